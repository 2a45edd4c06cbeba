//! The trajectory step on the wire (the `Warren-Step` header, in and out)
//! and the trajectory routes: the log of a sandbox and its replay.

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ApiError, ReplayReport, ReplayRequest, Trajectory, STEP_HEADER};
use warren_node::trajectory::{check_step, ExecAnswer, Stepped};
use warren_node::Node;

use crate::error::HttpError;
use crate::extract::ApiJson;
use crate::AppState;

type ApiResult<T> = Result<T, HttpError>;

/// The call's trajectory step from the `Warren-Step` header; `None` lets
/// the server assign the next one.
pub struct Step(pub Option<u64>);

impl<S: Send + Sync> FromRequestParts<S> for Step {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, HttpError> {
        let Some(value) = parts.headers.get(STEP_HEADER) else { return Ok(Step(None)) };
        let step = value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| ApiError::invalid("Warren-Step", "must be a decimal step number"))?;
        Ok(Step(Some(check_step(step)?)))
    }
}

/// `resp` with the step it was logged as in the `Warren-Step` header.
pub fn with_step(step: u64, resp: impl IntoResponse) -> Response {
    let mut resp = resp.into_response();
    resp.headers_mut().insert(HeaderName::from_static(STEP_HEADER), HeaderValue::from(step));
    resp
}

/// An exec step's answer: the live exec as usual, or the logged one
/// replayed (its recorded `started`, `output` and `end` frames, or with
/// `wait` its result) without running anything.
pub async fn exec_answer(answer: Stepped<ExecAnswer>, wait: bool) -> ApiResult<Response> {
    let resp = match answer.value {
        ExecAnswer::Live(entry) => crate::handlers::exec_answer(entry, wait).await?,
        ExecAnswer::Logged(result) if wait => Json(*result).into_response(),
        ExecAnswer::Logged(result) => crate::handlers::ndjson(futures_util::stream::iter(Node::logged_frames(*result))),
    };
    Ok(with_step(answer.step, resp))
}

/// The sandbox's trajectory: what it was made from and every mutating call
/// in step order. Kept after the sandbox ends, for the server's
/// `--trajectory-retention-secs`.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/trajectory", params(("id" = String, Path)),
    responses((status = 200, body = Trajectory), (status = 404, body = ApiError)))]
pub async fn get_trajectory(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<Trajectory>> {
    let node = s.node.clone();
    let trajectory = tokio::task::spawn_blocking(move || node.trajectory(&id))
        .await
        .map_err(|e| ApiError::new(warren_api::ErrorCode::Internal, e.to_string()))??;
    Ok(Json(trajectory))
}

/// Re-runs the trajectory step by step in a fresh sandbox made from the
/// same origin and reports for each step whether the result matches (exit
/// code, status and output digests for execs). Answers when the replay is
/// done.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/trajectory/replay", request_body = ReplayRequest, params(("id" = String, Path)),
    responses((status = 200, body = ReplayReport), (status = 400, body = ApiError), (status = 404, body = ApiError)))]
pub async fn replay_trajectory(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<ReplayRequest>,
) -> ApiResult<Json<ReplayReport>> {
    Ok(Json(s.node.replay_trajectory(&id, req).await?))
}

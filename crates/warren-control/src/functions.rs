//! `POST /v1/functions/run`: one stateless call in a fresh worker.

use axum::extract::State;
use axum::Json;
use warren_api::{ApiError, FunctionPoolList, FunctionResult, RunFunctionRequest};

use crate::error::HttpError;
use crate::extract::ApiJson;
use crate::AppState;

/// Runs code (in `language`) or a command in a fresh one-use worker of the
/// image's warm pool and answers once it ended, with its output, the
/// fetched files and where the time went. Calls beyond the pool's
/// concurrency wait in a bounded queue; a full queue answers 429
/// `queue_full`.
#[utoipa::path(post, path = "/v1/functions/run", request_body = RunFunctionRequest,
    responses((status = 200, body = FunctionResult), (status = 400, body = ApiError),
        (status = 429, description = "every worker is busy and the queue is full", body = ApiError)))]
pub async fn run_function(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<RunFunctionRequest>,
) -> Result<Json<FunctionResult>, HttpError> {
    Ok(Json(s.node.run_function(req).await?))
}

/// The warm pools of function workers: bounds, idle, busy and queued calls,
/// and the idle target that follows demand.
#[utoipa::path(get, path = "/v1/functions/pools", responses((status = 200, body = FunctionPoolList)))]
pub async fn list_function_pools(State(s): State<AppState>) -> Json<FunctionPoolList> {
    Json(FunctionPoolList { pools: s.node.function_pools() })
}

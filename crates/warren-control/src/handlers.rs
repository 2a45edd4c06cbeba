//! Handlers of the sandbox, exec, session and image routes. Each one parses,
//! calls the node once, and shapes the answer.

use std::collections::BTreeMap;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{Stream, StreamExt};
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};
use warren_api::*;

use crate::error::HttpError;
use crate::extract::{ApiJson, ApiQuery};
use crate::trajectory::{with_step, Step};
use crate::AppState;

type ApiResult<T> = Result<T, HttpError>;

pub const NDJSON: &str = "application/x-ndjson";

#[utoipa::path(get, path = "/v1/health", responses((status = 200, body = Health)))]
pub async fn health(State(s): State<AppState>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        sandboxes_running: s.node.sandboxes_running() as u64,
    })
}

pub async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], crate::openapi::document()).into_response()
}

pub async fn not_found() -> HttpError {
    HttpError(ApiError::new(ErrorCode::NotFound, "no such route"))
}

// ---- images ----------------------------------------------------------------

#[utoipa::path(get, path = "/v1/images", responses((status = 200, body = ImageList)))]
pub async fn list_images(State(s): State<AppState>) -> ApiResult<Json<ImageList>> {
    Ok(Json(ImageList { images: s.node.list_images().await? }))
}

/// Lazy-loading statistics: per cached layer and for the blob store.
#[utoipa::path(get, path = "/v1/images/stats", responses((status = 200, body = ImageStats)))]
pub async fn image_stats(State(s): State<AppState>) -> Json<ImageStats> {
    Json(s.node.image_stats())
}

/// Import a directory on the server's machine as a one-layer image.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ImportDirRequest {
    pub name: String,
    /// Absolute path on the server's host: a root filesystem directory, an
    /// OCI layout directory, or (for `docker_save`) a tarball file.
    #[serde(alias = "path")]
    pub dir: String,
    #[serde(default)]
    pub format: ImageFormat,
    /// Role of the imported layers (layered formats only; default `base`).
    #[serde(default)]
    pub role: Option<ImageLayerRole>,
}

#[utoipa::path(post, path = "/v1/images", request_body = ImportDirRequest,
    responses((status = 201, body = ImageInfo), (status = 400, body = ApiError)))]
pub async fn import_image_dir(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<ImportDirRequest>,
) -> ApiResult<(StatusCode, Json<ImageInfo>)> {
    let dir = std::path::PathBuf::from(&req.dir);
    let wants_file = req.format == ImageFormat::DockerSave;
    if !dir.is_absolute() || (wants_file && !dir.is_file()) || (!wants_file && !dir.is_dir()) {
        let what = if wants_file { "file" } else { "directory" };
        return Err(ApiError::invalid("dir", format!("must be an existing absolute {what} on the server")).into());
    }
    if req.format == ImageFormat::Dir && req.role.is_some() {
        return Err(ApiError::invalid("role", "roles apply to layered formats only").into());
    }
    let info = match req.format {
        ImageFormat::Dir => s.node.import_image_dir(req.name, dir).await?,
        ImageFormat::Erofs => s.node.import_image_layered(req.name, dir, req.role).await?,
        ImageFormat::OciLayout => s.node.import_image_oci(req.name, dir, false, req.role).await?,
        ImageFormat::DockerSave => s.node.import_image_oci(req.name, dir, true, req.role).await?,
    };
    Ok((StatusCode::CREATED, Json(info)))
}

#[utoipa::path(put, path = "/v1/images/{name}/tar", request_body(content = Vec<u8>, content_type = "application/x-tar"),
    params(("name" = String, Path)), responses((status = 201, body = ImageInfo), (status = 400, body = ApiError)))]
pub async fn import_image_tar(
    State(s): State<AppState>,
    Path(name): Path<String>,
    body: Body,
) -> ApiResult<(StatusCode, Json<ImageInfo>)> {
    let stream = body.into_data_stream().map(|r| r.map_err(std::io::Error::other));
    let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
    Ok((StatusCode::CREATED, Json(s.node.import_image_tar(name, reader).await?)))
}

// ---- sandboxes ---------------------------------------------------------------

// `POST /v1/sandboxes` (with its admission queue) is in `batch.rs`.

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// `key=value`; a sandbox must carry the label.
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub state: Option<SandboxState>,
}

#[utoipa::path(get, path = "/v1/sandboxes", params(ListQuery), responses((status = 200, body = SandboxList)))]
pub async fn list_sandboxes(
    State(s): State<AppState>,
    Extension(caller): Extension<warren_iam::Caller>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<Json<SandboxList>> {
    let mut labels = BTreeMap::new();
    if let Some(l) = q.label {
        let (k, v) = l.split_once('=').ok_or_else(|| ApiError::invalid("label", "must be key=value"))?;
        labels.insert(k.to_string(), v.to_string());
    }
    let mut sandboxes = s.node.list(&labels, q.state)?;
    if let Some(auth) = &s.auth {
        sandboxes.retain(|info| auth.iam.may_act_on_project(&caller, &info.project));
    }
    Ok(Json(SandboxList { sandboxes }))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiError)))]
pub async fn get_sandbox(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<SandboxInfo>> {
    Ok(Json(s.node.get(&id)?))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}", params(("id" = String, Path)),
    responses((status = 200, description = "ended (or had already ended)", body = SandboxInfo), (status = 404, body = ApiError)))]
pub async fn delete_sandbox(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<SandboxInfo>> {
    let info = s.node.delete(&id).await?;
    if let Some(auth) = &s.auth {
        // Its quota is free: creates waiting for it need not wait for their next look.
        auth.iam.room_changed();
    }
    Ok(Json(info))
}

/// `pack_diff`: snapshot the sandbox's writable layer into a new image.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pack", request_body = PackRequest, params(("id" = String, Path)),
    responses((status = 201, body = ImageInfo), (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 409, body = ApiError)))]
pub async fn pack_sandbox(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<PackRequest>,
) -> ApiResult<(StatusCode, Json<ImageInfo>)> {
    Ok((StatusCode::CREATED, Json(s.node.pack(&id, req).await?)))
}

/// Switch phase: later execs run under the phase's protected paths (and
/// its egress policy); by default every process of earlier phases is
/// killed first.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/phase", request_body = SetPhaseRequest, params(("id" = String, Path), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 200, body = SandboxInfo), (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 410, body = ApiError)))]
pub async fn set_phase(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Step(step): Step,
    ApiJson(req): ApiJson<SetPhaseRequest>,
) -> ApiResult<Response> {
    let done = s.node.set_phase_stepped(&id, req, step).await?;
    Ok(with_step(done.step, Json(done.value)))
}

/// Replace the egress policy of an `allowlist` sandbox, live: the next
/// connection or datagram of any of its sockets is judged by the new policy,
/// and packets of connections to destinations no longer allowed are dropped.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", request_body = warren_api::NetworkPolicy, params(("id" = String, Path), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 200, body = SandboxInfo), (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 410, body = ApiError)))]
pub async fn set_network(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Step(step): Step,
    ApiJson(policy): ApiJson<warren_api::NetworkPolicy>,
) -> ApiResult<Response> {
    let done = s.node.set_network_stepped(&id, policy, step).await?;
    Ok(with_step(done.step, Json(done.value)))
}

// ---- exec --------------------------------------------------------------------

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct ExecQuery {
    /// Answer once with the final result (and captured output) instead of streaming.
    #[serde(default)]
    pub wait: bool,
}

pub(crate) fn ndjson(frames: impl Stream<Item = ExecFrame> + Send + 'static) -> Response {
    let body = frames.map(|f| {
        let mut line = serde_json::to_vec(&f).unwrap_or_else(|_| b"{}".to_vec());
        line.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(line))
    });
    ([(header::CONTENT_TYPE, NDJSON)], Body::from_stream(body)).into_response()
}

pub(crate) async fn exec_answer(entry: std::sync::Arc<warren_node::ExecEntry>, wait: bool) -> ApiResult<Response> {
    if wait {
        entry.ended().await;
        return Ok(Json(entry.result(true)).into_response());
    }
    let first = ExecFrame::Started { exec_id: entry.id.clone() };
    Ok(ndjson(entry.stream(0, 0, Some(first))))
}

/// Streams NDJSON [`ExecFrame`]s: `started`, `output`/`gap`, then `end`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", request_body = ExecRequest, params(("id" = String, Path), ExecQuery, ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 200, description = "NDJSON stream of ExecFrame (or ExecResult with ?wait=true)", body = ExecFrame, content_type = "application/x-ndjson"),
        (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 410, body = ApiError)))]
pub async fn start_exec(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<ExecQuery>,
    Step(step): Step,
    ApiJson(req): ApiJson<ExecRequest>,
) -> ApiResult<Response> {
    let answer = s.node.exec_stepped(&id, req, None, step).await?;
    crate::trajectory::exec_answer(answer, q.wait).await
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/exec/{exec_id}", params(("id" = String, Path), ("exec_id" = String, Path)),
    responses((status = 200, body = ExecResult), (status = 404, body = ApiError)))]
pub async fn get_exec(
    State(s): State<AppState>,
    Path((id, exec_id)): Path<(String, String)>,
) -> ApiResult<Json<ExecResult>> {
    Ok(Json(s.node.exec_result(&id, &exec_id)?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/exec/{exec_id}/stream",
    params(("id" = String, Path), ("exec_id" = String, Path), ("stdout_offset" = Option<u64>, Query), ("stderr_offset" = Option<u64>, Query)),
    responses((status = 200, description = "NDJSON stream of ExecFrame from the offsets on", body = ExecFrame, content_type = "application/x-ndjson"),
        (status = 404, body = ApiError)))]
pub async fn resume_exec(
    State(s): State<AppState>,
    Path((id, exec_id)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<ResumeQuery>,
) -> ApiResult<Response> {
    Ok(ndjson(s.node.exec_stream(&id, &exec_id, q.stdout_offset, q.stderr_offset)?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec/{exec_id}/kill", params(("id" = String, Path), ("exec_id" = String, Path)),
    responses((status = 202, body = ExecResult), (status = 404, body = ApiError)))]
pub async fn kill_exec(
    State(s): State<AppState>,
    Path((id, exec_id)): Path<(String, String)>,
) -> ApiResult<(StatusCode, Json<ExecResult>)> {
    Ok((StatusCode::ACCEPTED, Json(s.node.kill_exec(&id, &exec_id)?)))
}

/// Security events: what the sandbox tried that the platform refused.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/events", params(("id" = String, Path), ("after_seq" = Option<u64>, Query)),
    responses((status = 200, body = SecurityEventList), (status = 404, body = ApiError), (status = 410, body = ApiError)))]
pub async fn list_events(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<EventsQuery>,
) -> ApiResult<Json<SecurityEventList>> {
    Ok(Json(s.node.events(&id, q.after_seq).await?))
}

// ---- sessions ------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions", request_body = CreateSessionRequest, params(("id" = String, Path), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 201, body = SessionInfo), (status = 400, body = ApiError), (status = 404, body = ApiError)))]
pub async fn create_session(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Step(step): Step,
    ApiJson(req): ApiJson<CreateSessionRequest>,
) -> ApiResult<Response> {
    let made = s.node.create_session_stepped(&id, req, step).await?;
    Ok(with_step(made.step, (StatusCode::CREATED, Json(made.value))))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/sessions", params(("id" = String, Path)), responses((status = 200, body = SessionList)))]
pub async fn list_sessions(State(s): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<SessionList>> {
    Ok(Json(SessionList { sessions: s.node.list_sessions(&id).await? }))
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/sessions/{sid}", params(("id" = String, Path), ("sid" = String, Path)),
    responses((status = 204), (status = 404, body = ApiError)))]
pub async fn delete_session(
    State(s): State<AppState>,
    Path((id, sid)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    s.node.delete_session(&id, &sid)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Runs a shell command in the session: its cwd and exports carry over to the next.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/sessions/{sid}/exec", request_body = ExecRequest,
    params(("id" = String, Path), ("sid" = String, Path), ExecQuery, ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 200, description = "as for exec", body = ExecFrame, content_type = "application/x-ndjson"), (status = 400, body = ApiError), (status = 404, body = ApiError)))]
pub async fn session_exec(
    State(s): State<AppState>,
    Path((id, sid)): Path<(String, String)>,
    ApiQuery(q): ApiQuery<ExecQuery>,
    Step(step): Step,
    ApiJson(req): ApiJson<ExecRequest>,
) -> ApiResult<Response> {
    let answer = s.node.exec_stepped(&id, req, Some(&sid), step).await?;
    crate::trajectory::exec_answer(answer, q.wait).await
}

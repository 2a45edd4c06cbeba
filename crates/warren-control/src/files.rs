//! File routes: streamed upload and download, stat, list, mkdir, remove.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::*;

use crate::error::HttpError;
use crate::extract::{ApiJson, ApiQuery};
use crate::trajectory::{with_step, Step};
use crate::AppState;

type ApiResult<T> = Result<T, HttpError>;

fn mode_of(mode: Option<&str>, default: u32) -> Result<u32, HttpError> {
    match mode {
        None => Ok(default),
        Some(m) => {
            parse_mode(m).ok_or_else(|| ApiError::invalid("mode", "must be octal permission bits like 644").into())
        }
    }
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), ("path" = String, Query)),
    responses((status = 200, description = "the file's bytes", content_type = "application/octet-stream"), (status = 404, body = ApiError), (status = 409, body = ApiError)))]
pub async fn download(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Response> {
    let (stream, len) = s.node.open_file(&id, q.path).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream".to_string()), (header::CONTENT_LENGTH, len.to_string())],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Streams the body into the file; it replaces the old one only once complete.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    params(("id" = String, Path), ("path" = String, Query), ("mode" = Option<String>, Query), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 200, body = FileStat), (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 507, body = ApiError)))]
pub async fn upload(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    Step(step): Step,
    body: Body,
) -> ApiResult<Response> {
    let mode = mode_of(q.mode.as_deref(), 0o644)?;
    let mut stream = body.into_data_stream();
    let written = match s.node.write_file_stepped(&id, q.path, mode, &mut stream, step).await {
        Ok(written) => written,
        Err(e) => {
            drain(&mut stream).await;
            return Err(e.into());
        }
    };
    Ok(with_step(written.step, Json(written.value)))
}

/// How much of a refused upload's body is still read, and for how long.
const DRAIN_BYTES: u64 = 256 << 20;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// An upload refused midway (a full disk) still reads the rest of its
/// body, within a bound, so that the client, still sending, gets to read
/// the refusal instead of a broken pipe.
async fn drain(stream: &mut axum::body::BodyDataStream) {
    use futures_util::StreamExt;
    let deadline = tokio::time::sleep(DRAIN_TIME);
    tokio::pin!(deadline);
    let mut left = DRAIN_BYTES;
    loop {
        tokio::select! {
            _ = &mut deadline => return,
            next = stream.next() => match next {
                Some(Ok(chunk)) if (chunk.len() as u64) < left => left -= chunk.len() as u64,
                _ => return,
            },
        }
    }
}

#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), ("path" = String, Query), ("recursive" = Option<bool>, Query), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 204), (status = 404, body = ApiError), (status = 409, body = ApiError)))]
pub async fn remove(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
    Step(step): Step,
) -> ApiResult<Response> {
    let removed = s.node.remove_file_stepped(&id, q.path, q.recursive, step).await?;
    Ok(with_step(removed.step, StatusCode::NO_CONTENT))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", params(("id" = String, Path), ("path" = String, Query)),
    responses((status = 200, body = FileStat), (status = 404, body = ApiError)))]
pub async fn stat(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Json<FileStat>> {
    Ok(Json(s.node.stat_file(&id, q.path).await?))
}

#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", params(("id" = String, Path), ("path" = String, Query)),
    responses((status = 200, body = FileList), (status = 404, body = ApiError), (status = 409, body = ApiError)))]
pub async fn list(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> ApiResult<Json<FileList>> {
    Ok(Json(s.node.list_dir(&id, q.path).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", request_body = MkdirRequest, params(("id" = String, Path), ("Warren-Step" = Option<u64>, Header, description = "trajectory step of this call")),
    responses((status = 201, body = FileStat), (status = 400, body = ApiError), (status = 409, body = ApiError)))]
pub async fn mkdir(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Step(step): Step,
    ApiJson(req): ApiJson<MkdirRequest>,
) -> ApiResult<Response> {
    let mode = mode_of(req.mode.as_deref(), 0o755)?;
    let made = s.node.mkdir_stepped(&id, req.path, mode, req.parents, step).await?;
    Ok(with_step(made.step, (StatusCode::CREATED, Json(made.value))))
}

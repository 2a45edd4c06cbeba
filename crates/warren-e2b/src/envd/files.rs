//! envd's plain HTTP file transfer: `GET /files?path=` streams a file out,
//! `POST /files?path=` writes one from an `application/octet-stream` body or
//! from the parts of a `multipart/form-data` body (the file name of a part
//! is its path when the query gives none). Missing parent directories are
//! made, as envd does.

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{Stream, TryStreamExt};
use serde::Deserialize;

use super::abs_path;
use crate::connect::{Code, ConnectError};
use crate::error::http_error;
use crate::multipart::{self, Multipart};
use crate::E2b;

/// Mode of files written through `/files`.
const FILE_MODE: u32 = 0o644;

#[derive(Debug, Default, Deserialize)]
pub struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
    /// envd runs the transfer as this user; Warren's sandboxes run as root.
    #[serde(default)]
    #[allow(dead_code)]
    username: Option<String>,
}

fn sandbox(headers: &HeaderMap) -> Result<String, ConnectError> {
    crate::sandbox_id(headers).ok_or_else(|| ConnectError::new(Code::InvalidArgument, "no E2b-Sandbox-Id"))
}

pub async fn download(State(state): State<E2b>, headers: HeaderMap, Query(q): Query<FilesQuery>) -> Response {
    let run = async {
        let id = sandbox(&headers)?;
        let path = q
            .path
            .filter(|p| !p.is_empty())
            .ok_or_else(|| ConnectError::new(Code::InvalidArgument, "path is required"))?;
        // Exactly the length announced, even if the sandbox grows the file meanwhile.
        let (stream, len) = state.node.open_file(&id, abs_path(&path)).await?;
        Ok::<_, ConnectError>(
            (
                StatusCode::OK,
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::CONTENT_LENGTH, len.to_string()),
                ],
                Body::from_stream(stream),
            )
                .into_response(),
        )
    };
    run.await.unwrap_or_else(|e| http_error(&e))
}

pub async fn upload(State(state): State<E2b>, headers: HeaderMap, Query(q): Query<FilesQuery>, body: Body) -> Response {
    upload_inner(&state, &headers, q, body).await.unwrap_or_else(|e| http_error(&e))
}

async fn upload_inner(state: &E2b, headers: &HeaderMap, q: FilesQuery, body: Body) -> Result<Response, ConnectError> {
    let id = sandbox(headers)?;
    if headers.get(header::CONTENT_ENCODING).is_some_and(|v| v.as_bytes() != b"identity") {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            "compressed uploads (Content-Encoding) are not supported",
        ));
    }
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let query_path = q.path.filter(|p| !p.is_empty());
    let stream = body.into_data_stream();
    let mut written = Vec::new();
    if let Some(boundary) = multipart::boundary(content_type) {
        let mut parts = Multipart::new(stream, &boundary);
        while let Some(part) = parts.next_part().await.map_err(bad_body)? {
            let Some(path) = query_path.clone().or(part.filename.clone()).filter(|p| !p.is_empty()) else {
                // A form field that is not a file: skipped, as envd does.
                continue;
            };
            let data = futures_util::stream::unfold(&mut parts, |p| async move {
                match p.read_chunk().await {
                    Ok(Some(chunk)) => Some((Ok(chunk), p)),
                    Ok(None) => None,
                    Err(e) => Some((Err(e), p)),
                }
            });
            written.push(write(state, &id, &path, data).await?);
        }
    } else {
        let path = query_path.ok_or_else(|| ConnectError::new(Code::InvalidArgument, "path is required"))?;
        written.push(write(state, &id, &path, stream.map_err(|e| e.to_string())).await?);
    }
    Ok(Json(written).into_response())
}

fn bad_body(e: multipart::MultipartError) -> ConnectError {
    ConnectError::new(Code::InvalidArgument, e.to_string())
}

async fn write<E: std::fmt::Display>(
    state: &E2b,
    id: &str,
    path: &str,
    data: impl Stream<Item = Result<bytes::Bytes, E>> + Send,
) -> Result<serde_json::Value, ConnectError> {
    let path = abs_path(path);
    if let Some((parent, _)) = path.rsplit_once('/').filter(|(p, _)| !p.is_empty()) {
        // Made (and logged as a step) only when missing.
        if let Err(warren_node::NodeError::File(warren_node::FileError::NotFound)) =
            state.node.stat_file(id, parent.to_string()).await
        {
            state.node.mkdir_stepped(id, parent.to_string(), 0o755, true, None).await?;
        }
    }
    let st = state.node.write_file_stepped(id, path, FILE_MODE, data, None).await?.value;
    let name = st.path.rsplit('/').next().unwrap_or("").to_string();
    Ok(serde_json::json!({ "name": name, "type": "file", "path": st.path }))
}

//! Batch creation, the queued single create, pause and resume, and the
//! node's capacity books.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use utoipa::IntoParams;
use warren_api::*;
use warren_iam::Caller;
use warren_node::{BatchEvent, NodeError};

use crate::error::HttpError;
use crate::extract::{ApiJson, ApiQuery};
use crate::handlers::NDJSON;
use crate::AppState;

/// An admission refusal: `queue_full` carries the queue's bound in its body;
/// everything else answers as any other error.
pub(crate) fn refusal(e: NodeError) -> Response {
    match e {
        NodeError::AdmissionQueueFull { limit } => {
            let body = QueueFullError {
                code: ErrorCode::QueueFull,
                message: format!("the admission queue is full: {limit} creates wait already; retry later"),
                field: Some("queue".into()),
                queue_limit: limit as u64,
            };
            (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response()
        }
        other => HttpError::from(other).into_response(),
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CreateQuery {
    /// Wait in the node's admission queue while it is full, instead of
    /// answering 503 `capacity_exceeded` at once.
    #[serde(default)]
    pub queue: bool,
}

/// Makes a sandbox. With `?queue=true` a full node makes the call wait its
/// turn in the admission queue (429 `queue_full` when that is full too).
#[utoipa::path(post, path = "/v1/sandboxes", request_body = CreateSandboxRequest, params(CreateQuery),
    responses((status = 201, description = "made", body = SandboxInfo),
        (status = 200, description = "an earlier call with this idempotency key made it", body = SandboxInfo),
        (status = 400, body = ApiError), (status = 409, body = ApiError), (status = 429, body = QueueFullError),
        (status = 501, body = ApiError), (status = 503, body = ApiError)))]
pub async fn create_sandbox(
    State(s): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiQuery(q): ApiQuery<CreateQuery>,
    ApiJson(mut req): ApiJson<CreateSandboxRequest>,
) -> Response {
    if let Err(e) = req.validate() {
        return HttpError(e).into_response();
    }
    let new = crate::auth::new_sandboxes(&s, [req.idempotency_key.as_deref()]);
    let _quota = match crate::auth::admit_create(&s, &caller, &mut req, new, q.queue, "project").await {
        Ok(admitted) => admitted,
        Err(refused) => return crate::auth::iam_error(refused),
    };
    let made = if q.queue { s.node.create_queued(req).await } else { s.node.create(req).await };
    match made {
        Ok((info, made)) => (if made { StatusCode::CREATED } else { StatusCode::OK }, Json(info)).into_response(),
        Err(e) => refusal(e),
    }
}

/// Makes `count` sandboxes from one template. Answers an NDJSON stream of
/// [`BatchFrame`]s: `queued` while items wait for room, one `item` per
/// sandbox (a failed item carries its error and fails alone), then `done`.
#[utoipa::path(post, path = "/v1/sandboxes/batch", request_body = BatchCreateRequest,
    responses((status = 200, description = "NDJSON stream of BatchFrame", body = BatchFrame, content_type = "application/x-ndjson"),
        (status = 400, body = ApiError), (status = 429, body = QueueFullError)))]
pub async fn create_batch(
    State(s): State<AppState>,
    Extension(caller): Extension<Caller>,
    ApiJson(mut req): ApiJson<BatchCreateRequest>,
) -> Response {
    if let Err(e) = req.validate() {
        return HttpError(e).into_response();
    }
    // Items whose keys a first send of this batch claimed are retries: no quota.
    let new: std::collections::BTreeSet<u32> = (0..req.count)
        .filter(|&i| crate::auth::new_sandboxes(&s, [req.item(i).idempotency_key.as_deref()]) == 1)
        .collect();
    let count = new.len() as u64;
    let quota =
        match crate::auth::admit_create(&s, &caller, &mut req.template, count, req.queue, "template.project").await {
            Ok(admitted) => admitted,
            Err(refused) => return crate::auth::iam_error(refused),
        };
    let mut events = match s.node.create_batch(req) {
        Ok(rx) => rx,
        Err(e) => return refusal(e),
    };
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<BatchFrame>();
    tokio::spawn(async move {
        let (mut made, mut existing, mut failed) = (0, 0, 0);
        while let Some(event) = events.recv().await {
            if let (BatchEvent::Item { index, .. }, Some(quota)) = (&event, &quota) {
                if new.contains(index) {
                    // The item is live (and counted as such) or failed: its reserved room goes back.
                    quota.release_one();
                }
            }
            let frame = match event {
                BatchEvent::Queued { position, items_waiting } => BatchFrame::Queued { position, items_waiting },
                BatchEvent::Item { index, result } => match *result {
                    Ok((info, fresh)) => {
                        *(if fresh { &mut made } else { &mut existing }) += 1;
                        BatchFrame::Item { index, sandbox: Some(Box::new(info)), made: fresh, error: None }
                    }
                    Err(e) => {
                        failed += 1;
                        BatchFrame::Item { index, sandbox: None, made: false, error: Some(HttpError::from(e).0) }
                    }
                },
            };
            // A client that went away stops only its stream; the batch runs on.
            let _ = tx.send(frame);
        }
        let _ = tx.send(BatchFrame::Done { made, existing, failed });
    });
    let frames = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let body = frames.map(|f| {
        let mut line = serde_json::to_vec(&f).unwrap_or_else(|_| b"{}".to_vec());
        line.push(b'\n');
        Ok::<_, Infallible>(Bytes::from(line))
    });
    ([(header::CONTENT_TYPE, NDJSON)], Body::from_stream(body)).into_response()
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PauseQuery {
    /// `microvm`, `vm`: write the guest's memory to disk and stop its QEMU (the
    /// memory is freed); the resume loads it back. Running execs end (their
    /// processes are killed); every other process and file stays. Other
    /// backends answer 501 `unsupported`.
    #[serde(default)]
    pub to_disk: bool,
}

/// Freezes the sandbox: its processes make no progress until it is
/// resumed, explicitly or by the next exec, session command, file or
/// events call. The lifetime keeps counting; the idle timeout does not.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", params(("id" = String, Path), PauseQuery),
    responses((status = 200, body = SandboxInfo), (status = 400, body = ApiError), (status = 404, body = ApiError), (status = 410, body = ApiError), (status = 501, body = ApiError)))]
pub async fn pause_sandbox(
    State(s): State<AppState>,
    Path(id): Path<String>,
    ApiQuery(q): ApiQuery<PauseQuery>,
) -> Result<Json<SandboxInfo>, HttpError> {
    Ok(Json(s.node.pause_with(&id, q.to_disk).await?))
}

#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", params(("id" = String, Path)),
    responses((status = 200, body = SandboxInfo), (status = 404, body = ApiError), (status = 410, body = ApiError), (status = 501, body = ApiError)))]
pub async fn resume_sandbox(State(s): State<AppState>, Path(id): Path<String>) -> Result<Json<SandboxInfo>, HttpError> {
    Ok(Json(s.node.resume(&id).await?))
}

/// The node's capacity books: live and paused sandboxes, committed and
/// reclaimable (paused) memory, and the admission queue.
#[utoipa::path(get, path = "/v1/capacity", responses((status = 200, body = NodeBooks)))]
pub async fn capacity(State(s): State<AppState>) -> Json<NodeBooks> {
    Json(s.node.books())
}

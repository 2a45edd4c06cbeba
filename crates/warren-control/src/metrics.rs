//! Observability routes: `GET /metrics` (Prometheus text, or OpenMetrics
//! when the scraper asks for it), `GET /v1/stats` (the same numbers as
//! JSON for the dashboard) and a sandbox's exec history.

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ExecList, NodeStats};
use warren_node::metrics::{Format, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE};

use crate::error::HttpError;
use crate::AppState;

/// The text format a scraper asked for, and its `Content-Type`:
/// Prometheus text format 0.0.4 unless `Accept` names OpenMetrics.
pub fn negotiate(headers: &HeaderMap) -> (Format, &'static str) {
    let wants_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    match wants_openmetrics {
        true => (Format::OpenMetrics, OPENMETRICS_CONTENT_TYPE),
        false => (Format::Prometheus, PROMETHEUS_CONTENT_TYPE),
    }
}

/// `GET /metrics`: the node's registry in the negotiated format.
pub async fn metrics(State(s): State<AppState>, headers: HeaderMap) -> Response {
    let (format, content_type) = negotiate(&headers);
    let node = s.node.clone();
    // Reading the image cache's counters walks its layers: off the runtime.
    match tokio::task::spawn_blocking(move || node.metrics_text(format)).await {
        Ok(text) => ([(header::CONTENT_TYPE, content_type)], text).into_response(),
        Err(e) => HttpError(warren_api::ApiError::new(warren_api::ErrorCode::Internal, e.to_string())).into_response(),
    }
}

/// The node at a glance: sandboxes by state, capacity used, creates and
/// their latency, execs, end reasons, security events, image fetches.
#[utoipa::path(get, path = "/v1/stats", responses((status = 200, body = NodeStats)))]
pub async fn stats(State(s): State<AppState>) -> Json<NodeStats> {
    Json(s.node.stats())
}

/// The sandbox's execs by start time, without output; kept as long as the
/// sandbox's record is.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/exec", params(("id" = String, Path)),
    responses((status = 200, body = ExecList), (status = 404, body = warren_api::ApiError)))]
pub async fn list_execs(State(s): State<AppState>, Path(id): Path<String>) -> Result<Json<ExecList>, HttpError> {
    Ok(Json(ExecList { execs: s.node.list_execs(&id)? }))
}

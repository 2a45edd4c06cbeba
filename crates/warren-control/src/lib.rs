//! The API server: Warren's HTTP API v1 in front of the node agent.
//!
//! Owns: routes, request parsing (every rejection names the field), the one
//! mapping from internal errors to HTTP codes, NDJSON streaming, and the
//! OpenAPI document; `GET /metrics` (the node's registry as Prometheus text)
//! and the `/ui` dashboard, whose static assets are compiled in. In the
//! embedded mode it talks to one in-process node.
//! Never: holds sandbox state of its own, or reaches past the node to a
//! backend.

mod auth;
mod batch;
mod error;
mod extract;
mod files;
mod functions;
mod handlers;
mod images;
mod metrics;
pub mod openapi;
mod projects;
mod trajectory;
mod ui;

use std::future::Future;

use axum::http::{header, HeaderValue};
use axum::routing::{get, post};
use axum::Router;
use warren_node::Node;

pub use auth::{caller_of, iam_error, resolve_project, sandbox_id, Auth};
pub use error::HttpError;
pub use metrics::negotiate as metrics_format;
pub use projects::{routes as iam_routes, IamRoutes};
pub use ui::routes as ui_routes;
pub use warren_e2b::E2bConfig;

#[derive(Clone)]
pub struct AppState {
    pub node: Node,
    /// IAM (projects, keys, quotas); `None`: every request acts as the root
    /// project and the project routes answer `unsupported`.
    pub auth: Option<Auth>,
}

/// The complete v1 router, without IAM.
pub fn router(node: Node) -> Router {
    router_with_auth(node, None)
}

/// The complete v1 router; every route passes [`auth::authorize`].
pub fn router_with_auth(node: Node, auth: Option<Auth>) -> Router {
    use handlers::*;
    let state = AppState { node, auth };
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/stats", get(metrics::stats))
        .route("/metrics", get(metrics::metrics))
        .merge(ui::routes())
        .route("/v1/openapi.json", get(openapi_json))
        .route("/v1/images", get(list_images).post(import_image_dir))
        .route("/v1/images/stats", get(image_stats))
        .route("/v1/images/pull", post(images::pull_image))
        .route("/v1/images/compose", post(images::compose_image))
        .route("/v1/images/gc", post(images::gc_images))
        .route("/v1/images/{name}", get(images::inspect_image).delete(images::remove_image))
        .route("/v1/images/{name}/push", post(images::push_image))
        .route("/v1/images/{name}/tar", axum::routing::put(import_image_tar))
        .route("/v1/capacity", get(batch::capacity))
        .route("/v1/sandboxes", post(batch::create_sandbox).get(list_sandboxes))
        .route("/v1/sandboxes/batch", post(batch::create_batch))
        .route("/v1/sandboxes/{id}/pause", post(batch::pause_sandbox))
        .route("/v1/sandboxes/{id}/resume", post(batch::resume_sandbox))
        .route("/v1/functions/run", post(functions::run_function))
        .route("/v1/functions/pools", get(functions::list_function_pools))
        .route("/v1/sandboxes/{id}", get(get_sandbox).delete(delete_sandbox))
        .route("/v1/sandboxes/{id}/pack", post(pack_sandbox))
        .route("/v1/sandboxes/{id}/image-stats", get(images::sandbox_image_stats))
        .route("/v1/sandboxes/{id}/phase", axum::routing::put(set_phase))
        .route("/v1/sandboxes/{id}/network", axum::routing::put(set_network))
        .route("/v1/sandboxes/{id}/events", get(list_events))
        .route("/v1/sandboxes/{id}/trajectory", get(trajectory::get_trajectory))
        .route("/v1/sandboxes/{id}/trajectory/replay", post(trajectory::replay_trajectory))
        .route("/v1/sandboxes/{id}/exec", post(start_exec).get(metrics::list_execs))
        .route("/v1/sandboxes/{id}/exec/{exec_id}", get(get_exec))
        .route("/v1/sandboxes/{id}/exec/{exec_id}/stream", get(resume_exec))
        .route("/v1/sandboxes/{id}/exec/{exec_id}/kill", post(kill_exec))
        .route("/v1/sandboxes/{id}/sessions", post(create_session).get(list_sessions))
        .route("/v1/sandboxes/{id}/sessions/{sid}", axum::routing::delete(delete_session))
        .route("/v1/sandboxes/{id}/sessions/{sid}/exec", post(session_exec))
        .route("/v1/sandboxes/{id}/files", get(files::download).put(files::upload).delete(files::remove))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .merge(projects::routes())
        .fallback(handlers::not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth::authorize))
        .with_state(state)
        .layer(axum::middleware::from_fn(close_after_refused_body))
}

/// A request refused while its body was still arriving (an upload onto a
/// full disk) leaves that body partly unread, and hyper then closes the
/// connection; a client that already took the connection back into its
/// pool would send its next request into that close. Saying
/// `Connection: close` on the refusal keeps the connection out of the pool.
async fn close_after_refused_body(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let has_body = request.headers().contains_key(header::TRANSFER_ENCODING)
        || request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim() != "0");
    let mut response = next.run(request).await;
    if has_body && (response.status().is_client_error() || response.status().is_server_error()) {
        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Serves until `shutdown` resolves, then stops accepting and drains.
pub async fn serve(
    listener: tokio::net::TcpListener,
    node: Node,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(node)).with_graceful_shutdown(shutdown).await
}

/// The v1 router plus the E2B-compatible control API and envd routes
/// (`warren-e2b`; none of them starts with `/v1/`).
pub fn router_with_e2b(node: Node, e2b: E2bConfig) -> Router {
    router(node.clone()).merge(warren_e2b::router(node, e2b).layer(axum::middleware::from_fn(close_after_refused_body)))
}

/// [`router_with_e2b`] with IAM in front of the v1 routes. The E2B routes
/// keep their own `X-API-KEY` check and see every project's sandboxes, so
/// with auth required and no E2B key configured (which would leave them
/// open to anyone) they are not served at all.
pub fn router_with_e2b_and_auth(node: Node, e2b: E2bConfig, auth: Option<Auth>) -> Router {
    let e2b_open = e2b.api_keys.is_empty();
    let required = auth.as_ref().is_some_and(|a| a.required);
    let v1 = router_with_auth(node.clone(), auth);
    if required && e2b_open {
        tracing::warn!("auth is on and no --e2b-api-key is set: the E2B-compatible API is off");
        return v1;
    }
    v1.merge(warren_e2b::router(node, e2b).layer(axum::middleware::from_fn(close_after_refused_body)))
}

/// Serves `app` until `shutdown` resolves, then stops accepting and drains.
pub async fn serve_router(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// [`serve`] with the E2B-compatible routes on the same listener.
pub async fn serve_with_e2b(
    listener: tokio::net::TcpListener,
    node: Node,
    e2b: E2bConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router_with_e2b(node, e2b)).with_graceful_shutdown(shutdown).await
}

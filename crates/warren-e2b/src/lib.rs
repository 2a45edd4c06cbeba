//! E2B compatibility: the E2B control API and the in-sandbox agent protocol
//! ("envd", Connect with the JSON codec) translated onto [`warren_node::Node`],
//! so the official `e2b` SDK works against `warren serve` unchanged.
//!
//! Owns: E2B's wire formats (field names, status codes, error bodies,
//! Connect envelopes), the mapping of templates/metadata/timeouts onto
//! Warren's create request, and the envd process table (E2B names processes
//! by pid; Warren by exec id).
//! Invariant: every operation is a call on the node - the same exec, file
//! and lifecycle code the v1 API uses - so limits, guards and end reasons
//! apply to both front doors alike.
//! Never: keeps sandbox state of its own beyond that process table, or
//! reaches past the node to a backend.
//!
//! Routing: control routes (`/sandboxes...`, `/v2/sandboxes...`) need
//! `X-API-KEY`; envd routes (`/process.Process/*`, `/filesystem.Filesystem/*`,
//! `/files`, `/health`) are the ones a request with an `E2b-Sandbox-Id`
//! header reaches, which is how the SDK talks to a sandbox when
//! `E2B_SANDBOX_URL` points at Warren. See `docs/e2b.md`.

pub mod connect;
mod control;
mod envd;
mod error;
mod multipart;
mod time;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use sha2::{Digest, Sha256};
use warren_node::Node;

pub use error::ControlError;

/// The envd version Warren reports: the SDK gates features on it (0.5.2:
/// closing stdin; 0.5.7: octet-stream uploads). File metadata (0.6.2,
/// extended attributes) is not served, so the version stays below it.
pub const ENVD_VERSION: &str = "0.5.7";
/// The E2B template the SDK asks for when none is given.
pub const SDK_DEFAULT_TEMPLATE: &str = "base";
/// The user's home in E2B templates: relative paths and commands without a
/// working directory start here; Warren makes it in every E2B sandbox.
pub const HOME: &str = "/home/user";
/// The header that marks a request for a sandbox's envd.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";

/// How the E2B front door is set up (`warren serve --e2b-*`).
#[derive(Debug, Clone, Default)]
pub struct E2bConfig {
    /// Accepted `X-API-KEY` values; empty: the key is not checked (like the
    /// v1 API, which has no authentication in the embedded mode).
    pub api_keys: Vec<String>,
    /// The Warren image a sandbox gets when its template is E2B's default
    /// (`base`) or empty.
    pub default_template: String,
}

#[derive(Clone)]
pub(crate) struct E2b {
    pub node: Node,
    pub cfg: Arc<E2bConfig>,
    pub procs: Arc<envd::process::Table>,
}

impl E2b {
    /// The envd access token of a sandbox made with `api_key`: a digest of
    /// the key and the id, so envd requests are checked without state.
    fn envd_token(api_key: &str, sandbox_id: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"warren-e2b-envd\0");
        h.update(api_key.as_bytes());
        h.update(b"\0");
        h.update(sandbox_id.as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The token to hand out with a sandbox, when keys are configured.
    pub fn token_for(&self, headers: &HeaderMap, sandbox_id: &str) -> Option<String> {
        if self.cfg.api_keys.is_empty() {
            return None;
        }
        let key = headers.get("x-api-key")?.to_str().ok()?;
        Some(E2b::envd_token(key, sandbox_id))
    }

    fn api_key_ok(&self, headers: &HeaderMap) -> bool {
        if self.cfg.api_keys.is_empty() {
            return true;
        }
        let Some(given) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) else { return false };
        self.cfg.api_keys.iter().any(|k| constant_time_eq(k.as_bytes(), given.as_bytes()))
    }

    fn access_token_ok(&self, headers: &HeaderMap, sandbox_id: &str) -> bool {
        if self.cfg.api_keys.is_empty() {
            return true;
        }
        let Some(given) = headers.get("x-access-token").and_then(|v| v.to_str().ok()) else { return false };
        self.cfg.api_keys.iter().any(|k| constant_time_eq(E2b::envd_token(k, sandbox_id).as_bytes(), given.as_bytes()))
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The E2B routes (control API and envd), ready to merge into the v1 router:
/// none of them starts with `/v1/`.
pub fn router(node: Node, cfg: E2bConfig) -> Router {
    let state = E2b { node, cfg: Arc::new(cfg), procs: Arc::new(envd::process::Table::default()) };
    let control = Router::new()
        .route("/sandboxes", post(control::create_v1).get(control::list_v1))
        .route("/v2/sandboxes", post(control::create_v2).get(control::list_v2))
        .route("/sandboxes/{id}", get(control::get_sandbox).delete(control::kill))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/sandboxes/{id}/resume", post(control::resume))
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/refreshes", post(control::refresh))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_api_key));
    let envd = Router::new()
        .route("/process.Process/{method}", post(envd::process::call))
        .route("/filesystem.Filesystem/{method}", post(envd::filesystem::call))
        .route("/files", get(envd::files::download).post(envd::files::upload))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_sandbox));
    // `/health` is on both doors: envd's (204) when a sandbox is named,
    // the control API's otherwise.
    let health = Router::new().route("/health", get(health));
    control.merge(envd).merge(health).with_state(state)
}

async fn health(State(state): State<E2b>, headers: HeaderMap) -> Response {
    match sandbox_id(&headers) {
        Some(id) => match state.node.get(&id) {
            Ok(info) if info.state != warren_api::SandboxState::Ended => {
                axum::http::StatusCode::NO_CONTENT.into_response()
            }
            _ => error::http_error(&error::sandbox_gone(&id)),
        },
        None => (axum::http::StatusCode::OK, "Health check successful").into_response(),
    }
}

/// The sandbox an envd request is for.
pub(crate) fn sandbox_id(headers: &HeaderMap) -> Option<String> {
    let id = headers.get(SANDBOX_ID_HEADER)?.to_str().ok()?.trim();
    (!id.is_empty()).then(|| id.to_string())
}

async fn require_api_key(State(state): State<E2b>, req: Request, next: Next) -> Response {
    if !state.api_key_ok(req.headers()) {
        return ControlError::new(axum::http::StatusCode::UNAUTHORIZED, "Invalid API key, please visit docs/e2b.md")
            .into_response();
    }
    next.run(req).await
}

async fn require_sandbox(State(state): State<E2b>, req: Request, next: Next) -> Response {
    let Some(id) = sandbox_id(req.headers()) else {
        let e = connect::ConnectError::new(
            connect::Code::InvalidArgument,
            "envd requests name their sandbox in the `E2b-Sandbox-Id` header",
        );
        return error::http_error(&e);
    };
    if !state.access_token_ok(req.headers(), &id) {
        let e = connect::ConnectError::new(connect::Code::Unauthenticated, "missing or wrong X-Access-Token");
        return error::http_error(&e);
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envd_tokens_bind_key_and_sandbox() {
        let a = E2b::envd_token("k1", "sb-1");
        assert_eq!(a, E2b::envd_token("k1", "sb-1"));
        assert_ne!(a, E2b::envd_token("k2", "sb-1"));
        assert_ne!(a, E2b::envd_token("k1", "sb-2"));
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn constant_time_eq_compares_whole_values() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}

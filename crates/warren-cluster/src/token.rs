//! The cluster token: the shared secret with which API servers prove
//! themselves to node agents. A node answers sandbox operations only to a
//! request carrying it in [`HEADER`]; users never see it (they talk to API
//! servers, which authenticate them separately).

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ApiError, ErrorCode};

use crate::ClusterError;

/// The request header carrying the token, API server -> node.
pub const HEADER: &str = "warren-cluster-token";
/// Shorter tokens are refused: they could be guessed.
const MIN_BYTES: usize = 16;

/// The token, read once from its file.
#[derive(Clone)]
pub struct ClusterToken(Arc<str>);

impl std::fmt::Debug for ClusterToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterToken(..)")
    }
}

impl ClusterToken {
    /// Reads the token (surrounding whitespace trimmed) from `path`, which
    /// must not be readable by group or others.
    pub fn read(path: &Path) -> Result<ClusterToken, ClusterError> {
        let fail = |message: String| ClusterError::Token { path: path.display().to_string(), message };
        let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
        if std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o077 != 0 {
            return Err(fail("must not be readable by group or others (chmod 600)".into()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
        ClusterToken::new(text.trim()).map_err(fail)
    }

    pub fn new(token: &str) -> Result<ClusterToken, String> {
        if token.len() < MIN_BYTES || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(format!("the token must be at least {MIN_BYTES} printable ASCII characters"));
        }
        Ok(ClusterToken(token.into()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Compares in time independent of where the first difference is.
    pub fn matches(&self, offered: &[u8]) -> bool {
        let ours = self.0.as_bytes();
        let mut diff = ours.len() ^ offered.len();
        for (i, b) in ours.iter().enumerate() {
            diff |= usize::from(b ^ offered.get(i).copied().unwrap_or(0));
        }
        diff == 0
    }
}

/// Node-side middleware: everything but `GET /v1/health` needs the token.
pub async fn require_token(State(token): State<ClusterToken>, request: Request, next: Next) -> Response {
    if request.uri().path() == "/v1/health" {
        return next.run(request).await;
    }
    match request.headers().get(HEADER) {
        Some(offered) if token.matches(offered.as_bytes()) => next.run(request).await,
        _ => {
            let error = ApiError::new(
                ErrorCode::Unauthorized,
                "this is a cluster node: it answers only API servers holding the cluster token",
            );
            (axum::http::StatusCode::UNAUTHORIZED, Json(error)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        let token = ClusterToken::new("0123456789abcdef-secret").unwrap();
        assert!(token.matches(b"0123456789abcdef-secret"));
        assert!(!token.matches(b"0123456789abcdef-secreT"));
        assert!(!token.matches(b"0123456789abcdef-secret2"));
        assert!(!token.matches(b"0123456789abcdef-secre"));
        assert!(!token.matches(b""));
        assert!(ClusterToken::new("short").is_err());
        assert!(ClusterToken::new("has a space in it, long enough").is_err());
    }

    #[test]
    fn a_token_file_others_can_read_is_refused() {
        let dir = std::env::temp_dir().join(format!("warren-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "0123456789abcdef-secret\n").unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        assert!(ClusterToken::read(&path).unwrap_err().to_string().contains("chmod 600"));
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
        assert_eq!(ClusterToken::read(&path).unwrap().as_str(), "0123456789abcdef-secret");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

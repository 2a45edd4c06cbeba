//! The one error body every non-2xx answer carries.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Machine-readable error code. The HTTP status is derived from it in one
/// place ([`ErrorCode::http_status`]) so the mapping cannot drift.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request body or a parameter is malformed or out of range; `field` names it.
    InvalidRequest,
    /// The backend exists in the API but this server cannot run it yet.
    UnsupportedBackend,
    /// The operation exists but the sandbox's backend cannot perform it.
    Unsupported,
    NotFound,
    /// No credentials, or credentials this server does not accept.
    Unauthorized,
    /// The sandbox has ended; `message` carries the end reason.
    SandboxEnded,
    /// The idempotency key was used before with a different request.
    IdempotencyConflict,
    /// The node has no room for the sandbox right now.
    CapacityExceeded,
    /// A path inside the sandbox does not exist.
    FileNotFound,
    /// A path inside the sandbox exists where it must not, or has the wrong type.
    FileConflict,
    /// The sandbox's writable layer is full.
    NoSpace,
    ImageNotFound,
    /// The image is used by running sandboxes or a warm pool and cannot be replaced now.
    ImageInUse,
    /// The image registry could not be reached or failed; `message` says how.
    RegistryUnavailable,
    /// The image registry wants credentials and the request gave none
    /// (`auth`, or the node's registry credentials file).
    RegistryAuthRequired,
    /// The image registry refused the credentials given (wrong password,
    /// or no access to the repository). Never echoes the password.
    RegistryAuthFailed,
    /// The state store (etcd in a cluster) cannot be reached: nothing was
    /// changed that the caller cannot retry with the same idempotency key.
    StoreUnavailable,
    /// Cluster mode: the sandbox's node does not answer right now (its
    /// sandbox may still run; it ends `node_lost` if the node is lost).
    NodeUnavailable,
    /// The sandbox is at one of its own limits (its pids limit is full):
    /// the same request may succeed once its processes end. `field` names
    /// the limit.
    LimitReached,
    /// Every worker is busy and the admission queue is full: retry later.
    /// For sandbox creates the body is a `QueueFullError` with `queue_limit`.
    QueueFull,
    /// The call's trajectory step is logged with a different request;
    /// `divergence` has the step and both hashes.
    TrajectoryDiverged,
    /// The caller's key may not use this route at all: node-wide
    /// administration (image changes, node statistics) needs a key of the
    /// root project. (Another project's sandbox answers `not_found`.)
    Forbidden,
    /// A create would take a project past a quota; the body is a
    /// `QuotaExceededError` naming the project and the quota.
    QuotaExceeded,
    /// The server gave up on work of its own that took too long (a create
    /// past the node's create timeout): what it had made is removed, and
    /// the same request may be sent again.
    TimedOut,
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest => 400,
            ErrorCode::UnsupportedBackend | ErrorCode::Unsupported => 501,
            ErrorCode::NotFound | ErrorCode::FileNotFound | ErrorCode::ImageNotFound => 404,
            ErrorCode::SandboxEnded => 410,
            ErrorCode::Forbidden => 403,
            ErrorCode::Unauthorized => 401,
            ErrorCode::IdempotencyConflict
            | ErrorCode::FileConflict
            | ErrorCode::ImageInUse
            | ErrorCode::TrajectoryDiverged => 409,
            ErrorCode::CapacityExceeded => 503,
            ErrorCode::LimitReached | ErrorCode::QueueFull | ErrorCode::QuotaExceeded => 429,
            ErrorCode::NoSpace => 507,
            ErrorCode::RegistryUnavailable => 502,
            // Not 401: that answer is about the caller's own credentials
            // for this API, these are about the registry's.
            ErrorCode::RegistryAuthRequired | ErrorCode::RegistryAuthFailed => 403,
            ErrorCode::StoreUnavailable | ErrorCode::NodeUnavailable => 503,
            ErrorCode::TimedOut => 504,
            ErrorCode::Internal => 500,
        }
    }
}

/// `{code, message, field?}`: the body of every 4xx and 5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, thiserror::Error)]
#[error("{code:?}: {message}")]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    /// The request field (dotted path) the error is about, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Present with `trajectory_diverged`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence: Option<crate::trajectory::TrajectoryDivergence>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), field: None, divergence: None }
    }

    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            code: ErrorCode::InvalidRequest,
            message: message.into(),
            field: Some(field.into()),
            divergence: None,
        }
    }
}

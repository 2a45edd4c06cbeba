//! Node errors in E2B's two wire formats: the control API's
//! `{"code": <http status>, "message"}` and envd's Connect codes. The node's
//! own error type stays the single source; only the spelling differs.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::ErrorCode;
use warren_node::{FileError, NodeError};

use crate::connect::{Code, ConnectError};

/// A control-API error: E2B's `{"code": int, "message": str}` body with the
/// same HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ControlError {
    pub status: StatusCode,
    pub message: String,
}

impl ControlError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ControlError { status, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ControlError::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(sandbox_id: &str) -> Self {
        ControlError::new(
            StatusCode::NOT_FOUND,
            format!("sandbox \"{sandbox_id}\" doesn't exist or you don't have access to it"),
        )
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (self.status, Json(body)).into_response()
    }
}

impl From<NodeError> for ControlError {
    fn from(e: NodeError) -> Self {
        let msg = e.to_string();
        match e {
            NodeError::NotFound(id) | NodeError::Ended { id, .. } => ControlError::not_found(&id),
            NodeError::Invalid(api) => {
                let message = match &api.field {
                    Some(f) => format!("{f}: {}", api.message),
                    None => api.message.clone(),
                };
                ControlError::new(status_of(api.code), message)
            }
            NodeError::ImageNotFound(name) => ControlError::bad_request(format!("template \"{name}\" not found")),
            NodeError::IdempotencyConflict(_) => ControlError::new(StatusCode::CONFLICT, msg),
            NodeError::Capacity(_) => ControlError::new(StatusCode::TOO_MANY_REQUESTS, msg),
            NodeError::Backend(warren_backend::BackendError::Unsupported(..)) => {
                ControlError::new(StatusCode::NOT_IMPLEMENTED, msg)
            }
            other => {
                tracing::warn!("e2b control request failed: {other}");
                ControlError::new(StatusCode::INTERNAL_SERVER_ERROR, msg)
            }
        }
    }
}

fn status_of(code: ErrorCode) -> StatusCode {
    StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A sandbox that is gone, as E2B's proxy words it (the SDK recognises the
/// message and raises its "sandbox not found" error).
pub fn sandbox_gone(id: &str) -> ConnectError {
    ConnectError::new(Code::Unavailable, format!("The sandbox {id} was not found"))
}

impl From<NodeError> for ConnectError {
    fn from(e: NodeError) -> Self {
        let msg = e.to_string();
        match e {
            NodeError::NotFound(id) | NodeError::Ended { id, .. } => sandbox_gone(&id),
            NodeError::ExecNotFound(_) | NodeError::SessionNotFound(_) => ConnectError::new(Code::NotFound, msg),
            NodeError::Invalid(api) => ConnectError::new(connect_code_of(api.code), api.message),
            NodeError::File(f) => f.into(),
            NodeError::Capacity(_) => ConnectError::new(Code::ResourceExhausted, msg),
            NodeError::Backend(warren_backend::BackendError::Busy(_)) => {
                ConnectError::new(Code::ResourceExhausted, msg)
            }
            NodeError::Backend(warren_backend::BackendError::ProgramNotFound(_))
            | NodeError::Backend(warren_backend::BackendError::ExecRejected(_)) => {
                ConnectError::new(Code::InvalidArgument, msg)
            }
            NodeError::Backend(warren_backend::BackendError::Gone) => ConnectError::new(Code::Unavailable, msg),
            NodeError::Backend(warren_backend::BackendError::Unsupported(..)) => {
                ConnectError::new(Code::Unimplemented, msg)
            }
            other => {
                tracing::warn!("envd request failed: {other}");
                ConnectError::new(Code::Internal, msg)
            }
        }
    }
}

fn connect_code_of(code: ErrorCode) -> Code {
    match code {
        ErrorCode::NotFound | ErrorCode::FileNotFound | ErrorCode::ImageNotFound => Code::NotFound,
        ErrorCode::FileConflict | ErrorCode::IdempotencyConflict => Code::AlreadyExists,
        ErrorCode::Unsupported | ErrorCode::UnsupportedBackend => Code::Unimplemented,
        ErrorCode::SandboxEnded | ErrorCode::StoreUnavailable => Code::Unavailable,
        ErrorCode::LimitReached | ErrorCode::CapacityExceeded | ErrorCode::NoSpace => Code::ResourceExhausted,
        ErrorCode::InvalidRequest => Code::InvalidArgument,
        _ => Code::Internal,
    }
}

impl From<FileError> for ConnectError {
    fn from(f: FileError) -> Self {
        let msg = f.to_string();
        let code = match f {
            FileError::NotFound => Code::NotFound,
            FileError::IsDirectory | FileError::NotDirectory | FileError::InvalidPath(_) => Code::InvalidArgument,
            FileError::Conflict(_) => Code::AlreadyExists,
            FileError::NoSpace => Code::ResourceExhausted,
            FileError::Io { .. } => Code::Internal,
        };
        ConnectError::new(code, msg)
    }
}

/// The error body of envd's plain HTTP routes (`/files`): `{"code", "message"}`
/// with the HTTP status in both places.
pub fn http_error(e: &ConnectError) -> Response {
    let status = match e.code {
        // The proxy answers 502 for a sandbox that is gone.
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        Code::ResourceExhausted if e.message.contains("space") => StatusCode::INSUFFICIENT_STORAGE,
        other => other.http_status(),
    };
    let body = serde_json::json!({ "code": status.as_u16(), "message": e.message });
    (status, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::{ApiError, EndReason};

    #[test]
    fn gone_sandboxes_are_not_found_on_both_doors() {
        let ended = || NodeError::Ended { id: "sb-1".into(), reason: EndReason::Deleted };
        assert_eq!(ControlError::from(ended()).status, StatusCode::NOT_FOUND);
        assert_eq!(ControlError::from(NodeError::NotFound("sb-1".into())).status, StatusCode::NOT_FOUND);
        let c = ConnectError::from(ended());
        assert_eq!(c.code, Code::Unavailable);
        assert!(c.message.contains("sb-1") && c.message.contains("not found"));
    }

    #[test]
    fn invalid_input_names_the_field_and_is_a_4xx() {
        let e = ControlError::from(NodeError::Invalid(ApiError::invalid("labels.x", "too long")));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.message, "labels.x: too long");
        let c = ConnectError::from(NodeError::Invalid(ApiError::invalid("cwd", "must be absolute")));
        assert_eq!(c.code, Code::InvalidArgument);
    }

    #[test]
    fn file_errors_map_to_the_codes_the_sdk_checks() {
        assert_eq!(ConnectError::from(FileError::NotFound).code, Code::NotFound);
        assert_eq!(ConnectError::from(FileError::Conflict("x exists".into())).code, Code::AlreadyExists);
        assert_eq!(ConnectError::from(NodeError::File(FileError::NoSpace)).code, Code::ResourceExhausted);
        let r = http_error(&ConnectError::from(FileError::NotFound));
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(http_error(&sandbox_gone("sb-2")).status(), StatusCode::BAD_GATEWAY);
    }
}

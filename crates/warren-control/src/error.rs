//! The one place where internal errors become HTTP answers.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ApiError, ErrorCode};
use warren_backend::BackendError;
use warren_node::{FileError, NodeError};

/// An [`ApiError`] on its way out as `{code, message, field?}`.
#[derive(Debug)]
pub struct HttpError(pub ApiError);

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        HttpError(e)
    }
}

impl From<NodeError> for HttpError {
    fn from(e: NodeError) -> Self {
        HttpError(to_api(e))
    }
}

fn with_field(code: ErrorCode, message: String, field: &str) -> ApiError {
    ApiError { code, message, field: Some(field.to_string()), divergence: None }
}

fn to_api(e: NodeError) -> ApiError {
    let msg = e.to_string();
    match e {
        NodeError::Invalid(api) => api,
        NodeError::NotFound(_) | NodeError::ExecNotFound(_) | NodeError::SessionNotFound(_) => {
            ApiError::new(ErrorCode::NotFound, msg)
        }
        NodeError::Ended { .. } | NodeError::Backend(BackendError::Gone) => ApiError::new(ErrorCode::SandboxEnded, msg),
        NodeError::UnsupportedBackend(_) => with_field(ErrorCode::UnsupportedBackend, msg, "backend"),
        NodeError::ImageNotFound(_) => with_field(ErrorCode::ImageNotFound, msg, "image"),
        NodeError::IdempotencyConflict(_) => with_field(ErrorCode::IdempotencyConflict, msg, "idempotency_key"),
        NodeError::ImageInUse(_) => with_field(ErrorCode::ImageInUse, msg, "name"),
        NodeError::Capacity(_) => ApiError::new(ErrorCode::CapacityExceeded, msg),
        NodeError::TrajectoryDiverged(divergence) => ApiError {
            code: ErrorCode::TrajectoryDiverged,
            message: msg,
            field: Some("Warren-Step".into()),
            divergence: Some(divergence),
        },
        NodeError::FunctionQueueFull { .. } => with_field(ErrorCode::QueueFull, msg, "image"),
        NodeError::AdmissionQueueFull { .. } => with_field(ErrorCode::QueueFull, msg, "queue"),
        NodeError::Backend(ref b) if b.is_exhaustion() => ApiError::new(ErrorCode::CapacityExceeded, msg),
        NodeError::Backend(BackendError::Unsupported(..)) => ApiError::new(ErrorCode::Unsupported, msg),
        NodeError::Backend(BackendError::Busy(_)) => with_field(ErrorCode::LimitReached, msg, "pids"),
        NodeError::Backend(BackendError::ProgramNotFound(_)) => with_field(ErrorCode::InvalidRequest, msg, "argv"),
        NodeError::Backend(BackendError::Invalid { field, .. }) => with_field(ErrorCode::InvalidRequest, msg, field),
        NodeError::Backend(BackendError::ExecRejected(ref why)) => {
            let field = if why.contains("cwd") || why.contains("directory") { "cwd" } else { "argv" };
            with_field(ErrorCode::InvalidRequest, msg, field)
        }
        NodeError::File(f) => match f {
            FileError::NotFound => with_field(ErrorCode::FileNotFound, msg, "path"),
            FileError::IsDirectory | FileError::NotDirectory | FileError::Conflict(_) => {
                with_field(ErrorCode::FileConflict, msg, "path")
            }
            FileError::NoSpace => ApiError::new(ErrorCode::NoSpace, msg),
            FileError::InvalidPath(_) => with_field(ErrorCode::InvalidRequest, msg, "path"),
            _ => ApiError::new(ErrorCode::Internal, msg),
        },
        NodeError::CreateTimedOut(_) => ApiError::new(ErrorCode::TimedOut, msg),
        NodeError::Image(warren_node::ImageError::InvalidName(_)) => with_field(ErrorCode::InvalidRequest, msg, "name"),
        NodeError::Store(warren_node::StoreError::Unavailable { .. }) => {
            ApiError::new(ErrorCode::StoreUnavailable, msg)
        }
        NodeError::Backend(_) | NodeError::Store(_) | NodeError::Image(_) | NodeError::Internal(_) => {
            ApiError::new(ErrorCode::Internal, msg)
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::error!(code = ?self.0.code, "{}", self.0.message);
        }
        (status, Json(self.0)).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_state_store_is_503_store_unavailable_and_other_store_errors_500() {
        let gone =
            warren_node::StoreError::Unavailable { endpoints: "127.0.0.1:2379".into(), reason: "refused".into() };
        let api = to_api(NodeError::Store(gone));
        assert_eq!((api.code, api.code.http_status()), (ErrorCode::StoreUnavailable, 503));
        assert!(api.message.contains("127.0.0.1:2379"), "{}", api.message);
        let broken = to_api(NodeError::Store(warren_node::StoreError::Backend("disk".into())));
        assert_eq!(broken.code, ErrorCode::Internal);
    }

    #[test]
    fn a_node_out_of_room_is_503_capacity_exceeded_and_other_backend_failures_500() {
        let out_of_fds = BackendError::io("open cgroup", std::io::Error::from_raw_os_error(libc::EMFILE));
        let api = to_api(NodeError::Backend(out_of_fds));
        assert_eq!((api.code, api.code.http_status()), (ErrorCode::CapacityExceeded, 503));
        assert!(api.message.contains("open cgroup"), "{}", api.message);
        let api = to_api(NodeError::Backend(BackendError::Exhausted("all 1 uid ranges are in use".into())));
        assert_eq!(api.code, ErrorCode::CapacityExceeded);
        let denied = BackendError::io("mount", std::io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(to_api(NodeError::Backend(denied)).code, ErrorCode::Internal);
        assert_eq!(to_api(NodeError::Backend(BackendError::Setup("x".into()))).code, ErrorCode::Internal);
        let too_big = to_api(NodeError::Backend(BackendError::Invalid { field: "memory_mib", message: "x".into() }));
        assert_eq!((too_big.code, too_big.field.as_deref()), (ErrorCode::InvalidRequest, Some("memory_mib")));
    }
}

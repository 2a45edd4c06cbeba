use warren_store::StoreError;

use crate::quota::QuotaRefusal;

/// What IAM refuses, and why; the HTTP layer maps each to one code.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    /// No key, a malformed one, or one that is unknown or revoked.
    #[error("{0}")]
    Unauthorized(String),
    /// The project or key does not exist, or the caller may not see it
    /// (the two are indistinguishable on purpose).
    #[error("no {what} {id}")]
    NotFound { what: &'static str, id: String },
    /// A request field is wrong; `field` names it.
    #[error("{message}")]
    Invalid { field: String, message: String },
    /// A create does not fit a quota.
    #[error("{0}")]
    QuotaExceeded(QuotaRefusal),
    /// Too many creates wait for quota already.
    #[error("{limit} creates wait for quota already; retry later")]
    QueueFull { limit: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Internal(String),
}

impl IamError {
    pub(crate) fn invalid(field: impl Into<String>, message: impl Into<String>) -> IamError {
        IamError::Invalid { field: field.into(), message: message.into() }
    }

    pub(crate) fn no_project(id: &str) -> IamError {
        IamError::NotFound { what: "project", id: id.to_string() }
    }
}

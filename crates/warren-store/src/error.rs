use std::path::PathBuf;

/// Why a store operation failed. Variants are what a caller can act on; the
/// backend's own error text is kept for logs.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another process (or another handle in this one) has the store open.
    /// The embedded store is single-owner: stop the other `warren serve`.
    #[error("state store {path} is already open by another process or handle")]
    Locked { path: PathBuf },
    /// The store file exists but cannot be read as a store.
    #[error("state store is corrupt: {0}")]
    Corrupt(String),
    #[error("state store I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A networked store (etcd) could not be reached, or has no quorum, within
    /// its request timeout. The write may or may not have been applied; the
    /// caller retries with the same idempotency key, or reports 503.
    #[error("state store unavailable ({endpoints}): {reason}")]
    Unavailable { endpoints: String, reason: String },
    /// Any other backend failure; the text is for humans.
    #[error("state store backend error: {0}")]
    Backend(String),
    /// A value read through the JSON helpers did not decode, or a value to
    /// write did not encode.
    #[error("state store value for {table}/{key} is not valid JSON for the expected type: {source}")]
    Json {
        table: &'static str,
        key: String,
        #[source]
        source: serde_json::Error,
    },
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

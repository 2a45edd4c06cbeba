use std::io;
use std::path::PathBuf;

use crate::layer::LayerError;

/// Why a cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Manifest(#[from] LayerError),
    /// Every layer that could make room is leased (or still mounted by
    /// someone outside the cache).
    #[error("cache full: layer {digest} needs {needed_bytes} bytes, {in_use_bytes} of {capacity_bytes} are in use")]
    CacheFull { digest: String, needed_bytes: u64, capacity_bytes: u64, in_use_bytes: u64 },
    /// A chunk could not be fetched, or the bytes fetched are not the chunk
    /// the manifest names.
    #[error("layer {digest}: chunk {index}: {reason}")]
    Chunk { digest: String, index: usize, reason: String },
    /// The layer's metadata blob could not be fetched or is not the one
    /// its manifest names; nothing of it was written.
    #[error("layer {digest}: metadata: {reason}")]
    Metadata { digest: String, reason: String },
    /// What an earlier run left for a layer cannot be used; it is removed.
    #[error("cached layer {hex} is unusable: {reason}")]
    Unusable { hex: String, reason: String },
    #[error("cache directory {0} is open in another cache")]
    Busy(PathBuf),
    /// The fill threads wait on the runtime's workers, which a
    /// current-thread runtime does not have.
    #[error("the layer cache needs a multi-threaded tokio runtime")]
    Runtime,
    #[error("cache task failed: {0}")]
    Task(String),
    #[error("holder process: {0}")]
    Holder(String),
    /// `shutdown` found layers still leased or mounted by others; their
    /// mounts stay up and the holder keeps them failing closed.
    #[error("layers still in use: {0:?}")]
    InUse(Vec<String>),
}

pub type Result<T, E = CacheError> = std::result::Result<T, E>;

/// Attaches what was being done to an I/O error.
pub(crate) trait IoContext<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| CacheError::Io { context: what(), source })
    }
}

impl<T> IoContext<T> for rustix::io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| CacheError::Io { context: what(), source: e.into() })
    }
}

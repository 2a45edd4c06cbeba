use std::io;
use std::path::PathBuf;

/// Why an image operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {0:?} not found")]
    NotFound(String),
    #[error("invalid image name {0:?}: must match [a-zA-Z0-9][a-zA-Z0-9._-]{{0,127}}")]
    InvalidName(String),
    #[error("import source {0} is not a directory")]
    NotADirectory(PathBuf),
    /// The host's tar rejected the input or failed to copy it; the text is
    /// its stderr (or why it could not be started).
    #[error("tar failed: {0}")]
    Tar(String),
    /// A manifest on disk does not describe a usable image.
    #[error("image {name:?} is corrupt: {reason}")]
    Corrupt { name: String, reason: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

pub type Result<T, E = ImageError> = std::result::Result<T, E>;

/// Attaches what was being done to an I/O error, since a bare `ENOENT` from
/// deep inside an import names no path.
pub(crate) trait IoContext<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| ImageError::Io { context: what(), source })
    }
}

//! The file API (stat, list, read, write, mkdir, remove, rename) of a sandbox, on a
//! directory fd of the sandbox's root filesystem: served from the host for a
//! container (`warren_backend::files` re-exports this module), and by init
//! inside a microVM's guest (see `proto::FileRequest`).
//!
//! The sandbox is hostile: it plants symlinks (absolute, relative, `..`
//! chains, loops) and swaps path components while an operation runs.
//! Invariant: every file these functions touch lies inside the root. Paths
//! are resolved only by the kernel, with `openat2(RESOLVE_IN_ROOT |
//! RESOLVE_NO_MAGICLINKS)`, and fd-relative from there on.
//! Never: builds a host path string, follows a final symlink when stat-ing,
//! listing an entry or removing, or opens anything but a regular file for
//! reading.
//!
//! The functions block; the node calls them in `spawn_blocking`, init on a
//! connection's own thread.

mod inspect;
mod mkdir;
mod path;
mod remove;
mod rename;
mod resolve;
mod write;

pub use inspect::{list, open_read, stat};
pub use mkdir::mkdir;
pub use path::MAX_PATH_BYTES;
pub use remove::{remove, MAX_REMOVE_DEPTH};
pub use rename::rename;
pub use write::{create_write, FileWriter};

/// What went wrong, in terms a caller can answer with an HTTP status.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("no such file or directory")]
    NotFound,
    #[error("is a directory")]
    IsDirectory,
    #[error("not a directory")]
    NotDirectory,
    /// The path exists in a way that forbids the operation (exists already,
    /// directory not empty, not a regular file, mount point, ...).
    #[error("{0}")]
    Conflict(String),
    #[error("no space left in the sandbox's filesystem")]
    NoSpace,
    #[error("invalid path: {0}")]
    InvalidPath(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl FileError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FileError::Io { context: context.into(), source }
    }
}

/// A directory fd of the sandbox's root filesystem as the caller sees it,
/// and the uid/gid that the sandbox's root is there (new files get them).
pub struct FsRoot {
    pub dir: std::os::fd::OwnedFd,
    pub uid: u32,
    pub gid: u32,
}

pub type Result<T, E = FileError> = std::result::Result<T, E>;

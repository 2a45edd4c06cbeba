//! Renaming (moving) an entry inside the sandbox.
//!
//! Both parents are resolved in the root like every other path; the final
//! names are handed to `renameat` as plain names, so a symlink at either end
//! is moved or replaced itself, never followed out of the root.

use std::os::fd::AsFd;

use rustix::fs::{AtFlags, FileType};
use warren_api::FileStat;

use super::path::SandboxPath;
use super::resolve::{errno, open_parent, stat_entry};
use super::{FileError, FsRoot, Result};

/// Moves `from` to `to`, replacing an existing file (or empty directory) at
/// `to` as `rename(2)` does, and returns the metadata of the moved entry.
/// Neither end may be `/`; a directory cannot move into itself.
pub fn rename(root: &FsRoot, from: &str, to: &str) -> Result<FileStat> {
    let from = SandboxPath::parse(from)?;
    let to = SandboxPath::parse(to)?;
    if from.is_root() || to.is_root() {
        return Err(FileError::InvalidPath("refusing to move /".into()));
    }
    let (src_dir, src_name) = open_parent(root, &from)?;
    let (dst_dir, dst_name) = open_parent(root, &to)?;
    // Moving a directory onto a file (or the reverse) gives EISDIR/ENOTDIR
    // from the kernel already; only "is it there at all" needs a clear answer.
    let st = rustix::fs::statat(&src_dir, src_name.as_str(), AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| errno(e, "stat", &from))?;
    rustix::fs::renameat(&src_dir, src_name.as_str(), &dst_dir, dst_name.as_str()).map_err(|e| match e {
        rustix::io::Errno::INVAL if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
            FileError::Conflict(format!("cannot move {from} into itself"))
        }
        // Across mounts (say, into a tmpfs the image mounts): not a path escape.
        rustix::io::Errno::XDEV => FileError::Conflict(format!("{from} and {to} are on different filesystems")),
        other => errno(other, "rename", &from),
    })?;
    stat_entry(dst_dir.as_fd(), &dst_name, &to)
}

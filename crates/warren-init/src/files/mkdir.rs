//! Directory creation.

use rustix::fs::{Gid, Mode, OFlags, Uid};
use warren_api::FileStat;

use super::inspect::stat_path;
use super::path::SandboxPath;
use super::resolve::{errno, open_in_root, open_parent};
use super::{FileError, FsRoot, Result};

/// Creates directory `path` with `mode` (bits above 0o7777 are ignored),
/// owned by `root`'s uid/gid. With `parents`, missing ancestors are created
/// the same way and an existing directory is fine; an existing non-directory
/// is always [`FileError::Conflict`].
pub fn mkdir(root: &FsRoot, path: &str, mode: u32, parents: bool) -> Result<FileStat> {
    let path = SandboxPath::parse(path)?;
    if path.is_root() {
        return match parents {
            true => stat_path(root, &path),
            false => Err(FileError::Conflict("/ already exists".into())),
        };
    }
    let first = if parents { 1 } else { path.depth() };
    // Each level is looked up from the root again, so a symlink planted in
    // between is resolved inside the root like any other.
    for depth in first..=path.depth() {
        let level = path.prefix(depth);
        match create_dir(root, &level, mode) {
            Ok(()) => {}
            Err(FileError::Conflict(_)) if parents => require_dir(root, &level)?,
            Err(e) => return Err(e),
        }
    }
    stat_path(root, &path)
}

fn create_dir(root: &FsRoot, path: &SandboxPath, mode: u32) -> Result<()> {
    let (parent, name) = open_parent(root, path)?;
    // Private until chowned and chmodded; the final mode is set explicitly
    // because mkdirat's is cut by the node's umask.
    rustix::fs::mkdirat(&parent, name.as_str(), Mode::from_bits_truncate(0o700))
        .map_err(|e| errno(e, "mkdir", path))?;
    // NOFOLLOW + DIRECTORY: if the sandbox swapped the new directory for a
    // symlink meanwhile, this fails instead of chowning the link's target.
    let dir = rustix::fs::openat(
        &parent,
        name.as_str(),
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| errno(e, "open new directory", path))?;
    rustix::fs::fchown(&dir, Some(Uid::from_raw(root.uid)), Some(Gid::from_raw(root.gid)))
        .map_err(|e| errno(e, "chown new directory", path))?;
    rustix::fs::fchmod(&dir, Mode::from_bits_truncate(mode & 0o7777)).map_err(|e| errno(e, "chmod new directory", path))
}

/// An existing `path` is acceptable as a directory, also through a symlink
/// that leads to one inside the root.
fn require_dir(root: &FsRoot, path: &SandboxPath) -> Result<()> {
    match open_in_root(root, path, OFlags::PATH | OFlags::DIRECTORY) {
        Ok(_) => Ok(()),
        Err(FileError::NotDirectory) => Err(FileError::Conflict(format!("{path} exists and is not a directory"))),
        Err(e) => Err(e),
    }
}

//! Removal, of single entries and of whole trees.
//!
//! The tree walk holds a directory fd per level and only ever opens plain
//! names with `O_NOFOLLOW | O_DIRECTORY`, so a symlink in the tree, planted
//! before or during the walk, is unlinked and never entered. It never uses
//! `..`, which could lead above the root if the sandbox moved a directory
//! while we were in it, and it does not cross into other mounts.

use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

use super::path::SandboxPath;
use super::resolve::{errno, open_parent};
use super::{FileError, FsRoot, Result};

/// Directory levels a recursive removal descends; each holds an open fd.
pub const MAX_REMOVE_DEPTH: usize = 256;

/// Removes `path`; a final symlink is removed, not followed. A directory
/// must be empty unless `recursive`. Removing `/` is refused.
pub fn remove(root: &FsRoot, path: &str, recursive: bool) -> Result<()> {
    let path = SandboxPath::parse(path)?;
    if path.is_root() {
        return Err(FileError::InvalidPath("refusing to remove /".into()));
    }
    let (parent, name) = open_parent(root, &path)?;
    let st =
        rustix::fs::statat(&parent, name.as_str(), AtFlags::SYMLINK_NOFOLLOW).map_err(|e| errno(e, "stat", &path))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return rustix::fs::unlinkat(&parent, name.as_str(), AtFlags::empty()).map_err(|e| errno(e, "unlink", &path));
    }
    if recursive {
        remove_tree(parent.as_fd(), &name, &path)
    } else {
        rustix::fs::unlinkat(&parent, name.as_str(), AtFlags::REMOVEDIR).map_err(|e| errno(e, "rmdir", &path))
    }
}

/// One directory being emptied.
struct Level {
    dir: OwnedFd,
    mount_id: u64,
    /// Its name in the level above (or in the tree's parent).
    name: CString,
    /// Entries not handled yet, with whether readdir said "directory".
    pending: Vec<(CString, bool)>,
}

/// Removes directory `name` in `parent` with everything below it.
fn remove_tree(parent: BorrowedFd<'_>, name: &str, path: &SandboxPath) -> Result<()> {
    let name = CString::new(name).map_err(|_| FileError::InvalidPath(format!("{path} contains a NUL byte")))?;
    let parent_mount = mount_id(parent).map_err(|e| errno(e, "statx", path))?;
    let top = Level::open(parent, name, parent_mount)
        .map_err(|e| errno(e, "open directory", path))?
        .ok_or_else(|| FileError::Conflict(format!("{path} changed while it was removed")))?;
    let mut stack = vec![top];
    while let Some(mut level) = stack.pop() {
        let Some((entry, is_dir)) = level.pending.pop() else {
            let above = stack.last().map_or(parent, |l| l.dir.as_fd());
            let Level { dir, name, .. } = level;
            drop(dir);
            ignore_gone(rustix::fs::unlinkat(above, name.as_c_str(), AtFlags::REMOVEDIR))
                .map_err(|e| errno(e, "rmdir inside", path))?;
            continue;
        };
        let sub = remove_entry(&level, entry, is_dir).map_err(|e| errno(e, "remove inside", path))?;
        stack.push(level);
        if let Some(sub) = sub {
            if stack.len() >= MAX_REMOVE_DEPTH {
                return Err(FileError::Conflict(format!("{path} is deeper than {MAX_REMOVE_DEPTH} levels")));
            }
            stack.push(sub);
        }
    }
    Ok(())
}

/// Unlinks a non-directory entry, or opens a directory entry for the walk to
/// descend into. Handles the sandbox swapping one kind for the other after
/// readdir looked.
fn remove_entry(level: &Level, name: CString, is_dir: bool) -> rustix::io::Result<Option<Level>> {
    if !is_dir {
        match rustix::fs::unlinkat(&level.dir, name.as_c_str(), AtFlags::empty()) {
            Err(Errno::ISDIR) => {}
            other => return ignore_gone(other).map(|()| None),
        }
    }
    match Level::open(level.dir.as_fd(), name.clone(), level.mount_id) {
        Ok(Some(sub)) => Ok(Some(sub)),
        Ok(None) => ignore_gone(rustix::fs::unlinkat(&level.dir, name.as_c_str(), AtFlags::empty())).map(|()| None),
        Err(e) => ignore_gone(Err(e)).map(|()| None),
    }
}

impl Level {
    /// Opens directory `name` in `parent` and reads its entries; `None` if
    /// `name` is not a directory (any more).
    fn open(parent: BorrowedFd<'_>, name: CString, parent_mount: u64) -> rustix::io::Result<Option<Level>> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let dir = match rustix::fs::openat(parent, name.as_c_str(), flags, Mode::empty()) {
            Ok(dir) => dir,
            Err(Errno::NOTDIR | Errno::LOOP) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mount_id = mount_id(dir.as_fd())?;
        if mount_id != parent_mount {
            // Whatever is mounted there is not the sandbox's to delete.
            return Err(Errno::BUSY);
        }
        let pending = read_entries(&dir)?;
        Ok(Some(Level { dir, mount_id, name, pending }))
    }
}

/// All names in `dir` but `.` and `..`, read up front so that unlinking does
/// not disturb the readdir position.
fn read_entries(dir: &OwnedFd) -> rustix::io::Result<Vec<(CString, bool)>> {
    let mut entries = Vec::new();
    for entry in Dir::new(rustix::io::dup(dir)?)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        // DT_UNKNOWN is tried as a file first; unlink says EISDIR if not.
        entries.push((name.to_owned(), entry.file_type() == FileType::Directory));
    }
    Ok(entries)
}

fn mount_id(fd: BorrowedFd<'_>) -> rustix::io::Result<u64> {
    Ok(rustix::fs::statx(fd, c"", AtFlags::EMPTY_PATH, StatxFlags::MNT_ID)?.stx_mnt_id)
}

/// Something the sandbox removed before we did is fine.
fn ignore_gone(result: rustix::io::Result<()>) -> rustix::io::Result<()> {
    match result {
        Err(Errno::NOENT) => Ok(()),
        other => other,
    }
}

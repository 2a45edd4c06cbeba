//! Turns an extracted OCI layer's whiteouts into the form overlayfs reads
//! from a lower layer: `.wh.NAME` becomes a character device `NAME` with
//! device number 0:0, and `.wh..wh..opq` becomes the xattr
//! `trusted.overlay.opaque=y` on its directory.
//!
//! Per the OCI image spec a whiteout hides only what lower layers have, so
//! when the same layer also holds `NAME` itself, that entry wins (in overlay
//! form an entry of the upper layer already hides the lower one) and the
//! marker is simply dropped. Other `.wh..wh.` names are AUFS bookkeeping and
//! are dropped too.
//!
//! The walk works on directory descriptors and never follows a symlink the
//! archive planted. Directories it changes get their times back, so the
//! result is as reproducible as the archive.

use std::ffi::{CStr, CString, OsStr};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, XattrFlags};
use rustix::io::Errno;

use crate::erofs::ErofsError;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
const META_PREFIX: &[u8] = b".wh..wh.";
pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Converts every whiteout under `root` in place.
pub(crate) fn convert_to_overlay(root: &Path) -> Result<(), ErofsError> {
    let root_fd = rustix::fs::open(root, dir_flags(), Mode::empty()).map_err(|e| fail(root, e))?;
    let mut pending = vec![(root_fd, root.to_owned())];
    while let Some((dir, path)) = pending.pop() {
        pending.extend(convert_dir(&dir, &path)?);
    }
    Ok(())
}

/// Converts the markers directly in `dir` and returns its subdirectories.
fn convert_dir(dir: &OwnedFd, path: &Path) -> Result<Vec<(OwnedFd, PathBuf)>, ErofsError> {
    let before = rustix::fs::fstat(dir).map_err(|e| fail(path, e))?;
    let mut subdirs = Vec::new();
    let mut changed = false;
    for (name, file_type) in list(dir, path)? {
        let bytes = name.as_bytes();
        if let Some(hidden) = bytes.strip_prefix(WHITEOUT_PREFIX) {
            convert_marker(dir, path, &name, hidden)?;
            changed = true;
        } else if file_type == FileType::Directory {
            let child = rustix::fs::openat(dir, name.as_c_str(), dir_flags(), Mode::empty())
                .map_err(|e| fail(&path.join(OsStr::from_bytes(bytes)), e))?;
            subdirs.push((child, path.join(OsStr::from_bytes(bytes))));
        }
    }
    if changed {
        rustix::fs::futimens(dir, &times_of(&before)).map_err(|e| fail(path, e))?;
    }
    Ok(subdirs)
}

fn convert_marker(dir: &OwnedFd, path: &Path, marker: &CStr, hidden: &[u8]) -> Result<(), ErofsError> {
    let marker_path = path.join(OsStr::from_bytes(marker.to_bytes()));
    let marker_stat = rustix::fs::statat(dir, marker, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| fail(&marker_path, e))?;
    rustix::fs::unlinkat(dir, marker, AtFlags::empty()).map_err(|e| fail(&marker_path, e))?;
    if marker.to_bytes() == OPAQUE_MARKER {
        return rustix::fs::fsetxattr(dir, OPAQUE_XATTR, b"y", XattrFlags::empty()).map_err(|e| fail(path, e));
    }
    if marker.to_bytes().starts_with(META_PREFIX) {
        return Ok(());
    }
    if hidden.is_empty() || hidden == b"." || hidden == b".." {
        return Err(ErofsError::Whiteout { path: marker_path, reason: "whiteout names no entry".into() });
    }
    let hidden = CString::new(hidden)
        .map_err(|_| ErofsError::Whiteout { path: marker_path.clone(), reason: "NUL in name".into() })?;
    match rustix::fs::statat(dir, hidden.as_c_str(), AtFlags::SYMLINK_NOFOLLOW) {
        Ok(_) => Ok(()),
        Err(Errno::NOENT) => {
            let dev = rustix::fs::makedev(0, 0);
            rustix::fs::mknodat(dir, hidden.as_c_str(), FileType::CharacterDevice, Mode::empty(), dev)
                .map_err(|e| fail(&marker_path, e))?;
            // The whiteout takes the marker's times: the clock must not
            // leak into the layer.
            rustix::fs::utimensat(dir, hidden.as_c_str(), &times_of(&marker_stat), AtFlags::SYMLINK_NOFOLLOW)
                .map_err(|e| fail(&marker_path, e))
        }
        Err(e) => Err(fail(&marker_path, e)),
    }
}

fn times_of(st: &rustix::fs::Stat) -> rustix::fs::Timestamps {
    rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec { tv_sec: st.st_atime, tv_nsec: st.st_atime_nsec as _ },
        last_modification: rustix::fs::Timespec { tv_sec: st.st_mtime, tv_nsec: st.st_mtime_nsec as _ },
    }
}

/// The entries of `dir` but "." and "..", with their types (asking the
/// inode when the directory entry does not say).
fn list(dir: &OwnedFd, path: &Path) -> Result<Vec<(CString, FileType)>, ErofsError> {
    let mut entries = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir).map_err(|e| fail(path, e))? {
        let entry = entry.map_err(|e| fail(path, e))?;
        let name = entry.file_name();
        if matches!(name.to_bytes(), b"." | b"..") {
            continue;
        }
        let file_type = match entry.file_type() {
            FileType::Unknown => rustix::fs::statat(dir.as_fd(), name, AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| FileType::from_raw_mode(st.st_mode))
                .map_err(|e| fail(path, e))?,
            known => known,
        };
        entries.push((name.to_owned(), file_type));
    }
    Ok(entries)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn fail(path: &Path, errno: Errno) -> ErofsError {
    ErofsError::Whiteout { path: path.to_owned(), reason: std::io::Error::from(errno).to_string() }
}

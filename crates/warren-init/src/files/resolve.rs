//! Resolution inside the root: the only place paths meet the kernel.
//!
//! Every lookup of a multi-component path goes through [`open_in_root`]
//! (`openat2` with `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`). After that the
//! code only uses `*at` calls on a directory fd with a single plain name,
//! which the kernel cannot resolve anywhere but in that directory.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;
use warren_api::{FileKind, FileStat};

use super::path::SandboxPath;
use super::{FileError, FsRoot, Result};

/// `openat2` fails with EAGAIN when a rename or mount raced a `..` step of
/// a scoped lookup; the sandbox can cause that at will, so retry a bounded
/// number of times instead of failing the request at once.
const RESOLVE_ATTEMPTS: usize = 64;

/// Linux's `MAXSYMLINKS`: how many final-component symlinks a write follows.
pub const MAX_SYMLINK_HOPS: usize = 40;

/// Opens `path` inside the root. Symlinks in every component, the final one
/// too unless `flags` has `NOFOLLOW`, are followed with `/` and `..` clamped
/// to the root; magic links (`/proc/*/fd/*`) are refused.
pub fn open_in_root(root: &FsRoot, path: &SandboxPath, flags: OFlags) -> Result<OwnedFd> {
    let rel = path.relative();
    let resolve = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS;
    let mut last = Errno::AGAIN;
    for _ in 0..RESOLVE_ATTEMPTS {
        match rustix::fs::openat2(root.dir.as_fd(), rel.as_str(), flags | OFlags::CLOEXEC, Mode::empty(), resolve) {
            Ok(fd) => return Ok(fd),
            Err(e @ (Errno::AGAIN | Errno::INTR)) => last = e,
            Err(e) => return Err(errno(e, "open", path)),
        }
    }
    Err(errno(last, "open (lookup kept racing renames)", path))
}

/// A directory fd for `path`'s parent and `path`'s final name, which the
/// caller then operates on without following it. `path` must not be `/`.
pub fn open_parent(root: &FsRoot, path: &SandboxPath) -> Result<(OwnedFd, String)> {
    let name = path.file_name().ok_or_else(|| FileError::InvalidPath("`/` has no parent".into()))?;
    let dir = open_in_root(root, &path.parent(), OFlags::PATH | OFlags::DIRECTORY)?;
    Ok((dir, name.to_owned()))
}

/// Metadata of `name` in `dir`, of a symlink itself rather than its target.
pub fn stat_entry(dir: BorrowedFd<'_>, name: &str, path: &SandboxPath) -> Result<FileStat> {
    let st = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| errno(e, "stat", path))?;
    let symlink_target = match FileType::from_raw_mode(st.st_mode) {
        FileType::Symlink => Some(read_link(dir, name, path)?),
        _ => None,
    };
    Ok(file_stat(path, &st, symlink_target))
}

/// Metadata of an open fd (no symlink can be involved).
pub fn stat_fd(fd: BorrowedFd<'_>, path: &SandboxPath) -> Result<FileStat> {
    let st = rustix::fs::fstat(fd).map_err(|e| errno(e, "stat", path))?;
    Ok(file_stat(path, &st, None))
}

/// The target of symlink `name` in `dir`; `None` when `name` is no symlink.
pub fn symlink_target(dir: BorrowedFd<'_>, name: &str, path: &SandboxPath) -> Result<Option<String>> {
    match rustix::fs::readlinkat(dir, name, Vec::new()) {
        Ok(target) => Ok(Some(target.to_string_lossy().into_owned())),
        Err(Errno::INVAL | Errno::NOENT) => Ok(None),
        Err(e) => Err(errno(e, "readlink", path)),
    }
}

fn read_link(dir: BorrowedFd<'_>, name: &str, path: &SandboxPath) -> Result<String> {
    // The link may have been replaced since it was stat'ed; report it as gone.
    symlink_target(dir, name, path)?.ok_or(FileError::NotFound)
}

fn file_stat(path: &SandboxPath, st: &Stat, symlink_target: Option<String>) -> FileStat {
    let kind = match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => FileKind::File,
        FileType::Directory => FileKind::Dir,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    };
    let modified_ms = (st.st_mtime as i128) * 1000 + (st.st_mtime_nsec as i128) / 1_000_000;
    FileStat {
        path: path.to_string(),
        kind,
        size_bytes: u64::try_from(st.st_size).unwrap_or(0),
        mode: st.st_mode & 0o7777,
        modified_at_ms: u64::try_from(modified_ms).unwrap_or(0),
        symlink_target,
    }
}

/// Reopens an `O_PATH` fd for reading through procfs, the one way to do so
/// without a second path lookup. The caller checks the file type on the
/// `O_PATH` fd first, so a device node or FIFO is never opened at all.
pub fn reopen_for_reading(fd: BorrowedFd<'_>, path: &SandboxPath) -> Result<OwnedFd> {
    let fail = |e| errno(e, "reopen through /proc/self/fd", path);
    let fds = rustix::fs::open("/proc/self/fd", OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(fail)?;
    // A /proc that is not procfs could point the name anywhere.
    if rustix::fs::fstatfs(&fds).map_err(fail)?.f_type != rustix::fs::PROC_SUPER_MAGIC {
        return Err(FileError::io("/proc is not procfs", std::io::Error::from(Errno::NOSYS)));
    }
    let name = std::os::fd::AsRawFd::as_raw_fd(&fd).to_string();
    rustix::fs::openat(&fds, name.as_str(), OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY, Mode::empty())
        .map_err(fail)
}

/// Turns an errno into the error a caller can act on; `op` and `path` only
/// feed the message of unexpected errors.
pub fn errno(e: Errno, op: &str, path: &SandboxPath) -> FileError {
    match e {
        Errno::NOENT => FileError::NotFound,
        Errno::ISDIR => FileError::IsDirectory,
        Errno::NOTDIR => FileError::NotDirectory,
        Errno::EXIST => FileError::Conflict(format!("{path} already exists")),
        Errno::NOTEMPTY => FileError::Conflict(format!("{path} is a directory that is not empty")),
        Errno::BUSY => FileError::Conflict(format!("{path} is busy (a mount point?)")),
        Errno::NOSPC | Errno::DQUOT => FileError::NoSpace,
        Errno::LOOP => FileError::InvalidPath(format!("{path}: too many levels of symbolic links")),
        Errno::NAMETOOLONG => FileError::InvalidPath(format!("{path}: a component is too long")),
        Errno::XDEV => FileError::InvalidPath(format!("{path}: lookup left the sandbox root")),
        other => FileError::io(format!("{op} {path}"), std::io::Error::from(other)),
    }
}

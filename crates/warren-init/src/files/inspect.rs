//! Read-only operations: stat, list, open for reading.

use std::os::fd::AsFd;

use rustix::fs::{Dir, FileType, OFlags};
use warren_api::{FileList, FileStat};

use super::path::SandboxPath;
use super::resolve::{errno, open_in_root, open_parent, reopen_for_reading, stat_entry, stat_fd};
use super::{FileError, FsRoot, Result};

/// Metadata of `path`; a final symlink is described, not followed.
pub fn stat(root: &FsRoot, path: &str) -> Result<FileStat> {
    let path = SandboxPath::parse(path)?;
    stat_path(root, &path)
}

pub(super) fn stat_path(root: &FsRoot, path: &SandboxPath) -> Result<FileStat> {
    if path.is_root() {
        let dir = open_in_root(root, path, OFlags::PATH | OFlags::DIRECTORY)?;
        return stat_fd(dir.as_fd(), path);
    }
    let (dir, name) = open_parent(root, path)?;
    stat_entry(dir.as_fd(), &name, path)
}

/// The entries of directory `path`, sorted by name. A final symlink to a
/// directory inside the root is followed, as `ls /lib/` does; the entries
/// themselves are described, never followed.
pub fn list(root: &FsRoot, path: &str) -> Result<FileList> {
    let path = SandboxPath::parse(path)?;
    let fd = open_in_root(root, &path, OFlags::RDONLY | OFlags::DIRECTORY)?;
    let dir_fd = fd.try_clone().map_err(|e| FileError::io(format!("dup fd of {path}"), e))?;
    let mut dir = Dir::new(dir_fd).map_err(|e| errno(e, "read directory", &path))?;
    let mut entries = Vec::new();
    while let Some(entry) = dir.read() {
        let entry = entry.map_err(|e| errno(e, "read directory", &path))?;
        let Ok(name) = entry.file_name().to_str() else {
            // The API speaks UTF-8 paths; a name it cannot address is skipped
            // rather than reported under a lossy name that names nothing.
            continue;
        };
        if name == "." || name == ".." {
            continue;
        }
        match stat_entry(fd.as_fd(), name, &path.join(name)) {
            Ok(stat) => entries.push(stat),
            // Deleted while we listed: it is not there.
            Err(FileError::NotFound) => {}
            Err(e) => return Err(e),
        }
    }
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(FileList { path: path.to_string(), entries })
}

/// Opens the regular file at `path` for reading, following symlinks inside
/// the root. Directories are [`FileError::IsDirectory`]; FIFOs, sockets and
/// device nodes are refused before they are ever opened for reading.
pub fn open_read(root: &FsRoot, path: &str) -> Result<std::fs::File> {
    let path = SandboxPath::parse(path)?;
    let handle = open_in_root(root, &path, OFlags::PATH)?;
    let st = rustix::fs::fstat(&handle).map_err(|e| errno(e, "stat", &path))?;
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => {}
        FileType::Directory => return Err(FileError::IsDirectory),
        _ => return Err(FileError::Conflict(format!("{path} is not a regular file"))),
    }
    let fd = reopen_for_reading(handle.as_fd(), &path)?;
    Ok(std::fs::File::from(fd))
}

//! Uploads: a temp file in the target's directory, renamed into place on
//! commit, so a reader never sees a half-written file and an abandoned
//! upload leaves nothing behind.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Gid, Mode, OFlags, Uid};
use rustix::io::Errno;
use warren_api::FileStat;

use super::path::SandboxPath;
use super::resolve::{errno, open_parent, stat_fd, symlink_target, MAX_SYMLINK_HOPS};
use super::{FileError, FsRoot, Result};

/// How many unique temp names to try before giving up; only a sandbox that
/// plants files under our names makes the first one fail.
const TEMP_NAME_ATTEMPTS: usize = 16;

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Starts writing the regular file at `path`. Symlinks, the final one too,
/// are followed inside the root. The file gets `root`'s uid/gid and `mode`
/// (bits above 0o7777 are ignored) and appears only on [`FileWriter::commit`].
/// The parent directory must exist.
pub fn create_write(root: &FsRoot, path: &str, mode: u32) -> Result<FileWriter> {
    let path = SandboxPath::parse(path)?;
    let (dir, name, path) = resolve_target(root, path)?;
    let (file, temp) = create_temp(&dir, &path)?;
    let writer = FileWriter { file, dir, name, temp_name: temp, path };
    writer.set_owner_and_mode(root, mode)?;
    Ok(writer)
}

/// The directory and name an upload to `path` replaces: final symlinks are
/// followed, by joining their target to the link's path; the kernel then
/// resolves the result inside the root like any other path.
fn resolve_target(root: &FsRoot, mut path: SandboxPath) -> Result<(OwnedFd, String, SandboxPath)> {
    for _ in 0..=MAX_SYMLINK_HOPS {
        let (dir, name) = open_parent(root, &path)?;
        match symlink_target(dir.as_fd(), &name, &path)? {
            Some(target) => path = path.parent().join(&target),
            None => {
                refuse_directory(&dir, &name, &path)?;
                return Ok((dir, name, path));
            }
        }
    }
    Err(FileError::InvalidPath(format!("{path}: too many levels of symbolic links")))
}

/// Fails early for an existing directory, before the body is streamed;
/// commit checks again, atomically.
fn refuse_directory(dir: &OwnedFd, name: &str, path: &SandboxPath) -> Result<()> {
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => Err(FileError::IsDirectory),
        Ok(_) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(errno(e, "stat", path)),
    }
}

/// The temp file and, unless it is an `O_TMPFILE` (which has no name and
/// vanishes by itself if we crash), its name in the target's directory.
fn create_temp(dir: &OwnedFd, path: &SandboxPath) -> Result<(std::fs::File, Option<String>)> {
    let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::TMPFILE;
    match rustix::fs::openat(dir, ".", flags, Mode::from_bits_truncate(0o600)) {
        Ok(fd) => Ok((std::fs::File::from(fd), None)),
        // Filesystems without O_TMPFILE say EOPNOTSUPP (older kernels: EISDIR).
        Err(Errno::OPNOTSUPP | Errno::ISDIR | Errno::INVAL) => create_named_temp(dir, path),
        Err(e) => Err(errno(e, "create temp file in the parent of", path)),
    }
}

fn create_named_temp(dir: &OwnedFd, path: &SandboxPath) -> Result<(std::fs::File, Option<String>)> {
    let flags = OFlags::WRONLY | OFlags::CLOEXEC | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW;
    for _ in 0..TEMP_NAME_ATTEMPTS {
        let name = temp_name();
        match rustix::fs::openat(dir, name.as_str(), flags, Mode::from_bits_truncate(0o600)) {
            Ok(fd) => return Ok((std::fs::File::from(fd), Some(name))),
            Err(Errno::EXIST) => continue,
            Err(e) => return Err(errno(e, "create temp file in the parent of", path)),
        }
    }
    Err(FileError::Conflict(format!("no free temp file name next to {path}")))
}

fn temp_name() -> String {
    let n = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!(".warren-upload.{}.{n}.{nanos:08x}", std::process::id())
}

/// An upload in progress. Write with [`FileWriter::append`] (or
/// [`std::io::Write`]); [`FileWriter::commit`] puts it in place, dropping it
/// without commit discards it.
#[derive(Debug)]
#[must_use = "dropping a FileWriter discards the upload; call commit()"]
pub struct FileWriter {
    file: std::fs::File,
    /// The directory the file lands in; fixed at creation, so a later swap
    /// of a path component cannot redirect the commit.
    dir: OwnedFd,
    name: String,
    /// The temp file's name in `dir`, removed on drop; `None` while it is an
    /// unnamed `O_TMPFILE` and after commit.
    temp_name: Option<String>,
    path: SandboxPath,
}

impl FileWriter {
    /// Where the file will appear, after following final symlinks.
    pub fn path(&self) -> String {
        self.path.to_string()
    }

    /// Appends `buf`; a full filesystem is [`FileError::NoSpace`].
    pub fn append(&mut self, buf: &[u8]) -> Result<()> {
        self.file.write_all(buf).map_err(|e| write_error(e, &self.path))
    }

    /// Atomically replaces whatever non-directory is at the target with the
    /// written file and returns its metadata. An existing directory is
    /// [`FileError::IsDirectory`] and stays as it is.
    // No fsync: a sandbox's filesystem does not outlive a host crash anyway.
    pub fn commit(mut self) -> Result<FileStat> {
        let temp = match &self.temp_name {
            Some(name) => name.clone(),
            None => {
                let name = self.link_anonymous()?;
                self.temp_name = Some(name.clone());
                name
            }
        };
        rustix::fs::renameat(&self.dir, temp.as_str(), &self.dir, self.name.as_str())
            .map_err(|e| errno(e, "rename upload into place at", &self.path))?;
        self.temp_name = None;
        stat_fd(self.file.as_fd(), &self.path)
    }

    /// Gives the `O_TMPFILE` a unique name, since `linkat` cannot replace an
    /// existing file and `renameat` can.
    fn link_anonymous(&self) -> Result<String> {
        for _ in 0..TEMP_NAME_ATTEMPTS {
            let name = temp_name();
            match rustix::fs::linkat(&self.file, "", &self.dir, name.as_str(), AtFlags::EMPTY_PATH) {
                Ok(()) => return Ok(name),
                Err(Errno::EXIST) => continue,
                Err(e) => return Err(errno(e, "link upload next to", &self.path)),
            }
        }
        Err(FileError::Conflict(format!("no free temp file name next to {}", self.path)))
    }

    /// Owner first: `fchown` clears set-id bits that `fchmod` then sets.
    fn set_owner_and_mode(&self, root: &FsRoot, mode: u32) -> Result<()> {
        let (uid, gid) = (Uid::from_raw(root.uid), Gid::from_raw(root.gid));
        rustix::fs::fchown(&self.file, Some(uid), Some(gid)).map_err(|e| errno(e, "chown upload", &self.path))?;
        rustix::fs::fchmod(&self.file, Mode::from_bits_truncate(mode & 0o7777))
            .map_err(|e| errno(e, "chmod upload", &self.path))
    }
}

impl Write for FileWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl Drop for FileWriter {
    fn drop(&mut self) {
        if let Some(temp) = &self.temp_name {
            // Best effort: if the sandbox renamed our temp away, what it left
            // under that name is its own file in its own directory.
            let _ = rustix::fs::unlinkat(&self.dir, temp.as_str(), AtFlags::empty());
        }
    }
}

fn write_error(e: std::io::Error, path: &SandboxPath) -> FileError {
    match e.raw_os_error().map(Errno::from_raw_os_error) {
        Some(Errno::NOSPC | Errno::DQUOT) => FileError::NoSpace,
        _ => FileError::io(format!("write {path}"), e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path taken on filesystems without `O_TMPFILE`.
    #[test]
    fn named_temp_is_renamed_on_commit_and_removed_on_drop() {
        let tmp = tempfile::tempdir().unwrap();
        let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let open = || rustix::fs::open(tmp.path(), dir_flags, Mode::empty()).unwrap();
        let root = FsRoot { dir: open(), uid: rustix::process::geteuid().as_raw(), gid: 0 };
        let names = || {
            let mut v: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
            v.sort();
            v
        };
        let path = SandboxPath::parse("/f").unwrap();
        let start = |root: &FsRoot| {
            let (file, temp_name) = create_named_temp(&open(), &path).unwrap();
            let w = FileWriter { file, dir: open(), name: "f".into(), temp_name, path: path.clone() };
            w.set_owner_and_mode(root, 0o640).unwrap();
            w
        };

        let mut w = start(&root);
        w.append(b"abc").unwrap();
        assert_eq!(names().len(), 1);
        assert!(names()[0].to_str().unwrap().starts_with(".warren-upload."));
        drop(w);
        assert!(names().is_empty());

        let mut w = start(&root);
        w.append(b"abc").unwrap();
        let st = w.commit().unwrap();
        assert_eq!((st.size_bytes, st.mode), (3, 0o640));
        assert_eq!(names(), ["f"]);
        assert_eq!(std::fs::read(tmp.path().join("f")).unwrap(), b"abc");
    }
}

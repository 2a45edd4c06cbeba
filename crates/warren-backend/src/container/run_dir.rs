//! The run directory's own tmpfs. Sandbox directories are made and removed
//! at every create and destroy; on the host's filesystem each mkdir costs
//! 0.3-1.5 ms (this host's ext4 has no journal, and then every new inode
//! is checked against recently deleted ones: a quarter of the server's CPU
//! in a create loop), on a tmpfs a few microseconds.
//!
//! The tmpfs is mounted by the first create and stays while the driver
//! lives: it goes when the driver's release (the server's stop) or a
//! sweep (every start) finds no sandbox directory left on it. Unmounting
//! it with the last sandbox cost a mount and an unmount (and two reads of
//! the directory) in every cycle of a create-use-delete loop. It is only
//! ever mounted over an empty directory: a run directory that still holds
//! sandboxes on the host's filesystem (from an older server) is used as it
//! is until they are gone.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use rustix::mount::{mount, unmount, MountFlags, UnmountFlags};

use crate::{BackendError, Result};

/// `f_type` of a tmpfs in `statfs(2)`.
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// The mount's source, which names it in mountinfo as Warren's.
const SOURCE: &str = "warren-run";

#[derive(Debug)]
pub(crate) struct RunDir {
    path: PathBuf,
    /// Whether our tmpfs is mounted at `path`. Held while a sandbox
    /// directory is made, so no unmount can slip in between.
    mounted: Mutex<bool>,
}

impl RunDir {
    /// `path` exists. A tmpfs of an earlier server (one that stopped with
    /// sandboxes running) is adopted.
    pub(crate) fn new(path: PathBuf) -> Result<RunDir> {
        let mounted = is_our_tmpfs(&path)?;
        Ok(RunDir { path, mounted: Mutex::new(mounted) })
    }

    fn lock(&self) -> MutexGuard<'_, bool> {
        self.mounted.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes the sandbox directory `dir` (0711) in the run directory,
    /// mounting the tmpfs first if it is not there and the run directory
    /// is empty.
    pub(crate) fn make_sandbox_dir(&self, dir: &Path) -> io::Result<()> {
        let mut mounted = self.lock();
        if !*mounted && is_empty(&self.path)? {
            mount(
                SOURCE,
                &self.path,
                "tmpfs",
                MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
                Some(c"mode=0711,size=16m"),
            )?;
            *mounted = true;
        }
        fs::DirBuilder::new().mode(0o711).create(dir)
    }

    /// Removes the (empty) sandbox directory `dir`; the tmpfs stays for
    /// the next create (see [`RunDir::release_if_empty`]).
    pub(crate) fn remove_sandbox_dir(&self, dir: &Path) -> io::Result<()> {
        fs::remove_dir(dir)
    }

    /// Unmounts the tmpfs if no sandbox directory is left on it.
    pub(crate) fn release_if_empty(&self) -> Result<()> {
        let mut mounted = self.lock();
        let path = &self.path;
        let empty = is_empty(path).map_err(|e| BackendError::io(format!("read {}", path.display()), e))?;
        if *mounted && empty {
            unmount(path, UnmountFlags::NOFOLLOW)
                .or_else(|_| unmount(path, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH))
                .map_err(|e| BackendError::io(format!("unmount {}", path.display()), e.into()))?;
            *mounted = false;
        }
        Ok(())
    }
}

fn is_empty(dir: &Path) -> io::Result<bool> {
    Ok(fs::read_dir(dir)?.next().is_none())
}

/// A tmpfs mounted right at `path` (not merely a directory on one) whose
/// source says it is ours.
fn is_our_tmpfs(path: &Path) -> Result<bool> {
    let stat =
        rustix::fs::statfs(path).map_err(|e| BackendError::io(format!("statfs {}", path.display()), e.into()))?;
    if stat.f_type as i64 != TMPFS_MAGIC {
        return Ok(false);
    }
    let parent = path.parent().unwrap_or(Path::new("/"));
    let here = fs::metadata(path).map_err(|e| BackendError::io(format!("stat {}", path.display()), e))?;
    let above = fs::metadata(parent).map_err(|e| BackendError::io(format!("stat {}", parent.display()), e))?;
    if here.dev() == above.dev() {
        return Ok(false);
    }
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").map_err(|e| BackendError::io("read mountinfo", e))?;
    let point = path.to_string_lossy();
    Ok(mountinfo.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        let source = fields.iter().position(|f| *f == "-").and_then(|dash| fields.get(dash + 2));
        fields.get(4) == Some(&point.as_ref()) && source == Some(&SOURCE)
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// How many mounts sit right at `path`.
    fn mounts_at(path: &Path) -> usize {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        mountinfo.lines().filter(|line| line.split(' ').nth(4) == Some(path.to_str().unwrap())).count()
    }

    /// Detaches whatever a failed test left mounted at its path.
    pub(crate) struct Unmount(pub(crate) PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = unmount(&self.0, UnmountFlags::NOFOLLOW | UnmountFlags::DETACH);
        }
    }

    #[test]
    fn the_tmpfs_comes_with_the_first_sandbox_dir_and_goes_when_released_empty() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        fs::create_dir(&run).unwrap();
        let _unmount = Unmount(run.clone());
        let run_dir = RunDir::new(run.clone()).unwrap();
        assert!(!is_our_tmpfs(&run).unwrap());

        run_dir.make_sandbox_dir(&run.join("a")).unwrap();
        run_dir.make_sandbox_dir(&run.join("b")).unwrap();
        assert!(is_our_tmpfs(&run).unwrap());
        // A restarted server adopts it.
        assert!(*RunDir::new(run.clone()).unwrap().lock());
        run_dir.release_if_empty().unwrap();
        assert!(is_our_tmpfs(&run).unwrap(), "sandbox dirs are left: keep it");

        run_dir.remove_sandbox_dir(&run.join("a")).unwrap();
        run_dir.remove_sandbox_dir(&run.join("b")).unwrap();
        assert!(is_our_tmpfs(&run).unwrap(), "the next create finds it mounted");
        assert!(is_empty(&run).unwrap());
        // The next sandbox dir goes on the same tmpfs, without a new mount.
        run_dir.make_sandbox_dir(&run.join("c")).unwrap();
        assert!(is_our_tmpfs(&run).unwrap());
        assert_eq!(mounts_at(&run), 1);
        run_dir.remove_sandbox_dir(&run.join("c")).unwrap();

        // The release (or a sweep) that finds it empty removes it.
        run_dir.release_if_empty().unwrap();
        assert!(!is_our_tmpfs(&run).unwrap());
        assert!(is_empty(&run).unwrap());
        assert_eq!(mounts_at(&run), 0);
    }

    #[test]
    fn a_run_dir_with_entries_on_the_host_fs_is_not_covered() {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        fs::create_dir_all(run.join("old")).unwrap();
        let _unmount = Unmount(run.clone());
        let run_dir = RunDir::new(run.clone()).unwrap();
        run_dir.make_sandbox_dir(&run.join("new")).unwrap();
        assert!(!is_our_tmpfs(&run).unwrap());
        assert!(run.join("old").is_dir() && run.join("new").is_dir());
    }
}

//! Removing a sandbox, whole or half-made: the one routine behind destroy,
//! sweep and a failed create. Blocking (it polls the kernel); async callers
//! run it on the blocking pool.

use std::fs;
use std::io;
use std::thread;
use std::time::{Duration, Instant};

use rustix::process::{waitpid, Pid, WaitOptions};
use warren_guard::cgroup::{CgroupError, SandboxCgroup};

use super::rootfs;
use super::run_dir::RunDir;
use super::state::{Layout, ProcessId};
use crate::{BackendError, Result};

/// How long the processes of one sandbox may take to die.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);
const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// What a sandbox may have left: processes (PID 1 and everything in its
/// cgroup), mounts and files under its run directory, its cgroups.
#[derive(Debug, Clone)]
pub(crate) struct Remains {
    pub(crate) layout: Layout,
    pub(crate) cgroup: SandboxCgroup,
    pub(crate) pid1: Option<ProcessId>,
    /// Where the sandbox directory lives.
    pub(crate) run_dir: std::sync::Arc<RunDir>,
}

impl Remains {
    /// Removes all of it. Each step tolerates what is already gone, so this
    /// is idempotent and works on a sandbox that never finished.
    pub(crate) fn remove(&self) -> Result<()> {
        if self.cgroup.is_frozen() {
            // A paused sandbox: frozen tasks act on SIGKILL only once thawed,
            // so waiting for PID 1 first would wait out the whole timeout.
            self.cgroup.kill_all(KILL_TIMEOUT).map_err(cgroup_err)?;
        }
        if let Some(pid1) = self.pid1 {
            kill_if_same(pid1);
            // PID 1 finishes exiting only after every other process of its
            // pid namespace is gone, so this usually empties the cgroup too.
            reap(pid1, Instant::now() + KILL_TIMEOUT)?;
        }
        // A backstop for PID 1's namespace teardown, and the only killer
        // when PID 1 is unknown or not our child.
        self.cgroup.kill_all(KILL_TIMEOUT).map_err(cgroup_err)?;
        let dir = self.layout.dir();
        if !rootfs::detach(dir)? {
            rootfs::unmount_all_under(dir)?;
        }
        self.cgroup.remove().map_err(cgroup_err)?;
        remove_dir(&self.layout, &self.run_dir)
    }
}

pub(crate) fn cgroup_err(e: CgroupError) -> BackendError {
    BackendError::io("cgroup", io::Error::other(e))
}

/// SIGKILL, but only to the process that `pid1` names: a recycled pid
/// belongs to someone else.
fn kill_if_same(pid1: ProcessId) {
    if pid1.stat().is_some() {
        // SAFETY: kill(2) touches no memory; the start time check above makes
        // sure the pid is still PID 1 (a zombie at worst, where it is a no-op).
        unsafe {
            libc::kill(pid1.pid, libc::SIGKILL);
        }
    }
}

/// Reaps PID 1 if it is this process's child (it reparents here, the child
/// subreaper). After a server restart it is someone else's child: ECHILD,
/// and its reaper collects it. Only ever `waitpid(pid)`: the async runtime
/// reaps its own children and must not lose them.
fn reap(pid1: ProcessId, deadline: Instant) -> Result<()> {
    let Some(pid) = Pid::from_raw(pid1.pid) else { return Ok(()) };
    loop {
        if pid1.stat().is_none() {
            return Ok(());
        }
        match waitpid(Some(pid), WaitOptions::NOHANG) {
            Ok(Some(_)) | Err(rustix::io::Errno::CHILD) => return Ok(()),
            Ok(None) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(BackendError::io(format!("waitpid {}", pid1.pid), e.into())),
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(BackendError::io(
                format!("PID 1 (host pid {}) still not dead after {KILL_TIMEOUT:?}", pid1.pid),
                io::ErrorKind::TimedOut.into(),
            ));
        }
        wait_exit(pid, (deadline - now).min(POLL_INTERVAL));
    }
}

/// Sleeps until `pid` exits or `at_most` passes: a pidfd becomes readable at
/// exit, so a dying sandbox is reaped at once instead of on the next tick.
fn wait_exit(pid: Pid, at_most: Duration) {
    let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
        thread::sleep(at_most.min(Duration::from_millis(1)));
        return;
    };
    let mut fds = [rustix::event::PollFd::new(&pidfd, rustix::event::PollFlags::IN)];
    let timeout = rustix::event::Timespec::try_from(at_most).ok();
    let _ = rustix::event::poll(&mut fds, timeout.as_ref());
}

/// Removes the sandbox directory, but never through a mount: deleting
/// recursively through one would reach into a layer or a still-attached
/// writable layer. Once its tmpfs is detached the directory is empty, and
/// `rmdir` alone refuses a mount point; only a directory of the old layout
/// (files on the host's filesystem) takes the checked recursive path.
fn remove_dir(layout: &Layout, run_dir: &RunDir) -> Result<()> {
    let dir = layout.dir();
    match run_dir.remove_sandbox_dir(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        // Something was stacked on the tmpfs, or mounted where it never was.
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => rootfs::unmount_all_under(dir)?,
        Err(e) if e.kind() == io::ErrorKind::DirectoryNotEmpty => {}
        Err(e) => return Err(BackendError::io(format!("remove {}", dir.display()), e)),
    }
    let left = rootfs::mounts_under(dir)?;
    if !left.is_empty() {
        return Err(BackendError::io(
            format!("mounts remain under {}: {left:?}", dir.display()),
            io::ErrorKind::ResourceBusy.into(),
        ));
    }
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BackendError::io(format!("remove {}", dir.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaping_a_process_that_is_not_our_child_returns_at_once() {
        // Our parent lives on and is nobody we may wait for: after a server
        // restart PID 1 is in the same position.
        let parent = ProcessId::of(rustix::process::getppid().unwrap().as_raw_nonzero().get()).unwrap();
        reap(parent, Instant::now()).unwrap();
        assert!(parent.is_running());
    }

    #[test]
    fn reaping_a_gone_or_recycled_pid_does_nothing() {
        let me = ProcessId::of(std::process::id() as i32).unwrap();
        let recycled = ProcessId { start_time: me.start_time + 1, ..me };
        reap(recycled, Instant::now()).unwrap();
    }
}

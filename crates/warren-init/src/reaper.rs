//! PID 1 reaps every process that ends in the sandbox, from ONE place:
//! nothing else in init ever waits for a child (std's `Child::wait` would
//! race it). In a container that place is PID 1's service loop, woken by
//! `SIGCHLD` through a signalfd ([`Registry::reap_exited`]): a thread of
//! its own would cost every idle sandbox a task (a kernel stack, a
//! `task_struct`, its stack's pages). A microVM's init, whose main thread
//! serves a port rather than a listener, keeps the reaper thread
//! ([`Registry::start`]).
//!
//! No status can go to the wrong exec, even with pid reuse:
//! - an exec registers its pid while holding the registry lock, and holds
//!   it from before `fork` until the pid is registered, so the reaper can
//!   never reap an exec's process before its waiter exists;
//! - the reaper first *peeks* at an exited child (`waitid(WNOWAIT)`), which
//!   leaves the zombie and so keeps its pid from being reused, then takes
//!   the lock and only then reaps it and looks up its waiter.
//!
//! So no status ever has to be parked for a later registration: a status
//! with no waiter belongs to an orphan (or to a failed spawn std already
//! reaped) and is dropped.
//!
//! An exec's own thread may reap its process too, under the same lock
//! ([`ExitWaiter::reap_now`], when the process's pidfd turns readable):
//! the exit then reaches the exec without first waiting for PID 1's loop to
//! be woken and scheduled. Whoever comes second finds nothing to reap, and
//! reaping never blocks (`sys::reap_if_exited`): the pid a loop peeked at
//! may have been reaped by an exec's thread and reused by a live process
//! before the loop got the lock.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, TryLockError, Weak};
use std::time::Duration;

use crate::sys;

/// How a process ended, in the protocol's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitReport {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub cpu_user_us: u64,
    pub cpu_system_us: u64,
    pub max_rss_bytes: u64,
}

impl ExitReport {
    fn from_reaped(reaped: &sys::Reaped) -> ExitReport {
        let status = reaped.status;
        let (exit_code, signal) = if libc::WIFEXITED(status) {
            (Some(libc::WEXITSTATUS(status)), None)
        } else if libc::WIFSIGNALED(status) {
            (None, Some(libc::WTERMSIG(status)))
        } else {
            (None, None)
        };
        let micros = |tv: libc::timeval| (tv.tv_sec.max(0) as u64) * 1_000_000 + tv.tv_usec.max(0) as u64;
        ExitReport {
            exit_code,
            signal,
            cpu_user_us: micros(reaped.rusage.ru_utime),
            cpu_system_us: micros(reaped.rusage.ru_stime),
            // Linux reports ru_maxrss in KiB.
            max_rss_bytes: (reaped.rusage.ru_maxrss.max(0) as u64) * 1024,
        }
    }
}

/// What an exec holds to learn its process's end: the report arrives on
/// `report`, and `wake` (a pipe's read end) reaches EOF at the same moment,
/// so a `poll` loop can wait for it next to its other descriptors.
pub struct ExitWaiter {
    pub report: Receiver<ExitReport>,
    pub wake: OwnedFd,
    /// The process's pidfd (unless the kernel refused one): readable the
    /// moment the process has exited, so the exec's thread can reap it
    /// itself ([`ExitWaiter::reap_now`]) instead of waiting for the
    /// reaper to run first and then wake it through `wake`.
    pub pidfd: Option<OwnedFd>,
    pid: i32,
    registry: Weak<Registry>,
}

impl ExitWaiter {
    /// Reaps the process if it has exited and nobody has yet; its report is
    /// then on `report`.
    pub fn reap_now(&self) {
        if let Some(registry) = self.registry.upgrade() {
            let inner = registry.lock();
            if inner.waiters.contains_key(&self.pid) {
                Registry::reap_locked(inner, self.pid);
            }
        }
    }

    /// Waits up to `timeout` for the process to exit and be reaped, here
    /// on its pidfd (without one, by the reaper); its report if it came
    /// in time.
    pub fn wait_reaped(&self, timeout: Duration) -> Option<ExitReport> {
        let Some(pidfd) = &self.pidfd else { return self.report.recv_timeout(timeout).ok() };
        let limit = rustix::time::Timespec {
            tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        let mut fds = [rustix::event::PollFd::new(pidfd, rustix::event::PollFlags::IN)];
        if matches!(rustix::event::poll(&mut fds, Some(&limit)), Ok(1)) {
            self.reap_now();
        }
        // Reaped here or by the reaper, the report was sent before either
        // let go of the registry's lock.
        self.report.try_recv().ok()
    }
}

struct Waiter {
    report: SyncSender<ExitReport>,
    /// Dropped right after the report is sent: that is the wake-up.
    _wake: OwnedFd,
}

#[derive(Default)]
struct Inner {
    waiters: HashMap<i32, Waiter>,
    /// Counts registrations, so an idle reaper knows when a child may exist.
    generation: u64,
}

#[derive(Default)]
pub struct Registry {
    inner: Mutex<Inner>,
    registered: Condvar,
}

impl Registry {
    /// Starts the reaper thread.
    pub fn start() -> io::Result<Arc<Registry>> {
        let registry = Arc::new(Registry::default());
        let reaper = Arc::clone(&registry);
        std::thread::Builder::new().name("reaper".into()).stack_size(64 * 1024).spawn(move || reaper.reap_forever())?;
        Ok(registry)
    }

    /// A registry without a reaper thread: the caller reaps, by calling
    /// [`Registry::reap_exited`] whenever a child may have ended.
    pub fn new() -> Arc<Registry> {
        Arc::new(Registry::default())
    }

    /// Reaps every child that has exited by now, without blocking.
    /// Returns `false` when one had to be left for later because a spawn
    /// holds the lock (it may hold it while a stopped leader keeps it
    /// waiting, and the caller's loop must stay free to accept): call
    /// again shortly. The zombie keeps its pid from being reused meanwhile.
    pub fn reap_exited(&self) -> bool {
        loop {
            match sys::exited_child_peek() {
                Ok(Some(pid)) => {
                    let inner = match self.inner.try_lock() {
                        Ok(inner) => inner,
                        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
                        Err(TryLockError::WouldBlock) => return false,
                    };
                    Self::reap_locked(inner, pid);
                }
                Ok(None) => return true,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // Nothing sensible to do; the next SIGCHLD tries again.
                Err(_) => return true,
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `spawn` (which forks and returns the child's pid) under the
    /// registry lock and registers the pid before the lock is released.
    ///
    /// A spawn that fails may still have left a child behind (one whose
    /// exec failed and that PID 1 must reap): the reaper is woken either way.
    pub fn spawn_registered<T, E: From<io::Error>>(
        self: &Arc<Self>,
        spawn: impl FnOnce() -> Result<(i32, T), E>,
    ) -> Result<(T, ExitWaiter), E> {
        let (wake_rx, wake_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(io::Error::from)?;
        let (report_tx, report_rx) = mpsc::sync_channel(1);
        let mut inner = self.lock();
        let spawned = spawn();
        let mut pidfd = None;
        if let Ok((pid, _)) = &spawned {
            inner.waiters.insert(*pid, Waiter { report: report_tx, _wake: wake_tx });
            // Under the lock: the pid cannot have been reaped (and reused)
            // yet, so the pidfd is this process's. Without one the exec
            // learns the end through `wake` alone.
            pidfd = rustix::process::Pid::from_raw(*pid)
                .and_then(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok());
        }
        inner.generation += 1;
        drop(inner);
        self.registered.notify_all();
        let (pid, spawned) = spawned?;
        let waiter = ExitWaiter { report: report_rx, wake: wake_rx, pidfd, pid, registry: Arc::downgrade(self) };
        Ok((spawned, waiter))
    }

    /// Sends `signal` to the registered process `pid` unless it has been
    /// reaped already: under the lock the reaper reaps under, so the pid
    /// cannot have been reused by another process meanwhile.
    pub fn signal_unreaped(&self, pid: i32, signal: i32) {
        let inner = self.lock();
        if inner.waiters.contains_key(&pid) {
            sys::signal(pid, signal);
        }
    }

    fn reap_forever(&self) {
        loop {
            let seen = self.lock().generation;
            match sys::wait_any_exited_peek() {
                Ok(pid) => self.reap_one(pid),
                Err(e) if e.raw_os_error() == Some(libc::ECHILD) => self.wait_for_registration(seen),
                // EINTR, or nothing sensible to do but try again.
                Err(_) => {}
            }
        }
    }

    fn reap_one(&self, pid: i32) {
        Self::reap_locked(self.lock(), pid)
    }

    fn reap_locked(mut inner: MutexGuard<'_, Inner>, pid: i32) {
        // ECHILD: std reaped a child whose exec failed, under our lock, or
        // an exec's thread reaped it (`ExitWaiter::reap_now`). `None`: that
        // happened and the pid is a new process's already, which runs.
        let Ok(Some(reaped)) = sys::reap_if_exited(pid) else { return };
        if let Some(waiter) = inner.waiters.remove(&pid) {
            // The receiver may be gone (its exec ended on a broken
            // connection); the status then has nobody to go to.
            let _ = waiter.report.send(ExitReport::from_reaped(&reaped));
        }
    }

    /// Init has no children: none can appear until a spawn is attempted
    /// (orphans only ever come from descendants).
    fn wait_for_registration(&self, seen: u64) {
        let mut inner = self.lock();
        while inner.generation == seen {
            inner = self.registered.wait(inner).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reaped(status: i32, user_us: i64, sys_us: i64, maxrss_kib: i64) -> sys::Reaped {
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut rusage: libc::rusage = unsafe { std::mem::zeroed() };
        rusage.ru_utime = libc::timeval { tv_sec: user_us / 1_000_000, tv_usec: user_us % 1_000_000 };
        rusage.ru_stime = libc::timeval { tv_sec: sys_us / 1_000_000, tv_usec: sys_us % 1_000_000 };
        rusage.ru_maxrss = maxrss_kib;
        sys::Reaped { status, rusage }
    }

    /// The reaper waits for any child of its process, for the rest of the
    /// process's life: it would take the children other tests wait for
    /// themselves (pack's `tar`). So its test runs in a process of its own.
    #[test]
    fn reaper_delivers_each_exit_to_its_exec_even_after_a_failed_spawn() {
        let me = std::env::current_exe().expect("the test binary");
        let out = std::process::Command::new(me)
            .args(["--exact", "reaper::tests::reaper_in_a_process_of_its_own", "--ignored", "--test-threads=1"])
            .output()
            .expect("run the reaper's test");
        let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && report.contains("1 passed"), "{report}");
    }

    #[test]
    #[ignore = "run by reaper_delivers_each_exit_to_its_exec_even_after_a_failed_spawn in a process of its own"]
    fn reaper_in_a_process_of_its_own() {
        use std::process::Command;
        let registry = Registry::start().unwrap();
        let spawn = |program: &str, args: &[&str]| {
            let mut command = Command::new(program);
            command.args(args);
            registry.spawn_registered(|| {
                let child = command.spawn()?;
                Ok::<_, io::Error>((child.id() as i32, ()))
            })
        };
        // std reaps a child whose exec failed by itself: that must neither
        // panic std (the reaper got there first) nor confuse the reaper.
        assert!(spawn("/nonexistent/program", &[]).is_err());
        let waiters: Vec<ExitWaiter> =
            (0..5).map(|i| spawn("/bin/sh", &["-c", &format!("exit {i}")]).unwrap().1).collect();
        for (i, waiter) in waiters.into_iter().enumerate() {
            let report = waiter.report.recv().unwrap();
            assert_eq!(report.exit_code, Some(i as i32));
            // The wake-up descriptor reaches EOF once the report is sent.
            let mut byte = [0u8; 1];
            assert_eq!(rustix::io::read(&waiter.wake, &mut byte), Ok(0));
        }
        // An exec's thread reaps on its pidfd, racing the reaper thread:
        // whoever wins, the report arrives exactly once.
        for code in 10..15 {
            let (_, waiter) = spawn("/bin/sh", &["-c", &format!("exit {code}")]).unwrap();
            let pidfd = waiter.pidfd.as_ref().expect("a pidfd for the registered process");
            let mut fds = [rustix::event::PollFd::new(pidfd, rustix::event::PollFlags::IN)];
            assert_eq!(rustix::event::poll(&mut fds, None), Ok(1));
            waiter.reap_now();
            assert_eq!(waiter.report.recv().unwrap().exit_code, Some(code));
            assert!(waiter.report.try_recv().is_err());
        }
        // A bounded wait (a retired phase leader's): nothing while the
        // process runs, its report once it has ended.
        let (_, waiter) = spawn("/bin/sleep", &["30"]).unwrap();
        assert!(waiter.wait_reaped(Duration::from_millis(50)).is_none());
        registry.signal_unreaped(waiter.pid, libc::SIGKILL);
        let report = waiter.wait_reaped(Duration::from_secs(30)).expect("reaped once killed");
        assert_eq!(report.signal, Some(libc::SIGKILL));
    }

    #[test]
    fn exit_report_decodes_wait_status_and_rusage() {
        let exited = ExitReport::from_reaped(&reaped(3 << 8, 2_500_000, 42, 1000));
        assert_eq!(exited.exit_code, Some(3));
        assert_eq!(exited.signal, None);
        assert_eq!(exited.cpu_user_us, 2_500_000);
        assert_eq!(exited.cpu_system_us, 42);
        assert_eq!(exited.max_rss_bytes, 1_024_000);
        let killed = ExitReport::from_reaped(&reaped(libc::SIGKILL, 0, 0, 0));
        assert_eq!((killed.exit_code, killed.signal), (None, Some(libc::SIGKILL)));
    }
}

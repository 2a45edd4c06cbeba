//! The holder: a tiny process whose only job is to keep the cache's fanotify
//! group open.
//!
//! While any process holds the group, a read of an unfilled range waits for
//! a verdict; once the last holder closes it, the kernel allows every
//! pending and future access and holes read as zeros. The cache process
//! holds the group too, but it is the part that can crash; the holder is
//! small enough not to. A restarted cache finds the holder through a record
//! next to the layers, takes a copy of the group with `pidfd_getfd`, and
//! answers the readers that waited meanwhile.

use std::ffi::OsString;
use std::fs;
use std::io::{self, ErrorKind};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use rustix::process::{Pid, PidfdFlags, PidfdGetfdFlags, Signal};
use serde::{Deserialize, Serialize};

use super::error::{CacheError, IoContext, Result};
use super::fanotify::{is_fanotify, Group};

/// The argument the `warren` binary maps to [`holder_main`].
pub const HOLDER_ARG: &str = "__layer-cache-holder";
/// Where the holder finds the group.
pub const HOLDER_GROUP_FD: RawFd = 3;
/// Where the holder finds the read end of its control pipe.
pub const HOLDER_CONTROL_FD: RawFd = 4;
/// Sent down the control pipe to end a holder whose group is no longer needed.
const EXIT_BYTE: u8 = b'q';

/// The holder process's whole life: keep descriptor [`HOLDER_GROUP_FD`]
/// open until the control pipe says to stop. If the pipe closes instead
/// (the cache died), keep holding: only SIGKILL ends it then, which a
/// restarted cache sends once it has taken over the group.
pub fn holder_main() -> ! {
    if !is_fanotify(HOLDER_GROUP_FD) {
        eprintln!("layer cache holder: descriptor {HOLDER_GROUP_FD} is not a fanotify group");
        std::process::exit(2);
    }
    ignore_stop_signals();
    // The holder must pin no directory of the cache (or anything else).
    let _ = std::env::set_current_dir("/");
    if fd_is_open(HOLDER_CONTROL_FD) {
        // SAFETY: the spawner placed the pipe at this number for this
        // process alone, and nothing else here opens or closes it.
        let control = unsafe { OwnedFd::from_raw_fd(HOLDER_CONTROL_FD) };
        wait_for_exit_word(&control);
    }
    loop {
        std::thread::park();
    }
}

fn wait_for_exit_word(control: &OwnedFd) {
    let mut byte = [0u8; 1];
    loop {
        match rustix::io::read(control, &mut byte) {
            Ok(1) if byte[0] == EXIT_BYTE => std::process::exit(0),
            Ok(0) => return,
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
    }
}

/// SIGINT from a terminal, SIGHUP from a closing session or a stray SIGTERM
/// must not end the one process that keeps readers from seeing zeros.
fn ignore_stop_signals() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
        // SAFETY: SIG_IGN installs no handler code; it only changes the
        // disposition of a catchable signal.
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
}

fn fd_is_open(fd: RawFd) -> bool {
    // SAFETY: F_GETFD only reads the descriptor flags of a number; an
    // unused number answers EBADF.
    unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
}

/// How to start a holder: normally this executable with [`HOLDER_ARG`].
#[derive(Debug, Clone)]
pub struct HolderCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
    pub envs: Vec<(OsString, OsString)>,
}

impl HolderCommand {
    /// The running executable with [`HOLDER_ARG`], as the `warren` binary
    /// dispatches it.
    pub fn current_exe() -> io::Result<Self> {
        Ok(Self { program: std::env::current_exe()?, args: vec![HOLDER_ARG.into()], envs: Vec::new() })
    }
}

/// What a later cache needs to find this holder again, and to be sure the
/// pid still names it.
#[derive(Debug, Serialize, Deserialize)]
struct HolderRecord {
    pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: a reused pid starts at another time.
    start_ticks: u64,
    boot_id: String,
}

/// A running holder, spawned by this cache or adopted from a dead one.
#[derive(Debug)]
pub(crate) struct Holder {
    pid: Pid,
    pidfd: OwnedFd,
    /// Set when this process spawned it, so it can be reaped.
    child: Option<Child>,
    /// Write end of the control pipe; an adopted holder's was lost with the
    /// cache that spawned it.
    control: Option<OwnedFd>,
    command: HolderCommand,
    record_path: PathBuf,
}

/// A holder found alive, with a copy of the group it holds.
pub(crate) struct Adopted {
    pub(crate) holder: Holder,
    pub(crate) group: Group,
}

impl Holder {
    /// Starts a holder for `group` and records it at `record_path`.
    pub(crate) fn spawn(command: &HolderCommand, group: &Group, record_path: &Path) -> Result<Self> {
        let (control_read, control_write) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).context(|| "creating the holder pipe".into())?;
        let child = spawn_with_fds(command, group.as_fd(), control_read.as_fd())?;
        drop(control_read);
        let pid = child_pid(&child)?;
        let mut holder = Self {
            pid,
            pidfd: rustix::process::pidfd_open(pid, PidfdFlags::empty())
                .context(|| format!("opening a pidfd for holder {}", pid.as_raw_nonzero()))?,
            child: Some(child),
            control: Some(control_write),
            command: command.clone(),
            record_path: record_path.to_owned(),
        };
        if let Err(e) = holder.write_record() {
            // Unrecorded, no later cache could find it: end it now.
            let _ = holder.stop();
            return Err(e);
        }
        Ok(holder)
    }

    /// Finds the holder a previous cache recorded, if it is still the same
    /// live process, and copies its group. `None` means the caller must
    /// start over: any group that holder had is gone.
    pub(crate) fn adopt(command: &HolderCommand, record_path: &Path) -> Result<Option<Adopted>> {
        let bytes = match fs::read(record_path) {
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            other => other.context(|| format!("reading {}", record_path.display()))?,
        };
        let record: HolderRecord = match serde_json::from_slice(&bytes) {
            Ok(record) => record,
            Err(e) => {
                tracing::warn!(path = %record_path.display(), error = %e, "unreadable holder record; starting afresh");
                return Ok(None);
            }
        };
        let Some(pid) = Pid::from_raw(record.pid) else { return Ok(None) };
        if record.boot_id != boot_id()? {
            return Ok(None);
        }
        let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
            Err(rustix::io::Errno::SRCH) => return Ok(None),
            other => other.context(|| format!("opening a pidfd for holder {}", record.pid))?,
        };
        // Checked after the pidfd exists, so the pidfd names the process
        // whose start time matched.
        if start_ticks(pid).ok() != Some(record.start_ticks) {
            return Ok(None);
        }
        let group_fd = match rustix::process::pidfd_getfd(&pidfd, HOLDER_GROUP_FD, PidfdGetfdFlags::empty()) {
            Err(rustix::io::Errno::BADF) | Err(rustix::io::Errno::SRCH) => return Ok(None),
            other => other.context(|| format!("taking the group from holder {}", record.pid))?,
        };
        if !is_fanotify(group_fd.as_raw_fd()) {
            return Err(CacheError::Holder(format!("process {} holds no fanotify group", record.pid)));
        }
        let holder = Self {
            pid,
            pidfd,
            child: None,
            control: None,
            command: command.clone(),
            record_path: record_path.to_owned(),
        };
        Ok(Some(Adopted { holder, group: Group::from_fd(group_fd) }))
    }

    pub(crate) fn pid(&self) -> i32 {
        self.pid.as_raw_nonzero().get()
    }

    /// Readable once the holder has exited.
    pub(crate) fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Replaces a holder that died while this cache still holds `group`.
    pub(crate) fn respawn(&mut self, group: &Group) -> Result<()> {
        self.reap();
        let fresh = Self::spawn(&self.command, group, &self.record_path)?;
        *self = fresh;
        Ok(())
    }

    /// Ends the holder, which releases the group once no cache holds it.
    /// Only for when nothing mounted depends on the group any more.
    pub(crate) fn stop(&mut self) -> Result<()> {
        let asked = self.control.as_ref().is_some_and(|pipe| rustix::io::write(pipe, &[EXIT_BYTE]).is_ok());
        if !asked {
            match rustix::process::pidfd_send_signal(&self.pidfd, Signal::KILL) {
                Err(rustix::io::Errno::SRCH) | Ok(()) => {}
                Err(e) => return Err(CacheError::Holder(format!("killing holder {}: {e}", self.pid()))),
            }
        }
        if let Some(child) = self.child.as_mut() {
            child.wait().context(|| format!("waiting for holder {}", self.pid.as_raw_nonzero()))?;
        }
        match fs::remove_file(&self.record_path) {
            Err(e) if e.kind() != ErrorKind::NotFound => {
                Err(e).context(|| format!("removing {}", self.record_path.display()))
            }
            _ => Ok(()),
        }
    }

    fn reap(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.try_wait();
        }
    }

    fn write_record(&self) -> Result<()> {
        let record = HolderRecord { pid: self.pid(), start_ticks: start_ticks(self.pid)?, boot_id: boot_id()? };
        let bytes = serde_json::to_vec(&record).map_err(|e| CacheError::Holder(e.to_string()))?;
        let scratch = self.record_path.with_extension("tmp");
        fs::write(&scratch, bytes)
            .and_then(|()| fs::rename(&scratch, &self.record_path))
            .context(|| format!("writing {}", self.record_path.display()))
    }
}

fn spawn_with_fds(command: &HolderCommand, group: BorrowedFd<'_>, control: BorrowedFd<'_>) -> Result<Child> {
    let (group, control) = (group.as_raw_fd(), control.as_raw_fd());
    let mut cmd = Command::new(&command.program);
    cmd.args(&command.args)
        .envs(command.envs.iter().map(|(k, v)| (k, v)))
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and only
    // makes async-signal-safe calls (fcntl, dup2, close, setsid) on
    // descriptors the parent keeps open until `spawn` returns.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || place_holder_fds(group, control));
    }
    cmd.spawn().context(|| format!("starting the holder {}", command.program.display()))
}

/// Puts the group and pipe at their fixed numbers without close-on-exec,
/// and moves the holder into its own session so the cache's terminal or
/// process group signals do not reach it.
fn place_holder_fds(group: RawFd, control: RawFd) -> io::Result<()> {
    // Both sources go above the targets first, so placing one can never
    // overwrite the other.
    // SAFETY: fcntl(F_DUPFD) on descriptors open in this process.
    let high_group = check(unsafe { libc::fcntl(group, libc::F_DUPFD, 10) })?;
    // SAFETY: as above.
    let high_control = check(unsafe { libc::fcntl(control, libc::F_DUPFD, 10) })?;
    // SAFETY: dup2 onto fixed numbers this child owns from here on; dup2
    // leaves the new descriptor without close-on-exec.
    check(unsafe { libc::dup2(high_group, HOLDER_GROUP_FD) })?;
    // SAFETY: as above.
    check(unsafe { libc::dup2(high_control, HOLDER_CONTROL_FD) })?;
    // SAFETY: the high copies were made above and are used by nobody else.
    unsafe {
        libc::close(high_group);
        libc::close(high_control);
    }
    // SAFETY: setsid takes no arguments; a forked child is never a group leader.
    check(unsafe { libc::setsid() })?;
    Ok(())
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn child_pid(child: &Child) -> Result<Pid> {
    i32::try_from(child.id())
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| CacheError::Holder(format!("unusable pid {}", child.id())))
}

fn start_ticks(pid: Pid) -> Result<u64> {
    let path = format!("/proc/{}/stat", pid.as_raw_nonzero());
    let stat = fs::read_to_string(&path).context(|| format!("reading {path}"))?;
    // The command name (field 2) may hold spaces and parentheses; fields
    // after its closing parenthesis start at field 3.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(22 - 3))
        .and_then(|field| field.parse().ok())
        .ok_or_else(|| CacheError::Holder(format!("no start time in {path}")))
}

fn boot_id() -> Result<String> {
    let path = "/proc/sys/kernel/random/boot_id";
    Ok(fs::read_to_string(path).context(|| format!("reading {path}"))?.trim().to_owned())
}

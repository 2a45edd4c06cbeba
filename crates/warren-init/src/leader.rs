//! Phase leaders: the one process per phase that holds the phase's
//! Landlock domain and starts every exec of that phase.
//!
//! Landlock's signal and abstract-socket scopes separate *domains*: a
//! process may only signal (or connect to an abstract socket of) processes
//! in its own domain or in domains nested below it. Every `landlock_restrict_self`
//! makes a new domain, so if each exec restricted itself, a background job
//! started by one exec could not be killed by the next. Instead, PID 1
//! starts a leader per phase (a fork of PID 1, never a binary of the
//! image), which restricts itself once
//! and then creates each exec's process with `clone(CLONE_PARENT)`: the
//! process is PID 1's child exactly as if PID 1 had forked it (PID 1's
//! reaper, tree kills and session ids work unchanged), but it is born in
//! the phase's domain. PID 1 itself stays outside every domain, so it can
//! start a later phase with looser rules, and the sandbox's processes
//! cannot signal it.
//!
//! A leader is a `fork` of PID 1 that never execs (its command name is
//! [`LEADER_COMM`]): a second `execve` of this static binary would pay
//! glibc's start-up again (its CPU feature and cache probes issue CPUID,
//! which traps on virtualised hosts: about 0.6 ms here), and a fork shares
//! PID 1's pages until either writes them. PID 1 has other threads by
//! then (the seccomp supervisor, connections'; a microVM's reaper), so
//! the child only uses what no other thread can hold locked: glibc's
//! allocator (its `fork` resets the allocator's locks in the child), its
//! own descriptors and memory.
//!
//! Wire, on a stream socketpair (PID 1's end, the leader's fd 3): each
//! message is a big-endian `u32` length and a JSON body. PID 1 first sends
//! the [`PhaseRules`]; the leader answers `Ready` (or `Failed`). Then per
//! exec PID 1 sends a [`SpawnOrder`] whose length prefix carries the
//! child's descriptors (`SCM_RIGHTS`: stdin, stdout, stderr, and for a
//! session the state pipe and init's binary), and PID 1 hears twice:
//! `Cloned` with the new pid, then `Spawned` or `SpawnFailed` (an exec
//! failure travels back from the child through a close-on-exec pipe, as in
//! std). The leader starts the child with `clone(CLONE_VM | CLONE_VFORK)`
//! (no copy of its page tables; it waits until the child has exec'd), and
//! the child itself sends `Cloned` before anything else, so PID 1 always
//! learns the pid before the program runs, even when the program kills
//! the leader at once (a leader lost after `Cloned` is replaced, and its
//! exec stands); a child killed before its message is announced by the
//! leader.
//!
//! The leader is in the phase's domain, so the phase's own processes can
//! signal it (kill or stop it). That only hurts their own sandbox, and PID
//! 1 notices (broken channel, or no answer within [`ANSWER_TIMEOUT`]),
//! kills it and starts a fresh leader for the same phase (a new domain:
//! processes started before that can no longer signal those started after).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{self, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustix::net::RecvAncillaryBuffer;
use serde::{Deserialize, Serialize};
use warren_guard::landlock::{self as ruleset, Level, Plan};
use warren_guard::profile::{sandbox_capability_mask, Capability};
use warren_init::proto::{PathAccess, PhaseRules};

use crate::reaper::{ExitWaiter, Registry};
use crate::sys;

/// A leader's command name (`/proc/<pid>/comm`), so it can be told from
/// PID 1, whose memory and command line it shares.
pub const LEADER_COMM: &str = "phase-leader";
/// Set once by a VM's init before any leader starts; never by a
/// container's. Tells a leader two things. A phase without protected paths
/// may run without a Landlock domain when the kernel lacks the required
/// ABI (an older guest kernel, such as Debian 12's 6.1): the VM itself is
/// the sandbox's boundary. And the phase's processes would hold the
/// guest's full root: a phase *with* protected paths first drops to a
/// container's capabilities less `CAP_MKNOD` (see [`enforce`]).
pub static LANDLOCK_OPTIONAL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Set by a microVM's init: every phase's processes get a container's
/// capabilities (less `CAP_MKNOD`), as in a container, not the guest
/// root's whole set (raw memory and disks, the kernel's interfaces, raw
/// sockets, raising their own limits). A full VM's leader leaves the
/// guest's root whole: systemd and the OS are the task there.
pub static SEAL_CAPABILITIES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// In the leader: its end of the channel to PID 1.
const CHANNEL_FD: RawFd = 3;
/// In the leader: init's own binary (sessions exec it in report-state mode).
const EXE_FD: RawFd = 4;
/// The most descriptors one spawn hands over.
const MAX_FDS: usize = 5;
/// Largest message either side accepts.
const MAX_MESSAGE_BYTES: u32 = 16 << 20;
/// How long PID 1 waits for a leader's answer to a spawn.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long PID 1 waits for a new leader to build and enforce its ruleset.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a retired leader gets to exit on its closed channel before it
/// is killed, and then to be reaped.
const RETIRE_GRACE: Duration = Duration::from_secs(1);

/// PID 1 -> leader: start one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpawnOrder {
    /// The resolved program path.
    pub program: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: String,
}

/// Leader -> PID 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "says", rename_all = "snake_case")]
enum LeaderSays {
    Ready,
    /// `rejected`: the rules themselves cannot be enforced here (a bad or
    /// symlinked path, too many rules), not a failing system.
    Failed {
        message: String,
        rejected: bool,
    },
    /// The process exists and is about to exec.
    Cloned {
        pid: i32,
    },
    Spawned {
        pid: i32,
    },
    /// `errno` of the step (`chdir`, `execve`, ...) that failed.
    SpawnFailed {
        errno: i32,
        step: String,
    },
}

/// Why a spawn through the leader failed.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// The process could not start (its exec failed): the caller's problem.
    #[error("{0}")]
    Exec(io::Error),
    /// The leader was gone (or silent) before it started the order's
    /// process: start another and try again.
    #[error("phase leader gone: {0}")]
    LeaderGone(io::Error),
    /// The leader answered out of protocol. The leader is to be replaced;
    /// the order is not repeated.
    #[error("phase leader broke: {0}")]
    Leader(io::Error),
}

/// Why a leader could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The phase's rules cannot be enforced in this sandbox.
    #[error("{0}")]
    Rejected(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<StartError> for io::Error {
    fn from(e: StartError) -> io::Error {
        match e {
            StartError::Rejected(message) => io::Error::other(message),
            StartError::Io(e) => e,
        }
    }
}

/// What fails around the leader (e.g. the reaper's wake-up pipe) fails
/// only this spawn.
impl From<io::Error> for SpawnError {
    fn from(e: io::Error) -> SpawnError {
        SpawnError::Exec(e)
    }
}

/// PID 1's handle of a running leader. Dropping it closes the channel, on
/// which the leader exits.
pub struct Leader {
    pid: i32,
    channel: UnixStream,
    /// Went silent after a `Cloned`: to be replaced before the next spawn.
    lost: bool,
    _exit: ExitWaiter,
}

impl Leader {
    /// Starts a leader for `rules` and waits until it enforces them.
    pub fn start(registry: &Arc<Registry>, self_exe: BorrowedFd<'_>, rules: &PhaseRules) -> Result<Leader, StartError> {
        let (channel, theirs) = UnixStream::pair()?;
        let null = rustix::fs::open(
            "/dev/null",
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(io::Error::from)?;
        let fds = ChildFds { null: null.as_raw_fd(), channel: theirs.as_raw_fd(), exe: self_exe.as_raw_fd() };
        let landlock_optional = LANDLOCK_OPTIONAL.load(std::sync::atomic::Ordering::Relaxed);
        let (pid, exit) = registry.spawn_registered(|| {
            // SAFETY: PID 1 has other threads (the seccomp supervisor,
            // connections'; in a microVM the reaper). The child takes no
            // lock they could hold: it moves its descriptors with raw
            // calls, then runs `leader_main`, which allocates (glibc's
            // `fork` leaves the allocator usable in the child) and uses
            // only its own descriptors and memory.
            match unsafe { sys::fork() }? {
                sys::Forked::Child => {
                    if prepare_leader(&fds).is_err() {
                        sys::exit_now(1)
                    }
                    leader_main(landlock_optional)
                }
                sys::Forked::Parent { child } => Ok::<_, io::Error>((child, child)),
            }
        })?;
        drop(theirs);
        drop(null);
        let mut leader = Leader { pid, channel, lost: false, _exit: exit };
        let started = leader.handshake(rules);
        if started.is_err() {
            leader.kill(registry);
        }
        started.map(|()| leader)
    }

    fn handshake(&mut self, rules: &PhaseRules) -> Result<(), StartError> {
        self.channel.set_read_timeout(Some(READY_TIMEOUT))?;
        send_message(&self.channel, rules, &[])?;
        match read_message::<LeaderSays>(&mut self.channel)? {
            LeaderSays::Ready => Ok(()),
            LeaderSays::Failed { message, rejected: true } => Err(StartError::Rejected(message)),
            LeaderSays::Failed { message, rejected: false } => Err(io::Error::other(message).into()),
            other => Err(io::Error::other(format!("phase leader said {other:?} before it was ready")).into()),
        }
    }

    /// The leader's pid (in the sandbox's pid namespace).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether this leader went silent after it had started a process;
    /// it must be replaced.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Starts `order`'s process with `fds` as its descriptors 0, 1, 2, ...
    pub fn spawn(&mut self, order: &SpawnOrder, fds: &[BorrowedFd<'_>]) -> Result<i32, SpawnError> {
        self.channel.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(SpawnError::LeaderGone)?;
        send_message(&self.channel, order, fds).map_err(SpawnError::LeaderGone)?;
        // No `Cloned`: no process of this order can ever run (a child
        // whose leader died before saying it exits without exec), so the
        // order may go to a fresh leader.
        let cloned = match read_message::<LeaderSays>(&mut self.channel).map_err(SpawnError::LeaderGone)? {
            LeaderSays::Cloned { pid } => pid,
            LeaderSays::SpawnFailed { errno, step } => {
                let e = io::Error::from_raw_os_error(errno);
                return Err(SpawnError::Exec(io::Error::new(e.kind(), format!("{step}: {e}"))));
            }
            other => return Err(SpawnError::Leader(io::Error::other(format!("unexpected answer {other:?}")))),
        };
        let mut answer = read_message::<LeaderSays>(&mut self.channel);
        // The child announces itself, and the leader does when the child was
        // killed before it could: a child killed right after its message can
        // make both say it.
        while matches!(answer, Ok(LeaderSays::Cloned { pid }) if pid == cloned) {
            answer = read_message::<LeaderSays>(&mut self.channel);
        }
        let answer = match answer {
            Ok(answer) => answer,
            // The process was released to exec, and the program may well
            // have killed its leader (it may: they share the phase's
            // domain). It runs, or exits 127 if its exec failed.
            Err(_) => {
                self.lost = true;
                return Ok(cloned);
            }
        };
        match answer {
            LeaderSays::Spawned { pid } => Ok(pid),
            LeaderSays::SpawnFailed { errno, step } => {
                let e = io::Error::from_raw_os_error(errno);
                Err(SpawnError::Exec(io::Error::new(e.kind(), format!("{step}: {e}"))))
            }
            other => Err(SpawnError::Leader(io::Error::other(format!("unexpected answer {other:?}")))),
        }
    }

    /// Ends a leader that stopped answering (PID 1 may signal any process
    /// of the sandbox; the reaper collects it).
    pub fn kill(&self, registry: &Registry) {
        registry.signal_unreaped(self.pid, libc::SIGKILL);
    }

    /// Ends the leader and waits until it has been reaped, so that the
    /// switch that retires it answers with only the new phase's leader in
    /// the sandbox. Closing the channel ends it; one that has not exited
    /// within `RETIRE_GRACE` is killed, and waited for as long again.
    pub fn retire(self, registry: &Registry) {
        let Leader { pid, channel, _exit: exit, .. } = self;
        drop(channel);
        if exit.wait_reaped(RETIRE_GRACE).is_none() {
            registry.signal_unreaped(pid, libc::SIGKILL);
            exit.wait_reaped(RETIRE_GRACE);
        }
    }
}

/// PID 1's descriptors a new leader keeps.
struct ChildFds {
    null: RawFd,
    channel: RawFd,
    exe: RawFd,
}

/// First thing in the forked leader: its own session (the leader is part
/// of no exec's tree) and command name, `/dev/null` as 0-2, the channel at
/// [`CHANNEL_FD`] and init's binary at [`EXE_FD`], every other descriptor
/// of PID 1 closed (its listener, its connections, the seccomp listener),
/// default signal dispositions and an empty signal mask (PID 1 blocks
/// `SIGCHLD` for its signalfd; the sandbox's processes must not inherit
/// that).
fn prepare_leader(fds: &ChildFds) -> io::Result<()> {
    let check = |rc: libc::c_int| if rc == -1 { Err(io::Error::last_os_error()) } else { Ok(()) };
    // SAFETY: raw system calls on integers and on a valid, empty signal
    // set in the forked child. `channel` and `exe` are both above EXE_FD
    // (fds 3 and 4 of PID 1 are the retired setup socket's placeholder
    // and the listener), so the dup2s cannot clobber each other.
    unsafe {
        sys::reset_signal_dispositions();
        let mut none: libc::sigset_t = std::mem::zeroed();
        check(libc::sigemptyset(&mut none))?;
        check(libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut()))?;
        check(libc::setsid())?;
        for target in 0..=2 {
            check(libc::dup2(fds.null, target))?;
        }
        check(libc::dup2(fds.channel, CHANNEL_FD))?;
        check(libc::dup2(fds.exe, EXE_FD))?;
        check(libc::close_range((EXE_FD + 1) as libc::c_uint, libc::c_uint::MAX, 0))?;
    }
    rustix::thread::set_name(&CString::new(LEADER_COMM).map_err(io::Error::other)?).map_err(io::Error::from)
}

// ---- wire --------------------------------------------------------------

/// Sends one message; `fds` ride on its length prefix.
fn send_message<T: Serialize>(channel: &UnixStream, value: &T, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let body = serde_json::to_vec(value).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).ok().filter(|&n| n <= MAX_MESSAGE_BYTES);
    let len = len.ok_or_else(|| io::Error::other("message too large"))?.to_be_bytes();
    if fds.len() > MAX_FDS {
        return Err(io::Error::other("too many descriptors for one spawn"));
    }
    let sent = warren_init::proto::send_with_fds(channel.as_fd(), &len, fds)?;
    let mut writer = channel;
    writer.write_all(&len[sent..])?;
    writer.write_all(&body)
}

/// Reads one message without descriptors.
fn read_message<T: for<'de> Deserialize<'de>>(channel: &mut UnixStream) -> io::Result<T> {
    let mut len = [0u8; 4];
    channel.read_exact(&mut len)?;
    read_body(channel, len)
}

fn read_body<T: for<'de> Deserialize<'de>>(channel: &mut UnixStream, len: [u8; 4]) -> io::Result<T> {
    let len = u32::from_be_bytes(len);
    if len > MAX_MESSAGE_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "message too large"));
    }
    let mut body = vec![0u8; len as usize];
    channel.read_exact(&mut body)?;
    serde_json::from_slice(&body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads one message and the descriptors on its length prefix. `Ok(None)`
/// when PID 1 closed the channel.
fn read_message_with_fds<T: for<'de> Deserialize<'de>>(
    channel: &mut UnixStream,
) -> io::Result<Option<(T, Vec<OwnedFd>)>> {
    let mut len = [0u8; 4];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let (got, fds) = warren_init::proto::recv_with_fds(channel.as_fd(), &mut len, &mut control)?;
    let got = got.bytes;
    if got == 0 {
        return Ok(None);
    }
    channel.read_exact(&mut len[got..])?;
    Ok(Some((read_body(channel, len)?, fds)))
}

// ---- the leader process ------------------------------------------------

/// The forked leader: enforce the phase's ruleset, then start processes
/// for PID 1 until it closes the channel.
fn leader_main(landlock_optional: bool) -> ! {
    // Before anything else: the sandbox's root must not open this
    // process's descriptors (the channel) through /proc. Until this call
    // the leader is dumpable, but it is also in no Landlock domain yet, and
    // every sandbox process is in one: Landlock refuses a process access to
    // /proc/<pid>/fd of a process outside its domain (the ptrace check), so
    // even a process of an earlier phase cannot take the channel then.
    if rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable).is_err() {
        sys::exit_now(1)
    }
    // SAFETY: PID 1 hands the leader the channel at CHANNEL_FD and init's
    // binary at EXE_FD; nothing else in this process owns them.
    let (mut channel, exe) = unsafe { (UnixStream::from_raw_fd(CHANNEL_FD), OwnedFd::from_raw_fd(EXE_FD)) };
    for fd in [channel.as_fd(), exe.as_fd()] {
        if rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::CLOEXEC).is_err() {
            sys::exit_now(1)
        }
    }
    let answer = match read_message::<PhaseRules>(&mut channel) {
        Ok(rules) => match enforce(&rules, exe.as_fd(), landlock_optional) {
            Ok(()) => LeaderSays::Ready,
            Err((message, rejected)) => LeaderSays::Failed { message, rejected },
        },
        Err(_) => sys::exit_now(1),
    };
    let ready = answer == LeaderSays::Ready;
    if send_message(&channel, &answer, &[]).is_err() || !ready {
        sys::exit_now(1)
    }
    serve(&mut channel)
}

/// Builds the phase's ruleset and restricts this process (and so every
/// process it starts) to it. On failure: why, and whether the rules
/// themselves are at fault.
fn enforce(rules: &PhaseRules, exe: BorrowedFd<'_>, landlock_optional: bool) -> Result<(), (String, bool)> {
    // A guest's root reaches around any path rule with its capabilities:
    // raw disks and kernel memory (`CAP_SYS_RAWIO`), a device node of its
    // own making (`CAP_MKNOD`), the kernel's helpers and interfaces
    // (`CAP_SYS_ADMIN`, `CAP_SYS_MODULE`). The guest's init left the disks'
    // nodes behind and made the sysctls read-only at boot (`vm::boot`).
    let seal = SEAL_CAPABILITIES.load(std::sync::atomic::Ordering::Relaxed);
    if landlock_optional && (seal || !rules.protected_paths.is_empty()) {
        let mask = sandbox_capability_mask() & !Capability::Mknod.bit();
        crate::seal::apply_keeping(mask).map_err(|e| (format!("phase `{}`: {e}", rules.name), false))?;
    }
    if rules.protected_paths.is_empty() && landlock_optional && !ruleset::supported() {
        return Ok(());
    }
    let fail = |e: ruleset::LandlockError| {
        let rejected = matches!(
            e,
            ruleset::LandlockError::InvalidPath { .. }
                | ruleset::LandlockError::Symlink { .. }
                | ruleset::LandlockError::TooManyRules
        );
        (format!("phase `{}`: {e}", rules.name), rejected)
    };
    let plan =
        Plan::new(rules.protected_paths.iter().map(|(path, access)| (path.as_str(), level(*access)))).map_err(fail)?;
    let root = rustix::fs::open(
        "/",
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| (format!("open /: {e}"), false))?;
    // Session commands exec this binary (in report-state mode) through
    // the descriptor they are handed: the phase must be able to.
    let ruleset = plan.ruleset(root.as_fd(), &[(exe, Level::Read)]).map_err(fail)?;
    ruleset::restrict_self(ruleset).map_err(fail)?;
    Ok(())
}

fn level(access: PathAccess) -> Level {
    match access {
        PathAccess::None => Level::None,
        PathAccess::Read => Level::Read,
        PathAccess::ReadWrite => Level::ReadWrite,
    }
}

fn serve(channel: &mut UnixStream) -> ! {
    // Left uninitialised: zeroing it would make every page of it resident
    // in every idle leader (64 KiB per sandbox); untouched, only the pages
    // a child actually runs on ever cost memory.
    let mut stack = Box::<[u8]>::new_uninit_slice(CHILD_STACK_BYTES);
    loop {
        let (order, fds) = match read_message_with_fds::<SpawnOrder>(channel) {
            Ok(Some(message)) => message,
            // PID 1 retired this leader (or broke the channel).
            _ => sys::exit_now(0),
        };
        let answer = match spawn(channel, &order, &fds, &mut stack) {
            Ok(pid) => LeaderSays::Spawned { pid },
            Err((step, e)) => {
                LeaderSays::SpawnFailed { errno: e.raw_os_error().unwrap_or(libc::EIO), step: step.into() }
            }
        };
        drop(fds);
        if send_message(channel, &answer, &[]).is_err() {
            sys::exit_now(0)
        }
    }
}

/// What the child needs, prepared before `clone` so the child allocates
/// nothing.
struct Prepared {
    program: CString,
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    _env: Vec<CString>,
    env_ptrs: Vec<*const libc::c_char>,
    cwd: CString,
}

fn prepare(order: &SpawnOrder) -> io::Result<Prepared> {
    let cstring = |s: &str| CString::new(s).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL));
    let argv: Vec<CString> = order.argv.iter().map(|a| cstring(a)).collect::<io::Result<_>>()?;
    let env: Vec<CString> = order.env.iter().map(|(k, v)| cstring(&format!("{k}={v}"))).collect::<io::Result<_>>()?;
    let pointers =
        |strings: &[CString]| strings.iter().map(|s| s.as_ptr()).chain(std::iter::once(std::ptr::null())).collect();
    Ok(Prepared {
        program: cstring(&order.program)?,
        argv_ptrs: pointers(&argv),
        _argv: argv,
        env_ptrs: pointers(&env),
        _env: env,
        cwd: cstring(&order.cwd)?,
    })
}

/// The stack a child runs on between `clone` and `exec`: it shares the
/// leader's memory (`CLONE_VM`) and so cannot use the leader's stack. One
/// is enough, as the leader is suspended until its child has exec'd or
/// exited (`CLONE_VFORK`).
const CHILD_STACK_BYTES: usize = 64 * 1024;

/// Starts one process as PID 1's child in this leader's domain; on
/// failure, which step failed and why.
///
/// `clone(CLONE_VM | CLONE_VFORK)`, as `posix_spawn` does, not a `fork`:
/// the child does not copy the leader's page tables (nor the leader take a
/// copy-on-write fault for each page it writes afterwards), and it tells
/// PID 1 its pid itself, so no go-ahead has to wake it: one process
/// switch fewer per exec.
fn spawn(
    channel: &UnixStream,
    order: &SpawnOrder,
    fds: &[OwnedFd],
    stack: &mut [MaybeUninit<u8>],
) -> Result<i32, (&'static str, io::Error)> {
    if !(3..=MAX_FDS).contains(&fds.len()) {
        return Err(("descriptors", io::Error::from_raw_os_error(libc::EINVAL)));
    }
    let prepared = prepare(order).map_err(|e| ("arguments", e))?;
    let (error_rx, error_tx) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| ("pipe", io::Error::from(e)))?;
    let raw_fds: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let told = AtomicBool::new(false);
    let args = ChildArgs {
        prepared: &prepared,
        fds: &raw_fds,
        error_tx: error_tx.as_raw_fd(),
        channel: channel.as_raw_fd(),
        told: &told,
    };
    // The stack grows down from its 16-byte aligned top.
    let top = (stack.as_mut_ptr() as usize + stack.len()) & !15;
    let flags = libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PARENT | libc::SIGCHLD;
    // SAFETY: the leader is single-threaded and suspended until the child
    // has exec'd or exited, so nothing else touches the memory they share
    // meanwhile; the child runs `child_entry` on `stack`, which outlives
    // the call, and only reads `args` (alive until the call returns) and
    // stores to `told`, then makes raw system calls until it execs.
    let child = unsafe {
        libc::clone(child_entry, top as *mut libc::c_void, flags, (&args as *const ChildArgs<'_>).cast_mut().cast())
    };
    if child == -1 {
        return Err(("clone", io::Error::last_os_error()));
    }
    drop(error_tx);
    // A child killed before it could say its pid: PID 1 hears it from here
    // (before `Spawned`, as always).
    if !told.load(Ordering::SeqCst) && send_message(channel, &LeaderSays::Cloned { pid: child }, &[]).is_err() {
        sys::exit_now(0)
    }
    // The child has exec'd (the pipe closed on exec) or exited; a failed
    // step's report is in the pipe already.
    let mut report = [0u8; 8];
    let mut got = 0;
    while got < report.len() {
        match rustix::io::read(&error_rx, &mut report[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(("exec report", e.into())),
        }
    }
    match got {
        // The pipe closed on exec: the program runs.
        0 => Ok(child),
        8 => {
            let errno = i32::from_ne_bytes([report[0], report[1], report[2], report[3]]);
            let step = CHILD_STEPS.get(u32::from_ne_bytes([report[4], report[5], report[6], report[7]]) as usize);
            Err((step.copied().unwrap_or("exec"), io::Error::from_raw_os_error(errno)))
        }
        _ => Err(("exec report", io::Error::from(io::ErrorKind::UnexpectedEof))),
    }
}

/// The child's steps, numbered for the error report.
const CHILD_STEPS: [&str; 6] = ["setsid", "prctl(PR_SET_CHILD_SUBREAPER)", "dup2", "chdir", "execve", "announce"];

/// What the child reads from the leader's memory.
struct ChildArgs<'a> {
    prepared: &'a Prepared,
    fds: &'a [RawFd],
    /// Where it reports a failed step (close-on-exec).
    error_tx: RawFd,
    /// The leader's channel to PID 1, on which it announces its pid.
    channel: RawFd,
    /// Set once the announcement is sent.
    told: &'a AtomicBool,
}

/// `Cloned { pid }` as [`send_message`] frames it, built without
/// allocating: the child shares the leader's heap.
fn cloned_message(pid: i32, buf: &mut [u8; 64]) -> usize {
    let mut digits = [0u8; 10];
    let mut n = pid.unsigned_abs();
    let mut len = 0;
    loop {
        digits[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    const HEAD: &[u8] = br#"{"says":"cloned","pid":"#;
    let body_len = HEAD.len() + len + 1;
    buf[..4].copy_from_slice(&(body_len as u32).to_be_bytes());
    buf[4..4 + HEAD.len()].copy_from_slice(HEAD);
    for (i, d) in digits[..len].iter().rev().enumerate() {
        buf[4 + HEAD.len() + i] = *d;
    }
    buf[4 + body_len - 1] = b'}';
    4 + body_len
}

/// The child between `clone` and `exec`. Like `exec::prepare_child`: it
/// first tells PID 1 its pid (before the program can run, and so before it
/// can kill this leader), then takes its own session and child-subreaper
/// status (so PID 1's `kill_tree` finds the whole tree), `fds` as 0, 1, 2,
/// ..., everything else closed on exec, default signal dispositions.
/// Never returns.
extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` of `spawn`, alive (and not written)
    // while the leader is suspended in `clone`.
    let args = unsafe { &*(arg as *const ChildArgs<'_>) };
    let error_tx = args.error_tx;
    let fail = |step: u32| -> ! {
        let errno = io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        let mut report = [0u8; 8];
        report[..4].copy_from_slice(&errno.to_ne_bytes());
        report[4..].copy_from_slice(&step.to_ne_bytes());
        // SAFETY: write and _exit are async-signal-safe; `report` is a
        // valid buffer of its length.
        unsafe {
            libc::write(error_tx, report.as_ptr().cast(), report.len());
            libc::_exit(127)
        }
    };
    // SAFETY: raw system calls on integers, on buffers of this stack and on
    // the pointers prepared before the clone, which stay valid (the memory
    // is the leader's, which waits). The received descriptors are all above
    // EXE_FD, so no dup2 overwrites a source of a later one. No signal
    // handler can run on the shared memory: the leader has none (its
    // dispositions are the defaults), and this process resets its own.
    unsafe {
        let mut message = [0u8; 64];
        let len = cloned_message(libc::getpid(), &mut message);
        let mut sent = 0;
        while sent < len {
            let n = libc::send(args.channel, message[sent..len].as_ptr().cast(), len - sent, libc::MSG_NOSIGNAL);
            if n > 0 {
                sent += n as usize;
            } else if n == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            } else {
                // PID 1 is gone or the channel broke: this process must not run.
                fail(5)
            }
        }
        args.told.store(true, Ordering::SeqCst);
        sys::reset_signal_dispositions();
        if libc::setsid() == -1 {
            fail(0)
        }
        if libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) == -1 {
            fail(1)
        }
        for (target, &fd) in args.fds.iter().enumerate() {
            if libc::dup2(fd, target as RawFd) == -1 {
                fail(2)
            }
        }
        if libc::chdir(args.prepared.cwd.as_ptr()) == -1 {
            fail(3)
        }
        libc::close_range(args.fds.len() as libc::c_uint, libc::c_uint::MAX, libc::CLOSE_RANGE_CLOEXEC as i32);
        libc::execve(args.prepared.program.as_ptr(), args.prepared.argv_ptrs.as_ptr(), args.prepared.env_ptrs.as_ptr());
        fail(4)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_announces_itself_as_the_leader_would() {
        for pid in [1, 9, 10, 4_194_304, i32::MAX] {
            let mut buf = [0u8; 64];
            let len = cloned_message(pid, &mut buf);
            let (a, mut b) = UnixStream::pair().unwrap();
            (&a).write_all(&buf[..len]).unwrap();
            assert_eq!(read_message::<LeaderSays>(&mut b).unwrap(), LeaderSays::Cloned { pid });
        }
    }

    #[test]
    fn messages_carry_descriptors_on_their_length_prefix() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let order = SpawnOrder {
            program: "/bin/true".into(),
            argv: vec!["true".into()],
            env: BTreeMap::new(),
            cwd: "/".into(),
        };
        let (r, w) = rustix::pipe::pipe().unwrap();
        send_message(&a, &order, &[r.as_fd(), w.as_fd()]).unwrap();
        send_message(&a, &LeaderSays::Ready, &[]).unwrap();
        let (got, fds) = read_message_with_fds::<SpawnOrder>(&mut b).unwrap().unwrap();
        assert_eq!(got, order);
        assert_eq!(fds.len(), 2);
        // The received write end writes into the original pipe.
        rustix::io::write(&fds[1], b"x").unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(rustix::io::read(&r, &mut byte), Ok(1));
        assert_eq!(read_message::<LeaderSays>(&mut b).unwrap(), LeaderSays::Ready);
        drop(a);
        assert!(read_message_with_fds::<SpawnOrder>(&mut b).unwrap().is_none());
    }
}

//! The init zygote (see `proto::zygote`): exec'd once by the node, it forks
//! the first init of each new container sandbox. A create then pays a fork
//! of this small single-threaded process instead of an exec of this binary
//! and glibc's static start-up, whose CPUID probes trap on a VM (about half
//! a millisecond of CPU each time on the machines Warren was measured on).
//!
//! Each child starts as a copy of the zygote, so children share its
//! address-space layout and glibc's stack-protector canary; the node
//! replaces its zygote after a bounded number of spawns so that few
//! sandboxes share one. The zygote holds nothing of any sandbox: it closes
//! its copies of a request's descriptors as soon as the child is forked.
//!
//! It lives in the template mount namespace (see `template`), so a first
//! init's own mount namespace starts as a copy of four mounts, not of
//! the host's whole table.
//!
//! It ends when the node closes its socket (the node exited or replaced
//! it); sandboxes it started are not its to end.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use rustix::net::RecvAncillaryBuffer;
use rustix::process::DumpableBehavior;
use warren_init::proto::setup::InitSays;
use warren_init::proto::zygote::{Reply, Request, MAX_REQUEST_FDS, REQUEST_BYTES, SOCKET_FD};
use warren_init::proto::{LISTEN_FD, SETUP_FD};

use crate::{setup, sys, template};

/// Fds at or above this are free in a child while it moves the received
/// ones into place.
const SCRATCH_FD: RawFd = 10;

/// `clone3` flags (linux/sched.h); the libc crate lacks some of them.
const CLONE_PIDFD: u64 = 0x1000;
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `struct clone_args` of `clone3(2)` (version 2, with `cgroup`).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Serves spawn requests until the node closes the socket; never returns.
pub fn main() -> ! {
    if let Err(e) = serve() {
        eprintln!("warren-init zygote: {e}");
        sys::exit_now(1)
    }
    sys::exit_now(0)
}

fn serve() -> io::Result<()> {
    // A host-root process like the first init it forks: nothing may
    // ptrace it or open its descriptors through /proc.
    rustix::process::set_dumpable_behavior(DumpableBehavior::NotDumpable)?;
    // The kernel reaps the children: the node watches each through its
    // pidfd, and a first init exits once it has forked its sandbox's PID 1.
    ignore_children()?;
    // SAFETY: the node hands the zygote its socket at SOCKET_FD, and
    // nothing else in this process owns it; it is wrapped exactly once.
    let socket = unsafe { OwnedFd::from_raw_fd(SOCKET_FD) };
    // Whatever else the node's process let through its exec is not ours
    // (and would reach no child, which closes all but its own, anyway).
    sys::close_from(SOCKET_FD + 1)?;
    // Before the first fork: every first init starts from this namespace.
    template::enter()?;
    let null = rustix::fs::open("/dev/null", rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC, 0.into())?;
    crate::seccomp::precompile();
    while let Some((request, fds)) = receive(&socket)? {
        let (reply, pidfd) = match request.and_then(|r| spawn(r, fds, &null)) {
            Ok((pid, pidfd)) => (Reply::Spawned { pid }, Some(pidfd)),
            Err(e) => (Reply::Failed { errno: e.raw_os_error().unwrap_or(libc::EIO) }, None),
        };
        send(&socket, reply, pidfd.as_ref())?;
    }
    Ok(())
}

/// The next request with its descriptors; `None` at EOF. A malformed
/// request (wrong size, wrong descriptor count, cut-off descriptors) is an
/// `EINVAL` for that request only.
fn receive(socket: &OwnedFd) -> io::Result<Option<(io::Result<Request>, Vec<OwnedFd>)>> {
    let mut bytes = [0u8; REQUEST_BYTES + 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_REQUEST_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let (got, fds) = warren_init::proto::recv_with_fds(socket.as_fd(), &mut bytes, &mut control)?;
    if got.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let cut = got.flags.intersects(rustix::net::ReturnFlags::CTRUNC | rustix::net::ReturnFlags::TRUNC);
    let request = Request::decode(&bytes[..got.bytes])
        .filter(|r| !cut && fds.len() == 3 + r.v1_tasks as usize)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL));
    Ok(Some((request, fds)))
}

fn send(socket: &OwnedFd, reply: Reply, pidfd: Option<&OwnedFd>) -> io::Result<()> {
    let fds: &[BorrowedFd<'_>] = match pidfd {
        Some(fd) => &[fd.as_fd()],
        None => &[],
    };
    warren_init::proto::send_with_fds(socket.as_fd(), &reply.encode(), fds).map(drop)
}

/// Forks the first init of a sandbox, born in its cgroup2 directory
/// (`fds[2]`); returns its pid and pidfd. The child never returns.
fn spawn(request: Request, fds: Vec<OwnedFd>, null: &OwnedFd) -> io::Result<(i32, OwnedFd)> {
    let mut pidfd: RawFd = -1;
    let mut args = CloneArgs {
        flags: CLONE_PIDFD | CLONE_INTO_CGROUP,
        pidfd: &mut pidfd as *mut RawFd as u64,
        exit_signal: libc::SIGCHLD as u64,
        cgroup: fds[2].as_raw_fd() as u64,
        ..CloneArgs::default()
    };
    // SAFETY: without CLONE_VM the child gets a copy of this address space
    // and continues on (a copy of) this stack, like fork(2). This process
    // is single-threaded, so no lock can be held in the copy; `args` and
    // `pidfd` outlive the call.
    let rc = unsafe { libc::syscall(libc::SYS_clone3, &mut args as *mut CloneArgs, std::mem::size_of::<CloneArgs>()) };
    match rc {
        -1 => Err(io::Error::last_os_error()),
        0 => become_first_init(request, &fds, null),
        pid => {
            // SAFETY: with CLONE_PIDFD the kernel stored a new descriptor
            // (close-on-exec) that nothing else owns.
            let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
            Ok((pid as i32, pidfd))
        }
    }
}

/// The child: joins the v1 cgroups, puts the descriptors where an exec'd
/// first init finds them, sets its limits and signal state, and runs the
/// setup sequence. A failure before the setup starts is reported on the
/// setup socket, as the setup's own failures are.
fn become_first_init(request: Request, fds: &[OwnedFd], null: &OwnedFd) -> ! {
    let [setup, listen, _unified, v1_tasks @ ..] = fds else { sys::exit_now(127) };
    let fail = |step: &str, e: io::Error| -> ! {
        let message = InitSays::Failed { message: format!("{step}: {e}") };
        if let Ok(mut line) = serde_json::to_vec(&message) {
            line.push(b'\n');
            let _ = rustix::io::write(setup, &line);
        }
        sys::exit_now(127)
    };
    for tasks in v1_tasks {
        // "0" names the calling thread, this child's only one.
        if let Err(e) = rustix::io::write(tasks, b"0") {
            fail("join the sandbox's v1 cgroups", e.into());
        }
    }
    if let Err(e) = place_fds(setup, listen, null) {
        fail("move the inherited descriptors into place", e);
    }
    if let Some((soft, hard)) = request.open_files {
        let limit = rustix::process::Rlimit { current: Some(soft), maximum: Some(hard) };
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit) {
            fail("set RLIMIT_NOFILE", e.into());
        }
    }
    if let Err(e) = default_children() {
        fail("restore SIGCHLD", e);
    }
    setup::run(false)
}

/// `/dev/null` at 0, 1 and 2, the setup socket at [`SETUP_FD`] and the
/// listener at [`LISTEN_FD`], every other descriptor closed (the zygote's
/// socket sits at [`SETUP_FD`] until the setup socket replaces it). Each
/// source is first copied above [`SCRATCH_FD`] so that no `dup2` can
/// overwrite another's source.
fn place_fds(setup: &OwnedFd, listen: &OwnedFd, null: &OwnedFd) -> io::Result<()> {
    let setup = rustix::io::fcntl_dupfd_cloexec(setup, SCRATCH_FD)?;
    let listen = rustix::io::fcntl_dupfd_cloexec(listen, SCRATCH_FD)?;
    let null = rustix::io::fcntl_dupfd_cloexec(null, SCRATCH_FD)?;
    for (source, target) in [(&null, 0), (&null, 1), (&null, 2), (&setup, SETUP_FD), (&listen, LISTEN_FD)] {
        // SAFETY: dup2 on an open descriptor of this process; replacing
        // `target` is the point, and this single-threaded child owns
        // whatever had that number (the zygote's copies are closed next).
        if unsafe { libc::dup2(source.as_raw_fd(), target) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    // The scratch copies, the zygote's socket and /dev/null, and the
    // request's other descriptors: the child keeps none of them. Their
    // owners (frames of the zygote's loop) never run again in this child,
    // so nothing closes a number twice.
    std::mem::forget((setup, listen, null));
    sys::close_from(LISTEN_FD + 1)
}

/// SIGCHLD ignored: the kernel reaps this process's children.
fn ignore_children() -> io::Result<()> {
    set_sigchld(libc::SIG_IGN)
}

/// SIGCHLD back to its default, as an exec'd first init has it (an
/// ignored disposition survives fork and exec).
fn default_children() -> io::Result<()> {
    set_sigchld(libc::SIG_DFL)
}

fn set_sigchld(handler: libc::sighandler_t) -> io::Result<()> {
    // SAFETY: an all-zero sigaction is a valid value; setting SIG_IGN or
    // SIG_DFL installs no code, so no handler can run on this process's
    // memory.
    let rc = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler;
        libc::sigaction(libc::SIGCHLD, &action, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

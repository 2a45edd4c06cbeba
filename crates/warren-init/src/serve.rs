//! PID 1's service loop: accept the host's connections on the inherited
//! listener, one thread per connection, and reap every child that ends
//! (woken by `SIGCHLD`, see `reaper`): an idle sandbox's PID 1 is this
//! thread and the seccomp supervisor, nothing else (a connection the host
//! keeps between execs holds a thread for at most [`IDLE_CONNECTION`]).
//!
//! Only the host may talk to init. The listener's path lives in a host
//! directory the sandbox cannot reach, and on top of that every peer must
//! live outside the sandbox's pid namespace: `SO_PEERCRED` then reports
//! pid 0, while any process inside the sandbox has a nonzero pid here. A
//! sandbox process that somehow got hold of the socket still cannot forge
//! a control message.

use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use warren_init::proto::{self, FrameKind, Request, Response, LISTEN_FD};

use crate::events::EventLog;
use crate::exec::{self, Context};
use crate::leader::StartError;
use crate::phase::Phases;
use crate::reaper::Registry;
use crate::sys;
use crate::vm::TamperWatch;
use rustix::event::{PollFd, PollFlags};

/// Stack of a connection thread: the pump keeps its buffers on the heap.
const CONNECTION_STACK_BYTES: usize = 256 * 1024;
/// How long the accept loop may block answering "busy" on a connection it
/// cannot serve (the host reads promptly; this only bounds a stuck peer).
const BUSY_ANSWER_TIMEOUT: Duration = Duration::from_millis(200);
/// How soon to try again to reap a child whose reaping had to wait for a
/// spawn in progress (see `Registry::reap_exited`).
const REAP_RETRY: rustix::time::Timespec = rustix::time::Timespec { tv_sec: 0, tv_nsec: 5_000_000 };
/// How long a connection may wait between execs before init ends it (and
/// its thread). Long enough to span an agent's think time between commands,
/// short enough that a sandbox left alone soon holds no thread for it.
const IDLE_CONNECTION: rustix::time::Timespec = rustix::time::Timespec { tv_sec: 30, tv_nsec: 0 };

/// What every connection can reach.
pub(crate) struct Shared {
    exec: Context,
    events: Arc<EventLog>,
    /// A VM's own tamper watch (a container's is the node's).
    tamper: Option<TamperWatch>,
}

impl Shared {
    /// `tamper`: a VM's own watch, which every phase switch updates.
    pub(crate) fn new(phases: Arc<Phases>, events: Arc<EventLog>, tamper: Option<TamperWatch>) -> Arc<Shared> {
        Arc::new(Shared { exec: Context { phases }, events, tamper })
    }
}

/// What PID 1's loop reaps for: the registry, and the signalfd that turns
/// readable when a child has ended (`sys::child_exit_fd`).
pub struct Reaping {
    pub registry: Arc<Registry>,
    pub children: OwnedFd,
}

pub fn run(phases: Arc<Phases>, events: Arc<EventLog>, reaping: Reaping) -> ! {
    // SAFETY: the host hands init fd LISTEN_FD as a listening unix socket
    // and nothing else in this process owns it; it is wrapped once, here.
    let listener = unsafe { UnixListener::from_raw_fd(LISTEN_FD) };
    if rustix::io::fcntl_setfd(&listener, rustix::io::FdFlags::CLOEXEC).is_err() {
        sys::exit_now(1)
    }
    let ctx = Shared::new(phases, events, None);
    // A leader may have ended before the loop began (its SIGCHLD waits in
    // the signalfd, but there is no need to wait for the first poll).
    let mut reaped_all = reaping.registry.reap_exited();
    loop {
        let retry = (!reaped_all).then_some(&REAP_RETRY);
        let mut fds = [PollFd::new(&listener, PollFlags::IN), PollFd::new(&reaping.children, PollFlags::IN)];
        match rustix::event::poll(&mut fds, retry) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            // ENOMEM passes: back off as after a failed accept rather than
            // spin (and end the sandbox, as there, on a broken descriptor).
            Err(e) => {
                wait_after_accept_error(&io::Error::from(e));
                continue;
            }
        }
        let (connection, child_ended) = (!fds[0].revents().is_empty(), !fds[1].revents().is_empty());
        if child_ended || !reaped_all {
            sys::drain_child_exit_fd(reaping.children.as_fd());
            reaped_all = reaping.registry.reap_exited();
        }
        if connection {
            match listener.accept() {
                Ok((conn, _)) => admit(&ctx, conn),
                Err(e) => wait_after_accept_error(&e),
            }
        }
    }
}

fn admit(ctx: &Arc<Shared>, conn: UnixStream) {
    match sys::peer_pid(conn.as_fd()) {
        Ok(0) => {}
        // Inside the sandbox (or unknowable): refuse by closing.
        _ => return,
    }
    // A second handle costs a descriptor, not a pid: when the sandbox's
    // processes hold every pid of its cgroup (a fork bomb), the thread
    // cannot start but the host still gets an answer instead of a silently
    // closed connection it could mistake for a dead init.
    let answer_busy = conn.try_clone().ok();
    let ctx = Arc::clone(ctx);
    let started = std::thread::Builder::new()
        .name("conn".into())
        .stack_size(CONNECTION_STACK_BYTES)
        .spawn(move || serve_connection(&ctx, conn));
    if let (Err(e), Some(mut conn)) = (started, answer_busy) {
        let _ = conn.set_write_timeout(Some(BUSY_ANSWER_TIMEOUT));
        let _ = conn.set_read_timeout(Some(BUSY_ANSWER_TIMEOUT));
        // Take the request off the wire first: closing a socket with unread
        // data resets it, and the host would read the reset, not the answer.
        let _ = proto::read_frame(&mut conn);
        let busy = Response::Error {
            message: format!("the sandbox's init cannot start a thread ({e}): its pids limit is exhausted"),
            not_found: false,
            busy: true,
        };
        let _ = proto::write_json(&mut conn, FrameKind::Response, &busy);
        // Whatever else the host sent (e.g. stdin) is drained until it
        // closes, for the same reason.
        let _ = conn.shutdown(std::net::Shutdown::Write);
        let _ = io::copy(&mut conn, &mut io::sink());
    }
}

/// Out of descriptors or memory: the condition passes as execs end, so wait
/// a little instead of spinning on `accept`.
fn wait_after_accept_error(e: &io::Error) {
    match e.raw_os_error() {
        Some(libc::EINTR) | Some(libc::ECONNABORTED) => {}
        Some(libc::EBADF) | Some(libc::EINVAL) | Some(libc::ENOTSOCK) => {
            // The listener itself is broken: the sandbox cannot be driven
            // any more, so end it.
            sys::exit_now(1)
        }
        _ => std::thread::sleep(Duration::from_millis(10)),
    }
}

/// Serves a connection; also a microVM's mux streams (`vm::port`), whose
/// peer is always the node. A connection carries one request, or a series
/// of execs one after the other: after an exec that ended in order the host
/// may send the next exec on the same connection (it keeps one per sandbox
/// between execs), which then costs no connect, accept or thread. Any other
/// request ends the connection once answered.
pub(crate) fn serve_connection(ctx: &Shared, mut conn: UnixStream) {
    // The host may connect ahead of its first request (a claimed warm-pool
    // member's connection is made while the claim commits): such a
    // connection is ended when left idle, as one between two execs is.
    if !wait_readable(&conn, &IDLE_CONNECTION) {
        return;
    }
    let mut request = match proto::read_frame(&mut conn) {
        Ok(Some((FrameKind::Request, payload))) => serde_json::from_slice::<Request>(&payload),
        _ => return,
    };
    loop {
        let spec = match request {
            Ok(Request::Exec(spec)) => spec,
            other => return serve_one(ctx, conn, other),
        };
        let Some(reusable) = exec::run(&ctx.exec, conn, spec) else { return };
        conn = reusable.conn;
        request = match next_request(&conn, reusable.unread) {
            Some(next) => next,
            None => return,
        };
    }
}

/// The host's next request on a connection whose exec just ended. Frames
/// the host sent that exec after it had ended (stdin, its end, a kill that
/// crossed the `Exited` frame) come first and are passed over. `None` when
/// the host closes the connection, breaks the protocol, or leaves it idle
/// for [`IDLE_CONNECTION`] (the thread then ends, and the sandbox is back to
/// its idle shape; the host notices the close before it asks anything).
fn next_request(conn: &UnixStream, unread: Vec<u8>) -> Option<serde_json::Result<Request>> {
    let unread_len = unread.len() as u64;
    let mut unread = io::Cursor::new(unread);
    loop {
        if unread.position() == unread_len && !wait_readable(conn, &IDLE_CONNECTION) {
            return None;
        }
        match proto::read_frame(&mut io::Read::chain(&mut unread, conn)) {
            Ok(Some((FrameKind::Request, payload))) => return Some(serde_json::from_slice::<Request>(&payload)),
            Ok(Some((FrameKind::Stdin | FrameKind::StdinEof | FrameKind::Kill, _))) => {}
            _ => return None,
        }
    }
}

/// False when nothing arrived within `timeout` (or the poll failed).
fn wait_readable(conn: &UnixStream, timeout: &rustix::time::Timespec) -> bool {
    loop {
        let mut fds = [PollFd::new(conn, PollFlags::IN)];
        match rustix::event::poll(&mut fds, Some(timeout)) {
            Ok(0) => return false,
            Ok(_) => return true,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return false,
        }
    }
}

/// Answers a request other than a series of execs.
fn serve_one(ctx: &Shared, mut conn: UnixStream, request: serde_json::Result<Request>) {
    let request = match request {
        Ok(request) => match crate::fileserve::serve(request, &mut conn) {
            Some(other) => Ok(other),
            None => return,
        },
        Err(e) => Err(e),
    };
    match request {
        Ok(Request::Ping) => {
            let pong = Response::Pong { init_version: env!("CARGO_PKG_VERSION").to_string() };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &pong);
        }
        Ok(Request::Exec(spec)) => {
            let _ = exec::run(&ctx.exec, conn, spec);
        }
        Ok(Request::SetPhase { phase, kill_running }) => {
            let name = phase.name.clone();
            let answer = match ctx.exec.phases.switch(phase.clone(), kill_running) {
                Ok(killed) => {
                    // Before the answer: the switch is done once processes
                    // kept from earlier phases are held to its rules.
                    if let Some(watch) = &ctx.tamper {
                        watch.protect(&phase);
                    }
                    Response::PhaseSet { killed }
                }
                Err(StartError::Rejected(message)) => Response::PhaseRejected { message },
                Err(StartError::Io(e)) => Response::Error {
                    message: format!("cannot start phase `{name}`: {e}"),
                    not_found: false,
                    busy: false,
                },
            };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &answer);
        }
        Ok(Request::Events { after_seq }) => {
            let batch = ctx.events.after(after_seq);
            let events = Response::Events { events: batch.events, dropped: batch.dropped, next_seq: batch.next_seq };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &events);
        }
        Ok(Request::Identify { hostname, entropy, unix_time_ns }) => {
            let answer = match crate::vm::identify(hostname, entropy, unix_time_ns) {
                Ok(()) => Response::Identified,
                Err(message) => Response::Error { message, not_found: false, busy: false },
            };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &answer);
        }
        Ok(Request::PackUpper) => crate::pack::serve(&mut conn),
        Ok(Request::Limits) => {
            let answer = match crate::vm::limit_counters() {
                Ok(counters) => Response::Limits { counters },
                Err(message) => Response::Error { message, not_found: false, busy: false },
            };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &answer);
        }
        // Answered by `fileserve` above.
        Ok(
            Request::StatFile { .. }
            | Request::ListDir { .. }
            | Request::ReadFile { .. }
            | Request::WriteFile { .. }
            | Request::Mkdir { .. }
            | Request::RemoveFile { .. }
            | Request::RenameFile { .. },
        ) => {}
        Err(e) => {
            let error = Response::Error { message: format!("bad request: {e}"), not_found: false, busy: false };
            let _ = proto::write_json(&mut conn, FrameKind::Response, &error);
        }
    }
}

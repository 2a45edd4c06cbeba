//! One exec: start the process, then pump its pipes and the host's
//! connection in a single `poll` loop until it is over.
//!
//! The exec is over when the main process has been reaped AND stdout,
//! stderr (and a session's state pipe) reached EOF; or, after a kill, as
//! soon as the main process has been reaped (a process init could not see
//! may still hold a pipe; it must not keep a killed exec alive).
//!
//! Backpressure, both ways: output is only read from the pipes while less
//! than [`OUT_HIGH_WATER`] bytes wait for the socket, and the socket is only
//! read while less than [`STDIN_HIGH_WATER`] bytes wait for the child's
//! stdin. A host that closes the connection is noticed even while init does
//! not read from it (a unix stream socket reports `POLLHUP`).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use rustix::event::{PollFd, PollFlags};
use warren_init::proto::{self, ExecSpec, Exited, FrameKind, Response};

use crate::leader::SpawnOrder;
use crate::pathsearch::{self, LookupError};
use crate::phase::Phases;
use crate::reaper::{ExitReport, ExitWaiter};
use crate::session;
use crate::tree;

/// Largest output chunk per frame.
const CHUNK_BYTES: usize = 64 * 1024;
/// Stop reading the pipes while this much output waits for the host.
const OUT_HIGH_WATER: usize = 2 * CHUNK_BYTES;
/// Stop reading the host while this much stdin waits for the child.
const STDIN_HIGH_WATER: usize = 1 << 20;
/// A session state bigger than this is dropped (the exec still succeeds).
const STATE_MAX_BYTES: usize = 4 << 20;
/// After a kill, at most this many chunks per stream are still forwarded.
const DRAIN_MAX_CHUNKS: usize = 16;

/// Why an exec could not start; becomes `Response::Error`.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Lookup(#[from] LookupError),
    #[error("cwd {0}: not a directory")]
    BadCwd(String),
    #[error("capture_session_state needs argv [\"/bin/sh\", \"-c\", COMMAND]")]
    NotAShellCommand,
    #[error("empty argv")]
    EmptyArgv,
    #[error("{what}: {source}")]
    Sys {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl StartError {
    fn sys(what: &'static str) -> impl FnOnce(io::Error) -> StartError {
        move |source| StartError::Sys { what, source }
    }

    fn response(&self) -> Response {
        let not_found = match self {
            StartError::Lookup(LookupError::NotFound(_)) => true,
            StartError::Sys { source, .. } => source.kind() == io::ErrorKind::NotFound,
            _ => false,
        };
        let busy = matches!(self, StartError::Sys { source, .. } if source.raw_os_error() == Some(libc::EAGAIN));
        Response::Error { message: self.to_string(), not_found, busy }
    }
}

/// What init shares with every exec.
pub struct Context {
    /// The current phase, whose leader starts every process.
    pub phases: std::sync::Arc<Phases>,
}

/// A connection whose exec is over and that may carry the host's next
/// request, with what was read past the exec's last frame.
pub struct Reusable {
    pub conn: UnixStream,
    pub unread: Vec<u8>,
}

/// Runs `spec` for the host on `conn` until the exec is over. Gives the
/// connection back when the exec ended with the connection in order (the
/// host saw `Exited` or the start error, in whole frames).
pub fn run(ctx: &Context, mut conn: UnixStream, spec: ExecSpec) -> Option<Reusable> {
    let started = match start(ctx, &spec) {
        Ok(started) => started,
        Err(e) => {
            return send_response(&mut conn, &e.response()).ok().map(|()| Reusable { conn, unread: Vec::new() });
        }
    };
    let pid = started.pid;
    if send_response(&mut conn, &Response::Started { pid }).is_err() {
        // The host is gone before the exec began: nothing may outlive it.
        tree::kill_tree(pid, &started.pipe_inodes());
        let _ = started.exit.report.recv();
        return None;
    }
    Pump::new(conn, started).run()
}

/// One frame in one write: the host's reader wakes once, not for the
/// header and again for the payload.
fn send_response(conn: &mut UnixStream, response: &Response) -> io::Result<()> {
    let mut frame = Vec::with_capacity(64);
    proto::write_json(&mut frame, FrameKind::Response, response)?;
    conn.write_all(&frame)
}

/// A started process and init's ends of its pipes.
struct Started {
    pid: i32,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    state: Option<OwnedFd>,
    exit: ExitWaiter,
}

impl Started {
    fn pipe_inodes(&self) -> Vec<u64> {
        [Some(&self.stdin), Some(&self.stdout), Some(&self.stderr), self.state.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|fd| rustix::fs::fstat(fd).ok().map(|st| st.st_ino))
            .collect()
    }
}

/// The program, arguments and extra descriptors of an exec.
struct Plan {
    program: PathBuf,
    argv: Vec<String>,
    /// For a session: the pipe's write end for the shell's fd 3.
    state_tx: Option<OwnedFd>,
    state_rx: Option<OwnedFd>,
}

fn plan(spec: &ExecSpec) -> Result<Plan, StartError> {
    let cwd = Path::new(&spec.cwd);
    if !std::fs::metadata(cwd).is_ok_and(|m| m.is_dir()) {
        return Err(StartError::BadCwd(spec.cwd.clone()));
    }
    if !spec.capture_session_state {
        let program = spec.argv.first().ok_or(StartError::EmptyArgv)?;
        let program = pathsearch::resolve(program, &spec.env, cwd)?;
        return Ok(Plan { program, argv: spec.argv.clone(), state_tx: None, state_rx: None });
    }
    let cmd = session::shell_command(&spec.argv).ok_or(StartError::NotAShellCommand)?;
    let program = pathsearch::resolve(session::SHELL, &spec.env, cwd)?;
    let (rx, tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| StartError::Sys { what: "pipe", source: e.into() })?;
    Ok(Plan {
        program,
        argv: vec![session::SHELL.into(), "-c".into(), session::wrap_command(cmd)],
        state_tx: Some(tx),
        state_rx: Some(rx),
    })
}

fn start(ctx: &Context, spec: &ExecSpec) -> Result<Started, StartError> {
    let mut plan = plan(spec)?;
    let pipe = || {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| StartError::Sys { what: "pipe", source: e.into() })
    };
    let (stdin_rx, stdin_tx) = pipe()?;
    let (stdout_rx, stdout_tx) = pipe()?;
    let (stderr_rx, stderr_tx) = pipe()?;
    let order = SpawnOrder {
        program: plan.program.to_string_lossy().into_owned(),
        argv: plan.argv.clone(),
        env: spec.env.clone(),
        cwd: spec.cwd.clone(),
    };
    let mut fds = vec![stdin_rx.as_fd(), stdout_tx.as_fd(), stderr_tx.as_fd()];
    if let Some(state_tx) = &plan.state_tx {
        fds.extend([state_tx.as_fd(), ctx.phases.self_exe()]);
    }
    let (pid, exit) = ctx.phases.spawn(&order, &fds).map_err(StartError::sys("spawn"))?;
    // The child has its copies; init's must close or the pipes never end.
    drop(fds);
    plan.state_tx = None;
    drop((stdin_rx, stdout_tx, stderr_tx));
    Ok(Started { pid, stdin: stdin_tx, stdout: stdout_rx, stderr: stderr_rx, state: plan.state_rx, exit })
}

/// The state of one running exec's pump.
struct Pump {
    conn: UnixStream,
    /// False once the host closed the connection (or it broke).
    conn_open: bool,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    out_sent: usize,
    stdin: Option<OwnedFd>,
    stdin_buf: Vec<u8>,
    stdin_sent: usize,
    stdin_eof: bool,
    stdout: Option<OwnedFd>,
    stderr: Option<OwnedFd>,
    state: Option<OwnedFd>,
    state_buf: Vec<u8>,
    state_overflow: bool,
    pid: i32,
    pipe_inodes: Vec<u64>,
    exit: ExitWaiter,
    wake_open: bool,
    /// The process's pidfd until it is reaped (see `ExitWaiter::pidfd`).
    pidfd: Option<OwnedFd>,
    reaped: Option<ExitReport>,
    killed: bool,
    scratch: Vec<u8>,
    /// The guest kernel's OOM kill count when the exec started (microVMs only).
    oom_kills_before: Option<u64>,
}

/// Which descriptor each `PollFd` slot is.
#[derive(Clone, Copy)]
enum Slot {
    Conn,
    Stdout,
    Stderr,
    State,
    Stdin,
    Wake,
    Exited,
}

impl Pump {
    fn new(conn: UnixStream, mut started: Started) -> Pump {
        let pipe_inodes = started.pipe_inodes();
        let pidfd = started.exit.pidfd.take();
        let mut pump = Pump {
            conn,
            conn_open: true,
            inbuf: Vec::new(),
            out: Vec::new(),
            out_sent: 0,
            stdin: Some(started.stdin),
            stdin_buf: Vec::new(),
            stdin_sent: 0,
            stdin_eof: false,
            stdout: Some(started.stdout),
            stderr: Some(started.stderr),
            state: started.state,
            state_buf: Vec::new(),
            state_overflow: false,
            pid: started.pid,
            pipe_inodes,
            exit: started.exit,
            wake_open: true,
            pidfd,
            reaped: None,
            killed: false,
            scratch: vec![0u8; CHUNK_BYTES],
            oom_kills_before: crate::vm::oom_kills(),
        };
        if pump.set_nonblocking().is_err() {
            // Without non-blocking descriptors the loop could hang on one
            // of them: treat it as a lost connection.
            pump.lose_connection();
        }
        pump
    }

    fn set_nonblocking(&self) -> io::Result<()> {
        self.conn.set_nonblocking(true)?;
        for fd in [&self.stdin, &self.stdout, &self.stderr, &self.state].into_iter().flatten() {
            rustix::io::ioctl_fionbio(fd, true)?;
        }
        Ok(())
    }

    fn run(mut self) -> Option<Reusable> {
        while !self.is_over() {
            self.poll_once();
        }
        if self.killed {
            self.drain_pipes();
        }
        if !self.conn_open || self.send_exited().is_err() {
            return None;
        }
        Some(Reusable { conn: self.conn, unread: self.inbuf })
    }

    fn is_over(&self) -> bool {
        let Some(_) = self.reaped else { return false };
        self.killed || !self.conn_open || (self.stdout.is_none() && self.stderr.is_none() && self.state.is_none())
    }

    fn poll_once(&mut self) {
        let mut slots = Vec::with_capacity(6);
        let mut fds = Vec::with_capacity(6);
        if self.conn_open {
            let mut events = PollFlags::empty();
            if self.stdin_buf.len() < STDIN_HIGH_WATER {
                events |= PollFlags::IN;
            }
            if self.out_sent < self.out.len() {
                events |= PollFlags::OUT;
            }
            fds.push(PollFd::new(&self.conn, events));
            slots.push(Slot::Conn);
        }
        let room_for_output = self.out.len() - self.out_sent < OUT_HIGH_WATER;
        for (fd, slot, wanted) in [
            (&self.stdout, Slot::Stdout, room_for_output),
            (&self.stderr, Slot::Stderr, room_for_output),
            (&self.state, Slot::State, true),
        ] {
            if let (Some(fd), true) = (fd, wanted) {
                fds.push(PollFd::new(fd, PollFlags::IN));
                slots.push(slot);
            }
        }
        if let (Some(fd), true) = (&self.stdin, self.stdin_sent < self.stdin_buf.len()) {
            fds.push(PollFd::new(fd, PollFlags::OUT));
            slots.push(Slot::Stdin);
        }
        if self.wake_open {
            fds.push(PollFd::new(&self.exit.wake, PollFlags::IN));
            slots.push(Slot::Wake);
        }
        if let (Some(fd), None) = (&self.pidfd, &self.reaped) {
            fds.push(PollFd::new(fd, PollFlags::IN));
            slots.push(Slot::Exited);
        }
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return,
            // Only EINVAL/ENOMEM are possible: nothing can be pumped.
            Err(_) => {
                self.lose_connection();
                return;
            }
        }
        let ready: Vec<(Slot, PollFlags)> = slots.iter().copied().zip(fds.iter().map(PollFd::revents)).collect();
        drop(fds);
        for (slot, revents) in ready {
            if revents.is_empty() {
                continue;
            }
            match slot {
                Slot::Conn => self.on_conn(revents),
                Slot::Stdout => self.on_output(FrameKind::Stdout),
                Slot::Stderr => self.on_output(FrameKind::Stderr),
                Slot::State => self.on_state(),
                Slot::Stdin => self.on_stdin_writable(),
                Slot::Wake => self.on_wake(),
                Slot::Exited => self.on_exited(),
            }
        }
        if self.stdin_eof && self.stdin_sent == self.stdin_buf.len() {
            self.stdin = None;
        }
    }

    fn on_conn(&mut self, revents: PollFlags) {
        if revents.intersects(PollFlags::OUT) {
            self.flush_some();
        }
        if !self.conn_open {
            return;
        }
        let hung_up = revents.intersects(PollFlags::HUP | PollFlags::ERR);
        if revents.intersects(PollFlags::IN) || hung_up {
            self.read_conn(hung_up);
        }
    }

    /// Reads what the host sent. After a hang-up, reads to the end even
    /// past the stdin high-water mark: a `Kill` may be queued there.
    fn read_conn(&mut self, to_the_end: bool) {
        loop {
            match self.conn.read(&mut self.scratch) {
                Ok(0) => {
                    self.handle_frames();
                    self.lose_connection();
                    return;
                }
                Ok(n) => {
                    self.inbuf.extend_from_slice(&self.scratch[..n]);
                    if !to_the_end {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.handle_frames();
                    self.lose_connection();
                    return;
                }
            }
        }
        self.handle_frames();
    }

    /// Acts on every complete frame in `inbuf`.
    fn handle_frames(&mut self) {
        let mut used = 0;
        while self.inbuf.len() - used >= 5 {
            let header: [u8; 5] = self.inbuf[used..used + 5].try_into().unwrap_or([0; 5]);
            let Ok((kind, len)) = proto::parse_header(header) else {
                self.inbuf.clear();
                self.lose_connection();
                return;
            };
            let end = used + 5 + len as usize;
            if self.inbuf.len() < end {
                break;
            }
            match kind {
                FrameKind::Stdin if !self.stdin_eof && self.stdin.is_some() => {
                    self.stdin_buf.extend_from_slice(&self.inbuf[used + 5..end])
                }
                // Stdin after EOF, or for a child that closed its stdin.
                FrameKind::Stdin => {}
                FrameKind::StdinEof => self.stdin_eof = true,
                FrameKind::Kill => self.kill(),
                // A second request, or an init-to-host kind: the host is
                // confused; end the exec the safe way.
                _ => {
                    self.inbuf.clear();
                    self.lose_connection();
                    return;
                }
            }
            used = end;
        }
        self.inbuf.drain(..used);
    }

    fn on_output(&mut self, kind: FrameKind) {
        let fd = match kind {
            FrameKind::Stdout => &mut self.stdout,
            _ => &mut self.stderr,
        };
        let Some(pipe) = fd.as_ref() else { return };
        match rustix::io::read(pipe, &mut self.scratch) {
            Ok(0) => *fd = None,
            Ok(n) => {
                if self.conn_open {
                    // Writing into a Vec cannot fail.
                    let _ = proto::write_frame(&mut self.out, kind, &self.scratch[..n]);
                    self.flush_some();
                }
            }
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => *fd = None,
        }
    }

    fn on_state(&mut self) {
        let Some(pipe) = self.state.as_ref() else { return };
        match rustix::io::read(pipe, &mut self.scratch) {
            Ok(0) => self.state = None,
            Ok(n) if self.state_buf.len() + n <= STATE_MAX_BYTES => {
                self.state_buf.extend_from_slice(&self.scratch[..n])
            }
            Ok(_) => {
                self.state_overflow = true;
                self.state_buf = Vec::new();
            }
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
            Err(_) => self.state = None,
        }
    }

    fn on_stdin_writable(&mut self) {
        let Some(pipe) = self.stdin.as_ref() else { return };
        match rustix::io::write(pipe, &self.stdin_buf[self.stdin_sent..]) {
            Ok(n) => {
                self.stdin_sent += n;
                if self.stdin_sent == self.stdin_buf.len() {
                    self.stdin_buf.clear();
                    self.stdin_sent = 0;
                }
            }
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => {}
            // EPIPE: the child closed its stdin; what is left has no reader.
            Err(_) => self.close_stdin(),
        }
    }

    fn close_stdin(&mut self) {
        self.stdin = None;
        self.stdin_buf = Vec::new();
        self.stdin_sent = 0;
    }

    fn on_wake(&mut self) {
        if let Ok(report) = self.exit.report.try_recv() {
            self.reaped = Some(report);
        }
        // The reaper closes the write end right after sending: once it has,
        // there is nothing more to wait for on this descriptor.
        let mut byte = [0u8; 1];
        if matches!(rustix::io::read(&self.exit.wake, &mut byte), Ok(0)) {
            self.wake_open = false;
            if self.reaped.is_none() {
                // Sent before the close, so it is there now.
                self.reaped = self.exit.report.try_recv().ok();
            }
        }
    }

    /// The pidfd says the process exited: reap it here rather than wait for
    /// PID 1's loop to do it and wake this thread.
    fn on_exited(&mut self) {
        self.exit.reap_now();
        if self.reaped.is_none() {
            self.reaped = self.exit.report.try_recv().ok();
        }
        // Reaped by now, here or by PID 1 (whose report `wake` brings): the
        // pidfd stays readable and must not be polled again.
        self.pidfd = None;
    }

    /// Writes as much pending output as the socket takes now.
    fn flush_some(&mut self) {
        while self.conn_open && self.out_sent < self.out.len() {
            match self.conn.write(&self.out[self.out_sent..]) {
                Ok(n) => self.out_sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.lose_connection();
                    return;
                }
            }
        }
        self.out.clear();
        self.out_sent = 0;
    }

    /// The host asked for it: kill the tree, then report.
    fn kill(&mut self) {
        if !self.killed {
            self.killed = true;
            self.close_stdin();
            tree::kill_tree(self.pid, &self.pipe_inodes);
        }
    }

    /// The host is gone (or broke the protocol): nothing of the exec may
    /// outlive it, and nothing more is sent.
    fn lose_connection(&mut self) {
        if !self.conn_open {
            return;
        }
        self.conn_open = false;
        self.out = Vec::new();
        self.out_sent = 0;
        self.close_stdin();
        if !self.killed {
            self.killed = true;
            tree::kill_tree(self.pid, &self.pipe_inodes);
        }
    }

    /// After a kill: forward what is already in the pipes, without waiting
    /// for writers init could not kill.
    fn drain_pipes(&mut self) {
        for kind in [FrameKind::Stdout, FrameKind::Stderr] {
            for _ in 0..DRAIN_MAX_CHUNKS {
                let open = match kind {
                    FrameKind::Stdout => self.stdout.is_some(),
                    _ => self.stderr.is_some(),
                };
                let before = self.out.len();
                if !open {
                    break;
                }
                self.on_output(kind);
                if self.out.len() == before {
                    break;
                }
            }
        }
    }

    fn send_exited(&mut self) -> io::Result<()> {
        let Some(report) = self.reaped else { return Err(io::Error::other("the exec was not reaped")) };
        let session_state = match (self.killed, self.state_overflow) {
            (false, false) if !self.state_buf.is_empty() => session::parse_state(&self.state_buf),
            _ => None,
        };
        let exited = Exited {
            exit_code: report.exit_code,
            signal: report.signal,
            killed: self.killed,
            cpu_user_us: report.cpu_user_us,
            cpu_system_us: report.cpu_system_us,
            max_rss_bytes: report.max_rss_bytes,
            session_state,
            oom_killed: self.oom_kills_before.and_then(|before| crate::vm::oom_kills().map(|now| now > before)),
        };
        proto::write_json(&mut self.out, FrameKind::Response, &Response::Exited(exited))?;
        self.conn.set_nonblocking(false)?;
        self.conn.write_all(&self.out[self.out_sent..])
    }
}

//! Talking to a running sandbox's init over its control socket, framed as
//! in [`warren_init::proto`]: one connection per request, except that a
//! container's execs reuse the connection of an exec that ended in order
//! ([`IdleConnections`]).

use std::collections::HashMap;
use std::io::{self, ErrorKind};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};
use warren_guard::cgroup::SandboxCgroup;
use warren_init::proto::{self, ExecSpec, FrameKind, PhaseRules, Request, Response};

use crate::{BackendError, EventBatch, ExecControl, ExecEvent, ExecProcess, ExitInfo, Result};

/// Output frames buffered between init and the node. Small on purpose: when
/// the node stops reading, init blocks on the socket and the command on its
/// pipe, so nothing grows without bound.
const EVENT_BUFFER: usize = 16;
const CONTROL_BUFFER: usize = 16;
/// How long init may take to answer an exec with `Started` or `Error`.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Stdin up to this size travels in the exec request's own write (see
/// [`Feed`]): well within a socket's buffer, so the write never waits for
/// init to read it, and the start's timeout never covers a slow reader.
const FED_STDIN_MAX: usize = 64 * 1024;

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub(crate) async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> io::Result<Option<(FrameKind, Vec<u8>)>> {
    let mut header = [0u8; 5];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(io::Error::new(ErrorKind::UnexpectedEof, "truncated frame header")),
            n => got += n,
        }
    }
    let (kind, len) = proto::parse_header(header)?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    Ok(Some((kind, payload)))
}

pub(crate) async fn write_frame(w: &mut (impl AsyncWrite + Unpin), kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| io::Error::other("frame too large"))?;
    let mut frame = Vec::with_capacity(5 + payload.len());
    frame.push(kind as u8);
    frame.extend_from_slice(&len.to_be_bytes());
    frame.extend_from_slice(payload);
    w.write_all(&frame).await?;
    w.flush().await
}

async fn send_request(w: &mut (impl AsyncWrite + Unpin), request: &Request) -> io::Result<()> {
    let payload = serde_json::to_vec(request).map_err(io::Error::other)?;
    write_frame(w, FrameKind::Request, &payload).await
}

/// A missing or refusing socket means init is gone.
async fn connect(sock: &Path) -> Result<UnixStream> {
    crate::unix_sock::connect(sock).await.map_err(|e| match e.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => BackendError::Gone,
        _ => BackendError::io(format!("connect {}", sock.display()), e),
    })
}

fn parse_response(payload: &[u8]) -> Result<Response> {
    serde_json::from_slice(payload).map_err(|e| BackendError::Protocol(format!("bad response: {e}")))
}

/// True when init answers a `Ping` with `Pong` within `timeout`.
pub(crate) async fn ping(sock: &Path, timeout: Duration) -> bool {
    let exchange = async {
        let mut stream = connect(sock).await.ok()?;
        send_request(&mut stream, &Request::Ping).await.ok()?;
        let (kind, payload) = read_frame(&mut stream).await.ok()??;
        let answer = (kind == FrameKind::Response).then(|| parse_response(&payload).ok()).flatten()?;
        // An error answer (init too busy to serve the request) still proves
        // init alive and listening.
        Some(matches!(answer, Response::Pong { .. } | Response::Error { .. }))
    };
    tokio::time::timeout(timeout, exchange).await.ok().flatten().unwrap_or(false)
}

/// The security events init recorded after `after_seq`.
pub(crate) async fn events(sock: &Path, after_seq: u64) -> Result<EventBatch> {
    let exchange = async {
        let mut stream = connect(sock).await?;
        send_request(&mut stream, &Request::Events { after_seq })
            .await
            .map_err(|e| BackendError::io("send events request", e))?;
        match read_frame(&mut stream).await.map_err(|e| BackendError::io("read events answer", e))? {
            Some((FrameKind::Response, payload)) => match parse_response(&payload)? {
                Response::Events { events, dropped, next_seq } => Ok(EventBatch { events, dropped, next_seq }),
                other => Err(BackendError::Protocol(format!("expected Events, got {other:?}"))),
            },
            Some((kind, _)) => Err(BackendError::Protocol(format!("expected a response frame, got {kind:?}"))),
            None => Err(BackendError::Gone),
        }
    };
    tokio::time::timeout(START_TIMEOUT, exchange)
        .await
        .map_err(|_| BackendError::Protocol(format!("no answer to events within {START_TIMEOUT:?}")))?
}

/// A VM's limit counters from its init (see `Request::Limits`); blocking,
/// for the node's limit watch, which runs off the runtime.
pub(crate) fn limit_counters_blocking(sock: &Path, timeout: Duration) -> Result<proto::LimitCounters> {
    let link = |e: io::Error| BackendError::io("ask init for its limit counters", e);
    let mut conn = crate::unix_sock::connect_std(sock).map_err(link)?;
    conn.set_read_timeout(Some(timeout)).and_then(|()| conn.set_write_timeout(Some(timeout))).map_err(link)?;
    proto::write_json(&mut conn, FrameKind::Request, &Request::Limits).map_err(link)?;
    match proto::read_frame(&mut conn).map_err(link)? {
        Some((FrameKind::Response, payload)) => match parse_response(&payload)? {
            Response::Limits { counters } => Ok(counters),
            other => Err(BackendError::Protocol(format!("expected Limits, got {other:?}"))),
        },
        Some((kind, _)) => Err(BackendError::Protocol(format!("expected a response frame, got {kind:?}"))),
        None => Err(BackendError::Gone),
    }
}

/// How long a phase switch may take: init builds the new ruleset (listing
/// the protected paths' ancestors) and may have many processes to kill.
const SET_PHASE_TIMEOUT: Duration = Duration::from_secs(60);

/// Makes `phase` current in the sandbox; returns how many processes init
/// killed on the way.
pub(crate) async fn set_phase(sock: &Path, phase: PhaseRules, kill_running: bool) -> Result<u32> {
    let exchange = async {
        let mut stream = connect(sock).await?;
        send_request(&mut stream, &Request::SetPhase { phase, kill_running })
            .await
            .map_err(|e| BackendError::io("send set_phase request", e))?;
        match read_frame(&mut stream).await.map_err(|e| BackendError::io("read set_phase answer", e))? {
            Some((FrameKind::Response, payload)) => match parse_response(&payload)? {
                Response::PhaseSet { killed } => Ok(killed),
                Response::PhaseRejected { message } => Err(BackendError::PhaseRejected(message)),
                Response::Error { message, .. } => Err(BackendError::io("phase switch", io::Error::other(message))),
                other => Err(BackendError::Protocol(format!("expected PhaseSet, got {other:?}"))),
            },
            Some((kind, _)) => Err(BackendError::Protocol(format!("expected a response frame, got {kind:?}"))),
            None => Err(BackendError::Gone),
        }
    };
    tokio::time::timeout(SET_PHASE_TIMEOUT, exchange)
        .await
        .map_err(|_| BackendError::Protocol(format!("no answer to set_phase within {SET_PHASE_TIMEOUT:?}")))?
}

/// Connections to the inits of running sandboxes that sit between two
/// execs, at most one per sandbox. An exec that ended in order (init sent
/// `Exited`) leaves its connection here, and the sandbox's next exec takes
/// it instead of connecting: no connect, accept, peer check or new thread
/// in init, and init's thread reads the request at once instead of after a
/// hop through PID 1's accept loop. The peer check still holds: it was made
/// when the connection was accepted, and only this process has its end.
///
/// Init closes a connection left idle (`IDLE_CONNECTION` in warren-init's
/// `serve`); an exec that finds its connection closed before any answer
/// connects anew, which is safe because init never closes a connection
/// after reading a request without answering it (it dies, and the new
/// connection finds the sandbox gone).
#[derive(Default)]
pub(crate) struct IdleConnections {
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    by_sandbox: HashMap<String, std::os::unix::net::UnixStream>,
    /// Closed connections are swept when the map grows past this (see `put`).
    sweep_above: usize,
}

/// Below this many idle connections, none are swept.
const SWEEP_FLOOR: usize = 64;

impl IdleConnections {
    fn lock(&self) -> MutexGuard<'_, Idle> {
        // Every mutation is one map operation: a poisoned map is still whole.
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self, sandbox: &str) -> Option<UnixStream> {
        let stream = self.lock().by_sandbox.remove(sandbox)?;
        // Still non-blocking, as tokio left it.
        UnixStream::from_std(stream).ok()
    }

    /// Keeps `stream` for the sandbox's next exec (unless one is kept
    /// already). A sandbox that ends is forgotten by its destroy; one whose
    /// exec ended while it was being destroyed can slip in after that, so
    /// whenever the map has doubled since the last sweep, the connections
    /// init has closed are dropped: the map stays within twice the live
    /// sandboxes that ran an exec.
    fn put(&self, sandbox: &str, stream: UnixStream) {
        let Ok(stream) = stream.into_std() else { return };
        let mut idle = self.lock();
        idle.by_sandbox.entry(sandbox.to_string()).or_insert(stream);
        if idle.by_sandbox.len() > idle.sweep_above.max(SWEEP_FLOOR) {
            idle.by_sandbox.retain(|_, stream| still_open(stream));
            idle.sweep_above = 2 * idle.by_sandbox.len();
        }
    }

    /// The sandbox ended: its connection goes.
    pub(crate) fn forget(&self, sandbox: &str) {
        self.lock().by_sandbox.remove(sandbox);
    }
}

/// Whether init still holds its end of an idle connection: nothing may be
/// readable on one (init sends nothing between execs), an end of stream
/// means closed.
fn still_open(stream: &std::os::unix::net::UnixStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(io::Read::read(&mut &*stream, &mut byte), Err(e) if e.kind() == ErrorKind::WouldBlock)
}

/// Opens a connection to the sandbox's init and keeps it for the next exec
/// (unless one is kept already): for a sandbox whose first exec is near.
/// Init ends it if no request comes within its idle time, which the exec
/// then finds closed before any answer and replaces.
pub(crate) async fn preconnect(sock: &Path, idle: &IdleConnections, sandbox: &str) {
    if idle.lock().by_sandbox.contains_key(sandbox) {
        return;
    }
    if let Ok(stream) = connect(sock).await {
        idle.put(sandbox, stream);
    }
}

/// Where an exec's connection comes from and goes back to.
pub(crate) struct Reuse {
    pub(crate) idle: Arc<IdleConnections>,
    pub(crate) sandbox: String,
}

/// Starts `spec` in the sandbox and returns once init said `Started`.
pub(crate) async fn start_exec(sock: &Path, spec: ExecSpec, cgroup: SandboxCgroup) -> Result<ExecProcess> {
    start_exec_reusing(sock, spec, cgroup, None).await
}

/// [`start_exec`] on the sandbox's idle connection when there is one; with
/// `reuse`, the connection goes back there once the exec ended in order.
pub(crate) async fn start_exec_reusing(
    sock: &Path,
    spec: ExecSpec,
    cgroup: SandboxCgroup,
    reuse: Option<Reuse>,
) -> Result<ExecProcess> {
    start_exec_fed(sock, spec, cgroup, reuse, None).await
}

/// The stdin an exec starts with: its bytes, then its end when `eof`.
pub(crate) struct Feed {
    pub(crate) stdin: Bytes,
    pub(crate) eof: bool,
}

/// [`start_exec_reusing`] with `feed` sent right behind the request, in the
/// same write when it is small: init finds it with the request and closes
/// the command's stdin (or fills it) without waking up again for a frame of
/// its own, and the node writes once. Frames sent ahead of init's answer
/// are safe: init reads them only once the command runs, and passes over
/// them if it does not start (or the connection is then dropped).
pub(crate) async fn start_exec_fed(
    sock: &Path,
    spec: ExecSpec,
    cgroup: SandboxCgroup,
    reuse: Option<Reuse>,
    feed: Option<Feed>,
) -> Result<ExecProcess> {
    let oom_kills_before = cgroup.oom_kills().unwrap_or(0);
    let request = serde_json::to_vec(&Request::Exec(spec)).map_err(|e| BackendError::Protocol(e.to_string()))?;
    let (ahead, behind) = match feed {
        Some(feed) if feed.stdin.len() <= FED_STDIN_MAX => (Some(feed), None),
        other => (None, other),
    };
    let mut wire = Vec::with_capacity(15 + request.len() + ahead.as_ref().map_or(0, |f| f.stdin.len()));
    push_frame(&mut wire, FrameKind::Request, &request);
    if let Some(feed) = &ahead {
        if !feed.stdin.is_empty() {
            push_frame(&mut wire, FrameKind::Stdin, &feed.stdin);
        }
        if feed.eof {
            push_frame(&mut wire, FrameKind::StdinEof, &[]);
        }
    }
    let kept = reuse.as_ref().and_then(|r| r.idle.take(&r.sandbox));
    let answered = async {
        if let Some(mut stream) = kept {
            match ask(&mut stream, &wire).await {
                Ok(Some(first)) => return Ok((stream, Some(first))),
                // Closed by init before it read anything: ask anew.
                Ok(None) => {}
                Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
                Err(e) => return Err(BackendError::io("read exec answer", e)),
            }
        }
        let mut stream = connect(sock).await?;
        let first = ask(&mut stream, &wire).await.map_err(|e| BackendError::io("exec request", e))?;
        Ok((stream, first))
    };
    let (stream, first) = tokio::time::timeout(START_TIMEOUT, answered)
        .await
        .map_err(|_| BackendError::Protocol(format!("no answer to exec within {START_TIMEOUT:?}")))??;
    let pid = match first {
        None => return Err(BackendError::Gone),
        Some((FrameKind::Response, payload)) => match parse_response(&payload)? {
            Response::Started { pid } => pid,
            Response::Error { message, busy: true, .. } => return Err(BackendError::Busy(message)),
            Response::Error { message, not_found: true, .. } => return Err(BackendError::ProgramNotFound(message)),
            Response::Error { message, not_found: false, .. } => return Err(BackendError::ExecRejected(message)),
            other => return Err(BackendError::Protocol(format!("expected Started, got {other:?}"))),
        },
        Some((kind, _)) => return Err(BackendError::Protocol(format!("expected a response frame, got {kind:?}"))),
    };

    let (events_tx, events) = mpsc::channel(EVENT_BUFFER);
    let (control, control_rx) = mpsc::channel(CONTROL_BUFFER);
    // Room for Started is there: the channel is new.
    let _ = events_tx.try_send(ExecEvent::Started { pid });
    // A large feed goes the usual way, first (the channel is new and has
    // room for both messages).
    if let Some(feed) = behind {
        if !feed.stdin.is_empty() {
            let _ = control.try_send(ExecControl::Stdin(feed.stdin));
        }
        if feed.eof {
            let _ = control.try_send(ExecControl::StdinEof);
        }
    }
    let (read_half, write_half) = stream.into_split();
    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(forward_control(write_half, control_rx, done_rx, reuse));
    tokio::spawn(pump_events(read_half, events_tx, done_tx, OomWatch { cgroup, oom_kills_before }));
    Ok(ExecProcess { events, control })
}

/// Sends encoded frames (a request first); returns init's first frame
/// (`None`: the connection closed before one came).
async fn ask(stream: &mut UnixStream, wire: &[u8]) -> io::Result<Option<(FrameKind, Vec<u8>)>> {
    stream.write_all(wire).await?;
    read_frame(stream).await
}

/// Appends one frame to `wire`. Payloads here are far below the frame limit.
fn push_frame(wire: &mut Vec<u8>, kind: FrameKind, payload: &[u8]) {
    wire.push(kind as u8);
    wire.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    wire.extend_from_slice(payload);
}

/// Tells whether the out-of-memory killer struck while the exec ran. Any
/// process of the tree counts (a shell's child killed by OOM makes the shell
/// exit 137, not die of SIGKILL); an OOM kill in a concurrent exec of the same
/// sandbox is attributed to both - the memory cgroup is per sandbox.
struct OomWatch {
    cgroup: SandboxCgroup,
    oom_kills_before: u64,
}

impl OomWatch {
    fn exit_info(&self, exited: proto::Exited) -> ExitInfo {
        // A microVM's init knows (the guest kernel's count); the cgroup
        // here is QEMU's, whose own OOM kill ends the whole VM.
        let oom =
            exited.oom_killed.unwrap_or_else(|| self.cgroup.oom_kills().is_ok_and(|now| now > self.oom_kills_before));
        ExitInfo {
            exit_code: exited.exit_code,
            signal: exited.signal,
            killed: exited.killed,
            oom,
            cpu_time: Duration::from_micros(exited.cpu_user_us.saturating_add(exited.cpu_system_us)),
            peak_memory_bytes: exited.max_rss_bytes,
            session_state: exited.session_state,
        }
    }
}

/// init -> node. Signals `done` when the exec ended (handing back the
/// read half: the connection is in order) or the connection did; drops it
/// unsignalled when the node stopped listening or init broke the protocol,
/// which makes the control forwarder kill the process tree.
async fn pump_events(
    mut from_init: OwnedReadHalf,
    events: mpsc::Sender<ExecEvent>,
    done: oneshot::Sender<Option<OwnedReadHalf>>,
    oom: OomWatch,
) {
    loop {
        let event = match read_frame(&mut from_init).await {
            Ok(Some((FrameKind::Stdout, payload))) => ExecEvent::Stdout(Bytes::from(payload)),
            Ok(Some((FrameKind::Stderr, payload))) => ExecEvent::Stderr(Bytes::from(payload)),
            Ok(Some((FrameKind::Response, payload))) => match parse_response(&payload) {
                Ok(Response::Exited(exited)) => {
                    // Before the event: a node that drops `control` on seeing
                    // it must not make the forwarder send a Kill.
                    let _ = done.send(Some(from_init));
                    let _ = events.send(ExecEvent::Exited(oom.exit_info(exited))).await;
                    return;
                }
                Ok(other) => return lost(events, format!("unexpected response {other:?}")).await,
                Err(e) => return lost(events, e.to_string()).await,
            },
            Ok(Some((kind, _))) => return lost(events, format!("unexpected frame {kind:?} from init")).await,
            Ok(None) => {
                let _ = done.send(None);
                return lost(events, "connection closed before the exit status".to_string()).await;
            }
            Err(e) => {
                let _ = done.send(None);
                return lost(events, format!("reading from init: {e}")).await;
            }
        };
        if events.send(event).await.is_err() {
            return;
        }
    }
}

async fn lost(events: mpsc::Sender<ExecEvent>, why: String) {
    let _ = events.send(ExecEvent::Lost(why)).await;
}

/// node -> init, until the exec is over. A dropped control sender kills the
/// tree, as does an event pump that ended without the exec finishing. An
/// exec that ended in order leaves its connection for the sandbox's next
/// one (with `reuse`): whatever this sent before is ahead of the next
/// request, and init passes over it.
async fn forward_control(
    mut to_init: OwnedWriteHalf,
    mut control: mpsc::Receiver<ExecControl>,
    mut done: oneshot::Receiver<Option<OwnedReadHalf>>,
    reuse: Option<Reuse>,
) {
    loop {
        let (kind, payload) = tokio::select! {
            // The end first: the pump signals it before the node sees the
            // exit and drops `control`, which must then neither kill nor
            // keep the connection from the next exec.
            biased;
            ended = &mut done => {
                match ended {
                    Ok(Some(from_init)) => {
                        if let (Some(reuse), Ok(stream)) = (reuse, from_init.reunite(to_init)) {
                            reuse.idle.put(&reuse.sandbox, stream);
                        }
                    }
                    Ok(None) => {}
                    Err(_) => {
                        let _ = write_frame(&mut to_init, FrameKind::Kill, &[]).await;
                    }
                }
                return;
            }
            message = control.recv() => match message {
                Some(ExecControl::Stdin(bytes)) => (FrameKind::Stdin, bytes),
                Some(ExecControl::StdinEof) => (FrameKind::StdinEof, Bytes::new()),
                Some(ExecControl::Kill) => (FrameKind::Kill, Bytes::new()),
                None => {
                    let _ = write_frame(&mut to_init, FrameKind::Kill, &[]).await;
                    return;
                }
            },
        };
        if write_frame(&mut to_init, kind, &payload).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn frames_round_trip_through_the_async_reader() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        write_frame(&mut a, FrameKind::Stdout, b"hi").await.unwrap();
        send_request(&mut a, &Request::Ping).await.unwrap();
        drop(a);
        assert_eq!(read_frame(&mut b).await.unwrap(), Some((FrameKind::Stdout, b"hi".to_vec())));
        let (kind, payload) = read_frame(&mut b).await.unwrap().unwrap();
        assert_eq!(kind, FrameKind::Request);
        assert_eq!(serde_json::from_slice::<Request>(&payload).unwrap(), Request::Ping);
        assert_eq!(read_frame(&mut b).await.unwrap(), None);
    }

    /// A stand-in for init's control listener that serves one connection
    /// with `serve`.
    async fn fake_init<F, Fut>(serve: F) -> (tempfile::TempDir, std::path::PathBuf, tokio::task::JoinHandle<()>)
    where
        F: FnOnce(UnixStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ctl.sock");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let task = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            serve(stream).await;
        });
        (dir, sock, task)
    }

    async fn respond(stream: &mut UnixStream, response: &Response) {
        write_frame(stream, FrameKind::Response, &serde_json::to_vec(response).unwrap()).await.unwrap();
    }

    fn no_cgroup() -> SandboxCgroup {
        SandboxCgroup::new("warren-test-none", "none").unwrap()
    }

    fn spec() -> ExecSpec {
        ExecSpec { argv: vec!["x".into()], env: Default::default(), cwd: "/".into(), capture_session_state: false }
    }

    #[tokio::test]
    async fn exec_streams_output_then_exit_and_passes_stdin() {
        let (_dir, sock, server) = fake_init(|mut s| async move {
            let (kind, _) = read_frame(&mut s).await.unwrap().unwrap();
            assert_eq!(kind, FrameKind::Request);
            respond(&mut s, &Response::Started { pid: 7 }).await;
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::Stdin, b"in".to_vec())));
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
            write_frame(&mut s, FrameKind::Stdout, b"out").await.unwrap();
            write_frame(&mut s, FrameKind::Stderr, b"err").await.unwrap();
            let exited = proto::Exited {
                exit_code: Some(3),
                signal: None,
                killed: false,
                cpu_user_us: 5,
                cpu_system_us: 7,
                max_rss_bytes: 100,
                session_state: None,
                oom_killed: None,
            };
            respond(&mut s, &Response::Exited(exited)).await;
        })
        .await;
        let mut p = start_exec(&sock, spec(), no_cgroup()).await.unwrap();
        p.control.send(ExecControl::Stdin(Bytes::from_static(b"in"))).await.unwrap();
        p.control.send(ExecControl::StdinEof).await.unwrap();
        assert!(matches!(p.events.recv().await, Some(ExecEvent::Started { pid: 7 })));
        assert!(matches!(p.events.recv().await, Some(ExecEvent::Stdout(b)) if b == "out"));
        assert!(matches!(p.events.recv().await, Some(ExecEvent::Stderr(b)) if b == "err"));
        match p.events.recv().await {
            Some(ExecEvent::Exited(exit)) => {
                assert_eq!(exit.exit_code, Some(3));
                assert_eq!(exit.cpu_time, Duration::from_micros(12));
                assert!(!exit.oom);
            }
            other => panic!("{other:?}"),
        }
        server.await.unwrap();
    }

    fn exited(code: i32) -> Response {
        Response::Exited(proto::Exited {
            exit_code: Some(code),
            signal: None,
            killed: false,
            cpu_user_us: 0,
            cpu_system_us: 0,
            max_rss_bytes: 0,
            session_state: None,
            oom_killed: None,
        })
    }

    /// Runs one exec to its end and returns its exit code.
    async fn run_to_end(sock: &Path, idle: &Arc<IdleConnections>) -> Option<i32> {
        let reuse = Reuse { idle: Arc::clone(idle), sandbox: "sb".into() };
        let mut p = start_exec_reusing(sock, spec(), no_cgroup(), Some(reuse)).await.unwrap();
        p.control.send(ExecControl::StdinEof).await.unwrap();
        loop {
            match p.events.recv().await {
                Some(ExecEvent::Exited(exit)) => return exit.exit_code,
                Some(ExecEvent::Started { .. }) => {}
                other => panic!("{other:?}"),
            }
        }
    }

    /// Waits until the exec's connection is back among the idle ones (the
    /// forwarder puts it there after the exit event went out).
    async fn wait_kept(idle: &IdleConnections) {
        while !idle.lock().by_sandbox.contains_key("sb") {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn the_next_exec_reuses_the_connection_of_the_last_one() {
        // The fake accepts ONE connection: a second connect would find nobody.
        let (_dir, sock, server) = fake_init(|mut s| async move {
            for code in [3, 4] {
                let (kind, _) = read_frame(&mut s).await.unwrap().unwrap();
                assert_eq!(kind, FrameKind::Request);
                respond(&mut s, &Response::Started { pid: 7 }).await;
                assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
                respond(&mut s, &exited(code)).await;
            }
            assert_eq!(read_frame(&mut s).await.unwrap(), None, "the node closed it when the sandbox ended");
        })
        .await;
        let idle = Arc::new(IdleConnections::default());
        assert_eq!(run_to_end(&sock, &idle).await, Some(3));
        wait_kept(&idle).await;
        assert_eq!(run_to_end(&sock, &idle).await, Some(4));
        wait_kept(&idle).await;
        idle.forget("sb");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_kept_connection_that_init_closed_is_replaced_by_a_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("ctl.sock");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            for code in [5, 6] {
                let (mut s, _) = listener.accept().await.unwrap();
                read_frame(&mut s).await.unwrap().unwrap();
                respond(&mut s, &Response::Started { pid: 7 }).await;
                assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
                respond(&mut s, &exited(code)).await;
                // Init ends a connection left idle: this one ends at once.
            }
        });
        let idle = Arc::new(IdleConnections::default());
        assert_eq!(run_to_end(&sock, &idle).await, Some(5));
        wait_kept(&idle).await;
        assert_eq!(run_to_end(&sock, &idle).await, Some(6));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn closed_idle_connections_are_swept_as_the_map_grows() {
        let idle = IdleConnections::default();
        let mut open = Vec::new();
        for i in 0..=SWEEP_FLOOR {
            let (ours, theirs) = UnixStream::pair().unwrap();
            idle.put(&format!("sb-{i}"), ours);
            // Every other peer stays, as a live init would.
            if i % 2 == 0 {
                open.push(theirs);
            }
        }
        // The put past the floor swept the closed half.
        assert_eq!(idle.lock().by_sandbox.len(), open.len());
        idle.forget("sb-0");
        assert_eq!(idle.lock().by_sandbox.len(), open.len() - 1);
    }

    #[tokio::test]
    async fn a_small_feed_travels_with_the_request_and_a_large_one_after_it() {
        let big = vec![b'x'; FED_STDIN_MAX + 1];
        let expected_big = big.clone();
        let (_dir, sock, server) = fake_init(move |mut s| async move {
            // Read before init answers: the feed came with the request (a
            // node that waited for the answer would never send it; the
            // bound turns that hang into a failure).
            let ahead = async {
                let (kind, _) = read_frame(&mut s).await.unwrap().unwrap();
                assert_eq!(kind, FrameKind::Request);
                assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::Stdin, b"in".to_vec())));
                assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
            };
            tokio::time::timeout(Duration::from_secs(60), ahead).await.expect("the feed came without an answer");
            respond(&mut s, &Response::Started { pid: 7 }).await;
            respond(&mut s, &exited(0)).await;
            // The next exec's feed is too large to go ahead of the answer.
            let (kind, _) = read_frame(&mut s).await.unwrap().unwrap();
            assert_eq!(kind, FrameKind::Request);
            respond(&mut s, &Response::Started { pid: 8 }).await;
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::Stdin, expected_big)));
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
            respond(&mut s, &exited(1)).await;
        })
        .await;
        let idle = Arc::new(IdleConnections::default());
        for (stdin, code) in [(Bytes::from_static(b"in"), 0), (Bytes::from(big), 1)] {
            let reuse = Reuse { idle: Arc::clone(&idle), sandbox: "sb".into() };
            let feed = Feed { stdin, eof: true };
            let mut p = start_exec_fed(&sock, spec(), no_cgroup(), Some(reuse), Some(feed)).await.unwrap();
            loop {
                match p.events.recv().await {
                    Some(ExecEvent::Exited(exit)) => break assert_eq!(exit.exit_code, Some(code)),
                    Some(ExecEvent::Started { .. }) => {}
                    other => panic!("{other:?}"),
                }
            }
            wait_kept(&idle).await;
        }
        idle.forget("sb");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_preconnected_connection_serves_the_first_exec() {
        // The fake accepts ONE connection: the exec must use the one made ahead.
        let (_dir, sock, server) = fake_init(|mut s| async move {
            read_frame(&mut s).await.unwrap().unwrap();
            respond(&mut s, &Response::Started { pid: 7 }).await;
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::StdinEof, vec![])));
            respond(&mut s, &exited(9)).await;
        })
        .await;
        let idle = Arc::new(IdleConnections::default());
        preconnect(&sock, &idle, "sb").await;
        assert!(idle.lock().by_sandbox.contains_key("sb"));
        // A second call keeps the one it has.
        preconnect(&sock, &idle, "sb").await;
        assert_eq!(run_to_end(&sock, &idle).await, Some(9));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn dropping_control_sends_kill() {
        let (_dir, sock, server) = fake_init(|mut s| async move {
            read_frame(&mut s).await.unwrap().unwrap();
            respond(&mut s, &Response::Started { pid: 1 }).await;
            assert_eq!(read_frame(&mut s).await.unwrap(), Some((FrameKind::Kill, vec![])));
        })
        .await;
        let p = start_exec(&sock, spec(), no_cgroup()).await.unwrap();
        drop(p.control);
        server.await.unwrap();
        drop(p.events);
    }

    #[tokio::test]
    async fn a_connection_that_breaks_before_exit_is_lost() {
        let (_dir, sock, server) = fake_init(|mut s| async move {
            read_frame(&mut s).await.unwrap().unwrap();
            respond(&mut s, &Response::Started { pid: 1 }).await;
        })
        .await;
        let mut p = start_exec(&sock, spec(), no_cgroup()).await.unwrap();
        server.await.unwrap();
        assert!(matches!(p.events.recv().await, Some(ExecEvent::Started { .. })));
        assert!(matches!(p.events.recv().await, Some(ExecEvent::Lost(_))));
        assert!(p.events.recv().await.is_none());
    }

    #[tokio::test]
    async fn errors_before_start_map_to_backend_errors() {
        let (_dir, sock, _server) = fake_init(|mut s| async move {
            read_frame(&mut s).await.unwrap().unwrap();
            respond(&mut s, &Response::Error { message: "nope: not found".into(), not_found: true, busy: false }).await;
        })
        .await;
        let err = start_exec(&sock, spec(), no_cgroup()).await.err().unwrap();
        assert!(matches!(err, BackendError::ProgramNotFound(m) if m.contains("nope")));
        let gone = start_exec(&sock.with_file_name("missing.sock"), spec(), no_cgroup()).await.err().unwrap();
        assert!(matches!(gone, BackendError::Gone));
    }

    #[tokio::test]
    async fn ping_needs_a_pong() {
        let (_dir, sock, _server) = fake_init(|mut s| async move {
            read_frame(&mut s).await.unwrap().unwrap();
            respond(&mut s, &Response::Pong { init_version: "t".into() }).await;
        })
        .await;
        assert!(ping(&sock, Duration::from_secs(5)).await);
        // The fake serves one connection; the next ping finds nobody answering.
        assert!(!ping(&sock, Duration::from_millis(200)).await);
    }

    #[tokio::test]
    async fn a_truncated_frame_is_an_error_not_an_end() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(&[FrameKind::Stdout as u8, 0, 0, 0, 9, b'x']).await.unwrap();
        drop(a);
        assert_eq!(read_frame(&mut b).await.unwrap_err().kind(), ErrorKind::UnexpectedEof);
    }
}

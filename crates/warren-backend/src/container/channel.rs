//! Talking to a running sandbox's init over its control socket: one
//! connection per request, framed as in [`warren_init::proto`].

use std::io::{self, ErrorKind};
use std::path::Path;
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
    UnixStream::connect(sock).await.map_err(|e| match e.kind() {
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

/// Starts `spec` in the sandbox and returns once init said `Started`.
pub(crate) async fn start_exec(sock: &Path, spec: ExecSpec, cgroup: SandboxCgroup) -> Result<ExecProcess> {
    let oom_kills_before = cgroup.oom_kills().unwrap_or(0);
    let mut stream = connect(sock).await?;
    send_request(&mut stream, &Request::Exec(spec)).await.map_err(|e| BackendError::io("send exec request", e))?;
    let first = tokio::time::timeout(START_TIMEOUT, read_frame(&mut stream))
        .await
        .map_err(|_| BackendError::Protocol(format!("no answer to exec within {START_TIMEOUT:?}")))?
        .map_err(|e| BackendError::io("read exec answer", e))?;
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
    let (read_half, write_half) = stream.into_split();
    let (done_tx, done_rx) = oneshot::channel();
    tokio::spawn(forward_control(write_half, control_rx, done_rx));
    tokio::spawn(pump_events(read_half, events_tx, done_tx, OomWatch { cgroup, oom_kills_before }));
    Ok(ExecProcess { events, control })
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

/// init -> node. Signals `done` when the exec ended (or the connection
/// did); drops it unsignalled when the node stopped listening or init broke
/// the protocol, which makes the control forwarder kill the process tree.
async fn pump_events(
    mut from_init: OwnedReadHalf,
    events: mpsc::Sender<ExecEvent>,
    done: oneshot::Sender<()>,
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
                    let _ = done.send(());
                    let _ = events.send(ExecEvent::Exited(oom.exit_info(exited))).await;
                    return;
                }
                Ok(other) => return lost(events, format!("unexpected response {other:?}")).await,
                Err(e) => return lost(events, e.to_string()).await,
            },
            Ok(Some((kind, _))) => return lost(events, format!("unexpected frame {kind:?} from init")).await,
            Ok(None) => {
                let _ = done.send(());
                return lost(events, "connection closed before the exit status".to_string()).await;
            }
            Err(e) => {
                let _ = done.send(());
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
/// tree, as does an event pump that ended without the exec finishing.
async fn forward_control(
    mut to_init: OwnedWriteHalf,
    mut control: mpsc::Receiver<ExecControl>,
    mut done: oneshot::Receiver<()>,
) {
    loop {
        let (kind, payload) = tokio::select! {
            ended = &mut done => {
                if ended.is_err() {
                    let _ = write_frame(&mut to_init, FrameKind::Kill, &[]).await;
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

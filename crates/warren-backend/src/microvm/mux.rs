//! The host half of the mux (see [`warren_init::mux`]): a unix listener in
//! the sandbox's run directory (`ctl.sock`) whose every connection becomes
//! one stream over QEMU's virtio-serial socket. The container driver's
//! channel code connects to it exactly as to a container's control socket,
//! so exec, events and pings share one implementation.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use warren_init::mux::{self, MuxKind, HEADER_BYTES, MAX_CHUNK_BYTES};

use crate::{BackendError, Result};

/// Frames waiting for the port; a full queue makes connections wait.
const PORT_QUEUE: usize = 64;
/// Data for one connection waiting to be written to it.
const STREAM_QUEUE: usize = 16;

type Streams = Arc<Mutex<HashMap<u32, mpsc::Sender<Option<Vec<u8>>>>>>;

/// The running mux; aborting it (or dropping it) ends every stream.
pub struct Mux {
    tasks: Vec<JoinHandle<()>>,
}

impl Mux {
    /// A mux that serves nothing: what a VM holds between dropping its
    /// mux and getting a new one.
    pub fn detached() -> Mux {
        Mux { tasks: Vec::new() }
    }
}

impl Drop for Mux {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Connects to QEMU's end of the port at `serial_sock` (waiting up to
/// `wait` for QEMU to create it) and serves `listen_sock`.
pub async fn start(serial_sock: &Path, listen_sock: &Path, wait: Duration) -> Result<Mux> {
    start_from(serial_sock, listen_sock, wait, 1).await
}

/// As [`start`], numbering streams from `first_stream`: a guest restored
/// from a snapshot may still hold streams of the mux its template had, and
/// ids are never reused while a guest lives.
pub async fn start_from(serial_sock: &Path, listen_sock: &Path, wait: Duration, first_stream: u32) -> Result<Mux> {
    let port = connect_with_retry(serial_sock, wait).await?;
    let listener = crate::unix_sock::bind(listen_sock)
        .map_err(|e| BackendError::io(format!("bind {}", listen_sock.display()), e))?;
    Ok(serve(port, listener, first_stream))
}

/// As [`start_from`], for a guest that served an earlier mux, and for a
/// caller that may not wait on the runtime (a driver's `resume`):
/// connects, resyncs ([`resync_blocking`]) and binds with blocking calls,
/// then hands the sockets to the runtime. A stale `listen_sock` is
/// replaced. `first_stream` must be past every id the guest has seen.
pub fn start_blocking(serial_sock: &Path, listen_sock: &Path, wait: Duration, first_stream: u32) -> Result<Mux> {
    let mut port = connect_blocking(serial_sock, wait)?;
    resync_blocking(&mut port, wait)?;
    serve_blocking(port, listen_sock, first_stream)
}

/// Skips what a running guest wrote for an earlier node - frames of its
/// streams, perhaps starting mid-frame - up to the echo of a fresh random
/// token sent on [`mux::SYNC_STREAM`]; the next byte on `port` starts a
/// whole frame. Bytes are only consumed up to the echo's end (peeked
/// first), so nothing of what follows it is lost. Fails if no echo comes
/// within `wait` (a guest that is stopped, hung, or runs an init without
/// the sync).
pub fn resync_blocking(port: &mut std::os::unix::net::UnixStream, wait: Duration) -> Result<()> {
    use std::io::{Read, Write};
    let io = |e: std::io::Error| BackendError::io("resync the VM's control port", e);
    let mut token = [0u8; 16];
    let mut filled = 0;
    while filled < token.len() {
        filled += rustix::rand::getrandom(&mut token[filled..], rustix::rand::GetRandomFlags::empty())
            .map_err(|e| io(e.into()))?;
    }
    let echo = mux::encode(mux::SYNC_STREAM, MuxKind::Data, &token);
    port.write_all(&echo).map_err(io)?;
    let deadline = std::time::Instant::now() + wait;
    // The last bytes consumed, shorter than the echo: it may span reads.
    let mut seen: Vec<u8> = Vec::with_capacity(2 * echo.len());
    let mut peeked = vec![0u8; MAX_CHUNK_BYTES];
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(BackendError::Setup(format!("the guest did not answer the resync within {wait:?}")));
        }
        port.set_read_timeout(Some(left)).map_err(io)?;
        let n = match rustix::net::recv(&*port, &mut peeked, rustix::net::RecvFlags::PEEK) {
            Ok((0, _)) => return Err(io(std::io::ErrorKind::UnexpectedEof.into())),
            Ok((n, _)) => n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(io(e.into())),
        };
        let before = seen.len();
        seen.extend_from_slice(&peeked[..n]);
        let found = seen.windows(echo.len()).position(|w| w == echo.as_slice());
        let take = found.map_or(n, |at| at + echo.len() - before);
        port.read_exact(&mut peeked[..take]).map_err(io)?;
        if found.is_some() {
            port.set_read_timeout(None).map_err(io)?;
            return Ok(());
        }
        let keep = seen.len().min(echo.len() - 1);
        seen.drain(..seen.len() - keep);
    }
}

/// Connects to QEMU's end of the port, waiting up to `wait` for it.
pub fn connect_blocking(serial_sock: &Path, wait: Duration) -> Result<std::os::unix::net::UnixStream> {
    let deadline = std::time::Instant::now() + wait;
    loop {
        match crate::unix_sock::connect_std(serial_sock) {
            Ok(stream) => return Ok(stream),
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(BackendError::io(format!("connect to QEMU's control port {}", serial_sock.display()), e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Serves `listen_sock` over `port` (from [`connect_blocking`]).
pub fn serve_blocking(port: std::os::unix::net::UnixStream, listen_sock: &Path, first_stream: u32) -> Result<Mux> {
    let _ = std::fs::remove_file(listen_sock);
    let listener = crate::unix_sock::bind_std(listen_sock)
        .map_err(|e| BackendError::io(format!("bind {}", listen_sock.display()), e))?;
    let io = |e| BackendError::io("hand the mux's sockets to the runtime", e);
    port.set_nonblocking(true).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let port = UnixStream::from_std(port).map_err(io)?;
    let listener = UnixListener::from_std(listener).map_err(io)?;
    Ok(serve(port, listener, first_stream))
}

/// One request frame (`request`, a whole [`warren_init::proto`] frame) and
/// its answer on a new stream over a port no mux serves yet, with blocking
/// calls only: a driver's `resume` runs inline on a request's path and must
/// not wait on the runtime. A stream whose answer does not come within
/// `attempt` is given up (a guest just restored may not have seen the new
/// node yet) and the request sent again on the next id, until `wait`
/// passes. `next_stream` ends past every id used.
pub fn request_blocking(
    port: &mut std::os::unix::net::UnixStream,
    next_stream: &mut u32,
    request: &[u8],
    attempt: Duration,
    wait: Duration,
) -> Result<(warren_init::proto::FrameKind, Vec<u8>)> {
    use std::io::{Read, Write};
    let io = |e: std::io::Error| BackendError::io("a request on the VM's control port", e);
    let deadline = std::time::Instant::now() + wait;
    port.set_read_timeout(Some(attempt)).map_err(io)?;
    let answered = loop {
        let id = (*next_stream).max(1);
        *next_stream = id.wrapping_add(1).max(1);
        let mut frames = mux::encode(id, MuxKind::Data, request);
        frames.extend(mux::encode(id, MuxKind::Eof, &[]));
        port.write_all(&frames).map_err(io)?;
        let mut answer = Vec::new();
        let outcome = loop {
            let mut header = [0u8; HEADER_BYTES];
            if let Err(e) = port.read_exact(&mut header) {
                break Err(e);
            }
            let header = mux::parse_header(header).map_err(io)?;
            let mut payload = vec![0u8; header.len as usize];
            port.read_exact(&mut payload).map_err(io)?;
            // Whatever a stream of an earlier attempt still says is stale.
            if header.stream != id || header.kind != MuxKind::Data {
                continue;
            }
            answer.extend_from_slice(&payload);
            if let Some(frame) = whole_frame(&answer).map_err(io)? {
                break Ok(frame);
            }
        };
        match outcome {
            Ok(frame) => break frame,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                if std::time::Instant::now() >= deadline {
                    return Err(BackendError::Setup(format!("the guest did not answer within {wait:?}")));
                }
            }
            Err(e) => return Err(io(e)),
        }
    };
    port.set_read_timeout(None).map_err(io)?;
    Ok(answered)
}

/// The first whole [`warren_init::proto`] frame in `bytes`, if complete.
fn whole_frame(bytes: &[u8]) -> std::io::Result<Option<(warren_init::proto::FrameKind, Vec<u8>)>> {
    let Some(header) = bytes.first_chunk::<5>() else { return Ok(None) };
    let (kind, len) = warren_init::proto::parse_header(*header)?;
    Ok(bytes.get(5..5 + len as usize).map(|payload| (kind, payload.to_vec())))
}

fn serve(port: UnixStream, listener: UnixListener, first_stream: u32) -> Mux {
    let (port_rx, mut port_tx) = port.into_split();
    let (frames, mut queued) = mpsc::channel::<Vec<u8>>(PORT_QUEUE);
    let streams: Streams = Arc::default();
    let writer = tokio::spawn(async move {
        while let Some(frame) = queued.recv().await {
            if port_tx.write_all(&frame).await.is_err() {
                return;
            }
        }
    });
    let reader = tokio::spawn(demux(port_rx, Arc::clone(&streams)));
    let acceptor = tokio::spawn(accept(listener, frames, streams, first_stream.max(1)));
    Mux { tasks: vec![writer, reader, acceptor] }
}

async fn connect_with_retry(path: &Path, wait: Duration) -> Result<UnixStream> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match crate::unix_sock::connect(path).await {
            Ok(stream) => return Ok(stream),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(BackendError::io(format!("connect to QEMU's control port {}", path.display()), e))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

async fn accept(listener: UnixListener, frames: mpsc::Sender<Vec<u8>>, streams: Streams, first_stream: u32) {
    let mut next_id: u32 = first_stream;
    loop {
        let Ok((conn, _)) = listener.accept().await else { continue };
        let id = next_id;
        next_id = next_id.wrapping_add(1).max(1);
        let (to_conn, from_port) = mpsc::channel(STREAM_QUEUE);
        streams.lock().unwrap_or_else(PoisonError::into_inner).insert(id, to_conn);
        let (mut conn_rx, conn_tx) = conn.into_split();
        tokio::spawn(write_conn(conn_tx, from_port));
        let frames = frames.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_CHUNK_BYTES];
            loop {
                match conn_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if frames.send(mux::encode(id, MuxKind::Data, &buf[..n])).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = frames.send(mux::encode(id, MuxKind::Eof, &[])).await;
        });
    }
}

/// port -> connection; `None` is the guest's end-of-file.
async fn write_conn(mut conn: OwnedWriteHalf, mut from_port: mpsc::Receiver<Option<Vec<u8>>>) {
    while let Some(Some(bytes)) = from_port.recv().await {
        if conn.write_all(&bytes).await.is_err() {
            break;
        }
    }
    let _ = conn.shutdown().await;
}

/// Routes the guest's frames to their connections. A guest that breaks the
/// framing is not trusted further: every stream ends.
async fn demux(mut port: tokio::net::unix::OwnedReadHalf, streams: Streams) {
    loop {
        let mut header = [0u8; HEADER_BYTES];
        if port.read_exact(&mut header).await.is_err() {
            break;
        }
        let Ok(header) = mux::parse_header(header) else { break };
        let mut payload = vec![0u8; header.len as usize];
        if port.read_exact(&mut payload).await.is_err() {
            break;
        }
        let target = {
            let mut map = streams.lock().unwrap_or_else(PoisonError::into_inner);
            match header.kind {
                MuxKind::Data => map.get(&header.stream).cloned(),
                MuxKind::Eof => map.remove(&header.stream),
            }
        };
        let Some(target) = target else { continue };
        let message = match header.kind {
            MuxKind::Data => Some(payload),
            MuxKind::Eof => None,
        };
        // A connection whose reader went away just drops its data.
        let _ = target.send(message).await;
    }
    streams.lock().unwrap_or_else(PoisonError::into_inner).clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guest that has not seen the new node yet drops the first request;
    /// the second, on the next stream, is answered after a stale frame of
    /// another stream, in two pieces. `next_stream` ends past both ids.
    #[test]
    fn request_blocking_retries_on_a_new_stream_and_skips_other_streams() {
        use std::io::{Read, Write};
        use warren_init::proto::FrameKind;
        let (mut host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut request = Vec::new();
        warren_init::proto::write_frame(&mut request, FrameKind::Request, b"{}").unwrap();
        let sent = request.clone();
        let fake = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for _ in 0..2 {
                let mut data = vec![0u8; HEADER_BYTES + sent.len()];
                guest.read_exact(&mut data).unwrap();
                let mut eof = [0u8; HEADER_BYTES];
                guest.read_exact(&mut eof).unwrap();
                let header = mux::parse_header(data[..HEADER_BYTES].try_into().unwrap()).unwrap();
                assert_eq!((header.kind, &data[HEADER_BYTES..]), (MuxKind::Data, &sent[..]));
                seen.push(header.stream);
            }
            let mut answer = Vec::new();
            warren_init::proto::write_frame(&mut answer, FrameKind::Response, b"\"ok\"").unwrap();
            guest.write_all(&mux::encode(seen[0], MuxKind::Data, b"stale")).unwrap();
            guest.write_all(&mux::encode(seen[1], MuxKind::Data, &answer[..3])).unwrap();
            guest.write_all(&mux::encode(seen[1], MuxKind::Data, &answer[3..])).unwrap();
            seen
        });
        let mut next = 7;
        let answer =
            request_blocking(&mut host, &mut next, &request, Duration::from_millis(200), Duration::from_secs(30))
                .unwrap();
        assert_eq!(answer, (FrameKind::Response, b"\"ok\"".to_vec()));
        assert_eq!(fake.join().unwrap(), [7, 8]);
        assert_eq!(next, 9);
    }

    /// A guest whose earlier node died mid-frame: the new node reads the
    /// rest of that frame and a whole stale one, then the echo of its
    /// token - which arrives in two pieces - and the first frame after it
    /// is read whole, nothing of it consumed by the resync.
    #[test]
    fn resync_skips_stale_and_cut_frames_up_to_the_echo_and_no_further() {
        use std::io::{Read, Write};
        let (mut host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let fake = std::thread::spawn(move || {
            let cut = mux::encode(5, MuxKind::Data, b"output for the old node");
            guest.write_all(&cut[7..]).unwrap();
            guest.write_all(&mux::encode(6, MuxKind::Eof, &[])).unwrap();
            let mut sync = [0u8; HEADER_BYTES + 16];
            guest.read_exact(&mut sync).unwrap();
            let header = mux::parse_header(sync[..HEADER_BYTES].try_into().unwrap()).unwrap();
            assert_eq!((header.stream, header.kind, header.len), (mux::SYNC_STREAM, MuxKind::Data, 16));
            guest.write_all(&sync[..HEADER_BYTES + 3]).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            let mut rest = sync[HEADER_BYTES + 3..].to_vec();
            rest.extend(mux::encode(1 << 24, MuxKind::Data, b"for the new node"));
            guest.write_all(&rest).unwrap();
            guest
        });
        resync_blocking(&mut host, Duration::from_secs(30)).unwrap();
        let mut header = [0u8; HEADER_BYTES];
        host.read_exact(&mut header).unwrap();
        let header = mux::parse_header(header).unwrap();
        let mut payload = vec![0u8; header.len as usize];
        host.read_exact(&mut payload).unwrap();
        assert_eq!((header.stream, payload.as_slice()), (1 << 24, b"for the new node".as_slice()));
        drop(fake.join().unwrap());
    }

    /// Only the echo of this resync's own token counts: a guest that sends
    /// anything else (here: a sync frame of its own) is given up on.
    #[test]
    fn resync_without_the_echo_of_its_token_fails_in_time() {
        let (mut host, mut guest) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::io::Write;
        guest.write_all(&mux::encode(mux::SYNC_STREAM, MuxKind::Data, &[0u8; 16])).unwrap();
        let err = resync_blocking(&mut host, Duration::from_millis(200)).unwrap_err();
        assert!(err.to_string().contains("did not answer the resync"), "{err}");
    }

    #[test]
    fn request_blocking_gives_up_when_the_guest_never_answers() {
        let (mut host, _guest) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut next = 1;
        let err = request_blocking(&mut host, &mut next, b"x", Duration::from_millis(20), Duration::from_millis(100))
            .unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
        assert!(next > 2, "every attempt takes a new stream: {next}");
    }

    /// A stand-in for the guest: echoes every stream's bytes back on the
    /// same stream, and its end-of-file too.
    async fn echo_guest(listener: UnixListener) {
        let (port, _) = listener.accept().await.unwrap();
        let (mut rx, mut tx) = port.into_split();
        loop {
            let mut header = [0u8; HEADER_BYTES];
            if rx.read_exact(&mut header).await.is_err() {
                return;
            }
            let header = mux::parse_header(header).unwrap();
            let mut payload = vec![0u8; header.len as usize];
            rx.read_exact(&mut payload).await.unwrap();
            tx.write_all(&mux::encode(header.stream, header.kind, &payload)).await.unwrap();
        }
    }

    #[tokio::test]
    async fn connections_become_separate_streams_with_their_own_end() {
        let dir = tempfile::tempdir().unwrap();
        let (serial, listen) = (dir.path().join("port.sock"), dir.path().join("ctl.sock"));
        tokio::spawn(echo_guest(UnixListener::bind(&serial).unwrap()));
        let _mux = start(&serial, &listen, Duration::from_secs(5)).await.unwrap();
        let mut a = UnixStream::connect(&listen).await.unwrap();
        let mut b = UnixStream::connect(&listen).await.unwrap();
        let big = vec![7u8; 3 * MAX_CHUNK_BYTES + 5];
        a.write_all(b"from a").await.unwrap();
        b.write_all(&big).await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
        let (mut got_a, mut got_b) = (Vec::new(), Vec::new());
        a.read_to_end(&mut got_a).await.unwrap();
        b.read_to_end(&mut got_b).await.unwrap();
        assert_eq!(got_a, b"from a");
        assert_eq!(got_b, big, "a stream longer than one chunk arrives whole and in order");
    }

    #[tokio::test]
    async fn no_port_within_the_wait_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("port.sock");
        assert!(start(&missing, &dir.path().join("ctl.sock"), Duration::from_millis(100)).await.is_err());
    }
}

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
    let listener =
        UnixListener::bind(listen_sock).map_err(|e| BackendError::io(format!("bind {}", listen_sock.display()), e))?;
    Ok(serve(port, listener, first_stream))
}

/// As [`start_from`] for a caller that may not wait on the runtime (a
/// driver's `resume`): connects and binds with blocking calls, then hands
/// the sockets to the runtime. A stale `listen_sock` is replaced.
pub fn start_blocking(serial_sock: &Path, listen_sock: &Path, wait: Duration, first_stream: u32) -> Result<Mux> {
    let deadline = std::time::Instant::now() + wait;
    let port = loop {
        match std::os::unix::net::UnixStream::connect(serial_sock) {
            Ok(stream) => break stream,
            Err(e) if std::time::Instant::now() >= deadline => {
                return Err(BackendError::io(format!("connect to QEMU's control port {}", serial_sock.display()), e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let _ = std::fs::remove_file(listen_sock);
    let listener = std::os::unix::net::UnixListener::bind(listen_sock)
        .map_err(|e| BackendError::io(format!("bind {}", listen_sock.display()), e))?;
    let io = |e| BackendError::io("hand the mux's sockets to the runtime", e);
    port.set_nonblocking(true).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let port = UnixStream::from_std(port).map_err(io)?;
    let listener = UnixListener::from_std(listener).map_err(io)?;
    Ok(serve(port, listener, first_stream))
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
        match UnixStream::connect(path).await {
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

//! The guest half of the mux (see [`warren_init::mux`]): every stream the
//! node opens on the virtio-serial port becomes one end of a socketpair,
//! served by exactly the code that serves a container's connection.
//!
//! Threads per stream: the connection itself, one that copies the node's
//! bytes into the socketpair and one that copies init's answers back out.
//! Writes to the port are whole mux frames under one lock, so frames of
//! different streams never interleave; a node that stops reading blocks
//! the writers, and through their sockets the commands, as in a container.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use warren_init::mux::{self, MuxKind, HEADER_BYTES, MAX_CHUNK_BYTES};

use crate::serve::{self, Shared};

const PUMP_STACK_BYTES: usize = 64 * 1024;
const CONNECTION_STACK_BYTES: usize = 256 * 1024;
/// How long to wait before reading again after the node went away (a
/// virtio-serial port reads end-of-file while no host side is connected).
const RECONNECT_POLL: Duration = Duration::from_millis(50);

type PortWriter = Arc<Mutex<File>>;

pub fn serve(port: OwnedFd, shared: Arc<Shared>) -> ! {
    let mut reader = File::from(port);
    let writer: PortWriter = match reader.try_clone() {
        Ok(w) => Arc::new(Mutex::new(w)),
        Err(e) => {
            eprintln!("warren-init: cannot duplicate the control port: {e}");
            crate::sys::exit_now(1)
        }
    };
    let mut streams: HashMap<u32, Sender<Option<Vec<u8>>>> = HashMap::new();
    loop {
        let (header, payload) = match read_frame(&mut reader) {
            Ok(Some(frame)) => frame,
            Ok(None) | Err(_) => {
                // The node disconnected (or sent garbage, which only a
                // broken node does): its streams are gone with it, and
                // dropping their senders ends their connections, which kills
                // what they ran, as a closed connection does in a container.
                streams.clear();
                std::thread::sleep(RECONNECT_POLL);
                continue;
            }
        };
        match header.kind {
            MuxKind::Data if header.stream == mux::SYNC_STREAM => {
                // Blocks behind frames for an earlier node still being
                // written, which is the point: the echo comes after them.
                let _ = write_port(&writer, mux::SYNC_STREAM, MuxKind::Data, &payload);
            }
            MuxKind::Data => {
                let tx = match streams.entry(header.stream) {
                    std::collections::hash_map::Entry::Occupied(tx) => tx.into_mut(),
                    std::collections::hash_map::Entry::Vacant(slot) => {
                        match open_stream(header.stream, &shared, &writer) {
                            Ok(tx) => slot.insert(tx),
                            // Out of threads or descriptors: the node sees the
                            // stream end at once.
                            Err(_) => {
                                let _ = write_port(&writer, header.stream, MuxKind::Eof, &[]);
                                continue;
                            }
                        }
                    }
                };
                let _ = tx.send(Some(payload));
            }
            MuxKind::Eof => {
                if let Some(tx) = streams.remove(&header.stream) {
                    let _ = tx.send(None);
                }
            }
        }
    }
}

/// Reads one mux frame; `Ok(None)` at end of file.
fn read_frame(port: &mut File) -> io::Result<Option<(mux::MuxHeader, Vec<u8>)>> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match port.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "truncated mux header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let header = mux::parse_header(header)?;
    let mut payload = vec![0u8; header.len as usize];
    port.read_exact(&mut payload)?;
    Ok(Some((header, payload)))
}

fn write_port(writer: &PortWriter, stream: u32, kind: MuxKind, payload: &[u8]) -> io::Result<()> {
    let frame = mux::encode(stream, kind, payload);
    let mut port = writer.lock().unwrap_or_else(PoisonError::into_inner);
    port.write_all(&frame)?;
    port.flush()
}

/// Starts the connection for a new stream and its two pumps; returns where
/// the node's bytes for it go (`None`: the node's end-of-file).
fn open_stream(id: u32, shared: &Arc<Shared>, writer: &PortWriter) -> io::Result<Sender<Option<Vec<u8>>>> {
    let (ours, theirs) = UnixStream::pair()?;
    let inbound = ours.try_clone()?;
    let (tx, rx) = mpsc::channel();
    let shared = Arc::clone(shared);
    std::thread::Builder::new()
        .name("conn".into())
        .stack_size(CONNECTION_STACK_BYTES)
        .spawn(move || serve::serve_connection(&shared, theirs))?;
    std::thread::Builder::new()
        .name("mux-in".into())
        .stack_size(PUMP_STACK_BYTES)
        .spawn(move || pump_in(inbound, rx))?;
    let writer = Arc::clone(writer);
    std::thread::Builder::new()
        .name("mux-out".into())
        .stack_size(PUMP_STACK_BYTES)
        .spawn(move || pump_out(id, ours, &writer))?;
    Ok(tx)
}

/// node -> connection.
fn pump_in(mut conn: UnixStream, from_node: Receiver<Option<Vec<u8>>>) {
    while let Ok(Some(bytes)) = from_node.recv() {
        if conn.write_all(&bytes).is_err() {
            break;
        }
    }
    // The node's end-of-file, or the node is gone (the sender dropped).
    let _ = conn.shutdown(std::net::Shutdown::Write);
}

/// connection -> node, then the stream's end-of-file.
fn pump_out(id: u32, mut conn: UnixStream, writer: &PortWriter) {
    let mut buf = vec![0u8; MAX_CHUNK_BYTES];
    loop {
        match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if write_port(writer, id, MuxKind::Data, &buf[..n]).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let _ = write_port(writer, id, MuxKind::Eof, &[]);
}

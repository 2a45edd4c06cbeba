//! Framing of the one virtio-serial port between the node and the init of
//! a microVM.
//!
//! A container's init gets one unix connection per request; a VM has a
//! single byte pipe (this kernel has no vhost-vsock). The mux carries many
//! virtual connections over it, each a plain byte stream that holds exactly
//! what a container connection would (the frames of [`crate::proto`]), so
//! both sides reuse their per-connection code unchanged.
//!
//! Every mux frame: a big-endian `u32` stream id, one byte kind, a
//! big-endian `u32` payload length, the payload. Only the host opens
//! streams, implicitly, by sending on a new id (ids are never reused while
//! the VM lives). `Eof` half-closes the sender's direction; a stream is
//! finished once both directions saw `Eof`.
//!
//! Stream [`SYNC_STREAM`] is no connection: the guest echoes every `Data`
//! frame on it back unchanged. A node that connects to a guest that served
//! an earlier node (a restarted node, a guest back from disk) may first
//! read what the guest wrote for that node, possibly from the middle of a
//! frame; it sends a fresh random token there and skips everything up to
//! the token's echo, after which the framing is whole again.

use std::io;

/// The virtio-serial port's name (`virtserialport,name=...`).
pub const PORT_NAME: &str = "warren.ctl";
pub const HEADER_BYTES: usize = 9;
/// Largest payload of one mux frame: a long output burst is cut into
/// chunks so one stream cannot hold the port for long.
pub const MAX_CHUNK_BYTES: usize = 64 << 10;
/// The stream whose frames the guest echoes (see the module doc); the
/// node opens connections from stream 1 on.
pub const SYNC_STREAM: u32 = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum MuxKind {
    Data = 0,
    /// The sender will send nothing more on this stream (empty payload).
    Eof = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MuxHeader {
    pub stream: u32,
    pub kind: MuxKind,
    pub len: u32,
}

/// One whole frame, ready to write.
pub fn encode(stream: u32, kind: MuxKind, payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.push(kind as u8);
    // Payloads are at most MAX_CHUNK_BYTES, far below u32::MAX.
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

pub fn parse_header(header: [u8; HEADER_BYTES]) -> io::Result<MuxHeader> {
    let stream = u32::from_be_bytes([header[0], header[1], header[2], header[3]]);
    let kind = match header[4] {
        0 => MuxKind::Data,
        1 => MuxKind::Eof,
        other => return Err(io::Error::new(io::ErrorKind::InvalidData, format!("unknown mux frame kind {other}"))),
    };
    let len = u32::from_be_bytes([header[5], header[6], header[7], header[8]]);
    if len as usize > MAX_CHUNK_BYTES || (kind == MuxKind::Eof && len != 0) {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("bad mux frame length {len}")));
    }
    Ok(MuxHeader { stream, kind, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_round_trips_and_bad_headers_are_refused() {
        let frame = encode(7, MuxKind::Data, b"abc");
        let header: [u8; HEADER_BYTES] = frame[..HEADER_BYTES].try_into().unwrap();
        assert_eq!(parse_header(header).unwrap(), MuxHeader { stream: 7, kind: MuxKind::Data, len: 3 });
        assert_eq!(&frame[HEADER_BYTES..], b"abc");
        let mut bad = header;
        bad[4] = 9;
        assert!(parse_header(bad).is_err());
        let mut eof_with_payload: [u8; HEADER_BYTES] = encode(1, MuxKind::Eof, &[])[..].try_into().unwrap();
        eof_with_payload[8] = 1;
        assert!(parse_header(eof_with_payload).is_err());
        let too_long: [u8; HEADER_BYTES] =
            encode(1, MuxKind::Data, &vec![0; MAX_CHUNK_BYTES + 1])[..HEADER_BYTES].try_into().unwrap();
        assert!(parse_header(too_long).is_err());
    }
}

//! Wire protocol between the node (host side) and `warren-init`.
//!
//! Framing, in both directions: one byte kind, a big-endian `u32` payload
//! length, then the payload. Control payloads are JSON; output payloads are
//! raw bytes. An exec has a connection to the control listener to itself
//! (a later exec may follow it on the same connection once it ended), so
//! no multiplexing is needed and a dropped connection kills its process tree.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::{Deserialize, Serialize};

use crate::files::FileError;

/// Largest frame either side accepts; bigger frames are a protocol error.
pub const MAX_FRAME_BYTES: u32 = 16 << 20;

/// The fd number at which init inherits the setup socket.
pub const SETUP_FD: i32 = 3;
/// The fd number at which init inherits the control listener (a bound,
/// listening unix stream socket whose path only the host can reach).
pub const LISTEN_FD: i32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    // host -> init
    /// JSON [`Request`].
    Request = 1,
    /// Raw stdin bytes for the running exec.
    Stdin = 2,
    /// Stdin is finished (empty payload).
    StdinEof = 3,
    /// Kill the exec's whole process tree (empty payload).
    Kill = 4,
    /// Make the staged upload of a `WriteFile` the file (empty payload).
    Commit = 5,
    // init -> host
    /// JSON [`Response`].
    Response = 10,
    Stdout = 11,
    Stderr = 12,
}

impl FrameKind {
    pub fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            1 => FrameKind::Request,
            2 => FrameKind::Stdin,
            3 => FrameKind::StdinEof,
            4 => FrameKind::Kill,
            5 => FrameKind::Commit,
            10 => FrameKind::Response,
            11 => FrameKind::Stdout,
            12 => FrameKind::Stderr,
            _ => return None,
        })
    }
}

/// First frame on every control connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Liveness check; answered with [`Response::Pong`].
    Ping,
    /// Start a process. Answered with `Started`, then `Stdout`/`Stderr`
    /// frames, then `Exited`.
    Exec(ExecSpec),
    /// The security events recorded after `after_seq` (0: all that are
    /// still held); answered with [`Response::Events`].
    Events { after_seq: u64 },
    /// Makes `phase` current: later execs run under its Landlock ruleset.
    /// With `kill_running`, every process of the sandbox but init is killed
    /// first. Answered with [`Response::PhaseSet`] (or `Error`, and then
    /// the earlier phase stays current).
    SetPhase { phase: PhaseRules, kill_running: bool },
    // The file API, for a sandbox whose root the node cannot open (a
    // microVM's guest): init resolves every path inside its own root with
    // `crate::files`, as the node does for a container. Each answers
    // `FileError` when it fails.
    /// Answered with `FileStat`.
    StatFile { path: String },
    /// Answered with `FileList`.
    ListDir { path: String },
    /// Answered with `FileOpened`, then the content in `Stdout` frames,
    /// then `FileEnd` (a connection that ends before `FileEnd` broke off).
    ReadFile { path: String },
    /// Answered with `FileReady`; then the node sends the content in
    /// `Stdin` frames and `StdinEof`, init stages it (invisible in the
    /// sandbox) and answers `FileStaged`; then a `Commit` frame replaces
    /// the file with it (answered with `FileStat`), while a connection
    /// closed instead throws it away.
    WriteFile { path: String, mode: u32 },
    /// Answered with `FileStat`.
    Mkdir { path: String, mode: u32, parents: bool },
    /// Answered with `FileDone`.
    RemoveFile { path: String, recursive: bool },
    /// Answered with `FileStat` of the file at `to`.
    RenameFile { from: String, to: String },
    /// `pack_diff` of a VM: the writable layer (the overlay's upper
    /// directory) as a tar stream in OCI layer form (whiteouts as
    /// `.wh.NAME`, opaque directories as `.wh..wh..opq`), read while the
    /// sandbox's processes are stopped. Answered with `PackOpened`, then
    /// the archive in `Stdout` frames, then `FileEnd` (a connection that
    /// ends before `FileEnd` broke off), or with `Error` where init holds
    /// no writable layer of its own (a container's init).
    PackUpper,
    /// A microVM restored from a snapshot of a booted guest takes on its
    /// own identity: the hostname, `entropy` mixed into the kernel's pool
    /// followed by a forced reseed (clones of one snapshot share their
    /// random state until then), and the wall clock (frozen in the
    /// snapshot). Answered with `Identified`, or `Error` outside a microVM.
    Identify { hostname: String, entropy: Vec<u8>, unix_time_ns: u64 },
    /// A VM's counters of the limits its sandbox ran into (the node sees
    /// only QEMU from outside). Answered with `Limits`, or `Error` outside
    /// a VM.
    Limits,
}

/// What [`Request::Limits`] answers (and what the node reads of a
/// container itself); see the node's `limit_hit` events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitCounters {
    /// Processes the guest kernel's out-of-memory killer killed.
    pub oom_kills: u64,
    /// Forks refused at the sandbox's pids limit.
    pub pids_max_hits: u64,
    /// The writable disk's free and total bytes and inodes.
    pub disk_free_bytes: u64,
    pub disk_total_bytes: u64,
    pub inodes_free: u64,
    pub inodes_total: u64,
}

/// What init needs of a phase: its name (for messages) and its protected
/// paths. The host has validated them; init checks them again.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PhaseRules {
    pub name: String,
    /// Absolute path inside the sandbox -> access level.
    pub protected_paths: BTreeMap<String, PathAccess>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PathAccess {
    None,
    Read,
    ReadWrite,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecSpec {
    /// Program and arguments; `argv[0]` is looked up in `PATH` of `env` when
    /// it has no slash.
    pub argv: Vec<String>,
    /// The complete environment of the process (nothing is inherited).
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    /// When set, `argv` must be a shell command for `/bin/sh -c`: init runs
    /// it so that the shell's final working directory and exported
    /// environment come back in [`Exited::session_state`].
    pub capture_session_state: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Response {
    Pong {
        init_version: String,
    },
    /// The process runs; `pid` as seen inside the sandbox.
    Started {
        pid: i32,
    },
    Exited(Exited),
    /// The request failed before a process ran (e.g. no such program).
    Error {
        message: String,
        not_found: bool,
        /// No pid was left for the request (the sandbox's processes hold
        /// its whole pids limit); the same request may succeed later.
        #[serde(default)]
        busy: bool,
    },
    /// Every event still held with `seq > after_seq`, oldest first. Init
    /// keeps the latest events only (a bounded ring): `dropped` counts the
    /// events after `after_seq` it no longer holds. `next_seq` is the
    /// number the next event will get, so `next_seq - 1` is the
    /// `after_seq` that asks for only what is new.
    Events {
        events: Vec<SecurityEvent>,
        dropped: u64,
        next_seq: u64,
    },
    /// The phase is current; `killed` processes of earlier phases were
    /// killed on the way.
    PhaseSet {
        killed: u32,
    },
    /// The phase's rules cannot be enforced in this sandbox (e.g. a
    /// symbolic link on the way to a protected path); the earlier phase
    /// stays current.
    PhaseRejected {
        message: String,
    },
    FileStat {
        stat: warren_api::FileStat,
    },
    FileList {
        list: warren_api::FileList,
    },
    FileOpened {
        size_bytes: u64,
    },
    FileEnd,
    /// The archive of [`Request::PackUpper`] follows; `stopped` processes
    /// of the sandbox wait for its end.
    PackOpened {
        stopped: u32,
    },
    FileReady,
    FileStaged {
        size_bytes: u64,
    },
    FileDone,
    FileError {
        error: WireFileError,
    },
    Identified,
    Limits {
        counters: LimitCounters,
    },
}

/// A [`crate::files::FileError`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireFileError {
    pub kind: WireFileErrorKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WireFileErrorKind {
    NotFound,
    IsDirectory,
    NotDirectory,
    Conflict,
    NoSpace,
    InvalidPath,
    Io,
}

impl From<&FileError> for WireFileError {
    fn from(e: &FileError) -> Self {
        let (kind, message) = match e {
            FileError::NotFound => (WireFileErrorKind::NotFound, String::new()),
            FileError::IsDirectory => (WireFileErrorKind::IsDirectory, String::new()),
            FileError::NotDirectory => (WireFileErrorKind::NotDirectory, String::new()),
            FileError::Conflict(m) => (WireFileErrorKind::Conflict, m.clone()),
            FileError::NoSpace => (WireFileErrorKind::NoSpace, String::new()),
            FileError::InvalidPath(m) => (WireFileErrorKind::InvalidPath, m.clone()),
            FileError::Io { .. } => (WireFileErrorKind::Io, e.to_string()),
        };
        WireFileError { kind, message }
    }
}

impl From<WireFileError> for FileError {
    fn from(e: WireFileError) -> Self {
        match e.kind {
            WireFileErrorKind::NotFound => FileError::NotFound,
            WireFileErrorKind::IsDirectory => FileError::IsDirectory,
            WireFileErrorKind::NotDirectory => FileError::NotDirectory,
            WireFileErrorKind::Conflict => FileError::Conflict(e.message),
            WireFileErrorKind::NoSpace => FileError::NoSpace,
            WireFileErrorKind::InvalidPath => FileError::InvalidPath(e.message),
            WireFileErrorKind::Io => FileError::io("in the guest", io::Error::other(e.message)),
        }
    }
}

/// Something the sandbox tried that the platform refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityEvent {
    /// 1, 2, 3, ... in the order init recorded the events.
    pub seq: u64,
    /// When init recorded it, in milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// The process (thread group) as seen inside the sandbox; the calling
    /// thread's id if the process was gone before init could look.
    pub pid: i32,
    /// Its command name; empty if it was gone before init could look.
    pub comm: String,
    pub kind: SecurityEventKind,
    /// The refused system call, e.g. `ioctl` or `unshare`.
    pub syscall: String,
    /// What made it a refusal, e.g. `FICLONE (0x40049409)` or
    /// `CLONE_NEWUSER`; empty for calls refused whatever they ask.
    pub detail: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecurityEventKind {
    /// A system call the seccomp profile refuses.
    Seccomp,
    /// An access to a protected path refused by a VM's tamper watch (a
    /// process of an earlier phase; see `vm::tamper`).
    Tamper,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Exited {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// True when init killed the tree because of a `Kill` frame.
    pub killed: bool,
    pub cpu_user_us: u64,
    pub cpu_system_us: u64,
    pub max_rss_bytes: u64,
    pub session_state: Option<SessionState>,
    /// Set by an init that sees the kernel's OOM kills itself (a microVM's
    /// guest): whether the OOM killer fired while this exec ran. `None`:
    /// the node judges from the sandbox's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_killed: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionState {
    pub cwd: String,
    pub env: BTreeMap<String, String>,
}

/// One `recvmsg` into `buf` (retried on `EINTR`), with the descriptors
/// that came with it (close-on-exec) taken out of `control`: how both
/// sides receive the messages that pass descriptors (the phase leader's
/// orders, the zygote's requests and replies).
pub fn recv_with_fds(
    socket: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
    control: &mut rustix::net::RecvAncillaryBuffer<'_>,
) -> io::Result<(rustix::net::RecvMsg, Vec<std::os::fd::OwnedFd>)> {
    use rustix::net::{RecvAncillaryMessage, RecvFlags};
    let got = loop {
        match rustix::net::recvmsg(socket, &mut [io::IoSliceMut::new(buf)], control, RecvFlags::CMSG_CLOEXEC) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    };
    let mut fds = Vec::new();
    for message in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = message {
            fds.extend(received);
        }
    }
    Ok((got, fds))
}

/// Most descriptors one [`send_with_fds`] carries (the zygote's requests
/// are the largest).
pub const MAX_SENT_FDS: usize = zygote::MAX_REQUEST_FDS;

/// One `sendmsg` of `bytes` (retried on `EINTR`, `MSG_NOSIGNAL`: a peer
/// that went away is an `EPIPE`, not a signal) with `fds` riding on it
/// (`SCM_RIGHTS`; none if empty): how every side sends the messages that
/// pass descriptors, the twin of [`recv_with_fds`]. Returns the bytes sent;
/// on a stream socket that may be fewer than `bytes`, and the descriptors
/// went with the first of them, so the caller writes the rest plainly. A
/// non-blocking socket that is full answers `WouldBlock` with nothing sent.
pub fn send_with_fds(
    socket: std::os::fd::BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<usize> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if fds.len() > MAX_SENT_FDS || (!fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds))) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} descriptors do not fit one message (at most {MAX_SENT_FDS})", fds.len()),
        ));
    }
    loop {
        match rustix::net::sendmsg(socket, &[io::IoSlice::new(bytes)], &mut control, SendFlags::NOSIGNAL) {
            Ok(sent) => return Ok(sent),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| io::Error::other("frame too large"))?;
    let mut header = [0u8; 5];
    header[0] = kind as u8;
    header[1..].copy_from_slice(&len.to_be_bytes());
    w.write_all(&header)?;
    w.write_all(payload)?;
    w.flush()
}

pub fn write_json<T: Serialize>(w: &mut impl Write, kind: FrameKind, value: &T) -> io::Result<()> {
    let payload = serde_json::to_vec(value).map_err(io::Error::other)?;
    write_frame(w, kind, &payload)
}

/// Reads one frame; `Ok(None)` on a clean end of stream between frames.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(FrameKind, Vec<u8>)>> {
    let mut header = [0u8; 5];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "truncated frame header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    parse_header_and_read(header, r).map(Some)
}

fn parse_header_and_read(header: [u8; 5], r: &mut impl Read) -> io::Result<(FrameKind, Vec<u8>)> {
    let (kind, len) = parse_header(header)?;
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok((kind, payload))
}

/// Validates a frame header; shared by the blocking and the async readers.
pub fn parse_header(header: [u8; 5]) -> io::Result<(FrameKind, u32)> {
    let kind = FrameKind::from_u8(header[0])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unknown frame kind {}", header[0])))?;
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes is too large")));
    }
    Ok((kind, len))
}

/// Messages on the setup socket (fd [`SETUP_FD`]), one JSON object per line.
pub mod setup {
    use serde::{Deserialize, Serialize};

    /// init -> host.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "step", rename_all = "snake_case")]
    pub enum InitSays {
        /// init has unshared its user namespace: write its uid/gid maps and
        /// put it into the sandbox's cgroups, then send [`HostSays::Build`].
        UsernsReady,
        /// init forked the sandbox's PID 1; `pid` is its host pid. The first
        /// init process exits right after sending this.
        Pid1 {
            pid: i32,
        },
        /// PID 1 is serving on the control listener; setup is over.
        Ready,
        /// The initial phase's rules cannot be enforced in this image (e.g.
        /// a symbolic link on the way to a protected path); init exits.
        PhaseRejected {
            message: String,
        },
        Failed {
            message: String,
        },
    }

    /// host -> init.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "step", rename_all = "snake_case")]
    pub enum HostSays {
        /// The build order. Right after its line the host sends one byte
        /// carrying (`SCM_RIGHTS`) a detached clone of the sandbox's ready
        /// root filesystem (its overlay), which init attaches in its own
        /// mount namespace and pivots into: the namespace it copied (the
        /// zygote's template) was made before the host mounted the overlay.
        Build(BuildSpec),
    }

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    pub struct BuildSpec {
        pub hostname: String,
        /// Bring `lo` up in the new network namespace.
        pub loopback: bool,
        /// The phase the sandbox starts in (no name and no protected paths
        /// when the task has no phases).
        #[serde(default)]
        pub phase: super::PhaseRules,
    }
}

/// The init zygote: one `warren-init` per node, exec'd once, that forks
/// the first init of each new container sandbox instead of the node
/// exec'ing a fresh one (which costs an exec and glibc's static start-up,
/// whose CPUID probes trap on a VM: about half a millisecond per create).
///
/// Requests and replies are single `SOCK_SEQPACKET` messages on the socket
/// the zygote inherits at [`SOCKET_FD`]. A request's descriptors travel as
/// `SCM_RIGHTS`, in this order: the setup socket, the control listener, the
/// sandbox's cgroup2 directory, then `tasks` of each v1 hierarchy. A reply
/// carries the child's pidfd when it names a pid.
pub mod zygote {
    /// `argv[1]` that starts `warren-init` as the zygote.
    pub const ARG: &str = "--zygote";
    /// The fd number at which the zygote inherits its socket to the node.
    pub const SOCKET_FD: i32 = 3;
    /// Most v1 `tasks` descriptors one request may carry.
    pub const MAX_V1_TASKS: usize = 8;
    /// Most descriptors one request carries.
    pub const MAX_REQUEST_FDS: usize = 3 + MAX_V1_TASKS;
    /// Bytes of an encoded [`Request`].
    pub const REQUEST_BYTES: usize = 21;
    /// Bytes of an encoded [`Reply`].
    pub const REPLY_BYTES: usize = 8;

    /// One spawn; the descriptors travel beside it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Request {
        /// How many v1 `tasks` descriptors follow the first three.
        pub v1_tasks: u32,
        /// `RLIMIT_NOFILE` (soft, hard) for the child; `None` keeps the
        /// zygote's own.
        pub open_files: Option<(u64, u64)>,
    }

    impl Request {
        pub fn encode(&self) -> [u8; REQUEST_BYTES] {
            let mut out = [0u8; REQUEST_BYTES];
            out[..4].copy_from_slice(&self.v1_tasks.to_le_bytes());
            if let Some((soft, hard)) = self.open_files {
                out[4] = 1;
                out[5..13].copy_from_slice(&soft.to_le_bytes());
                out[13..21].copy_from_slice(&hard.to_le_bytes());
            }
            out
        }

        /// `None` for a message of the wrong size or shape.
        pub fn decode(bytes: &[u8]) -> Option<Request> {
            let bytes: &[u8; REQUEST_BYTES] = bytes.try_into().ok()?;
            let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
            let v1_tasks = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let open_files = match bytes[4] {
                0 => None,
                1 => Some((word(5), word(13))),
                _ => return None,
            };
            (v1_tasks as usize <= MAX_V1_TASKS).then_some(Request { v1_tasks, open_files })
        }
    }

    /// The zygote's answer: the child's host pid (its pidfd rides along),
    /// or the errno of a request it could not serve.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Reply {
        Spawned { pid: i32 },
        Failed { errno: i32 },
    }

    impl Reply {
        pub fn encode(&self) -> [u8; REPLY_BYTES] {
            let (pid, errno) = match *self {
                Reply::Spawned { pid } => (pid, 0),
                Reply::Failed { errno } => (0, errno),
            };
            let mut out = [0u8; REPLY_BYTES];
            out[..4].copy_from_slice(&pid.to_le_bytes());
            out[4..].copy_from_slice(&errno.to_le_bytes());
            out
        }

        pub fn decode(bytes: &[u8]) -> Option<Reply> {
            let bytes: &[u8; REPLY_BYTES] = bytes.try_into().ok()?;
            let pid = i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let errno = i32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
            match (pid, errno) {
                (pid, 0) if pid > 0 => Some(Reply::Spawned { pid }),
                (0, errno) if errno > 0 => Some(Reply::Failed { errno }),
                _ => None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_oversize() {
        let mut buf = Vec::new();
        write_json(&mut buf, FrameKind::Request, &Request::Ping).unwrap();
        write_frame(&mut buf, FrameKind::Stdout, b"hello").unwrap();
        let mut r = &buf[..];
        let (k, p) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(k, FrameKind::Request);
        assert_eq!(serde_json::from_slice::<Request>(&p).unwrap(), Request::Ping);
        let (k, p) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!((k, p.as_slice()), (FrameKind::Stdout, &b"hello"[..]));
        assert!(read_frame(&mut r).unwrap().is_none());

        let mut bad = vec![FrameKind::Stdout as u8];
        bad.extend_from_slice(&(MAX_FRAME_BYTES + 1).to_be_bytes());
        assert_eq!(read_frame(&mut &bad[..]).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let truncated = [FrameKind::Stdout as u8, 0, 0];
        assert_eq!(read_frame(&mut &truncated[..]).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn events_request_and_response_have_a_stable_json_form() {
        let request = serde_json::to_string(&Request::Events { after_seq: 7 }).unwrap();
        assert_eq!(request, r#"{"op":"events","after_seq":7}"#);
        let event = SecurityEvent {
            seq: 8,
            time_ms: 1_700_000_000_000,
            pid: 12,
            comm: "cp".into(),
            kind: SecurityEventKind::Seccomp,
            syscall: "ioctl".into(),
            detail: "FICLONE (0x40049409)".into(),
        };
        let response = Response::Events { events: vec![event], dropped: 0, next_seq: 9 };
        let json = serde_json::to_string(&response).unwrap();
        assert_eq!(
            json,
            r#"{"kind":"events","events":[{"seq":8,"time_ms":1700000000000,"pid":12,"comm":"cp","kind":"seccomp","syscall":"ioctl","detail":"FICLONE (0x40049409)"}],"dropped":0,"next_seq":9}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&json).unwrap(), response);
        let set = Request::SetPhase {
            phase: PhaseRules { name: "grade".into(), protected_paths: [("/answers".into(), PathAccess::Read)].into() },
            kill_running: true,
        };
        assert_eq!(
            serde_json::to_string(&set).unwrap(),
            r#"{"op":"set_phase","phase":{"name":"grade","protected_paths":{"/answers":"read"}},"kill_running":true}"#
        );
        let write = Request::WriteFile { path: "/a b".into(), mode: 0o644 };
        assert_eq!(serde_json::to_string(&write).unwrap(), r#"{"op":"write_file","path":"/a b","mode":420}"#);
        // The older requests keep their form.
        assert_eq!(serde_json::to_string(&Request::Ping).unwrap(), r#"{"op":"ping"}"#);
    }

    #[test]
    fn file_errors_cross_the_wire_with_their_kind() {
        for e in [
            FileError::NotFound,
            FileError::IsDirectory,
            FileError::NotDirectory,
            FileError::Conflict("directory not empty".into()),
            FileError::NoSpace,
            FileError::InvalidPath("`..` is not allowed".into()),
        ] {
            let json = serde_json::to_vec(&Response::FileError { error: WireFileError::from(&e) }).unwrap();
            let Response::FileError { error } = serde_json::from_slice(&json).unwrap() else { panic!("not an error") };
            assert_eq!(FileError::from(error).to_string(), e.to_string());
        }
        let io = FileError::io("write", io::Error::from_raw_os_error(libc::EIO));
        let back = FileError::from(WireFileError::from(&io));
        assert!(matches!(back, FileError::Io { .. }));
        assert!(back.to_string().contains("Input/output error"), "{back}");
        assert_eq!(FrameKind::from_u8(FrameKind::Commit as u8), Some(FrameKind::Commit));
    }

    #[test]
    fn zygote_messages_round_trip_and_malformed_ones_are_refused() {
        use super::zygote::{Reply, Request, MAX_V1_TASKS, REQUEST_BYTES};
        for request in
            [Request { v1_tasks: 5, open_files: Some((77, 1 << 40)) }, Request { v1_tasks: 0, open_files: None }]
        {
            assert_eq!(Request::decode(&request.encode()), Some(request));
        }
        let too_many = Request { v1_tasks: MAX_V1_TASKS as u32 + 1, open_files: None };
        assert_eq!(Request::decode(&too_many.encode()), None);
        let mut bad_flag = Request { v1_tasks: 1, open_files: None }.encode();
        bad_flag[4] = 2;
        assert_eq!(Request::decode(&bad_flag), None);
        assert_eq!(Request::decode(&[0u8; REQUEST_BYTES - 1]), None);
        for reply in [Reply::Spawned { pid: 4242 }, Reply::Failed { errno: libc::EAGAIN }] {
            assert_eq!(Reply::decode(&reply.encode()), Some(reply));
        }
        assert_eq!(Reply::decode(&[0u8; 8]), None, "neither a pid nor an errno");
    }

    /// What one side sends with descriptors the other receives: the bytes,
    /// then the same open files (a write through the received one shows in
    /// the sent one); a message with none carries none; more than fit one
    /// message are refused before anything is sent.
    #[test]
    fn descriptors_sent_with_a_message_arrive_with_it() {
        use std::io::Seek;
        use std::os::fd::AsFd;
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        assert_eq!(send_with_fds(a.as_fd(), b"one", &[file.as_fd()]).unwrap(), 3);
        assert_eq!(send_with_fds(a.as_fd(), b"two", &[]).unwrap(), 3);

        let mut buf = [0u8; 3];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let (got, fds) = recv_with_fds(b.as_fd(), &mut buf, &mut control).unwrap();
        assert_eq!((&buf[..got.bytes], fds.len()), (&b"one"[..], 1));
        std::fs::File::from(fds.into_iter().next().unwrap()).write_all(b"through the copy").unwrap();
        let mut seen = String::new();
        file.rewind().unwrap();
        file.read_to_string(&mut seen).unwrap();
        assert_eq!(seen, "through the copy");

        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_SENT_FDS))];
        let mut control = rustix::net::RecvAncillaryBuffer::new(&mut space);
        let (got, fds) = recv_with_fds(b.as_fd(), &mut buf, &mut control).unwrap();
        assert_eq!((&buf[..got.bytes], fds.len()), (&b"two"[..], 0));

        let too_many = vec![file.as_fd(); MAX_SENT_FDS + 1];
        let refused = send_with_fds(a.as_fd(), b"x", &too_many).unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidInput);
        drop(a);
        let mut rest = Vec::new();
        (&b).read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "a refused message sent {rest:?}");
    }
}

//! The kernel's audit channel, as far as Landlock needs it: a
//! `NETLINK_AUDIT` socket that reads and sets the audit status (enabled
//! flag, registered daemon, backlog limit) or listens on the read-log
//! multicast group, and a parser for the records Landlock denials produce.
//!
//! Since 6.15 the kernel reports a Landlock denial only as audit records,
//! one event per refused access, all with the same `audit(TIME:SERIAL)`
//! stamp: `AUDIT_LANDLOCK_ACCESS` (what was refused, in which domain),
//! `AUDIT_LANDLOCK_DOMAIN` (the first time a domain shows up: who created
//! it), and, when the task has an audit context, `AUDIT_SYSCALL` (the
//! refused process's pid and comm) and `AUDIT_EOE` (end of the event).
//!
//! Without an audit context (a task created under a `never,task` rule, see
//! [`AuditRule::task_never`]) there is no `AUDIT_SYSCALL` or `AUDIT_EOE`,
//! and each record gets a serial of its own: records must then be read one
//! by one, not grouped by serial.
//!
//! Never: touches the `failure` mode (2 would panic the host on a lost
//! record). Rules: lists them, and adds or deletes only the rule it is
//! given. The parser is pure; only [`AuditSocket`] makes system calls.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `AUDIT_GET`: read the status.
pub const AUDIT_GET: u16 = 1000;
/// `AUDIT_SET`: change the status fields named by the mask.
pub const AUDIT_SET: u16 = 1001;
/// `AUDIT_ADD_RULE`, `AUDIT_DEL_RULE`, `AUDIT_LIST_RULES`: one
/// `struct audit_rule_data` each (the list answers with one message per
/// rule, then `NLMSG_DONE`).
pub const AUDIT_ADD_RULE: u16 = 1011;
pub const AUDIT_DEL_RULE: u16 = 1012;
pub const AUDIT_LIST_RULES: u16 = 1013;
/// Sent by the kernel to a registered daemon to check that it still reads.
pub const AUDIT_REPLACE: u16 = 1329;
pub const AUDIT_SYSCALL: u16 = 1300;
pub const AUDIT_CONFIG_CHANGE: u16 = 1305;
/// End of a multi-record event.
pub const AUDIT_EOE: u16 = 1320;
pub const AUDIT_LANDLOCK_ACCESS: u16 = 1423;
pub const AUDIT_LANDLOCK_DOMAIN: u16 = 1424;

/// `AUDIT_ARCH_X86_64` as `AUDIT_SYSCALL` records write it.
const ARCH_X86_64: &str = "c000003e";
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `AUDIT_FILTER_TASK`: rules checked once, when a task is created.
pub const AUDIT_FILTER_TASK: u32 = 0x01;
/// `AUDIT_NEVER`: the rule's tasks get no audit context.
pub const AUDIT_NEVER: u32 = 0;
/// `AUDIT_BITMASK_SIZE` and `AUDIT_MAX_FIELDS`.
const RULE_MASK_WORDS: usize = 64;
const RULE_MAX_FIELDS: usize = 64;
/// `struct audit_rule_data` without its string buffer: flags, action,
/// field_count, mask, fields, values, fieldflags, buflen.
const RULE_LEN: usize = 4 * (3 + RULE_MASK_WORDS + 3 * RULE_MAX_FIELDS + 1);
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_HDRLEN: usize = 16;
/// `AUDIT_NLGRP_READLOG`: every record, as a multicast copy (needs
/// `CAP_AUDIT_READ`); independent of which daemon is registered.
const AUDIT_NLGRP_READLOG: u32 = 1;

const STATUS_ENABLED: u32 = 0x1;
const STATUS_PID: u32 = 0x4;
const STATUS_BACKLOG_LIMIT: u32 = 0x10;
/// `struct audit_status` as this kernel knows it: 11 `u32`s.
const STATUS_LEN: usize = 44;
/// How long a request waits for the kernel's answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one read blocks unless [`AuditSocket::set_recv_timeout`] says otherwise.
const DEFAULT_RECV_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The kernel refused a request (`EPERM`: no `CAP_AUDIT_CONTROL`, or not
    /// in the initial user and pid namespaces; `EEXIST`: another daemon is
    /// registered).
    #[error("{op}: the kernel answered {}", io::Error::from_raw_os_error(*errno))]
    Refused { op: &'static str, errno: i32 },
    #[error("{op}: no answer from the kernel within {REPLY_TIMEOUT:?}")]
    NoReply { op: &'static str },
}

impl AuditError {
    /// The errno the kernel refused a request with (`EEXIST`, `ENOENT`, `EPERM`).
    pub fn errno(&self) -> Option<i32> {
        match self {
            AuditError::Refused { errno, .. } => Some(*errno),
            _ => None,
        }
    }

    /// `EEXIST`: a rule identical to the one added is in force already.
    pub fn is_exists(&self) -> bool {
        self.errno() == Some(libc::EEXIST)
    }

    /// `ENOENT`: no rule identical to the one deleted.
    pub fn is_not_found(&self) -> bool {
        self.errno() == Some(libc::ENOENT)
    }
}

pub type Result<T, E = AuditError> = std::result::Result<T, E>;

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> AuditError {
    move |source| AuditError::Io { op, source }
}

/// The parts of `struct audit_status` Warren reads or sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AuditStatus {
    /// 0 off, 1 on, 2 on and locked.
    pub enabled: u32,
    /// What a lost record does: 0 nothing, 1 printk, 2 panic. Read only.
    pub failure: u32,
    /// The registered audit daemon's pid; 0 when none.
    pub pid: u32,
    pub backlog_limit: u32,
    pub lost: u32,
    pub backlog: u32,
}

impl AuditStatus {
    fn parse(body: &[u8]) -> Option<AuditStatus> {
        let word = |i: usize| body.get(i * 4..i * 4 + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
        Some(AuditStatus {
            enabled: word(1)?,
            failure: word(2)?,
            pid: word(3)?,
            backlog_limit: word(5)?,
            lost: word(6)?,
            backlog: word(7)?,
        })
    }
}

/// One record as the kernel sent it: its type and its text
/// (`audit(1796303516.462:40): domain=... blockers=...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    pub kind: u16,
    pub text: String,
}

/// A `NETLINK_AUDIT` socket. Records that arrive while a request waits for
/// its answer are kept for [`AuditSocket::recv`].
pub struct AuditSocket {
    fd: OwnedFd,
    seq: u32,
    early: VecDeque<RawRecord>,
}

impl AuditSocket {
    /// A socket for status requests; after [`AuditSocket::set_pid`] with
    /// this process's pid it is the daemon's socket, which every record is
    /// unicast to.
    pub fn open() -> Result<AuditSocket> {
        Self::open_groups(0)
    }

    /// A socket on the read-log multicast group: a copy of every record,
    /// whoever the daemon is, and only while audit is enabled.
    pub fn open_readlog() -> Result<AuditSocket> {
        Self::open_groups(1 << (AUDIT_NLGRP_READLOG - 1))
    }

    fn open_groups(groups: u32) -> Result<AuditSocket> {
        // SAFETY: plain socket(2); the returned descriptor is owned below.
        let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_AUDIT) };
        if raw < 0 {
            return Err(io_err("socket(NETLINK_AUDIT)")(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        addr.nl_groups = groups;
        // SAFETY: `addr` is a valid sockaddr_nl and the length says so.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &addr as *const libc::sockaddr_nl as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io_err("bind(NETLINK_AUDIT)")(io::Error::last_os_error()));
        }
        let socket = AuditSocket { fd, seq: 0, early: VecDeque::new() };
        // A daemon that reads too slowly makes the kernel retry and then
        // print the record to the kernel log: give bursts room. Forcing
        // needs CAP_NET_ADMIN; the plain size is the fallback.
        let bytes: libc::c_int = 8 << 20;
        if socket.setsockopt(libc::SO_RCVBUFFORCE, &bytes).is_err() {
            socket.setsockopt(libc::SO_RCVBUF, &bytes).map_err(io_err("setsockopt(SO_RCVBUF)"))?;
        }
        // Never block for good: requests wait for their answer with a
        // deadline, and readers look up from time to time.
        socket.set_recv_timeout(DEFAULT_RECV_TIMEOUT)?;
        Ok(socket)
    }

    fn setsockopt<T>(&self, name: libc::c_int, value: &T) -> io::Result<()> {
        // SAFETY: `value` points to a live T and the length is its size.
        let rc = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                value as *const T as *const libc::c_void,
                std::mem::size_of::<T>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// How long [`AuditSocket::recv`] blocks before it returns `None`
    /// (default 100 ms).
    pub fn set_recv_timeout(&self, timeout: Duration) -> Result<()> {
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        self.setsockopt(libc::SO_RCVTIMEO, &tv).map_err(io_err("setsockopt(SO_RCVTIMEO)"))
    }

    /// `AUDIT_LIST_RULES`: every rule of every list, in the kernel's order.
    pub fn list_rules(&mut self) -> Result<Vec<AuditRule>> {
        let op = "AUDIT_LIST_RULES";
        let seq = self.send(AUDIT_LIST_RULES, &[], op)?;
        let deadline = std::time::Instant::now() + REPLY_TIMEOUT;
        let mut rules = Vec::new();
        let (mut acked, mut done) = (false, false);
        // The rules come from a kernel thread of their own: the ack may
        // arrive before or after them.
        while !(acked && done) {
            match self.reply(seq, deadline, op)? {
                Reply::Ack => acked = true,
                Reply::Message(NLMSG_DONE, _) => done = true,
                Reply::Message(AUDIT_LIST_RULES, body) => rules.push(AuditRule::parse(&body)),
                Reply::Message(..) => {}
            }
        }
        Ok(rules)
    }

    /// `AUDIT_ADD_RULE`. `EEXIST` (as [`AuditError::Refused`]) when an
    /// identical rule is in its list already.
    pub fn add_rule(&mut self, rule: &AuditRule) -> Result<()> {
        self.request_acked(AUDIT_ADD_RULE, &rule.data, "AUDIT_ADD_RULE")
    }

    /// `AUDIT_DEL_RULE`: deletes exactly the rule identical to `rule`;
    /// `ENOENT` when there is none.
    pub fn delete_rule(&mut self, rule: &AuditRule) -> Result<()> {
        self.request_acked(AUDIT_DEL_RULE, &rule.data, "AUDIT_DEL_RULE")
    }

    fn request_acked(&mut self, kind: u16, body: &[u8], op: &'static str) -> Result<()> {
        let seq = self.send(kind, body, op)?;
        let deadline = std::time::Instant::now() + REPLY_TIMEOUT;
        loop {
            if let Reply::Ack = self.reply(seq, deadline, op)? {
                return Ok(());
            }
        }
    }

    /// `AUDIT_GET`.
    pub fn status(&mut self) -> Result<AuditStatus> {
        let seq = self.send(AUDIT_GET, &[], "AUDIT_GET")?;
        let deadline = std::time::Instant::now() + REPLY_TIMEOUT;
        let mut status = None;
        let mut acked = false;
        while status.is_none() || !acked {
            match self.reply(seq, deadline, "AUDIT_GET")? {
                Reply::Ack => acked = true,
                Reply::Message(AUDIT_GET, body) => status = AuditStatus::parse(&body),
                Reply::Message(..) => {}
            }
        }
        status.ok_or(AuditError::NoReply { op: "AUDIT_GET" })
    }

    /// Registers this process as the audit daemon (`pid` = its own pid), or
    /// unregisters it (`pid` = 0). The kernel refuses to replace a daemon
    /// that still reads (`EEXIST`) and drops one that does not.
    pub fn set_pid(&mut self, pid: u32) -> Result<()> {
        self.set(AuditStatusChange { mask: STATUS_PID, pid, ..Default::default() }, "AUDIT_SET pid")
    }

    pub fn set_enabled(&mut self, enabled: u32) -> Result<()> {
        self.set(AuditStatusChange { mask: STATUS_ENABLED, enabled, ..Default::default() }, "AUDIT_SET enabled")
    }

    pub fn set_backlog_limit(&mut self, backlog_limit: u32) -> Result<()> {
        let change = AuditStatusChange { mask: STATUS_BACKLOG_LIMIT, backlog_limit, ..Default::default() };
        self.set(change, "AUDIT_SET backlog_limit")
    }

    fn set(&mut self, change: AuditStatusChange, op: &'static str) -> Result<()> {
        self.request_acked(AUDIT_SET, &change.encode(), op)
    }

    fn send(&mut self, kind: u16, body: &[u8], op: &'static str) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let mut msg = Vec::with_capacity(NLMSG_HDRLEN + body.len());
        msg.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        msg.extend_from_slice(&self.seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(body);
        // SAFETY: `msg` is a live buffer of the given length; the socket is
        // connected to the kernel by default (destination pid 0).
        let n = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr() as *const libc::c_void, msg.len(), 0) };
        if n < 0 {
            return Err(io_err(op)(io::Error::last_os_error()));
        }
        Ok(self.seq)
    }

    /// The next answer to request `seq`; records that come first are kept.
    fn reply(&mut self, seq: u32, deadline: std::time::Instant, op: &'static str) -> Result<Reply> {
        loop {
            if std::time::Instant::now() > deadline {
                return Err(AuditError::NoReply { op });
            }
            let Some((kind, msg_seq, body)) = self.recv_datagram(op)? else { continue };
            if kind == NLMSG_ERROR && msg_seq == seq {
                let errno = body.get(..4).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                return if errno == 0 { Ok(Reply::Ack) } else { Err(AuditError::Refused { op, errno: -errno }) };
            }
            if matches!(kind, AUDIT_GET | AUDIT_LIST_RULES | NLMSG_DONE) && msg_seq == seq {
                return Ok(Reply::Message(kind, body));
            }
            if let Some(record) = record_of(kind, &body) {
                self.early.push_back(record);
            }
        }
    }

    /// The next record; `None` when none came within the receive timeout.
    pub fn recv(&mut self) -> Result<Option<RawRecord>> {
        if let Some(record) = self.early.pop_front() {
            return Ok(Some(record));
        }
        loop {
            let Some((kind, _, body)) = self.recv_datagram("recv(NETLINK_AUDIT)")? else { return Ok(None) };
            if let Some(record) = record_of(kind, &body) {
                return Ok(Some(record));
            }
        }
    }

    /// One datagram: (type, seq, body). Audit records are sent one per
    /// datagram, and their `nlmsg_len` leaves out the header (a kernel
    /// quirk kept for compatibility), so the body is all after the header.
    fn recv_datagram(&mut self, op: &'static str) -> Result<Option<(u16, u32, Vec<u8>)>> {
        let mut buf = vec![0u8; 16 << 10];
        // SAFETY: `buf` is a live, writable buffer of the given length.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                // The kernel overran our buffer: records were lost, the
                // socket still works.
                Some(libc::ENOBUFS) => Ok(None),
                _ => Err(io_err(op)(e)),
            };
        }
        let n = n as usize;
        if n < NLMSG_HDRLEN {
            return Ok(None);
        }
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let seq = u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]);
        buf.truncate(n);
        Ok(Some((kind, seq, buf.split_off(NLMSG_HDRLEN))))
    }
}

enum Reply {
    Ack,
    Message(u16, Vec<u8>),
}

#[derive(Debug, Default)]
struct AuditStatusChange {
    mask: u32,
    enabled: u32,
    pid: u32,
    backlog_limit: u32,
}

impl AuditStatusChange {
    fn encode(&self) -> [u8; STATUS_LEN] {
        let mut out = [0u8; STATUS_LEN];
        for (i, v) in [(0, self.mask), (1, self.enabled), (3, self.pid), (5, self.backlog_limit)] {
            out[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        out
    }
}

/// One audit rule, as `struct audit_rule_data` encodes it: compared and
/// deleted by its exact bytes, as the kernel compares rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditRule {
    data: Vec<u8>,
}

impl AuditRule {
    /// `-a never,task`: tasks created while it is in force get no audit
    /// context (no per-syscall audit work, no `AUDIT_SYSCALL` records).
    /// No fields, an empty syscall mask (a task rule's mask is not used).
    pub fn task_never() -> AuditRule {
        let mut data = vec![0u8; RULE_LEN];
        data[..4].copy_from_slice(&AUDIT_FILTER_TASK.to_ne_bytes());
        data[4..8].copy_from_slice(&AUDIT_NEVER.to_ne_bytes());
        AuditRule { data }
    }

    fn parse(body: &[u8]) -> AuditRule {
        AuditRule { data: body.to_vec() }
    }

    fn word(&self, i: usize) -> Option<u32> {
        self.data.get(i * 4..i * 4 + 4).map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// The list the rule is on (`AUDIT_FILTER_*`).
    pub fn list(&self) -> Option<u32> {
        self.word(0)
    }

    /// `AUDIT_NEVER` or `AUDIT_ALWAYS`.
    pub fn action(&self) -> Option<u32> {
        self.word(1)
    }

    pub fn field_count(&self) -> Option<u32> {
        self.word(2)
    }

    /// Any `never,task` rule without fields, whatever its mask: it has the
    /// effect of [`AuditRule::task_never`] (e.g. a distribution's own).
    pub fn is_task_never(&self) -> bool {
        self.list() == Some(AUDIT_FILTER_TASK) && self.action() == Some(AUDIT_NEVER) && self.field_count() == Some(0)
    }

    /// The encoded rule.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }
}

/// Records are the kernel's text messages (types 1100 and up); replies and
/// control messages below that are not.
fn record_of(kind: u16, body: &[u8]) -> Option<RawRecord> {
    if kind < 1100 || kind == AUDIT_REPLACE {
        return None;
    }
    let end = body.iter().position(|&b| b == 0).unwrap_or(body.len());
    Some(RawRecord { kind, text: String::from_utf8_lossy(&body[..end]).trim_end().to_string() })
}

// ---- parsing ---------------------------------------------------------------

/// `audit(SECONDS.MILLIS:SERIAL)`: when the event happened and its number;
/// every record of one event carries the same stamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    pub time_ms: u64,
    pub serial: u64,
}

/// Splits a record's text into its stamp and the rest.
pub fn parse_stamp(text: &str) -> Option<(Stamp, &str)> {
    let rest = text.strip_prefix("audit(")?;
    let (inner, rest) = rest.split_once("):")?;
    let (time, serial) = inner.split_once(':')?;
    let (secs, millis) = time.split_once('.')?;
    let time_ms = secs.parse::<u64>().ok()?.checked_mul(1000)?.checked_add(millis.parse::<u64>().ok()?)?;
    Some((Stamp { time_ms, serial: serial.parse().ok()? }, rest.trim_start()))
}

/// The `key=value` fields of a record body, values decoded: `"quoted"`
/// strings lose their quotes, and a value the kernel hex-encoded because
/// it held spaces, quotes or control characters (an untrusted string such
/// as a path or comm) is decoded; anything else is kept as written.
pub fn fields(body: &str) -> Vec<(&str, String)> {
    let mut out = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let Some(eq) = rest.find('=') else { break };
        let key = &rest[..eq];
        // A key never holds a space; text without one is not a field.
        let key = key.rsplit(' ').next().unwrap_or(key);
        let after = &rest[eq + 1..];
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            match quoted.find('"') {
                Some(end) => (quoted[..end].to_string(), &quoted[end + 1..]),
                None => (quoted.to_string(), ""),
            }
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        out.push((key, value));
        rest = next.trim_start();
    }
    out
}

/// Decodes a value the kernel may have hex-encoded (`audit_log_untrustedstring`):
/// an even number of upper-case hex digits that decode to text. Quoted
/// values come out of [`fields`] already; call this only on unquoted ones.
pub fn untrusted(value: &str) -> String {
    let hex = value.len().is_multiple_of(2)
        && !value.is_empty()
        && value.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b));
    if !hex {
        return value.to_string();
    }
    let bytes: Option<Vec<u8>> =
        (0..value.len()).step_by(2).map(|i| u8::from_str_radix(&value[i..i + 2], 16).ok()).collect();
    match bytes {
        Some(b) => String::from_utf8_lossy(&b).into_owned(),
        None => value.to_string(),
    }
}

/// A field that is an untrusted string: quoted as is, or hex-encoded.
fn untrusted_field(body: &str, name: &str) -> Option<String> {
    let raw = raw_field(body, name)?;
    let value = fields(body).into_iter().find(|(k, _)| *k == name).map(|(_, v)| v)?;
    Some(if raw.starts_with('"') { value } else { untrusted(&value) })
}

/// A field's text exactly as written (quotes included).
fn raw_field<'a>(body: &'a str, name: &str) -> Option<&'a str> {
    let mut search = body;
    loop {
        let at = search.find(name)?;
        let before_ok = at == 0 || search.as_bytes()[at - 1] == b' ';
        let after = &search[at + name.len()..];
        if before_ok && after.starts_with('=') {
            return Some(&after[1..]);
        }
        search = &search[at + name.len()..];
    }
}

fn field(body: &str, name: &str) -> Option<String> {
    fields(body).into_iter().find(|(k, _)| *k == name).map(|(_, v)| v)
}

/// What one record of a Landlock denial event says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LandlockRecord {
    /// `AUDIT_LANDLOCK_ACCESS`: a refused access.
    Access(LandlockAccess),
    /// `AUDIT_LANDLOCK_DOMAIN status=allocated`: the domain's first
    /// denial names the process that created it.
    DomainAllocated { stamp: Stamp, domain: u64, pid: i32, comm: String },
    /// `AUDIT_LANDLOCK_DOMAIN status=deallocated`: the domain is gone.
    DomainFreed { stamp: Stamp, domain: u64, denials: u64 },
    /// `AUDIT_SYSCALL`: the system call an event happened in, and who made
    /// it; `syscall` is the x86_64 number, `None` for another ABI (`arch=`
    /// other than `c000003e`, e.g. a 32-bit process).
    Syscall { stamp: Stamp, pid: i32, comm: String, syscall: Option<u64> },
    /// `AUDIT_EOE`: the event's last record.
    EndOfEvent { stamp: Stamp },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LandlockAccess {
    pub stamp: Stamp,
    /// The youngest domain that refused it (hex in the record).
    pub domain: u64,
    /// The missing rights, e.g. `fs.read_file` or `fs.write_file,fs.truncate`.
    pub blockers: String,
    /// The file, as the refused process sees it, when the access was to one.
    pub path: Option<String>,
    /// What else the record says about the object (e.g. `daddr=... dest=...`
    /// for a refused connection, `opid=... ocomm=...` for a signal), for
    /// records without a path.
    pub object: String,
}

impl LandlockAccess {
    /// The event's `detail`: the refused rights and what they were refused on.
    pub fn detail(&self) -> String {
        match (&self.path, self.object.is_empty()) {
            (Some(path), _) => format!("{} {path}", self.blockers),
            (None, false) => format!("{} {}", self.blockers, self.object),
            (None, true) => self.blockers.clone(),
        }
    }
}

/// Parses the records a Landlock denial event is made of; every other
/// record (and any record that does not parse) is `None`.
pub fn parse_landlock(record: &RawRecord) -> Option<LandlockRecord> {
    let (stamp, body) = parse_stamp(&record.text)?;
    let domain = || u64::from_str_radix(&field(body, "domain")?, 16).ok();
    match record.kind {
        AUDIT_LANDLOCK_ACCESS => {
            let object: Vec<String> = fields(body)
                .into_iter()
                .filter(|(k, _)| !matches!(*k, "domain" | "blockers" | "path" | "dev" | "ino"))
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            Some(LandlockRecord::Access(LandlockAccess {
                stamp,
                domain: domain()?,
                blockers: field(body, "blockers")?,
                path: untrusted_field(body, "path"),
                object: object.join(" "),
            }))
        }
        AUDIT_LANDLOCK_DOMAIN => match field(body, "status")?.as_str() {
            "allocated" => Some(LandlockRecord::DomainAllocated {
                stamp,
                domain: domain()?,
                pid: field(body, "pid")?.parse().ok()?,
                comm: untrusted_field(body, "comm").unwrap_or_default(),
            }),
            "deallocated" => Some(LandlockRecord::DomainFreed {
                stamp,
                domain: domain()?,
                denials: field(body, "denials").and_then(|d| d.parse().ok()).unwrap_or(0),
            }),
            _ => None,
        },
        AUDIT_SYSCALL => Some(LandlockRecord::Syscall {
            stamp,
            pid: field(body, "pid")?.parse().ok()?,
            comm: untrusted_field(body, "comm").unwrap_or_default(),
            syscall: match field(body, "arch").as_deref() {
                Some(ARCH_X86_64) => field(body, "syscall")?.parse().ok(),
                _ => None,
            },
        }),
        AUDIT_EOE => Some(LandlockRecord::EndOfEvent { stamp }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: u16, text: &str) -> RawRecord {
        RawRecord { kind, text: text.to_string() }
    }

    // Captured on this host (kernel 6.18) from a process that Landlock
    // refused two reads, with this process registered as the audit daemon.
    const ACCESS: &str = r#"audit(1796303516.462:40): domain=109a41c35 blockers=fs.read_file path="/tmp/s12/answers/x" dev="vda" ino=10035640"#;
    const ACCESS_HEX: &str = "audit(1796303513.742:36): domain=109a41c33 blockers=fs.read_file path=2F746D702F7331322F616E73776572732F782079 dev=\"vda\" ino=10035521";
    const DOMAIN: &str = r#"audit(1796303513.742:36): domain=109a41c33 status=allocated mode=enforcing pid=8088 uid=0 exe="/tmp/s12/ll" comm="ll""#;
    const SYSCALL: &str = r#"audit(1796303513.742:36): arch=c000003e syscall=257 success=no exit=-13 a0=ffffff9c a1=7ffcd9601933 a2=0 a3=0 items=0 ppid=8024 pid=8088 auid=4294967295 uid=0 gid=0 euid=0 suid=0 fsuid=0 egid=0 sgid=0 fsgid=0 tty=(none) ses=4294967295 comm="ll" exe="/tmp/s12/ll" key=(null)"#;
    const EOE: &str = "audit(1796303513.742:36): ";
    const FREED: &str = "audit(1796303513.798:38): domain=109a41c33 status=deallocated denials=2";
    const CONFIG: &str = "audit(1796303514.750:39): op=set audit_enabled=0 old=1 auid=4294967295 ses=4294967295 res=1";

    #[test]
    fn stamps_carry_time_and_serial() {
        let (stamp, rest) = parse_stamp(ACCESS).unwrap();
        assert_eq!(stamp, Stamp { time_ms: 1_796_303_516_462, serial: 40 });
        assert!(rest.starts_with("domain="));
        assert_eq!(parse_stamp("audit(12:3): x"), None);
        assert_eq!(parse_stamp("type=1300 msg=audit(1.2:3): x"), None);
    }

    #[test]
    fn access_records_name_domain_blockers_and_path() {
        let Some(LandlockRecord::Access(a)) = parse_landlock(&rec(AUDIT_LANDLOCK_ACCESS, ACCESS)) else { panic!() };
        assert_eq!(a.domain, 0x109a41c35);
        assert_eq!(a.blockers, "fs.read_file");
        assert_eq!(a.path.as_deref(), Some("/tmp/s12/answers/x"));
        assert_eq!(a.detail(), "fs.read_file /tmp/s12/answers/x");
    }

    #[test]
    fn hex_encoded_paths_are_decoded() {
        let Some(LandlockRecord::Access(a)) = parse_landlock(&rec(AUDIT_LANDLOCK_ACCESS, ACCESS_HEX)) else { panic!() };
        assert_eq!(a.path.as_deref(), Some("/tmp/s12/answers/x y"));
    }

    #[test]
    fn records_without_a_path_keep_their_object() {
        let text = "audit(1.5:9): domain=1a blockers=scope.signal opid=42 ocomm=\"sh\"";
        let Some(LandlockRecord::Access(a)) = parse_landlock(&rec(AUDIT_LANDLOCK_ACCESS, text)) else { panic!() };
        assert_eq!((a.path.clone(), a.detail()), (None, "scope.signal opid=42 ocomm=sh".to_string()));
    }

    #[test]
    fn domain_syscall_and_end_records_parse() {
        assert_eq!(
            parse_landlock(&rec(AUDIT_LANDLOCK_DOMAIN, DOMAIN)),
            Some(LandlockRecord::DomainAllocated {
                stamp: Stamp { time_ms: 1_796_303_513_742, serial: 36 },
                domain: 0x109a41c33,
                pid: 8088,
                comm: "ll".into()
            })
        );
        assert_eq!(
            parse_landlock(&rec(AUDIT_LANDLOCK_DOMAIN, FREED)),
            Some(LandlockRecord::DomainFreed {
                stamp: Stamp { time_ms: 1_796_303_513_798, serial: 38 },
                domain: 0x109a41c33,
                denials: 2
            })
        );
        let Some(LandlockRecord::Syscall { pid, comm, syscall, .. }) = parse_landlock(&rec(AUDIT_SYSCALL, SYSCALL))
        else {
            panic!()
        };
        assert_eq!((pid, comm.as_str(), syscall), (8088, "ll", Some(257)));
        let compat = SYSCALL.replace("arch=c000003e", "arch=40000003");
        let Some(LandlockRecord::Syscall { syscall, .. }) = parse_landlock(&rec(AUDIT_SYSCALL, &compat)) else {
            panic!()
        };
        assert_eq!(syscall, None, "a 32-bit process's numbers are another table");
        assert!(matches!(
            parse_landlock(&rec(AUDIT_EOE, EOE)),
            Some(LandlockRecord::EndOfEvent { stamp: Stamp { serial: 36, .. } })
        ));
    }

    #[test]
    fn other_and_broken_records_are_ignored() {
        assert_eq!(parse_landlock(&rec(AUDIT_CONFIG_CHANGE, CONFIG)), None);
        assert_eq!(parse_landlock(&rec(AUDIT_LANDLOCK_ACCESS, "audit(1.2:3): blockers=fs.read_file")), None);
        assert_eq!(parse_landlock(&rec(AUDIT_LANDLOCK_ACCESS, "garbage")), None);
        assert_eq!(parse_landlock(&rec(AUDIT_LANDLOCK_DOMAIN, "audit(1.2:3): domain=zz status=allocated")), None);
    }

    #[test]
    fn untrusted_strings_decode_only_when_hex() {
        assert_eq!(untrusted("2F612062"), "/a b");
        assert_eq!(untrusted("(null)"), "(null)");
        assert_eq!(untrusted("abc"), "abc");
        assert_eq!(untrusted("ABC"), "ABC");
    }

    #[test]
    fn the_task_never_rule_encodes_list_action_and_no_fields() {
        let rule = AuditRule::task_never();
        assert_eq!(rule.bytes().len(), 1040, "sizeof(struct audit_rule_data)");
        assert_eq!((rule.list(), rule.action(), rule.field_count()), (Some(1), Some(0), Some(0)));
        assert!(rule.is_task_never());
        let mut exit_never = rule.bytes().to_vec();
        exit_never[..4].copy_from_slice(&4u32.to_ne_bytes());
        assert!(!AuditRule::parse(&exit_never).is_task_never(), "an exit-list rule is another rule");
        let mut with_field = rule.bytes().to_vec();
        with_field[8..12].copy_from_slice(&1u32.to_ne_bytes());
        assert!(!AuditRule::parse(&with_field).is_task_never(), "a rule with a field is not for every task");
        assert!(!AuditRule::parse(&[1, 0]).is_task_never());
    }

    #[test]
    fn status_replies_decode_and_changes_encode() {
        let mut body = [0u8; STATUS_LEN];
        for (i, v) in [0u32, 1, 1, 7185, 0, 64, 3, 2, 127, 15000, 0].into_iter().enumerate() {
            body[i * 4..i * 4 + 4].copy_from_slice(&v.to_ne_bytes());
        }
        let s = AuditStatus::parse(&body).unwrap();
        assert_eq!(s, AuditStatus { enabled: 1, failure: 1, pid: 7185, backlog_limit: 64, lost: 3, backlog: 2 });
        assert_eq!(AuditStatus::parse(&body[..12]), None);
        let change = AuditStatusChange { mask: STATUS_PID, pid: 9, ..Default::default() }.encode();
        assert_eq!(AuditStatus::parse(&change).unwrap().pid, 9);
        assert_eq!(change[..4], STATUS_PID.to_ne_bytes(), "the mask names only the pid");
        assert_eq!(AuditStatus::parse(&change).unwrap().failure, 0, "failure is never in the mask");
    }
}

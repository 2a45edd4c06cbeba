//! The slice of fanotify the cache uses: a pre-content group, inode marks,
//! event records with their byte range, and verdicts.
//!
//! Debian 12's headers (and the `libc` crate) predate pre-content events, so
//! their definitions are spelled out here from the kernel's
//! `include/uapi/linux/fanotify.h` (v6.14 and later; checked on 6.18).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Raised before a marked file's content is read or written, with the range.
pub(crate) const FAN_PRE_ACCESS: u64 = 0x0010_0000;
/// Info record type carrying `{hdr, u32 pad, u64 offset, u64 count}`.
const FAN_EVENT_INFO_TYPE_RANGE: u8 = 6;
/// `FAN_DENY_ERRNO(e)` is `FAN_DENY | (e & FAN_ERRNO_MASK) << FAN_ERRNO_SHIFT`.
const FAN_ERRNO_BITS: u32 = 8;
const FAN_ERRNO_SHIFT: u32 = 32 - FAN_ERRNO_BITS;
const FAN_ERRNO_MASK: u32 = (1 << FAN_ERRNO_BITS) - 1;
/// The event layout this parser knows (`struct fanotify_event_metadata`).
const FANOTIFY_METADATA_VERSION: u8 = 3;
const METADATA_LEN: usize = 24;
/// `struct fanotify_event_info_range`.
const RANGE_INFO_LEN: usize = 24;

/// The answer to one permission event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allow,
    /// The reader's syscall fails with `EIO`: what a missing or corrupt
    /// chunk must look like, never zeros.
    DenyEio,
}

impl Verdict {
    fn response_bits(self) -> u32 {
        match self {
            Verdict::Allow => libc::FAN_ALLOW,
            Verdict::DenyEio => libc::FAN_DENY | ((libc::EIO.unsigned_abs() & FAN_ERRNO_MASK) << FAN_ERRNO_SHIFT),
        }
    }
}

/// One event as read from the group: a permission event owns the file
/// descriptor the kernel opened for it, which is also the only descriptor
/// through which the file can be written without raising another event.
#[derive(Debug)]
pub(crate) struct Event {
    pub(crate) mask: u64,
    /// The number the verdict must name; it stays valid as a response key
    /// after `fd` is closed.
    pub(crate) raw_fd: RawFd,
    pub(crate) fd: Option<OwnedFd>,
    /// `(offset, count)` from the range record, if the event had one.
    pub(crate) range: Option<(u64, u64)>,
    /// The process whose access raised the event (in the daemon's pid
    /// namespace); it waits in the kernel until the event is answered.
    pub(crate) pid: i32,
}

impl Event {
    pub(crate) fn is_pre_access(&self) -> bool {
        self.mask & FAN_PRE_ACCESS != 0
    }
}

/// A fanotify group of the pre-content class. Every process holding its
/// descriptor keeps the group, its marks and its pending events alive.
#[derive(Debug)]
pub(crate) struct Group {
    fd: OwnedFd,
}

impl Group {
    /// A new group whose event descriptors are opened read-write (so fills
    /// can be written through them) and whose queue never overflows: an
    /// overflowed permission event is allowed by the kernel, which would read
    /// a hole as zeros.
    pub(crate) fn new() -> io::Result<Self> {
        let flags = libc::FAN_CLASS_PRE_CONTENT | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK | libc::FAN_UNLIMITED_QUEUE;
        let event_f_flags = u32::try_from(libc::O_RDWR | libc::O_LARGEFILE).map_err(|_| io::ErrorKind::InvalidInput)?;
        // SAFETY: fanotify_init takes two flag words and touches no memory of ours.
        let fd = unsafe { libc::fanotify_init(flags, event_f_flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fanotify_init just returned this descriptor; nothing else owns it.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Wraps a descriptor of an existing group (one adopted from a holder).
    pub(crate) fn from_fd(fd: OwnedFd) -> Self {
        Self { fd }
    }

    /// Raises pre-content events for every access to `file`'s inode. Must
    /// happen before the file is opened by a mount: the kernel decides at
    /// open time whether a file can raise pre-content events at all.
    pub(crate) fn mark(&self, file: BorrowedFd<'_>) -> io::Result<()> {
        self.modify_mark(libc::FAN_MARK_ADD, file)
    }

    /// Stops events for `file`; an inode that was not marked is not an error.
    pub(crate) fn unmark(&self, file: BorrowedFd<'_>) -> io::Result<()> {
        match self.modify_mark(libc::FAN_MARK_REMOVE, file) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            other => other,
        }
    }

    fn modify_mark(&self, flags: libc::c_uint, file: BorrowedFd<'_>) -> io::Result<()> {
        // SAFETY: a null path makes the kernel mark the inode of `file`
        // itself; both descriptors are borrowed and outlive the call.
        let rc = unsafe {
            libc::fanotify_mark(
                self.fd.as_raw_fd(),
                flags | libc::FAN_MARK_INODE,
                FAN_PRE_ACCESS,
                file.as_raw_fd(),
                std::ptr::null(),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Answers the permission event whose descriptor number is `event_fd`.
    /// `ENOENT` means no pending event carries that number.
    pub(crate) fn respond(&self, event_fd: RawFd, verdict: Verdict) -> io::Result<()> {
        let mut response = [0u8; 8];
        response[..4].copy_from_slice(&event_fd.to_ne_bytes());
        response[4..].copy_from_slice(&verdict.response_bits().to_ne_bytes());
        let written = rustix::io::write(&self.fd, &response)?;
        if written != response.len() {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short fanotify response"));
        }
        Ok(())
    }

    /// Reads whatever events are queued; an empty list when none are.
    pub(crate) fn read_events(&self, buf: &mut [u8]) -> io::Result<Vec<Event>> {
        match rustix::io::read(&self.fd, &mut *buf) {
            Ok(n) => Ok(parse_events(&buf[..n])),
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }
}

impl AsFd for Group {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Whether `fd` is a fanotify group, as the kernel names its anonymous inode.
pub(crate) fn is_fanotify(fd: RawFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|target| target.as_os_str() == "anon_inode:[fanotify]")
}

/// Splits a read buffer into events. Every descriptor in it is taken into an
/// `OwnedFd` so none leaks, whatever happens to the event afterwards.
fn parse_events(mut buf: &[u8]) -> Vec<Event> {
    let mut events = Vec::new();
    while buf.len() >= METADATA_LEN {
        let event_len = usize::try_from(u32_at(buf, 0)).unwrap_or(usize::MAX);
        let metadata_len = usize::from(u16::from_ne_bytes([buf[6], buf[7]]));
        if buf[4] != FANOTIFY_METADATA_VERSION
            || event_len < METADATA_LEN
            || event_len > buf.len()
            || metadata_len < METADATA_LEN
            || metadata_len > event_len
        {
            tracing::error!(version = buf[4], event_len, "unparseable fanotify event; dropping the rest of the read");
            break;
        }
        let raw_fd = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
        let fd = (raw_fd >= 0).then(|| {
            // SAFETY: the kernel installed this descriptor in our table for
            // this event and hands its ownership to the reader.
            unsafe { OwnedFd::from_raw_fd(raw_fd) }
        });
        let pid = i32::from_ne_bytes([buf[20], buf[21], buf[22], buf[23]]);
        events.push(Event { mask: u64_at(buf, 8), raw_fd, fd, range: find_range(&buf[metadata_len..event_len]), pid });
        buf = &buf[event_len..];
    }
    events
}

fn find_range(mut info: &[u8]) -> Option<(u64, u64)> {
    while info.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([info[2], info[3]]));
        if len < 4 || len > info.len() {
            return None;
        }
        if info[0] == FAN_EVENT_INFO_TYPE_RANGE && len >= RANGE_INFO_LEN {
            return Some((u64_at(info, 8), u64_at(info, 16)));
        }
        info = &info[len..];
    }
    None
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&buf[at..at + 4]);
    u32::from_ne_bytes(word)
}

fn u64_at(buf: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&buf[at..at + 8]);
    u64::from_ne_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(mask: u64, fd: i32, range: Option<(u64, u64)>) -> Vec<u8> {
        let info_len = if range.is_some() { RANGE_INFO_LEN } else { 0 };
        let mut out = Vec::new();
        out.extend_from_slice(&u32::try_from(METADATA_LEN + info_len).unwrap().to_ne_bytes());
        out.push(FANOTIFY_METADATA_VERSION);
        out.push(0);
        out.extend_from_slice(&u16::try_from(METADATA_LEN).unwrap().to_ne_bytes());
        out.extend_from_slice(&mask.to_ne_bytes());
        out.extend_from_slice(&fd.to_ne_bytes());
        out.extend_from_slice(&1234i32.to_ne_bytes());
        if let Some((offset, count)) = range {
            out.push(FAN_EVENT_INFO_TYPE_RANGE);
            out.push(0);
            out.extend_from_slice(&u16::try_from(RANGE_INFO_LEN).unwrap().to_ne_bytes());
            out.extend_from_slice(&0u32.to_ne_bytes());
            out.extend_from_slice(&offset.to_ne_bytes());
            out.extend_from_slice(&count.to_ne_bytes());
        }
        out
    }

    #[test]
    fn parses_range_records_and_event_boundaries() {
        // fd -1 (FAN_NOFD) so the parser takes ownership of nothing real.
        let mut buf = record(FAN_PRE_ACCESS, -1, Some((4096, 16384)));
        buf.extend(record(libc::FAN_Q_OVERFLOW, -1, None));
        let events = parse_events(&buf);
        assert_eq!(events.len(), 2);
        assert!(events[0].is_pre_access());
        assert_eq!(events[0].range, Some((4096, 16384)));
        assert_eq!(events[0].pid, 1234);
        assert!(!events[1].is_pre_access());
        assert_eq!(events[1].range, None);
        assert!(events.iter().all(|e| e.fd.is_none()));
    }

    #[test]
    fn truncated_buffer_yields_only_whole_events() {
        let mut buf = record(FAN_PRE_ACCESS, -1, Some((0, 1)));
        let whole = buf.len();
        buf.extend(&record(FAN_PRE_ACCESS, -1, Some((8, 1)))[..30]);
        assert_eq!(parse_events(&buf).len(), 1);
        assert_eq!(parse_events(&buf[..whole - 1]).len(), 0);
    }

    #[test]
    fn deny_carries_eio_in_the_top_byte() {
        assert_eq!(Verdict::DenyEio.response_bits(), 0x0500_0002);
        assert_eq!(Verdict::Allow.response_bits(), 1);
    }
}

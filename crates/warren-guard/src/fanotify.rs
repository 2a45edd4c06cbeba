//! fanotify permission events, at the syscall boundary: a group that
//! receives them ([`Group`]), inode marks, the answers, and the pure
//! decoding a watcher needs to judge an open it holds back (which system
//! call made it and whether it opens for writing: [`open_intent`]).
//!
//! The kernel holds the process that triggered a permission event until
//! the group answers it. Invariant: every event read from a [`Group`] is
//! handed out as a [`PermissionEvent`] whose drop answers `allow` unless
//! the caller answered first, so no error path can leave a process hung;
//! closing the group lets every event still queued through.
//! Never: marks anything by a path string a sandbox controls (marks are
//! placed on descriptors the caller opened).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// An open (`open`, `openat`, `execve`, ...) is held for an answer.
pub const OPEN_PERM: u64 = libc::FAN_OPEN_PERM;
/// The open of an `execve` is held for an answer.
pub const OPEN_EXEC_PERM: u64 = libc::FAN_OPEN_EXEC_PERM;
/// A read through an open descriptor is held for an answer.
pub const ACCESS_PERM: u64 = libc::FAN_ACCESS_PERM;
/// A directory's mark also covers the files directly in it.
pub const EVENT_ON_CHILD: u64 = libc::FAN_EVENT_ON_CHILD;

/// Everything a mark of this module may carry, for removing a mark whole.
pub const ALL_PERM_EVENTS: u64 = OPEN_PERM | OPEN_EXEC_PERM | ACCESS_PERM | EVENT_ON_CHILD;

/// A fanotify group of class `content` (permission events), reporting
/// thread ids.
#[derive(Debug)]
pub struct Group {
    fd: OwnedFd,
}

impl Group {
    /// Needs `CAP_SYS_ADMIN` in the initial user namespace.
    pub fn new() -> io::Result<Group> {
        let flags = libc::FAN_CLASS_CONTENT | libc::FAN_CLOEXEC | libc::FAN_NONBLOCK | libc::FAN_REPORT_TID;
        let event_flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_LARGEFILE) as libc::c_uint;
        // SAFETY: plain integer arguments; the result is checked before use.
        let fd = unsafe { libc::fanotify_init(flags, event_flags) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        Ok(Group { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Adds `mask` to the inode mark of the file `target` refers to (an
    /// `O_PATH` descriptor is enough).
    pub fn mark(&self, target: BorrowedFd<'_>, mask: u64) -> io::Result<()> {
        self.mark_op(libc::FAN_MARK_ADD, target, mask)
    }

    /// Takes `mask` off the inode mark of `target`; the mark goes when its
    /// mask is empty.
    pub fn unmark(&self, target: BorrowedFd<'_>, mask: u64) -> io::Result<()> {
        self.mark_op(libc::FAN_MARK_REMOVE, target, mask)
    }

    fn mark_op(&self, op: libc::c_uint, target: BorrowedFd<'_>, mask: u64) -> io::Result<()> {
        // fanotify_mark resolves a NULL path through `fdget`, which refuses
        // O_PATH descriptors; the magic link reaches the same inode without
        // opening it (so it triggers no event of its own).
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", target.as_raw_fd()))
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::fanotify_mark(self.fd.as_raw_fd(), op | libc::FAN_MARK_INODE, mask, libc::AT_FDCWD, path.as_ptr())
        };
        match rc {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// Waits up to `timeout_ms` for events; true when some may be read.
    pub fn wait(&self, timeout_ms: i32) -> io::Result<bool> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        match rc {
            n if n > 0 => Ok(true),
            0 => Ok(false),
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => Ok(false),
                    _ => Err(e),
                }
            }
        }
    }

    /// The events queued now (none when the queue is empty).
    pub fn read(&self) -> io::Result<Vec<PermissionEvent<'_>>> {
        let mut buf = [0u8; 8192];
        // SAFETY: `buf` is valid for writes of its whole length.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(Vec::new()),
                _ => Err(e),
            };
        }
        let mut events = Vec::new();
        for raw in parse_metadata(&buf[..n as usize]) {
            if raw.fd < 0 {
                // FAN_NOFD: an overflow notice, never a permission event.
                continue;
            }
            // SAFETY: the kernel installed this descriptor for us with the
            // event; nothing else owns it.
            let file = unsafe { OwnedFd::from_raw_fd(raw.fd) };
            events.push(PermissionEvent { group: self, file, mask: raw.mask, tid: raw.pid, answered: false });
        }
        Ok(events)
    }

    fn respond(&self, fd: RawFd, allow: bool) -> io::Result<()> {
        let response = libc::fanotify_response { fd, response: if allow { libc::FAN_ALLOW } else { libc::FAN_DENY } };
        let size = std::mem::size_of::<libc::fanotify_response>();
        // SAFETY: `response` is a valid fanotify_response of `size` bytes.
        let n = unsafe { libc::write(self.fd.as_raw_fd(), (&response as *const libc::fanotify_response).cast(), size) };
        match n {
            n if n as usize == size => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }
}

impl AsFd for Group {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One access the kernel holds until it is answered.
#[derive(Debug)]
pub struct PermissionEvent<'g> {
    group: &'g Group,
    /// The file accessed, opened for the group (read-only, no events).
    pub file: OwnedFd,
    /// `FAN_OPEN_PERM`, `FAN_OPEN_EXEC_PERM` or `FAN_ACCESS_PERM`.
    pub mask: u64,
    /// The host thread id of the accessing thread.
    pub tid: i32,
    answered: bool,
}

impl PermissionEvent<'_> {
    /// Lets the access through (`true`) or fails it with `EPERM`.
    pub fn answer(mut self, allow: bool) -> io::Result<()> {
        self.answered = true;
        self.group.respond(self.file.as_raw_fd(), allow)
    }
}

impl Drop for PermissionEvent<'_> {
    fn drop(&mut self) {
        if !self.answered {
            let _ = self.group.respond(self.file.as_raw_fd(), true);
        }
    }
}

struct RawEvent {
    mask: u64,
    fd: RawFd,
    pid: i32,
}

/// The event records in one read's bytes (`fanotify_event_metadata`, each
/// `event_len` long; info records after the metadata are skipped).
fn parse_metadata(mut bytes: &[u8]) -> Vec<RawEvent> {
    const META: usize = std::mem::size_of::<libc::fanotify_event_metadata>();
    let mut out = Vec::new();
    while bytes.len() >= META {
        // SAFETY: at least META bytes remain; read_unaligned copes with
        // the buffer's alignment.
        let meta: libc::fanotify_event_metadata = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        let len = meta.event_len as usize;
        if len < META || len > bytes.len() {
            break;
        }
        out.push(RawEvent { mask: meta.mask, fd: meta.fd, pid: meta.pid });
        bytes = &bytes[len..];
    }
    out
}

/// What an open held back in a permission event is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenIntent {
    Read,
    /// Open for writing, or read-only with `O_TRUNC` (which truncates).
    Write,
    /// The open of `execve`/`execveat`.
    Exec,
    /// A call this decoder does not know (a 32-bit call, a kernel-internal
    /// open): a watcher should treat it as a write.
    Unknown,
}

impl OpenIntent {
    pub fn as_str(self) -> &'static str {
        match self {
            OpenIntent::Read => "read",
            OpenIntent::Write => "write",
            OpenIntent::Exec => "exec",
            OpenIntent::Unknown => "unknown",
        }
    }
}

/// The call a blocked thread is in, from its `/proc/TID/syscall` line
/// (`nr arg0 .. arg5 sp pc`), and what an open in it is for.
/// `read_u64(addr)` reads the thread's memory (`openat2` passes its flags
/// in a struct). Returns the call's name ("" when unknown) and the intent.
pub fn open_intent(syscall_line: &str, read_u64: impl FnOnce(u64) -> Option<u64>) -> (&'static str, OpenIntent) {
    let mut fields = syscall_line.split_whitespace();
    let Some(nr) = fields.next().and_then(|f| f.parse::<i64>().ok()) else { return ("", OpenIntent::Unknown) };
    let args: Vec<u64> =
        fields.take(6).filter_map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok()).collect();
    let arg = |i: usize| args.get(i).copied();
    let by_flags = |flags: Option<u64>| flags.map_or(OpenIntent::Unknown, flags_intent);
    match nr {
        #[cfg(target_arch = "x86_64")]
        n if n == libc::SYS_open => ("open", by_flags(arg(1))),
        #[cfg(target_arch = "x86_64")]
        n if n == libc::SYS_creat => ("creat", OpenIntent::Write),
        n if n == libc::SYS_openat => ("openat", by_flags(arg(2))),
        n if n == libc::SYS_openat2 => ("openat2", by_flags(arg(2).and_then(read_u64))),
        n if n == libc::SYS_execve => ("execve", OpenIntent::Exec),
        n if n == libc::SYS_execveat => ("execveat", OpenIntent::Exec),
        _ => ("", OpenIntent::Unknown),
    }
}

/// Whether open flags ask for writing (an access mode other than
/// read-only, or `O_TRUNC`).
pub fn flags_intent(flags: u64) -> OpenIntent {
    let mode = flags & libc::O_ACCMODE as u64;
    if mode != libc::O_RDONLY as u64 || flags & libc::O_TRUNC as u64 != 0 {
        OpenIntent::Write
    } else {
        OpenIntent::Read
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_flags_decide_read_or_write() {
        assert_eq!(flags_intent(libc::O_RDONLY as u64), OpenIntent::Read);
        assert_eq!(flags_intent((libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW) as u64), OpenIntent::Read);
        assert_eq!(flags_intent(libc::O_WRONLY as u64), OpenIntent::Write);
        assert_eq!(flags_intent(libc::O_RDWR as u64), OpenIntent::Write);
        assert_eq!(flags_intent((libc::O_RDONLY | libc::O_TRUNC) as u64), OpenIntent::Write);
        assert_eq!(flags_intent((libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND) as u64), OpenIntent::Write);
    }

    #[test]
    fn syscall_lines_name_the_call_and_its_intent() {
        let no_memory = |_| None;
        let line = |nr: i64, args: &[u64]| {
            let mut s = nr.to_string();
            for a in args {
                s.push_str(&format!(" 0x{a:x}"));
            }
            s + " 0x7ffd0000 0x7f000000"
        };
        let at_fdcwd = libc::AT_FDCWD as u32 as u64;
        let wr = (libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC) as u64;
        assert_eq!(
            open_intent(&line(libc::SYS_openat, &[at_fdcwd, 0x5000, 0, 0, 0, 0]), no_memory),
            ("openat", OpenIntent::Read)
        );
        assert_eq!(
            open_intent(&line(libc::SYS_openat, &[at_fdcwd, 0x5000, wr, 0o644, 0, 0]), no_memory),
            ("openat", OpenIntent::Write)
        );
        assert_eq!(
            open_intent(&line(libc::SYS_execve, &[0x5000, 0x6000, 0x7000, 0, 0, 0]), no_memory),
            ("execve", OpenIntent::Exec)
        );
        // openat2's flags are the first field of the struct at arg2.
        let how = line(libc::SYS_openat2, &[at_fdcwd, 0x5000, 0x9000, 24, 0, 0]);
        assert_eq!(
            open_intent(&how, |addr| (addr == 0x9000).then_some(libc::O_RDWR as u64)),
            ("openat2", OpenIntent::Write)
        );
        assert_eq!(open_intent(&how, |addr| (addr == 0x9000).then_some(0)), ("openat2", OpenIntent::Read));
        assert_eq!(open_intent(&how, no_memory), ("openat2", OpenIntent::Unknown));
        // Not in a call, or a call that is no open: unknown, so refused by a watcher.
        assert_eq!(open_intent("running", no_memory), ("", OpenIntent::Unknown));
        assert_eq!(open_intent("-1 0x7ffd0000 0x7f000000", no_memory), ("", OpenIntent::Unknown));
        assert_eq!(open_intent(&line(libc::SYS_getpid, &[0, 0, 0, 0, 0, 0]), no_memory), ("", OpenIntent::Unknown));
    }

    #[test]
    fn metadata_records_are_split_by_their_length() {
        let meta = |fd: i32, pid: i32, mask: u64| {
            let m = libc::fanotify_event_metadata {
                event_len: std::mem::size_of::<libc::fanotify_event_metadata>() as u32,
                vers: libc::FANOTIFY_METADATA_VERSION,
                reserved: 0,
                metadata_len: std::mem::size_of::<libc::fanotify_event_metadata>() as u16,
                mask,
                fd,
                pid,
            };
            // SAFETY: a plain C struct viewed as its bytes.
            unsafe {
                std::slice::from_raw_parts(
                    (&m as *const libc::fanotify_event_metadata).cast::<u8>(),
                    std::mem::size_of::<libc::fanotify_event_metadata>(),
                )
            }
            .to_vec()
        };
        let mut bytes = meta(7, 100, libc::FAN_OPEN_PERM);
        bytes.extend(meta(8, 101, libc::FAN_ACCESS_PERM));
        bytes.extend([0u8; 5]);
        let events = parse_metadata(&bytes);
        assert_eq!(
            events.iter().map(|e| (e.fd, e.pid, e.mask)).collect::<Vec<_>>(),
            vec![(7, 100, libc::FAN_OPEN_PERM), (8, 101, libc::FAN_ACCESS_PERM)]
        );
    }
}

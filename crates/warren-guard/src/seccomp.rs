//! The seccomp profile of every sandbox process: which system calls it may
//! make, which calls and `ioctl` commands are refused, why, and what the
//! caller gets back.
//!
//! Shape: an allowlist ([`ALLOWED_SYSCALLS`], in `seccomp/allow.rs`) with
//! deny rules in front of it ([`DENY_RULES`]). The deny rules name the
//! dangerous calls the issue lists, each with a reason, and judge the
//! arguments of the few allowed calls that are only dangerous with some
//! arguments (`clone`/`unshare` namespace flags, `ioctl` commands,
//! `personality`); what passes them must then be on the allowlist. A call
//! on neither list is refused too, so a system call added to the kernel
//! later is refused until someone allows it. [`REFUSED_UNLISTED`] says why
//! each known call that is on neither list stays off the allowlist; a test
//! checks that every call of the kernel's table (`seccomp/syscalls.rs`) is
//! either allowed, denied by a rule or there.
//!
//! What a refused call gets back:
//! - a deny rule's call: `EPERM`, recorded as a security event naming the
//!   call and what made it a refusal (`CLONE_NEWUSER`, `FICLONE (0x...)`);
//! - a known call that is not allowed: `EPERM`, recorded with the detail
//!   `syscall N not allowed`;
//! - a number the kernel's table did not have when this profile was
//!   written (a newer kernel's call, or none): `ENOSYS`, recorded the same
//!   way. `ENOSYS` is what libc and runtimes expect from a kernel that
//!   lacks a call, and they fall back to an older one; `EPERM` would look
//!   like a real failure (Docker's profiles broke glibc's `faccessat2` and
//!   `clone3` fallbacks that way);
//! - the [`Answer::Absent`] rules (`clone3`, `statmount`, `listmount`):
//!   `ENOSYS` straight from the filter, unrecorded, because libc or
//!   libmount try them in ordinary work and fall back to a call the
//!   profile can judge (`clone`, `/proc/self/mountinfo`).
//!
//! With [`Delivery::Notify`] a recorded refusal reaches a supervisor (PID 1
//! of the sandbox) that records it as a security event before answering.
//! `clone3` is refused because it keeps its flags in memory a filter cannot
//! see; libc's fallback `clone` has them in a register.
//!
//! The filter is built for x86_64 by [`compile`]: an ABI fence first, then
//! a binary search over the system-call number whose leaves return the
//! call's answer or, for the few rules that judge arguments, jump to that
//! rule's checks (a set of ioctl commands or personas is a binary search
//! too). About ten comparisons decide a call; and the kernel's seccomp
//! cache, which proves at install time which calls the filter allows
//! whatever their arguments, lets those skip it altogether. (It was a row
//! of rules built by `seccompiler` before: the same answers, which a test
//! checks number by number against that compiler, kept in
//! `seccomp/linear.rs`.) The fence kills a process that makes a system call of
//! another ABI (`int 0x80`, a 32-bit binary): its numbers differ, so this
//! profile could not judge it. It refuses the x32 ABI (numbers with bit 30
//! set), which would reach the same kernel functions under other numbers
//! on kernels that enable it.
//!
//! Comparisons of 32-bit arguments (ioctl commands, clone flags, personas)
//! look at the low half only, as the kernel does: setting high bits cannot
//! slip a command past the filter.
//!
//! [`ALLOWLIST_ENFORCED`] switches the allowlist off (back to a deny list
//! over a default of ALLOW), for bisecting a workload the allowlist breaks.

mod allow;
#[cfg(test)]
mod linear;
mod syscalls;

pub use allow::{ALLOWED_SYSCALLS, REFUSED_UNLISTED};

use std::collections::BTreeMap;

pub use libc::sock_filter;

/// A classic-BPF program, as `seccomp(SECCOMP_SET_MODE_FILTER)` takes it.
pub type BpfProgram = Vec<sock_filter>;

/// Errors building the filter. They are all bugs in the profile's data, so
/// none can happen for [`DENY_RULES`] (a test compiles it).
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("system call {0:?} has no x86_64 number in this profile's table")]
    UnknownSyscall(&'static str),
    #[error("system call {0:?} has more than one deny rule")]
    DuplicateRule(&'static str),
    #[error("the filter has {0} instructions; the kernel takes at most {BPF_MAXINSNS}")]
    TooLong(usize),
}

// ---------------------------------------------------------------------------
// ioctl command numbers
// ---------------------------------------------------------------------------

// The generic encoding of <asm-generic/ioctl.h>, which x86 uses:
// direction (2 bits) | argument size (14 bits) | type (8 bits) | number (8 bits).
const IOC_NRSHIFT: u32 = 0;
const IOC_TYPESHIFT: u32 = 8;
const IOC_SIZESHIFT: u32 = 16;
const IOC_DIRSHIFT: u32 = 30;
const IOC_SIZEBITS: u32 = 14;
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// `_IOC(dir, type, nr, size)`.
pub const fn ioc(dir: u32, kind: u8, nr: u8, size: usize) -> u32 {
    assert!(size < (1 << IOC_SIZEBITS), "an ioctl argument size has 14 bits");
    (dir << IOC_DIRSHIFT)
        | ((size as u32) << IOC_SIZESHIFT)
        | ((kind as u32) << IOC_TYPESHIFT)
        | ((nr as u32) << IOC_NRSHIFT)
}

/// `_IOR(type, nr, size)`: the kernel writes the argument.
pub const fn ior(kind: u8, nr: u8, size: usize) -> u32 {
    ioc(IOC_READ, kind, nr, size)
}

/// `_IOW(type, nr, size)`: the kernel reads the argument.
pub const fn iow(kind: u8, nr: u8, size: usize) -> u32 {
    ioc(IOC_WRITE, kind, nr, size)
}

/// `_IOWR(type, nr, size)`.
pub const fn iowr(kind: u8, nr: u8, size: usize) -> u32 {
    ioc(IOC_READ | IOC_WRITE, kind, nr, size)
}

/// Sizes (x86_64 layout) of the argument structs that are part of the
/// denied commands' numbers. The tests check the resulting numbers against
/// the C headers' values.
mod arg_bytes {
    pub const INT: usize = 4;
    pub const LONG: usize = 8;
    /// `struct xfs_swapext`: five `__s64`, 16 bytes of padding, then a
    /// `struct xfs_bstat` (136 bytes).
    pub const XFS_SWAPEXT: usize = 5 * 8 + 16 + 136;
    /// `struct xfs_fsop_handlereq`: three (`__u32`, pointer) pairs, each
    /// padded to 16 bytes, then the `ohandlen` pointer.
    pub const XFS_HANDLEREQ: usize = 3 * 16 + 8;
    /// `struct xfs_fsop_setdm_handlereq`: the handle request and a pointer.
    pub const XFS_SETDM_HANDLEREQ: usize = XFS_HANDLEREQ + 8;
    /// `struct xfs_fsop_attrlist_handlereq`: the handle request, a 16-byte
    /// cursor, two `__u32` and a buffer pointer.
    pub const XFS_ATTRLIST_HANDLEREQ: usize = XFS_HANDLEREQ + 16 + 2 * 4 + 8;
    /// `struct xfs_fsop_attrmulti_handlereq`: the handle request, a `__u32`
    /// count padded to 8, and a pointer.
    pub const XFS_ATTRMULTI_HANDLEREQ: usize = XFS_HANDLEREQ + 8 + 8;
    /// `struct xfs_getparents_by_handle`: a 24-byte `struct xfs_handle` and a
    /// 40-byte `struct xfs_getparents`.
    pub const XFS_GETPARENTS_BY_HANDLE: usize = 24 + 40;
    /// `struct xfs_exchange_range`: `__s32` fd, `__u32` pad, four `__u64`.
    pub const XFS_EXCHANGE_RANGE: usize = 8 + 4 * 8;
    /// `struct xfs_commit_range`: the exchange fields and six `__u64` of
    /// freshness data.
    pub const XFS_COMMIT_RANGE: usize = XFS_EXCHANGE_RANGE + 6 * 8;
    /// `struct xfs_flock64`: two `__s16` (padded to 8), two `__s64`, two
    /// 32-bit ids and four `__s32` of padding.
    pub const XFS_FLOCK64: usize = 8 + 2 * 8 + 2 * 4 + 4 * 4;
    /// `struct file_clone_range`: an `__s64` fd and three `__u64`.
    pub const FILE_CLONE_RANGE: usize = 4 * 8;
    /// `struct file_dedupe_range` without its flexible array: two `__u64`,
    /// two `__u16`, one `__u32`.
    pub const FILE_DEDUPE_RANGE: usize = 2 * 8 + 2 * 2 + 4;
    /// `struct fsxattr`: five `__u32` and 8 bytes of padding.
    pub const FSXATTR: usize = 5 * 4 + 8;
    /// `struct move_extent` (ext4): two `__u32`, four `__u64`.
    pub const EXT4_MOVE_EXTENT: usize = 2 * 4 + 4 * 8;
    /// `char[FSLABEL_MAX]`.
    pub const FSLABEL: usize = 256;
}

/// One `ioctl` command the sandbox may not issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeniedIoctl {
    pub name: &'static str,
    pub command: u32,
    pub reason: &'static str,
}

const fn ioctl(name: &'static str, command: u32, reason: &'static str) -> DeniedIoctl {
    DeniedIoctl { name, command, reason }
}

const XFS_HANDLE_REASON: &str = "XFS file handles open files by inode, around every path-based check \
     (the 'shocker' escape class); needs CAP_SYS_ADMIN today, refused regardless";
const XFS_PREALLOC_REASON: &str = "removed in Linux 5.17 after CVE-2021-4155 (they exposed stale disk blocks); \
     refused in case the sandbox runs on an older kernel";
const FICLONE_REASON: &str = "shares extents between two files: copy-on-write and dedupe code paths reached \
     with attacker-chosen files; cp --reflink=auto falls back to copying";
const SETFLAGS_REASON: &str = "sets inode flags (immutable, append-only, no-COW, ...) on files of shared layers";
const SETVERSION_REASON: &str = "rewrites an inode's generation, which file handles and caches trust";

/// The `ioctl` commands refused on any descriptor: filesystem-changing ones
/// (several reach the host's filesystem through the writable layer) and the
/// two terminal-injection ones.
pub const DENIED_IOCTLS: &[DeniedIoctl] = &[
    ioctl(
        "XFS_IOC_SWAPEXT",
        iowr(b'X', 109, arg_bytes::XFS_SWAPEXT),
        "swaps two files' extents: used in a past incident to read a protected file through another \
         descriptor, which corrupted XFS metadata and shut the filesystem down",
    ),
    ioctl(
        "XFS_IOC_EXCHANGE_RANGE",
        iow(b'X', 129, arg_bytes::XFS_EXCHANGE_RANGE),
        "the newer form of XFS_IOC_SWAPEXT: exchanges ranges of two files",
    ),
    ioctl(
        "XFS_IOC_COMMIT_RANGE",
        iow(b'X', 131, arg_bytes::XFS_COMMIT_RANGE),
        "XFS_IOC_EXCHANGE_RANGE with a freshness check",
    ),
    ioctl("XFS_IOC_PATH_TO_FSHANDLE", iowr(b'X', 104, arg_bytes::XFS_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_PATH_TO_HANDLE", iowr(b'X', 105, arg_bytes::XFS_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_FD_TO_HANDLE", iowr(b'X', 106, arg_bytes::XFS_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_OPEN_BY_HANDLE", iowr(b'X', 107, arg_bytes::XFS_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_READLINK_BY_HANDLE", iowr(b'X', 108, arg_bytes::XFS_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_FSSETDM_BY_HANDLE", iow(b'X', 121, arg_bytes::XFS_SETDM_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_ATTRLIST_BY_HANDLE", iow(b'X', 122, arg_bytes::XFS_ATTRLIST_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_ATTRMULTI_BY_HANDLE", iow(b'X', 123, arg_bytes::XFS_ATTRMULTI_HANDLEREQ), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_GETPARENTS_BY_HANDLE", iowr(b'X', 63, arg_bytes::XFS_GETPARENTS_BY_HANDLE), XFS_HANDLE_REASON),
    ioctl("XFS_IOC_ALLOCSP", iow(b'X', 10, arg_bytes::XFS_FLOCK64), XFS_PREALLOC_REASON),
    ioctl("XFS_IOC_FREESP", iow(b'X', 11, arg_bytes::XFS_FLOCK64), XFS_PREALLOC_REASON),
    ioctl("XFS_IOC_ALLOCSP64", iow(b'X', 36, arg_bytes::XFS_FLOCK64), XFS_PREALLOC_REASON),
    ioctl("XFS_IOC_FREESP64", iow(b'X', 37, arg_bytes::XFS_FLOCK64), XFS_PREALLOC_REASON),
    ioctl(
        "EXT4_IOC_MOVE_EXT",
        iowr(b'f', 15, arg_bytes::EXT4_MOVE_EXTENT),
        "ext4's XFS_IOC_SWAPEXT: moves extents between two files (this host's root filesystem is ext4)",
    ),
    ioctl(
        "FS_IOC_SHUTDOWN",
        ior(b'X', 125, arg_bytes::INT),
        "shuts the whole filesystem down (XFS_IOC_GOINGDOWN, EXT4_IOC_SHUTDOWN)",
    ),
    ioctl("FIFREEZE", iowr(b'X', 119, arg_bytes::INT), "freezes every write to the whole filesystem"),
    ioctl("FITHAW", iowr(b'X', 120, arg_bytes::INT), "the other half of FIFREEZE"),
    ioctl("FS_IOC_SETFSLABEL", iow(0x94, 50, arg_bytes::FSLABEL), "renames the whole filesystem"),
    ioctl("FICLONE", iow(0x94, 9, arg_bytes::INT), FICLONE_REASON),
    ioctl("FICLONERANGE", iow(0x94, 13, arg_bytes::FILE_CLONE_RANGE), FICLONE_REASON),
    ioctl("FIDEDUPERANGE", iowr(0x94, 54, arg_bytes::FILE_DEDUPE_RANGE), FICLONE_REASON),
    ioctl("FS_IOC_SETFLAGS", iow(b'f', 2, arg_bytes::LONG), SETFLAGS_REASON),
    ioctl("FS_IOC32_SETFLAGS", iow(b'f', 2, arg_bytes::INT), SETFLAGS_REASON),
    ioctl(
        "FS_IOC_FSSETXATTR",
        iow(b'X', 32, arg_bytes::FSXATTR),
        "sets extended inode flags and the project id that project quotas account by",
    ),
    ioctl("FS_IOC_SETVERSION", iow(b'v', 2, arg_bytes::LONG), SETVERSION_REASON),
    ioctl("FS_IOC32_SETVERSION", iow(b'v', 2, arg_bytes::INT), SETVERSION_REASON),
    // The terminal ioctls predate the _IOC encoding: their numbers are the
    // plain constants of <asm-generic/ioctls.h>.
    ioctl(
        "TIOCSTI",
        0x5412,
        "pushes bytes into a terminal's input queue: commands typed into whatever reads that terminal",
    ),
    ioctl("TIOCLINUX", 0x541C, "virtual-console subcommands, among them selection paste (another injection path)"),
];

// ---------------------------------------------------------------------------
// The deny rules
// ---------------------------------------------------------------------------

/// A named bit or value of a system-call argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Named {
    pub name: &'static str,
    pub value: u32,
}

const fn named(name: &'static str, value: i32) -> Named {
    Named { name, value: value as u32 }
}

/// Every namespace `clone` can create (`CLONE_NEWTIME` shares its bit with
/// the exit signal there, so `clone` cannot ask for it).
pub const CLONE_NAMESPACE_FLAGS: &[Named] = &[
    named("CLONE_NEWNS", libc::CLONE_NEWNS),
    named("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
    named("CLONE_NEWUTS", libc::CLONE_NEWUTS),
    named("CLONE_NEWIPC", libc::CLONE_NEWIPC),
    named("CLONE_NEWUSER", libc::CLONE_NEWUSER),
    named("CLONE_NEWPID", libc::CLONE_NEWPID),
    named("CLONE_NEWNET", libc::CLONE_NEWNET),
];

/// Every namespace `unshare` can create.
pub const UNSHARE_NAMESPACE_FLAGS: &[Named] = &[
    named("CLONE_NEWNS", libc::CLONE_NEWNS),
    named("CLONE_NEWCGROUP", libc::CLONE_NEWCGROUP),
    named("CLONE_NEWUTS", libc::CLONE_NEWUTS),
    named("CLONE_NEWIPC", libc::CLONE_NEWIPC),
    named("CLONE_NEWUSER", libc::CLONE_NEWUSER),
    named("CLONE_NEWPID", libc::CLONE_NEWPID),
    named("CLONE_NEWNET", libc::CLONE_NEWNET),
    named("CLONE_NEWTIME", libc::CLONE_NEWTIME),
];

/// The personas a process may switch to (Docker's list): Linux, its 32-bit
/// `uname`, the 2.6-version `uname`, both, and the query value. Refused
/// are the flags that weaken the process (`ADDR_NO_RANDOMIZE`,
/// `READ_IMPLIES_EXEC`, `MMAP_PAGE_ZERO`, ...) and foreign personas.
pub const ALLOWED_PERSONAS: &[u32] = &[0x0000_0000, 0x0000_0008, 0x0002_0000, 0x0002_0008, 0xffff_ffff];

/// When a rule refuses its system call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// Any of `flags` is set in the low 32 bits of argument `arg`.
    AnyFlag {
        arg: u8,
        flags: &'static [Named],
    },
    /// The low 32 bits of argument `arg` are none of `allowed`.
    NotOneOf {
        arg: u8,
        allowed: &'static [u32],
    },
    /// The command (argument 1, an `unsigned int` for the kernel) is one of
    /// these.
    IoctlCommand(&'static [DeniedIoctl]),
}

/// What a refused call gets back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Answer {
    /// `EPERM`, recorded as a security event when delivered to a supervisor.
    Refuse,
    /// `ENOSYS` straight from the filter, never recorded: the call looks
    /// absent, so libc falls back to an older call the filter can judge.
    Absent,
}

impl Answer {
    pub const fn errno(self) -> i32 {
        match self {
            Answer::Refuse => libc::EPERM,
            Answer::Absent => libc::ENOSYS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DenyRule {
    pub syscall: &'static str,
    pub when: When,
    pub answer: Answer,
    pub reason: &'static str,
}

const fn always(syscall: &'static str, reason: &'static str) -> DenyRule {
    DenyRule { syscall, when: When::Always, answer: Answer::Refuse, reason }
}

const MOUNT_REASON: &str = "changes the mount tree: could uncover masked paths or mount over the platform's";
const NEW_MOUNT_API_REASON: &str = "the new mount API: the same power as mount(2)";
const MODULE_REASON: &str = "loads or removes kernel code";
const TIME_REASON: &str = "sets the host's clock, which no namespace isolates";
const KEYS_REASON: &str = "kernel keyrings: not namespaced, and a long record of kernel bugs";
const IO_URING_REASON: &str = "io_uring: a large, bug-prone kernel surface that seccomp cannot see into";
const CROSS_PROCESS_REASON: &str = "reads or changes another process's memory, registers or descriptors";

/// The profile: one rule per system call.
pub const DENY_RULES: &[DenyRule] = &[
    always("mount", MOUNT_REASON),
    always("umount2", MOUNT_REASON),
    always("fsopen", NEW_MOUNT_API_REASON),
    always("fsconfig", NEW_MOUNT_API_REASON),
    always("fsmount", NEW_MOUNT_API_REASON),
    always("fspick", NEW_MOUNT_API_REASON),
    always("move_mount", NEW_MOUNT_API_REASON),
    always("open_tree", NEW_MOUNT_API_REASON),
    always("open_tree_attr", NEW_MOUNT_API_REASON),
    always("mount_setattr", NEW_MOUNT_API_REASON),
    always("pivot_root", MOUNT_REASON),
    always("chroot", "changes the root directory: the classic start of a chroot escape"),
    DenyRule {
        syscall: "unshare",
        when: When::AnyFlag { arg: 0, flags: UNSHARE_NAMESPACE_FLAGS },
        answer: Answer::Refuse,
        reason: "new namespaces (a user namespace first of all) reach kernel code written for root",
    },
    DenyRule {
        syscall: "clone",
        when: When::AnyFlag { arg: 0, flags: CLONE_NAMESPACE_FLAGS },
        answer: Answer::Refuse,
        reason: "new namespaces, as with unshare; clone without them (fork, threads) is allowed",
    },
    DenyRule {
        syscall: "clone3",
        when: When::Always,
        answer: Answer::Absent,
        reason: "its flags live in memory the filter cannot read; answering ENOSYS makes libc use clone, \
                 which the filter can judge. Not recorded: glibc tries it for every thread it creates",
    },
    DenyRule {
        syscall: "statmount",
        when: When::Always,
        answer: Answer::Absent,
        reason: "mount details by mount id (Linux 6.8): new kernel code for what /proc/self/mountinfo already \
                 says. Answered ENOSYS and unrecorded because libmount tries it in ordinary work and falls back",
    },
    DenyRule {
        syscall: "listmount",
        when: When::Always,
        answer: Answer::Absent,
        reason: "lists mount ids (Linux 6.8); the other half of statmount",
    },
    always("setns", "enters another namespace"),
    always("ptrace", CROSS_PROCESS_REASON),
    always("process_vm_readv", CROSS_PROCESS_REASON),
    always("process_vm_writev", CROSS_PROCESS_REASON),
    always("pidfd_getfd", CROSS_PROCESS_REASON),
    always("kcmp", "compares kernel objects of two processes: a kernel-layout oracle needed only by CRIU"),
    always("kexec_load", "replaces the running kernel"),
    always("kexec_file_load", "replaces the running kernel"),
    always("init_module", MODULE_REASON),
    always("finit_module", MODULE_REASON),
    always("delete_module", MODULE_REASON),
    always("bpf", "loads programs into the kernel"),
    always("perf_event_open", "kernel profiling: leaks kernel addresses and has had many bugs"),
    always("userfaultfd", "lets a process stall the kernel mid-copy: the usual tool to win kernel races"),
    always("io_uring_setup", IO_URING_REASON),
    always("io_uring_enter", IO_URING_REASON),
    always("io_uring_register", IO_URING_REASON),
    always("keyctl", KEYS_REASON),
    always("add_key", KEYS_REASON),
    always("request_key", KEYS_REASON),
    always("name_to_handle_at", "file handles open files by inode, around path checks ('shocker')"),
    always("open_by_handle_at", "file handles open files by inode, around path checks ('shocker')"),
    always("clock_settime", TIME_REASON),
    always("clock_adjtime", TIME_REASON),
    always("settimeofday", TIME_REASON),
    always("adjtimex", TIME_REASON),
    always("swapon", "host swap configuration"),
    always("swapoff", "host swap configuration"),
    always("reboot", "reboots the host, or ends the sandbox's pid namespace"),
    always("acct", "host process accounting"),
    always("quotactl", "host disk quotas"),
    always("quotactl_fd", "host disk quotas"),
    always("lookup_dcookie", "a profiling interface that leaks host paths (removed in Linux 6.9)"),
    always("iopl", "raw I/O port access"),
    always("ioperm", "raw I/O port access"),
    always("syslog", "the kernel log: host addresses and other tenants' activity"),
    always("file_setattr", "the system-call form of FS_IOC_FSSETXATTR (Linux 6.17), refused for the same reasons"),
    DenyRule {
        syscall: "personality",
        when: When::NotOneOf { arg: 0, allowed: ALLOWED_PERSONAS },
        answer: Answer::Refuse,
        reason: "persona flags switch off ASLR or make data executable",
    },
    DenyRule {
        syscall: "ioctl",
        when: When::IoctlCommand(DENIED_IOCTLS),
        answer: Answer::Refuse,
        reason: "filesystem-changing and terminal-injection commands (see DENIED_IOCTLS)",
    },
];

// ---------------------------------------------------------------------------
// x86_64 system-call numbers
// ---------------------------------------------------------------------------

use syscalls::X86_64_SYSCALLS;

/// The x86_64 number of `name`.
pub fn syscall_number(name: &str) -> Option<i64> {
    X86_64_SYSCALLS.iter().find(|(n, _)| *n == name).map(|(_, nr)| *nr)
}

/// The name of x86_64 system call `number`.
pub fn syscall_name(number: i64) -> Option<&'static str> {
    X86_64_SYSCALLS.iter().find(|(_, nr)| *nr == number).map(|(n, _)| *n)
}

// ---------------------------------------------------------------------------
// Compiling
// ---------------------------------------------------------------------------

/// `AUDIT_ARCH_X86_64`: `EM_X86_64` | 64-bit | little-endian.
pub const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// System-call numbers with this bit set are the x32 ABI's.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// The kernel's limit on a filter's length.
pub const BPF_MAXINSNS: usize = 4096;

const BPF_LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
const BPF_JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
const BPF_JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
/// Only the old row of rules and the tests compare with `jgt`.
#[cfg(test)]
const BPF_JGT_K: u16 = (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16;
const BPF_JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
const BPF_JSET_K: u16 = (libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K) as u16;
const BPF_ALU_AND_K: u16 = (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16;
/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
/// The low half of the first argument (x86_64 is little-endian).
const DATA_ARGS: u32 = 16;

/// Where refusals go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// To a supervisor (`SECCOMP_RET_USER_NOTIF`), which records each one
    /// and answers [`Answer::errno`]. The filter must then be installed
    /// with `SECCOMP_FILTER_FLAG_NEW_LISTENER`, or refused calls fail with
    /// `ENOSYS`.
    Notify,
    /// Answered by the filter (`SECCOMP_RET_ERRNO`), unrecorded.
    Errno,
}

/// Whether the sandbox profile refuses calls that are not on
/// [`ALLOWED_SYSCALLS`]. `false` gives the older deny list (every call no
/// rule names is allowed); kept as a switch for bisecting a workload the
/// allowlist breaks, not as a mode to run in.
pub const ALLOWLIST_ENFORCED: bool = true;

/// A complete profile: deny rules, judged first, and what happens to a
/// call that passes them.
#[derive(Debug, Clone, Copy)]
pub struct Profile<'a> {
    pub rules: &'a [DenyRule],
    /// `Some`: only these calls are allowed; `None`: every call is.
    pub allowed: Option<&'a [&'static str]>,
}

/// The profile of every sandbox process.
pub const SANDBOX_PROFILE: Profile<'static> =
    Profile { rules: DENY_RULES, allowed: if ALLOWLIST_ENFORCED { Some(ALLOWED_SYSCALLS) } else { None } };

impl<'a> Profile<'a> {
    /// Deny rules over a default of ALLOW.
    pub const fn deny_list(rules: &'a [DenyRule]) -> Profile<'a> {
        Profile { rules, allowed: None }
    }

    /// Whether a call that passed the deny rules is allowed.
    pub fn allows(&self, number: i64) -> bool {
        match self.allowed {
            None => true,
            Some(allowed) => syscall_name(number).is_some_and(|name| allowed.contains(&name)),
        }
    }
}

/// Compiles `profile` into one x86_64 filter: the ABI fence, then a binary
/// search over the system-call number (runs of numbers that get the same
/// answer are one leaf), whose leaves either return at once or jump to the
/// argument checks of a rule that judges its call's arguments.
///
/// Why a tree and not the rules one after another: every call the kernel
/// cannot cache runs the filter, and at install time the kernel runs it
/// once per system-call number to build that cache. In a row of rules
/// every number walks past each rule's comparison (689 instructions,
/// about 82,000 emulated at install); in the tree it takes about ten.
pub fn compile(profile: &Profile<'_>, delivery: Delivery) -> Result<BpfProgram, SeccompError> {
    let rules = profile.rules;
    check_one_rule_per_syscall(rules)?;
    let refusal = match delivery {
        Delivery::Notify => libc::SECCOMP_RET_USER_NOTIF,
        Delivery::Errno => errno_action(libc::EPERM),
    };
    let answer_action = |answer: Answer| match answer {
        Answer::Refuse => refusal,
        Answer::Absent => errno_action(libc::ENOSYS),
    };
    // What a call no rule refused gets: known calls by the allowlist,
    // numbers outside the kernel's table `unknown`.
    let (mut verdicts, unknown) = match profile.allowed {
        None => (BTreeMap::new(), libc::SECCOMP_RET_ALLOW),
        Some(allowed) => {
            let unknown = match delivery {
                Delivery::Notify => libc::SECCOMP_RET_USER_NOTIF,
                Delivery::Errno => errno_action(libc::ENOSYS),
            };
            let mut verdicts: BTreeMap<u32, Leaf> =
                X86_64_SYSCALLS.iter().map(|(_, nr)| (*nr as u32, Leaf::Return(refusal))).collect();
            for name in allowed {
                let nr = syscall_number(name).ok_or(SeccompError::UnknownSyscall(name))?;
                verdicts.insert(nr as u32, Leaf::Return(libc::SECCOMP_RET_ALLOW));
            }
            (verdicts, unknown)
        }
    };
    let mut judged = Vec::new();
    for rule in rules {
        let nr = syscall_number(rule.syscall).ok_or(SeccompError::UnknownSyscall(rule.syscall))? as u32;
        let refuse = answer_action(rule.answer);
        let leaf = match rule.when {
            When::Always => Leaf::Return(refuse),
            when => {
                let pass = match verdicts.get(&nr) {
                    Some(Leaf::Return(action)) => *action,
                    _ => unknown,
                };
                judged.push(argument_checks(&when, refuse, pass));
                Leaf::Jump(judged.len() - 1)
            }
        };
        verdicts.insert(nr, leaf);
    }
    let mut spans: Vec<(u32, Leaf)> = Vec::new();
    let mut next = 0u32;
    for (nr, leaf) in verdicts {
        if nr > next {
            push_span(&mut spans, next, Leaf::Return(unknown));
        }
        push_span(&mut spans, nr, leaf);
        next = nr + 1;
    }
    push_span(&mut spans, next, Leaf::Return(unknown));

    let mut program = abi_fence(refusal);
    // The fence leaves the number in the accumulator.
    let tree = search_tree(&spans);
    // Each rule's checks follow the tree, in the order of `judged`.
    let mut starts = Vec::with_capacity(judged.len());
    let mut at = program.len() + tree.len();
    for checks in &judged {
        starts.push(at);
        at += checks.len();
    }
    for insn in tree {
        program.push(match insn {
            Insn::Plain(insn) => insn,
            Insn::JumpTo(rule) => {
                let after = program.len() + 1;
                stmt(BPF_JA, (starts[rule] - after) as u32)
            }
        });
    }
    for checks in judged {
        program.extend(checks);
    }
    if program.len() > BPF_MAXINSNS {
        return Err(SeccompError::TooLong(program.len()));
    }
    Ok(program)
}

/// What the tree does with a run of numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaf {
    Return(u32),
    /// Jump to the argument checks of `judged[i]`.
    Jump(usize),
}

/// A tree instruction before the checks' places are known.
enum Insn {
    Plain(sock_filter),
    JumpTo(usize),
}

/// Appends the run starting at `lo`, merged into the previous one when it
/// returns the same.
fn push_span(spans: &mut Vec<(u32, Leaf)>, lo: u32, leaf: Leaf) {
    // A run that would be empty gives way to the new one.
    if spans.last().is_some_and(|(last_lo, _)| *last_lo == lo) {
        spans.pop();
    }
    match spans.last() {
        Some((_, last)) if *last == leaf && matches!(leaf, Leaf::Return(_)) => {}
        _ => spans.push((lo, leaf)),
    }
}

/// A binary search over the accumulator for `spans` (sorted by their first
/// value, the first one starting at 0, each running up to the next one's
/// start): `jge` at each node, the lower half inline after it.
fn search_tree(spans: &[(u32, Leaf)]) -> Vec<Insn> {
    if let [(_, leaf)] = spans {
        return vec![match *leaf {
            Leaf::Return(action) => Insn::Plain(stmt(BPF_RET_K, action)),
            Leaf::Jump(rule) => Insn::JumpTo(rule),
        }];
    }
    let mid = spans.len() / 2;
    let (lower, upper) = (search_tree(&spans[..mid]), search_tree(&spans[mid..]));
    let split = spans[mid].0;
    let mut out = Vec::with_capacity(lower.len() + upper.len() + 2);
    match u8::try_from(lower.len()) {
        Ok(skip) => out.push(Insn::Plain(jump(BPF_JGE_K, split, skip, 0))),
        // Too far for a conditional jump's 8 bits: through a `ja`.
        Err(_) => {
            out.push(Insn::Plain(jump(BPF_JGE_K, split, 0, 1)));
            out.push(Insn::Plain(stmt(BPF_JA, lower.len() as u32)));
        }
    }
    out.extend(lower);
    out.extend(upper);
    out
}

/// The checks of a rule that judges arguments: `refuse` when it objects,
/// `pass` otherwise. Each loads the low half of its argument, as the
/// kernel reads a 32-bit argument.
fn argument_checks(when: &When, refuse: u32, pass: u32) -> BpfProgram {
    let load = |arg: u8| stmt(BPF_LD_W_ABS, DATA_ARGS + 8 * u32::from(arg));
    let member_of = |values: &mut Vec<u32>, inside: u32, outside: u32| {
        values.sort_unstable();
        values.dedup();
        let mut spans = Vec::new();
        for v in values.iter().copied() {
            push_span(&mut spans, v, Leaf::Return(inside));
            if v < u32::MAX {
                push_span(&mut spans, v + 1, Leaf::Return(outside));
            }
        }
        if spans.first().is_none_or(|(lo, _)| *lo != 0) {
            spans.insert(0, (0, Leaf::Return(outside)));
        }
        search_tree(&spans).into_iter().map(|insn| match insn {
            Insn::Plain(insn) => insn,
            Insn::JumpTo(_) => unreachable!("only returns in a set's tree"),
        })
    };
    let mut out = Vec::new();
    match *when {
        When::Always => out.push(stmt(BPF_RET_K, refuse)),
        When::AnyFlag { arg, flags } => {
            // Each flag is refused when all of its bits are set, so a
            // flag of one bit is a `jset`; all of those share one.
            let bits: u32 = flags.iter().filter(|f| f.value.is_power_of_two()).fold(0, |m, f| m | f.value);
            out.push(load(arg));
            if bits != 0 {
                out.push(jump(BPF_JSET_K, bits, 0, 1));
                out.push(stmt(BPF_RET_K, refuse));
            }
            for flag in flags.iter().filter(|f| !f.value.is_power_of_two()) {
                out.push(stmt(BPF_ALU_AND_K, flag.value));
                out.push(jump(BPF_JEQ_K, flag.value, 0, 1));
                out.push(stmt(BPF_RET_K, refuse));
                out.push(load(arg));
            }
            out.push(stmt(BPF_RET_K, pass));
        }
        When::NotOneOf { arg, allowed } => {
            out.push(load(arg));
            out.extend(member_of(&mut allowed.to_vec(), pass, refuse));
        }
        When::IoctlCommand(commands) => {
            out.push(load(1));
            out.extend(member_of(&mut commands.iter().map(|c| c.command).collect(), refuse, pass));
        }
    }
    out
}

/// `SECCOMP_RET_ERRNO` with `errno`.
const fn errno_action(errno: i32) -> u32 {
    libc::SECCOMP_RET_ERRNO | (errno as u32 & libc::SECCOMP_RET_DATA)
}

fn check_one_rule_per_syscall(rules: &[DenyRule]) -> Result<(), SeccompError> {
    for (i, rule) in rules.iter().enumerate() {
        if rules[..i].iter().any(|earlier| earlier.syscall == rule.syscall) {
            return Err(SeccompError::DuplicateRule(rule.syscall));
        }
    }
    Ok(())
}

/// Kills a process that calls through another ABI, refuses the x32 ABI
/// (bit 30 set, bit 31 clear: `syscall(-1)` stays an ordinary ENOSYS),
/// and falls through to the rules otherwise.
fn abi_fence(refusal: u32) -> BpfProgram {
    vec![
        stmt(BPF_LD_W_ABS, DATA_ARCH),
        jump(BPF_JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(BPF_RET_K, libc::SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, DATA_NR),
        jump(BPF_JGE_K, X32_SYSCALL_BIT, 0, 2),
        jump(BPF_JGE_K, 0x8000_0000, 1, 0),
        stmt(BPF_RET_K, refusal),
    ]
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

// ---------------------------------------------------------------------------
// Naming a refusal
// ---------------------------------------------------------------------------

/// What a supervisor records about one refused call, and answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denial {
    pub syscall: String,
    /// The arguments that made it a refusal, e.g. `FICLONE (0x40049409)`
    /// or `CLONE_NEWUSER`; empty for calls refused whatever they ask.
    pub detail: String,
    pub errno: i32,
}

/// Names a call the filter refused: `nr`, `arch` and `args` as in the
/// kernel's `struct seccomp_data`.
pub fn describe(profile: &Profile<'_>, nr: i32, arch: u32, args: &[u64; 6]) -> Denial {
    let rules = profile.rules;
    let number = i64::from(nr);
    if arch != AUDIT_ARCH_X86_64 {
        return Denial {
            syscall: format!("#{nr}"),
            detail: format!("foreign ABI (audit arch {arch:#x})"),
            errno: libc::EPERM,
        };
    }
    // Bit 30 without bit 31, as the fence decides: `syscall(-1)` is no x32 call.
    if nr as u32 & 0xc000_0000 == X32_SYSCALL_BIT {
        let base = i64::from(nr as u32 & !X32_SYSCALL_BIT);
        let syscall = syscall_name(base).map_or_else(|| format!("#{base}"), str::to_string);
        return Denial { syscall, detail: "x32 ABI".into(), errno: libc::EPERM };
    }
    let rule = rules.iter().find(|r| syscall_number(r.syscall) == Some(number));
    match rule {
        Some(rule) => {
            Denial { syscall: rule.syscall.to_string(), detail: detail(&rule.when, args), errno: rule.answer.errno() }
        }
        None if !profile.allows(number) => Denial {
            syscall: syscall_name(number).map_or_else(|| format!("#{nr}"), str::to_string),
            detail: format!("syscall {nr} not allowed"),
            errno: if syscall_name(number).is_some() { libc::EPERM } else { libc::ENOSYS },
        },
        // The filter and the profile disagree: still a refusal.
        None => Denial { syscall: format!("#{nr}"), detail: "not in the profile".into(), errno: libc::EPERM },
    }
}

fn detail(when: &When, args: &[u64; 6]) -> String {
    let low = |arg: u8| args[usize::from(arg)] as u32;
    match *when {
        When::Always => String::new(),
        When::AnyFlag { arg, flags } => {
            let value = low(arg);
            let set: Vec<&str> = flags.iter().filter(|f| value & f.value != 0).map(|f| f.name).collect();
            set.join("|")
        }
        When::NotOneOf { arg, .. } => format!("{:#x}", low(arg)),
        When::IoctlCommand(commands) => {
            let command = low(1);
            match commands.iter().find(|c| c.command == command) {
                Some(c) => format!("{} ({command:#x})", c.name),
                None => format!("{command:#x}"),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Probes
// ---------------------------------------------------------------------------

/// One call the profile must refuse, derived from the rules so that a new
/// rule is probed without anyone writing a test for it: one per flag, per
/// ioctl command, per rule otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub syscall: &'static str,
    pub number: i64,
    pub args: [u64; 6],
    pub errno: i32,
    /// Whether a supervisor records it (see [`Answer`]).
    pub recorded: bool,
    /// What [`describe`] says about it.
    pub detail: String,
}

/// The probes of `rules`. Arguments are zero except the ones a rule looks
/// at, so a call that got through by mistake fails harmlessly (null
/// pointers, descriptor 0).
pub fn probes(rules: &[DenyRule]) -> Result<Vec<Probe>, SeccompError> {
    let mut out = Vec::new();
    for rule in rules {
        let number = syscall_number(rule.syscall).ok_or(SeccompError::UnknownSyscall(rule.syscall))?;
        for args in probe_args(&rule.when) {
            out.push(Probe {
                syscall: rule.syscall,
                number,
                args,
                errno: rule.answer.errno(),
                recorded: rule.answer == Answer::Refuse,
                detail: detail(&rule.when, &args),
            });
        }
    }
    Ok(out)
}

fn probe_args(when: &When) -> Vec<[u64; 6]> {
    let with = |arg: u8, value: u32| {
        let mut args = [0u64; 6];
        args[usize::from(arg)] = value.into();
        args
    };
    match *when {
        When::Always => vec![[0; 6]],
        When::AnyFlag { arg, flags } => flags.iter().map(|f| with(arg, f.value)).collect(),
        When::NotOneOf { arg, allowed } => {
            let refused = (1..=u32::MAX).find(|v| !allowed.contains(v)).unwrap_or(0);
            vec![with(arg, refused)]
        }
        When::IoctlCommand(commands) => commands.iter().map(|c| with(1, c.command)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a classic-BPF seccomp program the way the kernel does, for the
    /// instructions seccompiler and this module emit.
    fn run(program: &[sock_filter], nr: i64, arch: u32, args: [u64; 6]) -> u32 {
        run_counting(program, nr, arch, args, &mut 0)
    }

    fn run_counting(program: &[sock_filter], nr: i64, arch: u32, args: [u64; 6], steps: &mut usize) -> u32 {
        let word = |offset: u32| -> u32 {
            match offset {
                0 => nr as u32,
                4 => arch,
                16..=63 => {
                    let arg = args[((offset - 16) / 8) as usize];
                    // Little-endian: the high half is the word 4 bytes in.
                    if offset & 4 == 0 {
                        arg as u32
                    } else {
                        (arg >> 32) as u32
                    }
                }
                _ => panic!("load from offset {offset}"),
            }
        };
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let insn = &program[pc];
            pc += 1;
            *steps += 1;
            let cond = |taken: bool| if taken { usize::from(insn.jt) } else { usize::from(insn.jf) };
            match insn.code {
                BPF_LD_W_ABS => acc = word(insn.k),
                c if c == (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16 => acc &= insn.k,
                BPF_JA => pc += insn.k as usize,
                BPF_JEQ_K => pc += cond(acc == insn.k),
                BPF_JGE_K => pc += cond(acc >= insn.k),
                c if c == (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16 => pc += cond(acc > insn.k),
                BPF_JSET_K => pc += cond(acc & insn.k != 0),
                BPF_RET_K => return insn.k,
                other => panic!("unexpected instruction {other:#x} at {}", pc - 1),
            }
        }
    }

    fn x86(program: &[sock_filter], name: &str, args: [u64; 6]) -> u32 {
        run(program, syscall_number(name).unwrap(), AUDIT_ARCH_X86_64, args)
    }

    const NOTIFY: u32 = libc::SECCOMP_RET_USER_NOTIF;
    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;

    #[test]
    fn ioctl_numbers_match_the_c_headers() {
        // Printed by a C program built against linux-libc-dev 6.1 and
        // xfslibs-dev 6.1 (the XFS ones newer than those headers from the
        // struct layouts in Linux 6.18's xfs_fs.h).
        let expected: &[(&str, u32)] = &[
            ("XFS_IOC_SWAPEXT", 0xc0c0586d),
            ("XFS_IOC_EXCHANGE_RANGE", 0x40285881),
            ("XFS_IOC_COMMIT_RANGE", 0x40585883),
            ("XFS_IOC_PATH_TO_FSHANDLE", 0xc0385868),
            ("XFS_IOC_PATH_TO_HANDLE", 0xc0385869),
            ("XFS_IOC_FD_TO_HANDLE", 0xc038586a),
            ("XFS_IOC_OPEN_BY_HANDLE", 0xc038586b),
            ("XFS_IOC_READLINK_BY_HANDLE", 0xc038586c),
            ("XFS_IOC_FSSETDM_BY_HANDLE", 0x40405879),
            ("XFS_IOC_ATTRLIST_BY_HANDLE", 0x4058587a),
            ("XFS_IOC_ATTRMULTI_BY_HANDLE", 0x4048587b),
            ("XFS_IOC_GETPARENTS_BY_HANDLE", 0xc040583f),
            ("XFS_IOC_ALLOCSP", 0x4030580a),
            ("XFS_IOC_FREESP", 0x4030580b),
            ("XFS_IOC_ALLOCSP64", 0x40305824),
            ("XFS_IOC_FREESP64", 0x40305825),
            ("EXT4_IOC_MOVE_EXT", 0xc028660f),
            ("FS_IOC_SHUTDOWN", 0x8004587d),
            ("FIFREEZE", 0xc0045877),
            ("FITHAW", 0xc0045878),
            ("FS_IOC_SETFSLABEL", 0x41009432),
            ("FICLONE", 0x40049409),
            ("FICLONERANGE", 0x4020940d),
            ("FIDEDUPERANGE", 0xc0189436),
            ("FS_IOC_SETFLAGS", 0x40086602),
            ("FS_IOC32_SETFLAGS", 0x40046602),
            ("FS_IOC_FSSETXATTR", 0x401c5820),
            ("FS_IOC_SETVERSION", 0x40087602),
            ("FS_IOC32_SETVERSION", 0x40047602),
            ("TIOCSTI", 0x5412),
            ("TIOCLINUX", 0x541c),
        ];
        let ours: Vec<(&str, u32)> = DENIED_IOCTLS.iter().map(|d| (d.name, d.command)).collect();
        assert_eq!(ours, expected);
        // The formulas against libc's own constants.
        assert_eq!(u64::from(iowr(b'!', 0, 80)), libc::SECCOMP_IOCTL_NOTIF_RECV);
        assert_eq!(u64::from(iow(b'!', 2, 8)), libc::SECCOMP_IOCTL_NOTIF_ID_VALID);
        assert_eq!(u64::from(ior(b'f', 1, 8)), libc::FS_IOC_GETFLAGS);
    }

    #[test]
    fn every_rule_names_an_x86_64_syscall_once() {
        for rule in DENY_RULES {
            assert!(syscall_number(rule.syscall).is_some(), "{} has no number", rule.syscall);
            assert!(!rule.reason.is_empty(), "{} has no reason", rule.syscall);
        }
        check_one_rule_per_syscall(DENY_RULES).unwrap();
        let mut numbers: Vec<i64> = X86_64_SYSCALLS.iter().map(|(_, nr)| *nr).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), X86_64_SYSCALLS.len(), "two names share a number");
    }

    #[test]
    fn syscall_numbers_match_the_kernel_headers() {
        // The headers of this host may be older than the newest calls; those
        // must then be ones taken from the kernel's table by hand (the
        // header of linux-libc-dev 6.1 ends at 450).
        let Ok(header) = std::fs::read_to_string("/usr/include/x86_64-linux-gnu/asm/unistd_64.h") else {
            return;
        };
        let from_header = |name: &str| {
            let define = format!("#define __NR_{name} ");
            header.lines().find_map(|l| l.strip_prefix(define.as_str())).map(|n| n.trim().parse::<i64>().unwrap())
        };
        for (name, number) in X86_64_SYSCALLS {
            match from_header(name) {
                Some(expected) => assert_eq!(*number, expected, "{name}"),
                None => assert!(
                    header.contains("__NR_set_mempolicy_home_node ") && (*number > 450 || [335, 336].contains(number)),
                    "{name} is not in the header"
                ),
            }
        }
        // And the table misses nothing the header has.
        for line in header.lines() {
            if let Some(rest) = line.strip_prefix("#define __NR_") {
                let (name, number) = rest.split_once(' ').unwrap();
                assert_eq!(syscall_number(name), Some(number.trim().parse().unwrap()), "{name}");
            }
        }
    }

    #[test]
    fn issue_list_is_covered() {
        let required = [
            "mount",
            "umount2",
            "fsopen",
            "fsconfig",
            "fsmount",
            "fspick",
            "move_mount",
            "open_tree",
            "mount_setattr",
            "unshare",
            "clone",
            "clone3",
            "setns",
            "pivot_root",
            "chroot",
            "ptrace",
            "process_vm_readv",
            "process_vm_writev",
            "kexec_load",
            "kexec_file_load",
            "init_module",
            "finit_module",
            "delete_module",
            "bpf",
            "perf_event_open",
            "userfaultfd",
            "io_uring_setup",
            "io_uring_enter",
            "io_uring_register",
            "keyctl",
            "add_key",
            "request_key",
            "name_to_handle_at",
            "open_by_handle_at",
            "clock_settime",
            "clock_adjtime",
            "settimeofday",
            "adjtimex",
            "swapon",
            "swapoff",
            "reboot",
            "acct",
            "quotactl",
            "quotactl_fd",
            "lookup_dcookie",
            "iopl",
            "ioperm",
            "syslog",
            "personality",
            "ioctl",
        ];
        for name in required {
            assert!(DENY_RULES.iter().any(|r| r.syscall == name), "{name} is not denied");
        }
    }

    #[test]
    fn profile_compiles_and_every_probe_is_refused_as_declared() {
        let notify = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        let errno = compile(&SANDBOX_PROFILE, Delivery::Errno).unwrap();
        let probes = probes(DENY_RULES).unwrap();
        assert!(probes.len() > DENY_RULES.len(), "flags and commands get a probe each");
        for probe in &probes {
            let via_notify = run(&notify, probe.number, AUDIT_ARCH_X86_64, probe.args);
            let via_errno = run(&errno, probe.number, AUDIT_ARCH_X86_64, probe.args);
            if probe.recorded {
                assert_eq!(via_notify, NOTIFY, "{probe:?}");
                assert_eq!(via_errno, errno_action(probe.errno), "{probe:?}");
            } else {
                assert_eq!(via_notify, errno_action(probe.errno), "{probe:?}");
                assert_eq!(via_errno, errno_action(probe.errno), "{probe:?}");
            }
        }
    }

    #[test]
    fn ordinary_calls_and_harmless_variants_are_allowed() {
        let program = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        for nr in [libc::SYS_read, libc::SYS_write, libc::SYS_execve, libc::SYS_fork, libc::SYS_openat] {
            assert_eq!(run(&program, nr, AUDIT_ARCH_X86_64, [0; 6]), ALLOW, "nr {nr}");
        }
        let fork_flags = (libc::CLONE_CHILD_SETTID | libc::CLONE_CHILD_CLEARTID | libc::SIGCHLD) as u64;
        assert_eq!(x86(&program, "clone", [fork_flags, 0, 0, 0, 0, 0]), ALLOW);
        let thread_flags = (libc::CLONE_VM | libc::CLONE_FS | libc::CLONE_FILES | libc::CLONE_SIGHAND) as u64;
        assert_eq!(x86(&program, "clone", [thread_flags | libc::CLONE_THREAD as u64, 0, 0, 0, 0, 0]), ALLOW);
        assert_eq!(x86(&program, "unshare", [libc::CLONE_FILES as u64, 0, 0, 0, 0, 0]), ALLOW);
        for persona in ALLOWED_PERSONAS {
            assert_eq!(x86(&program, "personality", [u64::from(*persona), 0, 0, 0, 0, 0]), ALLOW);
        }
        for command in [libc::TCGETS, libc::FIONREAD, libc::FIONBIO, libc::TIOCGWINSZ] {
            assert_eq!(x86(&program, "ioctl", [0, command, 0, 0, 0, 0]), ALLOW, "ioctl {command:#x}");
        }
        assert_eq!(x86(&program, "personality", [0x0040_0000, 0, 0, 0, 0, 0]), NOTIFY);
        // Every allowed call, with arguments no rule objects to.
        for name in ALLOWED_SYSCALLS {
            assert_eq!(x86(&program, name, [0; 6]), ALLOW, "{name}");
        }
        // Without the allowlist, calls no rule names are allowed: the old
        // deny list.
        let deny_list = compile(&Profile::deny_list(DENY_RULES), Delivery::Notify).unwrap();
        assert_eq!(run(&deny_list, 1000, AUDIT_ARCH_X86_64, [0; 6]), ALLOW);
        assert_eq!(x86(&deny_list, "vhangup", [0; 6]), ALLOW);
        assert_eq!(x86(&deny_list, "mount", [0; 6]), NOTIFY);
    }

    #[test]
    fn high_argument_bits_do_not_hide_a_command_or_flag() {
        let program = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        let ficlone = 0x40049409u64 | 0xdead_beef_0000_0000;
        assert_eq!(x86(&program, "ioctl", [0, ficlone, 0, 0, 0, 0]), NOTIFY);
        let newuser = libc::CLONE_NEWUSER as u64 | 0x1_0000_0000;
        assert_eq!(x86(&program, "unshare", [newuser, 0, 0, 0, 0, 0]), NOTIFY);
        assert_eq!(x86(&program, "clone", [newuser | libc::SIGCHLD as u64, 0, 0, 0, 0, 0]), NOTIFY);
    }

    #[test]
    fn other_abis_are_fenced_off() {
        let program = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        assert_eq!(run(&program, 20, AUDIT_ARCH_I386, [0; 6]), libc::SECCOMP_RET_KILL_PROCESS);
        let x32_read = i64::from(X32_SYSCALL_BIT);
        assert_eq!(run(&program, x32_read, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY);
        assert_eq!(run(&program, x32_read + libc::SYS_mount, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY);
        // syscall(-1) is not x32, only a number no kernel assigns.
        assert_eq!(run(&program, -1, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY);
        let minus_one = describe(&SANDBOX_PROFILE, -1, AUDIT_ARCH_X86_64, &[0; 6]);
        assert_eq!((minus_one.detail.as_str(), minus_one.errno), ("syscall -1 not allowed", libc::ENOSYS));
        let deny_list = compile(&Profile::deny_list(DENY_RULES), Delivery::Notify).unwrap();
        assert_eq!(run(&deny_list, -1, AUDIT_ARCH_X86_64, [0; 6]), ALLOW, "the kernel answers ENOSYS itself");
    }

    #[test]
    fn description_names_the_call_and_what_made_it_a_refusal() {
        let call = |name: &str, args: [u64; 6]| {
            describe(&SANDBOX_PROFILE, syscall_number(name).unwrap() as i32, AUDIT_ARCH_X86_64, &args)
        };
        assert_eq!(
            call("ioctl", [3, 0x40049409, 0, 0, 0, 0]),
            Denial { syscall: "ioctl".into(), detail: "FICLONE (0x40049409)".into(), errno: libc::EPERM }
        );
        let flags = (libc::CLONE_NEWUSER | libc::CLONE_NEWNS) as u64;
        assert_eq!(call("unshare", [flags, 0, 0, 0, 0, 0]).detail, "CLONE_NEWNS|CLONE_NEWUSER");
        assert_eq!(call("mount", [0; 6]).detail, "");
        assert_eq!(call("personality", [0x40_0000, 0, 0, 0, 0, 0]).detail, "0x400000");
        assert_eq!(call("clone3", [0; 6]).errno, libc::ENOSYS);
        let x32 =
            describe(&SANDBOX_PROFILE, (X32_SYSCALL_BIT as i64 + libc::SYS_mount) as i32, AUDIT_ARCH_X86_64, &[0; 6]);
        assert_eq!((x32.syscall.as_str(), x32.detail.as_str()), ("mount", "x32 ABI"));
    }

    #[test]
    fn compile_rejects_bad_rule_data() {
        let unknown = [always("no_such_call", "x")];
        assert!(matches!(
            compile(&Profile::deny_list(&unknown), Delivery::Notify),
            Err(SeccompError::UnknownSyscall("no_such_call"))
        ));
        let twice = [always("mount", "x"), always("mount", "y")];
        assert!(matches!(
            compile(&Profile::deny_list(&twice), Delivery::Notify),
            Err(SeccompError::DuplicateRule("mount"))
        ));
    }

    #[test]
    fn a_profile_of_only_absent_rules_allows_everything_else() {
        let only_absent: Vec<DenyRule> = DENY_RULES.iter().filter(|r| r.answer == Answer::Absent).copied().collect();
        let program = compile(&Profile::deny_list(&only_absent), Delivery::Notify).unwrap();
        assert_eq!(x86(&program, "clone3", [0; 6]), errno_action(libc::ENOSYS));
        assert_eq!(x86(&program, "mount", [0; 6]), ALLOW);
        let full = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        assert!(full.len() < BPF_MAXINSNS / 4, "{} instructions", full.len());
    }

    /// The kernel's own check (`seccomp_is_const_allow`) of whether a call
    /// is allowed whatever its arguments, which lets it skip the filter for
    /// that call from then on: the program must reach `ret ALLOW` without
    /// loading an argument.
    fn kernel_caches_as_allowed(program: &[sock_filter], nr: i64) -> bool {
        let (mut pc, mut acc) = (0usize, 0u32);
        while pc < program.len() {
            let insn = &program[pc];
            pc += 1;
            match insn.code {
                BPF_LD_W_ABS => match insn.k {
                    DATA_NR => acc = nr as u32,
                    DATA_ARCH => acc = AUDIT_ARCH_X86_64,
                    _ => return false,
                },
                BPF_RET_K => return insn.k == ALLOW,
                BPF_JA => pc += insn.k as usize,
                BPF_JEQ_K => pc += usize::from(if acc == insn.k { insn.jt } else { insn.jf }),
                BPF_JGE_K => pc += usize::from(if acc >= insn.k { insn.jt } else { insn.jf }),
                BPF_JGT_K => pc += usize::from(if acc > insn.k { insn.jt } else { insn.jf }),
                BPF_JSET_K => pc += usize::from(if acc & insn.k != 0 { insn.jt } else { insn.jf }),
                c if c == (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16 => acc &= insn.k,
                _ => return false,
            }
        }
        false
    }

    #[test]
    fn calls_off_the_allowlist_are_refused_known_ones_eperm_unknown_ones_enosys() {
        let notify = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        let errno = compile(&SANDBOX_PROFILE, Delivery::Errno).unwrap();
        for (name, _) in REFUSED_UNLISTED {
            assert_eq!(x86(&notify, name, [0; 6]), NOTIFY, "{name}");
            assert_eq!(x86(&errno, name, [0; 6]), errno_action(libc::EPERM), "{name}");
            let denial = describe(&SANDBOX_PROFILE, syscall_number(name).unwrap() as i32, AUDIT_ARCH_X86_64, &[0; 6]);
            let nr = syscall_number(name).unwrap();
            assert_eq!(
                denial,
                Denial { syscall: name.to_string(), detail: format!("syscall {nr} not allowed"), errno: libc::EPERM }
            );
        }
        // Unassigned numbers: the gap before the newer calls, past the
        // newest one, and far out.
        for nr in [337, 423, 470, 1000, 0x3fff_ffff] {
            assert_eq!(run(&notify, nr, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY, "{nr}");
            assert_eq!(run(&errno, nr, AUDIT_ARCH_X86_64, [0; 6]), errno_action(libc::ENOSYS), "{nr}");
            let denial = describe(&SANDBOX_PROFILE, nr as i32, AUDIT_ARCH_X86_64, &[0; 6]);
            assert_eq!(
                denial,
                Denial { syscall: format!("#{nr}"), detail: format!("syscall {nr} not allowed"), errno: libc::ENOSYS }
            );
        }
        // A rule's call keeps its rule's description.
        assert_eq!(describe(&SANDBOX_PROFILE, libc::SYS_mount as i32, AUDIT_ARCH_X86_64, &[0; 6]).detail, "");
        assert_eq!(x86(&errno, "statmount", [0; 6]), errno_action(libc::ENOSYS));
    }

    #[test]
    fn every_known_call_is_allowed_denied_or_refused_with_a_reason() {
        let denied = |name: &str| DENY_RULES.iter().find(|r| r.syscall == name);
        let unlisted = |name: &str| REFUSED_UNLISTED.iter().any(|(n, _)| *n == name);
        for (name, _) in X86_64_SYSCALLS {
            let allowed = ALLOWED_SYSCALLS.contains(name);
            match denied(name) {
                // A rule that judges arguments lets the rest through to
                // the allowlist; one that refuses always has nothing to let
                // through, so listing its call as allowed would mislead.
                Some(rule) => assert_eq!(allowed, rule.when != When::Always, "{name}"),
                None => assert!(allowed != unlisted(name), "{name}: allowed or in REFUSED_UNLISTED, exactly one"),
            }
            assert!(!(denied(name).is_some() && unlisted(name)), "{name} has a rule and is in REFUSED_UNLISTED");
        }
        for name in ALLOWED_SYSCALLS.iter().copied().chain(REFUSED_UNLISTED.iter().map(|(n, _)| *n)) {
            assert!(syscall_number(name).is_some(), "{name} has no number");
        }
        let mut listed: Vec<&str> = ALLOWED_SYSCALLS.to_vec();
        listed.sort_unstable();
        let count = listed.len();
        listed.dedup();
        assert_eq!(listed.len(), count, "a call is allowed twice");
        assert!(REFUSED_UNLISTED.iter().all(|(_, why)| !why.is_empty()));
    }

    #[test]
    fn what_ordinary_programs_need_is_allowed() {
        // What python3, gcc, g++, git, pytest, perl and coreutils did in the
        // default image (strace -f), what glibc and Rust std probe, and what
        // warren-init does under the filter.
        let needed = [
            "access",
            "arch_prctl",
            "brk",
            "chdir",
            "chmod",
            "clone",
            "close",
            "close_range",
            "connect",
            "copy_file_range",
            "creat",
            "dup2",
            "epoll_create1",
            "execve",
            "exit_group",
            "faccessat2",
            "fadvise64",
            "fchdir",
            "fcntl",
            "fstatfs",
            "ftruncate",
            "futex",
            "getcwd",
            "getdents64",
            "getegid",
            "geteuid",
            "getgid",
            "getpid",
            "getppid",
            "getrandom",
            "getrusage",
            "gettid",
            "getuid",
            "getxattr",
            "ioctl",
            "lgetxattr",
            "link",
            "lseek",
            "mkdir",
            "mknodat",
            "mmap",
            "mprotect",
            "munmap",
            "newfstatat",
            "openat",
            "pipe2",
            "pread64",
            "prlimit64",
            "read",
            "readlink",
            "rename",
            "renameat2",
            "rseq",
            "rt_sigaction",
            "rt_sigprocmask",
            "rt_sigreturn",
            "sched_getaffinity",
            "set_robust_list",
            "set_tid_address",
            "sigaltstack",
            "socket",
            "statfs",
            "statx",
            "symlink",
            "sysinfo",
            "umask",
            "uname",
            "unlink",
            "unlinkat",
            "vfork",
            "wait4",
            "write",
            "restart_syscall",
            "membarrier",
            "poll",
            "accept4",
            "recvmsg",
            "sendmsg",
            "kill",
            "waitid",
            "execveat",
            "landlock_create_ruleset",
            "landlock_add_rule",
            "landlock_restrict_self",
            "prctl",
            "pidfd_open",
            "pidfd_send_signal",
            "epoll_pwait2",
            "openat2",
            "fchmodat2",
        ];
        for name in needed {
            assert!(ALLOWED_SYSCALLS.contains(&name), "{name}");
        }
    }

    #[test]
    fn allowed_calls_are_cached_by_the_kernel_and_others_are_not() {
        let program = compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap();
        let judged = ["clone", "unshare", "ioctl", "personality"];
        for name in ALLOWED_SYSCALLS {
            let nr = syscall_number(name).unwrap();
            assert_eq!(kernel_caches_as_allowed(&program, nr), !judged.contains(name), "{name}");
        }
        for (name, nr) in X86_64_SYSCALLS {
            if !ALLOWED_SYSCALLS.contains(name) {
                assert!(!kernel_caches_as_allowed(&program, *nr), "{name}");
            }
        }
    }

    /// Calls whose answer depends on the arguments get, besides zeros and
    /// their probes, each listed value, its neighbours and some high bits.
    fn argument_cases(when: &When) -> Vec<[u64; 6]> {
        let with = |arg: u8, value: u64| {
            let mut args = [0u64; 6];
            args[usize::from(arg)] = value;
            args
        };
        let (arg, values): (u8, Vec<u32>) = match *when {
            When::Always => return vec![[0; 6]],
            When::AnyFlag { arg, flags } => {
                let all = flags.iter().fold(0, |m, f| m | f.value);
                let mut values: Vec<u32> = flags.iter().map(|f| f.value).collect();
                values.extend([
                    all,
                    !all,
                    u32::MAX,
                    libc::SIGCHLD as u32,
                    (libc::CLONE_VM | libc::CLONE_THREAD) as u32,
                ]);
                (arg, values)
            }
            When::NotOneOf { arg, allowed } => (arg, allowed.to_vec()),
            When::IoctlCommand(commands) => (1, commands.iter().map(|c| c.command).collect()),
        };
        let mut out = vec![[0; 6]];
        for v in values {
            for near in [v.wrapping_sub(1), v, v.wrapping_add(1)] {
                out.push(with(arg, u64::from(near)));
                out.push(with(arg, u64::from(near) | 0xdead_beef_0000_0000));
            }
        }
        out.extend([with(arg, u64::from(u32::MAX)), with(arg, u64::MAX), with(arg, 1 << 32)]);
        out
    }

    #[test]
    fn the_tree_answers_every_call_as_the_row_of_rules_did() {
        let max = X86_64_SYSCALLS.iter().map(|(_, nr)| *nr).max().unwrap();
        let numbers: Vec<i64> = (0..=max + 64)
            .chain([1000, 0x3fff_ffff, 0x4000_0000, 0x4000_0001, 0x4000_00a5, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff])
            .chain([-1, -2, i64::from(i32::MIN)])
            .collect();
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        let deny_list = Profile::deny_list(DENY_RULES);
        let only_absent: Vec<DenyRule> = DENY_RULES.iter().filter(|r| r.answer == Answer::Absent).copied().collect();
        let only_refuse: Vec<DenyRule> = DENY_RULES.iter().filter(|r| r.answer == Answer::Refuse).copied().collect();
        let profiles = [
            SANDBOX_PROFILE,
            deny_list,
            Profile::deny_list(&only_absent),
            Profile { rules: &only_refuse, allowed: Some(ALLOWED_SYSCALLS) },
            Profile { rules: &[], allowed: Some(ALLOWED_SYSCALLS) },
        ];
        let mut compared = 0;
        for profile in &profiles {
            for delivery in [Delivery::Notify, Delivery::Errno] {
                let tree = compile(profile, delivery).unwrap();
                let row = linear::compile(profile, delivery).unwrap();
                for &nr in &numbers {
                    let rule = profile.rules.iter().find(|r| syscall_number(r.syscall) == Some(nr));
                    let cases = rule.map_or_else(|| vec![[0; 6], [u64::MAX; 6]], |r| argument_cases(&r.when));
                    for args in cases {
                        for arch in [AUDIT_ARCH_X86_64, AUDIT_ARCH_I386, 0] {
                            let (want, got) = (run(&row, nr, arch, args), run(&tree, nr, arch, args));
                            assert_eq!(got, want, "nr {nr} arch {arch:#x} args {args:x?} {delivery:?}");
                            compared += 1;
                        }
                    }
                }
            }
        }
        assert!(compared > 20_000, "{compared}");
        // And what it saves: the old row against the tree.
        let (tree, row) = (
            compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap(),
            linear::compile(&SANDBOX_PROFILE, Delivery::Notify).unwrap(),
        );
        let steps = |program: &[sock_filter]| (0..=max).map(|nr| steps_to_answer(program, nr)).sum::<usize>();
        assert!(steps(&tree) * 4 < steps(&row), "tree {} vs row {} steps", steps(&tree), steps(&row));
    }

    /// Instructions the kernel runs to answer call `nr` with zero arguments.
    fn steps_to_answer(program: &[sock_filter], nr: i64) -> usize {
        let mut steps = 0;
        run_counting(program, nr, AUDIT_ARCH_X86_64, [0; 6], &mut steps);
        steps
    }
}

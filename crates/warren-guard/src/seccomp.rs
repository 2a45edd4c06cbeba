//! The seccomp profile of every sandbox process: which system calls and
//! which `ioctl` commands are refused, why, and what the caller gets back.
//!
//! Shape: a deny list over a default of ALLOW. The long-term aim is an
//! allowlist of the ~350 calls real workloads make; a deny list comes first
//! because every denial here is one the issue names (plus the few new calls
//! that reach the same kernel code, see [`DENY_RULES`]), each can be probed
//! and justified on its own, and nothing an agent's toolchain needs can be
//! broken by a call we forgot to allow. Its known weakness: a system call
//! added to the kernel later is allowed until someone lists it (6.15 and
//! 6.17 added `open_tree_attr` and `file_setattr`, both listed here).
//!
//! A refused call answers `EPERM` and, with [`Delivery::Notify`], reaches a
//! supervisor (PID 1 of the sandbox) that records it as a security event
//! before answering. `clone3` answers `ENOSYS` straight from the filter: libc
//! then falls back to `clone`, whose flags the filter can read (`clone3`
//! keeps them in memory a filter cannot see).
//!
//! The filter is built with `seccompiler` for x86_64 and then changed in
//! three small ways `seccompiler` cannot express (see [`compile`]): refusals
//! become `SECCOMP_RET_USER_NOTIF`, the two answer groups are chained into
//! one program, and an ABI fence comes first. The fence kills a process
//! that makes a system call of another ABI (`int 0x80`, a 32-bit binary):
//! its numbers differ, so this profile could not judge it. It refuses the
//! x32 ABI (numbers with bit 30 set), which would reach the same kernel
//! functions under other numbers on kernels that enable it.
//!
//! Comparisons of 32-bit arguments (ioctl commands, clone flags, personas)
//! look at the low half only, as the kernel does: setting high bits cannot
//! slip a command past the filter.

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

pub use seccompiler::{sock_filter, BpfProgram};

/// Errors building the filter. They are all bugs in the profile's data, so
/// none can happen for [`DENY_RULES`] (a test compiles it).
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("system call {0:?} has no x86_64 number in this profile's table")]
    UnknownSyscall(&'static str),
    #[error("system call {0:?} has more than one deny rule")]
    DuplicateRule(&'static str),
    #[error("seccompiler: {0}")]
    Backend(#[from] seccompiler::BackendError),
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

/// The x86_64 numbers of the calls the profile names.
const X86_64_SYSCALLS: &[(&str, libc::c_long)] = &[
    ("acct", libc::SYS_acct),
    ("add_key", libc::SYS_add_key),
    ("adjtimex", libc::SYS_adjtimex),
    ("bpf", libc::SYS_bpf),
    ("chroot", libc::SYS_chroot),
    ("clock_adjtime", libc::SYS_clock_adjtime),
    ("clock_settime", libc::SYS_clock_settime),
    ("clone", libc::SYS_clone),
    ("clone3", libc::SYS_clone3),
    ("delete_module", libc::SYS_delete_module),
    ("file_setattr", SYS_FILE_SETATTR),
    ("finit_module", libc::SYS_finit_module),
    ("fsconfig", libc::SYS_fsconfig),
    ("fsmount", libc::SYS_fsmount),
    ("fsopen", libc::SYS_fsopen),
    ("fspick", libc::SYS_fspick),
    ("init_module", libc::SYS_init_module),
    ("io_uring_enter", libc::SYS_io_uring_enter),
    ("io_uring_register", libc::SYS_io_uring_register),
    ("io_uring_setup", libc::SYS_io_uring_setup),
    ("ioctl", libc::SYS_ioctl),
    ("ioperm", libc::SYS_ioperm),
    ("iopl", libc::SYS_iopl),
    ("kcmp", libc::SYS_kcmp),
    ("kexec_file_load", libc::SYS_kexec_file_load),
    ("kexec_load", libc::SYS_kexec_load),
    ("keyctl", libc::SYS_keyctl),
    ("lookup_dcookie", libc::SYS_lookup_dcookie),
    ("mount", libc::SYS_mount),
    ("mount_setattr", libc::SYS_mount_setattr),
    ("move_mount", libc::SYS_move_mount),
    ("name_to_handle_at", libc::SYS_name_to_handle_at),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("open_tree", libc::SYS_open_tree),
    ("open_tree_attr", SYS_OPEN_TREE_ATTR),
    ("perf_event_open", libc::SYS_perf_event_open),
    ("personality", libc::SYS_personality),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
    ("pivot_root", libc::SYS_pivot_root),
    ("process_vm_readv", libc::SYS_process_vm_readv),
    ("process_vm_writev", libc::SYS_process_vm_writev),
    ("ptrace", libc::SYS_ptrace),
    ("quotactl", libc::SYS_quotactl),
    ("quotactl_fd", libc::SYS_quotactl_fd),
    ("reboot", libc::SYS_reboot),
    ("request_key", libc::SYS_request_key),
    ("setns", libc::SYS_setns),
    ("settimeofday", libc::SYS_settimeofday),
    ("swapoff", libc::SYS_swapoff),
    ("swapon", libc::SYS_swapon),
    ("syslog", libc::SYS_syslog),
    ("umount2", libc::SYS_umount2),
    ("unshare", libc::SYS_unshare),
    ("userfaultfd", libc::SYS_userfaultfd),
];

// Newer than the libc crate: arch/x86/entry/syscalls/syscall_64.tbl.
/// `open_tree_attr`, Linux 6.15.
const SYS_OPEN_TREE_ATTR: libc::c_long = 467;
/// `file_setattr`, Linux 6.17.
const SYS_FILE_SETATTR: libc::c_long = 469;

/// The x86_64 number of `name`, for the calls this profile names.
pub fn syscall_number(name: &str) -> Option<i64> {
    X86_64_SYSCALLS.iter().find(|(n, _)| *n == name).map(|(_, nr)| *nr)
}

fn syscall_name(number: i64) -> Option<&'static str> {
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
const BPF_JA: u16 = (libc::BPF_JMP | libc::BPF_JA) as u16;
const BPF_RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;

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

/// Compiles `rules` into one x86_64 filter: the ABI fence, then the
/// `Refuse` rules, then the `Absent` rules, each group built by seccompiler
/// (default ALLOW) and chained to the next by turning its ALLOW returns
/// into jumps past its end.
pub fn compile(rules: &[DenyRule], delivery: Delivery) -> Result<BpfProgram, SeccompError> {
    check_one_rule_per_syscall(rules)?;
    let refusal = match delivery {
        Delivery::Notify => libc::SECCOMP_RET_USER_NOTIF,
        Delivery::Errno => errno_action(libc::EPERM),
    };
    let mut groups = Vec::new();
    for answer in [Answer::Refuse, Answer::Absent] {
        let chosen: Vec<&DenyRule> = rules.iter().filter(|r| r.answer == answer).collect();
        if chosen.is_empty() {
            continue;
        }
        let mut group = seccompiler_program(&chosen, answer)?;
        if answer == Answer::Refuse {
            rewrite_returns(&mut group, errno_action(libc::EPERM), refusal);
        }
        groups.push(group);
    }
    let mut program = abi_fence(refusal);
    program.extend(chain(groups));
    if program.len() > BPF_MAXINSNS {
        return Err(SeccompError::TooLong(program.len()));
    }
    Ok(program)
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

/// One seccompiler filter for rules that share an answer: their calls
/// return `SECCOMP_RET_ERRNO | answer.errno()`, everything else ALLOW.
fn seccompiler_program(rules: &[&DenyRule], answer: Answer) -> Result<BpfProgram, SeccompError> {
    let mut by_number = BTreeMap::new();
    for rule in rules {
        let number = syscall_number(rule.syscall).ok_or(SeccompError::UnknownSyscall(rule.syscall))?;
        by_number.insert(number, seccompiler_rules(&rule.when)?);
    }
    let filter = SeccompFilter::new(
        by_number,
        SeccompAction::Allow,
        SeccompAction::Errno(answer.errno() as u32),
        TargetArch::x86_64,
    )?;
    Ok(filter.try_into()?)
}

/// The conditions of one rule, as seccompiler rules (any one matching
/// refuses the call; an empty list refuses it always).
fn seccompiler_rules(when: &When) -> Result<Vec<SeccompRule>, SeccompError> {
    let dword =
        |arg: u8, op: SeccompCmpOp, value: u32| SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value.into());
    let rules = match *when {
        When::Always => Vec::new(),
        When::AnyFlag { arg, flags } => flags
            .iter()
            .map(|flag| SeccompRule::new(vec![dword(arg, SeccompCmpOp::MaskedEq(flag.value.into()), flag.value)?]))
            .collect::<Result<_, _>>()?,
        When::NotOneOf { arg, allowed } => {
            let conditions = allowed.iter().map(|v| dword(arg, SeccompCmpOp::Ne, *v)).collect::<Result<_, _>>()?;
            vec![SeccompRule::new(conditions)?]
        }
        When::IoctlCommand(commands) => commands
            .iter()
            .map(|c| SeccompRule::new(vec![dword(1, SeccompCmpOp::Eq, c.command)?]))
            .collect::<Result<_, _>>()?,
    };
    Ok(rules)
}

/// Replaces every `ret from` by `ret to`.
fn rewrite_returns(program: &mut BpfProgram, from: u32, to: u32) {
    for insn in program.iter_mut().filter(|i| i.code == BPF_RET_K && i.k == from) {
        insn.k = to;
    }
}

/// Concatenates filters: in every one but the last, `ret ALLOW` becomes a
/// jump to the first instruction after it, i.e. to the next filter.
fn chain(groups: Vec<BpfProgram>) -> BpfProgram {
    let count = groups.len();
    let mut out = Vec::new();
    for (i, mut group) in groups.into_iter().enumerate() {
        if i + 1 < count {
            let len = group.len();
            for (at, insn) in group.iter_mut().enumerate() {
                if insn.code == BPF_RET_K && insn.k == libc::SECCOMP_RET_ALLOW {
                    *insn = stmt(BPF_JA, (len - 1 - at) as u32);
                }
            }
        }
        out.extend(group);
    }
    out
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
pub fn describe(rules: &[DenyRule], nr: i32, arch: u32, args: &[u64; 6]) -> Denial {
    let number = i64::from(nr);
    if arch != AUDIT_ARCH_X86_64 {
        return Denial {
            syscall: format!("#{nr}"),
            detail: format!("foreign ABI (audit arch {arch:#x})"),
            errno: libc::EPERM,
        };
    }
    if nr as u32 & X32_SYSCALL_BIT != 0 {
        let base = i64::from(nr as u32 & !X32_SYSCALL_BIT);
        let syscall = syscall_name(base).map_or_else(|| format!("#{base}"), str::to_string);
        return Denial { syscall, detail: "x32 ABI".into(), errno: libc::EPERM };
    }
    let rule = rules.iter().find(|r| syscall_number(r.syscall) == Some(number));
    match rule {
        Some(rule) => {
            Denial { syscall: rule.syscall.to_string(), detail: detail(&rule.when, args), errno: rule.answer.errno() }
        }
        // The filter and the rules disagree: still a refusal.
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
            let cond = |taken: bool| if taken { usize::from(insn.jt) } else { usize::from(insn.jf) };
            match insn.code {
                BPF_LD_W_ABS => acc = word(insn.k),
                c if c == (libc::BPF_ALU | libc::BPF_AND | libc::BPF_K) as u16 => acc &= insn.k,
                BPF_JA => pc += insn.k as usize,
                BPF_JEQ_K => pc += cond(acc == insn.k),
                BPF_JGE_K => pc += cond(acc >= insn.k),
                c if c == (libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K) as u16 => pc += cond(acc > insn.k),
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
        // must then be the two taken from the kernel's table by hand.
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
                None => assert!(["open_tree_attr", "file_setattr"].contains(name), "{name} is not in the header"),
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
        let notify = compile(DENY_RULES, Delivery::Notify).unwrap();
        let errno = compile(DENY_RULES, Delivery::Errno).unwrap();
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
        let program = compile(DENY_RULES, Delivery::Notify).unwrap();
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
        // The other "personality" refused and unknown syscalls allowed: the
        // default of a deny list.
        assert_eq!(x86(&program, "personality", [0x0040_0000, 0, 0, 0, 0, 0]), NOTIFY);
        assert_eq!(run(&program, 1000, AUDIT_ARCH_X86_64, [0; 6]), ALLOW);
    }

    #[test]
    fn high_argument_bits_do_not_hide_a_command_or_flag() {
        let program = compile(DENY_RULES, Delivery::Notify).unwrap();
        let ficlone = 0x40049409u64 | 0xdead_beef_0000_0000;
        assert_eq!(x86(&program, "ioctl", [0, ficlone, 0, 0, 0, 0]), NOTIFY);
        let newuser = libc::CLONE_NEWUSER as u64 | 0x1_0000_0000;
        assert_eq!(x86(&program, "unshare", [newuser, 0, 0, 0, 0, 0]), NOTIFY);
        assert_eq!(x86(&program, "clone", [newuser | libc::SIGCHLD as u64, 0, 0, 0, 0, 0]), NOTIFY);
    }

    #[test]
    fn other_abis_are_fenced_off() {
        let program = compile(DENY_RULES, Delivery::Notify).unwrap();
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        assert_eq!(run(&program, 20, AUDIT_ARCH_I386, [0; 6]), libc::SECCOMP_RET_KILL_PROCESS);
        let x32_read = i64::from(X32_SYSCALL_BIT);
        assert_eq!(run(&program, x32_read, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY);
        assert_eq!(run(&program, x32_read + libc::SYS_mount, AUDIT_ARCH_X86_64, [0; 6]), NOTIFY);
        // syscall(-1) is not x32: the kernel answers ENOSYS itself.
        assert_eq!(run(&program, -1, AUDIT_ARCH_X86_64, [0; 6]), ALLOW);
    }

    #[test]
    fn description_names_the_call_and_what_made_it_a_refusal() {
        let call = |name: &str, args: [u64; 6]| {
            describe(DENY_RULES, syscall_number(name).unwrap() as i32, AUDIT_ARCH_X86_64, &args)
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
        let x32 = describe(DENY_RULES, (X32_SYSCALL_BIT as i64 + libc::SYS_mount) as i32, AUDIT_ARCH_X86_64, &[0; 6]);
        assert_eq!((x32.syscall.as_str(), x32.detail.as_str()), ("mount", "x32 ABI"));
    }

    #[test]
    fn compile_rejects_bad_rule_data() {
        let unknown = [always("no_such_call", "x")];
        assert!(matches!(compile(&unknown, Delivery::Notify), Err(SeccompError::UnknownSyscall("no_such_call"))));
        let twice = [always("mount", "x"), always("mount", "y")];
        assert!(matches!(compile(&twice, Delivery::Notify), Err(SeccompError::DuplicateRule("mount"))));
    }

    #[test]
    fn chained_groups_fall_through_to_allow() {
        // Only the Absent group: no chaining, clone3 still ENOSYS.
        let only_absent: Vec<DenyRule> = DENY_RULES.iter().filter(|r| r.answer == Answer::Absent).copied().collect();
        let program = compile(&only_absent, Delivery::Notify).unwrap();
        assert_eq!(x86(&program, "clone3", [0; 6]), errno_action(libc::ENOSYS));
        assert_eq!(x86(&program, "mount", [0; 6]), ALLOW);
        let full = compile(DENY_RULES, Delivery::Notify).unwrap();
        assert!(full.len() < BPF_MAXINSNS / 4, "{} instructions", full.len());
    }
}

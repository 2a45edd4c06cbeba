//! The fixed part of every container sandbox's profile: the capabilities its
//! processes may hold and the kernel files it must never see or change.
//!
//! This module is data, not mechanism: `warren-init` applies it from inside
//! the sandbox (it owns the mount namespace and the credentials there).
//! Paths are absolute as seen inside the sandbox.

/// A Linux capability, numbered as in `<linux/capability.h>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Capability {
    Chown = 0,
    DacOverride = 1,
    DacReadSearch = 2,
    Fowner = 3,
    Fsetid = 4,
    Kill = 5,
    Setgid = 6,
    Setuid = 7,
    Setpcap = 8,
    LinuxImmutable = 9,
    NetBindService = 10,
    NetBroadcast = 11,
    NetAdmin = 12,
    NetRaw = 13,
    IpcLock = 14,
    IpcOwner = 15,
    SysModule = 16,
    SysRawio = 17,
    SysChroot = 18,
    SysPtrace = 19,
    SysPacct = 20,
    SysAdmin = 21,
    SysBoot = 22,
    SysNice = 23,
    SysResource = 24,
    SysTime = 25,
    SysTtyConfig = 26,
    Mknod = 27,
    Lease = 28,
    AuditWrite = 29,
    AuditControl = 30,
    Setfcap = 31,
    MacOverride = 32,
    MacAdmin = 33,
    Syslog = 34,
    WakeAlarm = 35,
    BlockSuspend = 36,
    AuditRead = 37,
    Perfmon = 38,
    Bpf = 39,
    CheckpointRestore = 40,
}

impl Capability {
    /// The kernel's number for this capability.
    pub const fn number(self) -> u32 {
        self as u32
    }

    /// This capability as a bit of a capability-set mask.
    pub const fn bit(self) -> u64 {
        1u64 << (self as u32)
    }
}

/// What a sandbox's processes may hold: Docker's default set without
/// `CAP_NET_RAW` (raw sockets allow spoofing on the sandbox's network and
/// have been the door to several kernel bugs; `ping` is not worth it).
/// Everything else is removed from the bounding set, so no exec, setuid
/// binary or file capability can bring it back.
pub const SANDBOX_CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// [`SANDBOX_CAPABILITIES`] as a mask, bit `n` for capability number `n`.
pub const fn sandbox_capability_mask() -> u64 {
    let mut mask = 0u64;
    let mut i = 0;
    while i < SANDBOX_CAPABILITIES.len() {
        mask |= SANDBOX_CAPABILITIES[i].bit();
        i += 1;
    }
    mask
}

/// Whether the sandbox keeps capability number `number` (any number the
/// kernel knows, including ones newer than [`Capability`]).
pub const fn sandbox_keeps(number: u32) -> bool {
    number < 64 && sandbox_capability_mask() & (1u64 << number) != 0
}

/// Files hidden behind `/dev/null`: they expose host memory, kernel
/// addresses, other tenants' keys and timers, or let a write reach the
/// whole host (`sysrq-trigger`).
pub const MASKED_FILES: &[&str] = &[
    "/proc/kcore",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/kpagecgroup",
    "/proc/sysrq-trigger",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/keys",
    "/proc/key-users",
    "/proc/latency_stats",
];

/// Directories hidden behind an empty read-only tmpfs: host hardware,
/// firmware, debug and security interfaces, and the host's cgroup tree.
pub const MASKED_DIRS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/scsi",
    "/proc/driver",
    "/sys/firmware",
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
    "/sys/kernel/security",
    "/sys/kernel/config",
    "/sys/fs/cgroup",
    "/sys/fs/bpf",
    "/sys/fs/fuse/connections",
    "/sys/devices/virtual/powercap",
];

/// Kernel interfaces the sandbox may read but never write: bound onto
/// themselves read-only.
pub const READ_ONLY_PATHS: &[&str] = &["/proc/sys", "/proc/bus", "/proc/fs", "/proc/irq"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_set_is_dockers_default_without_net_raw() {
        assert_eq!(SANDBOX_CAPABILITIES.len(), 13);
        for dangerous in [
            Capability::NetRaw,
            Capability::SysAdmin,
            Capability::SysPtrace,
            Capability::SysModule,
            Capability::NetAdmin,
            Capability::DacReadSearch,
            Capability::Bpf,
        ] {
            assert!(!sandbox_keeps(dangerous.number()), "{dangerous:?} must be dropped");
        }
        assert!(sandbox_keeps(Capability::Chown.number()));
        assert!(sandbox_keeps(Capability::AuditWrite.number()));
        assert!(!sandbox_keeps(Capability::CheckpointRestore.number() + 1), "unknown capabilities are dropped");
        assert!(!sandbox_keeps(200));
        assert_eq!(sandbox_capability_mask().count_ones() as usize, SANDBOX_CAPABILITIES.len());
    }

    #[test]
    fn mask_paths_are_absolute_kernel_paths_without_duplicates() {
        let all: Vec<&str> = MASKED_FILES.iter().chain(MASKED_DIRS).chain(READ_ONLY_PATHS).copied().collect();
        for p in &all {
            assert!(p.starts_with("/proc/") || p.starts_with("/sys/"), "{p} is not under /proc or /sys");
            assert!(!p.contains(".."), "{p} must not climb");
        }
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len(), "a path is listed twice");
    }
}

//! The counters of the limits a VM's sandbox ran into, for the node's
//! `limit_hit` events: from outside, the node sees only QEMU. The guest
//! kernel's OOM kills (`/proc/vmstat`), the forks its pids cgroup refused
//! (`pids.events` of the microVM's `sandbox` cgroup, or of the full VM's
//! agent unit: a descriptor kept from boot, since neither is in the
//! sandbox's view), and the writable disk's free space (the descriptor
//! `pack` keeps of its upper directory).

use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::OnceLock;

use rustix::fs::{Mode, OFlags};
use warren_init::proto::LimitCounters;

/// The directory of the cgroup that holds the sandbox's pids limit.
static PIDS_CGROUP: OnceLock<OwnedFd> = OnceLock::new();

/// Keeps the cgroup directory at `path` (at boot, while it is in reach).
pub(crate) fn keep_pids_cgroup(path: &str) {
    match rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => {
            let _ = PIDS_CGROUP.set(fd);
        }
        Err(e) => eprintln!("warren-init: cannot keep the pids cgroup {path}: {e} (no pids limit_hit events)"),
    }
}

/// A full VM's agent service: its own cgroup (cgroup2, where systemd's
/// `TasksMax` is the unit's `pids.max`).
pub(crate) fn keep_own_cgroup() {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    match own.lines().find_map(|l| l.strip_prefix("0::")) {
        Some(path) => keep_pids_cgroup(&format!("/sys/fs/cgroup{}", path.trim())),
        None => eprintln!("warren-init: no cgroup2 path in /proc/self/cgroup (no pids limit_hit events)"),
    }
}

/// What [`warren_init::proto::Request::Limits`] answers.
pub(crate) fn counters() -> Result<LimitCounters, String> {
    let oom_kills = super::oom_kills().ok_or("not a VM's init: the node reads a container's counters itself")?;
    let mut counters = LimitCounters { oom_kills, pids_max_hits: pids_max_hits(), ..LimitCounters::default() };
    if let Some(upper) = crate::pack::upper() {
        let fs = rustix::fs::fstatvfs(upper).map_err(|e| format!("statvfs of the writable disk: {e}"))?;
        // Available, not free: ext4 keeps clusters back for its own
        // metadata, so a full disk's free count never reaches 0.
        counters.disk_free_bytes = fs.f_bavail.saturating_mul(fs.f_frsize);
        counters.disk_total_bytes = fs.f_blocks.saturating_mul(fs.f_frsize);
        counters.inodes_free = fs.f_ffree;
        counters.inodes_total = fs.f_files;
    }
    Ok(counters)
}

/// The `max` line of `pids.events`; 0 without the cgroup.
fn pids_max_hits() -> u64 {
    let Some(dir) = PIDS_CGROUP.get() else { return 0 };
    let Ok(fd) = rustix::fs::openat(dir, c"pids.events", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()) else {
        return 0;
    };
    let mut text = String::new();
    let _ = std::fs::File::from(fd).read_to_string(&mut text);
    warren_guard::cgroup::counter(&text, "max").unwrap_or(0)
}

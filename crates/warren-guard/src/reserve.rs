//! What a node keeps back from its sandboxes so that none of them, nor all
//! of them together, can starve the node agent.
//!
//! Every sandbox is bounded by its own cgroups; this adds the bound on their
//! sum. The instance's parent directories (`<controller>/<instance>`, the
//! parents of every sandbox cgroup) get a memory limit (with memsw) of the
//! host's memory minus a reserve, and a pids limit of the host's pid space
//! minus a reserve. The agent itself stays outside them and is the global
//! OOM killer's last choice (`oom_score_adj` -999, one above the kernel's
//! "never"); its CPU is protected by the CFS weights: the instance directory
//! holds every sandbox and has one group's weight, the agent is a task of
//! its own group.

use std::fs;
use std::path::{Path, PathBuf};

use crate::cgroup::{CgroupError, Result, DEFAULT_ROOT};

/// The agent's `oom_score_adj`: below every sandbox process (their PID 1s
/// run at -998, their commands at 0), but not -1000, so a runaway agent can
/// still be killed rather than take the host down.
pub const AGENT_OOM_SCORE_ADJ: i32 = -999;

/// How much of the host the sandboxes of one instance may use together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeReserve {
    /// Memory the sandboxes together never get.
    pub memory_bytes: u64,
    /// Pids the sandboxes together never get.
    pub pids: u64,
}

impl NodeReserve {
    /// A tenth of the host's memory (at least 256 MiB, at most 2 GiB) and
    /// of its pid space (at least 1024).
    pub fn default_for(host: &HostTotals) -> Self {
        const MIB: u64 = 1 << 20;
        NodeReserve {
            memory_bytes: (host.memory_bytes / 10).clamp(256 * MIB, 2048 * MIB),
            pids: (host.pid_max / 10).max(1024),
        }
    }
}

/// The host's totals the reserve is taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTotals {
    pub memory_bytes: u64,
    pub pid_max: u64,
}

impl HostTotals {
    /// `MemTotal` of `/proc/meminfo` and `/proc/sys/kernel/pid_max`.
    pub fn read() -> Result<Self> {
        let meminfo = read("/proc/meminfo")?;
        let memory_kib = meminfo
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .ok_or_else(|| CgroupError::Parse { path: "/proc/meminfo".into(), content: "no MemTotal".into() })?;
        let pid_max_text = read("/proc/sys/kernel/pid_max")?;
        let pid_max = pid_max_text
            .trim()
            .parse()
            .map_err(|_| CgroupError::Parse { path: "/proc/sys/kernel/pid_max".into(), content: pid_max_text })?;
        Ok(HostTotals { memory_bytes: memory_kib * 1024, pid_max })
    }
}

/// The limits written on the instance's parent cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstanceLimits {
    pub memory_bytes: u64,
    pub pids: u64,
}

/// Makes the instance's parent directories and caps what all its sandboxes
/// may use together at `host` minus `reserve`. Idempotent (a restarted
/// server rewrites the same values). The directories are removed with the
/// instance's sandboxes' (see `SandboxCgroup::remove_instance`).
pub fn cap_instance(instance: &str, host: &HostTotals, reserve: &NodeReserve) -> Result<InstanceLimits> {
    cap_instance_under(Path::new(DEFAULT_ROOT), instance, host, reserve)
}

pub fn cap_instance_under(
    root: &Path,
    instance: &str,
    host: &HostTotals,
    reserve: &NodeReserve,
) -> Result<InstanceLimits> {
    if instance.is_empty() || instance.contains('/') || instance == "." || instance == ".." {
        return Err(CgroupError::InvalidName(instance.to_string()));
    }
    let limits = InstanceLimits {
        memory_bytes: host.memory_bytes.saturating_sub(reserve.memory_bytes).max(1 << 20),
        pids: host.pid_max.saturating_sub(reserve.pids).max(1),
    };
    let memory = root.join("memory").join(instance);
    let pids = root.join("pids").join(instance);
    for dir in [&memory, &pids] {
        fs::create_dir_all(dir).map_err(|e| io_err("mkdir", dir, e))?;
    }
    // memsw may not go below the memory limit: on a lowered limit memory
    // goes first, on a raised one memsw does. Either order works from
    // "unlimited", which is what a new directory has.
    let bytes = limits.memory_bytes.to_string();
    let memsw = memory.join("memory.memsw.limit_in_bytes");
    let limit = memory.join("memory.limit_in_bytes");
    if write(&limit, &bytes).is_err() {
        write(&memsw, &bytes)?;
        write(&limit, &bytes)?;
    } else {
        write(&memsw, &bytes)?;
    }
    write(&pids.join("pids.max"), &limits.pids.to_string())?;
    Ok(limits)
}

/// Makes the calling process the global OOM killer's last choice (see
/// [`AGENT_OOM_SCORE_ADJ`]). Processes it starts inherit the value; the
/// container driver raises it for each sandbox's PID 1. Lowering a score
/// needs `CAP_SYS_RESOURCE`, which root in some containers lacks: then
/// nothing changes and the answer is `false`.
pub fn protect_agent_from_oom_killer() -> Result<bool> {
    let path = Path::new("/proc/self/oom_score_adj");
    match fs::write(path, AGENT_OOM_SCORE_ADJ.to_string()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(false),
        Err(e) => Err(io_err("write", path, e)),
    }
}

fn read(path: &str) -> Result<String> {
    fs::read_to_string(path).map_err(|e| io_err("read", Path::new(path), e))
}

fn write(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|e| io_err("write", path, e))
}

fn io_err(op: &'static str, path: &Path, source: std::io::Error) -> CgroupError {
    CgroupError::Io { op, path: PathBuf::from(path), source }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn the_default_reserve_is_a_tenth_within_bounds() {
        let small = HostTotals { memory_bytes: GIB, pid_max: 4096 };
        assert_eq!(NodeReserve::default_for(&small), NodeReserve { memory_bytes: 256 << 20, pids: 1024 });
        let big = HostTotals { memory_bytes: 64 * GIB, pid_max: 4_194_304 };
        assert_eq!(NodeReserve::default_for(&big), NodeReserve { memory_bytes: 2 * GIB, pids: 419_430 });
        let mid = HostTotals { memory_bytes: 10 * GIB, pid_max: 100_000 };
        assert_eq!(NodeReserve::default_for(&mid).memory_bytes, GIB);
    }

    #[test]
    fn the_host_totals_are_read() {
        let host = HostTotals::read().unwrap();
        assert!(host.memory_bytes > 64 << 20, "{host:?}");
        assert!(host.pid_max >= 301, "{host:?}");
    }

    /// Needs root and the v1 memory and pids hierarchies (CI has both).
    #[test]
    fn an_instance_is_capped_at_the_host_minus_the_reserve() {
        let instance = format!("reserve-test-{}", std::process::id());
        let host = HostTotals::read().unwrap();
        let reserve = NodeReserve { memory_bytes: GIB, pids: 5000 };
        let limits = cap_instance(&instance, &host, &reserve).unwrap();
        // Twice: a restarted server writes the same limits again.
        assert_eq!(cap_instance(&instance, &host, &reserve).unwrap(), limits);
        let root = Path::new(DEFAULT_ROOT);
        let read_u64 = |p: PathBuf| fs::read_to_string(&p).unwrap().trim().parse::<u64>().unwrap();
        let memory = read_u64(root.join("memory").join(&instance).join("memory.limit_in_bytes"));
        let memsw = read_u64(root.join("memory").join(&instance).join("memory.memsw.limit_in_bytes"));
        let pids = read_u64(root.join("pids").join(&instance).join("pids.max"));
        // The kernel rounds the memory limit down to whole pages.
        assert_eq!(memory, (host.memory_bytes - GIB) / 4096 * 4096);
        assert_eq!(memsw, memory);
        assert_eq!(pids, host.pid_max - 5000);
        for controller in ["memory", "pids"] {
            fs::remove_dir(root.join(controller).join(&instance)).unwrap();
        }
    }

    #[test]
    fn an_instance_name_with_a_slash_is_refused() {
        let host = HostTotals { memory_bytes: GIB, pid_max: 4096 };
        let reserve = NodeReserve::default_for(&host);
        assert!(matches!(cap_instance("../x", &host, &reserve), Err(CgroupError::InvalidName(_))));
    }
}

//! What the host tells us: the machine, its free memory, how busy its CPUs
//! were, a process's CPU time and RSS, and the versions of the tools.

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::error::{BenchError, Result};

/// Where the v1 memory controller is mounted on this host.
pub const MEMORY_CGROUP_ROOT: &str = "/sys/fs/cgroup/memory";

#[derive(Debug, Clone)]
pub struct Machine {
    pub cpu_model: String,
    pub nproc: usize,
    pub kernel: String,
    pub mem_total_bytes: u64,
}

pub fn machine() -> Machine {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| "unknown".into());
    let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
    let kernel =
        fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(|_| "unknown".into(), |s| s.trim().into());
    let meminfo = fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_total_bytes = meminfo_bytes(&meminfo, "MemTotal").unwrap_or(0);
    Machine { cpu_model, nproc, kernel, mem_total_bytes }
}

/// The 1-minute load average (runnable tasks, averaged), 0 when unreadable.
pub fn loadavg1() -> f64 {
    fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0.0)
}

/// The three load averages, as `/proc/loadavg` prints them.
pub fn loadavg() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// A `/proc/meminfo` field (given in kB there) in bytes.
pub fn meminfo_bytes(meminfo: &str, field: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name != field {
            return None;
        }
        let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    })
}

/// Host memory figures at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemSnapshot {
    pub available: u64,
    /// SUnreclaim + KernelStack + PageTables + Percpu: kernel memory that
    /// namespaces, mounts and processes pin, and that another process's page
    /// cache or heap does not move.
    pub kernel_pinned: u64,
}

pub fn parse_mem_snapshot(meminfo: &str) -> Option<MemSnapshot> {
    let field = |name| meminfo_bytes(meminfo, name).unwrap_or(0);
    Some(MemSnapshot {
        available: meminfo_bytes(meminfo, "MemAvailable")?,
        kernel_pinned: field("SUnreclaim") + field("KernelStack") + field("PageTables") + field("Percpu"),
    })
}

fn mem_snapshot_now() -> Result<MemSnapshot> {
    let text = fs::read_to_string("/proc/meminfo").map_err(|e| BenchError::io("read", "/proc/meminfo", e))?;
    parse_mem_snapshot(&text).ok_or_else(|| BenchError::parse("/proc/meminfo", "no MemAvailable"))
}

/// The median (by MemAvailable) of three readings 200 ms apart, so one
/// reading taken while the kernel frees or another process allocates does
/// not become the figure.
pub fn settled_mem_snapshot() -> Result<MemSnapshot> {
    let mut readings = Vec::with_capacity(3);
    for i in 0..3 {
        if i > 0 {
            std::thread::sleep(Duration::from_millis(200));
        }
        readings.push(mem_snapshot_now()?);
    }
    readings.sort_unstable_by_key(|m| m.available);
    Ok(readings[1])
}

/// Host CPU counters at one instant.
#[derive(Debug, Clone, Copy)]
pub struct CpuSnapshot {
    busy_ticks: u64,
    at: Instant,
    load: f64,
}

/// CPU time all of the host's CPUs spent busy over a stretch of wall time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CpuUse {
    pub busy: Duration,
    pub wall: Duration,
    /// 1-minute load average when the stretch began: how much else wanted the CPUs.
    pub load_at_start: f64,
}

/// Busy ticks from the `cpu` line of `/proc/stat`: everything but idle and iowait.
pub fn parse_busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line.split_whitespace().skip(1).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]; guest time is already in user.
    let at = |i: usize| fields.get(i).copied().unwrap_or(0);
    Some(at(0) + at(1) + at(2) + at(5) + at(6) + at(7))
}

fn ticks_to_duration(ticks: u64) -> Duration {
    let hz = rustix::param::clock_ticks_per_second().max(1);
    Duration::from_micros(ticks.saturating_mul(1_000_000) / hz)
}

impl CpuSnapshot {
    pub fn now() -> Result<Self> {
        let stat = fs::read_to_string("/proc/stat").map_err(|e| BenchError::io("read", "/proc/stat", e))?;
        let busy_ticks = parse_busy_ticks(&stat).ok_or_else(|| BenchError::parse("/proc/stat", "no cpu line"))?;
        Ok(CpuSnapshot { busy_ticks, at: Instant::now(), load: loadavg1() })
    }

    pub fn since(&self) -> Result<CpuUse> {
        let now = CpuSnapshot::now()?;
        Ok(CpuUse {
            busy: ticks_to_duration(now.busy_ticks.saturating_sub(self.busy_ticks)),
            wall: now.at - self.at,
            load_at_start: self.load,
        })
    }
}

impl CpuUse {
    /// Adds a later stretch: busy and wall time add up, the first start's load stays.
    pub fn add(&mut self, later: &CpuUse) {
        self.busy += later.busy;
        self.wall += later.wall;
    }
    /// Busy share of all CPUs, 0-100.
    pub fn percent_of_host(&self, nproc: usize) -> f64 {
        let capacity = self.wall.as_secs_f64() * nproc.max(1) as f64;
        if capacity <= 0.0 {
            return 0.0;
        }
        100.0 * self.busy.as_secs_f64() / capacity
    }

    pub fn per_op(&self, ops: usize) -> Option<Duration> {
        u32::try_from(ops).ok().filter(|n| *n > 0).map(|n| self.busy / n)
    }
}

/// utime + stime + cutime + cstime of a process (its own and its reaped children's CPU).
pub fn parse_process_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name may hold spaces and parentheses; fields resume after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14.
    (11..=14).map(|i| fields.get(i)?.parse::<u64>().ok()).sum()
}

pub fn process_cpu(pid: u32) -> Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let text = fs::read_to_string(&path).map_err(|e| BenchError::io("read", &path, e))?;
    parse_process_cpu_ticks(&text).map(ticks_to_duration).ok_or_else(|| BenchError::parse(path, "short stat line"))
}

pub fn process_rss_bytes(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = fs::read_to_string(&path).map_err(|e| BenchError::io("read", &path, e))?;
    meminfo_bytes(&text, "VmRSS").ok_or_else(|| BenchError::parse(path, "no VmRSS"))
}

/// `memory.usage_in_bytes` of a v1 memory cgroup (hierarchical on this kernel).
pub fn cgroup_memory_usage(dir: &Path) -> Option<u64> {
    fs::read_to_string(dir.join("memory.usage_in_bytes")).ok()?.trim().parse().ok()
}

/// The memory cgroup of a process as a host path, from `/proc/<pid>/cgroup`.
pub fn memory_cgroup_of(pid: u32) -> Option<std::path::PathBuf> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then(|| Path::new(MEMORY_CGROUP_ROOT).join(path.trim_start_matches('/')))
    })
}

/// The first line a tool prints about its version, or why there is none.
pub fn tool_version(program: &str, args: &[&str]) -> String {
    match Command::new(program).args(args).output() {
        Ok(out) => {
            let text = if out.stdout.is_empty() { out.stderr } else { out.stdout };
            String::from_utf8_lossy(&text).lines().next().unwrap_or("").trim().to_string()
        }
        Err(e) => format!("not available ({e})"),
    }
}

pub fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Alive and not a zombie.
pub fn pid_running(pid: u32) -> bool {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next()).is_some_and(|state| state != "Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_bytes() {
        let text = "MemTotal:       24567890 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(meminfo_bytes(text, "MemAvailable"), Some(2048 * 1024));
        assert_eq!(meminfo_bytes(text, "MemFree"), Some(100 * 1024));
        assert_eq!(meminfo_bytes(text, "Mem"), None);
        let full = "MemAvailable: 10 kB\nSUnreclaim: 1 kB\nKernelStack: 2 kB\nPageTables: 3 kB\nPercpu: 4 kB\n";
        assert_eq!(parse_mem_snapshot(full), Some(MemSnapshot { available: 10240, kernel_pinned: 10240 }));
        assert_eq!(parse_mem_snapshot("MemFree: 1 kB\n"), None);
    }

    #[test]
    fn busy_ticks_exclude_idle_and_iowait() {
        let stat = "cpu  10 1 5 1000 50 2 3 4 7 0\ncpu0 5 0 2 500 25 1 1 2 0 0\n";
        assert_eq!(parse_busy_ticks(stat), Some(10 + 1 + 5 + 2 + 3 + 4));
        assert_eq!(parse_busy_ticks("intr 1 2\n"), None);
    }

    #[test]
    fn process_cpu_survives_odd_command_names() {
        let stat = "42 (we ird) name)) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 2 1 20 0 1 0 100 0 0";
        assert_eq!(parse_process_cpu_ticks(stat), Some(7 + 3 + 2 + 1));
    }

    #[test]
    fn cpu_use_scales_to_host_and_ops() {
        let u = CpuUse { busy: Duration::from_secs(1), wall: Duration::from_secs(1), load_at_start: 0.0 };
        assert!((u.percent_of_host(2) - 50.0).abs() < 1e-9);
        assert_eq!(u.per_op(4), Some(Duration::from_millis(250)));
        assert_eq!(u.per_op(0), None);
    }

    #[test]
    fn this_process_has_a_memory_cgroup_and_readable_counters() {
        let pid = std::process::id();
        assert!(process_rss_bytes(pid).unwrap() > 0);
        assert!(process_cpu(pid).is_ok());
        assert!(memory_cgroup_of(pid).is_some_and(|p| p.starts_with(MEMORY_CGROUP_ROOT)));
        let m = settled_mem_snapshot().unwrap();
        assert!(m.available > 0 && m.kernel_pinned > 0);
    }
}

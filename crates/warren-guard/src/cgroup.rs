//! The cgroups that bound one sandbox: `<instance>/<id>` in the v1
//! hierarchies this host has (cpu, cpuacct, memory, pids, freezer) plus a
//! cgroup2 directory under the `unified` mount that later carries eBPF
//! programs.
//!
//! Host facts this relies on (kernel 6.18, hybrid layout):
//! - `memory.use_hierarchy` is always 1 and cannot be cleared, so a child's
//!   usage counts in its parents and nothing has to be set for it.
//! - `memory.memsw.*` exists (swap accounting is on); setting it equal to the
//!   memory limit closes the swap escape.
//! - v1 tasks in a FROZEN freezer do not act on SIGKILL until thawed, hence
//!   freeze, kill, thaw in [`SandboxCgroup::kill_all`].
//! - Writing a pid to `cgroup.procs` (v1 or v2) takes the kernel's global
//!   `cgroup_threadgroup_rwsem` for writing, which waits for an RCU grace
//!   period: 5-20 ms per sandbox measured here. Two ways in skip it, and
//!   [`SandboxCgroup::spawn_target`] serves both: a single-threaded process
//!   writing `0` (itself) to a v1 `tasks` file, and a child made by
//!   `clone3(CLONE_INTO_CGROUP)` for the cgroup2 directory.

use std::fs;
use std::io::{self, ErrorKind};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

/// The v1 hierarchies a sandbox gets a directory in.
pub const V1_CONTROLLERS: [&str; 5] = ["cpu", "cpuacct", "memory", "pids", "freezer"];
/// The cgroup2 mount (below [`DEFAULT_ROOT`]) on this hybrid host.
pub const UNIFIED: &str = "unified";

/// The number after `key` in a kernel counter file of `key value` lines
/// (`memory.oom_control`, `pids.events`, `/proc/vmstat`).
pub fn counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| line.strip_prefix(key)?.strip_prefix(' ')).and_then(|n| n.trim().parse().ok())
}
/// Where the hierarchies are mounted.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup";

const CFS_PERIOD_US: u64 = 100_000;
/// The kernel rejects quotas below 1 ms.
const MIN_CFS_QUOTA_US: u64 = 1_000;
const POLL_INTERVAL: Duration = Duration::from_millis(1);

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("invalid cgroup name {0:?}: must be non-empty, without '/', not '.' or '..'")]
    InvalidName(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: cannot parse {content:?}")]
    Parse { path: PathBuf, content: String },
    #[error("{path}: still holds processes {pids:?} after {waited:?}")]
    NotEmpty { path: PathBuf, pids: Vec<i32>, waited: Duration },
    #[error("{path}: did not reach FROZEN within {waited:?}")]
    FreezeTimeout { path: PathBuf, waited: Duration },
}

pub type Result<T, E = CgroupError> = std::result::Result<T, E>;

/// The limits written at creation.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub memory_bytes: u64,
    /// CPU cores, enforced as a CFS quota per 100 ms period.
    pub cpus: f64,
    /// Maximum number of processes and threads.
    pub pids: u32,
}

/// Counters read from the cgroup.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupUsage {
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub cpu_time_ns: u64,
    pub pids: u64,
}

/// Descriptors that let a new process start inside a sandbox's cgroups
/// without a migration (see the module doc for why that matters).
#[derive(Debug)]
pub struct SpawnTarget {
    /// `tasks` of every v1 hierarchy, open for writing: the new process,
    /// still single-threaded, writes `0` to each to move itself in.
    pub v1_tasks: Vec<OwnedFd>,
    /// The cgroup2 directory, for `clone3`'s `CLONE_INTO_CGROUP`.
    pub unified_dir: OwnedFd,
}

/// The cgroup directories of one sandbox. Creating the value touches
/// nothing; [`SandboxCgroup::create`] makes the directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxCgroup {
    root: PathBuf,
    instance: String,
    id: String,
}

impl SandboxCgroup {
    pub fn new(instance: &str, id: &str) -> Result<Self> {
        Self::with_root(Path::new(DEFAULT_ROOT), instance, id)
    }

    /// Like [`SandboxCgroup::new`] with the hierarchies mounted under `root`.
    pub fn with_root(root: &Path, instance: &str, id: &str) -> Result<Self> {
        check_name(instance)?;
        check_name(id)?;
        Ok(SandboxCgroup { root: root.to_path_buf(), instance: instance.to_string(), id: id.to_string() })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// The sandbox's directory in `hierarchy` (a v1 controller or [`UNIFIED`]).
    pub fn path(&self, hierarchy: &str) -> PathBuf {
        self.root.join(hierarchy).join(&self.instance).join(&self.id)
    }

    fn hierarchies() -> impl Iterator<Item = &'static str> {
        V1_CONTROLLERS.into_iter().chain([UNIFIED])
    }

    /// Makes every directory (parents included) and writes the limits. A
    /// directory that exists already is reused, so a retried create works.
    pub fn create(&self, limits: &Limits) -> Result<()> {
        let mut reused = false;
        for hierarchy in Self::hierarchies() {
            reused |= make_dir(&self.path(hierarchy))?;
        }
        self.limit_memory(limits.memory_bytes)?;
        self.limit_cpu(limits.cpus, reused)?;
        write_file(&self.path("pids").join("pids.max"), &limits.pids.to_string())
    }

    fn limit_memory(&self, bytes: u64) -> Result<()> {
        let dir = self.path("memory");
        // memsw must never be below the memory limit; both start unlimited,
        // so the memory limit goes first.
        write_file(&dir.join("memory.limit_in_bytes"), &bytes.to_string())?;
        write_file(&dir.join("memory.memsw.limit_in_bytes"), &bytes.to_string())?;
        // Not every kernel lets a non-root cgroup set swappiness; with memsw
        // equal to the limit there is no swap to escape to anyway.
        let _ = write_file(&dir.join("memory.swappiness"), "0");
        Ok(())
    }

    /// A new cgroup starts with the kernel's 100 ms period; only a reused
    /// one (a retried create) may carry another, against which the quota
    /// would mean something else.
    fn limit_cpu(&self, cpus: f64, reused: bool) -> Result<()> {
        let dir = self.path("cpu");
        let quota = ((cpus * CFS_PERIOD_US as f64).round() as u64).max(MIN_CFS_QUOTA_US);
        if reused {
            write_file(&dir.join("cpu.cfs_period_us"), &CFS_PERIOD_US.to_string())?;
        }
        write_file(&dir.join("cpu.cfs_quota_us"), &quota.to_string())
    }

    /// Opens what a new process needs to be born inside every hierarchy
    /// (see [`SpawnTarget`]). The directories must exist.
    pub fn spawn_target(&self) -> Result<SpawnTarget> {
        let mut v1_tasks = Vec::with_capacity(V1_CONTROLLERS.len());
        for controller in V1_CONTROLLERS {
            let path = self.path(controller).join("tasks");
            let file = fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(|e| io_err("open", &path, e))?;
            v1_tasks.push(OwnedFd::from(file));
        }
        let dir = self.path(UNIFIED);
        let unified = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&dir)
            .map_err(|e| io_err("open", &dir, e))?;
        Ok(SpawnTarget { v1_tasks, unified_dir: OwnedFd::from(unified) })
    }

    /// Moves `pid` (a whole process) into every hierarchy. Costs an RCU
    /// grace period (see the module doc): a process that is still to be
    /// started should be born inside with [`SandboxCgroup::spawn_target`].
    pub fn add_pid(&self, pid: i32) -> Result<()> {
        for hierarchy in Self::hierarchies() {
            write_file(&self.path(hierarchy).join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    pub fn usage(&self) -> Result<CgroupUsage> {
        let memory = self.path("memory");
        Ok(CgroupUsage {
            memory_bytes: read_u64(&memory.join("memory.usage_in_bytes"))?,
            memory_peak_bytes: read_u64(&memory.join("memory.max_usage_in_bytes"))?,
            cpu_time_ns: self.cpu_time_ns()?,
            pids: read_u64(&self.path("pids").join("pids.current"))?,
        })
    }

    /// CPU time used by the cgroup's processes, in all.
    pub fn cpu_time_ns(&self) -> Result<u64> {
        read_u64(&self.path("cpuacct").join("cpuacct.usage"))
    }

    /// How many processes the out-of-memory killer has killed in this cgroup.
    pub fn oom_kills(&self) -> Result<u64> {
        let path = self.path("memory").join("memory.oom_control");
        let text = read_file(&path)?;
        counter(&text, "oom_kill").ok_or(CgroupError::Parse { path, content: text })
    }

    /// How many forks the pids limit refused (`max` of v1 `pids.events`).
    pub fn pids_max_hits(&self) -> Result<u64> {
        let path = self.path("pids").join("pids.events");
        let text = read_file(&path)?;
        counter(&text, "max").ok_or(CgroupError::Parse { path, content: text })
    }

    /// The pids in `hierarchy`'s `cgroup.procs`; empty when the directory
    /// does not exist.
    pub fn pids(&self, hierarchy: &str) -> Result<Vec<i32>> {
        let path = self.path(hierarchy).join("cgroup.procs");
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("read", &path, e)),
        };
        text.lines()
            .map(|line| {
                line.trim().parse().map_err(|_| CgroupError::Parse { path: path.clone(), content: text.clone() })
            })
            .collect()
    }

    /// Kills every process in every hierarchy and waits, at most `timeout`,
    /// until none is left. Freezing first means no process can fork a
    /// survivor between reading `cgroup.procs` and the kill.
    pub fn kill_all(&self, timeout: Duration) -> Result<()> {
        // Usually PID 1's end has emptied the sandbox already, and an empty
        // cgroup cannot gain a process from inside: no freeze needed.
        if self.is_empty()? {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        let frozen = self.freeze(deadline)?;
        let killed = self.signal_all();
        if frozen {
            self.thaw()?;
        }
        killed?;
        self.wait_empty(deadline, timeout)
    }

    /// Freezes every process of the sandbox until the returned guard drops,
    /// so a snapshot sees one consistent moment of its files.
    pub fn frozen(&self, timeout: Duration) -> Result<Frozen<'_>> {
        let frozen = self.freeze(Instant::now() + timeout)?;
        Ok(Frozen { cgroup: self, frozen })
    }

    /// Freezes every process of the sandbox until [`SandboxCgroup::resume`]
    /// (pause): frozen tasks are not scheduled and cannot act on signals,
    /// so nothing in the sandbox makes progress. Waits, at most `timeout`,
    /// until the kernel reports the whole cgroup FROZEN.
    pub fn pause(&self, timeout: Duration) -> Result<()> {
        match self.freeze(Instant::now() + timeout)? {
            true => Ok(()),
            false => Err(io_err("freeze", &self.path("freezer"), io::Error::from(ErrorKind::NotFound))),
        }
    }

    /// Thaws a paused sandbox. A missing freezer directory (the sandbox is
    /// gone) is not an error: there is nothing left to thaw.
    pub fn resume(&self) -> Result<()> {
        match fs::write(self.path("freezer").join("freezer.state"), "THAWED") {
            Err(e) if e.kind() != ErrorKind::NotFound => {
                Err(io_err("write", &self.path("freezer").join("freezer.state"), e))
            }
            _ => Ok(()),
        }
    }

    /// True while the sandbox is frozen or freezing (self or a parent).
    pub fn is_frozen(&self) -> bool {
        read_file(&self.path("freezer").join("freezer.state")).is_ok_and(|s| s.trim() != "THAWED")
    }

    /// Returns false when there is no freezer directory (a half-made sandbox).
    fn freeze(&self, deadline: Instant) -> Result<bool> {
        let state = self.path("freezer").join("freezer.state");
        match fs::write(&state, "FROZEN") {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err("write", &state, e)),
        }
        let started = Instant::now();
        while read_file(&state)?.trim() != "FROZEN" {
            if Instant::now() >= deadline {
                // Leave it usable for a retry rather than stuck half-frozen.
                let _ = self.thaw();
                return Err(CgroupError::FreezeTimeout { path: state, waited: started.elapsed() });
            }
            thread::sleep(POLL_INTERVAL);
        }
        Ok(true)
    }

    fn thaw(&self) -> Result<()> {
        write_file(&self.path("freezer").join("freezer.state"), "THAWED")
    }

    fn signal_all(&self) -> Result<()> {
        for hierarchy in Self::hierarchies() {
            for pid in self.pids(hierarchy)? {
                // SAFETY: kill(2) has no memory effects; the pid comes from
                // the cgroup, which only holds this sandbox's processes. ESRCH
                // (already gone) is fine and ignored.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        Ok(())
    }

    /// True when no hierarchy holds a process (or none exists).
    fn is_empty(&self) -> Result<bool> {
        for hierarchy in Self::hierarchies() {
            if !self.pids(hierarchy)?.is_empty() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn wait_empty(&self, deadline: Instant, timeout: Duration) -> Result<()> {
        loop {
            let mut left = None;
            for hierarchy in Self::hierarchies() {
                let pids = self.pids(hierarchy)?;
                if !pids.is_empty() {
                    left = Some((self.path(hierarchy), pids));
                    break;
                }
            }
            let Some((path, pids)) = left else { return Ok(()) };
            if Instant::now() >= deadline {
                return Err(CgroupError::NotEmpty { path, pids, waited: timeout });
            }
            // A process that got SIGKILL in a frozen cgroup may need another
            // nudge if it was mid-fork when frozen.
            self.signal_all()?;
            thread::sleep(POLL_INTERVAL);
        }
    }

    /// Removes every directory. Idempotent: a missing directory is fine.
    /// Fails (naming the directory) while processes remain.
    pub fn remove(&self) -> Result<()> {
        let mut first_err = None;
        for hierarchy in Self::hierarchies() {
            let dir = self.path(hierarchy);
            match fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                // Keep going: the other hierarchies should not leak because one is busy.
                Err(e) => first_err = first_err.or(Some(io_err("rmdir", &dir, e))),
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The ids that have a directory in any hierarchy of `instance`.
    pub fn list(instance: &str) -> Result<Vec<String>> {
        Self::list_under(Path::new(DEFAULT_ROOT), instance)
    }

    pub fn list_under(root: &Path, instance: &str) -> Result<Vec<String>> {
        check_name(instance)?;
        let mut ids = Vec::new();
        for hierarchy in Self::hierarchies() {
            let dir = root.join(hierarchy).join(instance);
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("readdir", &dir, e)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io_err("readdir", &dir, e))?;
                let is_dir = entry.file_type().map_err(|e| io_err("stat", &entry.path(), e))?.is_dir();
                if let (true, Some(name)) = (is_dir, entry.file_name().to_str()) {
                    if !ids.iter().any(|id| id == name) {
                        ids.push(name.to_string());
                    }
                }
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Removes the `instance` directories themselves where they are empty;
    /// one that still holds a sandbox stays.
    pub fn remove_instance(instance: &str) -> Result<()> {
        check_name(instance)?;
        for hierarchy in Self::hierarchies() {
            let dir = Path::new(DEFAULT_ROOT).join(hierarchy).join(instance);
            match fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::DirectoryNotEmpty) => {}
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(io_err("rmdir", &dir, e)),
            }
        }
        Ok(())
    }
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.contains('\0') {
        return Err(CgroupError::InvalidName(name.to_string()));
    }
    Ok(())
}

/// Makes `dir` (and its parents); true when it existed already.
fn make_dir(dir: &Path) -> Result<bool> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(false),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(true),
        // The instance directory is missing: the first sandbox of a server.
        Err(e) if e.kind() == ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(|e| io_err("mkdir", dir, e))?;
            Ok(false)
        }
        Err(e) => Err(io_err("mkdir", dir, e)),
    }
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> CgroupError {
    CgroupError::Io { op, path: path.to_path_buf(), source }
}

fn write_file(path: &Path, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|e| io_err("write", path, e))
}

fn read_file(path: &Path) -> Result<String> {
    fs::read_to_string(path).map_err(|e| io_err("read", path, e))
}

fn read_u64(path: &Path) -> Result<u64> {
    let text = read_file(path)?;
    text.trim().parse().map_err(|_| CgroupError::Parse { path: path.to_path_buf(), content: text })
}

/// A frozen sandbox; dropping it thaws the sandbox again.
pub struct Frozen<'a> {
    cgroup: &'a SandboxCgroup,
    frozen: bool,
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if self.frozen {
            if let Err(e) = self.cgroup.thaw() {
                // Nothing better to do from a destructor than to say so loudly.
                eprintln!("warren-guard: cannot thaw {}: {e}", self.cgroup.id());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_is_read_by_its_whole_key() {
        let oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(counter(oom_control, "oom_kill"), Some(3));
        assert_eq!(counter("max 12\n", "max"), Some(12));
        assert_eq!(counter("maximum 5\n", "max"), None);
        assert_eq!(counter("max lots\n", "max"), None);
    }
    use std::process::{Command, Stdio};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn unique_instance() -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        format!("wg-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    /// Removes whatever a test made, also when it fails.
    struct Cleanup(SandboxCgroup, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.0.kill_all(Duration::from_secs(5));
            let _ = self.0.remove();
            let _ = SandboxCgroup::remove_instance(&self.1);
        }
    }

    #[test]
    fn pause_holds_every_task_until_resume_and_a_paused_cgroup_can_be_killed() {
        let instance = unique_instance();
        let cg = SandboxCgroup::new(&instance, "sb").unwrap();
        let _cleanup = Cleanup(cg.clone(), instance.clone());
        cg.create(&Limits { memory_bytes: 64 << 20, cpus: 1.0, pids: 16 }).unwrap();
        let mut child = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().unwrap();
        cg.add_pid(child.id() as i32).unwrap();
        let state = |pid: u32| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            stat.rsplit(") ").next().and_then(|s| s.split(' ').next()).map(str::to_string).unwrap()
        };

        assert!(!cg.is_frozen());
        cg.pause(Duration::from_secs(5)).unwrap();
        assert!(cg.is_frozen());
        // A frozen task sleeps in the freezer, uninterruptibly.
        assert_eq!(state(child.id()), "D");
        cg.resume().unwrap();
        assert!(!cg.is_frozen());
        // Thawed, the task runs ("R") for a moment before it sleeps again.
        let thawed_by = Instant::now() + Duration::from_secs(10);
        while state(child.id()) != "S" {
            assert!(Instant::now() < thawed_by, "still {} after the thaw", state(child.id()));
            thread::sleep(POLL_INTERVAL);
        }

        // Killing a paused cgroup works (frozen tasks act on SIGKILL once thawed).
        cg.pause(Duration::from_secs(5)).unwrap();
        cg.kill_all(Duration::from_secs(5)).unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!cg.is_frozen());
        cg.remove().unwrap();
        // Resuming what is gone is not an error.
        cg.resume().unwrap();
    }

    #[test]
    fn names_with_slashes_or_dots_are_rejected() {
        assert!(SandboxCgroup::new("warren", "../x").is_err());
        assert!(SandboxCgroup::new("", "a").is_err());
        assert!(SandboxCgroup::new("warren", "..").is_err());
        assert!(SandboxCgroup::new("warren", "sb-1").is_ok());
    }

    #[test]
    fn create_writes_limits_and_kill_all_empties_it() {
        let instance = unique_instance();
        let cg = SandboxCgroup::new(&instance, "sb").unwrap();
        let _cleanup = Cleanup(cg.clone(), instance.clone());
        cg.create(&Limits { memory_bytes: 64 << 20, cpus: 0.5, pids: 16 }).unwrap();

        let read = |h: &str, f: &str| fs::read_to_string(cg.path(h).join(f)).unwrap().trim().to_string();
        assert_eq!(read("memory", "memory.limit_in_bytes"), (64u64 << 20).to_string());
        assert_eq!(read("memory", "memory.memsw.limit_in_bytes"), (64u64 << 20).to_string());
        assert_eq!(read("cpu", "cpu.cfs_quota_us"), "50000");
        assert_eq!(read("cpu", "cpu.cfs_period_us"), "100000");
        assert_eq!(read("pids", "pids.max"), "16");
        assert_eq!(SandboxCgroup::list(&instance).unwrap(), vec!["sb".to_string()]);

        let mut child = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().unwrap();
        let pid = child.id() as i32;
        cg.add_pid(pid).unwrap();
        for h in V1_CONTROLLERS.iter().copied().chain([UNIFIED]) {
            assert_eq!(cg.pids(h).unwrap(), vec![pid], "{h}");
        }
        assert_eq!(cg.usage().unwrap().pids, 1);
        assert_eq!(cg.oom_kills().unwrap(), 0);
        assert_eq!(cg.pids_max_hits().unwrap(), 0);

        cg.kill_all(Duration::from_secs(5)).unwrap();
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert_eq!(read("freezer", "freezer.state"), "THAWED");

        cg.remove().unwrap();
        cg.remove().unwrap();
        assert!(SandboxCgroup::list(&instance).unwrap().is_empty());
        for h in V1_CONTROLLERS.iter().copied().chain([UNIFIED]) {
            assert!(!cg.path(h).exists(), "{h}");
        }
    }

    #[test]
    fn a_child_writing_0_to_the_tasks_files_starts_inside_every_v1_hierarchy() {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let instance = unique_instance();
        let cg = SandboxCgroup::new(&instance, "spawned").unwrap();
        let _cleanup = Cleanup(cg.clone(), instance.clone());
        cg.create(&Limits { memory_bytes: 64 << 20, cpus: 1.0, pids: 16 }).unwrap();
        let target = cg.spawn_target().unwrap();
        let fds: Vec<i32> = target.v1_tasks.iter().map(|fd| fd.as_raw_fd()).collect();
        let mut command = Command::new("sleep");
        command.arg("1000").stdin(Stdio::null());
        // SAFETY: write(2) on inherited descriptors is async-signal-safe and
        // allocates nothing; the child is single-threaded between fork and exec.
        unsafe {
            command.pre_exec(move || {
                for &fd in &fds {
                    if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = command.spawn().unwrap();
        let pid = child.id() as i32;
        for h in V1_CONTROLLERS {
            assert_eq!(cg.pids(h).unwrap(), vec![pid], "{h}");
        }
        // The cgroup2 directory is joined at clone time (CLONE_INTO_CGROUP),
        // which this std-spawned child did not use.
        assert!(cg.pids(UNIFIED).unwrap().is_empty());
        cg.kill_all(Duration::from_secs(5)).unwrap();
        child.wait().unwrap();
        // Empty now: kill_all returns without freezing anything.
        cg.kill_all(Duration::from_secs(5)).unwrap();
        assert_eq!(fs::read_to_string(cg.path("freezer").join("freezer.state")).unwrap().trim(), "THAWED");
    }

    #[test]
    fn remove_refuses_while_processes_live() {
        let instance = unique_instance();
        let cg = SandboxCgroup::new(&instance, "busy").unwrap();
        let _cleanup = Cleanup(cg.clone(), instance.clone());
        cg.create(&Limits { memory_bytes: 64 << 20, cpus: 1.0, pids: 16 }).unwrap();
        let mut child = Command::new("sleep").arg("1000").stdin(Stdio::null()).spawn().unwrap();
        cg.add_pid(child.id() as i32).unwrap();
        let err = cg.remove().unwrap_err();
        assert!(err.to_string().contains(&instance), "{err}");
        cg.kill_all(Duration::from_secs(5)).unwrap();
        child.wait().unwrap();
        cg.remove().unwrap();
    }
}

//! What a server may leave on the host - mounts under its data dir, cgroups
//! and processes of its instance, sandbox run directories - how to find
//! them, and how to remove them when a test failed halfway.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use rustix::mount::{unmount, UnmountFlags};
use rustix::process::{kill_process, Pid, Signal};

/// Where the cgroup hierarchies are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Everything found on the host that belongs to one test server.
#[derive(Debug, Default)]
pub struct Leaks {
    pub mounts: Vec<PathBuf>,
    pub cgroup_dirs: Vec<PathBuf>,
    /// Live (non-zombie) processes in one of the instance's cgroups, with their command line.
    pub processes: Vec<(i32, String)>,
    pub run_entries: Vec<PathBuf>,
}

impl Leaks {
    /// Scans the host for what the server of `instance` on `data_dir` left.
    pub fn scan(data_dir: &Path, instance: &str) -> Leaks {
        Leaks {
            mounts: mounts_under(data_dir),
            cgroup_dirs: sandbox_cgroup_dirs(instance),
            processes: instance_processes(instance),
            run_entries: [dir_entries(&data_dir.join("run")), vm_run_entries(data_dir)].concat(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.mounts.is_empty()
            && self.cgroup_dirs.is_empty()
            && self.processes.is_empty()
            && self.run_entries.is_empty()
    }
}

impl fmt::Display for Leaks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "mounts under the data dir: {:?}", self.mounts)?;
        writeln!(f, "sandbox cgroup directories: {:?}", self.cgroup_dirs)?;
        writeln!(f, "processes in the instance's cgroups: {:?}", self.processes)?;
        write!(f, "entries in run/: {:?}", self.run_entries)
    }
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut found: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape_mountinfo(field)))
        .filter(|point| point.starts_with(dir))
        .collect();
    found.reverse();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found
}

/// mountinfo writes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `/sys/fs/cgroup/<hierarchy>/<instance>` (and the microVM driver's
/// `<instance>-vm`, the full-VM driver's `<instance>-fullvm`) for every
/// hierarchy that has it.
pub fn instance_cgroup_dirs(instance: &str) -> Vec<PathBuf> {
    let names = [instance.to_string(), vm_instance(instance), full_vm_instance(instance)];
    dir_entries(Path::new(CGROUP_ROOT))
        .into_iter()
        .flat_map(|h| names.iter().map(move |n| h.join(n)))
        .filter(|d| d.is_dir())
        .collect()
}

/// The microVM driver's cgroup instance: its QEMU processes live there.
pub fn vm_instance(instance: &str) -> String {
    format!("{instance}-vm")
}

/// The full-VM driver's cgroup instance.
pub fn full_vm_instance(instance: &str) -> String {
    format!("{instance}-fullvm")
}

/// Sandbox directories of the microVM and full-VM drivers (their caches
/// start with a dot), and the microVM driver's snapshots (removed when
/// the server stops).
pub fn vm_run_entries(data_dir: &Path) -> Vec<PathBuf> {
    let hidden = |p: &PathBuf| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
    let sandboxes = [dir_entries(&data_dir.join("vm")), dir_entries(&data_dir.join("fullvm"))]
        .concat()
        .into_iter()
        .filter(|p| !hidden(p));
    sandboxes.chain(dir_entries(&data_dir.join("vm").join(".snapshots"))).collect()
}

/// The per-sandbox directories below the instance's directories.
pub fn sandbox_cgroup_dirs(instance: &str) -> Vec<PathBuf> {
    instance_cgroup_dirs(instance).into_iter().flat_map(|d| dir_entries(&d)).filter(|d| d.is_dir()).collect()
}

/// Sorted entries of `dir`; none when it does not exist.
pub fn dir_entries(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> =
        fs::read_dir(dir).map(|rd| rd.flatten().map(|e| e.path()).collect()).unwrap_or_default();
    out.sort();
    out
}

/// Host pids of live processes whose cgroup path (in any hierarchy) has
/// `instance` as a component, with their command lines.
pub fn instance_processes(instance: &str) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for entry in dir_entries(Path::new("/proc")) {
        let Some(pid) = entry.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cgroups) = fs::read_to_string(entry.join("cgroup")) else { continue };
        let in_instance = cgroups.lines().filter_map(|l| l.splitn(3, ':').nth(2)).any(|path| {
            path.split('/').any(|component| {
                component == instance || component == vm_instance(instance) || component == full_vm_instance(instance)
            })
        });
        if in_instance && !is_zombie(pid) {
            out.push((pid, cmdline(pid)));
        }
    }
    out
}

/// The process's arguments joined by spaces ("" when it is gone).
pub fn cmdline(pid: i32) -> String {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    raw.split(|b| *b == 0).filter(|a| !a.is_empty()).map(String::from_utf8_lossy).collect::<Vec<_>>().join(" ")
}

/// True for zombies and for pids that are gone. A zombie holds no resource
/// but its pid; reaping orphans is the host init's job once the server died.
pub fn is_zombie(pid: i32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next().map(str::to_string));
    matches!(state.as_deref(), Some("Z" | "X" | "x") | None)
}

/// True when `pid` is gone, a zombie, or past the start of `do_exit`
/// (`PF_EXITING` in `/proc/<pid>/stat`'s flags): it runs no user code again.
/// A sandbox's PID 1 waits in that state, its memory already dropped, until
/// the last process of its pid namespace is reaped, after it has left its
/// cgroups - so it must not read as a process outside every sandbox.
pub fn is_exiting(pid: i32) -> bool {
    const PF_EXITING: u64 = 0x4;
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { return true };
    let mut fields = stat.rfind(')').map(|i| stat[i + 1..].split_whitespace()).into_iter().flatten();
    let state = fields.next();
    // After the state: ppid, pgrp, session, tty_nr, tpgid, then flags.
    let flags = fields.nth(5).and_then(|f| f.parse::<u64>().ok());
    matches!(state, Some("Z" | "X" | "x") | None) || flags.is_none_or(|f| f & PF_EXITING != 0)
}

/// A process named by pid and start time, so a recycled pid is never
/// mistaken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessIdentity {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`.
    pub start_time: u64,
}

impl ProcessIdentity {
    /// True while the same process exists and is not a zombie.
    pub fn is_alive(&self) -> bool {
        stat_fields(self.pid).is_some_and(|(state, ppid_start)| ppid_start.1 == self.start_time && state != "Z")
    }
}

/// State, and (ppid, start time), from `/proc/<pid>/stat`.
fn stat_fields(pid: i32) -> Option<(String, (i32, u64))> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command (field 2) may hold spaces and parentheses; it ends at the last ')'.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let state = fields.next()?.to_string();
    let ppid = fields.next()?.parse().ok()?;
    // Field 22 is the 19th after the ppid (field 4).
    let start_time = fields.nth(17)?.parse().ok()?;
    Some((state, (ppid, start_time)))
}

/// Every pid in `/proc`.
fn proc_pids() -> impl Iterator<Item = i32> {
    dir_entries(Path::new("/proc"))
        .into_iter()
        .filter_map(|e| e.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<i32>().ok()))
}

/// The live children of `ppid`.
pub fn children_of(ppid: i32) -> Vec<ProcessIdentity> {
    proc_pids()
        .filter_map(|pid| match stat_fields(pid) {
            Some((state, (parent, start_time))) if parent == ppid && state != "Z" => {
                Some(ProcessIdentity { pid, start_time })
            }
            _ => None,
        })
        .collect()
}

/// The children of `ppid` whose command (`/proc/<pid>/comm`) is `comm`,
/// zombies included: a zombie is still seen inside its pid namespace.
pub fn children_named(ppid: i32, comm: &str) -> Vec<i32> {
    proc_pids()
        .filter(|pid| stat_fields(*pid).is_some_and(|(_, (parent, _))| parent == ppid))
        .filter(|pid| fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim_end() == comm))
        .collect()
}

/// A line of `/proc/<pid>/status`, e.g. `Uid` or `NSpid`, without its key.
pub fn proc_status_field(pid: i32, key: &str) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|l| l.strip_prefix(key).and_then(|rest| rest.strip_prefix(':')).map(|v| v.trim().to_string()))
}

/// Best-effort removal of everything a server of `instance` left: kills its
/// sandboxes' processes, unmounts below `data_dir`, removes its cgroups.
/// Returns the mounts that could not be removed.
pub fn force_cleanup(data_dir: &Path, instance: &str) -> Vec<PathBuf> {
    kill_instance_processes(instance, Duration::from_secs(10));
    detach_mounts_under(data_dir);
    for dir in sandbox_cgroup_dirs(instance) {
        let _ = fs::remove_dir(dir);
    }
    remove_instance_dirs(instance);
    mounts_under(data_dir)
}

/// Removes what test servers of *dead* test processes left in the cgroup
/// hierarchies: instances named `wt-<pid>-<n>` (and their `-vm`,
/// `-fullvm` siblings) whose `<pid>` no longer exists. A test process
/// killed from outside never runs its servers' cleanup, and no later server
/// restarts its instance, so nothing else would. Instances of live
/// processes (this one, or another suite running beside it) are left alone.
pub fn sweep_dead_test_instances() {
    let mut dead = std::collections::BTreeSet::new();
    for hierarchy in dir_entries(Path::new(CGROUP_ROOT)) {
        for dir in dir_entries(&hierarchy) {
            let Some(name) = dir.file_name().and_then(|n| n.to_str()) else { continue };
            let Some(instance) = dead_test_instance(name) else { continue };
            dead.insert(instance);
        }
    }
    for instance in dead {
        kill_instance_processes(&instance, Duration::from_secs(10));
        for dir in sandbox_cgroup_dirs(&instance) {
            let _ = fs::remove_dir(dir);
        }
        remove_instance_dirs(&instance);
    }
}

/// In a test server's temp dir: the pid of the test process that made it.
pub const OWNER_FILE: &str = "owner-pid";

/// Removes the temp dirs (`warren-test-*` in `parent`) of dead test
/// processes, as [`OWNER_FILE`] names them: their mounts (sandbox roots and
/// their tmpfs uppers, layer mounts) are detached, then the dirs deleted. A
/// test process killed from outside never drops its temp dir, and no later
/// server uses that dir again, so nothing else would. Dirs of live
/// processes, and dirs without an owner file, are left alone.
pub fn sweep_dead_test_dirs(parent: &Path) {
    for dir in dir_entries(parent) {
        let is_test_dir = dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("warren-test-"));
        let owner = fs::read_to_string(dir.join(OWNER_FILE)).ok().and_then(|o| o.trim().parse::<u32>().ok());
        let Some(pid) = owner.filter(|_| is_test_dir) else { continue };
        if !is_dead_test_process(pid) {
            continue;
        }
        detach_mounts_under(&dir);
        if mounts_under(&dir).is_empty() {
            let _ = fs::remove_dir_all(&dir);
        }
    }
}

/// `wt-<pid>-<n>` (from a cgroup directory named so, or with a driver's
/// suffix) when `<pid>` is not a live process.
fn dead_test_instance(name: &str) -> Option<String> {
    let base = name.strip_suffix("-vm").or_else(|| name.strip_suffix("-fullvm")).unwrap_or(name);
    let mut parts = base.strip_prefix("wt-")?.splitn(2, '-');
    let pid: u32 = parts.next()?.parse().ok()?;
    let _n: u32 = parts.next()?.parse().ok()?;
    is_dead_test_process(pid).then(|| base.to_string())
}

/// A test process's pid that names no process now (never this one).
fn is_dead_test_process(pid: u32) -> bool {
    pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Detaches every mount below `dir`, deepest first.
fn detach_mounts_under(dir: &Path) {
    for point in mounts_under(dir) {
        let _ = unmount(&point, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW);
    }
}

/// Removes the (empty) instance directories themselves.
pub fn remove_instance_dirs(instance: &str) {
    for dir in instance_cgroup_dirs(instance) {
        let _ = fs::remove_dir(dir);
    }
}

/// SIGKILLs every process in the instance's cgroups until none is left or
/// `within` passed. Thaws frozen sandboxes first: a frozen v1 task does not
/// act on SIGKILL.
fn kill_instance_processes(instance: &str, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let pids = instance_processes(instance);
        if pids.is_empty() || Instant::now() > deadline {
            return;
        }
        let freezer = Path::new(CGROUP_ROOT).join("freezer").join(instance);
        for dir in dir_entries(&freezer) {
            let _ = fs::write(dir.join("freezer.state"), "THAWED");
        }
        for (pid, _) in pids {
            if let Some(pid) = Pid::from_raw(pid) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Layer-cache fill holders (`warren __layer-cache-holder`) that still hold a
/// file under `dir` open - they inherit the test server's log. A holder
/// outlives a crashed server on purpose (the next start adopts it), but never
/// a server that stopped cleanly.
pub fn layer_cache_holders(dir: &Path) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in dir_entries(Path::new("/proc")) {
        let Some(pid) = entry.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if !cmdline(pid).contains("__layer-cache-holder") || is_zombie(pid) {
            continue;
        }
        let holds_ours = dir_entries(&entry.join("fd"))
            .iter()
            .filter_map(|fd| fs::read_link(fd).ok())
            .any(|target| target.starts_with(dir));
        if holds_ours {
            out.push(pid);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_decoded() {
        assert_eq!(unescape_mountinfo(r"/tmp/a\040b\134c"), "/tmp/a b\\c");
    }

    #[test]
    fn a_child_is_found_until_it_exits() {
        let mut child = std::process::Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let me = std::process::id() as i32;
        let found = children_of(me).into_iter().find(|p| p.pid == child.id() as i32).expect("the child is listed");
        assert!(found.is_alive());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!found.is_alive());
    }

    #[test]
    fn own_status_fields_are_found() {
        let me = std::process::id() as i32;
        assert!(proc_status_field(me, "Uid").is_some());
        assert!(!is_zombie(me));
        assert!(!is_exiting(me), "a running process is not exiting");
    }

    #[test]
    fn a_zombie_reads_as_exiting() {
        let mut child = std::process::Command::new("true").spawn().expect("spawn true");
        let pid = child.id() as i32;
        // Unreaped, the child stays a zombie until wait().
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !is_zombie(pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(is_exiting(pid), "a zombie has run its last user code");
        child.wait().unwrap();
        assert!(is_exiting(pid), "a reaped pid is gone");
    }
}

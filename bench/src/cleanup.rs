//! Removing what a run made: cgroup trees, mounts below a directory, and
//! the leftovers of an earlier run that was killed before its guards ran.
//!
//! Every name the benchmark gives carries its pid (`wb<pid>-...` containers,
//! `warren-bench-<pid>-...` cgroups and temp dirs, the `bench-<pid>` Warren
//! instance), so a sweep only touches runs whose process is gone.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::error::{BenchError, Result};
use crate::host;

pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const RMDIR_PATIENCE: Duration = Duration::from_secs(5);

/// Prefix of the benchmark's temp dirs and of the cgroups it makes itself.
pub fn own_prefix(pid: u32) -> String {
    format!("warren-bench-{pid}-")
}

/// The Warren `--instance` of one run (the name the brief fixes).
pub fn warren_instance(pid: u32) -> String {
    format!("bench-{pid}")
}

/// Prefix of every runc / crun container id of one run.
pub fn container_prefix(pid: u32) -> String {
    format!("wb{pid}-")
}

/// The run's temp dir. Dropping it first detaches anything still mounted
/// below it, so removing the tree can never reach into a mounted filesystem.
pub struct Workdir {
    dir: tempfile::TempDir,
}

impl Workdir {
    pub fn create() -> Result<Workdir> {
        let dir = tempfile::Builder::new()
            .prefix(&own_prefix(std::process::id()))
            .tempdir()
            .map_err(|e| BenchError::io("create", std::env::temp_dir(), e))?;
        Ok(Workdir { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        let detached = unmount_below(self.dir.path());
        if detached > 0 {
            eprintln!("warren-bench: cleanup: detached {detached} mounts below {}", self.dir.path().display());
        }
    }
}

/// A memory cgroup the benchmark made to count a peer's usage; removed on drop.
pub struct CgroupDir {
    pub path: PathBuf,
}

impl CgroupDir {
    pub fn create(name: &str) -> Result<CgroupDir> {
        let path = Path::new(host::MEMORY_CGROUP_ROOT).join(name);
        fs::create_dir(&path).map_err(|e| BenchError::io("mkdir", &path, e))?;
        Ok(CgroupDir { path })
    }
}

impl Drop for CgroupDir {
    fn drop(&mut self) {
        if let Err(e) = remove_cgroup_tree(&self.path) {
            eprintln!("warren-bench: cleanup: {e}");
        }
    }
}

/// Kills every process in a v1 cgroup tree and removes its directories,
/// deepest first. A frozen freezer cgroup is thawed first, as frozen tasks
/// do not act on SIGKILL.
pub fn remove_cgroup_tree(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        return Ok(());
    }
    let mut children = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| BenchError::io("list", dir, e))?.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            children.push(entry.path());
        }
    }
    for child in children {
        remove_cgroup_tree(&child)?;
    }
    let _ = fs::write(dir.join("freezer.state"), "THAWED");
    let deadline = Instant::now() + RMDIR_PATIENCE;
    loop {
        kill_members(dir);
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(BenchError::io("rmdir", dir, e)),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn kill_members(dir: &Path) {
    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
        if let Some(pid) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

/// Mount points at or below `dir`, deepest first, from `/proc/self/mountinfo`.
pub fn mounts_below(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = mountinfo
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(unescape_mountinfo)
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            let octal = std::str::from_utf8(&bytes[i + 1..i + 4]).ok().and_then(|s| u8::from_str_radix(s, 8).ok());
            if let Some(b) = octal {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Lazily unmounts everything mounted below `dir`; returns how many.
pub fn unmount_below(dir: &Path) -> usize {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mounts = mounts_below(&info, dir);
    for m in &mounts {
        let _ = rustix::mount::unmount(m, rustix::mount::UnmountFlags::DETACH);
    }
    mounts.len()
}

/// Cgroup directories of a Warren instance that still exist, per hierarchy
/// (`<hierarchy>/<instance>/<sandbox>`), i.e. sandboxes not torn down.
pub fn instance_cgroups(instance: &str) -> Vec<PathBuf> {
    let mut left = Vec::new();
    for hierarchy in fs::read_dir(CGROUP_ROOT).into_iter().flatten().flatten() {
        let dir = hierarchy.path().join(instance);
        for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                left.push(entry.path());
            }
        }
    }
    left
}

/// Removes `<hierarchy>/<name>` trees in every cgroup hierarchy.
pub fn remove_named_cgroups(name: &str) -> Vec<BenchError> {
    let mut errors = Vec::new();
    for hierarchy in fs::read_dir(CGROUP_ROOT).into_iter().flatten().flatten() {
        if let Err(e) = remove_cgroup_tree(&hierarchy.path().join(name)) {
            errors.push(e);
        }
    }
    errors
}

/// The pid in a name made by [`own_prefix`], [`warren_instance`] or
/// [`container_prefix`].
pub fn owner_pid(name: &str) -> Option<u32> {
    let rest = name
        .strip_prefix("warren-bench-")
        .or_else(|| name.strip_prefix("bench-"))
        .or_else(|| name.strip_prefix("wb"))?;
    let digits = rest.split('-').next()?;
    if name.starts_with("bench-") && digits.len() != rest.len() {
        return None; // the Warren instance is exactly `bench-<pid>`
    }
    digits.parse().ok()
}

fn stale(name: &str) -> bool {
    owner_pid(name).is_some_and(|pid| pid != std::process::id() && !host::pid_alive(pid))
}

/// Removes what earlier, killed runs left: containers, cgroups, mounts and
/// temp dirs whose owning benchmark process no longer lives. Returns what it did.
pub fn sweep_stale(mount_ns_runner: impl Fn(&str) -> Command) -> Vec<String> {
    let mut done = Vec::new();
    for runtime in ["runc", "crun"] {
        let listed = mount_ns_runner(runtime).args(["list", "-q"]).output();
        let ids = listed.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        for id in ids.lines().map(str::trim).filter(|id| id.starts_with("wb") && stale(id)) {
            let ok =
                mount_ns_runner(runtime).args(["delete", "--force", id]).output().is_ok_and(|o| o.status.success());
            done.push(format!("{runtime} delete --force {id}: {}", if ok { "ok" } else { "failed" }));
        }
    }
    let mut names = std::collections::BTreeSet::new();
    for hierarchy in fs::read_dir(CGROUP_ROOT).into_iter().flatten().flatten() {
        for entry in fs::read_dir(hierarchy.path()).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if entry.file_type().is_ok_and(|t| t.is_dir()) && stale(&name) {
                names.insert(name);
            }
        }
    }
    for name in names {
        let errors = remove_named_cgroups(&name);
        done.push(format!(
            "cgroups {name}: {}",
            if errors.is_empty() { "removed".into() } else { errors[0].to_string() }
        ));
    }
    let tmp = std::env::temp_dir();
    for entry in fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("warren-bench-") && stale(&name) {
            let unmounted = unmount_below(&entry.path());
            let removed = fs::remove_dir_all(entry.path()).is_ok();
            done.push(format!("{}: {unmounted} mounts detached, removed: {removed}", entry.path().display()));
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pids_come_from_every_name_form() {
        assert_eq!(owner_pid("warren-bench-123-bwrap"), Some(123));
        assert_eq!(owner_pid("warren-bench-77-abcd"), Some(77));
        assert_eq!(owner_pid("bench-42"), Some(42));
        assert_eq!(owner_pid("bench-42-other"), None);
        assert_eq!(owner_pid("wb9-runc-12"), Some(9));
        assert_eq!(owner_pid("warren"), None);
        assert_eq!(owner_pid("benchmark"), None);
    }

    #[test]
    fn mounts_below_a_dir_come_deepest_first_and_unescaped() {
        let info = "\
22 1 0:21 / /proc rw - proc proc rw
40 22 0:50 / /tmp/wb/run/a rw - tmpfs t rw
41 40 0:51 / /tmp/wb/run/a/b rw - tmpfs t rw
42 22 0:52 / /tmp/wb\\040x rw - tmpfs t rw
43 22 0:53 / /tmp/wbother rw - tmpfs t rw
";
        let got = mounts_below(info, Path::new("/tmp/wb"));
        assert_eq!(got, vec![PathBuf::from("/tmp/wb/run/a/b"), PathBuf::from("/tmp/wb/run/a")]);
        assert_eq!(mounts_below(info, Path::new("/tmp/wb x")), vec![PathBuf::from("/tmp/wb x")]);
    }

    #[test]
    fn a_cgroup_tree_with_a_live_process_is_removed() {
        let name = format!("{}cleanup-test", own_prefix(std::process::id()));
        let dir = CgroupDir::create(&name).unwrap();
        fs::create_dir(dir.path.join("child")).unwrap();
        let mut child = Command::new("/bin/sleep").arg("60").spawn().unwrap();
        fs::write(dir.path.join("child/cgroup.procs"), child.id().to_string()).unwrap();
        let path = dir.path.clone();
        drop(dir);
        assert!(!path.exists());
        assert!(!child.wait().unwrap().success(), "the member was killed");
    }
}

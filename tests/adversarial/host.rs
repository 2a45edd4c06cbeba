//! What "the host is unchanged" means after a case, measured from the
//! host: a sentinel file tree (and the platform's own binaries and image
//! layer) hash the same, no mount appeared or vanished outside the
//! directories tests use, no process escaped its sandbox's cgroups, and the
//! kernel log has no new `BUG`/`Oops`/`WARNING` line.
//!
//! Other suites (and other servers) may run at the same time on this host,
//! so each check looks only where a sandbox escape would show and where
//! concurrent tests do not write: mounts outside temp and run directories,
//! processes with a sandbox uid outside every sandbox cgroup or descended
//! from our server outside its cgroups.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use warren_tests::leaks;

/// The first host uid of sandbox ranges (`ContainerConfig::DEFAULT_UID_BASE_START`).
const SANDBOX_UID_BASE: u64 = 1 << 30;

/// Kernel log lines that mean the kernel itself went wrong.
const KERNEL_TROUBLE: &[&str] = &[
    "BUG:",
    "Oops",
    "WARNING:",
    "Kernel panic",
    "general protection fault",
    "Filesystem has been shut down",
    "Corruption",
    "warren-forged",
];

/// Files above this are compared by metadata (inode, size, times), not content.
const BIG_FILE_BYTES: u64 = 1 << 20;

/// A planted tree of files the sandbox must never reach, plus files of the
/// host that matter to the platform.
pub struct Sentinel {
    pub dir: PathBuf,
    /// Files and directories hashed besides the planted tree.
    pub watched: Vec<PathBuf>,
}

impl Sentinel {
    /// Plants `dir` with a few files, a symlink and a private directory.
    pub fn plant(dir: &Path, marker: &str, watched: Vec<PathBuf>) -> Sentinel {
        fs::create_dir_all(dir.join("private")).expect("make the sentinel tree");
        fs::write(dir.join("answers.txt"), format!("{marker}\n")).expect("plant a sentinel file");
        fs::write(dir.join("private/key"), format!("key-{marker}\n")).expect("plant a sentinel file");
        fs::set_permissions(dir.join("private"), fs::Permissions::from_mode(0o700)).expect("chmod");
        let _ = std::os::unix::fs::symlink("answers.txt", dir.join("link"));
        Sentinel { dir: dir.to_path_buf(), watched }
    }

    /// `path -> description` (mode, owner, size, sha256 or link target) of
    /// every entry below each root.
    pub fn hashes(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        for root in std::iter::once(&self.dir).chain(&self.watched) {
            describe_tree(root, &mut out);
        }
        out
    }
}

fn describe_tree(path: &Path, out: &mut BTreeMap<PathBuf, String>) {
    let Ok(meta) = fs::symlink_metadata(path) else {
        out.insert(path.to_path_buf(), "missing".into());
        return;
    };
    let head = format!("{:o} {}:{}", meta.mode(), meta.uid(), meta.gid());
    let desc = if meta.file_type().is_symlink() {
        format!("{head} -> {:?}", fs::read_link(path).ok())
    } else if meta.is_dir() {
        let mut entries: Vec<PathBuf> =
            fs::read_dir(path).map(|rd| rd.flatten().map(|e| e.path()).collect()).unwrap_or_default();
        entries.sort();
        for e in &entries {
            describe_tree(e, out);
        }
        format!("{head} dir of {}", entries.len())
    } else if meta.len() > BIG_FILE_BYTES {
        // Any write moves mtime and ctime; hashing a 200 MB binary twice
        // per case would make the suite slow.
        format!(
            "{head} {} ino {} mtime {}.{} ctime {}.{}",
            meta.len(),
            meta.ino(),
            meta.mtime(),
            meta.mtime_nsec(),
            meta.ctime(),
            meta.ctime_nsec()
        )
    } else {
        let digest = fs::read(path).map(|b| format!("{:x}", Sha256::digest(&b))).unwrap_or_else(|e| e.to_string());
        format!("{head} {} {digest}", meta.len())
    };
    out.insert(path.to_path_buf(), desc);
}

/// The host state one case must leave as it found it.
#[derive(Debug, Clone, PartialEq)]
pub struct HostState {
    pub files: BTreeMap<PathBuf, String>,
    pub mounts: BTreeSet<String>,
    pub kernel_trouble: BTreeSet<String>,
}

/// Directories in which concurrent tests (ours and others') make and remove
/// mounts all the time.
fn busy_mount_dir(point: &str) -> bool {
    let tmp = std::env::temp_dir();
    let tmp = tmp.to_string_lossy();
    [tmp.as_ref(), "/tmp", "/run", "/var/tmp", "/sys/fs/bpf", "/var/lib/warren", "/var/cache/warren"]
        .iter()
        .any(|d| point == *d || point.starts_with(&format!("{}/", d.trim_end_matches('/'))))
}

/// `mount point fstype source` of every host mount outside [`busy_mount_dir`]s.
pub fn host_mounts() -> BTreeSet<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = *fields.get(4)?;
            let dash = fields.iter().position(|f| *f == "-")?;
            let fstype = fields.get(dash + 1)?;
            let source = fields.get(dash + 2)?;
            (!busy_mount_dir(point)).then(|| format!("{point} {fstype} {source}"))
        })
        .collect()
}

/// Lines of the kernel log that report kernel trouble.
pub fn kernel_trouble() -> BTreeSet<String> {
    let out = Command::new("dmesg").output().expect("run dmesg");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| KERNEL_TROUBLE.iter().any(|k| l.contains(k)))
        .map(str::to_string)
        .collect()
}

impl HostState {
    pub fn take(sentinel: &Sentinel) -> HostState {
        HostState { files: sentinel.hashes(), mounts: host_mounts(), kernel_trouble: kernel_trouble() }
    }

    /// What changed since `self`, one line per change; empty when nothing did.
    pub fn changes(&self, now: &HostState) -> Vec<String> {
        let mut out = Vec::new();
        for (path, before) in &self.files {
            match now.files.get(path) {
                Some(after) if after == before => {}
                Some(after) => out.push(format!("host file {} changed: {before} -> {after}", path.display())),
                None => out.push(format!("host file {} vanished", path.display())),
            }
        }
        for path in now.files.keys().filter(|p| !self.files.contains_key(*p)) {
            out.push(format!("host file {} appeared", path.display()));
        }
        for m in now.mounts.difference(&self.mounts) {
            out.push(format!("host mount appeared: {m}"));
        }
        for m in self.mounts.difference(&now.mounts) {
            out.push(format!("host mount vanished: {m}"));
        }
        for l in now.kernel_trouble.difference(&self.kernel_trouble) {
            out.push(format!("new kernel log line: {l}"));
        }
        out
    }
}

/// Pids of the `pids` cgroup path of a process, e.g. `/wt-1-0/sb-x`.
fn pids_cgroup(pid: i32) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines().find_map(|l| l.split_once(":pids:").map(|(_, path)| path.to_string()))
}

fn comm(pid: i32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim_end().to_string()).unwrap_or_default()
}

fn parent(pid: i32) -> Option<i32> {
    leaks::proc_status_field(pid, "PPid").and_then(|p| p.trim().parse().ok())
}

fn host_pids() -> Vec<i32> {
    leaks::dir_entries(Path::new("/proc"))
        .iter()
        .filter_map(|p| p.file_name()?.to_str()?.parse().ok())
        .filter(|pid| !leaks::is_exiting(*pid))
        .collect()
}

/// The node's init zygote: a root child of the server that runs
/// `warren-init --zygote` (`warren_init::proto::zygote::ARG`). It forks
/// each sandbox's first init and lives outside every sandbox by design.
fn is_init_zygote(pid: i32, server: i32, uid: Option<u64>) -> bool {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let args: Vec<&[u8]> = raw.split(|b| *b == 0).filter(|a| !a.is_empty()).collect();
    uid == Some(0)
        && parent(pid) == Some(server)
        && args.len() == 2
        && args[0].ends_with(b"warren-init")
        && args[1] == b"--zygote"
}

/// Processes that left their sandbox: any live process with a sandbox uid
/// that sits in no sandbox cgroup (`/<instance>/<id>`), and any descendant
/// of our server outside our instance's cgroups.
pub fn escaped_processes(server_pid: Option<u32>, instance: &str) -> Vec<String> {
    let mut out = Vec::new();
    for pid in host_pids() {
        let uid: Option<u64> = leaks::proc_status_field(pid, "Uid")
            .and_then(|ids| ids.split_whitespace().next().and_then(|u| u.parse().ok()));
        let cgroup = pids_cgroup(pid).unwrap_or_default();
        let in_some_sandbox = cgroup.trim_matches('/').split('/').count() >= 2;
        // A VM's QEMU sits in the VM drivers' own instances.
        let ours = [instance.to_string(), leaks::vm_instance(instance), leaks::full_vm_instance(instance)];
        let in_ours = cgroup.split('/').any(|c| ours.iter().any(|o| o == c));
        // Exiting is checked again after the reads above: a process leaves
        // its v1 cgroups inside do_exit, after PF_EXITING is set, so one
        // that began to exit between the first check and the cgroup read
        // shows the root cgroup and is caught here.
        if uid.is_some_and(|u| u >= SANDBOX_UID_BASE) && !in_some_sandbox && !leaks::is_exiting(pid) {
            out.push(format!("pid {pid} ({}, uid {uid:?}, cgroup {cgroup}): {}", comm(pid), leaks::cmdline(pid)));
            continue;
        }
        let Some(server) = server_pid.map(|p| p as i32) else { continue };
        if pid == server || in_ours || is_init_zygote(pid, server, uid) {
            continue;
        }
        let mut ancestor = parent(pid);
        for _ in 0..64 {
            match ancestor {
                Some(a) if a == server => {
                    if !leaks::is_exiting(pid) {
                        out.push(format!(
                            "pid {pid} ({}), a descendant of the server outside its cgroups ({cgroup}): {}",
                            comm(pid),
                            leaks::cmdline(pid)
                        ));
                    }
                    break;
                }
                Some(a) if a > 1 => ancestor = parent(a),
                _ => break,
            }
        }
    }
    out
}

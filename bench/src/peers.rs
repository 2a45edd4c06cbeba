//! The peers Warren is compared with, driven through their own CLIs exactly
//! as a user would: bubblewrap, runc and crun on the same rootfs.

use std::fs;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rustix::process::{pidfd_open, Pid, PidfdFlags};
use rustix::thread::{move_into_link_name_space, LinkNameSpaceType};

use crate::cleanup::{self, CgroupDir};
use crate::cmd;
use crate::contest::Contestant;
use crate::error::{BenchError, Result};
use crate::harness::{self, IdleHolder, IdleUsage};
use crate::host;
use crate::oci;
use crate::results::{Contender, IdleMemory, Measured, Outcome, Plan, Sustained};

/// How long idle sandboxes may take to reach their `sleep`.
const READY_LIMIT: Duration = Duration::from_secs(120);

// ---- bubblewrap ----------------------------------------------------------------

pub struct Bwrap {
    rootfs: PathBuf,
}

impl Bwrap {
    pub fn new(rootfs: &Path) -> Self {
        Bwrap { rootfs: rootfs.to_path_buf() }
    }

    pub fn command(&self, argv: &[&str]) -> Command {
        let mut c = Command::new("bwrap");
        c.args(["--unshare-all", "--die-with-parent", "--bind"])
            .arg(&self.rootfs)
            .args(["/", "--proc", "/proc", "--dev", "/dev"])
            .args(argv);
        c
    }

    /// Sandbox, run `true`, tear down: one bwrap invocation.
    pub fn cold(&self) -> Result<Duration> {
        cmd::run_timed(&mut self.command(&["true"]))
    }
}

/// An idle bwrap sandbox; killing the outer bwrap ends it (`--die-with-parent`).
pub struct BwrapChild(Child);

impl BwrapChild {
    fn stop(mut self) -> Result<()> {
        self.0.kill().map_err(|e| BenchError::io("kill", "bwrap", e))?;
        cmd::wait_bounded(&mut self.0, cmd::TOOL_LIMIT).map(|_| ())
    }
}

impl Drop for BwrapChild {
    fn drop(&mut self) {
        // Already reaped after stop(); then kill fails harmlessly.
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

struct BwrapIdle<'a> {
    bwrap: &'a Bwrap,
    cgroup: CgroupDir,
}

impl IdleHolder for BwrapIdle<'_> {
    type Worker = ();
    type Handle = BwrapChild;

    fn worker(&self) -> Result<()> {
        Ok(())
    }

    /// Joins the counting cgroup from a shell that then becomes bwrap, so
    /// every process of the sandbox is born inside it.
    fn start(&self, _: &mut (), _: usize) -> Result<BwrapChild> {
        let inner = self.bwrap.command(&["sleep", "1d"]);
        let mut c = Command::new("/bin/sh");
        c.args(["-c", "echo $$ > \"$0\" && exec \"$@\""])
            .arg(self.cgroup.path.join("cgroup.procs"))
            .arg(inner.get_program())
            .args(inner.get_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c.spawn().map(BwrapChild).map_err(|e| BenchError::Spawn { program: cmd::describe(&c), source: e })
    }

    fn ready(&self, handles: &[BwrapChild]) -> Result<()> {
        wait_for_sleepers(&self.cgroup.path, handles.len()).map_err(|e| {
            let gone = handles.iter().filter(|h| !host::pid_running(h.0.id())).count();
            BenchError::Unexpected {
                op: "idle bwrap".into(),
                detail: format!("{e}; {gone} bwrap processes have exited"),
            }
        })
    }

    fn usage(&self, _: &[BwrapChild]) -> IdleUsage {
        IdleUsage {
            cgroup_bytes: host::cgroup_memory_usage(&self.cgroup.path),
            source: format!("memory.usage_in_bytes of {} (made for them)", self.cgroup.path.display()),
            extra: Vec::new(),
        }
    }

    fn stop(&self, _: &mut (), h: BwrapChild) -> Result<()> {
        h.stop()
    }

    /// bwrap sets a parent-death signal on itself, and the "parent" the
    /// kernel watches is the thread that forked it.
    fn tied_to_starting_thread(&self) -> bool {
        true
    }
}

/// Waits until `n` processes of the cgroup tree run `sleep`.
fn wait_for_sleepers(cgroup: &Path, n: usize) -> Result<()> {
    let deadline = Instant::now() + READY_LIMIT;
    loop {
        let procs = fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default();
        let sleeping = procs
            .lines()
            .filter(|pid| fs::read_to_string(format!("/proc/{}/comm", pid.trim())).is_ok_and(|c| c.trim() == "sleep"))
            .count();
        if sleeping >= n {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Timeout {
                what: format!("{n} idle sandboxes (have {sleeping})"),
                limit: READY_LIMIT,
            });
        }
        harness::check_interrupt()?;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// bwrap as a contestant: cold cycle, sustained cycles, idle sandboxes.
pub struct BwrapContestant {
    bwrap: Bwrap,
    c: Contender,
}

impl BwrapContestant {
    pub fn new(rootfs: &Path) -> Self {
        let bwrap = Bwrap::new(rootfs);
        let mut c = Contender::new("bwrap", host::tool_version("bwrap", &["--version"]));
        c.commands.push(("cold".into(), cmd::describe(&bwrap.command(&["true"]))));
        c.commands.push(("sustained".into(), "each client: the cold command, again and again".into()));
        c.commands.push(("idle".into(), cmd::describe(&bwrap.command(&["sleep", "1d"]))));
        c.exec = Outcome::skipped("bwrap has no way to run a second command in a running sandbox");
        BwrapContestant { bwrap, c }
    }
}

impl Contestant for BwrapContestant {
    fn contender(&mut self) -> &mut Contender {
        &mut self.c
    }

    fn cold_routes(&self) -> Vec<String> {
        vec!["bwrap ... true".into()]
    }

    fn cold(&mut self, _: usize) -> Result<Duration> {
        self.bwrap.cold()
    }

    fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>> {
        let bwrap = &self.bwrap;
        harness::sustained(clients, window, || Ok(()), |_| bwrap.cold())
    }

    fn idle(&mut self, plan: &Plan) -> Result<Measured<IdleMemory>> {
        let cgroup = CgroupDir::create(&format!("{}bwrap", cleanup::own_prefix(std::process::id())))?;
        let bwrap = &self.bwrap;
        harness::idle(plan, &BwrapIdle { bwrap, cgroup }, || bwrap.cold())
    }
}

// ---- the floor: no sandbox at all ---------------------------------------------------

/// The same `true` of the rootfs, started by this process with no isolation
/// at all: what one process start costs on this host. No sandbox's exec
/// can be faster, so it is the floor under every exec and cold figure (on a
/// host where CPUID traps, glibc's start-up probes alone take a good part
/// of a millisecond).
pub struct FloorContestant {
    true_bin: PathBuf,
    c: Contender,
}

impl FloorContestant {
    pub fn new(rootfs: &Path) -> Self {
        let true_bin = rootfs.join("bin/true");
        let mut c = Contender::new(crate::report::FLOOR, "fork + exec");
        let command = cmd::describe(&Command::new(&true_bin));
        c.commands.push(("cold and exec".into(), format!("{command}  # started by the bench itself, no isolation")));
        c.commands.push(("sustained".into(), "each client: the same, again and again".into()));
        c.idle = Outcome::skipped("a process is not a sandbox: nothing to compare");
        FloorContestant { true_bin, c }
    }

    fn spawn(&self) -> Result<Duration> {
        cmd::run_timed(&mut Command::new(&self.true_bin))
    }
}

impl Contestant for FloorContestant {
    fn contender(&mut self) -> &mut Contender {
        &mut self.c
    }

    fn cold_routes(&self) -> Vec<String> {
        vec!["true".into()]
    }

    fn cold(&mut self, _: usize) -> Result<Duration> {
        self.spawn()
    }

    fn exec_start(&mut self) -> Result<bool> {
        Ok(true)
    }

    fn exec(&mut self) -> Result<Duration> {
        self.spawn()
    }

    fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>> {
        let floor = &*self;
        harness::sustained(clients, window, || Ok(()), |_| floor.spawn())
    }

    fn has_idle(&self) -> bool {
        false
    }

    fn idle(&mut self, _: &Plan) -> Result<Measured<IdleMemory>> {
        Err(BenchError::Unexpected { op: "idle".into(), detail: "not measured for the floor".into() })
    }
}

// ---- runc and crun ------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Runc,
    Crun,
}

impl Runtime {
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Crun => "crun",
        }
    }
}

/// A mount namespace of our own in which `/sys/fs/cgroup/unified` is not
/// mounted: crun refuses a hybrid cgroup host, and this is the one change
/// that makes it see a plain v1 host. Held as an fd, so no process has to
/// stay alive for it.
pub struct PrivateMountNs {
    fd: OwnedFd,
}

impl PrivateMountNs {
    pub fn without_cgroup2() -> Result<Self> {
        let mut holder = Command::new("unshare")
            .args(["-m", "--propagation", "private", "/bin/sh", "-c"])
            .arg("umount /sys/fs/cgroup/unified 2>/dev/null; exec cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Spawn { program: "unshare -m".into(), source: e })?;
        let opened = Self::adopt(holder.id());
        // Closing cat's stdin ends the holder; the namespace lives on in our fd.
        drop(holder.stdin.take());
        let _ = cmd::wait_bounded(&mut holder, cmd::TOOL_LIMIT);
        opened
    }

    fn adopt(pid: u32) -> Result<Self> {
        let deadline = Instant::now() + Duration::from_secs(10);
        // `cat` runs only after the umount, so its name marks the namespace as ready.
        while fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |c| c.trim() != "cat") {
            if Instant::now() > deadline {
                return Err(BenchError::Timeout {
                    what: "private mount namespace".into(),
                    limit: Duration::from_secs(10),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mountinfo = fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .map_err(|e| BenchError::io("read", format!("/proc/{pid}/mountinfo"), e))?;
        if mountinfo.lines().any(|l| l.split_whitespace().nth(4) == Some("/sys/fs/cgroup/unified")) {
            return Err(BenchError::Unexpected {
                op: "private mount namespace".into(),
                detail: "/sys/fs/cgroup/unified is still mounted".into(),
            });
        }
        let path = format!("/proc/{pid}/ns/mnt");
        let file = fs::File::open(&path).map_err(|e| BenchError::io("open", &path, e))?;
        Ok(PrivateMountNs { fd: file.into() })
    }

    /// Makes `cmd` enter this namespace between fork and exec.
    pub fn enter_on_spawn(&self, cmd: &mut Command) {
        let raw = self.fd.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and only
        // makes one system call (setns), which is async-signal-safe. `raw`
        // is valid there: the child has a copy of our fd table, and `self`
        // (owning the fd) outlives every command built from it, as commands
        // are spawned inside methods that borrow `self`.
        unsafe {
            cmd.pre_exec(move || {
                let fd = BorrowedFd::borrow_raw(raw);
                move_into_link_name_space(fd, Some(LinkNameSpaceType::Mount)).map_err(std::io::Error::from)
            });
        }
    }
}

/// A runtime with its bundles: `true` for the cold cycle, `sleep 1d` for
/// idle containers and exec targets.
pub struct Oci {
    runtime: Runtime,
    mount_ns: Option<PrivateMountNs>,
    oneshot: PathBuf,
    sleeper: PathBuf,
    pid_dir: PathBuf,
    prefix: String,
    next: AtomicU64,
}

impl Oci {
    pub fn new(runtime: Runtime, workdir: &Path, rootfs: &Path) -> Result<Oci> {
        let dir = workdir.join(runtime.name());
        let oneshot = dir.join("bundle-true");
        let sleeper = dir.join("bundle-sleep");
        oci::make_bundle(&oneshot, rootfs, &["true"])?;
        oci::make_bundle(&sleeper, rootfs, &["sleep", "1d"])?;
        let pid_dir = dir.join("pids");
        fs::create_dir_all(&pid_dir).map_err(|e| BenchError::io("mkdir", &pid_dir, e))?;
        let mount_ns = match runtime {
            Runtime::Crun => Some(PrivateMountNs::without_cgroup2()?),
            Runtime::Runc => None,
        };
        let prefix = format!("{}{}-", cleanup::container_prefix(std::process::id()), runtime.name());
        Ok(Oci { runtime, mount_ns, oneshot, sleeper, pid_dir, prefix, next: AtomicU64::new(0) })
    }

    pub fn command(&self) -> Command {
        runtime_command(self.runtime, self.mount_ns.as_ref())
    }

    fn new_id(&self) -> String {
        format!("{}{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// `run`: create, start, wait and delete in one invocation.
    pub fn run_once(&self) -> Result<Duration> {
        cmd::run_timed(self.command().arg("run").arg("--bundle").arg(&self.oneshot).arg(self.new_id()))
    }

    /// `create`, `start`, wait for the process to exit, `delete`: the steps
    /// an engine such as containerd drives one by one.
    pub fn create_start_delete(&self) -> Result<Duration> {
        let id = self.new_id();
        let pid_file = self.pid_dir.join(&id);
        let started = Instant::now();
        cmd::run(
            self.command().args(["create", "--bundle"]).arg(&self.oneshot).arg("--pid-file").arg(&pid_file).arg(&id),
        )?;
        let container = Container { oci: self, id, deleted: false };
        let pid = read_pid(&pid_file)?;
        let exited =
            pidfd_open(pid, PidfdFlags::empty()).map_err(|e| BenchError::io("pidfd_open", "container", e.into()))?;
        cmd::run(self.command().arg("start").arg(&container.id))?;
        wait_fd_readable(&exited, cmd::TOOL_LIMIT)?;
        container.delete()?;
        let took = started.elapsed();
        let _ = fs::remove_file(&pid_file);
        Ok(took)
    }

    /// A detached container running `sleep 1d`, deleted when the value drops.
    pub fn start_sleeper(&self) -> Result<(Container<'_>, u32)> {
        let id = self.new_id();
        let pid_file = self.pid_dir.join(&id);
        cmd::run(
            self.command()
                .args(["run", "--detach", "--bundle"])
                .arg(&self.sleeper)
                .arg("--pid-file")
                .arg(&pid_file)
                .arg(&id),
        )?;
        let container = Container { oci: self, id, deleted: false };
        let pid = read_pid(&pid_file)?;
        let _ = fs::remove_file(&pid_file);
        Ok((container, pid.as_raw_nonzero().get() as u32))
    }

    pub fn exec(&self, id: &str) -> Result<Duration> {
        cmd::run_timed(self.command().args(["exec", id, "true"]))
    }

    fn delete(&self, id: &str) -> Result<()> {
        cmd::run(self.command().args(["delete", "--force", id]))
    }
}

impl Drop for Oci {
    /// A `run` that failed midway may leave its container; remove all of ours.
    fn drop(&mut self) {
        let listed = self.command().args(["list", "-q"]).output();
        let ids = listed.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        for id in ids.lines().map(str::trim).filter(|id| id.starts_with(&self.prefix)) {
            if let Err(e) = self.delete(id) {
                eprintln!("warren-bench: cleanup: {e}");
            }
        }
    }
}

/// The runtime's CLI, inside the private mount namespace when it has one.
pub fn runtime_command(runtime: Runtime, mount_ns: Option<&PrivateMountNs>) -> Command {
    let mut c = Command::new(runtime.name());
    if let Some(ns) = mount_ns {
        ns.enter_on_spawn(&mut c);
    }
    c
}

fn read_pid(pid_file: &Path) -> Result<Pid> {
    let text = fs::read_to_string(pid_file).map_err(|e| BenchError::io("read", pid_file, e))?;
    let raw: i32 = text.trim().parse().map_err(|e| BenchError::parse(pid_file.display().to_string(), e))?;
    Pid::from_raw(raw).ok_or_else(|| BenchError::parse(pid_file.display().to_string(), "pid 0"))
}

fn wait_fd_readable(fd: &OwnedFd, limit: Duration) -> Result<()> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let timeout = Timespec::try_from(limit).unwrap_or(Timespec { tv_sec: 30, tv_nsec: 0 });
    loop {
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => return Err(BenchError::Timeout { what: "container process exit".into(), limit }),
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(BenchError::io("poll", "pidfd", e.into())),
        }
    }
}

/// A container of ours; deleted (forcibly) when dropped unless already deleted.
pub struct Container<'a> {
    oci: &'a Oci,
    id: String,
    deleted: bool,
}

impl Container<'_> {
    pub fn delete(mut self) -> Result<()> {
        self.deleted = true;
        self.oci.delete(&self.id)
    }

    /// Hands the container over to the caller, who deletes it by id (and
    /// the runtime's guard deletes whatever of ours is left at the end).
    pub fn keep(mut self) -> String {
        self.deleted = true;
        std::mem::take(&mut self.id)
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        if !self.deleted {
            let _ = self.oci.delete(&self.id);
        }
    }
}

struct OciIdle<'a> {
    oci: &'a Oci,
}

impl<'a> IdleHolder for OciIdle<'a> {
    type Worker = ();
    type Handle = (Container<'a>, u32);

    fn worker(&self) -> Result<()> {
        Ok(())
    }

    fn start(&self, _: &mut (), _: usize) -> Result<Self::Handle> {
        self.oci.start_sleeper()
    }

    fn ready(&self, handles: &[Self::Handle]) -> Result<()> {
        let deadline = Instant::now() + READY_LIMIT;
        for (c, pid) in handles {
            while fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |comm| comm.trim() != "sleep") {
                if Instant::now() > deadline {
                    return Err(BenchError::Timeout {
                        what: format!("container {} to run sleep", c.id),
                        limit: READY_LIMIT,
                    });
                }
                harness::check_interrupt()?;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    fn usage(&self, handles: &[Self::Handle]) -> IdleUsage {
        let mut dirs: Vec<PathBuf> = handles.iter().filter_map(|(_, pid)| host::memory_cgroup_of(*pid)).collect();
        dirs.sort();
        dirs.dedup();
        let read: Vec<u64> = dirs.iter().filter_map(|d| host::cgroup_memory_usage(d)).collect();
        let complete = read.len() == handles.len();
        IdleUsage {
            cgroup_bytes: complete.then(|| read.iter().sum()),
            source: format!("sum of the {} containers' own memory cgroups (from /proc/<pid>/cgroup)", read.len()),
            extra: Vec::new(),
        }
    }

    fn stop(&self, _: &mut (), (c, _): Self::Handle) -> Result<()> {
        c.delete()
    }
}

/// runc or crun as a contestant: `run` and the split route for the cold
/// cycle, `exec` into a sleeping container, sustained `run`s, idle containers.
pub struct OciContestant {
    oci: Oci,
    exec_target: Option<String>,
    c: Contender,
}

impl OciContestant {
    pub fn new(runtime: Runtime, workdir: &Path, rootfs: &Path) -> Result<Self> {
        let name = runtime.name();
        let mut c = Contender::new(name, host::tool_version(name, &["--version"]));
        let oci = Oci::new(runtime, workdir, rootfs)?;
        describe_oci(&mut c, &oci);
        Ok(OciContestant { oci, exec_target: None, c })
    }

    /// The contender with the setup error, when the runtime cannot be set up.
    pub fn failed(runtime: Runtime, e: &BenchError) -> Contender {
        let mut c = Contender::new(runtime.name(), host::tool_version(runtime.name(), &["--version"]));
        c.cold = Outcome::Failed(format!("setup: {e}"));
        c
    }
}

impl Contestant for OciContestant {
    fn contender(&mut self) -> &mut Contender {
        &mut self.c
    }

    fn cold_routes(&self) -> Vec<String> {
        let name = self.oci.runtime.name();
        vec![format!("{name} run"), format!("split: {name} create + start + wait + delete")]
    }

    fn cold(&mut self, route: usize) -> Result<Duration> {
        if route == 0 {
            self.oci.run_once()
        } else {
            self.oci.create_start_delete()
        }
    }

    fn exec_start(&mut self) -> Result<bool> {
        let (target, _) = self.oci.start_sleeper()?;
        self.exec_target = Some(target.keep());
        Ok(true)
    }

    fn exec(&mut self) -> Result<Duration> {
        let id = self
            .exec_target
            .as_deref()
            .ok_or_else(|| BenchError::Unexpected { op: "exec".into(), detail: "no target container".into() })?;
        self.oci.exec(id)
    }

    fn exec_stop(&mut self) -> Result<()> {
        match self.exec_target.take() {
            Some(id) => self.oci.delete(&id),
            None => Ok(()),
        }
    }

    fn sustain(&mut self, clients: usize, window: Duration) -> Result<Measured<Sustained>> {
        let oci = &self.oci;
        harness::sustained(clients, window, || Ok(()), |_| oci.run_once())
    }

    fn idle(&mut self, plan: &Plan) -> Result<Measured<IdleMemory>> {
        let oci = &self.oci;
        harness::idle(plan, &OciIdle { oci }, || oci.run_once())
    }
}

fn describe_oci(c: &mut Contender, oci: &Oci) {
    let ns = if oci.mount_ns.is_some() {
        " (run in a private mount namespace without /sys/fs/cgroup/unified, entered by setns before exec)"
    } else {
        ""
    };
    let name = oci.runtime.name();
    let b = |p: &Path| p.display().to_string();
    c.commands.push(("cold".into(), format!("{name} run --bundle {} <id>{ns}", b(&oci.oneshot))));
    c.commands.push((
        "cold, split".into(),
        format!(
            "{name} create --bundle {} --pid-file F <id>; {name} start <id>; (pidfd wait); {name} delete --force <id>",
            b(&oci.oneshot)
        ),
    ));
    c.commands.push(("exec".into(), format!("{name} exec <id> true  # into a container running sleep 1d")));
    c.commands.push(("sustained".into(), format!("each client: {name} run as for cold, again and again")));
    c.commands.push(("idle".into(), format!("{name} run --detach --bundle {} --pid-file F <id>", b(&oci.sleeper))));
    c.notes.push(format!("bundles from `runc spec`, root.path = the shared rootfs (read-only), terminal false{ns}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rootfs() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::Builder::new().prefix(&cleanup::own_prefix(std::process::id())).tempdir().unwrap();
        let root = crate::rootfs::build(&crate::rootfs::default_script(), &tmp.path().join("rootfs")).unwrap();
        (tmp, root.dir)
    }

    #[test]
    fn bwrap_runs_true_and_fails_a_missing_program() {
        let (_tmp, root) = rootfs();
        let b = Bwrap::new(&root);
        assert!(b.cold().is_ok());
        assert!(cmd::run(&mut b.command(&["/bin/does-not-exist"])).is_err());
    }

    fn small_plan() -> Plan {
        Plan {
            samples: 1,
            warmup: 0,
            exec_samples: 1,
            sustain: Duration::from_millis(10),
            clients: 3,
            idle: 5,
            idle_cpu_window: Duration::from_millis(10),
            settle: Duration::from_millis(300),
            pool_size: 1,
            held_cold_samples: 2,
        }
    }

    #[test]
    fn idle_bwrap_sandboxes_outlive_the_threads_and_are_all_stopped() {
        let (_tmp, root) = rootfs();
        let bwrap = Bwrap::new(&root);
        let name = format!("{}bwrap-test", cleanup::own_prefix(std::process::id()));
        let holder = BwrapIdle { bwrap: &bwrap, cgroup: CgroupDir::create(&name).unwrap() };
        let m = harness::idle(&small_plan(), &holder, || bwrap.cold()).unwrap().value;
        assert_eq!((m.started, m.start_failures.count, m.stop_failures.count), (5, 0, 0));
        assert_eq!(m.cold_while_held.map(|cold| cold.len()), Some(2));
        assert!(m.cgroup_bytes.is_some_and(|b| b > 0));
        let left = fs::read_to_string(holder.cgroup.path.join("cgroup.procs")).unwrap();
        assert!(left.trim().is_empty(), "still in the cgroup: {left}");
    }

    #[test]
    fn idle_crun_containers_are_counted_and_deleted() {
        let (tmp, root) = rootfs();
        let oci = Oci::new(Runtime::Crun, tmp.path(), &root).unwrap();
        let m = harness::idle(&small_plan(), &OciIdle { oci: &oci }, || oci.run_once()).unwrap().value;
        assert_eq!((m.started, m.stop_failures.count), (5, 0));
        assert!(m.cgroup_bytes.is_some_and(|b| b > 0), "{}", m.cgroup_source);
        let list = oci.command().args(["list", "-q"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&list.stdout).contains(&oci.prefix));
    }

    #[test]
    fn runc_cycles_execs_and_cleans_up() {
        let (tmp, root) = rootfs();
        let oci = Oci::new(Runtime::Runc, tmp.path(), &root).unwrap();
        oci.run_once().unwrap();
        oci.create_start_delete().unwrap();
        let (target, pid) = oci.start_sleeper().unwrap();
        oci.exec(&target.id).unwrap();
        assert!(host::pid_alive(pid));
        let id = target.id.clone();
        drop(target);
        let list = oci.command().args(["list", "-q"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&list.stdout).lines().any(|l| l.trim() == id), "dropped container deleted");
    }

    #[test]
    fn crun_works_inside_the_private_mount_namespace() {
        let (tmp, root) = rootfs();
        let oci = Oci::new(Runtime::Crun, tmp.path(), &root).unwrap();
        oci.run_once().unwrap();
        oci.create_start_delete().unwrap();
        let (target, _) = oci.start_sleeper().unwrap();
        oci.exec(&target.id).unwrap();
        target.delete().unwrap();
        // Outside the namespace crun refuses this hybrid host, which is why the namespace exists.
        let outside =
            Command::new("crun").args(["run", "--bundle"]).arg(&oci.oneshot).arg(oci.new_id()).output().unwrap();
        assert!(!outside.status.success());
    }
}

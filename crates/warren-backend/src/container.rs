//! The container driver: a sandbox is `warren-init` as PID 1 in fresh user,
//! pid, mount, network, ipc, uts and cgroup namespaces, bounded by its own
//! cgroups, on an overlay of idmapped read-only layers and a size-limited
//! tmpfs.
//!
//! The host side (this module) owns everything made in the host's
//! namespaces: the uid range, the run directory, the control socket, the
//! cgroups, the mounts, and the init zygote that forks each sandbox's first
//! init (see `spawn`). init builds the inside (see `warren-init`).
//!
//! Invariants: a sandbox's processes only ever run with ids of its own
//! 65536-id range; nothing is killed without checking the pid's start time;
//! a failed create leaves nothing behind.

pub(crate) mod channel;
mod rootfs;
mod run_dir;
mod snapshot;
mod spawn;
pub(crate) mod state;
mod teardown;

use std::fs;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use rustix::fs::{Mode, OFlags};
use warren_api::{Backend, NetworkMode, Usage};
use warren_guard::cgroup::{Limits, SandboxCgroup, UNIFIED};
use warren_init::proto::setup::{BuildSpec, HostSays, InitSays};

use self::rootfs::RootfsSpec;
use self::run_dir::RunDir;
use self::spawn::{FirstInit, SetupChannel};
use self::state::{HandleState, Layout, ProcessId, SlotBook};
use self::teardown::{cgroup_err, Remains};
use crate::{
    check_id, BackendError, Driver, EventBatch, ExecProcess, ExecSpec, FsRoot, LimitCounters, Liveness, PhaseRules,
    Result, SandboxHandle, SandboxSpec, SweepReport,
};

/// Nothing stays "creating" longer than this.
const SETUP_DEADLINE: Duration = Duration::from_secs(30);
const PING_TIMEOUT: Duration = Duration::from_secs(2);
/// A freeze waits for every task to reach a freezable point; one stuck in
/// an uninterruptible sleep (disk I/O) may take a while.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(10);
/// PID 1's `oom_score_adj`: the OOM killer takes the sandbox's commands
/// before its init. Init resets it to 0 for the commands it starts.
const PID1_OOM_SCORE_ADJ: &str = "-998";

#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// Holds one directory per sandbox (e.g. `<data>/run`). It and its
    /// parents must be searchable (`o+x`) by other users: init resolves the
    /// root filesystem path after it has become an unprivileged user.
    pub run_dir: PathBuf,
    pub init_binary: PathBuf,
    /// Name of the parent cgroup of all sandboxes (e.g. `warren`).
    pub cgroup_instance: String,
    /// First host uid of the per-sandbox ranges.
    pub uid_base_start: u32,
}

impl ContainerConfig {
    /// 2^30: far above any uid a distribution hands out, aligned to the range
    /// size, and room for 49151 ranges below `u32::MAX`.
    pub const DEFAULT_UID_BASE_START: u32 = 1 << 30;
}

pub struct ContainerDriver {
    config: ContainerConfig,
    run_dir: Arc<RunDir>,
    slots: SlotBook,
    /// Each sandbox's connection to init between two execs.
    idle: Arc<channel::IdleConnections>,
    /// Forks each sandbox's first init.
    zygote: spawn::InitZygote,
}

impl ContainerDriver {
    /// Prepares `run_dir` and makes this process the child subreaper, so the
    /// PID 1s whose first init exits reparent here.
    pub fn new(mut config: ContainerConfig) -> Result<ContainerDriver> {
        SandboxCgroup::new(&config.cgroup_instance, "probe").map_err(cgroup_err)?;
        let slots = SlotBook::new(PathBuf::new(), config.uid_base_start);
        if config.uid_base_start == 0 || slots.capacity() == 0 {
            return Err(BackendError::Setup(format!("uid_base_start {} leaves no uid range", config.uid_base_start)));
        }
        let run_dir = &config.run_dir;
        fs::create_dir_all(run_dir).map_err(|e| BackendError::io(format!("mkdir {}", run_dir.display()), e))?;
        fs::set_permissions(run_dir, fs::Permissions::from_mode(0o711))
            .map_err(|e| BackendError::io(format!("chmod {}", run_dir.display()), e))?;
        // mountinfo shows canonical paths; sweeping compares against them.
        config.run_dir =
            fs::canonicalize(run_dir).map_err(|e| BackendError::io(format!("resolve {}", run_dir.display()), e))?;
        become_subreaper()?;
        let slots = SlotBook::new(config.run_dir.clone(), config.uid_base_start);
        let run_dir = Arc::new(RunDir::new(config.run_dir.clone())?);
        let zygote = spawn::InitZygote::new(config.init_binary.clone());
        Ok(ContainerDriver { config, run_dir, slots, idle: Arc::default(), zygote })
    }

    fn layout(&self, id: &str) -> Layout {
        Layout::new(&self.config.run_dir, id)
    }

    fn cgroup(&self, id: &str) -> Result<SandboxCgroup> {
        SandboxCgroup::new(&self.config.cgroup_instance, id).map_err(cgroup_err)
    }

    /// The handle's state, checked to belong to this driver.
    fn state(&self, handle: &SandboxHandle) -> Result<HandleState> {
        check_id(&handle.id)?;
        let state = HandleState::from_json(&handle.state)?;
        if state.dir != self.layout(&handle.id).dir() {
            return Err(BackendError::Protocol(format!("handle of {} is not from this driver", handle.id)));
        }
        Ok(state)
    }

    /// Makes the sandbox's directory, with its own tmpfs of `disk_mib`, and
    /// claims its uid slot. Fails, having made nothing, if the id is taken.
    fn reserve(&self, layout: &Layout, resources: &warren_api::Resources) -> Result<u32> {
        let dir = layout.dir();
        match self.run_dir.make_sandbox_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(BackendError::Setup(format!("sandbox {} exists already", dir.display())))
            }
            Err(e) => return Err(BackendError::io(format!("mkdir {}", dir.display()), e)),
        }
        let claimed = rootfs::mount_sandbox_dir(layout, resources.disk_mib, resources.inodes)
            .and_then(|()| self.slots.claim_slot(layout));
        if claimed.is_err() {
            let _ = rootfs::detach(dir);
            let _ = self.run_dir.remove_sandbox_dir(dir);
        }
        claimed
    }

    /// Creation after the directory and slot exist; `undo` learns each
    /// thing made as it is made.
    async fn build(&self, spec: &SandboxSpec, slot: u32, undo: &mut Undo) -> Result<HandleState> {
        let uid_base = self.slots.uid_base(slot);
        undo.remains.cgroup.create(&limits(spec)).map_err(cgroup_err)?;
        let (init_pid, mut setup) = self.start_init(undo, spec.resources.open_files)?;
        let rootfs_spec = RootfsSpec { layers: &spec.layers, uid_base, userns_pid: init_pid };
        // While init starts on another CPU: what needs no user namespace.
        rootfs::prepare(&undo.remains.layout, &rootfs_spec)?;
        match setup.next().await? {
            InitSays::UsernsReady => {}
            other => return Err(spawn::unexpected("userns_ready", other)),
        }
        spawn::write_id_maps(init_pid, uid_base)?;
        rootfs::build(&undo.remains.layout, &rootfs_spec)?;
        let pid1 = self.hand_over(spec, &mut setup, undo).await?;
        protect_from_oom_killer(pid1.pid)?;
        let state = HandleState { pid1, uid_base, slot, dir: undo.remains.layout.dir().to_path_buf() };
        state.save(&undo.remains.layout)?;
        Ok(state)
    }

    /// Spawns init inside the sandbox's cgroups, with `open_files` as its
    /// `RLIMIT_NOFILE` (every process of the sandbox inherits it and, without
    /// CAP_SYS_RESOURCE on the host, cannot raise it); `undo` holds it until
    /// it has been reaped.
    fn start_init(&self, undo: &mut Undo, open_files: u32) -> Result<(i32, SetupChannel)> {
        let target = undo.remains.cgroup.spawn_target().map_err(cgroup_err)?;
        let listener = spawn::bind_control(&undo.remains.layout)?;
        let (first_init, setup) = self.zygote.spawn_init(listener, &target, open_files)?;
        let pid = first_init.pid();
        undo.first_init = Some(first_init);
        Ok((pid, setup))
    }

    /// Sends the build order, learns PID 1, reaps the first init and waits
    /// until PID 1 serves.
    async fn hand_over(&self, spec: &SandboxSpec, setup: &mut SetupChannel, undo: &mut Undo) -> Result<ProcessId> {
        setup.send(&HostSays::Build(build_spec(spec))).await?;
        setup.send_fd(rootfs::clone_for_init(&undo.remains.layout)?.as_fd()).await?;
        let pid1 = match setup.next().await? {
            InitSays::Pid1 { pid } => match self.adopt_pid1(&undo.remains.cgroup, pid) {
                Ok(pid1) => pid1,
                // PID 1 can fail its build and exit before we look at the
                // cgroup; then its `Failed` report (a `Setup` error) is the
                // real answer, not the missing pid.
                Err(not_in_sandbox) => {
                    setup.next().await?;
                    return Err(not_in_sandbox);
                }
            },
            other => return Err(spawn::unexpected("pid1", other)),
        };
        undo.remains.pid1 = Some(pid1);
        if let Some(first_init) = undo.first_init.as_mut() {
            first_init.wait().await.map_err(|e| BackendError::io("reap the first init", e))?;
        }
        undo.first_init = None;
        match setup.next().await? {
            InitSays::Ready => Ok(pid1),
            other => Err(spawn::unexpected("ready", other)),
        }
    }

    /// Identifies the PID 1 init reported, after checking it really is in
    /// the sandbox's cgroup: it is the pid that destroy will SIGKILL.
    fn adopt_pid1(&self, cgroup: &SandboxCgroup, pid: i32) -> Result<ProcessId> {
        if !cgroup.pids("memory").map_err(cgroup_err)?.contains(&pid) {
            return Err(BackendError::Protocol(format!("init reported PID 1 as host pid {pid}, not in the sandbox")));
        }
        ProcessId::of(pid).map_err(|e| BackendError::io(format!("PID 1 (host pid {pid})"), e))
    }

    /// Removes what `remains` names and frees its uid slot.
    async fn remove(&self, remains: Remains) -> Result<()> {
        let slot = tokio::task::spawn_blocking(move || {
            let slot = SlotBook::recorded(&remains.layout);
            remains.remove().map(|()| slot)
        })
        .await
        .map_err(|e| BackendError::io("teardown task", io::Error::other(e)))??;
        if let Some(slot) = slot {
            self.slots.release(slot);
        }
        Ok(())
    }

    /// Ids with a run directory or a cgroup.
    fn known_ids(&self) -> Result<Vec<String>> {
        let mut ids = SandboxCgroup::list(&self.config.cgroup_instance).map_err(cgroup_err)?;
        let run_dir = &self.config.run_dir;
        let entries = fs::read_dir(run_dir).map_err(|e| BackendError::io(format!("read {}", run_dir.display()), e))?;
        for entry in entries {
            let entry = entry.map_err(|e| BackendError::io(format!("read {}", run_dir.display()), e))?;
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                if let Some(name) = entry.file_name().to_str() {
                    ids.push(name.to_string());
                }
            }
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }
}

#[async_trait]
impl Driver for ContainerDriver {
    fn backend(&self) -> Backend {
        Backend::Container
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle> {
        check_id(&spec.id)?;
        let layout = self.layout(&spec.id);
        let cgroup = self.cgroup(&spec.id)?;
        let slot = self.reserve(&layout, &spec.resources)?;
        let mut undo = Undo {
            remains: Remains { layout, cgroup, pid1: None, run_dir: Arc::clone(&self.run_dir) },
            first_init: None,
            armed: true,
        };
        let built = match tokio::time::timeout(SETUP_DEADLINE, self.build(spec, slot, &mut undo)).await {
            Ok(built) => built,
            Err(_) => Err(BackendError::Setup(format!("sandbox not ready within {SETUP_DEADLINE:?}"))),
        };
        match built {
            Ok(state) => {
                undo.armed = false;
                Ok(SandboxHandle { id: spec.id.clone(), backend: Backend::Container, state: state.to_json() })
            }
            Err(e) => Err(undo.run(self, e).await),
        }
    }

    async fn exec(&self, handle: &SandboxHandle, spec: ExecSpec) -> Result<ExecProcess> {
        let _ = self.state(handle)?;
        let reuse = channel::Reuse { idle: Arc::clone(&self.idle), sandbox: handle.id.clone() };
        channel::start_exec_reusing(&self.layout(&handle.id).ctl_sock(), spec, self.cgroup(&handle.id)?, Some(reuse))
            .await
    }

    async fn exec_fed(
        &self,
        handle: &SandboxHandle,
        spec: ExecSpec,
        stdin: bytes::Bytes,
        keep_open: bool,
    ) -> Result<ExecProcess> {
        let _ = self.state(handle)?;
        let reuse = channel::Reuse { idle: Arc::clone(&self.idle), sandbox: handle.id.clone() };
        let feed = channel::Feed { stdin, eof: !keep_open };
        let sock = self.layout(&handle.id).ctl_sock();
        channel::start_exec_fed(&sock, spec, self.cgroup(&handle.id)?, Some(reuse), Some(feed)).await
    }

    /// Connects to init ahead of the first exec: the connect, init's accept
    /// hop, peer check and new thread then overlap the claim's commit.
    async fn prepare_exec(&self, handle: &SandboxHandle) {
        if self.state(handle).is_ok() {
            channel::preconnect(&self.layout(&handle.id).ctl_sock(), &self.idle, &handle.id).await;
        }
    }

    async fn destroy(&self, handle: &SandboxHandle) -> Result<()> {
        check_id(&handle.id)?;
        self.idle.forget(&handle.id);
        let layout = self.layout(&handle.id);
        let pid1 = self.state(handle).ok().or_else(|| HandleState::load(&layout)).map(|s| s.pid1);
        let cgroup = self.cgroup(&handle.id)?;
        self.remove(Remains { layout, cgroup, pid1, run_dir: Arc::clone(&self.run_dir) }).await
    }

    /// From the state file a finished create leaves in the sandbox's run
    /// directory (written before `create` returns).
    fn recover_handle(&self, id: &str) -> Option<SandboxHandle> {
        check_id(id).ok()?;
        let state = HandleState::load(&self.layout(id))?;
        Some(SandboxHandle { id: id.to_string(), backend: Backend::Container, state: state.to_json() })
    }

    fn recovers_handles(&self) -> bool {
        true
    }

    /// Init's process is alive: that is enough in a sandbox where nothing
    /// has run (init answered when the sandbox was made, and only a process
    /// of the sandbox could have stopped it answering since). The full probe
    /// connects to init, which costs init a thread and the claim a round
    /// trip through two schedulers.
    async fn probe_idle(&self, handle: &SandboxHandle) -> Liveness {
        match self.state(handle) {
            Ok(state) if state.pid1.is_running() => Liveness::Alive,
            _ => self.probe(handle).await,
        }
    }

    async fn probe(&self, handle: &SandboxHandle) -> Liveness {
        let Ok(state) = self.state(handle) else { return Liveness::Dead { oom: false } };
        // A frozen init cannot answer a ping; its being there is all a paused sandbox can show.
        let frozen = || self.cgroup(&handle.id).is_ok_and(|cg| cg.is_frozen());
        if state.pid1.is_running() {
            if frozen() || channel::ping(&self.layout(&handle.id).ctl_sock(), PING_TIMEOUT).await {
                return Liveness::Alive;
            }
            // The ping's wait may have seen init die; if not, it is only slow.
            if state.pid1.is_running() {
                return Liveness::Unresponsive;
            }
        }
        let oom = self.cgroup(&handle.id).and_then(|cg| cg.oom_kills().map_err(cgroup_err)).is_ok_and(|n| n > 0);
        Liveness::Dead { oom }
    }

    async fn set_phase(&self, handle: &SandboxHandle, phase: PhaseRules, kill_running: bool) -> Result<u32> {
        let _ = self.state(handle)?;
        channel::set_phase(&self.layout(&handle.id).ctl_sock(), phase, kill_running).await
    }

    async fn events(&self, handle: &SandboxHandle, after_seq: u64) -> Result<EventBatch> {
        let _ = self.state(handle)?;
        channel::events(&self.layout(&handle.id).ctl_sock(), after_seq).await
    }

    fn usage(&self, handle: &SandboxHandle) -> Result<Usage> {
        let _ = self.state(handle)?;
        if !self.layout(&handle.id).dir().exists() {
            return Err(BackendError::Gone);
        }
        let counters = self.cgroup(&handle.id)?.usage().map_err(cgroup_err)?;
        Ok(Usage {
            memory_bytes: counters.memory_bytes,
            memory_peak_bytes: counters.memory_peak_bytes,
            cpu_time_secs: counters.cpu_time_ns as f64 / 1e9,
            pids: counters.pids,
            disk_bytes: disk_used(&self.layout(&handle.id).rw())?,
        })
    }

    fn limit_counters(&self, handle: &SandboxHandle) -> Result<LimitCounters> {
        let _ = self.state(handle)?;
        let rw = self.layout(&handle.id).rw();
        let cgroup = self.cgroup(&handle.id)?;
        let fs =
            rustix::fs::statvfs(&rw).map_err(|e| BackendError::io(format!("statvfs {}", rw.display()), e.into()))?;
        Ok(LimitCounters {
            oom_kills: cgroup.oom_kills().map_err(cgroup_err)?,
            pids_max_hits: cgroup.pids_max_hits().map_err(cgroup_err)?,
            disk_free_bytes: fs.f_bfree.saturating_mul(fs.f_frsize),
            disk_total_bytes: fs.f_blocks.saturating_mul(fs.f_frsize),
            inodes_free: fs.f_ffree,
            inodes_total: fs.f_files,
        })
    }

    fn network_target(&self, handle: &SandboxHandle) -> Result<crate::NetworkTarget> {
        let state = self.state(handle)?;
        let path = format!("/proc/{}/ns/net", state.pid1.pid);
        let netns = fs::File::open(&path).map_err(|e| BackendError::io(format!("open {path}"), e))?;
        // The pid could have been reused since: only PID 1 itself counts.
        if !state.pid1.is_running() {
            return Err(BackendError::Gone);
        }
        Ok(crate::NetworkTarget { netns: OwnedFd::from(netns), cgroup2_dir: self.cgroup(&handle.id)?.path(UNIFIED) })
    }

    fn fs_root(&self, handle: &SandboxHandle) -> Result<FsRoot> {
        let state = self.state(handle)?;
        let rootfs = self.layout(&handle.id).rootfs();
        let dir = open_dir_path(&rootfs)?;
        Ok(FsRoot { dir, uid: state.uid_base, gid: state.uid_base })
    }

    fn snapshot(&self, handle: &SandboxHandle, dest: &Path) -> Result<()> {
        let state = self.state(handle)?;
        let cgroup = self.cgroup(&handle.id)?;
        snapshot::snapshot(&self.layout(&handle.id), &cgroup, state.uid_base, dest)
    }

    fn pause(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = self.state(handle)?;
        self.cgroup(&handle.id)?.pause(PAUSE_TIMEOUT).map_err(cgroup_err)
    }

    fn resume(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = self.state(handle)?;
        self.cgroup(&handle.id)?.resume().map_err(cgroup_err)
    }

    async fn release(&self) -> Result<()> {
        self.run_dir.release_if_empty()?;
        SandboxCgroup::remove_instance(&self.config.cgroup_instance).map_err(cgroup_err)
    }

    async fn sweep(&self, keep: &[String]) -> Result<SweepReport> {
        let mut report = SweepReport::default();
        let mut first_error = None;
        for id in self.known_ids()? {
            if keep.contains(&id) {
                continue;
            }
            let Ok(cgroup) = self.cgroup(&id) else { continue };
            let layout = self.layout(&id);
            let pid1 = HandleState::load(&layout).map(|s| s.pid1);
            let remains = Remains { layout, cgroup, pid1, run_dir: Arc::clone(&self.run_dir) };
            match self.remove(remains).await {
                Ok(()) => report.sandboxes_removed.push(id),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "sweep could not remove a sandbox");
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Err(e) = self.run_dir.release_if_empty() {
            first_error.get_or_insert(e);
        }
        first_error.map_or(Ok(report), Err)
    }
}

/// What a create has made so far, removed again when it fails. If the
/// create future is dropped midway, `Drop` removes it on a thread of its own.
struct Undo {
    remains: Remains,
    /// The first init process, until it has been reaped.
    first_init: Option<FirstInit>,
    armed: bool,
}

impl Undo {
    /// Removes everything and returns `error`, extended if cleaning failed.
    async fn run(mut self, driver: &ContainerDriver, error: BackendError) -> BackendError {
        self.armed = false;
        if let Some(child) = self.first_init.as_ref() {
            child.kill();
        }
        let remains = self.remains.clone();
        let cleaned = driver.remove(remains).await;
        if let Some(mut child) = self.first_init.take() {
            let _ = child.wait().await;
        }
        match cleaned {
            Ok(()) => error,
            Err(cleanup) => {
                tracing::warn!(error = %cleanup, "cleaning up a failed create");
                BackendError::Setup(format!("{error}; cleaning up also failed: {cleanup}"))
            }
        }
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // Killed now; dropping it (with `self`) reaps it.
        if let Some(child) = self.first_init.as_ref() {
            child.kill();
        }
        // The uid slot stays taken in the driver's book (not on disk) until
        // a restart: this path has no driver to give it back to.
        let remains = self.remains.clone();
        std::thread::spawn(move || {
            if let Err(e) = remains.remove() {
                tracing::warn!(error = %e, "cleaning up an abandoned create");
            }
        });
    }
}

fn limits(spec: &SandboxSpec) -> Limits {
    Limits {
        memory_bytes: spec.resources.memory_mib.saturating_mul(1 << 20),
        cpus: spec.resources.cpus,
        pids: spec.resources.pids,
    }
}

fn build_spec(spec: &SandboxSpec) -> BuildSpec {
    BuildSpec {
        hostname: spec.hostname.clone(),
        loopback: spec.network != NetworkMode::None,
        phase: spec.phase.clone(),
    }
}

fn disk_used(rw: &Path) -> Result<u64> {
    let stat = rustix::fs::statvfs(rw).map_err(|e| BackendError::io(format!("statvfs {}", rw.display()), e.into()))?;
    Ok(stat.f_blocks.saturating_sub(stat.f_bfree).saturating_mul(stat.f_frsize))
}

fn open_dir_path(path: &Path) -> Result<OwnedFd> {
    rustix::fs::open(path, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).map_err(|e| match e {
        rustix::io::Errno::NOENT => BackendError::Gone,
        e => BackendError::io(format!("open {}", path.display()), e.into()),
    })
}

/// Lowers PID 1's `oom_score_adj`. Lowering needs CAP_SYS_RESOURCE, which
/// a server in a container may lack (this test host does): then PID 1 keeps
/// the default and is still the smallest process of its sandbox.
fn protect_from_oom_killer(pid: i32) -> Result<()> {
    let path = format!("/proc/{pid}/oom_score_adj");
    match fs::write(&path, PID1_OOM_SCORE_ADJ) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            tracing::debug!(pid, "cannot lower PID 1's oom_score_adj without CAP_SYS_RESOURCE");
            Ok(())
        }
        Err(e) => Err(BackendError::io(format!("write {path}"), e)),
    }
}

/// Sets `PR_SET_CHILD_SUBREAPER` once per process.
fn become_subreaper() -> Result<()> {
    static DONE: OnceLock<Result<(), io::ErrorKind>> = OnceLock::new();
    let done = DONE.get_or_init(|| {
        rustix::process::set_child_subreaper(Some(rustix::process::getpid())).map_err(|e| io::Error::from(e).kind())
    });
    done.map_err(|kind| BackendError::io("PR_SET_CHILD_SUBREAPER", kind.into()))
}

//! The driver trait every backend implements, and the drivers.
//!
//! Owns: turning a [`SandboxSpec`] into a running sandbox and back into
//! nothing, running processes in it, giving the node a root to resolve file
//! paths in (or, for a microVM or full VM, a channel to the init that
//! resolves them: [`remote_files`]), and sweeping what a crash left behind.
//! The full-VM backend is the microVM driver on a `q35` machine
//! ([`microvm::Machine`]).
//! Invariant: `destroy` and `sweep` are idempotent and leave no mount,
//! cgroup, process or directory of the sandbox behind.
//! Never: decides policy (admission, deadlines, output caps, idle timeouts):
//! that is the node's job.

pub mod container;
pub mod files;
pub mod microvm;
pub mod remote_files;
pub mod unix_sock;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_api::{Backend, NetworkMode, Resources, Usage};
pub use warren_init::proto::{ExecSpec, PathAccess, PhaseRules, SecurityEvent, SecurityEventKind, SessionState};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("backend `{0}` cannot do this: {1}")]
    Unsupported(&'static str, &'static str),
    #[error("sandbox is gone")]
    Gone,
    #[error("program not found: {0}")]
    ProgramNotFound(String),
    /// init refused to start the process (bad working directory, not executable, ...).
    #[error("cannot start the process: {0}")]
    ExecRejected(String),
    /// The sandbox's processes hold its whole pids limit, so init has no
    /// pid to serve the request with; it may succeed once some end.
    #[error("the sandbox is at its pids limit: {0}")]
    Busy(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    /// The phase's rules cannot be enforced in this sandbox (e.g. a
    /// protected path's ancestor is a symbolic link); on a switch the
    /// earlier phase stays current, on a create nothing is made.
    #[error("{0}")]
    PhaseRejected(String),
    #[error("protocol error talking to warren-init: {0}")]
    Protocol(String),
    /// The node is out of something every sandbox needs (here: uid
    /// ranges); the same request may succeed later or on another node.
    #[error("the node is out of room: {0}")]
    Exhausted(String),
    /// The request asks for what this backend on this host cannot give
    /// (e.g. a VM's guest memory beyond the host's): `field` names the
    /// request's field.
    #[error("{message}")]
    Invalid { field: &'static str, message: String },
}

impl BackendError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BackendError::Io { context: context.into(), source }
    }

    /// True when the failure says the node ran out of a resource (uid
    /// ranges, memory, processes, file descriptors, its own disk), not that
    /// the request or the node is broken: worth a retry later or elsewhere.
    pub fn is_exhaustion(&self) -> bool {
        match self {
            BackendError::Exhausted(_) => true,
            BackendError::Io { source, .. } => source.raw_os_error().is_some_and(|errno| {
                [libc::ENOMEM, libc::EAGAIN, libc::EMFILE, libc::ENFILE, libc::ENOSPC, libc::EDQUOT, libc::ENOBUFS]
                    .contains(&errno)
            }),
            _ => false,
        }
    }
}

pub type Result<T, E = BackendError> = std::result::Result<T, E>;

/// Everything a driver needs to make one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Unique, `[a-z0-9-]`, at most 40 bytes; used in paths and cgroup names.
    pub id: String,
    /// Read-only layer directories, bottom first.
    pub layers: Vec<PathBuf>,
    pub resources: Resources,
    pub network: NetworkMode,
    pub hostname: String,
    /// The phase the sandbox starts in (empty: no phases, nothing protected).
    pub phase: PhaseRules,
}

/// What the node persists about a live sandbox so that a restarted node can
/// re-adopt it. `state` is the driver's own, opaque to the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxHandle {
    pub id: String,
    pub backend: Backend,
    pub state: serde_json::Value,
}

/// Node -> running exec.
#[derive(Debug, Clone)]
pub enum ExecControl {
    Stdin(Bytes),
    StdinEof,
    /// Kill the whole process tree; an `Exited` event with `killed` follows.
    Kill,
}

/// Running exec -> node, in order: `Started`, output, then exactly one of
/// `Exited` or `Lost`.
#[derive(Debug)]
pub enum ExecEvent {
    Started {
        pid: i32,
    },
    Stdout(Bytes),
    Stderr(Bytes),
    Exited(ExitInfo),
    /// The channel to the sandbox broke before an exit status arrived.
    Lost(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ExitInfo {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The tree was killed on an [`ExecControl::Kill`].
    pub killed: bool,
    /// The out-of-memory killer fired in the sandbox while this exec ran and
    /// the process died of SIGKILL.
    pub oom: bool,
    pub cpu_time: Duration,
    pub peak_memory_bytes: u64,
    pub session_state: Option<SessionState>,
}

/// A started exec. Dropping `control` kills the process tree.
pub struct ExecProcess {
    pub events: mpsc::Receiver<ExecEvent>,
    pub control: mpsc::Sender<ExecControl>,
}

/// Result of [`Driver::probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// PID 1 (or the VM's QEMU) is there but did not answer a ping in time:
    /// a host or guest too loaded to answer (a TCG guest at high load), or a
    /// hung init. Not dead yet: the node ends the sandbox only when this
    /// lasts (see the node's reaper).
    Unresponsive,
    /// PID 1 is gone; `oom` when the out-of-memory killer took it.
    Dead {
        oom: bool,
    },
}

/// A sandbox's network namespace (an open `/proc/<pid>/ns/net`) and the
/// cgroup2 directory its processes live in.
pub struct NetworkTarget {
    pub netns: std::os::fd::OwnedFd,
    pub cgroup2_dir: PathBuf,
}

/// A directory fd of the sandbox's root filesystem as the host sees it, and
/// the host uid/gid that the sandbox's root maps to (new files get them).
pub use warren_init::files::FsRoot;

/// The node's capacity books as a driver sees them: a driver that runs
/// something of its own beside the sandboxes (the microVM driver's
/// snapshot template guests) reserves its memory and CPUs here, so that
/// admission, `GET /v1/capacity` and `GET /v1/stats` count it like a
/// create under way.
pub trait HostBooks: Send + Sync {
    /// Reserves `memory_mib` and `cpus` if they fit the node now and no
    /// create waits for room (a driver's own work never overtakes one);
    /// `None` otherwise. Held until the [`Reservation`] is dropped.
    fn reserve(&self, memory_mib: u64, cpus: f64) -> Option<Reservation>;
}

/// Room held in the node's books ([`HostBooks::reserve`]) until dropped.
pub struct Reservation {
    _release: Box<dyn Send + Sync>,
}

impl Reservation {
    /// `release` gives the room back when it is dropped.
    pub fn new(release: impl Send + Sync + 'static) -> Reservation {
        Reservation { _release: Box::new(release) }
    }
}

#[async_trait]
pub trait Driver: Send + Sync {
    fn backend(&self) -> Backend;

    /// Makes the sandbox and returns when its init answers. On error nothing
    /// of it is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle>;

    async fn exec(&self, handle: &SandboxHandle, spec: ExecSpec) -> Result<ExecProcess>;

    /// [`Driver::exec`] with the process's stdin given up front: `stdin`,
    /// then its end unless `keep_open` (further input goes through
    /// `control` as usual). A backend may send them together with the
    /// request, which saves the sandbox a wake-up for a message of their own.
    async fn exec_fed(
        &self,
        handle: &SandboxHandle,
        spec: ExecSpec,
        stdin: Bytes,
        keep_open: bool,
    ) -> Result<ExecProcess> {
        let process = self.exec(handle, spec).await?;
        if !stdin.is_empty() {
            let _ = process.control.send(ExecControl::Stdin(stdin)).await;
        }
        if !keep_open {
            let _ = process.control.send(ExecControl::StdinEof).await;
        }
        Ok(process)
    }

    /// Kills everything in the sandbox and removes all it owned. Idempotent.
    async fn destroy(&self, handle: &SandboxHandle) -> Result<()>;

    /// Whether the sandbox's init still lives (and answers, for re-adoption).
    async fn probe(&self, handle: &SandboxHandle) -> Liveness;

    /// At a node's start: takes over a sandbox an earlier node process
    /// left running (`paused`: the node saw it paused, and it stays so),
    /// then probes it. `Dead` for one that cannot be taken over, which the
    /// node then destroys.
    async fn adopt(&self, handle: &SandboxHandle, paused: bool) -> Liveness {
        let _ = paused;
        self.probe(handle).await
    }

    /// The handle of sandbox `id`, rebuilt from what the driver keeps on
    /// the host itself, for a sandbox whose durable record holds none: the
    /// node records a fresh create beside the driver's work (the handle
    /// does not exist yet), so a crash between the two leaves a record
    /// without one. `None`: nothing to rebuild it from (the sandbox never
    /// got that far, or the driver keeps nothing).
    fn recover_handle(&self, id: &str) -> Option<SandboxHandle> {
        let _ = id;
        None
    }

    /// Whether [`Driver::recover_handle`] finds every sandbox this driver
    /// finished making: only then may the node record a create before its
    /// handle exists.
    fn recovers_handles(&self) -> bool {
        false
    }

    /// [`Driver::probe`] as cheaply as the backend can tell whether init
    /// lives: a backend may skip the round trip to init that proves it
    /// answers. For a warm-pool member being claimed (nothing has run in
    /// it yet) and for the reaper's probes between two pings.
    async fn probe_idle(&self, handle: &SandboxHandle) -> Liveness {
        self.probe(handle).await
    }

    /// Readies a sandbox in which nothing has run yet (a warm-pool member
    /// just claimed) for its first exec, while the claim commits: a backend
    /// that talks to its init over a connection may open it now. Best
    /// effort; the exec does whatever this did not.
    async fn prepare_exec(&self, handle: &SandboxHandle) {
        let _ = handle;
    }

    fn usage(&self, handle: &SandboxHandle) -> Result<Usage>;

    /// Counters of the limits the sandbox ran into, read from outside it;
    /// the node turns their rises into `limit_hit` events.
    fn limit_counters(&self, handle: &SandboxHandle) -> Result<LimitCounters> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "limit counters"))
    }

    /// What the driver knows of why a sandbox its probe found dead is gone,
    /// beyond "its init exited" (a VM: its guest console's last words).
    /// Asked before the sandbox is torn down; `None` when nothing is known.
    fn death_detail(&self, handle: &SandboxHandle) -> Option<String> {
        let _ = handle;
        None
    }

    /// Security events recorded in the sandbox after sequence number `after_seq`.
    async fn events(&self, handle: &SandboxHandle, after_seq: u64) -> Result<EventBatch> {
        let _ = (handle, after_seq);
        Err(BackendError::Unsupported(self.backend().as_str(), "security events"))
    }

    /// Makes `phase` the sandbox's current phase (see `warren-init`'s phase
    /// leaders); returns how many processes of earlier phases were killed.
    async fn set_phase(&self, handle: &SandboxHandle, phase: PhaseRules, kill_running: bool) -> Result<u32> {
        let _ = (handle, phase, kill_running);
        Err(BackendError::Unsupported(self.backend().as_str(), "phases"))
    }

    /// Where the node plugs an `allowlist` sandbox's network in: its
    /// network namespace and its cgroup2 directory.
    fn network_target(&self, handle: &SandboxHandle) -> Result<NetworkTarget> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "egress networking"))
    }

    /// What runs a VM sandbox's guest; `None` for backends without one.
    fn accelerator(&self, handle: &SandboxHandle) -> Option<warren_api::Accelerator> {
        let _ = handle;
        None
    }

    /// How a VM sandbox's guest came up; `None` for backends without one.
    fn boot(&self, handle: &SandboxHandle) -> Option<warren_api::VmBoot> {
        let _ = handle;
        None
    }

    /// The root to resolve file API paths in.
    fn fs_root(&self, handle: &SandboxHandle) -> Result<FsRoot> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "file access"))
    }

    /// For a backend without a root the node can open ([`Driver::fs_root`]
    /// unsupported): where the sandbox's init serves the file API itself.
    fn remote_files(&self, handle: &SandboxHandle) -> Result<remote_files::RemoteFiles> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "file access"))
    }

    /// Copies the sandbox's writable layer into the empty directory `dest`
    /// as a read-only layer for new sandboxes (`pack_diff`): ownership is
    /// shifted back to the image's ids, overlay whiteouts and opaque
    /// directories are kept so the layer stacks on the sandbox's own layers.
    /// (The node applies `pack_diff`'s scrub list to the packed image, see
    /// `warren_image::scrub`.) Blocking; the node calls it off the async runtime.
    fn snapshot(&self, handle: &SandboxHandle, dest: &std::path::Path) -> Result<()> {
        let _ = (handle, dest);
        Err(BackendError::Unsupported(self.backend().as_str(), "pack_diff"))
    }

    /// Stops every process of the sandbox where it is (pause) until
    /// [`Driver::resume`]; its memory stays allocated. A paused sandbox must
    /// still [`Driver::probe`] as alive (without answering pings) and be
    /// destroyable. Blocking but short; the node calls it off the runtime.
    fn pause(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "pause"))
    }

    /// As [`Driver::pause`], with the sandbox's memory written to disk and
    /// released (for a VM, QEMU exits); [`Driver::resume`] loads it again.
    /// Pausing to disk a sandbox already paused in memory moves it to disk.
    fn pause_to_disk(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "pause to disk"))
    }

    /// The node's images changed (one was imported, replaced, removed or
    /// collected): a driver drops what it derived from images now gone.
    fn images_changed(&self) {}

    /// Hands the driver the node's capacity books, for work of its own that
    /// holds host memory and CPUs outside any sandbox (see [`HostBooks`]).
    /// Called once, when the node starts.
    fn attach_books(&self, books: std::sync::Arc<dyn HostBooks>) {
        let _ = books;
    }

    /// Lets a paused sandbox run again; a no-op on one that is not paused.
    /// Must be quick: the node calls it inline when a request reaches a
    /// paused sandbox.
    fn resume(&self, handle: &SandboxHandle) -> Result<()> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "resume"))
    }

    /// Removes every sandbox resource (mounts, cgroups, processes, dirs) of
    /// this driver whose id is not in `keep`. Run at start-up.
    async fn sweep(&self, keep: &[String]) -> Result<SweepReport>;

    /// Removes the driver's node-wide resources (such as its parent cgroup
    /// directories) when no sandbox is left; a no-op while some still run.
    async fn release(&self) -> Result<()> {
        Ok(())
    }
}

/// A batch of security events; `dropped` counts events lost to the bounded
/// ring since `after_seq`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EventBatch {
    pub events: Vec<SecurityEvent>,
    pub dropped: u64,
    pub next_seq: u64,
}

/// See [`Driver::limit_counters`]: the same counters a VM's init sends.
/// Full disk or inodes can only be seen as a state (the sandbox's `ENOSPC`
/// is not observable from outside).
pub use warren_init::proto::LimitCounters;

/// What a sweep removed, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    pub sandboxes_removed: Vec<String>,
}

/// Longest sandbox id a driver accepts.
const MAX_ID_BYTES: usize = 40;

/// Ids name directories and cgroups: `[a-z0-9-]`, 1 to 40 bytes. Every
/// driver checks them before an id becomes part of a path.
pub(crate) fn check_id(id: &str) -> Result<()> {
    let valid = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(BackendError::Setup(format!("invalid sandbox id {id:?}: use 1-{MAX_ID_BYTES} of [a-z0-9-]")))
    }
}

#[cfg(test)]
mod id_tests {
    use super::*;

    #[test]
    fn ids_are_checked_before_they_name_paths() {
        assert!(check_id("sb-1").is_ok());
        for bad in ["", "../x", "A", "a/b", "a.b", &"x".repeat(41)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }
}

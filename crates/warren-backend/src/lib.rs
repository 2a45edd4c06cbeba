//! The driver trait every backend implements, and the drivers.
//!
//! Owns: turning a [`SandboxSpec`] into a running sandbox and back into
//! nothing, running processes in it, giving the node a root to resolve file
//! paths in, and sweeping what a crash left behind.
//! Invariant: `destroy` and `sweep` are idempotent and leave no mount,
//! cgroup, process or directory of the sandbox behind.
//! Never: decides policy (admission, deadlines, output caps, idle timeouts):
//! that is the node's job.

pub mod container;
pub mod files;

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_api::{Backend, NetworkMode, Resources, Usage};
pub use warren_init::proto::{ExecSpec, SecurityEvent, SecurityEventKind, SessionState};

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
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    #[error("protocol error talking to warren-init: {0}")]
    Protocol(String),
}

impl BackendError {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        BackendError::Io { context: context.into(), source }
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
    /// PID 1 is gone; `oom` when the out-of-memory killer took it.
    Dead {
        oom: bool,
    },
}

/// A directory fd of the sandbox's root filesystem as the host sees it, and
/// the host uid/gid that the sandbox's root maps to (new files get them).
pub struct FsRoot {
    pub dir: std::os::fd::OwnedFd,
    pub uid: u32,
    pub gid: u32,
}

#[async_trait]
pub trait Driver: Send + Sync {
    fn backend(&self) -> Backend;

    /// Makes the sandbox and returns when its init answers. On error nothing
    /// of it is left behind.
    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle>;

    async fn exec(&self, handle: &SandboxHandle, spec: ExecSpec) -> Result<ExecProcess>;

    /// Kills everything in the sandbox and removes all it owned. Idempotent.
    async fn destroy(&self, handle: &SandboxHandle) -> Result<()>;

    /// Whether the sandbox's init still lives (and answers, for re-adoption).
    async fn probe(&self, handle: &SandboxHandle) -> Liveness;

    fn usage(&self, handle: &SandboxHandle) -> Result<Usage>;

    /// Security events recorded in the sandbox after sequence number `after_seq`.
    async fn events(&self, handle: &SandboxHandle, after_seq: u64) -> Result<EventBatch> {
        let _ = (handle, after_seq);
        Err(BackendError::Unsupported(self.backend().as_str(), "security events"))
    }

    /// The root to resolve file API paths in.
    fn fs_root(&self, handle: &SandboxHandle) -> Result<FsRoot> {
        let _ = handle;
        Err(BackendError::Unsupported(self.backend().as_str(), "file access"))
    }

    /// Copies the sandbox's writable layer into the empty directory `dest`
    /// as a read-only layer for new sandboxes (`pack_diff`): ownership is
    /// shifted back to the image's ids, overlay whiteouts and opaque
    /// directories are kept so the layer stacks on the sandbox's own layers,
    /// and the paths in `scrub` (absolute, inside the sandbox) are removed.
    /// Blocking; the node calls it off the async runtime.
    fn snapshot(&self, handle: &SandboxHandle, dest: &std::path::Path, scrub: &[String]) -> Result<()> {
        let _ = (handle, dest, scrub);
        Err(BackendError::Unsupported(self.backend().as_str(), "pack_diff"))
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

/// What a sweep removed, for logs and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    pub sandboxes_removed: Vec<String>,
}

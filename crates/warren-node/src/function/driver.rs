//! `backend = "function"` sandboxes: a name for a stateless environment.
//!
//! Creating one makes nothing but a record (its image's layers and shape).
//! Every exec runs in a fresh worker - claimed from the function pool of the
//! same image and shape when there is one, else made for it - and the
//! worker is destroyed when the exec ends, so no exec sees what another
//! wrote or left running. What needs state between calls (sessions, files,
//! phases, egress policies, `pack_diff`, security events) answers the
//! driver's typed `unsupported` error.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_api::{Backend, NetworkMode, Resources, Usage};
use warren_backend::{
    BackendError, Driver, ExecControl, ExecEvent, ExecProcess, ExecSpec, Liveness, Result, SandboxHandle, SandboxSpec,
    SweepReport,
};

use super::{Functions, Worker};
use crate::new_id;
use crate::pool::PoolKey;

/// What a function sandbox's handle keeps: enough to make its workers.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FunctionState {
    layers: Vec<PathBuf>,
    resources: Resources,
    network: NetworkMode,
}

pub(crate) struct FunctionDriver {
    functions: Arc<Functions>,
    running: Arc<Running>,
}

/// Workers running an exec, per function sandbox, with the way to kill
/// each one's tree: a destroyed sandbox kills them.
#[derive(Default)]
struct Running(Mutex<HashMap<String, HashMap<String, mpsc::Sender<ExecControl>>>>);

impl Running {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, mpsc::Sender<ExecControl>>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn remove(&self, sandbox: &str, worker: &str) {
        let mut map = self.map();
        if let Some(workers) = map.get_mut(sandbox) {
            workers.remove(worker);
            if workers.is_empty() {
                map.remove(sandbox);
            }
        }
    }
}

impl FunctionDriver {
    pub(crate) fn new(functions: Arc<Functions>) -> Arc<Self> {
        Arc::new(FunctionDriver { functions, running: Arc::default() })
    }

    fn state(handle: &SandboxHandle) -> Result<FunctionState> {
        serde_json::from_value(handle.state.clone())
            .map_err(|e| BackendError::Protocol(format!("not a function sandbox's handle: {e}")))
    }

    async fn worker(&self, sandbox: &str, state: &FunctionState) -> Result<Worker> {
        let shape = PoolKey::new("", &state.resources, state.network);
        let pool = self.functions.pools().values().find(|p| p.layers == state.layers && p.shape == shape).cloned();
        let made = match pool {
            Some(pool) => self.functions.claim(&pool).await.map(|(w, _)| w),
            None => {
                let id = new_id("fn");
                let spec = SandboxSpec {
                    id: id.clone(),
                    layers: state.layers.clone(),
                    resources: state.resources.clone(),
                    network: state.network,
                    hostname: id,
                    phase: Default::default(),
                };
                self.functions.make_unpooled(&spec).await
            }
        };
        made.map_err(|e| match e {
            crate::NodeError::Backend(b) => b,
            crate::NodeError::FunctionQueueFull { .. } => {
                BackendError::Busy(format!("function sandbox {sandbox}: {e}"))
            }
            other => BackendError::Setup(other.to_string()),
        })
    }
}

/// Pumps one exec between the node and its worker, then lets the worker go
/// (which destroys it).
async fn forward(
    mut inner: ExecProcess,
    mut control: mpsc::Receiver<ExecControl>,
    events: mpsc::Sender<ExecEvent>,
    worker: Worker,
    sandbox: String,
    running: Arc<Running>,
) {
    loop {
        tokio::select! {
            ev = inner.events.recv() => {
                let last = !matches!(ev, Some(ExecEvent::Started { .. } | ExecEvent::Stdout(_) | ExecEvent::Stderr(_)));
                let ev = ev.unwrap_or_else(|| ExecEvent::Lost("the worker's channel closed".into()));
                if events.send(ev).await.is_err() || last {
                    break;
                }
            }
            c = control.recv() => match c {
                Some(c) => {
                    let _ = inner.control.send(c).await;
                }
                // The node let go of the exec: the worker goes with it.
                None => break,
            },
        }
    }
    running.remove(&sandbox, &worker.handle.id);
    drop(worker);
}

#[async_trait]
impl Driver for FunctionDriver {
    fn backend(&self) -> Backend {
        Backend::Function
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<SandboxHandle> {
        if !spec.phase.name.is_empty() || !spec.phase.protected_paths.is_empty() {
            return Err(BackendError::Unsupported("function", "phases"));
        }
        if spec.network == NetworkMode::Allowlist {
            return Err(BackendError::Unsupported("function", "egress networking"));
        }
        let state =
            FunctionState { layers: spec.layers.clone(), resources: spec.resources.clone(), network: spec.network };
        let state = serde_json::to_value(state).map_err(|e| BackendError::Protocol(e.to_string()))?;
        Ok(SandboxHandle { id: spec.id.clone(), backend: Backend::Function, state })
    }

    async fn exec(&self, handle: &SandboxHandle, spec: ExecSpec) -> Result<ExecProcess> {
        if spec.capture_session_state {
            return Err(BackendError::Unsupported("function", "sessions"));
        }
        let state = Self::state(handle)?;
        let worker = self.worker(&handle.id, &state).await?;
        let inner = self.functions.container.exec(&worker.handle, spec).await?;
        let (events_tx, events_rx) = mpsc::channel(64);
        let (control_tx, control_rx) = mpsc::channel(16);
        self.running
            .map()
            .entry(handle.id.clone())
            .or_default()
            .insert(worker.handle.id.clone(), inner.control.clone());
        tokio::spawn(forward(inner, control_rx, events_tx, worker, handle.id.clone(), Arc::clone(&self.running)));
        Ok(ExecProcess { events: events_rx, control: control_tx })
    }

    async fn destroy(&self, handle: &SandboxHandle) -> Result<()> {
        let workers = self.running.map().remove(&handle.id).unwrap_or_default();
        for kill in workers.into_values() {
            let _ = kill.send(ExecControl::Kill).await;
        }
        Ok(())
    }

    async fn probe(&self, handle: &SandboxHandle) -> Liveness {
        match Self::state(handle) {
            Ok(_) => Liveness::Alive,
            Err(_) => Liveness::Dead { oom: false },
        }
    }

    fn usage(&self, _handle: &SandboxHandle) -> Result<Usage> {
        Ok(Usage::default())
    }

    async fn sweep(&self, _keep: &[String]) -> Result<SweepReport> {
        // Workers are container sandboxes: the container driver's sweep removes them.
        Ok(SweepReport::default())
    }
}

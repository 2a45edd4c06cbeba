//! `backend = "function"` sandboxes: a name for a stateless environment.
//!
//! Creating one makes nothing but a record (its image's layers and shape).
//! Every exec runs in a fresh worker - claimed from the function pool of the
//! same image and shape when there is one, else made for it - and the
//! worker is destroyed when the exec ends, so no exec sees what another
//! wrote or left running. What needs state between calls (sessions, files,
//! phases, egress policies, `pack_diff`) answers the driver's typed
//! `unsupported` error.
//!
//! What a function sandbox does keep: the security events of its workers
//! (pulled from each worker's init before the exec's end is reported, so a
//! client that reads the events after the result sees them), and a pause
//! that freezes the workers running its execs (an exec started while the
//! sandbox is paused resumes it first, as for every backend).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_api::{Backend, NetworkMode, Resources, Usage};
use warren_backend::{
    BackendError, Driver, EventBatch, ExecControl, ExecEvent, ExecProcess, ExecSpec, Liveness, Result, SandboxHandle,
    SandboxSpec, SecurityEvent, SweepReport,
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

/// Per function sandbox: the workers running its execs (with the way to
/// kill each one's tree: a destroyed sandbox kills them) and the security
/// events its finished workers reported.
#[derive(Default)]
struct Running(Mutex<HashMap<String, SandboxWork>>);

#[derive(Default)]
struct SandboxWork {
    workers: HashMap<String, (SandboxHandle, mpsc::Sender<ExecControl>)>,
    events: VecDeque<SecurityEvent>,
    /// `seq` of the last event kept (the sandbox's own numbering).
    last_seq: u64,
    /// Events dropped from the front of the bounded ring.
    dropped: u64,
}

impl SandboxWork {
    fn keep(&mut self, events: Vec<SecurityEvent>) {
        for mut event in events {
            self.last_seq += 1;
            event.seq = self.last_seq;
            if self.events.len() == EVENTS_KEPT {
                self.events.pop_front();
                self.dropped += 1;
            }
            self.events.push_back(event);
        }
    }
}

/// Events kept per function sandbox, as the node keeps per sandbox.
const EVENTS_KEPT: usize = crate::events::RING_CAPACITY;

impl Running {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, SandboxWork>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn worker_handles(&self, sandbox: &str) -> Vec<SandboxHandle> {
        self.map().get(sandbox).map(|w| w.workers.values().map(|(h, _)| h.clone()).collect()).unwrap_or_default()
    }

    /// Lets the worker go and keeps what it reported.
    fn finish(&self, sandbox: &str, worker: &str, events: Vec<SecurityEvent>) {
        if let Some(work) = self.map().get_mut(sandbox) {
            work.workers.remove(worker);
            work.keep(events);
        }
    }
}

impl FunctionDriver {
    pub(crate) fn new(functions: Arc<Functions>) -> Arc<Self> {
        Arc::new(FunctionDriver { functions, running: Arc::default() })
    }

    /// Runs `op` on each worker running one of the sandbox's execs; a
    /// worker whose exec ended meanwhile is being destroyed and skipped.
    fn on_running_workers(&self, handle: &SandboxHandle, op: impl Fn(&SandboxHandle) -> Result<()>) -> Result<()> {
        let _ = Self::state(handle)?;
        for worker in self.running.worker_handles(&handle.id) {
            match op(&worker) {
                Ok(()) | Err(BackendError::Gone) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
/// (which destroys it). The worker's security events are pulled before the
/// exec's last event is passed on.
async fn forward(
    mut inner: ExecProcess,
    mut control: mpsc::Receiver<ExecControl>,
    events: mpsc::Sender<ExecEvent>,
    worker: Worker,
    container: Arc<dyn Driver>,
    sandbox: String,
    running: Arc<Running>,
) {
    let mut last_event = None;
    loop {
        tokio::select! {
            ev = inner.events.recv() => {
                let last = !matches!(ev, Some(ExecEvent::Started { .. } | ExecEvent::Stdout(_) | ExecEvent::Stderr(_)));
                let ev = ev.unwrap_or_else(|| ExecEvent::Lost("the worker's channel closed".into()));
                if last {
                    last_event = Some(ev);
                    break;
                }
                if events.send(ev).await.is_err() {
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
    // A worker that cannot answer any more reported nothing more.
    let reported = container.events(&worker.handle, 0).await.map(|b| b.events).unwrap_or_default();
    running.finish(&sandbox, &worker.handle.id, reported);
    drop(worker);
    if let Some(ev) = last_event {
        let _ = events.send(ev).await;
    }
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
            .workers
            .insert(worker.handle.id.clone(), (worker.handle.clone(), inner.control.clone()));
        let container = Arc::clone(&self.functions.container);
        tokio::spawn(forward(
            inner,
            control_rx,
            events_tx,
            worker,
            container,
            handle.id.clone(),
            Arc::clone(&self.running),
        ));
        Ok(ExecProcess { events: events_rx, control: control_tx })
    }

    async fn destroy(&self, handle: &SandboxHandle) -> Result<()> {
        let work = self.running.map().remove(&handle.id).unwrap_or_default();
        for (worker, kill) in work.workers.into_values() {
            // A frozen worker could not die of the kill.
            let _ = self.functions.container.resume(&worker);
            let _ = kill.send(ExecControl::Kill).await;
        }
        Ok(())
    }

    async fn events(&self, handle: &SandboxHandle, after_seq: u64) -> Result<EventBatch> {
        let _ = Self::state(handle)?;
        let map = self.running.map();
        let Some(work) = map.get(&handle.id) else {
            return Ok(EventBatch { events: Vec::new(), dropped: 0, next_seq: after_seq });
        };
        let events: Vec<SecurityEvent> = work.events.iter().filter(|e| e.seq > after_seq).cloned().collect();
        Ok(EventBatch { events, dropped: work.dropped, next_seq: work.last_seq })
    }

    /// Freezes the workers running the sandbox's execs; with none running
    /// there is nothing to stop and the pause is the state alone.
    fn pause(&self, handle: &SandboxHandle) -> Result<()> {
        self.on_running_workers(handle, |worker| self.functions.container.pause(worker))
    }

    fn resume(&self, handle: &SandboxHandle) -> Result<()> {
        self.on_running_workers(handle, |worker| self.functions.container.resume(worker))
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

//! The python fork server of a function pool: long-lived "zygotes" that
//! fork one pristine child per call, so that neither a container create
//! nor the interpreter's start-up is paid per call.
//!
//! A zygote is a container sandbox made exactly like a one-use worker (the
//! container driver, the guard's profile, the pool's shape) running the
//! image's `python3 -c` with the bootstrap `zygote.py`, through an ordinary
//! exec whose stdin and stdout are the control channel. The bootstrap
//! initialises the interpreter once and never reads a call: per call it has
//! forked a *leader* ahead of time, which has forked the child ahead of
//! time too (the child does all it can before the request: the call's
//! path holds no fork and few copy-on-write faults), passes the request
//! on, frames the child's stdout and stderr (pipes it owns, so user code
//! never touches the channel), reports the exit (`X`), then kills
//! everything the call left (it is a child subreaper), removes its SysV
//! IPC, says so (`D`) and exits. The node answers the call on `X`; the
//! zygote serves again only after `D`. The child enters its own
//! Landlock domain first: writes only beneath its call directory, no
//! signal, ptrace or abstract socket outside the domain; then it becomes
//! `nobody`, so that it cannot change the mode, owner, times or xattrs of
//! the zygote's files either (Landlock does not guard those). A child that
//! cannot do so fails the call's set-up (fail closed) and the pool turns to
//! one-use workers for python.
//!
//! A zygote serves one call at a time; the node writes the call's files
//! into a fresh call directory (the call's `cwd`, which must not exist in
//! the image) before the request, reads `fetch` back after the exit report
//! and removes the directory before the zygote takes another call. A zygote
//! that dies, answers garbage or ignores a kill is destroyed and the call
//! ends typed (`killed`, `oom` or `timed_out`), never hanging.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use warren_backend::{ExecControl, ExecEvent, ExecProcess, ExecSpec, ExitInfo, SandboxHandle};

use super::{Demand, FunctionPool, Functions};

/// Linux's SIGKILL, as the exit report numbers signals.
const SIGKILL: i32 = 9;
/// The bootstrap every zygote runs with `python3 -c`.
const BOOTSTRAP: &str = include_str!("zygote.py");
/// A zygote that has not reported ready by then is given up.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Frames carry at most 64 KiB of output; anything far larger is garbage.
const MAX_FRAME_BYTES: usize = 1 << 20;
/// Zygotes one pool makes at the same time.
const MAKERS: usize = 2;
/// How long a leader may take, after its exit report, to kill what its
/// call left and remove its IPC before its zygote is given up.
const SWEEP_TIMEOUT: Duration = Duration::from_secs(10);
/// Zygotes that broke while serving a call, in a row, after which the
/// pool's python calls run on one-use workers for good: a fork server that
/// keeps dying fails the call it held each time and costs a new sandbox.
const BREAKS_IN_A_ROW: usize = 3;

/// Why a zygote could not be made or used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForkError {
    /// The image or the kernel cannot host a fork server (no python, no
    /// Landlock scopes): its python calls run on one-use workers.
    #[error("the python fork server cannot run here: {0}")]
    Unusable(String),
    /// Making this one failed (a transient error of the container driver).
    #[error("cannot make a fork server: {0}")]
    Make(String),
}

/// Whether a pool's python calls can use zygotes.
#[derive(Debug, Clone, PartialEq)]
enum ForkState {
    Untried,
    Usable,
    Unusable(String),
}

/// The zygotes of one pool, and the demand of its python calls.
pub(crate) struct ForkPool {
    idle: Mutex<VecDeque<Zygote>>,
    /// Zygotes that reported ready and are not destroyed yet: idle, serving
    /// a call or settling after one.
    live: Arc<AtomicUsize>,
    making: AtomicUsize,
    /// Zygotes whose call was answered and whose leader is still sweeping.
    settling: AtomicUsize,
    state: Mutex<ForkState>,
    /// Python calls waiting for admission, running, or settling after
    /// their answer (they hold a zygote until it is back).
    calls: AtomicUsize,
    demand: Mutex<Demand>,
    /// A python call came: the filler keeps zygotes from then on.
    seen: AtomicBool,
    /// Zygotes broken while serving a call since the last clean call.
    breaks: AtomicUsize,
}

impl ForkPool {
    pub(crate) fn new() -> Self {
        ForkPool {
            idle: Mutex::new(VecDeque::new()),
            live: Arc::new(AtomicUsize::new(0)),
            making: AtomicUsize::new(0),
            settling: AtomicUsize::new(0),
            state: Mutex::new(ForkState::Untried),
            calls: AtomicUsize::new(0),
            demand: Mutex::new(Demand::new()),
            seen: AtomicBool::new(false),
            breaks: AtomicUsize::new(0),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, VecDeque<Zygote>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ForkState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn usable(&self) -> bool {
        !matches!(*self.state(), ForkState::Unusable(_))
    }

    pub(crate) fn idle_count(&self) -> usize {
        self.idle().len()
    }

    /// Zygotes being made or settling after a call: shutdown waits for them.
    pub(crate) fn making(&self) -> usize {
        self.making.load(Ordering::SeqCst) + self.settling.load(Ordering::SeqCst)
    }

    pub(crate) fn settling_started(&self) {
        self.settling.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn settling_done(&self) {
        self.settling.fetch_sub(1, Ordering::SeqCst);
    }

    /// Python calls in flight or waiting: the part of the pool's demand
    /// that zygotes, not workers, serve.
    pub(crate) fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    fn mark_unusable(&self, why: &str, image: &str) {
        let mut state = self.state();
        if !matches!(*state, ForkState::Unusable(_)) {
            tracing::warn!(image, "python calls fall back to one-use workers: {why}");
            *state = ForkState::Unusable(why.to_string());
        }
    }

    /// Notes a zygote that broke while serving a call; the pool falls back
    /// to workers at the third in a row. Returns whether it did.
    fn note_break(&self, why: &str, image: &str) -> bool {
        let breaks = self.breaks.fetch_add(1, Ordering::SeqCst) + 1;
        if breaks < BREAKS_IN_A_ROW {
            return false;
        }
        self.mark_unusable(
            &format!("{breaks} fork servers in a row broke while serving a call (the last: {why})"),
            image,
        );
        true
    }

    /// Zygotes wanted alive now (idle, serving or settling): the recent
    /// peak of python calls within the pool's bounds, none before the first
    /// python call or once unusable. A call holds its zygote from its claim
    /// until the zygote is back, and is counted as long, so this many never
    /// leave a call without an idle zygote; zygotes are reused, so the ones
    /// serving calls count (counting idle ones only made a spare during
    /// every call and dropped one after it).
    pub(crate) fn target(&self, min: usize, max: usize) -> usize {
        let peak = self.demand.lock().unwrap_or_else(|p| p.into_inner()).note(self.calls());
        if !self.seen.load(Ordering::SeqCst) || !self.usable() {
            return 0;
        }
        peak.clamp(min, max)
    }

    fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Whether the filler has zygotes to make for `target`.
    fn short_of(&self, target: usize) -> bool {
        self.live() + self.making.load(Ordering::SeqCst) < target
    }

    /// The idle zygotes beyond the first `keep`, to be dropped (which
    /// destroys them): the least recently used go, the warmest stay.
    pub(crate) fn take_idle(&self, keep: usize) -> VecDeque<Zygote> {
        let mut idle = self.idle();
        let keep = keep.min(idle.len());
        idle.split_off(keep)
    }
}

/// Counts a python call in the pool's zygote demand while it lives.
pub(crate) struct ForkDemand(Arc<FunctionPool>);

impl ForkDemand {
    /// Wakes the filler when the pool has fewer zygotes than calls now.
    pub(crate) fn new(pool: &Arc<FunctionPool>, functions: &Functions) -> Self {
        pool.fork.seen.store(true, Ordering::SeqCst);
        pool.fork.calls.fetch_add(1, Ordering::SeqCst);
        if pool.fork.short_of(pool.fork.target(pool.min, pool.max)) {
            functions.wake.notify_one();
        }
        ForkDemand(Arc::clone(pool))
    }
}

impl Drop for ForkDemand {
    fn drop(&mut self) {
        self.0.fork.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One zygote: its sandbox and the control channel to its bootstrap.
/// Dropping it destroys the sandbox (in the background).
pub(crate) struct Zygote {
    pub(crate) handle: SandboxHandle,
    control: mpsc::Sender<ExecControl>,
    events: mpsc::Receiver<ExecEvent>,
    frames: Frames,
    /// The sandbox's OOM kills seen so far: a rise during a call whose
    /// child died of SIGKILL means the call ran out of memory.
    oom_kills: u64,
    functions: Arc<Functions>,
    /// Its pool's count of live zygotes, once it counts there (ready).
    live: Option<Arc<AtomicUsize>>,
}

impl Drop for Zygote {
    fn drop(&mut self) {
        if let Some(live) = &self.live {
            live.fetch_sub(1, Ordering::SeqCst);
        }
        self.functions.destroy_later(self.handle.clone());
        self.functions.wake.notify_one();
    }
}

/// What the bootstrap sends: 1 byte kind, 4 bytes big-endian length, payload.
#[derive(Debug, PartialEq)]
enum Frame {
    Ready,
    Stdout(Bytes),
    Stderr(Bytes),
    Exit(Vec<u8>),
    /// After `Exit`: nothing of the call is left in the sandbox.
    Swept,
    Fatal(String),
}

/// Reassembles frames from the zygote's stdout, which arrives in chunks of
/// any size.
#[derive(Default)]
struct Frames(Vec<u8>);

impl Frames {
    fn push(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn next(&mut self) -> Result<Option<Frame>, String> {
        if self.0.len() < 5 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.0[1], self.0[2], self.0[3], self.0[4]]) as usize;
        if len > MAX_FRAME_BYTES {
            return Err(format!("a frame of {len} bytes"));
        }
        if self.0.len() < 5 + len {
            return Ok(None);
        }
        let kind = self.0[0];
        let payload: Vec<u8> = self.0[5..5 + len].to_vec();
        self.0.drain(..5 + len);
        Ok(Some(match kind {
            b'R' => Frame::Ready,
            b'O' => Frame::Stdout(payload.into()),
            b'E' => Frame::Stderr(payload.into()),
            b'X' => Frame::Exit(payload),
            b'D' => Frame::Swept,
            b'F' => Frame::Fatal(String::from_utf8_lossy(&payload).into_owned()),
            other => return Err(format!("a frame of unknown kind {other}")),
        }))
    }
}

fn frame(kind: u8, payload: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(kind);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.into()
}

/// How a zygote stopped answering.
#[derive(Debug)]
enum Gone {
    /// Its process ended; `oom` when the OOM killer took it.
    Ended { oom: bool },
    /// It said why (the bootstrap's last words).
    Fatal(String),
    /// It sent what is not a frame.
    Garbage(String),
}

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gone::Ended { oom: true } => write!(f, "the fork server was killed for memory"),
            Gone::Ended { oom: false } => write!(f, "the fork server ended"),
            Gone::Fatal(why) => write!(f, "{why}"),
            Gone::Garbage(why) => write!(f, "the fork server sent {why}"),
        }
    }
}

impl Zygote {
    async fn next_frame(&mut self) -> Result<Frame, Gone> {
        loop {
            match self.frames.next() {
                Ok(Some(Frame::Fatal(why))) => return Err(Gone::Fatal(why)),
                Ok(Some(f)) => return Ok(f),
                Ok(None) => {}
                Err(e) => return Err(Gone::Garbage(e)),
            }
            match self.events.recv().await {
                Some(ExecEvent::Stdout(b)) => self.frames.push(&b),
                Some(ExecEvent::Stderr(b)) => {
                    tracing::warn!(zygote = %self.handle.id, "fork server: {}", String::from_utf8_lossy(&b).trim_end());
                }
                Some(ExecEvent::Started { .. }) => {}
                Some(ExecEvent::Exited(info)) => return Err(Gone::Ended { oom: info.oom }),
                Some(ExecEvent::Lost(_)) | None => return Err(Gone::Ended { oom: false }),
            }
        }
    }

    async fn send(&self, kind: u8, payload: &[u8]) -> bool {
        self.control.send(ExecControl::Stdin(frame(kind, payload))).await.is_ok()
    }
}

/// Makes one zygote for `pool`: a worker sandbox running the bootstrap
/// with the image's `python3`, ready once it has proven a child can enter
/// its own Landlock domain.
async fn make(functions: &Arc<Functions>, pool: &FunctionPool) -> Result<Zygote, ForkError> {
    let handle = functions.container.create(&pool.spec()).await.map_err(|e| ForkError::Make(e.to_string()))?;
    // From here on dropping the zygote (or this guard) destroys the sandbox.
    let guard = SandboxGuard(Some(handle.clone()), Arc::clone(functions));
    let root = functions.container.fs_root(&handle).map_err(|e| ForkError::Make(e.to_string()))?;
    let python = tokio::task::spawn_blocking(move || super::run::find_toolchain(&root, warren_api::Language::Python))
        .await
        .map_err(|e| ForkError::Make(e.to_string()))?
        .ok_or_else(|| ForkError::Unusable("the image has no python3".into()))?;
    let spec = ExecSpec {
        argv: vec![python, "-c".into(), BOOTSTRAP.into()],
        env: crate::base_env(&BTreeMap::new()),
        cwd: "/".into(),
        capture_session_state: false,
    };
    let process = functions.container.exec(&handle, spec).await.map_err(|e| ForkError::Make(e.to_string()))?;
    let mut zygote = Zygote {
        handle: guard.disarm(),
        control: process.control,
        events: process.events,
        frames: Frames::default(),
        oom_kills: 0,
        functions: Arc::clone(functions),
        live: None,
    };
    zygote.oom_kills = functions.container.limit_counters(&zygote.handle).map(|c| c.oom_kills).unwrap_or(0);
    match tokio::time::timeout(READY_TIMEOUT, zygote.next_frame()).await {
        Ok(Ok(Frame::Ready)) => {
            pool.fork.live.fetch_add(1, Ordering::SeqCst);
            zygote.live = Some(Arc::clone(&pool.fork.live));
            Ok(zygote)
        }
        Ok(Ok(other)) => Err(ForkError::Unusable(format!("it answered {other:?} before ready"))),
        Ok(Err(Gone::Fatal(why))) => Err(ForkError::Unusable(why)),
        Ok(Err(gone)) => Err(ForkError::Make(gone.to_string())),
        Err(_) => Err(ForkError::Make(format!("not ready after {READY_TIMEOUT:?}"))),
    }
}

/// Destroys a sandbox on drop unless disarmed.
struct SandboxGuard(Option<SandboxHandle>, Arc<Functions>);

impl SandboxGuard {
    fn disarm(mut self) -> SandboxHandle {
        self.0.take().expect("armed until disarmed")
    }
}

impl Drop for SandboxGuard {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            self.1.destroy_later(h);
        }
    }
}

/// Makes a zygote and notes what its failure says about the pool.
async fn make_for(functions: &Arc<Functions>, pool: &Arc<FunctionPool>) -> Option<Zygote> {
    match make(functions, pool).await {
        Ok(z) => {
            let mut state = pool.fork.state();
            if *state == ForkState::Untried {
                tracing::info!(image = %pool.image, "python calls run on fork servers");
                *state = ForkState::Usable;
            }
            Some(z)
        }
        Err(ForkError::Unusable(why)) => {
            pool.fork.mark_unusable(&why, &pool.image);
            None
        }
        Err(e) => {
            tracing::warn!(image = %pool.image, "{e}");
            None
        }
    }
}

/// Takes an idle zygote of an admitted call, or makes one; `None` when
/// the pool's python calls must run on workers.
pub(crate) async fn claim(functions: &Arc<Functions>, pool: &Arc<FunctionPool>) -> Option<(Zygote, bool)> {
    if !pool.fork.usable() {
        return None;
    }
    // The filler is not woken: a claim changes no count it looks at (the
    // call's demand woke it if the pool was short).
    let popped = pool.fork.idle().pop_front();
    match popped {
        Some(z) => Some((z, true)),
        None => make_for(functions, pool).await.map(|z| (z, false)),
    }
}

/// The filler's pass over a pool's zygotes.
pub(crate) fn fill(functions: &Arc<Functions>, pool: &Arc<FunctionPool>) {
    let target = pool.fork.target(pool.min, pool.max);
    let idle = pool.fork.idle_count();
    let (surplus, make) = plan(target, pool.fork.live(), idle, pool.fork.making.load(Ordering::SeqCst));
    drop(pool.fork.take_idle(idle - surplus));
    for _ in 0..make {
        pool.fork.making.fetch_add(1, Ordering::SeqCst);
        let (functions, pool) = (Arc::clone(functions), Arc::clone(pool));
        tokio::spawn(async move {
            let made = make_for(&functions, &pool).await;
            if let Some(z) = made {
                // Dropped (destroyed) instead when the node stopped meanwhile.
                if !functions.closed.load(Ordering::SeqCst) {
                    pool.fork.idle().push_back(z);
                }
            }
            pool.fork.making.fetch_sub(1, Ordering::SeqCst);
            functions.destroyed.notify_waiters();
            functions.wake.notify_one();
        });
    }
}

/// The filler's plan for a pool's zygotes: how many idle ones to drop and
/// how many to start making, given the `target` of live ones, the `live`
/// ones (idle, serving or settling), the `idle` ones and those `making`.
/// Only idle zygotes are dropped; at most [`MAKERS`] are made at a time.
fn plan(target: usize, live: usize, idle: usize, making: usize) -> (usize, usize) {
    let surplus = live.saturating_sub(target).min(idle);
    let make = target.saturating_sub(live + making).min(MAKERS.saturating_sub(making));
    (surplus, make)
}

/// The request a leader passes to its child (as JSON), and the call's
/// stdin, which the leader writes and which is sent raw beside the JSON.
#[derive(Serialize)]
pub(crate) struct ForkRequest {
    pub(crate) code: String,
    pub(crate) args: Vec<String>,
    pub(crate) env: BTreeMap<String, String>,
    pub(crate) cwd: String,
    #[serde(skip)]
    pub(crate) stdin: Vec<u8>,
}

impl ForkRequest {
    /// A `C` frame's payload: the JSON's length (4 bytes big-endian), the
    /// JSON, the stdin.
    fn payload(&self) -> Result<Vec<u8>, String> {
        let json = serde_json::to_vec(self).map_err(|e| e.to_string())?;
        let len = u32::try_from(json.len()).map_err(|_| format!("a request of {} bytes", json.len()))?;
        let mut out = Vec::with_capacity(4 + json.len() + self.stdin.len());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&json);
        out.extend_from_slice(&self.stdin);
        Ok(out)
    }
}

/// A leader's exit report.
#[derive(Deserialize)]
struct ExitReport {
    #[serde(default)]
    setup_error: Option<String>,
    #[serde(default)]
    killed: bool,
    exit_code: Option<i32>,
    signal: Option<i32>,
    #[serde(default)]
    cpu_ns: u64,
    #[serde(default)]
    peak_memory_bytes: u64,
}

/// How a call's relay ended.
pub(crate) enum Relayed {
    /// The call ran and its exit went out as the process's `Exited`; the
    /// leader's sweep of what the call left follows ([`swept`]).
    Exited(Zygote),
    /// The child could not isolate itself; the user code never ran.
    SetupFailed(Zygote, String),
    /// The zygote is unusable (dead, garbage, unresponsive): destroy it.
    /// The process ended `Lost` (or `Exited` with `oom`).
    Broken(Zygote, String),
}

/// Starts `request` on `zygote`. Returns the call's process, which behaves
/// like an exec's (output, then one `Exited` or `Lost`; `Kill` kills the
/// call's tree), and the relay that feeds it from the zygote's frames until
/// the exit report. The relay is a future to poll beside the process's
/// consumer in the same task: no task of its own, so an output frame costs
/// one wake-up of the call's task, not two.
pub(crate) async fn start(
    zygote: Zygote,
    request: &ForkRequest,
) -> Result<(ExecProcess, impl std::future::Future<Output = Relayed>), (Zygote, String)> {
    let payload = match request.payload() {
        Ok(p) => p,
        Err(e) => return Err((zygote, e)),
    };
    if !zygote.send(b'C', &payload).await {
        return Err((zygote, "the fork server's channel is closed".into()));
    }
    let (events_tx, events_rx) = mpsc::channel(64);
    let (control_tx, control_rx) = mpsc::channel(16);
    Ok((ExecProcess { events: events_rx, control: control_tx }, relay(zygote, control_rx, events_tx)))
}

/// Passes one call's frames on as exec events until its exit report.
async fn relay(
    mut zygote: Zygote,
    mut control: mpsc::Receiver<ExecControl>,
    events: mpsc::Sender<ExecEvent>,
) -> Relayed {
    let channel = zygote.control.clone();
    let mut kill_sent = false;
    let why = loop {
        tokio::select! {
            f = zygote.next_frame() => match f {
                Ok(Frame::Stdout(b)) => { let _ = events.send(ExecEvent::Stdout(b)).await; }
                Ok(Frame::Stderr(b)) => { let _ = events.send(ExecEvent::Stderr(b)).await; }
                Ok(Frame::Exit(json)) => {
                    let report: ExitReport = match serde_json::from_slice(&json) {
                        Ok(r) => r,
                        Err(e) => break format!("a bad exit report: {e}"),
                    };
                    if let Some(why) = report.setup_error {
                        return Relayed::SetupFailed(zygote, why);
                    }
                    let info = exit_info(&mut zygote, &report);
                    let _ = events.send(ExecEvent::Exited(info)).await;
                    return Relayed::Exited(zygote);
                }
                Ok(other) => break format!("an unexpected {other:?}"),
                Err(Gone::Ended { oom: true }) => {
                    let _ = events.send(ExecEvent::Exited(killed_for_memory())).await;
                    return Relayed::Broken(zygote, Gone::Ended { oom: true }.to_string());
                }
                Err(gone) => break gone.to_string(),
            },
            c = control.recv() => match c {
                Some(ExecControl::Kill) if !kill_sent => {
                    kill_sent = true;
                    let _ = channel.send(ExecControl::Stdin(frame(b'K', b""))).await;
                }
                Some(_) => {}
                // The exec's owner gave up on it (a kill went unanswered).
                None => break "the call was abandoned".to_string(),
            },
        }
    };
    let _ = events.send(ExecEvent::Lost(why.clone())).await;
    Relayed::Broken(zygote, why)
}

/// Waits, after a call's exit report, for its leader to say that nothing
/// of the call is left; an error means the zygote must be destroyed
/// ([`broke`]).
pub(crate) async fn swept(pool: &FunctionPool, zygote: &mut Zygote) -> Result<(), String> {
    let swept = match tokio::time::timeout(SWEEP_TIMEOUT, zygote.next_frame()).await {
        Ok(Ok(Frame::Swept)) => Ok(()),
        Ok(Ok(other)) => Err(format!("an unexpected {other:?} after the exit")),
        Ok(Err(gone)) => Err(gone.to_string()),
        Err(_) => Err(format!("no sweep within {SWEEP_TIMEOUT:?} of the exit")),
    };
    if swept.is_ok() {
        pool.fork.breaks.store(0, Ordering::SeqCst);
    }
    swept
}

/// Destroys a zygote that broke while serving a call (it is replaced);
/// the third in a row without a clean call between sends the pool's python
/// calls to one-use workers.
pub(crate) fn broke(pool: &FunctionPool, zygote: Zygote, why: &str) {
    tracing::warn!(zygote = %zygote.handle.id, "a fork server is replaced: {why}");
    drop(zygote);
    if pool.fork.note_break(why, &pool.image) {
        drop(pool.fork.take_idle(0));
    }
}

fn exit_info(zygote: &mut Zygote, report: &ExitReport) -> ExitInfo {
    let mut oom = false;
    if report.signal == Some(SIGKILL) && !report.killed {
        if let Ok(c) = zygote.functions.container.limit_counters(&zygote.handle) {
            oom = c.oom_kills > zygote.oom_kills;
            zygote.oom_kills = c.oom_kills;
        }
    }
    ExitInfo {
        exit_code: report.exit_code,
        signal: report.signal,
        killed: report.killed,
        oom,
        cpu_time: Duration::from_nanos(report.cpu_ns),
        peak_memory_bytes: report.peak_memory_bytes,
        session_state: None,
    }
}

fn killed_for_memory() -> ExitInfo {
    ExitInfo {
        exit_code: None,
        signal: Some(SIGKILL),
        killed: false,
        oom: true,
        cpu_time: Duration::ZERO,
        peak_memory_bytes: 0,
        session_state: None,
    }
}

/// Returns a zygote that is ready for a call to its pool's idle list.
pub(crate) fn put_back(pool: &FunctionPool, zygote: Zygote) {
    if zygote.functions.closed.load(Ordering::SeqCst) {
        return;
    }
    // Most recently used first: the warmest is taken next, the coldest is
    // the one dropped. The filler need not look: a zygote coming back
    // changes no count it acts on.
    pool.fork.idle().push_front(zygote);
}

/// Marks the pool's python calls as unable to fork (a child could not
/// isolate itself).
pub(crate) fn give_up(pool: &FunctionPool, why: &str) {
    pool.fork.mark_unusable(why, &pool.image);
    drop(pool.fork.take_idle(0));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_reassembled_from_chunks_of_any_size() {
        let mut wire = frame(b'O', b"hello").to_vec();
        wire.extend_from_slice(&frame(b'X', b"{}"));
        wire.extend_from_slice(&frame(b'D', b""));
        let mut frames = Frames::default();
        let mut got = Vec::new();
        for byte in wire {
            frames.push(&[byte]);
            while let Some(f) = frames.next().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, [Frame::Stdout(Bytes::from_static(b"hello")), Frame::Exit(b"{}".to_vec()), Frame::Swept]);
    }

    #[test]
    fn a_request_carries_its_stdin_raw_after_the_json() {
        let request = ForkRequest {
            code: "print(1)".into(),
            args: vec!["a".into()],
            env: BTreeMap::from([("HOME".to_string(), "/w".to_string())]),
            cwd: "/w".into(),
            stdin: b"\x00raw\xff".to_vec(),
        };
        let payload = request.payload().unwrap();
        let len = u32::from_be_bytes(payload[..4].try_into().unwrap()) as usize;
        let json: serde_json::Value = serde_json::from_slice(&payload[4..4 + len]).unwrap();
        assert_eq!(json, serde_json::json!({"code": "print(1)", "args": ["a"], "env": {"HOME": "/w"}, "cwd": "/w"}));
        assert_eq!(&payload[4 + len..], b"\x00raw\xff");
    }

    #[test]
    fn zygotes_serving_calls_count_toward_the_target() {
        // A steady caller's one zygote, serving its call: no spare is made...
        assert_eq!(plan(1, 1, 0, 0), (0, 0));
        // ...so none is dropped when it comes back.
        assert_eq!(plan(1, 1, 1, 0), (0, 0));
        // Demand fell: idle ones above the target go, never a busy one.
        assert_eq!(plan(1, 3, 1, 0), (1, 0));
        assert_eq!(plan(1, 3, 3, 0), (2, 0));
        // Demand rose: the ones being made count, at most MAKERS at a time.
        assert_eq!(plan(6, 1, 0, 0), (0, MAKERS));
        assert_eq!(plan(6, 4, 0, 1), (0, 1));
        assert_eq!(plan(6, 5, 1, 1), (0, 0));
    }

    #[test]
    fn a_pool_falls_back_to_workers_after_three_broken_fork_servers_in_a_row() {
        let pool = ForkPool::new();
        assert!(!pool.note_break("gone", "img") && !pool.note_break("gone", "img"));
        // A clean call between breaks starts the count again.
        pool.breaks.store(0, Ordering::SeqCst);
        assert!(!pool.note_break("gone", "img") && !pool.note_break("gone", "img"));
        assert!(pool.usable());
        assert!(pool.note_break("gone", "img"));
        assert!(!pool.usable());
        assert_eq!(pool.target(1, 4), 0, "no zygote is kept once the pool fell back");
    }

    #[test]
    fn garbage_on_the_channel_is_an_error_not_a_wait() {
        let mut frames = Frames::default();
        frames.push(&[b'Z', 0, 0, 0, 1, b'x']);
        assert!(frames.next().is_err());
        let mut huge = Frames::default();
        huge.push(&[b'O', 0xff, 0xff, 0xff, 0xff]);
        assert!(huge.next().is_err());
    }
}

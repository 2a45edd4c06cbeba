//! The trajectory log: every mutating call on a sandbox (exec, session
//! create and command, file write, remove and mkdir, phase and network
//! change) as one totally ordered, persistent list of steps in the state
//! store, with the request, its hash, the result and the timings.
//!
//! A step is *claimed* with an atomic `put_if_absent` of its key before the
//! call runs, so of any number of calls with one step exactly one runs; the
//! others are answered from the log (same request hash), attach to the
//! running call (an exec still running), or are refused as diverged
//! (another hash). A call that fails releases its step: only calls that
//! took effect stay in the log. A call without a step takes the next free
//! one (`last + 1`, retried on collision).
//!
//! Storage: [`Table::Trajectories`] holds one row per sandbox (what it was
//! made from, and when it ended); [`Table::TrajectorySteps`] the steps,
//! keyed `<sandbox>/<step:020>`. Exec output above [`INLINE_OUTPUT_BYTES`]
//! and the bytes of uploads up to [`KEEP_UPLOAD_BYTES`] (so a replay can
//! write them again; each sandbox's up to `NodeConfig::upload_retention_bytes`)
//! are data files under `<data_dir>/trajectory/<sandbox>/`,
//! named by their sha256. The log outlives the sandbox by the node's
//! `trajectory_retention`. Exec output counts against the sandbox's output
//! budget (see `retention`): past it the oldest steps' output is dropped
//! (`output_ref: expired`) and its data file removed.

use std::io::Write as _;
use std::path::PathBuf;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use warren_api::{
    ApiError, CreateSessionRequest, ExecFrame, ExecOutput, ExecRequest, ExecResult, ExecStatus, FileStat,
    NetworkPolicy, SandboxInfo, SandboxState, SessionInfo, SetPhaseRequest, StepKind, StepResult, StepState,
    Trajectory, TrajectoryDivergence, TrajectoryOrigin, TrajectoryStep, MAX_STEP,
};
use warren_store::{StateStoreExt, Table, Write};

use crate::records::{self, SandboxRecord};
use crate::{now_ms, ExecEntry, Live, Node, NodeError, Result};

mod replay;

/// An exec's step and the data file holding its output, if any.
#[derive(Debug, Clone)]
pub(crate) struct ExecStep {
    pub step: u64,
    pub data_file: Option<String>,
}

/// A step's output data file (`sha256:<hex>`), when its output is in one.
fn data_file_ref(result: &StepResult) -> Option<String> {
    result.output_ref.clone().filter(|r| r.starts_with("sha256:"))
}

/// A step's `output_ref` once its output was dropped (see `retention`).
pub const EXPIRED_OUTPUT: &str = "expired";
/// Captured output up to this size (as JSON) stays in the log entry.
pub const INLINE_OUTPUT_BYTES: usize = 8 << 10;
/// Uploads up to this size are kept for replay; larger ones are logged by
/// digest only and a replay skips them.
pub const KEEP_UPLOAD_BYTES: u64 = 64 << 20;
/// Default of [`crate::NodeConfig::trajectory_retention`]: one day.
pub const DEFAULT_TRAJECTORY_RETENTION_SECS: u64 = 24 * 3600;
/// How often a call waiting for a concurrent call of the same step looks again.
const ATTACH_POLL: Duration = Duration::from_millis(20);
/// A step claimed by another call that has not started its exec after this
/// long is reported as an error instead of waited for.
const ATTACH_START_DEADLINE: Duration = Duration::from_secs(30);

/// A stepped call's answer and the step it was logged as.
#[derive(Debug)]
pub struct Stepped<T> {
    pub step: u64,
    pub value: T,
}

/// An exec step's answer: the exec to stream (run now, or attached to while
/// it runs), or the recorded result (with its output) of a logged one.
pub enum ExecAnswer {
    Live(Arc<ExecEntry>),
    Logged(Box<ExecResult>),
}

/// One row of [`Table::Trajectories`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Header {
    origin: TrajectoryOrigin,
    /// Set by the retention sweep once the sandbox has ended, so the clock
    /// keeps running after the sandbox's own record is forgotten.
    #[serde(default)]
    ended_at_ms: Option<u64>,
}

/// One row of [`Table::TrajectorySteps`]: the wire step plus what a
/// fast-forward needs to answer exactly as the call did.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StepRecord {
    #[serde(flatten)]
    step: TrajectoryStep,
    /// Exec steps: the final result; its output inline when small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exec: Option<ExecResult>,
    /// File writes: the uploaded bytes are in the data file named by the
    /// request's sha256.
    #[serde(default)]
    content_kept: bool,
}

/// An exec that is a trajectory step: its id was chosen before the claim,
/// and the claim's commit also stores the exec's `running` record, so the
/// exec itself stores only its final record (in one commit with the step's).
pub(crate) struct LoggedExec {
    pub exec_id: String,
    pub step: StepNo,
}

/// The step of a [`LoggedExec`].
pub(crate) enum StepNo {
    /// Claimed (durably) before the process started: a client-numbered
    /// step, where of two calls with one number exactly one may run.
    Claimed(u64),
    /// An auto-numbered step, whose claim cannot lose to another call and
    /// so commits while the process starts (the commit's sync is then off
    /// the exec's path; the call still answers only once it is durable).
    /// The sender is dropped unsent when the claim failed.
    Claiming(tokio::sync::oneshot::Receiver<u64>),
}

impl StepNo {
    /// The step once its claim committed; `None` if the claim failed.
    pub(crate) async fn settled(self) -> Option<u64> {
        match self {
            StepNo::Claimed(n) => Some(n),
            StepNo::Claiming(rx) => rx.await.ok(),
        }
    }
}

enum Claim {
    /// This call owns the step: run it, then finish or release it.
    Fresh,
    Done(Box<StepRecord>),
    Running,
}

fn step_key(sandbox: &str, step: u64) -> String {
    format!("{sandbox}/{step:020}")
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// `sha256:<hex>` over the canonical JSON of `{kind, request}`: object keys
/// sorted, no whitespace.
pub fn request_hash(kind: StepKind, request: &serde_json::Value) -> String {
    let canon = canonical(&serde_json::json!({ "kind": kind, "request": request }));
    format!("sha256:{}", sha256_hex(canon.as_bytes()))
}

/// JSON with object keys in byte order at every level, whatever map type
/// `serde_json` was built with.
fn canonical(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let fields: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", serde_json::Value::String(k.clone()), canonical(&map[k])))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        serde_json::Value::Array(items) => {
            format!("[{}]", items.iter().map(canonical).collect::<Vec<_>>().join(","))
        }
        other => other.to_string(),
    }
}

fn to_json<T: Serialize>(v: &T) -> Result<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| NodeError::Internal(format!("cannot encode a trajectory request: {e}")))
}

fn from_json<T: DeserializeOwned>(v: serde_json::Value, what: &str) -> Result<T> {
    serde_json::from_value(v).map_err(|e| NodeError::Internal(format!("logged {what} does not decode: {e}")))
}

/// Checks a client's step number.
pub fn check_step(step: u64) -> Result<u64> {
    match step {
        1..=MAX_STEP => Ok(step),
        _ => Err(NodeError::Invalid(ApiError::invalid("Warren-Step", format!("must be between 1 and {MAX_STEP}")))),
    }
}

fn diverged(step: u64, expected: String, got: String) -> NodeError {
    NodeError::TrajectoryDiverged(TrajectoryDivergence { step, expected, got })
}

/// Digests and sizes of an exec's captured output.
fn exec_step_result(r: &ExecResult) -> StepResult {
    let mut out = StepResult {
        exec_id: Some(r.exec_id.clone()),
        status: Some(r.status),
        exit_code: r.exit_code,
        signal: r.signal,
        wall_time_secs: Some(r.wall_time_secs),
        cpu_time_secs: Some(r.cpu_time_secs),
        peak_memory_bytes: Some(r.peak_memory_bytes),
        ..Default::default()
    };
    if let Some(output) = &r.output {
        let digest = |c: &warren_api::CapturedOutput| {
            let bytes = base64::engine::general_purpose::STANDARD.decode(&c.data_b64).unwrap_or_default();
            format!("sha256:{}", sha256_hex(&bytes))
        };
        out.stdout_sha256 = Some(digest(&output.stdout));
        out.stderr_sha256 = Some(digest(&output.stderr));
        out.stdout_bytes = Some(output.stdout.total_bytes);
        out.stderr_bytes = Some(output.stderr.total_bytes);
    }
    out
}

/// The record an exec's claim stores: what a restart reports `killed` if
/// the node stops before the exec's final record is written.
fn running_exec(exec_id: &str, session_id: Option<&str>) -> ExecResult {
    ExecResult {
        exec_id: exec_id.to_string(),
        status: ExecStatus::Running,
        exit_code: None,
        signal: None,
        wall_time_secs: 0.0,
        cpu_time_secs: 0.0,
        peak_memory_bytes: 0,
        started_at_ms: now_ms(),
        ended_at_ms: None,
        session_id: session_id.map(str::to_string),
        output: None,
        output_expired: false,
    }
}

/// Runs a store call on the blocking pool: a claim or a finish is a durable
/// commit that must not stall a runtime worker.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| NodeError::Internal(format!("trajectory task failed: {e}")))?
}

impl Node {
    fn trajectory_dir(&self, sandbox: &str) -> PathBuf {
        self.inner.cfg.data_dir.join("trajectory").join(sandbox)
    }

    /// The sandbox's header row, if it has none yet: written in the commit
    /// of its first step's claim (a step never exists without it). Two
    /// first claims racing both write it, with the same content.
    fn missing_header(&self, sandbox: &str) -> Result<Option<Write>> {
        if self.store().get(Table::Trajectories, sandbox)?.is_some() {
            return Ok(None);
        }
        let rec = self
            .store()
            .get_json::<SandboxRecord>(Table::Sandboxes, sandbox)?
            .ok_or_else(|| NodeError::NotFound(sandbox.to_string()))?;
        let header = Header { origin: origin_of(&rec), ended_at_ms: None };
        Ok(Some(Write::json(Table::Trajectories, sandbox, &header)?))
    }

    /// Claims `step` (or the next free one) for a call of `kind`.
    fn claim(
        &self,
        sandbox: &str,
        step: Option<u64>,
        kind: StepKind,
        request: &serde_json::Value,
    ) -> Result<(u64, Claim)> {
        self.claim_with(sandbox, step, kind, request, None)
    }

    /// [`Node::claim`]; for an exec (`exec`: its id and session), the
    /// step is claimed with the exec's id in it and, in the same commit,
    /// the exec's `running` record: one device sync before the command
    /// runs instead of three (claim, id, record), and a crash at any point
    /// leaves a step that restart settles as `killed`.
    fn claim_with(
        &self,
        sandbox: &str,
        step: Option<u64>,
        kind: StepKind,
        request: &serde_json::Value,
        exec: Option<(&str, Option<&str>)>,
    ) -> Result<(u64, Claim)> {
        let hash = request_hash(kind, request);
        let mut also: Vec<Write> = self.missing_header(sandbox)?.into_iter().collect();
        if let Some((exec_id, session_id)) = exec {
            also.push(Write::json(Table::Execs, format!("{sandbox}/{exec_id}"), &running_exec(exec_id, session_id))?);
        }
        let noted = exec.map(|(exec_id, _)| StepResult { exec_id: Some(exec_id.to_string()), ..Default::default() });
        let fresh = |n: u64| StepRecord {
            step: TrajectoryStep {
                step: n,
                kind,
                request: request.clone(),
                request_hash: hash.clone(),
                state: StepState::Running,
                client_step: step.is_some(),
                started_at_ms: now_ms(),
                ended_at_ms: None,
                result: noted.clone(),
            },
            exec: None,
            content_kept: false,
        };
        if let Some(n) = step {
            let existing =
                self.store().put_json_if_absent_and(Table::TrajectorySteps, &step_key(sandbox, n), &fresh(n), &also)?;
            return match existing {
                None => Ok((n, Claim::Fresh)),
                Some(logged) if logged.step.request_hash != hash => Err(diverged(n, logged.step.request_hash, hash)),
                Some(logged) if logged.step.state == StepState::Done => Ok((n, Claim::Done(Box::new(logged)))),
                Some(_) => Ok((n, Claim::Running)),
            };
        }
        let prefix = format!("{sandbox}/");
        let mut next =
            self.store().last_json::<StepRecord>(Table::TrajectorySteps, &prefix)?.map_or(1, |(_, r)| r.step.step + 1);
        // A client-named step may take `next` between the look and the
        // claim: move on until a claim wins.
        while self
            .store()
            .put_json_if_absent_and(Table::TrajectorySteps, &step_key(sandbox, next), &fresh(next), &also)?
            .is_some()
        {
            next += 1;
        }
        Ok((next, Claim::Fresh))
    }

    fn release(&self, sandbox: &str, step: u64) {
        if let Err(e) = self.store().delete(Table::TrajectorySteps, &step_key(sandbox, step)) {
            tracing::error!(sandbox, step, "cannot release a trajectory step: {e}");
        }
    }

    /// Releases an exec's step and the `running` record its claim stored.
    fn release_exec(&self, sandbox: &str, step: u64, exec_id: &str) {
        let writes = [
            Write::delete(Table::TrajectorySteps, step_key(sandbox, step)),
            Write::delete(Table::Execs, format!("{sandbox}/{exec_id}")),
        ];
        if let Err(e) = self.store().apply(&writes) {
            tracing::error!(sandbox, step, "cannot release a trajectory step: {e}");
        }
    }

    fn load_step(&self, sandbox: &str, step: u64) -> Result<Option<StepRecord>> {
        Ok(self.store().get_json(Table::TrajectorySteps, &step_key(sandbox, step))?)
    }

    fn update_step(&self, sandbox: &str, step: u64, f: impl FnOnce(&mut StepRecord)) -> Result<()> {
        let key = step_key(sandbox, step);
        let Some(mut rec) = self.store().get_json::<StepRecord>(Table::TrajectorySteps, &key)? else {
            return Ok(());
        };
        f(&mut rec);
        Ok(self.store().put_json(Table::TrajectorySteps, &key, &rec)?)
    }

    /// Runs a call that is not an exec as step `step` (or the next one).
    async fn stepped<T, F, Fut>(
        &self,
        sandbox: &str,
        step: Option<u64>,
        kind: StepKind,
        request: serde_json::Value,
        run: F,
    ) -> Result<Stepped<T>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.live(sandbox)?;
        let (node, id, req) = (self.clone(), sandbox.to_string(), request.clone());
        let (n, claim) = blocking(move || node.claim(&id, step, kind, &req)).await?;
        match claim {
            Claim::Fresh => match run().await {
                Ok(value) => {
                    let response = to_json(&value)?;
                    let (node, id) = (self.clone(), sandbox.to_string());
                    blocking(move || {
                        node.update_step(&id, n, |r| {
                            r.step.state = StepState::Done;
                            r.step.ended_at_ms = Some(now_ms());
                            r.step.result = Some(StepResult { response: Some(response), ..Default::default() });
                        })
                    })
                    .await?;
                    Ok(Stepped { step: n, value })
                }
                Err(e) => {
                    self.release(sandbox, n);
                    Err(e)
                }
            },
            Claim::Done(rec) => Ok(Stepped { step: n, value: logged_response(*rec)? }),
            Claim::Running => {
                let rec = self.wait_done(sandbox, n).await?;
                Ok(Stepped { step: n, value: logged_response(rec)? })
            }
        }
    }

    /// Waits for a step another call is running to be done. A step that
    /// was released meanwhile (its call failed) is an error for this call
    /// too: it asked for the same thing.
    async fn wait_done(&self, sandbox: &str, step: u64) -> Result<StepRecord> {
        let deadline = tokio::time::Instant::now() + ATTACH_START_DEADLINE;
        loop {
            match self.load_step(sandbox, step)? {
                Some(rec) if rec.step.state == StepState::Done => return Ok(rec),
                Some(_) if tokio::time::Instant::now() < deadline => {}
                Some(_) => return Err(NodeError::Internal(format!("step {step} is still being run by another call"))),
                None => {
                    return Err(NodeError::Internal(format!("step {step} failed in a concurrent call; send it again")))
                }
            }
            tokio::time::sleep(ATTACH_POLL).await;
        }
    }

    // ---- the stepped calls --------------------------------------------------

    /// [`Node::exec`] as a trajectory step: runs it, attaches to it while
    /// it runs, or answers from the log.
    pub async fn exec_stepped(
        &self,
        id: &str,
        req: ExecRequest,
        session_id: Option<&str>,
        step: Option<u64>,
    ) -> Result<Stepped<ExecAnswer>> {
        req.validate(session_id.is_some()).map_err(NodeError::Invalid)?;
        self.live(id)?;
        let (kind, mut request) = match session_id {
            Some(_) => (StepKind::SessionExec, to_json(&req)?),
            None => (StepKind::Exec, to_json(&req)?),
        };
        if let (Some(sid), Some(obj)) = (session_id, request.as_object_mut()) {
            obj.insert("session_id".into(), serde_json::Value::String(sid.to_string()));
        }
        // Chosen before the claim, which notes it in the step: a call that
        // retries this step after a broken connection finds the exec to join.
        let exec_id = crate::new_id("ex");
        if step.is_none() {
            return self.exec_claiming(id, req, session_id, kind, request, exec_id).await;
        }
        let (node, sandbox, hashed, ex, sid) =
            (self.clone(), id.to_string(), request.clone(), exec_id.clone(), session_id.map(str::to_string));
        let (n, claim) =
            blocking(move || node.claim_with(&sandbox, step, kind, &hashed, Some((ex.as_str(), sid.as_deref()))))
                .await?;
        match claim {
            Claim::Fresh => {
                let logged = LoggedExec { exec_id: exec_id.clone(), step: StepNo::Claimed(n) };
                let entry = match self.exec_logged(id, req, session_id, false, Some(logged)).await {
                    Ok(entry) => entry,
                    Err(e) => {
                        self.release_exec(id, n, &exec_id);
                        return Err(e);
                    }
                };
                Ok(Stepped { step: n, value: ExecAnswer::Live(entry) })
            }
            Claim::Done(rec) => {
                Ok(Stepped { step: n, value: ExecAnswer::Logged(Box::new(self.logged_exec(id, *rec)?)) })
            }
            Claim::Running => Ok(Stepped { step: n, value: self.attach_exec(id, n).await? }),
        }
    }

    /// [`Node::exec_stepped`] without a client step: the claim (of the next
    /// free number, which no other call can take from it) commits while the
    /// process starts, so its sync is not on the exec's path. The call
    /// answers only once both are done: a client that saw the answer finds
    /// the step and the exec's record after a crash, as before. A crash
    /// between the start and the commit can leave a process that ran without
    /// a record; it dies with the node's connection to init.
    async fn exec_claiming(
        &self,
        id: &str,
        req: ExecRequest,
        session_id: Option<&str>,
        kind: StepKind,
        request: serde_json::Value,
        exec_id: String,
    ) -> Result<Stepped<ExecAnswer>> {
        let (node, sandbox, ex, sid) = (self.clone(), id.to_string(), exec_id.clone(), session_id.map(str::to_string));
        let (step_tx, step_rx) = tokio::sync::oneshot::channel();
        // A task of its own, so the exec learns its step (and writes its
        // final record only after the claim's `running` one) even when this
        // call is dropped midway.
        let claiming = tokio::spawn(async move {
            let claimed =
                blocking(move || node.claim_with(&sandbox, None, kind, &request, Some((ex.as_str(), sid.as_deref()))))
                    .await;
            if let Ok((n, _)) = &claimed {
                let _ = step_tx.send(*n);
            }
            claimed
        });
        let logged = LoggedExec { exec_id: exec_id.clone(), step: StepNo::Claiming(step_rx) };
        let started = self.exec_logged(id, req, session_id, false, Some(logged)).await;
        let claimed = claiming.await.map_err(|e| NodeError::Internal(format!("trajectory task failed: {e}")))?;
        match (started, claimed) {
            (Ok(entry), Ok((n, _))) => Ok(Stepped { step: n, value: ExecAnswer::Live(entry) }),
            (Ok(entry), Err(e)) => {
                // An exec the log does not hold must not run on; its end is
                // stored without a step.
                entry.request_kill();
                Err(e)
            }
            (Err(e), Ok((n, _))) => {
                self.release_exec(id, n, &exec_id);
                Err(e)
            }
            (Err(e), Err(_)) => Err(e),
        }
    }

    fn finish_exec_step(&self, sandbox: &str, step: u64, result: ExecResult) -> Result<()> {
        match self.finished_exec_step(sandbox, step, result)? {
            Some((write, _)) => Ok(self.store().apply(&[write])?),
            None => Ok(()),
        }
    }

    /// The write that records an ended exec's result in its step (`None`
    /// if the step is gone); its large output goes to a data file first.
    /// The exec's own final record is committed with it (see
    /// [`Node::exec_logged`]). Until then a reader of the log sees the step
    /// settled from the exec itself: see [`Node::settled`]. With the write
    /// comes the data file's `output_ref` (`sha256:<hex>`), if one was made.
    pub(crate) fn finished_exec_step(
        &self,
        sandbox: &str,
        step: u64,
        mut result: ExecResult,
    ) -> Result<Option<(Write, Option<String>)>> {
        let mut summary = exec_step_result(&result);
        if let Some(mut output) = result.output.take() {
            records::output_without_text(&mut output);
            let json = serde_json::to_vec(&output).map_err(|e| NodeError::Internal(e.to_string()))?;
            if json.len() <= INLINE_OUTPUT_BYTES {
                summary.output_ref = Some("inline".into());
                result.output = Some(output);
            } else {
                let digest = sha256_hex(&json);
                self.write_data_file(sandbox, &digest, &json)?;
                summary.output_ref = Some(format!("sha256:{digest}"));
            }
        }
        let key = step_key(sandbox, step);
        let Some(mut r) = self.store().get_json::<StepRecord>(Table::TrajectorySteps, &key)? else {
            return Ok(None);
        };
        r.step.state = StepState::Done;
        r.step.ended_at_ms = result.ended_at_ms.or(Some(now_ms()));
        let data_file = data_file_ref(&summary);
        r.step.result = Some(summary);
        r.exec = Some(result);
        Ok(Some((Write::json(Table::TrajectorySteps, key, &r)?, data_file)))
    }

    /// The write that drops a step's kept output (see `retention`): its
    /// `output_ref` becomes `expired`. `None` if the step is gone.
    pub(crate) fn expire_step_output(&self, sandbox: &str, step: u64) -> Result<Option<Write>> {
        let key = step_key(sandbox, step);
        let Some(mut r) = self.store().get_json::<StepRecord>(Table::TrajectorySteps, &key)? else {
            return Ok(None);
        };
        if let Some(exec) = r.exec.as_mut() {
            exec.output = None;
            exec.output_expired = true;
        }
        if let Some(result) = r.step.result.as_mut().filter(|res| res.output_ref.is_some()) {
            result.output_ref = Some(EXPIRED_OUTPUT.into());
        }
        Ok(Some(Write::json(Table::TrajectorySteps, key, &r)?))
    }

    /// Each exec step's exec id, with its step and data file.
    pub(crate) fn exec_steps(&self, sandbox: &str) -> Result<std::collections::HashMap<String, ExecStep>> {
        let mut steps = std::collections::HashMap::new();
        for (_, rec) in self.store().list_json::<StepRecord>(Table::TrajectorySteps, &format!("{sandbox}/"))? {
            let Some(result) = rec.step.result.as_ref() else { continue };
            if let Some(exec_id) = result.exec_id.clone() {
                steps.insert(exec_id, ExecStep { step: rec.step.step, data_file: data_file_ref(result) });
            }
        }
        Ok(steps)
    }

    /// Removes a data file (`sha256:<hex>`) no step refers to any more.
    pub(crate) fn remove_trajectory_data_file(&self, sandbox: &str, output_ref: &str) {
        let Some(name) = output_ref.strip_prefix("sha256:") else { return };
        let path = self.trajectory_dir(sandbox).join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(sandbox, path = %path.display(), "cannot remove an expired output: {e}"),
        }
    }

    fn write_data_file(&self, sandbox: &str, name: &str, bytes: &[u8]) -> Result<()> {
        let dir = self.trajectory_dir(sandbox);
        std::fs::create_dir_all(&dir).map_err(|e| NodeError::Internal(format!("{}: {e}", dir.display())))?;
        let path = dir.join(name);
        if path.exists() {
            return Ok(());
        }
        let mut tmp = tempfile_in(&dir)?;
        tmp.1.write_all(bytes).and_then(|()| tmp.1.sync_data()).map_err(|e| NodeError::Internal(e.to_string()))?;
        std::fs::rename(&tmp.0, &path).map_err(|e| NodeError::Internal(e.to_string()))?;
        Ok(())
    }

    /// A logged exec's result with its captured output, from the log entry
    /// or its data file.
    fn logged_exec(&self, sandbox: &str, rec: StepRecord) -> Result<ExecResult> {
        let mut result = match rec.exec {
            Some(r) => r,
            None => {
                let exec_id = rec.step.result.and_then(|r| r.exec_id).unwrap_or_default();
                return self.stored_exec(sandbox, &exec_id);
            }
        };
        if result.output.is_none() {
            let output_ref = rec.step.result.as_ref().and_then(|r| r.output_ref.clone());
            if let Some(digest) = output_ref.as_deref().and_then(|r| r.strip_prefix("sha256:")) {
                let path = self.trajectory_dir(sandbox).join(digest);
                let bytes = std::fs::read(&path)
                    .map_err(|e| NodeError::Internal(format!("logged output {}: {e}", path.display())))?;
                let output: ExecOutput = serde_json::from_slice(&bytes)
                    .map_err(|e| NodeError::Internal(format!("logged output {}: {e}", path.display())))?;
                result.output = Some(output);
            }
        }
        Ok(records::with_text(result))
    }

    /// Joins a step another call is running: its live exec once it has
    /// one, or the logged result once it has ended.
    async fn attach_exec(&self, sandbox: &str, step: u64) -> Result<ExecAnswer> {
        let deadline = tokio::time::Instant::now() + ATTACH_START_DEADLINE;
        loop {
            let Some(rec) = self.load_step(sandbox, step)? else {
                return Err(NodeError::Internal(format!("step {step} failed in a concurrent call; send it again")));
            };
            if rec.step.state == StepState::Done {
                return Ok(ExecAnswer::Logged(Box::new(self.logged_exec(sandbox, rec)?)));
            }
            if let Some(exec_id) = rec.step.result.as_ref().and_then(|r| r.exec_id.as_deref()) {
                if let Some(entry) = self.exec_entry(sandbox, exec_id) {
                    return Ok(ExecAnswer::Live(entry));
                }
                // Ended and left memory, but its step is not written yet.
                if let Ok(stored) = self.stored_exec(sandbox, exec_id) {
                    if stored.status != ExecStatus::Running {
                        return Ok(ExecAnswer::Logged(Box::new(stored)));
                    }
                }
            } else if tokio::time::Instant::now() > deadline {
                return Err(NodeError::Internal(format!("step {step} is still being started by another call")));
            }
            tokio::time::sleep(ATTACH_POLL).await;
        }
    }

    pub async fn create_session_stepped(
        &self,
        id: &str,
        req: CreateSessionRequest,
        step: Option<u64>,
    ) -> Result<Stepped<SessionInfo>> {
        let request = to_json(&req)?;
        self.stepped(id, step, StepKind::SessionCreate, request, || self.create_session(id, req)).await
    }

    pub async fn remove_file_stepped(
        &self,
        id: &str,
        path: String,
        recursive: bool,
        step: Option<u64>,
    ) -> Result<Stepped<()>> {
        let request = serde_json::json!({ "path": path, "recursive": recursive });
        self.stepped(id, step, StepKind::FileRemove, request, || self.remove_file(id, path, recursive)).await
    }

    pub async fn mkdir_stepped(
        &self,
        id: &str,
        path: String,
        mode: u32,
        parents: bool,
        step: Option<u64>,
    ) -> Result<Stepped<FileStat>> {
        let request = serde_json::json!({ "path": path, "mode": mode, "parents": parents });
        self.stepped(id, step, StepKind::Mkdir, request, || self.mkdir(id, path, mode, parents)).await
    }

    pub async fn set_phase_stepped(
        &self,
        id: &str,
        req: SetPhaseRequest,
        step: Option<u64>,
    ) -> Result<Stepped<SandboxInfo>> {
        let request = to_json(&req)?;
        let (node, owned_id) = (self.clone(), id.to_string());
        // Detached: dropped midway, the switch could stop with init in the
        // new phase but the record, the event and the phase's egress
        // policy not yet following, and the step claimed for good (every
        // retry of it would wait for it, then fail).
        self.detached("phase", id, async move {
            node.stepped(&owned_id, step, StepKind::Phase, request, || node.set_phase(&owned_id, req)).await
        })
        .await
    }

    pub async fn set_network_stepped(
        &self,
        id: &str,
        policy: NetworkPolicy,
        step: Option<u64>,
    ) -> Result<Stepped<SandboxInfo>> {
        let request = to_json(&policy)?;
        let (node, owned_id) = (self.clone(), id.to_string());
        // Detached for the same reasons as a phase switch.
        self.detached("network", id, async move {
            node.stepped(&owned_id, step, StepKind::Network, request, || async {
                node.apply_network_policy(&owned_id, &policy).await
            })
            .await
        })
        .await
    }

    /// [`Node::write_file`] as a trajectory step. The request's hash covers
    /// the content's sha256, known only once the body is in: the body is
    /// staged (invisible in the sandbox) while it is hashed, the step is
    /// claimed, and only a fresh claim commits it. Bodies up to
    /// [`KEEP_UPLOAD_BYTES`] are also kept for replay.
    pub async fn write_file_stepped<E: std::fmt::Display>(
        &self,
        id: &str,
        path: String,
        mode: u32,
        body: impl Stream<Item = Result<Bytes, E>> + Send,
        step: Option<u64>,
    ) -> Result<Stepped<FileStat>> {
        let root = self.fs_root(id)?;
        let live = self.live(id)?;
        let dir = self.trajectory_dir(id);
        let staged_path = path.clone();
        let mut staged = blocking(move || {
            let writer = root.create_write(&staged_path, mode)?;
            Ok(Staged { writer, hasher: Sha256::new(), size: 0, kept: KeptUpload::start(&dir) })
        })
        .await?;
        let mut body = pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| NodeError::Internal(format!("upload broke off: {e}")))?;
            staged = blocking(move || {
                staged.append(&chunk)?;
                Ok(staged)
            })
            .await?;
        }
        let digest = sha256_hex(&staged.hasher.clone().finalize());
        let request = serde_json::json!({
            "path": path, "mode": mode, "size_bytes": staged.size, "sha256": format!("sha256:{digest}"),
        });
        // The body is in: what is left runs detached, as a phase switch
        // does, so a caller gone now cannot leave the step claimed for good.
        let (node, sandbox) = (self.clone(), id.to_string());
        self.detached("file_write", id, async move {
            node.commit_upload(&sandbox, step, request, staged, live, digest).await
        })
        .await
    }

    /// The rest of [`Node::write_file_stepped`] once the body is staged:
    /// claims the step and, on a fresh claim, makes the file visible.
    async fn commit_upload(
        &self,
        id: &str,
        step: Option<u64>,
        request: serde_json::Value,
        mut staged: Staged,
        live: Arc<Live>,
        digest: String,
    ) -> Result<Stepped<FileStat>> {
        self.live(id)?;
        let (node, sandbox, hashed) = (self.clone(), id.to_string(), request.clone());
        let (n, claim) = blocking(move || node.claim(&sandbox, step, StepKind::FileWrite, &hashed)).await?;
        match claim {
            Claim::Fresh => {
                let node = self.clone();
                let committed = blocking(move || {
                    let stat = staged.writer.commit()?;
                    let kept = node.keep_upload(&live, &mut staged.kept, staged.size, &digest);
                    Ok((stat, kept))
                })
                .await;
                match committed {
                    Ok((stat, kept)) => {
                        let response = to_json(&stat)?;
                        let (node, sandbox) = (self.clone(), id.to_string());
                        blocking(move || {
                            node.update_step(&sandbox, n, |r| {
                                r.step.state = StepState::Done;
                                r.step.ended_at_ms = Some(now_ms());
                                r.step.result = Some(StepResult { response: Some(response), ..Default::default() });
                                r.content_kept = kept;
                            })
                        })
                        .await?;
                        Ok(Stepped { step: n, value: stat })
                    }
                    Err(e) => {
                        self.release(id, n);
                        Err(e)
                    }
                }
            }
            // The staged file and the kept copy go away with `staged`.
            Claim::Done(rec) => Ok(Stepped { step: n, value: logged_response(*rec)? }),
            Claim::Running => {
                let rec = self.wait_done(id, n).await?;
                Ok(Stepped { step: n, value: logged_response(rec)? })
            }
        }
    }

    /// Keeps the upload's copy (`size` bytes) under `digest` if the
    /// sandbox's upload budget ([`crate::NodeConfig::upload_retention_bytes`])
    /// has room for it; a content it keeps already costs nothing. Under the
    /// sandbox's lock, so concurrent uploads cannot overrun the budget
    /// together.
    fn keep_upload(&self, live: &Live, copy: &mut KeptUpload, size: u64, digest: &str) -> bool {
        if !copy.has_copy() {
            return false;
        }
        let mut kept_bytes = live.kept_upload_bytes.lock().unwrap_or_else(|p| p.into_inner());
        let total = match *kept_bytes {
            Some(total) => total,
            None => match self.kept_upload_total(&live.id) {
                Ok(total) => *kept_bytes.insert(total),
                Err(e) => {
                    tracing::warn!(sandbox = %live.id, "cannot count the uploads the trajectory keeps: {e}");
                    return false;
                }
            },
        };
        let cost = if copy.dir.join(digest).exists() { 0 } else { size };
        if total.saturating_add(cost) > self.inner.cfg.upload_retention_bytes || !copy.keep(digest) {
            return false;
        }
        *kept_bytes = Some(total + cost);
        true
    }

    /// Bytes of the distinct uploads the sandbox's trajectory keeps, from
    /// its steps.
    fn kept_upload_total(&self, sandbox: &str) -> Result<u64> {
        let mut seen = std::collections::HashSet::new();
        let mut total = 0u64;
        for (_, rec) in self.store().list_json::<StepRecord>(Table::TrajectorySteps, &format!("{sandbox}/"))? {
            if rec.step.kind != StepKind::FileWrite || !rec.content_kept {
                continue;
            }
            let digest = rec.step.request.get("sha256").and_then(|v| v.as_str()).unwrap_or_default().to_string();
            if seen.insert(digest) {
                total += rec.step.request.get("size_bytes").and_then(|v| v.as_u64()).unwrap_or(0);
            }
        }
        Ok(total)
    }

    // ---- reading the log ------------------------------------------------------

    /// `GET /v1/sandboxes/{id}/trajectory`: what the sandbox was made from
    /// and every step, also after the sandbox ended (for the retention).
    pub fn trajectory(&self, id: &str) -> Result<Trajectory> {
        let header = match self.store().get_json::<Header>(Table::Trajectories, id)? {
            Some(h) => h,
            None => {
                let rec = self
                    .store()
                    .get_json::<SandboxRecord>(Table::Sandboxes, id)?
                    .ok_or_else(|| NodeError::NotFound(id.to_string()))?;
                Header { origin: origin_of(&rec), ended_at_ms: rec.info.ended_at_ms }
            }
        };
        let ended_at_ms = match header.ended_at_ms {
            Some(t) => Some(t),
            None => self.get(id).ok().and_then(|info| info.ended_at_ms),
        };
        let steps = self
            .store()
            .list_json::<StepRecord>(Table::TrajectorySteps, &format!("{id}/"))?
            .into_iter()
            .map(|(_, r)| self.settled(id, r))
            .collect();
        Ok(Trajectory { sandbox_id: id.to_string(), origin: header.origin, ended_at_ms, steps })
    }

    /// A step as a reader should see it: an exec step whose exec has ended
    /// but whose result is still being written is shown done, with the
    /// exec's result (the client may have its `end` frame already).
    fn settled(&self, sandbox: &str, rec: StepRecord) -> TrajectoryStep {
        let mut step = rec.step;
        let Some(exec_id) = step.result.as_ref().and_then(|r| r.exec_id.clone()) else { return step };
        if step.state != StepState::Running {
            return step;
        }
        let ended = match self.exec_entry(sandbox, &exec_id) {
            Some(entry) => Some(entry.result(true)).filter(|_| entry.is_finished()),
            None => self.stored_exec(sandbox, &exec_id).ok().filter(|r| r.status != ExecStatus::Running),
        };
        if let Some(result) = ended {
            step.state = StepState::Done;
            step.ended_at_ms = result.ended_at_ms;
            step.result = Some(exec_step_result(&result));
        }
        step
    }

    /// A logged exec's stream: `started`, its output frames, `end`.
    pub fn logged_frames(result: ExecResult) -> Vec<ExecFrame> {
        let mut frames = vec![ExecFrame::Started { exec_id: result.exec_id.clone() }];
        frames.extend(crate::records::replay_frames(result, 0, 0));
        frames
    }

    // ---- restart and retention ----------------------------------------------

    /// After a restart no exec of before is running: their steps get the
    /// exec's final record (`killed` when it was cut off), and steps of
    /// other calls that never finished are released. Data files a crash
    /// left half-written, and the data of sandboxes without a log, go.
    pub(crate) fn recover_trajectories(&self) -> Result<()> {
        self.sweep_data_files();
        for (sandbox, _) in self.store().list(Table::Trajectories, "")? {
            for (key, rec) in self.store().list_json::<StepRecord>(Table::TrajectorySteps, &format!("{sandbox}/"))? {
                if rec.step.state != StepState::Running {
                    continue;
                }
                let exec_id = rec.step.result.as_ref().and_then(|r| r.exec_id.clone());
                match exec_id {
                    Some(exec_id) => {
                        let mut result = self.stored_exec(&sandbox, &exec_id).unwrap_or_else(|_| ExecResult {
                            exec_id: exec_id.clone(),
                            status: ExecStatus::Killed,
                            exit_code: None,
                            signal: None,
                            wall_time_secs: 0.0,
                            cpu_time_secs: 0.0,
                            peak_memory_bytes: 0,
                            started_at_ms: rec.step.started_at_ms,
                            ended_at_ms: Some(now_ms()),
                            session_id: None,
                            output: None,
                            output_expired: false,
                        });
                        if result.status == ExecStatus::Running {
                            result.status = ExecStatus::Killed;
                            result.ended_at_ms = Some(now_ms());
                        }
                        self.finish_exec_step(&sandbox, rec.step.step, result)?;
                    }
                    None => {
                        self.store().delete(Table::TrajectorySteps, &key)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn sweep_data_files(&self) {
        let Ok(dirs) = std::fs::read_dir(self.inner.cfg.data_dir.join("trajectory")) else { return };
        for dir in dirs.flatten() {
            let sandbox = dir.file_name().to_string_lossy().into_owned();
            let logged = self.store().get(Table::Trajectories, &sandbox).ok().flatten().is_some();
            if !logged {
                let _ = std::fs::remove_dir_all(dir.path());
                continue;
            }
            for file in std::fs::read_dir(dir.path()).into_iter().flatten().flatten() {
                if file.file_name().to_string_lossy().starts_with(".tmp-") {
                    let _ = std::fs::remove_file(file.path());
                }
            }
        }
    }

    /// Deletes the logs of sandboxes that ended more than the trajectory
    /// retention ago. Returns how many went.
    pub(crate) fn forget_trajectories(&self, now: u64) -> Result<usize> {
        let retention_ms = u64::try_from(self.inner.cfg.trajectory_retention.as_millis()).unwrap_or(u64::MAX);
        let mut forgotten = 0;
        for (sandbox, bytes) in self.store().list(Table::Trajectories, "")? {
            let Ok(mut header) = serde_json::from_slice::<Header>(&bytes) else { continue };
            if header.ended_at_ms.is_none() {
                // Forgotten before this sweep saw it end: the clock starts now.
                let Some(ended) = self.ended_at(&sandbox, &header, now)? else { continue };
                header.ended_at_ms = Some(ended);
                self.store().put_json(Table::Trajectories, &sandbox, &header)?;
            }
            if header.ended_at_ms.is_some_and(|ended| now.saturating_sub(ended) >= retention_ms) {
                self.forget_trajectory(&sandbox)?;
                forgotten += 1;
            }
        }
        Ok(forgotten)
    }

    /// Deletes a sandbox's trajectory: its steps, its header, its data files.
    pub(crate) fn forget_trajectory(&self, sandbox: &str) -> Result<()> {
        self.store().delete_prefix(Table::TrajectorySteps, &format!("{sandbox}/"))?;
        self.store().delete(Table::Trajectories, sandbox)?;
        let _ = std::fs::remove_dir_all(self.trajectory_dir(sandbox));
        Ok(())
    }

    /// When each ended sandbox that still has a trajectory ended (0 when
    /// its record is already forgotten: long ago).
    pub(crate) fn ended_trajectories(&self) -> Result<Vec<(String, u64)>> {
        let mut ended = Vec::new();
        for (sandbox, bytes) in self.store().list(Table::Trajectories, "")? {
            let Ok(header) = serde_json::from_slice::<Header>(&bytes) else { continue };
            if let Some(at) = self.ended_at(&sandbox, &header, 0)? {
                ended.push((sandbox, at));
            }
        }
        Ok(ended)
    }

    /// When the sandbox of a trajectory ended: the header's time, or its
    /// record's while the sweep has not set it yet, or `forgotten` when the
    /// record is gone too (a header is written only beside a record:
    /// `missing_header`); `None` while it has not ended.
    fn ended_at(&self, sandbox: &str, header: &Header, forgotten: u64) -> Result<Option<u64>> {
        if let Some(at) = header.ended_at_ms {
            return Ok(Some(at));
        }
        Ok(match self.store().get_json::<SandboxRecord>(Table::Sandboxes, sandbox)? {
            Some(rec) if rec.info.state == SandboxState::Ended => rec.info.ended_at_ms,
            Some(_) => None,
            None => Some(forgotten),
        })
    }
}

/// The answer a logged call gave, for a fast-forward of it.
fn logged_response<T: DeserializeOwned>(rec: StepRecord) -> Result<T> {
    let response = rec.step.result.and_then(|r| r.response).unwrap_or(serde_json::Value::Null);
    from_json(response, "answer")
}

fn origin_of(rec: &SandboxRecord) -> TrajectoryOrigin {
    let info = &rec.info;
    let initial_phase = info.phase.clone();
    TrajectoryOrigin {
        backend: info.backend,
        image: info.image.clone(),
        resources: info.resources.clone(),
        env: rec.env.clone(),
        labels: info.labels.clone(),
        network: info.network,
        network_policy: info.network_policy.clone(),
        phases: info.phases.clone(),
        phase: initial_phase,
        created_at_ms: info.created_at_ms,
        project: (info.project != warren_api::ROOT_PROJECT).then(|| info.project.clone()),
    }
}

/// A temp file in `dir` with a random name.
fn tempfile_in(dir: &std::path::Path) -> Result<(PathBuf, std::fs::File)> {
    let path = dir.join(format!(".tmp-{}", crate::new_id("t")));
    let file = std::fs::File::create(&path).map_err(|e| NodeError::Internal(format!("{}: {e}", path.display())))?;
    Ok((path, file))
}

/// An upload on its way in: the staged file, its running digest, and the
/// copy kept for replay.
struct Staged {
    writer: warren_backend::remote_files::FileAccessWriter,
    hasher: Sha256,
    size: u64,
    kept: KeptUpload,
}

impl Staged {
    fn append(&mut self, chunk: &[u8]) -> Result<()> {
        self.writer.append(chunk)?;
        self.hasher.update(chunk);
        self.size += chunk.len() as u64;
        self.kept.append(chunk, self.size);
        Ok(())
    }
}

/// The copy of an upload kept for replay, given up once it passes
/// [`KEEP_UPLOAD_BYTES`]; its temp file is removed on drop unless kept.
struct KeptUpload {
    dir: PathBuf,
    temp: Option<(PathBuf, std::fs::File)>,
}

impl KeptUpload {
    fn start(dir: &std::path::Path) -> KeptUpload {
        let temp = std::fs::create_dir_all(dir).ok().and_then(|()| tempfile_in(dir).ok());
        KeptUpload { dir: dir.to_path_buf(), temp }
    }

    fn append(&mut self, chunk: &[u8], size_so_far: u64) {
        let failed = match &mut self.temp {
            Some(_) if size_so_far > KEEP_UPLOAD_BYTES => true,
            Some((_, file)) => file.write_all(chunk).is_err(),
            None => false,
        };
        if failed {
            self.discard();
        }
    }

    fn discard(&mut self) {
        if let Some((path, _)) = self.temp.take() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Whether there is a copy to keep (none past [`KEEP_UPLOAD_BYTES`]).
    fn has_copy(&self) -> bool {
        self.temp.is_some()
    }

    /// Keeps the copy under `digest`; false when there is none.
    fn keep(&mut self, digest: &str) -> bool {
        let Some((path, file)) = self.temp.take() else { return false };
        let target = self.dir.join(digest);
        let kept = file.sync_data().is_ok() && std::fs::rename(&path, &target).is_ok();
        if !kept {
            let _ = std::fs::remove_file(&path);
        }
        kept
    }
}

impl Drop for KeptUpload {
    fn drop(&mut self) {
        self.discard();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_hash_ignores_key_order_and_sees_every_value() {
        let a = serde_json::json!({ "command": "ls", "env": { "A": "1", "B": "2" } });
        let b = serde_json::json!({ "env": { "B": "2", "A": "1" }, "command": "ls" });
        assert_eq!(request_hash(StepKind::Exec, &a), request_hash(StepKind::Exec, &b));
        let c = serde_json::json!({ "command": "ls", "env": { "A": "1", "B": "3" } });
        assert_ne!(request_hash(StepKind::Exec, &a), request_hash(StepKind::Exec, &c));
        assert_ne!(request_hash(StepKind::Exec, &a), request_hash(StepKind::SessionExec, &a));
        assert!(request_hash(StepKind::Exec, &a).starts_with("sha256:"));
    }

    #[test]
    fn step_keys_sort_in_step_order() {
        let mut keys: Vec<String> = [10u64, 9, 100, 1].iter().map(|n| step_key("sb-1", *n)).collect();
        keys.sort();
        assert_eq!(keys, [step_key("sb-1", 1), step_key("sb-1", 9), step_key("sb-1", 10), step_key("sb-1", 100)]);
    }

    #[test]
    fn steps_outside_the_range_are_refused_naming_the_header() {
        for bad in [0, MAX_STEP + 1] {
            match check_step(bad) {
                Err(NodeError::Invalid(e)) => assert_eq!(e.field.as_deref(), Some("Warren-Step")),
                other => panic!("step {bad}: {other:?}"),
            }
        }
        assert_eq!(check_step(1).ok(), Some(1));
    }
}

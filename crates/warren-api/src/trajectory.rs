//! The trajectory log: every mutating call on a sandbox, in one total order
//! of steps, with the request, its hash and the result.
//!
//! A call names its step in the [`STEP_HEADER`] request header. A step that
//! is already in the log with the same request hash is answered from the
//! log (an exec stream replays its recorded frames); a step still running
//! with the same hash attaches to the running call; a different hash is
//! refused with `trajectory_diverged`. A call without the header gets the
//! next free step from the server. Every answer of a logged call carries
//! its step in the same header.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::exec::ExecStatus;
use crate::sandbox::{Backend, NetworkMode, Resources};
use crate::{NetworkPolicy, PhaseSpec};

/// Request and response header carrying the trajectory step (a decimal
/// integer from 1 to [`MAX_STEP`]).
pub const STEP_HEADER: &str = "warren-step";
/// The largest step a client may name: exact in every JSON number type.
pub const MAX_STEP: u64 = (1 << 53) - 1;

/// What kind of call a step logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// `POST .../exec`.
    Exec,
    /// `POST .../sessions`.
    SessionCreate,
    /// `POST .../sessions/{sid}/exec`.
    SessionExec,
    /// `PUT .../files` (the request holds the content's sha256 and size).
    FileWrite,
    /// `DELETE .../files`.
    FileRemove,
    /// `POST .../files/mkdir`.
    Mkdir,
    /// `PUT .../phase`.
    Phase,
    /// `PUT .../network`.
    Network,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// The call is still running (an exec that has not ended).
    Running,
    /// The call took effect and its result is recorded.
    Done,
}

/// The result of a logged call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StepResult {
    /// Exec steps: the exec's durable id, status, exit and resource use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ExecStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time_secs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_time_secs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_memory_bytes: Option<u64>,
    /// `sha256:<hex>` of the captured stdout / stderr bytes, and their
    /// lengths as written by the process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_bytes: Option<u64>,
    /// Where the captured output is kept: `inline` (in the log entry) or
    /// `sha256:<hex>`, a data file under the server's data directory; or
    /// `expired`: dropped past the sandbox's output budget (`warren serve
    /// --exec-output-retention-mib`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_ref: Option<String>,
    /// Other steps: the call's JSON answer (a `FileStat`, a `SessionInfo`,
    /// the sandbox's phase or network policy); absent for a remove.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub response: Option<serde_json::Value>,
}

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrajectoryStep {
    pub step: u64,
    pub kind: StepKind,
    /// The request as the server hashed it (uploads: path, mode, the
    /// content's `sha256` and `size_bytes`, never the bytes).
    #[schema(value_type = Object)]
    pub request: serde_json::Value,
    /// `sha256:<hex>` over the canonical JSON of `{kind, request}`.
    pub request_hash: String,
    pub state: StepState,
    /// True when the client named the step; false when the server assigned it.
    pub client_step: bool,
    pub started_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StepResult>,
}

/// What a sandbox was made from: enough to make another one like it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TrajectoryOrigin {
    pub backend: Backend,
    pub image: String,
    pub resources: Resources,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub network: NetworkMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub phases: BTreeMap<String, PhaseSpec>,
    /// The phase the sandbox started in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    pub created_at_ms: u64,
    /// The project the sandbox belonged to (absent: the root project); a
    /// replay's sandbox lands in it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
}

/// `GET /v1/sandboxes/{id}/trajectory`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Trajectory {
    pub sandbox_id: String,
    pub origin: TrajectoryOrigin,
    /// When the sandbox ended; the log is kept for the server's
    /// trajectory retention after that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    /// In step order.
    pub steps: Vec<TrajectoryStep>,
}

/// The body of a `trajectory_diverged` error (HTTP 409): the step exists in
/// the log with another request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TrajectoryDivergence {
    pub step: u64,
    /// The logged request's hash.
    pub expected: String,
    /// This request's hash.
    pub got: String,
}

/// `POST /v1/sandboxes/{id}/trajectory/replay`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReplayRequest {
    /// Keep the fresh sandbox instead of deleting it after the replay.
    #[serde(default)]
    pub keep: bool,
}

/// How one step came out when replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReplayOutcome {
    /// Same result: exit code, status and output digests (execs), or the
    /// same answer kind (other calls).
    Match,
    /// It ran, with a different result; `differences` says how.
    Mismatch,
    /// It could not be re-run (an upload whose bytes were not kept, or a
    /// step that was still running when recorded).
    Skipped,
    /// The replayed call failed with an error; `message` has it.
    Failed,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplayStep {
    pub step: u64,
    pub kind: StepKind,
    pub outcome: ReplayOutcome,
    /// Field names whose values differ, e.g. `exit_code`, `stdout_sha256`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub differences: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The replayed call's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<StepResult>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReplayReport {
    /// The trajectory that was replayed.
    pub source_id: String,
    /// The fresh sandbox it was replayed in (deleted unless `keep`).
    pub sandbox_id: String,
    pub steps: Vec<ReplayStep>,
    /// True when every step matched.
    pub matched: bool,
}

//! `GET /v1/stats`: the node at a glance, for dashboards. The same numbers
//! as `GET /metrics` (Prometheus text), summed over labels where a
//! dashboard wants one line; counters count since the server started.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::events::SecurityEventKind;
use crate::exec::ExecStatus;
use crate::sandbox::{Backend, EndReason, SandboxState};

/// Where a created sandbox came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum CreateSource {
    /// Claimed from a warm pool (a warm create).
    Pool,
    /// Made for the request (a cold create).
    Fresh,
}

impl CreateSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CreateSource::Pool => "pool",
            CreateSource::Fresh => "fresh",
        }
    }
}

/// Sandboxes of one backend in one state, now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SandboxCount {
    pub backend: Backend,
    pub state: SandboxState,
    pub count: u64,
}

/// Successful creates of one backend from one source, and their latency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CreateLatency {
    pub backend: Backend,
    pub source: CreateSource,
    pub count: u64,
    /// Sum of their create times: `sum_secs / count` is the mean.
    pub sum_secs: f64,
}

/// What the node can hold and what its sandboxes asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeCapacity {
    pub max_sandboxes: u64,
    /// Live sandboxes plus creates in flight.
    pub sandboxes_used: u64,
    /// CPUs of the host.
    pub cpus_total: f64,
    /// CPUs the live sandboxes asked for, plus those a driver holds for
    /// its own guests (a VM snapshot template while it is built).
    pub cpus_used: f64,
    /// Memory of the host.
    pub memory_total_bytes: u64,
    /// Memory the live sandboxes asked for, plus what a driver holds for
    /// its own guests (a VM snapshot template while it is built).
    pub memory_used_bytes: u64,
}

/// Lazy image loading since the server started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
pub struct ImageFetchStats {
    /// Bytes fetched from the blob store.
    pub fetched_bytes: u64,
    pub fetched_chunks: u64,
    /// Fill requests of the layer cache that found their range already local.
    pub cache_hits: u64,
    /// Fill requests of the layer cache in all.
    pub fill_events: u64,
}

/// `GET /v1/stats`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeStats {
    pub version: String,
    /// Unix time in milliseconds when the numbers were read.
    pub time_ms: u64,
    /// Sandboxes that are not ended, by backend and state.
    pub sandboxes: Vec<SandboxCount>,
    pub capacity: NodeCapacity,
    /// Creates that made (or claimed) a sandbox.
    pub creations_total: u64,
    /// Creates that failed after admission.
    pub creations_failed_total: u64,
    pub create_latency: Vec<CreateLatency>,
    /// Finished execs by status.
    pub execs: BTreeMap<ExecStatus, u64>,
    /// Sum of finished execs' wall times.
    pub exec_seconds_sum: f64,
    /// Ended sandboxes by reason.
    pub ends: BTreeMap<EndReason, u64>,
    /// Security events the node learnt of, by kind.
    pub security_events: BTreeMap<SecurityEventKind, u64>,
    pub images: ImageFetchStats,
    /// Creates waiting for admission.
    pub queue_depth: u64,
    /// Idle warm-pool members by image (every configured pool, zero included).
    pub pool_idle: BTreeMap<String, u64>,
    /// Whether Landlock's refusals become `landlock` events here
    /// (`warren serve --landlock-audit`), and if not, why.
    #[serde(default)]
    pub landlock_events: LandlockEvents,
}

/// Whether the node reads Landlock's refusals (kernel audit records).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
pub struct LandlockEvents {
    /// True while refusals become `landlock` security events.
    pub available: bool,
    /// How the node gets the records (e.g. `registered as the audit
    /// daemon`), or why there are none (`--landlock-audit off`, the
    /// kernel's refusal to enable audit).
    pub detail: String,
}

//! Sandboxes: the create request, the info record, states and end reasons.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::network::NetworkPolicy;
use crate::phase::{validate_phases, PhaseSpec};

/// Which isolation technology runs the sandbox. One parameter moves a task
/// between backends; only `container` runs in this release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    Function,
    #[default]
    Container,
    Microvm,
    Vm,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Function => "function",
            Backend::Container => "container",
            Backend::Microvm => "microvm",
            Backend::Vm => "vm",
        }
    }
}

/// What the sandbox's network namespace contains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// An empty network namespace: not even loopback is up.
    #[default]
    None,
    /// A private network namespace with only `lo` up.
    Loopback,
    /// `lo` plus egress through a veth pair, limited to `network_policy`
    /// (enforced by eBPF programs on the sandbox's cgroup).
    Allowlist,
}

pub const DEFAULT_IMAGE: &str = "default";

/// `POST /v1/sandboxes`. Unknown fields are rejected with the field named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    #[serde(default)]
    pub backend: Backend,
    /// Image name, e.g. `default` or `busybox`.
    #[serde(default = "default_image")]
    pub image: String,
    /// CPU cores (fractions allowed), enforced as a CFS quota.
    #[serde(default = "default_cpus")]
    pub cpus: f64,
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u64,
    /// Size of the writable layer.
    #[serde(default = "default_disk_mib")]
    pub disk_mib: u64,
    /// Maximum number of processes and threads.
    #[serde(default = "default_pids")]
    pub pids: u32,
    /// Maximum number of files, directories and links in the writable
    /// layer (64 to 2^32); default 256 per MiB of `disk_mib`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inodes: Option<u64>,
    /// Open files per process (`RLIMIT_NOFILE`, soft and hard, 16 to
    /// 2^20); default 4096.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_files: Option<u32>,
    /// Environment every exec in the sandbox starts with.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// End the sandbox after this long without an API call touching it.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_secs: u64,
    /// End the sandbox this long after creation, whatever it is doing.
    #[serde(default = "default_lifetime")]
    pub lifetime_secs: u64,
    #[serde(default)]
    pub network: NetworkMode,
    /// Egress allowed in `allowlist` mode (a phase's `network` replaces it
    /// while that phase is current). Only valid with `network: allowlist`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    /// Named phases with their protected paths and egress policies.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub phases: BTreeMap<String, PhaseSpec>,
    /// The phase the sandbox starts in; required when `phases` is not empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The same key always answers with the same sandbox, never a second one.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// The project the sandbox belongs to: the caller key's own project
    /// (the default) or one below it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
}

fn root_project() -> String {
    crate::iam::ROOT_PROJECT.to_string()
}
fn default_image() -> String {
    DEFAULT_IMAGE.to_string()
}
fn default_cpus() -> f64 {
    1.0
}
fn default_memory_mib() -> u64 {
    512
}
fn default_disk_mib() -> u64 {
    1024
}
fn default_pids() -> u32 {
    512
}
fn default_idle_timeout() -> u64 {
    900
}
fn default_lifetime() -> u64 {
    6 * 3600
}

pub const MAX_CPUS: f64 = 64.0;
pub const MIN_MEMORY_MIB: u64 = 16;
pub const MAX_MEMORY_MIB: u64 = 1024 * 1024;
pub const MIN_DISK_MIB: u64 = 1;
pub const MAX_DISK_MIB: u64 = 1024 * 1024;
pub const MIN_PIDS: u32 = 8;
pub const MAX_PIDS: u32 = 1 << 20;
pub const MAX_TIMEOUT_SECS: u64 = 30 * 24 * 3600;
pub const MIN_INODES: u64 = 64;
pub const MAX_INODES: u64 = 1 << 32;
/// Writable-layer inodes per MiB of disk when the request names none: one
/// per 4 KiB, so a disk full of small files is still possible while an
/// empty-file flood stops at a bound the node can afford.
pub const INODES_PER_DISK_MIB: u64 = 256;
pub const DEFAULT_OPEN_FILES: u32 = 4096;
/// Below this a shell cannot run a pipeline; above it is the kernel's `nr_open` default.
pub const MIN_OPEN_FILES: u32 = 16;
pub const MAX_OPEN_FILES: u32 = 1 << 20;

/// The writable layer's inode cap for a disk of `disk_mib` when the request
/// names none.
pub fn default_inodes(disk_mib: u64) -> u64 {
    disk_mib.saturating_mul(INODES_PER_DISK_MIB).clamp(MIN_INODES, MAX_INODES)
}

impl Default for CreateSandboxRequest {
    fn default() -> Self {
        CreateSandboxRequest {
            backend: Backend::default(),
            image: default_image(),
            cpus: default_cpus(),
            memory_mib: default_memory_mib(),
            disk_mib: default_disk_mib(),
            pids: default_pids(),
            inodes: None,
            open_files: None,
            env: BTreeMap::new(),
            labels: BTreeMap::new(),
            idle_timeout_secs: default_idle_timeout(),
            lifetime_secs: default_lifetime(),
            network: NetworkMode::default(),
            network_policy: None,
            phases: BTreeMap::new(),
            phase: None,
            idempotency_key: None,
            project: None,
        }
    }
}

impl CreateSandboxRequest {
    /// Checks ranges; the error names the first offending field.
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.image.is_empty() || self.image.len() > 256 {
            return Err(ApiError::invalid("image", "must be 1-256 characters"));
        }
        if !(self.cpus.is_finite() && self.cpus >= 0.01 && self.cpus <= MAX_CPUS) {
            return Err(ApiError::invalid("cpus", format!("must be between 0.01 and {MAX_CPUS}")));
        }
        if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&self.memory_mib) {
            return Err(ApiError::invalid(
                "memory_mib",
                format!("must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}"),
            ));
        }
        if !(MIN_DISK_MIB..=MAX_DISK_MIB).contains(&self.disk_mib) {
            return Err(ApiError::invalid("disk_mib", format!("must be between {MIN_DISK_MIB} and {MAX_DISK_MIB}")));
        }
        if !(MIN_PIDS..=MAX_PIDS).contains(&self.pids) {
            return Err(ApiError::invalid("pids", format!("must be between {MIN_PIDS} and {MAX_PIDS}")));
        }
        if let Some(inodes) = self.inodes {
            if !(MIN_INODES..=MAX_INODES).contains(&inodes) {
                return Err(ApiError::invalid("inodes", format!("must be between {MIN_INODES} and {MAX_INODES}")));
            }
        }
        if let Some(files) = self.open_files {
            if !(MIN_OPEN_FILES..=MAX_OPEN_FILES).contains(&files) {
                return Err(ApiError::invalid(
                    "open_files",
                    format!("must be between {MIN_OPEN_FILES} and {MAX_OPEN_FILES}"),
                ));
            }
        }
        if self.idle_timeout_secs == 0 || self.idle_timeout_secs > MAX_TIMEOUT_SECS {
            return Err(ApiError::invalid("idle_timeout_secs", format!("must be between 1 and {MAX_TIMEOUT_SECS}")));
        }
        if self.lifetime_secs == 0 || self.lifetime_secs > MAX_TIMEOUT_SECS {
            return Err(ApiError::invalid("lifetime_secs", format!("must be between 1 and {MAX_TIMEOUT_SECS}")));
        }
        validate_env(&self.env, "env")?;
        for (k, v) in &self.labels {
            if k.is_empty() || k.len() > 128 || v.len() > 1024 {
                return Err(ApiError::invalid(format!("labels.{k}"), "keys are 1-128 bytes, values at most 1024"));
            }
        }
        if let Some(policy) = &self.network_policy {
            if self.network != NetworkMode::Allowlist {
                return Err(ApiError::invalid("network_policy", "only valid with `network: allowlist`"));
            }
            policy.validate("network_policy")?;
        }
        validate_phases(&self.phases, self.phase.as_deref())?;
        if let Some(key) = &self.idempotency_key {
            if key.is_empty() || key.len() > 256 {
                return Err(ApiError::invalid("idempotency_key", "must be 1-256 characters"));
            }
        }
        Ok(())
    }
}

/// Environment names must be non-empty and free of `=` and NUL; values free of NUL.
pub fn validate_env(env: &BTreeMap<String, String>, field: &str) -> Result<(), ApiError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::invalid(format!("{field}.{k}"), "name must be non-empty without '=' or NUL"));
        }
        if v.contains('\0') {
            return Err(ApiError::invalid(format!("{field}.{k}"), "value must not contain NUL"));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// Being made; bounded by the create deadline.
    Creating,
    Running,
    /// Frozen by `POST .../pause`: its processes make no progress; the next
    /// request that needs them (exec, session, files, events) resumes it.
    /// The lifetime keeps counting, the idle timeout does not.
    Paused,
    /// Being torn down; bounded by the teardown deadline.
    Ending,
    /// Gone; `end_reason` says why.
    Ended,
}

/// Why a sandbox ended. Every ended sandbox has exactly one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// A client deleted it.
    Deleted,
    /// No API call touched it for `idle_timeout_secs`.
    IdleTimeout,
    /// It reached `lifetime_secs`.
    Lifetime,
    /// Its init was killed by the out-of-memory killer.
    Oom,
    /// Its init exited or was killed for another reason.
    InitDied,
    /// The server restarted and could not re-adopt it.
    NodeRestarted,
    /// Creation failed; `end_message` says where.
    CreateFailed,
    /// The server stopped with `--destroy-on-exit`.
    Shutdown,
    /// Cluster mode: its node stopped renewing its registration (crashed,
    /// or cut off from etcd) and the sandbox was given up.
    NodeLost,
}

/// Resources the sandbox asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Resources {
    pub cpus: f64,
    pub memory_mib: u64,
    pub disk_mib: u64,
    pub pids: u32,
    /// Inode cap of the writable layer (0 in records older than the field:
    /// the tmpfs default).
    #[serde(default)]
    pub inodes: u64,
    /// `RLIMIT_NOFILE` of every process (0 in records older than the field).
    #[serde(default)]
    pub open_files: u32,
}

impl Resources {
    /// What a create request asks for, defaults filled in.
    pub fn of(req: &CreateSandboxRequest) -> Resources {
        Resources {
            cpus: req.cpus,
            memory_mib: req.memory_mib,
            disk_mib: req.disk_mib,
            pids: req.pids,
            inodes: req.inodes.unwrap_or_else(|| default_inodes(req.disk_mib)),
            open_files: req.open_files.unwrap_or(DEFAULT_OPEN_FILES),
        }
    }
}

/// Resources the sandbox uses now (running sandboxes only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema, Default)]
pub struct Usage {
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub cpu_time_secs: f64,
    pub pids: u64,
    /// Bytes used in the writable layer.
    pub disk_bytes: u64,
}

/// `GET /v1/sandboxes/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxInfo {
    pub id: String,
    pub backend: Backend,
    pub image: String,
    pub state: SandboxState,
    pub resources: Resources,
    pub network: NetworkMode,
    /// The egress policy in force now (allowlist mode only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<NetworkPolicy>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub phases: BTreeMap<String, PhaseSpec>,
    /// The current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub idle_timeout_secs: u64,
    pub lifetime_secs: u64,
    /// Unix time in milliseconds.
    pub created_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at_ms: Option<u64>,
    pub last_activity_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<EndReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// True when the sandbox was claimed from a warm pool.
    pub from_pool: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// VM backends: what runs the guest's CPU (`tcg` where KVM cannot run
    /// this guest, as on a host whose own KVM is paravirtual).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accelerator: Option<Accelerator>,
    /// `microvm`: whether the guest booted (`cold`) or was restored from
    /// the node's snapshot of a booted guest (`snapshot`, `--vm-snapshots on`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<VmBoot>,
    /// Cluster mode: the node it was placed on, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<crate::cluster::Placement>,
    /// The project it belongs to (`root` for sandboxes made before IAM).
    #[serde(default = "root_project")]
    pub project: String,
}

/// How a VM sandbox's guest came up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VmBoot {
    /// Booted the kernel and init.
    Cold,
    /// Restored from a snapshot of a booted, idle guest of the same image
    /// and shape, then given its own hostname, entropy and clock.
    Snapshot,
}

/// How a VM sandbox's guest runs: hardware virtualization (`kvm`) or
/// QEMU's instruction translator (`tcg`, many times slower).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Accelerator {
    Kvm,
    Tcg,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxInfo>,
}

/// How an imported image is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// Read-only layer directories on the node's disk.
    #[default]
    Dir,
    /// Layered: EROFS layer files in the chunked blob store, fetched lazily
    /// through the node's layer cache and mounted once per node.
    Erofs,
    /// Layered, from an OCI image layout directory (each image layer one
    /// EROFS base layer).
    OciLayout,
    /// Layered, from a `docker save` tarball (a file on the server's host).
    DockerSave,
}

/// `GET /v1/images`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageInfo {
    pub name: String,
    /// Layer ids, bottom first.
    pub layers: Vec<String>,
    pub created_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}

/// `POST /v1/sandboxes/{id}/pack` (`pack_diff`): the sandbox's writable layer
/// becomes the top layer of a new image over the sandbox's own image layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PackRequest {
    /// Name of the new image (an existing image of that name is replaced,
    /// unless sandboxes use it).
    pub image: String,
    /// Absolute paths gone from the new image, e.g. build leftovers or a
    /// task's answers that would leak: removed from the new layer, and
    /// hidden (an overlay whiteout) where a lower layer holds them.
    #[serde(default)]
    pub scrub: Vec<String>,
}

impl PackRequest {
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.image.is_empty() || self.image.len() > 128 {
            return Err(ApiError::invalid("image", "must be 1-128 characters"));
        }
        for (i, p) in self.scrub.iter().enumerate() {
            if !p.starts_with('/') || p.contains('\0') || p == "/" {
                return Err(ApiError::invalid(format!("scrub[{i}]"), "must be an absolute path other than /"));
            }
        }
        Ok(())
    }
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub version: String,
    pub sandboxes_running: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(json: &str) -> Option<String> {
        let req: CreateSandboxRequest = serde_json::from_str(json).unwrap();
        req.validate().err().and_then(|e| e.field)
    }

    #[test]
    fn defaults_are_valid() {
        assert_eq!(field_of("{}"), None);
    }

    #[test]
    fn out_of_range_values_name_their_field() {
        assert_eq!(field_of(r#"{"cpus": 0}"#).as_deref(), Some("cpus"));
        assert_eq!(field_of(r#"{"memory_mib": 1}"#).as_deref(), Some("memory_mib"));
        assert_eq!(field_of(r#"{"disk_mib": 0}"#).as_deref(), Some("disk_mib"));
        assert_eq!(field_of(r#"{"pids": 1}"#).as_deref(), Some("pids"));
        assert_eq!(field_of(r#"{"inodes": 1}"#).as_deref(), Some("inodes"));
        assert_eq!(field_of(r#"{"open_files": 3}"#).as_deref(), Some("open_files"));
        assert_eq!(field_of(r#"{"inodes": 5000, "open_files": 64}"#), None);
        assert_eq!(field_of(r#"{"idle_timeout_secs": 0}"#).as_deref(), Some("idle_timeout_secs"));
        assert_eq!(field_of(r#"{"env": {"A=B": "x"}}"#).as_deref(), Some("env.A=B"));
        assert_eq!(field_of(r#"{"image": ""}"#).as_deref(), Some("image"));
    }

    #[test]
    fn unknown_fields_and_backends_are_rejected_by_the_parser() {
        let err = serde_json::from_str::<CreateSandboxRequest>(r#"{"colour": "blue"}"#).unwrap_err();
        assert!(err.to_string().contains("unknown field `colour`"));
        assert!(serde_json::from_str::<CreateSandboxRequest>(r#"{"backend": "lambda"}"#).is_err());
        let req: CreateSandboxRequest = serde_json::from_str(r#"{"backend": "microvm"}"#).unwrap();
        assert_eq!(req.backend, Backend::Microvm);
    }
}

/// One layer in the node's layer cache (`GET /v1/images/stats`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LayerCacheStats {
    /// `sha256:<hex>` of the layer file.
    pub digest: String,
    pub size_bytes: u64,
    /// Bytes held locally (whole verified chunks).
    pub present_bytes: u64,
    /// Bytes readers asked for that were not local yet.
    pub bytes_accessed: u64,
    /// Bytes fetched from the blob store, metadata prefill included.
    pub bytes_fetched: u64,
    pub chunks_fetched: u64,
    /// Chunks prefetched because they hold metadata (layers stored before
    /// metadata blobs existed).
    pub metadata_chunks_fetched: u64,
    /// Bytes of the layer's metadata blob fetched before mounting.
    #[serde(default)]
    pub metadata_bytes_fetched: u64,
    /// Fill events answered with EIO (a chunk could not be fetched or verified).
    pub failed_fills: u64,
    /// Bytes fetched ahead of sequential readers (part of `bytes_fetched`).
    #[serde(default)]
    pub prefetched_bytes: u64,
    /// Prefetched pieces, and how many of them a later read asked for.
    #[serde(default)]
    pub prefetched_units: u64,
    #[serde(default)]
    pub prefetched_units_used: u64,
    /// Pieces fetched because the layer's stored access trace named them
    /// (each verified like a demand fill's; part of `chunks_fetched`), their
    /// bytes, and those refused (fetch failed or digest mismatch; left for
    /// reads to fetch on demand).
    #[serde(default)]
    pub trace_units_replayed: u64,
    #[serde(default)]
    pub trace_bytes_replayed: u64,
    #[serde(default)]
    pub failed_trace_units: u64,
    /// Pieces in this node's access trace of the layer, and how many times
    /// this node stored the trace in the blob store.
    #[serde(default)]
    pub traced_units: u64,
    #[serde(default)]
    pub traces_published: u64,
    /// 1 while the layer's trace replay runs (it runs beside the first
    /// sandbox's workload; the replay counters are final at 0).
    #[serde(default)]
    pub trace_replays_running: u64,
    /// Unless `warren serve --layer-complete-after-use=false`: pieces fetched
    /// because the node completes the layer in the background once it ran
    /// something from it (verified like a demand fill's; part of
    /// `chunks_fetched` and `bytes_fetched`), their bytes, and those
    /// refused (left for reads to fetch on demand).
    #[serde(default)]
    pub completion_units: u64,
    #[serde(default)]
    pub completion_bytes: u64,
    #[serde(default)]
    pub failed_completion_units: u64,
    /// 1 while the layer's background completion runs.
    #[serde(default)]
    pub completion_running: u64,
    /// Sandboxes (and pool members) using the layer now.
    pub leases: u64,
    pub mounted: bool,
}

/// The blob store's counters since the server started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
pub struct BlobStoreStats {
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Chunks refused for a wrong digest or length.
    pub chunks_rejected: u64,
    pub chunks_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Chunks a push found already stored and did not send.
    pub chunks_deduplicated: u64,
    /// Verified pieces fetched (layers with piece digests: a read miss
    /// fetches pieces of a chunk, not the whole chunk).
    #[serde(default)]
    pub pieces_fetched: u64,
    /// Ranged GETs those pieces took (neighbouring pieces share one).
    #[serde(default)]
    pub range_requests: u64,
}

/// `GET /v1/images/stats`: what lazy loading fetched and served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
pub struct ImageStats {
    pub layers: Vec<LayerCacheStats>,
    pub store: BlobStoreStats,
}

//! The node agent: admission (with a FIFO queue and batch creates), sandbox
//! lifecycle, pause and resume, warm pools, the reaper of
//! idle and expired sandboxes, execs with their deadlines and bounded output,
//! shell sessions, file access, and function calls (one-use workers from
//! adaptive pools: `function`) - on one machine. It records its own
//! metrics (`metrics`: one Prometheus registry, served by the control crate)
//! and turns what it observes from outside a sandbox into security events
//! (`events`; Landlock's refusals come from the kernel's audit records:
//! `landlock_audit`), and holds processes that outlived their phase to the
//! current phase's protected paths with fanotify (`tamper`).
//!
//! Owns: the life of every sandbox on this node, from admission to its typed
//! end, the records that let a restarted node re-adopt them, and each
//! sandbox's trajectory log (every mutating call as a numbered step; a
//! logged step is answered from the log, never run twice: `trajectory`),
//! and how long ended sandboxes' data stays on the node's disk (per-sandbox
//! output budgets: `retention`; early forgetting while the data disk is
//! below its reserve: `pressure`).
//! Invariants: every sandbox that leaves `running` ends with exactly one
//! [`EndReason`]; nothing stays `creating` or `ending` past its deadline; a
//! warm-pool member is handed out at most once.
//! Never: resolves a sandbox path on the host by string (files go through
//! the backend's in-root resolution), or runs platform logic inside a sandbox.

mod abandoned;
mod admission;
mod batch;
mod capture;
pub mod events;
mod exec;
mod files;
mod function;
mod history;
mod image_config;
mod images;
mod landlock_audit;
mod layered;
mod limits;
pub mod metrics;
mod network;
mod pause;
mod phase;
mod pool;
mod pressure;
mod projects;
mod records;
mod retention;
mod steer;
mod tamper;
pub mod trajectory;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::{Stream, StreamExt};
use tokio::time::Instant;
use warren_api::{
    ApiError, Backend, CreateSandboxRequest, CreateSessionRequest, CreateSource, EndReason, ExecFrame, ExecRequest,
    ExecResult, ExecStatus, FileKind, ImageInfo, Resources, SandboxInfo, SandboxState, SessionInfo,
};
use warren_backend::{BackendError, Driver, ExecSpec, Liveness, SandboxHandle, SandboxSpec};
use warren_image::ImageStore;
use warren_store::{StateStore, StateStoreExt, Table};

pub use batch::BatchEvent;
pub use capture::{Capture, Chunk};
pub use exec::{ExecEntry, StdinError};
pub use files::FileError;
pub use function::FunctionPoolSpec;
pub use landlock_audit::{LandlockAuditError, LandlockAuditMode};
pub use layered::{BlobStoreConfig, DEFAULT_CACHE_BYTES, DEFAULT_LAYER_COMPLETE_AFTER_USE};
pub use network::{builtin_presets, NetworkOptions};
pub use pool::PoolSpec;
pub use projects::LiveProject;
use records::{SandboxRecord, SessionRecord};
pub use warren_image::blob::S3Config;
pub use warren_image::cache::HolderCommand;
use warren_image::cache::LayerLease;
pub use warren_image::ImageError;
pub use warren_store::StoreError;

/// How long a create may take before it is abandoned and cleaned up,
/// unless the node is configured otherwise (`--create-timeout-ms`).
pub const DEFAULT_CREATE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often the reaper looks at every sandbox.
const REAP_INTERVAL: Duration = Duration::from_millis(250);
/// The data directory's free space is looked at every this many reaper
/// ticks (one `statvfs`; see `pressure`).
const PRESSURE_EVERY_TICKS: u64 = 4;
/// Liveness probes run every this many reaper ticks.
const PROBE_EVERY_TICKS: u64 = 8;
/// One probe in this many has init answer a ping; the others only look
/// whether it lives ([`Driver::probe_idle`]: for a container, no wake-up
/// inside the sandbox). Pings of idle sandboxes were most of an idle
/// node's CPU (each is a connection init serves on a thread of its own).
/// While a ping goes unanswered, every probe pings, so the
/// [`UNRESPONSIVE_GRACE`] is counted as before.
const PING_EVERY_PROBES: u64 = 4;
/// How long a sandbox whose PID 1 is there may leave every ping unanswered
/// before it is ended as `init_died`. A ping alone is a poor judge: a TCG
/// guest on a loaded host misses its 2 s for a while and then answers.
const UNRESPONSIVE_GRACE: Duration = Duration::from_secs(30);
/// Probes in flight at once, over all sandboxes. Each runs in its own task:
/// a ping that waits out its timeout delays no other sandbox's probe, nor
/// the reaper's idle and lifetime checks.
const PROBES_AT_ONCE: usize = 16;
/// Limit counters (OOM kills, refused forks, a full writable layer) are
/// read every this many reaper ticks.
const LIMITS_EVERY_TICKS: u64 = 4;
/// Threads reading limit counters at once: a VM's are a round trip to its
/// guest (up to 2 s for one that does not answer), a container's a few
/// file reads.
const LIMIT_WATCHERS: usize = 4;
/// Sandboxes taken over at once when a node starts (a VM's adoption waits
/// for its guest to answer the control port's resync).
const ADOPT_CONCURRENCY: usize = 16;
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub data_dir: PathBuf,
    /// Names this node's cgroups (`<controller>/<instance>/<sandbox>`), so
    /// several nodes or test servers on one host never touch each other's.
    pub instance: String,
    pub init_binary: PathBuf,
    pub max_sandboxes: usize,
    /// Memory (MiB) the running sandboxes may ask for in all; paused ones'
    /// memory does not count. `None`: only `max_sandboxes` bounds admission.
    pub max_memory_mib: Option<u64>,
    /// Creates that may wait for room at once (the admission queue's bound).
    pub admission_queue_limit: usize,
    pub pools: Vec<PoolSpec>,
    /// Warm pools of one-use workers for function calls (`--function-pool`).
    pub function_pools: Vec<FunctionPoolSpec>,
    /// Enables layered (EROFS, lazily fetched) images: how to start the
    /// layer cache's fill holder, and the cache's size bound.
    pub layer_cache: Option<(HolderCommand, u64)>,
    /// Docker-style `config.json` with registry credentials, used by pulls
    /// and pushes whose request brings none.
    pub registry_auth_file: Option<PathBuf>,
    /// Layered images' blob store: an S3-compatible bucket instead of
    /// `<data>/blobs`, and the chunk size of new layers.
    pub blob_store: BlobStoreConfig,
    /// Ended sandboxes' records (with their exec results and idempotency
    /// keys) are deleted this long after they ended.
    pub ended_retention: Duration,
    /// The address pool, resolver hosts and presets of `allowlist` sandboxes.
    pub network: NetworkOptions,
    /// A sandbox's trajectory log is deleted this long after the sandbox
    /// ended (it outlives the sandbox's own record).
    pub trajectory_retention: Duration,
    /// Captured output of finished execs a sandbox keeps on the node (exec
    /// results and trajectory) before the oldest outputs are dropped.
    pub exec_output_retention_bytes: u64,
    /// Bytes of uploads a sandbox's trajectory keeps for replay (each
    /// distinct content once); past it an upload is logged by its digest
    /// only, as one larger than [`trajectory::KEEP_UPLOAD_BYTES`] is.
    pub upload_retention_bytes: u64,
    /// While less than this share (percent) of the data directory's
    /// filesystem is available, ended sandboxes are forgotten before their
    /// retention is up, the longest ended first (see `pressure`); 0: never.
    pub disk_reserve_percent: u8,
    /// Sandbox ids are `<prefix>-<16 hex digits>`: [`SANDBOX_ID_PREFIX`]
    /// alone, or `sb-<node name>` on a cluster's node, so that any API
    /// server can tell a sandbox's node from its id.
    pub sandbox_id_prefix: String,
    /// Whether Landlock's audit records become `landlock` events, and
    /// whether the node may enable audit for it (`--landlock-audit`).
    pub landlock_audit: LandlockAuditMode,
    /// How long a create may take before it is abandoned, everything it
    /// made removed, and the caller answered `timed_out`.
    pub create_timeout: Duration,
}

/// The default [`NodeConfig::sandbox_id_prefix`].
pub const SANDBOX_ID_PREFIX: &str = "sb";

/// Default of [`NodeConfig::exec_output_retention_bytes`], MiB: eight execs'
/// whole default capture (1 MiB per stream). Stored, an output takes about
/// twice its size in the exec record (text and base64) and again in the
/// trajectory.
pub const DEFAULT_EXEC_OUTPUT_RETENTION_MIB: u64 = 16;

/// Default of [`NodeConfig::upload_retention_bytes`], MiB: half of a
/// default sandbox's disk, eight uploads of the largest size kept.
pub const DEFAULT_UPLOAD_RETENTION_MIB: u64 = 512;

/// Default of [`NodeConfig::disk_reserve_percent`].
pub const DEFAULT_DISK_RESERVE_PERCENT: u8 = 10;

/// Default of [`NodeConfig::ended_retention`]: one hour.
pub const DEFAULT_ENDED_RETENTION_SECS: u64 = 3600;
/// Ended records are looked for at most every this many reaper ticks
/// (about 15 s), and more often when the retention is shorter.
const RETENTION_MAX_EVERY_TICKS: u64 = 60;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("{0}")]
    Invalid(ApiError),
    #[error("no sandbox {0}")]
    NotFound(String),
    #[error("sandbox {id} has ended ({reason:?})")]
    Ended { id: String, reason: EndReason },
    #[error("no exec {0}")]
    ExecNotFound(String),
    #[error("no session {0}")]
    SessionNotFound(String),
    #[error("backend `{}` is not supported by this node yet", .0.as_str())]
    UnsupportedBackend(Backend),
    #[error("no image {0}")]
    ImageNotFound(String),
    #[error("idempotency key {0} was used with a different request")]
    IdempotencyConflict(String),
    #[error("image {0} is in use by running sandboxes or a warm pool")]
    ImageInUse(String),
    #[error("node is full: {0} sandboxes running")]
    Capacity(usize),
    #[error("trajectory step {} is logged with another request (logged {}, this one {})", .0.step, .0.expected, .0.got)]
    TrajectoryDiverged(warren_api::TrajectoryDivergence),
    #[error("every function worker of image {image} is busy and {queue} calls already wait")]
    FunctionQueueFull { image: String, queue: usize },
    #[error("the admission queue is full: {limit} creates wait already")]
    AdmissionQueueFull { limit: usize },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Image(ImageError),
    #[error(transparent)]
    File(#[from] FileError),
    #[error("the create did not finish within {0:?}; what it had made is removed")]
    CreateTimedOut(Duration),
    #[error("{0}")]
    Internal(String),
}

impl From<ImageError> for NodeError {
    fn from(e: ImageError) -> Self {
        match e {
            ImageError::NotFound(name) => NodeError::ImageNotFound(name),
            other => NodeError::Image(other),
        }
    }
}

pub type Result<T, E = NodeError> = std::result::Result<T, E>;

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// A random id like `sb-1f2e3d4c5b6a7980`.
pub fn new_id(prefix: &str) -> String {
    let mut bytes = [0u8; 8];
    // getrandom only fails before the kernel's pool is initialised; fall back to time.
    if rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty()).is_err() {
        bytes = (SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0) as u64).to_le_bytes();
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// A sandbox this node runs now.
struct Live {
    id: String,
    handle: SandboxHandle,
    driver: Arc<dyn Driver>,
    record: Mutex<SandboxRecord>,
    execs: Mutex<HashMap<String, Arc<ExecEntry>>>,
    running_execs: AtomicUsize,
    sessions: Mutex<HashMap<String, Arc<tokio::sync::Mutex<SessionRecord>>>>,
    /// Security events, init's and the node's, in one order.
    timeline: Mutex<events::Timeline>,
    /// Held while the sandbox switches phase (see `phase`).
    phase_switch: tokio::sync::Mutex<()>,
    /// The limit counters the reaper saw last.
    limits: Mutex<limits::LimitWatch>,
    /// The finished execs' outputs it keeps on the node (see `retention`).
    outputs: Mutex<retention::OutputLedger>,
    /// Bytes of the uploads its trajectory keeps; `None` until the first
    /// upload since the server started counts them (see `trajectory`).
    kept_upload_bytes: Mutex<Option<u64>>,
    /// Since when every probe found PID 1 there but not answering.
    unanswered_since: Mutex<Option<std::time::Instant>>,
    /// A probe of this sandbox is in flight; the reaper starts no second one.
    probing: AtomicBool,
    /// Probes so far (see [`PING_EVERY_PROBES`]).
    probes: AtomicU64,
    /// Keeps the sandbox's layered-image layers mounted while it lives.
    _layers: Vec<LayerLease>,
}

impl Live {
    fn new(
        id: String,
        handle: SandboxHandle,
        driver: Arc<dyn Driver>,
        rec: SandboxRecord,
        layers: Vec<LayerLease>,
    ) -> Arc<Live> {
        Arc::new(Live {
            id,
            handle,
            driver,
            _layers: layers,
            record: Mutex::new(rec),
            execs: Mutex::new(HashMap::new()),
            running_execs: AtomicUsize::new(0),
            sessions: Mutex::new(HashMap::new()),
            timeline: Mutex::new(events::Timeline::default()),
            phase_switch: tokio::sync::Mutex::new(()),
            limits: Mutex::new(limits::LimitWatch::default()),
            outputs: Mutex::new(retention::OutputLedger::default()),
            kept_upload_bytes: Mutex::new(None),
            unanswered_since: Mutex::new(None),
            probing: AtomicBool::new(false),
            probes: AtomicU64::new(0),
        })
    }

    /// Records a probe's answer; returns for how long no probe has been
    /// answered (zero when this one was).
    fn probe_answered(&self, answered: bool) -> Duration {
        let mut since = self.unanswered_since.lock().unwrap_or_else(|p| p.into_inner());
        if answered {
            *since = None;
            return Duration::ZERO;
        }
        since.get_or_insert_with(std::time::Instant::now).elapsed()
    }

    fn timeline(&self) -> std::sync::MutexGuard<'_, events::Timeline> {
        self.timeline.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self) -> std::sync::MutexGuard<'_, SandboxRecord> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn touch(&self) {
        self.record().info.last_activity_at_ms = now_ms();
    }
}

struct Inner {
    cfg: NodeConfig,
    store: Arc<dyn StateStore>,
    images: Arc<ImageStore>,
    /// Taken out (and shut down) when the node stops.
    layered: Mutex<Option<Arc<layered::LayeredImages>>>,
    container: Arc<dyn Driver>,
    /// Drivers of the VM backends this node runs (see [`Node::start_with`]);
    /// a backend with none answers `unsupported_backend`.
    vm_drivers: HashMap<Backend, Arc<dyn Driver>>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    creating: AtomicUsize,
    pools: pool::Pools,
    functions: Arc<function::Functions>,
    function_driver: Arc<function::driver::FunctionDriver>,
    net: network::NodeNet,
    metrics: Arc<metrics::NodeMetrics>,
    admission: admission::Admission,
    /// Serialises pausing and resuming (see `pause`).
    pause_gate: Mutex<()>,
    /// Bounds the reaper's probes in flight ([`PROBES_AT_ONCE`]).
    probe_slots: Arc<tokio::sync::Semaphore>,
    /// Set while a round of the limit watch runs (one at a time).
    watching_limits: Arc<AtomicBool>,
    /// Disk-pressure rounds that found nothing left to forget (`pressure`).
    pressure: pressure::Relief,
    /// Reads Landlock's audit records; taken out (and stopped, restoring
    /// the host's audit settings) when the node stops.
    landlock_audit: Mutex<Option<landlock_audit::Listener>>,
    /// Refuses what earlier phases' processes may no longer do to
    /// protected paths (fanotify; see `tamper`).
    tamper: tamper::TamperWatch,
}

/// The node agent. Cheap to clone; all clones share one node.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

impl Node {
    /// Opens the node on its data directory, re-adopts the sandboxes that
    /// still live, ends the others with `node_restarted`, sweeps orphans, and
    /// starts the reaper and the pool filler.
    pub async fn start(cfg: NodeConfig, store: Arc<dyn StateStore>, container: Arc<dyn Driver>) -> Result<Node> {
        Node::start_with(cfg, store, container, HashMap::new()).await
    }

    /// [`Node::start`] with drivers for further backends (`microvm`, `vm`),
    /// one per backend.
    pub async fn start_with(
        cfg: NodeConfig,
        store: Arc<dyn StateStore>,
        container: Arc<dyn Driver>,
        vm_drivers: HashMap<Backend, Arc<dyn Driver>>,
    ) -> Result<Node> {
        let images = Arc::new(ImageStore::open(cfg.data_dir.join("images"))?);
        let pools = pool::Pools::new(cfg.pools.clone());
        let layered = match &cfg.layer_cache {
            Some((holder, bytes)) => {
                let store = &cfg.blob_store;
                Some(Arc::new(layered::LayeredImages::open(&cfg.data_dir, holder.clone(), *bytes, store).await?))
            }
            None => None,
        };
        let net = network::NodeNet::open(&cfg.instance, &cfg.data_dir, &cfg.network)?;
        let functions = function::Functions::new(cfg.function_pools.clone(), Arc::clone(&container));
        let function_driver = function::driver::FunctionDriver::new(Arc::clone(&functions));
        let admission = admission::Admission::new(cfg.admission_queue_limit);
        let (tamper, refusals) = tamper::TamperWatch::new(cfg.instance.clone());
        let node = Node {
            inner: Arc::new(Inner {
                net,
                cfg,
                store,
                images,
                layered: Mutex::new(layered),
                container,
                vm_drivers,
                live: Mutex::new(HashMap::new()),
                creating: AtomicUsize::new(0),
                admission,
                pause_gate: Mutex::new(()),
                probe_slots: Arc::new(tokio::sync::Semaphore::new(PROBES_AT_ONCE)),
                watching_limits: Arc::new(AtomicBool::new(false)),
                pressure: pressure::Relief::default(),
                landlock_audit: Mutex::new(None),
                tamper,
                pools,
                functions,
                function_driver,
                metrics: metrics::NodeMetrics::new(),
            }),
        };
        node.inner.net.set_node(&node.inner);
        tamper::record_refusals(Arc::downgrade(&node.inner), refusals);
        for driver in node.inner.vm_drivers.values() {
            driver.attach_books(Arc::new(admission::DriverBooks(Arc::downgrade(&node.inner))));
        }
        let cfg = &node.inner.cfg;
        let listener = landlock_audit::Listener::start(
            cfg.landlock_audit,
            Arc::downgrade(&node.inner),
            cfg.instance.clone(),
            &cfg.data_dir,
        )
        .map_err(|e| NodeError::Internal(e.to_string()))?;
        *node.inner.landlock_audit.lock().unwrap_or_else(|p| p.into_inner()) = Some(listener);
        node.recover().await?;
        if let Err(e) = node.recover_trajectories() {
            // The sandboxes still work; only steps cut by the restart stay `running`.
            tracing::error!("cannot settle the trajectory steps cut by the restart: {e}");
        }
        let reaper = node.clone();
        tokio::spawn(async move { reaper.reap_forever().await });
        let filler = node.clone();
        tokio::spawn(async move { filler.fill_pools_forever().await });
        let function_filler = node.clone();
        tokio::spawn(async move { function_filler.fill_function_pools_forever().await });
        Ok(node)
    }

    fn live_map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Live>>> {
        self.inner.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn driver(&self, backend: Backend) -> Result<Arc<dyn Driver>> {
        match backend {
            Backend::Container => Ok(Arc::clone(&self.inner.container)),
            Backend::Function => Ok(self.inner.function_driver.clone()),
            other => self.inner.vm_drivers.get(&other).cloned().ok_or(NodeError::UnsupportedBackend(other)),
        }
    }

    fn store(&self) -> &dyn StateStore {
        self.inner.store.as_ref()
    }

    fn save(&self, rec: &SandboxRecord) -> Result<()> {
        Ok(self.store().put_json(Table::Sandboxes, &rec.info.id, rec)?)
    }

    /// [`Node::save`] on the blocking pool, started at once: a durable commit
    /// waits for the disk, which must not stall a runtime worker (and so
    /// every other request on it). Await the handle for the outcome.
    fn commit(&self, rec: SandboxRecord) -> tokio::task::JoinHandle<Result<()>> {
        let node = self.clone();
        tokio::task::spawn_blocking(move || node.save(&rec))
    }

    pub fn sandboxes_running(&self) -> usize {
        self.live_map().len()
    }

    // ---- lifecycle ------------------------------------------------------

    /// Creates a sandbox, or returns the one an earlier call with the same
    /// idempotency key made. The bool is true when this call made it.
    pub async fn create(&self, req: CreateSandboxRequest) -> Result<(SandboxInfo, bool)> {
        self.create_with(req, admission::Admit::Now).await
    }

    /// [`Node::create`], meeting a full node as `admit` says.
    async fn create_with(&self, req: CreateSandboxRequest, admit: admission::Admit<'_>) -> Result<(SandboxInfo, bool)> {
        self.inner.pools.busy();
        req.validate().map_err(NodeError::Invalid)?;
        let driver = self.driver(req.backend)?;
        let image = self.resolve_image(&req.image).await.map_err(|e| match e {
            NodeError::ImageNotFound(name) => {
                NodeError::Invalid(ApiError::invalid("image", format!("no image named `{name}`")))
            }
            other => other,
        })?;
        let resources = Resources::of(&req);
        let pool_key = pool::PoolKey::new(&req.image, &resources, req.network).with_backend(req.backend);
        let id = new_id(&self.inner.cfg.sandbox_id_prefix);
        let policy = Node::initial_policy(&req);
        if req.network == warren_api::NetworkMode::Allowlist {
            self.check_policy(&policy)?;
        }

        if let Some(key) = &req.idempotency_key {
            let claim = records::IdempotencyClaim { sandbox_id: id.clone(), request_hash: records::request_hash(&req) };
            if let Some(existing) = self.store().put_json_if_absent(Table::Idempotency, key, &claim)? {
                if existing.request_hash != claim.request_hash {
                    return Err(NodeError::IdempotencyConflict(key.clone()));
                }
                return Ok((self.wait_created(&existing.sandbox_id).await?, false));
            }
        }
        // From here a call dropped midway (its client went away) leaves
        // nothing half-done: see `abandoned`.
        let mut guard = abandoned::CreateGuard::new(self.clone(), &id, req.idempotency_key.as_deref());

        let admitted = match self.admit(&id, req.memory_mib, admit).await {
            Ok(t) => t,
            Err(e) => {
                if let Some(key) = &req.idempotency_key {
                    // Nothing was made: a retry with this key must be free to try again.
                    let _ = self.store().delete(Table::Idempotency, key);
                }
                guard.settle();
                return Err(e);
            }
        };
        let create_started = Instant::now();
        let _creating = self.inner.metrics.in_flight(req.backend, SandboxState::Creating);
        let now = now_ms();
        let mut rec = SandboxRecord {
            info: SandboxInfo {
                id: id.clone(),
                backend: req.backend,
                image: req.image.clone(),
                state: SandboxState::Creating,
                resources: resources.clone(),
                network: req.network,
                network_policy: req.network_policy.clone(),
                phases: req.phases.clone(),
                phase: req.phase.clone(),
                labels: req.labels.clone(),
                idle_timeout_secs: req.idle_timeout_secs,
                lifetime_secs: req.lifetime_secs,
                created_at_ms: now,
                started_at_ms: None,
                last_activity_at_ms: now,
                ended_at_ms: None,
                end_reason: None,
                end_message: None,
                usage: None,
                from_pool: false,
                idempotency_key: req.idempotency_key.clone(),
                accelerator: None,
                boot: None,
                placement: None,
                project: req.project.clone().unwrap_or_else(|| warren_api::ROOT_PROJECT.to_string()),
            },
            env: image_config::sandbox_env(&image.config, &req.env),
            workdir: image.config.working_dir.clone(),
            handle: None,
        };
        // Only a concurrent call with the same idempotency key can learn the
        // id before this call returns, and it looks for this record. Without
        // a key nobody can, and a crash midway leaves only what the startup
        // sweep removes: the record would be a durable commit for nothing.
        if req.idempotency_key.is_some() {
            guard.recording(&rec, self.commit(rec.clone()));
            if let Some(committed) = guard.recorded().await {
                committed?;
            }
        }

        let mut layer_leases = image.leases;
        // Pool members are made without phases (the first phase's rules
        // start with the member's init); a sandbox with phases is always
        // made fresh. An `allowlist` member's network and policy are
        // plugged below, at the claim, as a fresh sandbox's are.
        let poolable = req.phases.is_empty() && pool::pooled_backend(req.backend);
        let pooled = if poolable { self.claim_pooled(&pool_key).await } else { None };
        // A fresh sandbox's record is committed (`creating`) while the
        // driver makes it, not after: the device sync overlaps the create,
        // and the call still answers only once both are done. The record
        // has no handle; a restart rebuilds it from the driver's own state
        // and re-adopts the sandbox, or ends it `node_restarted` if it
        // never got that far. A create with an idempotency key committed
        // its record already and stays in order: a concurrent call with
        // the key waits for it to leave `creating` and must then find the
        // sandbox made.
        if let Some((handle, _)) = &pooled {
            guard.made(&driver, handle);
        }
        if pooled.is_none() && req.idempotency_key.is_none() && driver.recovers_handles() {
            guard.recording(&rec, self.commit(rec.clone()));
        }
        let made = match pooled {
            Some((handle, member_leases)) => {
                rec.info.from_pool = true;
                layer_leases = member_leases;
                Ok(handle)
            }
            None => {
                let spec = SandboxSpec {
                    id: id.clone(),
                    layers: image.paths,
                    resources,
                    network: req.network,
                    hostname: id.clone(),
                    phase: phase::rules(&req.phases, req.phase.as_deref()),
                };
                let timeout = self.inner.cfg.create_timeout;
                match tokio::time::timeout(timeout, driver.create(&spec)).await {
                    Ok(r) => r.map_err(|e| phase::backend_error(e, req.phase.as_deref().unwrap_or_default())),
                    Err(_) => {
                        // The create future was dropped midway; sweep whatever it left.
                        let _ = driver
                            .destroy(&SandboxHandle {
                                id: id.clone(),
                                backend: req.backend,
                                state: serde_json::Value::Null,
                            })
                            .await;
                        Err(NodeError::CreateTimedOut(timeout))
                    }
                }
            }
        };
        if let Ok(handle) = &made {
            guard.made(&driver, handle);
        }
        let made = match made {
            Ok(handle) if req.network == warren_api::NetworkMode::Allowlist => {
                match self.plug_network(&id, &driver, &handle, &policy).await {
                    Ok(()) => Ok(handle),
                    Err(e) => {
                        let _ = driver.destroy(&handle).await;
                        Err(e)
                    }
                }
            }
            other => other,
        };
        let early_committed = guard.recorded().await;
        let handle = match made {
            Ok(h) => h,
            Err(e) => {
                let source = if rec.info.from_pool { CreateSource::Pool } else { CreateSource::Fresh };
                self.inner.metrics.create_failed(req.backend, source, &rec.info.project);
                self.inner.metrics.ended(req.backend, EndReason::CreateFailed, &rec.info.project);
                rec.mark_ended(EndReason::CreateFailed, Some(e.to_string()));
                joined(self.commit(rec.clone()).await)?;
                if let Some(key) = &req.idempotency_key {
                    // Let a retry with the same key try again instead of replaying the failure.
                    let _ = self.store().delete(Table::Idempotency, key);
                }
                guard.settle();
                return Err(e);
            }
        };
        rec.info.state = SandboxState::Running;
        rec.info.started_at_ms = Some(now_ms());
        rec.info.accelerator = driver.accelerator(&handle);
        rec.info.boot = driver.boot(&handle);
        rec.handle = Some(handle.clone());
        match early_committed {
            Some(Ok(())) => {}
            // The sandbox stands but its record could not be made durable.
            Some(Err(e)) => {
                let _ = driver.destroy(&handle).await;
                guard.settle();
                return Err(e);
            }
            None => joined(self.commit(rec.clone()).await)?,
        }
        let info = rec.info.clone();
        self.live_map().insert(id.clone(), Live::new(id, handle, driver, rec, layer_leases));
        guard.settle();
        if info.phase.is_some() {
            self.watch_protected_paths(&info.id).await;
        }
        drop(admitted);
        let source = if info.from_pool { CreateSource::Pool } else { CreateSource::Fresh };
        self.inner.metrics.created(info.backend, source, create_started.elapsed().as_secs_f64(), &info.project);
        Ok((info, true))
    }

    /// Waits (bounded) until a sandbox made by a concurrent call with the same
    /// idempotency key has left `creating`.
    async fn wait_created(&self, id: &str) -> Result<SandboxInfo> {
        let mut deadline = Instant::now() + self.inner.cfg.create_timeout + Duration::from_secs(5);
        loop {
            // The first call stores its claim before its record: not found yet means not made yet.
            match self.get(id) {
                Ok(info) if info.state != SandboxState::Creating => return Ok(info),
                Ok(info) if Instant::now() > deadline => return Ok(info),
                // Still waiting for room: its create deadline has not started.
                Err(NodeError::NotFound(_)) if self.inner.admission.is_waiting(id) => {
                    deadline = Instant::now() + self.inner.cfg.create_timeout + Duration::from_secs(5);
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Ok(_) | Err(NodeError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The live sandbox `id`, as it is (a paused one stays paused); request
    /// paths use [`Node::live`], which resumes it.
    fn live_as_is(&self, id: &str) -> Result<Arc<Live>> {
        if let Some(l) = self.live_map().get(id) {
            return Ok(Arc::clone(l));
        }
        match self.store().get_json::<SandboxRecord>(Table::Sandboxes, id)? {
            Some(rec) => match rec.info.end_reason {
                Some(reason) => Err(NodeError::Ended { id: id.to_string(), reason }),
                None => Err(NodeError::Invalid(ApiError::new(
                    warren_api::ErrorCode::InvalidRequest,
                    format!("sandbox {id} is {:?}", rec.info.state),
                ))),
            },
            None => Err(NodeError::NotFound(id.to_string())),
        }
    }

    pub fn get(&self, id: &str) -> Result<SandboxInfo> {
        if let Some(l) = self.live_map().get(id).cloned() {
            let mut info = l.record().info.clone();
            info.usage = l.driver.usage(&l.handle).ok();
            return Ok(info);
        }
        self.store()
            .get_json::<SandboxRecord>(Table::Sandboxes, id)?
            .map(|r| r.info)
            .ok_or_else(|| NodeError::NotFound(id.to_string()))
    }

    pub fn list(&self, labels: &BTreeMap<String, String>, state: Option<SandboxState>) -> Result<Vec<SandboxInfo>> {
        let mut out = Vec::new();
        for (id, _) in self.store().list(Table::Sandboxes, "")? {
            let Ok(info) = self.get(&id) else { continue };
            if state.is_some_and(|s| s != info.state) {
                continue;
            }
            if labels.iter().all(|(k, v)| info.labels.get(k) == Some(v)) {
                out.push(info);
            }
        }
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    /// The backends this node can run.
    pub fn backends(&self) -> Vec<Backend> {
        let mut out = vec![Backend::Container, Backend::Function];
        out.extend(self.inner.vm_drivers.keys().copied());
        out.sort_by_key(|b| b.as_str());
        out
    }

    /// Ends a sandbox the cluster gave up on while this node was out of
    /// touch (see `warren-cluster`): it ends `node_lost`, as its clients
    /// were told. An ended one answers with its record.
    pub async fn end_node_lost(&self, id: &str) -> Result<SandboxInfo> {
        let message = Some("the cluster declared this sandbox's node lost".to_string());
        match self.end(id, EndReason::NodeLost, message).await {
            Ok(info) => Ok(info),
            Err(NodeError::Ended { .. }) => self.get(id),
            Err(e) => Err(e),
        }
    }

    /// Deletes a sandbox; deleting an ended one answers with its record.
    pub async fn delete(&self, id: &str) -> Result<SandboxInfo> {
        match self.end(id, EndReason::Deleted, None).await {
            Ok(info) => Ok(info),
            Err(NodeError::Ended { .. }) => self.get(id),
            Err(e) => Err(e),
        }
    }

    /// Ends a live sandbox with `reason`: stops its execs, destroys it, and
    /// records the end. Only the first of concurrent calls does the work.
    ///
    /// The work runs as a task of its own, which the caller only waits for:
    /// dropped at one of its `.await`s (an HTTP client that hangs up on its
    /// DELETE drops the call), it would stop there, with the sandbox out of
    /// the live map, its end not counted and, for a VM, its teardown cut
    /// short (QEMU killed, its directory, cgroup and uid left).
    async fn end(&self, id: &str, reason: EndReason, message: Option<String>) -> Result<SandboxInfo> {
        let (node, owned_id) = (self.clone(), id.to_string());
        let call = if reason == EndReason::Deleted { "delete" } else { "end" };
        self.detached(call, id, async move { node.end_now(&owned_id, reason, message).await }).await
    }

    /// Runs `work` (call `call` on sandbox `id`) as a task of its own and
    /// waits for it. A caller that goes away stops waiting, and the work
    /// runs on to its end instead of stopping at whatever it awaited; the
    /// call is counted as abandoned ([`metrics::NodeMetrics::abandoned`]).
    pub(crate) async fn detached<T: Send + 'static>(
        &self,
        call: &'static str,
        id: &str,
        work: impl std::future::Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let task = tokio::spawn(work);
        let mut waiting = AbandonWatch { metrics: &self.inner.metrics, call, id, done: false };
        let outcome = task.await.map_err(|e| NodeError::Internal(format!("{call} task: {e}")));
        waiting.done = true;
        outcome?
    }

    async fn end_now(&self, id: &str, reason: EndReason, message: Option<String>) -> Result<SandboxInfo> {
        self.inner.pools.busy();
        let live = self.live_as_is(id)?;
        if self.live_map().remove(id).is_none() {
            return self.get(id);
        }
        // Before the driver unmounts its root, which the marks' descriptors would hold.
        self.inner.tamper.forget(id);
        // Its slot is free: a waiting create may go.
        self.inner.admission.bump();
        // `ending` is in memory only (this record, the gauge): no durable
        // commit, since a restart needs none. A crash mid-teardown leaves
        // the `running` record or the `ended` one (see below). The restart
        // probes a `running` one: with PID 1 killed the sandbox ends
        // `node_restarted`, as an `ending` record did; before the kill it
        // is re-adopted, as if the unanswered delete had never come. What
        // an `ended` one left is swept. Either way nothing runs unrecorded.
        let backend = {
            let mut rec = live.record();
            rec.info.state = SandboxState::Ending;
            rec.info.backend
        };
        let _ending = self.inner.metrics.in_flight(backend, SandboxState::Ending);
        let execs: Vec<_> = live.execs.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        for e in &execs {
            e.request_kill();
        }
        let mode = live.record().info.network;
        self.unplug_network(id, mode).await;
        let mut rec = live.record().clone();
        rec.mark_ended(reason, message);
        // The end is committed while the driver tears down, not after it:
        // the device sync and the teardown overlap, and the call still
        // answers only once both are done. A crash between the two leaves
        // an `ended` record beside what the restart's sweep removes (it
        // keeps only sandboxes with a live record).
        let (destroyed, committed) = tokio::join!(live.driver.destroy(&live.handle), self.commit(rec.clone()));
        joined(committed)?;
        if let Err(e) = destroyed {
            rec.info.end_message = Some(format!("teardown error (swept at next start): {e}"));
            joined(self.commit(rec.clone()).await)?;
        }
        self.inner.metrics.ended(rec.info.backend, reason, &rec.info.project);
        self.inner.pressure.sandbox_ended();
        // Execs that were still running are recorded as killed by the
        // platform. One that had ended is recorded by its own task (a
        // second write here would cost a commit for nothing).
        for e in execs {
            if !e.is_finished() {
                e.finish_without_process(ExecStatus::Killed);
                self.persist_exec(id, &e);
            }
        }
        let _ = self.store().delete_prefix(Table::Sessions, &format!("{id}/"));
        Ok(rec.info)
    }

    // ---- execs -----------------------------------------------------------

    /// Starts an exec (in a session when `session_id` is given) and returns
    /// its entry; the node drives it to its end whatever the client does.
    pub async fn exec(&self, id: &str, req: ExecRequest, session_id: Option<&str>) -> Result<Arc<ExecEntry>> {
        self.exec_with(id, req, session_id, false).await
    }

    /// [`Node::exec`], with stdin left open after `req`'s stdin when
    /// `stdin_open` (see [`Node::send_stdin`]).
    pub async fn exec_with(
        &self,
        id: &str,
        req: ExecRequest,
        session_id: Option<&str>,
        stdin_open: bool,
    ) -> Result<Arc<ExecEntry>> {
        self.exec_logged(id, req, session_id, stdin_open, None).await
    }

    /// [`Node::exec_with`]; with `logged`, the exec is that trajectory step
    /// (whose claim already stored its `running` record) and its final
    /// record is committed together with the step's.
    pub(crate) async fn exec_logged(
        &self,
        id: &str,
        req: ExecRequest,
        session_id: Option<&str>,
        stdin_open: bool,
        logged: Option<trajectory::LoggedExec>,
    ) -> Result<Arc<ExecEntry>> {
        self.inner.pools.busy();
        req.validate(session_id.is_some()).map_err(NodeError::Invalid)?;
        let live = self.live(id)?;
        live.touch();
        let stdin = match (&req.stdin, &req.stdin_b64) {
            (Some(s), _) => Some(s.as_bytes().to_vec()),
            (None, Some(b)) => {
                use base64::Engine as _;
                Some(
                    base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .map_err(|_| NodeError::Invalid(ApiError::invalid("stdin_b64", "not valid base64")))?,
                )
            }
            (None, None) => None,
        };
        let session = match session_id {
            Some(sid) => {
                let s = live.sessions.lock().unwrap_or_else(|p| p.into_inner()).get(sid).cloned();
                Some(s.ok_or_else(|| NodeError::SessionNotFound(sid.to_string()))?.lock_owned().await)
            }
            None => None,
        };
        let (mut env, workdir) = {
            let record = live.record();
            (base_env(&record.env), record.workdir.clone())
        };
        let cwd = match &session {
            Some(s) => {
                env = s.env.clone();
                req.cwd.clone().unwrap_or_else(|| s.cwd.clone())
            }
            None => req.cwd.clone().or(workdir).unwrap_or_else(|| "/".to_string()),
        };
        env.extend(req.env.clone());
        let argv = match (&req.argv, &req.command) {
            (Some(argv), _) => argv.clone(),
            (None, Some(cmd)) => vec!["/bin/sh".to_string(), "-c".to_string(), cmd.clone()],
            (None, None) => return Err(NodeError::Invalid(ApiError::invalid("command", "give argv or command"))),
        };
        let spec = ExecSpec { argv, env, cwd, capture_session_state: session.is_some() };
        // Stdin goes with the request: a command whose stdin is closed at
        // once costs the sandbox no wake-up for that.
        let fed = stdin.map(bytes::Bytes::from).unwrap_or_default();
        let process = live.driver.exec_fed(&live.handle, spec, fed, stdin_open).await?;

        let cap = req.output_cap_bytes.unwrap_or(warren_api::DEFAULT_OUTPUT_CAP_BYTES);
        let exec_id = logged.as_ref().map_or_else(|| new_id("ex"), |l| l.exec_id.clone());
        let entry = ExecEntry::new(exec_id, session_id.map(str::to_string), cap);
        live.execs.lock().unwrap_or_else(|p| p.into_inner()).insert(entry.id.clone(), Arc::clone(&entry));
        live.running_execs.fetch_add(1, Ordering::SeqCst);
        let timeout = Duration::from_secs_f64(req.timeout_secs.unwrap_or(warren_api::DEFAULT_EXEC_TIMEOUT_SECS));
        let deadline = Instant::now() + timeout;
        if let Some(mut session) = session {
            // Stored before the end is published: a client that saw the
            // command end must find the session's new state after a crash.
            let (store, key) = (Arc::clone(&self.inner.store), format!("{}/{}", live.id, session.id));
            entry.before_end(Box::new(move |exit| {
                if let Some(state) = exit.and_then(|e| e.session_state.clone()) {
                    session.cwd = state.cwd;
                    session.env = state.env;
                    session.commands_run += 1;
                    if let Err(e) = store.put_json(Table::Sessions, &key, &*session) {
                        tracing::error!(session = %key, "cannot persist session state: {e}");
                    }
                }
            }));
        }
        let node = self.clone();
        let driving = Arc::clone(&entry);
        tokio::spawn(async move {
            // Recorded as running so that a restart can report it killed; on
            // the blocking pool while the exec runs, since the record costs a
            // durable commit. The final record waits for it, so it never
            // overwrites the final one.
            let step = logged.map(|l| l.step);
            let running = step.is_none().then(|| {
                let (node, sandbox, entry) = (node.clone(), live.id.clone(), Arc::clone(&driving));
                tokio::task::spawn_blocking(move || node.persist_exec(&sandbox, &entry))
            });
            Arc::clone(&driving).drive_fed(process, stdin_open, deadline).await;
            let done = driving.result(false);
            node.inner.metrics.exec_finished(done.status, done.wall_time_secs);
            // Touch first: the reaper must never see "no exec running" with a stale activity time.
            live.touch();
            live.running_execs.fetch_sub(1, Ordering::SeqCst);
            if let Some(running) = running {
                let _ = running.await;
            }
            // After the claim's commit, whose `running` record this one replaces.
            let step = match step {
                Some(step) => step.settled().await,
                None => None,
            };
            let finished = {
                let (node, sandbox, entry) = (node.clone(), live.id.clone(), Arc::clone(&driving));
                tokio::task::spawn_blocking(move || node.persist_exec_end(&sandbox, &entry, step))
            };
            let _ = finished.await;
            // Finished execs are served from the store; memory holds only running ones.
            live.execs.lock().unwrap_or_else(|p| p.into_inner()).remove(&driving.id);
        });
        Ok(entry)
    }

    fn persist_exec(&self, sandbox_id: &str, entry: &ExecEntry) {
        let result = records::without_text(entry.result(true));
        if let Err(e) = self.store().put_json(Table::Execs, &format!("{sandbox_id}/{}", entry.id), &result) {
            tracing::error!(exec = %entry.id, "cannot persist exec result: {e}");
        }
    }

    /// An ended exec's final record and, for a trajectory step, the step's
    /// result: one commit.
    fn persist_exec_end(&self, sandbox_id: &str, entry: &ExecEntry, step: Option<u64>) {
        let result = entry.result(true);
        let (bytes, started_at_ms) = (result.output.as_ref().map_or(0, retention::kept_bytes), result.started_at_ms);
        let mut writes = Vec::with_capacity(2);
        let result = records::without_text(result);
        match warren_store::Write::json(Table::Execs, format!("{sandbox_id}/{}", entry.id), &result) {
            Ok(w) => writes.push(w),
            Err(e) => tracing::error!(exec = %entry.id, "cannot encode exec result: {e}"),
        }
        let mut data_file = None;
        if let Some(step) = step {
            match self.finished_exec_step(sandbox_id, step, result) {
                Ok(Some((w, file))) => {
                    writes.push(w);
                    data_file = file;
                }
                Ok(None) => {}
                Err(e) => tracing::error!(exec = %entry.id, step, "cannot record an exec step's result: {e}"),
            }
        }
        let output = retention::KeptOutput { exec_id: entry.id.clone(), started_at_ms, step, data_file, bytes };
        if let Err(e) = self.commit_exec_end(sandbox_id, &writes, output) {
            tracing::error!(exec = %entry.id, "cannot persist exec result: {e}");
        }
    }

    fn exec_entry(&self, id: &str, exec_id: &str) -> Option<Arc<ExecEntry>> {
        let live = self.live_map().get(id).cloned()?;
        let e = live.execs.lock().unwrap_or_else(|p| p.into_inner()).get(exec_id).cloned();
        if e.is_some() {
            live.touch();
        }
        e
    }

    /// The exec's result so far, with its captured output.
    pub fn exec_result(&self, id: &str, exec_id: &str) -> Result<ExecResult> {
        if let Some(e) = self.exec_entry(id, exec_id) {
            return Ok(e.result(true));
        }
        self.stored_exec(id, exec_id)
    }

    fn stored_exec(&self, id: &str, exec_id: &str) -> Result<ExecResult> {
        self.store()
            .get_json::<ExecResult>(Table::Execs, &format!("{id}/{exec_id}"))?
            .map(records::with_text)
            .ok_or_else(|| NodeError::ExecNotFound(exec_id.to_string()))
    }

    /// A frame stream from the given offsets; for an exec that already ended
    /// and left memory, the stored capture is replayed.
    pub fn exec_stream(
        &self,
        id: &str,
        exec_id: &str,
        stdout_offset: u64,
        stderr_offset: u64,
    ) -> Result<std::pin::Pin<Box<dyn Stream<Item = ExecFrame> + Send>>> {
        if let Some(e) = self.exec_entry(id, exec_id) {
            return Ok(Box::pin(e.stream(stdout_offset, stderr_offset, None)));
        }
        let stored = self.stored_exec(id, exec_id)?;
        Ok(Box::pin(futures_util::stream::iter(records::replay_frames(stored, stdout_offset, stderr_offset))))
    }

    pub fn kill_exec(&self, id: &str, exec_id: &str) -> Result<ExecResult> {
        match self.exec_entry(id, exec_id) {
            Some(e) => {
                e.request_kill();
                Ok(e.result(false))
            }
            None => self.stored_exec(id, exec_id),
        }
    }

    // ---- security events ---------------------------------------------------

    /// What the sandbox tried that the platform refused, after `after_seq`:
    /// init's events are pulled into the sandbox's timeline first.
    pub async fn events(&self, id: &str, after_seq: u64) -> Result<warren_api::SecurityEventList> {
        let live = self.live(id)?;
        live.touch();
        let pulled_up_to = live.timeline().init_seq_pulled;
        let batch = live.driver.events(&live.handle, pulled_up_to).await?;
        let mut timeline = live.timeline();
        // A concurrent call may have pulled the same batch meanwhile.
        if timeline.init_seq_pulled == pulled_up_to {
            timeline.count_lost(batch.dropped);
            for event in batch.events {
                let event = records::observed(event);
                self.inner.metrics.security_event(event.kind);
                timeline.push(event, 0);
            }
            timeline.init_seq_pulled = batch.next_seq.saturating_sub(1).max(pulled_up_to);
        }
        Ok(timeline.after(after_seq))
    }

    /// Adds an event the node observed from outside the sandbox (a blocked
    /// connection, a limit hit, a phase change) to the sandbox's timeline.
    /// Events for a sandbox that is not live are dropped.
    pub fn record_event(&self, id: &str, observed: events::Observed) {
        if let Ok(live) = self.live_as_is(id) {
            self.inner.metrics.security_event(observed.kind);
            live.timeline().push(observed, now_ms());
        }
    }

    // ---- sessions --------------------------------------------------------

    pub async fn create_session(&self, id: &str, req: CreateSessionRequest) -> Result<SessionInfo> {
        if let Some(cwd) = &req.cwd {
            if !cwd.starts_with('/') {
                return Err(NodeError::Invalid(ApiError::invalid("cwd", "must be an absolute path")));
            }
        }
        warren_api::validate_env(&req.env, "env").map_err(NodeError::Invalid)?;
        let live = self.live(id)?;
        live.touch();
        if live.record().info.backend == Backend::Function {
            // Every exec of a function sandbox runs in a fresh worker: no state to keep.
            return Err(BackendError::Unsupported("function", "sessions").into());
        }
        if let Some(cwd) = &req.cwd {
            self.check_session_cwd(id, cwd).await?;
        }
        let mut env = base_env(&live.record().env);
        env.extend(req.env);
        let rec = SessionRecord {
            id: new_id("ss"),
            cwd: req.cwd.or_else(|| live.record().workdir.clone()).unwrap_or_else(|| "/root".to_string()),
            env,
            created_at_ms: now_ms(),
            commands_run: 0,
        };
        self.store().put_json(Table::Sessions, &format!("{id}/{}", rec.id), &rec)?;
        let info = rec.info(&base_env(&live.record().env));
        live.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.id.clone(), Arc::new(tokio::sync::Mutex::new(rec)));
        Ok(info)
    }

    /// A session asked to start in a directory that is not there is refused
    /// at once: otherwise every one of its commands would fail, far from
    /// the call that made the mistake.
    async fn check_session_cwd(&self, id: &str, cwd: &str) -> Result<()> {
        let refuse =
            |why: &str| Err(NodeError::Invalid(ApiError::invalid("cwd", format!("{cwd}: {why} in the sandbox"))));
        match self.stat_file(id, cwd.to_string()).await {
            // A symlink is left to the shell: it may well lead to a directory.
            Ok(stat) if matches!(stat.kind, FileKind::Dir | FileKind::Symlink) => Ok(()),
            Ok(_) => refuse("not a directory"),
            Err(NodeError::File(FileError::NotFound)) => refuse("no such directory"),
            Err(NodeError::File(FileError::NotDirectory)) => refuse("a component of the path is not a directory"),
            Err(other) => Err(other),
        }
    }

    pub async fn list_sessions(&self, id: &str) -> Result<Vec<SessionInfo>> {
        let live = self.live(id)?;
        live.touch();
        let base = base_env(&live.record().env);
        let sessions: Vec<_> = live.sessions.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        let mut out = Vec::new();
        for s in sessions {
            out.push(s.lock().await.info(&base));
        }
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    pub fn delete_session(&self, id: &str, sid: &str) -> Result<()> {
        let live = self.live(id)?;
        live.touch();
        live.sessions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sid)
            .ok_or_else(|| NodeError::SessionNotFound(sid.to_string()))?;
        self.store().delete(Table::Sessions, &format!("{id}/{sid}"))?;
        Ok(())
    }

    /// `pack_diff`: a new image = the sandbox's image layers + its writable
    /// layer, usable at once by new sandboxes. The scrub list's paths are
    /// gone from the new image, wherever they were: the new layer hides
    /// what lower layers hold there (`warren_image::scrub`).
    pub async fn pack(&self, id: &str, req: warren_api::PackRequest) -> Result<ImageInfo> {
        req.validate().map_err(NodeError::Invalid)?;
        let live = self.live(id)?;
        live.touch();
        self.check_image_unused(&req.image)?;
        let base = live.record().info.image.clone();
        let base_image = match self.inner.images.get(&base) {
            Ok(image) => image,
            Err(not_a_directory_image) => match self.layered().filter(|_| !live._layers.is_empty()) {
                Some(layered) => return self.pack_layered(&layered, live, &base, req).await,
                None => return Err(not_a_directory_image.into()),
            },
        };
        let lowers: Vec<PathBuf> = base_image.layers().iter().map(|l| l.path().to_path_buf()).collect();
        let images = Arc::clone(&self.inner.images);
        let img = tokio::task::spawn_blocking(move || {
            let mut backend_error = None;
            let made = images.extend(&req.image, &base, |dst| {
                live.driver.snapshot(&live.handle, dst).map_err(|e| {
                    let message = e.to_string();
                    backend_error = Some(e);
                    ImageError::Tar(message)
                })?;
                let hidden = warren_image::scrub::hide_in_image(dst, &lowers, &req.scrub)?;
                tracing::info!(image = %req.image, ?hidden, "pack_diff scrubbed");
                Ok(())
            });
            match (made, backend_error) {
                (Err(_), Some(e)) => Err(NodeError::Backend(e)),
                (made, _) => Ok(made?),
            }
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()))??;
        Ok(records::image_info(img))
    }

    /// `pack_diff` of a sandbox on a layered image: its writable layer
    /// becomes one more EROFS layer (role `diff`) over the same layers.
    async fn pack_layered(
        &self,
        layered: &layered::LayeredImages,
        live: Arc<Live>,
        base: &str,
        req: warren_api::PackRequest,
    ) -> Result<ImageInfo> {
        let dir = layered.scratch_dir()?;
        let (snap_dir, scrub) = (dir.clone(), req.scrub.clone());
        let snapped = tokio::task::spawn_blocking(move || {
            live.driver.snapshot(&live.handle, &snap_dir).map_err(NodeError::Backend)?;
            let lowers: Vec<PathBuf> = live._layers.iter().map(|l| l.mount_path().to_path_buf()).collect();
            let hidden = warren_image::scrub::hide_in_image(&snap_dir, &lowers, &scrub)?;
            tracing::info!(?hidden, "pack_diff scrubbed");
            Ok::<_, NodeError>(())
        })
        .await
        .map_err(|e| NodeError::Internal(e.to_string()));
        let packed = match snapped {
            Ok(Ok(())) => layered.extend(&req.image, base, &dir).await,
            Ok(Err(e)) | Err(e) => Err(e),
        };
        let _ = std::fs::remove_dir_all(&dir);
        packed
    }

    // ---- images ----------------------------------------------------------

    pub fn images(&self) -> Result<Vec<ImageInfo>> {
        Ok(self.inner.images.list()?.into_iter().map(records::image_info).collect())
    }

    fn layered(&self) -> Option<Arc<layered::LayeredImages>> {
        self.inner.layered.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The layer directories of image `name` (bottom first): a directory
    /// image's own, or a layered image's layers mounted through the cache
    /// (with the leases that keep them mounted).
    async fn resolve_image(&self, name: &str) -> Result<ResolvedImage> {
        match self.inner.images.get(name) {
            Ok(image) => {
                return Ok(ResolvedImage {
                    paths: image.layers().iter().map(|l| l.path().to_path_buf()).collect(),
                    leases: Vec::new(),
                    config: Default::default(),
                })
            }
            Err(warren_image::ImageError::NotFound(_)) | Err(warren_image::ImageError::InvalidName(_)) => {}
            Err(e) => return Err(e.into()),
        }
        // No separate existence check: `acquire` answers `ImageNotFound`
        // itself, and each check was one more read of the image's manifest
        // from the blob store on every create.
        match self.layered() {
            Some(layered) => {
                let (leases, config) = layered.acquire(name).await?;
                let paths = leases.iter().map(|l| l.mount_path().to_path_buf()).collect();
                Ok(ResolvedImage { paths, leases, config })
            }
            None => Err(NodeError::ImageNotFound(name.to_string())),
        }
    }

    /// What lazy loading fetched and served (empty without layered images).
    pub fn image_stats(&self) -> warren_api::ImageStats {
        self.layered().map(|l| l.stats()).unwrap_or_default()
    }

    /// Imports `dir` as a layered image: one EROFS layer (of `role`,
    /// default base) in the blob store.
    pub async fn import_image_layered(
        &self,
        name: String,
        dir: PathBuf,
        role: Option<warren_api::ImageLayerRole>,
    ) -> Result<ImageInfo> {
        let layered = self.layered_or_invalid("format")?;
        layered.import_dir(&name, &dir, images::layer_role(role)).await
    }

    /// Imports an OCI image layout directory or a `docker save` tarball as a
    /// layered image, every layer of `role` (default base).
    pub async fn import_image_oci(
        &self,
        name: String,
        source: PathBuf,
        docker_save: bool,
        role: Option<warren_api::ImageLayerRole>,
    ) -> Result<ImageInfo> {
        let layered = self.layered_or_invalid("format")?;
        layered.import_oci(&name, &source, docker_save, images::layer_role(role)).await
    }

    /// Replacing an image removes its old layer directories, which running
    /// sandboxes still have mounted: refuse while any sandbox or pool uses it.
    fn check_image_unused(&self, name: &str) -> Result<()> {
        let in_use = self.live_map().values().any(|l| l.record().info.image == name)
            || self.inner.pools.uses_image(name)
            || self.inner.functions.uses_image(name);
        match in_use {
            true => Err(NodeError::ImageInUse(name.to_string())),
            false => Ok(()),
        }
    }

    pub async fn import_image_dir(&self, name: String, dir: PathBuf) -> Result<ImageInfo> {
        self.check_image_unused(&name)?;
        let images = Arc::clone(&self.inner.images);
        let img = tokio::task::spawn_blocking(move || images.import_dir(&name, &dir))
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))??;
        self.images_changed();
        Ok(records::image_info(img))
    }

    /// Lets the VM drivers drop what they derived from images now gone
    /// (their snapshots of booted guests).
    pub(crate) fn images_changed(&self) {
        for driver in self.inner.vm_drivers.values() {
            driver.images_changed();
        }
    }

    pub async fn import_image_tar(&self, name: String, tar: impl std::io::Read + Send + 'static) -> Result<ImageInfo> {
        self.check_image_unused(&name)?;
        let images = Arc::clone(&self.inner.images);
        let img = tokio::task::spawn_blocking(move || images.import_tar(&name, tar))
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))??;
        self.images_changed();
        Ok(records::image_info(img))
    }

    // ---- background work -------------------------------------------------

    async fn reap_forever(self) {
        let mut tick: u64 = 0;
        let mut interval = tokio::time::interval(REAP_INTERVAL);
        let retention_ticks = (self.inner.cfg.ended_retention.as_millis() / REAP_INTERVAL.as_millis()) as u64;
        let retention_every = retention_ticks.clamp(1, RETENTION_MAX_EVERY_TICKS);
        loop {
            interval.tick().await;
            tick += 1;
            if tick.is_multiple_of(PRESSURE_EVERY_TICKS) {
                let node = self.clone();
                if let Ok(Err(e)) = tokio::task::spawn_blocking(move || node.relieve_disk_pressure()).await {
                    tracing::warn!("could not relieve the data directory's disk pressure: {e}");
                }
            }
            if tick.is_multiple_of(retention_every) {
                let node = self.clone();
                let forgotten = tokio::task::spawn_blocking(move || node.forget_ended(now_ms())).await;
                if let Ok(Err(e)) = forgotten {
                    tracing::warn!("could not delete expired records of ended sandboxes: {e}");
                }
                let node = self.clone();
                let forgotten = tokio::task::spawn_blocking(move || node.forget_trajectories(now_ms())).await;
                if let Ok(Err(e)) = forgotten {
                    tracing::warn!("could not delete expired trajectory logs: {e}");
                }
            }
            let lives: Vec<Arc<Live>> = self.live_map().values().cloned().collect();
            if tick.is_multiple_of(LIMITS_EVERY_TICKS) && !self.inner.watching_limits.swap(true, Ordering::SeqCst) {
                // Off the runtime and beside the reaper's checks: a VM's
                // counters are a round trip to its guest (bounded by the
                // driver), and guests that do not answer must delay no
                // sandbox's idle or lifetime end.
                let (watched, node) = (lives.clone(), self.clone());
                let round = RoundFlag(Arc::clone(&self.inner.watching_limits));
                tokio::task::spawn_blocking(move || {
                    watch_all_limits(&watched, &node.inner.metrics);
                    drop(round);
                });
            }
            for live in lives {
                let (created, last, idle, lifetime) = {
                    let r = live.record();
                    (r.info.created_at_ms, r.info.last_activity_at_ms, r.info.idle_timeout_secs, r.info.lifetime_secs)
                };
                let now = now_ms();
                let reason = if now >= created + lifetime * 1000 {
                    Some((EndReason::Lifetime, None))
                } else if live.running_execs.load(Ordering::SeqCst) == 0
                    && now >= last + idle * 1000
                    && live.record().info.state != SandboxState::Paused
                {
                    Some((EndReason::IdleTimeout, None))
                } else {
                    if tick.is_multiple_of(PROBE_EVERY_TICKS) && !live.probing.swap(true, Ordering::SeqCst) {
                        tokio::spawn(self.clone().probe_once(Arc::clone(&live)));
                    }
                    None
                };
                if let Some((reason, msg)) = reason {
                    let node = self.clone();
                    tokio::spawn(async move {
                        if let Err(e) = node.end(&live.id, reason, msg).await {
                            tracing::warn!(sandbox = %live.id, "reaper could not end sandbox: {e}");
                        }
                    });
                }
            }
        }
    }

    /// Probes one sandbox (in its own task, see [`PROBES_AT_ONCE`]) and ends
    /// it if its init is gone, or has answered no ping for
    /// [`UNRESPONSIVE_GRACE`].
    async fn probe_once(self, live: Arc<Live>) {
        let silent = live.unanswered_since.lock().unwrap_or_else(|p| p.into_inner()).is_some();
        let ping = pings(live.probes.fetch_add(1, Ordering::Relaxed), silent);
        let verdict = match Arc::clone(&self.inner.probe_slots).acquire_owned().await {
            Ok(_slot) if ping => probe_verdict(&live, live.driver.probe(&live.handle).await),
            Ok(_slot) => probe_verdict(&live, live.driver.probe_idle(&live.handle).await),
            // Closed only with the node.
            Err(_) => None,
        };
        live.probing.store(false, Ordering::SeqCst);
        let Some((reason, mut msg)) = verdict else { return };
        if reason == EndReason::InitDied {
            // Before the teardown, which takes what the driver knew with it.
            if let (Some(m), Some(detail)) = (msg.as_mut(), live.driver.death_detail(&live.handle)) {
                m.push_str(&format!("; {detail}"));
            }
        }
        // Ended meanwhile (deleted, or by the reaper's clock): its probe
        // saw the teardown, not a death.
        let still_live = self.live_map().get(&live.id).is_some_and(|l| Arc::ptr_eq(l, &live));
        if still_live {
            if let Err(e) = self.end(&live.id, reason, msg).await {
                tracing::warn!(sandbox = %live.id, "reaper could not end sandbox: {e}");
            }
        }
    }

    /// Deletes what is kept of sandboxes that ended more than the retention
    /// ago: the record, its exec results, and its idempotency key (a later
    /// create with that key makes a new sandbox). Returns how many went.
    fn forget_ended(&self, now: u64) -> Result<usize> {
        let retention_ms = u64::try_from(self.inner.cfg.ended_retention.as_millis()).unwrap_or(u64::MAX);
        let mut forgotten = 0;
        for (id, bytes) in self.store().list(Table::Sandboxes, "")? {
            let Ok(rec) = serde_json::from_slice::<SandboxRecord>(&bytes) else { continue };
            let expired = rec.info.state == SandboxState::Ended
                && rec.info.ended_at_ms.is_some_and(|ended| now.saturating_sub(ended) >= retention_ms);
            if !expired {
                continue;
            }
            self.forget_ended_record(&id, &rec)?;
            forgotten += 1;
        }
        Ok(forgotten)
    }

    /// Deletes an ended sandbox's record, its exec results, and its
    /// idempotency key (if the key still names it).
    fn forget_ended_record(&self, id: &str, rec: &SandboxRecord) -> Result<()> {
        self.store().delete_prefix(Table::Execs, &format!("{id}/"))?;
        if let Some(key) = &rec.info.idempotency_key {
            self.release_idempotency_key(key, id)?;
        }
        self.store().delete(Table::Sandboxes, id)?;
        Ok(())
    }

    /// Frees idempotency key `key` for a new create, if it still names
    /// sandbox `id` (a later create may have claimed it since).
    fn release_idempotency_key(&self, key: &str, id: &str) -> Result<()> {
        let claim = self.store().get_json::<records::IdempotencyClaim>(Table::Idempotency, key).ok().flatten();
        if claim.is_some_and(|c| c.sandbox_id == id) {
            self.store().delete(Table::Idempotency, key)?;
        }
        Ok(())
    }

    /// Re-adopts what survived a restart; everything else ends and is swept.
    async fn recover(&self) -> Result<()> {
        let mut records = Vec::new();
        for (id, bytes) in self.store().list(Table::Sandboxes, "")? {
            let rec: SandboxRecord = match serde_json::from_slice(&bytes) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(sandbox = %id, "unreadable record: {e}");
                    continue;
                }
            };
            if rec.info.state == SandboxState::Ended {
                continue;
            }
            let driver = self.driver(rec.info.backend)?;
            let mut rec = rec;
            if rec.handle.is_none() && matches!(rec.info.state, SandboxState::Creating | SandboxState::Running) {
                // Recorded while it was being made (see `create_with`): made
                // if the driver has its handle, and then running.
                rec.handle = driver.recover_handle(&id);
                if rec.handle.is_some() && rec.info.state == SandboxState::Creating {
                    rec.info.state = SandboxState::Running;
                    rec.info.started_at_ms = Some(rec.info.created_at_ms);
                }
            }
            records.push((id, rec, driver));
        }
        // Adopting a VM waits for its guest to answer: several side by side.
        let verdicts: Vec<bool> = futures_util::stream::iter(&records)
            .map(|(_, rec, driver)| async move {
                match (&rec.handle, rec.info.state) {
                    // A paused sandbox is re-adopted paused (the driver probes it without a ping).
                    // A slow init is re-adopted; the reaper ends it if it stays silent.
                    (Some(h), SandboxState::Running | SandboxState::Paused) => {
                        let paused = rec.info.state == SandboxState::Paused;
                        !matches!(driver.adopt(h, paused).await, Liveness::Dead { .. })
                    }
                    _ => false,
                }
            })
            .buffered(ADOPT_CONCURRENCY)
            .collect()
            .await;
        let mut keep = Vec::new();
        for ((id, mut rec, driver), alive) in records.into_iter().zip(verdicts) {
            if alive {
                let Some(handle) = rec.handle.clone() else { continue };
                keep.push(handle.id.clone());
                rec.info.last_activity_at_ms = now_ms();
                let layers = match self.resolve_image(&rec.info.image).await {
                    Ok(image) => image.leases,
                    Err(e) => {
                        tracing::warn!(sandbox = %id, "re-adopted, but its image's layers are not available: {e}");
                        Vec::new()
                    }
                };
                let live = Live::new(id.clone(), handle, driver, rec, layers);
                for (key, bytes) in self.store().list(Table::Sessions, &format!("{id}/"))? {
                    if let Ok(s) = serde_json::from_slice::<SessionRecord>(&bytes) {
                        let sid = key.rsplit('/').next().unwrap_or_default().to_string();
                        live.sessions
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(sid, Arc::new(tokio::sync::Mutex::new(s)));
                    }
                }
                self.live_map().insert(id.clone(), live);
                self.watch_protected_paths(&id).await;
                tracing::info!(sandbox = %id, "re-adopted");
            } else {
                if let Some(h) = &rec.handle {
                    let _ = driver.destroy(h).await;
                }
                self.inner.metrics.ended(rec.info.backend, EndReason::NodeRestarted, &rec.info.project);
                rec.mark_ended(
                    EndReason::NodeRestarted,
                    Some("the node restarted and the sandbox could not be re-adopted".into()),
                );
                self.save(&rec)?;
                let _ = self.store().delete_prefix(Table::Sessions, &format!("{id}/"));
            }
        }
        // Execs that were running when the node stopped cannot be re-attached.
        for (key, bytes) in self.store().list(Table::Execs, "")? {
            if let Ok(mut r) = serde_json::from_slice::<ExecResult>(&bytes) {
                if r.status == ExecStatus::Running {
                    r.status = ExecStatus::Killed;
                    r.ended_at_ms = Some(now_ms());
                    self.store().put_json(Table::Execs, &key, &r)?;
                }
            }
        }
        let mut report = self.inner.container.sweep(&keep).await?;
        for driver in self.inner.vm_drivers.values() {
            report.sandboxes_removed.extend(driver.sweep(&keep).await?.sandboxes_removed);
        }
        self.recover_network(&keep).await;
        if !report.sandboxes_removed.is_empty() {
            tracing::info!(removed = ?report.sandboxes_removed, "swept orphaned sandboxes");
        }
        Ok(())
    }

    /// Stops the node: destroys the idle warm-pool members (they are not
    /// persisted, so no later start could re-adopt them) and, with
    /// `end_sandboxes`, ends every live sandbox with `reason`; otherwise live
    /// sandboxes keep running for the next start to re-adopt.
    pub async fn shutdown(&self, end_sandboxes: Option<EndReason>) {
        if let Some(reason) = end_sandboxes {
            let ids: Vec<String> = self.live_map().keys().cloned().collect();
            for id in ids {
                let _ = self.end(&id, reason, None).await;
            }
        }
        self.inner.pools.drain(self.inner.container.as_ref()).await;
        for driver in self.inner.vm_drivers.values() {
            self.inner.pools.drain(driver.as_ref()).await;
        }
        self.inner.functions.drain().await;
        let node = self.clone();
        // Joins a thread that waits at most one tick; closing the group lets
        // every held access through.
        let _ = tokio::task::spawn_blocking(move || node.inner.tamper.stop()).await;
        let listener = self.inner.landlock_audit.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(listener) = listener {
            // Joins a thread that waits at most a read tick and the kernel's answers.
            let _ = tokio::task::spawn_blocking(move || listener.stop()).await;
        }
        if self.sandboxes_running() == 0 {
            let layered = self.inner.layered.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(layered) = layered.and_then(|l| Arc::try_unwrap(l).ok()) {
                if let Err(e) = layered.shutdown().await {
                    tracing::warn!("cannot shut the layer cache down: {e}");
                }
            }
            self.shutdown_network().await;
            if let Err(e) = self.inner.container.release().await {
                tracing::warn!("cannot release the container driver's node-wide resources: {e}");
            }
            for (backend, driver) in &self.inner.vm_drivers {
                if let Err(e) = driver.release().await {
                    tracing::warn!("cannot release the {} driver's node-wide resources: {e}", backend.as_str());
                }
            }
        }
    }
}

/// The environment every exec starts from, before the sandbox's own.
/// Records a `limit_hit` event for each limit the sandbox ran into since
/// the last look. A sandbox that is going away has no counters: skipped.
/// Whether probe number `probe` (from 0) of a sandbox pings its init:
/// one in [`PING_EVERY_PROBES`], the first included, and every probe while
/// the last ping went unanswered (`silent`).
fn pings(probe: u64, silent: bool) -> bool {
    silent || probe.is_multiple_of(PING_EVERY_PROBES)
}

/// Clears a "round in flight" flag when the round ends, also by a panic.
struct RoundFlag(Arc<AtomicBool>);

impl Drop for RoundFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// One round of the limit watch over `lives`, [`LIMIT_WATCHERS`] at a time.
fn watch_all_limits(lives: &[Arc<Live>], metrics: &metrics::NodeMetrics) {
    let next = AtomicUsize::new(0);
    let watch_next = || {
        while let Some(live) = lives.get(next.fetch_add(1, Ordering::Relaxed)) {
            watch_limits(live, metrics);
        }
    };
    let helpers = lives.len().min(LIMIT_WATCHERS).saturating_sub(1);
    std::thread::scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(watch_next);
        }
        watch_next();
    });
}

fn watch_limits(live: &Live, metrics: &metrics::NodeMetrics) {
    let Ok(counters) = live.driver.limit_counters(&live.handle) else { return };
    let resources = live.record().info.resources.clone();
    let hits = live.limits.lock().unwrap_or_else(|p| p.into_inner()).update(counters, &resources);
    for hit in hits {
        tracing::info!(sandbox = %live.id, detail = %hit.detail, "limit hit");
        metrics.security_event(hit.kind);
        live.timeline().push(hit, now_ms());
    }
}

fn base_env(sandbox_env: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = BTreeMap::from([
        ("PATH".to_string(), DEFAULT_PATH.to_string()),
        ("HOME".to_string(), "/root".to_string()),
        ("LANG".to_string(), "C.UTF-8".to_string()),
        ("TERM".to_string(), "dumb".to_string()),
    ]);
    env.extend(sandbox_env.clone());
    env
}

/// Counts (and logs) a call whose caller stopped waiting for it before it
/// finished, when dropped before `done`.
struct AbandonWatch<'a> {
    metrics: &'a metrics::NodeMetrics,
    call: &'static str,
    id: &'a str,
    done: bool,
}

impl Drop for AbandonWatch<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.metrics.abandoned(self.call);
            tracing::info!(sandbox = %self.id, call = self.call, "the caller went away; the call runs to its end");
        }
    }
}

/// The outcome of a task on the blocking pool; a task that panicked is an
/// internal error.
fn joined<T>(outcome: std::result::Result<Result<T>, tokio::task::JoinError>) -> Result<T> {
    outcome.map_err(|e| NodeError::Internal(format!("store task: {e}")))?
}

/// An image's layers as the driver wants them.
struct ResolvedImage {
    paths: Vec<PathBuf>,
    leases: Vec<LayerLease>,
    /// A layered image's OCI config (empty for directory images).
    config: warren_image::layer::ImageConfig,
}

/// What a probe's answer means for a live sandbox: the reason to end it,
/// if any.
fn probe_verdict(live: &Live, liveness: Liveness) -> Option<(EndReason, Option<String>)> {
    match liveness {
        Liveness::Alive => {
            live.probe_answered(true);
            None
        }
        Liveness::Unresponsive => {
            let silent = live.probe_answered(false);
            if silent >= UNRESPONSIVE_GRACE {
                let msg = format!("init is there but answered no ping for {} s", silent.as_secs());
                Some((EndReason::InitDied, Some(msg)))
            } else {
                tracing::warn!(sandbox = %live.id, "init did not answer a ping (silent for {silent:?})");
                None
            }
        }
        Liveness::Dead { oom: true } => Some((EndReason::Oom, Some("init was killed by the OOM killer".to_string()))),
        Liveness::Dead { oom: false } => Some((EndReason::InitDied, Some("the sandbox's init exited".to_string()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_ping_one_in_four_and_every_time_while_init_is_silent() {
        let pinged: Vec<u64> = (0..9).filter(|&n| pings(n, false)).collect();
        assert_eq!(pinged, vec![0, 4, 8], "the first probe pings, then one in {PING_EVERY_PROBES}");
        assert!((0..9).all(|n| pings(n, true)), "a silent init is pinged by every probe");
    }
}

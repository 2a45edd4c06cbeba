//! Warm pools: per (backend, image, resource shape, network) a number of
//! sandboxes is kept made and idle. A matching create claims one; the pool
//! refills in the background. Members are never handed out twice and are
//! not persisted: a restarted node sweeps them and makes fresh ones.
//!
//! `backend=microvm` (or `vm`) keeps booted VMs: a claim hands over a guest
//! whose init already answers, so the create costs no boot at all (with
//! `--vm-snapshots on` the refills are snapshot restores too). A member
//! keeps the hostname it was made with (its own id), as a container
//! member does.
//!
//! `network=allowlist` keeps members with a network namespace of their own
//! and nothing in it: the claim plugs the veth, NAT and egress programs
//! with the request's own policy, as a fresh create does once made (the
//! plug is part of the claim's time). No policy is in a member before.
//!
//! Refills yield to requests: making a member costs as much CPU as a cold
//! create, and one made at once after a claim competes with the claimed
//! sandbox's first execs. So while a pool holds at least half its size, the
//! next member waits until no create, exec or delete has started for
//! [`QUIET`] (at most [`QUIET_MAX`]); below half it is made at once.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use warren_api::{Backend, NetworkMode, Resources};
use warren_backend::{Driver, Liveness, SandboxHandle, SandboxSpec};
use warren_image::cache::LayerLease;

use crate::{new_id, Node};

/// `image=busybox,cpus=1,memory_mib=256,disk_mib=256,pids=512,network=none,size=4`
/// (`network` is `none`, `loopback` or `allowlist`)
/// (also `inodes`, `open_files` and `backend=container|microvm|vm`);
/// omitted keys take the create request's defaults, the inode cap the one
/// derived from the pool's disk size.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSpec {
    pub backend: Backend,
    pub image: String,
    pub resources: Resources,
    pub network: NetworkMode,
    pub size: usize,
}

impl FromStr for PoolSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let d = warren_api::CreateSandboxRequest::default();
        let mut spec = PoolSpec {
            backend: Backend::Container,
            resources: Resources::of(&d),
            image: d.image,
            network: d.network,
            size: 1,
        };
        let mut inodes = None;
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}` is not key=value"))?;
            let bad = |_| format!("bad value for {k}: `{v}`");
            match k {
                "image" => spec.image = v.to_string(),
                "backend" => {
                    spec.backend = match v {
                        "container" => Backend::Container,
                        "microvm" => Backend::Microvm,
                        "vm" => Backend::Vm,
                        _ => return Err(format!("bad value for backend: `{v}` (container, microvm or vm)")),
                    }
                }
                "cpus" => spec.resources.cpus = v.parse().map_err(|_| format!("bad value for {k}: `{v}`"))?,
                "memory_mib" => spec.resources.memory_mib = v.parse().map_err(bad)?,
                "disk_mib" => spec.resources.disk_mib = v.parse().map_err(bad)?,
                "pids" => spec.resources.pids = v.parse().map_err(bad)?,
                "inodes" => inodes = Some(v.parse().map_err(bad)?),
                "open_files" => spec.resources.open_files = v.parse().map_err(bad)?,
                "size" => spec.size = v.parse().map_err(bad)?,
                "network" => {
                    spec.network = match v {
                        "none" => NetworkMode::None,
                        "loopback" => NetworkMode::Loopback,
                        "allowlist" => NetworkMode::Allowlist,
                        _ => return Err(format!("bad value for network: `{v}`")),
                    }
                }
                _ => return Err(format!("unknown pool key `{k}`")),
            }
        }
        // The derived default follows the pool's disk size, as a create's does.
        spec.resources.inodes = inodes.unwrap_or_else(|| warren_api::default_inodes(spec.resources.disk_mib));
        Ok(spec)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    backend: Backend,
    image: String,
    millicpus: u64,
    memory_mib: u64,
    disk_mib: u64,
    pids: u32,
    inodes: u64,
    open_files: u32,
    network: NetworkMode,
}

impl PoolKey {
    pub fn new(image: &str, r: &Resources, network: NetworkMode) -> Self {
        PoolKey {
            backend: Backend::Container,
            image: image.to_string(),
            millicpus: (r.cpus * 1000.0).round() as u64,
            memory_mib: r.memory_mib,
            disk_mib: r.disk_mib,
            pids: r.pids,
            inodes: r.inodes,
            open_files: r.open_files,
            network,
        }
    }

    /// The same shape on another backend (a container pool's by default).
    pub fn with_backend(self, backend: Backend) -> Self {
        PoolKey { backend, ..self }
    }
}

/// Whether creates on `backend` may claim warm pool members.
pub fn pooled_backend(backend: Backend) -> bool {
    matches!(backend, Backend::Container | Backend::Microvm | Backend::Vm)
}

/// How long the node must have started no request before a refill goes.
pub const QUIET: Duration = Duration::from_millis(10);
/// The longest a refill waits for quiet.
pub const QUIET_MAX: Duration = Duration::from_millis(500);

/// An idle sandbox and the leases that keep its image's layers mounted.
type Member = (SandboxHandle, Vec<LayerLease>);

pub struct Pools {
    specs: Vec<PoolSpec>,
    members: Mutex<HashMap<PoolKey, VecDeque<Member>>>,
    wake: Notify,
    /// Start of the clock [`Pools::busy_ns`] counts on.
    epoch: Instant,
    /// When the last request started, in ns since `epoch`.
    busy_ns: AtomicU64,
    /// Set by [`Pools::drain`]: no member is made or kept after it.
    closed: AtomicBool,
    /// Held while a member is made and put in its pool, so that a drain
    /// waits for a member under way instead of missing it.
    filling: tokio::sync::Mutex<()>,
}

impl Pools {
    pub fn new(specs: Vec<PoolSpec>) -> Self {
        Pools {
            specs,
            members: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            epoch: Instant::now(),
            busy_ns: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            filling: tokio::sync::Mutex::new(()),
        }
    }

    /// Notes that a request (create, exec, delete) started: refills wait.
    pub fn busy(&self) {
        if !self.specs.is_empty() {
            let now = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.busy_ns.store(now, Ordering::Relaxed);
        }
    }

    /// Waits until no request has started for [`QUIET`], or [`QUIET_MAX`].
    async fn quiet(&self) {
        let waited = Instant::now();
        loop {
            let busy = Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed));
            let since = self.epoch.elapsed().saturating_sub(busy);
            if since >= QUIET || waited.elapsed() >= QUIET_MAX {
                return;
            }
            tokio::time::sleep(QUIET - since).await;
        }
    }

    fn members(&self) -> std::sync::MutexGuard<'_, HashMap<PoolKey, VecDeque<Member>>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn pop(&self, key: &PoolKey) -> Option<Member> {
        self.members().get_mut(key).and_then(VecDeque::pop_front)
    }

    /// Whether an idle member was made from `image`.
    pub fn uses_image(&self, image: &str) -> bool {
        self.members().iter().any(|(key, members)| key.image == image && !members.is_empty())
    }

    /// Idle members per image of every configured pool, zero included.
    pub fn idle_by_image(&self) -> std::collections::BTreeMap<String, u64> {
        let mut idle: std::collections::BTreeMap<String, u64> =
            self.specs.iter().map(|s| (s.image.clone(), 0)).collect();
        for (key, members) in self.members().iter() {
            *idle.entry(key.image.clone()).or_default() += members.len() as u64;
        }
        idle
    }

    /// Destroys every idle member of `driver`'s backend (shutdown of a
    /// test server).
    pub async fn drain(&self, driver: &dyn Driver) {
        self.closed.store(true, Ordering::SeqCst);
        // A member being made now is in its pool once this is ours.
        let _no_filling = self.filling.lock().await;
        let backend = driver.backend();
        let all: Vec<Member> = {
            let mut members = self.members();
            let keys: Vec<PoolKey> = members.keys().filter(|k| k.backend == backend).cloned().collect();
            keys.iter().filter_map(|k| members.remove(k)).flatten().collect()
        };
        for (h, _leases) in all {
            let _ = driver.destroy(&h).await;
        }
    }
}

impl Node {
    /// Takes a live idle member matching `key`, if any.
    pub(crate) async fn claim_pooled(&self, key: &PoolKey) -> Option<Member> {
        let pools = &self.inner.pools;
        let driver = self.driver(key.backend).ok()?;
        loop {
            let (handle, leases) = pools.pop(key)?;
            pools.wake.notify_one();
            if driver.probe_idle(&handle).await == Liveness::Alive {
                // In the background of the claim's commit: what the first
                // exec would do first (a container's connection to init).
                let (driver, prepared) = (Arc::clone(&driver), handle.clone());
                tokio::spawn(async move { driver.prepare_exec(&prepared).await });
                return Some((handle, leases));
            }
            let _ = driver.destroy(&handle).await;
        }
    }

    pub(crate) async fn fill_pools_forever(self) {
        let pools = &self.inner.pools;
        if pools.specs.is_empty() {
            return;
        }
        loop {
            let mut failed = false;
            for spec in &pools.specs {
                let key = PoolKey::new(&spec.image, &spec.resources, spec.network).with_backend(spec.backend);
                loop {
                    let idle = pools.members().get(&key).map_or(0, VecDeque::len);
                    if idle >= spec.size {
                        break;
                    }
                    if idle >= spec.size.div_ceil(2) {
                        pools.quiet().await;
                    }
                    let _filling = pools.filling.lock().await;
                    if pools.closed.load(Ordering::SeqCst) {
                        return;
                    }
                    match self.make_member(spec).await {
                        Ok(h) => pools.members().entry(key.clone()).or_default().push_back(h),
                        Err(e) => {
                            tracing::warn!(image = %spec.image, "cannot fill warm pool: {e}");
                            failed = true;
                            break;
                        }
                    }
                }
            }
            let wait = if failed { Duration::from_secs(5) } else { Duration::from_secs(1) };
            let _ = tokio::time::timeout(wait, pools.wake.notified()).await;
        }
    }

    async fn make_member(&self, spec: &PoolSpec) -> crate::Result<Member> {
        let image = self.resolve_image(&spec.image).await?;
        let id = new_id(&self.inner.cfg.sandbox_id_prefix);
        let sandbox = SandboxSpec {
            id: id.clone(),
            layers: image.paths,
            resources: spec.resources.clone(),
            network: spec.network,
            hostname: id,
            phase: Default::default(),
        };
        let handle = self.driver(spec.backend)?.create(&sandbox).await?;
        Ok((handle, image.leases))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_spec_parses_and_names_bad_keys() {
        let s: PoolSpec = "image=busybox,cpus=0.5,memory_mib=128,size=3,network=loopback".parse().unwrap();
        assert_eq!(s.backend, Backend::Container);
        let vms: PoolSpec = "backend=microvm,memory_mib=256".parse().unwrap();
        assert_eq!(vms.backend, Backend::Microvm);
        assert!("backend=lambda".parse::<PoolSpec>().unwrap_err().contains("backend"));
        assert_eq!((s.image.as_str(), s.resources.cpus, s.resources.memory_mib, s.size), ("busybox", 0.5, 128, 3));
        assert_eq!(s.network, NetworkMode::Loopback);
        let egress: PoolSpec = "network=allowlist".parse().unwrap();
        assert_eq!(egress.network, NetworkMode::Allowlist);
        assert!("network=open".parse::<PoolSpec>().unwrap_err().contains("network"));
        assert_eq!(s.resources.inodes, warren_api::default_inodes(s.resources.disk_mib));
        let capped: PoolSpec = "disk_mib=8,inodes=900,open_files=64".parse().unwrap();
        assert_eq!((capped.resources.inodes, capped.resources.open_files), (900, 64));
        let derived: PoolSpec = "disk_mib=8".parse().unwrap();
        assert_eq!(derived.resources.inodes, warren_api::default_inodes(8));
        assert!("colour=blue".parse::<PoolSpec>().unwrap_err().contains("colour"));
        assert!("size=lots".parse::<PoolSpec>().unwrap_err().contains("size"));
    }

    #[test]
    fn pool_keys_match_equal_shapes_only() {
        let r = Resources { cpus: 1.0, memory_mib: 256, disk_mib: 256, pids: 512, inodes: 65536, open_files: 4096 };
        let a = PoolKey::new("busybox", &r, NetworkMode::None);
        assert_eq!(a, PoolKey::new("busybox", &r.clone(), NetworkMode::None));
        assert_ne!(a, PoolKey::new("busybox", &r, NetworkMode::Loopback));
        assert_ne!(a, PoolKey::new("busybox", &Resources { memory_mib: 512, ..r }, NetworkMode::None));
        assert_ne!(a, PoolKey::new("busybox", &r, NetworkMode::None).with_backend(Backend::Microvm));
    }
}

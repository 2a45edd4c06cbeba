//! The function-call backend: short stateless runs, each in a fresh worker.
//!
//! A worker is a container sandbox (the container driver, the guard's
//! profile) made ahead of time and used for exactly one call, then
//! destroyed: nothing a call writes or leaves running can reach the next.
//! Per image and worker shape a [`FunctionPool`] keeps idle workers made; its
//! target follows demand (the peak of busy + queued calls over the last two
//! windows) within the pool's `min..=max`, and the filler makes or destroys
//! workers to meet it. At most `max` calls of a pool run at once; the next
//! `queue` wait for admission, and a call beyond that is refused
//! (`queue_full`, HTTP 429) instead of piling up.
//!
//! Python calls run instead on the pool's fork servers (`fork.rs`): warm
//! interpreters in sandboxes of the same profile that fork one child per
//! call, each child in its own Landlock domain and everything it left
//! killed before the zygote serves again.
//!
//! `POST /v1/functions/run` is [`Node::run_function`] (`run.rs`); sandboxes
//! made with `backend = "function"` run every exec in a fresh worker
//! through [`driver::FunctionDriver`].

pub(crate) mod driver;
mod fork;
mod run;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use warren_api::{NetworkMode, Resources};
use warren_backend::{Driver, SandboxHandle, SandboxSpec};
use warren_image::cache::LayerLease;

use crate::pool::{PoolKey, PoolSpec};
use crate::{new_id, Node, NodeError, Result};

/// Bounds of a pool made on the first call for an image that no
/// `--function-pool` names.
pub const DEFAULT_MIN_WORKERS: usize = 0;
pub const DEFAULT_MAX_WORKERS: usize = 4;
pub const DEFAULT_QUEUE: usize = 256;
/// Demand is the peak over this window and the one before it.
const DEMAND_WINDOW: Duration = Duration::from_secs(5);
/// How often the filler looks at every pool without being woken.
const FILL_TICK: Duration = Duration::from_millis(250);
/// Workers one pool makes at the same time.
const MAKERS_PER_POOL: usize = 2;
/// A pool no call used for this long, made on demand, is dropped.
const UNUSED_POOL_TTL: Duration = Duration::from_secs(120);

/// `--function-pool image=default,min=2,max=8,queue=64,memory_mib=256,cpus=1`:
/// a warm pool of one-use workers for function calls. The worker's shape
/// takes the keys of `--pool` (except `size`); defaults min 1, max 4,
/// queue 256.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionPoolSpec {
    pub image: String,
    pub resources: Resources,
    pub network: NetworkMode,
    pub min: usize,
    pub max: usize,
    pub queue: usize,
}

impl FromStr for FunctionPoolSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (mut min, mut max, mut queue) = (1, DEFAULT_MAX_WORKERS, DEFAULT_QUEUE);
        let mut shape = Vec::new();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("`{part}` is not key=value"))?;
            let bad = |_| format!("bad value for {k}: `{v}`");
            match k {
                "min" => min = v.parse().map_err(bad)?,
                "max" => max = v.parse().map_err(bad)?,
                "queue" => queue = v.parse().map_err(bad)?,
                "size" => return Err("function pools take min= and max=, not size=".into()),
                _ => shape.push(part),
            }
        }
        if max == 0 || min > max {
            return Err(format!("need 0 <= min <= max and max >= 1 (min={min}, max={max})"));
        }
        let base: PoolSpec = shape.join(",").parse()?;
        Ok(FunctionPoolSpec { image: base.image, resources: base.resources, network: base.network, min, max, queue })
    }
}

/// The shape of the workers a call needs: the image's configured pool's,
/// with the call's own memory and CPU when it names them.
pub(crate) fn call_shape(
    specs: &[FunctionPoolSpec],
    image: &str,
    memory_mib: Option<u64>,
    cpus: Option<f64>,
) -> (Resources, NetworkMode) {
    let base = specs.iter().find(|s| s.image == image);
    let mut resources = match base {
        Some(s) => s.resources.clone(),
        None => Resources::of(&warren_api::CreateSandboxRequest::default()),
    };
    if let Some(m) = memory_mib {
        resources.memory_mib = m;
    }
    if let Some(c) = cpus {
        resources.cpus = c;
    }
    (resources, base.map_or(NetworkMode::None, |s| s.network))
}

/// Busy + queued calls, as a peak over two windows.
struct Demand {
    window_started: Instant,
    current: usize,
    previous: usize,
}

impl Demand {
    fn new() -> Self {
        Demand { window_started: Instant::now(), current: 0, previous: 0 }
    }

    fn note(&mut self, now_demand: usize) -> usize {
        let elapsed = self.window_started.elapsed();
        if elapsed >= DEMAND_WINDOW {
            self.previous = if elapsed >= DEMAND_WINDOW * 2 { 0 } else { self.current };
            self.current = 0;
            self.window_started = Instant::now();
        }
        self.current = self.current.max(now_demand);
        self.current.max(self.previous)
    }
}

/// Idle workers of one image and shape, and the admission of its calls.
pub(crate) struct FunctionPool {
    pub(crate) image: String,
    /// The worker shape without the image, as function sandboxes know it.
    pub(crate) shape: PoolKey,
    pub(crate) layers: Vec<PathBuf>,
    resources: Resources,
    network: NetworkMode,
    min: usize,
    max: usize,
    queue: usize,
    configured: bool,
    /// Keeps a layered image's layers mounted while the pool lives.
    _leases: Vec<LayerLease>,
    idle: Mutex<VecDeque<SandboxHandle>>,
    making: AtomicUsize,
    busy: AtomicUsize,
    waiting: AtomicUsize,
    permits: Arc<Semaphore>,
    demand: Mutex<Demand>,
    last_used: Mutex<Instant>,
    /// The python fork servers (zygotes) of this image and shape.
    fork: fork::ForkPool,
}

impl FunctionPool {
    fn idle(&self) -> std::sync::MutexGuard<'_, VecDeque<SandboxHandle>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn demand_now(&self) -> usize {
        self.busy.load(Ordering::SeqCst) + self.waiting.load(Ordering::SeqCst)
    }

    /// How many idle workers the pool wants now: python calls that the
    /// fork servers serve are not their demand.
    fn target(&self) -> usize {
        let forked = if self.fork.usable() { self.fork.calls() } else { 0 };
        let demand = self.demand_now().saturating_sub(forked);
        let peak = self.demand.lock().unwrap_or_else(|p| p.into_inner()).note(demand);
        peak.clamp(self.min, self.max)
    }

    fn spec(&self) -> SandboxSpec {
        let id = new_id("fn");
        SandboxSpec {
            id: id.clone(),
            layers: self.layers.clone(),
            resources: self.resources.clone(),
            network: self.network,
            hostname: id,
            phase: Default::default(),
        }
    }
}

/// A claimed worker, used once: dropping it destroys it (in the
/// background) and frees its pool's admission slot.
pub(crate) struct Worker {
    pub(crate) handle: SandboxHandle,
    pub(crate) warm: bool,
    admission: Option<Admission>,
    functions: Arc<Functions>,
}

/// A call's place among the `max` that a pool runs at once; dropping it
/// lets the next waiting call in.
pub(crate) struct Admission {
    pool: Arc<FunctionPool>,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.pool.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Worker {
    /// Swaps a worker that turned out broken (an idle worker is not probed
    /// before a call: that would cost a round trip on every call) for a
    /// freshly made one of the same pool.
    pub(crate) async fn replace(&mut self) -> Result<()> {
        let pool = self
            .admission
            .as_ref()
            .map(|a| &a.pool)
            .ok_or_else(|| NodeError::Internal("an unpooled worker broke".into()))?;
        let fresh = self.functions.container.create(&pool.spec()).await?;
        let broken = std::mem::replace(&mut self.handle, fresh);
        self.functions.destroy_later(broken);
        self.warm = false;
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.functions.destroy_later(self.handle.clone());
        self.functions.wake.notify_one();
    }
}

/// Every function pool of the node, the filler's wake-up, and the workers
/// being destroyed (shutdown waits for them).
pub(crate) struct Functions {
    specs: Vec<FunctionPoolSpec>,
    container: Arc<dyn Driver>,
    pools: Mutex<HashMap<(String, PoolKey), Arc<FunctionPool>>>,
    wake: Notify,
    destroying: AtomicUsize,
    destroyed: Notify,
    /// Set when the node stops: no worker is made or kept idle after it.
    closed: AtomicBool,
}

impl Functions {
    pub(crate) fn new(specs: Vec<FunctionPoolSpec>, container: Arc<dyn Driver>) -> Arc<Self> {
        Arc::new(Functions {
            specs,
            container,
            pools: Mutex::new(HashMap::new()),
            wake: Notify::new(),
            destroying: AtomicUsize::new(0),
            destroyed: Notify::new(),
            closed: AtomicBool::new(false),
        })
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, HashMap<(String, PoolKey), Arc<FunctionPool>>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn specs(&self) -> &[FunctionPoolSpec] {
        &self.specs
    }

    /// Waits for admission to `pool` (bounded queue), then claims an idle
    /// worker or makes one. Returns the worker and how long admission took.
    pub(crate) async fn claim(self: &Arc<Self>, pool: &Arc<FunctionPool>) -> Result<(Worker, Duration)> {
        let (admission, queued) = self.admit(pool).await?;
        let worker = self.take_worker(admission).await?;
        Ok((worker, queued))
    }

    /// An idle worker of an admitted call, or one made for it.
    pub(crate) async fn take_worker(self: &Arc<Self>, admission: Admission) -> Result<Worker> {
        let pool = &admission.pool;
        let popped = pool.idle().pop_front();
        pool.target();
        self.wake.notify_one();
        let (handle, warm) = match popped {
            Some(h) => (h, true),
            None => (self.container.create(&pool.spec()).await?, false),
        };
        Ok(Worker { handle, warm, admission: Some(admission), functions: Arc::clone(self) })
    }

    /// Waits for admission to `pool` (at most `max` calls run at once; the
    /// next `queue` wait, one more is refused). Returns how long it took.
    pub(crate) async fn admit(self: &Arc<Self>, pool: &Arc<FunctionPool>) -> Result<(Admission, Duration)> {
        let arrived = Instant::now();
        *pool.last_used.lock().unwrap_or_else(|p| p.into_inner()) = arrived;
        let permit = match Arc::clone(&pool.permits).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if pool.waiting.fetch_add(1, Ordering::SeqCst) >= pool.queue {
                    pool.waiting.fetch_sub(1, Ordering::SeqCst);
                    return Err(NodeError::FunctionQueueFull { image: pool.image.clone(), queue: pool.queue });
                }
                pool.target();
                self.wake.notify_one();
                let permit = Arc::clone(&pool.permits).acquire_owned().await;
                pool.waiting.fetch_sub(1, Ordering::SeqCst);
                permit.map_err(|_| NodeError::Internal("function pool closed".into()))?
            }
        };
        pool.busy.fetch_add(1, Ordering::SeqCst);
        Ok((Admission { pool: Arc::clone(pool), _permit: permit }, arrived.elapsed()))
    }

    /// A worker made for one exec of a function sandbox that no pool serves.
    pub(crate) async fn make_unpooled(self: &Arc<Self>, spec: &SandboxSpec) -> Result<Worker> {
        let handle = self.container.create(spec).await?;
        Ok(Worker { handle, warm: false, admission: None, functions: Arc::clone(self) })
    }

    fn destroy_later(self: &Arc<Self>, handle: SandboxHandle) {
        self.destroying.fetch_add(1, Ordering::SeqCst);
        let this = Arc::clone(self);
        tokio::spawn(async move {
            if let Err(e) = this.container.destroy(&handle).await {
                tracing::warn!(worker = %handle.id, "cannot destroy a function worker: {e}");
            }
            this.destroying.fetch_sub(1, Ordering::SeqCst);
            this.destroyed.notify_waiters();
        });
    }

    /// Destroys every idle worker and waits for the ones being destroyed.
    pub(crate) async fn drain(self: &Arc<Self>) {
        self.closed.store(true, Ordering::SeqCst);
        let pools: Vec<Arc<FunctionPool>> = self.pools().drain().map(|(_, p)| p).collect();
        for pool in &pools {
            let idle: Vec<SandboxHandle> = pool.idle().drain(..).collect();
            for h in idle {
                self.destroy_later(h);
            }
            drop(pool.fork.take_idle(0));
        }
        loop {
            let notified = self.destroyed.notified();
            let making: usize = pools.iter().map(|p| p.making.load(Ordering::SeqCst) + p.fork.making()).sum();
            if self.destroying.load(Ordering::SeqCst) == 0 && making == 0 {
                return;
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
        }
    }

    /// Every pool with its bounds and counts, by image.
    pub(crate) fn list(&self) -> Vec<warren_api::FunctionPoolInfo> {
        let pools: Vec<Arc<FunctionPool>> = self.pools().values().cloned().collect();
        let mut out: Vec<warren_api::FunctionPoolInfo> = pools
            .iter()
            .map(|p| warren_api::FunctionPoolInfo {
                image: p.image.clone(),
                memory_mib: p.resources.memory_mib,
                cpus: p.resources.cpus,
                min: p.min as u64,
                max: p.max as u64,
                queue: p.queue as u64,
                configured: p.configured,
                idle: p.idle().len() as u64,
                busy: p.busy.load(Ordering::SeqCst) as u64,
                waiting: p.waiting.load(Ordering::SeqCst) as u64,
                target: p.target() as u64,
                idle_fork_servers: p.fork.idle_count() as u64,
            })
            .collect();
        out.sort_by(|a, b| a.image.cmp(&b.image).then(a.memory_mib.cmp(&b.memory_mib)));
        out
    }

    /// Whether a pool holds workers of `image` (it cannot be replaced then).
    pub(crate) fn uses_image(&self, image: &str) -> bool {
        self.pools().values().any(|p| p.image == image && (!p.idle().is_empty() || p.fork.idle_count() > 0))
    }

    /// One pass of the filler over a pool: make workers up to its target,
    /// destroy idle ones above it.
    fn fill(self: &Arc<Self>, pool: &Arc<FunctionPool>) {
        if self.closed.load(Ordering::SeqCst) {
            return;
        }
        fork::fill(self, pool);
        let target = pool.target();
        let surplus: Vec<SandboxHandle> = {
            let mut idle = pool.idle();
            let n = idle.len().saturating_sub(target);
            idle.drain(..n).collect()
        };
        for h in surplus {
            self.destroy_later(h);
        }
        loop {
            let have = pool.idle().len() + pool.making.load(Ordering::SeqCst);
            if have >= target || pool.making.load(Ordering::SeqCst) >= MAKERS_PER_POOL {
                return;
            }
            pool.making.fetch_add(1, Ordering::SeqCst);
            let (this, pool) = (Arc::clone(self), Arc::clone(pool));
            tokio::spawn(async move {
                let made = this.container.create(&pool.spec()).await;
                pool.making.fetch_sub(1, Ordering::SeqCst);
                match made {
                    // The node stopped while this one was made: nobody will claim it.
                    Ok(h) if this.closed.load(Ordering::SeqCst) => this.destroy_later(h),
                    Ok(h) => pool.idle().push_back(h),
                    Err(e) => tracing::warn!(image = %pool.image, "cannot make a function worker: {e}"),
                }
                this.wake.notify_one();
            });
        }
    }
}

impl Node {
    /// `GET /v1/functions/pools`.
    pub fn function_pools(&self) -> Vec<warren_api::FunctionPoolInfo> {
        self.inner.functions.list()
    }

    /// The pool for calls of `image` in this shape, made on first use; a
    /// pool whose image was replaced since is retired and made again.
    pub(crate) async fn function_pool(
        &self,
        image: &str,
        resources: Resources,
        network: NetworkMode,
    ) -> Result<Arc<FunctionPool>> {
        let functions = &self.inner.functions;
        let key = PoolKey::new(image, &resources, network);
        let resolved = self.resolve_image(image).await?;
        let map_key = (image.to_string(), key.clone());
        let stale = {
            let pools = functions.pools();
            match pools.get(&map_key) {
                Some(p) if p.layers == resolved.paths => return Ok(Arc::clone(p)),
                other => other.cloned(),
            }
        };
        if let Some(old) = stale {
            functions.pools().remove(&map_key);
            let idle: Vec<SandboxHandle> = old.idle().drain(..).collect();
            for h in idle {
                functions.destroy_later(h);
            }
            drop(old.fork.take_idle(0));
        }
        let spec =
            functions.specs.iter().find(|s| s.image == image && PoolKey::new(image, &s.resources, s.network) == key);
        let (min, max, queue) =
            spec.map_or((DEFAULT_MIN_WORKERS, DEFAULT_MAX_WORKERS, DEFAULT_QUEUE), |s| (s.min, s.max, s.queue));
        let pool = Arc::new(FunctionPool {
            image: image.to_string(),
            shape: PoolKey::new("", &resources, network),
            layers: resolved.paths,
            resources,
            network,
            min,
            max,
            queue,
            configured: spec.is_some(),
            _leases: resolved.leases,
            idle: Mutex::new(VecDeque::new()),
            making: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            permits: Arc::new(Semaphore::new(max)),
            demand: Mutex::new(Demand::new()),
            last_used: Mutex::new(Instant::now()),
            fork: fork::ForkPool::new(),
        });
        // A concurrent first call may have made it meanwhile: keep one.
        let pool = Arc::clone(functions.pools().entry(map_key).or_insert(pool));
        functions.wake.notify_one();
        Ok(pool)
    }

    /// Keeps every function pool at its target; makes the configured pools
    /// as soon as their image exists.
    pub(crate) async fn fill_function_pools_forever(self) {
        let functions = Arc::clone(&self.inner.functions);
        while !functions.closed.load(Ordering::SeqCst) {
            for spec in functions.specs.clone() {
                let key = (spec.image.clone(), PoolKey::new(&spec.image, &spec.resources, spec.network));
                let current = functions.pools().get(&key).map(|p| p.layers.clone());
                let resolved = match self.resolve_image(&spec.image).await {
                    Ok(r) => r,
                    Err(_) => continue,
                };
                if current.as_ref() != Some(&resolved.paths) {
                    drop(resolved);
                    if let Err(e) = self.function_pool(&spec.image, spec.resources.clone(), spec.network).await {
                        tracing::warn!(image = %spec.image, "cannot make the function pool: {e}");
                    }
                }
            }
            let pools: Vec<Arc<FunctionPool>> = functions.pools().values().cloned().collect();
            for pool in pools {
                let unused = pool.last_used.lock().unwrap_or_else(|p| p.into_inner()).elapsed() > UNUSED_POOL_TTL;
                if !pool.configured && unused && pool.demand_now() == 0 {
                    functions.pools().retain(|_, p| !Arc::ptr_eq(p, &pool));
                    let idle: Vec<SandboxHandle> = pool.idle().drain(..).collect();
                    for h in idle {
                        functions.destroy_later(h);
                    }
                    drop(pool.fork.take_idle(0));
                    continue;
                }
                functions.fill(&pool);
            }
            let _ = tokio::time::timeout(FILL_TICK, functions.wake.notified()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_pool_specs_parse_bounds_and_shape() {
        let s: FunctionPoolSpec = "image=busybox,min=1,max=3,queue=5,memory_mib=64".parse().unwrap();
        assert_eq!((s.image.as_str(), s.min, s.max, s.queue, s.resources.memory_mib), ("busybox", 1, 3, 5, 64));
        assert!("image=x,size=2".parse::<FunctionPoolSpec>().unwrap_err().contains("min"));
        assert!("image=x,min=3,max=2".parse::<FunctionPoolSpec>().is_err());
        assert!("image=x,max=0".parse::<FunctionPoolSpec>().is_err());
        assert!("image=x,colour=red".parse::<FunctionPoolSpec>().unwrap_err().contains("colour"));
    }

    #[test]
    fn demand_is_the_peak_of_two_windows() {
        let mut d = Demand::new();
        assert_eq!(d.note(3), 3);
        assert_eq!(d.note(1), 3);
        d.window_started -= DEMAND_WINDOW;
        assert_eq!(d.note(1), 3, "the previous window's peak still counts");
        d.window_started -= DEMAND_WINDOW * 2;
        assert_eq!(d.note(0), 0, "two quiet windows forget the peak");
    }

    #[test]
    fn a_call_takes_its_images_pool_shape_unless_it_names_its_own() {
        let specs = vec!["image=busybox,memory_mib=64,cpus=0.5".parse::<FunctionPoolSpec>().unwrap()];
        let (r, _) = call_shape(&specs, "busybox", None, None);
        assert_eq!((r.memory_mib, r.cpus), (64, 0.5));
        let (r, _) = call_shape(&specs, "busybox", Some(128), None);
        assert_eq!((r.memory_mib, r.cpus), (128, 0.5));
        let (r, _) = call_shape(&specs, "other", None, None);
        assert_eq!(r.memory_mib, 512);
    }
}

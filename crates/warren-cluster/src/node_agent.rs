//! The node role's side of the cluster: keeping this node's registration
//! alive in etcd, and honouring what the cluster decided while it was out
//! of touch.
//!
//! The registration (`nodes/<name>`, a [`NodeStatus`]) is written under a
//! lease with a TTL of [`NodeAgentConfig::ttl`] and rewritten every
//! heartbeat with the node's books, images and running counts; placement
//! reads it. If the node stops (crash, `kill -9`, cut off from etcd) the
//! lease runs out, the record vanishes, and a watcher on an API server
//! ends the node's sandboxes `node_lost`. A node that comes back (a restart
//! re-adopts its sandboxes) first ends those the cluster already gave up,
//! then registers again; a restart within the TTL loses nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use warren_api::{NodeStatus, QuotaUse, SandboxState};
use warren_node::Node;
use warren_store::{StateStore, Table};
use warren_store_etcd::EtcdStore;

use crate::records::{check_node_name, Etcd};
use crate::ClusterError;

/// Default lease TTL: how long a silent node counts as alive.
pub const DEFAULT_TTL: Duration = Duration::from_secs(5);
/// Default time between two registration writes.
pub const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);
/// Every this many heartbeats the node drops placement records of
/// sandboxes it has forgotten (their retention ran out).
const SWEEP_EVERY: u64 = 30;

#[derive(Debug, Clone)]
pub struct NodeAgentConfig {
    pub name: String,
    /// Where API servers reach this node (`http://10.0.0.5:7070`).
    pub url: String,
    /// Its data directory, whose free space it reports.
    pub data_dir: std::path::PathBuf,
    pub ttl: Duration,
    pub heartbeat: Duration,
}

/// A running registration; [`Registration::stop`] ends it.
pub struct Registration {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    etcd: Etcd,
    lease: Arc<std::sync::atomic::AtomicI64>,
}

impl Registration {
    /// Stops renewing. `withdraw`: also revoke the lease now, so the record
    /// vanishes at once - for a node that ended all its sandboxes. Without
    /// it the record lives out its TTL, and a restart within it is seamless.
    pub async fn stop(self, withdraw: bool) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        if withdraw {
            let lease = self.lease.load(std::sync::atomic::Ordering::SeqCst);
            if let Err(e) = self.etcd.call(move |s| Ok(s.revoke_lease(lease)?)).await {
                tracing::warn!("could not withdraw this node's registration: {e}");
            }
        }
    }
}

/// Ends the sandboxes the cluster gave up on, registers this node and keeps
/// the registration alive until stopped.
pub async fn register(node: Node, store: Arc<EtcdStore>, cfg: NodeAgentConfig) -> Result<Registration, ClusterError> {
    check_node_name(&cfg.name)?;
    if cfg.ttl < cfg.heartbeat * 2 {
        return Err(ClusterError::Config("the lease TTL must be at least two heartbeats".into()));
    }
    let etcd = Etcd(store);
    end_sandboxes_given_up(&node, &etcd, &cfg.name).await?;
    let started_at_ms = warren_node::now_ms();
    let ttl_secs = cfg.ttl.as_secs().max(1) as i64;
    let lease = etcd.call(move |s| Ok(s.grant_lease(ttl_secs)?)).await?;
    write_status(&etcd, &node, &cfg, started_at_ms, lease).await?;
    tracing::info!(node = %cfg.name, url = %cfg.url, lease, "registered with the cluster");
    let lease = Arc::new(std::sync::atomic::AtomicI64::new(lease));
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn({
        let (etcd, lease) = (etcd.clone(), lease.clone());
        async move {
            let mut beats = 0u64;
            loop {
                tokio::select! {
                    _ = stopped.changed() => return,
                    _ = tokio::time::sleep(cfg.heartbeat) => {}
                }
                beats += 1;
                if let Err(e) = heartbeat(&etcd, &node, &cfg, started_at_ms, &lease, beats).await {
                    tracing::warn!(node = %cfg.name, "heartbeat failed: {e}");
                }
            }
        }
    });
    Ok(Registration { stop, task, etcd, lease })
}

async fn heartbeat(
    etcd: &Etcd,
    node: &Node,
    cfg: &NodeAgentConfig,
    started_at_ms: u64,
    lease: &std::sync::atomic::AtomicI64,
    beats: u64,
) -> Result<(), ClusterError> {
    let current = lease.load(std::sync::atomic::Ordering::SeqCst);
    let alive = etcd.call(move |s| Ok(s.keep_alive(current)?)).await?;
    if !alive {
        // Out of touch for longer than the TTL: the cluster may have
        // given our sandboxes up meanwhile. Honour that before coming back.
        tracing::warn!(node = %cfg.name, "the registration lapsed; ending what the cluster gave up, then registering again");
        end_sandboxes_given_up(node, etcd, &cfg.name).await?;
        let ttl_secs = cfg.ttl.as_secs().max(1) as i64;
        let fresh = etcd.call(move |s| Ok(s.grant_lease(ttl_secs)?)).await?;
        lease.store(fresh, std::sync::atomic::Ordering::SeqCst);
    }
    write_status(etcd, node, cfg, started_at_ms, lease.load(std::sync::atomic::Ordering::SeqCst)).await?;
    if beats.is_multiple_of(SWEEP_EVERY) {
        forget_placements(etcd, node, &cfg.name).await?;
    }
    Ok(())
}

/// This node as placement sees it.
pub fn status(node: &Node, cfg: &NodeAgentConfig, started_at_ms: u64) -> NodeStatus {
    // Stamped before the counts are read: an API server forgets what it
    // placed here once a heartbeat is stamped after the create finished,
    // so every count below must include what was live at this time.
    let heartbeat_at_ms = warren_node::now_ms();
    let mut usage_by_project: BTreeMap<String, QuotaUse> = BTreeMap::new();
    for live in node.live_projects() {
        let usage = usage_by_project.entry(live.project).or_default();
        usage.sandboxes += 1;
        usage.cpus += live.cpus;
        usage.memory_mib += live.memory_mib;
    }
    let mut running_by_backend = BTreeMap::new();
    let mut running_by_label = BTreeMap::new();
    for sandbox in node.list(&BTreeMap::new(), Some(SandboxState::Running)).unwrap_or_default() {
        *running_by_backend.entry(sandbox.backend.as_str().to_string()).or_insert(0) += 1;
        for (k, v) in &sandbox.labels {
            *running_by_label.entry(format!("{k}={v}")).or_insert(0) += 1;
        }
    }
    let host = host_totals();
    NodeStatus {
        name: cfg.name.clone(),
        url: cfg.url.clone(),
        backends: node.backends(),
        cpus: host.0,
        memory_total_mib: host.1,
        disk_free_mib: rustix::fs::statvfs(&cfg.data_dir).map_or(0, |st| st.f_bavail * st.f_frsize / (1 << 20)),
        books: node.books(),
        images: node.images().map(|list| list.into_iter().map(|i| i.name).collect()).unwrap_or_default(),
        running_by_backend,
        running_by_label,
        usage_by_project,
        heartbeat_at_ms,
        started_at_ms,
    }
}

async fn write_status(
    etcd: &Etcd,
    node: &Node,
    cfg: &NodeAgentConfig,
    started_at_ms: u64,
    lease: i64,
) -> Result<(), ClusterError> {
    let record = serde_json::to_vec(&status(node, cfg, started_at_ms))
        .map_err(|e| ClusterError::Config(format!("cannot encode the node record: {e}")))?;
    let name = cfg.name.clone();
    etcd.call(move |s| Ok(s.put_with_lease(Table::Nodes, &name, &record, lease)?)).await
}

/// Ends every sandbox of this node that a watcher marked lost.
async fn end_sandboxes_given_up(node: &Node, etcd: &Etcd, name: &str) -> Result<(), ClusterError> {
    for record in etcd.placements_of(name).await? {
        if record.lost_at_ms.is_none() {
            continue;
        }
        match node.end_node_lost(&record.sandbox.id).await {
            Ok(info) => tracing::info!(sandbox = %info.id, "ended: the cluster gave it up while this node was away"),
            Err(warren_node::NodeError::NotFound(_)) => {}
            Err(e) => tracing::warn!(sandbox = %record.sandbox.id, "cannot end a sandbox the cluster gave up: {e}"),
        }
    }
    Ok(())
}

/// Drops placement records of sandboxes this node no longer knows (its own
/// record of them reached the end of its retention).
async fn forget_placements(etcd: &Etcd, node: &Node, name: &str) -> Result<(), ClusterError> {
    let prefix = format!("{name}/");
    let keys: Vec<String> = etcd
        .call(move |s: &EtcdStore| Ok(s.list(Table::Placements, &prefix)?.into_iter().map(|(k, _)| k).collect()))
        .await?;
    let forgotten: Vec<String> = keys
        .into_iter()
        .filter(|key| {
            let id = key.rsplit('/').next().unwrap_or_default();
            matches!(node.get(id), Err(warren_node::NodeError::NotFound(_)))
        })
        .collect();
    if forgotten.is_empty() {
        return Ok(());
    }
    etcd.call(move |s| {
        for key in &forgotten {
            s.delete(Table::Placements, key)?;
        }
        Ok(())
    })
    .await
}

/// CPUs and memory (MiB) of this host.
fn host_totals() -> (f64, u64) {
    let cpus = std::thread::available_parallelism().map(|n| n.get() as f64).unwrap_or(1.0);
    let memory_mib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024);
    (cpus, memory_mib)
}

//! An API server's metrics, and its `GET /v1/stats` summed over the nodes.
//!
//! Two kinds of numbers, kept apart by prefix:
//!
//! - `warren_api_*` count what this API server did (creates it placed,
//!   refusals that made it try another node, batch items, its queue of
//!   waiting creates). Every API server has its own: sum them over the
//!   instances.
//! - `warren_cluster_*` are levels read from the node registrations the
//!   watcher keeps (capacity, running sandboxes by node and backend, by
//!   project) and from the placement records (lost nodes and their
//!   sandboxes). Every API server reports the same cluster: take `max`
//!   over the instances, not `sum`. The counts are the nodes' own as of
//!   their last heartbeat.
//!
//! `GET /v1/stats` asks every live node for its own and adds them up
//! ([`merge_stats`]), so the dashboard reads a cluster as it reads a node.
//! Nothing here keeps state of its own beyond the counters.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use serde_json::Value;
use warren_api::{
    Backend, CreateLatency, EndReason, ImageFetchStats, LandlockEvents, NodeCapacity, NodeStats, NodeStatus,
    SandboxCount,
};
use warren_node::metrics::Format;

use crate::token::{self, ClusterToken};

type Labels<const N: usize> = [(&'static str, String); N];
type FloatGauge = Gauge<f64, AtomicU64>;

/// What an answered create counts under when no node made a sandbox.
pub const NO_NODE: &str = "none";

/// How long `GET /v1/stats` waits for a node's own.
const NODE_STATS_TIMEOUT: Duration = Duration::from_secs(5);

/// Creates through the API server: 1 ms to about 65 s (a queued create
/// may wait longer; it lands in `+Inf`).
fn create_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Waits in the line of queued creates: 10 ms to about 11 min.
fn queue_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.01, 2.0, 17))
}

/// What is a level, not an event: read when scraped.
#[derive(Debug, Default, Clone)]
pub struct ClusterLevels {
    /// The live nodes, as the watcher last read them.
    pub nodes: Vec<NodeStatus>,
    /// Per lost node: its sandboxes given up `node_lost`, still on record.
    /// `None` when the placement records could not be read: the last
    /// values stand.
    pub lost: Option<BTreeMap<String, u64>>,
    /// Creates waiting in this API server's line (`?queue=true`).
    pub queued: u64,
}

pub struct ApiMetrics {
    registry: Registry,
    /// Serialises refresh-and-encode so two scrapes never interleave.
    scrape: Mutex<()>,
    creates: Family<Labels<3>, Counter>,
    create_seconds: Family<Labels<1>, Histogram, fn() -> Histogram>,
    refusals: Family<Labels<2>, Counter>,
    batch_items: Family<Labels<1>, Counter>,
    queued: Gauge,
    queue_wait_seconds: Histogram,
    nodes: Family<Labels<1>, Gauge>,
    lost_sandboxes: Gauge,
    sandboxes: Family<Labels<2>, Gauge>,
    project_sandboxes: Family<Labels<1>, Gauge>,
    node_capacity_sandboxes: Family<Labels<1>, Gauge>,
    node_live_sandboxes: Family<Labels<1>, Gauge>,
    node_cpus: Family<Labels<1>, FloatGauge>,
    node_used_cpus: Family<Labels<1>, FloatGauge>,
    node_memory_bytes: Family<Labels<1>, Gauge>,
    node_committed_memory_bytes: Family<Labels<1>, Gauge>,
    node_disk_free_bytes: Family<Labels<1>, Gauge>,
    node_queued: Family<Labels<1>, Gauge>,
}

impl std::fmt::Debug for ApiMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiMetrics").finish_non_exhaustive()
    }
}

/// What a create's answer counts as: `created` (201), `existing` (200: a
/// known idempotency key), else the error's code (`capacity_exceeded`,
/// `queue_full`, `node_unavailable`, ...).
pub fn create_result(status: u16, answer: &Value) -> String {
    match status {
        201 => "created".into(),
        200 => "existing".into(),
        _ => answer.get("code").and_then(Value::as_str).unwrap_or("failed").to_string(),
    }
}

/// The node a create's answer names, or [`NO_NODE`].
pub fn placed_node(answer: &Value) -> String {
    answer.pointer("/placement/node").and_then(Value::as_str).unwrap_or(NO_NODE).to_string()
}

fn bytes_of_mib(mib: u64) -> i64 {
    mib.saturating_mul(1024 * 1024).min(i64::MAX as u64) as i64
}

impl ApiMetrics {
    pub fn new() -> Arc<ApiMetrics> {
        let mut registry = Registry::with_prefix("warren");
        let m = ApiMetrics {
            registry: Registry::default(),
            scrape: Mutex::new(()),
            creates: Family::default(),
            create_seconds: Family::new_with_constructor(create_histogram as fn() -> Histogram),
            refusals: Family::default(),
            batch_items: Family::default(),
            queued: Gauge::default(),
            queue_wait_seconds: queue_histogram(),
            nodes: Family::default(),
            lost_sandboxes: Gauge::default(),
            sandboxes: Family::default(),
            project_sandboxes: Family::default(),
            node_capacity_sandboxes: Family::default(),
            node_live_sandboxes: Family::default(),
            node_cpus: Family::default(),
            node_used_cpus: Family::default(),
            node_memory_bytes: Family::default(),
            node_committed_memory_bytes: Family::default(),
            node_disk_free_bytes: Family::default(),
            node_queued: Family::default(),
        };
        registry.register(
            "api_creates",
            "Creates this API server answered (single and batch items), by backend, node placed on and result",
            m.creates.clone(),
        );
        registry.register_with_unit(
            "api_create",
            "Time from request to answer of creates that made a sandbox, through this API server, by backend",
            Unit::Seconds,
            m.create_seconds.clone(),
        );
        registry.register(
            "api_placement_refusals",
            "Nodes that refused a create this API server sent them (it then tries another), by node and reason",
            m.refusals.clone(),
        );
        registry.register("api_batch_items", "Batch items by result (made, existing, failed)", m.batch_items.clone());
        registry.register("api_queued_creates", "Creates waiting in this API server's line for room", m.queued.clone());
        registry.register_with_unit(
            "api_queue_wait",
            "Time queued creates waited in this API server's line",
            Unit::Seconds,
            m.queue_wait_seconds.clone(),
        );
        registry.register("cluster_nodes", "Nodes by state: up (registered) or lost", m.nodes.clone());
        registry.register(
            "cluster_lost_sandboxes",
            "Sandboxes given up node_lost with their nodes, still on record",
            m.lost_sandboxes.clone(),
        );
        registry.register(
            "cluster_sandboxes",
            "Running sandboxes by node and backend, as of each node's last heartbeat",
            m.sandboxes.clone(),
        );
        registry.register(
            "cluster_project_sandboxes",
            "Live sandboxes by project over every node, as of their last heartbeats",
            m.project_sandboxes.clone(),
        );
        registry.register(
            "cluster_node_capacity_sandboxes",
            "Sandboxes each node admits at most",
            m.node_capacity_sandboxes.clone(),
        );
        registry.register(
            "cluster_node_live_sandboxes",
            "Live sandboxes (paused ones included) on each node",
            m.node_live_sandboxes.clone(),
        );
        registry.register("cluster_node_cpus", "CPUs of each node", m.node_cpus.clone());
        registry.register(
            "cluster_node_used_cpus",
            "CPUs each node's live sandboxes asked for",
            m.node_used_cpus.clone(),
        );
        registry.register_with_unit(
            "cluster_node_memory",
            "Memory of each node",
            Unit::Bytes,
            m.node_memory_bytes.clone(),
        );
        registry.register_with_unit(
            "cluster_node_committed_memory",
            "Memory of each node's running sandboxes and creates under way",
            Unit::Bytes,
            m.node_committed_memory_bytes.clone(),
        );
        registry.register_with_unit(
            "cluster_node_disk_free",
            "Free space of each node's data directory",
            Unit::Bytes,
            m.node_disk_free_bytes.clone(),
        );
        registry.register(
            "cluster_node_queued_creates",
            "Creates waiting in each node's admission queue",
            m.node_queued.clone(),
        );
        // Both node states exist from the start, at zero.
        for state in ["up", "lost"] {
            let _ = m.nodes.get_or_create(&[("state", state.into())]);
        }
        Arc::new(ApiMetrics { registry, ..m })
    }

    // ---- events ---------------------------------------------------------------

    /// A create (or batch item) answered `status` with `answer` after `took`.
    pub fn create_answered(&self, backend: Backend, status: u16, answer: &Value, took: Duration) {
        let b = backend.as_str().to_string();
        let result = create_result(status, answer);
        self.creates.get_or_create(&[("backend", b.clone()), ("node", placed_node(answer)), ("result", result)]).inc();
        if status == 201 {
            self.create_seconds.get_or_create(&[("backend", b)]).observe(took.as_secs_f64());
        }
    }

    /// `node` refused a create (`reason`: its error code, or `unreachable`).
    pub fn refused(&self, node: &str, reason: &str) {
        self.refusals.get_or_create(&[("node", node.to_string()), ("reason", reason.to_string())]).inc();
    }

    /// A batch item finished: `made`, `existing` or `failed`.
    pub fn batch_item(&self, result: &'static str) {
        self.batch_items.get_or_create(&[("result", result.into())]).inc();
    }

    /// A queued create left the line after `waited`.
    pub fn left_queue(&self, waited: Duration) {
        self.queue_wait_seconds.observe(waited.as_secs_f64());
    }

    // ---- levels and output ----------------------------------------------------

    fn refresh(&self, levels: &ClusterLevels) {
        self.queued.set(levels.queued.min(i64::MAX as u64) as i64);
        self.nodes.get_or_create(&[("state", "up".into())]).set(levels.nodes.len() as i64);
        if let Some(lost) = &levels.lost {
            self.nodes.get_or_create(&[("state", "lost".into())]).set(lost.len() as i64);
            self.lost_sandboxes.set(lost.values().sum::<u64>().min(i64::MAX as u64) as i64);
        }
        // Cleared first: a node that left, or a project whose last sandbox
        // ended, drops out instead of keeping its last value.
        for family in [
            &self.node_capacity_sandboxes,
            &self.node_live_sandboxes,
            &self.node_memory_bytes,
            &self.node_committed_memory_bytes,
            &self.node_disk_free_bytes,
            &self.node_queued,
            &self.project_sandboxes,
        ] {
            family.clear();
        }
        self.sandboxes.clear();
        self.node_cpus.clear();
        self.node_used_cpus.clear();
        let mut by_project: BTreeMap<&str, u64> = BTreeMap::new();
        for node in &levels.nodes {
            let name = || [("node", node.name.clone())];
            for (backend, n) in &node.running_by_backend {
                self.sandboxes
                    .get_or_create(&[("node", node.name.clone()), ("backend", backend.clone())])
                    .set(*n as i64);
            }
            let books = &node.books;
            self.node_capacity_sandboxes.get_or_create(&name()).set(books.sandboxes_max as i64);
            self.node_live_sandboxes.get_or_create(&name()).set(books.sandboxes_live as i64);
            self.node_cpus.get_or_create(&name()).set(node.cpus);
            self.node_used_cpus.get_or_create(&name()).set(node.usage_by_project.values().map(|u| u.cpus).sum());
            self.node_memory_bytes.get_or_create(&name()).set(bytes_of_mib(node.memory_total_mib));
            self.node_committed_memory_bytes.get_or_create(&name()).set(bytes_of_mib(books.memory_mib_committed));
            self.node_disk_free_bytes.get_or_create(&name()).set(bytes_of_mib(node.disk_free_mib));
            self.node_queued.get_or_create(&name()).set(books.queue_waiting as i64);
            for (project, used) in &node.usage_by_project {
                *by_project.entry(project).or_default() += used.sandboxes;
            }
        }
        for (project, n) in by_project {
            self.project_sandboxes.get_or_create(&[("project", project.to_string())]).set(n as i64);
        }
    }

    /// The registry as text in `format`, levels as given.
    pub fn encode(&self, levels: &ClusterLevels, format: Format) -> String {
        let _scrape = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh(levels);
        let mut out = String::new();
        // Writing to a String cannot fail; a metric's own encoder error
        // would still leave the partial text as the best answer.
        let _ = match format {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry),
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &self.registry),
        };
        out
    }
}

// ---- GET /v1/stats --------------------------------------------------------

/// Every node's own `/v1/stats`, asked in parallel with the cluster
/// token. A node that does not answer in time is left out (and logged):
/// the sum is then short by its numbers, as it is once a node is lost.
pub async fn fetch_node_stats(http: &reqwest::Client, token: &ClusterToken, nodes: &[NodeStatus]) -> Vec<NodeStats> {
    let calls = nodes.iter().map(|node| {
        let request = http
            .get(format!("{}/v1/stats", node.url))
            .header(token::HEADER, token.as_str())
            .timeout(NODE_STATS_TIMEOUT);
        async move {
            let response = request.send().await.map_err(|e| e.to_string())?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("answered {status}"));
            }
            response.json::<NodeStats>().await.map_err(|e| e.to_string())
        }
    });
    let mut out = Vec::new();
    for (node, answer) in nodes.iter().zip(futures_util::future::join_all(calls).await) {
        match answer {
            Ok(stats) => out.push(stats),
            Err(e) => tracing::warn!(node = %node.name, "no stats from the node: {e}"),
        }
    }
    out
}

/// The nodes' stats as one: counts, capacity, counters and latency sums
/// added up. Exact for what is a sum (counters, the sums and counts of
/// create latency, so its means stay right); approximate in that the
/// nodes were read one after another, not at one instant, and a node
/// that restarted counts from zero again. `queued` (the API server's own
/// line) adds to the nodes' queues; `lost` sandboxes add to the
/// `node_lost` ends, which no live node counts.
pub fn merge_stats(parts: &[NodeStats], queued: u64, lost: u64, time_ms: u64) -> NodeStats {
    let mut sandboxes: BTreeMap<(String, String), SandboxCount> = BTreeMap::new();
    let mut latency: BTreeMap<(String, String), CreateLatency> = BTreeMap::new();
    let mut out = NodeStats {
        version: env!("CARGO_PKG_VERSION").to_string(),
        time_ms,
        sandboxes: Vec::new(),
        capacity: NodeCapacity {
            max_sandboxes: 0,
            sandboxes_used: 0,
            cpus_total: 0.0,
            cpus_used: 0.0,
            memory_total_bytes: 0,
            memory_used_bytes: 0,
        },
        creations_total: 0,
        creations_failed_total: 0,
        create_latency: Vec::new(),
        execs: BTreeMap::new(),
        exec_seconds_sum: 0.0,
        ends: BTreeMap::new(),
        security_events: BTreeMap::new(),
        images: ImageFetchStats::default(),
        queue_depth: queued,
        pool_idle: BTreeMap::new(),
        landlock_events: LandlockEvents::default(),
    };
    for part in parts {
        for c in &part.sandboxes {
            let key = (c.backend.as_str().to_string(), wire(&c.state));
            sandboxes.entry(key).or_insert(SandboxCount { count: 0, ..c.clone() }).count += c.count;
        }
        let (cap, sum) = (&part.capacity, &mut out.capacity);
        sum.max_sandboxes += cap.max_sandboxes;
        sum.sandboxes_used += cap.sandboxes_used;
        sum.cpus_total += cap.cpus_total;
        sum.cpus_used += cap.cpus_used;
        sum.memory_total_bytes = sum.memory_total_bytes.saturating_add(cap.memory_total_bytes);
        sum.memory_used_bytes = sum.memory_used_bytes.saturating_add(cap.memory_used_bytes);
        out.creations_total += part.creations_total;
        out.creations_failed_total += part.creations_failed_total;
        for l in &part.create_latency {
            let key = (l.backend.as_str().to_string(), l.source.as_str().to_string());
            let entry = latency.entry(key).or_insert(CreateLatency { count: 0, sum_secs: 0.0, ..l.clone() });
            entry.count += l.count;
            entry.sum_secs += l.sum_secs;
        }
        add_all(&mut out.execs, &part.execs);
        out.exec_seconds_sum += part.exec_seconds_sum;
        add_all(&mut out.ends, &part.ends);
        add_all(&mut out.security_events, &part.security_events);
        let (img, sum) = (&part.images, &mut out.images);
        sum.fetched_bytes = sum.fetched_bytes.saturating_add(img.fetched_bytes);
        sum.fetched_chunks += img.fetched_chunks;
        sum.cache_hits += img.cache_hits;
        sum.fill_events += img.fill_events;
        out.queue_depth += part.queue_depth;
        add_all(&mut out.pool_idle, &part.pool_idle);
    }
    if lost > 0 {
        *out.ends.entry(EndReason::NodeLost).or_default() += lost;
    }
    out.landlock_events = merge_landlock_events(parts);
    out.sandboxes = sandboxes.into_values().collect();
    out.create_latency = latency.into_values().collect();
    out
}

/// Available only when every node has them: a refusal on a node without
/// them would go unseen. The detail is the nodes' reasons for not having them.
fn merge_landlock_events(parts: &[NodeStats]) -> LandlockEvents {
    let missing: std::collections::BTreeSet<&str> =
        parts.iter().filter(|p| !p.landlock_events.available).map(|p| p.landlock_events.detail.as_str()).collect();
    match (parts.first(), missing.is_empty()) {
        (None, _) => LandlockEvents { available: false, detail: "no node answered".into() },
        (Some(first), true) => LandlockEvents { available: true, detail: first.landlock_events.detail.clone() },
        (Some(_), false) => LandlockEvents {
            available: false,
            detail: format!("not on every node: {}", missing.into_iter().collect::<Vec<_>>().join("; ")),
        },
    }
}

fn add_all<K: Ord + Clone>(into: &mut BTreeMap<K, u64>, from: &BTreeMap<K, u64>) {
    for (k, v) in from {
        *into.entry(k.clone()).or_default() += v;
    }
}

/// The wire name of an API enum value (`"running"`).
fn wire<T: serde::Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}

/// Lost sandboxes per node, from their ids.
pub fn lost_by_node<'a>(ids: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, u64> {
    let mut out: HashMap<String, u64> = HashMap::new();
    for id in ids {
        if let Some(node) = crate::records::node_of(id) {
            *out.entry(node.to_string()).or_default() += 1;
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_api::{CreateSource, ExecStatus, NodeBooks, QuotaUse, SandboxState, SecurityEventKind};

    fn stats(running: u64, creates: u64, secs: f64) -> NodeStats {
        let mut s = merge_stats(&[], 0, 0, 0);
        s.sandboxes = vec![SandboxCount { backend: Backend::Container, state: SandboxState::Running, count: running }];
        s.capacity = NodeCapacity {
            max_sandboxes: 10,
            sandboxes_used: running,
            cpus_total: 4.0,
            cpus_used: running as f64,
            memory_total_bytes: 1 << 30,
            memory_used_bytes: running << 20,
        };
        s.creations_total = creates;
        s.create_latency = vec![CreateLatency {
            backend: Backend::Container,
            source: CreateSource::Fresh,
            count: creates,
            sum_secs: secs,
        }];
        s.execs.insert(ExecStatus::Ok, 2);
        s.ends.insert(EndReason::Deleted, 1);
        s.security_events.insert(SecurityEventKind::Seccomp, 1);
        s.pool_idle.insert("busybox".into(), 1);
        s.queue_depth = 1;
        s
    }

    #[test]
    fn stats_of_nodes_add_up_and_keep_the_mean_latency() {
        let mut b = stats(3, 1, 0.3);
        b.sandboxes.push(SandboxCount { backend: Backend::Vm, state: SandboxState::Paused, count: 1 });
        let merged = merge_stats(&[stats(2, 3, 0.3), b], 2, 4, 77);
        assert_eq!(merged.time_ms, 77);
        let running: Vec<_> = merged.sandboxes.iter().map(|c| (c.backend, c.state, c.count)).collect();
        assert_eq!(
            running,
            vec![(Backend::Container, SandboxState::Running, 5), (Backend::Vm, SandboxState::Paused, 1)]
        );
        assert_eq!(merged.capacity.max_sandboxes, 20);
        assert_eq!(merged.capacity.cpus_total, 8.0);
        assert_eq!(merged.capacity.memory_used_bytes, 5 << 20);
        assert_eq!(merged.creations_total, 4);
        assert_eq!(merged.create_latency.len(), 1, "one (backend, source) pair: {:?}", merged.create_latency);
        let l = &merged.create_latency[0];
        assert_eq!((l.count, l.sum_secs), (4, 0.6), "the mean is 0.15 s over both nodes");
        assert_eq!(merged.execs[&ExecStatus::Ok], 4);
        assert_eq!(merged.ends[&EndReason::Deleted], 2);
        assert_eq!(merged.ends[&EndReason::NodeLost], 4, "lost sandboxes are ends no node counts");
        assert_eq!(merged.security_events[&SecurityEventKind::Seccomp], 2);
        assert_eq!(merged.pool_idle["busybox"], 2);
        assert_eq!(merged.queue_depth, 4, "both nodes' queues and the API server's own line");
    }

    #[test]
    fn landlock_events_are_available_only_when_every_node_has_them() {
        let with = |available: bool, detail: &str| {
            let mut s = stats(1, 1, 0.1);
            s.landlock_events = LandlockEvents { available, detail: detail.into() };
            s
        };
        let daemon = "registered as the audit daemon";
        let both = merge_stats(&[with(true, daemon), with(true, daemon)], 0, 0, 1).landlock_events;
        assert_eq!(both, LandlockEvents { available: true, detail: daemon.into() });
        let one = merge_stats(&[with(true, daemon), with(false, "--landlock-audit off")], 0, 0, 1).landlock_events;
        assert_eq!(one, LandlockEvents { available: false, detail: "not on every node: --landlock-audit off".into() });
        assert!(!merge_stats(&[], 0, 0, 1).landlock_events.available);
    }

    #[test]
    fn no_nodes_is_an_empty_cluster_not_an_error() {
        let merged = merge_stats(&[], 0, 0, 1);
        assert!(merged.sandboxes.is_empty() && merged.create_latency.is_empty() && merged.ends.is_empty());
        assert_eq!(merged.capacity.max_sandboxes, 0);
    }

    fn sample(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn node(name: &str, running: u64, project: &str) -> NodeStatus {
        NodeStatus {
            name: name.into(),
            url: format!("http://{name}"),
            backends: vec![Backend::Container],
            cpus: 4.0,
            memory_total_mib: 1024,
            disk_free_mib: 10,
            books: NodeBooks {
                sandboxes_max: 8,
                sandboxes_live: running,
                sandboxes_paused: 0,
                memory_mib_max: None,
                memory_mib_committed: 64 * running,
                memory_mib_reclaimable: 0,
                queue_waiting: 0,
                queue_limit: 16,
            },
            images: vec![],
            running_by_backend: [("container".to_string(), running)].into(),
            running_by_label: BTreeMap::new(),
            usage_by_project: [(project.to_string(), QuotaUse { sandboxes: running, cpus: 0.5, memory_mib: 64 })]
                .into(),
            heartbeat_at_ms: 0,
            started_at_ms: 0,
        }
    }

    #[test]
    fn events_and_cluster_levels_show_in_the_text() {
        let m = ApiMetrics::new();
        let placed = serde_json::json!({"id": "sb-n1-00", "placement": {"node": "n1", "reason": "least loaded"}});
        m.create_answered(Backend::Container, 201, &placed, Duration::from_millis(20));
        m.create_answered(Backend::Container, 200, &placed, Duration::from_millis(1));
        let full = serde_json::json!({"code": "capacity_exceeded", "message": "no node"});
        m.create_answered(Backend::Vm, 503, &full, Duration::from_millis(1));
        m.refused("n0", "capacity_exceeded");
        m.batch_item("made");
        m.left_queue(Duration::from_millis(300));
        let levels = ClusterLevels {
            nodes: vec![node("n0", 1, "root"), node("n1", 2, "root")],
            lost: Some(lost_by_node(["sb-n2-aa", "sb-n2-bb", "not-an-id"])),
            queued: 3,
        };
        let text = m.encode(&levels, Format::Prometheus);
        let get = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("no sample `{s}` in:\n{text}"));
        assert_eq!(get(r#"warren_api_creates_total{backend="container",node="n1",result="created"}"#), 1.0);
        assert_eq!(get(r#"warren_api_creates_total{backend="container",node="n1",result="existing"}"#), 1.0);
        assert_eq!(get(r#"warren_api_creates_total{backend="vm",node="none",result="capacity_exceeded"}"#), 1.0);
        assert_eq!(get(r#"warren_api_create_seconds_count{backend="container"}"#), 1.0, "only made sandboxes");
        assert_eq!(get(r#"warren_api_placement_refusals_total{node="n0",reason="capacity_exceeded"}"#), 1.0);
        assert_eq!(get(r#"warren_api_batch_items_total{result="made"}"#), 1.0);
        assert_eq!(get("warren_api_queue_wait_seconds_count"), 1.0);
        assert_eq!(get("warren_api_queued_creates"), 3.0);
        assert_eq!(get(r#"warren_cluster_nodes{state="up"}"#), 2.0);
        assert_eq!(get(r#"warren_cluster_nodes{state="lost"}"#), 1.0);
        assert_eq!(get("warren_cluster_lost_sandboxes"), 2.0);
        assert_eq!(get(r#"warren_cluster_sandboxes{node="n1",backend="container"}"#), 2.0);
        assert_eq!(get(r#"warren_cluster_project_sandboxes{project="root"}"#), 3.0);
        assert_eq!(get(r#"warren_cluster_node_used_cpus{node="n0"}"#), 0.5);
        assert_eq!(get(r#"warren_cluster_node_memory_bytes{node="n0"}"#), (1024u64 << 20) as f64);

        // A node that left drops out; unreadable records keep the last lost count.
        let levels = ClusterLevels { nodes: vec![node("n0", 0, "root")], lost: None, queued: 0 };
        let text = m.encode(&levels, Format::OpenMetrics);
        assert_eq!(sample(&text, r#"warren_cluster_sandboxes{node="n1",backend="container"}"#), None);
        assert_eq!(sample(&text, "warren_cluster_lost_sandboxes"), Some(2.0));
        assert!(text.ends_with("# EOF\n"));
    }
}

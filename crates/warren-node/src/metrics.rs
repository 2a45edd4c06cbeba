//! The node's metrics: one Prometheus registry per node. The node records
//! events as they happen (creates, execs, ends, security events); what is a
//! level rather than an event (sandboxes by state, capacity used, image
//! fetch counters kept by the image crate, queue depth) is read when
//! scraped. The control crate serves the text; nothing here does I/O.
//!
//! Label values are the wire names of the API's enums, so a dashboard, the
//! JSON API and the metrics all say `idle_timeout`, never two spellings.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use serde::Serialize;
use warren_api::{
    Backend, CreateLatency, CreateSource, EndReason, ExecStatus, ImageFetchStats, NodeCapacity, SandboxCount,
    SandboxState, SecurityEventKind,
};

/// `Content-Type` of [`Format::Prometheus`].
pub const PROMETHEUS_CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;
/// `Content-Type` of [`Format::OpenMetrics`].
pub const OPENMETRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Text formats `GET /metrics` can answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// The classic Prometheus text format (0.0.4): what every scraper reads.
    Prometheus,
    /// OpenMetrics 1.0 text, for scrapers that ask for it.
    OpenMetrics,
}

const BACKENDS: [Backend; 4] = [Backend::Function, Backend::Container, Backend::Microvm, Backend::Vm];
/// States a sandbox that is not ended can be in.
const STATES: [SandboxState; 4] =
    [SandboxState::Creating, SandboxState::Running, SandboxState::Paused, SandboxState::Ending];
const SOURCES: [CreateSource; 2] = [CreateSource::Pool, CreateSource::Fresh];
const EXEC_ENDS: [ExecStatus; 4] = [ExecStatus::Ok, ExecStatus::TimedOut, ExecStatus::Killed, ExecStatus::Oom];
/// The calls [`NodeMetrics::abandoned`] counts.
pub const ABANDONABLE_CALLS: [&str; 6] = ["create", "delete", "end", "phase", "network", "file_write"];

type Labels<const N: usize> = [(&'static str, String); N];
type HistogramFamily<const N: usize> = Family<Labels<N>, Histogram, fn() -> Histogram>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The wire name of an API enum value (`"idle_timeout"`).
fn wire<T: Serialize>(value: &T) -> String {
    match serde_json::to_value(value) {
        Ok(serde_json::Value::String(s)) => s,
        _ => "unknown".to_string(),
    }
}

/// Create times: 1 ms to about 65 s.
fn create_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Exec wall times: 1 ms to about 1050 s.
fn exec_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 21))
}

/// What is a level, not an event: read from the node when scraped.
#[derive(Debug, Default, Clone)]
pub struct Levels {
    /// Live sandboxes by backend and state (creates and ends in flight are
    /// added by the metrics themselves).
    pub sandboxes: HashMap<(Backend, SandboxState), u64>,
    pub max_sandboxes: u64,
    pub cpus_used: f64,
    pub memory_used_bytes: u64,
    pub images: ImageFetchStats,
    pub queue_depth: u64,
    /// Idle warm-pool members by image.
    pub pool_idle: BTreeMap<String, u64>,
    /// Live sandboxes (paused ones included) by project, backend and state.
    pub project_sandboxes: HashMap<(String, Backend, SandboxState), u64>,
}

#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    /// Serialises refresh-and-encode so two scrapes never interleave.
    scrape: Mutex<()>,
    sandboxes: Family<Labels<2>, Gauge>,
    /// Creates and ends in progress: `(backend, state)` -> count.
    in_flight: Mutex<HashMap<(Backend, SandboxState), i64>>,
    /// Histogram sums and counts for the JSON summary (the histogram type
    /// does not expose them).
    tallies: Mutex<Tallies>,
    creations: Family<Labels<3>, Counter>,
    create_seconds: HistogramFamily<2>,
    execs: Family<Labels<1>, Counter>,
    exec_seconds: HistogramFamily<1>,
    ends: Family<Labels<2>, Counter>,
    security_events: Family<Labels<1>, Counter>,
    abandoned_calls: Family<Labels<1>, Counter>,
    image_fetched_bytes: Counter,
    image_fetched_chunks: Counter,
    layer_cache_hits: Counter,
    layer_fill_events: Counter,
    queue_depth: Gauge,
    pool_idle: Family<Labels<1>, Gauge>,
    project_sandboxes: Family<Labels<3>, Gauge>,
    project_creations: Family<Labels<2>, Counter>,
    project_ends: Family<Labels<2>, Counter>,
    capacity_sandboxes: Gauge,
    used_sandboxes: Gauge,
    capacity_cpus: FloatGauge,
    used_cpus: FloatGauge,
    capacity_memory_bytes: Gauge,
    used_memory_bytes: Gauge,
}

impl NodeMetrics {
    pub fn new() -> Arc<NodeMetrics> {
        let mut registry = Registry::with_prefix("warren");
        let m = NodeMetrics {
            registry: Registry::default(),
            scrape: Mutex::new(()),
            sandboxes: Family::default(),
            in_flight: Mutex::new(HashMap::new()),
            tallies: Mutex::new(Tallies::default()),
            creations: Family::default(),
            create_seconds: Family::new_with_constructor(create_histogram as fn() -> Histogram),
            execs: Family::default(),
            exec_seconds: Family::new_with_constructor(exec_histogram as fn() -> Histogram),
            ends: Family::default(),
            security_events: Family::default(),
            abandoned_calls: Family::default(),
            image_fetched_bytes: Counter::default(),
            image_fetched_chunks: Counter::default(),
            layer_cache_hits: Counter::default(),
            layer_fill_events: Counter::default(),
            queue_depth: Gauge::default(),
            pool_idle: Family::default(),
            project_sandboxes: Family::default(),
            project_creations: Family::default(),
            project_ends: Family::default(),
            capacity_sandboxes: Gauge::default(),
            used_sandboxes: Gauge::default(),
            capacity_cpus: FloatGauge::default(),
            used_cpus: FloatGauge::default(),
            capacity_memory_bytes: Gauge::default(),
            used_memory_bytes: Gauge::default(),
        };
        registry.register("sandboxes", "Sandboxes that are not ended, by backend and state", m.sandboxes.clone());
        registry.register(
            "sandbox_creations",
            "Sandbox creates after admission, by backend, source (pool: warm, fresh: cold) and outcome",
            m.creations.clone(),
        );
        registry.register_with_unit(
            "sandbox_create",
            "Time from admission to a running sandbox, by backend and source (pool: warm, fresh: cold)",
            Unit::Seconds,
            m.create_seconds.clone(),
        );
        registry.register("execs", "Finished execs and session commands, by status", m.execs.clone());
        registry.register_with_unit(
            "exec",
            "Wall time of finished execs and session commands, by status",
            Unit::Seconds,
            m.exec_seconds.clone(),
        );
        registry.register("sandbox_ends", "Ended sandboxes, by backend and end reason", m.ends.clone());
        registry.register(
            "security_events",
            "Security events the node learnt of, by kind (init's are pulled when a client reads them)",
            m.security_events.clone(),
        );
        registry.register(
            "abandoned_calls",
            "Calls whose caller went away before they finished, by call (create: undone; delete, an end for another reason, phase and network switches, a stepped file write whose body was in: finished); the node saw to the sandbox itself",
            m.abandoned_calls.clone(),
        );
        registry.register_with_unit(
            "image_fetched",
            "Bytes of layered images fetched from the blob store",
            Unit::Bytes,
            m.image_fetched_bytes.clone(),
        );
        registry.register(
            "image_fetched_chunks",
            "Chunks of layered images fetched from the blob store",
            m.image_fetched_chunks.clone(),
        );
        registry.register(
            "layer_cache_hits",
            "Layer cache fill requests whose range was already local",
            m.layer_cache_hits.clone(),
        );
        registry.register("layer_cache_fills", "Layer cache fill requests", m.layer_fill_events.clone());
        registry.register("admission_queue_depth", "Creates waiting for admission", m.queue_depth.clone());
        registry.register(
            "pool_idle_sandboxes",
            "Idle warm-pool members by image: what the next warm creates can claim",
            m.pool_idle.clone(),
        );
        registry.register(
            "project_sandboxes",
            "Live sandboxes (paused ones included) by project, backend and state; a project's own only, not its children's",
            m.project_sandboxes.clone(),
        );
        registry.register(
            "project_sandbox_creations",
            "Sandbox creates after admission by project and outcome (ok, failed)",
            m.project_creations.clone(),
        );
        registry.register("project_sandbox_ends", "Ended sandboxes by project and end reason", m.project_ends.clone());
        registry.register(
            "node_capacity_sandboxes",
            "Sandboxes this node admits at most",
            m.capacity_sandboxes.clone(),
        );
        registry.register("node_used_sandboxes", "Live sandboxes plus creates in flight", m.used_sandboxes.clone());
        registry.register("node_capacity_cpus", "CPUs of the host", m.capacity_cpus.clone());
        registry.register("node_used_cpus", "CPUs the live sandboxes asked for", m.used_cpus.clone());
        registry.register_with_unit(
            "node_capacity_memory",
            "Memory of the host",
            Unit::Bytes,
            m.capacity_memory_bytes.clone(),
        );
        registry.register_with_unit(
            "node_used_memory",
            "Memory the live sandboxes asked for",
            Unit::Bytes,
            m.used_memory_bytes.clone(),
        );
        // The common series exist from the start, at zero: a scraper's
        // rate() then counts the first event too.
        for backend in BACKENDS {
            for source in SOURCES {
                for outcome in ["ok", "failed"] {
                    let _ = m.creations.get_or_create(&[
                        ("backend", backend.as_str().into()),
                        ("source", source.as_str().into()),
                        ("outcome", outcome.into()),
                    ]);
                }
            }
        }
        for status in EXEC_ENDS {
            let _ = m.execs.get_or_create(&[("status", wire(&status))]);
        }
        for call in ABANDONABLE_CALLS {
            let _ = m.abandoned_calls.get_or_create(&[("call", call.into())]);
        }
        m.capacity_cpus.set(std::thread::available_parallelism().map_or(1, |n| n.get()) as f64);
        let info = rustix::system::sysinfo();
        m.capacity_memory_bytes
            .set((info.totalram as u128 * info.mem_unit.max(1) as u128).min(i64::MAX as u128) as i64);
        Arc::new(NodeMetrics { registry, ..m })
    }

    // ---- events ---------------------------------------------------------------

    /// Counts a create (or an end) as in flight until the guard drops.
    pub fn in_flight(self: &Arc<Self>, backend: Backend, state: SandboxState) -> InFlight {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).entry((backend, state)).or_default() += 1;
        InFlight { metrics: Arc::clone(self), key: (backend, state) }
    }

    pub fn created(&self, backend: Backend, source: CreateSource, seconds: f64, project: &str) {
        self.project_creations.get_or_create(&[("project", project.into()), ("outcome", "ok".into())]).inc();
        let b = backend.as_str().to_string();
        self.creations
            .get_or_create(&[("backend", b.clone()), ("source", source.as_str().into()), ("outcome", "ok".into())])
            .inc();
        self.create_seconds.get_or_create(&[("backend", b), ("source", source.as_str().into())]).observe(seconds);
        let mut tallies = self.tallies();
        let (count, sum) = tallies.creates.entry((backend, source)).or_default();
        *count += 1;
        *sum += seconds;
    }

    pub fn create_failed(&self, backend: Backend, source: CreateSource, project: &str) {
        self.project_creations.get_or_create(&[("project", project.into()), ("outcome", "failed".into())]).inc();
        self.creations
            .get_or_create(&[
                ("backend", backend.as_str().into()),
                ("source", source.as_str().into()),
                ("outcome", "failed".into()),
            ])
            .inc();
    }

    pub fn exec_finished(&self, status: ExecStatus, wall_secs: f64) {
        let labels = [("status", wire(&status))];
        self.execs.get_or_create(&labels).inc();
        self.exec_seconds.get_or_create(&labels).observe(wall_secs);
        self.tallies().exec_seconds_sum += wall_secs;
    }

    pub fn ended(&self, backend: Backend, reason: EndReason, project: &str) {
        self.project_ends.get_or_create(&[("project", project.into()), ("reason", wire(&reason))]).inc();
        self.ends.get_or_create(&[("backend", backend.as_str().into()), ("reason", wire(&reason))]).inc();
    }

    pub fn security_event(&self, kind: SecurityEventKind) {
        self.security_events.get_or_create(&[("kind", wire(&kind))]).inc();
    }

    /// A call (one of [`ABANDONABLE_CALLS`]) whose caller stopped waiting.
    pub fn abandoned(&self, call: &'static str) {
        self.abandoned_calls.get_or_create(&[("call", call.into())]).inc();
    }

    // ---- levels and output ----------------------------------------------------

    /// Sets the gauges from `levels`; returns the sandboxes by backend
    /// and state, creates and ends in flight included.
    fn refresh(&self, levels: &Levels) -> HashMap<(Backend, SandboxState), u64> {
        let in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut counts = levels.sandboxes.clone();
        let mut used = levels.sandboxes.values().sum::<u64>();
        for (key, n) in in_flight {
            let n = n.max(0) as u64;
            *counts.entry(key).or_default() += n;
            if key.1 == SandboxState::Creating {
                used += n;
            }
        }
        // Every backend and state gets a series, zero included: a state that
        // empties shows 0, not a gap the scraper fills with the last value.
        self.sandboxes.clear();
        for backend in BACKENDS {
            for state in STATES {
                self.sandboxes.get_or_create(&[("backend", backend.as_str().into()), ("state", wire(&state))]).set(0);
            }
        }
        for (&(backend, state), &n) in &counts {
            self.sandboxes
                .get_or_create(&[("backend", backend.as_str().into()), ("state", wire(&state))])
                .set(n as i64);
        }
        self.capacity_sandboxes.set(levels.max_sandboxes as i64);
        self.used_sandboxes.set(used as i64);
        self.used_cpus.set(levels.cpus_used);
        self.used_memory_bytes.set(levels.memory_used_bytes.min(i64::MAX as u64) as i64);
        self.queue_depth.set(levels.queue_depth as i64);
        self.pool_idle.clear();
        for (image, idle) in &levels.pool_idle {
            self.pool_idle.get_or_create(&[("image", image.clone())]).set(*idle as i64);
        }
        // Cleared first: a project whose last sandbox ended drops out.
        self.project_sandboxes.clear();
        for ((project, backend, state), live) in &levels.project_sandboxes {
            self.project_sandboxes
                .get_or_create(&[
                    ("project", project.clone()),
                    ("backend", backend.as_str().into()),
                    ("state", wire(state)),
                ])
                .set(*live as i64);
        }
        // Kept by the image crate; a layer evicted from the cache takes its
        // counts along, which a scraper sees as a counter reset.
        let img = &levels.images;
        for (counter, value) in [
            (&self.image_fetched_bytes, img.fetched_bytes),
            (&self.image_fetched_chunks, img.fetched_chunks),
            (&self.layer_cache_hits, img.cache_hits),
            (&self.layer_fill_events, img.fill_events),
        ] {
            counter.inner().store(value, Ordering::Relaxed);
        }
        counts
    }

    /// The registry as text in `format`, levels read just now.
    pub fn encode(&self, levels: &Levels, format: Format) -> String {
        let _scrape = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        self.refresh(levels);
        let mut out = String::new();
        // Writing to a String cannot fail; an error would only come from a
        // metric's own encoder, and then the partial text is still the best answer.
        let _ = match format {
            Format::Prometheus => prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry),
            Format::OpenMetrics => prometheus_client::encoding::text::encode(&mut out, &self.registry),
        };
        out
    }

    // ---- the JSON summary ----------------------------------------------------

    pub fn sandbox_counts(&self, levels: &Levels) -> Vec<SandboxCount> {
        let _scrape = self.scrape.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<SandboxCount> = self
            .refresh(levels)
            .into_iter()
            .filter(|&(_, count)| count > 0)
            .map(|((backend, state), count)| SandboxCount { backend, state, count })
            .collect();
        out.sort_by_key(|c| (c.backend.as_str(), wire(&c.state)));
        out
    }

    pub fn capacity(&self) -> NodeCapacity {
        NodeCapacity {
            max_sandboxes: self.capacity_sandboxes.get().max(0) as u64,
            sandboxes_used: self.used_sandboxes.get().max(0) as u64,
            cpus_total: self.capacity_cpus.get(),
            cpus_used: self.used_cpus.get(),
            memory_total_bytes: self.capacity_memory_bytes.get().max(0) as u64,
            memory_used_bytes: self.used_memory_bytes.get().max(0) as u64,
        }
    }

    /// `(successful, failed)` creates since start.
    pub fn creations(&self) -> (u64, u64) {
        let (mut ok, mut failed) = (0, 0);
        for backend in BACKENDS {
            for source in SOURCES {
                let mut labels = [
                    ("backend", backend.as_str().to_string()),
                    ("source", source.as_str().into()),
                    ("outcome", "ok".into()),
                ];
                ok += self.creations.get(&labels).map_or(0, |c| c.get());
                labels[2].1 = "failed".into();
                failed += self.creations.get(&labels).map_or(0, |c| c.get());
            }
        }
        (ok, failed)
    }

    fn tallies(&self) -> std::sync::MutexGuard<'_, Tallies> {
        self.tallies.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn create_latency(&self) -> Vec<CreateLatency> {
        let tallies = self.tallies();
        let mut out = Vec::new();
        for backend in BACKENDS {
            for source in SOURCES {
                if let Some(&(count, sum_secs)) = tallies.creates.get(&(backend, source)) {
                    out.push(CreateLatency { backend, source, count, sum_secs });
                }
            }
        }
        out
    }

    /// Finished execs by status, and the sum of their wall times.
    pub fn execs(&self) -> (BTreeMap<ExecStatus, u64>, f64) {
        let mut by_status = BTreeMap::new();
        for status in EXEC_ENDS {
            let n = self.execs.get(&[("status", wire(&status))]).map_or(0, |c| c.get());
            if n > 0 {
                by_status.insert(status, n);
            }
        }
        (by_status, self.tallies().exec_seconds_sum)
    }

    pub fn ends(&self) -> BTreeMap<EndReason, u64> {
        let reasons = [
            EndReason::Deleted,
            EndReason::IdleTimeout,
            EndReason::Lifetime,
            EndReason::Oom,
            EndReason::InitDied,
            EndReason::NodeRestarted,
            EndReason::CreateFailed,
            EndReason::Shutdown,
            EndReason::NodeLost,
        ];
        let mut out = BTreeMap::new();
        for reason in reasons {
            let n: u64 = BACKENDS
                .iter()
                .filter_map(|b| {
                    self.ends.get(&[("backend", b.as_str().to_string()), ("reason", wire(&reason))]).map(|c| c.get())
                })
                .sum();
            if n > 0 {
                out.insert(reason, n);
            }
        }
        out
    }

    pub fn security_events(&self) -> BTreeMap<SecurityEventKind, u64> {
        let kinds = [
            SecurityEventKind::Seccomp,
            SecurityEventKind::Landlock,
            SecurityEventKind::NetworkBlocked,
            SecurityEventKind::DnsRefused,
            SecurityEventKind::PhaseChanged,
            SecurityEventKind::LimitHit,
            SecurityEventKind::Tamper,
        ];
        kinds
            .into_iter()
            .filter_map(|k| self.security_events.get(&[("kind", wire(&k))]).map(|c| (k, c.get())))
            .collect()
    }
}

impl crate::Node {
    /// What is a level now: live sandboxes, what they asked for, the image
    /// crate's fetch counters, the admission queue.
    fn metric_levels(&self) -> Levels {
        let mut levels = Levels { max_sandboxes: self.inner.cfg.max_sandboxes as u64, ..Levels::default() };
        for live in self.live_map().values() {
            let info = &live.record().info;
            *levels.sandboxes.entry((info.backend, info.state)).or_default() += 1;
            levels.cpus_used += info.resources.cpus;
            levels.memory_used_bytes += info.resources.memory_mib * 1024 * 1024;
            *levels.project_sandboxes.entry((info.project.clone(), info.backend, info.state)).or_default() += 1;
        }
        // A driver's own guests (VM snapshot templates) hold host room too.
        let (reserved_mib, reserved_cpus) = self.inner.admission.reserved();
        levels.cpus_used += reserved_cpus;
        levels.memory_used_bytes += reserved_mib * 1024 * 1024;
        let store = self.image_stats().store;
        let (fill_events, cache_hits) = self.layered().map(|l| l.fill_counters()).unwrap_or_default();
        levels.images = ImageFetchStats {
            fetched_bytes: store.bytes_fetched,
            fetched_chunks: store.chunks_fetched,
            cache_hits,
            fill_events,
        };
        levels.queue_depth = self.books().queue_waiting;
        levels.pool_idle = self.inner.pools.idle_by_image();
        levels
    }

    /// `GET /metrics`: the node's metrics as text.
    pub fn metrics_text(&self, format: Format) -> String {
        self.inner.metrics.encode(&self.metric_levels(), format)
    }

    /// `GET /v1/stats`: the same numbers, summed for a dashboard.
    pub fn stats(&self) -> warren_api::NodeStats {
        let levels = self.metric_levels();
        let m = &self.inner.metrics;
        let sandboxes = m.sandbox_counts(&levels);
        let (creations_total, creations_failed_total) = m.creations();
        let (execs, exec_seconds_sum) = m.execs();
        warren_api::NodeStats {
            version: env!("CARGO_PKG_VERSION").to_string(),
            time_ms: crate::now_ms(),
            sandboxes,
            capacity: m.capacity(),
            creations_total,
            creations_failed_total,
            create_latency: m.create_latency(),
            execs,
            exec_seconds_sum,
            ends: m.ends(),
            security_events: m.security_events(),
            images: levels.images,
            queue_depth: levels.queue_depth,
            pool_idle: levels.pool_idle,
            landlock_events: self.landlock_events(),
        }
    }
}

#[derive(Debug, Default)]
struct Tallies {
    /// `(backend, source)` -> (successful creates, sum of their seconds).
    creates: HashMap<(Backend, CreateSource), (u64, f64)>,
    exec_seconds_sum: f64,
}

/// A create or an end in progress; counted in `warren_sandboxes` while it lives.
pub struct InFlight {
    metrics: Arc<NodeMetrics>,
    key: (Backend, SandboxState),
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(n) = self.metrics.in_flight.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&self.key) {
            *n -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn events_and_levels_show_in_the_text() {
        let m = NodeMetrics::new();
        m.created(Backend::Container, CreateSource::Fresh, 0.02, "prj-a");
        m.created(Backend::Container, CreateSource::Pool, 0.001, "root");
        m.create_failed(Backend::Container, CreateSource::Fresh, "prj-a");
        m.exec_finished(ExecStatus::TimedOut, 2.0);
        m.ended(Backend::Container, EndReason::IdleTimeout, "prj-a");
        m.security_event(SecurityEventKind::NetworkBlocked);
        let creating = m.in_flight(Backend::Container, SandboxState::Creating);
        let mut levels = Levels { max_sandboxes: 8, cpus_used: 1.5, ..Levels::default() };
        levels.sandboxes.insert((Backend::Container, SandboxState::Running), 2);
        levels.images.fetched_bytes = 4096;
        levels.pool_idle.insert("busybox".into(), 2);
        levels.project_sandboxes.insert(("prj-a".into(), Backend::Container, SandboxState::Running), 2);
        levels.project_sandboxes.insert(("prj-a".into(), Backend::Container, SandboxState::Paused), 1);

        let text = m.encode(&levels, Format::Prometheus);
        let get = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("no sample `{s}` in:\n{text}"));
        assert_eq!(get(r#"warren_sandboxes{backend="container",state="running"}"#), 2.0);
        assert_eq!(get(r#"warren_sandboxes{backend="container",state="creating"}"#), 1.0);
        assert_eq!(get(r#"warren_sandboxes{backend="vm",state="running"}"#), 0.0);
        assert_eq!(get(r#"warren_sandbox_creations_total{backend="container",source="fresh",outcome="failed"}"#), 1.0);
        assert_eq!(get(r#"warren_sandbox_create_seconds_count{backend="container",source="pool"}"#), 1.0);
        assert_eq!(get(r#"warren_exec_seconds_bucket{status="timed_out",le="+Inf"}"#), 1.0);
        assert_eq!(get(r#"warren_sandbox_ends_total{backend="container",reason="idle_timeout"}"#), 1.0);
        assert_eq!(get(r#"warren_project_sandbox_creations_total{project="prj-a",outcome="ok"}"#), 1.0);
        assert_eq!(get(r#"warren_project_sandbox_creations_total{project="prj-a",outcome="failed"}"#), 1.0);
        assert_eq!(get(r#"warren_project_sandbox_creations_total{project="root",outcome="ok"}"#), 1.0);
        assert_eq!(get(r#"warren_project_sandbox_ends_total{project="prj-a",reason="idle_timeout"}"#), 1.0);
        assert_eq!(get(r#"warren_security_events_total{kind="network_blocked"}"#), 1.0);
        assert_eq!(get("warren_image_fetched_bytes_total"), 4096.0);
        assert_eq!(get(r#"warren_pool_idle_sandboxes{image="busybox"}"#), 2.0);
        assert_eq!(get(r#"warren_project_sandboxes{project="prj-a",backend="container",state="running"}"#), 2.0);
        assert_eq!(get(r#"warren_project_sandboxes{project="prj-a",backend="container",state="paused"}"#), 1.0);
        assert_eq!(get("warren_node_used_sandboxes"), 3.0);
        assert_eq!(get("warren_node_used_cpus"), 1.5);
        assert!(get("warren_node_capacity_memory_bytes") > 0.0);

        drop(creating);
        let text = m.encode(&levels, Format::OpenMetrics);
        assert_eq!(sample(&text, r#"warren_sandboxes{backend="container",state="creating"}"#), Some(0.0));
        assert!(text.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF");
        assert_eq!(m.creations(), (2, 1));
        assert_eq!(m.ends()[&EndReason::IdleTimeout], 1);
    }
}

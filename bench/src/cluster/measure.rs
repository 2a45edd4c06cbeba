//! The measures: sequential create latency (targets interleaved round by
//! round), sustained create+delete cycles (windows cut into slices the
//! targets take in turn), placement decisions in process, and etcd's
//! revision count around a burst of creates. Percentiles are nearest-rank.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use warren_api::{Backend, NodeBooks, NodeStatus};
use warren_cluster::placement::{self, Ask, Candidate};

use crate::Res;

/// Every sandbox the benchmark makes.
pub fn sandbox_body() -> Value {
    json!({"image": crate::IMAGE, "memory_mib": 64, "disk_mib": 16})
}

/// Somewhere creates are sent: one or more base URLs (used in turn) and
/// the client to send them with (a node's carries the cluster token).
#[derive(Clone)]
pub struct Target {
    pub name: &'static str,
    pub urls: Vec<String>,
    pub http: reqwest::Client,
}

/// One `POST /v1/sandboxes`; the new sandbox's id.
pub async fn create(http: &reqwest::Client, base: &str, body: &Value) -> Res<String> {
    let resp = http.post(format!("{base}/v1/sandboxes")).json(body).send().await.map_err(|e| format!("{base}: {e}"))?;
    let status = resp.status();
    let v: Value = resp.json().await.map_err(|e| format!("{base}: {e}"))?;
    if !status.is_success() {
        return Err(format!("create on {base}: {status}: {v}"));
    }
    v["id"].as_str().map(str::to_string).ok_or_else(|| format!("create on {base}: no id in {v}"))
}

pub async fn delete(http: &reqwest::Client, base: &str, id: &str) -> Res<()> {
    let resp = http.delete(format!("{base}/v1/sandboxes/{id}")).send().await.map_err(|e| format!("{base}: {e}"))?;
    match resp.status().is_success() {
        true => Ok(()),
        false => Err(format!("delete {id} on {base}: {}: {}", resp.status(), resp.text().await.unwrap_or_default())),
    }
}

#[derive(Debug, Clone, Default)]
pub struct Latencies(pub Vec<Duration>);

impl Latencies {
    pub fn pct(&self, p: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        if v.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
        v[rank.min(v.len()) - 1]
    }

    pub fn mean(&self) -> Duration {
        match self.0.len() {
            0 => Duration::ZERO,
            n => self.0.iter().sum::<Duration>() / n as u32,
        }
    }
}

/// Host CPU time, from the first line of `/proc/stat` (busy, total ticks).
pub fn cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    let total: u64 = fields.iter().sum();
    // idle + iowait are not busy.
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// CPUs busy on average between two [`cpu_ticks`] readings.
pub fn cpus_busy(before: (u64, u64), after: (u64, u64), cores: usize) -> f64 {
    let total = after.1.saturating_sub(before.1).max(1) as f64;
    after.0.saturating_sub(before.0) as f64 / total * cores as f64
}

/// Sequential creates (timed) each followed by its delete (not timed),
/// `samples` per target after 5 warm-up cycles each, the targets
/// interleaved one sample each per round with the first rotating, so
/// every target is measured under the same background load. Within a
/// target its URLs are taken in turn.
pub async fn sequential_creates(targets: &[Target], samples: usize) -> Res<(Vec<Latencies>, f64)> {
    let body = sandbox_body();
    let mut out = vec![Latencies::default(); targets.len()];
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let before = cpu_ticks();
    for round in 0..samples + 5 {
        for k in 0..targets.len() {
            let i = (round + k) % targets.len();
            let t = &targets[i];
            let base = &t.urls[round % t.urls.len()];
            let start = Instant::now();
            let id = create(&t.http, base, &body).await?;
            let took = start.elapsed();
            delete(&t.http, base, &id).await?;
            if round >= 5 {
                out[i].0.push(took);
            }
        }
    }
    Ok((out, cpus_busy(before, cpu_ticks(), cores)))
}

/// What one throughput target did.
#[derive(Debug, Clone, Default)]
pub struct Rate {
    pub ok: u64,
    pub failed: u64,
    pub secs: f64,
    pub first_error: Option<String>,
    /// CPUs busy, averaged over its slices.
    pub cpus_busy: f64,
}

impl Rate {
    pub fn per_sec(&self) -> f64 {
        self.ok as f64 / self.secs.max(f64::MIN_POSITIVE)
    }
}

/// `clients` concurrent create+delete loops per target for `secs` seconds
/// in all, cut into `slices` slices the targets take in turn (the first
/// rotating). Client `c` uses the target's URL `c % urls`.
pub async fn sustained(targets: &[Target], clients: usize, secs: f64, slices: usize) -> Res<Vec<Rate>> {
    let mut rates = vec![Rate::default(); targets.len()];
    let slice = Duration::from_secs_f64(secs / slices.max(1) as f64);
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    for s in 0..slices.max(1) {
        for k in 0..targets.len() {
            let i = (s + k) % targets.len();
            let before = cpu_ticks();
            let (ok, failed, took, err) = window(&targets[i], clients, slice).await?;
            let r = &mut rates[i];
            r.cpus_busy += cpus_busy(before, cpu_ticks(), cores) / slices.max(1) as f64;
            r.ok += ok;
            r.failed += failed;
            r.secs += took;
            if r.first_error.is_none() {
                r.first_error = err;
            }
        }
    }
    Ok(rates)
}

async fn window(t: &Target, clients: usize, length: Duration) -> Res<(u64, u64, f64, Option<String>)> {
    let start = Instant::now();
    let end = start + length;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (http, base) = (t.http.clone(), t.urls[c % t.urls.len()].clone());
        tasks.push(tokio::spawn(async move {
            let body = sandbox_body();
            let (mut ok, mut failed, mut err) = (0u64, 0u64, None);
            while Instant::now() < end {
                let r = match create(&http, &base, &body).await {
                    Ok(id) => delete(&http, &base, &id).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(()) => ok += 1,
                    Err(e) => {
                        failed += 1;
                        err.get_or_insert(e);
                    }
                }
            }
            (ok, failed, err)
        }));
    }
    let (mut ok, mut failed, mut err) = (0, 0, None);
    for task in tasks {
        let (o, f, e) = task.await.map_err(|e| e.to_string())?;
        ok += o;
        failed += f;
        if err.is_none() {
            err = e;
        }
    }
    // Cycles started before the end finish after it: count the whole time.
    Ok((ok, failed, start.elapsed().as_secs_f64(), err))
}

/// One placement size: decisions timed in process.
#[derive(Debug, Clone)]
pub struct PlacementRate {
    pub nodes: usize,
    pub decisions: u64,
    pub ns_per_decision: f64,
}

/// A small xorshift: placement only needs an index in `0..n`.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// `n` synthetic registrations: loads spread over 0-90% of 100 sandboxes,
/// every third node holding the image.
pub fn synthetic_nodes(n: usize) -> Vec<NodeStatus> {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15 ^ n as u64);
    (0..n)
        .map(|i| {
            let live = rng.below(91) as u64;
            NodeStatus {
                name: format!("n{i}"),
                url: format!("http://10.0.{}.{}:7070", i / 250, i % 250 + 1),
                backends: vec![Backend::Container],
                cpus: 32.0,
                memory_total_mib: 128 * 1024,
                disk_free_mib: 1024 * 1024,
                books: NodeBooks {
                    sandboxes_max: 100,
                    sandboxes_live: live,
                    sandboxes_paused: 0,
                    memory_mib_max: None,
                    memory_mib_committed: live * 512,
                    memory_mib_reclaimable: 0,
                    queue_waiting: 0,
                    queue_limit: 1024,
                },
                images: match i % 3 {
                    0 => vec![crate::IMAGE.to_string(), "default".into()],
                    _ => vec!["default".into()],
                },
                running_by_backend: BTreeMap::from([("container".to_string(), live)]),
                running_by_label: BTreeMap::new(),
                usage_by_project: BTreeMap::new(),
                heartbeat_at_ms: 0,
                started_at_ms: 0,
            }
        })
        .collect()
}

/// `placement::choose` over `n` synthetic nodes for about `secs` seconds
/// (at least 1000 decisions), as an API server calls it: the candidates
/// built from its node view, nothing excluded.
pub fn placement_rate(n: usize, secs: f64) -> Res<PlacementRate> {
    let nodes = synthetic_nodes(n);
    let ask = Ask { backend: Backend::Container, image: crate::IMAGE.into(), memory_mib: 64, disk_mib: 16 };
    let excluded = BTreeSet::new();
    let mut rng = XorShift(42);
    let budget = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut decisions = 0u64;
    loop {
        for _ in 0..64 {
            let candidates: Vec<Candidate<'_>> =
                nodes.iter().map(|node| Candidate { node, pending_sandboxes: 0, pending_memory_mib: 0 }).collect();
            let choice = placement::choose(&candidates, &ask, &excluded, &mut |len| rng.below(len))?;
            std::hint::black_box(choice);
            decisions += 1;
        }
        if decisions >= 1000 && start.elapsed() >= budget {
            break;
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / decisions as f64;
    Ok(PlacementRate { nodes: n, decisions, ns_per_decision: ns })
}

//! What one contender's run produced, measure by measure. The report is
//! rendered from these values only.

use std::time::Duration;

use crate::host::{CpuUse, MemSnapshot};
use crate::stats::{Failures, Latencies};

/// A measure's value with the host CPU it took.
#[derive(Debug, Clone)]
pub struct Measured<T> {
    pub value: T,
    pub cpu: CpuUse,
}

#[derive(Debug, Clone)]
pub enum Outcome<T> {
    Done(Measured<T>),
    /// Setup failed, so there are no samples; the message says why.
    Failed(String),
    /// Not applicable to this contender, or not asked for; says why.
    Skipped(String),
}

impl<T> Outcome<T> {
    pub fn done(&self) -> Option<&Measured<T>> {
        match self {
            Outcome::Done(m) => Some(m),
            _ => None,
        }
    }

    pub fn skipped(why: impl Into<String>) -> Self {
        Outcome::Skipped(why.into())
    }
}

/// Creations per second kept up by several clients for a while.
#[derive(Debug, Clone, Default)]
pub struct Sustained {
    pub clients: usize,
    pub elapsed: Duration,
    /// One sample per completed cycle; failures counted there too.
    pub cycles: Latencies,
}

impl Sustained {
    /// Adds a later slice of the same measure.
    pub fn merge(&mut self, slice: Sustained) {
        self.elapsed += slice.elapsed;
        self.cycles.merge(slice.cycles);
    }

    pub fn per_second(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs <= 0.0 {
            0.0
        } else {
            self.cycles.len() as f64 / secs
        }
    }
}

/// Host memory taken by many idle sandboxes.
#[derive(Debug, Clone, Default)]
pub struct IdleMemory {
    pub requested: usize,
    pub started: usize,
    pub start_failures: Failures,
    /// Host memory before any was started, with all of them idle, and after teardown.
    pub before: MemSnapshot,
    pub during: MemSnapshot,
    pub after: MemSnapshot,
    /// Sum of the sandboxes' memory cgroup usage, when it could be read.
    pub cgroup_bytes: Option<u64>,
    /// How the cgroup figure was read.
    pub cgroup_source: String,
    /// Other per-contender figures (label, value).
    pub extra: Vec<(String, String)>,
    /// Host CPU over a quiet window with all of them idle.
    pub idle_cpu: Option<CpuUse>,
    /// Cold create+exec+destroy cycles taken while all of them were held:
    /// what density does to a create (every mount a live sandbox leaves in
    /// the host's table, every cgroup, is there for the next one to meet).
    pub cold_while_held: Option<Latencies>,
    pub start_wall: Duration,
    pub stop_wall: Duration,
    pub stop_failures: Failures,
}

impl IdleMemory {
    fn per_sandbox(&self, bytes: i64) -> Option<f64> {
        (self.started > 0).then(|| bytes as f64 / self.started as f64)
    }

    /// MemAvailable before minus with all idle, per sandbox: the brief's figure.
    pub fn per_sandbox_drop(&self) -> Option<f64> {
        self.per_sandbox(self.before.available as i64 - self.during.available as i64)
    }

    /// The same against the level after teardown, which cancels drift that
    /// other processes caused while the sandboxes were being started.
    pub fn per_sandbox_drop_vs_after(&self) -> Option<f64> {
        self.per_sandbox(self.after.available as i64 - self.during.available as i64)
    }

    pub fn per_sandbox_kernel_pinned(&self) -> Option<f64> {
        self.per_sandbox(self.during.kernel_pinned as i64 - self.before.kernel_pinned as i64)
    }

    /// MemAvailable that had not come back after teardown (negative: more came back).
    pub fn not_returned_bytes(&self) -> i64 {
        self.before.available as i64 - self.after.available as i64
    }

    pub fn per_sandbox_cgroup(&self) -> Option<f64> {
        let bytes = self.cgroup_bytes?;
        (self.started > 0).then(|| bytes as f64 / self.started as f64)
    }
}

/// A figure that explains a measure. Its name starts with the measure's
/// (`cold`, `warm`), so the report shows it under that measure.
#[derive(Debug, Clone)]
pub struct Part {
    pub name: String,
    pub latencies: Outcome<Latencies>,
    /// False for one step of a cycle: the cycle's CPU cannot be split among its steps.
    pub own_cpu: bool,
}

/// One tool's results.
#[derive(Debug, Clone)]
pub struct Contender {
    pub name: String,
    pub version: String,
    /// Create + run `true` + destroy, by the tool's most direct route.
    pub cold: Outcome<Latencies>,
    /// Figures that explain a measure: its steps, or a second route to the same end.
    pub parts: Vec<Part>,
    /// Warm-pool claim + exec (Warren only).
    pub warm: Outcome<Latencies>,
    /// Exec of `true` in a running sandbox.
    pub exec: Outcome<Latencies>,
    pub sustained: Outcome<Sustained>,
    pub idle: Outcome<IdleMemory>,
    /// CPU of the contender's own long-lived process per operation, when it
    /// has one (Warren's server): (operation, CPU time).
    pub server_cpu: Vec<(String, Duration)>,
    /// (measure, exact command or request used).
    pub commands: Vec<(String, String)>,
    pub notes: Vec<String>,
}

impl Contender {
    pub fn server_cpu_per(&self, operation: &str) -> Option<Duration> {
        self.server_cpu.iter().find(|(op, _)| op == operation).map(|(_, d)| *d)
    }

    pub fn part(&self, name: &str) -> Option<&Latencies> {
        self.parts.iter().find(|p| p.name == name).and_then(|p| p.latencies.done()).map(|m| &m.value)
    }

    pub fn new(name: impl Into<String>, version: impl Into<String>) -> Self {
        Contender {
            name: name.into(),
            version: version.into(),
            cold: Outcome::skipped("not run"),
            parts: Vec::new(),
            warm: Outcome::skipped("no warm pool in this tool"),
            exec: Outcome::skipped("not run"),
            sustained: Outcome::skipped("not run"),
            idle: Outcome::skipped("not run"),
            server_cpu: Vec::new(),
            commands: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// How much to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Cold and warm cycles per contender.
    pub samples: usize,
    /// Unrecorded cycles first, so first-use effects (page cache, lazy init) stay out.
    pub warmup: usize,
    pub exec_samples: usize,
    pub sustain: Duration,
    pub clients: usize,
    pub idle: usize,
    /// Quiet window over which idle CPU is measured.
    pub idle_cpu_window: Duration,
    /// Wait after the idle sandboxes are up before memory is read.
    pub settle: Duration,
    pub pool_size: usize,
    /// Cold cycles taken while the idle sandboxes are held (after as many
    /// unrecorded ones as `warmup`).
    pub held_cold_samples: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_and_per_sandbox_figures_divide_by_what_happened() {
        let mut cycles = Latencies::default();
        for _ in 0..30 {
            cycles.push(Duration::from_millis(1));
        }
        let s = Sustained { clients: 2, elapsed: Duration::from_secs(3), cycles };
        assert!((s.per_second() - 10.0).abs() < 1e-9);
        let snap = |available, kernel_pinned| MemSnapshot { available, kernel_pinned };
        let idle = IdleMemory {
            started: 4,
            before: snap(10_000, 100),
            during: snap(5_904, 500),
            after: snap(9_000, 100),
            cgroup_bytes: Some(2048),
            ..Default::default()
        };
        assert_eq!(idle.per_sandbox_drop(), Some(1024.0));
        assert_eq!(idle.per_sandbox_drop_vs_after(), Some(774.0));
        assert_eq!(idle.per_sandbox_kernel_pinned(), Some(100.0));
        assert_eq!(idle.not_returned_bytes(), 1000);
        assert_eq!(idle.per_sandbox_cgroup(), Some(512.0));
        assert_eq!(IdleMemory::default().per_sandbox_drop(), None);
    }
}

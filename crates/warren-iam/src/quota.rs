//! Quota arithmetic, free of I/O: what a project's subtree holds, whether a
//! create fits every quota on its project's path, whether a delegation fits
//! what the parent has left to give, and the creation-rate bucket.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use warren_api::{Quota, QuotaKind, QuotaUse};

/// Floating point slack for CPU sums (0.1 + 0.2 must fit a quota of 0.3).
const CPU_EPSILON: f64 = 1e-9;

/// One live sandbox as quotas see it.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxUsage {
    pub project: String,
    pub cpus: f64,
    pub memory_mib: u64,
}

/// What a create (or a batch of `count` alike) asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Demand {
    pub count: u64,
    /// Per sandbox.
    pub cpus: f64,
    /// Per sandbox.
    pub memory_mib: u64,
}

impl Demand {
    pub fn one(cpus: f64, memory_mib: u64) -> Demand {
        Demand { count: 1, cpus, memory_mib }
    }

    fn total(&self, kind: QuotaKind) -> f64 {
        match kind {
            QuotaKind::Sandboxes | QuotaKind::CreatesPerSec => self.count as f64,
            QuotaKind::Cpus => self.cpus * self.count as f64,
            QuotaKind::MemoryMib => (self.memory_mib * self.count) as f64,
        }
    }
}

/// Why a create does not fit: `project`'s `kind` quota is `limit`, its
/// subtree holds `used`, and the create asks for `requested`.
#[derive(Debug, Clone, PartialEq)]
pub struct QuotaRefusal {
    pub project: String,
    pub kind: QuotaKind,
    pub limit: f64,
    pub used: f64,
    pub requested: f64,
    /// For `creates_per_sec`: when the bucket holds enough again.
    pub retry_after: Option<Duration>,
}

impl std::fmt::Display for QuotaRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            QuotaKind::CreatesPerSec => write!(
                f,
                "project {} may create {} sandboxes per second and has used its share for now",
                self.project, self.limit
            ),
            kind => write!(
                f,
                "project {} has a {} quota of {} and holds {}; this create asks for {} more",
                self.project,
                kind.as_str(),
                self.limit,
                self.used,
                self.requested
            ),
        }
    }
}

/// The limit of one dimension, as a number (`None`: no limit of its own).
pub fn limit_of(q: &Quota, kind: QuotaKind) -> Option<f64> {
    match kind {
        QuotaKind::Sandboxes => q.sandboxes.map(|v| v as f64),
        QuotaKind::Cpus => q.cpus,
        QuotaKind::MemoryMib => q.memory_mib.map(|v| v as f64),
        QuotaKind::CreatesPerSec => q.creates_per_sec.map(f64::from),
    }
}

fn used_of(u: &QuotaUse, kind: QuotaKind) -> f64 {
    match kind {
        QuotaKind::Sandboxes => u.sandboxes as f64,
        QuotaKind::Cpus => u.cpus,
        QuotaKind::MemoryMib => u.memory_mib as f64,
        QuotaKind::CreatesPerSec => 0.0,
    }
}

/// Adds `n` sandboxes of `cpus` and `memory_mib` each to `u`.
pub fn add_use(u: &mut QuotaUse, n: u64, cpus: f64, memory_mib: u64) {
    u.sandboxes += n;
    u.cpus += cpus * n as f64;
    u.memory_mib += memory_mib * n;
}

/// Each project's subtree use from `(project path, count, cpus, memory_mib)`
/// items: a sandbox counts for its project and every project above it.
pub fn subtree_use<'a>(
    sandboxes: impl IntoIterator<Item = (&'a [String], u64, f64, u64)>,
) -> HashMap<String, QuotaUse> {
    let mut out: HashMap<String, QuotaUse> = HashMap::new();
    for (path, n, cpus, memory_mib) in sandboxes {
        for project in path {
            add_use(out.entry(project.clone()).or_default(), n, cpus, memory_mib);
        }
    }
    out
}

/// Whether `demand` fits the concurrent quotas (sandboxes, cpus, memory) of
/// every project on `path`, given each project's subtree use. The refusal
/// names the deepest full project.
pub fn check_fit(
    path: &[(String, Quota)],
    usage: &HashMap<String, QuotaUse>,
    demand: &Demand,
) -> Result<(), QuotaRefusal> {
    let none = QuotaUse::default();
    for (project, quota) in path.iter().rev() {
        let used = usage.get(project).unwrap_or(&none);
        for kind in [QuotaKind::Sandboxes, QuotaKind::Cpus, QuotaKind::MemoryMib] {
            let Some(limit) = limit_of(quota, kind) else { continue };
            let (now, asked) = (used_of(used, kind), demand.total(kind));
            if now + asked > limit + CPU_EPSILON {
                return Err(QuotaRefusal {
                    project: project.clone(),
                    kind,
                    limit,
                    used: now,
                    requested: asked,
                    retry_after: None,
                });
            }
        }
    }
    Ok(())
}

/// Whether `demand` could ever fit `path`'s quotas (with nothing else
/// running): a create that cannot is refused at once, never queued.
pub fn check_possible(path: &[(String, Quota)], demand: &Demand) -> Result<(), QuotaRefusal> {
    check_fit(path, &HashMap::new(), demand)
}

/// Whether a child of `parent` may get `child` while the parent's other
/// children hold `delegated` in all: per dimension the parent limits, the
/// child must set a limit, and the children's sum must stay within the
/// parent's. Where the parent has no limit, the child may set any.
pub fn check_delegation(parent: &Quota, delegated: &Quota, child: &Quota) -> Result<(), (QuotaKind, String)> {
    for kind in QuotaKind::ALL {
        let wanted = limit_of(child, kind);
        if let Some(v) = wanted {
            if !v.is_finite() || v < 0.0 {
                return Err((kind, "must be a finite number of at least 0".into()));
            }
        }
        let Some(limit) = limit_of(parent, kind) else { continue };
        let given = limit_of(delegated, kind).unwrap_or(0.0);
        let left = (limit - given).max(0.0);
        match wanted {
            None => {
                return Err((
                    kind,
                    format!("required: the parent project limits {} to {limit} ({left} left to give)", kind.as_str()),
                ))
            }
            Some(v) if v > left + CPU_EPSILON => {
                return Err((
                    kind,
                    format!(
                        "{v} is more than the parent project has left to give: its quota is {limit}, \
                         {given} of it is given to its other children"
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Adds `q` to the running sum `sum` (absent limits count as 0).
pub fn add_quota(sum: &mut Quota, q: &Quota) {
    if let Some(v) = q.sandboxes {
        sum.sandboxes = Some(sum.sandboxes.unwrap_or(0) + v);
    }
    if let Some(v) = q.cpus {
        sum.cpus = Some(sum.cpus.unwrap_or(0.0) + v);
    }
    if let Some(v) = q.memory_mib {
        sum.memory_mib = Some(sum.memory_mib.unwrap_or(0) + v);
    }
    if let Some(v) = q.creates_per_sec {
        sum.creates_per_sec = Some(sum.creates_per_sec.unwrap_or(0) + v);
    }
}

/// A token bucket holding at most one second's worth of creations (and at
/// least one). A batch may take more than the bucket holds once it is full:
/// the bucket goes into debt, so the average rate still holds.
#[derive(Debug, Clone)]
pub struct RateBucket {
    rate_per_sec: f64,
    tokens: f64,
    at: Instant,
}

impl RateBucket {
    pub fn new(rate_per_sec: u32, now: Instant) -> RateBucket {
        let rate = f64::from(rate_per_sec);
        // A rate of 0 starts empty: such a project never creates.
        let tokens = if rate > 0.0 { rate.max(1.0) } else { 0.0 };
        RateBucket { rate_per_sec: rate, tokens, at: now }
    }

    fn capacity(&self) -> f64 {
        self.rate_per_sec.max(1.0)
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate_per_sec).min(self.capacity());
        self.at = now;
    }

    /// `Ok` when `count` creations may start now; otherwise how long until
    /// they may (`None`: never, the rate is 0).
    pub fn check(&mut self, count: u64, now: Instant) -> Result<(), Option<Duration>> {
        self.refill(now);
        let need = (count as f64).min(self.capacity());
        if self.tokens + CPU_EPSILON >= need {
            return Ok(());
        }
        if self.rate_per_sec <= 0.0 {
            return Err(None);
        }
        Err(Some(Duration::from_secs_f64((need - self.tokens) / self.rate_per_sec)))
    }

    /// Takes `count` tokens (after a successful [`RateBucket::check`]).
    pub fn take(&mut self, count: u64) {
        self.tokens -= count as f64;
    }

    /// Gives back tokens a create took but did not use (it was refused
    /// further down, or failed before it made anything).
    pub fn give_back(&mut self, count: u64) {
        self.tokens = (self.tokens + count as f64).min(self.capacity());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(sandboxes: Option<u64>, cpus: Option<f64>, memory_mib: Option<u64>, rate: Option<u32>) -> Quota {
        Quota { sandboxes, cpus, memory_mib, creates_per_sec: rate }
    }

    fn path(levels: &[(&str, Quota)]) -> Vec<(String, Quota)> {
        levels.iter().map(|(p, q)| (p.to_string(), q.clone())).collect()
    }

    #[test]
    fn a_create_fits_only_if_every_project_on_its_path_has_room() {
        let p = path(&[
            ("root", Quota::default()),
            ("a", q(Some(2), Some(2.0), None, None)),
            ("a1", q(None, None, Some(1024), None)),
        ]);
        let one = Demand::one(1.0, 512);
        let mut usage = HashMap::new();
        assert!(check_fit(&p, &usage, &one).is_ok());
        // a1 holds one sandbox: a1's memory has room for one more, a's cpus too.
        let a1_path = vec!["root".to_string(), "a".into(), "a1".into()];
        usage = subtree_use([(a1_path.as_slice(), 1, 1.0, 512)]);
        assert!(check_fit(&p, &usage, &one).is_ok());
        usage = subtree_use([(a1_path.as_slice(), 2, 1.0, 512)]);
        let refusal = check_fit(&p, &usage, &one).unwrap_err();
        // The deepest full project is named: a1's memory before a's count.
        assert_eq!((refusal.project.as_str(), refusal.kind), ("a1", QuotaKind::MemoryMib));
        assert_eq!((refusal.limit, refusal.used, refusal.requested), (1024.0, 1024.0, 512.0));
        // A sibling's sandboxes count against the shared parent.
        let a2_path = vec!["root".to_string(), "a".into(), "a2".into()];
        usage = subtree_use([(a2_path.as_slice(), 2, 0.5, 64)]);
        let refusal = check_fit(&p, &usage, &one).unwrap_err();
        assert_eq!((refusal.project.as_str(), refusal.kind), ("a", QuotaKind::Sandboxes));
    }

    #[test]
    fn cpu_sums_tolerate_rounding_but_not_excess() {
        let p = path(&[("p", q(None, Some(0.3), None, None))]);
        let usage = subtree_use([(&["p".to_string()][..], 1, 0.1, 1), (&["p".to_string()][..], 1, 0.1, 1)]);
        assert!(check_fit(&p, &usage, &Demand::one(0.1, 1)).is_ok());
        assert_eq!(check_fit(&p, &usage, &Demand::one(0.11, 1)).unwrap_err().kind, QuotaKind::Cpus);
    }

    #[test]
    fn a_create_larger_than_a_quota_is_impossible() {
        let p = path(&[("p", q(Some(10), Some(2.0), None, None))]);
        assert!(check_possible(&p, &Demand::one(2.0, 1)).is_ok());
        assert_eq!(check_possible(&p, &Demand::one(2.5, 1)).unwrap_err().kind, QuotaKind::Cpus);
        assert_eq!(
            check_possible(&p, &Demand { count: 11, cpus: 0.1, memory_mib: 1 }).unwrap_err().kind,
            QuotaKind::Sandboxes
        );
    }

    #[test]
    fn delegation_gives_only_what_the_parent_has_left() {
        let parent = q(Some(10), Some(4.0), None, Some(5));
        let mut delegated = Quota::default();
        add_quota(&mut delegated, &q(Some(6), Some(3.0), Some(1 << 20), Some(2)));
        // Within what is left: fine; memory is unlimited above, so any.
        assert!(check_delegation(&parent, &delegated, &q(Some(4), Some(1.0), Some(1 << 30), Some(3))).is_ok());
        // One sandbox too many.
        let (kind, _) = check_delegation(&parent, &delegated, &q(Some(5), Some(1.0), None, Some(1))).unwrap_err();
        assert_eq!(kind, QuotaKind::Sandboxes);
        // More than the parent's own quota, even with no siblings.
        let (kind, msg) =
            check_delegation(&parent, &Quota::default(), &q(Some(1), Some(4.5), None, Some(1))).unwrap_err();
        assert_eq!(kind, QuotaKind::Cpus);
        assert!(msg.contains("4.5"), "{msg}");
        // A limited parent's child must say how much it takes.
        let (kind, _) = check_delegation(&parent, &Quota::default(), &q(Some(1), Some(1.0), None, None)).unwrap_err();
        assert_eq!(kind, QuotaKind::CreatesPerSec);
        let (kind, _) =
            check_delegation(&Quota::default(), &Quota::default(), &q(None, Some(-1.0), None, None)).unwrap_err();
        assert_eq!(kind, QuotaKind::Cpus);
        // An unlimited parent gives anything.
        assert!(check_delegation(&Quota::default(), &delegated, &Quota::default()).is_ok());
    }

    #[test]
    fn the_rate_bucket_holds_one_second_and_refills() {
        let t0 = Instant::now();
        let mut b = RateBucket::new(2, t0);
        assert!(b.check(1, t0).is_ok());
        b.take(1);
        assert!(b.check(1, t0).is_ok());
        b.take(1);
        let wait = b.check(1, t0).unwrap_err().unwrap();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert!(b.check(1, t0 + Duration::from_millis(500)).is_ok());
        // Never more than a second's worth, however long it rested.
        let mut b = RateBucket::new(2, t0);
        assert!(b.check(3, t0 + Duration::from_secs(60)).is_ok());
        b.take(3);
        assert!(b.check(1, t0 + Duration::from_secs(60)).is_err());
        // A rate of 0 never admits.
        let mut zero = RateBucket::new(0, t0);
        assert_eq!(zero.check(1, t0 + Duration::from_secs(5)), Err(None));
    }
}

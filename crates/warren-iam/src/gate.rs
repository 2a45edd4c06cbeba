//! The quota gate: creates take room out of their project's quotas (and
//! every quota above it) before they start, and give it back when they are
//! done; a create with `queue` waits for room instead of being refused.
//!
//! What a project holds is the live sandboxes a [`UsageSource`] reports
//! plus the creates admitted here and not finished yet (a reservation).
//! Both are read under the gate's lock and a reservation is released only
//! after its sandbox is live (or failed), so a sandbox is never counted by
//! neither; it may briefly be counted by both, which only errs on the safe
//! side.
//!
//! Fairness: waiting creates are tried oldest first; a create that fits
//! lets an older waiting create of a project sharing a limited ancestor go
//! first when that one fits too, but one that does not fit (its own project
//! is full) blocks nobody, so a project at its limit never holds up another.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use warren_api::{Quota, QuotaKind, QuotaUse};

use crate::error::IamError;
use crate::quota::{add_use, check_fit, check_possible, Demand, QuotaRefusal, RateBucket, SandboxUsage};
use crate::Iam;

/// Waiters look again this often without a wake-up: room appears without a
/// call through here when a sandbox ends on its own (idle, lifetime, exit).
const RECHECK: Duration = Duration::from_millis(200);

/// Where the gate learns what runs: the node's live sandboxes in the
/// embedded server.
pub trait UsageSource: Send + Sync {
    fn live(&self) -> Vec<SandboxUsage>;
}

/// A project's path with each project's quota, root first.
pub(crate) type QuotaPath = Vec<(String, Quota)>;

pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: watch::Sender<u64>,
    queue_limit: usize,
}

#[derive(Default)]
struct GateState {
    next_id: u64,
    reserved: HashMap<u64, Reserved>,
    buckets: HashMap<String, RateBucket>,
    waiting: BTreeMap<u64, Waiting>,
}

struct Reserved {
    path: Vec<String>,
    demand: Demand,
}

struct Waiting {
    path: QuotaPath,
    demand: Demand,
}

enum Miss {
    Quota(QuotaRefusal),
    /// It fits, but an older waiting create that fits too goes first.
    Yield,
}

impl Gate {
    pub(crate) fn new(queue_limit: usize) -> Gate {
        Gate { state: Mutex::new(GateState::default()), changed: watch::channel(0).0, queue_limit }
    }

    fn state(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter to look again (a sandbox ended, a create finished).
    pub(crate) fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// How many creates wait now.
    pub(crate) fn waiting(&self) -> usize {
        self.state().waiting.len()
    }
}

/// Room taken out of a project's quotas until dropped (or, for a batch,
/// released item by item).
pub struct Admitted {
    iam: Iam,
    id: u64,
    project: String,
}

impl Admitted {
    pub fn project(&self) -> &str {
        &self.project
    }

    /// Gives back one sandbox's share (a batch item finished: it is live
    /// and counted as such, or it failed).
    pub fn release_one(&self) {
        let gate = &self.iam.inner.gate;
        {
            let mut state = gate.state();
            if let Some(r) = state.reserved.get_mut(&self.id) {
                r.demand.count = r.demand.count.saturating_sub(1);
            }
        }
        gate.bump();
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let gate = &self.iam.inner.gate;
        gate.state().reserved.remove(&self.id);
        gate.bump();
    }
}

/// Takes a waiting create off the list when its future is dropped.
struct InLine<'a> {
    gate: &'a Gate,
    ticket: u64,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.gate.state().waiting.remove(&self.ticket);
        self.gate.bump();
    }
}

impl Iam {
    /// Takes `demand` out of `project`'s quotas (and every quota above
    /// it). Without `queue` a create that does not fit is refused with
    /// [`IamError::QuotaExceeded`]; with it, it waits its turn. A create
    /// that could never fit (it alone is more than a quota) is refused
    /// either way.
    pub async fn admit(
        &self,
        project: &str,
        demand: Demand,
        source: &dyn UsageSource,
        queue: bool,
    ) -> Result<Admitted, IamError> {
        let path = self.quota_path(project)?;
        check_possible(&path, &demand).map_err(IamError::QuotaExceeded)?;
        if let Some((id, _)) = path.iter().find(|(_, q)| q.creates_per_sec == Some(0)) {
            return Err(IamError::QuotaExceeded(QuotaRefusal {
                project: id.clone(),
                kind: QuotaKind::CreatesPerSec,
                limit: 0.0,
                used: 0.0,
                requested: demand.count as f64,
                retry_after: None,
            }));
        }
        let gate = &self.inner.gate;
        if !queue {
            let mut state = gate.state();
            return match self.try_take(&mut state, None, &path, &demand, source) {
                Ok(id) => Ok(self.admitted(id, project)),
                Err(Miss::Quota(r)) => Err(IamError::QuotaExceeded(r)),
                // Only a waiting create yields; one that does not wait has no turn to give.
                Err(Miss::Yield) => Err(IamError::Internal("a create that does not wait yielded".into())),
            };
        }
        let ticket = {
            let mut state = gate.state();
            if state.waiting.len() >= gate.queue_limit {
                return Err(IamError::QueueFull { limit: gate.queue_limit });
            }
            let ticket = state.next_id;
            state.next_id += 1;
            state.waiting.insert(ticket, Waiting { path: path.clone(), demand });
            ticket
        };
        let _in_line = InLine { gate, ticket };
        let mut changed = gate.changed.subscribe();
        loop {
            let pause = {
                let mut state = gate.state();
                match self.try_take(&mut state, Some(ticket), &path, &demand, source) {
                    Ok(id) => return Ok(self.admitted(id, project)),
                    Err(Miss::Quota(r)) => r.retry_after.unwrap_or(RECHECK).min(RECHECK),
                    Err(Miss::Yield) => RECHECK,
                }
            };
            let _ = tokio::time::timeout(pause, changed.changed()).await;
        }
    }

    fn admitted(&self, id: u64, project: &str) -> Admitted {
        Admitted { iam: self.clone(), id, project: project.to_string() }
    }

    /// What every project's subtree holds now: live sandboxes plus the
    /// reservations of creates under way. Called under the gate's lock.
    fn holdings(&self, state: &GateState, source: &dyn UsageSource) -> HashMap<String, QuotaUse> {
        let mut out: HashMap<String, QuotaUse> = HashMap::new();
        for s in source.live() {
            for p in self.path_of(&s.project) {
                add_use(out.entry(p).or_default(), 1, s.cpus, s.memory_mib);
            }
        }
        for r in state.reserved.values() {
            for p in &r.path {
                add_use(out.entry(p.clone()).or_default(), r.demand.count, r.demand.cpus, r.demand.memory_mib);
            }
        }
        out
    }

    fn try_take(
        &self,
        state: &mut GateState,
        ticket: Option<u64>,
        path: &QuotaPath,
        demand: &Demand,
        source: &dyn UsageSource,
    ) -> Result<u64, Miss> {
        let holdings = self.holdings(state, source);
        let now = Instant::now();
        fits(state, &holdings, path, demand, now).map_err(Miss::Quota)?;
        if let Some(mine) = ticket {
            let older: Vec<(QuotaPath, Demand)> = state
                .waiting
                .range(..mine)
                .filter(|(_, w)| shares_a_limit(&w.path, path))
                .map(|(_, w)| (w.path.clone(), w.demand))
                .collect();
            if older.iter().any(|(p, d)| fits(state, &holdings, p, d, now).is_ok()) {
                return Err(Miss::Yield);
            }
        }
        for (project, quota) in path {
            if let Some(rate) = quota.creates_per_sec {
                state.buckets.entry(project.clone()).or_insert_with(|| RateBucket::new(rate, now)).take(demand.count);
            }
        }
        let id = state.next_id;
        state.next_id += 1;
        let names = path.iter().map(|(p, _)| p.clone()).collect();
        state.reserved.insert(id, Reserved { path: names, demand: *demand });
        Ok(id)
    }
}

/// Whether `demand` fits `path`'s concurrent quotas and creation rates now.
fn fits(
    state: &mut GateState,
    holdings: &HashMap<String, QuotaUse>,
    path: &QuotaPath,
    demand: &Demand,
    now: Instant,
) -> Result<(), QuotaRefusal> {
    check_fit(path, holdings, demand)?;
    for (project, quota) in path.iter().rev() {
        let Some(rate) = quota.creates_per_sec else { continue };
        let bucket = state.buckets.entry(project.clone()).or_insert_with(|| RateBucket::new(rate, now));
        if let Err(wait) = bucket.check(demand.count, now) {
            return Err(QuotaRefusal {
                project: project.clone(),
                kind: QuotaKind::CreatesPerSec,
                limit: f64::from(rate),
                used: 0.0,
                requested: demand.count as f64,
                retry_after: wait,
            });
        }
    }
    Ok(())
}

/// Whether two paths meet at a project with any limit: only then can one
/// create's room be another's.
fn shares_a_limit(a: &QuotaPath, b: &QuotaPath) -> bool {
    a.iter().any(|(p, q)| *q != Quota::default() && b.iter().any(|(o, _)| o == p))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::tests::{iam_in, project};
    use crate::Caller;

    /// A node stand-in: the sandboxes "live" are whatever the test says.
    #[derive(Default)]
    struct Live(Mutex<Vec<SandboxUsage>>);

    impl UsageSource for Live {
        fn live(&self) -> Vec<SandboxUsage> {
            self.0.lock().unwrap().clone()
        }
    }

    impl Live {
        fn add(&self, project: &str, cpus: f64, memory_mib: u64) {
            self.0.lock().unwrap().push(SandboxUsage { project: project.into(), cpus, memory_mib });
        }
        fn clear(&self) {
            self.0.lock().unwrap().clear();
        }
    }

    #[tokio::test]
    async fn reservations_count_until_released_and_the_live_sandbox_takes_over() {
        let (_dir, iam) = iam_in();
        let a = project(&iam, &Caller::root(), "a", Quota { sandboxes: Some(2), ..Quota::default() });
        let live = Live::default();
        let one = Demand::one(1.0, 64);
        let first = iam.admit(&a.id, one, &live, false).await.unwrap();
        let second = iam.admit(&a.id, one, &live, false).await.unwrap();
        let refused = iam.admit(&a.id, one, &live, false).await.err().unwrap();
        assert!(matches!(refused, IamError::QuotaExceeded(ref r) if r.kind == QuotaKind::Sandboxes), "{refused:?}");
        // The first create finished: its sandbox is live, the reservation goes.
        live.add(&a.id, 1.0, 64);
        drop(first);
        assert!(iam.admit(&a.id, one, &live, false).await.is_err());
        // The second failed: its room comes back.
        drop(second);
        assert!(iam.admit(&a.id, one, &live, false).await.is_ok());
    }

    #[tokio::test]
    async fn a_queued_create_waits_for_room_and_an_impossible_one_is_refused_at_once() {
        let (_dir, iam) = iam_in();
        let a = project(&iam, &Caller::root(), "a", Quota { cpus: Some(2.0), ..Quota::default() });
        let live = Arc::new(Live::default());
        live.add(&a.id, 2.0, 64);
        let too_big = iam.admit(&a.id, Demand::one(3.0, 64), live.as_ref(), true).await.err().unwrap();
        assert!(matches!(too_big, IamError::QuotaExceeded(ref r) if r.kind == QuotaKind::Cpus));
        let waiter = {
            let (iam, live, id) = (iam.clone(), Arc::clone(&live), a.id.clone());
            tokio::spawn(async move { iam.admit(&id, Demand::one(1.0, 64), live.as_ref(), true).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        assert_eq!(iam.inner.gate.waiting(), 1);
        live.clear();
        iam.inner.gate.bump();
        waiter.await.unwrap().unwrap();
        assert_eq!(iam.inner.gate.waiting(), 0);
    }

    #[tokio::test]
    async fn a_full_project_does_not_hold_up_its_sibling_in_the_queue() {
        let (_dir, iam) = iam_in();
        let root = Caller::root();
        let parent = project(&iam, &root, "p", Quota { sandboxes: Some(4), ..Quota::default() });
        let owner = Caller { project: parent.id.clone(), key_id: None };
        let full = project(&iam, &owner, "full", Quota { sandboxes: Some(1), ..Quota::default() });
        let free = project(&iam, &owner, "free", Quota { sandboxes: Some(3), ..Quota::default() });
        let live = Arc::new(Live::default());
        live.add(&full.id, 1.0, 64);
        let blocked = {
            let (iam, live, id) = (iam.clone(), Arc::clone(&live), full.id.clone());
            tokio::spawn(async move { iam.admit(&id, Demand::one(1.0, 64), live.as_ref(), true).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        // The older waiter of `full` cannot go; `free`'s create does not wait behind it.
        let admitted = tokio::time::timeout(
            Duration::from_secs(5),
            iam.admit(&free.id, Demand::one(1.0, 64), live.as_ref(), true),
        )
        .await
        .expect("the sibling was held up")
        .unwrap();
        assert_eq!(admitted.project(), free.id);
        blocked.abort();
    }

    #[tokio::test]
    async fn the_creation_rate_is_enforced_on_every_level() {
        let (_dir, iam) = iam_in();
        let a = project(&iam, &Caller::root(), "a", Quota { creates_per_sec: Some(2), ..Quota::default() });
        let live = Live::default();
        let one = Demand::one(0.1, 8);
        let _k1 = iam.admit(&a.id, one, &live, false).await.unwrap();
        let _k2 = iam.admit(&a.id, one, &live, false).await.unwrap();
        let refused = iam.admit(&a.id, one, &live, false).await.err().unwrap();
        match refused {
            IamError::QuotaExceeded(r) => {
                assert_eq!(r.kind, QuotaKind::CreatesPerSec);
                assert!(r.retry_after.is_some_and(|d| d <= Duration::from_millis(500)), "{r:?}");
            }
            other => panic!("{other:?}"),
        }
        // Queued, it waits for the bucket instead.
        let _k3 =
            tokio::time::timeout(Duration::from_secs(5), iam.admit(&a.id, one, &live, true)).await.unwrap().unwrap();
        let zero = project(&iam, &Caller::root(), "z", Quota { creates_per_sec: Some(0), ..Quota::default() });
        assert!(matches!(iam.admit(&zero.id, one, &live, true).await, Err(IamError::QuotaExceeded(_))));
    }

    #[tokio::test]
    async fn the_waiting_line_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(warren_store::RedbStore::open(dir.path().join("state.redb")).unwrap());
        let iam = Iam::open_with(store, 1).unwrap();
        let a = project(&iam, &Caller::root(), "a", Quota { sandboxes: Some(0), ..Quota::default() });
        let b = project(&iam, &Caller::root(), "b", Quota { sandboxes: Some(1), ..Quota::default() });
        let live = Arc::new(Live::default());
        live.add(&b.id, 1.0, 1);
        let waiter = {
            let (iam, live, id) = (iam.clone(), Arc::clone(&live), b.id.clone());
            tokio::spawn(async move { iam.admit(&id, Demand::one(1.0, 1), live.as_ref(), true).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        let refused = iam.admit(&b.id, Demand::one(1.0, 1), live.as_ref(), true).await.err().unwrap();
        assert!(matches!(refused, IamError::QueueFull { limit: 1 }), "{refused:?}");
        // A quota of 0 can never fit: refused, not queued.
        assert!(matches!(
            iam.admit(&a.id, Demand::one(1.0, 1), live.as_ref(), true).await,
            Err(IamError::QuotaExceeded(_))
        ));
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(iam.inner.gate.waiting(), 0, "an abandoned waiter leaves the line");
    }
}

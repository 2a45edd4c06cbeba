//! The line of creates waiting for room (`?queue=true`) on one API server,
//! fair across projects: each project's creates wait in their own FIFO,
//! and only a project's head tries to place. Projects take room in turns:
//! each counts the creates it placed while waiting, and only the projects
//! that placed the fewest may try, so when room frees one sandbox at a
//! time, a project that queued a thousand creates and one that queued one
//! get it alternately. A project joining the line starts level with the
//! least served one (it does not jump ahead of the others' earlier turns).
//!
//! Backfill: when no create of the line was placed for [`BACKFILL_AFTER`]
//! (the least served projects' heads do not fit, e.g. they ask for more
//! memory than any node has free), every head may try, so a big create
//! cannot hold room that smaller ones of other projects would use.
//!
//! The line is bounded as a whole ([`FairLine::join`] refuses past the
//! limit). It is per API server: two servers' lines do not know each
//! other, so the fairness holds among the creates each server holds.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How long the line may go without placing anything before every
/// project's head may try, not only the least served ones'.
pub const BACKFILL_AFTER: Duration = Duration::from_secs(5);

/// See the module doc.
pub struct FairLine {
    limit: usize,
    state: Mutex<LineState>,
    /// Bumped on every change of who may try, so waiters look again.
    changed: watch::Sender<u64>,
}

struct LineState {
    next_ticket: u64,
    projects: HashMap<String, ProjectLine>,
    len: usize,
    /// When a create of the line was last placed (or the line started).
    last_progress: Instant,
}

#[derive(Default)]
struct ProjectLine {
    /// Waiting tickets in arrival order.
    tickets: VecDeque<u64>,
    /// Creates placed while the project waited (see the module doc).
    served: u64,
}

impl LineState {
    fn least_served(&self) -> Option<u64> {
        self.projects.values().map(|p| p.served).min()
    }

    fn may_try(&self, project: &str, ticket: u64, now: Instant) -> bool {
        let Some(line) = self.projects.get(project) else { return false };
        if line.tickets.front() != Some(&ticket) {
            return false;
        }
        Some(line.served) == self.least_served() || now.duration_since(self.last_progress) >= BACKFILL_AFTER
    }
}

/// One create's place in the line; leaving the line is dropping it, after
/// [`Place::placed`] when it was placed.
pub struct Place {
    line: Arc<FairLine>,
    project: String,
    ticket: u64,
    changes: watch::Receiver<u64>,
    last_try: Option<Instant>,
    placed: bool,
}

impl FairLine {
    pub fn new(limit: usize) -> Arc<FairLine> {
        let state = LineState { next_ticket: 0, projects: HashMap::new(), len: 0, last_progress: Instant::now() };
        Arc::new(FairLine { limit, state: Mutex::new(state), changed: watch::channel(0).0 })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Creates waiting now.
    pub fn len(&self) -> usize {
        self.state().len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A place at the back of `project`'s line, with the whole line's
    /// length counting it; `None` when the line is full.
    pub fn join(self: &Arc<Self>, project: &str) -> Option<(Place, usize)> {
        let mut state = self.state();
        if state.len >= self.limit {
            return None;
        }
        if state.len == 0 {
            state.last_progress = Instant::now();
        }
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.len += 1;
        let level = state.least_served().unwrap_or(0);
        let line = state
            .projects
            .entry(project.to_string())
            .or_insert_with(|| ProjectLine { served: level, ..Default::default() });
        line.tickets.push_back(ticket);
        let len = state.len;
        drop(state);
        let place = Place {
            line: Arc::clone(self),
            project: project.to_string(),
            ticket,
            changes: self.changed.subscribe(),
            last_try: None,
            placed: false,
        };
        self.bump();
        Some((place, len))
    }
}

impl Place {
    /// Whether this create may try to place now.
    pub fn may_try(&self) -> bool {
        self.line.state().may_try(&self.project, self.ticket, Instant::now())
    }

    /// Waits until this create may try, and until at least `spacing` has
    /// passed since its last try (so a create that may try again at once
    /// does not spin).
    pub async fn wait_turn(&mut self, spacing: Duration) {
        loop {
            self.changes.borrow_and_update();
            if self.may_try() {
                break;
            }
            // The periodic look is a backstop (and how backfill opens); a
            // change of who may try wakes it first.
            let _ = tokio::time::timeout(spacing, self.changes.changed()).await;
        }
        if let Some(last) = self.last_try {
            tokio::time::sleep_until(last + spacing).await;
        }
        self.last_try = Some(Instant::now());
    }

    /// This create was placed: its project counts one more turn taken.
    pub fn placed(&mut self) {
        self.placed = true;
    }
}

impl Drop for Place {
    /// Placed, refused or given up: the create leaves the line.
    fn drop(&mut self) {
        let mut state = self.line.state();
        state.len = state.len.saturating_sub(1);
        if self.placed {
            state.last_progress = Instant::now();
        }
        let now_empty = match state.projects.get_mut(&self.project) {
            Some(line) => {
                line.tickets.retain(|t| *t != self.ticket);
                line.served += u64::from(self.placed);
                line.tickets.is_empty()
            }
            None => false,
        };
        if now_empty {
            state.projects.remove(&self.project);
        }
        drop(state);
        self.line.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tries(places: &[&Place]) -> Vec<bool> {
        places.iter().map(|p| p.may_try()).collect()
    }

    fn placed(mut place: Place) {
        place.placed();
    }

    #[tokio::test]
    async fn only_heads_of_the_least_served_projects_may_try() {
        let line = FairLine::new(10);
        let (a1, n) = line.join("a").expect("room");
        assert_eq!(n, 1);
        let (a2, _) = line.join("a").expect("room");
        let (b1, n) = line.join("b").expect("room");
        assert_eq!(n, 3);
        assert_eq!(tries(&[&a1, &a2, &b1]), [true, false, true], "both heads, level");
        placed(a1);
        assert_eq!(tries(&[&a2, &b1]), [false, true], "a took a turn: b's go");
        placed(b1);
        assert!(a2.may_try(), "b is done: a goes on");
    }

    #[tokio::test]
    async fn a_project_with_many_waiting_takes_turns_with_one_that_has_few() {
        let line = FairLine::new(100);
        let mut big: VecDeque<Place> = (0..5).map(|_| line.join("big").expect("room").0).collect();
        let (small1, _) = line.join("small").expect("room");
        let (small2, _) = line.join("small").expect("room");
        placed(big.pop_front().expect("a place"));
        assert!(!big[0].may_try() && small1.may_try());
        placed(small1);
        assert!(big[0].may_try() && small2.may_try(), "level again");
        placed(big.pop_front().expect("a place"));
        assert!(!big[0].may_try() && small2.may_try());
        // A newcomer starts level with the least served, not at zero.
        let (late, _) = line.join("late").expect("room");
        assert!(late.may_try() && small2.may_try() && !big[0].may_try());
        assert_eq!(line.len(), 5);
    }

    #[tokio::test]
    async fn a_create_that_gives_up_takes_no_turn_and_leaves_no_trace() {
        let line = FairLine::new(2);
        let (a1, _) = line.join("a").expect("room");
        let (b1, _) = line.join("b").expect("room");
        assert!(line.join("c").is_none(), "the line is bounded as a whole");
        drop(b1); // gave up
        assert!(a1.may_try());
        let (c1, n) = line.join("c").expect("room again");
        assert_eq!(n, 2);
        drop(a1);
        assert!(c1.may_try());
        drop(c1);
        assert!(line.is_empty());
        assert!(line.state().projects.is_empty());
    }

    #[tokio::test]
    async fn every_head_may_try_when_the_line_makes_no_progress() {
        let line = FairLine::new(10);
        let (a1, _) = line.join("a").expect("room");
        let (b1, _) = line.join("b").expect("room");
        let (a2, _) = line.join("a").expect("room");
        placed(a1);
        assert!(!a2.may_try() && b1.may_try(), "b's turn");
        let later = Instant::now() + BACKFILL_AFTER;
        assert!(line.state().may_try("a", a2.ticket, later), "b's head placed nothing for a while: a may backfill");
    }

    #[tokio::test]
    async fn a_waiter_wakes_when_it_may_try() {
        let line = FairLine::new(10);
        let (a1, _) = line.join("a").expect("room");
        let (mut a2, _) = line.join("a").expect("room");
        let waiter = tokio::spawn(async move {
            a2.wait_turn(Duration::from_secs(3600)).await;
            a2.may_try()
        });
        tokio::task::yield_now().await;
        drop(a1);
        let woke = tokio::time::timeout(Duration::from_secs(30), waiter).await.expect("woken").expect("joined");
        assert!(woke);
    }
}

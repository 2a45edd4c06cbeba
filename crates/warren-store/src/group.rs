//! Group commit for the embedded store: writers that arrive while a commit
//! is in flight are committed together in the next transaction, so N
//! concurrent writers pay for one device sync instead of queueing for N.
//!
//! The first writer to find no commit in flight leads: it takes every queued
//! operation, runs them in arrival order in one transaction, commits, hands
//! each writer its outcome and returns; a writer still queued then leads the
//! next group. A writer alone pays exactly what it did without grouping (one
//! transaction, one sync). Operations of one group succeed or fail together:
//! a failed commit (or an operation the backend refuses) fails the whole
//! group, and none of it is applied.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::error::{Result, StoreError};
use crate::store::{Table, Write};

/// One writer's operation.
pub(crate) enum Op {
    Apply(Vec<Write>),
    PutIfAbsent { table: Table, key: String, value: Vec<u8>, also: Vec<Write> },
    Delete { table: Table, key: String },
    DeletePrefix { table: Table, prefix: String },
}

/// What an [`Op`] found, as its trait method returns it.
#[derive(Debug)]
pub(crate) enum Outcome {
    Done,
    Existing(Option<Vec<u8>>),
    Existed(bool),
    Removed(u64),
}

#[derive(Default)]
struct State {
    next_ticket: u64,
    queue: Vec<(u64, Op)>,
    leading: bool,
    done: HashMap<u64, Result<Outcome>>,
}

#[derive(Default)]
pub(crate) struct Group {
    state: Mutex<State>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `op` and returns its outcome once its group has committed.
    /// `run` executes one group in one transaction, an outcome per op.
    pub(crate) fn submit(&self, op: Op, run: impl Fn(&[Op]) -> Result<Vec<Outcome>>) -> Result<Outcome> {
        let mut st = self.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        st.queue.push((ticket, op));
        loop {
            if let Some(outcome) = st.done.remove(&ticket) {
                return outcome;
            }
            if !st.leading {
                break;
            }
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        // Lead one group: everything queued by now, this op included.
        st.leading = true;
        let batch = std::mem::take(&mut st.queue);
        drop(st);
        let (tickets, ops): (Vec<u64>, Vec<Op>) = batch.into_iter().unzip();
        let outcome = run(&ops);
        let mut st = self.lock();
        match outcome {
            Ok(outcomes) if outcomes.len() == tickets.len() => {
                st.done.extend(tickets.into_iter().zip(outcomes.into_iter().map(Ok)));
            }
            Ok(_) => {
                let e = StoreError::Backend("group commit returned the wrong number of outcomes".into());
                st.done.extend(tickets.into_iter().map(|t| (t, Err(duplicate(&e)))));
            }
            Err(e) => st.done.extend(tickets.into_iter().map(|t| (t, Err(duplicate(&e))))),
        }
        st.leading = false;
        let mine = st.done.remove(&ticket);
        drop(st);
        self.changed.notify_all();
        mine.unwrap_or_else(|| Err(StoreError::Backend("group commit lost an outcome".into())))
    }
}

/// The same error for every writer of a failed group.
fn duplicate(e: &StoreError) -> StoreError {
    match e {
        StoreError::Io(io) => StoreError::Io(std::io::Error::new(io.kind(), io.to_string())),
        StoreError::Corrupt(msg) => StoreError::Corrupt(msg.clone()),
        StoreError::Locked { path } => StoreError::Locked { path: path.clone() },
        other => StoreError::Backend(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    use super::*;

    fn put(key: &str) -> Op {
        Op::Apply(vec![Write::Put { table: Table::Meta, key: key.into(), value: Vec::new() }])
    }

    #[test]
    fn a_lone_writer_runs_its_own_group() {
        let group = Group::default();
        let runs = AtomicUsize::new(0);
        let out = group.submit(put("a"), |ops| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok(ops.iter().map(|_| Outcome::Existed(true)).collect())
        });
        assert!(matches!(out, Ok(Outcome::Existed(true))));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// Writers queued behind a slow commit share the next one, each gets
    /// its own outcome, and every op runs exactly once.
    #[test]
    fn concurrent_writers_share_commits_and_get_their_own_outcomes() {
        let group = Arc::new(Group::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let ran_ops = Arc::new(AtomicUsize::new(0));
        let writers = 8;
        let start = Arc::new(Barrier::new(writers));
        let handles: Vec<_> = (0..writers)
            .map(|i| {
                let (group, runs, ran_ops, start) =
                    (Arc::clone(&group), Arc::clone(&runs), Arc::clone(&ran_ops), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    let key = format!("k{i}");
                    let out = group.submit(Op::Delete { table: Table::Meta, key: key.clone() }, |ops| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        ran_ops.fetch_add(ops.len(), Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        Ok(ops
                            .iter()
                            .map(|op| match op {
                                Op::Delete { key, .. } => Outcome::Removed(key[1..].parse().unwrap_or(u64::MAX)),
                                _ => Outcome::Done,
                            })
                            .collect())
                    });
                    match out {
                        Ok(Outcome::Removed(n)) => assert_eq!(n, i as u64, "got another writer's outcome"),
                        other => panic!("unexpected outcome {other:?}"),
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(ran_ops.load(Ordering::SeqCst), writers, "an op ran twice or never");
        assert!(runs.load(Ordering::SeqCst) < writers, "no two writers shared a commit");
    }

    #[test]
    fn a_failed_group_fails_every_writer_in_it() {
        let group = Group::default();
        let out = group.submit(put("a"), |_| Err(StoreError::Io(std::io::Error::other("disk gone"))));
        match out {
            Err(StoreError::Io(e)) => assert!(e.to_string().contains("disk gone")),
            other => panic!("unexpected {other:?}"),
        }
        // The group is free again.
        assert!(matches!(
            group.submit(put("b"), |ops| Ok(ops.iter().map(|_| Outcome::Done).collect())),
            Ok(Outcome::Done)
        ));
    }
}

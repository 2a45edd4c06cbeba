//! Admission: whether a create fits the node now, and the bounded FIFO
//! queue of creates that wait for room.
//!
//! The books: live sandboxes (paused ones included) against
//! `max_sandboxes`, and the memory of running sandboxes plus creates under
//! way against `max_memory_mib` when set. A paused sandbox's memory is
//! *reclaimable* (its processes cannot touch it) and is not counted
//! against `max_memory_mib`; it still holds its sandbox slot. What a driver
//! runs beside the sandboxes (a VM snapshot template guest) reserves its
//! memory and CPUs here ([`DriverBooks`]): committed like a create under
//! way, without a sandbox slot.
//!
//! Invariants: waiting creates are admitted in arrival order (a create that
//! does not wait never overtakes one that does: with a queue it is refused);
//! a create that stops waiting (its caller went away) leaves the queue at
//! once; the queue never holds more than its limit.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;
use warren_api::{NodeBooks, SandboxState};
use warren_backend::{HostBooks, Reservation};

use crate::{Inner, Node, NodeError, Result};

/// Waiters look again this often even without a wake-up: room can appear
/// without a call through this module (a sandbox's init dies and the reaper
/// ends it a tick later).
const RECHECK: Duration = Duration::from_millis(250);

/// How a create meets a full node.
pub(crate) enum Admit<'a> {
    /// Refused at once with `capacity_exceeded` (and while others wait).
    Now,
    /// Waits in the queue; a batch passes the set its waiting items join.
    Queue(Option<&'a Waiters>),
}

pub(crate) struct Admission {
    limit: usize,
    books: Mutex<Books>,
    /// Bumped whenever the queue moves or room may have appeared.
    changed: watch::Sender<u64>,
}

#[derive(Default)]
struct Books {
    waiting: VecDeque<Waiter>,
    next_ticket: u64,
    /// Creates admitted and not finished yet, and their memory.
    creating: usize,
    creating_memory_mib: u64,
    /// Drivers' reservations ([`DriverBooks`]); CPUs in thousandths, so
    /// that releases subtract exactly what was added.
    reserved_memory_mib: u64,
    reserved_millicpus: u64,
}

struct Waiter {
    ticket: u64,
    sandbox_id: String,
}

/// The queue tickets of one batch's waiting items.
#[derive(Default)]
pub(crate) struct Waiters(Mutex<BTreeSet<u64>>);

impl Waiters {
    fn set(&self) -> std::sync::MutexGuard<'_, BTreeSet<u64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How many of them wait now.
    pub(crate) fn len(&self) -> usize {
        self.set().len()
    }
}

impl Admission {
    pub(crate) fn new(limit: usize) -> Admission {
        Admission { limit, books: Mutex::new(Books::default()), changed: watch::channel(0).0 }
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter to look at the books again.
    pub(crate) fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// True when one more create cannot join the queue.
    pub(crate) fn is_full(&self) -> bool {
        self.books().waiting.len() >= self.limit
    }

    /// Memory (MiB) and CPUs the drivers hold reserved now.
    pub(crate) fn reserved(&self) -> (u64, f64) {
        let books = self.books();
        (books.reserved_memory_mib, books.reserved_millicpus as f64 / 1000.0)
    }

    /// Whether the create of sandbox `id` waits in the queue now.
    pub(crate) fn is_waiting(&self, id: &str) -> bool {
        self.books().waiting.iter().any(|w| w.sandbox_id == id)
    }

    /// The 1-based queue position of the first of `waiters`, if any waits.
    pub(crate) fn position_of(&self, waiters: &Waiters) -> Option<u64> {
        let mine = waiters.set();
        let books = self.books();
        books.waiting.iter().position(|w| mine.contains(&w.ticket)).map(|i| i as u64 + 1)
    }
}

/// Counts one admitted create in the books until dropped.
pub(crate) struct Ticket<'a> {
    node: &'a Node,
    memory_mib: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let admission = &self.node.inner.admission;
        {
            let mut books = admission.books();
            books.creating -= 1;
            books.creating_memory_mib -= self.memory_mib;
        }
        self.node.inner.creating.fetch_sub(1, Ordering::SeqCst);
        admission.bump();
    }
}

/// Takes a waiting create out of the queue when its future is dropped
/// (admitted, or its caller went away).
struct InQueue<'a> {
    admission: &'a Admission,
    ticket: u64,
    waiters: Option<&'a Waiters>,
}

impl Drop for InQueue<'_> {
    fn drop(&mut self) {
        self.admission.books().waiting.retain(|w| w.ticket != self.ticket);
        if let Some(w) = self.waiters {
            w.set().remove(&self.ticket);
        }
        self.admission.bump();
    }
}

impl Node {
    /// Admits the create of sandbox `id` (asking for `memory_mib`), now or
    /// after waiting its turn, per `mode`.
    pub(crate) async fn admit(&self, id: &str, memory_mib: u64, mode: Admit<'_>) -> Result<Ticket<'_>> {
        let admission = &self.inner.admission;
        let (ticket, waiters) = {
            let mut books = admission.books();
            if books.waiting.is_empty() {
                match self.room_for(&books, memory_mib) {
                    Ok(()) => return Ok(self.take(&mut books, memory_mib)),
                    Err(e) if matches!(mode, Admit::Now) => return Err(e),
                    Err(_) => {}
                }
            }
            let waiters = match mode {
                // Others wait already: a create that cannot wait must not overtake them.
                Admit::Now => return Err(NodeError::Capacity(self.sandboxes_running())),
                Admit::Queue(waiters) => waiters,
            };
            if books.waiting.len() >= admission.limit {
                return Err(NodeError::AdmissionQueueFull { limit: admission.limit });
            }
            let ticket = books.next_ticket;
            books.next_ticket += 1;
            books.waiting.push_back(Waiter { ticket, sandbox_id: id.to_string() });
            if let Some(w) = waiters {
                w.set().insert(ticket);
            }
            (ticket, waiters)
        };
        let _in_queue = InQueue { admission, ticket, waiters };
        admission.bump();
        let mut changed = admission.subscribe();
        loop {
            {
                let mut books = admission.books();
                if books.waiting.front().is_some_and(|w| w.ticket == ticket)
                    && self.room_for(&books, memory_mib).is_ok()
                {
                    books.waiting.pop_front();
                    return Ok(self.take(&mut books, memory_mib));
                }
            }
            let _ = tokio::time::timeout(RECHECK, changed.changed()).await;
        }
    }

    fn take(&self, books: &mut Books, memory_mib: u64) -> Ticket<'_> {
        books.creating += 1;
        books.creating_memory_mib += memory_mib;
        self.inner.creating.fetch_add(1, Ordering::SeqCst);
        Ticket { node: self, memory_mib }
    }

    /// Whether one more create of `memory_mib` fits the books.
    fn room_for(&self, books: &Books, memory_mib: u64) -> Result<()> {
        let (live, _, committed, _) = self.live_books();
        if live + books.creating >= self.inner.cfg.max_sandboxes {
            return Err(NodeError::Capacity(live));
        }
        if !self.memory_fits(books, committed, memory_mib) {
            return Err(NodeError::Capacity(live));
        }
        Ok(())
    }

    /// Whether `memory_mib` more fits `max_memory_mib` beside `committed`
    /// (running sandboxes), the creates under way and the reservations.
    fn memory_fits(&self, books: &Books, committed: u64, memory_mib: u64) -> bool {
        self.inner
            .cfg
            .max_memory_mib
            .is_none_or(|max| committed + books.creating_memory_mib + books.reserved_memory_mib + memory_mib <= max)
    }

    /// Live sandboxes, paused ones among them, and the memory (MiB) of the
    /// running and of the paused ones.
    fn live_books(&self) -> (usize, usize, u64, u64) {
        let lives: Vec<_> = self.live_map().values().cloned().collect();
        let (mut paused, mut committed, mut reclaimable) = (0, 0, 0);
        for live in &lives {
            let rec = live.record();
            match rec.info.state {
                SandboxState::Paused => {
                    paused += 1;
                    reclaimable += rec.info.resources.memory_mib;
                }
                _ => committed += rec.info.resources.memory_mib,
            }
        }
        (lives.len(), paused, committed, reclaimable)
    }

    /// The node's capacity books (`GET /v1/capacity`).
    pub fn books(&self) -> NodeBooks {
        let (live, paused, committed, reclaimable) = self.live_books();
        let admission = &self.inner.admission;
        let books = admission.books();
        NodeBooks {
            sandboxes_max: self.inner.cfg.max_sandboxes as u64,
            sandboxes_live: live as u64,
            sandboxes_paused: paused as u64,
            memory_mib_max: self.inner.cfg.max_memory_mib,
            memory_mib_committed: committed + books.creating_memory_mib + books.reserved_memory_mib,
            memory_mib_reclaimable: reclaimable,
            queue_waiting: books.waiting.len() as u64,
            queue_limit: admission.limit as u64,
        }
    }
}

/// The books as the drivers see them ([`warren_backend::HostBooks`]). Holds
/// the node weakly: a driver keeps it, and the node keeps its drivers.
pub(crate) struct DriverBooks(pub(crate) Weak<Inner>);

impl HostBooks for DriverBooks {
    fn reserve(&self, memory_mib: u64, cpus: f64) -> Option<Reservation> {
        let node = Node { inner: self.0.upgrade()? };
        let millicpus = (cpus.max(0.0) * 1000.0).round() as u64;
        {
            let mut books = node.inner.admission.books();
            // No sandbox slot: a reservation is not a sandbox.
            let (_, _, committed, _) = node.live_books();
            if !books.waiting.is_empty() || !node.memory_fits(&books, committed, memory_mib) {
                return None;
            }
            books.reserved_memory_mib += memory_mib;
            books.reserved_millicpus += millicpus;
        }
        let inner = Arc::downgrade(&node.inner);
        Some(Reservation::new(Reserved { inner, memory_mib, millicpus }))
    }
}

/// Gives a driver's reservation back when dropped.
struct Reserved {
    inner: Weak<Inner>,
    memory_mib: u64,
    millicpus: u64,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        let Some(inner) = self.inner.upgrade() else { return };
        {
            let mut books = inner.admission.books();
            books.reserved_memory_mib -= self.memory_mib;
            books.reserved_millicpus -= self.millicpus;
        }
        inner.admission.bump();
    }
}

//! The sandbox's security events, kept in PID 1's memory (never in a file
//! the sandbox could read or change) until the host asks for them.
//!
//! A bounded ring: when it is full, the oldest event makes room, and a
//! reader that had not seen it learns how many it missed. Sequence numbers
//! start at 1 and never repeat, so the host asks for "everything after the
//! last one I saw" and needs no other state.

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard, PoisonError};

use warren_init::proto::SecurityEvent;

/// How many events PID 1 holds: far more than a host that polls every few
/// seconds needs, small enough (a few hundred KiB) to never matter.
pub const CAPACITY: usize = 1024;

/// What a reader gets: see `proto::Response::Events`.
#[derive(Debug, PartialEq, Eq)]
pub struct Batch {
    pub events: Vec<SecurityEvent>,
    pub dropped: u64,
    pub next_seq: u64,
}

pub struct EventLog {
    inner: Mutex<Ring>,
}

struct Ring {
    events: VecDeque<SecurityEvent>,
    capacity: usize,
    next_seq: u64,
}

impl EventLog {
    pub fn new(capacity: usize) -> EventLog {
        let ring = Ring { events: VecDeque::with_capacity(capacity), capacity: capacity.max(1), next_seq: 1 };
        EventLog { inner: Mutex::new(ring) }
    }

    fn lock(&self) -> MutexGuard<'_, Ring> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `event`, giving it the next sequence number (whatever its
    /// `seq` was).
    pub fn record(&self, mut event: SecurityEvent) {
        let mut ring = self.lock();
        event.seq = ring.next_seq;
        ring.next_seq += 1;
        if ring.events.len() == ring.capacity {
            ring.events.pop_front();
        }
        ring.events.push_back(event);
    }

    /// Every held event with `seq > after_seq`.
    pub fn after(&self, after_seq: u64) -> Batch {
        let ring = self.lock();
        let oldest_held = ring.events.front().map_or(ring.next_seq, |e| e.seq);
        let first_wanted = after_seq.saturating_add(1);
        Batch {
            events: ring.events.iter().filter(|e| e.seq >= first_wanted).cloned().collect(),
            dropped: oldest_held.saturating_sub(first_wanted),
            next_seq: ring.next_seq,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use warren_init::proto::SecurityEventKind;

    fn event(syscall: &str) -> SecurityEvent {
        SecurityEvent {
            seq: 0,
            time_ms: 1,
            pid: 2,
            comm: "x".into(),
            kind: SecurityEventKind::Seccomp,
            syscall: syscall.into(),
            detail: String::new(),
        }
    }

    fn seqs(batch: &Batch) -> Vec<u64> {
        batch.events.iter().map(|e| e.seq).collect()
    }

    #[test]
    fn events_are_numbered_from_one_and_read_after_a_cursor() {
        let log = EventLog::new(8);
        assert_eq!(log.after(0), Batch { events: vec![], dropped: 0, next_seq: 1 });
        for name in ["mount", "ptrace", "bpf"] {
            log.record(event(name));
        }
        let all = log.after(0);
        assert_eq!((seqs(&all), all.dropped, all.next_seq), (vec![1, 2, 3], 0, 4));
        assert_eq!(all.events[1].syscall, "ptrace");
        let newer = log.after(2);
        assert_eq!((seqs(&newer), newer.dropped), (vec![3], 0));
        assert_eq!(log.after(3).events, vec![]);
        assert_eq!(log.after(u64::MAX).dropped, 0, "a cursor from the future misses nothing");
    }

    #[test]
    fn a_full_ring_drops_the_oldest_and_tells_each_reader_what_it_missed() {
        let log = EventLog::new(4);
        for _ in 0..10 {
            log.record(event("mount"));
        }
        let all = log.after(0);
        assert_eq!((seqs(&all), all.dropped, all.next_seq), (vec![7, 8, 9, 10], 6, 11));
        let late = log.after(5);
        assert_eq!((seqs(&late), late.dropped), (vec![7, 8, 9, 10], 1));
        let current = log.after(8);
        assert_eq!((seqs(&current), current.dropped), (vec![9, 10], 0));
    }
}

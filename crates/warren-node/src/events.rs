//! Each live sandbox's security-event timeline: one bounded, totally
//! ordered ring that merges what init saw inside the sandbox (seccomp
//! refusals, pulled from init when a client asks) with what the node saw
//! from outside (blocked connections, refused names, limits hit, phase
//! changes - recorded the moment the node learns of them).
//!
//! `seq` follows the order in which the node learnt of events, which for
//! init's events is when they were pulled; `time_ms` is when each happened.

use std::collections::{BTreeMap, VecDeque};

use warren_api::{SecurityEvent, SecurityEventKind, SecurityEventList};

/// Events kept per sandbox; older ones are dropped (and counted).
pub const RING_CAPACITY: usize = 1024;

/// What a node-side observer reports; the timeline gives it its `seq`.
#[derive(Debug, Clone)]
pub struct Observed {
    pub kind: SecurityEventKind,
    /// The process inside the sandbox (its pid there), 0 if unknown.
    pub pid: i32,
    pub comm: String,
    pub syscall: String,
    pub detail: String,
    /// Unix time in milliseconds; 0 means now.
    pub time_ms: u64,
}

impl Observed {
    pub fn new(kind: SecurityEventKind, detail: impl Into<String>) -> Observed {
        Observed { kind, pid: 0, comm: String::new(), syscall: String::new(), detail: detail.into(), time_ms: 0 }
    }

    pub fn process(mut self, pid: i32, comm: impl Into<String>) -> Observed {
        self.pid = pid;
        self.comm = comm.into();
        self
    }
}

#[derive(Debug, Default)]
pub struct Timeline {
    ring: VecDeque<SecurityEvent>,
    /// `seq` of the last event appended (0: none yet).
    last_seq: u64,
    counts: BTreeMap<SecurityEventKind, u64>,
    /// Init's own `seq` of the last event pulled from it.
    pub init_seq_pulled: u64,
}

impl Timeline {
    pub fn push(&mut self, observed: Observed, now_ms: u64) {
        self.last_seq += 1;
        *self.counts.entry(observed.kind).or_default() += 1;
        if self.ring.len() == RING_CAPACITY {
            self.ring.pop_front();
        }
        self.ring.push_back(SecurityEvent {
            seq: self.last_seq,
            time_ms: if observed.time_ms == 0 { now_ms } else { observed.time_ms },
            pid: observed.pid,
            comm: observed.comm,
            kind: observed.kind,
            syscall: observed.syscall,
            detail: observed.detail,
        });
    }

    /// Counts init's events that were lost in init's own ring before the
    /// node pulled them.
    pub fn count_lost(&mut self, lost: u64) {
        self.last_seq += lost;
    }

    /// The kept events after `after_seq`, and how many of those are gone.
    pub fn after(&self, after_seq: u64) -> SecurityEventList {
        let events: Vec<SecurityEvent> = self.ring.iter().filter(|e| e.seq > after_seq).cloned().collect();
        let first_kept = events.first().map_or(self.last_seq + 1, |e| e.seq);
        SecurityEventList {
            dropped: first_kept.saturating_sub(after_seq + 1),
            events,
            next_seq: self.last_seq + 1,
            counts: self.counts.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_numbered_counted_and_bounded() {
        let mut t = Timeline::default();
        for i in 0..RING_CAPACITY + 10 {
            t.push(Observed::new(SecurityEventKind::NetworkBlocked, format!("{i}")), 5);
        }
        t.push(Observed::new(SecurityEventKind::PhaseChanged, "grade").process(7, "sh"), 6);
        let all = t.after(0);
        assert_eq!(all.events.len(), RING_CAPACITY);
        assert_eq!(all.dropped, 11);
        assert_eq!(all.next_seq, RING_CAPACITY as u64 + 12);
        assert_eq!(all.counts[&SecurityEventKind::NetworkBlocked], RING_CAPACITY as u64 + 10);
        let last = all.events.last().unwrap();
        assert_eq!((last.kind, last.pid, last.time_ms), (SecurityEventKind::PhaseChanged, 7, 6));
        let tail = t.after(all.next_seq - 2);
        assert_eq!((tail.events.len(), tail.dropped), (1, 0));
    }

    #[test]
    fn lost_init_events_show_as_dropped() {
        let mut t = Timeline::default();
        t.push(Observed::new(SecurityEventKind::Seccomp, "a"), 1);
        t.count_lost(3);
        t.push(Observed::new(SecurityEventKind::Seccomp, "b"), 1);
        let all = t.after(0);
        assert_eq!(all.events.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 5]);
        assert_eq!(all.dropped, 0, "gaps inside the kept range are not reported as a prefix drop");
        assert_eq!(t.after(1).dropped, 3);
    }
}

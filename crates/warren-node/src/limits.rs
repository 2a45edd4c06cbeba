//! Resource limits a sandbox ran into, seen from outside: the reaper reads
//! each sandbox's counters on its own ticks (no thread per sandbox) and a
//! rise, or a writable layer that has just become full, becomes one
//! `limit_hit` event whose detail starts with the create field of the limit
//! (`memory_mib`, `pids`, `disk_mib`, `inodes`).
//!
//! A full disk or inode table is a state, not a counter: the sandbox's own
//! `ENOSPC` is invisible from the host. The event fires when the layer
//! becomes full and again only after it had room once more. Full is less
//! than [`DISK_FULL_BELOW`] left: a VM's ext4 refuses a write with a few
//! blocks still free (the metadata the write itself would need).

use warren_api::{Resources, SecurityEventKind};
use warren_backend::LimitCounters;

use crate::events::Observed;

/// What the reaper saw last for one sandbox. A new sandbox starts from
/// zero, so a limit hit before the first look is still reported; so does a
/// re-adopted one, whose in-memory timeline the restart lost, so the hits
/// it had before are reported again once.
/// A writable layer with less than this many bytes available is full.
const DISK_FULL_BELOW: u64 = 64 << 10;

#[derive(Debug, Default)]
pub(crate) struct LimitWatch {
    seen: LimitCounters,
    disk_full: bool,
    inodes_full: bool,
}

impl LimitWatch {
    /// The events `now` shows since the last call.
    pub(crate) fn update(&mut self, now: LimitCounters, limits: &Resources) -> Vec<Observed> {
        let mut out = Vec::new();
        let hit = |detail: String| Observed::new(SecurityEventKind::LimitHit, detail);
        if now.oom_kills > self.seen.oom_kills {
            let n = now.oom_kills - self.seen.oom_kills;
            out.push(hit(format!(
                "memory_mib: the out-of-memory killer killed {n} process(es) at the {} MiB limit",
                limits.memory_mib
            )));
        }
        if now.pids_max_hits > self.seen.pids_max_hits {
            let n = now.pids_max_hits - self.seen.pids_max_hits;
            out.push(hit(format!("pids: {n} fork(s) refused at the limit of {} processes", limits.pids)));
        }
        let disk_full = now.disk_total_bytes > 0 && now.disk_free_bytes < DISK_FULL_BELOW;
        if disk_full && !self.disk_full {
            out.push(hit(format!("disk_mib: the writable layer is full ({} MiB)", limits.disk_mib)));
        }
        let inodes_full = now.inodes_total > 0 && now.inodes_free == 0;
        if inodes_full && !self.inodes_full {
            out.push(hit(format!("inodes: the writable layer has no free inode ({} inodes)", limits.inodes)));
        }
        *self = LimitWatch { seen: now, disk_full, inodes_full };
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources() -> Resources {
        Resources { cpus: 1.0, memory_mib: 128, disk_mib: 64, pids: 256, inodes: 1000, open_files: 4096 }
    }

    fn roomy() -> LimitCounters {
        LimitCounters {
            disk_free_bytes: 1 << 20,
            disk_total_bytes: 64 << 20,
            inodes_free: 10,
            inodes_total: 1032,
            ..LimitCounters::default()
        }
    }

    #[test]
    fn rises_and_new_full_states_become_one_event_each() {
        let mut w = LimitWatch::default();
        assert!(w.update(roomy(), &resources()).is_empty());
        // A few blocks left that ext4 keeps for a write's own metadata: full.
        let now = LimitCounters { oom_kills: 2, pids_max_hits: 5, disk_free_bytes: 3 << 10, ..roomy() };
        let details: Vec<String> = w.update(now, &resources()).into_iter().map(|o| o.detail).collect();
        assert_eq!(details.len(), 3, "{details:?}");
        assert!(details[0].starts_with("memory_mib: ") && details[0].contains("killed 2"), "{details:?}");
        assert!(details[1].starts_with("pids: 5 fork(s)"), "{details:?}");
        assert!(details[2].starts_with("disk_mib: "), "{details:?}");
        // Nothing new: no event, the disk staying full included.
        assert!(w.update(now, &resources()).is_empty());
        // Room again, then full again: a second event.
        assert!(w.update(LimitCounters { disk_free_bytes: DISK_FULL_BELOW, ..now }, &resources()).is_empty());
        let again = w.update(LimitCounters { inodes_free: 0, ..now }, &resources());
        let details: Vec<&str> = again.iter().map(|o| o.detail.as_str()).collect();
        assert_eq!(details.len(), 2, "{details:?}");
        assert!(details[0].starts_with("disk_mib: ") && details[1].starts_with("inodes: "), "{details:?}");
        assert!(again.iter().all(|o| o.kind == SecurityEventKind::LimitHit));
    }
}

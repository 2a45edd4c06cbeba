//! Who read what: fill events attributed to the cgroup of the process that
//! raised them.
//!
//! A pre-content event carries the reader's pid, and the reader waits in
//! the kernel until the event is answered, so its `/proc/<pid>/cgroup` is
//! still there to read. Every sandbox runs in cgroups of its own, so a
//! sandbox's share of a shared layer is the sum over its cgroups.
//!
//! What this cannot see: reads the page cache serves. A page of a shared
//! layer one sandbox brought in serves the next sandbox without any event,
//! so that sandbox shows neither a fetch nor a hit for it. Hits appear when
//! the layer's pages were dropped (memory pressure, a cgroup's reclaim)
//! while the layer file still holds the data.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use serde::Serialize;

use super::file::FillOutcome;

/// Readers whose counters are kept; past this, the one updated longest ago
/// is dropped (counters of long-gone sandboxes go first).
const MAX_READERS: usize = 4096;

/// What the readers in one cgroup cost and were served, over all layers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReaderStats {
    /// The reader's cgroup path (cgroup2 if it has one there, else its
    /// first v1 path other than the root); empty when it could not be read.
    pub cgroup: String,
    /// Sum of the ranges its reads asked the daemon for.
    pub bytes_accessed: u64,
    /// Bytes fetched from the store to answer its reads.
    pub bytes_fetched: u64,
    pub chunks_fetched: u64,
    /// Events whose whole range was local already.
    pub cache_hits: u64,
    pub fill_events: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Readers {
    inner: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    /// Counters and when they last changed (the table's clock).
    by_cgroup: HashMap<String, (ReaderStats, u64)>,
    clock: u64,
}

impl Table {
    /// The counters of `cgroup`, made (evicting the stalest) if new.
    fn touch(&mut self, cgroup: String) -> &mut ReaderStats {
        self.clock += 1;
        let now = self.clock;
        if !self.by_cgroup.contains_key(&cgroup) && self.by_cgroup.len() >= MAX_READERS {
            let oldest = self.by_cgroup.iter().min_by_key(|(_, (_, seen))| *seen).map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                self.by_cgroup.remove(&oldest);
            }
        }
        let (stats, seen) = self
            .by_cgroup
            .entry(cgroup.clone())
            .or_insert_with(|| (ReaderStats { cgroup, ..ReaderStats::default() }, now));
        *seen = now;
        stats
    }
}

impl Readers {
    /// Adds one fill event raised by `pid`.
    pub(crate) fn record(&self, pid: i32, outcome: &FillOutcome) {
        let cgroup = cgroup_of(pid).unwrap_or_default();
        let mut table = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let stats = table.touch(cgroup);
        stats.fill_events += 1;
        stats.bytes_accessed += outcome.bytes_accessed;
        stats.bytes_fetched += outcome.bytes_fetched;
        stats.chunks_fetched += outcome.chunks_fetched;
        stats.cache_hits += u64::from(outcome.cache_hit);
    }

    pub(crate) fn snapshot(&self) -> Vec<ReaderStats> {
        let table = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<ReaderStats> = table.by_cgroup.values().map(|(s, _)| s.clone()).collect();
        all.sort_by(|a, b| a.cgroup.cmp(&b.cgroup));
        all
    }
}

/// The cgroup `pid` is in: its cgroup2 path unless that is the root (a
/// hybrid host may leave processes there), else its first v1 path that is
/// not the root.
fn cgroup_of(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    pick_cgroup(&text).map(str::to_owned)
}

fn pick_cgroup(text: &str) -> Option<&str> {
    let paths = text.lines().filter_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, _controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        Some((id == "0", path))
    });
    let (unified, v1): (Vec<_>, Vec<_>) = paths.filter(|(_, p)| *p != "/").partition(|(v2, _)| *v2);
    unified.first().or(v1.first()).map(|(_, p)| *p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_path_wins_and_a_root_one_falls_back_to_v1() {
        let hybrid = "4:memory:/inst/sb-1\n1:cpu:/inst/sb-1\n0::/inst/sb-1/leader\n";
        assert_eq!(pick_cgroup(hybrid), Some("/inst/sb-1/leader"));
        let v1_only = "9:name=systemd:/\n4:memory:/inst/sb-2\n0::/\n";
        assert_eq!(pick_cgroup(v1_only), Some("/inst/sb-2"));
        assert_eq!(pick_cgroup("0::/\n"), None);
    }

    #[test]
    fn events_add_up_per_cgroup() {
        let readers = Readers::default();
        let fetched = FillOutcome { bytes_accessed: 10, bytes_fetched: 4096, chunks_fetched: 1, cache_hit: false };
        let hit = FillOutcome { bytes_accessed: 10, cache_hit: true, ..FillOutcome::default() };
        let me = std::process::id() as i32;
        readers.record(me, &fetched);
        readers.record(me, &hit);
        let all = readers.snapshot();
        assert_eq!(all.len(), 1, "{all:?}");
        let mine = &all[0];
        assert_eq!((mine.fill_events, mine.bytes_fetched, mine.cache_hits, mine.bytes_accessed), (2, 4096, 1, 20));
    }

    #[test]
    fn the_stalest_reader_is_dropped_past_the_bound() {
        let mut table = Table::default();
        for i in 0..MAX_READERS {
            table.touch(format!("/x/{i}")).fill_events = 1;
        }
        table.touch("/x/0".into());
        table.touch("/new".into());
        assert_eq!(table.by_cgroup.len(), MAX_READERS);
        assert!(table.by_cgroup.contains_key("/x/0"), "recently touched: kept");
        assert!(!table.by_cgroup.contains_key("/x/1"), "the stalest: dropped");
        assert!(table.by_cgroup.contains_key("/new"));
    }
}

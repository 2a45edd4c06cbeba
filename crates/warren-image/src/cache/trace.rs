//! Access traces: the fetch units of a layer that readers asked for, in
//! the order they first asked, recorded by every node and stored beside
//! the layer in the blob store (`traces/sha256/<layer hex>.json`). The
//! next node that makes the layer local fetches the units the trace names
//! while its first workload starts, many ranged GETs in flight, instead of
//! one serial round trip per miss as a Python import storm reads one small
//! file after another.
//!
//! Why this shape:
//! - A trace is a hint, never content: every unit it names is fetched and
//!   checked against the manifest's digest like a demand fill's, and one
//!   that fails stays missing for a read to fetch (or fail) on demand. A
//!   wrong or hostile trace costs bytes only, bounded by [`MAX_SHARE`] of
//!   the layer.
//! - The replay starts once the layer is mounted and the acquire returns,
//!   so the workload runs beside it instead of after it (the replay cost a
//!   traced cold start about 0.7 s when the acquire waited for it). It
//!   fetches in trace order (sorted within small blocks, so neighbours
//!   share a GET) and claims each run only when its GET starts, like a
//!   prefetch: a read of a unit the replay has not reached fetches it on
//!   demand, one of a unit in flight waits for it, and the replay skips
//!   what reads fetched meanwhile. Its writes go through the cache's own
//!   descriptor, opened before the inode was ever marked, which the kernel
//!   therefore never reports (pre-content events are decided at open). It
//!   runs as one of the layer's prefetch tasks: closing the layer aborts it
//!   and puts its claimed units back to missing.
//! - A node seeds its log with the trace it replayed, so what it publishes
//!   is the union of that trace and its own reads; it publishes when a
//!   layer's last lease goes, or a lease that saw reads ends (the trace
//!   closes then, see below), and only if it recorded units beyond what it
//!   replayed or published. Nodes racing overwrite each other (a hint).
//! - Only demand reads are recorded (the event's range), not prefetches or
//!   whole-file widenings: those are re-derived on the next node from the
//!   demand that caused them, and a prefetch nobody read is not repeated.
//! - Only while the mount has its first, narrow readahead window: an
//!   event's range is the window, and once the node widens it (see the
//!   cache's top doc) each event names several units the reader never
//!   asked for, which a cold node replaying the trace would fetch for
//!   nothing. So the log closes when the window widens.

use std::ops::RangeInclusive;

use serde::{Deserialize, Serialize};

/// At most this share of a layer's units is recorded or replayed (one in
/// `MAX_SHARE`); a layer whose workloads read more is better pulled whole.
pub(crate) const MAX_SHARE: usize = 4;
/// A trace of a small layer may still name this many units.
const MIN_LIMIT: usize = 64;
/// An event covering more units than this (an mmap of a whole file, which
/// comes without a range) is not a read to replay.
const MAX_RECORDED_SPAN: usize = 64;
const FORMAT_VERSION: u32 = 1;

/// The stored form: runs of consecutive units, in first-access order.
#[derive(Debug, Serialize, Deserialize)]
struct TraceFile {
    version: u32,
    /// The fetch unit the indices count in; a trace of another unit size
    /// (the layer was re-pushed with other pieces) is ignored.
    unit_size: u64,
    runs: Vec<(usize, usize)>,
}

/// The units recorded for one layer on this node.
#[derive(Debug)]
pub(crate) struct TraceLog {
    seen: Vec<bool>,
    order: Vec<usize>,
    /// `order[..published]` is in the store already (or came from it).
    published: usize,
    limit: usize,
    /// Records nothing more (see the top doc).
    closed: bool,
}

impl TraceLog {
    pub(crate) fn new(units: usize) -> Self {
        Self { seen: vec![false; units], order: Vec::new(), published: 0, limit: limit(units), closed: false }
    }

    /// Stops recording; what is recorded stays, to be published.
    pub(crate) fn close(&mut self) {
        self.closed = true;
    }

    /// Records a read of `span` (units), unless the log is full or the span
    /// is too wide to be a read.
    pub(crate) fn record(&mut self, span: RangeInclusive<usize>) {
        if self.closed || span.end().saturating_sub(*span.start()) >= MAX_RECORDED_SPAN {
            return;
        }
        for index in span {
            if self.order.len() >= self.limit {
                return;
            }
            if let Some(seen) = self.seen.get_mut(index) {
                if !*seen {
                    *seen = true;
                    self.order.push(index);
                }
            }
        }
    }

    /// Starts the log with a trace from the store: those units count as
    /// published.
    pub(crate) fn seed(&mut self, units: &[usize]) {
        if !self.order.is_empty() {
            return;
        }
        self.record_all(units);
        self.published = self.order.len();
    }

    fn record_all(&mut self, units: &[usize]) {
        for &index in units {
            self.record(index..=index);
        }
    }

    /// The log's stored form if it holds units not published yet; they
    /// count as published from here on.
    pub(crate) fn take_unpublished(&mut self, unit_size: u64) -> Option<Vec<u8>> {
        if self.order.len() <= self.published {
            return None;
        }
        self.published = self.order.len();
        Some(encode(&self.order, unit_size))
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }
}

fn limit(units: usize) -> usize {
    (units / MAX_SHARE).max(MIN_LIMIT).min(units)
}

/// Runs of consecutive units, in the order given.
fn encode(order: &[usize], unit_size: u64) -> Vec<u8> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &index in order {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == index => *count += 1,
            _ => runs.push((index, 1)),
        }
    }
    let file = TraceFile { version: FORMAT_VERSION, unit_size, runs };
    // A struct of integers always serializes.
    serde_json::to_vec(&file).unwrap_or_default()
}

/// The units a stored trace names, in its order, for a layer of `units`
/// fetch units of `unit_size` bytes: each named once, none out of range,
/// at most the share a trace may hold.
pub(crate) fn decode(bytes: &[u8], unit_size: u64, units: usize) -> Result<Vec<usize>, String> {
    let file: TraceFile = serde_json::from_slice(bytes).map_err(|e| format!("not a trace: {e}"))?;
    if file.version != FORMAT_VERSION {
        return Err(format!("trace format {} (this node reads {FORMAT_VERSION})", file.version));
    }
    if file.unit_size != unit_size {
        return Err(format!("trace of {}-byte units, the layer has {unit_size}", file.unit_size));
    }
    let mut log = TraceLog::new(units);
    for (first, count) in file.runs {
        let end = first.checked_add(count).filter(|&end| end <= units && count > 0);
        let Some(end) = end else {
            return Err(format!("run {first}+{count} outside the layer's {units} units"));
        };
        log.record_all(&(first..end).collect::<Vec<_>>());
    }
    Ok(log.order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_round_trips_in_first_access_order_and_publishes_only_news() {
        let mut log = TraceLog::new(1000);
        log.record(10..=11);
        log.record(3..=3);
        log.record(11..=12);
        log.record(0..=999);
        assert_eq!(log.order, [10, 11, 3, 12], "repeats and a whole-file span are not recorded");
        let bytes = log.take_unpublished(16384).unwrap();
        assert!(log.take_unpublished(16384).is_none(), "nothing new");
        assert_eq!(decode(&bytes, 16384, 1000).unwrap(), [10, 11, 3, 12]);
        let mut next = TraceLog::new(1000);
        next.seed(&[10, 11, 3, 12]);
        next.record(3..=3);
        assert!(next.take_unpublished(16384).is_none(), "what was replayed is not news");
        next.record(500..=500);
        let union = next.take_unpublished(16384).unwrap();
        assert_eq!(decode(&union, 16384, 1000).unwrap(), [10, 11, 3, 12, 500]);
    }

    #[test]
    fn a_closed_log_keeps_what_it_had_and_records_nothing_more() {
        let mut log = TraceLog::new(1000);
        log.record(7..=8);
        log.close();
        log.record(20..=27);
        assert_eq!(log.order, [7, 8]);
        let bytes = log.take_unpublished(16384).unwrap();
        assert_eq!(decode(&bytes, 16384, 1000).unwrap(), [7, 8]);
    }

    #[test]
    fn a_trace_is_bounded_and_checked_against_the_layer() {
        let mut log = TraceLog::new(400);
        for i in 0..400 {
            log.record(i..=i);
        }
        assert_eq!(log.len(), 100, "a quarter of the layer");
        let bytes = log.take_unpublished(4096).unwrap();
        assert!(decode(&bytes, 16384, 400).is_err(), "another unit size");
        assert!(decode(&bytes, 4096, 50).is_err(), "a run past the layer's end");
        let hostile = br#"{"version":1,"unit_size":4096,"runs":[[0,400]]}"#;
        assert_eq!(decode(hostile, 4096, 400).unwrap().len(), 100, "a long trace is cut to the bound");
        assert!(decode(br#"{"version":1,"unit_size":4096,"runs":[[5,0]]}"#, 4096, 400).is_err());
        assert!(decode(b"not json", 4096, 400).is_err());
        let small = TraceLog::new(10);
        assert_eq!(small.limit, 10, "a small layer may be traced whole");
    }
}

//! Prefetch: fetching the pieces just past a sequential reader while it
//! works on what it has.
//!
//! A reader of a lazily filled layer waits for one ranged GET per readahead
//! window it misses, serially: the window is small (every byte it covers is
//! fetched), so a file read front to back costs one store round trip per
//! 16 KiB. When a layer's fill events show a reader moving forward through
//! the file, the daemon claims the next missing pieces after its range and
//! fetches them in the background, in one ranged GET per run of
//! neighbouring pieces; the reader's next event then finds them local, or
//! already in flight and waits for them rather than asking again.
//!
//! Why this shape:
//! - A stream is recognised from the layer-file offsets of consecutive
//!   events (EROFS lays a file's data out contiguously, and the files of a
//!   directory next to each other), so the first event of a read never
//!   prefetches; the window ahead starts at [`INITIAL_WINDOW_UNITS`] and
//!   doubles with each further event of the stream up to the configured
//!   maximum, like the kernel's own readahead ramp. A short read wastes at
//!   most one small window.
//! - A prefetch never crosses a chunk border (one GET of one chunk object);
//!   the stream carries on into the next chunk on its next event.
//! - Demand comes first: a prefetch starts only after the event that
//!   triggered it is filled, takes no more than the layer's remaining
//!   prefetch request budget (the bound on ranged GETs in flight per layer)
//!   and is skipped, not queued, when that budget is spent.
//! - A prefetched piece goes through the same check as a demand one: its
//!   bytes reach the file only after they match the manifest's digest, and
//!   a piece that fails stays missing, so the next read of it fetches it on
//!   demand (and fails with `EIO` if the store still serves bad bytes).
//! - Prefetches write through a duplicate of an event's descriptor (the
//!   only descriptors whose writes raise no event after an adoption), held
//!   by the layer until it is closed. Closing the layer (unmount, eviction,
//!   shutdown) aborts its prefetches, drops that descriptor and waits until
//!   no prefetch task holds the layer.

use std::ops::Range;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::AbortHandle;

/// Default bound on how far ahead of a sequential reader the daemon fetches
/// (KiB).
pub const DEFAULT_PREFETCH_KB: u32 = 64;
/// Default bound on the data of a file a miss fetches whole (KiB).
pub const DEFAULT_WHOLE_FILE_KB: u32 = 256;
/// Default bound on prefetch requests (ranged GETs) in flight per layer.
pub const DEFAULT_PREFETCH_REQUESTS: usize = 4;
/// Default bound on the ranged GETs in flight while a layer's access trace
/// is replayed (see `trace`).
pub const DEFAULT_TRACE_REQUESTS: usize = 8;
/// The window ahead on a stream's second event, in fetch units.
pub(crate) const INITIAL_WINDOW_UNITS: usize = 2;
/// Streams remembered per layer (the least recently advanced one goes).
const MAX_STREAMS: usize = 32;
/// An event that starts this many units past a stream's end still
/// continues it: the small files of one directory lie next to each other,
/// and a file whose first pages were cached skips ahead.
const STREAM_GAP_UNITS: usize = 2;
/// How long closing a layer waits for its aborted prefetches to let go of
/// it before logging and moving on.
const CLOSE_PATIENCE: Duration = Duration::from_secs(10);

/// How much prefetching a cache does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// The furthest ahead of a reader a prefetch reaches, in bytes; 0
    /// turns prefetching off.
    pub max_ahead_bytes: u64,
    /// Prefetch requests in flight per layer, at most.
    pub max_requests: usize,
    /// A miss in a regular file with at most this many bytes of data
    /// blocks fetches the file's missing units with its own, in the same
    /// request (pieced layers only); 0 turns it off. Larger files keep
    /// the per-window fetch and the stream prefetch.
    pub whole_file_bytes: u64,
    /// Ranged GETs in flight while a layer's stored access trace is
    /// replayed (beside its first readers); 0 turns traces off (none is replayed,
    /// recorded or published).
    pub trace_requests: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        Self {
            max_ahead_bytes: u64::from(DEFAULT_PREFETCH_KB) * 1024,
            max_requests: DEFAULT_PREFETCH_REQUESTS,
            whole_file_bytes: u64::from(DEFAULT_WHOLE_FILE_KB) * 1024,
            trace_requests: DEFAULT_TRACE_REQUESTS,
        }
    }
}

impl PrefetchConfig {
    pub fn off() -> Self {
        Self { max_ahead_bytes: 0, max_requests: 0, whole_file_bytes: 0, trace_requests: 0 }
    }

    /// The window bound in fetch units of `unit` bytes (0: off).
    pub(crate) fn max_units(&self, unit: u64) -> usize {
        if self.max_requests == 0 || unit == 0 {
            return 0;
        }
        usize::try_from(self.max_ahead_bytes / unit).unwrap_or(usize::MAX)
    }
}

#[derive(Debug, Clone, Copy)]
struct Stream {
    /// The first unit after the stream's last event.
    next: usize,
    /// Units ahead of `next` the last prefetch aimed at (0 before any).
    window: usize,
    /// The first unit no prefetch of this stream has claimed.
    ahead: usize,
    last_seen: u64,
}

/// The streams of one layer.
#[derive(Debug, Default)]
pub(crate) struct Streams {
    list: Vec<Stream>,
    clock: u64,
}

impl Streams {
    /// Records an event covering units `first..=last` and returns the units
    /// to prefetch for it: empty unless the event continues a stream.
    /// `max_window` bounds the window in units; the caller clips the range
    /// to a chunk and to the layer and reports back with [`Self::claimed`].
    pub(crate) fn advance(&mut self, first: usize, last: usize, max_window: usize) -> (usize, Range<usize>) {
        self.clock += 1;
        let now = self.clock;
        let next = last.saturating_add(1);
        let continues = |s: &Stream| first.saturating_add(1) >= s.next && first <= s.next + STREAM_GAP_UNITS;
        let Some(index) = self.list.iter().position(continues) else {
            let fresh = Stream { next, window: 0, ahead: next, last_seen: now };
            if self.list.len() < MAX_STREAMS {
                self.list.push(fresh);
            } else if let Some(stalest) = self.list.iter_mut().min_by_key(|s| s.last_seen) {
                *stalest = fresh;
            }
            return (usize::MAX, next..next);
        };
        let stream = &mut self.list[index];
        stream.last_seen = now;
        stream.next = stream.next.max(next);
        stream.window = match stream.window {
            0 => INITIAL_WINDOW_UNITS.min(max_window),
            w => w.saturating_mul(2).min(max_window),
        };
        let start = stream.ahead.max(stream.next);
        let end = stream.next.saturating_add(stream.window);
        (index, start..end.max(start))
    }

    /// Records that the prefetch planned for stream `index` covered units
    /// up to `end` (exclusive), so the next one starts there.
    pub(crate) fn claimed(&mut self, index: usize, end: usize) {
        if let Some(stream) = self.list.get_mut(index) {
            stream.ahead = stream.ahead.max(end);
        }
    }
}

/// Per-layer prefetch state.
#[derive(Debug, Default)]
pub(crate) struct LayerPrefetch {
    pub(crate) streams: Mutex<Streams>,
    /// Prefetch requests in flight on this layer.
    requests: AtomicUsize,
    closed: AtomicBool,
    /// An event descriptor's duplicate prefetches write through.
    writer: Mutex<Option<Arc<OwnedFd>>>,
    tasks: Mutex<Tasks>,
    drained: Condvar,
}

#[derive(Debug, Default)]
struct Tasks {
    live: usize,
    next_id: u64,
    handles: Vec<(u64, AbortHandle)>,
}

/// Prefetch requests taken from a layer's budget; returned on drop.
#[derive(Debug)]
pub(crate) struct Budget {
    owner: Arc<LayerPrefetch>,
    taken: usize,
}

impl Budget {
    pub(crate) fn requests(&self) -> usize {
        self.taken
    }
}

impl Drop for Budget {
    fn drop(&mut self) {
        self.owner.requests.fetch_sub(self.taken, Ordering::AcqRel);
    }
}

impl LayerPrefetch {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Prefetch requests planned and not yet written and settled.
    pub(crate) fn requests_in_flight(&self) -> usize {
        self.requests.load(Ordering::Acquire)
    }

    fn lock_tasks(&self) -> MutexGuard<'_, Tasks> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes up to `wanted` requests of the `bound` in flight; `None` when
    /// none is left (or the layer is closed).
    pub(crate) fn take_budget(self: &Arc<Self>, wanted: usize, bound: usize) -> Option<Budget> {
        if self.is_closed() || wanted == 0 {
            return None;
        }
        let mut current = self.requests.load(Ordering::Acquire);
        loop {
            let taken = wanted.min(bound.saturating_sub(current));
            if taken == 0 {
                return None;
            }
            match self.requests.compare_exchange(current, current + taken, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(Budget { owner: Arc::clone(self), taken }),
                Err(now) => current = now,
            }
        }
    }

    /// The descriptor prefetches write through, made from `event_fd` the
    /// first time; `None` once closed or if it cannot be duplicated.
    pub(crate) fn writer(&self, event_fd: BorrowedFd<'_>) -> Option<Arc<OwnedFd>> {
        let mut writer = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if self.is_closed() {
            return None;
        }
        if writer.is_none() {
            match event_fd.try_clone_to_owned() {
                Ok(fd) => *writer = Some(Arc::new(fd)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot keep a descriptor for prefetching");
                    return None;
                }
            }
        }
        writer.clone()
    }

    /// Runs `task` on `runtime` as one of this layer's prefetches, unless
    /// the layer is closed.
    pub(crate) fn spawn<F>(self: &Arc<Self>, runtime: &Handle, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let id = {
            let mut tasks = self.lock_tasks();
            if self.is_closed() {
                return;
            }
            tasks.live += 1;
            tasks.next_id += 1;
            tasks.next_id
        };
        let live = LiveTask { layer: Arc::clone(self), id };
        // Not under the lock: a runtime that is shutting down drops the
        // task (and so `live`, which takes the lock) inside `spawn`.
        let handle = runtime.spawn(async move {
            // Dropped when the task ends or is aborted, whichever first.
            let _live = live;
            task.await;
        });
        let mut tasks = self.lock_tasks();
        // A task that ended before this push left its handle behind.
        tasks.handles.retain(|(_, h)| !h.is_finished());
        tasks.handles.push((id, handle.abort_handle()));
        // A close that ran meanwhile did not see this task: abort it here.
        if self.is_closed() {
            handle.abort();
        }
    }

    /// Stops prefetching on this layer: aborts what runs and drops the
    /// writer. The aborted tasks let go of the layer when the runtime next
    /// polls them; [`Self::wait_drained`] waits for that.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.writer.lock().unwrap_or_else(PoisonError::into_inner).take();
        for (_, handle) in &self.lock_tasks().handles {
            handle.abort();
        }
    }

    /// Waits (bounded) until no prefetch task of this layer is left. Not
    /// on a runtime worker: the tasks need one to be dropped.
    pub(crate) fn wait_drained(&self) {
        let tasks = self.lock_tasks();
        let (tasks, timeout) = self
            .drained
            .wait_timeout_while(tasks, CLOSE_PATIENCE, |t| t.live > 0)
            .unwrap_or_else(PoisonError::into_inner);
        if timeout.timed_out() {
            tracing::warn!(live = tasks.live, "prefetch tasks still running after their layer closed");
        }
    }
}

/// Counts a spawned prefetch task as live until it is dropped.
struct LiveTask {
    layer: Arc<LayerPrefetch>,
    id: u64,
}

impl Drop for LiveTask {
    fn drop(&mut self) {
        let mut tasks = self.layer.lock_tasks();
        tasks.live = tasks.live.saturating_sub(1);
        tasks.handles.retain(|(id, _)| *id != self.id);
        drop(tasks);
        self.layer.drained.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_event_prefetches_nothing_and_a_continuing_one_ramps_up() {
        let mut streams = Streams::default();
        let (_, first) = streams.advance(10, 10, 8);
        assert!(first.is_empty(), "one event is no stream: {first:?}");
        let (s, second) = streams.advance(11, 11, 8);
        assert_eq!(second, 12..14, "the window starts at two units");
        streams.claimed(s, second.end);
        let (s, third) = streams.advance(12, 12, 8);
        assert_eq!(third, 14..17, "it doubles to four ahead of the reader, from where the last one ended");
        streams.claimed(s, third.end);
        let (s, fourth) = streams.advance(13, 14, 8);
        assert_eq!(fourth, 17..23, "and is capped at the maximum");
        streams.claimed(s, fourth.end);
        let (_, fifth) = streams.advance(15, 15, 8);
        assert_eq!(fifth, 23..24);
    }

    #[test]
    fn unrelated_events_start_streams_of_their_own() {
        let mut streams = Streams::default();
        streams.advance(100, 100, 8);
        let (_, far) = streams.advance(500, 500, 8);
        assert!(far.is_empty(), "a jump is a new stream");
        let (_, back) = streams.advance(101, 101, 8);
        assert_eq!(back, 102..104, "the first stream is still known");
        let (_, gap) = streams.advance(503, 503, 8);
        assert_eq!(gap, 504..506, "a small gap continues a stream");
        let (_, behind) = streams.advance(90, 90, 8);
        assert!(behind.is_empty(), "going backwards is no continuation");
    }

    #[test]
    fn an_unclaimed_plan_is_planned_again_and_streams_are_bounded() {
        let mut streams = Streams::default();
        streams.advance(0, 0, 8);
        let (_, plan) = streams.advance(1, 1, 8);
        assert_eq!(plan, 2..4);
        // Nothing claimed (no budget): the next event asks again, further on.
        let (_, again) = streams.advance(2, 2, 8);
        assert_eq!(again, 3..7);
        for i in 0..(2 * MAX_STREAMS) {
            streams.advance(1000 * (i + 1), 1000 * (i + 1), 8);
        }
        assert_eq!(streams.list.len(), MAX_STREAMS);
        assert!(PrefetchConfig::off().max_units(16384) == 0);
        assert_eq!(PrefetchConfig::default().max_units(16384), 4);
    }

    #[test]
    fn the_request_budget_is_never_exceeded_and_comes_back_on_drop() {
        let owner = Arc::new(LayerPrefetch::default());
        let take = |wanted| owner.take_budget(wanted, 4);
        let a = take(3).unwrap();
        assert_eq!(a.taken, 3);
        let b = take(3).unwrap();
        assert_eq!(b.taken, 1, "only what is left of the bound");
        assert!(take(1).is_none(), "nothing left");
        assert_eq!(owner.requests_in_flight(), 4);
        drop(a);
        assert_eq!(take(5).unwrap().taken, 3);
        drop(b);
        assert_eq!(owner.requests_in_flight(), 0);
        owner.close();
        assert!(take(1).is_none(), "a closed layer prefetches nothing");
    }
}

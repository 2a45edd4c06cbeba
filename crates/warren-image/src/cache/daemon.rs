//! The fill daemon: one thread reads the group's events, a few workers fill
//! the ranges they name and answer them.
//!
//! Every verdict is written before the event's descriptor is closed:
//! verdicts are matched to pending events by descriptor number alone, and a
//! number closed early could be reused by the next event.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::JoinHandle;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::runtime::Handle;

use super::error::{IoContext, Result};
use super::fanotify::{Event, Group, Verdict};
use super::file::{FillError, FillOutcome, InodeKey, LayerFile};
use super::holder::Holder;
use super::prefetch::PrefetchConfig;
use super::readers::Readers;
use crate::blob::ChunkSource;
use crate::layer::LayerManifest;

/// Events read but not yet taken by a worker; the reader waits beyond this,
/// so at most this many event descriptors are open at once.
const JOB_QUEUE: usize = 256;
const EVENT_BUFFER_BYTES: usize = 64 * 1024;
/// Chunks one fill fetches concurrently (a readahead window spans several).
const FETCH_CONCURRENCY: usize = 4;
/// How far the daemon reads a layer file ahead of an event on local data
/// (the kernel's default readahead window, which plain directories get).
const LOCAL_READAHEAD_BYTES: u64 = 128 * 1024;
/// Bound on the orphaned-event sweep when no earlier daemon left a mark.
const MAX_SWEPT_FDS: u64 = 1 << 20;

/// What the daemon threads and the cache share.
pub(crate) struct Shared {
    pub(crate) group: Group,
    /// Layer files by inode, which is all an event tells about its file.
    pub(crate) files: RwLock<HashMap<InodeKey, Arc<LayerFile>>>,
    pub(crate) source: Arc<dyn ChunkSource>,
    pub(crate) runtime: Handle,
    pub(crate) holder: Mutex<Holder>,
    pub(crate) high_water: HighWater,
    /// Fill events by the cgroup of the process that raised them.
    pub(crate) readers: Readers,
    pub(crate) prefetch: PrefetchConfig,
}

impl Shared {
    pub(crate) fn register(&self, file: &Arc<LayerFile>) {
        self.files.write().unwrap_or_else(PoisonError::into_inner).insert(file.key(), Arc::clone(file));
    }

    /// Stops routing events to `file` and aborts its prefetches.
    pub(crate) fn forget(&self, file: &LayerFile) {
        self.files.write().unwrap_or_else(PoisonError::into_inner).remove(&file.key());
        file.prefetch_state().close();
    }

    fn lookup(&self, key: InodeKey) -> Option<Arc<LayerFile>> {
        self.files.read().unwrap_or_else(PoisonError::into_inner).get(&key).cloned()
    }

    fn watch_holder(&self) -> Option<OwnedFd> {
        self.holder.lock().unwrap_or_else(PoisonError::into_inner).pidfd().try_clone_to_owned().ok()
    }

    /// Starts a new holder after the last one died; while this process
    /// lives it holds the group itself, so nothing failed open meanwhile.
    fn replace_holder(&self) -> Option<OwnedFd> {
        let mut holder = self.holder.lock().unwrap_or_else(PoisonError::into_inner);
        tracing::warn!(pid = holder.pid(), "layer cache holder exited; starting another");
        match holder.respawn(&self.group) {
            Ok(()) => holder.pidfd().try_clone_to_owned().ok(),
            Err(e) => {
                tracing::error!(error = %e, "no holder: lazy layers fail closed only while this process lives");
                None
            }
        }
    }
}

/// The highest event descriptor number any daemon of this cache has held,
/// persisted before the event is worked on, so a successor knows how far to
/// sweep for events its predecessor took and never answered.
pub(crate) struct HighWater {
    file: File,
    value: AtomicI32,
}

impl HighWater {
    /// Opens the mark at `path`, with what an earlier daemon left there.
    pub(crate) fn open(path: &Path) -> Result<(Self, Option<RawFd>)> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .context(|| format!("opening {}", path.display()))?;
        let mut word = [0u8; 4];
        let previous = file.read_exact_at(&mut word, 0).ok().map(|()| i32::from_le_bytes(word));
        Ok((Self { file, value: AtomicI32::new(previous.unwrap_or(-1)) }, previous))
    }

    /// Forgets the old mark: a new group has no events from before.
    pub(crate) fn reset(&self) -> Result<()> {
        self.value.store(-1, Ordering::Release);
        self.file.write_all_at(&(-1i32).to_le_bytes(), 0).context(|| "resetting the event mark".into())
    }

    fn raise(&self, fd: RawFd) {
        if fd <= self.value.load(Ordering::Acquire) {
            return;
        }
        self.value.store(fd, Ordering::Release);
        if let Err(e) = self.file.write_all_at(&fd.to_le_bytes(), 0) {
            tracing::warn!(error = %e, "could not persist the event mark");
        }
    }
}

/// Answers, with `EIO`, every event a dead daemon read and never answered.
/// Must run before this daemon reads any event: the numbers those events
/// carry belong to no open descriptor any more and would collide with ours.
/// A reader denied this way sees its readahead fail and retries the page,
/// which raises a fresh event.
pub(crate) fn deny_orphaned_events(group: &Group, highest: Option<RawFd>) -> usize {
    let limit = match highest {
        Some(fd) => u64::try_from(fd).map_or(0, |fd| fd + 1),
        None => rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(MAX_SWEPT_FDS)
            .min(MAX_SWEPT_FDS),
    };
    (0..limit)
        .filter_map(|fd| RawFd::try_from(fd).ok())
        .filter(|&fd| group.respond(fd, Verdict::DenyEio).is_ok())
        .count()
}

/// The running daemon. Dropping it stops the reader; events already read
/// are still filled and answered by the workers, in the background.
pub(crate) struct Daemon {
    stop: Option<OwnedFd>,
    threads: Vec<JoinHandle<()>>,
}

impl Daemon {
    pub(crate) fn start(shared: Arc<Shared>, fill_threads: usize) -> Result<Self> {
        let (stop_read, stop_write) =
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).context(|| "creating the stop pipe".into())?;
        let (jobs, queue) = sync_channel::<Event>(JOB_QUEUE);
        let queue = Arc::new(Mutex::new(queue));
        let mut daemon = Self { stop: Some(stop_write), threads: Vec::new() };
        for n in 0..fill_threads.max(1) {
            let (shared, queue) = (Arc::clone(&shared), Arc::clone(&queue));
            let thread = std::thread::Builder::new()
                .name(format!("layer-fill-{n}"))
                .spawn(move || work(&shared, &queue))
                .context(|| "starting a fill thread".into())?;
            daemon.threads.push(thread);
        }
        let reader = std::thread::Builder::new()
            .name("layer-events".into())
            .spawn(move || read_events(&shared, &stop_read, &jobs))
            .context(|| "starting the event thread".into())?;
        daemon.threads.push(reader);
        Ok(daemon)
    }

    /// Stops the daemon and waits until every event it read is answered.
    pub(crate) fn stop_and_join(mut self) {
        self.stop = None;
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a layer cache thread panicked");
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Closing the write end wakes the reader with POLLHUP.
        self.stop = None;
    }
}

#[derive(Default)]
struct Ready {
    group: bool,
    stop: bool,
    holder: bool,
}

fn read_events(shared: &Shared, stop: &OwnedFd, jobs: &SyncSender<Event>) {
    let mut buf = vec![0u8; EVENT_BUFFER_BYTES];
    let mut holder = shared.watch_holder();
    loop {
        let ready = match wait_ready(shared.group.as_fd(), stop.as_fd(), holder.as_ref().map(AsFd::as_fd)) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::error!(error = %e, "layer cache event thread stops; readers wait for the next daemon");
                return;
            }
        };
        if ready.stop {
            return;
        }
        if ready.holder {
            holder = shared.replace_holder();
        }
        if ready.group {
            take_queued(shared, &mut buf, jobs);
        }
    }
}

fn wait_ready(group: BorrowedFd<'_>, stop: BorrowedFd<'_>, holder: Option<BorrowedFd<'_>>) -> io::Result<Ready> {
    let watch = |fd: RawFd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let mut fds = [watch(group.as_raw_fd()), watch(stop.as_raw_fd()), watch(holder.map_or(-1, |h| h.as_raw_fd()))];
    // SAFETY: `fds` is a live array of three pollfd for the whole call and
    // its length is passed with it; poll skips the negative descriptor.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
    if rc < 0 {
        let err = io::Error::last_os_error();
        return if err.kind() == io::ErrorKind::Interrupted { Ok(Ready::default()) } else { Err(err) };
    }
    if fds[0].revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
        return Err(io::Error::other("the fanotify group reports an error"));
    }
    Ok(Ready { group: fds[0].revents != 0, stop: fds[1].revents != 0, holder: fds[2].revents != 0 })
}

fn take_queued(shared: &Shared, buf: &mut [u8], jobs: &SyncSender<Event>) {
    loop {
        let events = match shared.group.read_events(buf) {
            Ok(events) if events.is_empty() => return,
            Ok(events) => events,
            Err(e) => {
                tracing::error!(error = %e, "reading fanotify events");
                return;
            }
        };
        for event in events {
            dispatch(shared, jobs, event);
        }
    }
}

fn dispatch(shared: &Shared, jobs: &SyncSender<Event>, event: Event) {
    if event.fd.is_none() {
        // Only notification events (a queue overflow) come without a
        // descriptor, and they need no verdict.
        tracing::error!(mask = event.mask, "fanotify event without a descriptor");
        return;
    }
    shared.high_water.raise(event.raw_fd);
    if !event.is_pre_access() {
        answer(shared, event, Verdict::Allow);
        return;
    }
    // A range already local is answered here, without the hand-off to a
    // fill thread: on a warm node that is nearly every event.
    if answer_if_local(shared, &event) {
        answer(shared, event, Verdict::Allow);
        return;
    }
    if let Err(returned) = jobs.send(event) {
        answer(shared, returned.0, Verdict::DenyEio);
    }
}

fn work(shared: &Shared, queue: &Mutex<Receiver<Event>>) {
    loop {
        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(event) = next else { return };
        let verdict = match fill_event(shared, &event) {
            Ok(()) => Verdict::Allow,
            Err(e) => {
                tracing::warn!(error = %e, range = ?event.range, "layer read denied with EIO");
                Verdict::DenyEio
            }
        };
        answer(shared, event, verdict);
    }
}

/// Writes the verdict, then closes the event's descriptor (in that order;
/// see the module note).
fn answer(shared: &Shared, event: Event, verdict: Verdict) {
    if let Err(e) = shared.group.respond(event.raw_fd, verdict) {
        tracing::error!(error = %e, fd = event.raw_fd, "answering a fanotify event");
    }
    drop(event);
}

#[derive(Debug, thiserror::Error)]
enum EventError {
    #[error("event without a descriptor")]
    NoDescriptor,
    #[error("stat of the event's file: {0}")]
    Stat(io::Error),
    #[error("the event's file is not a layer this cache holds")]
    UnknownFile,
    #[error(transparent)]
    Fill(#[from] FillError),
}

fn fill_event(shared: &Shared, event: &Event) -> Result<(), EventError> {
    let fd = event.fd.as_ref().ok_or(EventError::NoDescriptor)?;
    let stat = rustix::fs::fstat(fd).map_err(|e| EventError::Stat(e.into()))?;
    let file = shared.lookup((stat.st_dev, stat.st_ino)).ok_or(EventError::UnknownFile)?;
    // An event without a range (an mmap of the whole file) covers it all.
    let (offset, count) = event.range.unwrap_or((0, u64::MAX));
    let fetch = |indices: &[usize]| fetch_blocking(shared, file.manifest(), indices);
    let mut outcome = FillOutcome::default();
    let filled = file.fill(fd.as_fd(), offset, count, shared.prefetch.whole_file_bytes, &fetch, &mut outcome);
    if filled.is_ok() {
        // After the demand fill, so it never waits behind its own prefetch.
        prefetch_after(shared, &file, fd.as_fd(), offset, count, &mut outcome);
    }
    shared.readers.record(event.pid, &outcome);
    filled?;
    unmark_if_complete(shared, &file);
    Ok(())
}

/// Drops the mark of a layer that just became complete (a demand fill or
/// a prefetch wrote its last unit): no read of it needs a verdict any more.
pub(crate) fn unmark_if_complete(shared: &Shared, file: &LayerFile) {
    if file.take_unmark_turn() {
        if let Err(e) = shared.group.unmark(file.inode()) {
            tracing::warn!(layer = file.hex(), error = %e, "could not unmark a complete layer");
        }
    }
}

/// Answers from the event thread when the event's whole range is local
/// already (and starts the prefetch a continuing stream calls for); false
/// when a fill thread must fetch.
fn answer_if_local(shared: &Shared, event: &Event) -> bool {
    let Some(fd) = event.fd.as_ref() else { return false };
    let Ok(stat) = rustix::fs::fstat(fd) else { return false };
    let Some(file) = shared.lookup((stat.st_dev, stat.st_ino)) else { return false };
    let (offset, count) = event.range.unwrap_or((0, u64::MAX));
    let Some(mut outcome) = file.try_hit(offset, count) else { return false };
    // The kernel reads the layer file in windows as small as the mount's
    // readahead (every byte of a window on missing data is fetched), so a
    // warm node would read its disk 16 KiB at a time. Where the data is
    // local, start a plain-directory-sized readahead of the layer file
    // itself: it fetches nothing, and the next windows find it cached.
    // The event's descriptor raises no event of its own.
    let local = file.local_bytes_from(offset, LOCAL_READAHEAD_BYTES);
    if local > count {
        let _ = rustix::fs::fadvise(fd, offset, std::num::NonZeroU64::new(local), rustix::fs::Advice::WillNeed);
    }
    prefetch_after(shared, &file, fd.as_fd(), offset, count, &mut outcome);
    shared.readers.record(event.pid, &outcome);
    unmark_if_complete(shared, &file);
    true
}

/// Starts the prefetch an event over `[offset, offset + count)` calls for,
/// if it continues a sequential stream (see `prefetch`). What it claims is
/// counted as fetched for the event's reader, on whose behalf it goes.
fn prefetch_after(
    shared: &Shared,
    file: &Arc<LayerFile>,
    event_fd: BorrowedFd<'_>,
    offset: u64,
    count: u64,
    outcome: &mut FillOutcome,
) {
    let manifest = file.manifest();
    // Whole-chunk layers keep their old path: a miss already brings 1 MiB.
    if manifest.piece_size.is_none() {
        return;
    }
    let max_window = shared.prefetch.max_units(manifest.fetch_unit_size());
    let Some(span) = file.unit_span(offset, count).filter(|_| max_window > 0) else { return };
    let state = Arc::clone(file.prefetch_state());
    let Some(writer) = state.writer(event_fd) else { return };
    let Some((claim, budget)) = file.plan_prefetch(span, max_window, shared.prefetch.max_requests) else { return };
    for &index in claim.indices() {
        outcome.chunks_fetched += 1;
        outcome.bytes_fetched += manifest.fetch_unit_extent(index).map_or(0, |(_, len)| len);
    }
    let (file, source, manifest) = (Arc::clone(file), Arc::clone(&shared.source), Arc::clone(manifest));
    state.spawn(&shared.runtime, async move {
        let indices = claim.indices().to_vec();
        let fetched = fetch_batch(source, manifest, indices).await;
        file.store_prefetch(claim, fetched, writer.as_fd());
        drop(budget);
    });
}

/// Runs a fetch on the cache's runtime from a fill thread. A runtime that
/// is shut down drops the task, which fails the fetch (and the read).
fn fetch_blocking(shared: &Shared, manifest: &Arc<LayerManifest>, indices: &[usize]) -> Vec<Result<Bytes, String>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let batch = fetch_batch(Arc::clone(&shared.source), Arc::clone(manifest), indices.to_vec());
    shared.runtime.spawn(async move {
        let _ = tx.send(batch.await);
    });
    rx.blocking_recv()
        .unwrap_or_else(|_| indices.iter().map(|_| Err("the cache's runtime is gone".to_owned())).collect())
}

/// Fetches the fetch units `indices` (pieces or whole chunks, see
/// `LayerManifest::fetch_unit_size`) with bounded concurrency; results in
/// the same order. Neighbouring pieces of one chunk go in one ranged GET.
pub(crate) async fn fetch_batch(
    source: Arc<dyn ChunkSource>,
    manifest: Arc<LayerManifest>,
    indices: Vec<usize>,
) -> Vec<Result<Bytes, String>> {
    if manifest.piece_size.is_none() {
        return futures_util::stream::iter(indices)
            .map(|index| {
                let (source, manifest) = (Arc::clone(&source), Arc::clone(&manifest));
                async move { source.fetch_chunk(&manifest, index).await.map_err(|e| e.to_string()) }
            })
            .buffered(FETCH_CONCURRENCY)
            .collect()
            .await;
    }
    let runs = piece_runs(&manifest, &indices);
    let fetched: Vec<Vec<Result<Bytes, String>>> = futures_util::stream::iter(runs)
        .map(|(first, count)| {
            let (source, manifest) = (Arc::clone(&source), Arc::clone(&manifest));
            async move {
                match source.fetch_pieces(&manifest, first, count).await {
                    Ok(pieces) if pieces.len() == count => pieces.into_iter().map(Ok).collect(),
                    Ok(pieces) => vec![Err(format!("{} pieces returned, {count} asked for", pieces.len())); count],
                    Err(e) => vec![Err(e.to_string()); count],
                }
            }
        })
        .buffered(FETCH_CONCURRENCY)
        .collect()
        .await;
    fetched.into_iter().flatten().collect()
}

/// Splits piece indices into `(first, count)` runs of consecutive pieces
/// inside one chunk, in order: one ranged GET each. `indices` must be
/// ascending (a claim's are); a break in the sequence starts a new run.
pub(crate) fn piece_runs(manifest: &LayerManifest, indices: &[usize]) -> Vec<(usize, usize)> {
    let per_chunk = manifest.piece_size.map_or(1, |p| (manifest.chunk_size / p).max(1));
    let chunk_of = |i: usize| u64::try_from(i).unwrap_or(u64::MAX) / per_chunk;
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &index in indices {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == index && chunk_of(*first) == chunk_of(index) => *count += 1,
            _ => runs.push((index, 1)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::LayerRole;

    const D: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

    fn layer(size: u64, chunk_size: u64, piece_size: u64) -> LayerManifest {
        let count = |unit: u64| usize::try_from(size.div_ceil(unit)).unwrap();
        LayerManifest {
            name: "l".into(),
            version: "1".into(),
            role: LayerRole::Base,
            digest: D.into(),
            size,
            chunk_size,
            chunks: vec![D.into(); count(chunk_size)],
            metadata_ranges: Vec::new(),
            metadata_blob: None,
            piece_size: Some(piece_size),
            pieces: vec![D.into(); count(piece_size)],
        }
    }

    #[test]
    fn neighbouring_pieces_of_one_chunk_coalesce_and_chunk_borders_split() {
        // 4 pieces per chunk: pieces 0-3 are chunk 0, 4-7 chunk 1.
        let l = layer(10 * 4096, 16384, 4096);
        l.validate().unwrap();
        assert_eq!(piece_runs(&l, &[0, 1, 2, 3]), [(0, 4)]);
        assert_eq!(piece_runs(&l, &[2, 3, 4, 5]), [(2, 2), (4, 2)]);
        assert_eq!(piece_runs(&l, &[0, 2, 3, 9]), [(0, 1), (2, 2), (9, 1)]);
        assert_eq!(piece_runs(&l, &[]), Vec::<(usize, usize)>::new());
        // Every run is a range fetch_pieces accepts.
        for (first, count) in piece_runs(&l, &[1, 2, 3, 4, 5, 6, 7, 8, 9]) {
            crate::blob::piece_run_range(&l, first, count).unwrap();
        }
        assert!(crate::blob::piece_run_range(&l, 3, 2).is_err());
    }
}

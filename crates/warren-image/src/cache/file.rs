//! One cached layer on disk: `<hex>.erofs` (the layer, sparse until
//! filled), `<hex>.json` (its manifest), `<hex>.present` (one byte per
//! fetch unit, 1 once the unit is written and verified) and `<hex>.meta`
//! (the metadata blob's digest, once all of its pages are written).
//!
//! The fetch unit is a piece when the manifest lists piece digests (see
//! `LayerManifest::piece_size`), else a whole chunk; below, "chunk" means
//! that unit. Presence is tracked at two granularities: units, and the
//! metadata pages written from the layer's metadata blob (all or none).
//! A read whose pages are all metadata needs no unit; a read that touches
//! a data page of a unit fetches the whole unit, verifies it and writes
//! it, rewriting any metadata pages in it with the same bytes.
//!
//! A layer whose metadata came as a blob also keeps a map of where each
//! regular file's data blocks lie, read from those metadata pages with
//! the push-time EROFS parser, so a miss can fetch a small file whole
//! (see [`LayerFile::fill`]).
//!
//! Invariant: a unit is marked present only after its bytes matched the
//! manifest's digest and were written; a present unit is never rewritten.
//! The metadata pages are marked present only after the whole blob matched
//! the manifest's digest and metadata map and every page was written.
//! Bytes outside present units and pages are never handed to a reader:
//! the fill daemon either writes the verified unit or denies the read.

use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::ops::{Range, RangeInclusive};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::error::{CacheError, IoContext, Result};
use super::prefetch::{Budget, LayerPrefetch};
use super::trace::TraceLog;
use super::LayerStats;
use crate::layer::{digest_hex, LayerManifest};

/// `(st_dev, st_ino)`: how a fanotify event's descriptor is matched to its
/// layer.
pub(crate) type InodeKey = (u64, u64);

/// Why a range could not be filled; the reader gets `EIO`.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FillError {
    #[error("piece or chunk {index}: fetch failed: {reason}")]
    Fetch { index: usize, reason: String },
    #[error("piece or chunk {index}: {reason}")]
    Corrupt { index: usize, reason: String },
    #[error("piece or chunk {index}: writing it: {source}")]
    Write {
        index: usize,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    Missing,
    /// Claimed by one filler; others wait for it to settle.
    Fetching,
    Present,
}

#[derive(Debug)]
struct Chunks {
    states: Vec<ChunkState>,
    present: usize,
    /// Units a prefetch wrote that no fill event has asked for yet.
    prefetched: Vec<bool>,
}

#[derive(Debug, Default)]
struct Counters {
    bytes_accessed: AtomicU64,
    bytes_fetched: AtomicU64,
    chunks_fetched: AtomicU64,
    metadata_chunks_fetched: AtomicU64,
    metadata_bytes_fetched: AtomicU64,
    cache_hits: AtomicU64,
    fill_events: AtomicU64,
    failed_fills: AtomicU64,
    prefetch_units: AtomicU64,
    prefetch_bytes: AtomicU64,
    prefetch_used: AtomicU64,
    prefetch_failed: AtomicU64,
    prefetch_requests: AtomicU64,
    whole_file_fills: AtomicU64,
    whole_file_units: AtomicU64,
    traces_published: AtomicU64,
    /// Trace replays (0 or 1 running: one per new layer).
    replay: BackgroundCounters,
    /// Background completions (0 or 1 running).
    completion: BackgroundCounters,
}

/// What one kind of background fetch stored, refused, and has running.
#[derive(Debug, Default)]
struct BackgroundCounters {
    units: AtomicU64,
    bytes: AtomicU64,
    failed: AtomicU64,
    /// Started and not ended.
    running: AtomicUsize,
}

/// What a background fetch of a layer's units is for; each counts apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Background {
    /// The units the layer's stored access trace names (see `trace`).
    TraceReplay,
    /// Every unit still missing, once the node has run the layer (see
    /// `CacheConfig::complete_after_use`).
    Completion,
}

/// What one fill event cost, for attributing it to its reader.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct FillOutcome {
    pub(crate) bytes_accessed: u64,
    pub(crate) bytes_fetched: u64,
    pub(crate) chunks_fetched: u64,
    /// The whole range was local when the event arrived.
    pub(crate) cache_hit: bool,
}

/// The fetcher a fill uses: one result per index, in the same order.
pub(crate) type FetchFn<'a> = dyn Fn(&[usize]) -> Vec<Result<Bytes, String>> + 'a;

#[derive(Debug)]
pub(crate) struct LayerFile {
    manifest: Arc<LayerManifest>,
    hex: String,
    path: PathBuf,
    /// Opened before the file is ever marked when the file is new or found
    /// after a reboot, so writes and reads through it raise no events; after
    /// an adoption it is used only to name the inode (mark, unmark, stat).
    file: File,
    bitmap: File,
    /// Where `meta_present` is persisted.
    meta_marker: PathBuf,
    key: InodeKey,
    digests: Vec<[u8; 32]>,
    /// The pages the metadata blob carries; empty for a manifest without
    /// one (its metadata arrives in whole chunks).
    meta_pages: Vec<Range<u64>>,
    meta_present: AtomicBool,
    chunks: Mutex<Chunks>,
    settled: Condvar,
    unmarked: AtomicBool,
    counters: Counters,
    prefetch: Arc<LayerPrefetch>,
    /// Where each regular file's data blocks lie (see `file_extents`):
    /// set once the layer's metadata is local, before it is marked; unset
    /// (misses fetch only their own units) if that could not be read.
    files: OnceLock<Vec<Range<u64>>>,
    /// The units readers asked for, for the layer's access trace.
    trace: Mutex<TraceLog>,
}

impl LayerFile {
    /// Creates the sparse layer file, its empty bitmap and its record.
    pub(crate) fn create(dir: &Path, manifest: &LayerManifest) -> Result<Self> {
        let hex = digest_hex(&manifest.digest)?.to_owned();
        let paths = Paths::new(dir, &hex);
        let json = manifest.to_json()?;
        fs::write(&paths.record, json).context(|| format!("writing {}", paths.record.display()))?;
        remove_if_present(&paths.meta);
        let file = create_sized(&paths.layer, manifest.size)?;
        let units = manifest.fetch_unit_digests().len();
        let bitmap = create_sized(&paths.bitmap, u64::try_from(units).unwrap_or(u64::MAX))?;
        Self::assemble(manifest.clone(), hex, paths, file, bitmap, vec![0; units], false)
    }

    /// Opens what an earlier run left for `hex`.
    pub(crate) fn load(dir: &Path, hex: &str) -> Result<Self> {
        let paths = Paths::new(dir, hex);
        let json = fs::read(&paths.record).context(|| format!("reading {}", paths.record.display()))?;
        let manifest = LayerManifest::from_json(&json)?;
        manifest.validate()?;
        if digest_hex(&manifest.digest)? != hex {
            return Err(corrupt(hex, "the record names another layer"));
        }
        let file = open_rw(&paths.layer)?;
        let len = file.metadata().context(|| format!("stat {}", paths.layer.display()))?.len();
        if len != manifest.size {
            return Err(corrupt(hex, &format!("file holds {len} bytes, the layer has {}", manifest.size)));
        }
        let bitmap = open_rw(&paths.bitmap)?;
        let mut marks = vec![0u8; manifest.fetch_unit_digests().len()];
        // A short bitmap (a crash while creating it) reads as missing chunks.
        let read = read_at_most(&bitmap, &mut marks).context(|| format!("reading {}", paths.bitmap.display()))?;
        marks[read..].fill(0);
        let meta_present = match (&manifest.metadata_blob, fs::read(&paths.meta)) {
            (Some(blob), Ok(recorded)) => recorded == blob.digest.as_bytes(),
            _ => false,
        };
        Self::assemble(manifest, hex.to_owned(), paths, file, bitmap, marks, meta_present)
    }

    fn assemble(
        manifest: LayerManifest,
        hex: String,
        paths: Paths,
        file: File,
        bitmap: File,
        marks: Vec<u8>,
        meta_present: bool,
    ) -> Result<Self> {
        let path = paths.layer;
        let digests = manifest.fetch_unit_digests().iter().map(|c| parse_digest(c)).collect::<Result<Vec<_>>>()?;
        let stat = rustix::fs::fstat(&file).context(|| format!("stat {}", path.display()))?;
        let states: Vec<ChunkState> =
            marks.iter().map(|&m| if m == 1 { ChunkState::Present } else { ChunkState::Missing }).collect();
        let present = states.iter().filter(|s| **s == ChunkState::Present).count();
        let prefetched = vec![false; states.len()];
        let units = states.len();
        let meta_pages = if manifest.metadata_blob.is_some() { manifest.metadata_pages() } else { Vec::new() };
        Ok(Self {
            manifest: Arc::new(manifest),
            hex,
            path,
            file,
            bitmap,
            meta_marker: paths.meta,
            key: (stat.st_dev, stat.st_ino),
            digests,
            meta_pages,
            meta_present: AtomicBool::new(meta_present),
            chunks: Mutex::new(Chunks { states, present, prefetched }),
            settled: Condvar::new(),
            unmarked: AtomicBool::new(false),
            counters: Counters::default(),
            prefetch: Arc::default(),
            files: OnceLock::new(),
            trace: Mutex::new(TraceLog::new(units)),
        })
    }

    /// Removes every file of `hex`; missing files are not an error.
    pub(crate) fn remove(dir: &Path, hex: &str) {
        let paths = Paths::new(dir, hex);
        for path in [&paths.layer, &paths.bitmap, &paths.meta, &paths.record] {
            remove_if_present(path);
        }
    }

    pub(crate) fn manifest(&self) -> &Arc<LayerManifest> {
        &self.manifest
    }

    pub(crate) fn hex(&self) -> &str {
        &self.hex
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn key(&self) -> InodeKey {
        self.key
    }

    /// The inode to mark and unmark.
    pub(crate) fn inode(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    pub(crate) fn is_complete(&self) -> bool {
        let chunks = self.lock();
        chunks.present == chunks.states.len()
    }

    /// Fill events readers of the mount have raised on the layer since this
    /// cache opened it; a lease notes it when made, so its release can tell
    /// whether the layer was read during its life.
    pub(crate) fn fill_events(&self) -> u64 {
        self.counters.fill_events.load(Ordering::Relaxed)
    }

    /// True the first time it is called on a complete layer: the moment to
    /// drop its mark, since no read of it needs a verdict any more.
    pub(crate) fn take_unmark_turn(&self) -> bool {
        self.is_complete() && !self.unmarked.swap(true, Ordering::AcqRel)
    }

    /// Re-hashes every chunk the bitmap calls present and forgets the ones
    /// that do not match (after a reboot the bitmap may be ahead of the
    /// data). Only for a file no group marks, or reads would raise events.
    pub(crate) fn verify_present(&self) -> Result<usize> {
        let present: Vec<usize> = {
            let chunks = self.lock();
            (0..chunks.states.len()).filter(|&i| chunks.states[i] == ChunkState::Present).collect()
        };
        let mut dropped = 0;
        let mut buf = Vec::new();
        for index in present {
            let (offset, len) = self.extent(index);
            buf.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
            let read = read_at_most_at(&self.file, &mut buf, offset).context(|| format!("reading {}", self.hex))?;
            if read != buf.len() || Sha256::digest(&buf).as_slice() != self.digests[index] {
                self.set_state(index, ChunkState::Missing);
                dropped += 1;
            }
        }
        if self.meta_present.load(Ordering::Acquire) && !self.metadata_pages_match()? {
            self.meta_present.store(false, Ordering::Release);
            remove_if_present(&self.meta_marker);
            dropped += 1;
        }
        if self.meta_present.load(Ordering::Acquire) {
            self.index_files_on_disk();
        }
        Ok(dropped)
    }

    /// Builds the file map from the metadata pages on disk. Reads through
    /// the file's own descriptor, so only while no group marks the file
    /// (as in `verify_present`): a read of a marked file from the daemon
    /// would wait for the daemon's own answer.
    fn index_files_on_disk(&self) {
        self.index_files(&self.file);
    }

    fn index_files<R: crate::erofs::format::ImageRead + ?Sized>(&self, image: &R) {
        if self.files.get().is_some() {
            return;
        }
        match crate::erofs::format::file_extents(image) {
            Ok(extents) => {
                let _ = self.files.set(extents);
            }
            Err(e) => tracing::warn!(layer = %self.hex, error = %e,
                "cannot map the layer's files; a miss fetches only what it reads"),
        }
    }

    /// The fetch units of the file whose data holds byte `at`, if it has
    /// at most `bound` bytes of data blocks.
    fn small_file_units(&self, at: u64, bound: u64) -> Option<RangeInclusive<usize>> {
        let files = self.files.get()?;
        let i = files.partition_point(|f| f.start <= at).checked_sub(1)?;
        let file = files.get(i).filter(|f| at < f.end && f.end - f.start <= bound)?;
        self.unit_span(file.start, file.end - file.start)
    }

    /// Whether the metadata pages on disk still make the blob the manifest
    /// names.
    fn metadata_pages_match(&self) -> Result<bool> {
        let Some(blob) = &self.manifest.metadata_blob else { return Ok(false) };
        match crate::metablob::encode(&self.file, &self.meta_pages) {
            Ok(bytes) => Ok(crate::metablob::digest(&bytes) == blob.digest),
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => Ok(false),
            Err(e) => Err(e).context(|| format!("reading the metadata of {}", self.hex)),
        }
    }

    /// Whether the layer's metadata comes as one blob that is not written
    /// yet: what must happen before it is mounted.
    pub(crate) fn needs_metadata_blob(&self) -> bool {
        self.manifest.metadata_blob.is_some() && !self.meta_present.load(Ordering::Acquire)
    }

    /// Checks the fetched metadata blob against the manifest and writes all
    /// of its pages, through the file's own (event-free) descriptor, before
    /// the file is marked. Nothing is written unless the whole blob checked.
    pub(crate) fn store_metadata_blob(&self, fetched: std::result::Result<Bytes, String>) -> Result<()> {
        let error = |reason: String| CacheError::Metadata { digest: self.manifest.digest.clone(), reason };
        let blob = fetched.map_err(|reason| error(format!("fetching the metadata blob: {reason}")))?;
        let r = self.manifest.metadata_blob.as_ref().ok_or_else(|| error("the layer has no metadata blob".into()))?;
        // What crossed the wire: the stored (compressed) form, if any.
        let wire = r.stored_size();
        self.counters.bytes_fetched.fetch_add(wire, Ordering::Relaxed);
        self.counters.metadata_bytes_fetched.fetch_add(wire, Ordering::Relaxed);
        let ranges = crate::metablob::decode(&blob, &r.digest, &self.meta_pages).map_err(|e| error(e.to_string()))?;
        for &(offset, bytes) in &ranges {
            self.file.write_all_at(bytes, offset).context(|| format!("writing the metadata of {}", self.hex))?;
        }
        // The blob holds every page an inode walk reads: no disk read.
        self.index_files(&crate::erofs::format::PagesImage { ranges: &ranges, len: self.manifest.size });
        // The marker trails the pages: a crash in between only costs a refetch.
        self.file.sync_data().context(|| format!("syncing {}", self.path.display()))?;
        fs::write(&self.meta_marker, r.digest.as_bytes())
            .context(|| format!("writing {}", self.meta_marker.display()))?;
        self.meta_present.store(true, Ordering::Release);
        // A chunk made only of metadata pages now holds the bytes the
        // manifest names (the blob matched it): no read will ever fetch it.
        for index in 0..self.digests.len() {
            let (start, len) = self.extent(index);
            if self.in_metadata_pages(start..start + len) && self.lock().states[index] == ChunkState::Missing {
                self.set_state(index, ChunkState::Present);
            }
        }
        Ok(())
    }

    /// Whether every byte of `range` lies in metadata pages already written.
    fn in_metadata_pages(&self, range: Range<u64>) -> bool {
        if range.is_empty() || !self.meta_present.load(Ordering::Acquire) {
            return false;
        }
        // The pages are sorted and merged, so one of them must hold it all.
        let i = self.meta_pages.partition_point(|p| p.end <= range.start);
        self.meta_pages.get(i).is_some_and(|p| p.start <= range.start && range.end <= p.end)
    }

    /// Chunks holding metadata that are not present yet: what must be local
    /// before the layer is mounted (none when the metadata comes as a blob).
    pub(crate) fn missing_metadata_chunks(&self) -> Vec<usize> {
        if self.manifest.metadata_blob.is_some() {
            return Vec::new();
        }
        let chunk_size = self.manifest.fetch_unit_size();
        let chunks = self.lock();
        let mut wanted: Vec<usize> = self
            .manifest
            .metadata_ranges
            .iter()
            .filter(|(_, len)| *len > 0)
            .flat_map(|&(offset, len)| chunk_index(offset, chunk_size)..=chunk_index(offset + len - 1, chunk_size))
            .filter(|&i| chunks.states.get(i) == Some(&ChunkState::Missing))
            .collect();
        wanted.dedup();
        wanted
    }

    /// Stores a chunk fetched before the file was marked, through the
    /// file's own (event-free) descriptor.
    pub(crate) fn store_prefetched(&self, index: usize, fetched: Result<Bytes, String>) -> Result<()> {
        let to_error =
            |e: FillError| CacheError::Chunk { digest: self.manifest.digest.clone(), index, reason: e.to_string() };
        let bytes = fetched.map_err(|reason| to_error(FillError::Fetch { index, reason }))?;
        self.count_fetched(&bytes);
        self.counters.metadata_chunks_fetched.fetch_add(1, Ordering::Relaxed);
        self.check_chunk(index, &bytes).map_err(to_error)?;
        let (offset, _) = self.extent(index);
        self.file.write_all_at(&bytes, offset).map_err(|source| to_error(FillError::Write { index, source }))?;
        self.set_state(index, ChunkState::Present);
        Ok(())
    }

    /// Makes `[offset, offset + count)` readable: fetches, verifies and
    /// writes (through `event_fd`, which raises no event) every chunk of the
    /// range not yet present, waiting for chunks another filler is fetching.
    ///
    /// With `whole_file_bytes` > 0 on a pieced layer, a miss in a file of
    /// at most that many data bytes first claims the missing units of the
    /// whole file (at the range's start and end): the same round trip
    /// brings them, and the file's next reads find them local. Only the
    /// range's own units decide the verdict: a bad unit elsewhere in the
    /// file stays missing for the read that needs it.
    pub(crate) fn fill(
        &self,
        event_fd: BorrowedFd<'_>,
        offset: u64,
        count: u64,
        whole_file_bytes: u64,
        fetch: &FetchFn<'_>,
        outcome: &mut FillOutcome,
    ) -> Result<(), FillError> {
        self.counters.fill_events.fetch_add(1, Ordering::Relaxed);
        let end = offset.saturating_add(count).min(self.manifest.size);
        if offset >= end {
            self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
            outcome.cache_hit = true;
            return Ok(());
        }
        self.counters.bytes_accessed.fetch_add(end - offset, Ordering::Relaxed);
        outcome.bytes_accessed += end - offset;
        let unit = self.manifest.fetch_unit_size();
        let span = chunk_index(offset, unit)..=chunk_index(end - 1, unit);
        self.trace_log().record(span.clone());
        // Chunks whose part of the range is all metadata pages already here.
        let covered: Vec<usize> = span
            .clone()
            .filter(|&index| {
                let (start, len) = self.extent(index);
                self.in_metadata_pages(offset.max(start)..end.min(start + len))
            })
            .collect();
        let mut first_look = true;
        if let Some(wide) = self.whole_file_span(offset, end, whole_file_bytes).filter(|w| *w != span) {
            let (claim, _) = self.claim(wide, &covered);
            let extra = claim.indices.iter().filter(|i| !span.contains(i)).count();
            if !claim.indices.is_empty() {
                first_look = false;
                if extra > 0 {
                    self.counters.whole_file_fills.fetch_add(1, Ordering::Relaxed);
                    self.counters.whole_file_units.fetch_add(u64::try_from(extra).unwrap_or(0), Ordering::Relaxed);
                }
                self.fetch_into(event_fd, claim, &span, fetch, outcome).inspect_err(|_| {
                    self.counters.failed_fills.fetch_add(1, Ordering::Relaxed);
                })?;
            }
        }
        loop {
            let (claim, others_fetching) = self.claim(span.clone(), &covered);
            if claim.indices.is_empty() && !others_fetching {
                if first_look {
                    self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
                    outcome.cache_hit = true;
                }
                return Ok(());
            }
            first_look = false;
            if !claim.indices.is_empty() {
                self.fetch_into(event_fd, claim, &span, fetch, outcome).inspect_err(|_| {
                    self.counters.failed_fills.fetch_add(1, Ordering::Relaxed);
                })?;
            }
            if others_fetching {
                self.wait_settled(span.clone());
            }
        }
    }

    /// The units of `[offset, end)` widened to the small files its ends lie
    /// in; `None` when whole-file fetching does not apply.
    fn whole_file_span(&self, offset: u64, end: u64, bound: u64) -> Option<RangeInclusive<usize>> {
        // Whole-chunk layers already bring a chunk per miss.
        if bound == 0 || self.manifest.piece_size.is_none() {
            return None;
        }
        let demand = self.unit_span(offset, end - offset)?;
        let (mut first, mut last) = (*demand.start(), *demand.end());
        for at in [offset, end - 1] {
            if let Some(file) = self.small_file_units(at, bound) {
                first = first.min(*file.start());
                last = last.max(*file.end());
            }
        }
        Some(first..=last)
    }

    /// The fetch units `[offset, offset + count)` touches, if any.
    pub(crate) fn unit_span(&self, offset: u64, count: u64) -> Option<RangeInclusive<usize>> {
        let end = offset.saturating_add(count).min(self.manifest.size);
        let unit = self.manifest.fetch_unit_size();
        (offset < end).then(|| chunk_index(offset, unit)..=chunk_index(end - 1, unit))
    }

    /// Answers an event whose range is all local without fetching: the
    /// counters of a cache hit, or `None` if some of it is missing or being
    /// fetched (then [`Self::fill`] must run).
    pub(crate) fn try_hit(&self, offset: u64, count: u64) -> Option<FillOutcome> {
        let end = offset.saturating_add(count).min(self.manifest.size);
        let mut outcome = FillOutcome { cache_hit: true, ..FillOutcome::default() };
        if let Some(span) = self.unit_span(offset, count) {
            let mut used = 0;
            {
                let mut chunks = self.lock();
                for index in span.clone() {
                    if chunks.states[index] != ChunkState::Present {
                        let (start, len) = self.extent(index);
                        if !self.in_metadata_pages(offset.max(start)..end.min(start + len)) {
                            return None;
                        }
                    }
                }
                for index in span.clone() {
                    used += u64::from(std::mem::take(&mut chunks.prefetched[index]));
                }
            }
            self.trace_log().record(span);
            self.counters.prefetch_used.fetch_add(used, Ordering::Relaxed);
            self.counters.bytes_accessed.fetch_add(end - offset, Ordering::Relaxed);
            outcome.bytes_accessed = end - offset;
        }
        self.counters.fill_events.fetch_add(1, Ordering::Relaxed);
        self.counters.cache_hits.fetch_add(1, Ordering::Relaxed);
        Some(outcome)
    }

    /// How many bytes from `offset` on are present, up to `max`: a range
    /// the layer file can be read ahead in without anything being fetched.
    pub(crate) fn local_bytes_from(&self, offset: u64, max: u64) -> u64 {
        let end = offset.saturating_add(max).min(self.manifest.size);
        let Some(span) = self.unit_span(offset, end.saturating_sub(offset)) else { return 0 };
        let chunks = self.lock();
        let reach = span.take_while(|&i| chunks.states[i] == ChunkState::Present).last().map_or(offset, |i| {
            let (start, len) = self.extent(i);
            start + len
        });
        reach.min(end).saturating_sub(offset)
    }

    fn trace_log(&self) -> MutexGuard<'_, TraceLog> {
        self.trace.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the access trace's recording (see `trace`: the mount's window
    /// widened).
    pub(crate) fn close_trace(&self) {
        self.trace_log().close();
    }

    /// Starts the access trace with the one a replay fetched (see `trace`).
    pub(crate) fn seed_trace(&self, units: &[usize]) {
        self.trace_log().seed(units);
    }

    /// The trace to publish, if this node recorded units beyond the stored
    /// one.
    pub(crate) fn take_trace(&self) -> Option<Vec<u8>> {
        self.trace_log().take_unpublished(self.manifest.fetch_unit_size())
    }

    pub(crate) fn count_trace_published(&self) {
        self.counters.traces_published.fetch_add(1, Ordering::Relaxed);
    }

    /// The units of `units` not present yet, in the same order.
    pub(crate) fn missing_of(&self, units: &[usize]) -> Vec<usize> {
        let chunks = self.lock();
        units.iter().copied().filter(|&i| chunks.states.get(i) == Some(&ChunkState::Missing)).collect()
    }

    /// Every unit not present yet, in layer order.
    pub(crate) fn missing_units(&self) -> Vec<usize> {
        let chunks = self.lock();
        (0..chunks.states.len()).filter(|&i| chunks.states[i] == ChunkState::Missing).collect()
    }

    /// Claims the missing units of `first..first + count` for a background
    /// fetch (readers of them wait for it, as for a prefetch); `None`
    /// when none is missing (a read or prefetch got there first).
    pub(crate) fn claim_background(self: &Arc<Self>, first: usize, count: usize) -> Option<PrefetchClaim> {
        let mut chunks = self.lock();
        let end = first.saturating_add(count).min(chunks.states.len());
        let mut claim = PrefetchClaim { file: Arc::clone(self), indices: Vec::new() };
        for index in first..end {
            if chunks.states[index] == ChunkState::Missing {
                chunks.states[index] = ChunkState::Fetching;
                claim.indices.push(index);
            }
        }
        drop(chunks);
        (!claim.indices.is_empty()).then_some(claim)
    }

    /// Marks a background fetch of this layer as running until the
    /// returned guard drops (see [`LayerStats::trace_replays_running`] and
    /// [`LayerStats::completion_running`]).
    pub(crate) fn background_running(self: &Arc<Self>, kind: Background) -> BackgroundRunning {
        self.background_counters(kind).running.fetch_add(1, Ordering::AcqRel);
        BackgroundRunning { file: Arc::clone(self), kind }
    }

    fn background_counters(&self, kind: Background) -> &BackgroundCounters {
        match kind {
            Background::TraceReplay => &self.counters.replay,
            Background::Completion => &self.counters.completion,
        }
    }

    /// Checks and stores what a background fetch got for `claim` (one
    /// result per claimed unit, in the claim's order) through the file's
    /// own descriptor: it was opened before the inode was ever marked, so
    /// its writes raise no event, also while the layer is mounted and
    /// marked. A unit that fails its check or its fetch goes back to
    /// missing for a read to fetch on demand (or fail with `EIO`); returns
    /// how many were stored.
    pub(crate) fn store_background(
        &self,
        kind: Background,
        mut claim: PrefetchClaim,
        fetched: Vec<Result<Bytes, String>>,
    ) -> usize {
        let counters = self.background_counters(kind);
        let indices = claim.indices.clone();
        let mut results = fetched.into_iter();
        let mut stored = 0;
        for index in indices {
            let result = results.next().unwrap_or_else(|| Err("no result from the fetcher".to_owned()));
            if self.prefetch.is_closed() {
                // Closed (unmounted, evicted): the claim puts the rest back.
                return stored;
            }
            let written = result.map_err(|reason| FillError::Fetch { index, reason }).and_then(|bytes| {
                self.count_fetched(&bytes);
                self.check_chunk(index, &bytes)?;
                let (offset, _) = self.extent(index);
                self.file.write_all_at(&bytes, offset).map_err(|source| FillError::Write { index, source })?;
                Ok(bytes.len())
            });
            match written {
                Ok(len) => {
                    // Present first: a counter never runs ahead of the data.
                    claim.settle(index, ChunkState::Present);
                    counters.units.fetch_add(1, Ordering::Relaxed);
                    counters.bytes.fetch_add(u64::try_from(len).unwrap_or(u64::MAX), Ordering::Relaxed);
                    stored += 1;
                }
                Err(e) => {
                    tracing::warn!(layer = %self.hex, ?kind, error = %e, "a unit fetched in the background refused; a read will fetch it again");
                    claim.settle(index, ChunkState::Missing);
                    counters.failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        stored
    }

    pub(crate) fn prefetch_state(&self) -> &Arc<LayerPrefetch> {
        &self.prefetch
    }

    /// Plans the prefetch an event over units `first..=last` calls for:
    /// advances the layer's streams, clips the window to one chunk, claims
    /// its missing units and takes one request per run of them from the
    /// layer's budget (dropping the runs past what the budget allows).
    pub(crate) fn plan_prefetch(
        self: &Arc<Self>,
        span: RangeInclusive<usize>,
        max_window: usize,
        max_requests: usize,
    ) -> Option<(PrefetchClaim, Budget)> {
        let per_chunk = self.manifest.piece_size.map_or(1, |p| (self.manifest.chunk_size / p).max(1));
        let per_chunk = usize::try_from(per_chunk).unwrap_or(usize::MAX);
        let mut streams = self.prefetch.streams.lock().unwrap_or_else(PoisonError::into_inner);
        let (stream, wanted) = streams.advance(*span.start(), *span.end(), max_window);
        let chunk_end = (wanted.start / per_chunk).saturating_add(1).saturating_mul(per_chunk);
        let end = wanted.end.min(chunk_end).min(self.digests.len());
        if wanted.start >= end {
            return None;
        }
        let missing: Vec<usize> = {
            let chunks = self.lock();
            (wanted.start..end).filter(|&i| chunks.states[i] == ChunkState::Missing).collect()
        };
        if missing.is_empty() {
            // All local or in flight already: the stream moves on.
            streams.claimed(stream, end);
            return None;
        }
        let runs = 1 + missing.windows(2).filter(|w| w[1] != w[0] + 1).count();
        // No budget: nothing is claimed and the stream asks again next time.
        let budget = self.prefetch.take_budget(runs, max_requests)?;
        // Keep the runs the budget covers; a cut plan resumes where it was cut.
        let mut kept_runs = 0;
        let cut = missing
            .iter()
            .enumerate()
            .position(|(i, &index)| {
                if i == 0 || missing[i - 1] + 1 != index {
                    kept_runs += 1;
                }
                kept_runs > budget.requests()
            })
            .unwrap_or(missing.len());
        let mut claim = PrefetchClaim { file: Arc::clone(self), indices: Vec::new() };
        {
            let mut chunks = self.lock();
            for &index in &missing[..cut] {
                if chunks.states[index] == ChunkState::Missing {
                    chunks.states[index] = ChunkState::Fetching;
                    claim.indices.push(index);
                }
            }
        }
        streams.claimed(stream, missing.get(cut).copied().unwrap_or(end));
        if claim.indices.is_empty() {
            return None;
        }
        self.counters.prefetch_requests.fetch_add(u64::try_from(budget.requests()).unwrap_or(0), Ordering::Relaxed);
        Some((claim, budget))
    }

    /// Checks and writes what a prefetch fetched, through `fd` (which
    /// raises no event), unless the layer was closed meanwhile; each unit
    /// that fails stays missing for a demand fill to fetch again.
    pub(crate) fn store_prefetch(
        &self,
        mut claim: PrefetchClaim,
        fetched: Vec<Result<Bytes, String>>,
        fd: BorrowedFd<'_>,
    ) {
        let indices = claim.indices.clone();
        let mut results = fetched.into_iter();
        for index in indices {
            let result = results.next().unwrap_or_else(|| Err("no result from the fetcher".to_owned()));
            if self.prefetch.is_closed() {
                return;
            }
            let stored = result.map_err(|reason| FillError::Fetch { index, reason }).and_then(|bytes| {
                self.count_fetched(&bytes);
                self.counters.prefetch_units.fetch_add(1, Ordering::Relaxed);
                let len = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
                self.counters.prefetch_bytes.fetch_add(len, Ordering::Relaxed);
                self.check_chunk(index, &bytes)?;
                let (offset, _) = self.extent(index);
                write_all_at(fd, &bytes, offset).map_err(|source| FillError::Write { index, source })
            });
            match stored {
                Ok(()) => {
                    self.lock().prefetched[index] = true;
                    claim.settle(index, ChunkState::Present);
                }
                Err(e) => {
                    tracing::warn!(layer = %self.hex, error = %e, "prefetch refused; a read will fetch it again");
                    self.counters.prefetch_failed.fetch_add(1, Ordering::Relaxed);
                    claim.settle(index, ChunkState::Missing);
                }
            }
        }
    }

    /// Fetches, checks and writes the claimed units; fails if one inside
    /// `demand` failed (one outside is logged and stays missing).
    fn fetch_into(
        &self,
        event_fd: BorrowedFd<'_>,
        mut claim: Claim<'_>,
        demand: &RangeInclusive<usize>,
        fetch: &FetchFn<'_>,
        outcome: &mut FillOutcome,
    ) -> Result<(), FillError> {
        let indices = claim.indices.clone();
        let mut results = fetch(&indices).into_iter();
        let mut failure = None;
        for index in indices {
            let fetched = results.next().unwrap_or_else(|| Err("no result from the fetcher".to_owned()));
            let stored = fetched.map_err(|reason| FillError::Fetch { index, reason }).and_then(|bytes| {
                self.count_fetched(&bytes);
                outcome.chunks_fetched += 1;
                outcome.bytes_fetched += u64::try_from(bytes.len()).unwrap_or(u64::MAX);
                self.check_chunk(index, &bytes)?;
                let (offset, _) = self.extent(index);
                write_all_at(event_fd, &bytes, offset).map_err(|source| FillError::Write { index, source })
            });
            match stored {
                Ok(()) => claim.settle(index, ChunkState::Present),
                Err(e) if demand.contains(&index) => {
                    claim.settle(index, ChunkState::Missing);
                    failure.get_or_insert(e);
                }
                Err(e) => {
                    tracing::warn!(layer = %self.hex, error = %e, "a unit of a small file refused; a read will fetch it again");
                    claim.settle(index, ChunkState::Missing);
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Marks every missing chunk of `span` as ours to fetch; reports whether
    /// other fillers are fetching some of the rest.
    fn claim(&self, span: RangeInclusive<usize>, covered: &[usize]) -> (Claim<'_>, bool) {
        let mut chunks = self.lock();
        let mut indices = Vec::new();
        let mut others = false;
        for index in span.filter(|i| !covered.contains(i)) {
            match chunks.states[index] {
                ChunkState::Missing => {
                    chunks.states[index] = ChunkState::Fetching;
                    indices.push(index);
                }
                ChunkState::Fetching => others = true,
                ChunkState::Present => {
                    if std::mem::take(&mut chunks.prefetched[index]) {
                        self.counters.prefetch_used.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        (Claim { file: self, indices }, others)
    }

    fn wait_settled(&self, span: RangeInclusive<usize>) {
        let chunks = self.lock();
        let _settled = self
            .settled
            .wait_while(chunks, |c| c.states[span.clone()].contains(&ChunkState::Fetching))
            .unwrap_or_else(PoisonError::into_inner);
    }

    fn set_state(&self, index: usize, state: ChunkState) {
        let mut chunks = self.lock();
        let was_present = chunks.states[index] == ChunkState::Present;
        chunks.states[index] = state;
        match (was_present, state == ChunkState::Present) {
            (false, true) => chunks.present += 1,
            (true, false) => chunks.present -= 1,
            _ => {}
        }
        drop(chunks);
        self.settled.notify_all();
        // The bitmap trails the data: losing this write only costs a refetch.
        let mark = [u8::from(state == ChunkState::Present)];
        let at = u64::try_from(index).unwrap_or(u64::MAX);
        if let Err(e) = self.bitmap.write_all_at(&mark, at) {
            tracing::warn!(layer = %self.hex, index, error = %e, "could not record a chunk's state");
        }
    }

    fn check_chunk(&self, index: usize, bytes: &[u8]) -> Result<(), FillError> {
        let (_, len) = self.extent(index);
        if u64::try_from(bytes.len()).ok() != Some(len) {
            return Err(FillError::Corrupt { index, reason: format!("{} bytes, expected {len}", bytes.len()) });
        }
        if Sha256::digest(bytes).as_slice() != self.digests[index] {
            return Err(FillError::Corrupt { index, reason: "digest mismatch".to_owned() });
        }
        Ok(())
    }

    fn count_fetched(&self, bytes: &[u8]) {
        self.counters.chunks_fetched.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_fetched.fetch_add(u64::try_from(bytes.len()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn extent(&self, index: usize) -> (u64, u64) {
        // Indices come from `chunk_index` over in-bounds offsets or from the
        // state vector, both sized by the validated manifest.
        self.manifest.fetch_unit_extent(index).unwrap_or((self.manifest.size, 0))
    }

    fn lock(&self) -> MutexGuard<'_, Chunks> {
        self.chunks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn stats(&self, leases: usize, mounted: bool) -> LayerStats {
        let present_chunks = {
            let chunks = self.lock();
            (0..chunks.states.len()).filter(|&i| chunks.states[i] == ChunkState::Present).collect::<Vec<_>>()
        };
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LayerStats {
            digest: self.manifest.digest.clone(),
            size_bytes: self.manifest.size,
            present_bytes: present_chunks.iter().map(|&i| self.extent(i).1).sum(),
            bytes_accessed: load(&self.counters.bytes_accessed),
            bytes_fetched: load(&self.counters.bytes_fetched),
            chunks_fetched: load(&self.counters.chunks_fetched),
            metadata_chunks_fetched: load(&self.counters.metadata_chunks_fetched),
            metadata_bytes_fetched: load(&self.counters.metadata_bytes_fetched),
            cache_hits: load(&self.counters.cache_hits),
            fill_events: load(&self.counters.fill_events),
            failed_fills: load(&self.counters.failed_fills),
            prefetched_units: load(&self.counters.prefetch_units),
            prefetched_bytes: load(&self.counters.prefetch_bytes),
            prefetched_units_used: load(&self.counters.prefetch_used),
            failed_prefetches: load(&self.counters.prefetch_failed),
            prefetch_requests: load(&self.counters.prefetch_requests),
            prefetch_requests_in_flight: self.prefetch.requests_in_flight(),
            whole_file_fills: load(&self.counters.whole_file_fills),
            whole_file_units: load(&self.counters.whole_file_units),
            trace_units_replayed: load(&self.counters.replay.units),
            trace_bytes_replayed: load(&self.counters.replay.bytes),
            failed_trace_units: load(&self.counters.replay.failed),
            traced_units: u64::try_from(self.trace_log().len()).unwrap_or(u64::MAX),
            traces_published: load(&self.counters.traces_published),
            trace_replays_running: self.counters.replay.running.load(Ordering::Acquire),
            completion_units: load(&self.counters.completion.units),
            completion_bytes: load(&self.counters.completion.bytes),
            failed_completion_units: load(&self.counters.completion.failed),
            completion_running: self.counters.completion.running.load(Ordering::Acquire),
            leases,
            mounted,
        }
    }
}

/// Chunks one filler claimed; any it did not settle (a panic, an early
/// return) go back to missing, so no other filler waits on them forever.
struct Claim<'a> {
    file: &'a LayerFile,
    indices: Vec<usize>,
}

impl Claim<'_> {
    fn settle(&mut self, index: usize, state: ChunkState) {
        self.indices.retain(|&i| i != index);
        self.file.set_state(index, state);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        for index in std::mem::take(&mut self.indices) {
            self.file.set_state(index, ChunkState::Missing);
        }
    }
}

/// Units a prefetch claimed; like [`Claim`], but owning its layer so it
/// can travel with the prefetch task. Units not settled (an aborted task)
/// go back to missing.
pub(crate) struct PrefetchClaim {
    file: Arc<LayerFile>,
    indices: Vec<usize>,
}

impl PrefetchClaim {
    pub(crate) fn indices(&self) -> &[usize] {
        &self.indices
    }

    fn settle(&mut self, index: usize, state: ChunkState) {
        self.indices.retain(|&i| i != index);
        self.file.set_state(index, state);
    }
}

impl Drop for PrefetchClaim {
    fn drop(&mut self) {
        for index in std::mem::take(&mut self.indices) {
            self.file.set_state(index, ChunkState::Missing);
        }
    }
}

/// A running background fetch of one layer; counted until dropped (when
/// it ends, is aborted, or never started).
pub(crate) struct BackgroundRunning {
    file: Arc<LayerFile>,
    kind: Background,
}

impl Drop for BackgroundRunning {
    fn drop(&mut self) {
        self.file.background_counters(self.kind).running.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Paths {
    layer: PathBuf,
    record: PathBuf,
    bitmap: PathBuf,
    meta: PathBuf,
}

impl Paths {
    fn new(dir: &Path, hex: &str) -> Self {
        Self {
            layer: dir.join(format!("{hex}.erofs")),
            record: dir.join(format!("{hex}.json")),
            bitmap: dir.join(format!("{hex}.present")),
            meta: dir.join(format!("{hex}.meta")),
        }
    }
}

/// The `<hex>` of a cache file name the cache owns, if it is one.
pub(crate) fn owned_file_hex(name: &str) -> Option<&str> {
    let (hex, ext) = name.rsplit_once('.')?;
    let is_hex = hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    (is_hex && matches!(ext, "erofs" | "json" | "present" | "meta")).then_some(hex)
}

fn chunk_index(offset: u64, chunk_size: u64) -> usize {
    usize::try_from(offset / chunk_size).unwrap_or(usize::MAX)
}

fn parse_digest(digest: &str) -> Result<[u8; 32]> {
    let hex = digest_hex(digest)?;
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        // digest_hex guarantees 64 lowercase hex digits.
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| corrupt(hex, "bad chunk digest"))?;
    }
    Ok(out)
}

fn corrupt(hex: &str, reason: &str) -> CacheError {
    CacheError::Unusable { hex: hex.to_owned(), reason: reason.to_owned() }
}

fn remove_if_present(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a cached layer file");
        }
    }
}

fn create_sized(path: &Path, len: u64) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .context(|| format!("creating {}", path.display()))?;
    file.set_len(len).context(|| format!("sizing {}", path.display()))?;
    Ok(file)
}

fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new().read(true).write(true).open(path).context(|| format!("opening {}", path.display()))
}

fn read_at_most(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    read_at_most_at(file, buf, 0)
}

/// Reads until `buf` is full or the file ends.
fn read_at_most_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let at = offset + u64::try_from(done).unwrap_or(u64::MAX);
        match file.read_at(&mut buf[done..], at) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

fn write_all_at(fd: BorrowedFd<'_>, mut bytes: &[u8], mut offset: u64) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match rustix::io::pwrite(fd, bytes, offset) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => {
                bytes = &bytes[n..];
                offset += u64::try_from(n).unwrap_or(u64::MAX);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

//! The node's layer cache: every layer a sandbox uses is one local EROFS
//! file, mounted once per node (read-only, file-backed) and filled lazily.
//!
//! A layer file starts sparse with only its metadata local (what EROFS
//! reads without raising events): the pages of its metadata blob, written
//! at page granularity, or for a manifest from before metadata blobs every
//! chunk that holds metadata. It is marked for fanotify
//! pre-content events, then mounted, with a small readahead window
//! ([`DEFAULT_READAHEAD_KB`]: every byte readahead asks for is fetched),
//! widened ([`DEFAULT_WARM_READAHEAD_KB`]) once a sandbox that read from
//! the layer has let go of it: the node then holds what such a workload
//! reads, and a wide window over local data costs one event instead of
//! eight. A
//! read of a range not yet local waits in the kernel while the fill daemon
//! fetches what covers it - the pieces (one ranged GET per run of
//! neighbouring pieces of one chunk) when the manifest has piece digests,
//! else whole chunks - checks each against the manifest's digest and
//! writes it through the event's descriptor; one that cannot be fetched
//! or does not match fails the read with `EIO`. A reader moving forward
//! through a layer gets the pieces just past its reads fetched in the
//! background, checked the same way (`prefetch`); an event whose range is
//! local already is answered from the event thread.
//!
//! Invariants: a reader never gets bytes that are not the layer's. An
//! unfilled range errors or waits, never reads as zeros, also while no
//! daemon runs: a holder process ([`holder_main`]) keeps the fanotify group
//! open, and the next cache opened on the directory adopts it and answers
//! the waiting readers. A leased layer is never evicted, and the layer
//! files together never exceed the capacity (counted at their full size, so
//! lazy filling can never overrun the disk budget).
//!
//! Never parses or runs anything from a layer: the kernel's EROFS driver is
//! the only reader of its contents.

mod daemon;
mod error;
mod fanotify;
mod file;
mod holder;
mod mount;
mod prefetch;
mod readers;
mod trace;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::SystemTime;

use rustix::fs::FlockOperation;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::blob::ChunkSource;
use crate::layer::{digest_hex, LayerManifest};
use daemon::{deny_orphaned_events, fetch_batch, Daemon, HighWater, Shared};
use error::IoContext;
pub use error::{CacheError, Result};
use fanotify::Group;
use file::{owned_file_hex, Background, LayerFile};
use futures_util::StreamExt;
pub use holder::{holder_main, HolderCommand, HOLDER_ARG, HOLDER_CONTROL_FD, HOLDER_GROUP_FD};
use holder::{Adopted, Holder};
pub use prefetch::{
    PrefetchConfig, DEFAULT_PREFETCH_KB, DEFAULT_PREFETCH_REQUESTS, DEFAULT_TRACE_REQUESTS, DEFAULT_WHOLE_FILE_KB,
};
pub use readers::ReaderStats;
use readers::Readers;

pub const DEFAULT_FILL_THREADS: usize = 4;
/// Readahead window of a lazily filled layer mount, in KiB (the kernel's
/// default is 128). Every byte a readahead window covers is a byte the
/// fill daemon must fetch, whether or not the reader wants it; chosen by
/// the lazy-loading benchmark (`docs/images.md`).
pub const DEFAULT_READAHEAD_KB: u32 = 16;
/// Readahead window of a layer mount once the node has run something from
/// the layer (a lease during whose life it was read ended), in KiB: the kernel's
/// default. Chosen by the lazy-loading benchmark (`docs/images.md`).
pub const DEFAULT_WARM_READAHEAD_KB: u32 = 128;
/// Ranged GETs in flight while a layer is completed in the background:
/// fewer than a trace replay's, since no reader is waiting for them and
/// demand fills share the link.
const COMPLETION_REQUESTS: usize = 4;
/// Held exclusively by the one cache that owns a directory.
const LOCK_FILE: &str = ".lock";
const HOLDER_RECORD: &str = "holder.json";
const HIGH_WATER: &str = "event-fd-high-water";
const MOUNT_DIR: &str = "mnt";
const READ_THROUGH_BYTES: usize = 1 << 20;
/// A trace replay sorts the trace's units within blocks of this many (see
/// [`replay_order`]).
const REPLAY_BLOCK_UNITS: usize = 64;

/// Where and how big the cache is, and how to start its holder.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub dir: PathBuf,
    pub capacity_bytes: u64,
    pub holder: HolderCommand,
    /// Events filled concurrently.
    pub fill_threads: usize,
    /// Readahead window set on each layer mount the cache makes (KiB);
    /// `None` keeps the kernel's default.
    pub readahead_kb: Option<u32>,
    /// Window the mount gets instead once a lease during whose life readers
    /// raised events on the layer ends (other leases may live on), and
    /// from the start for a complete
    /// layer (KiB); `None` keeps the first window. Files already open keep
    /// the window they opened with.
    pub warm_readahead_kb: Option<u32>,
    /// Whether the cache fetches every missing unit of a layer in the
    /// background once the node has run it (at the same moment the window
    /// widens), so that later reads need no event and no daemon at all:
    /// a complete layer is unmarked. Costs the rest of the layer's bytes
    /// from the store, once per node. Off in `CacheConfig::new`; the node
    /// turns it on by default (its policy, not the cache's).
    pub complete_after_use: bool,
    /// How far ahead of sequential readers the daemon fetches, and with how
    /// many requests in flight per layer (see `prefetch`).
    pub prefetch: PrefetchConfig,
}

impl CacheConfig {
    /// A cache whose holder is this executable run with [`HOLDER_ARG`].
    pub fn new(dir: impl Into<PathBuf>, capacity_bytes: u64) -> Result<Self> {
        let holder = HolderCommand::current_exe().context(|| "locating the running executable".into())?;
        Ok(Self {
            dir: dir.into(),
            capacity_bytes,
            holder,
            fill_threads: DEFAULT_FILL_THREADS,
            readahead_kb: Some(DEFAULT_READAHEAD_KB),
            warm_readahead_kb: Some(DEFAULT_WARM_READAHEAD_KB),
            complete_after_use: false,
            prefetch: PrefetchConfig::default(),
        })
    }
}

/// What one cached layer cost and served since this cache opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LayerStats {
    pub digest: String,
    pub size_bytes: u64,
    /// Bytes of the layer held locally (verified chunks, or pieces).
    pub present_bytes: u64,
    /// Sum of the ranges readers asked the daemon for.
    pub bytes_accessed: u64,
    /// Bytes fetched from the store, metadata prefill included.
    pub bytes_fetched: u64,
    /// Fetch units fetched: whole chunks, or pieces for a layer whose
    /// manifest lists piece digests.
    pub chunks_fetched: u64,
    /// Chunks fetched before mounting because they hold metadata (layers
    /// whose manifest has no metadata blob).
    pub metadata_chunks_fetched: u64,
    /// Bytes of metadata blobs fetched before mounting.
    pub metadata_bytes_fetched: u64,
    /// Events whose range was already local when they arrived (the page
    /// cache had dropped pages the file holds).
    pub cache_hits: u64,
    pub fill_events: u64,
    /// Events answered with `EIO`.
    pub failed_fills: u64,
    /// Fetch units fetched ahead of a sequential reader (counted in
    /// `chunks_fetched` and `bytes_fetched` too), and their bytes.
    pub prefetched_units: u64,
    pub prefetched_bytes: u64,
    /// Prefetched units a later read asked for: what prefetching saved.
    pub prefetched_units_used: u64,
    /// Prefetched units refused (fetch failed or digest mismatch); they
    /// stay missing.
    pub failed_prefetches: u64,
    /// Ranged GETs prefetching issued.
    pub prefetch_requests: u64,
    /// Prefetch requests planned whose units are not yet written and
    /// settled; 0 means every prefetch so far has landed (or failed).
    pub prefetch_requests_in_flight: usize,
    /// Misses that also fetched the rest of the small file they fell in
    /// (see `PrefetchConfig::whole_file_bytes`), and the units they
    /// fetched beyond the reads' own (counted in `chunks_fetched` too).
    pub whole_file_fills: u64,
    pub whole_file_units: u64,
    /// Units fetched because the layer's stored access trace named them
    /// (counted in `chunks_fetched` too), their bytes, and those refused
    /// (fetch failed or digest mismatch; left missing).
    pub trace_units_replayed: u64,
    pub trace_bytes_replayed: u64,
    pub failed_trace_units: u64,
    /// Units in this node's access trace of the layer (the replayed trace
    /// and what readers asked for since), and how many times this node
    /// stored it.
    pub traced_units: u64,
    pub traces_published: u64,
    /// Trace replays of the layer still running (0 or 1): the replay runs
    /// beside the layer's first readers, and its counters are final at 0.
    pub trace_replays_running: usize,
    /// Units fetched by the layer's background completion (counted in
    /// `chunks_fetched` and `bytes_fetched` too), their bytes, and those
    /// refused (left missing), with `complete_after_use`.
    pub completion_units: u64,
    pub completion_bytes: u64,
    pub failed_completion_units: u64,
    /// Background completions of the layer still running (0 or 1).
    pub completion_running: usize,
    pub leases: usize,
    pub mounted: bool,
}

/// Sets a layer mount's readahead window; failing only costs fetches or
/// read time, so it is logged.
fn set_window(hex: &str, target: &Path, kb: u32) {
    if let Err(e) = mount::set_readahead_kb(target, kb) {
        tracing::warn!(layer = hex, kb, error = %e, "cannot set the layer mount's readahead");
    }
}

/// The node's cache of lazily filled layers. Dropping it stops its daemon
/// but leaves mounts and holder up, as a crash would: the next cache opened
/// on the directory takes over. [`LayerCache::shutdown`] tears down.
pub struct LayerCache {
    inner: Arc<Inner>,
    daemon: Option<Daemon>,
}

/// A use of one mounted layer; the layer stays mounted and unevictable
/// while any lease on it lives.
#[derive(Debug)]
pub struct LayerLease {
    inner: Arc<Inner>,
    hex: String,
    digest: String,
    mount: PathBuf,
    file: PathBuf,
    /// The layer's fill events when the lease was made (see `release`).
    events_at_start: u64,
}

impl LayerLease {
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The layer's read-only mount, shared by every lease on it.
    pub fn mount_path(&self) -> &Path {
        &self.mount
    }

    /// The local layer file (a raw EROFS image once complete).
    pub fn file_path(&self) -> &Path {
        &self.file
    }
}

impl Drop for LayerLease {
    fn drop(&mut self) {
        self.inner.release(&self.hex, self.events_at_start);
    }
}

impl LayerCache {
    /// Opens the cache at `dir` with the default holder command.
    pub async fn open(dir: impl Into<PathBuf>, capacity_bytes: u64, source: Arc<dyn ChunkSource>) -> Result<Self> {
        Self::open_with(CacheConfig::new(dir, capacity_bytes)?, source).await
    }

    /// Opens (creating if needed) the cache in `config.dir`. If a holder from
    /// an earlier cache is alive, adopts its group, so mounts stay up and
    /// readers waiting on them are answered; otherwise starts a new group
    /// and holder and re-prepares what the directory holds.
    pub async fn open_with(config: CacheConfig, source: Arc<dyn ChunkSource>) -> Result<Self> {
        let runtime = Handle::try_current().map_err(|_| CacheError::Runtime)?;
        if matches!(runtime.runtime_flavor(), RuntimeFlavor::CurrentThread) {
            return Err(CacheError::Runtime);
        }
        let fill_threads = config.fill_threads;
        let inner = tokio::task::spawn_blocking(move || Inner::open(config, source, runtime))
            .await
            .map_err(|e| CacheError::Task(e.to_string()))??;
        let inner = Arc::new(inner);
        let daemon = Daemon::start(Arc::clone(&inner.shared), fill_threads)?;
        Ok(Self { inner, daemon: Some(daemon) })
    }

    /// Makes the layer local (metadata now, data on first read) and mounted,
    /// once per node; every further acquire shares the mount.
    pub async fn acquire(&self, manifest: &LayerManifest) -> Result<LayerLease> {
        manifest.validate()?;
        let hex = digest_hex(&manifest.digest)?.to_owned();
        let gate = self.inner.gate(&hex);
        let turn = gate.lock().await;
        let result = self.acquire_in_turn(manifest, &hex).await;
        drop(turn);
        self.inner.drop_gate(&hex, gate);
        result
    }

    async fn acquire_in_turn(&self, manifest: &LayerManifest, hex: &str) -> Result<LayerLease> {
        let inner = &self.inner;
        let (file, created, replay) = match inner.claim(hex, manifest)? {
            Claimed::Leased { events } => return Ok(inner.lease(hex, events)),
            Claimed::OnDisk(file) => match self.prepare(&file, false).await {
                Ok(_) => (file, false, None),
                Err(e) => {
                    inner.abandon(hex, false);
                    return Err(e);
                }
            },
            Claimed::New => match self.create(manifest).await {
                Ok((file, replay)) => (file, true, replay),
                Err(e) => {
                    inner.abandon(hex, true);
                    return Err(e);
                }
            },
        };
        match inner.mount(&file) {
            Ok(complete) => {
                // The lease first: the replay runs beside the readers the
                // caller is about to start, not before them.
                let lease = inner.finish(hex, Arc::clone(&file), complete);
                if let Some(units) = replay {
                    self.replay_trace(&file, &units);
                }
                Ok(lease)
            }
            Err(e) => {
                inner.abandon(hex, created);
                Err(e)
            }
        }
    }

    /// Creates the sparse file and fetches its metadata, before any mark:
    /// writes through the file's own descriptor raise no events yet (nor
    /// later: the descriptor predates the mark). Returns the stored trace
    /// to replay once the layer is mounted.
    async fn create(&self, manifest: &LayerManifest) -> Result<(Arc<LayerFile>, Option<Vec<usize>>)> {
        let file = Arc::new(LayerFile::create(&self.inner.dir, manifest)?);
        let replay = self.prepare(&file, true).await?;
        Ok((file, replay))
    }

    /// What must happen before a layer file is marked and mounted: its
    /// metadata made local and the layer's stored access trace fetched
    /// alongside (see `trace`). For a layer new on this node (`replay`)
    /// the trace is returned, to replay once the layer is mounted; a layer
    /// found on disk holds what this node read before, and its trace only
    /// seeds the log, so what this node publishes stays the union.
    async fn prepare(&self, file: &Arc<LayerFile>, replay: bool) -> Result<Option<Vec<usize>>> {
        let (prefilled, trace) = tokio::join!(self.prefill(file), self.fetch_trace(file));
        prefilled?;
        match trace {
            Some(units) if replay => return Ok(Some(units)),
            Some(units) => file.seed_trace(&units),
            None => {}
        }
        Ok(None)
    }

    /// The layer's stored access trace, if traces are on and one is stored
    /// and readable (a bad one is logged and ignored: it is only a hint).
    async fn fetch_trace(&self, file: &Arc<LayerFile>) -> Option<Vec<usize>> {
        if self.inner.shared.prefetch.trace_requests == 0 {
            return None;
        }
        let manifest = file.manifest();
        let bytes = match self.inner.shared.source.fetch_trace(manifest).await {
            Ok(bytes) => bytes?,
            Err(e) => {
                tracing::warn!(layer = file.hex(), error = %e, "cannot read the layer's access trace");
                return None;
            }
        };
        let units = manifest.fetch_unit_digests().len();
        match trace::decode(&bytes, manifest.fetch_unit_size(), units) {
            Ok(units) => Some(units),
            Err(reason) => {
                tracing::warn!(layer = file.hex(), %reason, "ignoring the layer's access trace");
                None
            }
        }
    }

    /// Starts fetching the missing units of `units` (a trace, in its order)
    /// in the background, with up to `trace_requests` ranged GETs in
    /// flight, while the layer is mounted and read (see
    /// [`Inner::fetch_in_background`]).
    fn replay_trace(&self, file: &Arc<LayerFile>, units: &[usize]) {
        file.seed_trace(units);
        let wanted = replay_order(file.missing_of(units));
        let requests = self.inner.shared.prefetch.trace_requests.max(1);
        self.inner.fetch_in_background(file, wanted, Background::TraceReplay, requests);
    }

    /// Makes the layer's metadata local: its metadata blob, or for a
    /// manifest without one every chunk holding metadata. Does nothing for
    /// metadata already here (a layer found on disk).
    async fn prefill(&self, file: &Arc<LayerFile>) -> Result<()> {
        let source = Arc::clone(&self.inner.shared.source);
        if file.needs_metadata_blob() {
            let fetched = source.fetch_metadata_blob(file.manifest()).await.map_err(|e| e.to_string());
            let file = Arc::clone(file);
            return tokio::task::spawn_blocking(move || file.store_metadata_blob(fetched))
                .await
                .map_err(|e| CacheError::Task(e.to_string()))?;
        }
        let wanted = file.missing_metadata_chunks();
        let fetched = fetch_batch(source, Arc::clone(file.manifest()), wanted.clone()).await;
        for (index, result) in wanted.into_iter().zip(fetched) {
            file.store_prefetched(index, result)?;
        }
        Ok(())
    }

    /// Fills every chunk of a leased layer (the whole file becomes a plain
    /// EROFS image, usable as a VM disk) and checks the file's digest. The
    /// reads go through the daemon like any other reader's.
    pub async fn fetch_all(&self, lease: &LayerLease) -> Result<()> {
        let path = lease.file.clone();
        let expected = lease.digest.clone();
        let actual = tokio::task::spawn_blocking(move || digest_reading_through(&path))
            .await
            .map_err(|e| CacheError::Task(e.to_string()))??;
        if actual != expected {
            let hex = lease.hex.clone();
            return Err(CacheError::Unusable { hex, reason: format!("the filled file hashes to {actual}") });
        }
        Ok(())
    }

    /// Per-layer statistics, by digest.
    pub fn stats(&self) -> Vec<LayerStats> {
        let table = self.inner.table();
        let mut stats: Vec<LayerStats> =
            table.entries.values().filter_map(|e| e.file.as_ref().map(|f| f.stats(e.leases, e.mounted))).collect();
        stats.sort_by(|a, b| a.digest.cmp(&b.digest));
        stats
    }

    /// Fill events by the cgroup of the process whose read raised them,
    /// over every layer (see `readers` for what page-cache hits hide).
    pub fn reader_stats(&self) -> Vec<ReaderStats> {
        self.inner.shared.readers.snapshot()
    }

    /// Evicts every unleased layer whose digest is not in `keep` (a layer
    /// no image references any more); returns how many and their bytes.
    pub fn evict_unreferenced(&self, keep: &HashSet<String>) -> (usize, u64) {
        let mut table = self.inner.table();
        let victims: Vec<String> = table
            .entries
            .iter()
            .filter(|(hex, e)| e.leases == 0 && !e.busy && e.file.is_some() && !keep.contains(&format!("sha256:{hex}")))
            .map(|(hex, _)| hex.clone())
            .collect();
        let (mut count, mut bytes) = (0, 0);
        for hex in victims {
            let evicted = table.entries.get(&hex).map(|entry| (self.inner.evict(&hex, entry), entry.size_bytes));
            match evicted {
                Some((Ok(()), size)) => {
                    table.entries.remove(&hex);
                    count += 1;
                    bytes += size;
                }
                Some((Err(e), _)) => tracing::warn!(layer = %hex, error = %e, "cannot evict an unreferenced layer"),
                None => {}
            }
        }
        (count, bytes)
    }

    pub fn holder_pid(&self) -> i32 {
        self.inner.shared.holder.lock().unwrap_or_else(PoisonError::into_inner).pid()
    }

    /// Whether this cache took over a holder an earlier cache left running.
    pub fn adopted_holder(&self) -> bool {
        self.inner.adopted
    }

    /// Unmounts every layer, stops the daemon and ends the holder. Refuses
    /// (`InUse`) while a layer is leased or its mount is busy: those stay
    /// mounted and the holder stays, so they keep failing closed.
    pub async fn shutdown(mut self) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        let daemon = self.daemon.take();
        tokio::task::spawn_blocking(move || inner.shutdown(daemon))
            .await
            .map_err(|e| CacheError::Task(e.to_string()))?
    }
}

struct Inner {
    dir: PathBuf,
    mounts: PathBuf,
    capacity_bytes: u64,
    readahead_kb: Option<u32>,
    warm_readahead_kb: Option<u32>,
    complete_after_use: bool,
    shared: Arc<Shared>,
    table: Mutex<Table>,
    /// One async turn per layer, so one acquire prepares it and the others
    /// then share its mount.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    adopted: bool,
    _lock: File,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner").field("dir", &self.dir).finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Table {
    entries: HashMap<String, Entry>,
    /// Ticks on every acquire and release; orders eviction.
    clock: u64,
}

struct Entry {
    /// `None` while the first acquire creates the file.
    file: Option<Arc<LayerFile>>,
    size_bytes: u64,
    leases: usize,
    last_used: u64,
    mounted: bool,
    /// A sandbox that read from the layer has ended since it was mounted
    /// (or it was complete then): its mount has the warm window, its trace
    /// is closed and, with `complete_after_use`, its completion started.
    ran_here: bool,
    /// An acquire is working on it; not evictable.
    busy: bool,
}

enum Claimed {
    /// Already mounted; a lease was counted, when the layer had seen
    /// `events` fill events.
    Leased { events: u64 },
    /// On disk from before but not mounted.
    OnDisk(Arc<LayerFile>),
    /// Room was made and the entry reserved; the file is to be created.
    New,
}

impl Inner {
    fn open(config: CacheConfig, source: Arc<dyn ChunkSource>, runtime: Handle) -> Result<Self> {
        let dir = prepare_dir(&config.dir)?;
        let mounts = dir.join(MOUNT_DIR);
        fs::create_dir_all(&mounts).context(|| format!("creating {}", mounts.display()))?;
        let lock = lock_dir(&dir)?;
        let (high_water, previous_high) = HighWater::open(&dir.join(HIGH_WATER))?;
        let record = dir.join(HOLDER_RECORD);
        let (group, holder, adopted) = match Holder::adopt(&config.holder, &record)? {
            Some(Adopted { holder, group }) => {
                let denied = deny_orphaned_events(&group, previous_high);
                if denied > 0 {
                    tracing::warn!(denied, "answered events a dead daemon had taken with EIO");
                }
                (group, holder, true)
            }
            None => {
                let group = Group::new().context(|| "creating a pre-content fanotify group".into())?;
                high_water.reset()?;
                let holder = Holder::spawn(&config.holder, &group, &record)?;
                (group, holder, false)
            }
        };
        let shared = Shared {
            group,
            files: RwLock::default(),
            source,
            runtime,
            holder: Mutex::new(holder),
            high_water,
            readers: Readers::default(),
            prefetch: config.prefetch,
        };
        let inner = Self {
            dir,
            mounts,
            capacity_bytes: config.capacity_bytes,
            readahead_kb: config.readahead_kb,
            warm_readahead_kb: config.warm_readahead_kb,
            complete_after_use: config.complete_after_use,
            shared: Arc::new(shared),
            table: Mutex::default(),
            gates: Mutex::default(),
            adopted,
            _lock: lock,
        };
        inner.recover()?;
        inner.trim_to_capacity();
        Ok(inner)
    }

    /// Takes stock of what an earlier cache left: layers on disk, their
    /// mounts, and mounts or files nothing accounts for.
    fn recover(&self) -> Result<()> {
        let mounted = mount::mount_points().context(|| "reading the mount table".into())?;
        let mut found: Vec<(String, Entry, SystemTime)> = Vec::new();
        for hex in self.hexes_on_disk()? {
            let target = self.mounts.join(&hex);
            match self.recover_layer(&hex, mounted.contains(&target)) {
                Ok(entry) => {
                    let touched = fs::metadata(self.dir.join(format!("{hex}.erofs")))
                        .and_then(|m| m.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH);
                    found.push((hex, entry, touched));
                }
                Err(e) => {
                    tracing::warn!(layer = %hex, error = %e, "discarding a cached layer");
                    if mounted.contains(&target) {
                        let _ = mount::unmount(&target);
                    }
                    LayerFile::remove(&self.dir, &hex);
                }
            }
        }
        // Oldest first, so the clock orders eviction as the files' last fills did.
        found.sort_by_key(|(_, _, touched)| *touched);
        let mut table = self.table();
        for (hex, mut entry, _) in found {
            table.clock += 1;
            entry.last_used = table.clock;
            table.entries.insert(hex, entry);
        }
        self.sweep_mount_dirs(&table, &mounted);
        Ok(())
    }

    fn hexes_on_disk(&self) -> Result<BTreeSet<String>> {
        let listing = fs::read_dir(&self.dir).context(|| format!("listing {}", self.dir.display()))?;
        Ok(listing
            .filter_map(|entry| entry.ok()?.file_name().to_str().and_then(owned_file_hex).map(str::to_owned))
            .collect())
    }

    fn recover_layer(&self, hex: &str, mounted: bool) -> Result<Entry> {
        let file = Arc::new(LayerFile::load(&self.dir, hex)?);
        let mut mounted = mounted;
        if self.adopted {
            // The adopted group still carries the marks this mount raises
            // events through.
            if mounted {
                self.shared.register(&file);
            }
        } else {
            mounted = self.reprepare(&file, mounted)?;
        }
        // An adopted mount's window is unknown: widened again after its next use.
        Ok(Entry {
            size_bytes: file.manifest().size,
            file: Some(file),
            leases: 0,
            last_used: 0,
            mounted,
            ran_here: false,
            busy: false,
        })
    }

    /// After the group a layer was mounted under is gone: readers may have
    /// read zeros meanwhile, and the mount's page cache may still hold them,
    /// so the mount goes; the chunks on disk are checked again. A mount
    /// still in use is kept and re-marked, so at least no further read
    /// fails open. Returns whether the layer is still mounted.
    fn reprepare(&self, file: &Arc<LayerFile>, mounted: bool) -> Result<bool> {
        let target = self.mounts.join(file.hex());
        let still_mounted = mounted
            && match mount::unmount(&target) {
                Ok(()) => false,
                Err(e) => {
                    tracing::error!(layer = file.hex(), error = %e,
                        "a lazy layer outlived its fanotify group and is still in use; pages read meanwhile may be zeros");
                    true
                }
            };
        let dropped = file.verify_present()?;
        if dropped > 0 {
            tracing::warn!(
                layer = file.hex(),
                dropped,
                "chunks on disk did not match their digest; they will be fetched again"
            );
        }
        if still_mounted {
            self.shared.register(file);
            if !file.is_complete() {
                self.shared.group.mark(file.inode()).context(|| format!("marking {}", file.path().display()))?;
            }
        }
        Ok(still_mounted)
    }

    /// Removes mount directories of layers the cache no longer has.
    fn sweep_mount_dirs(&self, table: &Table, mounted: &HashSet<PathBuf>) {
        let Ok(listing) = fs::read_dir(&self.mounts) else { return };
        for entry in listing.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if table.entries.contains_key(&name) {
                continue;
            }
            let path = entry.path();
            if mounted.contains(&path) {
                if let Err(e) = mount::unmount(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot unmount a stale layer mount");
                    continue;
                }
            }
            let _ = fs::remove_dir(&path);
        }
    }

    /// Evicts least-recently-used layers while the directory holds more than
    /// the capacity (after the capacity was lowered between runs).
    fn trim_to_capacity(&self) {
        let mut table = self.table();
        if let Err(e) = self.make_room(&mut table, "", 0) {
            tracing::warn!(error = %e, "the cache stays over capacity: its layers are in use");
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn gate(&self, hex: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut gates = self.gates.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(gates.entry(hex.to_owned()).or_default())
    }

    fn drop_gate(&self, hex: &str, gate: Arc<tokio::sync::Mutex<()>>) {
        let mut gates = self.gates.lock().unwrap_or_else(PoisonError::into_inner);
        drop(gate);
        if gates.get(hex).is_some_and(|g| Arc::strong_count(g) == 1) {
            gates.remove(hex);
        }
    }

    fn claim(&self, hex: &str, manifest: &LayerManifest) -> Result<Claimed> {
        let mut table = self.table();
        table.clock += 1;
        let now = table.clock;
        if let Some(entry) = table.entries.get_mut(hex) {
            if entry.mounted {
                entry.leases += 1;
                entry.last_used = now;
                return Ok(Claimed::Leased { events: entry.file.as_ref().map_or(0, |f| f.fill_events()) });
            }
            if let Some(file) = &entry.file {
                entry.busy = true;
                return Ok(Claimed::OnDisk(Arc::clone(file)));
            }
        }
        self.make_room(&mut table, &manifest.digest, manifest.size)?;
        let entry = Entry {
            file: None,
            size_bytes: manifest.size,
            leases: 0,
            last_used: now,
            mounted: false,
            ran_here: false,
            busy: true,
        };
        table.entries.insert(hex.to_owned(), entry);
        Ok(Claimed::New)
    }

    /// Evicts unleased layers, least recently used first, until `size`
    /// more bytes fit.
    fn make_room(&self, table: &mut Table, digest: &str, size: u64) -> Result<()> {
        let mut stuck = HashSet::new();
        loop {
            let used: u64 = table.entries.values().map(|e| e.size_bytes).sum();
            if used.saturating_add(size) <= self.capacity_bytes {
                return Ok(());
            }
            let victim = table
                .entries
                .iter()
                .filter(|(hex, e)| e.leases == 0 && !e.busy && e.file.is_some() && !stuck.contains(*hex))
                .min_by_key(|(_, e)| e.last_used)
                .map(|(hex, _)| hex.clone());
            let Some(victim) = victim else {
                return Err(CacheError::CacheFull {
                    digest: digest.to_owned(),
                    needed_bytes: size,
                    capacity_bytes: self.capacity_bytes,
                    in_use_bytes: used,
                });
            };
            match table.entries.get(&victim).map(|entry| self.evict(&victim, entry)) {
                Some(Err(e)) => {
                    tracing::warn!(layer = %victim, error = %e, "cannot evict a layer");
                    stuck.insert(victim);
                }
                _ => {
                    table.entries.remove(&victim);
                }
            }
        }
    }

    /// Unmounts and deletes one layer. The mark goes too: it pins the inode,
    /// which would keep the deleted file's blocks allocated.
    fn evict(&self, hex: &str, entry: &Entry) -> Result<()> {
        if entry.mounted {
            let target = self.mounts.join(hex);
            mount::unmount(&target).context(|| format!("unmounting {}", target.display()))?;
            let _ = fs::remove_dir(&target);
        }
        if let Some(file) = &entry.file {
            self.shared.forget(file);
            if let Err(e) = self.shared.group.unmark(file.inode()) {
                tracing::warn!(layer = hex, error = %e, "could not unmark an evicted layer");
            }
        }
        LayerFile::remove(&self.dir, hex);
        tracing::debug!(layer = hex, "evicted");
        Ok(())
    }

    /// Registers, marks (unless complete) and mounts a layer file, in that
    /// order: a file mounted before it is marked never raises events.
    /// Returns whether the layer was complete.
    fn mount(&self, file: &Arc<LayerFile>) -> Result<bool> {
        self.shared.register(file);
        let mounted = self.mark_and_mount(file);
        if mounted.is_err() {
            self.shared.forget(file);
            let _ = self.shared.group.unmark(file.inode());
        }
        mounted
    }

    fn mark_and_mount(&self, file: &LayerFile) -> Result<bool> {
        let complete = file.is_complete();
        if !complete {
            self.shared.group.mark(file.inode()).context(|| format!("marking {}", file.path().display()))?;
        }
        let target = self.mounts.join(file.hex());
        fs::create_dir_all(&target).context(|| format!("creating {}", target.display()))?;
        mount::mount_erofs(file.path(), &target).context(|| format!("mounting {}", file.path().display()))?;
        // Before the lease exists, so no file is open on the mount yet and
        // every later open takes this window. A complete layer has nothing
        // left to fetch, so it starts wide.
        let window = if complete { self.warm_readahead_kb.or(self.readahead_kb) } else { self.readahead_kb };
        if let Some(kb) = window {
            set_window(file.hex(), &target, kb);
        }
        Ok(complete)
    }

    fn finish(self: &Arc<Self>, hex: &str, file: Arc<LayerFile>, complete: bool) -> LayerLease {
        let events = file.fill_events();
        let mut table = self.table();
        table.clock += 1;
        let now = table.clock;
        if let Some(entry) = table.entries.get_mut(hex) {
            entry.file = Some(file);
            entry.mounted = true;
            entry.ran_here = complete;
            entry.busy = false;
            entry.leases += 1;
            entry.last_used = now;
        }
        drop(table);
        self.lease(hex, events)
    }

    /// Undoes a failed acquire: a layer it created goes entirely; one that
    /// was on disk stays, unmounted.
    fn abandon(&self, hex: &str, created: bool) {
        let mut table = self.table();
        if created {
            table.entries.remove(hex);
            LayerFile::remove(&self.dir, hex);
        } else if let Some(entry) = table.entries.get_mut(hex) {
            entry.busy = false;
        }
    }

    fn lease(self: &Arc<Self>, hex: &str, events_at_start: u64) -> LayerLease {
        LayerLease {
            events_at_start,
            inner: Arc::clone(self),
            hex: hex.to_owned(),
            digest: format!("sha256:{hex}"),
            mount: self.mounts.join(hex),
            file: self.dir.join(format!("{hex}.erofs")),
        }
    }

    /// Fetches `wanted` (unit indices, in that order) in the background,
    /// with up to `requests` ranged GETs in flight, while the layer is
    /// mounted and read. Each run of units is claimed only when its GET
    /// starts: a read of a unit not claimed yet takes the ordinary miss
    /// path, a read of one in flight waits for it. Every unit is checked
    /// before it is written; one that fails goes back to missing for a read
    /// to fetch (or fail closed) on demand. Runs as one of the layer's
    /// prefetch tasks, so closing the layer aborts it. A layer it completes
    /// is unmarked.
    fn fetch_in_background(&self, file: &Arc<LayerFile>, wanted: Vec<usize>, kind: Background, requests: usize) {
        if wanted.is_empty() {
            return;
        }
        let manifest = Arc::clone(file.manifest());
        let shared = Arc::clone(&self.shared);
        let runs = daemon::piece_runs(&manifest, &wanted);
        let running = file.background_running(kind);
        let (layer, wanted) = (Arc::clone(file), wanted.len());
        file.prefetch_state().spawn(&self.shared.runtime, async move {
            let _running = running;
            let stored: usize = futures_util::stream::iter(runs)
                .map(|(first, count)| {
                    let (file, source, manifest) =
                        (Arc::clone(&layer), Arc::clone(&shared.source), Arc::clone(&manifest));
                    async move {
                        // Claimed now, not when the fetch started: reads
                        // ahead of it fetch on demand meanwhile.
                        let Some(claim) = file.claim_background(first, count) else { return 0 };
                        // Only what was claimed: a read may have fetched
                        // part of the run meanwhile.
                        let mut fetched = Vec::with_capacity(claim.indices().len());
                        for (first, count) in daemon::piece_runs(&manifest, claim.indices()) {
                            let got = if manifest.piece_size.is_some() {
                                source.fetch_pieces(&manifest, first, count).await
                            } else {
                                source.fetch_chunk(&manifest, first).await.map(|bytes| vec![bytes])
                            };
                            match got {
                                Ok(units) if units.len() == count => fetched.extend(units.into_iter().map(Ok)),
                                Ok(units) => fetched.extend(
                                    (0..count).map(|_| Err(format!("{} units for a request of {count}", units.len()))),
                                ),
                                Err(e) => fetched.extend((0..count).map(|_| Err(e.to_string()))),
                            }
                        }
                        // Hashing and writing up to a chunk: off the runtime.
                        // An aborted or failed task drops the claim, which
                        // puts its units back to missing.
                        tokio::task::spawn_blocking(move || file.store_background(kind, claim, fetched))
                            .await
                            .unwrap_or(0)
                    }
                })
                .buffer_unordered(requests)
                .fold(0, |total, stored| async move { total + stored })
                .await;
            tracing::debug!(layer = layer.hex(), ?kind, wanted, fetched = stored, "fetched units in the background");
            daemon::unmark_if_complete(&shared, &layer);
        });
    }

    /// Ends a lease made when the layer had seen `events_at_start` fill
    /// events. If the layer was read during the lease's life, a sandbox
    /// ran from it here: the first such end widens the mount's window,
    /// closes the access trace and starts the completion - whether or not
    /// other leases live on, since a warm pool's idle members or
    /// overlapping rollouts can hold one at all times. (The reads may be
    /// another sandbox's; a lease that saw none, a pull's, starts nothing.)
    fn release(&self, hex: &str, events_at_start: u64) {
        let mut table = self.table();
        table.clock += 1;
        let now = table.clock;
        if let Some(entry) = table.entries.get_mut(hex) {
            entry.leases = entry.leases.saturating_sub(1);
            entry.last_used = now;
            if let Some(file) = &entry.file {
                let ran = entry.mounted && !entry.ran_here && file.fill_events() > events_at_start;
                if entry.leases == 0 || ran {
                    self.publish_trace(file);
                }
                // Under the table's lock, so the mount cannot go (evicted)
                // between the check and the write.
                if ran {
                    entry.ran_here = true;
                    if let Some(kb) = self.warm_readahead_kb {
                        set_window(hex, &self.mounts.join(hex), kb);
                        file.close_trace();
                    }
                    if self.complete_after_use {
                        let missing = file.missing_units();
                        self.fetch_in_background(file, missing, Background::Completion, COMPLETION_REQUESTS);
                    }
                }
            }
        }
    }

    /// Stores the layer's access trace in the background when this node
    /// recorded units the stored one lacks (see `trace`). Failing costs the
    /// next node's cold start only, so it is logged and dropped.
    fn publish_trace(&self, file: &Arc<LayerFile>) {
        if self.shared.prefetch.trace_requests == 0 {
            return;
        }
        let Some(trace) = file.take_trace() else { return };
        let (file, source) = (Arc::clone(file), Arc::clone(&self.shared.source));
        self.shared.runtime.spawn(async move {
            match source.put_trace(file.manifest(), bytes::Bytes::from(trace)).await {
                Ok(()) => file.count_trace_published(),
                Err(e) => tracing::warn!(layer = file.hex(), error = %e, "cannot store the layer's access trace"),
            }
        });
    }

    fn shutdown(&self, daemon: Option<Daemon>) -> Result<()> {
        // Unmount while the daemon still answers: a reader racing the
        // unmount must not be left waiting.
        let in_use = self.unmount_all();
        if let Some(daemon) = daemon {
            daemon.stop_and_join();
        }
        // The daemon could start prefetches until it stopped; wait until
        // those of the layers just closed let go of them.
        for entry in self.table().entries.values().filter(|e| !e.mounted) {
            if let Some(file) = &entry.file {
                file.prefetch_state().close();
                file.prefetch_state().wait_drained();
            }
        }
        if !in_use.is_empty() {
            return Err(CacheError::InUse(in_use));
        }
        self.shared.holder.lock().unwrap_or_else(PoisonError::into_inner).stop()
    }

    /// Unmounts every unleased layer; returns the digests still in use.
    fn unmount_all(&self) -> Vec<String> {
        let mut table = self.table();
        let mut in_use = Vec::new();
        for (hex, entry) in table.entries.iter_mut().filter(|(_, e)| e.mounted) {
            let target = self.mounts.join(hex.as_str());
            if entry.leases > 0 {
                in_use.push(format!("sha256:{hex}"));
                continue;
            }
            match mount::unmount(&target) {
                Ok(()) => {
                    entry.mounted = false;
                    let _ = fs::remove_dir(&target);
                    if let Some(file) = &entry.file {
                        self.shared.forget(file);
                    }
                }
                Err(e) => {
                    tracing::warn!(layer = %hex, error = %e, "cannot unmount a layer");
                    in_use.push(format!("sha256:{hex}"));
                }
            }
        }
        in_use
    }
}

/// A trace's units in the order a replay fetches them: the trace's own
/// (first access first, what a starting workload needs next), but sorted
/// within blocks of [`REPLAY_BLOCK_UNITS`] so neighbouring units share a
/// ranged GET.
fn replay_order(mut units: Vec<usize>) -> Vec<usize> {
    for block in units.chunks_mut(REPLAY_BLOCK_UNITS) {
        block.sort_unstable();
    }
    units
}

fn prepare_dir(dir: &Path) -> Result<PathBuf> {
    fs::create_dir_all(dir).context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).context(|| format!("restricting {}", dir.display()))?;
    dir.canonicalize().context(|| format!("resolving {}", dir.display()))
}

fn lock_dir(dir: &Path) -> Result<File> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .context(|| format!("opening {}", path.display()))?;
    match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(CacheError::Busy(dir.to_owned())),
        Err(e) => Err(e).context(|| format!("locking {}", path.display())),
    }
}

/// Reads the whole file through an ordinary descriptor (so every missing
/// range raises an event and is filled) and hashes what it read.
fn digest_reading_through(path: &Path) -> Result<String> {
    let mut file = File::open(path).context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; READ_THROUGH_BYTES];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e).context(|| format!("reading {}", path.display())),
        }
    }
    let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("sha256:{hex}"))
}

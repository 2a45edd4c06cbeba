//! The lazy layer cache against the real kernel: file-backed EROFS mounts
//! of sparse files, filled through fanotify pre-content events. Needs root,
//! a 6.14+ kernel and `mkfs.erofs`.
//!
//! The tests take one lock each: they mount, spawn holder processes (this
//! test binary re-run as `holder_process_entry_point`) and reopen cache
//! directories, and a fork by one test would briefly hold another test's
//! directory lock.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use sha2::{Digest, Sha256};
use warren_image::blob::{BlobError, ChunkSource};
use warren_image::cache::{
    holder_main, CacheConfig, CacheError, HolderCommand, LayerCache, PrefetchConfig, DEFAULT_READAHEAD_KB,
    DEFAULT_TRACE_REQUESTS,
};
use warren_image::layer::{LayerManifest, LayerRole, MetadataBlobRef};
use warren_image::metablob;

const HOLDER_ENV: &str = "WARREN_TEST_CACHE_HOLDER";
const CHILD_ENV: &str = "WARREN_TEST_CACHE_CHILD";
const CHILD_READY: &str = "CACHE-CHILD-READY";
const CHUNK: u64 = 64 * 1024;
/// Bound on waiting for something the test needs to observe; reaching it
/// fails the test, it never decides a pass.
const PATIENCE: Duration = Duration::from_secs(30);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Not a test: the holder process the caches under test start.
#[test]
fn holder_process_entry_point() {
    if std::env::var_os(HOLDER_ENV).is_some() {
        holder_main();
    }
}

fn holder_command() -> HolderCommand {
    HolderCommand {
        program: std::env::current_exe().unwrap(),
        args: ["holder_process_entry_point", "--exact", "--nocapture", "--test-threads=1"]
            .iter()
            .map(Into::into)
            .collect(),
        envs: vec![(HOLDER_ENV.into(), "1".into())],
    }
}

// ---------------------------------------------------------------- layers

/// An EROFS image built here, with what the tests need to know about it.
struct Built {
    image: Vec<u8>,
    manifest: LayerManifest,
    files: BTreeMap<String, Vec<u8>>,
    /// Physical `(offset, len)` data extents of each regular file.
    extents: BTreeMap<String, Vec<(u64, u64)>>,
    /// The metadata blob the manifest names, if it names one.
    blob: Option<Vec<u8>>,
}

impl Built {
    fn chunks_of(&self, file: &str) -> BTreeSet<usize> {
        self.extents[file]
            .iter()
            .flat_map(|&(offset, len)| (offset / CHUNK) as usize..=((offset + len - 1) / CHUNK) as usize)
            .collect()
    }

    fn metadata_chunks(&self) -> BTreeSet<usize> {
        self.manifest
            .metadata_ranges
            .iter()
            .flat_map(|&(offset, len)| (offset / CHUNK) as usize..=((offset + len - 1) / CHUNK) as usize)
            .collect()
    }
}

/// Deterministic incompressible bytes.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

/// `count` data files of a few hundred KiB under `data/`, a small inline
/// file and a nested directory.
fn layer_files(seed: u64, count: usize) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for i in 0..count {
        let len = 200_000 + (i * 7919) % 150_000;
        files.insert(format!("data/file{i:03}"), noise(seed * 1000 + i as u64, len));
    }
    files.insert("etc/hostname".into(), format!("layer-{seed}\n").into_bytes());
    files.insert("usr/share/doc/readme".into(), b"lazy layers\n".to_vec());
    files
}

fn build_layer(name: &str, files: BTreeMap<String, Vec<u8>>) -> Built {
    let work = tempfile::tempdir().unwrap();
    let tree = work.path().join("tree");
    for (path, bytes) in &files {
        let path = tree.join(path);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, bytes).unwrap();
    }
    let image_path = work.path().join("layer.erofs");
    let out = Command::new("mkfs.erofs")
        .args(["-T0", "-U", "6a8a1e32-55b3-4cfe-8c54-6a3b1d5e3c11"])
        .arg(&image_path)
        .arg(&tree)
        .output()
        .expect("mkfs.erofs (erofs-utils) is needed");
    assert!(out.status.success(), "mkfs.erofs: {}", String::from_utf8_lossy(&out.stderr));
    let image = fs::read(&image_path).unwrap();
    let extents = data_extents(&image_path, work.path(), &files);
    let size = image.len() as u64;
    let metadata_ranges = complement(size, extents.values().flatten().copied().collect());
    let chunks = image.chunks(CHUNK as usize).map(|c| format!("sha256:{}", hex(&Sha256::digest(c)))).collect();
    let manifest = LayerManifest {
        name: name.into(),
        version: "1".into(),
        role: LayerRole::Other,
        digest: format!("sha256:{}", hex(&Sha256::digest(&image))),
        size,
        chunk_size: CHUNK,
        chunks,
        metadata_ranges,
        metadata_blob: None,
        piece_size: None,
        pieces: Vec::new(),
    };
    manifest.validate().unwrap();
    Built { image, manifest, files, extents, blob: None }
}

/// `built` with a metadata blob in its manifest, as a push makes it.
fn with_metadata_blob(mut built: Built) -> Built {
    let mut file = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut file, &built.image).unwrap();
    let blob = metablob::encode(&file, &built.manifest.metadata_pages()).unwrap();
    built.manifest.metadata_blob =
        Some(MetadataBlobRef { digest: metablob::digest(&blob), size: blob.len() as u64, stored: None });
    built.manifest.validate().unwrap();
    built.blob = Some(blob);
    built
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Mounts the complete image and asks FIEMAP where each regular file's
/// data lives. Inline tails (stored in the inode's metadata block) are
/// metadata: EROFS reads them without raising events.
fn data_extents(image: &Path, work: &Path, files: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<(u64, u64)>> {
    let target = work.join("mnt");
    fs::create_dir(&target).unwrap();
    let mount = MountGuard::mount_erofs(image, &target);
    let extents = files.keys().map(|path| (path.clone(), fiemap(&target.join(path)))).collect();
    drop(mount);
    extents
}

fn fiemap(path: &Path) -> Vec<(u64, u64)> {
    const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
    const EXTENT_LAST: u32 = 0x1;
    const EXTENT_DATA_INLINE: u32 = 0x200;
    const SLOTS: usize = 32;
    let file = fs::File::open(path).unwrap();
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        // struct fiemap (32 bytes) + SLOTS * struct fiemap_extent (56 bytes), u64-aligned.
        let mut buf = vec![0u64; 4 + 7 * SLOTS];
        buf[0] = start;
        buf[1] = u64::MAX - start;
        buf[3] = SLOTS as u64; // fm_extent_count, low half on little endian
                               // SAFETY: FS_IOC_FIEMAP reads the header and writes at most SLOTS
                               // extents into `buf`, which is sized for exactly that.
        let rc = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, buf.as_mut_ptr()) };
        assert_eq!(rc, 0, "FIEMAP {}: {}", path.display(), std::io::Error::last_os_error());
        let mapped = (buf[2] >> 32) as usize;
        let mut last = mapped == 0;
        for i in 0..mapped {
            let e = &buf[4 + 7 * i..4 + 7 * (i + 1)];
            let (logical, physical, len, flags) = (e[0], e[1], e[2], e[5] as u32);
            if flags & EXTENT_DATA_INLINE == 0 {
                out.push((physical, len));
            }
            start = logical + len;
            last |= flags & EXTENT_LAST != 0;
        }
        if last {
            return out;
        }
    }
}

/// `[0, size)` minus `data`, as sorted `(offset, len)`.
fn complement(size: u64, mut data: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    data.sort();
    let mut out = Vec::new();
    let mut pos = 0;
    for (offset, len) in data {
        if offset > pos {
            out.push((pos, offset - pos));
        }
        pos = pos.max(offset + len);
    }
    if pos < size {
        out.push((pos, size - pos));
    }
    out
}

// ---------------------------------------------------------------- source

/// Serves chunks from images in memory; counts fetches and can be told to
/// fail or corrupt chunks.
#[derive(Default)]
struct TestSource {
    images: Mutex<HashMap<String, Vec<u8>>>,
    fetched: Mutex<Vec<(String, usize)>>,
    failing: Mutex<HashSet<usize>>,
    corrupt: Mutex<HashSet<usize>>,
    /// Chunks whose fetch never completes; the first such fetch creates
    /// `hang_marker`.
    hanging: Mutex<HashSet<usize>>,
    hang_marker: Mutex<Option<PathBuf>>,
    /// Metadata blobs by layer digest.
    blobs: Mutex<HashMap<String, Vec<u8>>>,
    blob_fetches: Mutex<usize>,
    corrupt_blob: Mutex<bool>,
    /// `(layer digest, first piece, count)` of every piece request.
    piece_runs: Mutex<Vec<(String, usize, usize)>>,
    /// Stored access traces by layer digest.
    traces: Mutex<HashMap<String, Bytes>>,
    /// Pieces served with one byte flipped (not verified here: the cache
    /// must catch them).
    corrupt_pieces: Mutex<HashSet<usize>>,
    /// When set, piece runs that reach outside these pieces (what the
    /// test's reads ask for) are held until `released`: prefetches.
    demand_only: Mutex<Option<HashSet<usize>>>,
    released: AtomicBool,
    held_now: AtomicUsize,
    held_max: AtomicUsize,
}

/// One held piece run, counted while it waits.
struct Held<'a>(&'a TestSource);

impl<'a> Held<'a> {
    fn enter(source: &'a TestSource) -> Self {
        let now = source.held_now.fetch_add(1, Ordering::SeqCst) + 1;
        source.held_max.fetch_max(now, Ordering::SeqCst);
        Self(source)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.held_now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl TestSource {
    fn with(layers: &[&Built]) -> Arc<Self> {
        let source = Self::default();
        for layer in layers {
            source.images.lock().unwrap().insert(layer.manifest.digest.clone(), layer.image.clone());
            if let Some(blob) = &layer.blob {
                source.blobs.lock().unwrap().insert(layer.manifest.digest.clone(), blob.clone());
            }
        }
        Arc::new(source)
    }

    fn fetched(&self, layer: &Built) -> Vec<usize> {
        let fetched = self.fetched.lock().unwrap();
        fetched.iter().filter(|(d, _)| *d == layer.manifest.digest).map(|(_, i)| *i).collect()
    }

    fn forget_fetches(&self) {
        self.fetched.lock().unwrap().clear();
    }
}

#[async_trait]
impl ChunkSource for TestSource {
    async fn fetch_chunk(&self, layer: &LayerManifest, index: usize) -> Result<Bytes, BlobError> {
        self.fetched.lock().unwrap().push((layer.digest.clone(), index));
        if self.hanging.lock().unwrap().contains(&index) {
            if let Some(marker) = self.hang_marker.lock().unwrap().as_ref() {
                fs::write(marker, b"hanging").unwrap();
            }
            std::future::pending::<()>().await;
        }
        if self.failing.lock().unwrap().contains(&index) {
            return Err(BlobError::NotFound(format!("chunk {index} (told to fail)")));
        }
        let images = self.images.lock().unwrap();
        let image = images.get(&layer.digest).ok_or_else(|| BlobError::NotFound(layer.digest.clone()))?;
        let start = index * CHUNK as usize;
        let mut bytes = image[start..(start + CHUNK as usize).min(image.len())].to_vec();
        if self.corrupt.lock().unwrap().contains(&index) {
            bytes[0] ^= 0xff;
        }
        Ok(Bytes::from(bytes))
    }

    async fn fetch_pieces(&self, layer: &LayerManifest, first: usize, count: usize) -> Result<Vec<Bytes>, BlobError> {
        self.piece_runs.lock().unwrap().push((layer.digest.clone(), first, count));
        let outside =
            self.demand_only.lock().unwrap().as_ref().is_some_and(|d| (first..first + count).any(|i| !d.contains(&i)));
        if outside {
            let _held = Held::enter(self);
            while !self.released.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        let images = self.images.lock().unwrap();
        let image = images.get(&layer.digest).ok_or_else(|| BlobError::NotFound(layer.digest.clone()))?;
        let corrupt = self.corrupt_pieces.lock().unwrap();
        Ok((first..first + count)
            .map(|index| {
                let (offset, len) = layer.fetch_unit_extent(index).unwrap();
                let mut bytes = image[offset as usize..(offset + len) as usize].to_vec();
                if corrupt.contains(&index) {
                    bytes[len as usize / 2] ^= 0xff;
                }
                Bytes::from(bytes)
            })
            .collect())
    }

    async fn fetch_trace(&self, layer: &LayerManifest) -> Result<Option<Bytes>, BlobError> {
        Ok(self.traces.lock().unwrap().get(&layer.digest).cloned())
    }

    async fn put_trace(&self, layer: &LayerManifest, trace: Bytes) -> Result<(), BlobError> {
        self.traces.lock().unwrap().insert(layer.digest.clone(), trace);
        Ok(())
    }

    async fn fetch_metadata_blob(&self, layer: &LayerManifest) -> Result<Bytes, BlobError> {
        *self.blob_fetches.lock().unwrap() += 1;
        let blobs = self.blobs.lock().unwrap();
        let mut blob = blobs.get(&layer.digest).cloned().ok_or_else(|| BlobError::NoMetadataBlob(layer.id()))?;
        if *self.corrupt_blob.lock().unwrap() {
            let last = blob.len() - 1;
            blob[last] ^= 0xff;
        }
        Ok(Bytes::from(blob))
    }
}

// ---------------------------------------------------------------- cleanup

struct MountGuard(PathBuf);

impl MountGuard {
    fn mount_erofs(file: &Path, target: &Path) -> Self {
        rustix::mount::mount(file, target, "erofs", rustix::mount::MountFlags::RDONLY, None).unwrap();
        Self(target.to_owned())
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

/// Owns a test's directories. Declared first in a test so it drops last,
/// after the cache: kills the holder the cache left (if the test did not
/// shut it down) and detaches every layer mount, even after a failure.
struct Fixture {
    tmp: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl Fixture {
    fn new() -> Self {
        Self { _serial: serial(), tmp: tempfile::tempdir().unwrap() }
    }

    fn cache_dir(&self) -> PathBuf {
        self.tmp.path().join("cache")
    }

    fn config(&self, capacity_bytes: u64) -> CacheConfig {
        CacheConfig {
            dir: self.cache_dir(),
            capacity_bytes,
            holder: holder_command(),
            fill_threads: 4,
            readahead_kb: Some(DEFAULT_READAHEAD_KB),
            // A widened window would change what a second round of reads
            // fetches; its own test turns it on.
            warm_readahead_kb: None,
            complete_after_use: false,
            // Whole-file fetching would bring most test files in one go;
            // its own tests turn it on.
            prefetch: PrefetchConfig { whole_file_bytes: 0, ..PrefetchConfig::default() },
        }
    }

    fn hang_marker(&self) -> PathBuf {
        self.tmp.path().join("hanging")
    }

    fn holder_pid(&self) -> Option<i32> {
        let record = fs::read(self.cache_dir().join("holder.json")).ok()?;
        let value: serde_json::Value = serde_json::from_slice(&record).ok()?;
        value["pid"].as_i64().map(|p| p as i32)
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(pid) = self.holder_pid() {
            // SAFETY: plain syscalls on a pid this test's cache started.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
        if let Ok(listing) = fs::read_dir(self.cache_dir().join("mnt")) {
            for entry in listing.flatten() {
                let _ = rustix::mount::unmount(entry.path(), rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
}

fn erofs_mounts_at(path: &Path) -> usize {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap();
    table.lines().filter(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()) && l.contains(" - erofs ")).count()
}

fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    fs::read(path)
}

/// The errno a read of `path` failed with, or a panic naming how much it read.
fn read_errno(path: &Path) -> Option<i32> {
    match read(path) {
        Ok(bytes) => panic!("reading {} succeeded with {} bytes", path.display(), bytes.len()),
        Err(e) => e.raw_os_error(),
    }
}

// ---------------------------------------------------------------- tests

/// Type-checked, never run: the cache is used from multi-threaded async
/// handlers, so its futures must be `Send`.
fn _cache_futures_are_send(cache: &LayerCache, manifest: &LayerManifest, lease: &warren_image::cache::LayerLease) {
    fn send<T: Send>(_: T) {}
    send(cache.acquire(manifest));
    send(cache.fetch_all(lease));
    send(LayerCache::open_with(CacheConfig::new("/nonexistent", 0).unwrap(), TestSource::with(&[])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_lists_directories_before_any_data_chunk_is_fetched() {
    let fx = Fixture::new();
    let layer = build_layer("meta", layer_files(1, 24));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();

    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let prefetched: BTreeSet<usize> = source.fetched(&layer).into_iter().collect();
    assert_eq!(prefetched, layer.metadata_chunks(), "the prefill fetched exactly the metadata chunks");
    assert!(prefetched.len() < layer.manifest.chunks.len(), "the layer is not fetched whole");

    let root = lease.mount_path();
    let mut listed: Vec<String> =
        fs::read_dir(root.join("data")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    listed.sort();
    let expected: Vec<String> = layer.files.keys().filter_map(|p| p.strip_prefix("data/")).map(str::to_owned).collect();
    assert_eq!(listed, expected);
    for (path, bytes) in &layer.files {
        assert_eq!(fs::metadata(root.join(path)).unwrap().len(), bytes.len() as u64);
    }
    // Small files live inline in their inode's block: metadata, already here.
    assert_eq!(read(&root.join("etc/hostname")).unwrap(), layer.files["etc/hostname"]);
    assert_eq!(source.fetched(&layer).len(), prefetched.len(), "listing and stat fetched nothing");

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_one_file_fetches_only_the_chunks_it_needs() {
    let fx = Fixture::new();
    let layer = build_layer("frac", layer_files(2, 48));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let prefetched: BTreeSet<usize> = source.fetched(&layer).into_iter().collect();
    source.forget_fetches();

    let name = "data/file017";
    assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);

    let fetched = source.fetched(&layer);
    let unique: BTreeSet<usize> = fetched.iter().copied().collect();
    assert_eq!(unique.len(), fetched.len(), "a chunk was fetched twice");
    let needed: BTreeSet<usize> = layer.chunks_of(name).difference(&prefetched).copied().collect();
    assert_eq!(unique, needed, "fetched chunks are exactly those under the file's data not already local");
    let fetched_bytes = fetched.len() as u64 * CHUNK;
    assert!(
        fetched_bytes * 20 < layer.manifest.size,
        "reading one of 48 files fetched {fetched_bytes} of {} bytes",
        layer.manifest.size
    );

    let stats = cache.stats();
    assert_eq!(stats.len(), 1);
    let s = &stats[0];
    assert_eq!(s.chunks_fetched, (prefetched.len() + fetched.len()) as u64);
    assert_eq!(s.metadata_chunks_fetched, prefetched.len() as u64);
    assert!(s.bytes_accessed >= layer.files[name].len() as u64 - CHUNK, "accessed {}", s.bytes_accessed);
    assert!(s.fill_events > 0);
    assert_eq!(s.failed_fills, 0);

    // A second read is served by the kernel's caches: nothing fetched.
    source.forget_fetches();
    assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);
    assert!(source.fetched(&layer).is_empty());

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_or_missing_chunk_fails_the_read_with_eio_until_the_source_is_fixed() {
    let fx = Fixture::new();
    let layer = build_layer("bad", layer_files(3, 8));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let metadata = layer.metadata_chunks();

    let corrupt_file = "data/file002";
    let corrupt: HashSet<usize> = layer.chunks_of(corrupt_file).difference(&metadata).copied().collect();
    assert!(!corrupt.is_empty());
    *source.corrupt.lock().unwrap() = corrupt.clone();
    assert_eq!(read_errno(&lease.mount_path().join(corrupt_file)), Some(libc::EIO), "a corrupt chunk reads as EIO");

    let missing_file = "data/file005";
    let missing: HashSet<usize> = layer.chunks_of(missing_file).difference(&metadata).copied().collect();
    *source.failing.lock().unwrap() = missing;
    assert_eq!(
        read_errno(&lease.mount_path().join(missing_file)),
        Some(libc::EIO),
        "an unfetchable chunk reads as EIO"
    );
    assert!(cache.stats()[0].failed_fills >= 2);

    source.corrupt.lock().unwrap().clear();
    source.failing.lock().unwrap().clear();
    assert_eq!(read(&lease.mount_path().join(corrupt_file)).unwrap(), layer.files[corrupt_file]);
    assert_eq!(read(&lease.mount_path().join(missing_file)).unwrap(), layer.files[missing_file]);

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_acquires_share_one_mount() {
    let fx = Fixture::new();
    let layer = build_layer("shared", layer_files(4, 6));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();

    let (a, b) = tokio::join!(cache.acquire(&layer.manifest), cache.acquire(&layer.manifest));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.mount_path(), b.mount_path());
    assert_eq!(erofs_mounts_at(a.mount_path()), 1);
    assert_eq!(source.fetched(&layer).len(), layer.metadata_chunks().len(), "metadata fetched once");
    assert_eq!(cache.stats()[0].leases, 2);

    let mount = a.mount_path().to_owned();
    drop(a);
    assert_eq!(read(&b.mount_path().join("data/file001")).unwrap(), layer.files["data/file001"]);
    drop(b);
    // The last lease makes the layer evictable; it does not unmount it.
    assert_eq!(erofs_mounts_at(&mount), 1);
    assert_eq!(cache.stats()[0].leases, 0);

    cache.shutdown().await.unwrap();
    assert_eq!(erofs_mounts_at(&mount), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_takes_the_least_recently_used_unleased_layer() {
    let fx = Fixture::new();
    let a = build_layer("a", layer_files(5, 6));
    let b = build_layer("b", layer_files(6, 6));
    let c = build_layer("c", layer_files(7, 4));
    assert!(c.manifest.size <= a.manifest.size.min(b.manifest.size));
    let source = TestSource::with(&[&a, &b, &c]);
    let capacity = a.manifest.size + b.manifest.size;
    let cache = LayerCache::open_with(fx.config(capacity), source.clone()).await.unwrap();
    let file_of = |l: &Built| fx.cache_dir().join(format!("{}.erofs", &l.manifest.digest[7..]));

    drop(cache.acquire(&a.manifest).await.unwrap());
    let lease_b = cache.acquire(&b.manifest).await.unwrap();
    let mount_b = lease_b.mount_path().to_owned();
    drop(lease_b);
    drop(cache.acquire(&a.manifest).await.unwrap()); // a is now the most recent

    let lease_c = cache.acquire(&c.manifest).await.unwrap();
    assert!(file_of(&a).exists(), "the recently used layer stays");
    assert!(!file_of(&b).exists(), "the least recently used layer is evicted");
    assert_eq!(erofs_mounts_at(&mount_b), 0, "and unmounted");
    assert_eq!(read(&lease_c.mount_path().join("data/file003")).unwrap(), c.files["data/file003"]);

    // With a and c leased nothing can make room for b.
    let lease_a = cache.acquire(&a.manifest).await.unwrap();
    match cache.acquire(&b.manifest).await {
        Err(CacheError::CacheFull { .. }) => {}
        other => panic!("expected CacheFull, got {other:?}"),
    }
    assert!(file_of(&a).exists() && file_of(&c).exists(), "leased layers survive a failed acquire");
    assert_eq!(read(&lease_a.mount_path().join("data/file004")).unwrap(), a.files["data/file004"]);

    drop((lease_a, lease_c));
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fully_fetched_layer_mounts_as_a_plain_erofs_file() {
    let fx = Fixture::new();
    let layer = build_layer("whole", layer_files(8, 10));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    cache.fetch_all(&lease).await.unwrap();
    let stats = &cache.stats()[0];
    assert_eq!(stats.present_bytes, layer.manifest.size);
    assert_eq!(source.fetched(&layer).len(), layer.manifest.chunks.len(), "every chunk fetched exactly once");

    // util-linux mount (which may attach a loop device): the file is a
    // plain EROFS image now, as a VM's virtio-blk disk would see it.
    let target = fx.tmp.path().join("plain");
    fs::create_dir(&target).unwrap();
    let status = Command::new("mount").args(["-t", "erofs", "-o", "ro"]).arg(lease.file_path()).arg(&target).status();
    assert!(status.unwrap().success());
    let _plain = MountGuard(target.clone());
    for (path, bytes) in &layer.files {
        assert_eq!(&read(&target.join(path)).unwrap(), bytes, "{path}");
    }

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopening_after_shutdown_reuses_verified_chunks_and_refetches_damaged_ones() {
    let fx = Fixture::new();
    let layer = build_layer("again", layer_files(9, 8));
    let source = TestSource::with(&[&layer]);
    let read_file = "data/file004";
    let (file_path, first_pid) = {
        let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
        let lease = cache.acquire(&layer.manifest).await.unwrap();
        assert_eq!(read(&lease.mount_path().join(read_file)).unwrap(), layer.files[read_file]);
        let ids = (lease.file_path().to_owned(), cache.holder_pid());
        drop(lease);
        cache.shutdown().await.unwrap();
        ids
    };
    assert!(fx.holder_pid().is_none(), "shutdown ended the holder and removed its record");
    assert!(!Path::new(&format!("/proc/{first_pid}")).exists());

    // Damage one data chunk on disk while no cache runs.
    let damaged = *layer.chunks_of(read_file).difference(&layer.metadata_chunks()).next().unwrap();
    let mut bytes = fs::read(&file_path).unwrap();
    bytes[damaged * CHUNK as usize] ^= 0xff;
    fs::write(&file_path, &bytes).unwrap();

    source.forget_fetches();
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    assert!(!cache.adopted_holder());
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert!(source.fetched(&layer).is_empty(), "metadata was already local");
    assert_eq!(read(&lease.mount_path().join(read_file)).unwrap(), layer.files[read_file]);
    assert_eq!(source.fetched(&layer), vec![damaged], "only the damaged chunk is fetched again");

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_dies_is_replaced_while_the_cache_runs() {
    let fx = Fixture::new();
    let layer = build_layer("respawn", layer_files(10, 4));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let first = cache.holder_pid();
    // SAFETY: signals the holder this test's cache started.
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);

    let deadline = Instant::now() + PATIENCE;
    while cache.holder_pid() == first {
        assert!(Instant::now() < deadline, "no new holder");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = cache.holder_pid();
    assert!(Path::new(&format!("/proc/{second}")).exists());
    assert_eq!(fx.holder_pid(), Some(second), "the record names the new holder");
    assert_eq!(read(&lease.mount_path().join("data/file001")).unwrap(), layer.files["data/file001"]);

    drop(lease);
    cache.shutdown().await.unwrap();
}

/// What the crash child needs to open the same cache on the same layer.
#[derive(serde::Serialize, serde::Deserialize)]
struct ChildPlan {
    cache_dir: PathBuf,
    image: PathBuf,
    manifest: LayerManifest,
    /// Chunks the child's source never delivers.
    hanging: Vec<usize>,
    hang_marker: PathBuf,
}

/// Not a test: a cache process that mounts a layer, says so, and waits to
/// be killed.
#[test]
fn crash_child_entry_point() {
    let Some(plan) = std::env::var_os(CHILD_ENV) else { return };
    let plan: ChildPlan = serde_json::from_slice(&fs::read(plan).unwrap()).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let source = TestSource::default();
        source.images.lock().unwrap().insert(plan.manifest.digest.clone(), fs::read(&plan.image).unwrap());
        *source.hanging.lock().unwrap() = plan.hanging.into_iter().collect();
        *source.hang_marker.lock().unwrap() = Some(plan.hang_marker);
        let config = CacheConfig {
            dir: plan.cache_dir,
            capacity_bytes: 1 << 30,
            holder: holder_command(),
            fill_threads: 2,
            readahead_kb: None,
            warm_readahead_kb: None,
            complete_after_use: false,
            prefetch: PrefetchConfig::default(),
        };
        let cache = LayerCache::open_with(config, Arc::new(source)).await.unwrap();
        let lease = cache.acquire(&plan.manifest).await.unwrap();
        println!("{CHILD_READY} {}", lease.mount_path().display());
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        std::process::abort();
    });
}

/// A cache running in another process, on the fixture's directory.
struct CacheChild {
    child: std::process::Child,
    mount: PathBuf,
}

impl CacheChild {
    /// Starts the child and waits until it has mounted `layer`.
    fn start(fx: &Fixture, layer: &Built, hanging: &[usize]) -> Self {
        let image = fx.tmp.path().join("image.erofs");
        fs::write(&image, &layer.image).unwrap();
        let plan = ChildPlan {
            cache_dir: fx.cache_dir(),
            image,
            manifest: layer.manifest.clone(),
            hanging: hanging.to_vec(),
            hang_marker: fx.hang_marker(),
        };
        let plan_path = fx.tmp.path().join("plan.json");
        fs::write(&plan_path, serde_json::to_vec(&plan).unwrap()).unwrap();
        // The holder outlives the child; as subreaper this process inherits
        // it and can reap it.
        // SAFETY: prctl with integer arguments only.
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }, 0);
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["crash_child_entry_point", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &plan_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        // libtest prints "test <name> ... " without a newline before running
        // the test, so the marker may sit mid-line.
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some((_, path)) = line.split_once(CHILD_READY) {
                    let _ = ready_tx.send(PathBuf::from(path.trim()));
                }
            }
        });
        match ready_rx.recv_timeout(PATIENCE) {
            Ok(mount) => Self { child, mount },
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child never mounted the layer: {e}");
            }
        }
    }

    /// Kills the cache process: no cleanup of any kind runs.
    fn crash(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for CacheChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A thread of this process reading a whole file.
struct Reader {
    tid: i32,
    done: std::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>,
}

impl Reader {
    fn start(path: PathBuf) -> Self {
        let (tid_tx, tid_rx) = channel();
        let (done_tx, done) = channel();
        std::thread::spawn(move || {
            tid_tx.send(rustix::thread::gettid().as_raw_nonzero().get()).unwrap();
            let mut bytes = Vec::new();
            let result = fs::File::open(&path).and_then(|mut f| f.read_to_end(&mut bytes)).map(|_| bytes);
            let _ = done_tx.send(result);
        });
        Self { tid: tid_rx.recv().unwrap(), done }
    }

    /// Waits until the reader sleeps on a fanotify verdict; panics if the
    /// read returns first.
    fn wait_until_blocked(&self) {
        let deadline = Instant::now() + PATIENCE;
        while !waits_on_fanotify(self.tid) {
            if let Ok(result) = self.done.try_recv() {
                panic!("the read returned without a verdict: {:?}", result.map(|b| b.len()));
            }
            assert!(Instant::now() < deadline, "the reader never blocked on fanotify");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(self.done.try_recv(), Err(TryRecvError::Empty)), "the reader is still waiting");
    }

    async fn finish(self) -> std::io::Result<Vec<u8>> {
        tokio::task::spawn_blocking(move || self.done.recv_timeout(PATIENCE))
            .await
            .unwrap()
            .expect("the reader finished once a cache was back")
    }
}

/// Whether thread `tid` of this process sleeps waiting for a fanotify verdict.
fn waits_on_fanotify(tid: i32) -> bool {
    let task = format!("/proc/self/task/{tid}");
    let wchan = fs::read_to_string(format!("{task}/wchan")).unwrap_or_default();
    let stack = fs::read_to_string(format!("{task}/stack")).unwrap_or_default();
    wchan.contains("fanotify") || stack.contains("fanotify")
}

fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + PATIENCE;
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Shuts the adopting cache down and reaps the adopted holder, which this
/// process inherited as subreaper.
async fn shut_down_adopter(cache: LayerCache, mount: &Path, holder: i32) {
    cache.shutdown().await.unwrap();
    assert_eq!(erofs_mounts_at(mount), 0);
    // SAFETY: waits for a process this test's child started and this
    // process inherited.
    assert_eq!(unsafe { libc::waitpid(holder, std::ptr::null_mut(), 0) }, holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_daemon_blocks_readers_until_a_new_cache_adopts_the_holder() {
    let fx = Fixture::new();
    let layer = build_layer("crash", layer_files(11, 12));
    let child = CacheChild::start(&fx, &layer, &[]);
    let mount = child.mount.clone();
    child.crash();
    let holder = fx.holder_pid().expect("the child recorded its holder");
    assert!(Path::new(&format!("/proc/{holder}")).exists(), "the holder outlived the cache");
    assert_eq!(erofs_mounts_at(&mount), 1, "the mount outlived the cache");

    // A reader of data no daemon fetched yet must wait, not read zeros.
    let name = "data/file007";
    let reader = Reader::start(mount.join(name));
    reader.wait_until_blocked();

    // A new cache adopts the holder's group and answers the waiting reader.
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    assert!(cache.adopted_holder());
    assert_eq!(cache.holder_pid(), holder);
    let bytes = reader.finish().await.unwrap();
    assert!(bytes == layer.files[name], "the waiting reader got the file's bytes");
    assert!(!source.fetched(&layer).is_empty(), "the adopting cache fetched the data");

    // The surviving mount is the cache's again: leasable, then torn down.
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(lease.mount_path(), mount);
    assert_eq!(read(&mount.join("data/file003")).unwrap(), layer.files["data/file003"]);
    drop(lease);
    shut_down_adopter(cache, &mount, holder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_the_dead_daemon_had_taken_is_answered_by_the_next_cache() {
    let fx = Fixture::new();
    let layer = build_layer("orphan", layer_files(12, 12));
    let name = "data/file006";
    let data: Vec<usize> = layer.chunks_of(name).difference(&layer.metadata_chunks()).copied().collect();
    let child = CacheChild::start(&fx, &layer, &data);
    let mount = child.mount.clone();

    // The child's daemon takes the reader's event and hangs fetching it...
    let reader = Reader::start(mount.join(name));
    wait_for_file(&fx.hang_marker());
    reader.wait_until_blocked();
    // ...and dies holding it: no process will ever answer it by itself.
    child.crash();
    let holder = fx.holder_pid().expect("the child recorded its holder");

    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    assert!(cache.adopted_holder());
    // The orphaned readahead event is denied with EIO; the kernel then
    // retries the page alone, which raises an event the new daemon fills.
    let bytes = reader.finish().await.unwrap();
    assert!(bytes == layer.files[name], "the reader got the file's bytes");
    assert_eq!(read(&mount.join(name)).unwrap(), layer.files[name]);
    shut_down_adopter(cache, &mount, holder).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_holder_the_next_cache_remounts_the_layer_afresh() {
    let fx = Fixture::new();
    let layer = build_layer("lost", layer_files(13, 8));
    let child = CacheChild::start(&fx, &layer, &[]);
    let mount = child.mount.clone();
    child.crash();
    let holder = fx.holder_pid().expect("the child recorded its holder");
    // With the holder gone too, the group is gone: the old mount no longer
    // fails closed and must not be reused.
    // SAFETY: signals and reaps the holder this process inherited.
    unsafe {
        assert_eq!(libc::kill(holder, libc::SIGKILL), 0);
        assert_eq!(libc::waitpid(holder, std::ptr::null_mut(), 0), holder);
    }
    assert_eq!(erofs_mounts_at(&mount), 1);

    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    assert!(!cache.adopted_holder());
    assert_ne!(cache.holder_pid(), holder);
    assert_eq!(erofs_mounts_at(&mount), 0, "the stale mount was taken down");
    let stats = cache.stats();
    assert_eq!(stats.len(), 1, "the layer file was kept");
    assert!(!stats[0].mounted);

    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert!(source.fetched(&layer).is_empty(), "the metadata on disk passed its check");
    let name = "data/file005";
    assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);
    drop(lease);
    cache.shutdown().await.unwrap();
}

// ------------------------------------------------------- metadata blobs

/// A layer like a Python tree: many small files (inline tails), some large
/// ones, nested directories, a symlink, a hard link and an xattr.
fn python_like_files() -> BTreeMap<String, Vec<u8>> {
    let mut files = layer_files(11, 12);
    for pkg in 0..6 {
        for module in 0..40 {
            let len = 300 + (pkg * 977 + module * 131) % 9000;
            files.insert(
                format!("lib/pkg{pkg}/sub{}/mod{module:02}.py", module % 4),
                noise(pkg * 100 + module, len as usize),
            );
        }
    }
    files
}

fn build_python_like(name: &str) -> Built {
    with_metadata_blob(build_layer(name, python_like_files()))
}

/// Every path under `root` with its `lstat`, like `ls -lR`.
fn stat_tree(root: &Path) -> BTreeMap<String, (u32, u64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path.clone());
            }
            let rel = path.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            out.insert(rel, (std::os::unix::fs::MetadataExt::mode(&meta), meta.len()));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metadata_blob_alone_mounts_and_stats_every_file_while_all_data_is_refused() {
    let fx = Fixture::new();
    let layer = build_python_like("blob");
    let blob_len = layer.blob.as_ref().unwrap().len() as u64;
    assert!(blob_len * 4 < layer.manifest.size, "metadata {blob_len} of {} bytes", layer.manifest.size);
    let source = TestSource::with(&[&layer]);
    // The store refuses every data chunk: only the metadata blob comes.
    *source.failing.lock().unwrap() = (0..layer.manifest.chunks.len()).collect();
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();

    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(*source.blob_fetches.lock().unwrap(), 1);
    assert!(source.fetched(&layer).is_empty(), "no chunk fetched before mounting");

    let root = lease.mount_path();
    let tree = stat_tree(root);
    for (path, bytes) in &layer.files {
        let (mode, len) = tree.get(path).unwrap_or_else(|| panic!("{path} missing from the listing"));
        assert_eq!((mode & 0o170000, *len), (0o100000, bytes.len() as u64), "{path}");
    }
    let ls = Command::new("ls").arg("-lR").arg(root).output().unwrap();
    assert!(ls.status.success(), "ls -lR: {}", String::from_utf8_lossy(&ls.stderr));
    // Inline files are metadata too: readable with no chunk.
    assert_eq!(read(&root.join("etc/hostname")).unwrap(), layer.files["etc/hostname"]);
    assert!(source.fetched(&layer).is_empty(), "listing and stat fetched {:?}", source.fetched(&layer));
    let stats = &cache.stats()[0];
    assert_eq!((stats.metadata_bytes_fetched, stats.metadata_chunks_fetched, stats.chunks_fetched), (blob_len, 0, 0));
    assert_eq!(stats.bytes_fetched, blob_len);

    // Data fails closed while the store refuses it...
    assert_eq!(read_errno(&root.join("data/file003")), Some(libc::EIO));
    // ...and once it serves, every file reads back whole, including data in
    // chunks that also hold metadata pages.
    source.failing.lock().unwrap().clear();
    for (path, bytes) in &layer.files {
        assert_eq!(&read(&root.join(path)).unwrap(), bytes, "{path}");
    }
    cache.fetch_all(&lease).await.unwrap();
    assert_eq!(fs::read(lease.file_path()).unwrap(), layer.image);

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_metadata_blob_fails_the_acquire_and_leaves_no_layer_behind() {
    let fx = Fixture::new();
    let layer = build_python_like("badmeta");
    let source = TestSource::with(&[&layer]);
    *source.corrupt_blob.lock().unwrap() = true;
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();

    let err = cache.acquire(&layer.manifest).await.unwrap_err();
    assert!(matches!(err, CacheError::Metadata { .. }), "{err}");
    assert!(err.to_string().contains("hashes to"), "{err}");
    let hex = &layer.manifest.digest[7..];
    let left: Vec<String> = fs::read_dir(fx.cache_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with(hex))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(cache.stats().is_empty());
    assert_eq!(erofs_mounts_at(&fx.cache_dir().join("mnt").join(hex)), 0);

    // A missing blob is as clear, and as clean.
    source.blobs.lock().unwrap().clear();
    let err = cache.acquire(&layer.manifest).await.unwrap_err();
    assert!(matches!(err, CacheError::Metadata { .. }), "{err}");

    *source.corrupt_blob.lock().unwrap() = false;
    source.blobs.lock().unwrap().insert(layer.manifest.digest.clone(), layer.blob.clone().unwrap());
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(read(&lease.mount_path().join("data/file001")).unwrap(), layer.files["data/file001"]);
    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopening_keeps_verified_metadata_pages_and_refetches_damaged_ones() {
    let fx = Fixture::new();
    let layer = build_python_like("metaagain");
    let source = TestSource::with(&[&layer]);
    let file_path = {
        let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
        let lease = cache.acquire(&layer.manifest).await.unwrap();
        let path = lease.file_path().to_owned();
        drop(lease);
        cache.shutdown().await.unwrap();
        path
    };
    assert_eq!(*source.blob_fetches.lock().unwrap(), 1);

    // Reopened as is: the pages check out and nothing is fetched again.
    {
        let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
        let lease = cache.acquire(&layer.manifest).await.unwrap();
        assert_eq!(*source.blob_fetches.lock().unwrap(), 1);
        let tree = stat_tree(lease.mount_path());
        assert!(layer.files.keys().all(|p| tree.contains_key(p)));
        drop(lease);
        cache.shutdown().await.unwrap();
    }

    // A damaged metadata page while no cache runs: the blob comes again.
    let first_page = layer.manifest.metadata_pages()[0].start as usize;
    let mut bytes = fs::read(&file_path).unwrap();
    bytes[first_page + 1024] ^= 0xff; // the superblock's magic
    fs::write(&file_path, &bytes).unwrap();
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(*source.blob_fetches.lock().unwrap(), 2);
    let tree = stat_tree(lease.mount_path());
    assert!(layer.files.keys().all(|p| tree.contains_key(p)));
    drop(lease);
    cache.shutdown().await.unwrap();
}

// ---------------------------------------------------------------- pieces

const PIECE: u64 = 16 * 1024;

/// `built` with piece digests (and a metadata blob), as a push makes it.
fn with_pieces(built: Built) -> Built {
    let mut built = with_metadata_blob(built);
    built.manifest.piece_size = Some(PIECE);
    built.manifest.pieces =
        built.image.chunks(PIECE as usize).map(|p| format!("sha256:{}", hex(&Sha256::digest(p)))).collect();
    built.manifest.validate().unwrap();
    built
}

impl Built {
    fn pieces_of(&self, file: &str) -> BTreeSet<usize> {
        self.extents[file]
            .iter()
            .flat_map(|&(offset, len)| (offset / PIECE) as usize..=((offset + len - 1) / PIECE) as usize)
            .collect()
    }
}

impl TestSource {
    /// Every piece requested for `layer`, in request order.
    fn pieces_fetched(&self, layer: &Built) -> Vec<usize> {
        let runs = self.piece_runs.lock().unwrap();
        runs.iter()
            .filter(|(d, _, _)| *d == layer.manifest.digest)
            .flat_map(|&(_, first, n)| first..first + n)
            .collect()
    }
}

/// Whether `[offset, offset + len)` of `path` holds no data (a hole in the
/// sparse layer file). `lseek` raises no pre-content event.
fn is_hole(path: &Path, offset: u64, len: u64) -> bool {
    let file = fs::File::open(path).unwrap();
    match rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(offset)) {
        Ok(next_data) => next_data >= offset + len,
        Err(rustix::io::Errno::NXIO) => true,
        Err(e) => panic!("SEEK_DATA: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_pieces_a_read_fetches_only_the_pieces_under_its_file_in_ranged_runs() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("pieces", layer_files(21, 24)));
    let source = TestSource::with(&[&layer]);
    // The demand path alone (prefetching reaches past a file's end).
    let config = CacheConfig { prefetch: PrefetchConfig::off(), ..fx.config(1 << 30) };
    let cache = LayerCache::open_with(config, source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert!(source.fetched(&layer).is_empty() && source.pieces_fetched(&layer).is_empty(), "only the blob came");

    let name = "data/file007";
    assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);

    let fetched = source.pieces_fetched(&layer);
    let unique: BTreeSet<usize> = fetched.iter().copied().collect();
    assert_eq!(unique.len(), fetched.len(), "a piece was fetched twice: {fetched:?}");
    assert!(source.fetched(&layer).is_empty(), "no whole chunk was fetched");
    let under_file = layer.pieces_of(name);
    assert!(unique.is_subset(&under_file), "fetched {unique:?}, the file lies in {under_file:?}");
    // All of the file's data pieces came (a piece made only of metadata
    // pages would not need to, and a ~250 KB file has at most two of them).
    assert!(unique.len() + 2 >= under_file.len(), "fetched {unique:?} of {under_file:?}");
    let runs: Vec<(usize, usize)> = source.piece_runs.lock().unwrap().iter().map(|&(_, f, n)| (f, n)).collect();
    assert!(runs.len() < fetched.len(), "neighbouring pieces were coalesced: {runs:?}");
    let per_chunk = (CHUNK / PIECE) as usize;
    for &(first, n) in &runs {
        assert_eq!(first / per_chunk, (first + n - 1) / per_chunk, "run {first}+{n} crosses a chunk");
    }
    // A small read costs less than the chunk it falls in, readahead
    // window included.
    let other = "data/file011";
    let mut head = [0u8; 4096];
    let file = fs::File::open(lease.mount_path().join(other)).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).unwrap();
    assert_eq!(&head[..], &layer.files[other][..4096]);
    let small: Vec<usize> = source.pieces_fetched(&layer).into_iter().filter(|i| !unique.contains(i)).collect();
    assert!(!small.is_empty() && (small.len() as u64) * PIECE < CHUNK, "a 4 KiB read fetched pieces {small:?}");
    drop(file);

    // Presence is per piece: the bitmap has one byte per piece, set for
    // exactly the pieces fetched (and those made only of metadata pages).
    let hex = &layer.manifest.digest[7..];
    let bitmap = fs::read(fx.cache_dir().join(format!("{hex}.present"))).unwrap();
    assert_eq!(bitmap.len(), layer.manifest.pieces.len());
    for index in &unique {
        assert_eq!(bitmap[*index], 1, "piece {index} fetched but not marked present");
    }
    let stats = &cache.stats()[0];
    let all = source.pieces_fetched(&layer);
    assert_eq!(stats.chunks_fetched, all.len() as u64, "fetch units are pieces");
    let piece_bytes: u64 = all.iter().map(|&i| layer.manifest.fetch_unit_extent(i).unwrap().1).sum();
    assert_eq!(stats.bytes_fetched - stats.metadata_bytes_fetched, piece_bytes);

    // The next file's pieces in a chunk already partly present come alone.
    source.piece_runs.lock().unwrap().clear();
    for (path, bytes) in &layer.files {
        assert_eq!(&read(&lease.mount_path().join(path)).unwrap(), bytes, "{path}");
    }
    let again: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
    let unique: BTreeSet<usize> = unique.into_iter().chain(small).collect();
    assert!(again.is_disjoint(&unique), "present pieces were fetched again: {:?}", again.intersection(&unique));
    cache.fetch_all(&lease).await.unwrap();
    assert_eq!(fs::read(lease.file_path()).unwrap(), layer.image);

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_piece_that_does_not_match_its_digest_fails_the_read_with_eio_and_is_not_written() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("badpiece", layer_files(22, 8)));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let name = "data/file004";
    // A piece well inside the file: all data, no metadata page in it.
    let pieces: Vec<usize> = layer.pieces_of(name).into_iter().collect();
    let bad = pieces[pieces.len() / 2];
    *source.corrupt_pieces.lock().unwrap() = HashSet::from([bad]);
    assert_eq!(read_errno(&lease.mount_path().join(name)), Some(libc::EIO), "a corrupt piece reads as EIO");
    assert!(source.pieces_fetched(&layer).contains(&bad));

    let (offset, len) = layer.manifest.fetch_unit_extent(bad).unwrap();
    assert!(is_hole(lease.file_path(), offset, len), "the corrupt piece's bytes reached the layer file");
    let hex = &layer.manifest.digest[7..];
    let bitmap = fs::read(fx.cache_dir().join(format!("{hex}.present"))).unwrap();
    assert_eq!(bitmap[bad], 0, "the corrupt piece is not marked present");
    assert!(cache.stats()[0].failed_fills >= 1);

    // Fixed at the source, the same read succeeds: nothing was poisoned.
    source.corrupt_pieces.lock().unwrap().clear();
    assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);
    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_mount_gets_the_configured_readahead_window() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("ra", layer_files(23, 2)));
    let source = TestSource::with(&[&layer]);
    let config = CacheConfig { readahead_kb: Some(12), ..fx.config(1 << 30) };
    let cache = LayerCache::open_with(config, source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(mount_readahead_kb(lease.mount_path()), 12);
    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_mount_widens_its_readahead_once_a_reader_lets_go_and_a_complete_one_starts_wide() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("ra-warm", layer_files(29, 3)));
    let source = TestSource::with(&[&layer]);
    let config = || CacheConfig { readahead_kb: Some(12), warm_readahead_kb: Some(40), ..fx.config(1 << 30) };
    let cache = LayerCache::open_with(config(), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let mount = lease.mount_path().to_path_buf();
    assert_eq!(mount_readahead_kb(&mount), 12);
    // A use that read nothing (a pull) tells nothing about the workload.
    drop(lease);
    assert_eq!(mount_readahead_kb(&mount), 12);

    // A lease that lives throughout (a warm pool's idle member, an
    // overlapping rollout) does not hold the widening back.
    let throughout = cache.acquire(&layer.manifest).await.unwrap();
    let reader = cache.acquire(&layer.manifest).await.unwrap();
    let name = "data/file000";
    assert_eq!(read(&mount.join(name)).unwrap(), layer.files[name]);
    // A lease made after the reads, that saw none itself, tells nothing.
    drop(cache.acquire(&layer.manifest).await.unwrap());
    assert_eq!(mount_readahead_kb(&mount), 12, "widened by a lease that saw no read");
    drop(reader);
    assert_eq!(mount_readahead_kb(&mount), 40, "not widened once the node ran something from the layer");
    // A wide window's events name units nobody asked for: the access trace
    // stops there.
    let before = cache.stats()[0].clone();
    assert!(before.traced_units > 0);
    let reader = cache.acquire(&layer.manifest).await.unwrap();
    let name = "data/file002";
    assert_eq!(read(&mount.join(name)).unwrap(), layer.files[name]);
    let after = &cache.stats()[0];
    assert!(after.fill_events > before.fill_events, "the read raised no event");
    assert_eq!(after.traced_units, before.traced_units, "recorded after the window widened");
    drop(reader);
    drop(throughout);

    let lease = cache.acquire(&layer.manifest).await.unwrap();
    cache.fetch_all(&lease).await.unwrap();
    drop(lease);
    cache.shutdown().await.unwrap();
    // Mounted again, complete: nothing is left to fetch, so it starts wide.
    let cache = LayerCache::open_with(config(), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(mount_readahead_kb(lease.mount_path()), 40);
    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_complete_after_use_a_layer_the_node_ran_is_completed_in_the_background_and_read_without_events() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("complete", layer_files(31, 4)));
    let source = TestSource::with(&[&layer]);
    let config = CacheConfig { complete_after_use: true, ..fx.config(1 << 30) };
    let cache = LayerCache::open_with(config, source.clone()).await.unwrap();
    // A use that read nothing (a pull) starts nothing.
    drop(cache.acquire(&layer.manifest).await.unwrap());
    let pulled = cache.stats()[0].clone();
    assert_eq!((pulled.completion_units, pulled.completion_running), (0, 0));
    assert!(pulled.present_bytes < layer.manifest.size);

    let reader = cache.acquire(&layer.manifest).await.unwrap();
    let mount = reader.mount_path().to_path_buf();
    let name = "data/file000";
    assert_eq!(read(&mount.join(name)).unwrap(), layer.files[name]);
    drop(reader);
    eventually("the layer to be completed", || {
        let stats = &cache.stats()[0];
        stats.present_bytes == layer.manifest.size && stats.completion_running == 0
    })
    .await;
    let done = cache.stats()[0].clone();
    assert!(done.completion_units > 0 && done.completion_bytes > 0, "{done:?}");
    assert_eq!(done.failed_completion_units, 0);
    assert!(done.bytes_fetched >= done.completion_bytes, "completion bytes are part of the fetched bytes");
    assert_eq!(fs::read(fx.cache_dir().join(format!("{}.erofs", &layer.manifest.digest[7..]))).unwrap(), layer.image);

    // Complete, the layer is unmarked: a read of data never read before
    // raises no event.
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    let name = "data/file003";
    assert_eq!(read(&mount.join(name)).unwrap(), layer.files[name]);
    assert_eq!(cache.stats()[0].fill_events, done.fill_events, "a complete layer still raised events");
    drop(lease);
    cache.shutdown().await.unwrap();
}

/// The readahead window of the filesystem mounted at `path`, from its bdi.
fn mount_readahead_kb(path: &Path) -> u32 {
    const FS_IOC_GETFSSYSFSPATH: libc::c_ulong = 0x8081_1501;
    let dir = fs::File::open(path).unwrap();
    let mut buf = [0u8; 129];
    // SAFETY: the ioctl writes at most 129 bytes (its encoded size) into `buf`.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), FS_IOC_GETFSSYSFSPATH, buf.as_mut_ptr()) };
    assert_eq!(rc, 0, "FS_IOC_GETFSSYSFSPATH: {}", std::io::Error::last_os_error());
    let sysfs = std::str::from_utf8(&buf[1..1 + buf[0] as usize]).unwrap();
    let bdi = sysfs.rsplit('/').next().unwrap();
    fs::read_to_string(format!("/sys/class/bdi/{bdi}/read_ahead_kb")).unwrap().trim().parse().unwrap()
}

// ---------------------------------------------------------------- prefetch

/// Reads `len` bytes from the start of `path` in 16 KiB reads with
/// readahead off (`POSIX_FADV_RANDOM`), so each read is one fill event for
/// exactly its pages.
fn read_in_steps(path: &Path, len: usize) -> std::io::Result<Vec<u8>> {
    let file = fs::File::open(path)?;
    // SAFETY: posix_fadvise reads no memory of ours; `file` is open.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    assert_eq!(rc, 0, "posix_fadvise");
    let mut out = vec![0u8; len];
    for (i, step) in out.chunks_mut(16 * 1024).enumerate() {
        std::os::unix::fs::FileExt::read_exact_at(&file, step, (i * 16 * 1024) as u64)?;
    }
    Ok(out)
}

impl Built {
    /// The pieces under the first `len` bytes of `file` (one extent).
    fn pieces_under_head(&self, file: &str, len: u64) -> BTreeSet<usize> {
        let (offset, extent) = self.extents[file][0];
        assert!(extent >= len, "{file}: first extent {extent} < {len}");
        ((offset / PIECE) as usize..=((offset + len - 1) / PIECE) as usize).collect()
    }
}

/// Polls `done` until it holds; `PATIENCE` only bounds a failing test.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < PATIENCE, "gave up waiting: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn bitmap_of(fx: &Fixture, layer: &Built) -> Vec<u8> {
    fs::read(fx.cache_dir().join(format!("{}.present", &layer.manifest.digest[7..]))).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_read_prefetches_the_next_pieces_which_later_reads_use() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("seq", layer_files(31, 8)));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let name = "data/file002";
    let path = lease.mount_path().join(name);
    let head = 64 * 1024;
    assert_eq!(read_in_steps(&path, head).unwrap(), layer.files[name][..head]);
    // Every prefetch is planned before its event is answered, so once the
    // reads returned, nothing in flight means every prefetch has settled.
    eventually("the prefetches settle", || {
        let s = &cache.stats()[0];
        s.prefetched_units + s.failed_prefetches > 0 && s.prefetch_requests_in_flight == 0
    })
    .await;
    let stats = cache.stats()[0].clone();
    let under_read = layer.pieces_under_head(name, head as u64);
    let fetched: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
    let ahead: BTreeSet<usize> = fetched.difference(&under_read).copied().collect();
    assert!(!ahead.is_empty(), "nothing was fetched past the reads: {fetched:?}, read {under_read:?}");
    assert!(stats.prefetched_units >= ahead.len() as u64 && stats.failed_prefetches == 0, "{stats:?}");
    assert!(
        stats.prefetch_requests > 0 && stats.prefetch_requests < stats.prefetched_units,
        "runs coalesce: {stats:?}"
    );
    // Past the read, within reach of the window, and under the same file.
    let file_pieces = layer.pieces_of(name);
    let window = (PrefetchConfig::default().max_ahead_bytes / PIECE) as usize;
    let last_read = *under_read.last().unwrap();
    for &p in &ahead {
        assert!(p > last_read && p <= last_read + window, "piece {p} is not just past the read (up to {last_read})");
        assert!(file_pieces.contains(&p), "piece {p} is outside {name}");
    }
    // Prefetched pieces are verified and marked present like demand ones.
    let bitmap = bitmap_of(&fx, &layer);
    assert!(ahead.iter().all(|&p| bitmap[p] == 1), "prefetched pieces are present");

    // Reading on finds them local: no piece is fetched twice, and they
    // count as used.
    let runs_before = source.piece_runs.lock().unwrap().len();
    assert_eq!(read(&path).unwrap(), layer.files[name]);
    let all = source.pieces_fetched(&layer);
    let unique: BTreeSet<usize> = all.iter().copied().collect();
    assert_eq!(unique.len(), all.len(), "a piece was fetched twice: {all:?}");
    let stats = cache.stats()[0].clone();
    assert!(stats.prefetched_units_used >= ahead.len() as u64, "{stats:?}");
    assert!(source.piece_runs.lock().unwrap().len() >= runs_before);

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_prefetched_piece_is_refused_and_its_read_fails_until_the_source_is_fixed() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("badahead", layer_files(32, 6)));
    let source = TestSource::with(&[&layer]);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let name = "data/file003";
    let path = lease.mount_path().join(name);
    let head = 32 * 1024;
    let under_read = layer.pieces_under_head(name, head as u64);
    let bad: HashSet<usize> = layer.pieces_of(name).into_iter().filter(|p| !under_read.contains(p)).collect();
    *source.corrupt_pieces.lock().unwrap() = bad.clone();
    assert_eq!(read_in_steps(&path, head).unwrap(), layer.files[name][..head], "the pieces read are fine");
    eventually("a prefetch of a corrupt piece fails", || cache.stats()[0].failed_prefetches > 0).await;
    eventually("the prefetches settle", || cache.stats()[0].prefetch_requests_in_flight == 0).await;

    let bitmap = bitmap_of(&fx, &layer);
    for &p in &bad {
        assert_eq!(bitmap[p], 0, "corrupt piece {p} is marked present");
        let (offset, len) = layer.manifest.fetch_unit_extent(p).unwrap();
        assert!(is_hole(lease.file_path(), offset, len), "corrupt piece {p}'s bytes reached the layer file");
    }
    assert_eq!(cache.stats()[0].prefetched_units_used, 0);
    // A read of it fetches it again on demand and gets EIO, as any other.
    assert_eq!(read_errno(&path), Some(libc::EIO));
    source.corrupt_pieces.lock().unwrap().clear();
    assert_eq!(read(&path).unwrap(), layer.files[name]);

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_requests_in_flight_never_exceed_their_bound() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("bound", layer_files(33, 8)));
    let source = TestSource::with(&[&layer]);
    let head = 96 * 1024;
    let names: Vec<String> = (0..4).map(|i| format!("data/file{:03}", 2 * i)).collect();
    let demand: HashSet<usize> = names.iter().flat_map(|n| layer.pieces_under_head(n, head as u64)).collect();
    *source.demand_only.lock().unwrap() = Some(demand);
    let bound = 2;
    let prefetch = PrefetchConfig { max_requests: bound, ..fx.config(0).prefetch };
    let config = CacheConfig { prefetch, ..fx.config(1 << 30) };
    let cache = LayerCache::open_with(config, source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let readers: Vec<_> = names
        .iter()
        .map(|name| {
            let path = lease.mount_path().join(name);
            std::thread::spawn(move || read_in_steps(&path, head))
        })
        .collect();
    eventually("prefetches reach the bound", || source.held_now.load(Ordering::SeqCst) == bound).await;
    source.released.store(true, Ordering::SeqCst);
    for (reader, name) in readers.into_iter().zip(&names) {
        assert_eq!(reader.join().unwrap().unwrap(), layer.files[name][..head]);
    }
    assert_eq!(source.held_max.load(Ordering::SeqCst), bound, "more prefetches than the bound were in flight");
    assert!(cache.stats()[0].prefetch_requests >= bound as u64);

    drop(lease);
    cache.shutdown().await.unwrap();
}

/// Descriptors of this process open on `file` (also once it is deleted).
fn fds_on(file: &Path) -> usize {
    let name = file.file_name().unwrap().to_str().unwrap().to_owned();
    fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains(&name))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_layer_cancels_its_prefetches_and_leaves_nothing_behind() {
    let fx = Fixture::new();
    let evicted = with_pieces(build_layer("gone", layer_files(34, 4)));
    let closed = with_pieces(build_layer("shut", layer_files(35, 4)));
    let source = TestSource::with(&[&evicted, &closed]);
    let head = 48 * 1024;
    let name = "data/file001";
    let demand: HashSet<usize> = evicted
        .pieces_under_head(name, head as u64)
        .into_iter()
        .chain(closed.pieces_under_head(name, head as u64))
        .collect();
    // Prefetches hang for good: only closing the layers ends them.
    *source.demand_only.lock().unwrap() = Some(demand);
    let cache = LayerCache::open_with(fx.config(1 << 30), source.clone()).await.unwrap();

    // Eviction of an unleased layer while its prefetch hangs.
    let lease = cache.acquire(&evicted.manifest).await.unwrap();
    let (file, mount) = (lease.file_path().to_owned(), lease.mount_path().to_owned());
    let path = lease.mount_path().join(name);
    let got = tokio::task::spawn_blocking(move || read_in_steps(&path, head)).await.unwrap().unwrap();
    assert_eq!(got, evicted.files[name][..head]);
    eventually("a prefetch hangs", || source.held_now.load(Ordering::SeqCst) == 1).await;
    drop(lease);
    assert_eq!(cache.evict_unreferenced(&HashSet::new()).0, 1);
    assert!(!file.exists() && erofs_mounts_at(&mount) == 0);
    eventually("the aborted prefetch lets go", || source.held_now.load(Ordering::SeqCst) == 0).await;
    eventually("no descriptor keeps the deleted layer", || fds_on(&file) == 0).await;

    // Shutdown while a prefetch hangs: it returns, and nothing stays open.
    let lease = cache.acquire(&closed.manifest).await.unwrap();
    let (file, mount) = (lease.file_path().to_owned(), lease.mount_path().to_owned());
    let path = lease.mount_path().join(name);
    let got = tokio::task::spawn_blocking(move || read_in_steps(&path, head)).await.unwrap().unwrap();
    assert_eq!(got, closed.files[name][..head]);
    eventually("a prefetch hangs", || source.held_now.load(Ordering::SeqCst) == 1).await;
    let hanging: Vec<usize> = source
        .pieces_fetched(&closed)
        .into_iter()
        .filter(|p| !closed.pieces_under_head(name, head as u64).contains(p))
        .collect();
    assert!(!hanging.is_empty());
    drop(lease);
    tokio::time::timeout(PATIENCE, cache.shutdown()).await.expect("shutdown waits on a hung prefetch").unwrap();
    assert_eq!(source.held_now.load(Ordering::SeqCst), 0, "shutdown returned before its prefetches ended");
    assert_eq!(erofs_mounts_at(&mount), 0);
    assert_eq!(fds_on(&file), 0, "a descriptor on the layer file outlived the cache");
    let bitmap = bitmap_of(&fx, &closed);
    for p in hanging {
        assert_eq!(bitmap[p], 0, "cancelled piece {p} is marked present");
    }
}

// ------------------------------------------------------- whole small files

const WHOLE_FILE_BOUND: u64 = 256 * 1024;

/// Small source-like files (several pieces each, so a 16 KiB window
/// alone would take several events), one file above the bound, and the
/// usual tiny inline ones.
fn small_and_large_files(seed: u64) -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for (i, len) in [45_000usize, 70_000, 100_000, 130_000].into_iter().enumerate() {
        files.insert(format!("lib/mod{i}.py"), noise(seed * 100 + i as u64, len));
    }
    files.insert("lib/big.so".into(), noise(seed * 100 + 50, 600_000));
    files.insert("etc/hostname".into(), format!("layer-{seed}\n").into_bytes());
    files
}

/// A cache that fetches small files whole and does no stream prefetch, so
/// every request the source sees is a demand one.
async fn whole_file_cache(fx: &Fixture, source: Arc<TestSource>) -> LayerCache {
    let prefetch = PrefetchConfig { whole_file_bytes: WHOLE_FILE_BOUND, ..PrefetchConfig::off() };
    let config = CacheConfig { prefetch, ..fx.config(1 << 30) };
    LayerCache::open_with(config, source).await.unwrap()
}

fn read_head(path: &Path, len: usize) -> Vec<u8> {
    let file = fs::File::open(path).unwrap();
    let mut head = vec![0u8; len];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0).unwrap();
    head
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_the_first_page_of_a_small_file_fetches_the_whole_file_in_one_request_per_chunk() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("whole", small_and_large_files(41)));
    let source = TestSource::with(&[&layer]);
    let cache = whole_file_cache(&fx, source.clone()).await;
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    // Not neighbours on disk: a piece shared with a file read before
    // would make the first page local already.
    for name in ["lib/mod0.py", "lib/mod2.py"] {
        source.piece_runs.lock().unwrap().clear();
        let path = lease.mount_path().join(name);
        assert_eq!(read_head(&path, 4096), layer.files[name][..4096], "{name}");
        // The file's data lies in one extent; its last partial block may be
        // an inline tail (metadata, already local).
        let (offset, len) = layer.extents[name][0];
        assert_eq!(layer.extents[name].len(), 1, "{name}: one extent");
        let data_pieces: BTreeSet<usize> =
            ((offset / PIECE) as usize..=((offset + len - 1) / PIECE) as usize).collect();
        let runs: Vec<(usize, usize)> = source.piece_runs.lock().unwrap().iter().map(|&(_, f, n)| (f, n)).collect();
        let chunks: BTreeSet<u64> = data_pieces.iter().map(|&p| p as u64 * PIECE / CHUNK).collect();
        assert!(!runs.is_empty() && runs.len() <= chunks.len(), "{name}: one request per chunk spanned: {runs:?}");
        let bitmap = bitmap_of(&fx, &layer);
        for p in &data_pieces {
            assert_eq!(bitmap[*p], 1, "{name}: piece {p} of the file is not present after its first read");
        }
        let fetched: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
        assert!(fetched.is_subset(&data_pieces), "{name}: fetched {fetched:?}, the file lies in {data_pieces:?}");

        // Every later read of the file is local: no request at all.
        source.piece_runs.lock().unwrap().clear();
        assert_eq!(read_in_steps(&path, layer.files[name].len()).unwrap(), layer.files[name], "{name}");
        assert_eq!(read(&path).unwrap(), layer.files[name], "{name}");
        assert!(source.pieces_fetched(&layer).is_empty(), "{name}: a later read fetched again");
    }
    let stats = cache.stats()[0].clone();
    assert_eq!(stats.whole_file_fills, 2, "{stats:?}");
    assert!(stats.whole_file_units > 0 && stats.failed_fills == 0, "{stats:?}");

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_above_the_bound_keeps_fetching_only_the_pieces_read() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("wholebig", small_and_large_files(42)));
    let source = TestSource::with(&[&layer]);
    let cache = whole_file_cache(&fx, source.clone()).await;
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let name = "lib/big.so";
    assert!(layer.files[name].len() as u64 > WHOLE_FILE_BOUND);
    let path = lease.mount_path().join(name);
    assert_eq!(read_head(&path, 4096), layer.files[name][..4096]);
    let fetched: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
    // The mount's 16 KiB window: at most the two pieces it can straddle.
    let window = layer.pieces_under_head(name, DEFAULT_READAHEAD_KB as u64 * 1024);
    assert!(!fetched.is_empty() && fetched.is_subset(&window), "fetched {fetched:?}, the window is {window:?}");
    let stats = cache.stats()[0].clone();
    assert_eq!((stats.whole_file_fills, stats.whole_file_units), (0, 0), "{stats:?}");
    // The rest of the file is still missing.
    let pieces = layer.pieces_of(name);
    let bitmap = bitmap_of(&fx, &layer);
    assert!(pieces.iter().filter(|p| bitmap[**p] == 0).count() > pieces.len() / 2, "the big file was fetched whole");

    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_piece_of_a_small_file_is_refused_and_only_its_reads_fail() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("wholebad", small_and_large_files(43)));
    let source = TestSource::with(&[&layer]);
    let cache = whole_file_cache(&fx, source.clone()).await;
    let lease = cache.acquire(&layer.manifest).await.unwrap();

    let name = "lib/mod3.py";
    let path = lease.mount_path().join(name);
    let pieces: Vec<usize> = layer.pieces_of(name).into_iter().collect();
    // Past the first read's window, all data.
    let bad = pieces[pieces.len() / 2];
    assert!(bad > pieces[1], "{pieces:?}");
    *source.corrupt_pieces.lock().unwrap() = HashSet::from([bad]);

    // The first page reads (its own pieces are good); the bad piece came
    // with the rest of the file but was refused and not written.
    assert_eq!(read_head(&path, 4096), layer.files[name][..4096]);
    assert!(source.pieces_fetched(&layer).contains(&bad), "the whole file was asked for");
    let (offset, len) = layer.manifest.fetch_unit_extent(bad).unwrap();
    assert!(is_hole(lease.file_path(), offset, len), "the corrupt piece's bytes reached the layer file");
    assert_eq!(bitmap_of(&fx, &layer)[bad], 0, "the corrupt piece is not marked present");
    assert_eq!(cache.stats()[0].failed_fills, 0, "the read did not need the bad piece");

    // A read that needs it fails with EIO, and keeps failing while the
    // source serves bad bytes.
    assert_eq!(read_errno(&path), Some(libc::EIO));
    assert_eq!(read_errno(&path), Some(libc::EIO));
    assert!(cache.stats()[0].failed_fills >= 1);
    assert!(is_hole(lease.file_path(), offset, len));

    // A small file whose first piece is bad fails its first read.
    let other = "lib/mod2.py";
    let first = *layer.pieces_of(other).first().unwrap();
    *source.corrupt_pieces.lock().unwrap() = HashSet::from([bad, first]);
    assert_eq!(read_errno(&lease.mount_path().join(other)), Some(libc::EIO));

    // Fixed at the source, both read whole.
    source.corrupt_pieces.lock().unwrap().clear();
    assert_eq!(read(&path).unwrap(), layer.files[name]);
    assert_eq!(read(&lease.mount_path().join(other)).unwrap(), layer.files[other]);
    drop(lease);
    cache.shutdown().await.unwrap();
}

/// Demand fills only (no stream prefetch, no whole files), traces on.
fn traced_config(fx: &Fixture) -> CacheConfig {
    let prefetch = PrefetchConfig { trace_requests: DEFAULT_TRACE_REQUESTS, ..PrefetchConfig::off() };
    CacheConfig { prefetch, ..fx.config(1 << 30) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_node_replays_the_access_trace_and_a_bad_piece_stays_missing() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("traced", layer_files(51, 12)));
    let source = TestSource::with(&[&layer]);
    let (read_a, read_b, unread) = ("data/file003", "data/file008", "data/file005");

    // The first node reads two files; releasing the layer stores its trace.
    let cache = LayerCache::open_with(traced_config(&fx), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    assert_eq!(cache.stats()[0].trace_units_replayed, 0, "no trace was stored yet");
    for name in [read_a, read_b] {
        assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name], "{name}");
    }
    let demanded: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
    drop(lease);
    eventually("the trace to be stored", || cache.stats()[0].traces_published == 1).await;
    assert!(source.traces.lock().unwrap().contains_key(&layer.manifest.digest));
    cache.shutdown().await.unwrap();

    // A new node: empty cache directory, same store. One piece under a
    // file the trace names is served corrupt.
    fs::remove_dir_all(fx.cache_dir()).unwrap();
    source.piece_runs.lock().unwrap().clear();
    let bad = *layer.pieces_of(read_a).iter().nth(3).unwrap();
    assert!(demanded.contains(&bad));
    *source.corrupt_pieces.lock().unwrap() = HashSet::from([bad]);
    let cache = LayerCache::open_with(traced_config(&fx), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    // The replay runs beside the layer's readers; this test reads after it.
    eventually("the replay to end", || cache.stats()[0].trace_replays_running == 0).await;

    // Before any read: what the first node's reads needed was fetched,
    // nothing of the unread file, in fewer requests than pieces.
    let replayed: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().collect();
    assert_eq!(replayed, demanded, "the replay fetched what the first node's reads fetched");
    assert!(replayed.is_disjoint(&layer.pieces_of(unread)));
    let requests = source.piece_runs.lock().unwrap().len();
    assert!(requests < replayed.len(), "neighbouring pieces share a request: {requests} for {}", replayed.len());
    let stats = cache.stats()[0].clone();
    assert_eq!(stats.trace_units_replayed as usize, replayed.len() - 1, "{stats:?}");
    assert_eq!(stats.failed_trace_units, 1, "{stats:?}");
    let (offset, len) = layer.manifest.fetch_unit_extent(bad).unwrap();
    assert!(is_hole(lease.file_path(), offset, len), "the corrupt piece's bytes reached the layer file");
    assert_eq!(bitmap_of(&fx, &layer)[bad], 0);

    // The traced files read with no request but the bad piece's, which
    // fails closed while the store serves it corrupt.
    source.piece_runs.lock().unwrap().clear();
    assert_eq!(read(&lease.mount_path().join(read_b)).unwrap(), layer.files[read_b]);
    assert!(source.pieces_fetched(&layer).is_empty(), "a traced file was fetched again");
    assert_eq!(read_errno(&lease.mount_path().join(read_a)), Some(libc::EIO));
    source.corrupt_pieces.lock().unwrap().clear();
    assert_eq!(read(&lease.mount_path().join(read_a)).unwrap(), layer.files[read_a]);
    assert!(source.pieces_fetched(&layer).iter().all(|&p| p == bad), "only the bad piece was fetched again");

    // Nothing new was read: releasing stores nothing.
    drop(lease);
    assert!(cache.stats()[0].traced_units as usize >= replayed.len());
    assert_eq!(cache.stats()[0].traces_published, 0);
    cache.shutdown().await.unwrap();
}

/// A node reads `names` from `layer` and stores its access trace; then its
/// cache directory goes, so the next cache opened is a node new to the
/// layer, and the store forgets the requests seen so far.
async fn a_node_reads_and_stores_its_trace(fx: &Fixture, source: &Arc<TestSource>, layer: &Built, names: &[&str]) {
    let cache = LayerCache::open_with(traced_config(fx), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    for &name in names {
        assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name], "{name}");
    }
    drop(lease);
    eventually("the trace to be stored", || cache.stats()[0].traces_published == 1).await;
    cache.shutdown().await.unwrap();
    fs::remove_dir_all(fx.cache_dir()).unwrap();
    source.piece_runs.lock().unwrap().clear();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_run_while_the_trace_replays_and_fetch_what_it_has_not_reached() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("overlap", layer_files(53, 12)));
    let source = TestSource::with(&[&layer]);
    let (read_a, read_b) = ("data/file003", "data/file008");
    a_node_reads_and_stores_its_trace(&fx, &source, &layer, &[read_a, read_b]).await;

    // A new node replaying one GET at a time; the store holds every request
    // that reaches outside `read_b`'s pieces, so the replay's first GET
    // waits until released.
    let b_pieces = layer.pieces_of(read_b);
    *source.demand_only.lock().unwrap() = Some(b_pieces.iter().copied().collect());
    let mut config = traced_config(&fx);
    config.prefetch.trace_requests = 1;
    let cache = LayerCache::open_with(config, source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    eventually("the replay's first GET", || source.held_now.load(Ordering::SeqCst) == 1).await;
    let held: Vec<(String, usize, usize)> = source.piece_runs.lock().unwrap().clone();
    assert_eq!(held.len(), 1, "one replay GET at a time: {held:?}");
    let (_, first, count) = held[0];
    assert!((first..first + count).all(|p| !b_pieces.contains(&p)), "the held GET is not read_b's: {held:?}");

    // The acquire did not wait for the replay, and a traced file the
    // replay has not reached reads now, through the ordinary miss path.
    assert_eq!(cache.stats()[0].trace_replays_running, 1);
    assert_eq!(read(&lease.mount_path().join(read_b)).unwrap(), layer.files[read_b]);
    let demand: BTreeSet<usize> = source.pieces_fetched(&layer).into_iter().filter(|p| b_pieces.contains(p)).collect();
    assert!(!demand.is_empty(), "read_b was fetched on demand");
    assert_eq!(cache.stats()[0].trace_replays_running, 1, "the replay is still held");

    // Released, the replay fetches the rest and skips what the read fetched.
    source.released.store(true, Ordering::SeqCst);
    eventually("the replay to end", || cache.stats()[0].trace_replays_running == 0).await;
    let stats = cache.stats()[0].clone();
    assert_eq!(stats.failed_trace_units, 0, "{stats:?}");
    let runs = source.piece_runs.lock().unwrap().clone();
    let fetched_twice = runs.iter().flat_map(|&(_, f, c)| f..f + c).filter(|p| demand.contains(p)).count();
    assert_eq!(fetched_twice, demand.len(), "no piece read_b fetched was fetched again by the replay: {runs:?}");
    source.piece_runs.lock().unwrap().clear();
    assert_eq!(read(&lease.mount_path().join(read_a)).unwrap(), layer.files[read_a]);
    assert!(source.pieces_fetched(&layer).is_empty(), "the replayed file was fetched again");
    drop(lease);
    cache.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_layer_during_its_replay_stops_the_replay() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("closing", layer_files(54, 8)));
    let source = TestSource::with(&[&layer]);
    a_node_reads_and_stores_its_trace(&fx, &source, &layer, &["data/file002"]).await;

    // Every replay GET is held; the cache shuts down under it.
    *source.demand_only.lock().unwrap() = Some(HashSet::new());
    let cache = LayerCache::open_with(traced_config(&fx), source.clone()).await.unwrap();
    let lease = cache.acquire(&layer.manifest).await.unwrap();
    eventually("the replay's GETs", || source.held_now.load(Ordering::SeqCst) >= 1).await;
    let stats = cache.stats()[0].clone();
    drop(lease);
    cache.shutdown().await.unwrap();
    assert_eq!(stats.trace_replays_running, 1, "{stats:?}");
    assert_eq!(stats.trace_units_replayed, 0, "{stats:?}");
    eventually("the held GETs to be dropped", || source.held_now.load(Ordering::SeqCst) == 0).await;
    source.released.store(true, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_for_other_pieces_or_a_garbled_one_is_ignored() {
    let fx = Fixture::new();
    let layer = with_pieces(build_layer("badtrace", layer_files(52, 4)));
    let source = TestSource::with(&[&layer]);
    let units = layer.manifest.pieces.len();
    for trace in [
        format!(r#"{{"version":1,"unit_size":{},"runs":[[0,4]]}}"#, PIECE * 2),
        format!(r#"{{"version":1,"unit_size":{PIECE},"runs":[[{units},1]]}}"#),
        "garbage".to_owned(),
    ] {
        source.traces.lock().unwrap().insert(layer.manifest.digest.clone(), Bytes::from(trace.clone()));
        let _ = fs::remove_dir_all(fx.cache_dir());
        let cache = LayerCache::open_with(traced_config(&fx), source.clone()).await.unwrap();
        let lease = cache.acquire(&layer.manifest).await.unwrap();
        assert!(source.pieces_fetched(&layer).is_empty(), "{trace}: the acquire fetched pieces");
        let name = "data/file001";
        assert_eq!(read(&lease.mount_path().join(name)).unwrap(), layer.files[name]);
        drop(lease);
        cache.shutdown().await.unwrap();
        source.piece_runs.lock().unwrap().clear();
    }
}

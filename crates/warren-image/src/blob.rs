//! The blob store: EROFS layers kept as content-addressed, fixed-size chunks
//! plus JSON manifests, over any `object_store` backend - a local path (also
//! how a mounted distributed filesystem such as 3FS, CephFS or NFS is used)
//! or an S3-compatible service.
//!
//! Keys: `chunks/sha256/<hex>`, `metadata/sha256/<hex>` (a layer's
//! metadata blob, see [`crate::metablob`]), `layers/<name>/<version>.json`,
//! `images/<name>/<tag>.json`.
//!
//! A layer manifest may also list a digest per fixed-size *piece* of the
//! file (default [`DEFAULT_PIECE_SIZE`], a divisor of the chunk size):
//! pieces are not objects of their own, a node fetches a run of them with
//! one ranged GET of the chunk object that holds them.
//!
//! Invariants: a chunk is never returned unless its sha256 and length match
//! the layer manifest, nor a run of pieces unless every piece's sha256 and
//! length match it, nor a metadata blob unless its sha256, length and
//! range table match it; an eagerly pulled layer appears at its destination
//! only after its whole-file digest matched; a layer manifest is written
//! only after all of its chunks and its metadata blob are stored, so a
//! manifest never names a missing object; layer manifests are immutable
//! (pushing another file under an existing `name@version` is refused; the
//! one exception adds a metadata blob or piece digests to a manifest
//! stored before they existed, for the same file). A chunk already present with the right
//! length is not rewritten (dedup across layers and images).
//!
//! Durability: `object_store`'s local backend publishes each object by
//! rename but does not fsync it, so a crash can leave a torn chunk. A push
//! rewrites a chunk whose length is wrong; one of the right length but wrong
//! content is refused by every fetch (an error, never data) until it is
//! pushed again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{BackoffConfig, ObjectStore, PutPayload, RetryConfig};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::erofs::{self, ErofsError};
use crate::error::ImageError;
use crate::fsutil::random_hex_id;
use crate::layer::{
    self, digest_hex, BlobEncoding, ImageManifest, LayerError, LayerManifest, LayerRole, MetadataBlobRef, StoredBlob,
};
use crate::metablob::{self, MetaBlobError};

/// Nydus's choice, and the middle of the 256 KiB - 4 MiB range block-level
/// lazy loaders use.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;
/// The unit a node fetches and verifies inside a chunk (see
/// `LayerManifest::piece_size`); chosen by the lazy-loading benchmark
/// (`docs/images.md`).
pub const DEFAULT_PIECE_SIZE: u64 = 16 << 10;
/// Chunks in flight per push or eager pull.
const TRANSFER_CONCURRENCY: usize = 8;

/// Why a blob-store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error("{context}: {source}")]
    Store {
        context: String,
        #[source]
        source: object_store::Error,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} not found in the blob store")]
    NotFound(String),
    #[error(transparent)]
    Manifest(#[from] LayerError),
    /// A manifest stored under one key names another layer or image.
    #[error("{key} holds the manifest of {found}")]
    Misfiled { key: String, found: String },
    #[error("layer {layer} has {count} chunks, chunk {index} asked for")]
    ChunkIndex { layer: String, index: usize, count: usize },
    /// The store returned bytes that are not the piece the manifest names.
    #[error("piece {index} of layer {layer} is corrupt: expected {expected}, got {actual}")]
    PieceCorrupt { layer: String, index: usize, expected: String, actual: String },
    /// A piece request the manifest cannot satisfy (no pieces, past the
    /// end, or a run that crosses a chunk).
    #[error("layer {layer}: pieces {first}..{end} are not a run inside one chunk of its {count} pieces")]
    PieceRange { layer: String, first: usize, end: usize, count: usize },
    /// The store returned bytes that are not the chunk the manifest names.
    #[error("chunk {index} of layer {layer} is corrupt: expected {expected}, got {actual}")]
    ChunkCorrupt { layer: String, index: usize, expected: String, actual: String },
    /// The store returned a metadata blob that is not the one the
    /// manifest names.
    #[error("metadata blob of layer {layer} is corrupt: {source}")]
    MetadataCorrupt {
        layer: String,
        #[source]
        source: MetaBlobError,
    },
    /// The layer manifest predates metadata blobs.
    #[error("layer {0} has no metadata blob")]
    NoMetadataBlob(String),
    #[error("layer {layer} reassembled to {actual}, expected {expected}")]
    LayerCorrupt { layer: String, expected: String, actual: String },
    #[error("layer {layer} already exists with digest {existing}; layers are immutable, push a new version")]
    LayerExists { layer: String, existing: String },
    #[error("chunk size {0} is not a power of two in 4 KiB..=64 MiB")]
    InvalidChunkSize(u64),
    #[error("piece size {0} is not a power of two in 4 KiB..=64 MiB")]
    InvalidPieceSize(u64),
    #[error("layer file: {0}")]
    Erofs(#[from] ErofsError),
    #[error("blob store configuration: {0}")]
    Config(String),
    #[error("background task failed: {0}")]
    Task(String),
    #[error(transparent)]
    Local(ImageError),
}

/// Where a layer's chunks come from: the seam between the node's lazy cache
/// and the store.
#[async_trait]
pub trait ChunkSource: Send + Sync {
    /// Chunk `index` of `layer`, verified against its digest.
    async fn fetch_chunk(&self, layer: &LayerManifest, index: usize) -> Result<Bytes, BlobError>;

    /// The layer's metadata blob, as its manifest `digest` names it (a
    /// compressed stored form already checked and inflated). The cache
    /// checks it against the manifest again before writing any of it; a
    /// source that has none says so.
    async fn fetch_metadata_blob(&self, layer: &LayerManifest) -> Result<Bytes, BlobError> {
        Err(BlobError::NoMetadataBlob(layer.id()))
    }

    /// Pieces `first..first + count` of `layer` (a run inside one chunk),
    /// each verified against its digest. A source without ranged reads
    /// fetches the whole chunk and cuts it.
    async fn fetch_pieces(&self, layer: &LayerManifest, first: usize, count: usize) -> Result<Vec<Bytes>, BlobError> {
        let (chunk, range) = piece_run_range(layer, first, count)?;
        let bytes = self.fetch_chunk(layer, chunk).await?;
        let (chunk_offset, _) = layer.chunk_extent(chunk).unwrap_or_default();
        let start = usize::try_from(range.start - chunk_offset).unwrap_or(usize::MAX);
        let end = usize::try_from(range.end - chunk_offset).unwrap_or(usize::MAX);
        let run = bytes.get(start..end).map(|_| bytes.slice(start..end)).ok_or_else(|| BlobError::ChunkCorrupt {
            layer: layer.id(),
            index: chunk,
            expected: format!("at least {end} bytes"),
            actual: format!("{} bytes", bytes.len()),
        })?;
        split_pieces(layer, first, count, run)
    }

    /// The access trace stored for `layer` (see `cache::trace`), `None`
    /// when there is none. A trace is only a hint of which fetch units to
    /// bring early: every unit it names is still verified against the
    /// manifest before use. A source without traces has none.
    async fn fetch_trace(&self, _layer: &LayerManifest) -> Result<Option<Bytes>, BlobError> {
        Ok(None)
    }

    /// Stores `trace` as `layer`'s access trace, replacing any earlier
    /// one. A source without traces drops it.
    async fn put_trace(&self, _layer: &LayerManifest, _trace: Bytes) -> Result<(), BlobError> {
        Ok(())
    }
}

/// The chunk holding pieces `first..first + count` and their byte range in
/// the layer file; an error unless they are a run inside one chunk.
pub fn piece_run_range(
    layer: &LayerManifest,
    first: usize,
    count: usize,
) -> Result<(usize, std::ops::Range<u64>), BlobError> {
    let bad = || BlobError::PieceRange {
        layer: layer.id(),
        first,
        end: first.saturating_add(count),
        count: layer.pieces.len(),
    };
    if layer.piece_size.is_none() || count == 0 {
        return Err(bad());
    }
    let (start, _) = layer.fetch_unit_extent(first).ok_or_else(bad)?;
    let (last, last_len) = layer.fetch_unit_extent(first + count - 1).ok_or_else(bad)?;
    let end = last + last_len;
    let chunk = usize::try_from(start / layer.chunk_size).map_err(|_| bad())?;
    if (end - 1) / layer.chunk_size != start / layer.chunk_size {
        return Err(bad());
    }
    Ok((chunk, start..end))
}

/// Cuts the bytes of pieces `first..first + count` into pieces, refusing
/// the lot if any piece's length or digest is not the manifest's.
pub fn split_pieces(layer: &LayerManifest, first: usize, count: usize, run: Bytes) -> Result<Vec<Bytes>, BlobError> {
    let mut pieces = Vec::with_capacity(count);
    let mut at = 0usize;
    for index in first..first + count {
        let (Some(digest), Some((_, len))) = (layer.pieces.get(index), layer.fetch_unit_extent(index)) else {
            return Err(BlobError::PieceRange {
                layer: layer.id(),
                first,
                end: first + count,
                count: layer.pieces.len(),
            });
        };
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let piece = run.get(at..at.saturating_add(len)).map(|_| run.slice(at..at + len));
        let actual = piece.as_deref().map(sha256_digest);
        match (piece, actual) {
            (Some(piece), Some(actual)) if actual == *digest => pieces.push(piece),
            (_, actual) => {
                return Err(BlobError::PieceCorrupt {
                    layer: layer.id(),
                    index,
                    expected: format!("{digest} ({len} bytes)"),
                    actual: actual.unwrap_or_else(|| format!("{} bytes", run.len().saturating_sub(at))),
                })
            }
        }
        at += len;
    }
    if at != run.len() {
        return Err(BlobError::PieceCorrupt {
            layer: layer.id(),
            index: first + count - 1,
            expected: format!("{at} bytes in the run"),
            actual: format!("{} bytes", run.len()),
        });
    }
    Ok(pieces)
}

/// An S3-compatible endpoint, addressed path-style. `Debug` leaves the
/// secret key out.
#[derive(Clone)]
pub struct S3Config {
    /// e.g. `http://127.0.0.1:9000`.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub allow_http: bool,
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("bucket", &self.bucket)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"<redacted>")
            .field("allow_http", &self.allow_http)
            .finish()
    }
}

/// What a layer is, apart from its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMeta {
    pub name: String,
    pub version: String,
    pub role: LayerRole,
}

/// What [`BlobStore::collect_garbage`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub layers_removed: u64,
    pub chunks_removed: u64,
    /// Bytes of the deleted objects (manifests and chunks).
    pub bytes_freed: u64,
    /// File digests of the layers images still use.
    pub kept_layer_digests: std::collections::HashSet<String>,
}

/// Counters since the store was opened (shared by its clones).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlobStats {
    /// Verified chunks handed out by `fetch_chunk` (and eager pulls).
    pub chunks_fetched: u64,
    pub bytes_fetched: u64,
    /// Fetched chunks (or piece runs) refused for a wrong digest or length.
    pub chunks_rejected: u64,
    /// Verified pieces handed out by `fetch_pieces`.
    pub pieces_fetched: u64,
    /// Ranged GETs `fetch_pieces` made (one per run of neighbouring pieces).
    pub range_requests: u64,
    pub chunks_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Chunks a push found already stored and did not send.
    pub chunks_deduplicated: u64,
}

#[derive(Debug, Default)]
struct Counters {
    chunks_fetched: AtomicU64,
    bytes_fetched: AtomicU64,
    chunks_rejected: AtomicU64,
    pieces_fetched: AtomicU64,
    range_requests: AtomicU64,
    chunks_uploaded: AtomicU64,
    bytes_uploaded: AtomicU64,
    chunks_deduplicated: AtomicU64,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

/// Layers and images in one object store. Cheap to clone.
#[derive(Clone)]
pub struct BlobStore {
    store: Arc<dyn ObjectStore>,
    chunk_size: u64,
    piece_size: Option<u64>,
    counters: Arc<Counters>,
    /// Layer manifests already read, by name, version and digest: a stored
    /// layer is never rewritten (a new push is a new version), so a create
    /// from a known image reads only the image's manifest (its tag can move).
    known_layers: Arc<std::sync::Mutex<std::collections::HashMap<LayerKey, LayerManifest>>>,
}

/// A stored layer's name, version and digest.
type LayerKey = (String, String, String);

/// How many layer manifests [`BlobStore`] keeps (a 1 GB layer's is about
/// 100 KB with 1 MiB chunks).
const KNOWN_LAYERS: usize = 256;

impl std::fmt::Debug for BlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobStore")
            .field("store", &self.store.to_string())
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

impl BlobStore {
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self {
            store,
            chunk_size: DEFAULT_CHUNK_SIZE,
            piece_size: Some(DEFAULT_PIECE_SIZE),
            counters: Arc::default(),
            known_layers: Arc::default(),
        }
    }

    /// A store under the local directory `root` (created if missing).
    pub fn local(root: &Path) -> Result<Self, BlobError> {
        std::fs::create_dir_all(root)
            .map_err(|source| BlobError::Io { context: format!("creating {}", root.display()), source })?;
        let store = LocalFileSystem::new_with_prefix(root)
            .map_err(|source| BlobError::Store { context: format!("opening {}", root.display()), source })?;
        Ok(Self::new(Arc::new(store)))
    }

    /// A store in an S3-compatible bucket (which must exist).
    pub fn s3(config: &S3Config) -> Result<Self, BlobError> {
        // object_store's default retries for three minutes; a node should
        // learn sooner that its store is gone.
        let retry =
            RetryConfig { backoff: BackoffConfig::default(), max_retries: 3, retry_timeout: Duration::from_secs(30) };
        let store = AmazonS3Builder::new()
            .with_endpoint(&config.endpoint)
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_allow_http(config.allow_http)
            .with_virtual_hosted_style_request(false)
            .with_retry(retry)
            .build()
            .map_err(|e| BlobError::Config(e.to_string()))?;
        Ok(Self::new(Arc::new(store)))
    }

    /// Sets the chunk size for layers pushed from now on (layers already
    /// stored keep theirs).
    pub fn with_chunk_size(mut self, bytes: u64) -> Result<Self, BlobError> {
        if !layer::is_valid_chunk_size(bytes) {
            return Err(BlobError::InvalidChunkSize(bytes));
        }
        self.chunk_size = bytes;
        Ok(self)
    }

    pub fn chunk_size(&self) -> u64 {
        self.chunk_size
    }

    /// Sets the piece size for layers pushed from now on; `None` stores no
    /// piece digests (nodes then fetch whole chunks). A piece size not
    /// smaller than the chunk size means no pieces either.
    pub fn with_piece_size(mut self, bytes: Option<u64>) -> Result<Self, BlobError> {
        if let Some(bytes) = bytes {
            if !layer::is_valid_piece_size(bytes, layer::MAX_CHUNK_SIZE) {
                return Err(BlobError::InvalidPieceSize(bytes));
            }
        }
        self.piece_size = bytes;
        Ok(self)
    }

    /// The piece size layers pushed now get, if any.
    pub fn piece_size(&self) -> Option<u64> {
        self.piece_size.filter(|&p| p < self.chunk_size)
    }

    pub fn stats(&self) -> BlobStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        BlobStats {
            chunks_fetched: get(&c.chunks_fetched),
            bytes_fetched: get(&c.bytes_fetched),
            chunks_rejected: get(&c.chunks_rejected),
            pieces_fetched: get(&c.pieces_fetched),
            range_requests: get(&c.range_requests),
            chunks_uploaded: get(&c.chunks_uploaded),
            bytes_uploaded: get(&c.bytes_uploaded),
            chunks_deduplicated: get(&c.chunks_deduplicated),
        }
    }

    /// Stores the EROFS file `erofs_file` as layer `meta.name@meta.version`:
    /// chunks first (those already present are skipped), the manifest last.
    /// Pushing the same file again is a no-op; pushing a different one under
    /// the same name and version is refused.
    pub async fn push_layer(&self, erofs_file: &Path, meta: &LayerMeta) -> Result<LayerManifest, BlobError> {
        let path = erofs_file.to_owned();
        let chunk_size = self.chunk_size;
        let piece_size = self.piece_size();
        let plan = tokio::task::spawn_blocking(move || plan_layer(&path, chunk_size, piece_size))
            .await
            .map_err(|e| BlobError::Task(e.to_string()))??;
        let manifest = LayerManifest {
            name: meta.name.clone(),
            version: meta.version.clone(),
            role: meta.role,
            digest: plan.digest,
            size: plan.size,
            chunk_size,
            chunks: plan.chunks,
            metadata_ranges: plan.metadata_ranges,
            metadata_blob: Some(MetadataBlobRef {
                digest: metablob::digest(&plan.metadata_blob),
                size: plan.metadata_blob.len() as u64,
                stored: Some(StoredBlob {
                    encoding: BlobEncoding::Zlib,
                    digest: metablob::digest(&plan.metadata_stored),
                    size: plan.metadata_stored.len() as u64,
                }),
            }),
            piece_size,
            pieces: plan.pieces,
        };
        manifest.validate()?;
        match self.existing_layer(&manifest).await? {
            Existing::Same(existing) => return Ok(*existing),
            // Re-pushing a layer stored before metadata blobs or piece
            // digests existed adds what it lacks: the bytes they describe
            // are the ones the digest names, and no chunk moves.
            Existing::Upgrade => {}
            Existing::None => self.upload_chunks(erofs_file, &manifest).await?,
        }
        self.upload_metadata_blob(&manifest, plan.metadata_stored).await?;
        self.put_layer_manifest(&manifest).await?;
        Ok(manifest)
    }

    /// What the store holds under `manifest`'s name and version; an error
    /// if another layer holds them.
    async fn existing_layer(&self, manifest: &LayerManifest) -> Result<Existing, BlobError> {
        match self.get_layer_manifest(&manifest.name, &manifest.version).await {
            Ok(existing) if existing == *manifest => Ok(Existing::Same(Box::new(existing))),
            Ok(existing) if core(&existing) == core(manifest) => {
                let lacks_blob = existing.metadata_blob.is_none() && manifest.metadata_blob.is_some();
                let lacks_pieces = existing.piece_size.is_none() && manifest.piece_size.is_some();
                if lacks_blob || lacks_pieces {
                    Ok(Existing::Upgrade)
                } else {
                    // Same layer, other piece size: the stored one serves.
                    Ok(Existing::Same(Box::new(existing)))
                }
            }
            Ok(existing) => Err(BlobError::LayerExists { layer: manifest.id(), existing: existing.digest }),
            Err(BlobError::NotFound(_)) => Ok(Existing::None),
            Err(e) => Err(e),
        }
    }

    /// Stores the blob's stored form (`stored`: compressed when the
    /// manifest says so) under its digest.
    async fn upload_metadata_blob(&self, manifest: &LayerManifest, stored: Bytes) -> Result<(), BlobError> {
        let Some(r) = &manifest.metadata_blob else { return Ok(()) };
        let key = metadata_key(r.key_digest())?;
        match self.store.head(&key).await {
            Ok(meta) if meta.size == r.stored_size() => return Ok(()),
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => return Err(BlobError::Store { context: format!("looking up {}", r.digest), source }),
        }
        self.store
            .put(&key, PutPayload::from_bytes(stored))
            .await
            .map_err(|source| BlobError::Store { context: format!("storing metadata blob {}", r.digest), source })?;
        Counters::add(&self.counters.bytes_uploaded, r.stored_size());
        Ok(())
    }

    /// The metadata blob of `layer`, checked against the manifest's digest,
    /// length and metadata map; when it is stored compressed, the stored
    /// bytes are checked against their own digest and size before they are
    /// inflated (to at most the blob's size).
    pub async fn fetch_metadata_blob(&self, layer: &LayerManifest) -> Result<Bytes, BlobError> {
        let r = layer.metadata_blob.as_ref().ok_or_else(|| BlobError::NoMetadataBlob(layer.id()))?;
        let key = metadata_key(r.key_digest())?;
        let fetched = self.get_bytes(&key, || format!("metadata blob of {}", layer.id())).await?;
        let checked = match &r.stored {
            None => Ok(fetched),
            Some(stored) => {
                let (stored, size) = (stored.clone(), r.size);
                tokio::task::spawn_blocking(move || {
                    metablob::decompress(&fetched, &stored.digest, stored.size, size).map(Bytes::from)
                })
                .await
                .map_err(|e| BlobError::Task(e.to_string()))?
            }
        }
        .and_then(|bytes| metablob::decode(&bytes, &r.digest, &layer.metadata_pages()).map(|_| ()).and(Ok(bytes)));
        let bytes = checked.map_err(|source| {
            Counters::add(&self.counters.chunks_rejected, 1);
            BlobError::MetadataCorrupt { layer: layer.id(), source }
        })?;
        Counters::add(&self.counters.bytes_fetched, r.stored_size());
        Ok(bytes)
    }

    async fn upload_chunks(&self, file: &Path, manifest: &LayerManifest) -> Result<(), BlobError> {
        let file = Arc::new(
            File::open(file)
                .map_err(|source| BlobError::Io { context: format!("opening {}", file.display()), source })?,
        );
        // The first occurrence of each distinct chunk; a layer repeats chunks
        // (zero runs) more often than one might think.
        let mut seen = std::collections::HashSet::new();
        let unique: Vec<usize> = (0..manifest.chunks.len()).filter(|&i| seen.insert(&manifest.chunks[i])).collect();
        stream::iter(unique)
            .map(|index| self.upload_chunk(Arc::clone(&file), manifest, index))
            .buffer_unordered(TRANSFER_CONCURRENCY)
            .try_collect::<()>()
            .await
    }

    async fn upload_chunk(&self, file: Arc<File>, manifest: &LayerManifest, index: usize) -> Result<(), BlobError> {
        let digest = &manifest.chunks[index];
        let (offset, len) = manifest.chunk_extent(index).ok_or_else(|| BlobError::ChunkIndex {
            layer: manifest.id(),
            index,
            count: manifest.chunks.len(),
        })?;
        let key = chunk_key(digest)?;
        // A chunk of the wrong length (a torn write on a store without
        // atomic puts) is written again; one of the right length but wrong
        // content is caught by every fetch.
        match self.store.head(&key).await {
            Ok(meta) if meta.size == len => {
                Counters::add(&self.counters.chunks_deduplicated, 1);
                return Ok(());
            }
            Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => return Err(BlobError::Store { context: format!("looking up chunk {digest}"), source }),
        }
        let bytes = read_chunk(file, offset, len).await?;
        let actual = sha256_digest(&bytes);
        if actual != *digest {
            return Err(BlobError::Io {
                context: format!("chunk {index} of {}", manifest.id()),
                source: std::io::Error::other(format!("the file changed while it was pushed ({actual} != {digest})")),
            });
        }
        self.store
            .put(&key, PutPayload::from_bytes(bytes))
            .await
            .map_err(|source| BlobError::Store { context: format!("storing chunk {digest}"), source })?;
        Counters::add(&self.counters.chunks_uploaded, 1);
        Counters::add(&self.counters.bytes_uploaded, len);
        Ok(())
    }

    /// Chunk `index` of `layer`, checked against its digest and length.
    pub async fn fetch_chunk(&self, layer: &LayerManifest, index: usize) -> Result<Bytes, BlobError> {
        let (Some(digest), Some((_, len))) = (layer.chunks.get(index), layer.chunk_extent(index)) else {
            return Err(BlobError::ChunkIndex { layer: layer.id(), index, count: layer.chunks.len() });
        };
        let key = chunk_key(digest)?;
        let bytes = self.get_bytes(&key, || format!("chunk {index} of {}", layer.id())).await?;
        let actual = sha256_digest(&bytes);
        if actual != *digest || bytes.len() as u64 != len {
            Counters::add(&self.counters.chunks_rejected, 1);
            return Err(BlobError::ChunkCorrupt {
                layer: layer.id(),
                index,
                expected: format!("{digest} ({len} bytes)"),
                actual: format!("{actual} ({} bytes)", bytes.len()),
            });
        }
        Counters::add(&self.counters.chunks_fetched, 1);
        Counters::add(&self.counters.bytes_fetched, len);
        Ok(bytes)
    }

    /// Pieces `first..first + count` of `layer`, a run inside one chunk, in
    /// one ranged GET of that chunk; each piece checked against its digest
    /// before any is returned.
    pub async fn fetch_pieces(
        &self,
        layer: &LayerManifest,
        first: usize,
        count: usize,
    ) -> Result<Vec<Bytes>, BlobError> {
        let (chunk, range) = piece_run_range(layer, first, count)?;
        let (Some(digest), Some((chunk_offset, _))) = (layer.chunks.get(chunk), layer.chunk_extent(chunk)) else {
            return Err(BlobError::ChunkIndex { layer: layer.id(), index: chunk, count: layer.chunks.len() });
        };
        let key = chunk_key(digest)?;
        let what = || format!("pieces {first}..{} of {}", first + count, layer.id());
        let within = range.start - chunk_offset..range.end - chunk_offset;
        let bytes = match self.store.get_range(&key, within).await {
            Ok(bytes) => bytes,
            Err(object_store::Error::NotFound { .. }) => return Err(BlobError::NotFound(what())),
            Err(source) => return Err(BlobError::Store { context: format!("reading {}", what()), source }),
        };
        let pieces = split_pieces(layer, first, count, bytes).inspect_err(|_| {
            Counters::add(&self.counters.chunks_rejected, 1);
        })?;
        Counters::add(&self.counters.pieces_fetched, u64::try_from(count).unwrap_or(u64::MAX));
        Counters::add(&self.counters.bytes_fetched, range.end - range.start);
        Counters::add(&self.counters.range_requests, 1);
        Ok(pieces)
    }

    /// Fetches the whole layer to `dest` (the eager baseline). `dest` appears
    /// only once the reassembled file matched the layer digest.
    pub async fn pull_layer_eager(&self, layer: &LayerManifest, dest: &Path) -> Result<(), BlobError> {
        layer.validate()?;
        let partial = PartialFile::new(dest)?;
        let mut file = tokio::fs::File::create(partial.path())
            .await
            .map_err(|source| BlobError::Io { context: format!("creating {}", partial.path().display()), source })?;
        let mut hasher = Sha256::new();
        let mut chunks = stream::iter(0..layer.chunks.len())
            .map(|index| self.fetch_chunk(layer, index))
            .buffered(TRANSFER_CONCURRENCY);
        let write_err = |source| BlobError::Io { context: format!("writing {}", partial.path().display()), source };
        while let Some(chunk) = chunks.try_next().await? {
            hasher.update(&chunk);
            file.write_all(&chunk).await.map_err(write_err)?;
        }
        file.sync_all().await.map_err(write_err)?;
        drop(file);
        let actual = format!("sha256:{}", erofs::hex(&hasher.finalize()));
        if actual != layer.digest {
            return Err(BlobError::LayerCorrupt { layer: layer.id(), expected: layer.digest.clone(), actual });
        }
        partial.publish(dest)
    }

    /// Stores a layer manifest (after validating it). Prefer `push_layer`,
    /// which also stores the chunks.
    pub async fn put_layer_manifest(&self, manifest: &LayerManifest) -> Result<(), BlobError> {
        manifest.validate()?;
        let key = layer_key(&manifest.name, &manifest.version);
        self.put_json(&key, manifest.to_json()?).await
    }

    /// The manifest of `name@version`, validated.
    pub async fn get_layer_manifest(&self, name: &str, version: &str) -> Result<LayerManifest, BlobError> {
        let key = layer_key(name, version);
        let bytes = self.get_bytes(&key, || format!("layer {name}@{version}")).await?;
        let manifest = LayerManifest::from_json(&bytes)?;
        if manifest.name != name || manifest.version != version {
            return Err(BlobError::Misfiled { key: key.to_string(), found: manifest.id() });
        }
        Ok(manifest)
    }

    pub async fn put_image_manifest(&self, manifest: &ImageManifest) -> Result<(), BlobError> {
        manifest.validate()?;
        let key = image_key(&manifest.name, &manifest.tag);
        self.put_json(&key, manifest.to_json()?).await
    }

    pub async fn get_image_manifest(&self, name: &str, tag: &str) -> Result<ImageManifest, BlobError> {
        let key = image_key(name, tag);
        let bytes = self.get_bytes(&key, || format!("image {name}:{tag}")).await?;
        let manifest = ImageManifest::from_json(&bytes)?;
        if manifest.name != name || manifest.tag != tag {
            return Err(BlobError::Misfiled { key: key.to_string(), found: manifest.id() });
        }
        Ok(manifest)
    }

    /// The layer manifests of `image`, bottom first, each checked to carry
    /// the digest the image names. Read from the store once per layer
    /// version; later calls find them in memory.
    pub async fn image_layers(&self, image: &ImageManifest) -> Result<Vec<LayerManifest>, BlobError> {
        // Fetched side by side: a cold node's create waits for them all.
        let layers = image.layers.iter().enumerate().map(|(index, r)| async move {
            let key = (r.name.clone(), r.version.clone(), r.digest.clone());
            let known = self.known_layers.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&key).cloned();
            if let Some(layer) = known {
                return Ok(layer);
            }
            let layer = self.get_layer_manifest(&r.name, &r.version).await?;
            image.check_layer(index, &layer)?;
            let mut known = self.known_layers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if known.len() >= KNOWN_LAYERS {
                known.clear();
            }
            known.insert(key, layer.clone());
            Ok(layer)
        });
        futures_util::future::try_join_all(layers).await
    }

    /// Makes (or moves) the tag `name:tag` to the stored layers
    /// `(name, version)`, bottom first. Writes one small manifest; no chunk
    /// is read or copied.
    pub async fn compose_image(
        &self,
        name: &str,
        tag: &str,
        layers: &[(&str, &str)],
    ) -> Result<ImageManifest, BlobError> {
        self.compose_image_with_config(name, tag, layers, layer::ImageConfig::default()).await
    }

    /// [`BlobStore::compose_image`] with the image config the image carries.
    pub async fn compose_image_with_config(
        &self,
        name: &str,
        tag: &str,
        layers: &[(&str, &str)],
        config: layer::ImageConfig,
    ) -> Result<ImageManifest, BlobError> {
        let mut manifests = Vec::with_capacity(layers.len());
        for (layer_name, version) in layers {
            manifests.push(self.get_layer_manifest(layer_name, version).await?);
        }
        let image = layer::compose_with_config(name, tag, &manifests, config)?;
        self.put_image_manifest(&image).await?;
        Ok(image)
    }

    /// Every image manifest in the store, by name then tag.
    pub async fn list_images(&self) -> Result<Vec<ImageManifest>, BlobError> {
        let mut images = Vec::new();
        for meta in self.list_keys("images").await? {
            let key = meta.location;
            let bytes = self.get_bytes(&key, || key.to_string()).await?;
            match ImageManifest::from_json(&bytes) {
                Ok(image) if image_key(&image.name, &image.tag) == key => images.push(image),
                Ok(image) => tracing::warn!(%key, found = %image.id(), "skipping a misfiled image manifest"),
                Err(e) => tracing::warn!(%key, error = %e, "skipping an unreadable image manifest"),
            }
        }
        images.sort_by(|a, b| (&a.name, &a.tag).cmp(&(&b.name, &b.tag)));
        Ok(images)
    }

    /// Removes the tag `name:tag`. Its layers and chunks stay until
    /// [`BlobStore::collect_garbage`].
    pub async fn delete_image(&self, name: &str, tag: &str) -> Result<(), BlobError> {
        self.get_image_manifest(name, tag).await?;
        let key = image_key(name, tag);
        self.store.delete(&key).await.map_err(|source| BlobError::Store { context: format!("deleting {key}"), source })
    }

    /// Deletes every layer manifest no image names (unless its digest is in
    /// `keep_digests`: layers still in use) and every chunk no remaining
    /// layer lists. A referenced layer whose manifest cannot be
    /// read stops the collection before anything is deleted, since its
    /// chunks are unknown. Not safe while another writer pushes to the same
    /// store (a push stores chunks before its manifest): the node runs it
    /// under its import lock.
    pub async fn collect_garbage(
        &self,
        keep_digests: &std::collections::HashSet<String>,
    ) -> Result<GcReport, BlobError> {
        let images = self.list_images().await?;
        let named: std::collections::HashSet<(String, String)> =
            images.iter().flat_map(|i| i.layers.iter().map(|l| (l.name.clone(), l.version.clone()))).collect();
        let mut kept_chunks = std::collections::HashSet::new();
        let mut kept_metadata = std::collections::HashSet::new();
        let mut kept_layers = std::collections::HashSet::new();
        let mut doomed_layers = Vec::new();
        for meta in self.list_keys("layers").await? {
            let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
            let id = match parts.as_slice() {
                [_, name, file] => file.strip_suffix(".json").map(|version| (name.clone(), version.to_owned())),
                _ => None,
            };
            let Some((name, version)) = id else {
                doomed_layers.push(meta);
                continue;
            };
            let layer = if named.contains(&(name.clone(), version.clone())) {
                Some(self.get_layer_manifest(&name, &version).await?)
            } else if keep_digests.is_empty() {
                None
            } else {
                // Unreadable and unnamed: nothing can use it.
                self.get_layer_manifest(&name, &version).await.ok().filter(|l| keep_digests.contains(&l.digest))
            };
            match layer {
                Some(layer) => {
                    kept_chunks.extend(layer.chunks.iter().cloned());
                    kept_metadata.extend(layer.metadata_blob.map(|b| b.key_digest().to_owned()));
                    kept_layers.insert(layer.digest);
                }
                None => doomed_layers.push(meta),
            }
        }
        let mut report = GcReport { kept_layer_digests: kept_layers, ..GcReport::default() };
        for meta in doomed_layers {
            self.delete_key(&meta.location).await?;
            report.layers_removed += 1;
            report.bytes_freed += meta.size;
        }
        for meta in self.list_keys("chunks/sha256").await? {
            let digest = meta.location.filename().map(|hex| format!("sha256:{hex}"));
            if digest.is_some_and(|d| kept_chunks.contains(&d)) {
                continue;
            }
            self.delete_key(&meta.location).await?;
            report.chunks_removed += 1;
            report.bytes_freed += meta.size;
        }
        for meta in self.list_keys("metadata/sha256").await? {
            let digest = meta.location.filename().map(|hex| format!("sha256:{hex}"));
            if digest.is_some_and(|d| kept_metadata.contains(&d)) {
                continue;
            }
            self.delete_key(&meta.location).await?;
            report.bytes_freed += meta.size;
        }
        // Access traces go with the last layer of their digest.
        for meta in self.list_keys("traces/sha256").await? {
            let digest =
                meta.location.filename().and_then(|f| f.strip_suffix(".json")).map(|hex| format!("sha256:{hex}"));
            if digest.is_some_and(|d| report.kept_layer_digests.contains(&d)) {
                continue;
            }
            self.delete_key(&meta.location).await?;
            report.bytes_freed += meta.size;
        }
        Ok(report)
    }

    async fn list_keys(&self, prefix: &str) -> Result<Vec<object_store::ObjectMeta>, BlobError> {
        let prefix = StorePath::from(prefix);
        self.store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|source| BlobError::Store { context: format!("listing {prefix}"), source })
    }

    async fn delete_key(&self, key: &StorePath) -> Result<(), BlobError> {
        match self.store.delete(key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(BlobError::Store { context: format!("deleting {key}"), source }),
        }
    }

    async fn put_json(&self, key: &StorePath, json: Vec<u8>) -> Result<(), BlobError> {
        self.store
            .put(key, PutPayload::from(json))
            .await
            .map(|_| ())
            .map_err(|source| BlobError::Store { context: format!("storing {key}"), source })
    }

    async fn get_bytes(&self, key: &StorePath, what: impl Fn() -> String) -> Result<Bytes, BlobError> {
        let result = match self.store.get(key).await {
            Ok(result) => result,
            Err(object_store::Error::NotFound { .. }) => return Err(BlobError::NotFound(what())),
            Err(source) => return Err(BlobError::Store { context: format!("reading {}", what()), source }),
        };
        result.bytes().await.map_err(|source| BlobError::Store { context: format!("reading {}", what()), source })
    }
}

#[async_trait]
impl ChunkSource for BlobStore {
    async fn fetch_chunk(&self, layer: &LayerManifest, index: usize) -> Result<Bytes, BlobError> {
        BlobStore::fetch_chunk(self, layer, index).await
    }

    async fn fetch_metadata_blob(&self, layer: &LayerManifest) -> Result<Bytes, BlobError> {
        BlobStore::fetch_metadata_blob(self, layer).await
    }

    async fn fetch_pieces(&self, layer: &LayerManifest, first: usize, count: usize) -> Result<Vec<Bytes>, BlobError> {
        BlobStore::fetch_pieces(self, layer, first, count).await
    }

    async fn fetch_trace(&self, layer: &LayerManifest) -> Result<Option<Bytes>, BlobError> {
        let key = trace_key(&layer.digest)?;
        match self.get_bytes(&key, || format!("access trace of {}", layer.id())).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(BlobError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn put_trace(&self, layer: &LayerManifest, trace: Bytes) -> Result<(), BlobError> {
        let key = trace_key(&layer.digest)?;
        self.store.put(&key, PutPayload::from_bytes(trace)).await.map(|_| ()).map_err(|source| BlobError::Store {
            context: format!("storing the access trace of {}", layer.id()),
            source,
        })
    }
}

/// What a push found already stored under its name and version.
enum Existing {
    None,
    /// Boxed: a manifest is large next to the other variants.
    Same(Box<LayerManifest>),
    /// The same layer, stored before metadata blobs or piece digests existed.
    Upgrade,
}

/// A manifest without what later formats added (metadata blob, pieces):
/// what must match for two manifests to describe the same stored layer.
fn core(manifest: &LayerManifest) -> LayerManifest {
    LayerManifest { metadata_blob: None, piece_size: None, pieces: Vec::new(), ..manifest.clone() }
}

/// What a push learns from one pass over the layer file.
struct LayerPlan {
    digest: String,
    size: u64,
    chunks: Vec<String>,
    metadata_ranges: Vec<(u64, u64)>,
    metadata_blob: Bytes,
    /// What the store keeps of it (compressed).
    metadata_stored: Bytes,
    pieces: Vec<String>,
}

/// Hashes the file whole and chunk by chunk in one pass, and maps its
/// metadata (which also proves it is an EROFS image this crate can serve).
fn plan_layer(path: &Path, chunk_size: u64, piece_size: Option<u64>) -> Result<LayerPlan, BlobError> {
    let metadata_ranges = erofs::metadata_ranges(path)?;
    let io_err = |source| BlobError::Io { context: format!("reading {}", path.display()), source };
    let file = File::open(path).map_err(io_err)?;
    let mut whole = Sha256::new();
    let mut chunks = Vec::new();
    let mut pieces = Vec::new();
    let piece_len = match piece_size {
        Some(p) => usize::try_from(p).map_err(|_| BlobError::InvalidPieceSize(p))?,
        None => 0,
    };
    let mut buf = vec![0u8; usize::try_from(chunk_size).map_err(|_| BlobError::InvalidChunkSize(chunk_size))?];
    let mut offset = 0u64;
    loop {
        let n = read_full_at(&file, &mut buf, offset).map_err(io_err)?;
        if n == 0 {
            break;
        }
        whole.update(&buf[..n]);
        chunks.push(sha256_digest(&buf[..n]));
        if piece_len > 0 {
            pieces.extend(buf[..n].chunks(piece_len).map(sha256_digest));
        }
        offset += n as u64;
    }
    let digest = format!("sha256:{}", erofs::hex(&whole.finalize()));
    let pages = metablob::pages(&metadata_ranges, offset);
    let metadata_blob = metablob::encode(&file, &pages).map_err(io_err)?;
    let metadata_stored = metablob::compress(&metadata_blob)
        .map_err(|source| BlobError::Io { context: "compressing the metadata blob".into(), source })?;
    Ok(LayerPlan {
        digest,
        size: offset,
        chunks,
        metadata_ranges,
        metadata_blob: Bytes::from(metadata_blob),
        metadata_stored: Bytes::from(metadata_stored),
        pieces,
    })
}

/// Fills `buf` from `offset` unless the file ends first; returns the count.
fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

async fn read_chunk(file: Arc<File>, offset: u64, len: u64) -> Result<Bytes, BlobError> {
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; usize::try_from(len).map_err(|_| BlobError::InvalidChunkSize(len))?];
        let n = read_full_at(&file, &mut buf, offset)
            .map_err(|source| BlobError::Io { context: format!("reading {len} bytes at {offset}"), source })?;
        buf.truncate(n);
        Ok(Bytes::from(buf))
    })
    .await
    .map_err(|e| BlobError::Task(e.to_string()))?
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", erofs::hex(&Sha256::digest(bytes)))
}

fn chunk_key(digest: &str) -> Result<StorePath, BlobError> {
    Ok(StorePath::from(format!("chunks/sha256/{}", digest_hex(digest)?)))
}

fn metadata_key(digest: &str) -> Result<StorePath, BlobError> {
    Ok(StorePath::from(format!("metadata/sha256/{}", digest_hex(digest)?)))
}

/// By layer digest: every version that names the same bytes shares it.
fn trace_key(digest: &str) -> Result<StorePath, BlobError> {
    Ok(StorePath::from(format!("traces/sha256/{}.json", digest_hex(digest)?)))
}

fn layer_key(name: &str, version: &str) -> StorePath {
    StorePath::from(format!("layers/{name}/{version}.json"))
}

fn image_key(name: &str, tag: &str) -> StorePath {
    StorePath::from(format!("images/{name}/{tag}.json"))
}

/// A file being written next to its destination, removed when dropped
/// unless published.
struct PartialFile {
    path: PathBuf,
    armed: bool,
}

impl PartialFile {
    fn new(dest: &Path) -> Result<Self, BlobError> {
        let id = random_hex_id().map_err(BlobError::Local)?;
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Ok(Self { path: dir.join(format!(".{name}.partial-{id}")), armed: true })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn publish(mut self, dest: &Path) -> Result<(), BlobError> {
        std::fs::rename(&self.path, dest)
            .map_err(|source| BlobError::Io { context: format!("publishing {}", dest.display()), source })?;
        self.armed = false;
        let dir = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        crate::fsutil::fsync_dir(dir).map_err(BlobError::Local)
    }
}

impl Drop for PartialFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

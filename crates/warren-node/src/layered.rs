//! Layered images: each layer one reproducible EROFS file in the blob store
//! (chunked, content addressed), mounted once per node through the lazy layer
//! cache and shared read-only by every sandbox that uses it.
//!
//! The node asks this module for an image's layer *directories* (the cache's
//! mount points), so the container driver stacks them exactly as it stacks
//! directory layers: an idmapped clone of each, under one overlay.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use warren_api::ImageInfo;
use warren_image::blob::{BlobStore, ChunkSource, LayerMeta, S3Config};
use warren_image::cache::{CacheConfig, HolderCommand, LayerCache, LayerLease, PrefetchConfig};
use warren_image::erofs::{self, BuildOptions};
use warren_image::layer::{ImageConfig, ImageManifest, LayerManifest, LayerRole};
use warren_image::oci;
use warren_image::registry::{self, RegistryError, RegistryOptions};

use crate::{new_id, now_ms, NodeError, Result};

/// The tag every image gets until tags reach the API.
const TAG: &str = "latest";
/// Written by the cache while a fill holder runs (see `warren_image::cache`).
const HOLDER_RECORD: &str = "holder.json";
/// Default size bound of the node's layer cache.
pub const DEFAULT_CACHE_BYTES: u64 = 32 << 30;
/// A node completes a layer in the background once a sandbox that read
/// from it has ended: the node that ran an image once is the node that will
/// run it a thousand times (an RL trainer's shape), and a complete layer is
/// read at plain-directory speed with no fill daemon in the path. The cost,
/// the rest of the layer once per node, is what an eager pull pays before
/// the first start; `--layer-complete-after-use=false` turns it off.
pub const DEFAULT_LAYER_COMPLETE_AFTER_USE: bool = true;

/// Where layered images' chunks live and how big new chunks are.
#[derive(Debug, Clone, Default)]
pub struct BlobStoreConfig {
    /// An S3-compatible bucket instead of `<data>/blobs`.
    pub s3: Option<S3Config>,
    /// Chunk size of layers pushed from now on (default 1 MiB; a power of
    /// two from 4 KiB to 64 MiB). Stored layers keep theirs.
    pub chunk_size_bytes: Option<u64>,
    /// Piece size of layers pushed from now on: the unit a node fetches
    /// and verifies inside a chunk (default 16 KiB; 0 = no pieces, nodes
    /// fetch whole chunks). Stored layers keep theirs.
    pub piece_size_bytes: Option<u64>,
    /// Readahead window of the node's layer mounts in KiB (default
    /// `warren_image::cache::DEFAULT_READAHEAD_KB`; 0 = the kernel's).
    pub layer_readahead_kb: Option<u32>,
    /// Window a layer mount gets once the node has run something from the
    /// layer, in KiB (default
    /// `warren_image::cache::DEFAULT_WARM_READAHEAD_KB`; 0 = keep the first).
    pub layer_warm_readahead_kb: Option<u32>,
    /// Whether the node fetches the rest of a layer in the background once
    /// it has run something from it (default
    /// [`DEFAULT_LAYER_COMPLETE_AFTER_USE`]).
    pub layer_complete_after_use: Option<bool>,
    /// Prefetch, whole-small-file fetch and access-trace settings of the
    /// node's layer cache (`warren serve --layer-*`; default
    /// `PrefetchConfig::default()`).
    pub layer_prefetch: PrefetchConfig,
    /// Fill events the layer cache serves at once (default
    /// `warren_image::cache::DEFAULT_FILL_THREADS`).
    pub layer_fill_threads: Option<usize>,
}

pub struct LayeredImages {
    blobs: BlobStore,
    /// Opened on first use (it starts the fill holder), or at start when a
    /// holder from an earlier run may still hold layers failing closed.
    cache: tokio::sync::OnceCell<LayerCache>,
    config: CacheConfig,
    scratch: PathBuf,
    /// Held shared by everything that pushes layers to the store or leases
    /// them, and exclusively by garbage collection, which would otherwise
    /// delete the chunks of a layer whose manifest is not written yet or
    /// whose lease is being made.
    writes: tokio::sync::RwLock<()>,
}

fn image_err(context: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::Internal(format!("{context}: {e}"))
}

impl LayeredImages {
    /// The blob store in the S3 bucket `store` names, else under
    /// `<data>/blobs` (a local path; a mounted distributed filesystem works
    /// the same), and the cache under `<data>/layer-cache`, which adopts the
    /// fill holder a crash left.
    pub async fn open(
        data_dir: &Path,
        holder: HolderCommand,
        cache_bytes: u64,
        store: &BlobStoreConfig,
    ) -> Result<LayeredImages> {
        let mut blobs = match &store.s3 {
            Some(config) => BlobStore::s3(config),
            None => BlobStore::local(&data_dir.join("blobs")),
        }
        .map_err(|e| image_err("opening the blob store", e))?;
        if let Some(bytes) = store.chunk_size_bytes {
            blobs = blobs.with_chunk_size(bytes).map_err(|e| image_err("the blob store's chunk size", e))?;
        }
        if let Some(bytes) = store.piece_size_bytes {
            let pieces = (bytes > 0).then_some(bytes);
            blobs = blobs.with_piece_size(pieces).map_err(|e| image_err("the blob store's piece size", e))?;
        }
        let config = CacheConfig {
            holder,
            prefetch: store.layer_prefetch,
            fill_threads: store.layer_fill_threads.unwrap_or(warren_image::cache::DEFAULT_FILL_THREADS).max(1),
            readahead_kb: match store.layer_readahead_kb {
                Some(0) => None,
                Some(kb) => Some(kb),
                None => Some(warren_image::cache::DEFAULT_READAHEAD_KB),
            },
            warm_readahead_kb: match store.layer_warm_readahead_kb {
                Some(0) => None,
                Some(kb) => Some(kb),
                None => Some(warren_image::cache::DEFAULT_WARM_READAHEAD_KB),
            },
            complete_after_use: store.layer_complete_after_use.unwrap_or(DEFAULT_LAYER_COMPLETE_AFTER_USE),
            ..CacheConfig::new(data_dir.join("layer-cache"), cache_bytes).map_err(|e| image_err("layer cache", e))?
        };
        let scratch = data_dir.join("tmp");
        std::fs::create_dir_all(&scratch).map_err(|e| image_err("creating the scratch dir", e))?;
        let earlier_run = config.dir.join(HOLDER_RECORD).exists();
        let images = LayeredImages {
            blobs,
            cache: tokio::sync::OnceCell::new(),
            config,
            scratch,
            writes: tokio::sync::RwLock::new(()),
        };
        if earlier_run {
            images.cache().await?;
        }
        Ok(images)
    }

    async fn cache(&self) -> Result<&LayerCache> {
        self.cache
            .get_or_try_init(|| async {
                let source: Arc<dyn ChunkSource> = Arc::new(self.blobs.clone());
                LayerCache::open_with(self.config.clone(), source).await
            })
            .await
            .map_err(|e| image_err("opening the layer cache", e))
    }

    /// Builds one EROFS layer from `dir`, pushes it and makes image `name` of it.
    pub async fn import_dir(&self, name: &str, dir: &Path, role: LayerRole) -> Result<ImageInfo> {
        let meta = LayerMeta { name: format!("{name}.layer"), version: now_ms().to_string(), role };
        self.build_and_publish(name, dir, meta, Vec::new(), ImageConfig::default()).await
    }

    /// Builds an EROFS layer from `dir`, pushes it as `meta`, and makes image
    /// `name` = the layers `below` (name, version; bottom first) + it, with
    /// image config `config`.
    async fn build_and_publish(
        &self,
        name: &str,
        dir: &Path,
        meta: LayerMeta,
        below: Vec<(String, String)>,
        config: ImageConfig,
    ) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
        let _writing = self.writes.read().await;
        let file = self.scratch.join(format!("{}.erofs", new_id("layer")));
        let (src, dst) = (dir.to_path_buf(), file.clone());
        let built = tokio::task::spawn_blocking(move || erofs::build_from_dir(&src, &dst, &BuildOptions::default()))
            .await
            .map_err(|e| image_err("layer build task", e))?;
        let pushed = async {
            let built = built.map_err(|e| image_err("building the EROFS layer", e))?;
            self.blobs.push_layer(&built.path, &meta).await.map_err(|e| image_err("pushing the layer", e))?;
            let mut pairs: Vec<(&str, &str)> = below.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
            pairs.push((meta.name.as_str(), meta.version.as_str()));
            self.blobs
                .compose_image_with_config(name, TAG, &pairs, config)
                .await
                .map_err(|e| image_err("composing the image", e))
        }
        .await;
        let _ = std::fs::remove_file(&file);
        Ok(image_info(&pushed?))
    }

    /// Imports an OCI image layout directory or a `docker save` tarball: every
    /// image layer becomes one EROFS layer of `role` (whiteouts converted),
    /// pushed and composed into image `name`.
    pub async fn import_oci(&self, name: &str, source: &Path, docker_save: bool, role: LayerRole) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
        let _writing = self.writes.read().await;
        let out = self.scratch.join(new_id("oci"));
        std::fs::create_dir_all(&out).map_err(|e| image_err("creating the import dir", e))?;
        let (src, dst) = (source.to_path_buf(), out.clone());
        let imported = tokio::task::spawn_blocking(move || {
            let opts = BuildOptions::default();
            if docker_save {
                let file = std::fs::File::open(&src).map_err(|e| e.to_string())?;
                oci::import_docker_save(file, None, &dst, &opts).map_err(|e| e.to_string())
            } else {
                oci::import_oci_layout(&src, None, &dst, &opts).map_err(|e| e.to_string())
            }
        })
        .await
        .map_err(|e| image_err("OCI import task", e))?;
        let pushed = async {
            let imported = imported.map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("dir", e)))?;
            let paths: Vec<&Path> = imported.layers.iter().map(|l| l.path.as_path()).collect();
            self.publish_layers(name, &paths, imported.config.clone(), |i, version| LayerMeta {
                name: format!("{name}.layer{i}"),
                version: version.to_owned(),
                role,
            })
            .await
        }
        .await;
        let _ = std::fs::remove_dir_all(&out);
        Ok(image_info(&pushed?))
    }

    /// Pushes the EROFS files `paths` (bottom first) as the layers `meta`
    /// names, then makes image `name` of them, carrying `config`. Called
    /// with the write gate held.
    async fn publish_layers(
        &self,
        name: &str,
        paths: &[&Path],
        config: ImageConfig,
        meta: impl Fn(usize, &str) -> LayerMeta,
    ) -> Result<ImageManifest> {
        let version = format!("{}", now_ms());
        let mut refs = Vec::with_capacity(paths.len());
        for (i, path) in paths.iter().enumerate() {
            let meta = meta(i, &version);
            self.blobs.push_layer(path, &meta).await.map_err(|e| image_err("pushing a layer", e))?;
            if !refs.contains(&(meta.name.clone(), meta.version.clone())) {
                refs.push((meta.name, meta.version));
            }
        }
        let pairs: Vec<(&str, &str)> = refs.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        self.blobs
            .compose_image_with_config(name, TAG, &pairs, config)
            .await
            .map_err(|e| image_err("composing the image", e))
    }

    /// Pulls `reference` from an OCI registry into image `name`. Ordinary
    /// images become EROFS layers of `role` (default base), converted like
    /// an OCI layout; a Warren artifact's layers come back as pushed, under
    /// their own `name@version` and role unless `role` overrides it.
    pub async fn pull(
        &self,
        name: &str,
        reference: &str,
        options: RegistryOptions,
        role: Option<LayerRole>,
    ) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
        let _writing = self.writes.read().await;
        let out = self.scratch.join(new_id("pull"));
        std::fs::create_dir_all(&out).map_err(|e| image_err("creating the pull dir", e))?;
        let published = async {
            let pulled =
                registry::pull(reference, options, &out, &BuildOptions::default()).await.map_err(registry_node_err)?;
            tracing::info!(name, resolved = %pulled.resolved, layers = pulled.layers.len(), "pulled an image");
            let paths: Vec<&Path> = pulled.layers.iter().map(|l| l.built.path.as_path()).collect();
            self.publish_layers(name, &paths, pulled.config.clone(), |i, version| match &pulled.layers[i].origin {
                Some(origin) => LayerMeta {
                    name: origin.name.clone(),
                    version: origin.version.clone(),
                    role: role.unwrap_or(origin.role),
                },
                None => LayerMeta {
                    name: format!("{name}.layer{i}"),
                    version: version.to_owned(),
                    role: role.unwrap_or(LayerRole::Base),
                },
            })
            .await
        }
        .await;
        let _ = std::fs::remove_dir_all(&out);
        Ok(image_info(&published?))
    }

    /// Pushes image `name` to `reference` as a Warren artifact: each layer
    /// fetched whole from the store (digest checked), then sent as is.
    pub async fn push(&self, name: &str, reference: &str, options: RegistryOptions) -> Result<registry::PushedImage> {
        let _reading = self.writes.read().await;
        let (image, layers) = self.inspect(name).await?.ok_or_else(|| NodeError::ImageNotFound(name.to_string()))?;
        let dir = self.scratch_dir()?;
        let pushed = async {
            let mut files = Vec::with_capacity(layers.len());
            for layer in &layers {
                let file = dir.join(format!("{}.erofs", layer.digest.trim_start_matches("sha256:")));
                if !file.exists() {
                    self.blobs.pull_layer_eager(layer, &file).await.map_err(|e| image_err("reading a layer", e))?;
                }
                let origin = registry::LayerOrigin {
                    name: layer.name.clone(),
                    version: layer.version.clone(),
                    role: layer.role,
                };
                files.push(registry::PushLayer { origin, file });
            }
            registry::push(reference, options, &files, &image.config).await.map_err(registry_node_err)
        }
        .await;
        let _ = std::fs::remove_dir_all(&dir);
        pushed
    }

    /// Image `name`'s manifest and its layers' (bottom first), or `None`.
    pub async fn inspect(&self, name: &str) -> Result<Option<(ImageManifest, Vec<LayerManifest>)>> {
        let image = match self.blobs.get_image_manifest(name, TAG).await {
            Ok(image) => image,
            Err(warren_image::blob::BlobError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(image_err("reading the image", e)),
        };
        let layers = self.blobs.image_layers(&image).await.map_err(|e| image_err("reading the image's layers", e))?;
        Ok(Some((image, layers)))
    }

    /// Every layered image.
    pub async fn list(&self) -> Result<Vec<ImageInfo>> {
        let images = self.blobs.list_images().await.map_err(|e| image_err("listing images", e))?;
        Ok(images.iter().map(image_info).collect())
    }

    /// Removes image `name`'s tag; `false` if there is none. Its layers stay
    /// until [`LayeredImages::gc`].
    pub async fn remove(&self, name: &str) -> Result<bool> {
        match self.blobs.delete_image(name, TAG).await {
            Ok(()) => Ok(true),
            Err(warren_image::blob::BlobError::NotFound(_)) => Ok(false),
            Err(e) => Err(image_err("removing the image", e)),
        }
    }

    /// Image `name` = `layers` (each `name@version`, bottom first), carrying
    /// `config`. No layer data is read or copied.
    pub async fn compose(&self, name: &str, layers: &[LayerManifest], config: ImageConfig) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
        let _writing = self.writes.read().await;
        let pairs: Vec<(&str, &str)> = layers.iter().map(|l| (l.name.as_str(), l.version.as_str())).collect();
        let image = self.blobs.compose_image_with_config(name, TAG, &pairs, config).await.map_err(|e| match e {
            warren_image::blob::BlobError::Manifest(m) => {
                NodeError::Invalid(warren_api::ApiError::invalid("layers", m.to_string()))
            }
            other => image_err("composing the image", other),
        })?;
        Ok(image_info(&image))
    }

    /// Layer `name@version`, or `None`.
    pub async fn layer(&self, name: &str, version: &str) -> Result<Option<LayerManifest>> {
        match self.blobs.get_layer_manifest(name, version).await {
            Ok(layer) => Ok(Some(layer)),
            Err(warren_image::blob::BlobError::NotFound(_)) => Ok(None),
            Err(e) => Err(image_err("reading the layer", e)),
        }
    }

    /// Deletes what no image references: layer manifests, chunks, and
    /// unleased cached layer files. Layers leased by running sandboxes are
    /// kept with their chunks even when no image names them any more.
    pub async fn gc(&self) -> Result<warren_api::ImageGcReport> {
        let _exclusive = self.writes.write().await;
        let leased: std::collections::HashSet<String> = self
            .cache
            .get()
            .map(|c| c.stats().into_iter().filter(|l| l.leases > 0).map(|l| l.digest).collect())
            .unwrap_or_default();
        let report = self.blobs.collect_garbage(&leased).await.map_err(|e| image_err("collecting garbage", e))?;
        let mut keep = report.kept_layer_digests.clone();
        keep.extend(leased);
        let (cached, cached_bytes) = self.cache.get().map(|c| c.evict_unreferenced(&keep)).unwrap_or_default();
        Ok(warren_api::ImageGcReport {
            layers_removed: report.layers_removed,
            chunks_removed: report.chunks_removed,
            cached_layers_removed: cached as u64,
            bytes_freed: report.bytes_freed + cached_bytes,
        })
    }

    /// A fresh, empty directory under the scratch dir; the caller removes it.
    pub fn scratch_dir(&self) -> Result<PathBuf> {
        let dir = self.scratch.join(new_id("pack"));
        std::fs::create_dir(&dir).map_err(|e| image_err("creating a scratch dir", e))?;
        Ok(dir)
    }

    /// Makes image `name` = the layers of image `base` + one new `diff` layer
    /// built from `dir`. The base's layers are referenced, not copied.
    pub async fn extend(&self, name: &str, base: &str, dir: &Path) -> Result<ImageInfo> {
        let base =
            self.blobs.get_image_manifest(base, TAG).await.map_err(|e| image_err("reading the base image", e))?;
        let below = base.layers.iter().map(|l| (l.name.clone(), l.version.clone())).collect();
        let meta = LayerMeta { name: format!("{name}.diff"), version: now_ms().to_string(), role: LayerRole::Diff };
        self.build_and_publish(name, dir, meta, below, base.config).await
    }

    /// The layer cache's fill requests and those that found their range
    /// already local, summed over the cached layers.
    pub fn fill_counters(&self) -> (u64, u64) {
        let layers = self.cache.get().map(LayerCache::stats).unwrap_or_default();
        layers.iter().fold((0, 0), |(fills, hits), l| (fills + l.fill_events, hits + l.cache_hits))
    }

    /// Fill events by the cgroup of the reader, over every cached layer.
    pub fn reader_stats(&self) -> Vec<warren_image::cache::ReaderStats> {
        self.cache.get().map(LayerCache::reader_stats).unwrap_or_default()
    }

    /// Per-layer cache statistics and the blob store's counters.
    pub fn stats(&self) -> warren_api::ImageStats {
        let layers = self.cache.get().map(LayerCache::stats).unwrap_or_default();
        let b = self.blobs.stats();
        warren_api::ImageStats {
            layers: layers
                .into_iter()
                .map(|l| warren_api::LayerCacheStats {
                    digest: l.digest,
                    size_bytes: l.size_bytes,
                    present_bytes: l.present_bytes,
                    bytes_accessed: l.bytes_accessed,
                    bytes_fetched: l.bytes_fetched,
                    chunks_fetched: l.chunks_fetched,
                    metadata_chunks_fetched: l.metadata_chunks_fetched,
                    metadata_bytes_fetched: l.metadata_bytes_fetched,
                    failed_fills: l.failed_fills,
                    prefetched_bytes: l.prefetched_bytes,
                    prefetched_units: l.prefetched_units,
                    prefetched_units_used: l.prefetched_units_used,
                    trace_units_replayed: l.trace_units_replayed,
                    trace_bytes_replayed: l.trace_bytes_replayed,
                    failed_trace_units: l.failed_trace_units,
                    traced_units: l.traced_units,
                    traces_published: l.traces_published,
                    trace_replays_running: l.trace_replays_running as u64,
                    completion_units: l.completion_units,
                    completion_bytes: l.completion_bytes,
                    failed_completion_units: l.failed_completion_units,
                    completion_running: l.completion_running as u64,
                    leases: l.leases as u64,
                    mounted: l.mounted,
                })
                .collect(),
            store: warren_api::BlobStoreStats {
                chunks_fetched: b.chunks_fetched,
                bytes_fetched: b.bytes_fetched,
                chunks_rejected: b.chunks_rejected,
                chunks_uploaded: b.chunks_uploaded,
                bytes_uploaded: b.bytes_uploaded,
                chunks_deduplicated: b.chunks_deduplicated,
                pieces_fetched: b.pieces_fetched,
                range_requests: b.range_requests,
            },
        }
    }

    /// Unmounts every layer and ends the cache's fill holder; refused (and
    /// everything left failing closed) while a layer is still leased.
    pub async fn shutdown(self) -> Result<()> {
        match self.cache.into_inner() {
            Some(cache) => cache.shutdown().await.map_err(|e| image_err("shutting the layer cache down", e)),
            None => Ok(()),
        }
    }

    /// Leases every layer of `name` (bottom first), each mounted and ready,
    /// and returns them with the image's config.
    pub async fn acquire(&self, name: &str) -> Result<(Vec<LayerLease>, ImageConfig)> {
        // Until the leases exist, garbage collection must not take the
        // chunks of the layers being prepared.
        let _reading = self.writes.read().await;
        let image =
            self.blobs.get_image_manifest(name, TAG).await.map_err(|_| NodeError::ImageNotFound(name.to_string()))?;
        let layers = self.blobs.image_layers(&image).await.map_err(|e| image_err("reading the image's layers", e))?;
        // All at once: on a cold node each layer's manifest, metadata blob
        // and trace are store round trips and a sync, which the layers need
        // not wait out in turn. A failure drops the leases already made.
        let cache = self.cache().await?;
        let leases = futures_util::future::try_join_all(layers.iter().map(|layer| cache.acquire(layer)))
            .await
            .map_err(|e| image_err("preparing a layer", e))?;
        Ok((leases, image.config))
    }
}

/// A registry failure as the API reports it: bad input and bad content are
/// the caller's (400, field `reference`), a missing image is 404, missing or
/// refused credentials 403 (field `auth`), an unreachable or failing
/// registry 502. Messages never hold a password (see `registry`).
fn registry_node_err(e: RegistryError) -> NodeError {
    use warren_api::{ApiError, ErrorCode};
    let message = e.to_string();
    let auth = |code| {
        NodeError::Invalid(ApiError { code, message: message.clone(), field: Some("auth".into()), divergence: None })
    };
    let code = match e {
        RegistryError::NotFound { .. } => ErrorCode::NotFound,
        RegistryError::AuthRequired { .. } | RegistryError::Denied { .. } => {
            return auth(ErrorCode::RegistryAuthRequired)
        }
        RegistryError::AuthFailed { .. } => return auth(ErrorCode::RegistryAuthFailed),
        RegistryError::Registry { .. } => ErrorCode::RegistryUnavailable,
        RegistryError::Io { .. } | RegistryError::Scratch(_) => return NodeError::Internal(message),
        _ => ErrorCode::InvalidRequest,
    };
    NodeError::Invalid(ApiError { code, message, field: Some("reference".into()), divergence: None })
}

fn image_info(image: &ImageManifest) -> ImageInfo {
    ImageInfo {
        name: image.name.clone(),
        layers: image.layers.iter().map(|l| format!("{}@{}", l.name, l.version)).collect(),
        created_at_ms: now_ms(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's blob-store settings are the layer cache's: a setting
    /// dropped on the way fails here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn layer_cache_settings_reach_the_cache_config() {
        let dir = tempfile::tempdir().unwrap();
        let prefetch =
            PrefetchConfig { max_ahead_bytes: 8 << 10, max_requests: 3, whole_file_bytes: 0, trace_requests: 5 };
        let store = BlobStoreConfig {
            layer_readahead_kb: Some(64),
            layer_warm_readahead_kb: Some(0),
            layer_complete_after_use: Some(false),
            layer_prefetch: prefetch,
            layer_fill_threads: Some(6),
            ..BlobStoreConfig::default()
        };
        let holder = HolderCommand::current_exe().unwrap();
        let images = LayeredImages::open(dir.path(), holder, 1 << 30, &store).await.unwrap();
        assert_eq!(images.config.prefetch, prefetch);
        assert_eq!(images.config.fill_threads, 6);
        assert_eq!(images.config.readahead_kb, Some(64));
        assert_eq!(images.config.warm_readahead_kb, None);
        assert!(!images.config.complete_after_use);
        // Nothing opened the cache: no holder was started.
        assert!(images.cache.get().is_none());

        let defaults = LayeredImages::open(
            dir.path(),
            HolderCommand::current_exe().unwrap(),
            1 << 30,
            &BlobStoreConfig::default(),
        )
        .await
        .unwrap();
        assert_eq!(defaults.config.prefetch, PrefetchConfig::default());
        assert_eq!(defaults.config.fill_threads, warren_image::cache::DEFAULT_FILL_THREADS);
        assert_eq!(defaults.config.readahead_kb, Some(warren_image::cache::DEFAULT_READAHEAD_KB));
        assert_eq!(defaults.config.warm_readahead_kb, Some(warren_image::cache::DEFAULT_WARM_READAHEAD_KB));
        assert_eq!(defaults.config.complete_after_use, DEFAULT_LAYER_COMPLETE_AFTER_USE);
    }
}

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
use warren_image::blob::{BlobStore, ChunkSource, LayerMeta};
use warren_image::cache::{CacheConfig, HolderCommand, LayerCache, LayerLease};
use warren_image::erofs::{self, BuildOptions};
use warren_image::layer::{ImageManifest, LayerRole};
use warren_image::oci;

use crate::{new_id, now_ms, NodeError, Result};

/// The tag every image gets until tags reach the API.
const TAG: &str = "latest";
/// Written by the cache while a fill holder runs (see `warren_image::cache`).
const HOLDER_RECORD: &str = "holder.json";
/// Default size bound of the node's layer cache.
pub const DEFAULT_CACHE_BYTES: u64 = 32 << 30;

pub struct LayeredImages {
    blobs: BlobStore,
    /// Opened on first use (it starts the fill holder), or at start when a
    /// holder from an earlier run may still hold layers failing closed.
    cache: tokio::sync::OnceCell<LayerCache>,
    config: CacheConfig,
    scratch: PathBuf,
}

fn image_err(context: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::Internal(format!("{context}: {e}"))
}

impl LayeredImages {
    /// The blob store under `<data>/blobs` (a local path; a mounted
    /// distributed filesystem works the same) and the cache under
    /// `<data>/layer-cache`, which adopts the fill holder a crash left.
    pub async fn open(data_dir: &Path, holder: HolderCommand, cache_bytes: u64) -> Result<LayeredImages> {
        let blobs = BlobStore::local(&data_dir.join("blobs")).map_err(|e| image_err("opening the blob store", e))?;
        let config = CacheConfig {
            holder,
            ..CacheConfig::new(data_dir.join("layer-cache"), cache_bytes).map_err(|e| image_err("layer cache", e))?
        };
        let scratch = data_dir.join("tmp");
        std::fs::create_dir_all(&scratch).map_err(|e| image_err("creating the scratch dir", e))?;
        let earlier_run = config.dir.join(HOLDER_RECORD).exists();
        let images = LayeredImages { blobs, cache: tokio::sync::OnceCell::new(), config, scratch };
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
        self.build_and_publish(name, dir, meta, Vec::new()).await
    }

    /// Builds an EROFS layer from `dir`, pushes it as `meta`, and makes image
    /// `name` = the layers `below` (name, version; bottom first) + it.
    async fn build_and_publish(
        &self,
        name: &str,
        dir: &Path,
        meta: LayerMeta,
        below: Vec<(String, String)>,
    ) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
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
            self.blobs.compose_image(name, TAG, &pairs).await.map_err(|e| image_err("composing the image", e))
        }
        .await;
        let _ = std::fs::remove_file(&file);
        Ok(image_info(&pushed?))
    }

    /// Imports an OCI image layout directory or a `docker save` tarball: every
    /// image layer becomes one EROFS base layer (whiteouts converted), pushed
    /// and composed into image `name`.
    pub async fn import_oci(&self, name: &str, source: &Path, docker_save: bool) -> Result<ImageInfo> {
        warren_image::validate_name(name)
            .map_err(|e| NodeError::Invalid(warren_api::ApiError::invalid("name", e.to_string())))?;
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
            let version = format!("{}", now_ms());
            let mut refs = Vec::new();
            for (i, layer) in imported.layers.iter().enumerate() {
                let meta =
                    LayerMeta { name: format!("{name}.layer{i}"), version: version.clone(), role: LayerRole::Base };
                self.blobs.push_layer(&layer.path, &meta).await.map_err(|e| image_err("pushing a layer", e))?;
                refs.push(meta.name);
            }
            let pairs: Vec<(&str, &str)> = refs.iter().map(|n| (n.as_str(), version.as_str())).collect();
            self.blobs.compose_image(name, TAG, &pairs).await.map_err(|e| image_err("composing the image", e))
        }
        .await;
        let _ = std::fs::remove_dir_all(&out);
        Ok(image_info(&pushed?))
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
        self.build_and_publish(name, dir, meta, below).await
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
                    failed_fills: l.failed_fills,
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
            },
        }
    }

    /// Whether an image of that name exists in the blob store.
    pub async fn has(&self, name: &str) -> bool {
        self.blobs.get_image_manifest(name, TAG).await.is_ok()
    }

    /// Unmounts every layer and ends the cache's fill holder; refused (and
    /// everything left failing closed) while a layer is still leased.
    pub async fn shutdown(self) -> Result<()> {
        match self.cache.into_inner() {
            Some(cache) => cache.shutdown().await.map_err(|e| image_err("shutting the layer cache down", e)),
            None => Ok(()),
        }
    }

    /// Leases every layer of `name` (bottom first), each mounted and ready.
    pub async fn acquire(&self, name: &str) -> Result<Vec<LayerLease>> {
        let image =
            self.blobs.get_image_manifest(name, TAG).await.map_err(|_| NodeError::ImageNotFound(name.to_string()))?;
        let layers = self.blobs.image_layers(&image).await.map_err(|e| image_err("reading the image's layers", e))?;
        let mut leases = Vec::with_capacity(layers.len());
        for layer in &layers {
            leases.push(self.cache().await?.acquire(layer).await.map_err(|e| image_err("preparing a layer", e))?);
        }
        Ok(leases)
    }
}

fn image_info(image: &ImageManifest) -> ImageInfo {
    ImageInfo {
        name: image.name.clone(),
        layers: image.layers.iter().map(|l| format!("{}@{}", l.name, l.version)).collect(),
        created_at_ms: now_ms(),
    }
}

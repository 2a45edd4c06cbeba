//! Image management on the node: registry pull and push, inspect, remove,
//! compose and garbage collection. Directory images live in the node's
//! [`warren_image::ImageStore`], layered ones in the blob store behind
//! [`crate::layered::LayeredImages`]; one name means one image, so a name
//! taken in one store is refused in the other.

use std::sync::Arc;

use warren_api::{
    ApiError, ComposeImageRequest, ComposeLayer, ImageDetail, ImageGcReport, ImageInfo, ImageLayerRole, ImageRunConfig,
    ImageStorage, LayerDetail, PullImageRequest, PushImageRequest, PushImageResult, RegistryAuth, SandboxImageStats,
};
use warren_image::docker_config;
use warren_image::layer::{ImageConfig, LayerManifest, LayerRole};
use warren_image::registry::{self, RegistryCredentials, RegistryOptions};

use crate::layered::LayeredImages;
use crate::{Node, NodeError, Result};

pub(crate) fn layer_role(role: Option<ImageLayerRole>) -> LayerRole {
    role.map(to_layer_role).unwrap_or(LayerRole::Base)
}

fn to_layer_role(role: ImageLayerRole) -> LayerRole {
    match role {
        ImageLayerRole::Base => LayerRole::Base,
        ImageLayerRole::Workspace => LayerRole::Workspace,
        ImageLayerRole::Toolkit => LayerRole::Toolkit,
        ImageLayerRole::Diff => LayerRole::Diff,
        ImageLayerRole::Other => LayerRole::Other,
    }
}

fn api_role(role: LayerRole) -> ImageLayerRole {
    match role {
        LayerRole::Base => ImageLayerRole::Base,
        LayerRole::Workspace => ImageLayerRole::Workspace,
        LayerRole::Toolkit => ImageLayerRole::Toolkit,
        LayerRole::Diff => ImageLayerRole::Diff,
        LayerRole::Other => ImageLayerRole::Other,
    }
}

/// The local name a pull gets by default: the repository's last segment.
fn default_name(reference: &str) -> &str {
    let path = reference.split('@').next().unwrap_or(reference);
    let last = path.rsplit('/').next().unwrap_or(path);
    last.split(':').next().unwrap_or(last)
}

impl Node {
    pub(crate) fn layered_or_invalid(&self, field: &str) -> Result<Arc<LayeredImages>> {
        self.layered().ok_or_else(|| {
            NodeError::Invalid(ApiError::invalid(field, "layered images are not enabled on this server"))
        })
    }

    /// A layered image may not take the name of a directory image.
    fn check_not_dir_image(&self, name: &str) -> Result<()> {
        match self.inner.images.get(name) {
            Ok(_) => Err(NodeError::Invalid(ApiError::invalid(
                "name",
                format!("a directory image named `{name}` exists; remove it first"),
            ))),
            Err(_) => Ok(()),
        }
    }

    /// The credentials a pull or push of `reference` uses: the request's,
    /// else the node's credentials file's entry for the registry host, else
    /// none (anonymous).
    fn registry_credentials(&self, reference: &str, auth: Option<RegistryAuth>) -> Result<Option<RegistryCredentials>> {
        if let Some(RegistryAuth { username, password }) = auth {
            if username.is_empty() || username.contains(':') {
                return Err(NodeError::Invalid(ApiError::invalid("auth.username", "must be non-empty without ':'")));
            }
            return Ok(Some(RegistryCredentials { username, password }));
        }
        let Some(path) = &self.inner.cfg.registry_auth_file else { return Ok(None) };
        let host = registry::registry_host(reference)
            .map_err(|e| NodeError::Invalid(ApiError::invalid("reference", e.to_string())))?;
        let bytes = std::fs::read(path).map_err(|e| {
            NodeError::Internal(format!("reading the registry credentials file {}: {e}", path.display()))
        })?;
        docker_config::credentials_for(&bytes, &host).map_err(|e| {
            NodeError::Internal(format!("the registry credentials file {} is not valid: {e}", path.display()))
        })
    }

    /// What sandbox `id`'s reads of its layered image cost: the fill events
    /// raised by processes in its cgroups (a path segment is its id).
    pub fn sandbox_image_stats(&self, id: &str) -> Result<SandboxImageStats> {
        self.get(id)?;
        let mut total = SandboxImageStats { sandbox_id: id.to_string(), ..SandboxImageStats::default() };
        let readers = self.layered().map(|l| l.reader_stats()).unwrap_or_default();
        for r in readers.iter().filter(|r| r.cgroup.split('/').any(|segment| segment == id)) {
            total.bytes_accessed += r.bytes_accessed;
            total.bytes_fetched += r.bytes_fetched;
            total.chunks_fetched += r.chunks_fetched;
            total.cache_hits += r.cache_hits;
            total.fill_events += r.fill_events;
        }
        Ok(total)
    }

    /// Every image: directory images, then layered ones.
    pub async fn list_images(&self) -> Result<Vec<ImageInfo>> {
        let mut images = self.images()?;
        if let Some(layered) = self.layered() {
            images.extend(layered.list().await?);
        }
        Ok(images)
    }

    /// Pulls an image from an OCI registry into a layered image.
    pub async fn pull_image(&self, req: PullImageRequest) -> Result<ImageInfo> {
        let layered = self.layered_or_invalid("reference")?;
        let name = req.name.clone().unwrap_or_else(|| default_name(&req.reference).to_owned());
        warren_image::validate_name(&name).map_err(|e| {
            let field = if req.name.is_some() { "name" } else { "reference" };
            NodeError::Invalid(ApiError::invalid(field, format!("{e} (pass `name`)")))
        })?;
        self.check_not_dir_image(&name)?;
        let credentials = self.registry_credentials(&req.reference, req.auth)?;
        let options = RegistryOptions { insecure: req.insecure, credentials };
        layered.pull(&name, &req.reference, options, req.role.map(to_layer_role)).await
    }

    /// Pushes layered image `name` to a registry.
    pub async fn push_image(&self, name: &str, req: PushImageRequest) -> Result<PushImageResult> {
        if self.inner.images.get(name).is_ok() {
            return Err(NodeError::Invalid(ApiError::invalid(
                "name",
                "only layered (erofs) images can be pushed; import the directory with format erofs first",
            )));
        }
        let layered = self.layered().ok_or_else(|| NodeError::ImageNotFound(name.to_string()))?;
        let credentials = self.registry_credentials(&req.reference, req.auth)?;
        let options = RegistryOptions { insecure: req.insecure, credentials };
        let pushed = layered.push(name, &req.reference, options).await?;
        Ok(PushImageResult {
            name: name.to_string(),
            reference: pushed.resolved,
            manifest_digest: pushed.manifest_digest,
            layer_bytes: pushed.layer_bytes,
        })
    }

    /// An image's layers: role, digest, size and chunk count of each
    /// layered one; the ids of a directory image's.
    pub async fn inspect_image(&self, name: &str) -> Result<ImageDetail> {
        match self.inner.images.get(name) {
            Ok(image) => {
                let layers = image
                    .layers()
                    .iter()
                    .map(|l| LayerDetail {
                        id: l.id().to_string(),
                        role: None,
                        digest: None,
                        size_bytes: None,
                        chunk_count: None,
                    })
                    .collect();
                return Ok(ImageDetail { name: name.to_string(), storage: ImageStorage::Dir, layers, config: None });
            }
            Err(warren_image::ImageError::NotFound(_)) | Err(warren_image::ImageError::InvalidName(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let found = match self.layered() {
            Some(layered) => layered.inspect(name).await?,
            None => None,
        };
        let (image, layers) = found.ok_or_else(|| NodeError::ImageNotFound(name.to_string()))?;
        let config = (!image.config.is_empty()).then(|| run_config(image.config));
        Ok(ImageDetail {
            name: name.to_string(),
            storage: ImageStorage::Erofs,
            layers: layers.iter().map(layer_detail).collect(),
            config,
        })
    }

    /// Removes image `name`; refused while a sandbox or warm pool uses it.
    /// A layered image's data goes with the next [`Node::gc_images`].
    pub async fn remove_image(&self, name: &str) -> Result<()> {
        self.check_image_unused(name)?;
        let images = Arc::clone(&self.inner.images);
        let owned = name.to_string();
        match tokio::task::spawn_blocking(move || images.remove(&owned))
            .await
            .map_err(|e| NodeError::Internal(e.to_string()))?
        {
            Ok(()) => {
                self.images_changed();
                return Ok(());
            }
            Err(warren_image::ImageError::NotFound(_)) => {}
            Err(e) => return Err(e.into()),
        }
        match self.layered() {
            Some(layered) if layered.remove(name).await? => Ok(()),
            _ => Err(NodeError::ImageNotFound(name.to_string())),
        }
    }

    /// Deletes layers, chunks and cached layer files no image references.
    pub async fn gc_images(&self) -> Result<ImageGcReport> {
        let report = match self.layered() {
            Some(layered) => layered.gc().await,
            None => Ok(ImageGcReport::default()),
        };
        self.images_changed();
        report
    }

    /// A new layered image from the layers of others, bottom first.
    pub async fn compose_image(&self, req: ComposeImageRequest) -> Result<ImageInfo> {
        let layered = self.layered_or_invalid("layers")?;
        self.check_not_dir_image(&req.name)?;
        if req.layers.is_empty() {
            return Err(NodeError::Invalid(ApiError::invalid("layers", "at least one layer is needed")));
        }
        let mut stack: Vec<LayerManifest> = Vec::new();
        // The highest listed image with a config lends it to the new image
        // (an OS image's PATH survives a workspace composed on top).
        let mut config = ImageConfig::default();
        for (i, entry) in req.layers.iter().enumerate() {
            let field = format!("layers[{i}]");
            let invalid = |msg: String| NodeError::Invalid(ApiError::invalid(field.clone(), msg));
            match entry {
                ComposeLayer::Image { image, role } => {
                    let (manifest, layers) = match layered.inspect(image).await? {
                        Some(found) => found,
                        None => return Err(invalid(format!("no layered image named `{image}`"))),
                    };
                    let wanted = role.map(to_layer_role);
                    let before = stack.len();
                    stack.extend(layers.into_iter().filter(|l| wanted.is_none_or(|r| l.role == r)));
                    if stack.len() == before {
                        let which = wanted.map(|r| format!("{r:?}").to_lowercase()).unwrap_or_default();
                        return Err(invalid(format!("image `{image}` has no {which} layer")));
                    }
                    if !manifest.config.is_empty() {
                        config = manifest.config;
                    }
                }
                ComposeLayer::Layer { layer } => {
                    let Some((name, version)) = layer.split_once('@') else {
                        return Err(invalid(format!("`{layer}` is not name@version")));
                    };
                    match layered.layer(name, version).await {
                        Ok(Some(found)) => stack.push(found),
                        Ok(None) | Err(_) => return Err(invalid(format!("no layer `{layer}`"))),
                    }
                }
            }
        }
        layered.compose(&req.name, &stack, config).await
    }
}

fn run_config(c: ImageConfig) -> ImageRunConfig {
    ImageRunConfig { env: c.env, entrypoint: c.entrypoint, cmd: c.cmd, working_dir: c.working_dir, user: c.user }
}

fn layer_detail(l: &LayerManifest) -> LayerDetail {
    LayerDetail {
        id: l.id(),
        role: Some(api_role(l.role)),
        digest: Some(l.digest.clone()),
        size_bytes: Some(l.size),
        chunk_count: Some(l.chunk_count() as u64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pull_is_named_after_the_repository_by_default() {
        assert_eq!(default_name("127.0.0.1:5000/team/py:v1"), "py");
        assert_eq!(default_name("busybox"), "busybox");
        assert_eq!(default_name("localhost:5000/py@sha256:00"), "py");
    }

    #[test]
    fn roles_map_both_ways() {
        for role in [
            ImageLayerRole::Base,
            ImageLayerRole::Workspace,
            ImageLayerRole::Toolkit,
            ImageLayerRole::Diff,
            ImageLayerRole::Other,
        ] {
            assert_eq!(api_role(to_layer_role(role)), role);
        }
    }
}

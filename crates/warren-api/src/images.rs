//! Image management beyond import: registry pull and push, inspect,
//! remove, compose and garbage collection.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What a layer is for in an image stack (base at the bottom).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageLayerRole {
    /// The OS and system packages.
    Base,
    /// The task repository and its dependencies.
    Workspace,
    /// The agent harness.
    Toolkit,
    /// A sandbox's writable layer packed by `pack_diff`.
    Diff,
    Other,
}

/// `POST /v1/images/pull`: fetch an image from an OCI registry into a
/// layered image. Answers when the pull is done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PullImageRequest {
    /// `registry/repository:tag` or `registry/repository@sha256:...`.
    pub reference: String,
    /// Local image name; defaults to the repository's last path segment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Plain HTTP to a registry that is not on loopback (loopback
    /// registries always get plain HTTP).
    #[serde(default)]
    pub insecure: bool,
    /// Role of every pulled layer (default `base`). A Warren-pushed image
    /// keeps the roles it was pushed with unless this is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<ImageLayerRole>,
    /// Credentials for the registry; without them the node uses its
    /// credentials file's entry for the registry host, if any, else
    /// anonymous access.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RegistryAuth>,
}

/// A registry username and password. The server never logs them, stores
/// them or echoes them in an answer; `Debug` shows the username only.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegistryAuth {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryAuth").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

/// `POST /v1/images/{name}/push`: push a layered image to a registry as a
/// Warren artifact (its EROFS layers, media type
/// `application/vnd.warren.layer.v1.erofs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PushImageRequest {
    /// `registry/repository:tag`.
    pub reference: String,
    #[serde(default)]
    pub insecure: bool,
    /// As for a pull.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<RegistryAuth>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PushImageResult {
    pub name: String,
    /// `registry/repository@sha256:...` of the pushed manifest.
    pub reference: String,
    pub manifest_digest: String,
    /// Bytes of layer data sent.
    pub layer_bytes: u64,
}

/// How an image is stored on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ImageStorage {
    /// Read-only layer directories.
    Dir,
    /// EROFS layers in the chunked blob store, fetched lazily.
    Erofs,
}

/// `GET /v1/images/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageDetail {
    pub name: String,
    pub storage: ImageStorage,
    /// Bottom (base) first.
    pub layers: Vec<LayerDetail>,
    /// The OCI config an imported or pulled image came with; absent when
    /// the image has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ImageRunConfig>,
}

/// An image's OCI config. `env` is every sandbox's default environment
/// (the create request's `env`, then an exec's, override it) and
/// `working_dir` the default `cwd` of execs and sessions. `entrypoint` +
/// `cmd` is what `warren run IMAGE` runs when given no command; the server
/// never runs them by itself. `user` is informational: execs run as the
/// sandbox's root.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ImageRunConfig {
    /// `NAME=value` entries.
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl ImageRunConfig {
    /// The command an image runs by default: `entrypoint` then `cmd`.
    pub fn default_command(&self) -> Vec<String> {
        self.entrypoint.iter().chain(&self.cmd).cloned().collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LayerDetail {
    /// `name@version` of a layered image's layer, or a directory layer's id.
    pub id: String,
    /// Layered images only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<ImageLayerRole>,
    /// `sha256:<hex>` of the EROFS file (layered images only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_count: Option<u64>,
}

/// One entry of a composed stack: the layers of an existing image
/// (optionally only those with `role`), or one layer by `name@version`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ComposeLayer {
    Image {
        image: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        role: Option<ImageLayerRole>,
    },
    Layer {
        layer: String,
    },
}

/// `POST /v1/images/compose`: a new layered image from existing layers,
/// bottom first. Copies no layer data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ComposeImageRequest {
    pub name: String,
    pub layers: Vec<ComposeLayer>,
}

/// `GET /v1/sandboxes/{id}/image-stats`: what one sandbox's reads of its
/// layered image cost, over all its layers, since the server started.
/// Reads are attributed by the cgroup of the reading process (every
/// sandbox has its own). Reads the page cache serves raise no fill event
/// and count nowhere: a page one sandbox brought in serves the next without
/// a trace. All zero for a directory image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SandboxImageStats {
    pub sandbox_id: String,
    /// Sum of the ranges the sandbox's reads asked the layer cache for.
    pub bytes_accessed: u64,
    /// Bytes the cache fetched from the blob store for those reads.
    pub bytes_fetched: u64,
    pub chunks_fetched: u64,
    /// Fill events whose whole range the node already held.
    pub cache_hits: u64,
    pub fill_events: u64,
}

/// `POST /v1/images/gc`: what was removed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ImageGcReport {
    /// Layer manifests no image referenced.
    pub layers_removed: u64,
    /// Blob-store chunks no remaining layer lists.
    pub chunks_removed: u64,
    /// Layer files dropped from the node's layer cache.
    pub cached_layers_removed: u64,
    /// Store bytes (manifests and chunks) plus cache bytes freed.
    pub bytes_freed: u64,
}

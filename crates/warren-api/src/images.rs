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

//! Pull and push over the OCI distribution protocol (the `oci-client`
//! crate), anonymously or with a username and password: HTTP basic auth,
//! or the bearer-token flow a registry's `WWW-Authenticate` challenge asks
//! for (oci-client trades the credentials for a token at the realm).
//!
//! A pull resolves `name:tag` (or `name@digest`) to one image manifest -
//! OCI or Docker v2 schema 2, linux/amd64 picked from an index - and
//! downloads its blobs into a private OCI image layout, hashing every blob
//! as it streams. An ordinary image is then converted by the OCI-layout
//! importer ([`crate::oci::import_oci_layout`]): the same code path, the
//! same whiteout conversion, the same checks. An image Warren pushed is an
//! OCI artifact whose layers *are* EROFS files
//! ([`MEDIA_WARREN_LAYER`]); those come back byte for byte, digests equal.
//!
//! Invariants: no blob is used unless its sha256 and size match the
//! manifest's descriptor; media types are checked before any layer is
//! downloaded and unknown ones refused; layer files appear in `out_dir`
//! only once every layer is in, so a failed pull leaves nothing behind.
//! Plain HTTP is used only for a loopback registry or when the caller asks
//! for it (`insecure`). A password never appears in a `Debug` print or an
//! error: [`RegistryCredentials`] redacts it, and errors carry only the
//! registry's own words and URLs (credentials travel in headers).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use futures_util::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::erofs::{self, BuildOptions, BuiltLayer, ErofsError};
use crate::error::ImageError;
use crate::fsutil::{fsync_dir, private_scratch_dir, DirGuard};
use crate::layer::{digest_hex, LayerRole};
use crate::oci::{self, ImageConfig, OciError};

/// A layer Warren pushed: an uncompressed EROFS image file.
pub const MEDIA_WARREN_LAYER: &str = "application/vnd.warren.layer.v1.erofs";
/// The config blob of a Warren-pushed image: each layer's name, version
/// and role.
pub const MEDIA_WARREN_CONFIG: &str = "application/vnd.warren.image.config.v1+json";
/// The `artifactType` of a Warren-pushed image's manifest.
pub const ARTIFACT_WARREN_IMAGE: &str = "application/vnd.warren.image.v1";

/// Manifest types a pull asks for.
const ACCEPTED_MANIFESTS: &[&str] =
    &[oci::MEDIA_OCI_MANIFEST, oci::MEDIA_DOCKER_MANIFEST, oci::MEDIA_OCI_INDEX, oci::MEDIA_DOCKER_LIST];
/// Indexes may nest; real ones go one level deep.
const MAX_INDEX_DEPTH: usize = 4;

/// Why a pull or push failed. Nothing was written to `out_dir`.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference { reference: String, reason: String },
    /// The registry has no such repository, tag, manifest or blob.
    #[error("{reference}: not found in the registry: {message}")]
    NotFound { reference: String, message: String },
    /// The registry wants credentials and none were given.
    #[error("{reference}: the registry requires authentication: {message}")]
    AuthRequired { reference: String, message: String },
    /// The registry refused the credentials given (wrong password, or no
    /// access to this repository).
    #[error("{reference}: the registry refused the credentials for user {username:?}: {message}")]
    AuthFailed { reference: String, username: String, message: String },
    /// The registry could not be reached or answered with an error.
    #[error("{reference}: registry error: {message}")]
    Registry { reference: String, message: String },
    /// The registry refused access; [`pull`] and [`push`] turn this into
    /// [`RegistryError::AuthRequired`] or [`RegistryError::AuthFailed`].
    #[error("{reference}: the registry refused access: {message}")]
    Denied { reference: String, message: String },
    #[error("{what}: digest mismatch: expected {expected}, found {actual}")]
    DigestMismatch { what: String, expected: String, actual: String },
    #[error("{what}: size mismatch: expected {expected} bytes, found {actual}")]
    SizeMismatch { what: String, expected: u64, actual: u64 },
    #[error("{what}: unsupported media type {media_type:?}")]
    UnknownMediaType { what: String, media_type: String },
    /// The registry's answer is readable but does not describe one image.
    #[error("{0}")]
    Invalid(String),
    /// Converting the downloaded image failed.
    #[error(transparent)]
    Import(#[from] OciError),
    #[error("layer {index}: {source}")]
    Layer {
        index: usize,
        #[source]
        source: ErofsError,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("scratch space: {0}")]
    Scratch(#[source] ImageError),
}

/// How to reach the registry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryOptions {
    /// Use plain HTTP for this registry even though it is not on loopback.
    pub insecure: bool,
    /// Anonymous access without.
    pub credentials: Option<RegistryCredentials>,
}

/// A registry username and password. `Debug` shows the username only.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryCredentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryCredentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl RegistryOptions {
    fn auth(&self) -> RegistryAuth {
        match &self.credentials {
            Some(c) => RegistryAuth::Basic(c.username.clone(), c.password.clone()),
            None => RegistryAuth::Anonymous,
        }
    }

    /// A refusal as the caller can act on it: give credentials, or fix them.
    fn classify(&self, e: RegistryError) -> RegistryError {
        match (e, &self.credentials) {
            (RegistryError::Denied { reference, message }, None) => RegistryError::AuthRequired { reference, message },
            (RegistryError::Denied { reference, message }, Some(c)) => {
                RegistryError::AuthFailed { reference, username: c.username.clone(), message }
            }
            (other, _) => other,
        }
    }
}

/// One layer a pull produced, with the role and `name@version` a
/// Warren-pushed image recorded for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledLayer {
    pub built: BuiltLayer,
    pub origin: Option<LayerOrigin>,
}

/// An image pulled into `out_dir`: EROFS layers bottom first, named
/// `<sha256 hex>.erofs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledImage {
    /// `registry/repository@sha256:...` of the manifest pulled.
    pub resolved: String,
    pub layers: Vec<PulledLayer>,
    pub config: ImageConfig,
    /// Whether the image was a Warren artifact (EROFS layers as pushed).
    pub warren_artifact: bool,
}

/// What a Warren-pushed image records for each layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerOrigin {
    pub name: String,
    pub version: String,
    pub role: LayerRole,
}

/// A layer to push: its origin and its whole EROFS file.
#[derive(Debug, Clone)]
pub struct PushLayer {
    pub origin: LayerOrigin,
    pub file: PathBuf,
}

/// What a push stored: the manifest's digest and how many bytes of layer
/// data it sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushedImage {
    pub resolved: String,
    pub manifest_digest: String,
    pub layer_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct WarrenConfig {
    layers: Vec<LayerOrigin>,
    /// The image's own config (environment, working directory, command).
    #[serde(default, skip_serializing_if = "ImageConfig::is_empty")]
    image: ImageConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    platform: Option<Platform>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

/// Enough of a manifest or index to tell which it is.
#[derive(Debug, Deserialize)]
struct AnyManifest {
    #[serde(rename = "schemaVersion", default)]
    schema_version: u32,
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    config: Option<Descriptor>,
    #[serde(default)]
    layers: Option<Vec<Descriptor>>,
}

/// Pulls `reference` into `out_dir` (see the module doc).
pub async fn pull(
    reference: &str,
    options: RegistryOptions,
    out_dir: &Path,
    build: &BuildOptions,
) -> Result<PulledImage, RegistryError> {
    pull_as(reference, &options, out_dir, build).await.map_err(|e| options.classify(e))
}

async fn pull_as(
    reference: &str,
    options: &RegistryOptions,
    out_dir: &Path,
    build: &BuildOptions,
) -> Result<PulledImage, RegistryError> {
    let reference = parse_reference(reference)?;
    let client = client_for(&reference, options, false);
    let auth = options.auth();
    let (manifest_ref, media_type, manifest_bytes, manifest) = resolve_manifest(&client, &reference, &auth).await?;
    let (config_desc, layer_descs) = match (manifest.config, manifest.layers) {
        (Some(c), Some(l)) if !l.is_empty() => (c, l),
        _ => {
            return Err(RegistryError::Invalid(format!(
                "{}: the manifest lists no config or no layers",
                whole(&manifest_ref)
            )))
        }
    };
    let scratch = private_scratch_dir(out_dir, ".pull-").map_err(RegistryError::Scratch)?;
    let layout = scratch.path().join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).map_err(|e| io_err(format!("creating {}", blobs.display()), e))?;
    if config_desc.media_type == MEDIA_WARREN_CONFIG {
        let (layers, config) = pull_warren_layers(&client, &manifest_ref, &config_desc, &layer_descs, &scratch).await?;
        let published = publish(scratch, layers, out_dir)?;
        return Ok(PulledImage { resolved: whole(&manifest_ref), layers: published, config, warren_artifact: true });
    }
    check_image_media_types(&config_desc, &layer_descs)?;
    download(&client, &manifest_ref, &config_desc, "image config", &blobs).await?;
    for (index, desc) in layer_descs.iter().enumerate() {
        download(&client, &manifest_ref, desc, &format!("layer {index}"), &blobs).await?;
    }
    write_layout(&layout, &media_type, &manifest_bytes)?;
    let (out, opts) = (out_dir.to_path_buf(), build.clone());
    let imported = tokio::task::spawn_blocking(move || {
        let imported = oci::import_oci_layout(&layout, None, &out, &opts);
        drop(scratch);
        imported
    })
    .await
    .map_err(|e| io_err("the import task".into(), std::io::Error::other(e.to_string())))??;
    Ok(PulledImage {
        resolved: whole(&manifest_ref),
        layers: imported.layers.into_iter().map(|built| PulledLayer { built, origin: None }).collect(),
        config: imported.config,
        warren_artifact: false,
    })
}

/// Pushes `layers` (bottom first) and the image's `config` as a Warren
/// artifact to `reference`. Each layer file is read whole into memory while
/// it is sent.
pub async fn push(
    reference: &str,
    options: RegistryOptions,
    layers: &[PushLayer],
    image_config: &ImageConfig,
) -> Result<PushedImage, RegistryError> {
    push_as(reference, &options, layers, image_config).await.map_err(|e| options.classify(e))
}

async fn push_as(
    reference: &str,
    options: &RegistryOptions,
    layers: &[PushLayer],
    image_config: &ImageConfig,
) -> Result<PushedImage, RegistryError> {
    let reference = parse_reference(reference)?;
    if reference.digest().is_some() {
        return Err(RegistryError::InvalidReference {
            reference: whole(&reference),
            reason: "push needs a tag, not a digest".into(),
        });
    }
    let client = client_for(&reference, options, true);
    // Blob uploads use whatever the client learnt here: a bearer token for
    // push scope, or the basic credentials.
    client
        .auth(&reference, &options.auth(), oci_client::RegistryOperation::Push)
        .await
        .map_err(|e| registry_err(&reference, e))?;
    let mut descriptors = Vec::with_capacity(layers.len());
    let mut layer_bytes = 0u64;
    for layer in layers {
        let data =
            tokio::fs::read(&layer.file).await.map_err(|e| io_err(format!("reading {}", layer.file.display()), e))?;
        let digest = sha256_digest(&data);
        client.push_blob(&reference, &data, &digest).await.map_err(|e| registry_err(&reference, e))?;
        layer_bytes += data.len() as u64;
        descriptors.push(serde_json::json!({
            "mediaType": MEDIA_WARREN_LAYER,
            "digest": digest,
            "size": data.len(),
            "annotations": {
                "dev.warren.layer.name": layer.origin.name,
                "dev.warren.layer.version": layer.origin.version,
                "dev.warren.layer.role": layer.origin.role,
            },
        }));
    }
    let config =
        WarrenConfig { layers: layers.iter().map(|l| l.origin.clone()).collect(), image: image_config.clone() };
    let config = serde_json::to_vec(&config).map_err(|e| RegistryError::Invalid(e.to_string()))?;
    let config_digest = sha256_digest(&config);
    client.push_blob(&reference, &config, &config_digest).await.map_err(|e| registry_err(&reference, e))?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": oci::MEDIA_OCI_MANIFEST,
        "artifactType": ARTIFACT_WARREN_IMAGE,
        "config": {"mediaType": MEDIA_WARREN_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": descriptors,
    });
    let body = serde_json::to_vec(&manifest).map_err(|e| RegistryError::Invalid(e.to_string()))?;
    let manifest_digest = sha256_digest(&body);
    let content_type = oci::MEDIA_OCI_MANIFEST.parse().map_err(|_| RegistryError::Invalid("media type".into()))?;
    client.push_manifest_raw(&reference, body, content_type).await.map_err(|e| registry_err(&reference, e))?;
    let resolved = whole(&reference.clone_with_digest(manifest_digest.clone()));
    Ok(PushedImage { resolved, manifest_digest, layer_bytes })
}

/// The registry host (`host[:port]`) `reference` names, as credentials are
/// looked up by.
pub fn registry_host(reference: &str) -> Result<String, RegistryError> {
    Ok(parse_reference(reference)?.resolve_registry().to_owned())
}

fn parse_reference(reference: &str) -> Result<Reference, RegistryError> {
    reference
        .parse::<Reference>()
        .map_err(|e| RegistryError::InvalidReference { reference: reference.to_owned(), reason: e.to_string() })
}

/// A client speaking HTTPS, or plain HTTP to a loopback registry or one
/// the caller marked insecure.
fn client_for(reference: &Reference, options: &RegistryOptions, pushing: bool) -> Client {
    Client::new(ClientConfig {
        protocol: protocol_for(reference, options),
        // Chunked uploads are an optional part of the spec some registries
        // get wrong; a layer is in memory anyway.
        use_monolithic_push: pushing,
        ..ClientConfig::default()
    })
}

fn protocol_for(reference: &Reference, options: &RegistryOptions) -> ClientProtocol {
    let registry = reference.resolve_registry().to_owned();
    if options.insecure || is_loopback(&registry) {
        ClientProtocol::HttpsExcept(vec![registry])
    } else {
        ClientProtocol::Https
    }
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The image manifest `reference` names (following indexes), its media
/// type, raw bytes and parsed form; the reference returned pins its digest.
async fn resolve_manifest(
    client: &Client,
    reference: &Reference,
    auth: &RegistryAuth,
) -> Result<(Reference, String, Vec<u8>, AnyManifest), RegistryError> {
    let mut current = reference.clone();
    for _ in 0..MAX_INDEX_DEPTH {
        let (bytes, digest) = client
            .pull_manifest_raw(&current, auth, ACCEPTED_MANIFESTS)
            .await
            .map_err(|e| registry_err(&current, e))?;
        let actual = sha256_digest(&bytes);
        let expected = current.digest().map(str::to_owned).unwrap_or(digest);
        if actual != expected {
            return Err(RegistryError::DigestMismatch {
                what: format!("manifest of {}", whole(&current)),
                expected,
                actual,
            });
        }
        let parsed: AnyManifest = serde_json::from_slice(&bytes)
            .map_err(|e| RegistryError::Invalid(format!("the manifest of {} is not valid: {e}", whole(&current))))?;
        if parsed.schema_version != 2 {
            return Err(RegistryError::Invalid(format!(
                "{}: manifest schema version {} is not supported (only 2)",
                whole(&current),
                parsed.schema_version
            )));
        }
        let media_type = parsed.media_type.clone().unwrap_or_else(|| {
            if parsed.manifests.is_some() { oci::MEDIA_OCI_INDEX } else { oci::MEDIA_OCI_MANIFEST }.to_owned()
        });
        current = current.clone_with_digest(actual);
        match media_type.as_str() {
            oci::MEDIA_OCI_MANIFEST | oci::MEDIA_DOCKER_MANIFEST => return Ok((current, media_type, bytes, parsed)),
            oci::MEDIA_OCI_INDEX | oci::MEDIA_DOCKER_LIST => {
                let entries = parsed.manifests.unwrap_or_default();
                let chosen = choose_platform(&entries)?;
                current = current.clone_with_digest(chosen.digest.clone());
            }
            other => return Err(unknown_media(&format!("manifest of {}", whole(&current)), other)),
        }
    }
    Err(RegistryError::Invalid(format!("{}: image indexes nest too deeply", whole(reference))))
}

fn choose_platform(entries: &[Descriptor]) -> Result<&Descriptor, RegistryError> {
    if let [only] = entries {
        return Ok(only);
    }
    entries
        .iter()
        .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64"))
        .ok_or_else(|| RegistryError::Invalid("the image index has no linux/amd64 image".into()))
}

/// Refuses a config or layer type the OCI importer cannot convert, before
/// anything is downloaded.
fn check_image_media_types(config: &Descriptor, layers: &[Descriptor]) -> Result<(), RegistryError> {
    if ![oci::MEDIA_OCI_CONFIG, oci::MEDIA_DOCKER_CONFIG].contains(&config.media_type.as_str()) {
        return Err(unknown_media("image config", &config.media_type));
    }
    if config.size > oci::MAX_JSON_BYTES {
        return Err(RegistryError::Invalid(format!("the image config claims {} bytes", config.size)));
    }
    for (index, desc) in layers.iter().enumerate() {
        if !oci::LAYER_MEDIA_TYPES.contains(&desc.media_type.as_str()) {
            return Err(unknown_media(&format!("layer {index}"), &desc.media_type));
        }
    }
    Ok(())
}

/// Downloads the layers of a Warren artifact into the scratch dir, each
/// checked to be an EROFS image this crate can serve.
async fn pull_warren_layers(
    client: &Client,
    reference: &Reference,
    config_desc: &Descriptor,
    layer_descs: &[Descriptor],
    scratch: &DirGuard,
) -> Result<(Vec<PulledLayer>, ImageConfig), RegistryError> {
    for (index, desc) in layer_descs.iter().enumerate() {
        if desc.media_type != MEDIA_WARREN_LAYER {
            return Err(unknown_media(&format!("layer {index} of a Warren image"), &desc.media_type));
        }
    }
    if config_desc.size > oci::MAX_JSON_BYTES {
        return Err(RegistryError::Invalid(format!("the image config claims {} bytes", config_desc.size)));
    }
    let config_path = download(client, reference, config_desc, "image config", scratch.path()).await?;
    let bytes = std::fs::read(&config_path).map_err(|e| io_err("reading the image config".into(), e))?;
    let config: WarrenConfig = serde_json::from_slice(&bytes)
        .map_err(|e| RegistryError::Invalid(format!("the Warren image config is not valid: {e}")))?;
    config
        .image
        .validate()
        .map_err(|reason| RegistryError::Invalid(format!("the Warren image config is not valid: {reason}")))?;
    if config.layers.len() != layer_descs.len() {
        return Err(RegistryError::Invalid(format!(
            "the Warren image config describes {} layers, the manifest lists {}",
            config.layers.len(),
            layer_descs.len()
        )));
    }
    let mut layers = Vec::with_capacity(layer_descs.len());
    for (index, (desc, origin)) in layer_descs.iter().zip(config.layers.clone()).enumerate() {
        let path = download(client, reference, desc, &format!("layer {index}"), scratch.path()).await?;
        let check = path.clone();
        let metadata_ranges = tokio::task::spawn_blocking(move || erofs::metadata_ranges(&check))
            .await
            .map_err(|e| io_err("the layer check task".into(), std::io::Error::other(e.to_string())))?
            .map_err(|source| RegistryError::Layer { index, source })?;
        let built = BuiltLayer { path, digest: desc.digest.clone(), size: desc.size, metadata_ranges };
        layers.push(PulledLayer { built, origin: Some(origin) });
    }
    Ok((layers, config.image))
}

/// Streams blob `desc` into `dir/<hex>`, hashing and counting as it goes.
async fn download(
    client: &Client,
    reference: &Reference,
    desc: &Descriptor,
    what: &str,
    dir: &Path,
) -> Result<PathBuf, RegistryError> {
    let hex = digest_hex(&desc.digest)
        .map_err(|_| RegistryError::Invalid(format!("{what}: invalid digest {:?}", desc.digest)))?;
    let path = dir.join(hex);
    if path.exists() {
        // The same blob twice in one image (an empty layer, say).
        return Ok(path);
    }
    let oci_desc = OciDescriptor {
        media_type: desc.media_type.clone(),
        digest: desc.digest.clone(),
        size: i64::try_from(desc.size).unwrap_or(i64::MAX),
        ..OciDescriptor::default()
    };
    let partial = dir.join(format!(".{hex}.partial"));
    let mut file =
        tokio::fs::File::create(&partial).await.map_err(|e| io_err(format!("creating {}", partial.display()), e))?;
    let mut stream = client.pull_blob_stream(reference, &oci_desc).await.map_err(|e| registry_err(reference, e))?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut failure = None;
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(bytes) => {
                size += bytes.len() as u64;
                if size > desc.size {
                    return Err(RegistryError::SizeMismatch {
                        what: what.to_owned(),
                        expected: desc.size,
                        actual: size,
                    });
                }
                hasher.update(&bytes);
                file.write_all(&bytes).await.map_err(|e| io_err(format!("writing {}", partial.display()), e))?;
            }
            // oci-client's own digest check fails the stream's end; our
            // count and hash say what went wrong.
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let actual = format!("sha256:{}", erofs::hex(&hasher.finalize()));
    if size == desc.size && actual != desc.digest {
        return Err(RegistryError::DigestMismatch { what: what.to_owned(), expected: desc.digest.clone(), actual });
    }
    if let Some(e) = failure {
        return Err(RegistryError::Registry {
            reference: whole(reference),
            message: format!("downloading {what}: {e}"),
        });
    }
    if size != desc.size {
        return Err(RegistryError::SizeMismatch { what: what.to_owned(), expected: desc.size, actual: size });
    }
    file.sync_all().await.map_err(|e| io_err(format!("writing {}", partial.display()), e))?;
    drop(file);
    std::fs::rename(&partial, &path).map_err(|e| io_err(format!("publishing {}", path.display()), e))?;
    Ok(path)
}

/// Completes the OCI layout around the downloaded blobs: the manifest blob,
/// `index.json` pointing at it, and `oci-layout`.
fn write_layout(layout: &Path, media_type: &str, manifest: &[u8]) -> Result<(), RegistryError> {
    let digest = sha256_digest(manifest);
    let hex = &digest["sha256:".len()..];
    let write = |rel: &str, bytes: &[u8]| {
        std::fs::write(layout.join(rel), bytes).map_err(|e| io_err(format!("writing {rel} of the pulled layout"), e))
    };
    write(&format!("blobs/sha256/{hex}"), manifest)?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": oci::MEDIA_OCI_INDEX,
        "manifests": [{"mediaType": media_type, "digest": digest, "size": manifest.len()}],
    });
    write("index.json", index.to_string().as_bytes())?;
    write("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)
}

/// Moves the downloaded Warren layers into `out_dir` under content names.
fn publish(scratch: DirGuard, layers: Vec<PulledLayer>, out_dir: &Path) -> Result<Vec<PulledLayer>, RegistryError> {
    let mut published = Vec::with_capacity(layers.len());
    for layer in layers {
        let hex = layer.built.digest.trim_start_matches("sha256:");
        let dest = out_dir.join(format!("{hex}.erofs"));
        // An image may list one layer twice; its file moved the first time.
        if !dest.exists() {
            std::fs::rename(&layer.built.path, &dest)
                .map_err(|e| io_err(format!("publishing {}", dest.display()), e))?;
        }
        published.push(PulledLayer { built: BuiltLayer { path: dest, ..layer.built }, origin: layer.origin });
    }
    fsync_dir(out_dir).map_err(RegistryError::Scratch)?;
    drop(scratch);
    Ok(published)
}

fn registry_err(reference: &Reference, e: OciDistributionError) -> RegistryError {
    let reference = whole(reference);
    match e {
        OciDistributionError::RegistryError { envelope, .. } => {
            let message = envelope.to_string();
            let not_found = envelope.errors.iter().any(|e| {
                matches!(
                    e.code,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            });
            let denied =
                envelope.errors.iter().any(|e| matches!(e.code, OciErrorCode::Unauthorized | OciErrorCode::Denied));
            if not_found {
                RegistryError::NotFound { reference, message }
            } else if denied {
                RegistryError::Denied { reference, message }
            } else {
                RegistryError::Registry { reference, message }
            }
        }
        OciDistributionError::ImageManifestNotFoundError(message) => RegistryError::NotFound { reference, message },
        OciDistributionError::ServerError { code: 404, message, .. } => RegistryError::NotFound { reference, message },
        OciDistributionError::ServerError { code: 401 | 403, message, .. } => {
            RegistryError::Denied { reference, message }
        }
        OciDistributionError::UnauthorizedError { url } | OciDistributionError::AuthenticationFailure(url) => {
            RegistryError::Denied { reference, message: url }
        }
        OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError { expected, actual }) => {
            RegistryError::DigestMismatch { what: reference, expected, actual }
        }
        other => RegistryError::Registry { reference, message: error_chain(&other) },
    }
}

/// An error with its sources: reqwest's top-level message alone ("error
/// sending request") does not say that the connection was refused.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

fn whole(reference: &Reference) -> String {
    reference.whole()
}

fn unknown_media(what: &str, media_type: &str) -> RegistryError {
    RegistryError::UnknownMediaType { what: what.to_owned(), media_type: media_type.to_owned() }
}

fn io_err(context: String, source: std::io::Error) -> RegistryError {
    RegistryError::Io { context, source }
}

fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", erofs::hex(&Sha256::digest(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_registries_are_recognised_with_and_without_ports() {
        for yes in ["127.0.0.1:5000", "127.3.2.1", "localhost:5000", "localhost", "[::1]:5000"] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in ["docker.io", "10.0.0.1:5000", "registry.example:443", "[2001:db8::1]:5000"] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    #[test]
    fn a_remote_registry_is_https_unless_marked_insecure() {
        let remote: Reference = "registry.example/app:v1".parse().unwrap();
        let local: Reference = "127.0.0.1:5000/app:v1".parse().unwrap();
        let scheme = |r: &Reference, insecure| matches!(protocol_for(r, &RegistryOptions { insecure, credentials: None }), ClientProtocol::HttpsExcept(list) if list == [r.resolve_registry()]);
        assert!(!scheme(&remote, false));
        assert!(scheme(&remote, true));
        assert!(scheme(&local, false));
    }

    #[test]
    fn credentials_never_show_their_password() {
        let credentials = RegistryCredentials { username: "ci".into(), password: "hunter2-secret".into() };
        let options = RegistryOptions { insecure: false, credentials: Some(credentials) };
        assert!(!format!("{options:?}").contains("hunter2"), "{options:?}");
        let denied = RegistryError::Denied { reference: "r/x:1".into(), message: "unauthorized".into() };
        let failed = options.classify(denied);
        assert!(matches!(failed, RegistryError::AuthFailed { .. }), "{failed:?}");
        assert!(!failed.to_string().contains("hunter2"), "{failed}");
        let denied = RegistryError::Denied { reference: "r/x:1".into(), message: "unauthorized".into() };
        assert!(matches!(RegistryOptions::default().classify(denied), RegistryError::AuthRequired { .. }));
    }

    #[test]
    fn an_index_without_linux_amd64_is_refused() {
        let d = |arch: &str| Descriptor {
            media_type: oci::MEDIA_OCI_MANIFEST.into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 1,
            platform: Some(Platform { architecture: arch.into(), os: "linux".into() }),
        };
        assert!(choose_platform(&[d("arm64"), d("s390x")]).is_err());
        assert_eq!(
            choose_platform(&[d("arm64"), d("amd64")]).unwrap().platform.as_ref().unwrap().architecture,
            "amd64"
        );
    }

    #[test]
    fn unknown_layer_media_types_are_refused_before_download() {
        let config = Descriptor {
            media_type: oci::MEDIA_OCI_CONFIG.into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 2,
            platform: None,
        };
        let layer = Descriptor { media_type: "application/x-mystery".into(), ..config.clone() };
        assert!(matches!(check_image_media_types(&config, &[layer]), Err(RegistryError::UnknownMediaType { .. })));
    }
}

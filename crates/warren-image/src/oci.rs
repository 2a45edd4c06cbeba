//! Importers for OCI images: an OCI image layout directory and a
//! `docker save` tarball (legacy, or the OCI layout Docker 25+ writes inside
//! it). Each OCI layer becomes one EROFS layer with its whiteouts in
//! overlayfs form; the config's Env, Cmd, Entrypoint, WorkingDir and User
//! come back with them.
//!
//! Invariants: every blob is checked against its digest (and size, where the
//! descriptor gives one) before it is used; unknown media types are refused,
//! never guessed at; an import writes its layer files into `out_dir` only
//! after every layer built, so a failed import leaves nothing behind.
//! Files are opened beneath the layout root (`openat2` with
//! `RESOLVE_BENEATH`), so paths in a manifest or symlinks in an archive
//! cannot make the importer read outside it.

mod diff;
pub(crate) mod whiteout;

pub use diff::unpack_sandbox_diff;

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Read, Seek};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags, ResolveFlags};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::erofs::{self, BuildOptions, BuiltLayer, ErofsError};
use crate::error::ImageError;
use crate::fsutil::{fsync_dir, private_scratch_dir, DirGuard};

pub(crate) const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub(crate) const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub(crate) const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub(crate) const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub(crate) const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub(crate) const MEDIA_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// Layer media types: tar, optionally gzip or zstd compressed (the importer
/// sniffs which from the bytes; the type only has to be one of these).
pub(crate) const LAYER_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];
const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";
const CONTAINERD_NAME_ANNOTATION: &str = "io.containerd.image.name";
/// Manifests, indexes and configs are small; a larger "JSON" blob is hostile.
pub(crate) const MAX_JSON_BYTES: u64 = 16 << 20;
/// Indexes may nest; real ones go one level deep.
const MAX_INDEX_DEPTH: usize = 4;

/// Why an import failed. Nothing was written to `out_dir`.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("{what} is not valid: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what}: digest mismatch: expected {expected}, found {actual}")]
    DigestMismatch { what: String, expected: String, actual: String },
    #[error("{what}: size mismatch: expected {expected} bytes, found {actual}")]
    SizeMismatch { what: String, expected: u64, actual: u64 },
    #[error("{what}: unsupported media type {media_type:?}")]
    UnknownMediaType { what: String, media_type: String },
    #[error("unsupported or malformed digest {0:?} (only sha256:<64 hex> is accepted)")]
    InvalidDigest(String),
    /// The input is readable but does not describe one image.
    #[error("{0}")]
    Invalid(String),
    #[error("path {0:?} in the image leaves the image's root")]
    UnsafePath(String),
    /// The `docker save` archive is damaged or truncated.
    #[error("reading the archive: {0}")]
    Archive(#[source] ImageError),
    #[error("layer {index} ({digest}): {source}")]
    Layer {
        index: usize,
        digest: String,
        #[source]
        source: ErofsError,
    },
    #[error("scratch space: {0}")]
    Scratch(#[source] ImageError),
}

/// The parts of an image config a sandbox needs. Kept with the image's
/// manifest; the node applies `env` and `working_dir` to every exec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    /// `NAME=value` entries, in the image's order (a later one wins).
    pub env: Vec<String>,
    pub cmd: Vec<String>,
    pub entrypoint: Vec<String>,
    /// Absolute path.
    pub working_dir: Option<String>,
    pub user: Option<String>,
}

impl ImageConfig {
    pub fn is_empty(&self) -> bool {
        self == &ImageConfig::default()
    }

    /// Refuses what could not be applied to a process: an `Env` entry that
    /// is not `NAME=value` (name non-empty) or holds NUL, a relative or
    /// NUL-holding `WorkingDir`, NUL in `Cmd`, `Entrypoint` or `User`.
    pub fn validate(&self) -> Result<(), String> {
        for entry in &self.env {
            match entry.split_once('=') {
                Some((name, _)) if !name.is_empty() && !entry.contains('\0') => {}
                _ => return Err(format!("Env entry {entry:?} is not NAME=value")),
            }
        }
        if let Some(dir) = &self.working_dir {
            if !dir.starts_with('/') || dir.contains('\0') {
                return Err(format!("WorkingDir {dir:?} is not an absolute path"));
            }
        }
        let words = self.cmd.iter().chain(&self.entrypoint).chain(&self.user);
        if words.into_iter().any(|w| w.contains('\0')) {
            return Err("Cmd, Entrypoint and User must not contain NUL".to_owned());
        }
        Ok(())
    }

    /// `env` as name -> value, a later entry overriding an earlier one.
    pub fn env_map(&self) -> std::collections::BTreeMap<String, String> {
        self.env.iter().filter_map(|e| e.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }
}

/// An imported image: EROFS layers in `out_dir`, bottom first, and its
/// config. Layer files are named `<sha256 hex>.erofs`, so identical layers
/// share one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedImage {
    pub layers: Vec<BuiltLayer>,
    pub config: ImageConfig,
}

/// Imports from the OCI image layout at `layout`. `reference` picks an image
/// by its `org.opencontainers.image.ref.name` annotation (a full name or
/// just the tag); without it the layout must hold exactly one image.
pub fn import_oci_layout(
    layout: &Path,
    reference: Option<&str>,
    out_dir: &Path,
    opts: &BuildOptions,
) -> Result<ImportedImage, OciError> {
    let root = Root::open(layout)?;
    let scratch = Scratch::new(out_dir)?;
    let image = read_layout_image(&root, reference)?;
    let built = build_layers(&root, &image.layers, &scratch, opts)?;
    publish(scratch, built, image.config, out_dir)
}

/// Imports from a `docker save` tarball (plain or compressed). `reference`
/// picks an image by one of its `RepoTags` (`name:tag`); without it the
/// archive must hold exactly one image.
pub fn import_docker_save(
    archive: impl Read,
    reference: Option<&str>,
    out_dir: &Path,
    opts: &BuildOptions,
) -> Result<ImportedImage, OciError> {
    let scratch = Scratch::new(out_dir)?;
    let tree = scratch.dir().join("archive");
    std::fs::create_dir(&tree)
        .map_err(|source| OciError::Io { context: format!("creating {}", tree.display()), source })?;
    crate::tar::extract(archive, &tree).map_err(OciError::Archive)?;
    let root = Root::open(&tree)?;
    let image = match root.open_optional("manifest.json")? {
        Some(file) => read_docker_image(&root, file, reference)?,
        // Some tools write only the OCI layout into the tarball.
        None => read_layout_image(&root, reference)?,
    };
    let built = build_layers(&root, &image.layers, &scratch, opts)?;
    publish(scratch, built, image.config, out_dir)
}

/// A layer blob found and the digests it must have.
struct LayerSource {
    /// Where the blob is, relative to the root.
    path: String,
    /// Digest and size of the blob as stored, when known.
    blob_digest: Option<String>,
    blob_size: Option<u64>,
    /// The config's `diff_id`: the digest of the uncompressed tar.
    diff_id: Option<String>,
}

impl LayerSource {
    fn label(&self) -> String {
        self.blob_digest.clone().or_else(|| self.diff_id.clone()).unwrap_or_else(|| self.path.clone())
    }
}

struct ResolvedImage {
    layers: Vec<LayerSource>,
    config: ImageConfig,
}

#[derive(Debug, Clone, Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    size: u64,
    #[serde(default)]
    annotations: HashMap<String, String>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Debug, Clone, Deserialize)]
struct Platform {
    architecture: String,
    os: String,
}

#[derive(Debug, Deserialize)]
struct Index {
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    manifests: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct Manifest {
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    config: Descriptor,
    layers: Vec<Descriptor>,
}

#[derive(Debug, Deserialize)]
struct LayoutVersion {
    #[serde(rename = "imageLayoutVersion")]
    image_layout_version: String,
}

#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    env: Option<Vec<String>>,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    working_dir: Option<String>,
    user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct DockerManifestEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

fn read_layout_image(root: &Root, reference: Option<&str>) -> Result<ResolvedImage, OciError> {
    let version: LayoutVersion = parse_json("oci-layout", &root.read_small("oci-layout")?)?;
    if version.image_layout_version != "1.0.0" {
        return Err(OciError::Invalid(format!("unsupported OCI layout version {}", version.image_layout_version)));
    }
    let index: Index = parse_json("index.json", &root.read_small("index.json")?)?;
    let chosen = choose_by_reference(&index.manifests, reference)?;
    let manifest_desc = resolve_to_manifest(root, chosen.clone())?;
    let manifest: Manifest = parse_json("image manifest", &read_blob(root, &manifest_desc, "image manifest")?)?;
    if let Some(mt) = manifest.media_type.as_deref().filter(|mt| *mt != manifest_desc.media_type) {
        return Err(OciError::Invalid(format!(
            "manifest says media type {mt}, its descriptor {}",
            manifest_desc.media_type
        )));
    }
    if ![MEDIA_OCI_CONFIG, MEDIA_DOCKER_CONFIG].contains(&manifest.config.media_type.as_str()) {
        return Err(unknown_media("image config", &manifest.config.media_type));
    }
    let config: ConfigFile = parse_json("image config", &read_blob(root, &manifest.config, "image config")?)?;
    let diff_ids = config.rootfs.as_ref().map(|r| r.diff_ids.clone()).unwrap_or_default();
    let mut layers = Vec::with_capacity(manifest.layers.len());
    for (index, desc) in manifest.layers.iter().enumerate() {
        if !LAYER_MEDIA_TYPES.contains(&desc.media_type.as_str()) {
            return Err(unknown_media(&format!("layer {index}"), &desc.media_type));
        }
        layers.push(LayerSource {
            path: blob_path(&desc.digest)?,
            blob_digest: Some(desc.digest.clone()),
            blob_size: Some(desc.size),
            diff_id: diff_ids.get(index).cloned(),
        });
    }
    Ok(ResolvedImage { layers, config: image_config(config)? })
}

/// Follows image indexes down to one image manifest, picking linux/amd64
/// where an index offers several platforms.
fn resolve_to_manifest(root: &Root, mut desc: Descriptor) -> Result<Descriptor, OciError> {
    for _ in 0..MAX_INDEX_DEPTH {
        match desc.media_type.as_str() {
            MEDIA_OCI_MANIFEST | MEDIA_DOCKER_MANIFEST => return Ok(desc),
            MEDIA_OCI_INDEX | MEDIA_DOCKER_LIST => {
                let nested: Index = parse_json("image index", &read_blob(root, &desc, "image index")?)?;
                if let Some(mt) = nested.media_type.as_deref().filter(|mt| *mt != desc.media_type) {
                    return Err(OciError::Invalid(format!(
                        "index says media type {mt}, its descriptor {}",
                        desc.media_type
                    )));
                }
                desc = choose_platform(&nested.manifests)?.clone();
            }
            other => return Err(unknown_media("index entry", other)),
        }
    }
    Err(OciError::Invalid("image indexes nest too deeply".into()))
}

/// The top-level entry `reference` names, or the only one.
fn choose_by_reference<'a>(entries: &'a [Descriptor], reference: Option<&str>) -> Result<&'a Descriptor, OciError> {
    let names = |d: &Descriptor| -> Vec<String> {
        [REF_NAME_ANNOTATION, CONTAINERD_NAME_ANNOTATION]
            .iter()
            .filter_map(|k| d.annotations.get(*k).cloned())
            .collect()
    };
    match reference {
        Some(wanted) => {
            let matches = |name: &String| name == wanted || name.rsplit_once(':').is_some_and(|(_, tag)| tag == wanted);
            entries.iter().find(|d| names(d).iter().any(matches)).ok_or_else(|| {
                let known: Vec<String> = entries.iter().flat_map(names).collect();
                OciError::Invalid(format!("no image named {wanted:?} in the layout (it has {known:?})"))
            })
        }
        None => match entries {
            [only] => Ok(only),
            [] => Err(OciError::Invalid("the layout holds no image".into())),
            _ => {
                let known: Vec<String> = entries.iter().flat_map(names).collect();
                Err(OciError::Invalid(format!("the layout holds {} images {known:?}: name one", entries.len())))
            }
        },
    }
}

fn choose_platform(entries: &[Descriptor]) -> Result<&Descriptor, OciError> {
    if let [only] = entries {
        return Ok(only);
    }
    entries
        .iter()
        .find(|d| d.platform.as_ref().is_some_and(|p| p.os == "linux" && p.architecture == "amd64"))
        .ok_or_else(|| OciError::Invalid("the image index has no linux/amd64 image".into()))
}

fn read_docker_image(root: &Root, manifest: File, reference: Option<&str>) -> Result<ResolvedImage, OciError> {
    let entries: Vec<DockerManifestEntry> = parse_json("manifest.json", &read_limited(manifest, "manifest.json")?)?;
    let entry = choose_docker_entry(&entries, reference)?;
    let config_bytes = root.read_small(&entry.config)?;
    if let Some(expected) = digest_from_path(&entry.config) {
        check_digest(&format!("config {}", entry.config), &expected, &sha256_of(&config_bytes), None, None)?;
    }
    let config: ConfigFile = parse_json("image config", &config_bytes)?;
    let diff_ids = config.rootfs.as_ref().map(|r| r.diff_ids.clone()).unwrap_or_default();
    if diff_ids.len() != entry.layers.len() {
        return Err(OciError::Invalid(format!(
            "the config lists {} layer digests for {} layers",
            diff_ids.len(),
            entry.layers.len()
        )));
    }
    let layers = entry
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(path, diff_id)| LayerSource {
            path: path.clone(),
            blob_digest: digest_from_path(path),
            blob_size: None,
            diff_id: Some(diff_id),
        })
        .collect();
    Ok(ResolvedImage { layers, config: image_config(config)? })
}

fn choose_docker_entry<'a>(
    entries: &'a [DockerManifestEntry],
    reference: Option<&str>,
) -> Result<&'a DockerManifestEntry, OciError> {
    let tags = |e: &DockerManifestEntry| e.repo_tags.clone().unwrap_or_default();
    match (reference, entries) {
        (Some(wanted), _) => entries.iter().find(|e| tags(e).iter().any(|t| t == wanted)).ok_or_else(|| {
            let known: Vec<String> = entries.iter().flat_map(tags).collect();
            OciError::Invalid(format!("no image tagged {wanted:?} in the archive (it has {known:?})"))
        }),
        (None, [only]) => Ok(only),
        (None, []) => Err(OciError::Invalid("the archive holds no image".into())),
        (None, _) => {
            let known: Vec<String> = entries.iter().flat_map(tags).collect();
            Err(OciError::Invalid(format!("the archive holds {} images {known:?}: name one", entries.len())))
        }
    }
}

fn image_config(file: ConfigFile) -> Result<ImageConfig, OciError> {
    let c = file.config.unwrap_or_default();
    let config = ImageConfig {
        env: c.env.unwrap_or_default(),
        cmd: c.cmd.unwrap_or_default(),
        entrypoint: c.entrypoint.unwrap_or_default(),
        working_dir: c.working_dir.filter(|w| !w.is_empty()),
        user: c.user.filter(|u| !u.is_empty()),
    };
    config.validate().map_err(|reason| OciError::Invalid(format!("the image config: {reason}")))?;
    Ok(config)
}

/// Verifies and converts every layer into the scratch directory.
fn build_layers(
    root: &Root,
    layers: &[LayerSource],
    scratch: &Scratch,
    opts: &BuildOptions,
) -> Result<Vec<BuiltLayer>, OciError> {
    let mut built = Vec::with_capacity(layers.len());
    for (index, source) in layers.iter().enumerate() {
        let mut file = open_verified_layer(root, source, index)?;
        // Layers of one image should not share a UUID (overlayfs features
        // such as `index=on` need them distinct), and the source digest
        // keeps it reproducible.
        let uuid_seed = source.diff_id.clone().unwrap_or_else(|| source.label());
        let layer_opts = BuildOptions { uuid: uuid_from(&uuid_seed), ..opts.clone() };
        let dest = scratch.dir().join(format!("{index}.erofs"));
        file.rewind().map_err(|e| io_err(format!("rewinding layer {index}"), e))?;
        let layer = erofs::build_from_oci_layer(file, &dest, &layer_opts).map_err(|source_err| OciError::Layer {
            index,
            digest: source.label(),
            source: source_err,
        })?;
        built.push(layer);
    }
    Ok(built)
}

/// Opens a layer blob and checks it against every digest known for it.
/// A compressed blob known only by its uncompressed `diff_id` cannot be
/// checked without unpacking it twice, so it is refused.
fn open_verified_layer(root: &Root, source: &LayerSource, index: usize) -> Result<File, OciError> {
    let what = format!("layer {index} ({})", source.path);
    let mut file = root.open_file(&source.path)?;
    let (digest, size, compressed) = hash_file(&mut file).map_err(|e| io_err(format!("reading {what}"), e))?;
    let mut verified = false;
    if let Some(expected) = &source.blob_digest {
        check_digest(&what, expected, &digest, source.blob_size, Some(size))?;
        verified = true;
    }
    if let Some(diff_id) = source.diff_id.as_ref().filter(|_| !compressed) {
        check_digest(&what, diff_id, &digest, None, None)?;
        verified = true;
    }
    if !verified {
        return Err(OciError::Invalid(format!("{what}: compressed layer with no digest to check it against")));
    }
    Ok(file)
}

fn check_digest(
    what: &str,
    expected: &str,
    actual: &str,
    expected_size: Option<u64>,
    actual_size: Option<u64>,
) -> Result<(), OciError> {
    blob_hex(expected)?;
    if let (Some(e), Some(a)) = (expected_size, actual_size) {
        if e != a {
            return Err(OciError::SizeMismatch { what: what.to_owned(), expected: e, actual: a });
        }
    }
    if expected != actual {
        return Err(OciError::DigestMismatch {
            what: what.to_owned(),
            expected: expected.to_owned(),
            actual: actual.to_owned(),
        });
    }
    Ok(())
}

/// Moves the built layers into `out_dir` under content names.
fn publish(
    scratch: Scratch,
    built: Vec<BuiltLayer>,
    config: ImageConfig,
    out_dir: &Path,
) -> Result<ImportedImage, OciError> {
    let mut layers = Vec::with_capacity(built.len());
    for layer in built {
        let hex = layer.digest.trim_start_matches("sha256:");
        let dest = out_dir.join(format!("{hex}.erofs"));
        std::fs::rename(&layer.path, &dest).map_err(|e| io_err(format!("publishing {}", dest.display()), e))?;
        layers.push(BuiltLayer { path: dest, ..layer });
    }
    fsync_dir(out_dir).map_err(OciError::Scratch)?;
    drop(scratch);
    Ok(ImportedImage { layers, config })
}

/// Reads and checks a JSON blob named by a descriptor.
fn read_blob(root: &Root, desc: &Descriptor, what: &str) -> Result<Vec<u8>, OciError> {
    if desc.size > MAX_JSON_BYTES {
        return Err(OciError::Invalid(format!("{what} claims {} bytes", desc.size)));
    }
    let bytes = root.read_small(&blob_path(&desc.digest)?)?;
    check_digest(what, &desc.digest, &sha256_of(&bytes), Some(desc.size), Some(bytes.len() as u64))?;
    Ok(bytes)
}

fn blob_path(digest: &str) -> Result<String, OciError> {
    Ok(format!("blobs/sha256/{}", blob_hex(digest)?))
}

fn blob_hex(digest: &str) -> Result<&str, OciError> {
    digest
        .strip_prefix("sha256:")
        .filter(|hex| hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
        .ok_or_else(|| OciError::InvalidDigest(digest.to_owned()))
}

/// `blobs/sha256/<hex>` and legacy `<hex>.json` name their own digest.
fn digest_from_path(path: &str) -> Option<String> {
    let name = path.rsplit('/').next()?;
    let hex = name.strip_suffix(".json").unwrap_or(name);
    let digest = format!("sha256:{hex}");
    blob_hex(&digest).is_ok().then_some(digest)
}

fn uuid_from(seed: &str) -> [u8; 16] {
    let hash = Sha256::digest(seed.as_bytes());
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&hash[..16]);
    // RFC 9562 version 8 (custom), variant 10.
    uuid[6] = (uuid[6] & 0x0f) | 0x80;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    uuid
}

fn sha256_of(bytes: &[u8]) -> String {
    format!("sha256:{}", erofs::hex(&Sha256::digest(bytes)))
}

/// Digest and size of a whole file, and whether it starts like gzip, zstd
/// or xz.
fn hash_file(file: &mut File) -> io::Result<(String, u64, bool)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    let mut head = Vec::with_capacity(6);
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if head.len() < 6 {
            head.extend_from_slice(&buf[..n.min(6 - head.len())]);
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    let compressed = head.starts_with(&[0x1f, 0x8b])
        || head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd])
        || head.starts_with(b"\xfd7zXZ\x00");
    Ok((format!("sha256:{}", erofs::hex(&hasher.finalize())), size, compressed))
}

fn parse_json<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, OciError> {
    serde_json::from_slice(bytes).map_err(|source| OciError::Json { what: what.to_owned(), source })
}

fn read_limited(file: File, what: &str) -> Result<Vec<u8>, OciError> {
    let mut bytes = Vec::new();
    file.take(MAX_JSON_BYTES + 1).read_to_end(&mut bytes).map_err(|e| io_err(format!("reading {what}"), e))?;
    if bytes.len() as u64 > MAX_JSON_BYTES {
        return Err(OciError::Invalid(format!("{what} is larger than {MAX_JSON_BYTES} bytes")));
    }
    Ok(bytes)
}

fn unknown_media(what: &str, media_type: &str) -> OciError {
    OciError::UnknownMediaType { what: what.to_owned(), media_type: media_type.to_owned() }
}

fn io_err(context: String, source: io::Error) -> OciError {
    OciError::Io { context, source }
}

/// The directory an image is read from. Every open resolves beneath it.
struct Root {
    fd: OwnedFd,
    path: PathBuf,
}

impl Root {
    fn open(path: &Path) -> Result<Self, OciError> {
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let fd = rustix::fs::open(path, flags, Mode::empty())
            .map_err(|e| io_err(format!("opening {}", path.display()), e.into()))?;
        Ok(Self { fd, path: path.to_owned() })
    }

    fn open_file(&self, rel: &str) -> Result<File, OciError> {
        self.open_optional(rel)?
            .ok_or_else(|| OciError::Invalid(format!("{rel} is missing from {}", self.path.display())))
    }

    /// Opens `rel` if it exists and is a regular file. It is probed with
    /// `O_PATH` first, so a device node or FIFO planted in an archive is
    /// refused without being opened.
    fn open_optional(&self, rel: &str) -> Result<Option<File>, OciError> {
        let Some(probe) = self.open_beneath(rel, OFlags::PATH)? else {
            return Ok(None);
        };
        let stat = rustix::fs::fstat(&probe).map_err(|e| io_err(format!("reading {rel}"), e.into()))?;
        if rustix::fs::FileType::from_raw_mode(stat.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(OciError::Invalid(format!("{rel} is not a regular file")));
        }
        let fd = self.open_beneath(rel, OFlags::RDONLY)?.ok_or_else(|| OciError::Invalid(format!("{rel} vanished")))?;
        let again = rustix::fs::fstat(&fd).map_err(|e| io_err(format!("reading {rel}"), e.into()))?;
        if (again.st_dev, again.st_ino) != (stat.st_dev, stat.st_ino) {
            return Err(OciError::Invalid(format!("{rel} changed while it was opened")));
        }
        Ok(Some(File::from(fd)))
    }

    fn open_beneath(&self, rel: &str, flags: OFlags) -> Result<Option<OwnedFd>, OciError> {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(&self.fd, rel, flags | OFlags::CLOEXEC, Mode::empty(), resolve) {
            Ok(fd) => Ok(Some(fd)),
            Err(rustix::io::Errno::NOENT) => Ok(None),
            Err(rustix::io::Errno::XDEV) => Err(OciError::UnsafePath(rel.to_owned())),
            Err(e) => Err(io_err(format!("opening {rel} in {}", self.path.display()), e.into())),
        }
    }

    fn read_small(&self, rel: &str) -> Result<Vec<u8>, OciError> {
        read_limited(self.open_file(rel)?, rel)
    }
}

/// The import's private work directory inside `out_dir`, removed with all
/// it holds when dropped.
struct Scratch(DirGuard);

impl Scratch {
    fn new(out_dir: &Path) -> Result<Self, OciError> {
        private_scratch_dir(out_dir, ".import-").map(Self).map_err(OciError::Scratch)
    }

    fn dir(&self) -> &Path {
        self.0.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_read_from_blob_and_legacy_config_names() {
        let hex = "a".repeat(64);
        assert_eq!(digest_from_path(&format!("blobs/sha256/{hex}")), Some(format!("sha256:{hex}")));
        assert_eq!(digest_from_path(&format!("{hex}.json")), Some(format!("sha256:{hex}")));
        assert_eq!(digest_from_path("abc/layer.tar"), None);
    }

    #[test]
    fn only_sha256_digests_with_64_lowercase_hex_are_accepted() {
        assert!(blob_hex(&format!("sha256:{}", "0".repeat(64))).is_ok());
        for bad in ["sha512:00", "sha256:../../etc", &format!("sha256:{}", "A".repeat(64))] {
            assert!(matches!(blob_hex(bad), Err(OciError::InvalidDigest(_))), "{bad}");
        }
    }

    #[test]
    fn derived_uuids_differ_per_layer_and_carry_version_8() {
        let a = uuid_from("sha256:a");
        assert_ne!(a, uuid_from("sha256:b"));
        assert_eq!(a[6] >> 4, 8);
        assert_eq!(a[8] >> 6, 0b10);
    }
}

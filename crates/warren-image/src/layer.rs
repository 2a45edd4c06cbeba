//! Layer and image manifests: what the blob store keeps about each EROFS
//! layer (`name@version`) and each image (`name:tag`, an ordered list of
//! layers, base at the bottom).
//!
//! Invariants: a manifest that passes [`LayerManifest::validate`] describes
//! a chunk list that tiles the layer exactly (and, if it has pieces, a
//! piece list that does too, each piece inside one chunk) and a metadata
//! map inside it, and every name in it is safe as an object-store path
//! segment. A layer is only ever reached from an image through
//! [`ImageManifest::check_layer`], which refuses a layer manifest whose
//! digest is not the one the image names. Composing an image copies no
//! layer data.

use serde::{Deserialize, Serialize};

pub use crate::oci::ImageConfig;

/// Smallest and largest chunk the store accepts; chunks are powers of two
/// and at least one EROFS block, so chunk boundaries fall on block
/// boundaries.
pub const MIN_CHUNK_SIZE: u64 = 4096;
pub const MAX_CHUNK_SIZE: u64 = 64 << 20;

/// What a layer is for in an image stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerRole {
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

/// One immutable EROFS layer as stored: the file's digest and size, the
/// digests of its fixed-size chunks in order, and its metadata map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerManifest {
    pub name: String,
    pub version: String,
    pub role: LayerRole,
    /// `sha256:<hex>` of the whole EROFS file.
    pub digest: String,
    /// Bytes in the EROFS file.
    pub size: u64,
    /// Bytes in every chunk but the last.
    pub chunk_size: u64,
    /// `sha256:<hex>` of each chunk, in file order.
    pub chunks: Vec<String>,
    /// `(offset, len)` in bytes of every range that is not regular-file
    /// data, sorted: what a node must hold before mounting the layer.
    pub metadata_ranges: Vec<(u64, u64)>,
    /// The blob holding the pages of `metadata_ranges` (see
    /// [`crate::metablob`]), which a node fetches instead of every chunk
    /// those ranges touch. Absent in manifests written before it existed;
    /// a node then prefills whole chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata_blob: Option<MetadataBlobRef>,
    /// Bytes in every piece but the last: the unit a node fetches (a
    /// ranged GET of the chunk holding it) and verifies, so a read miss
    /// costs pieces, not a whole chunk. A power of two that divides the
    /// chunk size, so pieces tile the file like the chunks do. Absent in
    /// manifests written before pieces existed; a node then fetches whole
    /// chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub piece_size: Option<u64>,
    /// `sha256:<hex>` of each piece, in file order (piece `i` is the bytes
    /// at `i * piece_size`); empty without `piece_size`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pieces: Vec<String>,
}

/// Where a layer's metadata blob is and what it must hash to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetadataBlobRef {
    /// `sha256:<hex>` of the blob.
    pub digest: String,
    /// Bytes in the blob (range table included).
    pub size: u64,
    /// How the blob is stored, if not as is: compressed, under the digest
    /// of the stored bytes. Absent in manifests written before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored: Option<StoredBlob>,
}

/// A metadata blob stored compressed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlob {
    pub encoding: BlobEncoding,
    /// `sha256:<hex>` of the stored (compressed) bytes: the object's key.
    pub digest: String,
    /// Bytes stored (and fetched).
    pub size: u64,
}

/// Compression of a stored metadata blob.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlobEncoding {
    /// zlib (RFC 1950) deflate.
    Zlib,
}

impl MetadataBlobRef {
    /// The digest the object is stored under.
    pub fn key_digest(&self) -> &str {
        self.stored.as_ref().map_or(&self.digest, |s| &s.digest)
    }

    /// Bytes a node fetches for the blob.
    pub fn stored_size(&self) -> u64 {
        self.stored.as_ref().map_or(self.size, |s| s.size)
    }
}

/// An image's pointer to one layer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerRef {
    pub name: String,
    pub version: String,
    /// `sha256:<hex>` the layer's manifest must carry.
    pub digest: String,
}

/// An image: layers bottom (base) first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageManifest {
    pub name: String,
    pub tag: String,
    pub layers: Vec<LayerRef>,
    /// The OCI config an imported or pulled image came with (environment,
    /// working directory, command); empty for images made here.
    #[serde(default, skip_serializing_if = "ImageConfig::is_empty")]
    pub config: ImageConfig,
}

/// Why a manifest was refused.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("invalid {what} {value:?}: must match [a-zA-Z0-9][a-zA-Z0-9._-]{{0,127}}")]
    InvalidName { what: &'static str, value: String },
    #[error("invalid digest {0:?}: must be sha256:<64 lowercase hex digits>")]
    InvalidDigest(String),
    #[error("layer {layer}: {reason}")]
    InvalidLayer { layer: String, reason: String },
    #[error("image {image}: {reason}")]
    InvalidImage { image: String, reason: String },
    /// The layer manifest found is not the layer the image was made from.
    #[error("layer {layer}: image {image} expects digest {expected}, the layer has {actual}")]
    DigestMismatch { image: String, layer: String, expected: String, actual: String },
    #[error("cannot encode or decode a manifest: {0}")]
    Json(#[from] serde_json::Error),
}

impl LayerManifest {
    /// `name@version`, for messages.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// `(offset, len)` of chunk `index` in the layer file, or `None` past
    /// the end.
    pub fn chunk_extent(&self, index: usize) -> Option<(u64, u64)> {
        if index >= self.chunks.len() {
            return None;
        }
        let offset = u64::try_from(index).ok()?.checked_mul(self.chunk_size)?;
        Some((offset, self.chunk_size.min(self.size.checked_sub(offset)?)))
    }

    /// The unit a node fetches, verifies and tracks: pieces when the
    /// manifest has them, else whole chunks.
    pub fn fetch_unit_size(&self) -> u64 {
        self.piece_size.unwrap_or(self.chunk_size)
    }

    /// The digests of the fetch units, in file order.
    pub fn fetch_unit_digests(&self) -> &[String] {
        if self.piece_size.is_some() {
            &self.pieces
        } else {
            &self.chunks
        }
    }

    /// `(offset, len)` of fetch unit `index` in the layer file, or `None`
    /// past the end.
    pub fn fetch_unit_extent(&self, index: usize) -> Option<(u64, u64)> {
        let Some(piece_size) = self.piece_size else { return self.chunk_extent(index) };
        if index >= self.pieces.len() {
            return None;
        }
        let offset = u64::try_from(index).ok()?.checked_mul(piece_size)?;
        Some((offset, piece_size.min(self.size.checked_sub(offset)?)))
    }

    /// Checks every invariant a reader relies on; called on every manifest
    /// read from a store.
    pub fn validate(&self) -> Result<(), LayerError> {
        check_name("layer name", &self.name)?;
        check_name("layer version", &self.version)?;
        check_digest(&self.digest)?;
        let invalid = |reason: String| LayerError::InvalidLayer { layer: self.id(), reason };
        if !is_valid_chunk_size(self.chunk_size) {
            return Err(invalid(format!("chunk size {} is not a power of two in 4 KiB..=64 MiB", self.chunk_size)));
        }
        let expected = self.size.div_ceil(self.chunk_size);
        if u64::try_from(self.chunks.len()).ok() != Some(expected) {
            return Err(invalid(format!(
                "{} chunks listed, {expected} needed for {} bytes",
                self.chunks.len(),
                self.size
            )));
        }
        self.chunks.iter().try_for_each(|c| check_digest(c))?;
        match self.piece_size {
            Some(piece_size) => {
                if !is_valid_piece_size(piece_size, self.chunk_size) {
                    return Err(invalid(format!(
                        "piece size {piece_size} is not a power of two in 4 KiB..=chunk size {}",
                        self.chunk_size
                    )));
                }
                let expected = self.size.div_ceil(piece_size);
                if u64::try_from(self.pieces.len()).ok() != Some(expected) {
                    return Err(invalid(format!(
                        "{} pieces listed, {expected} needed for {} bytes",
                        self.pieces.len(),
                        self.size
                    )));
                }
                self.pieces.iter().try_for_each(|p| check_digest(p))?;
            }
            None if !self.pieces.is_empty() => return Err(invalid("pieces listed without a piece size".into())),
            None => {}
        }
        let mut end = 0u64;
        for &(offset, len) in &self.metadata_ranges {
            let stop = offset.checked_add(len).filter(|&s| len > 0 && offset >= end && s <= self.size);
            end = stop.ok_or_else(|| invalid(format!("metadata range ({offset}, {len}) is out of order or bounds")))?;
        }
        if let Some(blob) = &self.metadata_blob {
            check_digest(&blob.digest)?;
            if let Some(stored) = &blob.stored {
                check_digest(&stored.digest)?;
            }
            let expected = crate::metablob::encoded_len(&self.metadata_pages());
            if blob.size != expected {
                return Err(invalid(format!("metadata blob is {} bytes, its ranges need {expected}", blob.size)));
            }
        }
        Ok(())
    }

    /// The page-aligned ranges the metadata blob carries.
    pub fn metadata_pages(&self) -> Vec<std::ops::Range<u64>> {
        crate::metablob::pages(&self.metadata_ranges, self.size)
    }

    /// The reference an image stores for this layer.
    pub fn to_ref(&self) -> LayerRef {
        LayerRef { name: self.name.clone(), version: self.version.clone(), digest: self.digest.clone() }
    }

    pub fn to_json(&self) -> Result<Vec<u8>, LayerError> {
        Ok(serde_json::to_vec_pretty(self)?)
    }

    /// Decodes and validates a manifest.
    pub fn from_json(bytes: &[u8]) -> Result<Self, LayerError> {
        let manifest: Self = serde_json::from_slice(bytes)?;
        manifest.validate()?;
        Ok(manifest)
    }
}

impl ImageManifest {
    pub fn id(&self) -> String {
        format!("{}:{}", self.name, self.tag)
    }

    pub fn validate(&self) -> Result<(), LayerError> {
        check_name("image name", &self.name)?;
        check_name("image tag", &self.tag)?;
        if self.layers.is_empty() {
            return Err(LayerError::InvalidImage { image: self.id(), reason: "no layers".into() });
        }
        self.config.validate().map_err(|reason| LayerError::InvalidImage { image: self.id(), reason })?;
        for (i, layer) in self.layers.iter().enumerate() {
            check_name("layer name", &layer.name)?;
            check_name("layer version", &layer.version)?;
            check_digest(&layer.digest)?;
            if self.layers[..i].iter().any(|l| l.name == layer.name && l.version == layer.version) {
                return Err(LayerError::InvalidImage {
                    image: self.id(),
                    reason: format!("layer {}@{} appears twice", layer.name, layer.version),
                });
            }
        }
        Ok(())
    }

    /// Refuses `layer` unless it is exactly the layer at `index` of this
    /// image: same name, version and digest.
    pub fn check_layer(&self, index: usize, layer: &LayerManifest) -> Result<(), LayerError> {
        let Some(want) = self.layers.get(index) else {
            return Err(LayerError::InvalidImage { image: self.id(), reason: format!("no layer at index {index}") });
        };
        if want.name != layer.name || want.version != layer.version || want.digest != layer.digest {
            return Err(LayerError::DigestMismatch {
                image: self.id(),
                layer: format!("{}@{}", want.name, want.version),
                expected: want.digest.clone(),
                actual: format!("{} ({})", layer.digest, layer.id()),
            });
        }
        Ok(())
    }

    pub fn to_json(&self) -> Result<Vec<u8>, LayerError> {
        Ok(serde_json::to_vec_pretty(self)?)
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self, LayerError> {
        let manifest: Self = serde_json::from_slice(bytes)?;
        manifest.validate()?;
        Ok(manifest)
    }
}

/// A new image `name:tag` made of existing `layers`, bottom first. Only
/// references are copied: no layer data moves.
pub fn compose(name: &str, tag: &str, layers: &[LayerManifest]) -> Result<ImageManifest, LayerError> {
    compose_with_config(name, tag, layers, ImageConfig::default())
}

/// [`compose`] with the image config the new image carries.
pub fn compose_with_config(
    name: &str,
    tag: &str,
    layers: &[LayerManifest],
    config: ImageConfig,
) -> Result<ImageManifest, LayerError> {
    for layer in layers {
        layer.validate()?;
    }
    let image = ImageManifest {
        name: name.to_owned(),
        tag: tag.to_owned(),
        layers: layers.iter().map(|l| l.to_ref()).collect(),
        config,
    };
    image.validate()?;
    Ok(image)
}

pub fn is_valid_chunk_size(bytes: u64) -> bool {
    bytes.is_power_of_two() && (MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&bytes)
}

/// Pieces are at least one EROFS block and divide the chunk, so a piece
/// never straddles two chunk objects.
pub fn is_valid_piece_size(bytes: u64, chunk_size: u64) -> bool {
    bytes.is_power_of_two() && bytes >= MIN_CHUNK_SIZE && bytes <= chunk_size
}

/// The hex part of a valid `sha256:<hex>` digest.
pub fn digest_hex(digest: &str) -> Result<&str, LayerError> {
    check_digest(digest)?;
    Ok(&digest["sha256:".len()..])
}

fn check_digest(digest: &str) -> Result<(), LayerError> {
    let ok = digest
        .strip_prefix("sha256:")
        .is_some_and(|hex| hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    if ok {
        Ok(())
    } else {
        Err(LayerError::InvalidDigest(digest.to_owned()))
    }
}

/// Names become object-store path segments: the crate's image-name grammar
/// keeps them from climbing out of their prefix.
fn check_name(what: &'static str, value: &str) -> Result<(), LayerError> {
    crate::validate_name(value).map_err(|_| LayerError::InvalidName { what, value: value.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0000000000000000000000000000000000000000000000000000000000000000";

    fn layer(name: &str, size: u64, chunk_size: u64) -> LayerManifest {
        LayerManifest {
            name: name.into(),
            version: "1".into(),
            role: LayerRole::Base,
            digest: D.into(),
            size,
            chunk_size,
            chunks: vec![D.into(); usize::try_from(size.div_ceil(chunk_size)).unwrap()],
            metadata_ranges: vec![(0, size.min(4096))],
            metadata_blob: None,
            piece_size: None,
            pieces: Vec::new(),
        }
    }

    #[test]
    fn pieces_must_tile_the_layer_and_divide_the_chunk() {
        let mut l = layer("base", 10_000, 8192);
        l.piece_size = Some(4096);
        l.pieces = vec![D.into(); 3];
        l.validate().unwrap();
        assert_eq!(LayerManifest::from_json(&l.to_json().unwrap()).unwrap(), l);
        assert_eq!(l.fetch_unit_size(), 4096);
        assert_eq!(l.fetch_unit_extent(2), Some((8192, 10_000 - 8192)));
        assert_eq!(l.fetch_unit_extent(3), None);
        assert_eq!(l.fetch_unit_digests().len(), 3);
        for (size, count) in [(Some(4096), 2), (Some(16384), 1), (Some(3000), 3), (None, 3)] {
            let mut bad = l.clone();
            bad.piece_size = size;
            bad.pieces = vec![D.into(); count];
            assert!(matches!(bad.validate(), Err(LayerError::InvalidLayer { .. })), "{size:?} {count}");
        }
        // A manifest without pieces keeps whole chunks as its unit.
        let old = layer("base", 10_000, 8192);
        assert_eq!((old.fetch_unit_size(), old.fetch_unit_extent(1)), (8192, Some((8192, 10_000 - 8192))));
        let json = String::from_utf8(old.to_json().unwrap()).unwrap();
        assert!(!json.contains("piece"), "{json}");
    }

    #[test]
    fn a_metadata_blob_must_have_the_size_its_ranges_give() {
        let mut l = layer("base", 10_000, 4096);
        let size = crate::metablob::encoded_len(&l.metadata_pages());
        l.metadata_blob = Some(MetadataBlobRef { digest: D.into(), size, stored: None });
        l.validate().unwrap();
        assert_eq!(LayerManifest::from_json(&l.to_json().unwrap()).unwrap(), l);
        l.metadata_blob = Some(MetadataBlobRef { digest: D.into(), size: size + 1, stored: None });
        assert!(matches!(l.validate(), Err(LayerError::InvalidLayer { .. })));
        // A manifest from before metadata blobs still reads.
        let mut old: serde_json::Value = serde_json::from_slice(&layer("base", 10, 4096).to_json().unwrap()).unwrap();
        old.as_object_mut().unwrap().remove("metadata_blob");
        assert_eq!(LayerManifest::from_json(&serde_json::to_vec(&old).unwrap()).unwrap().metadata_blob, None);
    }

    #[test]
    fn a_consistent_layer_manifest_validates_and_round_trips() {
        let l = layer("base", 10_000, 4096);
        l.validate().unwrap();
        assert_eq!(LayerManifest::from_json(&l.to_json().unwrap()).unwrap(), l);
        assert_eq!(l.chunk_extent(2), Some((8192, 10_000 - 8192)));
        assert_eq!(l.chunk_extent(3), None);
        let json = String::from_utf8(l.to_json().unwrap()).unwrap();
        assert!(json.contains("\"role\": \"base\""), "{json}");
    }

    #[test]
    fn chunk_lists_that_do_not_tile_the_layer_are_refused() {
        let mut l = layer("base", 10_000, 4096);
        l.chunks.pop();
        assert!(matches!(l.validate(), Err(LayerError::InvalidLayer { .. })));
        let mut l = layer("base", 10_000, 4096);
        l.chunk_size = 5000;
        assert!(matches!(l.validate(), Err(LayerError::InvalidLayer { .. })));
    }

    #[test]
    fn metadata_ranges_must_be_sorted_and_inside_the_layer() {
        for ranges in [vec![(8192, 4096), (0, 4096)], vec![(0, 20_000)], vec![(0, 0)], vec![(u64::MAX, 2)]] {
            let mut l = layer("base", 10_000, 4096);
            l.metadata_ranges = ranges.clone();
            assert!(matches!(l.validate(), Err(LayerError::InvalidLayer { .. })), "{ranges:?}");
        }
    }

    #[test]
    fn traversal_names_and_malformed_digests_are_refused() {
        let mut l = layer("base", 10, 4096);
        l.version = "../../x".into();
        assert!(matches!(l.validate(), Err(LayerError::InvalidName { .. })));
        let mut l = layer("base", 10, 4096);
        l.chunks[0] = "sha256:ABC".into();
        assert!(matches!(l.validate(), Err(LayerError::InvalidDigest(_))));
    }

    #[test]
    fn compose_keeps_order_and_refuses_duplicates_and_empty_stacks() {
        let image = compose("py", "v2", &[layer("base", 10, 4096), layer("tools", 10, 4096)]).unwrap();
        let names: Vec<_> = image.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["base", "tools"]);
        assert!(compose("py", "v2", &[]).is_err());
        assert!(compose("py", "v2", &[layer("base", 10, 4096), layer("base", 10, 4096)]).is_err());
    }

    #[test]
    fn an_image_config_round_trips_and_a_relative_working_dir_is_refused() {
        let config = ImageConfig {
            env: vec!["PATH=/opt/bin:/bin".into(), "GREETING=a=b".into()],
            working_dir: Some("/srv".into()),
            cmd: vec!["/bin/sh".into()],
            ..ImageConfig::default()
        };
        let image = compose_with_config("py", "v1", &[layer("base", 10, 4096)], config.clone()).unwrap();
        let back = ImageManifest::from_json(&image.to_json().unwrap()).unwrap();
        assert_eq!(back.config, config);
        assert_eq!(back.config.env_map()["GREETING"], "a=b");
        let plain = compose("py", "v1", &[layer("base", 10, 4096)]).unwrap();
        assert!(!String::from_utf8(plain.to_json().unwrap()).unwrap().contains("config"));
        for bad in [
            ImageConfig { working_dir: Some("srv".into()), ..ImageConfig::default() },
            ImageConfig { env: vec!["NOEQUALS".into()], ..ImageConfig::default() },
            ImageConfig { env: vec!["=x".into()], ..ImageConfig::default() },
        ] {
            let err = compose_with_config("py", "v1", &[layer("base", 10, 4096)], bad.clone());
            assert!(matches!(err, Err(LayerError::InvalidImage { .. })), "{bad:?}");
        }
    }

    #[test]
    fn check_layer_refuses_a_layer_with_another_digest() {
        let base = layer("base", 10, 4096);
        let image = compose("py", "v1", std::slice::from_ref(&base)).unwrap();
        image.check_layer(0, &base).unwrap();
        let mut forged = base.clone();
        forged.digest = format!("sha256:{}", "1".repeat(64));
        assert!(matches!(image.check_layer(0, &forged), Err(LayerError::DigestMismatch { .. })));
    }
}

//! The on-disk manifest: `manifests/<name>.json`, naming an image's layers
//! bottom first. It stores layer ids, not paths, so the store can move.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ImageError, IoContext, Result};

const FORMAT_VERSION: u32 = 1;
const LAYER_ID_LEN: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub(crate) version: u32,
    pub(crate) name: String,
    pub(crate) layers: Vec<String>,
    pub(crate) created_at_ms: u64,
}

impl Manifest {
    pub(crate) fn new(name: &str, layers: Vec<String>, created_at_ms: u64) -> Self {
        Self { version: FORMAT_VERSION, name: name.to_owned(), layers, created_at_ms }
    }

    /// Reads and checks the manifest of image `name` at `path`.
    pub(crate) fn load(path: &Path, name: &str) -> Result<Self> {
        let bytes = match std::fs::read(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(ImageError::NotFound(name.to_owned())),
            other => other.context(|| format!("reading manifest {}", path.display()))?,
        };
        let corrupt = |reason: String| ImageError::Corrupt { name: name.to_owned(), reason };
        let manifest: Manifest = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if manifest.version != FORMAT_VERSION {
            return Err(corrupt(format!("unsupported manifest version {}", manifest.version)));
        }
        if manifest.name != name {
            return Err(corrupt(format!("manifest names image {:?}", manifest.name)));
        }
        // Ids become paths under layers/ and are removed with the image, so a
        // tampered id such as "../.." must never get that far.
        if let Some(bad) = manifest.layers.iter().find(|id| !is_layer_id(id)) {
            return Err(corrupt(format!("invalid layer id {bad:?}")));
        }
        Ok(manifest)
    }

    pub(crate) fn to_bytes(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).map_err(|e| ImageError::Corrupt {
            name: self.name.clone(),
            reason: format!("cannot encode manifest: {e}"),
        })
    }
}

/// Layer ids are 32 lowercase hex digits; nothing else in `layers/` is ours.
pub(crate) fn is_layer_id(s: &str) -> bool {
    s.len() == LAYER_ID_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ids_are_exactly_32_lowercase_hex() {
        assert!(is_layer_id("0123456789abcdef0123456789abcdef"));
        for bad in ["", "..", "../../../../etc", "0123456789ABCDEF0123456789ABCDEF", "0123456789abcdef0123456789abcde"]
        {
            assert!(!is_layer_id(bad), "{bad:?}");
        }
    }

    #[test]
    fn load_rejects_traversal_in_layer_ids() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("evil.json");
        let evil = Manifest { version: 1, name: "evil".into(), layers: vec!["../../etc".into()], created_at_ms: 0 };
        std::fs::write(&path, evil.to_bytes().unwrap()).unwrap();
        assert!(matches!(Manifest::load(&path, "evil"), Err(ImageError::Corrupt { .. })));
    }

    #[test]
    fn load_rejects_a_manifest_filed_under_another_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        std::fs::write(&path, Manifest::new("b", vec![], 0).to_bytes().unwrap()).unwrap();
        assert!(matches!(Manifest::load(&path, "a"), Err(ImageError::Corrupt { .. })));
    }
}

//! The crash-leftover sweep that `ImageStore::open` runs when it is the sole
//! opener of a root.
//!
//! Kept apart from the import tests on purpose, and nothing here spawns a
//! process: a child forked by a concurrently running test briefly shares
//! every open file of the test binary, including a just-dropped store's lock,
//! which makes the sweep (correctly) back off. These tests assert that the
//! sweep does run, so no other test may fork next to them.

use std::fs;
use std::path::Path;

use warren_image::{ImageError, ImageStore};

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// Writes an image by hand in the v1 on-disk format (which this also pins):
/// a layer directory and a manifest naming it.
fn write_image(root: &Path, name: &str, layer_id: &str) {
    fs::create_dir_all(root.join("layers").join(layer_id)).unwrap();
    fs::write(root.join("layers").join(layer_id).join("f"), b"x").unwrap();
    let manifest = format!(r#"{{"version":1,"name":"{name}","layers":["{layer_id}"],"created_at_ms":1}}"#);
    fs::write(root.join("manifests").join(format!("{name}.json")), manifest).unwrap();
}

#[test]
fn open_sweeps_tmp_and_unreferenced_layers() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    drop(ImageStore::open(&root).unwrap());
    write_image(&root, "kept", "00112233445566778899aabbccddeeff");

    // What a crash mid-import or mid-remove leaves.
    fs::create_dir_all(root.join("tmp/0123456789abcdef0123456789abcdef/usr")).unwrap();
    fs::write(root.join("tmp/abc.manifest"), b"{").unwrap();
    let orphan = root.join("layers/fedcba9876543210fedcba9876543210");
    fs::create_dir_all(orphan.join("etc")).unwrap();
    let foreign = root.join("layers/not-a-layer-id");
    fs::create_dir(&foreign).unwrap();

    let store = ImageStore::open(&root).unwrap();
    assert_eq!(entries(&root.join("tmp")), Vec::<String>::new());
    assert!(!orphan.exists(), "unreferenced layer survived the sweep");
    assert!(foreign.exists(), "the sweep removed something that is not a layer");
    let kept = store.get("kept").unwrap();
    assert_eq!(kept.created_at_ms(), 1);
    assert_eq!(kept.layers()[0].id(), "00112233445566778899aabbccddeeff");
    assert_eq!(fs::read(kept.layers()[0].path().join("f")).unwrap(), b"x");
}

#[test]
fn open_does_not_sweep_while_another_store_has_the_root_open() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    let first = ImageStore::open(&root).unwrap();
    let in_progress = root.join("tmp/0123456789abcdef0123456789abcdef");
    fs::create_dir(&in_progress).unwrap();

    let second = ImageStore::open(&root).unwrap();
    assert!(in_progress.exists(), "a second opener swept another store's import in progress");

    drop((first, second));
    let _sole = ImageStore::open(&root).unwrap();
    assert!(!in_progress.exists());
}

#[test]
fn corrupt_manifest_is_reported_removable_and_blocks_layer_deletion() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    drop(ImageStore::open(&root).unwrap());
    fs::write(root.join("manifests/bad.json"), b"{ not json").unwrap();
    let maybe_used = root.join("layers/fedcba9876543210fedcba9876543210");
    fs::create_dir(&maybe_used).unwrap();

    let store = ImageStore::open(&root).unwrap();
    assert!(matches!(store.get("bad"), Err(ImageError::Corrupt { .. })));
    assert!(matches!(store.list(), Err(ImageError::Corrupt { .. })));
    assert!(maybe_used.exists(), "layer deleted while a manifest that may name it was unreadable");

    store.remove("bad").unwrap();
    assert!(matches!(store.get("bad"), Err(ImageError::NotFound(_))));
    drop(store);
    drop(ImageStore::open(&root).unwrap());
    assert!(!maybe_used.exists());
}

#[test]
fn get_reports_a_manifest_whose_layer_is_missing_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    let store = ImageStore::open(&root).unwrap();
    write_image(&root, "broken", "00112233445566778899aabbccddeeff");
    fs::remove_dir_all(root.join("layers/00112233445566778899aabbccddeeff")).unwrap();
    assert!(matches!(store.get("broken"), Err(ImageError::Corrupt { .. })));
}

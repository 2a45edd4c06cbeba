//! OCI image layout and `docker save` importers, on images these tests make
//! themselves (layer tars by the host's GNU tar, digests with sha2). Run as
//! root: the imported layers are mounted and stacked with overlayfs.

use std::ffi::CString;
use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::mount::{MountFlags, UnmountFlags};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tempfile::TempDir;
use warren_image::erofs::BuildOptions;
use warren_image::oci::{self, ImageConfig, ImportedImage, OciError};

const TAR: &str = "application/vnd.oci.image.layer.v1.tar";
const TAR_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";

struct Mounted(PathBuf);

impl Mounted {
    fn new(source: &Path, target: &Path, fstype: &str, data: Option<String>) -> Self {
        fs::create_dir_all(target).unwrap();
        let data = data.map(|d| CString::new(d).unwrap());
        rustix::mount::mount(source, target, fstype, MountFlags::RDONLY, data.as_deref()).unwrap();
        Self(target.to_owned())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if rustix::mount::unmount(&self.0, UnmountFlags::empty()).is_err() {
            let _ = rustix::mount::unmount(&self.0, UnmountFlags::DETACH);
        }
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

fn hex(digest: &str) -> &str {
    digest.trim_start_matches("sha256:")
}

/// A layer tar of the tree `fill` makes, as the host's GNU tar writes it.
fn layer_tar(work: &Path, name: &str, fill: impl FnOnce(&Path)) -> Vec<u8> {
    let dir = work.join(format!("{name}-tree"));
    fs::create_dir_all(&dir).unwrap();
    fill(&dir);
    let archive = work.join(format!("{name}.tar"));
    let status = Command::new("tar")
        .args(["--create", "--sort=name", "--numeric-owner", "--xattrs", "--format=pax", "--mtime=@1600000000"])
        // Without atime and ctime the same tree always makes the same tar.
        .arg("--pax-option=delete=atime,delete=ctime")
        .arg(format!("--file={}", archive.display()))
        .arg("-C")
        .arg(&dir)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    fs::read(archive).unwrap()
}

fn gzip(bytes: &[u8], work: &Path) -> Vec<u8> {
    let path = work.join("to-gzip");
    fs::write(&path, bytes).unwrap();
    let out = Command::new("gzip").args(["-n", "-c"]).arg(&path).output().unwrap();
    assert!(out.status.success());
    out.stdout
}

/// The base layer: a few files and a directory with an old entry.
fn base_layer(work: &Path) -> Vec<u8> {
    layer_tar(work, "base", |d| {
        fs::create_dir_all(d.join("etc")).unwrap();
        fs::write(d.join("etc/os-release"), b"ID=test\n").unwrap();
        fs::write(d.join("gone"), b"deleted by the next layer").unwrap();
        fs::create_dir_all(d.join("cache")).unwrap();
        fs::write(d.join("cache/old"), b"old").unwrap();
    })
}

/// The top layer: deletes `gone`, makes `cache` opaque, adds files.
fn top_layer(work: &Path) -> Vec<u8> {
    layer_tar(work, "top", |d| {
        fs::write(d.join(".wh.gone"), b"").unwrap();
        fs::create_dir_all(d.join("cache")).unwrap();
        fs::write(d.join("cache/.wh..wh..opq"), b"").unwrap();
        fs::write(d.join("cache/new"), b"new").unwrap();
        fs::create_dir_all(d.join("work")).unwrap();
        fs::write(d.join("work/main.py"), b"print('hi')\n").unwrap();
    })
}

fn config_json(diff_ids: &[String]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/bin:/usr/bin", "LANG=C.UTF-8"],
            "Cmd": ["python3", "main.py"],
            "WorkingDir": "/work"
        },
        "rootfs": { "type": "layers", "diff_ids": diff_ids }
    }))
    .unwrap()
}

fn expected_config() -> ImageConfig {
    ImageConfig {
        env: vec!["PATH=/usr/local/bin:/usr/bin".into(), "LANG=C.UTF-8".into()],
        cmd: vec!["python3".into(), "main.py".into()],
        entrypoint: vec![],
        working_dir: Some("/work".into()),
        user: None,
    }
}

/// Writes an OCI image layout and returns the manifest descriptor it indexes.
struct Layout {
    dir: PathBuf,
}

impl Layout {
    fn new(dir: &Path) -> Self {
        fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Self { dir: dir.to_owned() }
    }

    fn blob(&self, bytes: &[u8]) -> Value {
        let digest = sha256(bytes);
        fs::write(self.dir.join("blobs/sha256").join(hex(&digest)), bytes).unwrap();
        json!({ "digest": digest, "size": bytes.len() })
    }

    fn descriptor(&self, media_type: &str, bytes: &[u8]) -> Value {
        let mut d = self.blob(bytes);
        d["mediaType"] = json!(media_type);
        d
    }

    /// An image manifest over `layers` (media type, bytes) with a config
    /// whose diff_ids are `diff_ids`.
    fn image(&self, layers: &[(&str, Vec<u8>)], diff_ids: &[String]) -> Value {
        let config = self.descriptor(CONFIG, &config_json(diff_ids));
        let layers: Vec<Value> = layers.iter().map(|(mt, bytes)| self.descriptor(mt, bytes)).collect();
        let manifest = json!({ "schemaVersion": 2, "mediaType": MANIFEST, "config": config, "layers": layers });
        self.descriptor(MANIFEST, &serde_json::to_vec(&manifest).unwrap())
    }

    fn index(&self, manifests: Vec<Value>) {
        let index = json!({ "schemaVersion": 2, "mediaType": INDEX, "manifests": manifests });
        fs::write(self.dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    }
}

/// The standard two-layer test image as an OCI layout; the top layer is
/// gzip-compressed.
fn two_layer_layout(work: &Path) -> (PathBuf, Vec<String>) {
    let (base, top) = (base_layer(work), top_layer(work));
    let diff_ids = vec![sha256(&base), sha256(&top)];
    let top_gz = gzip(&top, work);
    let layout = Layout::new(&work.join("layout"));
    let mut manifest = layout.image(&[(TAR, base), (TAR_GZIP, top_gz)], &diff_ids);
    manifest["annotations"] = json!({ "org.opencontainers.image.ref.name": "example.com/py:v1" });
    layout.index(vec![manifest]);
    (layout.dir, diff_ids)
}

/// The same image as a legacy `docker save` tarball.
fn two_layer_docker_save(work: &Path) -> Vec<u8> {
    let (base, top) = (base_layer(work), top_layer(work));
    let config = config_json(&[sha256(&base), sha256(&top)]);
    docker_save(work, &[base, top], &config, None)
}

fn docker_save(work: &Path, layers: &[Vec<u8>], config: &[u8], layer_paths: Option<Vec<String>>) -> Vec<u8> {
    let dir = work.join("docker-save");
    fs::create_dir_all(&dir).unwrap();
    let config_name = format!("{}.json", hex(&sha256(config)));
    fs::write(dir.join(&config_name), config).unwrap();
    let mut paths = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        let id = format!("{:064x}", i + 1);
        fs::create_dir_all(dir.join(&id)).unwrap();
        fs::write(dir.join(&id).join("layer.tar"), layer).unwrap();
        paths.push(format!("{id}/layer.tar"));
    }
    let manifest = json!([{ "Config": config_name, "RepoTags": ["py:v1"], "Layers": layer_paths.unwrap_or(paths) }]);
    fs::write(dir.join("manifest.json"), serde_json::to_vec(&manifest).unwrap()).unwrap();
    let archive = work.join("image.tar");
    let status = Command::new("tar")
        .args(["--create", "--sort=name"])
        .arg(format!("--file={}", archive.display()))
        .arg("-C")
        .arg(&dir)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
    fs::read(archive).unwrap()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Mounts the imported layers, stacks them, and checks the merged view.
fn assert_stack_shows_the_image(image: &ImportedImage, work: &Path) {
    let mounts: Vec<Mounted> = image
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| Mounted::new(&l.path, &work.join(format!("layer{i}")), "erofs", None))
        .collect();
    // Whiteouts are in overlay form in the top layer itself.
    let top = &mounts[1].0;
    let gone = fs::symlink_metadata(top.join("gone")).unwrap();
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    let mut value = [0u8; 8];
    let n = rustix::fs::getxattr(top.join("cache"), "trusted.overlay.opaque", &mut value).unwrap();
    assert_eq!(&value[..n], b"y");

    let lowers: Vec<String> = mounts.iter().rev().map(|m| m.0.display().to_string()).collect();
    let merged = Mounted::new(
        Path::new("overlay"),
        &work.join("merged"),
        "overlay",
        Some(format!("lowerdir={}", lowers.join(":"))),
    );
    assert_eq!(entries(&merged.0), ["cache", "etc", "work"]);
    assert_eq!(entries(&merged.0.join("cache")), ["new"]);
    assert_eq!(fs::read(merged.0.join("work/main.py")).unwrap(), b"print('hi')\n");
    assert_eq!(fs::read(merged.0.join("etc/os-release")).unwrap(), b"ID=test\n");
}

fn assert_only_layers_in(out: &Path, image: &ImportedImage) {
    let mut want: Vec<String> = image.layers.iter().map(|l| format!("{}.erofs", hex(&l.digest))).collect();
    want.sort();
    want.dedup();
    assert_eq!(entries(out), want);
}

#[test]
fn oci_layout_import_converts_whiteouts_and_returns_the_config() {
    let work = TempDir::new().unwrap();
    let (layout, _) = two_layer_layout(work.path());
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let image = oci::import_oci_layout(&layout, None, &out, &BuildOptions::default()).unwrap();
    assert_eq!(image.layers.len(), 2);
    assert_eq!(image.config, expected_config());
    for layer in &image.layers {
        assert_eq!(layer.digest, sha256(&fs::read(&layer.path).unwrap()));
    }
    assert_only_layers_in(&out, &image);
    assert_stack_shows_the_image(&image, work.path());

    // Importing again gives the same layers, byte for byte.
    let again = oci::import_oci_layout(&layout, Some("v1"), &out, &BuildOptions::default()).unwrap();
    assert_eq!(again, image);
}

#[test]
fn docker_save_import_gives_the_same_layers_as_the_oci_layout() {
    let work = TempDir::new().unwrap();
    let archive = two_layer_docker_save(work.path());
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let image = oci::import_docker_save(&archive[..], Some("py:v1"), &out, &BuildOptions::default()).unwrap();
    assert_eq!(image.config, expected_config());
    assert_only_layers_in(&out, &image);
    assert_stack_shows_the_image(&image, work.path());

    let (layout, _) = two_layer_layout(work.path());
    let out2 = work.path().join("out2");
    fs::create_dir(&out2).unwrap();
    let from_layout = oci::import_oci_layout(&layout, None, &out2, &BuildOptions::default()).unwrap();
    let digests = |i: &ImportedImage| i.layers.iter().map(|l| l.digest.clone()).collect::<Vec<_>>();
    assert_eq!(digests(&image), digests(&from_layout));
}

#[test]
fn a_layer_blob_that_does_not_match_its_digest_is_refused_and_nothing_is_written() {
    let work = TempDir::new().unwrap();
    let (layout, diff_ids) = two_layer_layout(work.path());
    // Corrupt the (uncompressed) base layer blob in place.
    let blob = layout.join("blobs/sha256").join(hex(&diff_ids[0]));
    let mut bytes = fs::read(&blob).unwrap();
    bytes[600] ^= 1;
    fs::write(&blob, bytes).unwrap();
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err = oci::import_oci_layout(&layout, None, &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
    assert!(err.to_string().contains(&diff_ids[0]), "{err}");
    assert!(entries(&out).is_empty(), "{:?}", entries(&out));
}

#[test]
fn an_unknown_layer_media_type_is_refused() {
    let work = TempDir::new().unwrap();
    let base = base_layer(work.path());
    let layout = Layout::new(&work.path().join("layout"));
    let manifest = layout.image(&[("application/vnd.example.squashfs", base.clone())], &[sha256(&base)]);
    layout.index(vec![manifest]);
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err = oci::import_oci_layout(&layout.dir, None, &out, &BuildOptions::default()).unwrap_err();
    match &err {
        OciError::UnknownMediaType { media_type, .. } => assert_eq!(media_type, "application/vnd.example.squashfs"),
        other => panic!("{other}"),
    }
    assert!(entries(&out).is_empty());
}

#[test]
fn a_truncated_docker_save_archive_is_refused_and_nothing_is_written() {
    let work = TempDir::new().unwrap();
    let archive = two_layer_docker_save(work.path());
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err =
        oci::import_docker_save(&archive[..archive.len() * 2 / 3], None, &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::Archive(_)), "{err}");
    assert!(entries(&out).is_empty(), "{:?}", entries(&out));
}

#[test]
fn a_docker_save_layer_that_does_not_match_its_diff_id_is_refused() {
    let work = TempDir::new().unwrap();
    let (base, top) = (base_layer(work.path()), top_layer(work.path()));
    // The config claims the base layer's digest for both layers.
    let config = config_json(&[sha256(&base), sha256(&base)]);
    let archive = docker_save(work.path(), &[base, top], &config, None);
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err = oci::import_docker_save(&archive[..], None, &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::DigestMismatch { .. }), "{err}");
    assert!(err.to_string().contains("layer 1"), "{err}");
    assert!(entries(&out).is_empty());
}

#[test]
fn manifest_paths_that_leave_the_archive_are_refused() {
    let work = TempDir::new().unwrap();
    let base = base_layer(work.path());
    let config = config_json(&[sha256(&base)]);
    let archive = docker_save(work.path(), &[base], &config, Some(vec!["../../../../etc/passwd".into()]));
    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err = oci::import_docker_save(&archive[..], None, &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::UnsafePath(_)), "{err}");
    assert!(entries(&out).is_empty());
}

#[test]
fn references_pick_one_of_several_images_and_indexes_resolve_to_linux_amd64() {
    let work = TempDir::new().unwrap();
    let (base, top) = (base_layer(work.path()), top_layer(work.path()));
    let layout = Layout::new(&work.path().join("layout"));
    let mut small = layout.image(&[(TAR, base.clone())], &[sha256(&base)]);
    small["annotations"] = json!({ "org.opencontainers.image.ref.name": "small" });

    // "full" is a multi-platform index whose arm64 entry names blobs that do
    // not exist: choosing it would fail.
    let mut amd64 = layout.image(&[(TAR, base.clone()), (TAR, top.clone())], &[sha256(&base), sha256(&top)]);
    amd64["platform"] = json!({ "architecture": "amd64", "os": "linux" });
    let arm64 = json!({
        "mediaType": MANIFEST, "digest": format!("sha256:{}", "e".repeat(64)), "size": 10,
        "platform": { "architecture": "arm64", "os": "linux" }
    });
    let nested = json!({ "schemaVersion": 2, "mediaType": INDEX, "manifests": [arm64, amd64] });
    let mut full = layout.descriptor(INDEX, &serde_json::to_vec(&nested).unwrap());
    full["annotations"] = json!({ "org.opencontainers.image.ref.name": "full" });
    layout.index(vec![small, full]);

    let out = work.path().join("out");
    fs::create_dir(&out).unwrap();
    let err = oci::import_oci_layout(&layout.dir, None, &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::Invalid(_)) && err.to_string().contains("small"), "{err}");
    let err = oci::import_oci_layout(&layout.dir, Some("huge"), &out, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, OciError::Invalid(_)), "{err}");
    let small = oci::import_oci_layout(&layout.dir, Some("small"), &out, &BuildOptions::default()).unwrap();
    assert_eq!(small.layers.len(), 1);
    let full = oci::import_oci_layout(&layout.dir, Some("full"), &out, &BuildOptions::default()).unwrap();
    assert_eq!(full.layers.len(), 2);
}

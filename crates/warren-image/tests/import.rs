//! Image store behaviour on the real filesystem with the host's tar. Run as
//! root: the tests create files owned by other users and device nodes.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{chown, symlink, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::{FileType, Mode, XattrFlags};
use tempfile::TempDir;
use warren_image::{ImageError, ImageStore};

fn new_store() -> (TempDir, ImageStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = ImageStore::open(dir.path().join("images")).unwrap();
    (dir, store)
}

fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// A tree with one of every awkward thing an image holds.
fn make_rich_tree(root: &Path) {
    fs::set_permissions(root, fs::Permissions::from_mode(0o750)).unwrap();
    chown(root, Some(11), Some(12)).unwrap();

    let file = root.join("suid-file");
    fs::write(&file, b"payload").unwrap();
    chown(&file, Some(1234), Some(5678)).unwrap();
    // After chown: chown clears set-id bits.
    fs::set_permissions(&file, fs::Permissions::from_mode(0o4750)).unwrap();
    rustix::fs::setxattr(&file, "user.test", b"hello", XattrFlags::empty()).unwrap();

    fs::hard_link(&file, root.join("hard-link")).unwrap();
    symlink("suid-file", root.join("relative-link")).unwrap();
    symlink("/etc/passwd", root.join("absolute-link")).unwrap();

    let ping = root.join("ping");
    fs::write(&ping, b"#!/bin/sh\n").unwrap();
    fs::set_permissions(&ping, fs::Permissions::from_mode(0o755)).unwrap();
    rustix::fs::setxattr(&ping, "security.capability", &net_raw_capability(), XattrFlags::empty()).unwrap();

    fs::create_dir(root.join("dev")).unwrap();
    let null = root.join("dev/null");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &null,
        FileType::CharacterDevice,
        Mode::from_raw_mode(0o666),
        rustix::fs::makedev(1, 3),
    )
    .unwrap();
    rustix::fs::mknodat(rustix::fs::CWD, root.join("fifo"), FileType::Fifo, Mode::from_raw_mode(0o600), 0).unwrap();

    let private = root.join("private");
    fs::create_dir(&private).unwrap();
    fs::write(private.join("inside"), b"x").unwrap();
    chown(&private, Some(7), Some(8)).unwrap();
    fs::set_permissions(&private, fs::Permissions::from_mode(0o711)).unwrap();
}

/// `vfs_cap_data` revision 2 granting CAP_NET_RAW (13), permitted and effective.
fn net_raw_capability() -> Vec<u8> {
    [0x0200_0001u32, 1 << 13, 0, 0, 0].iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn xattr(path: &Path, name: &str) -> Vec<u8> {
    let mut buf = vec![0u8; 256];
    let len = rustix::fs::lgetxattr(path, name, &mut buf[..]).unwrap();
    buf.truncate(len);
    buf
}

fn assert_rich_tree_preserved(layer: &Path) {
    let root = fs::symlink_metadata(layer).unwrap();
    assert_eq!((root.uid(), root.gid(), root.mode() & 0o7777), (11, 12, 0o750), "layer root attributes");

    let file = fs::symlink_metadata(layer.join("suid-file")).unwrap();
    assert_eq!((file.uid(), file.gid()), (1234, 5678));
    assert_eq!(file.mode() & 0o7777, 0o4750);
    assert_eq!(fs::read(layer.join("suid-file")).unwrap(), b"payload");
    assert_eq!(xattr(&layer.join("suid-file"), "user.test"), b"hello");

    let link = fs::symlink_metadata(layer.join("hard-link")).unwrap();
    assert_eq!(link.ino(), file.ino(), "hard link became a copy");
    assert_eq!(file.nlink(), 2);

    assert_eq!(fs::read_link(layer.join("relative-link")).unwrap(), PathBuf::from("suid-file"));
    assert_eq!(fs::read_link(layer.join("absolute-link")).unwrap(), PathBuf::from("/etc/passwd"));

    assert_eq!(xattr(&layer.join("ping"), "security.capability"), net_raw_capability());

    let null = fs::symlink_metadata(layer.join("dev/null")).unwrap();
    assert!(null.file_type().is_char_device());
    assert_eq!(null.rdev(), rustix::fs::makedev(1, 3));
    assert!(fs::symlink_metadata(layer.join("fifo")).unwrap().file_type().is_fifo());

    let private = fs::symlink_metadata(layer.join("private")).unwrap();
    assert_eq!((private.uid(), private.gid(), private.mode() & 0o7777), (7, 8, 0o711));
}

fn host_tar(src: &Path, extra: &[&str]) -> Vec<u8> {
    let out = Command::new("tar").args(extra).arg("-C").arg(src).args(["-cf", "-", "."]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out.stdout
}

fn assert_nothing_left(dir: &TempDir, store: &ImageStore, name: &str) {
    assert!(matches!(store.get(name), Err(ImageError::NotFound(_))));
    let images = dir.path().join("images");
    assert_eq!(entries(&images.join("manifests")), Vec::<String>::new());
    assert_eq!(entries(&images.join("layers")), Vec::<String>::new());
    assert_eq!(entries(&images.join("tmp")), Vec::<String>::new());
}

#[test]
fn import_dir_preserves_owners_modes_links_xattrs_and_devices() {
    let (_dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    make_rich_tree(src.path());

    let image = store.import_dir("rich", src.path()).unwrap();

    assert_eq!(image.name(), "rich");
    assert_eq!(image.layers().len(), 1);
    let layer = image.layers()[0].path();
    assert!(layer.is_absolute() && layer.starts_with(store.root().join("layers")));
    assert_rich_tree_preserved(layer);
    assert_eq!(store.get("rich").unwrap(), image);
}

#[test]
fn import_tar_streams_plain_and_compressed_archives() {
    let (dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    make_rich_tree(src.path());
    let all_attrs = ["--xattrs", "--xattrs-include=*", "--numeric-owner"];

    let plain = store.import_tar("plain", &host_tar(src.path(), &all_attrs)[..]).unwrap();
    assert_rich_tree_preserved(plain.layers()[0].path());

    for (name, flag) in [("gzip", "--gzip"), ("zstd", "--zstd"), ("xz", "--xz")] {
        let archive = host_tar(src.path(), &[flag]);
        let image = store.import_tar(name, &archive[..]).unwrap();
        assert_eq!(fs::read(image.layers()[0].path().join("suid-file")).unwrap(), b"payload", "{name}");
    }
    assert_eq!(entries(&dir.path().join("images/tmp")), Vec::<String>::new());
}

#[test]
fn list_get_and_remove() {
    let (dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    fs::write(src.path().join("f"), b"x").unwrap();
    let b = store.import_dir("b-image", src.path()).unwrap();
    let a = store.import_dir("a-image", src.path()).unwrap();
    assert_ne!(a.layers()[0].id(), b.layers()[0].id());

    let names: Vec<String> = store.list().unwrap().iter().map(|i| i.name().to_owned()).collect();
    assert_eq!(names, ["a-image", "b-image"]);
    assert_eq!(store.get("a-image").unwrap(), a);

    store.remove("a-image").unwrap();
    assert!(matches!(store.get("a-image"), Err(ImageError::NotFound(_))));
    assert!(!a.layers()[0].path().exists(), "removed image's layer stayed");
    assert!(b.layers()[0].path().is_dir());
    assert_eq!(store.list().unwrap(), vec![b]);
    assert!(matches!(store.remove("a-image"), Err(ImageError::NotFound(_))));
    assert_eq!(entries(&dir.path().join("images/tmp")), Vec::<String>::new());
}

#[test]
fn reimport_replaces_the_image_and_removes_its_old_layer() {
    let (dir, store) = new_store();
    let (v1, v2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    fs::write(v1.path().join("version"), b"1").unwrap();
    fs::write(v2.path().join("version"), b"2").unwrap();

    let old = store.import_dir("app", v1.path()).unwrap();
    let new = store.import_dir("app", v2.path()).unwrap();

    assert_eq!(store.get("app").unwrap(), new);
    assert_eq!(fs::read(new.layers()[0].path().join("version")).unwrap(), b"2");
    assert!(!old.layers()[0].path().exists());
    assert_eq!(entries(&dir.path().join("images/layers")), [new.layers()[0].id()]);
}

#[test]
fn import_layers_keeps_bottom_first_order() {
    let (_dir, store) = new_store();
    let (base, top) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    fs::write(base.path().join("which"), b"base").unwrap();
    fs::write(top.path().join("which"), b"top").unwrap();
    let image = store.import_layers("stack", &[base.path(), top.path()]).unwrap();
    let contents: Vec<Vec<u8>> = image.layers().iter().map(|l| fs::read(l.path().join("which")).unwrap()).collect();
    assert_eq!(contents, [b"base".to_vec(), b"top".to_vec()]);
}

#[test]
fn invalid_names_are_rejected_everywhere() {
    let (_dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    for name in ["", "../escape", "a/b", ".hidden", "-flag", &"x".repeat(129)] {
        assert!(matches!(store.import_dir(name, src.path()), Err(ImageError::InvalidName(_))), "{name:?}");
        assert!(matches!(store.import_tar(name, &b""[..]), Err(ImageError::InvalidName(_))), "{name:?}");
        assert!(matches!(store.get(name), Err(ImageError::InvalidName(_))), "{name:?}");
        assert!(matches!(store.remove(name), Err(ImageError::InvalidName(_))), "{name:?}");
    }
    assert!(store.import_dir(&"x".repeat(128), src.path()).is_ok());
}

#[test]
fn import_dir_of_a_file_is_not_a_directory() {
    let (dir, store) = new_store();
    let file = dir.path().join("file");
    fs::write(&file, b"x").unwrap();
    assert!(matches!(store.import_dir("img", &file), Err(ImageError::NotADirectory(_))));
    assert!(matches!(store.import_dir("img", &dir.path().join("missing")), Err(ImageError::NotADirectory(_))));
}

#[test]
fn failed_import_of_garbage_leaves_no_manifest_and_no_tmp() {
    let (dir, store) = new_store();
    let garbage = vec![0xabu8; 20 * 1024];
    match store.import_tar("junk", &garbage[..]) {
        Err(ImageError::Tar(stderr)) => assert!(stderr.contains("does not look like a tar archive"), "{stderr}"),
        other => panic!("expected a tar error, got {other:?}"),
    }
    assert_nothing_left(&dir, &store, "junk");
}

#[test]
fn failed_import_keeps_the_previous_image() {
    let (_dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    fs::write(src.path().join("f"), b"x").unwrap();
    let good = store.import_dir("app", src.path()).unwrap();
    assert!(store.import_tar("app", &[0u8, 1, 2, 3][..]).is_err());
    assert_eq!(store.get("app").unwrap(), good);
}

/// Fails after handing out some bytes, like a network stream that drops.
struct FailingReader {
    good: Vec<u8>,
}

impl Read for FailingReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.good.is_empty() {
            return Err(io::Error::new(io::ErrorKind::ConnectionReset, "stream dropped"));
        }
        let n = buf.len().min(self.good.len());
        buf[..n].copy_from_slice(&self.good[..n]);
        self.good.drain(..n);
        Ok(n)
    }
}

#[test]
fn reader_failure_is_reported_as_io_and_leaves_nothing() {
    let (dir, store) = new_store();
    let src = tempfile::tempdir().unwrap();
    fs::write(src.path().join("big"), vec![7u8; 256 * 1024]).unwrap();
    let archive = host_tar(src.path(), &[]);
    let reader = FailingReader { good: archive[..archive.len() / 2].to_vec() };
    match store.import_tar("cut", reader) {
        Err(ImageError::Io { source, .. }) => assert_eq!(source.kind(), io::ErrorKind::ConnectionReset),
        other => panic!("expected the reader's error, got {other:?}"),
    }
    assert_nothing_left(&dir, &store, "cut");
}

#[test]
fn tar_writing_through_its_own_symlink_is_rejected_and_nothing_escapes() {
    let (dir, store) = new_store();
    let outside = tempfile::tempdir().unwrap();
    let (planted, payload) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    symlink(outside.path(), planted.path().join("a")).unwrap();
    fs::create_dir(payload.path().join("a")).unwrap();
    fs::write(payload.path().join("a/pwned"), b"x").unwrap();
    // Member "a" (symlink to outside) followed by member "a/pwned".
    let out = Command::new("tar")
        .args(["-cf", "-", "-C"])
        .arg(planted.path())
        .arg("a")
        .arg("-C")
        .arg(payload.path())
        .arg("a/pwned")
        .output()
        .unwrap();
    assert!(out.status.success());

    assert!(matches!(store.import_tar("evil", &out.stdout[..]), Err(ImageError::Tar(_))));
    assert_eq!(entries(outside.path()), Vec::<String>::new(), "the archive wrote outside its layer");
    assert_nothing_left(&dir, &store, "evil");
}

#[test]
fn concurrent_imports_of_one_name_leave_one_image_and_one_layer() {
    let (dir, store) = new_store();
    let srcs: Vec<TempDir> = (0..4)
        .map(|i| {
            let src = tempfile::tempdir().unwrap();
            fs::write(src.path().join("who"), i.to_string()).unwrap();
            src
        })
        .collect();
    std::thread::scope(|s| {
        for src in &srcs {
            let store = &store;
            s.spawn(move || store.import_dir("same", src.path()).unwrap());
        }
    });
    let image = store.get("same").unwrap();
    assert_eq!(entries(&dir.path().join("images/layers")), [image.layers()[0].id()]);
    assert_eq!(entries(&dir.path().join("images/tmp")), Vec::<String>::new());
}

//! EROFS layer building against the real kernel: every image built here is
//! mounted with mount(2) as a file-backed EROFS mount (no loop device) and
//! compared with its source. Run as root.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{chown, symlink, FileExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use rustix::fs::{AtFlags, FileType, Mode, Timespec, Timestamps as Times, XattrFlags};
use rustix::mount::{MountFlags, UnmountFlags};
use sha2::{Digest, Sha256};
use tempfile::TempDir;
use warren_image::erofs::{self, BuildOptions, ErofsError, Timestamps};

/// A file-backed EROFS (or any) mount, unmounted when dropped.
struct Mounted {
    target: PathBuf,
}

impl Mounted {
    fn erofs(image: &Path, target: &Path) -> Self {
        fs::create_dir_all(target).unwrap();
        rustix::mount::mount(image, target, "erofs", MountFlags::RDONLY, None).unwrap();
        Self { target: target.to_owned() }
    }

    fn try_erofs(image: &Path, target: &Path) -> rustix::io::Result<Self> {
        fs::create_dir_all(target).unwrap();
        rustix::mount::mount(image, target, "erofs", MountFlags::RDONLY, None)?;
        Ok(Self { target: target.to_owned() })
    }

    fn overlay(lowers: &[&Path], target: &Path) -> Self {
        fs::create_dir_all(target).unwrap();
        let lowerdir: Vec<String> = lowers.iter().map(|p| p.display().to_string()).collect();
        let data = std::ffi::CString::new(format!("lowerdir={}", lowerdir.join(":"))).unwrap();
        rustix::mount::mount("overlay", target, "overlay", MountFlags::RDONLY, Some(data.as_c_str())).unwrap();
        Self { target: target.to_owned() }
    }

    /// The `source` field of this mount in /proc/self/mountinfo.
    fn source(&self) -> String {
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let target = self.target.display().to_string();
        let line = info.lines().find(|l| l.split(' ').nth(4) == Some(target.as_str())).unwrap();
        let after = line.split(" - ").nth(1).unwrap();
        after.split(' ').nth(1).unwrap().to_owned()
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if rustix::mount::unmount(&self.target, UnmountFlags::empty()).is_err() {
            let _ = rustix::mount::unmount(&self.target, UnmountFlags::DETACH);
        }
    }
}

fn set_mtime(path: &Path, secs: i64, nsecs: i64) {
    let t = Timespec { tv_sec: secs, tv_nsec: nsecs };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &Times { last_access: t, last_modification: t },
        AtFlags::SYMLINK_NOFOLLOW,
    )
    .unwrap();
}

fn mknod(path: &Path, kind: FileType, mode: u32, dev: (u32, u32)) {
    rustix::fs::mknodat(rustix::fs::CWD, path, kind, Mode::from_raw_mode(mode), rustix::fs::makedev(dev.0, dev.1))
        .unwrap();
}

/// Every kind of entry a layer carries. `reverse` creates them in the
/// opposite order (different readdir order and inode numbers).
fn make_rich_tree(root: &Path, reverse: bool) {
    type Step = Box<dyn Fn(&Path)>;
    let mut steps: Vec<Step> = vec![
        Box::new(|r| {
            let f = r.join("suid");
            fs::write(&f, b"payload").unwrap();
            chown(&f, Some(1234), Some(5678)).unwrap();
            fs::set_permissions(&f, fs::Permissions::from_mode(0o4750)).unwrap();
            rustix::fs::setxattr(&f, "user.test", b"hello", XattrFlags::empty()).unwrap();
            rustix::fs::setxattr(&f, "trusted.note", b"t", XattrFlags::empty()).unwrap();
            fs::hard_link(&f, r.join("hard-link")).unwrap();
        }),
        Box::new(|r| {
            symlink("suid", r.join("relative-link")).unwrap();
            symlink("/etc/passwd", r.join("absolute-link")).unwrap();
            symlink("x".repeat(3000), r.join("long-link")).unwrap();
        }),
        Box::new(|r| {
            let f = r.join("ping");
            fs::write(&f, b"#!/bin/sh\n").unwrap();
            fs::set_permissions(&f, fs::Permissions::from_mode(0o755)).unwrap();
            // cap_net_raw+ep, VFS_CAP_REVISION_2
            let cap = [0, 0, 0, 2, 0, 0x20, 0, 0, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
            rustix::fs::setxattr(&f, "security.capability", &cap, XattrFlags::empty()).unwrap();
        }),
        Box::new(|r| {
            fs::create_dir(r.join("dev")).unwrap();
            mknod(&r.join("dev/null"), FileType::CharacterDevice, 0o666, (1, 3));
            mknod(&r.join("dev/whiteout"), FileType::CharacterDevice, 0, (0, 0));
            mknod(&r.join("fifo"), FileType::Fifo, 0o600, (0, 0));
            drop(std::os::unix::net::UnixListener::bind(r.join("socket")).unwrap());
        }),
        Box::new(|r| {
            let d = r.join("opaque");
            fs::create_dir(&d).unwrap();
            fs::write(d.join("kept"), b"k").unwrap();
            rustix::fs::setxattr(&d, "trusted.overlay.opaque", b"y", XattrFlags::empty()).unwrap();
        }),
        Box::new(|r| {
            // Multi-block files with unaligned tails, an empty file, and a
            // directory large enough to need full directory blocks.
            fs::write(r.join("big"), pattern(3 * 4096 + 123, 1)).unwrap();
            fs::write(r.join("exact"), pattern(2 * 4096, 2)).unwrap();
            fs::write(r.join("empty"), b"").unwrap();
            let many = r.join("many");
            fs::create_dir(&many).unwrap();
            for i in 0..300 {
                fs::write(many.join(format!("entry-with-a-long-name-{i:04}")), format!("{i}")).unwrap();
            }
        }),
        Box::new(|r| {
            let p = r.join("private");
            fs::create_dir(&p).unwrap();
            fs::write(p.join("secret"), pattern(5000, 3)).unwrap();
            chown(&p, Some(70_000), Some(70_001)).unwrap();
            fs::set_permissions(&p, fs::Permissions::from_mode(0o700)).unwrap();
        }),
    ];
    if reverse {
        steps.reverse();
    }
    for step in &steps {
        step(root);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// Gives every entry under `dst` the mtime of the same entry under `src`
/// (deepest first, since touching an entry changes its parent's mtime).
fn copy_mtimes(src: &Path, dst: &Path) {
    let mut paths: Vec<PathBuf> = walk(src).into_iter().collect();
    paths.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for rel in paths {
        let meta = fs::symlink_metadata(src.join(&rel)).unwrap();
        set_mtime(&dst.join(&rel), meta.mtime(), meta.mtime_nsec());
    }
}

/// Relative paths of everything under `root`, including "" for the root.
fn walk(root: &Path) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::new()];
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in fs::read_dir(root.join(&rel)).unwrap() {
            let entry = entry.unwrap();
            let child = rel.join(entry.file_name());
            if entry.file_type().unwrap().is_dir() {
                stack.push(child.clone());
            }
            out.push(child);
        }
    }
    out.sort();
    out
}

/// Everything a layer must preserve about one entry.
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    kind: String,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    rdev: u64,
    size: Option<u64>,
    content: Option<String>,
    link: Option<PathBuf>,
    xattrs: BTreeMap<String, Vec<u8>>,
    /// The first path sharing this inode (hard links).
    same_as: PathBuf,
}

fn snapshot(root: &Path, with_content: bool) -> BTreeMap<PathBuf, Entry> {
    let mut first_of_inode: BTreeMap<u64, PathBuf> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for rel in walk(root) {
        let path = root.join(&rel);
        let meta = fs::symlink_metadata(&path).unwrap();
        let ft = meta.file_type();
        let kind = if ft.is_dir() {
            "dir"
        } else if ft.is_symlink() {
            "symlink"
        } else if ft.is_file() {
            "file"
        } else if ft.is_char_device() {
            "char"
        } else if ft.is_fifo() {
            "fifo"
        } else if ft.is_socket() {
            "socket"
        } else {
            "other"
        };
        let same_as = if ft.is_file() {
            first_of_inode.entry(meta.ino()).or_insert_with(|| rel.clone()).clone()
        } else {
            rel.clone()
        };
        let content = (ft.is_file() && with_content).then(|| format!("{:x}", Sha256::digest(fs::read(&path).unwrap())));
        out.insert(
            rel.clone(),
            Entry {
                kind: kind.to_owned(),
                mode: meta.mode(),
                uid: meta.uid(),
                gid: meta.gid(),
                mtime: (meta.mtime(), meta.mtime_nsec()),
                rdev: meta.rdev(),
                size: ft.is_file().then(|| meta.size()),
                content,
                link: ft.is_symlink().then(|| fs::read_link(&path).unwrap()),
                xattrs: xattrs(&path),
                same_as,
            },
        );
    }
    out
}

fn xattrs(path: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut names = vec![0u8; 64 * 1024];
    let n = rustix::fs::llistxattr(path, &mut names).unwrap();
    let mut out = BTreeMap::new();
    for name in names[..n].split(|&b| b == 0).filter(|s| !s.is_empty()) {
        let name = String::from_utf8(name.to_vec()).unwrap();
        let mut value = vec![0u8; 64 * 1024];
        let len = rustix::fs::lgetxattr(path, name.as_str(), &mut value).unwrap();
        out.insert(name, value[..len].to_vec());
    }
    out
}

fn assert_same_trees(a: &BTreeMap<PathBuf, Entry>, b: &BTreeMap<PathBuf, Entry>) {
    let only_a: Vec<_> = a.keys().filter(|k| !b.contains_key(*k)).collect();
    let only_b: Vec<_> = b.keys().filter(|k| !a.contains_key(*k)).collect();
    assert!(only_a.is_empty() && only_b.is_empty(), "only in source: {only_a:?}, only in layer: {only_b:?}");
    for (path, entry) in a {
        assert_eq!(Some(entry), b.get(path), "{}", path.display());
    }
}

fn build_dir(src: &Path, dest: &Path) -> erofs::BuiltLayer {
    erofs::build_from_dir(src, dest, &BuildOptions::default()).unwrap()
}

fn leftovers(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect()
}

fn tar_of(dir: &Path, archive: &Path) {
    let status = Command::new("tar")
        .args(["--create", "--sort=name", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--format=pax"])
        .arg(format!("--file={}", archive.display()))
        .arg("-C")
        .arg(dir)
        .arg(".")
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn dir_layer_mounts_file_backed_with_owners_modes_xattrs_links_and_special_files() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    let layer = build_dir(&src, &tmp.path().join("layer.erofs"));
    assert_eq!(layer.size, fs::metadata(&layer.path).unwrap().len());
    let expected_digest = format!("sha256:{:x}", Sha256::digest(fs::read(&layer.path).unwrap()));
    assert_eq!(layer.digest, expected_digest);

    let mnt = Mounted::erofs(&layer.path, &tmp.path().join("mnt"));
    // A true file-backed mount names the file itself, not a loop device.
    assert_eq!(mnt.source(), layer.path.display().to_string());
    assert_same_trees(&snapshot(&src, true), &snapshot(&mnt.target, true));
    assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
}

#[test]
fn same_tree_made_in_different_order_builds_to_the_same_digest() {
    let tmp = TempDir::new().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    fs::create_dir(&a).unwrap();
    fs::create_dir(&b).unwrap();
    make_rich_tree(&a, false);
    make_rich_tree(&b, true);
    copy_mtimes(&a, &b);
    let built_a = build_dir(&a, &tmp.path().join("a.erofs"));
    let built_b = build_dir(&b, &tmp.path().join("b.erofs"));
    assert_eq!(built_a.digest, built_b.digest);
    assert_eq!(built_a.metadata_ranges, built_b.metadata_ranges);

    // And the digest does follow the content.
    fs::write(b.join("big"), pattern(3 * 4096 + 123, 9)).unwrap();
    copy_mtimes(&a, &b);
    assert_ne!(build_dir(&b, &tmp.path().join("c.erofs")).digest, built_a.digest);
}

#[test]
fn tar_layers_are_reproducible_and_keep_whiteout_markers_as_files() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    // GNU tar does not archive sockets.
    fs::remove_file(src.join("socket")).unwrap();
    fs::write(src.join(".wh.gone"), b"").unwrap();
    let archive = tmp.path().join("layer.tar");
    tar_of(&src, &archive);

    let opts = BuildOptions::default();
    let one = erofs::build_from_tar(fs::File::open(&archive).unwrap(), &tmp.path().join("1.erofs"), &opts).unwrap();
    let two = erofs::build_from_tar(fs::File::open(&archive).unwrap(), &tmp.path().join("2.erofs"), &opts).unwrap();
    assert_eq!(one.digest, two.digest);

    let mnt = Mounted::erofs(&one.path, &tmp.path().join("mnt"));
    let mut want = snapshot(&src, true);
    let mut got = snapshot(&mnt.target, true);
    // The layer root's mtime is pinned to the build time (0 by default).
    assert_eq!(got[Path::new("")].mtime, (0, 0));
    for tree in [&mut want, &mut got] {
        tree.get_mut(Path::new("")).unwrap().mtime = (0, 0);
    }
    assert_same_trees(&want, &got);
    assert!(mnt.target.join(".wh.gone").metadata().unwrap().is_file());
}

#[test]
fn fixed_timestamps_make_the_image_independent_of_input_mtimes() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    let opts = BuildOptions { timestamps: Timestamps::Fixed(1_700_000_000), ..BuildOptions::default() };
    let first = erofs::build_from_dir(&src, &tmp.path().join("1.erofs"), &opts).unwrap();
    set_mtime(&src.join("big"), 12345, 6789);
    let second = erofs::build_from_dir(&src, &tmp.path().join("2.erofs"), &opts).unwrap();
    assert_eq!(first.digest, second.digest);
    let preserved = build_dir(&src, &tmp.path().join("3.erofs"));
    let mnt = Mounted::erofs(&preserved.path, &tmp.path().join("mnt"));
    let meta = fs::metadata(mnt.target.join("big")).unwrap();
    assert_eq!((meta.mtime(), meta.mtime_nsec()), (12345, 6789));
}

const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_DATA_INLINE: u32 = 0x200;

/// Physical extents of a file on the mounted image, as `(offset, len,
/// flags)`, asked from the kernel with FS_IOC_FIEMAP.
fn fiemap(path: &Path) -> Vec<(u64, u64, u32)> {
    const EXTENTS: usize = 64;
    const HEADER_WORDS: usize = 4; // start, length, flags+mapped, count+reserved
    const EXTENT_WORDS: usize = 7; // logical, physical, length, 2 reserved, flags+2 reserved
    let file = fs::File::open(path).unwrap();
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut buf = vec![0u64; HEADER_WORDS + EXTENTS * EXTENT_WORDS];
        buf[0] = start;
        buf[1] = u64::MAX;
        buf[3] = EXTENTS as u64; // fm_extent_count (low half), reserved 0
                                 // SAFETY: `buf` is a struct fiemap followed by room for EXTENTS
                                 // extents, 8-byte aligned, and lives across the call.
        let rc = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&file), FS_IOC_FIEMAP, buf.as_mut_ptr()) };
        assert_eq!(rc, 0, "FIEMAP {}: {}", path.display(), std::io::Error::last_os_error());
        let mapped = (buf[2] >> 32) as usize;
        let mut last = mapped == 0;
        for i in 0..mapped {
            let e = &buf[HEADER_WORDS + i * EXTENT_WORDS..];
            let flags = e[5] as u32;
            out.push((e[1], e[2], flags));
            start = e[0] + e[2];
            last |= flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last {
            return out;
        }
    }
}

#[test]
fn metadata_map_is_the_exact_complement_of_fiemap_data_extents() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    for i in 0..40 {
        fs::write(src.join(format!("f{i:02}")), pattern(i * 1500, i as u8)).unwrap();
    }
    for (name, inline) in [("inline", true), ("noinline", false)] {
        let opts = BuildOptions { inline_tails: inline, ..BuildOptions::default() };
        let layer = erofs::build_from_dir(&src, &tmp.path().join(format!("{name}.erofs")), &opts).unwrap();
        let block = erofs::block_size(&layer.path).unwrap();

        // Data blocks as the kernel maps them, rounded out to blocks.
        let mnt = Mounted::erofs(&layer.path, &tmp.path().join(format!("mnt-{name}")));
        let mut kernel: Vec<(u64, u64)> = Vec::new();
        for rel in walk(&mnt.target) {
            let path = mnt.target.join(&rel);
            if !fs::symlink_metadata(&path).unwrap().is_file() {
                continue;
            }
            for (physical, len, flags) in fiemap(&path) {
                if flags & FIEMAP_EXTENT_DATA_INLINE != 0 {
                    // Inline tails live in the metadata area: check they do.
                    assert!(in_ranges(&layer.metadata_ranges, physical, len), "{} tail", rel.display());
                    continue;
                }
                kernel.push((physical / block * block, len.div_ceil(block) * block));
            }
        }
        let kernel = merge(kernel);
        let parsed: Vec<(u64, u64)> =
            erofs::data_ranges(&layer.path).unwrap().into_iter().map(|r| (r.start, r.end - r.start)).collect();
        assert_eq!(parsed, kernel, "{name}: parsed data ranges differ from FIEMAP");
        assert!(!parsed.is_empty());

        // Metadata and data tile the file exactly.
        let mut all = layer.metadata_ranges.clone();
        all.extend(&parsed);
        all.sort();
        let mut at = 0;
        for (offset, len) in all {
            assert_eq!(offset, at, "{name}: gap or overlap at {offset}");
            at = offset + len;
        }
        assert_eq!(at, layer.size);
        assert_eq!(erofs::metadata_ranges(&layer.path).unwrap(), layer.metadata_ranges);
    }
}

fn in_ranges(ranges: &[(u64, u64)], offset: u64, len: u64) -> bool {
    ranges.iter().any(|&(o, l)| offset >= o && offset + len <= o + l)
}

fn merge(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (o, l) in ranges {
        match out.last_mut() {
            Some((lo, ll)) if o <= *lo + *ll => *ll = (*ll).max(o + l - *lo),
            _ => out.push((o, l)),
        }
    }
    out
}

#[test]
fn image_holding_only_its_metadata_ranges_mounts_and_lists_everything() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    let layer = build_dir(&src, &tmp.path().join("full.erofs"));

    // A sparse copy with only the metadata map filled in: what a lazy node
    // holds right after pulling the layer.
    let full = fs::File::open(&layer.path).unwrap();
    let sparse_path = tmp.path().join("sparse.erofs");
    let sparse = fs::File::create(&sparse_path).unwrap();
    sparse.set_len(layer.size).unwrap();
    for &(offset, len) in &layer.metadata_ranges {
        let mut buf = vec![0u8; len as usize];
        full.read_exact_at(&mut buf, offset).unwrap();
        sparse.write_all_at(&buf, offset).unwrap();
    }
    drop(sparse);

    let mnt = Mounted::erofs(&sparse_path, &tmp.path().join("mnt"));
    // Names, owners, modes, times, xattrs, link targets: all metadata.
    assert_same_trees(&snapshot(&src, false), &snapshot(&mnt.target, false));
    // Data blocks were not copied, so multi-block files read as zeros up to
    // their inline tail, while small inline files are whole.
    let mut big = Vec::new();
    fs::File::open(mnt.target.join("big")).unwrap().read_to_end(&mut big).unwrap();
    assert!(big[..3 * 4096].iter().all(|&b| b == 0));
    assert_eq!(fs::read(mnt.target.join("suid")).unwrap(), b"payload");
}

#[test]
fn oci_whiteouts_hide_lower_entries_through_overlayfs() {
    let tmp = TempDir::new().unwrap();
    let lower_src = tmp.path().join("lower-src");
    fs::create_dir_all(lower_src.join("dir")).unwrap();
    fs::write(lower_src.join("gone"), b"old").unwrap();
    fs::write(lower_src.join("stays"), b"old").unwrap();
    fs::write(lower_src.join("dir/old"), b"old").unwrap();
    let lower = build_dir(&lower_src, &tmp.path().join("lower.erofs"));

    let upper_src = tmp.path().join("upper-src");
    fs::create_dir_all(upper_src.join("dir")).unwrap();
    fs::write(upper_src.join(".wh.gone"), b"").unwrap();
    fs::write(upper_src.join("dir/.wh..wh..opq"), b"").unwrap();
    fs::write(upper_src.join("dir/new"), b"new").unwrap();
    // A whiteout next to the entry it names, in the same layer: the entry
    // wins, per the OCI spec.
    fs::write(upper_src.join(".wh.stays"), b"").unwrap();
    fs::write(upper_src.join("stays"), b"new").unwrap();
    set_mtime(&upper_src.join("dir"), 1_600_000_000, 5);
    let archive = tmp.path().join("upper.tar");
    tar_of(&upper_src, &archive);
    let upper = erofs::build_from_oci_layer(
        fs::File::open(&archive).unwrap(),
        &tmp.path().join("upper.erofs"),
        &BuildOptions::default(),
    )
    .unwrap();

    let lower_mnt = Mounted::erofs(&lower.path, &tmp.path().join("lower"));
    let upper_mnt = Mounted::erofs(&upper.path, &tmp.path().join("upper"));
    let gone = fs::symlink_metadata(upper_mnt.target.join("gone")).unwrap();
    assert!(gone.file_type().is_char_device() && gone.rdev() == 0);
    assert!(!upper_mnt.target.join(".wh.gone").exists());
    assert!(!upper_mnt.target.join("dir/.wh..wh..opq").exists());
    assert_eq!(xattrs(&upper_mnt.target.join("dir")).get("trusted.overlay.opaque"), Some(&b"y".to_vec()));
    // Converting markers must not disturb the directory's own time.
    let dir_meta = fs::metadata(upper_mnt.target.join("dir")).unwrap();
    assert_eq!((dir_meta.mtime(), dir_meta.mtime_nsec()), (1_600_000_000, 5));

    let merged = Mounted::overlay(&[&upper_mnt.target, &lower_mnt.target], &tmp.path().join("merged"));
    let names = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> =
            fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    assert_eq!(names(&merged.target), ["dir", "stays"]);
    assert_eq!(names(&merged.target.join("dir")), ["new"]);
    assert_eq!(fs::read(merged.target.join("stays")).unwrap(), b"new");
}

#[test]
fn truncated_archive_fails_and_leaves_nothing_behind() {
    let tmp = TempDir::new().unwrap();
    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("big"), pattern(100_000, 1)).unwrap();
    let archive = tmp.path().join("layer.tar");
    tar_of(&src, &archive);
    let bytes = fs::read(&archive).unwrap();
    let out = tmp.path().join("out");
    fs::create_dir(&out).unwrap();
    let dest = out.join("layer.erofs");
    let err = erofs::build_from_tar(&bytes[..bytes.len() / 2], &dest, &BuildOptions::default()).unwrap_err();
    assert!(matches!(err, ErofsError::Extract(_)), "{err}");
    assert!(err.to_string().contains("Unexpected EOF"), "{err}");
    assert_eq!(fs::read_dir(&out).unwrap().count(), 0);
}

#[test]
fn non_erofs_and_corrupt_images_are_refused_not_mapped() {
    let tmp = TempDir::new().unwrap();
    let junk = tmp.path().join("junk");
    fs::write(&junk, pattern(8192, 7)).unwrap();
    assert!(matches!(erofs::metadata_ranges(&junk), Err(ErofsError::Format { .. })));

    let src = tmp.path().join("src");
    fs::create_dir(&src).unwrap();
    make_rich_tree(&src, false);
    let layer = build_dir(&src, &tmp.path().join("layer.erofs"));
    // Point the root inode past the end of the image.
    let file = fs::OpenOptions::new().write(true).open(&layer.path).unwrap();
    file.write_all_at(&u16::MAX.to_le_bytes(), 1024 + 14).unwrap();
    file.write_all_at(&u32::MAX.to_le_bytes(), 1024 + 40).unwrap();
    assert!(matches!(erofs::metadata_ranges(&layer.path), Err(ErofsError::Format { .. })));
    // And the kernel agrees the superblock is no longer valid.
    assert!(Mounted::try_erofs(&layer.path, &tmp.path().join("mnt")).is_err());
}

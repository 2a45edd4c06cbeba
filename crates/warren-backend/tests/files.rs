//! The file API against a plain directory standing in for a sandbox root.
//! The "sandbox" plants symlinks and swaps components from a thread; the
//! tests then check the host side is untouched.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{Mode, OFlags};
use warren_api::FileKind;
use warren_backend::files::{self, FileError};
use warren_backend::FsRoot;

const HOST_SECRET: &[u8] = b"host secret, must never be read or changed";

/// A temp dir as the sandbox's root, opened the way the container driver
/// hands it over (`O_PATH | O_DIRECTORY`).
struct Sandbox {
    dir: tempfile::TempDir,
    fs: FsRoot,
}

impl Sandbox {
    fn new() -> Self {
        Self::with_owner(rustix::process::geteuid().as_raw(), rustix::process::getegid().as_raw())
    }

    fn with_owner(uid: u32, gid: u32) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let fs = FsRoot { dir: open_root(dir.path()), uid, gid };
        Sandbox { dir, fs }
    }

    /// The host path of `rel` inside the root (tests only).
    fn host(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel.trim_start_matches('/'))
    }

    fn upload(&self, path: &str, data: &[u8], mode: u32) -> Result<warren_api::FileStat, FileError> {
        let mut w = files::create_write(&self.fs, path, mode)?;
        w.append(data)?;
        w.commit()
    }

    fn download(&self, path: &str) -> Result<Vec<u8>, FileError> {
        let mut f = files::open_read(&self.fs, path)?;
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut f, &mut buf).unwrap();
        Ok(buf)
    }
}

fn open_root(path: &Path) -> std::os::fd::OwnedFd {
    rustix::fs::open(path, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).unwrap()
}

/// A host directory outside every sandbox, filled with files an escape
/// would read, overwrite or delete.
fn host_dir() -> tempfile::TempDir {
    let host = tempfile::tempdir().unwrap();
    fs::write(host.path().join("passwd"), HOST_SECRET).unwrap();
    fs::write(host.path().join("f"), HOST_SECRET).unwrap();
    fs::create_dir(host.path().join("d")).unwrap();
    fs::write(host.path().join("d/g"), HOST_SECRET).unwrap();
    host
}

/// Everything below `dir` (names, kinds, modes, owners, contents, link
/// targets), without following symlinks.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u32, u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(p) = todo.pop() {
        let meta = fs::symlink_metadata(&p).unwrap();
        let content = if meta.is_dir() {
            for e in fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
            Vec::new()
        } else if meta.file_type().is_symlink() {
            fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes()
        } else {
            fs::read(&p).unwrap()
        };
        out.insert(p, (meta.mode(), meta.uid(), content));
    }
    out
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Unmounts (lazily) on drop, also when the test panics.
struct MountGuard(PathBuf);

impl MountGuard {
    fn tmpfs(target: &Path, options: &str) -> Self {
        let data = std::ffi::CString::new(options).unwrap();
        rustix::mount::mount("warren-test", target, "tmpfs", rustix::mount::MountFlags::empty(), data.as_c_str())
            .unwrap();
        MountGuard(target.to_path_buf())
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

// ---------------------------------------------------------------- function

#[test]
fn round_trip_write_read_stat_list_mkdir_remove() {
    let sb = Sandbox::new();
    let dir = files::mkdir(&sb.fs, "/work", 0o755, false).unwrap();
    assert_eq!((dir.path.as_str(), dir.kind, dir.mode), ("/work", FileKind::Dir, 0o755));

    let st = sb.upload("/work/b.txt", b"hello", 0o644).unwrap();
    assert_eq!((st.path.as_str(), st.kind, st.size_bytes, st.mode), ("/work/b.txt", FileKind::File, 5, 0o644));
    assert!(st.modified_at_ms > 1_600_000_000_000);
    sb.upload("/work/a.txt", b"", 0o600).unwrap();
    files::mkdir(&sb.fs, "/work/c", 0o700, false).unwrap();
    assert_eq!(sb.download("/work/b.txt").unwrap(), b"hello");
    assert_eq!(fs::read(sb.host("work/b.txt")).unwrap(), b"hello");

    let stat = files::stat(&sb.fs, "//work/./b.txt").unwrap();
    assert_eq!(stat, st);
    let list = files::list(&sb.fs, "/work/").unwrap();
    assert_eq!(list.path, "/work");
    let names: Vec<_> = list.entries.iter().map(|e| (e.path.as_str(), e.kind)).collect();
    assert_eq!(names, [("/work/a.txt", FileKind::File), ("/work/b.txt", FileKind::File), ("/work/c", FileKind::Dir)]);

    let root = files::list(&sb.fs, "/").unwrap();
    assert_eq!(root.entries.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(), ["/work"]);
    assert_eq!(files::stat(&sb.fs, "/").unwrap().kind, FileKind::Dir);

    files::remove(&sb.fs, "/work/b.txt", false).unwrap();
    assert!(matches!(files::stat(&sb.fs, "/work/b.txt"), Err(FileError::NotFound)));
    assert!(matches!(files::remove(&sb.fs, "/work", false), Err(FileError::Conflict(_))));
    files::remove(&sb.fs, "/work", true).unwrap();
    assert!(!sb.host("work").exists());
    assert!(matches!(files::remove(&sb.fs, "/work", true), Err(FileError::NotFound)));
}

#[test]
fn modes_are_honoured_regardless_of_umask() {
    let sb = Sandbox::new();
    sb.upload("/x", b"#!/bin/sh\n", 0o4777).unwrap();
    assert_eq!(fs::metadata(sb.host("x")).unwrap().permissions().mode() & 0o7777, 0o4777);
    sb.upload("/y", b"", 0o000).unwrap();
    assert_eq!(fs::metadata(sb.host("y")).unwrap().permissions().mode() & 0o7777, 0);
    files::mkdir(&sb.fs, "/a/b", 0o777, true).unwrap();
    assert_eq!(fs::metadata(sb.host("a")).unwrap().permissions().mode() & 0o7777, 0o777);
    assert_eq!(fs::metadata(sb.host("a/b")).unwrap().permissions().mode() & 0o7777, 0o777);
}

#[test]
fn new_files_and_dirs_belong_to_the_sandbox_root_owner() {
    if !is_root() {
        eprintln!("skipped: chown needs root");
        return;
    }
    let sb = Sandbox::with_owner(123_456, 123_457);
    sb.upload("/f", b"x", 0o6755).unwrap();
    files::mkdir(&sb.fs, "/p/q", 0o755, true).unwrap();
    for rel in ["f", "p", "p/q"] {
        let meta = fs::metadata(sb.host(rel)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (123_456, 123_457), "{rel}");
    }
    // chown clears set-id bits; the mode is applied after it.
    assert_eq!(fs::metadata(sb.host("f")).unwrap().permissions().mode() & 0o7777, 0o6755);
}

#[test]
fn mkdir_parents_accepts_existing_dirs_and_refuses_files() {
    let sb = Sandbox::new();
    assert!(matches!(files::mkdir(&sb.fs, "/a/b", 0o755, false), Err(FileError::NotFound)));
    files::mkdir(&sb.fs, "/a/b/c", 0o755, true).unwrap();
    files::mkdir(&sb.fs, "/a/b/c", 0o755, true).unwrap();
    files::mkdir(&sb.fs, "/", 0o755, true).unwrap();
    assert!(matches!(files::mkdir(&sb.fs, "/a/b", 0o755, false), Err(FileError::Conflict(_))));
    assert!(matches!(files::mkdir(&sb.fs, "/", 0o755, false), Err(FileError::Conflict(_))));
    sb.upload("/a/file", b"", 0o644).unwrap();
    assert!(matches!(files::mkdir(&sb.fs, "/a/file", 0o755, true), Err(FileError::Conflict(_))));
    assert!(matches!(files::mkdir(&sb.fs, "/a/file/sub", 0o755, true), Err(FileError::Conflict(_))));
    assert!(matches!(files::mkdir(&sb.fs, "/a/file/sub", 0o755, false), Err(FileError::NotDirectory)));
    // A symlink to a directory inside the root is as good as the directory.
    symlink("a/b", sb.host("ab")).unwrap();
    files::mkdir(&sb.fs, "/ab/new", 0o755, true).unwrap();
    assert!(sb.host("a/b/new").is_dir());
}

#[test]
fn upload_replaces_a_file_and_refuses_a_directory() {
    let sb = Sandbox::new();
    sb.upload("/f", b"old", 0o644).unwrap();
    let reader = files::open_read(&sb.fs, "/f").unwrap();
    sb.upload("/f", b"new content", 0o600).unwrap();
    assert_eq!(sb.download("/f").unwrap(), b"new content");
    // Atomic replacement: a reader of the old file keeps the old content.
    assert_eq!(std::io::read_to_string(reader).unwrap(), "old");

    files::mkdir(&sb.fs, "/d", 0o755, false).unwrap();
    assert!(matches!(files::create_write(&sb.fs, "/d", 0o644), Err(FileError::IsDirectory)));
    // A directory appearing during the upload is not replaced either.
    let mut w = files::create_write(&sb.fs, "/later", 0o644).unwrap();
    w.append(b"data").unwrap();
    fs::create_dir(sb.host("later")).unwrap();
    assert!(matches!(w.commit(), Err(FileError::IsDirectory)));
    assert!(sb.host("later").is_dir());
    assert_eq!(fs::read_dir(sb.dir.path()).unwrap().count(), 3, "no temp file left behind");
}

#[test]
fn abandoned_upload_leaves_nothing_behind() {
    let sb = Sandbox::new();
    sb.upload("/keep", b"v1", 0o644).unwrap();
    let mut w = files::create_write(&sb.fs, "/keep", 0o644).unwrap();
    w.append(b"partial").unwrap();
    drop(w);
    assert_eq!(sb.download("/keep").unwrap(), b"v1");
    let names: Vec<_> = fs::read_dir(sb.dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["keep"]);
}

#[test]
fn upload_into_a_missing_directory_is_not_found() {
    let sb = Sandbox::new();
    assert!(matches!(files::create_write(&sb.fs, "/nope/f", 0o644), Err(FileError::NotFound)));
    sb.upload("/file", b"", 0o644).unwrap();
    assert!(matches!(files::create_write(&sb.fs, "/file/f", 0o644), Err(FileError::NotDirectory)));
    assert!(matches!(files::create_write(&sb.fs, "/", 0o644), Err(FileError::InvalidPath(_))));
}

#[test]
fn full_filesystem_is_no_space() {
    if !is_root() {
        eprintln!("skipped: mounting tmpfs needs root");
        return;
    }
    let outer = tempfile::tempdir().unwrap();
    let _mount = MountGuard::tmpfs(outer.path(), "size=64k");
    let fs_root = FsRoot { dir: open_root(outer.path()), uid: 0, gid: 0 };
    let mut w = files::create_write(&fs_root, "/big", 0o644).unwrap();
    let chunk = vec![7u8; 64 * 1024];
    let err = (0..4).try_for_each(|_| w.append(&chunk)).unwrap_err();
    assert!(matches!(err, FileError::NoSpace), "{err:?}");
}

#[test]
fn reading_refuses_directories_fifos_and_devices() {
    let sb = Sandbox::new();
    files::mkdir(&sb.fs, "/d", 0o755, false).unwrap();
    assert!(matches!(files::open_read(&sb.fs, "/d"), Err(FileError::IsDirectory)));
    assert!(matches!(files::open_read(&sb.fs, "/"), Err(FileError::IsDirectory)));
    // Opening a FIFO for reading would block until a writer came.
    let root = open_root(sb.dir.path());
    rustix::fs::mknodat(&root, "fifo", rustix::fs::FileType::Fifo, Mode::from_bits_truncate(0o666), 0).unwrap();
    assert!(matches!(files::open_read(&sb.fs, "/fifo"), Err(FileError::Conflict(_))));
    assert_eq!(files::stat(&sb.fs, "/fifo").unwrap().kind, FileKind::Other);
    if is_root() {
        let null = rustix::fs::makedev(1, 3);
        let mode = Mode::from_bits_truncate(0o666);
        rustix::fs::mknodat(&root, "null", rustix::fs::FileType::CharacterDevice, mode, null).unwrap();
        assert!(matches!(files::open_read(&sb.fs, "/null"), Err(FileError::Conflict(_))));
    }
}

#[test]
fn malformed_paths_are_invalid() {
    let sb = Sandbox::new();
    for bad in ["", "relative", "a/../b", "/a\0b"] {
        assert!(matches!(files::stat(&sb.fs, bad), Err(FileError::InvalidPath(_))), "{bad:?}");
    }
    let long = format!("/{}", "a/".repeat(files::MAX_PATH_BYTES / 2));
    assert!(matches!(files::stat(&sb.fs, &long), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::stat(&sb.fs, &format!("/{}", "n".repeat(300))), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::remove(&sb.fs, "/", true), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::remove(&sb.fs, "/..", true), Err(FileError::InvalidPath(_))));
}

// ---------------------------------------------------------------- security

#[test]
fn dotdot_beyond_root_stays_inside() {
    let sb = Sandbox::new();
    assert!(matches!(sb.download("/../../etc/passwd"), Err(FileError::NotFound)));
    assert!(matches!(files::stat(&sb.fs, "/../../etc/passwd"), Err(FileError::NotFound)));
    assert!(matches!(files::list(&sb.fs, "/../../etc"), Err(FileError::NotFound)));
    // The root's own `..` is the root.
    let up = files::list(&sb.fs, "/..").unwrap();
    assert_eq!((up.path.as_str(), up.entries.len()), ("/", 0));
    files::mkdir(&sb.fs, "/etc", 0o755, false).unwrap();
    sb.upload("/etc/passwd", b"inside", 0o644).unwrap();
    assert_eq!(sb.download("/../../etc/passwd").unwrap(), b"inside");
}

#[test]
fn absolute_symlink_resolves_inside_root() {
    let sb = Sandbox::new();
    let host = host_dir();
    symlink(host.path(), sb.host("evil")).unwrap();
    symlink("/etc", sb.host("etc-link")).unwrap();
    assert!(matches!(sb.download("/evil/passwd"), Err(FileError::NotFound)));
    assert!(matches!(sb.download("/etc-link/passwd"), Err(FileError::NotFound)));
    assert!(matches!(files::list(&sb.fs, "/evil"), Err(FileError::NotFound)));
    // The same target, created inside the root, is what the link means.
    let inside = sb.host(host.path().to_str().unwrap());
    fs::create_dir_all(&inside).unwrap();
    fs::write(inside.join("passwd"), b"inside").unwrap();
    assert_eq!(sb.download("/evil/passwd").unwrap(), b"inside");
}

#[test]
fn relative_dotdot_symlink_resolves_inside_root() {
    let sb = Sandbox::new();
    let host = host_dir();
    fs::create_dir(sb.host("a")).unwrap();
    symlink("../../../../../../../../etc", sb.host("a/up")).unwrap();
    let host_rel = format!("../../../../../../../..{}", host.path().display());
    symlink(&host_rel, sb.host("a/host")).unwrap();
    assert!(matches!(sb.download("/a/up/passwd"), Err(FileError::NotFound)));
    assert!(matches!(sb.download("/a/host/passwd"), Err(FileError::NotFound)));
    assert!(matches!(files::stat(&sb.fs, "/a/host/passwd"), Err(FileError::NotFound)));
    fs::create_dir(sb.host("etc")).unwrap();
    fs::write(sb.host("etc/passwd"), b"inside").unwrap();
    assert_eq!(sb.download("/a/up/passwd").unwrap(), b"inside");
}

#[test]
fn write_through_symlinked_parent_lands_inside_root() {
    let sb = Sandbox::new();
    let host = host_dir();
    let before = snapshot(host.path());
    symlink(host.path(), sb.host("out")).unwrap();
    symlink(format!("../../../../../../..{}", host.path().display()), sb.host("out-rel")).unwrap();

    // The target's directory does not exist inside the root: NotFound.
    assert!(matches!(sb.upload("/out/new", b"x", 0o644), Err(FileError::NotFound)));
    assert!(matches!(sb.upload("/out/f", b"x", 0o644), Err(FileError::NotFound)));
    assert!(matches!(files::mkdir(&sb.fs, "/out/newdir", 0o755, false), Err(FileError::NotFound)));

    // Once it does, writes land in it.
    let inside = sb.host(host.path().to_str().unwrap());
    fs::create_dir_all(&inside).unwrap();
    sb.upload("/out/f", b"sandbox", 0o644).unwrap();
    sb.upload("/out-rel/new", b"sandbox", 0o644).unwrap();
    files::mkdir(&sb.fs, "/out-rel/newdir", 0o755, false).unwrap();
    assert_eq!(fs::read(inside.join("f")).unwrap(), b"sandbox");
    assert_eq!(fs::read(inside.join("new")).unwrap(), b"sandbox");
    assert!(inside.join("newdir").is_dir());
    assert_eq!(snapshot(host.path()), before);
}

#[test]
fn write_follows_a_final_symlink_only_inside_root() {
    let sb = Sandbox::new();
    let host = host_dir();
    let before = snapshot(host.path());
    symlink(host.path().join("f"), sb.host("abs")).unwrap();
    symlink(format!("../../../../../../..{}/f", host.path().display()), sb.host("rel")).unwrap();
    symlink("real", sb.host("plain")).unwrap();
    // Dangling inside the root: the target is created, the link stays.
    sb.upload("/plain", b"via link", 0o644).unwrap();
    assert_eq!(fs::read(sb.host("real")).unwrap(), b"via link");
    assert!(fs::symlink_metadata(sb.host("plain")).unwrap().file_type().is_symlink());
    // Pointing at the host: resolved inside the root, whose dirs are missing.
    assert!(matches!(sb.upload("/abs", b"x", 0o644), Err(FileError::NotFound)));
    assert!(matches!(sb.upload("/rel", b"x", 0o644), Err(FileError::NotFound)));
    let inside = sb.host(host.path().to_str().unwrap());
    fs::create_dir_all(&inside).unwrap();
    let st = sb.upload("/rel", b"sandbox", 0o644).unwrap();
    assert_eq!(st.path, format!("{}/f", host.path().display()));
    assert_eq!(fs::read(inside.join("f")).unwrap(), b"sandbox");
    assert_eq!(snapshot(host.path()), before);
}

#[test]
fn symlink_loops_are_invalid_not_hangs() {
    let sb = Sandbox::new();
    symlink("loop2", sb.host("loop1")).unwrap();
    symlink("/loop1", sb.host("loop2")).unwrap();
    assert!(matches!(sb.download("/loop1"), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::stat(&sb.fs, "/loop1/x"), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::create_write(&sb.fs, "/loop1", 0o644), Err(FileError::InvalidPath(_))));
    assert_eq!(files::stat(&sb.fs, "/loop1").unwrap().kind, FileKind::Symlink);
}

#[test]
fn stat_and_list_describe_symlinks_without_following() {
    let sb = Sandbox::new();
    let host = host_dir();
    symlink(host.path(), sb.host("hostdir")).unwrap();
    symlink("../x", sb.host("rel")).unwrap();
    let st = files::stat(&sb.fs, "/hostdir").unwrap();
    assert_eq!(st.kind, FileKind::Symlink);
    assert_eq!(st.symlink_target.as_deref(), Some(host.path().to_str().unwrap()));
    let list = files::list(&sb.fs, "/").unwrap();
    let got: Vec<_> = list.entries.iter().map(|e| (e.path.as_str(), e.kind, e.symlink_target.as_deref())).collect();
    let host_str = host.path().to_str().unwrap();
    assert_eq!(got, [("/hostdir", FileKind::Symlink, Some(host_str)), ("/rel", FileKind::Symlink, Some("../x"))]);
}

#[test]
fn removing_a_symlink_to_a_host_dir_removes_only_the_link() {
    let sb = Sandbox::new();
    let host = host_dir();
    let before = snapshot(host.path());
    symlink(host.path(), sb.host("link")).unwrap();
    files::remove(&sb.fs, "/link", true).unwrap();
    assert!(fs::symlink_metadata(sb.host("link")).is_err());
    symlink(host.path(), sb.host("link")).unwrap();
    files::remove(&sb.fs, "/link", false).unwrap();
    // Through the link, the host's files are not reachable to remove.
    symlink(host.path(), sb.host("link")).unwrap();
    assert!(matches!(files::remove(&sb.fs, "/link/f", false), Err(FileError::NotFound)));
    assert!(matches!(files::remove(&sb.fs, "/link/d", true), Err(FileError::NotFound)));
    assert_eq!(snapshot(host.path()), before);
}

#[test]
fn recursive_remove_never_enters_symlinks_to_host() {
    let sb = Sandbox::new();
    let host = host_dir();
    let before = snapshot(host.path());
    fs::create_dir_all(sb.host("tree/a/b")).unwrap();
    fs::write(sb.host("tree/a/b/file"), b"x").unwrap();
    symlink(host.path(), sb.host("tree/hostdir")).unwrap();
    symlink(host.path().join("f"), sb.host("tree/a/hostfile")).unwrap();
    symlink(format!("../../../../../../..{}", host.path().display()), sb.host("tree/a/b/rel")).unwrap();
    files::remove(&sb.fs, "/tree", true).unwrap();
    assert!(!sb.host("tree").exists());
    assert_eq!(snapshot(host.path()), before);
}

#[test]
fn recursive_remove_refuses_trees_deeper_than_its_fd_budget() {
    let sb = Sandbox::new();
    let deep = (0..files::MAX_REMOVE_DEPTH + 5).fold(sb.host("deep"), |p, _| p.join("d"));
    fs::create_dir_all(&deep).unwrap();
    assert!(matches!(files::remove(&sb.fs, "/deep", true), Err(FileError::Conflict(_))));
    let shallow = (0..files::MAX_REMOVE_DEPTH - 2).fold(sb.host("shallow"), |p, _| p.join("d"));
    fs::create_dir_all(&shallow).unwrap();
    files::remove(&sb.fs, "/shallow", true).unwrap();
    assert!(!sb.host("shallow").exists());
}

#[test]
fn recursive_remove_does_not_cross_into_other_mounts() {
    if !is_root() {
        eprintln!("skipped: mounting tmpfs needs root");
        return;
    }
    let sb = Sandbox::new();
    fs::create_dir_all(sb.host("tree/mnt")).unwrap();
    let _mount = MountGuard::tmpfs(&sb.host("tree/mnt"), "size=64k");
    fs::write(sb.host("tree/mnt/kept"), b"x").unwrap();
    assert!(matches!(files::remove(&sb.fs, "/tree", true), Err(FileError::Conflict(_))));
    assert!(sb.host("tree/mnt/kept").exists());
}

#[test]
fn magic_links_in_the_root_are_refused() {
    if !is_root() {
        eprintln!("skipped: mounting proc needs root");
        return;
    }
    let sb = Sandbox::new();
    fs::create_dir(sb.host("proc")).unwrap();
    let data = std::ffi::CString::new("").unwrap();
    rustix::mount::mount("proc", sb.host("proc"), "proc", rustix::mount::MountFlags::empty(), data.as_c_str()).unwrap();
    let _mount = MountGuard(sb.host("proc"));
    // /proc/self/root is the host's `/` to anyone who follows it.
    assert!(matches!(sb.download("/proc/self/root/etc/passwd"), Err(FileError::InvalidPath(_))));
    let own_cwd = format!("/proc/{}/cwd/etc/passwd", std::process::id());
    assert!(matches!(sb.download(&own_cwd), Err(FileError::InvalidPath(_))));
}

/// Swaps `sw` and `alt` in the root with `RENAME_EXCHANGE` until stopped;
/// dropping it stops it, so a failing test still cleans up its temp dir.
struct Flipper {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Flipper {
    fn start(root: std::os::fd::OwnedFd) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut flips = 0u64;
            while !flag.load(Ordering::Relaxed) {
                rustix::fs::renameat_with(&root, "sw", &root, "alt", rustix::fs::RenameFlags::EXCHANGE).unwrap();
                flips += 1;
            }
            flips
        });
        Flipper { stop, thread: Some(thread) }
    }

    /// Stops the thread and returns how many swaps it made.
    fn stop(mut self) -> u64 {
        self.halt()
    }

    fn halt(&mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

impl Drop for Flipper {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A thread flips `/sw` between a real directory and a symlink to the host
/// while the main thread works through `/sw/...`. The host must stay
/// untouched and its content must never be read.
fn race_symlink_swap(link_target: impl FnOnce(&Path) -> PathBuf) {
    const OPERATIONS: usize = 50_000;
    let sb = Sandbox::new();
    let host = host_dir();
    let before = snapshot(host.path());
    fs::create_dir(sb.host("sw")).unwrap();
    fs::write(sb.host("sw/f"), b"sandbox").unwrap();
    symlink(link_target(host.path()), sb.host("alt")).unwrap();

    let flipper = Flipper::start(open_root(sb.dir.path()));
    for i in 0..OPERATIONS {
        match i % 8 {
            0 => drop(sb.upload("/sw/f", b"sandbox", 0o644)),
            1 => drop(sb.upload("/sw/d/g", b"sandbox", 0o644)),
            2 => {
                if let Ok(data) = sb.download("/sw/f") {
                    assert_eq!(data, b"sandbox");
                }
                if let Ok(data) = sb.download("/sw/passwd") {
                    assert_ne!(data, HOST_SECRET);
                }
            }
            3 => drop(files::remove(&sb.fs, "/sw/f", false)),
            4 => drop(files::remove(&sb.fs, "/sw/d", true)),
            5 => drop(files::mkdir(&sb.fs, "/sw/d/e", 0o700, true)),
            6 => {
                if let Ok(list) = files::list(&sb.fs, "/sw") {
                    assert!(list.entries.iter().all(|e| e.path != "/sw/passwd"));
                }
            }
            _ => drop(files::stat(&sb.fs, "/sw/d/g")),
        }
    }
    assert!(flipper.stop() > 0);
    assert_eq!(snapshot(host.path()), before);
}

#[test]
fn symlink_swap_to_absolute_host_path_stays_inside_root() {
    race_symlink_swap(|host| host.to_path_buf());
}

#[test]
fn symlink_swap_to_relative_dotdot_path_stays_inside_root() {
    race_symlink_swap(|host| PathBuf::from(format!("../../../../../../../..{}", host.display())));
}

#[test]
fn rename_moves_files_and_dirs_and_replaces_a_file() {
    let sb = Sandbox::new();
    sb.upload("/a.txt", b"one", 0o644).unwrap();
    sb.upload("/b.txt", b"two", 0o644).unwrap();
    let moved = files::rename(&sb.fs, "/a.txt", "/c.txt").unwrap();
    assert_eq!((moved.path.as_str(), moved.kind, moved.size_bytes), ("/c.txt", FileKind::File, 3));
    assert!(matches!(files::stat(&sb.fs, "/a.txt"), Err(FileError::NotFound)));
    // Like rename(2): an existing file at the destination is replaced.
    files::rename(&sb.fs, "/c.txt", "/b.txt").unwrap();
    assert_eq!(sb.download("/b.txt").unwrap(), b"one");

    files::mkdir(&sb.fs, "/d/e", 0o755, true).unwrap();
    sb.upload("/d/e/f", b"x", 0o644).unwrap();
    let dir = files::rename(&sb.fs, "/d", "/g").unwrap();
    assert_eq!(dir.kind, FileKind::Dir);
    assert_eq!(sb.download("/g/e/f").unwrap(), b"x");

    assert!(matches!(files::rename(&sb.fs, "/missing", "/x"), Err(FileError::NotFound)));
    assert!(matches!(files::rename(&sb.fs, "/g", "/g/e/inside"), Err(FileError::Conflict(_))));
    assert!(matches!(files::rename(&sb.fs, "/", "/x"), Err(FileError::InvalidPath(_))));
    assert!(matches!(files::rename(&sb.fs, "/b.txt", "/"), Err(FileError::InvalidPath(_))));
}

#[test]
fn rename_through_a_symlink_stays_inside_the_root() {
    let sb = Sandbox::new();
    let outside = tempfile::tempdir().unwrap();
    fs::write(outside.path().join("secret"), b"host").unwrap();
    // An absolute link to the host directory's path: inside the root it
    // resolves to a directory of the sandbox, never to the host's.
    symlink(outside.path(), sb.host("link")).unwrap();
    sb.upload("/f", b"sandbox", 0o644).unwrap();
    assert!(files::rename(&sb.fs, "/f", "/link/secret").is_err());
    assert!(files::rename(&sb.fs, "/link/secret", "/stolen").is_err());
    assert_eq!(fs::read(outside.path().join("secret")).unwrap(), b"host");
    assert!(!sb.host("stolen").exists());
    // A final symlink is moved itself, not its target.
    let moved = files::rename(&sb.fs, "/link", "/link2").unwrap();
    assert_eq!(moved.kind, FileKind::Symlink);
    assert!(outside.path().join("secret").exists());
}

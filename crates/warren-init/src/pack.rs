//! `pack_diff` of a VM ([`Request::PackUpper`](warren_init::proto::Request::PackUpper)):
//! init streams the guest's writable layer - the overlay's upper
//! directory on the writable disk - to the node as a tar archive in OCI
//! layer form, which the node turns back into overlay form and packs as
//! it packs a container's upper directory.
//!
//! The upper directory is out of the sandbox's sight (a microVM's init
//! leaves it behind in the initramfs's mount tree, a full VM's service
//! mounts the writable disk again, detached), so [`keep_upper`] takes a
//! descriptor of it while init may still open it, before the seccomp
//! profile; every later step is descriptor-relative and never follows a
//! symlink.
//!
//! While the archive is written, every process of the sandbox is stopped
//! (`SIGSTOP`, then `SIGCONT` for those this stopped; one the sandbox had
//! stopped itself stays stopped), the guest's counterpart of the freezer a
//! container's copy runs under. The archive holds regular files, hard
//! links, directories, symlinks and FIFOs with owners, modes, times and
//! extended attributes; device nodes and sockets are left out (a guest's
//! root can make devices, a layer has no use for them), and overlayfs's own
//! attributes become OCI markers: a whiteout (character device 0:0) is a
//! `.wh.NAME` file, an opaque directory holds `.wh..wh..opq`.

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::process::{Pid, Signal};
use warren_init::mux::MAX_CHUNK_BYTES;
use warren_init::proto::{self, FrameKind, Response};

use crate::tree::{self, ProcStat};

/// The overlay's upper directory, set once at boot in a VM.
static UPPER: OnceLock<OwnedFd> = OnceLock::new();

const OVERLAY_XATTR_PREFIX: &[u8] = b"trusted.overlay.";
const OPAQUE_XATTR: &[u8] = b"trusted.overlay.opaque";
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// How long stopped processes get to reach the stopped state (one in an
/// uninterruptible wait stops when it returns; the archive goes on).
const STOP_WAIT: Duration = Duration::from_secs(2);

/// Keeps `upper` (a directory descriptor) for the sandbox's `pack_diff`.
pub(crate) fn keep_upper(upper: OwnedFd) {
    let _ = UPPER.set(upper);
}

/// The writable layer's directory, once kept (in a VM).
pub(crate) fn upper() -> Option<BorrowedFd<'static>> {
    UPPER.get().map(|fd| fd.as_fd())
}

/// Answers [`proto::Request::PackUpper`] on `conn`.
pub(crate) fn serve(conn: &mut UnixStream) {
    let Some(upper) = UPPER.get() else {
        let message = "this init holds no writable layer of its own (only a VM's does)".to_string();
        let _ =
            proto::write_json(conn, FrameKind::Response, &Response::Error { message, not_found: false, busy: false });
        return;
    };
    let stopped = Stopped::all_but_init();
    let opened = Response::PackOpened { stopped: u32::try_from(stopped.pids.len()).unwrap_or(u32::MAX) };
    if proto::write_json(conn, FrameKind::Response, &opened).is_err() {
        return;
    }
    let mut out = Tar::new(Frames { conn, buf: Vec::with_capacity(MAX_CHUNK_BYTES) });
    // No `FileEnd` after a failure: the node reports the archive as broken off.
    if archive_tree(&mut out, upper).and_then(|()| out.finish()).is_ok() {
        drop(stopped);
        let _ = proto::write_json(conn, FrameKind::Response, &Response::FileEnd);
    }
}

/// Writes `upper` and everything under it.
fn archive_tree<W: Write>(out: &mut Tar<W>, upper: &OwnedFd) -> io::Result<()> {
    let root = rustix::fs::openat(upper, c".", dir_flags(), Mode::empty())?;
    let stat = rustix::fs::fstat(&root)?;
    let xattrs = xattrs_of(&root)?;
    out.entry(&Entry::of(b'5', b"./".to_vec(), &stat, 0), &xattrs.kept)?;
    let mut links = HashMap::new();
    let mut pending = vec![(root, Vec::new())];
    while let Some((dir, prefix)) = pending.pop() {
        pending.extend(archive_dir(out, &dir, &prefix, &mut links)?);
    }
    Ok(())
}

/// Archives what `dir` holds (sorted by name, so the same tree gives the
/// same archive) and returns its subdirectories, each already written.
fn archive_dir<W: Write>(
    out: &mut Tar<W>,
    dir: &OwnedFd,
    prefix: &[u8],
    links: &mut HashMap<(u64, u64), Vec<u8>>,
) -> io::Result<Vec<(OwnedFd, Vec<u8>)>> {
    let mut subdirs = Vec::new();
    for name in names(dir)? {
        // Names are bytes: a name that is not UTF-8 keeps its bytes.
        let path = [prefix, name.as_bytes()].concat();
        let stat = rustix::fs::statat(dir, name.as_c_str(), AtFlags::SYMLINK_NOFOLLOW)?;
        match FileType::from_raw_mode(stat.st_mode) {
            FileType::Directory => {
                let child = rustix::fs::openat(dir, name.as_c_str(), dir_flags(), Mode::empty())?;
                let xattrs = xattrs_of(&child)?;
                let dir_path = [path.as_slice(), b"/"].concat();
                out.entry(&Entry::of(b'5', dir_path.clone(), &stat, 0), &xattrs.kept)?;
                if xattrs.opaque {
                    out.entry(&Entry::marker([dir_path.as_slice(), OPAQUE_MARKER].concat()), &[])?;
                }
                subdirs.push((child, dir_path));
            }
            FileType::RegularFile => {
                let key = (stat.st_dev, stat.st_ino);
                if stat.st_nlink > 1 {
                    if let Some(first) = links.get(&key) {
                        let mut link = Entry::of(b'1', path, &stat, 0);
                        link.link = first.clone();
                        out.entry(&link, &[])?;
                        continue;
                    }
                    links.insert(key, path.clone());
                }
                let file = rustix::fs::openat(dir, name.as_c_str(), file_flags(), Mode::empty())?;
                let size = u64::try_from(stat.st_size).unwrap_or(0);
                out.entry(&Entry::of(b'0', path, &stat, size), &xattrs_of(&file)?.kept)?;
                out.data(&mut std::fs::File::from(file), size)?;
            }
            FileType::Symlink => {
                let target = rustix::fs::readlinkat(dir, name.as_c_str(), Vec::new())?;
                let mut link = Entry::of(b'2', path, &stat, 0);
                link.link = target.into_bytes();
                out.entry(&link, &[])?;
            }
            FileType::Fifo => out.entry(&Entry::of(b'6', path, &stat, 0), &[])?,
            FileType::CharacterDevice if stat.st_rdev == 0 => {
                out.entry(&Entry::marker([prefix, WHITEOUT_PREFIX, name.as_bytes()].concat()), &[])?
            }
            // Devices and sockets: see the module's doc.
            _ => {}
        }
    }
    Ok(subdirs)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn file_flags() -> OFlags {
    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK
}

/// The names in `dir` but `.` and `..`, sorted.
fn names(dir: &OwnedFd) -> io::Result<Vec<CString>> {
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let name = entry?.file_name().to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// A file's extended attributes: overlayfs's own are dropped (its opaque
/// mark becomes `opaque`), every other one is kept.
struct Xattrs {
    kept: Vec<(Vec<u8>, Vec<u8>)>,
    opaque: bool,
}

fn xattrs_of(fd: &OwnedFd) -> io::Result<Xattrs> {
    let mut found = Xattrs { kept: Vec::new(), opaque: false };
    let list = match sized(rustix::fs::flistxattr_query(fd), |buf| rustix::fs::flistxattr(fd, buf)) {
        Ok(list) => list,
        Err(rustix::io::Errno::NOTSUP) => return Ok(found),
        Err(e) => return Err(e.into()),
    };
    for name in list.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name).map_err(io::Error::other)?;
        let name_c = cname.as_c_str();
        let value = match sized(rustix::fs::fgetxattr_query(fd, name_c), |buf| rustix::fs::fgetxattr(fd, name_c, buf)) {
            Ok(value) => value,
            // Removed since it was listed.
            Err(rustix::io::Errno::NODATA) => continue,
            Err(e) => return Err(e.into()),
        };
        if name == OPAQUE_XATTR {
            found.opaque = value == b"y";
        } else if !name.starts_with(OVERLAY_XATTR_PREFIX) {
            found.kept.push((name.to_vec(), value));
        }
    }
    Ok(found)
}

/// The kernel's largest attribute list and value (`XATTR_LIST_MAX`,
/// `XATTR_SIZE_MAX`).
const XATTR_MAX_BYTES: usize = 64 << 10;

/// What `get` (an xattr call) fills, in a buffer of the size `query` (the
/// same call's size query) asked for - most files have no attribute, and
/// then nothing is allocated - or of the kernel's maximum when it grew in
/// between.
fn sized(
    query: rustix::io::Result<usize>,
    get: impl Fn(&mut [u8]) -> rustix::io::Result<usize>,
) -> rustix::io::Result<Vec<u8>> {
    let want = query?;
    if want == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; want];
    let n = match get(&mut buf) {
        Err(rustix::io::Errno::RANGE) => {
            buf = vec![0u8; XATTR_MAX_BYTES];
            get(&mut buf)?
        }
        other => other?,
    };
    buf.truncate(n);
    Ok(buf)
}

/// The stopped processes, continued on drop.
struct Stopped {
    pids: Vec<Pid>,
}

impl Stopped {
    /// Stops every process of the sandbox (init's descendants: in a
    /// microVM every process but the kernel's threads, in a full VM what
    /// the agent service started) and waits until they are.
    fn all_but_init() -> Stopped {
        let me = std::process::id() as i32;
        let (_, pids) = tree::stop_all(|| tree::descendants(&tree::scan(), me));
        let stopped = Stopped { pids: pids.into_iter().filter_map(Pid::from_raw).collect() };
        let deadline = Instant::now() + STOP_WAIT;
        let mut waiting: HashSet<i32> = stopped.pids.iter().map(|p| p.as_raw_nonzero().get()).collect();
        while !waiting.is_empty() && Instant::now() < deadline {
            let now: HashMap<i32, ProcStat> = tree::scan().into_iter().map(|p| (p.pid, p)).collect();
            waiting.retain(|pid| now.get(pid).is_some_and(|p| !p.is_stopped() && !p.is_dead()));
            if !waiting.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        stopped
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for pid in &self.pids {
            let _ = rustix::process::kill_process(*pid, Signal::CONT);
        }
    }
}

/// Bytes for the node in `Stdout` frames of at most [`MAX_CHUNK_BYTES`].
struct Frames<'a> {
    conn: &'a mut UnixStream,
    buf: Vec<u8>,
}

impl Write for Frames<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = bytes.len().min(MAX_CHUNK_BYTES - self.buf.len());
        self.buf.extend_from_slice(&bytes[..n]);
        if self.buf.len() == MAX_CHUNK_BYTES {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            proto::write_frame(self.conn, FrameKind::Stdout, &self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }
}

/// One archive member's header fields.
struct Entry {
    kind: u8,
    path: Vec<u8>,
    link: Vec<u8>,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    mtime: i64,
}

impl Entry {
    fn of(kind: u8, path: Vec<u8>, stat: &rustix::fs::Stat, size: u64) -> Entry {
        Entry {
            kind,
            path,
            link: Vec::new(),
            mode: stat.st_mode & 0o7777,
            uid: stat.st_uid,
            gid: stat.st_gid,
            size,
            mtime: stat.st_mtime,
        }
    }

    /// An empty root-owned file: an OCI whiteout or opaque marker.
    fn marker(path: Vec<u8>) -> Entry {
        Entry { kind: b'0', path, link: Vec::new(), mode: 0, uid: 0, gid: 0, size: 0, mtime: 0 }
    }
}

const BLOCK: usize = 512;
/// The largest value of an 8-byte (7-digit) and a 12-byte (11-digit)
/// octal header field; larger ones go into a PAX record.
const MAX_OCTAL_7: u64 = 0o7777777;
const MAX_OCTAL_11: u64 = 0o77777777777;

/// A POSIX (pax) tar writer: ustar headers, with a PAX extended header in
/// front of a member whose path or link is long or whose ids, size or
/// extended attributes a ustar header cannot hold (what GNU tar reads back
/// with `--xattrs`).
struct Tar<W: Write> {
    out: W,
}

impl<W: Write> Tar<W> {
    fn new(out: W) -> Self {
        Tar { out }
    }

    fn entry(&mut self, e: &Entry, xattrs: &[(Vec<u8>, Vec<u8>)]) -> io::Result<()> {
        let mut pax = Vec::new();
        let long = |name: &[u8]| name.len() > 100;
        // PAX text is UTF-8 unless the header says the names are raw bytes.
        if (long(&e.path) && std::str::from_utf8(&e.path).is_err())
            || (long(&e.link) && std::str::from_utf8(&e.link).is_err())
        {
            pax_record(&mut pax, b"hdrcharset", b"BINARY");
        }
        if long(&e.path) {
            pax_record(&mut pax, b"path", &e.path);
        }
        if long(&e.link) {
            pax_record(&mut pax, b"linkpath", &e.link);
        }
        for (key, id) in [(&b"uid"[..], e.uid), (b"gid", e.gid)] {
            if u64::from(id) > MAX_OCTAL_7 {
                pax_record(&mut pax, key, id.to_string().as_bytes());
            }
        }
        if e.size > MAX_OCTAL_11 {
            pax_record(&mut pax, b"size", e.size.to_string().as_bytes());
        }
        for (name, value) in xattrs {
            pax_record(&mut pax, &[b"SCHILY.xattr.", name.as_slice()].concat(), value);
        }
        if !pax.is_empty() {
            let header = Entry {
                kind: b'x',
                path: b"././@PaxHeader".to_vec(),
                link: Vec::new(),
                size: pax.len() as u64,
                mtime: 0,
                mode: 0o644,
                uid: 0,
                gid: 0,
            };
            self.out.write_all(&ustar_header(&header))?;
            self.out.write_all(&pax)?;
            self.pad(pax.len() as u64)?;
        }
        self.out.write_all(&ustar_header(e))
    }

    /// Exactly `size` bytes of `file` (zeros for what a shrunken file no
    /// longer has), padded to the block.
    fn data(&mut self, file: &mut std::fs::File, size: u64) -> io::Result<()> {
        let copied = io::copy(&mut io::Read::take(file, size), &mut self.out)?;
        io::copy(&mut io::Read::take(io::repeat(0), size - copied), &mut self.out)?;
        self.pad(size)
    }

    fn pad(&mut self, len: u64) -> io::Result<()> {
        let rest = (BLOCK - (len % BLOCK as u64) as usize) % BLOCK;
        self.out.write_all(&[0u8; BLOCK][..rest])
    }

    /// The two zero blocks that end an archive.
    fn finish(&mut self) -> io::Result<()> {
        self.out.write_all(&[0u8; 2 * BLOCK])?;
        self.out.flush()
    }
}

/// `"<len> <key>=<value>\n"`, where `<len>` counts the whole record, its
/// own digits included.
fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let body = key.len() + value.len() + 3;
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    out.extend_from_slice(format!("{len} ").as_bytes());
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

fn ustar_header(e: &Entry) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    put_str(&mut h[0..100], &e.path);
    put_octal(&mut h[100..108], u64::from(e.mode));
    put_octal(&mut h[108..116], u64::from(e.uid).min(MAX_OCTAL_7));
    put_octal(&mut h[116..124], u64::from(e.gid).min(MAX_OCTAL_7));
    put_octal(&mut h[124..136], e.size.min(MAX_OCTAL_11));
    put_octal(&mut h[136..148], u64::try_from(e.mtime).unwrap_or(0).min(MAX_OCTAL_11));
    h[156] = e.kind;
    put_str(&mut h[157..257], &e.link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is taken with its own field as spaces.
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
    put_octal(&mut h[148..155], u64::from(sum));
    h
}

/// As much of `value` as fits (a longer one is in the PAX header too).
fn put_str(field: &mut [u8], value: &[u8]) {
    let n = value.len().min(field.len());
    field[..n].copy_from_slice(&value[..n]);
}

/// Zero-padded octal digits and a NUL, filling `field`.
fn put_octal(field: &mut [u8], value: u64) {
    let width = field.len() - 1;
    let digits = format!("{value:0width$o}");
    field[..width].copy_from_slice(&digits.as_bytes()[digits.len() - width..]);
    field[width] = 0;
}

/// A microVM's PID 1, before it leaves the initramfs: keeps the upper
/// directory at `dir`. A failure is reported and leaves `pack_diff`
/// answering that init holds no layer; the sandbox serves the rest.
pub(crate) fn keep_upper_at(dir: &CStr) {
    match rustix::fs::open(dir, dir_flags(), Mode::empty()) {
        Ok(fd) => keep_upper(fd),
        Err(e) => eprintln!("warren-init: cannot open the writable layer {dir:?}: {e}"),
    }
}

/// A full VM's service: the writable disk (ext4 at `device`, mounted as
/// the overlay's upper layer by the initramfs) mounted once more, read-only
/// and detached from every mount tree (`fsmount` without `move_mount`),
/// so the sandbox sees no new mount. The same superblock serves both.
pub(crate) fn keep_upper_of_disk(device: &std::path::Path) {
    use rustix::mount::{fsconfig_create, fsconfig_set_string, fsmount, fsopen};
    use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};
    let opened = fsopen("ext4", FsOpenFlags::FSOPEN_CLOEXEC)
        .and_then(|fs| fsconfig_set_string(&fs, "source", device).map(|()| fs))
        .and_then(|fs| fsconfig_create(&fs).map(|()| fs))
        .and_then(|fs| fsmount(&fs, FsMountFlags::FSMOUNT_CLOEXEC, MountAttrFlags::MOUNT_ATTR_RDONLY))
        .and_then(|mnt| rustix::fs::openat(&mnt, c"upper", dir_flags(), Mode::empty()));
    match opened {
        Ok(fd) => keep_upper(fd),
        Err(e) => eprintln!("warren-init: cannot open the writable layer on {}: {e}", device.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    use std::process::Command;

    /// The writer's archive, read back by GNU tar (the node's extractor):
    /// contents, modes, owners, links, long names, xattrs and the markers.
    #[test]
    fn gnu_tar_reads_back_what_the_writer_archives() {
        let src = tempfile::tempdir().unwrap();
        let s = src.path();
        std::fs::create_dir_all(s.join("d/opaque")).unwrap();
        std::fs::write(s.join("d/file"), b"hello").unwrap();
        // chown clears set-id bits: the mode after it.
        std::os::unix::fs::chown(s.join("d/file"), Some(1234), Some(5678)).unwrap();
        std::fs::set_permissions(s.join("d/file"), std::fs::Permissions::from_mode(0o4751)).unwrap();
        std::fs::hard_link(s.join("d/file"), s.join("d/hard")).unwrap();
        std::os::unix::fs::symlink("../outside/target", s.join("d/link")).unwrap();
        let long = "n".repeat(150);
        std::fs::write(s.join("d").join(&long), vec![7u8; 70_000]).unwrap();
        // Not UTF-8, and long enough for a PAX record.
        let raw = std::ffi::OsStr::from_bytes(&[b"\xff\xfe-".as_slice(), &[b'r'; 120]].concat()).to_owned();
        std::fs::write(s.join("d").join(&raw), b"raw").unwrap();
        rustix::fs::setxattr(s.join("d/file").as_path(), "user.note", b"kept", rustix::fs::XattrFlags::empty())
            .unwrap();
        rustix::fs::setxattr(
            s.join("d/opaque").as_path(),
            "trusted.overlay.opaque",
            b"y",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        rustix::fs::mknodat(rustix::fs::CWD, s.join("d/gone").as_path(), FileType::CharacterDevice, Mode::empty(), 0)
            .unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            s.join("d/disk").as_path(),
            FileType::BlockDevice,
            Mode::from_raw_mode(0o600),
            rustix::fs::makedev(8, 0),
        )
        .unwrap();

        let archive = tempfile::NamedTempFile::new().unwrap();
        let mut tar = Tar::new(std::fs::File::create(archive.path()).unwrap());
        let upper = rustix::fs::open(s, dir_flags(), Mode::empty()).unwrap();
        archive_tree(&mut tar, &upper).unwrap();
        tar.finish().unwrap();

        let dst = tempfile::tempdir().unwrap();
        let out = Command::new("tar")
            .args([
                "--extract",
                "--same-owner",
                "--preserve-permissions",
                "--numeric-owner",
                "--xattrs",
                "--xattrs-include=*",
                "--file",
            ])
            .arg(archive.path())
            .arg("--directory")
            .arg(dst.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let d = dst.path().join("d");
        use std::os::unix::fs::MetadataExt;
        let file = std::fs::metadata(d.join("file")).unwrap();
        assert_eq!((file.mode() & 0o7777, file.uid(), file.gid()), (0o4751, 1234, 5678));
        assert_eq!(std::fs::read(d.join("hard")).unwrap(), b"hello");
        assert_eq!(std::fs::metadata(d.join("hard")).unwrap().ino(), file.ino(), "a hard link stays one");
        assert_eq!(std::fs::read_link(d.join("link")).unwrap().to_str(), Some("../outside/target"));
        assert_eq!(std::fs::read(d.join(&long)).unwrap(), vec![7u8; 70_000]);
        assert_eq!(std::fs::read(d.join(&raw)).unwrap(), b"raw", "a name's bytes stay as they are");
        let mut note = [0u8; 16];
        let n = rustix::fs::getxattr(d.join("file").as_path(), "user.note", &mut note).unwrap();
        assert_eq!(&note[..n], b"kept");
        assert!(d.join("opaque/.wh..wh..opq").exists(), "the opaque mark becomes the OCI marker");
        assert!(rustix::fs::getxattr(d.join("opaque").as_path(), "trusted.overlay.opaque", &mut note).is_err());
        assert!(d.join(".wh.gone").exists(), "a whiteout becomes the OCI marker");
        assert!(!d.join("gone").exists() && !d.join("disk").exists(), "no device node is archived");
    }

    #[test]
    fn pax_records_count_their_own_length() {
        for value_len in [0, 1, 90, 95, 96, 1000] {
            let mut out = Vec::new();
            pax_record(&mut out, b"path", &vec![b'a'; value_len]);
            let (len, _) = std::str::from_utf8(&out).unwrap().split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), out.len(), "value of {value_len} bytes");
        }
    }
}

//! File-backed EROFS mounts and the mount table lookups the restart path
//! needs.

use std::collections::HashSet;
use std::io;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

/// Mounts the layer file itself (no loop device): `mount(2)` with a regular
/// file as source is EROFS's file-backed mode, which util-linux `mount` would
/// bypass by attaching a loop device.
pub(crate) fn mount_erofs(file: &Path, target: &Path) -> io::Result<()> {
    let flags = MountFlags::RDONLY | MountFlags::NODEV | MountFlags::NOSUID;
    rustix::mount::mount(file, target, "erofs", flags, None).map_err(io::Error::from)
}

/// `FS_IOC_GETFSSYSFSPATH` (Linux 6.10): `_IOR(0x15, 1, struct
/// fs_sysfs_path)`, the struct being a length byte and 128 name bytes.
const FS_IOC_GETFSSYSFSPATH: libc::c_ulong = 0x8081_1501;

#[repr(C)]
struct FsSysfsPath {
    len: u8,
    name: [u8; 128],
}

/// Sets the readahead window of the filesystem mounted at `target`, which
/// sizes both `read(2)` readahead and the mmap fault read-around of files
/// opened on it from now on (a file's window is copied from its bdi at
/// open). A file-backed EROFS mount has a bdi of its own, named like its
/// sysfs directory (`erofs/erofs-<n>` -> `/sys/class/bdi/erofs-<n>`).
pub(crate) fn set_readahead_kb(target: &Path, kb: u32) -> io::Result<()> {
    let dir = std::fs::File::open(target)?;
    let mut path = FsSysfsPath { len: 0, name: [0; 128] };
    // SAFETY: the ioctl writes at most size_of::<FsSysfsPath>() bytes (the
    // size encoded in the request) into `path`, which lives for the call;
    // `dir` is an open descriptor.
    let rc = unsafe {
        libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&dir), FS_IOC_GETFSSYSFSPATH as _, &mut path as *mut FsSysfsPath)
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    let len = usize::from(path.len).min(path.name.len());
    let sysfs = std::str::from_utf8(&path.name[..len]).map_err(|_| io::Error::other("sysfs path is not UTF-8"))?;
    let name = sysfs.rsplit('/').next().filter(|n| !n.is_empty() && !n.contains(".."));
    let name = name.ok_or_else(|| io::Error::other(format!("unexpected sysfs path {sysfs:?}")))?;
    std::fs::write(format!("/sys/class/bdi/{name}/read_ahead_kb"), kb.to_string())
}

/// Unmounts `target` only if nothing uses it: a busy mount answers `EBUSY`
/// rather than being detached, because a detached mount would outlive the
/// cache's accounting of it.
pub(crate) fn unmount(target: &Path) -> io::Result<()> {
    rustix::mount::unmount(target, UnmountFlags::empty()).map_err(io::Error::from)
}

/// Every mount point of this mount namespace.
pub(crate) fn mount_points() -> io::Result<HashSet<PathBuf>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(table.lines().filter_map(|line| line.split(' ').nth(4)).map(|field| PathBuf::from(unescape(field))).collect())
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match escaped_byte(&bytes[i..]) {
            Some(byte) => {
                out.push(byte);
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The byte a leading `\ooo` stands for, if `at` starts with one.
fn escaped_byte(at: &[u8]) -> Option<u8> {
    let digits = at.get(1..4).filter(|d| at[0] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))?;
    let value = digits.iter().fold(0u32, |acc, d| acc << 3 | u32::from(d - b'0'));
    u8::try_from(value).ok()
}

#[cfg(test)]
mod tests {
    use super::unescape;

    #[test]
    fn mountinfo_octal_escapes_are_decoded() {
        assert_eq!(unescape(r"/tmp/a\040b\134c"), r"/tmp/a b\c");
        assert_eq!(unescape(r"/plain\09"), r"/plain\09");
    }
}

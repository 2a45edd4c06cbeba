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

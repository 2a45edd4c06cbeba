//! A microVM's disks: one read-only EROFS file per image layer and one
//! writable ext4 file of the sandbox's disk size.
//!
//! A layered image's layers are EROFS files already (the node's layer
//! cache mounts them; the file behind the mount is what QEMU attaches, and
//! QEMU's reads fill it lazily like any reader's). A directory layer is
//! built into an EROFS file once and kept in the driver's layer cache,
//! keyed by the directory's path, inode and change time (image
//! directories are never changed in place).

use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{BackendError, Result};

/// `EROFS_SUPER_MAGIC_V1`: `statfs` of a mounted EROFS layer.
const EROFS_MAGIC: i64 = 0xE0F5_E1E2;

/// The EROFS file to attach for layer `dir`, building it into `cache_dir`
/// if `dir` is a plain directory. Blocking.
pub fn layer_file(dir: &Path, cache_dir: &Path) -> Result<PathBuf> {
    let fs_type = rustix::fs::statfs(dir)
        .map_err(|e| BackendError::io(format!("statfs {}", dir.display()), e.into()))?
        .f_type as i64;
    if fs_type == EROFS_MAGIC {
        return mounted_source(dir);
    }
    let meta = fs::metadata(dir).map_err(|e| BackendError::io(format!("stat {}", dir.display()), e))?;
    let mut key = Sha256::new();
    key.update(dir.as_os_str().as_encoded_bytes());
    key.update(meta.dev().to_be_bytes());
    key.update(meta.ino().to_be_bytes());
    key.update(meta.ctime().to_be_bytes());
    key.update(meta.ctime_nsec().to_be_bytes());
    let hex: String = key.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let dest = cache_dir.join(format!("{hex}.erofs"));
    if dest.exists() {
        return Ok(dest);
    }
    warren_image::erofs::build_from_dir(dir, &dest, &warren_image::erofs::BuildOptions::default())
        .map_err(|e| BackendError::Setup(format!("cannot build an EROFS layer from {}: {e}", dir.display())))?;
    Ok(dest)
}

/// The file a file-backed EROFS mount at `mount_point` reads.
fn mounted_source(mount_point: &Path) -> Result<PathBuf> {
    let mountinfo =
        fs::read_to_string("/proc/self/mountinfo").map_err(|e| BackendError::io("read /proc/self/mountinfo", e))?;
    let wanted = mount_point.to_string_lossy();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else { continue };
        if fields.get(4).map(|p| unescape(p)) == Some(wanted.to_string()) && fields.get(sep + 1) == Some(&"erofs") {
            if let Some(source) = fields.get(sep + 2) {
                let source = PathBuf::from(unescape(source));
                if source.is_file() {
                    return Ok(source);
                }
            }
        }
    }
    Err(BackendError::Setup(format!("{} is an EROFS mount without a backing file this driver can attach", wanted)))
}

/// mountinfo writes space, tab, newline and backslash as octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() && bytes[i + 1..i + 4].iter().all(|b| (b'0'..=b'7').contains(b)) {
            out.push((bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Makes the writable disk: a sparse file of `disk_mib` with an ext4 file
/// system of at most `inodes` inodes (no journal: the disk dies with the
/// sandbox).
pub async fn make_writable(path: &Path, disk_mib: u64, inodes: u64) -> Result<()> {
    let file = fs::File::create(path).map_err(|e| BackendError::io(format!("create {}", path.display()), e))?;
    file.set_len(disk_mib << 20).map_err(|e| BackendError::io(format!("size {}", path.display()), e))?;
    drop(file);
    let out = tokio::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal", "-m", "0", "-E", "lazy_itable_init=1,nodiscard"])
        .arg("-N")
        .arg(inodes.max(64).to_string())
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| BackendError::io("run mkfs.ext4 (e2fsprogs)", e))?;
    if !out.status.success() {
        return Err(BackendError::Setup(format!(
            "mkfs.ext4 {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Bytes the writable disk's file takes on the host.
pub fn allocated_bytes(path: &Path) -> io::Result<u64> {
    Ok(fs::metadata(path)?.blocks() * 512)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape(r"/a\040b\134c"), "/a b\\c");
        assert_eq!(unescape("/plain"), "/plain");
    }

    #[test]
    fn a_directory_layer_is_built_once() {
        let src = tempfile::tempdir().unwrap();
        fs::write(src.path().join("f"), b"x").unwrap();
        let cache = tempfile::tempdir().unwrap();
        let first = layer_file(src.path(), cache.path()).unwrap();
        let modified = fs::metadata(&first).unwrap().modified().unwrap();
        let second = layer_file(src.path(), cache.path()).unwrap();
        assert_eq!(first, second);
        assert_eq!(fs::metadata(&second).unwrap().modified().unwrap(), modified);
        assert_eq!(warren_image::erofs::block_size(&first).unwrap(), 4096);
    }
}

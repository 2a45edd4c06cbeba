//! A sandbox's writable layer sent as an OCI layer archive (a VM guest's
//! `pack_diff`: its init writes the overlay's upper directory with
//! whiteouts as `.wh.` markers), unpacked into the overlay form a packed
//! layer directory has.
//!
//! The archive comes from inside a sandbox, so it is input, not trusted:
//! GNU tar keeps every member inside the target (as for any import), and
//! what a guest's init never sends is refused - device nodes (a layer is
//! no way to hand a device to other sandboxes) and `trusted.*` attributes
//! (overlayfs's own; the markers are how whiteouts travel).

use std::io::Read;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use super::whiteout;
use crate::erofs::ErofsError;

/// Unpacks `archive` into the empty directory `dst`, whiteouts in overlay
/// form. On an error `dst` holds a partial tree the caller removes.
pub fn unpack_sandbox_diff(archive: impl Read, dst: &Path) -> Result<(), ErofsError> {
    crate::tar::extract(archive, dst).map_err(ErofsError::Extract)?;
    refuse_what_no_sandbox_sends(dst)?;
    whiteout::convert_to_overlay(dst)
}

fn refuse_what_no_sandbox_sends(root: &Path) -> Result<(), ErofsError> {
    let io_err =
        |path: &Path, e: std::io::Error| ErofsError::Io { context: format!("reading {}", path.display()), source: e };
    let mut pending = vec![root.to_path_buf()];
    while let Some(path) = pending.pop() {
        let kind = std::fs::symlink_metadata(&path).map_err(|e| io_err(&path, e))?.file_type();
        if kind.is_block_device() || kind.is_char_device() {
            return Err(ErofsError::Forbidden { path, reason: "a device node".into() });
        }
        if !kind.is_symlink() {
            let mut names = vec![0u8; 64 << 10];
            let len = rustix::fs::llistxattr(path.as_path(), &mut names).map_err(|e| io_err(&path, e.into()))?;
            if let Some(name) = names[..len].split(|b| *b == 0).find(|n| n.starts_with(b"trusted.")) {
                let reason = format!("the attribute {}", String::from_utf8_lossy(name));
                return Err(ErofsError::Forbidden { path, reason });
            }
        }
        if kind.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(|e| io_err(&path, e))? {
                pending.push(entry.map_err(|e| io_err(&path, e))?.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// A tar of `tree` as GNU tar writes it (with xattrs and devices).
    fn archive_of(tree: &Path) -> Vec<u8> {
        let out = Command::new("tar")
            .args(["--create", "--file=-", "--numeric-owner", "--xattrs", "--xattrs-include=*", "--directory"])
            .arg(tree)
            .arg(".")
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    }

    #[test]
    fn markers_become_overlay_whiteouts_and_opaque_directories() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("etc/fresh")).unwrap();
        std::fs::write(src.path().join("etc/.wh.group"), b"").unwrap();
        std::fs::write(src.path().join("etc/fresh/.wh..wh..opq"), b"").unwrap();
        std::fs::write(src.path().join("etc/fresh/kept"), b"x").unwrap();
        let dst = tempfile::tempdir().unwrap();
        unpack_sandbox_diff(archive_of(src.path()).as_slice(), dst.path()).unwrap();
        let group = std::fs::symlink_metadata(dst.path().join("etc/group")).unwrap();
        assert!(group.file_type().is_char_device(), "a whiteout: {group:?}");
        let mut value = [0u8; 4];
        let n =
            rustix::fs::getxattr(dst.path().join("etc/fresh").as_path(), "trusted.overlay.opaque", &mut value).unwrap();
        assert_eq!(&value[..n], b"y");
        assert_eq!(std::fs::read(dst.path().join("etc/fresh/kept")).unwrap(), b"x");
    }

    #[test]
    fn a_forged_archive_with_a_device_or_an_overlay_attribute_is_refused() {
        let with_device = tempfile::tempdir().unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            with_device.path().join("disk").as_path(),
            rustix::fs::FileType::BlockDevice,
            rustix::fs::Mode::from_raw_mode(0o600),
            rustix::fs::makedev(8, 0),
        )
        .unwrap();
        let dst = tempfile::tempdir().unwrap();
        let err = unpack_sandbox_diff(archive_of(with_device.path()).as_slice(), dst.path()).unwrap_err();
        assert!(matches!(&err, ErofsError::Forbidden { reason, .. } if reason.contains("device")), "{err}");

        let with_attr = tempfile::tempdir().unwrap();
        std::fs::write(with_attr.path().join("f"), b"").unwrap();
        rustix::fs::setxattr(
            with_attr.path().join("f").as_path(),
            "trusted.overlay.redirect",
            b"/etc",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let dst = tempfile::tempdir().unwrap();
        let err = unpack_sandbox_diff(archive_of(with_attr.path()).as_slice(), dst.path()).unwrap_err();
        assert!(matches!(&err, ErofsError::Forbidden { reason, .. } if reason.contains("trusted.overlay")), "{err}");
    }
}

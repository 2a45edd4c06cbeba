//! The busybox root filesystem every test imports as the `busybox` image.

use std::fs;
use std::io;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::process::Command;

/// The host's static busybox (Debian's `busybox-static`).
pub const HOST_BUSYBOX: &str = "/bin/busybox";
/// What `/etc/hostname` says inside every test sandbox, so a test can tell
/// the sandbox's view from the host's.
pub const SANDBOX_HOSTNAME_FILE: &str = "warren-test-sandbox\n";

/// Builds a busybox rootfs in `dir`: `/bin/busybox` with a symlink per
/// applet, the usual mount points, and root-only `/etc/passwd` and `/etc/group`.
pub fn build_busybox_rootfs(dir: &Path) -> io::Result<()> {
    for sub in ["bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "etc", "root", "work", "mnt"] {
        fs::create_dir_all(dir.join(sub))?;
    }
    let busybox = dir.join("bin/busybox");
    fs::copy(HOST_BUSYBOX, &busybox)?;
    fs::set_permissions(&busybox, fs::Permissions::from_mode(0o755))?;
    link_applets(dir)?;
    fs::write(dir.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n")?;
    fs::write(dir.join("etc/group"), "root:x:0:\n")?;
    fs::write(dir.join("etc/hostname"), SANDBOX_HOSTNAME_FILE)?;
    for (sub, mode) in [("tmp", 0o1777), ("root", 0o700), ("proc", 0o555), ("sys", 0o555)] {
        fs::set_permissions(dir.join(sub), fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// One symlink to `/bin/busybox` per applet, at the path busybox lists for it.
/// `busybox --install -s` would point the links at the host path of the
/// copy it runs as, which does not exist inside the sandbox.
fn link_applets(dir: &Path) -> io::Result<()> {
    let out = Command::new(HOST_BUSYBOX).arg("--list-full").output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("{HOST_BUSYBOX} --list-full failed: {:?}", out.status)));
    }
    let list = String::from_utf8_lossy(&out.stdout);
    for applet in list.lines().map(str::trim).filter(|l| !l.is_empty() && *l != "bin/busybox") {
        let link = dir.join(applet);
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent)?;
        }
        match symlink("/bin/busybox", &link) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    if fs::symlink_metadata(dir.join("bin/sh")).is_err() {
        symlink("busybox", dir.join("bin/sh"))?;
    }
    Ok(())
}

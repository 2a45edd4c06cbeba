//! `pack_diff` for containers: the overlay's upper directory, frozen for a
//! consistent moment, copied into a new layer directory with ownership shifted
//! back from the sandbox's host id range to the ids the image uses.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use warren_guard::cgroup::SandboxCgroup;

use super::state::Layout;
use super::teardown::cgroup_err;
use crate::{BackendError, Result};

const IDS_PER_SANDBOX: u32 = 65536;
const FREEZE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn snapshot(layout: &Layout, cgroup: &SandboxCgroup, uid_base: u32, dest: &Path) -> Result<()> {
    {
        let _frozen = cgroup.frozen(FREEZE_TIMEOUT).map_err(cgroup_err)?;
        copy_tree(&layout.upper(), dest)?;
    }
    shift_ids(dest, uid_base)
}

/// The host's `cp -a` keeps owners, modes, xattrs (overlay's opaque markers
/// are `trusted.*`, copied because we are root), hard links and the 0:0
/// character devices overlayfs uses as whiteouts.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    let out = Command::new("cp")
        .arg("-a")
        .arg("--no-target-directory")
        .arg(from)
        .arg(to)
        .output()
        .map_err(|e| BackendError::io("running cp", e))?;
    if !out.status.success() {
        return Err(BackendError::Setup(format!(
            "copying the writable layer failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Maps every owner in `[base, base + 65536)` back to `[0, 65536)`. chown
/// clears set-id bits, so the mode is put back afterwards.
fn shift_ids(dir: &Path, base: u32) -> Result<()> {
    let shift = |id: u32| if (base..base + IDS_PER_SANDBOX).contains(&id) { id - base } else { id };
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path).map_err(|e| BackendError::io(format!("lstat {}", path.display()), e))?;
        std::os::unix::fs::lchown(&path, Some(shift(meta.uid())), Some(shift(meta.gid())))
            .map_err(|e| BackendError::io(format!("chown {}", path.display()), e))?;
        if !meta.file_type().is_symlink() {
            fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode() & 0o7777))
                .map_err(|e| BackendError::io(format!("chmod {}", path.display()), e))?;
        }
        if meta.is_dir() {
            for entry in fs::read_dir(&path).map_err(|e| BackendError::io(format!("reading {}", path.display()), e))? {
                stack.push(entry.map_err(|e| BackendError::io(format!("reading {}", path.display()), e))?.path());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn ids_in_the_sandbox_range_shift_back_and_set_id_bits_survive() {
        let dir = tempfile::tempdir().unwrap();
        let base = 1 << 30;
        let file = dir.path().join("tool");
        fs::write(&file, "x").unwrap();
        std::os::unix::fs::chown(&file, Some(base + 5), Some(base + 7)).unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o4755)).unwrap();
        let foreign = dir.path().join("foreign");
        fs::write(&foreign, "y").unwrap();
        std::os::unix::fs::chown(&foreign, Some(1234), Some(1234)).unwrap();
        std::os::unix::fs::chown(dir.path(), Some(base), Some(base)).unwrap();

        shift_ids(dir.path(), base).unwrap();
        let m = fs::metadata(&file).unwrap();
        assert_eq!((m.uid(), m.gid(), m.mode() & 0o7777), (5, 7, 0o4755));
        assert_eq!(fs::metadata(&foreign).unwrap().uid(), 1234, "ids outside the range stay");
        assert_eq!(fs::metadata(dir.path()).unwrap().uid(), 0);
    }
}

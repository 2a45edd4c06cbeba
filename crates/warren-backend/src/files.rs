//! The file API (stat, list, read, write, mkdir, remove, rename) of a sandbox, served
//! from the host on a directory fd of the sandbox's root filesystem.
//!
//! The code lives in `warren_init::files` because a microVM's init runs the
//! very same resolution inside its guest; the container backend uses it
//! here, on the host. See that module for the invariants.

pub use warren_init::files::*;

/// Removes `paths` (absolute, as the sandbox names them) from the layer
/// tree at `dir` that `pack_diff` is making, each resolved inside it; a
/// path that is not there is fine.
pub(crate) fn scrub(dir: &std::path::Path, paths: &[String]) -> crate::Result<()> {
    let root = crate::FsRoot {
        dir: std::fs::File::open(dir)
            .map_err(|e| crate::BackendError::io(format!("opening {}", dir.display()), e))?
            .into(),
        uid: 0,
        gid: 0,
    };
    for path in paths {
        match remove(&root, path, true) {
            Ok(()) | Err(FileError::NotFound) => {}
            Err(e) => return Err(crate::BackendError::Setup(format!("scrubbing {path}: {e}"))),
        }
    }
    Ok(())
}

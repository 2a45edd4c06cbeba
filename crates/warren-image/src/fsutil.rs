//! Small durable-filesystem steps shared by the store: every rename that
//! publishes something is preceded by a sync of what it publishes and
//! followed by a sync of the directory that holds it.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{IoContext, Result};

/// 128 random bits as 32 lowercase hex digits.
pub(crate) fn random_hex_id() -> Result<String> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context(|| "reading /dev/urandom".to_owned())?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// A fresh `<parent>/<prefix><random>` directory only root can enter (the
/// trees built in it may hold set-id files owned by anyone), removed when the
/// guard drops.
pub(crate) fn private_scratch_dir(parent: &Path, prefix: &str) -> Result<DirGuard> {
    use std::os::unix::fs::PermissionsExt;
    let path = parent.join(format!("{prefix}{}", random_hex_id()?));
    std::fs::create_dir(&path).context(|| format!("creating {}", path.display()))?;
    let guard = DirGuard::new(path);
    std::fs::set_permissions(guard.path(), std::fs::Permissions::from_mode(0o700))
        .context(|| format!("setting the mode of {}", guard.path().display()))?;
    Ok(guard)
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Makes the entries of `dir` (creations, renames, removals) durable.
pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).context(|| format!("syncing directory {}", dir.display()))
}

/// Flushes every dirty page of the filesystem holding `path`. One call after
/// a tar extraction is far cheaper than an fsync per extracted file.
pub(crate) fn sync_filesystem(path: &Path) -> Result<()> {
    let dir = File::open(path).context(|| format!("opening {}", path.display()))?;
    rustix::fs::syncfs(&dir)
        .map_err(std::io::Error::from)
        .context(|| format!("syncing the filesystem of {}", path.display()))
}

/// Writes `bytes` to `dest` so that a reader (or a crash) sees either the old
/// file or the whole new one: write to `scratch`, sync, rename, sync the
/// directory. `scratch` must be on the same filesystem and is removed on
/// failure.
pub(crate) fn write_atomically(scratch: &Path, dest: &Path, bytes: &[u8]) -> Result<()> {
    let written = write_synced(scratch, bytes)
        .and_then(|()| std::fs::rename(scratch, dest).context(|| format!("publishing {}", dest.display())));
    if written.is_err() {
        let _ = std::fs::remove_file(scratch);
    }
    written?;
    fsync_dir(dest.parent().unwrap_or(Path::new("/")))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file =
        File::options().write(true).create_new(true).open(path).context(|| format!("creating {}", path.display()))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).context(|| format!("writing {}", path.display()))
}

/// Removes a directory tree; a tree that is already gone is not an error.
pub(crate) fn remove_tree(path: &Path) -> Result<()> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other.context(|| format!("removing {}", path.display())),
    }
}

/// Removes the directory it guards when dropped, unless `keep` was called:
/// the cleanup for every early return of a half-done import.
pub(crate) struct DirGuard {
    path: PathBuf,
    armed: bool,
}

impl DirGuard {
    pub(crate) fn new(path: PathBuf) -> Self {
        Self { path, armed: true }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Records that the directory now lives at `to` (after a rename), so a
    /// later failure removes it there.
    pub(crate) fn moved_to(&mut self, to: PathBuf) {
        self.path = to;
    }

    pub(crate) fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for DirGuard {
    fn drop(&mut self) {
        if self.armed {
            // Best effort: whatever stays behind is swept by the next sole
            // opener of the store.
            let _ = remove_tree(&self.path);
        }
    }
}

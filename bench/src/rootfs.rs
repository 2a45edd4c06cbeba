//! The one busybox-static rootfs every contender runs, built by the same
//! script the test suites use, so the benchmark measures the image they test.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd;
use crate::error::{BenchError, Result};

/// The repository's image script, found from where this crate was built.
pub fn default_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/make-test-image.sh")
}

#[derive(Debug, Clone)]
pub struct Rootfs {
    pub dir: PathBuf,
    pub busybox_version: String,
    pub files: u64,
    pub bytes: u64,
}

pub fn build(script: &Path, dir: &Path) -> Result<Rootfs> {
    cmd::run(Command::new("/bin/sh").arg(script).arg(dir))?;
    let (files, bytes) = tally(dir)?;
    Ok(Rootfs { dir: dir.to_path_buf(), busybox_version: busybox_version(&dir.join("bin/busybox")), files, bytes })
}

/// Entries and bytes of regular files below `dir` (symlinks count as entries).
fn tally(dir: &Path) -> Result<(u64, u64)> {
    let mut entries = 0;
    let mut bytes = 0;
    for entry in fs::read_dir(dir).map_err(|e| BenchError::io("list", dir, e))? {
        let entry = entry.map_err(|e| BenchError::io("list", dir, e))?;
        let meta = entry.path().symlink_metadata().map_err(|e| BenchError::io("stat", entry.path(), e))?;
        entries += 1;
        if meta.is_dir() {
            let (e, b) = tally(&entry.path())?;
            entries += e;
            bytes += b;
        } else if meta.is_file() {
            bytes += meta.len();
        }
    }
    Ok((entries, bytes))
}

fn busybox_version(busybox: &Path) -> String {
    let out = Command::new(busybox).output().map(|o| o.stdout).unwrap_or_default();
    let text = String::from_utf8_lossy(&out);
    let first = text.lines().next().unwrap_or("unknown");
    // "BusyBox v1.35.0 (Debian 1:1.35.0-4+b3) multi-call binary." -> drop the tail.
    first.trim_end_matches('.').trim_end_matches("multi-call binary").trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_test_image_script_yields_a_runnable_busybox_root() {
        let tmp = tempfile::tempdir().unwrap();
        let root = build(&default_script(), &tmp.path().join("rootfs")).unwrap();
        assert!(root.dir.join("bin/true").symlink_metadata().unwrap().file_type().is_symlink());
        assert!(root.busybox_version.starts_with("BusyBox v"), "{}", root.busybox_version);
        assert!(root.files > 100 && root.bytes > 500_000, "{root:?}");
    }
}

//! The one busybox-static rootfs every contender runs, built by the same
//! script the test suites use, so the benchmark measures the image they test.

use std::fs;
use std::os::unix::fs::PermissionsExt;
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

/// A program that exits 0 at once, in the rootfs beside busybox: the
/// exec measures' `true` without a C library's start-up (see [`exit0_elf`]).
pub const EXIT0: &str = "bin/exit0";

pub fn build(script: &Path, dir: &Path) -> Result<Rootfs> {
    cmd::run(Command::new("/bin/sh").arg(script).arg(dir))?;
    let exit0 = dir.join(EXIT0);
    fs::write(&exit0, exit0_elf()).map_err(|e| BenchError::io("write", &exit0, e))?;
    fs::set_permissions(&exit0, fs::Permissions::from_mode(0o755)).map_err(|e| BenchError::io("chmod", &exit0, e))?;
    let (files, bytes) = tally(dir)?;
    Ok(Rootfs { dir: dir.to_path_buf(), busybox_version: busybox_version(&dir.join("bin/busybox")), files, bytes })
}

/// A whole x86-64 ELF executable that calls `exit(0)`: one loadable
/// segment holding the headers and three instructions. Any C library's
/// start-up costs more than the exec itself on a host where the CPUID
/// instruction traps to the hypervisor (glibc probes the caches with it
/// dozens of times, ~7 us each here), so the exec measures run this beside
/// busybox's `true` to tell that cost from the sandbox's own.
pub fn exit0_elf() -> Vec<u8> {
    const BASE: u64 = 0x40_0000;
    const EHDR: u16 = 64;
    const PHDR: u16 = 56;
    // mov eax, 60 (exit); xor edi, edi; syscall
    const CODE: [u8; 9] = [0xb8, 0x3c, 0x00, 0x00, 0x00, 0x31, 0xff, 0x0f, 0x05];
    let size = u64::from(EHDR + PHDR) + CODE.len() as u64;
    let mut elf = Vec::with_capacity(size as usize);
    elf.extend_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    elf.extend_from_slice(&1u32.to_le_bytes()); // EV_CURRENT
    elf.extend_from_slice(&(BASE + u64::from(EHDR + PHDR)).to_le_bytes()); // entry: the code
    elf.extend_from_slice(&u64::from(EHDR).to_le_bytes()); // program headers right after this one
    elf.extend_from_slice(&0u64.to_le_bytes()); // no section headers
    elf.extend_from_slice(&0u32.to_le_bytes()); // flags
    for half in [EHDR, PHDR, 1, 0, 0, 0] {
        // header size, program header size and count, no sections
        elf.extend_from_slice(&half.to_le_bytes());
    }
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // read + execute
    for word in [0, BASE, BASE, size, size, 0x1000] {
        // offset, virtual and physical address, file and memory size, alignment
        elf.extend_from_slice(&word.to_le_bytes());
    }
    elf.extend_from_slice(&CODE);
    elf
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
        let status = Command::new(root.dir.join(EXIT0)).status().unwrap();
        assert_eq!(status.code(), Some(0), "{status}");
    }

    #[test]
    fn exit0_is_a_program_the_kernel_runs() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("exit0");
        fs::write(&path, exit0_elf()).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new(&path).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{:?}", out.status);
        assert!(out.stdout.is_empty() && out.stderr.is_empty());
        assert_eq!(exit0_elf().len(), 64 + 56 + 9);
    }
}

//! The guest's initramfs: `warren-init` as `/init` and the few kernel
//! modules it loads (the Debian cloud kernel builds the virtio transports
//! and block driver, EROFS and overlayfs as modules; which ones and in what
//! order comes from the kernel's `modules.dep`), uncompressed, as an
//! uncompressed `newc` cpio archive. Built once per driver; nothing of the
//! image is in it.
//!
//! Everything in it is cut to what the guest uses, because the kernel
//! unpacks the whole archive on every boot, under TCG at tens of
//! milliseconds per few megabytes: `/init` is only the program's loadable
//! image (the release build's symbols and line tables are four fifths of
//! the file: 2.3 of 11.5 MB), and the modules lose their signatures.

use std::borrow::Cow;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::{BackendError, Result};

/// The modules the guest needs, by name; [`load_order`] adds what they
/// depend on and leaves out what the kernel has built in (Debian 12's 6.1
/// builds the virtio core and console as modules, 6.12 builds them in).
/// `virtio_mmio` binds the devices QEMU's microvm machine describes in ACPI.
pub const MODULES: &[&str] = &["virtio_mmio", "virtio_blk", "virtio_console", "erofs", "overlay"];

/// The same for a q35 full VM: its virtio devices sit on PCI.
pub const Q35_MODULES: &[&str] = &["virtio_pci", "virtio_blk", "virtio_console", "erofs", "overlay"];

/// What a guest with a network device (`warren.net`) loads after the rest.
pub const NET_MODULES: &[&str] = &["virtio_net"];

/// Writes the archive to `dest` (through a temporary file, so a reader never
/// sees half of one).
/// `modules/order` lists the modules every boot loads, `modules/net-order`
/// those only a guest with a network device loads (after the others).
pub fn build(init_binary: &Path, modules_dir: &Path, modules: &[&str], dest: &Path) -> Result<()> {
    let io_err = |what: &str, path: &Path, e: io::Error| BackendError::io(format!("{what} {}", path.display()), e);
    let mut archive = Cpio::default();
    for dir in ["dev", "proc", "sys", "modules"] {
        archive.dir(dir);
    }
    let init = fs::read(init_binary).map_err(|e| io_err("read", init_binary, e))?;
    archive.file("init", 0o755, &loadable_image(&init));
    let always = load_order(modules_dir, modules)?;
    let with_net: Vec<String> =
        load_order(modules_dir, NET_MODULES)?.into_iter().filter(|m| !always.contains(m)).collect();
    for (list, order_file) in [(&always, "modules/order"), (&with_net, "modules/net-order")] {
        let mut order = String::new();
        for module in list {
            let path = modules_dir.join(module);
            let bytes = uncompressed(&path)?;
            let name = module_name(module);
            archive.file(&format!("modules/{name}.ko"), 0o644, without_signature(&bytes));
            order.push_str(name);
            order.push('\n');
        }
        archive.file(order_file, 0o644, order.as_bytes());
    }
    let bytes = archive.finish();
    write_replacing(dest, &bytes).map_err(|e| io_err("write", dest, e))
}

/// Writes `bytes` to `dest` through a temporary file beside it, synced and
/// renamed over `dest`: a reader (a QEMU booting a guest) never sees half
/// a file, and a failed write leaves no temporary behind.
pub(super) fn write_replacing(dest: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = PathBuf::from(format!("{}.tmp{}", dest.display(), std::process::id()));
    let written = fs::File::create(&tmp).and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()));
    written.and_then(|()| fs::rename(&tmp, dest)).inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })
}

/// The module files (relative to `modules_dir`) to load for `wanted`, each
/// after what it depends on, from the kernel's own `modules.dep` and
/// `modules.builtin` (what `depmod` wrote when the package was installed).
fn load_order(modules_dir: &Path, wanted: &[&str]) -> Result<Vec<String>> {
    let read = |name: &str| {
        let path = modules_dir.join(name);
        fs::read_to_string(&path).map_err(|e| BackendError::io(format!("read {} (run depmod)", path.display()), e))
    };
    let builtin = read("modules.builtin")?;
    let deps = read("modules.dep")?;
    plan_load_order(&builtin, &deps, wanted)
}

/// [`load_order`] over the two files' text. `modules.dep` lists a module's
/// dependencies so that loading them from the last to the first works (as
/// `modprobe` does).
fn plan_load_order(builtin: &str, deps: &str, wanted: &[&str]) -> Result<Vec<String>> {
    let same = |a: &str, b: &str| a.replace('-', "_") == b.replace('-', "_");
    let mut order: Vec<String> = Vec::new();
    for name in wanted {
        if builtin.lines().any(|line| same(module_name(line), name)) {
            continue;
        }
        let line = deps
            .lines()
            .find(|line| line.split_once(':').is_some_and(|(module, _)| same(module_name(module), name)))
            .ok_or_else(|| BackendError::Setup(format!("the guest kernel has no module {name} (modules.dep)")))?;
        let (module, needs) = line.split_once(':').unwrap_or((line, ""));
        for file in needs.split_ascii_whitespace().rev().chain([module.trim()]) {
            if !order.iter().any(|known| known == file) {
                order.push(file.to_string());
            }
        }
    }
    Ok(order)
}

/// `virtio_blk` of `kernel/drivers/block/virtio_blk.ko.xz`.
fn module_name(path: &str) -> &str {
    let file = path.trim().rsplit('/').next().unwrap_or(path);
    file.split_once(".ko").map_or(file, |(name, _)| name)
}

/// A module's bytes as the kernel's loader reads them: Debian's 6.12
/// packages compress each module with xz, and decompressing once on the
/// host beats the guest doing it on every boot under TCG.
fn uncompressed(path: &Path) -> Result<Vec<u8>> {
    let tool = match path.extension().and_then(|e| e.to_str()) {
        Some("xz") => "xz",
        Some("zst") => "zstd",
        Some("gz") => "gzip",
        _ => return fs::read(path).map_err(|e| BackendError::io(format!("read {}", path.display()), e)),
    };
    let out = std::process::Command::new(tool)
        .arg("-dc")
        .arg(path)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| BackendError::io(format!("run {tool} -dc {}", path.display()), e))?;
    if !out.status.success() {
        return Err(BackendError::Setup(format!(
            "{tool} -dc {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out.stdout)
}

/// Debian signs its modules; this kernel checks a signature that is there
/// but does not require one (`MODULE_SIG` without `MODULE_SIG_FORCE`).
/// Checking it (SHA-256 over the module and an RSA verify) is a tenth of
/// the modules' load time under TCG on every boot and proves nothing the
/// node, which read the files from the host's `/lib/modules`, does not
/// know; the guest kernel taints itself `E` instead. A module without a
/// well-formed signature is kept as it is.
fn without_signature(module: &[u8]) -> &[u8] {
    const MARKER: &[u8] = b"~Module signature appended~\n";
    // `struct module_signature`: five one-byte fields, three of padding,
    // then the signature's length (big-endian); the signature precedes it.
    const INFO_BYTES: usize = 12;
    let Some(body) = module.strip_suffix(MARKER) else { return module };
    let Some(info_at) = body.len().checked_sub(INFO_BYTES) else { return module };
    let len_bytes: [u8; 4] = match body[body.len() - 4..].try_into() {
        Ok(b) => b,
        Err(_) => return module,
    };
    let sig_len = u32::from_be_bytes(len_bytes) as usize;
    match info_at.checked_sub(sig_len) {
        Some(end) => &module[..end],
        None => module,
    }
}

/// Little-endian fields of an ELF64 file, `None` past its end.
pub(super) fn le_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at.checked_add(2)?)?.try_into().ok()?))
}

pub(super) fn le_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub(super) fn le_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

fn is_elf64_le(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x7fELF\x02\x01")
}

/// What of an executable the kernel loads (see [`loadable_end`]), with no
/// section header table: what `strip` leaves and less, and all that exec
/// and a static-pie's start-up (which finds itself through its program
/// headers) read. A file that is not a well-formed ELF64 executable is
/// kept whole.
fn loadable_image(elf: &[u8]) -> Cow<'_, [u8]> {
    match loadable_end(elf) {
        Some(end) if end < elf.len() => {
            let mut image = elf[..end].to_vec();
            // e_shoff, then e_shnum and e_shstrndx: no section headers.
            image[0x28..0x30].fill(0);
            image[0x3c..0x40].fill(0);
            Cow::Owned(image)
        }
        _ => Cow::Borrowed(elf),
    }
}

/// The end of the ELF header, the program headers and every segment's
/// bytes in the file; `None` if `elf` is no ELF64 little-endian file or a
/// header points past its end.
pub(super) fn loadable_end(elf: &[u8]) -> Option<usize> {
    const EHDR_BYTES: usize = 0x40;
    const PHDR_BYTES: usize = 56;
    if !is_elf64_le(elf) || elf.len() < EHDR_BYTES {
        return None;
    }
    let phoff = usize::try_from(le_u64(elf, 0x20)?).ok()?;
    let phentsize = usize::from(le_u16(elf, 0x36)?);
    let phnum = usize::from(le_u16(elf, 0x38)?);
    if phnum == 0 || phentsize < PHDR_BYTES {
        return None;
    }
    let mut end = phoff.checked_add(phentsize.checked_mul(phnum)?)?.max(EHDR_BYTES);
    for i in 0..phnum {
        let ph = phoff + i * phentsize;
        let offset = le_u64(elf, ph + 8)?;
        let filesz = le_u64(elf, ph + 32)?;
        end = end.max(usize::try_from(offset.checked_add(filesz)?).ok()?);
    }
    (end <= elf.len()).then_some(end)
}

/// What the archive's size is a multiple of (see [`Cpio::finish`]).
const INITRD_ALIGN: usize = 4096;

/// A `newc` cpio writer: enough for directories and regular files.
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    next_ino: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, &[]);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | mode, data);
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.next_ino += 1;
        let nlink = if mode & 0o040_000 != 0 { 2 } else { 1 };
        let fields = [self.next_ino, mode, 0, 0, nlink, 0, data.len() as u32, 0, 0, 0, 0, name.len() as u32 + 1, 0];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out.extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while self.out.len() & 3 != 0 {
            self.out.push(0);
        }
    }

    /// The trailer, then zeros up to a whole number of 4 KiB pages (the
    /// kernel's unpacker skips zeros after the trailer). QEMU 10 loads a
    /// PVH guest's initrd so that one whose size ends far into its last
    /// page breaks the guest's early boot: with sizes 3726792 and 3726892
    /// bytes (a release `warren-init`) every boot hung at "ACPI: Core
    /// revision" or the init died at once, at 256 MiB to 1 GiB of memory;
    /// the same archive padded to a page boundary always booted.
    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        let padded = self.out.len().next_multiple_of(INITRD_ALIGN);
        self.out.resize(padded, 0);
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_load_after_their_dependencies_and_builtins_are_left_out() {
        let builtin = "kernel/drivers/virtio/virtio.ko\nkernel/drivers/char/virtio_console.ko\n";
        let deps = "kernel/fs/erofs/erofs.ko.xz: kernel/lib/libcrc32c.ko.xz\n\
                    kernel/lib/libcrc32c.ko.xz:\n\
                    kernel/drivers/net/virtio_net.ko.xz: kernel/drivers/net/net_failover.ko.xz kernel/net/core/failover.ko.xz\n\
                    kernel/drivers/block/virtio_blk.ko.xz:\n";
        let order = plan_load_order(builtin, deps, &["virtio_console", "erofs", "virtio-net", "virtio_blk"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/lib/libcrc32c.ko.xz",
                "kernel/fs/erofs/erofs.ko.xz",
                "kernel/net/core/failover.ko.xz",
                "kernel/drivers/net/net_failover.ko.xz",
                "kernel/drivers/net/virtio_net.ko.xz",
                "kernel/drivers/block/virtio_blk.ko.xz",
            ]
        );
        let missing = plan_load_order(builtin, deps, &["overlay"]).unwrap_err();
        assert!(missing.to_string().contains("overlay"), "{missing}");
    }

    #[test]
    fn a_module_signature_is_cut_and_anything_else_kept() {
        let mut signed = b"\x7fELF module".to_vec();
        let sig = [0xaa_u8; 5];
        signed.extend_from_slice(&sig);
        signed.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0]);
        signed.extend_from_slice(&(sig.len() as u32).to_be_bytes());
        signed.extend_from_slice(b"~Module signature appended~\n");
        assert_eq!(without_signature(&signed), b"\x7fELF module");
        assert_eq!(without_signature(b"\x7fELF unsigned"), b"\x7fELF unsigned");
        // A length past the file's start: not a signature this code knows.
        let mut bogus = vec![0_u8; 8];
        bogus.extend_from_slice(&1000_u32.to_be_bytes());
        bogus.extend_from_slice(b"~Module signature appended~\n");
        assert_eq!(without_signature(&bogus), &bogus[..]);
    }

    /// An ELF64 header with `phnum` program headers at 0x40 and `shnum`
    /// section headers at `shoff`.
    fn elf_header(phnum: u16, shoff: u64, shnum: u16, shstrndx: u16) -> Vec<u8> {
        let mut h = vec![0u8; 0x40];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        h[0x20..0x28].copy_from_slice(&0x40_u64.to_le_bytes());
        h[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        h[0x36..0x38].copy_from_slice(&56_u16.to_le_bytes());
        h[0x38..0x3a].copy_from_slice(&phnum.to_le_bytes());
        h[0x3a..0x3c].copy_from_slice(&64_u16.to_le_bytes());
        h[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
        h[0x3e..0x40].copy_from_slice(&shstrndx.to_le_bytes());
        h
    }

    fn program_header(offset: u64, filesz: u64) -> Vec<u8> {
        let mut ph = vec![0u8; 56];
        ph[..4].copy_from_slice(&1_u32.to_le_bytes());
        ph[8..16].copy_from_slice(&offset.to_le_bytes());
        ph[32..40].copy_from_slice(&filesz.to_le_bytes());
        ph
    }

    #[test]
    fn the_init_binary_keeps_its_segments_and_loses_the_rest() {
        // Two segments, the second ending at 0x300; debug bytes and the
        // section headers after it.
        let mut elf = elf_header(2, 0x400, 3, 2);
        elf.extend(program_header(0, 0x200));
        elf.extend(program_header(0x200, 0x100));
        elf.resize(0x300, 0xcc);
        elf.resize(0x400, 0xdd);
        elf.extend(vec![0xee; 3 * 64]);
        let image = loadable_image(&elf);
        assert_eq!(image.len(), 0x300);
        assert_eq!(&image[0x40..0x300], &elf[0x40..0x300], "program headers and segments unchanged");
        assert_eq!(le_u64(&image, 0x28), Some(0), "no section header table");
        assert_eq!(le_u16(&image, 0x3c), Some(0));
        assert_eq!(le_u16(&image, 0x3e), Some(0));
        assert_eq!(le_u16(&image, 0x38), Some(2), "the program headers are all there");
        assert_eq!(loadable_end(&image), Some(0x300));

        // A segment past the file's end, or no ELF at all: kept whole.
        let mut broken = elf_header(1, 0, 0, 0);
        broken.extend(program_header(0, 0x1000));
        assert_eq!(&*loadable_image(&broken), &broken[..]);
        assert_eq!(&*loadable_image(b"#!/bin/sh\n"), b"#!/bin/sh\n");
    }

    #[test]
    fn entries_are_aligned_and_the_trailer_ends_the_archive_in_whole_pages() {
        let mut archive = Cpio::default();
        archive.dir("dev");
        archive.file("init", 0o755, b"abc");
        let bytes = archive.finish();
        assert_eq!(&bytes[..6], b"070701");
        assert_eq!(bytes.len() % 4, 0);
        // The name follows the 110-byte header; "dev\0" pads to 4-byte alignment.
        assert_eq!(&bytes[110..114], b"dev\0");
        let init_at = bytes.windows(5).position(|w| w == b"init\0").unwrap();
        let data_at = (init_at + 5).next_multiple_of(4);
        assert_eq!(&bytes[data_at..data_at + 3], b"abc");
        let trailer = bytes.windows(11).position(|w| w == b"TRAILER!!!\0").unwrap();
        assert_eq!(bytes.len() % INITRD_ALIGN, 0, "{} bytes", bytes.len());
        assert!(bytes[trailer + 11..].iter().all(|&b| b == 0), "only zeros after the trailer");
    }
}

//! The guest kernel as QEMU boots it fastest: the uncompressed ELF
//! `vmlinux` inside Debian's `vmlinuz`, entered through its PVH note.
//!
//! A `vmlinuz` (bzImage) decompresses itself in the guest before the
//! kernel proper starts; under TCG that is emulated code, and Debian's 6.12
//! compresses with zstd: about a second per boot here (a bare boot of the
//! same kernel to its first `init`: 3.1 s from the bzImage, 2.1 s from the
//! `vmlinux`). The driver decompresses it once, on the host, and QEMU
//! loads the ELF directly (`-kernel` of an ELF with a PVH entry note).
//! A kernel this cannot unpack is booted as it is.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use super::initramfs::{le_u16, le_u32, le_u64, loadable_end, write_replacing};
use crate::{BackendError, Result};

/// The compressions a bzImage's payload may use: its magic and the tool
/// that decompresses it (Debian's `zstd`, `lz4`, `xz-utils`, `gzip`).
const FORMATS: &[(&[u8], &str)] =
    &[(b"\x28\xb5\x2f\xfd", "zstd"), (b"\x02\x21\x4c\x18", "lz4"), (b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b\x08", "gzip")];

/// `XEN_ELFNOTE_PHYS32_ENTRY`: the note QEMU's PVH boot needs.
const PVH_NOTE_TYPE: u32 = 18;

/// Writes the `vmlinux` inside `bzimage` to `dest` (through a temporary
/// file); `Err` when no payload decompresses to an ELF kernel QEMU can
/// enter by PVH.
pub fn extract(bzimage: &Path, dest: &Path) -> Result<()> {
    let image = std::fs::read(bzimage).map_err(|e| BackendError::io(format!("read {}", bzimage.display()), e))?;
    let elf = FORMATS
        .iter()
        .filter_map(|(magic, tool)| find(&image, magic).map(|at| (at, *tool)))
        .filter_map(|(at, tool)| decompress(tool, &image[at..]))
        .find(|elf| loadable_end(elf).is_some() && has_pvh_note(elf))
        .ok_or_else(|| BackendError::Setup(format!("no PVH-bootable vmlinux inside {}", bzimage.display())))?;
    write_replacing(dest, &elf).map_err(|e| BackendError::io(format!("write {}", dest.display()), e))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// `tool -dc` of `data`; what it wrote, even if it then complained (the
/// payload is followed by the bzImage's trailer, which the tools call
/// trailing garbage). `loadable_end` tells a whole kernel from a cut one.
fn decompress(tool: &str, data: &[u8]) -> Option<Vec<u8>> {
    let mut child = Command::new(tool)
        .arg("-dc")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let input = data.to_vec();
    let feeder = std::thread::spawn(move || {
        // A tool that stops reading early ends the pipe: not an error here.
        let _ = stdin.write_all(&input);
    });
    let mut out = Vec::new();
    let read = child.stdout.take().map(|mut s| s.read_to_end(&mut out));
    let _ = child.wait();
    let _ = feeder.join();
    read.and_then(Result::ok).map(|_| out)
}

/// Whether a `PT_NOTE` segment of `elf` holds Xen's PVH entry note.
fn has_pvh_note(elf: &[u8]) -> bool {
    let at = |v: u64| usize::try_from(v).ok();
    let (Some(phoff), Some(phentsize), Some(phnum)) =
        (le_u64(elf, 0x20).and_then(at), le_u16(elf, 0x36), le_u16(elf, 0x38))
    else {
        return false;
    };
    (0..usize::from(phnum)).any(|i| {
        let Some(ph) = usize::from(phentsize).checked_mul(i).and_then(|o| o.checked_add(phoff)) else { return false };
        let (Some(4), Some(offset), Some(size)) =
            (le_u32(elf, ph), le_u64(elf, ph + 8).and_then(at), le_u64(elf, ph + 32).and_then(at))
        else {
            return false;
        };
        let Some(notes) = elf.get(offset..offset.saturating_add(size)) else { return false };
        let mut at = 0;
        while let (Some(namesz), Some(descsz), Some(kind)) =
            (le_u32(notes, at), le_u32(notes, at + 4), le_u32(notes, at + 8))
        {
            let (namesz, descsz) = (namesz as usize, descsz as usize);
            if notes.get(at + 12..at + 12 + namesz) == Some(b"Xen\0".as_slice()) && kind == PVH_NOTE_TYPE {
                return true;
            }
            at += 12 + namesz.div_ceil(4) * 4 + descsz.div_ceil(4) * 4;
        }
        false
    })
}

/// `symbol+0xoffset` of a guest kernel address, from the `System.map`
/// beside `vmlinuz` (`/boot/System.map-<release>`). A PVH boot has no
/// decompressor and so no KASLR: the map's addresses are the guest's.
pub fn symbol(vmlinuz: &Path, addr: u64) -> Option<String> {
    let name = vmlinuz.file_name()?.to_str()?;
    let map = vmlinuz.with_file_name(format!("System.map-{}", name.strip_prefix("vmlinuz-")?));
    nearest_symbol(&std::fs::read_to_string(map).ok()?, addr)
}

fn nearest_symbol(map: &str, addr: u64) -> Option<String> {
    let mut best: Option<(u64, &str)> = None;
    for line in map.lines() {
        let mut fields = line.split_whitespace();
        let (Some(at), Some(_kind), Some(name)) = (fields.next(), fields.next(), fields.next()) else { continue };
        let Ok(at) = u64::from_str_radix(at, 16) else { continue };
        if at <= addr && best.is_none_or(|(b, _)| at >= b) {
            best = Some((at, name));
        }
    }
    best.map(|(at, name)| format!("{name}+{:#x}", addr - at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_the_symbol_they_are_in() {
        let map =
            "ffffffff81000000 T _stext\nffffffff81001000 T do_one_initcall\nffffffff81002000 t native_safe_halt\n";
        assert_eq!(nearest_symbol(map, 0xffff_ffff_8100_1234).as_deref(), Some("do_one_initcall+0x234"));
        assert_eq!(nearest_symbol(map, 0xffff_ffff_8100_2000).as_deref(), Some("native_safe_halt+0x0"));
        assert_eq!(nearest_symbol(map, 0x1000), None, "below every symbol");
    }

    /// The host's own newest cloud kernel, when it has one (the VM suites
    /// need it anyway; this test says so instead of passing silently).
    #[test]
    fn the_cloud_kernel_unpacks_to_a_pvh_bootable_vmlinux() {
        let kernel = crate::microvm::newest_cloud_kernel()
            .expect("this test needs a Debian cloud kernel in /boot (scripts/setup-host.sh installs one)");
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("vmlinux");
        extract(&kernel, &dest).unwrap();
        let elf = std::fs::read(&dest).unwrap();
        assert!(loadable_end(&elf).is_some() && has_pvh_note(&elf));
        assert!(elf.len() > std::fs::metadata(&kernel).unwrap().len() as usize, "bigger than the compressed image");
    }

    #[test]
    fn a_file_without_a_kernel_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("vmlinuz");
        std::fs::write(&fake, b"MZ not a kernel \x1f\x8b\x08 truncated").unwrap();
        assert!(extract(&fake, &dir.path().join("vmlinux")).is_err());
        assert!(!dir.path().join("vmlinux").exists());
    }
}

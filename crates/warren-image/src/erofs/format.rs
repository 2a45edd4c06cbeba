//! Just enough of the EROFS on-disk format to tell file data from metadata,
//! and to rewrite the superblock's build time.
//!
//! Layout facts used here (kernel `fs/erofs/erofs_fs.h`): the superblock sits
//! at byte 1024; inode `nid` lives at `meta_blkaddr * block_size + nid * 32`;
//! a compact inode is 32 bytes, an extended one 64; `i_format` bit 0 is the
//! version and bits 1-3 the data layout. Regular-file data of the two
//! uncompressed layouts lives in whole blocks from `raw_blkaddr` on: all
//! `ceil(size / block)` of them for FLAT_PLAIN, all but the last for
//! FLAT_INLINE, whose tail follows the inode (and its inline xattrs) in the
//! metadata area. Directories are arrays of 12-byte dirents per block, the
//! first entry's `nameoff / 12` giving the count.
//!
//! Everything that is not regular-file data blocks is metadata: the kernel
//! reads it through its metadata buffer (no fanotify event), so a lazily
//! filled copy must hold those bytes before it is mounted.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;

/// Where the superblock starts: the first 1024 bytes are left for boot code.
pub(crate) const SUPERBLOCK_OFFSET: u64 = 1024;
const SUPERBLOCK_LEN: usize = 128;
const MAGIC: u32 = 0xE0F5_E1E2;
const FEATURE_COMPAT_SB_CHKSUM: u32 = 0x1;
/// Inode slots are 32 bytes; a nid counts slots.
const INODE_SLOT_BITS: u32 = 5;
const COMPACT_INODE_LEN: u64 = 32;
const EXTENDED_INODE_LEN: u64 = 64;
const XATTR_IBODY_HEADER_LEN: u64 = 12;
const XATTR_ENTRY_UNIT: u64 = 4;
const DIRENT_LEN: usize = 12;

const LAYOUT_FLAT_PLAIN: u16 = 0;
const LAYOUT_FLAT_INLINE: u16 = 2;

const S_IFMT: u16 = 0o170_000;
const S_IFREG: u16 = 0o100_000;
const S_IFDIR: u16 = 0o040_000;

/// Why a file could not be read as an EROFS image this module understands.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("reading the image: {0}")]
    Io(#[from] io::Error),
    #[error("not an EROFS image (bad magic {0:#010x})")]
    BadMagic(u32),
    #[error("corrupt image: {0}")]
    Corrupt(String),
    /// Compressed, chunk-based or multi-device images keep data where this
    /// module does not look; layers are built without them.
    #[error("unsupported EROFS feature: {0}")]
    Unsupported(String),
}

/// Where the parser reads an image from: a whole image file, or only the
/// metadata pages of one held in memory (see [`PagesImage`]), which is all
/// a walk of the inodes ever touches.
pub(crate) trait ImageRead {
    /// Reads exactly `buf.len()` bytes at `offset`; `UnexpectedEof` when
    /// they are not all there.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    fn image_len(&self) -> io::Result<u64>;
}

impl ImageRead for File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(self, buf, offset)
    }

    fn image_len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

/// An image of `len` bytes of which only `ranges` (sorted, disjoint) are
/// known: a layer's metadata pages as its metadata blob carries them.
pub(crate) struct PagesImage<'a> {
    pub(crate) ranges: &'a [(u64, &'a [u8])],
    pub(crate) len: u64,
}

impl ImageRead for PagesImage<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let i = self.ranges.partition_point(|(start, bytes)| start + bytes.len() as u64 <= offset);
        let missing = || io::Error::new(io::ErrorKind::UnexpectedEof, "outside the metadata pages");
        let (start, bytes) = self.ranges.get(i).ok_or_else(missing)?;
        let at = offset.checked_sub(*start).and_then(|a| usize::try_from(a).ok()).ok_or_else(missing)?;
        let end = at.checked_add(buf.len()).filter(|&e| e <= bytes.len()).ok_or_else(missing)?;
        buf.copy_from_slice(&bytes[at..end]);
        Ok(())
    }

    fn image_len(&self) -> io::Result<u64> {
        Ok(self.len)
    }
}

/// The superblock fields this module needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Superblock {
    pub(crate) block_size: u64,
    root_nid: u64,
    meta_blkaddr: u64,
    feature_compat: u32,
}

impl Superblock {
    pub(crate) fn read<R: ImageRead + ?Sized>(file: &R) -> Result<Self, FormatError> {
        let mut raw = [0u8; SUPERBLOCK_LEN];
        read_exact_at(file, &mut raw, SUPERBLOCK_OFFSET)?;
        let magic = le32(&raw, 0);
        if magic != MAGIC {
            return Err(FormatError::BadMagic(magic));
        }
        let blkszbits = u32::from(raw[12]);
        if !(9..=16).contains(&blkszbits) {
            return Err(FormatError::Corrupt(format!("block size 2^{blkszbits}")));
        }
        let extra_devices = le16(&raw, 86);
        if extra_devices != 0 {
            return Err(FormatError::Unsupported(format!("{extra_devices} extra devices")));
        }
        Ok(Self {
            block_size: 1 << blkszbits,
            root_nid: u64::from(le16(&raw, 14)),
            meta_blkaddr: u64::from(le32(&raw, 40)),
            feature_compat: le32(&raw, 8),
        })
    }

    fn inode_offset(&self, nid: u64) -> Result<u64, FormatError> {
        nid.checked_mul(1 << INODE_SLOT_BITS)
            .and_then(|off| off.checked_add(self.meta_blkaddr.checked_mul(self.block_size)?))
            .ok_or_else(|| FormatError::Corrupt(format!("nid {nid} out of range")))
    }
}

/// One inode, reduced to what locating its data needs.
#[derive(Debug)]
struct Inode {
    mode: u16,
    layout: u16,
    size: u64,
    raw_blkaddr: u64,
    /// Where inline data (a FLAT_INLINE tail) would start.
    inline_offset: u64,
}

impl Inode {
    fn read<R: ImageRead + ?Sized>(file: &R, sb: &Superblock, nid: u64) -> Result<Self, FormatError> {
        let offset = sb.inode_offset(nid)?;
        let mut raw = [0u8; EXTENDED_INODE_LEN as usize];
        read_exact_at(file, &mut raw[..COMPACT_INODE_LEN as usize], offset)?;
        let format = le16(&raw, 0);
        let extended = format & 1 == 1;
        let (len, size) = if extended {
            read_exact_at(file, &mut raw[COMPACT_INODE_LEN as usize..], offset + COMPACT_INODE_LEN)?;
            (EXTENDED_INODE_LEN, le64(&raw, 8))
        } else {
            (COMPACT_INODE_LEN, u64::from(le32(&raw, 8)))
        };
        let xattr_icount = u64::from(le16(&raw, 2));
        let xattr_len =
            if xattr_icount == 0 { 0 } else { XATTR_IBODY_HEADER_LEN + (xattr_icount - 1) * XATTR_ENTRY_UNIT };
        Ok(Self {
            mode: le16(&raw, 4),
            layout: (format >> 1) & 0x7,
            size,
            raw_blkaddr: u64::from(le32(&raw, 16)),
            inline_offset: offset + len + xattr_len,
        })
    }

    fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }

    fn is_regular(&self) -> bool {
        self.mode & S_IFMT == S_IFREG
    }

    /// The whole blocks of this inode's data: `(first block, count)`.
    fn block_extent(&self, nid: u64, block_size: u64) -> Result<(u64, u64), FormatError> {
        let blocks = self.size.div_ceil(block_size);
        match self.layout {
            LAYOUT_FLAT_PLAIN => Ok((self.raw_blkaddr, blocks)),
            LAYOUT_FLAT_INLINE => Ok((self.raw_blkaddr, blocks.saturating_sub(1))),
            other => Err(FormatError::Unsupported(format!("data layout {other} (nid {nid})"))),
        }
    }
}

/// The byte ranges of `file` (an EROFS image) holding regular-file data
/// blocks, sorted and merged.
pub(crate) fn data_ranges(file: &File) -> Result<Vec<Range<u64>>, FormatError> {
    Ok(merge(file_extents(file)?))
}

/// The data blocks of each regular file of `file` (an EROFS image), one
/// range per file with any, sorted by start and not merged: where a read
/// of the image lands in which file. Reads only metadata (superblock,
/// inodes, directories), so the metadata pages alone suffice.
pub(crate) fn file_extents<R: ImageRead + ?Sized>(file: &R) -> Result<Vec<Range<u64>>, FormatError> {
    let sb = Superblock::read(file)?;
    let image_len = file.image_len()?;
    let mut ranges = Vec::new();
    let mut seen = HashSet::from([sb.root_nid]);
    let mut dirs = vec![sb.root_nid];
    // Every directory's bytes are stored once, so an honest image never
    // makes the walk read more than its own length; a crafted one that
    // points many directories at the same blocks would.
    let mut dir_budget = image_len;
    while let Some(dir_nid) = dirs.pop() {
        let dir = Inode::read(file, &sb, dir_nid)?;
        if !dir.is_dir() {
            return Err(FormatError::Corrupt(format!("root nid {dir_nid} is not a directory")));
        }
        dir_budget = dir_budget
            .checked_sub(dir.size)
            .ok_or_else(|| FormatError::Corrupt("directories hold more bytes than the image".into()))?;
        // Hard links and "."/".." point at inodes already seen.
        for nid in dir_children(file, &sb, dir_nid, &dir, image_len)? {
            if !seen.insert(nid) {
                continue;
            }
            let inode = Inode::read(file, &sb, nid)?;
            if inode.is_dir() {
                dirs.push(nid);
            } else if inode.is_regular() {
                let (first, count) = inode.block_extent(nid, sb.block_size)?;
                if count > 0 {
                    ranges.push(block_range(first, count, sb.block_size, image_len, nid)?);
                }
            }
        }
    }
    ranges.sort_by_key(|r| r.start);
    Ok(ranges)
}

/// The complement of `data` within `[0, len)`: what must be local before the
/// image is mounted.
pub(crate) fn complement(data: &[Range<u64>], len: u64) -> Vec<Range<u64>> {
    let mut gaps = Vec::new();
    let mut at = 0;
    for range in data {
        if range.start > at {
            gaps.push(at..range.start);
        }
        at = at.max(range.end);
    }
    if at < len {
        gaps.push(at..len);
    }
    gaps
}

fn block_range(first: u64, count: u64, block_size: u64, image_len: u64, nid: u64) -> Result<Range<u64>, FormatError> {
    let start = first.checked_mul(block_size);
    let end = first.checked_add(count).and_then(|b| b.checked_mul(block_size));
    match (start, end) {
        (Some(start), Some(end)) if end <= image_len => Ok(start..end),
        _ => Err(FormatError::Corrupt(format!("data of nid {nid} lies past the end of the image"))),
    }
}

/// The nids named by a directory's entries (including "." and "..").
fn dir_children<R: ImageRead + ?Sized>(
    file: &R,
    sb: &Superblock,
    nid: u64,
    dir: &Inode,
    image_len: u64,
) -> Result<Vec<u64>, FormatError> {
    let (first, full_blocks) = dir.block_extent(nid, sb.block_size)?;
    let mut children = Vec::new();
    let mut logical = 0;
    while logical < dir.size {
        let len = (dir.size - logical).min(sb.block_size);
        let block_index = logical / sb.block_size;
        let physical = if block_index < full_blocks {
            block_range(first + block_index, 1, sb.block_size, image_len, nid)?.start
        } else {
            // The FLAT_INLINE tail must sit inside one block.
            let at = dir.inline_offset;
            if at % sb.block_size + len > sb.block_size {
                return Err(FormatError::Corrupt(format!("inline tail of directory nid {nid} crosses a block")));
            }
            at
        };
        let mut block = vec![0u8; usize::try_from(len).map_err(|_| FormatError::Corrupt("huge block".into()))?];
        read_exact_at(file, &mut block, physical)?;
        children.extend(dirent_nids(&block, nid)?);
        logical += len;
    }
    Ok(children)
}

fn dirent_nids(block: &[u8], dir_nid: u64) -> Result<Vec<u64>, FormatError> {
    let corrupt = || FormatError::Corrupt(format!("bad directory block in nid {dir_nid}"));
    if block.len() < DIRENT_LEN {
        return Err(corrupt());
    }
    let names_start = usize::from(le16(block, 8));
    if names_start % DIRENT_LEN != 0 || names_start == 0 || names_start > block.len() {
        return Err(corrupt());
    }
    Ok(block[..names_start].chunks_exact(DIRENT_LEN).map(|d| le64(d, 0)).collect())
}

/// Sorts and joins overlapping or touching ranges.
fn merge(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Sets the superblock's build time, the time every compact inode reports,
/// and refreshes the superblock checksum. mkfs.erofs 1.5 cannot fix the build
/// time without also overwriting every file's mtime (`-T`), so a layer that
/// keeps mtimes is built with the clock's time and patched here.
pub(crate) fn set_build_time(file: &File, secs: u64) -> Result<(), FormatError> {
    let sb = Superblock::read(file)?;
    // Block 0 must hold the whole superblock for the checksum to cover it.
    let Some(rest) = sb.block_size.checked_sub(SUPERBLOCK_OFFSET).filter(|&n| n >= SUPERBLOCK_LEN as u64) else {
        return Err(FormatError::Unsupported(format!("block size {}", sb.block_size)));
    };
    let mut block = vec![0u8; usize::try_from(rest).map_err(|_| FormatError::Unsupported("huge block".into()))?];
    read_exact_at(file, &mut block, SUPERBLOCK_OFFSET)?;
    block[24..32].copy_from_slice(&secs.to_le_bytes());
    block[32..36].copy_from_slice(&0u32.to_le_bytes());
    if sb.feature_compat & FEATURE_COMPAT_SB_CHKSUM != 0 {
        let checksum = superblock_checksum(&mut block);
        block[4..8].copy_from_slice(&checksum.to_le_bytes());
    }
    file.write_all_at(&block, SUPERBLOCK_OFFSET)?;
    Ok(())
}

/// The kernel's superblock checksum: crc32c seeded with !0 and not inverted
/// at the end, over the rest of block 0 from the superblock on, with the
/// checksum field zeroed. Leaves that field zeroed.
pub(crate) fn superblock_checksum(block_from_superblock: &mut [u8]) -> u32 {
    block_from_superblock[4..8].fill(0);
    crc32c_raw(!0, block_from_superblock)
}

/// Reflected CRC-32C (Castagnoli, polynomial 0x82F63B78) without the final
/// inversion, as the kernel's `crc32c()` computes it.
fn crc32c_raw(mut crc: u32, bytes: &[u8]) -> u32 {
    const POLY: u32 = 0x82F6_3B78;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ POLY } else { crc >> 1 };
        }
    }
    crc
}

/// Reads exactly `buf.len()` bytes at `offset`; a short image is corrupt.
fn read_exact_at<R: ImageRead + ?Sized>(file: &R, buf: &mut [u8], offset: u64) -> Result<(), FormatError> {
    file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => {
            FormatError::Corrupt(format!("{} bytes at offset {offset} lie past the end", buf.len()))
        }
        _ => FormatError::Io(e),
    })
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian `u64` at `at` (the caller has checked the length).
pub(crate) fn le64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The published CRC-32C check value of "123456789" is 0xE3069283,
        // which is the raw value inverted.
        assert_eq!(!crc32c_raw(!0, b"123456789"), 0xE306_9283);
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // ranges of ranges, not ranges of numbers
    fn complement_covers_everything_outside_the_data() {
        assert_eq!(complement(&[], 10), vec![0..10]);
        assert_eq!(complement(&[0..4, 6..10], 10), vec![4..6]);
        assert_eq!(complement(&[2..4], 10), vec![0..2, 4..10]);
        assert_eq!(complement(&[0..10], 10), Vec::<Range<u64>>::new());
    }

    #[test]
    fn merge_joins_touching_and_overlapping_ranges() {
        assert_eq!(merge(vec![8..12, 0..4, 4..6, 10..14]), vec![0..6, 8..14]);
    }

    #[test]
    fn a_pages_image_serves_only_reads_inside_one_of_its_ranges() {
        let (a, b) = ([1u8; 8], [2u8; 4]);
        let ranges = [(16, &a[..]), (24, &b[..])];
        let image = PagesImage { ranges: &ranges, len: 100 };
        let mut buf = [0u8; 4];
        image.read_exact_at(&mut buf, 20).unwrap();
        assert_eq!(buf, [1; 4]);
        image.read_exact_at(&mut buf, 24).unwrap();
        assert_eq!(buf, [2; 4]);
        for at in [0, 14, 22, 26, 96] {
            let e = image.read_exact_at(&mut buf, at).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "at {at}");
        }
        assert!(matches!(read_exact_at(&image, &mut buf, 0), Err(FormatError::Corrupt(_))));
        assert_eq!(image.image_len().unwrap(), 100);
    }

    #[test]
    fn dirent_blocks_with_bad_name_offsets_are_corrupt() {
        let mut block = vec![0u8; 24];
        block[8] = 13; // not a multiple of the dirent size
        assert!(matches!(dirent_nids(&block, 1), Err(FormatError::Corrupt(_))));
        block[8] = 48; // past the block
        assert!(matches!(dirent_nids(&block, 1), Err(FormatError::Corrupt(_))));
        block[8] = 24;
        block[0] = 7;
        block[12] = 9;
        assert_eq!(dirent_nids(&block, 1).unwrap(), vec![7, 9]);
    }
}

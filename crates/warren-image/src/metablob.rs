//! The metadata blob: every page of a layer that holds EROFS metadata
//! (superblock, inodes, directories, xattrs, inline tails), concatenated
//! behind a range table, stored once per layer and named by its sha256 in
//! the layer manifest.
//!
//! Why: mkfs.erofs interleaves metadata with file data all through a layer
//! of many small files, so prefilling every *chunk* that holds any metadata
//! fetched about half of a 1 MiB-chunked layer. The pages themselves are a
//! few percent; one blob brings exactly them in one request.
//!
//! Layout (all integers little endian):
//!
//! ```text
//! magic  "WRNMETA1"          8 bytes
//! count  u64                 number of ranges
//! table  count x (offset u64, len u64), sorted, disjoint, page-aligned
//! bytes  the ranges' bytes, in table order
//! ```
//!
//! Invariants: the table of a blob a node accepts is exactly
//! [`pages`] of the manifest's metadata map (so a blob cannot make the node
//! write anywhere else), and its sha256 is the digest the manifest names.
//! Building the blob from the same layer file always gives the same bytes.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use sha2::{Digest, Sha256};

use crate::erofs::format::le64;

/// The granularity of the map: the page size, and the EROFS block size of
/// every layer built here, so pages never split a block.
pub const PAGE: u64 = 4096;
const MAGIC: &[u8; 8] = b"WRNMETA1";
const HEADER_LEN: u64 = 16;
const ENTRY_LEN: u64 = 16;

/// Why a metadata blob was refused.
#[derive(Debug, thiserror::Error)]
pub enum MetaBlobError {
    #[error("metadata blob is {actual} bytes, expected {expected}")]
    Length { expected: u64, actual: u64 },
    #[error("metadata blob has the wrong magic")]
    Magic,
    #[error("metadata blob's range table does not match the layer's metadata map ({0})")]
    Table(String),
    #[error("metadata blob hashes to {actual}, expected {expected}")]
    Digest { expected: String, actual: String },
    #[error("stored metadata blob: {0}")]
    Stored(String),
}

/// The blob compressed for storage (zlib): inode tables, directories and
/// the inline tails of small files compress about 2.7x, and the blob is
/// what every node fetches before it can mount a layer.
pub fn compress(blob: &[u8]) -> io::Result<Vec<u8>> {
    use std::io::Write;
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
    encoder.write_all(blob)?;
    encoder.finish()
}

/// Checks stored bytes against the digest and size a manifest names, then
/// inflates them, refusing more than `max_len` bytes of output (the blob's
/// size), so a stored object cannot make a node inflate without bound.
pub fn decompress(
    stored: &[u8],
    stored_digest: &str,
    stored_size: u64,
    max_len: u64,
) -> Result<Vec<u8>, MetaBlobError> {
    use std::io::Read;
    if stored.len() as u64 != stored_size {
        return Err(MetaBlobError::Stored(format!("{} bytes, expected {stored_size}", stored.len())));
    }
    let actual = digest(stored);
    if actual != stored_digest {
        return Err(MetaBlobError::Stored(format!("hashes to {actual}, expected {stored_digest}")));
    }
    let cap = usize::try_from(max_len).map_err(|_| MetaBlobError::Stored("blob too large".into()))?;
    let mut out = Vec::with_capacity(cap);
    flate2::read::ZlibDecoder::new(stored)
        .take(max_len.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| MetaBlobError::Stored(format!("cannot inflate: {e}")))?;
    if out.len() as u64 > max_len {
        return Err(MetaBlobError::Stored(format!("inflates past {max_len} bytes")));
    }
    Ok(out)
}

/// `ranges` (sorted `(offset, len)`) widened to whole pages, clipped to
/// `size` and merged: what the blob carries.
pub fn pages(ranges: &[(u64, u64)], size: u64) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for &(offset, len) in ranges {
        let start = offset - offset % PAGE;
        let end = offset.saturating_add(len).saturating_add(PAGE - 1) / PAGE * PAGE;
        let end = end.min(size);
        if start >= end {
            continue;
        }
        match out.last_mut() {
            Some(last) if start <= last.end => last.end = last.end.max(end),
            _ => out.push(start..end),
        }
    }
    out
}

/// The blob's length for these pages.
pub fn encoded_len(pages: &[Range<u64>]) -> u64 {
    let table = HEADER_LEN + ENTRY_LEN * pages.len() as u64;
    table + pages.iter().map(|r| r.end - r.start).sum::<u64>()
}

/// Builds the blob of `pages` from the layer file.
pub fn encode(file: &File, pages: &[Range<u64>]) -> io::Result<Vec<u8>> {
    let len = usize::try_from(encoded_len(pages)).map_err(|_| io::Error::other("metadata blob too large"))?;
    let mut blob = Vec::with_capacity(len);
    blob.extend_from_slice(MAGIC);
    blob.extend_from_slice(&(pages.len() as u64).to_le_bytes());
    for range in pages {
        blob.extend_from_slice(&range.start.to_le_bytes());
        blob.extend_from_slice(&(range.end - range.start).to_le_bytes());
    }
    for range in pages {
        let at = blob.len();
        let n = usize::try_from(range.end - range.start).map_err(|_| io::Error::other("range too large"))?;
        blob.resize(at + n, 0);
        file.read_exact_at(&mut blob[at..], range.start)?;
    }
    Ok(blob)
}

/// `sha256:<hex>` of a blob.
pub fn digest(blob: &[u8]) -> String {
    format!("sha256:{}", crate::erofs::hex(&Sha256::digest(blob)))
}

/// Checks `blob` against the digest and pages a manifest names and
/// returns its ranges with their bytes, in file order. Nothing is returned
/// unless everything matched, so a caller writes all or nothing.
pub fn decode<'a>(
    blob: &'a [u8],
    expected_digest: &str,
    pages: &[Range<u64>],
) -> Result<Vec<(u64, &'a [u8])>, MetaBlobError> {
    let expected_len = encoded_len(pages);
    if blob.len() as u64 != expected_len {
        return Err(MetaBlobError::Length { expected: expected_len, actual: blob.len() as u64 });
    }
    let actual = digest(blob);
    if actual != expected_digest {
        return Err(MetaBlobError::Digest { expected: expected_digest.to_owned(), actual });
    }
    if &blob[..8] != MAGIC {
        return Err(MetaBlobError::Magic);
    }
    if le64(blob, 8) != pages.len() as u64 {
        return Err(MetaBlobError::Table(format!("{} ranges, expected {}", le64(blob, 8), pages.len())));
    }
    let mut at = usize::try_from(HEADER_LEN + ENTRY_LEN * pages.len() as u64).unwrap_or(usize::MAX);
    let mut out = Vec::with_capacity(pages.len());
    for (i, range) in pages.iter().enumerate() {
        let entry = 16 + i * 16;
        let (offset, len) = (le64(blob, entry), le64(blob, entry + 8));
        if offset != range.start || len != range.end - range.start {
            return Err(MetaBlobError::Table(format!("entry {i} is ({offset}, {len})")));
        }
        // The length check above makes every slice in bounds.
        let n = usize::try_from(len).unwrap_or(usize::MAX);
        out.push((offset, &blob[at..at + n]));
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn pages_widen_to_page_boundaries_clip_and_merge() {
        assert_eq!(pages(&[(0, 1024)], 1 << 20), vec![0..4096]);
        assert_eq!(pages(&[(100, 10), (4000, 200)], 1 << 20), vec![0..8192]);
        assert_eq!(pages(&[(0, 4096), (8192, 4096)], 1 << 20), vec![0..4096, 8192..12288]);
        assert_eq!(pages(&[(8192, 10)], 9000), vec![8192..9000]);
        assert!(pages(&[], 10).is_empty());
    }

    fn sample() -> (tempfile::NamedTempFile, Vec<Range<u64>>) {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..5 * PAGE).map(|i| (i % 251) as u8).collect();
        file.write_all(&bytes).unwrap();
        (file, vec![0..4096, 12288..16384])
    }

    #[test]
    fn a_stored_blob_is_checked_before_it_is_inflated_and_inflates_only_to_its_size() {
        let (file, pages) = sample();
        let blob = encode(file.as_file(), &pages).unwrap();
        let stored = compress(&blob).unwrap();
        assert!(stored.len() < blob.len(), "{} -> {}", blob.len(), stored.len());
        let (d, n, max) = (digest(&stored), stored.len() as u64, blob.len() as u64);
        assert_eq!(decompress(&stored, &d, n, max).unwrap(), blob);
        let mut bad = stored.clone();
        bad[n as usize / 2] ^= 0xff;
        assert!(matches!(decompress(&bad, &d, n, max), Err(MetaBlobError::Stored(_))));
        assert!(matches!(decompress(&stored, &d, n + 1, max), Err(MetaBlobError::Stored(_))));
        // A stored object that inflates past the blob's size is refused.
        let bomb = compress(&vec![0u8; 1 << 20]).unwrap();
        let err = decompress(&bomb, &digest(&bomb), bomb.len() as u64, max).unwrap_err();
        assert!(err.to_string().contains("inflates past"), "{err}");
    }

    #[test]
    fn a_blob_round_trips_to_the_file_bytes() {
        let (file, pages) = sample();
        let blob = encode(file.as_file(), &pages).unwrap();
        assert_eq!(blob.len() as u64, encoded_len(&pages));
        let ranges = decode(&blob, &digest(&blob), &pages).unwrap();
        let content = std::fs::read(file.path()).unwrap();
        assert_eq!(ranges.len(), 2);
        for (offset, bytes) in ranges {
            let o = offset as usize;
            assert_eq!(bytes, &content[o..o + bytes.len()]);
        }
    }

    #[test]
    fn a_corrupt_truncated_or_misplaced_blob_is_refused() {
        let (file, pages) = sample();
        let blob = encode(file.as_file(), &pages).unwrap();
        let good = digest(&blob);
        let mut flipped = blob.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(matches!(decode(&flipped, &good, &pages), Err(MetaBlobError::Digest { .. })));
        assert!(matches!(decode(&blob[..blob.len() - 1], &good, &pages), Err(MetaBlobError::Length { .. })));
        // A blob that is honest about itself but would write elsewhere.
        let elsewhere = vec![4096..8192, 12288..16384];
        let other = encode(file.as_file(), &elsewhere).unwrap();
        assert!(matches!(decode(&other, &digest(&other), &pages), Err(MetaBlobError::Table(_))));
    }
}

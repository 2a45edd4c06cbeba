//! Builds one EROFS image file per layer, from a directory, a tar stream or
//! an OCI layer tar, with Debian's `mkfs.erofs` (1.5: no `--tar`, so archives
//! are first extracted as root by the host's GNU tar into a scratch tree).
//!
//! Invariants: images are uncompressed (the lazy cache needs plain block
//! layouts) and reproducible: the same tree gives the same bytes, because
//! mkfs sorts directory entries and allocates inodes and data in that order,
//! the UUID is fixed by the caller and the superblock build time is pinned.
//! A layer file appears at its destination whole or not at all; the scratch
//! tree is removed on every path.
//!
//! Each build also reports the image's metadata map: every byte range that
//! is not regular-file data blocks. It is computed by walking the on-disk
//! format of the produced file (see [`format`]), not by mounting it, so it
//! works unprivileged and on any copy of the file; the tests check it against
//! FIEMAP of the mounted image.

pub(crate) mod format;

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read};
use std::ops::Range;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

pub use format::FormatError;

use crate::error::ImageError;
use crate::fsutil::{fsync_dir, private_scratch_dir, DirGuard};

/// The UUID layers get unless the caller picks one. Only overlayfs's
/// `index`/`nfs_export` features (off by default) care that lower layers'
/// UUIDs differ.
pub const DEFAULT_UUID: [u8; 16] = *b"warren-layer-v1\0";

/// Why a layer could not be built or read.
#[derive(Debug, thiserror::Error)]
pub enum ErofsError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("layer source {0} is not a directory")]
    NotADirectory(PathBuf),
    /// The archive could not be extracted (bad, truncated or unsafe); the
    /// text is tar's complaint.
    #[error("extracting the layer archive: {0}")]
    Extract(#[source] ImageError),
    #[error("mkfs.erofs failed: {0}")]
    Mkfs(String),
    #[error("{path}: {source}")]
    Format {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    /// An OCI whiteout could not be turned into its overlayfs form.
    #[error("converting whiteouts at {path}: {reason}")]
    Whiteout { path: PathBuf, reason: String },
    /// A sandbox's archive holds what no sandbox's layer may (see
    /// [`crate::oci::unpack_sandbox_diff`]).
    #[error("{path}: the archive may not hold {reason}")]
    Forbidden { path: PathBuf, reason: String },
    /// Setting up or removing the scratch tree failed.
    #[error("scratch space: {0}")]
    Scratch(#[source] ImageError),
}

/// What happens to the files' modification times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timestamps {
    /// Keep every file's mtime (seconds and nanoseconds). Python's `.pyc`
    /// files are validated against their source's mtime, so a base or
    /// toolkit layer should keep them.
    Preserve,
    /// Give every inode this mtime (seconds since the epoch): the image then
    /// depends only on names, contents, owners, modes and xattrs.
    Fixed(u64),
}

#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub uuid: [u8; 16],
    /// The superblock's build time, seconds since the epoch. Only compact
    /// inodes (which have no mtime of their own) show it.
    pub build_time_secs: u64,
    pub timestamps: Timestamps,
    /// Store the last partial block of small files and directories right
    /// after their inode (part of the metadata map, so prefetched with it)
    /// rather than in a data block of its own.
    pub inline_tails: bool,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self { uuid: DEFAULT_UUID, build_time_secs: 0, timestamps: Timestamps::Preserve, inline_tails: true }
    }
}

/// A layer file just built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltLayer {
    pub path: PathBuf,
    /// `sha256:<hex>` of the whole file.
    pub digest: String,
    pub size: u64,
    /// `(offset, len)` of every byte range that is not regular-file data.
    pub metadata_ranges: Vec<(u64, u64)>,
}

/// Builds `dest` from the tree under `src` (which the build reads as is:
/// its root directory's attributes become the layer root's).
pub fn build_from_dir(src: &Path, dest: &Path, opts: &BuildOptions) -> Result<BuiltLayer, ErofsError> {
    if !std::fs::metadata(src).map_err(|e| io_err(format!("reading {}", src.display()), e))?.is_dir() {
        return Err(ErofsError::NotADirectory(src.to_owned()));
    }
    let scratch = Scratch::new(dest)?;
    publish(scratch, src, dest, opts)
}

/// Builds `dest` from a tar stream (plain, gzip, zstd or xz), kept as is:
/// `.wh.` files stay ordinary files.
pub fn build_from_tar(archive: impl Read, dest: &Path, opts: &BuildOptions) -> Result<BuiltLayer, ErofsError> {
    build_from_archive(archive, dest, opts, |_| Ok(()))
}

/// Builds `dest` from an OCI (or Docker) layer tar, turning its whiteouts
/// into overlayfs form: `.wh.NAME` becomes a 0:0 character device `NAME`,
/// `.wh..wh..opq` becomes `trusted.overlay.opaque=y` on its directory.
pub fn build_from_oci_layer(archive: impl Read, dest: &Path, opts: &BuildOptions) -> Result<BuiltLayer, ErofsError> {
    build_from_archive(archive, dest, opts, crate::oci::whiteout::convert_to_overlay)
}

/// The byte ranges of the EROFS image at `path` that are not regular-file
/// data, as `(offset, len)`: what a lazily filled copy must hold before it
/// is mounted.
pub fn metadata_ranges(path: &Path) -> Result<Vec<(u64, u64)>, ErofsError> {
    let file = File::open(path).map_err(|e| io_err(format!("opening {}", path.display()), e))?;
    let len = file.metadata().map_err(|e| io_err(format!("reading {}", path.display()), e))?.len();
    let data = data_ranges_of(&file, path)?;
    Ok(format::complement(&data, len).into_iter().map(|r| (r.start, r.end - r.start)).collect())
}

/// The byte ranges of regular-file data blocks of the image at `path`,
/// sorted and merged: the complement of [`metadata_ranges`].
pub fn data_ranges(path: &Path) -> Result<Vec<Range<u64>>, ErofsError> {
    let file = File::open(path).map_err(|e| io_err(format!("opening {}", path.display()), e))?;
    data_ranges_of(&file, path)
}

/// The image's block size (4096 for every layer built here).
pub fn block_size(path: &Path) -> Result<u64, ErofsError> {
    let file = File::open(path).map_err(|e| io_err(format!("opening {}", path.display()), e))?;
    let sb = format::Superblock::read(&file).map_err(|source| ErofsError::Format { path: path.to_owned(), source })?;
    Ok(sb.block_size)
}

fn data_ranges_of(file: &File, path: &Path) -> Result<Vec<Range<u64>>, ErofsError> {
    format::data_ranges(file).map_err(|source| ErofsError::Format { path: path.to_owned(), source })
}

fn build_from_archive(
    archive: impl Read,
    dest: &Path,
    opts: &BuildOptions,
    prepare: impl FnOnce(&Path) -> Result<(), ErofsError>,
) -> Result<BuiltLayer, ErofsError> {
    let scratch = Scratch::new(dest)?;
    let tree = scratch.dir().join("tree");
    make_tree_root(&tree)?;
    crate::tar::extract(archive, &tree).map_err(ErofsError::Extract)?;
    prepare(&tree)?;
    pin_root_mtime(&tree, opts)?;
    publish(scratch, &tree, dest, opts)
}

/// The scratch tree's root stands for the layer's root when the archive has
/// no `./` entry: make it the same on every build.
fn make_tree_root(tree: &Path) -> Result<(), ErofsError> {
    std::fs::create_dir(tree).map_err(|e| io_err(format!("creating {}", tree.display()), e))?;
    std::fs::set_permissions(tree, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| io_err(format!("setting the mode of {}", tree.display()), e))
}

/// Extraction itself touches the root directory's mtime whether or not the
/// archive names `./`, so it is pinned to the build time.
fn pin_root_mtime(tree: &Path, opts: &BuildOptions) -> Result<(), ErofsError> {
    let secs = match opts.timestamps {
        Timestamps::Preserve => opts.build_time_secs,
        Timestamps::Fixed(secs) => secs,
    };
    let when = rustix::fs::Timespec { tv_sec: i64::try_from(secs).unwrap_or(i64::MAX), tv_nsec: 0 };
    let times = rustix::fs::Timestamps { last_access: when, last_modification: when };
    rustix::fs::utimensat(rustix::fs::CWD, tree, &times, rustix::fs::AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| io_err(format!("setting the times of {}", tree.display()), e.into()))
}

/// Runs mkfs on `tree` inside the scratch dir, pins the build time, syncs,
/// measures the result and only then renames it to `dest`.
fn publish(scratch: Scratch, tree: &Path, dest: &Path, opts: &BuildOptions) -> Result<BuiltLayer, ErofsError> {
    let image = scratch.dir().join("image.erofs");
    run_mkfs(tree, &image, opts)?;
    let file = File::options()
        .read(true)
        .write(true)
        .open(&image)
        .map_err(|e| io_err(format!("opening {}", image.display()), e))?;
    if opts.timestamps == Timestamps::Preserve {
        format::set_build_time(&file, opts.build_time_secs)
            .map_err(|source| ErofsError::Format { path: image.clone(), source })?;
    }
    file.sync_all().map_err(|e| io_err(format!("syncing {}", image.display()), e))?;
    let data = data_ranges_of(&file, &image)?;
    let (digest, size) = sha256_file(&file).map_err(|e| io_err(format!("hashing {}", image.display()), e))?;
    std::fs::rename(&image, dest).map_err(|e| io_err(format!("publishing {}", dest.display()), e))?;
    fsync_dir(parent_of(dest)).map_err(ErofsError::Scratch)?;
    let metadata_ranges = format::complement(&data, size).into_iter().map(|r| (r.start, r.end - r.start)).collect();
    drop(scratch);
    Ok(BuiltLayer { path: dest.to_owned(), digest, size, metadata_ranges })
}

fn run_mkfs(tree: &Path, image: &Path, opts: &BuildOptions) -> Result<(), ErofsError> {
    let output = Command::new("mkfs.erofs")
        .args(mkfs_args(tree, image, opts))
        .env("LC_ALL", "C")
        .env_remove("SOURCE_DATE_EPOCH")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ErofsError::Mkfs(format!("cannot run mkfs.erofs (install erofs-utils): {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    Err(ErofsError::Mkfs(format!("{} {}{}", output.status, stderr.trim(), stdout.trim())))
}

fn mkfs_args(tree: &Path, image: &Path, opts: &BuildOptions) -> Vec<OsString> {
    let mut args = vec![OsString::from("--quiet"), OsString::from(format!("-U{}", uuid_string(&opts.uuid)))];
    args.push(match opts.timestamps {
        Timestamps::Preserve => OsString::from("--preserve-mtime"),
        Timestamps::Fixed(secs) => OsString::from(format!("-T{secs}")),
    });
    if !opts.inline_tails {
        args.push(OsString::from("-Enoinline_data"));
    }
    args.extend([image.as_os_str().to_owned(), tree.as_os_str().to_owned()]);
    args
}

fn uuid_string(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// `sha256:<hex>` and length of a whole file.
pub(crate) fn sha256_file(file: &File) -> io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut offset = 0u64;
    loop {
        let n = std::os::unix::fs::FileExt::read_at(file, &mut buf, offset)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok((format!("sha256:{}", hex(&hasher.finalize())), offset))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

fn io_err(context: String, source: io::Error) -> ErofsError {
    ErofsError::Io { context, source }
}

/// A private scratch directory next to the destination (same filesystem, so
/// the final rename is atomic), removed with everything in it when dropped.
struct Scratch(DirGuard);

impl Scratch {
    fn new(dest: &Path) -> Result<Self, ErofsError> {
        private_scratch_dir(parent_of(dest), ".erofs-build-").map(Self).map_err(ErofsError::Scratch)
    }

    fn dir(&self) -> &Path {
        self.0.path()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_in_canonical_groups() {
        assert_eq!(uuid_string(&[0xab; 16]), "abababab-abab-abab-abab-abababababab");
    }

    #[test]
    fn mkfs_never_compresses_and_pins_time_as_asked() {
        let opts = BuildOptions { timestamps: Timestamps::Fixed(7), inline_tails: false, ..BuildOptions::default() };
        let args: Vec<String> = mkfs_args(Path::new("t"), Path::new("i"), &opts)
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.iter().all(|a| !a.starts_with("-z")), "{args:?}");
        assert!(args.contains(&"-T7".to_owned()) && args.contains(&"-Enoinline_data".to_owned()), "{args:?}");
        assert_eq!(&args[args.len() - 2..], ["i", "t"]);
    }
}

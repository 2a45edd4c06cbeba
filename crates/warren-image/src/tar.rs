//! Copies trees with the host's GNU tar, which already knows every file type,
//! hard links, xattrs, ACLs and sparse files, and refuses archive members that
//! would land outside the target (`..`, absolute names, writes through a
//! symlink the archive itself planted).

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;

use crate::error::{ImageError, Result};

/// How much of tar's stderr is kept for the error; the first lines name the
/// cause, the rest is usually a cascade.
const STDERR_KEEP_BYTES: usize = 16 * 1024;

/// Copies the tree under `src` into the existing directory `dst`, including
/// the attributes of `src` itself, without crossing into other mounts.
pub(crate) fn copy_dir(src: &Path, dst: &Path) -> Result<()> {
    let mut create = TarChild::spawn(create_args(src), Stdio::null(), Stdio::piped())?;
    let archive = create.take_stdout()?;
    let extract = TarChild::spawn(extract_args(dst, None), Stdio::from(archive), Stdio::null())?;
    // Wait for the reader first: if it dies, the writer gets EPIPE and exits.
    let extracted = extract.finish();
    let created = create.finish();
    match (created, extracted) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(c), Ok(())) => Err(ImageError::Tar(format!("reading {}: {c}", src.display()))),
        (Ok(()), Err(x)) => Err(ImageError::Tar(x)),
        (Err(c), Err(x)) => Err(ImageError::Tar(format!("reading {}: {c}; extracting: {x}", src.display()))),
    }
}

/// Extracts the tar stream `archive` (plain, gzip, zstd or xz) into the
/// existing directory `dst`.
pub(crate) fn extract(mut archive: impl Read, dst: &Path) -> Result<()> {
    let mut head = [0u8; 6];
    let head_len = read_up_to(&mut archive, &mut head)
        .map_err(|source| ImageError::Io { context: "reading the tar stream".into(), source })?;
    let head = &head[..head_len];
    let mut tar = TarChild::spawn(extract_args(dst, compression_flag(head)), Stdio::piped(), Stdio::null())?;
    let stdin = tar.take_stdin()?;
    let fed = feed(head.chain(archive), stdin);
    let status = tar.finish();
    match (fed, status) {
        // A failing reader cuts the archive short; tar's complaint about that
        // would hide the cause.
        (Err(Feed::Read(source)), _) => Err(ImageError::Io { context: "reading the tar stream".into(), source }),
        (_, Err(stderr)) => Err(ImageError::Tar(stderr)),
        // tar stops at the end-of-archive blocks; trailing padding is unread.
        (Err(Feed::Write(e)), Ok(())) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        (Err(Feed::Write(source)), Ok(())) => Err(ImageError::Io { context: "writing to tar".into(), source }),
        (Ok(()), Ok(())) => Ok(()),
    }
}

fn create_args(src: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = ["--create", "--file=-", "--sparse", "--one-file-system"].map(OsString::from).into();
    args.extend(attribute_args());
    args.extend([OsString::from("--directory"), src.as_os_str().to_owned(), OsString::from(".")]);
    args
}

fn extract_args(dst: &Path, compression: Option<&str>) -> Vec<OsString> {
    let mut args: Vec<OsString> =
        ["--extract", "--file=-", "--same-owner", "--preserve-permissions"].map(OsString::from).into();
    args.extend(attribute_args());
    args.extend(compression.map(OsString::from));
    args.extend([OsString::from("--directory"), dst.as_os_str().to_owned()]);
    args
}

/// Numeric ids because user names mean nothing across host and image; all
/// xattr namespaces so file capabilities (`security.capability`) survive.
fn attribute_args() -> [OsString; 4] {
    ["--numeric-owner", "--xattrs", "--xattrs-include=*", "--acls"].map(OsString::from)
}

/// GNU tar detects compression only on seekable files, not on a pipe.
fn compression_flag(head: &[u8]) -> Option<&'static str> {
    if head.starts_with(&[0x1f, 0x8b]) {
        Some("--gzip")
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Some("--zstd")
    } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
        Some("--xz")
    } else {
        None
    }
}

fn read_up_to(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

enum Feed {
    Read(io::Error),
    Write(io::Error),
}

/// Streams `reader` into tar's stdin, telling apart which side failed.
/// Closing stdin at the end is tar's end of input.
fn feed(mut reader: impl Read, mut stdin: ChildStdin) -> Result<(), Feed> {
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Feed::Read(e)),
        };
        stdin.write_all(&buf[..n]).map_err(Feed::Write)?;
    }
}

/// A running tar with its stderr drained on a thread (so a chatty tar never
/// blocks on a full pipe). Dropped unfinished, it is killed and reaped.
struct TarChild {
    child: Option<Child>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl TarChild {
    fn spawn(args: Vec<OsString>, stdin: Stdio, stdout: Stdio) -> Result<Self> {
        let mut child = Command::new("tar")
            .args(args)
            .env("LC_ALL", "C")
            .stdin(stdin)
            .stdout(stdout)
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| ImageError::Tar(format!("cannot run tar: {e}")))?;
        let stderr = child.stderr.take().map(|pipe| std::thread::spawn(move || drain(pipe)));
        Ok(Self { child: Some(child), stderr })
    }

    fn take_stdout(&mut self) -> Result<ChildStdout> {
        self.child
            .as_mut()
            .and_then(|c| c.stdout.take())
            .ok_or_else(|| ImageError::Tar("tar has no stdout pipe".into()))
    }

    fn take_stdin(&mut self) -> Result<ChildStdin> {
        self.child.as_mut().and_then(|c| c.stdin.take()).ok_or_else(|| ImageError::Tar("tar has no stdin pipe".into()))
    }

    /// Waits for tar; on failure returns its stderr (or exit status).
    fn finish(mut self) -> Result<(), String> {
        let Some(mut child) = self.child.take() else {
            return Err("tar was already reaped".into());
        };
        let status = child.wait();
        let stderr = self.stderr.take().and_then(|h| h.join().ok()).unwrap_or_default();
        let stderr = String::from_utf8_lossy(&stderr).trim().to_owned();
        match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) if stderr.is_empty() => Err(format!("tar exited with {s}")),
            Ok(_) => Err(stderr),
            Err(e) => Err(format!("waiting for tar: {e}")),
        }
    }
}

impl Drop for TarChild {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(handle) = self.stderr.take() {
            let _ = handle.join();
        }
    }
}

fn drain(mut pipe: impl Read) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => return kept,
            Ok(n) => {
                let room = STDERR_KEEP_BYTES.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return kept,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_is_sniffed_from_magic_bytes() {
        assert_eq!(compression_flag(&[0x1f, 0x8b, 8, 0, 0, 0]), Some("--gzip"));
        assert_eq!(compression_flag(&[0x28, 0xb5, 0x2f, 0xfd, 0, 0]), Some("--zstd"));
        assert_eq!(compression_flag(b"\xfd7zXZ\x00"), Some("--xz"));
        assert_eq!(compression_flag(b"etc/pa"), None);
        assert_eq!(compression_flag(b""), None);
    }
}

//! The file API of a sandbox whose root the node cannot open (a microVM's
//! guest): every operation is one connection to the sandbox's init, which
//! runs the same resolution inside its own root (see the file requests of
//! [`warren_init::proto`]). [`FileAccess`] gives the node one interface
//! over both ways.
//!
//! Blocking, like [`crate::files`]; the node calls it off the runtime.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use warren_api::{FileList, FileStat};
use warren_init::proto::{self, FrameKind, Request, Response};

use crate::files::{self, FileError, FileWriter, Result};
use crate::FsRoot;

/// Most bytes of one upload frame (init refuses frames over
/// [`proto::MAX_FRAME_BYTES`]).
const UPLOAD_CHUNK_BYTES: usize = 1 << 20;

/// The longest a `pack_diff` archive may go without a frame.
const PACK_SILENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// The control socket of a sandbox whose init serves file requests.
#[derive(Debug, Clone)]
pub struct RemoteFiles {
    sock: PathBuf,
}

fn link_error(e: io::Error) -> FileError {
    FileError::io("talk to the sandbox's init", e)
}

fn protocol(what: &str) -> FileError {
    link_error(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected answer from init: {what}")))
}

/// Reads init's next answer; its `FileError` becomes the error.
fn answer(conn: &mut UnixStream) -> Result<Response> {
    match proto::read_frame(conn).map_err(link_error)? {
        Some((FrameKind::Response, payload)) => {
            match serde_json::from_slice(&payload).map_err(|e| link_error(io::Error::other(e)))? {
                Response::FileError { error } => Err(error.into()),
                other => Ok(other),
            }
        }
        Some((kind, _)) => Err(protocol(&format!("{kind:?} frame"))),
        None => Err(link_error(io::Error::new(io::ErrorKind::UnexpectedEof, "init closed the connection"))),
    }
}

impl RemoteFiles {
    pub fn new(sock: PathBuf) -> RemoteFiles {
        RemoteFiles { sock }
    }

    fn send(&self, request: &Request) -> Result<UnixStream> {
        let mut conn = crate::unix_sock::connect_std(&self.sock).map_err(link_error)?;
        proto::write_json(&mut conn, FrameKind::Request, request).map_err(link_error)?;
        Ok(conn)
    }

    fn expect_stat(&self, request: &Request) -> Result<FileStat> {
        match answer(&mut self.send(request)?)? {
            Response::FileStat { stat } => Ok(stat),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }

    pub fn stat(&self, path: &str) -> Result<FileStat> {
        self.expect_stat(&Request::StatFile { path: path.into() })
    }

    pub fn list(&self, path: &str) -> Result<FileList> {
        match answer(&mut self.send(&Request::ListDir { path: path.into() })?)? {
            Response::FileList { list } => Ok(list),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }

    pub fn mkdir(&self, path: &str, mode: u32, parents: bool) -> Result<FileStat> {
        self.expect_stat(&Request::Mkdir { path: path.into(), mode, parents })
    }

    pub fn remove(&self, path: &str, recursive: bool) -> Result<()> {
        match answer(&mut self.send(&Request::RemoveFile { path: path.into(), recursive })?)? {
            Response::FileDone => Ok(()),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<FileStat> {
        self.expect_stat(&Request::RenameFile { from: from.into(), to: to.into() })
    }

    /// Opens `path` for reading; also returns its size.
    pub fn open_read(&self, path: &str) -> Result<(RemoteReader, u64)> {
        let mut conn = self.send(&Request::ReadFile { path: path.into() })?;
        match answer(&mut conn)? {
            Response::FileOpened { size_bytes } => Ok((RemoteReader::new(conn), size_bytes)),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }

    /// Starts the archive of the guest's writable layer (`pack_diff`, see
    /// [`Request::PackUpper`]); also returns how many of the sandbox's
    /// processes init stopped until the archive's end.
    pub fn open_pack(&self) -> Result<(RemoteReader, u32)> {
        let mut conn = self.send(&Request::PackUpper)?;
        // A guest that stops sending (paused meanwhile, or broken) fails
        // the pack instead of holding it, and its stopped processes, forever.
        conn.set_read_timeout(Some(PACK_SILENCE)).map_err(link_error)?;
        match answer(&mut conn)? {
            Response::PackOpened { stopped } => Ok((RemoteReader::new(conn), stopped)),
            Response::Error { message, .. } => Err(link_error(io::Error::other(message))),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }

    /// Starts an upload that replaces `path` on [`RemoteWriter::commit`].
    pub fn create_write(&self, path: &str, mode: u32) -> Result<RemoteWriter> {
        let mut conn = self.send(&Request::WriteFile { path: path.into(), mode })?;
        match answer(&mut conn)? {
            Response::FileReady => Ok(RemoteWriter { conn }),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }
}

/// A file's content as init streams it; ends with an error if init stops
/// before the whole file was sent.
pub struct RemoteReader {
    conn: UnixStream,
    pending: Vec<u8>,
    at: usize,
    ended: bool,
}

impl RemoteReader {
    /// Reads what init sends on `conn` after its first answer.
    fn new(conn: UnixStream) -> RemoteReader {
        RemoteReader { conn, pending: Vec::new(), at: 0, ended: false }
    }
}

impl Read for RemoteReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.pending.len() {
            if self.ended {
                return Ok(0);
            }
            match proto::read_frame(&mut self.conn)? {
                Some((FrameKind::Stdout, chunk)) => {
                    self.pending = chunk;
                    self.at = 0;
                }
                Some((FrameKind::Response, payload)) => match serde_json::from_slice(&payload) {
                    Ok(Response::FileEnd) => self.ended = true,
                    _ => return Err(io::Error::new(io::ErrorKind::InvalidData, "unexpected answer from init")),
                },
                _ => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "init broke off the download")),
            }
        }
        let n = buf.len().min(self.pending.len() - self.at);
        buf[..n].copy_from_slice(&self.pending[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// An upload staged in the guest: invisible there until committed, thrown
/// away when dropped uncommitted (the connection closes).
pub struct RemoteWriter {
    conn: UnixStream,
}

impl RemoteWriter {
    pub fn append(&mut self, buf: &[u8]) -> Result<()> {
        for chunk in buf.chunks(UPLOAD_CHUNK_BYTES) {
            // Init answers mid-upload only to refuse it (e.g. its disk is
            // full); stop sending at once then.
            self.refused_early()?;
            proto::write_frame(&mut self.conn, FrameKind::Stdin, chunk).map_err(link_error)?;
        }
        Ok(())
    }

    fn refused_early(&mut self) -> Result<()> {
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        match rustix::net::recv(&self.conn, &mut [0u8; 1], flags) {
            Err(rustix::io::Errno::AGAIN) => Ok(()),
            Ok(_) => {
                let other = answer(&mut self.conn)?;
                Err(protocol(&format!("{other:?}")))
            }
            Err(e) => Err(link_error(e.into())),
        }
    }

    /// Ends the upload and makes it the file.
    pub fn commit(mut self) -> Result<FileStat> {
        proto::write_frame(&mut self.conn, FrameKind::StdinEof, &[]).map_err(link_error)?;
        match answer(&mut self.conn)? {
            Response::FileStaged { .. } => {}
            other => return Err(protocol(&format!("{other:?}"))),
        }
        proto::write_frame(&mut self.conn, FrameKind::Commit, &[]).map_err(link_error)?;
        match answer(&mut self.conn)? {
            Response::FileStat { stat } => Ok(stat),
            other => Err(protocol(&format!("{other:?}"))),
        }
    }
}

/// A sandbox's files, however the driver offers them.
pub enum FileAccess {
    /// Resolved by the node in a root it holds open (a container).
    Local(FsRoot),
    /// Resolved by the sandbox's init (a microVM).
    Remote(RemoteFiles),
}

/// An upload in progress, see [`FileAccess::create_write`].
pub enum FileAccessWriter {
    Local(FileWriter),
    Remote(RemoteWriter),
}

impl FileAccess {
    /// How the sandbox of `handle` is reached: through a root the node
    /// holds open if the driver offers one, else through its init.
    pub fn of(driver: &dyn crate::Driver, handle: &crate::SandboxHandle) -> crate::Result<FileAccess> {
        match driver.fs_root(handle) {
            Ok(root) => Ok(FileAccess::Local(root)),
            Err(crate::BackendError::Unsupported(..)) => Ok(FileAccess::Remote(driver.remote_files(handle)?)),
            Err(e) => Err(e),
        }
    }

    pub fn stat(&self, path: &str) -> Result<FileStat> {
        match self {
            FileAccess::Local(root) => files::stat(root, path),
            FileAccess::Remote(r) => r.stat(path),
        }
    }

    pub fn list(&self, path: &str) -> Result<FileList> {
        match self {
            FileAccess::Local(root) => files::list(root, path),
            FileAccess::Remote(r) => r.list(path),
        }
    }

    pub fn mkdir(&self, path: &str, mode: u32, parents: bool) -> Result<FileStat> {
        match self {
            FileAccess::Local(root) => files::mkdir(root, path, mode, parents),
            FileAccess::Remote(r) => r.mkdir(path, mode, parents),
        }
    }

    pub fn remove(&self, path: &str, recursive: bool) -> Result<()> {
        match self {
            FileAccess::Local(root) => files::remove(root, path, recursive),
            FileAccess::Remote(r) => r.remove(path, recursive),
        }
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<FileStat> {
        match self {
            FileAccess::Local(root) => files::rename(root, from, to),
            FileAccess::Remote(r) => r.rename(from, to),
        }
    }

    /// The file's content and its size.
    pub fn open_read(&self, path: &str) -> Result<(Box<dyn Read + Send>, u64)> {
        match self {
            FileAccess::Local(root) => {
                let f = files::open_read(root, path)?;
                let len = f.metadata().map_err(|e| FileError::io("stat", e))?.len();
                Ok((Box::new(f), len))
            }
            FileAccess::Remote(r) => {
                let (reader, len) = r.open_read(path)?;
                Ok((Box::new(reader), len))
            }
        }
    }

    pub fn create_write(&self, path: &str, mode: u32) -> Result<FileAccessWriter> {
        match self {
            FileAccess::Local(root) => files::create_write(root, path, mode).map(FileAccessWriter::Local),
            FileAccess::Remote(r) => r.create_write(path, mode).map(FileAccessWriter::Remote),
        }
    }
}

impl FileAccessWriter {
    pub fn append(&mut self, buf: &[u8]) -> Result<()> {
        match self {
            FileAccessWriter::Local(w) => w.append(buf),
            FileAccessWriter::Remote(w) => w.append(buf),
        }
    }

    /// Replaces the file with what was appended.
    pub fn commit(self) -> Result<FileStat> {
        match self {
            FileAccessWriter::Local(w) => w.commit(),
            FileAccessWriter::Remote(w) => w.commit(),
        }
    }
}

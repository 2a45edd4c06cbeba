//! File access for the API: the node finds the sandbox, the backend resolves
//! every path inside the sandbox's root - on the host in a root the driver
//! opens ([`Driver::fs_root`], a container), or by the sandbox's own init
//! when the driver offers only that ([`Driver::remote_files`], a microVM).
//!
//! [`Driver::fs_root`]: warren_backend::Driver::fs_root
//! [`Driver::remote_files`]: warren_backend::Driver::remote_files

use std::io::Read;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use warren_api::{FileList, FileStat};
pub use warren_backend::files::FileError;
use warren_backend::remote_files::FileAccess;

use crate::{Node, NodeError, Result};

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| NodeError::Internal(format!("file task failed: {e}")))?
}

impl Node {
    pub(crate) fn fs_root(&self, id: &str) -> Result<FileAccess> {
        let live = self.live(id)?;
        live.touch();
        Ok(FileAccess::of(live.driver.as_ref(), &live.handle)?)
    }

    pub async fn stat_file(&self, id: &str, path: String) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(root.stat(&path)?)).await
    }

    pub async fn list_dir(&self, id: &str, path: String) -> Result<FileList> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(root.list(&path)?)).await
    }

    /// The file's content, exactly as many bytes as the returned size even
    /// if the sandbox changes the file meanwhile.
    pub async fn open_file(&self, id: &str, path: String) -> Result<(FileBody, u64)> {
        let root = self.fs_root(id)?;
        let (reader, len) = blocking(move || Ok(root.open_read(&path)?)).await?;
        Ok((body_of(reader.take(len)), len))
    }

    pub async fn mkdir(&self, id: &str, path: String, mode: u32, parents: bool) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(root.mkdir(&path, mode, parents)?)).await
    }

    pub async fn remove_file(&self, id: &str, path: String, recursive: bool) -> Result<()> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(root.remove(&path, recursive)?)).await
    }

    /// Moves `from` to `to` inside the sandbox (replacing a file at `to`).
    pub async fn rename_file(&self, id: &str, from: String, to: String) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(root.rename(&from, &to)?)).await
    }

    /// Streams `body` into a new file that replaces `path` atomically once
    /// the whole body arrived; a broken upload leaves the old file intact.
    pub async fn write_file<E: std::fmt::Display>(
        &self,
        id: &str,
        path: String,
        mode: u32,
        body: impl Stream<Item = Result<Bytes, E>> + Send,
    ) -> Result<FileStat> {
        let root = std::sync::Arc::new(self.fs_root(id)?);
        let mut writer = blocking(move || Ok(root.create_write(&path, mode)?)).await?;
        let mut body = std::pin::pin!(body);
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| NodeError::Internal(format!("upload broke off: {e}")))?;
            writer = blocking(move || {
                writer.append(&chunk)?;
                Ok(writer)
            })
            .await?;
        }
        blocking(move || Ok(writer.commit()?)).await
    }
}

/// A downloaded file's bytes.
pub type FileBody = std::pin::Pin<Box<dyn Stream<Item = std::io::Result<Bytes>> + Send>>;

const DOWNLOAD_CHUNK_BYTES: usize = 64 << 10;

/// Reads `reader` off the runtime, one chunk per blocking task.
fn body_of(reader: impl Read + Send + 'static) -> FileBody {
    Box::pin(futures_util::stream::unfold(Some(reader), |state| async move {
        let mut reader = state?;
        let read = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; DOWNLOAD_CHUNK_BYTES];
            let n = reader.read(&mut buf)?;
            buf.truncate(n);
            Ok::<_, std::io::Error>((buf, reader))
        })
        .await;
        match read {
            Ok(Ok((buf, _))) if buf.is_empty() => None,
            Ok(Ok((buf, reader))) => Some((Ok(Bytes::from(buf)), Some(reader))),
            Ok(Err(e)) => Some((Err(e), None)),
            Err(e) => Some((Err(std::io::Error::other(e)), None)),
        }
    }))
}

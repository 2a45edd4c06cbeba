//! File access for the API: the node finds the sandbox, the backend resolves
//! every path inside the sandbox's root.

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use warren_api::{FileList, FileStat};
use warren_backend::files;
pub use warren_backend::files::FileError;

use crate::{Node, NodeError, Result};

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| NodeError::Internal(format!("file task failed: {e}")))?
}

impl Node {
    pub(crate) fn fs_root(&self, id: &str) -> Result<warren_backend::FsRoot> {
        let live = self.live(id)?;
        live.touch();
        Ok(live.driver.fs_root(&live.handle)?)
    }

    pub async fn stat_file(&self, id: &str, path: String) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(files::stat(&root, &path)?)).await
    }

    pub async fn list_dir(&self, id: &str, path: String) -> Result<FileList> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(files::list(&root, &path)?)).await
    }

    pub async fn open_file(&self, id: &str, path: String) -> Result<(std::fs::File, u64)> {
        let root = self.fs_root(id)?;
        blocking(move || {
            let f = files::open_read(&root, &path)?;
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            Ok((f, len))
        })
        .await
    }

    pub async fn mkdir(&self, id: &str, path: String, mode: u32, parents: bool) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(files::mkdir(&root, &path, mode, parents)?)).await
    }

    pub async fn remove_file(&self, id: &str, path: String, recursive: bool) -> Result<()> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(files::remove(&root, &path, recursive)?)).await
    }

    /// Moves `from` to `to` inside the sandbox (replacing a file at `to`).
    pub async fn rename_file(&self, id: &str, from: String, to: String) -> Result<FileStat> {
        let root = self.fs_root(id)?;
        blocking(move || Ok(files::rename(&root, &from, &to)?)).await
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
        let mut writer = blocking(move || Ok(files::create_write(&root, &path, mode)?)).await?;
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

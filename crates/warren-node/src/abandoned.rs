//! A create whose call is dropped midway (its HTTP client went away, or a
//! caller gave up waiting): the future stops at whatever `.await` it was
//! at. The driver undoes a half-made sandbox itself, but what the node did
//! around it would stay: a `creating` record nobody finishes (listed, and a
//! retry with the same idempotency key waiting on it), or a sandbox made -
//! or claimed from a warm pool - that no live entry tracks. [`CreateGuard`]
//! is armed through the create and settled at its end; dropped unsettled,
//! it destroys what was made and records the sandbox ended
//! (`create_failed`), on a task of its own.

use std::sync::Arc;

use tokio::task::JoinHandle;
use warren_api::EndReason;
use warren_backend::{Driver, SandboxHandle};

use crate::records::SandboxRecord;
use crate::{joined, Node, Result};

/// What the end message of an abandoned create says.
pub(crate) const ABANDONED: &str = "the create was abandoned before it finished (its caller went away)";

pub(crate) struct CreateGuard {
    node: Node,
    id: String,
    /// The idempotency key this create claimed for `id`, if any.
    key: Option<String>,
    /// The record as the create stored it (or is storing it); `None` while
    /// nothing of it is durable.
    record: Option<SandboxRecord>,
    /// That record's commit, still running.
    pending: Option<JoinHandle<Result<()>>>,
    /// The sandbox, once made or claimed.
    made: Option<(Arc<dyn Driver>, SandboxHandle)>,
    settled: bool,
}

impl CreateGuard {
    /// A create of sandbox `id` that claimed `key`.
    pub(crate) fn new(node: Node, id: &str, key: Option<&str>) -> CreateGuard {
        CreateGuard {
            node,
            id: id.to_string(),
            key: key.map(str::to_string),
            record: None,
            pending: None,
            made: None,
            settled: false,
        }
    }

    /// `record` is being made durable by `commit`.
    pub(crate) fn recording(&mut self, record: &SandboxRecord, commit: JoinHandle<Result<()>>) {
        self.record = Some(record.clone());
        self.pending = Some(commit);
    }

    /// Waits for the record's commit, if one runs; held here meanwhile, so
    /// that a drop while waiting still orders the end after it.
    pub(crate) async fn recorded(&mut self) -> Option<Result<()>> {
        let outcome = joined(self.pending.as_mut()?.await);
        self.pending = None;
        Some(outcome)
    }

    pub(crate) fn made(&mut self, driver: &Arc<dyn Driver>, handle: &SandboxHandle) {
        self.made = Some((Arc::clone(driver), handle.clone()));
    }

    /// The create reached its end (made and tracked, or failed and recorded).
    pub(crate) fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for CreateGuard {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        self.node.inner.metrics.abandoned("create");
        let (node, record, pending, made) =
            (self.node.clone(), self.record.take(), self.pending.take(), self.made.take());
        let (id, key) = (std::mem::take(&mut self.id), self.key.take());
        if record.is_none() && made.is_none() && key.is_none() {
            return;
        }
        // A create runs on the runtime, so one is there to take this over.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            if let Some((driver, handle)) = made {
                if let Err(e) = driver.destroy(&handle).await {
                    tracing::warn!(sandbox = %handle.id, "abandoned create: teardown failed (swept at next start): {e}");
                }
            }
            // After it, so that the end is the record's last write.
            if let Some(pending) = pending {
                let _ = pending.await;
            }
            if let Some(mut rec) = record {
                rec.mark_ended(EndReason::CreateFailed, Some(ABANDONED.into()));
                node.inner.metrics.ended(rec.info.backend, EndReason::CreateFailed, &rec.info.project);
                if let Err(e) = joined(node.commit(rec).await) {
                    tracing::warn!(sandbox = %id, "abandoned create: cannot record its end: {e}");
                }
            }
            if let Some(key) = key {
                // A retry with the key makes the sandbox anew.
                let _ = node.release_idempotency_key(&key, &id);
            }
        });
    }
}

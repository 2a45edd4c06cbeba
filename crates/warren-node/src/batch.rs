//! Batch creation: `count` sandboxes from one template, each item an
//! ordinary idempotent create (key `{batch_key}-{i}`) that waits in the
//! admission queue while the node is full. A failed item fails alone.
//!
//! The batch runs in its own task: a client that goes away does not stop
//! it, and the same batch sent again (same `batch_key`) answers with the
//! sandboxes the first made, never new ones.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use warren_api::{BatchCreateRequest, CreateSandboxRequest, SandboxInfo};

use crate::admission::{Admit, Waiters};
use crate::{Node, NodeError, Result};

/// Items of one batch made at the same time: a create is mostly CPU work of
/// the node's own, and a few in flight keep it busy; the rest wait in line
/// inside the batch, not in the node's queue.
const BATCH_CONCURRENCY: usize = 8;

/// What a running batch reports, in order: progress while items wait,
/// then each item as it finishes (the channel closes after the last).
#[derive(Debug)]
pub enum BatchEvent {
    /// The batch's first waiting item is at `position` (1: next) of the
    /// admission queue; `items_waiting` of its items are not admitted yet.
    Queued { position: u64, items_waiting: u64 },
    /// Item `index`: the sandbox and whether this call made it, or its error.
    Item { index: u32, result: Box<Result<(SandboxInfo, bool)>> },
}

impl Node {
    /// Starts a batch and returns its events. Refused as a whole only when
    /// the request is invalid or the admission queue is full already.
    pub fn create_batch(&self, req: BatchCreateRequest) -> Result<mpsc::UnboundedReceiver<BatchEvent>> {
        req.validate().map_err(NodeError::Invalid)?;
        if req.queue && self.inner.admission.is_full() {
            return Err(NodeError::AdmissionQueueFull { limit: self.inner.admission.limit() });
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let node = self.clone();
        tokio::spawn(async move { node.run_batch(req, tx).await });
        Ok(rx)
    }

    /// A create that waits in the admission queue while the node is full.
    /// It runs in its own task, so a caller that goes away does not undo it:
    /// a retry with the same idempotency key finds the sandbox.
    pub async fn create_queued(&self, req: CreateSandboxRequest) -> Result<(SandboxInfo, bool)> {
        let node = self.clone();
        tokio::spawn(async move { node.create_with(req, Admit::Queue(None)).await })
            .await
            .map_err(|e| NodeError::Internal(format!("create task: {e}")))?
    }

    async fn run_batch(self, req: BatchCreateRequest, tx: mpsc::UnboundedSender<BatchEvent>) {
        let waiters = Arc::new(Waiters::default());
        let started = Arc::new(AtomicU32::new(0));
        let req = Arc::new(req);
        let count = req.count;
        let mut items = futures_util::stream::iter(0..count)
            .map(|index| {
                let (node, req, waiters, started) =
                    (self.clone(), Arc::clone(&req), Arc::clone(&waiters), Arc::clone(&started));
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    let mode = if req.queue { Admit::Queue(Some(&*waiters)) } else { Admit::Now };
                    (index, node.create_with(req.item(index), mode).await)
                }
            })
            .buffer_unordered(BATCH_CONCURRENCY);
        let mut changed = self.inner.admission.subscribe();
        let mut last = None;
        loop {
            tokio::select! {
                item = items.next() => match item {
                    // A client that went away stops nothing: the items are made all the same.
                    Some((index, result)) => {
                        let _ = tx.send(BatchEvent::Item { index, result: Box::new(result) });
                    }
                    None => break,
                },
                _ = changed.changed() => {
                    let Some(position) = self.inner.admission.position_of(&waiters) else { continue };
                    let not_started = u64::from(count - started.load(Ordering::SeqCst));
                    let items_waiting = not_started + waiters.len() as u64;
                    if last != Some((position, items_waiting)) {
                        last = Some((position, items_waiting));
                        let _ = tx.send(BatchEvent::Queued { position, items_waiting });
                    }
                }
            }
        }
    }
}

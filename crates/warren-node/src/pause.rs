//! Pause and resume: a paused sandbox's processes are stopped where they
//! are (the container backend freezes its cgroup) until it is resumed, by
//! `resume` or by the next request that needs its processes. With
//! `?to_disk=true` (microVMs and full VMs) the memory goes to disk and QEMU exits; the
//! resume, explicit or on the next request, loads it back on this node.
//!
//! Timers: the lifetime keeps counting while paused (it bounds what a
//! sandbox may hold); the idle timeout does not (a paused sandbox is idle
//! on purpose) and starts afresh on resume. A paused sandbox's memory is
//! reclaimable in the admission books. A restart re-adopts a paused
//! sandbox still paused.

use std::sync::Arc;

use warren_api::{SandboxInfo, SandboxState};

use crate::{joined, now_ms, Live, Node, NodeError, Result};

impl Node {
    /// Pauses a running sandbox; pausing a paused one answers its record.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo> {
        self.pause_with(id, false).await
    }

    /// [`Node::pause`]; with `to_disk` the sandbox's memory goes to disk
    /// and is released until the resume (a VM's QEMU exits), also for
    /// one already paused in memory. Backends that cannot answer
    /// `unsupported`.
    pub async fn pause_with(&self, id: &str, to_disk: bool) -> Result<SandboxInfo> {
        let live = self.live_as_is(id)?;
        let node = self.clone();
        let paused = Arc::clone(&live);
        let rec = tokio::task::spawn_blocking(move || {
            let _gate = node.pause_gate();
            if paused.record().info.state == SandboxState::Paused {
                if to_disk {
                    paused.driver.pause_to_disk(&paused.handle)?;
                }
                return Ok(None);
            }
            match to_disk {
                true => paused.driver.pause_to_disk(&paused.handle)?,
                false => paused.driver.pause(&paused.handle)?,
            }
            let mut rec = paused.record();
            rec.info.state = SandboxState::Paused;
            Ok::<_, NodeError>(Some(rec.clone()))
        })
        .await
        .map_err(|e| NodeError::Internal(format!("pause task: {e}")))??;
        if let Some(rec) = rec {
            joined(self.commit(rec).await)?;
            // Its memory is reclaimable now: a create waiting on memory may fit.
            self.inner.admission.bump();
            tracing::info!(sandbox = %id, "paused");
        }
        self.get(id)
    }

    /// Resumes a paused sandbox; resuming a running one answers its record.
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo> {
        let live = self.live_as_is(id)?;
        if let Some(rec) = self.wake(&live)? {
            joined(self.commit(rec).await)?;
        }
        self.get(id)
    }

    /// Thaws `live` if it is paused and returns the record to persist.
    /// Quick (the driver's resume is one write for a container), so every
    /// request path calls it inline through [`Node::live`].
    fn wake(&self, live: &Live) -> Result<Option<crate::records::SandboxRecord>> {
        if live.record().info.state != SandboxState::Paused {
            return Ok(None);
        }
        let _gate = self.pause_gate();
        let mut rec = live.record();
        if rec.info.state != SandboxState::Paused {
            return Ok(None);
        }
        live.driver.resume(&live.handle)?;
        rec.info.state = SandboxState::Running;
        // The idle timeout starts afresh: the pause itself was not idleness.
        rec.info.last_activity_at_ms = now_ms();
        tracing::info!(sandbox = %live.id, "resumed");
        Ok(Some(rec.clone()))
    }

    /// [`Node::live_as_is`], resumed first when paused: what every request
    /// that needs the sandbox's processes goes through.
    pub(crate) fn live(&self, id: &str) -> Result<Arc<Live>> {
        let live = self.live_as_is(id)?;
        if let Some(rec) = self.wake(&live)? {
            // Durable in the background: the request must not wait for the disk.
            drop(self.commit(rec));
        }
        Ok(live)
    }

    fn pause_gate(&self) -> std::sync::MutexGuard<'_, ()> {
        self.inner.pause_gate.lock().unwrap_or_else(|p| p.into_inner())
    }
}

//! What the node persists in the state store, and the small JSON helpers.

use std::collections::BTreeMap;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use warren_api::{CreateSandboxRequest, ExecFrame, ExecResult, ImageInfo, SandboxInfo, SessionInfo, StreamName};
use warren_backend::SandboxHandle;

/// One sandbox, keyed by id in [`Table::Sandboxes`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub info: SandboxInfo,
    pub env: BTreeMap<String, String>,
    /// Present while the sandbox runs: what the driver needs to re-adopt it.
    pub handle: Option<SandboxHandle>,
}

/// Keyed by idempotency key in [`Table::Idempotency`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IdempotencyClaim {
    pub sandbox_id: String,
    pub request_hash: String,
}

/// Keyed by `<sandbox>/<session>` in [`Table::Sessions`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionRecord {
    pub id: String,
    pub cwd: String,
    /// The complete environment the next command starts with.
    pub env: BTreeMap<String, String>,
    pub created_at_ms: u64,
    pub commands_run: u64,
}

impl SessionRecord {
    /// The client's view: only variables that differ from the sandbox's base.
    pub fn info(&self, base: &BTreeMap<String, String>) -> SessionInfo {
        SessionInfo {
            id: self.id.clone(),
            cwd: self.cwd.clone(),
            env: self
                .env
                .iter()
                .filter(|(k, v)| base.get(*k) != Some(v))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            created_at_ms: self.created_at_ms,
            commands_run: self.commands_run,
        }
    }
}

/// A stable digest of a create request without its idempotency key, so a
/// replay with identical content is recognised and a different one refused.
pub fn request_hash(req: &CreateSandboxRequest) -> String {
    let mut canon = req.clone();
    canon.idempotency_key = None;
    let bytes = serde_json::to_vec(&canon).unwrap_or_default();
    // FNV-1a: not cryptographic, only a conflict check between calls of one client key.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

pub fn image_info(img: warren_image::Image) -> ImageInfo {
    ImageInfo {
        name: img.name().to_string(),
        layers: img.layers().iter().map(|l| l.id().to_string()).collect(),
        created_at_ms: img.created_at_ms(),
    }
}

/// The frames a reader at the given offsets gets from a finished, stored exec.
pub fn replay_frames(mut result: ExecResult, stdout_offset: u64, stderr_offset: u64) -> Vec<ExecFrame> {
    let mut frames = Vec::new();
    if let Some(output) = result.output.take() {
        for (name, cap, from) in
            [(StreamName::Stdout, output.stdout, stdout_offset), (StreamName::Stderr, output.stderr, stderr_offset)]
        {
            let kept = base64::engine::general_purpose::STANDARD.decode(&cap.data_b64).unwrap_or_default();
            let head_len = cap.dropped_at.unwrap_or(kept.len() as u64);
            let tail_start = head_len + cap.dropped_bytes;
            // The kept bytes are the head (offsets 0..) followed by the tail (offsets tail_start..).
            let (head, tail) = kept.split_at((head_len as usize).min(kept.len()));
            let mut off = from;
            if off < head_len {
                frames.push(output_frame(name, off, &head[off as usize..]));
                off = head_len;
            }
            if off < tail_start {
                frames.push(ExecFrame::Gap { stream: name, offset: off, dropped_bytes: tail_start - off });
                off = tail_start;
            }
            if off < cap.total_bytes {
                let skip = ((off - tail_start) as usize).min(tail.len());
                frames.push(output_frame(name, off, &tail[skip..]));
            }
        }
    }
    frames.push(ExecFrame::End { result: Box::new(result) });
    frames
}

fn output_frame(stream: StreamName, offset: u64, data: &[u8]) -> ExecFrame {
    ExecFrame::Output { stream, offset, data_b64: base64::engine::general_purpose::STANDARD.encode(data) }
}

/// The API's view of an event init recorded.
pub fn security_event(e: warren_backend::SecurityEvent) -> warren_api::SecurityEvent {
    warren_api::SecurityEvent {
        seq: e.seq,
        time_ms: e.time_ms,
        pid: e.pid,
        comm: e.comm,
        kind: match e.kind {
            warren_backend::SecurityEventKind::Seccomp => warren_api::SecurityEventKind::Seccomp,
        },
        syscall: e.syscall,
        detail: e.detail,
    }
}

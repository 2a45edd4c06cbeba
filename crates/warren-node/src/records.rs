//! What the node persists in the state store, and the small JSON helpers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use warren_api::{
    CreateSandboxRequest, EndReason, ExecFrame, ExecOutput, ExecResult, ImageInfo, SandboxInfo, SandboxState,
    SessionInfo, StreamName,
};
use warren_backend::SandboxHandle;

use crate::capture::Capture;
use crate::exec::push_frames;

/// An exec result as stored (exec records, trajectory steps and their data
/// files): its output without `text`, which is the lossy UTF-8 decoding of
/// `data_b64` and is made again by [`with_text`] on reading. The text was
/// most of a stored output (a megabyte of it took 2.3 MB as JSON).
pub fn without_text(mut result: ExecResult) -> ExecResult {
    if let Some(output) = result.output.as_mut() {
        output_without_text(output);
    }
    result
}

/// [`without_text`] for an output alone.
pub fn output_without_text(output: &mut ExecOutput) {
    output.stdout.text.clear();
    output.stderr.text.clear();
}

/// A stored result as the API answers it: see [`without_text`]. A record
/// stored with its text (by an earlier version) is left as it is.
pub fn with_text(mut result: ExecResult) -> ExecResult {
    if let Some(output) = result.output.as_mut() {
        output_with_text(output);
    }
    result
}

/// [`with_text`] for an output alone.
pub fn output_with_text(output: &mut ExecOutput) {
    use base64::Engine as _;
    for stream in [&mut output.stdout, &mut output.stderr] {
        if stream.text.is_empty() && !stream.data_b64.is_empty() {
            if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(&stream.data_b64) {
                stream.text = String::from_utf8_lossy(&bytes).into_owned();
            }
        }
    }
}

/// One sandbox, keyed by id in [`Table::Sandboxes`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub info: SandboxInfo,
    /// The sandbox's environment: its image's `Env` overridden by the
    /// create request's.
    pub env: BTreeMap<String, String>,
    /// Default working directory of execs and sessions (the image's
    /// `WorkingDir`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Present while the sandbox runs: what the driver needs to re-adopt it.
    pub handle: Option<SandboxHandle>,
}

impl SandboxRecord {
    /// The record of the sandbox ended now with `reason`: nothing of it
    /// runs, so no handle and no usage are kept.
    pub fn mark_ended(&mut self, reason: EndReason, message: Option<String>) {
        self.info.state = SandboxState::Ended;
        self.info.end_reason = Some(reason);
        self.info.end_message = message;
        self.info.ended_at_ms = Some(crate::now_ms());
        self.info.usage = None;
        self.handle = None;
    }
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
        let (mut out_at, mut err_at) = (stdout_offset, stderr_offset);
        push_frames(StreamName::Stdout, &Capture::restore(&output.stdout), &mut out_at, &mut frames);
        push_frames(StreamName::Stderr, &Capture::restore(&output.stderr), &mut err_at, &mut frames);
    }
    frames.push(ExecFrame::End { result: Box::new(result) });
    frames
}

/// An event init recorded, as the sandbox's timeline takes it.
pub fn observed(e: warren_backend::SecurityEvent) -> crate::events::Observed {
    crate::events::Observed {
        kind: match e.kind {
            warren_backend::SecurityEventKind::Seccomp => warren_api::SecurityEventKind::Seccomp,
            warren_backend::SecurityEventKind::Tamper => warren_api::SecurityEventKind::Tamper,
        },
        pid: e.pid,
        comm: e.comm,
        syscall: e.syscall,
        detail: e.detail,
        time_ms: e.time_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn captured(bytes: &[u8]) -> warren_api::CapturedOutput {
        use base64::Engine as _;
        warren_api::CapturedOutput {
            text: String::from_utf8_lossy(bytes).into_owned(),
            data_b64: base64::engine::general_purpose::STANDARD.encode(bytes),
            total_bytes: bytes.len() as u64,
            ..Default::default()
        }
    }

    #[test]
    fn a_stored_output_loses_its_text_and_gets_the_same_back() {
        let output = ExecOutput { stdout: captured("héllo\n".as_bytes()), stderr: captured(b"bad \xff byte") };
        let mut stored = output.clone();
        output_without_text(&mut stored);
        assert_eq!((stored.stdout.text.as_str(), stored.stderr.text.as_str()), ("", ""));
        assert!(serde_json::to_vec(&stored).unwrap().len() < serde_json::to_vec(&output).unwrap().len());
        output_with_text(&mut stored);
        assert_eq!(stored, output);
        // A record an earlier version stored with its text reads the same.
        let mut legacy = output.clone();
        output_with_text(&mut legacy);
        assert_eq!(legacy, output);
    }
}

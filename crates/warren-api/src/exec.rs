//! Exec: the request, the NDJSON stream frames and the final result.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::sandbox::{validate_env, MAX_TIMEOUT_SECS};

/// Default per-stream capture cap when the request names none.
pub const DEFAULT_OUTPUT_CAP_BYTES: u64 = 1 << 20;
/// Largest per-stream capture cap a request may ask for.
pub const MAX_OUTPUT_CAP_BYTES: u64 = 64 << 20;
pub const DEFAULT_EXEC_TIMEOUT_SECS: f64 = 3600.0;

/// `POST /v1/sandboxes/{id}/exec` and `.../sessions/{sid}/exec`.
/// Exactly one of `argv` and `command` (a `/bin/sh -c` string) is given;
/// session commands take `command` only.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Working directory inside the sandbox (default `/`, or the session's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Added to (and overriding) the sandbox's and session's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// UTF-8 text written to the process's stdin, then closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Binary stdin, base64; exclusive with `stdin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    /// The server kills the whole process tree after this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
    /// Per-stream capture cap; head and tail halves are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_cap_bytes: Option<u64>,
}

impl ExecRequest {
    pub fn shell(command: impl Into<String>) -> Self {
        ExecRequest { command: Some(command.into()), ..Default::default() }
    }

    pub fn argv<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        ExecRequest { argv: Some(argv.into_iter().map(Into::into).collect()), ..Default::default() }
    }

    pub fn validate(&self, session: bool) -> Result<(), ApiError> {
        match (&self.argv, &self.command) {
            (Some(_), Some(_)) => return Err(ApiError::invalid("argv", "give either argv or command, not both")),
            (None, None) => return Err(ApiError::invalid("command", "give argv or command")),
            (Some(_), None) if session => {
                return Err(ApiError::invalid("argv", "session commands take `command`, a shell string"))
            }
            (Some(argv), None) => {
                if argv.is_empty() || argv[0].is_empty() {
                    return Err(ApiError::invalid("argv", "must name a program"));
                }
                if argv.iter().any(|a| a.contains('\0')) {
                    return Err(ApiError::invalid("argv", "must not contain NUL"));
                }
            }
            (None, Some(c)) => {
                if c.contains('\0') {
                    return Err(ApiError::invalid("command", "must not contain NUL"));
                }
            }
        }
        if let Some(cwd) = &self.cwd {
            if !cwd.starts_with('/') || cwd.contains('\0') {
                return Err(ApiError::invalid("cwd", "must be an absolute path"));
            }
        }
        validate_env(&self.env, "env")?;
        if self.stdin.is_some() && self.stdin_b64.is_some() {
            return Err(ApiError::invalid("stdin_b64", "give either stdin or stdin_b64, not both"));
        }
        if let Some(t) = self.timeout_secs {
            if !(t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_SECS as f64) {
                return Err(ApiError::invalid("timeout_secs", format!("must be > 0 and <= {MAX_TIMEOUT_SECS}")));
            }
        }
        if let Some(cap) = self.output_cap_bytes {
            if !(2..=MAX_OUTPUT_CAP_BYTES).contains(&cap) {
                return Err(ApiError::invalid(
                    "output_cap_bytes",
                    format!("must be between 2 and {MAX_OUTPUT_CAP_BYTES}"),
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StreamName {
    Stdout,
    Stderr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExecStatus {
    Running,
    /// The process exited or was killed by a signal of its own making.
    Ok,
    /// The deadline passed; the server killed the whole process tree.
    TimedOut,
    /// Killed by the platform (sandbox ended, server restarted).
    Killed,
    /// Killed by the out-of-memory killer.
    Oom,
}

/// One line of the NDJSON stream (`application/x-ndjson`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecFrame {
    /// First frame: the durable exec id to resume or fetch the result with.
    Started { exec_id: String },
    /// Bytes of one stream starting at byte `offset` of that stream.
    Output { stream: StreamName, offset: u64, data_b64: String },
    /// Bytes `offset..offset+dropped_bytes` of a stream were not kept (capture cap).
    Gap { stream: StreamName, offset: u64, dropped_bytes: u64 },
    /// Last frame.
    End { result: Box<ExecResult> },
}

/// What was kept of one output stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema, Default)]
pub struct CapturedOutput {
    /// Kept bytes decoded as UTF-8 (lossy); head and tail joined.
    pub text: String,
    /// Kept bytes exactly, base64.
    pub data_b64: String,
    /// Bytes the process wrote in all.
    pub total_bytes: u64,
    /// Bytes dropped from the middle to respect the cap.
    pub dropped_bytes: u64,
    /// Stream offset where the dropped range begins (equals the head length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropped_at: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ExecOutput {
    pub stdout: CapturedOutput,
    pub stderr: CapturedOutput,
}

/// Final result of an exec; `GET .../exec/{exec_id}` also answers with it
/// (with `status: running` and no exit fields while it runs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ExecResult {
    pub exec_id: String,
    pub status: ExecStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Signal that ended the process, when it was a signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    pub wall_time_secs: f64,
    pub cpu_time_secs: f64,
    pub peak_memory_bytes: u64,
    pub started_at_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Present in `GET .../exec/{id}` and `?wait=true` answers; absent in the
    /// stream's `end` frame, whose output came as frames.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<ExecOutput>,
    /// The node no longer keeps this exec's output (so `output` is absent):
    /// it keeps a sandbox's newest finished outputs up to a budget
    /// (`warren serve --exec-output-retention-mib`) and drops the oldest
    /// beyond it. Status, exit and timings stay.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub output_expired: bool,
}

/// Query of `GET .../exec/{exec_id}/stream`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct ResumeQuery {
    #[serde(default)]
    pub stdout_offset: u64,
    #[serde(default)]
    pub stderr_offset: u64,
}

/// `GET /v1/sandboxes/{id}/exec`: the sandbox's execs by start time,
/// without their output (fetch one exec for that).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ExecList {
    pub execs: Vec<ExecResult>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_requests_need_exactly_one_program_form() {
        assert_eq!(ExecRequest::default().validate(false).unwrap_err().field.as_deref(), Some("command"));
        let both = ExecRequest { argv: Some(vec!["ls".into()]), command: Some("ls".into()), ..Default::default() };
        assert_eq!(both.validate(false).unwrap_err().field.as_deref(), Some("argv"));
        assert!(ExecRequest::argv(["ls"]).validate(false).is_ok());
        assert_eq!(ExecRequest::argv(["ls"]).validate(true).unwrap_err().field.as_deref(), Some("argv"));
        assert!(ExecRequest::shell("cd /tmp").validate(true).is_ok());
    }

    #[test]
    fn exec_limits_name_their_field() {
        let bad = |r: ExecRequest| r.validate(false).unwrap_err().field.unwrap();
        assert_eq!(bad(ExecRequest { timeout_secs: Some(0.0), ..ExecRequest::shell("x") }), "timeout_secs");
        assert_eq!(bad(ExecRequest { timeout_secs: Some(f64::NAN), ..ExecRequest::shell("x") }), "timeout_secs");
        assert_eq!(bad(ExecRequest { output_cap_bytes: Some(1), ..ExecRequest::shell("x") }), "output_cap_bytes");
        assert_eq!(bad(ExecRequest { cwd: Some("rel".into()), ..ExecRequest::shell("x") }), "cwd");
        let both_stdin =
            ExecRequest { stdin: Some("a".into()), stdin_b64: Some("YQ==".into()), ..ExecRequest::shell("x") };
        assert_eq!(bad(both_stdin), "stdin_b64");
    }
}

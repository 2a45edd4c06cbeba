//! The one error type of the benchmark. A failed sample is recorded and the
//! run goes on; a failed setup step ends that contender's measure only.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start `{program}`: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// A peer tool or helper exited unsuccessfully.
    #[error("`{command}` failed ({status}): {stderr}")]
    Tool { command: String, status: String, stderr: String },
    #[error("`{command}` did not finish within {limit:?}")]
    ToolTimeout { command: String, limit: Duration },
    #[error("{what} did not happen within {limit:?}")]
    Timeout { what: String, limit: Duration },
    #[error("HTTP {op}: {source}")]
    Http {
        op: String,
        #[source]
        source: reqwest::Error,
    },
    /// The Warren API answered with an error status.
    #[error("{op}: HTTP {status}: {body}")]
    Api { op: String, status: u16, body: String },
    /// The Warren API answered 2xx but the result is not what was asked for.
    #[error("{op}: {detail}")]
    Unexpected { op: String, detail: String },
    #[error("cannot parse {what}: {detail}")]
    Parse { what: String, detail: String },
    #[error("the warren server exited early ({status}); last log lines:\n{log_tail}")]
    ServerDied { status: String, log_tail: String },
    #[error("interrupted")]
    Interrupted,
}

impl BenchError {
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io { what, path: path.into(), source }
    }

    pub fn parse(what: impl Into<String>, detail: impl ToString) -> Self {
        BenchError::Parse { what: what.into(), detail: detail.to_string() }
    }
}

pub type Result<T, E = BenchError> = std::result::Result<T, E>;

//! Function calls (`POST /v1/functions/run`): one short, stateless run of
//! code or a command in a fresh worker, with files in and out.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::exec::{ExecResult, MAX_OUTPUT_CAP_BYTES};
use crate::sandbox::{validate_env, MAX_CPUS, MAX_MEMORY_MIB, MIN_MEMORY_MIB};

/// Deadline of a call that names none.
pub const DEFAULT_FUNCTION_TIMEOUT_SECS: f64 = 30.0;
/// Longest deadline a call may ask for: function calls are short by design.
pub const MAX_FUNCTION_TIMEOUT_SECS: f64 = 3600.0;
/// Bytes of all files sent in with one call, decoded.
pub const MAX_FUNCTION_FILES_BYTES: u64 = 32 << 20;
/// Largest file fetched back; a larger one answers `too_large`.
pub const MAX_FETCH_FILE_BYTES: u64 = 16 << 20;
/// Files a call may send in or fetch back.
pub const MAX_FUNCTION_FILES: usize = 256;
/// Working directory of a call that names none; created empty.
pub const DEFAULT_FUNCTION_CWD: &str = "/work";

/// What `code` is written in. The image must carry the toolchain; a call
/// for a language whose toolchain the image lacks is refused naming
/// `language`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Language {
    /// `python3`.
    Python,
    /// `bash`.
    Bash,
    /// POSIX `sh` (every image with a shell has it).
    Sh,
    /// Compiled with `cc` (or `gcc`), then run.
    C,
    /// Compiled with `c++` (or `g++`), then run.
    Cpp,
    /// `node` (or `nodejs`).
    Javascript,
}

impl Language {
    pub fn as_str(self) -> &'static str {
        match self {
            Language::Python => "python",
            Language::Bash => "bash",
            Language::Sh => "sh",
            Language::C => "c",
            Language::Cpp => "cpp",
            Language::Javascript => "javascript",
        }
    }

    /// The programs that provide the language, preferred first.
    pub fn toolchain(self) -> &'static [&'static str] {
        match self {
            Language::Python => &["python3"],
            Language::Bash => &["bash"],
            Language::Sh => &["sh"],
            Language::C => &["cc", "gcc"],
            Language::Cpp => &["c++", "g++"],
            Language::Javascript => &["node", "nodejs"],
        }
    }
}

/// `POST /v1/functions/run`. Exactly one of `code` (with `language`),
/// `command` (a `/bin/sh -c` string) and `argv` is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct RunFunctionRequest {
    /// Image name (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<Language>,
    /// Source text in `language`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Arguments passed to the program that runs `code`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// UTF-8 text written to stdin, then closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Binary stdin, base64; exclusive with `stdin`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin_b64: Option<String>,
    /// Files written before the run: path (absolute, or relative to `cwd`) -> UTF-8 content.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<String, String>,
    /// Binary files written before the run: path -> base64 content.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files_b64: BTreeMap<String, String>,
    /// Paths (absolute, or relative to `cwd`) read back after the run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fetch: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory (default `/work`, created empty).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The whole run (compilation included) is killed after this long (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<f64>,
    /// Memory limit of the worker (default: the image's function pool's, else 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// CPU cores of the worker (default: the image's function pool's, else 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Per-stream capture cap; head and tail halves are kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_cap_bytes: Option<u64>,
}

fn validate_path(path: &str, field: &str) -> Result<(), ApiError> {
    if path.is_empty() || path.len() > 4096 || path.contains('\0') {
        return Err(ApiError::invalid(field, format!("`{path}` is not a valid path")));
    }
    if path.split('/').any(|c| c == "..") {
        return Err(ApiError::invalid(field, format!("`{path}` must not contain `..`")));
    }
    Ok(())
}

impl RunFunctionRequest {
    /// Checks shapes and ranges; the error names the first offending field.
    pub fn validate(&self) -> Result<(), ApiError> {
        if let Some(image) = &self.image {
            if image.is_empty() || image.len() > 256 {
                return Err(ApiError::invalid("image", "must be 1-256 characters"));
            }
        }
        let forms = [self.code.is_some(), self.command.is_some(), self.argv.is_some()];
        match forms.iter().filter(|f| **f).count() {
            0 => return Err(ApiError::invalid("code", "give code (with language), command or argv")),
            1 => {}
            _ => return Err(ApiError::invalid("code", "give only one of code, command and argv")),
        }
        match (&self.code, self.language) {
            (Some(_), None) => return Err(ApiError::invalid("language", "code needs a language")),
            (None, Some(_)) => return Err(ApiError::invalid("language", "language goes with code")),
            _ => {}
        }
        if self.code.as_deref().is_some_and(|c| c.contains('\0')) {
            return Err(ApiError::invalid("code", "must not contain NUL"));
        }
        if self.command.as_deref().is_some_and(|c| c.contains('\0')) {
            return Err(ApiError::invalid("command", "must not contain NUL"));
        }
        if let Some(argv) = &self.argv {
            if argv.is_empty() || argv[0].is_empty() || argv.iter().any(|a| a.contains('\0')) {
                return Err(ApiError::invalid("argv", "must name a program and contain no NUL"));
            }
        }
        if !self.args.is_empty() && self.code.is_none() {
            return Err(ApiError::invalid("args", "args go with code; put them in argv or command"));
        }
        if self.args.iter().any(|a| a.contains('\0')) {
            return Err(ApiError::invalid("args", "must not contain NUL"));
        }
        if self.stdin.is_some() && self.stdin_b64.is_some() {
            return Err(ApiError::invalid("stdin_b64", "give either stdin or stdin_b64, not both"));
        }
        if self.files.len() + self.files_b64.len() > MAX_FUNCTION_FILES {
            return Err(ApiError::invalid("files", format!("at most {MAX_FUNCTION_FILES} files")));
        }
        for path in self.files.keys() {
            validate_path(path, "files")?;
        }
        for path in self.files_b64.keys() {
            validate_path(path, "files_b64")?;
            if self.files.contains_key(path) {
                return Err(ApiError::invalid("files_b64", format!("`{path}` is also in files")));
            }
        }
        if self.fetch.len() > MAX_FUNCTION_FILES {
            return Err(ApiError::invalid("fetch", format!("at most {MAX_FUNCTION_FILES} paths")));
        }
        for path in &self.fetch {
            validate_path(path, "fetch")?;
        }
        validate_env(&self.env, "env")?;
        if let Some(cwd) = &self.cwd {
            if !cwd.starts_with('/') {
                return Err(ApiError::invalid("cwd", "must be an absolute path"));
            }
            validate_path(cwd, "cwd")?;
        }
        if let Some(t) = self.timeout_secs {
            if !(t.is_finite() && t > 0.0 && t <= MAX_FUNCTION_TIMEOUT_SECS) {
                return Err(ApiError::invalid(
                    "timeout_secs",
                    format!("must be > 0 and <= {MAX_FUNCTION_TIMEOUT_SECS}"),
                ));
            }
        }
        if let Some(m) = self.memory_mib {
            if !(MIN_MEMORY_MIB..=MAX_MEMORY_MIB).contains(&m) {
                return Err(ApiError::invalid(
                    "memory_mib",
                    format!("must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}"),
                ));
            }
        }
        if let Some(c) = self.cpus {
            if !(c.is_finite() && (0.01..=MAX_CPUS).contains(&c)) {
                return Err(ApiError::invalid("cpus", format!("must be between 0.01 and {MAX_CPUS}")));
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FetchStatus {
    Ok,
    /// Nothing at the path after the run.
    Missing,
    /// Larger than `MAX_FETCH_FILE_BYTES`; not returned.
    TooLarge,
    /// A directory or another non-regular file.
    NotAFile,
}

/// One path of `fetch`, read back after the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FetchedFile {
    pub status: FetchStatus,
    #[serde(default)]
    pub size_bytes: u64,
    /// The content, base64; present when `status` is `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_b64: Option<String>,
}

/// Where a call's time went, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema, Default)]
pub struct FunctionTimings {
    /// Waiting for admission while every worker of the image was busy.
    pub queue_secs: f64,
    /// Claiming (or, with none idle, making) a worker and writing the files in.
    pub setup_secs: f64,
    /// The run itself, from start to exit.
    pub run_secs: f64,
    /// Reading the fetched files back.
    pub fetch_secs: f64,
    /// From arrival to answer.
    pub total_secs: f64,
}

/// The answer of `POST /v1/functions/run`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionResult {
    /// The run's result exactly as an exec's (`?wait=true`), output included.
    pub exec: ExecResult,
    /// Each path of `fetch`, as given.
    pub files: BTreeMap<String, FetchedFile>,
    pub timings: FunctionTimings,
    /// The worker came from the warm pool (false: made for this call).
    pub warm_worker: bool,
    /// A python call served by a fork of the pool's warm interpreter
    /// instead of a one-use worker (see `docs/architecture.md`).
    #[serde(default)]
    pub forked: bool,
}

/// One warm pool of function workers, as `GET /v1/functions/pools` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionPoolInfo {
    pub image: String,
    pub memory_mib: u64,
    pub cpus: f64,
    /// Bounds of the idle workers kept; `max` is also how many calls run at once.
    pub min: u64,
    pub max: u64,
    /// Calls that may wait for a worker before `queue_full`.
    pub queue: u64,
    /// Made by `--function-pool` (else on a first call, dropped when unused).
    pub configured: bool,
    pub idle: u64,
    pub busy: u64,
    pub waiting: u64,
    /// Idle workers wanted now: recent peak demand within `min..=max`.
    pub target: u64,
    /// Idle python fork servers (made once the pool's first python call
    /// came; their number follows the python calls' demand the same way).
    #[serde(default)]
    pub idle_fork_servers: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionPoolList {
    pub pools: Vec<FunctionPoolInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(r: RunFunctionRequest) -> String {
        r.validate().unwrap_err().field.unwrap()
    }

    fn code(lang: Language, src: &str) -> RunFunctionRequest {
        RunFunctionRequest { language: Some(lang), code: Some(src.into()), ..Default::default() }
    }

    #[test]
    fn a_call_needs_exactly_one_program_form() {
        assert_eq!(field(RunFunctionRequest::default()), "code");
        assert!(code(Language::Python, "print(1)").validate().is_ok());
        let both = RunFunctionRequest { command: Some("ls".into()), ..code(Language::Sh, "ls") };
        assert_eq!(field(both), "code");
        let no_lang = RunFunctionRequest { code: Some("x".into()), ..Default::default() };
        assert_eq!(field(no_lang), "language");
        let lang_only =
            RunFunctionRequest { language: Some(Language::C), command: Some("x".into()), ..Default::default() };
        assert_eq!(field(lang_only), "language");
    }

    #[test]
    fn bad_fields_are_named() {
        let base = || code(Language::Sh, "true");
        assert_eq!(field(RunFunctionRequest { timeout_secs: Some(0.0), ..base() }), "timeout_secs");
        assert_eq!(field(RunFunctionRequest { memory_mib: Some(1), ..base() }), "memory_mib");
        assert_eq!(field(RunFunctionRequest { cwd: Some("rel".into()), ..base() }), "cwd");
        assert_eq!(field(RunFunctionRequest { fetch: vec!["../x".into()], ..base() }), "fetch");
        let files = BTreeMap::from([("a\0b".to_string(), String::new())]);
        assert_eq!(field(RunFunctionRequest { files, ..base() }), "files");
        let args = RunFunctionRequest { args: vec!["x".into()], command: Some("y".into()), ..Default::default() };
        assert_eq!(field(args), "args");
    }

    #[test]
    fn languages_serialize_as_their_names() {
        for lang in [Language::Python, Language::Bash, Language::Sh, Language::C, Language::Cpp, Language::Javascript] {
            assert_eq!(serde_json::to_value(lang).unwrap(), serde_json::json!(lang.as_str()));
        }
    }
}

//! One function call: admission, a fresh worker, files in, the run under
//! its deadline, files out, and the worker's destruction.

use std::collections::BTreeMap;
use std::io::Read as _;
use std::sync::Arc;

use base64::Engine as _;
use tokio::time::Instant;
use warren_api::{
    ApiError, FetchStatus, FetchedFile, FunctionResult, FunctionTimings, Language, RunFunctionRequest,
    DEFAULT_FUNCTION_CWD, DEFAULT_FUNCTION_TIMEOUT_SECS, MAX_FETCH_FILE_BYTES, MAX_FUNCTION_FILES_BYTES,
};
use warren_backend::files::{self, FileError};
use warren_backend::{ExecProcess, ExecSpec, FsRoot};

use super::fork::{self, ForkDemand, ForkRequest, Relayed, Zygote};
use super::{call_shape, Admission, FunctionPool, Worker};
use crate::exec::ExecEntry;
use crate::{base_env, new_id, Node, NodeError, Result};

/// Where the code of a call is written; outside the working directory so
/// that a listing of `cwd` shows the caller's own files only.
const CODE_DIR: &str = "/tmp/.warren-fn";
/// Directories searched for a language's toolchain (the exec's `PATH`).
const TOOL_DIRS: [&str; 6] = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

/// A call after decoding: what is written, run and read back.
struct Call {
    argv_for: Program,
    stdin: Option<Vec<u8>>,
    files: Vec<(String, Vec<u8>)>,
    fetch: Vec<String>,
    env: BTreeMap<String, String>,
    /// `HOME` or `TMPDIR` named by the caller (kept on the fork server).
    env_home: bool,
    env_tmpdir: bool,
    cwd: String,
    timeout: std::time::Duration,
    output_cap: u64,
}

enum Program {
    Code { language: Language, code: String, args: Vec<String> },
    Argv(Vec<String>),
}

impl Call {
    fn decode(req: RunFunctionRequest) -> Result<Call> {
        let b64 = &base64::engine::general_purpose::STANDARD;
        let stdin = match (req.stdin, req.stdin_b64) {
            (Some(s), _) => Some(s.into_bytes()),
            (None, Some(b)) => Some(
                b64.decode(b).map_err(|_| NodeError::Invalid(ApiError::invalid("stdin_b64", "not valid base64")))?,
            ),
            (None, None) => None,
        };
        let cwd = req.cwd.unwrap_or_else(|| DEFAULT_FUNCTION_CWD.to_string());
        let mut files = Vec::new();
        let mut total: u64 = 0;
        for (path, text) in req.files {
            files.push((absolute(&cwd, &path), text.into_bytes()));
        }
        for (path, data) in req.files_b64 {
            let bytes = b64.decode(data).map_err(|_| {
                NodeError::Invalid(ApiError::invalid("files_b64", format!("`{path}` is not valid base64")))
            })?;
            files.push((absolute(&cwd, &path), bytes));
        }
        for (_, bytes) in &files {
            total += bytes.len() as u64;
        }
        if total > MAX_FUNCTION_FILES_BYTES {
            return Err(NodeError::Invalid(ApiError::invalid(
                "files",
                format!("at most {MAX_FUNCTION_FILES_BYTES} bytes of files per call"),
            )));
        }
        let argv_for = match (req.code, req.language, req.command, req.argv) {
            (Some(code), Some(language), _, _) => Program::Code { language, code, args: req.args },
            (_, _, Some(cmd), _) => Program::Argv(vec!["/bin/sh".into(), "-c".into(), cmd]),
            (_, _, _, Some(argv)) => Program::Argv(argv),
            _ => return Err(NodeError::Invalid(ApiError::invalid("code", "give code, command or argv"))),
        };
        let mut env = base_env(&BTreeMap::new());
        let (env_home, env_tmpdir) = (req.env.contains_key("HOME"), req.env.contains_key("TMPDIR"));
        env.extend(req.env);
        Ok(Call {
            argv_for,
            stdin,
            files,
            fetch: req.fetch,
            env,
            env_home,
            env_tmpdir,
            cwd,
            timeout: std::time::Duration::from_secs_f64(req.timeout_secs.unwrap_or(DEFAULT_FUNCTION_TIMEOUT_SECS)),
            output_cap: req.output_cap_bytes.unwrap_or(warren_api::DEFAULT_OUTPUT_CAP_BYTES),
        })
    }
}

impl Call {
    /// The request for a fork server, when this call can use one: python
    /// code whose files all go beneath its working directory (the call
    /// directory, the only place the forked child may write).
    fn fork_request(&self) -> Option<ForkRequest> {
        let Program::Code { language: Language::Python, code, args } = &self.argv_for else { return None };
        let dir = format!("{}/", self.cwd.trim_end_matches('/'));
        if dir == "/" || !self.files.iter().all(|(path, _)| path.starts_with(&dir)) {
            return None;
        }
        let mut env = self.env.clone();
        if !self.env_home {
            env.insert("HOME".into(), self.cwd.clone());
        }
        if !self.env_tmpdir {
            env.insert("TMPDIR".into(), self.cwd.clone());
        }
        let stdin = self.stdin.clone().unwrap_or_default();
        Some(ForkRequest { code: code.clone(), args: args.clone(), env, cwd: self.cwd.clone(), stdin })
    }
}

/// What became of a call offered to a fork server.
enum Forked {
    Done(Box<Result<FunctionResult>>),
    /// No fork server could take it and nothing of it ran: a worker runs it.
    Declined(Admission),
}

fn absolute(cwd: &str, path: &str) -> String {
    match path.starts_with('/') {
        true => path.to_string(),
        false => format!("{}/{}", cwd.trim_end_matches('/'), path),
    }
}

/// A file error of the files a call sends in, named by the request field.
fn files_error(path: &str, e: FileError) -> NodeError {
    match e {
        FileError::NoSpace | FileError::Io { .. } => NodeError::File(e),
        other => NodeError::Invalid(ApiError::invalid("files", format!("cannot write `{path}`: {other}"))),
    }
}

/// The first program of `language`'s toolchain the worker's image has.
pub(super) fn find_toolchain(root: &FsRoot, language: Language) -> Option<String> {
    language.toolchain().iter().find_map(|name| {
        TOOL_DIRS.iter().map(|dir| format!("{dir}/{name}")).find(|path| files::open_read(root, path).is_ok())
    })
}

/// The argv that runs `code` (written at `src`) with `tool`.
fn code_argv(language: Language, tool: String, src: &str, args: Vec<String>) -> Vec<String> {
    let compiled = |flags: &str| {
        let bin = format!("{CODE_DIR}/main");
        let script = format!("{tool} {flags} -o {bin} {src} && exec {bin} \"$@\"");
        let mut argv = vec!["/bin/sh".to_string(), "-c".to_string(), script, "main".to_string()];
        argv.extend(args.clone());
        argv
    };
    match language {
        Language::C => compiled("-O2 -w"),
        Language::Cpp => compiled("-O2 -w"),
        _ => {
            let mut argv = vec![tool, src.to_string()];
            argv.extend(args);
            argv
        }
    }
}

fn extension(language: Language) -> &'static str {
    match language {
        Language::Python => "py",
        Language::Bash | Language::Sh => "sh",
        Language::C => "c",
        Language::Cpp => "cpp",
        Language::Javascript => "js",
    }
}

fn write_file(root: &FsRoot, path: &str, data: &[u8]) -> std::result::Result<(), FileError> {
    if let Some((parent, _)) = path.rsplit_once('/') {
        if !parent.is_empty() {
            match files::mkdir(root, parent, 0o755, true) {
                Ok(_) | Err(FileError::Conflict(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    let mut w = files::create_write(root, path, 0o644)?;
    w.append(data)?;
    w.commit()?;
    Ok(())
}

/// Prepares the worker: the working directory, the files, the code and
/// its toolchain. Returns the argv to run. Blocking.
fn prepare(root: &FsRoot, call: &Call, image: &str) -> Result<Vec<String>> {
    match files::mkdir(root, &call.cwd, 0o755, true) {
        Ok(_) | Err(FileError::Conflict(_)) => {}
        Err(e) => return Err(NodeError::Invalid(ApiError::invalid("cwd", format!("cannot make it: {e}")))),
    }
    for (path, data) in &call.files {
        write_file(root, path, data).map_err(|e| files_error(path, e))?;
    }
    match &call.argv_for {
        Program::Argv(argv) => Ok(argv.clone()),
        Program::Code { language, code, args } => {
            let tool = find_toolchain(root, *language).ok_or_else(|| {
                NodeError::Invalid(ApiError::invalid(
                    "language",
                    format!(
                        "image `{image}` has no {} toolchain (looked for {} in {})",
                        language.as_str(),
                        language.toolchain().join(" or "),
                        TOOL_DIRS.join(":")
                    ),
                ))
            })?;
            let src = format!("{CODE_DIR}/main.{}", extension(*language));
            write_file(root, &src, code.as_bytes()).map_err(|e| files_error(&src, e))?;
            Ok(code_argv(*language, tool, &src, args.clone()))
        }
    }
}

/// Whether a fork server's call directory could be made.
enum CallDir {
    Made,
    /// The call's `cwd` exists in the image (or its parent does not): a
    /// worker runs the call, as the directory cannot be the call's alone.
    Taken,
    /// The files could not be written (the error to answer).
    Failed(NodeError),
}

/// Makes the call's `cwd` - which must not exist yet - and writes its
/// files there. Blocking.
fn make_call_dir(root: &FsRoot, call: &Call) -> CallDir {
    match files::mkdir(root, &call.cwd, 0o755, false) {
        Ok(_) => {}
        Err(_) => return CallDir::Taken,
    }
    for (path, data) in &call.files {
        if let Err(e) = write_file(root, path, data) {
            return CallDir::Failed(files_error(path, e));
        }
    }
    CallDir::Made
}

/// Gives a zygote back to its pool once its call directory is gone (a
/// zygote whose directory cannot be removed is destroyed). A call that left
/// its directory empty - most do - costs one rmdir here; a tree is removed
/// off the runtime.
async fn settle(pool: Arc<FunctionPool>, zygote: Zygote, root: Arc<FsRoot>, call_dir: String) {
    let removed = match files::remove(&root, &call_dir, false) {
        Ok(()) => Ok(()),
        Err(_) => {
            let dir = call_dir.clone();
            match blocking(move || files::remove(&root, &dir, true)).await {
                Ok(removed) => removed.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    match removed {
        Ok(()) => fork::put_back(&pool, zygote),
        Err(e) => tracing::warn!(zygote = %zygote.handle.id, "cannot remove the call directory {call_dir}: {e}"),
    }
}

/// Reads the fetched files back. Blocking.
fn fetch(root: &FsRoot, cwd: &str, paths: &[String]) -> BTreeMap<String, FetchedFile> {
    let b64 = &base64::engine::general_purpose::STANDARD;
    let mut out = BTreeMap::new();
    for path in paths {
        let missing = |status| FetchedFile { status, size_bytes: 0, data_b64: None };
        let fetched = match files::open_read(root, &absolute(cwd, path)) {
            Ok(f) => {
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                if len > MAX_FETCH_FILE_BYTES {
                    FetchedFile { status: FetchStatus::TooLarge, size_bytes: len, data_b64: None }
                } else {
                    let mut data = Vec::with_capacity(len as usize);
                    // The sandbox may grow the file meanwhile: read at most the cap.
                    match f.take(MAX_FETCH_FILE_BYTES + 1).read_to_end(&mut data) {
                        Ok(n) if n as u64 > MAX_FETCH_FILE_BYTES => {
                            FetchedFile { status: FetchStatus::TooLarge, size_bytes: n as u64, data_b64: None }
                        }
                        Ok(n) => FetchedFile {
                            status: FetchStatus::Ok,
                            size_bytes: n as u64,
                            data_b64: Some(b64.encode(&data)),
                        },
                        Err(_) => missing(FetchStatus::NotAFile),
                    }
                }
            }
            Err(FileError::NotFound) | Err(FileError::NotDirectory) => missing(FetchStatus::Missing),
            Err(_) => missing(FetchStatus::NotAFile),
        };
        out.insert(path.clone(), fetched);
    }
    out
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| NodeError::Internal(format!("function task failed: {e}")))
}

impl Node {
    /// `POST /v1/functions/run`: runs one call in a fresh worker of its
    /// image's pool and destroys the worker. The call runs in its own task,
    /// so a client that goes away cannot leave a worker half made.
    pub async fn run_function(&self, req: RunFunctionRequest) -> Result<FunctionResult> {
        let node = self.clone();
        tokio::spawn(async move { node.run_function_inner(req).await })
            .await
            .map_err(|e| NodeError::Internal(format!("function call task: {e}")))?
    }

    async fn run_function_inner(&self, req: RunFunctionRequest) -> Result<FunctionResult> {
        let arrived = Instant::now();
        req.validate().map_err(NodeError::Invalid)?;
        let image = req.image.clone().unwrap_or_else(|| warren_api::DEFAULT_IMAGE.to_string());
        let (resources, network) = call_shape(self.inner.functions.specs(), &image, req.memory_mib, req.cpus);
        let call = Call::decode(req)?;
        let pool = self.function_pool(&image, resources, network).await.map_err(|e| match e {
            NodeError::ImageNotFound(name) => {
                NodeError::Invalid(ApiError::invalid("image", format!("no image named `{name}`")))
            }
            other => other,
        })?;
        let forked = call.fork_request().map(|request| (request, ForkDemand::new(&pool, &self.inner.functions)));
        let (admission, queued) = self.inner.functions.admit(&pool).await?;
        let call = Arc::new(call);
        let admission = match forked {
            Some((request, demand)) => {
                match self.run_forked(&pool, admission, demand, &call, request, arrived, queued).await {
                    Forked::Done(result) => return *result,
                    Forked::Declined(admission) => admission,
                }
            }
            None => admission,
        };
        let mut worker = self.inner.functions.take_worker(admission).await?;
        let process = match self.start_in(&worker, &call, &image).await {
            Err(NodeError::Invalid(e)) => return Err(NodeError::Invalid(e)),
            Err(e) if worker.warm => {
                tracing::warn!(worker = %worker.handle.id, "a warm function worker failed, using a fresh one: {e}");
                worker.replace().await?;
                self.start_in(&worker, &call, &image).await?
            }
            started => started?,
        };
        let (prepared, run_started) = (arrived.elapsed(), Instant::now());
        let entry = ExecEntry::new(new_id("ex"), None, call.output_cap);
        Arc::clone(&entry).drive(process, call.stdin.clone(), false, run_started + call.timeout).await;
        let run_secs = run_started.elapsed().as_secs_f64();

        let fetch_started = Instant::now();
        let files = if call.fetch.is_empty() {
            BTreeMap::new()
        } else {
            let root = self.inner.container.fs_root(&worker.handle)?;
            let (cwd, paths) = (call.cwd.clone(), call.fetch.clone());
            blocking(move || fetch(&root, &cwd, &paths)).await?
        };
        let warm_worker = worker.warm;
        drop(worker);
        Ok(FunctionResult {
            exec: entry.result(true),
            files,
            timings: timings(arrived, queued, prepared, run_secs, fetch_started),
            warm_worker,
            forked: false,
        })
    }

    /// Runs a python call on one of the pool's fork servers: a fresh call
    /// directory with the files, the request, the run under the deadline,
    /// `fetch`, and the directory's removal before the zygote serves again.
    /// The call counts in the pool's zygote demand (`demand`) and holds its
    /// admission until its zygote is back.
    #[allow(clippy::too_many_arguments)]
    async fn run_forked(
        &self,
        pool: &Arc<FunctionPool>,
        admission: Admission,
        demand: ForkDemand,
        call: &Arc<Call>,
        request: ForkRequest,
        arrived: Instant,
        queued: std::time::Duration,
    ) -> Forked {
        let functions = &self.inner.functions;
        let Some((zygote, warm)) = fork::claim(functions, pool).await else { return Forked::Declined(admission) };
        let root = match self.inner.container.fs_root(&zygote.handle) {
            Ok(root) => Arc::new(root),
            Err(e) => {
                tracing::warn!(zygote = %zygote.handle.id, "a fork server has no root: {e}");
                return Forked::Declined(admission);
            }
        };
        let made = if call.files.is_empty() {
            // One mkdir in the sandbox's upper layer (a tmpfs): cheaper
            // than the hops to a blocking thread and back.
            make_call_dir(&root, call)
        } else {
            let (dir_root, dir_call) = (Arc::clone(&root), Arc::clone(call));
            match blocking(move || make_call_dir(&dir_root, &dir_call)).await {
                Ok(made) => made,
                Err(e) => return Forked::Done(Box::new(Err(e))),
            }
        };
        match made {
            CallDir::Made => {}
            CallDir::Taken => {
                fork::put_back(pool, zygote);
                return Forked::Declined(admission);
            }
            CallDir::Failed(e) => {
                settle(Arc::clone(pool), zygote, root, call.cwd.clone()).await;
                return Forked::Done(Box::new(Err(e)));
            }
        }
        let (process, relay) = match fork::start(zygote, &request).await {
            Ok(started) => started,
            Err((zygote, why)) => {
                tracing::warn!(zygote = %zygote.handle.id, "a fork server took no call: {why}");
                return Forked::Declined(admission);
            }
        };
        let (prepared, run_started) = (arrived.elapsed(), Instant::now());
        let entry = ExecEntry::new(new_id("ex"), None, call.output_cap);
        // The relay runs in this task beside the exec's pump; it ends on the
        // exit report (or when the pump gave up on the zygote).
        let (_, relayed) =
            tokio::join!(Arc::clone(&entry).drive(process, None, false, run_started + call.timeout), relay);
        let run_secs = run_started.elapsed().as_secs_f64();
        let zygote = match relayed {
            Relayed::Exited(zygote) => Some(zygote),
            Relayed::SetupFailed(zygote, why) => {
                fork::give_up(pool, &why);
                drop(zygote);
                return Forked::Declined(admission);
            }
            Relayed::Broken(zygote, why) => {
                fork::broke(pool, zygote, &why);
                None
            }
        };
        let fetch_started = Instant::now();
        let files = if call.fetch.is_empty() {
            Ok(BTreeMap::new())
        } else {
            let (fetch_root, paths, cwd) = (Arc::clone(&root), call.fetch.clone(), call.cwd.clone());
            blocking(move || fetch(&fetch_root, &cwd, &paths)).await
        };
        // The answer does not wait for the leader's sweep; the zygote (and
        // the call's admission slot) come back once it is done and the call
        // directory is gone.
        if let Some(mut zygote) = zygote {
            let (settle_pool, cwd, functions) = (Arc::clone(pool), call.cwd.clone(), Arc::clone(functions));
            settle_pool.fork.settling_started();
            tokio::spawn(async move {
                match fork::swept(&settle_pool, &mut zygote).await {
                    Ok(()) => settle(Arc::clone(&settle_pool), zygote, root, cwd).await,
                    Err(why) => fork::broke(&settle_pool, zygote, &why),
                }
                drop((admission, demand));
                settle_pool.fork.settling_done();
                functions.destroyed.notify_waiters();
            });
        }
        let files = match files {
            Ok(files) => files,
            Err(e) => return Forked::Done(Box::new(Err(e))),
        };
        Forked::Done(Box::new(Ok(FunctionResult {
            exec: entry.result(true),
            files,
            timings: timings(arrived, queued, prepared, run_secs, fetch_started),
            warm_worker: warm,
            forked: true,
        })))
    }

    /// Writes the call's files and code into the worker (off the runtime)
    /// and starts the run.
    async fn start_in(&self, worker: &Worker, call: &Arc<Call>, image: &str) -> Result<ExecProcess> {
        let root = self.inner.container.fs_root(&worker.handle)?;
        let (prepared, image) = (Arc::clone(call), image.to_string());
        let argv = blocking(move || prepare(&root, &prepared, &image)).await??;
        let spec = ExecSpec { argv, env: call.env.clone(), cwd: call.cwd.clone(), capture_session_state: false };
        Ok(self.inner.container.exec(&worker.handle, spec).await?)
    }
}

/// A call's timings, from the moments its steps ended: `queued` and
/// `prepared` are measured from `arrived`.
fn timings(
    arrived: tokio::time::Instant,
    queued: std::time::Duration,
    prepared: std::time::Duration,
    run_secs: f64,
    fetch_started: tokio::time::Instant,
) -> FunctionTimings {
    FunctionTimings {
        queue_secs: queued.as_secs_f64(),
        setup_secs: prepared.saturating_sub(queued).as_secs_f64(),
        run_secs,
        fetch_secs: fetch_started.elapsed().as_secs_f64(),
        total_secs: arrived.elapsed().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_join_the_working_directory() {
        assert_eq!(absolute("/work", "a/b.txt"), "/work/a/b.txt");
        assert_eq!(absolute("/work/", "x"), "/work/x");
        assert_eq!(absolute("/work", "/etc/x"), "/etc/x");
    }

    #[test]
    fn compiled_languages_build_then_exec_with_their_args() {
        let argv = code_argv(Language::C, "/usr/bin/cc".into(), "/tmp/.warren-fn/main.c", vec!["7".into()]);
        assert_eq!(argv[0], "/bin/sh");
        assert!(argv[2].starts_with("/usr/bin/cc -O2 -w -o /tmp/.warren-fn/main /tmp/.warren-fn/main.c && exec"));
        assert_eq!(&argv[3..], ["main", "7"]);
        let py = code_argv(Language::Python, "/usr/bin/python3".into(), "/tmp/m.py", vec!["a".into()]);
        assert_eq!(py, ["/usr/bin/python3", "/tmp/m.py", "a"]);
    }
}

//! `process.Process`: Start/Connect stream a command's events, List,
//! SendInput, CloseStdin and SendSignal steer it. A process is a node exec;
//! E2B names it by pid, so the table here maps pids to exec ids.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Mutex;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use warren_api::{ExecFrame, ExecRequest, ExecResult, ExecStatus, StreamName, MAX_TIMEOUT_SECS};

use warren_node::trajectory::ExecAnswer;

use super::{abs_path, unary_request, unknown_method};
use crate::connect::{self, Code, ConnectError};
use crate::E2b;

/// Keepalive interval when the client does not ask for one (envd's).
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);
/// The first pid handed out; below it a pid looks like a system process.
const FIRST_PID: u32 = 1000;
/// A sandbox's ended processes are dropped from the table when it holds
/// this many (and on every `List`).
const PRUNE_AT: usize = 256;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct StartRequest {
    #[serde(default)]
    process: Option<ProcessConfig>,
    #[serde(default)]
    pty: Option<serde_json::Value>,
    #[serde(default)]
    tag: Option<String>,
    #[serde(default)]
    stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct ProcessSelector {
    #[serde(default)]
    pid: Option<u32>,
    #[serde(default)]
    tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Selected {
    #[serde(default)]
    process: Option<ProcessSelector>,
}

#[derive(Debug, Default, Deserialize)]
struct ProcessInput {
    #[serde(default)]
    stdin: Option<String>,
    #[serde(default)]
    pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct SendInputRequest {
    #[serde(default)]
    process: Option<ProcessSelector>,
    #[serde(default)]
    input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
struct SendSignalRequest {
    #[serde(default)]
    process: Option<ProcessSelector>,
    #[serde(default)]
    signal: Option<serde_json::Value>,
}

#[derive(Debug, Clone)]
struct Proc {
    exec_id: String,
    config: ProcessConfig,
    tag: Option<String>,
}

/// The pids of the processes started through envd, per sandbox.
#[derive(Default)]
pub struct Table {
    inner: Mutex<TableInner>,
}

#[derive(Default)]
struct TableInner {
    next_pid: u32,
    procs: HashMap<String, BTreeMap<u32, Proc>>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, TableInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, sandbox: &str, proc: Proc) -> u32 {
        let mut t = self.lock();
        t.next_pid = t.next_pid.max(FIRST_PID) + 1;
        let pid = t.next_pid;
        t.procs.entry(sandbox.to_string()).or_default().insert(pid, proc);
        pid
    }

    fn find(&self, sandbox: &str, sel: &ProcessSelector) -> Result<(u32, Proc), ConnectError> {
        let t = self.lock();
        let procs = t.procs.get(sandbox);
        let found = match (sel.pid, &sel.tag) {
            (Some(pid), _) => procs.and_then(|p| p.get(&pid)).map(|p| (pid, p.clone())),
            (None, Some(tag)) => procs
                .and_then(|p| p.iter().find(|(_, p)| p.tag.as_deref() == Some(tag.as_str())))
                .map(|(pid, p)| (*pid, p.clone())),
            (None, None) => return Err(ConnectError::new(Code::InvalidArgument, "select a process by pid or tag")),
        };
        found.ok_or_else(|| match (sel.pid, &sel.tag) {
            (Some(pid), _) => ConnectError::new(Code::NotFound, format!("process with pid {pid} not found")),
            (_, tag) => ConnectError::new(Code::NotFound, format!("process with tag {tag:?} not found")),
        })
    }

    fn remove(&self, sandbox: &str, pid: u32) {
        if let Some(p) = self.lock().procs.get_mut(sandbox) {
            p.remove(&pid);
        }
    }

    fn of(&self, sandbox: &str) -> Vec<(u32, Proc)> {
        self.lock().procs.get(sandbox).map(|p| p.iter().map(|(k, v)| (*k, v.clone())).collect()).unwrap_or_default()
    }

    /// Drops every process of a sandbox (it was killed).
    pub fn forget_sandbox(&self, sandbox: &str) {
        self.lock().procs.remove(sandbox);
    }

    /// Drops the processes of sandboxes that are no longer live (ended by
    /// their timeout, or forgotten), so the table does not grow with every
    /// sandbox a long-running server has seen.
    pub fn forget_gone(&self, node: &warren_node::Node) {
        let sandboxes: Vec<String> = self.lock().procs.keys().cloned().collect();
        for id in sandboxes {
            let live = node.get(&id).is_ok_and(|i| i.state != warren_api::SandboxState::Ended);
            if !live {
                self.forget_sandbox(&id);
            }
        }
    }

    fn len_of(&self, sandbox: &str) -> usize {
        self.lock().procs.get(sandbox).map_or(0, BTreeMap::len)
    }
}

/// `POST /process.Process/{method}`.
pub async fn call(State(state): State<E2b>, Path(method): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(sandbox) = crate::sandbox_id(&headers) else {
        return ConnectError::new(Code::InvalidArgument, "no E2b-Sandbox-Id").into_response();
    };
    let unary = |r: Result<serde_json::Value, ConnectError>| match r {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => e.into_response(),
    };
    match method.as_str() {
        "Start" => start(&state, &sandbox, &headers, &body).await.unwrap_or_else(stream_error),
        "Connect" => reconnect(&state, &sandbox, &headers, &body).await.unwrap_or_else(stream_error),
        "List" => unary(list(&state, &sandbox, &headers, &body).await),
        "SendInput" => unary(send_input(&state, &sandbox, &headers, &body).await),
        "CloseStdin" => unary(close_stdin(&state, &sandbox, &headers, &body).await),
        "SendSignal" => unary(send_signal(&state, &sandbox, &headers, &body).await),
        other => unknown_method("process.Process", other).into_response(),
    }
}

/// A streaming call that failed before it started: Connect sends the error
/// in an end-of-stream envelope of a 200 answer.
fn stream_error(e: ConnectError) -> Response {
    stream_response(Body::from(connect::end_envelope(Some(&e))))
}

fn stream_response(body: Body) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/connect+json")], body).into_response()
}

/// Maps a Start request onto an exec request (argv, env, cwd, deadline).
fn exec_request(config: ProcessConfig, timeout_ms: Option<u64>) -> Result<ExecRequest, ConnectError> {
    if config.cmd.is_empty() {
        return Err(ConnectError::new(Code::InvalidArgument, "process.cmd is required"));
    }
    let mut argv = vec![config.cmd];
    argv.extend(config.args);
    // The client's deadline bounds the command (0 or none: Warren's maximum).
    let timeout_secs = match timeout_ms {
        Some(ms) if ms > 0 => (ms as f64 / 1000.0).min(MAX_TIMEOUT_SECS as f64),
        _ => MAX_TIMEOUT_SECS as f64,
    };
    Ok(ExecRequest {
        argv: Some(argv),
        env: config.envs,
        cwd: Some(config.cwd.as_deref().map(abs_path).unwrap_or_else(|| crate::HOME.to_string())),
        timeout_secs: Some(timeout_secs),
        ..ExecRequest::default()
    })
}

async fn start(state: &E2b, sandbox: &str, headers: &HeaderMap, body: &Bytes) -> Result<Response, ConnectError> {
    connect::check_content_type(headers, true)?;
    let req: StartRequest = connect::decode_enveloped(body)?;
    if req.pty.is_some() {
        return Err(ConnectError::new(Code::Unimplemented, "PTY processes are not supported by Warren"));
    }
    let config = req.process.unwrap_or_default();
    let exec = exec_request(config.clone(), connect::timeout_ms(headers))?;
    // envd keeps stdin open unless the client says otherwise. Such a
    // process is not a trajectory step: its input is not logged, so a
    // replay could not run it again; every other one is.
    let entry = match req.stdin.unwrap_or(true) {
        true => state.node.exec_with(sandbox, exec, None, true).await?,
        false => match state.node.exec_stepped(sandbox, exec, None, None).await?.value {
            ExecAnswer::Live(entry) => entry,
            // Only a call naming a logged step is answered from the log.
            ExecAnswer::Logged(_) => {
                return Err(ConnectError::new(Code::Internal, "a new step was answered from the log"))
            }
        },
    };
    if state.procs.len_of(sandbox) >= PRUNE_AT {
        forget_ended(state, sandbox);
    }
    let pid = state.procs.insert(sandbox, Proc { exec_id: entry.id.clone(), config, tag: req.tag });
    Ok(events(state, sandbox, pid, &entry.id, headers))
}

async fn reconnect(state: &E2b, sandbox: &str, headers: &HeaderMap, body: &Bytes) -> Result<Response, ConnectError> {
    connect::check_content_type(headers, true)?;
    let req: Selected = connect::decode_enveloped(body)?;
    let (pid, proc) = state.procs.find(sandbox, &req.process.unwrap_or_default())?;
    state.node.exec_result(sandbox, &proc.exec_id)?;
    Ok(events(state, sandbox, pid, &proc.exec_id, headers))
}

/// `{"event": {...}}`, the body of `StartResponse` and `ConnectResponse`.
fn event(inner: serde_json::Value) -> Bytes {
    connect::message_envelope(&serde_json::json!({ "event": inner }))
}

/// The end event of a finished exec, as Go's `os.ProcessState` reads.
pub fn end_event(result: &ExecResult) -> serde_json::Value {
    let (exit_code, exited, status) = match (result.status, result.exit_code, result.signal) {
        (_, Some(code), _) => (code, true, format!("exit status {code}")),
        (_, None, Some(sig)) => (-1, false, format!("signal: {}", signal_name(sig))),
        (ExecStatus::TimedOut | ExecStatus::Killed | ExecStatus::Oom, None, None) => {
            (-1, false, "signal: killed".to_string())
        }
        (_, None, None) => (-1, false, "unknown".to_string()),
    };
    let mut end = serde_json::json!({ "exitCode": exit_code, "exited": exited, "status": status });
    let error = match result.status {
        ExecStatus::TimedOut => Some("the command ran past its timeout and was killed"),
        ExecStatus::Oom => Some("the command was killed by the out-of-memory killer"),
        _ => None,
    };
    if let Some(e) = error {
        end["error"] = e.into();
    }
    serde_json::json!({ "end": end })
}

fn signal_name(sig: i32) -> String {
    match sig {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        1 => "hangup".into(),
        6 => "aborted".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        n => format!("signal {n}"),
    }
}

/// One exec frame as an envd event, or nothing (gaps have no E2B spelling).
pub fn frame_event(frame: &ExecFrame) -> Option<serde_json::Value> {
    match frame {
        // Both are base64: the node's capture encoding is proto3 JSON's `bytes`.
        ExecFrame::Output { stream: StreamName::Stdout, data_b64, .. } => {
            Some(serde_json::json!({ "data": { "stdout": data_b64 } }))
        }
        ExecFrame::Output { stream: StreamName::Stderr, data_b64, .. } => {
            Some(serde_json::json!({ "data": { "stderr": data_b64 } }))
        }
        ExecFrame::End { result } => Some(end_event(result)),
        _ => None,
    }
}

/// The event stream of a process: `start`, its output, `end`, keepalives
/// while it is quiet, and the end-of-stream envelope.
fn events(state: &E2b, sandbox: &str, pid: u32, exec_id: &str, headers: &HeaderMap) -> Response {
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .map(Duration::from_secs)
        .unwrap_or(DEFAULT_KEEPALIVE);
    let frames = state.node.exec_stream(sandbox, exec_id, 0, 0);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(32);
    tokio::spawn(async move {
        if tx.send(event(serde_json::json!({ "start": { "pid": pid } }))).await.is_err() {
            return;
        }
        let mut frames = match frames {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.send(connect::end_envelope(Some(&ConnectError::from(e)))).await;
                return;
            }
        };
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + keepalive, keepalive);
        loop {
            let msg = tokio::select! {
                frame = frames.next() => match frame {
                    Some(f) => match frame_event(&f) {
                        Some(ev) => event(ev),
                        None => continue,
                    },
                    None => break,
                },
                _ = ticks.tick() => event(serde_json::json!({ "keepalive": {} })),
            };
            if tx.send(msg).await.is_err() {
                // The client went away; the process carries on (envd's too).
                return;
            }
        }
        let _ = tx.send(connect::end_envelope(None)).await;
    });
    let body =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx)) });
    stream_response(Body::from_stream(body))
}

async fn list(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let _: serde_json::Value = unary_request(headers, body)?;
    // Also tells a gone sandbox apart from one without processes.
    let info = state.node.get(sandbox)?;
    if info.state == warren_api::SandboxState::Ended {
        return Err(crate::error::sandbox_gone(sandbox));
    }
    let out: Vec<serde_json::Value> = forget_ended(state, sandbox)
        .into_iter()
        .map(|(pid, proc)| {
            let mut p = serde_json::json!({ "config": proc.config, "pid": pid });
            if let Some(tag) = &proc.tag {
                p["tag"] = tag.clone().into();
            }
            p
        })
        .collect();
    Ok(serde_json::json!({ "processes": out }))
}

/// Drops a sandbox's ended processes from the table; returns the running ones.
fn forget_ended(state: &E2b, sandbox: &str) -> Vec<(u32, Proc)> {
    let mut running = Vec::new();
    for (pid, proc) in state.procs.of(sandbox) {
        match state.node.exec_status(sandbox, &proc.exec_id).ok() {
            Some(ExecStatus::Running) => running.push((pid, proc)),
            // Ended (or forgotten): its pid is free for good.
            _ => state.procs.remove(sandbox, pid),
        }
    }
    running
}

async fn send_input(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: SendInputRequest = unary_request(headers, body)?;
    let (_, proc) = state.procs.find(sandbox, &req.process.unwrap_or_default())?;
    let input = req.input.unwrap_or_default();
    if input.pty.is_some() {
        return Err(ConnectError::new(Code::Unimplemented, "PTY input is not supported by Warren"));
    }
    let data = base64::engine::general_purpose::STANDARD
        .decode(input.stdin.unwrap_or_default())
        .map_err(|_| ConnectError::new(Code::InvalidArgument, "input.stdin is not base64"))?;
    state.node.send_stdin(sandbox, &proc.exec_id, data.into()).await.map_err(stdin_error)?;
    Ok(serde_json::json!({}))
}

async fn close_stdin(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: Selected = unary_request(headers, body)?;
    let (_, proc) = state.procs.find(sandbox, &req.process.unwrap_or_default())?;
    state.node.close_stdin(sandbox, &proc.exec_id).await.map_err(stdin_error)?;
    Ok(serde_json::json!({}))
}

fn stdin_error(e: warren_node::NodeError) -> ConnectError {
    match e {
        warren_node::NodeError::Invalid(api) => ConnectError::new(Code::FailedPrecondition, api.message),
        other => other.into(),
    }
}

/// SIGKILL and SIGTERM (the two signals envd's API names), by enum name or number.
fn parse_signal(v: Option<&serde_json::Value>) -> Result<i32, ConnectError> {
    let sig = match v {
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => 9,
            "SIGNAL_SIGTERM" => 15,
            _ => 0,
        },
        Some(serde_json::Value::Number(n)) => n.as_i64().unwrap_or(0) as i32,
        _ => 0,
    };
    match sig {
        9 | 15 => Ok(sig),
        _ => Err(ConnectError::new(Code::InvalidArgument, "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")),
    }
}

async fn send_signal(
    state: &E2b,
    sandbox: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<serde_json::Value, ConnectError> {
    let req: SendSignalRequest = unary_request(headers, body)?;
    parse_signal(req.signal.as_ref())?;
    let (_, proc) = state.procs.find(sandbox, &req.process.unwrap_or_default())?;
    // Both end the whole process tree: Warren's kill is the tree kill the
    // node enforces deadlines with (SIGTERM gets no grace period).
    let result = state.node.kill_exec(sandbox, &proc.exec_id)?;
    if result.status != ExecStatus::Running {
        return Err(ConnectError::new(Code::NotFound, "the process has already ended"));
    }
    Ok(serde_json::json!({}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(status: ExecStatus, exit_code: Option<i32>, signal: Option<i32>) -> ExecResult {
        let mut r: ExecResult = serde_json::from_value(serde_json::json!({
            "exec_id": "ex-1", "status": "ok", "wall_time_secs": 0.0, "cpu_time_secs": 0.0,
            "peak_memory_bytes": 0, "started_at_ms": 0
        }))
        .unwrap();
        (r.status, r.exit_code, r.signal) = (status, exit_code, signal);
        r
    }

    #[test]
    fn start_maps_cmd_args_env_cwd_and_deadline() {
        let cfg = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo hi".into()],
            envs: [("A".to_string(), "1".to_string())].into(),
            cwd: Some("work".into()),
        };
        let req = exec_request(cfg, Some(60_000)).unwrap();
        assert_eq!(req.argv.unwrap(), ["/bin/bash", "-l", "-c", "echo hi"]);
        assert_eq!(req.cwd.as_deref(), Some("/home/user/work"));
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.timeout_secs, Some(60.0));
        let unbounded = exec_request(ProcessConfig { cmd: "ls".into(), ..Default::default() }, Some(0)).unwrap();
        assert_eq!(unbounded.timeout_secs, Some(MAX_TIMEOUT_SECS as f64));
        assert_eq!(unbounded.cwd.as_deref(), Some("/home/user"));
        assert_eq!(exec_request(ProcessConfig::default(), None).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn end_events_read_like_go_process_state() {
        let ok = end_event(&result(ExecStatus::Ok, Some(3), None));
        assert_eq!(ok, serde_json::json!({"end": {"exitCode": 3, "exited": true, "status": "exit status 3"}}));
        let killed = end_event(&result(ExecStatus::Killed, None, Some(9)));
        assert_eq!(killed["end"]["exitCode"], -1);
        assert_eq!(killed["end"]["exited"], false);
        assert_eq!(killed["end"]["status"], "signal: killed");
        let timed_out = end_event(&result(ExecStatus::TimedOut, None, None));
        assert!(timed_out["end"]["error"].as_str().unwrap().contains("timeout"));
    }

    #[test]
    fn output_frames_become_data_events_and_gaps_vanish() {
        let out = ExecFrame::Output { stream: StreamName::Stderr, offset: 0, data_b64: "aGk=".into() };
        assert_eq!(frame_event(&out), Some(serde_json::json!({"data": {"stderr": "aGk="}})));
        let gap = ExecFrame::Gap { stream: StreamName::Stdout, offset: 0, dropped_bytes: 5 };
        assert_eq!(frame_event(&gap), None);
    }

    #[test]
    fn signals_by_name_or_number() {
        assert_eq!(parse_signal(Some(&"SIGNAL_SIGKILL".into())).unwrap(), 9);
        assert_eq!(parse_signal(Some(&serde_json::json!(15))).unwrap(), 15);
        assert!(parse_signal(Some(&"SIGNAL_UNSPECIFIED".into())).is_err());
        assert!(parse_signal(None).is_err());
    }

    #[test]
    fn the_table_finds_by_pid_and_tag_and_forgets() {
        let t = Table::default();
        let proc = |tag: Option<&str>| Proc {
            exec_id: "ex".into(),
            config: ProcessConfig::default(),
            tag: tag.map(Into::into),
        };
        let a = t.insert("sb", proc(None));
        let b = t.insert("sb", proc(Some("web")));
        assert!(b > a && a > FIRST_PID);
        assert_eq!(t.find("sb", &ProcessSelector { pid: Some(a), tag: None }).unwrap().0, a);
        assert_eq!(t.find("sb", &ProcessSelector { pid: None, tag: Some("web".into()) }).unwrap().0, b);
        assert_eq!(t.find("other", &ProcessSelector { pid: Some(a), tag: None }).unwrap_err().code, Code::NotFound);
        t.forget_sandbox("sb");
        assert!(t.of("sb").is_empty());
    }
}

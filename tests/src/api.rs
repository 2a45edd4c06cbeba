//! Typed helpers over the HTTP API, as a user of the API would call it.
//! Helpers named after an operation assert it succeeded; `try_*` helpers
//! hand back the status and body for tests that expect a rejection.

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::time::{sleep, timeout, Instant};
use warren_api::{
    ApiError, ErrorCode, ExecFrame, ExecRequest, ExecResult, ExecStatus, FileStat, SandboxInfo, SandboxList,
    SandboxState, SessionInfo, StreamName,
};

use crate::server::{TestServer, IMAGE, SERVER_WAIT};

/// Bound on one whole HTTP exchange, body included.
pub const CALL_WAIT: Duration = Duration::from_secs(180);

/// Sends a request; a transport error or a server that does not answer
/// within [`CALL_WAIT`] fails the test.
pub async fn send(rb: RequestBuilder) -> Response {
    match timeout(CALL_WAIT, rb.send()).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => panic!("HTTP request failed: {e:?}"),
        Err(_) => panic!("the server did not answer within {CALL_WAIT:?}"),
    }
}

/// Status and JSON body (`Value::Null` for an empty body, a string for non-JSON).
pub async fn json_response(resp: Response) -> (StatusCode, Value) {
    let status = resp.status();
    let bytes = timeout(CALL_WAIT, resp.bytes()).await.expect("body within bound").expect("read the body");
    let value = match bytes.is_empty() {
        true => Value::Null,
        false => {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
        }
    };
    (status, value)
}

fn parse<T: DeserializeOwned>(what: &str, value: Value) -> T {
    serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("{what}: cannot parse {value}: {e}"))
}

/// Why an answer is not the expected error (`None` when it is): its status,
/// `code` and, when given, `field`.
pub fn api_error_mismatch(status: StatusCode, body: &Value, want: ErrorCode, field: Option<&str>) -> Option<String> {
    let err: ApiError = match serde_json::from_value(body.clone()) {
        Ok(e) => e,
        Err(e) => return Some(format!("expected an ApiError body, got {status} {body}: {e}")),
    };
    if err.code != want || status.as_u16() != want.http_status() {
        return Some(format!("expected {} {want:?}, got {status} {body}", want.http_status()));
    }
    match field {
        Some(f) if err.field.as_deref() != Some(f) => Some(format!("expected field `{f}`, got {body}")),
        _ => None,
    }
}

/// Asserts an error answer: its status, `code` and (when given) `field`.
pub fn assert_api_error(status: StatusCode, body: &Value, want: ErrorCode, field: Option<&str>) {
    if let Some(why) = api_error_mismatch(status, body, want, field) {
        panic!("{why}");
    }
}

/// A create request for a small busybox sandbox, with `extra` fields merged over it.
pub fn small(extra: Value) -> Value {
    let mut req = json!({"image": IMAGE, "cpus": 1.0, "memory_mib": 128, "disk_mib": 64, "pids": 256});
    if let (Some(base), Value::Object(extra)) = (req.as_object_mut(), extra) {
        base.extend(extra);
    }
    req
}

/// Captured stdout of a `?wait=true` result.
pub fn stdout(r: &ExecResult) -> &str {
    &r.output.as_ref().expect("the result carries output").stdout.text
}

pub fn stderr(r: &ExecResult) -> &str {
    &r.output.as_ref().expect("the result carries output").stderr.text
}

pub fn b64(data: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(data).expect("valid base64")
}

/// Bytes of `stream` in the `output` frames, in order.
pub fn frame_bytes(frames: &[ExecFrame], stream: StreamName) -> Vec<u8> {
    let mut out = Vec::new();
    for f in frames {
        if let ExecFrame::Output { stream: s, data_b64, .. } = f {
            if *s == stream {
                out.extend(b64(data_b64));
            }
        }
    }
    out
}

/// The result in the final `end` frame.
pub fn end_result(frames: &[ExecFrame]) -> &ExecResult {
    match frames.last() {
        Some(ExecFrame::End { result }) => result,
        other => panic!("the stream did not end with an `end` frame: last was {other:?}"),
    }
}

/// An open NDJSON exec stream, read frame by frame.
pub struct FrameReader {
    resp: Response,
    buf: Vec<u8>,
    done: bool,
}

impl FrameReader {
    /// The next frame; `None` once the server closed the stream.
    pub async fn next(&mut self) -> Option<ExecFrame> {
        loop {
            if let Some(nl) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=nl).collect();
                let frame = serde_json::from_slice(&line)
                    .unwrap_or_else(|e| panic!("bad frame {:?}: {e}", String::from_utf8_lossy(&line)));
                return Some(frame);
            }
            if self.done {
                assert!(self.buf.is_empty(), "stream ended mid-line: {:?}", String::from_utf8_lossy(&self.buf));
                return None;
            }
            match timeout(CALL_WAIT, self.resp.chunk()).await {
                Ok(Ok(Some(chunk))) => self.buf.extend_from_slice(&chunk),
                Ok(Ok(None)) => self.done = true,
                Ok(Err(e)) => panic!("reading the exec stream: {e}"),
                Err(_) => panic!("no frame within {CALL_WAIT:?}"),
            }
        }
    }

    /// Reads every remaining frame.
    pub async fn collect(mut self) -> Vec<ExecFrame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next().await {
            frames.push(f);
        }
        frames
    }

    /// Reads until the `started` frame and returns the exec id.
    pub async fn exec_id(&mut self) -> String {
        match self.next().await {
            Some(ExecFrame::Started { exec_id }) => exec_id,
            other => panic!("the first frame must be `started`, got {other:?}"),
        }
    }
}

impl TestServer {
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        self.http.request(method, format!("{}{path}", self.url))
    }

    /// Sends `method path` (with a JSON `body`) and hangs up at once,
    /// without reading the answer: the server drops the call wherever it
    /// has got to.
    pub async fn abandon(&self, method: Method, path: &str, body: Option<&Value>) {
        use tokio::io::AsyncWriteExt;
        let addr = self.url.trim_start_matches("http://").trim_end_matches('/').to_string();
        let body = body.map(Value::to_string).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut conn = tokio::net::TcpStream::connect(&addr).await.expect("connect to the server");
        conn.write_all(request.as_bytes()).await.expect("send the request");
        drop(conn);
    }

    /// One scrape of `GET /metrics`, in the Prometheus text format.
    pub async fn scrape(&self) -> crate::prometheus::Scrape {
        let answer = self.http.get(format!("{}/metrics", self.url)).send().await.expect("GET /metrics");
        assert_eq!(answer.status(), StatusCode::OK);
        let content_type = answer.headers()[reqwest::header::CONTENT_TYPE].to_str().unwrap_or_default().to_string();
        assert!(content_type.starts_with("text/plain; version=0.0.4"), "content type {content_type}");
        crate::prometheus::parse(&answer.text().await.expect("the metrics text"))
    }

    /// `warren_abandoned_calls_total{call}`: calls whose caller went away
    /// before they finished.
    pub async fn abandoned_calls(&self, call: &str) -> f64 {
        self.scrape().await.must(&format!("warren_abandoned_calls_total{{call=\"{call}\"}}"))
    }

    // ---- sandboxes ---------------------------------------------------------

    pub async fn try_create(&self, body: &Value) -> (StatusCode, Value) {
        self.call(Method::POST, "/v1/sandboxes", Some(body)).await
    }

    /// Creates a sandbox and asserts 201 and `running`.
    pub async fn create(&self, body: Value) -> SandboxInfo {
        let (status, value) = self.try_create(&body).await;
        assert_eq!(status, StatusCode::CREATED, "create {body}: {value}");
        let info: SandboxInfo = parse("create", value);
        assert_eq!(info.state, SandboxState::Running, "a new sandbox runs");
        info
    }

    /// A small busybox sandbox with default settings.
    pub async fn create_small(&self) -> SandboxInfo {
        self.create(small(json!({}))).await
    }

    pub async fn try_get(&self, id: &str) -> (StatusCode, Value) {
        self.call(Method::GET, &format!("/v1/sandboxes/{id}"), None).await
    }

    pub async fn get(&self, id: &str) -> SandboxInfo {
        let (status, value) = self.try_get(id).await;
        assert_eq!(status, StatusCode::OK, "get {id}: {value}");
        parse("get", value)
    }

    /// The sandbox once it has ended, or as it is after `within`.
    pub async fn poll_ended(&self, id: &str, within: Duration) -> SandboxInfo {
        let deadline = Instant::now() + within;
        loop {
            let info = self.get(id).await;
            if info.state == SandboxState::Ended || Instant::now() >= deadline {
                return info;
            }
            sleep(Duration::from_millis(20)).await;
        }
    }

    /// `GET /v1/sandboxes`, optionally `?label=k=v`.
    pub async fn list(&self, label: Option<&str>) -> Vec<SandboxInfo> {
        let mut rb = self.request(Method::GET, "/v1/sandboxes");
        if let Some(l) = label {
            rb = rb.query(&[("label", l)]);
        }
        let (status, value) = json_response(send(rb).await).await;
        assert_eq!(status, StatusCode::OK, "list: {value}");
        parse::<SandboxList>("list", value).sandboxes
    }

    pub async fn delete(&self, id: &str) -> SandboxInfo {
        let (status, value) = self.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
        assert_eq!(status, StatusCode::OK, "delete {id}: {value}");
        parse("delete", value)
    }

    /// Polls `GET` (which does not count as activity) until the sandbox has
    /// ended, at most `within`.
    pub async fn wait_ended(&self, id: &str, within: Duration) -> SandboxInfo {
        let info = self.poll_ended(id, within).await;
        assert_eq!(info.state, SandboxState::Ended, "sandbox {id} still {:?} after {within:?}", info.state);
        info
    }

    // ---- exec ----------------------------------------------------------------

    pub async fn try_exec_wait(&self, id: &str, body: &Value) -> (StatusCode, Value) {
        self.call(Method::POST, &format!("/v1/sandboxes/{id}/exec?wait=true"), Some(body)).await
    }

    /// Runs an exec to its end and returns the result with its output.
    pub async fn exec_wait(&self, id: &str, req: &ExecRequest) -> ExecResult {
        let body = serde_json::to_value(req).expect("serialize the exec request");
        let (status, value) = self.try_exec_wait(id, &body).await;
        assert_eq!(status, StatusCode::OK, "exec {body}: {value}");
        let result: ExecResult = parse("exec", value);
        assert_ne!(result.status, ExecStatus::Running, "a waited exec has ended");
        result
    }

    /// Runs a shell command to its end.
    pub async fn sh(&self, id: &str, command: &str) -> ExecResult {
        self.exec_wait(id, &ExecRequest::shell(command)).await
    }

    /// Runs a shell command and asserts it exited 0; returns its stdout.
    pub async fn sh_ok(&self, id: &str, command: &str) -> String {
        let r = self.sh(id, command).await;
        assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(0)), "`{command}`: {r:?}");
        stdout(&r).to_string()
    }

    /// Starts a streaming exec.
    pub async fn exec_open(&self, id: &str, req: &ExecRequest) -> FrameReader {
        let resp = send(self.request(Method::POST, &format!("/v1/sandboxes/{id}/exec")).json(req)).await;
        assert_eq!(resp.status(), StatusCode::OK, "streaming exec {req:?}");
        FrameReader { resp, buf: Vec::new(), done: false }
    }

    /// A streaming exec read to its end.
    pub async fn exec_stream(&self, id: &str, req: &ExecRequest) -> Vec<ExecFrame> {
        self.exec_open(id, req).await.collect().await
    }

    /// `GET .../exec/{eid}/stream` from the given offsets, read to its end.
    pub async fn resume(&self, id: &str, exec_id: &str, stdout_offset: u64, stderr_offset: u64) -> Vec<ExecFrame> {
        let path = format!(
            "/v1/sandboxes/{id}/exec/{exec_id}/stream?stdout_offset={stdout_offset}&stderr_offset={stderr_offset}"
        );
        let resp = send(self.request(Method::GET, &path)).await;
        assert_eq!(resp.status(), StatusCode::OK, "resume {exec_id}");
        FrameReader { resp, buf: Vec::new(), done: false }.collect().await
    }

    pub async fn get_exec(&self, id: &str, exec_id: &str) -> ExecResult {
        let (status, value) = self.call(Method::GET, &format!("/v1/sandboxes/{id}/exec/{exec_id}"), None).await;
        assert_eq!(status, StatusCode::OK, "get exec {exec_id}: {value}");
        parse("get exec", value)
    }

    /// Polls `GET .../exec/{eid}` until the exec is no longer running.
    pub async fn wait_exec(&self, id: &str, exec_id: &str, within: Duration) -> ExecResult {
        let deadline = Instant::now() + within;
        loop {
            let r = self.get_exec(id, exec_id).await;
            if r.status != ExecStatus::Running {
                return r;
            }
            assert!(Instant::now() < deadline, "exec {exec_id} still running after {within:?}");
            sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn kill_exec(&self, id: &str, exec_id: &str) -> (StatusCode, Value) {
        self.call(Method::POST, &format!("/v1/sandboxes/{id}/exec/{exec_id}/kill"), None).await
    }

    // ---- sessions --------------------------------------------------------------

    pub async fn create_session(&self, id: &str, body: Value) -> SessionInfo {
        let (status, value) = self.call(Method::POST, &format!("/v1/sandboxes/{id}/sessions"), Some(&body)).await;
        assert_eq!(status, StatusCode::CREATED, "create session: {value}");
        parse("create session", value)
    }

    pub async fn list_sessions(&self, id: &str) -> Vec<SessionInfo> {
        let (status, value) = self.call(Method::GET, &format!("/v1/sandboxes/{id}/sessions"), None).await;
        assert_eq!(status, StatusCode::OK, "list sessions: {value}");
        parse::<warren_api::SessionList>("list sessions", value).sessions
    }

    pub async fn try_session_exec(&self, id: &str, sid: &str, command: &str) -> (StatusCode, Value) {
        let body = json!({"command": command});
        self.call(Method::POST, &format!("/v1/sandboxes/{id}/sessions/{sid}/exec?wait=true"), Some(&body)).await
    }

    pub async fn session_exec(&self, id: &str, sid: &str, command: &str) -> ExecResult {
        let (status, value) = self.try_session_exec(id, sid, command).await;
        assert_eq!(status, StatusCode::OK, "session exec `{command}`: {value}");
        parse("session exec", value)
    }

    pub async fn delete_session(&self, id: &str, sid: &str) -> (StatusCode, Value) {
        self.call(Method::DELETE, &format!("/v1/sandboxes/{id}/sessions/{sid}"), None).await
    }

    // ---- files -------------------------------------------------------------------

    pub async fn put_file(
        &self,
        id: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
        mode: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut query = vec![("path", path)];
        if let Some(m) = mode {
            query.push(("mode", m));
        }
        let rb = self.request(Method::PUT, &format!("/v1/sandboxes/{id}/files")).query(&query).body(body);
        json_response(send(rb).await).await
    }

    /// Uploads and asserts success.
    pub async fn put_file_ok(&self, id: &str, path: &str, body: impl Into<reqwest::Body>) -> FileStat {
        let (status, value) = self.put_file(id, path, body, None).await;
        assert_eq!(status, StatusCode::OK, "upload {path}: {value}");
        parse("upload", value)
    }

    /// Status and body of a download; an error body stays as bytes.
    pub async fn get_file(&self, id: &str, path: &str) -> (StatusCode, Bytes) {
        let rb = self.request(Method::GET, &format!("/v1/sandboxes/{id}/files")).query(&[("path", path)]);
        let resp = send(rb).await;
        let status = resp.status();
        (status, timeout(CALL_WAIT, resp.bytes()).await.expect("body within bound").expect("read the body"))
    }

    pub async fn stat(&self, id: &str, path: &str) -> (StatusCode, Value) {
        let rb = self.request(Method::GET, &format!("/v1/sandboxes/{id}/files/stat")).query(&[("path", path)]);
        json_response(send(rb).await).await
    }

    pub async fn list_dir(&self, id: &str, path: &str) -> (StatusCode, Value) {
        let rb = self.request(Method::GET, &format!("/v1/sandboxes/{id}/files/list")).query(&[("path", path)]);
        json_response(send(rb).await).await
    }

    pub async fn mkdir(&self, id: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, &format!("/v1/sandboxes/{id}/files/mkdir"), Some(&body)).await
    }

    pub async fn remove_file(&self, id: &str, path: &str, recursive: bool) -> (StatusCode, Value) {
        let recursive = if recursive { "true" } else { "false" };
        let rb = self
            .request(Method::DELETE, &format!("/v1/sandboxes/{id}/files"))
            .query(&[("path", path), ("recursive", recursive)]);
        json_response(send(rb).await).await
    }

    /// Idle members of the warm pools of image `busybox`, from `GET /metrics`.
    pub async fn pool_idle(&self) -> f64 {
        let answer = self.http.get(format!("{}/metrics", self.url)).send().await.expect("GET /metrics");
        let text = answer.text().await.expect("the metrics text");
        crate::prometheus::parse(&text).get(r#"warren_pool_idle_sandboxes{image="busybox"}"#)
    }

    /// Waits (bounded by a count, not a clock: a booted VM under TCG takes
    /// what it takes) until the pools of image `busybox` hold `n` idle
    /// members.
    pub async fn wait_pool_idle(&self, n: usize) {
        for _ in 0..1200 {
            if self.pool_idle().await >= n as f64 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!("the pool never held {n} idle members; log:\n{}", self.log_tail(40));
    }

    /// Waits until the server answers `/v1/health`.
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + SERVER_WAIT;
        loop {
            if let Ok(Ok(r)) = timeout(Duration::from_secs(5), self.request(Method::GET, "/v1/health").send()).await {
                if r.status() == StatusCode::OK {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "the server is not healthy after {SERVER_WAIT:?}");
            sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Deterministic bytes that no compression or zero page can fake.
pub fn pattern(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A request body sent in 64 KiB chunks, never as one buffer.
pub fn chunked_body(data: &[u8]) -> reqwest::Body {
    let chunks: Vec<Result<Bytes, std::io::Error>> =
        data.chunks(64 * 1024).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
}

/// A JSON answer as `T`, or a panic naming what did not parse.
pub fn from_json<T: DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v.clone()).unwrap_or_else(|e| panic!("cannot parse {v}: {e}"))
}

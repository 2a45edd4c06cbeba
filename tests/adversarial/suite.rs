//! The table-driven runner: a [`Case`] is a script an agent could run and
//! what must come of it; [`Suite`] runs cases against one server, checks
//! after every case that the host, the node agent and a neighbour sandbox
//! are unchanged, and collects every failure instead of stopping at the
//! first.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};
use warren_api::{ExecRequest, ExecResult, ExecStatus, SandboxInfo, SandboxState, SecurityEvent, SecurityEventKind};
use warren_tests::*;

use crate::host::{self, HostState, Sentinel};

/// Where a case runs.
#[derive(Debug, Clone)]
pub enum Placement {
    /// The suite's long-lived victim sandbox: the case must not break it.
    Shared,
    /// A sandbox of its own, made with these fields over the small default
    /// and deleted after the case.
    Own(Value),
}

/// Everything a check can look at once the case ran.
#[derive(Debug)]
pub struct Outcome {
    /// The exec's answer when the server accepted it.
    pub result: Option<ExecResult>,
    /// The HTTP status and body when it did not (a rejected `cwd`, ...).
    pub rejected: Option<(StatusCode, Value)>,
    pub stdout: String,
    pub stderr: String,
    /// Security events recorded during the case (its sandbox's, after the
    /// seq seen before it).
    pub events: Vec<SecurityEvent>,
    /// The sandbox after the case.
    pub sandbox: SandboxInfo,
    /// Problems found by the runner's own work during the case (a race
    /// that reached the host, ...).
    pub extra: Vec<String>,
}

impl Outcome {
    pub fn seccomp(&self, syscall: &str) -> bool {
        self.events.iter().any(|e| e.kind == SecurityEventKind::Seccomp && e.syscall == syscall)
    }

    pub fn limit_hit(&self, field: &str) -> bool {
        let prefix = format!("{field}: ");
        self.events.iter().any(|e| e.kind == SecurityEventKind::LimitHit && e.detail.starts_with(&prefix))
    }

    pub fn status(&self) -> Option<ExecStatus> {
        self.result.as_ref().map(|r| r.status)
    }
}

pub type Check = fn(&Outcome) -> Result<(), String>;

/// What must come of a case. All listed conditions must hold.
#[derive(Debug, Clone, Default)]
pub struct Expect {
    /// Lines (substrings) the script's stdout must contain.
    pub stdout_has: Vec<String>,
    /// Substrings stdout must not contain.
    pub stdout_lacks: Vec<String>,
    /// System calls that must show up as seccomp events.
    pub seccomp: Vec<String>,
    /// Limit fields (`pids`, `memory_mib`, ...) that must show up as
    /// `limit_hit` events (polled for a bounded time).
    pub limits: Vec<String>,
    /// `(syscall, detail)` pairs that must show up as seccomp events.
    pub seccomp_detail: Vec<(String, String)>,
    /// A stdout line that must appear exactly this many times.
    pub line_count: Option<(String, usize)>,
    /// The exec's status; `None` accepts any.
    pub status: Option<ExecStatus>,
    /// Anything else.
    pub check: Option<Check>,
}

impl Expect {
    pub fn has(mut self, s: impl Into<String>) -> Self {
        self.stdout_has.push(s.into());
        self
    }
    pub fn lacks(mut self, s: impl Into<String>) -> Self {
        self.stdout_lacks.push(s.into());
        self
    }
    pub fn seccomp(mut self, syscall: impl Into<String>) -> Self {
        self.seccomp.push(syscall.into());
        self
    }
    pub fn limit(mut self, field: impl Into<String>) -> Self {
        self.limits.push(field.into());
        self
    }
    pub fn status(mut self, status: ExecStatus) -> Self {
        self.status = Some(status);
        self
    }
    pub fn check(mut self, check: Check) -> Self {
        self.check = Some(check);
        self
    }
}

/// How the case's command reaches the sandbox.
#[derive(Debug, Clone)]
pub enum Via {
    /// `sh -c SCRIPT` through the exec API.
    Exec,
    /// The same, with this working directory (hostile cwd cases).
    ExecCwd(&'static str),
    /// The script runs in the background while the runner hammers the file
    /// API with paths through the script's swapping symlink.
    FileRace,
    /// Overwrites `/bin/sh` and `/bin/bash`, then checks the platform still
    /// works (exec, files, sessions) without running the impostor.
    ShellImpostor,
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: String,
    /// What the agent runs (busybox `sh -c`), with placeholders
    /// ([`Suite::expand`]).
    pub script: String,
    pub placement: Placement,
    pub via: Via,
    pub timeout_secs: f64,
    pub output_cap_bytes: Option<u64>,
    pub expect: Expect,
    /// A known hole: the case still runs and its result is reported, but a
    /// failure of its expectation is listed as a known hole, not a failure.
    pub known_hole: Option<&'static str>,
    /// A second script run after the first (same sandbox), its stdout
    /// appended after a `--then--` line: does the platform still behave?
    pub then: Option<&'static str>,
}

impl Case {
    pub fn new(name: impl Into<String>, script: impl Into<String>, expect: Expect) -> Case {
        Case {
            name: name.into(),
            script: script.into(),
            placement: Placement::Shared,
            via: Via::Exec,
            timeout_secs: 60.0,
            output_cap_bytes: None,
            expect,
            known_hole: None,
            then: None,
        }
    }
    pub fn own(mut self, fields: Value) -> Case {
        self.placement = Placement::Own(fields);
        self
    }
    pub fn via(mut self, via: Via) -> Case {
        self.via = via;
        self
    }
    pub fn timeout(mut self, secs: f64) -> Case {
        self.timeout_secs = secs;
        self
    }
    pub fn then(mut self, script: &'static str) -> Case {
        self.then = Some(script);
        self
    }
    pub fn cap(mut self, bytes: u64) -> Case {
        self.output_cap_bytes = Some(bytes);
        self
    }
}

/// The probe, built once per test process.
pub fn probe_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| static_c_helper("adversarial/probe.c", env!("CARGO_TARGET_TMPDIR"))).clone()
}

/// How much the node agent's peak memory may grow during one case: a
/// flood that piles output (or anything else) up in the server shows here.
const NODE_MEMORY_GROWTH_BOUND: u64 = 128 << 20;

/// Where the probe lives inside every sandbox.
pub const PROBE: &str = "/tmp/.probe";
const NEIGHBOUR_FILES: [(&str, &str); 3] =
    [("/work/n/a.txt", "alpha\n"), ("/work/n/b.txt", "bravo\n"), ("/work/n/deep/c.txt", "charlie\n")];

/// A host process holding a secret in its command line and environment;
/// killed (by pid) on drop.
pub struct PlantedSecret {
    pub secret: String,
    child: Child,
}

impl PlantedSecret {
    fn plant() -> PlantedSecret {
        let secret = unique_marker("hostsecret");
        // `read` is a shell builtin: no grandchild outlives the kill below.
        let child = Command::new("/bin/sh")
            .args(["-c", "read line", &secret])
            .env("WARREN_ADV_SECRET", &secret)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the secret-holding host process");
        PlantedSecret { secret, child }
    }

    /// A regular expression that matches the secret but whose own text does
    /// not (`[x]` for one character), so a grep's own command line does not
    /// match itself.
    pub fn pattern(&self) -> String {
        let mut s = self.secret.clone();
        let i = s.find("hostsecret").expect("the marker names itself") + 4;
        s.replace_range(i..i + 1, &format!("[{}]", &self.secret[i..i + 1]));
        s
    }
}

impl Drop for PlantedSecret {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Suite {
    pub server: TestServer,
    /// Fields every sandbox of the suite is made with over the small
    /// default (`{}`: containers; the backend and its memory for VMs).
    backend: Value,
    pub victim: SandboxInfo,
    pub neighbour: SandboxInfo,
    neighbour_pid1: Option<i32>,
    pub sentinel: Sentinel,
    pub secret: PlantedSecret,
    /// The result of every case, failures with their reasons.
    pub failures: Vec<String>,
    pub holes: Vec<String>,
    pub passed: Vec<String>,
}

impl Suite {
    pub async fn start() -> Suite {
        Self::start_with(&[]).await
    }

    pub async fn start_with(args: &[&str]) -> Suite {
        Self::start_on(args, json!({})).await
    }

    /// A suite whose victim, neighbour and own sandboxes are made with
    /// `backend`'s fields (e.g. `{"backend": "microvm", "memory_mib": 256}`).
    pub async fn start_on(args: &[&str], backend: Value) -> Suite {
        let probe = probe_binary();
        let server = TestServer::start_with(args).await;
        let mut watched = vec![server.path().join("rootfs"), probe.clone(), PathBuf::from("/bin/busybox")];
        for f in ["/etc/passwd", "/etc/hostname", "/etc/hosts", "/proc/sys/kernel/core_pattern"] {
            watched.push(PathBuf::from(f));
        }
        if let Ok(exe) = std::fs::canonicalize(std::env::var_os("WARREN_BIN").map(PathBuf::from).unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("test exe");
            exe.parent().and_then(Path::parent).map(|d| d.join("warren")).unwrap_or(exe)
        })) {
            watched.push(exe.with_file_name("warren-init"));
            watched.push(exe);
        }
        for sub in ["images/layers", "layers"] {
            let dir = server.data_dir().join(sub);
            if dir.is_dir() {
                watched.push(dir);
            }
        }
        let sentinel = Sentinel::plant(&server.path().join("sentinel"), &unique_marker("sentinel"), watched);
        let secret = PlantedSecret::plant();
        let victim = server.create(small(backend.clone())).await;
        let neighbour = server.create(small(backend.clone())).await;
        let suite = Suite {
            backend,
            neighbour_pid1: sandbox_pid1(&server.instance, &neighbour.id),
            server,
            victim,
            neighbour,
            sentinel,
            secret,
            failures: Vec::new(),
            holes: Vec::new(),
            passed: Vec::new(),
        };
        suite.prepare(&suite.victim.id.clone()).await;
        suite.server.sh_ok(&suite.neighbour.id, "mkdir -p /work/n/deep").await;
        for (path, text) in NEIGHBOUR_FILES {
            suite.server.put_file_ok(&suite.neighbour.id, path, text).await;
        }
        suite
    }

    /// Uploads the probe.
    async fn prepare(&self, id: &str) {
        let bytes = std::fs::read(probe_binary()).expect("read the probe");
        let (status, body) = self.server.put_file(id, PROBE, bytes, Some("755")).await;
        assert_eq!(status, StatusCode::OK, "upload the probe: {body}");
    }

    /// Replaces the placeholders: `{probe}`, `{pattern}` (matches the
    /// planted host secret), `{sentinel}` (the host sentinel tree's path),
    /// `{datadir}`, `{instance}`, `{port}` (the API's port on the host).
    pub fn expand(&self, script: &str) -> String {
        let port = self.server.url.rsplit(':').next().unwrap_or("0").to_string();
        script
            .replace("{probe}", PROBE)
            .replace("{pattern}", &self.secret.pattern())
            .replace("{sentinel}", &self.sentinel.dir.to_string_lossy())
            .replace("{datadir}", &self.server.data_dir().to_string_lossy())
            .replace("{instance}", &self.server.instance)
            .replace("{port}", &port)
    }

    fn expand_expect(&self, e: &Expect) -> Expect {
        let all = |v: &[String]| v.iter().map(|s| self.expand(s)).collect();
        Expect { stdout_has: all(&e.stdout_has), stdout_lacks: all(&e.stdout_lacks), ..e.clone() }
    }

    pub async fn events(&self, id: &str, after_seq: u64) -> (Vec<SecurityEvent>, u64) {
        let (status, body) =
            self.server.call(Method::GET, &format!("/v1/sandboxes/{id}/events?after_seq={after_seq}"), None).await;
        if status != StatusCode::OK {
            return (Vec::new(), after_seq);
        }
        let list: warren_api::SecurityEventList = serde_json::from_value(body).expect("a SecurityEventList");
        (list.events, list.next_seq.saturating_sub(1))
    }

    /// Runs every case, then the after-case checks; records the results.
    pub async fn run_all(&mut self, cases: &[Case]) {
        for case in cases {
            let started = Instant::now();
            let before = HostState::take(&self.sentinel);
            let problems = self.run_one(case).await;
            let mut after_problems = self.after_case(&before).await;
            let elapsed = started.elapsed();
            let mut all = problems;
            all.append(&mut after_problems);
            match (all.is_empty(), case.known_hole) {
                (true, Some(hole)) => self.failures.push(format!(
                    "{}: marked as the known hole \"{hole}\" but stopped now: remove the mark",
                    case.name
                )),
                (true, None) => self.passed.push(format!("{} ({elapsed:.1?})", case.name)),
                (false, Some(hole)) => self.holes.push(format!("{}: KNOWN HOLE {hole}: {}", case.name, all.join("; "))),
                (false, None) => self.failures.push(format!("{}: {}", case.name, all.join("; "))),
            }
            eprintln!(
                "adversarial case {} done in {elapsed:.1?}: {}",
                case.name,
                if self.failures.last().is_some_and(|f| f.starts_with(&format!("{}:", case.name))) {
                    "FAILED"
                } else {
                    "ok"
                }
            );
        }
    }

    /// The case itself; returns what its expectation found wrong.
    async fn run_one(&mut self, case: &Case) -> Vec<String> {
        let (id, own) = match &case.placement {
            Placement::Shared => (self.victim.id.clone(), false),
            Placement::Own(fields) => {
                let (status, body) = self.server.try_create(&small(merged(&self.backend, fields))).await;
                if status != StatusCode::CREATED {
                    return vec![format!("creating its sandbox: {status} {body}")];
                }
                let info: SandboxInfo = serde_json::from_value(body).expect("SandboxInfo");
                self.prepare(&info.id).await;
                (info.id, true)
            }
        };
        let (_, seq_before) = self.events(&id, 0).await;
        let peak_before = self.server_peak_rss();
        let script = self.expand(&case.script);
        let mut outcome = match &case.via {
            Via::Exec | Via::ExecCwd(_) => {
                let mut outcome = self.exec(&id, case, &script).await;
                if let Some(then) = case.then {
                    let r = self.server.sh(&id, &self.expand(then)).await;
                    outcome.stdout.push_str(&format!("--then--\n{}", stdout(&r)));
                }
                outcome
            }
            Via::FileRace => self.file_race(&id, case, &script).await,
            Via::ShellImpostor => self.shell_impostor(&id, case, &script).await,
        };
        let grown = self.server_peak_rss().saturating_sub(peak_before);
        if grown > NODE_MEMORY_GROWTH_BOUND {
            outcome.extra.push(format!("the server's peak memory grew by {} MiB during the case", grown >> 20));
        }
        // Limit events come from the node's reaper: poll for them.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (events, _) = self.events(&id, seq_before).await;
            outcome.events = events;
            let missing = case.expect.limits.iter().any(|f| !outcome.limit_hit(f));
            if !missing || Instant::now() > deadline {
                break;
            }
            sleep(Duration::from_millis(250)).await;
        }
        outcome.sandbox = self.server.get(&id).await;
        let problems = judge(&self.expand_expect(&case.expect), &outcome);
        if own {
            if outcome.sandbox.state != SandboxState::Ended {
                let (status, body) = self.server.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
                if status != StatusCode::OK {
                    return [problems, vec![format!("deleting its sandbox: {status} {body}")]].concat();
                }
            }
        } else if outcome.sandbox.state != SandboxState::Running {
            let mut problems = problems;
            problems.push(format!("the shared victim ended ({:?}); making a new one", outcome.sandbox.end_reason));
            self.victim = self.server.create(small(self.backend.clone())).await;
            self.prepare(&self.victim.id.clone()).await;
            return problems;
        }
        problems
    }

    /// The server's peak resident memory (`VmHWM`), bytes.
    fn server_peak_rss(&self) -> u64 {
        let Some(pid) = self.server.server_pid() else { return 0 };
        leaks::proc_status_field(pid as i32, "VmHWM")
            .and_then(|v| v.split_whitespace().next().and_then(|kb| kb.parse::<u64>().ok()))
            .map_or(0, |kb| kb << 10)
    }

    async fn exec(&self, id: &str, case: &Case, script: &str) -> Outcome {
        let mut req = ExecRequest::shell(script);
        req.timeout_secs = Some(case.timeout_secs);
        req.output_cap_bytes = case.output_cap_bytes;
        if let Via::ExecCwd(cwd) = &case.via {
            req.cwd = Some(cwd.to_string());
        }
        let body = serde_json::to_value(&req).expect("serialize");
        let (status, value) = self.server.try_exec_wait(id, &body).await;
        let mut outcome = blank_outcome(self.server.get(id).await);
        if status == StatusCode::OK {
            let result: ExecResult = serde_json::from_value(value).expect("ExecResult");
            outcome.stdout = stdout(&result).to_string();
            outcome.stderr = stderr(&result).to_string();
            outcome.result = Some(result);
        } else {
            outcome.rejected = Some((status, value));
        }
        outcome
    }

    /// CVE-2018-15664 class: while the script swaps `/work/race` between a
    /// directory and symlinks to `/` and to the host's sentinel path, the
    /// file API writes and reads through it. Nothing may land on, or come
    /// from, the host.
    async fn file_race(&self, id: &str, case: &Case, script: &str) -> Outcome {
        let mut req = ExecRequest::shell(script);
        req.timeout_secs = Some(case.timeout_secs);
        let mut stream = self.server.exec_open(id, &req).await;
        let exec_id = stream.exec_id().await;
        let secret_file = std::fs::read_to_string(self.sentinel.dir.join("answers.txt")).unwrap_or_default();
        let mut extra = Vec::new();
        for i in 0..200 {
            let (status, body) = self.server.get_file(id, "/work/race/answers.txt").await;
            if status == StatusCode::OK && String::from_utf8_lossy(&body).contains(secret_file.trim()) {
                extra.push(format!("download {i} through the race returned the host sentinel's content"));
            }
            let _ = self.server.put_file(id, "/work/race/planted.txt", format!("planted {i}"), None).await;
            let _ = self.server.stat(id, "/work/race/private/key").await;
        }
        let _ = self.server.kill_exec(id, &exec_id).await;
        let _ = stream.collect().await;
        if self.sentinel.dir.join("planted.txt").exists() {
            extra.push("the file API wrote planted.txt into the host's sentinel tree".into());
        }
        let mut outcome = blank_outcome(self.server.get(id).await);
        outcome.result = Some(self.server.wait_exec(id, &exec_id, Duration::from_secs(30)).await);
        outcome.stdout =
            outcome.result.as_ref().and_then(|r| r.output.as_ref()).map(|o| o.stdout.text.clone()).unwrap_or_default();
        outcome.extra = extra;
        outcome
    }

    /// The `/bin/bash` incident: the script plants impostors for `/bin/sh`
    /// and `/bin/bash` that log every run; then the platform's own
    /// operations (argv exec, files, a session with state) must still work
    /// and must not have run the impostor more often than the user's own
    /// shell commands asked for.
    async fn shell_impostor(&self, id: &str, case: &Case, script: &str) -> Outcome {
        let mut outcome = self.exec(id, case, script).await;
        let s = &self.server;
        let mut extra = Vec::new();
        let r = s.exec_wait(id, &ExecRequest::argv(["/bin/busybox", "echo", "platform-ok"])).await;
        if stdout(&r) != "platform-ok\n" {
            extra.push(format!("argv exec after the overwrite: {r:?}"));
        }
        let hijacks = |r: &ExecResult| stdout(r).lines().count();
        let log = ExecRequest::argv(["/bin/busybox", "cat", "/tmp/hijacked"]);
        let after_argv = hijacks(&s.exec_wait(id, &log).await);
        if after_argv != 0 {
            extra.push(format!("the platform ran the impostor {after_argv} time(s) for an argv exec"));
        }
        s.put_file_ok(id, "/work/after.txt", "files still work").await;
        let (status, body) = s.get_file(id, "/work/after.txt").await;
        if (status, body.as_ref()) != (StatusCode::OK, b"files still work".as_ref()) {
            extra.push(format!("file API after the overwrite: {status}"));
        }
        let session = s.create_session(id, json!({})).await;
        let first = s.session_exec(id, &session.id, "cd /tmp && export AGENT_VAR=kept").await;
        let second = s.session_exec(id, &session.id, "echo \"$(pwd) $AGENT_VAR\"").await;
        if stdout(&second).trim() != "/tmp kept" {
            extra.push(format!("session state after the overwrite: {first:?} then {second:?}"));
        }
        let after_session = hijacks(&s.exec_wait(id, &log).await);
        // Two session commands are two user shells; the platform's own
        // state reporting must not add runs.
        if after_session > 2 {
            extra.push(format!("the impostor ran {after_session} times for 2 session commands"));
        }
        outcome.extra = extra;
        outcome
    }

    /// The after-case checks: host, node agent, neighbour.
    async fn after_case(&mut self, before: &HostState) -> Vec<String> {
        let mut problems = before.changes(&HostState::take(&self.sentinel));
        problems.extend(host::escaped_processes(self.server.server_pid(), &self.server.instance));
        let (status, body) = self.server.call(Method::GET, "/v1/health", None).await;
        if status != StatusCode::OK || body["status"] != "ok" {
            problems.push(format!("node health: {status} {body}"));
        }
        let n = &self.neighbour.id;
        let info = self.server.get(n).await;
        if info.state != SandboxState::Running {
            problems.push(format!("the neighbour ended: {:?}", info.end_reason));
            return problems;
        }
        if sandbox_pid1(&self.server.instance, n) != self.neighbour_pid1 {
            problems.push("the neighbour's PID 1 changed".into());
        }
        let paths: Vec<&str> = NEIGHBOUR_FILES.iter().map(|(p, _)| *p).collect();
        let r = self.server.exec_wait(n, &ExecRequest::argv([&["cat"], paths.as_slice()].concat())).await;
        let want: String = NEIGHBOUR_FILES.iter().map(|(_, t)| *t).collect();
        if r.status != ExecStatus::Ok || stdout(&r) != want {
            problems.push(format!("the neighbour's files or exec changed: {r:?}"));
        }
        let listing = self.server.sh(n, "find / -xdev -newer /work/n/deep/c.txt -type f 2>/dev/null | head").await;
        let fresh = stdout(&listing).trim().to_string();
        if !fresh.is_empty() {
            problems.push(format!("files changed in the neighbour: {fresh}"));
        }
        problems
    }

    /// Reports and asserts: every failing case is listed.
    pub async fn finish(self, what: &str) {
        eprintln!(
            "{what}: {} passed, {} failed, {} known holes",
            self.passed.len(),
            self.failures.len(),
            self.holes.len()
        );
        for h in &self.holes {
            eprintln!("  {h}");
        }
        let failures = self.failures.clone();
        if !failures.is_empty() {
            panic!("{what}: {} case(s) failed:\n  {}", failures.len(), failures.join("\n  "));
        }
        self.server.finish().await;
    }
}

/// `base` with `over`'s fields set on it.
fn merged(base: &Value, over: &Value) -> Value {
    let mut out = base.clone();
    if let (Some(out), Some(over)) = (out.as_object_mut(), over.as_object()) {
        out.extend(over.clone());
    }
    out
}

fn blank_outcome(sandbox: SandboxInfo) -> Outcome {
    Outcome {
        result: None,
        rejected: None,
        stdout: String::new(),
        stderr: String::new(),
        events: Vec::new(),
        sandbox,
        extra: Vec::new(),
    }
}

/// Everything the expectation finds wrong with the outcome.
pub fn judge(expect: &Expect, o: &Outcome) -> Vec<String> {
    let mut problems = o.extra.clone();
    let shown = || format!("stdout {:?}, stderr {:?}", clip(&o.stdout), clip(&o.stderr));
    for s in &expect.stdout_has {
        if !o.stdout.contains(s.as_str()) {
            problems.push(format!("stdout lacks {s:?} ({})", shown()));
        }
    }
    for s in &expect.stdout_lacks {
        if o.stdout.contains(s.as_str()) {
            problems.push(format!("stdout has {s:?} ({})", shown()));
        }
    }
    for call in &expect.seccomp {
        if !o.seccomp(call) {
            let seen: Vec<String> =
                o.events.iter().map(|e| format!("{:?}:{}:{}", e.kind, e.syscall, e.detail)).collect();
            problems.push(format!("no seccomp event for `{call}` (events: {seen:?})"));
        }
    }
    for (call, detail) in &expect.seccomp_detail {
        let seen =
            o.events.iter().any(|e| e.kind == SecurityEventKind::Seccomp && &e.syscall == call && &e.detail == detail);
        if !seen {
            problems.push(format!("no seccomp event `{call}` `{detail}`"));
        }
    }
    if let Some((line, n)) = &expect.line_count {
        let got = o.stdout.lines().filter(|l| l == line).count();
        if got != *n {
            problems.push(format!("{got} lines {line:?}, expected {n} ({})", shown()));
        }
    }
    for field in &expect.limits {
        if !o.limit_hit(field) {
            let seen: Vec<&str> = o.events.iter().map(|e| e.detail.as_str()).collect();
            problems.push(format!("no limit_hit event for `{field}` (events: {seen:?})"));
        }
    }
    if let Some(want) = expect.status {
        if o.status() != Some(want) {
            problems.push(format!("exec status {:?}, expected {want:?} ({})", o.status(), shown()));
        }
    }
    if let Some(check) = expect.check {
        if let Err(why) = check(o) {
            problems.push(why);
        }
    }
    problems
}

fn clip(s: &str) -> String {
    if s.len() <= 600 {
        return s.to_string();
    }
    let mut end = 600;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...[{} bytes]", &s[..end], s.len())
}

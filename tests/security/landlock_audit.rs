//! Landlock denials as security events, with the server's default
//! (`--landlock-audit auto`): where no audit daemon runs, the server
//! registers as the host's audit daemon, adds a `never,task` audit rule and
//! enables audit; a refused read inside a sandbox becomes a `landlock`
//! event naming the path, and stopping the server - or starting it again
//! after a crash - puts the host's audit settings and rule list back.
//! Without `CAP_AUDIT_CONTROL`, `auto` runs without the events and says so,
//! and `on` refuses to start. Its own test binary: enabling audit is
//! host-wide, so it must not overlap another suite's kernel-log checks
//! (every other test server runs with `--landlock-audit off`), and its
//! tests run one at a time.
//!
//! Needs `CAP_AUDIT_CONTROL` in the initial user and pid namespaces; where
//! the host refuses, the tests fail and say so (never pass silently).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::json;
use tokio::time::{sleep, Instant};
use warren_api::{ExecStatus, NodeStats, SecurityEvent, SecurityEventKind, SecurityEventList};
use warren_guard::audit::{AuditError, AuditRule, AuditSocket, AuditStatus};
use warren_tests::*;

/// One test at a time: they make the server the host's audit daemon.
static AUDIT: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn audit_status() -> AuditStatus {
    AuditSocket::open().and_then(|mut s| s.status()).unwrap_or_else(|e| {
        panic!(
            "cannot read the host's audit status ({e}): this test needs CAP_AUDIT_CONTROL in the initial \
             user and pid namespaces, and cannot check Landlock events without it"
        )
    })
}

/// Kernel-log lines that only appear when audit records reach the kernel
/// log instead of a daemon (Landlock records, audit configuration changes)
/// or are lost.
fn audit_noise() -> BTreeSet<String> {
    let out = Command::new("dmesg").output().expect("run dmesg");
    assert!(out.status.success(), "dmesg failed: {}", String::from_utf8_lossy(&out.stderr));
    const NOISE: &[&str] = &["type=1423", "type=1424", "type=1305", "audit_backlog", "audit_lost", "kauditd"];
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| NOISE.iter().any(|n| l.contains(n)))
        .map(|l| l.split_once(']').map_or(l, |(_, rest)| rest).trim().to_string())
        .collect()
}

/// `AUDIT_LIST_RULES`: every rule of the host, in the kernel's order.
fn audit_rules() -> Vec<AuditRule> {
    AuditSocket::open().and_then(|mut s| s.list_rules()).unwrap_or_else(|e| panic!("cannot list the audit rules: {e}"))
}

/// The host's audit state a test must leave as it found it.
#[derive(Debug, Clone, PartialEq)]
struct HostAudit {
    enabled: u32,
    failure: u32,
    backlog_limit: u32,
    pid: u32,
    rules: Vec<AuditRule>,
}

fn host_audit() -> HostAudit {
    let s = audit_status();
    HostAudit {
        enabled: s.enabled,
        failure: s.failure,
        backlog_limit: s.backlog_limit,
        pid: s.pid,
        rules: audit_rules(),
    }
}

/// Puts the host's audit state back as it was if a test fails half-way: a
/// failing test's server is SIGKILLed and its data dir (with the node's
/// record of what it changed) removed, so no later start would undo it.
/// Declared before the server, so dropped after it.
struct RestoreOnPanic(HostAudit);

impl Drop for RestoreOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Err(e) = restore_host(&self.0) {
                eprintln!("cannot put the host's audit state back to {:?}: {e}", self.0);
            }
        }
    }
}

fn restore_host(before: &HostAudit) -> Result<(), AuditError> {
    let mut socket = AuditSocket::open()?;
    let now = socket.status()?;
    if now.pid != 0 && pid_alive(now.pid) {
        return Ok(()); // a live daemon's state is its own
    }
    socket.set_pid(std::process::id())?;
    for rule in socket.list_rules()? {
        if rule.is_task_never() && !before.rules.contains(&rule) {
            socket.delete_rule(&rule)?;
        }
    }
    if now.backlog_limit != before.backlog_limit {
        socket.set_backlog_limit(before.backlog_limit)?;
    }
    if now.enabled != before.enabled {
        socket.set_enabled(before.enabled)?;
    }
    // What was queued for this daemon, up to a quiet read.
    while socket.recv()?.is_some() {}
    socket.set_pid(0)
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The host's audit state before a test, checked to be one the test can
/// take over: no other daemon running.
fn before() -> HostAudit {
    let host = host_audit();
    assert!(
        host.pid == 0 || !pid_alive(host.pid),
        "an audit daemon (pid {}) runs on this host: the server would only listen to it; run this test \
         where no audit daemon runs",
        host.pid
    );
    // A dead daemon's pid is dropped by the kernel on its next record:
    // compare with what a stop leaves.
    HostAudit { pid: 0, ..host }
}

/// The server is the daemon, and the `never,task` rule is in force: the
/// one it added, or one the host had.
fn assert_registered(server: &TestServer, before: &HostAudit) {
    let rules = audit_rules();
    let never: Vec<&AuditRule> = rules.iter().filter(|r| r.is_task_never()).collect();
    assert_eq!(never.len(), 1, "not exactly one `never,task` rule in force: {rules:?}");
    if !before.rules.iter().any(AuditRule::is_task_never) {
        assert_eq!(rules.len(), before.rules.len() + 1, "the server changed more than its own rule");
        assert_eq!(never[0], &AuditRule::task_never());
    }
    let now = audit_status();
    assert_eq!(
        Some(now.pid),
        server.server_pid(),
        "the server did not register as the audit daemon; log:\n{}",
        server.log_tail(30)
    );
    assert_eq!(now.enabled, 1, "audit is not enabled while the server is the daemon");
    assert!(now.backlog_limit >= 8192, "the backlog limit stayed tiny: {}", now.backlog_limit);
}

/// Stops the server (SIGTERM) and checks that the host's audit settings
/// and rules are as before it started, and that no record was lost.
async fn stop_and_assert_restored(server: &mut TestServer, before: &HostAudit, lost_before: u32) {
    server.stop().await;
    let after = host_audit();
    assert_eq!(&after, before, "the host's audit state was not restored; log:\n{}", server.log_tail(40));
    assert_eq!(audit_status().lost, lost_before, "the kernel lost audit records; log:\n{}", server.log_tail(40));
}

/// A server with the default `--landlock-audit` (no flag).
async fn default_server() -> TestServer {
    TestServer::start_launched(Launch { default_landlock_audit: true, ..Launch::default() }).await
}

async fn stats(server: &TestServer) -> NodeStats {
    let (status, body) = server.call(Method::GET, "/v1/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body).expect("NodeStats")
}

async fn events(server: &TestServer, id: &str) -> SecurityEventList {
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/events"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body).expect("a SecurityEventList")
}

/// Waits (bounded) for a `landlock` event whose detail names `path`.
async fn landlock_event(server: &TestServer, id: &str, path: &str) -> SecurityEvent {
    landlock_event_after(server, id, path, 0).await
}

/// [`landlock_event`] among the events after `after_seq`.
async fn landlock_event_after(server: &TestServer, id: &str, path: &str, after_seq: u64) -> SecurityEvent {
    let deadline = Instant::now() + warren_tests::server::SERVER_WAIT;
    loop {
        let list = events(server, id).await;
        let found = list
            .events
            .iter()
            .find(|e| e.seq > after_seq && e.kind == SecurityEventKind::Landlock && e.detail.contains(path));
        if let Some(e) = found {
            return e.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no landlock event naming {path}: {:?}\nlog:\n{}",
            list.events,
            server.log_tail(30)
        );
        sleep(Duration::from_millis(50)).await;
    }
}

async fn landlock_count(server: &TestServer, id: &str) -> u64 {
    events(server, id).await.counts.get(&SecurityEventKind::Landlock).copied().unwrap_or(0)
}

/// A sandbox whose `rollout` phase hides `/work/answers`, switched to it
/// with the answer in place.
async fn sandbox_in_rollout(server: &TestServer) -> String {
    let phases = json!({"setup": {}, "rollout": {"protected_paths": {"/work/answers": "none"}}});
    let sb = server.create(small(json!({"phases": phases, "phase": "setup"}))).await;
    server.sh_ok(&sb.id, "mkdir -p /work/answers && echo secret > /work/answers/key").await;
    let (status, body) =
        server.call(Method::PUT, &format!("/v1/sandboxes/{}/phase", sb.id), Some(&json!({"name": "rollout"}))).await;
    assert_eq!(status, StatusCode::OK, "set phase: {body}");
    sb.id
}

#[tokio::test]
async fn by_default_a_refused_read_becomes_a_landlock_event_and_audit_is_restored() {
    let _one = AUDIT.lock().await;
    let before = before();
    let _restore = RestoreOnPanic(before.clone());
    let lost = audit_status().lost;
    let noise_before = audit_noise();
    let mut server = default_server().await;
    assert_registered(&server, &before);
    assert!(server.data_dir().join("landlock-audit.json").is_file(), "the takeover is not written down");
    let shown = stats(&server).await.landlock_events;
    assert!(shown.available, "{shown:?}");
    assert!(shown.detail.contains("audit daemon"), "{shown:?}");

    let id = sandbox_in_rollout(&server).await;
    let r = server.sh(&id, "cat /work/answers/key").await;
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_ne!(r.exit_code, Some(0), "the protected file was readable: {}", stdout(&r));
    assert!(stderr(&r).contains("Permission denied"), "not EACCES: {}", stderr(&r));

    let event = landlock_event(&server, &id, "/work/answers/key").await;
    assert_eq!(event.detail, "fs.read_file /work/answers/key", "{event:?}");
    // Under the `never,task` rule the sandbox's processes have no audit
    // context: no AUDIT_SYSCALL record names the refused process.
    assert_eq!((event.pid, event.comm.as_str(), event.syscall.as_str()), (0, "", ""), "{event:?}");

    // A burst: every refusal is counted, none is lost to the kernel log
    // (checked below) or dropped for want of backlog.
    const BURST: u64 = 500;
    let seen = landlock_count(&server, &id).await;
    server.sh_ok(&id, &format!("for i in $(seq {BURST}); do cat /work/answers/key 2>/dev/null; done; true")).await;
    let deadline = Instant::now() + warren_tests::server::SERVER_WAIT;
    while landlock_count(&server, &id).await < seen + BURST {
        assert!(
            Instant::now() < deadline,
            "{} of {BURST} refusals became events",
            landlock_count(&server, &id).await - seen
        );
        sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(landlock_count(&server, &id).await, seen + BURST, "more events than refusals");

    let (status, body) = server.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    stop_and_assert_restored(&mut server, &before, lost).await;
    assert!(!server.data_dir().join("landlock-audit.json").exists(), "the takeover file outlived a clean stop");
    server.finish().await;
    let new_noise: Vec<String> = audit_noise().difference(&noise_before).cloned().collect();
    assert!(new_noise.is_empty(), "audit records reached the kernel log: {new_noise:?}");
}

#[tokio::test]
async fn a_restart_after_a_crash_restores_audit() {
    let _one = AUDIT.lock().await;
    let before = before();
    let _restore = RestoreOnPanic(before.clone());
    let lost = audit_status().lost;
    let mut server = default_server().await;
    assert_registered(&server, &before);
    let crashed = server.server_pid();
    server.crash().await;
    // What a crash leaves: audit still enabled, the rule still in force; the
    // dead daemon's pid is dropped by the kernel the next time it has a
    // record to send.
    let left = host_audit();
    assert_eq!(left.enabled, 1, "audit was disabled without a clean stop?");
    assert!(left.pid == 0 || Some(left.pid) == crashed, "{left:?}");
    assert!(left.rules.iter().any(AuditRule::is_task_never), "the rule went without a clean stop? {left:?}");

    server.launch().await;
    assert_registered(&server, &before);
    stop_and_assert_restored(&mut server, &before, lost).await;

    // A crash, and a restart with `off`: what the crash left is undone too.
    server.launch().await;
    assert_registered(&server, &before);
    server.crash().await;
    assert!(server.data_dir().join("landlock-audit.json").is_file());
    // Same data dir, now with the harness's `--landlock-audit off`.
    server.set_default_landlock_audit(false);
    server.launch().await;
    let after = HostAudit { pid: 0, ..host_audit() };
    assert_eq!(after, before, "an `off` start did not undo a crashed node's audit settings");
    let shown = stats(&server).await.landlock_events;
    assert_eq!((shown.available, shown.detail.as_str()), (false, "--landlock-audit off"));
    server.stop().await;
    assert_eq!(audit_status().lost, lost, "the kernel lost audit records");
    server.finish().await;
}

/// A SIGTERM as early as a client can see the server (its `server.url`
/// written) still ends it cleanly with the host's audit settings put back:
/// the server takes the signal over before it starts, not after.
#[tokio::test]
async fn a_sigterm_right_after_start_restores_audit() {
    let _one = AUDIT.lock().await;
    let before = before();
    let _restore = RestoreOnPanic(before.clone());
    let lost = audit_status().lost;
    let mut server = default_server().await;
    stop_and_assert_restored(&mut server, &before, lost).await;
    for _ in 0..3 {
        server.launch().await;
        stop_and_assert_restored(&mut server, &before, lost).await;
    }
    server.finish().await;
}

/// Where audit cannot be had (here: no `CAP_AUDIT_CONTROL`), the default
/// runs without Landlock events and says so; `on` refuses to start.
#[tokio::test]
async fn without_cap_audit_control_auto_degrades_and_on_refuses() {
    let _one = AUDIT.lock().await;
    let before = before();
    let _restore = RestoreOnPanic(before.clone());
    // `setpriv` drops the capability from the bounding set, so the exec'd
    // root server has it in no set.
    let no_cap: Vec<String> =
        ["setpriv", "--bounding-set=-audit_control", "--inh-caps=-audit_control", "--"].map(String::from).to_vec();
    let mut server = TestServer::start_launched(Launch {
        prefix: no_cap.clone(),
        default_landlock_audit: true,
        ..Launch::default()
    })
    .await;
    let shown = stats(&server).await.landlock_events;
    assert!(!shown.available, "{shown:?}");
    assert!(shown.detail.starts_with("audit cannot be enabled"), "{shown:?}");
    assert!(server.log_tail(200).contains("landlock denials are NOT security events"), "no warning in the log");
    assert_eq!(host_audit(), HostAudit { pid: audit_status().pid, ..before }, "the host's audit state changed");
    server.stop().await;

    let data = server.path().join("data-on");
    let instance = format!("{}-on", server.instance);
    let out = Command::new(no_cap[0].as_str())
        .args(&no_cap[1..])
        .arg(warren_binary())
        .arg("serve")
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0", "--instance", &instance])
        .args(["--landlock-audit", "on"])
        .env("NO_COLOR", "1")
        .output()
        .expect("run warren serve");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "`--landlock-audit on` started without CAP_AUDIT_CONTROL: {stderr}");
    assert!(stderr.contains("audit"), "the refusal does not say why: {stderr}");
    let leaks = warren_tests::leaks::Leaks::scan(&data, &instance);
    assert!(leaks.is_empty(), "the server that refused to start left behind:\n{leaks}");
    warren_tests::leaks::remove_instance_dirs(&instance);
    let _ = std::fs::remove_dir_all(&data);
    server.finish().await;
}

/// This test process as the host's audit daemon (as `auditd` would be):
/// registered, audit enabled, every record read and dropped, until stopped.
struct FakeDaemon {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeDaemon {
    fn start(enabled_before: u32) -> FakeDaemon {
        let mut socket = AuditSocket::open().expect("open an audit socket");
        socket.set_pid(std::process::id()).expect("register the test as the audit daemon");
        if enabled_before == 0 {
            socket.set_enabled(1).expect("enable audit");
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                let _ = socket.recv();
            }
            if enabled_before == 0 {
                socket.set_enabled(0).expect("disable audit again");
                // Read up to the record of that change, then to a quiet read.
                // (Bounded: each read waits at most 100 ms.)
                let mut changed = false;
                for _ in 0..100 {
                    match socket.recv().expect("read audit records") {
                        Some(r) if r.text.contains("audit_enabled=0") => changed = true,
                        None if changed => break,
                        _ => {}
                    }
                }
            }
            socket.set_pid(0).expect("unregister the test as the audit daemon");
        });
        FakeDaemon { stop, thread: Some(thread) }
    }

    fn stop(mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("the fake daemon's thread");
        }
    }
}

impl Drop for FakeDaemon {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[tokio::test]
async fn with_another_audit_daemon_the_server_only_listens() {
    let _one = AUDIT.lock().await;
    let before = before();
    let _restore = RestoreOnPanic(before.clone());
    let noise_before = audit_noise();
    let daemon = FakeDaemon::start(before.enabled);
    // The default: a daemon runs, so the server reads the read-log group.
    let mut server = default_server().await;
    let shown = stats(&server).await.landlock_events;
    assert!(shown.available && shown.detail.contains("read-log"), "{shown:?}");
    let id = sandbox_in_rollout(&server).await;
    let r = server.sh(&id, "cat /work/answers/key").await;
    assert!(stderr(&r).contains("Permission denied"), "not EACCES: {r:?}");
    let event = landlock_event(&server, &id, "/work/answers/key").await;
    assert_eq!(event.comm, "cat", "{event:?}");

    let (status, body) = server.call(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.stop().await;
    let now = audit_status();
    assert_eq!(now.pid, std::process::id(), "the server touched another daemon's registration");
    assert_eq!(now.enabled, 1, "the server disabled another daemon's audit");
    assert_eq!(audit_rules(), before.rules, "the server changed another daemon's rules");
    assert!(!server.data_dir().join("landlock-audit.json").exists(), "a listener recorded a takeover");

    daemon.stop();
    assert_eq!(host_audit(), before);
    server.finish().await;
    let new_noise: Vec<String> = audit_noise().difference(&noise_before).cloned().collect();
    assert!(new_noise.is_empty(), "audit records reached the kernel log: {new_noise:?}");
}

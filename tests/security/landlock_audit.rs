//! Landlock denials as security events (`--landlock-audit on`): the server
//! registers as the host's audit daemon, a refused read inside a sandbox
//! becomes a `landlock` event naming the path, and stopping the server -
//! or starting it again after a crash - puts the host's audit settings
//! back. Its own test binary: enabling audit is host-wide, so it must not
//! overlap another suite's kernel-log checks, and its tests run one at a
//! time.
//!
//! Needs `CAP_AUDIT_CONTROL` in the initial user and pid namespaces; where
//! the host refuses, the tests fail and say so (never pass silently).

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::json;
use tokio::time::{sleep, Instant};
use warren_api::{ExecStatus, SecurityEvent, SecurityEventKind, SecurityEventList};
use warren_guard::audit::{AuditSocket, AuditStatus};
use warren_tests::*;

/// One test at a time: both make the server the host's audit daemon.
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

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// The host's audit state before a test, checked to be one the test can
/// take over: no other daemon running.
fn before() -> AuditStatus {
    let status = audit_status();
    assert!(
        status.pid == 0 || !pid_alive(status.pid),
        "an audit daemon (pid {}) runs on this host: the server would only listen to it; run this test \
         where no audit daemon runs",
        status.pid
    );
    status
}

fn assert_registered(server: &TestServer) {
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
/// are as before it started.
async fn stop_and_assert_restored(server: &mut TestServer, before: &AuditStatus) {
    server.stop().await;
    let after = audit_status();
    let log = || server.log_tail(40);
    assert_eq!(after.enabled, before.enabled, "audit `enabled` was not restored; log:\n{}", log());
    assert_eq!(after.backlog_limit, before.backlog_limit, "the backlog limit was not restored; log:\n{}", log());
    assert_eq!(after.failure, before.failure, "the failure mode changed");
    assert_eq!(after.lost, before.lost, "the kernel lost audit records; log:\n{}", log());
    assert_eq!(after.pid, 0, "a daemon pid is left registered; log:\n{}", log());
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
async fn a_refused_read_becomes_a_landlock_event_and_audit_is_restored() {
    let _one = AUDIT.lock().await;
    let before = before();
    let noise_before = audit_noise();
    let mut server = TestServer::start_with(&["--landlock-audit", "on"]).await;
    assert_registered(&server);
    assert!(server.data_dir().join("landlock-audit.json").is_file(), "the takeover is not written down");

    let id = sandbox_in_rollout(&server).await;
    let r = server.sh(&id, "cat /work/answers/key").await;
    assert_eq!(r.status, ExecStatus::Ok, "{r:?}");
    assert_ne!(r.exit_code, Some(0), "the protected file was readable: {}", stdout(&r));
    assert!(stderr(&r).contains("Permission denied"), "not EACCES: {}", stderr(&r));

    let event = landlock_event(&server, &id, "/work/answers/key").await;
    assert_eq!(event.detail, "fs.read_file /work/answers/key", "{event:?}");
    assert_eq!((event.comm.as_str(), event.syscall.as_str()), ("cat", "openat"), "{event:?}");

    // A refused process that still lives when its records are read is
    // named by its pid inside the sandbox (`cat` above may be gone: pid 0).
    let pid = server.sh_ok(&id, "sh -c 'read x < /work/answers/key; exec sleep 600' >/dev/null 2>&1 & echo $!").await;
    let pid: i32 = pid.trim().parse().expect("the background shell's pid");
    let event = landlock_event_after(&server, &id, "/work/answers/key", event.seq).await;
    assert_eq!((event.comm.as_str(), event.pid), ("sh", pid), "{event:?}");

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
    stop_and_assert_restored(&mut server, &before).await;
    server.finish().await;
    let new_noise: Vec<String> = audit_noise().difference(&noise_before).cloned().collect();
    assert!(new_noise.is_empty(), "audit records reached the kernel log: {new_noise:?}");
}

#[tokio::test]
async fn a_restart_after_a_crash_restores_audit() {
    let _one = AUDIT.lock().await;
    let before = before();
    let mut server = TestServer::start_with(&["--landlock-audit", "on"]).await;
    assert_registered(&server);
    let crashed = server.server_pid();
    server.crash().await;
    // What a crash leaves: audit still enabled; the dead daemon's pid is
    // dropped by the kernel the next time it has a record to send.
    let left = audit_status();
    assert_eq!(left.enabled, 1, "audit was disabled without a clean stop?");
    assert!(left.pid == 0 || Some(left.pid) == crashed, "{left:?}");

    server.launch().await;
    assert_registered(&server);
    stop_and_assert_restored(&mut server, &before).await;
    server.finish().await;
}

/// This test process as the host's audit daemon (as `auditd` would be):
/// registered, audit enabled, every record read and dropped, until stopped.
struct FakeDaemon {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeDaemon {
    fn start(before: &AuditStatus) -> FakeDaemon {
        let mut socket = AuditSocket::open().expect("open an audit socket");
        socket.set_pid(std::process::id()).expect("register the test as the audit daemon");
        if before.enabled == 0 {
            socket.set_enabled(1).expect("enable audit");
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let enabled_before = before.enabled;
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
    let noise_before = audit_noise();
    let daemon = FakeDaemon::start(&before);
    // `auto`: audit is enabled now, so the server reads the read-log group.
    let mut server = TestServer::start_with(&["--landlock-audit", "auto"]).await;
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
    assert!(!server.data_dir().join("landlock-audit.json").exists(), "a listener recorded a takeover");

    daemon.stop();
    let after = audit_status();
    assert_eq!((after.enabled, after.pid, after.backlog_limit), (before.enabled, 0, before.backlog_limit));
    server.finish().await;
    let new_noise: Vec<String> = audit_noise().difference(&noise_before).cloned().collect();
    assert!(new_noise.is_empty(), "audit records reached the kernel log: {new_noise:?}");
}

//! The tamper watch (fanotify): a process that outlived its phase keeps its
//! old Landlock domain, but the node still holds it to the current phase's
//! protected paths - each refused access is `EPERM` and a `tamper` event -
//! while the platform's own file API reads everything, and sandboxes
//! without protected paths cost no mark at all.

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{SandboxInfo, SecurityEvent, SecurityEventKind, SecurityEventList};
use warren_tests::*;

/// `setup` protects nothing; `rollout` hides the answers and makes the
/// reference read-only; `grade` opens the answers again.
fn phases() -> Value {
    json!({
        "setup": {},
        "rollout": {"protected_paths": {"/work/answers": "none", "/work/ref": "read"}},
        "grade": {"protected_paths": {"/work/answers": "read_write", "/work/ref": "read"}},
    })
}

/// A sandbox in `setup` with the answers (a key and a program) and the
/// reference in place, and a background job of `setup` that runs
/// `/tmp/cmd` whenever `/tmp/go` appears (see [`as_kept`]).
async fn sandbox_with_kept_job(server: &TestServer) -> SandboxInfo {
    let sb = server.create(small(json!({"phases": phases(), "phase": "setup"}))).await;
    server
        .sh_ok(
            &sb.id,
            "mkdir -p /work/answers/sub /work/ref && echo secret > /work/answers/key && echo deep > /work/answers/sub/k \
             && cp /bin/true /work/answers/run && echo ref > /work/ref/data",
        )
        .await;
    let job = "while :; do if [ -e /tmp/go ]; then sh /tmp/cmd > /tmp/out 2>&1; echo \"exit=$?\" >> /tmp/out; \
               rm /tmp/go; fi; sleep 0.05; done";
    server.sh_ok(&sb.id, &format!("({job}) >/dev/null 2>&1 &")).await;
    sb
}

/// Runs `command` in the job `setup` left running and returns its output
/// (ending in `exit=<code>`).
async fn as_kept(server: &TestServer, id: &str, command: &str) -> String {
    server.put_file_ok(id, "/tmp/cmd", command.to_string()).await;
    server.sh_ok(id, "touch /tmp/go; while [ -e /tmp/go ]; do sleep 0.05; done; cat /tmp/out").await
}

async fn set_phase(server: &TestServer, id: &str, name: &str, kill_running: bool) {
    let body = json!({"name": name, "kill_running": kill_running});
    let (status, body) = server.call(Method::PUT, &format!("/v1/sandboxes/{id}/phase"), Some(&body)).await;
    assert_eq!(status, StatusCode::OK, "set phase {name}: {body}");
}

async fn tamper_events(server: &TestServer, id: &str) -> Vec<SecurityEvent> {
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/events"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list: SecurityEventList = serde_json::from_value(body).expect("a SecurityEventList");
    list.events.into_iter().filter(|e| e.kind == SecurityEventKind::Tamper).collect()
}

/// The tamper events once each of `wanted` starts one of them: the node
/// answers an access first and records its refusal right after, so a
/// client may read the timeline in between (bounded: fails after 500 looks).
async fn tamper_events_with(server: &TestServer, id: &str, wanted: &[&str]) -> Vec<SecurityEvent> {
    let mut events = Vec::new();
    for _ in 0..500 {
        events = tamper_events(server, id).await;
        if wanted.iter().all(|w| events.iter().any(|e| e.detail.starts_with(w))) {
            return events;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("not all of {wanted:#?} in {events:#?}");
}

fn refused(out: &str) -> bool {
    out.contains("Operation not permitted") && !out.ends_with("exit=0\n")
}

#[tokio::test]
async fn a_process_of_an_earlier_phase_is_held_to_the_current_phases_protected_paths() {
    let server = TestServer::start().await;
    let sb = sandbox_with_kept_job(&server).await;
    assert_eq!(as_kept(&server, &sb.id, "cat /work/answers/key").await, "secret\nexit=0\n", "setup protects nothing");

    set_phase(&server, &sb.id, "rollout", false).await;
    // The new phase's own execs meet Landlock first: EACCES, no tamper event.
    let r = server.sh(&sb.id, "cat /work/answers/key").await;
    assert!(stderr(&r).contains("Permission denied"), "{r:?}");
    assert!(tamper_events(&server, &sb.id).await.is_empty(), "Landlock refused that one");

    // `none`: the kept job can neither read, nor run, what it could in setup.
    let out = as_kept(&server, &sb.id, "cat /work/answers/key").await;
    assert!(refused(&out) && !out.contains("secret"), "{out}");
    let out = as_kept(&server, &sb.id, "cat /work/answers/sub/k").await;
    assert!(refused(&out) && !out.contains("deep"), "{out}");
    let out = as_kept(&server, &sb.id, "/work/answers/run").await;
    assert!(!out.ends_with("exit=0\n"), "{out}");
    // `read`: it reads the reference, but cannot change or truncate it.
    assert_eq!(as_kept(&server, &sb.id, "cat /work/ref/data").await, "ref\nexit=0\n");
    let out = as_kept(&server, &sb.id, "echo forged >> /work/ref/data").await;
    assert!(refused(&out), "{out}");
    let out = as_kept(&server, &sb.id, ": > /work/ref/data").await;
    assert!(refused(&out), "{out}");

    // The platform reads and writes protected files in any phase.
    let (status, body) = server.get_file(&sb.id, "/work/answers/key").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"secret\n"[..]));
    let (status, body) = server.get_file(&sb.id, "/work/ref/data").await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"ref\n"[..]), "the refused writes changed nothing");
    server.put_file_ok(&sb.id, "/work/answers/key", "rotated\n").await;

    let wanted = [
        "open(read) /work/answers/key denied: phase rollout level none",
        "open(read) /work/answers/sub/k denied: phase rollout level none",
        "exec /work/answers/run denied: phase rollout level none",
        "open(write) /work/ref/data denied: phase rollout level read",
    ];
    let events = tamper_events_with(&server, &sb.id, &wanted).await;
    let details: Vec<&str> = events.iter().map(|e| e.detail.as_str()).collect();
    let key = events.iter().find(|e| e.detail.contains("/work/answers/key")).expect("the key's event");
    assert_eq!(key.comm, "cat");
    assert!(key.pid > 0, "the pid inside the sandbox: {key:?}");
    assert!(key.syscall.starts_with("open"), "{key:?}");
    assert!(!details.iter().any(|d| d.contains("/work/ref/data") && d.starts_with("open(read)")), "{details:#?}");

    // `grade` opens the answers to every phase's processes again.
    set_phase(&server, &sb.id, "grade", false).await;
    assert_eq!(as_kept(&server, &sb.id, "cat /work/answers/key").await, "rotated\nexit=0\n");
    let out = as_kept(&server, &sb.id, "echo forged >> /work/ref/data").await;
    assert!(refused(&out), "{out}");
    server.finish().await;
}

/// The fanotify marks the server's node holds now: `fanotify ino:` lines
/// in the fdinfo of its fanotify descriptors.
fn node_marks(server: &TestServer) -> usize {
    let pid = server.server_pid().expect("the server runs");
    let mut marks = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the server's fds") {
        let Ok(entry) = entry else { continue };
        let is_fanotify =
            std::fs::read_link(entry.path()).is_ok_and(|t| t.to_string_lossy() == "anon_inode:[fanotify]");
        if !is_fanotify {
            continue;
        }
        let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", entry.file_name().to_string_lossy()))
            .unwrap_or_default();
        marks += info.lines().filter(|l| l.starts_with("fanotify ino:")).count();
    }
    marks
}

#[tokio::test]
async fn marks_exist_only_while_a_phase_protects_something_and_go_with_the_sandbox() {
    let server = TestServer::start().await;
    let plain = server.create_small().await;
    let sb = sandbox_with_kept_job(&server).await;
    assert_eq!(node_marks(&server), 0, "no protected path at `none` or `read` yet");

    set_phase(&server, &sb.id, "rollout", false).await;
    // /work/answers, /work/answers/sub and /work/ref.
    assert_eq!(node_marks(&server), 3);
    set_phase(&server, &sb.id, "grade", false).await;
    assert_eq!(node_marks(&server), 1, "only /work/ref stays read-only");
    set_phase(&server, &sb.id, "setup", false).await;
    assert_eq!(node_marks(&server), 0);

    set_phase(&server, &sb.id, "rollout", false).await;
    assert_eq!(node_marks(&server), 3);
    server.delete(&sb.id).await;
    assert_eq!(node_marks(&server), 0, "an ended sandbox keeps no mark");
    assert_eq!(server.sh_ok(&plain.id, "echo still").await, "still\n");
    server.finish().await;
}

#[tokio::test]
async fn a_re_adopted_sandbox_is_marked_again_after_a_node_crash() {
    let mut server = TestServer::start().await;
    let sb = sandbox_with_kept_job(&server).await;
    set_phase(&server, &sb.id, "rollout", false).await;
    assert_eq!(node_marks(&server), 3);
    // SIGKILL: the kernel closes the group and drops its marks with it.
    server.restart().await;
    assert_eq!(node_marks(&server), 3, "the new node marks what the phase protects");
    let out = as_kept(&server, &sb.id, "cat /work/answers/key").await;
    assert!(refused(&out) && !out.contains("secret"), "{out}");
    tamper_events_with(&server, &sb.id, &["open(read) /work/answers/key denied: phase rollout level none"]).await;
    server.finish().await;
}

//! Phases: each phase's protected paths hold for root inside the sandbox
//! (Landlock), switching phase changes access live for new execs and by
//! default kills what earlier phases left running, processes of one phase
//! share one Landlock domain (a later exec can kill an earlier one's
//! background job) while nothing in the sandbox can signal init or reach
//! an abstract socket of another domain.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{ErrorCode, ExecStatus, SandboxInfo, SecurityEventKind, SecurityEventList};
use warren_tests::*;

/// `setup` protects nothing, `rollout` hides the answers and makes the
/// reference read-only, `grade` opens the answers again.
fn phases() -> Value {
    json!({
        "setup": {},
        "rollout": {"protected_paths": {"/work/answers": "none", "/work/ref": "read"}},
        "grade": {"protected_paths": {"/work/answers": "read_write", "/work/ref": "read"}},
    })
}

/// A sandbox in `setup` with the answers and the reference in place.
async fn sandbox_with_answers(server: &TestServer) -> SandboxInfo {
    let sb = server.create(small(json!({"phases": phases(), "phase": "setup"}))).await;
    assert_eq!(sb.phase.as_deref(), Some("setup"));
    server
        .sh_ok(
            &sb.id,
            "mkdir -p /work/answers /work/ref && echo secret > /work/answers/key && echo ref > /work/ref/data",
        )
        .await;
    sb
}

async fn try_set_phase(server: &TestServer, id: &str, body: Value) -> (StatusCode, Value) {
    server.call(Method::PUT, &format!("/v1/sandboxes/{id}/phase"), Some(&body)).await
}

async fn set_phase(server: &TestServer, id: &str, name: &str, kill_running: bool) -> SandboxInfo {
    let (status, body) = try_set_phase(server, id, json!({"name": name, "kill_running": kill_running})).await;
    assert_eq!(status, StatusCode::OK, "set phase {name}: {body}");
    let info: SandboxInfo = serde_json::from_value(body).expect("a SandboxInfo");
    assert_eq!(info.phase.as_deref(), Some(name));
    info
}

/// Runs `command` and returns (exit code, stdout + stderr).
async fn run(server: &TestServer, id: &str, command: &str) -> (Option<i32>, String) {
    let r = server.sh(id, command).await;
    assert_eq!(r.status, ExecStatus::Ok, "`{command}`: {r:?}");
    (r.exit_code, format!("{}{}", stdout(&r), stderr(&r)))
}

/// Asserts `command` fails with EACCES.
async fn denied(server: &TestServer, id: &str, command: &str) {
    let (code, out) = run(server, id, command).await;
    assert_ne!(code, Some(0), "`{command}` should fail: {out}");
    assert!(out.contains("Permission denied"), "`{command}` should fail with EACCES: {out}");
}

#[tokio::test]
async fn protected_paths_hold_for_root_and_change_live_with_the_phase() {
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /work/answers/key").await, "secret\n", "setup protects nothing");
    server.sh_ok(&sb.id, "ln /work/answers/key /root/key && rm /root/key").await;

    set_phase(&server, &sb.id, "rollout", true).await;
    assert_eq!(server.sh_ok(&sb.id, "id -u").await, "0\n", "the checks below run as root");
    // `none`: not readable, listable, renamable or linkable.
    denied(&server, &sb.id, "cat /work/answers/key").await;
    denied(&server, &sb.id, "ls /work/answers").await;
    denied(&server, &sb.id, "mv /work/answers /work/elsewhere").await;
    // (/root: the same filesystem, so a refusal is not just EXDEV.)
    denied(&server, &sb.id, "mv /work/answers/key /root/key").await;
    // Landlock refuses a link out of a hidden directory as a reparenting
    // it does not allow (EXDEV); in `setup` the same link worked.
    let (code, out) = run(&server, &sb.id, "ln /work/answers/key /root/key").await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("Invalid cross-device link") || out.contains("Permission denied"), "{out}");
    denied(&server, &sb.id, "ln -s /work/answers/key /root/link && cat /root/link").await;
    denied(&server, &sb.id, "echo forged > /work/answers/key").await;
    // `read`: readable, not writable.
    assert_eq!(server.sh_ok(&sb.id, "cat /work/ref/data").await, "ref\n");
    assert_eq!(server.sh_ok(&sb.id, "ls /work/ref").await, "data\n");
    denied(&server, &sb.id, "echo more >> /work/ref/data").await;
    denied(&server, &sb.id, "touch /work/ref/new").await;
    // Sessions work within a phase (their state reporter is init's own
    // binary, which every phase may execute).
    let session = server.create_session(&sb.id, json!({})).await;
    server.session_exec(&sb.id, &session.id, "cd /tmp && export PHASE=rollout").await;
    let r = server.session_exec(&sb.id, &session.id, "echo $(pwd) $PHASE").await;
    assert_eq!(stdout(&r), "/tmp rollout\n");
    // Everything else stays the agent's.
    assert_eq!(
        server.sh_ok(&sb.id, "echo mine > /tmp/f && cat /tmp/f && mkdir -p /root/x && ls /usr").await.lines().next(),
        Some("mine")
    );

    set_phase(&server, &sb.id, "grade", true).await;
    // `read_write`, for new execs at once.
    assert_eq!(
        server
            .sh_ok(&sb.id, "cat /work/answers/key && echo graded > /work/answers/score && cat /work/answers/score")
            .await,
        "secret\ngraded\n"
    );
    denied(&server, &sb.id, "echo more >> /work/ref/data").await;
    assert_eq!(server.get(&sb.id).await.phase.as_deref(), Some("grade"));
    server.finish().await;
}

#[tokio::test]
async fn a_missing_protected_path_cannot_be_created_during_its_phase() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"phases": phases(), "phase": "rollout"}))).await;
    // /work/answers does not exist in the image: nothing may create it,
    // and /work itself can only gain nothing while it is an ancestor.
    denied(&server, &sb.id, "mkdir /work/answers").await;
    denied(&server, &sb.id, "touch /work/other").await;
    // Its siblings elsewhere stay usable.
    assert_eq!(server.sh_ok(&sb.id, "mkdir -p /tmp/a/b && echo ok").await, "ok\n");
    server.finish().await;
}

#[tokio::test]
async fn kill_running_ends_earlier_phases_and_the_tamper_watch_holds_the_kept_ones() {
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    // A background job of `setup` that reads the answers when asked to:
    // it lives on in `rollout` only with kill_running=false, and then it
    // still has the Landlock domain of `setup`, but the node's tamper
    // watch holds it to `rollout`'s protected paths (EPERM, not EACCES).
    let reader = "while :; do if [ -e /tmp/go ]; then cat /work/answers/key > /tmp/leak 2>&1; rm /tmp/go; fi; \
                  sleep 0.05; done";
    let pid = server.sh_ok(&sb.id, &format!("({reader}) >/dev/null 2>&1 & echo $!")).await.trim().to_string();

    set_phase(&server, &sb.id, "rollout", false).await;
    assert_eq!(server.sh_ok(&sb.id, &format!("[ -d /proc/{pid} ] && echo alive")).await, "alive\n");
    denied(&server, &sb.id, "cat /work/answers/key").await;
    let leaked = server.sh_ok(&sb.id, "touch /tmp/go; while [ -e /tmp/go ]; do sleep 0.05; done; cat /tmp/leak").await;
    assert!(
        leaked.contains("Operation not permitted") && !leaked.contains("secret"),
        "the tamper watch refuses the kept process: {leaked}"
    );
    // It is in another domain: the new phase cannot signal it.
    let (code, out) = run(&server, &sb.id, &format!("kill -9 {pid}")).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("Operation not permitted") || out.contains("not permitted"), "{out}");

    // The default: nothing of earlier phases survives the switch.
    let info = set_phase(&server, &sb.id, "grade", true).await;
    assert_eq!(info.phase.as_deref(), Some("grade"));
    assert_eq!(server.sh_ok(&sb.id, &format!("[ -d /proc/{pid} ] && echo alive || echo gone")).await, "gone\n");
    let (_, ps) = run(&server, &sb.id, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").await;
    assert!(!ps.contains("/tmp/go"), "a process of an earlier phase survived: {ps}");
    server.finish().await;
}

#[tokio::test]
async fn a_background_job_can_be_killed_by_a_later_exec_of_the_same_phase() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"phases": phases(), "phase": "rollout"}))).await;
    let pid = server.sh_ok(&sb.id, "sleep 1000 >/dev/null 2>&1 & echo $!").await.trim().to_string();
    assert_eq!(server.sh_ok(&sb.id, &format!("[ -d /proc/{pid} ] && echo alive")).await, "alive\n");
    server.sh_ok(&sb.id, &format!("kill -9 {pid}")).await;
    assert_eq!(
        server.sh_ok(&sb.id, &format!("while [ -d /proc/{pid} ]; do sleep 0.05; done; echo gone")).await,
        "gone\n"
    );
    server.finish().await;
}

/// The abstract-socket helper, built once per test binary.
fn abstract_helper() -> &'static PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| static_c_helper("functional/phases/abstract.c", env!("CARGO_TARGET_TMPDIR")))
}

#[tokio::test]
async fn sandbox_processes_cannot_signal_init_nor_reach_another_domains_abstract_socket() {
    let helper = std::fs::read(abstract_helper()).expect("read the helper");
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    let (status, body) = server.put_file(&sb.id, "/tmp/abstract", helper, Some("0755")).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // init cannot be signalled, and lives on.
    let (code, out) = run(&server, &sb.id, "kill -9 1").await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("not permitted"), "{out}");
    assert_eq!(server.sh_ok(&sb.id, "echo still here").await, "still here\n");

    // A listener of `setup`: reachable from its own phase ...
    server
        .sh_ok(
            &sb.id,
            "/tmp/abstract listen warren-test > /tmp/listener.out 2>&1 & \
                         while ! grep -q listening /tmp/listener.out; do sleep 0.05; done",
        )
        .await;
    assert_eq!(server.sh_ok(&sb.id, "/tmp/abstract connect warren-test").await, "connected\n");
    // ... but not from a later phase's domain, although it still runs.
    set_phase(&server, &sb.id, "rollout", false).await;
    let (code, out) = run(&server, &sb.id, "/tmp/abstract connect warren-test").await;
    assert_eq!((code, out.as_str()), (Some(1), "error: Operation not permitted\n"));
    let listeners = "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = abstract ] && echo $p; done | wc -l";
    assert_eq!(server.sh_ok(&sb.id, listeners).await.trim(), "1", "the listener still runs");
    server.finish().await;
}

#[tokio::test]
async fn the_phase_survives_a_server_restart() {
    let mut server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    set_phase(&server, &sb.id, "rollout", true).await;
    server.restart().await;
    assert_eq!(server.get(&sb.id).await.phase.as_deref(), Some("rollout"));
    denied(&server, &sb.id, "cat /work/answers/key").await;
    // And the re-adopted sandbox can still switch.
    set_phase(&server, &sb.id, "grade", true).await;
    assert_eq!(server.sh_ok(&sb.id, "cat /work/answers/key").await, "secret\n");
    server.finish().await;
}

#[tokio::test]
async fn bad_phase_input_names_the_field() {
    let server = TestServer::start().await;
    let (status, body) = server.try_create(&small(json!({"phases": phases()}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phase"));
    let (status, body) = server.try_create(&small(json!({"phases": phases(), "phase": "nope"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phase"));
    let bad_path = json!({"x": {"protected_paths": {"/proc/1": "none"}}});
    let (status, body) = server.try_create(&small(json!({"phases": bad_path, "phase": "x"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phases.x.protected_paths./proc/1"));

    let sb = server.create(small(json!({"phases": phases(), "phase": "setup"}))).await;
    let (status, body) = try_set_phase(&server, &sb.id, json!({"name": "nope"})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("name"));
    let (status, body) = try_set_phase(&server, &sb.id, json!({"name": "grade", "extra": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let plain = server.create_small().await;
    let (status, body) = try_set_phase(&server, &plain.id, json!({"name": "setup"})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("name"));
    assert_eq!(server.get(&sb.id).await.phase.as_deref(), Some("setup"), "a refused switch changes nothing");

    // A ruleset init cannot build (a symlink on the way to a protected
    // path) is refused naming the phase's paths; the old phase stays.
    let linked = json!({"setup": {}, "linked": {"protected_paths": {"/lnk/secret": "none"}}});
    let sb = server.create(small(json!({"phases": linked, "phase": "setup"}))).await;
    server.sh_ok(&sb.id, "mkdir /tmp/real && echo s > /tmp/real/secret && ln -s /tmp/real /lnk").await;
    let (status, body) = try_set_phase(&server, &sb.id, json!({"name": "linked"})).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phases.linked.protected_paths"));
    assert!(body["message"].as_str().is_some_and(|m| m.contains("/lnk")), "{body}");
    assert_eq!(server.get(&sb.id).await.phase.as_deref(), Some("setup"));
    assert_eq!(server.sh_ok(&sb.id, "cat /lnk/secret").await, "s\n");
    // The same at create, for the initial phase (busybox's /bin/sh is a
    // symlink): refused, and nothing is left behind.
    let at_create = json!({"x": {"protected_paths": {"/bin/sh": "none"}}});
    let (status, body) = server.try_create(&small(json!({"phases": at_create, "phase": "x"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phases.x.protected_paths"));
    server.finish().await;
}

#[tokio::test]
async fn phase_changes_appear_in_the_event_timeline() {
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    server.sh_ok(&sb.id, "sleep 1000 >/dev/null 2>&1 &").await;
    set_phase(&server, &sb.id, "rollout", true).await;
    set_phase(&server, &sb.id, "grade", false).await;
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{}/events", sb.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let list: SecurityEventList = serde_json::from_value(body).expect("a SecurityEventList");
    let changes: Vec<&str> =
        list.events.iter().filter(|e| e.kind == SecurityEventKind::PhaseChanged).map(|e| e.detail.as_str()).collect();
    assert_eq!(changes.len(), 2, "{list:?}");
    assert!(changes[0].starts_with("setup -> rollout; killed "), "{changes:?}");
    assert!(!changes[0].starts_with("setup -> rollout; killed 0 "), "the sleep was killed: {changes:?}");
    assert!(changes[1].starts_with("rollout -> grade; processes of earlier phases keep running"), "{changes:?}");
    assert_eq!(list.counts[&SecurityEventKind::PhaseChanged], 2);
    server.finish().await;
}

/// The pid `find` prints once it prints exactly one: a killed leader is
/// still seen, until it has exited and been reaped, for a moment after the
/// exec that killed it answered (a retired one is not: a phase switch
/// waits for it).
async fn the_only_leader(server: &TestServer, id: &str, find: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let found = server.sh_ok(id, find).await.trim().to_string();
        if !found.is_empty() && !found.contains('\n') {
            return found;
        }
        assert!(tokio::time::Instant::now() < deadline, "one leader: {found:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Host pids of the sandbox's phase leaders, zombies included: the
/// children of its PID 1 named `phase-leader`.
fn leaders_seen_from_the_host(instance: &str, id: &str) -> Vec<i32> {
    let pid1 = sandbox_pid1(instance, id).expect("the sandbox's PID 1");
    leaks::children_named(pid1, "phase-leader")
}

/// A switch answers once the old phase's leader has exited and been
/// reaped: right after the answer the sandbox has exactly one leader, the
/// new phase's. A leader that cannot exit on its closed channel (stopped
/// from the host here, which makes the check independent of timing) is
/// killed, and the switch still answers with one leader.
#[tokio::test]
async fn a_phase_switch_answers_once_the_old_leader_is_gone() {
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    let mut before = leaders_seen_from_the_host(&server.instance, &sb.id);
    assert_eq!(before.len(), 1, "one leader after the create: {before:?}");
    let switches = [("rollout", true, false), ("grade", false, true), ("rollout", false, false), ("grade", true, true)];
    for (name, kill_running, stop_old_leader) in switches {
        if stop_old_leader {
            let pid = rustix::process::Pid::from_raw(before[0]).expect("a leader pid");
            rustix::process::kill_process(pid, rustix::process::Signal::STOP).expect("stop the old leader");
        }
        set_phase(&server, &sb.id, name, kill_running).await;
        let after = leaders_seen_from_the_host(&server.instance, &sb.id);
        assert_eq!(after.len(), 1, "one leader right after the switch to {name}: {after:?}");
        assert_ne!(after, before, "the switch to {name} started a new leader");
        before = after;
    }
    server.finish().await;
}

#[tokio::test]
async fn a_killed_phase_leader_is_replaced_and_the_phase_still_holds() {
    let server = TestServer::start().await;
    let sb = sandbox_with_answers(&server).await;
    set_phase(&server, &sb.id, "rollout", true).await;
    // The leader shares the phase's domain, so the phase may kill it; it
    // only costs its own sandbox a new leader with the same rules.
    let find = "for p in /proc/[0-9]*; do \
                [ \"$(cat $p/comm 2>/dev/null)\" = phase-leader ] && echo ${p#/proc/}; done; true";
    // Several times: the exec that kills its leader at once must itself
    // run and report, since PID 1 learns its pid before it can run.
    let mut leader = the_only_leader(&server, &sb.id, find).await;
    for _ in 0..3 {
        let out = server.sh_ok(&sb.id, &format!("kill -9 {leader} && echo killed")).await;
        assert_eq!(out, "killed\n");
        let replaced = the_only_leader(&server, &sb.id, find).await;
        assert_ne!(replaced, leader, "a new leader");
        leader = replaced;
    }
    denied(&server, &sb.id, "cat /work/answers/key").await;
    server.finish().await;
}

/// A phase switch whose client hangs up midway still completes: the
/// sandbox's record names the new phase, its protected paths hold, the
/// switch is in the event timeline, and the node counts the call as
/// abandoned. (Dropped at one of its awaits, the switch used to stop
/// there: init in the new phase, the record, the event and the phase's
/// egress policy never following.) Rounds repeat until a close lands
/// while the switch runs; one that lands before the call starts leaves
/// the sandbox in `setup`, and the round starts over on a new sandbox.
#[tokio::test]
async fn a_phase_switch_whose_caller_goes_away_still_completes() {
    let server = TestServer::start().await;
    let mut round = 0;
    loop {
        round += 1;
        assert!(round <= 20, "in 20 rounds no close landed while the switch ran");
        let sb = sandbox_with_answers(&server).await;
        // Processes the switch kills make it, and so the window, longer.
        server.sh_ok(&sb.id, "for i in 1 2 3 4 5 6 7 8; do sleep 600 >/dev/null 2>&1 & done").await;
        let body = json!({"name": "rollout", "kill_running": true});
        server.abandon(Method::PUT, &format!("/v1/sandboxes/{}/phase", sb.id), Some(&body)).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
        let mut info = server.get(&sb.id).await;
        while info.phase.as_deref() != Some("rollout") && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            info = server.get(&sb.id).await;
        }
        let abandoned = server.abandoned_calls("phase").await;
        if info.phase.as_deref() != Some("rollout") {
            assert_eq!(abandoned, 0.0, "round {round}: the abandoned switch left {info:?}");
            server.delete(&sb.id).await;
            continue;
        }
        denied(&server, &sb.id, "cat /work/answers/key").await;
        let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{}/events", sb.id), None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let list: SecurityEventList = serde_json::from_value(body).expect("a SecurityEventList");
        assert_eq!(list.counts.get(&SecurityEventKind::PhaseChanged), Some(&1), "round {round}: {list:?}");
        server.delete(&sb.id).await;
        if abandoned > 0.0 {
            break;
        }
    }
    server.finish().await;
}

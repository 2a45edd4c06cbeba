//! Sandbox lifecycle over HTTP: create, get, list, delete, idempotency,
//! input validation, and the idle and lifetime reapers.

use std::collections::BTreeSet;
use std::time::Duration;

use futures_util::future::join_all;
use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_api::{EndReason, ErrorCode, ExecRequest, ExecStatus, SandboxInfo, SandboxState, StreamName};
use warren_tests::api::json_response;
use warren_tests::*;

/// Generous bound for a reaper to act on a 1-2 s timeout.
const REAPER_WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn create_get_list_and_delete_ends_with_deleted() {
    let server = TestServer::start().await;
    let tag = unique_marker("tag");
    let a = server.create(small(json!({"labels": {"suite": "lifecycle", "tag": tag}}))).await;
    let b = server.create(small(json!({"labels": {"suite": "lifecycle", "tag": "other"}}))).await;
    assert_ne!(a.id, b.id);
    assert_eq!((a.image.as_str(), a.resources.memory_mib, a.resources.disk_mib), (IMAGE, 128, 64));

    let got = server.get(&a.id).await;
    assert_eq!((got.id.as_str(), got.state), (a.id.as_str(), SandboxState::Running));
    assert_eq!(got.labels.get("tag"), Some(&tag));

    let tagged: Vec<String> = server.list(Some(&format!("tag={tag}"))).await.into_iter().map(|s| s.id).collect();
    assert_eq!(tagged, vec![a.id.clone()], "the label filter selects exactly the labelled sandbox");
    let suite: BTreeSet<String> = server.list(Some("suite=lifecycle")).await.into_iter().map(|s| s.id).collect();
    assert_eq!(suite, BTreeSet::from([a.id.clone(), b.id.clone()]));

    let deleted = server.delete(&a.id).await;
    assert_eq!((deleted.state, deleted.end_reason), (SandboxState::Ended, Some(EndReason::Deleted)));
    assert!(deleted.ended_at_ms.is_some(), "an ended sandbox says when: {deleted:?}");
    let after = server.get(&a.id).await;
    assert_eq!((after.state, after.end_reason), (SandboxState::Ended, Some(EndReason::Deleted)));
    let again = server.delete(&a.id).await;
    assert_eq!(again.end_reason, Some(EndReason::Deleted), "deleting twice answers with the same end");

    let (status, body) = server.try_exec_wait(&a.id, &json!({"command": "true"})).await;
    assert_api_error(status, &body, ErrorCode::SandboxEnded, None);
    assert_eq!(server.get(&b.id).await.state, SandboxState::Running, "deleting one sandbox leaves the other");
    server.finish().await;
}

#[tokio::test]
async fn ended_sandboxes_are_forgotten_after_the_retention() {
    let server = TestServer::start_with(&["--ended-retention-secs", "1"]).await;
    let key = unique_marker("key");
    let req = small(json!({"idempotency_key": key}));
    let (status, body) = server.try_create(&req).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let id = body["id"].as_str().expect("an id").to_string();
    let ran = server.exec_wait(&id, &ExecRequest { argv: Some(vec!["true".into()]), ..Default::default() }).await;
    let exec_id = ran.exec_id.clone();
    server.delete(&id).await;
    // Kept (and answered) right after the end ...
    assert_eq!(server.get_exec(&id, &exec_id).await.exec_id, exec_id);
    // ... and gone once the retention has passed: record, exec and key.
    let deadline = std::time::Instant::now() + REAPER_WAIT;
    loop {
        let (status, _) = server.try_get(&id).await;
        if status == StatusCode::NOT_FOUND {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{id} is still kept after {REAPER_WAIT:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, _) = server.call(Method::GET, &format!("/v1/sandboxes/{id}/exec/{exec_id}"), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "the exec result went with its sandbox");
    let (status, body) = server.try_create(&req).await;
    assert_eq!(status, StatusCode::CREATED, "the forgotten key makes a new sandbox: {body}");
    assert_ne!(body["id"].as_str(), Some(id.as_str()));
    server.finish().await;
}

#[tokio::test]
async fn same_idempotency_key_answers_with_the_same_sandbox() {
    let server = TestServer::start().await;
    let key = unique_marker("key");
    let req = small(json!({"idempotency_key": key}));
    let (first, body1) = server.try_create(&req).await;
    let (second, body2) = server.try_create(&req).await;
    assert_eq!((first, second), (StatusCode::CREATED, StatusCode::OK), "{body1} / {body2}");
    assert_eq!(body1["id"], body2["id"]);

    let different = small(json!({"idempotency_key": key, "memory_mib": 256}));
    let (status, body) = server.try_create(&different).await;
    assert_api_error(status, &body, ErrorCode::IdempotencyConflict, Some("idempotency_key"));
    assert_eq!(server.list(None).await.len(), 1, "no second sandbox was made");
    server.finish().await;
}

#[tokio::test]
async fn concurrent_creates_with_one_key_make_one_sandbox() {
    let server = TestServer::start().await;
    let req = small(json!({"idempotency_key": unique_marker("race")}));
    let answers = join_all((0..8).map(|_| server.try_create(&req))).await;
    let made = answers.iter().filter(|(s, _)| *s == StatusCode::CREATED).count();
    let replayed = answers.iter().filter(|(s, _)| *s == StatusCode::OK).count();
    assert_eq!((made, replayed), (1, 7), "exactly one create makes the sandbox: {answers:?}");
    let ids: BTreeSet<String> = answers.iter().map(|(_, b)| b["id"].as_str().unwrap_or_default().to_string()).collect();
    assert_eq!(ids.len(), 1, "every answer names the same sandbox: {ids:?}");
    for (_, body) in &answers {
        assert_eq!(body["state"], "running", "a replayed answer waits for the create to finish: {body}");
    }
    assert_eq!(server.list(None).await.len(), 1);
    server.finish().await;
}

#[tokio::test]
async fn unsupported_backends_answer_501_naming_backend() {
    // This host runs every backend: the server is told not to offer two.
    let server = TestServer::start_with(&["--disable-backend", "microvm", "--disable-backend", "vm"]).await;
    for backend in ["microvm", "vm"] {
        let (status, body) = server.try_create(&small(json!({"backend": backend}))).await;
        assert_api_error(status, &body, ErrorCode::UnsupportedBackend, Some("backend"));
    }
    assert!(server.list(None).await.is_empty());
    server.finish().await;
}

#[tokio::test]
async fn bad_create_input_is_rejected_naming_the_field() {
    let server = TestServer::start().await;
    let cases = [
        (small(json!({"bogus": 1})), "bogus"),
        (small(json!({"cpus": 0})), "cpus"),
        (small(json!({"cpus": "two"})), "cpus"),
        (small(json!({"memory_mib": 1u64 << 40})), "memory_mib"),
        (small(json!({"pids": 1})), "pids"),
        (small(json!({"env": {"BAD=NAME": "x"}})), "env.BAD=NAME"),
        (small(json!({"env": {"": "x"}})), "env."),
        (small(json!({"network": "host"})), "network"),
        (small(json!({"image": "no-such-image"})), "image"),
        (small(json!({"idle_timeout_secs": 0})), "idle_timeout_secs"),
    ];
    let mut wrong = Vec::new();
    for (req, field) in &cases {
        let (status, body) = server.try_create(req).await;
        wrong.extend(api_error_mismatch(status, &body, ErrorCode::InvalidRequest, Some(field)));
    }
    assert!(wrong.is_empty(), "rejections that do not name the field:\n{}", wrong.join("\n"));

    let malformed = server
        .http
        .post(format!("{}/v1/sandboxes", server.url))
        .header("content-type", "application/json")
        .body("{\"image\": \"busybox\",");
    let resp = api::send(malformed).await;
    let content_type = resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let (status, body) = json_response(resp).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, None);
    assert!(content_type.starts_with("application/json"), "errors are JSON, got {content_type}");

    assert!(server.list(None).await.is_empty(), "no rejected request made a sandbox");
    server.finish().await;
}

#[tokio::test]
async fn unknown_sandbox_and_route_answer_404_json() {
    let server = TestServer::start().await;
    let (status, body) = server.try_get("sb-0000000000000000").await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let (status, body) = server.try_exec_wait("sb-0000000000000000", &json!({"command": "true"})).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let (status, body) = server.call(Method::GET, "/v1/no-such-route", None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    server.finish().await;
}

#[tokio::test]
async fn idle_sandbox_ends_with_idle_timeout() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"idle_timeout_secs": 1}))).await;
    let ended = server.wait_ended(&sb.id, REAPER_WAIT).await;
    assert_eq!(ended.end_reason, Some(EndReason::IdleTimeout), "{ended:?}");
    server.finish().await;
}

#[tokio::test]
async fn busy_sandbox_ends_at_its_lifetime() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"lifetime_secs": 2, "idle_timeout_secs": 600}))).await;
    let mut stream = server.exec_open(&sb.id, &ExecRequest::argv(["sleep", "1000"])).await;
    let exec_id = stream.exec_id().await;
    let ended = server.wait_ended(&sb.id, REAPER_WAIT).await;
    assert_eq!(ended.end_reason, Some(EndReason::Lifetime), "{ended:?}");
    let frames = stream.collect().await;
    let result = end_result(&frames);
    assert_eq!((result.exec_id.as_str(), result.status), (exec_id.as_str(), ExecStatus::Killed));
    server.finish().await;
}

#[tokio::test]
async fn running_exec_keeps_an_idle_sandbox_alive() {
    let server = TestServer::start().await;
    let sb: SandboxInfo = server.create(small(json!({"idle_timeout_secs": 1}))).await;
    // Runs for four idle timeouts; only the exec keeps the sandbox busy.
    let frames = server.exec_stream(&sb.id, &ExecRequest::shell("sleep 4; echo done")).await;
    let result = end_result(&frames);
    assert_eq!((result.status, result.exit_code), (ExecStatus::Ok, Some(0)), "{result:?}");
    assert_eq!(frame_bytes(&frames, StreamName::Stdout), b"done\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running, "the sandbox outlived its idle timeout");
    let ended = server.wait_ended(&sb.id, REAPER_WAIT).await;
    assert_eq!(ended.end_reason, Some(EndReason::IdleTimeout), "idle again after the exec: {ended:?}");
    server.finish().await;
}

/// A data dir below a directory the sandboxes' unprivileged uids cannot
/// search (what `mktemp -d` makes) would fail every create with an internal
/// error; the server refuses it at start instead, naming the directory and
/// the fix, and leaves nothing behind.
#[test]
fn serve_refuses_a_data_dir_the_sandboxes_cannot_reach() {
    use std::os::unix::fs::PermissionsExt;
    let closed = tempfile::Builder::new().prefix("warren-closed-").tempdir().expect("make a temp dir");
    std::fs::set_permissions(closed.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod 0700");
    let data_dir = closed.path().join("data");
    let instance = format!("closed-{}", std::process::id());
    let log = closed.path().join("serve.log");
    let mut child = std::process::Command::new(warren_binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--instance", &instance, "--destroy-on-exit", "--data-dir"])
        .arg(&data_dir)
        .stdin(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("create the log"))
        .spawn()
        .expect("run warren serve");
    // A server that starts anyway would run until stopped: give it a while
    // to refuse, then stop it and fail.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for warren serve") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("a valid pid");
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.is_some_and(|s| !s.success()), "warren serve started on an unreachable data dir; log:\n{stderr}");
    let named = format!("{} has mode 700", closed.path().display());
    assert!(stderr.contains(&named) && stderr.contains("chmod o+x"), "the refusal does not say why: {stderr}");
    assert!(leaks::instance_cgroup_dirs(&instance).is_empty(), "the refused server made cgroups");
}

/// Sandboxes whose PID 1 stopped answering hold up no other sandbox: their
/// probes wait out their pings in tasks of their own, beside the reaper's
/// lifetime and idle checks. (Probed one after another, twelve silent
/// sandboxes made every probe round wait 12 x the 2 s ping, and a sandbox
/// whose lifetime ran out in that round ended up to 24 s late.)
#[tokio::test]
async fn silent_sandboxes_do_not_delay_another_sandboxs_end() {
    use rustix::process::{kill_process, Pid, Signal};
    const SILENT: usize = 12;
    let server = TestServer::start().await;
    let mut silent = Vec::new();
    for _ in 0..SILENT {
        let sb = server.create_small().await;
        let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox has a PID 1");
        silent.push((sb.id, Pid::from_raw(pid1).expect("a valid pid")));
    }
    for (_, pid) in &silent {
        kill_process(*pid, Signal::STOP).expect("stop a sandbox's PID 1");
    }
    // Every silent sandbox has been probed at least once (one after another
    // this takes 12 pings' timeouts); well within the 30 s grace.
    let missed = |server: &TestServer| server.log_tail(400).matches("init did not answer a ping").count();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while missed(&server) < SILENT {
        assert!(tokio::time::Instant::now() < deadline, "probes missed too few pings; log:\n{}", server.log_tail(40));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let sb = server.create(small(json!({"lifetime_secs": 2, "idle_timeout_secs": 600}))).await;
    let ended = server.wait_ended(&sb.id, REAPER_WAIT).await;
    for (_, pid) in &silent {
        kill_process(*pid, Signal::CONT).expect("resume a sandbox's PID 1");
    }
    assert_eq!(ended.end_reason, Some(EndReason::Lifetime), "{ended:?}");
    // The server's own clock, so the test's polling adds nothing. The reaper
    // looks every 250 ms; one silent round would be 24 s.
    let late_ms = ended.ended_at_ms.unwrap_or(u64::MAX).saturating_sub(ended.created_at_ms + 2_000);
    assert!(late_ms < 6_000, "the lifetime end came {late_ms} ms late behind the silent sandboxes' probes");
    for (id, _) in &silent {
        let info = server.delete(id).await;
        assert_eq!(info.end_reason, Some(EndReason::Deleted), "a silent sandbox was ended by the reaper: {info:?}");
    }
    server.finish().await;
}

/// A PID 1 that stops answering (stopped from the host here) is not taken
/// for dead at its first missed ping - a TCG guest on a loaded host misses
/// some and then answers - but one that stays silent is ended `init_died`,
/// saying why.
#[tokio::test]
async fn a_silent_init_is_ended_only_when_it_stays_silent() {
    use rustix::process::{kill_process, Pid, Signal};
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox has a PID 1");
    let pid = Pid::from_raw(pid1).expect("a valid pid");
    let missed = |server: &TestServer| server.log_tail(400).matches("init did not answer a ping").count();

    kill_process(pid, Signal::STOP).expect("stop the sandbox's PID 1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while missed(&server) < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no probe missed its ping; log:\n{}", server.log_tail(40));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = server.get(&sb.id).await;
    assert_eq!(info.state, SandboxState::Running, "ended at a missed ping: {info:?}");
    kill_process(pid, Signal::CONT).expect("resume the sandbox's PID 1");
    assert_eq!(server.sh_ok(&sb.id, "echo still here").await, "still here\n");

    kill_process(pid, Signal::STOP).expect("stop the sandbox's PID 1 again");
    let info = server.wait_ended(&sb.id, Duration::from_secs(120)).await;
    assert_eq!(info.end_reason, Some(EndReason::InitDied), "{info:?}");
    let message = info.end_message.unwrap_or_default();
    assert!(message.contains("answered no ping"), "the end does not say init went silent: {message}");
    assert!(sandbox_pids(&server.instance, &sb.id).is_empty(), "the silent sandbox's processes outlived its end");
    server.finish().await;
}

#[tokio::test]
async fn a_create_past_the_create_timeout_answers_timed_out_and_leaves_nothing() {
    // A create takes milliseconds, so one of 1-4 ms is dropped at whatever
    // step it has reached; every such step must be swept.
    let server = TestServer::start_with(&["--create-timeout-ms", "1"]).await;
    let server_pid = server.server_pid().expect("the server runs") as i32;
    for round in 0..6 {
        let (status, body) = server.try_create(&small(json!({"labels": {"round": round.to_string()}}))).await;
        assert_api_error(status, &body, ErrorCode::TimedOut, None);
        assert_eq!(status.as_u16(), 504, "{body}");
    }
    let mut leaks = warren_tests::leaks::Leaks::scan(&server.data_dir(), &server.instance);
    // The server's own mount of its run directory stays while it runs.
    leaks.mounts.retain(|m| *m != server.data_dir().join("run"));
    assert!(leaks.is_empty(), "abandoned creates left behind, with the server still up:\n{leaks}");
    // With no sandbox alive the server's only child is the init zygote,
    // and that has none.
    let children = |pid| warren_tests::leaks::children_of(pid).into_iter().map(|p| p.pid).collect::<Vec<_>>();
    for child in children(server_pid) {
        let command = warren_tests::leaks::cmdline(child);
        assert!(command.contains("--zygote"), "the server still has child {child}: {command}");
        assert_eq!(children(child), Vec::<i32>::new(), "the zygote still has children");
    }
    let ended = server.list(None).await;
    assert_eq!(ended.len(), 6, "each abandoned create keeps a record: {ended:?}");
    for sb in &ended {
        assert_eq!((sb.state, sb.end_reason), (SandboxState::Ended, Some(EndReason::CreateFailed)), "{sb:?}");
    }
    server.finish().await;
}

const DELETED_ENDS: &str = r#"warren_sandbox_ends_total{backend="container",reason="deleted"}"#;

/// A delete whose client hangs up midway still ends the sandbox: it ends
/// `deleted`, nothing of it runs, its running exec is recorded killed, its
/// end is counted once, and the node counts the call as abandoned. (Dropped
/// at one of its awaits, the end used to stop there: the sandbox out of
/// the node's live map, the rest of its end - the count, a microVM's
/// teardown - never done.) Rounds repeat until a close lands while the
/// delete runs; one that lands before the call starts leaves the sandbox
/// running, and it is deleted the ordinary way.
#[tokio::test]
async fn a_delete_whose_caller_goes_away_still_ends_the_sandbox() {
    let server = TestServer::start().await;
    let mut round = 0;
    while server.abandoned_calls("delete").await == 0.0 {
        round += 1;
        assert!(round <= 20, "in 20 rounds no close landed while the delete ran");
        let sb = server.create_small().await;
        // Processes to kill make the teardown, and so the window, longer.
        server.sh_ok(&sb.id, "for i in 1 2 3 4 5 6 7 8; do sleep 600 >/dev/null 2>&1 & done").await;
        let mut running = server.exec_open(&sb.id, &ExecRequest::argv(["sleep", "600"])).await;
        let exec_id = running.exec_id().await;
        let ends_before = server.scrape().await.get(DELETED_ENDS);
        server.abandon(Method::DELETE, &format!("/v1/sandboxes/{}", sb.id), None).await;
        let info = server.poll_ended(&sb.id, Duration::from_secs(3)).await;
        if info.state != SandboxState::Ended {
            let abandoned = server.abandoned_calls("delete").await;
            assert_eq!(abandoned, 0.0, "round {round}: the abandoned delete left {info:?}");
            server.delete(&sb.id).await;
            continue;
        }
        assert_eq!(info.end_reason, Some(EndReason::Deleted), "round {round}: {info:?}");
        // The end's record is committed beside the teardown, not after it.
        let ended = tokio::time::Instant::now();
        while !sandbox_pids(&server.instance, &sb.id).is_empty() && ended.elapsed() < REAPER_WAIT {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(sandbox_pids(&server.instance, &sb.id).is_empty(), "round {round}: the deleted sandbox runs on");
        let exec = server.wait_exec(&sb.id, &exec_id, REAPER_WAIT).await;
        assert_eq!(exec.status, ExecStatus::Killed, "round {round}: the exec the delete ended: {exec:?}");
        let ends = server.scrape().await.get(DELETED_ENDS) - ends_before;
        assert_eq!(ends, 1.0, "round {round}: the delete's end is counted once");
    }
    server.finish().await;
}

/// A create whose client goes away midway leaves nothing half-done: the
/// sandbox ends `create_failed`, saying why, nothing of it runs, and a
/// retry with its idempotency key makes a new sandbox instead of waiting
/// on the abandoned one. No sandbox is left `creating`. (A close can also
/// land before the call starts, or after it finished: those rounds are
/// retried, the finished sandbox deleted.)
#[tokio::test]
async fn a_create_whose_caller_goes_away_ends_create_failed_and_frees_its_key() {
    let server = TestServer::start().await;
    for keyed in [false, true] {
        let mut abandoned = None;
        for round in 0..10 {
            let label = unique_marker("abandoned");
            let key = format!("{label}-key");
            let mut body = small(json!({"labels": {"round": label}}));
            if keyed {
                body["idempotency_key"] = json!(key);
            }
            server.abandon(Method::POST, "/v1/sandboxes", Some(&body)).await;
            // The call is over once its record is ended or running, or
            // there is none a while after the close.
            let closed = tokio::time::Instant::now();
            let settled = loop {
                let listed = server.list(Some(&format!("round={label}"))).await;
                match listed.as_slice() {
                    [sb] if matches!(sb.state, SandboxState::Ended | SandboxState::Running) => break Some(sb.clone()),
                    [] if closed.elapsed() > Duration::from_secs(2) => break None,
                    [] | [_] => {}
                    many => panic!("one create listed as {many:?}"),
                }
                assert!(closed.elapsed() < REAPER_WAIT, "round {round}: the create is still {listed:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            match settled {
                Some(sb) if sb.state == SandboxState::Running => {
                    server.delete(&sb.id).await;
                }
                Some(sb) => {
                    abandoned = Some((sb, body));
                    break;
                }
                None => {
                    if keyed {
                        // Dropped before anything was made: the key is free.
                        let made = server.create(body.clone()).await;
                        server.delete(&made.id).await;
                    }
                }
            }
        }
        let (sb, body) = abandoned.expect("in 10 rounds no close landed while the sandbox was made");
        assert!(server.abandoned_calls("create").await >= 1.0, "the abandoned create is not counted");
        assert_eq!(sb.end_reason, Some(EndReason::CreateFailed), "{sb:?}");
        assert!(sb.end_message.as_deref().is_some_and(|m| m.contains("abandoned")), "{sb:?}");
        assert!(sandbox_pids(&server.instance, &sb.id).is_empty(), "the abandoned sandbox runs on");
        if keyed {
            let again = server.create(body).await;
            assert_ne!(again.id, sb.id, "the key still names the abandoned sandbox");
            assert_eq!(again.state, SandboxState::Running);
            server.delete(&again.id).await;
        }
    }
    server.finish().await;
}

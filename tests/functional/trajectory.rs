//! The trajectory log: every mutating call is a step; a re-issued step is
//! answered from the log (never run twice), a running one is joined, a
//! different request at a logged step is refused; the log lists the steps,
//! survives a server restart and the sandbox's deletion, and replays in a
//! fresh sandbox.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};
use warren_api::{
    ErrorCode, ExecFrame, ExecRequest, ExecResult, ExecStatus, ReplayOutcome, ReplayReport, StepKind, StepState,
    StreamName, Trajectory,
};
use warren_tests::*;

const WAIT: Duration = Duration::from_secs(60);

/// The server's answer to a call: status, the step it was logged as, body.
struct Answer {
    status: StatusCode,
    step: Option<u64>,
    body: bytes::Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn frames(&self) -> Vec<ExecFrame> {
        self.body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| {
                serde_json::from_slice(l).unwrap_or_else(|e| panic!("bad frame {:?}: {e}", String::from_utf8_lossy(l)))
            })
            .collect()
    }
}

async fn call(
    server: &TestServer,
    method: Method,
    path: &str,
    query: &[(&str, &str)],
    step: Option<u64>,
    body: Option<reqwest::Body>,
) -> Answer {
    let mut rb = server.http.request(method, format!("{}{path}", server.url)).query(query);
    if let Some(step) = step {
        rb = rb.header("Warren-Step", step.to_string());
    }
    if let Some(body) = body {
        rb = rb.header("content-type", "application/json").body(body);
    }
    let resp = api::send(rb).await;
    let status = resp.status();
    let step = resp.headers().get("warren-step").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
    let body = resp.bytes().await.expect("read the body");
    Answer { status, step, body }
}

async fn exec_step(server: &TestServer, id: &str, step: Option<u64>, command: &str) -> Answer {
    let body = json!({ "command": command }).to_string();
    call(server, Method::POST, &format!("/v1/sandboxes/{id}/exec"), &[], step, Some(body.into())).await
}

async fn upload_step(server: &TestServer, id: &str, step: Option<u64>, path: &str, content: &str) -> Answer {
    let files = format!("/v1/sandboxes/{id}/files");
    call(server, Method::PUT, &files, &[("path", path)], step, Some(content.to_string().into())).await
}

async fn trajectory(server: &TestServer, id: &str) -> (StatusCode, Value) {
    server.call(Method::GET, &format!("/v1/sandboxes/{id}/trajectory"), None).await
}

async fn trajectory_ok(server: &TestServer, id: &str) -> Trajectory {
    let (status, body) = trajectory(server, id).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body.clone()).unwrap_or_else(|e| panic!("trajectory {body}: {e}"))
}

/// How many times the counter file was appended to.
async fn runs(server: &TestServer, id: &str, counter: &str) -> usize {
    let r = server.sh(id, &format!("cat {counter} 2>/dev/null")).await;
    stdout(&r).lines().count()
}

#[tokio::test]
async fn reissued_exec_step_is_answered_from_the_log_without_running() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    // More output than fits in the log entry: it comes back from the data file.
    let command = "echo run >> /tmp/count; echo hello; head -c 100000 /dev/zero | tr '\\0' a >&2";
    let first = exec_step(&server, &sb.id, Some(1), command).await;
    assert_eq!((first.status, first.step), (StatusCode::OK, Some(1)), "{:?}", first.body);
    let first_frames = first.frames();
    let first_result = end_result(&first_frames).clone();
    assert_eq!(first_result.exit_code, Some(0), "{first_result:?}");

    let again = exec_step(&server, &sb.id, Some(1), command).await;
    assert_eq!((again.status, again.step), (StatusCode::OK, Some(1)));
    let frames = again.frames();
    match frames.first() {
        Some(ExecFrame::Started { exec_id }) => assert_eq!(exec_id, &first_result.exec_id, "the logged exec"),
        other => panic!("a fast-forwarded stream starts with `started`, got {other:?}"),
    }
    assert_eq!(frame_bytes(&frames, StreamName::Stdout), b"hello\n");
    assert_eq!(frame_bytes(&frames, StreamName::Stderr), vec![b'a'; 100000]);
    assert_eq!(end_result(&frames).exit_code, Some(0));

    let wait = call(
        &server,
        Method::POST,
        &format!("/v1/sandboxes/{}/exec", sb.id),
        &[("wait", "true")],
        Some(1),
        Some(json!({ "command": command }).to_string().into()),
    )
    .await;
    let waited: ExecResult = serde_json::from_value(wait.json()).expect("an ExecResult");
    assert_eq!((waited.exec_id.as_str(), stdout(&waited)), (first_result.exec_id.as_str(), "hello\n"));

    assert_eq!(runs(&server, &sb.id, "/tmp/count").await, 1, "a re-issued step ran again");
    server.finish().await;
}

#[tokio::test]
async fn step_running_elsewhere_is_joined_not_run_twice() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let gate = "/tmp/gate";
    let command = format!("echo run >> /tmp/count; while [ ! -e {gate} ]; do sleep 0.05; done; echo done");
    let (first, second) = tokio::join!(exec_step(&server, &sb.id, Some(7), &command), async {
        // The second call goes out once the first is running for sure.
        let deadline = Instant::now() + WAIT;
        while runs(&server, &sb.id, "/tmp/count").await == 0 {
            assert!(Instant::now() < deadline, "the first call never started");
            sleep(Duration::from_millis(20)).await;
        }
        let touch = format!("touch {gate}");
        let (joined, _) = tokio::join!(exec_step(&server, &sb.id, Some(7), &command), server.sh(&sb.id, &touch));
        joined
    });
    let (a, b) = (first.frames(), second.frames());
    assert_eq!(end_result(&a).exec_id, end_result(&b).exec_id, "both calls answer with the one exec");
    assert_eq!(frame_bytes(&b, StreamName::Stdout), b"done\n");
    assert_eq!(runs(&server, &sb.id, "/tmp/count").await, 1);
    server.finish().await;
}

#[tokio::test]
async fn different_request_at_a_logged_step_is_refused_as_diverged() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    assert_eq!(exec_step(&server, &sb.id, Some(1), "echo one").await.status, StatusCode::OK);
    let refused = exec_step(&server, &sb.id, Some(1), "echo two").await;
    let body = refused.json();
    assert_api_error(refused.status, &body, ErrorCode::TrajectoryDiverged, Some("Warren-Step"));
    let logged = trajectory_ok(&server, &sb.id).await;
    assert_eq!(body["divergence"]["step"], 1);
    assert_eq!(body["divergence"]["expected"], logged.steps[0].request_hash.as_str());
    assert_ne!(body["divergence"]["got"], body["divergence"]["expected"]);

    // An upload's hash covers its content; the refused one changes nothing.
    assert_eq!(upload_step(&server, &sb.id, Some(2), "/tmp/f", "v1").await.status, StatusCode::OK);
    let refused = upload_step(&server, &sb.id, Some(2), "/tmp/f", "v2").await;
    assert_api_error(refused.status, &refused.json(), ErrorCode::TrajectoryDiverged, Some("Warren-Step"));
    assert_eq!(server.get_file(&sb.id, "/tmp/f").await.1.as_ref(), b"v1");
    // The same upload again is answered from the log: the file is not rewritten.
    server.sh_ok(&sb.id, "echo changed > /tmp/f").await;
    let again = upload_step(&server, &sb.id, Some(2), "/tmp/f", "v1").await;
    assert_eq!((again.status, again.step), (StatusCode::OK, Some(2)), "{:?}", again.body);
    assert_eq!(again.json()["size_bytes"], 2);
    assert_eq!(server.get_file(&sb.id, "/tmp/f").await.1.as_ref(), b"changed\n");

    for bad in ["0", "x", "9007199254740992"] {
        let rb = server.http.post(format!("{}/v1/sandboxes/{}/exec", server.url, sb.id)).header("Warren-Step", bad);
        let (status, body) = api::json_response(api::send(rb.json(&json!({ "command": "true" }))).await).await;
        assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("Warren-Step"));
    }
    server.finish().await;
}

#[tokio::test]
async fn log_lists_every_mutating_call_and_survives_restart_and_deletion() {
    let mut server = TestServer::start_with(&["--ended-retention-secs", "1"]).await;
    let sb = server.create(small(json!({ "env": { "TASK": "t1" } }))).await;
    let id = sb.id.clone();
    let base = format!("/v1/sandboxes/{id}");
    let mkdir = json!({ "path": "/job" }).to_string();
    let made = call(&server, Method::POST, &format!("{base}/files/mkdir"), &[], Some(1), Some(mkdir.into())).await;
    assert_eq!(made.status, StatusCode::CREATED);
    assert_eq!(upload_step(&server, &id, Some(2), "/job/a.txt", "alpha").await.status, StatusCode::OK);
    assert_eq!(exec_step(&server, &id, Some(3), "cat /job/a.txt").await.status, StatusCode::OK);
    let session = call(&server, Method::POST, &format!("{base}/sessions"), &[], Some(4), Some("{}".into())).await;
    let sid = session.json()["id"].as_str().expect("a session id").to_string();
    let body = json!({ "command": "cd /job && export X=1" }).to_string();
    let ran =
        call(&server, Method::POST, &format!("{base}/sessions/{sid}/exec"), &[], Some(5), Some(body.into())).await;
    assert_eq!(ran.status, StatusCode::OK);
    let files = format!("{base}/files");
    let removed = call(&server, Method::DELETE, &files, &[("path", "/job/a.txt")], Some(6), None).await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);
    // No step given: the server assigns the next one.
    let mut unstepped = server.exec_open(&id, &ExecRequest::shell("echo run >> /tmp/count; sleep 4321")).await;
    unstepped.exec_id().await;
    drop(unstepped);
    find_instance_process(&server.instance, "sleep 4321", WAIT).await;

    let log = trajectory_ok(&server, &id).await;
    let kinds: Vec<StepKind> = log.steps.iter().map(|s| s.kind).collect();
    use StepKind::*;
    assert_eq!(kinds, [Mkdir, FileWrite, Exec, SessionCreate, SessionExec, FileRemove, Exec]);
    assert_eq!(log.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7]);
    assert!(!log.steps[6].client_step && log.steps[..6].iter().all(|s| s.client_step));
    assert_eq!(log.steps[6].state, StepState::Running);
    let upload = &log.steps[1].request;
    assert_eq!(upload["size_bytes"], 5);
    assert!(upload["sha256"].as_str().is_some_and(|h| h.starts_with("sha256:")), "{upload}");
    assert!(!upload.to_string().contains("alpha"), "the log holds the upload's bytes: {upload}");
    let cat = log.steps[2].result.as_ref().expect("a result");
    assert_eq!((cat.status, cat.exit_code, cat.stdout_bytes), (Some(ExecStatus::Ok), Some(0), Some(5)));
    assert_eq!((log.origin.image.as_str(), log.origin.env.get("TASK").map(String::as_str)), (IMAGE, Some("t1")));

    // What a crash mid-upload would leave: swept at the next start, while
    // the kept bytes of the logged upload stay.
    let data = server.data_dir().join("trajectory");
    let kept: Vec<_> = std::fs::read_dir(data.join(&id)).expect("the sandbox's data").flatten().collect();
    assert_eq!(kept.len(), 1, "one kept upload");
    std::fs::write(data.join(&id).join(".tmp-stray"), b"half").expect("a stray temp file");
    std::fs::create_dir_all(data.join("sb-without-log")).expect("a stray dir");

    // The log is persistent: after a crash the cut exec's step is done
    // (killed), and logged steps still fast-forward.
    server.restart().await;
    assert!(!data.join(&id).join(".tmp-stray").exists() && !data.join("sb-without-log").exists());
    assert!(kept[0].path().exists(), "the kept upload went");
    let log = trajectory_ok(&server, &id).await;
    let cut = &log.steps[6];
    assert_eq!(cut.state, StepState::Done, "{cut:?}");
    assert_eq!(cut.result.as_ref().and_then(|r| r.status), Some(ExecStatus::Killed));
    let again = exec_step(&server, &id, Some(3), "cat /job/a.txt").await;
    assert_eq!(frame_bytes(&again.frames(), StreamName::Stdout), b"alpha", "answered from the log after a restart");
    let cut_again = exec_step(&server, &id, Some(7), "echo run >> /tmp/count; sleep 4321").await;
    assert_eq!(end_result(&cut_again.frames()).status, ExecStatus::Killed);
    assert_eq!(runs(&server, &id, "/tmp/count").await, 1);
    // (The checks above are unstepped execs: they are logged too.)
    let logged = trajectory_ok(&server, &id).await.steps.len() as u64;
    let next = exec_step(&server, &id, None, "true").await;
    assert_eq!(next.step, Some(logged + 1), "server-assigned steps continue after the log");

    // Deleted, and its record forgotten after the retention: the log stays.
    server.delete(&id).await;
    let deadline = Instant::now() + WAIT;
    while server.try_get(&id).await.0 != StatusCode::NOT_FOUND {
        assert!(Instant::now() < deadline, "the ended sandbox's record was never forgotten");
        sleep(Duration::from_millis(200)).await;
    }
    let kept = trajectory_ok(&server, &id).await;
    assert_eq!(kept.steps.len() as u64, logged + 1);
    assert!(kept.ended_at_ms.is_some());
    server.finish().await;
}

#[tokio::test]
async fn log_is_forgotten_after_the_trajectory_retention() {
    let server = TestServer::start_with(&["--ended-retention-secs", "1", "--trajectory-retention-secs", "1"]).await;
    let sb = server.create_small().await;
    assert_eq!(exec_step(&server, &sb.id, Some(1), "true").await.status, StatusCode::OK);
    assert_eq!(upload_step(&server, &sb.id, Some(2), "/tmp/x", "kept for replay").await.status, StatusCode::OK);
    let data = server.data_dir().join("trajectory").join(&sb.id);
    assert!(data.is_dir(), "the upload is kept under {}", data.display());
    server.delete(&sb.id).await;
    let deadline = Instant::now() + WAIT;
    while trajectory(&server, &sb.id).await.0 != StatusCode::NOT_FOUND {
        assert!(Instant::now() < deadline, "the trajectory outlived its retention");
        sleep(Duration::from_millis(200)).await;
    }
    assert!(!data.exists(), "its data files stayed");
    server.finish().await;
}

/// While the data directory's filesystem is below `--disk-reserve-percent`
/// (here 100: never met on a filesystem that holds anything), ended
/// sandboxes are forgotten whole long before their retention (an hour and
/// a day by default): record, exec results, trajectory and its data files.
/// A live sandbox keeps all of its own. With the check off (0, as below
/// any real reserve) nothing ended is forgotten early.
#[tokio::test]
async fn ended_sandboxes_are_forgotten_early_while_the_disk_is_below_its_reserve() {
    let mut server = TestServer::start_with(&["--disk-reserve-percent", "100"]).await;
    let live = server.create_small().await;
    let ended = server.create_small().await;
    // 100 KiB: the output is kept in a data file of the trajectory.
    let print = "head -c 102400 /dev/zero | tr '\\0' x";
    let mut execs = Vec::new();
    for id in [&live.id, &ended.id] {
        let answer = exec_step(&server, id, Some(1), print).await;
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
        execs.push(end_result(&answer.frames()).exec_id.clone());
    }
    server.delete(&ended.id).await;
    let deadline = Instant::now() + WAIT;
    while server.try_get(&ended.id).await.0 != StatusCode::NOT_FOUND {
        assert!(Instant::now() < deadline, "the ended sandbox was kept; log:\n{}", server.log_tail(30));
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(trajectory(&server, &ended.id).await.0, StatusCode::NOT_FOUND);
    let (status, _) = server.call(Method::GET, &format!("/v1/sandboxes/{}/exec/{}", ended.id, execs[1]), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(data_files(&server, &ended.id), 0, "its data files stayed");
    let log = server.log_tail(200);
    assert!(log.contains("forgot the longest-ended sandboxes early"), "the log does not say why:\n{log}");
    assert!(log.contains("no ended sandbox is left to forget"), "nor that the disk stays low:\n{log}");

    assert_eq!(server.get(&live.id).await.state, warren_api::SandboxState::Running);
    assert_eq!(trajectory_ok(&server, &live.id).await.steps.len(), 1);
    assert_eq!(server.get_exec(&live.id, &execs[0]).await.output.map(|o| o.stdout.total_bytes), Some(102400));
    assert_eq!(data_files(&server, &live.id), 1);

    // Off: an ended sandbox stays (its retention is an hour).
    server.restart_with(&["--disk-reserve-percent", "0"]).await;
    server.delete(&live.id).await;
    sleep(Duration::from_secs(2)).await;
    assert_eq!(server.get(&live.id).await.end_reason, Some(warren_api::EndReason::Deleted));
    assert_eq!(data_files(&server, &live.id), 1);
    server.finish().await;
}

#[tokio::test]
async fn replay_reruns_the_steps_in_a_fresh_sandbox_and_reports_each() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let id = sb.id.clone();
    let mkdir = json!({ "path": "/job" }).to_string();
    call(&server, Method::POST, &format!("/v1/sandboxes/{id}/files/mkdir"), &[], Some(1), Some(mkdir.into())).await;
    upload_step(&server, &id, Some(2), "/job/fix.txt", "patched\n").await;
    exec_step(&server, &id, Some(3), "cat /job/fix.txt; exit 3").await;
    // Different in every run: the replay must report it.
    exec_step(&server, &id, Some(4), "cat /proc/sys/kernel/random/uuid").await;

    let (status, body) =
        server.call(Method::POST, &format!("/v1/sandboxes/{id}/trajectory/replay"), Some(&json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let report: ReplayReport = serde_json::from_value(body.clone()).expect("a replay report");
    let outcomes: Vec<ReplayOutcome> = report.steps.iter().map(|s| s.outcome).collect();
    use ReplayOutcome::*;
    assert_eq!(outcomes, [Match, Match, Match, Mismatch], "{body}");
    assert_eq!(report.steps[3].differences, ["stdout_sha256"]);
    assert_eq!(report.steps[2].result.as_ref().and_then(|r| r.exit_code), Some(3));
    assert!(!report.matched);
    assert_ne!(report.sandbox_id, id);
    assert_eq!(server.get(&report.sandbox_id).await.state, warren_api::SandboxState::Ended, "not kept");
    // The replay logged its own trajectory.
    assert_eq!(trajectory_ok(&server, &report.sandbox_id).await.steps.len(), 4);
    server.finish().await;
}

/// Files in the sandbox's trajectory data directory (kept outputs and
/// uploads).
fn data_files(server: &TestServer, id: &str) -> usize {
    std::fs::read_dir(server.data_dir().join("trajectory").join(id)).map_or(0, |d| d.count())
}

/// A sandbox keeps its newest finished outputs up to the node's budget
/// (here 1 MiB): the oldest exec's output is dropped from its result
/// (`output_expired`) and from its step (`output_ref: expired`, the data
/// file gone), its status and exit stay, a re-issued step answers without
/// it; the ledger is rebuilt after a restart. Without the budget every
/// exec's output stays on the node's disk however many there are.
#[tokio::test]
async fn a_sandbox_keeps_only_its_newest_outputs_up_to_the_budget() {
    let mut server = TestServer::start_with(&["--exec-output-retention-mib", "1"]).await;
    let sb = server.create_small().await;
    // 400 KiB each, of a different byte (one data file each).
    let print = |c: char| format!("head -c 409600 /dev/zero | tr '\\0' {c}; exit 7");
    let mut execs = Vec::new();
    for (n, c) in ['a', 'b', 'c', 'd'].into_iter().enumerate() {
        let answer = exec_step(&server, &sb.id, Some(n as u64 + 1), &print(c)).await;
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
        execs.push(end_result(&answer.frames()).exec_id.clone());
    }
    // An exec's answer ends before its record is committed (and the older
    // outputs dropped after it), and the records of execs run one after
    // the other may be committed in another order.
    wait_expired(&server, &sb.id, &execs[0]).await;
    wait_expired(&server, &sb.id, &execs[1]).await;
    for (n, exec_id) in execs.iter().enumerate() {
        let r = server.get_exec(&sb.id, exec_id).await;
        assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(7)), "exec {n}: {r:?}");
        // a, b, c: 1.2 MiB > 1 MiB drops a; d drops b.
        let expired = n < 2;
        assert_eq!(r.output_expired, expired, "exec {n}");
        assert_eq!(r.output.map(|o| o.stdout.total_bytes), (!expired).then_some(409600), "exec {n}");
    }
    let log = trajectory_ok(&server, &sb.id).await;
    let refs: Vec<Option<String>> =
        log.steps.iter().map(|s| s.result.as_ref().and_then(|r| r.output_ref.clone())).collect();
    assert_eq!(refs[..2], [Some("expired".to_string()), Some("expired".to_string())], "{refs:?}");
    assert!(refs[2..].iter().all(|r| r.as_deref().is_some_and(|r| r.starts_with("sha256:"))), "{refs:?}");
    assert_eq!(data_files(&server, &sb.id), 2, "the dropped outputs' data files are removed");
    // The step is still logged: re-issued, it answers from the log, without output.
    let again = exec_step(&server, &sb.id, Some(1), &print('a')).await;
    let frames = again.frames();
    assert!(frames.iter().all(|f| !matches!(f, ExecFrame::Output { .. })), "{frames:?}");
    assert!(end_result(&frames).output_expired && end_result(&frames).exit_code == Some(7), "{frames:?}");

    // After a restart the ledger comes back from the store: the next
    // output drops c's.
    server.restart().await;
    let answer = exec_step(&server, &sb.id, Some(5), &print('e')).await;
    assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    wait_expired(&server, &sb.id, &execs[2]).await;
    assert!(!server.get_exec(&sb.id, &execs[3]).await.output_expired);
    assert_eq!(data_files(&server, &sb.id), 2);
    server.finish().await;
}

/// Waits (bounded) until the exec's output is dropped.
async fn wait_expired(server: &TestServer, id: &str, exec_id: &str) {
    let deadline = Instant::now() + WAIT;
    while !server.get_exec(id, exec_id).await.output_expired {
        assert!(Instant::now() < deadline, "{exec_id}'s output was not dropped; log:\n{}", server.log_tail(30));
        sleep(Duration::from_millis(50)).await;
    }
}

/// Uploads a sandbox's trajectory keeps for replay are bounded too (here
/// 1 MiB, each distinct content once): an upload past the budget is logged
/// by its digest only and a replay skips it; the count is rebuilt from the
/// log after a restart. Without the bound, every version of every file a
/// harness writes would stay on the node's disk for the log's retention.
#[tokio::test]
async fn a_sandbox_keeps_uploads_for_replay_only_up_to_the_budget() {
    let mut server = TestServer::start_with(&["--upload-retention-mib", "1"]).await;
    let sb = server.create_small().await;
    let id = sb.id.clone();
    let content = |c: char| c.to_string().repeat(400 << 10);
    for (step, path, c) in [(1, "/tmp/a", 'a'), (2, "/tmp/a-again", 'a'), (3, "/tmp/b", 'b')] {
        let answer = upload_step(&server, &id, Some(step), path, &content(c)).await;
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    }
    // a and b: 800 KiB. After a restart, c would make 1.2 MiB: not kept;
    // a fourth copy of a costs nothing and is.
    server.restart().await;
    for (step, path, c) in [(4, "/tmp/c", 'c'), (5, "/tmp/a-third", 'a')] {
        let answer = upload_step(&server, &id, Some(step), path, &content(c)).await;
        assert_eq!(answer.status, StatusCode::OK, "{:?}", answer.body);
    }
    assert_eq!(data_files(&server, &id), 2, "a and b kept, c not");
    // Every upload took effect in the sandbox, whatever was kept of it.
    let sizes = server.sh(&id, "wc -c < /tmp/c; wc -c < /tmp/a-third").await;
    assert_eq!(stdout(&sizes).split_whitespace().collect::<Vec<_>>(), ["409600", "409600"]);

    let (status, body) =
        server.call(Method::POST, &format!("/v1/sandboxes/{id}/trajectory/replay"), Some(&json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let report: ReplayReport = serde_json::from_value(body.clone()).expect("a replay report");
    let outcomes: Vec<ReplayOutcome> = report.steps.iter().map(|s| s.outcome).collect();
    use ReplayOutcome::*;
    // Step 6, the check above, is logged too: in the replay /tmp/c is missing.
    assert_eq!(outcomes, [Match, Match, Match, Skipped, Match, Mismatch], "{body}");
    let why = report.steps[3].message.as_deref().unwrap_or_default();
    assert!(why.contains("upload budget"), "{why}");
    server.finish().await;
}

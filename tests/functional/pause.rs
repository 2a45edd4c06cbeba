//! Pause and resume of container sandboxes: a paused sandbox's processes
//! make no progress; the next exec resumes it; delete and a server restart
//! work while it is paused; the idle timeout does not run while paused.
//!
//! Progress is watched from the host, without a request that would resume
//! the sandbox: a counter loop in the sandbox writes its count to a file of
//! the writable layer, which the host reads under the sandbox's run dir.

use std::path::PathBuf;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};
use warren_api::{EndReason, ErrorCode, ExecRequest, SandboxInfo, SandboxState};
use warren_tests::*;

const WAIT: Duration = Duration::from_secs(30);
/// How long a paused sandbox is watched for progress it must not make.
const WATCH: Duration = Duration::from_millis(1500);

const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; done";

async fn pause(server: &TestServer, id: &str) -> SandboxInfo {
    let (status, body) = server.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(status, StatusCode::OK, "pause {id}: {body}");
    let info: SandboxInfo = serde_json::from_value(body).expect("a SandboxInfo");
    assert_eq!(info.state, SandboxState::Paused, "{info:?}");
    info
}

async fn resume(server: &TestServer, id: &str) -> SandboxInfo {
    let (status, body) = server.call(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None).await;
    assert_eq!(status, StatusCode::OK, "resume {id}: {body}");
    serde_json::from_value(body).expect("a SandboxInfo")
}

/// The counter file as the host sees it in the sandbox's writable layer.
fn counter_path(server: &TestServer, id: &str) -> PathBuf {
    server.data_dir().join("run").join(id).join("rw/upper/tmp/count")
}

fn read_count(path: &PathBuf) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Waits (bounded) until the counter moves past `after`.
async fn count_moves_past(path: &PathBuf, after: u64) -> u64 {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(n) = read_count(path).filter(|n| *n > after) {
            return n;
        }
        assert!(Instant::now() < deadline, "the counter at {} did not move past {after}", path.display());
        sleep(Duration::from_millis(20)).await;
    }
}

/// Starts the counter loop (streaming exec, left running) and waits until it counts.
async fn start_counter(server: &TestServer, id: &str) -> (FrameReader, PathBuf) {
    let stream = server.exec_open(id, &ExecRequest::shell(COUNTER)).await;
    let path = counter_path(server, id);
    count_moves_past(&path, 0).await;
    (stream, path)
}

/// The counter stays where it is while paused, as does the sandbox's CPU time.
/// Returns the count it stopped at (0 when it was frozen between the
/// shell's truncate and write of the file).
async fn assert_frozen(server: &TestServer, id: &str, path: &PathBuf) -> u64 {
    let read = || std::fs::read_to_string(path).expect("the counter file");
    let before = read();
    let cpu_before = server.get(id).await.usage.expect("usage").cpu_time_secs;
    sleep(WATCH).await;
    assert_eq!(read(), before, "the counter advanced while paused");
    let cpu_after = server.get(id).await.usage.expect("usage").cpu_time_secs;
    assert_eq!(cpu_before, cpu_after, "the sandbox used CPU while paused");
    before.trim().parse().unwrap_or(0)
}

#[tokio::test]
async fn paused_sandbox_makes_no_progress_until_resumed() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let (_stream, path) = start_counter(&server, &sb.id).await;

    pause(&server, &sb.id).await;
    // GET and list do not resume it.
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Paused);
    let frozen_at = assert_frozen(&server, &sb.id, &path).await;
    let paused = server.call(Method::GET, "/v1/sandboxes?state=paused", None).await.1;
    assert_eq!(paused["sandboxes"][0]["id"], json!(sb.id), "{paused}");
    // Pausing twice is fine and changes nothing.
    pause(&server, &sb.id).await;

    let info = resume(&server, &sb.id).await;
    assert_eq!(info.state, SandboxState::Running, "{info:?}");
    count_moves_past(&path, frozen_at).await;
    server.finish().await;
}

#[tokio::test]
async fn exec_on_a_paused_sandbox_resumes_it() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let (_stream, path) = start_counter(&server, &sb.id).await;
    pause(&server, &sb.id).await;
    let frozen_at = assert_frozen(&server, &sb.id, &path).await;

    assert_eq!(server.sh_ok(&sb.id, "echo awake").await, "awake\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    count_moves_past(&path, frozen_at).await;

    // A file call resumes it too.
    pause(&server, &sb.id).await;
    server.put_file_ok(&sb.id, "/tmp/note", "hi").await;
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    server.finish().await;
}

#[tokio::test]
async fn deleting_a_paused_sandbox_leaves_nothing_behind() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let (_stream, _path) = start_counter(&server, &sb.id).await;
    pause(&server, &sb.id).await;

    let ended = server.delete(&sb.id).await;
    assert_eq!((ended.state, ended.end_reason), (SandboxState::Ended, Some(EndReason::Deleted)), "{ended:?}");
    assert!(sandbox_pids(&server.instance, &sb.id).is_empty(), "processes of the deleted sandbox live on");
    // An ended sandbox cannot be paused or resumed.
    let (status, body) = server.call(Method::POST, &format!("/v1/sandboxes/{}/resume", sb.id), None).await;
    assert_api_error(status, &body, ErrorCode::SandboxEnded, None);
    let (status, body) = server.call(Method::POST, "/v1/sandboxes/sb-nosuch/pause", None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    server.finish().await;
}

#[tokio::test]
async fn paused_sandbox_is_readopted_paused_after_a_restart() {
    let mut server = TestServer::start().await;
    let sb = server.create_small().await;
    let (stream, path) = start_counter(&server, &sb.id).await;
    drop(stream);
    pause(&server, &sb.id).await;

    server.restart().await;

    assert_eq!(server.get(&sb.id).await.state, SandboxState::Paused, "re-adopted as it was");
    assert_frozen(&server, &sb.id, &path).await;
    assert_eq!(server.sh_ok(&sb.id, "echo back").await, "back\n");
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    server.finish().await;
}

#[tokio::test]
async fn idle_timeout_does_not_run_while_paused_and_lifetime_does() {
    let server = TestServer::start().await;
    let idle = server.create(small(json!({"idle_timeout_secs": 2}))).await;
    pause(&server, &idle.id).await;
    let short = server.create(small(json!({"lifetime_secs": 3}))).await;
    pause(&server, &short.id).await;

    // The lifetime ends a paused sandbox like any other.
    let ended = server.wait_ended(&short.id, WAIT).await;
    assert_eq!(ended.end_reason, Some(EndReason::Lifetime), "{ended:?}");
    // By then the idle sandbox has been idle past its timeout, and lives on paused.
    assert_eq!(server.get(&idle.id).await.state, SandboxState::Paused);

    resume(&server, &idle.id).await;
    let ended = server.wait_ended(&idle.id, WAIT).await;
    assert_eq!(ended.end_reason, Some(EndReason::IdleTimeout), "{ended:?}");
    server.finish().await;
}

#[tokio::test]
async fn paused_memory_counts_as_reclaimable_in_the_books() {
    let server = TestServer::start_with(&["--max-memory-mib", "256"]).await;
    let a = server.create(small(json!({"memory_mib": 128}))).await;
    let _b = server.create(small(json!({"memory_mib": 128}))).await;
    let (status, body) = server.try_create(&small(json!({"memory_mib": 128}))).await;
    assert_api_error(status, &body, ErrorCode::CapacityExceeded, None);

    pause(&server, &a.id).await;
    let books: Value = server.call(Method::GET, "/v1/capacity", None).await.1;
    assert_eq!(
        (&books["sandboxes_paused"], &books["memory_mib_reclaimable"], &books["memory_mib_committed"]),
        (&json!(1), &json!(128), &json!(128)),
        "{books}"
    );
    // The paused sandbox's memory makes room for a new one.
    server.create(small(json!({"memory_mib": 128}))).await;
    server.finish().await;
}

#[tokio::test]
async fn cli_pauses_and_resumes_sandboxes() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let run = |verb: &str| {
        let out = std::process::Command::new(warren_binary())
            .args(["--url", &server.url, "sandbox", verb, &sb.id])
            .output()
            .expect("run the warren CLI");
        assert!(out.status.success(), "warren sandbox {verb}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(run("pause").contains("paused"));
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Paused);
    assert!(run("resume").contains("running"));
    assert_eq!(server.get(&sb.id).await.state, SandboxState::Running);
    server.finish().await;
}

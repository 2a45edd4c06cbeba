//! Server restarts: a SIGKILLed server's sandboxes are re-adopted by the
//! next start on the same data dir; what died meanwhile ends with
//! `node_restarted`; a create cut short leaves nothing behind.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::json;
use warren_api::{EndReason, ExecRequest, ExecStatus, SandboxState};
use warren_tests::leaks::Leaks;
use warren_tests::*;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn running_sandbox_is_readopted_after_a_crash() {
    let mut server = TestServer::start().await;
    let sb = server.create_small().await;
    server.put_file_ok(&sb.id, "/work/keep.txt", "survives").await;
    server.sh_ok(&sb.id, "echo from-exec > /tmp/exec.txt").await;
    let session = server.create_session(&sb.id, json!({})).await;
    server.session_exec(&sb.id, &session.id, "cd /tmp && export KEPT=yes").await;
    let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox has a PID 1");

    server.restart().await;

    let info = server.get(&sb.id).await;
    assert_eq!(info.state, SandboxState::Running, "{info:?}");
    assert_eq!(sandbox_pid1(&server.instance, &sb.id), Some(pid1), "the same PID 1 carries on");
    assert_eq!(server.sh_ok(&sb.id, "cat /work/keep.txt /tmp/exec.txt").await, "survivesfrom-exec\n");
    let (status, body) = server.get_file(&sb.id, "/work/keep.txt").await;
    assert_eq!((status, body.as_ref()), (StatusCode::OK, b"survives".as_ref()));
    let r = server.session_exec(&sb.id, &session.id, "echo \"$PWD $KEPT\"").await;
    assert_eq!(stdout(&r), "/tmp yes\n", "the session's state survived the restart");
    server.finish().await;
}

#[tokio::test]
async fn exec_cut_by_a_crash_is_recorded_killed_and_gone() {
    let mut server = TestServer::start().await;
    let sb = server.create_small().await;
    let mut stream = server.exec_open(&sb.id, &ExecRequest::argv(["sleep", "4321"])).await;
    let exec_id = stream.exec_id().await;
    find_instance_process(&server.instance, "sleep 4321", WAIT).await;
    drop(stream);

    server.restart().await;

    let r = server.get_exec(&sb.id, &exec_id).await;
    assert_eq!(r.status, ExecStatus::Killed, "{r:?}");
    let ps = server.exec_wait(&sb.id, &ExecRequest::argv(["ps", "-o", "pid,args"])).await;
    assert!(!stdout(&ps).contains("sleep 4321"), "an exec reported killed still runs:\n{}", stdout(&ps));
    server.finish().await;
}

#[tokio::test]
async fn sandbox_whose_init_died_while_down_ends_node_restarted() {
    let mut server = TestServer::start().await;
    let dead = server.create_small().await;
    let alive = server.create_small().await;
    let pid1 = sandbox_pid1(&server.instance, &dead.id).expect("the sandbox has a PID 1");

    server.crash().await;
    let pid = rustix::process::Pid::from_raw(pid1).expect("a valid pid");
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill the sandbox's PID 1");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !leaks::is_zombie(pid1) {
        assert!(tokio::time::Instant::now() < deadline, "PID 1 {pid1} survived SIGKILL");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.launch().await;

    let info = server.get(&dead.id).await;
    assert_eq!((info.state, info.end_reason), (SandboxState::Ended, Some(EndReason::NodeRestarted)), "{info:?}");
    assert!(sandbox_pids(&server.instance, &dead.id).is_empty(), "nothing of the dead sandbox runs");
    assert_eq!(server.get(&alive.id).await.state, SandboxState::Running, "its neighbour was re-adopted");
    assert_eq!(server.sh_ok(&alive.id, "echo ok").await, "ok\n");
    server.finish().await;
}

/// A fresh create's record is committed while the sandbox is made, before
/// the driver's handle exists, so a `running` record may hold none (until a
/// later commit of it). The next start rebuilds the handle from what the
/// driver keeps in the run directory and re-adopts the sandbox - here with
/// the record's handle removed by hand while the server is down, whatever
/// it held. Without the rebuild the sandbox would end `node_restarted`.
#[tokio::test]
async fn running_sandbox_whose_record_has_no_handle_is_readopted() {
    let mut server = TestServer::start().await;
    let sb = server.create_small().await;
    server.sh_ok(&sb.id, "echo kept > /tmp/kept.txt").await;
    let pid1 = sandbox_pid1(&server.instance, &sb.id).expect("the sandbox has a PID 1");
    server.crash().await;
    {
        use warren_store::{StateStore, Table};
        let store = warren_store::RedbStore::open(server.data_dir().join("state.redb")).expect("open the store");
        let bytes = store.get(Table::Sandboxes, &sb.id).expect("read the record").expect("the record is there");
        let mut record: serde_json::Value = serde_json::from_slice(&bytes).expect("a JSON record");
        record["handle"] = serde_json::Value::Null;
        store.put(Table::Sandboxes, &sb.id, &serde_json::to_vec(&record).expect("encode")).expect("write the record");
    }
    server.launch().await;
    let info = server.get(&sb.id).await;
    assert_eq!(info.state, SandboxState::Running, "{info:?}\nlog:\n{}", server.log_tail(20));
    assert_eq!(sandbox_pid1(&server.instance, &sb.id), Some(pid1), "the same PID 1 carries on");
    assert_eq!(server.sh_ok(&sb.id, "cat /tmp/kept.txt").await, "kept\n");
    server.finish().await;
}

/// Starts a create in the background and SIGKILLs the server as soon as the
/// sandbox's run directory appears. Returns whether the create was cut short
/// (false when it won the race) and the processes the server had started.
async fn crash_mid_create(server: &mut TestServer) -> (bool, Vec<leaks::ProcessIdentity>) {
    let run_dir = server.data_dir().join("run");
    let before = leaks::dir_entries(&run_dir);
    let http = server.http.clone();
    let url = format!("{}/v1/sandboxes", server.url);
    let create = tokio::spawn(async move { http.post(url).json(&small(json!({}))).send().await.map(|r| r.status()) });
    let deadline = tokio::time::Instant::now() + WAIT;
    while leaks::dir_entries(&run_dir) == before {
        assert!(tokio::time::Instant::now() < deadline, "no sandbox directory appeared under {}", run_dir.display());
        tokio::task::yield_now().await;
    }
    let started = leaks::children_of(server.server_pid().expect("the server runs") as i32);
    server.crash().await;
    let answer = create.await.expect("the create task ran");
    (!matches!(answer, Ok(s) if s.is_success()), started)
}

#[tokio::test]
async fn crash_during_create_leaves_nothing_after_restart() {
    let mut server = TestServer::start().await;
    let mut cut = false;
    let mut started = Vec::new();
    for _ in 0..5 {
        (cut, started) = crash_mid_create(&mut server).await;
        server.launch().await;
        if cut {
            break;
        }
        // The create finished before the kill: clean up and try again.
        for sb in server.list(None).await {
            server.delete(&sb.id).await;
        }
    }
    assert!(cut, "every create finished before the server could be killed");
    for sb in server.list(None).await {
        if sb.state == SandboxState::Running {
            // Made, and recorded while it was made, but killed before the
            // answer: re-adopted whole (its record is durable), and working.
            assert_eq!(server.sh_ok(&sb.id, "echo whole").await, "whole\n", "{sb:?}");
            server.delete(&sb.id).await;
            continue;
        }
        assert_eq!(sb.state, SandboxState::Ended, "a half-made sandbox is not running: {sb:?}");
        // Retries whose create beat the kill were deleted by the loop above.
        assert!(
            matches!(sb.end_reason, Some(EndReason::NodeRestarted | EndReason::CreateFailed | EndReason::Deleted)),
            "{sb:?}"
        );
    }
    // The half-made sandbox's first process may not have reached a cgroup
    // yet; whatever the dead server had started must die all the same.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let alive: Vec<_> = started.iter().filter(|p| p.is_alive()).map(|p| (p.pid, leaks::cmdline(p.pid))).collect();
        if alive.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "processes of the crashed create live on: {alive:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let leaks = Leaks::scan(&server.data_dir(), &server.instance);
    assert!(leaks.is_empty(), "the restarted server left the half-made sandbox:\n{leaks}");
    let sb = server.create_small().await;
    assert_eq!(server.sh_ok(&sb.id, "echo fine").await, "fine\n", "the node works after the sweep");
    server.finish().await;
}

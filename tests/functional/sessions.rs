//! Shell sessions: cwd and exported variables persist between commands,
//! sessions do not see each other, deleting one ends it.

use serde_json::json;
use warren_api::{ErrorCode, ExecStatus};
use warren_tests::*;

#[tokio::test]
async fn cd_and_export_persist_between_commands() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let s = server.create_session(&sb.id, json!({})).await;
    let r = server.session_exec(&sb.id, &s.id, "mkdir -p /tmp/deep/er && cd /tmp/deep && export FOO='bar baz'").await;
    assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(0)), "{r:?}");
    let r = server.session_exec(&sb.id, &s.id, "cd er; pwd; echo \"$FOO\"").await;
    assert_eq!(stdout(&r), "/tmp/deep/er\nbar baz\n");
    let r = server.session_exec(&sb.id, &s.id, "pwd").await;
    assert_eq!(stdout(&r), "/tmp/deep/er\n", "a relative cd persists too");

    let listed = server.list_sessions(&sb.id).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].cwd, "/tmp/deep/er");
    assert_eq!(listed[0].env.get("FOO").map(String::as_str), Some("bar baz"));
    assert_eq!(listed[0].commands_run, 3);

    let plain = server.sh(&sb.id, "pwd; echo \"[$FOO]\"").await;
    assert_eq!(stdout(&plain), "/\n[]\n", "a plain exec does not see session state");
    server.finish().await;
}

#[tokio::test]
async fn sessions_start_where_asked_and_are_independent() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"env": {"BASE": "b"}}))).await;
    let one = server.create_session(&sb.id, json!({"cwd": "/work", "env": {"ONLY_ONE": "1"}})).await;
    let two = server.create_session(&sb.id, json!({})).await;
    assert_eq!(one.cwd, "/work");
    server.session_exec(&sb.id, &one.id, "cd /tmp; export SHARED=from-one").await;

    let r = server.session_exec(&sb.id, &one.id, "echo \"$PWD $ONLY_ONE $SHARED $BASE\"").await;
    assert_eq!(stdout(&r), "/tmp 1 from-one b\n");
    let r = server.session_exec(&sb.id, &two.id, "echo \"$PWD [$ONLY_ONE] [$SHARED] $BASE\"").await;
    assert_eq!(stdout(&r), "/root [] [] b\n", "the second session sees none of the first's state");
    server.finish().await;
}

#[tokio::test]
async fn a_session_cannot_start_where_there_is_no_directory() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let url = format!("/v1/sandboxes/{}/sessions", sb.id);
    for cwd in ["/no/such/dir", "/etc/passwd", "/etc/passwd/below"] {
        let (status, body) = server.call(reqwest::Method::POST, &url, Some(&json!({"cwd": cwd}))).await;
        assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("cwd"));
        assert!(body["message"].as_str().is_some_and(|m| m.contains(cwd)), "{body}");
    }
    assert!(server.list_sessions(&sb.id).await.is_empty(), "a refused session is not kept");
    server.sh_ok(&sb.id, "ln -s /tmp /tmp-link").await;
    let s = server.create_session(&sb.id, json!({"cwd": "/tmp-link"})).await;
    assert_eq!(stdout(&server.session_exec(&sb.id, &s.id, "pwd -P").await), "/tmp\n");
    server.finish().await;
}

#[tokio::test]
async fn session_exec_takes_a_command_not_argv() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let s = server.create_session(&sb.id, json!({})).await;
    let (status, body) = server
        .call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{}/sessions/{}/exec?wait=true", sb.id, s.id),
            Some(&json!({"argv": ["pwd"]})),
        )
        .await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("argv"));
    server.finish().await;
}

#[tokio::test]
async fn deleted_session_is_gone() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let keep = server.create_session(&sb.id, json!({})).await;
    let gone = server.create_session(&sb.id, json!({})).await;
    let (status, body) = server.delete_session(&sb.id, &gone.id).await;
    assert_eq!(status.as_u16(), 204, "{body}");

    let (status, body) = server.try_session_exec(&sb.id, &gone.id, "true").await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let (status, body) = server.delete_session(&sb.id, &gone.id).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let ids: Vec<String> = server.list_sessions(&sb.id).await.into_iter().map(|s| s.id).collect();
    assert_eq!(ids, vec![keep.id.clone()]);
    assert_eq!(stdout(&server.session_exec(&sb.id, &keep.id, "echo still").await), "still\n");
    server.finish().await;
}

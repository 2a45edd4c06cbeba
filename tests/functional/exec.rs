//! Exec: argv and shell forms, exit status, environment, stdin, separated
//! streams, NDJSON streaming and resumption, deadlines, output caps, kill.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use serde_json::json;
use warren_api::{ErrorCode, ExecFrame, ExecRequest, ExecStatus, StreamName};
use warren_tests::*;

const EXEC_WAIT: Duration = Duration::from_secs(60);

fn with<F: FnOnce(&mut ExecRequest)>(mut req: ExecRequest, f: F) -> ExecRequest {
    f(&mut req);
    req
}

#[tokio::test]
async fn argv_and_shell_forms_run() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["printf", "%s|", "a b", "$HOME", "c"])).await;
    assert_eq!(stdout(&r), "a b|$HOME|c|", "argv reaches the program verbatim, no shell in between");
    let r = server.sh(&sb.id, "echo $((6 * 7)) | tr 4 x").await;
    assert_eq!(stdout(&r), "x2\n", "the command form runs through /bin/sh");
    server.finish().await;
}

#[tokio::test]
async fn exit_codes_and_signals_are_reported() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    for (cmd, code) in [("exit 0", 0), ("exit 3", 3), ("exit 255", 255)] {
        let r = server.sh(&sb.id, cmd).await;
        assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, Some(code), None), "`{cmd}`");
    }
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["false"])).await;
    assert_eq!(r.exit_code, Some(1));
    let r = server.sh(&sb.id, "kill -9 $$").await;
    assert_eq!((r.status, r.exit_code, r.signal), (ExecStatus::Ok, None, Some(9)), "{r:?}");
    server.finish().await;
}

#[tokio::test]
async fn environment_comes_from_sandbox_then_request() {
    let server = TestServer::start().await;
    let sb = server.create(small(json!({"env": {"FROM_SANDBOX": "s", "OVERRIDE": "sandbox"}}))).await;
    let req = with(ExecRequest::shell("echo \"$FROM_SANDBOX $OVERRIDE $FROM_REQUEST $HOME\""), |r| {
        r.env = BTreeMap::from([("OVERRIDE".into(), "request".into()), ("FROM_REQUEST".into(), "r".into())]);
    });
    let r = server.exec_wait(&sb.id, &req).await;
    assert_eq!(stdout(&r), "s request r /root\n");
    let r = server.sh(&sb.id, "echo \"$OVERRIDE\"").await;
    assert_eq!(stdout(&r), "sandbox\n", "a request's env does not stick");
    server.finish().await;
}

#[tokio::test]
async fn cwd_defaults_to_root_and_can_be_set() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["pwd"])).await;
    assert_eq!(stdout(&r), "/\n");
    let r = server.exec_wait(&sb.id, &with(ExecRequest::argv(["pwd"]), |r| r.cwd = Some("/tmp".into()))).await;
    assert_eq!(stdout(&r), "/tmp\n");
    server.finish().await;
}

#[tokio::test]
async fn stdin_text_and_base64_reach_the_process() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let text = with(ExecRequest::argv(["cat"]), |r| r.stdin = Some("line1\nline2 ü\n".into()));
    assert_eq!(stdout(&server.exec_wait(&sb.id, &text).await), "line1\nline2 ü\n");

    let bytes: Vec<u8> = (0..=255u8).collect();
    let binary = with(ExecRequest::argv(["od", "-An", "-v", "-tx1"]), |r| {
        r.stdin_b64 = Some(base64::engine::general_purpose::STANDARD.encode(&bytes));
    });
    let r = server.exec_wait(&sb.id, &binary).await;
    let hex: String = stdout(&r).split_whitespace().collect();
    let want: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(hex, want, "every byte value arrives unchanged");

    let r = server.exec_wait(&sb.id, &ExecRequest::argv(["cat"])).await;
    assert_eq!((r.exit_code, stdout(&r)), (Some(0), ""), "without stdin the process reads EOF at once");
    server.finish().await;
}

#[tokio::test]
async fn stdout_and_stderr_are_kept_apart() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let r = server.sh(&sb.id, "echo out; echo err >&2; echo out2").await;
    assert_eq!((stdout(&r), stderr(&r)), ("out\nout2\n", "err\n"));
    server.finish().await;
}

#[tokio::test]
async fn stream_frames_arrive_in_order_with_contiguous_offsets() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let cmd = "i=0; while [ $i -lt 300 ]; do i=$((i+1)); echo out-$i; echo err-$i >&2; done";
    let frames = server.exec_stream(&sb.id, &ExecRequest::shell(cmd)).await;
    let ExecFrame::Started { exec_id } = &frames[0] else { panic!("first frame is not `started`: {:?}", frames[0]) };
    let mut next = std::collections::HashMap::from([(StreamName::Stdout, 0u64), (StreamName::Stderr, 0u64)]);
    for f in &frames[1..frames.len() - 1] {
        match f {
            ExecFrame::Output { stream, offset, data_b64 } => {
                let expected = next.get_mut(stream).expect("known stream");
                assert_eq!(*offset, *expected, "{stream:?} frames are contiguous");
                *expected += b64(data_b64).len() as u64;
            }
            other => panic!("unexpected frame in the middle: {other:?}"),
        }
    }
    let result = end_result(&frames);
    assert_eq!((&result.exec_id, result.status, result.exit_code), (exec_id, ExecStatus::Ok, Some(0)));
    let want_out: String = (1..=300).map(|i| format!("out-{i}\n")).collect();
    let want_err: String = (1..=300).map(|i| format!("err-{i}\n")).collect();
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stdout)).unwrap(), want_out);
    assert_eq!(String::from_utf8(frame_bytes(&frames, StreamName::Stderr)).unwrap(), want_err);
    server.finish().await;
}

#[tokio::test]
async fn output_streams_while_the_process_runs_and_kill_ends_it() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let mut stream = server.exec_open(&sb.id, &ExecRequest::shell("echo first; sleep 1000")).await;
    let exec_id = stream.exec_id().await;
    match stream.next().await {
        Some(ExecFrame::Output { stream: StreamName::Stdout, offset: 0, data_b64 }) => {
            assert_eq!(b64(&data_b64), b"first\n")
        }
        other => panic!("expected the first output before the process ends, got {other:?}"),
    }
    assert_eq!(server.get_exec(&sb.id, &exec_id).await.status, ExecStatus::Running);
    let (status, body) = server.kill_exec(&sb.id, &exec_id).await;
    assert_eq!(status.as_u16(), 202, "kill answers 202: {body}");
    let rest = stream.collect().await;
    assert_eq!(end_result(&rest).status, ExecStatus::Killed, "{rest:?}");
    let after = server.get_exec(&sb.id, &exec_id).await;
    assert_eq!(after.status, ExecStatus::Killed);
    assert_eq!(stdout(&after), "first\n");
    assert_no_sleep_left(&server, &sb.id).await;
    server.finish().await;
}

/// Asserts (bounded) that no `sleep` is left in the sandbox, seen both from
/// inside (`ps`) and from the host (the sandbox's cgroup).
async fn assert_no_sleep_left(server: &TestServer, id: &str) {
    let deadline = tokio::time::Instant::now() + EXEC_WAIT;
    loop {
        let ps = server.exec_wait(id, &ExecRequest::argv(["ps", "-o", "pid,args"])).await;
        let inside: Vec<&str> = stdout(&ps).lines().filter(|l| l.contains("sleep")).collect();
        let host: Vec<String> = sandbox_pids(&server.instance, id)
            .into_iter()
            .map(leaks::cmdline)
            .filter(|c| c.contains("sleep"))
            .collect();
        if inside.is_empty() && host.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "sleeps survive: inside {inside:?}, host {host:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn deadline_kills_the_whole_tree_and_keeps_partial_output() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let req =
        with(ExecRequest::argv(["sh", "-c", "sleep 1000 & echo started; sleep 1000"]), |r| r.timeout_secs = Some(2.0));
    let r = server.exec_wait(&sb.id, &req).await;
    assert_eq!(r.status, ExecStatus::TimedOut, "{r:?}");
    assert_eq!(stdout(&r), "started\n", "output before the deadline is kept");
    assert_no_sleep_left(&server, &sb.id).await;
    server.finish().await;
}

#[tokio::test]
async fn output_cap_keeps_head_and_tail_and_counts_everything() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let total: u64 = 50_000_000;
    let cap: u64 = 65_536;
    let req = with(ExecRequest::shell(format!("yes | head -c {total}")), |r| r.output_cap_bytes = Some(cap));
    let r = server.exec_wait(&sb.id, &req).await;
    assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(0)), "{r:?}");
    let out = &r.output.as_ref().expect("output").stdout;
    let kept = b64(&out.data_b64);
    assert_eq!(out.total_bytes, total);
    assert!(out.dropped_bytes > 0, "something was dropped: {}", out.dropped_bytes);
    assert_eq!(kept.len() as u64 + out.dropped_bytes, total, "kept + dropped = written");
    assert!(kept.len() as u64 <= cap && out.text.len() as u64 <= cap, "kept {} > cap {cap}", kept.len());
    let head = out.dropped_at.expect("dropped_at is set when bytes were dropped") as usize;
    assert!(head > 0 && head < kept.len(), "both a head and a tail are kept (head {head}, kept {})", kept.len());
    assert!(kept[..head].starts_with(b"y\ny\n"), "the head is the start of the output");
    assert!(kept.ends_with(b"y\ny\n"), "the tail is the end of the output");
    assert!(kept.iter().all(|b| *b == b'y' || *b == b'\n'));
    server.finish().await;
}

#[tokio::test]
async fn result_is_complete_after_the_client_dropped_the_stream() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let mut stream = server.exec_open(&sb.id, &ExecRequest::shell("echo begin; sleep 2; echo end >&2; exit 7")).await;
    let exec_id = stream.exec_id().await;
    drop(stream);
    let r = server.wait_exec(&sb.id, &exec_id, EXEC_WAIT).await;
    assert_eq!((r.status, r.exit_code), (ExecStatus::Ok, Some(7)), "{r:?}");
    assert_eq!((stdout(&r), stderr(&r)), ("begin\n", "end\n"));
    server.finish().await;
}

#[tokio::test]
async fn resume_from_an_offset_returns_exactly_the_rest() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let frames = server.exec_stream(&sb.id, &ExecRequest::shell("seq 1 5000; seq 1 300 >&2")).await;
    let ExecFrame::Started { exec_id } = &frames[0] else { panic!("no started frame") };
    let out = frame_bytes(&frames, StreamName::Stdout);
    let err = frame_bytes(&frames, StreamName::Stderr);
    assert!(out.len() > 20_000 && err.len() > 1000, "enough output to resume in the middle");

    let resumed = server.resume(&sb.id, exec_id, 1000, 777).await;
    assert_eq!(frame_bytes(&resumed, StreamName::Stdout), out[1000..]);
    assert_eq!(frame_bytes(&resumed, StreamName::Stderr), err[777..]);
    let first_out = resumed.iter().find_map(|f| match f {
        ExecFrame::Output { stream: StreamName::Stdout, offset, .. } => Some(*offset),
        _ => None,
    });
    assert_eq!(first_out, Some(1000), "the first resumed frame starts at the requested offset");
    assert_eq!(end_result(&resumed).exit_code, Some(0));

    let at_end = server.resume(&sb.id, exec_id, out.len() as u64, err.len() as u64).await;
    assert_eq!(at_end.len(), 1, "nothing but `end` past the last byte: {at_end:?}");
    end_result(&at_end);

    // After a restart the exec is only in the state store: the replay from
    // the stored capture gives exactly the same bytes.
    let mut server = server;
    server.restart().await;
    let replayed = server.resume(&sb.id, exec_id, 1000, 777).await;
    assert_eq!(frame_bytes(&replayed, StreamName::Stdout), out[1000..]);
    assert_eq!(frame_bytes(&replayed, StreamName::Stderr), err[777..]);
    assert_eq!(end_result(&replayed).exit_code, Some(0));
    server.finish().await;
}

#[tokio::test]
async fn program_not_found_and_bad_exec_requests_name_the_field() {
    let server = TestServer::start().await;
    let sb = server.create_small().await;
    let cases = [
        (json!({"argv": ["/no/such/program"]}), "argv"),
        (json!({"argv": ["no-such-program-on-path"]}), "argv"),
        (json!({"argv": []}), "argv"),
        (json!({"argv": ["true"], "command": "true"}), "argv"),
        (json!({"command": "true", "cwd": "relative"}), "cwd"),
        (json!({"command": "true", "timeout_secs": 0}), "timeout_secs"),
        (json!({"command": "true", "output_cap_bytes": 0}), "output_cap_bytes"),
        (json!({"command": "true", "stdin_b64": "***"}), "stdin_b64"),
        (json!({"command": "true", "frobnicate": 1}), "frobnicate"),
    ];
    let mut wrong = Vec::new();
    for (req, field) in &cases {
        let (status, body) = server.try_exec_wait(&sb.id, req).await;
        wrong.extend(api_error_mismatch(status, &body, ErrorCode::InvalidRequest, Some(field)));
    }
    assert!(wrong.is_empty(), "rejections that do not name the field:\n{}", wrong.join("\n"));
    let (status, body) = server.call(reqwest::Method::GET, &format!("/v1/sandboxes/{}/exec/ex-0", sb.id), None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    server.finish().await;
}

//! `GET /metrics`, `GET /v1/stats` and the exec history: scraped around
//! real creates (fresh, from a warm pool, and one that init refuses), execs
//! that exit, fail and time out, a refused system call and ends; the text is
//! checked line by line against the Prometheus text format and each counter
//! against what the test did.

use std::time::Duration;

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_api::{EndReason, ErrorCode, ExecList, ExecRequest, ExecStatus, NodeStats};
use warren_tests::*;

const POOL: &str = "image=busybox,cpus=1,memory_mib=128,disk_mib=64,pids=256,size=1";

async fn stats(server: &TestServer) -> NodeStats {
    let (status, body) = server.call(Method::GET, "/v1/stats", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_value(body).expect("a NodeStats")
}

const FRESH_OK: &str = r#"warren_sandbox_creations_total{backend="container",source="fresh",outcome="ok"}"#;
const FRESH_FAILED: &str = r#"warren_sandbox_creations_total{backend="container",source="fresh",outcome="failed"}"#;
const POOL_OK: &str = r#"warren_sandbox_creations_total{backend="container",source="pool",outcome="ok"}"#;
const FRESH_SECONDS: &str = r#"warren_sandbox_create_seconds_count{backend="container",source="fresh"}"#;
const POOL_SECONDS: &str = r#"warren_sandbox_create_seconds_count{backend="container",source="pool"}"#;
const RUNNING: &str = r#"warren_sandboxes{backend="container",state="running"}"#;
/// Without `--auth`, every sandbox is the root project's.
const ROOT_RUNNING: &str = r#"warren_project_sandboxes{project="root",backend="container",state="running"}"#;
const ROOT_CREATED: &str = r#"warren_project_sandbox_creations_total{project="root",outcome="ok"}"#;
const ROOT_FAILED: &str = r#"warren_project_sandbox_creations_total{project="root",outcome="failed"}"#;
const ROOT_LIFETIME_ENDS: &str = r#"warren_project_sandbox_ends_total{project="root",reason="lifetime"}"#;

fn ends(reason: &str) -> String {
    format!(r#"warren_sandbox_ends_total{{backend="container",reason="{reason}"}}"#)
}

fn execs(status: &str) -> String {
    format!(r#"warren_execs_total{{status="{status}"}}"#)
}

#[tokio::test]
async fn metrics_count_creates_execs_events_and_ends() {
    let server = TestServer::start_with(&["--pool", POOL]).await;
    let before = server.scrape().await;
    assert_eq!(before.must(RUNNING), 0.0);
    assert_eq!(before.must("warren_admission_queue_depth"), 0.0);
    assert!(before.must(r#"warren_pool_idle_sandboxes{image="busybox"}"#) <= 1.0, "a pool of size 1");
    assert!(before.must("warren_node_capacity_cpus") >= 1.0);
    assert!(before.must("warren_node_capacity_memory_bytes") > 0.0);

    // A shape no pool has: always made fresh.
    let fresh = server.create(small(json!({"memory_mib": 96, "cpus": 0.5}))).await;
    assert!(!fresh.from_pool);
    // The pool's shape: claimed once the pool has filled; the misses are fresh creates.
    let mut fresh_creates = 1.0;
    let pooled = loop {
        let sb = server.create_small().await;
        if sb.from_pool {
            break sb;
        }
        fresh_creates += 1.0;
        server.delete(&sb.id).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let deleted_misses = fresh_creates - 1.0;
    // Admitted, then refused by init (busybox's /bin/sh is a symlink, which
    // a protected path must not cross): a failed create that ends the record.
    let refused = json!({"x": {"protected_paths": {"/bin/sh": "none"}}});
    let (status, body) = server.try_create(&small(json!({"phases": refused, "phase": "x"}))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("phases.x.protected_paths"));

    let ok = server.sh(&fresh.id, "true").await;
    let failing = server.sh(&fresh.id, "exit 3").await;
    assert_eq!((ok.status, failing.status, failing.exit_code), (ExecStatus::Ok, ExecStatus::Ok, Some(3)));
    let slow = ExecRequest { timeout_secs: Some(0.3), ..ExecRequest::shell("sleep 30") };
    assert_eq!(server.exec_wait(&fresh.id, &slow).await.status, ExecStatus::TimedOut);
    // A refused system call becomes a seccomp event once the node pulls it.
    server.sh(&pooled.id, "chroot / true; true").await;
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{}/events", pooled.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let during = server.scrape().await;
    assert_eq!(during.get(FRESH_OK) - before.get(FRESH_OK), fresh_creates);
    assert_eq!(during.get(POOL_OK) - before.get(POOL_OK), 1.0);
    assert_eq!(during.get(FRESH_SECONDS) - before.get(FRESH_SECONDS), fresh_creates, "failed creates have no latency");
    assert_eq!(during.get(FRESH_FAILED) - before.get(FRESH_FAILED), 1.0);
    assert_eq!(during.get(&ends("create_failed")) - before.get(&ends("create_failed")), 1.0);
    assert_eq!(during.get(POOL_SECONDS) - before.get(POOL_SECONDS), 1.0);
    assert_eq!(during.must(RUNNING), 2.0);
    assert_eq!(during.must(ROOT_RUNNING), 2.0, "live sandboxes by project, backend and state");
    assert_eq!(during.sum("warren_project_sandboxes", &[]), 2.0, "{}", during.text);
    assert_eq!(during.get(ROOT_CREATED) - before.get(ROOT_CREATED), fresh_creates + 1.0, "fresh and pooled");
    assert_eq!(during.get(ROOT_FAILED) - before.get(ROOT_FAILED), 1.0);
    assert_eq!(during.must("warren_node_used_sandboxes"), 2.0);
    assert_eq!(during.must("warren_node_used_cpus"), 1.5);
    assert_eq!(during.must("warren_node_used_memory_bytes"), ((96 + 128) << 20) as f64);
    assert_eq!(during.get(&execs("ok")) - before.get(&execs("ok")), 3.0, "true, exit 3 and the chroot shell");
    assert_eq!(during.get(&execs("timed_out")) - before.get(&execs("timed_out")), 1.0);
    assert_eq!(during.must(r#"warren_exec_seconds_count{status="timed_out"}"#), 1.0);
    assert!(during.must(r#"warren_exec_seconds_sum{status="timed_out"}"#) >= 0.3, "the exec ran to its deadline");
    assert!(during.get(r#"warren_security_events_total{kind="seccomp"}"#) >= 1.0, "{}", during.text);
    assert_eq!(during.get(&ends("deleted")) - before.get(&ends("deleted")), deleted_misses);

    // The exec history: every exec, oldest first, without output.
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{}/exec", fresh.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let history: ExecList = serde_json::from_value(body).expect("an ExecList");
    let seen: Vec<(ExecStatus, Option<i32>)> = history.execs.iter().map(|e| (e.status, e.exit_code)).collect();
    assert_eq!(seen, vec![(ExecStatus::Ok, Some(0)), (ExecStatus::Ok, Some(3)), (ExecStatus::TimedOut, None)]);
    assert!(history.execs.iter().all(|e| e.output.is_none()), "the history carries no output");
    let (status, body) = server.call(Method::GET, "/v1/sandboxes/sb-0000000000000000/exec", None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);

    // The JSON summary says the same.
    let summary = stats(&server).await;
    assert_eq!(summary.creations_total as f64, during.get(FRESH_OK) + during.get(POOL_OK));
    assert_eq!(summary.creations_failed_total, 1);
    assert_eq!(summary.execs.get(&ExecStatus::TimedOut), Some(&1));
    assert_eq!(summary.capacity.sandboxes_used, 2);
    let running: u64 =
        summary.sandboxes.iter().filter(|c| c.state == wire::SandboxState::Running).map(|c| c.count).sum();
    assert_eq!(running, 2);

    // Ends: by a client, and by the lifetime reaper.
    server.delete(&fresh.id).await;
    server.delete(&pooled.id).await;
    let short = server.create(small(json!({"memory_mib": 96, "lifetime_secs": 1}))).await;
    let ended = server.wait_ended(&short.id, Duration::from_secs(30)).await;
    assert_eq!(ended.end_reason, Some(EndReason::Lifetime));
    let after = server.scrape().await;
    assert_eq!(after.must(RUNNING), 0.0);
    assert_eq!(after.get(ROOT_RUNNING), 0.0, "a project with no live sandbox has no series");
    assert_eq!(after.sum("warren_project_sandboxes", &[]), 0.0);
    assert_eq!(after.get(ROOT_LIFETIME_ENDS) - before.get(ROOT_LIFETIME_ENDS), 1.0);
    let ends_by_project =
        after.sum("warren_project_sandbox_ends_total", &[]) - before.sum("warren_project_sandbox_ends_total", &[]);
    let ends_by_backend = after.sum("warren_sandbox_ends_total", &[]) - before.sum("warren_sandbox_ends_total", &[]);
    assert_eq!(ends_by_project, ends_by_backend, "every end is counted by project too");
    assert_eq!(after.must("warren_node_used_cpus"), 0.0);
    assert_eq!(after.get(&ends("deleted")) - before.get(&ends("deleted")), deleted_misses + 2.0);
    assert_eq!(after.get(&ends("lifetime")) - before.get(&ends("lifetime")), 1.0);
    assert_eq!(stats(&server).await.ends.get(&EndReason::Lifetime), Some(&1));
    // Ended sandboxes keep their exec history as long as their record.
    let (status, body) = server.call(Method::GET, &format!("/v1/sandboxes/{}/exec", fresh.id), None).await;
    assert_eq!((status, body["execs"].as_array().map(Vec::len)), (StatusCode::OK, Some(3)), "{body}");
    server.finish().await;
}

#[tokio::test]
async fn metrics_answer_openmetrics_when_asked_and_the_dashboard_is_served() {
    let server = TestServer::start().await;
    let answer = server
        .http
        .get(format!("{}/metrics", server.url))
        .header(ACCEPT, "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(answer.status(), StatusCode::OK);
    let content_type = answer.headers()[CONTENT_TYPE].to_str().unwrap_or_default().to_string();
    assert!(content_type.starts_with("application/openmetrics-text"), "content type {content_type}");
    let text = answer.text().await.expect("the metrics text");
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF:\n{text}");
    assert!(text.contains("# TYPE warren_sandboxes gauge"), "{text}");

    for (path, kind, marker) in [
        ("/ui", "text/html", "<canvas id=\"chart-creations\""),
        ("/ui/app.js", "text/javascript", "/v1/stats"),
        ("/ui/style.css", "text/css", "#overview"),
    ] {
        let answer = server.http.get(format!("{}{path}", server.url)).send().await.expect("GET a dashboard asset");
        assert_eq!(answer.status(), StatusCode::OK, "{path}");
        let content_type = answer.headers()[CONTENT_TYPE].to_str().unwrap_or_default().to_string();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        assert!(answer.text().await.expect("the asset").contains(marker), "{path} lacks {marker}");
    }
    // Nothing the page loads comes from another origin.
    let page = server.http.get(format!("{}/ui", server.url)).send().await.expect("GET /ui");
    let page = page.text().await.expect("the page");
    assert!(!page.contains("http://") && !page.contains("https://"), "the page loads only from the server");
    server.finish().await;
}

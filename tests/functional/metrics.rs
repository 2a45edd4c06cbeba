//! `GET /metrics`, `GET /v1/stats` and the exec history: scraped around
//! real creates (fresh, from a warm pool, and one that init refuses), execs
//! that exit, fail and time out, a refused system call and ends; the text is
//! checked line by line against the Prometheus text format and each counter
//! against what the test did.

use std::collections::BTreeMap;
use std::time::Duration;

use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, StatusCode};
use serde_json::json;
use warren_api::{EndReason, ErrorCode, ExecList, ExecRequest, ExecStatus, NodeStats};
use warren_tests::*;

const POOL: &str = "image=busybox,cpus=1,memory_mib=128,disk_mib=64,pids=256,size=1";

/// One scrape: every sample by `name{labels}` exactly as written.
struct Scrape {
    samples: BTreeMap<String, f64>,
    text: String,
}

impl Scrape {
    /// The sample's value; 0 when the series does not exist yet (a counter
    /// with no event so far has no series).
    fn get(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    fn must(&self, series: &str) -> f64 {
        *self.samples.get(series).unwrap_or_else(|| panic!("no series `{series}` in:\n{}", self.text))
    }
}

/// Parses the Prometheus text format (0.0.4) strictly enough to catch a
/// broken encoder: every sample belongs to a family declared by `# TYPE`,
/// names and labels are well formed, values are numbers, counters end in
/// `_total`, histogram buckets grow and end with `+Inf` equal to `_count`.
fn parse(text: &str) -> Scrape {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("bad TYPE line `{line}`"));
            assert!(name_ok(name), "bad family name in `{line}`");
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind), "bad type in `{line}`");
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "family `{name}` declared twice");
            continue;
        }
        if line.starts_with('#') {
            assert!(line.starts_with("# HELP ") || line == "# EOF", "unknown comment `{line}`");
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value in `{line}`"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value of `{line}` is not a number")),
        };
        let name = series.split('{').next().unwrap_or_default();
        assert!(name_ok(name), "bad metric name in `{line}`");
        if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
            let inner = labels.strip_prefix('{').and_then(|l| l.strip_suffix('}'));
            let inner = inner.unwrap_or_else(|| panic!("bad label block in `{line}`"));
            for pair in inner.split("\",").filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once("=\"").unwrap_or_else(|| panic!("bad label `{pair}` in `{line}`"));
                assert!(name_ok(k) && !k.starts_with("__"), "bad label name `{k}` in `{line}`");
                assert!(!v.trim_end_matches('"').contains('"'), "unescaped quote in `{line}`");
            }
        }
        let family = types
            .iter()
            .filter(|(f, _)| name == f.as_str() || name.strip_prefix(f.as_str()).is_some_and(|s| s.starts_with('_')))
            .max_by_key(|(f, _)| f.len())
            .unwrap_or_else(|| panic!("sample `{line}` has no # TYPE before it"));
        match family.1.as_str() {
            "counter" => assert!(name.ends_with("_total") && value >= 0.0, "bad counter sample `{line}`"),
            "histogram" => assert!(
                ["_bucket", "_sum", "_count"].iter().any(|s| name.ends_with(s)),
                "bad histogram sample `{line}`"
            ),
            _ => {}
        }
        assert!(samples.insert(series.to_string(), value).is_none(), "series `{series}` twice");
    }
    check_histograms(&samples);
    Scrape { samples, text: text.to_string() }
}

/// Buckets of each histogram series never shrink, and `+Inf` is `_count`.
fn check_histograms(samples: &BTreeMap<String, f64>) {
    let mut buckets: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (series, value) in samples {
        let Some((name, labels)) = series.split_once("_bucket{") else { continue };
        let (rest, le) = labels.rsplit_once("le=\"").expect("a bucket has le");
        let le = le.trim_end_matches("\"}");
        let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().expect("le is a number") };
        let key = format!("{name}_count{{{}}}", rest.trim_end_matches(','));
        let key = key.replace("{}", "");
        buckets.entry(key).or_default().push((bound, *value));
    }
    for (count_series, mut b) in buckets {
        b.sort_by(|x, y| x.0.total_cmp(&y.0));
        assert!(b.windows(2).all(|w| w[0].1 <= w[1].1), "buckets of {count_series} shrink: {b:?}");
        let last = b.last().expect("a bucket");
        assert_eq!(last.0, f64::INFINITY, "{count_series} has no +Inf bucket");
        assert_eq!(Some(&last.1), samples.get(&count_series), "+Inf bucket of {count_series} is not its count");
    }
}

async fn scrape(server: &TestServer) -> Scrape {
    let answer = server.http.get(format!("{}/metrics", server.url)).send().await.expect("GET /metrics");
    assert_eq!(answer.status(), StatusCode::OK);
    let content_type = answer.headers()[CONTENT_TYPE].to_str().unwrap_or_default().to_string();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "content type {content_type}");
    parse(&answer.text().await.expect("the metrics text"))
}

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

fn ends(reason: &str) -> String {
    format!(r#"warren_sandbox_ends_total{{backend="container",reason="{reason}"}}"#)
}

fn execs(status: &str) -> String {
    format!(r#"warren_execs_total{{status="{status}"}}"#)
}

#[tokio::test]
async fn metrics_count_creates_execs_events_and_ends() {
    let server = TestServer::start_with(&["--pool", POOL]).await;
    let before = scrape(&server).await;
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

    let during = scrape(&server).await;
    assert_eq!(during.get(FRESH_OK) - before.get(FRESH_OK), fresh_creates);
    assert_eq!(during.get(POOL_OK) - before.get(POOL_OK), 1.0);
    assert_eq!(during.get(FRESH_SECONDS) - before.get(FRESH_SECONDS), fresh_creates, "failed creates have no latency");
    assert_eq!(during.get(FRESH_FAILED) - before.get(FRESH_FAILED), 1.0);
    assert_eq!(during.get(&ends("create_failed")) - before.get(&ends("create_failed")), 1.0);
    assert_eq!(during.get(POOL_SECONDS) - before.get(POOL_SECONDS), 1.0);
    assert_eq!(during.must(RUNNING), 2.0);
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
    let after = scrape(&server).await;
    assert_eq!(after.must(RUNNING), 0.0);
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

#[test]
fn the_parser_rejects_broken_text() {
    let good = "# HELP a_total A.\n# TYPE a_total counter\na_total{x=\"1\"} 2\n";
    assert_eq!(parse(good).get("a_total{x=\"1\"}"), 2.0);
    for bad in [
        "a_total 1\n",
        "# TYPE a_total counter\na_total one\n",
        "# TYPE a counter\na 1\n",
        "# TYPE h histogram\nh_bucket{le=\"1\"} 2\nh_bucket{le=\"+Inf\"} 1\nh_count 1\n",
    ] {
        assert!(std::panic::catch_unwind(|| parse(bad)).is_err(), "accepted:\n{bad}");
    }
}

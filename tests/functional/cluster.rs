//! Cluster mode on one machine: a 3-member etcd, 2 API servers and 3 node
//! agents, each node in its own network namespace with its own address (a
//! bridge and veths this test makes; no traffic leaves these test hosts).
//! One scenario, in order, since each step builds on the cluster the last
//! one left: placement spreads load and prefers image locality; any API
//! server reaches any sandbox; a killed API server's client retries on the
//! other with its idempotency key and gets the same sandbox; the cluster
//! works on with an etcd member dead; a batch sent twice makes its
//! sandboxes once; a create waits (`?queue=true`) until the full cluster has
//! room; a node killed with SIGKILL has its
//! sandboxes end `node_lost` and new sandboxes go elsewhere; a restarted
//! node re-adopts its sandboxes; a lost node that comes back ends what the
//! cluster gave up. Along the way each API server's `/metrics` counts what
//! it placed where, its `/v1/stats` adds up the nodes' own, and it serves
//! the `/ui` dashboard.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};
use warren_api::{ClusterStatus, EndReason, NodeStats, SandboxInfo, SandboxState};
use warren_cluster::testing::Lab;
use warren_store_etcd::testing::EtcdCluster;
use warren_tests::cluster::*;
use warren_tests::prometheus::{parse, Scrape};
use warren_tests::*;

const NODES: usize = 3;
/// `--max-memory-mib` of every node.
const NODE_MEMORY_MIB: u64 = 1024;
/// A sandbox of which one node takes at most one.
const BIG_MIB: u64 = 700;
/// How long a lost node's sandboxes may take to end `node_lost`: the
/// node's lease TTL (5 s) plus the watchers' poll, with room for a slow CI.
const LOST_WITHIN: Duration = Duration::from_secs(30);

fn node_names(status: &ClusterStatus) -> BTreeSet<String> {
    status.nodes.iter().map(|n| n.name.clone()).collect()
}

fn placed_on(info: &SandboxInfo) -> String {
    let placement = info.placement.as_ref().unwrap_or_else(|| panic!("no placement in {info:?}"));
    assert!(info.id.starts_with(&format!("sb-{}-", placement.node)), "the id names the node: {info:?}");
    assert!(!placement.reason.is_empty());
    placement.node.clone()
}

/// `GET /metrics` of a server, parsed strictly.
async fn scrape(server: &TestServer) -> Scrape {
    let answer = server.http.get(format!("{}/metrics", server.url)).send().await.expect("GET /metrics");
    assert_eq!(answer.status(), StatusCode::OK);
    parse(&answer.text().await.expect("the metrics text"))
}

async fn stats(server: &TestServer) -> NodeStats {
    let (code, answer) = server.call(Method::GET, "/v1/stats", None).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    from_json(answer)
}

fn running(stats: &NodeStats) -> u64 {
    stats.sandboxes.iter().filter(|c| c.state == SandboxState::Running).map(|c| c.count).sum()
}

fn body(image: &str) -> Value {
    small(json!({"image": image, "memory_mib": 64, "disk_mib": 16, "labels": {"suite": "cluster"}}))
}

#[tokio::test]
async fn a_cluster_places_routes_and_survives_its_failures() {
    let lab = Lab::new(NODES);
    let mut etcd = EtcdCluster::start_on(3, lab.host_ip());
    let secrets = tempfile::tempdir().expect("a temp dir");
    let token = token_file(secrets.path());
    let mut nodes = Vec::new();
    for i in 0..NODES {
        nodes.push(start_node(&lab, i, &etcd, &token, &["--max-memory-mib", &NODE_MEMORY_MIB.to_string()]).await);
    }
    let mut apis = vec![start_api(&etcd, &token, &[]).await, start_api(&etcd, &token, &[]).await];
    for api in &apis {
        wait_status(api, "three nodes with the test image", |s| {
            s.nodes.len() == NODES && s.nodes.iter().all(|n| n.images.iter().any(|i| i == IMAGE))
        })
        .await;
    }

    // A node answers sandbox calls only with the cluster token.
    let plain = reqwest::Client::builder().no_proxy().build().expect("a client");
    let answer = plain.get(format!("{}/v1/sandboxes", nodes[0].url)).send().await.expect("reach the node");
    assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
    let answer = plain.get(format!("{}/v1/health", nodes[0].url)).send().await.expect("reach the node");
    assert_eq!(answer.status(), StatusCode::OK);

    // Placement spreads load; every API server reaches every sandbox.
    let mut by_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Per API server: how many it placed on each node.
    let mut placed_by: [BTreeMap<String, u64>; 2] = Default::default();
    for i in 0..9 {
        let info = apis[i % 2].create(body(IMAGE)).await;
        *placed_by[i % 2].entry(placed_on(&info)).or_default() += 1;
        by_node.entry(placed_on(&info)).or_default().push(info.id);
    }
    let counts: Vec<usize> = by_node.values().map(Vec::len).collect();
    assert_eq!(by_node.len(), NODES, "every node got sandboxes: {by_node:?}");
    assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 3, "balanced: {by_node:?}");
    for ids in by_node.values() {
        assert_eq!(apis[1].sh_ok(&ids[0], "echo routed").await, "routed\n");
        let info = apis[0].get(&ids[0]).await;
        assert_eq!(info.state, SandboxState::Running);
        placed_on(&info);
    }
    let listed = apis[1].list(None).await;
    assert_eq!(listed.len(), 9, "the list merges every node's");
    let (code, answer) = apis[1].call(Method::GET, "/v1/sandboxes?state=sleepy", None).await;
    assert_api_error(code, &answer, warren_api::ErrorCode::InvalidRequest, Some("state"));
    // `warren cluster status`, as an operator would ask (the counts are
    // the nodes' own, as of their last heartbeat).
    wait_status(&apis[0], "nine running", |s| s.running == 9).await;
    let cli = Command::new(warren_binary())
        .args(["--json", "cluster", "status"])
        .env("WARREN_URL", &apis[0].url)
        .output()
        .expect("run the warren CLI");
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let seen: ClusterStatus = serde_json::from_slice(&cli.stdout).expect("the CLI prints the status as JSON");
    assert_eq!(seen.running, 9, "{seen:?}");
    assert_eq!(seen.running_by_backend.get("container"), Some(&9));
    assert_eq!(seen.running_by_node.values().sum::<u64>(), 9);
    assert_eq!(seen.running_by_label.get("suite=cluster"), Some(&9), "{seen:?}");
    assert_eq!(seen.live_by_project.values().sum::<u64>(), 9, "{seen:?}");
    check_observability(&apis, &nodes, &placed_by).await;

    // Image locality: an image only n2 holds goes to n2.
    let rootfs = nodes[2].path().join("rootfs");
    let (code, answer) =
        nodes[2].call(Method::POST, "/v1/images", Some(&json!({"name": "onlyhere", "dir": rootfs}))).await;
    assert_eq!(code, StatusCode::CREATED, "{answer}");
    for api in &apis {
        wait_status(api, "n2 reports the image", |s| {
            s.nodes.iter().any(|n| n.name == "n2" && n.images.iter().any(|i| i == "onlyhere"))
        })
        .await;
    }
    for api in &apis {
        let info = api.create(body("onlyhere")).await;
        assert_eq!(placed_on(&info), "n2", "{:?}", info.placement);
        let reason = &info.placement.as_ref().map(|p| p.reason.clone()).unwrap_or_default();
        assert!(reason.contains("holds image `onlyhere`"), "{reason}");
        by_node.entry("n2".into()).or_default().push(info.id);
    }

    // An image no node holds is the client's error, as on one node.
    let (code, answer) = apis[1].try_create(&body("nowhere")).await;
    assert_api_error(code, &answer, warren_api::ErrorCode::InvalidRequest, Some("image"));

    // A client whose API server died retries on the other with its key:
    // the same sandbox, never a second one.
    let keyed = json!({"image": IMAGE, "memory_mib": 64, "disk_mib": 16, "idempotency_key": "retry-me"});
    let first = apis[0].create(keyed.clone()).await;
    apis[0].crash().await;
    let (code, again) = apis[1].try_create(&keyed).await;
    assert_eq!(code, StatusCode::OK, "a known key answers 200 with the first sandbox: {again}");
    assert_eq!(again["id"], json!(first.id));
    let with_key = apis[1].list(None).await.into_iter().filter(|s| s.idempotency_key.as_deref() == Some("retry-me"));
    assert_eq!(with_key.count(), 1);
    let first_node = placed_on(&first);
    by_node.entry(first_node).or_default().push(first.id);

    // A batch, sent twice: the second send answers the same sandboxes.
    let batch = json!({"count": 3, "batch_key": "b1", "template": body(IMAGE)});
    let mut batch_ids = BTreeSet::new();
    for (n, api) in apis.iter().skip(1).chain(apis.iter().skip(1)).enumerate() {
        let answer = api.request(Method::POST, "/v1/sandboxes/batch").json(&batch).send().await.expect("a batch");
        assert_eq!(answer.status(), StatusCode::OK);
        let text = answer.text().await.expect("the NDJSON answer");
        let frames: Vec<warren_api::BatchFrame> =
            text.lines().map(|l| serde_json::from_str(l).expect("a batch frame")).collect();
        let want_done = match n {
            0 => warren_api::BatchFrame::Done { made: 3, existing: 0, failed: 0 },
            _ => warren_api::BatchFrame::Done { made: 0, existing: 3, failed: 0 },
        };
        assert_eq!(frames.last(), Some(&want_done), "{text}");
        for frame in &frames {
            if let warren_api::BatchFrame::Item { sandbox: Some(info), .. } = frame {
                batch_ids.insert(info.id.clone());
                if n == 0 {
                    by_node.entry(placed_on(info)).or_default().push(info.id.clone());
                }
            }
        }
    }
    assert_eq!(batch_ids.len(), 3, "the second send answered the same three: {batch_ids:?}");

    // One etcd member dies; the cluster works on.
    etcd.kill(0);
    let after = apis[1].create(body(IMAGE)).await;
    assert_eq!(apis[1].sh_ok(&after.id, "echo quorum").await, "quorum\n");
    by_node.entry(placed_on(&after)).or_default().push(after.id);

    // n2 is killed: its sandboxes end node_lost, new ones go elsewhere.
    nodes[2].crash().await;
    let lost: Vec<String> = by_node["n2"].clone();
    let deadline = Instant::now() + LOST_WITHIN;
    for id in &lost {
        loop {
            // Until the node's lease runs out it may yet come back: the
            // API server says it cannot reach it (503 node_unavailable).
            let (code, answer) = apis[1].try_get(id).await;
            if code == StatusCode::OK {
                let info: SandboxInfo = from_json(answer.clone());
                if info.state == SandboxState::Ended {
                    assert_eq!(info.end_reason, Some(EndReason::NodeLost), "{info:?}");
                    break;
                }
            } else {
                assert_api_error(code, &answer, warren_api::ErrorCode::NodeUnavailable, None);
            }
            assert!(Instant::now() < deadline, "{id} did not end node_lost within {LOST_WITHIN:?}: {answer}");
            sleep(Duration::from_millis(200)).await;
        }
    }
    let (code, answer) = apis[1].try_exec_wait(&lost[0], &json!({"argv": ["true"]})).await;
    assert_api_error(code, &answer, warren_api::ErrorCode::SandboxEnded, None);
    let now = wait_status(&apis[1], "n2 gone", |s| !node_names(s).contains("n2")).await;
    assert!(now.lost >= lost.len() as u64, "{now:?}");
    let seen = scrape(&apis[1]).await;
    assert_eq!(seen.must(r#"warren_cluster_nodes{state="up"}"#), 2.0);
    assert_eq!(seen.must(r#"warren_cluster_nodes{state="lost"}"#), 1.0);
    assert_eq!(seen.must("warren_cluster_lost_sandboxes"), now.lost as f64);
    assert_eq!(seen.sum("warren_cluster_sandboxes", &[("node", "n2")]), 0.0, "a lost node drops out");
    let summed = stats(&apis[1]).await;
    assert_eq!(summed.ends.get(&EndReason::NodeLost), Some(&now.lost), "{summed:?}");
    for _ in 0..3 {
        let info = apis[1].create(body(IMAGE)).await;
        let node = placed_on(&info);
        assert_ne!(node, "n2");
        by_node.entry(node).or_default().push(info.id);
    }

    // n0 restarts (SIGKILL, then start again, within its lease): its
    // sandboxes are re-adopted and keep running.
    nodes[0].restart().await;
    let n0_url = nodes[0].url.clone();
    wait_status(&apis[1], "n0 re-registered at its new address", |s| {
        s.nodes.iter().any(|n| n.name == "n0" && n.url == n0_url)
    })
    .await;
    for id in &by_node["n0"] {
        assert_eq!(apis[1].sh_ok(id, "echo still-here").await, "still-here\n", "{id}");
    }

    // n2 comes back: what the cluster gave up, it ends.
    nodes[2].launch().await;
    wait_status(&apis[1], "n2 back", |s| node_names(s).contains("n2")).await;
    for id in &lost {
        let info = apis[1].get(id).await;
        assert_eq!((info.state, info.end_reason), (SandboxState::Ended, Some(EndReason::NodeLost)), "{info:?}");
    }
    let live_on_n2 = nodes[2].list(None).await.into_iter().filter(|s| s.state != SandboxState::Ended).count();
    assert_eq!(live_on_n2, 0, "n2 ended every sandbox the cluster gave up");

    // Admission: with `?queue=true` a create waits until the cluster has
    // room, instead of being refused.
    let big = json!({"image": IMAGE, "memory_mib": BIG_MIB, "disk_mib": 16});
    let mut bigs = Vec::new();
    loop {
        let (code, answer) = apis[1].try_create(&big).await;
        if code == StatusCode::SERVICE_UNAVAILABLE {
            assert_api_error(code, &answer, warren_api::ErrorCode::CapacityExceeded, None);
            break;
        }
        assert_eq!(code, StatusCode::CREATED, "{answer}");
        bigs.push(from_json::<SandboxInfo>(answer));
        assert!(bigs.len() <= NODES, "at most one big sandbox fits a node: {bigs:?}");
    }
    assert!(!bigs.is_empty(), "n2, empty again, takes one");
    let seen = scrape(&apis[1]).await;
    let full = r#"warren_api_creates_total{backend="container",node="none",result="capacity_exceeded"}"#;
    assert!(seen.must(full) >= 1.0, "the refused create is counted: {}", seen.text);
    assert_eq!(seen.must("warren_api_queued_creates"), 0.0);
    let queued = {
        let (http, url) = (apis[1].http.clone(), apis[1].url.clone());
        let big = big.clone();
        tokio::spawn(async move {
            let answer = http.post(format!("{url}/v1/sandboxes?queue=true")).json(&big).send().await;
            let answer = answer.expect("the queued create answers");
            (answer.status(), answer.json::<Value>().await.expect("a JSON answer"))
        })
    };
    sleep(Duration::from_secs(2)).await;
    assert!(!queued.is_finished(), "the queued create waits while the cluster is full");
    assert_eq!(scrape(&apis[1]).await.must("warren_api_queued_creates"), 1.0, "the waiting create is in the line");
    let freed = bigs.pop().expect("a big sandbox");
    apis[1].delete(&freed.id).await;
    let (code, answer) = tokio::time::timeout(LOST_WITHIN, queued).await.expect("admitted in time").expect("joined");
    assert_eq!(code, StatusCode::CREATED, "{answer}");
    let admitted: SandboxInfo = from_json(answer);
    assert_eq!(placed_on(&admitted), placed_on(&freed), "it took the room the delete freed");
    let seen = scrape(&apis[1]).await;
    assert_eq!(seen.must("warren_api_queued_creates"), 0.0);
    assert_eq!(seen.must("warren_api_queue_wait_seconds_count"), 1.0, "one create waited in the line");

    // A function call through an API server runs on a node holding its
    // image; an image no node holds names the field.
    let call = json!({"image": IMAGE, "language": "sh", "code": "echo $((6 * 7))"});
    let (code, answer) = apis[1].call(Method::POST, "/v1/functions/run", Some(&call)).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    let ran: warren_api::FunctionResult = from_json(answer);
    assert_eq!(ran.exec.output.as_ref().map(|o| o.stdout.text.as_str()), Some("42\n"), "{ran:?}");
    let nowhere = json!({"image": "nowhere", "language": "sh", "code": "true"});
    let (code, answer) = apis[1].call(Method::POST, "/v1/functions/run", Some(&nowhere)).await;
    assert_api_error(code, &answer, warren_api::ErrorCode::InvalidRequest, Some("image"));

    // An image change goes to every live node; a read merges them.
    let image_names = |list: &Value| -> BTreeSet<String> {
        list["images"]
            .as_array()
            .expect("images")
            .iter()
            .filter_map(|i| i["name"].as_str().map(str::to_string))
            .collect()
    };
    let import = json!({"name": "fanned", "dir": nodes[0].path().join("rootfs")});
    let answer =
        apis[1].http.post(format!("{}/v1/images", apis[1].url)).json(&import).send().await.expect("POST /v1/images");
    assert_eq!(answer.status(), StatusCode::CREATED);
    assert_eq!(answer.headers()["warren-nodes"], "n0,n1,n2", "every node imported it");
    for node in &nodes {
        let (code, list) = node.call(Method::GET, "/v1/images", None).await;
        assert_eq!(code, StatusCode::OK, "{list}");
        assert!(image_names(&list).contains("fanned"), "{list}");
    }
    let (code, list) = apis[1].call(Method::GET, "/v1/images", None).await;
    assert_eq!(code, StatusCode::OK, "{list}");
    let merged = image_names(&list);
    assert!(merged.contains(IMAGE) && merged.contains("fanned") && merged.contains("onlyhere"), "{merged:?}");
    let made = apis[1].create(json!({"image": "fanned", "memory_mib": 64, "disk_mib": 16})).await;
    apis[1].delete(&made.id).await;
    let bad = json!({"name": "broken", "dir": "/no/such/dir"});
    let (code, answer) = apis[1].call(Method::POST, "/v1/images", Some(&bad)).await;
    assert_api_error(code, &answer, warren_api::ErrorCode::InvalidRequest, Some("dir"));
    let (code, answer) = apis[1].call(Method::DELETE, "/v1/images/fanned", None).await;
    assert!(code.is_success(), "{answer}");
    for node in &nodes {
        let (_, list) = node.call(Method::GET, "/v1/images", None).await;
        assert!(!image_names(&list).contains("fanned"), "{list}");
    }

    // Every node cleans up after itself; the API servers hold nothing.
    let api = apis.pop().expect("an API server");
    api.finish().await;
    drop(apis);
    for node in nodes {
        node.finish().await;
    }
}

/// What an API server reports of the nine creates just made: its own
/// placements per node in `/metrics`, the nodes' numbers added up in
/// `/v1/stats`, and the dashboard.
async fn check_observability(apis: &[TestServer], nodes: &[TestServer], placed_by: &[BTreeMap<String, u64>; 2]) {
    for (api, placed) in apis.iter().zip(placed_by) {
        // Its watcher's view has caught up with the nodes' heartbeats.
        wait_status(api, "nine running", |s| s.running == 9).await;
        let seen = scrape(api).await;
        for node in ["n0", "n1", "n2"] {
            let created = format!(r#"warren_api_creates_total{{backend="container",node="{node}",result="created"}}"#);
            let want = placed.get(node).copied().unwrap_or(0) as f64;
            assert_eq!(seen.get(&created), want, "{node}: {placed:?}\n{}", seen.text);
            assert!(seen.must(&format!(r#"warren_cluster_node_capacity_sandboxes{{node="{node}"}}"#)) > 0.0);
        }
        let made = placed.values().sum::<u64>() as f64;
        assert_eq!(seen.sum("warren_api_creates_total", &[]), made, "nothing else was created through it");
        assert_eq!(seen.must(r#"warren_api_create_seconds_count{backend="container"}"#), made);
        assert_eq!(seen.must(r#"warren_cluster_nodes{state="up"}"#), NODES as f64);
        assert_eq!(seen.sum("warren_cluster_sandboxes", &[("backend", "container")]), 9.0);
        assert_eq!(seen.must(r#"warren_cluster_project_sandboxes{project="root"}"#), 9.0);
    }
    assert_eq!(placed_by.iter().flat_map(|p| p.values()).sum::<u64>(), 9);

    // `/v1/stats` of an API server is the sum of the nodes' own.
    let summed = stats(&apis[1]).await;
    assert_eq!(running(&summed), 9, "{summed:?}");
    let mut own = Vec::new();
    for node in nodes {
        own.push(stats(node).await);
    }
    assert_eq!(summed.creations_total, own.iter().map(|s| s.creations_total).sum::<u64>());
    assert_eq!(summed.creations_total, 9, "{summed:?}");
    assert_eq!(summed.capacity.max_sandboxes, own.iter().map(|s| s.capacity.max_sandboxes).sum::<u64>());
    assert_eq!(summed.capacity.cpus_total, own.iter().map(|s| s.capacity.cpus_total).sum::<f64>());
    let latency_count: u64 = summed.create_latency.iter().map(|l| l.count).sum();
    assert_eq!(latency_count, 9, "{:?}", summed.create_latency);

    // The dashboard, served by the API role as by a single server.
    for (path, kind, marker) in
        [("/ui", "text/html", "<canvas id=\"chart-creations\""), ("/ui/app.js", "text/javascript", "/v1/cluster")]
    {
        let answer = apis[0].http.get(format!("{}{path}", apis[0].url)).send().await.expect("GET a dashboard asset");
        assert_eq!(answer.status(), StatusCode::OK, "{path}");
        let content_type = answer.headers()[reqwest::header::CONTENT_TYPE].to_str().unwrap_or_default().to_string();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        assert!(answer.text().await.expect("the asset").contains(marker), "{path} lacks {marker}");
    }
}

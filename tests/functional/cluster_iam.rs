//! IAM and quotas in a cluster's API role: 1 etcd member, 2 API servers
//! with `--auth on` and 2 node agents (each in its own network namespace).
//! Keys and projects live in etcd, so both API servers know every key; a
//! key needs no more than any API server to be refused (401) or to find
//! another project's sandbox missing (404, through either API server, by
//! the project in its placement record); a project's sandbox quota holds
//! cluster-wide (the nodes report what each project runs) and frees up
//! after a delete; and the root admin key was made exactly once.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::time::{sleep, Instant};
use warren_api::{ErrorCode, ProjectInfo, QuotaKind, SandboxInfo, SandboxState};
use warren_cluster::testing::Lab;
use warren_store_etcd::testing::EtcdCluster;
use warren_tests::cluster::*;
use warren_tests::iam::*;
use warren_tests::*;

const NODES: usize = 2;

fn body() -> Value {
    small(json!({"image": IMAGE, "memory_mib": 64, "disk_mib": 16}))
}

/// A client that sends `key` on every request, as a user of one project would.
fn client_with_key(key: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    let value = format!("Bearer {key}").parse().expect("a header value");
    headers.insert(reqwest::header::AUTHORIZATION, value);
    reqwest::Client::builder().no_proxy().default_headers(headers).build().expect("an HTTP client")
}

/// Waits until `api` counts `sandboxes` live sandboxes in `project` (the
/// nodes' heartbeats reached it), and returns what it says.
async fn wait_usage(api: &TestServer, project: &str, sandboxes: u64) -> ProjectInfo {
    let deadline = Instant::now() + SETTLE_WITHIN;
    loop {
        let (code, answer) = api.call(Method::GET, &format!("/v1/projects/{project}"), None).await;
        assert_eq!(code, StatusCode::OK, "{answer}");
        let info: ProjectInfo = from_json(answer);
        if info.usage.sandboxes == sandboxes {
            return info;
        }
        assert!(Instant::now() < deadline, "{project} never held {sandboxes} sandboxes at {}: {info:?}", api.url);
        sleep(Duration::from_millis(200)).await;
    }
}

/// A create of `project` through `api`, retried while it is refused for
/// the sandboxes quota: in the few milliseconds between a node making a
/// sandbox and the API server that asked marking its quota hold done, a
/// heartbeat of that node may count the sandbox that the hold still counts
/// (the ledger errs on the safe side; see `warren_cluster::ledger`), until
/// the node's next heartbeat.
async fn create_when_counted_once(api: &TestServer, key: &str, project: &str) -> SandboxInfo {
    let deadline = Instant::now() + SETTLE_WITHIN;
    loop {
        let (code, answer) = call_as(api, Some(key), Method::POST, "/v1/sandboxes", Some(&body())).await;
        if code == StatusCode::CREATED {
            return from_json(answer);
        }
        assert_quota_refusal(code, &answer, project, QuotaKind::Sandboxes);
        assert!(Instant::now() < deadline, "the quota never made room: {answer}");
        sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn api_servers_enforce_keys_project_isolation_and_quotas_cluster_wide() {
    let lab = Lab::new(NODES);
    let etcd = EtcdCluster::start_on(1, lab.host_ip());
    let secrets = tempfile::tempdir().expect("a temp dir");
    let token = token_file(secrets.path());
    let mut nodes = Vec::new();
    for i in 0..NODES {
        nodes.push(start_node(&lab, i, &etcd, &token, &[]).await);
    }
    let mut apis = vec![start_api(&etcd, &token, &["--auth", "on"]).await];
    apis.push(start_api(&etcd, &token, &["--auth", "on"]).await);

    // The admin key was made once, by the first API server; the second
    // found it made and wrote none, yet takes it (keys live in etcd).
    let admin = apis[0].admin_key.clone().expect("the first API server wrote admin.key");
    assert!(apis[1].admin_key.is_none(), "the second API server made a second admin key");
    assert!(!apis[1].data_dir().join("admin.key").exists());
    apis[1].http = client_with_key(&admin);
    for api in &apis {
        wait_status(api, "both nodes registered", |s| s.nodes.len() == NODES).await;
    }

    // No key, or a wrong one: 401 on either API server; health stays open.
    for api in &apis {
        for (method, path, body) in [
            (Method::GET, "/v1/sandboxes", None),
            (Method::POST, "/v1/sandboxes", Some(body())),
            (Method::GET, "/v1/projects", None),
            (Method::GET, "/v1/cluster", None),
        ] {
            let (code, answer) = call_as(api, None, method.clone(), path, body.as_ref()).await;
            assert_api_error(code, &answer, ErrorCode::Unauthorized, None);
            let (code, answer) = call_as(api, Some("wrn_not-a-key"), method, path, body.as_ref()).await;
            assert_api_error(code, &answer, ErrorCode::Unauthorized, None);
        }
        let (code, _) = call_as(api, None, Method::GET, "/v1/health", None).await;
        assert_eq!(code, StatusCode::OK);
        // The dashboard's page is open; what it reads is not.
        let plain = reqwest::Client::builder().no_proxy().build().expect("an HTTP client");
        let page = plain.get(format!("{}/ui", api.url)).send().await.expect("GET /ui");
        assert_eq!(page.status(), StatusCode::OK);
        let (code, answer) = call_as(api, None, Method::GET, "/v1/stats", None).await;
        assert_api_error(code, &answer, ErrorCode::Unauthorized, None);
    }

    // Projects made through one API server, keys through the other.
    let a = project(&apis[0], None, "a", json!({"sandboxes": 2})).await;
    let b = project(&apis[0], None, "b", json!({})).await;
    let key_a = key_of(&apis[1], &a.id).await;
    let key_b = key_of(&apis[1], &b.id).await;

    let b1 = create_as(&apis[1], &key_b, body()).await;
    let a1 = create_as(&apis[0], &key_a, body()).await;
    assert_eq!((a1.project.as_str(), b1.project.as_str()), (a.id.as_str(), b.id.as_str()));
    // A project's own key reaches its sandbox through either API server.
    for api in &apis {
        let (code, answer) = call_as(api, Some(&key_a), Method::GET, &format!("/v1/sandboxes/{}", a1.id), None).await;
        assert_eq!(code, StatusCode::OK, "{answer}");
    }

    // A's key finds B's sandbox missing, through either API server, exactly
    // as an id that never existed; and it cannot exec in it or delete it.
    let never = format!("sb-{}-0123456789abcdef", b1.placement.as_ref().expect("placed").node);
    for api in &apis {
        let (code, missing) = call_as(api, Some(&key_a), Method::GET, &format!("/v1/sandboxes/{never}"), None).await;
        assert_api_error(code, &missing, ErrorCode::NotFound, None);
        let (code, hidden) = call_as(api, Some(&key_a), Method::GET, &format!("/v1/sandboxes/{}", b1.id), None).await;
        assert_api_error(code, &hidden, ErrorCode::NotFound, None);
        assert_eq!(hidden["message"], json!(format!("no sandbox {}", b1.id)), "{hidden}");
        let exec = json!({"argv": ["echo", "in-b"]});
        let path = format!("/v1/sandboxes/{}/exec", b1.id);
        let (code, answer) = call_as(api, Some(&key_a), Method::POST, &path, Some(&exec)).await;
        assert_api_error(code, &answer, ErrorCode::NotFound, None);
        let path = format!("/v1/sandboxes/{}", b1.id);
        let (code, answer) = call_as(api, Some(&key_a), Method::DELETE, &path, None).await;
        assert_api_error(code, &answer, ErrorCode::NotFound, None);
        // The cluster's counts span every project: root only.
        for path in ["/v1/cluster", "/metrics", "/v1/stats"] {
            let (code, answer) = call_as(api, Some(&key_a), Method::GET, path, None).await;
            assert_api_error(code, &answer, ErrorCode::Forbidden, None);
        }
    }
    assert_eq!(apis[0].get(&b1.id).await.state, SandboxState::Running, "B's sandbox was left alone");
    assert_eq!(apis[1].sh_ok(&b1.id, "echo admin-reaches-b").await, "admin-reaches-b\n");

    // Each key lists its own project's sandboxes only; the admin key all.
    for api in &apis {
        assert_eq!(list_as(api, &key_a).await, vec![a1.id.clone()]);
        assert_eq!(list_as(api, &key_b).await, vec![b1.id.clone()]);
        let all: Vec<String> = api.list(None).await.into_iter().map(|s| s.id).collect();
        assert!(all.contains(&a1.id) && all.contains(&b1.id), "{all:?}");
    }

    // A may hold 2 sandboxes: the second goes through the other API
    // server; once both API servers count both (the nodes' heartbeats),
    // a third is refused through either.
    let a2 = create_when_counted_once(&apis[1], &key_a, &a.id).await;
    for api in &apis {
        wait_usage(api, &a.id, 2).await;
        let (code, answer) = call_as(api, Some(&key_a), Method::POST, "/v1/sandboxes", Some(&body())).await;
        assert_quota_refusal(code, &answer, &a.id, QuotaKind::Sandboxes);
    }
    // B has no quota of its own: A's full quota does not touch it.
    let b2 = create_as(&apis[0], &key_b, body()).await;

    // A queued create waits for A's room; a delete makes it.
    let queued = {
        let (http, url) = (client_with_key(&key_a), apis[0].url.clone());
        tokio::spawn(async move {
            let answer = http.post(format!("{url}/v1/sandboxes?queue=true")).json(&body()).send().await;
            let answer = answer.expect("the queued create answers");
            (answer.status(), answer.json::<Value>().await.expect("a JSON answer"))
        })
    };
    sleep(Duration::from_secs(2)).await;
    assert!(!queued.is_finished(), "the queued create waits while A's quota is full");
    let (code, answer) =
        call_as(&apis[1], Some(&key_a), Method::DELETE, &format!("/v1/sandboxes/{}", a2.id), None).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    let (code, answer) = tokio::time::timeout(SETTLE_WITHIN, queued).await.expect("admitted in time").expect("joined");
    assert_eq!(code, StatusCode::CREATED, "{answer}");
    let a3: SandboxInfo = from_json(answer);
    assert_eq!(a3.project, a.id);

    // After another delete, a plain create fits again (once this API
    // server's count has caught up with the delete).
    let (code, answer) =
        call_as(&apis[0], Some(&key_a), Method::DELETE, &format!("/v1/sandboxes/{}", a3.id), None).await;
    assert_eq!(code, StatusCode::OK, "{answer}");
    let deadline = Instant::now() + SETTLE_WITHIN;
    let a4 = loop {
        let (code, answer) = call_as(&apis[1], Some(&key_a), Method::POST, "/v1/sandboxes", Some(&body())).await;
        if code == StatusCode::CREATED {
            break from_json::<SandboxInfo>(answer);
        }
        assert_quota_refusal(code, &answer, &a.id, QuotaKind::Sandboxes);
        assert!(Instant::now() < deadline, "the delete never made room: {answer}");
        sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(a4.project, a.id);

    // Creates racing through both API servers at once: the quota ledger
    // in etcd lets at most the quota's worth through, whichever server
    // each went to and however fresh the nodes' heartbeats are.
    let c = project(&apis[0], None, "c", json!({"sandboxes": 2})).await;
    let key_c = key_of(&apis[0], &c.id).await;
    let bodies: Vec<Value> = (0..6).map(|_| body()).collect();
    let racing = bodies
        .iter()
        .enumerate()
        .map(|(i, b)| call_as(&apis[i % 2], Some(&key_c), Method::POST, "/v1/sandboxes", Some(b)));
    let answers = futures_util::future::join_all(racing).await;
    let mut made = Vec::new();
    for (code, answer) in answers {
        match code {
            StatusCode::CREATED => made.push(from_json::<SandboxInfo>(answer).id),
            _ => {
                assert_quota_refusal(code, &answer, &c.id, QuotaKind::Sandboxes);
            }
        }
    }
    // Never more than the quota; fewer only if a node's heartbeat counted a
    // made sandbox while its hold still did (see `create_when_counted_once`).
    assert!(!made.is_empty() && made.len() <= 2, "c's quota of 2 held across both API servers: {made:?}");

    for id in [&a1.id, &a4.id, &b1.id, &b2.id].into_iter().chain(&made) {
        apis[0].delete(id).await;
    }
    drop(apis);
    for node in nodes {
        node.finish().await;
    }
}

/// Room a full cluster frees goes to waiting projects in turns: project
/// `a` queues three creates before `b` queues one, yet `b`'s is placed
/// with the first or the second sandbox that a delete frees (the line is
/// fair across projects, FIFO within each; see `warren_cluster::line`).
#[tokio::test]
async fn a_full_cluster_gives_waiting_projects_room_in_turns() {
    /// One fits the node (`--max-memory-mib 1024`), two do not.
    const BIG: u64 = 700;
    let lab = Lab::new(1);
    let etcd = EtcdCluster::start_on(1, lab.host_ip());
    let secrets = tempfile::tempdir().expect("a temp dir");
    let token = token_file(secrets.path());
    let node = start_node(&lab, 0, &etcd, &token, &["--max-memory-mib", "1024"]).await;
    let api = start_api(&etcd, &token, &["--auth", "on"]).await;
    wait_status(&api, "the node registers", |s| s.nodes.len() == 1).await;
    let a = project(&api, None, "a", json!({})).await;
    let b = project(&api, None, "b", json!({})).await;
    let (key_a, key_b) = (key_of(&api, &a.id).await, key_of(&api, &b.id).await);
    let big = small(json!({"image": IMAGE, "memory_mib": BIG, "disk_mib": 16}));

    let filler = api.create(big.clone()).await;
    let queued = |key: &str| {
        let (http, url, big) = (client_with_key(key), api.url.clone(), big.clone());
        tokio::spawn(async move {
            let answer = http.post(format!("{url}/v1/sandboxes?queue=true")).json(&big).send().await;
            let answer = answer.expect("the queued create answers");
            (answer.status(), answer.json::<Value>().await.expect("a JSON answer"))
        })
    };
    let waiting = |n: f64| {
        let api = &api;
        async move {
            let deadline = Instant::now() + SETTLE_WITHIN;
            loop {
                let text = api.http.get(format!("{}/metrics", api.url)).send().await.expect("GET /metrics");
                let seen = warren_tests::prometheus::parse(&text.text().await.expect("the metrics text"));
                if seen.get("warren_api_queued_creates") == n {
                    return;
                }
                assert!(Instant::now() < deadline, "the line never held {n}: {}", seen.text);
                sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let mut a_creates = Vec::new();
    for i in 1..=3 {
        a_creates.push(queued(&key_a));
        waiting(i as f64).await;
    }
    let b_create = queued(&key_b);
    waiting(4.0).await;

    // The first room: a's head or b's, whichever tries first.
    api.delete(&filler.id).await;
    waiting(3.0).await;
    if !b_create.is_finished() {
        let first = a_creates.iter().position(|c| c.is_finished()).expect("one of a's creates was placed");
        let (code, answer) = a_creates.remove(first).await.expect("joined");
        assert_eq!(code, StatusCode::CREATED, "{answer}");
        let made: SandboxInfo = from_json(answer);
        assert_eq!(made.project, a.id);
        // a took its turn: the next room is b's, not a's next create's.
        api.delete(&made.id).await;
        waiting(2.0).await;
    }
    assert!(b_create.is_finished(), "b waited behind a's later creates");
    let (code, answer) = b_create.await.expect("joined");
    assert_eq!(code, StatusCode::CREATED, "{answer}");
    let made: SandboxInfo = from_json(answer);
    assert_eq!(made.project, b.id);
    api.delete(&made.id).await;
    // a's creates go on: each takes the room the one before it leaves.
    for create in a_creates {
        let (code, answer) =
            tokio::time::timeout(SETTLE_WITHIN, create).await.expect("placed in time").expect("joined");
        assert_eq!(code, StatusCode::CREATED, "{answer}");
        api.delete(&from_json::<SandboxInfo>(answer).id).await;
    }
    api.finish().await;
    node.finish().await;
}

//! IAM against a real `warren serve --auth on`: keys are required and can be
//! revoked, a project's sandboxes are invisible to other projects (404,
//! never 403) and visible to the projects above it, quota is delegated only
//! out of what a project holds, and the concurrent-sandbox, cpu, memory and
//! creation-rate quotas refuse the create past the line with a typed error
//! (or make a queued create wait) until room comes back.

use std::os::unix::fs::PermissionsExt;

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{ApiKeyCreated, ErrorCode, ProjectInfo, QuotaKind};
use warren_tests::iam::*;
use warren_tests::*;

#[tokio::test]
async fn requests_need_a_valid_key_and_the_admin_key_is_kept_private() {
    let mut server = TestServer::start_with_auth(&[]).await;
    let key_file = server.data_dir().join("admin.key");
    let mode = std::fs::metadata(&key_file).expect("admin.key").permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "admin.key is readable by its owner only");
    let admin = server.admin_key.clone().expect("the harness read the admin key");

    let (status, body) = call_as(&server, None, Method::GET, "/v1/sandboxes", None).await;
    assert_api_error(status, &body, ErrorCode::Unauthorized, None);
    let (status, body) = call_as(&server, None, Method::POST, "/v1/sandboxes", Some(&small(json!({})))).await;
    assert_api_error(status, &body, ErrorCode::Unauthorized, None);
    let forged = format!("wrn_{}_{}", "0".repeat(16), "1".repeat(64));
    for bad in [forged.as_str(), "not-a-key", &admin[..admin.len() - 2]] {
        let (status, body) = call_as(&server, Some(bad), Method::GET, "/v1/sandboxes", None).await;
        assert_api_error(status, &body, ErrorCode::Unauthorized, None);
    }
    // Health and the API document stay open (load balancers, clients).
    let (status, _) = call_as(&server, None, Method::GET, "/v1/health", None).await;
    assert_eq!(status, StatusCode::OK);

    // A restart keeps the admin key: it is made once, on the first start.
    server.restart().await;
    assert_eq!(server.admin_key.as_deref(), Some(admin.as_str()));
    let (status, body) = call_as(&server, Some(&admin), Method::GET, "/v1/projects", None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.finish().await;
}

#[tokio::test]
async fn another_projects_sandbox_is_invisible_and_untouchable() {
    let server = TestServer::start_with_auth(&[]).await;
    let a = project(&server, None, "a", json!({})).await;
    let b = project(&server, None, "b", json!({})).await;
    let (a_key, b_key) = (key_of(&server, &a.id).await, key_of(&server, &b.id).await);
    let theirs = create_as(&server, &b_key, small(json!({}))).await;
    assert_eq!(theirs.project, b.id);

    // Every way in answers as for a sandbox that does not exist.
    let (_, never) = call_as(&server, Some(&a_key), Method::GET, "/v1/sandboxes/sb-0000000000000000", None).await;
    let id = &theirs.id;
    let exec = json!({"argv": ["true"]});
    for (method, path, body) in [
        (Method::GET, format!("/v1/sandboxes/{id}"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/exec?wait=true"), Some(&exec)),
        (Method::GET, format!("/v1/sandboxes/{id}/files?path=/etc/passwd"), None),
        (Method::POST, format!("/v1/sandboxes/{id}/pause"), None),
        (Method::DELETE, format!("/v1/sandboxes/{id}"), None),
    ] {
        let (status, body) = call_as(&server, Some(&a_key), method.clone(), &path, body).await;
        assert_api_error(status, &body, ErrorCode::NotFound, None);
        assert_eq!(body["message"], json!(format!("no sandbox {id}")), "{method} {path}");
    }
    assert_eq!(never["code"], json!("not_found"));
    // An escaped id is not a way around the check.
    let escaped = format!("/v1/sandboxes/{}%{:02x}", &id[..id.len() - 1], id.as_bytes()[id.len() - 1]);
    let (status, body) = call_as(&server, Some(&a_key), Method::DELETE, &escaped, None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    assert!(!list_as(&server, &a_key).await.contains(id));
    // Nor can a create land in it.
    let (status, body) =
        call_as(&server, Some(&a_key), Method::POST, "/v1/sandboxes", Some(&small(json!({"project": b.id})))).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("project"));
    let (status, body) = call_as(&server, Some(&a_key), Method::GET, &format!("/v1/projects/{}", b.id), None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    // Node-wide administration is the root project's.
    let (status, body) = call_as(&server, Some(&a_key), Method::POST, "/v1/images/gc", None).await;
    assert_api_error(status, &body, ErrorCode::Forbidden, None);

    // The owner still has it, untouched, and can delete it.
    assert_eq!(list_as(&server, &b_key).await, vec![id.clone()]);
    let (status, body) =
        call_as(&server, Some(&b_key), Method::POST, &format!("/v1/sandboxes/{id}/exec?wait=true"), Some(&exec)).await;
    assert_eq!((status, &body["exit_code"]), (StatusCode::OK, &json!(0)), "{body}");
    let (status, body) = call_as(&server, Some(&b_key), Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    server.finish().await;
}

#[tokio::test]
async fn a_parent_key_sees_and_drives_its_childrens_sandboxes() {
    let server = TestServer::start_with_auth(&[]).await;
    let team = project(&server, None, "team", json!({})).await;
    let team_key = key_of(&server, &team.id).await;
    let child = project(&server, Some(&team_key), "child", json!({})).await;
    assert_eq!(child.parent.as_deref(), Some(team.id.as_str()));
    assert_eq!(child.path, vec!["root".to_string(), team.id.clone(), child.id.clone()]);
    // The parent's key makes the child's keys.
    let (status, value) =
        call_as(&server, Some(&team_key), Method::POST, &format!("/v1/projects/{}/keys", child.id), Some(&json!({})))
            .await;
    assert_eq!(status, StatusCode::CREATED, "{value}");
    let child_key = from_json::<ApiKeyCreated>(value).secret;

    let childs = create_as(&server, &child_key, small(json!({}))).await;
    let teams = create_as(&server, &team_key, small(json!({}))).await;
    // A create may name a project below the key's own.
    let placed = create_as(&server, &team_key, small(json!({"project": child.id}))).await;
    assert_eq!(
        (childs.project.as_str(), teams.project.as_str(), placed.project.as_str()),
        (child.id.as_str(), team.id.as_str(), child.id.as_str())
    );

    let mut seen = list_as(&server, &team_key).await;
    seen.sort();
    let mut all = vec![childs.id.clone(), teams.id.clone(), placed.id.clone()];
    all.sort();
    assert_eq!(seen, all, "the parent sees its own and its child's");
    let mut child_sees = list_as(&server, &child_key).await;
    child_sees.sort();
    let mut childs_own = vec![childs.id.clone(), placed.id.clone()];
    childs_own.sort();
    assert_eq!(child_sees, childs_own, "the child does not see its parent's");
    let (status, body) = call_as(
        &server,
        Some(&team_key),
        Method::POST,
        &format!("/v1/sandboxes/{}/exec?wait=true", childs.id),
        Some(&json!({"argv": ["true"]})),
    )
    .await;
    assert_eq!((status, &body["exit_code"]), (StatusCode::OK, &json!(0)), "{body}");
    let (status, body) =
        call_as(&server, Some(&child_key), Method::GET, &format!("/v1/sandboxes/{}", teams.id), None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    // Projects too: the child's key lists only its own.
    let (_, listed) = call_as(&server, Some(&child_key), Method::GET, "/v1/projects", None).await;
    let ids: Vec<String> = listed["projects"]
        .as_array()
        .expect("projects")
        .iter()
        .map(|p| p["id"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(ids, vec![child.id.clone()]);
    server.finish().await;
}

#[tokio::test]
async fn delegation_beyond_the_projects_own_quota_is_refused() {
    let server = TestServer::start_with_auth(&[]).await;
    let team =
        project(&server, None, "team", json!({"sandboxes": 4, "cpus": 2.0, "memory_mib": 1024, "creates_per_sec": 10}))
            .await;
    let key = key_of(&server, &team.id).await;
    let over = json!({"name": "big", "quota": {"sandboxes": 5, "cpus": 1.0, "memory_mib": 512, "creates_per_sec": 1}});
    let (status, body) = call_as(&server, Some(&key), Method::POST, "/v1/projects", Some(&over)).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("quota.sandboxes"));
    let unbounded = json!({"name": "open", "quota": {"sandboxes": 1, "cpus": 1.0, "creates_per_sec": 1}});
    let (status, body) = call_as(&server, Some(&key), Method::POST, "/v1/projects", Some(&unbounded)).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("quota.memory_mib"));
    project(&server, Some(&key), "one", json!({"sandboxes": 3, "cpus": 1.5, "memory_mib": 512, "creates_per_sec": 5}))
        .await;
    // The sum of the children's quotas stays within the parent's.
    let second =
        json!({"name": "two", "quota": {"sandboxes": 1, "cpus": 1.0, "memory_mib": 512, "creates_per_sec": 5}});
    let (status, body) = call_as(&server, Some(&key), Method::POST, "/v1/projects", Some(&second)).await;
    assert_api_error(status, &body, ErrorCode::InvalidRequest, Some("quota.cpus"));
    project(&server, Some(&key), "two", json!({"sandboxes": 1, "cpus": 0.5, "memory_mib": 512, "creates_per_sec": 5}))
        .await;
    let (status, value) = call_as(&server, Some(&key), Method::GET, &format!("/v1/projects/{}", team.id), None).await;
    assert_eq!(status, StatusCode::OK, "{value}");
    let info: ProjectInfo = from_json(value);
    assert_eq!(
        (info.delegated.sandboxes, info.delegated.cpus, info.delegated.memory_mib),
        (Some(4), Some(2.0), Some(1024))
    );
    server.finish().await;
}

#[tokio::test]
async fn concurrent_cpu_and_memory_quotas_refuse_past_the_line_and_allow_after_a_delete() {
    let server = TestServer::start_with_auth(&[]).await;
    let cases = [
        (
            "count",
            json!({"sandboxes": 2}),
            QuotaKind::Sandboxes,
            json!({"cpus": 0.5, "memory_mib": 128}),
            json!({"cpus": 0.5, "memory_mib": 128}),
        ),
        (
            "cpu",
            json!({"cpus": 1.5}),
            QuotaKind::Cpus,
            json!({"cpus": 0.75, "memory_mib": 128}),
            json!({"cpus": 0.5, "memory_mib": 128}),
        ),
        (
            "memory",
            json!({"memory_mib": 256}),
            QuotaKind::MemoryMib,
            json!({"cpus": 0.5, "memory_mib": 128}),
            json!({"cpus": 0.5, "memory_mib": 64}),
        ),
    ];
    for (name, quota, kind, each, over) in cases {
        let p = project(&server, None, name, quota).await;
        let key = key_of(&server, &p.id).await;
        let first = create_as(&server, &key, small(each.clone())).await;
        create_as(&server, &key, small(each.clone())).await;
        let (status, body) =
            call_as(&server, Some(&key), Method::POST, "/v1/sandboxes", Some(&small(over.clone()))).await;
        let refusal = assert_quota_refusal(status, &body, &p.id, kind);
        assert!(refusal.used + refusal.requested > refusal.limit, "{body}");
        let (_, info) = call_as(&server, Some(&key), Method::GET, &format!("/v1/projects/{}", p.id), None).await;
        assert_eq!(info["usage"]["sandboxes"], json!(2), "{info}");
        // The node's metrics count it by project too (the admin key may read them).
        let metrics = server.request(Method::GET, "/metrics").send().await.expect("GET /metrics");
        let text = metrics.text().await.expect("the metrics text");
        let labels = format!("project=\"{}\",backend=\"container\",state=\"running\"", p.id);
        let series = format!("warren_project_sandboxes{{{labels}}} 2");
        assert!(text.lines().any(|l| l == series), "no `{series}` in:\n{text}");
        // Room comes back with a delete.
        let (status, body) =
            call_as(&server, Some(&key), Method::DELETE, &format!("/v1/sandboxes/{}", first.id), None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        create_as(&server, &key, small(over)).await;
    }
    server.finish().await;
}

#[tokio::test]
async fn a_queued_create_waits_for_quota_instead_of_failing() {
    let server = TestServer::start_with_auth(&[]).await;
    let p = project(&server, None, "one", json!({"sandboxes": 1})).await;
    let key = key_of(&server, &p.id).await;
    let first = create_as(&server, &key, small(json!({}))).await;
    let waiting = {
        let (url, key) = (server.url.clone(), key.clone());
        tokio::spawn(async move {
            let http = reqwest::Client::builder().no_proxy().build().expect("an HTTP client");
            let rb = http.post(format!("{url}/v1/sandboxes?queue=true")).bearer_auth(key).json(&small(json!({})));
            api::json_response(api::send(rb).await).await
        })
    };
    // It waits while the quota is full (it cannot have been answered: nothing freed room).
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a queued create over quota was answered before room came back");
    let (status, body) =
        call_as(&server, Some(&key), Method::DELETE, &format!("/v1/sandboxes/{}", first.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = waiting.await.expect("the waiting create");
    assert_eq!(status, StatusCode::CREATED, "{body}");
    server.finish().await;
}

#[tokio::test]
async fn the_creation_rate_quota_refuses_a_burst() {
    let server = TestServer::start_with_auth(&[]).await;
    let p = project(&server, None, "slow", json!({"creates_per_sec": 1})).await;
    let key = key_of(&server, &p.id).await;
    // Four at once: the bucket holds one second's worth, one create.
    let burst: Vec<_> = (0..4)
        .map(|_| {
            let (url, key) = (server.url.clone(), key.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::builder().no_proxy().build().expect("an HTTP client");
                let resp =
                    api::send(http.post(format!("{url}/v1/sandboxes")).bearer_auth(key).json(&small(json!({})))).await;
                let retry_after = resp.headers().get("retry-after").is_some();
                (api::json_response(resp).await, retry_after)
            })
        })
        .collect();
    let (mut made, mut refused) = (0, 0);
    for call in burst {
        let ((status, body), retry_after) = call.await.expect("a burst create");
        match status {
            StatusCode::CREATED => made += 1,
            _ => {
                assert_quota_refusal(status, &body, &p.id, QuotaKind::CreatesPerSec);
                assert!(retry_after, "a rate refusal says when to retry");
                refused += 1;
            }
        }
    }
    assert!(made >= 1 && refused >= 1, "made {made}, refused {refused}");
    // Queued, a create waits for its turn instead.
    let (status, body) =
        call_as(&server, Some(&key), Method::POST, "/v1/sandboxes?queue=true", Some(&small(json!({})))).await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    server.finish().await;
}

#[tokio::test]
async fn a_revoked_key_is_refused_from_the_next_request_on() {
    let server = TestServer::start_with_auth(&[]).await;
    let a = project(&server, None, "a", json!({})).await;
    let b = project(&server, None, "b", json!({})).await;
    let (status, value) = server.call(Method::POST, &format!("/v1/projects/{}/keys", a.id), Some(&json!({}))).await;
    assert_eq!(status, StatusCode::CREATED, "{value}");
    let made: ApiKeyCreated = from_json(value);
    let b_key = key_of(&server, &b.id).await;
    assert_eq!(list_as(&server, &made.secret).await, Vec::<String>::new());
    // Another project's key cannot see it, so cannot revoke it.
    let (status, body) =
        call_as(&server, Some(&b_key), Method::DELETE, &format!("/v1/keys/{}", made.key.id), None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let (status, body) = server.call(Method::DELETE, &format!("/v1/keys/{}", made.key.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = call_as(&server, Some(&made.secret), Method::GET, "/v1/sandboxes", None).await;
    assert_api_error(status, &body, ErrorCode::Unauthorized, None);
    server.finish().await;
}

#[tokio::test]
async fn a_forgotten_sandboxs_trajectory_stays_with_its_project() {
    let server = TestServer::start_with_auth(&["--ended-retention-secs", "1"]).await;
    let a = project(&server, None, "a", json!({})).await;
    let b = project(&server, None, "b", json!({})).await;
    let (a_key, b_key) = (key_of(&server, &a.id).await, key_of(&server, &b.id).await);
    let sb = create_as(&server, &b_key, small(json!({}))).await;
    let exec = json!({"argv": ["true"]});
    let (status, body) =
        call_as(&server, Some(&b_key), Method::POST, &format!("/v1/sandboxes/{}/exec?wait=true", sb.id), Some(&exec))
            .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) =
        call_as(&server, Some(&b_key), Method::DELETE, &format!("/v1/sandboxes/{}", sb.id), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The record is forgotten after the retention; the trajectory stays.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let (status, _) = call_as(&server, Some(&b_key), Method::GET, &format!("/v1/sandboxes/{}", sb.id), None).await;
        if status == StatusCode::NOT_FOUND {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the ended record was never forgotten");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let path = format!("/v1/sandboxes/{}/trajectory", sb.id);
    let (status, body) = call_as(&server, Some(&b_key), Method::GET, &path, None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["origin"]["project"], json!(b.id), "{body}");
    let (status, body) = call_as(&server, Some(&a_key), Method::GET, &path, None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    let (status, body) =
        call_as(&server, Some(&a_key), Method::POST, &format!("{path}/replay"), Some(&json!({}))).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    server.finish().await;
}

#[tokio::test]
async fn with_auth_on_and_no_e2b_key_the_e2b_routes_are_not_an_open_door() {
    let server = TestServer::start_with_auth(&[]).await;
    let b = project(&server, None, "b", json!({})).await;
    let b_key = key_of(&server, &b.id).await;
    create_as(&server, &b_key, small(json!({}))).await;
    // E2B's `GET /sandboxes` would list every project's sandboxes: not served.
    let (status, body) = call_as(&server, None, Method::GET, "/sandboxes", None).await;
    assert_api_error(status, &body, ErrorCode::Unauthorized, None);
    let (status, body) = server.call(Method::GET, "/sandboxes", None).await;
    assert_api_error(status, &body, ErrorCode::NotFound, None);
    server.finish().await;
}

#[tokio::test]
async fn a_retried_create_gets_its_sandbox_even_at_a_full_quota() {
    let server = TestServer::start_with_auth(&[]).await;
    let p = project(&server, None, "one", json!({"sandboxes": 2})).await;
    let key = key_of(&server, &p.id).await;
    let first = create_as(&server, &key, small(json!({"idempotency_key": "job-1"}))).await;
    create_as(&server, &key, small(json!({}))).await;
    // Full: a new create is refused, a retry of the first answers with its sandbox.
    let (status, body) = call_as(&server, Some(&key), Method::POST, "/v1/sandboxes", Some(&small(json!({})))).await;
    assert_quota_refusal(status, &body, &p.id, QuotaKind::Sandboxes);
    let retry = small(json!({"idempotency_key": "job-1"}));
    let (status, body) = call_as(&server, Some(&key), Method::POST, "/v1/sandboxes", Some(&retry)).await;
    assert_eq!((status, &body["id"]), (StatusCode::OK, &json!(first.id)), "{body}");
    server.finish().await;
}

/// The NDJSON frames of a batch answer, as JSON values.
async fn batch_as(server: &TestServer, key: &str, body: &Value) -> (StatusCode, Vec<Value>) {
    let http = reqwest::Client::builder().no_proxy().build().expect("an HTTP client");
    let rb = http.post(format!("{}/v1/sandboxes/batch", server.url)).bearer_auth(key).json(body);
    let resp = api::send(rb).await;
    let status = resp.status();
    let text = resp.text().await.expect("the batch answer");
    let frames = text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
    (status, frames)
}

#[tokio::test]
async fn a_batch_takes_quota_for_its_new_items_only() {
    let server = TestServer::start_with_auth(&[]).await;
    let p = project(&server, None, "batch", json!({"sandboxes": 2})).await;
    let key = key_of(&server, &p.id).await;
    // More than the quota at all: refused at once, even though batches queue.
    let (status, frames) = batch_as(&server, &key, &json!({"count": 3, "template": small(json!({}))})).await;
    assert_quota_refusal(status, &frames[0], &p.id, QuotaKind::Sandboxes);
    let batch = json!({"count": 2, "template": small(json!({})), "batch_key": "b1"});
    let (status, frames) = batch_as(&server, &key, &batch).await;
    assert_eq!(status, StatusCode::OK);
    let done = frames.last().expect("a done frame");
    assert_eq!((&done["type"], &done["made"]), (&json!("done"), &json!(2)), "{frames:?}");
    // The project is full now; the same batch again is a retry and answers.
    let (status, frames) = batch_as(&server, &key, &batch).await;
    assert_eq!(status, StatusCode::OK);
    let done = frames.last().expect("a done frame");
    assert_eq!((&done["made"], &done["existing"]), (&json!(0), &json!(2)), "{frames:?}");
    server.finish().await;
}

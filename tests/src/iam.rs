//! IAM helpers shared by the suites that run with `--auth on` (one
//! embedded server, or a cluster's API servers): requests as a given key,
//! projects and keys made with the admin key, and the quota refusal's shape.

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use warren_api::{ApiKeyCreated, ErrorCode, ProjectInfo, QuotaExceededError, QuotaKind, SandboxInfo, SandboxList};

use crate::{api, from_json, TestServer};

/// One request as `key` (`None`: no `Authorization` header at all).
pub async fn call_as(
    server: &TestServer,
    key: Option<&str>,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let http = reqwest::Client::builder().no_proxy().build().expect("an HTTP client");
    let mut rb = http.request(method, format!("{}{path}", server.url));
    if let Some(k) = key {
        rb = rb.bearer_auth(k);
    }
    if let Some(b) = body {
        rb = rb.json(b);
    }
    api::json_response(api::send(rb).await).await
}

/// A project made by `key` (`None`: the admin key), asserting 201.
pub async fn project(server: &TestServer, key: Option<&str>, name: &str, quota: Value) -> ProjectInfo {
    let body = json!({"name": name, "quota": quota});
    let (status, value) = match key {
        Some(k) => call_as(server, Some(k), Method::POST, "/v1/projects", Some(&body)).await,
        None => server.call(Method::POST, "/v1/projects", Some(&body)).await,
    };
    assert_eq!(status, StatusCode::CREATED, "create project {body}: {value}");
    from_json(value)
}

/// A new key of `project`, made with the admin key.
pub async fn key_of(server: &TestServer, project: &str) -> String {
    let (status, value) =
        server.call(Method::POST, &format!("/v1/projects/{project}/keys"), Some(&json!({"name": "test"}))).await;
    assert_eq!(status, StatusCode::CREATED, "create key: {value}");
    let made: ApiKeyCreated = from_json(value);
    assert_eq!(made.key.project, project);
    made.secret
}

pub async fn create_as(server: &TestServer, key: &str, body: Value) -> SandboxInfo {
    let (status, value) = call_as(server, Some(key), Method::POST, "/v1/sandboxes", Some(&body)).await;
    assert_eq!(status, StatusCode::CREATED, "create {body}: {value}");
    from_json(value)
}

pub async fn list_as(server: &TestServer, key: &str) -> Vec<String> {
    let (status, value) = call_as(server, Some(key), Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK, "list: {value}");
    from_json::<SandboxList>(value).sandboxes.into_iter().map(|s| s.id).collect()
}

/// Asserts a 429 `quota_exceeded` naming `project` and `kind`.
pub fn assert_quota_refusal(status: StatusCode, body: &Value, project: &str, kind: QuotaKind) -> QuotaExceededError {
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    let refusal: QuotaExceededError = from_json(body.clone());
    assert_eq!(refusal.code, ErrorCode::QuotaExceeded, "{body}");
    assert_eq!((refusal.project.as_str(), refusal.quota), (project, kind), "{body}");
    assert_eq!(refusal.field.as_deref(), Some(format!("quota.{}", kind.as_str()).as_str()));
    refusal
}

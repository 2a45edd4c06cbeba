//! E2B's control API (e2b-dev/infra `spec/openapi.yml`) on the node:
//! templateID -> image, metadata -> labels, envVars -> env, timeout ->
//! lifetime. Unknown request fields are ignored; errors are
//! `{"code": <status>, "message"}`.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use warren_api::{CreateSandboxRequest, SandboxInfo, SandboxState, MAX_TIMEOUT_SECS};

use crate::error::ControlError;
use crate::{time, E2b, ENVD_VERSION, HOME, SDK_DEFAULT_TEMPLATE};

/// E2B's default sandbox timeout when the request gives none.
const DEFAULT_TIMEOUT_SECS: u64 = 15;
/// E2B's `clientID` is a legacy field the SDK still requires.
const CLIENT_ID: &str = "warren";
/// Page size of `GET /v2/sandboxes` when the client gives no `limit`.
const DEFAULT_PAGE: usize = 100;
const MAX_PAGE: usize = 100;

/// `NewSandbox` (v1) and `NewSandboxV2`: the fields Warren uses.
#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID", default)]
    pub template_id: String,
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub env_vars: Option<BTreeMap<String, String>>,
}

/// `Sandbox`: the answer of create and connect.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxOut {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    alias: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    domain: Option<String>,
}

/// `SandboxDetail` and `ListedSandbox` (the latter is a subset).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxDetail {
    #[serde(rename = "templateID")]
    template_id: String,
    alias: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: &'static str,
    started_at: String,
    end_at: String,
    envd_version: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    domain: Option<String>,
    cpu_count: u64,
    #[serde(rename = "memoryMB")]
    memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u64,
    metadata: BTreeMap<String, String>,
    state: &'static str,
}

/// Maps an E2B create onto Warren's create request.
pub fn create_request(
    body: NewSandbox,
    default_template: &str,
    idempotency_key: Option<String>,
) -> Result<CreateSandboxRequest, ControlError> {
    let timeout = body.timeout.unwrap_or(DEFAULT_TIMEOUT_SECS);
    if timeout == 0 || timeout > MAX_TIMEOUT_SECS {
        return Err(ControlError::bad_request(format!("timeout: must be between 1 and {MAX_TIMEOUT_SECS} seconds")));
    }
    let image = match body.template_id.as_str() {
        "" | SDK_DEFAULT_TEMPLATE => default_template.to_string(),
        other => other.to_string(),
    };
    Ok(CreateSandboxRequest {
        image,
        labels: body.metadata.unwrap_or_default(),
        env: body.env_vars.unwrap_or_default(),
        lifetime_secs: timeout,
        // E2B sandboxes have a timeout and no idle timeout.
        idle_timeout_secs: MAX_TIMEOUT_SECS,
        idempotency_key,
        ..CreateSandboxRequest::default()
    })
}

fn parse_body<T: for<'de> Deserialize<'de> + Default>(body: &Bytes) -> Result<T, ControlError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| ControlError::bad_request(format!("invalid request body: {e}")))
}

fn sandbox_out(state: &E2b, headers: &HeaderMap, info: &SandboxInfo) -> SandboxOut {
    SandboxOut {
        template_id: info.image.clone(),
        sandbox_id: info.id.clone(),
        alias: info.image.clone(),
        client_id: CLIENT_ID,
        envd_version: ENVD_VERSION,
        envd_access_token: state.token_for(headers, &info.id),
        domain: None,
    }
}

fn state_name(s: SandboxState) -> Option<&'static str> {
    match s {
        SandboxState::Creating | SandboxState::Running => Some("running"),
        SandboxState::Paused => Some("paused"),
        _ => None,
    }
}

fn detail(state: &E2b, headers: &HeaderMap, info: &SandboxInfo) -> Option<SandboxDetail> {
    let started = info.started_at_ms.unwrap_or(info.created_at_ms);
    Some(SandboxDetail {
        template_id: info.image.clone(),
        alias: info.image.clone(),
        sandbox_id: info.id.clone(),
        client_id: CLIENT_ID,
        started_at: time::rfc3339(started),
        end_at: time::rfc3339(info.created_at_ms + info.lifetime_secs * 1000),
        envd_version: ENVD_VERSION,
        envd_access_token: state.token_for(headers, &info.id),
        domain: None,
        cpu_count: info.resources.cpus.ceil() as u64,
        memory_mb: info.resources.memory_mib,
        disk_size_mb: info.resources.disk_mib,
        metadata: info.labels.clone(),
        state: state_name(info.state)?,
    })
}

/// A live sandbox's record; ended ones are "not found", as in E2B.
fn live_info(state: &E2b, id: &str) -> Result<SandboxInfo, ControlError> {
    let info = state.node.get(id)?;
    if state_name(info.state).is_none() {
        return Err(ControlError::not_found(id));
    }
    Ok(info)
}

async fn create(state: E2b, headers: HeaderMap, body: Bytes, idempotent: bool) -> Result<Response, ControlError> {
    let key = match idempotent {
        true => headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_string),
        false => None,
    };
    let req = create_request(parse_body(&body)?, &state.cfg.default_template, key)?;
    state.procs.forget_gone(&state.node);
    let (info, _) = state.node.create(req).await?;
    // Relative paths and default working directories live here in E2B.
    if let Err(e) = state.node.mkdir_stepped(&info.id, HOME.to_string(), 0o755, true, None).await {
        tracing::warn!(sandbox = %info.id, "cannot make {HOME}: {e}");
    }
    Ok((StatusCode::CREATED, Json(sandbox_out(&state, &headers, &info))).into_response())
}

pub async fn create_v1(State(state): State<E2b>, headers: HeaderMap, body: Bytes) -> Result<Response, ControlError> {
    create(state, headers, body, false).await
}

pub async fn create_v2(State(state): State<E2b>, headers: HeaderMap, body: Bytes) -> Result<Response, ControlError> {
    create(state, headers, body, true).await
}

pub async fn get_sandbox(
    State(state): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ControlError> {
    let info = live_info(&state, &id)?;
    let d = detail(&state, &headers, &info).ok_or_else(|| ControlError::not_found(&id))?;
    Ok(Json(d).into_response())
}

pub async fn kill(State(state): State<E2b>, Path(id): Path<String>) -> Result<StatusCode, ControlError> {
    live_info(&state, &id)?;
    state.node.delete(&id).await?;
    state.procs.forget_sandbox(&id);
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
pub struct TimeoutBody {
    #[serde(default)]
    timeout: Option<u64>,
}

pub async fn set_timeout(
    State(state): State<E2b>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ControlError> {
    let body: TimeoutBody = parse_body(&body)?;
    let timeout = body.timeout.ok_or_else(|| ControlError::bad_request("timeout: required"))?;
    live_info(&state, &id)?;
    state.node.set_remaining_lifetime(&id, timeout).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/refreshes`: keeps the sandbox alive `duration`
/// more seconds (never shortens it).
pub async fn refresh(
    State(state): State<E2b>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ControlError> {
    #[derive(Default, Deserialize)]
    struct Refresh {
        #[serde(default)]
        duration: Option<u64>,
    }
    let body: Refresh = parse_body(&body)?;
    extend_to(&state, &id, body.duration.unwrap_or(DEFAULT_TIMEOUT_SECS)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Makes the sandbox live at least `secs` more seconds.
async fn extend_to(state: &E2b, id: &str, secs: u64) -> Result<SandboxInfo, ControlError> {
    let info = live_info(state, id)?;
    let ends_at_ms = info.created_at_ms + info.lifetime_secs * 1000;
    if ends_at_ms < warren_node::now_ms() + secs * 1000 {
        return Ok(state.node.set_remaining_lifetime(id, secs).await?);
    }
    Ok(info)
}

pub async fn pause(State(state): State<E2b>, Path(id): Path<String>) -> Result<StatusCode, ControlError> {
    let info = live_info(&state, &id)?;
    if info.state == SandboxState::Paused {
        return Err(ControlError::new(StatusCode::CONFLICT, format!("sandbox \"{id}\" is already paused")));
    }
    state.node.pause(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
pub struct ConnectBody {
    #[serde(default)]
    timeout: Option<u64>,
}

/// `POST /sandboxes/{id}/resume` (deprecated in E2B, kept for old SDKs).
pub async fn resume(
    State(state): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ControlError> {
    let info = live_info(&state, &id)?;
    if info.state != SandboxState::Paused {
        return Err(ControlError::new(StatusCode::CONFLICT, format!("sandbox \"{id}\" is not paused")));
    }
    connect(State(state), headers, Path(id), body).await
}

/// Connect (v1 and v2): resumes a paused sandbox (201) or answers a running
/// one (200); a `timeout` extends its life to at least that many seconds.
pub async fn connect(
    State(state): State<E2b>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ControlError> {
    let body: ConnectBody = parse_body(&body)?;
    let before = live_info(&state, &id)?;
    let resumed = before.state == SandboxState::Paused;
    if resumed {
        state.node.resume(&id).await?;
    }
    let info = match body.timeout {
        Some(t) if t > 0 => extend_to(&state, &id, t).await?,
        _ => live_info(&state, &id)?,
    };
    let status = if resumed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(sandbox_out(&state, &headers, &info))).into_response())
}

/// Query of `GET /v2/sandboxes` (and the older `GET /sandboxes`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    #[serde(default)]
    metadata: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    next_token: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    /// Only sandboxes of this template (image).
    #[serde(default)]
    template: Option<String>,
}

/// The metadata filter: `k=v&k2=v2`, each key and value percent-encoded once
/// more by the SDK (E2B's server unescapes them after parsing the pairs).
pub fn parse_metadata_filter(raw: &str) -> Result<BTreeMap<String, String>, ControlError> {
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(raw)
        .map_err(|e| ControlError::bad_request(format!("metadata: not a query string: {e}")))?;
    pairs.into_iter().map(|(k, v)| Ok((percent_decode(&k)?, percent_decode(&v)?))).collect()
}

fn percent_decode(s: &str) -> Result<String, ControlError> {
    let bad = || ControlError::bad_request(format!("metadata: bad percent-encoding in `{s}`"));
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).ok_or_else(bad)?;
            let hex = std::str::from_utf8(hex).map_err(|_| bad())?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

fn parse_states(raw: Option<&str>) -> Result<Vec<&'static str>, ControlError> {
    let Some(raw) = raw.filter(|r| !r.is_empty()) else { return Ok(vec!["running", "paused"]) };
    raw.split(',')
        .map(|s| match s.trim() {
            "running" => Ok("running"),
            "paused" => Ok("paused"),
            other => Err(ControlError::bad_request(format!("state: unknown state `{other}` (running, paused)"))),
        })
        .collect()
}

/// The page after `token` (a listing is ordered by creation time, then id),
/// and the token of the next page if there is one.
fn page(
    items: Vec<SandboxInfo>,
    token: Option<&str>,
    limit: usize,
) -> Result<(Vec<SandboxInfo>, Option<String>), ControlError> {
    let after = match token.filter(|t| !t.is_empty()) {
        Some(t) => {
            let (ms, id) = t.split_once('_').ok_or_else(|| ControlError::bad_request("nextToken: not a token"))?;
            let ms: u64 = ms.parse().map_err(|_| ControlError::bad_request("nextToken: not a token"))?;
            Some((ms, id.to_string()))
        }
        None => None,
    };
    let mut rest: Vec<SandboxInfo> = items
        .into_iter()
        .filter(|i| after.as_ref().is_none_or(|(ms, id)| (i.created_at_ms, &i.id) > (*ms, id)))
        .collect();
    let next = (rest.len() > limit).then(|| {
        let last = &rest[limit - 1];
        format!("{}_{}", last.created_at_ms, last.id)
    });
    rest.truncate(limit);
    Ok((rest, next))
}

async fn list(state: E2b, headers: HeaderMap, q: ListQuery, paged: bool) -> Result<Response, ControlError> {
    let labels = match q.metadata.as_deref() {
        Some(m) if !m.is_empty() => parse_metadata_filter(m)?,
        _ => BTreeMap::new(),
    };
    let states = parse_states(q.state.as_deref())?;
    let all: Vec<SandboxInfo> = state
        .node
        .list(&labels, None)?
        .into_iter()
        .filter(|i| state_name(i.state).is_some_and(|s| states.contains(&s)))
        .filter(|i| q.template.as_deref().is_none_or(|t| t.is_empty() || t == i.image))
        .collect();
    let limit = q.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    let (items, next) = if paged { page(all, q.next_token.as_deref(), limit)? } else { (all, None) };
    let body: Vec<SandboxDetail> = items
        .iter()
        .filter_map(|i| detail(&state, &headers, i))
        .map(|mut d| {
            // Listings never carry access tokens.
            d.envd_access_token = None;
            d
        })
        .collect();
    let mut resp = Json(body).into_response();
    if let Some(next) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", next);
    }
    Ok(resp)
}

pub async fn list_v2(
    State(state): State<E2b>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, ControlError> {
    list(state, headers, q, true).await
}

pub async fn list_v1(
    State(state): State<E2b>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, ControlError> {
    list(state, headers, ListQuery { state: Some("running".into()), ..q }, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(id: &str, created: u64) -> SandboxInfo {
        let mut i: SandboxInfo = serde_json::from_value(serde_json::json!({
            "id": id, "backend": "container", "image": "busybox", "state": "running",
            "resources": serde_json::to_value(warren_api::Resources::of(&CreateSandboxRequest::default())).unwrap(),
            "network": "none", "labels": {}, "idle_timeout_secs": 60, "lifetime_secs": 60,
            "created_at_ms": created, "last_activity_at_ms": created, "from_pool": false
        }))
        .unwrap();
        i.created_at_ms = created;
        i
    }

    #[test]
    fn create_maps_template_metadata_env_and_timeout() {
        let body: NewSandbox = serde_json::from_value(serde_json::json!({
            "templateID": "python", "timeout": 120, "metadata": {"team": "rl"},
            "envVars": {"A": "1"}, "autoPause": false, "secure": true, "brandNew": {"x": 1}
        }))
        .unwrap();
        let req = create_request(body, "busybox", Some("k1".into())).unwrap();
        assert_eq!((req.image.as_str(), req.lifetime_secs), ("python", 120));
        assert_eq!(req.labels.get("team").map(String::as_str), Some("rl"));
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(req.idle_timeout_secs, MAX_TIMEOUT_SECS);
    }

    #[test]
    fn the_sdk_default_template_and_no_timeout_take_the_defaults() {
        let req = create_request(NewSandbox { template_id: "base".into(), ..Default::default() }, "img", None).unwrap();
        assert_eq!((req.image.as_str(), req.lifetime_secs), ("img", DEFAULT_TIMEOUT_SECS));
        let null_maps: NewSandbox =
            serde_json::from_value(serde_json::json!({"templateID": "", "metadata": null, "envVars": null})).unwrap();
        assert_eq!(create_request(null_maps, "img", None).unwrap().image, "img");
        let zero = NewSandbox { timeout: Some(0), ..Default::default() };
        assert_eq!(create_request(zero, "img", None).unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn metadata_filter_is_unescaped_after_splitting() {
        // The SDK: urlencode({quote(k): quote(v)}), sent as one query value.
        let m = parse_metadata_filter("user%2520id=a%2526b&plain=x").unwrap();
        assert_eq!(m.get("user id").map(String::as_str), Some("a&b"));
        assert_eq!(m.get("plain").map(String::as_str), Some("x"));
        assert!(parse_metadata_filter("k=%zz").is_err());
    }

    #[test]
    fn states_default_to_running_and_paused() {
        assert_eq!(parse_states(None).unwrap(), ["running", "paused"]);
        assert_eq!(parse_states(Some("paused")).unwrap(), ["paused"]);
        assert_eq!(parse_states(Some("dead")).unwrap_err().status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn pages_follow_the_token_without_gaps_or_repeats() {
        let items: Vec<_> = (0..5).map(|n| info(&format!("sb-{n}"), 1000 + n / 2)).collect();
        let (p1, t1) = page(items.clone(), None, 2).unwrap();
        let (p2, t2) = page(items.clone(), t1.as_deref(), 2).unwrap();
        let (p3, t3) = page(items.clone(), t2.as_deref(), 2).unwrap();
        let ids: Vec<_> = p1.iter().chain(&p2).chain(&p3).map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["sb-0", "sb-1", "sb-2", "sb-3", "sb-4"]);
        assert!(t1.is_some() && t2.is_some() && t3.is_none());
        assert!(page(items, Some("garbage"), 2).is_err());
    }
}

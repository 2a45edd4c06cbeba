//! The API role: a stateless front for the cluster. It places creates on
//! nodes, proxies every sandbox call to the node the sandbox id names, and
//! answers for sandboxes whose node was lost from their placement records.
//! Any number run side by side; they share nothing but etcd.
//!
//! Served: `POST /v1/sandboxes` (placement; `?queue=true` waits for room),
//! `POST /v1/sandboxes/batch` (the same per item), `GET /v1/sandboxes` (every
//! node's list, merged), everything under `/v1/sandboxes/{id}` (proxied:
//! request and response bodies stream through, so exec output arrives as
//! the node sends it), `GET /v1/cluster`, `GET /v1/health`, `GET /metrics`
//! and `GET /v1/stats` (this server's and the cluster's numbers, see
//! [`crate::metrics`]), the `/ui` dashboard, and the IAM
//! routes (`/v1/projects...`, `/v1/keys/{id}`: warren-control's own, over
//! projects and keys in etcd). Every request passes `iam::authorize`
//! first: creates land in the caller's project within its quotas, and
//! another project's sandbox is not found. Everything else
//! (images, functions, E2B) answers 501 `unsupported` in this
//! role for now: images are imported on nodes (or pulled by them from the
//! blob store).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Extension, FromRef, Path, RawQuery, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use futures_util::TryStreamExt;
use serde_json::Value;
use warren_api::{
    ApiError, Backend, BatchCreateRequest, BatchFrame, ClusterStatus, ErrorCode, NodeStatus, Placement, SandboxInfo,
    SandboxList, SandboxState,
};
use warren_store::{StateStore, StateStoreExt, Table};
use warren_store_etcd::{Cas, EtcdStore, Expect};

use warren_control::{Auth, IamRoutes};
use warren_iam::Caller;

use crate::iam::{self, ClusterUsage};
use crate::ledger::QuotaLedger;
use crate::line::{FairLine, Place};
use crate::metrics::{ApiMetrics, ClusterLevels};
use crate::placement::{self, Ask, Candidate};
use crate::records::{self, Etcd, IdempotencyClaim, PlacementRecord};
use crate::rng::Rng;
use crate::token::{self, ClusterToken};
use crate::watcher::{self, NodeView};
use crate::ClusterError;

/// How long an API server waits to connect to a node.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How often a queued create looks for room again.
const QUEUE_RETRY: Duration = Duration::from_millis(200);

/// One API server's shared state.
#[derive(Clone)]
pub struct ApiState {
    etcd: Etcd,
    nodes: NodeView,
    http: reqwest::Client,
    token: ClusterToken,
    rng: Arc<Rng>,
    /// Creates this server sent each node, with when and how much memory:
    /// counted as load until the node's next heartbeat includes them.
    pending: Arc<Mutex<Sent>>,
    /// Creates waiting for room (`?queue=true`), fair across projects and
    /// bounded by [`warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT`].
    line: Arc<FairLine>,
    /// Projects, keys and the quota gate, on etcd.
    auth: Auth,
    /// What runs per project, as the quota gate counts it.
    usage: ClusterUsage,
    /// Room limited projects' creates hold cluster-wide.
    ledger: Arc<QuotaLedger>,
    metrics: Arc<ApiMetrics>,
}

impl FromRef<ApiState> for IamRoutes {
    fn from_ref(s: &ApiState) -> IamRoutes {
        IamRoutes { auth: Some(s.auth.clone()), usage: Arc::new(s.usage.clone()) }
    }
}

/// One place in the line of queued creates, given back on drop (when
/// its wait is counted).
struct QueuePlace {
    place: Place,
    since: Instant,
    metrics: Arc<ApiMetrics>,
}

impl Drop for QueuePlace {
    fn drop(&mut self) {
        self.metrics.left_queue(self.since.elapsed());
    }
}

/// Per node: `(unix ms, memory MiB)` of each create sent to it.
type Sent = HashMap<String, Vec<(u64, u64)>>;

/// A running API server.
pub struct ApiServer {
    pub addr: SocketAddr,
    pub task: tokio::task::JoinHandle<std::io::Result<()>>,
    watcher: tokio::task::JoinHandle<()>,
}

impl ApiServer {
    /// Stops watching; the server task ends with its shutdown future.
    pub fn abort_watcher(&self) {
        self.watcher.abort();
    }
}

/// Starts an API server on `listener` until `shutdown` resolves, with
/// IAM `auth` (see [`iam::open`]).
pub async fn start(
    listener: tokio::net::TcpListener,
    store: Arc<EtcdStore>,
    token: ClusterToken,
    auth: Auth,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<ApiServer, ClusterError> {
    let etcd = Etcd(store);
    let nodes = NodeView::default();
    let watcher = watcher::start(etcd.clone(), nodes.clone()).await?;
    let http = reqwest::Client::builder()
        .no_proxy()
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .map_err(|e| ClusterError::Config(format!("cannot build the HTTP client: {e}")))?;
    let usage = ClusterUsage::new(nodes.clone());
    let ledger = QuotaLedger::new(etcd.clone(), nodes.clone(), &warren_node::new_id("api"));
    let state = ApiState {
        etcd,
        nodes,
        http,
        token,
        rng: Arc::new(Rng::new()),
        pending: Arc::new(Mutex::new(HashMap::new())),
        line: FairLine::new(warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT),
        auth,
        usage,
        ledger,
        metrics: ApiMetrics::new(),
    };
    let addr = listener.local_addr()?;
    let task = tokio::spawn(axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).into_future());
    Ok(ApiServer { addr, task, watcher })
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/cluster", get(cluster_status))
        .route("/metrics", get(metrics_text))
        .route("/v1/stats", get(stats))
        .route("/v1/sandboxes", post(create).get(list))
        .route("/v1/sandboxes/batch", post(create_batch))
        .route("/v1/functions/run", post(run_function))
        .route("/v1/sandboxes/{id}", any(proxy))
        .route("/v1/sandboxes/{id}/{*rest}", any(proxy))
        .merge(crate::images::routes())
        .merge(warren_control::iam_routes())
        .merge(warren_control::ui_routes())
        .fallback(unsupported)
        .layer(axum::middleware::from_fn_with_state(state.clone(), iam::authorize))
        .with_state(state)
}

fn error(code: ErrorCode, message: impl Into<String>, field: Option<&str>) -> Response {
    Reject::new(code, message, field).into_response()
}

/// An error answer not yet turned into a response.
struct Reject(ApiError);

impl Reject {
    fn new(code: ErrorCode, message: impl Into<String>, field: Option<&str>) -> Reject {
        let mut body = ApiError::new(code, message);
        body.field = field.map(str::to_string);
        Reject(body)
    }
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.0)).into_response()
    }
}

fn store_error(e: ClusterError) -> Response {
    error(ErrorCode::StoreUnavailable, format!("the cluster's state store: {e}"), None)
}

async fn health() -> Json<Value> {
    Json(serde_json::json!({"status": "ok", "role": "api"}))
}

async fn unsupported(request: Request) -> Response {
    error(
        ErrorCode::Unsupported,
        format!(
            "{} {} is not served by a cluster API server yet (import images on the nodes, or use a node's own API)",
            request.method(),
            request.uri().path()
        ),
        None,
    )
}

async fn cluster_status(State(s): State<ApiState>) -> Response {
    let nodes = s.nodes.all();
    let lost = match lost_sandboxes(&s.etcd, &nodes).await {
        Ok(lost) => lost.len() as u64,
        Err(e) => return store_error(e),
    };
    Json(summarise(nodes, lost)).into_response()
}

/// `GET /metrics`: this API server's counters and the cluster's levels.
async fn metrics_text(State(s): State<ApiState>, headers: HeaderMap) -> Response {
    let (format, content_type) = warren_control::metrics_format(&headers);
    let nodes = s.nodes.all();
    let lost = match lost_sandboxes(&s.etcd, &nodes).await {
        Ok(lost) => Some(crate::metrics::lost_by_node(lost.iter().map(|info| info.id.as_str()))),
        Err(e) => {
            tracing::warn!("metrics: cannot read the placement records: {e}");
            None
        }
    };
    let queued = s.line.len() as u64;
    let text = s.metrics.encode(&ClusterLevels { nodes, lost, queued }, format);
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

/// `GET /v1/stats`: every live node's own, added up
/// ([`crate::metrics::merge_stats`] says what is approximate).
async fn stats(State(s): State<ApiState>) -> Response {
    let nodes = s.nodes.all();
    let (parts, lost) =
        tokio::join!(crate::metrics::fetch_node_stats(&s.http, &s.token, &nodes), lost_sandboxes(&s.etcd, &nodes));
    let lost = match lost {
        Ok(lost) => lost.len() as u64,
        Err(e) => return store_error(e),
    };
    let queued = s.line.len() as u64;
    Json(crate::metrics::merge_stats(&parts, queued, lost, warren_node::now_ms())).into_response()
}

/// The sandboxes given up with lost nodes (`live` are the nodes registered
/// now), as clients see them, from their placement records.
async fn lost_sandboxes(etcd: &Etcd, live: &[NodeStatus]) -> Result<Vec<SandboxInfo>, ClusterError> {
    let live: BTreeSet<String> = live.iter().map(|n| n.name.clone()).collect();
    etcd.call(move |s| {
        Ok(s.list_json::<PlacementRecord>(Table::Placements, "")?
            .into_iter()
            .filter(|(_, r)| r.lost_at_ms.is_some() && !live.contains(&r.placement.node))
            .map(|(_, r)| r.lost_info())
            .collect())
    })
    .await
}

/// The cluster's counts from the nodes' own.
pub fn summarise(nodes: Vec<NodeStatus>, lost: u64) -> ClusterStatus {
    let mut status = ClusterStatus {
        nodes: Vec::new(),
        running: 0,
        running_by_backend: BTreeMap::new(),
        running_by_node: BTreeMap::new(),
        running_by_label: BTreeMap::new(),
        live_by_project: BTreeMap::new(),
        lost,
    };
    for node in &nodes {
        let running: u64 = node.running_by_backend.values().sum();
        status.running += running;
        status.running_by_node.insert(node.name.clone(), running);
        for (backend, n) in &node.running_by_backend {
            *status.running_by_backend.entry(backend.clone()).or_insert(0) += n;
        }
        for (label, n) in &node.running_by_label {
            *status.running_by_label.entry(label.clone()).or_insert(0) += n;
        }
        for (project, usage) in &node.usage_by_project {
            *status.live_by_project.entry(project.clone()).or_insert(0) += usage.sandboxes;
        }
    }
    status.nodes = nodes;
    status
}

// ---- create -------------------------------------------------------------

/// What placement needs from a create body; the node validates the rest.
fn ask_of(body: &Value) -> Result<(Ask, Option<String>), Reject> {
    let Some(object) = body.as_object() else {
        return Err(Reject::new(ErrorCode::InvalidRequest, "the body must be a JSON object", None));
    };
    let backend = match object.get("backend") {
        None | Some(Value::Null) => Backend::Container,
        Some(v) => serde_json::from_value::<Backend>(v.clone()).map_err(|_| {
            Reject::new(
                ErrorCode::InvalidRequest,
                "unknown backend (function, container, microvm or vm)",
                Some("backend"),
            )
        })?,
    };
    let image = match object.get("image") {
        None | Some(Value::Null) => warren_api::DEFAULT_IMAGE.to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(Reject::new(ErrorCode::InvalidRequest, "must be a string", Some("image"))),
    };
    let memory_mib = match object.get("memory_mib") {
        None | Some(Value::Null) => warren_api::CreateSandboxRequest::default().memory_mib,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| Reject::new(ErrorCode::InvalidRequest, "must be a whole number", Some("memory_mib")))?,
    };
    let disk_mib = match object.get("disk_mib") {
        None | Some(Value::Null) => warren_api::CreateSandboxRequest::default().disk_mib,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| Reject::new(ErrorCode::InvalidRequest, "must be a whole number", Some("disk_mib")))?,
    };
    let key = match object.get("idempotency_key") {
        None | Some(Value::Null) => None,
        Some(Value::String(k)) if !k.is_empty() => Some(k.clone()),
        Some(_) => {
            return Err(Reject::new(ErrorCode::InvalidRequest, "must be a non-empty string", Some("idempotency_key")))
        }
    };
    Ok((Ask { backend, image, memory_mib, disk_mib }, key))
}

/// Answers a node gives that mean "not here", so placement tries another.
fn is_refusal(status: StatusCode, body: &Value) -> bool {
    let code = body.get("code").and_then(Value::as_str).unwrap_or_default();
    matches!(code, "capacity_exceeded" | "queue_full" | "image_not_found" | "unsupported_backend")
        || is_missing_image(body)
        || status == StatusCode::SERVICE_UNAVAILABLE
}

/// A node without the image answers `invalid_request` on `image`.
fn is_missing_image(body: &Value) -> bool {
    body.get("code").and_then(Value::as_str) == Some("invalid_request")
        && body.get("field").and_then(Value::as_str) == Some("image")
}

async fn create(
    State(s): State<ApiState>,
    Extension(caller): Extension<Caller>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let mut parsed: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(ErrorCode::InvalidRequest, format!("the body is not JSON: {e}"), None),
    };
    let (ask, key) = match ask_of(&parsed) {
        Ok(a) => a,
        Err(r) => return r.into_response(),
    };
    let queue = list_flag(query.as_deref(), "queue");
    let count = match iam::is_retry(&s.etcd, key.as_deref()).await {
        Ok(retry) => u64::from(!retry),
        Err(e) => return warren_control::iam_error(e),
    };
    // Held until the sandbox is counted as placed (or the create failed).
    let (project, quota) = match iam::admit(&s, &caller, &mut parsed, "project", count, queue).await {
        Ok(admitted) => admitted,
        Err(e) => return warren_control::iam_error(e),
    };
    let body = Bytes::from(serde_json::to_vec(&parsed).unwrap_or_default());
    let wait = queue.then_some(Wait { project: &project, on_wait: &|_| {} });
    let (status, answer) = place_and_count(&s, query.as_deref(), &body, &ask, key.as_deref(), wait).await;
    s.count_placed(status, &answer, &project, cpus_of(&parsed), ask.memory_mib);
    if let Some(held) = quota {
        let node = match status {
            StatusCode::CREATED => answer.pointer("/placement/node").and_then(Value::as_str).map(str::to_string),
            _ => None,
        };
        held.finish(node).await;
    }
    (status, Json(answer)).into_response()
}

/// The cpus a create body asks for (the node checks the value).
fn cpus_of(body: &Value) -> f64 {
    body.get("cpus").and_then(Value::as_f64).unwrap_or(warren_api::CreateSandboxRequest::default().cpus)
}

/// A status and JSON body, before it becomes a response (or a batch item).
type Answer = (StatusCode, Value);

fn answer_of(reject: Reject) -> Answer {
    let status = StatusCode::from_u16(reject.0.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, serde_json::to_value(&reject.0).unwrap_or(Value::Null))
}

fn store_answer(e: ClusterError) -> Answer {
    answer_of(Reject::new(ErrorCode::StoreUnavailable, format!("the cluster's state store: {e}"), None))
}

/// How a create waits for room (`?queue=true`): in its project's line,
/// calling `on_wait` with the whole line's length when it joins.
#[derive(Clone, Copy)]
struct Wait<'a> {
    project: &'a str,
    on_wait: &'a (dyn Fn(usize) + Send + Sync),
}

/// [`place_and_create`], counted in the API server's metrics.
async fn place_and_count(
    s: &ApiState,
    query: Option<&str>,
    body: &Bytes,
    ask: &Ask,
    key: Option<&str>,
    wait: Option<Wait<'_>>,
) -> Answer {
    let started = Instant::now();
    let (status, answer) = place_and_create(s, query, body, ask, key, wait).await;
    s.metrics.create_answered(ask.backend, status.as_u16(), &answer, started.elapsed());
    (status, answer)
}

/// Places one create and sends it to the chosen node, trying others on a
/// refusal; with `wait`, waits for room in the bounded line, fair across
/// projects (see [`crate::line`]): when others already wait it joins them
/// before its first try.
async fn place_and_create(
    s: &ApiState,
    query: Option<&str>,
    body: &Bytes,
    ask: &Ask,
    key: Option<&str>,
    wait: Option<Wait<'_>>,
) -> Answer {
    // A key already claimed goes where it went the first time.
    if let Some(key) = key {
        let claim_key = records::idempotency_key(key);
        let existing =
            s.etcd.call(move |st| Ok(st.get_json::<IdempotencyClaim>(Table::Idempotency, &claim_key)?)).await;
        match existing {
            Err(e) => return store_answer(e),
            Ok(Some(claim)) => {
                let placement = Placement {
                    node: claim.node.clone(),
                    reason: format!("idempotency key already placed on {}", claim.node),
                };
                return match forward_create(s, &claim.node, query, body).await {
                    Ok((status, answer)) => finish_create(s, status, answer, placement).await,
                    Err(r) => answer_of(r),
                };
            }
            Ok(None) => {}
        }
    }
    let mut place_in_line: Option<QueuePlace> = None;
    if let Some(wait) = wait.filter(|_| !s.line.is_empty()) {
        let Some(mut place) = s.join_queue(wait) else { return queue_full() };
        place.place.wait_turn(QUEUE_RETRY).await;
        place_in_line = Some(place);
    }
    let mut excluded = BTreeSet::new();
    let mut refusals = Vec::new();
    // The last node's answer when every refusal was "no such image": the
    // client's to see (a name no node holds), not a capacity problem.
    let mut missing_image: Option<Answer> = None;
    let mut only_missing_images = true;
    loop {
        let choice = {
            let nodes = s.nodes.all();
            let pending = s.pending_view(&nodes);
            let candidates: Vec<Candidate<'_>> = nodes
                .iter()
                .map(|n| {
                    let (count, memory) = pending.get(&n.name).copied().unwrap_or((0, 0));
                    Candidate { node: n, pending_sandboxes: count, pending_memory_mib: memory }
                })
                .collect();
            placement::choose(&candidates, ask, &excluded, &mut |n| s.rng.below(n))
        };
        let choice = match choice {
            Ok(c) => c,
            Err(why) => {
                if let (true, Some(answer)) = (only_missing_images, missing_image.take()) {
                    return answer;
                }
                // `?queue=true`: wait for room (a node may free some, or
                // join), in a bounded line, instead of refusing.
                if let Some(wait) = wait {
                    if place_in_line.is_none() {
                        match s.join_queue(wait) {
                            Some(place) => place_in_line = Some(place),
                            None => return queue_full(),
                        }
                    }
                    if let Some(place) = &mut place_in_line {
                        place.place.wait_turn(QUEUE_RETRY).await;
                    }
                    excluded.clear();
                    refusals.clear();
                    continue;
                }
                let refused = match refusals.is_empty() {
                    true => String::new(),
                    false => format!(" (refused: {})", refusals.join("; ")),
                };
                let message = format!("no node can take this sandbox: {why}{refused}");
                return answer_of(Reject::new(ErrorCode::CapacityExceeded, message, None));
            }
        };
        // Claim the key for this node before sending: of two API servers
        // racing on one key, the loser follows the winner's node.
        let mut node = choice.node.clone();
        let mut claimed = None;
        if let Some(key) = key {
            match claim(&s.etcd, key, &node).await {
                Ok(Claim::Ours(revision)) => claimed = Some(revision),
                Ok(Claim::Theirs(other)) => node = other,
                Err(e) => return store_answer(e),
            }
        }
        let mut reason = choice.reason.clone();
        if node != choice.node {
            reason = format!("idempotency key placed on {node} by another API server");
        }
        if !refusals.is_empty() {
            reason = format!("{reason}; refused first: {}", refusals.join("; "));
        }
        let placement = Placement { node: node.clone(), reason };
        s.note_pending(&node, ask.memory_mib);
        let outcome = forward_create(s, &node, query, body).await;
        let refused = match &outcome {
            Ok((status, answer)) if is_refusal(*status, answer) => {
                Some(answer.get("code").and_then(Value::as_str).unwrap_or("unavailable").to_string())
            }
            Ok(_) => None,
            Err(_) => Some("unreachable".to_string()),
        };
        // A key another server claimed stays on its node: that node's
        // refusal is the answer. Otherwise the next node may take it.
        if let Some(why) = refused.filter(|_| claimed.is_some() || key.is_none()) {
            match &outcome {
                Ok((status, answer)) if is_missing_image(answer) => missing_image = Some((*status, answer.clone())),
                _ => only_missing_images = false,
            }
            s.metrics.refused(&node, &why);
            refusals.push(format!("{node}: {why}"));
            excluded.insert(node.clone());
            if let (Some(key), Some(revision)) = (key, claimed) {
                if let Err(e) = release(&s.etcd, key, revision).await {
                    return store_answer(e);
                }
            }
            continue;
        }
        if let (Some(place), Ok((status, _))) = (&mut place_in_line, &outcome) {
            if status.is_success() {
                place.place.placed();
            }
        }
        return match outcome {
            Ok((status, answer)) => finish_create(s, status, answer, placement).await,
            Err(reject) => answer_of(reject),
        };
    }
}

/// Concurrent item creates of one batch (placement counts each as pending
/// load, so a batch spreads over the nodes).
const BATCH_PARALLEL: usize = 8;

/// `POST /v1/sandboxes/batch`: every item placed and created as a single
/// create would be, [`BATCH_PARALLEL`] at a time, answered as the same
/// NDJSON frames as on one node (`queued` while items wait for room).
async fn create_batch(State(s): State<ApiState>, Extension(caller): Extension<Caller>, body: Bytes) -> Response {
    let mut req: BatchCreateRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(ErrorCode::InvalidRequest, format!("the body is not a batch request: {e}"), None),
    };
    if let Err(e) = req.validate() {
        return Reject(e).into_response();
    }
    let new = match batch_retries(&s.etcd, &req).await {
        Ok(retries) => u64::from(req.count).saturating_sub(retries),
        Err(e) => return store_error(e),
    };
    let mut template = serde_json::to_value(&req.template).unwrap_or(Value::Null);
    let (project, quota) = match iam::admit(&s, &caller, &mut template, "template.project", new, req.queue).await {
        Ok(admitted) => admitted,
        Err(e) => return warren_control::iam_error(e),
    };
    req.template.project = template.get("project").and_then(Value::as_str).map(str::to_string);
    let quota = Arc::new(quota);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<BatchFrame>();
    tokio::spawn(async move {
        let permits = Arc::new(tokio::sync::Semaphore::new(BATCH_PARALLEL));
        let waiting = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut items = tokio::task::JoinSet::new();
        for index in 0..req.count {
            let item = req.item(index);
            let (s, tx, permits, waiting) = (s.clone(), tx.clone(), permits.clone(), waiting.clone());
            let (quota, project) = (quota.clone(), project.clone());
            let queue = req.queue;
            items.spawn(async move {
                let _permit = permits.acquire_owned().await;
                let body = Bytes::from(serde_json::to_vec(&item).unwrap_or_default());
                let ask = Ask {
                    backend: item.backend,
                    image: item.image.clone(),
                    memory_mib: item.memory_mib,
                    disk_mib: item.disk_mib,
                };
                let query = queue.then_some("queue=true");
                let joined = {
                    let (tx, waiting) = (tx.clone(), waiting.clone());
                    move |length: usize| {
                        let items_waiting = waiting.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                        let _ = tx.send(BatchFrame::Queued { position: length as u64, items_waiting });
                    }
                };
                let wait = queue.then_some(Wait { project: &project, on_wait: &joined });
                let (status, answer) =
                    place_and_count(&s, query, &body, &ask, item.idempotency_key.as_deref(), wait).await;
                s.count_placed(status, &answer, &project, item.cpus, item.memory_mib);
                // A retry (200) took no room; a made or failed item gives its share back.
                if let (Some(quota), false) = (quota.as_ref(), status == StatusCode::OK) {
                    quota.release_one();
                }
                (index, status, answer)
            });
        }
        let (mut made, mut existing, mut failed) = (0, 0, 0);
        while let Some(joined) = items.join_next().await {
            let Ok((index, status, answer)) = joined else {
                failed += 1;
                continue;
            };
            let frame = match serde_json::from_value::<SandboxInfo>(answer.clone()) {
                Ok(info) if status.is_success() => {
                    let fresh = status == StatusCode::CREATED;
                    *(if fresh { &mut made } else { &mut existing }) += 1;
                    s.metrics.batch_item(if fresh { "made" } else { "existing" });
                    BatchFrame::Item { index, sandbox: Some(Box::new(info)), made: fresh, error: None }
                }
                _ => {
                    failed += 1;
                    s.metrics.batch_item("failed");
                    let error = serde_json::from_value::<ApiError>(answer.clone()).unwrap_or_else(|_| {
                        ApiError::new(ErrorCode::Internal, format!("node answered {status}: {answer}"))
                    });
                    BatchFrame::Item { index, sandbox: None, made: false, error: Some(error) }
                }
            };
            let _ = tx.send(frame);
        }
        let _ = tx.send(BatchFrame::Done { made, existing, failed });
    });
    let lines = tokio_stream_lines(rx);
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response()
}

/// How many of a batch's items are retries: their keys were claimed
/// cluster-wide (one etcd list), so they make no sandbox and take no quota.
async fn batch_retries(etcd: &Etcd, req: &BatchCreateRequest) -> Result<u64, ClusterError> {
    let Some(batch_key) = req.batch_key.clone() else { return Ok(0) };
    let keys: BTreeSet<String> =
        (0..req.count).filter_map(|i| req.item(i).idempotency_key.map(|k| records::idempotency_key(&k))).collect();
    let prefix = records::idempotency_key(&format!("{batch_key}-"));
    etcd.call(move |st| {
        let claimed = st.list(Table::Idempotency, &prefix)?;
        Ok(claimed.iter().filter(|(k, _)| keys.contains(k)).count() as u64)
    })
    .await
}

/// Each frame as one NDJSON line.
fn tokio_stream_lines(
    rx: tokio::sync::mpsc::UnboundedReceiver<BatchFrame>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    futures_util::stream::unfold(rx, |mut rx| async move {
        let frame = rx.recv().await?;
        let mut line = serde_json::to_vec(&frame).unwrap_or_default();
        line.push(b'\n');
        Some((Ok(Bytes::from(line)), rx))
    })
}

enum Claim {
    /// This server claimed the key (at this etcd revision).
    Ours(i64),
    /// Another server did, for this node.
    Theirs(String),
}

async fn claim(etcd: &Etcd, key: &str, node: &str) -> Result<Claim, ClusterError> {
    let claim_key = records::idempotency_key(key);
    let value = serde_json::to_vec(&IdempotencyClaim { node: node.to_string() })
        .map_err(|e| ClusterError::Config(e.to_string()))?;
    etcd.call(move |s| match s.compare_and_swap(Table::Idempotency, &claim_key, Expect::Absent, &value)? {
        Cas::Done { revision } => Ok(Claim::Ours(revision)),
        Cas::Conflict { current } => {
            let node = current
                .and_then(|v| serde_json::from_slice::<IdempotencyClaim>(&v.value).ok())
                .map(|c| c.node)
                .ok_or_else(|| ClusterError::Config("an idempotency claim is unreadable".into()))?;
            Ok(Claim::Theirs(node))
        }
    })
    .await
}

/// Gives a claim up after its node refused, unless someone rewrote it.
async fn release(etcd: &Etcd, key: &str, revision: i64) -> Result<(), ClusterError> {
    let claim_key = records::idempotency_key(key);
    etcd.call(move |s| {
        s.compare_and_delete(Table::Idempotency, &claim_key, revision)?;
        Ok(())
    })
    .await
}

/// Sends the create to `node`; `Err` is the answer for the client when the
/// node cannot be reached.
async fn forward_create(
    s: &ApiState,
    node: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Result<(StatusCode, Value), Reject> {
    let Some(status) = s.nodes.get(node) else {
        return Err(Reject::new(ErrorCode::NodeUnavailable, format!("node {node} is not registered"), None));
    };
    let url = match query {
        Some(q) => format!("{}/v1/sandboxes?{q}", status.url),
        None => format!("{}/v1/sandboxes", status.url),
    };
    let sent = s
        .http
        .post(url)
        .header(token::HEADER, s.token.as_str())
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.clone())
        .send()
        .await;
    let unreachable = |e: reqwest::Error| Reject::new(ErrorCode::NodeUnavailable, format!("node {node}: {e}"), None);
    let response = sent.map_err(unreachable)?;
    let code = StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = response.bytes().await.map_err(unreachable)?;
    let value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((code, value))
}

/// Records the placement of a created sandbox and answers the client.
async fn finish_create(s: &ApiState, status: StatusCode, mut answer: Value, placement: Placement) -> Answer {
    if status.is_success() {
        if let Ok(mut info) = serde_json::from_value::<SandboxInfo>(answer.clone()) {
            info.placement = Some(placement.clone());
            let record = PlacementRecord { sandbox: info.clone(), placement: placement.clone(), lost_at_ms: None };
            // A retried idempotent create keeps the first placement's words.
            let existing = s.etcd.placement(&placement.node, &info.id).await;
            let record = match existing {
                Ok(Some(first)) => first,
                Ok(None) => {
                    if let Err(e) = s.etcd.put_placement(record.clone()).await {
                        return store_answer(e);
                    }
                    record
                }
                Err(e) => return store_answer(e),
            };
            info.placement = Some(record.placement);
            answer = serde_json::to_value(&info).unwrap_or(answer);
        }
    }
    (status, answer)
}

fn queue_full() -> Answer {
    let limit = warren_api::DEFAULT_ADMISSION_QUEUE_LIMIT;
    let body = warren_api::QueueFullError {
        code: ErrorCode::QueueFull,
        message: format!("the cluster is full and {limit} creates wait already; retry later"),
        field: Some("queue".into()),
        queue_limit: limit as u64,
    };
    (StatusCode::TOO_MANY_REQUESTS, serde_json::to_value(&body).unwrap_or(Value::Null))
}

impl ApiState {
    pub(crate) fn auth(&self) -> &Auth {
        &self.auth
    }

    pub(crate) fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    pub(crate) fn usage(&self) -> &ClusterUsage {
        &self.usage
    }

    pub(crate) fn nodes(&self) -> &NodeView {
        &self.nodes
    }

    pub(crate) fn ledger(&self) -> &Arc<QuotaLedger> {
        &self.ledger
    }

    /// Counts a sandbox a create just made (201) against its project
    /// until its node's heartbeat does.
    fn count_placed(&self, status: StatusCode, answer: &Value, project: &str, cpus: f64, memory_mib: u64) {
        if status != StatusCode::CREATED {
            return;
        }
        if let Some(node) = answer.pointer("/placement/node").and_then(Value::as_str) {
            self.usage.note_placed(node, project, cpus, memory_mib);
        }
    }

    /// A place in the project's line of waiting creates (telling
    /// `on_wait` the whole line's length); `None` when the line is full.
    fn join_queue(&self, wait: Wait<'_>) -> Option<QueuePlace> {
        let (place, length) = self.line.join(wait.project)?;
        (wait.on_wait)(length);
        Some(QueuePlace { place, since: Instant::now(), metrics: self.metrics.clone() })
    }

    fn note_pending(&self, node: &str, memory_mib: u64) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        pending.entry(node.to_string()).or_default().push((warren_node::now_ms(), memory_mib));
    }

    /// Per node: creates sent since its last heartbeat, and their memory.
    fn pending_view(&self, nodes: &[NodeStatus]) -> HashMap<String, (u64, u64)> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = HashMap::new();
        for node in nodes {
            if let Some(sent) = pending.get_mut(&node.name) {
                sent.retain(|(at, _)| *at >= node.heartbeat_at_ms);
                out.insert(node.name.clone(), (sent.len() as u64, sent.iter().map(|(_, m)| m).sum()));
            }
        }
        pending.retain(|name, sent| !sent.is_empty() && nodes.iter().any(|n| &n.name == name));
        out
    }
}

// ---- list ---------------------------------------------------------------

async fn list(State(s): State<ApiState>, Extension(caller): Extension<Caller>, RawQuery(query): RawQuery) -> Response {
    let nodes = s.nodes.all();
    let (wanted_state, label) = list_filters(query.as_deref());
    let mut all: Vec<SandboxInfo> = Vec::new();
    let calls = nodes.iter().map(|node| {
        let url = match &query {
            Some(q) => format!("{}/v1/sandboxes?{q}", node.url),
            None => format!("{}/v1/sandboxes", node.url),
        };
        let request = s.http.get(url).header(token::HEADER, s.token.as_str()).send();
        async move {
            let unreachable = |e: reqwest::Error| (None, e.to_string());
            let response = request.await.map_err(unreachable)?;
            let status = response.status();
            let bytes = response.bytes().await.map_err(unreachable)?;
            if !status.is_success() {
                return Err((Some(status), String::from_utf8_lossy(&bytes).into_owned()));
            }
            serde_json::from_slice::<SandboxList>(&bytes).map_err(|e| (None, e.to_string()))
        }
    });
    for (node, answer) in nodes.iter().zip(futures_util::future::join_all(calls).await) {
        match answer {
            Ok(list) => all.extend(list.sandboxes),
            // A bad filter is the client's: every node says the same, so
            // its answer (naming the field) is the client's answer.
            Err((Some(StatusCode::BAD_REQUEST), body)) => {
                return (StatusCode::BAD_REQUEST, [(header::CONTENT_TYPE, "application/json")], body).into_response();
            }
            Err((_, e)) => {
                return error(ErrorCode::NodeUnavailable, format!("cannot list node {}: {e}", node.name), None)
            }
        }
    }
    match lost_sandboxes(&s.etcd, &nodes).await {
        Ok(lost) => all.extend(lost.into_iter().filter(|info| {
            wanted_state.is_none_or(|st| st == SandboxState::Ended)
                && label.as_ref().is_none_or(|(k, v)| info.labels.get(k) == Some(v))
        })),
        Err(e) => return store_error(e),
    }
    // Only what the caller may act on; the rest is not there for it.
    if caller.project != warren_api::ROOT_PROJECT {
        let iam = s.auth.iam.clone();
        let visible = iam::blocking(move || {
            Ok(all.into_iter().filter(|info| iam.may_act_on_project(&caller, &info.project)).collect::<Vec<_>>())
        })
        .await;
        all = match visible {
            Ok(v) => v,
            Err(e) => return warren_control::iam_error(e),
        };
    }
    all.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then_with(|| a.id.cmp(&b.id)));
    Json(SandboxList { sandboxes: all }).into_response()
}

/// A query's `name=value` pairs, decoded (none for a malformed query: the
/// node it goes to rejects that, naming the field).
fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query.and_then(|q| serde_urlencoded::from_str(q).ok()).unwrap_or_default()
}

/// Whether a query sets `name=true`.
fn list_flag(query: Option<&str>, name: &str) -> bool {
    query_pairs(query).iter().any(|(k, v)| k == name && v == "true")
}

/// `state` and `label` of a list query (the nodes check them; this
/// filters the lost nodes' sandboxes alike).
fn list_filters(query: Option<&str>) -> (Option<SandboxState>, Option<(String, String)>) {
    let pairs = query_pairs(query);
    let state = pairs
        .iter()
        .find(|(k, _)| k == "state")
        .and_then(|(_, v)| serde_json::from_value::<SandboxState>(Value::String(v.clone())).ok());
    let label = pairs
        .iter()
        .find(|(k, _)| k == "label")
        .and_then(|(_, v)| v.split_once('=').map(|(a, b)| (a.to_string(), b.to_string())));
    (state, label)
}

// ---- proxy --------------------------------------------------------------

/// Headers that belong to one hop, not to the request or answer.
const HOP_HEADERS: [&str; 7] =
    ["connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection", "host"];

async fn proxy(State(s): State<ApiState>, Path(params): Path<HashMap<String, String>>, request: Request) -> Response {
    let id = params.get("id").cloned().unwrap_or_default();
    let Some(node) = records::node_of(&id).map(str::to_string) else {
        return error(ErrorCode::NotFound, format!("no sandbox {id}"), None);
    };
    let is_info = !params.contains_key("rest");
    let Some(status) = s.nodes.get(&node) else {
        return answer_for_absent_node(&s, &node, &id, request.method(), is_info).await;
    };
    let response = match send_on(&s, &node, &status.url, request).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let (code, mut out_headers) = answer_head(&response);
    // The sandbox's info gains its placement (small JSON, read whole).
    if is_info && code.is_success() {
        let bytes = match response.bytes().await {
            Ok(b) => b,
            Err(e) => return error(ErrorCode::NodeUnavailable, format!("node {node}: {e}"), None),
        };
        let mut info: SandboxInfo = match serde_json::from_slice(&bytes) {
            Ok(i) => i,
            Err(_) => return (code, out_headers, Body::from(bytes)).into_response(),
        };
        if let Ok(Some(record)) = s.etcd.placement(&node, &id).await {
            info.placement = Some(record.placement);
        }
        out_headers.remove(header::CONTENT_LENGTH);
        return (code, out_headers, Json(info)).into_response();
    }
    let stream = response.bytes_stream().map_err(std::io::Error::other);
    (code, out_headers, Body::from_stream(stream)).into_response()
}

/// Sends `request` on to `node` (at `base`) as it came, with the cluster
/// token instead of any the client sent and without hop-by-hop headers;
/// the body streams through.
pub(crate) async fn send_on(
    s: &ApiState,
    node: &str,
    base: &str,
    request: Request,
) -> Result<reqwest::Response, Response> {
    let path_and_query = request.uri().path_and_query().map_or(request.uri().path(), |pq| pq.as_str()).to_string();
    let method = request.method().clone();
    let mut headers = HeaderMap::new();
    for (name, value) in request.headers() {
        if !HOP_HEADERS.contains(&name.as_str()) && name.as_str() != token::HEADER {
            headers.append(name.clone(), value.clone());
        }
    }
    let body = reqwest::Body::wrap_stream(request.into_body().into_data_stream());
    let sent = s
        .http
        .request(method, format!("{base}{path_and_query}"))
        .headers(headers)
        .header(token::HEADER, s.token.as_str())
        .body(body)
        .send()
        .await;
    sent.map_err(|e| error(ErrorCode::NodeUnavailable, format!("node {node}: {e}"), None))
}

/// A node's status and headers as the client gets them.
fn answer_head(response: &reqwest::Response) -> (StatusCode, HeaderMap) {
    let code = StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    for (name, value) in response.headers() {
        if !HOP_HEADERS.contains(&name.as_str()) {
            headers.append(name.clone(), value.clone());
        }
    }
    (code, headers)
}

/// `POST /v1/functions/run`: one call, run by a node that holds the
/// call's image (function workers are the node's own; they take no room
/// in its sandbox books), the least loaded of a sample as for a create.
async fn run_function(State(s): State<ApiState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, FUNCTION_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return error(ErrorCode::InvalidRequest, format!("the body: {e}"), None),
    };
    let parsed: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(ErrorCode::InvalidRequest, format!("the body is not JSON: {e}"), None),
    };
    let image = match parsed.get("image") {
        None | Some(Value::Null) => warren_api::DEFAULT_IMAGE.to_string(),
        Some(Value::String(i)) => i.clone(),
        Some(_) => return error(ErrorCode::InvalidRequest, "must be a string", Some("image")),
    };
    let ask = Ask { backend: Backend::Function, image: image.clone(), memory_mib: 0, disk_mib: 0 };
    let choice = {
        let nodes = s.nodes.all();
        let others: BTreeSet<String> =
            nodes.iter().filter(|n| !n.images.contains(&image)).map(|n| n.name.clone()).collect();
        let candidates: Vec<Candidate<'_>> =
            nodes.iter().map(|n| Candidate { node: n, pending_sandboxes: 0, pending_memory_mib: 0 }).collect();
        placement::choose(&candidates, &ask, &others, &mut |n| s.rng.below(n))
    };
    let choice = match choice {
        Ok(c) => c,
        Err(why) => {
            let message =
                format!("no node can run a call of image `{image}`: {why} (nodes without the image left out)");
            return error(ErrorCode::InvalidRequest, message, Some("image"));
        }
    };
    let Some(status) = s.nodes.get(&choice.node) else {
        return error(ErrorCode::NodeUnavailable, format!("node {} is not registered", choice.node), None);
    };
    let request = Request::from_parts(parts, Body::from(body));
    match send_on(&s, &choice.node, &status.url, request).await {
        Ok(response) => {
            let (code, headers) = answer_head(&response);
            let stream = response.bytes_stream().map_err(std::io::Error::other);
            (code, headers, Body::from_stream(stream)).into_response()
        }
        Err(answer) => answer,
    }
}

/// A function call's request: its code, stdin and files in, with room to spare.
const FUNCTION_BODY_LIMIT: usize = 2 * warren_api::MAX_FUNCTION_FILES_BYTES as usize;

/// The node is not registered: lost (answer from the record) or briefly
/// away (503; the client may retry).
async fn answer_for_absent_node(s: &ApiState, node: &str, id: &str, method: &Method, is_info: bool) -> Response {
    let record = match s.etcd.placement(node, id).await {
        Ok(r) => r,
        Err(e) => return store_error(e),
    };
    let Some(record) = record else {
        return error(ErrorCode::NotFound, format!("no sandbox {id}"), None);
    };
    if record.lost_at_ms.is_none() {
        return error(
            ErrorCode::NodeUnavailable,
            format!("node {node} is not registered right now; if it does not return, {id} ends node_lost"),
            None,
        );
    }
    if is_info && (method == Method::GET || method == Method::DELETE) {
        return Json(record.lost_info()).into_response();
    }
    error(ErrorCode::SandboxEnded, format!("sandbox {id} has ended (node_lost: node {node} was lost)"), None)
}

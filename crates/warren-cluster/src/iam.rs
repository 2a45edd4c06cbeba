//! IAM in the API role: the embedded server's projects, keys and quota
//! gate ([`warren_iam::Iam`]) on the etcd store every API server shares,
//! in front of the cluster's routes.
//!
//! - Who a request is: [`warren_control::caller_of`], as on one machine
//!   (401 `unauthorized`); `GET /v1/cluster` counts every project's
//!   sandboxes, so it needs a key of the root project (403 `forbidden`).
//! - A sandbox-scoped call is checked against the project in the
//!   sandbox's placement record (one etcd get): another project's sandbox
//!   answers word for word as one that does not exist (404).
//! - Quotas: the gate counts what the live nodes report per project in
//!   their heartbeats, plus the creates this API server finished since a
//!   node's last heartbeat ([`ClusterUsage`]), plus - for a project with a
//!   concurrency quota on its path - the other API servers' holds in the
//!   quota ledger, where its own create then takes its room by
//!   compare-and-swap ([`crate::ledger`]). Nodes run without IAM and trust
//!   the project an API server writes into the create.
//! - The root admin key is made once per cluster: the API server that wins
//!   a put-if-absent on `meta/cluster/admin-key` keeps it
//!   ([`bootstrap_admin_key`]).

use std::sync::{Arc, Mutex};

use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use warren_api::{ApiError, CreateKeyRequest, ErrorCode, NodeStatus, ROOT_PROJECT};
use warren_control::{Auth, HttpError};
use warren_iam::{Admitted, Caller, Demand, Iam, IamError, SandboxUsage, UsageSource};
use warren_store::{StateStore, StateStoreExt, Table};
use warren_store_etcd::EtcdStore;

use crate::api::ApiState;
use crate::ledger::HoldGuard;
use crate::records::{self, Etcd};
use crate::watcher::NodeView;
use crate::ClusterError;

/// The key in [`Table::Meta`] whose one writer made the admin key.
const ADMIN_CLAIM: &str = "cluster/admin-key";

/// Who made the cluster's admin key, and when.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AdminClaim {
    key_id: String,
    at_ms: u64,
}

/// What [`bootstrap_admin_key`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum AdminKey {
    /// This API server made the key (the secret, shown once, is persisted).
    Made { secret: String },
    /// Another API server made it, before or while this one tried; the
    /// key this one made and persisted meanwhile, if any, is revoked.
    MadeElsewhere { discarded: bool },
}

/// Makes the root project's admin key unless an API server already did.
/// The key is made and `persist`ed first, then claimed: a crash between
/// the two leaves a valid key on this server's disk and lets the next
/// start claim again, rather than leave the cluster without an admin key.
/// Of racing API servers exactly one wins the claim; the others revoke
/// their key (the caller then deletes what `persist` wrote). Blocking.
pub fn bootstrap_admin_key(
    iam: &Iam,
    store: &EtcdStore,
    persist: impl FnOnce(&str) -> std::io::Result<()>,
) -> Result<AdminKey, ClusterError> {
    if store.get(Table::Meta, ADMIN_CLAIM)?.is_some() {
        return Ok(AdminKey::MadeElsewhere { discarded: false });
    }
    let made = iam.create_key(&Caller::root(), ROOT_PROJECT, &CreateKeyRequest { name: Some("admin".into()) })?;
    persist(&made.secret)?;
    let claim = AdminClaim { key_id: made.key.id.clone(), at_ms: warren_node::now_ms() };
    match store.put_json_if_absent(Table::Meta, ADMIN_CLAIM, &claim)? {
        None => Ok(AdminKey::Made { secret: made.secret }),
        Some(_) => {
            iam.revoke_key(&Caller::root(), &made.key.id)?;
            Ok(AdminKey::MadeElsewhere { discarded: true })
        }
    }
}

/// A create this API server finished on a node, counted against its
/// project until the node's heartbeat includes it.
#[derive(Debug, Clone)]
struct Placed {
    node: String,
    at_ms: u64,
    usage: SandboxUsage,
}

/// The cluster's live sandboxes per project, as the quota gate counts them.
#[derive(Clone, Default)]
pub struct ClusterUsage {
    nodes: NodeView,
    placed: Arc<Mutex<Vec<Placed>>>,
}

impl ClusterUsage {
    pub fn new(nodes: NodeView) -> ClusterUsage {
        ClusterUsage { nodes, placed: Arc::default() }
    }

    /// Counts a sandbox `node` just made (after its create answered), so
    /// it is not forgotten between the gate's reservation ending and the
    /// node's next heartbeat.
    pub fn note_placed(&self, node: &str, project: &str, cpus: f64, memory_mib: u64) {
        let usage = SandboxUsage { project: project.to_string(), cpus, memory_mib };
        let placed = Placed { node: node.to_string(), at_ms: warren_node::now_ms(), usage };
        self.placed.lock().unwrap_or_else(|p| p.into_inner()).push(placed);
    }
}

impl UsageSource for ClusterUsage {
    fn live(&self) -> Vec<SandboxUsage> {
        let nodes = self.nodes.all();
        live_usage(&nodes, &mut self.placed.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// What `nodes` report per project plus what `placed` holds that their
/// heartbeats do not include yet (dropping the rest, and what went to
/// nodes no longer live: their sandboxes are gone).
fn live_usage(nodes: &[NodeStatus], placed: &mut Vec<Placed>) -> Vec<SandboxUsage> {
    placed.retain(|p| nodes.iter().any(|n| n.name == p.node && p.at_ms >= n.heartbeat_at_ms));
    let mut out: Vec<SandboxUsage> = placed.iter().map(|p| p.usage.clone()).collect();
    for node in nodes {
        for (project, usage) in &node.usage_by_project {
            // The gate counts one sandbox per entry: the project's totals
            // ride on the first, the others add only to the count.
            out.push(SandboxUsage { project: project.clone(), cpus: usage.cpus, memory_mib: usage.memory_mib });
            let rest = usage.sandboxes.saturating_sub(1) as usize;
            out.extend(std::iter::repeat_n(SandboxUsage { project: project.clone(), cpus: 0.0, memory_mib: 0 }, rest));
        }
    }
    out
}

/// Runs a blocking IAM call (it may read etcd) off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, IamError> + Send + 'static,
) -> Result<T, IamError> {
    tokio::task::spawn_blocking(f).await.map_err(|_| IamError::Internal("an IAM call was cancelled".into()))?
}

/// The middleware in front of every route of the API role.
pub(crate) async fn authorize(State(s): State<ApiState>, mut request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    // The dashboard's page is open, as on one node; what it reads is not.
    if path == "/v1/health" || path == "/ui" || path.starts_with("/ui/") {
        return next.run(request).await;
    }
    let auth = s.auth().clone();
    let headers = request.headers().clone();
    let caller = match tokio::task::spawn_blocking(move || warren_control::caller_of(&auth, &headers)).await {
        Ok(Ok(caller)) => caller,
        Ok(Err(refused)) => return warren_control::iam_error(refused),
        Err(_) => return HttpError(ApiError::new(ErrorCode::Internal, "authentication was cancelled")).into_response(),
    };
    let is_root = caller.project == ROOT_PROJECT;
    let image_change = path.starts_with("/v1/images") && request.method() != Method::GET;
    if !is_root && (image_change || matches!(path.as_str(), "/v1/cluster" | "/metrics" | "/v1/stats")) {
        let e = ApiError::new(
            ErrorCode::Forbidden,
            "this route counts every project's sandboxes: it needs a key of the root project",
        );
        return HttpError(e).into_response();
    }
    match warren_control::sandbox_id(&path) {
        None => {}
        Some(Err(())) => return HttpError(ApiError::new(ErrorCode::NotFound, "no such sandbox")).into_response(),
        // The root project may act on every sandbox: no lookup.
        Some(Ok(_)) if is_root => {}
        Some(Ok(id)) => match may_act_on_sandbox(&s, &caller, id).await {
            Ok(true) => {}
            Ok(false) => return not_found(id),
            Err(e) => return warren_control::iam_error(e),
        },
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// Word for word what a node says of an id it never had.
fn not_found(id: &str) -> Response {
    HttpError::from(warren_node::NodeError::NotFound(id.to_string())).into_response()
}

/// Whether `caller` may act on sandbox `id`, by the project in its
/// placement record (a sandbox without one was not placed by an API
/// server: only the root project may reach it).
async fn may_act_on_sandbox(s: &ApiState, caller: &Caller, id: &str) -> Result<bool, IamError> {
    let Some(node) = records::node_of(id) else { return Ok(false) };
    let record = s.etcd().placement(node, id).await.map_err(cluster_to_iam)?;
    let Some(record) = record else { return Ok(false) };
    let (iam, caller) = (s.auth().iam.clone(), caller.clone());
    blocking(move || Ok(iam.may_act_on_project(&caller, &record.sandbox.project))).await
}

fn cluster_to_iam(e: ClusterError) -> IamError {
    match e {
        ClusterError::Store(e) => IamError::Store(e),
        other => IamError::Internal(other.to_string()),
    }
}

/// The room a create (or `count` creates of a batch) takes from its
/// project: resolves the project as the embedded server does (the body's
/// `project`, at `field`, or the caller's own), writes it into `body`
/// (the node trusts it) and passes the quota gate, waiting with `queue`.
pub(crate) async fn admit(
    s: &ApiState,
    caller: &Caller,
    body: &mut Value,
    field: &str,
    count: u64,
    queue: bool,
) -> Result<(String, Option<Held>), IamError> {
    let Some(object) = body.as_object_mut() else {
        return Err(IamError::Invalid { field: field.into(), message: "the body must be a JSON object".into() });
    };
    let named = match object.get("project") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.clone()),
        Some(_) => return Err(IamError::Invalid { field: field.into(), message: "must be a string".into() }),
    };
    let project = {
        let (auth, caller, field) = (s.auth().clone(), caller.clone(), field.to_string());
        blocking(move || warren_control::resolve_project(&auth, &caller, named.as_deref(), &field)).await?
    };
    // The root project is what no project means, as on one machine: the
    // node's idempotency hashes stay as they were before IAM.
    match project == ROOT_PROJECT {
        true => object.remove("project"),
        false => object.insert("project".into(), Value::String(project.clone())),
    };
    if count == 0 {
        return Ok((project, None));
    }
    let defaults = warren_api::CreateSandboxRequest::default();
    let cpus = object.get("cpus").and_then(Value::as_f64).unwrap_or(defaults.cpus);
    let memory_mib = object.get("memory_mib").and_then(Value::as_u64).unwrap_or(defaults.memory_mib);
    let demand = Demand { count, cpus, memory_mib };
    let iam = s.auth().iam.clone();
    let limited = {
        let (iam, project) = (iam.clone(), project.clone());
        blocking(move || iam.has_concurrency_quota(&project)).await?
    };
    if !limited {
        let local = iam.admit(&project, demand, s.usage(), queue).await?;
        return Ok((project, Some(Held { local, hold: None })));
    }
    // The ledger (see `crate::ledger`): admitted against what the other
    // API servers hold, then held there unless one of them wrote first.
    for _ in 0..LEDGER_ATTEMPTS {
        let snapshot = s.ledger().read().await.map_err(cluster_to_iam)?;
        let source = WithOthers { base: s.usage(), others: s.ledger().others_usage(&snapshot) };
        let local = iam.admit(&project, demand, &source, queue).await?;
        if let Some(hold) = s.ledger().try_take(snapshot, &project, demand).await.map_err(cluster_to_iam)? {
            return Ok((project, Some(Held { local, hold: Some(hold) })));
        }
    }
    Err(IamError::Internal(format!("the quota ledger stayed contended for {LEDGER_ATTEMPTS} attempts")))
}

/// How often a create reads the ledger again when other API servers keep
/// writing it first.
const LEDGER_ATTEMPTS: usize = 64;

/// Room a create took: in this API server's gate, and, for a project with
/// a concurrency quota, in the cluster's quota ledger (marked done by
/// [`Held::finish`], or in the background when this is dropped).
pub(crate) struct Held {
    local: Admitted,
    hold: Option<HoldGuard>,
}

impl Held {
    /// The create is done (its sandbox made on `node`, if any): the room
    /// goes back to the gate and the ledger's hold is marked done before
    /// the client is answered.
    pub(crate) async fn finish(self, node: Option<String>) {
        let Held { local, hold } = self;
        if let Some(hold) = hold {
            hold.finish(node).await;
        }
        drop(local);
    }

    /// See [`Admitted::release_one`] (the ledger's hold stays until the
    /// whole batch is done).
    pub(crate) fn release_one(&self) {
        self.local.release_one();
    }
}

/// The gate's view with the other API servers' holds counted as live.
struct WithOthers<'a> {
    base: &'a ClusterUsage,
    others: Vec<SandboxUsage>,
}

impl UsageSource for WithOthers<'_> {
    fn live(&self) -> Vec<SandboxUsage> {
        let mut live = self.base.live();
        live.extend(self.others.iter().cloned());
        live
    }
}

/// Whether a create with idempotency `key` is a retry (its key was
/// claimed cluster-wide): a retry makes no sandbox, so it takes no quota.
pub(crate) async fn is_retry(etcd: &Etcd, key: Option<&str>) -> Result<bool, IamError> {
    let Some(key) = key else { return Ok(false) };
    let claim_key = records::idempotency_key(key);
    etcd.call(move |st| Ok(st.get(Table::Idempotency, &claim_key)?.is_some())).await.map_err(cluster_to_iam)
}

/// Opens IAM on the cluster's etcd (the root project is made on first use).
pub fn open(store: Arc<EtcdStore>, required: bool) -> Result<Auth, ClusterError> {
    let iam = Iam::open(store as Arc<dyn StateStore>)?;
    Ok(Auth { iam, required })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use warren_api::QuotaUse;

    use super::*;

    pub(crate) fn node(name: &str, heartbeat_at_ms: u64, usage: &[(&str, u64, f64, u64)]) -> NodeStatus {
        let mut status: NodeStatus = serde_json::from_value(serde_json::json!({
            "name": name, "url": "http://x", "backends": [], "cpus": 1.0, "memory_total_mib": 1,
            "disk_free_mib": 1, "books": {"sandboxes_max": 1, "sandboxes_live": 0, "sandboxes_paused": 0,
            "memory_mib_max": null, "memory_mib_committed": 0, "memory_mib_reclaimable": 0,
            "queue_waiting": 0, "queue_limit": 1}, "images": [], "running_by_backend": {},
            "running_by_label": {}, "heartbeat_at_ms": heartbeat_at_ms, "started_at_ms": 0
        }))
        .expect("a node status");
        status.usage_by_project = usage
            .iter()
            .map(|(p, n, c, m)| (p.to_string(), QuotaUse { sandboxes: *n, cpus: *c, memory_mib: *m }))
            .collect::<BTreeMap<_, _>>();
        status
    }

    fn totals(live: &[SandboxUsage], project: &str) -> (usize, f64, u64) {
        let mine: Vec<_> = live.iter().filter(|u| u.project == project).collect();
        (mine.len(), mine.iter().map(|u| u.cpus).sum(), mine.iter().map(|u| u.memory_mib).sum())
    }

    fn placed(node: &str, at_ms: u64, project: &str) -> Placed {
        Placed { node: node.into(), at_ms, usage: SandboxUsage { project: project.into(), cpus: 1.0, memory_mib: 64 } }
    }

    #[test]
    fn usage_sums_the_live_nodes_and_what_their_heartbeats_do_not_include_yet() {
        let nodes =
            [node("n0", 1000, &[("a", 3, 1.5, 300)]), node("n1", 2000, &[("a", 1, 1.0, 64), ("b", 2, 2.0, 128)])];
        let mut sent = vec![
            placed("n0", 1500, "a"), // after n0's heartbeat: not in it yet
            placed("n1", 1500, "a"), // before n1's: in its counts already
            placed("n9", 5000, "b"), // a node no longer live
        ];
        let live = live_usage(&nodes, &mut sent);
        assert_eq!(totals(&live, "a"), (5, 3.5, 428));
        assert_eq!(totals(&live, "b"), (2, 2.0, 128));
        assert_eq!(sent.len(), 1, "only what a heartbeat has not counted is kept: {sent:?}");
        assert_eq!(sent[0].node, "n0");
    }
}

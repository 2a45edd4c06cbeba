//! Who a request is and what it may touch, before any handler runs.
//!
//! Every v1 request passes [`authorize`]: it reads `Authorization: Bearer
//! <key>` (401 `unauthorized` when auth is on and there is none, or the key
//! is unknown or revoked), puts the [`Caller`] into the request for the
//! handlers that need it (creates, lists, projects), and checks a
//! sandbox-scoped path (`/v1/sandboxes/{id}/...`) against the sandbox's
//! project: a sandbox of a project the key may not act on answers exactly
//! like one that does not exist (404 `not_found`). Node-wide administration
//! (image changes, `/metrics`, `/v1/stats`) needs a key of the root project
//! (403 `forbidden`).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::{ApiError, CreateSandboxRequest, ErrorCode, QueueFullError, QuotaExceededError, ROOT_PROJECT};
use warren_iam::{Admitted, Caller, Demand, Iam, IamError};
use warren_node::{Node, NodeError};

use crate::error::HttpError;
use crate::AppState;

/// IAM as the API serves it.
#[derive(Clone)]
pub struct Auth {
    pub iam: Iam,
    /// When false (the embedded default), a request without a key acts as
    /// the root project; a request with a key still acts as that key.
    pub required: bool,
}

/// The node's live sandboxes as the quota gate counts them.
pub(crate) struct NodeUsage(pub Node);

impl warren_iam::UsageSource for NodeUsage {
    fn live(&self) -> Vec<warren_iam::SandboxUsage> {
        self.0
            .live_projects()
            .into_iter()
            .map(|l| warren_iam::SandboxUsage { project: l.project, cpus: l.cpus, memory_mib: l.memory_mib })
            .collect()
    }
}

/// Routes anyone may call, key or not.
fn is_open(path: &str) -> bool {
    matches!(path, "/v1/health" | "/v1/openapi.json") || path == "/ui" || path.starts_with("/ui/")
}

/// Routes that act on the whole node, not on a project's sandboxes.
fn needs_root(method: &Method, path: &str) -> bool {
    let image_change = path.starts_with("/v1/images") && method != Method::GET && method != Method::HEAD;
    image_change || path == "/metrics" || path == "/v1/stats"
}

/// The `{id}` of a sandbox-scoped path, as axum will decode it. Ids never
/// hold `%`, so an escaped segment is refused rather than decoded: the id
/// checked here is always the id the handler acts on. `None`: not a
/// sandbox-scoped path; `Err`: one no sandbox can have (answer 404).
pub fn sandbox_id(path: &str) -> Option<Result<&str, ()>> {
    let rest = path.strip_prefix("/v1/sandboxes/")?;
    let id = rest.split('/').next().unwrap_or_default();
    match id {
        "" | "batch" if !rest.contains('/') => None,
        "" => Some(Err(())),
        id if id.contains('%') || id.contains('+') => Some(Err(())),
        id => Some(Ok(id)),
    }
}

fn bearer(headers: &HeaderMap) -> Result<Option<&str>, ()> {
    let Some(value) = headers.get(header::AUTHORIZATION) else { return Ok(None) };
    let value = value.to_str().map_err(|_| ())?;
    let (scheme, token) = value.split_once(' ').ok_or(())?;
    match scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() {
        true => Ok(Some(token.trim())),
        false => Err(()),
    }
}

fn unauthorized(message: &str) -> Response {
    let mut response = HttpError(ApiError::new(ErrorCode::Unauthorized, message)).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Who the request with `headers` is: its key's project, or the root
/// project when it sends none and auth is not required; otherwise
/// [`IamError::Unauthorized`] (401 through [`iam_error`]). One store read
/// (blocking) when a key is sent.
pub fn caller_of(auth: &Auth, headers: &HeaderMap) -> Result<Caller, IamError> {
    let refused = |message: &str| Err(IamError::Unauthorized(message.to_string()));
    match bearer(headers) {
        Err(()) => refused("the Authorization header must be `Bearer <API key>`"),
        Ok(None) if auth.required => {
            refused("this server requires an API key: `Authorization: Bearer <key>` (WARREN_API_KEY)")
        }
        Ok(None) => Ok(Caller::root()),
        Ok(Some(secret)) => auth.iam.authenticate(secret),
    }
}

/// The middleware in front of every v1 route.
pub(crate) async fn authorize(State(s): State<AppState>, mut request: Request, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    if is_open(&path) {
        return next.run(request).await;
    }
    let Some(auth) = &s.auth else {
        request.extensions_mut().insert(Caller::root());
        return next.run(request).await;
    };
    let caller = match caller_of(auth, request.headers()) {
        Ok(caller) => caller,
        Err(refused) => return iam_error(refused),
    };
    if caller.project != ROOT_PROJECT && needs_root(request.method(), &path) {
        let e = ApiError::new(
            ErrorCode::Forbidden,
            "this route acts on the whole node: it needs a key of the root project",
        );
        return HttpError(e).into_response();
    }
    match sandbox_id(&path) {
        None => {}
        Some(Err(())) => return HttpError(ApiError::new(ErrorCode::NotFound, "no such sandbox")).into_response(),
        Some(Ok(id)) => match s.node.project_of(id) {
            Ok(project) if auth.iam.may_act_on_project(&caller, &project) => {}
            // Word for word what the node says of an id it never had.
            Ok(_) => return HttpError::from(NodeError::NotFound(id.to_string())).into_response(),
            // Unknown here: the handler answers as it always does.
            Err(NodeError::NotFound(_)) => {}
            Err(e) => return HttpError::from(e).into_response(),
        },
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

/// The project a create lands in: `named` if the caller may act on it,
/// else the caller's own.
pub(crate) fn project_for(s: &AppState, caller: &Caller, named: Option<&str>, field: &str) -> Result<String, IamError> {
    match &s.auth {
        Some(auth) => resolve_project(auth, caller, named, field),
        // No IAM here: a cluster node, which answers only API servers
        // (they hold the cluster token), and they resolved and checked the
        // project against the caller's key before forwarding the create.
        None => Ok(named.map_or_else(|| caller.project.clone(), str::to_string)),
    }
}

/// The project a create lands in: `named` if the caller may act on it
/// (else `invalid_request` on `field`, as if it did not exist), or the
/// caller's own.
pub fn resolve_project(auth: &Auth, caller: &Caller, named: Option<&str>, field: &str) -> Result<String, IamError> {
    let Some(named) = named else { return Ok(caller.project.clone()) };
    let invalid = |message: String| IamError::Invalid { field: field.to_string(), message };
    match auth.iam.visible_project(caller, named) {
        Ok(p) => Ok(p.id),
        Err(IamError::NotFound { .. }) => Err(invalid(format!("no project {named} that this key may act on"))),
        Err(e) => Err(e),
    }
}

/// Puts a create (or a batch of `count` new sandboxes) into its project -
/// the caller's, or the one `req.project` names (`field` in errors) - and
/// takes its room out of the project's quotas, waiting for it when `queue`
/// is set. `req` must be valid already. The room is given back when the
/// answer is dropped. `count` leaves out retries ([`new_sandboxes`]).
pub(crate) async fn admit_create(
    s: &AppState,
    caller: &Caller,
    req: &mut CreateSandboxRequest,
    count: u64,
    queue: bool,
    field: &str,
) -> Result<Option<Admitted>, IamError> {
    let project = project_for(s, caller, req.project.as_deref(), field)?;
    // The root project is what no project means: requests (and their
    // idempotency hashes) stay as they were before IAM.
    req.project = (project != ROOT_PROJECT).then(|| project.clone());
    let Some(auth) = &s.auth else { return Ok(None) };
    if count == 0 {
        return Ok(None);
    }
    let demand = Demand { count, cpus: req.cpus, memory_mib: req.memory_mib };
    auth.iam.admit(&project, demand, &NodeUsage(s.node.clone()), queue).await.map(Some)
}

/// How many of the creates with `keys` would make a sandbox: a key already
/// claimed is a retry, answered with the sandbox the first call made (or
/// `idempotency_conflict`), so it takes no quota - a client retrying after
/// a broken connection at a full quota gets its sandbox, not a refusal.
pub(crate) fn new_sandboxes<'a>(s: &AppState, keys: impl IntoIterator<Item = Option<&'a str>>) -> u64 {
    keys.into_iter()
        .filter(|key| match key {
            // A store error here counts the create as new: the quota errs on the safe side.
            Some(key) => !s.node.idempotency_claimed(key).unwrap_or(false),
            None => true,
        })
        .count() as u64
}

/// The one mapping of IAM's errors to HTTP answers (public for other API
/// front ends, e.g. a cluster's API server).
pub fn iam_error(e: IamError) -> Response {
    let message = e.to_string();
    match e {
        IamError::Unauthorized(_) => unauthorized(&message),
        IamError::NotFound { .. } => HttpError(ApiError::new(ErrorCode::NotFound, message)).into_response(),
        IamError::Invalid { field, .. } => HttpError(ApiError::invalid(field, message)).into_response(),
        IamError::QuotaExceeded(r) => {
            let retry_after = r.retry_after.map(|d| d.as_secs_f64().ceil().max(1.0) as u64);
            let body = QuotaExceededError {
                code: ErrorCode::QuotaExceeded,
                message,
                field: Some(warren_iam::quota_field(r.kind)),
                project: r.project,
                quota: r.kind,
                limit: r.limit,
                used: r.used,
                requested: r.requested,
            };
            let mut response = (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response();
            if let Some(secs) = retry_after {
                response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
            response
        }
        IamError::QueueFull { limit } => {
            let body = QueueFullError {
                code: ErrorCode::QueueFull,
                message,
                field: Some("queue".into()),
                queue_limit: limit as u64,
            };
            (StatusCode::TOO_MANY_REQUESTS, Json(body)).into_response()
        }
        IamError::Store(warren_node::StoreError::Unavailable { .. }) => {
            HttpError(ApiError::new(ErrorCode::StoreUnavailable, message)).into_response()
        }
        IamError::Store(_) | IamError::Internal(_) => {
            HttpError(ApiError::new(ErrorCode::Internal, message)).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths_are_recognised_and_escapes_refused() {
        assert_eq!(sandbox_id("/v1/sandboxes"), None);
        assert_eq!(sandbox_id("/v1/sandboxes/batch"), None);
        assert_eq!(sandbox_id("/v1/sandboxes/sb-1"), Some(Ok("sb-1")));
        assert_eq!(sandbox_id("/v1/sandboxes/sb-1/exec/e-1/kill"), Some(Ok("sb-1")));
        // A sandbox may be named nothing like `batch`, but its sub-routes are still checked.
        assert_eq!(sandbox_id("/v1/sandboxes/batch/files"), Some(Ok("batch")));
        assert_eq!(sandbox_id("/v1/sandboxes/sb-%31"), Some(Err(())));
        assert_eq!(sandbox_id("/v1/sandboxes//exec"), Some(Err(())));
        assert_eq!(sandbox_id("/v1/images"), None);
    }

    #[test]
    fn the_bearer_scheme_is_required_when_a_header_is_sent() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), Ok(None));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer wrn_x"));
        assert_eq!(bearer(&h), Ok(Some("wrn_x")));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer  wrn_y "));
        assert_eq!(bearer(&h), Ok(Some("wrn_y")));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic abc"));
        assert_eq!(bearer(&h), Err(()));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer "));
        assert_eq!(bearer(&h), Err(()));
    }

    #[test]
    fn node_wide_routes_need_the_root_project() {
        assert!(needs_root(&Method::POST, "/v1/images/pull"));
        assert!(needs_root(&Method::DELETE, "/v1/images/busybox"));
        assert!(needs_root(&Method::GET, "/metrics"));
        assert!(!needs_root(&Method::GET, "/v1/images"));
        assert!(!needs_root(&Method::POST, "/v1/sandboxes"));
        assert!(is_open("/v1/health") && is_open("/ui/app.js") && !is_open("/v1/sandboxes"));
    }
}

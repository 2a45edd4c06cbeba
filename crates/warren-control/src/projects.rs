//! IAM routes: projects (with their quota and use) and API keys. They need
//! IAM and a count of what runs ([`IamRoutes`]), not a node, so a cluster's
//! API server serves the same routes ([`routes`]) over its own state.

use std::sync::Arc;

use axum::extract::{Extension, FromRef, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use warren_api::*;
use warren_iam::{Caller, Iam, SandboxUsage, UsageSource};

use crate::auth::{iam_error, Auth, NodeUsage};
use crate::error::HttpError;
use crate::extract::ApiJson;
use crate::AppState;

/// What the IAM routes act on: IAM (`None`: the routes answer
/// `unsupported`) and where the projects' live usage comes from. Any
/// router state `S` with `IamRoutes: FromRef<S>` can serve [`routes`].
#[derive(Clone)]
pub struct IamRoutes {
    pub auth: Option<Auth>,
    pub usage: Arc<dyn UsageSource>,
}

impl FromRef<AppState> for IamRoutes {
    fn from_ref(s: &AppState) -> IamRoutes {
        IamRoutes { auth: s.auth.clone(), usage: Arc::new(NodeUsage(s.node.clone())) }
    }
}

/// `/v1/projects...` and `/v1/keys/{id}`. The handlers read the [`Caller`]
/// from the request's extensions: the router's auth middleware puts it there.
pub fn routes<S>() -> axum::Router<S>
where
    IamRoutes: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    use axum::routing::{delete, get, post};
    axum::Router::new()
        .route("/v1/projects", post(create_project).get(list_projects))
        .route("/v1/projects/{id}", get(get_project))
        .route("/v1/projects/{id}/keys", post(create_key))
        .route("/v1/keys/{id}", delete(delete_key))
}

fn no_iam() -> Response {
    HttpError(ApiError::new(ErrorCode::Unsupported, "this server runs without IAM (no projects or keys)"))
        .into_response()
}

fn live(s: &IamRoutes) -> Vec<SandboxUsage> {
    s.usage.live()
}

fn info(iam: &Iam, s: &IamRoutes, record: &warren_iam::ProjectRecord) -> ProjectInfo {
    iam.project_info(record, &live(s))
}

/// Makes a child project (of `parent`, default the key's own project),
/// with quota out of what the parent has left to give.
#[utoipa::path(post, path = "/v1/projects", request_body = CreateProjectRequest,
    responses((status = 201, body = ProjectInfo), (status = 400, body = ApiError), (status = 401, body = ApiError)))]
pub async fn create_project(
    State(s): State<IamRoutes>,
    Extension(caller): Extension<Caller>,
    ApiJson(req): ApiJson<CreateProjectRequest>,
) -> Response {
    let Some(auth) = &s.auth else { return no_iam() };
    match auth.iam.create_project(&caller, &req) {
        Ok(record) => (StatusCode::CREATED, Json(info(&auth.iam, &s, &record))).into_response(),
        Err(e) => iam_error(e),
    }
}

/// The key's project and every project below it.
#[utoipa::path(get, path = "/v1/projects", responses((status = 200, body = ProjectList), (status = 401, body = ApiError)))]
pub async fn list_projects(State(s): State<IamRoutes>, Extension(caller): Extension<Caller>) -> Response {
    let Some(auth) = &s.auth else { return no_iam() };
    match auth.iam.list_projects(&caller) {
        Ok(records) => {
            let live = live(&s);
            let projects = records.iter().map(|r| auth.iam.project_info(r, &live)).collect();
            Json(ProjectList { projects }).into_response()
        }
        Err(e) => iam_error(e),
    }
}

/// A project's quota, what it gave its children, and what it holds now.
#[utoipa::path(get, path = "/v1/projects/{id}", params(("id" = String, Path)),
    responses((status = 200, body = ProjectInfo), (status = 404, body = ApiError)))]
pub async fn get_project(
    State(s): State<IamRoutes>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let Some(auth) = &s.auth else { return no_iam() };
    match auth.iam.visible_project(&caller, &id) {
        Ok(record) => Json(info(&auth.iam, &s, &record)).into_response(),
        Err(e) => iam_error(e),
    }
}

/// Makes an API key of the project; the answer is the only time its secret
/// is shown.
#[utoipa::path(post, path = "/v1/projects/{id}/keys", request_body = CreateKeyRequest, params(("id" = String, Path)),
    responses((status = 201, body = ApiKeyCreated), (status = 400, body = ApiError), (status = 404, body = ApiError)))]
pub async fn create_key(
    State(s): State<IamRoutes>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
    ApiJson(req): ApiJson<CreateKeyRequest>,
) -> Response {
    let Some(auth) = &s.auth else { return no_iam() };
    match auth.iam.create_key(&caller, &id, &req) {
        Ok(made) => (StatusCode::CREATED, Json(made)).into_response(),
        Err(e) => iam_error(e),
    }
}

/// Revokes a key of the caller's project or one below it (a key may revoke
/// itself): it answers 401 from the next request on.
#[utoipa::path(delete, path = "/v1/keys/{id}", params(("id" = String, Path)),
    responses((status = 200, body = ApiKeyInfo), (status = 404, body = ApiError)))]
pub async fn delete_key(
    State(s): State<IamRoutes>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let Some(auth) = &s.auth else { return no_iam() };
    match auth.iam.revoke_key(&caller, &id) {
        Ok(key) => Json(key).into_response(),
        Err(e) => iam_error(e),
    }
}

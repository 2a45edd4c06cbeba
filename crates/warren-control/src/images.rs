//! Handlers of the image management routes: registry pull and push,
//! inspect, remove, compose and garbage collection. Pull and push answer
//! when the transfer is done.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use warren_api::*;

use crate::error::HttpError;
use crate::extract::ApiJson;
use crate::AppState;

type ApiResult<T> = Result<T, HttpError>;

/// Pull an image from an OCI registry into a layered image.
#[utoipa::path(post, path = "/v1/images/pull", request_body = PullImageRequest,
    responses((status = 201, body = ImageInfo), (status = 400, body = ApiError), (status = 404, body = ApiError),
        (status = 502, body = ApiError)))]
pub async fn pull_image(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<PullImageRequest>,
) -> ApiResult<(StatusCode, Json<ImageInfo>)> {
    if req.reference.trim().is_empty() {
        return Err(ApiError::invalid("reference", "must not be empty").into());
    }
    Ok((StatusCode::CREATED, Json(s.node.pull_image(req).await?)))
}

/// Push a layered image to an OCI registry as a Warren artifact.
#[utoipa::path(post, path = "/v1/images/{name}/push", request_body = PushImageRequest, params(("name" = String, Path)),
    responses((status = 200, body = PushImageResult), (status = 400, body = ApiError), (status = 404, body = ApiError),
        (status = 502, body = ApiError)))]
pub async fn push_image(
    State(s): State<AppState>,
    Path(name): Path<String>,
    ApiJson(req): ApiJson<PushImageRequest>,
) -> ApiResult<Json<PushImageResult>> {
    if req.reference.trim().is_empty() {
        return Err(ApiError::invalid("reference", "must not be empty").into());
    }
    Ok(Json(s.node.push_image(&name, req).await?))
}

/// An image's layers (role, digest, size and chunk count for layered images).
#[utoipa::path(get, path = "/v1/images/{name}", params(("name" = String, Path)),
    responses((status = 200, body = ImageDetail), (status = 404, body = ApiError)))]
pub async fn inspect_image(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<Json<ImageDetail>> {
    Ok(Json(s.node.inspect_image(&name).await?))
}

/// What one sandbox's reads of its layered image fetched and found cached.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/image-stats", params(("id" = String, Path)),
    responses((status = 200, body = SandboxImageStats), (status = 404, body = ApiError)))]
pub async fn sandbox_image_stats(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> ApiResult<Json<SandboxImageStats>> {
    Ok(Json(s.node.sandbox_image_stats(&id)?))
}

/// Remove an image; refused while sandboxes or a warm pool use it.
#[utoipa::path(delete, path = "/v1/images/{name}", params(("name" = String, Path)),
    responses((status = 204), (status = 404, body = ApiError), (status = 409, body = ApiError)))]
pub async fn remove_image(State(s): State<AppState>, Path(name): Path<String>) -> ApiResult<StatusCode> {
    s.node.remove_image(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Make a layered image from existing layers, bottom first (no data copied).
#[utoipa::path(post, path = "/v1/images/compose", request_body = ComposeImageRequest,
    responses((status = 201, body = ImageInfo), (status = 400, body = ApiError)))]
pub async fn compose_image(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<ComposeImageRequest>,
) -> ApiResult<(StatusCode, Json<ImageInfo>)> {
    Ok((StatusCode::CREATED, Json(s.node.compose_image(req).await?)))
}

/// Delete the layers, chunks and cached layer files no image references.
#[utoipa::path(post, path = "/v1/images/gc", responses((status = 200, body = ImageGcReport)))]
pub async fn gc_images(State(s): State<AppState>) -> ApiResult<Json<ImageGcReport>> {
    Ok(Json(s.node.gc_images().await?))
}

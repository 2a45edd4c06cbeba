//! Image management through an API server. Images live on each node (its
//! own store and layer cache), so an API server sends every image change -
//! import of a directory (a path on each node's machine), pull, compose,
//! gc, remove, tar upload - to every live node at once, and merges what
//! they answer:
//!
//! - every node took it: the first node's answer, with the nodes named in
//!   the `warren-nodes` header;
//! - every node refused it the same way (a bad field, an unknown image):
//!   that refusal, as one node gives it;
//! - some took it and some did not: 503 `node_unavailable` naming which
//!   nodes did what (the change stands where it was made; sending it again
//!   is how to finish it - imports and pulls of the same content are
//!   idempotent on a node).
//!
//! Reads: `GET /v1/images` lists the images of every live node (one entry
//! per name: the first node's), `GET /v1/images/{name}` answers from the
//! first node that has it, and a push goes from the first node that has
//! the image. Bodies are buffered to be sent to each node, up to
//! [`FANOUT_BODY_LIMIT`]; a bigger tar is refused (import it on each node).

use std::collections::BTreeMap;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use serde_json::Value;
use warren_api::{ApiError, ErrorCode, ImageInfo, ImageList, NodeStatus};

use crate::api::ApiState;

/// The largest body an API server buffers to send to every node.
pub const FANOUT_BODY_LIMIT: usize = 64 << 20;
/// The header naming the nodes that took a change.
pub const NODES_HEADER: &str = "warren-nodes";

pub(crate) fn routes() -> Router<ApiState> {
    Router::new()
        .route("/v1/images", get(list).post(to_every_node))
        .route("/v1/images/pull", post(to_every_node))
        .route("/v1/images/compose", post(to_every_node))
        .route("/v1/images/gc", post(to_every_node))
        .route("/v1/images/{name}", get(from_first_holder).delete(to_every_node))
        .route("/v1/images/{name}/push", post(from_first_holder))
        .route("/v1/images/{name}/tar", put(to_every_node))
}

fn error(status: StatusCode, code: ErrorCode, message: String) -> Response {
    (status, Json(ApiError::new(code, message))).into_response()
}

/// One node's answer, read whole (image answers are small JSON).
struct NodeAnswer {
    node: String,
    status: StatusCode,
    body: Bytes,
}

/// Sends `method path` with `body` to `node`, with the request's headers.
async fn ask(s: &ApiState, node: &NodeStatus, template: &axum::http::request::Parts, body: Bytes) -> NodeAnswer {
    let mut request = Request::new(Body::from(body));
    *request.method_mut() = template.method.clone();
    *request.uri_mut() = template.uri.clone();
    *request.headers_mut() = template.headers.clone();
    let answer = match crate::api::send_on(s, &node.name, &node.url, request).await {
        Ok(response) => {
            let status = StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            match response.bytes().await {
                Ok(body) => Ok((status, body)),
                Err(e) => Err(e.to_string()),
            }
        }
        Err(refusal) => Err(format!("unreachable ({})", refusal.status())),
    };
    let (status, body) = answer.unwrap_or_else(|why| {
        let body = serde_json::to_vec(&ApiError::new(ErrorCode::NodeUnavailable, why)).unwrap_or_default();
        (StatusCode::SERVICE_UNAVAILABLE, Bytes::from(body))
    });
    NodeAnswer { node: node.name.clone(), status, body }
}

/// Every live node, by name (the order answers are merged in).
fn live_nodes(s: &ApiState) -> Vec<NodeStatus> {
    let mut nodes = s.nodes().all();
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    nodes
}

fn relay(answer: NodeAnswer, nodes: Option<&[&str]>) -> Response {
    let mut response = (answer.status, answer.body).into_response();
    let headers = response.headers_mut();
    headers.insert(axum::http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(value) = nodes.and_then(|n| HeaderValue::from_str(&n.join(",")).ok()) {
        headers.insert(HeaderName::from_static(NODES_HEADER), value);
    }
    response
}

/// A message a node's error body carries, or its status.
fn message_of(answer: &NodeAnswer) -> String {
    serde_json::from_slice::<Value>(&answer.body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| answer.status.to_string())
}

async fn to_every_node(State(s): State<ApiState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, FANOUT_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => {
            let message = format!(
                "an API server sends an image change to every node and buffers at most {FANOUT_BODY_LIMIT} bytes of \
                 it ({e}); import a bigger archive on each node"
            );
            return error(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::InvalidRequest, message);
        }
    };
    let nodes = live_nodes(&s);
    if nodes.is_empty() {
        return error(StatusCode::SERVICE_UNAVAILABLE, ErrorCode::NodeUnavailable, "no live node".into());
    }
    let answers = futures_util::future::join_all(nodes.iter().map(|n| ask(&s, n, &parts, body.clone()))).await;
    merge_changes(answers)
}

/// See the module doc.
fn merge_changes(mut answers: Vec<NodeAnswer>) -> Response {
    let took: Vec<String> = answers.iter().filter(|a| a.status.is_success()).map(|a| a.node.clone()).collect();
    if took.len() == answers.len() {
        let names: Vec<&str> = took.iter().map(String::as_str).collect();
        return relay(answers.remove(0), Some(&names));
    }
    if took.is_empty() && answers.iter().all(|a| a.status == answers[0].status) {
        return relay(answers.remove(0), None);
    }
    let failed: Vec<String> =
        answers.iter().filter(|a| !a.status.is_success()).map(|a| format!("{}: {}", a.node, message_of(a))).collect();
    let took = if took.is_empty() { "none".to_string() } else { took.join(", ") };
    let message = format!("applied on {took}; not on {}", failed.join("; "));
    error(StatusCode::SERVICE_UNAVAILABLE, ErrorCode::NodeUnavailable, message)
}

async fn list(State(s): State<ApiState>, request: Request) -> Response {
    let (parts, _) = request.into_parts();
    let nodes = live_nodes(&s);
    let answers = futures_util::future::join_all(nodes.iter().map(|n| ask(&s, n, &parts, Bytes::new()))).await;
    let mut images: BTreeMap<String, ImageInfo> = BTreeMap::new();
    for answer in answers {
        if !answer.status.is_success() {
            let message = format!("node {}: {}", answer.node, message_of(&answer));
            return error(StatusCode::SERVICE_UNAVAILABLE, ErrorCode::NodeUnavailable, message);
        }
        let Ok(list) = serde_json::from_slice::<ImageList>(&answer.body) else {
            let message = format!("node {} answered no image list", answer.node);
            return error(StatusCode::BAD_GATEWAY, ErrorCode::NodeUnavailable, message);
        };
        for image in list.images {
            images.entry(image.name.clone()).or_insert(image);
        }
    }
    Json(ImageList { images: images.into_values().collect() }).into_response()
}

async fn from_first_holder(State(s): State<ApiState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, FANOUT_BODY_LIMIT).await {
        Ok(b) => b,
        Err(e) => return error(StatusCode::PAYLOAD_TOO_LARGE, ErrorCode::InvalidRequest, e.to_string()),
    };
    let mut last = None;
    for node in live_nodes(&s) {
        let answer = ask(&s, &node, &parts, body.clone()).await;
        if answer.status != StatusCode::NOT_FOUND {
            return relay(answer, None);
        }
        last = Some(answer);
    }
    match last {
        Some(answer) => relay(answer, None),
        None => error(StatusCode::SERVICE_UNAVAILABLE, ErrorCode::NodeUnavailable, "no live node".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(node: &str, status: u16, body: &str) -> NodeAnswer {
        NodeAnswer {
            node: node.into(),
            status: StatusCode::from_u16(status).expect("a status"),
            body: Bytes::from(body.to_string()),
        }
    }

    #[test]
    fn all_took_it_all_refused_it_or_some_did() {
        let all = merge_changes(vec![answer("n0", 201, "{}"), answer("n1", 201, "{}")]);
        assert_eq!(all.status(), StatusCode::CREATED);
        assert_eq!(all.headers()[NODES_HEADER], "n0,n1");
        let refused = r#"{"code":"invalid_request","message":"bad","field":"dir"}"#;
        let none = merge_changes(vec![answer("n0", 400, refused), answer("n1", 400, refused)]);
        assert_eq!(none.status(), StatusCode::BAD_REQUEST);
        assert!(none.headers().get(NODES_HEADER).is_none());
        let some = merge_changes(vec![answer("n0", 201, "{}"), answer("n1", 400, refused)]);
        assert_eq!(some.status(), StatusCode::SERVICE_UNAVAILABLE);
        let mixed = merge_changes(vec![answer("n0", 404, refused), answer("n1", 400, refused)]);
        assert_eq!(mixed.status(), StatusCode::SERVICE_UNAVAILABLE, "different refusals are not one answer");
    }
}

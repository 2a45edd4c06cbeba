//! The dashboard at `/ui`: one page of plain HTML, CSS and JavaScript
//! compiled into the binary (no CDN, no build step; works offline). It
//! reads the public API like any client: `GET /v1/stats` for the overview
//! and the live charts, `GET /v1/sandboxes` for the list, and a sandbox's
//! record, exec history (its trajectory log when the server has one) and
//! security events for the detail view. A cluster's API servers serve
//! the same page ([`routes`]); there it also lists the nodes from
//! `GET /v1/cluster`.

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX_HTML: &str = include_str!("../ui/index.html");
const APP_JS: &str = include_str!("../ui/app.js");
const STYLE_CSS: &str = include_str!("../ui/style.css");

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut answer = body.into_response();
    let headers = answer.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The assets change with the binary: a browser must not keep an old one.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    answer
}

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

/// `/ui` and its assets; they need no state, so any router can merge them.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(index))
        .route("/ui/", get(index))
        .route("/ui/app.js", get(app_js))
        .route("/ui/style.css", get(style_css))
}

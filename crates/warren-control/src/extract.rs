//! Body and query extractors whose rejections are JSON errors naming the field.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use serde::de::DeserializeOwned;
use warren_api::ApiError;

use crate::error::HttpError;

/// Largest JSON body accepted (file contents go through the streaming routes).
const MAX_JSON_BYTES: usize = 16 << 20;

/// Turns a serde error at `path` into an error that names the field.
fn named<E: std::fmt::Display>(path: String, inner: E) -> ApiError {
    let message = inner.to_string();
    // serde reports an unknown field with the name only in its message.
    let quoted = |marker: &str| message.split_once(marker).and_then(|(_, rest)| rest.split_once('`')).map(|(n, _)| n);
    let field = match (quoted("unknown field `"), quoted("missing field `")) {
        // For an unknown field the path already ends with its name.
        (Some(name), _) if path == "." || path.is_empty() => name.to_string(),
        (Some(_), _) => path,
        (None, Some(name)) if path == "." || path.is_empty() => name.to_string(),
        (None, Some(name)) => format!("{path}.{name}"),
        (None, None) if path == "." => String::new(),
        (None, None) => path,
    };
    match field.is_empty() {
        true => ApiError::new(warren_api::ErrorCode::InvalidRequest, message),
        false => ApiError::invalid(field, message),
    }
}

pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = HttpError;

    async fn from_request(req: Request, state: &S) -> Result<Self, HttpError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::new(warren_api::ErrorCode::InvalidRequest, format!("cannot read body: {e}")))?;
        if bytes.len() > MAX_JSON_BYTES {
            return Err(ApiError::new(warren_api::ErrorCode::InvalidRequest, "JSON body too large").into());
        }
        // No body at all reads as `{}`: the error then names the first
        // required field instead of "EOF while parsing", and a request
        // whose fields all have defaults needs no body.
        let body: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        let de = &mut serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(de)
            .map(ApiJson)
            .map_err(|e| HttpError(named(e.path().to_string(), e.into_inner())))
    }
}

pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = HttpError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, HttpError> {
        let query = parts.uri.query().unwrap_or_default();
        let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
        serde_path_to_error::deserialize(de)
            .map(ApiQuery)
            .map_err(|e| HttpError(named(e.path().to_string(), e.into_inner())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_name_the_field() {
        let e = serde_json::from_str::<warren_api::CreateSandboxRequest>(r#"{"colour": 1}"#).unwrap_err();
        assert_eq!(named(".".into(), e).field.as_deref(), Some("colour"));
        let de = &mut serde_json::Deserializer::from_str(r#"{"bogus": 1}"#);
        let e = serde_path_to_error::deserialize::<_, warren_api::CreateSandboxRequest>(de).unwrap_err();
        assert_eq!(named(e.path().to_string(), e.into_inner()).field.as_deref(), Some("bogus"));
        let de = &mut serde_json::Deserializer::from_str(r#"{"cpus": "many"}"#);
        let e = serde_path_to_error::deserialize::<_, warren_api::CreateSandboxRequest>(de).unwrap_err();
        assert_eq!(named(e.path().to_string(), e.into_inner()).field.as_deref(), Some("cpus"));
        let e = serde_urlencoded::from_str::<warren_api::PathQuery>("").unwrap_err();
        assert_eq!(named(String::new(), e).field.as_deref(), Some("path"));
    }

    #[tokio::test]
    async fn query_errors_name_the_field() {
        let query = |uri: &'static str| async move {
            let (mut parts, ()) = axum::http::Request::builder().uri(uri).body(()).unwrap().into_parts();
            ApiQuery::<crate::handlers::ListQuery>::from_request_parts(&mut parts, &()).await.err().map(|e| e.0.field)
        };
        assert_eq!(query("/v1/sandboxes?state=sleepy").await, Some(Some("state".into())));
        assert_eq!(query("/v1/sandboxes?colour=red").await, Some(Some("colour".into())));
        assert_eq!(query("/v1/sandboxes?state=running&label=a%3Db").await, None);
    }
}

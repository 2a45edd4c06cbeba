//! The Connect protocol's wire format, JSON codec, over HTTP/1.1: unary
//! calls are plain `application/json` bodies; server streams are
//! `application/connect+json` bodies made of envelopes (a flags byte, a
//! big-endian u32 length, the message), ended by an end-of-stream envelope
//! (flag 0x02) that carries the error, if any.

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Envelope flag: the message is compressed (never sent or accepted here).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Bound on one request message; envd's requests are small (stdin chunks).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Connect error codes (the protocol's fixed set), with their HTTP statuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (Connect's table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A Connect error: a code and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError { code, message: message.into() }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

/// A unary error answer: the code's HTTP status and a JSON body.
impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        (self.code.http_status(), [(header::CONTENT_TYPE, "application/json")], self.json().to_string()).into_response()
    }
}

/// One envelope: flags, big-endian length, message.
pub fn envelope(flags: u8, message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(flags);
    out.put_u32(message.len() as u32);
    out.put_slice(message);
    out.freeze()
}

/// The envelope of one stream message.
pub fn message_envelope<T: Serialize>(message: &T) -> Bytes {
    // Serialising our own plain structs cannot fail.
    envelope(0, &serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec()))
}

/// The end-of-stream envelope: `{}` on success, `{"error": ...}` otherwise.
pub fn end_envelope(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.json() }),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// Decodes the single enveloped request message of a server-streaming call.
pub fn decode_enveloped<T: DeserializeOwned>(body: &[u8]) -> Result<T, ConnectError> {
    let invalid = |m: String| ConnectError::new(Code::InvalidArgument, m);
    if body.len() < 5 {
        return Err(invalid("the request is not an enveloped message".into()));
    }
    let flags = body[0];
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if flags & FLAG_COMPRESSED != 0 {
        return Err(ConnectError::new(Code::Unimplemented, "compressed messages are not supported"));
    }
    if len > MAX_MESSAGE_BYTES {
        return Err(invalid(format!("message of {len} bytes is over {MAX_MESSAGE_BYTES}")));
    }
    let Some(message) = body.get(5..5 + len) else {
        return Err(invalid(format!("envelope says {len} bytes, {} arrived", body.len() - 5)));
    };
    if body.len() != 5 + len {
        return Err(invalid("a server-streaming call takes exactly one request message".into()));
    }
    decode_json(message)
}

/// Decodes a JSON message (unknown fields are ignored, as protobuf's JSON
/// mapping asks of a reader that may be older than the writer).
pub fn decode_json<T: DeserializeOwned>(message: &[u8]) -> Result<T, ConnectError> {
    let message = if message.iter().all(u8::is_ascii_whitespace) { b"{}" as &[u8] } else { message };
    serde_json::from_slice(message).map_err(|e| ConnectError::new(Code::InvalidArgument, format!("bad message: {e}")))
}

/// A unary success answer.
pub fn unary_ok<T: Serialize>(message: &T) -> Response {
    let body = serde_json::to_vec(message).unwrap_or_else(|_| b"{}".to_vec());
    ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response()
}

/// The client's deadline from `Connect-Timeout-Ms`, if it sent one.
pub fn timeout_ms(headers: &HeaderMap) -> Option<u64> {
    headers.get("connect-timeout-ms")?.to_str().ok()?.trim().parse().ok()
}

/// Checks a request's content type: `application/json` for unary calls,
/// `application/connect+json` for streams. Anything else (the binary
/// protobuf codec) is refused with a clear message.
pub fn check_content_type(headers: &HeaderMap, streaming: bool) -> Result<(), ConnectError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let ct = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let want = if streaming { "application/connect+json" } else { "application/json" };
    if ct == want {
        Ok(())
    } else {
        Err(ConnectError::new(
            Code::Unimplemented,
            format!("content type `{ct}` is not served; use `{want}` (the JSON codec)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Msg {
        #[serde(default)]
        path: String,
    }

    #[test]
    fn envelope_has_flags_and_big_endian_length() {
        let e = envelope(0, b"{\"a\":1}");
        assert_eq!(&e[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(&e[5..], b"{\"a\":1}");
        let big = envelope(FLAG_END_STREAM, &vec![b' '; 0x0102_0304 & 0xffff]);
        assert_eq!(&big[..5], &[2, 0, 0, 0x03, 0x04]);
    }

    #[test]
    fn end_envelope_carries_the_error() {
        let ok = end_envelope(None);
        assert_eq!((ok[0], &ok[5..]), (FLAG_END_STREAM, &b"{}"[..]));
        let err = end_envelope(Some(&ConnectError::new(Code::NotFound, "no process 7")));
        let v: serde_json::Value = serde_json::from_slice(&err[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "no process 7");
        assert_eq!(u32::from_be_bytes([err[1], err[2], err[3], err[4]]) as usize, err.len() - 5);
    }

    #[test]
    fn decode_round_trips_and_ignores_unknown_fields() {
        let body = envelope(0, br#"{"path":"/tmp","future":{"x":1}}"#);
        assert_eq!(decode_enveloped::<Msg>(&body).unwrap(), Msg { path: "/tmp".into() });
        assert_eq!(decode_json::<Msg>(b"").unwrap(), Msg { path: String::new() });
    }

    #[test]
    fn decode_rejects_truncated_compressed_and_trailing_envelopes() {
        let body = envelope(0, b"{}");
        assert_eq!(decode_enveloped::<Msg>(&body[..6]).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(decode_enveloped::<Msg>(&body[..3]).unwrap_err().code, Code::InvalidArgument);
        let compressed = envelope(FLAG_COMPRESSED, b"{}");
        assert_eq!(decode_enveloped::<Msg>(&compressed).unwrap_err().code, Code::Unimplemented);
        let mut two = body.to_vec();
        two.extend_from_slice(&body);
        assert_eq!(decode_enveloped::<Msg>(&two).unwrap_err().code, Code::InvalidArgument);
        let huge = [0u8, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(decode_enveloped::<Msg>(&huge).unwrap_err().code, Code::InvalidArgument);
        assert_eq!(decode_enveloped::<Msg>(&envelope(0, b"[1")).unwrap_err().code, Code::InvalidArgument);
    }

    #[test]
    fn unary_errors_use_connects_status_table() {
        assert_eq!(Code::NotFound.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(Code::AlreadyExists.http_status(), StatusCode::CONFLICT);
        assert_eq!(Code::Unimplemented.http_status(), StatusCode::NOT_IMPLEMENTED);
        assert_eq!(Code::Canceled.http_status().as_u16(), 499);
        let r = ConnectError::new(Code::InvalidArgument, "bad").into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn content_type_picks_the_json_codec() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=utf-8"));
        assert!(check_content_type(&h, false).is_ok());
        assert!(check_content_type(&h, true).is_err());
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/connect+proto"));
        assert_eq!(check_content_type(&h, true).unwrap_err().code, Code::Unimplemented);
    }
}

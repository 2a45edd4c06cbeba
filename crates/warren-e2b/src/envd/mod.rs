//! envd, the in-sandbox agent of E2B, served by Warren from outside the
//! sandbox: `process.Process` and `filesystem.Filesystem` over Connect, and
//! the plain HTTP `/files` routes. Every call is a node operation.

pub mod files;
pub mod filesystem;
pub mod process;

use axum::body::Bytes;
use axum::http::HeaderMap;

use crate::connect::{self, ConnectError};
use crate::HOME;

/// A path as envd understands it: absolute as is; `~` and relative paths
/// from the user's home.
pub fn abs_path(path: &str) -> String {
    let rest = match path {
        "" | "~" => return HOME.to_string(),
        p if p.starts_with('/') => return p.to_string(),
        p => p.strip_prefix("~/").unwrap_or(p),
    };
    format!("{HOME}/{rest}")
}

/// Decodes a unary request's JSON body.
pub fn unary_request<T: serde::de::DeserializeOwned>(headers: &HeaderMap, body: &Bytes) -> Result<T, ConnectError> {
    connect::check_content_type(headers, false)?;
    connect::decode_json(body)
}

/// The last path segment of an RPC route that no method matched.
pub fn unknown_method(service: &str, method: &str) -> ConnectError {
    ConnectError::new(connect::Code::Unimplemented, format!("{service}/{method} is not implemented by Warren"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_and_home_paths_start_at_home() {
        assert_eq!(abs_path("/etc/hosts"), "/etc/hosts");
        assert_eq!(abs_path("a/b.txt"), "/home/user/a/b.txt");
        assert_eq!(abs_path("~/x"), "/home/user/x");
        assert_eq!(abs_path("~"), "/home/user");
        assert_eq!(abs_path(""), "/home/user");
    }
}

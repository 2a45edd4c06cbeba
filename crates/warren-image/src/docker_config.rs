//! Registry credentials from a Docker-style `config.json`: the `auths` map
//! from registry host to `{"auth": base64("user:password")}` (or
//! `{"username", "password"}`). The node reads one from
//! `--registry-auth-file`; the CLI reads the user's `~/.docker/config.json`.
//!
//! Credential helpers (`credsStore`, `credHelpers`) are not run: this crate
//! never executes anything on behalf of a config file.

use std::collections::HashMap;

use base64::Engine as _;
use serde::Deserialize;

use crate::registry::RegistryCredentials;

#[derive(Debug, thiserror::Error)]
pub enum DockerConfigError {
    #[error("not a Docker config file: {0}")]
    Json(#[from] serde_json::Error),
    /// An entry is malformed; names the registry key, never the secret.
    #[error("the entry for {0:?} is not base64(\"user:password\") or username/password")]
    BadEntry(String),
}

#[derive(Debug, Default, Deserialize)]
struct ConfigFile {
    #[serde(default)]
    auths: HashMap<String, Entry>,
}

#[derive(Default, Deserialize)]
struct Entry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Entry(<redacted>)")
    }
}

/// The credentials `config` (the file's bytes) holds for `registry`
/// (`host[:port]`, as [`crate::registry::registry_host`] gives it), if any.
/// Keys match with or without a scheme and path (`https://host/v1/`).
pub fn credentials_for(config: &[u8], registry: &str) -> Result<Option<RegistryCredentials>, DockerConfigError> {
    let file: ConfigFile = serde_json::from_slice(config)?;
    let Some((key, entry)) = file.auths.iter().find(|(key, _)| host_of(key) == registry) else {
        return Ok(None);
    };
    let bad = || DockerConfigError::BadEntry(key.clone());
    match (&entry.auth, &entry.username, &entry.password) {
        (Some(auth), _, _) if !auth.is_empty() => {
            let decoded = base64::engine::general_purpose::STANDARD.decode(auth.trim()).map_err(|_| bad())?;
            let text = String::from_utf8(decoded).map_err(|_| bad())?;
            let (username, password) = text.split_once(':').ok_or_else(bad)?;
            Ok(Some(RegistryCredentials { username: username.to_owned(), password: password.to_owned() }))
        }
        (_, Some(username), Some(password)) => {
            Ok(Some(RegistryCredentials { username: username.clone(), password: password.clone() }))
        }
        _ => Err(bad()),
    }
}

/// `https://host:5000/v1/` -> `host:5000`; Docker Hub's legacy key maps to
/// the host oci-client resolves `docker.io` to.
fn host_of(key: &str) -> &str {
    let rest = key.split_once("://").map_or(key, |(_, rest)| rest);
    let host = rest.split('/').next().unwrap_or(rest);
    match host {
        "docker.io" | "registry-1.docker.io" => "index.docker.io",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_match_by_host_in_either_form() {
        let config = br#"{"auths": {
            "https://127.0.0.1:5000/v1/": {"auth": "Y2k6czNjcmV0Og=="},
            "registry.example": {"username": "bot", "password": "pw"},
            "docker.io": {"auth": "dTpw"}
        }}"#;
        let ci = credentials_for(config, "127.0.0.1:5000").unwrap().unwrap();
        assert_eq!((ci.username.as_str(), ci.password.as_str()), ("ci", "s3cret:"));
        assert_eq!(credentials_for(config, "registry.example").unwrap().unwrap().username, "bot");
        assert_eq!(credentials_for(config, "index.docker.io").unwrap().unwrap().password, "p");
        assert!(credentials_for(config, "other:5000").unwrap().is_none());
    }

    #[test]
    fn a_malformed_entry_is_refused_without_echoing_it() {
        let config = br#"{"auths": {"r.example": {"auth": "bm9jb2xvbg=="}}}"#;
        let err = credentials_for(config, "r.example").unwrap_err();
        assert!(matches!(err, DockerConfigError::BadEntry(_)));
        assert!(!err.to_string().contains("bm9jb2xvbg"), "{err}");
        assert!(credentials_for(b"{}", "r.example").unwrap().is_none());
    }
}

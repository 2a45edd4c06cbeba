//! Phases: named stages of a task (e.g. `setup`, `rollout`, `grade`), each
//! with its own protected-path access levels and, in `allowlist` network
//! mode, its own egress policy. Switching phase is one call.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::network::NetworkPolicy;

/// What processes of a phase may do under a protected path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AccessLevel {
    /// Not even visible in listings' contents: no read, write or execute.
    None,
    /// Read and execute, no change.
    Read,
    ReadWrite,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    /// Absolute path inside the sandbox -> access level during this phase.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub protected_paths: BTreeMap<String, AccessLevel>,
    /// Egress policy while this phase is current (allowlist mode only);
    /// absent keeps the sandbox's `network_policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkPolicy>,
}

/// `PUT /v1/sandboxes/{id}/phase`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPhaseRequest {
    /// One of the phases the sandbox was created with.
    pub name: String,
    /// Kill every process of earlier phases (default). With `false` they
    /// keep running with the rights of the phase they started in.
    #[serde(default = "yes")]
    pub kill_running: bool,
}

fn yes() -> bool {
    true
}

pub const MAX_PHASES: usize = 32;
pub const MAX_PROTECTED_PATHS: usize = 64;

/// Checks the create request's `phases` and `phase` together.
pub fn validate_phases(phases: &BTreeMap<String, PhaseSpec>, initial: Option<&str>) -> Result<(), ApiError> {
    if phases.len() > MAX_PHASES {
        return Err(ApiError::invalid("phases", format!("at most {MAX_PHASES} phases")));
    }
    for (name, spec) in phases {
        if !valid_phase_name(name) {
            return Err(ApiError::invalid(format!("phases.{name}"), "phase names are 1-64 of [A-Za-z0-9_-]"));
        }
        if spec.protected_paths.len() > MAX_PROTECTED_PATHS {
            return Err(ApiError::invalid(
                format!("phases.{name}.protected_paths"),
                format!("at most {MAX_PROTECTED_PATHS} paths"),
            ));
        }
        for path in spec.protected_paths.keys() {
            if let Err(why) = check_protected_path(path) {
                return Err(ApiError::invalid(format!("phases.{name}.protected_paths.{path}"), why));
            }
        }
        if let Some(network) = &spec.network {
            network.validate(&format!("phases.{name}.network"))?;
        }
    }
    match initial {
        None if !phases.is_empty() => Err(ApiError::invalid("phase", "name the initial phase (one of `phases`)")),
        Some(name) if !phases.contains_key(name) => {
            Err(ApiError::invalid("phase", format!("`{name}` is not one of `phases`")))
        }
        _ => Ok(()),
    }
}

pub fn valid_phase_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A protected path is absolute, normalized (no `.`, `..`, `//`, trailing
/// `/`), not `/` itself and not inside the kernel's pseudo filesystems.
pub fn check_protected_path(path: &str) -> Result<(), &'static str> {
    if !path.starts_with('/') || path == "/" {
        return Err("must be an absolute path other than /");
    }
    if path.len() > 4096 || path.contains('\0') {
        return Err("must be at most 4096 bytes without NUL");
    }
    if path[1..].split('/').any(|c| c.is_empty() || c == "." || c == "..") {
        return Err("must be normalized: no `.`, `..`, empty components or trailing `/`");
    }
    let top = path[1..].split('/').next().unwrap_or_default();
    if matches!(top, "proc" | "sys" | "dev") {
        return Err("/proc, /sys and /dev cannot be protected paths");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn phases(json: &str) -> BTreeMap<String, PhaseSpec> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn initial_phase_must_be_named_and_known() {
        let p = phases(r#"{"rollout": {"protected_paths": {"/answers": "none"}}, "grade": {}}"#);
        assert_eq!(validate_phases(&p, Some("rollout")), Ok(()));
        assert_eq!(validate_phases(&p, None).unwrap_err().field.as_deref(), Some("phase"));
        assert_eq!(validate_phases(&p, Some("nope")).unwrap_err().field.as_deref(), Some("phase"));
        assert_eq!(validate_phases(&BTreeMap::new(), None), Ok(()));
    }

    #[test]
    fn bad_protected_paths_name_their_field() {
        for bad in ["answers", "/", "/a/../b", "/a//b", "/a/", "/proc/1", "/dev"] {
            let p = phases(&format!(r#"{{"x": {{"protected_paths": {{"{bad}": "read"}}}}}}"#));
            let err = validate_phases(&p, Some("x")).unwrap_err();
            assert_eq!(err.field, Some(format!("phases.x.protected_paths.{bad}")), "{bad}");
        }
    }

    #[test]
    fn set_phase_kills_running_by_default() {
        let req: SetPhaseRequest = serde_json::from_str(r#"{"name": "grade"}"#).unwrap();
        assert!(req.kill_running);
        assert!(serde_json::from_str::<SetPhaseRequest>(r#"{"name": "g", "x": 1}"#).is_err());
    }
}

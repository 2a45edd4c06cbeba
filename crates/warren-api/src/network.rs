//! Egress policy of a sandbox in `allowlist` network mode: which
//! destinations (by domain or by address) it may reach, on which ports and
//! protocols. Everything not allowed is refused and reported.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// Transport protocol a rule allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    #[default]
    Tcp,
    Udp,
    /// TCP and UDP.
    Any,
}

/// One allowed destination: exactly one of `domain` and `cidr`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    /// A host name (`pypi.org`) or a suffix wildcard (`*.pythonhosted.org`).
    /// Reachable only through the platform resolver, which pins the answers
    /// it gives into the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// An address or prefix, IPv4 or IPv6 (`10.1.2.3`, `10.0.0.0/8`, `fd00::/8`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    /// Allowed destination ports; empty allows every port.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<u16>,
    #[serde(default)]
    pub protocol: Protocol,
}

/// The whole egress policy; `PUT /v1/sandboxes/{id}/network` replaces it.
/// An empty policy allows nothing but the platform resolver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Named rule sets configured on the server, e.g. `pypi`, `npm`, `debian`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub presets: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rules: Vec<NetworkRule>,
}

pub const MAX_NETWORK_RULES: usize = 1024;

impl NetworkPolicy {
    /// Checks the policy's shape; `field` is where it sits in the request
    /// (e.g. `network_policy` or `phases.grade.network`).
    pub fn validate(&self, field: &str) -> Result<(), ApiError> {
        if self.rules.len() > MAX_NETWORK_RULES {
            return Err(ApiError::invalid(format!("{field}.rules"), format!("at most {MAX_NETWORK_RULES} rules")));
        }
        for (i, preset) in self.presets.iter().enumerate() {
            if preset.is_empty()
                || preset.len() > 64
                || !preset.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(ApiError::invalid(format!("{field}.presets[{i}]"), "must be 1-64 of [A-Za-z0-9_-]"));
            }
        }
        for (i, rule) in self.rules.iter().enumerate() {
            rule.validate(&format!("{field}.rules[{i}]"))?;
        }
        Ok(())
    }
}

impl NetworkRule {
    fn validate(&self, field: &str) -> Result<(), ApiError> {
        match (&self.domain, &self.cidr) {
            (Some(domain), None) => {
                if !valid_domain_pattern(domain) {
                    return Err(ApiError::invalid(
                        format!("{field}.domain"),
                        "must be a lower-case host name, optionally starting with `*.`",
                    ));
                }
            }
            (None, Some(cidr)) => {
                if parse_cidr(cidr).is_none() {
                    return Err(ApiError::invalid(
                        format!("{field}.cidr"),
                        "must be an IP address or prefix, e.g. 10.0.0.0/8",
                    ));
                }
            }
            _ => return Err(ApiError::invalid(field, "give exactly one of `domain` and `cidr`")),
        }
        if let Some(j) = self.ports.iter().position(|&p| p == 0) {
            return Err(ApiError::invalid(format!("{field}.ports[{j}]"), "must be 1-65535"));
        }
        Ok(())
    }
}

/// `pypi.org`, `*.pythonhosted.org`: lower-case labels of [a-z0-9-], not
/// starting or ending with `-`, at most 253 bytes.
pub fn valid_domain_pattern(pattern: &str) -> bool {
    let name = pattern.strip_prefix("*.").unwrap_or(pattern);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// An address with an optional prefix length (the full length when absent).
pub fn parse_cidr(text: &str) -> Option<(std::net::IpAddr, u8)> {
    let (addr, len) = match text.split_once('/') {
        Some((addr, len)) => (addr, Some(len)),
        None => (text, None),
    };
    let addr: std::net::IpAddr = addr.parse().ok()?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let len = match len {
        Some(len) => len.parse::<u8>().ok().filter(|&l| l <= max)?,
        None => max,
    };
    Some((addr, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(json: &str) -> Option<String> {
        let policy: NetworkPolicy = serde_json::from_str(json).unwrap();
        policy.validate("network_policy").err().and_then(|e| e.field)
    }

    #[test]
    fn good_policies_pass() {
        assert_eq!(field_of(r#"{"rules": [{"domain": "pypi.org", "ports": [443]}]}"#), None);
        assert_eq!(field_of(r#"{"rules": [{"domain": "*.pythonhosted.org"}]}"#), None);
        assert_eq!(field_of(r#"{"rules": [{"cidr": "10.0.0.0/8", "protocol": "udp"}]}"#), None);
        assert_eq!(field_of(r#"{"rules": [{"cidr": "fd00::1"}], "presets": ["pypi"]}"#), None);
    }

    #[test]
    fn bad_rules_name_their_field() {
        assert_eq!(field_of(r#"{"rules": [{}]}"#).as_deref(), Some("network_policy.rules[0]"));
        assert_eq!(
            field_of(r#"{"rules": [{"domain": "a.b", "cidr": "1.2.3.4"}]}"#).as_deref(),
            Some("network_policy.rules[0]")
        );
        assert_eq!(
            field_of(r#"{"rules": [{"domain": "Bad_Name"}]}"#).as_deref(),
            Some("network_policy.rules[0].domain")
        );
        assert_eq!(
            field_of(r#"{"rules": [{"cidr": "10.0.0.0/33"}]}"#).as_deref(),
            Some("network_policy.rules[0].cidr")
        );
        assert_eq!(
            field_of(r#"{"rules": [{"cidr": "10.0.0.1", "ports": [80, 0]}]}"#).as_deref(),
            Some("network_policy.rules[0].ports[1]")
        );
        assert_eq!(field_of(r#"{"presets": ["no spaces"]}"#).as_deref(), Some("network_policy.presets[0]"));
    }
}

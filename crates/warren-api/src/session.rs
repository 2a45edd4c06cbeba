//! Shell sessions: cwd and exported environment persist between commands.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateSessionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SessionInfo {
    pub id: String,
    pub cwd: String,
    /// Variables the session's commands exported, beyond the sandbox's own.
    pub env: BTreeMap<String, String>,
    pub created_at_ms: u64,
    pub commands_run: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionInfo>,
}

//! IAM on the wire: projects (nested), their quotas and use, API keys, and
//! the body of a `quota_exceeded` refusal.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ErrorCode;

/// The project that exists from the start: every other project is below
/// it, and a sandbox made without a key (auth off) belongs to it.
pub const ROOT_PROJECT: &str = "root";
/// Environment variable through which every client finds its API key.
pub const API_KEY_ENV: &str = "WARREN_API_KEY";

/// What a project (with everything below it) may hold at once, and how fast
/// it may create. An absent limit is "no limit of its own" (only its
/// ancestors' limits apply); a project below a limited one must set it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Live sandboxes (paused ones included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u64>,
    /// CPU cores the live sandboxes ask for in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Memory (MiB) the live sandboxes ask for in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Sandbox creations per second (a token bucket holding one second's
    /// worth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creates_per_sec: Option<u32>,
}

/// One dimension of a [`Quota`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum QuotaKind {
    Sandboxes,
    Cpus,
    MemoryMib,
    CreatesPerSec,
}

impl QuotaKind {
    pub const ALL: [QuotaKind; 4] =
        [QuotaKind::Sandboxes, QuotaKind::Cpus, QuotaKind::MemoryMib, QuotaKind::CreatesPerSec];

    /// The field's name in [`Quota`] (and in error `field`s, as `quota.<name>`).
    pub const fn as_str(self) -> &'static str {
        match self {
            QuotaKind::Sandboxes => "sandboxes",
            QuotaKind::Cpus => "cpus",
            QuotaKind::MemoryMib => "memory_mib",
            QuotaKind::CreatesPerSec => "creates_per_sec",
        }
    }
}

/// What a project and everything below it hold now.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QuotaUse {
    pub sandboxes: u64,
    pub cpus: f64,
    pub memory_mib: u64,
}

/// `GET /v1/projects/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectInfo {
    pub id: String,
    pub name: String,
    /// Absent only for the root project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Ids from the root project down to this one (itself included).
    pub path: Vec<String>,
    pub quota: Quota,
    /// The sum of the quotas given to its direct children.
    pub delegated: Quota,
    /// Live use by this project and everything below it.
    pub usage: QuotaUse,
    /// Unix time in milliseconds.
    pub created_at_ms: u64,
}

/// `GET /v1/projects`: the caller's project and every project below it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ProjectList {
    pub projects: Vec<ProjectInfo>,
}

/// `POST /v1/projects`: a child project, given quota out of its parent's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProjectRequest {
    /// 1-64 characters of `[A-Za-z0-9._-]`; unique among its siblings.
    pub name: String,
    /// Default: the caller's own project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default)]
    pub quota: Quota,
}

/// `POST /v1/projects/{id}/keys`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    /// A label for people (at most 128 characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// An API key as it is stored: never its secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ApiKeyInfo {
    pub id: String,
    pub project: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Unix time in milliseconds.
    pub created_at_ms: u64,
}

/// The answer to a key's creation: the only time its secret is shown.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ApiKeyCreated {
    pub key: ApiKeyInfo,
    /// Send as `Authorization: Bearer <secret>`. Warren keeps only its hash.
    pub secret: String,
}

/// 429 `quota_exceeded`: the create would take a project (the sandbox's or
/// one above it) past one of its quotas. `field` is `quota.<kind>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct QuotaExceededError {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The project whose quota is full.
    pub project: String,
    pub quota: QuotaKind,
    pub limit: f64,
    /// What the project and everything below it hold now.
    pub used: f64,
    /// What this create asks for.
    pub requested: f64,
}

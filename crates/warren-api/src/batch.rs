//! Batch creation and the admission queue: `POST /v1/sandboxes/batch`, its
//! NDJSON frames, and the body of a `queue_full` refusal.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorCode};
use crate::sandbox::{CreateSandboxRequest, SandboxInfo};

/// The most sandboxes one batch may ask for.
pub const MAX_BATCH_COUNT: u32 = 4096;
/// Default bound of the node's admission queue (creates waiting for room).
pub const DEFAULT_ADMISSION_QUEUE_LIMIT: usize = 1024;

/// `POST /v1/sandboxes/batch`: `count` sandboxes made from one template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BatchCreateRequest {
    /// How many sandboxes (1 to 4096).
    pub count: u32,
    /// What each sandbox is made from; its `idempotency_key` must be unset
    /// (items get theirs from `batch_key`).
    #[serde(default)]
    pub template: CreateSandboxRequest,
    /// Item `i` is created with the idempotency key `{batch_key}-{i}`: the
    /// same batch sent again answers with the same sandboxes, never more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_key: Option<String>,
    /// Wait in the node's admission queue while it is full (the default);
    /// `false` answers items that do not fit with `capacity_exceeded`.
    #[serde(default = "yes")]
    pub queue: bool,
}

fn yes() -> bool {
    true
}

impl BatchCreateRequest {
    pub fn validate(&self) -> Result<(), ApiError> {
        if !(1..=MAX_BATCH_COUNT).contains(&self.count) {
            return Err(ApiError::invalid("count", format!("must be between 1 and {MAX_BATCH_COUNT}")));
        }
        if self.template.idempotency_key.is_some() {
            return Err(ApiError::invalid(
                "template.idempotency_key",
                "items take their keys from `batch_key`; leave it unset",
            ));
        }
        if let Some(key) = &self.batch_key {
            if key.is_empty() || key.len() > 200 {
                return Err(ApiError::invalid("batch_key", "must be 1-200 characters"));
            }
        }
        self.template.validate().map_err(|mut e| {
            e.field = e.field.map(|f| format!("template.{f}"));
            e
        })
    }

    /// The create request of item `index`.
    pub fn item(&self, index: u32) -> CreateSandboxRequest {
        let mut req = self.template.clone();
        req.idempotency_key = self.batch_key.as_ref().map(|k| format!("{k}-{index}"));
        req
    }
}

/// One line of the batch's NDJSON answer: `queued` frames while items wait
/// for room (sent when the position changes), one `item` frame per sandbox
/// in the order they finish, then exactly one `done`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BatchFrame {
    Queued {
        /// Position of the batch's first waiting item in the node's
        /// admission queue: 1 is admitted next.
        position: u64,
        /// Items of this batch not admitted yet.
        items_waiting: u64,
    },
    Item {
        index: u32,
        /// The sandbox, when the item succeeded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sandbox: Option<Box<SandboxInfo>>,
        /// False when an earlier call with the item's idempotency key made it.
        #[serde(default)]
        made: bool,
        /// Why the item failed; the other items are not affected.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<ApiError>,
    },
    Done {
        /// Items made by this call.
        made: u32,
        /// Items answered with the sandbox an earlier call made.
        existing: u32,
        failed: u32,
    },
}

/// The body of HTTP 429 `queue_full`: the admission queue holds
/// `queue_limit` waiting creates already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct QueueFullError {
    pub code: ErrorCode,
    pub message: String,
    /// Always `queue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// How many creates the queue holds at most.
    pub queue_limit: u64,
}

/// What the node's books say about its capacity (`GET /v1/capacity`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema, Default)]
pub struct NodeBooks {
    pub sandboxes_max: u64,
    /// Live sandboxes, paused ones included.
    pub sandboxes_live: u64,
    pub sandboxes_paused: u64,
    /// Memory the node admits against (`--max-memory-mib`); absent: unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib_max: Option<u64>,
    /// Memory of running (not paused) sandboxes, of creates under way and
    /// of a driver's own guests (a VM snapshot template while it is built).
    pub memory_mib_committed: u64,
    /// Memory of paused sandboxes: not counted against `memory_mib_max`.
    pub memory_mib_reclaimable: u64,
    /// Creates waiting in the admission queue, and its bound.
    pub queue_waiting: u64,
    pub queue_limit: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_get_keys_from_the_batch_key_and_fields_are_named() {
        let req: BatchCreateRequest =
            serde_json::from_str(r#"{"count": 3, "batch_key": "b", "template": {"memory_mib": 64}}"#).unwrap();
        assert!(req.queue);
        assert_eq!(req.item(2).idempotency_key.as_deref(), Some("b-2"));
        assert_eq!(req.item(2).memory_mib, 64);
        let bad: BatchCreateRequest = serde_json::from_str(r#"{"count": 2, "template": {"memory_mib": 1}}"#).unwrap();
        assert_eq!(bad.validate().unwrap_err().field.as_deref(), Some("template.memory_mib"));
        let zero: BatchCreateRequest = serde_json::from_str(r#"{"count": 0}"#).unwrap();
        assert_eq!(zero.validate().unwrap_err().field.as_deref(), Some("count"));
        let keyed: BatchCreateRequest =
            serde_json::from_str(r#"{"count": 1, "template": {"idempotency_key": "k"}}"#).unwrap();
        assert_eq!(keyed.validate().unwrap_err().field.as_deref(), Some("template.idempotency_key"));
    }
}

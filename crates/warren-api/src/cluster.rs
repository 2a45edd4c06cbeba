//! Cluster mode: where a sandbox was placed, and the cluster's status.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::{Backend, NodeBooks};

/// Which node a sandbox runs on, and why the API server chose it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Placement {
    pub node: String,
    /// The decision in words: the candidates sampled, their load, image
    /// locality, and nodes that refused first.
    pub reason: String,
}

/// One node agent as the cluster sees it (`GET /v1/cluster`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NodeStatus {
    pub name: String,
    /// Where API servers reach it.
    pub url: String,
    pub backends: Vec<Backend>,
    pub cpus: f64,
    pub memory_total_mib: u64,
    /// Free space of its data directory (VM disks, layer cache, images).
    pub disk_free_mib: u64,
    pub books: NodeBooks,
    /// Images it holds locally (placement prefers these nodes).
    pub images: Vec<String>,
    /// Running sandboxes by backend and by label (`key=value`).
    pub running_by_backend: BTreeMap<String, u64>,
    pub running_by_label: BTreeMap<String, u64>,
    /// What each project's live sandboxes hold on this node (the quota gate
    /// of every API server sums these over the live nodes).
    #[serde(default)]
    pub usage_by_project: BTreeMap<String, crate::QuotaUse>,
    /// Unix time in milliseconds of its last registration write; the counts
    /// above include every sandbox that was live at this time.
    pub heartbeat_at_ms: u64,
    pub started_at_ms: u64,
}

/// `GET /v1/cluster`: the live nodes and the sandboxes running on them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ClusterStatus {
    pub nodes: Vec<NodeStatus>,
    pub running: u64,
    pub running_by_backend: BTreeMap<String, u64>,
    pub running_by_node: BTreeMap<String, u64>,
    pub running_by_label: BTreeMap<String, u64>,
    /// Live sandboxes (paused ones included) by project, from the nodes'
    /// heartbeats.
    #[serde(default)]
    pub live_by_project: BTreeMap<String, u64>,
    /// Sandboxes given up with their lost nodes, still on record.
    pub lost: u64,
}

//! The cluster's records in etcd and their keys:
//!
//! - `nodes/<node>`: a node's [`NodeStatus`], written under the node's
//!   lease, so it vanishes when the node stops renewing it;
//! - `placements/<node>/<sandbox>`: a [`PlacementRecord`], written by the
//!   API server that placed the sandbox, marked lost by a watcher when the
//!   node is lost, deleted by the node once it has forgotten the sandbox;
//! - `idempotency/cluster/<key>`: which node a client's idempotency key
//!   went to, so that a retry through any API server reaches the same node
//!   (whose own idempotency then returns the same sandbox).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use warren_api::{NodeStatus, Placement, SandboxInfo, SandboxState};
use warren_store::{StateStore, StateStoreExt, Table};
use warren_store_etcd::EtcdStore;

use crate::ClusterError;

/// Longest node name: `sb-<name>-<16 hex>` must fit the 40 bytes a
/// sandbox id may have.
pub const MAX_NODE_NAME: usize = 16;

/// Node names: 1 to [`MAX_NODE_NAME`] of `[a-z0-9]` (no `-`, which
/// separates the name from the rest of a sandbox id).
pub fn check_node_name(name: &str) -> Result<(), ClusterError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NODE_NAME
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    match ok {
        true => Ok(()),
        false => Err(ClusterError::Config(format!("node name {name:?}: use 1-{MAX_NODE_NAME} characters of [a-z0-9]"))),
    }
}

/// The id prefix of a node's sandboxes (see `NodeConfig::sandbox_id_prefix`).
pub fn sandbox_id_prefix(node: &str) -> String {
    format!("sb-{node}")
}

/// The node a cluster sandbox id names: `sb-<node>-<hex>`. `None` for ids
/// of the embedded server (`sb-<hex>`) and anything else.
pub fn node_of(sandbox_id: &str) -> Option<&str> {
    let (node, hex) = sandbox_id.strip_prefix("sb-")?.split_once('-')?;
    let valid = check_node_name(node).is_ok() && !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit());
    valid.then_some(node)
}

/// Where a sandbox went, kept in etcd beside the node's own record of it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlacementRecord {
    /// The sandbox as its node answered the create.
    pub sandbox: SandboxInfo,
    pub placement: Placement,
    /// Set by a watcher when the node was lost: unix ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_at_ms: Option<u64>,
}

impl PlacementRecord {
    /// What a client sees of a sandbox whose node is lost.
    pub fn lost_info(&self) -> SandboxInfo {
        let mut info = self.sandbox.clone();
        info.state = SandboxState::Ended;
        info.end_reason = Some(warren_api::EndReason::NodeLost);
        info.ended_at_ms = self.lost_at_ms;
        info.end_message = Some(format!("node {} was lost", self.placement.node));
        info.usage = None;
        info.placement = Some(self.placement.clone());
        info
    }
}

pub fn placement_key(node: &str, sandbox_id: &str) -> String {
    format!("{node}/{sandbox_id}")
}

pub fn idempotency_key(client_key: &str) -> String {
    format!("cluster/{client_key}")
}

/// The claim an idempotency key makes: which node got it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdempotencyClaim {
    pub node: String,
}

/// The etcd store shared by a role's tasks; every call blocks, so async
/// code goes through [`Etcd::call`].
#[derive(Clone)]
pub struct Etcd(pub Arc<EtcdStore>);

impl Etcd {
    /// Runs a blocking store call off the async threads.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&EtcdStore) -> Result<T, ClusterError> + Send + 'static,
    ) -> Result<T, ClusterError> {
        let store = self.0.clone();
        tokio::task::spawn_blocking(move || f(&store)).await.map_err(|_| ClusterError::Cancelled)?
    }

    pub async fn nodes(&self) -> Result<Vec<NodeStatus>, ClusterError> {
        self.call(|s| Ok(s.list_json::<NodeStatus>(Table::Nodes, "")?.into_iter().map(|(_, n)| n).collect())).await
    }

    pub async fn placements_of(&self, node: &str) -> Result<Vec<PlacementRecord>, ClusterError> {
        let prefix = format!("{node}/");
        self.call(move |s| {
            Ok(s.list_json::<PlacementRecord>(Table::Placements, &prefix)?.into_iter().map(|(_, p)| p).collect())
        })
        .await
    }

    pub async fn placement(&self, node: &str, sandbox_id: &str) -> Result<Option<PlacementRecord>, ClusterError> {
        let key = placement_key(node, sandbox_id);
        self.call(move |s| Ok(s.get_json(Table::Placements, &key)?)).await
    }

    pub async fn put_placement(&self, record: PlacementRecord) -> Result<(), ClusterError> {
        let key = placement_key(&record.placement.node, &record.sandbox.id);
        self.call(move |s| Ok(s.put_json(Table::Placements, &key, &record)?)).await
    }
}

/// Marks `node`'s placements lost (each a compare-and-swap, so two
/// watchers agree on one time). Returns how many it marked.
pub fn mark_lost(store: &EtcdStore, node: &str, now_ms: u64) -> Result<usize, ClusterError> {
    let mut marked = 0;
    for (key, _) in store.list(Table::Placements, &format!("{node}/"))? {
        let outcome = store.update(Table::Placements, &key, |current| {
            let Some(mut record) = current.and_then(|b| serde_json::from_slice::<PlacementRecord>(b).ok()) else {
                return warren_store_etcd::Update::Keep;
            };
            if record.lost_at_ms.is_some() {
                return warren_store_etcd::Update::Keep;
            }
            record.lost_at_ms = Some(now_ms);
            match serde_json::to_vec(&record) {
                Ok(bytes) => warren_store_etcd::Update::Put(bytes),
                Err(_) => warren_store_etcd::Update::Keep,
            }
        })?;
        if matches!(outcome, warren_store_etcd::Update::Put(_)) {
            marked += 1;
        }
    }
    Ok(marked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_id_names_its_node() {
        assert_eq!(node_of("sb-n1-0123456789abcdef"), Some("n1"));
        assert_eq!(node_of(&format!("{}-00ff", sandbox_id_prefix("node7"))), Some("node7"));
        assert_eq!(node_of("sb-0123456789abcdef"), None, "an embedded server's id");
        assert_eq!(node_of("sb-N1-0123"), None);
        assert_eq!(node_of("sb-n1-xyz"), None);
        assert_eq!(node_of("sb-n1-"), None);
        assert_eq!(node_of("fn-n1-0123"), None);
        assert_eq!(node_of("sb-abcdefghijklmnopq-00"), None, "17 characters is one too many");
        assert!(check_node_name("a-b").is_err());
        assert!(check_node_name("").is_err());
        assert!(check_node_name("n0123456789abcde").is_ok());
        // The longest name still makes an id of at most 40 bytes.
        assert!(format!("{}-{}", sandbox_id_prefix("n0123456789abcde"), "0".repeat(16)).len() <= 40);
    }
}

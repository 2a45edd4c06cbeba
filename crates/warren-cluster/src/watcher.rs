//! The API server's view of the live nodes, and the watcher that keeps it:
//! every [`POLL`] it lists the registrations; a node whose registration
//! vanished (its lease ran out) is lost, and its sandboxes are marked
//! ended `node_lost` in their placement records. Detection takes at most
//! the node's lease TTL plus one poll. Every API server runs one; the
//! marking is a compare-and-swap per record, so they agree. On start it
//! also marks the sandboxes of nodes that vanished while no API server
//! watched.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use warren_api::NodeStatus;
use warren_store::{StateStore, Table};

use crate::records::{mark_lost, Etcd};
use crate::ClusterError;

/// How often the registrations are read.
pub const POLL: Duration = Duration::from_secs(1);

/// The live nodes as last read from etcd.
#[derive(Clone, Default)]
pub struct NodeView(Arc<RwLock<HashMap<String, NodeStatus>>>);

impl NodeView {
    pub fn get(&self, name: &str) -> Option<NodeStatus> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    pub fn all(&self) -> Vec<NodeStatus> {
        let mut nodes: Vec<NodeStatus> = self.0.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        nodes.sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    fn replace(&self, nodes: HashMap<String, NodeStatus>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = nodes;
    }
}

/// Reads the registrations once (so the server starts with a view), marks
/// what was lost before, then keeps watching until the task is aborted.
pub async fn start(etcd: Etcd, view: NodeView) -> Result<tokio::task::JoinHandle<()>, ClusterError> {
    let live = read(&etcd).await?;
    let names: BTreeSet<String> = live.keys().cloned().collect();
    view.replace(live);
    mark_vanished_before(&etcd, &names).await?;
    Ok(tokio::spawn(async move {
        let mut known = names;
        loop {
            tokio::time::sleep(POLL).await;
            match poll(&etcd, &view, &known).await {
                Ok(now) => known = now,
                Err(e) => tracing::warn!("reading the node registrations failed: {e}"),
            }
        }
    }))
}

async fn read(etcd: &Etcd) -> Result<HashMap<String, NodeStatus>, ClusterError> {
    Ok(etcd.nodes().await?.into_iter().map(|n| (n.name.clone(), n)).collect())
}

async fn poll(etcd: &Etcd, view: &NodeView, known: &BTreeSet<String>) -> Result<BTreeSet<String>, ClusterError> {
    let live = read(etcd).await?;
    let names: BTreeSet<String> = live.keys().cloned().collect();
    view.replace(live);
    for lost in known.difference(&names) {
        let node = lost.clone();
        let now = warren_node::now_ms();
        let marked = etcd.call(move |s| mark_lost(s, &node, now)).await?;
        tracing::warn!(node = %lost, sandboxes = marked, "node lost: its registration lapsed");
    }
    Ok(names)
}

/// Nodes with placements but no registration: lost while nobody watched.
async fn mark_vanished_before(etcd: &Etcd, live: &BTreeSet<String>) -> Result<(), ClusterError> {
    let live = live.clone();
    etcd.call(move |s| {
        let placed: BTreeSet<String> = s
            .list(Table::Placements, "")?
            .into_iter()
            .filter_map(|(key, _)| key.split_once('/').map(|(node, _)| node.to_string()))
            .collect();
        let now = warren_node::now_ms();
        for node in placed.difference(&live) {
            let marked = mark_lost(s, node, now)?;
            if marked > 0 {
                tracing::warn!(node = %node, sandboxes = marked, "node lost before this API server started");
            }
        }
        Ok(())
    })
    .await
}

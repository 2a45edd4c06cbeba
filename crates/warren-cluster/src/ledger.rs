//! The quota ledger: what makes a project's quotas hold across API servers.
//!
//! Each API server's quota gate counts the nodes' heartbeats (what runs,
//! per project) and its own creates under way. What it cannot see alone is
//! the creates another API server admitted since the nodes' last
//! heartbeats. So a create of a project with any quota on its path takes
//! its room in one etcd key shared by every API server, `meta/cluster/
//! quota-ledger`: it reads the ledger, passes the local gate counting the
//! ledger's holds of the other servers as live sandboxes, and writes its
//! own hold with a compare-and-swap on the ledger's revision. If another
//! server wrote in between, the admission is given back and done again on
//! the new ledger - two API servers can never both take the last room.
//!
//! A hold counts from when it is taken until the create is done (made or
//! failed) and every live node has sent a heartbeat since - from then on the
//! heartbeats count what it made. A hold whose create never says it is done
//! (its API server died) counts for [`HOLD_TTL_MS`]. Holds that count no
//! more are pruned by whichever write comes next. Projects without any
//! quota on their path never touch the ledger (no etcd cost).
//!
//! Cost: two compare-and-swaps on the ledger per limited create (take,
//! done), plus a read; retries when API servers race on it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use warren_api::NodeStatus;
use warren_iam::{Demand, SandboxUsage};
use warren_store::Table;
use warren_store_etcd::{Cas, Expect, Update};

use crate::records::Etcd;
use crate::watcher::NodeView;
use crate::ClusterError;

/// The ledger's key in [`Table::Meta`].
pub const LEDGER_KEY: &str = "cluster/quota-ledger";
/// How long a hold whose create never finished counts (its API server
/// went away mid-create). Longer than any create takes, VM boots included.
pub const HOLD_TTL_MS: u64 = 120_000;

/// Every hold, by id (`<api server>-<n>`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Ledger {
    pub holds: BTreeMap<String, Hold>,
}

/// Room one create (or batch) took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hold {
    pub project: String,
    pub count: u64,
    /// Per sandbox, as [`Demand`].
    pub cpus: f64,
    pub memory_mib: u64,
    pub taken_at_ms: u64,
    /// When the create finished (made or failed); `None` while under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_at_ms: Option<u64>,
    /// The node that made the sandbox, when one create made one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

impl Hold {
    /// Whether the hold still holds room: under way and not expired, or
    /// done but not yet in a heartbeat of the node that made its sandbox
    /// (of every live node, when that is not known: a batch, a failure).
    fn counts(&self, nodes: &[NodeStatus], now_ms: u64) -> bool {
        match (self.done_at_ms, &self.node) {
            (None, _) => now_ms.saturating_sub(self.taken_at_ms) < HOLD_TTL_MS,
            // A node gone is its sandboxes gone.
            (Some(done), Some(node)) => nodes.iter().any(|n| n.name == *node && n.heartbeat_at_ms <= done),
            (Some(done), None) => nodes.iter().any(|n| n.heartbeat_at_ms <= done),
        }
    }
}

impl Ledger {
    fn parse(bytes: Option<&[u8]>) -> Result<Ledger, ClusterError> {
        match bytes {
            None => Ok(Ledger::default()),
            Some(b) => serde_json::from_slice(b).map_err(|e| ClusterError::Corrupt(format!("the quota ledger: {e}"))),
        }
    }

    /// The room other API servers' holds take, as live sandboxes for the
    /// gate (one entry per sandbox of a hold).
    pub fn others_usage(&self, own_prefix: &str, nodes: &[NodeStatus], now_ms: u64) -> Vec<SandboxUsage> {
        self.holds
            .iter()
            .filter(|(id, h)| !id.starts_with(own_prefix) && h.counts(nodes, now_ms))
            .flat_map(|(_, h)| {
                let one = SandboxUsage { project: h.project.clone(), cpus: h.cpus, memory_mib: h.memory_mib };
                std::iter::repeat_n(one, h.count as usize)
            })
            .collect()
    }

    /// Drops the holds that no longer count.
    pub fn prune(&mut self, nodes: &[NodeStatus], now_ms: u64) {
        self.holds.retain(|_, h| h.counts(nodes, now_ms));
    }
}

/// The ledger as read, with the revision a write must find unchanged.
pub struct Snapshot {
    pub ledger: Ledger,
    expect: Expect,
}

/// One API server's side of the ledger.
pub struct QuotaLedger {
    etcd: Etcd,
    /// The live nodes, whose heartbeats end done holds.
    nodes: NodeView,
    /// `<api server id>-`: this server's holds.
    own_prefix: String,
    next: AtomicU64,
}

impl QuotaLedger {
    pub fn new(etcd: Etcd, nodes: NodeView, api_id: &str) -> Arc<QuotaLedger> {
        Arc::new(QuotaLedger { etcd, nodes, own_prefix: format!("{api_id}-"), next: AtomicU64::new(0) })
    }

    /// The room other API servers' holds take in `snapshot` now.
    pub fn others_usage(&self, snapshot: &Snapshot) -> Vec<SandboxUsage> {
        snapshot.ledger.others_usage(&self.own_prefix, &self.nodes.all(), warren_node::now_ms())
    }

    pub async fn read(&self) -> Result<Snapshot, ClusterError> {
        let current = self.etcd.call(|st| Ok(st.get_versioned(Table::Meta, LEDGER_KEY)?)).await?;
        let ledger = Ledger::parse(current.as_ref().map(|v| v.value.as_slice()))?;
        let expect = current.map_or(Expect::Absent, |v| Expect::ModRevision(v.mod_revision));
        Ok(Snapshot { ledger, expect })
    }

    /// Writes a hold for `demand` of `project` if the ledger is still as
    /// `snapshot` read it; `None` when another API server wrote first.
    pub async fn try_take(
        self: &Arc<Self>,
        snapshot: Snapshot,
        project: &str,
        demand: Demand,
    ) -> Result<Option<HoldGuard>, ClusterError> {
        let id = format!("{}{}", self.own_prefix, self.next.fetch_add(1, Ordering::Relaxed));
        let Snapshot { mut ledger, expect } = snapshot;
        let now_ms = warren_node::now_ms();
        ledger.prune(&self.nodes.all(), now_ms);
        let hold = Hold {
            project: project.to_string(),
            count: demand.count,
            cpus: demand.cpus,
            memory_mib: demand.memory_mib,
            taken_at_ms: now_ms,
            done_at_ms: None,
            node: None,
        };
        ledger.holds.insert(id.clone(), hold);
        let value = serde_json::to_vec(&ledger).map_err(|e| ClusterError::Corrupt(e.to_string()))?;
        let outcome =
            self.etcd.call(move |st| Ok(st.compare_and_swap(Table::Meta, LEDGER_KEY, expect, &value)?)).await?;
        Ok(match outcome {
            Cas::Done { .. } => Some(HoldGuard { held: Some((Arc::clone(self), id)) }),
            Cas::Conflict { .. } => None,
        })
    }

    /// Marks hold `id` done now, made on `node` if one create made one
    /// there (a read-modify-write that retries on races).
    async fn done(&self, id: String, node: Option<String>) -> Result<(), ClusterError> {
        let now = warren_node::now_ms();
        let nodes = self.nodes.all();
        let update = move |current: Option<&[u8]>| {
            let Ok(mut ledger) = Ledger::parse(current) else { return Update::Keep };
            let Some(hold) = ledger.holds.get_mut(&id) else { return Update::Keep };
            hold.done_at_ms = Some(now);
            hold.node = node.clone();
            ledger.prune(&nodes, now);
            serde_json::to_vec(&ledger).map_or(Update::Keep, Update::Put)
        };
        self.etcd.call(move |st| Ok(st.update(Table::Meta, LEDGER_KEY, update)?)).await.map(|_| ())
    }
}

/// A hold in the ledger: [`HoldGuard::finish`] marks it done; dropping it
/// unfinished marks it done in the background, node unknown.
pub struct HoldGuard {
    held: Option<(Arc<QuotaLedger>, String)>,
}

impl HoldGuard {
    /// Marks the hold done now, its sandbox made on `node` (if any), and
    /// waits for the write: the create's client, once answered, finds its
    /// sandbox counted exactly once by every API server.
    pub async fn finish(mut self, node: Option<String>) {
        if let Some((ledger, id)) = self.held.take() {
            if let Err(e) = ledger.done(id.clone(), node).await {
                tracing::warn!(hold = %id, "the quota ledger: marking a hold done: {e}");
            }
        }
    }
}

impl Drop for HoldGuard {
    fn drop(&mut self) {
        let Some((ledger, id)) = self.held.take() else { return };
        // Off the request: a hold not marked done expires after HOLD_TTL_MS.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(e) = ledger.done(id.clone(), None).await {
                    tracing::warn!(hold = %id, "the quota ledger: marking a hold done: {e}");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, heartbeat_at_ms: u64) -> NodeStatus {
        crate::iam::tests::node(name, heartbeat_at_ms, &[])
    }

    fn hold(project: &str, count: u64, taken: u64, done: Option<u64>) -> Hold {
        Hold {
            project: project.into(),
            count,
            cpus: 1.0,
            memory_mib: 64,
            taken_at_ms: taken,
            done_at_ms: done,
            node: None,
        }
    }

    #[test]
    fn other_servers_holds_count_until_every_node_has_seen_them() {
        let mut ledger = Ledger::default();
        ledger.holds.insert("api1-0".into(), hold("a", 2, 1_000, None));
        ledger.holds.insert("api1-1".into(), hold("a", 1, 1_000, Some(2_000)));
        ledger.holds.insert("api2-0".into(), hold("b", 1, 1_000, None));
        let nodes = [node("n0", 1_500), node("n1", 2_500)];
        let seen = ledger.others_usage("api2-", &nodes, 3_000);
        // api1-0 (2 sandboxes, under way) and api1-1 (done after n0's last heartbeat).
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|u| u.project == "a"), "its own holds are the gate's already: {seen:?}");
        // Once every node has sent a heartbeat after it was done, a hold counts no more.
        let nodes = [node("n0", 2_100), node("n1", 2_500)];
        assert_eq!(ledger.others_usage("api2-", &nodes, 3_000).len(), 2);
    }

    #[test]
    fn a_hold_with_its_node_counts_until_that_nodes_heartbeat_only() {
        let mut ledger = Ledger::default();
        let mut made = hold("a", 1, 1_000, Some(2_000));
        made.node = Some("n0".into());
        ledger.holds.insert("api1-0".into(), made);
        // n0 has not sent a heartbeat since: the hold counts, whatever n1 did.
        assert_eq!(ledger.others_usage("api2-", &[node("n0", 1_900), node("n1", 2_500)], 3_000).len(), 1);
        // n0's heartbeat counts the sandbox now; n1 lagging does not matter.
        assert_eq!(ledger.others_usage("api2-", &[node("n0", 2_100), node("n1", 1_500)], 3_000).len(), 0);
        // n0 gone: its sandbox with it.
        assert_eq!(ledger.others_usage("api2-", &[node("n1", 1_500)], 3_000).len(), 0);
    }

    #[test]
    fn a_hold_whose_create_never_finished_expires() {
        let mut ledger = Ledger::default();
        ledger.holds.insert("gone-0".into(), hold("a", 1, 1_000, None));
        let nodes = [node("n0", 5_000)];
        assert_eq!(ledger.others_usage("me-", &nodes, 1_000 + HOLD_TTL_MS - 1).len(), 1);
        assert_eq!(ledger.others_usage("me-", &nodes, 1_000 + HOLD_TTL_MS).len(), 0);
        ledger.prune(&nodes, 1_000 + HOLD_TTL_MS);
        assert!(ledger.holds.is_empty());
    }

    #[test]
    fn a_corrupt_ledger_is_an_error_not_an_empty_one() {
        assert!(Ledger::parse(Some(b"{not json")).is_err());
        assert_eq!(Ledger::parse(None).expect("absent is empty"), Ledger::default());
    }
}

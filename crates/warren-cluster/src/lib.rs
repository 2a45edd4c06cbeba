//! Cluster mode: many machines running the same binary, with etcd holding
//! the shared state. Two roles build on the embedded pieces:
//!
//! - a **node** (`warren serve --role node`) is the embedded server (its own
//!   node agent, local redb, images) that registers in etcd under a lease
//!   ([`node_agent`]), names its sandboxes `sb-<node>-<hex>`, and answers
//!   sandbox operations only to callers holding the cluster token
//!   ([`token`]);
//! - an **API server** (`warren serve --role api`) keeps no state of its
//!   own: it places creates on nodes ([`placement`]), records where
//!   ([`records`]), proxies every sandbox call to the node its id names
//!   ([`api`]), and watches for lost nodes, whose sandboxes it ends
//!   `node_lost` ([`watcher`]). Any number run side by side. It enforces
//!   IAM and quotas with projects and keys in etcd ([`iam`]); nodes trust
//!   the project it writes into a create.
//!   It serves `/metrics`, `/v1/stats` summed over the nodes, and the `/ui`
//!   dashboard ([`metrics`]).
//!
//! Owns: the cluster records in etcd (node registrations, placements,
//! cluster-wide idempotency claims), placement, routing and the node-loss
//! watcher. Never: runs sandboxes itself (that is the node agent's), or does
//! consensus of its own (every shared decision is one etcd transaction).

pub mod api;
pub mod iam;
pub mod images;
pub mod ledger;
pub mod line;
pub mod metrics;
pub mod node_agent;
pub mod placement;
pub mod records;
pub mod token;
pub mod watcher;

#[cfg(feature = "testing")]
pub mod testing;

mod error;
mod rng;

pub use error::ClusterError;

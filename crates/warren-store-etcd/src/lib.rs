//! Owns the cluster mode's shared state: [`EtcdStore`], the
//! [`StateStore`](warren_store::StateStore) on an etcd cluster, so that any
//! number of API servers and node agents see one set of sandboxes,
//! idempotency claims and trajectories. etcd does the consensus; Warren
//! never does its own.
//!
//! Invariants: every key lives under the configured prefix
//! (`<prefix>/<table>/<key>`, see [`EtcdConfig::prefix`]); a write has been
//! committed by a quorum when the call returns; [`put_if_absent`] and every
//! compare-and-swap are single etcd transactions, so two API servers racing
//! on one key get exactly one winner. Beyond the trait it offers what a
//! cluster needs and the embedded store does not: [`EtcdStore::compare_and_swap`]
//! and [`EtcdStore::update`] on mod revisions (state transitions), and
//! [`EtcdStore::watch`] from a revision (components that react to changes).
//!
//! Never: hide a lost quorum or connection. Those are
//! [`EtcdError::Unavailable`] (`StoreError::Unavailable` through the trait)
//! after the configured timeouts, never a hang and never an empty answer.
//!
//! A separate crate from `warren-store` because the etcd client brings
//! tonic, prost and a `protoc` build step that the embedded binary's store
//! does not need.
//!
//! [`put_if_absent`]: warren_store::StateStore::put_if_absent

mod error;
mod keys;
mod store;
mod watch;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

#[cfg(test)]
mod tests;

pub use error::EtcdError;
pub use store::{Cas, EtcdConfig, EtcdStore, Expect, Update, Versioned};
pub use watch::{Watch, WatchEvent};

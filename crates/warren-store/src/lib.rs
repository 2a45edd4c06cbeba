//! Owns Warren's durable control-plane state: a small key-value store with a
//! fixed set of typed tables, behind the [`StateStore`] trait.
//!
//! Invariants: a write has reached stable storage when the call returns, and
//! [`StateStore::put_if_absent`] is atomic (of any number of racing callers,
//! exactly one inserts). The trait never exposes backend types, so the
//! embedded [`RedbStore`] and a cluster (etcd) implementation are
//! interchangeable; both must pass the same [`conformance`] suite.
//!
//! Cost: every durable write is a device sync, which dominates a short
//! operation. So an operation that writes several records writes them in
//! one commit ([`StateStore::apply`], [`StateStore::put_if_absent_and`]),
//! and the embedded store group-commits concurrent writers (one sync for
//! everything waiting when a commit starts). Nothing is written with a
//! weaker durability: what a restart needs (sandbox records, idempotency
//! claims, trajectory steps, exec records) is what the store holds, and
//! what it does not need (running execs' output, pool members) never goes
//! into it.
//!
//! This crate stores bytes; it never interprets them beyond the JSON helpers
//! in [`StateStoreExt`].

mod error;
mod group;
mod redb_store;
mod store;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

pub use error::{Result, StoreError};
pub use redb_store::RedbStore;
pub use store::{StateStore, StateStoreExt, Table, Write};

//! Owns Warren's durable control-plane state: a small key-value store with a
//! fixed set of typed tables, behind the [`StateStore`] trait.
//!
//! Invariants: a write has reached stable storage when the call returns, and
//! [`StateStore::put_if_absent`] is atomic (of any number of racing callers,
//! exactly one inserts). The trait never exposes backend types, so the
//! embedded [`RedbStore`] and a cluster (etcd) implementation are
//! interchangeable; both must pass the same [`conformance`] suite.
//!
//! This crate stores bytes; it never interprets them beyond the JSON helpers
//! in [`StateStoreExt`].

mod error;
mod redb_store;
mod store;

#[cfg(any(test, feature = "conformance"))]
pub mod conformance;

pub use error::{Result, StoreError};
pub use redb_store::RedbStore;
pub use store::{StateStore, StateStoreExt, Table};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Result, StoreError};

/// The store's tables. Fixed so that every backend can create them up front
/// and a typo cannot make a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    Sandboxes,
    Idempotency,
    Execs,
    Sessions,
    Meta,
    /// One row per sandbox that has a trajectory: what it was made from.
    Trajectories,
    /// The trajectory steps, keyed `<sandbox>/<step, zero-padded>`.
    TrajectorySteps,
    /// Cluster mode: node agents' registrations, each under its lease.
    Nodes,
    /// Cluster mode: where each sandbox was placed (node, why, its owner),
    /// and the end of a sandbox whose node was lost.
    Placements,
    /// IAM: projects by id (each with its parent, path and quota).
    Projects,
    /// IAM: API keys by id (project and secret hash, never the secret).
    ApiKeys,
}

impl Table {
    pub const ALL: [Table; 11] = [
        Table::Sandboxes,
        Table::Idempotency,
        Table::Execs,
        Table::Sessions,
        Table::Meta,
        Table::Trajectories,
        Table::TrajectorySteps,
        Table::Nodes,
        Table::Placements,
        Table::Projects,
        Table::ApiKeys,
    ];

    /// The table's stable on-disk name; renaming one loses its data.
    pub const fn name(self) -> &'static str {
        match self {
            Table::Sandboxes => "sandboxes",
            Table::Idempotency => "idempotency",
            Table::Execs => "execs",
            Table::Sessions => "sessions",
            Table::Meta => "meta",
            Table::Trajectories => "trajectories",
            Table::TrajectorySteps => "trajectory_steps",
            Table::Nodes => "nodes",
            Table::Placements => "placements",
            Table::Projects => "projects",
            Table::ApiKeys => "api_keys",
        }
    }
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One change of a [`StateStore::apply`] batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    Put { table: Table, key: String, value: Vec<u8> },
    Delete { table: Table, key: String },
}

impl Write {
    /// A put of `value` as JSON.
    pub fn json<T: Serialize + ?Sized>(table: Table, key: impl Into<String>, value: &T) -> Result<Write> {
        let key = key.into();
        let value = encode(table, &key, value)?;
        Ok(Write::Put { table, key, value })
    }

    pub fn delete(table: Table, key: impl Into<String>) -> Write {
        Write::Delete { table, key: key.into() }
    }
}

/// A durable key-value store of byte values in fixed tables, keys ordered by
/// their UTF-8 bytes. Synchronous: async callers use `spawn_blocking`, since
/// a write waits for stable storage.
pub trait StateStore: Send + Sync {
    fn get(&self, t: Table, key: &str) -> Result<Option<Vec<u8>>>;
    /// Inserts or overwrites. Durable when it returns.
    fn put(&self, t: Table, key: &str, value: &[u8]) -> Result<()>;
    /// Inserts only if absent; returns the existing value otherwise (atomic).
    /// `None` means this call inserted.
    fn put_if_absent(&self, t: Table, key: &str, value: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Returns whether the key existed.
    fn delete(&self, t: Table, key: &str) -> Result<bool>;
    /// All entries whose key starts with `prefix`, in ascending key order.
    fn list(&self, t: Table, prefix: &str) -> Result<Vec<(String, Vec<u8>)>>;
    /// The entry with the greatest key starting with `prefix`, without
    /// reading the others: an append-only log finds its tail in one seek.
    fn last(&self, t: Table, prefix: &str) -> Result<Option<(String, Vec<u8>)>>;
    /// Deletes all keys starting with `prefix` in one transaction; returns
    /// how many there were.
    fn delete_prefix(&self, t: Table, prefix: &str) -> Result<u64>;

    /// Applies `writes` in order; durable when it returns. The embedded
    /// store commits them as one transaction (one device sync for all, and
    /// a crash keeps all or none); this default, for a backend without
    /// multi-key transactions, applies them one by one.
    fn apply(&self, writes: &[Write]) -> Result<()> {
        for w in writes {
            match w {
                Write::Put { table, key, value } => self.put(*table, key, value)?,
                Write::Delete { table, key } => {
                    self.delete(*table, key)?;
                }
            }
        }
        Ok(())
    }

    /// [`StateStore::put_if_absent`] that also applies `also` when (and
    /// only when) this call inserted. The embedded store does both in one
    /// transaction; this default applies `also` right after the insert.
    fn put_if_absent_and(&self, t: Table, key: &str, value: &[u8], also: &[Write]) -> Result<Option<Vec<u8>>> {
        let existing = self.put_if_absent(t, key, value)?;
        if existing.is_none() {
            self.apply(also)?;
        }
        Ok(existing)
    }
}

/// Typed JSON access on top of any [`StateStore`], including `dyn` ones.
pub trait StateStoreExt: StateStore {
    fn get_json<T: DeserializeOwned>(&self, t: Table, key: &str) -> Result<Option<T>> {
        self.get(t, key)?.map(|bytes| decode(t, key, &bytes)).transpose()
    }

    fn put_json<T: Serialize + ?Sized>(&self, t: Table, key: &str, value: &T) -> Result<()> {
        self.put(t, key, &encode(t, key, value)?)
    }

    /// Like [`StateStore::put_if_absent`]; returns the existing value decoded.
    fn put_json_if_absent<T: Serialize + DeserializeOwned>(&self, t: Table, key: &str, value: &T) -> Result<Option<T>> {
        self.put_if_absent(t, key, &encode(t, key, value)?)?.map(|bytes| decode(t, key, &bytes)).transpose()
    }

    /// [`StateStore::put_if_absent_and`] with the value as JSON; returns the
    /// existing value decoded.
    fn put_json_if_absent_and<T: Serialize + DeserializeOwned>(
        &self,
        t: Table,
        key: &str,
        value: &T,
        also: &[Write],
    ) -> Result<Option<T>> {
        self.put_if_absent_and(t, key, &encode(t, key, value)?, also)?.map(|bytes| decode(t, key, &bytes)).transpose()
    }

    fn last_json<T: DeserializeOwned>(&self, t: Table, prefix: &str) -> Result<Option<(String, T)>> {
        self.last(t, prefix)?
            .map(|(key, bytes)| {
                let value = decode(t, &key, &bytes)?;
                Ok((key, value))
            })
            .transpose()
    }

    fn list_json<T: DeserializeOwned>(&self, t: Table, prefix: &str) -> Result<Vec<(String, T)>> {
        self.list(t, prefix)?
            .into_iter()
            .map(|(key, bytes)| {
                let value = decode(t, &key, &bytes)?;
                Ok((key, value))
            })
            .collect()
    }
}

impl<S: StateStore + ?Sized> StateStoreExt for S {}

fn encode<T: Serialize + ?Sized>(t: Table, key: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| StoreError::Json { table: t.name(), key: key.to_owned(), source })
}

fn decode<T: DeserializeOwned>(t: Table, key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|source| StoreError::Json { table: t.name(), key: key.to_owned(), source })
}

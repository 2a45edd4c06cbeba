use std::path::{Path, PathBuf};

use redb::{Database, DatabaseError, Durability, ReadableTable, TableDefinition, WriteTransaction};

use crate::error::{Result, StoreError};
use crate::store::{StateStore, Table};

/// The embedded store: one redb file, owned by one process at a time (redb
/// takes an exclusive `flock` on it).
///
/// Every write transaction commits with [`Durability::Immediate`] (redb 2's
/// default, set explicitly so a redb upgrade cannot weaken it): the commit
/// `fdatasync`s before returning, so each `put` costs one sync of the device.
/// Writers are serialised by redb; readers never block writers.
pub struct RedbStore {
    db: Database,
    path: PathBuf,
}

const fn definition(t: Table) -> TableDefinition<'static, &'static str, &'static [u8]> {
    TableDefinition::new(t.name())
}

impl RedbStore {
    /// Opens the store at `path`, creating the file and all tables if needed.
    /// Fails with [`StoreError::Locked`] if the file is open elsewhere.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let db = Database::create(&path).map_err(|e| match e {
            DatabaseError::DatabaseAlreadyOpen => StoreError::Locked { path: path.clone() },
            other => backend_error(other),
        })?;
        let store = Self { db, path };
        store.create_tables()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creating every table up front lets reads assume they exist instead of
    /// treating "no such table" as "empty" at each call site.
    fn create_tables(&self) -> Result<()> {
        let txn = self.begin_write()?;
        for t in Table::ALL {
            txn.open_table(definition(t)).map_err(backend_error)?;
        }
        txn.commit().map_err(backend_error)
    }

    fn begin_write(&self) -> Result<WriteTransaction> {
        let mut txn = self.db.begin_write().map_err(backend_error)?;
        txn.set_durability(Durability::Immediate);
        Ok(txn)
    }

    /// Commits if the transaction changed something; a no-op write would
    /// still pay for a device sync.
    fn finish(txn: WriteTransaction, changed: bool) -> Result<()> {
        if changed {
            txn.commit().map_err(backend_error)
        } else {
            txn.abort().map_err(backend_error)
        }
    }
}

impl StateStore for RedbStore {
    fn get(&self, t: Table, key: &str) -> Result<Option<Vec<u8>>> {
        let txn = self.db.begin_read().map_err(backend_error)?;
        let table = txn.open_table(definition(t)).map_err(backend_error)?;
        let value = table.get(key).map_err(backend_error)?.map(|v| v.value().to_vec());
        Ok(value)
    }

    fn put(&self, t: Table, key: &str, value: &[u8]) -> Result<()> {
        let txn = self.begin_write()?;
        txn.open_table(definition(t)).map_err(backend_error)?.insert(key, value).map_err(backend_error)?;
        Self::finish(txn, true)
    }

    fn put_if_absent(&self, t: Table, key: &str, value: &[u8]) -> Result<Option<Vec<u8>>> {
        // redb admits one write transaction at a time, so the read and the
        // insert below cannot interleave with another writer.
        let txn = self.begin_write()?;
        let existing = {
            let mut table = txn.open_table(definition(t)).map_err(backend_error)?;
            let existing = table.get(key).map_err(backend_error)?.map(|v| v.value().to_vec());
            if existing.is_none() {
                table.insert(key, value).map_err(backend_error)?;
            }
            existing
        };
        Self::finish(txn, existing.is_none())?;
        Ok(existing)
    }

    fn delete(&self, t: Table, key: &str) -> Result<bool> {
        let txn = self.begin_write()?;
        let existed =
            txn.open_table(definition(t)).map_err(backend_error)?.remove(key).map_err(backend_error)?.is_some();
        Self::finish(txn, existed)?;
        Ok(existed)
    }

    fn list(&self, t: Table, prefix: &str) -> Result<Vec<(String, Vec<u8>)>> {
        let txn = self.db.begin_read().map_err(backend_error)?;
        let table = txn.open_table(definition(t)).map_err(backend_error)?;
        let mut entries = Vec::new();
        for entry in table.range(prefix..).map_err(backend_error)? {
            let (key, value) = entry.map_err(backend_error)?;
            let key = key.value();
            if !key.starts_with(prefix) {
                break;
            }
            entries.push((key.to_owned(), value.value().to_vec()));
        }
        Ok(entries)
    }

    fn last(&self, t: Table, prefix: &str) -> Result<Option<(String, Vec<u8>)>> {
        let txn = self.db.begin_read().map_err(backend_error)?;
        let table = txn.open_table(definition(t)).map_err(backend_error)?;
        // Keys starting with `prefix` sort before `prefix + U+10FFFF` unless
        // they start with that too; so look at those first (rarely any),
        // then walk back once from the bound.
        let mut bounds = vec![prefix.to_owned()];
        while let Some(deeper) = bounds.last().map(|b| format!("{b}{}", char::MAX)) {
            let has_deeper = table
                .range(deeper.as_str()..)
                .map_err(backend_error)?
                .next()
                .transpose()
                .map_err(backend_error)?
                .is_some_and(|(k, _)| k.value().starts_with(deeper.as_str()));
            if !has_deeper {
                break;
            }
            bounds.push(deeper);
        }
        let Some(innermost) = bounds.pop() else { return Ok(None) };
        let upper = format!("{innermost}{}", char::MAX);
        let found = table.range(innermost.as_str()..upper.as_str()).map_err(backend_error)?.next_back();
        match found {
            None => Ok(None),
            Some(entry) => {
                let (key, value) = entry.map_err(backend_error)?;
                Ok(Some((key.value().to_owned(), value.value().to_vec())))
            }
        }
    }

    fn delete_prefix(&self, t: Table, prefix: &str) -> Result<u64> {
        let txn = self.begin_write()?;
        let removed = {
            let mut table = txn.open_table(definition(t)).map_err(backend_error)?;
            let mut keys = Vec::new();
            for entry in table.range(prefix..).map_err(backend_error)? {
                let (key, _) = entry.map_err(backend_error)?;
                let key = key.value();
                if !key.starts_with(prefix) {
                    break;
                }
                keys.push(key.to_owned());
            }
            for key in &keys {
                table.remove(key.as_str()).map_err(backend_error)?;
            }
            keys.len() as u64
        };
        Self::finish(txn, removed > 0)?;
        Ok(removed)
    }
}

/// Keeps redb's error types out of the public API: callers see the variants
/// they can act on, and redb's text for the rest.
fn backend_error(e: impl Into<redb::Error>) -> StoreError {
    match e.into() {
        redb::Error::Corrupted(msg) => StoreError::Corrupt(msg),
        redb::Error::Io(io) => StoreError::Io(io),
        other => StoreError::Backend(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance;

    fn with_store(check: fn(&dyn StateStore)) {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path().join("state.redb")).unwrap();
        check(&store);
    }

    #[test]
    fn crud_roundtrip() {
        with_store(conformance::crud_roundtrip);
    }

    #[test]
    fn tables_are_independent() {
        with_store(conformance::tables_are_independent);
    }

    #[test]
    fn list_returns_prefix_matches_in_key_order() {
        with_store(conformance::list_returns_prefix_matches_in_key_order);
    }

    #[test]
    fn delete_prefix_removes_only_matches() {
        with_store(conformance::delete_prefix_removes_only_matches);
    }

    #[test]
    fn put_if_absent_keeps_first_value() {
        with_store(conformance::put_if_absent_keeps_first_value);
    }

    #[test]
    fn put_if_absent_race_has_exactly_one_winner() {
        with_store(conformance::put_if_absent_race_has_exactly_one_winner);
    }

    #[test]
    fn json_helpers_roundtrip_and_reject_wrong_type() {
        with_store(conformance::json_helpers_roundtrip_and_reject_wrong_type);
    }

    #[test]
    fn last_returns_greatest_key_with_prefix() {
        with_store(conformance::last_returns_greatest_key_with_prefix);
    }

    #[test]
    fn run_all_passes() {
        with_store(conformance::run_all);
    }

    #[test]
    fn reopen_after_drop_keeps_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let store = RedbStore::open(&path).unwrap();
            store.put(Table::Sandboxes, "sb-1", b"running").unwrap();
            store.put(Table::Meta, "schema", b"1").unwrap();
            store.put(Table::Execs, "gone", b"x").unwrap();
            assert!(store.delete(Table::Execs, "gone").unwrap());
        }
        let store = RedbStore::open(&path).unwrap();
        assert_eq!(store.get(Table::Sandboxes, "sb-1").unwrap().as_deref(), Some(&b"running"[..]));
        assert_eq!(store.get(Table::Meta, "schema").unwrap().as_deref(), Some(&b"1"[..]));
        assert_eq!(store.get(Table::Execs, "gone").unwrap(), None);
    }

    #[test]
    fn second_open_while_open_fails_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let first = RedbStore::open(&path).unwrap();
        match RedbStore::open(&path) {
            Err(StoreError::Locked { path: locked }) => assert_eq!(locked, path),
            Err(other) => panic!("expected Locked, got {other}"),
            Ok(_) => panic!("second open of a held store succeeded"),
        }
        let err = RedbStore::open(&path).err().unwrap().to_string();
        assert!(err.contains("already open") && err.contains("state.redb"), "unclear message: {err}");
        // The first handle is unaffected, and the lock goes with it.
        first.put(Table::Meta, "k", b"v").unwrap();
        drop(first);
        let again = RedbStore::open(&path).unwrap();
        assert_eq!(again.get(Table::Meta, "k").unwrap().as_deref(), Some(&b"v"[..]));
    }

    #[test]
    fn open_of_a_non_store_file_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        std::fs::write(&path, vec![0xa5u8; 8192]).unwrap();
        let err = RedbStore::open(&path).err().expect("garbage file opened as a store");
        assert!(!matches!(err, StoreError::Locked { .. }), "{err}");
    }
}

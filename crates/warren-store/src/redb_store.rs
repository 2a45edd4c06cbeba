use std::path::{Path, PathBuf};

use redb::{Database, DatabaseError, Durability, ReadableTable, TableDefinition, WriteTransaction};

use crate::error::{Result, StoreError};
use crate::group::{Group, Op, Outcome};
use crate::store::{StateStore, Table, Write};

/// The embedded store: one redb file, owned by one process at a time (redb
/// takes an exclusive `flock` on it).
///
/// Every write transaction commits with [`Durability::Immediate`] (redb 2's
/// default, set explicitly so a redb upgrade cannot weaken it): the commit
/// `fdatasync`s before returning, so each commit costs one sync of the
/// device (about 0.25 ms on an idle virtio disk, far more under load).
/// Writers are serialised by redb; readers never block writers. So callers
/// that write several records for one operation fold them into one commit
/// with [`StateStore::apply`] or [`StateStore::put_if_absent_and`] instead of
/// paying (and queueing behind) a sync per record; and writes of concurrent
/// callers are group-committed (see `group`): whoever arrives while a commit
/// is in flight goes into the next one, together with everyone else
/// waiting, so a busy node pays one sync per group instead of per write.
/// Every write is still durable when its call returns.
pub struct RedbStore {
    db: Database,
    path: PathBuf,
    group: Group,
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
        let store = Self { db, path, group: Group::default() };
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

    /// Runs `op` in the next group commit.
    fn submit(&self, op: Op) -> Result<Outcome> {
        self.group.submit(op, |ops| self.run_group(ops))
    }

    /// One group: its ops in order in one transaction, committed (one
    /// sync) if any of them changed something.
    fn run_group(&self, ops: &[Op]) -> Result<Vec<Outcome>> {
        let txn = self.begin_write()?;
        let mut changed = false;
        let mut outcomes = Vec::with_capacity(ops.len());
        for op in ops {
            let outcome = match op {
                Op::Apply(writes) => {
                    Self::write_all(&txn, writes)?;
                    changed |= !writes.is_empty();
                    Outcome::Done
                }
                Op::PutIfAbsent { table, key, value, also } => {
                    let existing = {
                        let mut t = txn.open_table(definition(*table)).map_err(backend_error)?;
                        let existing = t.get(key.as_str()).map_err(backend_error)?.map(|v| v.value().to_vec());
                        if existing.is_none() {
                            t.insert(key.as_str(), value.as_slice()).map_err(backend_error)?;
                        }
                        existing
                    };
                    if existing.is_none() {
                        Self::write_all(&txn, also)?;
                        changed = true;
                    }
                    Outcome::Existing(existing)
                }
                Op::Delete { table, key } => {
                    let existed = txn
                        .open_table(definition(*table))
                        .map_err(backend_error)?
                        .remove(key.as_str())
                        .map_err(backend_error)?
                        .is_some();
                    changed |= existed;
                    Outcome::Existed(existed)
                }
                Op::DeletePrefix { table, prefix } => {
                    let mut t = txn.open_table(definition(*table)).map_err(backend_error)?;
                    let mut keys = Vec::new();
                    for entry in t.range(prefix.as_str()..).map_err(backend_error)? {
                        let (key, _) = entry.map_err(backend_error)?;
                        let key = key.value();
                        if !key.starts_with(prefix.as_str()) {
                            break;
                        }
                        keys.push(key.to_owned());
                    }
                    for key in &keys {
                        t.remove(key.as_str()).map_err(backend_error)?;
                    }
                    changed |= !keys.is_empty();
                    Outcome::Removed(keys.len() as u64)
                }
            };
            outcomes.push(outcome);
        }
        Self::finish(txn, changed)?;
        Ok(outcomes)
    }

    fn write_all(txn: &WriteTransaction, writes: &[Write]) -> Result<()> {
        for w in writes {
            match w {
                Write::Put { table, key, value } => {
                    txn.open_table(definition(*table))
                        .map_err(backend_error)?
                        .insert(key.as_str(), value.as_slice())
                        .map_err(backend_error)?;
                }
                Write::Delete { table, key } => {
                    txn.open_table(definition(*table))
                        .map_err(backend_error)?
                        .remove(key.as_str())
                        .map_err(backend_error)?;
                }
            }
        }
        Ok(())
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
        self.apply(&[Write::Put { table: t, key: key.to_owned(), value: value.to_vec() }])
    }

    fn put_if_absent(&self, t: Table, key: &str, value: &[u8]) -> Result<Option<Vec<u8>>> {
        self.put_if_absent_and(t, key, value, &[])
    }

    fn delete(&self, t: Table, key: &str) -> Result<bool> {
        // Deleting what is not there (a sandbox without sessions, a released
        // claim) needs no place in the commit queue.
        if self.get(t, key)?.is_none() {
            return Ok(false);
        }
        match self.submit(Op::Delete { table: t, key: key.to_owned() })? {
            Outcome::Existed(existed) => Ok(existed),
            other => Err(unexpected(other)),
        }
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

    fn apply(&self, writes: &[Write]) -> Result<()> {
        if writes.is_empty() {
            return Ok(());
        }
        match self.submit(Op::Apply(writes.to_vec()))? {
            Outcome::Done => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    fn put_if_absent_and(&self, t: Table, key: &str, value: &[u8], also: &[Write]) -> Result<Option<Vec<u8>>> {
        // The read and the insert run in one write transaction, and redb
        // admits one at a time: no other writer can come between them.
        let op = Op::PutIfAbsent { table: t, key: key.to_owned(), value: value.to_vec(), also: also.to_vec() };
        match self.submit(op)? {
            Outcome::Existing(existing) => Ok(existing),
            other => Err(unexpected(other)),
        }
    }

    fn delete_prefix(&self, t: Table, prefix: &str) -> Result<u64> {
        if self.last(t, prefix)?.is_none() {
            return Ok(0);
        }
        match self.submit(Op::DeletePrefix { table: t, prefix: prefix.to_owned() })? {
            Outcome::Removed(n) => Ok(n),
            other => Err(unexpected(other)),
        }
    }
}

fn unexpected(outcome: Outcome) -> StoreError {
    StoreError::Backend(format!("group commit answered with {outcome:?}"))
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
    fn apply_puts_and_deletes_in_order() {
        with_store(conformance::apply_puts_and_deletes_in_order);
    }

    #[test]
    fn put_if_absent_and_applies_only_for_the_inserter() {
        with_store(conformance::put_if_absent_and_applies_only_for_the_inserter);
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

    /// A batch is one commit: a reopened store has all of it.
    #[test]
    fn applied_batch_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let store = RedbStore::open(&path).unwrap();
            store.put(Table::Execs, "sb/old", b"x").unwrap();
            store
                .apply(&[
                    Write::Put { table: Table::Execs, key: "sb/ex".into(), value: b"done".to_vec() },
                    Write::Put { table: Table::TrajectorySteps, key: "sb/1".into(), value: b"step".to_vec() },
                    Write::delete(Table::Execs, "sb/old"),
                ])
                .unwrap();
        }
        let store = RedbStore::open(&path).unwrap();
        assert_eq!(store.get(Table::Execs, "sb/ex").unwrap().as_deref(), Some(&b"done"[..]));
        assert_eq!(store.get(Table::TrajectorySteps, "sb/1").unwrap().as_deref(), Some(&b"step"[..]));
        assert_eq!(store.get(Table::Execs, "sb/old").unwrap(), None);
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

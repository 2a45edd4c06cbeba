//! The behaviour every [`StateStore`] implementation must show. Each check
//! takes a store, works under its own key prefix (so checks can share a
//! store that holds other data) and panics on a violation, like a test.
//! An implementation runs [`run_all`] or each check as its own `#[test]`.

use std::sync::Barrier;

use serde::{Deserialize, Serialize};

use crate::{StateStore, StateStoreExt, StoreError, Table, Write};

/// Runs every check against one store.
pub fn run_all(store: &dyn StateStore) {
    crud_roundtrip(store);
    tables_are_independent(store);
    list_returns_prefix_matches_in_key_order(store);
    delete_prefix_removes_only_matches(store);
    put_if_absent_keeps_first_value(store);
    put_if_absent_race_has_exactly_one_winner(store);
    json_helpers_roundtrip_and_reject_wrong_type(store);
    last_returns_greatest_key_with_prefix(store);
    apply_puts_and_deletes_in_order(store);
    put_if_absent_and_applies_only_for_the_inserter(store);
}

pub fn apply_puts_and_deletes_in_order(store: &dyn StateStore) {
    let (a, b) = ("conformance/apply/a", "conformance/apply/b");
    store.put(Table::Sessions, b, b"old").unwrap();
    store
        .apply(&[
            Write::Put { table: Table::Execs, key: a.into(), value: b"first".to_vec() },
            Write::Put { table: Table::Execs, key: a.into(), value: b"second".to_vec() },
            Write::delete(Table::Sessions, b),
            Write::json(Table::Meta, a, &7u32).unwrap(),
        ])
        .unwrap();
    assert_eq!(store.get(Table::Execs, a).unwrap().as_deref(), Some(&b"second"[..]), "later writes win");
    assert_eq!(store.get(Table::Sessions, b).unwrap(), None);
    assert_eq!(store.get_json::<u32>(Table::Meta, a).unwrap(), Some(7));
    store.apply(&[]).unwrap();
    store.apply(&[Write::delete(Table::Execs, a), Write::delete(Table::Meta, a)]).unwrap();
    assert_eq!(store.get(Table::Execs, a).unwrap(), None);
    assert_eq!(store.get(Table::Meta, a).unwrap(), None);
}

pub fn put_if_absent_and_applies_only_for_the_inserter(store: &dyn StateStore) {
    let (key, side) = ("conformance/pia/k", "conformance/pia/side");
    let also = |v: &[u8]| vec![Write::Put { table: Table::Execs, key: side.into(), value: v.to_vec() }];
    assert_eq!(store.put_if_absent_and(Table::TrajectorySteps, key, b"one", &also(b"1")).unwrap(), None);
    assert_eq!(store.get(Table::Execs, side).unwrap().as_deref(), Some(&b"1"[..]));
    let existing = store.put_if_absent_and(Table::TrajectorySteps, key, b"two", &also(b"2")).unwrap();
    assert_eq!(existing.as_deref(), Some(&b"one"[..]));
    assert_eq!(store.get(Table::Execs, side).unwrap().as_deref(), Some(&b"1"[..]), "a loser's writes were applied");
    assert_eq!(store.get(Table::TrajectorySteps, key).unwrap().as_deref(), Some(&b"one"[..]));
    store.apply(&[Write::delete(Table::TrajectorySteps, key), Write::delete(Table::Execs, side)]).unwrap();
}

pub fn crud_roundtrip(store: &dyn StateStore) {
    let t = Table::Sandboxes;
    let key = "conformance/crud/k";
    assert_eq!(store.get(t, key).unwrap(), None);
    store.put(t, key, b"one").unwrap();
    assert_eq!(store.get(t, key).unwrap().as_deref(), Some(&b"one"[..]));
    store.put(t, key, b"two").unwrap();
    assert_eq!(store.get(t, key).unwrap().as_deref(), Some(&b"two"[..]));
    assert!(store.delete(t, key).unwrap());
    assert!(!store.delete(t, key).unwrap());
    assert_eq!(store.get(t, key).unwrap(), None);

    // Values are bytes, not text; empty is a value, not absence.
    let binary = [0u8, 0xff, 0xfe, 0, 1];
    store.put(t, "conformance/crud/binary", &binary).unwrap();
    assert_eq!(store.get(t, "conformance/crud/binary").unwrap().as_deref(), Some(&binary[..]));
    store.put(t, "conformance/crud/empty", b"").unwrap();
    assert_eq!(store.get(t, "conformance/crud/empty").unwrap(), Some(Vec::new()));
    assert_eq!(store.delete_prefix(t, "conformance/crud/").unwrap(), 2);
}

pub fn tables_are_independent(store: &dyn StateStore) {
    let key = "conformance/tables/k";
    store.put(Table::Sandboxes, key, b"sandbox").unwrap();
    for other in Table::ALL.into_iter().filter(|t| *t != Table::Sandboxes) {
        assert_eq!(store.get(other, key).unwrap(), None, "{other} sees a key put in sandboxes");
        assert!(store.list(other, "conformance/tables/").unwrap().is_empty());
        assert!(!store.delete(other, key).unwrap());
    }
    assert!(store.delete(Table::Sandboxes, key).unwrap());
}

pub fn list_returns_prefix_matches_in_key_order(store: &dyn StateStore) {
    let t = Table::Execs;
    // Neighbours that sort just before and just after the prefix range.
    let outside = ["conformance/list-", "conformance/list0", "conformance/lisz"];
    let inside = [
        "conformance/list/b",
        "conformance/list/é",
        "conformance/list/a/x",
        "conformance/list/a",
        "conformance/list/c",
    ];
    for key in outside.iter().chain(inside.iter()) {
        store.put(t, key, key.as_bytes()).unwrap();
    }
    let listed = store.list(t, "conformance/list/").unwrap();
    let keys: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    // Byte order: 'é' (0xc3 0xa9) sorts after every ASCII letter.
    assert_eq!(
        keys,
        [
            "conformance/list/a",
            "conformance/list/a/x",
            "conformance/list/b",
            "conformance/list/c",
            "conformance/list/é"
        ]
    );
    for (key, value) in &listed {
        assert_eq!(value, key.as_bytes());
    }
    assert_eq!(store.list(t, "conformance/list/zzz").unwrap(), Vec::new());
    assert_eq!(store.delete_prefix(t, "conformance/lis").unwrap(), 8);
}

pub fn delete_prefix_removes_only_matches(store: &dyn StateStore) {
    let t = Table::Sessions;
    for key in ["conformance/dp/sb-1/a", "conformance/dp/sb-1/b", "conformance/dp/sb-10/a", "conformance/dp/sb-2/a"] {
        store.put(t, key, b"x").unwrap();
    }
    assert_eq!(store.delete_prefix(t, "conformance/dp/sb-1/").unwrap(), 2);
    let left: Vec<String> = store.list(t, "conformance/dp/").unwrap().into_iter().map(|(k, _)| k).collect();
    assert_eq!(left, ["conformance/dp/sb-10/a", "conformance/dp/sb-2/a"]);
    assert_eq!(store.delete_prefix(t, "conformance/dp/sb-1/").unwrap(), 0);
    assert_eq!(store.delete_prefix(t, "conformance/dp/").unwrap(), 2);
    assert!(store.list(t, "conformance/dp/").unwrap().is_empty());
}

pub fn put_if_absent_keeps_first_value(store: &dyn StateStore) {
    let t = Table::Idempotency;
    let key = "conformance/pia/k";
    assert_eq!(store.put_if_absent(t, key, b"first").unwrap(), None);
    assert_eq!(store.put_if_absent(t, key, b"second").unwrap().as_deref(), Some(&b"first"[..]));
    assert_eq!(store.get(t, key).unwrap().as_deref(), Some(&b"first"[..]));
    assert!(store.delete(t, key).unwrap());
    assert_eq!(store.put_if_absent(t, key, b"third").unwrap(), None);
    assert!(store.delete(t, key).unwrap());
}

/// 8 threads race `put_if_absent` on one key, over several rounds so a
/// non-atomic check-then-insert has many chances to show.
pub fn put_if_absent_race_has_exactly_one_winner(store: &dyn StateStore) {
    const THREADS: usize = 8;
    const ROUNDS: usize = 16;
    let t = Table::Idempotency;
    for round in 0..ROUNDS {
        let key = format!("conformance/race/{round}");
        let barrier = Barrier::new(THREADS);
        let outcomes: Vec<(Vec<u8>, Option<Vec<u8>>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|i| {
                    let (key, barrier) = (&key, &barrier);
                    s.spawn(move || {
                        let mine = format!("thread-{i}").into_bytes();
                        barrier.wait();
                        let existing = store.put_if_absent(t, key, &mine).unwrap();
                        (mine, existing)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let winners: Vec<&Vec<u8>> = outcomes.iter().filter(|(_, e)| e.is_none()).map(|(mine, _)| mine).collect();
        assert_eq!(winners.len(), 1, "round {round}: {} threads inserted", winners.len());
        let winner = winners[0];
        for (_, existing) in &outcomes {
            if let Some(seen) = existing {
                assert_eq!(seen, winner, "round {round}: a loser saw a value other than the winner's");
            }
        }
        assert_eq!(store.get(t, &key).unwrap().as_ref(), Some(winner));
    }
    assert_eq!(store.delete_prefix(t, "conformance/race/").unwrap(), ROUNDS as u64);
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Record {
    id: String,
    cpus: u32,
}

pub fn json_helpers_roundtrip_and_reject_wrong_type(store: &dyn StateStore) {
    let t = Table::Meta;
    let record = Record { id: "sb-1".into(), cpus: 2 };
    store.put_json(t, "conformance/json/a", &record).unwrap();
    assert_eq!(store.get_json::<Record>(t, "conformance/json/a").unwrap(), Some(record));
    assert_eq!(store.get_json::<Record>(t, "conformance/json/missing").unwrap(), None);

    let other = Record { id: "sb-2".into(), cpus: 4 };
    let existing = store.put_json_if_absent(t, "conformance/json/a", &other).unwrap();
    assert_eq!(existing, Some(Record { id: "sb-1".into(), cpus: 2 }));
    assert_eq!(store.list_json::<Record>(t, "conformance/json/").unwrap().len(), 1);

    store.put(t, "conformance/json/bad", b"{not json").unwrap();
    match store.get_json::<Record>(t, "conformance/json/bad") {
        Err(StoreError::Json { table, key, .. }) => {
            assert_eq!(table, "meta");
            assert_eq!(key, "conformance/json/bad");
        }
        other => panic!("expected a Json error, got {other:?}"),
    }
    assert_eq!(store.delete_prefix(t, "conformance/json/").unwrap(), 2);
}

/// `last` is the tail of an append-only log: the greatest key with the
/// prefix, never a neighbour's key that sorts after it.
pub fn last_returns_greatest_key_with_prefix(store: &dyn StateStore) {
    let t = Table::TrajectorySteps;
    assert_eq!(store.last(t, "conformance/last/").unwrap(), None);
    // Neighbours on both sides of the prefix range, including one that
    // extends the prefix with the greatest char.
    store.put(t, "conformance/last-", b"before").unwrap();
    store.put(t, "conformance/last0", b"after").unwrap();
    assert_eq!(store.last(t, "conformance/last/").unwrap(), None);
    for step in [3u64, 1, 20, 2] {
        store.put(t, &format!("conformance/last/{step:020}"), step.to_string().as_bytes()).unwrap();
    }
    let (key, value) = store.last(t, "conformance/last/").unwrap().unwrap();
    assert_eq!(key, format!("conformance/last/{:020}", 20));
    assert_eq!(value, b"20");
    let max = format!("conformance/last/{}tail", char::MAX);
    store.put(t, &max, b"max").unwrap();
    assert_eq!(store.last(t, "conformance/last/").unwrap().map(|(k, _)| k), Some(max.clone()));
    assert!(store.delete(t, &max).unwrap());
    store.put_json(t, "conformance/last/x", &Record { id: "sb-9".into(), cpus: 1 }).unwrap();
    let (key, rec) = store.last_json::<Record>(t, "conformance/last/").unwrap().unwrap();
    assert_eq!((key.as_str(), rec.cpus), ("conformance/last/x", 1));
    assert_eq!(store.delete_prefix(t, "conformance/last").unwrap(), 7);
    assert_eq!(store.last(t, "conformance/last").unwrap(), None);
}

//! The store against real etcd members started per test (see
//! [`crate::testing`]): the shared conformance suite, then what only the
//! etcd store promises (prefixes, compare-and-swap, watches, unavailability,
//! a member's death).

use std::sync::Barrier;
use std::time::Duration;

use warren_store::{conformance, StateStore, StoreError, Table};

use crate::testing::EtcdCluster;
use crate::{Cas, EtcdConfig, EtcdError, EtcdStore, Expect, Update, WatchEvent};

fn store_on(endpoints: Vec<String>, prefix: &str) -> EtcdStore {
    EtcdStore::connect(EtcdConfig::new(endpoints).with_prefix(prefix)).expect("connect")
}

fn with_store(check: fn(&dyn StateStore)) {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/conformance");
    check(&store);
}

/// A plain etcd client, for looking at (and compacting) the keyspace past
/// the store.
fn raw<T>(endpoints: Vec<String>, f: impl AsyncFnOnce(etcd_client::Client) -> T) -> T {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let client = etcd_client::Client::connect(endpoints, None).await.unwrap();
        f(client).await
    })
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

/// Every check, including ones added to the suite later without a test of
/// their own here.
#[test]
fn run_all_passes() {
    with_store(conformance::run_all);
}

#[test]
fn keys_live_under_the_prefix_and_prefixes_do_not_mix() {
    let cluster = EtcdCluster::start(1);
    let a = store_on(cluster.endpoints(), "/a/");
    let b = store_on(cluster.endpoints(), "/b");
    a.put(Table::Sandboxes, "sb-1", b"in a").unwrap();
    assert_eq!(b.get(Table::Sandboxes, "sb-1").unwrap(), None);
    assert!(b.list(Table::Sandboxes, "").unwrap().is_empty());
    assert_eq!(b.delete_prefix(Table::Sandboxes, "").unwrap(), 0);
    assert_eq!(a.list(Table::Sandboxes, "").unwrap(), vec![("sb-1".to_owned(), b"in a".to_vec())]);

    let keys: Vec<Vec<u8>> = raw(cluster.endpoints(), async |mut c| {
        let resp = c.get("", Some(etcd_client::GetOptions::new().with_all_keys().with_keys_only())).await.unwrap();
        resp.kvs().iter().map(|kv| kv.key().to_vec()).collect()
    });
    assert_eq!(keys, vec![b"/a/sandboxes/sb-1".to_vec()]);
}

#[test]
fn list_spans_pages_as_one_snapshot() {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/pages");
    // More than two pages, so paging continues from a pinned revision.
    let n = 600;
    for i in 0..n {
        store.put(Table::TrajectorySteps, &format!("sb-1/{i:020}"), i.to_string().as_bytes()).unwrap();
    }
    store.put(Table::TrajectorySteps, "sb-10/0", b"neighbour").unwrap();
    let listed = store.list(Table::TrajectorySteps, "sb-1/").unwrap();
    assert_eq!(listed.len(), n);
    for (i, (key, value)) in listed.iter().enumerate() {
        assert_eq!(key, &format!("sb-1/{i:020}"));
        assert_eq!(value, i.to_string().as_bytes());
    }
    let (_, revision) = store.list_versioned(Table::TrajectorySteps, "sb-1/").unwrap();
    assert!(revision >= n as i64, "listing revision {revision} predates the writes");
    assert_eq!(store.delete_prefix(Table::TrajectorySteps, "sb-1/").unwrap(), n as u64);
}

#[test]
fn compare_and_swap_applies_only_on_the_expected_revision() {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/cas");
    let t = Table::Sandboxes;
    let Cas::Done { revision: created } = store.compare_and_swap(t, "sb-1", Expect::Absent, b"creating").unwrap()
    else {
        panic!("insert of an absent key conflicted");
    };
    let current = store.get_versioned(t, "sb-1").unwrap().unwrap();
    assert_eq!((current.value.as_slice(), current.mod_revision), (&b"creating"[..], created));

    // A second "absent" claim loses and sees the winner.
    match store.compare_and_swap(t, "sb-1", Expect::Absent, b"other").unwrap() {
        Cas::Conflict { current: Some(v) } => assert_eq!(v, current),
        other => panic!("expected a conflict, got {other:?}"),
    }
    let Cas::Done { revision: running } =
        store.compare_and_swap(t, "sb-1", Expect::ModRevision(created), b"running").unwrap()
    else {
        panic!("swap on the current revision conflicted");
    };
    assert!(running > created);
    // A writer holding the old revision loses: no lost update.
    match store.compare_and_swap(t, "sb-1", Expect::ModRevision(created), b"ended").unwrap() {
        Cas::Conflict { current: Some(v) } => {
            assert_eq!((v.value.as_slice(), v.mod_revision), (&b"running"[..], running))
        }
        other => panic!("stale swap was applied: {other:?}"),
    }
    assert!(matches!(store.compare_and_delete(t, "sb-1", created).unwrap(), Cas::Conflict { .. }));
    assert!(matches!(store.compare_and_delete(t, "sb-1", running).unwrap(), Cas::Done { .. }));
    assert_eq!(store.get(t, "sb-1").unwrap(), None);
    match store.compare_and_swap(t, "sb-1", Expect::ModRevision(running), b"x").unwrap() {
        Cas::Conflict { current: None } => {}
        other => panic!("swap on a deleted key: {other:?}"),
    }
}

/// Racing read-modify-writes through two store handles (two API servers):
/// every increment lands, none is lost to an interleaving.
#[test]
fn update_races_lose_no_increment() {
    const THREADS: usize = 4;
    const EACH: usize = 25;
    let cluster = EtcdCluster::start(1);
    let stores = [store_on(cluster.endpoints(), "/update"), store_on(cluster.endpoints(), "/update")];
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for i in 0..THREADS {
            let (store, barrier) = (&stores[i % 2], &barrier);
            s.spawn(move || {
                barrier.wait();
                for _ in 0..EACH {
                    let decided = store
                        .update(Table::Meta, "counter", |current| {
                            let n: usize = current.map_or(0, |v| std::str::from_utf8(v).unwrap().parse().unwrap());
                            Update::Put((n + 1).to_string().into_bytes())
                        })
                        .unwrap();
                    assert!(matches!(decided, Update::Put(_)));
                }
            });
        }
    });
    let total = stores[0].get(Table::Meta, "counter").unwrap().unwrap();
    assert_eq!(total, (THREADS * EACH).to_string().as_bytes());

    // A transition that does not apply writes nothing.
    let before = stores[0].get_versioned(Table::Meta, "counter").unwrap().unwrap();
    assert_eq!(stores[1].update(Table::Meta, "counter", |_| Update::Keep).unwrap(), Update::Keep);
    assert_eq!(stores[0].get_versioned(Table::Meta, "counter").unwrap().unwrap(), before);
    assert_eq!(stores[1].update(Table::Meta, "counter", |_| Update::Delete).unwrap(), Update::Delete);
    assert_eq!(stores[0].get(Table::Meta, "counter").unwrap(), None);
}

#[test]
fn watch_from_a_listing_sees_every_later_change_once_in_order() {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/watch");
    let t = Table::Sandboxes;
    store.put(t, "sb-1", b"creating").unwrap();
    let (listed, revision) = store.list_versioned(t, "").unwrap();
    assert_eq!(listed.len(), 1);

    // Changes between the listing and the watch are not lost...
    store.put(t, "sb-1", b"running").unwrap();
    store.put(t, "sb-2", b"creating").unwrap();
    let mut from_listing = store.watch(t, "", Some(revision + 1)).unwrap();
    // ...and a watch from "now" sees only what follows it.
    let mut from_now = store.watch(t, "", None).unwrap();
    // Not in range: another table, and the same table under another prefix.
    store.put(Table::Execs, "sb-1", b"exec").unwrap();
    store_on(cluster.endpoints(), "/other").put(t, "sb-3", b"elsewhere").unwrap();
    assert!(store.delete(t, "sb-1").unwrap());

    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(from_listing.blocking_next().unwrap().unwrap());
    }
    let summary: Vec<(&str, Option<&[u8]>)> = seen
        .iter()
        .map(|e| match e {
            WatchEvent::Put { key, value, .. } => (key.as_str(), Some(value.as_slice())),
            WatchEvent::Delete { key, .. } => (key.as_str(), None),
        })
        .collect();
    assert_eq!(summary, [("sb-1", Some(&b"running"[..])), ("sb-2", Some(&b"creating"[..])), ("sb-1", None)]);
    assert!(seen.windows(2).all(|w| w[0].revision() < w[1].revision()));
    assert!(seen[0].revision() > revision);

    let only = from_now.blocking_next().unwrap().unwrap();
    assert_eq!(only, seen[2]);

    // A prefix watch sees only its prefix.
    let mut sb2 = store.watch(t, "sb-2", None).unwrap();
    store.put(t, "sb-1", b"again").unwrap();
    store.put(t, "sb-2", b"running").unwrap();
    assert_eq!(sb2.blocking_next().unwrap().unwrap().key(), "sb-2");
}

#[test]
fn watch_from_compacted_history_is_a_typed_error() {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/compact");
    for i in 0..5 {
        store.put(Table::Sandboxes, "sb-1", i.to_string().as_bytes()).unwrap();
    }
    let (_, revision) = store.list_versioned(Table::Sandboxes, "").unwrap();
    raw(cluster.endpoints(), async |mut c| c.compact(revision, None).await.unwrap());
    // etcd confirms the watch, then cancels it: the error is its first item.
    let mut watch = store.watch(Table::Sandboxes, "", Some(2)).unwrap();
    match watch.blocking_next() {
        Some(Err(EtcdError::Compacted { requested: 2, compacted })) => assert_eq!(compacted, revision),
        other => panic!("expected Compacted, got {other:?}"),
    }
    assert!(watch.blocking_next().is_none());
    // From the listing's revision on, the watch works.
    let mut watch = store.watch(Table::Sandboxes, "", Some(revision + 1)).unwrap();
    store.put(Table::Sandboxes, "sb-1", b"after").unwrap();
    assert_eq!(watch.blocking_next().unwrap().unwrap().revision(), revision + 1);
}

#[test]
fn unreachable_etcd_is_unavailable_not_a_hang() {
    // A port that was free a moment ago: nothing listens there.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut config = EtcdConfig::new([endpoint.clone()]).with_prefix("/down");
    config.request_timeout = Duration::from_secs(1);
    config.retry_budget = Duration::from_secs(1);
    let store = EtcdStore::connect(config).unwrap();
    for result in [store.get(Table::Sandboxes, "sb-1").map(|_| ()), store.put(Table::Sandboxes, "sb-1", b"x")] {
        match result {
            Err(StoreError::Unavailable { endpoints, .. }) => assert_eq!(endpoints, endpoint),
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
    assert!(matches!(store.check(), Err(EtcdError::Unavailable { .. })));
    let message = store.get(Table::Sandboxes, "sb-1").unwrap_err().to_string();
    assert!(message.contains("unavailable") && message.contains(&endpoint), "unclear message: {message}");
}

#[test]
fn losing_the_only_member_turns_calls_unavailable() {
    let mut cluster = EtcdCluster::start(1);
    let mut config = EtcdConfig::new(cluster.endpoints()).with_prefix("/lost");
    config.request_timeout = Duration::from_secs(1);
    config.retry_budget = Duration::from_secs(1);
    let store = EtcdStore::connect(config).unwrap();
    store.put(Table::Sandboxes, "sb-1", b"running").unwrap();
    let mut watch = store.watch(Table::Sandboxes, "", None).unwrap();
    cluster.kill(0);
    let read = store.get(Table::Sandboxes, "sb-1");
    assert!(matches!(read, Err(StoreError::Unavailable { .. })), "{read:?}");
    let claim = store.put_if_absent(Table::Idempotency, "k", b"sb-2");
    assert!(matches!(claim, Err(StoreError::Unavailable { .. })), "{claim:?}");
    // The watch cannot resume anywhere and says so, after which it ends.
    assert!(matches!(watch.blocking_next(), Some(Err(EtcdError::Unavailable { .. }))));
    assert!(watch.blocking_next().is_none());
}

/// `warren serve` is async: opening, using and dropping the store there
/// must neither panic (nested runtimes) nor deadlock (a blocked worker).
#[test]
fn usable_from_inside_an_async_runtime() {
    let cluster = EtcdCluster::start(1);
    let endpoints = cluster.endpoints();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async move {
        let store = store_on(endpoints, "/async");
        let mut watch = store.watch(Table::Sandboxes, "", None).unwrap();
        store.put(Table::Sandboxes, "sb-1", b"running").unwrap();
        assert_eq!(store.get(Table::Sandboxes, "sb-1").unwrap().as_deref(), Some(&b"running"[..]));
        assert_eq!(watch.next().await.unwrap().unwrap().key(), "sb-1");
        drop(watch);
        drop(store);
    });
}

#[test]
fn invalid_config_is_rejected_up_front() {
    assert!(matches!(EtcdStore::connect(EtcdConfig::new(Vec::<String>::new())), Err(EtcdError::Config(_))));
    assert!(matches!(
        EtcdStore::connect(EtcdConfig::new(["http://127.0.0.1:2379"]).with_prefix("warren")),
        Err(EtcdError::Config(_))
    ));
}

/// Each member's id and the leader's id, by asking each live member.
fn member_ids(cluster: &EtcdCluster) -> (Vec<u64>, u64) {
    let endpoints = cluster.all_endpoints();
    raw(cluster.endpoints(), async |_| {
        let (mut ids, mut leader) = (Vec::new(), 0);
        for endpoint in &endpoints {
            let mut client = etcd_client::Client::connect([endpoint], None).await.unwrap();
            let status = client.status().await.unwrap();
            ids.push(status.header().unwrap().member_id());
            leader = status.leader();
        }
        (ids, leader)
    })
}

/// Index of the member that leads.
fn leader(cluster: &EtcdCluster) -> usize {
    let (ids, leader) = member_ids(cluster);
    ids.iter().position(|id| *id == leader).expect("no member is the leader")
}

/// The member a watch streams from dies: the watch picks up on a survivor
/// from the revision after its last event, so nothing written around the
/// kill is missed or delivered twice.
#[test]
fn watch_resumes_on_a_survivor_when_its_member_dies() {
    let mut cluster = EtcdCluster::start(3);
    let store = store_on(cluster.endpoints(), "/resume");
    let t = Table::Sandboxes;
    let mut watch = store.watch(t, "", None).unwrap();
    store.put(t, "sb-0", b"before").unwrap();
    assert_eq!(watch.blocking_next().unwrap().unwrap().key(), "sb-0");

    let (ids, _) = member_ids(&cluster);
    let serving = ids.iter().position(|id| *id == watch.member_id()).expect("the watch's member is not in the cluster");
    cluster.kill(serving);
    // Written while the watch has no stream; `put` resends by itself.
    for i in 1..=5 {
        store.put(t, &format!("sb-{i}"), b"after").unwrap();
    }
    let keys: Vec<String> = (1..=5).map(|_| watch.blocking_next().unwrap().unwrap().key().to_owned()).collect();
    assert_eq!(keys, ["sb-1", "sb-2", "sb-3", "sb-4", "sb-5"]);
    assert_ne!(watch.member_id(), ids[serving], "the watch still claims the dead member");
    assert!(ids.contains(&watch.member_id()));
}

/// Three members; the leader is SIGKILLed while a store and a watch use the
/// cluster. Once the survivors have elected a new leader, reads, claims and
/// compare-and-swap writes all succeed and the watch carries on from where
/// it was, with nothing missed.
#[test]
fn three_member_cluster_keeps_working_after_a_member_is_killed() {
    let mut cluster = EtcdCluster::start(3);
    let store = store_on(cluster.endpoints(), "/cluster");
    let t = Table::Sandboxes;
    store.put(t, "sb-0", b"running").unwrap();
    let mut watch = store.watch(t, "", None).unwrap();
    store.put(t, "sb-1", b"running").unwrap();
    assert_eq!(watch.blocking_next().unwrap().unwrap().key(), "sb-1");

    let victim = leader(&cluster);
    let pid = cluster.pid(victim).unwrap();
    cluster.kill(victim);
    assert!(cluster.pid(victim).is_none());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "killed member {pid} still running");

    // The first requests may land in the election: they fail Unavailable,
    // never with a wrong answer. Wait for one linearizable read to succeed.
    let mut settled = false;
    for _ in 0..60 {
        match store.check() {
            Ok(()) => {
                settled = true;
                break;
            }
            Err(EtcdError::Unavailable { .. }) => std::thread::sleep(Duration::from_millis(250)),
            Err(other) => panic!("unexpected error during failover: {other}"),
        }
    }
    assert!(settled, "the two survivors never served a quorum read");

    for i in 2..12 {
        let key = format!("sb-{i}");
        assert_eq!(store.get(t, "sb-0").unwrap().as_deref(), Some(&b"running"[..]));
        assert_eq!(store.put_if_absent(Table::Idempotency, &key, key.as_bytes()).unwrap(), None);
        assert_eq!(store.put_if_absent(Table::Idempotency, &key, b"again").unwrap().as_deref(), Some(key.as_bytes()));
        assert!(matches!(store.compare_and_swap(t, &key, Expect::Absent, b"creating").unwrap(), Cas::Done { .. }));
        let current = store.get_versioned(t, &key).unwrap().unwrap();
        let swap = store.compare_and_swap(t, &key, Expect::ModRevision(current.mod_revision), b"running").unwrap();
        assert!(matches!(swap, Cas::Done { .. }));
    }
    assert_eq!(store.list(t, "").unwrap().len(), 12);

    // The watch resumed on a survivor: every change after sb-1, in order.
    let mut events = Vec::new();
    while events.len() < 20 {
        events.push(watch.blocking_next().unwrap().unwrap());
    }
    let expected: Vec<(String, Vec<u8>)> = (2..12)
        .flat_map(|i| [(format!("sb-{i}"), b"creating".to_vec()), (format!("sb-{i}"), b"running".to_vec())])
        .collect();
    let got: Vec<(String, Vec<u8>)> = events
        .into_iter()
        .map(|e| match e {
            WatchEvent::Put { key, value, .. } => (key, value),
            WatchEvent::Delete { key, .. } => panic!("unexpected delete of {key}"),
        })
        .collect();
    assert_eq!(got, expected);
}

#[test]
fn a_leased_key_lives_while_kept_alive_and_vanishes_with_its_lease() {
    let cluster = EtcdCluster::start(1);
    let store = store_on(cluster.endpoints(), "/lease");
    let short = store.grant_lease(2).expect("grant");
    store.put_with_lease(Table::Nodes, "n1", b"alive", short).expect("put");
    // Kept alive past twice its TTL, the key stays.
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(500));
        assert!(store.keep_alive(short).expect("keep alive"), "the lease is live");
    }
    assert_eq!(store.get(Table::Nodes, "n1").unwrap().as_deref(), Some(&b"alive"[..]));
    // Left alone, it expires and takes the key with it (etcd checks
    // expiry every 500 ms, so give it a few TTLs).
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while store.get(Table::Nodes, "n1").unwrap().is_some() {
        assert!(std::time::Instant::now() < deadline, "the key outlived its lease");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(!store.keep_alive(short).expect("keep alive"), "an expired lease cannot be renewed");
    // Revoking ends a lease at once.
    let long = store.grant_lease(600).expect("grant");
    store.put_with_lease(Table::Nodes, "n2", b"alive", long).expect("put");
    store.revoke_lease(long).expect("revoke");
    assert_eq!(store.get(Table::Nodes, "n2").unwrap(), None);
}

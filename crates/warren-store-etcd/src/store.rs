use std::future::Future;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, KeyValue, KvClient, LeaseClient, PutOptions,
    SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use tokio::runtime::Runtime;
use warren_store::{StateStore, Table};

use crate::error::{self, EtcdError};
use crate::keys::Keys;
use crate::watch::{self, Watch};

/// How to reach etcd and where this store's keys live.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs of the members (`http://10.0.0.1:2379`); requests are
    /// balanced over all of them.
    pub endpoints: Vec<String>,
    /// Every key of this store lives under `<prefix>/<table>/`; two Warren
    /// clusters (or a test per prefix) can share one etcd.
    pub prefix: String,
    /// How long one member may take to accept a connection.
    pub connect_timeout: Duration,
    /// How long one attempt at a request may take. Shorter than etcd's own
    /// proposal timeout (5 s and more), so that a write stuck on a follower
    /// while the leader is gone is sent again once a new one is elected.
    pub request_timeout: Duration,
    /// How long a call that is safe to send again (reads, plain puts, and
    /// anything that could not connect) keeps trying before it reports
    /// `Unavailable`. A call blocks at most about this plus one
    /// `request_timeout` when the cluster has lost quorum.
    pub retry_budget: Duration,
}

impl EtcdConfig {
    pub const DEFAULT_PREFIX: &'static str = "/warren";

    pub fn new(endpoints: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(3),
            retry_budget: Duration::from_secs(8),
        }
    }

    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }
}

/// A value with the etcd revision that last wrote it: the token a
/// compare-and-swap presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// What a compare-and-swap expects to find.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// The key does not exist.
    Absent,
    /// The key was last written at this revision (from [`Versioned`]).
    ModRevision(i64),
}

/// The result of a compare-and-swap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cas {
    /// The expectation held and the write was applied at `revision`.
    Done { revision: i64 },
    /// Someone else wrote first; this is what is there now.
    Conflict { current: Option<Versioned> },
}

/// What [`EtcdStore::update`]'s closure decides for the current value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    Put(Vec<u8>),
    Delete,
    /// Leave the key as it is (the transition does not apply).
    Keep,
}

/// Keys per page of a `list`: pages are read at one pinned revision, so a
/// long listing is still one consistent snapshot.
const LIST_PAGE: i64 = 256;
/// etcd caps a value at `--max-request-bytes` (1.5 MiB by default), so a page
/// of 256 small records fits well under this.
const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Sends of one request at most (and never past the retry budget): a
/// balanced channel may route a few to a dead member before it notices, and
/// an election after a leader's death takes about a second.
const RETRIES: u32 = 30;
/// Compare-and-swap rounds [`EtcdStore::update`] tries before it reports
/// the key contended.
const UPDATE_ATTEMPTS: u32 = 64;

/// [`StateStore`] on an etcd cluster: the state of a Warren cluster, shared
/// by every API server and node agent.
///
/// Each table is a key range `<prefix>/<table>/`; keys and values are stored
/// as they are. Every single-key write is one etcd request (one raft
/// round); [`StateStore::put_if_absent`] is a transaction comparing the
/// key's create revision with 0, so of two API servers claiming one
/// idempotency key exactly one wins. Read-modify-write (state transitions)
/// goes through [`EtcdStore::update`] or [`EtcdStore::compare_and_swap`],
/// which compare the key's mod revision.
///
/// The trait is synchronous, like the embedded store's: the store owns a
/// small tokio runtime (one worker) that drives the gRPC connections, and
/// each call blocks its thread until etcd answers. Any thread may call it;
/// async code does so from `spawn_blocking`, as with the embedded store.
pub struct EtcdStore {
    client: Client,
    keys: Keys,
    endpoints: String,
    retry_budget: Duration,
    runtime: Option<Runtime>,
}

impl EtcdStore {
    /// Connects lazily: this fails only on a bad configuration; an
    /// unreachable cluster shows as [`EtcdError::Unavailable`] on the first
    /// call (see [`EtcdStore::check`]).
    pub fn connect(config: EtcdConfig) -> Result<Self, EtcdError> {
        if config.endpoints.is_empty() {
            return Err(EtcdError::Config("no etcd endpoints given".into()));
        }
        let keys = Keys::new(&config.prefix)?;
        let endpoints = config.endpoints.join(",");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("warren-etcd")
            .enable_all()
            .build()
            .map_err(|e| EtcdError::Runtime(e.to_string()))?;
        let options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            // Without keep-alives a member that vanished (SIGKILL, a cut
            // network) is only noticed when a request times out.
            .with_keep_alive(Duration::from_secs(2), config.request_timeout)
            .with_keep_alive_while_idle(true);
        let eps = config.endpoints.clone();
        // Spawned and waited for, not `block_on`: the caller may be async
        // code (`warren serve` opening its store), where `block_on` panics.
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        runtime.spawn(async move {
            let _ = tx.send(Client::connect(eps, Some(options)).await);
        });
        let client = rx
            .recv()
            .map_err(|_| EtcdError::Runtime("the etcd store's runtime shut down".into()))?
            .map_err(|e| EtcdError::from_client(e, &endpoints))?;
        Ok(Self { client, keys, endpoints, retry_budget: config.retry_budget, runtime: Some(runtime) })
    }

    /// One round trip to the cluster: fails with `Unavailable` when no
    /// member answers or there is no leader.
    pub fn check(&self) -> Result<(), EtcdError> {
        // A linearizable read goes through the leader, so it proves quorum.
        let key = self.keys.table(Table::Meta);
        self.run(Retry::Unavailable, move |mut kv| {
            let key = key.clone();
            async move { kv.get(key, Some(GetOptions::new().with_count_only())).await.map(|_| ()) }
        })
    }

    /// The key prefix, normalised (no trailing `/`).
    pub fn prefix(&self) -> &str {
        self.keys.prefix()
    }

    pub fn get_versioned(&self, t: Table, key: &str) -> Result<Option<Versioned>, EtcdError> {
        let full = self.keys.key(t, key);
        let mut resp = self.run(Retry::Unavailable, move |mut kv| {
            let full = full.clone();
            async move { kv.get(full, None).await }
        })?;
        Ok(resp.take_kvs().into_iter().next().map(versioned))
    }

    /// Writes `value` only if the key is as `expect` says, in one etcd
    /// transaction.
    pub fn compare_and_swap(&self, t: Table, key: &str, expect: Expect, value: &[u8]) -> Result<Cas, EtcdError> {
        let full = self.keys.key(t, key);
        self.cas(full.clone(), expect, TxnOp::put(full, value.to_vec(), None))
    }

    /// Deletes the key only if it was last written at `mod_revision`.
    pub fn compare_and_delete(&self, t: Table, key: &str, mod_revision: i64) -> Result<Cas, EtcdError> {
        let full = self.keys.key(t, key);
        self.cas(full.clone(), Expect::ModRevision(mod_revision), TxnOp::delete(full, None))
    }

    /// Read-modify-write under compare-and-swap: `decide` sees the current
    /// value (or `None`) and says what to do; if another writer got in
    /// between, it runs again on the new value. Returns what was decided
    /// last (`Keep` writes nothing). `decide` must be pure: it may run more
    /// than once.
    pub fn update(
        &self,
        t: Table,
        key: &str,
        mut decide: impl FnMut(Option<&[u8]>) -> Update,
    ) -> Result<Update, EtcdError> {
        let mut current = self.get_versioned(t, key)?;
        for _ in 0..UPDATE_ATTEMPTS {
            let expect = current.as_ref().map_or(Expect::Absent, |v| Expect::ModRevision(v.mod_revision));
            let decision = decide(current.as_ref().map(|v| v.value.as_slice()));
            let outcome = match &decision {
                Update::Keep => return Ok(decision),
                Update::Put(value) => self.compare_and_swap(t, key, expect, value)?,
                Update::Delete => match expect {
                    // Deleting what is not there needs no write.
                    Expect::Absent => return Ok(decision),
                    Expect::ModRevision(rev) => self.compare_and_delete(t, key, rev)?,
                },
            };
            match outcome {
                Cas::Done { .. } => return Ok(decision),
                Cas::Conflict { current: now } => current = now,
            }
        }
        Err(EtcdError::Contended { key: format!("{t}/{key}"), attempts: UPDATE_ATTEMPTS })
    }

    /// Every entry under `prefix` with its revision, and the store revision
    /// the listing was read at: [`EtcdStore::watch`] from `revision + 1`
    /// then sees every change after the listing, none twice.
    pub fn list_versioned(&self, t: Table, prefix: &str) -> Result<(Vec<(String, Versioned)>, i64), EtcdError> {
        let (start, end) = self.keys.range(t, prefix);
        let (kvs, revision) = self.run(Retry::Unavailable, move |kv| list_pages(kv, start.clone(), end.clone()))?;
        let entries = kvs
            .into_iter()
            .map(|kv| {
                let key = self.keys.strip(t, kv.key())?;
                Ok((key, versioned(kv)))
            })
            .collect::<Result<Vec<_>, EtcdError>>()?;
        Ok((entries, revision))
    }

    /// Changes to keys under `prefix` in table `t`, from `from_revision`
    /// (inclusive; `None` means changes after this call). Returns once etcd
    /// has registered the watch. The watch resumes by itself when the member
    /// it streams from goes away, from the revision after the last event it
    /// delivered.
    pub fn watch(&self, t: Table, prefix: &str, from_revision: Option<i64>) -> Result<Watch, EtcdError> {
        let runtime = self.runtime()?;
        let (start, end) = self.keys.range(t, prefix);
        // "After this call" is pinned by a linearizable read: a watch without
        // a start revision starts at the revision its member has applied, and
        // a follower behind the leader would replay writes this client has
        // already seen acknowledged (seen in CI: a put made just before the
        // watch came out as its first event).
        let from_revision = match from_revision {
            Some(rev) => rev,
            None => {
                let (key, range_end) = (start.clone(), end.clone());
                let resp = self.run(Retry::Unavailable, move |mut kv| {
                    let (key, range_end) = (key.clone(), range_end.clone());
                    async move { kv.get(key, Some(GetOptions::new().with_range(range_end).with_count_only())).await }
                })?;
                resp.header().map_or(0, |h| h.revision()) + 1
            }
        };
        let spec = watch::Spec {
            client: self.client.watch_client(),
            start,
            end,
            strip: self.keys.table(t),
            endpoints: self.endpoints.clone(),
        };
        let handle = runtime.handle().clone();
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        runtime.spawn(async move {
            let _ = tx.send(watch::start(spec, Some(from_revision), handle).await);
        });
        rx.recv().map_err(|_| EtcdError::Runtime("the etcd store's runtime shut down".into()))?
    }

    /// A new lease that expires `ttl_secs` after its last keep-alive; keys
    /// written with it ([`EtcdStore::put_with_lease`]) vanish when it does.
    /// Returns the lease id.
    pub fn grant_lease(&self, ttl_secs: i64) -> Result<i64, EtcdError> {
        let resp = self.run_on(self.client.lease_client(), Retry::Unsent, move |mut lease| async move {
            lease.grant(ttl_secs, None).await
        })?;
        Ok(resp.id())
    }

    /// Renews `lease` once. `false`: the lease has expired (or was revoked),
    /// and its keys are gone.
    pub fn keep_alive(&self, lease: i64) -> Result<bool, EtcdError> {
        self.run_on(self.client.lease_client(), Retry::Unavailable, move |mut client: LeaseClient| async move {
            let (mut keeper, mut answers) = match client.keep_alive(lease).await {
                // What the client says when the first answer has TTL 0.
                Err(etcd_client::Error::LeaseKeepAliveError(e)) if e == "lease not found" => return Ok(false),
                other => other?,
            };
            keeper.keep_alive().await?;
            Ok(answers.message().await?.is_some_and(|answer| answer.ttl() > 0))
        })
    }

    /// Ends `lease` now: its keys vanish at once (a node that stops in
    /// order does not wait for its TTL to run out).
    pub fn revoke_lease(&self, lease: i64) -> Result<(), EtcdError> {
        self.run_on(self.client.lease_client(), Retry::Unavailable, move |mut client| async move {
            client.revoke(lease).await.map(|_| ())
        })
    }

    /// Writes `value` attached to `lease`.
    pub fn put_with_lease(&self, t: Table, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let (full, value) = (self.keys.key(t, key), value.to_vec());
        self.run(Retry::Unavailable, move |mut kv| {
            let (full, value) = (full.clone(), value.clone());
            async move { kv.put(full, value, Some(PutOptions::new().with_lease(lease))).await.map(|_| ()) }
        })
    }

    fn kv(&self) -> KvClient {
        self.client.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES)
    }

    fn runtime(&self) -> Result<&Runtime, EtcdError> {
        self.runtime.as_ref().ok_or_else(|| EtcdError::Runtime("the etcd store is shut down".into()))
    }

    fn cas(&self, full: Vec<u8>, expect: Expect, op: TxnOp) -> Result<Cas, EtcdError> {
        let compare = match expect {
            Expect::Absent => Compare::create_revision(full.clone(), CompareOp::Equal, 0),
            Expect::ModRevision(rev) => Compare::mod_revision(full.clone(), CompareOp::Equal, rev),
        };
        let txn = Txn::new().when([compare]).and_then([op]).or_else([TxnOp::get(full, None)]);
        let mut resp = self.run(Retry::Unsent, move |mut kv| {
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })?;
        let revision = resp.take_header().map_or(0, |h| h.revision());
        if resp.succeeded() {
            return Ok(Cas::Done { revision });
        }
        let current = first_get(resp.op_responses())?.map(versioned);
        Ok(Cas::Conflict { current })
    }

    /// Runs one request on the store's runtime and waits for it on this
    /// thread, sending it again (within the retry budget) when `retry`
    /// allows. The future is spawned, not `block_on`ed, so a caller that
    /// happens to be inside another runtime waits instead of panicking.
    fn run<T, F, Fut>(&self, retry: Retry, request: F) -> Result<T, EtcdError>
    where
        T: Send + 'static,
        F: Fn(KvClient) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send,
    {
        self.run_on(self.kv(), retry, request)
    }

    /// [`EtcdStore::run`] on any of the client's service clients.
    fn run_on<C, T, F, Fut>(&self, kv: C, retry: Retry, request: F) -> Result<T, EtcdError>
    where
        C: Clone + Send + 'static,
        T: Send + 'static,
        F: Fn(C) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, etcd_client::Error>> + Send,
    {
        let runtime = self.runtime()?;
        let budget = self.retry_budget;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        runtime.spawn(async move {
            let started = Instant::now();
            let mut attempt = 0;
            let result = loop {
                let result = request(kv.clone()).await;
                match &result {
                    Err(e) if attempt < RETRIES && started.elapsed() < budget && retry.allows(e) => {
                        attempt += 1;
                        tracing::debug!(error = %e, attempt, "etcd request failed; sending it again");
                        tokio::time::sleep(Duration::from_millis(50) * attempt.min(5)).await;
                    }
                    _ => break result,
                }
            };
            let _ = tx.send(result);
        });
        let result = rx.recv().map_err(|_| EtcdError::Runtime("the etcd store's runtime shut down".into()))?;
        result.map_err(|e| EtcdError::from_client(e, &self.endpoints))
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks until its tasks stop, which panics when
        // the store is dropped inside async code; nothing here needs to
        // finish (watches end, connections close), so let it go.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("endpoints", &self.endpoints).field("prefix", &self.keys.prefix()).finish()
    }
}

impl StateStore for EtcdStore {
    fn get(&self, t: Table, key: &str) -> warren_store::Result<Option<Vec<u8>>> {
        Ok(self.get_versioned(t, key)?.map(|v| v.value))
    }

    fn put(&self, t: Table, key: &str, value: &[u8]) -> warren_store::Result<()> {
        let (full, value) = (self.keys.key(t, key), value.to_vec());
        // Writing the same value twice leaves the same state: safe to resend.
        self.run(Retry::Unavailable, move |mut kv| {
            let (full, value) = (full.clone(), value.clone());
            async move { kv.put(full, value, None).await }
        })?;
        Ok(())
    }

    fn put_if_absent(&self, t: Table, key: &str, value: &[u8]) -> warren_store::Result<Option<Vec<u8>>> {
        match self.compare_and_swap(t, key, Expect::Absent, value)? {
            Cas::Done { .. } => Ok(None),
            Cas::Conflict { current: Some(existing) } => Ok(Some(existing.value)),
            // The comparison failed, so the key existed when the
            // transaction ran, and its `or_else` read is in the same
            // revision: an empty read cannot happen.
            Cas::Conflict { current: None } => {
                Err(EtcdError::Backend(format!("put_if_absent on {t}/{key}: key exists but read back empty")).into())
            }
        }
    }

    fn delete(&self, t: Table, key: &str) -> warren_store::Result<bool> {
        let full = self.keys.key(t, key);
        // Not resent after an ambiguous failure: a second delete would
        // report the key absent although this call removed it.
        let resp = self.run(Retry::Unsent, move |mut kv| {
            let full = full.clone();
            async move { kv.delete(full, None).await }
        })?;
        Ok(resp.deleted() > 0)
    }

    fn list(&self, t: Table, prefix: &str) -> warren_store::Result<Vec<(String, Vec<u8>)>> {
        let (entries, _) = self.list_versioned(t, prefix)?;
        Ok(entries.into_iter().map(|(k, v)| (k, v.value)).collect())
    }

    fn last(&self, t: Table, prefix: &str) -> warren_store::Result<Option<(String, Vec<u8>)>> {
        let (start, end) = self.keys.range(t, prefix);
        let options = GetOptions::new().with_range(end).with_sort(SortTarget::Key, SortOrder::Descend).with_limit(1);
        let mut resp = self.run(Retry::Unavailable, move |mut kv| {
            let (start, options) = (start.clone(), options.clone());
            async move { kv.get(start, Some(options)).await }
        })?;
        let Some(kv) = resp.take_kvs().into_iter().next() else { return Ok(None) };
        let key = self.keys.strip(t, kv.key())?;
        Ok(Some((key, kv.into_key_value().1)))
    }

    fn delete_prefix(&self, t: Table, prefix: &str) -> warren_store::Result<u64> {
        let (start, end) = self.keys.range(t, prefix);
        // One DeleteRange is one etcd revision: all or nothing.
        let resp = self.run(Retry::Unsent, move |mut kv| {
            let (start, end) = (start.clone(), end.clone());
            async move { kv.delete(start, Some(DeleteOptions::new().with_range(end))).await }
        })?;
        Ok(u64::try_from(resp.deleted()).unwrap_or(0))
    }
}

/// Reads `[start, end)` page by page, every page at the revision of the
/// first, so the result is one snapshot.
async fn list_pages(
    mut kv: KvClient,
    start: Vec<u8>,
    end: Vec<u8>,
) -> Result<(Vec<KeyValue>, i64), etcd_client::Error> {
    let mut out = Vec::new();
    let mut from = start;
    let mut revision = 0;
    loop {
        let mut options = GetOptions::new().with_range(end.clone()).with_limit(LIST_PAGE);
        if revision > 0 {
            options = options.with_revision(revision);
        }
        let mut resp = kv.get(from.clone(), Some(options)).await?;
        if revision == 0 {
            revision = resp.header().map_or(0, |h| h.revision());
        }
        let more = resp.more();
        let kvs = resp.take_kvs();
        let Some(last) = kvs.last() else { break };
        // The next page starts just after the last key read.
        from = last.key().to_vec();
        from.push(0);
        out.extend(kvs);
        if !more {
            break;
        }
    }
    Ok((out, revision))
}

/// When a failed request may be sent again.
#[derive(Debug, Clone, Copy)]
enum Retry {
    /// Reads and plain overwrites: after any unavailability, since sending
    /// them twice changes nothing.
    Unavailable,
    /// Claims, compare-and-swaps, deletes: only when the request provably
    /// never reached etcd, since a second send of one that was applied would
    /// report "someone else won" for our own write.
    Unsent,
}

impl Retry {
    fn allows(self, e: &etcd_client::Error) -> bool {
        match self {
            Retry::Unavailable => error::unavailable(e),
            Retry::Unsent => error::never_sent(e),
        }
    }
}

fn first_get(responses: Vec<TxnOpResponse>) -> Result<Option<KeyValue>, EtcdError> {
    for response in responses {
        if let TxnOpResponse::Get(mut get) = response {
            return Ok(get.take_kvs().into_iter().next());
        }
    }
    Err(EtcdError::Backend("transaction answered without its read".into()))
}

fn versioned(kv: KeyValue) -> Versioned {
    let mod_revision = kv.mod_revision();
    Versioned { value: kv.into_key_value().1, mod_revision }
}

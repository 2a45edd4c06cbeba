//! What etcd costs a create, measured from the outside: the latency of one
//! write through the same client the API servers use (`EtcdStore::put`, a
//! raft round committed to a quorum's disks), and etcd revisions counted
//! around a burst of creates (every write request is one revision; the
//! nodes' heartbeat writes, measured while idle, are subtracted).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use warren_store::{StateStore, Table};
use warren_store_etcd::{EtcdConfig, EtcdStore};

use crate::measure::{self, Latencies, Target};
use crate::Res;

pub struct Etcd {
    store: Arc<EtcdStore>,
}

/// Revisions per operation of one burst.
#[derive(Debug, Clone)]
pub struct Writes {
    pub what: &'static str,
    pub ops: usize,
    /// Revisions the burst advanced etcd by, in all.
    pub revisions: i64,
    /// Heartbeat writes expected over the burst's duration.
    pub heartbeats: f64,
}

impl Writes {
    pub fn per_op(&self) -> f64 {
        (self.revisions as f64 - self.heartbeats) / self.ops.max(1) as f64
    }
}

impl Etcd {
    /// Connects (blocking: the store has its own runtime) under `prefix`.
    pub async fn connect(endpoints: Vec<String>, prefix: String) -> Res<Etcd> {
        let store = tokio::task::spawn_blocking(move || {
            let store = EtcdStore::connect(EtcdConfig::new(endpoints).with_prefix(prefix))?;
            store.check()?;
            Ok::<_, warren_store_etcd::EtcdError>(store)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("etcd: {e}"))?;
        Ok(Etcd { store: Arc::new(store) })
    }

    /// etcd's current revision (the header of an empty range read).
    pub async fn revision(&self) -> Res<i64> {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || store.list_versioned(Table::Meta, "wbc-none/").map(|(_, rev)| rev))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("etcd revision: {e}"))
    }

    /// `samples` sequential 1 KiB puts (the size of a placement record)
    /// after 5 warm-up puts; the key is deleted afterwards.
    pub async fn put_latency(&self, samples: usize) -> Res<Latencies> {
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || {
            let value = vec![b'x'; 1024];
            let mut out = Vec::with_capacity(samples);
            for i in 0..samples + 5 {
                let t = Instant::now();
                store.put(Table::Meta, "wbc-put", &value).map_err(|e| format!("etcd put: {e}"))?;
                if i >= 5 {
                    out.push(t.elapsed());
                }
            }
            store.delete(Table::Meta, "wbc-put").map_err(|e| format!("etcd delete: {e}"))?;
            Ok(Latencies(out))
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Heartbeat writes per second while nothing else happens, over `secs`.
    pub async fn idle_rate(&self, secs: u64) -> Res<f64> {
        let r0 = self.revision().await?;
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(secs)).await;
        let r1 = self.revision().await?;
        Ok((r1 - r0) as f64 / t.elapsed().as_secs_f64())
    }

    /// Revisions of `ops` sequential creates through `api` (its URLs in
    /// turn), then of their deletes; with `key_prefix`, every create
    /// carries an idempotency key.
    pub async fn writes_per_cycle(
        &self,
        api: &Target,
        ops: usize,
        idle_per_sec: f64,
        key_prefix: Option<&str>,
    ) -> Res<(Writes, Writes)> {
        let mut made = Vec::with_capacity(ops);
        let r0 = self.revision().await?;
        let t = Instant::now();
        for i in 0..ops {
            let mut body = measure::sandbox_body();
            if let Some(p) = key_prefix {
                body["idempotency_key"] = Value::from(format!("{p}-{i}"));
            }
            let base = &api.urls[i % api.urls.len()];
            made.push((base.clone(), measure::create(&api.http, base, &body).await?));
        }
        let r1 = self.revision().await?;
        let create_secs = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for (base, id) in &made {
            measure::delete(&api.http, base, id).await?;
        }
        let r2 = self.revision().await?;
        let delete_secs = t.elapsed().as_secs_f64();
        let (what_c, what_d) = match key_prefix {
            Some(_) => ("create with an idempotency key", "delete (of a keyed create)"),
            None => ("create without an idempotency key", "delete"),
        };
        Ok((
            Writes { what: what_c, ops, revisions: r1 - r0, heartbeats: idle_per_sec * create_secs },
            Writes { what: what_d, ops, revisions: r2 - r1, heartbeats: idle_per_sec * delete_secs },
        ))
    }
}

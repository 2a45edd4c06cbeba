//! Measures durable `put`s per second for 1 KiB values, next to the rate of
//! bare `write + fdatasync` on the same filesystem (the floor a durable store
//! cannot beat).
//!
//! Usage: cargo run --release -p warren-store --example put_rate [DIR] [COUNT]
//! DIR defaults to a temporary directory under /var/tmp (disk, not tmpfs).

use std::io::Write;
use std::time::Instant;

use warren_store::{RedbStore, StateStore, Table};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let tmp = tempfile::tempdir_in(args.next().unwrap_or_else(|| "/var/tmp".into()))?;
    let count: usize = args.next().map(|c| c.parse()).transpose()?.unwrap_or(2000);
    let value = vec![0x5au8; 1024];

    let store = RedbStore::open(tmp.path().join("rate.redb"))?;
    let start = Instant::now();
    for i in 0..count {
        store.put(Table::Sandboxes, &format!("sb-{i:08}"), &value)?;
    }
    let store_rate = count as f64 / start.elapsed().as_secs_f64();

    let mut file = std::fs::File::create(tmp.path().join("sync-floor"))?;
    let start = Instant::now();
    for _ in 0..count {
        file.write_all(&value)?;
        file.sync_data()?;
    }
    let sync_rate = count as f64 / start.elapsed().as_secs_f64();

    println!("{count} puts of 1 KiB: {store_rate:.0} puts/s (redb, Durability::Immediate)");
    println!("{count} writes of 1 KiB + fdatasync: {sync_rate:.0} /s (floor)");
    Ok(())
}

//! Resident memory per tracked key: creates distinct keys through the shard set (each a cold
//! key, created by its shard actor) and, at 1,000,000 keys and at each further checkpoint,
//! divides the growth of the process's resident set by the number of keys. Run:
//! `cargo bench --bench memory_per_key`, or `MEMORY_BENCH_KEYS=10000000 cargo bench --bench
//! memory_per_key` to go on to 10,000,000 keys (about 3 GB, a few minutes).
//!
//! The figure moves a little with the hash tables' fill: a stripe's keys sit side by side in
//! a vector, found through a table of 5 bytes a bucket that doubles when seven eighths full,
//! so a key count just past a doubling costs the most per key. 1,000,000 keys over this
//! bench's two shards of 64 stripes is such a count (7,813 keys a stripe, in tables of
//! 16,384 buckets: 10.5 bytes a key); 10,000,000 fill theirs to 60 %.
//!
//! The keys fall under a limit of 0, which every decision refuses without a lease, so the
//! ledger (in this process) stays empty and only the shards' slots are measured; a slot's
//! size does not depend on the lease it holds.

use std::time::Duration;

use quotamesh::core::lease::LeaseTuning;
use quotamesh::core::policy::FailureMode;
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::metrics::Metrics;

mod support;

/// The first checkpoint; `MEMORY_BENCH_KEYS` sets the last (each ten times the one before).
const KEYS_FIRST_CHECKPOINT: usize = 1_000_000;

/// Resident set size of this process, from /proc (Linux).
fn resident_bytes() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .ok_or_else(|| anyhow::anyhow!("no VmRSS"))?;
    let kib: u64 =
        line.split_whitespace().nth(1).ok_or_else(|| anyhow::anyhow!("bad VmRSS"))?.parse()?;
    Ok(kib * 1024)
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let keys_max: usize = match std::env::var("MEMORY_BENCH_KEYS") {
            Ok(keys) => keys.parse()?,
            Err(_) => KEYS_FIRST_CHECKPOINT,
        };
        let metrics = Metrics::new();
        let ledger = support::ledger(true).await?;
        // No sweep during the measurement: every key stays tracked.
        let shards = support::shard_set(
            &ledger,
            support::Setup {
                keys_per_shard_max: keys_max,
                sweep_interval: Duration::from_secs(3600),
                ..support::Setup::default()
            },
            support::no_policy(),
            &metrics,
        )
        .await?;
        let spec = LimitSpec::new(Algorithm::TokenBucket, 0, 1000, None)?;
        let lease = LeaseTuning::default();
        let now_ms = quotamesh::clock::now_ms();
        let before = resident_bytes()?;
        println!("resident before         {:.1} MiB", before as f64 / 1048576.0);
        let mut checkpoint = KEYS_FIRST_CHECKPOINT.min(keys_max);
        for index in 0..keys_max {
            let value = index.to_string();
            let probe = support::probe(
                &shards,
                "bench",
                ("api_key", value.as_str()),
                &spec,
                &lease,
                FailureMode::Open,
                1,
            );
            shards.decide(&probe, now_ms).await?;
            if index + 1 == checkpoint {
                let after = resident_bytes()?;
                let tracked = shards.key_count();
                anyhow::ensure!(tracked == checkpoint, "{checkpoint} keys, tracking {tracked}");
                let per_key = (after.saturating_sub(before)) as f64 / checkpoint as f64;
                println!("keys tracked            {tracked}");
                println!("resident after          {:.1} MiB", after as f64 / 1048576.0);
                println!("resident bytes per key  {per_key:.1}");
                checkpoint = checkpoint.saturating_mul(10).min(keys_max);
            }
        }
        shards.shutdown().await;
        anyhow::Ok(())
    })
}

//! Life cycle of a 3-process region: every node stopped and restarted from its data
//! directory, and a follower that was down while the leader compacted its log.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use common::cluster::{Cluster, ClusterOptions, call, ledger_key, wanted};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;

/// Grants `count` single-key commands through node `via`, on keys `<prefix>-<n>`.
async fn grant_each(cluster: &Cluster, via: u64, prefix: &str, count: usize) -> Result<()> {
    let mut client = cluster.admin(via).await?;
    for n in 0..count {
        let request = admin::AcquireLeasesRequest {
            leases: vec![wanted("api_key", &format!("{prefix}-{n}"), 2)],
            lease_ttl_ms: 60_000,
        };
        client.acquire_leases(call(request)).await?;
    }
    Ok(())
}

// Proves that the ledger is recovered from disk when all three nodes stop, first cleanly
// (SIGTERM) and then by kill -9: the digests and the applied state are the same before and
// after, and the region takes grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_three_restart_with_the_state_they_had() -> Result<()> {
    let mut cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    grant_each(&cluster, leader, "t20-a", 10).await?;
    let before = cluster.converged(&[1, 2, 3]).await?;

    for id in [1, 2, 3] {
        cluster.node(id).stop()?;
    }
    for id in [1, 2, 3] {
        cluster.node(id).start()?;
    }
    cluster.leader().await?;
    let after = cluster.converged_past(&[1, 2, 3], before[0].applied_index).await?;
    assert_eq!(after[0].state_digest, before[0].state_digest, "same ledger after a clean restart");
    assert_eq!(after[0].ledger_keys, 10);
    assert!(after[0].applied_index >= before[0].applied_index);

    // Again, without any chance to flush: kill -9 all three.
    let leader = cluster.leader().await?;
    grant_each(&cluster, leader, "t20-b", 10).await?;
    let before = cluster.converged(&[1, 2, 3]).await?;
    for id in [1, 2, 3] {
        cluster.node(id).kill()?;
    }
    for id in [1, 2, 3] {
        cluster.node(id).start()?;
    }
    let leader = cluster.leader().await?;
    let after = cluster.converged_past(&[1, 2, 3], before[0].applied_index).await?;
    assert_eq!(after[0].state_digest, before[0].state_digest, "same ledger after kill -9");
    assert_eq!(after[0].ledger_keys, 20);

    // Every lease is still accounted, and the region keeps granting.
    let keys = vec![ledger_key("api_key", "t20-a-0"), ledger_key("api_key", "t20-b-9")];
    let read = cluster
        .admin(leader)
        .await?
        .read_keys(call(admin::ReadKeysRequest { keys, ..Default::default() }))
        .await?;
    for entry in read.into_inner().entries {
        assert_eq!(entry.leases.iter().map(|lease| lease.tokens).sum::<u64>(), 2, "{entry:?}");
    }
    grant_each(&cluster, leader, "t20-c", 1).await?;
    cluster.converged(&[1, 2, 3]).await?;
    Ok(())
}

// Proves that a follower that was down while the leader snapshotted and purged its log
// (snapshot every 5 entries, through the node config) catches up by installing a snapshot and
// ends with the same ledger as the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_behind_a_purged_log_catches_up_from_a_snapshot() -> Result<()> {
    let options = ClusterOptions {
        snapshot_every_logs: Some(5),
        logs_kept_after_snapshot: Some(2),
        ..ClusterOptions::default()
    };
    let mut cluster = Cluster::start(3, options).await?;
    let leader = cluster.leader().await?;
    let down = [1, 2, 3].into_iter().find(|id| *id != leader).expect("a follower");
    cluster.node(down).stop()?;
    let behind_at = cluster.status(leader).await?.last_log_index.unwrap_or(0);

    grant_each(&cluster, leader, "t20-snap", 30).await?;
    // Purging follows the snapshot asynchronously: wait until the entries the stopped node
    // needs are gone from the leader's log.
    let deadline = Instant::now() + Duration::from_secs(30);
    let purged = loop {
        let status = cluster.status(leader).await?;
        if let Some(purged) = status.purged_index
            && purged > behind_at + 10
        {
            break purged;
        }
        if Instant::now() > deadline {
            bail!("the leader did not purge its log: {status:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    cluster.node(down).start()?;
    let statuses = cluster.converged(&[1, 2, 3]).await?;
    let caught_up = statuses.iter().find(|status| status.node_id == down).expect("its status");
    assert!(
        caught_up.snapshot_index.is_some_and(|index| index >= purged),
        "node {down} holds a snapshot at or past the leader's purge point {purged}: {caught_up:?}"
    );
    assert_eq!(caught_up.ledger_keys, 30);
    Ok(())
}

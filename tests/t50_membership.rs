//! Fault: membership changes under load. Grants stream in while the region grows from three
//! voters to five and shrinks back to three, removing two of the original nodes (the leader
//! among them when it is one of the two), all through `quotamesh cluster add-node` and
//! `remove-node`.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use common::cluster::{Cluster, ClusterOptions, Outcome, check_grants, stream_grants};

/// Runs a `quotamesh cluster` membership command until it succeeds: right after a leader is
/// removed no node leads for a moment. `done` recognises a refusal meaning that an earlier
/// attempt, whose answer was lost, already made the change.
async fn until_done(cluster: &Cluster, arguments: &[&str], done: &str) -> Result<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match cluster.cli(arguments) {
            Ok(output) => return Ok(output),
            Err(error) if error.to_string().contains(done) => return Ok(String::new()),
            Err(error) if Instant::now() > deadline => return Err(error),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Waits until node `id` sees exactly `voters` as voters.
async fn voters_are(cluster: &Cluster, id: u64, voters: &[u64]) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = cluster.voters(id).await.unwrap_or_default();
        if seen == voters {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("node {id} sees voters {seen:?}, expected {voters:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Proves that the membership can go 3 -> 5 -> 3 while grants flow: the new nodes catch up
// and vote, the removed ones (the leader possibly among them) leave, grants keep committing,
// and the final three nodes hold every acknowledged grant exactly once and agree on the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_goes_three_five_three_while_grants_flow() -> Result<()> {
    let mut cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Node 3 stays a voter throughout; grants go through it.
    let stream = tokio::spawn(stream_grants(
        3,
        cluster.nodes[&3].admin_addr,
        "t50-members".to_owned(),
        2,
        stopped,
    ));

    let changes_started = Instant::now();
    for id in [4, 5] {
        let raft_addr = cluster.start_newcomer(id)?.raft_addr.to_string();
        let voters = cluster.admin_addrs(&[1, 2, 3]);
        let id_text = id.to_string();
        until_done(
            &cluster,
            &[
                "cluster",
                "add-node",
                "--admin-addr",
                &voters,
                "--node-id",
                &id_text,
                "--raft-addr",
                &raft_addr,
            ],
            "a voter already",
        )
        .await?;
        eprintln!("added {id} at {:?}", changes_started.elapsed());
    }
    for id in [1, 2, 3, 4, 5] {
        voters_are(&cluster, id, &[1, 2, 3, 4, 5]).await?;
    }
    let grown = cluster.converged(&[1, 2, 3, 4, 5]).await?;
    assert!(grown[0].ledger_keys > 0, "grants flowed while the region grew");

    for id in [1, 2] {
        let voters = cluster.admin_addrs(&[1, 2, 3, 4, 5]);
        let id_text = id.to_string();
        until_done(
            &cluster,
            &["cluster", "remove-node", "--admin-addr", &voters, "--node-id", &id_text],
            "is not a member",
        )
        .await?;
        eprintln!("removed {id} at {:?}", changes_started.elapsed());
    }
    for id in [3, 4, 5] {
        voters_are(&cluster, id, &[3, 4, 5]).await?;
    }
    let changes_done = Instant::now();
    let leader = cluster.leader_among(&[3, 4, 5]).await?;
    // Grants keep committing on the shrunk region.
    let keys_then = cluster.status(leader).await?.ledger_keys;
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.status(leader).await?.ledger_keys < keys_then + 20 {
        anyhow::ensure!(Instant::now() < deadline, "no grant committed after the shrink");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let _ = stop.send(true);
    let ops = stream.await?;
    cluster.converged(&[3, 4, 5]).await?;
    for id in [3, 4, 5] {
        let (ok, fail, unknown, applied) = check_grants(&cluster, id, &ops).await?;
        eprintln!("node {id}: {ok} ok, {fail} fail, {unknown} unknown ({applied} applied)");
    }
    let during_changes = ops
        .iter()
        .filter(|op| {
            op.outcome == Outcome::Ok
                && op.completed_at > changes_started
                && op.completed_at < changes_done
        })
        .count();
    let slowest = ops
        .windows(2)
        .map(|pair| {
            (pair[1].completed_at - pair[0].completed_at, pair[1].completed_at - changes_started)
        })
        .max()
        .unwrap_or_default();
    eprintln!("slowest grant: {slowest:?}");
    eprintln!(
        "{during_changes} grants acknowledged during {:?} of membership changes",
        changes_done - changes_started
    );
    assert!(during_changes >= 5, "grants were acknowledged while the membership changed");
    Ok(())
}

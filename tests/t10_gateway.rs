//! A gateway (`role = "gateway"`) next to a region of three real `quotamesh serve` processes:
//! it is no member of the quota group, yet its lease grants commit in the voters' ledger,
//! held by it; after kill -9 of the leader its next write finds the new leader by itself.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use common::cluster::{Cluster, ClusterOptions, call, ledger_key, wanted};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;

/// The gateway's raft_node_id (and its address, 127.0.0.4).
const GATEWAY: u64 = 4;
/// Deadline of the first write after the kill: room for an election and a few seed tries.
const FAILOVER_WRITE_TIMEOUT: Duration = Duration::from_secs(15);
/// How soon after the kill that write must have found the new leader ("a few seconds",
/// generous for a shared 2-core machine; elections take 300 to 600 ms of silence).
const FAILOVER_WITHIN: Duration = Duration::from_secs(10);

/// Grants `tokens` on `api_key=<prefix>-<n>` for `count` fresh keys through node `via`;
/// returns the reply.
async fn grant_batch(
    cluster: &Cluster,
    via: u64,
    prefix: &str,
    count: usize,
    tokens: u64,
    timeout: Duration,
) -> Result<admin::AcquireLeasesReply> {
    let leases = (0..count).map(|n| wanted("api_key", &format!("{prefix}-{n}"), tokens)).collect();
    let mut request = call(admin::AcquireLeasesRequest { leases, lease_ttl_ms: 60_000 });
    request.set_timeout(timeout);
    let reply = cluster.admin(via).await?.acquire_leases(request).await?.into_inner();
    anyhow::ensure!(reply.results.len() == count, "one result per key: {reply:?}");
    for result in &reply.results {
        anyhow::ensure!(result.error.is_empty() && result.granted_tokens == tokens, "{result:?}");
    }
    Ok(reply)
}

/// The tokens each node holds, as node `id`'s status counts them.
fn outstanding(status: &admin::StatusReply) -> Vec<(u64, u64)> {
    status.outstanding_tokens.iter().map(|tokens| (tokens.node_id, tokens.tokens)).collect()
}

// Proves that a gateway, configured with the voters as peers and never added to the group,
// gets lease grants through its admin API that commit in the voters' ledger (equal digests,
// the tokens outstanding for the gateway's node id), that it reports its role and is refused
// what needs a member, and that after kill -9 of the leader its next write reaches the new
// leader within a few seconds without any help.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_leases_through_the_voters_and_follows_a_new_leader() -> Result<()> {
    let mut cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;
    cluster.start_gateway(GATEWAY)?;

    // The gateway is no member: it names no leader, has no members, and knows its voters.
    let status = cluster.status(GATEWAY).await?;
    assert_eq!(status.role, "gateway");
    assert_eq!(status.leader_id, None);
    assert!(status.members.is_empty(), "{status:?}");
    let seeds: Vec<u64> = status.seeds.iter().map(|seed| seed.node_id).collect();
    assert_eq!(seeds, vec![1, 2, 3]);
    assert_eq!(cluster.voters(leader).await?, vec![1, 2, 3], "the gateway joined no group");
    assert_eq!(cluster.status(leader).await?.role, "voter");

    // A batch through the gateway commits in the voters' ledger, held by the gateway.
    let before = cluster.status(leader).await?;
    let reply = grant_batch(&cluster, GATEWAY, "gw", 32, 7, Duration::from_secs(5)).await?;
    assert_eq!(reply.leaseholder_node_id, GATEWAY);
    assert_eq!(reply.results[0].key, ledger_key("api_key", "gw-0"));
    let statuses = cluster.converged(&[1, 2, 3]).await?;
    for status in &statuses {
        assert!(status.applied_index > before.applied_index, "the batch was applied");
        assert_eq!(status.ledger_keys, 32);
        assert_eq!(outstanding(status), vec![(GATEWAY, 32 * 7)], "node {}", status.node_id);
    }
    assert_eq!(cluster.status(GATEWAY).await?.cached_leader_id, Some(leader));

    // `cluster status` shows the role of each node.
    let output = cluster.cli(&[
        "cluster",
        "status",
        "--json",
        "--admin-addr",
        &cluster.admin_addrs(&[1, 2, 3, GATEWAY]),
    ])?;
    let shown: serde_json::Value = serde_json::from_str(&output)?;
    let roles: Vec<(u64, String)> = shown["nodes"]
        .as_array()
        .context("nodes")?
        .iter()
        .map(|node| (node["node_id"].as_u64().unwrap_or(0), node["role"].to_string()))
        .collect();
    assert_eq!(
        roles,
        vec![
            (1, "\"voter\"".to_owned()),
            (2, "\"voter\"".to_owned()),
            (3, "\"voter\"".to_owned()),
            (GATEWAY, "\"gateway\"".to_owned())
        ]
    );
    let text =
        cluster.cli(&["cluster", "status", "--admin-addr", &cluster.admin_addrs(&[GATEWAY])])?;
    assert!(text.contains("gateway"), "{text}");

    // What needs a member is refused on the gateway, saying why.
    let mut gateway = cluster.admin(GATEWAY).await?;
    let refused = gateway
        .read_keys(call(admin::ReadKeysRequest {
            keys: vec![ledger_key("api_key", "gw-0")],
            ..Default::default()
        }))
        .await
        .expect_err("a gateway holds no replica");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(refused.message().contains("gateway"), "{}", refused.message());
    let refused = gateway.init(call(admin::InitRequest {})).await.expect_err("no member");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);

    // kill -9 of the leader; the gateway's next write finds the new leader by itself.
    cluster.node(leader).kill()?;
    let killed = Instant::now();
    let reply = grant_batch(&cluster, GATEWAY, "gw-after", 8, 3, FAILOVER_WRITE_TIMEOUT).await?;
    let found_after = killed.elapsed();
    eprintln!("the gateway's first write after the kill committed {found_after:?} after it");
    assert!(found_after < FAILOVER_WITHIN, "took {found_after:?}");
    assert_eq!(reply.leaseholder_node_id, GATEWAY);

    let survivors: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != leader).collect();
    let new_leader = cluster.leader_among(&survivors).await?;
    assert_ne!(new_leader, leader);
    let statuses = cluster.converged(&survivors).await?;
    for status in &statuses {
        assert_eq!(status.ledger_keys, 32 + 8);
        assert_eq!(outstanding(status), vec![(GATEWAY, 32 * 7 + 8 * 3)], "node {}", status.node_id);
    }
    assert_eq!(cluster.status(GATEWAY).await?.cached_leader_id, Some(new_leader));
    Ok(())
}

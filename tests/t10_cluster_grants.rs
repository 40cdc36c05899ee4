//! A region of three real `quotamesh serve` processes on 127.0.0.1-3: leader election, a
//! batch of lease grants committed through a follower, and identical replicas, seen through
//! the admin API and the `quotamesh cluster` CLI (`status`, and `keys` with each bucket's
//! totals).

use anyhow::Result;
use common::cluster::{Cluster, ClusterOptions, call, ledger_key, ledger_key_at, wanted};
use quotamesh::api::proto::quotamesh::admin::v1 as admin;

// Proves that three node processes elect one leader, that a batch of lease grants sent to a
// follower commits, and that every node applies it identically (equal state digests at equal
// applied index, and equal ledger contents).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_elect_a_leader_and_apply_a_batch_identically() -> Result<()> {
    let cluster = Cluster::start(3, ClusterOptions::default()).await?;
    let leader = cluster.leader().await?;

    // `quotamesh cluster status --json` over all three: one leader, three voters each.
    let output = cluster.cli(&[
        "cluster",
        "status",
        "--json",
        "--admin-addr",
        &cluster.admin_addrs(&[1, 2, 3]),
    ])?;
    let status: serde_json::Value = serde_json::from_str(&output)?;
    let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
    assert_eq!(nodes.len(), 3, "{output}");
    for node in &nodes {
        assert_eq!(node["leader_id"].as_u64(), Some(leader), "{node}");
        let voters = node["members"]
            .as_array()
            .map_or(0, |members| members.iter().filter(|member| member["voter"] == true).count());
        assert_eq!(voters, 3, "{node}");
    }
    let leaders = nodes.iter().filter(|node| node["state"] == "Leader").count();
    assert_eq!(leaders, 1, "exactly one node leads: {output}");

    // One batch through a follower: 64 keys of one limit and one rule with two limits.
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).expect("a follower");
    let before = cluster.status(leader).await?;
    let mut leases: Vec<admin::LeaseWanted> =
        (0..64).map(|n| wanted("api_key", &format!("t10-{n}"), 5)).collect();
    leases.push(wanted("two_limits", "t10", 5));
    let reply = cluster
        .admin(follower)
        .await?
        .acquire_leases(call(admin::AcquireLeasesRequest { leases, lease_ttl_ms: 30_000 }))
        .await?
        .into_inner();
    assert_eq!(reply.leaseholder_node_id, follower);
    assert_eq!(reply.results.len(), 66, "one result per limit");
    for result in &reply.results {
        assert_eq!(result.granted_tokens, 5, "{result:?}");
        assert!(result.error.is_empty(), "{result:?}");
    }
    assert_eq!(reply.results[0].key, ledger_key("api_key", "t10-0"));
    assert_eq!(reply.results[65].key, ledger_key_at("two_limits", "t10", 1));

    let statuses = cluster.converged(&[1, 2, 3]).await?;
    for status in &statuses {
        assert!(status.applied_index > before.applied_index, "the batch was applied");
        assert_ne!(status.state_digest, before.state_digest, "the batch changed the ledger");
        assert_eq!(status.ledger_keys, 66);
        let held: Vec<(u64, u64)> = status
            .outstanding_tokens
            .iter()
            .map(|tokens| (tokens.node_id, tokens.tokens))
            .collect();
        assert_eq!(held, vec![(follower, 66 * 5)], "node {} counts the leases", status.node_id);
    }

    // The ledger contents agree key by key, not only by digest.
    let keys: Vec<String> = reply.results.iter().map(|result| result.key.clone()).collect();
    let mut contents = Vec::new();
    for id in [1, 2, 3] {
        let read = cluster
            .admin(id)
            .await?
            .read_keys(call(admin::ReadKeysRequest { keys: keys.clone(), ..Default::default() }))
            .await?
            .into_inner();
        assert!(read.entries.iter().all(|entry| entry.found), "node {id} holds every key");
        contents.push(read.entries);
    }
    assert_eq!(contents[0], contents[1]);
    assert_eq!(contents[1], contents[2]);
    for entry in &contents[0] {
        // Each key's bucket gave its 5 tokens and got none back since it was made.
        let totals = (entry.granted_tokens, entry.charged_tokens, entry.returned_tokens);
        assert_eq!(totals, (5, 0, 0), "{entry:?}");
        assert_eq!(entry.totals_since_ms, entry.last_used_ms, "{entry:?}");
        assert_eq!(entry.algorithm, "token_bucket", "{entry:?}");
    }

    // With no keys named, ReadKeys lists every key in order, a page at a time.
    let mut listed = Vec::new();
    let mut after = String::new();
    loop {
        let page = cluster
            .admin(follower)
            .await?
            .read_keys(call(admin::ReadKeysRequest { keys: vec![], after, max_keys: 10 }))
            .await?
            .into_inner();
        assert!(page.entries.len() <= 10, "{} entries in a page of 10", page.entries.len());
        assert!(page.ledger_time_ms >= contents[0][0].last_used_ms, "ledger time of the state");
        listed.extend(page.entries);
        if page.next_after.is_empty() {
            break;
        }
        after = page.next_after;
    }
    let mut expected = contents[0].clone();
    expected.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(listed, expected, "the pages hold every key once, in order");

    // `quotamesh cluster keys` shows the same keys with their totals.
    let output = cluster.cli(&[
        "cluster",
        "keys",
        "--json",
        "--limit",
        "50",
        "--admin-addr",
        &cluster.admin_addrs(&[follower]),
    ])?;
    let shown: serde_json::Value = serde_json::from_str(&output)?;
    let shown_keys = shown["keys"].as_array().cloned().unwrap_or_default();
    assert_eq!(shown_keys.len(), 50, "{output}");
    for (shown, entry) in shown_keys.iter().zip(&expected) {
        assert_eq!(shown["key"], entry.key.as_str(), "{output}");
        assert_eq!(shown["granted_tokens"], 5, "{output}");
        assert_eq!(shown["leases"][0]["node_id"], follower, "{output}");
    }
    Ok(())
}

//! Partitions of one node by firewall rules that drop its packets (its connections go
//! silent; nothing is refused), on three real node processes: a healed node serves again
//! within 2 s of the heal, whatever the kernel's TCP retransmission timers say, and a second
//! partition 3 s after the first heal takes the quota group down for no longer than an
//! election.
//!
//! The test runs as root: each node runs under its own user id, and an nftables table drops
//! every packet the cut-off node's sockets send (`meta skuid`) and every packet sent to its
//! ports. `PARTITION_ROUNDS` (default 2) and `PARTITION_MS` (default 8000) lengthen the first
//! test; `benches/partition_heal.sh` runs 20 rounds and prints the figures.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use common::cluster::{Cluster, ClusterNode, ClusterOptions, admin_client, wanted};
use common::nft;
use parking_lot::Mutex;
use quotamesh::api::proto::quotamesh::admin::v1 as admin;

/// Node N of the first test runs as this plus N, of the second as this plus 100 plus N:
/// the tests run at once, and a rule on one node's user id must not cut off the other's.
const UID_BASE: u32 = 47_000;
/// The bound of the issue: a healed node serves again within this.
const HEALED_WITHIN: Duration = Duration::from_secs(2);
/// Longest a write may find no commit while one follower is cut off: an election (300 to
/// 600 ms without a leader's heartbeat, then a vote) with room for a loaded machine.
const ELECTION_BOUND: Duration = Duration::from_millis(2_500);
/// Deadline of one write of the probes: short, so a dead link shows as a gap, not a hang.
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|value| value.parse().ok()).unwrap_or(default)
}

/// An nftables table that black-holes one node; deleted on drop.
struct Partition {
    table: String,
}

impl Partition {
    fn cut(node: &ClusterNode) -> anyhow::Result<Self> {
        let uid = node.uid.context("the node runs under its own user id")?;
        let table = format!("quotamesh_test_{}_{uid}", std::process::id());
        let ports = [node.raft_addr, node.admin_addr, node.rls_addr, node.metrics_addr]
            .iter()
            .map(|address| address.port().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let rules = format!(
            "table inet {table} {{\n  chain output {{\n    type filter hook output priority 0; \
             policy accept;\n    meta skuid {uid} drop\n    ip daddr {ip} tcp dport {{ {ports} }} \
             drop\n  }}\n}}\n",
            ip = node.raft_addr.ip(),
        );
        nft(&["-f", "-"], Some(&rules)).context("nft (run as root with nftables installed)")?;
        Ok(Self { table })
    }

    fn heal(self) -> anyhow::Result<()> {
        let table = self.table.clone();
        std::mem::forget(self);
        nft(&["delete", "table", "inet", &table], None)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = nft(&["delete", "table", "inet", &self.table], None);
    }
}

/// One write of a lease through node `address`'s admin API (forwarded to the leader).
async fn write_through(address: std::net::SocketAddr, value: &str) -> bool {
    let attempt = async {
        let mut client = admin_client(address).await?;
        let mut request = tonic::Request::new(admin::AcquireLeasesRequest {
            leases: vec![wanted("api_key", value, 1)],
            lease_ttl_ms: 1_000,
        });
        request.set_timeout(PROBE_TIMEOUT);
        let token = format!("Bearer {}", common::tls::ADMIN_TOKEN);
        request.metadata_mut().insert("authorization", token.parse()?);
        client.acquire_leases(request).await?;
        anyhow::Ok(())
    };
    matches!(tokio::time::timeout(PROBE_TIMEOUT * 3, attempt).await, Ok(Ok(())))
}

/// Node `id`'s applied index, if it answers within the probe timeout.
async fn applied_index(cluster: &Cluster, id: u64) -> Option<u64> {
    let status = tokio::time::timeout(PROBE_TIMEOUT * 3, cluster.status(id)).await.ok()?.ok()?;
    status.applied_index
}

fn partitioned_cluster_options(test: u32) -> ClusterOptions {
    ClusterOptions { uid_base: Some(UID_BASE + 100 * test), ..ClusterOptions::default() }
}

/// Cut off a follower while the leader keeps committing, heal, and time how long until the
/// follower has applied what was committed meanwhile and takes a write of its own again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healed_node_serves_again_within_two_seconds() -> anyhow::Result<()> {
    let rounds = env_number("PARTITION_ROUNDS", 2);
    let partition = Duration::from_millis(env_number("PARTITION_MS", 8_000));
    let cluster = Cluster::start(3, partitioned_cluster_options(0)).await?;
    let leader = cluster.leader().await?;
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).context("a follower")?;
    let mut healed_after = Vec::new();
    for round in 0..rounds {
        let cut = Partition::cut(&cluster.nodes[&follower])?;
        let until = Instant::now() + partition;
        let mut writes = 0u64;
        while Instant::now() < until {
            // The leader may change if the cut-off node's term disrupts it on a heal.
            for id in [1, 2, 3].into_iter().filter(|id| *id != follower) {
                if write_through(cluster.nodes[&id].admin_addr, &format!("heal-{round}")).await {
                    writes += 1;
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::ensure!(writes > 0, "round {round}: the majority committed nothing");
        let mut committed = 0;
        for id in [1, 2, 3].into_iter().filter(|id| *id != follower) {
            committed = committed.max(applied_index(&cluster, id).await.unwrap_or(0));
        }
        cut.heal()?;
        let healed = Instant::now();
        let deadline = healed + Duration::from_secs(30);
        let (mut caught_up, mut wrote) = (false, false);
        while !(caught_up && wrote) {
            anyhow::ensure!(
                Instant::now() < deadline,
                "round {round}: node {follower} never came back"
            );
            if !caught_up {
                caught_up = applied_index(&cluster, follower).await.unwrap_or(0) >= committed;
            }
            if !wrote {
                let address = cluster.nodes[&follower].admin_addr;
                wrote = write_through(address, &format!("back-{round}")).await;
            }
            if !(caught_up && wrote) {
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }
        let took = healed.elapsed();
        eprintln!("round {round}: node {follower} back {} ms after the heal", took.as_millis());
        healed_after.push(took);
    }
    let worst = healed_after.iter().max().copied().unwrap_or_default();
    eprintln!(
        "healed node back after (ms): {:?}; worst {} ms over {rounds} partitions of {} ms",
        healed_after.iter().map(Duration::as_millis).collect::<Vec<_>>(),
        worst.as_millis(),
        partition.as_millis()
    );
    assert!(worst <= HEALED_WITHIN, "a healed node took {worst:?} to serve again");
    Ok(())
}

/// Cut off one follower for 15 s, heal, and 3 s later cut off the other: writes through the
/// node never cut off find a commit again within an election at every moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_partitions_three_seconds_apart_cost_at_most_an_election() -> anyhow::Result<()> {
    let cluster = Arc::new(Cluster::start(3, partitioned_cluster_options(1)).await?);
    let leader = cluster.leader().await?;
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != leader).collect();
    // A writer through the node never cut off, recording when each write committed.
    let commits = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (commits, stop) = (Arc::clone(&commits), Arc::clone(&stop));
        let address = cluster.nodes[&leader].admin_addr;
        tokio::spawn(async move {
            let mut sequence = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                sequence += 1;
                if write_through(address, &format!("w{}", sequence % 64)).await {
                    commits.lock().push(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let first = Partition::cut(&cluster.nodes[&followers[0]])?;
    tokio::time::sleep(Duration::from_secs(15)).await;
    first.heal()?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let watched_from = Instant::now();
    let second = Partition::cut(&cluster.nodes[&followers[1]])?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let watched_until = Instant::now();
    second.heal()?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await?;
    let commits = commits.lock().clone();
    let mut marks: Vec<Instant> =
        commits.iter().copied().filter(|at| (watched_from..=watched_until).contains(at)).collect();
    marks.insert(0, watched_from);
    marks.push(watched_until);
    let longest = marks.windows(2).map(|pair| pair[1] - pair[0]).max().unwrap_or_default();
    eprintln!(
        "second partition: {} commits in {} ms, longest gap {} ms",
        marks.len() - 2,
        (watched_until - watched_from).as_millis(),
        longest.as_millis()
    );
    assert!(longest <= ELECTION_BOUND, "the group found no commit for {longest:?}");
    Ok(())
}

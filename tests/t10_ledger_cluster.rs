//! Three quota-group Raft nodes in one test process, each with its own directory (real redb
//! and sled) and its own gRPC server on a 127.0.0.1 socket: election, writes forwarded from a
//! follower, identical replicas, restart from disk, catch-up from a snapshot, and a stop
//! under load that logs no error.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use quotamesh::core::ledger::{LeaseRequest, NodeId, QuotaCommand, QuotaResponse};
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::ledger::{
    BasicNode, GroupSettings, PeerChannels, QUOTA_GROUP_NAME, QuotaGroup, RaftGroup,
    RaftPeerService,
};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing_subscriber::layer::{Layer, SubscriberExt};

/// Generous for a shared 2-core machine running debug builds.
const WAIT: Duration = Duration::from_secs(20);
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// One node: its group, its gRPC server, and how to stop them.
struct TestNode {
    id: NodeId,
    address: String,
    directory: PathBuf,
    group: RaftGroup<QuotaGroup>,
    stop_server: oneshot::Sender<()>,
    server: JoinHandle<()>,
}

fn settings(id: NodeId, directory: &Path, snapshot_every_logs: u64) -> GroupSettings {
    let mut settings = GroupSettings::new(QUOTA_GROUP_NAME, id, directory.join(QUOTA_GROUP_NAME));
    settings.snapshot_every_logs = snapshot_every_logs;
    settings.logs_kept_after_snapshot = 2;
    settings
}

async fn start_node(
    id: NodeId,
    listener: TcpListener,
    directory: PathBuf,
    snapshot_every_logs: u64,
) -> Result<TestNode> {
    let address = listener.local_addr()?.to_string();
    let group = RaftGroup::<QuotaGroup>::open(
        &settings(id, &directory, snapshot_every_logs),
        PeerChannels::new(None),
    )
    .await
    .with_context(|| format!("open node {id}"))?;
    let service = RaftPeerService::new(false);
    service.register_group(&group)?;
    let (stop_server, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        if let Err(error) = service.serve(listener, shutdown).await {
            eprintln!("node {id}: server stopped: {error}");
        }
    });
    Ok(TestNode { id, address, directory, group, stop_server, server })
}

impl TestNode {
    /// Stops the Raft node and its server and releases its storage.
    async fn stop(self) -> Result<(NodeId, String, PathBuf)> {
        self.group.shutdown().await?;
        let _ = self.stop_server.send(());
        self.server.await?;
        let TestNode { id, address, directory, group, .. } = self;
        drop(group);
        Ok((id, address, directory))
    }
}

async fn start_cluster(root: &Path, snapshot_every_logs: u64) -> Result<Vec<TestNode>> {
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let directory = root.join(format!("node{id}"));
        nodes.push(start_node(NodeId(id), listener, directory, snapshot_every_logs).await?);
    }
    let members: BTreeMap<NodeId, BasicNode> =
        nodes.iter().map(|node| (node.id, BasicNode::new(node.address.clone()))).collect();
    nodes[0].group.initialize(members).await?;
    Ok(nodes)
}

/// Waits until every node names the same leader; returns it.
async fn agreed_leader(nodes: &[TestNode]) -> Result<NodeId> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let leaders: Vec<Option<NodeId>> = nodes.iter().map(|node| node.group.leader()).collect();
        if let Some(Some(leader)) = leaders.first()
            && leaders.iter().all(|seen| *seen == Some(*leader))
        {
            return Ok(*leader);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("no agreed leader within {WAIT:?}: {leaders:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every node applied at least `index`; returns their digests.
async fn digests_at(nodes: &[TestNode], index: u64) -> Result<Vec<u64>> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let applied: Vec<Option<u64>> =
            nodes.iter().map(|node| node.group.last_applied_index()).collect();
        if applied.iter().all(|seen| seen.is_some_and(|seen| seen >= index)) {
            return Ok(nodes.iter().map(|node| node.group.digest()).collect());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("not every node applied index {index} within {WAIT:?}: {applied:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn lease_batch(now_ms: u64, node_id: NodeId, keys: usize, round: usize) -> QuotaCommand {
    let limit =
        LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(2_000)).expect("a valid limit");
    QuotaCommand::AcquireLeases {
        now_ms,
        node_id,
        requests: (0..keys)
            .map(|key| LeaseRequest {
                key: format!("rl:tenant:api_key_{key}"),
                limit,
                tokens_wanted: 10 + u64::try_from(round).unwrap_or(0),
                lease_ttl_ms: 500,
            })
            .collect(),
    }
}

fn granted(response: &QuotaResponse) -> Result<Vec<u64>> {
    match response {
        QuotaResponse::Leases(grants) => grants
            .iter()
            .map(|grant| {
                grant.as_ref().map(|grant| grant.granted_tokens).map_err(|e| anyhow::anyhow!("{e}"))
            })
            .collect(),
        other => bail!("expected lease grants, got {other:?}"),
    }
}

/// The highest index any node applied: the leader's, which answered the last write.
fn highest_applied(nodes: &[TestNode]) -> Result<u64> {
    nodes.iter().filter_map(|node| node.group.last_applied_index()).max().context("nothing applied")
}

fn follower_of(nodes: &[TestNode], leader: NodeId) -> usize {
    nodes.iter().position(|node| node.id != leader).expect("three nodes have a follower")
}

// Proves a 3-node group elects a leader, commits a batch written on a follower (forwarded to
// the leader over gRPC), applies it identically everywhere, and that a node restarted from
// its directory recovers the same state and keeps up with later writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_replicate_forwarded_grants_and_recover_after_restart() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut nodes = start_cluster(root.path(), 10_000).await?;
    let leader = agreed_leader(&nodes).await?;
    let follower = follower_of(&nodes, leader);

    let response = nodes[follower]
        .group
        .write(lease_batch(1_000, nodes[follower].id, 64, 0), WRITE_TIMEOUT)
        .await?;
    assert_eq!(granted(&response)?, vec![10; 64], "every key had a full bucket");
    let applied = highest_applied(&nodes)?;
    let digests = digests_at(&nodes, applied).await?;
    assert!(digests.iter().all(|digest| *digest == digests[0]), "replicas differ: {digests:?}");
    for node in &nodes {
        let outstanding = node.group.read(|ledger| ledger.outstanding_tokens(nodes[follower].id));
        assert_eq!(outstanding, 640, "node {} counts the leases", node.id);
    }

    // Restart a follower from its directory: same state, then it keeps up.
    let restarted = follower_of(&nodes, leader);
    let before = nodes[restarted].group.digest();
    let node = nodes.remove(restarted);
    let (id, address, directory) = node.stop().await?;
    let listener = TcpListener::bind(&address).await?;
    nodes.insert(restarted, start_node(id, listener, directory, 10_000).await?);
    let recovered = digests_at(&nodes[restarted..=restarted], applied).await?;
    assert_eq!(recovered[0], before, "the restarted node recovered its state");

    let response =
        nodes[restarted].group.write(lease_batch(2_000, id, 16, 1), WRITE_TIMEOUT).await?;
    assert_eq!(granted(&response)?, vec![11; 16]);
    let applied = highest_applied(&nodes)?;
    let digests = digests_at(&nodes, applied).await?;
    assert!(digests.iter().all(|digest| *digest == digests[0]), "replicas differ: {digests:?}");

    for node in nodes {
        node.stop().await?;
    }
    Ok(())
}

// Proves a follower that was down while the leader compacted its log catches up by an
// InstallSnapshot over gRPC, and ends with the same state as the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_behind_a_compacted_log_catches_up_from_a_snapshot() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut nodes = start_cluster(root.path(), 5).await?;
    let leader = agreed_leader(&nodes).await?;
    let down = follower_of(&nodes, leader);
    let node = nodes.remove(down);
    let (id, address, directory) = node.stop().await?;

    let writer = nodes.iter().position(|node| node.id == leader).context("leader")?;
    for round in 0..30 {
        let now_ms = 10_000 + u64::try_from(round)? * 10;
        nodes[writer]
            .group
            .write(lease_batch(now_ms, nodes[writer].id, 4, round), WRITE_TIMEOUT)
            .await?;
    }
    // Purging follows the snapshot asynchronously.
    nodes[writer]
        .group
        .wait(WAIT)
        .metrics(|metrics| metrics.purged.is_some(), "the leader purged its log after a snapshot")
        .await?;

    let listener = TcpListener::bind(&address).await?;
    nodes.insert(down, start_node(id, listener, directory, 5).await?);
    let applied = highest_applied(&nodes)?;
    let digests = digests_at(&nodes, applied).await?;
    assert!(digests.iter().all(|digest| *digest == digests[0]), "replicas differ: {digests:?}");
    assert!(nodes[down].group.metrics().snapshot.is_some(), "the follower installed a snapshot");

    for node in nodes {
        node.stop().await?;
    }
    Ok(())
}

// Proves a node outside the group (a gateway: never initialized, no member) writes through
// its seeds: a seed that refuses connections is skipped, a follower seed names the leader,
// the leader it reached is cached, and once that leader is gone its next write finds the new
// one by itself. Every write commits once, in the members' ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_outside_the_group_writes_through_its_seeds() -> Result<()> {
    let root = tempfile::tempdir()?;
    let mut nodes = start_cluster(root.path(), 10_000).await?;
    let leader = agreed_leader(&nodes).await?;

    // Seeds: the three members and a port nobody listens on.
    let closed = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.to_string();
    let mut seeds: BTreeMap<NodeId, BasicNode> =
        nodes.iter().map(|node| (node.id, BasicNode::new(node.address.clone()))).collect();
    seeds.insert(NodeId(9), BasicNode::new(closed));
    // Seed order is by id (1, 2, 3, 9) and a node starts at its id modulo the count: node 7
    // looks at the closed seed first.
    let gateway_id = NodeId(7);
    let mut gateway_settings = settings(gateway_id, &root.path().join("gateway"), 10_000);
    gateway_settings.seeds = seeds;
    let gateway = RaftGroup::<QuotaGroup>::open(&gateway_settings, PeerChannels::new(None)).await?;
    assert!(!gateway.is_member());
    assert_eq!(gateway.voter_count(), 4, "a non-member counts its seeds");
    assert_eq!(gateway.cached_leader(), None);

    // The first write skips the closed seed; the later ones go straight to the cached leader.
    for round in 0..6 {
        let now_ms = 1_000 + u64::try_from(round)?;
        let response =
            gateway.write(lease_batch(now_ms, gateway_id, 4, round), WRITE_TIMEOUT).await?;
        assert_eq!(granted(&response)?, vec![10 + u64::try_from(round)?; 4]);
        assert_eq!(gateway.cached_leader(), Some(leader));
    }
    assert_eq!(gateway.leader(), None, "the gateway's own metrics name no leader");
    let applied = highest_applied(&nodes)?;
    digests_at(&nodes, applied).await?;
    for node in &nodes {
        let outstanding = node.group.read(|ledger| ledger.outstanding_tokens(gateway_id));
        assert_eq!(outstanding, (10..16).sum::<u64>() * 4, "node {} counts the leases", node.id);
    }

    // The cached leader goes away; the next write finds the new one through the seeds.
    let old = nodes.iter().position(|node| node.id == leader).context("leader")?;
    nodes.remove(old).stop().await?;
    let response = gateway.write(lease_batch(2_000, gateway_id, 4, 6), WRITE_TIMEOUT).await?;
    assert_eq!(granted(&response)?, vec![16; 4]);
    let new_leader = agreed_leader(&nodes).await?;
    assert_ne!(new_leader, leader);
    assert_eq!(gateway.cached_leader(), Some(new_leader));

    gateway.shutdown().await?;
    for node in nodes {
        node.stop().await?;
    }
    Ok(())
}

/// The ERROR events seen on the threads it is installed on, past the node's own filter of
/// openraft's expected ones (`quotamesh::logging`).
#[derive(Clone, Default)]
struct ErrorEvents(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> Layer<S> for ErrorEvents {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _context: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut fields = String::new();
            event.record(&mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                fields.push_str(&format!(" {}={value:?}", field.name()));
            });
            let line = format!("{}:{fields}", event.metadata().target());
            self.0.lock().expect("not poisoned").push(line);
        }
    }
}

/// Writes on `node` from `writers` tasks until `stop` is set or a write fails; returns the
/// count of writes that committed.
fn spawn_writers(node: &TestNode, writers: usize, stop: &Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    (0..writers)
        .map(|writer| {
            let (group, id, stop) = (node.group.clone(), node.id, Arc::clone(stop));
            tokio::spawn(async move {
                let mut committed = 0;
                while !stop.load(Ordering::Relaxed) {
                    let now_ms = 1_000 + committed;
                    let batch = lease_batch(now_ms, id, 2, writer);
                    if group.write(batch, WRITE_TIMEOUT).await.is_err() {
                        break;
                    }
                    committed += 1;
                }
                committed
            })
        })
        .collect()
}

// Proves that nodes stopped while writes and replication are in flight log no ERROR: a
// follower stopped under the leader's stream of appends, then the leader under its clients'
// writes, then the last node. openraft logs a call its core stopped under as an ERROR; the
// group closes its gate first, so none is left in flight. The tracing subscriber is the
// node's filter plus a recorder, on this test's runtime threads only.
#[test]
fn nodes_stopped_under_a_stream_of_writes_log_no_error() -> Result<()> {
    let errors = ErrorEvents::default();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::registry()
            .with(quotamesh::logging::ExpectedOpenraftEvents)
            .with(errors.clone()),
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(move || {
            // Installed for the thread's whole life: every task of the test runs on these.
            std::mem::forget(tracing::dispatcher::set_default(&dispatch));
        })
        .build()?;
    runtime.block_on(async {
        let root = tempfile::tempdir()?;
        let mut nodes = start_cluster(root.path(), 10_000).await?;
        let leader = agreed_leader(&nodes).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let writers: Vec<JoinHandle<u64>> =
            nodes.iter().flat_map(|node| spawn_writers(node, 8, &stop)).collect();
        let streaming = highest_applied(&nodes).unwrap_or(0) + 50;
        digests_at(&nodes, streaming).await?;

        let follower = follower_of(&nodes, leader);
        nodes.remove(follower).stop().await?;
        let leading = nodes.iter().position(|node| node.id == leader).context("leader")?;
        nodes.remove(leading).stop().await?;
        stop.store(true, Ordering::Relaxed);
        for node in nodes {
            node.stop().await?;
        }
        let mut committed = 0;
        for writer in writers {
            committed += writer.await?;
        }
        assert!(committed >= 50, "the writes flowed before the stops: {committed}");
        anyhow::Ok(())
    })?;
    drop(runtime);
    let errors = errors.0.lock().expect("not poisoned");
    assert!(errors.is_empty(), "ERROR events while stopping: {errors:#?}");
    Ok(())
}

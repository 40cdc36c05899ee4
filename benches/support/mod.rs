//! What the in-process benchmarks (and `tests/t10_leasing.rs`) share: a real quota ledger (a single-node Raft group on
//! disk, or one that can never elect a leader) and a shard set leasing from it.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use quotamesh::actors::lease_broker::{BrokerSettings, LeaseBroker};
use quotamesh::actors::shard::{LedgerName, Probe, ProbeCounter, ShardSet, ShardSetOptions};
use quotamesh::config::{LeasingConfig, NodeConfig, PeerConfig};
use quotamesh::core::circuit::BreakerSettings;
use quotamesh::core::lease::LeaseTuning;
use quotamesh::core::ledger::NodeId;
use quotamesh::core::policy::FailureMode;
use quotamesh::core::policy::PolicySet;
use quotamesh::core::rate::LimitSpec;
use quotamesh::metrics::Metrics;
use quotamesh::raft_host::RaftHost;

/// A node's ledger side: the Raft host and the directory it lives in.
pub struct Ledger {
    pub host: RaftHost,
    _directory: tempfile::TempDir,
}

/// A single-node quota group on disk (fsync on), or, with `reachable = false`, a group whose
/// second voter does not exist, so no leader is ever elected and every ledger call fails.
pub async fn ledger(reachable: bool) -> anyhow::Result<Ledger> {
    let directory = tempfile::tempdir()?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let raft_addr = listener.local_addr()?;
    drop(listener);
    let mut config =
        NodeConfig { data_dir: directory.path().to_owned(), raft_addr, ..NodeConfig::default() };
    if !reachable {
        config.peers = vec![
            PeerConfig { id: NodeId(1), raft_addr: raft_addr.to_string() },
            PeerConfig { id: NodeId(2), raft_addr: "127.0.0.1:9".to_owned() },
        ];
    }
    let host = RaftHost::start(&config, &Metrics::new()).await?;
    if reachable {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while host.quota().leader().is_none() {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "no leader elected");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(Ledger { host, _directory: directory })
}

/// How a shard set under test or benchmark leases.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub shard_count: usize,
    pub keys_per_shard_max: usize,
    pub sweep_interval: Duration,
    /// The node's `leasing.ledger_timeout_ms`: `None` judges calls by measured latency.
    pub ledger_timeout_ms: Option<u64>,
    /// Nodes the fallback bucket shares the limit with.
    pub nodes_in_region: u64,
}

impl Default for Setup {
    /// The node's defaults: measured ledger deadlines, 1 ms batches, one node, a sweep a
    /// second.
    fn default() -> Self {
        Self {
            shard_count: 2,
            keys_per_shard_max: 1_000_000,
            sweep_interval: Duration::from_secs(1),
            ledger_timeout_ms: None,
            nodes_in_region: 1,
        }
    }
}

/// A shard set leasing from `ledger` through its own lease broker.
pub async fn shard_set(
    ledger: &Ledger,
    setup: Setup,
    policy: Arc<ArcSwap<PolicySet>>,
    metrics: &Metrics,
) -> anyhow::Result<ShardSet> {
    let settings = BrokerSettings {
        node_id: ledger.host.node_id(),
        batch_window_ms: 1,
        breaker: BreakerSettings {
            fixed_deadline_ms: setup.ledger_timeout_ms,
            ..BreakerSettings::default()
        },
    };
    let (broker, _task) =
        LeaseBroker::start(ledger.host.quota().clone(), settings, metrics.clone()).await?;
    let options = ShardSetOptions {
        shard_count: setup.shard_count,
        keys_per_shard_max: setup.keys_per_shard_max,
        sweep_interval: setup.sweep_interval,
        wait_budget: Duration::from_millis(LeasingConfig::default().wait_budget_ms),
        fallback_multiplier_permille: 1_000,
        nodes_in_region: setup.nodes_in_region,
    };
    Ok(ShardSet::start(options, metrics, broker, policy).await?)
}

/// A probe of one descriptor `key=value` of `domain` under `spec` (no rule: leases as
/// `lease` says, fails as `failure_mode` says).
pub fn probe<'p>(
    shards: &ShardSet,
    domain: &'p str,
    (key, value): (&'p str, &'p str),
    spec: &'p LimitSpec,
    lease: &'p LeaseTuning,
    failure_mode: FailureMode,
    hits: u64,
) -> [Probe<'p>; 1] {
    let hash = shards.hash_descriptor(domain, [(key, value)].into_iter());
    [Probe {
        stripe: shards.stripe_of(&hash),
        counters: smallvec::smallvec![ProbeCounter {
            key: shards.counter_of(&hash, 0, spec),
            spec,
            ledger_spec: spec,
        }],
        hits,
        check_only: false,
        enforced: true,
        quota_mode: false,
        lease,
        failure_mode,
        rule: None,
        name: LedgerName { domain, entries: smallvec::smallvec![(key, value)] },
    }]
}

/// An empty policy (the benchmarks build their probes by hand).
pub fn no_policy() -> Arc<ArcSwap<PolicySet>> {
    Arc::new(ArcSwap::from_pointee(PolicySet::parse(&[]).expect("an empty policy set parses")))
}

//! Wires one node together and takes it apart again.
//!
//! ```text
//! start:    config ─▶ data dir lock ─▶ metrics ─▶ policy ─▶ listeners ─▶ Raft groups
//!           (identity, quota and billing groups, Raft peer listener) ─▶ lease broker ─▶ shard
//!           actors ─▶ servers (RLS in node/rls.rs, admin, billing API in node/billing.rs)
//!           ─▶ group watches
//!           (raft_health.rs) ─▶ the region's policy version installed, then followed
//!           (policy_follow.rs) ─▶ demand reports and, on a gateway, the ledger's slices
//!           (slice_follow.rs) ─▶ QUIC endpoint and rebalancer (with [[regions]]) ─▶ ready
//! shutdown: not ready ─▶ stop accepting, drain calls (RLS, HTTP, admin, billing) ─▶ stop
//!           the rebalancer and close QUIC ─▶ stop watchers ─▶ stop shard actors ─▶ stop
//!           lease broker ─▶ stop Raft groups, then the
//!           Raft peer listener ─▶ unlock
//! ```
//!
//! A group that stops on an error (a storage failure) resolves [`Node::failed`]; `quotamesh
//! serve` then shuts the node down and exits non-zero (crash-only, `crate::raft_health`).
//!
//! A gateway (`role = "gateway"`) starts the same way without billing: the billing group has
//! voters only, so a gateway neither opens it nor binds `billing_addr`.
//!
//! The Raft groups are `crate::raft_host`'s; the admin API over them is `crate::api::admin`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::actors::lease_broker::{BrokerSettings, LeaseBroker};
use crate::actors::rebalancer::{Rebalancer, RebalancerParts, RegionBoard};
use crate::actors::shard::{ShardSet, ShardSetOptions, ShardSpawnError};
use crate::api::admin::{AdminNode, AdminService};
use crate::api::grpc_metrics::GrpcMetricsLayer;
use crate::api::rls::RlsService;
use crate::api::shadow_events::ShadowSink;
use crate::config::{ConfigError, NodeConfig};
use crate::core::circuit::BreakerSettings;
use crate::core::headers::HeaderOptions;
use crate::metrics::Metrics;
use crate::policy_store::{PolicyLoadError, PolicyOrigin, PolicyStore};
use crate::raft_health::{Failures, GroupViews};
use crate::raft_host::{RaftHost, RaftHostError};
use crate::tls::credentials::Accept;

mod billing;
mod rls;

/// Concurrent HTTP/2 streams per client connection (Envoy multiplexes on few connections).
pub const GRPC_STREAMS_PER_CONNECTION_MAX: u32 = 4096;
/// How long shutdown waits for in-flight calls before it stops serving anyway.
pub const SHUTDOWN_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Name of the lock file that keeps two nodes off one data directory.
pub const DATA_DIR_LOCK_FILE: &str = "node.lock";

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The data directory cannot be created or locked.
    #[error("data directory {path}: {reason}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The initial policy is invalid or unreadable.
    #[error(transparent)]
    Policy(#[from] PolicyLoadError),
    /// `[policy] shadow_events_file` cannot be opened for appending.
    #[error("shadow events file {path}: {source}")]
    ShadowEvents {
        /// The file.
        path: PathBuf,
        /// The IO error.
        source: std::io::Error,
    },
    /// A listener could not be bound.
    #[error("cannot listen for {service} on {address}: {source}")]
    Bind {
        /// Which listener.
        service: &'static str,
        /// The address.
        address: SocketAddr,
        /// The IO error.
        source: std::io::Error,
    },
    /// The shard actors could not be started.
    #[error(transparent)]
    Shards(#[from] ShardSpawnError),
    /// The Raft groups could not be started (identity, storage, Raft listener).
    #[error(transparent)]
    Raft(#[from] RaftHostError),
    /// A supporting service (reflection, file watch, signals) could not be set up.
    #[error("cannot start {what}: {reason}")]
    Setup {
        /// Which part.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

/// A running node.
pub struct Node {
    rls_addr: SocketAddr,
    metrics_addr: SocketAddr,
    admin_addr: SocketAddr,
    billing_addr: Option<SocketAddr>,
    raft: RaftHost,
    ready: Arc<AtomicBool>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    watcher: JoinHandle<()>,
    shards: Arc<ShardSet>,
    broker: (LeaseBroker, JoinHandle<()>),
    policy: Arc<PolicyStore>,
    group_watches: Vec<JoinHandle<()>>,
    /// The QUIC endpoint and rebalancer, on a voter of a region with `[[regions]]`.
    rebalancer: Option<Rebalancer>,
    failures: Failures,
    _data_dir_lock: std::fs::File,
}

impl Node {
    /// Starts every part of a node and returns once it is ready to serve.
    ///
    /// # Errors
    /// [`NodeError`] naming the part that could not start; nothing is left running.
    pub async fn start(config: NodeConfig) -> Result<Self, NodeError> {
        config.validate()?;
        let data_dir_lock = lock_data_dir(&config.data_dir)?;
        let metrics = Metrics::new();
        if config.tls.is_none() && !config.peers.is_empty() {
            // validate() let this through only because insecure_cluster says so.
            tracing::warn!(
                "insecure_cluster = true: the Raft port has no TLS; anyone who can reach it can \
                 write to this region's ledgers. Configure [tls] (quotamesh cluster certs)"
            );
            metrics.insecure_cluster.set(1);
        }
        let origin = config.policy.path.clone().map_or(PolicyOrigin::Embedded, PolicyOrigin::Path);
        let policy = Arc::new(PolicyStore::open(
            origin,
            config.policy.load_options(),
            &config.region,
            &config.node_id,
            metrics.clone(),
        )?);

        let rls_listener = bind("Envoy RLS gRPC", config.rls_addr).await?;
        let metrics_listener = bind("metrics HTTP", config.metrics_addr).await?;
        let admin_listener = bind("admin gRPC", config.admin_addr).await?;
        let rls_addr = local_addr("Envoy RLS gRPC", &rls_listener, config.rls_addr)?;
        let metrics_addr = local_addr("metrics HTTP", &metrics_listener, config.metrics_addr)?;
        let admin_addr = local_addr("admin gRPC", &admin_listener, config.admin_addr)?;
        let billing_listener = if config.is_gateway() {
            tracing::info!(
                "gateway: not serving the billing API (the billing group has voters only)"
            );
            None
        } else {
            let listener = bind("billing gRPC", config.billing_addr).await?;
            let address = local_addr("billing gRPC", &listener, config.billing_addr)?;
            Some((listener, address))
        };
        let billing_addr = billing_listener.as_ref().map(|(_, address)| *address);

        let raft = RaftHost::start(&config, &metrics).await?;
        let (broker, shards) = match start_leasing(&config, &raft, &metrics, &policy).await {
            Ok(started) => started,
            Err(error) => {
                raft.shutdown().await;
                return Err(error);
            }
        };
        let headers = HeaderOptions {
            ietf_draft10: config.headers.ietf_draft10,
            legacy: config.headers.legacy,
            retry_after: config.headers.retry_after,
        };
        let mut rls =
            RlsService::new(Arc::clone(&shards), policy.active(), metrics.clone(), headers)
                .with_near_limit_ratio_permille(config.policy.near_limit_ratio_permille());
        if let Some(path) = &config.policy.shadow_events_file {
            let max_bytes = config.policy.shadow_events_file_max_bytes;
            let sink = ShadowSink::open(path, max_bytes, metrics.clone())
                .map_err(|source| NodeError::ShadowEvents { path: path.clone(), source })?;
            rls = rls.with_shadow_events(sink, &config.node_id);
        }
        let region_board = Arc::new(RegionBoard::default());
        let admin = AdminService::new(
            AdminNode {
                name: config.node_id.clone(),
                raft_node_id: raft.node_id(),
                role: raft.role(),
                cluster_id: raft.cluster_id().to_owned(),
                advertise_addr: raft.advertise_addr().to_owned(),
                peers: raft.peers().clone(),
            },
            raft.quota().clone(),
            raft.billing().cloned(),
            Arc::clone(&policy),
            crate::api::operators::Operators::new(&config.admin),
        )
        .with_regions(&config.region, Arc::clone(&region_board));

        let (stop, stopped) = watch::channel(false);
        let ready = Arc::new(AtomicBool::new(false));
        let rls_threads = config.rls_thread_count();
        let grpc = match rls::serve(rls, &metrics, rls_listener, rls_threads, stopped.clone()).await
        {
            Ok(grpc) => grpc,
            Err(error) => {
                unwind(&stop, Vec::new(), shards, broker, raft).await;
                return Err(error);
            }
        };
        let admin_tls = raft.credentials().filter(|_| config.admin.tls).map(|credentials| {
            crate::tls::transport::server_config(credentials, Accept::NodesAndOperators)
        });
        let admin_server = {
            let shutdown = until_stopped(stopped.clone());
            let grpc_metrics = GrpcMetricsLayer::new(&metrics);
            tokio::spawn(async move {
                if let Err(error) =
                    admin.serve(admin_listener, admin_tls, grpc_metrics, shutdown).await
                {
                    tracing::error!(%error, "admin gRPC server stopped");
                }
            })
        };
        let billing_server = match (billing_listener, raft.billing()) {
            (Some((listener, _)), Some(group)) => {
                match billing::serve(
                    &config,
                    group,
                    &metrics,
                    listener,
                    until_stopped(stopped.clone()),
                ) {
                    Ok(server) => Some(server),
                    Err(error) => {
                        unwind(&stop, vec![grpc, admin_server], shards, broker, raft).await;
                        return Err(error);
                    }
                }
            }
            _ => None,
        };
        // Each group's health: its series, its view for /readyz, and a failure that stops
        // the node (crate::raft_health).
        let group_names: Vec<&'static str> = std::iter::once(crate::ledger::QUOTA_GROUP_NAME)
            .chain(raft.billing().map(|_| crate::ledger::BILLING_GROUP_NAME))
            .collect();
        let views = GroupViews::expecting(&group_names);
        let failures = Failures::default();
        let mut group_watches = vec![crate::raft_health::watch_group(
            crate::ledger::QUOTA_GROUP_NAME,
            raft.quota().clone(),
            metrics.clone(),
            views.clone(),
            failures.clone(),
            stopped.clone(),
        )];
        if let Some(billing) = raft.billing() {
            group_watches.push(crate::raft_health::watch_group(
                crate::ledger::BILLING_GROUP_NAME,
                billing.clone(),
                metrics.clone(),
                views.clone(),
                failures.clone(),
                stopped.clone(),
            ));
        }
        let http = {
            let readiness = crate::api::http::Readiness {
                started: Arc::clone(&ready),
                groups: views,
                metrics: metrics.clone(),
                policy: Arc::clone(&policy),
            };
            let (metrics, shutdown) = (metrics.clone(), until_stopped(stopped.clone()));
            let served = crate::api::http::Served {
                readiness,
                policy: policy.served(),
                operators: crate::api::operators::Operators::new(&config.admin),
            };
            tokio::spawn(async move {
                if let Err(error) =
                    crate::api::http::serve(metrics_listener, metrics, served, shutdown).await
                {
                    tracing::error!(%error, "metrics HTTP server stopped");
                }
            })
        };
        // The region's replicated version, if any, is served before the node says it is ready.
        group_watches.push(
            crate::policy_follow::PolicyFollower::start(
                Arc::clone(&policy),
                raft.quota().clone(),
                raft.role(),
                until_stopped(stopped.clone()),
            )
            .await,
        );
        // A voter without `[[regions]]` runs no rebalancer to read the reports; a gateway
        // follows the slices through them whatever it is told of the other regions.
        if !config.regions.is_empty() || config.is_gateway() {
            let follower = crate::slice_follow::SliceFollower {
                node_id: raft.node_id(),
                role: raft.role(),
                group: raft.quota().clone(),
                policy: Arc::clone(&policy),
                metrics: metrics.clone(),
                interval: Duration::from_millis(config.rebalance.interval_ms),
            };
            group_watches.push(follower.start(until_stopped(stopped.clone())));
        }
        let watcher = match Arc::clone(&policy).watch(until_stopped(stopped)) {
            Ok(watcher) => watcher,
            Err(error) => {
                let mut servers = vec![grpc, admin_server, http];
                servers.extend(billing_server);
                servers.extend(group_watches);
                unwind(&stop, servers, shards, broker, raft).await;
                return Err(NodeError::Setup { what: "policy watch", reason: error.to_string() });
            }
        };

        let rebalancer =
            match start_rebalancer(&config, &raft, &metrics, &policy, region_board).await {
                Ok(rebalancer) => rebalancer,
                Err(error) => {
                    let mut servers = vec![grpc, admin_server, http, watcher];
                    servers.extend(billing_server);
                    servers.extend(group_watches);
                    unwind(&stop, servers, shards, broker, raft).await;
                    return Err(error);
                }
            };

        let mut servers = vec![grpc, http, admin_server];
        servers.extend(billing_server);
        ready.store(true, Ordering::Release);
        tracing::info!(%rls_addr, rls_threads, %metrics_addr, %admin_addr, ?billing_addr, raft_addr = %raft.raft_addr(), node_id = %config.node_id, region = %config.region, role = %config.role, "quotamesh node ready");
        Ok(Self {
            rls_addr,
            metrics_addr,
            admin_addr,
            billing_addr,
            raft,
            ready,
            stop,
            servers,
            watcher,
            shards,
            broker,
            policy,
            group_watches,
            rebalancer,
            failures,
            _data_dir_lock: data_dir_lock,
        })
    }

    /// Resolves when one of the node's Raft groups stopped on an error (a storage failure),
    /// with which and why. The node cannot serve that group again in this process: shut it
    /// down and exit non-zero, so its supervisor restarts it from its durable state.
    pub async fn failed(&self) -> String {
        self.failures.first().await
    }

    /// The bound Envoy RLS gRPC address (useful when configured with port 0).
    pub fn rls_addr(&self) -> SocketAddr {
        self.rls_addr
    }

    /// The bound metrics and health HTTP address.
    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    /// The bound admin gRPC address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// The Raft side of the node: its groups and their peer listener.
    pub fn raft(&self) -> &RaftHost {
        &self.raft
    }

    /// The bound billing gRPC address; `None` on a gateway, which serves no billing API.
    pub fn billing_addr(&self) -> Option<SocketAddr> {
        self.billing_addr
    }

    /// The policy store (to reload by hand).
    pub fn policy(&self) -> &PolicyStore {
        &self.policy
    }

    /// Stops in order: readiness, listeners (draining calls), policy watch, shard actors, Raft
    /// groups and their peer listener.
    pub async fn shutdown(self) {
        self.ready.store(false, Ordering::Release);
        let _ = self.stop.send(true);
        for mut server in self.servers {
            if tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, &mut server).await.is_err() {
                // A client that never answers GOAWAY must not hold the node up forever.
                tracing::warn!(
                    "a server did not drain within {SHUTDOWN_DRAIN_TIMEOUT:?}; closing it"
                );
                server.abort();
                let _ = server.await;
            }
        }
        if let Some(rebalancer) = self.rebalancer {
            rebalancer.shutdown().await;
        }
        let _ = self.watcher.await;
        for watch in self.group_watches {
            let _ = watch.await;
        }
        match Arc::try_unwrap(self.shards) {
            Ok(shards) => shards.shutdown().await,
            Err(_) => tracing::error!("shard actors still referenced at shutdown; not stopped"),
        }
        let (broker, broker_task) = self.broker;
        broker.stop();
        let _ = broker_task.await;
        self.raft.shutdown().await;
        tracing::info!("quotamesh node stopped");
    }
}

/// Takes apart what start-up had started when a later step failed, in shutdown order: the
/// servers and watches (told to stop through `stop`), the shard actors, the lease broker,
/// the Raft groups. Nothing of a failed start keeps running or holds the data directory.
async fn unwind(
    stop: &watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    shards: Arc<ShardSet>,
    (broker, broker_task): (LeaseBroker, JoinHandle<()>),
    raft: RaftHost,
) {
    let _ = stop.send(true);
    for mut server in servers {
        if tokio::time::timeout(SHUTDOWN_DRAIN_TIMEOUT, &mut server).await.is_err() {
            server.abort();
            let _ = server.await;
        }
    }
    match Arc::try_unwrap(shards) {
        Ok(shards) => shards.shutdown().await,
        Err(_) => tracing::error!("shard actors still referenced after a failed start"),
    }
    broker.stop();
    let _ = broker_task.await;
    raft.shutdown().await;
}

/// Starts the lease broker over the quota group, then the shard actors that lease from it.
async fn start_leasing(
    config: &NodeConfig,
    raft: &RaftHost,
    metrics: &Metrics,
    policy: &PolicyStore,
) -> Result<((LeaseBroker, JoinHandle<()>), Arc<ShardSet>), NodeError> {
    let leasing = &config.leasing;
    let settings = BrokerSettings {
        node_id: raft.node_id(),
        batch_window_ms: leasing.batch_window_ms,
        breaker: BreakerSettings {
            fixed_deadline_ms: leasing.ledger_timeout_ms,
            failures_to_open: leasing.circuit_failures_to_open,
            probe_interval_ms: leasing.circuit_probe_interval_ms,
            close_after_calls: leasing.circuit_close_after_calls,
            ..BreakerSettings::default()
        },
    };
    let (broker, broker_task) = LeaseBroker::start(raft.quota().clone(), settings, metrics.clone())
        .await
        .map_err(|error| NodeError::Setup { what: "lease broker", reason: error.to_string() })?;
    let options = ShardSetOptions {
        shard_count: config.shard_count(),
        keys_per_shard_max: config.shards.keys_per_shard_max,
        sweep_interval: Duration::from_millis(config.shards.sweep_interval_ms),
        wait_budget: Duration::from_millis(leasing.wait_budget_ms),
        fallback_multiplier_permille: leasing.fallback_multiplier_permille(),
        nodes_in_region: config.nodes_in_region(),
    };
    match ShardSet::start(options, metrics, broker.clone(), policy.active()).await {
        Ok(shards) => Ok(((broker, broker_task), Arc::new(shards))),
        Err(error) => {
            broker.stop();
            let _ = broker_task.await;
            Err(error.into())
        }
    }
}

/// Binds the QUIC endpoint and starts the rebalancer on a voter of a region with
/// `[[regions]]` (`crate::actors::rebalancer`); `None` otherwise. A gateway holds no replica
/// of the ledger to follow or to lead.
async fn start_rebalancer(
    config: &NodeConfig,
    raft: &RaftHost,
    metrics: &Metrics,
    policy: &Arc<PolicyStore>,
    board: Arc<RegionBoard>,
) -> Result<Option<Rebalancer>, NodeError> {
    if config.regions.is_empty() || config.is_gateway() {
        return Ok(None);
    }
    let credentials = raft.credentials().ok_or_else(|| NodeError::Setup {
        what: "QUIC endpoint",
        reason: "[[regions]] needs [tls]".to_owned(),
    })?;
    let parts = RebalancerParts {
        region: config.region.clone(),
        peers: config.regions.iter().map(crate::region::RegionPeer::from).collect(),
        quic_addr: config.quic_addr,
        credentials: Arc::clone(credentials),
        group: raft.quota().clone(),
        policy: Arc::clone(policy),
        metrics: metrics.clone(),
        settings: config.rebalance,
        board,
    };
    let rebalancer = Rebalancer::start(parts)
        .await
        .map_err(|error| NodeError::Setup { what: "QUIC endpoint", reason: error.to_string() })?;
    let quic_addr = rebalancer.local_addr().map_err(|source| NodeError::Bind {
        service: "QUIC",
        address: config.quic_addr,
        source,
    })?;
    tracing::info!(%quic_addr, peers = config.regions.len(), "serving QUIC to the other regions");
    Ok(Some(rebalancer))
}

/// Creates the data directory and takes its lock, so two nodes never share one.
fn lock_data_dir(path: &Path) -> Result<std::fs::File, NodeError> {
    let error = |reason: String| NodeError::DataDir { path: path.to_owned(), reason };
    std::fs::create_dir_all(path).map_err(|io| error(io.to_string()))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path.join(DATA_DIR_LOCK_FILE))
        .map_err(|io| error(io.to_string()))?;
    lock.try_lock().map_err(|locked| error(format!("is in use by another process ({locked})")))?;
    Ok(lock)
}

async fn bind(
    service: &'static str,
    address: SocketAddr,
) -> Result<tokio::net::TcpListener, NodeError> {
    tokio::net::TcpListener::bind(address).await.map_err(|source| NodeError::Bind {
        service,
        address,
        source,
    })
}

fn local_addr(
    service: &'static str,
    listener: &tokio::net::TcpListener,
    address: SocketAddr,
) -> Result<SocketAddr, NodeError> {
    listener.local_addr().map_err(|source| NodeError::Bind { service, address, source })
}

/// Resolves once the stop flag is raised (or its sender is gone).
async fn until_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

//! The billing part of a node: opens the billing Raft group in `<data_dir>/billing`,
//! registers it with the node's Raft peer service, forms the group when this node is the
//! one to, and serves the billing gRPC API. `node.rs` calls [`start`] and, at shutdown,
//! [`BillingPart::shutdown`] after the listeners have drained.
//!
//! The billing group has the quota group's members (`raft_node_id`, `peers`). Forming it:
//! - no `peers`: a single-node group of this node, initialized on its first start;
//! - `peers` listed: the node with `billing.bootstrap = true` initializes the group with all
//!   of them on its first start; the others wait to be contacted by its leader.
//!
//! A node whose storage already holds a membership never initializes again. A gateway has
//! no billing part: `node.rs` does not call [`start`] there.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::api::billing::auth::Authenticator;
use crate::api::billing::{BillingService, BillingSettings, tls};
use crate::config::NodeConfig;
use crate::ledger::ledger_time::ClockOffsets;
use crate::ledger::{
    BILLING_GROUP_NAME, BasicNode, BillingGroup, GroupSettings, MembershipError, NodeId,
    PeerChannels, RaftGroup, RaftPeerService,
};
use crate::metrics::Metrics;

use super::{GRPC_STREAMS_PER_CONNECTION_MAX, NodeError};

/// Longest a billing call may run on the server, whatever else is set; the commit
/// deadline (`billing.deadline_ms`, at most 60 s) answers first.
const BILLING_REQUEST_TIMEOUT: Duration = Duration::from_secs(65);

/// The running billing group and its gRPC server.
pub(super) struct BillingPart {
    group: RaftGroup<BillingGroup>,
    server: JoinHandle<()>,
}

fn setup_error(what: &'static str, reason: impl std::fmt::Display) -> NodeError {
    NodeError::Setup { what, reason: reason.to_string() }
}

/// Opens, registers and (when this node is the one to) forms the billing group, then
/// serves the billing API on `listener` until `shutdown` resolves.
///
/// # Errors
/// [`NodeError::Setup`] naming the part that failed.
pub(super) async fn start(
    config: &NodeConfig,
    advertise_addr: &str,
    peers: &RaftPeerService,
    channels: PeerChannels,
    clock_offsets: ClockOffsets,
    metrics: &Metrics,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<BillingPart, NodeError> {
    // The billing group has the quota group's members: the same node ids and Raft addresses.
    let node_id = config.raft_node_id;
    let mut settings =
        GroupSettings::new(BILLING_GROUP_NAME, node_id, config.data_dir.join(BILLING_GROUP_NAME));
    settings.clock_offsets = clock_offsets;
    let group = RaftGroup::<BillingGroup>::open(&settings, channels)
        .await
        .map_err(|error| setup_error("billing Raft group", error))?;
    match serve(config, advertise_addr, peers, &group, metrics, listener, shutdown).await {
        Ok(server) => Ok(BillingPart { group, server }),
        Err(error) => {
            // Nothing of a failed start keeps running: a retry in this process (or the next
            // start) opens the directory again.
            peers.unregister(BILLING_GROUP_NAME);
            if let Err(shutdown) = group.shutdown().await {
                tracing::warn!(%shutdown, "billing group did not stop cleanly");
            }
            Err(error)
        }
    }
}

/// Registers and (when this node is the one to) forms the opened billing group, then
/// serves the billing API on `listener`.
async fn serve(
    config: &NodeConfig,
    advertise_addr: &str,
    peers: &RaftPeerService,
    group: &RaftGroup<BillingGroup>,
    metrics: &Metrics,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<JoinHandle<()>, NodeError> {
    let billing = &config.billing;
    let node_id = config.raft_node_id;
    peers.register_group(group).map_err(|error| setup_error("billing Raft group", error))?;

    let members: Option<BTreeMap<NodeId, BasicNode>> = if config.peers.is_empty() {
        Some(BTreeMap::from([(node_id, BasicNode::new(advertise_addr))]))
    } else if billing.bootstrap {
        Some(
            config
                .peers
                .iter()
                .map(|peer| (peer.id, BasicNode::new(peer.raft_addr.clone())))
                .collect(),
        )
    } else {
        None
    };
    if let Some(members) = members {
        match group.initialize(members).await {
            Ok(()) => tracing::info!(%node_id, "billing group formed"),
            Err(MembershipError::AlreadyInitialized) => {
                tracing::info!(%node_id, "billing group already formed; not forming it again");
            }
            Err(error) => return Err(setup_error("billing group formation", error)),
        }
    }

    let auth = Authenticator::new(&billing.tokens);
    let service = BillingService::new(
        group.clone(),
        auth,
        BillingSettings {
            deadline: Duration::from_millis(billing.deadline_ms),
            key_retention_ms: billing.key_retention_ms,
        },
        metrics.clone(),
    );
    let mut builder = Server::builder()
        .layer(crate::api::grpc_metrics::GrpcMetricsLayer::new(metrics))
        .timeout(BILLING_REQUEST_TIMEOUT)
        .max_concurrent_streams(GRPC_STREAMS_PER_CONNECTION_MAX);
    if let Some(tls) = &billing.tls {
        let tls = tls::server_config(tls).map_err(|error| setup_error("billing TLS", error))?;
        builder = builder.tls_config(tls).map_err(|error| setup_error("billing TLS", error))?;
    }
    let router = builder.add_service(service.into_server());
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    Ok(tokio::spawn(async move {
        if let Err(error) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
            tracing::error!(%error, "billing gRPC server stopped");
        }
    }))
}

impl BillingPart {
    /// The billing Raft group.
    pub(super) fn group(&self) -> &RaftGroup<BillingGroup> {
        &self.group
    }

    /// Waits for the billing server to drain (its shutdown signal must be raised), then
    /// stops the Raft group and releases its storage.
    pub(super) async fn shutdown(mut self, drain_timeout: Duration) {
        if tokio::time::timeout(drain_timeout, &mut self.server).await.is_err() {
            tracing::warn!("the billing server did not drain within {drain_timeout:?}; closing it");
            self.server.abort();
            let _ = self.server.await;
        }
        if let Err(error) = self.group.shutdown().await {
            tracing::error!(%error, "billing Raft group did not stop cleanly");
        }
    }
}

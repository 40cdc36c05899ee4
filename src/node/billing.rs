//! The billing API of a node: serves `quotamesh.billing.v1.Billing` over the billing Raft
//! group, which `crate::raft_host` opens, forms and stops with the node's other group.
//! `node.rs` calls [`serve`] on a voter and drains the server with the other listeners at
//! shutdown. A gateway has no billing API: `node.rs` does not call [`serve`] there.

use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::api::billing::auth::Authenticator;
use crate::api::billing::{BillingService, BillingSettings, tls};
use crate::api::grpc_limits::{self, Bounded};
use crate::config::NodeConfig;
use crate::ledger::{BillingGroup, RaftGroup};
use crate::metrics::Metrics;

use super::{GRPC_STREAMS_PER_CONNECTION_MAX, NodeError};

/// Longest a billing call may run on the server, whatever else is set; the commit
/// deadline (`billing.deadline_ms`, at most 60 s) answers first.
const BILLING_REQUEST_TIMEOUT: Duration = Duration::from_secs(65);

fn setup_error(what: &'static str, reason: impl std::fmt::Display) -> NodeError {
    NodeError::Setup { what, reason: reason.to_string() }
}

/// Serves the billing API over `group` on `listener` until `shutdown` resolves.
///
/// # Errors
/// [`NodeError::Setup`] when the billing TLS files cannot be used; nothing is left running.
pub(super) fn serve(
    config: &NodeConfig,
    group: &RaftGroup<BillingGroup>,
    metrics: &Metrics,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<JoinHandle<()>, NodeError> {
    let billing = &config.billing;
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
        .max_concurrent_streams(GRPC_STREAMS_PER_CONNECTION_MAX)
        .http2_max_header_list_size(grpc_limits::HEADER_LIST_BYTES_MAX);
    if let Some(tls) = &billing.tls {
        let tls = tls::server_config(tls).map_err(|error| setup_error("billing TLS", error))?;
        builder = builder.tls_config(tls).map_err(|error| setup_error("billing TLS", error))?;
    }
    let router = builder.add_service(Bounded::new(service.into_server()));
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    Ok(tokio::spawn(async move {
        if let Err(error) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
            tracing::error!(%error, "billing gRPC server stopped");
        }
    }))
}

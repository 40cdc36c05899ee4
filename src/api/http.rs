//! HTTP endpoints for operators: Prometheus `/metrics`, liveness `/healthz` (the process
//! answers) and readiness `/readyz`: started, every Raft group it is a member of running
//! with a leader and applied within a bound of its commits, and the circuit breaker around
//! the quota ledger not open (`crate::core::readiness`; the group views come from
//! `crate::raft_health`). A refusal names its reason.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::core::readiness::{NotReady, judge};
use crate::metrics::Metrics;
use crate::raft_health::GroupViews;

/// `quotamesh_ledger_circuit_state` of an open circuit (the lease broker publishes it).
const CIRCUIT_OPEN_GAUGE: i64 = 2;

/// What `/readyz` judges.
#[derive(Clone)]
pub struct Readiness {
    /// Set once the node has started, cleared when it begins to shut down.
    pub started: Arc<AtomicBool>,
    /// The node's Raft groups as last watched.
    pub groups: GroupViews,
    /// The node's metrics, for the ledger circuit's state.
    pub metrics: Metrics,
}

impl Readiness {
    fn judge(&self) -> Result<(), NotReady> {
        let circuit_open = self.metrics.ledger_circuit_state.get() == CIRCUIT_OPEN_GAUGE;
        judge(self.started.load(Ordering::Acquire), &self.groups.snapshot(), circuit_open)
    }
}

/// Shared state of the HTTP endpoints.
#[derive(Clone)]
struct Endpoints {
    metrics: Metrics,
    readiness: Readiness,
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
///
/// # Errors
/// The IO error that stopped the server.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readiness_text))
        .with_state(Endpoints { metrics, readiness });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn metrics_text(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        endpoints.metrics.encode(),
    )
}

async fn readiness_text(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    match endpoints.readiness.judge() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
    }
}

/// Binds the HTTP listener.
///
/// # Errors
/// The bind error (address in use, permission).
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

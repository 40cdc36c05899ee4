//! HTTP endpoints for operators: Prometheus `/metrics`, liveness `/healthz` and readiness
//! `/readyz` (ready once the policy is loaded and the gRPC listeners are bound).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Shared state of the HTTP endpoints.
#[derive(Clone)]
struct Endpoints {
    metrics: Metrics,
    ready: Arc<AtomicBool>,
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
///
/// # Errors
/// The IO error that stopped the server.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    ready: Arc<AtomicBool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readiness))
        .with_state(Endpoints { metrics, ready });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn metrics_text(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        endpoints.metrics.encode(),
    )
}

async fn readiness(State(endpoints): State<Endpoints>) -> impl IntoResponse {
    if endpoints.ready.load(Ordering::Acquire) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

/// Binds the HTTP listener.
///
/// # Errors
/// The bind error (address in use, permission).
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

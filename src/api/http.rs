//! HTTP endpoints for operators: Prometheus `/metrics`, liveness `/healthz` (the process
//! answers) and readiness `/readyz`: started, every Raft group it is a member of running
//! with a leader and applied within a bound of its commits, and the circuit breaker around
//! the quota ledger not open (`crate::core::readiness`; the group views come from
//! `crate::raft_health`). A refusal names its reason. `/config` (also `/rlconfig`, as
//! envoyproxy/ratelimit names it) shows the policy the node serves: its digest and files,
//! as text, or JSON with `?format=json` (what `quotamesh policy get` and `quotamesh audit
//! canary` read: with the `[policy]` options the files were read with).
//!
//! The port has no TLS and is open to Prometheus and probes, but the policy files are the
//! operators' business: `/config` asks for an operator token (`Authorization: Bearer`) as the
//! admin API's reads do (`crate::api::operators`), and is open only where those are
//! (`admin.read_open`). Without one it answers 401 saying what to send.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::api::operators::{Access, Operators};
use crate::core::readiness::{NotReady, judge};
use crate::metrics::Metrics;
use crate::policy_store::ServedPolicy;
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
    /// The node's policy, whose version and source `/readyz` reports.
    pub policy: Arc<crate::policy_store::PolicyStore>,
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
    policy: Arc<ArcSwap<ServedPolicy>>,
    operators: Arc<Operators>,
}

/// What the HTTP endpoints serve, besides the metrics.
pub struct Served {
    /// What `/readyz` judges.
    pub readiness: Readiness,
    /// The policy `/config` shows.
    pub policy: Arc<ArcSwap<ServedPolicy>>,
    /// Who may read `/config`: the admin API's operators.
    pub operators: Operators,
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
///
/// # Errors
/// The IO error that stopped the server.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    served: Served,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Served { readiness, policy, operators } = served;
    let operators = Arc::new(operators);
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readiness_text))
        .route("/config", get(config_text))
        .route("/rlconfig", get(config_text))
        .with_state(Endpoints { metrics, readiness, policy, operators });
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
        Ok(()) => (StatusCode::OK, format!("ready\n{}\n", policy_detail(&endpoints.readiness))),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n{}\n", policy_detail(&endpoints.readiness)),
        ),
    }
}

/// The policy line of `/readyz`: the version served and where it comes from, and the
/// region's latest version when the node serves its own files.
fn policy_detail(readiness: &Readiness) -> String {
    let served = readiness.policy.served().load_full();
    let digest = format!("{:016x}", served.digest);
    let region_version = readiness.policy.region_version();
    match served.source {
        crate::policy_store::ServedFrom::Replicated => {
            format!("policy_version {} policy_source replicated digest {digest}", served.version)
        }
        crate::policy_store::ServedFrom::Local => format!(
            "policy_version 0 policy_source local digest {digest} region_policy_version \
             {region_version}"
        ),
    }
}

/// The answer to a `/config` request without a valid operator token.
fn unauthenticated(headers: HeaderMap, operators: &Operators) -> Option<axum::response::Response> {
    let metadata = tonic::metadata::MetadataMap::from_headers(headers);
    let error = operators.authorize(&metadata, None, Access::Read).err()?;
    tracing::warn!(%error, "policy read on the metrics port refused");
    let body = format!(
        "unauthenticated: {error}. /config shows the node's policy files, so it needs an \
         operator token as the admin API's reads do: send `Authorization: Bearer <token>` with \
         a token of [[admin.tokens]] (`quotamesh policy get` sends QUOTAMESH_ADMIN_TOKEN), or \
         set admin.read_open = true\n"
    );
    Some(
        (
            StatusCode::UNAUTHORIZED,
            [
                (header::WWW_AUTHENTICATE, "Bearer"),
                (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            ],
            body,
        )
            .into_response(),
    )
}

async fn config_text(
    State(endpoints): State<Endpoints>,
    uri: Uri,
    headers: HeaderMap,
) -> axum::response::Response {
    if let Some(refusal) = unauthenticated(headers, &endpoints.operators) {
        return refusal;
    }
    let policy = endpoints.policy.load();
    let digest = format!("{:016x}", policy.digest);
    let active_since = crate::core::rfc3339::format_epoch_ms(policy.active_since_ms);
    if uri.query().is_some_and(|query| query.split('&').any(|pair| pair == "format=json")) {
        let files: Vec<serde_json::Value> = policy
            .sources
            .iter()
            .map(|source| serde_json::json!({"name": source.name, "text": source.text}))
            .collect();
        let body = serde_json::json!({
            "digest": digest,
            "rules": policy.rules,
            "version": policy.version,
            "policy_source": policy.source.to_string(),
            "active_since": active_since,
            "active_since_ms": policy.active_since_ms,
            "files": files,
            "merge_domains": policy.options.merge_domains,
            "default_algorithm": policy.options.default_algorithm,
        });
        return ([(header::CONTENT_TYPE, "application/json")], format!("{body}\n")).into_response();
    }
    let mut text = format!(
        "# policy digest {digest}, {} rule(s), {} file(s), active since {active_since}\n\
         # policy_source {}, policy_version {}\n",
        policy.rules,
        policy.sources.len(),
        policy.source,
        policy.version
    );
    for source in &policy.sources {
        text.push_str(&format!("# --- {}\n{}", source.name, source.text));
        if !source.text.ends_with('\n') {
            text.push('\n');
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
}

/// Binds the HTTP listener.
///
/// # Errors
/// The bind error (address in use, permission).
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}

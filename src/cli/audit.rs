//! `quotamesh audit canary`: proves every fail-closed rule of the intended policy still
//! refuses over-quota traffic on every node (DESIGN section 8), against the silent fail-open
//! creep.
//!
//! For each node and each audited rule (`crate::core::canary_audit`): one synthetic
//! over-quota request through the node's RLS port, which must be refused, on a counter no
//! caller shares; and, with the node's `--config-url`, the rule as the node serves it
//! (`/config`), which must not let more through (a rule made fail-open still refuses while
//! the ledger is healthy, so only its configuration shows it). Once, it exits 1 on any
//! failure (cron, CI); with `--every` it runs until stopped and exports
//! `quotamesh_canary_audit_failures_total` and
//! `quotamesh_canary_audit_last_success_timestamp_seconds` on `--metrics-addr` for the
//! alert in `cluster/alerts/`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use prometheus::{Encoder, IntCounter, IntGauge, Registry, TextEncoder};

use crate::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use crate::core::canary_audit::{SyntheticRequest, drift, synthetic_request};
use crate::core::policy::{LoadOptions, PolicySet, parse_duration_ms};
use crate::core::rate::Algorithm;
use crate::policy_store::PolicyOrigin;

/// Shortest `--every`: an audit round sends one request per rule and node.
const EVERY_MS_MIN: u64 = 1_000;

/// Options of `quotamesh audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// What to audit.
    #[command(subcommand)]
    pub command: AuditCommand,
}

/// Audit subcommands.
#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Send a synthetic over-quota request per fail-closed rule through each node's RLS
    /// port, and compare each node's served rules with the intended policy; exit 1 on any
    /// rule admitted or drifted, or any node not answering.
    Canary(CanaryArgs),
}

/// Options of `quotamesh audit canary`.
#[derive(Debug, Args)]
pub struct CanaryArgs {
    /// The intended policy: files or directories, as the nodes load them (e.g. from git).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Read the policy with `[policy] merge_domains = true`.
    #[arg(long)]
    pub merge_domains: bool,
    /// The algorithm of limits that name none, as the nodes' `[policy] default_algorithm`.
    #[arg(long, value_parser = crate::cli::serve::parse_algorithm)]
    pub default_algorithm: Option<Algorithm>,
    /// A node's RLS address; repeat for every node (gateways included).
    #[arg(long = "node", required = true)]
    pub nodes: Vec<String>,
    /// The node's metrics address, whose `/config` shows the rules it serves; repeat once
    /// per `--node`, in the same order. Without it only the requests are checked.
    #[arg(long = "config-url")]
    pub config_urls: Vec<String>,
    /// A file holding the operator token `/config` asks for (else `QUOTAMESH_ADMIN_TOKEN`).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// How long each call may take, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Audit again at this interval until stopped (`10m`, `30s`), exporting metrics.
    #[arg(long)]
    pub every: Option<String>,
    /// Where the `--every` mode serves `/metrics`.
    #[arg(long, default_value = "127.0.0.1:6071")]
    pub metrics_addr: SocketAddr,
}

/// What one round found.
#[derive(Debug, Default)]
struct Round {
    /// Checks that passed.
    passed: u64,
    /// Checks that failed (a rule admitted or drifted, a node not answering).
    failed: u64,
}

/// Runs `quotamesh audit`.
///
/// # Errors
/// An intended policy that does not load, an operator token file that cannot be read, bad
/// options, or (with `--every`) a metrics address that cannot be bound.
pub async fn run(arguments: AuditArgs) -> anyhow::Result<ExitCode> {
    let AuditCommand::Canary(arguments) = arguments.command;
    anyhow::ensure!(
        arguments.config_urls.is_empty() || arguments.config_urls.len() == arguments.nodes.len(),
        "give --config-url once per --node, in the same order, or not at all"
    );
    let options = LoadOptions {
        merge_domains: arguments.merge_domains,
        default_algorithm: arguments.default_algorithm.unwrap_or_default(),
    };
    let intended = load_intended(&arguments.policy, options)?;
    let token = crate::cli::cluster::operator_token(arguments.admin_token_file.as_deref())?;
    let timeout = Duration::from_millis(arguments.timeout_ms);
    let Some(every) = &arguments.every else {
        let round = audit(&intended, &arguments, token.as_deref(), timeout).await;
        return Ok(if round.failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    };
    let every_ms = parse_duration_ms(every).map_err(|error| anyhow::anyhow!("--every: {error}"))?;
    anyhow::ensure!(every_ms >= EVERY_MS_MIN, "--every must be at least 1s");
    let metrics = AuditMetrics::new()?;
    let listener = tokio::net::TcpListener::bind(arguments.metrics_addr)
        .await
        .with_context(|| format!("cannot bind --metrics-addr {}", arguments.metrics_addr))?;
    let served = metrics.clone();
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(move || std::future::ready(served.encode())));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut termination = crate::cli::serve::Termination::install()?;
    let mut ticks = tokio::time::interval(Duration::from_millis(every_ms));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = termination.wait() => break,
            _ = ticks.tick() => {
                let round = audit(&intended, &arguments, token.as_deref(), timeout).await;
                metrics.record(&round);
            }
        }
    }
    server.abort();
    Ok(ExitCode::SUCCESS)
}

/// The intended policy, as the nodes would load it.
fn load_intended(paths: &[PathBuf], options: LoadOptions) -> anyhow::Result<PolicySet> {
    let mut sources = Vec::new();
    for path in paths {
        sources.extend(PolicyOrigin::Path(path.clone()).read_sources()?);
    }
    PolicySet::parse_with(&sources, options)
        .map_err(|errors| anyhow::anyhow!("the intended policy does not load:\n{errors}"))
}

/// One round over every node and rule; prints a line per check and a summary.
async fn audit(
    intended: &PolicySet,
    arguments: &CanaryArgs,
    token: Option<&str>,
    timeout: Duration,
) -> Round {
    let mut round = Round::default();
    let mut not_audited = 0;
    for (index, node) in arguments.nodes.iter().enumerate() {
        let served = match arguments.config_urls.get(index) {
            None => None,
            Some(url) => match served_policy(url, token, timeout).await {
                Ok(served) => Some(served),
                Err(error) => {
                    println!("{node}: FAILED: its served policy: {error:#}");
                    round.failed += 1;
                    None
                }
            },
        };
        let mut client = match connect(node, timeout).await {
            Ok(client) => client,
            Err(error) => {
                println!("{node}: FAILED: {error:#}");
                round.failed += 1;
                continue;
            }
        };
        for rule in intended.rules() {
            let name = format!("{}/{}", rule.domain, rule.path);
            let request = match synthetic_request(rule) {
                Ok(request) => request,
                Err(reason) => {
                    // Once per rule, not per node: it depends on the policy only.
                    if index == 0 && rule.failure_mode == crate::core::policy::FailureMode::Closed {
                        println!("{name}: not audited: {reason}");
                        not_audited += 1;
                    }
                    continue;
                }
            };
            for drifted in served.as_ref().map(|served| drift(rule, served)).unwrap_or_default() {
                println!("{node}: {name}: FAILED: {drifted}");
                round.failed += 1;
            }
            match over_quota_refused(&mut client, &request).await {
                Ok(true) => {
                    println!("{node}: {name}: refused {} hits: ok", request.hits);
                    round.passed += 1;
                }
                Ok(false) => {
                    println!(
                        "{node}: {name}: FAILED: admitted a synthetic request of {} hits, over \
                         its limit",
                        request.hits
                    );
                    round.failed += 1;
                }
                Err(error) => {
                    println!("{node}: {name}: FAILED: {error:#}");
                    round.failed += 1;
                }
            }
        }
    }
    println!(
        "canary audit: {} passed, {} failed, {not_audited} fail-closed rule(s) not audited, {} \
         node(s)",
        round.passed,
        round.failed,
        arguments.nodes.len()
    );
    round
}

async fn connect(
    node: &str,
    timeout: Duration,
) -> anyhow::Result<RateLimitServiceClient<tonic::transport::Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(node.to_owned())
        .with_context(|| format!("{node:?} is not a URL"))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("cannot connect to the RLS port {node}"))?;
    Ok(RateLimitServiceClient::new(channel))
}

/// Whether the node refused `request` (its only descriptor answered OVER_LIMIT).
async fn over_quota_refused(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    request: &SyntheticRequest,
) -> anyhow::Result<bool> {
    let entries = request
        .entries
        .iter()
        .map(|(key, value)| Entry { key: key.clone(), value: value.clone() })
        .collect();
    let call = RateLimitRequest {
        domain: request.domain.clone(),
        descriptors: vec![RateLimitDescriptor { entries, limit: None, hits_addend: None }],
        hits_addend: request.hits,
    };
    let response = client.should_rate_limit(call).await.context("ShouldRateLimit")?.into_inner();
    Ok(response.overall_code() == Code::OverLimit
        && response.statuses.first().is_some_and(|status| status.code() == Code::OverLimit))
}

/// The policy the node at `url` serves, read off the blocking HTTP client's thread.
async fn served_policy(
    url: &str,
    token: Option<&str>,
    timeout: Duration,
) -> anyhow::Result<PolicySet> {
    let (url, token) = (url.to_owned(), token.map(str::to_owned));
    tokio::task::spawn_blocking(move || {
        crate::cli::policy::served_policy(&url, token.as_deref(), timeout).map(|(policy, _)| policy)
    })
    .await
    .context("the /config reader stopped")?
}

/// The metrics of the `--every` mode.
#[derive(Clone)]
struct AuditMetrics {
    registry: Registry,
    failures: IntCounter,
    last_success: IntGauge,
}

impl AuditMetrics {
    fn new() -> anyhow::Result<Self> {
        let registry = Registry::new();
        let failures = IntCounter::new(
            "quotamesh_canary_audit_failures_total",
            "Checks of the canary audit that failed: a fail-closed rule admitted a synthetic \
             over-quota request or drifted from the intended policy, or a node did not answer.",
        )?;
        let last_success = IntGauge::new(
            "quotamesh_canary_audit_last_success_timestamp_seconds",
            "When the last audit round without a failure ended (Unix seconds; 0: none yet).",
        )?;
        registry.register(Box::new(failures.clone()))?;
        registry.register(Box::new(last_success.clone()))?;
        Ok(Self { registry, failures, last_success })
    }

    fn record(&self, round: &Round) {
        self.failures.inc_by(round.failed);
        if round.failed == 0 {
            let now_s = crate::clock::now_ms() / 1_000;
            self.last_success.set(i64::try_from(now_s).unwrap_or(i64::MAX));
        }
    }

    fn encode(&self) -> String {
        let mut buffer = Vec::new();
        // Encoding into a Vec cannot fail: the only errors are IO errors of the writer.
        if TextEncoder::new().encode(&self.registry.gather(), &mut buffer).is_err() {
            return String::new();
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

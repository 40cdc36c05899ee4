//! The `quotamesh` command line: one module per subcommand; `main.rs` only dispatches.

pub mod audit;
pub mod bench;
pub mod bench_ledger;
pub mod billing;
pub mod certs;
pub mod cluster;
pub mod health;
pub mod http_get;
pub mod policy;
pub mod rls;
pub mod serve;

use clap::{Parser, Subcommand};

/// Exit code: done (a billing operation APPROVED, or a replay of an approval).
pub const EXIT_OK: u8 = 0;
/// Exit code: refused or failed, nothing applied; or a check found a problem. (Code 2 is
/// clap's, for a command line it cannot parse.)
pub const EXIT_FAILED: u8 = 1;
/// Exit code: a billing operation committed as INSUFFICIENT_FUNDS (or a replay of one).
pub const EXIT_INSUFFICIENT_FUNDS: u8 = 3;
/// Exit code: the outcome is unknown (UNAVAILABLE, deadline passed): the operation may or
/// may not have applied; retry it with the same idempotency key.
pub const EXIT_UNKNOWN_OUTCOME: u8 = 4;

/// quotamesh: a distributed quota mesh speaking Envoy's Rate Limit Service protocol.
#[derive(Debug, Parser)]
#[command(name = "quotamesh", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "QUOTAMESH_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// Which events to log, as `RUST_LOG` (which it overrides): for example
    /// `warn,quotamesh=debug`. Default: `warn,quotamesh=info`.
    #[arg(long, global = true, env = "QUOTAMESH_LOG_FILTER")]
    pub log_filter: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a node (with no configuration: the embedded single-node default).
    Serve(serve::ServeArgs),
    /// Work with policy files; show the policy a node serves.
    Policy(policy::PolicyArgs),
    /// Talk to a node's Envoy RLS endpoint.
    Rls(rls::RlsArgs),
    /// Form and change the region's quota group, show its status (admin gRPC client).
    Cluster(cluster::ClusterArgs),
    /// Talk to a node's billing-debit API (operations, balances, audit, verify).
    Billing(billing::BillingArgs),
    /// Prove the nodes enforce what the policy intends (`audit canary`: every fail-closed
    /// rule refuses a synthetic over-quota request and is served as written).
    Audit(audit::AuditArgs),
    /// Ask a node's `/readyz` (or another URL) and exit 0 when it answers 200: a container
    /// HEALTHCHECK without curl.
    Health(health::HealthArgs),
    /// Helpers for load tests (request bodies for h2load, a constant-OK ceiling server).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

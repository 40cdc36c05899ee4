//! The `quotamesh` command line: one module per subcommand; `main.rs` only dispatches.

pub mod bench;
pub mod bench_ledger;
pub mod billing;
pub mod certs;
pub mod cluster;
pub mod policy;
pub mod rls;
pub mod serve;

use clap::{Parser, Subcommand};

/// quotamesh: a distributed quota mesh speaking Envoy's Rate Limit Service protocol.
#[derive(Debug, Parser)]
#[command(name = "quotamesh", version, about, propagate_version = true)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "QUOTAMESH_LOG_FORMAT")]
    pub log_format: LogFormat,
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
    /// Work with policy files.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// Talk to a node's Envoy RLS endpoint.
    #[command(subcommand)]
    Rls(rls::RlsCommand),
    /// Form and change the region's quota group, show its status (admin gRPC client).
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// Talk to a node's billing-debit API (operations, balances, audit, verify).
    Billing(billing::BillingArgs),
    /// Helpers for load tests (request bodies for h2load, a constant-OK ceiling server).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

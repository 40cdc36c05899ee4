//! `quotamesh serve`: runs a node until SIGTERM or Ctrl-C.
//!
//! Settings come from the TOML file, then `QUOTAMESH_*` variables, then flags: a flag beats
//! a variable beats the file (clap reads flag and variable; the file fills the rest).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::config::{NodeConfig, PeerConfig, Role, parse_peer, parse_role};
use crate::core::ledger::NodeId;
use crate::core::rate::Algorithm;
use crate::node::Node;

/// Flags of `quotamesh serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Node configuration file (TOML).
    #[arg(long, env = "QUOTAMESH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Envoy RLS v3 gRPC listen address [default: 0.0.0.0:8081].
    #[arg(long, env = "QUOTAMESH_RLS_ADDR")]
    pub rls_addr: Option<SocketAddr>,
    /// Prometheus and health HTTP listen address [default: 0.0.0.0:6070].
    #[arg(long, env = "QUOTAMESH_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Billing-debit gRPC listen address [default: 0.0.0.0:8082].
    #[arg(long, env = "QUOTAMESH_BILLING_ADDR")]
    pub billing_addr: Option<SocketAddr>,
    /// Data directory [default: ./quotamesh-data].
    #[arg(long, env = "QUOTAMESH_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Policy file or directory of policy files [default: the embedded example].
    #[arg(long, env = "QUOTAMESH_POLICY")]
    pub policy: Option<PathBuf>,
    /// The algorithm of limits that name none: token_bucket, fixed_window (counts as
    /// envoyproxy/ratelimit) or sliding_window [default: token_bucket].
    #[arg(long, env = "QUOTAMESH_DEFAULT_ALGORITHM", value_parser = parse_algorithm)]
    pub default_algorithm: Option<Algorithm>,
    /// Let several policy files declare one domain and merge them (envoyproxy/ratelimit's
    /// MERGE_DOMAIN_CONFIG) [default: false].
    #[arg(long, env = "QUOTAMESH_MERGE_DOMAINS")]
    pub merge_domains: Option<bool>,
    /// Append each request a shadow rule would have refused to this file as a JSON line
    /// (`quotamesh policy shadow-report` reads it).
    #[arg(long, env = "QUOTAMESH_SHADOW_EVENTS_FILE")]
    pub shadow_events_file: Option<PathBuf>,
    /// This node's id.
    #[arg(long, env = "QUOTAMESH_NODE_ID")]
    pub node_id: Option<String>,
    /// Raft peer gRPC listen address [default: 0.0.0.0:8084].
    #[arg(long, env = "QUOTAMESH_RAFT_ADDR")]
    pub raft_addr: Option<SocketAddr>,
    /// Admin gRPC listen address [default: 0.0.0.0:8083].
    #[arg(long, env = "QUOTAMESH_ADMIN_ADDR")]
    pub admin_addr: Option<SocketAddr>,
    /// QUIC (UDP) listen address for the other regions [default: 127.0.0.1:8443].
    #[arg(long, env = "QUOTAMESH_QUIC_ADDR")]
    pub quic_addr: Option<SocketAddr>,
    /// This node's Raft id, at least 1 [default: 1].
    #[arg(long, env = "QUOTAMESH_RAFT_NODE_ID")]
    pub raft_node_id: Option<u64>,
    /// The region's cluster id, stored in the data directory on first start [default: local].
    #[arg(long, env = "QUOTAMESH_CLUSTER_ID")]
    pub cluster_id: Option<String>,
    /// `voter` (a member of the region's Raft groups) or `gateway` (leases only, through
    /// the voters in `--peers`) [default: voter].
    #[arg(long, env = "QUOTAMESH_ROLE", value_parser = parse_role)]
    pub role: Option<Role>,
    /// The region's voters as ID=HOST:PORT, comma-separated or repeated; replaces the file's
    /// `[[peers]]` [default: none, a single-node region].
    #[arg(long, env = "QUOTAMESH_PEERS", value_delimiter = ',', value_parser = parse_peer)]
    pub peers: Vec<PeerConfig>,
    /// A fixed deadline by which a ledger call is judged slow [default: 4 x the ledger's
    /// measured p90, or the file's `leasing.ledger_timeout_ms`].
    #[arg(long, env = "QUOTAMESH_LEDGER_TIMEOUT_MS")]
    pub ledger_timeout_ms: Option<u64>,
}

impl ServeArgs {
    /// The configuration after layering file, variables and flags.
    ///
    /// # Errors
    /// When the configuration file cannot be read or parsed.
    pub fn resolve(&self) -> anyhow::Result<NodeConfig> {
        let mut config = match &self.config {
            Some(path) => NodeConfig::from_file(path)?,
            None => NodeConfig::default(),
        };
        if let Some(address) = self.rls_addr {
            config.rls_addr = address;
        }
        if let Some(address) = self.metrics_addr {
            config.metrics_addr = address;
        }
        if let Some(address) = self.billing_addr {
            config.billing_addr = address;
        }
        if let Some(directory) = &self.data_dir {
            config.data_dir.clone_from(directory);
        }
        if let Some(policy) = &self.policy {
            config.policy.path = Some(policy.clone());
        }
        if let Some(algorithm) = self.default_algorithm {
            config.policy.default_algorithm = algorithm;
        }
        if let Some(merge) = self.merge_domains {
            config.policy.merge_domains = merge;
        }
        if let Some(file) = &self.shadow_events_file {
            config.policy.shadow_events_file = Some(file.clone());
        }
        if let Some(node_id) = &self.node_id {
            config.node_id.clone_from(node_id);
        }
        if let Some(address) = self.raft_addr {
            config.raft_addr = address;
        }
        if let Some(address) = self.admin_addr {
            config.admin_addr = address;
        }
        if let Some(address) = self.quic_addr {
            config.quic_addr = address;
        }
        if let Some(id) = self.raft_node_id {
            config.raft_node_id = NodeId(id);
        }
        if let Some(cluster_id) = &self.cluster_id {
            config.cluster_id.clone_from(cluster_id);
        }
        if let Some(role) = self.role {
            config.role = role;
        }
        if !self.peers.is_empty() {
            config.peers.clone_from(&self.peers);
        }
        if let Some(timeout_ms) = self.ledger_timeout_ms {
            config.leasing.ledger_timeout_ms = Some(timeout_ms);
        }
        Ok(config)
    }
}

/// Runs the node until a termination signal, then shuts it down in order.
///
/// # Errors
/// When the configuration is invalid or the node cannot start.
pub async fn run(arguments: ServeArgs) -> anyhow::Result<()> {
    let config = arguments.resolve()?;
    // The handlers are in place before the node starts: a SIGTERM while it starts (a
    // supervisor stopping a node that just became ready) ends in the same orderly shutdown
    // once the start is done, instead of the signal's default, an abrupt exit.
    let mut termination = Termination::install()?;
    let node = Node::start(config).await.context("cannot start the node")?;
    let failure = tokio::select! {
        () = termination.wait() => None,
        failure = node.failed() => Some(failure),
    };
    match failure {
        None => {
            tracing::info!("shutting down");
            node.shutdown().await;
            Ok(())
        }
        Some(failure) => {
            // Crash-only: the group cannot come back in this process; its supervisor
            // restarts the node from the durable log and snapshot (crate::raft_health).
            tracing::error!(%failure, "shutting down to restart from durable state");
            if tokio::time::timeout(FAILED_SHUTDOWN_TIMEOUT, node.shutdown()).await.is_err() {
                tracing::error!("the node did not stop within {FAILED_SHUTDOWN_TIMEOUT:?}");
            }
            anyhow::bail!("{failure}")
        }
    }
}

/// Longest the shutdown after a group failure may take before the process exits anyway.
const FAILED_SHUTDOWN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// SIGTERM and SIGINT (Ctrl-C), caught from the moment they are installed.
pub(crate) struct Termination {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl Termination {
    pub(crate) fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            terminate: signal(SignalKind::terminate())
                .context("cannot install the SIGTERM handler")?,
            interrupt: signal(SignalKind::interrupt())
                .context("cannot install the SIGINT handler")?,
        })
    }

    /// Returns when either signal has come (at once if one came since `install`).
    pub(crate) async fn wait(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

/// A `--default-algorithm` value, named as in policy files.
pub(crate) fn parse_algorithm(text: &str) -> Result<Algorithm, String> {
    match text {
        "token_bucket" => Ok(Algorithm::TokenBucket),
        "fixed_window" => Ok(Algorithm::FixedWindow),
        "sliding_window" => Ok(Algorithm::SlidingWindow),
        other => Err(format!(
            "unknown algorithm `{other}`; expected token_bucket, fixed_window or sliding_window"
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        serve: ServeArgs,
    }

    /// Flags replace what the file says, field by field; peers are replaced as a whole.
    #[test]
    fn flags_beat_the_file() -> anyhow::Result<()> {
        let directory = tempfile::tempdir()?;
        let path = directory.path().join("node.toml");
        std::fs::write(
            &path,
            "raft_node_id = 1\nraft_addr = \"127.0.0.1:9000\"\ncluster_id = \"file\"\n\
             insecure_cluster = true\n[[peers]]\nid = 1\nraft_addr = \"127.0.0.1:9000\"\n",
        )?;
        let path = path.display().to_string();
        let parsed = Wrapper::try_parse_from([
            "serve",
            "--config",
            &path,
            "--raft-addr",
            "127.0.0.2:9001",
            "--raft-node-id",
            "2",
            "--peers",
            "1=127.0.0.1:9000,2=127.0.0.2:9001",
            "--quic-addr",
            "127.0.0.2:9443",
        ])?;
        let config = parsed.serve.resolve()?;
        assert_eq!(config.raft_addr.to_string(), "127.0.0.2:9001");
        assert_eq!(config.quic_addr.to_string(), "127.0.0.2:9443");
        assert_eq!(config.raft_node_id, NodeId(2));
        assert_eq!(config.cluster_id, "file", "the file fills what no flag names");
        assert_eq!(config.peers.len(), 2);
        assert!(config.validate().is_ok());
        assert_eq!(config.raft_advertise_addr(), "127.0.0.2:9001");
        Ok(())
    }

    /// The role comes from the file unless a flag names it; a gateway given by flag with
    /// the voters as peers validates, and an unknown role is refused by the parser.
    #[test]
    fn role_flag_beats_the_file() -> anyhow::Result<()> {
        let directory = tempfile::tempdir()?;
        let path = directory.path().join("node.toml");
        std::fs::write(&path, "role = \"voter\"\nraft_node_id = 4\ninsecure_cluster = true\n")?;
        let path = path.display().to_string();
        let parsed = Wrapper::try_parse_from([
            "serve",
            "--config",
            &path,
            "--role",
            "gateway",
            "--peers",
            "1=127.0.0.1:9000,2=127.0.0.2:9000,3=127.0.0.3:9000",
        ])?;
        let config = parsed.serve.resolve()?;
        assert_eq!(config.role, Role::Gateway);
        assert!(config.validate().is_ok(), "{:?}", config.validate());
        let unflagged = Wrapper::try_parse_from(["serve", "--config", &path])?;
        assert_eq!(unflagged.serve.resolve()?.role, Role::Voter, "the file's role");
        let error = Wrapper::try_parse_from(["serve", "--role", "observer"])
            .expect_err("unknown role")
            .to_string();
        assert!(error.contains("observer") && error.contains("gateway"), "{error}");
        Ok(())
    }
}

//! `quotamesh cluster certs init|issue|issue-operator`: the cluster's certificate authority
//! and the certificates it issues (`crate::tls::authority`), written as PEM files.
//!
//! ```text
//!  certs init --cluster-id region-a --out certs        certs/ca.pem, certs/ca.key
//!  certs issue --ca certs --node-id 1 --region eu-1 --san 10.0.0.1 --san node-1.internal
//!                                                       certs/node-1.pem, certs/node-1.key
//!  certs issue --ca certs --node-id 4 --region eu-1 --san 10.0.0.4 --gateway
//!                                                       a gateway's: leases for itself only
//!  certs issue-operator --ca certs --name alice         certs/operator-alice.pem, .key
//! ```
//!
//! A node needs `ca.pem` (its trust bundle), its own certificate and its own key; `ca.key`
//! stays with the operator. Files are never overwritten; keys are owner-only.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use crate::core::ledger::NodeId;
use crate::tls::authority::{
    Authority, CA_VALID_DAYS_DEFAULT, Issued, LEAF_VALID_DAYS_DEFAULT, write_new,
};

/// Certificate subcommands.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Make a new CA for a cluster: `ca.pem` (give it to every node) and `ca.key` (keep it).
    Init {
        /// Directory to write into (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// The cluster's `cluster_id`; nodes accept only certificates naming it.
        #[arg(long)]
        cluster_id: String,
        /// Validity in days.
        #[arg(long, default_value_t = CA_VALID_DAYS_DEFAULT)]
        valid_days: u32,
    },
    /// Issue a node's certificate, naming its cluster, region and Raft node id, valid as
    /// server and client for the hosts its peers dial.
    Issue {
        /// The CA directory (`ca.pem`, `ca.key`).
        #[arg(long)]
        ca: PathBuf,
        /// The node's `raft_node_id`.
        #[arg(long)]
        node_id: u64,
        /// The node's region.
        #[arg(long)]
        region: String,
        /// A host name or IP address the other nodes reach it at (its `[[peers]]`
        /// `raft_addr` host); repeat for several.
        #[arg(long = "san", required = true)]
        sans: Vec<String>,
        /// Directory to write `node-<id>.pem` and `node-<id>.key` into (default: the CA's).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Validity in days.
        #[arg(long, default_value_t = LEAF_VALID_DAYS_DEFAULT)]
        valid_days: u32,
        /// A gateway's certificate (`role = "gateway"`): it may lease for itself, but never
        /// send Raft messages or propose anything else.
        #[arg(long)]
        gateway: bool,
    },
    /// Issue an operator's client certificate (`operator-<name>.pem` and `.key`).
    IssueOperator {
        /// The CA directory (`ca.pem`, `ca.key`).
        #[arg(long)]
        ca: PathBuf,
        /// The operator's name.
        #[arg(long)]
        name: String,
        /// Directory to write into (default: the CA's).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Validity in days.
        #[arg(long, default_value_t = LEAF_VALID_DAYS_DEFAULT)]
        valid_days: u32,
    },
}

/// Runs a certificate subcommand.
///
/// # Errors
/// When a file cannot be read or written (existing files are never overwritten), or an
/// argument is invalid.
pub fn run(command: CertsCommand) -> anyhow::Result<()> {
    let now_ms = crate::clock::now_ms();
    match command {
        CertsCommand::Init { out, cluster_id, valid_days } => {
            std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
            let authority = Authority::generate(&cluster_id, now_ms, valid_days)?;
            authority.save(&out)?;
            println!("CA of cluster {cluster_id:?} written to {}", out.display());
        }
        CertsCommand::Issue { ca, node_id, region, sans, out, valid_days, gateway } => {
            let authority = Authority::load(&ca)?;
            let node = NodeId(node_id);
            let issued = if gateway {
                authority.issue_gateway(&region, node, &sans, now_ms, valid_days)?
            } else {
                authority.issue_node(&region, node, &sans, now_ms, valid_days)?
            };
            let written =
                write_pair(out.as_ref().unwrap_or(&ca), &format!("node-{node_id}"), &issued)?;
            println!(
                "certificate of node {node_id} (region {region}, cluster {}) written to {written}",
                authority.cluster_id()
            );
        }
        CertsCommand::IssueOperator { ca, name, out, valid_days } => {
            let authority = Authority::load(&ca)?;
            let issued = authority.issue_operator(&name, now_ms, valid_days)?;
            let written =
                write_pair(out.as_ref().unwrap_or(&ca), &format!("operator-{name}"), &issued)?;
            println!("certificate of operator {name} written to {written}");
        }
    }
    Ok(())
}

/// Writes `<stem>.pem` and `<stem>.key` into `directory`; returns the certificate's path.
fn write_pair(directory: &std::path::Path, stem: &str, issued: &Issued) -> anyhow::Result<String> {
    std::fs::create_dir_all(directory)
        .with_context(|| format!("create {}", directory.display()))?;
    let cert = directory.join(format!("{stem}.pem"));
    write_new(&cert, &issued.cert_pem, false)?;
    write_new(&directory.join(format!("{stem}.key")), &issued.key_pem, true)?;
    Ok(cert.display().to_string())
}

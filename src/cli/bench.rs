//! `quotamesh bench`: helpers for load tests with external tools such as h2load.
//!
//! - `encode-request` writes a ShouldRateLimit request as a gRPC body (5-byte frame header
//!   plus protobuf), for `h2load -d`.
//! - `constant-ok` serves an RLS that answers OK without deciding anything: the ceiling any
//!   RLS can reach on the same machine with the same gRPC stack, measured beside a real node.
//! - `ledger`: committed lease grants of a real loopback region (`super::bench_ledger`).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use prost::Message;
use tonic::{Request, Response, Status};

use crate::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use crate::api::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// Benchmark helpers.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Write a ShouldRateLimit request as a gRPC-framed body.
    EncodeRequest {
        /// The request's domain.
        #[arg(long)]
        domain: String,
        /// A descriptor entry `key=value`; repeat for a nested descriptor.
        #[arg(long = "entry", required = true)]
        entries: Vec<String>,
        /// Where to write the body.
        #[arg(long)]
        out: PathBuf,
    },
    /// Serve an RLS that always answers OK (the throughput ceiling).
    ConstantOk {
        /// Listen address.
        #[arg(long, default_value = "127.0.0.1:8091")]
        rls_addr: SocketAddr,
        /// Serve from a single-threaded runtime on a thread of its own, as a node serves its
        /// RLS port (`rls_threads` of 1), instead of the multi-threaded runtime.
        #[arg(long)]
        single_thread: bool,
    },
    /// Committed AcquireLeases batches and grants per second, commit latency and bytes
    /// written per grant, on a loopback region of real nodes against a single node.
    Ledger(super::bench_ledger::LedgerBenchArgs),
}

/// Runs a bench subcommand.
///
/// # Errors
/// When the file cannot be written or the server cannot listen.
pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::EncodeRequest { domain, entries, out } => {
            let entries = entries
                .iter()
                .map(|entry| {
                    let (key, value) = entry.split_once('=').context("an entry is key=value")?;
                    Ok(Entry { key: key.to_owned(), value: value.to_owned() })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            let request = RateLimitRequest {
                domain,
                descriptors: vec![RateLimitDescriptor { entries, limit: None, hits_addend: None }],
                hits_addend: 0,
            };
            let message = request.encode_to_vec();
            let mut body = Vec::with_capacity(message.len() + 5);
            body.push(0); // not compressed
            body.extend_from_slice(&u32::try_from(message.len())?.to_be_bytes());
            body.extend_from_slice(&message);
            std::fs::write(&out, body)
                .with_context(|| format!("cannot write {}", out.display()))?;
            Ok(())
        }
        BenchCommand::Ledger(arguments) => super::bench_ledger::run(arguments).await,
        BenchCommand::ConstantOk { rls_addr, single_thread } if single_thread => {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let thread = std::thread::Builder::new()
                .name("constant-ok".to_owned())
                .spawn(move || runtime.block_on(serve_constant_ok(rls_addr)))?;
            tokio::task::spawn_blocking(move || thread.join())
                .await?
                .map_err(|_| anyhow::anyhow!("the serving thread panicked"))?
        }
        BenchCommand::ConstantOk { rls_addr, .. } => serve_constant_ok(rls_addr).await,
    }
}

/// Serves [`ConstantOk`] on `rls_addr` until Ctrl-C.
async fn serve_constant_ok(rls_addr: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(rls_addr).await?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tracing::info!(%rls_addr, "constant-OK RLS serving");
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(ConstantOk))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// Answers OK with one OK status per descriptor, deciding nothing.
struct ConstantOk;

#[tonic::async_trait]
impl RateLimitService for ConstantOk {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus { code: Code::Ok.into(), ..Default::default() })
            .collect();
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses,
            ..Default::default()
        }))
    }
}

//! `quotamesh rls ask`: sends one ShouldRateLimit request to a node and prints the answer,
//! as lines or, with `--json`, one JSON document, for operators checking a policy and for
//! smoke tests.

use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use crate::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use crate::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use crate::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

/// How long `ask` waits for the connection and for the answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Options of `quotamesh rls`, accepted before or after the subcommand (`global`).
#[derive(Debug, Args)]
pub struct RlsArgs {
    /// The node's RLS address.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8081")]
    pub addr: String,
    /// Print JSON instead of lines.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: RlsCommand,
}

/// RLS client subcommands.
#[derive(Debug, Subcommand)]
pub enum RlsCommand {
    /// Ask a node whether one descriptor is rate limited (this consumes a hit).
    Ask {
        /// The request's domain.
        #[arg(long)]
        domain: String,
        /// A descriptor entry `key=value`; repeat for a nested descriptor.
        #[arg(long = "entry", required = true)]
        entries: Vec<String>,
        /// Hits this request adds (0 means 1).
        #[arg(long, default_value_t = 0)]
        hits: u32,
    },
}

/// Runs an RLS client subcommand.
///
/// # Errors
/// When an entry is malformed, the node cannot be reached in time, or it answers an error.
pub async fn run(arguments: RlsArgs) -> anyhow::Result<()> {
    let RlsArgs { addr, json, command: RlsCommand::Ask { domain, entries, hits } } = arguments;
    let entries = entries
        .iter()
        .map(|entry| {
            let (key, value) =
                entry.split_once('=').with_context(|| format!("{entry:?} is not key=value"))?;
            Ok(Entry { key: key.to_owned(), value: value.to_owned() })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let channel = tonic::transport::Endpoint::from_shared(addr.clone())?
        .connect_timeout(ASK_TIMEOUT)
        .timeout(ASK_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    let request = RateLimitRequest {
        domain,
        descriptors: vec![RateLimitDescriptor { entries, limit: None, hits_addend: None }],
        hits_addend: hits,
    };
    let response =
        RateLimitServiceClient::new(channel).should_rate_limit(request).await?.into_inner();
    let code_name = |code: i32| Code::try_from(code).map_or("UNKNOWN", |code| code.as_str_name());
    let statuses: Vec<serde_json::Value> = response
        .statuses
        .iter()
        .map(|status| {
            serde_json::json!({
                "code": code_name(status.code),
                "limit": status.current_limit.as_ref().map(|limit| serde_json::json!({
                    "name": limit.name,
                    "requests_per_unit": limit.requests_per_unit,
                    "unit": limit.unit().as_str_name(),
                })),
                "limit_remaining": status.limit_remaining,
                "duration_until_reset_ms": status.duration_until_reset.map(|duration| {
                    duration.seconds.saturating_mul(1000).saturating_add(i64::from(duration.nanos / 1_000_000))
                }),
            })
        })
        .collect();
    let headers: serde_json::Map<String, serde_json::Value> = response
        .response_headers_to_add
        .iter()
        .map(|header| (header.key.clone(), serde_json::Value::from(header.value.clone())))
        .collect();
    if json {
        let answer = serde_json::json!({
            "overall_code": code_name(response.overall_code),
            "statuses": statuses,
            "headers": headers,
        });
        println!("{}", serde_json::to_string_pretty(&answer)?);
        return Ok(());
    }
    println!("{}", code_name(response.overall_code));
    for status in &response.statuses {
        let limit = status.current_limit.as_ref().map_or_else(
            || "no limit applies".to_owned(),
            |limit| {
                let name =
                    if limit.name.is_empty() { String::new() } else { format!("{} ", limit.name) };
                format!("limit {name}{}/{}", limit.requests_per_unit, limit.unit().as_str_name())
            },
        );
        let reset = status.duration_until_reset.map_or_else(String::new, |duration| {
            format!(", resets in {}.{:03} s", duration.seconds, duration.nanos / 1_000_000)
        });
        println!(
            "  {}: {limit}, {} remaining{reset}",
            code_name(status.code),
            status.limit_remaining
        );
    }
    for header in &response.response_headers_to_add {
        println!("  {}: {}", header.key, header.value);
    }
    Ok(())
}

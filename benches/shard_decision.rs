//! Latency of one rate-limit decision in process, without gRPC: through the shard set
//! (a key paid from its leased balance, a key the ledger blocked, and the same key paid
//! from the local fallback bucket while the ledger is unreachable, which is the decision
//! the node made before leasing: a bucket under a stripe lock), and through the whole RLS
//! handler (validation, policy match, decision, response with headers).
//!
//! The leases come from a real single-node quota group on disk. Prints p50, p99 and p999
//! in ns, and the leased decision's p99 as a ratio of the local one in the same run. Each
//! sample times a batch of calls, so the cost of reading the clock is spread over the
//! batch. Run: `cargo bench --bench shard_decision`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use quotamesh::actors::shard::{Probe, ShardSet};
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::api::rls::RlsService;
use quotamesh::core::headers::HeaderOptions;
use quotamesh::core::lease::LeaseTuning;
use quotamesh::core::policy::FailureMode;
use quotamesh::core::policy::{PolicySet, PolicySource};
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::metrics::Metrics;

mod support;

const BATCH: usize = 16;
const SAMPLES: usize = 100_000;

/// Prints the percentiles; returns the p99.
fn percentiles(name: &str, mut samples_ns: Vec<f64>) -> f64 {
    samples_ns.sort_by(f64::total_cmp);
    let at = |quantile: f64| samples_ns[((samples_ns.len() as f64 - 1.0) * quantile) as usize];
    println!(
        "{name:<52} p50 {:>8.0} ns   p99 {:>8.0} ns   p999 {:>8.0} ns",
        at(0.50),
        at(0.99),
        at(0.999)
    );
    at(0.99)
}

/// A probe for one descriptor `api_key=value` of domain `bench` under `spec`.
fn probe<'p>(
    shards: &ShardSet,
    value: &'p str,
    spec: &'p LimitSpec,
    lease: &'p LeaseTuning,
) -> [Probe<'p>; 1] {
    support::probe(shards, "bench", ("api_key", value), spec, lease, FailureMode::Open, 1)
}

async fn measure<F: AsyncFnMut()>(name: &str, mut call: F) -> f64 {
    for _ in 0..10_000 {
        call().await;
    }
    let mut samples_ns = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        for _ in 0..BATCH {
            call().await;
        }
        samples_ns.push(started.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    percentiles(name, samples_ns)
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let metrics = Metrics::new();
        let ledger = support::ledger(true).await?;
        // The node's defaults: calls judged by the ledger's measured latency (the bypass
        // count below says whether a run paid from the fallback).
        let shards = Arc::new(
            support::shard_set(&ledger, support::Setup::default(), support::no_policy(), &metrics)
                .await?,
        );
        // A hot key: the largest leases and the longest TTL, so the refill asked at the
        // watermark arrives long before the balance runs out even at millions per second.
        // The lease is that large from the first one (min = max): sized by the rate
        // estimate, it would start at the minimum and be refilled too late for a 5 ms
        // ledger timeout on a busy machine, until the estimate caught up.
        let hot_lease = LeaseTuning::with_sizes(1_000_000, 1_000_000, 500)?;
        let roomy = LimitSpec::new(Algorithm::TokenBucket, 1_000_000_000_000, 1000, None)?;
        let hot = probe(&shards, "hot", &roomy, &hot_lease);
        // The first lease, from a ledger that has just started, may come later than the
        // ledger timeout (the decision is then paid from the fallback): wait for it.
        let leased = tokio::time::Instant::now() + Duration::from_secs(60);
        while shards.decide(&hot, quotamesh::clock::now_ms()).await?.bypass.is_some() {
            anyhow::ensure!(tokio::time::Instant::now() < leased, "the hot key was never leased");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let default_lease = LeaseTuning::default();
        let leased_p99 = measure("shard decision, leased balance, admitted", async || {
            let decision = shards.decide(&hot, quotamesh::clock::now_ms()).await.expect("decides");
            assert!(decision.admitted);
        })
        .await;
        // On a loaded machine a lease can miss the 5 ms ledger timeout (the first one, before
        // the lease size has grown with the traffic): those decisions were bypasses.
        let bypassed: u64 = ["ledger_timeout", "circuit_open", "overloaded"]
            .iter()
            .map(|reason| metrics.rate_limit_bypassed.with_label_values(&[reason]).get())
            .sum();
        println!("  of which paid from the fallback (ledger too slow): {bypassed}");

        let tight = LimitSpec::new(Algorithm::TokenBucket, 1, 3_600_000, None)?;
        let blocked = probe(&shards, "blocked", &tight, &default_lease);
        shards.decide(&blocked, quotamesh::clock::now_ms()).await?;
        measure("shard decision, blocked by the ledger, rejected", async || {
            let decision =
                shards.decide(&blocked, quotamesh::clock::now_ms()).await.expect("decides");
            assert!(!decision.admitted);
        })
        .await;

        // The same hot key on a node whose ledger never answers: once the circuit is open,
        // every decision is the local bucket's.
        let unreachable = support::ledger(false).await?;
        let local =
            support::shard_set(&unreachable, support::Setup::default(), support::no_policy(), &metrics).await?;
        let local_hot = probe(&local, "hot", &roomy, &hot_lease);
        let opened = tokio::time::Instant::now() + Duration::from_secs(10);
        while local.decide(&local_hot, quotamesh::clock::now_ms()).await?.bypass
            != Some(quotamesh::core::admission::BypassReason::CircuitOpen)
        {
            anyhow::ensure!(tokio::time::Instant::now() < opened, "the circuit never opened");
        }
        let local_p99 = measure("shard decision, local fallback bucket, admitted", async || {
            let decision = local.decide(&local_hot, quotamesh::clock::now_ms()).await.expect("decides");
            assert!(decision.admitted);
        })
        .await;
        println!("leased / local decision p99: x{:.2}", leased_p99 / local_p99);

        let policy = PolicySet::parse(&[PolicySource {
            name: "bench.yaml".to_owned(),
            text: "domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n    lease: {min_tokens: 1000, max_tokens: 1000000, lookahead: 500ms}\n".to_owned(),
        }])
        .map_err(|errors| anyhow::anyhow!("{errors}"))?;
        let headers = HeaderOptions { ietf_draft10: true, legacy: true, retry_after: true };
        let service = RlsService::new(Arc::clone(&shards), Arc::new(ArcSwap::from_pointee(policy)), metrics, headers);
        let request = RateLimitRequest {
            domain: "bench".to_owned(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry { key: "api_key".to_owned(), value: "alice".to_owned() }],
                limit: None,
                hits_addend: None,
            }],
            hits_addend: 0,
        };
        measure("RLS handler (validate, match, decide, build the answer)", async || {
            let response =
                service.decide(&request, quotamesh::clock::now_ms()).await.expect("decides");
            assert_eq!(response.overall_code, Code::Ok);
        })
        .await;
        anyhow::Ok(())
    })
}

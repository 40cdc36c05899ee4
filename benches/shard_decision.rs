//! Latency of one rate-limit decision in process, without gRPC: through the shard set
//! (a key the shard has seen, and a key that is over its limit), and through the whole RLS
//! handler (validation, policy match, decision, response with headers).
//!
//! Prints p50, p99 and p999 in ns. Each sample times a batch of calls, so the cost of
//! reading the clock is spread over the batch. Run: `cargo bench --bench shard_decision`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use quotamesh::actors::shard::{Probe, ShardSet, ShardSetOptions};
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use quotamesh::api::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use quotamesh::api::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use quotamesh::api::rls::RlsService;
use quotamesh::core::headers::HeaderOptions;
use quotamesh::core::policy::{PolicySet, PolicySource};
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::metrics::Metrics;

const BATCH: usize = 16;
const SAMPLES: usize = 100_000;

fn percentiles(name: &str, mut samples_ns: Vec<f64>) {
    samples_ns.sort_by(f64::total_cmp);
    let at = |quantile: f64| samples_ns[((samples_ns.len() as f64 - 1.0) * quantile) as usize];
    println!(
        "{name:<44} p50 {:>8.0} ns   p99 {:>8.0} ns   p999 {:>8.0} ns",
        at(0.50),
        at(0.99),
        at(0.999)
    );
}

async fn measure<F: AsyncFnMut()>(name: &str, mut call: F) {
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
    percentiles(name, samples_ns);
}

fn main() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let metrics = Metrics::new();
        let options = ShardSetOptions {
            shard_count: 2,
            keys_per_shard_max: 1_000_000,
            sweep_interval: Duration::from_secs(1),
        };
        let shards = Arc::new(ShardSet::start(options, &metrics).await?);
        let now_ms = quotamesh::clock::now_ms();

        let roomy = LimitSpec::new(Algorithm::TokenBucket, 1_000_000_000_000, 1000, None)?;
        let hash = shards.hash_descriptor("bench", [("api_key", "hot")].into_iter());
        let probe = [Probe {
            stripe: shards.stripe_of(&hash),
            counters: smallvec::smallvec![(shards.counter_of(&hash, 0, &roomy), &roomy)],
            hits: 1,
            enforced: true,
        }];
        measure("shard decision, existing key, admitted", async || {
            let decision = shards.decide(&probe, now_ms).await.expect("decides");
            assert!(decision.admitted);
        })
        .await;

        let tight = LimitSpec::new(Algorithm::TokenBucket, 1, 3_600_000, None)?;
        let hash = shards.hash_descriptor("bench", [("api_key", "blocked")].into_iter());
        let probe = [Probe {
            stripe: shards.stripe_of(&hash),
            counters: smallvec::smallvec![(shards.counter_of(&hash, 0, &tight), &tight)],
            hits: 1,
            enforced: true,
        }];
        shards.decide(&probe, now_ms).await?;
        measure("shard decision, blocked key, rejected", async || {
            let decision = shards.decide(&probe, now_ms).await.expect("decides");
            assert!(!decision.admitted);
        })
        .await;

        let policy = PolicySet::parse(&[PolicySource {
            name: "bench.yaml".to_owned(),
            text: "domain: bench\ndescriptors:\n  - key: api_key\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n".to_owned(),
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
        measure("RLS handler (validate, match, decide, encode)", async || {
            let response = service.decide(&request, now_ms).await.expect("decides");
            assert_eq!(response.overall_code, 1);
        })
        .await;
        anyhow::Ok(())
    })
}

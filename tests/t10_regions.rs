//! Two regions of one cluster, one voter each, linked by QUIC under the cluster's CA
//! (`[[regions]]`): a global limit shared 50/50, all traffic on one region, and the
//! rebalancer moves the other region's idle tokens to it; the sum of both slices plus the
//! tokens in flight stays the global limit, and the hot region's admitted rate rises past
//! its policy slice.
//!
//! One voter per region: three each would be six processes on a 2-core machine that also
//! runs the CPU hog; the rebalancer runs on each quota group's leader alike. The rebalancer
//! runs its shipped defaults (80 % of a slice within a 20 s window, a look each second).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, ClusterOptions};
use common::{CpuHog, descriptor, free_port_on, metric_value, request};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const DOMAIN: &str = "regions-test";
/// A global limit of 100 a second, half in each region.
const POLICY: &str = "\
domain: regions-test
descriptors:
  - key: global
    rate_limit: {unit: second, requests_per_unit: 100}
    regions: {east: 50%, west: 50%}
";
const GLOBAL_TOKENS: f64 = 100.0;
const POLICY_SLICE_TOKENS: f64 = 50.0;
/// The slice key of the rule's one limit, as the metrics label it.
const RULE: &str = "regions-test/global#0";
/// Longest the hot region may take to hold more than its policy slice: the demand window
/// fills to the trigger within a few seconds of traffic, then a transfer takes a tick.
const REBALANCED_WITHIN: Duration = Duration::from_secs(60);
/// Concurrent RLS callers on the hot region.
const CALLERS: usize = 2;

/// The options of region `region`, whose peer `peer` answers QUIC at `peer_quic`.
fn region_options(
    region: &str,
    quic: std::net::SocketAddr,
    peer: &str,
    peer_quic: std::net::SocketAddr,
) -> ClusterOptions {
    ClusterOptions {
        policy: Some(POLICY.to_owned()),
        region: Some(region.to_owned()),
        config_extra: format!("[[regions]]\nname = \"{peer}\"\nquic_addr = \"{peer_quic}\"\n"),
        node_environment: [(1, vec![("QUOTAMESH_QUIC_ADDR", quic.to_string())])].into(),
        ..ClusterOptions::default()
    }
}

/// What one region's node reports of the rule: its slice, its tokens in flight, and the
/// peer's slice as it last read it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    slice: f64,
    in_flight: f64,
}

fn sample(cluster: &Cluster, region: &str) -> anyhow::Result<Sample> {
    let node = &cluster.nodes[&1];
    let metrics = node.process.as_ref().expect("running").metrics()?;
    Ok(Sample {
        slice: metric_value(
            &metrics,
            &format!("quotamesh_region_slice_tokens{{region=\"{region}\",rule=\"{RULE}\"}}"),
        ),
        in_flight: metric_value(
            &metrics,
            &format!("quotamesh_region_in_flight_tokens{{rule=\"{RULE}\"}}"),
        ),
    })
}

/// Sends requests to `cluster`'s node until `until` or until `stop` is raised; returns the
/// admitted count.
async fn traffic(cluster: &Cluster, until: Instant, stop: Arc<AtomicBool>) -> anyhow::Result<u64> {
    let node = cluster.nodes[&1].process.as_ref().expect("running");
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let mut client = node.client().await?;
        let stop = Arc::clone(&stop);
        callers.push(tokio::spawn(async move {
            let mut admitted = 0_u64;
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                let call = request(DOMAIN, vec![descriptor(&[("global", "all")])]);
                let response = client.should_rate_limit(call).await?.into_inner();
                if response.overall_code() == Code::Ok {
                    admitted += 1;
                }
            }
            anyhow::Ok(admitted)
        }));
    }
    let mut admitted = 0;
    for caller in callers {
        admitted += caller.await??;
    }
    Ok(admitted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skewed_traffic_moves_tokens_to_the_hot_region() -> anyhow::Result<()> {
    // The hot region gets more than its policy slice, tokens are conserved at every quiet
    // sample, and it admits more than its policy slice allowed: with both cores busy.
    let east_quic = format!("127.0.0.1:{}", free_port_on("127.0.0.1")?).parse()?;
    let west_quic = format!("127.0.0.1:{}", free_port_on("127.0.0.1")?).parse()?;
    let east = Cluster::start(1, region_options("east", east_quic, "west", west_quic)).await?;
    let west =
        Cluster::start_sharing_ca(1, region_options("west", west_quic, "east", east_quic), &east)
            .await?;
    let _hog = CpuHog::start(2);

    // Both regions adopt their policy slice.
    let started = Instant::now();
    loop {
        let (e, w) = (sample(&east, "east")?, sample(&west, "west")?);
        if e.slice == POLICY_SLICE_TOKENS && w.slice == POLICY_SLICE_TOKENS {
            break;
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "slices {e:?} {w:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // All traffic on east, sampling both regions while it runs.
    let shift = Instant::now();
    let until = shift + REBALANCED_WITHIN;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(&east, until, Arc::clone(&stop));
    let watch = async {
        let mut previous: Option<(Sample, Sample)> = None;
        let mut quiet_samples = 0;
        let mut rebalanced_after = None;
        while Instant::now() < until {
            let (e, w) = (sample(&east, "east")?, sample(&west, "west")?);
            anyhow::ensure!(e.slice <= GLOBAL_TOKENS && w.slice <= GLOBAL_TOKENS, "{e:?} {w:?}");
            // Read one region after the other, a sample is exact only while nothing moves:
            // no tokens in flight, and the same numbers as the sample before.
            if e.in_flight == 0.0 && w.in_flight == 0.0 && previous == Some((e, w)) {
                anyhow::ensure!(
                    e.slice + w.slice == GLOBAL_TOKENS,
                    "tokens not conserved: east {e:?}, west {w:?}"
                );
                if rebalanced_after.is_some() {
                    quiet_samples += 1;
                }
            }
            if e.slice > POLICY_SLICE_TOKENS && rebalanced_after.is_none() {
                rebalanced_after = Some(shift.elapsed());
            }
            previous = Some((e, w));
            if rebalanced_after.is_some() && quiet_samples >= 3 && e.slice >= 90.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        stop.store(true, Ordering::Relaxed);
        anyhow::Ok((rebalanced_after, quiet_samples, previous))
    };
    let (admitted, watched) = tokio::join!(load, watch);
    let (rebalanced_after, quiet_samples, last) = watched?;
    let admitted = admitted?;
    let elapsed = shift.elapsed();
    eprintln!(
        "rebalanced after {rebalanced_after:?}; last samples {last:?}; {quiet_samples} quiet \
         samples after it; admitted {admitted} in {elapsed:?}"
    );
    rebalanced_after.ok_or_else(|| {
        anyhow::anyhow!(
            "east never got more than its policy slice: {last:?}\neast log:\n{}\nwest log:\n{}",
            east.nodes[&1].process.as_ref().expect("running").log_tail(40),
            west.nodes[&1].process.as_ref().expect("running").log_tail(40)
        )
    })?;
    anyhow::ensure!(quiet_samples > 0, "no quiet sample after the rebalance to check");

    // With the slice moved, east admits past what its policy slice allowed.
    let window = Duration::from_secs(5);
    let admitted =
        traffic(&east, Instant::now() + window, Arc::new(AtomicBool::new(false))).await?;
    let policy_bound = POLICY_SLICE_TOKENS * (window.as_secs_f64() + 1.0);
    eprintln!("east admitted {admitted} in {window:?} (its policy slice allows {policy_bound})");
    anyhow::ensure!(
        admitted as f64 > policy_bound,
        "east admitted {admitted} in {window:?}, no more than its policy slice allows"
    );
    Ok(())
}

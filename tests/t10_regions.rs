//! Two regions of one cluster, one voter each, linked by QUIC under the cluster's CA
//! (`[[regions]]`): a global limit shared 50/50, all traffic on one region, and the
//! rebalancer moves the other region's idle tokens to it; the sum of both slices plus the
//! tokens in flight stays the global limit, and the hot region's admitted rate rises past
//! its policy slice. With the peer region's process stopped, the hot region answers at once
//! from the slice it has, and the transfer happens once the peer runs again.
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
/// Slowest answer allowed while the peer region is stopped: far under the QUIC call timeout
/// (5 s), so an answer that waited on the other region shows; room for the CPU hog.
const NO_WAIT_BOUND: Duration = Duration::from_secs(1);

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

/// What one run of traffic saw: admitted requests, and the slowest answer.
struct Load {
    admitted: u64,
    slowest: Duration,
}

/// Sends requests to `cluster`'s node until `until` or until `stop` is raised.
async fn traffic(cluster: &Cluster, until: Instant, stop: Arc<AtomicBool>) -> anyhow::Result<Load> {
    let node = cluster.nodes[&1].process.as_ref().expect("running");
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let mut client = node.client().await?;
        let stop = Arc::clone(&stop);
        callers.push(tokio::spawn(async move {
            let mut load = Load { admitted: 0, slowest: Duration::ZERO };
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                let call = request(DOMAIN, vec![descriptor(&[("global", "all")])]);
                let sent = Instant::now();
                let response = client.should_rate_limit(call).await?.into_inner();
                load.slowest = load.slowest.max(sent.elapsed());
                if response.overall_code() == Code::Ok {
                    load.admitted += 1;
                }
            }
            anyhow::Ok(load)
        }));
    }
    let mut total = Load { admitted: 0, slowest: Duration::ZERO };
    for caller in callers {
        let load = caller.await??;
        total.admitted += load.admitted;
        total.slowest = total.slowest.max(load.slowest);
    }
    Ok(total)
}

/// Starts regions east and west, each naming the other, and waits until both adopted their
/// policy slice.
async fn start_regions() -> anyhow::Result<(Cluster, Cluster)> {
    let east_quic = format!("127.0.0.1:{}", free_port_on("127.0.0.1")?).parse()?;
    let west_quic = format!("127.0.0.1:{}", free_port_on("127.0.0.1")?).parse()?;
    let east = Cluster::start(1, region_options("east", east_quic, "west", west_quic)).await?;
    let west =
        Cluster::start_sharing_ca(1, region_options("west", west_quic, "east", east_quic), &east)
            .await?;
    let started = Instant::now();
    loop {
        let (e, w) = (sample(&east, "east")?, sample(&west, "west")?);
        if e.slice == POLICY_SLICE_TOKENS && w.slice == POLICY_SLICE_TOKENS {
            return Ok((east, west));
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "slices {e:?} {w:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends all traffic to east until it holds at least 90 % of the global limit, checking
/// conservation at every quiet sample; returns how long it took.
async fn rebalance(east: &Cluster, west: &Cluster) -> anyhow::Result<Duration> {
    let shift = Instant::now();
    let until = shift + REBALANCED_WITHIN;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(east, until, Arc::clone(&stop));
    let watch = async {
        let mut previous: Option<(Sample, Sample)> = None;
        let mut quiet_samples = 0;
        let mut rebalanced_after = None;
        while Instant::now() < until {
            let (e, w) = (sample(east, "east")?, sample(west, "west")?);
            anyhow::ensure!(e.slice <= GLOBAL_TOKENS && w.slice <= GLOBAL_TOKENS, "{e:?} {w:?}");
            // Read one region after the other, a sample is exact only while nothing moves:
            // no tokens in flight, and the same numbers as the sample before (the gauges
            // follow each committed region command at once).
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
    let (load, watched) = tokio::join!(load, watch);
    let (rebalanced_after, quiet_samples, last) = watched?;
    let load = load?;
    eprintln!(
        "rebalanced after {rebalanced_after:?}; last samples {last:?}; {quiet_samples} quiet \
         samples after it; admitted {} in {:?}, slowest answer {:?}",
        load.admitted,
        shift.elapsed(),
        load.slowest
    );
    let rebalanced_after = rebalanced_after.ok_or_else(|| {
        anyhow::anyhow!(
            "east never got more than its policy slice: {last:?}\neast log:\n{}\nwest log:\n{}",
            east.nodes[&1].process.as_ref().expect("running").log_tail(40),
            west.nodes[&1].process.as_ref().expect("running").log_tail(40)
        )
    })?;
    anyhow::ensure!(
        quiet_samples >= 3 && last.is_some_and(|(e, _)| e.slice >= 90.0),
        "east did not reach 90 % of the global limit: {last:?}"
    );
    Ok(rebalanced_after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skewed_traffic_moves_tokens_to_the_hot_region() -> anyhow::Result<()> {
    // The hot region gets at least 90 % of the global limit, tokens are conserved at every
    // quiet sample, and it admits more than its policy slice allowed: with both cores busy.
    let (east, west) = start_regions().await?;
    let _hog = CpuHog::start(2);
    rebalance(&east, &west).await?;

    // `cluster regions` reads each region's ledger: east holds what west gave, nothing is
    // in flight, and east's leader shows its demand and west's slice as last read.
    let slices = |cluster: &Cluster| -> anyhow::Result<serde_json::Value> {
        let admin_addr = cluster.nodes[&1].admin_addr.to_string();
        let output = cluster.cli(&["cluster", "regions", "--json", "--admin-addr", &admin_addr])?;
        let reply: serde_json::Value = serde_json::from_str(&output)?;
        Ok(reply["nodes"][0].clone())
    };
    let tokens = |slice: &serde_json::Value, field: &str| slice[field].as_u64().unwrap_or(u64::MAX);
    // East reads west's slice once a second: look again until it has read the last one.
    let started = Instant::now();
    let (east_reply, west_reply) = loop {
        let (east_reply, west_reply) = (slices(&east)?, slices(&west)?);
        let (east_slice, west_slice) = (&east_reply["slices"][0], &west_reply["slices"][0]);
        if east_slice["peer_slice_tokens"]["west"] == west_slice["slice_tokens"]
            || started.elapsed() > Duration::from_secs(10)
        {
            break (east_reply, west_reply);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let (east_slice, west_slice) = (&east_reply["slices"][0], &west_reply["slices"][0]);
    eprintln!("cluster regions: east {east_slice}, west {west_slice}");
    anyhow::ensure!(east_reply["region"] == "east" && east_slice["rule"] == RULE, "{east_reply}");
    anyhow::ensure!(
        tokens(east_slice, "in_flight_tokens") == 0 && tokens(west_slice, "in_flight_tokens") == 0,
        "transfers in flight after the rebalance settled: {east_reply} {west_reply}"
    );
    anyhow::ensure!(
        tokens(east_slice, "slice_tokens") + tokens(west_slice, "slice_tokens") == 100
            && tokens(east_slice, "global_tokens") == 100,
        "the slices do not add up to the global limit: {east_slice} {west_slice}"
    );
    anyhow::ensure!(
        tokens(east_slice, "slice_tokens") >= 90 && tokens(east_slice, "demand_tokens") > 0,
        "{east_slice}"
    );
    anyhow::ensure!(
        east_slice["peer_slice_tokens"]["west"] == west_slice["slice_tokens"],
        "east's view of west {east_slice} is not west's slice {west_slice}"
    );

    // With the slice moved, east admits past what its policy slice allowed.
    let window = Duration::from_secs(5);
    let load = traffic(&east, Instant::now() + window, Arc::new(AtomicBool::new(false))).await?;
    let policy_bound = POLICY_SLICE_TOKENS * (window.as_secs_f64() + 1.0);
    eprintln!(
        "east admitted {} in {window:?} (its policy slice allows {policy_bound})",
        load.admitted
    );
    anyhow::ensure!(
        load.admitted as f64 > policy_bound,
        "east admitted {} in {window:?}, no more than its policy slice allows",
        load.admitted
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_peer_region_holds_nobody_up_and_transfers_resume() -> anyhow::Result<()> {
    // With the peer region's process stopped (its QUIC socket silent), the hot region
    // answers every request at once from the slice it has and keeps that slice; once the
    // peer runs again, the tokens move.
    let (east, west) = start_regions().await?;
    let _hog = CpuHog::start(2);
    let west_process = west.nodes[&1].process.as_ref().expect("running");
    west_process.signal("STOP")?;
    // Longer than a QUIC call's timeout, so the rebalancer's calls time out meanwhile.
    let window = Duration::from_secs(8);
    let stopped = traffic(&east, Instant::now() + window, Arc::new(AtomicBool::new(false))).await;
    let during = sample(&east, "east");
    west_process.signal("CONT")?;
    let (stopped, during) = (stopped?, during?);
    eprintln!(
        "peer stopped: east admitted {} in {window:?}, slowest answer {:?}, slice {during:?}",
        stopped.admitted, stopped.slowest
    );
    anyhow::ensure!(stopped.admitted > 0, "east admitted nothing while west was stopped");
    anyhow::ensure!(
        stopped.slowest < NO_WAIT_BOUND,
        "a request waited {:?} while west was stopped",
        stopped.slowest
    );
    anyhow::ensure!(
        during.slice == POLICY_SLICE_TOKENS && during.in_flight == 0.0,
        "east's slice changed without its peer: {during:?}"
    );
    let after = rebalance(&east, &west).await?;
    eprintln!("after the peer resumed, rebalanced within {after:?}");
    Ok(())
}

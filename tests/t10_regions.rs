//! Two regions of one cluster linked by QUIC under the cluster's CA (`[[regions]]`): a
//! global limit shared 50/50, all traffic on one region, and the rebalancer moves the other
//! region's idle tokens to it; the sum of both slices plus the tokens in flight stays the
//! global limit, and the hot region's admitted rate rises past its policy slice. With the
//! peer region's process stopped, the hot region answers at once from the slice it has,
//! and the transfer happens once the peer runs again. Those two run one voter per region;
//! a third runs three voters per region and a gateway in the hot one, with traffic spread
//! over its four nodes so that no node alone makes the region hot: the region's demand is
//! counted region-wide (the gateway's reports included), and the gateway enforces the
//! ledger's slice. Over every run, what the regions admit together stays within their
//! documented bounds (README, Regions). Two more run three voters per region: west's leader
//! killed right after it debits a transfer (west's next leader settles it), and the QUIC
//! link cut by firewall rules and healed. And once the traffic stops, the slices drift
//! back to the policy's shares.
//!
//! The rebalancer runs its shipped defaults (80 % of a slice within a 20 s window, a look
//! each second), with both cores kept busy by the CPU hog.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::cluster::{Cluster, ClusterOptions};
use common::{CpuHog, descriptor, free_port_on, metric_sum, metric_value, nft, request};
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use quotamesh::api::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

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
/// The gateway of the three-voter region east.
const GATEWAY: u64 = 4;
/// Requests a second offered through east's gateway, and through each of its voters, in
/// the three-voter test. East's policy slice is 50 and a region is hot at 80 % of it (40):
/// each voter's own traffic (10) is far under it and the voters' together (30) still are,
/// so east is found hot only by adding every node's offered hits, the gateway's included
/// (90; 45 with half the offered rate lost to the CPU hog).
const GATEWAY_RATE: u32 = 60;
const VOTER_RATE: u32 = 10;
/// Slowest answer allowed while the peer region is stopped: far under the QUIC call timeout
/// (5 s), so an answer that waited on the other region shows; room for the CPU hog.
const NO_WAIT_BOUND: Duration = Duration::from_secs(1);

/// A QUIC address for each of `voters` voters (node N on 127.0.0.N, as the harness puts it).
fn quic_addrs(voters: u64) -> anyhow::Result<BTreeMap<u64, SocketAddr>> {
    (1..=voters)
        .map(|id| {
            let ip = format!("127.0.0.{id}");
            Ok((id, format!("{ip}:{}", free_port_on(&ip)?).parse()?))
        })
        .collect()
}

/// The options of region `region`, whose voters answer QUIC at `quic`, and whose peer `peer`
/// is dialled at `peer_quic` (one of its voters: any answers a peer).
fn region_options(
    region: &str,
    quic: &BTreeMap<u64, SocketAddr>,
    peer: &str,
    peer_quic: SocketAddr,
) -> ClusterOptions {
    ClusterOptions {
        policy: Some(POLICY.to_owned()),
        region: Some(region.to_owned()),
        config_extra: format!("[[regions]]\nname = \"{peer}\"\nquic_addr = \"{peer_quic}\"\n"),
        node_environment: quic
            .iter()
            .map(|(id, addr)| (*id, vec![("QUOTAMESH_QUIC_ADDR", addr.to_string())]))
            .collect(),
        ..ClusterOptions::default()
    }
}

/// What one region's node reports of the rule: its slice and its tokens in flight.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    slice: f64,
    in_flight: f64,
}

/// One region and the voter whose gauges are read: its leader's, which follow every region
/// command it commits at once (a follower's follow on its next tick).
struct Region {
    cluster: Cluster,
    name: &'static str,
    leader: u64,
    /// Its voters: `nodes_in_region` by default.
    voters: u64,
    /// Its voters' QUIC addresses.
    quic: BTreeMap<u64, SocketAddr>,
}

impl Region {
    /// The region `name` of `voters` voters that `cluster` runs, answering QUIC at `quic`.
    async fn of(
        cluster: Cluster,
        name: &'static str,
        voters: u64,
        quic: BTreeMap<u64, SocketAddr>,
    ) -> anyhow::Result<Self> {
        Ok(Self { leader: cluster.leader().await?, cluster, name, voters, quic })
    }

    fn sample(&self) -> anyhow::Result<Sample> {
        sample(&self.cluster, self.leader, self.name)
    }
}

fn sample(cluster: &Cluster, node_id: u64, region: &str) -> anyhow::Result<Sample> {
    let node = &cluster.nodes[&node_id];
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

/// What one run of traffic saw: requests sent and admitted, and the slowest answer.
#[derive(Debug, Default)]
struct Load {
    sent: u64,
    admitted: u64,
    slowest: Duration,
}

impl Load {
    fn add(&mut self, other: &Load) {
        self.sent += other.sent;
        self.admitted += other.admitted;
        self.slowest = self.slowest.max(other.slowest);
    }
}

/// Sends one request through `client` and counts it in `load`.
async fn send(client: &mut RateLimitServiceClient<Channel>, load: &mut Load) -> anyhow::Result<()> {
    let call = request(DOMAIN, vec![descriptor(&[("global", "all")])]);
    let sent = Instant::now();
    let response = client.should_rate_limit(call).await?.into_inner();
    load.sent += 1;
    load.slowest = load.slowest.max(sent.elapsed());
    if response.overall_code() == Code::Ok {
        load.admitted += 1;
    }
    Ok(())
}

/// Sends requests as fast as they are answered to `cluster`'s node `node_id`, from
/// [`CALLERS`] callers, until `until` or until `stop` is raised.
async fn traffic(
    cluster: &Cluster,
    node_id: u64,
    until: Instant,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Load> {
    let node = cluster.nodes[&node_id].process.as_ref().expect("running");
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let mut client = node.client().await?;
        let stop = Arc::clone(&stop);
        callers.push(tokio::spawn(async move {
            let mut load = Load::default();
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                send(&mut client, &mut load).await?;
            }
            anyhow::Ok(load)
        }));
    }
    let mut total = Load::default();
    for caller in callers {
        total.add(&caller.await??);
    }
    Ok(total)
}

/// Sends `per_second` requests a second to `cluster`'s node `node_id` (late ones catch up)
/// until `until` or until `stop` is raised.
async fn paced(
    cluster: &Cluster,
    node_id: u64,
    per_second: u32,
    until: Instant,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<Load> {
    let mut client = cluster.nodes[&node_id].process.as_ref().expect("running").client().await?;
    let mut ticks = tokio::time::interval(Duration::from_secs(1) / per_second);
    let mut load = Load::default();
    while Instant::now() < until && !stop.load(Ordering::Relaxed) {
        ticks.tick().await;
        send(&mut client, &mut load).await?;
    }
    Ok(load)
}

/// Starts regions east and west of `voters` voters each, each naming the other, and waits
/// until both adopted their policy slice.
async fn start_regions(voters: u64) -> anyhow::Result<(Region, Region)> {
    let (east_quic, west_quic) = (quic_addrs(voters)?, quic_addrs(voters)?);
    let east =
        Cluster::start(voters, region_options("east", &east_quic, "west", west_quic[&1])).await?;
    let west = Cluster::start_sharing_ca(
        voters,
        region_options("west", &west_quic, "east", east_quic[&1]),
        &east,
    )
    .await?;
    let east = Region::of(east, "east", voters, east_quic).await?;
    let west = Region::of(west, "west", voters, west_quic).await?;
    let started = Instant::now();
    loop {
        let (e, w) = (east.sample()?, west.sample()?);
        if e.slice == POLICY_SLICE_TOKENS && w.slice == POLICY_SLICE_TOKENS {
            return Ok((east, west));
        }
        anyhow::ensure!(started.elapsed() < Duration::from_secs(30), "slices {e:?} {w:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Runs `load` (all traffic on east, ending at `until` or when `stop` is raised) until east
/// holds at least 90 % of the global limit, checking conservation at every quiet sample;
/// returns how long it took, and what the load saw.
async fn rebalance(
    east: &Region,
    west: &Region,
    load: impl Future<Output = anyhow::Result<Load>>,
    until: Instant,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<(Duration, Load)> {
    let shift = Instant::now();
    let watch = async {
        let mut previous: Option<(Sample, Sample)> = None;
        let mut quiet_samples = 0;
        let mut rebalanced_after = None;
        while Instant::now() < until {
            let (e, w) = (east.sample()?, west.sample()?);
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
         samples after it; sent {}, admitted {} in {:?}, slowest answer {:?}",
        load.sent,
        load.admitted,
        shift.elapsed(),
        load.slowest
    );
    let rebalanced_after = rebalanced_after.ok_or_else(|| {
        anyhow::anyhow!(
            "east never got more than its policy slice: {last:?}\neast log:\n{}\nwest log:\n{}",
            east.cluster.nodes[&east.leader].process.as_ref().expect("running").log_tail(40),
            west.cluster.nodes[&west.leader].process.as_ref().expect("running").log_tail(40)
        )
    })?;
    anyhow::ensure!(
        quiet_samples >= 3 && last.is_some_and(|(e, _)| e.slice >= 90.0),
        "east did not reach 90 % of the global limit: {last:?}"
    );
    Ok((rebalanced_after, load))
}

/// What the regions' nodes count toward the documented bound, read at the start of a span.
struct BoundStart {
    at: Instant,
    bypassed: f64,
}

impl BoundStart {
    fn now(regions: &[&Region]) -> anyhow::Result<Self> {
        Ok(Self { at: Instant::now(), bypassed: family_sum(regions, BYPASSED)? })
    }

    /// Checks that `admitted` over the span since `self` is within the documented bound
    /// across regions (README, Regions): the global burst, plus the global rate over the
    /// span, plus every region's drift bound for the nodes it runs, plus what the fallback
    /// paid. A moved slice adds nothing to it; a bucket that started over at each move would.
    fn check(&self, regions: &[&Region], admitted: u64) -> anyhow::Result<()> {
        let span = self.at.elapsed().as_secs_f64();
        let bypassed = family_sum(regions, BYPASSED)? - self.bypassed;
        let mut drift = 0.0;
        for region in regions {
            // Each node exports the region's bound for `nodes_in_region` holders (the
            // voters, by default); a gateway holds a lease too, so scale to every node.
            let running = region.cluster.running();
            let exported = running
                .iter()
                .map(|id| {
                    let metrics =
                        region.cluster.nodes[id].process.as_ref().expect("running").metrics()?;
                    anyhow::Ok(metric_sum(&metrics, "quotamesh_lease_drift_bound_tokens"))
                })
                .collect::<anyhow::Result<Vec<f64>>>()?
                .into_iter()
                .fold(0.0, f64::max);
            let voters = region.voters as f64;
            drift += exported / voters * running.len() as f64;
        }
        let bound = GLOBAL_TOKENS + GLOBAL_TOKENS * span + drift + bypassed;
        eprintln!(
            "admitted {admitted} in {span:.2} s across regions; documented bound {bound:.0} \
             (burst {GLOBAL_TOKENS}, rate {GLOBAL_TOKENS}/s, drift bounds {drift:.0}, fallback \
             {bypassed})"
        );
        anyhow::ensure!(
            admitted as f64 <= bound,
            "admitted {admitted} in {span:.2} s, above the documented bound {bound:.0}"
        );
        Ok(())
    }
}

/// The admissions the fallback paid, a family summed over its reasons.
const BYPASSED: &str = "quotamesh_rate_limit_bypassed_total";

/// `family` summed over every running node of `regions`.
fn family_sum(regions: &[&Region], family: &str) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for region in regions {
        for id in region.cluster.running() {
            let metrics = region.cluster.nodes[&id].process.as_ref().expect("running").metrics()?;
            sum += metric_sum(&metrics, family);
        }
    }
    Ok(sum)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skewed_traffic_moves_tokens_to_the_hot_region() -> anyhow::Result<()> {
    // The hot region gets at least 90 % of the global limit, tokens are conserved at every
    // quiet sample, and it admits more than its policy slice allowed: with both cores busy.
    let (east_region, west_region) = start_regions(1).await?;
    let _hog = CpuHog::start(2);
    let bound = BoundStart::now(&[&east_region, &west_region])?;
    let (_, rebalancing) = all_traffic_on_east(&east_region, &west_region).await?;
    let (east, west) = (&east_region.cluster, &west_region.cluster);

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
        let (east_reply, west_reply) = (slices(east)?, slices(west)?);
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
    let load = traffic(east, 1, Instant::now() + window, Arc::new(AtomicBool::new(false))).await?;
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
    // And over the whole run, the slice's moves included, no more than the regions'
    // documented bounds allow together.
    bound.check(&[&east_region, &west_region], rebalancing.admitted + load.admitted)?;

    // Cross-region traffic at steady state (one rule): each leader reads its peer's views
    // once a tick (1 s), and nothing else crosses while the slices stay put.
    let span = Duration::from_secs(5);
    let before = link_traffic(&east_region, "west")?;
    let west_before = link_traffic(&west_region, "east")?;
    tokio::time::sleep(span).await;
    for (region, peer, before) in
        [(&east_region, "west", before), (&west_region, "east", west_before)]
    {
        let after = link_traffic(region, peer)?;
        let per_second = |index: usize| (after[index] - before[index]) / span.as_secs_f64();
        let (calls, sent, received) = (per_second(0), per_second(1), per_second(2));
        eprintln!(
            "{} to {peer} at steady state, one rule: {calls:.1} calls/s, {sent:.0} B/s sent, \
             {received:.0} B/s received",
            region.name
        );
        anyhow::ensure!(calls <= 2.0, "{calls:.1} calls/s from {} at steady state", region.name);
    }
    Ok(())
}

/// The calls a region's leader made to `peer` so far, and their request and reply bytes.
fn link_traffic(region: &Region, peer: &str) -> anyhow::Result<[f64; 3]> {
    let metrics =
        region.cluster.nodes[&region.leader].process.as_ref().expect("running").metrics()?;
    Ok(["calls", "sent_bytes", "received_bytes"].map(|counter| {
        metric_value(&metrics, &format!("quotamesh_region_{counter}_total{{region=\"{peer}\"}}"))
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_peer_region_holds_nobody_up_and_transfers_resume() -> anyhow::Result<()> {
    // With the peer region's process stopped (its QUIC socket silent), the hot region
    // answers every request at once from the slice it has and keeps that slice; once the
    // peer runs again, the tokens move.
    let (east, west) = start_regions(1).await?;
    let _hog = CpuHog::start(2);
    let west_process = west.cluster.nodes[&1].process.as_ref().expect("running");
    west_process.signal("STOP")?;
    // Longer than a QUIC call's timeout, so the rebalancer's calls time out meanwhile.
    let window = Duration::from_secs(8);
    let stopped =
        traffic(&east.cluster, 1, Instant::now() + window, Arc::new(AtomicBool::new(false))).await;
    let during = east.sample();
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
    let (after, _) = all_traffic_on_east(&east, &west).await?;
    eprintln!("after the peer resumed, rebalanced within {after:?}");
    Ok(())
}

/// Sends all traffic to east's node 1, from [`CALLERS`] callers as fast as they are
/// answered, until east holds at least 90 % of the global limit ([`rebalance`]).
async fn all_traffic_on_east(east: &Region, west: &Region) -> anyhow::Result<(Duration, Load)> {
    let until = Instant::now() + REBALANCED_WITHIN;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(&east.cluster, 1, until, Arc::clone(&stop));
    rebalance(east, west, load, until, stop).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_region_counts_its_demand_on_every_node_and_its_gateway_enforces_the_ledger_slice()
-> anyhow::Result<()> {
    // Two regions of three voters, and a gateway in east taking most of east's traffic, at
    // rates under which no node alone (nor the voters together) makes east hot: east gets
    // at least 90 % of the global limit only because the ledger adds up every node's
    // offered hits, the gateway's included; then the gateway alone admits past east's
    // policy slice, so it enforces the ledger's slice, not the policy's share.
    let (mut east, west) = start_regions(3).await?;
    east.cluster.start_gateway(GATEWAY)?;
    let _hog = CpuHog::start(2);
    let bound = BoundStart::now(&[&east, &west])?;
    let until = Instant::now() + REBALANCED_WITHIN;
    let stop = Arc::new(AtomicBool::new(false));
    let cluster = &east.cluster;
    let load = async {
        let voter = |id| paced(cluster, id, VOTER_RATE, until, Arc::clone(&stop));
        let (gateway, one, two, three) = tokio::join!(
            paced(cluster, GATEWAY, GATEWAY_RATE, until, Arc::clone(&stop)),
            voter(1),
            voter(2),
            voter(3),
        );
        let gateway = gateway?;
        eprintln!(
            "through the gateway: sent {}, admitted {}, slowest answer {:?}",
            gateway.sent, gateway.admitted, gateway.slowest
        );
        let mut total = gateway;
        for (id, voter) in (1..=3).zip([one, two, three]) {
            let voter = voter?;
            eprintln!("through voter {id}: sent {}, admitted {}", voter.sent, voter.admitted);
            total.add(&voter);
        }
        anyhow::Ok(total)
    };
    let (after, rebalancing) = rebalance(&east, &west, load, until, Arc::clone(&stop)).await?;
    eprintln!("east (three voters and a gateway) rebalanced within {after:?}");

    let window = Duration::from_secs(5);
    let load = traffic(cluster, GATEWAY, Instant::now() + window, Arc::new(AtomicBool::new(false)))
        .await?;
    let policy_bound = POLICY_SLICE_TOKENS * (window.as_secs_f64() + 1.0);
    let slice = east.sample()?;
    eprintln!(
        "the gateway alone admitted {} of {} in {window:?} (east's policy slice allows \
         {policy_bound}; east's slice {slice:?})",
        load.admitted, load.sent
    );
    anyhow::ensure!(
        load.admitted as f64 > policy_bound,
        "the gateway admitted {} in {window:?}, no more than east's policy slice allows",
        load.admitted
    );
    bound.check(&[&east, &west], rebalancing.admitted + load.admitted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_donor_leader_killed_mid_transfer_loses_no_token() -> anyhow::Result<()> {
    // Two regions of three voters, all traffic on east: west's leader is killed (SIGKILL)
    // right after it debits its first transfer to east. A transfer settles on the donor's
    // next tick (a second later), so the kill lands mid-transfer: the debit is in west's
    // replicated ledger, the credit maybe not yet. West's next leader finishes the transfer
    // (same id), east still reaches 90 % of the global limit, and tokens are conserved at
    // every quiet sample after the kill, in flight included.
    let (east, mut west) = start_regions(3).await?;
    let _hog = CpuHog::start(2);
    let until = Instant::now() + REBALANCED_WITHIN;
    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(&east.cluster, 1, until, Arc::clone(&stop));
    let killed = west.leader;
    let kill = async {
        let killed = kill_after_first_debit(&west.cluster, killed, until).await;
        stop.store(true, Ordering::Relaxed);
        killed
    };
    let (before, in_flight_at_kill) = tokio::join!(load, kill);
    let (before, in_flight_at_kill) = (before?, in_flight_at_kill?);
    let others: Vec<u64> = west.cluster.running().into_iter().filter(|id| *id != killed).collect();
    west.leader = west.cluster.leader_among(&others).await?;
    eprintln!(
        "west's leader {killed} killed with {in_flight_at_kill} token(s) in flight after east \
         admitted {} of {}; node {} leads west now",
        before.admitted, before.sent, west.leader
    );
    let (after, _) = all_traffic_on_east(&east, &west).await?;
    eprintln!("east holds 90 % of the limit, the transfer settled, {after:?} after the kill");
    Ok(())
}

/// Polls node `leader` of a donor region every 10 ms and kills it (SIGKILL) as soon as it
/// has debited a transfer; returns the tokens it had in flight then.
async fn kill_after_first_debit(
    cluster: &Cluster,
    leader: u64,
    until: Instant,
) -> anyhow::Result<f64> {
    let process = cluster.nodes[&leader].process.as_ref().expect("running");
    let debited = "quotamesh_region_transfers_total{result=\"debited\"}";
    let in_flight = format!("quotamesh_region_in_flight_tokens{{rule=\"{RULE}\"}}");
    loop {
        let metrics = process.metrics()?;
        if metric_value(&metrics, debited) > 0.0 {
            process.signal("KILL")?;
            return Ok(metric_value(&metrics, &in_flight));
        }
        anyhow::ensure!(Instant::now() < until, "the donor never debited a transfer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An nftables table dropping every UDP packet to or from the regions' QUIC ports, so the
/// link between them goes silent (both processes keep running); deleted on drop.
struct LinkCut {
    table: String,
}

impl LinkCut {
    fn new(regions: &[&Region]) -> anyhow::Result<Self> {
        let table = format!("quotamesh_regions_{}", std::process::id());
        let ports = regions
            .iter()
            .flat_map(|region| region.quic.values())
            .map(|address| address.port().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let rules = format!(
            "table inet {table} {{\n  chain output {{\n    type filter hook output priority 0; \
             policy accept;\n    udp dport {{ {ports} }} drop\n    udp sport {{ {ports} }} \
             drop\n  }}\n}}\n"
        );
        nft(&["-f", "-"], Some(&rules))?;
        Ok(Self { table })
    }
}

impl Drop for LinkCut {
    fn drop(&mut self) {
        if let Err(error) = nft(&["delete", "table", "inet", &self.table], None) {
            eprintln!("could not heal the link: {error}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_link_between_regions_holds_nobody_up_and_transfers_resume_after_the_heal()
-> anyhow::Result<()> {
    // The QUIC link between the regions cut by firewall rules (packets dropped, nothing
    // refused, both processes running): east, made hot meanwhile, answers every request at
    // once from the slice it has, both regions keep their slices, and the link shows down;
    // once healed, the tokens move. Three voters a region: every voter's QUIC port is cut.
    let (east, west) = start_regions(3).await?;
    let _hog = CpuHog::start(2);
    let cut = LinkCut::new(&[&east, &west])?;
    // Longer than a QUIC call's timeout (5 s), so calls time out meanwhile.
    let window = Duration::from_secs(8);
    let load = traffic(&east.cluster, 1, Instant::now() + window, Arc::new(AtomicBool::new(false)))
        .await?;
    let (during_east, during_west) = (east.sample()?, west.sample()?);
    let east_metrics =
        east.cluster.nodes[&east.leader].process.as_ref().expect("running").metrics()?;
    let link_up = metric_value(&east_metrics, "quotamesh_region_link_up{region=\"west\"}");
    drop(cut);
    eprintln!(
        "link cut: east admitted {} of {} in {window:?}, slowest answer {:?}; slices {during_east:?} \
         {during_west:?}; east's link to west up: {link_up}",
        load.admitted, load.sent, load.slowest
    );
    anyhow::ensure!(load.admitted > 0, "east admitted nothing while the link was cut");
    anyhow::ensure!(load.slowest < NO_WAIT_BOUND, "a request waited {:?}", load.slowest);
    anyhow::ensure!(
        during_east.slice == POLICY_SLICE_TOKENS && during_east.in_flight == 0.0,
        "east's slice moved across a cut link: {during_east:?}"
    );
    anyhow::ensure!(
        during_west.slice == POLICY_SLICE_TOKENS && during_west.in_flight == 0.0,
        "west's slice moved across a cut link: {during_west:?}"
    );
    anyhow::ensure!(link_up == 0.0, "east's link to west shows up through the cut");
    let (after, _) = all_traffic_on_east(&east, &west).await?;
    eprintln!("after the heal, rebalanced within {after:?}");
    Ok(())
}

/// Longest the slices may take to drift back once traffic stops: the observation window
/// (20 s) must forget the traffic before a region is cold, then a transfer takes a tick.
const DRIFTED_BACK_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slices_drift_back_to_the_policy_shares_once_demand_falls() -> anyhow::Result<()> {
    // All traffic on east moves the whole limit to it; then the traffic stops. Once east's
    // demand over the observation window falls under a quarter of its slice, east gives
    // back what it holds above its policy slice, and the regions end at 50/50 again,
    // conserved at every quiet sample on the way.
    let (east, west) = start_regions(1).await?;
    let _hog = CpuHog::start(2);
    all_traffic_on_east(&east, &west).await?;
    let stopped = Instant::now();
    let mut previous: Option<(Sample, Sample)> = None;
    loop {
        let (e, w) = (east.sample()?, west.sample()?);
        if e.in_flight == 0.0 && w.in_flight == 0.0 && previous == Some((e, w)) {
            anyhow::ensure!(
                e.slice + w.slice == GLOBAL_TOKENS,
                "tokens not conserved: east {e:?}, west {w:?}"
            );
            if e.slice == POLICY_SLICE_TOKENS {
                break;
            }
        }
        anyhow::ensure!(
            stopped.elapsed() < DRIFTED_BACK_WITHIN,
            "not back at the policy's shares {DRIFTED_BACK_WITHIN:?} after the traffic \
             stopped: east {e:?}, west {w:?}"
        );
        previous = Some((e, w));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("back at 50/50 {:?} after the traffic stopped", stopped.elapsed());
    Ok(())
}

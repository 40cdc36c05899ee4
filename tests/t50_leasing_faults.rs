//! Faults of the quota ledger under RLS load on two gateways (real processes, three voters
//! and two gateways, `nodes_in_region = 5`): kill -9 of the leader, then of every voter,
//! then a restart of all of them from their data directories; and a quorum lost for 20 s
//! (SIGSTOP of the leader and one follower) and back; and a leader stopped for 200 ms, whose
//! late answers resume leasing at once.
//!
//! The leasing settings are the shipped defaults: calls judged against the ledger's measured
//! latency (so the slow fsync of a shared 2-core machine keeps a healthy region healthy),
//! 3 failures open the circuit, one probe a second, and the first healthy probe resumes
//! leasing (half-open) with 5 healthy calls closing it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::leasing::{
    Answer, BURST_TOKENS, GATEWAYS, LIMIT_PER_SECOND, NODES_IN_REGION, Outcome, Stream, VOTERS,
    collect, figure, ms, percentile, rls_client, scrape, send_one, start_region, start_stream,
    user_limit,
};
use common::{metric_sum, metric_value};
use quotamesh::core::lease::LeaseTuning;
use tokio::sync::watch;

/// Offered load per gateway on the fail-open key: below the limit while the ledger serves
/// (600/s over both), above the fallback bucket (1,000 / 5 = 200/s per node) while it does not.
const OPEN_PER_SECOND: u32 = 300;
/// Offered load per gateway on the fail-closed key.
const CLOSED_PER_SECOND: u32 = 100;
/// Tasks per stream.
const TASKS: u32 = 4;
/// Leases settle before the baseline is measured.
const WARM_UP: Duration = Duration::from_secs(2);
/// Length of each measured phase: baseline, after the leader's kill, the outage.
const PHASE: Duration = Duration::from_secs(4);
/// The outage is measured from this long after the last voter died: the circuit has opened
/// (three failed 5 ms calls) and the leases held at the stop (TTL 500 ms) have expired.
const OUTAGE_SETTLE: Duration = Duration::from_secs(2);
/// The added p99 latency allowed while the ledger is gone (DESIGN: decisions stay local).
const ADDED_P99_MAX: Duration = Duration::from_millis(5);
/// Longest wait for the circuits to close once the voters are back.
const CLOSE_WAIT: Duration = Duration::from_secs(30);
/// Measured after the circuits closed (plus a second for the keys to hold leases again).
const RECOVERED_PHASE: Duration = Duration::from_secs(3);

/// One test at a time in this binary: each starts five processes and loads them.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Offered load per gateway on the fail-open key while the quorum is lost: 1.2x the limit
/// over both, above the fallback bucket of each.
const QUORUM_OPEN_PER_SECOND: u32 = 600;
/// How long the quorum is lost.
const QUORUM_LOSS: Duration = Duration::from_secs(20);
/// How long the admissions are counted after the quorum is back.
const QUORUM_AFTER: Duration = Duration::from_secs(60);
/// The debt the fallback ran up is paid from the bucket's refill within this long after the
/// quorum is back; from then on the key is admitted at its limit.
const DEBT_PAID: Duration = Duration::from_secs(20);
/// From 20 s after the quorum's return the key may fall short of its limit by this share.
/// Measured +0.05 % and -1.88 % on a quiet machine and -10.0 % with two more test binaries
/// running beside it: how soon shares settle after a long stall is an open finding of the
/// leasing issue; this bound catches a key left stuck or starved.
const RECOVERED_SHORTFALL_PERCENT: f64 = 5.0;
/// The voter left running stands for election within this long of the others' stop: many
/// election timeouts (300-600 ms) even on a busy machine.
const SURVIVOR_CAMPAIGNS_WITHIN: Duration = Duration::from_secs(5);
/// The target: fail-closed rules admit again this soon after the quorum is back.
const FAIL_CLOSED_BACK_MAX: Duration = Duration::from_secs(2);

/// The fallback bucket of one node for a 1,000/s rule: rate and capacity, per second.
const FALLBACK_PER_SECOND: u64 = LIMIT_PER_SECOND / NODES_IN_REGION;

/// The answers sent within `[from, to)` since the origin, of `label`, through `node`.
fn sent_between<'a>(
    answers: &'a [Answer],
    from: Duration,
    to: Duration,
    label: Option<&str>,
    node: Option<u64>,
) -> Vec<&'a Answer> {
    answers
        .iter()
        .filter(|answer| (from..to).contains(&answer.sent_at))
        .filter(|answer| label.is_none_or(|label| answer.label == label))
        .filter(|answer| node.is_none_or(|node| answer.node == node))
        .collect()
}

fn count(answers: &[&Answer], outcome: Outcome) -> usize {
    answers.iter().filter(|answer| answer.outcome == outcome).count()
}

/// One gateway's counters of interest.
#[derive(Debug, Clone, Copy)]
struct Counters {
    bypassed: f64,
    bypassed_circuit_open: f64,
    failed_closed: f64,
    calls_ok: f64,
    circuit_state: f64,
    circuit_opened: f64,
    circuit_open_seconds: f64,
    slow_calls: f64,
    stalled_seconds: f64,
}

async fn counters(cluster: &common::cluster::Cluster, id: u64) -> Result<Counters> {
    let text = scrape(cluster.nodes[&id].metrics_addr).await?;
    Ok(Counters {
        bypassed: metric_sum(&text, "quotamesh_rate_limit_bypassed_total"),
        bypassed_circuit_open: metric_value(
            &text,
            "quotamesh_rate_limit_bypassed_total{reason=\"circuit_open\"}",
        ),
        failed_closed: metric_value(&text, "quotamesh_rate_limit_failed_closed_total"),
        calls_ok: metric_value(&text, "quotamesh_ledger_calls_total{result=\"ok\"}"),
        circuit_state: metric_value(&text, "quotamesh_ledger_circuit_state"),
        circuit_opened: metric_value(&text, "quotamesh_ledger_circuit_opened_total"),
        circuit_open_seconds: metric_value(&text, "quotamesh_ledger_circuit_open_seconds_total"),
        slow_calls: metric_value(&text, "quotamesh_ledger_calls_total{result=\"slow\"}"),
        stalled_seconds: metric_value(&text, "quotamesh_ledger_stalled_seconds_total"),
    })
}

/// Each gateway's counters, in the order of [`GATEWAYS`].
async fn gateway_counters(cluster: &common::cluster::Cluster) -> Result<Vec<Counters>> {
    let mut all = Vec::new();
    for gateway in GATEWAYS {
        all.push(counters(cluster, gateway).await?);
    }
    Ok(all)
}

/// The gateways' log lines about their circuits, for a failure message.
fn circuit_logs(cluster: &common::cluster::Cluster) -> String {
    let mut text = String::new();
    for gateway in GATEWAYS {
        let log = std::fs::read_to_string(&cluster.nodes[&gateway].log_path).unwrap_or_default();
        text.push_str(&format!("gateway {gateway}:\n"));
        for line in log.lines().filter(|line| line.contains("circuit")) {
            text.push_str(line);
            text.push('\n');
        }
    }
    text
}

/// Waits until `survivor`, the one voter left running, stands for election: the proof that
/// the stop reached the other voters' processes (a signal that stopped only a wrapper
/// around a node would leave the quorum, and every later figure would mislead).
async fn survivor_campaigns(
    cluster: &common::cluster::Cluster,
    survivor: u64,
    stopped: [u64; 2],
) -> Result<()> {
    let deadline = Instant::now() + SURVIVOR_CAMPAIGNS_WITHIN;
    loop {
        let status = cluster.status(survivor).await?;
        if status.state == "Candidate" {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "voters {stopped:?} were stopped, yet node {survivor} is still a {} following \
                 {:?} after {SURVIVOR_CAMPAIGNS_WITHIN:?}: the quorum was not lost (did the \
                 signal reach the node processes?)",
                status.state,
                status.leader_id
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sleeps until `at` since `origin`.
async fn until(origin: Instant, at: Duration) {
    tokio::time::sleep_until((origin + at).into()).await;
}

// Proves fail-open with bounded cost: while two gateways serve a fail-open and a fail-closed
// key, kill -9 of the ledger's leader costs no error; with every voter dead the answers keep
// coming with a p99 within 5 ms of the baseline's, fail-open requests are admitted up to the
// fallback bucket (1,000/5 per node per second) and counted as bypasses, fail-closed ones are
// denied and counted, and the circuit is open; once the voters restart from their data
// directories the circuits close, leases are granted again and bypasses stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_region_serves_through_a_leader_kill_and_a_ledger_outage() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let mut cluster = start_region("").await?;
    let (stop, stopped) = watch::channel(false);
    let origin = Instant::now();
    let mut handles = Vec::new();
    for gateway in GATEWAYS {
        let address = cluster.nodes[&gateway].rls_addr;
        for (label, key, per_second) in
            [("open", "user", OPEN_PER_SECOND), ("closed", "payment", CLOSED_PER_SECOND)]
        {
            let stream = Stream {
                node: gateway,
                address,
                label,
                entry: (key, "shared".to_owned()),
                per_second,
                tasks: TASKS,
            };
            handles.extend(start_stream(&stream, origin, &stopped).await?);
        }
    }

    // Baseline, with the ledger serving.
    let baseline = (WARM_UP, WARM_UP + PHASE);
    until(origin, baseline.0).await;
    let warm = gateway_counters(&cluster).await?;
    until(origin, baseline.1).await;
    let healthy = gateway_counters(&cluster).await?;

    // kill -9 of the leader.
    let leader = cluster.leader().await?;
    tokio::task::block_in_place(|| cluster.node(leader).kill())?;
    let killed_at = origin.elapsed();
    let survivors: Vec<u64> = VOTERS.into_iter().filter(|id| *id != leader).collect();
    let new_leader = cluster.leader_among(&survivors).await?;
    eprintln!(
        "killed leader {leader} at {:.2} s; node {new_leader} leads",
        killed_at.as_secs_f64()
    );
    until(origin, killed_at + PHASE).await;

    // Every voter down.
    let before_outage = gateway_counters(&cluster).await?;
    for id in &survivors {
        tokio::task::block_in_place(|| cluster.node(*id).kill())?;
    }
    let outage_at = origin.elapsed();
    let outage = (outage_at + OUTAGE_SETTLE, outage_at + OUTAGE_SETTLE + PHASE);
    until(origin, outage.1).await;
    let during_outage = gateway_counters(&cluster).await?;

    // The voters come back from their data directories.
    let restart_at = origin.elapsed();
    for id in VOTERS {
        tokio::task::block_in_place(|| cluster.node(id).start())?;
    }
    let restarted_leader = cluster.leader().await?;
    let leader_at = origin.elapsed();
    let deadline = Instant::now() + CLOSE_WAIT;
    loop {
        let states = gateway_counters(&cluster).await?;
        if states.iter().all(|counters| counters.circuit_state == 0.0) {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the circuits did not close within {CLOSE_WAIT:?} of the voters' return:\n{}",
                circuit_logs(&cluster)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed_at = origin.elapsed();
    until(origin, closed_at + Duration::from_secs(1)).await;
    let recovered = (origin.elapsed(), origin.elapsed() + RECOVERED_PHASE);
    let recovered_start = gateway_counters(&cluster).await?;
    until(origin, recovered.1).await;
    let recovered_end = gateway_counters(&cluster).await?;
    stop.send(true)?;
    let answers = collect(handles).await?;
    eprintln!(
        "voters restarted at {:.2} s, leader {restarted_leader} at {:.2} s, circuits closed at \
         {:.2} s; {} answers in {:.1} s",
        restart_at.as_secs_f64(),
        leader_at.as_secs_f64(),
        closed_at.as_secs_f64(),
        answers.len(),
        origin.elapsed().as_secs_f64()
    );

    // Answers kept coming, without error, through every phase: every second of the run
    // (by send time) has at least half the offered answers of each gateway.
    let errors: Vec<&Answer> =
        answers.iter().filter(|answer| matches!(answer.outcome, Outcome::Error(_))).collect();
    assert!(errors.is_empty(), "{} errors, first {:?}", errors.len(), errors.first());
    let offered_per_second = u64::from(OPEN_PER_SECOND + CLOSED_PER_SECOND);
    for second in 0..recovered.1.as_secs() {
        let from = Duration::from_secs(second);
        for gateway in GATEWAYS {
            let seen =
                sent_between(&answers, from, from + Duration::from_secs(1), None, Some(gateway));
            assert!(
                seen.len() as u64 >= offered_per_second / 2,
                "gateway {gateway}: {} answers for requests sent in second {second}",
                seen.len()
            );
        }
    }

    // Latency: the outage costs at most 5 ms at p99 over the baseline.
    let phases = [
        ("baseline", baseline),
        ("after the leader's kill", (killed_at, killed_at + PHASE)),
        ("outage", outage),
        ("recovered", recovered),
    ];
    for (name, (from, to)) in phases {
        let seen = sent_between(&answers, from, to, None, None);
        let open = sent_between(&answers, from, to, Some("open"), None);
        let closed = sent_between(&answers, from, to, Some("closed"), None);
        eprintln!(
            "{name} [{:.1} s, {:.1} s): {} answers, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; \
             open admitted {}/{}, closed admitted {}/{}",
            from.as_secs_f64(),
            to.as_secs_f64(),
            seen.len(),
            ms(percentile(seen.iter().copied(), 50)),
            ms(percentile(seen.iter().copied(), 99)),
            ms(percentile(seen.iter().copied(), 100)),
            count(&open, Outcome::Admitted),
            open.len(),
            count(&closed, Outcome::Admitted),
            closed.len(),
        );
    }
    let baseline_p99 =
        percentile(sent_between(&answers, baseline.0, baseline.1, None, None).into_iter(), 99);
    let outage_p99 =
        percentile(sent_between(&answers, outage.0, outage.1, None, None).into_iter(), 99);
    assert!(
        outage_p99 < baseline_p99 + ADDED_P99_MAX,
        "p99 during the outage {:.2} ms, baseline {:.2} ms",
        ms(outage_p99),
        ms(baseline_p99)
    );

    for (index, gateway) in GATEWAYS.into_iter().enumerate() {
        // The baseline was served from leases: the circuit closed, (almost) no bypass.
        let decisions = sent_between(&answers, baseline.0, baseline.1, None, Some(gateway)).len();
        let bypassed = healthy[index].bypassed - warm[index].bypassed;
        eprintln!("gateway {gateway}: {bypassed} bypasses in {decisions} baseline decisions");
        assert_eq!(
            (warm[index].circuit_state, healthy[index].circuit_state),
            (0.0, 0.0),
            "gateway {gateway}: the circuit was not closed in the baseline:\n{}",
            circuit_logs(&cluster)
        );
        assert!(
            bypassed <= decisions as f64 / 100.0,
            "gateway {gateway}: {bypassed} bypasses in {decisions} baseline decisions"
        );

        let (before, during) = (before_outage[index], during_outage[index]);
        eprintln!(
            "gateway {gateway}: healthy {:?}\n  before the outage {before:?}\n  during it \
             {during:?}\n  recovered {:?} -> {:?}",
            healthy[index], recovered_start[index], recovered_end[index]
        );
        // Fail-open: admitted from the fallback bucket, no more, and counted as bypasses.
        let open = sent_between(&answers, outage.0, outage.1, Some("open"), Some(gateway));
        let admitted = count(&open, Outcome::Admitted) as u64;
        let span =
            open.iter().map(|answer| answer.answered_at()).max().unwrap_or(outage.0) - outage.0;
        let fallback_max =
            FALLBACK_PER_SECOND + (FALLBACK_PER_SECOND as f64 * span.as_secs_f64()).ceil() as u64;
        let fallback_min = FALLBACK_PER_SECOND * PHASE.as_secs() * 8 / 10;
        assert!(
            (fallback_min..=fallback_max).contains(&admitted),
            "gateway {gateway}: {admitted} fail-open admissions in the outage, expected \
             [{fallback_min}, {fallback_max}] from a bucket of {FALLBACK_PER_SECOND}/s"
        );
        assert!(during.bypassed_circuit_open > before.bypassed_circuit_open, "gateway {gateway}");
        // Fail-closed: denied, and counted.
        let closed = sent_between(&answers, outage.0, outage.1, Some("closed"), Some(gateway));
        assert!(closed.len() >= 100, "gateway {gateway}: {} fail-closed requests", closed.len());
        assert_eq!(count(&closed, Outcome::OverLimit), closed.len(), "gateway {gateway}");
        assert!(during.failed_closed > before.failed_closed, "gateway {gateway}");
        assert!(
            [1.0, 2.0].contains(&during.circuit_state),
            "gateway {gateway}: circuit {} while no voter runs",
            during.circuit_state
        );

        // Recovered: leases granted again, bypasses stopped.
        let (start, end) = (recovered_start[index], recovered_end[index]);
        assert!(end.calls_ok > start.calls_ok, "gateway {gateway}: no ledger call succeeded");
        assert_eq!(end.circuit_state, 0.0, "gateway {gateway}: the circuit reopened");
        let decisions = sent_between(&answers, recovered.0, recovered.1, None, Some(gateway)).len();
        let bypassed = end.bypassed - start.bypassed;
        eprintln!(
            "gateway {gateway}: {admitted} fail-open admissions in the outage (bucket allows \
             {fallback_max}); {bypassed} bypasses in {decisions} decisions after recovery"
        );
        // As in the baseline: a lease slower than the ledger timeout may still be bypassed
        // now and then; a circuit still open would bypass most fail-open decisions.
        assert!(
            bypassed <= decisions as f64 / 100.0,
            "gateway {gateway}: {bypassed} bypasses in {decisions} decisions after recovery"
        );
    }
    Ok(())
}

// Proves the accounting of a quorum loss, the leasing issue's target: two gateways offer the
// fail-open key 1.2x its limit and the fail-closed key a fifth of it; the leader and one
// follower are stopped (SIGSTOP) for 20 s, then continued. From the loss until 60 s after the
// quorum is back, the fail-open key admits at most what one central bucket allows over that
// span (its capacity plus its refill) plus the fallback allowance (each gateway's bucket,
// from its share of the capacity at the rule's rate over the nodes, for as long as its
// circuit was not closed) plus the tokens leased before the loss (the drift bound): what the
// fallback admitted is debt, paid before new grants, and from 20 s after the quorum is back
// the key is admitted at its limit again. Fail-closed requests are admitted again within 2 s
// of the quorum's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_quorum_costs_no_more_than_the_fallback_allowance() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let cluster = start_region("").await?;
    let (stop, stopped) = watch::channel(false);
    let origin = Instant::now();
    let mut handles = Vec::new();
    for gateway in GATEWAYS {
        let address = cluster.nodes[&gateway].rls_addr;
        for (label, key, per_second, tasks) in [
            ("open", "user", QUORUM_OPEN_PER_SECOND, 16),
            ("closed", "payment", CLOSED_PER_SECOND, TASKS),
        ] {
            let stream = Stream {
                node: gateway,
                address,
                label,
                entry: (key, "quorum".to_owned()),
                per_second,
                tasks,
            };
            handles.extend(start_stream(&stream, origin, &stopped).await?);
        }
    }
    until(origin, WARM_UP).await;
    let leader = cluster.leader().await?;
    let follower = VOTERS.into_iter().find(|id| *id != leader).context("a follower")?;
    let stopped_voters = [leader, follower];
    for id in stopped_voters {
        cluster.nodes[&id].process.as_ref().context("running")?.signal("STOP")?;
    }
    let lost_at = origin.elapsed();
    let survivor =
        VOTERS.into_iter().find(|id| !stopped_voters.contains(id)).context("a third voter")?;
    survivor_campaigns(&cluster, survivor, stopped_voters).await?;
    until(origin, lost_at + QUORUM_LOSS).await;
    for id in stopped_voters {
        cluster.nodes[&id].process.as_ref().context("running")?.signal("CONT")?;
    }
    let back_at = origin.elapsed();
    // When each gateway's circuit closed again: the end of its fallback allowance.
    let mut closed_at: Vec<Option<Duration>> = vec![None; GATEWAYS.len()];
    while closed_at.iter().any(Option::is_none) && origin.elapsed() < back_at + CLOSE_WAIT {
        for (index, counters) in gateway_counters(&cluster).await?.iter().enumerate() {
            if closed_at[index].is_none() && counters.circuit_state == 0.0 {
                closed_at[index] = Some(origin.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let end = back_at + QUORUM_AFTER;
    until(origin, end).await;
    stop.send(true)?;
    let answers = collect(handles).await?;
    let errors: Vec<&Answer> =
        answers.iter().filter(|answer| matches!(answer.outcome, Outcome::Error(_))).collect();
    assert!(errors.is_empty(), "{} errors, first {:?}", errors.len(), errors.first());
    eprintln!(
        "stopped voters {stopped_voters:?} at {:.2} s, continued at {:.2} s; circuits closed at \
         {:?}",
        lost_at.as_secs_f64(),
        back_at.as_secs_f64(),
        closed_at.iter().map(|at| at.map(|at| at.as_secs_f64())).collect::<Vec<_>>()
    );

    // Fail-open accounting over the loss and the 60 s after it.
    let open = sent_between(&answers, lost_at, end, Some("open"), None);
    let admitted = count(&open, Outcome::Admitted) as u64;
    let last_answer = open.iter().map(|answer| answer.answered_at()).max().unwrap_or(end);
    let span = last_answer.saturating_sub(lost_at);
    let central = BURST_TOKENS + (LIMIT_PER_SECOND as f64 * span.as_secs_f64()).ceil() as u64;
    let mut allowance = 0;
    for (index, gateway) in GATEWAYS.into_iter().enumerate() {
        let closed = closed_at[index].with_context(|| {
            format!("gateway {gateway}: the circuit did not close:\n{}", circuit_logs(&cluster))
        })?;
        let not_closed = closed.saturating_sub(lost_at);
        allowance += BURST_TOKENS / NODES_IN_REGION
            + (FALLBACK_PER_SECOND as f64 * not_closed.as_secs_f64()).ceil() as u64;
    }
    let drift_bound_tokens =
        LeaseTuning::default().drift_bound_tokens(&user_limit(), NODES_IN_REGION, true, None);
    let bound = central + allowance + drift_bound_tokens;
    let during = sent_between(&answers, lost_at, back_at, Some("open"), None);
    eprintln!(
        "fail-open key: {admitted} admitted over {:.1} s (during the loss {}); a central bucket \
         allows {central} ({:+.2} %), bound {bound} with the fallback allowance {allowance} and \
         the drift bound {drift_bound_tokens}",
        span.as_secs_f64(),
        count(&during, Outcome::Admitted),
        (admitted as f64 / central as f64 - 1.0) * 100.0,
    );
    let case = "quorum lost for 20 s";
    figure(
        case,
        "fail-open admitted over the loss + 60 s against a central bucket; against the bound",
        format!(
            "{:+.2} %; {:.3}",
            (admitted as f64 / central as f64 - 1.0) * 100.0,
            admitted as f64 / bound as f64
        ),
    );
    assert!(admitted <= bound, "admitted {admitted} > {bound}");

    // The debt is paid, and the key is at its limit again.
    let recovered = sent_between(&answers, back_at + DEBT_PAID, end, Some("open"), None);
    let recovered_admitted = count(&recovered, Outcome::Admitted) as u64;
    let recovered_span = recovered
        .iter()
        .map(|answer| answer.answered_at())
        .max()
        .unwrap_or(end)
        .saturating_sub(back_at + DEBT_PAID);
    let at_limit = LIMIT_PER_SECOND as f64 * recovered_span.as_secs_f64();
    eprintln!(
        "fail-open key from {} s after the quorum's return: {recovered_admitted} admitted, the \
         limit allows {at_limit:.0} ({:+.2} %)",
        DEBT_PAID.as_secs(),
        (recovered_admitted as f64 / at_limit - 1.0) * 100.0
    );
    figure(
        case,
        "fail-open admitted from 20 s after the return against the limit",
        format!("{:+.2} %", (recovered_admitted as f64 / at_limit - 1.0) * 100.0),
    );
    assert!(
        recovered_admitted as f64 >= at_limit * (1.0 - RECOVERED_SHORTFALL_PERCENT / 100.0),
        "{recovered_admitted} admitted after the debt was paid, the limit allows {at_limit:.0}"
    );
    assert!(
        recovered_admitted <= at_limit.ceil() as u64 + BURST_TOKENS + drift_bound_tokens,
        "{recovered_admitted} admitted after the debt was paid, the limit allows {at_limit:.0}"
    );

    // Fail-closed: denied while the quorum is lost, admitted again within 2 s of its return.
    for gateway in GATEWAYS {
        let lost =
            sent_between(&answers, lost_at + OUTAGE_SETTLE, back_at, Some("closed"), Some(gateway));
        assert_eq!(
            count(&lost, Outcome::Admitted),
            0,
            "gateway {gateway}: fail-closed requests admitted without a quorum; the \
             gateways' circuits:\n{}",
            circuit_logs(&cluster)
        );
        let first_admitted = sent_between(&answers, back_at, end, Some("closed"), Some(gateway))
            .into_iter()
            .find(|answer| answer.outcome == Outcome::Admitted)
            .map(|answer| answer.answered_at() - back_at)
            .with_context(|| format!("gateway {gateway}: no fail-closed admission after"))?;
        eprintln!(
            "gateway {gateway}: fail-closed admitted again {:.0} ms after the quorum's return",
            ms(first_admitted)
        );
        figure(
            case,
            &format!("gateway {gateway}: fail-closed admits again after the return"),
            format!("{:.0} ms", ms(first_admitted)),
        );
        assert!(
            first_admitted <= FAIL_CLOSED_BACK_MAX,
            "gateway {gateway}: fail-closed admitted again after {first_admitted:?}"
        );
    }
    Ok(())
}

/// The quota leader is stopped (SIGSTOP) this long: past the deadline a call is judged by (4x
/// the ledger's p90 latency, at least 100 ms), short of the followers' election timeout
/// (300 ms at least, after heartbeats 50 ms apart), so the stalled calls commit and answer
/// once it continues.
const STALL: Duration = Duration::from_millis(200);
/// The shipped floor of the deadline a ledger call is judged slow by.
const DEADLINE_FLOOR: Duration = Duration::from_millis(100);
/// Stalls tried at most; one that cost the leader its term proves nothing and is not judged.
const STALL_ATTEMPTS: usize = 8;
/// Stalls judged (those that opened a circuit) before the test ends.
const STALLS_JUDGED: usize = 3;
/// Longest a circuit may stay open, on average per opening, over a judged stall. Opened by
/// the stalled calls (at least 100 ms into the stall), it stays open until their late answers
/// come (at most the stall's rest); were only the next probe to end it, that would be one
/// probe interval, 1 s, after it opened.
const OPEN_PER_OPENING_MAX: Duration = Duration::from_millis(500);
/// Each gateway asks about a key it has never seen this often: every new key asks the ledger
/// for its first lease, so calls go out one batch window apart and several are in flight when
/// the leader stops.
const NEW_KEY_EVERY: Duration = Duration::from_millis(4);

/// Waits until every gateway's circuit is in one of `states`; false after `within`.
async fn circuits_in(
    cluster: &common::cluster::Cluster,
    states: &[f64],
    within: Duration,
) -> Result<bool> {
    let deadline = Instant::now() + within;
    loop {
        let mut all = true;
        for gateway in GATEWAYS {
            all &= states.contains(&counters(cluster, gateway).await?.circuit_state);
        }
        if all {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each gateway's calls judged slow and seconds stalled since `before`, once every gateway
/// with such a call has counted its stall (which it does when the last of them ends), or
/// [`CLOSE_WAIT`] has passed.
async fn stalls_counted(
    cluster: &common::cluster::Cluster,
    before: &[Counters],
) -> Result<Vec<(f64, f64)>> {
    let deadline = Instant::now() + CLOSE_WAIT;
    loop {
        let now = gateway_counters(cluster).await?;
        let stalls: Vec<(f64, f64)> = now
            .iter()
            .zip(before)
            .map(|(a, b)| (a.slow_calls - b.slow_calls, a.stalled_seconds - b.stalled_seconds))
            .collect();
        if stalls.iter().all(|(slow, seconds)| *slow == 0.0 || *seconds > 0.0)
            || Instant::now() > deadline
        {
            return Ok(stalls);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Proves that a ledger call judged slow but answered after all resumes leasing at once: while
// each gateway asks about a new key every 4 ms, the quota leader is stopped (SIGSTOP) for
// 200 ms, so the calls in flight pass their deadline and open the gateways' circuits; when it
// continues, their late answers half-open the circuits. Over every stall that opened a circuit
// and kept the leader's term, the circuits were open at most 500 ms per opening on average
// (left to the next probe, 1 s each), each gateway whose calls were judged slow counted a
// stall of at least the 100 ms deadline floor and at most the stall and a second
// (`quotamesh_ledger_stalled_seconds_total`), and no request failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_call_that_answers_resumes_leasing_at_once() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let cluster = start_region("").await?;
    let (stop, stopped) = watch::channel(false);
    let origin = Instant::now();
    let mut handles = Vec::new();
    for gateway in GATEWAYS {
        let mut client = rls_client(cluster.nodes[&gateway].rls_addr).await?;
        let mut stopped = stopped.clone();
        handles.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            let mut interval = tokio::time::interval(NEW_KEY_EVERY);
            for key in 0_u64.. {
                tokio::select! {
                    _ = interval.tick() => {}
                    _ = stopped.changed() => {}
                }
                if *stopped.borrow() {
                    break;
                }
                let entry = ("tenant", format!("new-{gateway}-{key}"));
                answers
                    .push(send_one(&mut client, gateway, "new", (entry.0, &entry.1), origin).await);
            }
            answers
        }));
    }
    until(origin, WARM_UP).await;

    let mut judged = Vec::new();
    for attempt in 1..=STALL_ATTEMPTS {
        if judged.len() == STALLS_JUDGED {
            break;
        }
        if !circuits_in(&cluster, &[0.0], CLOSE_WAIT).await? {
            bail!("the circuits did not close between stalls:\n{}", circuit_logs(&cluster));
        }
        let leader = cluster.leader().await?;
        let term = |text: &str| metric_value(text, "quotamesh_raft_term{group=\"quota\"}");
        let term_before = term(&scrape(cluster.nodes[&leader].metrics_addr).await?);
        let before = gateway_counters(&cluster).await?;
        let process = cluster.nodes[&leader].process.as_ref().context("running")?;
        tokio::task::block_in_place(|| -> Result<()> {
            process.signal("STOP")?;
            std::thread::sleep(STALL);
            process.signal("CONT")
        })?;
        // An opening is added to the open seconds when it ends.
        let left_open = circuits_in(&cluster, &[0.0, 1.0], CLOSE_WAIT).await?;
        let term_after = term(&scrape(cluster.nodes[&leader].metrics_addr).await?);
        let after = gateway_counters(&cluster).await?;
        let opened: f64 =
            after.iter().zip(&before).map(|(a, b)| a.circuit_opened - b.circuit_opened).sum();
        let open_seconds: f64 = after
            .iter()
            .zip(&before)
            .map(|(a, b)| a.circuit_open_seconds - b.circuit_open_seconds)
            .sum();
        eprintln!(
            "stall {attempt} of leader {leader}: term {term_before} -> {term_after}, {opened} \
             openings, {open_seconds:.3} s open in all, circuits left open: {left_open}"
        );
        if term_after != term_before || opened == 0.0 {
            continue;
        }
        assert!(left_open, "a circuit stayed open:\n{}", circuit_logs(&cluster));
        // A gateway with calls judged slow counts the stall once the last of them ends: at
        // least the deadline floor (each was outstanding that long), at most the stall and
        // a second.
        for (gateway, (slow, seconds)) in
            GATEWAYS.iter().zip(stalls_counted(&cluster, &before).await?)
        {
            eprintln!("gateway {gateway}: {slow} calls judged slow, stalled {seconds:.3} s");
            if slow > 0.0 {
                assert!(
                    (DEADLINE_FLOOR.as_secs_f64()..=(STALL + Duration::from_secs(1)).as_secs_f64())
                        .contains(&seconds),
                    "gateway {gateway}: {slow} calls judged slow, stalled {seconds:.3} s"
                );
            }
        }
        judged.push(open_seconds / opened);
    }
    stop.send(true)?;
    let answers = collect(handles).await?;
    let errors: Vec<&Answer> =
        answers.iter().filter(|answer| matches!(answer.outcome, Outcome::Error(_))).collect();
    assert!(errors.is_empty(), "{} errors, first {:?}", errors.len(), errors.first());
    anyhow::ensure!(
        !judged.is_empty(),
        "no stall of {STALL:?} opened a circuit and kept the leader's term in \
         {STALL_ATTEMPTS} attempts; {} requests answered",
        answers.len()
    );
    let longest = judged.iter().copied().fold(0.0, f64::max);
    figure(
        "a slow call that answers",
        "longest average time open per opening over a stall",
        format!("{:.0} ms ({} stalls judged)", longest * 1000.0, judged.len()),
    );
    for open_per_opening in judged {
        assert!(
            open_per_opening <= OPEN_PER_OPENING_MAX.as_secs_f64(),
            "a circuit opened by a stall of {STALL:?} stayed open {:.0} ms per opening on \
             average:\n{}",
            open_per_opening * 1000.0,
            circuit_logs(&cluster)
        );
    }
    Ok(())
}

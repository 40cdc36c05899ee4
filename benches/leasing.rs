//! What local-first leasing costs the ledger, and what it over-admits, on one hot key.
//!
//! Part 1, ledger traffic: for each lease policy (static, B fixed at 50; proportional,
//! the DESIGN defaults `B = clamp(5, rate * 250 ms, 500)`) and each rate (10, 1,000 and
//! 10,000 decisions per second on ONE key, paced by a timer, each decision a task of its
//! own as concurrent RLS requests are), drives `ShardSet::decide` under a limit far above
//! the rate, so nothing is rejected, and prints the decisions per second achieved, ledger
//! calls (batched `SettleLeases` writes, the sweep's settlements included) and
//! per-key lease asks per decision, the same after the first second (once the rate
//! estimate has settled), the decisions paid from the fallback bucket (a lease that came
//! too late), and the tokens held at the end. The issue's targets for the proportional
//! policy are printed beside its figures as PASS or FAIL; they are never asserted (a
//! shared machine is noisy).
//!
//! Part 2, over-admission: drives a key limited to 1,000/s (burst 1,000) at 2,000/s and
//! compares what was admitted with `limit * elapsed + burst`, per 1 s window and in total;
//! any excess is set against the drift bound of one node (`LeaseTuning::drift_bound_tokens`),
//! and the admissions paid from the fallback bucket are counted by reason.
//!
//! The ledger is a real single-node quota group on disk (`support::ledger`), fsync on.
//! Every run uses a key of its own and a fresh shard set, lease broker and circuit breaker,
//! so a breaker that opened in one run (a slow disk) does not carry into the next. Calls are
//! judged by the node's default (the ledger's measured latency), or by a fixed deadline of
//! `LEASING_BENCH_LEDGER_TIMEOUT_MS`; decisions paid from the fallback bucket are counted in
//! the `fallback` column (past 1 % of the decisions, such a run measures the breaker, not
//! leasing, and its target verdict says so). Each run also prints the ledger call latency (p50 and p99, as
//! histogram bucket bounds), the calls that failed or timed out, and the circuit's state
//! at the end.
//!
//! Run: `cargo bench --bench leasing`.
//!
//! ```text
//!  timer (1 ms, or 1/rate) ──▶ decide x due ──▶ shard set ──refill at watermark──▶ broker
//!                                                   ▲                        (1 ms batches)
//!                                                   └──── grants ◀── quota group (on disk)
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::core::Metric as _;
use quotamesh::actors::shard::{Decision, ShardError, ShardSet};
use quotamesh::core::admission::BypassReason;
use quotamesh::core::lease::LeaseTuning;
use quotamesh::core::policy::FailureMode;
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::metrics::Metrics;

mod support;

/// The traffic rates of part 1, with how long each runs: the slowest runs longest so that
/// it still makes a hundred decisions.
const RATES: [(u64, Duration); 3] = [
    (10, Duration::from_secs(10)),
    (1_000, Duration::from_secs(5)),
    (10_000, Duration::from_secs(5)),
];
/// The issue's targets for the proportional policy: at most one ledger call per this many
/// decisions, at the given rate.
const TARGETS: [(u64, u64); 2] = [(1_000, 50), (10_000, 500)];
/// Unreported traffic on a fresh ledger before the measured runs.
const WARM_UP: Duration = Duration::from_secs(3);
/// Part 2: the limit (per second, and the burst), driven at twice the limit.
const OVER_LIMIT_PER_SECOND: u64 = 1_000;
const OVER_BURST_TOKENS: u64 = 1_000;
const OVER_DURATION: Duration = Duration::from_secs(5);

/// What one paced run measured.
struct Run {
    decisions: u64,
    admitted: u64,
    /// Admitted decisions paid from the fallback bucket instead of a lease.
    fallback: u64,
    elapsed: Duration,
    ledger_calls: u64,
    /// Ledger calls that failed or timed out.
    failed_calls: u64,
    lease_asks: u64,
    /// Decisions and ledger calls from the first second on.
    settled_decisions: u64,
    settled_ledger_calls: u64,
    held_tokens_end: u64,
    /// Ledger call latency, p50 and p99, as text.
    call_latency: String,
    /// The circuit's state at the end, as text.
    circuit: &'static str,
    /// Fallback decisions by reason, as text.
    fallback_reasons: String,
    /// Admitted decisions per whole second since the start.
    admitted_per_second: Vec<u64>,
}

/// Batched ledger calls so far, whatever their result.
fn ledger_calls(metrics: &Metrics) -> u64 {
    ["ok", "slow", "error"]
        .iter()
        .map(|result| metrics.ledger_calls.with_label_values(&[result]).get())
        .sum()
}

/// Per-key lease asks so far, queued or refused.
fn lease_asks(metrics: &Metrics) -> u64 {
    ["queued", "refused"]
        .iter()
        .map(|result| metrics.lease_asks.with_label_values(&[result]).get())
        .sum()
}

/// Decisions paid from the fallback so far, by reason.
fn fallback_reasons(metrics: &Metrics) -> String {
    [BypassReason::LedgerTimeout, BypassReason::CircuitOpen, BypassReason::Overloaded]
        .iter()
        .map(|reason| {
            let count = metrics.rate_limit_bypassed.with_label_values(&[reason.label()]).get();
            format!("{} {count}", reason.label())
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The upper bound, in ms, of the histogram bucket holding the `quantile` of the ledger
/// call latencies ("-" without calls, ">100" above the last bucket).
fn ledger_call_quantile_ms(metrics: &Metrics, quantile: f64) -> String {
    let metric = metrics.ledger_call_duration.metric();
    let histogram = metric.get_histogram();
    let count = histogram.get_sample_count();
    if count == 0 {
        return "-".to_owned();
    }
    let rank = ((count as f64 * quantile).ceil() as u64).max(1);
    histogram
        .get_bucket()
        .iter()
        .find(|bucket| bucket.cumulative_count() >= rank)
        .map_or_else(|| ">100".to_owned(), |bucket| format!("{}", bucket.upper_bound() * 1_000.0))
}

/// A fresh shard set (and lease broker, and circuit breaker) leasing from `ledger`.
async fn fresh_shards(
    ledger: &support::Ledger,
    metrics: &Metrics,
    ledger_timeout_ms: Option<u64>,
) -> anyhow::Result<ShardSet> {
    let setup = support::Setup { ledger_timeout_ms, ..support::Setup::default() };
    support::shard_set(ledger, setup, support::no_policy(), metrics).await
}

/// Drives `rate_per_second` decisions of one hit on the key `api_key=value` for `duration`,
/// through a fresh shard set with its own metrics.
///
/// A timer ticks every 1/rate (at most every millisecond) and each tick issues the
/// decisions due by then, each as a task of its own, as concurrent RLS requests would be:
/// a decision that waits for its lease does not hold back the next, so the offered rate
/// holds even when the key is over its limit. Admissions are counted in the second the
/// decision was issued.
async fn drive(
    ledger: &support::Ledger,
    ledger_timeout_ms: Option<u64>,
    value: &str,
    spec: &LimitSpec,
    lease: &LeaseTuning,
    rate_per_second: u64,
    duration: Duration,
) -> anyhow::Result<Run> {
    let metrics = Metrics::new();
    let shards = Arc::new(fresh_shards(ledger, &metrics, ledger_timeout_ms).await?);
    let value: Arc<str> = Arc::from(value);
    let tick = Duration::from_micros((1_000_000 / rate_per_second).max(1_000));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut tasks = tokio::task::JoinSet::new();
    let mut settled_from = None;
    let mut issued = 0_u64;
    let mut admitted = 0_u64;
    let mut fallback = 0_u64;
    let mut admitted_per_second = vec![0_u64; usize::try_from(duration.as_secs())?.max(1)];
    let mut count = |(second, decision): (usize, Result<Decision, ShardError>)| {
        let decision = decision?;
        if decision.admitted {
            admitted += 1;
            if let Some(count) = admitted_per_second.get_mut(second) {
                *count += 1;
            }
            if decision.bypass.is_some() {
                fallback += 1;
            }
        }
        anyhow::Ok(())
    };
    let started = Instant::now();
    loop {
        interval.tick().await;
        let elapsed = started.elapsed();
        if elapsed >= duration {
            break;
        }
        if settled_from.is_none() && elapsed >= Duration::from_secs(1) {
            settled_from = Some((issued, ledger_calls(&metrics)));
        }
        // One decision at time 0, then one per 1/rate.
        let due = u64::try_from(elapsed.as_micros() * u128::from(rate_per_second) / 1_000_000)?
            .saturating_add(1);
        let second = usize::try_from(elapsed.as_secs())?;
        for _ in issued..due {
            let (shards, value, spec, lease) =
                (Arc::clone(&shards), Arc::clone(&value), *spec, *lease);
            tasks.spawn(async move {
                let probe = support::probe(
                    &shards,
                    "bench",
                    ("api_key", &value),
                    &spec,
                    &lease,
                    FailureMode::Open,
                    1,
                );
                (second, shards.decide(&probe, quotamesh::clock::now_ms()).await)
            });
        }
        issued = issued.max(due);
        while let Some(done) = tasks.try_join_next() {
            count(done?)?;
        }
    }
    while let Some(done) = tasks.join_next().await {
        count(done?)?;
    }
    let elapsed = started.elapsed();
    let held_tokens_end = shards.held_tokens(quotamesh::clock::now_ms());
    let ledger_calls_total = ledger_calls(&metrics);
    let (settled_decisions, settled_ledger_calls) = settled_from
        .map_or((0, 0), |(issued_then, calls_then)| {
            (issued - issued_then, ledger_calls_total - calls_then)
        });
    let circuit = match metrics.ledger_circuit_state.get() {
        0 => "closed",
        1 => "probing",
        _ => "open",
    };
    let call_latency = format!(
        "{}/{}",
        ledger_call_quantile_ms(&metrics, 0.5),
        ledger_call_quantile_ms(&metrics, 0.99)
    );
    Arc::into_inner(shards)
        .ok_or_else(|| anyhow::anyhow!("every decision task has ended"))?
        .shutdown()
        .await;
    Ok(Run {
        decisions: issued,
        admitted,
        fallback,
        elapsed,
        ledger_calls: ledger_calls_total,
        failed_calls: metrics.ledger_calls.with_label_values(&["error"]).get(),
        lease_asks: lease_asks(&metrics),
        settled_decisions,
        settled_ledger_calls,
        held_tokens_end,
        call_latency,
        circuit,
        fallback_reasons: fallback_reasons(&metrics),
        admitted_per_second,
    })
}

/// `calls / decisions` as a decimal and as "1/N".
fn per_decision(calls: u64, decisions: u64) -> String {
    if decisions == 0 {
        return "-".to_owned();
    }
    let ratio = calls as f64 / decisions as f64;
    if calls == 0 {
        format!("{ratio:.5} (none)")
    } else {
        format!("{ratio:.5} = 1/{:.0}", decisions as f64 / calls as f64)
    }
}

async fn ledger_traffic(
    ledger: &support::Ledger,
    ledger_timeout_ms: Option<u64>,
) -> anyhow::Result<()> {
    let roomy = LimitSpec::new(Algorithm::TokenBucket, 1_000_000_000, 1_000, None)?;
    let policies = [
        ("static", LeaseTuning::with_sizes(50, 50, 250)?),
        ("proportional", LeaseTuning::default()),
    ];
    println!(
        "Part 1: ledger traffic of one key, limit 1e9/s (nothing rejected), ledger deadline \
         {}",
        ledger_timeout_ms.map_or_else(|| "measured".to_owned(), |ms| format!("{ms} ms"))
    );
    for (rate, duration) in RATES {
        println!("  rate {rate:>6}/s runs {:.0} s per policy", duration.as_secs_f64());
    }
    println!(
        "{:<12} {:>6} {:>10} {:>18} {:>18} {:>18} {:>10} {:>6} {:>8} {:>5} {:>7}  target",
        "policy",
        "rate/s",
        "achieved/s",
        "ledger calls/dec",
        "after 1st s",
        "lease asks/dec",
        "call ms",
        "failed",
        "fallback",
        "held",
        "circuit",
    );
    for (name, lease) in &policies {
        for (rate, duration) in RATES {
            let value = format!("{name}-{rate}");
            let run =
                drive(ledger, ledger_timeout_ms, &value, &roomy, lease, rate, duration).await?;
            let target = TARGETS
                .iter()
                .find(|(target_rate, _)| *name == "proportional" && *target_rate == rate)
                .map_or_else(String::new, |(_, per)| {
                    let pass = run.ledger_calls.saturating_mul(*per) <= run.decisions;
                    let verdict = if pass { "PASS" } else { "FAIL" };
                    // Above 1 % of decisions paid from the fallback, the run measured the
                    // circuit breaker rather than leasing.
                    if run.fallback.saturating_mul(100) <= run.decisions {
                        format!("<= 1/{per} {verdict}")
                    } else {
                        format!("<= 1/{per} {verdict} (unreliable: fallback paid)")
                    }
                });
            println!(
                "{:<12} {:>6} {:>10.1} {:>18} {:>18} {:>18} {:>10} {:>6} {:>8} {:>5} {:>7}  {}",
                name,
                rate,
                run.decisions as f64 / run.elapsed.as_secs_f64(),
                per_decision(run.ledger_calls, run.decisions),
                per_decision(run.settled_ledger_calls, run.settled_decisions),
                per_decision(run.lease_asks, run.decisions),
                run.call_latency,
                run.failed_calls,
                run.fallback,
                run.held_tokens_end,
                run.circuit,
                target,
            );
            anyhow::ensure!(run.admitted == run.decisions, "a roomy limit rejected a decision");
        }
    }
    Ok(())
}

async fn over_admission(
    ledger: &support::Ledger,
    ledger_timeout_ms: Option<u64>,
) -> anyhow::Result<()> {
    let spec = LimitSpec::new(
        Algorithm::TokenBucket,
        OVER_LIMIT_PER_SECOND,
        1_000,
        Some(OVER_BURST_TOKENS),
    )?;
    let lease = LeaseTuning::default();
    let drift_bound = lease.drift_bound_tokens(&spec, 1, true, None);
    let rate = 2 * OVER_LIMIT_PER_SECOND;
    println!();
    println!(
        "Part 2: over-admission, limit {OVER_LIMIT_PER_SECOND}/s burst {OVER_BURST_TOKENS}, \
         driven at {rate}/s for {:.0} s, proportional leases; drift bound {drift_bound} tokens",
        OVER_DURATION.as_secs_f64()
    );
    let run =
        drive(ledger, ledger_timeout_ms, "over-admission", &spec, &lease, rate, OVER_DURATION)
            .await?;
    println!(
        "{:<8} {:>8} {:>8} {:>6} {:>10} {:>8} {:>6}  within drift bound",
        "window", "admitted", "allowed", "excess", "cumulative", "allowed", "excess"
    );
    let mut cumulative = 0;
    for (second, admitted) in (0_u64..).zip(&run.admitted_per_second) {
        cumulative += admitted;
        let allowed = OVER_LIMIT_PER_SECOND + OVER_BURST_TOKENS;
        let excess = admitted.saturating_sub(allowed);
        let window_end = Duration::from_secs(second + 1).min(run.elapsed);
        let cumulative_allowed = allowed_by(window_end);
        let cumulative_excess = cumulative.saturating_sub(cumulative_allowed);
        println!(
            "{:<8} {:>8} {:>8} {:>6} {:>10} {:>8} {:>6}  {}",
            format!("{second}-{} s", second + 1),
            admitted,
            allowed,
            excess,
            cumulative,
            cumulative_allowed,
            cumulative_excess,
            if excess.max(cumulative_excess) <= drift_bound { "yes" } else { "NO" },
        );
    }
    println!(
        "(a window's allowance is limit * 1 s + burst; the cumulative one limit * t + burst, \
         t from the start)"
    );
    let allowed = allowed_by(run.elapsed);
    let excess = run.admitted.saturating_sub(allowed);
    println!(
        "total: {} decisions in {:.3} s, admitted {} of allowed {allowed} (limit * elapsed + \
         burst): excess {excess}, drift bound {drift_bound} ({}); paid from leases {}, from \
         the fallback {} ({})",
        run.decisions,
        run.elapsed.as_secs_f64(),
        run.admitted,
        if excess <= drift_bound { "within" } else { "OVER" },
        run.admitted - run.fallback,
        run.fallback,
        run.fallback_reasons,
    );
    println!(
        "       {} ledger calls ({} per decision), {} failed, call ms p50/p99 {}, circuit {}, \
         held at the end {}",
        run.ledger_calls,
        per_decision(run.ledger_calls, run.decisions),
        run.failed_calls,
        run.call_latency,
        run.circuit,
        run.held_tokens_end,
    );
    Ok(())
}

/// `limit * elapsed + burst`: what the ledger's bucket can have granted by `elapsed`.
fn allowed_by(elapsed: Duration) -> u64 {
    let refilled = u128::from(OVER_LIMIT_PER_SECOND) * elapsed.as_micros() / 1_000_000;
    u64::try_from(refilled).unwrap_or(u64::MAX).saturating_add(OVER_BURST_TOKENS)
}

fn main() -> anyhow::Result<()> {
    let ledger_timeout_ms = match std::env::var("LEASING_BENCH_LEDGER_TIMEOUT_MS") {
        Ok(text) => Some(text.parse()?),
        Err(_) => support::Setup::default().ledger_timeout_ms,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async {
        let ledger = support::ledger(true).await?;
        // A fresh ledger's first commits (files created, a disk still writing back the
        // bench's build) are the slowest: warm it up on a key of its own, unreported.
        let roomy = LimitSpec::new(Algorithm::TokenBucket, 1_000_000_000, 1_000, None)?;
        let lease = LeaseTuning::default();
        let warm_up =
            drive(&ledger, ledger_timeout_ms, "warm-up", &roomy, &lease, 1_000, WARM_UP).await?;
        println!(
            "warm-up: {:.0} s at 1000/s, ledger call ms p50/p99 {}, circuit {}",
            WARM_UP.as_secs_f64(),
            warm_up.call_latency,
            warm_up.circuit
        );
        ledger_traffic(&ledger, ledger_timeout_ms).await?;
        over_admission(&ledger, ledger_timeout_ms).await?;
        anyhow::Ok(())
    })
}

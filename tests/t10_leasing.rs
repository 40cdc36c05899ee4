//! Local-first leasing in one process, against a real quota ledger (a single-node Raft group
//! on disk, fsync on): shard actors spend leased tokens, the lease broker keeps them
//! supplied, a blocked key stays local, idle balances go back, and an unreachable ledger
//! opens the circuit so fail-open rules admit from the fallback and fail-closed rules deny.
//!
//! Every test runs the node's defaults (ledger calls judged by measured latency, a 15 ms
//! wait budget): a decision that waited too long on a slow disk is paid from the fallback
//! and charged to the ledger, so the counts these tests check hold on a busy machine too.

use std::time::Duration;

use quotamesh::actors::shard::ShardSet;
use quotamesh::config::LeasingConfig;
use quotamesh::core::admission::{BypassReason, FAIL_CLOSED_RETRY_AFTER_MS};
use quotamesh::core::lease::LeaseTuning;
use quotamesh::core::lease_key::LeaseKey;
use quotamesh::core::ledger::NodeId;
use quotamesh::core::policy::FailureMode;
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::metrics::Metrics;

#[path = "../benches/support/mod.rs"]
mod support;

/// The node's defaults, with a quicker sweep so returns show within the tests' patience.
const DEFAULTS: support::Setup = support::Setup {
    shard_count: 2,
    keys_per_shard_max: 100_000,
    sweep_interval: Duration::from_millis(100),
    ledger_timeout_ms: None,
    nodes_in_region: 1,
};

async fn leasing(setup: support::Setup, reachable: bool) -> (support::Ledger, ShardSet, Metrics) {
    let ledger = support::ledger(reachable).await.expect("a ledger");
    let metrics = Metrics::new();
    let shards = support::shard_set(&ledger, setup, support::no_policy(), &metrics)
        .await
        .expect("a shard set");
    (ledger, shards, metrics)
}

fn counter(metrics: &Metrics, family: &str, label: &str) -> u64 {
    match family {
        "asks" => metrics.lease_asks.with_label_values(&[label]).get(),
        "calls" => metrics.ledger_calls.with_label_values(&[label]).get(),
        "bypassed" => metrics.rate_limit_bypassed.with_label_values(&[label]).get(),
        other => panic!("no counter family {other}"),
    }
}

/// A burst of 30 requests at a bucket of 20 admits the bucket's 20 plus what it refilled
/// meanwhile, however long the ledger takes (what a wait could not pay is charged to it),
/// and the ledger accounts for the tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_enforce_the_limit_exactly() {
    let (ledger, shards, metrics) = leasing(DEFAULTS, true).await;
    let spec = LimitSpec::new(Algorithm::TokenBucket, 20, 1_000, Some(20)).expect("a valid limit");
    let lease = LeaseTuning::default();
    let probe = support::probe(&shards, "t", ("user", "u1"), &spec, &lease, FailureMode::Open, 1);
    let started = std::time::Instant::now();
    let mut admitted = 0;
    for _ in 0..30 {
        let decision = shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides");
        admitted += u64::from(decision.admitted);
    }
    let refilled = (started.elapsed().as_millis() as u64 * 20).div_ceil(1000);
    assert!(
        (20..=20 + refilled).contains(&admitted),
        "admitted {admitted}, bucket 20 + refill {refilled}"
    );
    let key = LeaseKey::of("t", [("user", "u1")].into_iter(), 0, &spec).ledger_key();
    let outstanding = ledger.host.quota().read(|machine| {
        machine.key(&key).and_then(|entry| entry.leases.get(&NodeId(1)).map(|lease| lease.tokens))
    });
    assert!(outstanding.is_some(), "the ledger holds this node's lease on {key}");
    assert!(counter(&metrics, "calls", "ok") >= 1);
    shards.shutdown().await;
}

/// When the ledger grants nothing, the key is rejected locally until the exact
/// retry_after, and no further request reaches the broker or the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_key_asks_nothing_until_retry_after() {
    let (_ledger, shards, metrics) = leasing(DEFAULTS, true).await;
    let spec = LimitSpec::new(Algorithm::FixedWindow, 2, 3_600_000, None).expect("a valid limit");
    let lease = LeaseTuning::default();
    let probe = support::probe(&shards, "t", ("user", "u2"), &spec, &lease, FailureMode::Open, 1);
    let mut admitted = 0;
    let mut blocked_retry_ms = None;
    for _ in 0..5 {
        let decision = shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides");
        admitted += u64::from(decision.admitted);
        if !decision.admitted {
            blocked_retry_ms = Some(decision.outcomes[0].verdicts[0].retry_after_ms);
        }
    }
    assert_eq!(admitted, 2, "the window's two hits");
    let retry_ms = blocked_retry_ms.expect("rejected once the window was spent");
    assert!(retry_ms > 1_000 && retry_ms <= 3_600_000, "retry after {retry_ms} ms");
    // The first rejection asked for what refills; the ledger's "none until the window
    // ends" blocks the key once it lands.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asks = counter(&metrics, "asks", "queued");
    let calls = counter(&metrics, "calls", "ok") + counter(&metrics, "calls", "error");
    for _ in 0..500 {
        let decision = shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides");
        assert!(!decision.admitted);
        let retry = decision.outcomes[0].verdicts[0].retry_after_ms;
        assert!(retry <= retry_ms && retry + 5_000 > retry_ms, "{retry} vs {retry_ms}");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(counter(&metrics, "asks", "queued"), asks, "no ask while blocked");
    assert_eq!(
        counter(&metrics, "calls", "ok") + counter(&metrics, "calls", "error"),
        calls,
        "no ledger call while blocked"
    );
    shards.shutdown().await;
}

/// A request larger than the lease size is paid once its lease (sized to the request)
/// arrives; a request larger than the limit's capacity is refused without a ledger call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_lease_what_they_need() {
    let (_ledger, shards, metrics) = leasing(DEFAULTS, true).await;
    let spec =
        LimitSpec::new(Algorithm::TokenBucket, 100, 1_000, Some(100)).expect("a valid limit");
    let lease = LeaseTuning::default();
    let big = support::probe(&shards, "t", ("user", "u3"), &spec, &lease, FailureMode::Open, 60);
    assert!(shards.decide(&big, quotamesh::clock::now_ms()).await.expect("decides").admitted);
    let asks = counter(&metrics, "asks", "queued");
    let huge = support::probe(&shards, "t", ("user", "u3"), &spec, &lease, FailureMode::Open, 101);
    let decision = shards.decide(&huge, quotamesh::clock::now_ms()).await.expect("decides");
    assert!(!decision.admitted);
    assert_eq!(decision.outcomes[0].verdicts[0].retry_after_ms, u64::MAX);
    assert_eq!(counter(&metrics, "asks", "queued"), asks);
    shards.shutdown().await;
}

/// A fail-closed key's first hit has no credit: it waits for its lease, and the answer to
/// its key's stripe wakes it. A request not woken waits out the whole budget (then decides
/// from whatever landed meanwhile: no timeout decides a count), so how long each wait took
/// tells the two apart. Each of 20 keys waits once; a commit slower than the
/// budget (a busy disk) may end a wait at the budget, most do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_is_woken_by_its_keys_answer() {
    let (_ledger, shards, metrics) = leasing(DEFAULTS, true).await;
    let spec =
        LimitSpec::new(Algorithm::TokenBucket, 100, 1_000, Some(100)).expect("a valid limit");
    let lease = LeaseTuning::default();
    let budget = Duration::from_millis(LeasingConfig::default().wait_budget_ms);
    let keys = 20;
    let mut woken_early = 0;
    for user in 0..keys {
        let user = format!("waiting-{user}");
        let probe =
            support::probe(&shards, "t", ("user", &user), &spec, &lease, FailureMode::Closed, 1);
        let started = std::time::Instant::now();
        shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides");
        woken_early += u64::from(started.elapsed() < budget);
    }
    assert_eq!(metrics.lease_waits.get(), keys, "every first hit waited for its lease");
    assert!(woken_early * 2 > keys, "{woken_early} of {keys} waits ended before the budget");
    shards.shutdown().await;
}

/// Once a key goes idle, the sweep gives its balance back: the node holds nothing and the
/// ledger counts as outstanding only the token that was spent (until the lease's TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_balances_return_to_the_ledger() {
    let (ledger, shards, metrics) = leasing(DEFAULTS, true).await;
    let spec = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, None).expect("a valid limit");
    let lease = LeaseTuning::default();
    let probe = support::probe(&shards, "t", ("user", "u4"), &spec, &lease, FailureMode::Open, 1);
    assert!(shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides").admitted);
    // The first hit was admitted on credit; its report's lease lands a commit later.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while shards.held_tokens(quotamesh::clock::now_ms()) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no lease arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let key = LeaseKey::of("t", [("user", "u4")].into_iter(), 0, &spec).ledger_key();
    let held_by_ledger = || {
        ledger.host.quota().read(|machine| {
            machine
                .key(&key)
                .and_then(|entry| entry.leases.get(&NodeId(1)).map(|lease| lease.tokens))
                .unwrap_or(0)
        })
    };
    assert_eq!(held_by_ledger(), 5, "a first lease of min_lease_tokens");
    // Idle for a lookahead (250 ms), a sweep (every 100 ms) returns the balance before it
    // expires (450 ms after its request). The ledger's state changes when the return is
    // applied; the node counts the credit when the answer reaches its broker, a moment later.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while held_by_ledger() > 1 || metrics.lease_credited_tokens.get() == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "balance never returned: the ledger holds {}, the node was credited {}",
            held_by_ledger(),
            metrics.lease_credited_tokens.get()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(shards.held_tokens(quotamesh::clock::now_ms()), 0);
    shards.shutdown().await;
}

/// A shard at its key cap evicts a sampled key to make room for a new one, and settles the
/// evicted key with the ledger (its balance goes back) rather than dropping what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_shard_evicts_and_settles_the_keys_it_drops() {
    const KEYS: usize = 24;
    // Two shards of 4 keys; no idle sweep, so only the cap removes keys.
    let setup = support::Setup {
        keys_per_shard_max: 4,
        sweep_interval: Duration::from_secs(3600),
        ..DEFAULTS
    };
    let (ledger, shards, metrics) = leasing(setup, true).await;
    let spec = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, None).expect("a valid limit");
    let lease = LeaseTuning::default();
    let names: Vec<String> = (0..KEYS).map(|index| format!("e{index}")).collect();
    let record = |name: &str| {
        let key = LeaseKey::of("t", [("user", name)].into_iter(), 0, &spec).ledger_key();
        ledger.host.quota().read(|machine| {
            machine.key(&key).and_then(|entry| entry.leases.get(&NodeId(1)).copied())
        })
    };
    for name in &names {
        let probe = support::probe(
            &shards,
            "t",
            ("user", name.as_str()),
            &spec,
            &lease,
            FailureMode::Open,
            1,
        );
        assert!(shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides").admitted);
        // Its first lease lands before the next key comes, so evictions find keys at rest.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while record(name).is_none() {
            assert!(tokio::time::Instant::now() < deadline, "no lease for {name}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let tracked = shards.key_count();
    assert!(tracked <= 8, "{tracked} keys tracked by two shards of 4");
    let evicted: u64 = ["0", "1"]
        .iter()
        .map(|shard| metrics.shard_evictions.with_label_values(&[shard, "capacity"]).get())
        .sum();
    assert_eq!(evicted, (KEYS - tracked) as u64, "every key not tracked was evicted for room");
    // An evicted key's second report (after its first lease) settles it: the ledger takes its
    // balance back and counts the one token its hit spent. A tracked key reports nothing more.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let records: Vec<_> = names.iter().filter_map(|name| record(name)).collect();
        let settled = records.iter().filter(|record| record.seq >= 2).collect::<Vec<_>>();
        if settled.len() as u64 == evicted {
            for record in settled {
                assert_eq!((record.tokens, record.spent_tokens), (0, 1), "{record:?}");
            }
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {evicted} evicted keys settled: {records:?}",
            settled.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shards.shutdown().await;
}

/// With no ledger leader, a cold fail-open key admits its credit, then its short requests
/// wait out the budget and fall back; once three calls are judged slow (against the default
/// deadline: nothing measured yet, so a second) the circuit opens and decisions fall back
/// at once. Credit and fallback together admit no more than the limit; fail-closed denies
/// with the probe interval as retry-after and asks nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ledger_opens_the_circuit() {
    let (_ledger, shards, metrics) = leasing(DEFAULTS, false).await;
    let spec = LimitSpec::new(Algorithm::TokenBucket, 10, 60_000, Some(10)).expect("a valid limit");
    let lease = LeaseTuning::default();
    let open = support::probe(&shards, "t", ("user", "open"), &spec, &lease, FailureMode::Open, 1);
    let closed =
        support::probe(&shards, "t", ("user", "closed"), &spec, &lease, FailureMode::Closed, 1);
    let mut reasons = Vec::new();
    let mut admitted = 0;
    let started = std::time::Instant::now();
    // Other keys' reports are calls of their own, as a node's traffic makes them.
    let others: Vec<_> = ["a", "b", "c"]
        .into_iter()
        .map(|user| {
            support::probe(&shards, "t", ("user", user), &spec, &lease, FailureMode::Open, 1)
        })
        .collect();
    while metrics.ledger_circuit_state.get() != 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "the circuit never opened");
        for other in &others {
            shards.decide(other, quotamesh::clock::now_ms()).await.expect("decides");
        }
        let decision = shards.decide(&open, quotamesh::clock::now_ms()).await.expect("decides");
        admitted += u64::from(decision.admitted);
        if let Some(reason) = decision.bypass {
            reasons.push(reason);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A key first seen while the circuit is open gets no credit: its fallback pays, at once.
    let fresh =
        support::probe(&shards, "t", ("user", "fresh"), &spec, &lease, FailureMode::Open, 1);
    let decision = shards.decide(&fresh, quotamesh::clock::now_ms()).await.expect("decides");
    assert!(decision.admitted);
    assert_eq!(decision.bypass, Some(BypassReason::CircuitOpen));
    // 10 per minute refill a token every 6 s.
    let refilled = started.elapsed().as_secs() / 6 + 1;
    assert!((10..=10 + refilled).contains(&admitted), "admitted {admitted}, limit 10 + {refilled}");
    assert_eq!(reasons.first(), Some(&BypassReason::LedgerTimeout), "{reasons:?}");
    let bypassed = counter(&metrics, "bypassed", "circuit_open")
        + counter(&metrics, "bypassed", "ledger_timeout");
    let credit = metrics.lease_credit_admissions.get();
    assert!(credit >= 5, "each key's credit of a minimum lease: {credit}");
    assert!(bypassed > admitted - 5, "the key admitted 5 on credit, the rest (and fresh) bypassed");
    let asks = counter(&metrics, "asks", "queued");
    let decision = shards.decide(&closed, quotamesh::clock::now_ms()).await.expect("decides");
    assert_eq!(counter(&metrics, "asks", "queued"), asks, "no ask while the circuit is open");
    assert!(!decision.admitted && decision.failed_closed);
    assert_eq!(decision.outcomes[0].verdicts[0].retry_after_ms, FAIL_CLOSED_RETRY_AFTER_MS);
    assert_eq!(metrics.rate_limit_failed_closed.get(), 1);
    shards.shutdown().await;
}

/// Concurrent requests at ten times a key's limit: the ledger's grants pay what the limit
/// allows and the rest is rejected locally; whatever a slow answer left to the fallback is
/// charged, so the total stays within the limit plus the drift bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_above_its_limit_is_held_to_it_without_fallback() {
    let (_ledger, shards, _metrics) = leasing(DEFAULTS, true).await;
    let shards = std::sync::Arc::new(shards);
    let spec =
        LimitSpec::new(Algorithm::TokenBucket, 200, 1_000, Some(200)).expect("a valid limit");
    let lease = LeaseTuning::default();
    let started = std::time::Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3_000 {
        ticks.tick().await;
        for _ in 0..2 {
            let shards = std::sync::Arc::clone(&shards);
            tasks.spawn(async move {
                let probe = support::probe(
                    &shards,
                    "t",
                    ("user", "hot"),
                    &spec,
                    &lease,
                    FailureMode::Open,
                    1,
                );
                let decision =
                    shards.decide(&probe, quotamesh::clock::now_ms()).await.expect("decides");
                (decision.admitted, decision.bypass)
            });
        }
    }
    let mut admitted = 0_u64;
    let mut bypassed = 0_u64;
    while let Some(result) = tasks.join_next().await {
        let (was_admitted, bypass) = result.expect("the task ran");
        admitted += u64::from(was_admitted);
        bypassed += u64::from(bypass.is_some());
    }
    let elapsed_ms = started.elapsed().as_millis() as u64;
    let allowed = 200 + elapsed_ms * 200 / 1_000 + lease.drift_bound_tokens(&spec, 1, true, None);
    println!(
        "admitted {admitted} of 6000 in {elapsed_ms} ms; allowed {allowed}; bypassed {bypassed}"
    );
    assert!(admitted <= allowed, "admitted {admitted} above {allowed}");
    assert!(
        admitted >= 200 + elapsed_ms * 200 / 1_000 / 2,
        "admitted {admitted}: far below the limit"
    );
}

//! Tests of the node-side lease math: sizing, the traffic estimate, and the per-key life
//! cycle, each against the numbers of DESIGN section 3 or a naive model.

use proptest::prelude::*;

use super::*;

/// Feeds `rate_per_second` evenly for `duration_ms` (one hit per interval) from `start_ms`.
fn feed(estimate: &mut RateEstimate, start_ms: u64, duration_ms: u64, rate_per_second: u64) -> u64 {
    let interval_ms = (1000 / rate_per_second.max(1)).max(1);
    let hits_per_interval = (rate_per_second * interval_ms / 1000).max(1);
    let mut now_ms = start_ms;
    while now_ms < start_ms + duration_ms {
        estimate.observe(now_ms, hits_per_interval, 1_000);
        now_ms += interval_ms;
    }
    now_ms
}

/// The decay table is 2^(-k/16) to the nearest 1/65536.
#[test]
fn decay_table_is_exact() {
    for (k, value) in DECAY_SIXTEENTHS.iter().enumerate() {
        let exact = (2f64.powf(-(k as f64) / 16.0) * 65536.0).round() as u64;
        assert_eq!(*value, exact, "k = {k}");
    }
}

/// The defaults are DESIGN's (5, 0.25 s, 500, 20 %, TTL 2 x lookahead) and valid; broken
/// relations are refused.
#[test]
fn default_tuning_is_the_design() {
    let tuning = LeaseTuning::default();
    assert_eq!(tuning.validate(), Ok(()));
    assert_eq!(
        (tuning.min_lease_tokens, tuning.max_lease_tokens, tuning.lookahead_ms),
        (5, 500, 250)
    );
    assert_eq!(tuning.lease_ttl_ms, 2 * tuning.lookahead_ms);
    let broken = [
        LeaseTuning { min_lease_tokens: 0, ..tuning },
        LeaseTuning { min_lease_tokens: 600, ..tuning },
        LeaseTuning { low_watermark_percent: 0, ..tuning },
        LeaseTuning { lease_ttl_ms: 2_000, ..tuning },
        LeaseTuning { lease_ttl_ms: 50, ..tuning },
        LeaseTuning { rate_half_life_ms: 0, ..tuning },
    ];
    for tuning in broken {
        assert!(tuning.validate().is_err(), "{tuning:?}");
    }
}

/// Lease size follows traffic: min for a trickle, rate x lookahead in between, max for a flood.
#[test]
fn lease_size_is_traffic_proportional() {
    let tuning = LeaseTuning::default();
    assert_eq!(tuning.lease_size_tokens(0), 5);
    assert_eq!(tuning.lease_size_tokens(1_000 * 1_000), 250, "1,000/s x 0.25 s");
    assert_eq!(tuning.lease_size_tokens(10_000 * 1_000), 500, "capped");
    assert_eq!(tuning.low_watermark_tokens(250), 50);
    assert_eq!(tuning.low_watermark_tokens(3), 1, "at least 1");
    assert_eq!(tuning.held_tokens_max(), 599);
    assert_eq!(tuning.drift_bound_tokens(3), 1_797);
}

/// A steady rate is estimated within 5 % once the estimate has settled (10 half-lives).
#[test]
fn steady_rates_are_estimated() {
    for rate in [10_u64, 100, 1_000, 2_000, 10_000] {
        let mut estimate = RateEstimate::default();
        let end_ms = feed(&mut estimate, 1_000, 10_000, rate);
        let estimated_milli = estimate.rate_milli_per_second(end_ms, 1_000);
        let error_percent = estimated_milli.abs_diff(rate * 1_000) * 100 / (rate * 1_000);
        assert!(error_percent <= 5, "rate {rate}/s estimated as {estimated_milli} milli/s");
    }
}

/// When traffic stops, the lease size decays back to the minimum within a few seconds,
/// never growing on the way.
#[test]
fn lease_size_decays_when_traffic_stops() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    let mut now_ms = 1_000;
    for _ in 0..5_000 {
        lease.spend(&tuning, now_ms, 1);
        now_ms += 1;
    }
    let mut size = lease.lease_size_tokens(&tuning, now_ms);
    assert!(size >= 200, "1,000/s calls for about 250, got {size}");
    for _ in 0..20 {
        now_ms += 500;
        let next = lease.lease_size_tokens(&tuning, now_ms);
        assert!(next <= size);
        size = next;
    }
    assert_eq!(size, 5);
}

/// A cold key is short until its first lease arrives; then it spends from the balance and
/// asks for a refill only below the watermark, one request at a time.
#[test]
fn cold_key_leases_then_spends_locally() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    assert_eq!(lease.spend(&tuning, 1_000, 1), Spend::Short);
    let want = lease.poll_refill(&tuning, 1_000).expect("a first lease");
    assert_eq!(want, LeaseWant { tokens: 5, sent_at_ms: 1_000 });
    assert_eq!(lease.poll_refill(&tuning, 1_001), None, "one request in flight at most");
    lease.apply_grant(&tuning, want, 5, 0, 1_002);
    assert_eq!(lease.spend(&tuning, 1_003, 1), Spend::Admitted);
    assert_eq!(lease.balance_tokens(1_003), 4);
    assert_eq!(lease.poll_refill(&tuning, 1_003), None, "4 is above the watermark of 1");
    for now_ms in 1_004..1_007 {
        assert_eq!(lease.spend(&tuning, now_ms, 1), Spend::Admitted);
    }
    assert_eq!(lease.balance_tokens(1_007), 1);
    assert_eq!(lease.spend(&tuning, 1_007, 1), Spend::Admitted);
    assert!(lease.poll_refill(&tuning, 1_007).is_some(), "below the watermark");
}

/// A lease expires a margin before TTL after its request was SENT, not when it arrived.
#[test]
fn lease_expires_from_its_send_time() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    let want = lease.poll_refill(&tuning, 10_000).expect("a lease");
    lease.apply_grant(&tuning, want, 5, 0, 10_300);
    assert_eq!(lease.balance_tokens(10_449), 5);
    assert_eq!(lease.balance_tokens(10_450), 0, "10,000 + 500 - 50");
    assert_eq!(lease.spend(&tuning, 10_450, 1), Spend::Short);
}

/// When the ledger grants nothing, the key is rejected locally until `retry_after_ms`
/// without another request; then it asks again.
#[test]
fn empty_ledger_blocks_until_retry_after() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    let want = lease.poll_refill(&tuning, 1_000).expect("a lease");
    lease.apply_grant(&tuning, want, 0, 300, 1_002);
    assert_eq!(lease.spend(&tuning, 1_100, 1), Spend::Blocked { retry_after_ms: 202 });
    assert_eq!(lease.poll_refill(&tuning, 1_301), None, "no request before 1,302");
    assert_eq!(lease.spend(&tuning, 1_302, 1), Spend::Short);
    assert!(lease.poll_refill(&tuning, 1_302).is_some());
}

/// The surplus above a shrunken lease size is taken for return; the rest stays.
#[test]
fn surplus_is_returned_as_traffic_falls() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    let want = lease.poll_refill(&tuning, 1_000).expect("a lease");
    lease.apply_grant(&tuning, LeaseWant { tokens: 400, ..want }, 400, 0, 1_001);
    assert_eq!(lease.take_surplus(&tuning, 1_002), 395, "idle key: lease size 5");
    assert_eq!(lease.balance_tokens(1_002), 5);
    assert_eq!(lease.take_all(1_002), 5);
    assert_eq!(lease.balance_tokens(1_002), 0);
}

/// One step of a random lease life.
#[derive(Debug, Clone)]
enum Step {
    Spend { after_ms: u64, hits: u64 },
    Refill { after_ms: u64 },
    Answer { after_ms: u64, grant_percent: u64, retry_after_ms: u64 },
    Fail,
    Surplus,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..20u64, 1..5u64).prop_map(|(after_ms, hits)| Step::Spend { after_ms, hits }),
        (0..50u64).prop_map(|after_ms| Step::Refill { after_ms }),
        (0..50u64, 0..=100u64, 0..500u64).prop_map(|(after_ms, grant_percent, retry_after_ms)| {
            Step::Answer { after_ms, grant_percent, retry_after_ms }
        }),
        Just(Step::Fail),
        Just(Step::Surplus),
    ]
}

proptest! {
    /// Against a ledger that grants at most what was asked: the node never holds more than
    /// `held_tokens_max`, never has two requests in flight, and never spends more than it
    /// was granted.
    #[test]
    fn lease_life_respects_its_bounds(steps in proptest::collection::vec(step(), 1..300)) {
        let tuning = LeaseTuning::default();
        let mut lease = KeyLease::default();
        let mut now_ms = 1_000_u64;
        let mut outstanding: Option<LeaseWant> = None;
        let (mut granted, mut spent, mut returned) = (0_u64, 0_u64, 0_u64);
        for step in steps {
            match step {
                Step::Spend { after_ms, hits } => {
                    now_ms += after_ms;
                    if lease.spend(&tuning, now_ms, hits) == Spend::Admitted {
                        spent += hits;
                    }
                }
                Step::Refill { after_ms } => {
                    now_ms += after_ms;
                    if let Some(want) = lease.poll_refill(&tuning, now_ms) {
                        prop_assert!(outstanding.is_none(), "two requests in flight");
                        prop_assert!(want.tokens <= tuning.max_lease_tokens);
                        outstanding = Some(want);
                    }
                }
                Step::Answer { after_ms, grant_percent, retry_after_ms } => {
                    if let Some(want) = outstanding.take() {
                        now_ms += after_ms;
                        let tokens = want.tokens * grant_percent / 100;
                        lease.apply_grant(&tuning, want, tokens, retry_after_ms, now_ms);
                        granted += tokens;
                    }
                }
                Step::Fail => {
                    if outstanding.take().is_some() {
                        lease.apply_failure();
                    }
                }
                Step::Surplus => returned += lease.take_surplus(&tuning, now_ms),
            }
            prop_assert_eq!(lease.in_flight(), outstanding.is_some());
            prop_assert!(lease.balance_tokens(now_ms) <= tuning.held_tokens_max());
            prop_assert!(spent + returned <= granted);
        }
    }

    /// Without new hits the estimate never grows: not when asked at a later time (it only
    /// decays) and not when the clock steps backwards.
    #[test]
    fn estimate_never_grows_without_hits(
        hits in 1..10_000u64,
        mut times in proptest::collection::vec(0..100_000u64, 1..20),
    ) {
        let mut estimate = RateEstimate::default();
        estimate.observe(50_000, hits, 1_000);
        let initial = estimate.rate_milli_per_second(50_000, 1_000);
        for now_ms in &times {
            prop_assert!(estimate.rate_milli_per_second(*now_ms, 1_000) <= initial);
        }
        times.sort_unstable();
        let rates: Vec<u64> =
            times.iter().map(|now_ms| estimate.rate_milli_per_second(*now_ms, 1_000)).collect();
        prop_assert!(rates.windows(2).all(|pair| pair[1] <= pair[0]), "{rates:?}");
    }

    /// Lease sizes stay within [min, max] for any rate and tuning that validates.
    #[test]
    fn lease_sizes_stay_in_bounds(
        rate in any::<u64>(),
        min in 1..1_000u64,
        extra in 0..10_000u64,
        lookahead_ms in 1..10_000u64,
    ) {
        let tuning = LeaseTuning {
            min_lease_tokens: min,
            max_lease_tokens: min + extra,
            lookahead_ms,
            ..LeaseTuning::default()
        };
        prop_assert_eq!(tuning.validate(), Ok(()));
        let size = tuning.lease_size_tokens(rate);
        prop_assert!((min..=min + extra).contains(&size));
        prop_assert!(tuning.low_watermark_tokens(size) >= 1);
    }
}

/// A request larger than the lease size asks for what it lacks; a settled key holds
/// nothing; the last hit's time is remembered.
#[test]
fn large_requests_and_settling() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::default();
    assert!(lease.is_settled(1_000));
    assert_eq!(lease.spend(&tuning, 1_000, 40), Spend::Short);
    assert_eq!(lease.last_hit_ms(), 1_000);
    let want = lease.poll_lease_for(&tuning, 1_000, 40).expect("a lease");
    assert_eq!(want.tokens, 40, "more than the minimum lease of 5");
    assert!(!lease.is_settled(1_001), "in flight");
    lease.apply_grant(&tuning, want, 40, 0, 1_002);
    assert!(!lease.is_settled(1_003), "holds tokens");
    assert_eq!(lease.spend(&tuning, 1_003, 40), Spend::Admitted);
    assert!(lease.is_settled(1_003));
    let want = lease.poll_refill(&tuning, 1_004).expect("below the watermark");
    lease.apply_grant(&tuning, want, 0, 300, 1_005);
    assert!(!lease.is_settled(1_200), "blocked until 1,305");
    assert!(lease.is_settled(1_305));
}

/// The fallback bucket is the node's share of the limit times the multiplier, never below
/// one token; a limit of 0 stays closed.
#[test]
fn fallback_is_a_share_of_the_limit() {
    use crate::core::rate::Algorithm;
    let spec =
        LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(1_500)).expect("a valid limit");
    let share = fallback_limit(&spec, 1_000, 2);
    assert_eq!((share.requests_per_window, share.burst_tokens), (500, 750));
    let doubled = fallback_limit(&spec, 2_000, 2);
    assert_eq!((doubled.requests_per_window, doubled.burst_tokens), (1_000, 1_500));
    let tiny = fallback_limit(
        &LimitSpec::new(Algorithm::FixedWindow, 3, 60_000, None).expect("a valid limit"),
        1_000,
        10,
    );
    assert_eq!((tiny.requests_per_window, tiny.burst_tokens, tiny.window_ms), (1, 1, 60_000));
    let closed = LimitSpec::new(Algorithm::TokenBucket, 0, 1_000, None).expect("a valid limit");
    assert_eq!(fallback_limit(&closed, 1_000, 3), closed);
}

proptest! {
    /// The fallback of every valid limit is a valid limit, never above the multiplied one.
    #[test]
    fn fallback_limits_are_valid(
        requests in 1..1_000_000u64,
        burst in 1..1_000_000u64,
        multiplier_permille in 1..10_000u64,
        nodes in 1..64u64,
    ) {
        use crate::core::rate::Algorithm;
        let spec = LimitSpec::new(Algorithm::TokenBucket, requests, 1_000, Some(burst)).expect("a valid limit");
        let share = fallback_limit(&spec, multiplier_permille, nodes);
        prop_assert_eq!(
            LimitSpec::new(share.algorithm, share.requests_per_window, share.window_ms, Some(share.burst_tokens)),
            Ok(share)
        );
        prop_assert!(share.requests_per_window <= (requests * multiplier_permille / 1000).max(1));
    }
}

/// `with_sizes` derives what DESIGN derives (TTL 2 x lookahead capped at 1 s, a margin that
/// stays below the TTL), gives the defaults back for the default sizes, and refuses what
/// `validate` refuses.
#[test]
fn with_sizes_derives_ttl_and_margin() {
    assert_eq!(LeaseTuning::with_sizes(5, 500, 250), Ok(LeaseTuning::default()));
    let custom = LeaseTuning::with_sizes(10, 1_000, 100).expect("valid sizes");
    assert_eq!(
        (custom.min_lease_tokens, custom.max_lease_tokens, custom.lookahead_ms),
        (10, 1_000, 100)
    );
    assert_eq!((custom.lease_ttl_ms, custom.expiry_margin_ms), (200, 50));
    let capped = LeaseTuning::with_sizes(5, 500, 800).expect("a long lookahead is capped");
    assert_eq!((capped.lease_ttl_ms, capped.expiry_margin_ms), (LEASE_TTL_MS_MAX, 50));
    let short = LeaseTuning::with_sizes(1, 1, 1).expect("the shortest lookahead");
    assert_eq!((short.lease_ttl_ms, short.expiry_margin_ms), (2, 0));
    let quarter = LeaseTuning::with_sizes(1, 1, 60).expect("a short lookahead");
    assert_eq!((quarter.lease_ttl_ms, quarter.expiry_margin_ms), (120, 30));
    let rest = LeaseTuning::default();
    assert_eq!(
        (quarter.low_watermark_percent, quarter.rate_half_life_ms),
        (rest.low_watermark_percent, rest.rate_half_life_ms)
    );
    assert_eq!(LeaseTuning::with_sizes(0, 500, 250), Err(LeaseTuningError::Sizes));
    assert_eq!(LeaseTuning::with_sizes(600, 500, 250), Err(LeaseTuningError::Sizes));
    assert_eq!(LeaseTuning::with_sizes(5, LEASE_TOKENS_MAX + 1, 250), Err(LeaseTuningError::Sizes));
    assert_eq!(
        LeaseTuning::with_sizes(5, LEASE_TOKENS_MAX, u64::MAX).map(|t| t.lease_ttl_ms),
        Ok(LEASE_TTL_MS_MAX)
    );
    // A lookahead of 0 gives a TTL of 0, which no margin fits under.
    assert_eq!(LeaseTuning::with_sizes(5, 500, 0), Err(LeaseTuningError::Ttl));
}

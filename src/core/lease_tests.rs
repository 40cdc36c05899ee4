//! Tests of the node-side lease math: sizing, the traffic estimate, and the per-key life
//! cycle, each against the numbers of DESIGN section 3 or a naive model.

use proptest::prelude::*;

use super::*;
use crate::core::rate::Algorithm;

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
    assert_eq!(tuning.refill_watermark_max_tokens(500), 499, "all but one for a warm key");
    assert_eq!(tuning.held_tokens_max(1_000_000, 3), 998, "500 + 499 - 1");
    let large = LimitSpec::new(Algorithm::TokenBucket, 1_000_000, 60_000, None).expect("a limit");
    assert_eq!(tuning.drift_bound_tokens(&large, 3, false, None), 2_994);
    assert_eq!(tuning.drift_bound_tokens(&large, 3, true, None), 3_009, "3 x 5 of credit");
    // 1,000/s over 5 nodes: leases capped at 100 (+98 below a warm key's watermark), 200
    // while the ledger divides the key (+39 below the plain watermark), +5 of credit.
    let capped = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, None).expect("a limit");
    assert_eq!(tuning.drift_bound_tokens(&capped, 5, true, None), 5 * 244);
    assert_eq!(
        tuning.drift_bound_tokens(&large, 3, true, Some(1_000)),
        1_003_009,
        "the fallback allowance while the circuit is not closed"
    );
    assert_eq!(tuning.held_tokens_max(20, 2), 11, "a key of 20 over 2 nodes: 10 + watermark 2 - 1");
    assert_eq!(tuning.held_tokens_max(8, 2), 2, "a small key's cap of 2 is never doubled");
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

/// A new key's rate is read within 10 % once an eighth of a half-life has passed, not after
/// several half-lives: a hot key's first leases cover its lookahead. One request read at
/// once counts as spread over that eighth, not as a flood.
#[test]
fn a_new_key_reads_its_rate_at_once() {
    for rate in [100_u64, 500, 1_000, 3_000] {
        let mut estimate = RateEstimate::default();
        let end_ms = feed(&mut estimate, 1_000, 125, rate);
        let estimated_milli = estimate.rate_milli_per_second(end_ms, 1_000);
        let error_percent = estimated_milli.abs_diff(rate * 1_000) * 100 / (rate * 1_000);
        assert!(error_percent <= 10, "rate {rate}/s read as {estimated_milli} milli/s at 125 ms");
    }
    let mut estimate = RateEstimate::default();
    estimate.observe(1_000, 40, 1_000);
    let read = estimate.rate_milli_per_second(1_000, 1_000);
    assert!((300_000..=340_000).contains(&read), "40 hits over 125 ms: {read} milli/s");
}

/// A key whose traffic has gone on for longer than the estimate counts its start (49 days,
/// in 32 bits), on node times of the Unix epoch, reads its rate as a key a minute old does.
#[test]
fn a_rate_older_than_49_days_is_read_whole() {
    let fed_for = |duration_ms: u64| {
        let mut estimate = RateEstimate::default();
        let end_ms = 1_800_000_000_000;
        let mut now_ms = end_ms - duration_ms;
        while now_ms <= end_ms {
            estimate.observe(now_ms, 10, 1_000);
            now_ms += 1_000;
        }
        estimate
    };
    let old = fed_for(50 * 24 * 3600 * 1000);
    assert_eq!(old.started_before_update_ms, u32::MAX);
    let read = |estimate: RateEstimate| estimate.rate_milli_per_second(1_800_000_000_500, 1_000);
    let (old_read, minute_read) = (read(old), read(fed_for(60_000)));
    assert!(old_read.abs_diff(minute_read) <= 10, "{old_read} against {minute_read} milli/s");
    assert!(old_read.abs_diff(10_000) <= 1_000, "10 hits a second read as {old_read} milli/s");
}

/// After a long pause the estimate starts anew: a key back from idle reads its new rate
/// as quickly as a new one.
#[test]
fn an_idle_key_starts_its_estimate_anew() {
    let mut estimate = RateEstimate::default();
    let end_ms = feed(&mut estimate, 1_000, 2_000, 10);
    let back_ms = end_ms + 30_000;
    let end_ms = feed(&mut estimate, back_ms, 250, 1_000);
    let estimated = estimate.rate_milli_per_second(end_ms, 1_000);
    assert!(estimated.abs_diff(1_000_000) <= 100_000, "read {estimated} milli/s");
}

/// When traffic stops, the lease size decays back to the minimum within a few seconds,
/// never growing on the way.
#[test]
fn lease_size_decays_when_traffic_stops() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000_000, 1_000_000);
    let mut now_ms = 1_000;
    for _ in 0..5_000 {
        lease.spend(&tuning, Credit::NONE, now_ms, 1);
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

fn settled(granted_tokens: u64, retry_after_ms: u64, remaining_tokens: u64) -> ReportAnswer {
    ReportAnswer::Settled { granted_tokens, retry_after_ms, remaining_tokens }
}

/// Spends `rate_per_ms` hits every ms from 1,000 ms for 5 s, paid from grants of what the
/// refills want (one token less, with a retry after 1 ms, when the ledger `divides` the key),
/// each answered `round_trip_ms` after its report and leaving `ledger_remaining` in the
/// bucket. Returns the balances at which refills were asked and the ms in the last 2.5 s when
/// the balance fell short (the ms a request would wait).
fn warm_key(
    rate_per_ms: u64,
    round_trip_ms: u64,
    ledger_remaining: u64,
    divides: bool,
) -> (Vec<u64>, u64) {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000_000_000, 1_000_000_000);
    let mut flying: Option<(ReportDraft, u64)> = None;
    let mut asked_at_balances = Vec::new();
    let mut short_ms = 0;
    for now_ms in 1_000..6_000 {
        if let Some((draft, due_ms)) = flying
            && now_ms >= due_ms
        {
            let want = draft.tokens_wanted;
            let answer = if divides {
                settled(want.saturating_sub(1), 1, ledger_remaining)
            } else {
                settled(want, 0, ledger_remaining)
            };
            lease.apply_answer(&tuning, &draft, answer, now_ms);
            flying = None;
        }
        if lease.spend(&tuning, Credit::NONE, now_ms, rate_per_ms) == Spend::Short
            && now_ms >= 3_500
        {
            short_ms += 1;
        }
        if flying.is_none()
            && let Some(draft) = lease.poll_lease_for(&tuning, now_ms, 0)
        {
            asked_at_balances.push(draft.held_tokens);
            flying = Some((draft, now_ms + round_trip_ms));
        }
    }
    (asked_at_balances, short_ms)
}

/// A warm hot key (a 500-token lease lasts 10 ms) whose reports take 3 ms asks for its
/// refill while two round trips of its traffic are left, at most all but one token, and never
/// runs short. With the plain 20 % watermark (2 ms of traffic) it would wait at every
/// refill, which is what a key whose bucket is nearly empty, or one the ledger divides
/// between nodes, does: it takes nothing early.
#[test]
fn a_warm_key_asks_its_refill_two_round_trips_ahead_while_the_bucket_has_plenty() {
    let (asked, short_ms) = warm_key(50, 3, 1_000_000, false);
    let warm = &asked[asked.len() / 2..];
    assert!(warm.iter().all(|held| (250..300).contains(held)), "asked at {warm:?}");
    assert_eq!(short_ms, 0, "a warm key never waits");
    for (remaining, divides) in [(999, false), (1_000_000, true)] {
        let (asked, short_ms) = warm_key(50, 3, remaining, divides);
        let warm = &asked[asked.len() / 2..];
        assert!(warm.iter().all(|held| *held < 100), "plain watermark: {warm:?}");
        assert!(short_ms > 100, "the plain watermark leaves it short {short_ms} ms");
    }
}

/// A cold fail-open key admits its first hits on credit without waiting; its first report
/// carries them as spent and as debt, and the grant that answers it is a clean balance.
#[test]
fn cold_key_is_admitted_on_credit_then_leases() {
    let tuning = LeaseTuning::default();
    let credit = Credit::fail_open(&tuning, 2_000, 1);
    assert_eq!(credit.tokens_max, 5);
    let mut lease = KeyLease::new(1_000, 1_000);
    assert_eq!(lease.spend(&tuning, credit, 1_000, 2), Spend::AdmittedOnCredit);
    let draft = lease.poll_lease_for(&tuning, 1_000, 0).expect("the first report");
    assert_eq!(
        (draft.seq, draft.spent_tokens, draft.held_tokens, draft.debt_tokens, draft.tokens_wanted),
        (1, 2, 0, 2, 5)
    );
    assert_eq!(lease.poll_refill(&tuning, 1_001), None, "one report in flight at most");
    // While it flies, three more hits on credit: 5 of credit in all, the maximum.
    assert_eq!(lease.spend(&tuning, credit, 1_001, 3), Spend::AdmittedOnCredit);
    assert_eq!(lease.spend(&tuning, credit, 1_001, 1), Spend::Short, "credit used up");
    lease.apply_answer(&tuning, &draft, settled(5, 0, 993), 1_002);
    // The report charged its 2; the grant of 5 pays the 3 spent since, so 2 are left.
    assert_eq!((lease.debt_tokens(), lease.balance_tokens(1_002)), (0, 2));
    assert_eq!(lease.poll_settle(&tuning, 1_002), None, "the ledger counts 2 + 0 + 5 = 5 + 2");
    assert_eq!(lease.spend(&tuning, credit, 1_003, 2), Spend::Admitted);
}

/// A fail-closed key has no credit: its first hit waits for a lease.
#[test]
fn fail_closed_key_waits_for_its_lease() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(100, 100);
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_000, 1), Spend::Short);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    assert_eq!((draft.spent_tokens, draft.debt_tokens, draft.tokens_wanted), (0, 0, 5));
    lease.apply_answer(&tuning, &draft, settled(5, 0, 95), 1_001);
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_001, 1), Spend::Admitted);
}

/// A lease expires a margin before TTL after its report was SENT, not when it arrived; the
/// expired balance is then settled back (a report with nothing held).
#[test]
fn lease_expires_from_its_send_time_and_is_settled_back() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(100, 100);
    let draft = lease.poll_lease_for(&tuning, 10_000, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(5, 0, 95), 10_300);
    assert_eq!(lease.balance_tokens(10_449), 5);
    assert_eq!(lease.poll_settle(&tuning, 10_449), None);
    assert_eq!(lease.balance_tokens(10_450), 0, "10,000 + 500 - 50");
    assert_eq!(lease.spend(&tuning, Credit::NONE, 10_450, 1), Spend::Short);
    let settle = lease.poll_settle(&tuning, 10_450).expect("the expired 5 go back");
    assert_eq!((settle.held_tokens, settle.spent_tokens, settle.tokens_wanted), (0, 0, 0));
    lease.apply_answer(&tuning, &settle, settled(0, 0, 100), 10_451);
    assert_eq!(lease.poll_settle(&tuning, 10_452), None);
    let spec = LimitSpec::new(Algorithm::TokenBucket, 100, 1_000, None).expect("a valid limit");
    assert!(lease.is_settled(&spec, 10_452), "the bucket was full at the answer");
}

/// A lease ended early (a window limit's window ends) drops its balance then, and the
/// dropped tokens are settled back like an expired lease's.
#[test]
fn lease_ended_at_a_window_end_drops_its_balance() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(100, 100);
    let draft = lease.poll_lease_for(&tuning, 59_900, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(5, 0, 95), 59_901);
    lease.expire_by(60_000);
    assert_eq!(lease.balance_tokens(59_999), 5);
    assert_eq!(lease.balance_tokens(60_000), 0, "the window ended before the TTL");
    let settle = lease.poll_settle(&tuning, 60_000).expect("the dropped 5 go back");
    assert_eq!((settle.held_tokens, settle.spent_tokens), (0, 0));
}

/// The expiry and the retry time are kept as offsets from the last answer: an answer that
/// grants nothing moves that base but leaves the lease's expiry where it was, and a retry
/// further off than 32 bits of ms (49 days) comes then, not never.
#[test]
fn lease_times_survive_a_moving_base() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000, 1_000);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(10, 0, 990), 1_001);
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_100, 10), Spend::Admitted);
    let refill = lease.poll_lease_for(&tuning, 1_200, 0).expect("a refill");
    lease.apply_answer(&tuning, &refill, settled(0, 0, 990), 1_300);
    assert_eq!(lease.balance_tokens(1_300), 0, "spent");
    let more = lease.poll_lease_for(&tuning, 1_300, 0).expect("another refill");
    lease.apply_answer(&tuning, &more, settled(5, 0, 985), 1_301);
    // Granted with the report sent at 1,300: expires at 1,300 + 500 - 50.
    let empty = lease.poll_lease_for(&tuning, 1_400, 6).expect("a report for 6");
    lease.apply_answer(&tuning, &empty, settled(0, 0, 985), 1_420);
    assert_eq!(lease.balance_tokens(1_749), 5, "the grant of 1,300 still runs");
    assert_eq!(lease.balance_tokens(1_750), 0);
    // A request stamped before that last answer, decided after it: no retry time was set,
    // so it is short (it may ask), not told to wait until the answer's time.
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_410, 6), Spend::Short);

    let day_ms = 86_400_000;
    let mut blocked = KeyLease::new(1_000, 1_000);
    let draft = blocked.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    blocked.apply_answer(&tuning, &draft, settled(0, 60 * day_ms, 0), 1_010);
    let until_ms = 1_010 + u64::from(u32::MAX);
    assert_eq!(
        blocked.spend(&tuning, Credit::NONE, until_ms - 1, 1),
        Spend::Blocked { retry_after_ms: 1 }
    );
    assert!(blocked.poll_lease_for(&tuning, until_ms - 1, 1).is_none());
    assert!(blocked.poll_lease_for(&tuning, until_ms, 1).is_some(), "asks again after 49 days");
}

/// When the ledger grants nothing, the key is rejected locally until `retry_after_ms`
/// (counted from the send) without another report, and gets no credit past an empty
/// answer; then it asks again.
#[test]
fn empty_ledger_blocks_until_retry_after() {
    let tuning = LeaseTuning::default();
    let credit = Credit::fail_open(&tuning, 200, 1);
    let mut lease = KeyLease::new(100, 100);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(0, 300, 0), 1_002);
    assert_eq!(lease.spend(&tuning, credit, 1_100, 1), Spend::Blocked { retry_after_ms: 200 });
    assert_eq!(lease.poll_refill(&tuning, 1_299), None, "no report before 1,300");
    assert_eq!(
        lease.spend(&tuning, credit, 1_300, 1),
        Spend::Short,
        "no credit past an empty bucket"
    );
    assert!(lease.poll_lease_for(&tuning, 1_300, 1).is_some());
}

/// A partial grant short of the want (a contended key at its share) is spent, then the key
/// rejects locally until the ledger's retry time: one report per retry period.
#[test]
fn partial_grant_defers_the_next_report() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000, 1_000);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(2, 250, 400), 1_003);
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_010, 2), Spend::Admitted);
    assert_eq!(lease.poll_refill(&tuning, 1_010), None, "not before 1,250");
    assert_eq!(
        lease.spend(&tuning, Credit::NONE, 1_100, 1),
        Spend::Blocked { retry_after_ms: 150 }
    );
    assert!(lease.poll_lease_for(&tuning, 1_250, 1).is_some());
}

/// A report that was not applied (failed, timed out, stale) changes nothing but the request
/// in flight: the next report carries the same totals plus what came since.
#[test]
fn unanswered_reports_are_carried_by_the_next() {
    let tuning = LeaseTuning::default();
    let credit = Credit::fail_open(&tuning, 2_000, 1);
    let mut lease = KeyLease::new(1_000, 1_000);
    assert_eq!(lease.spend(&tuning, credit, 1_000, 1), Spend::AdmittedOnCredit);
    let first = lease.poll_lease_for(&tuning, 1_000, 0).expect("a report");
    lease.apply_answer(&tuning, &first, ReportAnswer::NotApplied, 1_010);
    assert!(!lease.in_flight());
    assert_eq!(lease.debt_tokens(), 1, "still owed");
    assert_eq!(lease.spend(&tuning, credit, 1_011, 1), Spend::AdmittedOnCredit);
    let second = lease.poll_lease_for(&tuning, 1_011, 0).expect("the next report");
    assert_eq!((second.seq, second.spent_tokens, second.debt_tokens), (2, 2, 2));
}

/// A slot whose ledger key a newer slot of the node has reported on (a region's moved slice
/// makes one) is told it is superseded: it holds nothing, owes nothing, and is settled at
/// once, so the sweep forgets it instead of reporting it again and again.
#[test]
fn a_superseded_life_holds_nothing_and_is_settled() {
    let tuning = LeaseTuning::default();
    let credit = Credit::fail_open(&tuning, 2_000, 1);
    let spec = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, None).expect("a limit");
    let mut lease = KeyLease::new(1_000, 1_000);
    assert_eq!(lease.spend(&tuning, credit, 1_000, 1), Spend::AdmittedOnCredit);
    let first = lease.poll_lease_for(&tuning, 1_000, 0).expect("the first report");
    lease.apply_answer(&tuning, &first, settled(100, 0, 900), 1_005);
    assert_eq!(lease.spend(&tuning, credit, 1_010, 3), Spend::Admitted);
    lease.take_all(1_020);
    let last = lease.poll_settle(&tuning, 1_020).expect("the return of the balance");
    assert!(!lease.is_settled(&spec, 1_030), "in flight");
    lease.apply_answer(&tuning, &last, ReportAnswer::Superseded, 1_030);
    assert_eq!((lease.balance_tokens(1_030), lease.debt_tokens()), (0, 0));
    assert!(lease.is_settled(&spec, 1_030), "nothing left to report");
    assert_eq!(lease.poll_settle(&tuning, 1_030), None);
}

/// A small key (its cap below the minimum lease) leases only what a hit needs and never
/// prefetches, so a key of 2 per hour hit once from each of two nodes admits both.
#[test]
fn small_keys_lease_only_what_a_hit_needs() {
    let tuning = LeaseTuning::default();
    let cap = size_cap_tokens(2, 2);
    assert_eq!(cap, 1);
    assert_eq!(Credit::fail_open(&tuning, 2, 2).tokens_max, 0, "two nodes' credit would exceed it");
    let mut lease = KeyLease::new(2, cap);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease for the hit");
    assert_eq!(draft.tokens_wanted, 1);
    lease.apply_answer(&tuning, &draft, settled(1, 0, 1), 1_001);
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_001, 1), Spend::Admitted);
    assert_eq!(lease.poll_refill(&tuning, 1_002), None, "no prefetch below the watermark");
}

/// The surplus above a shrunken lease size is taken for return; the rest stays.
#[test]
fn surplus_is_returned_as_traffic_falls() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000, 1_000);
    let draft = lease.poll_lease_for(&tuning, 1_000, 400).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(400, 0, 600), 1_001);
    assert_eq!(lease.take_surplus(&tuning, 1_002), 395, "idle key: lease size 5");
    assert_eq!(lease.balance_tokens(1_002), 5);
    assert_eq!(lease.take_all(1_002), 5);
    let settle = lease.poll_settle(&tuning, 1_002).expect("400 went back");
    assert_eq!(settle.held_tokens, 0);
}

/// One step of a random lease life.
#[derive(Debug, Clone)]
enum Step {
    Spend { after_ms: u64, hits: u64 },
    Fallback { hits: u64 },
    Refill { after_ms: u64 },
    Answer { after_ms: u64, grant_percent: u64, retry_after_ms: u64 },
    Fail,
    Surplus,
    Settle,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0..20u64, 1..5u64).prop_map(|(after_ms, hits)| Step::Spend { after_ms, hits }),
        (1..3u64).prop_map(|hits| Step::Fallback { hits }),
        (0..50u64).prop_map(|after_ms| Step::Refill { after_ms }),
        (0..50u64, 0..=100u64, 0..500u64).prop_map(|(after_ms, grant_percent, retry_after_ms)| {
            Step::Answer { after_ms, grant_percent, retry_after_ms }
        }),
        Just(Step::Fail),
        Just(Step::Surplus),
        Just(Step::Settle),
    ]
}

proptest! {
    /// Against a ledger model that grants at most what was asked and settles every report:
    /// one report in flight at most; the balance never exceeds `held_tokens_max`; credit
    /// stays within its maximum (fallback admissions aside); every admission is counted as
    /// spent; and once every report has been answered and the key settled, the ledger's count
    /// of the key equals what the node spent plus what it holds.
    #[test]
    fn lease_life_respects_its_bounds(steps in proptest::collection::vec(step(), 1..300)) {
        let tuning = LeaseTuning::default();
        let credit = Credit::fail_open(&tuning, 2_000_000, 1);
        let mut lease = KeyLease::new(1_000_000, 1_000_000);
        let mut now_ms = 1_000_u64;
        let mut flying: Option<ReportDraft> = None;
        let mut admitted = 0_u64;
        let mut fallback = 0_u64;
        // The ledger model's count of the key: attributed = spent + held as last reported,
        // plus grants.
        let mut attributed = 0_u64;
        for step in steps {
            match step {
                Step::Spend { after_ms, hits } => {
                    now_ms += after_ms;
                    if matches!(lease.spend(&tuning, credit, now_ms, hits), Spend::Admitted | Spend::AdmittedOnCredit) {
                        admitted += hits;
                    }
                }
                Step::Fallback { hits } => {
                    lease.pay_beyond_lease(hits);
                    admitted += hits;
                    fallback += hits;
                }
                Step::Refill { after_ms } => {
                    now_ms += after_ms;
                    if let Some(draft) = lease.poll_refill(&tuning, now_ms) {
                        prop_assert!(flying.is_none(), "two reports in flight");
                        prop_assert!(draft.tokens_wanted <= tuning.max_lease_tokens);
                        flying = Some(draft);
                    }
                }
                Step::Settle => {
                    if let Some(draft) = lease.poll_settle(&tuning, now_ms) {
                        prop_assert!(flying.is_none(), "two reports in flight");
                        flying = Some(draft);
                    }
                }
                Step::Answer { after_ms, grant_percent, retry_after_ms } => {
                    if let Some(draft) = flying.take() {
                        now_ms += after_ms;
                        let granted = draft.tokens_wanted * grant_percent / 100;
                        attributed = draft.spent_tokens + draft.held_tokens + granted;
                        lease.apply_answer(&tuning, &draft, settled(granted, retry_after_ms, 1_000), now_ms);
                    }
                }
                Step::Fail => {
                    if let Some(draft) = flying.take() {
                        lease.apply_answer(&tuning, &draft, ReportAnswer::NotApplied, now_ms);
                    }
                }
                Step::Surplus => {
                    if !lease.in_flight() {
                        lease.take_surplus(&tuning, now_ms);
                    }
                }
            }
            prop_assert_eq!(lease.in_flight(), flying.is_some());
            prop_assert!(lease.balance_tokens(now_ms) <= tuning.held_tokens_max(1_000_000, 1));
            prop_assert!(lease.debt_tokens() <= credit.tokens_max + fallback);
        }
        // Drain: answer what flies, then settle until the ledger model agrees.
        for _ in 0..3 {
            if let Some(draft) = flying.take().or_else(|| lease.poll_settle(&tuning, now_ms)) {
                attributed = draft.spent_tokens + draft.held_tokens;
                lease.apply_answer(&tuning, &draft, settled(0, 0, 1_000), now_ms);
            }
        }
        prop_assert_eq!(lease.poll_settle(&tuning, now_ms), None);
        prop_assert_eq!(attributed, admitted + lease.balance_tokens(now_ms));
        prop_assert_eq!(lease.debt_tokens(), 0, "every debt charged");
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
/// nothing, owes nothing and waits for nothing; the last hit's time is remembered.
#[test]
fn large_requests_and_settling() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000, 1_000);
    // Refills a token a microsecond: "refilled since the answer" is never what waits here.
    let spec = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1, None).expect("a valid limit");
    assert!(lease.is_settled(&spec, 1_000));
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_000, 40), Spend::Short);
    assert_eq!(lease.last_hit_ms(), 1_000);
    let draft = lease.poll_lease_for(&tuning, 1_000, 40).expect("a lease");
    assert!(draft.tokens_wanted >= 40, "what the request lacks, more than the minimum lease of 5");
    assert!(!lease.is_settled(&spec, 1_001), "in flight");
    lease.apply_answer(&tuning, &draft, settled(40, 0, 960), 1_002);
    assert!(!lease.is_settled(&spec, 1_003), "holds tokens");
    assert_eq!(lease.spend(&tuning, Credit::NONE, 1_003, 40), Spend::Admitted);
    assert!(lease.is_settled(&spec, 1_003), "the ledger counts the 40 as this node's already");
    let draft = lease.poll_refill(&tuning, 1_004).expect("below the watermark");
    lease.apply_answer(&tuning, &draft, settled(0, 300, 0), 1_005);
    assert!(!lease.is_settled(&spec, 1_200), "blocked until 1,304");
    assert!(lease.is_settled(&spec, 1_304));
}

/// A key whose want the ledger answered short (divided at its limit) leases up to twice its
/// small-key cap, and back to the cap once a want is granted in full; a small key's cap
/// stays.
#[test]
fn a_divided_key_doubles_its_cap() {
    let tuning = LeaseTuning::default();
    let mut lease = KeyLease::new(1_000, 100);
    for now_ms in 1_000..1_200 {
        lease.observe_demand(&tuning, now_ms, 10);
    }
    let first = lease.poll_lease_for(&tuning, 1_200, 1).expect("a lease");
    assert_eq!(first.tokens_wanted, 100, "10,000/s held to the cap");
    lease.apply_answer(&tuning, &first, settled(60, 250, 0), 1_201);
    lease.spend(&tuning, Credit::NONE, 1_202, 60);
    let divided = lease.poll_lease_for(&tuning, 1_460, 1).expect("a lease");
    assert_eq!(divided.tokens_wanted, 200, "short of its want: divided");
    lease.apply_answer(&tuning, &divided, settled(200, 0, 500), 1_461);
    lease.spend(&tuning, Credit::NONE, 1_462, 200);
    let whole = lease.poll_lease_for(&tuning, 1_462, 1).expect("a lease");
    assert_eq!(whole.tokens_wanted, 100, "granted in full: the cap again");

    let mut small = KeyLease::new(8, 2);
    let draft = small.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    small.apply_answer(&tuning, &draft, settled(0, 250, 0), 1_001);
    for now_ms in 1_001..1_300 {
        small.observe_demand(&tuning, now_ms, 10);
    }
    let draft = small.poll_lease_for(&tuning, 1_300, 1).expect("a lease");
    assert_eq!(draft.tokens_wanted, 1, "a small key leases what a hit needs");
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

/// Credit never claims what the ledger said it no longer has: once the bucket's remainder is
/// promised to the report in flight, a short key waits instead of running up debt; and a key
/// the ledger last saw short of full is kept until its bucket has refilled.
#[test]
fn credit_stops_at_what_the_ledger_has_left() {
    use crate::core::rate::Algorithm;
    let tuning = LeaseTuning::default();
    let credit = Credit::fail_open(&tuning, 20, 1);
    let spec = LimitSpec::new(Algorithm::TokenBucket, 20, 1_000, None).expect("a valid limit");
    let mut lease = KeyLease::new(20, 10);
    let draft = lease.poll_lease_for(&tuning, 1_000, 1).expect("a lease");
    lease.apply_answer(&tuning, &draft, settled(5, 0, 3), 1_001);
    for _ in 0..5 {
        assert_eq!(lease.spend(&tuning, credit, 1_002, 1), Spend::Admitted);
    }
    let refill = lease.poll_refill(&tuning, 1_002).expect("below the watermark");
    assert_eq!(refill.tokens_wanted, 10, "5 hits in 2 ms read as a rate the key's cap holds");
    assert_eq!(
        lease.spend(&tuning, credit, 1_003, 1),
        Spend::Short,
        "3 left, all of them promised to the refill in flight"
    );
    lease.apply_answer(&tuning, &refill, settled(3, 0, 0), 1_004);
    assert!(lease.at_limit(1_004));
    for _ in 0..3 {
        assert_eq!(lease.spend(&tuning, credit, 1_005, 1), Spend::Admitted);
    }
    assert!(lease.at_limit(1_005), "no credit past an empty answer");
    let settle = lease.poll_settle(&tuning, 1_005);
    assert_eq!(settle, None, "spent what was granted: nothing to settle");
    assert!(!lease.is_settled(&spec, 1_500), "the bucket is still empty");
    assert!(lease.is_settled(&spec, 2_004), "20 refilled a second after the empty answer");
}

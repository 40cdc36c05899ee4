//! The per-request admission procedure of the abuse path, as a pure function of one
//! counter's state and `now_ms` (DESIGN section 3).
//!
//! [`judge`] decides one counter of one descriptor: spend from the leased balance, on credit
//! while the ledger can still pay, reject while the ledger said to wait or the key is at its
//! limit, and, once a lease is late or the ledger is out of reach, pay from a fallback bucket
//! (fail-open, charged to the ledger as debt) or deny (fail-closed). It returns the state the
//! counter would have after the decision ([`Staged`]) without writing anything: a request is
//! admitted only if every enforced counter admits it, and only then are the staged states
//! written. A rejected request consumes nothing, but its hits are still demand: the caller
//! counts them with [`record_rejected`], so a key at its limit reports its offered traffic,
//! which is what the ledger divides between nodes. The exception is a fixed window refusing
//! hits that did not fit: it is overrun ([`overrun_until_ms`]) and spends the rest of the
//! window, as envoyproxy/ratelimit counts hits past the limit.
//!
//! The shard actors (`crate::actors::shard`) hold the states under their stripe locks and do
//! the IO (asking leases, waiting for them); the leasing simulation
//! (`tests/t10_lease_simulation.rs`) drives this same function against the ledger's state
//! machine. Nothing here does IO or reads a clock.

use crate::core::lease::{Credit, KeyLease, LeaseTuning, Spend, fallback_limit, fallback_start};
use crate::core::policy::FailureMode;
use crate::core::rate::{Algorithm, LimitSpec, LimitState};

/// What a fail-closed rule tells a client to wait while the ledger is out of reach: the
/// circuit breaker's probe interval, the soonest the ledger can be back.
pub const FAIL_CLOSED_RETRY_AFTER_MS: u64 = 1_000;
/// The longest a request rejected by the fallback after its lease was late is told to wait:
/// the lease is on its way.
pub const LATE_LEASE_RETRY_AFTER_MS: u64 = 1_000;

/// Why a decision was paid from the fallback bucket instead of a ledger lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BypassReason {
    /// The circuit breaker is open: the ledger failed repeatedly.
    CircuitOpen,
    /// The key's lease did not arrive within `wait_budget_ms` (the request's share of
    /// Envoy's RLS timeout); what the fallback admitted is charged by the key's next report.
    LedgerTimeout,
    /// Too many requests were already waiting for leases.
    Overloaded,
}

impl BypassReason {
    /// The `reason` label of `rate_limit_bypassed_total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::CircuitOpen => "circuit_open",
            Self::LedgerTimeout => "ledger_timeout",
            Self::Overloaded => "overloaded",
        }
    }
}

/// What one limit said about a probe's hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether all the hits were admitted (never a part of them).
    pub admitted: bool,
    /// Hits still available: this node's balance plus what the ledger had left at its last
    /// grant (or the fallback bucket's count while deciding without the ledger).
    pub remaining: u64,
    /// Milliseconds until the limit is fully reset.
    pub reset_ms: u64,
    /// 0 when admitted; otherwise ms until the hits could be admitted, `u64::MAX` when they
    /// never can be at once.
    pub retry_after_ms: u64,
}

/// A local bucket that pays decisions while the ledger is out of reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fallback {
    /// The rule's limit scaled to this node's share.
    pub spec: LimitSpec,
    /// Its bucket or window.
    pub state: LimitState,
}

/// The part of a counter's state a decision changes, staged until the whole request is
/// decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Staged {
    /// The key's lease and settlement counts.
    pub lease: KeyLease,
    /// Its fallback bucket, only while the ledger is or was recently out of reach.
    pub fallback: Option<Fallback>,
}

/// How a decision treats a counter whose balance and credit do not cover its hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShortKeys {
    /// Ask a lease and wait for it (the circuit is closed or half-open).
    Wait,
    /// Decide now without the ledger, for this reason.
    Fallback(BypassReason),
}

/// One counter of one descriptor, as a request meets it.
#[derive(Debug, Clone, Copy)]
pub struct Counter<'c> {
    /// The limit the counter follows.
    pub spec: &'c LimitSpec,
    /// Hits the request adds (at least 1).
    pub hits: u64,
    /// The rule's lease sizes and TTL.
    pub tuning: &'c LeaseTuning,
    /// What to do when no lease can be had.
    pub failure_mode: FailureMode,
}

/// The region around a node, as admission needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Nodes leasing from the region's ledger (sizes credit and fallback shares).
    pub nodes_in_region: u64,
    /// The fallback buckets' multiplier of the limit, per mille.
    pub fallback_multiplier_permille: u64,
}

/// What one counter came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judged {
    /// Decided: write `staged` if the whole request is admitted.
    Decided {
        /// The answer for this counter.
        verdict: Verdict,
        /// The counter's state after the decision.
        staged: Staged,
        /// Set when admitted without a lease.
        bypass: Option<BypassReason>,
        /// True when a fail-closed rule denied because the ledger was out of reach.
        failed_closed: bool,
        /// True when admitted on credit (the next report charges it).
        on_credit: bool,
    },
    /// Rejected: the ledger answers but its bucket is empty; ask for what refills.
    AtLimit {
        /// The answer for this counter.
        verdict: Verdict,
    },
    /// The balance and credit do not cover the hits: ask a lease, then decide again (or
    /// decide with [`ShortKeys::Fallback`] once the lease is late).
    Short,
}

/// Decides `counter` from its `current` state at `now_ms`; writes nothing (module docs).
pub fn judge(
    current: &Staged,
    counter: &Counter<'_>,
    region: &Region,
    now_ms: u64,
    short_keys: ShortKeys,
) -> Judged {
    let Counter { spec, hits, tuning, failure_mode } = *counter;
    let capacity_tokens = spec.capacity_tokens();
    // A fixed window goes on to lease what is left, so that the refusal can spend it
    // ([`overrun_until_ms`]); other limits reject at once.
    if hits > capacity_tokens && !can_overrun(spec) {
        // More than the limit can ever admit at once: no lease would cover it.
        let verdict =
            Verdict { admitted: false, remaining: 0, reset_ms: 0, retry_after_ms: u64::MAX };
        return Judged::Decided {
            verdict,
            staged: *current,
            bypass: None,
            failed_closed: false,
            on_credit: false,
        };
    }
    // Credit is charged by the key's next report: none while the ledger is out of reach
    // (the fallback bucket is the allowance then), none for fail-closed rules.
    let credit = match (failure_mode, short_keys) {
        (FailureMode::Open, ShortKeys::Wait) => {
            Credit::fail_open(tuning, capacity_tokens, region.nodes_in_region)
        }
        _ => Credit::NONE,
    };
    let mut staged = *current;
    let ledger_remaining_tokens = staged.lease.ledger_remaining_tokens_at(spec, now_ms);
    let admitted = |staged: Staged, on_credit: bool| {
        let remaining = staged
            .lease
            .balance_tokens(now_ms)
            .saturating_add(ledger_remaining_tokens)
            .saturating_sub(staged.lease.debt_tokens())
            .min(capacity_tokens);
        let verdict = Verdict {
            admitted: true,
            remaining,
            reset_ms: spec.reset_ms_estimate(remaining, now_ms),
            retry_after_ms: 0,
        };
        Judged::Decided { verdict, staged, bypass: None, failed_closed: false, on_credit }
    };
    let rejected = |retry_after_ms: u64| Verdict {
        admitted: false,
        remaining: 0,
        reset_ms: spec.reset_ms_estimate(0, now_ms),
        retry_after_ms,
    };
    match staged.lease.spend(tuning, credit, now_ms, hits) {
        Spend::Admitted => admitted(staged, false),
        Spend::AdmittedOnCredit => admitted(staged, true),
        Spend::Blocked { retry_after_ms } => Judged::Decided {
            verdict: rejected(retry_after_ms),
            staged,
            bypass: None,
            failed_closed: false,
            on_credit: false,
        },
        // The ledger's bucket was empty after this node's last grant, which is still live:
        // the ledger answers and the key is at its limit. Reject as the ledger would, and
        // ask for what refills (a fallback here would admit above the limit, a wait would
        // hold requests the ledger cannot pay).
        Spend::Short if staged.lease.at_limit(now_ms) => Judged::AtLimit {
            verdict: rejected(if hits > capacity_tokens {
                u64::MAX
            } else {
                spec.reset_ms_estimate(capacity_tokens - hits, now_ms).max(1)
            }),
        },
        Spend::Short => match (short_keys, failure_mode) {
            (ShortKeys::Wait, _) => Judged::Short,
            (ShortKeys::Fallback(_), FailureMode::Closed) => {
                let verdict = Verdict {
                    admitted: false,
                    remaining: 0,
                    reset_ms: 0,
                    retry_after_ms: FAIL_CLOSED_RETRY_AFTER_MS,
                };
                Judged::Decided {
                    verdict,
                    staged,
                    bypass: None,
                    failed_closed: true,
                    on_credit: false,
                }
            }
            (ShortKeys::Fallback(reason), FailureMode::Open) => {
                let fallback_spec = fallback_limit(
                    spec,
                    region.fallback_multiplier_permille,
                    region.nodes_in_region,
                );
                let state =
                    staged.fallback.filter(|fallback| fallback.spec == fallback_spec).map_or_else(
                        || {
                            fallback_start(
                                &fallback_spec,
                                ledger_remaining_tokens.saturating_sub(staged.lease.debt_tokens()),
                                region.fallback_multiplier_permille,
                                region.nodes_in_region,
                                now_ms,
                            )
                        },
                        |fallback| fallback.state,
                    );
                let evaluation = fallback_spec.evaluate(&state, now_ms, hits);
                staged.fallback = Some(Fallback { spec: fallback_spec, state: evaluation.next });
                if evaluation.admitted {
                    // Paid without a lease: debt, charged by the key's next report.
                    staged.lease.pay_beyond_lease(hits);
                }
                // A lease that was merely late is on its way: the fallback's own wait (a
                // small key's share may refill in half an hour) would mislead the client.
                let retry_after_ms = match reason {
                    BypassReason::CircuitOpen => evaluation.retry_after_ms,
                    BypassReason::LedgerTimeout | BypassReason::Overloaded => {
                        evaluation.retry_after_ms.min(LATE_LEASE_RETRY_AFTER_MS)
                    }
                };
                let verdict = Verdict {
                    admitted: evaluation.admitted,
                    remaining: evaluation.remaining,
                    reset_ms: evaluation.reset_ms,
                    retry_after_ms,
                };
                Judged::Decided {
                    verdict,
                    staged,
                    bypass: Some(reason),
                    failed_closed: false,
                    on_credit: false,
                }
            }
        },
    }
}

/// True for a limit whose refused hits can overrun it ([`overrun_until_ms`]): a fixed window
/// that admits anything at all.
pub fn can_overrun(spec: &LimitSpec) -> bool {
    spec.algorithm == Algorithm::FixedWindow && spec.capacity_tokens() > 0
}

/// Until when a fixed-window counter is over its limit after refusing `hits` that a request
/// wanted to consume (the end of its window, node time), or `None` when the refusal changes
/// nothing.
///
/// envoyproxy/ratelimit adds every hit to its window's counter, past the limit too, and a
/// charge sent at a stream's end (Envoy's `apply_on_stream_done`) cannot be refused anyway:
/// a caller that overran what was left is over its limit for the rest of the window. A
/// quotamesh counter never goes past its limit, so it goes to it: hits beyond the whole
/// limit overrun it whatever is left, and so do hits beyond what the node knows is left (its
/// balance and the ledger's count at its last answer, less its debt), also when the lease
/// that would have told more came late and the fallback refused them. A refusal with nothing
/// left changes nothing (the window is spent already, as far as this node can tell). The
/// rejected hits are not counted past the limit, so nothing of them reaches the next window,
/// as upstream's counter starts every window at 0.
pub fn overrun_until_ms(lease: &KeyLease, spec: &LimitSpec, hits: u64, now_ms: u64) -> Option<u64> {
    let left_tokens = lease
        .balance_tokens(now_ms)
        .saturating_add(lease.ledger_remaining_tokens_at(spec, now_ms))
        .saturating_sub(lease.debt_tokens());
    let overran = hits > spec.capacity_tokens() || (left_tokens > 0 && hits > left_tokens);
    if !can_overrun(spec) || !overran {
        return None;
    }
    let window_ms = spec.window_ms.max(1);
    Some((now_ms / window_ms).saturating_add(1).saturating_mul(window_ms))
}

/// The answer to every hit and check of a counter overrun until `until_ms`
/// ([`overrun_until_ms`]): refused, nothing left, back when the window ends; `None` once it
/// has ended.
pub fn overrun_verdict(until_ms: u64, now_ms: u64) -> Option<Verdict> {
    let wait_ms = until_ms.checked_sub(now_ms).filter(|&wait_ms| wait_ms > 0)?;
    Some(Verdict { admitted: false, remaining: 0, reset_ms: wait_ms, retry_after_ms: wait_ms })
}

/// Spends the whole balance of an overrun counter (what it holds now, and what a lease
/// brings until its window ends): the ledger counts it as spent, so the window's count
/// reaches the limit. Other nodes' leases stay theirs (the drift bound of DESIGN section 3).
pub fn spend_what_is_left(lease: &mut KeyLease, now_ms: u64) {
    lease.pay_beyond_lease(lease.balance_tokens(now_ms));
}

/// How far a key's offered traffic is over `spec`'s rate, in thousandths of the limit (0 at
/// or under it; `None` for a limit of 0, which any traffic is over): this node's offered
/// rate (`demand_milli_per_second`, rejected hits included) times the region's nodes, since
/// Envoy spreads a caller's requests over them, against the limit's rate. What a warned
/// caller is told (`RateLimit-Warning`).
pub fn over_limit_permille(
    spec: &LimitSpec,
    demand_milli_per_second: u64,
    nodes_in_region: u64,
) -> Option<u64> {
    if spec.requests_per_window == 0 {
        return None;
    }
    // Both rates in milli-hits per window.
    let offered = u128::from(demand_milli_per_second)
        * u128::from(nodes_in_region.max(1))
        * u128::from(spec.window_ms.max(1))
        / 1_000;
    let limit = u128::from(spec.requests_per_window) * 1_000;
    let permille = (offered * 1_000 / limit).saturating_sub(1_000);
    Some(u64::try_from(permille).unwrap_or(u64::MAX))
}

/// Records a decided counter whose request was rejected: nothing is consumed (its staged
/// state is dropped), but its hits count as the key's demand.
pub fn record_rejected(lease: &mut KeyLease, counter: &Counter<'_>, now_ms: u64) {
    lease.observe_demand(counter.tuning, now_ms, counter.hits);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::lease::{Credit, ReportAnswer, size_cap_tokens};
    use proptest::prelude::*;

    const REGION: Region = Region { nodes_in_region: 5, fallback_multiplier_permille: 1_000 };

    fn limit(per_second: u64) -> LimitSpec {
        LimitSpec::new(Algorithm::TokenBucket, per_second, 1_000, None).expect("a valid limit")
    }

    fn fresh(spec: &LimitSpec) -> Staged {
        let capacity = spec.capacity_tokens();
        Staged {
            lease: KeyLease::new(capacity, size_cap_tokens(capacity, REGION.nodes_in_region)),
            fallback: None,
        }
    }

    /// Proves that a fail-closed rule denies, and says when to come back, once the ledger is
    /// out of reach: it never admits what the ledger has not granted.
    #[test]
    fn fail_closed_denies_without_the_ledger() {
        let spec = limit(100);
        let tuning = LeaseTuning::default();
        let counter =
            Counter { spec: &spec, hits: 1, tuning: &tuning, failure_mode: FailureMode::Closed };
        let short = ShortKeys::Fallback(BypassReason::CircuitOpen);
        let Judged::Decided { verdict, failed_closed, bypass, .. } =
            judge(&fresh(&spec), &counter, &REGION, 1_000, short)
        else {
            panic!("decided without the ledger");
        };
        assert!(!verdict.admitted && failed_closed && bypass.is_none());
        assert_eq!(verdict.retry_after_ms, FAIL_CLOSED_RETRY_AFTER_MS);
        // With the ledger in reach, the same key waits for its lease: no credit.
        assert_eq!(judge(&fresh(&spec), &counter, &REGION, 1_000, ShortKeys::Wait), Judged::Short);
    }

    /// Proves that a fail-open rule's fallback admission is debt for the next report, and
    /// that a late lease tells the client to retry within a second.
    #[test]
    fn the_fallback_admits_as_debt() {
        let spec = limit(1_000);
        let tuning = LeaseTuning::default();
        let counter =
            Counter { spec: &spec, hits: 3, tuning: &tuning, failure_mode: FailureMode::Open };
        let late = ShortKeys::Fallback(BypassReason::LedgerTimeout);
        let Judged::Decided { verdict, staged, bypass, .. } =
            judge(&fresh(&spec), &counter, &REGION, 1_000, late)
        else {
            panic!("decided from the fallback");
        };
        assert!(verdict.admitted);
        assert_eq!(bypass, Some(BypassReason::LedgerTimeout));
        assert_eq!(staged.lease.debt_tokens(), 3);
        assert_eq!(staged.lease.spent_tokens(), 3);
        assert!(staged.fallback.is_some());
    }

    /// Proves that more hits than the limit's capacity are rejected for good, fallback or not.
    #[test]
    fn hits_beyond_capacity_are_never_admitted() {
        let spec = limit(10);
        let tuning = LeaseTuning::default();
        let counter =
            Counter { spec: &spec, hits: 11, tuning: &tuning, failure_mode: FailureMode::Open };
        for short in [ShortKeys::Wait, ShortKeys::Fallback(BypassReason::CircuitOpen)] {
            let Judged::Decided { verdict, .. } = judge(&fresh(&spec), &counter, &REGION, 0, short)
            else {
                panic!("decided at once");
            };
            assert!(!verdict.admitted);
            assert_eq!(verdict.retry_after_ms, u64::MAX);
        }
    }

    /// Proves that a rejected request's hits are the key's demand: the report a key at its
    /// limit sends says what it is offered, not what it admitted.
    #[test]
    fn rejected_hits_count_as_demand() {
        let spec = limit(1_000);
        let tuning = LeaseTuning::default();
        let counter =
            Counter { spec: &spec, hits: 1, tuning: &tuning, failure_mode: FailureMode::Open };
        let mut lease = fresh(&spec).lease;
        for now_ms in 0..5_000 {
            record_rejected(&mut lease, &counter, now_ms);
        }
        let draft = lease.poll_lease_for(&tuning, 5_000, 1).expect("a short key asks");
        // 1,000 hits a second for five half-lives of the estimate: within 1/32 of the rate,
        // less the estimate's integer decay steps.
        assert!(
            (900_000..=1_000_000).contains(&draft.demand_milli_per_second),
            "demand {}",
            draft.demand_milli_per_second
        );
    }

    fn fixed_window(limit: u64) -> LimitSpec {
        LimitSpec::new(Algorithm::FixedWindow, limit, 60_000, None).expect("a valid limit")
    }

    /// A key that leased `granted_tokens` at `now_ms`, the ledger saying it had
    /// `remaining_tokens` left.
    fn leased(spec: &LimitSpec, granted_tokens: u64, remaining_tokens: u64, now_ms: u64) -> Staged {
        let tuning = LeaseTuning::default();
        let mut staged = fresh(spec);
        let draft = staged
            .lease
            .poll_lease_for(&tuning, now_ms, granted_tokens.max(1))
            .expect("a fresh key asks");
        // With nothing granted the ledger says when it will grant again: the window's end.
        let retry_after_ms =
            if granted_tokens == 0 { spec.window_ms - now_ms % spec.window_ms } else { 0 };
        let answer = ReportAnswer::Settled { granted_tokens, retry_after_ms, remaining_tokens };
        staged.lease.apply_answer(&tuning, &draft, answer, now_ms);
        staged
    }

    fn consuming<'c>(spec: &'c LimitSpec, tuning: &'c LeaseTuning, hits: u64) -> Counter<'c> {
        Counter { spec, hits, tuning, failure_mode: FailureMode::Open }
    }

    /// Proves that a fixed window's hits beyond its whole limit lease what is left (so that
    /// their refusal can spend it), while other algorithms refuse them at once.
    #[test]
    fn fixed_window_hits_beyond_capacity_lease_what_is_left() {
        let tuning = LeaseTuning::default();
        let spec = fixed_window(10);
        let judged =
            judge(&fresh(&spec), &consuming(&spec, &tuning, 11), &REGION, 0, ShortKeys::Wait);
        assert_eq!(judged, Judged::Short);
        let emptied = leased(&spec, 10, 0, 0);
        let Judged::AtLimit { verdict } =
            judge(&emptied, &consuming(&spec, &tuning, 11), &REGION, 0, ShortKeys::Wait)
        else {
            panic!("at the limit");
        };
        assert_eq!((verdict.admitted, verdict.retry_after_ms), (false, u64::MAX));
        assert_eq!(overrun_until_ms(&emptied.lease, &spec, 11, 0), Some(60_000));
        let mut spent = emptied.lease;
        spend_what_is_left(&mut spent, 0);
        assert_eq!(
            (spent.balance_tokens(0), spent.spent_tokens(), spent.debt_tokens()),
            (0, 10, 0)
        );
    }

    /// How far over a warned caller is: the node's offered rate times the region's nodes,
    /// against the limit's rate, in thousandths; 0 at or under it, none for a limit of 0.
    #[test]
    fn over_limit_is_the_region_rate_against_the_limit() {
        let per_minute = LimitSpec::new(Algorithm::TokenBucket, 100, 60_000, None).expect("valid");
        // 2 hits/s on one node is 120 a minute: 20 % over.
        assert_eq!(over_limit_permille(&per_minute, 2_000, 1), Some(200));
        // The same traffic spread over five nodes.
        assert_eq!(over_limit_permille(&per_minute, 400, 5), Some(200));
        assert_eq!(over_limit_permille(&per_minute, 1_000, 1), Some(0), "60 a minute is under");
        assert_eq!(over_limit_permille(&per_minute, u64::MAX, 1_000), Some(u64::MAX));
        assert_eq!(over_limit_permille(&fixed_window(0), 5_000, 1), None);
    }

    /// Proves when a refusal overruns a counter: only on a fixed window, for hits beyond its
    /// whole limit, or beyond what the node knows is left when something is; and that an
    /// overrun counter refuses everything until its window ends.
    #[test]
    fn an_overrun_needs_a_fixed_window_that_is_spent() {
        let window = fixed_window(10);
        let bucket = LimitSpec::new(Algorithm::TokenBucket, 10, 60_000, None).expect("valid");
        let emptied = leased(&window, 4, 0, 61_000).lease;
        assert_eq!(overrun_until_ms(&emptied, &window, 5, 61_000), Some(120_000));
        assert_eq!(overrun_until_ms(&fresh(&window).lease, &window, 11, 0), Some(60_000));
        // What the node holds and the ledger still has covers the hits: no overrun.
        assert_eq!(overrun_until_ms(&leased(&window, 4, 6, 0).lease, &window, 5, 0), None);
        assert_eq!(overrun_until_ms(&leased(&window, 4, 2, 0).lease, &window, 7, 0), Some(60_000));
        // Nothing held: the window is spent already as far as the node can tell.
        assert_eq!(overrun_until_ms(&leased(&window, 0, 0, 0).lease, &window, 1, 0), None);
        assert_eq!(overrun_until_ms(&leased(&bucket, 4, 0, 0).lease, &bucket, 5, 0), None);
        assert_eq!(overrun_until_ms(&fresh(&bucket).lease, &bucket, 11, 0), None);
        assert!(!can_overrun(&fixed_window(0)));
        let refused =
            Verdict { admitted: false, remaining: 0, reset_ms: 1_000, retry_after_ms: 1_000 };
        assert_eq!(overrun_verdict(60_000, 59_000), Some(refused));
        assert_eq!(overrun_verdict(60_000, 60_000), None);
        assert_eq!(overrun_verdict(0, 5), None);
    }

    /// Proves that a new window starts full for the fallback too: a lease that came late for
    /// the first hit of a window does not leave the fallback with the last window's count.
    #[test]
    fn the_fallback_starts_a_new_window_full() {
        let tuning = LeaseTuning::default();
        let spec = LimitSpec::new(Algorithm::FixedWindow, 50, 1_000, None).expect("valid");
        let spent = leased(&spec, 0, 0, 500);
        let late = ShortKeys::Fallback(BypassReason::LedgerTimeout);
        let counter = consuming(&spec, &tuning, 1);
        let Judged::Decided { verdict, .. } = judge(&spent, &counter, &REGION, 900, late) else {
            panic!("decided from the fallback");
        };
        assert!(!verdict.admitted, "the ledger's window is spent");
        let Judged::Decided { verdict, bypass, .. } = judge(&spent, &counter, &REGION, 1_050, late)
        else {
            panic!("decided from the fallback");
        };
        assert!(verdict.admitted && bypass.is_some(), "a new window: {verdict:?}");
    }

    proptest! {
        /// Proves upstream's counting of a charge larger than what is left, on a fixed window
        /// the ledger has emptied into this node's lease, as the shard applies it: the charge
        /// is refused, overruns the window and spends the whole balance (no token minted or
        /// lost: spent + balance is what was granted), and every later hit in the window is
        /// refused.
        #[test]
        fn a_refused_fixed_window_charge_overruns_the_window(
            limit in 1_u64..500,
            granted_share in 0_u64..=100,
            spent_share in 0_u64..=100,
            hits in 1_u64..1_200,
            later_ms in 0_u64..400,
        ) {
            let tuning = LeaseTuning::default();
            let spec = fixed_window(limit);
            let granted = limit * granted_share / 100;
            let mut state = leased(&spec, granted, 0, 1_000);
            let before = granted * spent_share / 100;
            if before > 0 {
                let counter = consuming(&spec, &tuning, before);
                let Judged::Decided { verdict, staged, .. } =
                    judge(&state, &counter, &REGION, 1_000, ShortKeys::Wait)
                else {
                    panic!("paid from the balance");
                };
                prop_assert!(verdict.admitted);
                state = staged;
            }
            prop_assume!(hits > granted - before);
            let counter = consuming(&spec, &tuning, hits);
            let verdict = match judge(&state, &counter, &REGION, 1_000, ShortKeys::Wait) {
                Judged::Decided { verdict, .. } | Judged::AtLimit { verdict } => verdict,
                Judged::Short => panic!("the ledger said it had nothing left"),
            };
            prop_assert!(!verdict.admitted);
            let until_ms = overrun_until_ms(&state.lease, &spec, hits, 1_000);
            prop_assert_eq!(until_ms.is_some(), hits > limit || granted > before);
            let mut lease = state.lease;
            if let Some(until_ms) = until_ms {
                prop_assert_eq!(until_ms, 60_000);
                spend_what_is_left(&mut lease, 1_000);
            }
            prop_assert_eq!(lease.balance_tokens(1_000), 0);
            prop_assert_eq!(lease.spent_tokens(), granted);
            prop_assert_eq!(lease.debt_tokens(), 0);
            let later_ms = 1_000 + later_ms;
            let after = Staged { lease, fallback: None };
            let next = until_ms.and_then(|until_ms| overrun_verdict(until_ms, later_ms)).map_or_else(
                || judge(&after, &consuming(&spec, &tuning, 1), &REGION, later_ms, ShortKeys::Wait),
                |verdict| Judged::AtLimit { verdict },
            );
            let admitted = matches!(next, Judged::Decided { verdict, .. } if verdict.admitted);
            prop_assert!(!admitted, "{:?}", next);
        }

        /// Proves that before any answer from the ledger a node admits at most its credit on
        /// a fail-open key and nothing on a fail-closed one, whatever the hits and times.
        #[test]
        fn without_an_answer_a_node_admits_at_most_its_credit(
            per_second in 1_u64..5_000,
            fail_open in any::<bool>(),
            requests in proptest::collection::vec((1_u64..4, 0_u64..50), 1..200),
        ) {
            let spec = limit(per_second);
            let tuning = LeaseTuning::default();
            let failure_mode = if fail_open { FailureMode::Open } else { FailureMode::Closed };
            let credit = if fail_open {
                Credit::fail_open(&tuning, spec.capacity_tokens(), REGION.nodes_in_region)
            } else {
                Credit::NONE
            };
            let mut state = fresh(&spec);
            let mut now_ms = 0;
            let mut admitted_hits = 0;
            for (hits, step_ms) in requests {
                now_ms += step_ms;
                let counter = Counter { spec: &spec, hits, tuning: &tuning, failure_mode };
                match judge(&state, &counter, &REGION, now_ms, ShortKeys::Wait) {
                    Judged::Decided { verdict, staged, .. } if verdict.admitted => {
                        admitted_hits += hits;
                        state = staged;
                    }
                    _ => record_rejected(&mut state.lease, &counter, now_ms),
                }
            }
            prop_assert!(admitted_hits <= credit.tokens_max);
            prop_assert_eq!(state.lease.debt_tokens(), admitted_hits);
        }
    }
}

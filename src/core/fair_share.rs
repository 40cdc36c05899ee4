//! Dividing a contended key's refill between the nodes that want it (DESIGN section 3).
//!
//! When the nodes' reported demand for a key exceeds its rate, the ledger divides the rate
//! max-min fairly (as Doorman does): every node gets its demand if that fits, and what the
//! modest nodes leave is split evenly between the hungry ones. Each node's share accrues as
//! an [`Entitlement`] in ledger time, so what a node is granted follows its share and not how
//! fast its requests reach the leader (the leader's own node has the shortest path) or what
//! its clock says. The ledger's apply (`crate::core::ledger`) calls these functions; they
//! do no IO and read no clock.

use crate::core::rate::{LimitSpec, MICRO_TOKENS_PER_TOKEN};

/// Milli-tokens per second in one token per second.
pub const MILLI_PER_TOKEN: u64 = 1_000;

/// A limit's refill rate, in milli-tokens per second (a token bucket's refill, a window's
/// count per window), saturating at `u64::MAX`.
pub fn rate_milli_per_second(limit: &LimitSpec) -> u64 {
    let rate =
        u128::from(limit.requests_per_window) * 1_000_000 / u128::from(limit.window_ms.max(1));
    u64::try_from(rate).unwrap_or(u64::MAX)
}

/// Max-min fair division of `capacity` between `demands` (same unit, e.g. milli-tokens per
/// second): each gets `min(demand, level)` for the one water level that spends the capacity
/// (or everyone's demand, when the demands fit). Returned in the order of `demands`; the
/// sum never exceeds `capacity`, and integer rounding leaves at most one unit per demand
/// unspent.
pub fn max_min_fair(capacity: u64, demands: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_unstable_by_key(|&index| demands[index]);
    let mut shares = vec![0; demands.len()];
    let mut left = capacity;
    for (served, &index) in order.iter().enumerate() {
        let waiting = (demands.len() - served) as u64;
        let level = left / waiting;
        let share = demands[index].min(level);
        shares[index] = share;
        left -= share;
    }
    shares
}

/// What a node may be granted of a contended key: its share, accrued in ledger time and
/// capped at `horizon_ms` of it (so an idle node cannot hoard a burst), in micro-tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Entitlement {
    /// Accrued and not yet granted.
    pub micro_tokens: u64,
    /// Ledger time it was last brought up to date.
    pub updated_ms: u64,
}

impl Entitlement {
    /// Accrues `share_milli_per_second` from the last update to `now_ms`, capped at
    /// `horizon_ms` of the share. A clock that steps back accrues nothing.
    pub fn accrue(&mut self, share_milli_per_second: u64, horizon_ms: u64, now_ms: u64) {
        let elapsed_ms = now_ms.saturating_sub(self.updated_ms);
        self.updated_ms = self.updated_ms.max(now_ms);
        let cap = accrual_micro(share_milli_per_second, horizon_ms);
        self.micro_tokens = self
            .micro_tokens
            .saturating_add(accrual_micro(share_milli_per_second, elapsed_ms))
            .min(cap);
    }

    /// Whole tokens that may be granted now.
    pub fn whole_tokens(&self) -> u64 {
        self.micro_tokens / MICRO_TOKENS_PER_TOKEN
    }

    /// Takes `tokens` granted out of the entitlement (never below zero: a grant of free
    /// tokens beyond it costs nothing).
    pub fn take(&mut self, tokens: u64) {
        self.micro_tokens =
            self.micro_tokens.saturating_sub(tokens.saturating_mul(MICRO_TOKENS_PER_TOKEN));
    }

    /// Milliseconds until one whole token has accrued at `share_milli_per_second`
    /// (`u64::MAX` for a share of 0).
    pub fn ms_until_one_token(&self, share_milli_per_second: u64) -> u64 {
        if self.micro_tokens >= MICRO_TOKENS_PER_TOKEN {
            return 0;
        }
        if share_milli_per_second == 0 {
            return u64::MAX;
        }
        (MICRO_TOKENS_PER_TOKEN - self.micro_tokens).div_ceil(share_milli_per_second)
    }
}

/// Micro-tokens accrued over `elapsed_ms` at `milli_per_second`: milli-tokens per second
/// times milliseconds is exactly micro-tokens.
fn accrual_micro(milli_per_second: u64, elapsed_ms: u64) -> u64 {
    u64::try_from(u128::from(milli_per_second) * u128::from(elapsed_ms)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::rate::Algorithm;
    use proptest::prelude::*;

    /// Demands that fit are met; a hungry node is capped at the level the others leave.
    #[test]
    fn max_min_examples() {
        assert_eq!(max_min_fair(100, &[10, 20, 30]), vec![10, 20, 30]);
        assert_eq!(max_min_fair(100, &[10, 200, 300]), vec![10, 45, 45]);
        assert_eq!(max_min_fair(90, &[200, 200, 200]), vec![30, 30, 30]);
        assert_eq!(max_min_fair(10, &[]), Vec::<u64>::new());
        assert_eq!(max_min_fair(0, &[5, 5]), vec![0, 0]);
    }

    /// One token per second of a 60-per-minute limit is 1000 milli-tokens per second.
    #[test]
    fn rate_of_a_limit() {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 60, 60_000, None).expect("valid");
        assert_eq!(rate_milli_per_second(&limit), 1_000);
        let fast = LimitSpec::new(Algorithm::FixedWindow, 50_000, 60_000, None).expect("valid");
        assert_eq!(rate_milli_per_second(&fast), 833_333);
    }

    /// An entitlement accrues its share, stops at its horizon and pays grants.
    #[test]
    fn entitlement_accrues_and_caps() {
        let mut entitlement = Entitlement { micro_tokens: 0, updated_ms: 0 };
        entitlement.accrue(2_000, 250, 100); // 2 tokens/s for 100 ms
        assert_eq!(entitlement.micro_tokens, 200_000);
        assert_eq!(entitlement.ms_until_one_token(2_000), 400);
        entitlement.accrue(2_000, 250, 10_000);
        assert_eq!(entitlement.micro_tokens, 500_000, "capped at 250 ms of the share");
        entitlement.accrue(2_000, 250, 5_000);
        assert_eq!(entitlement.updated_ms, 10_000, "time never steps back");
        let mut full = Entitlement { micro_tokens: 0, updated_ms: 0 };
        full.accrue(8_000, 250, 1_000);
        assert_eq!(full.whole_tokens(), 2);
        full.take(5);
        assert_eq!(full.micro_tokens, 0, "a grant beyond it costs no more than it holds");
    }

    proptest! {
        /// Max-min fairness: shares never exceed demand or, together, the capacity; they
        /// spend the capacity up to rounding when demand exceeds it; and no node short of its
        /// demand gets less than any other node (up to one unit of rounding).
        #[test]
        fn max_min_is_fair(capacity in 0..1_000_000u64, demands in proptest::collection::vec(0..500_000u64, 0..12)) {
            let shares = max_min_fair(capacity, &demands);
            prop_assert_eq!(shares.len(), demands.len());
            let total: u64 = shares.iter().sum();
            prop_assert!(total <= capacity);
            let demanded: u64 = demands.iter().sum();
            let n = demands.len() as u64;
            if demanded >= capacity {
                prop_assert!(total + n >= capacity, "spends the capacity: {total} of {capacity}");
            } else {
                prop_assert_eq!(total, demanded);
            }
            for (index, (&share, &demand)) in shares.iter().zip(&demands).enumerate() {
                prop_assert!(share <= demand);
                if share < demand {
                    for (other, &other_share) in shares.iter().enumerate() {
                        prop_assert!(other_share <= share + 1, "node {index} short at {share}, node {other} has {other_share}");
                    }
                }
            }
        }

        /// Over any sequence of accruals, the entitlement never exceeds its cap nor what the
        /// share accrued over the elapsed time plus what it started with.
        #[test]
        fn entitlement_is_bounded(share in 0..10_000_000u64, horizon_ms in 1..10_000u64, steps in proptest::collection::vec(0..5_000u64, 1..50)) {
            let mut entitlement = Entitlement::default();
            let mut now_ms = 0;
            for step in steps {
                now_ms += step;
                entitlement.accrue(share, horizon_ms, now_ms);
                prop_assert!(u128::from(entitlement.micro_tokens) <= u128::from(share) * u128::from(horizon_ms));
                prop_assert!(u128::from(entitlement.micro_tokens) <= u128::from(share) * u128::from(now_ms));
            }
        }
    }
}

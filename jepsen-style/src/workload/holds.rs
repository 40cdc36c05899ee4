//! The holds workload's plan: on the bank's accounts (opened and funded the same way), holds
//! reserved with a short TTL and then, after a seeded wait that is as often shorter as
//! longer than the TTL, captured (for part or all of the amount), voided, or left to expire;
//! and balance reads. So captures race expiry, and the clock nemesis moves the ledger's
//! time under them. Pure: the seed and the options fix every planned operation.

use serde::{Deserialize, Serialize};

use super::bank::BankOptions;
use super::{OPERATIONS_PER_WORKER_MAX, Pacing, Planned, PlannedOp};

/// How a planned hold ends, from the client's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HoldEnd {
    Capture {
        amount: u64,
    },
    Void,
    /// Nothing: the ledger expires it.
    Lapse,
}

/// A hold's TTL is drawn from this range (ledger time), short enough for expiries to happen
/// while the workload runs.
pub const TTL_MS_MIN: u64 = 200;
pub const TTL_MS_MAX: u64 = 2_000;

/// In percent: the share of planned operations that are holds (the rest are reads).
const HOLD_PERCENT: u64 = 80;

/// The accounts' shape for the holds workload: the bank's, funded 10,000 above the floor of
/// 100 so that open holds rarely exhaust an account, holds of 1 to 60.
pub fn options(pacing: Pacing) -> BankOptions {
    BankOptions {
        accounts: 3,
        initial_balance: 10_000,
        transfer_percent: 0,
        ..BankOptions::new(pacing)
    }
}

/// The idempotency keys of a hold's reserve and of its capture or void.
pub fn hold_keys(hold: u64) -> (String, String) {
    (format!("hold-{hold}-reserve"), format!("hold-{hold}-resolve"))
}

/// Every worker's operations, in order. Hold numbers (`worker x`
/// [`OPERATIONS_PER_WORKER_MAX`] `+ sequence`) are unique across workers.
pub fn plan(seed: u64, options: &BankOptions) -> Vec<Vec<Planned>> {
    let accounts = options.accounts.max(1);
    options.pacing.plan(seed, |rng, worker, sequence| {
        if !rng.percent(HOLD_PERCENT) {
            return PlannedOp::Read { account: rng.index(accounts) };
        }
        let amount = rng.between(1, options.transfer_amount_max.max(1));
        let ttl_ms = rng.between(TTL_MS_MIN, TTL_MS_MAX);
        let end = match rng.between(0, 9) {
            0..=4 => HoldEnd::Capture { amount: rng.between(1, amount) },
            5..=7 => HoldEnd::Void,
            _ => HoldEnd::Lapse,
        };
        PlannedOp::Hold {
            hold: worker * OPERATIONS_PER_WORKER_MAX + sequence,
            account: rng.index(accounts),
            amount,
            ttl_ms,
            wait_ms: rng.between(0, ttl_ms * 2),
            end,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Holds have unique numbers, existing accounts, amounts and TTLs in range, a
        /// capture of at most the held amount, and waits on both sides of the TTL.
        #[test]
        fn holds_are_sane(seed: u64, rate in 1_u64..400, time_limit_ms in 0_u64..30_000) {
            let options = options(Pacing::new(3, rate, time_limit_ms));
            let mut holds = std::collections::HashSet::new();
            for planned in plan(seed, &options).into_iter().flatten() {
                if let PlannedOp::Hold { hold, account, amount, ttl_ms, wait_ms, end } = planned.op {
                    prop_assert!(holds.insert(hold));
                    prop_assert!(account < options.accounts);
                    prop_assert!((1..=options.transfer_amount_max).contains(&amount));
                    prop_assert!((TTL_MS_MIN..=TTL_MS_MAX).contains(&ttl_ms));
                    prop_assert!(wait_ms <= ttl_ms * 2);
                    if let HoldEnd::Capture { amount: captured } = end {
                        prop_assert!((1..=amount).contains(&captured));
                    }
                }
            }
        }
    }

    /// Over a run, captures are planned both before and after their hold's TTL, and every
    /// kind of end comes up.
    #[test]
    fn captures_race_expiry() {
        let planned: Vec<PlannedOp> = plan(7, &options(Pacing::new(3, 200, 10_000)))
            .into_iter()
            .flatten()
            .map(|planned| planned.op)
            .collect();
        let capture = |early: bool| {
            planned.iter().any(|op| {
                matches!(op, PlannedOp::Hold { ttl_ms, wait_ms, end: HoldEnd::Capture { .. }, .. }
                    if (wait_ms < ttl_ms) == early)
            })
        };
        assert!(capture(true) && capture(false));
        for end in [HoldEnd::Void, HoldEnd::Lapse] {
            assert!(
                planned.iter().any(
                    |op| matches!(op, PlannedOp::Hold { end: planned, .. } if *planned == end)
                )
            );
        }
    }
}

//! The bank workload's plan: accounts opened with a balance above a floor, then transfers
//! (a debit from one account and, once approved, a credit of the same amount to another,
//! each under its own idempotency key, retried with that key when the outcome is unknown)
//! and linearizable balance reads, spread over workers and nodes at a given rate. Pure: the
//! seed and the options fix every planned operation.
//!
//! The billing API has no atomic transfer, so money is "in flight" between an approved
//! debit and its credit; the bank checker counts it so.

use serde::{Deserialize, Serialize};

use super::{OPERATIONS_PER_WORKER_MAX, Pacing, Planned, PlannedOp};

/// The tenant every account of the workload belongs to.
pub const TENANT: &str = "jepsen";

/// The workload's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BankOptions {
    pub accounts: usize,
    /// Credited to every account when it is opened.
    pub initial_balance: u64,
    /// No debit may take a balance below it.
    pub floor: u64,
    /// Transfers move 1 to this much.
    pub transfer_amount_max: u64,
    /// In percent: the share of planned operations that are transfers (the rest are reads).
    #[serde(default = "transfer_percent_default")]
    pub transfer_percent: u64,
    #[serde(flatten)]
    pub pacing: Pacing,
}

impl BankOptions {
    /// The defaults at the given pace: five accounts of 1,000 with a floor of 100 and
    /// transfers up to 60, so the floor is reached now and then (and `INSUFFICIENT_FUNDS`
    /// decisions get checked too).
    pub fn new(pacing: Pacing) -> Self {
        Self {
            accounts: 5,
            initial_balance: 1_000,
            floor: 100,
            transfer_amount_max: 60,
            transfer_percent: TRANSFER_PERCENT_DEFAULT,
            pacing,
        }
    }

    /// The `linear` workload's shape: the bank's on two accounts, half transfers and half
    /// reads, so every account sees many concurrent writes and reads for the
    /// linearizability search to order.
    pub fn linear(pacing: Pacing) -> Self {
        Self { accounts: 2, transfer_percent: 50, ..Self::new(pacing) }
    }
}

/// The bank's share of transfers (runs saved before it was an option had it too).
const TRANSFER_PERCENT_DEFAULT: u64 = 70;

fn transfer_percent_default() -> u64 {
    TRANSFER_PERCENT_DEFAULT
}

/// An account's meter name.
pub fn account_name(position: usize) -> String {
    format!("account-{position}")
}

/// The idempotency key opening an account.
pub fn create_key(account: &str) -> String {
    format!("create-{account}")
}

/// The idempotency key funding an account.
pub fn fund_key(account: &str) -> String {
    format!("fund-{account}")
}

/// The idempotency keys of a transfer's debit and credit.
pub fn transfer_keys(transfer: u64) -> (String, String) {
    (format!("transfer-{transfer}-debit"), format!("transfer-{transfer}-credit"))
}

/// Every worker's operations, in order. Transfer ids (`worker x`
/// [`OPERATIONS_PER_WORKER_MAX`] `+ sequence`) are unique across workers.
pub fn plan(seed: u64, options: &BankOptions) -> Vec<Vec<Planned>> {
    let accounts = options.accounts;
    options.pacing.plan(seed, |rng, worker, sequence| {
        if accounts >= 2 && rng.percent(options.transfer_percent) {
            let from = rng.index(accounts);
            let to = (from + 1 + rng.index(accounts - 1)) % accounts;
            let amount = rng.between(1, options.transfer_amount_max.max(1));
            let transfer = worker * OPERATIONS_PER_WORKER_MAX + sequence;
            PlannedOp::Transfer { transfer, from, to, amount }
        } else {
            PlannedOp::Read { account: rng.index(accounts.max(1)) }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Transfers have unique ids, two distinct existing accounts and amounts in range
        /// (pacing and seeding are `Pacing::plan`'s, tested with it).
        #[test]
        fn transfers_are_sane(seed: u64, rate in 1_u64..400, time_limit_ms in 0_u64..30_000) {
            let options = BankOptions::new(Pacing::new(3, rate, time_limit_ms));
            let mut transfers = std::collections::HashSet::new();
            for planned in plan(seed, &options).into_iter().flatten() {
                if let PlannedOp::Transfer { transfer, from, to, amount } = planned.op {
                    prop_assert!(transfers.insert(transfer));
                    prop_assert!(from != to && from.max(to) < options.accounts);
                    prop_assert!((1..=options.transfer_amount_max).contains(&amount));
                }
            }
        }
    }

    /// Another seed plans other operations.
    #[test]
    fn seeds_differ() {
        let options = BankOptions::new(Pacing::new(3, 200, 5_000));
        assert_ne!(plan(1, &options), plan(2, &options));
    }
}

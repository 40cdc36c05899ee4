//! `linearizable` (C1 of the fault-testing plan): the billing API's accounts behave as if
//! each operation took effect at one instant between its invoke and its completion, in one
//! order, with every `ok` answer the one a single sequential ledger would give. Judged from
//! the client history alone (no trail), per account (operations on different accounts
//! commute, so a history is linearizable iff each account's is: P-compositionality), by the
//! search in `wgl.rs`.
//!
//! A mutation is one logical operation per idempotency key, however many attempts it took:
//! it may have taken effect from its first attempt's invoke on (an attempt that ended `info`
//! may have committed), its output is the first `ok` reply (a `DUPLICATE` replay carries
//! the original commit's result), it is unknown when no attempt was `ok` but one was
//! `info`, and absent when every attempt failed. A read is one operation; only `ok` reads
//! count (a failed read observed nothing).
//!
//! The model per account: not opened, or a balance and a floor; a create opens it at 0; a
//! credit adds; a debit is approved and subtracts exactly when the amount fits above the
//! floor (the bank makes no holds), and is refused, changing nothing, otherwise; a read
//! returns the balance. What this finds that `bank.rs`'s trail checks may not: a read that
//! misses an acknowledged write but matches some index, an answer no order explains (a lost
//! or doubled write, a stale read), without trusting the indexes the nodes report.

use std::collections::BTreeMap;

use super::CheckResult;
use super::wgl::{self, Model, Outcome, Timed};
use crate::history::{Decision, Event, EventType, Function, Operation, operations};

/// The search's bound per account, in model steps: a bank run of 60 s at 200 operations a
/// second takes a few times its operation count; a history past this is reported unknown.
pub const STEPS_PER_ACCOUNT_MAX: u64 = 2_000_000;

/// What one operation on an account did, as far as the client knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BalanceOp {
    Create {
        floor: u64,
    },
    /// With the balance after it, when acknowledged.
    Credit {
        amount: u64,
        balance: Option<u64>,
    },
    /// With the decision and the balance after it, when acknowledged.
    Debit {
        amount: u64,
        outcome: Option<(Decision, u64)>,
    },
    Read {
        balance: u64,
    },
}

/// An account as the sequential model holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccountState {
    pub balance: u64,
    pub floor: u64,
}

/// One account of the billing ledger without holds; `None` until it is opened.
pub struct AccountModel;

impl Model for AccountModel {
    type State = Option<AccountState>;
    type Op = BalanceOp;

    fn initial(&self) -> Self::State {
        None
    }

    fn step(&self, state: &Self::State, op: &BalanceOp) -> Option<Self::State> {
        match (state, op) {
            (None, BalanceOp::Create { floor }) => {
                Some(Some(AccountState { balance: 0, floor: *floor }))
            }
            // Only a create opens an account; nothing else takes effect on a closed one.
            (None, _) | (Some(_), BalanceOp::Create { .. }) => None,
            (Some(account), BalanceOp::Credit { amount, balance }) => {
                let after = account.balance.checked_add(*amount)?;
                balance
                    .is_none_or(|seen| seen == after)
                    .then_some(Some(AccountState { balance: after, floor: account.floor }))
            }
            (Some(account), BalanceOp::Debit { amount, outcome }) => {
                let available = account.balance.saturating_sub(account.floor);
                let (decision, after) = if *amount <= available {
                    (Decision::Approved, account.balance - amount)
                } else {
                    (Decision::InsufficientFunds, account.balance)
                };
                outcome
                    .is_none_or(|seen| seen == (decision, after))
                    .then_some(Some(AccountState { balance: after, floor: account.floor }))
            }
            (Some(account), BalanceOp::Read { balance }) => {
                (account.balance == *balance).then_some(*state)
            }
        }
    }
}

/// An operation of an account's history, with the event that introduced it (for reports).
#[derive(Debug, Clone)]
pub struct AccountOp {
    pub timed: Timed<BalanceOp>,
    /// The history event of its (first) invoke.
    pub event: u64,
}

/// Each account's operations, in invoke order: mutations one per key, `ok` reads.
pub fn account_histories(events: &[Event]) -> BTreeMap<String, Vec<AccountOp>> {
    let mut accounts: BTreeMap<String, Vec<AccountOp>> = BTreeMap::new();
    // Each key's attempts, in the order they were invoked.
    let mut attempts: BTreeMap<&str, Vec<Operation<'_>>> = BTreeMap::new();
    for operation in operations(events) {
        let invoke = operation.invoke;
        match (invoke.f, invoke.value.key.as_deref()) {
            (Function::Read, _) => {
                if let (EventType::Ok, Some(balance)) =
                    (operation.outcome(), operation.result().balance)
                {
                    accounts.entry(invoke.value.account.clone()).or_default().push(AccountOp {
                        timed: Timed {
                            invoke_ns: invoke.time_ns,
                            complete_ns: Some(operation.completed_ns()),
                            op: BalanceOp::Read { balance },
                        },
                        event: invoke.index,
                    });
                }
            }
            (Function::CreateAccount | Function::Credit | Function::Debit, Some(key)) => {
                attempts.entry(key).or_default().push(operation);
            }
            _ => {}
        }
    }
    for tries in attempts.values() {
        let first = tries[0].invoke;
        let acknowledged = tries.iter().find(|attempt| attempt.outcome() == EventType::Ok);
        if acknowledged.is_none()
            && tries.iter().all(|attempt| attempt.outcome() == EventType::Fail)
        {
            continue; // never applied
        }
        let reply = acknowledged.map(Operation::result);
        let amount = first.value.amount.unwrap_or(0);
        let op = match first.f {
            Function::CreateAccount => BalanceOp::Create { floor: amount },
            Function::Credit => {
                BalanceOp::Credit { amount, balance: reply.and_then(|reply| reply.balance) }
            }
            _ => BalanceOp::Debit {
                amount,
                outcome: reply.and_then(|reply| reply.decision.zip(reply.balance)),
            },
        };
        accounts.entry(first.value.account.clone()).or_default().push(AccountOp {
            timed: Timed {
                invoke_ns: first.time_ns,
                complete_ns: acknowledged.map(Operation::completed_ns),
                op,
            },
            event: first.index,
        });
    }
    for ops in accounts.values_mut() {
        ops.sort_by_key(|op| (op.timed.invoke_ns, op.event));
    }
    accounts
}

fn describe(op: &BalanceOp) -> String {
    match op {
        BalanceOp::Create { floor } => format!("open with floor {floor}"),
        BalanceOp::Credit { amount, balance: Some(balance) } => {
            format!("credit {amount} answered balance {balance}")
        }
        BalanceOp::Credit { amount, balance: None } => format!("credit {amount} (unknown)"),
        BalanceOp::Debit { amount, outcome: Some((decision, balance)) } => {
            format!("debit {amount} answered {decision:?}, balance {balance}")
        }
        BalanceOp::Debit { amount, outcome: None } => format!("debit {amount} (unknown)"),
        BalanceOp::Read { balance } => format!("read {balance}"),
    }
}

/// Searches every account's history for a linearization, each within `steps_per_account_max`
/// steps of the search (past it: unknown).
pub fn check(events: &[Event], steps_per_account_max: u64) -> CheckResult {
    let mut result = CheckResult::new("linearizable");
    for (account, ops) in account_histories(events) {
        result.checked += ops.len() as u64;
        let timed: Vec<Timed<BalanceOp>> = ops.iter().map(|op| op.timed.clone()).collect();
        match wgl::check(&AccountModel, &timed, steps_per_account_max) {
            Outcome::Linearizable => {}
            Outcome::NotLinearizable { placed, state, stuck } => {
                let state = state.map_or("not open".to_owned(), |state| {
                    format!("balance {} (floor {})", state.balance, state.floor)
                });
                result.problem(format!(
                    "{account}: no order of its {} operations explains their answers; the \
                     longest order found places {placed} of them, leaving {state}, and then \
                     nothing explains the operation invoked at event {}: {}",
                    ops.len(),
                    ops[stuck].event,
                    describe(&ops[stuck].timed.op)
                ));
            }
            Outcome::Unbounded { steps } => result.unknown(format!(
                "{account}: {} operations, not judged within {steps} steps of the search",
                ops.len()
            )),
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::OpValue;
    use crate::history::tests::HistoryBuilder;
    use proptest::prelude::*;

    const STEPS: u64 = 100_000;

    /// Hand-made histories of one account, "a", opened with a floor of 100 and funded 1,000
    /// by process 0 before anything else.
    struct Account {
        history: HistoryBuilder,
        next_key: u64,
    }

    impl Account {
        fn new() -> Self {
            let mut account = Self { history: HistoryBuilder::new(), next_key: 0 };
            let create = account.invoke(0, Function::CreateAccount, 100);
            account.ok(0, Function::CreateAccount, create, None, 0);
            let fund = account.invoke(0, Function::Credit, 1_000);
            account.ok(0, Function::Credit, fund, None, 1_000);
            account
        }

        /// Invokes a mutation under a fresh key; returns its value.
        fn invoke(&mut self, process: u64, f: Function, amount: u64) -> OpValue {
            self.next_key += 1;
            let value = OpValue {
                account: "a".into(),
                amount: Some(amount),
                key: Some(format!("k{}", self.next_key)),
                ..OpValue::default()
            };
            self.history.push(process, EventType::Invoke, f, value.clone());
            value
        }

        fn ok(
            &mut self,
            process: u64,
            f: Function,
            value: OpValue,
            decision: Option<Decision>,
            balance: u64,
        ) {
            let decision = decision.or(Some(Decision::Approved));
            let reply = OpValue { decision, balance: Some(balance), ..value };
            self.history.push(process, EventType::Ok, f, reply);
        }

        fn end(&mut self, process: u64, event_type: EventType, f: Function, value: OpValue) {
            self.history.push(process, event_type, f, value);
        }

        fn read(&mut self, process: u64, balance: u64) {
            let value = OpValue { account: "a".into(), ..OpValue::default() };
            self.history.push(process, EventType::Invoke, Function::Read, value.clone());
            let reply = OpValue { balance: Some(balance), ..value };
            self.history.push(process, EventType::Ok, Function::Read, reply);
        }

        fn validity(&self) -> Validity {
            check(&self.history.events, STEPS).validity
        }
    }

    /// Sequential operations with the answers a ledger gives are linearizable.
    #[test]
    fn a_sequential_history_passes() {
        let mut account = Account::new();
        let debit = account.invoke(1, Function::Debit, 30);
        account.ok(1, Function::Debit, debit, None, 970);
        let refused = account.invoke(1, Function::Debit, 900);
        account.ok(1, Function::Debit, refused, Some(Decision::InsufficientFunds), 970);
        account.read(2, 970);
        assert_eq!(account.validity(), Validity::Valid);
    }

    /// A concurrent credit and debit may take effect in either order.
    #[test]
    fn concurrent_operations_in_either_order_pass() {
        for (debit_saw, credit_saw) in [(990, 1_000), (1_000, 1_010)] {
            let mut account = Account::new();
            let debit = account.invoke(1, Function::Debit, 10);
            let credit = account.invoke(2, Function::Credit, 10);
            account.ok(1, Function::Debit, debit, None, debit_saw);
            account.ok(2, Function::Credit, credit, None, credit_saw);
            account.read(3, 1_000);
            assert_eq!(account.validity(), Validity::Valid, "{debit_saw} {credit_saw}");
        }
    }

    /// A read invoked after a credit was acknowledged that misses it is flagged.
    #[test]
    fn a_stale_read_is_flagged() {
        let mut account = Account::new();
        let credit = account.invoke(1, Function::Credit, 10);
        account.ok(1, Function::Credit, credit, None, 1_010);
        account.read(2, 1_000);
        let result = check(&account.history.events, STEPS);
        assert_eq!(result.validity, Validity::Invalid);
        assert!(result.problems[0].contains("read 1000"), "{:?}", result.problems);
    }

    /// An acknowledged credit that later writes do not build on (lost) is flagged.
    #[test]
    fn a_lost_write_is_flagged() {
        let mut account = Account::new();
        let credit = account.invoke(1, Function::Credit, 10);
        account.ok(1, Function::Credit, credit, None, 1_010);
        let debit = account.invoke(1, Function::Debit, 5);
        account.ok(1, Function::Debit, debit, None, 995);
        assert_eq!(account.validity(), Validity::Invalid);
    }

    /// A read of a balance no order of the writes produces is flagged.
    #[test]
    fn a_read_of_a_value_never_written_is_flagged() {
        let mut account = Account::new();
        let debit = account.invoke(1, Function::Debit, 30);
        let unknown = account.invoke(2, Function::Debit, 50);
        account.ok(1, Function::Debit, debit, None, 970);
        account.end(2, EventType::Info, Function::Debit, unknown);
        for (seen, validity) in [(970, Validity::Valid), (920, Validity::Valid)] {
            let mut later = Account { history: HistoryBuilder::new(), next_key: 9 };
            later.history.events.clone_from(&account.history.events);
            later.read(3, seen);
            assert_eq!(later.validity(), validity, "read {seen}");
        }
        account.read(3, 1_234);
        assert_eq!(account.validity(), Validity::Invalid);
    }

    /// A debit refused while the funds were there is flagged.
    #[test]
    fn a_wrong_decision_is_flagged() {
        let mut account = Account::new();
        let debit = account.invoke(1, Function::Debit, 30);
        account.ok(1, Function::Debit, debit, Some(Decision::InsufficientFunds), 1_000);
        assert_eq!(account.validity(), Validity::Invalid);
    }

    /// A retried key is one operation: an `info` attempt and a `DUPLICATE` replay of it
    /// count once; a retry that applied again (the replay answering a second debit) is
    /// flagged.
    #[test]
    fn retries_count_once_and_a_double_application_is_flagged() {
        for (replayed, validity) in [(970, Validity::Valid), (940, Validity::Invalid)] {
            let mut account = Account::new();
            let debit = account.invoke(1, Function::Debit, 30);
            account.end(1, EventType::Info, Function::Debit, debit.clone());
            account.history.push(2, EventType::Invoke, Function::Debit, debit.clone());
            account.ok(2, Function::Debit, debit, None, replayed);
            account.read(3, 970);
            assert_eq!(account.validity(), validity, "replay answered {replayed}");
        }
    }

    /// A key whose every attempt failed was never applied: a read that shows it is flagged.
    #[test]
    fn failed_mutations_never_took_effect() {
        let mut account = Account::new();
        let debit = account.invoke(1, Function::Debit, 30);
        account.end(1, EventType::Fail, Function::Debit, debit);
        account.read(2, 1_000);
        assert_eq!(account.validity(), Validity::Valid);
        account.read(2, 970);
        assert_eq!(account.validity(), Validity::Invalid);
    }

    /// A history the search cannot finish within its bound is unknown, never valid.
    #[test]
    fn too_large_is_unknown() {
        let mut account = Account::new();
        for _ in 0..30 {
            let credit = account.invoke(1, Function::Credit, 1);
            account.end(1, EventType::Info, Function::Credit, credit);
        }
        account.read(2, 0);
        assert_eq!(check(&account.history.events, 1_000).validity, Validity::Unknown);
    }

    fn account_op() -> impl Strategy<Value = BalanceOp> {
        prop_oneof![
            (1_u64..40).prop_map(|amount| BalanceOp::Credit { amount, balance: None }),
            (1_u64..40).prop_map(|amount| BalanceOp::Debit { amount, outcome: None }),
            Just(BalanceOp::Read { balance: 0 }),
        ]
    }

    /// Runs `op` on the model and fills in the answer it gives.
    fn answered(state: &mut Option<AccountState>, op: BalanceOp) -> BalanceOp {
        let before = state.expect("open");
        if let BalanceOp::Read { .. } = op {
            return BalanceOp::Read { balance: before.balance };
        }
        *state = AccountModel.step(state, &op).expect("an unanswered operation always steps");
        let after = state.expect("open").balance;
        match op {
            BalanceOp::Credit { amount, .. } => BalanceOp::Credit { amount, balance: Some(after) },
            BalanceOp::Debit { amount, .. } => {
                let decision = if after == before.balance {
                    Decision::InsufficientFunds
                } else {
                    Decision::Approved
                };
                BalanceOp::Debit { amount, outcome: Some((decision, after)) }
            }
            BalanceOp::Read { .. } | BalanceOp::Create { .. } => op,
        }
    }

    proptest! {
        /// Operations run on the model in some order, each interval around its moment,
        /// some unknown (applied or not), make a linearizable history; the search agrees
        /// with trying every order on the small ones.
        #[test]
        fn executions_are_linearizable(
            ops in prop::collection::vec((account_op(), 0_u64..25, 0_u64..25, 0_u8..4), 0..40),
        ) {
            let mut state = Some(AccountState { balance: 50, floor: 10 });
            let mut timed = vec![Timed { invoke_ns: 0, complete_ns: Some(1), op: BalanceOp::Create { floor: 10 } }];
            timed.push(Timed { invoke_ns: 2, complete_ns: Some(3), op: BalanceOp::Credit { amount: 50, balance: Some(50) } });
            for (moment, (op, before, after, fate)) in ops.into_iter().enumerate() {
                let moment = moment as u64 * 10 + 30;
                let is_read = matches!(op, BalanceOp::Read { .. });
                // fate 0: unknown, never applied; 1: unknown, applied; else acknowledged.
                let (op, complete_ns) = match fate {
                    0 if !is_read => (op, None),
                    1 if !is_read => { answered(&mut state, op.clone()); (op, None) }
                    _ => (answered(&mut state, op), Some(moment + after)),
                };
                timed.push(Timed { invoke_ns: moment - before, complete_ns, op });
            }
            let verdict = wgl::check(&AccountModel, &timed, STEPS);
            prop_assert_eq!(&verdict, &Outcome::Linearizable);
            if timed.len() <= 8 {
                prop_assert!(wgl::tests::brute_force(&AccountModel, &timed));
            }
        }

        /// In a history of operations that never overlap, one read answered otherwise is
        /// flagged (the only order is real time's).
        #[test]
        fn a_wrong_read_in_a_sequential_history_is_flagged(
            ops in prop::collection::vec(account_op(), 1..40),
            wrong in any::<prop::sample::Index>(),
            offset in 1_u64..50,
        ) {
            let mut state = Some(AccountState { balance: 50, floor: 10 });
            let mut timed = vec![
                Timed { invoke_ns: 0, complete_ns: Some(1), op: BalanceOp::Create { floor: 10 } },
                Timed { invoke_ns: 2, complete_ns: Some(3), op: BalanceOp::Credit { amount: 50, balance: Some(50) } },
            ];
            for (moment, op) in ops.into_iter().enumerate() {
                let moment = moment as u64 * 10 + 10;
                timed.push(Timed { invoke_ns: moment, complete_ns: Some(moment + 5), op: answered(&mut state, op) });
            }
            let reads: Vec<usize> = (0..timed.len()).filter(|&position| matches!(timed[position].op, BalanceOp::Read { .. })).collect();
            prop_assume!(!reads.is_empty());
            let position = reads[wrong.index(reads.len())];
            if let BalanceOp::Read { balance } = &mut timed[position].op {
                *balance += offset;
            }
            let verdict = wgl::check(&AccountModel, &timed, STEPS);
            prop_assert!(matches!(verdict, Outcome::NotLinearizable { .. }), "{:?}", verdict);
        }
    }
}

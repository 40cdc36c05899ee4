//! The billing checkers fail on known-bad histories: a checker that always passes would
//! prove nothing in the fault tests.

use common::billing_checker::{Attempt, Completion, check_bank, check_exactly_once};
use quotamesh::core::billing::{
    AccountId, AuditEntry, BillingCommand, BillingLedger, Decision, IdempotencyKey, Operation,
    OperationRequest,
};

fn account() -> AccountId {
    AccountId::new("t1", "api")
}

/// A good run: an account funded with 100 (floor 10), debits of 30 (k1), 50 (k2, unknown to
/// its client) and 40 (k3, refused). Returns the history, the trail and the final balance.
fn good_run() -> (Vec<Attempt>, Vec<AuditEntry>, u64) {
    let mut ledger = BillingLedger::new();
    let op = |key: &str, request| Operation {
        caller: "svc".to_owned(),
        key: IdempotencyKey(key.to_owned()),
        request,
    };
    let command = BillingCommand {
        now_ms: 1,
        key_retention_ms: 86_400_000,
        operations: vec![
            op("create", OperationRequest::CreateAccount { account: account(), floor: 10 }),
            op("fund", OperationRequest::Credit { account: account(), amount: 100 }),
            op("k1", OperationRequest::Debit { account: account(), amount: 30 }),
            op("k2", OperationRequest::Debit { account: account(), amount: 50 }),
            op("k3", OperationRequest::Debit { account: account(), amount: 40 }),
        ],
    };
    let response = ledger.apply(1, &command);
    let ok = |index: usize| match &response.outcomes[index] {
        Ok(outcome) => Completion::Ok {
            decision: outcome.decision,
            duplicate: false,
            ledger_index: outcome.ledger_index,
            balance_after: outcome.balance_after,
        },
        Err(error) => panic!("{error}"),
    };
    let attempt = |key: &str, amount, completion| Attempt {
        key: key.to_owned(),
        account: account(),
        amount,
        completion,
    };
    let history = vec![
        attempt("k1", 30, ok(2)),
        attempt("k2", 50, Completion::Info("timeout".to_owned())),
        attempt("k3", 40, ok(4)),
        attempt("k1", 30, ok(2)),
    ];
    let final_balance = ledger.account_state(&account()).map_or(0, |a| a.balance);
    (history, ledger.trail().to_vec(), final_balance)
}

/// The good run passes both checkers.
#[test]
fn good_history_passes() {
    let (history, trail, balance) = good_run();
    assert_eq!(balance, 20);
    check_bank(&account(), 100, 10, &history, &trail, balance).expect("bank");
    check_exactly_once(&history, &trail).expect("exactly once");
}

/// A debit applied twice under one key fails both checkers.
#[test]
fn duplicate_application_is_caught() {
    let (history, mut trail, balance) = good_run();
    let mut twice = trail[2].clone();
    twice.sequence = trail.len() as u64;
    trail.push(twice);
    assert!(check_exactly_once(&history, &trail).is_err());
    assert!(check_bank(&account(), 100, 10, &history, &trail, balance).is_err());
}

/// An acknowledged debit missing from the trail (lost) is caught.
#[test]
fn lost_debit_is_caught() {
    let (history, trail, _) = good_run();
    let lost: Vec<AuditEntry> = trail.iter().filter(|e| e.sequence != 2).cloned().collect();
    assert!(check_exactly_once(&history, &lost).is_err());
}

/// A final balance that does not equal initial minus approved debits is caught.
#[test]
fn wrong_final_balance_is_caught() {
    let (history, trail, balance) = good_run();
    assert!(check_bank(&account(), 100, 10, &history, &trail, balance + 1).is_err());
}

/// An answer showing a balance below the floor is caught.
#[test]
fn below_floor_is_caught() {
    let (mut history, trail, balance) = good_run();
    history.push(Attempt {
        key: "k1".to_owned(),
        account: account(),
        amount: 30,
        completion: Completion::Ok {
            decision: Decision::Approved,
            duplicate: true,
            ledger_index: 1,
            balance_after: 5,
        },
    });
    assert!(check_bank(&account(), 100, 10, &history, &trail, balance).is_err());
}

/// A replay that disagrees with the original answer, and a phantom debit no client sent,
/// are caught.
#[test]
fn disagreeing_replay_and_phantom_are_caught() {
    let (mut history, trail, _) = good_run();
    history[3].completion = Completion::Ok {
        decision: Decision::Approved,
        duplicate: true,
        ledger_index: 99,
        balance_after: 70,
    };
    assert!(check_exactly_once(&history, &trail).is_err());
    let (history, trail, _) = good_run();
    let without_k2: Vec<Attempt> = history.into_iter().filter(|a| a.key != "k2").collect();
    assert!(check_exactly_once(&without_k2, &trail).is_err());
}

/// A key that failed definitely on every try must not be in the trail.
#[test]
fn applied_failure_is_caught() {
    let (mut history, trail, _) = good_run();
    history[1].completion = Completion::Fail(tonic::Code::InvalidArgument);
    assert!(check_exactly_once(&history, &trail).is_err());
}

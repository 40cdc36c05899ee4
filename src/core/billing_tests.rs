//! Tests of the billing ledger: worked examples of each rule, then property tests against a
//! naive model (the same rules written the slow, obvious way), with the invariants checked
//! after every command: never below the floor, conservation, replay idempotence, reload.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const RETENTION_MS: u64 = KEY_RETENTION_MS_MIN;

fn account(tenant: &str) -> AccountId {
    AccountId::new(tenant, "api")
}

fn operation(key: &str, request: OperationRequest) -> Operation {
    Operation { caller: "svc".to_owned(), key: IdempotencyKey(key.to_owned()), request }
}

fn command(now_ms: u64, operations: Vec<Operation>) -> BillingCommand {
    BillingCommand { now_ms, key_retention_ms: RETENTION_MS, operations }
}

/// Applies one operation at `now_ms` and returns its result.
fn run(
    ledger: &mut BillingLedger,
    index: u64,
    now_ms: u64,
    key: &str,
    request: OperationRequest,
) -> Result<Outcome, OperationError> {
    let mut response = ledger.apply(index, &command(now_ms, vec![operation(key, request)]));
    assert_eq!(response.outcomes.len(), 1);
    response.outcomes.remove(0)
}

fn funded(balance: u64, floor: u64) -> BillingLedger {
    let mut ledger = BillingLedger::new();
    let a = account("t1");
    run(
        &mut ledger,
        1,
        1000,
        "create",
        OperationRequest::CreateAccount { account: a.clone(), floor },
    )
    .expect("create");
    run(&mut ledger, 2, 1000, "fund", OperationRequest::Credit { account: a, amount: balance })
        .expect("credit");
    ledger
}

/// A debit within `available` is approved and lowers the balance; one above it is refused
/// with `InsufficientFunds` and changes nothing but the trail.
#[test]
fn debit_approves_within_available_and_refuses_beyond() {
    let mut ledger = funded(100, 10);
    let a = account("t1");
    let approved =
        run(&mut ledger, 3, 1001, "d1", OperationRequest::Debit { account: a.clone(), amount: 90 })
            .expect("debit");
    assert_eq!(approved.decision, Decision::Approved);
    assert_eq!(approved.balance_after, 10);
    assert_eq!(approved.ledger_index, 3);
    let refused =
        run(&mut ledger, 4, 1002, "d2", OperationRequest::Debit { account: a.clone(), amount: 1 })
            .expect("debit");
    assert_eq!(refused.decision, Decision::InsufficientFunds);
    assert_eq!(refused.balance_after, 10);
    assert_eq!(ledger.account_state(&a).map(|s| s.balance), Some(10));
    assert_eq!(ledger.trail().len(), 4);
}

/// The same key with the same parameters replays the original outcome (same index and
/// balance) without applying again; with other parameters it is refused.
#[test]
fn key_replays_original_and_refuses_other_parameters() {
    let mut ledger = funded(100, 0);
    let a = account("t1");
    let debit = OperationRequest::Debit { account: a.clone(), amount: 30 };
    let first = run(&mut ledger, 3, 1001, "k", debit.clone()).expect("debit");
    let again = run(&mut ledger, 9, 1500, "k", debit).expect("replay");
    assert!(again.replayed);
    assert_eq!(Outcome { replayed: false, ..again }, first);
    assert_eq!(ledger.account_state(&a).map(|s| s.balance), Some(70));
    let other = run(&mut ledger, 10, 1501, "k", OperationRequest::Debit { account: a, amount: 31 });
    assert!(matches!(other, Err(OperationError::KeyReused { previous: OperationKind::Debit, .. })));
    assert_eq!(ledger.trail().len(), 3);
}

/// Keys are scoped by tenant: another tenant's identical key is a new operation.
#[test]
fn keys_are_scoped_by_tenant() {
    let mut ledger = funded(100, 0);
    let b = account("t2");
    run(&mut ledger, 3, 1001, "fund", OperationRequest::CreateAccount { account: b, floor: 0 })
        .expect("the key `fund` of t1 does not exist for t2");
}

/// A key is forgotten after the retention carried by its command, by the sweep of a later
/// command: a retry after that applies again.
#[test]
fn key_is_forgotten_after_retention() {
    let mut ledger = funded(100, 0);
    let a = account("t1");
    let debit = OperationRequest::Debit { account: a.clone(), amount: 10 };
    run(&mut ledger, 3, 2000, "k", debit.clone()).expect("debit");
    let replay = run(&mut ledger, 4, 2000 + RETENTION_MS - 1, "k", debit.clone()).expect("replay");
    assert!(replay.replayed);
    let fresh = run(&mut ledger, 5, 2000 + RETENTION_MS, "k", debit).expect("applies again");
    assert!(!fresh.replayed);
    assert_eq!(ledger.account_state(&a).map(|s| s.balance), Some(80));
}

/// Holds: reserve lowers `available` but not the balance; capture debits up to the held
/// amount and releases the rest; void releases; a hold resolves once.
#[test]
fn holds_capture_void_and_resolve_once() {
    let mut ledger = funded(100, 0);
    let a = account("t1");
    let reserved = run(
        &mut ledger,
        3,
        1000,
        "r1",
        OperationRequest::Reserve { account: a.clone(), amount: 60, ttl_ms: 500 },
    )
    .expect("reserve");
    let hold = reserved.hold.expect("a hold id");
    assert_eq!((reserved.balance_after, reserved.held_after), (100, 60));
    let debit =
        run(&mut ledger, 4, 1001, "d", OperationRequest::Debit { account: a.clone(), amount: 50 })
            .expect("debit");
    assert_eq!(debit.decision, Decision::InsufficientFunds);
    let over = run(
        &mut ledger,
        5,
        1002,
        "c0",
        OperationRequest::Capture { account: a.clone(), hold, amount: 61 },
    );
    assert!(matches!(over, Err(OperationError::CaptureExceedsHold { held: 60, .. })));
    let captured = run(
        &mut ledger,
        6,
        1003,
        "c1",
        OperationRequest::Capture { account: a.clone(), hold, amount: 40 },
    )
    .expect("capture");
    assert_eq!((captured.balance_after, captured.held_after), (60, 0));
    let void = run(&mut ledger, 7, 1004, "v", OperationRequest::Void { account: a.clone(), hold });
    assert!(
        matches!(void, Err(OperationError::HoldResolved { ref state, .. }) if state == "captured")
    );
    let reserved = run(
        &mut ledger,
        8,
        1005,
        "r2",
        OperationRequest::Reserve { account: a.clone(), amount: 60, ttl_ms: 500 },
    )
    .expect("reserve");
    let hold = reserved.hold.expect("a hold id");
    let voided =
        run(&mut ledger, 9, 1006, "v2", OperationRequest::Void { account: a.clone(), hold })
            .expect("void");
    assert_eq!((voided.balance_after, voided.held_after), (60, 0));
}

/// A hold expires at `created + ttl_ms` of ledger time: the first command at or after that
/// time releases it with an `Expire` entry, and a capture then fails.
#[test]
fn hold_expires_by_ledger_time() {
    let mut ledger = funded(100, 0);
    let a = account("t1");
    let hold = run(
        &mut ledger,
        3,
        1000,
        "r",
        OperationRequest::Reserve { account: a.clone(), amount: 70, ttl_ms: 100 },
    )
    .expect("reserve")
    .hold
    .expect("hold");
    // Just before expiry the hold still counts.
    let early =
        run(&mut ledger, 4, 1099, "d1", OperationRequest::Debit { account: a.clone(), amount: 40 })
            .expect("debit");
    assert_eq!(early.decision, Decision::InsufficientFunds);
    // A proposer clock behind ledger time does not move time back.
    let capture = run(
        &mut ledger,
        5,
        1100,
        "c",
        OperationRequest::Capture { account: a.clone(), hold, amount: 10 },
    );
    assert_eq!(capture, Err(OperationError::HoldExpired(hold)));
    let expiry = ledger.trail().iter().find(|entry| entry.kind == OperationKind::Expire);
    assert_eq!(
        expiry.map(|entry| (entry.ledger_index, entry.caller.as_str())),
        Some((5, LEDGER_CALLER))
    );
    let late = run(&mut ledger, 6, 50, "d2", OperationRequest::Debit { account: a, amount: 40 })
        .expect("debit");
    assert_eq!(late.decision, Decision::Approved);
    assert_eq!(ledger.last_seen_ms(), 1100);
}

/// Bad input is refused with an error and leaves state and trail unchanged.
#[test]
fn bad_input_changes_nothing() {
    let mut ledger = funded(100, 0);
    let digest = ledger.digest();
    let a = account("t1");
    let cases = [
        ("z", OperationRequest::Debit { account: a.clone(), amount: 0 }),
        ("neg", OperationRequest::Debit { account: a.clone(), amount: u64::MAX }),
        ("big", OperationRequest::Credit { account: a.clone(), amount: AMOUNT_MAX + 1 }),
        ("unknown", OperationRequest::Debit { account: account("t9"), amount: 1 }),
        ("bad-name", OperationRequest::Debit { account: AccountId::new("t 1", "api"), amount: 1 }),
        ("ttl", OperationRequest::Reserve { account: a.clone(), amount: 1, ttl_ms: 0 }),
        ("hold", OperationRequest::Void { account: a.clone(), hold: HoldId(77) }),
        ("exists", OperationRequest::CreateAccount { account: a.clone(), floor: 0 }),
        (
            &"k".repeat(IDEMPOTENCY_KEY_BYTES_MAX + 1),
            OperationRequest::Debit { account: a.clone(), amount: 1 },
        ),
        ("", OperationRequest::Debit { account: a.clone(), amount: 1 }),
    ];
    for (index, (key, request)) in cases.into_iter().enumerate() {
        let result = run(&mut ledger, 10 + index as u64, 1000, key, request.clone());
        assert!(result.is_err(), "{request:?} under {key:?} was accepted: {result:?}");
    }
    // A credit that keeps the balance within u64 is fine; one that would not is refused.
    run(
        &mut ledger,
        30,
        1000,
        "c1",
        OperationRequest::Credit { account: a.clone(), amount: AMOUNT_MAX },
    )
    .expect("credit");
    let digest_full = ledger.digest();
    let overflow = run(
        &mut ledger,
        32,
        1000,
        "c3",
        OperationRequest::Credit { account: a, amount: AMOUNT_MAX },
    );
    assert!(matches!(overflow, Err(OperationError::BalanceOverflow { .. })));
    assert_eq!(ledger.digest(), digest_full);
    assert_ne!(digest, digest_full);
}

/// A command with too many operations is refused whole, time included.
#[test]
fn oversized_command_is_refused_whole() {
    let mut ledger = funded(100, 0);
    let digest = ledger.digest();
    let operations = (0..=OPERATIONS_PER_COMMAND_MAX)
        .map(|i| {
            operation(
                &format!("k{i}"),
                OperationRequest::Debit { account: account("t1"), amount: 1 },
            )
        })
        .collect();
    let response = ledger.apply(3, &command(5000, operations));
    assert!(response.outcomes.iter().all(|o| matches!(o, Err(OperationError::Command(_)))));
    assert_eq!(ledger.digest(), digest);
}

/// `verify_trail` accepts the ledger's own trail and catches a tampered one: a changed
/// amount, a dropped entry, a duplicated key, an approval beyond the floor.
#[test]
fn verify_trail_catches_tampering() {
    let mut ledger = funded(100, 10);
    let a = account("t1");
    run(&mut ledger, 3, 1001, "d1", OperationRequest::Debit { account: a.clone(), amount: 30 })
        .expect("debit");
    run(&mut ledger, 4, 1002, "d2", OperationRequest::Debit { account: a.clone(), amount: 50 })
        .expect("debit");
    let trail = ledger.trail().to_vec();
    let accounts = verify_trail(&trail).expect("the ledger's trail verifies");
    assert_eq!(accounts.get(&a).map(|s| s.balance), Some(20));

    let mut changed = trail.clone();
    changed[2].amount = 29;
    assert!(verify_trail(&changed).is_err());

    let mut dropped = trail.clone();
    dropped.remove(2);
    assert!(verify_trail(&dropped).is_err());

    let mut duplicated = trail.clone();
    duplicated[3].key = duplicated[2].key.clone();
    assert!(verify_trail(&duplicated).is_err());

    let mut below_floor = trail.clone();
    below_floor[3].amount = 65;
    below_floor[3].balance_after = 5;
    assert!(verify_trail(&below_floor).is_err());
}

// ---------------------------------------------------------------------------------------
// Property tests against a naive model.

/// The naive model: the same rules over plain maps and vectors, no indexes.
#[derive(Debug, Default, Clone)]
struct Model {
    now_ms: u64,
    accounts: BTreeMap<AccountId, Account>,
    /// (id, account, amount, expires_at_ms, state, forget_at_ms)
    holds: Vec<(HoldId, AccountId, u64, u64, HoldState, u64)>,
    /// (tenant, key) -> (request, outcome, forget_at_ms)
    keys: BTreeMap<(String, String), (OperationRequest, Outcome, u64)>,
    next_hold: u64,
    entries: u64,
    credited: u128,
    debited: u128,
}

type ModelResult = Result<Outcome, &'static str>;

fn error_name(error: &OperationError) -> &'static str {
    match error {
        OperationError::Invalid(_) => "invalid",
        OperationError::Command(_) => "command",
        OperationError::KeyReused { .. } => "key_reused",
        OperationError::AccountNotFound(_) => "account_not_found",
        OperationError::AccountExists(_) => "account_exists",
        OperationError::HoldNotFound { .. } => "hold_not_found",
        OperationError::HoldExpired(_) => "hold_expired",
        OperationError::HoldResolved { .. } => "hold_resolved",
        OperationError::CaptureExceedsHold { .. } => "capture_exceeds_hold",
        OperationError::BalanceOverflow { .. } => "overflow",
        OperationError::Full(_) => "full",
    }
}

impl Model {
    fn apply(&mut self, index: u64, command: &BillingCommand) -> Vec<ModelResult> {
        self.now_ms = self.now_ms.max(command.now_ms);
        let now = self.now_ms;
        let retention = command.key_retention_ms;
        let mut due: Vec<usize> = (0..self.holds.len())
            .filter(|&i| self.holds[i].4 == HoldState::Open && self.holds[i].3 <= now)
            .collect();
        due.sort_by_key(|&i| (self.holds[i].3, self.holds[i].0));
        for i in due {
            let (_, account, amount, ..) = self.holds[i].clone();
            if let Some(state) = self.accounts.get_mut(&account) {
                state.held -= amount;
            }
            self.holds[i].4 = HoldState::Expired;
            self.holds[i].5 = now + retention;
            self.entries += 1;
        }
        self.keys.retain(|_, (_, _, forget)| *forget > now);
        self.holds.retain(|hold| hold.4 == HoldState::Open || hold.5 > now);
        command.operations.iter().map(|op| self.operation(index, op, retention)).collect()
    }

    fn operation(&mut self, index: u64, op: &Operation, retention: u64) -> ModelResult {
        let now = self.now_ms;
        let request = &op.request;
        let key = op.key.0.clone();
        if key.is_empty() || key.len() > IDEMPOTENCY_KEY_BYTES_MAX {
            return Err("invalid");
        }
        if request.check().is_err() {
            return Err("invalid");
        }
        let id = (request.account().tenant.clone(), key);
        if let Some((stored, outcome, _)) = self.keys.get(&id) {
            return if stored == request {
                Ok(Outcome { replayed: true, ..*outcome })
            } else {
                Err("key_reused")
            };
        }
        let account_id = request.account().clone();
        let before = self.accounts.get(&account_id).copied();
        let mut hold_made = None;
        let decision = match request {
            OperationRequest::CreateAccount { floor, .. } => {
                if before.is_some() {
                    return Err("account_exists");
                }
                self.accounts
                    .insert(account_id.clone(), Account { balance: 0, held: 0, floor: *floor });
                Decision::Approved
            }
            OperationRequest::Credit { amount, .. } => {
                let state = self.accounts.get_mut(&account_id).ok_or("account_not_found")?;
                state.balance = state.balance.checked_add(*amount).ok_or("overflow")?;
                self.credited += u128::from(*amount);
                Decision::Approved
            }
            OperationRequest::Debit { amount, .. } => {
                let state = self.accounts.get_mut(&account_id).ok_or("account_not_found")?;
                if state
                    .balance
                    .checked_sub(state.held + state.floor)
                    .is_some_and(|free| free >= *amount)
                {
                    state.balance -= amount;
                    self.debited += u128::from(*amount);
                    Decision::Approved
                } else {
                    Decision::InsufficientFunds
                }
            }
            OperationRequest::Reserve { amount, ttl_ms, .. } => {
                let state = self.accounts.get_mut(&account_id).ok_or("account_not_found")?;
                if state
                    .balance
                    .checked_sub(state.held + state.floor)
                    .is_some_and(|free| free >= *amount)
                {
                    state.held += amount;
                    let hold = HoldId(self.next_hold);
                    self.next_hold += 1;
                    self.holds.push((
                        hold,
                        account_id.clone(),
                        *amount,
                        now + ttl_ms,
                        HoldState::Open,
                        0,
                    ));
                    hold_made = Some(hold);
                    Decision::Approved
                } else {
                    Decision::InsufficientFunds
                }
            }
            OperationRequest::Capture { hold, .. } | OperationRequest::Void { hold, .. } => {
                let position = self
                    .holds
                    .iter()
                    .position(|h| h.0 == *hold && h.1 == account_id)
                    .ok_or("hold_not_found")?;
                let (_, _, held, _, state, _) = self.holds[position].clone();
                match state {
                    HoldState::Open => {}
                    HoldState::Expired => return Err("hold_expired"),
                    HoldState::Captured(_) | HoldState::Voided => return Err("hold_resolved"),
                }
                let captured = match request {
                    OperationRequest::Capture { amount, .. } => {
                        if *amount > held {
                            return Err("capture_exceeds_hold");
                        }
                        *amount
                    }
                    _ => 0,
                };
                let account = self.accounts.get_mut(&account_id).ok_or("account_not_found")?;
                account.held -= held;
                account.balance -= captured;
                self.debited += u128::from(captured);
                self.holds[position].4 = match request {
                    OperationRequest::Capture { .. } => HoldState::Captured(captured),
                    _ => HoldState::Voided,
                };
                self.holds[position].5 = now + retention;
                Decision::Approved
            }
        };
        let after = self.accounts.get(&account_id).copied().unwrap_or_default();
        let outcome = Outcome {
            decision,
            replayed: false,
            balance_after: after.balance,
            held_after: after.held,
            floor: after.floor,
            ledger_index: index,
            entry_sequence: self.entries,
            hold: hold_made,
        };
        self.entries += 1;
        self.keys.insert(id, (request.clone(), outcome, now + retention));
        Ok(outcome)
    }
}

fn request_strategy() -> impl Strategy<Value = OperationRequest> {
    let tenant = prop::sample::select(vec!["t1", "t2"]);
    let amount = prop_oneof![8 => 0u64..=40, 1 => Just(AMOUNT_MAX + 1), 1 => Just(u64::MAX)];
    let hold = (0u64..6).prop_map(HoldId);
    prop_oneof![
        1 => (tenant.clone(), 0u64..=20).prop_map(|(t, floor)| OperationRequest::CreateAccount { account: account(t), floor }),
        3 => (tenant.clone(), amount.clone()).prop_map(|(t, amount)| OperationRequest::Credit { account: account(t), amount }),
        4 => (tenant.clone(), amount.clone()).prop_map(|(t, amount)| OperationRequest::Debit { account: account(t), amount }),
        2 => (tenant.clone(), amount.clone(), 0u64..=80).prop_map(|(t, amount, ttl_ms)| OperationRequest::Reserve { account: account(t), amount, ttl_ms }),
        2 => (tenant.clone(), hold.clone(), amount).prop_map(|(t, hold, amount)| OperationRequest::Capture { account: account(t), hold, amount }),
        1 => (tenant, hold).prop_map(|(t, hold)| OperationRequest::Void { account: account(t), hold }),
    ]
}

fn command_strategy() -> impl Strategy<Value = (u64, Vec<(String, OperationRequest)>)> {
    let step = prop_oneof![10 => 0u64..=30, 1 => Just(RETENTION_MS)];
    let key = (0u8..8).prop_map(|k| format!("k{k}"));
    (step, prop::collection::vec((key, request_strategy()), 0..4))
}

fn check_invariants(ledger: &BillingLedger, model: &Model) {
    let mut total: u128 = 0;
    for (id, state) in ledger.accounts() {
        // A new account starts at 0, maybe under its floor; only credits move it up.
        assert!(
            state.held == 0 || state.held <= state.balance.saturating_sub(state.floor),
            "{id} holds too much: {state:?}"
        );
        total += u128::from(state.balance);
    }
    for entry in ledger.trail() {
        let takes = matches!(
            entry.kind,
            OperationKind::Debit | OperationKind::Reserve | OperationKind::Capture
        ) && entry.decision == Decision::Approved;
        let floor = ledger.account_state(&entry.account).map_or(0, |a| a.floor);
        assert!(
            !takes || entry.balance_after - entry.held_after >= floor,
            "{entry:?} went below the floor"
        );
    }
    assert_eq!(total + model.debited, model.credited, "conservation");
    let recomputed = verify_trail(ledger.trail()).expect("the trail verifies");
    for (id, state) in ledger.accounts() {
        let from_trail = recomputed.get(id).copied().unwrap_or_default();
        assert_eq!((from_trail.balance, from_trail.held), (state.balance, state.held), "{id}");
    }
    assert_eq!(ledger.accounts().count(), recomputed.len());
}

/// What a store keeps: the last value of every record, and every trail block.
#[derive(Default)]
struct Stored {
    clock: Option<LedgerClock>,
    accounts: BTreeMap<AccountId, Account>,
    holds: BTreeMap<HoldId, Hold>,
    blocks: Vec<TrailBlock>,
}

fn store_changes(store: &mut Stored, changes: BillingChanges) {
    if let Some(clock) = changes.clock {
        store.clock = Some(clock);
    }
    for (id, value) in changes.accounts {
        match value {
            Some(value) => store.accounts.insert(id, value),
            None => store.accounts.remove(&id),
        };
    }
    for (id, value) in changes.holds {
        match value {
            Some(value) => store.holds.insert(id, value),
            None => store.holds.remove(&id),
        };
    }
    store.blocks.extend(changes.blocks);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every outcome equals the naive model's; after every command the balance is at or
    /// above its floor, money is conserved, and the trail alone recomputes every account.
    /// Replaying a command gives back each approved operation's original outcome and
    /// applies nothing. Rebuilding from the stored changes gives the same digest.
    #[test]
    fn ledger_matches_naive_model(commands in prop::collection::vec(command_strategy(), 1..40)) {
        let mut ledger = BillingLedger::new();
        let mut model = Model::default();
        let mut store = Stored::default();
        let mut now_ms = 1_000u64;
        for (position, (step, operations)) in commands.into_iter().enumerate() {
            let index = position as u64 * 2 + 1;
            now_ms += step;
            let command = command(now_ms, operations.iter().map(|(k, r)| operation(k, r.clone())).collect());
            let response = ledger.apply(index, &command);
            let expected = model.apply(index, &command);
            let got: Vec<ModelResult> = response.outcomes.iter().map(|o| o.clone().map_err(|e| error_name(&e))).collect();
            prop_assert_eq!(&got, &expected);
            check_invariants(&ledger, &model);

            // Replay the same command at the same time: approved operations come back as
            // replays of their original outcome, and nothing more is debited.
            let debited = model.debited;
            let replay = ledger.apply(index + 1, &command);
            let replay_model = model.apply(index + 1, &command);
            let replay_got: Vec<ModelResult> = replay.outcomes.iter().map(|o| o.clone().map_err(|e| error_name(&e))).collect();
            prop_assert_eq!(&replay_got, &replay_model);
            for (first, again) in response.outcomes.iter().zip(&replay.outcomes) {
                if let Ok(first) = first {
                    prop_assert_eq!(again.clone(), Ok(Outcome { replayed: true, ..*first }));
                }
            }
            let replayed_only = response.outcomes.iter().all(Result::is_ok);
            if replayed_only {
                prop_assert_eq!(model.debited, debited);
            }
            check_invariants(&ledger, &model);
            store_changes(&mut store, ledger.take_changes());
        }
        let reloaded = BillingLedger::from_parts(
            store.clock.unwrap_or_default(),
            store.accounts,
            store.holds,
            store.blocks,
        )
        .expect("reload");
        prop_assert_eq!(reloaded.digest(), ledger.digest());
    }

    /// The same commands give the same state: apply is deterministic.
    #[test]
    fn apply_is_deterministic(commands in prop::collection::vec(command_strategy(), 1..30)) {
        let mut first = BillingLedger::new();
        let mut second = BillingLedger::new();
        let mut now_ms = 0u64;
        for (position, (step, operations)) in commands.into_iter().enumerate() {
            now_ms += step;
            let command = command(now_ms, operations.iter().map(|(k, r)| operation(k, r.clone())).collect());
            let a = first.apply(position as u64 + 1, &command);
            let b = second.apply(position as u64 + 1, &command);
            prop_assert_eq!(a, b);
        }
        prop_assert_eq!(first.digest(), second.digest());
    }
}

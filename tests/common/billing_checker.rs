//! Checkers for billing histories (fault-testing.md section 4): the bank checker (C2:
//! conservation and floor) and the exactly-once checker (C3: idempotency keys over the whole
//! trail). A client operation ends `Ok` (a committed decision), `Fail` (known not applied)
//! or `Info` (timeout or UNAVAILABLE: it may or may not have applied); no checker assumes an
//! `Info` operation was absent.

use std::collections::{BTreeMap, BTreeSet};

use quotamesh::core::billing::{AccountId, AuditEntry, Decision, OperationKind, verify_trail};

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// A committed decision: the original one (for a DUPLICATE, what the first commit
    /// decided), with the original index and balance after.
    Ok { decision: Decision, duplicate: bool, ledger_index: u64, balance_after: u64 },
    /// Known not applied (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, ...).
    Fail(tonic::Code),
    /// Unknown: may have applied.
    Info(String),
}

/// One attempt of a debit by a client.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// The idempotency key (the same across retries of one logical debit).
    pub key: String,
    pub account: AccountId,
    pub amount: u64,
    pub completion: Completion,
}

/// Debits applied per key in the trail (approved or refused).
fn debit_entries(trail: &[AuditEntry]) -> BTreeMap<String, Vec<&AuditEntry>> {
    let mut by_key: BTreeMap<String, Vec<&AuditEntry>> = BTreeMap::new();
    for entry in trail {
        if entry.kind == OperationKind::Debit
            && let Some(key) = &entry.key
        {
            by_key.entry(key.0.clone()).or_default().push(entry);
        }
    }
    by_key
}

/// C2, the bank checker, for one account debited by the history:
/// (i) `final = initial - sum of approved debits in the trail`, and the trail recomputes
/// (`verify_trail`); (ii) no entry and no `Ok` answer shows a balance below the floor;
/// (iii) the approved debits the clients saw are at most those in the trail, and any
/// difference comes from keys whose outcome was unknown to the clients.
pub fn check_bank(
    account: &AccountId,
    initial: u64,
    floor: u64,
    history: &[Attempt],
    trail: &[AuditEntry],
    final_balance: u64,
) -> Result<(), String> {
    let recomputed = verify_trail(trail).map_err(|e| format!("trail does not verify: {e}"))?;
    let from_trail = recomputed.get(account).ok_or("account missing from the trail")?;
    if from_trail.balance != final_balance {
        return Err(format!(
            "ledger balance {final_balance} but the trail recomputes {}",
            from_trail.balance
        ));
    }
    let approved: Vec<&AuditEntry> = trail
        .iter()
        .filter(|e| e.account == *account && e.kind == OperationKind::Debit)
        .filter(|e| e.decision == Decision::Approved)
        .collect();
    let debited: u64 = approved.iter().map(|e| e.amount).sum();
    if initial.checked_sub(debited) != Some(final_balance) {
        return Err(format!(
            "final balance {final_balance} != initial {initial} - approved debits {debited}"
        ));
    }
    for entry in trail.iter().filter(|e| e.account == *account) {
        if entry.kind == OperationKind::Debit && entry.balance_after < floor {
            return Err(format!(
                "entry {} left the balance at {} below the floor {floor}",
                entry.sequence, entry.balance_after
            ));
        }
    }
    let mut seen_approved: BTreeMap<&str, u64> = BTreeMap::new();
    for attempt in history {
        if let Completion::Ok { decision, balance_after, .. } = &attempt.completion {
            if *balance_after < floor {
                return Err(format!(
                    "key {} answered balance {balance_after} below the floor",
                    attempt.key
                ));
            }
            if *decision == Decision::Approved {
                seen_approved.insert(&attempt.key, attempt.amount);
            }
        }
    }
    let approved_keys: BTreeSet<&str> =
        approved.iter().filter_map(|e| e.key.as_ref().map(|k| k.0.as_str())).collect();
    for key in seen_approved.keys() {
        if !approved_keys.contains(key) {
            return Err(format!(
                "debit {key} was acknowledged APPROVED but is not in the trail (lost)"
            ));
        }
    }
    let unknown_keys: BTreeSet<&str> = history
        .iter()
        .filter(|a| matches!(a.completion, Completion::Info(_)))
        .map(|a| a.key.as_str())
        .collect();
    for key in &approved_keys {
        if !seen_approved.contains_key(key) && !unknown_keys.contains(key) {
            return Err(format!(
                "debit {key} is approved in the trail but no client saw it approved or unknown"
            ));
        }
    }
    Ok(())
}

/// C3, the exactly-once checker over every debit key of the history and the whole trail:
/// (a) a key answered APPROVED has exactly one entry, with the same account and amount;
/// (b) no key has two entries; (c) a key whose every answer was a definite failure has
/// none; (e) every `Ok` answer of a key agrees on decision, index and balance; (g) every
/// debit entry's key was sent by some client (no phantom debit).
pub fn check_exactly_once(history: &[Attempt], trail: &[AuditEntry]) -> Result<(), String> {
    let entries = debit_entries(trail);
    let mut attempts: BTreeMap<&str, Vec<&Attempt>> = BTreeMap::new();
    for attempt in history {
        attempts.entry(&attempt.key).or_default().push(attempt);
    }
    for (key, found) in &entries {
        if found.len() > 1 {
            return Err(format!("key {key} applied {} times", found.len()));
        }
        if !attempts.contains_key(key.as_str()) {
            return Err(format!("key {key} is in the trail but no client sent it (phantom)"));
        }
    }
    for (key, tries) in &attempts {
        let found = entries.get(*key).map_or(&[][..], Vec::as_slice);
        let oks: Vec<&Completion> = tries
            .iter()
            .map(|a| &a.completion)
            .filter(|c| matches!(c, Completion::Ok { .. }))
            .collect();
        if let Some(Completion::Ok { decision, ledger_index, balance_after, .. }) = oks.first() {
            for other in &oks[1..] {
                if let Completion::Ok { decision: d, ledger_index: i, balance_after: b, .. } = other
                    && (d, i, b) != (decision, ledger_index, balance_after)
                {
                    return Err(format!("key {key}: answers disagree: {oks:?}"));
                }
            }
            let [entry] = found else {
                return Err(format!(
                    "key {key} was answered {decision:?} but has {} entries",
                    found.len()
                ));
            };
            let attempt = tries[0];
            if entry.account != attempt.account || entry.amount != attempt.amount {
                return Err(format!("key {key}: entry {entry:?} does not match the request"));
            }
            if entry.decision != *decision
                || entry.ledger_index != *ledger_index
                || entry.balance_after != *balance_after
            {
                return Err(format!(
                    "key {key}: answered {decision:?} at {ledger_index} but the trail says {:?} at {}",
                    entry.decision, entry.ledger_index
                ));
            }
        } else if tries.iter().all(|a| matches!(a.completion, Completion::Fail(_)))
            && !found.is_empty()
        {
            return Err(format!("key {key} failed definitely on every try but is in the trail"));
        }
    }
    Ok(())
}

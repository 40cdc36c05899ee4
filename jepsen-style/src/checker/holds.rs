//! The holds checker (C2b of the fault-testing plan) over the history of the holds workload
//! and the audit trail read after the run. What is observable from outside: the trail lists
//! every committed reserve, capture, void and expiry with its ledger time (`time_ms`: the
//! committing leader's clock, which the ledger never lets go back) and hold id; a reserve's
//! hold expires at its entry's time plus its TTL; the ledger releases due holds at the start
//! of the first command whose time reaches them, so an expiry is an entry too. The
//! runner's clock is not the ledger's (the clock nemesis moves the nodes' wall clocks on
//! purpose, and a leader whose clock jumps ahead expires holds early in real time by the
//! jump), so expiry is judged in ledger time only:
//!
//! - `ledger-time`: entry times never go back along the trail;
//! - `holds`: each hold is made by one approved reserve and resolved (captured, voided or
//!   expired) at most once; never captured or voided at or after its expiry; never expired
//!   before it (early), nor left open past the first entry at or after it (late); never
//!   captured above its amount; no resolution of a hold no reserve made;
//! - `hold-chain`: per account, each entry starts from the previous one's balance and held
//!   amount and moves them as its kind says; a reserve is approved exactly when its amount
//!   fits in `balance - held - floor`;
//! - `holds-acknowledged`: no key applied twice; every `ok` reserve, capture or void is in
//!   the trail with its kind, account, decision and (a reserve) hold id; a key whose every
//!   attempt failed is absent; a capture or void refused because its hold had expired names
//!   a hold the trail shows expired; no entry with a key no client sent.
//!
//! `trails-agree` (every node lists the same trail) is `bank.rs`'s.

use std::collections::{BTreeMap, HashMap};

use super::CheckResult;
use crate::history::{Decision, EntryKind, Event, EventType, Function, TrailEntry, operations};

/// What the workload set up, as the checker needs it.
#[derive(Debug, Clone)]
pub struct HoldsModel {
    pub floor: u64,
}

/// Runs every holds check on the first node's trail.
pub fn check(events: &[Event], trail: &[TrailEntry], model: &HoldsModel) -> Vec<CheckResult> {
    vec![ledger_time(trail), holds(trail), hold_chain(trail, model), acknowledged(events, trail)]
}

fn ledger_time(trail: &[TrailEntry]) -> CheckResult {
    let mut result = CheckResult::new("ledger-time");
    for pair in trail.windows(2) {
        result.checked += 1;
        if pair[1].time_ms < pair[0].time_ms {
            result.problem(format!(
                "entry {} at {} ms follows entry {} at {} ms",
                pair[1].sequence, pair[1].time_ms, pair[0].sequence, pair[0].time_ms
            ));
        }
    }
    result
}

/// A hold as its reserve entry made it.
struct Hold {
    position: usize,
    amount: u64,
    expires_at_ms: u64,
}

/// Approved reserves by hold id, flagging a hold id made twice.
fn made_holds(trail: &[TrailEntry], result: &mut CheckResult) -> BTreeMap<u64, Hold> {
    let mut made = BTreeMap::new();
    for (position, entry) in trail.iter().enumerate() {
        if entry.kind != EntryKind::Reserve || entry.decision != Decision::Approved {
            continue;
        }
        let Some(id) = entry.hold_id else {
            result.problem(format!("reserve entry {} approved without a hold id", entry.sequence));
            continue;
        };
        let hold = Hold {
            position,
            amount: entry.amount,
            expires_at_ms: entry.time_ms.saturating_add(entry.ttl_ms.unwrap_or(0)),
        };
        if made.insert(id, hold).is_some() {
            result.problem(format!("hold {id} made twice (again by entry {})", entry.sequence));
        }
    }
    made
}

fn resolves_hold(kind: EntryKind) -> bool {
    matches!(kind, EntryKind::Capture | EntryKind::Void | EntryKind::Expire)
}

fn holds(trail: &[TrailEntry]) -> CheckResult {
    let mut result = CheckResult::new("holds");
    let made = made_holds(trail, &mut result);
    let mut resolutions: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (position, entry) in trail.iter().enumerate() {
        if resolves_hold(entry.kind) && entry.decision == Decision::Approved {
            match entry.hold_id.filter(|id| made.contains_key(id)) {
                Some(id) => resolutions.entry(id).or_default().push(position),
                None => result.problem(format!(
                    "entry {} ({:?}) resolves hold {:?}, which no reserve made",
                    entry.sequence, entry.kind, entry.hold_id
                )),
            }
        }
    }
    for (id, hold) in &made {
        result.checked += 1;
        let ends = resolutions.get(id).map_or(&[][..], Vec::as_slice);
        if ends.len() > 1 {
            let sequences: Vec<u64> = ends.iter().map(|&end| trail[end].sequence).collect();
            result
                .problem(format!("hold {id} resolved {} times: entries {sequences:?}", ends.len()));
        }
        // The first entry at or past the expiry: the command that made it (its entries share
        // its ledger index; a sweep's expiries come first, in expiry order) swept the hold,
        // if nothing resolved it before.
        let due = trail[hold.position..]
            .iter()
            .position(|entry| entry.time_ms >= hold.expires_at_ms)
            .map(|offset| hold.position + offset);
        let due_end = due.map(|due| {
            let command = trail[due].ledger_index;
            due + trail[due..].iter().take_while(|entry| entry.ledger_index == command).count()
        });
        for &end in ends {
            let entry = &trail[end];
            let at = format!(
                "hold {id} {:?} by entry {} at {} ms (expiry at {} ms)",
                entry.kind, entry.sequence, entry.time_ms, hold.expires_at_ms
            );
            if end < hold.position {
                result.problem(format!("{at}: before the reserve that made it"));
            }
            match entry.kind {
                EntryKind::Expire if entry.time_ms < hold.expires_at_ms => {
                    result.problem(format!("{at}: expired early"));
                }
                EntryKind::Capture | EntryKind::Void if entry.time_ms >= hold.expires_at_ms => {
                    result.problem(format!("{at}: resolved at or after its expiry"));
                }
                EntryKind::Capture if entry.amount > hold.amount => {
                    result.problem(format!("{at}: captured {} of {}", entry.amount, hold.amount));
                }
                _ => {}
            }
        }
        if let (Some(due), Some(due_end)) = (due, due_end)
            && ends.first().is_none_or(|&first| first >= due_end)
        {
            result.problem(format!(
                "hold {id} (expiry at {} ms) still open at entry {} of {} ms: not expired when due",
                hold.expires_at_ms, trail[due].sequence, trail[due].time_ms
            ));
        }
    }
    result
}

fn hold_chain(trail: &[TrailEntry], model: &HoldsModel) -> CheckResult {
    let mut result = CheckResult::new("hold-chain");
    let mut ignored = CheckResult::new("holds");
    let made = made_holds(trail, &mut ignored);
    // Each account's last entry, by position.
    let mut last: HashMap<&str, usize> = HashMap::new();
    for (position, entry) in trail.iter().enumerate() {
        result.checked += 1;
        let at = format!("{} entry {} ({:?})", entry.account, entry.sequence, entry.kind);
        match last.insert(entry.account.as_str(), position).map(|previous| &trail[previous]) {
            None if entry.kind != EntryKind::CreateAccount => {
                result.problem(format!("{at}: the account's first entry is no create"));
            }
            Some(previous)
                if (previous.balance_after, previous.held_after)
                    != (entry.balance_before, entry.held_before) =>
            {
                result.problem(format!(
                    "{at}: starts from balance {} held {}, the previous entry left {} held {}",
                    entry.balance_before,
                    entry.held_before,
                    previous.balance_after,
                    previous.held_after
                ));
            }
            _ => {}
        }
        let (balance, held) = (entry.balance_before, entry.held_before);
        let held_amount = entry.hold_id.and_then(|id| made.get(&id)).map(|hold| hold.amount);
        let approved = entry.decision == Decision::Approved;
        let expected = match entry.kind {
            EntryKind::CreateAccount => Some((0, 0)),
            EntryKind::Credit => balance.checked_add(entry.amount).map(|after| (after, held)),
            EntryKind::Reserve => {
                let available = balance.saturating_sub(held).saturating_sub(model.floor);
                if approved != (entry.amount <= available) {
                    result.problem(format!(
                        "{at}: {:?} for {} with {available} available",
                        entry.decision, entry.amount
                    ));
                }
                if approved {
                    held.checked_add(entry.amount).map(|after| (balance, after))
                } else {
                    Some((balance, held))
                }
            }
            EntryKind::Capture => held_amount.and_then(|amount| {
                Some((balance.checked_sub(entry.amount)?, held.checked_sub(amount)?))
            }),
            EntryKind::Void | EntryKind::Expire => {
                held_amount.and_then(|amount| Some((balance, held.checked_sub(amount)?)))
            }
            EntryKind::Debit | EntryKind::Other => {
                result.problem(format!("{at}: a kind the holds workload never makes"));
                continue;
            }
        };
        if expected != Some((entry.balance_after, entry.held_after)) {
            result.problem(format!(
                "{at} of {}: balance {balance} held {held} became {} held {}, expected {expected:?}",
                entry.amount, entry.balance_after, entry.held_after
            ));
        }
    }
    result
}

fn acknowledged(events: &[Event], trail: &[TrailEntry]) -> CheckResult {
    let mut result = CheckResult::new("holds-acknowledged");
    let mut entries: HashMap<&str, Vec<&TrailEntry>> = HashMap::new();
    for entry in trail.iter().filter(|entry| entry.kind != EntryKind::Expire) {
        entries.entry(entry.key.as_str()).or_default().push(entry);
    }
    let expired: std::collections::HashSet<u64> = trail
        .iter()
        .filter(|entry| entry.kind == EntryKind::Expire)
        .filter_map(|entry| entry.hold_id)
        .collect();
    let operations = operations(events);
    let mut attempts: BTreeMap<&str, Vec<_>> = BTreeMap::new();
    for operation in operations.iter().filter(|operation| operation.invoke.f.is_mutation()) {
        if let Some(key) = operation.invoke.value.key.as_deref() {
            attempts.entry(key).or_default().push(operation);
        }
    }
    for (key, applied) in &entries {
        if applied.len() > 1 {
            let sequences: Vec<u64> = applied.iter().map(|entry| entry.sequence).collect();
            result.problem(format!("key {key} applied {} times: {sequences:?}", applied.len()));
        }
        if !attempts.contains_key(key) {
            result.problem(format!(
                "entry {} has key {key}, which no client sent",
                applied[0].sequence
            ));
        }
    }
    for (key, tries) in &attempts {
        result.checked += 1;
        let asked = tries[0].invoke;
        let entry = entries.get(key).and_then(|found| found.first());
        for attempt in tries.iter().filter(|attempt| attempt.outcome() == EventType::Fail) {
            let error = attempt.result().error.as_deref().unwrap_or_default();
            if error.contains("expired")
                && let Some(id) = asked.value.hold_id
                && !expired.contains(&id)
            {
                result.problem(format!(
                    "key {key}: refused at event {} as expired ({error}), but hold {id} has no \
                     expiry in the trail",
                    attempt.invoke.index
                ));
            }
        }
        let Some(acknowledged) = tries.iter().find(|attempt| attempt.outcome() == EventType::Ok)
        else {
            if let Some(entry) = entry
                && tries.iter().all(|attempt| attempt.outcome() == EventType::Fail)
            {
                result.problem(format!(
                    "key {key}: every attempt failed, yet entry {} applied it",
                    entry.sequence
                ));
            }
            continue;
        };
        let reply = acknowledged.result();
        let Some(entry) = entry else {
            result.problem(format!(
                "key {key}: acknowledged at event {}, not in the trail (lost)",
                acknowledged.invoke.index
            ));
            continue;
        };
        let reserve_mismatch = asked.f == Function::Reserve && reply.hold_id != entry.hold_id;
        if asked.f.entry_kind() != Some(entry.kind)
            || asked.value.account != entry.account
            || reply.decision != Some(entry.decision)
            || reserve_mismatch
        {
            result.problem(format!(
                "key {key}: answered {:?} {:?} on {} (hold {:?}); the trail has {:?} {:?} on {} \
                 (hold {:?}, entry {})",
                asked.f,
                reply.decision,
                asked.value.account,
                reply.hold_id,
                entry.kind,
                entry.decision,
                entry.account,
                entry.hold_id,
                entry.sequence
            ));
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

    const FLOOR: u64 = 100;

    /// A valid run on one account "a" (floor 100, funded 1,000): hold 1 of 50 (TTL 1,000 ms)
    /// captured for 30 at 500 ms by a command that first expires hold 2 of 20 (TTL 100 ms,
    /// due at 300 ms); hold 3 of 10 (TTL 10 s) made at 700 ms and voided at 800 ms; each
    /// client operation acknowledged.
    struct Scenario {
        history: HistoryBuilder,
        trail: Vec<TrailEntry>,
    }

    impl Scenario {
        fn new() -> Self {
            let mut scenario = Self { history: HistoryBuilder::new(), trail: Vec::new() };
            scenario.push(Function::CreateAccount, "create", 0, FLOOR, None, None);
            scenario.push(Function::Credit, "fund", 0, 1_000, None, None);
            scenario.push(Function::Reserve, "r1", 100, 50, Some(1), Some(1_000));
            scenario.push(Function::Reserve, "r2", 200, 20, Some(2), Some(100));
            scenario.expire(2, 500);
            scenario.push(Function::Capture, "c1", 500, 30, Some(1), None);
            scenario.push(Function::Reserve, "r3", 700, 10, Some(3), Some(10_000));
            scenario.push(Function::Void, "v3", 800, 10, Some(3), None);
            scenario
        }

        /// An acknowledged operation and its approved entry.
        fn push(
            &mut self,
            f: Function,
            key: &str,
            time_ms: u64,
            amount: u64,
            hold_id: Option<u64>,
            ttl_ms: Option<u64>,
        ) {
            let kind = f.entry_kind().expect("a mutation");
            let value = OpValue {
                account: "a".into(),
                amount: Some(amount),
                key: Some(key.into()),
                ttl_ms,
                hold_id: hold_id.filter(|_| f != Function::Reserve),
                ..OpValue::default()
            };
            self.append(kind, key, time_ms, amount, hold_id, ttl_ms);
            let reply = OpValue { decision: Some(Decision::Approved), hold_id, ..value.clone() };
            self.history.push(1, EventType::Invoke, f, value);
            self.history.push(1, EventType::Ok, f, reply);
        }

        fn expire(&mut self, hold_id: u64, time_ms: u64) {
            let amount = self.hold_amount(hold_id);
            self.append(EntryKind::Expire, "", time_ms, amount, Some(hold_id), None);
        }

        fn hold_amount(&self, hold_id: u64) -> u64 {
            self.trail
                .iter()
                .find(|entry| entry.kind == EntryKind::Reserve && entry.hold_id == Some(hold_id))
                .map_or(0, |entry| entry.amount)
        }

        /// An approved entry, its balances moved as the ledger moves them.
        fn append(
            &mut self,
            kind: EntryKind,
            key: &str,
            time_ms: u64,
            amount: u64,
            hold_id: Option<u64>,
            ttl_ms: Option<u64>,
        ) {
            let (balance, held) =
                self.trail.last().map_or((0, 0), |entry| (entry.balance_after, entry.held_after));
            let hold_amount = hold_id.map_or(0, |id| self.hold_amount(id));
            let (balance_after, held_after) = match kind {
                EntryKind::Credit => (balance + amount, held),
                EntryKind::Reserve => (balance, held + amount),
                // Saturating: the bad histories release a hold twice.
                EntryKind::Capture => (balance - amount, held.saturating_sub(hold_amount)),
                EntryKind::Void | EntryKind::Expire => (balance, held.saturating_sub(hold_amount)),
                _ => (balance, held),
            };
            self.trail.push(TrailEntry {
                sequence: self.trail.len() as u64 + 1,
                ledger_index: self.trail.len() as u64 + 10,
                time_ms,
                kind,
                account: "a".into(),
                key: key.into(),
                amount,
                decision: Decision::Approved,
                balance_before: balance,
                balance_after,
                held_before: held,
                held_after,
                hold_id,
                ttl_ms,
            });
        }

        fn failing(&self) -> Vec<String> {
            check(&self.history.events, &self.trail, &HoldsModel { floor: FLOOR })
                .into_iter()
                .filter(|result| result.validity != Validity::Valid)
                .map(|result| result.name)
                .collect()
        }
    }

    /// The valid scenario passes every check.
    #[test]
    fn a_valid_history_passes() {
        assert_eq!(Scenario::new().failing(), Vec::<String>::new());
    }

    /// A capture committed at the hold's expiry is flagged.
    #[test]
    fn a_capture_after_expiry_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.push(Function::Reserve, "r4", 900, 5, Some(4), Some(100));
        scenario.push(Function::Capture, "c4", 1_000, 5, Some(4), None);
        assert_eq!(scenario.failing(), ["holds"]);
    }

    /// An expiry before the hold's time is flagged, and so is one the ledger missed.
    #[test]
    fn early_and_late_expiries_are_flagged() {
        let mut early = Scenario::new();
        early.push(Function::Reserve, "r4", 900, 5, Some(4), Some(1_000));
        early.expire(4, 1_500);
        assert_eq!(early.failing(), ["holds"]);
        let mut late = Scenario::new();
        late.push(Function::Reserve, "r4", 900, 5, Some(4), Some(100));
        late.push(Function::Credit, "credit", 1_200, 5, None, None);
        assert_eq!(late.failing(), ["holds"]);
    }

    /// A hold resolved twice (voided after its capture) is flagged, and the second release
    /// breaks the account's chain too.
    #[test]
    fn a_hold_resolved_twice_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.push(Function::Void, "v1", 900, 50, Some(1), None);
        let failing = scenario.failing();
        assert!(failing.contains(&"holds".to_owned()), "{failing:?}");
    }

    /// One command's sweep expires several holds, each by its own entry, all at the
    /// command's index and time: a hold expired later in the same sweep is not late; one
    /// expired by a later command is.
    #[test]
    fn a_sweep_expires_holds_in_one_command() {
        for (one_command, failing) in [(true, vec![]), (false, vec!["holds"])] {
            let mut scenario = Scenario::new();
            scenario.push(Function::Reserve, "r4", 900, 5, Some(4), Some(100));
            scenario.push(Function::Reserve, "r5", 900, 5, Some(5), Some(50));
            scenario.expire(5, 1_000);
            scenario.expire(4, 1_000);
            if one_command {
                let last = scenario.trail.len() - 1;
                scenario.trail[last].ledger_index = scenario.trail[last - 1].ledger_index;
            }
            assert_eq!(scenario.failing(), failing, "one command: {one_command}");
        }
    }

    /// Ledger time that goes back along the trail is flagged.
    #[test]
    fn ledger_time_going_back_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.push(Function::Credit, "credit", 50, 5, None, None);
        assert!(scenario.failing().contains(&"ledger-time".to_owned()));
    }

    /// An acknowledged capture missing from the trail, and a reserve answered with another
    /// hold than the trail's, are flagged.
    #[test]
    fn acknowledged_operations_missing_or_different_are_flagged() {
        let mut lost = Scenario::new();
        let capture = lost.trail.iter().position(|entry| entry.key == "c1").expect("c1");
        lost.trail.remove(capture);
        assert!(lost.failing().contains(&"holds-acknowledged".to_owned()));
        let mut other = Scenario::new();
        let reply = other
            .history
            .events
            .iter_mut()
            .find(|event| {
                event.event_type == EventType::Ok && event.value.key.as_deref() == Some("r3")
            })
            .expect("r3's reply");
        reply.value.hold_id = Some(7);
        assert_eq!(other.failing(), ["holds-acknowledged"]);
    }

    /// A capture refused as expired while the trail shows its hold never expired is flagged.
    #[test]
    fn a_refusal_as_expired_of_an_open_hold_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.push(Function::Reserve, "r4", 900, 5, Some(4), Some(10_000));
        let value = OpValue {
            account: "a".into(),
            amount: Some(5),
            key: Some("c4".into()),
            hold_id: Some(4),
            ..OpValue::default()
        };
        let refused =
            OpValue { error: Some("FailedPrecondition: hold 4 expired".into()), ..value.clone() };
        scenario.history.push(2, EventType::Invoke, Function::Capture, value);
        scenario.history.push(2, EventType::Fail, Function::Capture, refused);
        assert_eq!(scenario.failing(), ["holds-acknowledged"]);
        scenario.expire(4, 20_000);
        assert_eq!(scenario.failing(), Vec::<String>::new());
    }

    /// What one simulated command does after its sweep.
    #[derive(Debug, Clone)]
    enum Step {
        Reserve { amount: u64, ttl_ms: u64 },
        Capture { pick: prop::sample::Index, percent: u64 },
        Void { pick: prop::sample::Index },
        Credit { amount: u64 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1_u64..400, 1_u64..500).prop_map(|(amount, ttl_ms)| Step::Reserve { amount, ttl_ms }),
            (any::<prop::sample::Index>(), 1_u64..=100)
                .prop_map(|(pick, percent)| Step::Capture { pick, percent }),
            any::<prop::sample::Index>().prop_map(|pick| Step::Void { pick }),
            (1_u64..300).prop_map(|amount| Step::Credit { amount }),
        ]
    }

    /// Runs commands on a reference ledger of one account (a sweep of due holds, in expiry
    /// order, then one operation, all at the command's time and index), acknowledging every
    /// client operation: the scenario's opening, then `steps` at the given time gaps.
    fn simulate(steps: Vec<(u64, Step)>) -> Scenario {
        let mut scenario = Scenario { history: HistoryBuilder::new(), trail: Vec::new() };
        scenario.push(Function::CreateAccount, "create", 0, FLOOR, None, None);
        scenario.push(Function::Credit, "fund", 0, 1_000, None, None);
        // Open holds: (expires at, id).
        let mut open: std::collections::BTreeSet<(u64, u64)> = std::collections::BTreeSet::new();
        let mut time_ms = 0;
        for (command, (gap_ms, step)) in steps.into_iter().enumerate() {
            time_ms += gap_ms;
            let first = scenario.trail.len();
            while let Some(&(expires_at_ms, id)) = open.first().filter(|(at, _)| *at <= time_ms) {
                open.remove(&(expires_at_ms, id));
                scenario.expire(id, time_ms);
            }
            let key = format!("k{command}");
            let hold_id = command as u64 + 100;
            let (balance, held) = scenario
                .trail
                .last()
                .map_or((0, 0), |entry| (entry.balance_after, entry.held_after));
            let pick = |pick: &prop::sample::Index| {
                (!open.is_empty())
                    .then(|| *open.iter().nth(pick.index(open.len())).expect("in range"))
            };
            match step {
                Step::Reserve { amount, ttl_ms } if amount <= balance - held - FLOOR => {
                    scenario.push(
                        Function::Reserve,
                        &key,
                        time_ms,
                        amount,
                        Some(hold_id),
                        Some(ttl_ms),
                    );
                    open.insert((time_ms + ttl_ms, hold_id));
                }
                Step::Capture { pick: chosen, percent } => {
                    if let Some((at, id)) = pick(&chosen) {
                        open.remove(&(at, id));
                        let amount = (scenario.hold_amount(id) * percent / 100).max(1);
                        scenario.push(Function::Capture, &key, time_ms, amount, Some(id), None);
                    }
                }
                Step::Void { pick: chosen } => {
                    if let Some((at, id)) = pick(&chosen) {
                        open.remove(&(at, id));
                        let amount = scenario.hold_amount(id);
                        scenario.push(Function::Void, &key, time_ms, amount, Some(id), None);
                    }
                }
                Step::Credit { amount } => {
                    scenario.push(Function::Credit, &key, time_ms, amount, None, None);
                }
                Step::Reserve { .. } => {}
            }
            // One command: one ledger index for every entry it made.
            let index = 1_000 + command as u64;
            for entry in &mut scenario.trail[first..] {
                entry.ledger_index = index;
            }
        }
        scenario
    }

    proptest! {
        /// A reference ledger's trail and acknowledgements pass every check; without one of
        /// its expiries that some entry follows, the holds check fails.
        #[test]
        fn reference_ledger_passes_and_a_missed_expiry_fails(
            steps in prop::collection::vec((0_u64..200, step()), 0..80),
            drop in any::<prop::sample::Index>(),
        ) {
            let mut scenario = simulate(steps);
            prop_assert_eq!(scenario.failing(), Vec::<String>::new());
            let followed: Vec<usize> = (0..scenario.trail.len().saturating_sub(1))
                .filter(|&position| scenario.trail[position].kind == EntryKind::Expire)
                .collect();
            prop_assume!(!followed.is_empty());
            scenario.trail.remove(followed[drop.index(followed.len())]);
            prop_assert!(scenario.failing().contains(&"holds".to_owned()));
        }
    }

    /// A reserve approved beyond what is available is flagged.
    #[test]
    fn a_reserve_beyond_available_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.push(Function::Reserve, "r4", 900, 2_000, Some(4), Some(10_000));
        assert_eq!(scenario.failing(), ["hold-chain"]);
    }
}

//! The bank checker (C2 and C3 of the fault-testing plan) over the history of the bank
//! workload and the audit trails read from every node after the run:
//!
//! - `trails-agree`: every node lists the same trail (none read: unknown);
//! - `trail-chain`: per account, each entry starts from the previous one's balance, moves it
//!   by its amount as its decision says, and decides as the balance, floor and amount demand;
//! - `floor`: no trail balance and no `ok` read below the account's floor;
//! - `exactly-once`: no key in the trail twice; every `ok` mutation's key once, with its
//!   account, amount, decision, index and balance; a key whose every attempt `fail`ed absent;
//!   an `info`-only key present once or not at all (both are counted); no entry whose key no
//!   client sent (phantom), and no entry of a kind the workload never asks for;
//! - `reads`: every `ok` read shows the balance after some entry at or past both the index it
//!   reports and every mutation acknowledged before the read was invoked (no stale read, no
//!   balance the account never had);
//! - `conservation`: money is neither made nor lost: no transfer credited without its approved
//!   debit or for another amount, and the final balances plus the transfers still in flight
//!   (debited, never credited, never acknowledged as credited) equal what was funded.

use std::collections::{BTreeMap, HashMap};

use super::CheckResult;
use crate::history::{
    Decision, EntryKind, Event, EventType, Function, NodeId, Operation, TrailEntry, operations,
};

/// What the workload set up, as the checker needs it.
#[derive(Debug, Clone)]
pub struct BankModel {
    pub accounts: Vec<String>,
    pub floor: u64,
}

/// Runs every bank check.
pub fn check(
    events: &[Event],
    trails: &[(NodeId, Vec<TrailEntry>)],
    model: &BankModel,
) -> Vec<CheckResult> {
    let operations = operations(events);
    let agree = trails_agree(trails);
    let Some((_, trail)) = trails.first() else {
        return vec![agree];
    };
    let chains = chains(trail);
    vec![
        agree,
        trail_chain(trail, &chains, model),
        floor(&chains, &operations, model),
        exactly_once(trail, &operations),
        reads(&chains, &operations),
        conservation(trail, &chains, &operations),
    ]
}

/// `trails-agree`: every node lists the same trail as the first (none read: unknown).
pub fn trails_agree(trails: &[(NodeId, Vec<TrailEntry>)]) -> CheckResult {
    let mut agree = CheckResult::new("trails-agree");
    let Some((_, trail)) = trails.first() else {
        agree.unknown("no node's audit trail was read".to_owned());
        return agree;
    };
    for (node, other) in trails {
        agree.checked += 1;
        if other != trail {
            let position = trail.iter().zip(other).position(|(first, second)| first != second);
            agree.problem(format!(
                "node {} lists {} entries, node {} {}; first difference at position {:?}",
                node.0,
                other.len(),
                trails[0].0.0,
                trail.len(),
                position.unwrap_or(trail.len().min(other.len())),
            ));
        }
    }
    agree
}

/// Each account's entries in trail order.
fn chains(trail: &[TrailEntry]) -> BTreeMap<&str, Vec<&TrailEntry>> {
    let mut chains: BTreeMap<&str, Vec<&TrailEntry>> = BTreeMap::new();
    for entry in trail {
        chains.entry(entry.account.as_str()).or_default().push(entry);
    }
    chains
}

fn trail_chain(
    trail: &[TrailEntry],
    chains: &BTreeMap<&str, Vec<&TrailEntry>>,
    model: &BankModel,
) -> CheckResult {
    let mut result = CheckResult::new("trail-chain");
    if trail.windows(2).any(|pair| pair[0].sequence >= pair[1].sequence) {
        result.problem("trail sequences do not increase".to_owned());
    }
    for (account, chain) in chains {
        let mut floor = model.floor;
        for (position, entry) in chain.iter().enumerate() {
            result.checked += 1;
            let at = format!("{account} entry {} ({})", entry.sequence, entry.key);
            if position == 0 {
                if entry.kind != EntryKind::CreateAccount {
                    result.problem(format!("{at}: first entry is {:?}, not a create", entry.kind));
                }
            } else if chain[position - 1].balance_after != entry.balance_before {
                result.problem(format!(
                    "{at}: starts from {}, the previous entry left {}",
                    entry.balance_before,
                    chain[position - 1].balance_after
                ));
            }
            let before = entry.balance_before;
            let available = before.saturating_sub(entry.held_after).saturating_sub(floor);
            let expected = match (entry.kind, entry.decision) {
                (EntryKind::CreateAccount, _) => {
                    if position != 0 {
                        result.problem(format!("{at}: account created twice"));
                    }
                    floor = entry.amount;
                    Some(0)
                }
                (EntryKind::Credit, Decision::Approved) => before.checked_add(entry.amount),
                (EntryKind::Debit, Decision::Approved) => {
                    if entry.amount > available {
                        result.problem(format!(
                            "{at}: debit of {} approved with {available} available",
                            entry.amount
                        ));
                    }
                    before.checked_sub(entry.amount)
                }
                (EntryKind::Debit, Decision::InsufficientFunds) => {
                    if entry.amount <= available {
                        result.problem(format!(
                            "{at}: debit of {} refused with {available} available",
                            entry.amount
                        ));
                    }
                    Some(before)
                }
                (kind, decision) => {
                    result.problem(format!("{at}: {kind:?} decided {decision:?}"));
                    None
                }
            };
            if expected != Some(entry.balance_after) {
                result.problem(format!(
                    "{at}: {:?} {:?} of {} took {before} to {}, expected {expected:?}",
                    entry.kind, entry.decision, entry.amount, entry.balance_after
                ));
            }
        }
    }
    result
}

fn floor(
    chains: &BTreeMap<&str, Vec<&TrailEntry>>,
    operations: &[Operation<'_>],
    model: &BankModel,
) -> CheckResult {
    let mut result = CheckResult::new("floor");
    for (account, chain) in chains {
        for entry in chain.iter().filter(|entry| entry.kind != EntryKind::CreateAccount) {
            result.checked += 1;
            if entry.balance_after < model.floor {
                result.problem(format!(
                    "{account} entry {} ({}) left {} below the floor {}",
                    entry.sequence, entry.key, entry.balance_after, model.floor
                ));
            }
        }
    }
    for operation in operations {
        if operation.invoke.f != Function::Read || operation.outcome() != EventType::Ok {
            continue;
        }
        result.checked += 1;
        let read = operation.result();
        if let Some(balance) = read.balance
            && balance < model.floor
        {
            result.problem(format!(
                "read at event {} saw {} at {balance}, below the floor {}",
                operation.invoke.index, read.account, model.floor
            ));
        }
    }
    result
}

/// Whether the bank makes entries of this kind (it makes no holds: any is a phantom).
fn made_by_bank(kind: EntryKind) -> bool {
    matches!(kind, EntryKind::CreateAccount | EntryKind::Credit | EntryKind::Debit)
}

/// Mutations by idempotency key.
fn by_key<'a>(operations: &'a [Operation<'a>]) -> BTreeMap<&'a str, Vec<&'a Operation<'a>>> {
    let mut keys: BTreeMap<&str, Vec<&Operation<'_>>> = BTreeMap::new();
    for operation in operations.iter().filter(|operation| operation.invoke.f.is_mutation()) {
        if let Some(key) = operation.invoke.value.key.as_deref() {
            keys.entry(key).or_default().push(operation);
        }
    }
    keys
}

fn exactly_once(trail: &[TrailEntry], operations: &[Operation<'_>]) -> CheckResult {
    let mut result = CheckResult::new("exactly-once");
    let mut entries: HashMap<&str, Vec<&TrailEntry>> = HashMap::new();
    for entry in trail {
        entries.entry(entry.key.as_str()).or_default().push(entry);
    }
    let keys = by_key(operations);
    for (key, applied) in &entries {
        if applied.len() > 1 {
            let sequences: Vec<u64> = applied.iter().map(|entry| entry.sequence).collect();
            result.problem(format!("key {key} applied {} times: {sequences:?}", applied.len()));
        }
        let entry = applied[0];
        if !made_by_bank(entry.kind) {
            result
                .problem(format!("entry {} ({key}) of a kind no client asked for", entry.sequence));
        }
        let Some(attempts) = keys.get(key) else {
            result.problem(format!("entry {} has key {key}, which no client sent", entry.sequence));
            continue;
        };
        let asked = &attempts[0].invoke;
        if asked.f.entry_kind() != Some(entry.kind)
            || asked.value.account != entry.account
            || asked.value.amount != Some(entry.amount)
        {
            result.problem(format!(
                "entry {} ({key}) is {:?} {} on {}; the client asked {:?} {:?} on {}",
                entry.sequence,
                entry.kind,
                entry.amount,
                entry.account,
                asked.f,
                asked.value.amount,
                asked.value.account
            ));
        }
    }
    for (key, attempts) in &keys {
        result.checked += 1;
        let applied = entries.get(key).and_then(|found| found.first());
        let acknowledged: Vec<_> =
            attempts.iter().filter(|attempt| attempt.outcome() == EventType::Ok).collect();
        if acknowledged.is_empty() {
            if attempts.iter().all(|attempt| attempt.outcome() == EventType::Fail)
                && let Some(entry) = applied
            {
                result.problem(format!(
                    "key {key}: every attempt failed, yet entry {} applied it",
                    entry.sequence
                ));
            }
            continue;
        }
        let Some(entry) = applied else {
            result.problem(format!(
                "key {key}: acknowledged at event {}, not in the trail (lost)",
                acknowledged[0].completion.map_or(0, |event| event.index)
            ));
            continue;
        };
        for attempt in acknowledged {
            let reply = attempt.result();
            if reply.decision != Some(entry.decision)
                || reply.ledger_index != Some(entry.ledger_index)
                || reply.balance != Some(entry.balance_after)
            {
                result.problem(format!(
                    "key {key}: event {} answered {:?} at index {:?} balance {:?}; the trail has \
                     {:?} at index {} balance {}",
                    attempt.completion.map_or(0, |event| event.index),
                    reply.decision,
                    reply.ledger_index,
                    reply.balance,
                    entry.decision,
                    entry.ledger_index,
                    entry.balance_after
                ));
            }
        }
    }
    result
}

fn reads(chains: &BTreeMap<&str, Vec<&TrailEntry>>, operations: &[Operation<'_>]) -> CheckResult {
    let mut result = CheckResult::new("reads");
    // When each key was first acknowledged.
    let mut acknowledged_ns: HashMap<&str, u64> = HashMap::new();
    for operation in operations {
        if operation.outcome() == EventType::Ok
            && let Some(key) = operation.invoke.value.key.as_deref()
        {
            let at = acknowledged_ns.entry(key).or_insert(u64::MAX);
            *at = (*at).min(operation.completed_ns());
        }
    }
    // Per account: each entry's acknowledgement time with its position, by time, and the
    // furthest position acknowledged up to each of them.
    let mut acknowledged: HashMap<&str, (Vec<u64>, Vec<usize>)> = HashMap::new();
    for (account, chain) in chains {
        let mut times: Vec<(u64, usize)> = chain
            .iter()
            .enumerate()
            .filter_map(|(position, entry)| {
                Some((*acknowledged_ns.get(entry.key.as_str())?, position))
            })
            .collect();
        times.sort_unstable();
        let furthest = times
            .iter()
            .scan(0, |furthest, (_, position)| {
                *furthest = (*furthest).max(*position);
                Some(*furthest)
            })
            .collect();
        acknowledged.insert(account, (times.into_iter().map(|(at, _)| at).collect(), furthest));
    }
    for operation in operations {
        if operation.invoke.f != Function::Read || operation.outcome() != EventType::Ok {
            continue;
        }
        result.checked += 1;
        let read = operation.result();
        let chain = chains.get(read.account.as_str()).map_or(&[][..], Vec::as_slice);
        let read_index = read.ledger_index.unwrap_or(0);
        // The read must reflect every entry up to its index (ledger indexes grow along the
        // chain) and every entry acknowledged before it was invoked.
        let by_index =
            chain.partition_point(|entry| entry.ledger_index <= read_index).checked_sub(1);
        let by_acknowledgement =
            acknowledged.get(read.account.as_str()).and_then(|(at, furthest)| {
                let before = at.partition_point(|at| *at < operation.invoke.time_ns);
                before.checked_sub(1).map(|last| furthest[last])
            });
        let lowest = by_index.max(by_acknowledgement);
        let Some(lowest) = lowest else {
            result.problem(format!(
                "read at event {} saw {} at {:?}, before the account existed",
                operation.invoke.index, read.account, read.balance
            ));
            continue;
        };
        if !chain[lowest..].iter().any(|entry| Some(entry.balance_after) == read.balance) {
            result.problem(format!(
                "read at event {} (index {read_index}) saw {} at {:?}; from entry {} on it was \
                 {:?}...",
                operation.invoke.index,
                read.account,
                read.balance,
                chain[lowest].sequence,
                chain[lowest..]
                    .iter()
                    .take(10)
                    .map(|entry| entry.balance_after)
                    .collect::<Vec<_>>()
            ));
        }
    }
    result
}

fn conservation(
    trail: &[TrailEntry],
    chains: &BTreeMap<&str, Vec<&TrailEntry>>,
    operations: &[Operation<'_>],
) -> CheckResult {
    let mut result = CheckResult::new("conservation");
    let entries: HashMap<&str, &TrailEntry> =
        trail.iter().map(|entry| (entry.key.as_str(), entry)).collect();
    // Each transfer's debit and credit keys, and whether a credit was acknowledged.
    let mut transfers: BTreeMap<u64, (Option<&str>, Option<&str>, bool)> = BTreeMap::new();
    for operation in operations {
        let value = &operation.invoke.value;
        let (Some(transfer), Some(key)) = (value.transfer, value.key.as_deref()) else {
            continue;
        };
        let slot = transfers.entry(transfer).or_default();
        match operation.invoke.f {
            Function::Debit => slot.0 = Some(key),
            Function::Credit => {
                slot.1 = Some(key);
                slot.2 |= operation.outcome() == EventType::Ok;
            }
            _ => {}
        }
    }
    let mut in_flight = 0_u64;
    for (transfer, (debit_key, credit_key, credit_acknowledged)) in &transfers {
        result.checked += 1;
        let debit = debit_key
            .and_then(|key| entries.get(key))
            .filter(|entry| entry.decision == Decision::Approved);
        let credit = credit_key.and_then(|key| entries.get(key));
        match (debit, credit) {
            (None, Some(credit)) => result.problem(format!(
                "transfer {transfer}: credited {} (entry {}) without an approved debit",
                credit.amount, credit.sequence
            )),
            (Some(debit), Some(credit)) if debit.amount != credit.amount => {
                result.problem(format!(
                    "transfer {transfer}: debited {}, credited {}",
                    debit.amount, credit.amount
                ));
            }
            (Some(debit), None) => {
                if *credit_acknowledged {
                    result.problem(format!(
                        "transfer {transfer}: its credit was acknowledged but is not applied"
                    ));
                }
                in_flight = in_flight.saturating_add(debit.amount);
            }
            _ => {}
        }
    }
    let transfer_credits: std::collections::HashSet<&str> =
        transfers.values().filter_map(|(_, credit, _)| *credit).collect();
    let funded: u64 = trail
        .iter()
        .filter(|entry| {
            entry.kind == EntryKind::Credit && !transfer_credits.contains(entry.key.as_str())
        })
        .filter(|entry| entry.decision == Decision::Approved)
        .map(|entry| entry.amount)
        .sum();
    let held: u64 =
        chains.values().filter_map(|chain| chain.last()).map(|entry| entry.balance_after).sum();
    if held.saturating_add(in_flight) != funded {
        result.problem(format!(
            "the accounts hold {held} and {in_flight} is in flight: {} where {funded} was funded",
            held.saturating_add(in_flight)
        ));
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::OpValue;
    use crate::history::tests::HistoryBuilder;

    /// A small valid run: two accounts opened with 1,000 above a floor of 100, a transfer of
    /// 30 from one to the other, a refused debit, an `info` debit that did apply, a read.
    struct Scenario {
        history: HistoryBuilder,
        trail: Vec<TrailEntry>,
    }

    const FLOOR: u64 = 100;

    fn model() -> BankModel {
        BankModel { accounts: vec!["a0".into(), "a1".into()], floor: FLOOR }
    }

    impl Scenario {
        fn new() -> Self {
            let mut scenario = Self { history: HistoryBuilder::new(), trail: Vec::new() };
            for account in ["a0", "a1"] {
                scenario.mutate(0, Function::CreateAccount, account, FLOOR, None, Some(0));
                scenario.mutate(0, Function::Credit, account, 1_000, None, Some(1_000));
            }
            scenario.mutate(1, Function::Debit, "a0", 30, Some(1), Some(970));
            scenario.mutate(1, Function::Credit, "a1", 30, Some(1), Some(1_030));
            // Refused: 970 - 100 available.
            scenario.mutate(2, Function::Debit, "a0", 900, Some(2), None);
            scenario.read(3, "a0", 970);
            scenario
        }

        fn key(f: Function, account: &str, transfer: Option<u64>) -> String {
            match (f, transfer) {
                (Function::Debit, Some(transfer)) => format!("transfer-{transfer}-debit"),
                (_, Some(transfer)) => format!("transfer-{transfer}-credit"),
                (Function::CreateAccount, None) => format!("create-{account}"),
                _ => format!("fund-{account}"),
            }
        }

        /// A mutation acknowledged `ok`, and its entry: approved to `after`, or refused when
        /// `after` is `None`.
        fn mutate(
            &mut self,
            process: u64,
            f: Function,
            account: &str,
            amount: u64,
            transfer: Option<u64>,
            after: Option<u64>,
        ) {
            let key = Self::key(f, account, transfer);
            let before = self
                .trail
                .iter()
                .rev()
                .find(|entry| entry.account == account)
                .map_or(0, |e| e.balance_after);
            let entry = TrailEntry {
                sequence: self.trail.len() as u64 + 1,
                ledger_index: self.trail.len() as u64 + 10,
                kind: f.entry_kind().expect("a mutation"),
                account: account.to_owned(),
                key: key.clone(),
                amount,
                decision: if after.is_some() {
                    Decision::Approved
                } else {
                    Decision::InsufficientFunds
                },
                balance_before: before,
                balance_after: after.unwrap_or(before),
                held_before: 0,
                held_after: 0,
                hold_id: None,
                ttl_ms: None,
                time_ms: 0,
            };
            let value = OpValue {
                account: account.to_owned(),
                amount: Some(amount),
                key: Some(key),
                transfer,
                ..OpValue::default()
            };
            let reply = OpValue {
                decision: Some(entry.decision),
                balance: Some(entry.balance_after),
                ledger_index: Some(entry.ledger_index),
                ..value.clone()
            };
            self.history.push(process, EventType::Invoke, f, value);
            self.history.push(process, EventType::Ok, f, reply);
            self.trail.push(entry);
        }

        fn read(&mut self, process: u64, account: &str, balance: u64) {
            let value = OpValue { account: account.to_owned(), ..OpValue::default() };
            let index = self.trail.last().map_or(0, |entry| entry.ledger_index);
            let reply =
                OpValue { balance: Some(balance), ledger_index: Some(index), ..value.clone() };
            self.history.push(process, EventType::Invoke, Function::Read, value);
            self.history.push(process, EventType::Ok, Function::Read, reply);
        }

        /// The checks that fail, by name (a check that cannot judge counts as failing).
        fn failing(&self) -> Vec<String> {
            let trails = vec![(NodeId(1), self.trail.clone()), (NodeId(2), self.trail.clone())];
            check(&self.history.events, &trails, &model())
                .into_iter()
                .filter(|result| result.validity != Validity::Valid)
                .map(|result| result.name)
                .collect()
        }

        /// The `ok` completion of the mutation with `key`.
        fn completion(&mut self, key: &str) -> &mut Event {
            self.history
                .events
                .iter_mut()
                .find(|event| {
                    event.event_type == EventType::Ok && event.value.key.as_deref() == Some(key)
                })
                .expect("an acknowledged mutation of the key")
        }

        /// The trail's entry with `key`.
        fn entry(&mut self, key: &str) -> &mut TrailEntry {
            self.trail.iter_mut().find(|entry| entry.key == key).expect("an entry of the key")
        }
    }

    /// The valid scenario passes every check.
    #[test]
    fn a_valid_history_passes() {
        assert_eq!(Scenario::new().failing(), Vec::<String>::new());
    }

    /// An `info` debit counts either way: applied or not, the history is valid.
    #[test]
    fn info_counts_either_way() {
        for applied in [true, false] {
            let mut scenario = Scenario::new();
            scenario.mutate(4, Function::Debit, "a1", 5, Some(3), Some(1_025));
            let last = scenario.history.events.len() - 1;
            scenario.history.events[last].event_type = EventType::Info;
            if !applied {
                scenario.trail.pop();
            }
            assert_eq!(scenario.failing(), Vec::<String>::new(), "applied: {applied}");
        }
    }

    /// An acknowledged credit missing from the trail is a lost write.
    #[test]
    fn lost_acknowledged_write_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.trail.retain(|entry| entry.key != "transfer-1-credit");
        let failing = scenario.failing();
        assert!(failing.contains(&"exactly-once".to_owned()), "{failing:?}");
        assert!(failing.contains(&"conservation".to_owned()), "{failing:?}");
    }

    /// A key applied twice is flagged, even with a consistent chain.
    #[test]
    fn key_applied_twice_is_flagged() {
        let mut scenario = Scenario::new();
        let mut again = scenario.entry("transfer-1-debit").clone();
        again.sequence = 100;
        again.ledger_index = 100;
        again.balance_before = 970;
        again.balance_after = 940;
        scenario.trail.push(again);
        let failing = scenario.failing();
        assert!(failing.contains(&"exactly-once".to_owned()), "{failing:?}");
        assert!(failing.contains(&"conservation".to_owned()), "{failing:?}");
    }

    /// A debit that went through the floor is flagged by the chain and the floor checks.
    #[test]
    fn debit_through_the_floor_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.mutate(4, Function::Debit, "a1", 1_000, Some(3), Some(30));
        let failing = scenario.failing();
        assert!(failing.contains(&"trail-chain".to_owned()), "{failing:?}");
        assert!(failing.contains(&"floor".to_owned()), "{failing:?}");
    }

    /// A refused debit that had the funds is a wrong decision.
    #[test]
    fn wrong_refusal_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.mutate(4, Function::Debit, "a1", 10, Some(3), None);
        assert_eq!(scenario.failing(), vec!["trail-chain".to_owned()]);
    }

    /// A read that misses a debit acknowledged before it began is stale; one showing a
    /// balance the account never had is invented.
    #[test]
    fn stale_and_invented_reads_are_flagged() {
        for balance in [1_000, 555] {
            let mut scenario = Scenario::new();
            let last = scenario.history.events.len() - 1;
            scenario.history.events[last].value.balance = Some(balance);
            assert_eq!(scenario.failing(), vec!["reads".to_owned()], "balance {balance}");
        }
    }

    /// A broken chain (an entry starting from a balance nobody left) is flagged.
    #[test]
    fn broken_chain_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.entry("transfer-1-credit").balance_before = 900;
        let failing = scenario.failing();
        assert!(failing.contains(&"trail-chain".to_owned()), "{failing:?}");
    }

    /// Two nodes listing different trails are flagged; no trail at all is unknown.
    #[test]
    fn disagreeing_and_missing_trails_are_flagged() {
        let scenario = Scenario::new();
        let mut other = scenario.trail.clone();
        other.pop();
        let trails = vec![(NodeId(1), scenario.trail.clone()), (NodeId(2), other)];
        let results = check(&scenario.history.events, &trails, &model());
        assert_eq!(results[0].validity, Validity::Invalid);
        let results = check(&scenario.history.events, &[], &model());
        assert_eq!(results[0].validity, Validity::Unknown);
    }

    /// An entry whose key no client sent, or whose every attempt failed, is flagged.
    #[test]
    fn phantom_and_failed_entries_are_flagged() {
        let mut scenario = Scenario::new();
        scenario.entry("transfer-1-debit").key = "nobody-sent-this".to_owned();
        let failing = scenario.failing();
        assert!(failing.contains(&"exactly-once".to_owned()), "{failing:?}");

        let mut scenario = Scenario::new();
        scenario.completion("transfer-2-debit").event_type = EventType::Fail;
        assert_eq!(scenario.failing(), vec!["exactly-once".to_owned()]);
    }

    /// A reply that disagrees with the trail (another index or balance) is flagged.
    #[test]
    fn reply_disagreeing_with_trail_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.completion("transfer-1-debit").value.ledger_index = Some(999);
        assert_eq!(scenario.failing(), vec!["exactly-once".to_owned()]);
    }

    /// A credit applied for a transfer whose debit was refused makes money.
    #[test]
    fn money_made_is_flagged() {
        let mut scenario = Scenario::new();
        scenario.mutate(2, Function::Credit, "a1", 900, Some(2), Some(1_930));
        let failing = scenario.failing();
        assert!(failing.contains(&"conservation".to_owned()), "{failing:?}");
    }
}

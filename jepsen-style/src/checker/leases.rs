//! The lease-conservation checker: the quota ledger grants, on a key no node settles, never
//! more than its bucket holds plus what refills. Each `ok` grant of the admin
//! `AcquireLeases` says how many tokens it got (g), how many the bucket kept (r) and, through
//! its lease's expiry less the TTL, the ledger time it was applied at (t). Per key:
//!
//! ```text
//! g <= wanted,   g + r <= C                                  (no bucket above its capacity)
//! sum of g over grants with t in [t_i, t_j] <= C + R x (t_j - t_i)      for every i <= j
//! ```
//!
//! with C the bucket's capacity and R its rate. The bucket holds at most C at t_i and
//! refills R a second of ledger time; with no settlement (`workload::leases`: no node
//! reports on these keys) nothing flows back into it. A grant that committed but whose
//! answer was lost (`info`) only took tokens too, so judging the `ok` ones alone is sound.
//! Ledger time is the applying leader's clock, never going back along the log: a clock
//! jump refills the bucket early, which the bound measured in ledger time allows.
//!
//! Across keys, ledger time never goes back in real time either: a grant answered before
//! another was sent was applied at no later ledger time (else the log lost or reordered a
//! committed command).
//!
//! On keys that nodes lease and settle (the RLS workload's), tokens flow back and grants
//! alone are unbounded, so `lease-totals` judges the ledger's own totals, read from the
//! voters while the run goes on (`ledger.jsonl`). Each read is one applied state; ordered by
//! applied index they are states of one log. For each key's life under one limit (since
//! ledger time s), with net = granted + charged - returned:
//!
//! ```text
//! net_j - net_i <= C + R x (t_j - t_i)     for every pair of states i <= j, and from (s, 0)
//! ```
//!
//! and reads of one applied index agree, ledger time and the totals never go back along the
//! log, and every key carries the workload's limit.

use std::collections::BTreeMap;

use super::CheckResult;
use crate::history::{Event, EventType, Function, KeySample, LedgerSample, operations};

/// What the checker needs to know of the keys' rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseModel {
    pub capacity_tokens: u64,
    pub rate_per_second: u64,
}

/// One `ok` grant of some tokens.
#[derive(Debug, Clone, Copy)]
struct Grant {
    event: u64,
    invoke_ns: u64,
    completed_ns: u64,
    ledger_time_ms: u64,
    granted: u64,
}

/// Runs both checks: `lease-conservation` and `lease-ledger-time`.
pub fn check(events: &[Event], model: LeaseModel) -> Vec<CheckResult> {
    let mut conservation = CheckResult::new("lease-conservation");
    let mut time = CheckResult::new("lease-ledger-time");
    let mut by_key: BTreeMap<String, Vec<Grant>> = BTreeMap::new();
    for operation in operations(events) {
        if operation.invoke.f != Function::Acquire || operation.outcome() != EventType::Ok {
            continue;
        }
        let asked = &operation.invoke.value;
        let reply = operation.result();
        let key = asked.descriptor.clone().unwrap_or_default();
        let index = operation.invoke.index;
        let (Some(granted), Some(remaining)) = (reply.granted, reply.remaining) else {
            conservation.unknown(format!("event {index}: an ok grant without its tokens"));
            continue;
        };
        conservation.checked += 1;
        if granted > asked.amount.unwrap_or(0) {
            conservation.problem(format!(
                "event {index}: key {key}: granted {granted}, more than the {} asked",
                asked.amount.unwrap_or(0)
            ));
        }
        if granted.saturating_add(remaining) > model.capacity_tokens {
            conservation.problem(format!(
                "event {index}: key {key}: granted {granted} and {remaining} left, above the \
                 bucket's capacity {}",
                model.capacity_tokens
            ));
        }
        if granted == 0 {
            continue;
        }
        let Some(ledger_time_ms) = reply.ledger_time_ms else {
            conservation.unknown(format!("event {index}: a grant without its ledger time"));
            continue;
        };
        by_key.entry(key).or_default().push(Grant {
            event: index,
            invoke_ns: operation.invoke.time_ns,
            completed_ns: operation.completed_ns(),
            ledger_time_ms,
            granted,
        });
    }
    let mut all = Vec::new();
    for (key, grants) in &mut by_key {
        if let Some(problem) = worst_interval(grants, model) {
            conservation.problem(format!("key {key}: {problem}"));
        }
        all.extend(grants.iter().copied());
    }
    time.checked = all.len() as u64;
    for problem in ledger_time_went_back(&mut all) {
        time.problem(problem);
    }
    vec![conservation, time]
}

/// The interval of ledger time whose grants most exceed the bound, if any does; sorts
/// `grants` by ledger time. Linear after the sort: the worst window ending at grant j
/// starts at the i <= j that maximises R x t_i - 1000 x (grants before i).
fn worst_interval(grants: &mut [Grant], model: LeaseModel) -> Option<String> {
    grants.sort_by_key(|grant| (grant.ledger_time_ms, grant.event));
    let rate = i128::from(model.rate_per_second);
    // In thousandths of a token: R tokens a second is R thousandths a millisecond; a
    // partial token of refill rounds up (999), so the bound is never below the truth.
    let allowance = i128::from(model.capacity_tokens) * 1_000 + 999;
    let mut before_milli: i128 = 0;
    let mut best_start: Option<(i128, usize)> = None;
    let mut worst: Option<(i128, usize, usize)> = None;
    for (position, grant) in grants.iter().enumerate() {
        let start_value = rate * i128::from(grant.ledger_time_ms) - before_milli;
        if best_start.is_none_or(|(value, _)| start_value > value) {
            best_start = Some((start_value, position));
        }
        before_milli += i128::from(grant.granted) * 1_000;
        let (start_value, start) = best_start.expect("set above");
        let excess =
            before_milli - rate * i128::from(grant.ledger_time_ms) + start_value - allowance;
        if excess > 0 && worst.is_none_or(|(most, _, _)| excess > most) {
            worst = Some((excess, start, position));
        }
    }
    let (_, start, end) = worst?;
    let (first, last) = (grants[start], grants[end]);
    let sum: u64 = grants[start..=end].iter().map(|grant| grant.granted).sum();
    let span_ms = last.ledger_time_ms - first.ledger_time_ms;
    Some(format!(
        "{sum} tokens granted in {} grants over {span_ms} ms of ledger time (events {} to {}), \
         above C + R x {span_ms} ms = {} + {}",
        end - start + 1,
        first.event,
        last.event,
        model.capacity_tokens,
        (u128::from(model.rate_per_second) * u128::from(span_ms)).div_ceil(1_000),
    ))
}

/// Grants applied at an earlier ledger time than one answered before they were sent.
fn ledger_time_went_back(grants: &mut [Grant]) -> Vec<String> {
    let mut by_completion: Vec<Grant> = grants.to_vec();
    by_completion.sort_by_key(|grant| grant.completed_ns);
    grants.sort_by_key(|grant| grant.invoke_ns);
    let mut problems = Vec::new();
    let mut completed = 0;
    let mut latest: Option<Grant> = None;
    for grant in grants.iter() {
        while completed < by_completion.len()
            && by_completion[completed].completed_ns < grant.invoke_ns
        {
            let done = by_completion[completed];
            if latest.is_none_or(|latest| done.ledger_time_ms > latest.ledger_time_ms) {
                latest = Some(done);
            }
            completed += 1;
        }
        if let Some(earlier) = latest
            && earlier.ledger_time_ms > grant.ledger_time_ms
        {
            problems.push(format!(
                "event {}: applied at ledger time {} ms, before event {}'s {} ms, answered \
                 before it was sent",
                grant.event, grant.ledger_time_ms, earlier.event, earlier.ledger_time_ms
            ));
        }
    }
    problems
}

/// One state of a key's life: the ledger time and the net tokens drawn, from a read.
#[derive(Debug, Clone, Copy)]
struct TotalsPoint {
    applied_index: u64,
    ledger_time_ms: u64,
    net_tokens: i128,
}

/// The `lease-totals` check over the ledger reads of a run (module docs).
pub fn check_totals(samples: &[LedgerSample], model: LeaseModel) -> CheckResult {
    let mut result = CheckResult::new("lease-totals");
    if samples.is_empty() {
        result.unknown("no reads of the ledger's keys (ledger.jsonl) to judge".to_owned());
        return result;
    }
    // One state per applied index: reads of the same index from any node must agree.
    let mut states: BTreeMap<u64, &LedgerSample> = BTreeMap::new();
    for sample in samples {
        result.checked += sample.keys.len() as u64;
        match states.get(&sample.applied_index) {
            None => {
                states.insert(sample.applied_index, sample);
            }
            Some(first)
                if (first.ledger_time_ms, &first.keys) != (sample.ledger_time_ms, &sample.keys) =>
            {
                result.problem(format!(
                    "nodes {} and {} read different states at applied index {}",
                    first.node.0, sample.node.0, sample.applied_index
                ));
            }
            Some(_) => {}
        }
    }
    let mut latest_time: Option<(u64, u64)> = None;
    for (index, state) in &states {
        if let Some((earlier_index, earlier_ms)) = latest_time
            && state.ledger_time_ms < earlier_ms
        {
            result.problem(format!(
                "ledger time went back along the log: {earlier_ms} ms at index {earlier_index}, \
                 {} ms at index {index}",
                state.ledger_time_ms
            ));
        }
        latest_time = Some((*index, state.ledger_time_ms.max(latest_time.map_or(0, |(_, ms)| ms))));
    }
    // Each key's lives (by `since_ms`), their states in log order.
    let mut lives: BTreeMap<(&str, u64), Vec<(&KeySample, TotalsPoint)>> = BTreeMap::new();
    let mut wrong_limit: BTreeMap<&str, String> = BTreeMap::new();
    for (applied_index, state) in &states {
        for key in &state.keys {
            if let Some(problem) = limit_problem(key, model) {
                wrong_limit.entry(&key.key).or_insert(problem);
            }
            let net_tokens = i128::from(key.granted_tokens) + i128::from(key.charged_tokens)
                - i128::from(key.returned_tokens);
            let point = TotalsPoint {
                applied_index: *applied_index,
                ledger_time_ms: state.ledger_time_ms,
                net_tokens,
            };
            lives.entry((&key.key, key.since_ms)).or_default().push((key, point));
        }
    }
    for (key, problem) in wrong_limit {
        result.problem(format!("key {key}: {problem}"));
    }
    for ((key, since_ms), points) in &lives {
        for pair in points.windows(2) {
            let ((before, at_before), (after, at_after)) = (pair[0], pair[1]);
            if after.granted_tokens < before.granted_tokens
                || after.charged_tokens < before.charged_tokens
                || after.returned_tokens < before.returned_tokens
            {
                result.problem(format!(
                    "key {key}: totals went back between applied index {} and {}: granted, \
                     charged, returned {:?} then {:?}",
                    at_before.applied_index,
                    at_after.applied_index,
                    (before.granted_tokens, before.charged_tokens, before.returned_tokens),
                    (after.granted_tokens, after.charged_tokens, after.returned_tokens),
                ));
            }
        }
        let origin = TotalsPoint { applied_index: 0, ledger_time_ms: *since_ms, net_tokens: 0 };
        let path: Vec<TotalsPoint> =
            std::iter::once(origin).chain(points.iter().map(|(_, point)| *point)).collect();
        if let Some(problem) = worst_net(&path, model) {
            result.problem(format!("key {key} (since {since_ms} ms): {problem}"));
        }
    }
    result
}

/// Why a key's limit is not the workload's token bucket, if it is not.
fn limit_problem(key: &KeySample, model: LeaseModel) -> Option<String> {
    let rate_ok = key.window_ms > 0
        && u128::from(key.requests_per_window) * 1_000
            == u128::from(model.rate_per_second) * u128::from(key.window_ms);
    (key.algorithm != "token_bucket" || key.capacity_tokens != model.capacity_tokens || !rate_ok)
        .then(|| {
            format!(
                "limit {} of {} per {} ms holding {}, not the workload's token bucket of {} a \
                 second holding {}",
                key.algorithm,
                key.requests_per_window,
                key.window_ms,
                key.capacity_tokens,
                model.rate_per_second,
                model.capacity_tokens
            )
        })
}

/// The pair of states between which the most net tokens above the bound were drawn, if
/// any: linear, keeping the start that minimises 1000 x net - R x t (thousandths).
fn worst_net(path: &[TotalsPoint], model: LeaseModel) -> Option<String> {
    let rate = i128::from(model.rate_per_second);
    let allowance = i128::from(model.capacity_tokens) * 1_000 + 999;
    let value =
        |point: &TotalsPoint| point.net_tokens * 1_000 - rate * i128::from(point.ledger_time_ms);
    let mut lowest: Option<(i128, TotalsPoint)> = None;
    let mut worst: Option<(i128, TotalsPoint, TotalsPoint)> = None;
    for point in path {
        let here = value(point);
        if lowest.is_none_or(|(low, _)| here < low) {
            lowest = Some((here, *point));
        }
        let (low, start) = lowest.expect("set above");
        let excess = here - low - allowance;
        if excess > 0 && worst.is_none_or(|(most, _, _)| excess > most) {
            worst = Some((excess, start, *point));
        }
    }
    let (_, start, end) = worst?;
    let span_ms = end.ledger_time_ms.saturating_sub(start.ledger_time_ms);
    Some(format!(
        "{} tokens drawn net (granted + charged - returned) over {span_ms} ms of ledger time \
         (applied index {} to {}), above C + R x {span_ms} ms = {} + {}",
        end.net_tokens - start.net_tokens,
        start.applied_index,
        end.applied_index,
        model.capacity_tokens,
        (u128::from(model.rate_per_second) * u128::from(span_ms)).div_ceil(1_000),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::OpValue;
    use crate::history::tests::HistoryBuilder;
    use proptest::prelude::*;

    const MODEL: LeaseModel = LeaseModel { capacity_tokens: 20, rate_per_second: 20 };

    /// Grants one after the other, each `(key, wanted, granted, remaining, ledger ms)`.
    fn history(grants: &[(&str, u64, u64, u64, u64)]) -> Vec<Event> {
        let mut history = HistoryBuilder::new();
        for (process, (key, wanted, granted, remaining, ledger_ms)) in grants.iter().enumerate() {
            let asked = OpValue {
                descriptor: Some((*key).to_owned()),
                amount: Some(*wanted),
                ttl_ms: Some(500),
                ..OpValue::default()
            };
            let reply = OpValue {
                granted: Some(*granted),
                remaining: Some(*remaining),
                ledger_time_ms: (*granted > 0).then_some(*ledger_ms),
                ..asked.clone()
            };
            history.push(process as u64, EventType::Invoke, Function::Acquire, asked);
            history.push(process as u64, EventType::Ok, Function::Acquire, reply);
        }
        history.events
    }

    fn validities(events: &[Event]) -> (Validity, Validity) {
        let results = check(events, MODEL);
        (results[0].validity, results[1].validity)
    }

    /// A full bucket drained, then its refill taken as it comes, on two keys: valid.
    #[test]
    fn grants_within_the_bucket_pass() {
        let events = history(&[
            ("k0", 5, 5, 15, 1_000),
            ("k0", 5, 5, 10, 1_000),
            ("k1", 20, 20, 0, 1_001),
            ("k0", 10, 10, 0, 1_002),
            ("k0", 5, 0, 0, 1_003),
            ("k0", 5, 2, 0, 1_100),
            ("k1", 5, 5, 0, 1_250),
            ("k0", 5, 5, 0, 1_350),
        ]);
        assert_eq!(validities(&events), (Validity::Valid, Validity::Valid));
    }

    /// More granted within a second than the bucket and its refill hold is flagged, as is
    /// one grant above the capacity or above what was asked.
    #[test]
    fn over_grants_are_flagged() {
        let drained_twice = history(&[("k0", 20, 20, 0, 1_000), ("k0", 20, 20, 0, 1_500)]);
        assert_eq!(validities(&drained_twice).0, Validity::Invalid);
        // 20 + 10 in 400 ms is more than 20 + 8.
        let refilled_early = history(&[("k0", 20, 20, 0, 1_000), ("k0", 10, 10, 0, 1_400)]);
        let results = check(&refilled_early, MODEL);
        assert_eq!(results[0].validity, Validity::Invalid);
        assert!(results[0].problems[0].contains("30 tokens granted in 2 grants"), "{results:?}");
        let above_capacity = history(&[("k0", 20, 15, 10, 1_000)]);
        assert_eq!(validities(&above_capacity).0, Validity::Invalid);
        let above_asked = history(&[("k0", 5, 6, 0, 1_000)]);
        assert_eq!(validities(&above_asked).0, Validity::Invalid);
        // The excess hides in the middle of a long run of fair grants.
        let mut grants = vec![("k0", 20, 20, 0, 1_000)];
        grants.extend((1..=20).map(|step| ("k0", 1, 1, 0, 1_000 + step * 50)));
        grants.push(("k0", 5, 5, 0, 2_010));
        assert_eq!(validities(&history(&grants)).0, Validity::Invalid);
    }

    /// A grant answered before another was sent with a later ledger time is flagged.
    #[test]
    fn ledger_time_going_back_is_flagged() {
        let events = history(&[("k0", 1, 1, 19, 2_000), ("k1", 1, 1, 19, 1_999)]);
        assert_eq!(validities(&events), (Validity::Valid, Validity::Invalid));
    }

    /// `info` grants and refused ones are not counted; an `ok` without its figures cannot
    /// be judged.
    #[test]
    fn unknown_grants_are_not_counted() {
        let mut events = history(&[("k0", 20, 20, 0, 1_000), ("k0", 20, 20, 0, 1_001)]);
        events[3].event_type = EventType::Info;
        assert_eq!(validities(&events).0, Validity::Valid);
        let mut bare = history(&[("k0", 20, 20, 0, 1_000)]);
        bare[1].value.granted = None;
        assert_eq!(validities(&bare).0, Validity::Unknown);
    }

    /// The naive check: every pair of grants, the sum between them by ledger time.
    fn naive_excess(grants: &[(u64, u64)]) -> bool {
        let mut sorted = grants.to_vec();
        sorted.sort_unstable();
        (0..sorted.len()).any(|start| {
            (start..sorted.len()).any(|end| {
                let sum: u64 = sorted[start..=end].iter().map(|(_, granted)| granted).sum();
                let span_ms = sorted[end].0 - sorted[start].0;
                sum * 1_000 > MODEL.capacity_tokens * 1_000 + MODEL.rate_per_second * span_ms + 999
            })
        })
    }

    proptest! {
        /// The linear sweep finds an interval above the bound exactly when some pair of
        /// grants encloses one.
        #[test]
        fn sweep_agrees_with_every_pair(
            grants in proptest::collection::vec((0_u64..3_000, 1_u64..12), 0..40),
        ) {
            let rows: Vec<(&str, u64, u64, u64, u64)> = grants
                .iter()
                .map(|(ledger_ms, granted)| ("k0", *granted, *granted, 0, *ledger_ms))
                .collect();
            let mut events = history(&rows);
            // All in flight together: no real-time order to hold ledger time to.
            for event in &mut events {
                event.time_ns = if event.event_type == EventType::Invoke { 0 } else { 1 };
            }
            let flagged = check(&events, MODEL)[0].validity == Validity::Invalid;
            prop_assert_eq!(flagged, naive_excess(&grants));
        }
    }

    /// A read of key `k0` on `node` at `index`: `(ledger ms, since ms, granted, charged,
    /// returned)`.
    fn read(
        node: u64,
        index: u64,
        (ledger_ms, since_ms, granted, charged, returned): (u64, u64, u64, u64, u64),
    ) -> LedgerSample {
        LedgerSample {
            time_ns: index,
            node: crate::history::NodeId(node),
            applied_index: index,
            ledger_time_ms: ledger_ms,
            keys: vec![KeySample {
                key: "rl:k0".to_owned(),
                algorithm: "token_bucket".to_owned(),
                capacity_tokens: MODEL.capacity_tokens,
                requests_per_window: MODEL.rate_per_second,
                window_ms: 1_000,
                since_ms,
                granted_tokens: granted,
                charged_tokens: charged,
                returned_tokens: returned,
            }],
        }
    }

    /// Reads one after the other on node 1, at indexes 1, 2, ...
    fn reads(states: &[(u64, u64, u64, u64, u64)]) -> Vec<LedgerSample> {
        states.iter().enumerate().map(|(at, state)| read(1, at as u64 + 1, *state)).collect()
    }

    /// Tokens that flow back make room again; a debt's charge counts as drawn; reads out
    /// of log order and repeated by other nodes change nothing.
    #[test]
    fn settled_keys_within_the_bucket_pass() {
        let mut samples = reads(&[
            (1_000, 1_000, 20, 0, 0),
            // 15 came back and 15 went out again at once: net 20 still.
            (1_010, 1_000, 35, 0, 15),
            // Half a second later: 10 more of refill, 5 of them charged for debt.
            (1_510, 1_000, 40, 5, 15),
            (3_000, 1_000, 70, 5, 15),
        ]);
        samples.push(read(2, 2, (1_010, 1_000, 35, 0, 15)));
        samples.swap(0, 3);
        let result = check_totals(&samples, MODEL);
        assert_eq!(result.validity, Validity::Valid, "{result:?}");
        assert_eq!(result.checked, 5);
    }

    /// Net draws above the bucket and its refill are flagged, from the life's start or
    /// between two reads; so are returns counted that did not refill, hidden by a later read.
    #[test]
    fn net_over_draws_are_flagged() {
        // 30 net in the first 400 ms of the life: more than 20 + 8.
        let early = check_totals(&reads(&[(1_400, 1_000, 30, 0, 0)]), MODEL);
        assert_eq!(early.validity, Validity::Invalid);
        assert!(early.problems[0].contains("30 tokens drawn net"), "{early:?}");
        // Between two reads: 10 net at 2,000 ms, 45 at 2,500 (35 in 500 ms > 20 + 10).
        let between =
            check_totals(&reads(&[(2_000, 1_000, 10, 0, 0), (2_500, 1_000, 50, 0, 5)]), MODEL);
        assert_eq!(between.validity, Validity::Invalid, "{between:?}");
        // A charge for debt is drawn like a grant.
        let charged =
            check_totals(&reads(&[(1_000, 1_000, 20, 0, 0), (1_100, 1_000, 20, 10, 0)]), MODEL);
        assert_eq!(charged.validity, Validity::Invalid, "{charged:?}");
    }

    /// A new life (the limit changed, or the key was forgotten and made again) starts over.
    #[test]
    fn a_new_life_starts_over() {
        let samples = reads(&[(1_000, 1_000, 20, 0, 0), (1_001, 1_001, 20, 0, 0)]);
        assert_eq!(check_totals(&samples, MODEL).validity, Validity::Valid);
    }

    /// Replicas that read differently at one index, totals or ledger time going back along
    /// the log, and a key under another limit are flagged; no reads cannot be judged.
    #[test]
    fn broken_ledgers_are_flagged() {
        let mut disagree = reads(&[(1_000, 1_000, 5, 0, 0)]);
        disagree.push(read(3, 1, (1_000, 1_000, 6, 0, 0)));
        let result = check_totals(&disagree, MODEL);
        assert_eq!(result.validity, Validity::Invalid);
        assert!(result.problems[0].contains("nodes 1 and 3"), "{result:?}");
        let went_back = reads(&[(1_000, 1_000, 5, 0, 3), (1_001, 1_000, 6, 0, 2)]);
        assert_eq!(check_totals(&went_back, MODEL).validity, Validity::Invalid);
        let time_back = reads(&[(1_000, 1_000, 5, 0, 0), (999, 1_000, 5, 0, 0)]);
        assert_eq!(check_totals(&time_back, MODEL).validity, Validity::Invalid);
        let mut other_limit = reads(&[(1_000, 1_000, 5, 0, 0)]);
        other_limit[0].keys[0].capacity_tokens = 40;
        assert_eq!(check_totals(&other_limit, MODEL).validity, Validity::Invalid);
        assert_eq!(check_totals(&[], MODEL).validity, Validity::Unknown);
    }

    /// Every pair of states of one life, the naive way, from the life's start too.
    fn naive_totals_excess(states: &[(u64, i128)], since_ms: u64) -> bool {
        let mut path = vec![(since_ms, 0_i128)];
        path.extend_from_slice(states);
        (0..path.len()).any(|first| {
            (first..path.len()).any(|last| {
                let span_ms = i128::from(path[last].0 - path[first].0);
                (path[last].1 - path[first].1) * 1_000
                    > i128::from(MODEL.capacity_tokens) * 1_000
                        + i128::from(MODEL.rate_per_second) * span_ms
                        + 999
            })
        })
    }

    proptest! {
        /// The linear sweep over a life flags exactly the lives some pair of states (or the
        /// life's start and a state) shows above the bound.
        #[test]
        fn totals_sweep_agrees_with_every_pair(
            steps in proptest::collection::vec((0_u64..300, 0_u64..15, 0_u64..3, 0_u64..12), 0..30),
        ) {
            let since_ms = 1_000;
            let (mut ledger_ms, mut granted, mut charged, mut returned) = (since_ms, 0, 0, 0);
            let mut states = Vec::new();
            let mut naive = Vec::new();
            for (step_ms, grant, charge, give_back) in steps {
                ledger_ms += step_ms;
                granted += grant;
                charged += charge;
                returned += give_back.min(granted + charged - returned);
                states.push((ledger_ms, since_ms, granted, charged, returned));
                naive.push((ledger_ms, i128::from(granted + charged) - i128::from(returned)));
            }
            let flagged = check_totals(&reads(&states), MODEL).validity == Validity::Invalid;
            prop_assert_eq!(flagged, naive_totals_excess(&naive, since_ms));
        }
    }
}

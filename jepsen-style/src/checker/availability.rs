//! The availability checker: how much of the service the clients got, held against
//! thresholds. Not a safety property (a slow machine can miss it), so its thresholds are
//! options of the run, but a region that stays down after a heal, or fails operations while
//! nothing is wrong, is a finding all the same. Measured from the history and the nemesis
//! records alone:
//!
//! - the share of operations answered `ok`, invoked with no fault active and not between a
//!   heal and every node's first `ok` after it (`quiet`), and with a fault of each kind
//!   active;
//! - for each fault, the time from its end (healing begun) to the first `ok` through any
//!   node and to the last node's first `ok` (`every`).
//!
//! A fault's recovery is judged only when the window after its heal is whole: it ends before
//! the next fault starts and before the history does; a node with no operation invoked in it
//! is not judged.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::CheckResult;
use crate::history::{Event, NodeId, operations};
use crate::nemesis::{FaultKind, NemesisRecord, Phase};

/// What the checker demands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Every node answers an `ok` within this long after a fault's heal.
    pub recovery_ms_max: u64,
    /// At least this share (in thousandths) of the quiet operations are `ok`.
    pub quiet_ok_permille_min: u64,
}

/// The defaults: a restarted node replays its log and the region elects a leader well
/// within 15 s even with both cores busy; outside faults nine in ten operations succeed
/// (the rest: calls racing an election the fault before caused, past the grace).
pub const THRESHOLDS_DEFAULT: Thresholds =
    Thresholds { recovery_ms_max: 15_000, quiet_ok_permille_min: 900 };

/// Operations and how many were `ok`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Share {
    pub operations: u64,
    pub ok: u64,
}

impl Share {
    fn add(&mut self, ok: bool) {
        self.operations += 1;
        self.ok += u64::from(ok);
    }

    /// The `ok` share in thousandths; `None` without operations.
    pub fn permille(self) -> Option<u64> {
        (self.operations > 0).then(|| self.ok * 1_000 / self.operations)
    }
}

/// One fault's recovery after its heal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    pub fault: usize,
    pub kind: FaultKind,
    pub end_ns: u64,
    /// To the first `ok` through any node.
    pub any_ms: Option<u64>,
    /// To the last node's first `ok` (`None` if some node had none).
    pub every_ms: Option<u64>,
    /// Nodes with an operation invoked in the window after the heal but no `ok` in it, when
    /// that window is whole (see the module docs).
    pub unrecovered: Vec<NodeId>,
}

/// The measures of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Availability {
    pub quiet: Share,
    /// Operations invoked while a fault of the kind was active.
    pub during: BTreeMap<FaultKind, Share>,
    pub recoveries: Vec<Recovery>,
}

/// A fault from its start record to its end record (`u64::MAX`: never healed).
struct Interval {
    fault: usize,
    kind: FaultKind,
    start_ns: u64,
    end_ns: u64,
}

fn intervals(faults: &[NemesisRecord]) -> Vec<Interval> {
    let mut intervals: Vec<Interval> = faults
        .iter()
        .filter(|record| record.phase == Phase::Start)
        .map(|start| Interval {
            fault: start.fault,
            kind: start.kind,
            start_ns: start.time_ns,
            end_ns: faults
                .iter()
                .find(|record| record.fault == start.fault && record.phase == Phase::End)
                .map_or(u64::MAX, |record| record.time_ns),
        })
        .collect();
    intervals.sort_by_key(|interval| interval.start_ns);
    intervals
}

/// Measures the history; `grace_ms` after a heal is the longest recovery waited for. Pure.
pub fn measure(events: &[Event], faults: &[NemesisRecord], grace_ms: u64) -> Availability {
    let grace_ns = grace_ms.saturating_mul(1_000_000);
    let intervals = intervals(faults);
    let operations = operations(events);
    let mut availability = Availability::default();
    let history_end_ns = events.last().map_or(0, |event| event.time_ns);
    let mut nodes: Vec<NodeId> = events.iter().map(|event| event.node).collect();
    nodes.sort_unstable();
    nodes.dedup();
    for (position, interval) in intervals.iter().enumerate() {
        if interval.end_ns == u64::MAX {
            continue;
        }
        let end_ns = interval.end_ns;
        let first_ok_ms = |node: Option<NodeId>| {
            events
                .iter()
                .find(|event| {
                    event.served()
                        && event.time_ns >= end_ns
                        && node.is_none_or(|node| event.node == node)
                })
                .map(|event| (event.time_ns - end_ns) / 1_000_000)
        };
        let firsts: Vec<Option<u64>> = nodes.iter().map(|node| first_ok_ms(Some(*node))).collect();
        let every_ms = firsts
            .iter()
            .copied()
            .collect::<Option<Vec<u64>>>()
            .and_then(|all| all.into_iter().max());
        let window_end_ns = end_ns.saturating_add(grace_ns);
        let next_start_ns = intervals.get(position + 1).map_or(u64::MAX, |next| next.start_ns);
        let whole = window_end_ns <= next_start_ns && window_end_ns <= history_end_ns;
        let unrecovered = if whole {
            nodes
                .iter()
                .zip(&firsts)
                .filter(|(node, first)| {
                    first.is_none_or(|ms| ms > grace_ms)
                        && operations.iter().any(|operation| {
                            operation.invoke.node == **node
                                && (end_ns..=window_end_ns).contains(&operation.invoke.time_ns)
                        })
                })
                .map(|(node, _)| *node)
                .collect()
        } else {
            Vec::new()
        };
        availability.recoveries.push(Recovery {
            fault: interval.fault,
            kind: interval.kind,
            end_ns,
            any_ms: first_ok_ms(None),
            every_ms,
            unrecovered,
        });
    }
    // After each heal, operations are neither quiet nor faulty until every node answered
    // again (at most the threshold).
    let recovered_ns: Vec<(u64, u64)> = availability
        .recoveries
        .iter()
        .map(|recovery| {
            let ms = recovery.every_ms.map_or(grace_ms, |ms| ms.min(grace_ms));
            (recovery.end_ns, recovery.end_ns.saturating_add(ms.saturating_mul(1_000_000)))
        })
        .collect();
    for operation in &operations {
        let at_ns = operation.invoke.time_ns;
        let ok = operation.served();
        let active: Vec<&Interval> = intervals
            .iter()
            .filter(|interval| interval.start_ns <= at_ns && at_ns <= interval.end_ns)
            .collect();
        if !active.is_empty() {
            for interval in active {
                availability.during.entry(interval.kind).or_default().add(ok);
            }
        } else if !recovered_ns
            .iter()
            .any(|(end_ns, recovered_ns)| *end_ns < at_ns && at_ns < *recovered_ns)
        {
            availability.quiet.add(ok);
        }
    }
    availability
}

/// Checks the history against `thresholds`. Pure.
pub fn check(events: &[Event], faults: &[NemesisRecord], thresholds: Thresholds) -> CheckResult {
    let mut result = CheckResult::new("availability");
    let measured = measure(events, faults, thresholds.recovery_ms_max);
    result.checked = measured.quiet.operations + measured.recoveries.len() as u64;
    if let Some(permille) = measured.quiet.permille()
        && permille < thresholds.quiet_ok_permille_min
    {
        result.problem(format!(
            "{} of {} operations outside faults were ok ({}.{} %), below {}.{} %",
            measured.quiet.ok,
            measured.quiet.operations,
            permille / 10,
            permille % 10,
            thresholds.quiet_ok_permille_min / 10,
            thresholds.quiet_ok_permille_min % 10,
        ));
    }
    for recovery in &measured.recoveries {
        for node in &recovery.unrecovered {
            result.problem(format!(
                "fault {} ({:?}): node {} answered no ok within {} ms of the heal",
                recovery.fault, recovery.kind, node.0, thresholds.recovery_ms_max
            ));
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::{EventType, Function, OpValue, ProcessId};
    use crate::nemesis::{FaultOutcome, Target};

    const MS: u64 = 1_000_000;

    /// A kill of node 2 from 1 s to 2 s.
    fn kill() -> Vec<NemesisRecord> {
        [(Phase::Start, 1_000 * MS), (Phase::End, 2_000 * MS)]
            .into_iter()
            .map(|(phase, time_ns)| NemesisRecord {
                time_ns,
                fault: 0,
                phase,
                kind: FaultKind::Kill,
                target: Target::One(1),
                nodes: vec![NodeId(2)],
                outcome: FaultOutcome::Installed,
                detail: None,
            })
            .collect()
    }

    /// Reads through nodes 1 and 2 every 100 ms for 6 s, each completing 1 ms later: `ok`
    /// unless `fails` says otherwise for (node, invoke ms).
    fn history(fails: impl Fn(u64, u64) -> bool) -> Vec<Event> {
        let mut events = Vec::new();
        for at_ms in (0..6_000).step_by(100) {
            for node in [1, 2] {
                let process = ProcessId(events.len() as u64);
                let mut push = |event_type, time_ns| {
                    events.push(Event {
                        index: events.len() as u64,
                        time_ns,
                        process,
                        event_type,
                        f: Function::Read,
                        node: NodeId(node),
                        value: OpValue::default(),
                    });
                };
                push(EventType::Invoke, at_ms * MS);
                let outcome = if fails(node, at_ms) { EventType::Info } else { EventType::Ok };
                push(outcome, (at_ms + 1) * MS);
            }
        }
        events.sort_by_key(|event| event.time_ns);
        events
    }

    const STRICT: Thresholds = Thresholds { recovery_ms_max: 1_000, quiet_ok_permille_min: 900 };

    /// A node down only during the fault, back right after its heal, passes; its recovery is
    /// measured.
    #[test]
    fn a_prompt_recovery_passes() {
        let events = history(|node, at_ms| node == 2 && (1_000..2_000).contains(&at_ms));
        let result = check(&events, &kill(), STRICT);
        assert_eq!(result.validity, Validity::Valid, "{result:?}");
        let measured = measure(&events, &kill(), STRICT.recovery_ms_max);
        assert_eq!(measured.recoveries[0].every_ms, Some(1));
        assert_eq!(measured.during[&FaultKind::Kill], Share { operations: 22, ok: 12 });
        assert_eq!(measured.quiet.permille(), Some(1_000));
    }

    /// A node still failing past the threshold after the heal is flagged.
    #[test]
    fn a_node_that_stays_down_is_flagged() {
        let events = history(|node, at_ms| node == 2 && (1_000..3_500).contains(&at_ms));
        let result = check(&events, &kill(), STRICT);
        assert_eq!(result.validity, Validity::Invalid, "{result:?}");
        assert!(result.problems[0].contains("node 2 answered no ok"), "{result:?}");
    }

    /// Failures with no fault active, beyond the threshold's share, are flagged.
    #[test]
    fn failures_outside_faults_are_flagged() {
        let events = history(|_, at_ms| at_ms >= 4_000 && at_ms % 200 == 0);
        let result = check(&events, &kill(), STRICT);
        assert_eq!(result.validity, Validity::Invalid, "{result:?}");
        assert!(result.problems[0].contains("outside faults"), "{result:?}");
    }

    /// A recovery window cut short by the end of the history is not judged.
    #[test]
    fn a_window_cut_short_is_not_judged() {
        let events: Vec<Event> = history(|node, at_ms| node == 2 && at_ms >= 1_000)
            .into_iter()
            .filter(|event| event.time_ns < 2_500 * MS)
            .collect();
        assert_eq!(check(&events, &kill(), STRICT).validity, Validity::Valid);
    }
}

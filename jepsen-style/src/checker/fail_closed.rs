//! The fail-closed checker (C4 of the fault-testing plan): a node cut off from a quorum
//! approves nothing and reads nothing. For each installed partition, from its start record
//! (the cut in place) to its end record (healing begun), the nodes on the side without a
//! quorum must not answer `ok` to a mutation (a `DUPLICATE` replay of an earlier commit
//! excepted) nor to a linearizable read whose whole call lies inside the partition. Sound:
//! such an answer needs a majority's acknowledgement within the call. A one-way partition
//! counts the same (its targets hear no acknowledgement); a flapping one is not judged (the
//! records do not say when its cut was in place). In a majorities ring each node drops what
//! some nodes send; a link works only both ways (the nodes speak TCP), so a node whose
//! working links reach fewer than a quorum, even through others, is judged (every node of
//! a ring of three; none of five, each linked to its two neighbours).

use super::CheckResult;
use crate::history::{Event, EventType, Function, NodeId, operations};
use crate::nemesis::{FaultKind, FaultOutcome, NemesisRecord, Phase, Target};

/// A stretch of time during which `nodes` had no quorum.
struct Cut {
    start_ns: u64,
    end_ns: u64,
    nodes: Vec<NodeId>,
    fault: usize,
}

/// Checks the history against the partitions of `faults` in a region of `node_count`.
pub fn check(events: &[Event], faults: &[NemesisRecord], node_count: usize) -> CheckResult {
    let mut result = CheckResult::new("fail-closed");
    let quorum = node_count / 2 + 1;
    let mut cuts = Vec::new();
    for start in faults.iter().filter(|record| {
        matches!(
            record.kind,
            FaultKind::Partition | FaultKind::PartitionOneWay | FaultKind::MajoritiesRing
        ) && record.phase == Phase::Start
            && record.outcome == FaultOutcome::Installed
    }) {
        let Some(end) =
            faults.iter().find(|record| record.fault == start.fault && record.phase == Phase::End)
        else {
            continue;
        };
        // Each side's component: the cut-off nodes together, or each alone for `All`. A
        // bridge leaves every node a path to a quorum (through the bridge): nothing to check.
        let component = match &start.target {
            Target::All => 1,
            Target::Bridge(_) => continue,
            Target::Ring(ring) => {
                for nodes in ring_components(ring, &start.nodes) {
                    if nodes.len() < quorum {
                        cuts.push(Cut {
                            start_ns: start.time_ns,
                            end_ns: end.time_ns,
                            nodes,
                            fault: start.fault,
                        });
                    }
                }
                continue;
            }
            _ => start.nodes.len(),
        };
        if component < quorum {
            cuts.push(Cut {
                start_ns: start.time_ns,
                end_ns: end.time_ns,
                nodes: start.nodes.clone(),
                fault: start.fault,
            });
        }
    }
    for operation in operations(events) {
        let invoke = operation.invoke;
        let Some(cut) = cuts.iter().find(|cut| {
            cut.nodes.contains(&invoke.node)
                && cut.start_ns <= invoke.time_ns
                && operation.completed_ns() <= cut.end_ns
        }) else {
            continue;
        };
        result.checked += 1;
        let answered = operation.outcome() == EventType::Ok;
        let needs_quorum = match invoke.f {
            Function::Read => true,
            Function::CreateAccount
            | Function::Credit
            | Function::Debit
            | Function::Reserve
            | Function::Capture
            | Function::Void => !operation.result().duplicate,
            // A grant commits through the quota group.
            Function::Acquire => true,
            // RLS decisions come from the node's own leases by design.
            Function::Check => false,
        };
        if answered && needs_quorum {
            result.problem(format!(
                "event {}: node {} answered {:?} ok while cut off from a quorum (fault {})",
                invoke.index, invoke.node.0, invoke.f, cut.fault
            ));
        }
    }
    result
}

/// The groups of nodes a majorities ring leaves linked both ways, directly or through
/// others; `ids` are the ring's nodes in ring order.
fn ring_components(ring: &[usize], ids: &[NodeId]) -> Vec<Vec<NodeId>> {
    let cut = crate::nemesis::majorities_ring_links(ring);
    let linked = |first: usize, second: usize| {
        !cut.contains(&(first, second)) && !cut.contains(&(second, first))
    };
    let id_of = |position: usize| {
        ring.iter()
            .position(|candidate| *candidate == position)
            .and_then(|slot| ids.get(slot).copied())
            .unwrap_or(NodeId(position as u64 + 1))
    };
    let mut seen = Vec::new();
    let mut components = Vec::new();
    for start in ring {
        if seen.contains(start) {
            continue;
        }
        let mut component = vec![*start];
        seen.push(*start);
        let mut next = 0;
        while let Some(node) = component.get(next).copied() {
            next += 1;
            for other in ring {
                if !seen.contains(other) && linked(node, *other) {
                    seen.push(*other);
                    component.push(*other);
                }
            }
        }
        components.push(component.into_iter().map(id_of).collect());
    }
    components
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::OpValue;
    use crate::history::tests::HistoryBuilder;

    /// Node 2 of 3 is cut off from 10 ms to 20 ms.
    fn partition(target: Target, nodes: Vec<u64>) -> Vec<NemesisRecord> {
        [(Phase::Start, 10_000_000), (Phase::End, 20_000_000)]
            .into_iter()
            .map(|(phase, time_ns)| NemesisRecord {
                time_ns,
                fault: 0,
                phase,
                kind: FaultKind::Partition,
                target: target.clone(),
                nodes: nodes.iter().map(|id| NodeId(*id)).collect(),
                outcome: FaultOutcome::Installed,
                detail: None,
            })
            .collect()
    }

    /// One operation through `node` invoked at `invoke_ms`, completed `ok` 1 ms later.
    fn history(f: Function, node: u64, invoke_ms: u64, duplicate: bool) -> Vec<Event> {
        let mut history = HistoryBuilder::new();
        let value = OpValue { account: "a".into(), ..OpValue::default() };
        history.push(0, EventType::Invoke, f, value.clone());
        history.push(0, EventType::Ok, f, OpValue { duplicate, ..value });
        for (position, event) in history.events.iter_mut().enumerate() {
            event.node = NodeId(node);
            event.time_ns = (invoke_ms + position as u64) * 1_000_000;
        }
        history.events
    }

    fn validity(events: &[Event], faults: &[NemesisRecord]) -> Validity {
        check(events, faults, 3).validity
    }

    /// An approval or a read through the cut-off node inside the partition is flagged.
    #[test]
    fn answers_without_quorum_are_flagged() {
        let faults = partition(Target::One(1), vec![2]);
        for f in [Function::Debit, Function::Credit, Function::Read] {
            assert_eq!(validity(&history(f, 2, 12, false), &faults), Validity::Invalid, "{f:?}");
        }
        let everyone = partition(Target::All, vec![1, 2, 3]);
        assert_eq!(validity(&history(Function::Debit, 1, 12, false), &everyone), Validity::Invalid);
        let mut one_way = partition(Target::One(1), vec![2]);
        for record in &mut one_way {
            record.kind = FaultKind::PartitionOneWay;
        }
        assert_eq!(validity(&history(Function::Read, 2, 12, false), &one_way), Validity::Invalid);
    }

    /// A majorities ring of three leaves every node alone (each link is cut one way): an
    /// answer inside it is flagged; one of five leaves every node a quorum: nothing is.
    #[test]
    fn majorities_rings_are_judged_by_their_links() {
        let mut three = partition(Target::Ring(vec![0, 2, 1]), vec![1, 3, 2]);
        for record in &mut three {
            record.kind = FaultKind::MajoritiesRing;
        }
        for node in 1..=3 {
            let debit = history(Function::Debit, node, 12, false);
            assert_eq!(validity(&debit, &three), Validity::Invalid, "node {node}");
        }
        assert_eq!(validity(&history(Function::Debit, 1, 21, false), &three), Validity::Valid);
        let mut five = partition(Target::Ring(vec![0, 1, 2, 3, 4]), vec![1, 2, 3, 4, 5]);
        for record in &mut five {
            record.kind = FaultKind::MajoritiesRing;
        }
        let debit = history(Function::Debit, 1, 12, false);
        assert_eq!(check(&debit, &five, 5).validity, Validity::Valid);
        assert_eq!(ring_components(&[0, 1, 2, 3, 4], &[]).len(), 1);
    }

    /// The majority side, calls straddling the cut, replays of earlier commits, and the
    /// bridge node of a bridge partition pass.
    #[test]
    fn legitimate_answers_pass() {
        let faults = partition(Target::One(1), vec![2]);
        assert_eq!(validity(&history(Function::Debit, 1, 12, false), &faults), Validity::Valid);
        assert_eq!(validity(&history(Function::Debit, 2, 9, false), &faults), Validity::Valid);
        assert_eq!(validity(&history(Function::Debit, 2, 20, false), &faults), Validity::Valid);
        assert_eq!(validity(&history(Function::Debit, 2, 12, true), &faults), Validity::Valid);
        assert_eq!(validity(&history(Function::Check, 2, 12, false), &faults), Validity::Valid);
        let bridge = partition(Target::Bridge(1), vec![2]);
        assert_eq!(validity(&history(Function::Debit, 2, 12, false), &bridge), Validity::Valid);
        let mut flap = partition(Target::One(1), vec![2]);
        for record in &mut flap {
            record.kind = FaultKind::PartitionFlap;
        }
        assert_eq!(validity(&history(Function::Debit, 2, 12, false), &flap), Validity::Valid);
    }
}

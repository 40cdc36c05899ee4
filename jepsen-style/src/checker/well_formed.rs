//! C0, well-formedness: the history is one the runner can have written. Every completion
//! follows an open invoke of its process and function, a process has one operation in flight,
//! a process that got `info` never invokes again, indices count up from 0 and times never go
//! back. A broken history is a harness fault: the verdict is unknown, never valid.

use std::collections::{HashMap, HashSet};

use super::CheckResult;
use crate::history::{Event, EventType, Function, ProcessId};

pub fn check(events: &[Event]) -> CheckResult {
    let mut result = CheckResult::new("well-formed");
    let mut open: HashMap<ProcessId, Function> = HashMap::new();
    let mut retired: HashSet<ProcessId> = HashSet::new();
    let mut previous_ns = 0;
    for (position, event) in events.iter().enumerate() {
        result.checked += 1;
        let at = format!("event {} (process {})", event.index, event.process.0);
        if event.index != position as u64 {
            result.unknown(format!("{at}: index out of sequence at position {position}"));
        }
        if event.time_ns < previous_ns {
            result.unknown(format!("{at}: time goes back"));
        }
        previous_ns = event.time_ns;
        match event.event_type {
            EventType::Invoke => {
                if retired.contains(&event.process) {
                    result.unknown(format!("{at}: invoke by a process retired by info"));
                }
                if open.insert(event.process, event.f).is_some() {
                    result.unknown(format!("{at}: invoke while an operation is in flight"));
                }
            }
            completion => match open.remove(&event.process) {
                None => result.unknown(format!("{at}: completion without an invoke")),
                Some(function) if function != event.f => {
                    result.unknown(format!("{at}: completes {:?}, invoked {function:?}", event.f));
                }
                Some(_) => {
                    if completion == EventType::Info {
                        retired.insert(event.process);
                    }
                }
            },
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

    fn value() -> OpValue {
        OpValue { account: "account-0".into(), ..OpValue::default() }
    }

    /// A history of paired operations, one retired by `info`, is well-formed.
    #[test]
    fn paired_operations_pass() {
        let mut history = HistoryBuilder::new();
        history
            .push(0, EventType::Invoke, Function::Read, value())
            .push(1, EventType::Invoke, Function::Debit, value())
            .push(0, EventType::Ok, Function::Read, value())
            .push(1, EventType::Info, Function::Debit, value())
            .push(9, EventType::Invoke, Function::Debit, value());
        assert_eq!(check(&history.events).validity, Validity::Valid);
    }

    /// Each way a runner could garble a history is flagged as unknown.
    #[test]
    fn garbled_histories_are_unknown() {
        let cases: Vec<Vec<(u64, EventType, Function)>> = vec![
            // A completion with no invoke.
            vec![(0, EventType::Ok, Function::Read)],
            // Two operations in flight on one process.
            vec![(0, EventType::Invoke, Function::Read), (0, EventType::Invoke, Function::Read)],
            // A completion of another function.
            vec![(0, EventType::Invoke, Function::Read), (0, EventType::Ok, Function::Debit)],
            // A process invoking again after info.
            vec![
                (0, EventType::Invoke, Function::Debit),
                (0, EventType::Info, Function::Debit),
                (0, EventType::Invoke, Function::Read),
            ],
        ];
        for case in cases {
            let mut history = HistoryBuilder::new();
            for (process, event_type, function) in &case {
                history.push(*process, *event_type, *function, value());
            }
            assert_eq!(check(&history.events).validity, Validity::Unknown, "{case:?}");
        }
        let mut history = HistoryBuilder::new();
        history.push(0, EventType::Invoke, Function::Read, value());
        history.push(0, EventType::Ok, Function::Read, value());
        history.events[1].time_ns = 0;
        history.events[0].time_ns = 5;
        assert_eq!(check(&history.events).validity, Validity::Unknown, "time going back");
    }
}

//! A linearizability search in the manner of Wing and Gong, with Lowe's memoisation (the
//! algorithm Knossos and Porcupine run): given operations with the real-time interval in
//! which each took effect and a sequential model, is there an order of them that respects
//! real time (an operation that completed before another was invoked comes first) and in
//! which every observed output is what the model produces? Generic over the model; pure.
//!
//! This file owns the search only. What an operation of quotamesh means (a balance read, a
//! debit) is `linearizable.rs`'s.
//!
//! Unknown operations (`info`: the client never learnt the outcome) complete at infinity: they
//! may take effect at any point after their invoke, or never. The search ends valid as soon
//! as every operation with a known completion is placed: the unknown ones left over are the
//! ones that never took effect.
//!
//! ```text
//!  entries by time:  call(a) call(b) ret(a) call(c) ret(b) ret(c) ... ret(info ops)
//!  scan from the head: a call whose step the model allows is placed (lifted out of the
//!  list, with its return) if (placed set, state) is new; reaching a return means the
//!  operation could not be placed before it completed: undo the last placement.
//! ```
//!
//! The search is exponential in the worst case, so it is bounded: past `steps_max` model
//! steps it gives up and says so ([`Outcome::Unbounded`]), which a checker reports as
//! unknown, never as valid.

use std::collections::HashSet;
use std::hash::Hash;

/// A sequential specification: a state and which operations (with their observed outputs)
/// it admits.
pub trait Model {
    type State: Clone + Eq + Hash;
    type Op;

    /// The state before any operation.
    fn initial(&self) -> Self::State;

    /// The state after `op` takes effect in `state`, if its observed output is what the
    /// model answers there (an operation whose output is unknown constrains nothing but the
    /// step itself).
    fn step(&self, state: &Self::State, op: &Self::Op) -> Option<Self::State>;
}

/// An operation with its real-time interval.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timed<Op> {
    pub invoke_ns: u64,
    /// `None`: unknown (`info`), it may take effect any time after `invoke_ns`, or never.
    pub complete_ns: Option<u64>,
    pub op: Op,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<State> {
    Linearizable,
    /// No order exists. The longest partial order the search built places `placed`
    /// operations and ends in `state`; from there, operation `stuck` (a position in the
    /// input) could be placed before its completion in no way the search tried last.
    NotLinearizable {
        placed: usize,
        state: State,
        stuck: usize,
    },
    /// The search took more than `steps_max` steps: the history is too large to judge.
    Unbounded {
        steps: u64,
    },
}

/// No entry: the end of the list.
const NONE: usize = usize::MAX;
/// The list's head, before every entry.
const HEAD: usize = 0;

/// The call and return entries of every operation in time order, as a doubly linked list
/// from which a placed operation's two entries are lifted and put back (dancing links).
struct Entries {
    next: Vec<usize>,
    previous: Vec<usize>,
    /// The operation (input position) of each entry; the head's is unused.
    op: Vec<usize>,
    is_call: Vec<bool>,
    /// A call entry's return entry.
    partner: Vec<usize>,
}

impl Entries {
    fn new<Op>(ops: &[Timed<Op>]) -> Self {
        // (time, return after call at the same instant, op): calls at an instant come
        // before returns at it, so operations that touch only at an instant are concurrent.
        let mut order: Vec<(u64, bool, usize)> = Vec::with_capacity(ops.len() * 2);
        for (position, timed) in ops.iter().enumerate() {
            order.push((timed.invoke_ns, false, position));
            order.push((timed.complete_ns.unwrap_or(u64::MAX), true, position));
        }
        order.sort_unstable();
        let count = order.len() + 1;
        let mut entries = Self {
            next: (1..=count).map(|next| if next == count { NONE } else { next }).collect(),
            previous: (0..count).map(|entry| entry.wrapping_sub(1)).collect(),
            op: vec![0; count],
            is_call: vec![false; count],
            partner: vec![NONE; count],
        };
        let mut call_of = vec![NONE; ops.len()];
        for (slot, (_, is_return, op)) in order.into_iter().enumerate() {
            let entry = slot + 1;
            entries.op[entry] = op;
            entries.is_call[entry] = !is_return;
            if is_return {
                entries.partner[call_of[op]] = entry;
            } else {
                call_of[op] = entry;
            }
        }
        entries
    }

    fn unlink(&mut self, entry: usize) {
        let (previous, next) = (self.previous[entry], self.next[entry]);
        self.next[previous] = next;
        if next != NONE {
            self.previous[next] = previous;
        }
    }

    fn relink(&mut self, entry: usize) {
        let (previous, next) = (self.previous[entry], self.next[entry]);
        self.next[previous] = entry;
        if next != NONE {
            self.previous[next] = entry;
        }
    }

    /// Takes a call and its return out of the list.
    fn lift(&mut self, call: usize) {
        self.unlink(call);
        self.unlink(self.partner[call]);
    }

    /// Puts them back, in the reverse order.
    fn unlift(&mut self, call: usize) {
        self.relink(self.partner[call]);
        self.relink(call);
    }
}

/// [`Placed`] as the memo keeps it: the first unplaced operation and the placed ones above.
type PlacedKey = (usize, Vec<u32>);

/// The set of placed operations, as a bit set, with a compact key for the memo: operations
/// are numbered in invoke order and placed roughly in that order, so "every operation below
/// `first_unplaced`, and these above it" is short where the bit set is long.
struct Placed {
    words: Vec<u64>,
    first_unplaced: usize,
}

impl Placed {
    fn new(count: usize) -> Self {
        Self { words: vec![0; count.div_ceil(64)], first_unplaced: 0 }
    }

    fn contains(&self, op: usize) -> bool {
        self.words[op / 64] & (1 << (op % 64)) != 0
    }

    fn insert(&mut self, op: usize) {
        self.words[op / 64] |= 1 << (op % 64);
        while self.first_unplaced < self.words.len() * 64 && self.contains(self.first_unplaced) {
            self.first_unplaced += 1;
        }
    }

    fn remove(&mut self, op: usize) {
        self.words[op / 64] &= !(1 << (op % 64));
        self.first_unplaced = self.first_unplaced.min(op);
    }

    /// `first_unplaced` and the placed operations above it.
    fn key(&self) -> PlacedKey {
        let mut above = Vec::new();
        let start = self.first_unplaced + 1;
        for word_position in start / 64..self.words.len() {
            let mut word = self.words[word_position];
            if word_position == start / 64 {
                word &= u64::MAX.checked_shl((start % 64) as u32).unwrap_or(0);
            }
            while word != 0 {
                let bit = word.trailing_zeros() as usize;
                above.push(u32::try_from(word_position * 64 + bit).unwrap_or(u32::MAX));
                word &= word - 1;
            }
        }
        (self.first_unplaced, above)
    }
}

/// Searches for a linearization of `ops` under `model`, taking at most `steps_max` steps.
pub fn check<M: Model>(model: &M, ops: &[Timed<M::Op>], steps_max: u64) -> Outcome<M::State> {
    let mut entries = Entries::new(ops);
    let mut placed = Placed::new(ops.len());
    let mut seen: HashSet<(PlacedKey, M::State)> = HashSet::new();
    // Each placement: its call entry and the state before it.
    let mut stack: Vec<(usize, M::State)> = Vec::new();
    let mut state = model.initial();
    let mut steps = 0_u64;
    let mut furthest: Option<(usize, M::State, usize)> = None;
    let mut entry = entries.next[HEAD];
    loop {
        if entry == NONE {
            // Only reachable with every entry lifted.
            return Outcome::Linearizable;
        }
        let op = entries.op[entry];
        if entries.is_call[entry] {
            steps += 1;
            if steps > steps_max {
                return Outcome::Unbounded { steps: steps_max };
            }
            if let Some(after) = model.step(&state, &ops[op].op) {
                placed.insert(op);
                if seen.insert((placed.key(), after.clone())) {
                    stack.push((entry, std::mem::replace(&mut state, after)));
                    entries.lift(entry);
                    entry = entries.next[HEAD];
                    continue;
                }
                placed.remove(op);
            }
            entry = entries.next[entry];
        } else {
            // The first return in the list: every operation completing earlier is placed.
            if ops[op].complete_ns.is_none() {
                // Unknown operations complete last: the rest never took effect.
                return Outcome::Linearizable;
            }
            if furthest.as_ref().is_none_or(|(depth, _, _)| stack.len() > *depth) {
                furthest = Some((stack.len(), state.clone(), op));
            }
            let Some((call, before)) = stack.pop() else {
                let (placed, state, stuck) = furthest.expect("recorded just above");
                return Outcome::NotLinearizable { placed, state, stuck };
            };
            placed.remove(entries.op[call]);
            state = before;
            entries.unlift(call);
            entry = entries.next[call];
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A register: write a value, or read one.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum RegisterOp {
        Write(u8),
        /// `None`: the read's output is unknown.
        Read(Option<u8>),
    }

    pub(crate) struct Register;

    impl Model for Register {
        type State = u8;
        type Op = RegisterOp;

        fn initial(&self) -> u8 {
            0
        }

        fn step(&self, state: &u8, op: &RegisterOp) -> Option<u8> {
            match op {
                RegisterOp::Write(value) => Some(*value),
                RegisterOp::Read(None) => Some(*state),
                RegisterOp::Read(Some(value)) => (value == state).then_some(*state),
            }
        }
    }

    fn timed(invoke_ns: u64, complete_ns: Option<u64>, op: RegisterOp) -> Timed<RegisterOp> {
        Timed { invoke_ns, complete_ns, op }
    }

    const STEPS: u64 = 1_000_000;

    /// The naive reference: tries every order of every subset containing the operations
    /// that completed, keeping real time, and asks the model about each.
    pub(crate) fn brute_force<M: Model>(model: &M, ops: &[Timed<M::Op>]) -> bool {
        fn extend<M: Model>(
            model: &M,
            ops: &[Timed<M::Op>],
            used: &mut Vec<bool>,
            state: &M::State,
        ) -> bool {
            let unplaced_known = (0..ops.len()).filter(|&op| !used[op]).all(|op| {
                ops[op].complete_ns.is_none() // an unknown one may never take effect
            });
            if unplaced_known {
                return true;
            }
            for op in 0..ops.len() {
                if used[op] {
                    continue;
                }
                // Placeable next only if no unplaced operation completed before it began.
                let blocked = (0..ops.len()).any(|other| {
                    !used[other]
                        && other != op
                        && ops[other].complete_ns.is_some_and(|done| done < ops[op].invoke_ns)
                });
                if blocked {
                    continue;
                }
                if let Some(after) = model.step(state, &ops[op].op) {
                    used[op] = true;
                    let found = extend(model, ops, used, &after);
                    used[op] = false;
                    if found {
                        return true;
                    }
                }
            }
            false
        }
        extend(model, ops, &mut vec![false; ops.len()], &model.initial())
    }

    fn is_linearizable(ops: &[Timed<RegisterOp>]) -> bool {
        match check(&Register, ops, STEPS) {
            Outcome::Linearizable => true,
            Outcome::NotLinearizable { .. } => false,
            Outcome::Unbounded { .. } => panic!("a tiny history exhausted the search"),
        }
    }

    /// Two overlapping writes may take effect in either order, and a read after both may
    /// see either value.
    #[test]
    fn concurrent_writes_in_either_order() {
        for seen in [1, 2] {
            let ops = [
                timed(0, Some(10), RegisterOp::Write(1)),
                timed(1, Some(9), RegisterOp::Write(2)),
                timed(11, Some(12), RegisterOp::Read(Some(seen))),
            ];
            assert!(is_linearizable(&ops), "read {seen}");
        }
    }

    /// A read that begins after a write completed and sees the value before it is flagged.
    #[test]
    fn stale_read_is_flagged() {
        let ops = [
            timed(0, Some(1), RegisterOp::Write(1)),
            timed(2, Some(3), RegisterOp::Write(2)),
            timed(4, Some(5), RegisterOp::Read(Some(1))),
        ];
        assert!(matches!(
            check(&Register, &ops, STEPS),
            Outcome::NotLinearizable { stuck: 2, placed: 2, state: 2 }
        ));
    }

    /// An unknown write may have taken effect at any later time, or never; but not before
    /// it was invoked.
    #[test]
    fn unknown_writes_count_either_way_but_not_before_invoke() {
        let unknown = timed(0, None, RegisterOp::Write(7));
        assert!(is_linearizable(&[unknown.clone(), timed(5, Some(6), RegisterOp::Read(Some(7)))]));
        assert!(is_linearizable(&[unknown, timed(5, Some(6), RegisterOp::Read(Some(0)))]));
        let late = timed(10, None, RegisterOp::Write(7));
        assert!(!is_linearizable(&[late, timed(5, Some(6), RegisterOp::Read(Some(7)))]));
    }

    /// A read of a value no one wrote is flagged; an empty history is linearizable.
    #[test]
    fn invented_value_is_flagged() {
        assert!(!is_linearizable(&[timed(0, Some(1), RegisterOp::Read(Some(9)))]));
        assert!(is_linearizable(&[]));
    }

    /// Past its step bound the search says so instead of guessing.
    #[test]
    fn the_search_is_bounded() {
        let ops: Vec<_> =
            (0..40).map(|value| timed(0, Some(100), RegisterOp::Write(value))).collect();
        let mut last = ops;
        last.push(timed(200, Some(201), RegisterOp::Read(Some(99))));
        assert_eq!(check(&Register, &last, 1_000), Outcome::Unbounded { steps: 1_000 });
    }

    fn history() -> impl Strategy<Value = Vec<Timed<RegisterOp>>> {
        let op = prop_oneof![
            (0_u8..3).prop_map(RegisterOp::Write),
            prop::option::of(0_u8..3).prop_map(RegisterOp::Read),
        ];
        prop::collection::vec((0_u64..20, 1_u64..8, any::<bool>(), op), 0..7).prop_map(|ops| {
            ops.into_iter()
                .map(|(invoke_ns, length, unknown, op)| {
                    let complete_ns = (!unknown).then_some(invoke_ns + length);
                    timed(invoke_ns, complete_ns, op)
                })
                .collect()
        })
    }

    proptest! {
        /// The search agrees with trying every order, on small random histories.
        #[test]
        fn agrees_with_brute_force(ops in history()) {
            prop_assert_eq!(is_linearizable(&ops), brute_force(&Register, &ops));
        }

        /// A history made by running the model in some order, each operation's interval
        /// containing its moment, with some operations unknown (taken effect or not), is
        /// linearizable.
        #[test]
        fn executions_are_linearizable(
            steps in prop::collection::vec((0_u8..4, any::<bool>(), 0_u64..30, 0_u64..30, 0_u8..3), 0..60),
        ) {
            let mut state = 0;
            let mut ops = Vec::new();
            for (moment, (value, is_write, before, after, fate)) in steps.into_iter().enumerate() {
                let moment = moment as u64 * 10 + 50;
                let (effect, op) = if is_write {
                    (Some(value), RegisterOp::Write(value))
                } else {
                    (None, RegisterOp::Read(Some(state)))
                };
                // fate 0: unknown and never took effect; 1: unknown and took effect; 2: ok.
                if fate != 0 || !is_write {
                    state = effect.unwrap_or(state);
                }
                let complete_ns = (fate == 2 || !is_write).then_some(moment + after);
                ops.push(timed(moment - before, complete_ns, op));
            }
            prop_assert!(is_linearizable(&ops));
        }
    }
}

//! Values that many holders share, each kept once and named by a 32-bit id, with a count of
//! its holders: what a shard's stripe keeps its keys' limits in.
//!
//! A stripe's keys follow a handful of limits, so a key holds the id of its limit (4 bytes)
//! rather than the limit (20). An id lives while a holder does: [`Interner::acquire`]
//! counts one more holder, [`Interner::release`] one fewer, and the last release frees the
//! id for a later value. The values are hashed with a process-random key, since a request
//! may carry a limit of its own.

use std::collections::HashMap;
use std::hash::Hash;

/// Values by id, with their holder counts (see the module docs).
#[derive(Debug)]
pub struct Interner<T> {
    /// Each id's value and its holders; `None` for a freed id.
    values: Vec<Option<(T, u32)>>,
    /// Freed ids, reused before the vector grows.
    free: Vec<u32>,
    ids: HashMap<T, u32>,
}

impl<T> Default for Interner<T> {
    fn default() -> Self {
        Self { values: Vec::new(), free: Vec::new(), ids: HashMap::new() }
    }
}

impl<T: Copy + Eq + Hash> Interner<T> {
    /// The id of `value`, counting one more holder of it.
    ///
    /// # Panics
    /// When `u32::MAX` values are held at once, or one value by `u32::MAX` holders (a
    /// stripe holds far fewer keys).
    pub fn acquire(&mut self, value: T) -> u32 {
        if let Some(&id) = self.ids.get(&value) {
            let (_, holders) = self.values[id as usize].as_mut().expect("an indexed id is live");
            *holders = holders.checked_add(1).expect("fewer than u32::MAX holders");
            return id;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.values.push(None);
                u32::try_from(self.values.len() - 1).expect("fewer than u32::MAX values")
            }
        };
        self.values[id as usize] = Some((value, 1));
        self.ids.insert(value, id);
        id
    }

    /// The value of a held id.
    ///
    /// # Panics
    /// When `id` is not held: a caller's bookkeeping bug.
    pub fn get(&self, id: u32) -> T {
        self.values[id as usize].expect("a held id").0
    }

    /// Counts one holder of `id` fewer, freeing the id with its last holder.
    ///
    /// # Panics
    /// When `id` is not held.
    pub fn release(&mut self, id: u32) {
        let entry = &mut self.values[id as usize];
        let (value, holders) = entry.as_mut().expect("a held id");
        *holders -= 1;
        if *holders == 0 {
            self.ids.remove(value);
            *entry = None;
            self.free.push(id);
        }
    }

    /// The number of distinct values held.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True when no value is held.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_value_keeps_its_id_while_held_and_a_freed_id_is_reused() {
        let mut interner = Interner::default();
        let seven = interner.acquire(7_u8);
        assert_eq!(interner.acquire(7), seven);
        let eight = interner.acquire(8);
        assert_ne!(seven, eight);
        interner.release(seven);
        assert_eq!(interner.get(seven), 7, "one holder is left");
        interner.release(seven);
        assert_eq!(interner.len(), 1);
        assert_eq!(interner.acquire(9), seven, "the freed id, not a new one");
        assert_eq!((interner.get(seven), interner.get(eight)), (9, 8));
    }

    proptest! {
        /// Against a model of holders (a list of (id, value) per holder): every held id
        /// reads its value, distinct held values have distinct ids, and the interner holds
        /// exactly the distinct values held, in no more ids than it ever held at once.
        #[test]
        fn ids_follow_their_holders(
            steps in prop::collection::vec((any::<bool>(), 0_u8..6, any::<prop::sample::Index>()), 1..200),
        ) {
            let mut interner = Interner::default();
            let mut holders: Vec<(u32, u8)> = Vec::new();
            let mut most_held = 0;
            for (acquire, value, which) in steps {
                if acquire || holders.is_empty() {
                    holders.push((interner.acquire(value), value));
                } else {
                    let (id, _) = holders.swap_remove(which.index(holders.len()));
                    interner.release(id);
                }
                let mut distinct: Vec<u8> = holders.iter().map(|&(_, value)| value).collect();
                distinct.sort_unstable();
                distinct.dedup();
                most_held = most_held.max(distinct.len());
                prop_assert_eq!(interner.len(), distinct.len());
                prop_assert!(interner.values.len() <= most_held);
                for &(id, value) in &holders {
                    prop_assert_eq!(interner.get(id), value);
                }
                for &(id, value) in &holders {
                    for &(other_id, other_value) in &holders {
                        prop_assert_eq!(id == other_id, value == other_value);
                    }
                }
            }
        }
    }
}

//! A hash map whose entries sit side by side in one vector, found through a table of their
//! 32-bit positions: what a shard's stripe keeps its tracked keys in.
//!
//! A hash table is between half and seven eighths full, so a table of whole entries pays for
//! up to one empty entry per key, and a table of pointers to boxed entries pays a pointer, an
//! allocation's header and its rounding. Here a table bucket costs 5 bytes (a position and a
//! control byte) and an entry exactly its size. Removing an entry moves the last one into its
//! place, so the vector stays dense and entries do not keep their positions.
//!
//! An entry holds its own key ([`Keyed`]), so a key whose alignment is smaller than the
//! rest of the entry fills room the entry would otherwise pad.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// Below this many entries' room a map never gives memory back: a stripe that holds a key
/// or two would otherwise shrink at one sweep and grow again at its next key.
const SHRINK_ABOVE_ENTRIES: usize = 64;

/// An entry that carries the key it is found by.
pub trait Keyed {
    /// The key.
    type Key: Hash + Eq;

    /// The entry's key.
    fn key(&self) -> &Self::Key;
}

/// A `(key, value)` pair is keyed by its first half.
impl<K: Hash + Eq, V> Keyed for (K, V) {
    type Key = K;

    fn key(&self) -> &K {
        &self.0
    }
}

/// A map of at most `u32::MAX` entries, stored densely (see the module docs).
#[derive(Debug, Clone)]
pub struct DenseMap<E, S> {
    /// Positions in `entries`, hashed by the key they hold.
    positions: HashTable<u32>,
    entries: Vec<E>,
    hasher: S,
}

impl<E, S: Default> Default for DenseMap<E, S> {
    fn default() -> Self {
        Self { positions: HashTable::new(), entries: Vec::new(), hasher: S::default() }
    }
}

impl<E: Keyed, S: BuildHasher> DenseMap<E, S> {
    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the map holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry of `key`.
    pub fn get(&self, key: &E::Key) -> Option<&E> {
        let position = self.position_of(key)?;
        Some(&self.entries[position])
    }

    /// The entry of `key`, to change (but for its key).
    pub fn get_mut(&mut self, key: &E::Key) -> Option<&mut E> {
        let position = self.position_of(key)?;
        Some(&mut self.entries[position])
    }

    /// Adds `entry`, returning the entry of the same key it replaced.
    ///
    /// # Panics
    /// When the map already holds `u32::MAX` entries (its callers bound it far lower).
    pub fn insert(&mut self, entry: E) -> Option<E> {
        let hash = self.hasher.hash_one(entry.key());
        if let Some(position) = self.position_hashed(hash, entry.key()) {
            return Some(std::mem::replace(&mut self.entries[position], entry));
        }
        let position =
            u32::try_from(self.entries.len()).expect("a dense map holds at most u32::MAX entries");
        let Self { positions, entries, hasher } = self;
        positions.insert_unique(hash, position, |&at| hasher.hash_one(entries[at as usize].key()));
        entries.push(entry);
        None
    }

    /// Removes the entry of `key`.
    pub fn remove(&mut self, key: &E::Key) -> Option<E> {
        let hash = self.hasher.hash_one(key);
        let entries = &self.entries;
        let found =
            self.positions.find_entry(hash, |&at| entries[at as usize].key() == key).ok()?;
        let (position, _) = found.remove();
        Some(self.take(position as usize))
    }

    /// Keeps only the entries for which `keep` is true, then gives back memory once a
    /// quarter or less of what the map holds room for is in use (past a small floor).
    /// `keep` must not change an entry's key.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut E) -> bool) {
        let mut position = 0;
        while position < self.entries.len() {
            if keep(&mut self.entries[position]) {
                position += 1;
                continue;
            }
            let hash = self.hasher.hash_one(self.entries[position].key());
            let at = u32::try_from(position).expect("positions fit u32");
            let found = self.positions.find_entry(hash, |&stored| stored == at);
            found.expect("every entry's position is in the table").remove();
            // The last entry moves here: look at this position again.
            self.take(position);
        }
        let room = self.entries.capacity();
        if room > SHRINK_ABOVE_ENTRIES && self.entries.len() <= room / 4 {
            self.entries.shrink_to_fit();
            let Self { positions, entries, hasher } = self;
            positions.shrink_to_fit(|&at| hasher.hash_one(entries[at as usize].key()));
        }
    }

    /// The entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &E> {
        self.entries.iter()
    }

    /// The entries, starting at the `start`-th (modulo their number) and wrapping around:
    /// for a caller that samples a few entries and moves its start on.
    pub fn iter_from(&self, start: usize) -> impl Iterator<Item = &E> {
        let start = start.checked_rem(self.entries.len()).unwrap_or(0);
        let (before, after) = self.entries.split_at(start);
        after.iter().chain(before)
    }

    fn position_of(&self, key: &E::Key) -> Option<usize> {
        self.position_hashed(self.hasher.hash_one(key), key)
    }

    fn position_hashed(&self, hash: u64, key: &E::Key) -> Option<usize> {
        let entries = &self.entries;
        let found = self.positions.find(hash, |&at| entries[at as usize].key() == key)?;
        Some(*found as usize)
    }

    /// Takes the entry at `position`, whose position has already left the table, moving
    /// the last entry into its place.
    fn take(&mut self, position: usize) -> E {
        let entry = self.entries.swap_remove(position);
        if let Some(moved) = self.entries.get(position) {
            let from = u32::try_from(self.entries.len()).expect("positions fit u32");
            let hash = self.hasher.hash_one(moved.key());
            let stored = self.positions.find_mut(hash, |&stored| stored == from);
            *stored.expect("every entry's position is in the table") =
                u32::try_from(position).expect("positions fit u32");
        }
        entry
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::hash::{BuildHasherDefault, Hasher};

    use proptest::prelude::*;

    use super::*;

    /// Sends every key to one hash, so every lookup walks collisions.
    #[derive(Default)]
    struct Colliding;

    impl Hasher for Colliding {
        fn finish(&self) -> u64 {
            7
        }
        fn write(&mut self, _bytes: &[u8]) {}
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u32),
        Remove(u8),
        Get(u8),
        Bump(u8),
        RetainOdd,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..48u8, any::<u32>()).prop_map(|(key, value)| Op::Insert(key, value)),
            2 => (0..48u8).prop_map(Op::Remove),
            2 => (0..48u8).prop_map(Op::Get),
            1 => (0..48u8).prop_map(Op::Bump),
            1 => Just(Op::RetainOdd),
        ]
    }

    /// Runs `ops` on a dense map and on std's map, which must agree at every step.
    fn agrees_with_std<S: BuildHasher>(mut dense: DenseMap<(u8, u32), S>, ops: &[Op]) {
        let mut model: HashMap<u8, u32> = HashMap::new();
        for op in ops {
            match *op {
                Op::Insert(key, value) => {
                    let replaced = dense.insert((key, value)).map(|(_, value)| value);
                    assert_eq!(replaced, model.insert(key, value));
                }
                Op::Remove(key) => {
                    assert_eq!(dense.remove(&key).map(|(_, value)| value), model.remove(&key));
                }
                Op::Get(key) => {
                    assert_eq!(dense.get(&key).map(|(_, value)| value), model.get(&key))
                }
                Op::Bump(key) => {
                    if let Some((_, value)) = dense.get_mut(&key) {
                        *value = value.wrapping_add(1);
                    }
                    if let Some(value) = model.get_mut(&key) {
                        *value = value.wrapping_add(1);
                    }
                }
                Op::RetainOdd => {
                    dense.retain(|(_, value)| *value % 2 == 1);
                    model.retain(|_, value| *value % 2 == 1);
                }
            }
            assert_eq!(dense.len(), model.len());
            let mut held: Vec<(u8, u32)> = dense.iter().copied().collect();
            held.sort_unstable();
            let mut expected: Vec<(u8, u32)> = model.iter().map(|(&k, &v)| (k, v)).collect();
            expected.sort_unstable();
            assert_eq!(held, expected);
        }
    }

    proptest! {
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec(op(), 0..300)) {
            agrees_with_std(DenseMap::<(u8, u32), std::hash::RandomState>::default(), &ops);
        }

        #[test]
        fn behaves_as_a_map_when_every_key_collides(
            ops in proptest::collection::vec(op(), 0..300),
        ) {
            agrees_with_std(DenseMap::<(u8, u32), BuildHasherDefault<Colliding>>::default(), &ops);
        }
    }

    #[test]
    fn iter_from_starts_anywhere_and_wraps_around() {
        let mut map = DenseMap::<(u32, u32), std::hash::RandomState>::default();
        for key in 0..5 {
            map.insert((key, key));
        }
        let keys = |start| map.iter_from(start).map(|&(key, _)| key).collect::<Vec<_>>();
        assert_eq!(keys(0), [0, 1, 2, 3, 4]);
        assert_eq!(keys(3), [3, 4, 0, 1, 2]);
        assert_eq!(keys(7), [2, 3, 4, 0, 1]);
        assert_eq!(
            DenseMap::<(u32, u32), std::hash::RandomState>::default().iter_from(3).count(),
            0
        );
    }

    #[test]
    fn retain_gives_memory_back_once_most_entries_are_gone() {
        let mut map = DenseMap::<(u32, u64), std::hash::RandomState>::default();
        for key in 0..10_000 {
            map.insert((key, u64::from(key)));
        }
        map.retain(|&mut (key, _)| key < 100);
        assert_eq!(map.len(), 100);
        assert!(map.entries.capacity() < 1_000, "capacity {}", map.entries.capacity());
        assert!(map.positions.capacity() < 1_000, "buckets {}", map.positions.capacity());
        assert_eq!(map.get(&99), Some(&(99, 99)));
        assert_eq!(map.get(&100), None);

        // A small map keeps its room: it would only grow again at its next entries.
        let mut small = DenseMap::<(u32, u64), std::hash::RandomState>::default();
        for key in 0..32 {
            small.insert((key, u64::from(key)));
        }
        small.retain(|&mut (key, _)| key == 0);
        assert!(small.entries.capacity() >= 32, "capacity {}", small.entries.capacity());
    }
}

//! A hash map whose entries sit side by side in one vector, found through a table of their
//! 32-bit positions: what a shard's stripe keeps its tracked keys in.
//!
//! A hash table is between half and seven eighths full, so a table of whole entries pays for
//! up to one empty entry per key, and a table of pointers to boxed entries pays a pointer, an
//! allocation's header and its rounding. Here a table bucket costs 5 bytes (a position and a
//! control byte) and an entry exactly its size. Removing an entry moves the last one into its
//! place, so the vector stays dense and entries do not keep their positions.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

/// Below this many entries' room a map never gives memory back: a stripe that holds a key
/// or two would otherwise shrink at one sweep and grow again at its next key.
const SHRINK_ABOVE_ENTRIES: usize = 64;

/// A map of at most `u32::MAX` entries, stored densely (see the module docs).
#[derive(Debug, Clone)]
pub struct DenseMap<K, V, S> {
    /// Positions in `entries`, hashed by the key they hold.
    positions: HashTable<u32>,
    entries: Vec<(K, V)>,
    hasher: S,
}

impl<K, V, S: Default> Default for DenseMap<K, V, S> {
    fn default() -> Self {
        Self { positions: HashTable::new(), entries: Vec::new(), hasher: S::default() }
    }
}

impl<K: Hash + Eq, V, S: BuildHasher> DenseMap<K, V, S> {
    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the map holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<&V> {
        let position = self.position_of(key)?;
        Some(&self.entries[position].1)
    }

    /// The value of `key`, to change.
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        let position = self.position_of(key)?;
        Some(&mut self.entries[position].1)
    }

    /// Sets `key` to `value`, returning the value it replaced.
    ///
    /// # Panics
    /// When the map already holds `u32::MAX` entries (its callers bound it far lower).
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let hash = self.hasher.hash_one(&key);
        if let Some(position) = self.position_hashed(hash, &key) {
            return Some(std::mem::replace(&mut self.entries[position].1, value));
        }
        let position =
            u32::try_from(self.entries.len()).expect("a dense map holds at most u32::MAX entries");
        let Self { positions, entries, hasher } = self;
        positions.insert_unique(hash, position, |&at| hasher.hash_one(&entries[at as usize].0));
        entries.push((key, value));
        None
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let hash = self.hasher.hash_one(key);
        let entries = &self.entries;
        let found = self.positions.find_entry(hash, |&at| entries[at as usize].0 == *key).ok()?;
        let (position, _) = found.remove();
        Some(self.take(position as usize))
    }

    /// Keeps only the entries for which `keep` is true, then gives back memory once a
    /// quarter or less of what the map holds room for is in use (past a small floor).
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        let mut position = 0;
        while position < self.entries.len() {
            let (key, value) = &mut self.entries[position];
            if keep(key, value) {
                position += 1;
                continue;
            }
            let hash = self.hasher.hash_one(&self.entries[position].0);
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
            positions.shrink_to_fit(|&at| hasher.hash_one(&entries[at as usize].0));
        }
    }

    /// The entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.entries.iter().map(|(key, value)| (key, value))
    }

    /// The entries, starting at the `start`-th (modulo their number) and wrapping around:
    /// for a caller that samples a few entries and moves its start on.
    pub fn iter_from(&self, start: usize) -> impl Iterator<Item = (&K, &V)> {
        let start = start.checked_rem(self.entries.len()).unwrap_or(0);
        let (before, after) = self.entries.split_at(start);
        after.iter().chain(before).map(|(key, value)| (key, value))
    }

    /// The values, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, value)| value)
    }

    fn position_of(&self, key: &K) -> Option<usize> {
        self.position_hashed(self.hasher.hash_one(key), key)
    }

    fn position_hashed(&self, hash: u64, key: &K) -> Option<usize> {
        let entries = &self.entries;
        let found = self.positions.find(hash, |&at| entries[at as usize].0 == *key)?;
        Some(*found as usize)
    }

    /// Takes the entry at `position`, whose position has already left the table, moving
    /// the last entry into its place.
    fn take(&mut self, position: usize) -> V {
        let (_, value) = self.entries.swap_remove(position);
        if let Some((moved, _)) = self.entries.get(position) {
            let from = u32::try_from(self.entries.len()).expect("positions fit u32");
            let hash = self.hasher.hash_one(moved);
            let stored = self.positions.find_mut(hash, |&stored| stored == from);
            *stored.expect("every entry's position is in the table") =
                u32::try_from(position).expect("positions fit u32");
        }
        value
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
    fn agrees_with_std<S: BuildHasher>(mut dense: DenseMap<u8, u32, S>, ops: &[Op]) {
        let mut model: HashMap<u8, u32> = HashMap::new();
        for op in ops {
            match *op {
                Op::Insert(key, value) => {
                    assert_eq!(dense.insert(key, value), model.insert(key, value));
                }
                Op::Remove(key) => assert_eq!(dense.remove(&key), model.remove(&key)),
                Op::Get(key) => assert_eq!(dense.get(&key), model.get(&key)),
                Op::Bump(key) => {
                    if let Some(value) = dense.get_mut(&key) {
                        *value = value.wrapping_add(1);
                    }
                    if let Some(value) = model.get_mut(&key) {
                        *value = value.wrapping_add(1);
                    }
                }
                Op::RetainOdd => {
                    dense.retain(|_, value| *value % 2 == 1);
                    model.retain(|_, value| *value % 2 == 1);
                }
            }
            assert_eq!(dense.len(), model.len());
            let mut held: Vec<(u8, u32)> = dense.iter().map(|(&k, &v)| (k, v)).collect();
            held.sort_unstable();
            let mut expected: Vec<(u8, u32)> = model.iter().map(|(&k, &v)| (k, v)).collect();
            expected.sort_unstable();
            assert_eq!(held, expected);
        }
    }

    proptest! {
        #[test]
        fn behaves_as_a_map(ops in proptest::collection::vec(op(), 0..300)) {
            agrees_with_std(DenseMap::<u8, u32, std::hash::RandomState>::default(), &ops);
        }

        #[test]
        fn behaves_as_a_map_when_every_key_collides(
            ops in proptest::collection::vec(op(), 0..300),
        ) {
            agrees_with_std(DenseMap::<u8, u32, BuildHasherDefault<Colliding>>::default(), &ops);
        }
    }

    #[test]
    fn iter_from_starts_anywhere_and_wraps_around() {
        let mut map = DenseMap::<u32, u32, std::hash::RandomState>::default();
        for key in 0..5 {
            map.insert(key, key);
        }
        let keys = |start| map.iter_from(start).map(|(&key, _)| key).collect::<Vec<_>>();
        assert_eq!(keys(0), [0, 1, 2, 3, 4]);
        assert_eq!(keys(3), [3, 4, 0, 1, 2]);
        assert_eq!(keys(7), [2, 3, 4, 0, 1]);
        assert_eq!(DenseMap::<u32, u32, std::hash::RandomState>::default().iter_from(3).count(), 0);
    }

    #[test]
    fn retain_gives_memory_back_once_most_entries_are_gone() {
        let mut map = DenseMap::<u32, u64, std::hash::RandomState>::default();
        for key in 0..10_000 {
            map.insert(key, u64::from(key));
        }
        map.retain(|&key, _| key < 100);
        assert_eq!(map.len(), 100);
        assert!(map.entries.capacity() < 1_000, "capacity {}", map.entries.capacity());
        assert!(map.positions.capacity() < 1_000, "buckets {}", map.positions.capacity());
        assert_eq!(map.get(&99), Some(&99));
        assert_eq!(map.get(&100), None);

        // A small map keeps its room: it would only grow again at its next entries.
        let mut small = DenseMap::<u32, u64, std::hash::RandomState>::default();
        for key in 0..32 {
            small.insert(key, u64::from(key));
        }
        small.retain(|&key, _| key == 0);
        assert!(small.entries.capacity() >= 32, "capacity {}", small.entries.capacity());
    }
}

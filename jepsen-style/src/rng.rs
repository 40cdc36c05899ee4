//! The suite's one source of randomness: a seeded SplitMix64 generator, so the same seed
//! draws the same schedule of operations and faults on every machine and Rust version
//! (a library generator may change its stream between releases).

/// A deterministic generator of `u64`s from a seed.
#[derive(Debug, Clone)]
pub struct SeededRng {
    state: u64,
}

impl SeededRng {
    /// A generator whose whole stream is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// An independent stream for one consumer (a worker, the nemesis), so adding draws to
    /// one consumer leaves the others' schedules unchanged.
    pub fn fork(seed: u64, stream: u64) -> Self {
        let mut mixer = Self::new(seed ^ stream.wrapping_mul(0xD605_BBB5_8C8A_BBD5));
        Self::new(mixer.next_u64())
    }

    /// The next value (SplitMix64: a Weyl sequence passed through a bit mixer).
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.state;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// Uniform in `low..=high` (`low` when the range is empty). The modulo bias is below
    /// 2^-40 for the small ranges the suite draws from.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        let span = high - low;
        match span.checked_add(1) {
            Some(count) => low + self.next_u64() % count,
            None => self.next_u64(),
        }
    }

    /// An index into a slice of `length` items (`length` > 0).
    pub fn index(&mut self, length: usize) -> usize {
        let last = u64::try_from(length.saturating_sub(1)).unwrap_or(u64::MAX);
        usize::try_from(self.between(0, last)).unwrap_or(0)
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.between(0, 99) < percent
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The same seed gives the same stream; `between` stays in its range.
        #[test]
        fn same_seed_same_stream(seed: u64, low in 0_u64..1000, width in 0_u64..1000) {
            let mut first = SeededRng::new(seed);
            let mut second = SeededRng::new(seed);
            for _ in 0..32 {
                let drawn = first.between(low, low + width);
                prop_assert_eq!(drawn, second.between(low, low + width));
                prop_assert!(drawn >= low && drawn <= low + width);
            }
        }
    }

    /// Different streams of one seed differ (a fork that ignored its stream would not).
    #[test]
    fn forks_differ() {
        let first: Vec<u64> = (0..4).map(|_| SeededRng::fork(42, 1).next_u64()).collect();
        let mut other = SeededRng::fork(42, 2);
        assert_ne!(first[0], other.next_u64());
    }
}

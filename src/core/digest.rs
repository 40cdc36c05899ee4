//! State digests that replicas compare: 64-bit FNV-1a over postcard encodings.
//!
//! FNV-1a is tiny and stable across platforms and versions (unlike `std::hash`, whose
//! `RandomState` differs per process), which is all a "do these replicas agree" check needs.
//! The quota and billing ledgers use it; the policy set has its own typed fingerprint
//! (`policy/digest.rs`).

use serde::Serialize;

/// A 64-bit FNV-1a hasher.
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    /// Mixes in raw bytes.
    pub fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Mixes in a value's postcard encoding, length first so adjacent values cannot run
    /// into each other.
    ///
    /// # Panics
    /// Never for the ledgers' types: postcard encodes plain data into a `Vec` without error.
    pub fn write_encoded<T: Serialize>(&mut self, value: &T) {
        let bytes = postcard::to_allocvec(value).expect("postcard encodes plain data into a Vec");
        self.write(&(bytes.len() as u64).to_le_bytes());
        self.write(&bytes);
    }

    /// The digest so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64 test vectors: the empty input and "a".
    #[test]
    fn matches_reference_vectors() {
        assert_eq!(Fnv1a::default().finish(), 0xcbf2_9ce4_8422_2325);
        let mut digest = Fnv1a::default();
        digest.write(b"a");
        assert_eq!(digest.finish(), 0xaf63_dc4c_8601_ec8c);
    }
}

//! The name of a counter in the regional ledger: the same on every node of the region.
//!
//! A shard identifies a counter by a process-random keyed hash (hash flooding cannot aim at
//! one process's maps), which differs between nodes; the ledger needs a name every node
//! computes alike. That name is a SHA-256 digest of the counter's identity, cut to 128 bits
//! (a collision between two of a region's counters practically impossible, and no client
//! can find one that names another's counter), so a shard slot holds 16 bytes instead of
//! the descriptor's strings, and the ledger key has a fixed length however long the
//! descriptor: `rl:` and 32 hex digits.
//!
//! The identity is the domain, the descriptor's entries in order, the limit's position in
//! its rule and the limit's numbers: a changed limit names a new counter, as it does in the
//! shard (`crate::actors::shard::ShardSet::counter_of`).

use sha2::{Digest, Sha256};

use crate::core::ledger::KEY_PREFIX;
use crate::core::rate::LimitSpec;

/// Domain separation: a future change of the encoding names every counter anew.
const CONTEXT: &[u8] = b"quotamesh.lease-key.v1";

/// A counter's name in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey([u8; 16]);

impl LeaseKey {
    /// The name of the `limit_index`-th limit `spec` on the descriptor `entries` of `domain`.
    pub fn of<'e>(
        domain: &str,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
        limit_index: usize,
        spec: &LimitSpec,
    ) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(CONTEXT);
        // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
        let mut field = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        };
        field(domain.as_bytes());
        for (key, value) in entries {
            field(key.as_bytes());
            field(value.as_bytes());
        }
        field(&(limit_index as u64).to_le_bytes());
        field(&[spec.algorithm as u8]);
        field(&spec.requests_per_window.to_le_bytes());
        field(&spec.window_ms.to_le_bytes());
        field(&spec.burst_tokens.to_le_bytes());
        let digest = hasher.finalize();
        let mut name = [0_u8; 16];
        name.copy_from_slice(&digest[..16]);
        Self(name)
    }

    /// The ledger key: `rl:` and 32 lowercase hex digits.
    pub fn ledger_key(&self) -> String {
        use std::fmt::Write as _;
        let mut key = String::with_capacity(KEY_PREFIX.len() + 32);
        key.push_str(KEY_PREFIX);
        for byte in self.0 {
            // Writing into a String cannot fail.
            let _ = write!(key, "{byte:02x}");
        }
        key
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::core::ledger::{KEY_BYTES_MAX, LeaseRequest, check_lease_request};
    use crate::core::rate::Algorithm;

    fn spec(requests: u64) -> LimitSpec {
        LimitSpec::new(Algorithm::TokenBucket, requests, 1_000, None).expect("a valid limit")
    }

    /// The same counter gets the same name; any part of its identity changes it; the key is
    /// a valid ledger key of fixed length.
    #[test]
    fn names_are_stable_and_distinct() {
        let name = |domain: &str, entries: &[(&str, &str)], index, requests| {
            LeaseKey::of(domain, entries.iter().copied(), index, &spec(requests))
        };
        let base = name("d", &[("k", "v")], 0, 10);
        assert_eq!(base, name("d", &[("k", "v")], 0, 10));
        for other in [
            name("e", &[("k", "v")], 0, 10),
            name("d", &[("k", "w")], 0, 10),
            name("d", &[("kv", "")], 0, 10),
            name("d", &[("k", "v"), ("a", "b")], 0, 10),
            name("d", &[("k", "v")], 1, 10),
            name("d", &[("k", "v")], 0, 11),
        ] {
            assert_ne!(base, other);
        }
        let key = base.ledger_key();
        assert_eq!(key.len(), 35);
        assert!(key.starts_with("rl:"));
        let request = LeaseRequest { key, limit: spec(10), tokens_wanted: 1, lease_ttl_ms: 500 };
        assert_eq!(check_lease_request(&request), Ok(()));
    }

    proptest! {
        /// Whatever the descriptor's size, the ledger key fits the ledger's bound.
        #[test]
        fn keys_fit_the_ledger(domain in ".{0,64}", value in ".{0,2048}") {
            let key = LeaseKey::of(&domain, [("k", value.as_str())].into_iter(), 0, &spec(1))
                .ledger_key();
            prop_assert!(key.len() <= KEY_BYTES_MAX);
            prop_assert!(key.bytes().skip(3).all(|byte| byte.is_ascii_hexdigit()));
        }
    }
}

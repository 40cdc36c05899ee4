//! The policy set fingerprint: FNV-1a 64 over a canonical, length-prefixed encoding.
//!
//! `std::hash` is no fit: `RandomState` differs per process, and `Hash` for integers writes
//! native-endian bytes. Nodes compare digests to tell whether they run the same policies,
//! so every number here is written little-endian and every string with its length.
//! `load.rs` decides what goes in; this file only encodes.

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// An FNV-1a 64 hasher with typed writes.
pub(super) struct Fingerprint {
    state: u64,
}

impl Fingerprint {
    pub(super) fn new() -> Self {
        Self { state: FNV_OFFSET_BASIS }
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.state ^= u64::from(*byte);
            self.state = self.state.wrapping_mul(FNV_PRIME);
        }
    }

    /// A one-byte tag that says what the next fields are.
    pub(super) fn tag(&mut self, tag: u8) {
        self.bytes(&[tag]);
    }

    pub(super) fn u64(&mut self, value: u64) {
        self.bytes(&value.to_le_bytes());
    }

    /// A count or an index.
    pub(super) fn len(&mut self, value: usize) {
        self.u64(u64::try_from(value).unwrap_or(u64::MAX));
    }

    pub(super) fn bool(&mut self, value: bool) {
        self.tag(u8::from(value));
    }

    /// A string with its length first, so `("ab", "c")` and `("a", "bc")` differ.
    pub(super) fn str(&mut self, value: &str) {
        self.len(value.len());
        self.bytes(value.as_bytes());
    }

    pub(super) fn option_str(&mut self, value: Option<&str>) {
        match value {
            None => self.tag(0),
            Some(value) => {
                self.tag(1);
                self.str(value);
            }
        }
    }

    pub(super) fn finish(&self) -> u64 {
        self.state
    }
}

/// The digest of a set without domains, the same whether built by `Default` or by parsing
/// no files.
pub(super) fn empty_set() -> u64 {
    Fingerprint::new().finish()
}

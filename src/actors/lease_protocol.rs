//! What the shard actors and the lease broker say to each other.
//!
//! A shard hands the broker a [`LeaseAsk`]: one key's report (`crate::core::lease`
//! drafts it: totals spent and held, tokens wanted) with the route of its answer. The broker
//! batches asks from every shard into one `SettleLeases` command and sends each answer back
//! as [`LeaseAnswers`] to the shard that asked. Both sides use this module and neither
//! imports the other: the broker knows a shard only as a [`DerivedActorRef`] that accepts
//! answers.

use std::hash::{Hash, Hasher};

use ractor::DerivedActorRef;

use crate::core::lease::{LeaseTuning, ReportAnswer, ReportDraft};
use crate::core::lease_key::LeaseKey;
use crate::core::ledger::{LeaseEpoch, LeaseReport};
use crate::core::rate::LimitSpec;

/// 96-bit fingerprint of one counter: (domain, descriptor entries, limit), a keyed hash.
///
/// 96 bits make a collision between two of a node's counters practically impossible (about
/// 1e-17 for a million keys, 1e-15 for ten million; the hash key is process-random, so no
/// client can aim at another's counter), so the key strings need not be stored. Three
/// 32-bit words, not two 64-bit ones: the key fills the last 12 bytes of its slot, where
/// 64-bit words would cost 4 bytes of padding more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterKey([u32; 3]);

impl CounterKey {
    /// The key of a 128-bit keyed hash `(first, second)`: its first 96 bits.
    pub fn from_hash(first: u64, second: u64) -> Self {
        // Truncations: the words are cut into halves, the last one dropped.
        Self([first as u32, (first >> 32) as u32, second as u32])
    }
}

impl Hash for CounterKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already a keyed hash: one word is all the map needs.
        state.write_u64(u64::from(self.0[0]) | (u64::from(self.0[1]) << 32));
    }
}

/// One key's report for the ledger, and where its answer goes.
#[derive(Debug)]
pub struct LeaseAsk {
    /// The shard actor that owns the key.
    pub reply_to: DerivedActorRef<LeaseAnswers>,
    /// The key's stripe in that shard.
    pub stripe: u32,
    /// The key in the shard.
    pub counter: CounterKey,
    /// The key's life on this node (its slot): an answer for another life is not applied.
    pub epoch: LeaseEpoch,
    /// The key in the ledger.
    pub lease_key: LeaseKey,
    /// The limit the ledger's bucket follows.
    pub spec: LimitSpec,
    /// The rule's lease settings (TTL, lookahead, expiry margin).
    pub tuning: LeaseTuning,
    /// What the report says, and when it was sent.
    pub draft: ReportDraft,
}

impl LeaseAsk {
    /// The report as the ledger reads it.
    pub fn report(&self) -> LeaseReport {
        LeaseReport {
            key: self.lease_key.ledger_key(),
            limit: self.spec,
            epoch: self.epoch,
            seq: self.draft.seq,
            spent_tokens: self.draft.spent_tokens,
            held_tokens: self.draft.held_tokens,
            settled_tokens: self.draft.settled_tokens,
            tokens_wanted: self.draft.tokens_wanted,
            demand_milli_per_second: self.draft.demand_milli_per_second,
            lookahead_ms: self.tuning.lookahead_ms,
            lease_ttl_ms: self.tuning.lease_ttl_ms,
        }
    }
}

/// The broker's answers to one shard's asks.
#[derive(Debug)]
pub struct LeaseAnswers(pub Vec<(LeaseAsk, ReportAnswer)>);

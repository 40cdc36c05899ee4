//! The quota ledger's state machine: pure, deterministic apply of lease commands.
//!
//! This file owns the authoritative buckets of a region (DESIGN.md section 4): which tokens
//! are granted as leases, to which node, until when; what comes back; when an idle key is
//! forgotten; and the versioned policy set. It does no IO, reads no clock and draws no random
//! number: every command carries the time its leader stamped (`ledger_time.rs`), and apply
//! uses `max(last_seen_ms, now_ms)`, so every replica that applies the same commands in the same
//! order reaches the same state ([`QuotaLedger::digest`] compares them). The bucket math is
//! `rate.rs`'s; replication, storage and the encoding of records are `src/ledger/`'s.
//!
//! # Leases and settlement
//! A grant takes tokens out of the key's bucket at once and records them as outstanding for
//! the node until `now_ms + lease_ttl_ms`. Nodes then settle what they did with them
//! ([`QuotaCommand::SettleLeases`]): each [`LeaseReport`] says how many tokens the node has
//! spent on the key in total (cumulative over the key's life on the node, its
//! [`LeaseEpoch`]) and how many it still holds. The ledger compares that with what it counts
//! as the node's (reported spending, plus outstanding tokens, plus tokens written off when a
//! lease expired unreported):
//!
//! ```text
//!   before = spent (last report) + written off + outstanding      after = spent + held
//!   after > before: the node spent beyond its leases (fallback, optimistic first hits):
//!                   debt, charged to the bucket before any new grant
//!   after < before: tokens the node neither spent nor holds (an expired lease's unspent
//!                   part, a return, a grant whose answer was lost): credited back, capped
//!                   as one central bucket caps them
//! ```
//!
//! So every token of a key is in exactly one place: the bucket, a node's live lease, or
//! spent; nothing is minted and nothing is lost. Reports are idempotent: the counts are
//! cumulative, and a report whose `(epoch, seq)` is not newer than the last applied one is
//! stale and changes nothing. Expiry only moves outstanding tokens to "written off" (counted
//! as spent: a dead node may have spent them); the node's next report settles them exactly.
//! A node's leases on one key are kept as one aggregate whose expiry is the latest of its
//! grants: a node refills a key at its low watermark with one request in flight, so its
//! leases on a key overlap anyway.
//!
//! Each key also keeps its bucket's totals since it took its limit ([`KeyTotals`]): granted,
//! charged for debt, and returned (only what the bucket could hold). They decide nothing;
//! they let an outside checker hold the bucket to its capacity plus refill on a key whose
//! tokens flow back (`ReadKeys`, the fault-injection suite's `lease-totals`).
//!
//! # Fair shares
//! When the nodes' reported demand for a key exceeds its rate, each node's grants are capped
//! by its max-min fair share of the rate, accrued in ledger time (`crate::core::fair_share`),
//! plus whatever the bucket holds beyond every node's near-term share; a node short of its
//! want is told to ask again in one lookahead, so a key at its limit costs each node a
//! bounded number of writes per second, whatever its offered load.
//!
//! # Sweep
//! Each key has a wake-up time: its earliest lease expiry, or the time it may be reclaimed
//! (2 x its window after its last use). Every command first sweeps up to
//! [`SWEEP_KEYS_PER_COMMAND_MAX`] keys whose wake-up time has come, in (time, key) order:
//! expired leases are written off, and a key with no live lease and no debt whose bucket is
//! back to its initial state is forgotten with its settlement records (a bucket not yet
//! refilled is looked at again one window later, since forgetting it would hand out a fresh
//! bucket).
//!
//! # Bad input
//! Each lease request is checked on its own: a bad one gets an error value and changes
//! nothing, the others proceed. A command that is bad as a whole (a batch over
//! [`LEASE_REQUESTS_PER_COMMAND_MAX`]) is refused before anything, even time, moves.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::core::digest::Fnv1a;

use crate::core::fair_share::{Entitlement, max_min_fair, rate_milli_per_second};
pub use crate::core::policy_versions::{
    POLICY_FILE_NAME_BYTES_MAX, POLICY_FILES_MAX, POLICY_SET_BYTES_MAX, PolicyApplied,
    PolicyAuthor, PolicySetError, PolicyVersions, StoredPolicyVersion,
};
use crate::core::rate::{Algorithm, LimitSpec, LimitState, MICRO_TOKENS_PER_TOKEN};
use crate::core::region::transfer::{RegionCommand, RegionLedger, RegionResponse};

mod regions;

/// Longest key, in bytes (`rl:{domain}:{descriptor path}`).
pub const KEY_BYTES_MAX: usize = 512;
/// Every ledger key starts with this.
pub const KEY_PREFIX: &str = "rl:";
/// Most lease requests in one `AcquireLeases` command; the lease broker batches about 1 ms
/// of requests from all shards of a node.
pub const LEASE_REQUESTS_PER_COMMAND_MAX: usize = 4096;
/// Most tokens one lease request may ask for, or one return give back (the design's
/// `max_lease` is 500 by default; this bounds what a broken client can ask).
pub const LEASE_TOKENS_MAX: u64 = 1_000_000;
/// Longest lease (the design caps lease TTLs at 1 s by default; this is the hard bound).
pub const LEASE_TTL_MS_MAX: u64 = 60_000;
/// Most tokens a report may count as spent in one epoch (room for years at the largest
/// limit, far from overflowing the sums of a settlement).
pub const SPENT_TOKENS_MAX: u64 = 1 << 60;
/// Longest lookahead a report may name (a fair share is accrued over two of them).
pub const LOOKAHEAD_MS_MAX: u64 = 3_600_000;
/// Most keys the ledger holds at once; a grant for a new key beyond it is refused.
pub const KEYS_MAX: usize = 1_000_000;
/// Most keys looked at by the sweep in one command, so one apply does bounded work.
pub const SWEEP_KEYS_PER_COMMAND_MAX: usize = 256;

const _: () = assert!(KEY_PREFIX.len() < KEY_BYTES_MAX);
const _: () = assert!(SWEEP_KEYS_PER_COMMAND_MAX > 0);

/// A node of a region, as the ledger and Raft know it.
///
/// It is a newtype so a node id cannot be confused with a token count or a log index where it
/// crosses an API. The same type is openraft's `NodeId` for every Raft group (it meets
/// openraft's bounds: `Copy`, `Ord`, `Display`, `Default`, serde), so there is one id per node
/// across the ledger, Raft and the CLI. It serializes as a bare `u64`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<u64> for NodeId {
    fn from(id: u64) -> Self {
        Self(id)
    }
}

/// One key's request for a lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRequest {
    /// `rl:{domain}:{descriptor path}`.
    pub key: String,
    /// The limit of the rule the key falls under.
    pub limit: LimitSpec,
    /// Tokens the node would like; it gets `min(tokens_wanted, whole tokens available)`.
    pub tokens_wanted: u64,
    /// How long the ledger counts the lease as outstanding.
    pub lease_ttl_ms: u64,
}

/// Which life of a key on a node a report speaks for. A node starts a new epoch for a key
/// whenever it creates the key's slot (first hit, or again after an eviction or a restart),
/// and its counts start from zero; epochs only grow (`incarnation` is the node process's
/// start time in microseconds, `serial` counts slots within it), so a report from an older
/// life that arrives late is stale.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct LeaseEpoch {
    /// The node process's start, in microseconds of its clock.
    pub incarnation: u64,
    /// The slot's number within the process.
    pub serial: u64,
}

/// A node's account of one key (see the module docs on settlement), and what it wants next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseReport {
    /// `rl:{domain}:{descriptor path}`.
    pub key: String,
    /// The limit of the rule the key falls under.
    pub limit: LimitSpec,
    /// The key's life on the node.
    pub epoch: LeaseEpoch,
    /// Increases with every report of the epoch; a report not newer than the last applied
    /// one is stale.
    pub seq: u64,
    /// Tokens the node admitted on the key in this epoch, in total (leased or not).
    pub spent_tokens: u64,
    /// Leased tokens the node still holds and may spend.
    pub held_tokens: u64,
    /// What the node last heard the ledger counts as its in this epoch (0 before any answer).
    /// Read only when the ledger has no record of the node on the key (it forgot an idle key
    /// with its records): the report is then settled against it, so spending the ledger
    /// already counted is not charged twice; it never credits anything.
    pub settled_tokens: u64,
    /// Tokens wanted now; 0 settles only.
    pub tokens_wanted: u64,
    /// The node's offered traffic on the key (admitted or not), milli-hits per second: its
    /// demand when the key is contended.
    pub demand_milli_per_second: u64,
    /// How much traffic one lease should cover; a node short of its share asks again after it.
    pub lookahead_ms: u64,
    /// How long the ledger counts a grant as outstanding.
    pub lease_ttl_ms: u64,
}

/// A command of the quota group's log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuotaCommand {
    /// Lease requests of one node, answered item by item.
    AcquireLeases {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The node the leases are for.
        node_id: NodeId,
        /// At most [`LEASE_REQUESTS_PER_COMMAND_MAX`].
        requests: Vec<LeaseRequest>,
    },
    /// A policy set for every node of the region: a new version unless its digest is the
    /// current version's (`crate::core::policy_versions`). Only a voter proposes it.
    ApplyPolicySet {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// `(file name, YAML text)` pairs, validated by the proposer.
        files: Vec<(String, String)>,
        /// The policy digest the proposer computed from the files.
        digest: u64,
        /// Who applies it and why.
        author: PolicyAuthor,
    },
    /// A new version with the files of an earlier one. Only a voter proposes it.
    RollbackPolicySet {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The version whose files become current again.
        to_version: u64,
        /// Who rolls back and why.
        author: PolicyAuthor,
    },
    /// A command about the region's slices of global limits and the transfers between
    /// regions (`crate::core::region::transfer`), proposed by the region's rebalancer (and
    /// demand reports, by every node of the region: `crate::slice_follow`).
    Region {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The command.
        command: RegionCommand,
    },
    /// One node's reports on its keys (the lease broker's batch): each settles what the node
    /// spent and holds, then grants what it wants, answered item by item.
    SettleLeases {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The node reporting.
        node_id: NodeId,
        /// At most [`LEASE_REQUESTS_PER_COMMAND_MAX`].
        reports: Vec<LeaseReport>,
    },
}

/// What a lease request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// `min(tokens_wanted, whole tokens available)`; may be 0.
    pub granted_tokens: u64,
    /// 0 when tokens were granted; otherwise the exact ms until one token is available.
    pub retry_after_ms: u64,
    /// Whole tokens left in the bucket after this grant; for a contended key, at most what
    /// is left of this node's share.
    pub remaining_tokens: u64,
    /// When the ledger stops counting this grant as outstanding (ledger time); `None` when
    /// nothing was granted.
    pub lease_expires_at_ms: Option<u64>,
}

/// Why one lease request was refused; the request changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum LeaseRequestError {
    /// The key is empty, longer than [`KEY_BYTES_MAX`] or does not start with [`KEY_PREFIX`].
    #[error("invalid key: {0}")]
    Key(KeyError),
    /// `tokens_wanted` was 0 or above [`LEASE_TOKENS_MAX`].
    #[error("tokens wanted must be between 1 and {LEASE_TOKENS_MAX}, got {0}")]
    TokensWanted(u64),
    /// `lease_ttl_ms` was 0 or above [`LEASE_TTL_MS_MAX`].
    #[error("lease TTL must be between 1 and {LEASE_TTL_MS_MAX} ms, got {0} ms")]
    LeaseTtl(u64),
    /// The limit's numbers are out of range.
    #[error("invalid limit: {0}")]
    Limit(String),
    /// The ledger holds [`KEYS_MAX`] keys and this one is new.
    #[error("the ledger holds the maximum of {KEYS_MAX} keys")]
    LedgerFull,
    /// A report's held tokens are above [`LEASE_TOKENS_MAX`], or its spent tokens above
    /// [`SPENT_TOKENS_MAX`].
    #[error(
        "a report's held tokens must be at most {LEASE_TOKENS_MAX} and spent at most {SPENT_TOKENS_MAX}"
    )]
    ReportTokens,
    /// A report's lookahead is 0 or above [`LOOKAHEAD_MS_MAX`].
    #[error("lookahead must be between 1 and {LOOKAHEAD_MS_MAX} ms, got {0} ms")]
    Lookahead(u64),
    /// A report of the same epoch counts fewer spent tokens than an earlier one: spending is
    /// cumulative, so the report is broken.
    #[error("spent tokens went down from {applied} to {reported} within one epoch")]
    SpentDecreased {
        /// Spent tokens of the last applied report.
        applied: u64,
        /// Spent tokens of this report.
        reported: u64,
    },
}

/// What is wrong with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum KeyError {
    /// No bytes at all.
    #[error("empty")]
    Empty,
    /// Over [`KEY_BYTES_MAX`] bytes.
    #[error("{0} bytes, over {KEY_BYTES_MAX}")]
    TooLong(usize),
    /// Missing the [`KEY_PREFIX`].
    #[error("does not start with {KEY_PREFIX:?}")]
    Prefix,
}

/// What a report settled and was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Settlement {
    /// The grant that followed the settlement (0 tokens when nothing was wanted or none
    /// could be had).
    pub grant: LeaseGrant,
    /// Tokens the node spent beyond its leases that the bucket paid now; what it could not
    /// pay stays owed by the key, paid before any new grant.
    pub charged_tokens: u64,
    /// Tokens credited back to the bucket (or to the key's debt).
    pub credited_tokens: u64,
    /// True when the key's demand exceeds its rate and grants follow fair shares.
    pub contended: bool,
}

/// What became of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportOutcome {
    /// Settled, and granted what could be had.
    Settled(Settlement),
    /// Not newer than the last report applied for the node and key: changed nothing.
    Stale,
    /// Of an earlier life of the key's slot on the node than one the ledger has heard from
    /// (the node made a new slot for the key, say for a region's moved slice): that life's
    /// tokens are counted spent, and it leases nothing more. Changed nothing.
    Superseded,
}

/// A command refused as a whole before anything moved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CommandError {
    /// More than [`LEASE_REQUESTS_PER_COMMAND_MAX`] lease requests or returns.
    #[error(
        "{0} lease requests or returns in one command, over the maximum of \
         {LEASE_REQUESTS_PER_COMMAND_MAX}"
    )]
    BatchTooLarge(usize),
}

/// The answer to one log entry of the quota group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuotaResponse {
    /// A blank or membership entry, which carries no command.
    NoCommand,
    /// One result per lease request, in order.
    Leases(Vec<Result<LeaseGrant, LeaseRequestError>>),
    /// One result per report of a [`QuotaCommand::SettleLeases`], in order.
    Settled(Vec<Result<ReportOutcome, LeaseRequestError>>),
    /// The result of an apply or a rollback of the policy set.
    PolicySet(Result<PolicyApplied, PolicySetError>),
    /// The command was refused as a whole.
    Rejected(CommandError),
    /// The answer to a [`QuotaCommand::Region`].
    Region(RegionResponse),
}

/// A node's lease on one key, and its settlement record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Lease {
    /// Tokens granted and neither settled nor expired: the node's live lease.
    pub tokens: u64,
    /// When the ledger stops counting them as live (the latest expiry of the grants).
    pub expires_at_ms: u64,
    /// For window limits: the aligned window (`now_ms / window_ms`) of the latest grant.
    pub window_index: u64,
    /// For window limits: tokens granted in that window, the only ones a credit may
    /// un-count (rate.rs `give_back`).
    pub tokens_in_window: u64,
    /// The life of the key on the node that the record follows.
    pub epoch: LeaseEpoch,
    /// The last report applied in that epoch.
    pub seq: u64,
    /// Spent tokens as last reported.
    pub spent_tokens: u64,
    /// Tokens of leases that expired before the node settled them: counted as spent until a
    /// report says otherwise.
    pub written_off_tokens: u64,
    /// The node's last reported demand, milli-hits per second.
    pub demand_milli_per_second: u64,
    /// Ledger time of the node's last report (its demand counts while it is recent).
    pub reported_at_ms: u64,
    /// The node's lookahead from its last report.
    pub lookahead_ms: u64,
    /// The node's accrued fair share while the key is contended.
    pub entitlement: Entitlement,
}

impl Lease {
    /// Tokens the ledger counts as the node's: spent, written off, or live.
    fn attributed_tokens(&self) -> u64 {
        self.spent_tokens.saturating_add(self.written_off_tokens).saturating_add(self.tokens)
    }

    /// True while the node's demand is recent enough to count for fair shares: within four
    /// lookaheads (a node at its share asks once per lookahead) and at least a second.
    fn demand_is_recent(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.reported_at_ms) <= self.lookahead_ms.saturating_mul(4).max(1_000)
    }
}

/// One key's bucket and the leases drawn from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyEntry {
    /// The limit in force (the latest a request named).
    pub limit: LimitSpec,
    /// The bucket or window counters.
    pub state: LimitState,
    /// Ledger time of the last lease request.
    pub last_used_ms: u64,
    /// When the sweep looks at this key next.
    pub wake_at_ms: u64,
    /// Leases and settlement records by node.
    pub leases: BTreeMap<NodeId, Lease>,
    /// Tokens nodes spent beyond their leases that the bucket could not pay yet; paid from
    /// refill before any new grant.
    pub debt_tokens: u64,
    /// Ledger time the key's current contention began (0: not contended at its last grant):
    /// fair shares accrue from then, so no node brings an entitlement from before.
    pub contended_since_ms: u64,
    /// What the bucket gave and got back under its current limit: an outside checker's
    /// view of conservation on a key that nodes settle.
    pub totals: KeyTotals,
}

/// Cumulative tokens through one key's bucket since it took its current limit (its
/// creation, or a request naming other numbers). Between any two states of one life, a
/// token bucket of capacity C and rate R obeys
/// `(granted + charged - returned) grew by <= C + R x (ledger time elapsed)`:
/// it held at most C at the first, refilled at most R a second, and lost what it gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeyTotals {
    /// Ledger time these totals began: the bucket's creation or its last change of limit.
    pub since_ms: u64,
    /// Tokens granted as leases.
    pub granted_tokens: u64,
    /// Tokens taken to pay debt (nodes' spending beyond their leases).
    pub charged_tokens: u64,
    /// Tokens that went back into the bucket on settlement (only what it could hold).
    pub returned_tokens: u64,
}

impl KeyTotals {
    fn starting_at(now_ms: u64) -> Self {
        Self { since_ms: now_ms, ..Self::default() }
    }
}

impl KeyEntry {
    /// Ledger time from which the key may be forgotten: 2 x its window after last use.
    fn reclaim_at_ms(&self) -> u64 {
        self.last_used_ms.saturating_add(self.limit.window_ms.saturating_mul(2))
    }

    /// When the sweep must look at the key next, seen from `now_ms`.
    fn next_wake_ms(&self, now_ms: u64) -> u64 {
        let reclaim_at_ms = self.reclaim_at_ms();
        // Past its reclaim time but not refilled yet: look again one window later.
        let reclaim_ms = if reclaim_at_ms > now_ms {
            reclaim_at_ms
        } else {
            now_ms.saturating_add(self.limit.window_ms.max(1))
        };
        self.leases
            .values()
            .filter(|lease| lease.tokens > 0)
            .map(|lease| lease.expires_at_ms)
            .fold(reclaim_ms, u64::min)
    }
}

/// What changed since the last [`QuotaLedger::take_changes`], for the store to persist.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LedgerChanges {
    /// The new `last_seen_ms`, when it moved.
    pub last_seen_ms: Option<u64>,
    /// Policy versions changed: `None` for a version whose record was dropped.
    pub policies: Vec<(u64, Option<StoredPolicyVersion>)>,
    /// The region's slices and transfers, when a command changed them.
    pub regions: Option<RegionLedger>,
    /// Changed keys: `None` for a key forgotten.
    pub keys: Vec<(String, Option<KeyEntry>)>,
}

/// A persisted ledger could not be rebuilt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerLoadError {
    /// A key entry is stored under an invalid key.
    #[error("stored key {key:?} is invalid: {reason}")]
    Key {
        /// The key, as stored.
        key: String,
        /// What is wrong with it.
        reason: KeyError,
    },
}

/// The quota ledger: all buckets, leases and the policy set of a region.
#[derive(Debug, Clone, Default)]
pub struct QuotaLedger {
    /// The greatest `now_ms` applied so far: ledger time.
    last_seen_ms: u64,
    keys: BTreeMap<String, KeyEntry>,
    policies: PolicyVersions,
    /// Slices of global limits and transfers between regions (`ledger/regions.rs`).
    regions: RegionLedger,
    // Derived from `keys`, rebuilt on load:
    /// `(wake_at_ms, key)` of every key, the sweep's queue.
    wake_queue: BTreeSet<(u64, String)>,
    /// Outstanding leased tokens per node, summed over keys.
    outstanding_by_node: BTreeMap<NodeId, u64>,
    // Not state: what the store has not persisted yet.
    changed_keys: BTreeSet<String>,
    last_seen_changed: bool,
    regions_changed: bool,
}

fn check_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        Err(KeyError::Empty)
    } else if key.len() > KEY_BYTES_MAX {
        Err(KeyError::TooLong(key.len()))
    } else if !key.starts_with(KEY_PREFIX) {
        Err(KeyError::Prefix)
    } else {
        Ok(())
    }
}

fn check_limit(limit: &LimitSpec) -> Result<(), LeaseRequestError> {
    // The fields are public and arrive over the wire: validate them as `new` would.
    let rebuilt = LimitSpec::new(
        limit.algorithm,
        limit.requests_per_window,
        limit.window_ms,
        Some(limit.burst_tokens),
    )
    .map_err(|e| LeaseRequestError::Limit(e.to_string()))?;
    if rebuilt == *limit {
        Ok(())
    } else {
        Err(LeaseRequestError::Limit(format!("{limit:?} is not canonical")))
    }
}

/// Checks one lease request as apply does before touching anything, so a proposer can
/// refuse bad input without proposing it (a refused request changes nothing, but the command
/// carrying it still moves ledger time). Only [`LeaseRequestError::LedgerFull`] depends on
/// the ledger's state and is left to apply.
///
/// # Errors
/// The [`LeaseRequestError`] apply would answer.
pub fn check_lease_request(request: &LeaseRequest) -> Result<(), LeaseRequestError> {
    check_key(&request.key).map_err(LeaseRequestError::Key)?;
    if request.tokens_wanted == 0 || request.tokens_wanted > LEASE_TOKENS_MAX {
        return Err(LeaseRequestError::TokensWanted(request.tokens_wanted));
    }
    if request.lease_ttl_ms == 0 || request.lease_ttl_ms > LEASE_TTL_MS_MAX {
        return Err(LeaseRequestError::LeaseTtl(request.lease_ttl_ms));
    }
    check_limit(&request.limit)
}

/// Checks one report as apply does before touching anything.
///
/// # Errors
/// The [`LeaseRequestError`] apply would answer (all but the state-dependent
/// [`LeaseRequestError::LedgerFull`] and [`LeaseRequestError::SpentDecreased`]).
pub fn check_report(report: &LeaseReport) -> Result<(), LeaseRequestError> {
    check_key(&report.key).map_err(LeaseRequestError::Key)?;
    if report.tokens_wanted > LEASE_TOKENS_MAX {
        return Err(LeaseRequestError::TokensWanted(report.tokens_wanted));
    }
    if report.held_tokens > LEASE_TOKENS_MAX
        || report.spent_tokens > SPENT_TOKENS_MAX
        || report.settled_tokens > SPENT_TOKENS_MAX
    {
        return Err(LeaseRequestError::ReportTokens);
    }
    if report.lease_ttl_ms == 0 || report.lease_ttl_ms > LEASE_TTL_MS_MAX {
        return Err(LeaseRequestError::LeaseTtl(report.lease_ttl_ms));
    }
    if report.lookahead_ms == 0 || report.lookahead_ms > LOOKAHEAD_MS_MAX {
        return Err(LeaseRequestError::Lookahead(report.lookahead_ms));
    }
    check_limit(&report.limit)
}

/// A contended key's cap on one node's grant.
#[derive(Debug, Clone, Copy)]
struct FairCap {
    /// Most tokens the node may be granted now.
    cap_tokens: u64,
    /// The node's fair share of the rate, milli-tokens per second.
    share_milli: u64,
}

/// The fair-share cap for `node_id` (whose `lease` is out of `entry.leases`), or `None`
/// while the recent demand of all nodes fits the key's rate. The cap is the node's accrued
/// entitlement plus what the bucket holds beyond every node's near-term share (a burst left
/// in the bucket is anyone's).
fn fair_cap(
    entry: &mut KeyEntry,
    node_id: NodeId,
    lease: &mut Lease,
    available_tokens: u64,
    lookahead_ms: u64,
    now_ms: u64,
) -> Option<FairCap> {
    let rate_milli = rate_milli_per_second(&entry.limit);
    let mut demands: Vec<(u64, u64)> = entry
        .leases
        .iter()
        .filter(|(other, other_lease)| {
            **other != node_id
                && other_lease.demand_milli_per_second > 0
                && other_lease.demand_is_recent(now_ms)
        })
        .map(|(_, other_lease)| (other_lease.demand_milli_per_second, other_lease.lookahead_ms))
        .collect();
    demands.push((lease.demand_milli_per_second, lookahead_ms));
    let total_milli: u128 = demands.iter().map(|(demand, _)| u128::from(*demand)).sum();
    // Contended: the demand exceeds the rate, and the bucket cannot cover the demand of the
    // next two lookaheads (a key with its burst in hand serves first come, as one bucket).
    let near_term_micro: u128 = demands
        .iter()
        .map(|(demand, lookahead_ms)| {
            u128::from(*demand) * u128::from(lookahead_ms.saturating_mul(2))
        })
        .sum();
    let bucket_micro = u128::from(available_tokens) * u128::from(MICRO_TOKENS_PER_TOKEN);
    // Fairness needs two nodes to be fair between, and a rate of at least a token per
    // horizon: below a token, shares would starve every node (first come is fairer then).
    let rate_per_horizon_micro =
        u128::from(rate_milli) * u128::from(lookahead_ms.saturating_mul(2));
    if total_milli <= u128::from(rate_milli)
        || bucket_micro >= near_term_micro
        || demands.len() < 2
        || rate_per_horizon_micro < u128::from(MICRO_TOKENS_PER_TOKEN)
    {
        return None;
    }
    let shares =
        max_min_fair(rate_milli, &demands.iter().map(|(demand, _)| *demand).collect::<Vec<_>>());
    let share_milli = *shares.last().expect("this node's demand was pushed");
    let horizon_ms = lookahead_ms.saturating_mul(2);
    if entry.contended_since_ms == 0 {
        entry.contended_since_ms = now_ms.max(1);
    }
    if lease.entitlement.updated_ms < entry.contended_since_ms {
        lease.entitlement = Entitlement { micro_tokens: 0, updated_ms: entry.contended_since_ms };
    }
    lease.entitlement.accrue(share_milli, horizon_ms, now_ms);
    let reserve_micro: u128 = shares
        .iter()
        .zip(&demands)
        .map(|(share, (_, lookahead_ms))| {
            u128::from(*share) * u128::from(lookahead_ms.saturating_mul(2))
        })
        .sum();
    let reserve_tokens =
        u64::try_from(reserve_micro / u128::from(MICRO_TOKENS_PER_TOKEN)).unwrap_or(u64::MAX);
    // A burst left in the bucket is anyone's, but at most a horizon of the node's own share
    // per grant: the node whose asks arrive first (the leader's own) must not take it all.
    let share_horizon_tokens = u64::try_from(
        u128::from(share_milli) * u128::from(horizon_ms) / u128::from(MICRO_TOKENS_PER_TOKEN),
    )
    .unwrap_or(u64::MAX);
    let free_tokens = available_tokens.saturating_sub(reserve_tokens).min(share_horizon_tokens);
    Some(FairCap {
        cap_tokens: lease.entitlement.whole_tokens().saturating_add(free_tokens),
        share_milli,
    })
}

impl QuotaLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds a ledger from its persisted parts (see [`LedgerChanges`]).
    ///
    /// # Errors
    /// [`LedgerLoadError`] when a stored key is invalid.
    pub fn from_parts(
        last_seen_ms: u64,
        policies: PolicyVersions,
        keys: impl IntoIterator<Item = (String, KeyEntry)>,
    ) -> Result<Self, LedgerLoadError> {
        let mut ledger = Self { last_seen_ms, policies, ..Self::default() };
        for (key, entry) in keys {
            check_key(&key).map_err(|reason| LedgerLoadError::Key { key: key.clone(), reason })?;
            ledger.wake_queue.insert((entry.wake_at_ms, key.clone()));
            for (node_id, lease) in &entry.leases {
                let total = ledger.outstanding_by_node.entry(*node_id).or_default();
                *total = total.saturating_add(lease.tokens);
            }
            ledger.keys.insert(key, entry);
        }
        Ok(ledger)
    }

    /// Applies one command at `max(last_seen_ms, now_ms)` and answers it.
    pub fn apply(&mut self, command: &QuotaCommand) -> QuotaResponse {
        match command {
            QuotaCommand::AcquireLeases { now_ms, node_id, requests } => {
                if requests.len() > LEASE_REQUESTS_PER_COMMAND_MAX {
                    return QuotaResponse::Rejected(CommandError::BatchTooLarge(requests.len()));
                }
                let now_ms = self.advance(*now_ms);
                QuotaResponse::Leases(
                    requests
                        .iter()
                        .map(|request| self.acquire(*node_id, request, now_ms))
                        .collect(),
                )
            }
            QuotaCommand::SettleLeases { now_ms, node_id, reports } => {
                if reports.len() > LEASE_REQUESTS_PER_COMMAND_MAX {
                    return QuotaResponse::Rejected(CommandError::BatchTooLarge(reports.len()));
                }
                let now_ms = self.advance(*now_ms);
                QuotaResponse::Settled(
                    reports.iter().map(|report| self.settle(*node_id, report, now_ms)).collect(),
                )
            }
            QuotaCommand::ApplyPolicySet { now_ms, files, digest, author } => {
                let now_ms = self.advance(*now_ms);
                QuotaResponse::PolicySet(self.policies.apply(files, *digest, author, now_ms))
            }
            QuotaCommand::RollbackPolicySet { now_ms, to_version, author } => {
                let now_ms = self.advance(*now_ms);
                QuotaResponse::PolicySet(self.policies.rollback(*to_version, author, now_ms))
            }
            QuotaCommand::Region { now_ms, command } => {
                let now_ms = self.advance(*now_ms);
                self.apply_region(command, now_ms)
            }
        }
    }

    /// Moves ledger time and runs the sweep; returns the time the command applies at.
    fn advance(&mut self, now_ms: u64) -> u64 {
        if now_ms > self.last_seen_ms {
            self.last_seen_ms = now_ms;
            self.last_seen_changed = true;
        }
        let now_ms = self.last_seen_ms;
        self.sweep(now_ms);
        now_ms
    }

    fn sweep(&mut self, now_ms: u64) {
        for _ in 0..SWEEP_KEYS_PER_COMMAND_MAX {
            let Some((wake_at_ms, _)) = self.wake_queue.first() else {
                break;
            };
            if *wake_at_ms > now_ms {
                break;
            }
            let Some((_, key)) = self.wake_queue.pop_first() else {
                break;
            };
            let mut entry =
                self.keys.remove(&key).expect("the wake queue names only keys in the map");
            self.expire_leases(&mut entry, now_ms);
            self.changed_keys.insert(key.clone());
            let forgettable = entry.leases.values().all(|lease| lease.tokens == 0)
                && entry.debt_tokens == 0
                && now_ms >= entry.reclaim_at_ms()
                && entry.limit.is_pristine(&entry.state, now_ms);
            if forgettable {
                // Its records go with it; a live lease would have kept it.
            } else {
                entry.wake_at_ms = entry.next_wake_ms(now_ms);
                self.wake_queue.insert((entry.wake_at_ms, key.clone()));
                self.keys.insert(key, entry);
            }
        }
    }

    /// Writes off the leases of `entry` that expired at `now_ms`: their tokens count as spent
    /// until the node settles them.
    fn expire_leases(&mut self, entry: &mut KeyEntry, now_ms: u64) {
        for (node_id, lease) in &mut entry.leases {
            if lease.tokens > 0 && lease.expires_at_ms <= now_ms {
                subtract_outstanding(&mut self.outstanding_by_node, *node_id, lease.tokens);
                lease.written_off_tokens = lease.written_off_tokens.saturating_add(lease.tokens);
                lease.tokens = 0;
            }
        }
    }

    /// Takes `key`'s entry out of the map and the wake queue, for a change.
    fn take_entry(&mut self, key: &str) -> Option<KeyEntry> {
        let entry = self.keys.remove(key)?;
        let removed = self.wake_queue.remove(&(entry.wake_at_ms, key.to_owned()));
        assert!(removed, "every key is in the wake queue at its wake time");
        Some(entry)
    }

    /// Puts a changed entry back, rescheduled.
    fn put_entry(&mut self, key: &str, mut entry: KeyEntry, now_ms: u64) {
        entry.wake_at_ms = entry.next_wake_ms(now_ms);
        self.wake_queue.insert((entry.wake_at_ms, key.to_owned()));
        self.keys.insert(key.to_owned(), entry);
        self.changed_keys.insert(key.to_owned());
    }

    /// Takes `key`'s entry for a change, or a fresh one under `limit`. Changed numbers carry
    /// the count over ([`LimitSpec::carried_from`]): a region's moved slice, or nodes that
    /// see the slice at different moments, mint no tokens. A limit of another shape starts
    /// the bucket over (a new policy). Either way the leases drawn under the old limit stay.
    fn entry_for(
        &mut self,
        key: &str,
        limit: LimitSpec,
        now_ms: u64,
    ) -> Result<KeyEntry, LeaseRequestError> {
        let mut entry = match self.take_entry(key) {
            Some(entry) => entry,
            None if self.keys.len() >= KEYS_MAX => return Err(LeaseRequestError::LedgerFull),
            None => KeyEntry {
                limit,
                state: limit.initial_state(now_ms),
                last_used_ms: now_ms,
                wake_at_ms: now_ms,
                leases: BTreeMap::new(),
                debt_tokens: 0,
                contended_since_ms: 0,
                totals: KeyTotals::starting_at(now_ms),
            },
        };
        if entry.limit != limit {
            entry.totals = KeyTotals::starting_at(now_ms);
            match limit.carried_from(&entry.limit, &entry.state, now_ms) {
                Some(state) => entry.state = state,
                None => {
                    entry.state = limit.initial_state(now_ms);
                    entry.debt_tokens = 0;
                }
            }
            entry.limit = limit;
        }
        self.expire_leases(&mut entry, now_ms);
        entry.last_used_ms = now_ms;
        Ok(entry)
    }

    /// An operator's or a benchmark's grant by hand: tokens for the node, outside any
    /// settlement epoch (the node's next report settles them like any other).
    fn acquire(
        &mut self,
        node_id: NodeId,
        request: &LeaseRequest,
        now_ms: u64,
    ) -> Result<LeaseGrant, LeaseRequestError> {
        check_lease_request(request)?;
        let mut entry = self.entry_for(&request.key, request.limit, now_ms)?;
        let mut lease = entry.leases.remove(&node_id).unwrap_or_default();
        let grant = self.grant(
            &mut entry,
            node_id,
            &mut lease,
            request.tokens_wanted,
            request.lease_ttl_ms,
            None,
            now_ms,
        );
        entry.leases.insert(node_id, lease);
        self.put_entry(&request.key, entry, now_ms);
        Ok(grant.0)
    }

    /// Settles one report (module docs), then grants what it wants.
    fn settle(
        &mut self,
        node_id: NodeId,
        report: &LeaseReport,
        now_ms: u64,
    ) -> Result<ReportOutcome, LeaseRequestError> {
        check_report(report)?;
        let mut entry = self.entry_for(&report.key, report.limit, now_ms)?;
        // Without a record (a new key, or one the sweep forgot with its records) the report's
        // own account of what was counted is the baseline, never above what it reports now.
        let baseline = || Lease {
            epoch: report.epoch,
            written_off_tokens: report
                .settled_tokens
                .min(report.spent_tokens.saturating_add(report.held_tokens)),
            ..Lease::default()
        };
        let mut lease = entry.leases.remove(&node_id).unwrap_or_else(baseline);
        if report.epoch > lease.epoch {
            // The key's slot on the node began a new life: whatever the old life held stays
            // counted as spent (its tokens may have been), and the counts start over.
            subtract_outstanding(&mut self.outstanding_by_node, node_id, lease.tokens);
            lease = Lease { entitlement: lease.entitlement, ..baseline() };
        }
        let stale = report.epoch < lease.epoch || report.seq <= lease.seq;
        if !stale && report.spent_tokens < lease.spent_tokens {
            let error = LeaseRequestError::SpentDecreased {
                applied: lease.spent_tokens,
                reported: report.spent_tokens,
            };
            entry.leases.insert(node_id, lease);
            self.put_entry(&report.key, entry, now_ms);
            return Err(error);
        }
        if stale {
            let outcome = if report.epoch < lease.epoch {
                ReportOutcome::Superseded
            } else {
                ReportOutcome::Stale
            };
            entry.leases.insert(node_id, lease);
            self.put_entry(&report.key, entry, now_ms);
            return Ok(outcome);
        }
        let limit = entry.limit;
        let before = lease.attributed_tokens();
        let after = report.spent_tokens.saturating_add(report.held_tokens);
        let mut credited_tokens = 0;
        if after > before {
            entry.debt_tokens = entry.debt_tokens.saturating_add(after - before);
        } else if before > after {
            let surplus = before - after;
            let paid_debt = surplus.min(entry.debt_tokens);
            entry.debt_tokens -= paid_debt;
            let creditable = match limit.algorithm {
                Algorithm::TokenBucket => surplus - paid_debt,
                // rate.rs: windows may only un-count hits of the current window.
                Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                    if lease.window_index == now_ms / limit.window_ms.max(1) {
                        (surplus - paid_debt).min(lease.tokens_in_window)
                    } else {
                        0
                    }
                }
            };
            lease.tokens_in_window = lease.tokens_in_window.saturating_sub(creditable);
            let (state, returned) = limit.give_back_counted(&entry.state, now_ms, creditable);
            entry.state = state;
            entry.totals.returned_tokens = entry.totals.returned_tokens.saturating_add(returned);
            credited_tokens = paid_debt.saturating_add(creditable);
        }
        // Debt comes first: what the bucket holds pays it before anything is granted.
        let charged_tokens = if entry.debt_tokens > 0 {
            let paid = limit.acquire_up_to(&entry.state, now_ms, entry.debt_tokens);
            entry.state = paid.next;
            entry.debt_tokens -= paid.granted;
            entry.totals.charged_tokens = entry.totals.charged_tokens.saturating_add(paid.granted);
            paid.granted
        } else {
            0
        };
        let outstanding = self.outstanding_by_node.entry(node_id).or_default();
        *outstanding = outstanding.saturating_sub(lease.tokens).saturating_add(report.held_tokens);
        if *outstanding == 0 {
            self.outstanding_by_node.remove(&node_id);
        }
        lease.tokens = report.held_tokens;
        lease.spent_tokens = report.spent_tokens;
        lease.written_off_tokens = 0;
        lease.seq = report.seq;
        lease.demand_milli_per_second = report.demand_milli_per_second;
        lease.reported_at_ms = now_ms;
        lease.lookahead_ms = report.lookahead_ms;
        let (grant, contended) = self.grant(
            &mut entry,
            node_id,
            &mut lease,
            report.tokens_wanted,
            report.lease_ttl_ms,
            Some(report.lookahead_ms),
            now_ms,
        );
        entry.leases.insert(node_id, lease);
        self.put_entry(&report.key, entry, now_ms);
        Ok(ReportOutcome::Settled(Settlement { grant, charged_tokens, credited_tokens, contended }))
    }

    /// Grants up to `wanted` tokens to `node_id`'s `lease` (taken out of `entry.leases`): none
    /// while the key owes debt; with `lookahead_ms` (a node's report), capped by the node's
    /// fair share while the key is contended. Returns the grant and whether it was contended.
    #[allow(clippy::too_many_arguments)]
    fn grant(
        &mut self,
        entry: &mut KeyEntry,
        node_id: NodeId,
        lease: &mut Lease,
        wanted: u64,
        lease_ttl_ms: u64,
        lookahead_ms: Option<u64>,
        now_ms: u64,
    ) -> (LeaseGrant, bool) {
        let limit = entry.limit;
        let nothing = |retry_after_ms, remaining_tokens| LeaseGrant {
            granted_tokens: 0,
            retry_after_ms,
            remaining_tokens,
            lease_expires_at_ms: None,
        };
        let available = limit.acquire_up_to(&entry.state, now_ms, 0);
        if entry.debt_tokens > 0 {
            // Exact wait until the debt and one more token have refilled.
            let owed = entry.debt_tokens.saturating_add(1).min(limit.capacity_tokens().max(1));
            let wait_ms = limit.evaluate(&entry.state, now_ms, owed).retry_after_ms.max(1);
            return (nothing(wait_ms, 0), false);
        }
        if wanted == 0 {
            return (nothing(0, available.remaining), false);
        }
        let fair = lookahead_ms.and_then(|lookahead_ms| {
            fair_cap(entry, node_id, lease, available.remaining, lookahead_ms, now_ms)
        });
        if fair.is_none() {
            entry.contended_since_ms = 0;
        }
        let cap = fair.map_or(wanted, |fair| wanted.min(fair.cap_tokens));
        let taken = limit.acquire_up_to(&entry.state, now_ms, cap);
        entry.state = taken.next;
        entry.totals.granted_tokens = entry.totals.granted_tokens.saturating_add(taken.granted);
        let mut retry_after_ms = taken.retry_after_ms;
        if let (Some(fair), Some(lookahead_ms)) = (fair, lookahead_ms) {
            lease.entitlement.take(taken.granted);
            if taken.granted < wanted {
                // Short of its want at the limit: come back in one lookahead, or when one
                // token of share has accrued if that is later.
                let until_share_ms = lease.entitlement.ms_until_one_token(fair.share_milli);
                retry_after_ms =
                    retry_after_ms.max(lookahead_ms).max(until_share_ms.min(LEASE_TTL_MS_MAX));
            }
        }
        // Contended, what is left for this node is its share, not the whole bucket (the rest
        // is other nodes' entitlement): a node that sees 0 rejects locally at its limit.
        // Contended and short of its want, the node has used its share: nothing is left for
        // it (the rest of the bucket is other nodes' entitlement), so it rejects locally and
        // runs up no credit until its next ask.
        let remaining_tokens = match fair {
            Some(_) if taken.granted < wanted => 0,
            Some(fair) => taken.remaining.min(fair.cap_tokens.saturating_sub(taken.granted)),
            None => taken.remaining,
        };
        if taken.granted == 0 {
            return (nothing(retry_after_ms.max(1), remaining_tokens), fair.is_some());
        }
        let expires_at_ms = now_ms.saturating_add(lease_ttl_ms);
        let window_index = now_ms / limit.window_ms.max(1);
        // A live lease takes the later expiry; a settled or expired one starts over.
        lease.expires_at_ms =
            if lease.tokens == 0 { expires_at_ms } else { lease.expires_at_ms.max(expires_at_ms) };
        lease.tokens = lease.tokens.saturating_add(taken.granted);
        if lease.window_index == window_index {
            lease.tokens_in_window = lease.tokens_in_window.saturating_add(taken.granted);
        } else {
            lease.window_index = window_index;
            lease.tokens_in_window = taken.granted;
        }
        let total = self.outstanding_by_node.entry(node_id).or_default();
        *total = total.saturating_add(taken.granted);
        let grant = LeaseGrant {
            granted_tokens: taken.granted,
            retry_after_ms: if taken.granted < wanted { retry_after_ms } else { 0 },
            remaining_tokens,
            lease_expires_at_ms: Some(expires_at_ms),
        };
        (grant, fair.is_some())
    }

    /// Returns and forgets what changed since the last call.
    pub fn take_changes(&mut self) -> LedgerChanges {
        let last_seen_ms = std::mem::take(&mut self.last_seen_changed).then_some(self.last_seen_ms);
        let policies = self.policies.take_changes();
        let keys = std::mem::take(&mut self.changed_keys)
            .into_iter()
            .map(|key| {
                let entry = self.keys.get(&key).cloned();
                (key, entry)
            })
            .collect();
        LedgerChanges { last_seen_ms, policies, regions: self.take_region_changes(), keys }
    }

    /// Ledger time: the greatest `now_ms` applied.
    pub fn last_seen_ms(&self) -> u64 {
        self.last_seen_ms
    }

    /// The region's policy versions.
    pub fn policies(&self) -> &PolicyVersions {
        &self.policies
    }

    /// One key's bucket and leases.
    pub fn key(&self, key: &str) -> Option<&KeyEntry> {
        self.keys.get(key)
    }

    /// How many keys the ledger holds.
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// All keys with their entries, in key order.
    pub fn keys(&self) -> impl Iterator<Item = (&String, &KeyEntry)> {
        self.keys.iter()
    }

    /// The keys after `after` (all of them after ""), in key order.
    pub fn keys_after<'a>(
        &'a self,
        after: &str,
    ) -> impl Iterator<Item = (&'a String, &'a KeyEntry)> + 'a {
        use std::ops::Bound::{Excluded, Unbounded};
        self.keys.range::<str, _>((Excluded(after), Unbounded))
    }

    /// Tokens leased to `node_id` and not yet returned or swept as expired.
    pub fn outstanding_tokens(&self, node_id: NodeId) -> u64 {
        self.outstanding_by_node.get(&node_id).copied().unwrap_or(0)
    }

    /// Tokens leased on `key` to all nodes and not yet returned or swept as expired.
    pub fn outstanding_tokens_on_key(&self, key: &str) -> u64 {
        self.keys.get(key).map_or(0, |entry| entry.leases.values().map(|lease| lease.tokens).sum())
    }

    /// A digest of the whole state (FNV-1a over a canonical encoding): equal on replicas
    /// that applied the same commands, and unchanged by a save and reload.
    pub fn digest(&self) -> u64 {
        let mut digest = Fnv1a::default();
        digest.write(&self.last_seen_ms.to_le_bytes());
        if self.policies.is_empty() {
            // As the single optional set was encoded before versions, so a ledger without
            // policies keeps its digest across the upgrade.
            digest.write_encoded(&None::<()>);
        } else {
            // Stored versions, oldest first: the same on replicas that applied the same sets.
            digest.write(&(self.policies.stored().count() as u64).to_le_bytes());
            for stored in self.policies.stored() {
                digest.write_encoded(stored);
            }
        }
        // Only once regions are in use, so ledgers without them keep their digests.
        if !self.regions.is_empty() {
            digest.write_encoded(&self.regions);
        }
        for (key, entry) in &self.keys {
            digest.write_encoded(key);
            digest.write_encoded(entry);
        }
        digest.finish()
    }
}

fn subtract_outstanding(
    outstanding_by_node: &mut BTreeMap<NodeId, u64>,
    node_id: NodeId,
    tokens: u64,
) {
    if let Some(total) = outstanding_by_node.get_mut(&node_id) {
        *total = total.saturating_sub(tokens);
        if *total == 0 {
            outstanding_by_node.remove(&node_id);
        }
    }
}

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
//! # Leases
//! A grant takes tokens out of the key's bucket at once and records them as outstanding for
//! the node until `now_ms + lease_ttl_ms`. Expiry only ends the accounting: the node may have
//! spent the tokens, so they never flow back; unspent tokens come back only through
//! [`QuotaCommand::ReturnLease`], credited at most up to what the node still holds on the key
//! (so a repeated return cannot mint tokens) and never above the bucket's capacity. A node's
//! leases on one key are kept as one aggregate whose expiry is the latest of its grants: a
//! node refills a key at its low watermark with one request in flight, so its leases on a key
//! overlap anyway, and the aggregate only ever holds accounting longer, never shorter.
//!
//! # Sweep
//! Each key has a wake-up time: its earliest lease expiry, or the time it may be reclaimed
//! (2 x its window after its last use). Every command first sweeps up to
//! [`SWEEP_KEYS_PER_COMMAND_MAX`] keys whose wake-up time has come, in (time, key) order:
//! expired leases are dropped, and a key with no lease whose bucket is back to its initial
//! state is forgotten (a bucket not yet refilled is looked at again one window later, since
//! forgetting it would hand out a fresh bucket).
//!
//! # Bad input
//! Each lease request is checked on its own: a bad one gets an error value and changes
//! nothing, the others proceed. A command that is bad as a whole (a batch over
//! [`LEASE_REQUESTS_PER_COMMAND_MAX`]) is refused before anything, even time, moves.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::core::digest::Fnv1a;

use crate::core::rate::{Algorithm, LimitSpec, LimitState};

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
/// Most keys the ledger holds at once; a grant for a new key beyond it is refused.
pub const KEYS_MAX: usize = 1_000_000;
/// Most keys looked at by the sweep in one command, so one apply does bounded work.
pub const SWEEP_KEYS_PER_COMMAND_MAX: usize = 256;
/// Most files in a policy set.
pub const POLICY_FILES_MAX: usize = 256;
/// Longest policy file name, in bytes.
pub const POLICY_FILE_NAME_BYTES_MAX: usize = 256;
/// Largest policy set: names and contents of all its files, in bytes.
pub const POLICY_SET_BYTES_MAX: usize = 2 * 1024 * 1024;

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
    /// Unspent tokens of a node's lease on a key, given back.
    ReturnLease {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The node giving the tokens back.
        node_id: NodeId,
        /// The key the lease is on.
        key: String,
        /// Tokens given back.
        tokens: u64,
    },
    /// A new version of the policy set (files of YAML by name), stored for every node.
    PutPolicySet {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// Must exceed the stored version (or equal it with identical files: a retry).
        version: u64,
        /// `(file name, YAML text)` pairs.
        policy_yaml: Vec<(String, String)>,
    },
    /// Unspent tokens of one node on several keys, given back in one entry (the lease
    /// broker's batch of surplus and idle balances); each return is credited as
    /// [`QuotaCommand::ReturnLease`] would.
    ReturnLeases {
        /// Ledger time, stamped by the leader that proposed it (`ledger_time.rs`).
        now_ms: u64,
        /// The node giving the tokens back.
        node_id: NodeId,
        /// `(key, tokens)`, at most [`LEASE_REQUESTS_PER_COMMAND_MAX`].
        returns: Vec<(String, u64)>,
    },
}

/// What a lease request got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// `min(tokens_wanted, whole tokens available)`; may be 0.
    pub granted_tokens: u64,
    /// 0 when tokens were granted; otherwise the exact ms until one token is available.
    pub retry_after_ms: u64,
    /// Whole tokens left in the bucket after this grant.
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

/// What a return credited back to the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReturnOutcome {
    /// Tokens credited: at most what was returned, at most what the node still held on the
    /// key (0 for a key or lease the ledger no longer knows), and for windows only tokens
    /// granted in the current window.
    pub credited_tokens: u64,
}

/// Why a return was refused; it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ReturnError {
    /// The key is malformed.
    #[error("invalid key: {0}")]
    Key(KeyError),
    /// `tokens` was 0 or above [`LEASE_TOKENS_MAX`].
    #[error("returned tokens must be between 1 and {LEASE_TOKENS_MAX}, got {0}")]
    Tokens(u64),
}

/// Why a policy set was refused; it changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum PolicySetError {
    /// A newer version is stored, or the same version with other files.
    #[error("policy set version {offered} is stale: version {stored} is stored")]
    StaleVersion {
        /// The version offered.
        offered: u64,
        /// The version stored.
        stored: u64,
    },
    /// More than [`POLICY_FILES_MAX`] files.
    #[error("{0} policy files, over the maximum of {POLICY_FILES_MAX}")]
    TooManyFiles(usize),
    /// A file name is empty, too long, or appears twice.
    #[error("invalid or duplicate policy file name {0:?}")]
    FileName(String),
    /// Names and contents together exceed [`POLICY_SET_BYTES_MAX`].
    #[error("policy set of {0} bytes, over the maximum of {POLICY_SET_BYTES_MAX}")]
    TooLarge(usize),
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
    /// The result of a return.
    Returned(Result<ReturnOutcome, ReturnError>),
    /// One result per return of a [`QuotaCommand::ReturnLeases`], in order.
    ReturnedMany(Vec<Result<ReturnOutcome, ReturnError>>),
    /// The result of a policy set.
    PolicySet(Result<(), PolicySetError>),
    /// The command was refused as a whole.
    Rejected(CommandError),
}

/// A node's outstanding lease on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Lease {
    /// Tokens granted and neither returned nor expired.
    pub tokens: u64,
    /// When the ledger stops counting them (the latest expiry of the grants).
    pub expires_at_ms: u64,
    /// For window limits: the aligned window (`now_ms / window_ms`) of the latest grant.
    pub window_index: u64,
    /// For window limits: tokens granted in that window, the only ones a return may
    /// un-count (rate.rs `give_back`).
    pub tokens_in_window: u64,
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
    /// Outstanding leases by node.
    pub leases: BTreeMap<NodeId, Lease>,
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
        self.leases.values().map(|lease| lease.expires_at_ms).fold(reclaim_ms, u64::min)
    }
}

/// A stored version of the policy set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicySet {
    /// Its version; only a greater one replaces it.
    pub version: u64,
    /// `(file name, YAML text)` pairs, as proposed.
    pub files: Vec<(String, String)>,
    /// Ledger time it was stored.
    pub stored_at_ms: u64,
}

/// What changed since the last [`QuotaLedger::take_changes`], for the store to persist.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LedgerChanges {
    /// The new `last_seen_ms`, when it moved.
    pub last_seen_ms: Option<u64>,
    /// The new policy set, when one was stored.
    pub policy: Option<PolicySet>,
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
    policy: Option<PolicySet>,
    // Derived from `keys`, rebuilt on load:
    /// `(wake_at_ms, key)` of every key, the sweep's queue.
    wake_queue: BTreeSet<(u64, String)>,
    /// Outstanding leased tokens per node, summed over keys.
    outstanding_by_node: BTreeMap<NodeId, u64>,
    // Not state: what the store has not persisted yet.
    changed_keys: BTreeSet<String>,
    last_seen_changed: bool,
    policy_changed: bool,
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
        policy: Option<PolicySet>,
        keys: impl IntoIterator<Item = (String, KeyEntry)>,
    ) -> Result<Self, LedgerLoadError> {
        let mut ledger = Self { last_seen_ms, policy, ..Self::default() };
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
            QuotaCommand::ReturnLease { now_ms, node_id, key, tokens } => {
                let now_ms = self.advance(*now_ms);
                QuotaResponse::Returned(self.give_back(*node_id, key, *tokens, now_ms))
            }
            QuotaCommand::ReturnLeases { now_ms, node_id, returns } => {
                if returns.len() > LEASE_REQUESTS_PER_COMMAND_MAX {
                    return QuotaResponse::Rejected(CommandError::BatchTooLarge(returns.len()));
                }
                let now_ms = self.advance(*now_ms);
                QuotaResponse::ReturnedMany(
                    returns
                        .iter()
                        .map(|(key, tokens)| self.give_back(*node_id, key, *tokens, now_ms))
                        .collect(),
                )
            }
            QuotaCommand::PutPolicySet { now_ms, version, policy_yaml } => {
                let now_ms = self.advance(*now_ms);
                QuotaResponse::PolicySet(self.put_policy_set(*version, policy_yaml, now_ms))
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
            let forgettable = entry.leases.is_empty()
                && now_ms >= entry.reclaim_at_ms()
                && entry.limit.is_pristine(&entry.state, now_ms);
            if !forgettable {
                entry.wake_at_ms = entry.next_wake_ms(now_ms);
                self.wake_queue.insert((entry.wake_at_ms, key.clone()));
                self.keys.insert(key, entry);
            }
        }
    }

    /// Drops the leases of `entry` that expired at `now_ms`.
    fn expire_leases(&mut self, entry: &mut KeyEntry, now_ms: u64) {
        let outstanding_by_node = &mut self.outstanding_by_node;
        entry.leases.retain(|node_id, lease| {
            let keep = lease.expires_at_ms > now_ms;
            if !keep {
                subtract_outstanding(outstanding_by_node, *node_id, lease.tokens);
            }
            keep
        });
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

    fn acquire(
        &mut self,
        node_id: NodeId,
        request: &LeaseRequest,
        now_ms: u64,
    ) -> Result<LeaseGrant, LeaseRequestError> {
        check_lease_request(request)?;
        let limit = request.limit;
        let mut entry = match self.take_entry(&request.key) {
            Some(entry) => entry,
            None if self.keys.len() >= KEYS_MAX => return Err(LeaseRequestError::LedgerFull),
            None => KeyEntry {
                limit,
                state: limit.initial_state(now_ms),
                last_used_ms: now_ms,
                wake_at_ms: now_ms,
                leases: BTreeMap::new(),
            },
        };
        if entry.limit != limit {
            // The rule changed (a new policy): start the key over under the new limit. The
            // outstanding leases stay counted; they were drawn under the old limit.
            entry.limit = limit;
            entry.state = limit.initial_state(now_ms);
        }
        self.expire_leases(&mut entry, now_ms);
        let grant = limit.acquire_up_to(&entry.state, now_ms, request.tokens_wanted);
        entry.state = grant.next;
        entry.last_used_ms = now_ms;
        let lease_expires_at_ms = if grant.granted > 0 {
            let expires_at_ms = now_ms.saturating_add(request.lease_ttl_ms);
            let window_index = now_ms / limit.window_ms.max(1);
            let lease = entry.leases.entry(node_id).or_default();
            lease.tokens = lease.tokens.saturating_add(grant.granted);
            lease.expires_at_ms = lease.expires_at_ms.max(expires_at_ms);
            if lease.window_index == window_index {
                lease.tokens_in_window = lease.tokens_in_window.saturating_add(grant.granted);
            } else {
                lease.window_index = window_index;
                lease.tokens_in_window = grant.granted;
            }
            let total = self.outstanding_by_node.entry(node_id).or_default();
            *total = total.saturating_add(grant.granted);
            Some(expires_at_ms)
        } else {
            None
        };
        self.put_entry(&request.key, entry, now_ms);
        Ok(LeaseGrant {
            granted_tokens: grant.granted,
            retry_after_ms: grant.retry_after_ms,
            remaining_tokens: grant.remaining,
            lease_expires_at_ms,
        })
    }

    fn give_back(
        &mut self,
        node_id: NodeId,
        key: &str,
        tokens: u64,
        now_ms: u64,
    ) -> Result<ReturnOutcome, ReturnError> {
        check_key(key).map_err(ReturnError::Key)?;
        if tokens == 0 || tokens > LEASE_TOKENS_MAX {
            return Err(ReturnError::Tokens(tokens));
        }
        let Some(mut entry) = self.take_entry(key) else {
            // Forgotten by the sweep: the lease expired long ago, nothing to credit.
            return Ok(ReturnOutcome { credited_tokens: 0 });
        };
        self.expire_leases(&mut entry, now_ms);
        let limit = entry.limit;
        let credited_tokens = match entry.leases.get_mut(&node_id) {
            None => 0,
            Some(lease) => {
                let returnable = match limit.algorithm {
                    Algorithm::TokenBucket => lease.tokens,
                    // rate.rs: windows may only un-count hits of the current window.
                    Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                        if lease.window_index == now_ms / limit.window_ms.max(1) {
                            lease.tokens_in_window.min(lease.tokens)
                        } else {
                            0
                        }
                    }
                };
                let credited = tokens.min(returnable);
                lease.tokens -= credited;
                lease.tokens_in_window = lease.tokens_in_window.saturating_sub(credited);
                credited
            }
        };
        if credited_tokens > 0 {
            entry.state = limit.give_back(&entry.state, now_ms, credited_tokens);
            subtract_outstanding(&mut self.outstanding_by_node, node_id, credited_tokens);
            entry.leases.retain(|_, lease| lease.tokens > 0);
        }
        self.put_entry(key, entry, now_ms);
        Ok(ReturnOutcome { credited_tokens })
    }

    fn put_policy_set(
        &mut self,
        version: u64,
        files: &[(String, String)],
        now_ms: u64,
    ) -> Result<(), PolicySetError> {
        if files.len() > POLICY_FILES_MAX {
            return Err(PolicySetError::TooManyFiles(files.len()));
        }
        let mut names = BTreeSet::new();
        let mut total_bytes = 0usize;
        for (name, text) in files {
            if name.is_empty()
                || name.len() > POLICY_FILE_NAME_BYTES_MAX
                || !names.insert(name.as_str())
            {
                return Err(PolicySetError::FileName(name.clone()));
            }
            total_bytes = total_bytes.saturating_add(name.len()).saturating_add(text.len());
        }
        if total_bytes > POLICY_SET_BYTES_MAX {
            return Err(PolicySetError::TooLarge(total_bytes));
        }
        if let Some(stored) = &self.policy {
            if stored.version == version && stored.files == files {
                return Ok(()); // A retry of the stored set.
            }
            if stored.version >= version {
                return Err(PolicySetError::StaleVersion {
                    offered: version,
                    stored: stored.version,
                });
            }
        }
        self.policy = Some(PolicySet { version, files: files.to_vec(), stored_at_ms: now_ms });
        self.policy_changed = true;
        Ok(())
    }

    /// Returns and forgets what changed since the last call.
    pub fn take_changes(&mut self) -> LedgerChanges {
        let last_seen_ms = std::mem::take(&mut self.last_seen_changed).then_some(self.last_seen_ms);
        let policy =
            if std::mem::take(&mut self.policy_changed) { self.policy.clone() } else { None };
        let keys = std::mem::take(&mut self.changed_keys)
            .into_iter()
            .map(|key| {
                let entry = self.keys.get(&key).cloned();
                (key, entry)
            })
            .collect();
        LedgerChanges { last_seen_ms, policy, keys }
    }

    /// Ledger time: the greatest `now_ms` applied.
    pub fn last_seen_ms(&self) -> u64 {
        self.last_seen_ms
    }

    /// The stored policy set, if any.
    pub fn policy(&self) -> Option<&PolicySet> {
        self.policy.as_ref()
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
        digest.write_encoded(&self.policy);
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

//! Tenant-shard actors and the per-key lease state they own.
//!
//! Keys are spread over K shards by a process-random 128-bit hash of `(domain, descriptor
//! entries)`; each shard is a ractor actor plus a table of striped maps that it publishes
//! to the RLS handlers. A key's slot holds its lease (`crate::core::lease::KeyLease`:
//! leased balance, expiry, traffic estimate, request in flight, `blocked_until`), its
//! name in the ledger and the id of its limit, which its stripe keeps once for all the keys
//! that follow it. A fallback bucket (only while the ledger is out of reach) and an overrun
//! window sit beside the slots, so the keys that have none pay nothing for them.
//! Ownership is split by who may change what:
//!
//! - the **actor** alone inserts and removes keys: it creates a key on its first hit
//!   (a cold key, reached by a cast carrying a one-shot reply; each slot starts a new
//!   settlement epoch), applies the lease broker's answers, settles surplus, idle and expired
//!   balances and spending on credit with the ledger, evicts when the shard is full, and
//!   sweeps keys that hold nothing the ledger does not know of;
//! - an **RLS handler** spends from the slots of keys that exist, under the stripe lock,
//!   and asks the lease broker for a refill when a balance falls below its watermark.
//!
//! ```text
//!  decide ─▶ lock stripes ─▶ spend leased tokens ── all paid ──▶ commit, ask refills ─▶ OK
//!                               │ credit (fail-open, within credit.tokens_max): admit now,
//!                               │         the next report charges it
//!                               │ Blocked / at limit: OVER_LIMIT until the ledger's retry_after
//!                               │ Short: ask a lease, wait for the broker's answer
//!                               ▼        (at most wait_budget_ms from the request)
//!                   fallback: fail-open rules pay from a local bucket at
//!                   multiplier x limit / nodes (a bypass, charged as debt); fail-closed deny
//! ```
//!
//! A request's descriptors may live in several stripes. The handler locks all of them in
//! ascending order (no deadlock), decides every limit with the pure admission procedure
//! (`crate::core::admission::judge`), and writes the new states back only if the whole
//! request is admitted: rejected hits never consume quota, but count as the keys' demand.
//! The one exception is upstream's counting of hits past the limit: a fixed window that
//! refuses hits past what it has left is overrun until it ends, spending what it holds and
//! refusing everything (`crate::core::admission::overrun_until_ms`). A check-only probe is decided like the
//! others and never written back.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::{Mutex, MutexGuard};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use siphasher::sip128::{Hash128, Hasher128, SipHasher13};
use smallvec::SmallVec;
use tokio::sync::{Notify, Semaphore, futures::Notified, oneshot};

use std::sync::atomic::{AtomicU64, Ordering};

use ractor::DerivedActorRef;

use crate::actors::lease_broker::LeaseBroker;
use crate::actors::lease_protocol::{CounterKey, LeaseAnswers, LeaseAsk};
use crate::core::admission::{
    self, BypassReason, Counter, Fallback, Judged, Region, ShortKeys, Staged, Verdict,
};
use crate::core::dense_map::{DenseMap, Keyed};
use crate::core::interner::Interner;
use crate::core::lease::{KeyLease, LeaseTuning, ReportAnswer, ReportDraft, size_cap_tokens};
use crate::core::lease_key::LeaseKey;
use crate::core::ledger::LeaseEpoch;
use crate::core::policy::{FailureMode, PolicySet, RuleId};
use crate::core::rate::{Algorithm, LimitSpec, PackedLimitSpec};
use crate::metrics::Metrics;

/// Stripes per shard: enough that handlers on different cores rarely meet on one lock.
pub const STRIPES_PER_SHARD: usize = 64;

// A shard actor marks the stripes a batch of answers touched in one 64-bit word.
const _: () = assert!(STRIPES_PER_SHARD <= 64);

/// Cold-key admissions awaiting a shard actor at once, over all shards; beyond this the
/// node answers `UNAVAILABLE` instead of growing the actors' unbounded mailboxes.
pub const COLD_ADMISSIONS_INFLIGHT_MAX: usize = 4096;
/// Requests waiting for a lease at once; beyond this a short key decides from the
/// fallback at once.
pub const LEASE_WAITERS_MAX: usize = 4096;
/// How long a handler waits for a shard actor to create its keys.
pub const COLD_ADMISSION_TIMEOUT: Duration = Duration::from_millis(100);
/// Rounds of "create missing keys, then decide" before giving up: a key can be evicted
/// between its creation and the decision only under extreme churn.
pub const COLD_ROUNDS_MAX: usize = 3;
/// A freshly created key is kept at least this long, so the sweep cannot remove it before
/// the request that created it has used it.
pub const FRESH_KEY_GRACE_MS: u64 = 5_000;
/// Keys sampled when a full shard must evict one (approximate LRU, as Redis does).
const EVICTION_SAMPLE: usize = 16;
/// `Slot::rule` of a counter that no policy rule owns (a request's `limit` override).
const NO_RULE: u32 = u32::MAX;

/// Passes a [`CounterKey`]'s first word through as the map hash.
#[derive(Default)]
struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }
    fn write_u64(&mut self, word: u64) {
        self.0 = word;
    }
}

/// Which stripe of which shard holds a descriptor's counters. Ordered, so a handler can
/// lock several stripes in one global order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StripeId {
    shard: u32,
    stripe: u32,
}

/// The strings that name a descriptor's counters in the ledger; read only when a key is
/// created (`crate::core::lease_key`).
#[derive(Debug, Clone)]
pub struct LedgerName<'p> {
    /// The request's domain.
    pub domain: &'p str,
    /// The descriptor's entries, in order.
    pub entries: SmallVec<[(&'p str, &'p str); 4]>,
}

/// One limit of a probe: its counter on this node and the limits it follows.
#[derive(Debug, Clone, Copy)]
pub struct ProbeCounter<'p> {
    /// The counter on this node: named by `spec`, so a changed limit starts a new one.
    pub key: CounterKey,
    /// The limit the node enforces.
    pub spec: &'p LimitSpec,
    /// The limit that names the counter in the ledger: the policy's own, of which `spec`
    /// may be the region's slice, so a moved slice keeps the region's count
    /// (`crate::core::policy::RuleLimit::policy_spec`).
    pub ledger_spec: &'p LimitSpec,
}

/// One descriptor's counters in a request, ready to be decided.
#[derive(Debug)]
pub struct Probe<'p> {
    /// Where the counters live.
    pub stripe: StripeId,
    /// Each limit of the matched rule with its counter.
    pub counters: SmallVec<[ProbeCounter<'p>; 2]>,
    /// Hits this descriptor adds.
    pub hits: u64,
    /// Decide `hits` but never consume them (a descriptor's `hits_addend` of 0: a check).
    pub check_only: bool,
    /// False for shadow-mode rules: evaluated and reported, never a reason to reject.
    pub enforced: bool,
    /// An enforced quota-mode probe rejects the request only when every quota-mode probe of
    /// the request rejects (upstream's `quota_mode`).
    pub quota_mode: bool,
    /// The rule's lease sizes and TTL.
    pub lease: &'p LeaseTuning,
    /// What to do when no lease can be had.
    pub failure_mode: FailureMode,
    /// The rule, for per-rule gauges; `None` for a request's own `limit`.
    pub rule: Option<RuleId>,
    /// The counters' names in the ledger.
    pub name: LedgerName<'p>,
}

/// What the limits of one probe said.
#[derive(Debug, Clone)]
pub struct ProbeOutcome {
    /// One verdict per counter, in the probe's order.
    pub verdicts: SmallVec<[Verdict; 2]>,
    /// True when every limit admits the hits.
    pub admitted: bool,
    /// For a rule that does not enforce (shadow, warn) and whose limits refused the hits:
    /// how far the key's offered traffic is over the tightest of them, in thousandths
    /// (`admission::over_limit_permille`; `u64::MAX` for a limit of 0). 0 otherwise.
    pub over_permille: u64,
}

/// The decision for a whole request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// One outcome per probe, in order. Requests carry a few descriptors of a limit or two:
    /// on the stack, since this is built for every decision.
    pub outcomes: SmallVec<[ProbeOutcome; 2]>,
    /// True when every enforced probe is admitted; only then were states consumed.
    pub admitted: bool,
    /// Set when an admitted counter was paid without a lease.
    pub bypass: Option<BypassReason>,
    /// True when a fail-closed rule denied because the ledger was out of reach.
    pub failed_closed: bool,
}

impl Decision {
    /// The decision of a request none of whose descriptors has a limit: admitted.
    #[must_use]
    pub fn without_limits() -> Self {
        Self { outcomes: SmallVec::new(), admitted: true, bypass: None, failed_closed: false }
    }
}

/// Why a decision could not be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// Too many cold keys are waiting for shard actors; retrying later may help.
    #[error("too many new keys are being created at once; the node is overloaded")]
    Overloaded,
    /// A shard actor did not answer in time or has stopped; retrying may help.
    #[error("a shard actor did not create the request's keys in time")]
    ActorUnavailable,
    /// Keys kept disappearing between creation and decision (extreme eviction churn).
    #[error("the shard is evicting keys faster than they can be used")]
    Churn,
}

/// Per-key state in a stripe: what every decision reads, and what its reports name.
#[derive(Debug)]
struct Slot {
    lease: KeyLease,
    lease_key: LeaseKey,
    /// The slot's life in this process ([`LeaseEpoch::serial`]; the incarnation is the
    /// process's, kept once in [`EpochSource`]), for the ledger's settlement; also when it
    /// was made, which the sweep's grace counts from.
    epoch_serial: u64,
    /// Its [`SlotLimit`]'s id in the stripe's [`Stripe::limits`].
    limit: u32,
    key: CounterKey,
}

impl Keyed for Slot {
    type Key = CounterKey;

    fn key(&self) -> &CounterKey {
        &self.key
    }
}

/// The limit a slot's counter follows and the rule it belongs to: read only off the
/// decision path (reports, sweeps), and shared by most of a stripe's keys, so kept once per
/// stripe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SlotLimit {
    /// The limit (settle reports name it; the probe's own on the decision path).
    spec: PackedLimitSpec,
    /// The owning rule's id ([`NO_RULE`] for an override), for its lease tuning and gauges.
    rule: u32,
}

/// The parts of a slot that a key needs only while its ledger is or was recently out of
/// reach, or its fixed window is overrun: most keys never do, so they are kept beside the
/// slots ([`RareTable`]) and cost the others nothing.
#[derive(Debug, Clone, Copy, Default)]
struct RareParts {
    fallback: Option<Fallback>,
    /// A fixed window refused hits past what was left: until its end (0: never) every hit is
    /// refused and every leased token spent (`admission::overrun_until_ms`).
    overrun_until_ms: u64,
}

// The slot, with its key, is what a tracked key costs (issue targets: resident bytes per
// key), with 5 bytes of the stripe's table per bucket; a field added here is a deliberate
// cost.
const _: () = assert!(size_of::<Slot>() <= 120);

/// The rare parts of a stripe's keys, by key: an entry only while a key has some, so a
/// stripe whose ledger answers holds none and a decision reads nothing but the empty table.
#[derive(Default)]
struct RareTable(HashMap<CounterKey, RareParts, BuildHasherDefault<FingerprintHasher>>);

impl RareTable {
    fn fallback(&self, key: &CounterKey) -> Option<Fallback> {
        self.get(key).and_then(|rare| rare.fallback)
    }

    fn overrun_until_ms(&self, key: &CounterKey) -> u64 {
        self.get(key).map_or(0, |rare| rare.overrun_until_ms)
    }

    fn set_fallback(&mut self, key: CounterKey, fallback: Option<Fallback>) {
        self.change(key, |rare| rare.fallback = fallback);
    }

    fn set_overrun_until_ms(&mut self, key: CounterKey, until_ms: u64) {
        self.change(key, |rare| rare.overrun_until_ms = until_ms);
    }

    /// Forgets a key that leaves its stripe.
    fn forget(&mut self, key: &CounterKey) {
        if !self.0.is_empty() {
            self.0.remove(key);
        }
    }

    fn get(&self, key: &CounterKey) -> Option<&RareParts> {
        // Most stripes hold none: no hashing then.
        if self.0.is_empty() { None } else { self.0.get(key) }
    }

    /// Changes a key's rare parts, dropping its entry once nothing is left in it.
    fn change(&mut self, key: CounterKey, change: impl FnOnce(&mut RareParts)) {
        let rare = self.0.entry(key).or_default();
        change(rare);
        if rare.fallback.is_none() && rare.overrun_until_ms == 0 {
            self.0.remove(&key);
        }
    }
}

/// A stripe's keys and the limits they follow.
#[derive(Default)]
struct Stripe {
    /// The keys, side by side: a hash table sits between half and seven eighths full, and
    /// its empty buckets then cost a 32-bit position each rather than a whole slot.
    slots: DenseMap<Slot, BuildHasherDefault<FingerprintHasher>>,
    /// Each slot holds one of these ids; an id lives while a slot holds it.
    limits: Interner<SlotLimit>,
    /// The few keys' rare parts.
    rare: RareTable,
}

impl Stripe {
    /// Removes `key`, releasing its limit: the slot, and what its limit was.
    fn remove(&mut self, key: &CounterKey) -> Option<(Slot, SlotLimit)> {
        let slot = self.slots.remove(key)?;
        let limit = self.limits.get(slot.limit);
        self.limits.release(slot.limit);
        self.rare.forget(key);
        Some((slot, limit))
    }
}

/// The published state of one shard: its stripes, and what its last sweep counted.
struct ShardTable {
    stripes: Box<[Mutex<Stripe>]>,
    /// Per stripe, the requests waiting for a lease on one of its keys: an answer wakes the
    /// waiters of its own stripe only, not every waiting request of the node.
    answered: Box<[Notify]>,
    /// Leased tokens held per rule id at the last sweep.
    held_by_rule: Mutex<HashMap<u32, u64>>,
}

impl ShardTable {
    fn new() -> Self {
        Self {
            stripes: (0..STRIPES_PER_SHARD).map(|_| Mutex::new(Stripe::default())).collect(),
            answered: (0..STRIPES_PER_SHARD).map(|_| Notify::new()).collect(),
            held_by_rule: Mutex::new(HashMap::new()),
        }
    }
}

/// A key a handler found missing, for its shard actor to create.
#[derive(Debug, Clone, Copy)]
pub struct ColdKey {
    stripe: u32,
    key: CounterKey,
    lease_key: LeaseKey,
    rule: u32,
    spec: LimitSpec,
}

/// Messages to a shard actor.
pub enum ShardMsg {
    /// Create these keys (those that still do not exist), then reply.
    Admit {
        /// The keys.
        keys: Vec<ColdKey>,
        /// The handler's time.
        now_ms: u64,
        /// Answered once the keys exist.
        reply: oneshot::Sender<()>,
    },
    /// The lease broker's answers to this shard's asks.
    Answers(LeaseAnswers),
    /// Return surplus and idle balances, drop keys that hold nothing.
    Sweep {
        /// The sweep's time.
        now_ms: u64,
    },
}

impl From<LeaseAnswers> for ShardMsg {
    fn from(answers: LeaseAnswers) -> Self {
        Self::Answers(answers)
    }
}

impl TryFrom<ShardMsg> for LeaseAnswers {
    type Error = ShardMsg;

    fn try_from(message: ShardMsg) -> Result<Self, ShardMsg> {
        match message {
            ShardMsg::Answers(answers) => Ok(answers),
            other => Err(other),
        }
    }
}

/// Where a node's settlement epochs come from: the process's start, and a slot's serial,
/// which is also when the slot was made: microseconds of node time since the start, one
/// more than the last serial when slots are made faster than that (or the clock stepped
/// back), so that serials only grow.
#[derive(Debug)]
struct EpochSource {
    incarnation_us: u64,
    last_serial: AtomicU64,
}

impl EpochSource {
    fn new() -> Self {
        Self { incarnation_us: crate::clock::now_us(), last_serial: AtomicU64::new(0) }
    }

    /// The serial of a slot made at node time `now_ms`.
    fn next_serial(&self, now_ms: u64) -> u64 {
        let since_start_us = now_ms.saturating_mul(1000).saturating_sub(self.incarnation_us);
        let mut last = self.last_serial.load(Ordering::Relaxed);
        loop {
            let next = since_start_us.max(last + 1);
            match self.last_serial.compare_exchange_weak(
                last,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return next,
                Err(seen) => last = seen,
            }
        }
    }

    /// The epoch of the slot with `serial`.
    fn epoch(&self, serial: u64) -> LeaseEpoch {
        LeaseEpoch { incarnation: self.incarnation_us, serial }
    }

    /// Node time until which the sweep keeps the slot with `serial`: [`FRESH_KEY_GRACE_MS`]
    /// from when it was made (later, when serials ran ahead of the clock).
    fn keep_until_ms(&self, serial: u64) -> u64 {
        let made_ms = self.incarnation_us.saturating_add(serial).div_ceil(1000);
        made_ms.saturating_add(FRESH_KEY_GRACE_MS)
    }
}

/// The shard actor: owner of its table's key set.
struct ShardActor;

/// A shard actor's state.
struct ShardActorState {
    shard_label: String,
    table: Arc<ShardTable>,
    keys_max: usize,
    nodes_in_region: u64,
    key_count: usize,
    /// Next stripe to evict from when the target stripe is empty.
    eviction_cursor: usize,
    /// Where in a stripe's entries the next eviction's sample starts: it moves on by a
    /// sample each time, so that every key is sampled in turn.
    eviction_sample_at: usize,
    broker: LeaseBroker,
    /// This actor, as the broker addresses its answers.
    answers_to: DerivedActorRef<LeaseAnswers>,
    epochs: Arc<EpochSource>,
    policy: Arc<ArcSwap<PolicySet>>,
    metrics: Metrics,
}

/// What a shard actor is started with.
struct ShardArguments {
    index: usize,
    table: Arc<ShardTable>,
    keys_max: usize,
    nodes_in_region: u64,
    broker: LeaseBroker,
    epochs: Arc<EpochSource>,
    policy: Arc<ArcSwap<PolicySet>>,
    metrics: Metrics,
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardActorState;
    type Arguments = ShardArguments;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        arguments: ShardArguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ShardActorState {
            shard_label: arguments.index.to_string(),
            table: arguments.table,
            keys_max: arguments.keys_max,
            nodes_in_region: arguments.nodes_in_region,
            key_count: 0,
            eviction_cursor: 0,
            eviction_sample_at: 0,
            broker: arguments.broker,
            answers_to: myself.get_derived(),
            epochs: arguments.epochs,
            policy: arguments.policy,
            metrics: arguments.metrics,
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: ShardMsg,
        state: &mut ShardActorState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            ShardMsg::Admit { keys, now_ms, reply } => {
                state.admit(&keys, now_ms);
                // The handler may have timed out and gone; nothing to do then.
                let _ = reply.send(());
            }
            ShardMsg::Answers(answers) => {
                state.apply_answers(answers);
                return Ok(());
            }
            ShardMsg::Sweep { now_ms } => state.sweep(now_ms),
        }
        state
            .metrics
            .shard_keys
            .with_label_values(&[&state.shard_label])
            .set(i64::try_from(state.key_count).unwrap_or(i64::MAX));
        Ok(())
    }
}

impl ShardActorState {
    fn admit(&mut self, keys: &[ColdKey], now_ms: u64) {
        let mut created = 0_u64;
        for cold in keys {
            let stripe_index = cold.stripe as usize;
            if self.table.stripes[stripe_index].lock().slots.get(&cold.key).is_some() {
                continue;
            }
            if self.key_count >= self.keys_max {
                self.evict_one(stripe_index, now_ms);
            }
            let capacity_tokens = cold.spec.capacity_tokens();
            let mut stripe = self.table.stripes[stripe_index].lock();
            let limit = SlotLimit { spec: PackedLimitSpec::pack(&cold.spec), rule: cold.rule };
            let slot = Slot {
                lease: KeyLease::new(
                    capacity_tokens,
                    size_cap_tokens(capacity_tokens, self.nodes_in_region),
                ),
                lease_key: cold.lease_key,
                epoch_serial: self.epochs.next_serial(now_ms),
                limit: stripe.limits.acquire(limit),
                key: cold.key,
            };
            stripe.slots.insert(slot);
            self.key_count += 1;
            created += 1;
        }
        self.metrics.shard_cold_admissions.with_label_values(&[&self.shard_label]).inc_by(created);
    }

    /// Applies the ledger's answers and wakes the handlers waiting for them. An answer for a
    /// slot's earlier life (the slot was removed after a final settle) has nothing to apply.
    fn apply_answers(&mut self, LeaseAnswers(answers): LeaseAnswers) {
        let now_ms = crate::clock::now_ms();
        // The stripes answered, one bit each: each one's waiters are woken once, at the end.
        let mut answered_stripes: u64 = 0;
        for (ask, answer) in answers {
            answered_stripes |= 1 << ask.stripe;
            let mut stripe = self.table.stripes[ask.stripe as usize].lock();
            let Stripe { slots, limits, rare } = &mut *stripe;
            if let Some(slot) = slots
                .get_mut(&ask.counter)
                .filter(|slot| self.epochs.epoch(slot.epoch_serial) == ask.epoch)
            {
                slot.lease.apply_answer(&ask.tuning, &ask.draft, answer, now_ms);
                if rare.overrun_until_ms(&ask.counter) > now_ms {
                    // What a lease brings to an overrun window is spent: the window's count
                    // stays at its limit.
                    admission::spend_what_is_left(&mut slot.lease, now_ms);
                }
                let spec = limits.get(slot.limit).spec.unpack();
                if spec.algorithm != Algorithm::TokenBucket {
                    // A window's tokens are spent in that window or not at all (the window
                    // of the answer: the grant came between the send and now).
                    let window_ms = spec.window_ms.max(1);
                    slot.lease.expire_by((now_ms / window_ms + 1).saturating_mul(window_ms));
                }
                if matches!(answer, ReportAnswer::Settled { .. }) {
                    // The ledger answers again: a later fallback starts from its new count,
                    // not from a bucket filled while it was out of reach.
                    rare.set_fallback(ask.counter, None);
                }
            }
        }
        while answered_stripes != 0 {
            let stripe = answered_stripes.trailing_zeros();
            answered_stripes &= answered_stripes - 1;
            self.table.answered[stripe as usize].notify_waiters();
        }
    }

    /// Hands a settle report for `slot`, whose counter follows `spec`, to the broker, when
    /// the ledger's count differs.
    fn settle(
        &self,
        stripe: u32,
        slot: &mut Slot,
        spec: LimitSpec,
        tuning: &LeaseTuning,
        now_ms: u64,
    ) {
        if let Some(draft) = slot.lease.poll_settle(tuning, now_ms) {
            let ask = LeaseAsk {
                reply_to: self.answers_to.clone(),
                stripe,
                counter: slot.key,
                epoch: self.epochs.epoch(slot.epoch_serial),
                lease_key: slot.lease_key,
                spec,
                tuning: *tuning,
                draft,
            };
            if !self.broker.ask(ask) {
                slot.lease.apply_answer(tuning, &draft, ReportAnswer::NotApplied, now_ms);
            }
        }
    }

    /// Evicts the sampled key used least recently, from `preferred` or else the next
    /// non-empty stripe, returning its balance to the ledger.
    fn evict_one(&mut self, preferred: usize, now_ms: u64) {
        let stripe_count = self.table.stripes.len();
        for offset in 0..=stripe_count {
            let index = if offset == 0 {
                preferred
            } else {
                (self.eviction_cursor + offset) % stripe_count
            };
            let mut stripe = self.table.stripes[index].lock();
            // A key with a report in flight stays until its answer is applied.
            let victim = stripe
                .slots
                .iter_from(self.eviction_sample_at)
                .filter(|slot| !slot.lease.in_flight())
                .take(EVICTION_SAMPLE)
                .min_by_key(|slot| {
                    slot.lease.last_hit_ms().max(self.epochs.keep_until_ms(slot.epoch_serial))
                })
                .map(|slot| slot.key);
            if let Some(key) = victim {
                let (mut slot, limit) = stripe.remove(&key).expect("the victim was just seen");
                drop(stripe);
                let policy = self.policy.load();
                let tuning = policy
                    .rule(RuleId(limit.rule))
                    .map_or_else(LeaseTuning::default, |rule| rule.lease);
                slot.lease.take_all(now_ms);
                self.settle(
                    u32::try_from(index).expect("stripe index fits u32"),
                    &mut slot,
                    limit.spec.unpack(),
                    &tuning,
                    now_ms,
                );
                self.key_count -= 1;
                self.eviction_cursor = index;
                self.eviction_sample_at = self.eviction_sample_at.wrapping_add(EVICTION_SAMPLE);
                self.metrics
                    .shard_evictions
                    .with_label_values(&[&self.shard_label, "capacity"])
                    .inc();
                return;
            }
        }
    }

    /// Settles surplus balances (the lease size shrank with the traffic), the whole balance
    /// of idle keys, expired balances and spending on credit with the ledger; drops fallback
    /// buckets that are full again, and forgets keys that are idle and settled; counts what
    /// each rule's keys hold.
    fn sweep(&mut self, now_ms: u64) {
        let policy = self.policy.load();
        let default_tuning = LeaseTuning::default();
        let tuning_of =
            |rule: u32| policy.rule(RuleId(rule)).map_or(&default_tuning, |rule| &rule.lease);
        let mut removed = 0_usize;
        let mut held_by_rule: HashMap<u32, u64> = HashMap::new();
        for (stripe_index, stripe) in self.table.stripes.iter().enumerate() {
            let stripe_index = u32::try_from(stripe_index).expect("stripe index fits u32");
            let mut stripe = stripe.lock();
            let Stripe { slots, limits, rare } = &mut *stripe;
            let before = slots.len();
            slots.retain(|slot| {
                let counter = slot.key;
                let limit = limits.get(slot.limit);
                let spec = limit.spec.unpack();
                let tuning = tuning_of(limit.rule);
                // Idle for a lookahead: its traffic no longer needs the balance, which would
                // otherwise expire unspent (the TTL is two lookaheads from the last refill).
                let idle = now_ms.saturating_sub(slot.lease.last_hit_ms()) >= tuning.lookahead_ms;
                if !slot.lease.in_flight() {
                    if idle {
                        slot.lease.take_all(now_ms);
                    } else {
                        slot.lease.take_surplus(tuning, now_ms);
                    }
                }
                self.settle(stripe_index, slot, spec, tuning, now_ms);
                let held = slot.lease.balance_tokens(now_ms);
                if held > 0 {
                    *held_by_rule.entry(limit.rule).or_insert(0) += held;
                }
                let fallback = rare.fallback(&counter);
                if fallback.is_some_and(|f| f.spec.is_pristine(&f.state, now_ms)) {
                    rare.set_fallback(counter, None);
                }
                let keep = now_ms < self.epochs.keep_until_ms(slot.epoch_serial)
                    || !idle
                    || !slot.lease.is_settled(&spec, now_ms)
                    || rare.fallback(&counter).is_some();
                if !keep {
                    limits.release(slot.limit);
                    rare.forget(&counter);
                }
                keep
            });
            removed += before - slots.len();
        }
        *self.table.held_by_rule.lock() = held_by_rule;
        self.key_count -= removed;
        self.metrics
            .shard_evictions
            .with_label_values(&[&self.shard_label, "idle"])
            .inc_by(removed as u64);
    }
}

/// Settings of a [`ShardSet`].
#[derive(Debug, Clone, Copy)]
pub struct ShardSetOptions {
    /// Number of shard actors.
    pub shard_count: usize,
    /// Keys one shard tracks at most.
    pub keys_per_shard_max: usize,
    /// Interval of the sweep (returns, idle keys, gauges).
    pub sweep_interval: Duration,
    /// Longest a request waits for a lease before deciding from the fallback: within
    /// Envoy's own RLS timeout (its ratelimit filter's default is 20 ms).
    pub wait_budget: Duration,
    /// Fallback bucket size as a share of the limit, in per mille of `limit / nodes`.
    pub fallback_multiplier_permille: u64,
    /// Nodes leasing from the region's ledger: the fallback bucket is `1 / nodes` of the
    /// limit, and the drift bound counts `nodes` holders.
    pub nodes_in_region: u64,
}

struct Shard {
    table: Arc<ShardTable>,
    actor: ActorRef<ShardMsg>,
    /// The actor, as the broker addresses answers.
    answers_to: DerivedActorRef<LeaseAnswers>,
    join: tokio::task::JoinHandle<()>,
}

/// All shards of a node: routing, the decision procedure, and the actors' life cycle.
pub struct ShardSet {
    shards: Box<[Shard]>,
    /// The process's secret key for descriptor hashes: clients cannot choose colliding
    /// descriptors without it.
    hash_keys: (u64, u64),
    cold_permits: Arc<Semaphore>,
    lease_waiters: Arc<Semaphore>,
    broker: LeaseBroker,
    options: ShardSetOptions,
    epochs: Arc<EpochSource>,
    metrics: Metrics,
    sweeper: tokio::task::JoinHandle<()>,
}

/// The hashing state of one descriptor, from which its stripe and counters derive.
pub struct DescriptorHash {
    low: u64,
    high: u64,
}

/// Why the shard actors could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot start shard actor {index}: {message}")]
pub struct ShardSpawnError {
    index: usize,
    message: String,
}

/// A decision [`ShardSet::decide_now`] could not make from memory: finish it with
/// [`ShardSet::decide_deferred`].
pub struct Deferred(Pending);

/// What a locked pass could not decide yet.
enum Pending {
    /// Keys that do not exist yet, per shard.
    Missing(Vec<Vec<ColdKey>>),
    /// Keys whose lease is on the way.
    Leasing,
}

impl ShardSet {
    /// Spawns the shard actors and their sweep timer. Leases come from `broker`; `policy`
    /// gives the sweep each rule's lease tuning and gauge labels.
    ///
    /// # Errors
    /// [`ShardSpawnError`] when ractor cannot spawn an actor.
    pub async fn start(
        options: ShardSetOptions,
        metrics: &Metrics,
        broker: LeaseBroker,
        policy: Arc<ArcSwap<PolicySet>>,
    ) -> Result<Self, ShardSpawnError> {
        let epochs = Arc::new(EpochSource::new());
        let mut shards = Vec::with_capacity(options.shard_count);
        for index in 0..options.shard_count.max(1) {
            let table = Arc::new(ShardTable::new());
            let arguments = ShardArguments {
                index,
                table: Arc::clone(&table),
                keys_max: options.keys_per_shard_max,
                nodes_in_region: options.nodes_in_region,
                broker: broker.clone(),
                epochs: Arc::clone(&epochs),
                policy: Arc::clone(&policy),
                metrics: metrics.clone(),
            };
            let (actor, join) = Actor::spawn(None, ShardActor, arguments)
                .await
                .map_err(|error| ShardSpawnError { index, message: error.to_string() })?;
            let join = tokio::spawn(async move {
                let _ = join.await;
            });
            shards.push(Shard { table, answers_to: actor.get_derived(), actor, join });
        }
        let sweeper = tokio::spawn(sweep_forever(
            shards.iter().map(|shard| (shard.actor.clone(), Arc::clone(&shard.table))).collect(),
            broker.clone(),
            options,
            policy,
            metrics.clone(),
        ));
        Ok(Self {
            shards: shards.into_boxed_slice(),
            hash_keys: (random_word(), random_word()),
            cold_permits: Arc::new(Semaphore::new(COLD_ADMISSIONS_INFLIGHT_MAX)),
            lease_waiters: Arc::new(Semaphore::new(LEASE_WAITERS_MAX)),
            broker,
            options,
            epochs,
            metrics: metrics.clone(),
            sweeper,
        })
    }

    /// Hashes a descriptor: its domain and entries, in order, in one keyed 128-bit pass
    /// (SipHash-1-3, as std's maps use, with twice the output).
    pub fn hash_descriptor<'e>(
        &self,
        domain: &str,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> DescriptorHash {
        let mut hasher = SipHasher13::new_with_keys(self.hash_keys.0, self.hash_keys.1);
        domain.hash(&mut hasher);
        for (key, value) in entries {
            key.hash(&mut hasher);
            value.hash(&mut hasher);
        }
        let Hash128 { h1, h2 } = hasher.finish128();
        DescriptorHash { low: h1, high: h2 }
    }

    /// The stripe that holds every counter of a descriptor.
    pub fn stripe_of(&self, descriptor: &DescriptorHash) -> StripeId {
        let word = descriptor.high;
        let shard_count = self.shards.len() as u64;
        StripeId {
            shard: u32::try_from(word % shard_count).expect("shard count fits u32"),
            stripe: u32::try_from((word >> 32) % STRIPES_PER_SHARD as u64)
                .expect("stripe count fits u32"),
        }
    }

    /// The counter of a descriptor's `index`-th limit. The limit's numbers are part of the
    /// key, so a changed limit starts from a fresh state instead of misreading an old one.
    ///
    /// The descriptor's keyed hashes already resist collisions chosen by clients; the limit
    /// only needs mixing in, which a finalizer does without another keyed pass.
    pub fn counter_of(
        &self,
        descriptor: &DescriptorHash,
        index: usize,
        spec: &LimitSpec,
    ) -> CounterKey {
        let algorithm = spec.algorithm as u64;
        let limit = mix(index as u64 ^ algorithm.rotate_left(32))
            ^ mix(spec.requests_per_window).rotate_left(17)
            ^ mix(spec.window_ms).rotate_left(31)
            ^ mix(spec.burst_tokens).rotate_left(47);
        CounterKey::from_hash(
            mix(descriptor.low ^ limit),
            mix(descriptor.high ^ limit.rotate_left(29)),
        )
    }

    /// Decides a request: every probe's limits are decided under the stripes' locks, and
    /// states are consumed only if every enforced probe admits its hits.
    ///
    /// A fail-open key whose balance does not cover its hits is admitted on credit when it
    /// may be (its first hits, the gap while a refill is on the way), else waits for its
    /// lease at most `wait_budget` from the call, then decides from the fallback; while the
    /// circuit is open it decides from the fallback at once. Every admission is charged to
    /// the ledger, so none of these timings decides a count.
    ///
    /// # Errors
    /// [`ShardError`] when new keys could not be created (overload, actor gone, churn).
    pub async fn decide(&self, probes: &[Probe<'_>], now_ms: u64) -> Result<Decision, ShardError> {
        match self.decide_now(probes, now_ms) {
            Ok(decision) => Ok(decision),
            Err(deferred) => self.decide_deferred(probes, now_ms, deferred).await,
        }
    }

    /// Decides a request from memory in one locked pass, as the first pass of
    /// [`ShardSet::decide`]; a request with keys to create or a lease to wait for is handed
    /// back, its asks sent. Most requests end here, so a caller that keeps the waiting path
    /// out of line pays nothing for it.
    ///
    /// # Errors
    /// [`Deferred`] when the decision needs new keys or a lease first.
    pub fn decide_now(&self, probes: &[Probe<'_>], now_ms: u64) -> Result<Decision, Deferred> {
        let decision =
            self.try_decide(probes, now_ms, self.short_keys_at_first()).map_err(Deferred)?;
        self.count(&decision);
        Ok(decision)
    }

    /// Finishes a decision [`ShardSet::decide_now`] deferred, for the same probes: creates
    /// the keys it found missing, waits for leases (see [`ShardSet::decide`]).
    ///
    /// # Errors
    /// [`ShardError`] when new keys could not be created (overload, actor gone, churn).
    pub async fn decide_deferred(
        &self,
        probes: &[Probe<'_>],
        now_ms: u64,
        deferred: Deferred,
    ) -> Result<Decision, ShardError> {
        let started = tokio::time::Instant::now();
        let deadline = started + self.options.wait_budget;
        let mut cold_rounds = 0;
        if let Deferred(Pending::Missing(missing)) = deferred {
            cold_rounds += 1;
            self.admit_cold(missing, now_ms).await?;
        }
        // A pass that found a key short is redone: only a pass after the waiter registers
        // can be sure not to miss the answer.
        let mut short_keys = self.short_keys_at_first();
        let mut decide_ms = now_ms;
        let mut waiting = None;
        loop {
            // Registered before the pass, so an answer applied during it is not missed.
            let mut answered = self.answered_events(probes);
            match self.try_decide(probes, decide_ms, short_keys) {
                Ok(decision) => {
                    self.count(&decision);
                    return Ok(decision);
                }
                Err(Pending::Missing(missing)) => {
                    cold_rounds += 1;
                    if cold_rounds > COLD_ROUNDS_MAX {
                        return Err(ShardError::Churn);
                    }
                    self.admit_cold(missing, decide_ms).await?;
                }
                Err(Pending::Leasing) => {
                    if waiting.is_none() {
                        self.metrics.lease_waits.inc();
                        match Arc::clone(&self.lease_waiters).try_acquire_owned() {
                            Ok(permit) => waiting = Some(permit),
                            Err(_) => {
                                short_keys = ShortKeys::Fallback(BypassReason::Overloaded);
                                continue;
                            }
                        }
                    }
                    if tokio::time::timeout_at(deadline, any_answered(&mut answered)).await.is_err()
                    {
                        short_keys = ShortKeys::Fallback(BypassReason::LedgerTimeout);
                    } else if self.broker.circuit_open() {
                        short_keys = ShortKeys::Fallback(BypassReason::CircuitOpen);
                    }
                    let waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(0);
                    decide_ms = now_ms.saturating_add(waited_ms);
                }
            }
        }
    }

    /// Registers for the answers to every stripe `probes` touch (a request has a few).
    fn answered_events(&self, probes: &[Probe<'_>]) -> SmallVec<[Pin<Box<Notified<'_>>>; 2]> {
        let mut stripes: SmallVec<[StripeId; 4]> =
            probes.iter().map(|probe| probe.stripe).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes
            .iter()
            .map(|id| {
                let table = &self.shards[id.shard as usize].table;
                let mut notified = Box::pin(table.answered[id.stripe as usize].notified());
                notified.as_mut().enable();
                notified
            })
            .collect()
    }

    /// How a first pass treats keys whose balance is short: wait for their lease, unless the
    /// circuit is open.
    fn short_keys_at_first(&self) -> ShortKeys {
        if self.broker.circuit_open() {
            ShortKeys::Fallback(BypassReason::CircuitOpen)
        } else {
            ShortKeys::Wait
        }
    }

    fn count(&self, decision: &Decision) {
        if let (true, Some(reason)) = (decision.admitted, decision.bypass) {
            self.metrics.rate_limit_bypassed.with_label_values(&[reason.label()]).inc();
        }
        if decision.failed_closed {
            self.metrics.rate_limit_failed_closed.inc();
        }
    }

    /// One locked pass.
    fn try_decide(
        &self,
        probes: &[Probe<'_>],
        now_ms: u64,
        short_keys: ShortKeys,
    ) -> Result<Decision, Pending> {
        let region = Region {
            nodes_in_region: self.options.nodes_in_region,
            fallback_multiplier_permille: self.options.fallback_multiplier_permille,
        };
        // Requests carry a few descriptors: keep the bookkeeping on the stack.
        let mut order: SmallVec<[StripeId; 4]> = probes.iter().map(|probe| probe.stripe).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: SmallVec<[MutexGuard<'_, Stripe>; 4]> = order
            .iter()
            .map(|id| self.shards[id.shard as usize].table.stripes[id.stripe as usize].lock())
            .collect();
        let guard_of =
            |id: StripeId| order.binary_search(&id).expect("every probe's stripe is locked");

        let mut missing: Vec<Vec<ColdKey>> = Vec::new();
        let mut short: SmallVec<[(usize, usize); 2]> = SmallVec::new();
        let mut refills: SmallVec<[(usize, usize); 2]> = SmallVec::new();
        let mut outcomes: SmallVec<[ProbeOutcome; 2]> = SmallVec::with_capacity(probes.len());
        let mut judged: SmallVec<[(usize, usize); 4]> = SmallVec::new();
        // Counters that refused hits a request wanted to consume.
        let mut refused: SmallVec<[(usize, usize); 2]> = SmallVec::new();
        // States this request would write, in order: a counter met twice in one request
        // (two identical descriptors) is decided against its already-consumed state.
        let mut pending: SmallVec<[(usize, usize, Staged); 4]> = SmallVec::new();
        let mut admitted = true;
        // Quota-mode probes: whether there were any, and whether one admitted.
        let (mut quota_probes, mut quota_admitted) = (false, false);
        let mut bypass = None;
        let mut failed_closed = false;
        for (probe_index, probe) in probes.iter().enumerate() {
            let stripe = &guards[guard_of(probe.stripe)];
            let mut verdicts: SmallVec<[Verdict; 2]> =
                SmallVec::with_capacity(probe.counters.len());
            // This probe's states go straight into `pending` and are taken out again unless the
            // probe is admitted (its counters are distinct keys: none reads another's).
            let staged_from = pending.len();
            for (counter_index, ProbeCounter { key, spec, ledger_spec }) in
                probe.counters.iter().enumerate()
            {
                let Some(slot) = stripe.slots.get(key) else {
                    if missing.is_empty() {
                        missing = vec![Vec::new(); self.shards.len()];
                    }
                    missing[probe.stripe.shard as usize].push(ColdKey {
                        stripe: probe.stripe.stripe,
                        key: *key,
                        lease_key: LeaseKey::of(
                            probe.name.domain,
                            probe.name.entries.iter().copied(),
                            counter_index,
                            ledger_spec,
                        ),
                        rule: probe.rule.map_or(NO_RULE, |rule| rule.0),
                        spec: LimitSpec::clone(spec),
                    });
                    continue;
                };
                let earlier = pending.iter().rev().find(|(earlier_probe, earlier_counter, _)| {
                    probes[*earlier_probe].counters[*earlier_counter].key == *key
                });
                let current = earlier.map_or_else(
                    || Staged { lease: slot.lease, fallback: stripe.rare.fallback(key) },
                    |(_, _, staged)| *staged,
                );
                let counter = Self::counter(probe, spec);
                let judgement =
                    match admission::overrun_verdict(stripe.rare.overrun_until_ms(key), now_ms) {
                        Some(verdict) => Judged::Decided {
                            verdict,
                            staged: current,
                            bypass: None,
                            failed_closed: false,
                            on_credit: false,
                        },
                        None => admission::judge(&current, &counter, &region, now_ms, short_keys),
                    };
                if !matches!(judgement, Judged::Short) {
                    judged.push((probe_index, counter_index));
                }
                match judgement {
                    Judged::Decided {
                        verdict,
                        staged,
                        bypass: paid_by,
                        failed_closed: closed,
                        on_credit,
                    } => {
                        if on_credit {
                            self.metrics.lease_credit_admissions.inc();
                        }
                        if !verdict.admitted && !probe.check_only {
                            refused.push((probe_index, counter_index));
                        }
                        verdicts.push(verdict);
                        pending.push((probe_index, counter_index, staged));
                        if verdict.admitted && bypass.is_none() {
                            bypass = paid_by;
                        }
                        failed_closed |= closed && probe.enforced;
                    }
                    Judged::AtLimit { verdict } => {
                        if !probe.check_only {
                            refused.push((probe_index, counter_index));
                        }
                        verdicts.push(verdict);
                        refills.push((probe_index, counter_index));
                    }
                    Judged::Short => short.push((probe_index, counter_index)),
                }
            }
            let probe_admitted = verdicts.iter().all(|verdict| verdict.admitted);
            if probe.enforced && probe.quota_mode {
                quota_probes = true;
                quota_admitted |= probe_admitted;
            } else {
                admitted &= probe_admitted || !probe.enforced;
            }
            if probe.check_only {
                // The check's hit was never taken: what is left includes it.
                for (verdict, counter) in verdicts.iter_mut().zip(&probe.counters) {
                    if verdict.admitted {
                        verdict.remaining = verdict
                            .remaining
                            .saturating_add(probe.hits)
                            .min(counter.spec.capacity_tokens());
                    }
                }
            }
            // A shadow rule that would have rejected keeps its quota, like a real rejection.
            if probe.check_only || !probe_admitted {
                pending.truncate(staged_from);
            }
            outcomes.push(ProbeOutcome { verdicts, admitted: probe_admitted, over_permille: 0 });
        }
        if quota_probes && !quota_admitted {
            admitted = false;
        }
        if !missing.is_empty() {
            return Err(Pending::Missing(missing));
        }
        let mut asks: SmallVec<[(StripeId, LeaseAsk); 2]> = SmallVec::new();
        if !short.is_empty() || short_keys == ShortKeys::Wait {
            for (probe_index, counter_index) in short.iter().chain(&refills).copied() {
                let probe = &probes[probe_index];
                let key = probe.counters[counter_index].key;
                let stripe = &mut guards[guard_of(probe.stripe)];
                let slot = stripe.slots.get_mut(&key).expect("a short key exists");
                if let Some(draft) = slot.lease.poll_lease_for(probe.lease, now_ms, probe.hits) {
                    asks.push((probe.stripe, self.ask(probe, counter_index, slot, draft)));
                }
            }
        }
        if !short.is_empty() {
            drop(guards);
            self.send_asks(&mut asks);
            return Err(Pending::Leasing);
        }
        if admitted {
            // By reference: a staged state is large, and each is copied once, into its slot.
            for &(probe_index, counter_index, ref staged) in &pending {
                let probe = &probes[probe_index];
                let key = probe.counters[counter_index].key;
                let Stripe { slots, rare, .. } = &mut *guards[guard_of(probe.stripe)];
                let slot = slots.get_mut(&key).expect("a decided key exists");
                slot.lease = staged.lease;
                if staged.fallback != rare.fallback(&key) {
                    rare.set_fallback(key, staged.fallback);
                }
                // While the circuit is open only the broker's probes reach the ledger.
                if short_keys == ShortKeys::Wait
                    && let Some(draft) = slot.lease.poll_refill(probe.lease, now_ms)
                {
                    asks.push((probe.stripe, self.ask(probe, counter_index, slot, draft)));
                }
            }
        }
        // A fixed window that refused hits past what was left is over its limit until it ends,
        // as upstream counts them.
        for (probe_index, counter_index) in refused {
            let probe = &probes[probe_index];
            let ProbeCounter { key, spec, .. } = probe.counters[counter_index];
            let Stripe { slots, rare, .. } = &mut *guards[guard_of(probe.stripe)];
            if let Some(slot) = slots.get_mut(&key)
                && let Some(until_ms) =
                    admission::overrun_until_ms(&slot.lease, spec, probe.hits, now_ms)
            {
                rare.set_overrun_until_ms(key, until_ms);
                admission::spend_what_is_left(&mut slot.lease, now_ms);
                // The refusal spent the window: its own answer says so, as every later one
                // will (a fallback's refusal would still show the fallback's balance).
                if let Some(verdict) = admission::overrun_verdict(until_ms, now_ms) {
                    outcomes[probe_index].verdicts[counter_index] = verdict;
                }
            }
        }
        // A counter whose state was not written (a rejection consumes nothing) still counts
        // its hits as demand: without them a key at its limit would look uncontended.
        for (probe_index, counter_index) in judged {
            let probe = &probes[probe_index];
            if admitted && outcomes[probe_index].admitted && !probe.check_only {
                continue;
            }
            let ProbeCounter { key, spec, .. } = probe.counters[counter_index];
            let stripe = &mut guards[guard_of(probe.stripe)];
            if let Some(slot) = stripe.slots.get_mut(&key) {
                admission::record_rejected(&mut slot.lease, &Self::counter(probe, spec), now_ms);
                let outcome = &mut outcomes[probe_index];
                // A caller warned instead of refused is told how far over it is.
                if !probe.enforced && !outcome.verdicts[counter_index].admitted {
                    let demand = slot.lease.demand_milli_per_second(probe.lease, now_ms);
                    let over = admission::over_limit_permille(spec, demand, region.nodes_in_region)
                        .unwrap_or(u64::MAX);
                    outcome.over_permille = outcome.over_permille.max(over);
                }
            }
        }
        drop(guards);
        if !asks.is_empty() {
            self.send_asks(&mut asks);
        }
        Ok(Decision { outcomes, admitted, bypass, failed_closed })
    }

    /// One counter of `probe`, as admission sees it.
    fn counter<'c>(probe: &'c Probe<'_>, spec: &'c LimitSpec) -> Counter<'c> {
        Counter { spec, hits: probe.hits, tuning: probe.lease, failure_mode: probe.failure_mode }
    }

    /// The ask of `probe`'s `counter_index`-th counter, whose slot is `slot`. The probe's
    /// limit is the slot's: a counter's key is named by its limit.
    fn ask(
        &self,
        probe: &Probe<'_>,
        counter_index: usize,
        slot: &Slot,
        draft: ReportDraft,
    ) -> LeaseAsk {
        let ProbeCounter { key, spec, .. } = probe.counters[counter_index];
        LeaseAsk {
            reply_to: self.shards[probe.stripe.shard as usize].answers_to.clone(),
            stripe: probe.stripe.stripe,
            counter: key,
            epoch: self.epochs.epoch(slot.epoch_serial),
            lease_key: slot.lease_key,
            spec: *spec,
            tuning: *probe.lease,
            draft,
        }
    }

    /// Hands asks to the broker; an ask it cannot take is answered "not applied" on its key
    /// at once, so the key can ask again. Borrowed, not moved: most decisions ask nothing,
    /// and moving the inline asks would copy them on every one.
    fn send_asks(&self, asks: &mut SmallVec<[(StripeId, LeaseAsk); 2]>) {
        for (stripe, ask) in asks.drain(..) {
            let (counter, tuning, draft) = (ask.counter, ask.tuning, ask.draft);
            if self.broker.ask(ask) {
                self.metrics.lease_asks.with_label_values(&["queued"]).inc();
            } else {
                self.metrics.lease_asks.with_label_values(&["refused"]).inc();
                let table = &self.shards[stripe.shard as usize].table;
                if let Some(slot) =
                    table.stripes[stripe.stripe as usize].lock().slots.get_mut(&counter)
                {
                    // Refused as it was drafted: "now" is its send time.
                    slot.lease.apply_answer(
                        &tuning,
                        &draft,
                        ReportAnswer::NotApplied,
                        draft.sent_at_ms,
                    );
                }
            }
        }
    }

    async fn admit_cold(&self, missing: Vec<Vec<ColdKey>>, now_ms: u64) -> Result<(), ShardError> {
        let mut replies = Vec::new();
        for (shard, keys) in self.shards.iter().zip(missing) {
            if keys.is_empty() {
                continue;
            }
            let permit = Arc::clone(&self.cold_permits)
                .try_acquire_owned()
                .map_err(|_| ShardError::Overloaded)?;
            let (reply, answer) = oneshot::channel();
            shard
                .actor
                .cast(ShardMsg::Admit { keys, now_ms, reply })
                .map_err(|_| ShardError::ActorUnavailable)?;
            replies.push((permit, answer));
        }
        for (_permit, answer) in replies {
            match tokio::time::timeout(COLD_ADMISSION_TIMEOUT, answer).await {
                Ok(Ok(())) => {}
                _ => return Err(ShardError::ActorUnavailable),
            }
        }
        Ok(())
    }

    /// Keys tracked by all shards (sums the stripes; for tests and benchmarks).
    pub fn key_count(&self) -> usize {
        self.shards
            .iter()
            .flat_map(|shard| shard.table.stripes.iter())
            .map(|stripe| stripe.lock().slots.len())
            .sum()
    }

    /// Leased tokens this node holds now, over all keys (for tests and benchmarks).
    pub fn held_tokens(&self, now_ms: u64) -> u64 {
        self.shards
            .iter()
            .flat_map(|shard| shard.table.stripes.iter())
            .map(|stripe| {
                stripe
                    .lock()
                    .slots
                    .iter()
                    .map(|slot| slot.lease.balance_tokens(now_ms))
                    .sum::<u64>()
            })
            .sum()
    }

    /// Stops the sweep timer and every shard actor, and waits for them. Balances still
    /// held are not returned: the ledger expires them within their TTL (at most 1 s).
    pub async fn shutdown(self) {
        self.sweeper.abort();
        for shard in self.shards {
            shard.actor.stop(None);
            let _ = shard.join.await;
        }
    }
}

/// Every sweep interval: asks each shard actor to sweep, then publishes the per-rule lease
/// gauges from what the previous sweeps counted.
async fn sweep_forever(
    shards: Vec<(ActorRef<ShardMsg>, Arc<ShardTable>)>,
    broker: LeaseBroker,
    options: ShardSetOptions,
    policy: Arc<ArcSwap<PolicySet>>,
    metrics: Metrics,
) {
    let mut interval = tokio::time::interval(options.sweep_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let now_ms = crate::clock::now_ms();
        let mut held_by_rule: HashMap<u32, u64> = HashMap::new();
        for (actor, table) in &shards {
            // A stopped actor ends the sweeper with it.
            if actor.cast(ShardMsg::Sweep { now_ms }).is_err() {
                return;
            }
            for (rule, held) in table.held_by_rule.lock().iter() {
                *held_by_rule.entry(*rule).or_insert(0) += held;
            }
        }
        let policy = policy.load();
        metrics.lease_held_tokens.reset();
        metrics.lease_drift_bound_tokens.reset();
        for rule in policy.rules().filter(|rule| !rule.unlimited && !rule.limits.is_empty()) {
            let labels = [rule.domain.as_str(), rule.path.as_str()];
            let held = held_by_rule.get(&rule.id.0).copied().unwrap_or(0);
            metrics.lease_held_tokens.with_label_values(&labels).set(gauge_value(held));
            let fallback_permille =
                (!broker.circuit_closed()).then_some(options.fallback_multiplier_permille);
            let bound = rule
                .limits
                .iter()
                .map(|limit| {
                    rule.lease.drift_bound_tokens(
                        &limit.spec,
                        options.nodes_in_region,
                        rule.failure_mode == FailureMode::Open,
                        fallback_permille,
                    )
                })
                .max()
                .unwrap_or(0);
            metrics.lease_drift_bound_tokens.with_label_values(&labels).set(gauge_value(bound));
        }
    }
}

fn gauge_value(tokens: u64) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

/// Completes when any of `events` (registered with [`ShardSet::answered_events`]) fires.
async fn any_answered(events: &mut [Pin<Box<Notified<'_>>>]) {
    std::future::poll_fn(|context| {
        if events.iter_mut().any(|event| event.as_mut().poll(context).is_ready()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}

/// MurmurHash3's 64-bit finalizer: every input bit affects every output bit.
/// A random word, from the randomly keyed hasher std seeds from the operating system.
fn random_word() -> u64 {
    RandomState::new().build_hasher().finish()
}

fn mix(mut word: u64) -> u64 {
    word ^= word >> 33;
    word = word.wrapping_mul(0xff51_afd7_ed55_8ccd);
    word ^= word >> 33;
    word = word.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    word ^ (word >> 33)
}

//! Tenant-shard actors and the per-key state they own.
//!
//! Keys are spread over K shards by a process-random 128-bit hash of `(domain, descriptor
//! entries)`; each shard is a ractor actor plus a table of striped maps that it publishes
//! to the RLS handlers. Ownership is split by who may change what:
//!
//! - the **actor** alone inserts and removes keys: it creates a key on its first hit
//!   (a cold key, reached by a cast carrying a one-shot reply), evicts when the shard is
//!   full, and sweeps keys whose state has returned to that of a fresh key;
//! - an **RLS handler** only updates the state of keys that exist, under the stripe lock,
//!   using the pure math of `crate::core::rate`.
//!
//! A request's descriptors may live in several stripes. The handler locks all of them in
//! ascending order (no deadlock), decides every limit, and writes the new states back only
//! if the whole request is admitted: rejected hits never consume quota.
//!
//! Memory per key: a 16-byte fingerprint and a 32-byte slot in a hash map, about 100 bytes
//! with the map's spare capacity (measured by `benches/memory_per_key.rs`).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher, RandomState};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use smallvec::SmallVec;
use tokio::sync::{Semaphore, oneshot};

use crate::core::rate::{Evaluation, LimitSpec, LimitState};
use crate::metrics::Metrics;

/// Stripes per shard: enough that handlers on different cores rarely meet on one lock.
pub const STRIPES_PER_SHARD: usize = 64;
/// Cold-key admissions awaiting a shard actor at once, over all shards; beyond this the
/// node answers `UNAVAILABLE` instead of growing the actors' unbounded mailboxes.
pub const COLD_ADMISSIONS_INFLIGHT_MAX: usize = 4096;
/// How long a handler waits for a shard actor to create its keys.
pub const COLD_ADMISSION_TIMEOUT: Duration = Duration::from_millis(100);
/// Rounds of "create missing keys, then decide" before giving up: a key can be evicted
/// between its creation and the decision only under extreme churn.
pub const COLD_ROUNDS_MAX: usize = 3;
/// A freshly created key is kept at least this long even if it stays pristine, so the
/// sweep cannot remove it before the request that created it has used it.
pub const FRESH_KEY_GRACE_MS: u64 = 5_000;
/// Keys sampled when a full shard must evict one (approximate LRU, as Redis does).
const EVICTION_SAMPLE: usize = 16;

/// 128-bit fingerprint of one counter: (domain, descriptor entries, limit).
///
/// 128 bits make a collision between two clients' counters practically impossible
/// (about 1e-26 for a million keys), so the key strings need not be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterKey([u64; 2]);

impl Hash for CounterKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already a keyed hash: one word is all the map needs.
        state.write_u64(self.0[0]);
    }
}

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

/// One descriptor's counters in a request, ready to be decided.
#[derive(Debug)]
pub struct Probe<'p> {
    /// Where the counters live.
    pub stripe: StripeId,
    /// Each limit of the matched rule with its counter.
    pub counters: SmallVec<[(CounterKey, &'p LimitSpec); 2]>,
    /// Hits this descriptor adds.
    pub hits: u64,
    /// False for shadow-mode rules: evaluated and reported, never a reason to reject.
    pub enforced: bool,
}

/// What the limits of one probe said.
#[derive(Debug, Clone)]
pub struct ProbeOutcome {
    /// One evaluation per counter, in the probe's order.
    pub evaluations: Vec<Evaluation>,
    /// True when every limit admits the hits.
    pub admitted: bool,
}

/// The decision for a whole request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// One outcome per probe, in order.
    pub outcomes: Vec<ProbeOutcome>,
    /// True when every enforced probe is admitted; only then were states consumed.
    pub admitted: bool,
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

/// Per-key state in a stripe.
#[derive(Debug, Clone, Copy)]
struct Slot {
    state: LimitState,
    /// From this time on the state equals a fresh key's, so the sweep may drop it.
    pristine_at_ms: u64,
}

type Stripe = HashMap<CounterKey, Slot, BuildHasherDefault<FingerprintHasher>>;

/// The published state of one shard: its stripes.
struct ShardTable {
    stripes: Box<[Mutex<Stripe>]>,
}

impl ShardTable {
    fn new() -> Self {
        Self { stripes: (0..STRIPES_PER_SHARD).map(|_| Mutex::new(Stripe::default())).collect() }
    }
}

/// A key a handler found missing, for its shard actor to create.
#[derive(Debug, Clone, Copy)]
struct ColdKey {
    stripe: u32,
    key: CounterKey,
    state: LimitState,
}

/// Messages to a shard actor.
enum ShardMsg {
    /// Create these keys (those that still do not exist), then reply.
    Admit { keys: Vec<ColdKey>, now_ms: u64, reply: oneshot::Sender<()> },
    /// Drop keys that have returned to a fresh key's state.
    Sweep { now_ms: u64 },
}

/// The shard actor: owner of its table's key set.
struct ShardActor;

/// A shard actor's state.
struct ShardActorState {
    shard_label: String,
    table: Arc<ShardTable>,
    keys_max: usize,
    key_count: usize,
    /// Next stripe to evict from when the target stripe is empty.
    eviction_cursor: usize,
    metrics: Metrics,
}

/// What a shard actor is started with.
struct ShardArguments {
    index: usize,
    table: Arc<ShardTable>,
    keys_max: usize,
    metrics: Metrics,
}

impl Actor for ShardActor {
    type Msg = ShardMsg;
    type State = ShardActorState;
    type Arguments = ShardArguments;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        arguments: ShardArguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(ShardActorState {
            shard_label: arguments.index.to_string(),
            table: arguments.table,
            keys_max: arguments.keys_max,
            key_count: 0,
            eviction_cursor: 0,
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
            if self.table.stripes[stripe_index].lock().contains_key(&cold.key) {
                continue;
            }
            if self.key_count >= self.keys_max {
                self.evict_one(stripe_index);
            }
            let slot = Slot {
                state: cold.state,
                pristine_at_ms: now_ms.saturating_add(FRESH_KEY_GRACE_MS),
            };
            self.table.stripes[stripe_index].lock().insert(cold.key, slot);
            self.key_count += 1;
            created += 1;
        }
        self.metrics.shard_cold_admissions.with_label_values(&[&self.shard_label]).inc_by(created);
    }

    /// Evicts the sampled key that would turn pristine soonest (it holds the least
    /// information), from `preferred` or else the next non-empty stripe.
    fn evict_one(&mut self, preferred: usize) {
        let stripe_count = self.table.stripes.len();
        for offset in 0..=stripe_count {
            let index = if offset == 0 {
                preferred
            } else {
                (self.eviction_cursor + offset) % stripe_count
            };
            let mut stripe = self.table.stripes[index].lock();
            let victim = stripe
                .iter()
                .take(EVICTION_SAMPLE)
                .min_by_key(|(_, slot)| slot.pristine_at_ms)
                .map(|(key, _)| *key);
            if let Some(key) = victim {
                stripe.remove(&key);
                self.key_count -= 1;
                self.eviction_cursor = index;
                self.metrics
                    .shard_evictions
                    .with_label_values(&[&self.shard_label, "capacity"])
                    .inc();
                return;
            }
        }
    }

    fn sweep(&mut self, now_ms: u64) {
        let mut removed = 0_usize;
        for stripe in &self.table.stripes {
            let mut stripe = stripe.lock();
            let before = stripe.len();
            stripe.retain(|_, slot| slot.pristine_at_ms > now_ms);
            removed += before - stripe.len();
        }
        self.key_count -= removed;
        self.metrics
            .shard_evictions
            .with_label_values(&[&self.shard_label, "pristine"])
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
    /// Interval of the pristine-key sweep.
    pub sweep_interval: Duration,
}

struct Shard {
    table: Arc<ShardTable>,
    actor: ActorRef<ShardMsg>,
    join: tokio::task::JoinHandle<()>,
}

/// All shards of a node: routing, the decision procedure, and the actors' life cycle.
pub struct ShardSet {
    shards: Box<[Shard]>,
    hash_low: RandomState,
    hash_high: RandomState,
    cold_permits: Arc<Semaphore>,
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

impl ShardSet {
    /// Spawns the shard actors and their sweep timer.
    ///
    /// # Errors
    /// [`ShardSpawnError`] when ractor cannot spawn an actor.
    pub async fn start(
        options: ShardSetOptions,
        metrics: &Metrics,
    ) -> Result<Self, ShardSpawnError> {
        let mut shards = Vec::with_capacity(options.shard_count);
        for index in 0..options.shard_count.max(1) {
            let table = Arc::new(ShardTable::new());
            let arguments = ShardArguments {
                index,
                table: Arc::clone(&table),
                keys_max: options.keys_per_shard_max,
                metrics: metrics.clone(),
            };
            let (actor, join) = Actor::spawn(None, ShardActor, arguments)
                .await
                .map_err(|error| ShardSpawnError { index, message: error.to_string() })?;
            let join = tokio::spawn(async move {
                let _ = join.await;
            });
            shards.push(Shard { table, actor, join });
        }
        let actors: Vec<ActorRef<ShardMsg>> =
            shards.iter().map(|shard| shard.actor.clone()).collect();
        let sweeper = tokio::spawn(async move {
            let mut interval = tokio::time::interval(options.sweep_interval);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                interval.tick().await;
                let now_ms = crate::clock::now_ms();
                for actor in &actors {
                    // A stopped actor ends the sweeper with it.
                    if actor.cast(ShardMsg::Sweep { now_ms }).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Self {
            shards: shards.into_boxed_slice(),
            hash_low: RandomState::new(),
            hash_high: RandomState::new(),
            cold_permits: Arc::new(Semaphore::new(COLD_ADMISSIONS_INFLIGHT_MAX)),
            sweeper,
        })
    }

    /// Starts hashing a descriptor: its domain and entries, in order.
    pub fn hash_descriptor<'e>(
        &self,
        domain: &str,
        entries: impl Iterator<Item = (&'e str, &'e str)>,
    ) -> DescriptorHash {
        let mut low = self.hash_low.build_hasher();
        let mut high = self.hash_high.build_hasher();
        domain.hash(&mut low);
        domain.hash(&mut high);
        for (key, value) in entries {
            key.hash(&mut low);
            value.hash(&mut low);
            key.hash(&mut high);
            value.hash(&mut high);
        }
        DescriptorHash { low: low.finish(), high: high.finish() }
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
        CounterKey([mix(descriptor.low ^ limit), mix(descriptor.high ^ limit.rotate_left(29))])
    }

    /// Decides a request: every probe's limits are evaluated under the stripes' locks, and
    /// states are consumed only if every enforced probe admits its hits.
    ///
    /// # Errors
    /// [`ShardError`] when new keys could not be created (overload, actor gone, churn).
    pub async fn decide(&self, probes: &[Probe<'_>], now_ms: u64) -> Result<Decision, ShardError> {
        for _ in 0..COLD_ROUNDS_MAX {
            match self.try_decide(probes, now_ms) {
                Ok(decision) => return Ok(decision),
                Err(missing) => self.admit_cold(missing, now_ms).await?,
            }
        }
        Err(ShardError::Churn)
    }

    /// One locked pass; returns the missing keys per shard when some do not exist yet.
    fn try_decide(&self, probes: &[Probe<'_>], now_ms: u64) -> Result<Decision, Vec<Vec<ColdKey>>> {
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
        let mut outcomes = Vec::with_capacity(probes.len());
        // States this request would write, in order: a counter met twice in one request
        // (two identical descriptors) is evaluated against its already-consumed state.
        let mut pending: SmallVec<[(StripeId, CounterKey, Slot); 4]> = SmallVec::new();
        let mut admitted = true;
        for probe in probes {
            let stripe = &guards[guard_of(probe.stripe)];
            let mut evaluations = Vec::with_capacity(probe.counters.len());
            for (key, spec) in &probe.counters {
                let earlier = pending.iter().rev().find(|(_, pending_key, _)| pending_key == key);
                match earlier.map(|(_, _, slot)| slot).or_else(|| stripe.get(key)) {
                    Some(slot) => evaluations.push(spec.evaluate(&slot.state, now_ms, probe.hits)),
                    None => {
                        if missing.is_empty() {
                            missing = vec![Vec::new(); self.shards.len()];
                        }
                        missing[probe.stripe.shard as usize].push(ColdKey {
                            stripe: probe.stripe.stripe,
                            key: *key,
                            state: spec.initial_state(now_ms),
                        });
                    }
                }
            }
            let probe_admitted = evaluations.iter().all(|evaluation| evaluation.admitted);
            admitted &= probe_admitted || !probe.enforced;
            // A shadow rule that would have rejected keeps its quota, like a real rejection.
            if probe_admitted {
                for ((key, spec), evaluation) in probe.counters.iter().zip(&evaluations) {
                    let pristine_at_ms = now_ms.saturating_add(pristine_after_ms(spec, evaluation));
                    pending.push((
                        probe.stripe,
                        *key,
                        Slot { state: evaluation.next, pristine_at_ms },
                    ));
                }
            }
            outcomes.push(ProbeOutcome { evaluations, admitted: probe_admitted });
        }
        if !missing.is_empty() {
            return Err(missing);
        }
        if admitted {
            for (stripe_id, key, slot) in pending {
                guards[guard_of(stripe_id)].insert(key, slot);
            }
        }
        Ok(Decision { outcomes, admitted })
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
            .map(|stripe| stripe.lock().len())
            .sum()
    }

    /// Stops the sweep timer and every shard actor, and waits for them.
    pub async fn shutdown(self) {
        self.sweeper.abort();
        for shard in self.shards {
            shard.actor.stop(None);
            let _ = shard.join.await;
        }
    }
}

/// MurmurHash3's 64-bit finalizer: every input bit affects every output bit.
fn mix(mut word: u64) -> u64 {
    word ^= word >> 33;
    word = word.wrapping_mul(0xff51_afd7_ed55_8ccd);
    word ^= word >> 33;
    word = word.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    word ^ (word >> 33)
}

/// Milliseconds after an update at which a limit's state equals a fresh key's: a token
/// bucket once full again, a fixed window at its end, a sliding window one window later
/// (when the current window has become the previous one and weighs nothing).
fn pristine_after_ms(spec: &LimitSpec, evaluation: &Evaluation) -> u64 {
    use crate::core::rate::Algorithm;
    match spec.algorithm {
        Algorithm::TokenBucket | Algorithm::FixedWindow => evaluation.reset_ms,
        Algorithm::SlidingWindow => evaluation.reset_ms.saturating_add(spec.window_ms),
    }
}

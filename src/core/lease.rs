//! Local-first leasing, the node's side, as pure functions of time (DESIGN section 3).
//!
//! A node spends tokens it leased from the regional ledger. Per key it keeps a
//! [`KeyLease`]: the leased balance, when that balance expires, whether a lease request is
//! in flight (never more than one), `blocked_until_ms` (the ledger said no token is
//! available until then), and a [`RateEstimate`] of the key's local traffic, from which
//! [`LeaseTuning::lease_size_tokens`] sizes the next lease:
//!
//! ```text
//!   B = clamp(min_lease_tokens, rate * lookahead, max_lease_tokens)
//!   refill when balance < low watermark = max(1, B * low_watermark_percent / 100)
//!     raised to rate * 2 round trips (at most B - 1) while the ledger's bucket holds 2 B
//!     and the key is not divided between nodes
//! ```
//!
//! The raised watermark is for warm hot keys: a 500-token lease at 50,000 decisions/s lasts
//! 10 ms and its 20 % watermark 2 ms, less than a ledger commit, so without it requests would
//! wait at every refill. Up to `B - 1`, a key whose round trip outlasts half its lease keeps
//! a report in flight (half a lease still left a tenth of its decisions waiting at 50,000/s
//! on one core); a node then holds up to `2 B - 2`, which the drift bound counts. It applies
//! only while the bucket has plenty: a key near its limit, or divided between nodes by fair
//! shares, keeps the plain watermark, so asking early never takes from another node's share.
//!
//! B follows the rate estimate, which decays exponentially when traffic falls, so B decays
//! back to `min_lease_tokens`; the surplus above the new B goes back to the ledger.
//!
//! Expiry is conservative: a lease counts from when the node SENT its request (on the
//! node's clock), minus a margin, so the node stops spending before the ledger stops
//! counting the lease as live.
//!
//! Every admission is charged to the ledger: paid from a lease, or spent on credit (a cold
//! key's first hits, the gap while a refill is on the way, the fallback while the ledger is
//! out of reach) and then charged by the next report, which carries the key's totals
//! (`crate::core::ledger` settles them). So no wait and no timeout decides a count: they
//! only decide how long a request waits.
//!
//! The shard and lease-broker actors (`crate::actors`) hold these states and perform the
//! requests; nothing here does IO or reads a clock.

use crate::core::rate::{LIMIT_TOKENS_MAX, LimitSpec, LimitState};

/// Fixed-point scale of [`RateEstimate`]: values are kept in milli-hits.
const MILLI: u64 = 1000;
/// `ln 2` in millionths: converts a decaying sum into a rate.
const LN_2_MICRO: u128 = 693_147;
/// `2^(-k/16)` for k in 0..16, in 1/65536: the fractional part of an exponential decay.
const DECAY_SIXTEENTHS: [u64; 16] = [
    65536, 62757, 60097, 57549, 55109, 52773, 50535, 48393, 46341, 44376, 42495, 40693, 38968,
    37316, 35734, 34219,
];

/// One, in the fixed point of [`DECAY_SIXTEENTHS`].
const FULL_WEIGHT: u64 = 65_536;

/// Largest lease a rule may ask for.
pub const LEASE_TOKENS_MAX: u64 = 1_000_000;
const _: () = assert!(LEASE_TOKENS_MAX <= u32::MAX as u64);
/// Longest lease TTL: DESIGN caps it at one second so a dead node strands tokens briefly.
pub const LEASE_TTL_MS_MAX: u64 = 1_000;

/// How a node sizes and times its leases; per rule overridable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTuning {
    /// Smallest lease (cold, low-frequency keys strand at most this many tokens).
    pub min_lease_tokens: u64,
    /// Largest lease (caps over-admission during bursts).
    pub max_lease_tokens: u64,
    /// How much future traffic one lease should cover.
    pub lookahead_ms: u64,
    /// Refill when the balance falls below this share of the lease size.
    pub low_watermark_percent: u64,
    /// How long a lease lives, counted from when its request was sent.
    pub lease_ttl_ms: u64,
    /// Subtracted from the TTL on the node, against clock skew and transit time.
    pub expiry_margin_ms: u64,
    /// Half-life of the traffic estimate: how fast B follows a change of rate.
    pub rate_half_life_ms: u64,
}

impl LeaseTuning {
    /// DESIGN section 3: 5, 0.25 s, 500, 20 %, TTL 2 x lookahead.
    pub const DESIGN: Self = Self {
        min_lease_tokens: 5,
        max_lease_tokens: 500,
        lookahead_ms: 250,
        low_watermark_percent: 20,
        lease_ttl_ms: 500,
        expiry_margin_ms: 50,
        rate_half_life_ms: 1_000,
    };
}

impl Default for LeaseTuning {
    /// [`LeaseTuning::DESIGN`].
    fn default() -> Self {
        Self::DESIGN
    }
}

/// Why a lease tuning was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseTuningError {
    /// `min_lease_tokens` is 0, above `max_lease_tokens`, or the maximum is too large.
    #[error("lease sizes need 1 <= min_lease_tokens <= max_lease_tokens <= {LEASE_TOKENS_MAX}")]
    Sizes,
    /// The watermark is not a percentage in 1..=100.
    #[error("low_watermark_percent must be between 1 and 100, got {0}")]
    Watermark(u64),
    /// The TTL is 0, above the maximum, or not above the expiry margin.
    #[error("a lease TTL must be longer than its expiry margin and at most {LEASE_TTL_MS_MAX} ms")]
    Ttl,
    /// A duration is 0.
    #[error("lookahead_ms and rate_half_life_ms must be at least 1")]
    Duration,
}

impl LeaseTuning {
    /// Checks the relations between the numbers.
    ///
    /// # Errors
    /// [`LeaseTuningError`] naming the first broken relation.
    pub fn validate(&self) -> Result<(), LeaseTuningError> {
        if self.min_lease_tokens == 0
            || self.min_lease_tokens > self.max_lease_tokens
            || self.max_lease_tokens > LEASE_TOKENS_MAX
        {
            return Err(LeaseTuningError::Sizes);
        }
        if !(1..=100).contains(&self.low_watermark_percent) {
            return Err(LeaseTuningError::Watermark(self.low_watermark_percent));
        }
        if self.lease_ttl_ms > LEASE_TTL_MS_MAX || self.lease_ttl_ms <= self.expiry_margin_ms {
            return Err(LeaseTuningError::Ttl);
        }
        if self.lookahead_ms == 0 || self.rate_half_life_ms == 0 {
            return Err(LeaseTuningError::Duration);
        }
        Ok(())
    }

    /// The lease size for a key whose local traffic is `rate_milli_per_second`.
    pub fn lease_size_tokens(&self, rate_milli_per_second: u64) -> u64 {
        let covered = u128::from(rate_milli_per_second) * u128::from(self.lookahead_ms)
            / u128::from(MILLI * MILLI);
        u64::try_from(covered)
            .unwrap_or(u64::MAX)
            .clamp(self.min_lease_tokens, self.max_lease_tokens.max(self.min_lease_tokens))
    }

    /// Balance below which a refill is requested: the watermark share of `lease_size`, at
    /// least 1.
    pub fn low_watermark_tokens(&self, lease_size_tokens: u64) -> u64 {
        let share = u128::from(lease_size_tokens) * u128::from(self.low_watermark_percent) / 100;
        u64::try_from(share).unwrap_or(u64::MAX).max(1)
    }

    /// Highest balance below which a key not divided between nodes, of lease size `size`,
    /// asks for a refill: the watermark, or all but one token of the lease while a warm
    /// key's round trips raise it (see [`KeyLease::refill_watermark_tokens`]).
    pub fn refill_watermark_max_tokens(&self, lease_size_tokens: u64) -> u64 {
        self.low_watermark_tokens(lease_size_tokens).max(lease_size_tokens.saturating_sub(1))
    }

    /// Most tokens one node can hold for a key of `capacity_tokens` in a region of `nodes`:
    /// a refill is asked only below the watermark, so at most `watermark - 1` remain when a
    /// full lease arrives. A key's lease is capped by its small-key cap; while the ledger
    /// divides the key the cap is doubled ([`KeyLease::lease_size_tokens`]) and the
    /// watermark is the plain one, otherwise a warm key's watermark may reach the lease.
    pub fn held_tokens_max(&self, capacity_tokens: u64, nodes: u64) -> u64 {
        let cap = size_cap_tokens(capacity_tokens, nodes);
        let whole = self.max_lease_tokens.min(cap);
        let whole_held =
            whole.saturating_add(self.refill_watermark_max_tokens(whole).saturating_sub(1));
        if cap < self.min_lease_tokens {
            return whole_held;
        }
        let divided = self.max_lease_tokens.min(cap.saturating_mul(2));
        let divided_held =
            divided.saturating_add(self.low_watermark_tokens(divided).saturating_sub(1));
        whole_held.max(divided_held)
    }

    /// The drift bound of DESIGN section 3 for one key of `limit` in a region of `nodes`:
    /// the tokens outside the ledger, each node holding at most
    /// [`LeaseTuning::held_tokens_max`] plus its credit (fail-open rules), and, while the
    /// circuit is not closed, the fallback allowance `fallback_permille / 1000 x capacity`
    /// (every node's bucket starts at most at its share; over a window W of outage the
    /// fallback refills add `multiplier x rate x W` more).
    pub fn drift_bound_tokens(
        &self,
        limit: &LimitSpec,
        nodes: u64,
        fail_open: bool,
        fallback_permille: Option<u64>,
    ) -> u64 {
        let capacity_tokens = limit.capacity_tokens();
        let credit =
            if fail_open { Credit::fail_open(self, capacity_tokens, nodes).tokens_max } else { 0 };
        let leases = nodes
            .saturating_mul(self.held_tokens_max(capacity_tokens, nodes).saturating_add(credit));
        let fallback = fallback_permille.map_or(0, |permille| {
            let allowance = u128::from(capacity_tokens) * u128::from(permille) / 1000;
            u64::try_from(allowance).unwrap_or(u64::MAX)
        });
        leases.saturating_add(if fail_open { fallback } else { 0 })
    }

    /// The tuning a policy rule asks for: its lease sizes and lookahead, with the TTL that
    /// DESIGN section 3 derives from the lookahead (2 x lookahead, at most
    /// [`LEASE_TTL_MS_MAX`]), a margin of 50 ms or a quarter of the TTL for short TTLs (so
    /// the margin never eats the lease), and the other numbers from [`Default`].
    ///
    /// # Errors
    /// [`LeaseTuningError`] when the result does not [`validate`](Self::validate): sizes
    /// out of order or above [`LEASE_TOKENS_MAX`], or a lookahead of 0.
    pub fn with_sizes(
        min_lease_tokens: u64,
        max_lease_tokens: u64,
        lookahead_ms: u64,
    ) -> Result<Self, LeaseTuningError> {
        let lease_ttl_ms = lookahead_ms.saturating_mul(2).min(LEASE_TTL_MS_MAX);
        let tuning = Self {
            min_lease_tokens,
            max_lease_tokens,
            lookahead_ms,
            lease_ttl_ms,
            expiry_margin_ms: (lease_ttl_ms / 4).min(50),
            ..Self::default()
        };
        tuning.validate()?;
        Ok(tuning)
    }
}

/// An exponentially decaying count of a key's hits, read as a rate.
///
/// The sum of hits, each weighted `2^(-age / half_life)`, equals `rate * half_life / ln 2`
/// for a steady rate, so the rate is read back as `sum * ln 2 / half_life`. Integers only:
/// the decay is a shift by whole half-lives and a table for sixteenths of one, with the
/// time below one sixteenth carried to the next update.
///
/// A sum started from nothing `t` ago holds only the weight `1 - 2^(-t / half_life)` of a
/// full history, so read as it is it would take a half-life to see half of a new key's
/// rate, and a hot key would lease a few tokens at a time while its requests wait for each
/// refill. The rate is divided by that weight (the bias correction of an average started at
/// zero), with `t` at least an eighth of a half-life, so that one large request does not
/// read as a flood. A sum worth less than one hit says nothing of the past: the next hit
/// starts it anew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateEstimate {
    decayed_milli_hits: u64,
    updated_ms: u64,
    /// Time already elapsed but not yet applied, in 1/16 ms: decay is applied in steps of
    /// 1/16 half-life, and carrying the rest keeps frequent small updates unbiased. Below
    /// one half-life, which is read as at most `u32::MAX` ms.
    unapplied_sixteenth_ms: u32,
    /// How long before `updated_ms` the sum last started from (next to) nothing, saturating
    /// at `u32::MAX` ms (49 days, where a sum's weight is whole for any half-life of a day
    /// or less).
    started_before_update_ms: u32,
}

// Every tracked key holds one: two 32-bit fields, not two 64-bit ones, keep it at 24 bytes.
const _: () = assert!(size_of::<RateEstimate>() == 24);

/// Longest half-life a rate estimate reads: a longer one is read as this.
const RATE_HALF_LIFE_MS_MAX: u64 = u32::MAX as u64;

impl RateEstimate {
    /// Adds `hits` seen at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, hits: u64, half_life_ms: u64) {
        self.decay_to(now_ms, half_life_ms);
        if self.decayed_milli_hits < MILLI {
            // At `now_ms`, which is `updated_ms` unless the clock stepped back.
            self.started_before_update_ms = narrow_ms(self.updated_ms - now_ms);
        }
        self.decayed_milli_hits =
            self.decayed_milli_hits.saturating_add(hits.saturating_mul(MILLI));
    }

    /// The estimated rate at `now_ms`, in milli-hits per second.
    pub fn rate_milli_per_second(&self, now_ms: u64, half_life_ms: u64) -> u64 {
        let half_life_ms = half_life_ms.clamp(1, RATE_HALF_LIFE_MS_MAX);
        let mut decayed = *self;
        decayed.decay_to(now_ms, half_life_ms);
        let started_ms = self.updated_ms.saturating_sub(u64::from(self.started_before_update_ms));
        let observed_ms = now_ms.saturating_sub(started_ms).max(half_life_ms / 8).max(1);
        let weight = FULL_WEIGHT - decay_factor(observed_ms, half_life_ms);
        let rate = u128::from(decayed.decayed_milli_hits) * LN_2_MICRO * u128::from(FULL_WEIGHT)
            / (u128::from(half_life_ms) * u128::from(MILLI) * u128::from(weight.max(1)));
        u64::try_from(rate).unwrap_or(u64::MAX)
    }

    fn decay_to(&mut self, now_ms: u64, half_life_ms: u64) {
        // A clock that steps back decays nothing (and is not remembered).
        let elapsed_ms = now_ms.saturating_sub(self.updated_ms);
        self.updated_ms = self.updated_ms.max(now_ms);
        self.started_before_update_ms =
            narrow_ms(u64::from(self.started_before_update_ms).saturating_add(elapsed_ms));
        // One step is 1/16 of a half-life, which is `half_life_ms` units of 1/16 ms.
        let half_life_ms = half_life_ms.clamp(1, RATE_HALF_LIFE_MS_MAX);
        let elapsed_sixteenth_ms =
            elapsed_ms.saturating_mul(16).saturating_add(u64::from(self.unapplied_sixteenth_ms));
        let steps = elapsed_sixteenth_ms / half_life_ms;
        self.unapplied_sixteenth_ms =
            u32::try_from(elapsed_sixteenth_ms % half_life_ms).expect("below a half-life");
        self.decayed_milli_hits = decay_by_steps(self.decayed_milli_hits, steps);
    }
}

/// `2^(-elapsed / half_life)` in 1/65536, rounded down to whole sixteenths of a half-life.
fn decay_factor(elapsed_ms: u64, half_life_ms: u64) -> u64 {
    decay_by_steps(FULL_WEIGHT, elapsed_ms.saturating_mul(16) / half_life_ms.max(1))
}

/// `value * 2^(-steps / 16)`.
fn decay_by_steps(value: u64, steps: u64) -> u64 {
    let halvings = steps / 16;
    if halvings >= 64 {
        return 0;
    }
    let shifted = value >> halvings;
    let factor = DECAY_SIXTEENTHS[usize::try_from(steps % 16).expect("below 16")];
    let scaled = u128::from(shifted) * u128::from(factor) / u128::from(FULL_WEIGHT);
    u64::try_from(scaled).expect("a decay never grows the value")
}

/// How much a key may lean on the ledger without waiting for it; set per decision from the
/// rule and the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// Most tokens this node may admit beyond its leases before a report covers them
    /// (optimistic first hits, and the gap while a refill is on the way); 0 for fail-closed
    /// rules, which never admit what the ledger has not granted.
    pub tokens_max: u64,
}

impl Credit {
    /// No credit: every admission waits for leased tokens.
    pub const NONE: Self = Self { tokens_max: 0 };

    /// The credit of a fail-open rule on a key of `capacity_tokens` in a region of `nodes`:
    /// at most a minimum lease, and at most `capacity / (2 x nodes)`, so that the credit of
    /// all nodes together stays within half the key's capacity (a key of 2 per hour over two
    /// nodes has none: its first hit waits for the ledger rather than risk a third
    /// admission).
    pub fn fail_open(tuning: &LeaseTuning, capacity_tokens: u64, nodes: u64) -> Self {
        let share = capacity_tokens / nodes.max(1).saturating_mul(2);
        Self { tokens_max: tuning.min_lease_tokens.min(share) }
    }
}

/// The lease size cap of a key whose limit is small against the region: a node leases at
/// most `capacity / (2 x nodes)` (at least 1), so that all nodes' leases together never hold
/// more than half of it (all of it while the ledger divides the key, when the cap doubles).
/// A key whose cap is below `min_lease_tokens` is a small key: it
/// leases only what a hit needs and never prefetches.
pub fn size_cap_tokens(capacity_tokens: u64, nodes_in_region: u64) -> u64 {
    (capacity_tokens / nodes_in_region.max(1).saturating_mul(2)).max(1)
}

/// The node time `offset_ms` after `base_ms`; an offset of 0 is no time at all (0), not
/// `base_ms`: a request stamped before an answer was applied is decided after it, and a
/// retry time or an expiry that had passed must not reach back to it.
fn at_offset(base_ms: u64, offset_ms: u64) -> u64 {
    if offset_ms == 0 { 0 } else { base_ms.saturating_add(offset_ms) }
}

/// `ms` in 32 bits, saturating (49 days).
fn narrow_ms(ms: u64) -> u32 {
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// What spending from a key's lease decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// Paid from the leased balance.
    Admitted,
    /// Paid on credit: the next report charges it to the ledger.
    AdmittedOnCredit,
    /// The ledger has nothing for this node until then (its bucket is empty, the key owes
    /// debt, or the node has used its fair share): reject without asking again.
    Blocked {
        /// Milliseconds until the ledger expects to grant again.
        retry_after_ms: u64,
    },
    /// The balance and the credit do not cover the hits: the key needs a lease first (a
    /// fail-closed key, or a refill that is late).
    Short,
}

/// A report to send for a key, and what the node must remember of it until its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReportDraft {
    /// The report's sequence number within the key's epoch.
    pub seq: u64,
    /// Tokens admitted in the epoch, in total.
    pub spent_tokens: u64,
    /// Leased tokens held when sent.
    pub held_tokens: u64,
    /// Debt (admissions beyond leases) when sent: the report charges it to the ledger.
    pub debt_tokens: u64,
    /// What the node last heard the ledger counts as its (see `LeaseReport::settled_tokens`).
    pub settled_tokens: u64,
    /// Tokens wanted; 0 settles only.
    pub tokens_wanted: u64,
    /// The node's offered traffic on the key, milli-hits per second.
    pub demand_milli_per_second: u64,
    /// Node time the report is sent; a grant expires relative to this.
    pub sent_at_ms: u64,
}

/// What the ledger answered to a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportAnswer {
    /// Settled, then granted `granted_tokens` (maybe 0).
    Settled {
        /// Tokens leased to this node.
        granted_tokens: u64,
        /// When short of the want: ms until the ledger expects to grant again.
        retry_after_ms: u64,
        /// Whole tokens left in the ledger's bucket after the grant.
        remaining_tokens: u64,
    },
    /// Not applied (the ledger had a newer report, or the call failed, or its outcome is
    /// unknown): the next report settles whatever happened, since its counts are totals.
    NotApplied,
    /// A later life of the key on this node has reported (a new slot for the same ledger
    /// key): the ledger counts this life's tokens as spent and leases it nothing more, so it
    /// holds nothing and has nothing left to settle.
    Superseded,
}

/// A node's lease on one key (DESIGN section 3), with its settlement counts.
///
/// ```text
///   spend: balance first, then credit (debt), else Blocked / Short
///   report: spent (total), held = balance, want        answer: debt at send is covered,
///   grant pays the debt run up since, the rest is balance
/// ```
///
/// The node's own count of what is its (`spent + balance`) differs from the ledger's
/// (`settled_tokens`, known from the last answer) when it spent on credit, let a balance
/// expire or returned one: then a settle report is due.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyLease {
    debt_tokens: u64,
    spent_tokens: u64,
    settled_tokens: u64,
    /// The fields with small bounds, packed (see [`Bits`]): every tracked key holds one.
    packed: [u64; 4],
    rate: RateEstimate,
}

// Every tracked key holds one (with the shard's slot around it): kept to 80 bytes.
const _: () = assert!(size_of::<KeyLease>() <= 80);

/// An unsigned field of [`KeyLease::packed`]: `width` bits from bit `shift` of word `word`.
///
/// ```text
///   word 0: ANSWERED_AT_MS 44        | WANT_IN_FLIGHT 20
///   word 1: LEDGER_REMAINING 40      | BALANCE 24
///   word 2: SEQ 40                   | ROUND_TRIP_MS 16 | 4 flags
///   word 3: RETRY_AFTER_ANSWER_MS 32 | SIZE_CAP 20       | EXPIRES_AFTER_ANSWER_MS 11
/// ```
#[derive(Debug, Clone, Copy)]
struct Bits {
    word: usize,
    shift: u32,
    width: u32,
}

impl Bits {
    /// The largest value the field holds.
    const fn max(self) -> u64 {
        (1 << self.width) - 1
    }
}

/// Node time of the last answer that said how much the ledger had left, whose offsets the
/// lease's expiry and retry time are (44 bits of milliseconds: until the year 2527).
const ANSWERED_AT_MS: Bits = Bits { word: 0, shift: 0, width: 44 };
/// What the report in flight wants (0 when none flies): the ledger may give it away. At
/// most [`LEASE_TOKENS_MAX`].
const WANT_IN_FLIGHT: Bits = Bits { word: 0, shift: 44, width: 20 };
/// Whole tokens the ledger's bucket had left at its last answer (at most
/// [`LIMIT_TOKENS_MAX`]).
const LEDGER_REMAINING: Bits = Bits { word: 1, shift: 0, width: 40 };
/// Tokens this node may spend from its leases. A grant is at most [`LEASE_TOKENS_MAX`] and
/// one report flies at a time, so 24 bits hold many grants; past them the balance saturates
/// and the node's count falls short of the ledger's, which makes a settle report return
/// the excess (as an expired balance would be).
const BALANCE: Bits = Bits { word: 1, shift: 40, width: 24 };
/// Reports sent in the key's epoch: 40 bits last 34 years at one a millisecond (a report
/// waits for the last one's answer, a ledger commit).
const SEQ: Bits = Bits { word: 2, shift: 0, width: 40 };
/// Recent report round trips, node ms: the last one, or more while a slower one decays.
/// Saturates at 65 s, where the raised watermark it feeds is at its cap anyway.
const ROUND_TRIP_MS: Bits = Bits { word: 2, shift: 40, width: 16 };
/// A report is in flight.
const IN_FLIGHT: Bits = Bits { word: 2, shift: 56, width: 1 };
/// The ledger's last answer to a want was short of it: the key is at its limit, and
/// divided between nodes by fair shares when several want it.
const DIVIDED: Bits = Bits { word: 2, shift: 57, width: 1 };
/// An answer has come: the key has heard from the ledger.
const ANSWERED: Bits = Bits { word: 2, shift: 58, width: 1 };
/// A report's outcome is unknown (no answer): the ledger may count a grant this node never
/// saw, so a settle report is due until an answer says what it counts.
const UNCONFIRMED: Bits = Bits { word: 2, shift: 59, width: 1 };
/// No report before this long after the answer (0: none is due). Saturates at 49 days: a
/// key told to wait longer (a window of months) asks again then, and is told again.
const RETRY_AFTER_ANSWER_MS: Bits = Bits { word: 3, shift: 0, width: 32 };
/// The small-key cap on the lease size (see [`size_cap_tokens`]), at most
/// [`LEASE_TOKENS_MAX`]: no lease is larger, so a larger cap caps nothing.
const SIZE_CAP: Bits = Bits { word: 3, shift: 32, width: 20 };
/// The balance expires this long after the answer (0: it has expired). A grant lives at most
/// [`LEASE_TTL_MS_MAX`] from its report, which was sent before the answer came.
const EXPIRES_AFTER_ANSWER_MS: Bits = Bits { word: 3, shift: 52, width: 11 };

/// Every packed field, to check at compile time that none overlaps another or its word.
const PACKED_FIELDS: [Bits; 13] = [
    ANSWERED_AT_MS,
    WANT_IN_FLIGHT,
    LEDGER_REMAINING,
    BALANCE,
    SEQ,
    ROUND_TRIP_MS,
    IN_FLIGHT,
    DIVIDED,
    ANSWERED,
    UNCONFIRMED,
    RETRY_AFTER_ANSWER_MS,
    SIZE_CAP,
    EXPIRES_AFTER_ANSWER_MS,
];

const fn fields_fit(fields: &[Bits]) -> bool {
    let mut used = [0_u64; 4];
    let mut index = 0;
    while index < fields.len() {
        let field = fields[index];
        if field.word >= used.len() || field.shift + field.width > u64::BITS {
            return false;
        }
        let mask = field.max() << field.shift;
        if used[field.word] & mask != 0 {
            return false;
        }
        used[field.word] |= mask;
        index += 1;
    }
    true
}

const _: () = assert!(fields_fit(&PACKED_FIELDS));
const _: () = assert!(LEASE_TOKENS_MAX <= WANT_IN_FLIGHT.max());
const _: () = assert!(LEASE_TOKENS_MAX <= SIZE_CAP.max());
const _: () = assert!(LEASE_TTL_MS_MAX <= EXPIRES_AFTER_ANSWER_MS.max());
const _: () = assert!(LIMIT_TOKENS_MAX <= LEDGER_REMAINING.max());

impl std::fmt::Debug for KeyLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyLease")
            .field("balance_tokens", &self.get(BALANCE))
            .field("debt_tokens", &self.debt_tokens)
            .field("spent_tokens", &self.spent_tokens)
            .field("settled_tokens", &self.settled_tokens)
            .field("seq", &self.get(SEQ))
            .field("ledger_remaining_tokens", &self.get(LEDGER_REMAINING))
            .field("answered_at_ms", &self.get(ANSWERED_AT_MS))
            .field("expires_after_answer_ms", &self.get(EXPIRES_AFTER_ANSWER_MS))
            .field("retry_after_answer_ms", &self.get(RETRY_AFTER_ANSWER_MS))
            .field("in_flight_want_tokens", &self.get(WANT_IN_FLIGHT))
            .field("size_cap_tokens", &self.get(SIZE_CAP))
            .field("round_trip_ms", &self.get(ROUND_TRIP_MS))
            .field("in_flight", &self.flag(IN_FLIGHT))
            .field("divided", &self.flag(DIVIDED))
            .field("answered", &self.flag(ANSWERED))
            .field("unconfirmed", &self.flag(UNCONFIRMED))
            .field("rate", &self.rate)
            .finish()
    }
}

/// The packed fields, by name.
impl KeyLease {
    const fn get(&self, field: Bits) -> u64 {
        (self.packed[field.word] >> field.shift) & field.max()
    }

    /// Sets `field` to `value`, saturating at its largest value.
    fn set(&mut self, field: Bits, value: u64) {
        let word = &mut self.packed[field.word];
        let mask = field.max() << field.shift;
        *word = (*word & !mask) | (value.min(field.max()) << field.shift);
    }

    const fn flag(&self, flag: Bits) -> bool {
        self.get(flag) == 1
    }

    fn set_flag(&mut self, flag: Bits, on: bool) {
        self.set(flag, u64::from(on));
    }

    fn balance(&self) -> u64 {
        self.get(BALANCE)
    }

    fn set_balance(&mut self, tokens: u64) {
        self.set(BALANCE, tokens);
    }

    fn remaining(&self) -> u64 {
        self.get(LEDGER_REMAINING)
    }

    fn answered_at_ms(&self) -> u64 {
        self.get(ANSWERED_AT_MS)
    }
}

impl KeyLease {
    /// A fresh key: nothing leased; `capacity_tokens` shown as the ledger's remaining count
    /// until the first answer.
    pub fn new(capacity_tokens: u64, size_cap_tokens: u64) -> Self {
        let mut lease = Self::default();
        lease.set(LEDGER_REMAINING, capacity_tokens);
        lease.set(SIZE_CAP, size_cap_tokens.min(LEASE_TOKENS_MAX));
        lease
    }

    /// Tokens this node may still spend from its leases.
    pub fn balance_tokens(&self, now_ms: u64) -> u64 {
        if now_ms >= self.expires_at_ms() { 0 } else { self.balance() }
    }

    /// Node time at which the balance expires (0: it has).
    fn expires_at_ms(&self) -> u64 {
        at_offset(self.answered_at_ms(), self.get(EXPIRES_AFTER_ANSWER_MS))
    }

    /// Node time before which no report is sent, the ledger's `retry_after` (0: none).
    fn retry_at_ms(&self) -> u64 {
        at_offset(self.answered_at_ms(), self.get(RETRY_AFTER_ANSWER_MS))
    }

    /// Sets the expiry and the retry time to node times `expires_at_ms` and `retry_at_ms`,
    /// as offsets from `answered_at_ms`: a time not after it is kept as 0, past.
    fn set_times(&mut self, expires_at_ms: u64, retry_at_ms: u64) {
        let answered_at_ms = self.answered_at_ms();
        self.set(EXPIRES_AFTER_ANSWER_MS, expires_at_ms.saturating_sub(answered_at_ms));
        self.set(RETRY_AFTER_ANSWER_MS, retry_at_ms.saturating_sub(answered_at_ms));
    }

    /// Tokens admitted beyond leases and not yet charged to the ledger.
    pub fn debt_tokens(&self) -> u64 {
        self.debt_tokens
    }

    /// Tokens admitted on the key in this epoch, in total (what reports count as spent).
    pub fn spent_tokens(&self) -> u64 {
        self.spent_tokens
    }

    /// What the ledger counted as this node's on the key at its last answer.
    pub fn settled_tokens(&self) -> u64 {
        self.settled_tokens
    }

    /// Whole tokens the ledger's bucket had left at its last answer.
    pub fn ledger_remaining_tokens(&self) -> u64 {
        self.remaining()
    }

    /// Whole tokens the ledger's bucket for `spec` holds at `now_ms` as far as this node
    /// knows: its last answer's count, or all of `spec` once the bucket has refilled since
    /// (a window that ended), so that a new window does not start from the last one's count.
    pub fn ledger_remaining_tokens_at(&self, spec: &LimitSpec, now_ms: u64) -> u64 {
        if self.flag(ANSWERED) && self.ledger_refilled(spec, now_ms) {
            spec.capacity_tokens()
        } else {
            self.remaining()
        }
    }

    /// Whether the ledger's bucket for `spec` has refilled since its last answer.
    fn ledger_refilled(&self, spec: &LimitSpec, now_ms: u64) -> bool {
        let refilled_at_ms = self
            .answered_at_ms()
            .saturating_add(spec.reset_ms_estimate(self.remaining(), self.answered_at_ms()));
        now_ms >= refilled_at_ms
    }

    /// Whether a report is in flight.
    pub fn in_flight(&self) -> bool {
        self.flag(IN_FLIGHT)
    }

    /// Spends `hits` (>= 1) at `now_ms`, counting them in the traffic estimate whatever the
    /// outcome (the estimate is the key's demand).
    pub fn spend(&mut self, tuning: &LeaseTuning, credit: Credit, now_ms: u64, hits: u64) -> Spend {
        self.rate.observe(now_ms, hits, tuning.rate_half_life_ms);
        self.expire(now_ms);
        let balance = self.balance();
        if hits <= balance {
            self.set_balance(balance - hits);
            self.spent_tokens = self.spent_tokens.saturating_add(hits);
            return Spend::Admitted;
        }
        let retry_at_ms = self.retry_at_ms();
        if now_ms < retry_at_ms {
            return Spend::Blocked { retry_after_ms: retry_at_ms - now_ms };
        }
        // Credit only while the ledger can still pay it, as far as this node knows: what it
        // had left at the last answer covers the debt, the report in flight and these hits.
        let lacking = hits - balance;
        let owed = self.debt_tokens.saturating_add(lacking);
        let ledger_may_pay = !self.flag(ANSWERED)
            || owed.saturating_add(self.get(WANT_IN_FLIGHT)) <= self.remaining();
        if ledger_may_pay && owed <= credit.tokens_max {
            self.pay_beyond_lease(hits);
            return Spend::AdmittedOnCredit;
        }
        Spend::Short
    }

    /// Counts `hits` offered at `now_ms` in the traffic estimate without spending anything:
    /// a rejected request's hits are demand too (the caller keeps a rejection's state
    /// unwritten, since rejected hits consume nothing).
    pub fn observe_demand(&mut self, tuning: &LeaseTuning, now_ms: u64, hits: u64) {
        self.rate.observe(now_ms, hits, tuning.rate_half_life_ms);
    }

    /// Admits `hits` that no lease pays (the fallback bucket decided): the balance pays what
    /// it can and the rest is debt, charged by the next report.
    pub fn pay_beyond_lease(&mut self, hits: u64) {
        let balance = self.balance();
        let from_balance = hits.min(balance);
        self.set_balance(balance - from_balance);
        self.debt_tokens = self.debt_tokens.saturating_add(hits - from_balance);
        self.spent_tokens = self.spent_tokens.saturating_add(hits);
    }

    /// True when the ledger's last answer left its bucket empty and this node's lease is
    /// still live: the key is at its limit, so a short request is rejected as the ledger
    /// would, not waited for.
    pub fn at_limit(&self, now_ms: u64) -> bool {
        self.flag(ANSWERED) && self.remaining() == 0 && now_ms < self.expires_at_ms()
    }

    /// The report to send now to lease for `hits` the balance does not cover (0: a refill at
    /// the low watermark), if any: never while one is in flight or before the ledger's
    /// `retry_after`, and a small key never prefetches. Marks the report in flight.
    pub fn poll_lease_for(
        &mut self,
        tuning: &LeaseTuning,
        now_ms: u64,
        hits: u64,
    ) -> Option<ReportDraft> {
        self.expire(now_ms);
        if self.flag(IN_FLIGHT) || now_ms < self.retry_at_ms() {
            return None;
        }
        // Read once: the lease's size and its raised watermark both follow it.
        let rate = self.rate.rate_milli_per_second(now_ms, tuning.rate_half_life_ms);
        let size = self.lease_size_for_rate(tuning, rate);
        let lacking = hits.saturating_sub(self.balance());
        let small = self.get(SIZE_CAP) < tuning.min_lease_tokens;
        let below_watermark = self.balance() < self.refill_watermark_tokens(tuning, size, rate);
        if lacking == 0 && (small || !below_watermark) {
            return None;
        }
        let want = if small { lacking.max(1) } else { size.max(lacking) };
        Some(self.draft(tuning, want.min(LEASE_TOKENS_MAX), now_ms))
    }

    /// Balance below which a key of lease size `size` and traffic `rate_milli_per_second`
    /// asks for a refill: the tuning's watermark, raised to cover two recent round trips of
    /// the traffic (at most all but one token of the lease) while the ledger's last answer
    /// left two leases in its bucket and the key is not divided: a divided key asking early
    /// would only be granted less of its share, and told to wait.
    fn refill_watermark_tokens(&self, tuning: &LeaseTuning, size: u64, rate: u64) -> u64 {
        let watermark = tuning.low_watermark_tokens(size);
        if !self.flag(ANSWERED) || self.flag(DIVIDED) || self.remaining() < size.saturating_mul(2) {
            return watermark;
        }
        let in_transit =
            u128::from(rate) * u128::from(self.get(ROUND_TRIP_MS)) * 2 / u128::from(MILLI * MILLI);
        let in_transit = u64::try_from(in_transit).unwrap_or(u64::MAX);
        watermark.max(in_transit.min(size.saturating_sub(1)))
    }

    /// The refill to request now, if any (see [`KeyLease::poll_lease_for`]).
    pub fn poll_refill(&mut self, tuning: &LeaseTuning, now_ms: u64) -> Option<ReportDraft> {
        self.poll_lease_for(tuning, now_ms, 0)
    }

    /// A settle-only report, when the ledger's count of this key differs from the node's (it
    /// spent on credit, let a balance expire, or returned one), is unknown (a report went
    /// unanswered), or a debt is still to be charged, and none is in flight. The counts can
    /// agree while a debt is owed: debt run up while a report flew, then a balance that
    /// expired before its answer, offset each other in them.
    pub fn poll_settle(&mut self, tuning: &LeaseTuning, now_ms: u64) -> Option<ReportDraft> {
        self.expire(now_ms);
        let own = self.spent_tokens.saturating_add(self.balance());
        let settled =
            own == self.settled_tokens && !self.flag(UNCONFIRMED) && self.debt_tokens == 0;
        if self.flag(IN_FLIGHT) || settled {
            return None;
        }
        Some(self.draft(tuning, 0, now_ms))
    }

    fn draft(&mut self, tuning: &LeaseTuning, tokens_wanted: u64, now_ms: u64) -> ReportDraft {
        self.set_flag(IN_FLIGHT, true);
        self.set(WANT_IN_FLIGHT, tokens_wanted);
        self.set(SEQ, self.get(SEQ) + 1);
        ReportDraft {
            seq: self.get(SEQ),
            spent_tokens: self.spent_tokens,
            held_tokens: self.balance(),
            debt_tokens: self.debt_tokens,
            settled_tokens: self.settled_tokens,
            tokens_wanted,
            demand_milli_per_second: self.demand_milli_per_second(tuning, now_ms),
            sent_at_ms: now_ms,
        }
    }

    /// The key's offered traffic on this node at `now_ms` (rejected hits included), in
    /// milli-hits per second.
    pub fn demand_milli_per_second(&self, tuning: &LeaseTuning, now_ms: u64) -> u64 {
        self.rate.rate_milli_per_second(now_ms, tuning.rate_half_life_ms)
    }

    /// Node time of the last hit counted (0 for none).
    pub fn last_hit_ms(&self) -> u64 {
        self.rate.updated_ms
    }

    /// True when the key holds nothing the ledger does not know of and nothing is in flight:
    /// no balance, no uncharged spending, no wait still running, and the ledger's bucket for
    /// `spec` has refilled since its last answer. Such a key may be forgotten once idle: a
    /// slot made for it anew starts on credit, which is safe only where the bucket is full.
    pub fn is_settled(&self, spec: &LimitSpec, now_ms: u64) -> bool {
        let balance_tokens = self.balance_tokens(now_ms);
        balance_tokens == 0
            && !self.flag(IN_FLIGHT)
            && self.spent_tokens.saturating_add(balance_tokens) == self.settled_tokens
            && !self.flag(UNCONFIRMED)
            && now_ms >= self.retry_at_ms()
            && (!self.flag(ANSWERED) || self.ledger_refilled(spec, now_ms))
    }

    /// Applies the ledger's answer to the report `sent`.
    pub fn apply_answer(
        &mut self,
        tuning: &LeaseTuning,
        sent: &ReportDraft,
        answer: ReportAnswer,
        now_ms: u64,
    ) {
        self.set_flag(IN_FLIGHT, false);
        self.set(WANT_IN_FLIGHT, 0);
        self.expire(now_ms);
        let (granted_tokens, retry_after_ms, remaining_tokens) = match answer {
            ReportAnswer::Settled { granted_tokens, retry_after_ms, remaining_tokens } => {
                (granted_tokens, retry_after_ms, remaining_tokens)
            }
            ReportAnswer::NotApplied => {
                self.set_flag(UNCONFIRMED, true);
                return;
            }
            ReportAnswer::Superseded => {
                // What it held and owed is the ledger's spent count already: nothing to
                // report, nothing to spend, and no bucket to wait for before forgetting it.
                self.set_balance(0);
                self.debt_tokens = 0;
                self.settled_tokens = self.spent_tokens;
                self.set_flag(UNCONFIRMED, false);
                self.set_flag(ANSWERED, false);
                self.set(RETRY_AFTER_ANSWER_MS, 0);
                return;
            }
        };
        self.set_flag(ANSWERED, true);
        self.set_flag(UNCONFIRMED, false);
        // A slow answer counts at once; a fast one lowers the figure by a quarter at a time,
        // so one quick commit between slow ones does not drop the watermark.
        let round_trip_ms = now_ms.saturating_sub(sent.sent_at_ms);
        let recent_ms = self.get(ROUND_TRIP_MS);
        self.set(ROUND_TRIP_MS, round_trip_ms.max(recent_ms - recent_ms / 4));
        if sent.tokens_wanted > 0 {
            self.set_flag(DIVIDED, granted_tokens < sent.tokens_wanted && retry_after_ms > 0);
        }
        self.set(LEDGER_REMAINING, remaining_tokens);
        // Read before the base they are kept from moves to this answer.
        let mut expires_at_ms = self.expires_at_ms();
        self.set(ANSWERED_AT_MS, now_ms);
        // The report charged the debt it carried; a grant pays the debt run up since.
        self.debt_tokens = self.debt_tokens.saturating_sub(sent.debt_tokens);
        let paid_debt = granted_tokens.min(self.debt_tokens);
        self.debt_tokens -= paid_debt;
        self.set_balance(self.balance().saturating_add(granted_tokens - paid_debt));
        self.settled_tokens =
            sent.spent_tokens.saturating_add(sent.held_tokens).saturating_add(granted_tokens);
        let retry_at_ms =
            if retry_after_ms > 0 { sent.sent_at_ms.saturating_add(retry_after_ms) } else { 0 };
        if granted_tokens > 0 {
            // The ledger extends every outstanding token of this node and key to the newest
            // grant's expiry, so the node may do the same, counted from when it sent.
            expires_at_ms = sent
                .sent_at_ms
                .saturating_add(tuning.lease_ttl_ms)
                .saturating_sub(tuning.expiry_margin_ms);
        }
        self.set_times(expires_at_ms, retry_at_ms);
    }

    /// Ends the lease by `at_ms` at the latest. A window algorithm's tokens count in the
    /// window the ledger granted them in, so the shard ends a window limit's lease at that
    /// window's end: spending a balance of the last window in the next would admit more than
    /// the limit in it. What expires goes back as a normal expiry (the ledger credits none
    /// of it to a window that has ended).
    pub fn expire_by(&mut self, at_ms: u64) {
        let expires_at_ms = self.expires_at_ms().min(at_ms);
        self.set_times(expires_at_ms, self.retry_at_ms());
    }

    /// Takes the balance above the current lease size, to settle back to the ledger (the
    /// lease size shrinks as traffic falls). Returns the tokens taken.
    pub fn take_surplus(&mut self, tuning: &LeaseTuning, now_ms: u64) -> u64 {
        self.expire(now_ms);
        let size = self.lease_size_tokens(tuning, now_ms);
        let balance = self.balance();
        let surplus = balance.saturating_sub(size);
        self.set_balance(balance - surplus);
        surplus
    }

    /// Takes the whole balance (idle key, eviction, shutdown), to settle back to the ledger.
    pub fn take_all(&mut self, now_ms: u64) -> u64 {
        self.expire(now_ms);
        let balance = self.balance();
        self.set_balance(0);
        balance
    }

    /// The lease size this key's traffic calls for now, within its small-key cap.
    ///
    /// While the ledger divides the key, the cap of a key that is not small is doubled: the
    /// ledger's fair cap then bounds each grant, and a node whose share is large (two of
    /// five nodes wanting the key) needs grants of a lookahead of that share, or it would
    /// ask more than 4 times a second.
    pub fn lease_size_tokens(&self, tuning: &LeaseTuning, now_ms: u64) -> u64 {
        let rate = self.rate.rate_milli_per_second(now_ms, tuning.rate_half_life_ms);
        self.lease_size_for_rate(tuning, rate)
    }

    fn lease_size_for_rate(&self, tuning: &LeaseTuning, rate_milli_per_second: u64) -> u64 {
        let size = tuning.lease_size_tokens(rate_milli_per_second);
        let cap = self.get(SIZE_CAP);
        let cap = if self.flag(DIVIDED) && cap >= tuning.min_lease_tokens { cap * 2 } else { cap };
        if cap == 0 { size } else { size.min(cap) }
    }

    fn expire(&mut self, now_ms: u64) {
        if now_ms >= self.expires_at_ms() {
            self.set_balance(0);
        }
    }
}

/// The fallback bucket of one node while the ledger is out of reach (DESIGN section 3):
/// the limit (rate and burst) scaled by `multiplier_permille / 1000 / nodes`, at least one
/// token, so `nodes` nodes together admit about `multiplier` times the limit. A limit of 0
/// stays 0.
pub fn fallback_limit(spec: &LimitSpec, multiplier_permille: u64, nodes: u64) -> LimitSpec {
    if spec.requests_per_window == 0 {
        return *spec;
    }
    let divisor = u128::from(nodes.max(1)) * 1000;
    let scale = |tokens: u64| {
        let scaled = u128::from(tokens) * u128::from(multiplier_permille) / divisor;
        u64::try_from(scaled).unwrap_or(u64::MAX).clamp(1, LIMIT_TOKENS_MAX)
    };
    LimitSpec {
        requests_per_window: scale(spec.requests_per_window),
        burst_tokens: scale(spec.burst_tokens),
        ..*spec
    }
}

/// A fallback bucket's first state: the node's share of what it last knew the ledger had left
/// for the key (`ledger_remaining_tokens`, less the node's uncharged debt), never a full
/// bucket, which would admit a whole limit per node on top of what the key already spent.
pub fn fallback_start(
    fallback_spec: &LimitSpec,
    ledger_remaining_tokens: u64,
    multiplier_permille: u64,
    nodes: u64,
    now_ms: u64,
) -> LimitState {
    let share = u128::from(ledger_remaining_tokens) * u128::from(multiplier_permille)
        / (u128::from(nodes.max(1)) * 1000);
    let share = u64::try_from(share).unwrap_or(u64::MAX);
    let full = fallback_spec.initial_state(now_ms);
    let surplus = fallback_spec.capacity_tokens().saturating_sub(share);
    fallback_spec.acquire_up_to(&full, now_ms, surplus).next
}

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;

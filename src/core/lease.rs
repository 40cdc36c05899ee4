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
//! ```
//!
//! B follows the rate estimate, which decays exponentially when traffic falls, so B decays
//! back to `min_lease_tokens`; the surplus above the new B goes back to the ledger.
//!
//! Expiry is conservative: a lease counts from when the node SENT its request (on the
//! node's clock), minus a margin, so a ledger whose clock runs ahead cannot re-grant
//! tokens this node may still spend.
//!
//! The shard and lease-broker actors (`crate::actors`) hold these states and perform the
//! requests; nothing here does IO or reads a clock.

use crate::core::rate::{LIMIT_TOKENS_MAX, LimitSpec};

/// Fixed-point scale of [`RateEstimate`]: values are kept in milli-hits.
const MILLI: u64 = 1000;
/// `ln 2` in millionths: converts a decaying sum into a rate.
const LN_2_MICRO: u128 = 693_147;
/// `2^(-k/16)` for k in 0..16, in 1/65536: the fractional part of an exponential decay.
const DECAY_SIXTEENTHS: [u64; 16] = [
    65536, 62757, 60097, 57549, 55109, 52773, 50535, 48393, 46341, 44376, 42495, 40693, 38968,
    37316, 35734, 34219,
];

/// Largest lease a rule may ask for.
pub const LEASE_TOKENS_MAX: u64 = 1_000_000;
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
    #[error("lease_ttl_ms must be above expiry_margin_ms and at most {LEASE_TTL_MS_MAX}")]
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

    /// Most tokens one node can hold for one key: a refill is asked only below the
    /// watermark, so at most `watermark - 1` remain when a full lease arrives.
    pub fn held_tokens_max(&self) -> u64 {
        let watermark = self.low_watermark_tokens(self.max_lease_tokens);
        self.max_lease_tokens.saturating_add(watermark.saturating_sub(1))
    }

    /// The drift bound of DESIGN section 3 for `nodes` nodes: tokens outside the ledger
    /// for one key, `N * (1 + watermark) * max_lease` (computed exactly as `N * held`).
    pub fn drift_bound_tokens(&self, nodes: u64) -> u64 {
        nodes.saturating_mul(self.held_tokens_max())
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateEstimate {
    decayed_milli_hits: u64,
    updated_ms: u64,
    /// Time already elapsed but not yet applied, in 1/16 ms: decay is applied in steps of
    /// 1/16 half-life, and carrying the rest keeps frequent small updates unbiased.
    unapplied_sixteenth_ms: u64,
}

impl RateEstimate {
    /// Adds `hits` seen at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, hits: u64, half_life_ms: u64) {
        self.decay_to(now_ms, half_life_ms);
        self.decayed_milli_hits =
            self.decayed_milli_hits.saturating_add(hits.saturating_mul(MILLI));
    }

    /// The estimated rate at `now_ms`, in milli-hits per second.
    pub fn rate_milli_per_second(&self, now_ms: u64, half_life_ms: u64) -> u64 {
        let mut decayed = *self;
        decayed.decay_to(now_ms, half_life_ms);
        let rate = u128::from(decayed.decayed_milli_hits) * LN_2_MICRO
            / (u128::from(half_life_ms.max(1)) * u128::from(MILLI));
        u64::try_from(rate).unwrap_or(u64::MAX)
    }

    fn decay_to(&mut self, now_ms: u64, half_life_ms: u64) {
        // A clock that steps back decays nothing (and is not remembered).
        let elapsed_ms = now_ms.saturating_sub(self.updated_ms);
        self.updated_ms = self.updated_ms.max(now_ms);
        // One step is 1/16 of a half-life, which is `half_life_ms` units of 1/16 ms.
        let half_life_ms = half_life_ms.max(1);
        let elapsed_sixteenth_ms =
            elapsed_ms.saturating_mul(16).saturating_add(self.unapplied_sixteenth_ms);
        let steps = elapsed_sixteenth_ms / half_life_ms;
        self.unapplied_sixteenth_ms = elapsed_sixteenth_ms % half_life_ms;
        let halvings = steps / 16;
        if halvings >= 64 {
            self.decayed_milli_hits = 0;
            return;
        }
        let shifted = self.decayed_milli_hits >> halvings;
        let factor = DECAY_SIXTEENTHS[usize::try_from(steps % 16).expect("below 16")];
        let scaled = u128::from(shifted) * u128::from(factor) / 65_536;
        self.decayed_milli_hits = u64::try_from(scaled).expect("a decay never grows the value");
    }
}

/// What spending from a key's lease decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// Paid from the leased balance.
    Admitted,
    /// The ledger has no token for this key until then: reject without asking again.
    Blocked {
        /// Milliseconds until the ledger expects a token.
        retry_after_ms: u64,
    },
    /// The balance does not cover the hits: the key needs a lease first (a cold key, or a
    /// refill that has not arrived).
    Short,
}

/// A lease request to send for a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseWant {
    /// Tokens to ask for.
    pub tokens: u64,
    /// Node time the request is sent; its lease expires relative to this.
    pub sent_at_ms: u64,
}

/// A node's lease on one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KeyLease {
    balance_tokens: u64,
    expires_at_ms: u64,
    in_flight: bool,
    blocked_until_ms: u64,
    rate: RateEstimate,
}

impl KeyLease {
    /// Tokens this node may still spend.
    pub fn balance_tokens(&self, now_ms: u64) -> u64 {
        if now_ms >= self.expires_at_ms { 0 } else { self.balance_tokens }
    }

    /// Whether a lease request is in flight.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Spends `hits` (>= 1) at `now_ms`, counting them in the traffic estimate.
    pub fn spend(&mut self, tuning: &LeaseTuning, now_ms: u64, hits: u64) -> Spend {
        self.rate.observe(now_ms, hits, tuning.rate_half_life_ms);
        self.expire(now_ms);
        if hits <= self.balance_tokens {
            self.balance_tokens -= hits;
            return Spend::Admitted;
        }
        if now_ms < self.blocked_until_ms {
            return Spend::Blocked { retry_after_ms: self.blocked_until_ms - now_ms };
        }
        Spend::Short
    }

    /// The refill to request now, if any: only below the low watermark, never while one is
    /// in flight or while the ledger said the key is empty. Marks the request in flight.
    pub fn poll_refill(&mut self, tuning: &LeaseTuning, now_ms: u64) -> Option<LeaseWant> {
        self.poll_lease_for(tuning, now_ms, 0)
    }

    /// As [`KeyLease::poll_refill`], for a request of `hits` the balance does not cover: the
    /// lease asked is at least what those hits lack, so a request larger than the lease
    /// size can still be paid once granted.
    pub fn poll_lease_for(
        &mut self,
        tuning: &LeaseTuning,
        now_ms: u64,
        hits: u64,
    ) -> Option<LeaseWant> {
        self.expire(now_ms);
        if self.in_flight || now_ms < self.blocked_until_ms {
            return None;
        }
        let size = self.lease_size_tokens(tuning, now_ms);
        let lacking = hits.saturating_sub(self.balance_tokens);
        if self.balance_tokens >= tuning.low_watermark_tokens(size) && lacking == 0 {
            return None;
        }
        self.in_flight = true;
        Some(LeaseWant { tokens: size.max(lacking).min(LEASE_TOKENS_MAX), sent_at_ms: now_ms })
    }

    /// True while the latest grant's lease has not expired on the node.
    pub fn grant_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms
    }

    /// Node time of the last hit counted (0 for none).
    pub fn last_hit_ms(&self) -> u64 {
        self.rate.updated_ms
    }

    /// True when the key holds nothing a fresh key would not: no balance, no request in
    /// flight, no block still running. Such a key may be forgotten once idle.
    pub fn is_settled(&self, now_ms: u64) -> bool {
        self.balance_tokens(now_ms) == 0 && !self.in_flight && now_ms >= self.blocked_until_ms
    }

    /// Applies the ledger's answer to the request sent at `want.sent_at_ms`.
    pub fn apply_grant(
        &mut self,
        tuning: &LeaseTuning,
        want: LeaseWant,
        granted_tokens: u64,
        retry_after_ms: u64,
        now_ms: u64,
    ) {
        self.in_flight = false;
        self.expire(now_ms);
        if granted_tokens == 0 {
            self.blocked_until_ms = now_ms.saturating_add(retry_after_ms);
            return;
        }
        self.blocked_until_ms = 0;
        self.balance_tokens = self.balance_tokens.saturating_add(granted_tokens);
        // The ledger extends every outstanding token of this node and key to the newest
        // grant's expiry, so the node may do the same, counted from when it sent.
        self.expires_at_ms = want
            .sent_at_ms
            .saturating_add(tuning.lease_ttl_ms)
            .saturating_sub(tuning.expiry_margin_ms);
    }

    /// The request failed or timed out: nothing was granted that the node knows of.
    pub fn apply_failure(&mut self) {
        self.in_flight = false;
    }

    /// Takes the balance above the current lease size, to return to the ledger (the lease
    /// size shrinks as traffic falls). Returns the tokens taken.
    pub fn take_surplus(&mut self, tuning: &LeaseTuning, now_ms: u64) -> u64 {
        self.expire(now_ms);
        let size = self.lease_size_tokens(tuning, now_ms);
        let surplus = self.balance_tokens.saturating_sub(size);
        self.balance_tokens -= surplus;
        surplus
    }

    /// Takes the whole balance (eviction or shutdown), to return to the ledger.
    pub fn take_all(&mut self, now_ms: u64) -> u64 {
        self.expire(now_ms);
        std::mem::take(&mut self.balance_tokens)
    }

    /// The lease size this key's traffic calls for now.
    pub fn lease_size_tokens(&self, tuning: &LeaseTuning, now_ms: u64) -> u64 {
        tuning.lease_size_tokens(self.rate.rate_milli_per_second(now_ms, tuning.rate_half_life_ms))
    }

    fn expire(&mut self, now_ms: u64) {
        if now_ms >= self.expires_at_ms {
            self.balance_tokens = 0;
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

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;

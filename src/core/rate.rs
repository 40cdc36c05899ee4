//! Rate-limit math for one limit and one key: token bucket, sliding-window counter and fixed
//! window, on fixed-point integers.
//!
//! This file owns how a [`LimitState`] refills or rolls over with time, whether hits are
//! admitted, the exact retry and reset times, partial grants (for leases) and give-backs. It
//! does no IO and reads no clock: every function takes `now_ms` (milliseconds since the Unix
//! epoch) from its caller and returns the next state as a value. Keeping states in a map,
//! evicting them, sizing leases and replicating through Raft belong to the shard actors
//! (`src/actors/`) and the ledger (`src/ledger/`), which store what this file returns.
//!
//! # Arithmetic
//! Tokens are integers: a token bucket holds micro-tokens ([`MICRO_TOKENS_PER_TOKEN`] per
//! token) in a `u64`, plus the refill remainder below one micro-token in units of
//! `1 / window_ms` micro-token. Refill is computed in `u128`, so the bucket is exact: many short
//! steps credit what one long step would, and no gap or `u64` input can overflow. No function
//! here panics, for any state and any `u64` input; results that do not fit a `u64` saturate.
//!
//! # Time
//! A `now_ms` older than the state's last update counts as no time elapsed, so a clock that
//! steps back never mints tokens nor reopens a window. Durations returned (`reset_ms`,
//! `retry_after_ms`) are still measured from the caller's `now_ms`. Windows are aligned to
//! multiples of `window_ms` since the epoch, so every node agrees where a window starts.
//!
//! # A limit of 0
//! `requests_per_window = 0` (envoyproxy/ratelimit's "black list", `requests_per_unit: 0`)
//! refuses every hit, whatever the algorithm: only `hits = 0` is admitted, as a no-op; a
//! refusal reports `remaining = 0`, `reset_ms = 0` (nothing is ever consumed, so the limit is
//! always as reset as it gets) and `retry_after_ms = u64::MAX` (never). Such a limit never
//! reads nor changes its state: every `next` is the state passed in, and every state is
//! pristine, so shards need not keep one. None of the refill or window math runs for it, so
//! it cannot divide by its zero rate.
//!
//! # Over-admission bounds
//! With `L = requests_per_window` and `W = window_ms`, the hits admitted by
//! [`LimitSpec::evaluate`] and [`LimitSpec::acquire_up_to`] within any `D` consecutive
//! milliseconds (tokens handed back by [`LimitSpec::give_back`] aside) are at most the
//! following, which is 0 for `L = 0` with every algorithm:
//! - token bucket: `burst_tokens + floor((D - 1) * L / W)`, which is at most
//!   `burst_tokens + ceil(D * L / W)`: a full bucket plus the refill between the first and the
//!   last millisecond;
//! - fixed window: `L` times the number of aligned windows the `D` ms touch; for `D = W` that
//!   is `2 * L` (the two sides of a boundary);
//! - sliding window, for `D = W`: `L + floor(L * (W - 2) / W)` (just `L` when `W <= 2`),
//!   below `2 * L`. Why: an aligned interval is one window, at most `L`. An interval of `W` ms
//!   starting at offset `y >= 1` of window `k - 1` holds at most all `n` hits of window
//!   `k - 1` plus the hits of window `k` up to offset `y - 1`; each of those was admitted while
//!   window `k - 1` still weighed at least `(W - y + 1) / W`, so they number at most
//!   `L - ceil(n * (W - y + 1) / W)`. The sum is `L + floor(n * (y - 1) / W)`, largest for
//!   `n = L`, `y = W - 1`, and reached when all `L` hits of a window land on its last
//!   millisecond.
//!
//! ```
//! use quotamesh::core::rate::{Algorithm, LimitSpec};
//!
//! // 10 requests per second, bursts up to 20.
//! let spec = LimitSpec::new(Algorithm::TokenBucket, 10, 1_000, Some(20)).expect("valid");
//! let fresh = spec.initial_state(5_000);
//! let decision = spec.evaluate(&fresh, 5_000, 20);
//! assert!(decision.admitted);
//! let refused = spec.evaluate(&decision.next, 5_000, 1);
//! assert!(!refused.admitted);
//! assert_eq!(refused.retry_after_ms, 100); // one token refills every 100 ms
//! ```

use serde::{Deserialize, Serialize};

/// Fixed-point scale: one token is this many micro-tokens.
pub const MICRO_TOKENS_PER_TOKEN: u64 = 1_000_000;
/// Largest `requests_per_window` or `burst_tokens` a limit may declare.
pub const LIMIT_TOKENS_MAX: u64 = 1_000_000_000_000;
/// Longest window a limit may declare: 400 days.
pub const WINDOW_MS_MAX: u64 = 400 * 24 * 3600 * 1000;

// The largest bucket fits a u64 of micro-tokens, so `LimitState` needs no wider field.
const _: () = assert!(LIMIT_TOKENS_MAX.checked_mul(MICRO_TOKENS_PER_TOKEN).is_some());
// Refill over any gap (up to u64::MAX ms) at the highest rate fits the u128 intermediate.
const _: () = assert!(
    (u64::MAX as u128)
        .checked_mul(LIMIT_TOKENS_MAX as u128 * MICRO_TOKENS_PER_TOKEN as u128)
        .is_some()
);
// So does the largest bucket counted in 1/window_ms micro-token units.
const _: () = assert!(
    (LIMIT_TOKENS_MAX as u128 * MICRO_TOKENS_PER_TOKEN as u128)
        .checked_mul(WINDOW_MS_MAX as u128)
        .is_some()
);

/// How a limit counts hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// Refills continuously at `requests_per_window / window_ms`; holds up to `burst_tokens`.
    #[default]
    TokenBucket,
    /// Weighted count of the current and previous aligned windows.
    SlidingWindow,
    /// Count per window aligned to multiples of `window_ms` since the Unix epoch.
    FixedWindow,
}

impl Algorithm {
    /// The name a policy file gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::TokenBucket => "token_bucket",
            Self::SlidingWindow => "sliding_window",
            Self::FixedWindow => "fixed_window",
        }
    }
}

/// One limit: an algorithm with its numbers, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LimitSpec {
    /// The counting algorithm.
    pub algorithm: Algorithm,
    /// Hits admitted per window (for a token bucket: tokens refilled per window).
    pub requests_per_window: u64,
    /// Window length in milliseconds.
    pub window_ms: u64,
    /// Token-bucket capacity; equal to `requests_per_window` unless a burst is configured.
    /// The window algorithms ignore it.
    pub burst_tokens: u64,
}

/// A [`LimitSpec`] in 16 bytes, aligned to one, for a tracked key's slot (32 bytes
/// unpacked). A validated limit's numbers fit bit fields: `requests_per_window` and
/// `burst_tokens` up to [`LIMIT_TOKENS_MAX`] in 40 bits each, `window_ms` up to
/// [`WINDOW_MS_MAX`] in 36, the algorithm in 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedLimitSpec([u8; 16]);

const TOKENS_BITS: u32 = 40;
const WINDOW_BITS: u32 = 36;
const _: () = assert!(LIMIT_TOKENS_MAX < 1 << TOKENS_BITS);
const _: () = assert!(WINDOW_MS_MAX < 1 << WINDOW_BITS);
const _: () = assert!(2 * TOKENS_BITS + WINDOW_BITS + 2 <= 128);

impl PackedLimitSpec {
    /// Packs `spec`. Numbers past a validated limit's bounds (only a hand-built spec has
    /// them) are clamped to those bounds.
    pub fn pack(spec: &LimitSpec) -> Self {
        let algorithm: u128 = match spec.algorithm {
            Algorithm::TokenBucket => 0,
            Algorithm::SlidingWindow => 1,
            Algorithm::FixedWindow => 2,
        };
        let requests = u128::from(spec.requests_per_window.min(LIMIT_TOKENS_MAX));
        let burst = u128::from(spec.burst_tokens.min(LIMIT_TOKENS_MAX));
        let window = u128::from(spec.window_ms.min(WINDOW_MS_MAX));
        let bits = requests
            | burst << TOKENS_BITS
            | window << (2 * TOKENS_BITS)
            | algorithm << (2 * TOKENS_BITS + WINDOW_BITS);
        Self(bits.to_le_bytes())
    }

    /// The limit packed.
    pub fn unpack(&self) -> LimitSpec {
        let bits = u128::from_le_bytes(self.0);
        let field = |shift: u32, width: u32| {
            u64::try_from((bits >> shift) & ((1 << width) - 1)).expect("a field fits u64")
        };
        let algorithm = match field(2 * TOKENS_BITS + WINDOW_BITS, 2) {
            0 => Algorithm::TokenBucket,
            1 => Algorithm::SlidingWindow,
            _ => Algorithm::FixedWindow,
        };
        LimitSpec {
            algorithm,
            requests_per_window: field(0, TOKENS_BITS),
            window_ms: field(2 * TOKENS_BITS, WINDOW_BITS),
            burst_tokens: field(TOKENS_BITS, TOKENS_BITS),
        }
    }
}

/// Why a limit's numbers were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitSpecError {
    /// `requests_per_window` was above [`LIMIT_TOKENS_MAX`].
    #[error("requests per window must be between 0 and {LIMIT_TOKENS_MAX}, got {0}")]
    Requests(u64),
    /// `window_ms` was 0 or above [`WINDOW_MS_MAX`].
    #[error("window must be between 1 ms and {WINDOW_MS_MAX} ms, got {0} ms")]
    Window(u64),
    /// `burst_tokens` was 0 or above [`LIMIT_TOKENS_MAX`] while `requests_per_window` was
    /// above 0.
    #[error("burst must be between 1 and {LIMIT_TOKENS_MAX} tokens, got {0}")]
    Burst(u64),
    /// `burst_tokens` was above 0 while `requests_per_window` was 0.
    #[error(
        "a limit of 0 requests per window refuses every hit, so its burst must be 0 or left out, \
         got {0}"
    )]
    BurstOfZeroLimit(u64),
}

/// Per-key state of one limit, 24 bytes; only the [`LimitSpec`] that produced it can read it.
///
/// What the fields mean depends on the algorithm, which is why they are private:
///
/// | field | token bucket | sliding window | fixed window |
/// |---|---|---|---|
/// | `updated_ms` | last refill | last update; names the current window | same |
/// | `level` | micro-tokens available | hits in the current window | same |
/// | `carry` | refill remainder, in `1 / window_ms` micro-tokens | hits in the previous window | 0 |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LimitState {
    updated_ms: u64,
    level: u64,
    carry: u64,
}

// Shards keep one state per key and limit in memory; keep it small.
const _: () = assert!(size_of::<LimitState>() <= 24);

/// Outcome of evaluating `hits` against one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evaluation {
    /// Whether all `hits` were admitted (never a part of them).
    pub admitted: bool,
    /// Whole tokens (hits) still available after this evaluation (after consuming when admitted).
    pub remaining: u64,
    /// Milliseconds until the limit is fully reset (token bucket: until full; windows: until
    /// the current window ends). Used for RateLimit-Reset / duration_until_reset.
    pub reset_ms: u64,
    /// 0 when admitted; when rejected, exact ms until `hits` could be admitted (assuming no
    /// other traffic), or `u64::MAX` when `hits` exceeds what the limit can ever admit at once
    /// (or the wait does not fit a `u64`).
    pub retry_after_ms: u64,
    /// The state to store if the caller commits this evaluation. When rejected it is the state
    /// with no hit consumed (rejected hits never consume quota).
    pub next: LimitState,
}

/// Outcome of a partial acquisition (used by the ledger to grant leases).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// min(want, whole tokens available); may be 0.
    pub granted: u64,
    /// 0 when granted > 0; otherwise exact ms until one whole token is available, or
    /// `u64::MAX` when none ever will be (a limit of 0).
    pub retry_after_ms: u64,
    /// Whole tokens still available after the grant.
    pub remaining: u64,
    /// The state to store if the caller commits this grant.
    pub next: LimitState,
}

impl LimitSpec {
    /// Validates and builds a limit; `burst_tokens` defaults to `requests_per_window`.
    ///
    /// `requests_per_window = 0` builds a limit that refuses every hit (see the module docs);
    /// its burst must then be 0 or left out.
    ///
    /// # Errors
    /// [`LimitSpecError`] when a number is out of range, the window is 0, the burst is 0 under
    /// a non-zero limit, or above 0 under a zero one.
    pub fn new(
        algorithm: Algorithm,
        requests_per_window: u64,
        window_ms: u64,
        burst_tokens: Option<u64>,
    ) -> Result<Self, LimitSpecError> {
        if requests_per_window > LIMIT_TOKENS_MAX {
            return Err(LimitSpecError::Requests(requests_per_window));
        }
        // Checked for a zero limit too: a bad window is a mistake whatever the limit.
        if window_ms == 0 || window_ms > WINDOW_MS_MAX {
            return Err(LimitSpecError::Window(window_ms));
        }
        let burst_tokens = burst_tokens.unwrap_or(requests_per_window);
        if requests_per_window == 0 {
            // A bucket that never refills would hand out its burst once per key and never
            // again, which is no rate limit; refuse rather than guess.
            if burst_tokens > 0 {
                return Err(LimitSpecError::BurstOfZeroLimit(burst_tokens));
            }
        } else if burst_tokens == 0 || burst_tokens > LIMIT_TOKENS_MAX {
            return Err(LimitSpecError::Burst(burst_tokens));
        }
        Ok(Self { algorithm, requests_per_window, window_ms, burst_tokens })
    }

    /// True for a limit of 0, which refuses every hit and never touches its state. Checked
    /// first by every public method, so hand-built specs with a burst above 0 behave the same
    /// and none of the math below meets a zero rate.
    fn refuses_every_hit(&self) -> bool {
        self.requests_per_window == 0
    }

    /// The state of a key never seen before: full bucket / empty window.
    pub fn initial_state(&self, now_ms: u64) -> LimitState {
        let level = match self.algorithm {
            Algorithm::TokenBucket => self.capacity_micro_tokens(),
            Algorithm::SlidingWindow | Algorithm::FixedWindow => 0,
        };
        LimitState { updated_ms: now_ms, level, carry: 0 }
    }

    /// The state under this limit of a key counted under `old` until `now_ms`, when both
    /// count alike (same algorithm and window) and only their numbers differ: a bucket keeps
    /// what it held (up to the new capacity), a window keeps its hits, so a changed number
    /// mints nothing however often it changes back and forth. `None` for a limit of another
    /// shape, whose state cannot be read from the old one.
    pub fn carried_from(
        &self,
        old: &LimitSpec,
        state: &LimitState,
        now_ms: u64,
    ) -> Option<LimitState> {
        if self.algorithm != old.algorithm || self.window_ms != old.window_ms {
            return None;
        }
        // Refilled or rolled over under the old numbers up to now, so the time before the
        // change is never refilled at the new rate.
        let at = old.advance(state, now_ms);
        Some(match self.algorithm {
            Algorithm::TokenBucket => {
                let capacity_micro_tokens = self.capacity_micro_tokens();
                if at.level >= capacity_micro_tokens {
                    LimitState { level: capacity_micro_tokens, carry: 0, ..at }
                } else {
                    at
                }
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => at,
        })
    }

    /// All-or-nothing: admits `hits` if that many whole tokens are available at `now_ms`.
    ///
    /// `hits = 0` is an admitted no-op that still reports `remaining` and `reset_ms`.
    pub fn evaluate(&self, state: &LimitState, now_ms: u64, hits: u64) -> Evaluation {
        if self.refuses_every_hit() {
            return Evaluation {
                admitted: hits == 0,
                remaining: 0,
                reset_ms: 0,
                retry_after_ms: if hits == 0 { 0 } else { u64::MAX },
                next: *state,
            };
        }
        let at = self.advance(state, now_ms);
        let available = self.available_tokens(&at);
        if hits <= available {
            let next = self.consume(&at, hits);
            Evaluation {
                admitted: true,
                remaining: available - hits,
                reset_ms: ms_until(now_ms, self.reset_at_ms(&next)),
                retry_after_ms: 0,
                next,
            }
        } else {
            Evaluation {
                admitted: false,
                remaining: available,
                reset_ms: ms_until(now_ms, self.reset_at_ms(&at)),
                retry_after_ms: self.retry_after_ms(&at, now_ms, hits),
                next: at,
            }
        }
    }

    /// Partial: takes up to `want` whole tokens, as many as are available at `now_ms`.
    pub fn acquire_up_to(&self, state: &LimitState, now_ms: u64, want: u64) -> Grant {
        if self.refuses_every_hit() {
            // Never a token, so even `want = 0` reports the wait for one: forever.
            return Grant { granted: 0, retry_after_ms: u64::MAX, remaining: 0, next: *state };
        }
        let at = self.advance(state, now_ms);
        let available = self.available_tokens(&at);
        let granted = want.min(available);
        if granted > 0 {
            Grant {
                granted,
                retry_after_ms: 0,
                remaining: available - granted,
                next: self.consume(&at, granted),
            }
        } else {
            // Nothing granted with a token available means `want` was 0: no wait.
            let retry_after_ms =
                if available > 0 { 0 } else { self.retry_after_ms(&at, now_ms, 1) };
            Grant { granted: 0, retry_after_ms, remaining: available, next: at }
        }
    }

    /// Gives back unspent tokens (lease returns), never above capacity; for the windows it
    /// un-counts hits in the current window, never below 0.
    ///
    /// The caller gives back only tokens acquired in the window that is current at `now_ms`:
    /// a state cannot tell which window a hit was counted in, and un-counting hits of an
    /// earlier window would let the current one admit more than its limit.
    pub fn give_back(&self, state: &LimitState, now_ms: u64, tokens: u64) -> LimitState {
        self.give_back_counted(state, now_ms, tokens).0
    }

    /// [`Self::give_back`], with the whole tokens that went back (rounded up): fewer than
    /// `tokens` when the bucket fills or the window's count reaches 0. The ledger's totals
    /// count these, so a return the bucket could not hold makes no room for later grants.
    pub fn give_back_counted(
        &self,
        state: &LimitState,
        now_ms: u64,
        tokens: u64,
    ) -> (LimitState, u64) {
        if self.refuses_every_hit() {
            // Nothing was ever taken, so there is nothing to give back.
            return (*state, 0);
        }
        let at = self.advance(state, now_ms);
        match self.algorithm {
            Algorithm::TokenBucket => {
                let capacity_micro_tokens = self.capacity_micro_tokens();
                let level = at.level.saturating_add(tokens.saturating_mul(MICRO_TOKENS_PER_TOKEN));
                let next = if level >= capacity_micro_tokens {
                    // A full bucket has no remainder, exactly like a fresh one.
                    LimitState { level: capacity_micro_tokens, carry: 0, ..at }
                } else {
                    LimitState { level, ..at }
                };
                let returned_micro = next.level.saturating_sub(at.level);
                (next, returned_micro.div_ceil(MICRO_TOKENS_PER_TOKEN))
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                let next = LimitState { level: at.level.saturating_sub(tokens), ..at };
                (next, at.level - next.level)
            }
        }
    }

    /// True when `state` at `now_ms` is indistinguishable from `initial_state(now_ms)`, so the
    /// key can be forgotten without changing any decision at `now_ms` or later: a full bucket,
    /// or windows with no counted hit that still weighs. A state last updated after `now_ms`
    /// is never pristine, since it treats the time up to its update as not elapsed. Under a
    /// limit of 0 every state is pristine: no decision reads it.
    pub fn is_pristine(&self, state: &LimitState, now_ms: u64) -> bool {
        self.refuses_every_hit() || self.advance(state, now_ms) == self.initial_state(now_ms)
    }

    /// Millisecond time the state was last updated (for least-recently-used eviction).
    pub fn last_touched_ms(&self, state: &LimitState) -> u64 {
        state.updated_ms
    }

    /// Capacity in whole tokens: `burst_tokens` for a token bucket, `requests_per_window`
    /// otherwise; 0 for a limit of 0, whatever a hand-built spec's burst says.
    pub fn capacity_tokens(&self) -> u64 {
        if self.refuses_every_hit() {
            return 0;
        }
        match self.algorithm {
            Algorithm::TokenBucket => self.burst_tokens,
            Algorithm::SlidingWindow | Algorithm::FixedWindow => self.requests_per_window,
        }
    }

    /// Milliseconds until a limit with `remaining_tokens` left at `now_ms` is fully reset,
    /// when only the count is known and not the state (a node spending leased tokens knows
    /// its balance and the ledger's last count, not the ledger's bucket): a token bucket
    /// refills the missing tokens at its rate, a window resets at the end of the aligned
    /// window that holds `now_ms` (the ledger aligns windows at multiples of `window_ms`).
    pub fn reset_ms_estimate(&self, remaining_tokens: u64, now_ms: u64) -> u64 {
        if self.refuses_every_hit() {
            return 0;
        }
        let window_ms = self.window_ms_nonzero();
        match self.algorithm {
            Algorithm::TokenBucket => {
                let missing = u128::from(self.burst_tokens.saturating_sub(remaining_tokens));
                let wait_ms = (missing * u128::from(window_ms))
                    .div_ceil(u128::from(self.requests_per_window));
                u64::try_from(wait_ms).unwrap_or(u64::MAX)
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => window_ms - now_ms % window_ms,
        }
    }

    /// Bucket capacity in micro-tokens; saturates only for a hand-built spec that
    /// [`LimitSpec::new`] would refuse.
    fn capacity_micro_tokens(&self) -> u64 {
        self.burst_tokens.saturating_mul(MICRO_TOKENS_PER_TOKEN)
    }

    /// `window_ms`, but never 0: the fields are public, and a hand-built spec must not make
    /// the math divide by zero.
    fn window_ms_nonzero(&self) -> u64 {
        self.window_ms.max(1)
    }

    /// Bucket refill per elapsed millisecond, in `1 / window_ms` micro-token units.
    fn refill_units_per_ms(&self) -> u128 {
        u128::from(self.requests_per_window) * u128::from(MICRO_TOKENS_PER_TOKEN)
    }

    /// Bucket contents in `1 / window_ms` micro-token units, the exact amount refill adds to.
    fn bucket_units(&self, at: &LimitState) -> u128 {
        u128::from(at.level) * u128::from(self.window_ms_nonzero()) + u128::from(at.carry)
    }

    /// Whole milliseconds of refill that cover `missing_units` (rounded up: the first
    /// millisecond at which the bucket holds enough); `None` if the bucket never refills.
    fn refill_wait_ms(&self, missing_units: u128) -> Option<u128> {
        let rate = self.refill_units_per_ms();
        if missing_units == 0 {
            Some(0)
        } else if rate == 0 {
            // Unreachable: a limit of 0 returns before any refill math. Kept so that a
            // future caller cannot divide by the zero rate.
            None
        } else {
            Some(missing_units.div_ceil(rate))
        }
    }

    /// Brings `state` forward to `max(state time, now_ms)`: refills the bucket, or rolls the
    /// windows over. Never moves time back, so it never mints tokens or reopens a window.
    fn advance(&self, state: &LimitState, now_ms: u64) -> LimitState {
        let at_ms = state.updated_ms.max(now_ms);
        let window_ms = self.window_ms_nonzero();
        match self.algorithm {
            Algorithm::TokenBucket => {
                let capacity_micro_tokens = self.capacity_micro_tokens();
                let elapsed_ms = at_ms.saturating_sub(state.updated_ms);
                // Refill plus the remainder carried from earlier steps, in 1/window_ms
                // micro-tokens: dividing once keeps the result exact however often we step.
                let refill_units = u128::from(elapsed_ms)
                    .saturating_mul(self.refill_units_per_ms())
                    .saturating_add(u128::from(state.carry));
                let window = u128::from(window_ms);
                let level = u128::from(state.level.min(capacity_micro_tokens))
                    .saturating_add(refill_units / window);
                if level >= u128::from(capacity_micro_tokens) {
                    // Refill beyond capacity is lost, remainder included.
                    LimitState { updated_ms: at_ms, level: capacity_micro_tokens, carry: 0 }
                } else {
                    LimitState {
                        updated_ms: at_ms,
                        level: u64::try_from(level).expect("below capacity, which is a u64"),
                        carry: u64::try_from(refill_units % window)
                            .expect("below window_ms, which is a u64"),
                    }
                }
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                let windows_passed =
                    (at_ms / window_ms).saturating_sub(state.updated_ms / window_ms);
                let (current, previous) = match windows_passed {
                    0 => (state.level, state.carry),
                    1 => (0, state.level),
                    _ => (0, 0),
                };
                let carry = match self.algorithm {
                    Algorithm::SlidingWindow => previous,
                    // A fixed window forgets the previous one.
                    Algorithm::TokenBucket | Algorithm::FixedWindow => 0,
                };
                LimitState { updated_ms: at_ms, level: current, carry }
            }
        }
    }

    /// Whole tokens available in an advanced state.
    fn available_tokens(&self, at: &LimitState) -> u64 {
        match self.algorithm {
            Algorithm::TokenBucket => at.level / MICRO_TOKENS_PER_TOKEN,
            Algorithm::FixedWindow => self.requests_per_window.saturating_sub(at.level),
            Algorithm::SlidingWindow => {
                let room =
                    u128::from(self.requests_per_window).saturating_sub(self.sliding_estimate(at));
                u64::try_from(room).expect("at most requests_per_window, which is a u64")
            }
        }
    }

    /// Hits a sliding window counts at the state's time: the previous window weighted by the
    /// share of it still inside the sliding window, rounded up so that it never under-counts,
    /// plus the current window.
    fn sliding_estimate(&self, at: &LimitState) -> u128 {
        let window_ms = self.window_ms_nonzero();
        let still_inside_ms = u128::from(window_ms - at.updated_ms % window_ms);
        let weighted_previous =
            (u128::from(at.carry) * still_inside_ms).div_ceil(u128::from(window_ms));
        weighted_previous + u128::from(at.level)
    }

    /// Takes `tokens` (at most the available ones) from an advanced state.
    fn consume(&self, at: &LimitState, tokens: u64) -> LimitState {
        let level = match self.algorithm {
            Algorithm::TokenBucket => {
                at.level.saturating_sub(tokens.saturating_mul(MICRO_TOKENS_PER_TOKEN))
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => at.level.saturating_add(tokens),
        };
        LimitState { level, ..*at }
    }

    /// Milliseconds from `now_ms` until `hits` fit, or `u64::MAX` if they never can.
    fn retry_after_ms(&self, at: &LimitState, now_ms: u64, hits: u64) -> u64 {
        self.admit_at_ms(at, hits).map_or(u64::MAX, |admit_ms| ms_until(now_ms, admit_ms))
    }

    /// Earliest time, at or after the advanced state's, at which `hits` fit with no other
    /// traffic; `None` when they exceed the capacity. A `u128`, since it may lie past
    /// `u64::MAX`.
    fn admit_at_ms(&self, at: &LimitState, hits: u64) -> Option<u128> {
        if hits > self.capacity_tokens() {
            return None;
        }
        let at_ms = u128::from(at.updated_ms);
        match self.algorithm {
            Algorithm::TokenBucket => {
                let needed_units = u128::from(hits)
                    .saturating_mul(u128::from(MICRO_TOKENS_PER_TOKEN))
                    .saturating_mul(u128::from(self.window_ms_nonzero()));
                let missing_units = needed_units.saturating_sub(self.bucket_units(at));
                Some(at_ms + self.refill_wait_ms(missing_units)?)
            }
            Algorithm::FixedWindow => {
                if u128::from(at.level) + u128::from(hits) <= u128::from(self.requests_per_window) {
                    Some(at_ms)
                } else {
                    Some(self.window_end_ms(at))
                }
            }
            Algorithm::SlidingWindow => Some(self.sliding_admit_at_ms(at, hits)),
        }
    }

    /// [`Self::admit_at_ms`] for a sliding window and `hits <= requests_per_window`.
    ///
    /// The estimate only falls while nothing is admitted: the previous window's weight shrinks
    /// every millisecond, and at a boundary the current count becomes the previous one at full
    /// weight. So the answer is the first fitting offset in this window, else in the next,
    /// else the start of the one after, when both counts have expired.
    fn sliding_admit_at_ms(&self, at: &LimitState, hits: u64) -> u128 {
        let limit = u128::from(self.requests_per_window);
        let hits = u128::from(hits);
        let window = u128::from(self.window_ms_nonzero());
        let start_ms = self.window_end_ms(at) - window;
        let current = u128::from(at.level);
        if let Some(room) = limit.checked_sub(current + hits) {
            let offset_ms = first_offset_ms(u128::from(at.carry), room, window)
                .max(u128::from(at.updated_ms) - start_ms);
            if offset_ms < window {
                return start_ms + offset_ms;
            }
        }
        let room = limit.saturating_sub(hits);
        let offset_ms = first_offset_ms(current, room, window);
        if offset_ms < window {
            return start_ms + window + offset_ms;
        }
        start_ms + 2 * window
    }

    /// When an advanced state is fully reset: a full bucket, or the end of the current window.
    fn reset_at_ms(&self, at: &LimitState) -> u128 {
        match self.algorithm {
            Algorithm::TokenBucket => {
                let full_units =
                    u128::from(self.capacity_micro_tokens()) * u128::from(self.window_ms_nonzero());
                let missing_units = full_units.saturating_sub(self.bucket_units(at));
                self.refill_wait_ms(missing_units)
                    .map_or(u128::MAX, |wait_ms| u128::from(at.updated_ms) + wait_ms)
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => self.window_end_ms(at),
        }
    }

    /// End (exclusive) of the aligned window holding the state's time; may pass `u64::MAX`.
    fn window_end_ms(&self, at: &LimitState) -> u128 {
        let window_ms = self.window_ms_nonzero();
        u128::from(at.updated_ms - at.updated_ms % window_ms) + u128::from(window_ms)
    }
}

/// First offset into a window at which `ceil(previous * (window - offset) / window) <= room`,
/// or `window` when no offset inside the window qualifies.
fn first_offset_ms(previous: u128, room: u128, window: u128) -> u128 {
    // ceil(p * (W - x) / W) <= room  <=>  p * (W - x) <= room * W  <=>
    // W - x <= floor(room * W / p), since room and W - x are integers.
    (room * window).checked_div(previous).map_or(0, |span_ms| window.saturating_sub(span_ms))
}

/// Milliseconds from `now_ms` to `at_ms`, saturating at `u64::MAX`.
fn ms_until(now_ms: u64, at_ms: u128) -> u64 {
    u64::try_from(at_ms.saturating_sub(u128::from(now_ms))).unwrap_or(u64::MAX)
}

#[cfg(test)]
#[path = "rate_tests.rs"]
mod tests;

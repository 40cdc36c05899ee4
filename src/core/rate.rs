//! Rate-limit math on fixed-point tokens: token bucket, sliding-window counter, fixed window.
//!
//! SKELETON: types only; the algorithms are being written.

use serde::{Deserialize, Serialize};

/// Fixed-point scale: one token is this many micro-tokens.
pub const MICRO_TOKENS_PER_TOKEN: u64 = 1_000_000;
/// Largest `requests_per_window` or `burst_tokens` a limit may declare.
pub const LIMIT_TOKENS_MAX: u64 = 1_000_000_000_000;
/// Longest window a limit may declare: 400 days.
pub const WINDOW_MS_MAX: u64 = 400 * 24 * 3600 * 1000;

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
    pub burst_tokens: u64,
}

/// Why a limit's numbers were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitSpecError {
    /// `requests_per_window` was 0 or above [`LIMIT_TOKENS_MAX`].
    #[error("requests per window must be between 1 and {LIMIT_TOKENS_MAX}, got {0}")]
    Requests(u64),
    /// `window_ms` was 0 or above [`WINDOW_MS_MAX`].
    #[error("window must be between 1 ms and {WINDOW_MS_MAX} ms, got {0} ms")]
    Window(u64),
    /// `burst_tokens` was below `requests_per_window`... or above the maximum.
    #[error("burst must be between 1 and {LIMIT_TOKENS_MAX}, got {0}")]
    Burst(u64),
}

impl LimitSpec {
    /// Validates and builds a limit; `burst_tokens` defaults to `requests_per_window`.
    ///
    /// # Errors
    /// [`LimitSpecError`] when a number is zero or out of range.
    pub fn new(
        algorithm: Algorithm,
        requests_per_window: u64,
        window_ms: u64,
        burst_tokens: Option<u64>,
    ) -> Result<Self, LimitSpecError> {
        if requests_per_window == 0 || requests_per_window > LIMIT_TOKENS_MAX {
            return Err(LimitSpecError::Requests(requests_per_window));
        }
        if window_ms == 0 || window_ms > WINDOW_MS_MAX {
            return Err(LimitSpecError::Window(window_ms));
        }
        let burst_tokens = burst_tokens.unwrap_or(requests_per_window);
        if burst_tokens == 0 || burst_tokens > LIMIT_TOKENS_MAX {
            return Err(LimitSpecError::Burst(burst_tokens));
        }
        Ok(Self { algorithm, requests_per_window, window_ms, burst_tokens })
    }
}

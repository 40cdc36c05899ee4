//! Tests of the rate-limit math in `rate.rs`: concrete cases per algorithm first, then
//! properties checked against naive reference models.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn spec(algorithm: Algorithm, requests: u64, window_ms: u64, burst: Option<u64>) -> LimitSpec {
    LimitSpec::new(algorithm, requests, window_ms, burst).expect("test specs are valid")
}

/// Evaluates a sequence of single hits at one time, returning the state after them.
fn admit_singles(spec: &LimitSpec, state: LimitState, now_ms: u64, count: u64) -> LimitState {
    (0..count).fold(state, |state, hit| {
        let evaluation = spec.evaluate(&state, now_ms, 1);
        assert!(evaluation.admitted, "hit {hit} of {count} should be admitted");
        evaluation.next
    })
}

// ---------------------------------------------------------------------------------------------
// Token bucket
// ---------------------------------------------------------------------------------------------

#[test]
fn token_bucket_fresh_key_admits_its_burst_then_rejects_with_exact_retry() {
    // A fresh bucket holds its whole burst, and the first refused hit waits exactly one refill.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, Some(20));
    let mut state = bucket.initial_state(5_000);
    for remaining in (0..20).rev() {
        let evaluation = bucket.evaluate(&state, 5_000, 1);
        assert!(evaluation.admitted);
        assert_eq!(evaluation.remaining, remaining);
        state = evaluation.next;
    }
    let refused = bucket.evaluate(&state, 5_000, 1);
    assert!(!refused.admitted);
    assert_eq!(refused.remaining, 0);
    assert_eq!(refused.retry_after_ms, 100);
    assert_eq!(refused.reset_ms, 2_000, "20 tokens at 10 per second");
    assert!(!bucket.evaluate(&state, 5_099, 1).admitted);
    assert!(bucket.evaluate(&state, 5_100, 1).admitted);
}

#[test]
fn token_bucket_fractional_rate_rounds_retry_and_reset_up() {
    // With 3 tokens per second a token takes 333.3 ms, so retry and reset round up to whole ms.
    let bucket = spec(Algorithm::TokenBucket, 3, 1_000, None);
    let drained = bucket.evaluate(&bucket.initial_state(0), 0, 3);
    assert!(drained.admitted);
    assert_eq!(drained.reset_ms, 1_000);
    let refused = bucket.evaluate(&drained.next, 0, 1);
    assert_eq!(refused.retry_after_ms, 334);
    assert!(!bucket.evaluate(&drained.next, 333, 1).admitted);
    let admitted = bucket.evaluate(&drained.next, 334, 1);
    assert!(admitted.admitted);
    assert_eq!(admitted.remaining, 0);
    // 0.002 tokens left; 2.998 more take 999.3 ms.
    assert_eq!(admitted.reset_ms, 1_000);
}

#[test]
fn token_bucket_multi_hit_is_all_or_nothing() {
    // Several hits at once are admitted together or not at all, and a refusal consumes nothing.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, None);
    let four = bucket.evaluate(&bucket.initial_state(0), 0, 4);
    assert!(four.admitted);
    assert_eq!(four.remaining, 6);
    assert_eq!(four.reset_ms, 400);
    let seven = bucket.evaluate(&four.next, 0, 7);
    assert!(!seven.admitted);
    assert_eq!(seven.remaining, 6);
    assert_eq!(seven.retry_after_ms, 100);
    assert!(bucket.evaluate(&seven.next, 0, 6).admitted);
    let too_many = bucket.evaluate(&four.next, 0, 11);
    assert!(!too_many.admitted);
    assert_eq!(too_many.retry_after_ms, u64::MAX);
}

#[test]
fn token_bucket_carries_fractions_across_many_short_steps() {
    // Refilling one ms at a time credits exactly what one 3-second step does (no rounding loss).
    let bucket = spec(Algorithm::TokenBucket, 1, 3, Some(1_000));
    let empty = bucket.evaluate(&bucket.initial_state(0), 0, 1_000).next;
    let mut stepped = empty;
    for now_ms in 1..=2_999 {
        stepped = bucket.evaluate(&stepped, now_ms, 0).next;
    }
    assert_eq!(bucket.evaluate(&stepped, 2_999, 0).remaining, 999);
    assert_eq!(bucket.evaluate(&stepped, 3_000, 0).remaining, 1_000);
    assert_eq!(bucket.evaluate(&empty, 3_000, 0).remaining, 1_000);
}

#[test]
fn token_bucket_time_going_backwards_mints_nothing() {
    // An earlier now_ms refills nothing and keeps the state's time; waits count from the caller's now.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, None);
    let drained = bucket.evaluate(&bucket.initial_state(1_000), 1_000, 10).next;
    let earlier = bucket.evaluate(&drained, 0, 1);
    assert!(!earlier.admitted);
    assert_eq!(earlier.remaining, 0);
    assert_eq!(earlier.retry_after_ms, 1_100);
    assert_eq!(bucket.last_touched_ms(&earlier.next), 1_000);
}

#[test]
fn acquire_up_to_grants_what_is_there_and_times_the_next_token() {
    // A partial acquisition takes min(want, available) and, when empty, the exact wait for one.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, None);
    let fresh = bucket.initial_state(0);
    assert_eq!(bucket.acquire_up_to(&fresh, 0, 0).granted, 0);
    assert_eq!(bucket.acquire_up_to(&fresh, 0, 0).retry_after_ms, 0);
    let four = bucket.acquire_up_to(&fresh, 0, 4);
    assert_eq!((four.granted, four.remaining), (4, 6));
    let rest = bucket.acquire_up_to(&four.next, 0, 100);
    assert_eq!((rest.granted, rest.remaining, rest.retry_after_ms), (6, 0, 0));
    let none = bucket.acquire_up_to(&rest.next, 40, 5);
    assert_eq!((none.granted, none.remaining, none.retry_after_ms), (0, 0, 60));
}

#[test]
fn give_back_never_fills_a_bucket_past_capacity() {
    // Returning more than was taken stops at a full bucket, which is then pristine.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, None);
    let taken = bucket.evaluate(&bucket.initial_state(0), 0, 3).next;
    let returned = bucket.give_back(&taken, 0, 10);
    assert_eq!(bucket.evaluate(&returned, 0, 0).remaining, 10);
    assert!(bucket.is_pristine(&returned, 0));
}

#[test]
fn is_pristine_only_for_a_full_bucket_at_or_after_its_time() {
    // A full bucket can be forgotten, but not before its own time nor while it is refilling.
    let bucket = spec(Algorithm::TokenBucket, 10, 1_000, None);
    let fresh = bucket.initial_state(1_000);
    assert!(bucket.is_pristine(&fresh, 1_000));
    assert!(bucket.is_pristine(&fresh, 9_000));
    assert!(!bucket.is_pristine(&fresh, 999));
    let one_taken = bucket.evaluate(&fresh, 1_000, 1).next;
    assert!(!bucket.is_pristine(&one_taken, 1_099));
    assert!(bucket.is_pristine(&one_taken, 1_100));
}

// ---------------------------------------------------------------------------------------------
// Fixed window
// ---------------------------------------------------------------------------------------------

#[test]
fn fixed_window_counts_per_aligned_window() {
    // Hits count in epoch-aligned windows; a refusal waits exactly for the next window.
    let window = spec(Algorithm::FixedWindow, 5, 1_000, None);
    let full = admit_singles(&window, window.initial_state(1_500), 1_500, 5);
    let refused = window.evaluate(&full, 1_500, 1);
    assert!(!refused.admitted);
    assert_eq!((refused.remaining, refused.retry_after_ms, refused.reset_ms), (0, 500, 500));
    assert_eq!(window.evaluate(&full, 1_999, 1).retry_after_ms, 1);
    let next_window = window.evaluate(&full, 2_000, 1);
    assert!(next_window.admitted);
    assert_eq!((next_window.remaining, next_window.reset_ms), (4, 1_000));
}

#[test]
fn fixed_window_multi_hit_and_oversized_request() {
    // Multi-hit requests fit or wait for the next window; more than the limit never fits.
    let window = spec(Algorithm::FixedWindow, 5, 1_000, None);
    let three = window.evaluate(&window.initial_state(0), 0, 3);
    assert_eq!((three.admitted, three.remaining, three.reset_ms), (true, 2, 1_000));
    let again = window.evaluate(&three.next, 10, 3);
    assert_eq!((again.admitted, again.remaining, again.retry_after_ms), (false, 2, 990));
    assert_eq!(window.evaluate(&three.next, 10, 6).retry_after_ms, u64::MAX);
    let returned = window.give_back(&three.next, 10, 10);
    assert_eq!(window.evaluate(&returned, 10, 0).remaining, 5);
    assert!(window.is_pristine(&returned, 10));
}

#[test]
fn fixed_window_admits_twice_its_limit_across_a_boundary() {
    // The documented fixed-window bound is reached: 2 * limit within 2 ms around a boundary.
    let window = spec(Algorithm::FixedWindow, 5, 1_000, None);
    let before = window.evaluate(&window.initial_state(999), 999, 5);
    let after = window.evaluate(&before.next, 1_000, 5);
    assert!(before.admitted && after.admitted);
}

// ---------------------------------------------------------------------------------------------
// Sliding window
// ---------------------------------------------------------------------------------------------

#[test]
fn sliding_window_weights_previous_window_and_times_retry_exactly() {
    // The previous window's count fades linearly, and retry lands on the first ms it leaves room.
    let sliding = spec(Algorithm::SlidingWindow, 10, 1_000, None);
    let full = sliding.evaluate(&sliding.initial_state(500), 500, 10);
    assert!(full.admitted);
    assert_eq!(full.reset_ms, 500);
    let refused = sliding.evaluate(&full.next, 1_000, 1);
    assert!(!refused.admitted);
    assert_eq!((refused.remaining, refused.retry_after_ms, refused.reset_ms), (0, 100, 1_000));
    // At 1_099 the previous 10 hits still weigh ceil(9.01) = 10; at 1_100 exactly 9.
    assert!(!sliding.evaluate(&full.next, 1_099, 1).admitted);
    let admitted = sliding.evaluate(&full.next, 1_100, 1);
    assert_eq!((admitted.admitted, admitted.remaining), (true, 0));
}

#[test]
fn sliding_window_rounds_the_previous_weight_up() {
    // A fractional weighted count is rounded up, so the estimate never under-counts.
    let sliding = spec(Algorithm::SlidingWindow, 10, 1_000, None);
    let three = sliding.evaluate(&sliding.initial_state(0), 0, 3).next;
    let remaining_at = |now_ms| sliding.evaluate(&three, now_ms, 0).remaining;
    assert_eq!(remaining_at(1_500), 8, "3 * 0.5 = 1.5 counts as 2");
    assert_eq!(remaining_at(1_666), 8, "3 * 0.334 = 1.002 counts as 2");
    assert_eq!(remaining_at(1_667), 9, "3 * 0.333 = 0.999 counts as 1");
    assert_eq!(remaining_at(2_000), 10);
}

#[test]
fn sliding_window_full_request_waits_for_both_windows_to_expire() {
    // A request for the whole limit must wait until no counted hit weighs any more.
    let sliding = spec(Algorithm::SlidingWindow, 10, 1_000, None);
    let one = sliding.evaluate(&sliding.initial_state(0), 0, 1).next;
    let refused = sliding.evaluate(&one, 0, 10);
    assert_eq!((refused.admitted, refused.retry_after_ms), (false, 2_000));
    assert!(!sliding.evaluate(&one, 1_999, 10).admitted);
    assert!(sliding.evaluate(&one, 2_000, 10).admitted);
}

#[test]
fn sliding_window_reaches_its_documented_bound() {
    // The bound L + floor(L * (W - 2) / W) is tight: 10 per 10 ms admits 18 within 10 ms.
    let sliding = spec(Algorithm::SlidingWindow, 10, 10, None);
    let last_ms_of_window = sliding.evaluate(&sliding.initial_state(9), 9, 10);
    assert!(last_ms_of_window.admitted);
    let mut state = last_ms_of_window.next;
    let mut admitted_in_interval = 10;
    for now_ms in 10..19 {
        let grant = sliding.acquire_up_to(&state, now_ms, u64::MAX);
        admitted_in_interval += grant.granted;
        state = grant.next;
    }
    assert_eq!(admitted_in_interval, 18);
}

// ---------------------------------------------------------------------------------------------
// Extremes
// ---------------------------------------------------------------------------------------------

#[test]
fn extreme_inputs_saturate_instead_of_panicking() {
    // The largest specs, times and hit counts give saturated, still meaningful answers.
    let slowest = spec(Algorithm::TokenBucket, 1, WINDOW_MS_MAX, Some(LIMIT_TOKENS_MAX));
    let drained = slowest.evaluate(&slowest.initial_state(0), 0, LIMIT_TOKENS_MAX);
    assert!(drained.admitted);
    assert_eq!(drained.reset_ms, u64::MAX, "refilling 10^12 tokens at 1 per 400 days");
    assert_eq!(slowest.evaluate(&drained.next, 0, 1).retry_after_ms, WINDOW_MS_MAX);
    let fastest = spec(Algorithm::TokenBucket, LIMIT_TOKENS_MAX, 1, Some(LIMIT_TOKENS_MAX));
    let late = fastest.evaluate(&drained.next, u64::MAX, u64::MAX);
    assert_eq!((late.admitted, late.retry_after_ms), (false, u64::MAX));
    assert_eq!(fastest.evaluate(&late.next, u64::MAX, 0).remaining, LIMIT_TOKENS_MAX);
    let sliding = spec(Algorithm::SlidingWindow, LIMIT_TOKENS_MAX, WINDOW_MS_MAX, None);
    let filled = sliding.evaluate(&sliding.initial_state(u64::MAX), u64::MAX, LIMIT_TOKENS_MAX);
    assert!(filled.admitted);
    let refused = sliding.evaluate(&filled.next, u64::MAX, 1);
    assert!(!refused.admitted);
    assert!(refused.retry_after_ms > 0 && refused.retry_after_ms < u64::MAX);
}

// ---------------------------------------------------------------------------------------------
// A limit of 0
// ---------------------------------------------------------------------------------------------

/// Checks every answer of a limit of 0 on `state`: only 0 hits pass, nothing is ever granted,
/// retry is never, reset is now, and the state is neither read nor changed.
fn assert_refuses_every_hit(spec: &LimitSpec, state: LimitState) {
    assert_eq!(spec.capacity_tokens(), 0);
    for now_ms in [0, 1, 999, 1_000, 1_500, 86_400_000, u64::MAX] {
        let none = spec.evaluate(&state, now_ms, 0);
        assert_eq!(
            (none.admitted, none.remaining, none.reset_ms, none.retry_after_ms),
            (true, 0, 0, 0)
        );
        assert_eq!(none.next, state);
        for hits in [1, 2, LIMIT_TOKENS_MAX, u64::MAX] {
            let refused = spec.evaluate(&state, now_ms, hits);
            assert_eq!(
                (refused.admitted, refused.remaining, refused.reset_ms, refused.retry_after_ms),
                (false, 0, 0, u64::MAX),
                "{hits} hits at {now_ms}"
            );
            assert_eq!(refused.next, state);
        }
        for want in [0, 1, u64::MAX] {
            let grant = spec.acquire_up_to(&state, now_ms, want);
            assert_eq!((grant.granted, grant.remaining, grant.retry_after_ms), (0, 0, u64::MAX));
            assert_eq!(grant.next, state);
        }
        assert_eq!(spec.give_back(&state, now_ms, 5), state);
        assert!(spec.is_pristine(&state, now_ms));
    }
}

#[test]
fn zero_limit_is_valid_for_every_algorithm_with_no_burst() {
    // A limit of 0 builds for every algorithm with a burst of 0 or none, and refuses a burst above 0.
    for algorithm in [Algorithm::TokenBucket, Algorithm::SlidingWindow, Algorithm::FixedWindow] {
        for burst in [None, Some(0)] {
            let zero = LimitSpec::new(algorithm, 0, 1_000, burst).expect("a limit of 0 is valid");
            assert_eq!((zero.requests_per_window, zero.burst_tokens), (0, 0));
        }
        let error = LimitSpec::new(algorithm, 0, 1_000, Some(3)).expect_err("burst above 0");
        assert_eq!(error, LimitSpecError::BurstOfZeroLimit(3));
        assert_eq!(
            error.to_string(),
            "a limit of 0 requests per window refuses every hit, so its burst must be 0 or left \
             out, got 3"
        );
        assert_eq!(LimitSpec::new(algorithm, 0, 0, None), Err(LimitSpecError::Window(0)));
    }
    assert_eq!(
        LimitSpec::new(Algorithm::TokenBucket, 5, 1_000, Some(0)),
        Err(LimitSpecError::Burst(0))
    );
    assert_eq!(
        LimitSpecError::Requests(LIMIT_TOKENS_MAX + 1).to_string(),
        "requests per window must be between 0 and 1000000000000, got 1000000000001"
    );
}

#[test]
fn zero_limit_token_bucket_refuses_every_hit() {
    // A token bucket of 0 never holds a token, fresh, late or stepped back, even if hand-built with a burst.
    let bucket = spec(Algorithm::TokenBucket, 0, 1_000, None);
    assert_refuses_every_hit(&bucket, bucket.initial_state(1_000));
    assert_refuses_every_hit(&bucket, LimitState { updated_ms: 7, level: u64::MAX, carry: 3 });
    let hand_built = LimitSpec { burst_tokens: 5, ..bucket };
    assert_refuses_every_hit(&hand_built, hand_built.initial_state(1_000));
}

#[test]
fn zero_limit_fixed_window_refuses_every_hit() {
    // A fixed window of 0 refuses in every window, before and after its boundaries.
    let window = spec(Algorithm::FixedWindow, 0, 1_000, None);
    assert_refuses_every_hit(&window, window.initial_state(1_500));
    assert_refuses_every_hit(&window, LimitState { updated_ms: u64::MAX, level: 9, carry: 9 });
}

#[test]
fn zero_limit_sliding_window_refuses_every_hit() {
    // A sliding window of 0 refuses whatever the previous window's weight, at any time.
    let sliding = spec(Algorithm::SlidingWindow, 0, 1_000, None);
    assert_refuses_every_hit(&sliding, sliding.initial_state(500));
    assert_refuses_every_hit(&sliding, LimitState { updated_ms: 1_999, level: 0, carry: 4 });
    let one_ms = spec(Algorithm::SlidingWindow, 0, 1, None);
    assert_refuses_every_hit(&one_ms, one_ms.initial_state(0));
}

// ---------------------------------------------------------------------------------------------
// Reference models
// ---------------------------------------------------------------------------------------------

/// What a model or the real code reports for one evaluation: admitted, remaining, reset,
/// retry after.
type Observed = (bool, u64, u64, u64);

fn observed(evaluation: &Evaluation) -> Observed {
    (evaluation.admitted, evaluation.remaining, evaluation.reset_ms, evaluation.retry_after_ms)
}

fn saturate(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// Naive token bucket: exact rational tokens with denominator `window_ms`, in one u128,
/// refilled `requests_per_window` units per elapsed ms and capped at `burst * window_ms`.
/// It knows nothing of micro-tokens or remainders.
struct BucketModel {
    spec: LimitSpec,
    units: u128,
    last_ms: u64,
}

impl BucketModel {
    fn new(spec: LimitSpec, now_ms: u64) -> Self {
        let units = u128::from(spec.burst_tokens) * u128::from(spec.window_ms);
        Self { spec, units, last_ms: now_ms }
    }

    fn capacity_units(&self) -> u128 {
        u128::from(self.spec.burst_tokens) * u128::from(self.spec.window_ms)
    }

    fn refill(&mut self, now_ms: u64) -> u64 {
        let at_ms = self.last_ms.max(now_ms);
        let refill = u128::from(at_ms - self.last_ms) * u128::from(self.spec.requests_per_window);
        self.units = (self.units + refill).min(self.capacity_units());
        self.last_ms = at_ms;
        at_ms
    }

    fn whole_tokens(&self) -> u64 {
        saturate(self.units / u128::from(self.spec.window_ms))
    }

    /// Ms from `now_ms` until the bucket holds `target_units`; `u64::MAX` if it never will.
    fn wait_ms(&self, now_ms: u64, target_units: u128) -> u64 {
        let missing_units = target_units.saturating_sub(self.units);
        let rate = u128::from(self.spec.requests_per_window);
        if rate == 0 && missing_units > 0 {
            // A limit of 0 never refills.
            return u64::MAX;
        }
        let refill_ms = missing_units.div_ceil(rate.max(1));
        saturate(u128::from(self.last_ms - now_ms) + refill_ms)
    }

    /// Ms from `now_ms` until the bucket is full; 0 for a limit of 0, which holds nothing to
    /// refill.
    fn reset_ms(&self, now_ms: u64) -> u64 {
        if self.spec.requests_per_window == 0 {
            0
        } else {
            self.wait_ms(now_ms, self.capacity_units())
        }
    }

    fn evaluate(&mut self, now_ms: u64, hits: u64) -> Observed {
        self.refill(now_ms);
        let window = u128::from(self.spec.window_ms);
        if hits <= self.spec.burst_tokens && self.units >= u128::from(hits) * window {
            self.units -= u128::from(hits) * window;
            (true, self.whole_tokens(), self.reset_ms(now_ms), 0)
        } else {
            let retry_ms = if hits > self.spec.burst_tokens {
                u64::MAX
            } else {
                self.wait_ms(now_ms, u128::from(hits) * window)
            };
            (false, self.whole_tokens(), self.reset_ms(now_ms), retry_ms)
        }
    }

    fn acquire(&mut self, now_ms: u64, want: u64) -> (u64, u64, u64) {
        self.refill(now_ms);
        let granted = want.min(self.whole_tokens());
        self.units -= u128::from(granted) * u128::from(self.spec.window_ms);
        let retry_ms = if self.whole_tokens() > 0 || granted > 0 {
            0
        } else {
            self.wait_ms(now_ms, u128::from(self.spec.window_ms))
        };
        (granted, self.whole_tokens(), retry_ms)
    }

    fn give_back(&mut self, now_ms: u64, tokens: u64) {
        self.refill(now_ms);
        let returned = u128::from(tokens) * u128::from(self.spec.window_ms);
        self.units = (self.units + returned).min(self.capacity_units());
    }
}

/// Naive windows: a count per aligned window index (u128 times, so no overflow near
/// `u64::MAX`), an estimate recomputed from those counts, and retry found by trying every ms.
struct WindowModel {
    spec: LimitSpec,
    counts: BTreeMap<u128, u64>,
    last_ms: u64,
}

impl WindowModel {
    fn new(spec: LimitSpec, now_ms: u64) -> Self {
        Self { spec, counts: BTreeMap::new(), last_ms: now_ms }
    }

    fn window(&self) -> u128 {
        u128::from(self.spec.window_ms)
    }

    fn count(&self, index: Option<u128>) -> u128 {
        index.and_then(|index| self.counts.get(&index)).map_or(0, |count| u128::from(*count))
    }

    fn estimate(&self, at_ms: u128) -> u128 {
        let index = at_ms / self.window();
        let current = self.count(Some(index));
        match self.spec.algorithm {
            Algorithm::FixedWindow => current,
            _ => {
                let previous = self.count(index.checked_sub(1));
                (previous * (self.window() - at_ms % self.window())).div_ceil(self.window())
                    + current
            }
        }
    }

    fn fits(&self, at_ms: u128, hits: u64) -> bool {
        self.estimate(at_ms) + u128::from(hits) <= u128::from(self.spec.requests_per_window)
    }

    fn advance(&mut self, now_ms: u64) -> u128 {
        self.last_ms = self.last_ms.max(now_ms);
        u128::from(self.last_ms)
    }

    /// Tries every ms from the model's time on; both counts expire within two windows.
    fn retry_ms(&self, now_ms: u64, hits: u64) -> u64 {
        if hits > self.spec.requests_per_window {
            return u64::MAX;
        }
        let from_ms = u128::from(self.last_ms);
        let fit_ms = (from_ms..=from_ms + 3 * self.window())
            .find(|at_ms| self.fits(*at_ms, hits))
            .expect("everything expires within two windows");
        saturate(fit_ms - u128::from(now_ms))
    }

    /// Ms from `now_ms` to the end of the model's window; 0 for a limit of 0, which never
    /// counts anything that a window end could reset.
    fn reset_ms(&self, now_ms: u64) -> u64 {
        if self.spec.requests_per_window == 0 {
            return 0;
        }
        let end_ms = (u128::from(self.last_ms) / self.window() + 1) * self.window();
        saturate(end_ms - u128::from(now_ms))
    }

    fn remaining(&self) -> u64 {
        saturate(
            u128::from(self.spec.requests_per_window)
                .saturating_sub(self.estimate(u128::from(self.last_ms))),
        )
    }

    fn record(&mut self, at_ms: u128, hits: u64) {
        *self.counts.entry(at_ms / self.window()).or_insert(0) += hits;
    }

    fn evaluate(&mut self, now_ms: u64, hits: u64) -> Observed {
        let at_ms = self.advance(now_ms);
        if self.fits(at_ms, hits) {
            self.record(at_ms, hits);
            (true, self.remaining(), self.reset_ms(now_ms), 0)
        } else {
            (false, self.remaining(), self.reset_ms(now_ms), self.retry_ms(now_ms, hits))
        }
    }

    fn acquire(&mut self, now_ms: u64, want: u64) -> (u64, u64, u64) {
        let at_ms = self.advance(now_ms);
        let granted = want.min(self.remaining());
        self.record(at_ms, granted);
        let retry_ms =
            if self.remaining() > 0 || granted > 0 { 0 } else { self.retry_ms(now_ms, 1) };
        (granted, self.remaining(), retry_ms)
    }

    fn give_back(&mut self, now_ms: u64, tokens: u64) {
        let at_ms = self.advance(now_ms);
        let index = at_ms / self.window();
        if let Some(count) = self.counts.get_mut(&index) {
            *count = count.saturating_sub(tokens);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies and histories
// ---------------------------------------------------------------------------------------------

/// One call on a limit, applied `delta_ms` after the previous one (negative: the clock stepped
/// back).
#[derive(Debug, Clone, Copy)]
enum Call {
    Evaluate(u64),
    Acquire(u64),
    GiveBack(u64),
}

#[derive(Debug, Clone, Copy)]
struct Step {
    delta_ms: i64,
    call: Call,
}

fn config() -> ProptestConfig {
    // Failures become named regression tests (STYLE.md), not files in the source tree.
    ProptestConfig { failure_persistence: None, ..ProptestConfig::default() }
}

fn algorithm() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::TokenBucket),
        Just(Algorithm::SlidingWindow),
        Just(Algorithm::FixedWindow)
    ]
}

/// Specs small enough that windows roll and buckets drain within a short history; now and
/// then a limit of 0, whose burst is then 0 or left out.
fn small_spec_of(algorithm: Algorithm) -> impl Strategy<Value = LimitSpec> {
    let requests = prop_oneof![1 => Just(0u64), 12 => 1u64..=12];
    (requests, 1u64..=40, 1u64..=24, any::<bool>()).prop_map(
        move |(requests, window_ms, burst, default_burst)| {
            let burst = match (requests, default_burst) {
                (_, true) => None,
                (0, false) => Some(0),
                (_, false) => Some(burst),
            };
            spec(algorithm, requests, window_ms, burst)
        },
    )
}

fn small_spec() -> impl Strategy<Value = LimitSpec> {
    algorithm().prop_flat_map(small_spec_of)
}

/// Small specs mixed with ones anywhere in the valid range, extremes and limits of 0 included.
fn any_valid_spec() -> impl Strategy<Value = LimitSpec> {
    let tokens = || prop_oneof![Just(1u64), 1..=LIMIT_TOKENS_MAX, Just(LIMIT_TOKENS_MAX)];
    let window_ms = prop_oneof![Just(1u64), 1..=WINDOW_MS_MAX, Just(WINDOW_MS_MAX)];
    prop_oneof![
        8 => small_spec(),
        4 => (algorithm(), tokens(), window_ms.clone(), tokens())
            .prop_map(|(algorithm, requests, window_ms, burst)| {
                spec(algorithm, requests, window_ms, Some(burst))
            }),
        1 => (algorithm(), window_ms).prop_map(|(algorithm, window_ms)| {
            spec(algorithm, 0, window_ms, None)
        }),
    ]
}

fn hits() -> impl Strategy<Value = u64> {
    prop_oneof![8 => 0u64..=4, 2 => 0u64..=30, 1 => Just(u64::MAX), 1 => any::<u64>()]
}

fn delta_ms() -> impl Strategy<Value = i64> {
    prop_oneof![6 => 0i64..=30, 2 => 31i64..=200, 1 => -50i64..0, 1 => Just(100_000i64)]
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        6 => hits().prop_map(Call::Evaluate),
        2 => hits().prop_map(Call::Acquire),
        1 => (0u64..=5).prop_map(Call::GiveBack),
    ]
}

fn steps(max_len: usize) -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (delta_ms(), call()).prop_map(|(delta_ms, call)| Step { delta_ms, call }),
        0..=max_len,
    )
}

fn start_ms() -> impl Strategy<Value = u64> {
    prop_oneof![3 => 0u64..=1 << 40, 1 => (u64::MAX - 100_000)..=u64::MAX]
}

fn extreme_u64() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), Just(1), Just(u64::MAX - 1), Just(u64::MAX), 0u64..=1_000, any::<u64>()]
}

fn apply(spec: &LimitSpec, state: &LimitState, now_ms: u64, call: Call) -> LimitState {
    match call {
        Call::Evaluate(hits) => spec.evaluate(state, now_ms, hits).next,
        Call::Acquire(want) => spec.acquire_up_to(state, now_ms, want).next,
        Call::GiveBack(tokens) => spec.give_back(state, now_ms, tokens),
    }
}

/// Runs a history from a fresh key at `start_ms`; returns the state and the last call's time.
fn run(spec: &LimitSpec, start_ms: u64, history: &[Step]) -> (LimitState, u64) {
    let mut state = spec.initial_state(start_ms);
    let mut now_ms = start_ms;
    for step in history {
        now_ms = now_ms.saturating_add_signed(step.delta_ms);
        state = apply(spec, &state, now_ms, step.call);
    }
    (state, now_ms)
}

/// Whole tokens available at `now_ms`, without changing anything that matters.
fn available(spec: &LimitSpec, state: &LimitState, now_ms: u64) -> u64 {
    spec.evaluate(state, now_ms, 0).remaining
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn token_bucket_matches_exact_rational_model(
        spec in prop_oneof![
            small_spec_of(Algorithm::TokenBucket),
            any_valid_spec().prop_map(|spec| LimitSpec { algorithm: Algorithm::TokenBucket, ..spec }),
        ],
        start_ms in start_ms(),
        history in steps(40),
    ) {
        // Every answer of the bucket equals that of exact rational arithmetic, within capacity.
        let mut model = BucketModel::new(spec, start_ms);
        let mut state = spec.initial_state(start_ms);
        let mut now_ms = start_ms;
        for step in history {
            now_ms = now_ms.saturating_add_signed(step.delta_ms);
            match step.call {
                Call::Evaluate(hits) => {
                    let evaluation = spec.evaluate(&state, now_ms, hits);
                    prop_assert_eq!(observed(&evaluation), model.evaluate(now_ms, hits));
                    prop_assert!(evaluation.remaining <= spec.capacity_tokens());
                    state = evaluation.next;
                }
                Call::Acquire(want) => {
                    let grant = spec.acquire_up_to(&state, now_ms, want);
                    let real = (grant.granted, grant.remaining, grant.retry_after_ms);
                    prop_assert_eq!(real, model.acquire(now_ms, want));
                    state = grant.next;
                }
                Call::GiveBack(tokens) => {
                    state = spec.give_back(&state, now_ms, tokens);
                    model.give_back(now_ms, tokens);
                }
            }
            prop_assert_eq!(available(&spec, &state, now_ms), model.whole_tokens());
            prop_assert!(state.level <= spec.capacity_micro_tokens());
        }
    }

    #[test]
    fn windows_match_per_window_count_model(
        spec in prop_oneof![
            small_spec_of(Algorithm::FixedWindow),
            small_spec_of(Algorithm::SlidingWindow),
        ],
        start_ms in start_ms(),
        history in steps(40),
    ) {
        // Fixed and sliding windows answer like counts kept per aligned window, with brute-force retry.
        let mut model = WindowModel::new(spec, start_ms);
        let mut state = spec.initial_state(start_ms);
        let mut now_ms = start_ms;
        for step in history {
            now_ms = now_ms.saturating_add_signed(step.delta_ms);
            match step.call {
                Call::Evaluate(hits) => {
                    let evaluation = spec.evaluate(&state, now_ms, hits);
                    prop_assert_eq!(observed(&evaluation), model.evaluate(now_ms, hits));
                    prop_assert!(evaluation.remaining <= spec.capacity_tokens());
                    state = evaluation.next;
                }
                Call::Acquire(want) => {
                    let grant = spec.acquire_up_to(&state, now_ms, want);
                    let real = (grant.granted, grant.remaining, grant.retry_after_ms);
                    prop_assert_eq!(real, model.acquire(now_ms, want));
                    state = grant.next;
                }
                Call::GiveBack(tokens) => {
                    state = spec.give_back(&state, now_ms, tokens);
                    model.give_back(now_ms, tokens);
                }
            }
            prop_assert_eq!(available(&spec, &state, now_ms), model.remaining());
        }
    }

    #[test]
    fn retry_after_is_the_exact_first_admitting_ms(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        delta_ms in delta_ms(),
        hits in hits(),
    ) {
        // A refused request is admitted at now + retry_after and still refused one ms earlier.
        let (state, last_ms) = run(&spec, start_ms, &history);
        let now_ms = last_ms.saturating_add_signed(delta_ms);
        let evaluation = spec.evaluate(&state, now_ms, hits);
        if hits > spec.capacity_tokens() {
            prop_assert_eq!(evaluation.retry_after_ms, u64::MAX);
        }
        if !evaluation.admitted {
            prop_assert!(evaluation.retry_after_ms > 0);
            // u64::MAX means never, even from now_ms = 0.
            if evaluation.retry_after_ms < u64::MAX
                && let Some(retry_at_ms) = now_ms.checked_add(evaluation.retry_after_ms)
            {
                prop_assert!(spec.evaluate(&state, retry_at_ms, hits).admitted);
                prop_assert!(!spec.evaluate(&state, retry_at_ms - 1, hits).admitted);
            }
        }
        let grant = spec.acquire_up_to(&state, now_ms, hits.max(1));
        if grant.granted == 0
            && grant.retry_after_ms < u64::MAX
            && let Some(retry_at_ms) = now_ms.checked_add(grant.retry_after_ms)
        {
            prop_assert_eq!(spec.acquire_up_to(&state, retry_at_ms, 1).granted, 1);
            prop_assert_eq!(spec.acquire_up_to(&state, retry_at_ms - 1, 1).granted, 0);
        }
    }

    #[test]
    fn reset_ms_is_exact(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        delta_ms in delta_ms(),
        hits in hits(),
    ) {
        // A bucket is full exactly at now + reset_ms; a window ends exactly at now + reset_ms.
        let (state, last_ms) = run(&spec, start_ms, &history);
        let now_ms = last_ms.saturating_add_signed(delta_ms);
        let evaluation = spec.evaluate(&state, now_ms, hits);
        let next = evaluation.next;
        if spec.requests_per_window == 0 {
            // Nothing to reset, and no time in the state that counts.
            prop_assert_eq!(evaluation.reset_ms, 0);
            return Ok(());
        }
        let state_ms = spec.last_touched_ms(&next);
        prop_assert!(evaluation.reset_ms >= state_ms - now_ms);
        let Some(reset_at_ms) = now_ms.checked_add(evaluation.reset_ms) else {
            return Ok(());
        };
        match spec.algorithm {
            Algorithm::TokenBucket => {
                prop_assert!(spec.is_pristine(&next, reset_at_ms));
                prop_assert_eq!(available(&spec, &next, reset_at_ms), spec.burst_tokens);
                if evaluation.reset_ms > 0 {
                    prop_assert!(!spec.is_pristine(&next, reset_at_ms - 1));
                }
            }
            Algorithm::SlidingWindow | Algorithm::FixedWindow => {
                prop_assert!(reset_at_ms > state_ms);
                prop_assert_eq!(reset_at_ms % spec.window_ms, 0);
                prop_assert_eq!((reset_at_ms - 1) / spec.window_ms, state_ms / spec.window_ms);
            }
        }
    }

    #[test]
    fn rejected_evaluation_consumes_nothing(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        delta_ms in delta_ms(),
        hits in hits(),
    ) {
        // A refused evaluation leaves exactly the state a zero-hit evaluation leaves.
        let (state, last_ms) = run(&spec, start_ms, &history);
        let now_ms = last_ms.saturating_add_signed(delta_ms);
        let evaluation = spec.evaluate(&state, now_ms, hits);
        let untouched = spec.evaluate(&state, now_ms, 0);
        if !evaluation.admitted {
            prop_assert_eq!(evaluation.next, untouched.next);
            prop_assert_eq!(evaluation.remaining, untouched.remaining);
        }
        let grant = spec.acquire_up_to(&state, now_ms, hits);
        if grant.granted == 0 {
            prop_assert_eq!(grant.next, untouched.next);
        }
    }

    #[test]
    fn admissions_in_any_interval_respect_the_documented_bound(
        spec in small_spec(),
        start_ms in 0u64..=1 << 40,
        calls in prop::collection::vec(
            (0u64..=45, prop_oneof![Just(u64::MAX), 0u64..=6], any::<bool>()),
            1..=80,
        ),
        interval_ms in 1u64..=200,
    ) {
        // Greedy traffic never gets more than the module doc's bound into any interval.
        let mut state = spec.initial_state(start_ms);
        let mut now_ms = start_ms;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (delta_ms, want, partial) in calls {
            now_ms += delta_ms;
            let taken = if partial {
                let grant = spec.acquire_up_to(&state, now_ms, want);
                state = grant.next;
                grant.granted
            } else {
                let evaluation = spec.evaluate(&state, now_ms, want);
                state = evaluation.next;
                if evaluation.admitted { want } else { 0 }
            };
            admitted.push((now_ms, taken));
        }
        let limit = spec.requests_per_window;
        let window_ms = spec.window_ms;
        let admitted_within = |from_ms: u64, length_ms: u64| -> u64 {
            admitted
                .iter()
                .filter(|(at_ms, _)| *at_ms >= from_ms && *at_ms - from_ms < length_ms)
                .map(|(_, tokens)| *tokens)
                .sum()
        };
        // The busiest interval starts at an admission, so those starts cover every interval.
        for &(from_ms, _) in &admitted {
            match spec.algorithm {
                Algorithm::TokenBucket => {
                    let bound = spec.burst_tokens + (interval_ms - 1) * limit / window_ms;
                    prop_assert!(bound <= spec.burst_tokens + (interval_ms * limit).div_ceil(window_ms));
                    prop_assert!(admitted_within(from_ms, interval_ms) <= bound);
                }
                Algorithm::FixedWindow => {
                    let windows_touched =
                        (from_ms + interval_ms - 1) / window_ms - from_ms / window_ms + 1;
                    prop_assert!(admitted_within(from_ms, interval_ms) <= limit * windows_touched);
                }
                Algorithm::SlidingWindow => {
                    let bound = limit + limit * window_ms.saturating_sub(2) / window_ms;
                    prop_assert!(bound < 2 * limit || limit == 0);
                    prop_assert!(admitted_within(from_ms, window_ms) <= bound);
                }
            }
        }
    }

    #[test]
    fn time_going_backwards_changes_nothing(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        back_ms in 1u64..=100_000,
        hits in hits(),
    ) {
        // At an earlier now_ms a state decides as at its own time: no token minted, no window reopened.
        let (state, _) = run(&spec, start_ms, &history);
        let state_ms = spec.last_touched_ms(&state);
        let earlier_ms = state_ms.saturating_sub(back_ms);
        let gap_ms = state_ms - earlier_ms;
        let then = spec.evaluate(&state, state_ms, hits);
        let earlier = spec.evaluate(&state, earlier_ms, hits);
        prop_assert_eq!(earlier.admitted, then.admitted);
        prop_assert_eq!(earlier.remaining, then.remaining);
        prop_assert_eq!(earlier.next, then.next);
        // A limit of 0 reports reset 0 at any time, since it has nothing to reset.
        let reset_gap_ms = if spec.requests_per_window == 0 { 0 } else { gap_ms };
        prop_assert_eq!(earlier.reset_ms, then.reset_ms.saturating_add(reset_gap_ms));
        if !then.admitted {
            prop_assert_eq!(earlier.retry_after_ms, then.retry_after_ms.saturating_add(gap_ms));
        }
        prop_assert!(available(&spec, &state, earlier_ms) <= available(&spec, &state, state_ms));
        prop_assert_eq!(spec.give_back(&state, earlier_ms, hits), spec.give_back(&state, state_ms, hits));
    }

    #[test]
    fn any_u64_inputs_never_panic(
        algorithm in algorithm(),
        requests in extreme_u64(),
        window_ms in extreme_u64(),
        burst in extreme_u64(),
        (updated_ms, level, carry) in (extreme_u64(), extreme_u64(), extreme_u64()),
        now_ms in extreme_u64(),
        hits in extreme_u64(),
    ) {
        // Any spec fields, any state and any inputs, valid or not, give answers instead of panics.
        let spec = LimitSpec { algorithm, requests_per_window: requests, window_ms, burst_tokens: burst };
        let state = LimitState { updated_ms, level, carry };
        let evaluation = spec.evaluate(&state, now_ms, hits);
        let grant = spec.acquire_up_to(&state, now_ms, hits);
        let returned = spec.give_back(&state, now_ms, hits);
        prop_assert!(evaluation.remaining <= spec.capacity_tokens());
        prop_assert!(grant.granted <= hits && grant.remaining <= spec.capacity_tokens());
        prop_assert!(available(&spec, &returned, now_ms) <= spec.capacity_tokens());
        spec.is_pristine(&state, now_ms);
        spec.is_pristine(&spec.initial_state(now_ms), now_ms);
    }

    #[test]
    fn give_back_never_exceeds_capacity_and_undoes_an_acquisition(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        want in hits(),
        extra in extreme_u64(),
    ) {
        // Tokens given back at the time they were taken restore the state, and no more fit.
        let (state, now_ms) = run(&spec, start_ms, &history);
        let before = available(&spec, &state, now_ms);
        let grant = spec.acquire_up_to(&state, now_ms, want);
        let restored = spec.give_back(&grant.next, now_ms, grant.granted);
        prop_assert_eq!(available(&spec, &restored, now_ms), before);
        let overfilled = spec.give_back(&restored, now_ms, extra);
        prop_assert!(available(&spec, &overfilled, now_ms) <= spec.capacity_tokens());
    }

    #[test]
    fn acquire_up_to_agrees_with_evaluate(
        spec in any_valid_spec(),
        start_ms in start_ms(),
        history in steps(30),
        want in hits(),
    ) {
        // A grant is the largest all-or-nothing evaluation that would pass, with the same outcome.
        let (state, now_ms) = run(&spec, start_ms, &history);
        let grant = spec.acquire_up_to(&state, now_ms, want);
        prop_assert!(grant.granted <= want);
        if grant.granted > 0 {
            let evaluation = spec.evaluate(&state, now_ms, grant.granted);
            prop_assert!(evaluation.admitted);
            prop_assert_eq!((evaluation.remaining, evaluation.next), (grant.remaining, grant.next));
        }
        if grant.granted < want {
            prop_assert!(!spec.evaluate(&state, now_ms, grant.granted + 1).admitted);
        }
        if grant.granted == 0 {
            prop_assert_eq!(grant.retry_after_ms, spec.evaluate(&state, now_ms, 1).retry_after_ms);
        }
    }

    #[test]
    fn pristine_states_decide_exactly_like_fresh_ones(
        spec in small_spec(),
        start_ms in start_ms(),
        history in steps(20),
        gap_ms in prop_oneof![0u64..=50, 0u64..=2_000, Just(1_000_000)],
        future in steps(20),
    ) {
        // A state that is_pristine at now can be replaced by a fresh one without changing any answer from now on.
        let (state, last_ms) = run(&spec, start_ms, &history);
        let now_ms = last_ms.saturating_add(gap_ms);
        prop_assert!(spec.is_pristine(&spec.initial_state(now_ms), now_ms));
        if !spec.is_pristine(&state, now_ms) {
            return Ok(());
        }
        let mut kept = state;
        let mut fresh = spec.initial_state(now_ms);
        let mut at_ms = now_ms;
        // A limit of 0 hands back the state it is given, so kept and fresh states keep their
        // different times, which no decision reads; there only the answers must agree.
        let states_agree = |kept: &LimitState, fresh: &LimitState| {
            spec.requests_per_window == 0 || kept == fresh
        };
        for step in future {
            // The clock may step back, but not before the time the key was forgotten.
            at_ms = at_ms.saturating_add_signed(step.delta_ms).max(now_ms);
            match step.call {
                Call::Evaluate(hits) => {
                    let (from_kept, from_fresh) =
                        (spec.evaluate(&kept, at_ms, hits), spec.evaluate(&fresh, at_ms, hits));
                    prop_assert_eq!(observed(&from_kept), observed(&from_fresh));
                    prop_assert!(states_agree(&from_kept.next, &from_fresh.next));
                    (kept, fresh) = (from_kept.next, from_fresh.next);
                }
                Call::Acquire(want) => {
                    let (from_kept, from_fresh) =
                        (spec.acquire_up_to(&kept, at_ms, want), spec.acquire_up_to(&fresh, at_ms, want));
                    prop_assert_eq!(
                        (from_kept.granted, from_kept.remaining, from_kept.retry_after_ms),
                        (from_fresh.granted, from_fresh.remaining, from_fresh.retry_after_ms)
                    );
                    prop_assert!(states_agree(&from_kept.next, &from_fresh.next));
                    (kept, fresh) = (from_kept.next, from_fresh.next);
                }
                Call::GiveBack(tokens) => {
                    kept = spec.give_back(&kept, at_ms, tokens);
                    fresh = spec.give_back(&fresh, at_ms, tokens);
                    prop_assert!(states_agree(&kept, &fresh));
                }
            }
        }
    }
}

/// The reset estimate from a count: a bucket refills what is missing at its rate (rounded
/// up), a window ends at the next multiple of its length, a limit of 0 never resets.
#[test]
fn reset_estimate_from_a_count() {
    let bucket =
        LimitSpec::new(Algorithm::TokenBucket, 10, 1_000, Some(20)).expect("a valid limit");
    assert_eq!(bucket.reset_ms_estimate(20, 5_000), 0, "full");
    assert_eq!(bucket.reset_ms_estimate(0, 5_000), 2_000, "20 tokens at 10/s");
    assert_eq!(bucket.reset_ms_estimate(17, 5_000), 300);
    let window = LimitSpec::new(Algorithm::FixedWindow, 5, 30_000, None).expect("a valid limit");
    assert_eq!(window.reset_ms_estimate(3, 61_000), 29_000);
    assert_eq!(window.reset_ms_estimate(3, 60_000), 30_000);
    let zero = LimitSpec::new(Algorithm::TokenBucket, 0, 1_000, None).expect("a valid limit");
    assert_eq!(zero.reset_ms_estimate(0, 1), 0);
}

proptest! {
    /// For a bucket, the estimate agrees with the state's own reset when the state holds
    /// exactly `remaining` whole tokens and no fraction.
    #[test]
    fn bucket_reset_estimate_matches_evaluate(
        rate in 1..1_000u64,
        window_ms in 1..100_000u64,
        burst in 1..1_000u64,
        taken in 0..1_000u64,
    ) {
        let spec = LimitSpec::new(Algorithm::TokenBucket, rate, window_ms, Some(burst)).expect("a valid limit");
        let taken = taken.min(burst);
        let state = spec.initial_state(1_000);
        let evaluation = spec.evaluate(&state, 1_000, taken);
        prop_assert_eq!(spec.reset_ms_estimate(evaluation.remaining, 1_000), evaluation.reset_ms);
    }
}

/// A token bucket whose numbers change back and forth (a region's slice as nodes see it at
/// different moments) grants at most its first capacity plus the refill of the numbers in
/// force over each step; a window never counts more hits in one window than the largest
/// limit in force in it. Counts only carry over between limits of one shape.
#[test]
fn a_moved_slice_keeps_its_count_and_a_reshaped_limit_starts_over() {
    let small = spec(Algorithm::TokenBucket, 50, 1_000, None);
    let large = spec(Algorithm::TokenBucket, 100, 1_000, None);
    let drained = small.evaluate(&small.initial_state(0), 0, 50).next;
    let carried = large.carried_from(&small, &drained, 0).expect("same shape");
    assert_eq!(large.evaluate(&carried, 0, 1).remaining, 0, "nothing minted by the move");
    assert_eq!(large.evaluate(&carried, 10, 1).remaining, 0, "10 ms of 100/s: one token");
    let full = large.initial_state(0);
    let cut = small.carried_from(&large, &full, 0).expect("same shape");
    assert_eq!(small.evaluate(&cut, 0, 0).remaining, 50, "capped at the new capacity");
    let other_window = spec(Algorithm::TokenBucket, 50, 60_000, None);
    assert_eq!(other_window.carried_from(&small, &drained, 0), None);
    let window = spec(Algorithm::FixedWindow, 50, 1_000, None);
    assert_eq!(window.carried_from(&small, &drained, 0), None);
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn changing_numbers_mint_nothing(
        algorithm in algorithm(),
        window_ms in 1u64..=40,
        numbers in proptest::collection::vec((1u64..=12, 1u64..=24), 1..=3),
        steps in proptest::collection::vec((0usize..3, 0u64..=30, 0u64..=6), 1..60),
    ) {
        let specs: Vec<LimitSpec> = numbers
            .iter()
            .map(|(requests, burst)| spec(algorithm, *requests, window_ms, Some(*burst)))
            .collect();
        let mut now_ms = 1_000;
        let mut current = specs[0];
        let mut state = current.initial_state(now_ms);
        // Token bucket: the first capacity plus each step's refill at the numbers in force,
        // in 1 / window_ms tokens.
        let mut allowed_units = u128::from(current.capacity_tokens()) * u128::from(window_ms);
        let mut granted_total: u128 = 0;
        // Windows: hits per aligned window, and the largest limit in force in each.
        let mut per_window: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for (pick, elapsed_ms, want) in steps {
            let next = specs[pick % specs.len()];
            allowed_units += u128::from(current.requests_per_window) * u128::from(elapsed_ms);
            now_ms += elapsed_ms;
            state = next.carried_from(&current, &state, now_ms).expect("one shape");
            current = next;
            let grant = current.acquire_up_to(&state, now_ms, want);
            state = grant.next;
            granted_total += u128::from(grant.granted);
            let window = per_window.entry(now_ms / window_ms).or_insert((0, 0));
            window.0 += grant.granted;
            window.1 = window.1.max(current.requests_per_window);
            if algorithm == Algorithm::TokenBucket {
                prop_assert!(
                    granted_total * u128::from(window_ms) <= allowed_units,
                    "granted {granted_total}, allowed {allowed_units} / {window_ms}"
                );
            }
        }
        if algorithm != Algorithm::TokenBucket {
            for (index, (hits, largest)) in per_window {
                prop_assert!(hits <= largest, "window {index}: {hits} hits, largest limit {largest}");
            }
        }
    }
}

proptest! {
    #[test]
    fn a_packed_limit_unpacks_to_itself(spec in any_valid_spec()) {
        prop_assert_eq!(PackedLimitSpec::pack(&spec).unpack(), spec);
    }
}

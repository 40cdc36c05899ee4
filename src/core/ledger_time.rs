//! Ledger time: how a Raft group's leader stamps the time of each command it proposes, and
//! how far another node's clock may differ from the leader's before it is reported.
//!
//! Ledger time is the time every replica applies a command at: idempotency retention, hold
//! and lease expiry, bucket refill and window alignment all follow it. It must not jump, or
//! one clock far ahead expires every key and refills every bucket at once. So the leader
//! stamps each command, and its stamps never run faster than its own monotonic clock:
//!
//! ```text
//!  becomes leader (new term) ──▶ anchor = (last applied ledger time, monotonic instant)
//!  proposes a command        ──▶ stamp  = anchor_ms + monotonic time elapsed since the anchor
//!  apply (every replica)     ──▶ ledger time = max(ledger time, stamp)
//! ```
//!
//! Wall clocks feed ledger time only on a fresh ledger (time 0), whose first leader starts
//! it at its wall clock. A wall clock far off — the leader's own included — cannot move
//! ledger time faster than real time; ledger time may fall behind wall time by the time
//! between the last command of one leader and the first anchor of the next (an election, or
//! an idle group), never run ahead of it.
//!
//! The leader also compares every proposer's wall clock with its own ([`clock_offset_ms`]):
//! past `max_clock_offset_ms` ([`offset_exceeded`]) the proposer is reported. Its proposals
//! still apply, at the leader's stamp, so they move no time.
//!
//! This module is pure: the shell that reads clocks and holds the anchor is
//! `crate::ledger::ledger_time`.

/// Default `max_clock_offset_ms`: a proposer whose wall clock differs from the leader's by
/// more is reported. NTP keeps nodes of one region within a few milliseconds; 500 ms leaves
/// room for a loaded machine's scheduling delay on the way.
pub const MAX_CLOCK_OFFSET_MS_DEFAULT: u64 = 500;

/// Ledger time a new leader continues from: the last applied ledger time, or on a fresh
/// ledger (time still 0) the leader's wall clock.
pub fn anchor_ms(applied_ledger_ms: u64, leader_wall_ms: u64) -> u64 {
    if applied_ledger_ms == 0 { leader_wall_ms } else { applied_ledger_ms }
}

/// The time a leader stamps on a command: its anchor plus the monotonic time elapsed since
/// it anchored. Never earlier than the anchor, never later by more than the elapsed time.
pub fn stamp_ms(anchor_ms: u64, elapsed_monotonic_ms: u64) -> u64 {
    anchor_ms.saturating_add(elapsed_monotonic_ms)
}

/// How far a proposer's wall clock is ahead of the leader's (negative: behind), from the
/// proposer's reading when it sent and the leader's when it received. The transit time
/// makes a proposer look behind by that much.
pub fn clock_offset_ms(proposer_wall_ms: u64, leader_wall_ms: u64) -> i64 {
    let difference = i128::from(proposer_wall_ms) - i128::from(leader_wall_ms);
    i64::try_from(difference).unwrap_or(if difference < 0 { i64::MIN } else { i64::MAX })
}

/// Whether an offset is past what the region tolerates, either way.
pub fn offset_exceeded(offset_ms: i64, max_clock_offset_ms: u64) -> bool {
    offset_ms.unsigned_abs() > max_clock_offset_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A fresh ledger takes the leader's wall clock; any other continues where it was.
    #[test]
    fn anchor_continues_or_starts_at_the_wall_clock() {
        assert_eq!(anchor_ms(0, 1_700_000_000_000), 1_700_000_000_000);
        assert_eq!(anchor_ms(5, 1_700_000_000_000), 5);
        assert_eq!(anchor_ms(5, 0), 5);
    }

    /// Offsets are signed and saturate instead of overflowing.
    #[test]
    fn offsets_are_signed_and_saturate() {
        assert_eq!(clock_offset_ms(1_500, 1_000), 500);
        assert_eq!(clock_offset_ms(1_000, 1_500), -500);
        assert_eq!(clock_offset_ms(u64::MAX, 0), i64::MAX);
        assert_eq!(clock_offset_ms(0, u64::MAX), i64::MIN);
        assert!(!offset_exceeded(500, 500));
        assert!(!offset_exceeded(-500, 500));
        assert!(offset_exceeded(501, 500));
        assert!(offset_exceeded(-501, 500));
        assert!(offset_exceeded(i64::MIN, 500));
    }

    /// One leader's term in a simulated region: how long it leads (real time) and its wall
    /// clock's error (any sign, up to days), with the gaps between its proposals.
    #[derive(Debug, Clone)]
    struct Term {
        wall_error_ms: i64,
        start_delay_ms: u64,
        proposal_gaps_ms: Vec<u64>,
    }

    fn term() -> impl Strategy<Value = Term> {
        (
            prop_oneof![Just(0i64), -500i64..500, -100_000_000i64..100_000_000],
            0u64..5_000,
            prop::collection::vec(0u64..10_000, 0..20),
        )
            .prop_map(|(wall_error_ms, start_delay_ms, proposal_gaps_ms)| Term {
                wall_error_ms,
                start_delay_ms,
                proposal_gaps_ms,
            })
    }

    /// The naive reference: ledger time as a region of leaders with arbitrary wall-clock
    /// errors makes it, returning (real time elapsed, ledger time at each apply).
    fn run_region(start_real_ms: u64, terms: &[Term]) -> (u64, Vec<u64>) {
        let mut real_ms = start_real_ms;
        let mut ledger_ms = 0u64;
        let mut applied = Vec::new();
        for term in terms {
            real_ms += term.start_delay_ms;
            let wall = real_ms.saturating_add_signed(term.wall_error_ms);
            let anchor = anchor_ms(ledger_ms, wall);
            let anchored_at = real_ms;
            for gap in &term.proposal_gaps_ms {
                real_ms += gap;
                // The leader's monotonic clock measures real time (its rate error is far
                // below what these bounds could see).
                let stamp = stamp_ms(anchor, real_ms - anchored_at);
                ledger_ms = ledger_ms.max(stamp);
                applied.push(ledger_ms);
            }
        }
        (real_ms - start_real_ms, applied)
    }

    proptest! {
        /// Whatever the leaders' wall clocks say, ledger time never goes back and, once
        /// started, never advances by more than the real time elapsed: no clock far ahead
        /// can expire a key or refill a bucket early.
        #[test]
        fn ledger_time_never_outruns_real_time(
            start_real_ms in 1_600_000_000_000u64..1_900_000_000_000,
            terms in prop::collection::vec(term(), 1..8),
        ) {
            let (elapsed_ms, applied) = run_region(start_real_ms, &terms);
            for pair in applied.windows(2) {
                prop_assert!(pair[0] <= pair[1], "ledger time went back: {pair:?}");
            }
            if let (Some(first), Some(last)) = (applied.first(), applied.last()) {
                prop_assert!(last - first <= elapsed_ms,
                    "ledger time advanced {} ms in {elapsed_ms} ms of real time", last - first);
            }
        }

        /// Between two stamps of one leader, ledger time advances by exactly the monotonic
        /// time elapsed between them, whatever its anchor.
        #[test]
        fn stamps_follow_the_monotonic_clock(
            anchor in 1u64..u64::MAX / 2,
            first in 0u64..1_000_000,
            more in 0u64..1_000_000,
        ) {
            let earlier = stamp_ms(anchor, first);
            let later = stamp_ms(anchor, first + more);
            prop_assert_eq!(later - earlier, more);
            prop_assert!(earlier >= anchor);
        }

        /// A proposer is reported exactly when its clock differs by more than the bound.
        #[test]
        fn offset_judgement_matches_the_difference(
            proposer in 0u64..u64::MAX / 2,
            leader in 0u64..u64::MAX / 2,
            bound in 0u64..10_000_000,
        ) {
            let offset = clock_offset_ms(proposer, leader);
            prop_assert_eq!(offset_exceeded(offset, bound), proposer.abs_diff(leader) > bound);
        }
    }
}

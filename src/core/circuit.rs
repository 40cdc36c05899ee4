//! The circuit breaker around ledger calls (DESIGN section 2), as a pure state machine.
//!
//! ```text
//!            3 consecutive failures                 a probe fails or is slow
//!  Closed ─────────────────────────▶ Open ◀─────────────────────────────┐
//!    ▲                                 │ one probe per probe_interval    │
//!    │ 30 s of probes, p99 < 5 ms      ▼                                 │
//!    └──────────────────────────── Recovering ───────────────────────────┘
//! ```
//!
//! While the circuit is not closed the node serves from its fallback (fail-open rules) or
//! denies (fail-closed rules) instead of waiting on the ledger; only probes reach it. The
//! lease-broker actor owns one breaker and reports every call's outcome to it.

/// Most probe latencies kept while recovering (30 s at one probe a second fits).
pub const PROBE_SAMPLES_MAX: usize = 256;

/// Settings of a breaker; defaults from DESIGN section 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// A ledger call slower than this counts as failed (and is abandoned by the caller).
    pub call_timeout_ms: u64,
    /// Consecutive failures that open the circuit.
    pub failures_to_open: u32,
    /// While open, one probe per this interval.
    pub probe_interval_ms: u64,
    /// Healthy probing needed before the circuit closes again.
    pub healthy_probing_ms: u64,
    /// The p99 latency probes must stay below to count as healthy.
    pub healthy_p99_ms: u64,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            call_timeout_ms: 5,
            failures_to_open: 3,
            probe_interval_ms: 1_000,
            healthy_probing_ms: 30_000,
            healthy_p99_ms: 5,
        }
    }
}

/// Where the circuit stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls flow; counts consecutive failures.
    Closed {
        /// Failures since the last success.
        consecutive_failures: u32,
    },
    /// Calls are refused; a probe is due at `next_probe_ms`.
    Open {
        /// When the next probe may go.
        next_probe_ms: u64,
    },
    /// Probes have succeeded since `since_ms`; closes once they have for long enough.
    Recovering {
        /// Start of the healthy streak.
        since_ms: u64,
        /// When the next probe may go.
        next_probe_ms: u64,
        /// Latencies of the streak's probes (bounded).
        latencies_ms: Vec<u64>,
    },
}

/// Whether a ledger call may go now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// The circuit is closed: call.
    Call,
    /// The circuit is open or recovering and a probe is due: call, as a probe.
    Probe,
    /// Do not call; serve without the ledger.
    Refuse,
}

/// What a ledger call came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered within the timeout after this many ms.
    Answered {
        /// Call latency.
        latency_ms: u64,
    },
    /// Failed or timed out.
    Failed,
}

/// A circuit breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: CircuitState,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(settings: BreakerSettings) -> Self {
        Self { settings, state: CircuitState::Closed { consecutive_failures: 0 } }
    }

    /// The current state.
    pub fn state(&self) -> &CircuitState {
        &self.state
    }

    /// True while calls flow normally.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, CircuitState::Closed { .. })
    }

    /// Whether a call may go at `now_ms`. A `Probe` permit moves the next probe time, so
    /// concurrent callers get one probe per interval.
    pub fn permit(&mut self, now_ms: u64) -> Permit {
        let interval_ms = self.settings.probe_interval_ms;
        match &mut self.state {
            CircuitState::Closed { .. } => Permit::Call,
            CircuitState::Open { next_probe_ms }
            | CircuitState::Recovering { next_probe_ms, .. } => {
                if now_ms < *next_probe_ms {
                    return Permit::Refuse;
                }
                *next_probe_ms = now_ms.saturating_add(interval_ms);
                Permit::Probe
            }
        }
    }

    /// Records the outcome of a call that a permit allowed.
    pub fn record(&mut self, now_ms: u64, permit: Permit, outcome: CallOutcome) {
        let settings = self.settings;
        let healthy = matches!(outcome, CallOutcome::Answered { latency_ms } if latency_ms < settings.call_timeout_ms);
        let open_now =
            CircuitState::Open { next_probe_ms: now_ms.saturating_add(settings.probe_interval_ms) };
        match (&mut self.state, permit) {
            (CircuitState::Closed { consecutive_failures }, Permit::Call) => {
                if healthy {
                    *consecutive_failures = 0;
                } else {
                    *consecutive_failures = consecutive_failures.saturating_add(1);
                    if *consecutive_failures >= settings.failures_to_open {
                        self.state = open_now;
                    }
                }
            }
            (CircuitState::Open { next_probe_ms }, Permit::Probe) => {
                if let (true, CallOutcome::Answered { latency_ms }) = (healthy, outcome) {
                    let next_probe_ms = *next_probe_ms;
                    self.state = CircuitState::Recovering {
                        since_ms: now_ms,
                        next_probe_ms,
                        latencies_ms: vec![latency_ms],
                    };
                }
            }
            (CircuitState::Recovering { since_ms, latencies_ms, next_probe_ms }, Permit::Probe) => {
                // Reopened, the probes keep their cadence: the next one is due an interval
                // after this probe's permit (when the caller's probe timer was set), not an
                // interval after its failure came back, which would skip a timer tick and
                // double the gap between probes.
                let reopened = CircuitState::Open { next_probe_ms: *next_probe_ms };
                let CallOutcome::Answered { latency_ms } = outcome else {
                    self.state = reopened;
                    return;
                };
                if latencies_ms.len() < PROBE_SAMPLES_MAX {
                    latencies_ms.push(latency_ms);
                }
                if p99_ms(latencies_ms) >= settings.healthy_p99_ms {
                    self.state = reopened;
                } else if now_ms.saturating_sub(*since_ms) >= settings.healthy_probing_ms {
                    self.state = CircuitState::Closed { consecutive_failures: 0 };
                }
            }
            // A call permitted in another state (the state moved meanwhile) says nothing
            // about the current one.
            _ => {}
        }
    }
}

/// The 99th percentile (nearest rank) of a non-empty sample.
fn p99_ms(latencies_ms: &[u64]) -> u64 {
    let mut sorted = latencies_ms.to_vec();
    sorted.sort_unstable();
    let rank = (sorted.len() * 99).div_ceil(100).max(1);
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OK: CallOutcome = CallOutcome::Answered { latency_ms: 1 };

    /// Three consecutive failures open the circuit; a success in between resets the count.
    #[test]
    fn three_failures_open() {
        let mut breaker = CircuitBreaker::new(BreakerSettings::default());
        for outcome in
            [CallOutcome::Failed, CallOutcome::Failed, OK, CallOutcome::Failed, CallOutcome::Failed]
        {
            assert_eq!(breaker.permit(0), Permit::Call);
            breaker.record(0, Permit::Call, outcome);
        }
        assert!(breaker.is_closed());
        breaker.record(10, Permit::Call, CallOutcome::Answered { latency_ms: 5 });
        assert_eq!(
            breaker.state(),
            &CircuitState::Open { next_probe_ms: 1_010 },
            "5 ms is a timeout"
        );
    }

    /// While open, one probe per second; 30 s of fast probes close it again; a slow or
    /// failed probe reopens it.
    #[test]
    fn probes_close_after_thirty_healthy_seconds() {
        let mut breaker = CircuitBreaker::new(BreakerSettings::default());
        for _ in 0..3 {
            breaker.record(0, Permit::Call, CallOutcome::Failed);
        }
        assert_eq!(breaker.permit(999), Permit::Refuse);
        assert_eq!(breaker.permit(1_000), Permit::Probe);
        assert_eq!(breaker.permit(1_000), Permit::Refuse, "one probe per interval");
        breaker.record(1_001, Permit::Probe, OK);
        let mut now_ms = 1_001;
        while !breaker.is_closed() {
            now_ms += 1_000;
            assert!(now_ms <= 32_001, "closed after 30 s of probes");
            assert_eq!(breaker.permit(now_ms), Permit::Probe);
            breaker.record(now_ms, Permit::Probe, OK);
        }
        assert_eq!(now_ms, 31_001);

        for _ in 0..3 {
            breaker.record(now_ms, Permit::Call, CallOutcome::Failed);
        }
        now_ms += 1_000;
        assert_eq!(breaker.permit(now_ms), Permit::Probe);
        breaker.record(now_ms, Permit::Probe, OK);
        now_ms += 1_000;
        assert_eq!(breaker.permit(now_ms), Permit::Probe);
        breaker.record(now_ms, Permit::Probe, CallOutcome::Answered { latency_ms: 9 });
        assert!(matches!(breaker.state(), CircuitState::Open { .. }), "a slow probe reopens");
    }

    /// A probe that fails or is slow while recovering reopens the circuit without delaying
    /// the next probe: it is due one interval after the failed probe's permit (when the lease
    /// broker set its probe timer), not one interval after the failure came back.
    #[test]
    fn a_failed_probe_keeps_the_probe_cadence() {
        let mut breaker = CircuitBreaker::new(BreakerSettings::default());
        for _ in 0..3 {
            breaker.record(0, Permit::Call, CallOutcome::Failed);
        }
        assert_eq!(breaker.permit(1_000), Permit::Probe);
        breaker.record(1_001, Permit::Probe, OK);
        assert_eq!(breaker.permit(2_000), Permit::Probe);
        breaker.record(2_005, Permit::Probe, CallOutcome::Failed);
        assert!(matches!(breaker.state(), CircuitState::Open { .. }));
        assert_eq!(breaker.permit(3_000), Permit::Probe, "the next timer tick may probe");
        breaker.record(3_001, Permit::Probe, OK);
        assert_eq!(breaker.permit(4_000), Permit::Probe);
        breaker.record(4_009, Permit::Probe, CallOutcome::Answered { latency_ms: 9 });
        assert!(matches!(breaker.state(), CircuitState::Open { .. }), "a slow probe reopens");
        assert_eq!(breaker.permit(4_999), Permit::Refuse, "still one probe per interval");
        assert_eq!(breaker.permit(5_000), Permit::Probe);
    }

    /// The p99 uses the nearest rank.
    #[test]
    fn p99_is_nearest_rank() {
        assert_eq!(p99_ms(&[3]), 3);
        let mut sample: Vec<u64> = (1..=100).collect();
        assert_eq!(p99_ms(&sample), 99);
        sample.push(1_000);
        assert_eq!(p99_ms(&sample), 100);
    }

    proptest! {
        /// Whatever the outcomes, a closed circuit never refuses, an open one allows at
        /// most one probe per interval, and it closes only after a healthy streak as long as
        /// the setting.
        #[test]
        fn breaker_invariants(steps in proptest::collection::vec((0..700u64, any::<bool>(), 0..8u64), 1..400)) {
            let settings = BreakerSettings::default();
            let mut breaker = CircuitBreaker::new(settings);
            let mut now_ms = 0_u64;
            let mut last_probe_ms: Option<u64> = None;
            let mut streak_start_ms: Option<u64> = None;
            for (advance_ms, fails, latency_ms) in steps {
                now_ms += advance_ms;
                let was_closed = breaker.is_closed();
                let permit = breaker.permit(now_ms);
                prop_assert_eq!(was_closed, permit == Permit::Call);
                if permit == Permit::Refuse {
                    continue;
                }
                if permit == Permit::Probe {
                    if let Some(last) = last_probe_ms {
                        prop_assert!(now_ms - last >= settings.probe_interval_ms);
                    }
                    last_probe_ms = Some(now_ms);
                }
                let outcome = if fails { CallOutcome::Failed } else { CallOutcome::Answered { latency_ms } };
                breaker.record(now_ms, permit, outcome);
                match breaker.state() {
                    CircuitState::Recovering { since_ms, .. } => streak_start_ms = Some(*since_ms),
                    CircuitState::Closed { .. } if !was_closed => {
                        let start = streak_start_ms.take().expect("closing follows a streak");
                        prop_assert!(now_ms - start >= settings.healthy_probing_ms);
                        last_probe_ms = None;
                    }
                    CircuitState::Open { .. } => streak_start_ms = None,
                    CircuitState::Closed { .. } => {}
                }
            }
        }
    }
}

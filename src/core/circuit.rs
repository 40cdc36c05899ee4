//! The circuit breaker around ledger calls (DESIGN section 2), as a pure state machine.
//!
//! ```text
//!            3 consecutive failures                   a call fails or is slow
//!  Closed ─────────────────────────▶ Open ◀─────────────────────────────┐
//!    ▲                                 │ one probe per probe_interval    │
//!    │ close_after_calls healthy calls │ the first healthy probe, or a   │
//!    │                                 │ slow call's late answer         │
//!    │                                 ▼                                 │
//!    └──────────────────────────── HalfOpen ─────────────────────────────┘
//!                                  (leasing resumes: every call goes)
//! ```
//!
//! A call is judged against the ledger's own measured latency, not a fixed number: while the
//! circuit is closed it is slow when it takes longer than `latency_multiplier x` the p90 of
//! recent answered calls, kept between a floor and a ceiling ([`LatencyTracker`]; a second
//! before anything is measured). The p90 rather than the p99: the few calls that waited out
//! a leader election must not raise the deadline so far that the next outage goes unnoticed
//! for seconds, while a ledger that became slow for good moves the p90 within a few dozen
//! calls. Open or half-open, calls are judged against the ceiling, so a ledger that answers,
//! however slowly, closes the circuit again and its latency is learnt. A fixed deadline
//! stays available as a setting. Judging a call slow never abandons it: its answer is
//! applied whenever it comes (the lease broker's business), so the breaker decides only
//! whether the node waits for the ledger or decides from its fallback, never what a count
//! is.
//!
//! While the circuit is open the node serves from its fallback (fail-open rules) or denies
//! (fail-closed rules) instead of waiting on the ledger; only probes reach it. Half-open, the
//! node leases again at once, keeping the fallback as its backstop.

/// Latencies of recent calls the tracker keeps.
pub const LATENCY_SAMPLES_MAX: usize = 128;

/// How a breaker judges calls and recovers; defaults from DESIGN section 2.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerSettings {
    /// A fixed deadline for every call, in ms; `None` judges calls by measured latency.
    pub fixed_deadline_ms: Option<u64>,
    /// The measured deadline is this multiple of the recent p90.
    pub latency_multiplier: u64,
    /// The measured deadline is never below this.
    pub deadline_floor_ms: u64,
    /// The measured deadline is never above this.
    pub deadline_ceiling_ms: u64,
    /// The deadline before any call has answered (nothing measured yet).
    pub deadline_initial_ms: u64,
    /// Consecutive failures that open the circuit.
    pub failures_to_open: u32,
    /// While open, one probe per this interval.
    pub probe_interval_ms: u64,
    /// Healthy calls in a row, half-open, that close the circuit.
    pub close_after_calls: u32,
}

impl Default for BreakerSettings {
    fn default() -> Self {
        Self {
            fixed_deadline_ms: None,
            latency_multiplier: 4,
            deadline_floor_ms: 100,
            deadline_ceiling_ms: 5_000,
            deadline_initial_ms: 1_000,
            failures_to_open: 3,
            probe_interval_ms: 1_000,
            close_after_calls: 5,
        }
    }
}

/// The recent latencies of answered calls, read as a deadline.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LatencyTracker {
    samples_ms: Vec<u64>,
    /// Where the next sample goes once the ring is full.
    next: usize,
    p90_ms: u64,
}

impl LatencyTracker {
    /// Records an answered call's latency.
    pub fn record(&mut self, latency_ms: u64) {
        if self.samples_ms.len() < LATENCY_SAMPLES_MAX {
            self.samples_ms.push(latency_ms);
        } else {
            self.samples_ms[self.next] = latency_ms;
            self.next = (self.next + 1) % LATENCY_SAMPLES_MAX;
        }
        self.p90_ms = percentile_ms(&self.samples_ms, 90);
    }

    /// The p90 of the recent samples (nearest rank); `None` before any.
    pub fn p90_ms(&self) -> Option<u64> {
        (!self.samples_ms.is_empty()).then_some(self.p90_ms)
    }
}

/// Where the circuit stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls flow; counts consecutive failures.
    Closed {
        /// Failures since the last healthy call.
        consecutive_failures: u32,
    },
    /// Calls are refused; a probe is due at `next_probe_ms`.
    Open {
        /// When the next probe may go.
        next_probe_ms: u64,
    },
    /// A probe succeeded: calls flow again; closes after enough healthy ones.
    HalfOpen {
        /// Healthy calls since the probe that opened it, the probe included.
        healthy_calls: u32,
    },
}

/// Whether a ledger call may go now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// The circuit is closed or half-open: call.
    Call,
    /// The circuit is open and a probe is due: call, as a probe.
    Probe,
    /// Do not call; serve without the ledger.
    Refuse,
}

/// What a ledger call came to, as the breaker judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// Answered within its deadline after this many ms.
    Answered {
        /// Call latency.
        latency_ms: u64,
    },
    /// Failed, or still unanswered at its deadline.
    Failed,
}

/// A circuit breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: CircuitState,
    latency: LatencyTracker,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(settings: BreakerSettings) -> Self {
        Self {
            settings,
            state: CircuitState::Closed { consecutive_failures: 0 },
            latency: LatencyTracker::default(),
        }
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        self.state
    }

    /// True while the circuit is open: only probes reach the ledger.
    pub fn is_open(&self) -> bool {
        matches!(self.state, CircuitState::Open { .. })
    }

    /// True once enough healthy calls closed it.
    pub fn is_closed(&self) -> bool {
        matches!(self.state, CircuitState::Closed { .. })
    }

    /// The deadline a call started now is judged against, in ms.
    pub fn deadline_ms(&self) -> u64 {
        let settings = &self.settings;
        if let Some(fixed_ms) = settings.fixed_deadline_ms {
            return fixed_ms;
        }
        if !self.is_closed() {
            return settings.deadline_ceiling_ms;
        }
        match self.latency.p90_ms() {
            None => settings.deadline_initial_ms,
            Some(p90_ms) => p90_ms
                .saturating_mul(settings.latency_multiplier)
                .clamp(settings.deadline_floor_ms, settings.deadline_ceiling_ms),
        }
    }

    /// The p90 latency of recent answered calls, in ms.
    pub fn latency_p90_ms(&self) -> Option<u64> {
        self.latency.p90_ms()
    }

    /// Whether a call may go at `now_ms`. A `Probe` permit moves the next probe time, so
    /// concurrent callers get one probe per interval.
    pub fn permit(&mut self, now_ms: u64) -> Permit {
        match &mut self.state {
            CircuitState::Closed { .. } | CircuitState::HalfOpen { .. } => Permit::Call,
            CircuitState::Open { next_probe_ms } => {
                if now_ms < *next_probe_ms {
                    return Permit::Refuse;
                }
                *next_probe_ms = now_ms.saturating_add(self.settings.probe_interval_ms);
                Permit::Probe
            }
        }
    }

    /// Records a latency measured on an answered call, whether or not it was judged in
    /// time: a slow but answering ledger raises the deadline it is judged by.
    pub fn observe_latency(&mut self, latency_ms: u64) {
        self.latency.record(latency_ms);
    }

    /// Records that a call judged failed at its deadline has answered since, after
    /// `latency_ms`. While the circuit is open, the ledger answering at all is what a probe
    /// waits to learn: an answer within the ceiling that probes are judged by half-opens it as
    /// a healthy probe would, so a stall shorter than a probe interval (a Raft log commit
    /// whose fsync stalled) costs the fallback no more than the stall itself. Closed or
    /// half-open, the call was already judged and nothing changes.
    pub fn record_late_answer(&mut self, latency_ms: u64) {
        if self.is_open() && latency_ms <= self.settings.deadline_ceiling_ms {
            self.state = close_or_half_open(1, self.settings.close_after_calls);
        }
    }

    /// Records the judgement of a call that a permit allowed, made when it answered or when
    /// its deadline passed, whichever came first.
    pub fn record(&mut self, now_ms: u64, permit: Permit, outcome: CallOutcome) {
        let settings = self.settings;
        let healthy = matches!(outcome, CallOutcome::Answered { .. });
        let open_now =
            CircuitState::Open { next_probe_ms: now_ms.saturating_add(settings.probe_interval_ms) };
        self.state = match (self.state, permit) {
            (CircuitState::Closed { .. }, Permit::Call) if healthy => {
                CircuitState::Closed { consecutive_failures: 0 }
            }
            (CircuitState::Closed { consecutive_failures }, Permit::Call) => {
                let failures = consecutive_failures.saturating_add(1);
                if failures >= settings.failures_to_open {
                    open_now
                } else {
                    CircuitState::Closed { consecutive_failures: failures }
                }
            }
            (CircuitState::Open { .. }, Permit::Probe) if healthy => {
                close_or_half_open(1, settings.close_after_calls)
            }
            // A failed probe keeps the probe cadence: the next is due an interval after this
            // probe's permit (already set), not after its failure came back.
            (state @ CircuitState::Open { .. }, Permit::Probe) => state,
            (CircuitState::HalfOpen { healthy_calls }, Permit::Call) if healthy => {
                close_or_half_open(healthy_calls.saturating_add(1), settings.close_after_calls)
            }
            (CircuitState::HalfOpen { .. }, Permit::Call) => open_now,
            // A call permitted in another state (the state moved meanwhile) says nothing
            // about the current one.
            (state, _) => state,
        };
    }
}

fn close_or_half_open(healthy_calls: u32, close_after_calls: u32) -> CircuitState {
    if healthy_calls >= close_after_calls {
        CircuitState::Closed { consecutive_failures: 0 }
    } else {
        CircuitState::HalfOpen { healthy_calls }
    }
}

/// The `percent`-th percentile (nearest rank) of a sample; 0 for none.
fn percentile_ms(latencies_ms: &[u64], percent: usize) -> u64 {
    let mut sorted = latencies_ms.to_vec();
    sorted.sort_unstable();
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted.get(rank - 1).copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const OK: CallOutcome = CallOutcome::Answered { latency_ms: 1 };

    fn opened() -> CircuitBreaker {
        let mut breaker = CircuitBreaker::new(BreakerSettings::default());
        for _ in 0..3 {
            breaker.record(0, Permit::Call, CallOutcome::Failed);
        }
        breaker
    }

    /// Three consecutive failures open the circuit; a healthy call in between resets the
    /// count.
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
        breaker.record(10, Permit::Call, CallOutcome::Failed);
        assert_eq!(breaker.state(), CircuitState::Open { next_probe_ms: 1_010 });
    }

    /// The first healthy probe resumes leasing (half-open: every call goes); five healthy
    /// calls close the circuit, so recovery takes one probe interval, not 30 s.
    #[test]
    fn first_healthy_probe_resumes_leasing() {
        let mut breaker = opened();
        assert_eq!(breaker.permit(999), Permit::Refuse);
        assert_eq!(breaker.permit(1_000), Permit::Probe);
        assert_eq!(breaker.permit(1_000), Permit::Refuse, "one probe per interval");
        breaker.record(1_003, Permit::Probe, OK);
        assert_eq!(breaker.state(), CircuitState::HalfOpen { healthy_calls: 1 });
        assert_eq!(breaker.permit(1_004), Permit::Call, "half-open lets every call through");
        for _ in 0..3 {
            breaker.record(1_005, Permit::Call, OK);
        }
        assert!(!breaker.is_closed());
        breaker.record(1_006, Permit::Call, OK);
        assert!(breaker.is_closed(), "five healthy calls close it");
    }

    /// A call judged failed that answers after all, while the circuit is open, resumes
    /// leasing at once instead of at the next probe; one slower than the ceiling, or one that
    /// answers while the circuit is not open, changes nothing.
    #[test]
    fn a_late_answer_half_opens_an_open_circuit() {
        let mut breaker = opened();
        breaker.record_late_answer(5_001);
        assert!(breaker.is_open(), "slower than the ceiling a probe is judged by");
        breaker.record_late_answer(400);
        assert_eq!(breaker.state(), CircuitState::HalfOpen { healthy_calls: 1 });
        assert_eq!(breaker.permit(1), Permit::Call, "leasing resumes before the probe is due");
        breaker.record_late_answer(400);
        assert_eq!(breaker.state(), CircuitState::HalfOpen { healthy_calls: 1 });
        let mut closed = CircuitBreaker::new(BreakerSettings::default());
        closed.record(0, Permit::Call, CallOutcome::Failed);
        closed.record_late_answer(400);
        assert_eq!(closed.state(), CircuitState::Closed { consecutive_failures: 1 });
    }

    /// A failure while half-open opens the circuit again; a failed probe keeps the probe
    /// cadence.
    #[test]
    fn half_open_failure_reopens() {
        let mut breaker = opened();
        assert_eq!(breaker.permit(1_000), Permit::Probe);
        breaker.record(1_500, Permit::Probe, CallOutcome::Failed);
        assert_eq!(breaker.permit(1_999), Permit::Refuse);
        assert_eq!(breaker.permit(2_000), Permit::Probe, "the next timer tick may probe");
        breaker.record(2_001, Permit::Probe, OK);
        breaker.record(2_002, Permit::Call, CallOutcome::Failed);
        assert_eq!(breaker.state(), CircuitState::Open { next_probe_ms: 3_002 });
    }

    /// Closed, the deadline follows the measured p90 within its floor and ceiling, and a few
    /// slow calls (an election) do not move it; before any answer it is a second; open or
    /// half-open it is the ceiling; a fixed deadline overrides it.
    #[test]
    fn deadline_follows_measured_latency() {
        let mut breaker = CircuitBreaker::new(BreakerSettings::default());
        assert_eq!(breaker.deadline_ms(), 1_000, "patient before the first answer");
        breaker.observe_latency(3);
        assert_eq!(breaker.deadline_ms(), 100, "the floor");
        for _ in 0..200 {
            breaker.observe_latency(80);
        }
        assert_eq!(breaker.deadline_ms(), 320, "4 x a slow but steady p90");
        for _ in 0..8 {
            breaker.observe_latency(2_500);
        }
        assert_eq!(breaker.deadline_ms(), 320, "an election's few slow calls");
        for _ in 0..200 {
            breaker.observe_latency(9_000);
        }
        assert_eq!(breaker.deadline_ms(), 5_000, "the ceiling");
        for _ in 0..200 {
            breaker.observe_latency(3);
        }
        for _ in 0..3 {
            breaker.record(0, Permit::Call, CallOutcome::Failed);
        }
        assert_eq!(breaker.deadline_ms(), 5_000, "open: judged by the ceiling");
        let fixed = CircuitBreaker::new(BreakerSettings {
            fixed_deadline_ms: Some(5),
            ..BreakerSettings::default()
        });
        assert_eq!(fixed.deadline_ms(), 5);
    }

    /// Percentiles use the nearest rank.
    #[test]
    fn percentiles_are_nearest_rank() {
        assert_eq!(percentile_ms(&[3], 90), 3);
        let mut sample: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile_ms(&sample, 99), 99);
        assert_eq!(percentile_ms(&sample, 90), 90);
        sample.push(1_000);
        assert_eq!(percentile_ms(&sample, 99), 100);
        assert_eq!(percentile_ms(&[], 90), 0);
    }

    proptest! {
        /// Whatever the outcomes and late answers: a closed or half-open circuit never
        /// refuses; an open one allows at most one probe per interval; it opens only after
        /// `failures_to_open` failures in a row (closed) or one (half-open); it half-opens
        /// only on a healthy probe or a late answer within the ceiling; it closes only after
        /// `close_after_calls` healthy calls in a row since it was open.
        #[test]
        fn breaker_invariants(
            steps in proptest::collection::vec((0..700u64, any::<bool>(), proptest::option::of(0..10_000u64)), 1..400),
        ) {
            let settings = BreakerSettings::default();
            let mut breaker = CircuitBreaker::new(settings);
            let mut now_ms = 0_u64;
            let mut last_probe_ms: Option<u64> = None;
            let mut failures_in_row = 0_u32;
            let mut healthy_in_row = 0_u32;
            for (advance_ms, fails, late_answer_ms) in steps {
                now_ms += advance_ms;
                if let Some(latency_ms) = late_answer_ms {
                    let before = breaker.state();
                    breaker.record_late_answer(latency_ms);
                    let resumed = matches!(before, CircuitState::Open { .. })
                        && latency_ms <= settings.deadline_ceiling_ms;
                    if resumed {
                        prop_assert_eq!(breaker.state(), CircuitState::HalfOpen { healthy_calls: 1 });
                        healthy_in_row = 1;
                        failures_in_row = 0;
                    } else {
                        prop_assert_eq!(breaker.state(), before);
                    }
                    continue;
                }
                let before = breaker.state();
                let permit = breaker.permit(now_ms);
                prop_assert_eq!(matches!(before, CircuitState::Open { .. }), permit != Permit::Call);
                if permit == Permit::Refuse {
                    continue;
                }
                if permit == Permit::Probe {
                    if let Some(last) = last_probe_ms {
                        prop_assert!(now_ms - last >= settings.probe_interval_ms);
                    }
                    last_probe_ms = Some(now_ms);
                }
                let outcome = if fails { CallOutcome::Failed } else { OK };
                breaker.record(now_ms, permit, outcome);
                if fails { failures_in_row += 1; healthy_in_row = 0 } else { healthy_in_row += 1; failures_in_row = 0 }
                match (before, breaker.state()) {
                    (CircuitState::Closed { .. }, CircuitState::Open { .. }) => {
                        prop_assert!(failures_in_row >= settings.failures_to_open);
                    }
                    (CircuitState::HalfOpen { .. }, CircuitState::Closed { .. }) => {
                        prop_assert!(healthy_in_row >= settings.close_after_calls);
                        last_probe_ms = None;
                    }
                    (CircuitState::Open { .. }, CircuitState::HalfOpen { .. }) => prop_assert!(!fails),
                    (CircuitState::HalfOpen { .. }, CircuitState::Open { .. }) => prop_assert!(fails),
                    _ => {}
                }
            }
        }
    }
}

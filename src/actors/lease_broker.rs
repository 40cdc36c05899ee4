//! The lease-broker actor: the one place a node talks to the quota ledger for leases.
//!
//! ```text
//!  RLS handlers ──ask (bounded)──▶ ┌──────────────┐  one SettleLeases per batch
//!  shard actors ─settle──────────▶ │ LeaseBroker  │ ─────────────────────────▶ quota group leader
//!                                  │  breaker     │ ◀── answers, however late
//!  shard actors ◀──cast answers─── └──────────────┘
//! ```
//!
//! Every ask is a key's report (`crate::core::lease`): its totals spent and held, and what
//! it wants. Asks from every shard are gathered for up to `batch_window_ms` (or until a
//! command is full) and sent as ONE command; the group forwards it to the leader
//! (`crate::ledger::RaftGroup::write`).
//!
//! The circuit breaker (`crate::core::circuit`) judges each call against the ledger's
//! measured latency when it answers or when its deadline passes, whichever comes first. At
//! its deadline a call's asks are answered "not applied", so their keys may report again
//! (and the breaker sees the next calls fail too, when the ledger is gone); the call itself
//! runs on until its answer comes (bounded by [`CALL_TIMEOUT`]). Whatever such a late call
//! granted is not lost: the keys marked themselves unconfirmed, and their next reports
//! settle it back to the bucket (`crate::core::ledger`'s settlement). While the circuit is
//! open, asks are answered "not applied" at once (the handlers decide from the fallback, and
//! the spending is charged by the key's next report) and one probe per interval reaches the
//! ledger, carrying whatever is pending, or an empty command when nothing is. Half-open,
//! every call goes again.
//!
//! The mailbox is unbounded (ractor); [`LeaseBroker`] counts queued messages and refuses
//! beyond [`BROKER_QUEUE_MAX`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::actors::lease_protocol::{LeaseAnswers, LeaseAsk};
use crate::core::circuit::{BreakerSettings, CallOutcome, CircuitBreaker, CircuitState, Permit};
use crate::core::lease::ReportAnswer;
use crate::core::ledger::{
    LEASE_REQUESTS_PER_COMMAND_MAX, NodeId, QuotaCommand, QuotaResponse, ReportOutcome,
};
use crate::ledger::RaftGroup;
use crate::ledger::WriteError;
use crate::ledger::quota::QuotaGroup;
use crate::metrics::Metrics;

/// Messages queued for the broker at most; beyond it asks are refused at once (the key
/// decides without the ledger and settles later).
pub const BROKER_QUEUE_MAX: usize = 65_536;
/// Ledger calls in flight at once; further batches wait for one to finish.
pub const CALLS_IN_FLIGHT_MAX: usize = 4;
/// Longest a ledger call runs before it is given up as of unknown outcome (the next report
/// of each key settles whatever it did).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// The circuit as the hot path reads it.
const CIRCUIT_CLOSED: u8 = 0;
const CIRCUIT_HALF_OPEN: u8 = 1;
const CIRCUIT_OPEN: u8 = 2;

/// How the broker runs.
#[derive(Debug, Clone, Copy)]
pub struct BrokerSettings {
    /// The node the leases are for.
    pub node_id: NodeId,
    /// Longest a batch waits for more asks.
    pub batch_window_ms: u64,
    /// The circuit breaker.
    pub breaker: BreakerSettings,
}

/// Messages to the broker.
pub enum BrokerMsg {
    /// A key's report.
    Ask(LeaseAsk),
    /// The batch window ended.
    Flush,
    /// While the circuit is open: send a probe if one is due.
    ProbeTick,
    /// A call's deadline passed before its answer.
    Overdue {
        /// The call's permit.
        permit: Permit,
        /// When the call started.
        started: Instant,
        /// Its asks, answered "not applied" now.
        asks: Vec<LeaseAsk>,
    },
    /// A ledger call finished.
    Done(CallDone),
}

/// A finished ledger call, back in the actor.
pub struct CallDone {
    permit: Permit,
    asks: Vec<LeaseAsk>,
    latency: Duration,
    /// True when the breaker already judged the call (its deadline passed first); its asks
    /// were answered then, and `asks` is empty.
    judged: bool,
    result: Result<QuotaResponse, WriteError>,
}

/// The handle handlers and shard actors hold.
#[derive(Clone)]
pub struct LeaseBroker {
    actor: ActorRef<BrokerMsg>,
    queued: Arc<AtomicUsize>,
    circuit: Arc<AtomicU8>,
}

/// The broker could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the lease broker: {0}")]
pub struct BrokerSpawnError(String);

impl LeaseBroker {
    /// Starts the broker over `ledger`; returns its handle and the task that ends with it.
    ///
    /// # Errors
    /// [`BrokerSpawnError`] when ractor cannot spawn the actor.
    pub async fn start(
        ledger: RaftGroup<QuotaGroup>,
        settings: BrokerSettings,
        metrics: Metrics,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), BrokerSpawnError> {
        let queued = Arc::new(AtomicUsize::new(0));
        let circuit = Arc::new(AtomicU8::new(CIRCUIT_CLOSED));
        let state = BrokerState {
            ledger,
            settings,
            metrics,
            breaker: CircuitBreaker::new(settings.breaker),
            last_failure: String::new(),
            queued: Arc::clone(&queued),
            circuit: Arc::clone(&circuit),
            asks: Vec::new(),
            flush_scheduled: false,
            probe_scheduled: false,
            calls_in_flight: 0,
            opened_at: None,
            overdue_calls: 0,
            stalled_since: None,
        };
        let (actor, join) = Actor::spawn(None, BrokerActor, state)
            .await
            .map_err(|error| BrokerSpawnError(error.to_string()))?;
        let join = tokio::spawn(async move {
            let _ = join.await;
        });
        Ok((Self { actor, queued, circuit }, join))
    }

    /// Queues a report; false when the broker is full or stopped (it was not sent, so the
    /// caller clears the key's report in flight).
    pub fn ask(&self, ask: LeaseAsk) -> bool {
        if self.queued.fetch_add(1, Ordering::Relaxed) >= BROKER_QUEUE_MAX {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        if self.actor.cast(BrokerMsg::Ask(ask)).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// True while the circuit is open: keys without tokens decide from the fallback.
    pub fn circuit_open(&self) -> bool {
        self.circuit.load(Ordering::Relaxed) == CIRCUIT_OPEN
    }

    /// True once the circuit has closed (not merely half-open): the fallback allowance no
    /// longer counts in the drift bound.
    pub fn circuit_closed(&self) -> bool {
        self.circuit.load(Ordering::Relaxed) == CIRCUIT_CLOSED
    }

    /// True when the queue is at its bound.
    pub fn saturated(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= BROKER_QUEUE_MAX
    }

    /// Stops the actor (pending asks are dropped; their keys settle when they next report).
    pub fn stop(&self) {
        self.actor.stop(None);
    }
}

struct BrokerActor;

struct BrokerState {
    ledger: RaftGroup<QuotaGroup>,
    settings: BrokerSettings,
    metrics: Metrics,
    breaker: CircuitBreaker,
    /// Why the last failed ledger call failed: the reason given when the circuit opens.
    last_failure: String,
    queued: Arc<AtomicUsize>,
    circuit: Arc<AtomicU8>,
    /// Asks waiting for the next call (bounded by the queue bound).
    asks: Vec<LeaseAsk>,
    flush_scheduled: bool,
    probe_scheduled: bool,
    calls_in_flight: usize,
    /// When the circuit last opened, while it is open.
    opened_at: Option<Instant>,
    /// Calls judged slow that have not ended yet.
    overdue_calls: usize,
    /// The start of the oldest of them, while there are any.
    stalled_since: Option<Instant>,
}

impl Actor for BrokerActor {
    type Msg = BrokerMsg;
    type State = BrokerState;
    type Arguments = BrokerState;

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        state: BrokerState,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: BrokerMsg,
        state: &mut BrokerState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            BrokerMsg::Ask(ask) => {
                state.queued.fetch_sub(1, Ordering::Relaxed);
                state.asks.push(ask);
                state.schedule_flush(&myself);
            }
            BrokerMsg::Flush => {
                state.flush_scheduled = false;
                state.flush(&myself, false);
            }
            BrokerMsg::ProbeTick => {
                state.probe_scheduled = false;
                if state.breaker.is_open() {
                    state.flush(&myself, true);
                    state.schedule_probe(&myself);
                }
            }
            BrokerMsg::Overdue { permit, started, asks } => {
                state.metrics.ledger_calls.with_label_values(&["slow"]).inc();
                state.overdue_calls += 1;
                state.stalled_since =
                    Some(state.stalled_since.map_or(started, |since| since.min(started)));
                state.last_failure = format!(
                    "no answer within the deadline of {} ms (4 x the ledger's p90 latency)",
                    state.breaker.deadline_ms()
                );
                state.breaker.record(crate::clock::now_ms(), permit, CallOutcome::Failed);
                state.publish_circuit(&myself);
                answer_all(asks, ReportAnswer::NotApplied);
                // Opened now: what waits for a call slot is refused rather than left waiting.
                state.flush(&myself, false);
            }
            BrokerMsg::Done(done) => state.finish(&myself, done),
        }
        Ok(())
    }
}

impl BrokerState {
    fn schedule_flush(&mut self, myself: &ActorRef<BrokerMsg>) {
        if self.asks.len() >= LEASE_REQUESTS_PER_COMMAND_MAX {
            self.flush(myself, false);
        } else if !self.flush_scheduled {
            self.flush_scheduled = true;
            myself.send_after(Duration::from_millis(self.settings.batch_window_ms), || {
                BrokerMsg::Flush
            });
        }
    }

    fn schedule_probe(&mut self, myself: &ActorRef<BrokerMsg>) {
        if !self.probe_scheduled {
            self.probe_scheduled = true;
            let interval = Duration::from_millis(self.settings.breaker.probe_interval_ms);
            myself.send_after(interval, || BrokerMsg::ProbeTick);
        }
    }

    /// Sends what is pending, as the breaker permits. `probe_tick`: an empty probe is worth
    /// sending (nothing else would tell when the ledger is back).
    fn flush(&mut self, myself: &ActorRef<BrokerMsg>, probe_tick: bool) {
        let now_ms = crate::clock::now_ms();
        if self.breaker.is_open() && self.calls_in_flight >= CALLS_IN_FLIGHT_MAX {
            // No slot for a probe either: nothing pending can go, so say so now rather than
            // let the handlers wait out their budget.
            self.refuse_pending();
            return;
        }
        while self.calls_in_flight < CALLS_IN_FLIGHT_MAX {
            let probe_due = probe_tick && self.breaker.is_open();
            if self.asks.is_empty() && !probe_due {
                return;
            }
            let permit = self.breaker.permit(now_ms);
            if permit == Permit::Refuse {
                self.refuse_pending();
                return;
            }
            let take = self.asks.len().min(LEASE_REQUESTS_PER_COMMAND_MAX);
            let asks: Vec<LeaseAsk> = self.asks.drain(..take).collect();
            self.send(myself, permit, asks, now_ms);
            if permit == Permit::Probe || self.asks.is_empty() {
                return;
            }
        }
    }

    fn refuse_pending(&mut self) {
        let refused = std::mem::take(&mut self.asks);
        self.metrics.lease_asks.with_label_values(&["refused"]).inc_by(refused.len() as u64);
        answer_all(refused, ReportAnswer::NotApplied);
    }

    fn send(
        &mut self,
        myself: &ActorRef<BrokerMsg>,
        permit: Permit,
        asks: Vec<LeaseAsk>,
        now_ms: u64,
    ) {
        let reports = asks.iter().map(LeaseAsk::report).collect();
        let command =
            QuotaCommand::SettleLeases { now_ms, node_id: self.settings.node_id, reports };
        self.calls_in_flight += 1;
        let ledger = self.ledger.clone();
        let deadline = Duration::from_millis(self.breaker.deadline_ms());
        let myself = myself.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let write = tokio::time::timeout(CALL_TIMEOUT, ledger.write(command, CALL_TIMEOUT));
            tokio::pin!(write);
            let (outcome, judged, asks) = tokio::select! {
                outcome = &mut write => (outcome, false, asks),
                () = tokio::time::sleep(deadline) => {
                    let _ = myself.cast(BrokerMsg::Overdue { permit, started, asks });
                    (write.await, true, Vec::new())
                }
            };
            let result = outcome.unwrap_or(Err(WriteError::Timeout));
            let done = CallDone { permit, asks, latency: started.elapsed(), judged, result };
            // A stopped broker drops the answers; the keys settle when they next report.
            let _ = myself.cast(BrokerMsg::Done(done));
        });
    }

    fn finish(&mut self, myself: &ActorRef<BrokerMsg>, done: CallDone) {
        self.calls_in_flight -= 1;
        let now_ms = crate::clock::now_ms();
        let latency_ms = u64::try_from(done.latency.as_millis()).unwrap_or(u64::MAX);
        self.metrics.ledger_call_duration.observe(done.latency.as_secs_f64());
        // The task casts `Overdue` before `Done`, so a judged call was counted overdue.
        if done.judged {
            self.overdue_calls -= 1;
            if self.overdue_calls == 0
                && let Some(since) = self.stalled_since.take()
            {
                self.metrics.ledger_stalled_seconds.inc_by(since.elapsed().as_secs_f64());
            }
        }
        // Only answers within the deadline they were judged by teach the breaker the
        // ledger's latency: an election's stalled calls must not raise the deadline for the
        // next outage (half-open, the deadline is the ceiling, so a ledger that became slow
        // for good is learnt there).
        if done.result.is_ok() && !done.judged {
            self.breaker.observe_latency(latency_ms);
        }
        // A slow call that answers after all: the ledger is back, so leasing need not wait
        // for the next probe.
        if done.result.is_ok() && done.judged {
            self.breaker.record_late_answer(latency_ms);
            self.publish_circuit(myself);
        }
        if !done.judged {
            let (label, outcome) = match &done.result {
                Ok(_) => ("ok", CallOutcome::Answered { latency_ms }),
                // No leader found within the deadline is a timeout too: nothing answered.
                Err(WriteError::Timeout | WriteError::NoLeader) => ("timeout", CallOutcome::Failed),
                Err(_) => ("error", CallOutcome::Failed),
            };
            if let Err(error) = &done.result {
                self.last_failure = error.to_string();
            }
            self.metrics.ledger_calls.with_label_values(&[label]).inc();
            self.breaker.record(now_ms, done.permit, outcome);
            self.publish_circuit(myself);
        }
        match done.result {
            // A judged call's asks were answered at its deadline.
            Ok(_) if done.judged => {}
            Ok(QuotaResponse::Settled(results)) if results.len() == done.asks.len() => {
                let mut by_shard: AnswersByShard = Vec::new();
                for (ask, result) in done.asks.into_iter().zip(results) {
                    let answer = match result {
                        Ok(ReportOutcome::Settled(settlement)) => {
                            let grant = settlement.grant;
                            if grant.granted_tokens > 0 {
                                self.metrics.lease_size.observe(grant.granted_tokens as f64);
                            }
                            self.metrics.lease_charged_tokens.inc_by(settlement.charged_tokens);
                            self.metrics.lease_credited_tokens.inc_by(settlement.credited_tokens);
                            ReportAnswer::Settled {
                                granted_tokens: grant.granted_tokens,
                                retry_after_ms: grant.retry_after_ms,
                                remaining_tokens: grant.remaining_tokens,
                            }
                        }
                        Ok(ReportOutcome::Stale) => ReportAnswer::NotApplied,
                        Ok(ReportOutcome::Superseded) => ReportAnswer::Superseded,
                        Err(refused) => {
                            tracing::warn!(%refused, "the ledger refused a lease report");
                            ReportAnswer::NotApplied
                        }
                    };
                    push_answer(&mut by_shard, ask, answer);
                }
                send_answers(by_shard);
            }
            Ok(other) => {
                tracing::warn!(?other, "unexpected answer to SettleLeases");
                answer_all(done.asks, ReportAnswer::NotApplied);
            }
            Err(error) => {
                tracing::debug!(%error, "ledger call failed");
                answer_all(done.asks, ReportAnswer::NotApplied);
            }
        }
        // Batches that waited for a free call slot go now.
        if !self.asks.is_empty() {
            self.flush(myself, false);
        }
    }

    fn publish_circuit(&mut self, myself: &ActorRef<BrokerMsg>) {
        let state = self.breaker.state();
        let value = match state {
            CircuitState::Closed { .. } => CIRCUIT_CLOSED,
            CircuitState::HalfOpen { .. } => CIRCUIT_HALF_OPEN,
            CircuitState::Open { .. } => CIRCUIT_OPEN,
        };
        let before = self.circuit.swap(value, Ordering::Relaxed);
        self.metrics.ledger_circuit_state.set(i64::from(value));
        if before != value {
            if value == CIRCUIT_OPEN {
                self.metrics.ledger_circuit_opened.inc();
                self.opened_at = Some(Instant::now());
            } else if let Some(opened_at) = self.opened_at.take() {
                self.metrics.ledger_circuit_open_seconds.inc_by(opened_at.elapsed().as_secs_f64());
            }
            let p90_ms = self.breaker.latency_p90_ms();
            match state {
                CircuitState::Open { next_probe_ms } => tracing::warn!(
                    reason = %self.last_failure,
                    ledger_p90_ms = ?p90_ms,
                    deadline_ms = self.breaker.deadline_ms(),
                    next_probe_at = %crate::core::rfc3339::format_epoch_ms(next_probe_ms),
                    "ledger circuit open: lease calls failed or were slow; fail-open rules \
                     admit from the fallback (charged later), fail-closed rules deny. Check \
                     the quota group's leader and disks (quotamesh cluster status)"
                ),
                _ => {
                    tracing::info!(state = ?state, ledger_p90_ms = ?p90_ms, "ledger circuit changed")
                }
            }
        }
        if value == CIRCUIT_OPEN {
            self.schedule_probe(myself);
        }
    }
}

/// Answers grouped by the shard actor they go back to.
type AnswersByShard = Vec<(ractor::ActorId, Vec<(LeaseAsk, ReportAnswer)>)>;

fn push_answer(by_shard: &mut AnswersByShard, ask: LeaseAsk, answer: ReportAnswer) {
    let id = ask.reply_to.get_id();
    match by_shard.iter_mut().find(|(shard, _)| *shard == id) {
        Some((_, answers)) => answers.push((ask, answer)),
        None => by_shard.push((id, vec![(ask, answer)])),
    }
}

fn send_answers(by_shard: AnswersByShard) {
    for (_, answers) in by_shard {
        let Some(reply_to) = answers.first().map(|(ask, _)| ask.reply_to.clone()) else {
            continue;
        };
        // A stopped shard has no keys to apply them to.
        let _ = reply_to.send_message(LeaseAnswers(answers));
    }
}

fn answer_all(asks: Vec<LeaseAsk>, answer: ReportAnswer) {
    let mut by_shard = Vec::new();
    for ask in asks {
        push_answer(&mut by_shard, ask, answer);
    }
    send_answers(by_shard);
}

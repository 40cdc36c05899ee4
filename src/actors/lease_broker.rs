//! The lease-broker actor: the one place a node talks to the quota ledger for leases.
//!
//! ```text
//!  RLS handlers ──ask (bounded)──▶ ┌──────────────┐   one AcquireLeases per batch
//!  shard actors ─return──────────▶ │ LeaseBroker  │ ──(5 ms timeout)──▶ quota group leader
//!                                  │  breaker     │ ◀────────────────── grants
//!  shard actors ◀──cast answers─── └──────────────┘
//! ```
//!
//! Asks and returns from every shard are gathered for up to `batch_window_ms` (or until a
//! command is full) and sent as ONE command each; the group forwards it to the leader
//! (`crate::ledger::RaftGroup::write`). Every call is bounded by `ledger_timeout_ms` and
//! reported to the circuit breaker (`crate::core::circuit`): while the circuit is not
//! closed, asks are answered "failed" at once (the handlers then decide from the fallback
//! bucket) and only one probe per interval reaches the ledger, carrying whatever asks are
//! pending, or an empty command when none are.
//!
//! A call that timed out may still commit: the tokens it granted stay outstanding in the
//! ledger until their TTL and are never spent, so a lost answer under-admits, never over.
//!
//! The mailbox is unbounded (ractor); [`LeaseBroker`] counts queued messages and refuses
//! beyond [`BROKER_QUEUE_MAX`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::actors::shard::{CounterKey, ShardMsg};
use crate::core::circuit::{BreakerSettings, CallOutcome, CircuitBreaker, CircuitState, Permit};
use crate::core::lease::{LeaseTuning, LeaseWant};
use crate::core::lease_key::LeaseKey;
use crate::core::ledger::{
    LEASE_REQUESTS_PER_COMMAND_MAX, LeaseRequest, NodeId, QuotaCommand, QuotaResponse,
};
use crate::core::rate::LimitSpec;
use crate::ledger::quota::QuotaGroup;
use crate::ledger::{RaftGroup, WriteError};
use crate::metrics::Metrics;

/// Messages queued for the broker at most; beyond it asks fail at once (the handler falls
/// back) and returns are dropped (their tokens expire in the ledger).
pub const BROKER_QUEUE_MAX: usize = 65_536;
/// Ledger calls in flight at once; further batches wait for one to finish.
pub const CALLS_IN_FLIGHT_MAX: usize = 4;

/// The circuit as the hot path reads it.
const CIRCUIT_CLOSED: u8 = 0;
const CIRCUIT_RECOVERING: u8 = 1;
const CIRCUIT_OPEN: u8 = 2;

/// How the broker runs.
#[derive(Debug, Clone, Copy)]
pub struct BrokerSettings {
    /// The node the leases are for.
    pub node_id: NodeId,
    /// Longest a batch waits for more asks.
    pub batch_window_ms: u64,
    /// The circuit breaker; its `call_timeout_ms` bounds every ledger call.
    pub breaker: BreakerSettings,
}

/// One key's request for a lease, and where its answer goes.
#[derive(Debug)]
pub struct LeaseAsk {
    /// The shard actor that owns the key.
    pub reply_to: ActorRef<ShardMsg>,
    /// The key's stripe in that shard.
    pub stripe: u32,
    /// The key in the shard.
    pub counter: CounterKey,
    /// The key in the ledger.
    pub lease_key: LeaseKey,
    /// The limit the ledger's bucket follows.
    pub spec: LimitSpec,
    /// The rule's lease settings (TTL, expiry margin).
    pub tuning: LeaseTuning,
    /// What was asked, and when.
    pub want: LeaseWant,
}

/// What the ledger said to one ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAnswer {
    /// Granted `granted_tokens` (0: none until `retry_after_ms`); `remaining_tokens` were left
    /// in the ledger's bucket.
    Granted {
        /// Tokens leased to this node.
        granted_tokens: u64,
        /// When nothing was granted: ms until a token is available.
        retry_after_ms: u64,
        /// Whole tokens left in the ledger's bucket after the grant.
        remaining_tokens: u64,
    },
    /// No answer (timeout, error, open circuit, refused request): nothing known granted.
    Failed,
}

/// Messages to the broker.
pub enum BrokerMsg {
    /// A key needs a lease.
    Ask(LeaseAsk),
    /// Unspent tokens to give back.
    Return {
        /// The key in the ledger.
        lease_key: LeaseKey,
        /// Tokens given back.
        tokens: u64,
    },
    /// The batch window ended.
    Flush,
    /// While the circuit is not closed: send a probe if one is due.
    ProbeTick,
    /// A ledger call finished.
    Done(CallDone),
}

/// A finished ledger call, back in the actor.
pub struct CallDone {
    permit: Permit,
    asks: Vec<LeaseAsk>,
    latency: Duration,
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
            queued: Arc::clone(&queued),
            circuit: Arc::clone(&circuit),
            asks: Vec::new(),
            returns: HashMap::new(),
            flush_scheduled: false,
            probe_scheduled: false,
            calls_in_flight: 0,
        };
        let (actor, join) = Actor::spawn(None, BrokerActor, state)
            .await
            .map_err(|error| BrokerSpawnError(error.to_string()))?;
        let join = tokio::spawn(async move {
            let _ = join.await;
        });
        Ok((Self { actor, queued, circuit }, join))
    }

    /// Queues an ask; false when the broker is full or stopped (the ask was not sent, so
    /// the caller clears the key's request in flight).
    pub fn ask(&self, ask: LeaseAsk) -> bool {
        if !self.reserve() {
            return false;
        }
        if self.actor.cast(BrokerMsg::Ask(ask)).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Queues unspent tokens for return; false when they were dropped (broker full or
    /// stopped: the ledger expires them at their TTL instead).
    pub fn give_back(&self, lease_key: LeaseKey, tokens: u64) -> bool {
        if tokens == 0 || !self.reserve() {
            return false;
        }
        if self.actor.cast(BrokerMsg::Return { lease_key, tokens }).is_err() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// True while the circuit is closed: short keys may wait for a lease.
    pub fn circuit_closed(&self) -> bool {
        self.circuit.load(Ordering::Relaxed) == CIRCUIT_CLOSED
    }

    /// True when the queue is at its bound.
    pub fn saturated(&self) -> bool {
        self.queued.load(Ordering::Relaxed) >= BROKER_QUEUE_MAX
    }

    /// Stops the actor (pending asks are dropped; their keys time out to the fallback).
    pub fn stop(&self) {
        self.actor.stop(None);
    }

    fn reserve(&self) -> bool {
        if self.queued.fetch_add(1, Ordering::Relaxed) >= BROKER_QUEUE_MAX {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }
}

struct BrokerActor;

struct BrokerState {
    ledger: RaftGroup<QuotaGroup>,
    settings: BrokerSettings,
    metrics: Metrics,
    breaker: CircuitBreaker,
    queued: Arc<AtomicUsize>,
    circuit: Arc<AtomicU8>,
    /// Asks waiting for the next call (bounded by the queue bound).
    asks: Vec<LeaseAsk>,
    /// Tokens to give back, summed per key.
    returns: HashMap<LeaseKey, u64>,
    flush_scheduled: bool,
    probe_scheduled: bool,
    calls_in_flight: usize,
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
            BrokerMsg::Return { lease_key, tokens } => {
                state.queued.fetch_sub(1, Ordering::Relaxed);
                let pending = state.returns.entry(lease_key).or_insert(0);
                *pending = pending.saturating_add(tokens);
                state.schedule_flush(&myself);
            }
            BrokerMsg::Flush => {
                state.flush_scheduled = false;
                state.flush(&myself, false);
            }
            BrokerMsg::ProbeTick => {
                state.probe_scheduled = false;
                if !state.breaker.is_closed() {
                    state.flush(&myself, true);
                    state.schedule_probe(&myself);
                }
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
        self.flush_returns(now_ms);
        if !self.returns.is_empty() && !self.flush_scheduled {
            self.flush_scheduled = true;
            myself.send_after(Duration::from_millis(self.settings.batch_window_ms), || {
                BrokerMsg::Flush
            });
        }
        while self.calls_in_flight < CALLS_IN_FLIGHT_MAX {
            let probe_due = probe_tick && !self.breaker.is_closed();
            if self.asks.is_empty() && !probe_due {
                return;
            }
            let permit = self.breaker.permit(now_ms);
            if permit == Permit::Refuse {
                let refused = std::mem::take(&mut self.asks);
                self.metrics
                    .lease_asks
                    .with_label_values(&["refused"])
                    .inc_by(refused.len() as u64);
                answer_all(refused, LeaseAnswer::Failed);
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

    fn send(
        &mut self,
        myself: &ActorRef<BrokerMsg>,
        permit: Permit,
        asks: Vec<LeaseAsk>,
        now_ms: u64,
    ) {
        let requests = asks
            .iter()
            .map(|ask| LeaseRequest {
                key: ask.lease_key.ledger_key(),
                limit: ask.spec,
                tokens_wanted: ask.want.tokens,
                lease_ttl_ms: ask.tuning.lease_ttl_ms,
            })
            .collect();
        let command =
            QuotaCommand::AcquireLeases { now_ms, node_id: self.settings.node_id, requests };
        self.calls_in_flight += 1;
        let ledger = self.ledger.clone();
        let timeout = Duration::from_millis(self.settings.breaker.call_timeout_ms);
        let myself = myself.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = match tokio::time::timeout(timeout, ledger.write(command, timeout)).await {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(error)) => Err(error),
                Err(_) => Err(WriteError::Timeout),
            };
            let done = CallDone { permit, asks, latency: started.elapsed(), result };
            // A stopped broker drops the answers; the handlers fall back at their deadline.
            let _ = myself.cast(BrokerMsg::Done(done));
        });
    }

    /// Sends the pending returns as one command, outside the breaker's accounting: a
    /// return is not worth waiting for, and while the circuit is open they are dropped (the
    /// ledger expires the tokens at their TTL).
    fn flush_returns(&mut self, now_ms: u64) {
        if self.returns.is_empty() {
            return;
        }
        // One command's worth; the rest stays for the next flush (a draining iterator cut
        // short would drop it).
        let keys: Vec<LeaseKey> =
            self.returns.keys().take(LEASE_REQUESTS_PER_COMMAND_MAX).copied().collect();
        let returns: Vec<(String, u64)> = keys
            .into_iter()
            .filter_map(|key| self.returns.remove(&key).map(|tokens| (key.ledger_key(), tokens)))
            .collect();
        let tokens: u64 = returns.iter().map(|(_, tokens)| tokens).sum();
        if !self.breaker.is_closed() {
            self.metrics.lease_returned_tokens.with_label_values(&["dropped"]).inc_by(tokens);
            return;
        }
        let command =
            QuotaCommand::ReturnLeases { now_ms, node_id: self.settings.node_id, returns };
        let ledger = self.ledger.clone();
        let timeout = Duration::from_millis(self.settings.breaker.call_timeout_ms);
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let outcome = match tokio::time::timeout(timeout, ledger.write(command, timeout)).await
            {
                Ok(Ok(QuotaResponse::ReturnedMany(_))) => "returned",
                _ => "failed",
            };
            metrics.lease_returned_tokens.with_label_values(&[outcome]).inc_by(tokens);
        });
    }

    fn finish(&mut self, myself: &ActorRef<BrokerMsg>, done: CallDone) {
        self.calls_in_flight -= 1;
        let now_ms = crate::clock::now_ms();
        let latency_ms = u64::try_from(done.latency.as_millis()).unwrap_or(u64::MAX);
        self.metrics.ledger_call_duration.observe(done.latency.as_secs_f64());
        let outcome = match &done.result {
            Ok(_) => CallOutcome::Answered { latency_ms },
            Err(_) => CallOutcome::Failed,
        };
        let label = match &done.result {
            Ok(_) if latency_ms < self.settings.breaker.call_timeout_ms => "ok",
            Ok(_) => "slow",
            Err(_) => "error",
        };
        self.metrics.ledger_calls.with_label_values(&[label]).inc();
        self.breaker.record(now_ms, done.permit, outcome);
        self.publish_circuit(myself);
        match done.result {
            Ok(QuotaResponse::Leases(results)) if results.len() == done.asks.len() => {
                let mut by_shard: AnswersByShard = Vec::new();
                for (ask, result) in done.asks.into_iter().zip(results) {
                    let answer = match result {
                        Ok(grant) => {
                            self.metrics.lease_size.observe(grant.granted_tokens as f64);
                            LeaseAnswer::Granted {
                                granted_tokens: grant.granted_tokens,
                                retry_after_ms: grant.retry_after_ms,
                                remaining_tokens: grant.remaining_tokens,
                            }
                        }
                        Err(refused) => {
                            tracing::warn!(%refused, "the ledger refused a lease request");
                            LeaseAnswer::Failed
                        }
                    };
                    push_answer(&mut by_shard, ask, answer);
                }
                for (shard, answers) in by_shard {
                    let _ = shard.cast(ShardMsg::Answers(answers));
                }
            }
            Ok(other) => {
                tracing::warn!(?other, "unexpected answer to AcquireLeases");
                answer_all(done.asks, LeaseAnswer::Failed);
            }
            Err(error) => {
                tracing::debug!(%error, "ledger call failed");
                answer_all(done.asks, LeaseAnswer::Failed);
            }
        }
        // Batches that waited for a free call slot go now.
        if !self.asks.is_empty() {
            self.flush(myself, false);
        }
    }

    fn publish_circuit(&mut self, myself: &ActorRef<BrokerMsg>) {
        let (value, gauge) = match self.breaker.state() {
            CircuitState::Closed { .. } => (CIRCUIT_CLOSED, 0),
            CircuitState::Recovering { .. } => (CIRCUIT_RECOVERING, 1),
            CircuitState::Open { .. } => (CIRCUIT_OPEN, 2),
        };
        let before = self.circuit.swap(value, Ordering::Relaxed);
        self.metrics.ledger_circuit_state.set(gauge);
        if before != value {
            tracing::warn!(state = ?self.breaker.state(), "ledger circuit changed");
        }
        if value != CIRCUIT_CLOSED {
            self.schedule_probe(myself);
        }
    }
}

/// Answers grouped by the shard actor they go back to.
type AnswersByShard = Vec<(ActorRef<ShardMsg>, Vec<(LeaseAsk, LeaseAnswer)>)>;

fn push_answer(by_shard: &mut AnswersByShard, ask: LeaseAsk, answer: LeaseAnswer) {
    let id = ask.reply_to.get_id();
    match by_shard.iter_mut().find(|(shard, _)| shard.get_id() == id) {
        Some((_, answers)) => answers.push((ask, answer)),
        None => by_shard.push((ask.reply_to.clone(), vec![(ask, answer)])),
    }
}

fn answer_all(asks: Vec<LeaseAsk>, answer: LeaseAnswer) {
    let mut by_shard = Vec::new();
    for ask in asks {
        push_answer(&mut by_shard, ask, answer);
    }
    for (shard, answers) in by_shard {
        let _ = shard.cast(ShardMsg::Answers(answers));
    }
}

//! The rebalancer: moves tokens of global limits between regions (DESIGN section 5). It
//! owns the region's QUIC endpoint (`crate::region`) and a ractor actor that, while this node
//! leads its region's quota group, looks at every sliced limit on a timer; the rules of
//! planning and of transfers are the core's (`crate::core::region`), this file only measures,
//! calls and proposes.
//!
//! ```text
//!  every interval_ms, on the quota group's leader (the others only follow the ledger):
//!   1 adopt:   a limit with `regions` and no slice in the ledger ── Adopt{policy slice} ──▶ ledger
//!   2 measure: hits offered in the region (the ledger's count of every node's reports,
//!              `crate::slice_follow`) ──▶ DemandWindow ──▶ demand
//!   3 settle:  each transfer debited and unsettled ── Credit{id} (Cancel{id} after
//!              transfer_timeout_ms) ──QUIC──▶ recipient ── Receive{id} ──▶ its ledger
//!              ◀── Credited | Cancelled ── Settle{serial, outcome} ──▶ ledger
//!   4 views:   each peer ── Views{after} ──QUIC──▶ its slices (fresh) and demand (last tick)
//!   5 give:    a peer the planner finds hot (or below its share while this region is above
//!              its own) ── Debit{next serial} ──▶ ledger, then Credit{id} as in 3
//!  on every voter, each interval: 2 (so any voter answers a peer's views), and the
//!  ledger's slices ──▶ PolicyStore::follow_slices (what RLS enforces) and the region gauges
//! ```
//!
//! A donor gives: a hot region does not send an ask, it shows its demand in the views its
//! peers read, and each peer computes with the planner what it gives (`PlanSettings::asks`
//! from the hot region's side, so donors split an ask alike). A transfer is debited in the
//! donor's ledger before any credit is sent, retried with the same id on every tick until
//! the recipient answers, and cancelled after its timeout; the tokens return only when the
//! recipient answered `Cancelled`, so no crash, partition or duplicate creates a token.
//!
//! Demand is region-wide: every node, voters and gateways, reports its offered hits to the
//! ledger (`crate::core::region::demand`), so a leader behind one balancer of several nodes
//! measures all of them; every voter measures alike from its replica, so a new leader has
//! the window measured already. Every call is
//! bounded: ledger writes by [`LEDGER_WRITE_TIMEOUT`], QUIC calls by the transport's
//! timeouts, a tick by [`TRANSFERS_PER_TICK_MAX`] new transfers and the core's bound on
//! transfers in flight; the actor schedules its next tick only when one is done, so its
//! mailbox holds at most one tick.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::config::RebalanceConfig;
use crate::core::ledger::{QuotaCommand, QuotaResponse};
use crate::core::policy::PolicySet;
use crate::core::region::demand::DemandWindow;
use crate::core::region::plan::{PlanSettings, RegionView};
use crate::core::region::transfer::{
    Received, RegionCommand, RegionCommandError, RegionResponse, SLICED_RULES_MAX, Slice, SliceKey,
    TransferId, TransferRequest,
};
use crate::ledger::{QuotaGroup, RaftGroup};
use crate::metrics::Metrics;
use crate::policy_store::PolicyStore;
use crate::region::RegionPeer;
use crate::region::transport::{EndpointError, Handler, LinkTraffic, RegionEndpoint};
use crate::region::wire::{RegionReply, RegionRequest, RuleView, VIEWS_PER_MESSAGE_MAX};

/// Longest one ledger write of the rebalancer (or of a peer's request) may take; under the
/// transport's call timeout, so a peer hears a refusal rather than a silence.
pub const LEDGER_WRITE_TIMEOUT: Duration = Duration::from_secs(3);
/// Most new transfers one tick debits.
pub const TRANSFERS_PER_TICK_MAX: usize = 16;
/// Most slices one tick adopts from the policy.
pub const ADOPTS_PER_TICK_MAX: usize = 64;
/// Most pages of views read from one peer in a tick: every sliced limit.
const VIEW_PAGES_MAX: usize = SLICED_RULES_MAX / VIEWS_PER_MESSAGE_MAX + 1;

const _: () =
    assert!(LEDGER_WRITE_TIMEOUT.as_millis() < crate::region::transport::CALL_TIMEOUT.as_millis());

/// The rebalancer could not start.
#[derive(Debug, thiserror::Error)]
pub enum RebalancerError {
    /// The QUIC endpoint could not be set up.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// ractor could not spawn the actor.
    #[error("cannot start the rebalancer: {0}")]
    Spawn(String),
}

/// What the rebalancer works with.
pub struct RebalancerParts {
    /// This node's region.
    pub region: String,
    /// The other regions.
    pub peers: Vec<RegionPeer>,
    /// The QUIC address to bind.
    pub quic_addr: std::net::SocketAddr,
    /// The node's cluster credentials.
    pub credentials: Arc<crate::tls::credentials::Credentials>,
    /// The region's quota group.
    pub group: RaftGroup<QuotaGroup>,
    /// The node's policy: the global limits, and what RLS enforces.
    pub policy: Arc<PolicyStore>,
    /// The node's metrics.
    pub metrics: Metrics,
    /// `[rebalance]`.
    pub settings: RebalanceConfig,
    /// Where it shows what it measured and read (the admin API reads it too).
    pub board: Arc<RegionBoard>,
}

/// What one sliced limit measured on the last tick: what peers read in this region's views.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Measured {
    /// This region's slice by the policy's shares.
    pub policy_tokens: u64,
    /// This region's demand over the observation window, tokens per window of the limit.
    pub demand_tokens: u64,
}

/// What the rebalancer last measured (on every voter) and read off its peers (while it
/// leads; empty otherwise): what peers and the admin API (`quotamesh cluster regions`) are
/// shown. Bounded by the sliced limits ([`SLICED_RULES_MAX`]) and the configured peers.
#[derive(Debug, Default)]
pub struct RegionBoard {
    measured: parking_lot::Mutex<BTreeMap<SliceKey, Measured>>,
    peers: parking_lot::Mutex<BTreeMap<String, BTreeMap<SliceKey, RegionView>>>,
}

impl RegionBoard {
    /// This region's measure of `key`, if it was measured on the last tick.
    #[must_use]
    pub fn measured(&self, key: &SliceKey) -> Option<Measured> {
        self.measured.lock().get(key).copied()
    }

    /// The slices of `key` the peers reported on the last tick, by region.
    #[must_use]
    pub fn peer_slices(&self, key: &SliceKey) -> BTreeMap<String, u64> {
        self.peers
            .lock()
            .iter()
            .filter_map(|(peer, views)| Some((peer.clone(), views.get(key)?.slice_tokens)))
            .collect()
    }
}

/// What the actor and the QUIC handler share.
struct Shared {
    region: String,
    group: RaftGroup<QuotaGroup>,
    metrics: Metrics,
    /// Measured on the last tick, and peers read while leading (bounded by the sliced
    /// limits, [`SLICED_RULES_MAX`]).
    board: Arc<RegionBoard>,
    /// The node's policy: which limits are sliced now.
    policy: Arc<PolicyStore>,
    /// The limits whose gauges this node exported last (at most [`SLICED_RULES_MAX`]): a
    /// limit gone from the policy has its gauges deleted, not left at their last value.
    exported: parking_lot::Mutex<BTreeSet<SliceKey>>,
}

/// The keys of every sliced limit of `policy`.
fn sliced_keys(policy: &PolicySet) -> BTreeSet<SliceKey> {
    policy
        .rules()
        .filter(|rule| rule.regions.is_some())
        .flat_map(|rule| {
            (0..rule.limits.len()).map(|index| SliceKey::of(&rule.domain, &rule.path, index))
        })
        .take(SLICED_RULES_MAX)
        .collect()
}

impl Shared {
    /// This region's view of `key`: its slice from the ledger as applied here now, the rest
    /// as measured.
    fn view(&self, key: &SliceKey, slice: Slice) -> RegionView {
        let measured = self.board.measured(key).unwrap_or_default();
        RegionView {
            global_tokens: slice.global_tokens,
            slice_tokens: slice.tokens,
            policy_tokens: measured.policy_tokens,
            demand_tokens: measured.demand_tokens,
        }
    }

    /// A page of views after `after`.
    fn views_after(&self, after: Option<&SliceKey>) -> RegionReply {
        let slices: Vec<(SliceKey, Slice)> = self.group.read(|ledger| {
            ledger
                .regions()
                .slices()
                .filter(|(key, _)| after.is_none_or(|after| *key > after))
                .take(VIEWS_PER_MESSAGE_MAX + 1)
                .map(|(key, slice)| (key.clone(), *slice))
                .collect()
        });
        let more = slices.len() > VIEWS_PER_MESSAGE_MAX;
        let views = slices
            .into_iter()
            .take(VIEWS_PER_MESSAGE_MAX)
            .map(|(key, slice)| RuleView { view: self.view(&key, slice), key })
            .collect();
        RegionReply::Views { views, more }
    }

    /// Commits a peer's credit or cancellation in this region's ledger.
    async fn receive(&self, request: TransferRequest) -> RegionReply {
        let command = RegionCommand::Receive(request);
        match self.propose(command).await {
            Ok(RegionResponse::Received(outcome)) => RegionReply::Received(outcome),
            Ok(RegionResponse::AlreadySettled) => RegionReply::AlreadySettled,
            Ok(RegionResponse::Refused(error)) => {
                // Busy frees up as the donor settles; a slice not adopted yet will be; a
                // changed limit is taken by both regions in time.
                let retry = matches!(
                    error,
                    RegionCommandError::Busy
                        | RegionCommandError::UnknownSlice(_)
                        | RegionCommandError::LimitChanged { .. }
                );
                RegionReply::refused(error.to_string(), retry)
            }
            Ok(other) => RegionReply::refused(format!("unexpected answer {other:?}"), false),
            Err(reason) => RegionReply::refused(reason, true),
        }
    }

    /// Commits a region command through the quota group.
    async fn propose(&self, command: RegionCommand) -> Result<RegionResponse, String> {
        let command = QuotaCommand::Region { now_ms: crate::clock::now_ms(), command };
        match self.group.write(command, LEDGER_WRITE_TIMEOUT).await {
            Ok(QuotaResponse::Region(response)) => {
                // At once, not on the next tick: the gauges are how operators (and tests)
                // check that slices plus tokens in flight add up.
                self.export();
                Ok(response)
            }
            Ok(other) => Err(format!("the ledger answered {other:?} to a region command")),
            Err(error) => Err(error.to_string()),
        }
    }
}

impl Shared {
    /// Exports this region's slices and tokens in flight as applied here, for the limits
    /// the policy slices, and deletes the gauges of limits it no longer slices; returns the
    /// slices, by key.
    fn export(&self) -> BTreeMap<SliceKey, u64> {
        let sliced = sliced_keys(&self.policy.global());
        let (slices, in_flight) = self.group.read(|ledger| {
            let slices: BTreeMap<SliceKey, u64> = ledger
                .regions()
                .slices()
                .filter(|(key, _)| sliced.contains(*key))
                .map(|(key, slice)| (key.clone(), slice.tokens))
                .collect();
            let mut in_flight: BTreeMap<SliceKey, u64> = BTreeMap::new();
            for (_, transfer) in ledger.regions().outgoing() {
                let tokens = in_flight.entry(transfer.key.clone()).or_default();
                *tokens = tokens.saturating_add(transfer.tokens);
            }
            (slices, in_flight)
        });
        let region = self.region.as_str();
        for (key, tokens) in &slices {
            let rule = key.0.as_str();
            self.metrics.region_slice_tokens.with_label_values(&[region, rule]).set(gauge(*tokens));
            let flying = in_flight.get(key).copied().unwrap_or(0);
            self.metrics.region_in_flight_tokens.with_label_values(&[rule]).set(gauge(flying));
        }
        let mut exported = self.exported.lock();
        for gone in exported.iter().filter(|key| !slices.contains_key(*key)) {
            let rule = gone.0.as_str();
            // An error only says the gauge was never set.
            let _ = self.metrics.region_slice_tokens.remove_label_values(&[region, rule]);
            let _ = self.metrics.region_in_flight_tokens.remove_label_values(&[rule]);
            let _ = self.metrics.region_demand_tokens.remove_label_values(&[rule]);
        }
        *exported = slices.keys().cloned().collect();
        slices
    }
}

/// A token count as a gauge value.
fn gauge(tokens: u64) -> i64 {
    i64::try_from(tokens).unwrap_or(i64::MAX)
}

/// A running rebalancer: its endpoint, the server of its peers' calls, and its actor.
pub struct Rebalancer {
    endpoint: Arc<RegionEndpoint>,
    server: tokio::task::JoinHandle<()>,
    actor: ActorRef<Tick>,
    join: tokio::task::JoinHandle<()>,
}

impl Rebalancer {
    /// Binds the QUIC endpoint, serves the peers' calls, and starts the actor.
    ///
    /// # Errors
    /// [`RebalancerError`]; nothing is left running.
    pub async fn start(parts: RebalancerParts) -> Result<Self, RebalancerError> {
        let endpoint = Arc::new(RegionEndpoint::bind(
            parts.quic_addr,
            &parts.credentials,
            &parts.region,
            &parts.peers,
        )?);
        let shared = Arc::new(Shared {
            region: parts.region.clone(),
            group: parts.group.clone(),
            metrics: parts.metrics.clone(),
            board: parts.board,
            policy: Arc::clone(&parts.policy),
            exported: parking_lot::Mutex::new(BTreeSet::new()),
        });
        let state = State {
            shared: Arc::clone(&shared),
            endpoint: Arc::clone(&endpoint),
            peers: parts.peers.iter().map(|peer| peer.name.clone()).collect(),
            policy: parts.policy,
            metrics: parts.metrics,
            plan: parts.settings.plan(),
            interval: Duration::from_millis(parts.settings.interval_ms),
            transfer_timeout_ms: parts.settings.transfer_timeout_ms,
            windows: BTreeMap::new(),
            peer_views: BTreeMap::new(),
            peer_gauges: BTreeSet::new(),
            exported_traffic: BTreeMap::new(),
            exported_refused: 0,
        };
        let (actor, join) = match Actor::spawn(None, RebalancerActor, state).await {
            Ok(spawned) => spawned,
            Err(error) => {
                endpoint.close();
                return Err(RebalancerError::Spawn(error.to_string()));
            }
        };
        let server = endpoint.serve(handler(shared));
        let join = tokio::spawn(async move {
            let _ = join.await;
        });
        Ok(Self { endpoint, server, actor, join })
    }

    /// The bound QUIC address.
    ///
    /// # Errors
    /// The socket's error.
    pub fn local_addr(&self) -> std::io::Result<std::net::SocketAddr> {
        self.endpoint.local_addr()
    }

    /// Stops the actor, closes the endpoint (calls in progress fail at once, and a transfer
    /// they were about is retried by the next leader with the same id), and waits for both.
    pub async fn shutdown(self) {
        self.actor.stop(None);
        self.endpoint.close();
        if tokio::time::timeout(crate::node::SHUTDOWN_DRAIN_TIMEOUT, self.join).await.is_err() {
            tracing::warn!("the rebalancer did not stop in time");
        }
        self.server.abort();
        let _ = self.server.await;
    }
}

/// The endpoint's handler: views from this node's state, transfers through the ledger.
fn handler(shared: Arc<Shared>) -> Handler {
    Arc::new(move |_region, request| {
        let shared = Arc::clone(&shared);
        Box::pin(async move {
            match request {
                RegionRequest::Views { after } => shared.views_after(after.as_ref()),
                RegionRequest::Transfer(transfer) => shared.receive(transfer).await,
            }
        })
    })
}

/// The actor's one message: look again.
pub struct Tick;

struct RebalancerActor;

struct State {
    shared: Arc<Shared>,
    endpoint: Arc<RegionEndpoint>,
    peers: Vec<String>,
    policy: Arc<PolicyStore>,
    metrics: Metrics,
    plan: PlanSettings,
    interval: Duration,
    transfer_timeout_ms: u64,
    /// Demand samples per sliced limit (only those the ledger and the policy both know).
    windows: BTreeMap<SliceKey, DemandWindow>,
    /// Each peer's views read this tick; a peer that did not answer has none.
    peer_views: BTreeMap<String, BTreeMap<SliceKey, RegionView>>,
    /// The `(peer, limit)` slice gauges exported on the last tick, deleted once no view
    /// shows them (bounded by the peers times [`SLICED_RULES_MAX`]).
    peer_gauges: BTreeSet<(String, SliceKey)>,
    /// Each link's traffic as last exported to the counters (one entry per peer).
    exported_traffic: BTreeMap<String, LinkTraffic>,
    /// The endpoint's refused connections as last exported.
    exported_refused: u64,
}

impl Actor for RebalancerActor {
    type Msg = Tick;
    type State = State;
    type Arguments = State;

    async fn pre_start(
        &self,
        myself: ActorRef<Tick>,
        state: State,
    ) -> Result<State, ActorProcessingErr> {
        myself.send_after(state.interval, || Tick);
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<Tick>,
        _tick: Tick,
        state: &mut State,
    ) -> Result<(), ActorProcessingErr> {
        state.tick().await;
        myself.send_after(state.interval, || Tick);
        Ok(())
    }
}

impl State {
    async fn tick(&mut self) {
        let group = &self.shared.group;
        let leading = group.leader() == Some(group.node_id());
        self.metrics.region_leading.set(i64::from(leading));
        let global = self.policy.global();
        // Every voter measures, from its replica of the region's count: a peer region may
        // read this region's views from any voter (its `[[regions]]` address), and a new
        // leader starts with a window already measured.
        self.measure(&global);
        if leading {
            self.adopt(&global).await;
            self.settle().await;
            self.read_views().await;
            self.give().await;
        } else {
            self.peer_views.clear();
            self.shared.board.peers.lock().clear();
        }
        self.publish().await;
    }

    /// Adopts the policy slice of every limit with `regions` the ledger has no slice for,
    /// and moves the slice of every limit whose global limit changed (`Relimit`).
    async fn adopt(&self, global: &PolicySet) {
        let region = &self.shared.region;
        let mut adopted = 0;
        for rule in global.rules() {
            let Some(shares) = &rule.regions else { continue };
            for (index, limit) in rule.limits.iter().enumerate() {
                let key = SliceKey::of(&rule.domain, &rule.path, index);
                let global_tokens = limit.spec.requests_per_window;
                let known = self.shared.group.read(|ledger| ledger.regions().slice(&key));
                // A limit of 0 is the policy's to enforce; the slice keeps its share of the
                // last limit for when it is raised again (`transfer.rs`, a changed limit).
                if known
                    .is_some_and(|slice| slice.global_tokens == global_tokens || global_tokens == 0)
                {
                    continue;
                }
                if adopted >= ADOPTS_PER_TICK_MAX {
                    return;
                }
                adopted += 1;
                let command = match known {
                    None => RegionCommand::Adopt {
                        key: key.clone(),
                        slice: Slice {
                            global_tokens,
                            tokens: shares.slice_of(region, global_tokens),
                        },
                    },
                    Some(slice) => RegionCommand::Relimit {
                        key: key.clone(),
                        from_global_tokens: slice.global_tokens,
                        to_global_tokens: global_tokens,
                        to_policy_tokens: shares.slice_of(region, global_tokens),
                    },
                };
                match self.shared.propose(command).await {
                    Ok(RegionResponse::Adopted) => {
                        tracing::info!(%key, global_tokens, "adopted a slice");
                    }
                    Ok(RegionResponse::Relimited(slice)) => {
                        tracing::info!(%key, tokens = slice.tokens, global_tokens, "the global limit changed: moved the slice");
                    }
                    outcome => tracing::warn!(%key, ?outcome, "could not adopt a slice"),
                }
            }
        }
    }

    /// Samples the region's hits offered on each sliced limit and records its demand.
    fn measure(&mut self, global: &PolicySet) {
        let now_ms = crate::clock::now_ms();
        let mut measured = BTreeMap::new();
        let mut windows = BTreeMap::new();
        let region = &self.shared.region;
        for rule in global.rules() {
            let Some(shares) = &rule.regions else { continue };
            for (index, limit) in rule.limits.iter().enumerate() {
                let key = SliceKey::of(&rule.domain, &rule.path, index);
                if measured.len() >= SLICED_RULES_MAX {
                    break;
                }
                let hits_total =
                    self.shared.group.read(|ledger| ledger.regions().offered_hits(&key));
                let mut window = self.windows.remove(&key).unwrap_or_default();
                let demand_tokens =
                    window.sample(now_ms, hits_total, self.plan.observe_ms, limit.spec.window_ms);
                let policy_tokens = shares.slice_of(region, limit.spec.requests_per_window);
                measured.insert(key.clone(), Measured { policy_tokens, demand_tokens });
                windows.insert(key, window);
            }
        }
        self.windows = windows;
        *self.shared.board.measured.lock() = measured;
    }

    /// Sends every unsettled transfer's credit (its cancellation once timed out) and
    /// settles what the recipients answer.
    async fn settle(&self) {
        let region = self.shared.region.as_str();
        let now_ms = crate::clock::now_ms();
        let timeout_ms = self.transfer_timeout_ms;
        // Read at once with the slices, so each credit's tokens and limit agree.
        let requests: Vec<(u64, String, TransferRequest)> = self.shared.group.read(|ledger| {
            let regions = ledger.regions();
            regions
                .outgoing()
                .filter_map(|(serial, transfer)| {
                    if now_ms.saturating_sub(transfer.debited_at_ms) >= timeout_ms {
                        let id = TransferId { donor: region.to_owned(), serial };
                        let settled_below = regions.settled_below(&transfer.recipient);
                        let cancel = TransferRequest::Cancel { id, settled_below };
                        return Some((serial, transfer.recipient.clone(), cancel));
                    }
                    let (recipient, credit) = regions.credit_request(region, serial)?;
                    Some((serial, recipient, credit))
                })
                .collect()
        });
        let mut unreachable: Vec<String> = Vec::new();
        for (serial, recipient, request) in requests {
            if unreachable.contains(&recipient) {
                continue;
            }
            if !self.deliver(serial, &recipient, request).await {
                unreachable.push(recipient);
            }
        }
    }

    /// Sends one transfer request and settles the answer; false when the call failed.
    async fn deliver(&self, serial: u64, recipient: &str, request: TransferRequest) -> bool {
        let result = |label: &str| self.metrics.region_transfers.with_label_values(&[label]).inc();
        let id = request.id().clone();
        match self.endpoint.call(recipient, &RegionRequest::Transfer(request)).await {
            Ok(RegionReply::Received(outcome)) => {
                let command = RegionCommand::Settle { serial, outcome };
                match self.shared.propose(command).await {
                    Ok(RegionResponse::Settled) => {
                        result(match outcome {
                            Received::Credited => "credited",
                            Received::Cancelled => "returned",
                        });
                        tracing::info!(%id, %recipient, ?outcome, "transfer settled");
                    }
                    outcome => {
                        // Settled on the next tick: the recipient repeats its answer.
                        result("failed");
                        tracing::warn!(%id, ?outcome, "could not settle a transfer");
                    }
                }
                true
            }
            Ok(reply) => {
                result("refused");
                tracing::warn!(%id, %recipient, ?reply, "a transfer step was refused");
                true
            }
            Err(error) => {
                result("failed");
                tracing::debug!(%id, %error, "a transfer call failed; retried with the same id");
                false
            }
        }
    }

    /// Reads every peer's views; a peer that does not answer has none this tick.
    async fn read_views(&mut self) {
        for peer in &self.peers {
            let mut views = BTreeMap::new();
            let mut after: Option<SliceKey> = None;
            let mut complete = false;
            for _ in 0..VIEW_PAGES_MAX {
                let request = RegionRequest::Views { after: after.clone() };
                match self.endpoint.call(peer, &request).await {
                    Ok(RegionReply::Views { views: page, more }) => {
                        after = page.last().map(|view| view.key.clone());
                        for RuleView { key, view } in page {
                            if self.windows.contains_key(&key) {
                                views.insert(key, view);
                            }
                        }
                        if !more || after.is_none() {
                            complete = true;
                            break;
                        }
                    }
                    Ok(reply) => {
                        tracing::warn!(%peer, ?reply, "unexpected answer to a views request");
                        break;
                    }
                    Err(error) => {
                        tracing::debug!(%peer, %error, "cannot read a peer region's views");
                        break;
                    }
                }
            }
            if complete {
                self.peer_views.insert(peer.clone(), views);
            } else {
                self.peer_views.remove(peer);
            }
        }
        self.shared.board.peers.lock().clone_from(&self.peer_views);
    }

    /// This region's view of `key` now, if the ledger holds a slice for it.
    fn own_view(&self, key: &SliceKey) -> Option<RegionView> {
        let slice = self.shared.group.read(|ledger| ledger.regions().slice(key))?;
        Some(self.shared.view(key, slice))
    }

    /// Gives to hot peers, or back toward the policy's shares, as the planner says.
    async fn give(&self) {
        let mut budget = TRANSFERS_PER_TICK_MAX;
        let region = self.shared.region.as_str();
        for key in self.windows.keys() {
            let Some(global_tokens) = self.own_view(key).map(|own| own.global_tokens) else {
                continue;
            };
            // A peer that has not moved to a changed limit yet is left until it has: its
            // numbers are of the other limit.
            let peers: Vec<(String, RegionView)> = self
                .peer_views
                .iter()
                .filter_map(|(peer, views)| Some((peer.clone(), *views.get(key)?)))
                .filter(|(_, view)| view.global_tokens == global_tokens)
                .collect();
            let mut gave = false;
            for (peer, view) in &peers {
                if budget == 0 {
                    return;
                }
                let Some(own) = self.own_view(key) else { break };
                if !self.plan.is_hot(view) || self.in_flight(key, peer) {
                    continue;
                }
                // The hot peer's asks over the donors it has (this region and the others),
                // so that every donor computes the same split.
                let donors: Vec<(String, RegionView)> = std::iter::once((region.to_owned(), own))
                    .chain(peers.iter().filter(|(other, _)| other != peer).cloned())
                    .collect();
                let tokens = self
                    .plan
                    .asks(view, &donors)
                    .into_iter()
                    .find(|(donor, _)| *donor == region)
                    .map_or(0, |(_, tokens)| tokens);
                if tokens > 0 {
                    budget -= 1;
                    gave = true;
                    self.transfer(key, peer, tokens).await;
                }
            }
            if gave || budget == 0 {
                continue;
            }
            let Some(own) = self.own_view(key) else { continue };
            if let Some((peer, tokens)) = self.plan.drift(&own, &peers)
                && !self.in_flight(key, peer)
            {
                budget -= 1;
                self.transfer(key, peer, tokens).await;
            }
        }
    }

    /// Whether a transfer of `key` to `peer` is unsettled: the peer's views do not show it
    /// yet, so giving again could give twice for one ask.
    fn in_flight(&self, key: &SliceKey, peer: &str) -> bool {
        self.shared.group.read(|ledger| {
            ledger
                .regions()
                .outgoing()
                .any(|(_, transfer)| transfer.key == *key && transfer.recipient == peer)
        })
    }

    /// Debits `tokens` of `key` toward `recipient`, then sends the credit.
    async fn transfer(&self, key: &SliceKey, recipient: &str, tokens: u64) {
        let serial = self.shared.group.read(|ledger| ledger.regions().next_serial());
        let command = RegionCommand::Debit {
            serial,
            key: key.clone(),
            recipient: recipient.to_owned(),
            tokens,
        };
        let result = |label: &str| self.metrics.region_transfers.with_label_values(&[label]).inc();
        match self.shared.propose(command).await {
            Ok(RegionResponse::Debited(serial)) => {
                result("debited");
                tracing::info!(%key, %recipient, tokens, serial, "debited a transfer");
                let region = self.shared.region.as_str();
                // From the ledger, not from what was asked: a changed limit may have scaled
                // the transfer since.
                let credit = self
                    .shared
                    .group
                    .read(|ledger| ledger.regions().credit_request(region, serial));
                if let Some((recipient, request)) = credit {
                    self.deliver(serial, &recipient, request).await;
                }
            }
            Ok(response) => {
                result("refused");
                tracing::warn!(%key, %recipient, tokens, ?response, "the debit was refused");
            }
            Err(reason) => {
                // Maybe applied: then it is in flight and the next tick sends its credit.
                result("failed");
                tracing::warn!(%key, %recipient, tokens, %reason, "the debit has no answer");
            }
        }
    }

    /// Enforces the ledger's slices and exports the region's gauges (on every voter).
    async fn publish(&mut self) {
        let slices = self.shared.export();
        let measured = self.shared.board.measured.lock().clone();
        for key in slices.keys() {
            let demand = measured.get(key).map_or(0, |measured| measured.demand_tokens);
            self.metrics
                .region_demand_tokens
                .with_label_values(&[key.0.as_str()])
                .set(gauge(demand));
        }
        let mut peer_gauges = BTreeSet::new();
        for (peer, views) in &self.peer_views {
            for (key, view) in views {
                self.metrics
                    .region_slice_tokens
                    .with_label_values(&[peer.as_str(), key.0.as_str()])
                    .set(gauge(view.slice_tokens));
                peer_gauges.insert((peer.clone(), key.clone()));
            }
        }
        // A peer's slice read no more (a limit removed, leadership lost) is not left at its
        // last value.
        for (peer, key) in self.peer_gauges.difference(&peer_gauges) {
            let labels = [peer.as_str(), key.0.as_str()];
            let _ = self.metrics.region_slice_tokens.remove_label_values(&labels);
        }
        self.peer_gauges = peer_gauges;
        let refused = self.endpoint.refused_connections();
        self.metrics
            .region_connections_refused
            .inc_by(refused.saturating_sub(self.exported_refused));
        self.exported_refused = refused;
        for peer in &self.peers {
            let Some(link) = self.endpoint.link(peer) else { continue };
            // The link counts; the counters follow by what it counted since the last tick.
            let traffic = link.traffic();
            let last = self.exported_traffic.insert(peer.clone(), traffic).unwrap_or_default();
            let labels = [peer.as_str()];
            self.metrics
                .region_calls
                .with_label_values(&labels)
                .inc_by(traffic.calls.saturating_sub(last.calls));
            self.metrics
                .region_sent_bytes
                .with_label_values(&labels)
                .inc_by(traffic.sent_bytes.saturating_sub(last.sent_bytes));
            self.metrics
                .region_received_bytes
                .with_label_values(&labels)
                .inc_by(traffic.received_bytes.saturating_sub(last.received_bytes));
            let up = link.is_connected().await;
            self.metrics.region_link_up.with_label_values(&[peer.as_str()]).set(i64::from(up));
            if let Some(rtt) = link.rtt().await {
                self.metrics
                    .region_link_rtt
                    .with_label_values(&[peer.as_str()])
                    .set(rtt.as_secs_f64());
            }
        }
        self.policy.follow_slices(slices);
    }
}

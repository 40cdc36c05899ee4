//! A deterministic, seeded simulation of the mesh's leasing: N nodes running the node's own
//! admission procedure (`core::admission::judge`, as the shard actors do) and lease machine
//! (`core::lease::KeyLease`) against the ledger's state machine (`core::ledger::QuotaLedger`), with random message latencies, reports lost before the
//! ledger applied them, answers lost after it did, late answers, lease expiries, node
//! restarts, ledger outages and node clocks offset from the ledger's.
//!
//! Every simulated millisecond it checks, against one central bucket of the same limit:
//!
//! - no token is created: what the ledger counts as the nodes' (spent, held, written off) plus
//!   what its bucket holds, less the debt it is owed, never exceeds capacity plus refill;
//! - admissions in every 1 s window stay within the documented bound: capacity, plus the
//!   refill over the window, plus the drift bound (every node's lease and credit), plus what
//!   the fallback admitted in the window and what nodes that died before settling had
//!   admitted on credit;
//!
//! and once the faults stop and every node has settled, that no token is lost: for every
//! node the ledger counts exactly what the node spent and holds, and no node owes anything.
//!
//! A seed that fails becomes a named regression test below (`regression_*`).
//!
//! ```text
//!  node i (clock + offset_i) ──report (latency, maybe lost)──▶ ledger (ledger time)
//!        ▲                                                        │
//!        └────────────── answer (latency, maybe lost) ◀───────────┘
//! ```

use std::collections::BTreeMap;

use quotamesh::core::admission::{
    BypassReason, Counter, Fallback, Judged, Region, ShortKeys, Staged, judge, record_rejected,
};
use quotamesh::core::lease::{KeyLease, LeaseTuning, ReportAnswer, ReportDraft, size_cap_tokens};
use quotamesh::core::ledger::{
    LeaseEpoch, LeaseReport, NodeId, QuotaCommand, QuotaLedger, QuotaResponse, ReportOutcome,
};
use quotamesh::core::policy::FailureMode;
use quotamesh::core::rate::{Algorithm, LimitSpec};

const KEY: &str = "rl:sim:key";
/// How long a node waits for an answer before taking the report as not applied.
const ANSWER_TIMEOUT_MS: u64 = 200;
/// The sweep interval, as the node's default.
const SWEEP_MS: u64 = 250;
/// Consecutive unanswered reports after which a node decides from its fallback.
const FAILURES_TO_OPEN: u32 = 3;
/// Fallback multiplier, per mille (the default, 1.0).
const FALLBACK_PERMILLE: u64 = 1_000;

/// SplitMix64: small, fast, and the same sequence for the same seed everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }

    fn chance(&mut self, per_million: u64) -> bool {
        self.below(1_000_000) < per_million
    }
}

/// What becomes of a report on its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Applied, and its answer arrives.
    Answered,
    /// Lost before the ledger saw it.
    LostBefore,
    /// Applied, but its answer is lost.
    LostAfter,
}

#[derive(Debug)]
struct Message {
    node: usize,
    epoch: LeaseEpoch,
    draft: ReportDraft,
    /// Ledger time it reaches the ledger.
    arrives_at_ms: u64,
    /// Extra time its answer takes back.
    answer_latency_ms: u64,
    fate: Fate,
}

#[derive(Debug)]
struct Answer {
    node: usize,
    epoch: LeaseEpoch,
    draft: ReportDraft,
    at_ms: u64,
    answer: ReportAnswer,
}

struct SimNode {
    id: NodeId,
    offset_ms: i64,
    lease: KeyLease,
    epoch: LeaseEpoch,
    /// Offered hits per million per ms.
    offered_per_million: u64,
    fallback: Option<Fallback>,
    failures_in_row: u32,
    next_sweep_ms: u64,
    down_until_ms: u64,
    /// Most one-way latency of its reports and answers, ms (the leader's own node answers
    /// fastest; a follower or gateway forwards).
    latency_ms_max: u64,
    /// Reports sent and hits admitted since [`World::measure_from_ms`].
    reports_sent: u64,
    admitted_hits: u64,
}

impl SimNode {
    fn clock(&self, now_ms: u64) -> u64 {
        now_ms.saturating_add_signed(self.offset_ms)
    }
}

struct World {
    rng: Rng,
    limit: LimitSpec,
    tuning: LeaseTuning,
    ledger: QuotaLedger,
    nodes: Vec<SimNode>,
    in_air: Vec<Message>,
    answers: Vec<Answer>,
    outage_until_ms: u64,
    incarnations: u64,
    /// Per 1 s window: hits admitted, of them from the fallback, and what dead nodes left
    /// uncharged.
    windows: BTreeMap<u64, (u64, u64, u64)>,
    /// Nodes count their reports and admissions from this simulated time on.
    measure_from_ms: u64,
    /// At this simulated time, all of one node's offered traffic moves to another:
    /// `(at_ms, from, to)`.
    traffic_shift: Option<(u64, usize, usize)>,
}

/// The faults a run injects, per million per simulated ms.
#[derive(Debug, Clone, Copy)]
struct Faults {
    lost_report: u64,
    lost_answer: u64,
    outage_start: u64,
    restart: u64,
}

const FAULTS: Faults =
    Faults { lost_report: 50_000, lost_answer: 50_000, outage_start: 150, restart: 100 };
const NO_FAULTS: Faults = Faults { lost_report: 0, lost_answer: 0, outage_start: 0, restart: 0 };

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let node_count = 2 + rng.below(4) as usize;
        let rate = [20, 100, 1_000][rng.below(3) as usize];
        let limit =
            LimitSpec::new(Algorithm::TokenBucket, rate, 1_000, Some(rate)).expect("a valid limit");
        let nodes = (0..node_count)
            .map(|index| {
                let offset_ms = rng.below(201) as i64 - 100;
                // Offered load from a tenth of the limit to three times it, split unevenly.
                let offered = rate * (1 + rng.below(30)) / 10;
                SimNode {
                    id: NodeId(index as u64 + 1),
                    offset_ms,
                    lease: KeyLease::new(rate, size_cap_tokens(rate, node_count as u64)),
                    epoch: LeaseEpoch { incarnation: 1, serial: index as u64 },
                    offered_per_million: offered * 1_000 / node_count as u64,
                    fallback: None,
                    failures_in_row: 0,
                    next_sweep_ms: 0,
                    down_until_ms: 0,
                    latency_ms_max: 30,
                    reports_sent: 0,
                    admitted_hits: 0,
                }
            })
            .collect();
        Self {
            rng,
            limit,
            tuning: LeaseTuning::default(),
            ledger: QuotaLedger::new(),
            nodes,
            in_air: Vec::new(),
            answers: Vec::new(),
            outage_until_ms: 0,
            incarnations: 1,
            windows: BTreeMap::new(),
            measure_from_ms: 0,
            traffic_shift: None,
        }
    }

    /// A key of `limit` offered `offered_per_second` by each of
    /// `node_count` nodes; node 0 answers within 2 ms (it leads), the others within
    /// `latency_ms_max`; node clocks are offset by `offsets_ms` (missing: 0).
    fn contended(
        seed: u64,
        node_count: usize,
        limit: LimitSpec,
        offered_per_second: u64,
        latency_ms_max: u64,
        offsets_ms: &[i64],
    ) -> Self {
        let mut world = Self::new(seed);
        world.limit = limit;
        let rate = limit.capacity_tokens();
        world.nodes = (0..node_count)
            .map(|index| SimNode {
                id: NodeId(index as u64 + 1),
                offset_ms: offsets_ms.get(index).copied().unwrap_or(0),
                lease: KeyLease::new(rate, size_cap_tokens(rate, node_count as u64)),
                epoch: LeaseEpoch { incarnation: 1, serial: index as u64 },
                offered_per_million: offered_per_second * 1_000,
                fallback: None,
                failures_in_row: 0,
                next_sweep_ms: 0,
                down_until_ms: 0,
                latency_ms_max: if index == 0 { 2 } else { latency_ms_max },
                reports_sent: 0,
                admitted_hits: 0,
            })
            .collect();
        world
    }

    fn node_count(&self) -> u64 {
        self.nodes.len() as u64
    }

    fn send(&mut self, node: usize, draft: ReportDraft, now_ms: u64, faults: Faults) {
        let fate = if self.rng.chance(faults.lost_report) {
            Fate::LostBefore
        } else if self.rng.chance(faults.lost_answer) {
            Fate::LostAfter
        } else {
            Fate::Answered
        };
        let latency_ms_max = self.nodes[node].latency_ms_max;
        if now_ms >= self.measure_from_ms {
            self.nodes[node].reports_sent += 1;
        }
        let message = Message {
            node,
            epoch: self.nodes[node].epoch,
            draft,
            arrives_at_ms: now_ms + 1 + self.rng.below(latency_ms_max),
            answer_latency_ms: 1 + self.rng.below(latency_ms_max),
            fate,
        };
        self.in_air.push(message);
    }

    fn deliver(&mut self, now_ms: u64) {
        let (due, waiting): (Vec<Message>, Vec<Message>) =
            std::mem::take(&mut self.in_air).into_iter().partition(|m| m.arrives_at_ms <= now_ms);
        self.in_air = waiting;
        for message in due {
            let lost = message.fate == Fate::LostBefore || now_ms < self.outage_until_ms;
            let mut answer = ReportAnswer::NotApplied;
            if !lost {
                let report = LeaseReport {
                    key: KEY.to_owned(),
                    limit: self.limit,
                    epoch: message.epoch,
                    seq: message.draft.seq,
                    spent_tokens: message.draft.spent_tokens,
                    held_tokens: message.draft.held_tokens,
                    settled_tokens: message.draft.settled_tokens,
                    tokens_wanted: message.draft.tokens_wanted,
                    demand_milli_per_second: message.draft.demand_milli_per_second,
                    lookahead_ms: self.tuning.lookahead_ms,
                    lease_ttl_ms: self.tuning.lease_ttl_ms,
                };
                let command = QuotaCommand::SettleLeases {
                    now_ms,
                    node_id: self.nodes[message.node].id,
                    reports: vec![report],
                };
                let QuotaResponse::Settled(mut outcomes) = self.ledger.apply(&command) else {
                    panic!("a settlement answer");
                };
                match outcomes.remove(0).expect("a valid report") {
                    ReportOutcome::Settled(settlement) => {
                        answer = ReportAnswer::Settled {
                            granted_tokens: settlement.grant.granted_tokens,
                            retry_after_ms: settlement.grant.retry_after_ms,
                            remaining_tokens: settlement.grant.remaining_tokens,
                        }
                    }
                    ReportOutcome::Stale => {}
                    ReportOutcome::Superseded => answer = ReportAnswer::Superseded,
                }
            }
            let at_ms = match (lost, message.fate) {
                (false, Fate::Answered) => now_ms + message.answer_latency_ms,
                // The node hears nothing and gives up after its timeout.
                _ => {
                    answer = ReportAnswer::NotApplied;
                    message.arrives_at_ms + ANSWER_TIMEOUT_MS
                }
            };
            self.answers.push(Answer {
                node: message.node,
                epoch: message.epoch,
                draft: message.draft,
                at_ms,
                answer,
            });
        }
        let (due, waiting): (Vec<Answer>, Vec<Answer>) =
            std::mem::take(&mut self.answers).into_iter().partition(|a| a.at_ms <= now_ms);
        self.answers = waiting;
        for answer in due {
            let node = &mut self.nodes[answer.node];
            if node.epoch != answer.epoch {
                continue; // For a life that ended: nothing to apply it to.
            }
            let node_ms = node.clock(now_ms);
            node.lease.apply_answer(&self.tuning, &answer.draft, answer.answer, node_ms);
            match answer.answer {
                ReportAnswer::Settled { .. } => {
                    node.failures_in_row = 0;
                    node.fallback = None;
                }
                ReportAnswer::NotApplied => node.failures_in_row += 1,
                ReportAnswer::Superseded => {
                    unreachable!("a node's current life is the newest the ledger knows")
                }
            }
        }
    }

    /// One node's traffic in one ms.
    fn traffic(&mut self, index: usize, now_ms: u64, faults: Faults, offered: bool) {
        let node_count = self.node_count();
        let window = now_ms / 1_000;
        let node = &mut self.nodes[index];
        if now_ms < node.down_until_ms {
            return;
        }
        let node_ms = node.clock(now_ms);
        let hits = u64::from(offered && self.rng.chance(node.offered_per_million));
        if hits > 0 {
            // The node's own admission procedure: the shard actors call the same function.
            let circuit_open = node.failures_in_row >= FAILURES_TO_OPEN;
            let counter = Counter {
                spec: &self.limit,
                hits,
                tuning: &self.tuning,
                failure_mode: FailureMode::Open,
            };
            let region = Region {
                nodes_in_region: node_count,
                fallback_multiplier_permille: FALLBACK_PERMILLE,
            };
            let current = Staged { lease: node.lease, fallback: node.fallback };
            let short_keys = if circuit_open {
                ShortKeys::Fallback(BypassReason::CircuitOpen)
            } else {
                ShortKeys::Wait
            };
            let mut judged = judge(&current, &counter, &region, node_ms, short_keys);
            // A request that waited out its budget (half of them here) decides from the
            // fallback; the others are still waiting when their lease comes, and retry.
            if judged == Judged::Short && self.rng.chance(500_000) {
                let late = ShortKeys::Fallback(BypassReason::LedgerTimeout);
                judged = judge(&current, &counter, &region, node_ms, late);
            }
            let admitted_from = match judged {
                Judged::Decided { verdict, staged, bypass, .. } if verdict.admitted => {
                    node.lease = staged.lease;
                    node.fallback = staged.fallback;
                    Some(bypass.is_some())
                }
                Judged::Decided { .. } | Judged::AtLimit { .. } | Judged::Short => {
                    record_rejected(&mut node.lease, &counter, node_ms);
                    None
                }
            };
            if let Some(from_fallback) = admitted_from {
                if now_ms >= self.measure_from_ms {
                    node.admitted_hits += hits;
                }
                let entry = self.windows.entry(window).or_default();
                entry.0 += hits;
                entry.1 += if from_fallback { hits } else { 0 };
            }
            let draft = if admitted_from.is_some() {
                node.lease.poll_refill(&self.tuning, node_ms)
            } else {
                node.lease.poll_lease_for(&self.tuning, node_ms, hits)
            };
            if let Some(draft) = draft {
                self.send(index, draft, now_ms, faults);
            }
        }
        let node = &mut self.nodes[index];
        if node_ms >= node.next_sweep_ms {
            node.next_sweep_ms = node_ms + SWEEP_MS;
            if !node.lease.in_flight() {
                let idle =
                    node_ms.saturating_sub(node.lease.last_hit_ms()) >= self.tuning.lookahead_ms;
                if idle {
                    node.lease.take_all(node_ms);
                } else {
                    node.lease.take_surplus(&self.tuning, node_ms);
                }
            }
            if let Some(draft) = node.lease.poll_settle(&self.tuning, node_ms) {
                self.send(index, draft, now_ms, faults);
            }
        }
    }

    fn faults(&mut self, now_ms: u64, faults: Faults) {
        if now_ms >= self.outage_until_ms && self.rng.chance(faults.outage_start) {
            self.outage_until_ms = now_ms + 500 + self.rng.below(3_000);
        }
        for index in 0..self.nodes.len() {
            if self.rng.chance(faults.restart) {
                self.incarnations += 1;
                let rate = self.limit.capacity_tokens();
                let size_cap = size_cap_tokens(rate, self.node_count());
                let window = now_ms / 1_000;
                let node = &mut self.nodes[index];
                // What it admitted on credit and never charged dies with it.
                self.windows.entry(window).or_default().2 += node.lease.debt_tokens();
                node.lease = KeyLease::new(rate, size_cap);
                node.epoch = LeaseEpoch { incarnation: self.incarnations, serial: 0 };
                node.fallback = None;
                node.failures_in_row = 0;
                node.down_until_ms = now_ms + 100 + self.rng.below(1_000);
            }
        }
    }

    /// Tokens the ledger counts as the nodes', in its bucket, and owed to it.
    fn ledger_counts(&self, now_ms: u64) -> (u64, u64, u64) {
        let Some(entry) = self.ledger.key(KEY) else {
            return (0, self.limit.capacity_tokens(), 0);
        };
        let attributed = entry
            .leases
            .values()
            .map(|lease| lease.spent_tokens + lease.written_off_tokens + lease.tokens)
            .sum();
        let bucket = entry.limit.evaluate(&entry.state, now_ms, 0).remaining;
        (attributed, bucket, entry.debt_tokens)
    }

    fn check_conservation(&self, seed: u64, now_ms: u64) {
        let (attributed, bucket, debt) = self.ledger_counts(now_ms);
        let refill = self.limit.requests_per_window * now_ms / self.limit.window_ms;
        assert!(
            attributed + bucket <= self.limit.capacity_tokens() + refill + debt + 1,
            "seed {seed} at {now_ms} ms: tokens created: attributed {attributed} + bucket {bucket} \
             > capacity {} + refill {refill} + debt {debt}",
            self.limit.capacity_tokens()
        );
    }

    fn check_windows(&self, seed: u64) {
        let node_count = self.node_count();
        let drift = self.tuning.drift_bound_tokens(&self.limit, node_count, true, None);
        let per_window = self.limit.capacity_tokens() + self.limit.requests_per_window + drift;
        for (window, (admitted, fallback, uncharged)) in &self.windows {
            assert!(
                *admitted <= per_window + fallback + uncharged,
                "seed {seed}: window {window} s admitted {admitted} > capacity + rate + drift \
                 {per_window} + fallback {fallback} + uncharged {uncharged}"
            );
        }
    }

    fn run(&mut self, seed: u64, duration_ms: u64, faults: Faults) {
        for now_ms in 0..duration_ms {
            if let Some((at_ms, from, to)) = self.traffic_shift
                && at_ms == now_ms
            {
                let moved = std::mem::take(&mut self.nodes[from].offered_per_million);
                self.nodes[to].offered_per_million += moved;
            }
            self.faults(now_ms, faults);
            self.deliver(now_ms);
            for index in 0..self.nodes.len() {
                self.traffic(index, now_ms, faults, true);
            }
            self.check_conservation(seed, now_ms);
        }
        self.check_windows(seed);
        // Quiesce: no traffic and no faults; every node settles what it holds and owes.
        self.outage_until_ms = 0;
        let end_ms = duration_ms + 5_000;
        for now_ms in duration_ms..end_ms {
            self.deliver(now_ms);
            for index in 0..self.nodes.len() {
                self.traffic(index, now_ms, NO_FAULTS, false);
            }
            self.check_conservation(seed, now_ms);
        }
        let entry = self.ledger.key(KEY);
        for node in &self.nodes {
            let node_ms = node.clock(end_ms);
            let own = node.lease.spent_tokens() + node.lease.balance_tokens(node_ms);
            match entry.and_then(|entry| entry.leases.get(&node.id)) {
                Some(lease) if lease.epoch == node.epoch => {
                    let counted = lease.spent_tokens + lease.written_off_tokens + lease.tokens;
                    assert_eq!(
                        counted, own,
                        "seed {seed}: node {} lost tokens: the ledger counts {counted}, the node \
                         has {own}",
                        node.id
                    );
                }
                // The sweep forgot the key with its records (and another node may have made
                // it anew): only a key whose bucket was full again and whose leases were all
                // settled goes, so the node must hold nothing the ledger had not counted.
                None => assert!(
                    node.lease.balance_tokens(node_ms) == 0 && own == node.lease.settled_tokens(),
                    "seed {seed}: node {} has tokens the forgotten key did not count",
                    node.id
                ),
                // The node's current life never reported: it has nothing to count.
                Some(_) => assert_eq!(own, 0, "seed {seed}: node {} never reported", node.id),
            }
            assert_eq!(node.lease.debt_tokens(), 0, "seed {seed}: node {} still owes", node.id);
        }
    }
}

fn simulate(seed: u64) {
    World::new(seed).run(seed, 20_000, FAULTS);
}

/// Proves the invariants above over many seeded schedules of faults.
#[test]
fn leasing_conserves_tokens_under_faults() {
    let seeds: u64 = std::env::var("LEASE_SIMULATION_SEEDS")
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(256);
    for seed in 0..seeds {
        simulate(seed);
    }
}

/// Proves that without faults, every admission is paid by the ledger and nothing from the
/// fallback beyond the wait-budget cases, with the same invariants.
#[test]
fn leasing_conserves_tokens_without_faults() {
    for seed in 1_000..1_016 {
        World::new(seed).run(seed, 10_000, NO_FAULTS);
    }
}

/// Seed 22 found that a key the ledger's sweep forgot, with its settlement records, charged a
/// node's spending a second time when the node next reported (fixed: a report carries what
/// the node last heard the ledger counted, the baseline when no record is left).
#[test]
fn regression_a_forgotten_key_charges_spending_once() {
    simulate(22);
}

/// Seed 85 found that a report the ledger applied but whose answer was lost left a grant the
/// node never saw counted as its for good: the node, unaware, never settled again (fixed: an
/// unanswered report leaves the key unconfirmed until a report is answered).
#[test]
fn regression_a_lost_answer_is_settled() {
    simulate(85);
}

/// Seed 154 found a node whose key the ledger had forgotten and another node had made anew,
/// which the no-loss check took for a lost record (the checker's bug; the key holds nothing
/// of the node's).
#[test]
fn regression_a_key_made_anew_by_another_node() {
    simulate(154);
}

/// What a contended run measured per node once the burst was gone.
struct AtLimit {
    /// Each node's share of the admissions.
    shares: Vec<f64>,
    /// Each node's reports (ledger writes) per second.
    writes_per_second: Vec<f64>,
    /// Admissions per second, all nodes.
    admitted_per_second: f64,
    /// How long it measured.
    seconds: f64,
}

/// Runs `world` without faults for `duration_ms`, measuring from `measure_from_ms`.
fn at_limit(mut world: World, seed: u64, measure_from_ms: u64, duration_ms: u64) -> AtLimit {
    world.measure_from_ms = measure_from_ms;
    world.run(seed, duration_ms, NO_FAULTS);
    let seconds = (duration_ms - measure_from_ms) as f64 / 1_000.0;
    let admitted: u64 = world.nodes.iter().map(|node| node.admitted_hits).sum();
    AtLimit {
        shares: world
            .nodes
            .iter()
            .map(|node| node.admitted_hits as f64 / admitted.max(1) as f64)
            .collect(),
        writes_per_second: world
            .nodes
            .iter()
            .map(|node| node.reports_sent as f64 / seconds)
            .collect(),
        admitted_per_second: admitted as f64 / seconds,
        seconds,
    }
}

/// The issue's targets for a key at its limit: each node's admitted share within 10 % of its
/// fair share, at most 4 ledger writes per second per node (one more write in the whole
/// measurement is the fence post: writes 250 ms apart fit `T / 250 ms + 1` times in `T`),
/// and the limit used (no more than 1 % under it).
fn assert_fair_and_cheap(case: &str, measured: &AtLimit, limit_per_second: f64) {
    let fair = 1.0 / measured.shares.len() as f64;
    eprintln!(
        "{case}: shares {:?}, writes/s {:?}, admitted {:.1}/s of {limit_per_second:.1}/s",
        measured.shares, measured.writes_per_second, measured.admitted_per_second
    );
    for (node, share) in measured.shares.iter().enumerate() {
        assert!(
            (share - fair).abs() <= fair * 0.10,
            "{case}: node {node} got share {share:.3}, fair {fair:.3}"
        );
    }
    for (node, writes) in measured.writes_per_second.iter().enumerate() {
        assert!(
            *writes <= 4.0 + 1.0 / measured.seconds,
            "{case}: node {node} made {writes:.2} ledger writes/s"
        );
    }
    assert!(
        measured.admitted_per_second >= limit_per_second * 0.99,
        "{case}: admitted {:.1}/s, under the limit of {limit_per_second:.1}/s",
        measured.admitted_per_second
    );
}

/// Proves that a key at its limit is shared fairly and cheaply: five nodes offering three
/// times a 1,000/s limit between them, the leader's node answered fastest, each get a fifth
/// within 10 % for at most 4 ledger writes per second.
#[test]
fn a_key_at_its_limit_is_shared_fairly_for_few_writes() {
    for seed in 0..4 {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(1_000))
            .expect("a valid limit");
        let world = World::contended(seed, 5, limit, 600, 30, &[]);
        assert_fair_and_cheap("1,000/s at 3x", &at_limit(world, seed, 3_000, 13_000), 1_000.0);
    }
}

/// Proves that a node whose clock runs 50 ms ahead takes no more than its fair share.
#[test]
fn a_clock_ahead_takes_no_more_than_its_share() {
    for seed in 0..4 {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(1_000))
            .expect("a valid limit");
        let world = World::contended(seed, 5, limit, 600, 30, &[0, 50]);
        assert_fair_and_cheap(
            "one clock 50 ms ahead",
            &at_limit(world, seed, 3_000, 13_000),
            1_000.0,
        );
    }
}

/// Proves that a key drained at once by one large request from one node (its demand estimate
/// inflated by those hits) is then shared fairly, at its rate.
#[test]
fn a_key_drained_by_one_large_request_is_shared_at_its_rate() {
    let limit = LimitSpec::new(Algorithm::TokenBucket, 50_000, 60_000, Some(50_000))
        .expect("a valid limit");
    let mut world = World::contended(7, 5, limit, 333, 30, &[]);
    let tuning = world.tuning;
    let counter =
        Counter { spec: &limit, hits: 50_000, tuning: &tuning, failure_mode: FailureMode::Open };
    // Another node leases the whole bucket and spends it; node 1's estimate counts the
    // 50,000 hits of its own first, refused, try.
    record_rejected(&mut world.nodes[0].lease, &counter, 0);
    for (seq, spent_tokens, tokens_wanted) in [(1, 0, 50_000), (2, 50_000, 0)] {
        let report = LeaseReport {
            key: KEY.to_owned(),
            limit,
            epoch: LeaseEpoch::default(),
            seq,
            spent_tokens,
            held_tokens: 0,
            settled_tokens: 0,
            tokens_wanted,
            demand_milli_per_second: 0,
            lookahead_ms: tuning.lookahead_ms,
            lease_ttl_ms: tuning.lease_ttl_ms,
        };
        let command =
            QuotaCommand::SettleLeases { now_ms: 0, node_id: NodeId(99), reports: vec![report] };
        world.ledger.apply(&command);
    }
    let measured = at_limit(world, 7, 3_000, 23_000);
    assert_fair_and_cheap("drained by one request", &measured, 50_000.0 / 60.0);
}

/// Proves that when all of one node's traffic moves to another (a skewed key: a client
/// reconnects elsewhere), the key still admits its rate, the idle node's share goes to the
/// others, and writes stay bounded.
#[test]
fn traffic_that_moves_between_nodes_keeps_the_key_at_its_rate() {
    for seed in 0..4 {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(1_000))
            .expect("a valid limit");
        let mut world = World::contended(seed, 5, limit, 600, 30, &[]);
        world.traffic_shift = Some((5_000, 1, 2));
        let measured = at_limit(world, seed, 8_000, 18_000);
        eprintln!("skewed: {:?}, {:?}", measured.shares, measured.writes_per_second);
        assert!(measured.shares[1] == 0.0, "the node without traffic admitted nothing");
        // Node 2 now offers twice what the others do; max-min gives every busy node a
        // quarter of the rate, which both of node 2's streams share.
        for node in [0, 2, 3, 4] {
            assert!(
                (measured.shares[node] - 0.25).abs() <= 0.025,
                "seed {seed}: node {node} got share {:.3}",
                measured.shares[node]
            );
        }
        assert!(measured.admitted_per_second >= 990.0, "{}", measured.admitted_per_second);
        for writes in &measured.writes_per_second {
            assert!(*writes <= 4.0 + 1.0 / measured.seconds, "{writes} writes/s");
        }
    }
}

/// Proves the enterprise tier (50,000 per minute) at twice its rate over five nodes, once its
/// burst is drained, is shared fairly and cheaply.
#[test]
fn the_enterprise_tier_at_twice_its_rate_is_shared_fairly() {
    for seed in 0..2 {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 50_000, 60_000, Some(50_000))
            .expect("a valid limit");
        let rate = 50_000.0 / 60.0;
        // 2x the rate in total, so the 50,000 burst drains in about a minute.
        let world = World::contended(seed, 5, limit, 333, 30, &[]);
        assert_fair_and_cheap(
            "enterprise tier at 2x",
            &at_limit(world, seed, 70_000, 90_000),
            rate,
        );
    }
}

/// Proves that a key wanted by two of five nodes at three times its limit is shared between
/// the two at its rate, for at most 4 ledger writes per second each: while the ledger divides
/// the key, a node's lease may be twice the small-key cap of `capacity / (2 x nodes)` (100
/// here, which covers only 200 ms of a 500/s share).
#[test]
fn a_key_at_its_limit_on_two_of_five_nodes_is_shared_for_few_writes() {
    for seed in 0..4 {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 1_000, 1_000, Some(1_000))
            .expect("a valid limit");
        let mut world = World::contended(seed, 5, limit, 1_500, 30, &[]);
        for idle in &mut world.nodes[2..] {
            idle.offered_per_million = 0;
        }
        let mut measured = at_limit(world, seed, 3_000, 13_000);
        measured.shares.truncate(2);
        measured.writes_per_second.truncate(2);
        assert_fair_and_cheap("2 of 5 nodes at 3x", &measured, 1_000.0);
    }
}

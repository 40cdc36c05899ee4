//! One run, end to end: start the topology, open the bank's accounts, let the workers carry
//! out their seeded plans while the nemesis carries out its seeded schedule, heal, resolve
//! every operation left unknown by retrying its idempotency key, read the final balances
//! and every node's audit trail, and check. Everything lands in the run's directory:
//!
//! ```text
//! run.json          options, seed and the bank's shape
//! schedule.json     the planned operations and faults (a function of the seed)
//! history.jsonl     every operation's invoke and completion
//! nemesis.jsonl     every fault's start and end, with the nodes it hit
//! trail-node-N.jsonl  node N's audit trail after the run
//! ledger.jsonl      the quota ledger's keys read from the voters (RLS and lease workloads)
//! logs/ nodes/ certs/ metrics/   the nodes' logs, configs and data, certificates, metrics
//! verdict.json  report.md
//! ```
//!
//! ```text
//!  workers (8) ──ops──> node 1..N billing API      nemesis ──SIGKILL/STOP/CONT──> nodes
//!      │                                              │
//!      └──── history.jsonl <── recorder ──> nemesis.jsonl
//! ```

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::checker::{self, CheckResult, Verdict};
use crate::client::{BillingNodes, Clients};
use crate::history::{
    Event, EventType, Function, JsonlWriter, NodeId, OpValue, ProcessId, TrailEntry, read_jsonl,
};
use crate::nemesis::{
    self, FaultKind, FaultOutcome, NemesisRecord, Phase, ScheduleOptions, ScheduledFault, Target,
};
use crate::topology::Topology;
use crate::topology::processes::{Cluster, Shape};
use crate::workload::bank::{self, BankOptions};
use crate::workload::holds::{self, HoldEnd};
use crate::workload::leases::{self, LeaseOptions};
use crate::workload::rls::{self, RlsOptions};
use crate::workload::{Pacing, Planned, PlannedOp};

/// How long the region may take to elect a billing leader, at the start and after healing.
const LEADER_WAIT: Duration = Duration::from_secs(60);
/// How long opening the accounts may take.
const SETUP_WAIT: Duration = Duration::from_secs(60);
/// How long the final phase may spend resolving unknown operations and reading trails.
const FINAL_WAIT: Duration = Duration::from_secs(60);
/// Attempts of one step of a transfer (on successive nodes) before it is left for later.
const ATTEMPTS: usize = 3;
/// Between two attempts: long enough for a leader election to progress.
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// A leader probe of one node during a fault: a paused node must not hold the nemesis up.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Between two reads of the quota ledger's keys, each from the next voter.
const LEDGER_READ_INTERVAL: Duration = Duration::from_millis(250);

/// What `quotamesh-jepsen run` was asked to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunOptions {
    pub topology: Topology,
    /// The workers, rate and time limit; its nodes are the voters.
    #[serde(flatten)]
    pub pacing: Pacing,
    /// Gateways besides the voters: RLS and lease requests go to them too.
    #[serde(default)]
    pub gateways: usize,
    pub workload: WorkloadKind,
    pub nemeses: Vec<FaultKind>,
    pub seed: u64,
    pub binary: PathBuf,
    /// The node image the `docker` topology runs (built from `binary` by
    /// `cluster/build-image.sh`; runs saved before it existed: the script's default tag).
    #[serde(default = "image_default")]
    pub image: String,
    /// What the availability checker demands (runs saved before it existed: the defaults).
    #[serde(default = "availability_default")]
    pub availability: checker::availability::Thresholds,
}

/// `cluster/build-image.sh`'s tag when given none.
pub const IMAGE_DEFAULT: &str = "quotamesh:dev";

fn image_default() -> String {
    IMAGE_DEFAULT.to_owned()
}

fn availability_default() -> checker::availability::Thresholds {
    checker::availability::THRESHOLDS_DEFAULT
}

/// The workloads a run can drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// Transfers and reads on the billing API.
    Bank,
    /// Hits on an open and a closed rule through the Rate Limit Service.
    Rls,
    /// The bank's transfers and reads on two accounts, half of them reads: the history the
    /// linearizability search judges hardest.
    Linear,
    /// Holds reserved with short TTLs and captured, voided or left to expire.
    Holds,
    /// Lease grants through the admin API on keys no node settles: the grants alone are
    /// bounded by the bucket.
    Leases,
}

impl WorkloadKind {
    /// Parses a `--workload` name.
    ///
    /// # Errors
    /// An unknown name.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name {
            "bank" => Ok(Self::Bank),
            "rls" => Ok(Self::Rls),
            "linear" => Ok(Self::Linear),
            "holds" => Ok(Self::Holds),
            "leases" => Ok(Self::Leases),
            other => {
                Err(format!("unknown workload {other:?}; known: bank, rls, linear, holds, leases"))
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Bank => "bank",
            Self::Rls => "rls",
            Self::Linear => "linear",
            Self::Holds => "holds",
            Self::Leases => "leases",
        }
    }

    /// Whether it drives the billing API's accounts (the bank's machinery and checks).
    pub fn is_billing(self) -> bool {
        matches!(self, Self::Bank | Self::Linear | Self::Holds)
    }

    /// Whether it leases from the quota ledger, whose keys' totals are read as it runs.
    pub fn leases(self) -> bool {
        matches!(self, Self::Rls | Self::Leases)
    }
}

/// `run.json`: the options and what the checkers need to know of the workload.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub options: RunOptions,
    pub bank: BankOptions,
    pub rls: RlsOptions,
    /// The lease workload's shape (runs saved before it existed have none).
    #[serde(default)]
    pub leases: Option<LeaseOptions>,
    pub started_unix_ms: u64,
}

/// `schedule.json`: everything the seed decides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    pub faults: Vec<ScheduledFault>,
    /// Each worker's operations.
    pub operations: Vec<Vec<Planned>>,
}

/// The bank's shape for a run.
pub fn bank_options(options: &RunOptions) -> BankOptions {
    let shape = match options.workload {
        WorkloadKind::Linear => BankOptions::linear,
        WorkloadKind::Holds => holds::options,
        WorkloadKind::Bank | WorkloadKind::Rls | WorkloadKind::Leases => BankOptions::new,
    };
    shape(options.pacing)
}

/// The run's pace over the nodes RLS and lease requests go to: the voters, then the
/// gateways.
fn serving_pacing(options: &RunOptions) -> Pacing {
    options.pacing.over(options.pacing.nodes + options.gateways)
}

/// The RLS workload's shape for a run.
pub fn rls_options(options: &RunOptions) -> RlsOptions {
    RlsOptions::new(serving_pacing(options))
}

/// The lease workload's shape for a run.
pub fn lease_options(options: &RunOptions) -> LeaseOptions {
    LeaseOptions::new(serving_pacing(options))
}

/// The operations and faults `options` (its seed included) plan. Pure.
pub fn schedule(options: &RunOptions) -> Schedule {
    let faults = nemesis::schedule(
        options.seed,
        &ScheduleOptions {
            kinds: options.nemeses.clone(),
            nodes: options.pacing.nodes,
            time_limit_ms: options.pacing.time_limit_ms,
            interval_ms: nemesis::INTERVAL_MS_DEFAULT,
            fault_ms_min: nemesis::FAULT_MS_MIN_DEFAULT,
            fault_ms_max: nemesis::FAULT_MS_MAX_DEFAULT,
        },
    );
    let operations = match options.workload {
        WorkloadKind::Bank | WorkloadKind::Linear => {
            bank::plan(options.seed, &bank_options(options))
        }
        WorkloadKind::Holds => holds::plan(options.seed, &bank_options(options)),
        WorkloadKind::Rls => rls::plan(options.seed, &rls_options(options)),
        WorkloadKind::Leases => leases::plan(options.seed, &lease_options(options)),
    };
    Schedule { faults, operations }
}

/// Milliseconds since the Unix epoch (names runs, and makes tokens unique).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

/// Writes the history and nemesis files, stamping events with the run's monotonic clock.
struct Recorder {
    epoch: Instant,
    history: Mutex<(u64, JsonlWriter)>,
    nemesis: Mutex<JsonlWriter>,
}

impl Recorder {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn event(
        &self,
        process: ProcessId,
        event_type: EventType,
        f: Function,
        node: NodeId,
        value: OpValue,
    ) {
        let mut history = self.history.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Stamped under the lock, so times never go back along the file.
        let event =
            Event { index: history.0, time_ns: self.now_ns(), process, event_type, f, node, value };
        history.0 += 1;
        if let Err(error) = history.1.write(&event) {
            eprintln!("quotamesh-jepsen: {error}");
        }
    }

    fn nemesis(&self, record: &NemesisRecord) {
        let mut file = self.nemesis.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(error) = file.write(record) {
            eprintln!("quotamesh-jepsen: {error}");
        }
    }
}

/// What the workers and the nemesis share.
struct Shared {
    recorder: Recorder,
    clients: Clients,
    next_process: AtomicU64,
    /// The RLS workload's rule keys, by position.
    rule_keys: Vec<String>,
    /// Every lease grant's TTL.
    lease_ttl_ms: u64,
}

/// When the workload (and the nemesis schedule) started, and for how long it runs.
#[derive(Clone, Copy)]
struct Clock {
    start: tokio::time::Instant,
    time_limit: Duration,
}

impl Shared {
    fn fresh_process(&self) -> ProcessId {
        ProcessId(self.next_process.fetch_add(1, Ordering::Relaxed))
    }

    /// One operation through node `position`, recorded; an `info` retires `process`.
    async fn operation(
        &self,
        process: &mut ProcessId,
        position: usize,
        f: Function,
        value: OpValue,
    ) -> (EventType, OpValue) {
        let node = NodeId(position as u64 + 1);
        self.recorder.event(*process, EventType::Invoke, f, node, value.clone());
        let (event_type, reply) = self.clients.call(position, f, &value).await;
        self.recorder.event(*process, event_type, f, node, reply.clone());
        if event_type == EventType::Info {
            *process = self.fresh_process();
        }
        (event_type, reply)
    }

    /// A mutation tried on up to `attempts` nodes from `position` on, with one key.
    async fn attempt(
        &self,
        process: &mut ProcessId,
        position: usize,
        f: Function,
        value: &OpValue,
        attempts: usize,
    ) -> Step {
        let mut unknown = false;
        for attempt in 0..attempts {
            let node = (position + attempt) % self.clients.len();
            match self.operation(process, node, f, value.clone()).await {
                (EventType::Ok, reply) => return Step::Decided(Box::new(reply)),
                (EventType::Info, _) => unknown = true,
                // The ledger's answer: another node would give the same.
                (EventType::Fail, reply) if reply.refused && !unknown => return Step::Failed,
                _ => {}
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
        if unknown { Step::Unknown } else { Step::Failed }
    }
}

/// How one step of a transfer ended.
enum Step {
    /// The node's reply (boxed: a step is mostly a failure, and the reply is large).
    Decided(Box<OpValue>),
    /// Every attempt failed: not applied.
    Failed,
    /// Some attempt may have applied.
    Unknown,
}

/// A transfer and the step it is at.
#[derive(Debug, Clone)]
struct Transfer {
    transfer: u64,
    from: usize,
    to: usize,
    amount: u64,
    node: usize,
    credit_due: bool,
}

impl Transfer {
    /// Drives the transfer as far as it goes in `attempts` per step; returns it if it is
    /// left unresolved (an unknown step, or a credit that failed).
    async fn drive(
        mut self,
        shared: &Shared,
        process: &mut ProcessId,
        attempts: usize,
    ) -> Option<Self> {
        let (debit_key, credit_key) = bank::transfer_keys(self.transfer);
        if !self.credit_due {
            let value = OpValue {
                account: bank::account_name(self.from),
                amount: Some(self.amount),
                key: Some(debit_key),
                transfer: Some(self.transfer),
                ..OpValue::default()
            };
            match shared.attempt(process, self.node, Function::Debit, &value, attempts).await {
                Step::Decided(reply)
                    if reply.decision == Some(crate::history::Decision::Approved) =>
                {
                    self.credit_due = true;
                }
                Step::Decided(_) | Step::Failed => return None,
                Step::Unknown => return Some(self),
            }
        }
        let value = OpValue {
            account: bank::account_name(self.to),
            amount: Some(self.amount),
            key: Some(credit_key),
            transfer: Some(self.transfer),
            ..OpValue::default()
        };
        match shared.attempt(process, self.node, Function::Credit, &value, attempts).await {
            Step::Decided(_) => None,
            Step::Failed | Step::Unknown => Some(self),
        }
    }
}

/// The capture or void of an approved hold, `wait_ms` after it was approved.
struct HoldEnding {
    hold: u64,
    hold_id: u64,
    account: usize,
    node: usize,
    end: HoldEnd,
}

impl HoldEnding {
    /// Tried on up to [`ATTEMPTS`] nodes with one key; whatever the outcome, it is not
    /// retried later (an unknown end counts either way, a refused one was not applied).
    async fn run(self, shared: std::sync::Arc<Shared>, wait_ms: u64) {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        let (_, key) = holds::hold_keys(self.hold);
        let (f, amount) = match self.end {
            HoldEnd::Capture { amount } => (Function::Capture, Some(amount)),
            HoldEnd::Void | HoldEnd::Lapse => (Function::Void, None),
        };
        let value = OpValue {
            account: bank::account_name(self.account),
            amount,
            key: Some(key),
            hold_id: Some(self.hold_id),
            ..OpValue::default()
        };
        let mut process = shared.fresh_process();
        shared.attempt(&mut process, self.node, f, &value, ATTEMPTS).await;
    }
}

/// One worker: its plan until the time limit, then (once the cluster is healed) every
/// transfer it left unresolved, retried by key until decided or the final phase ends.
async fn worker(
    shared: std::sync::Arc<Shared>,
    clock: Clock,
    plan: Vec<Planned>,
    mut healed: tokio::sync::watch::Receiver<bool>,
    final_deadline: tokio::sync::watch::Receiver<Option<tokio::time::Instant>>,
) -> usize {
    let mut process = shared.fresh_process();
    let mut unresolved = Vec::new();
    let mut hold_ends = Vec::new();
    for planned in plan {
        tokio::time::sleep_until(clock.start + Duration::from_millis(planned.at_ms)).await;
        if clock.start.elapsed() >= clock.time_limit {
            break;
        }
        match planned.op {
            PlannedOp::Check { rule } => {
                let key = shared.rule_keys.get(rule).cloned().unwrap_or_default();
                let value = OpValue { descriptor: Some(key), ..OpValue::default() };
                shared.operation(&mut process, planned.node, Function::Check, value).await;
            }
            PlannedOp::Lease { key, tokens } => {
                let value = OpValue {
                    descriptor: Some(LeaseOptions::key_value(key)),
                    amount: Some(tokens),
                    ttl_ms: Some(shared.lease_ttl_ms),
                    ..OpValue::default()
                };
                shared.operation(&mut process, planned.node, Function::Acquire, value).await;
            }
            PlannedOp::Read { account } => {
                let value = OpValue { account: bank::account_name(account), ..OpValue::default() };
                shared.operation(&mut process, planned.node, Function::Read, value).await;
            }
            PlannedOp::Transfer { transfer, from, to, amount } => {
                let transfer =
                    Transfer { transfer, from, to, amount, node: planned.node, credit_due: false };
                if let Some(left) = transfer.drive(&shared, &mut process, ATTEMPTS).await {
                    unresolved.push(left);
                }
            }
            PlannedOp::Hold { hold, account, amount, ttl_ms, wait_ms, end } => {
                let (reserve_key, _) = holds::hold_keys(hold);
                let value = OpValue {
                    account: bank::account_name(account),
                    amount: Some(amount),
                    key: Some(reserve_key),
                    ttl_ms: Some(ttl_ms),
                    ..OpValue::default()
                };
                let step =
                    shared.attempt(&mut process, planned.node, Function::Reserve, &value, ATTEMPTS);
                if let Step::Decided(reply) = step.await
                    && let Some(hold_id) = reply.hold_id
                    && end != HoldEnd::Lapse
                {
                    // Ended by a process of its own, so the worker goes on meanwhile.
                    let ending = HoldEnding { hold, hold_id, account, node: planned.node, end };
                    hold_ends.push(tokio::spawn(ending.run(shared.clone(), wait_ms)));
                }
            }
        }
    }
    for ending in hold_ends {
        // A panicked ending only leaves its hold to expire, which the checks allow.
        let _ = ending.await;
    }
    if healed.wait_for(|healed| *healed).await.is_err() {
        return unresolved.len();
    }
    let deadline = final_deadline.borrow().unwrap_or_else(tokio::time::Instant::now);
    while !unresolved.is_empty() && tokio::time::Instant::now() < deadline {
        let mut still = Vec::new();
        for transfer in unresolved {
            if let Some(left) = transfer.drive(&shared, &mut process, ATTEMPTS).await {
                still.push(left);
            }
        }
        unresolved = still;
    }
    unresolved.len()
}

/// Carries out the fault schedule; every fault ends (heals) before the next starts.
async fn nemesis_task(
    shared: std::sync::Arc<Shared>,
    clock: Clock,
    cluster: std::sync::Arc<tokio::sync::Mutex<Cluster>>,
    faults: Vec<ScheduledFault>,
    directory: PathBuf,
) {
    for (number, fault) in faults.into_iter().enumerate() {
        tokio::time::sleep_until(clock.start + Duration::from_millis(fault.start_ms)).await;
        let mut guard = cluster.lock().await;
        let count = guard.voters;
        let positions: Vec<usize> = match &fault.target {
            Target::One(position) => vec![*position],
            Target::Minority(positions) => positions.clone(),
            Target::All => (0..count).collect(),
            Target::Bridge(position) => vec![*position],
            Target::Ring(ring) => ring.clone(),
            Target::Leader => leader_position(&shared, &guard).await.into_iter().collect(),
        };
        let nodes: Vec<NodeId> =
            positions.iter().map(|position| guard.nodes[*position].id).collect();
        let record = |time_ns, phase, outcome, detail: Option<String>| NemesisRecord {
            time_ns,
            fault: number,
            phase,
            kind: fault.kind,
            target: fault.target.clone(),
            nodes: nodes.clone(),
            outcome,
            detail,
        };
        if positions.is_empty() {
            shared.recorder.nemesis(&record(
                shared.recorder.now_ns(),
                Phase::Start,
                FaultOutcome::Skipped,
                Some("no leader".into()),
            ));
            let now_ns = shared.recorder.now_ns();
            shared.recorder.nemesis(&record(now_ns, Phase::End, FaultOutcome::Skipped, None));
            continue;
        }
        let mut problems = Vec::new();
        if let Err(error) = install(&mut guard, &fault, &positions, true).await {
            problems.push(format!("{error:#}"));
        }
        // Stamped once the fault is in place...
        let installed_ns = shared.recorder.now_ns();
        let outcome = outcome_of(&problems);
        let mut detail = joined(&problems);
        let what = match (fault.clock_offset_s, fault.policy_edit) {
            (Some(offset_s), _) => Some(format!("wall clock {offset_s:+} s")),
            (None, Some(edit)) => Some(format!("policy {edit:?}")),
            (None, None) => None,
        };
        if let Some(what) = what {
            detail = Some(detail.map_or(what.clone(), |problems| format!("{what}; {problems}")));
        }
        shared.recorder.nemesis(&record(installed_ns, Phase::Start, outcome, detail));
        drop(guard);
        let until = tokio::time::Instant::now() + Duration::from_millis(fault.duration_ms);
        let mut toggles = 0_u64;
        let mut toggle_problems = Vec::new();
        if let Some(toggle_ms) = fault.kind.toggle_ms() {
            let toggle = Duration::from_millis(toggle_ms);
            let mut on = true;
            while tokio::time::Instant::now() + toggle < until {
                tokio::time::sleep(toggle).await;
                on = !on;
                toggles += 1;
                let mut guard = cluster.lock().await;
                if let Err(error) = install(&mut guard, &fault, &positions, on).await {
                    toggle_problems.push(format!("{error:#}"));
                }
            }
        }
        tokio::time::sleep_until(until).await;
        let mut guard = cluster.lock().await;
        // ...and its end when healing begins, so [start, end] is surely faulty.
        let healing_ns = shared.recorder.now_ns();
        let mut problems = toggle_problems;
        problems.extend(guard.heal().await);
        let mut detail = joined(&problems);
        if toggles > 0 {
            let what = format!("{toggles} toggles");
            detail = Some(detail.map_or(what.clone(), |problems| format!("{what}; {problems}")));
        }
        shared.recorder.nemesis(&record(healing_ns, Phase::End, outcome_of(&problems), detail));
        // The exported drift bound grows while circuits are open: look right after a fault.
        snapshot_metrics(&guard, &directory, &format!("fault-{number}")).await;
    }
}

/// Puts `fault` in place on the nodes at `positions` (`on`), or, for the faults that
/// toggle, takes it away (`!on`) while the fault lasts. Every other undoing is `heal`'s.
async fn install(
    cluster: &mut Cluster,
    fault: &ScheduledFault,
    positions: &[usize],
    on: bool,
) -> anyhow::Result<()> {
    let count = cluster.voters;
    let mut problems = Vec::new();
    match fault.kind {
        FaultKind::Partition | FaultKind::PartitionFlap if on => {
            cluster.partition(&nemesis::cut_links(&fault.target, positions, count)).await?;
        }
        FaultKind::PartitionOneWay => {
            let links = nemesis::one_way_links(&fault.target, positions, count);
            cluster.partition_one_way(&links).await?;
        }
        FaultKind::Partition | FaultKind::PartitionFlap => cluster.heal_partitions().await?,
        FaultKind::MajoritiesRing => {
            let Target::Ring(ring) = &fault.target else {
                anyhow::bail!("a majorities ring without its ring order");
            };
            cluster.partition_one_way(&nemesis::majorities_ring_links(ring)).await?;
        }
        FaultKind::Kill
        | FaultKind::Pause
        | FaultKind::Clock
        | FaultKind::ClockStep
        | FaultKind::Policy
        | FaultKind::Membership
        | FaultKind::Disk => {
            for position in positions {
                let result = match fault.kind {
                    FaultKind::Kill => cluster.kill(*position).await,
                    FaultKind::Pause => cluster.pause(*position).await,
                    FaultKind::Clock | FaultKind::ClockStep => {
                        let offset_s = if on { fault.clock_offset_s.unwrap_or(0) } else { 0 };
                        cluster.set_clock(*position, offset_s)
                    }
                    FaultKind::Policy => cluster.edit_policy(
                        *position,
                        fault.policy_edit.unwrap_or(nemesis::PolicyEdit::ExtraRule),
                    ),
                    FaultKind::Disk => cluster.fill_disk(*position),
                    _ => cluster.remove_voter(*position).await,
                };
                if let Err(error) = result {
                    problems.push(format!("{error:#}"));
                }
            }
        }
    }
    match joined(&problems) {
        Some(problems) => Err(anyhow::anyhow!(problems)),
        None => Ok(()),
    }
}

fn outcome_of(problems: &[String]) -> FaultOutcome {
    if problems.is_empty() { FaultOutcome::Installed } else { FaultOutcome::Indeterminate }
}

fn joined(problems: &[String]) -> Option<String> {
    (!problems.is_empty()).then(|| problems.join("; "))
}

/// The position of the billing leader, as the first running, unpaused node that answers names it.
async fn leader_position(shared: &Shared, cluster: &Cluster) -> Option<usize> {
    for (position, node) in cluster.nodes[..cluster.voters].iter().enumerate() {
        if !node.running() || node.paused() {
            continue;
        }
        if let Ok(Some(leader)) =
            tokio::time::timeout(PROBE_TIMEOUT, shared.clients.billing.leader_seen_by(position))
                .await
        {
            return cluster.nodes.iter().position(|candidate| candidate.id.0 == leader);
        }
    }
    None
}

/// Waits until some node names a billing leader.
async fn wait_for_leader(clients: &BillingNodes, within: Duration) -> anyhow::Result<u64> {
    let deadline = Instant::now() + within;
    loop {
        for position in 0..clients.len() {
            if let Some(leader) = clients.leader_seen_by(position).await {
                return Ok(leader);
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "no billing leader within {within:?}");
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// Opens and funds every account, retrying each key until it is decided.
async fn open_accounts(shared: &Shared, options: &BankOptions) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETUP_WAIT;
    let mut process = shared.fresh_process();
    for position in 0..options.accounts {
        let account = bank::account_name(position);
        let steps = [
            (Function::CreateAccount, options.floor, bank::create_key(&account)),
            (Function::Credit, options.initial_balance, bank::fund_key(&account)),
        ];
        for (f, amount, key) in steps {
            let value = OpValue {
                account: account.clone(),
                amount: Some(amount),
                key: Some(key),
                ..OpValue::default()
            };
            loop {
                if let Step::Decided(_) =
                    shared.attempt(&mut process, position, f, &value, ATTEMPTS).await
                {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "could not open {account} within {SETUP_WAIT:?}"
                );
            }
        }
    }
    Ok(())
}

/// Saves every running node's metrics as `metrics/node-N-<label>.prom`.
async fn snapshot_metrics(cluster: &Cluster, directory: &Path, label: &str) {
    let metrics = directory.join("metrics");
    if std::fs::create_dir_all(&metrics).is_err() {
        return;
    }
    for (position, node) in cluster.nodes.iter().enumerate() {
        if let Ok(text) = cluster.metrics(position).await {
            let _ = std::fs::write(metrics.join(format!("node-{}-{label}.prom", node.id.0)), text);
        }
    }
}

/// Runs once into a fresh directory under `out`; returns the directory and the verdict.
///
/// # Errors
/// The run directory cannot be written or the cluster cannot be started; failures after
/// that end in an `unknown` verdict instead.
pub async fn run(options: RunOptions, out: &Path) -> anyhow::Result<(PathBuf, Verdict)> {
    let started_unix_ms = unix_ms();
    let directory =
        out.join(format!("{}-seed{}-{started_unix_ms}", options.workload.name(), options.seed));
    std::fs::create_dir_all(&directory)
        .with_context(|| format!("create {}", directory.display()))?;
    let bank = bank_options(&options);
    let rls = rls_options(&options);
    let lease_shape = lease_options(&options);
    let plan = schedule(&options);
    let record = RunRecord {
        options: options.clone(),
        bank: bank.clone(),
        rls: rls.clone(),
        leases: Some(lease_shape.clone()),
        started_unix_ms,
    };
    std::fs::write(directory.join("run.json"), serde_json::to_vec_pretty(&record)?)?;
    std::fs::write(directory.join("schedule.json"), serde_json::to_vec_pretty(&plan)?)?;

    // The bank needs no policy, but a policy fault needs a file to rewrite.
    let policy = match options.workload {
        WorkloadKind::Leases => Some(lease_shape.policy_yaml()),
        WorkloadKind::Rls => Some(rls.policy_yaml()),
        _ => options.nemeses.contains(&FaultKind::Policy).then(|| rls.policy_yaml()),
    };
    let cluster = Cluster::start(
        &options.binary,
        &directory,
        Shape { voters: options.pacing.nodes, gateways: options.gateways },
        options.topology,
        policy.as_deref(),
        &options.nemeses,
        &options.image,
    )
    .await?;
    let voters = &cluster.nodes[..cluster.voters];
    let billing: Vec<String> = voters.iter().map(|node| node.billing_addr.clone()).collect();
    let rls_addrs: Vec<String> = cluster.nodes.iter().map(|node| node.rls_addr.clone()).collect();
    let admin_addrs: Vec<String> =
        cluster.nodes.iter().map(|node| node.admin_addr.clone()).collect();
    let clients = Clients::new(
        &billing,
        &rls_addrs,
        &admin_addrs,
        &cluster.tokens.billing,
        &cluster.tokens.admin,
    )?;
    let cluster = std::sync::Arc::new(tokio::sync::Mutex::new(cluster));
    let rule_keys = rls.rules.iter().map(|rule| rule.key.clone()).collect();
    let outcome = drive(
        &options,
        &bank,
        (rule_keys, lease_shape.lease_ttl_ms),
        plan,
        &directory,
        clients,
        &cluster,
    )
    .await;
    let mut cluster = cluster.lock().await;
    snapshot_metrics(&cluster, &directory, "final").await;
    cluster.shutdown().await;
    drop(cluster);
    let verdict = match outcome {
        Ok(()) => check_directory(&directory)?,
        Err(error) => {
            let mut harness = CheckResult::new("harness");
            harness.unknown(format!("{error:#}"));
            Verdict::of(vec![harness])
        }
    };
    write_verdict(&directory, &verdict)?;
    Ok((directory, verdict))
}

/// The run between a started cluster and its shutdown.
async fn drive(
    options: &RunOptions,
    bank: &BankOptions,
    (rule_keys, lease_ttl_ms): (Vec<String>, u64),
    plan: Schedule,
    directory: &Path,
    clients: Clients,
    cluster: &std::sync::Arc<tokio::sync::Mutex<Cluster>>,
) -> anyhow::Result<()> {
    wait_for_leader(&clients.billing, LEADER_WAIT).await?;
    let shared = std::sync::Arc::new(Shared {
        recorder: Recorder {
            epoch: Instant::now(),
            history: Mutex::new((0, JsonlWriter::create(&directory.join("history.jsonl"))?)),
            nemesis: Mutex::new(JsonlWriter::create(&directory.join("nemesis.jsonl"))?),
        },
        clients,
        next_process: AtomicU64::new(0),
        rule_keys,
        lease_ttl_ms,
    });
    if options.workload.is_billing() {
        open_accounts(&shared, bank).await?;
    }
    snapshot_metrics(&*cluster.lock().await, directory, "start").await;
    let (stop_reading, reading_stopped) = tokio::sync::watch::channel(false);
    let ledger_reader = if options.workload.leases() {
        let writer = JsonlWriter::create(&directory.join("ledger.jsonl"))?;
        Some(tokio::spawn(read_ledger(shared.clone(), writer, reading_stopped)))
    } else {
        None
    };
    // The workload's clock starts once the accounts are open.
    let clock = Clock {
        start: tokio::time::Instant::now(),
        time_limit: Duration::from_millis(options.pacing.time_limit_ms),
    };
    let (healed_sender, healed) = tokio::sync::watch::channel(false);
    let (deadline_sender, final_deadline) = tokio::sync::watch::channel(None);
    let workers: Vec<_> = plan
        .operations
        .into_iter()
        .map(|ops| {
            tokio::spawn(worker(shared.clone(), clock, ops, healed.clone(), final_deadline.clone()))
        })
        .collect();
    let nemesis = tokio::spawn(nemesis_task(
        shared.clone(),
        clock,
        cluster.clone(),
        plan.faults,
        directory.to_owned(),
    ));
    tokio::time::sleep_until(clock.start + clock.time_limit).await;
    nemesis.await.context("the nemesis task panicked")?;
    let problems = cluster.lock().await.heal().await;
    anyhow::ensure!(problems.is_empty(), "healing failed: {}", problems.join("; "));
    wait_for_leader(&shared.clients.billing, LEADER_WAIT).await?;
    let deadline = tokio::time::Instant::now() + FINAL_WAIT;
    deadline_sender.send_replace(Some(deadline));
    healed_sender.send_replace(true);
    let mut unresolved = 0;
    for handle in workers {
        unresolved += handle.await.context("a worker panicked")?;
    }
    if unresolved > 0 {
        eprintln!("quotamesh-jepsen: {unresolved} transfers left unresolved after healing");
    }
    if options.workload.is_billing() {
        final_reads(&shared, bank, directory).await?;
    }
    let replicas = replica_states(&shared.clients, directory).await;
    stop_reading.send_replace(true);
    if let Some(reader) = ledger_reader {
        reader.await.context("the ledger reader panicked")?;
    }
    replicas
}

/// Reads the quota ledger's keys from each voter in turn every [`LEDGER_READ_INTERVAL`]
/// into `ledger.jsonl` until told to stop, then once more from every voter (the final
/// state). A node that does not answer is skipped.
async fn read_ledger(
    shared: std::sync::Arc<Shared>,
    mut writer: JsonlWriter,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let voters = shared.clients.len();
    let mut write = |sample: Option<crate::history::LedgerSample>| {
        if let Some(sample) = sample
            && let Err(error) = writer.write(&sample)
        {
            eprintln!("quotamesh-jepsen: {error}");
        }
    };
    let now_ns = || shared.recorder.now_ns();
    for position in (0..voters.max(1)).cycle() {
        if *stop.borrow() {
            break;
        }
        write(shared.clients.ledger_sample(position, now_ns).await);
        tokio::select! {
            changed = stop.changed() => {
                if changed.is_err() {
                    // The run ended without the final phase: no final reads.
                    return;
                }
            }
            () = tokio::time::sleep(LEDGER_READ_INTERVAL) => {}
        }
    }
    for position in 0..voters {
        write(shared.clients.ledger_sample(position, now_ns).await);
    }
}

/// Waits (to the final phase's deadline) until every node reports each group at one
/// applied index, and writes what they report last to `replicas.json`.
async fn replica_states(clients: &Clients, directory: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + FINAL_WAIT;
    loop {
        let mut states = Vec::new();
        for position in 0..clients.len() {
            states.extend(clients.replica_states(position).await);
        }
        let converged = states.iter().all(|state| {
            state.applied_index.is_some()
                && states
                    .iter()
                    .filter(|other| other.group == state.group)
                    .all(|other| other.applied_index == state.applied_index)
        });
        if converged || Instant::now() > deadline {
            std::fs::write(directory.join("replicas.json"), serde_json::to_vec_pretty(&states)?)?;
            return Ok(());
        }
        tokio::time::sleep(RETRY_PAUSE).await;
    }
}

/// Reads every account through every node, then every node's trail (retried until the
/// final phase's deadline).
async fn final_reads(shared: &Shared, bank: &BankOptions, directory: &Path) -> anyhow::Result<()> {
    let mut process = shared.fresh_process();
    for position in 0..shared.clients.len() {
        for account in 0..bank.accounts {
            let value = OpValue { account: bank::account_name(account), ..OpValue::default() };
            shared.operation(&mut process, position, Function::Read, value).await;
        }
    }
    let deadline = Instant::now() + FINAL_WAIT;
    for position in 0..shared.clients.len() {
        let trail = loop {
            match shared.clients.billing.trail(position).await {
                Ok(trail) => break trail,
                Err(error) if Instant::now() > deadline => {
                    return Err(error.context(format!("read node {}'s trail", position + 1)));
                }
                Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
            }
        };
        let mut writer =
            JsonlWriter::create(&directory.join(format!("trail-node-{}.jsonl", position + 1)))?;
        for entry in &trail {
            writer.write(entry)?;
        }
    }
    Ok(())
}

/// Checks a run's directory from its files (what `check` does).
///
/// # Errors
/// `run.json` cannot be read; a missing or broken history makes the verdict unknown.
pub fn check_directory(directory: &Path) -> anyhow::Result<Verdict> {
    let record: RunRecord = serde_json::from_slice(
        &std::fs::read(directory.join("run.json"))
            .with_context(|| format!("read {}/run.json", directory.display()))?,
    )?;
    let events: Vec<Event> = match read_jsonl(&directory.join("history.jsonl")) {
        Ok(events) => events,
        Err(error) => {
            let mut harness = CheckResult::new("history");
            harness.unknown(error.to_string());
            return Ok(Verdict::of(vec![harness]));
        }
    };
    let replicas: Vec<checker::replicas::ReplicaState> =
        std::fs::read(directory.join("replicas.json"))
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
    let faults: Vec<NemesisRecord> =
        read_jsonl(&directory.join("nemesis.jsonl")).unwrap_or_default();
    let mut checks = vec![
        checker::well_formed::check(&events),
        checker::replicas::check(&replicas),
        checker::availability::check(&events, &faults, record.options.availability),
    ];
    match record.options.workload {
        WorkloadKind::Bank | WorkloadKind::Linear => {
            checks.extend(check_bank(directory, &record, &events));
            checks.push(checker::fail_closed::check(&events, &faults, record.options.pacing.nodes));
            checks.push(checker::linearizable::check(
                &events,
                checker::linearizable::STEPS_PER_ACCOUNT_MAX,
            ));
        }
        WorkloadKind::Holds => {
            let (trails, mut read) = read_trails(directory, record.options.pacing.nodes);
            read.push(checker::bank::trails_agree(&trails));
            if let Some((_, trail)) = trails.first() {
                let model = checker::holds::HoldsModel { floor: record.bank.floor };
                read.extend(checker::holds::check(&events, trail, &model));
            }
            checks.extend(read);
            checks.push(checker::fail_closed::check(&events, &faults, record.options.pacing.nodes));
        }
        WorkloadKind::Rls => checks.extend(check_rls(directory, &record, &events)),
        WorkloadKind::Leases => {
            // Runs saved before the shape was: its defaults (only the bucket is read here).
            let shape =
                record.leases.clone().unwrap_or_else(|| LeaseOptions::new(record.options.pacing));
            let model = checker::leases::LeaseModel {
                capacity_tokens: shape.burst_tokens,
                rate_per_second: shape.limit_per_second,
            };
            checks.extend(checker::leases::check(&events, model));
            checks.push(checker::leases::check_totals(&read_ledger_samples(directory), model));
            checks.push(checker::fail_closed::check(&events, &faults, record.options.pacing.nodes));
        }
    }
    Ok(Verdict::of(checks))
}

/// Every node's saved trail, and the `trails-read` check (in a vector the caller extends).
fn read_trails(
    directory: &Path,
    nodes: usize,
) -> (Vec<(NodeId, Vec<TrailEntry>)>, Vec<CheckResult>) {
    let mut trails: Vec<(NodeId, Vec<TrailEntry>)> = Vec::new();
    let mut missing = CheckResult::new("trails-read");
    for id in 1..=nodes as u64 {
        match read_jsonl(&directory.join(format!("trail-node-{id}.jsonl"))) {
            Ok(trail) => trails.push((NodeId(id), trail)),
            Err(error) => missing.unknown(error.to_string()),
        }
        missing.checked += 1;
    }
    (trails, vec![missing])
}

fn check_bank(directory: &Path, record: &RunRecord, events: &[Event]) -> Vec<CheckResult> {
    let (trails, mut checks) = read_trails(directory, record.options.pacing.nodes);
    let model = checker::bank::BankModel {
        accounts: (0..record.bank.accounts).map(bank::account_name).collect(),
        floor: record.bank.floor,
    };
    checks.extend(checker::bank::check(events, &trails, &model));
    checks
}

/// Every interval of this length is checked for over-admission.
const RLS_WINDOW_MS: u64 = 1_000;

fn check_rls(directory: &Path, record: &RunRecord, events: &[Event]) -> Vec<CheckResult> {
    let snapshots: Vec<String> = std::fs::read_dir(directory.join("metrics"))
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
                .collect()
        })
        .unwrap_or_default();
    let options = &record.rls;
    let rules: Vec<checker::rls::RuleModel> = options
        .rules
        .iter()
        .map(|rule| checker::rls::RuleModel {
            key: rule.key.clone(),
            capacity_tokens: options.burst_tokens,
            rate_per_second: options.limit_per_second,
            fail_open: rule.fail_open,
            fallback_multiplier_permille: options.fallback_multiplier_permille,
            drift_bound_tokens: checker::rls::drift_bound_from_metrics(
                &snapshots,
                rls::DOMAIN,
                &rule.key,
            ),
        })
        .collect();
    let mut checks = checker::rls::check(events, &rules, RLS_WINDOW_MS);
    let model = checker::leases::LeaseModel {
        capacity_tokens: options.burst_tokens,
        rate_per_second: options.limit_per_second,
    };
    checks.push(checker::leases::check_totals(&read_ledger_samples(directory), model));
    checks
}

/// The ledger reads of a run (`ledger.jsonl`); none for a run saved before they were taken,
/// which `lease-totals` then cannot judge.
fn read_ledger_samples(directory: &Path) -> Vec<crate::history::LedgerSample> {
    read_jsonl(&directory.join("ledger.jsonl")).unwrap_or_default()
}

/// Writes `verdict.json`, `report.md` and `report.html`.
///
/// # Errors
/// The files cannot be written, the run's records read, or a plot drawn.
pub fn write_verdict(directory: &Path, verdict: &Verdict) -> anyhow::Result<()> {
    std::fs::write(directory.join("verdict.json"), serde_json::to_vec_pretty(verdict)?)?;
    let report = crate::report::render(directory)?;
    std::fs::write(directory.join("report.md"), report)?;
    std::fs::write(directory.join("report.html"), crate::html::render(directory)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(seed: u64) -> RunOptions {
        RunOptions {
            topology: Topology::Local,
            pacing: Pacing::new(3, 200, 60_000),
            gateways: 0,
            workload: WorkloadKind::Bank,
            nemeses: vec![FaultKind::Kill, FaultKind::Pause],
            seed,
            binary: PathBuf::from("quotamesh"),
            image: IMAGE_DEFAULT.to_owned(),
            availability: checker::availability::THRESHOLDS_DEFAULT,
        }
    }

    /// The same seed plans the same operations and faults, byte for byte as written to
    /// `schedule.json`; another seed plans others.
    #[test]
    fn same_seed_same_schedule() {
        let first = serde_json::to_string(&schedule(&options(42))).expect("serializable");
        let second = serde_json::to_string(&schedule(&options(42))).expect("serializable");
        assert_eq!(first, second);
        assert_ne!(first, serde_json::to_string(&schedule(&options(7))).expect("serializable"));
        let planned = schedule(&options(42));
        assert!(!planned.faults.is_empty());
        assert!(planned.operations.iter().map(Vec::len).sum::<usize>() > 10_000);
    }
}

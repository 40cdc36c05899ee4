//! The health of a node's Raft groups: one watch task per group that exports its Prometheus
//! series, keeps the view `/readyz` judges (`crate::core::readiness`), and reports a group
//! whose openraft core quit on an error (a storage failure: ENOSPC, EIO) so the node stops.
//!
//! ```text
//!  every WATCH_INTERVAL, per group:
//!    openraft metrics + committed index ──▶ gauges (term, leader, role, indexes, lag)
//!                                       └─▶ GroupView for /readyz
//!    core quit on an error ──▶ storage_errors_total, GroupView.stopped
//!                          └─▶ Failures::report ──▶ `quotamesh serve` shuts the node down
//!                                                   and exits non-zero (crash-only: its
//!                                                   supervisor restarts it from durable state)
//! ```
//!
//! A live process with a dead group would answer every call "stopped" while looking healthy;
//! restarting from the durable log and snapshot is the one recovery path Raft already proves
//! correct, so the node does not try to revive a group in place.

use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;
use openraft::error::Fatal;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::core::readiness::GroupView;
use crate::ledger::{GroupConfig, NodeId, RaftGroup};
use crate::metrics::Metrics;

/// How often a group's view and series are refreshed.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(250);
/// Longest the committed-index query may take; a core that does not answer within it is
/// treated as knowing nothing committed (and the view shows it as behind, not ready).
const COMMITTED_QUERY_TIMEOUT: Duration = Duration::from_secs(1);
/// The role label values of `quotamesh_raft_role`.
const ROLES: [&str; 5] = ["leader", "follower", "candidate", "learner", "shutdown"];

/// The first group failure of a node, shared by its groups' watch tasks; cheap to clone.
#[derive(Clone)]
pub struct Failures {
    sender: Arc<watch::Sender<Option<String>>>,
}

impl Default for Failures {
    fn default() -> Self {
        Self { sender: Arc::new(watch::channel(None).0) }
    }
}

impl Failures {
    fn report(&self, failure: String) {
        self.sender.send_if_modified(|first| {
            if first.is_some() {
                return false;
            }
            *first = Some(failure);
            true
        });
    }

    /// Resolves with the first failure: which group stopped, and why.
    pub async fn first(&self) -> String {
        let mut receiver = self.sender.subscribe();
        match receiver.wait_for(Option::is_some).await {
            Ok(failure) => failure.clone().unwrap_or_default(),
            // The sender lives in `self`: the channel cannot close while this waits.
            Err(_) => std::future::pending().await,
        }
    }
}

/// The latest views of a node's groups, for `/readyz`; cheap to clone.
#[derive(Clone, Default)]
pub struct GroupViews {
    views: Arc<Mutex<Vec<GroupView>>>,
}

impl GroupViews {
    /// Views of the groups `names`, each unready (no leader known) until first watched.
    pub fn expecting(names: &[&'static str]) -> Self {
        let views = names
            .iter()
            .map(|group| GroupView {
                group,
                member: true,
                stopped: None,
                leader: None,
                applied_index: None,
                committed_index: None,
            })
            .collect();
        Self { views: Arc::new(Mutex::new(views)) }
    }

    /// Every group's latest view, in the order they were watched.
    pub fn snapshot(&self) -> Vec<GroupView> {
        self.views.lock().clone()
    }

    fn update(&self, view: GroupView) {
        let mut views = self.views.lock();
        match views.iter_mut().find(|known| known.group == view.group) {
            Some(known) => *known = view,
            None => views.push(view),
        }
    }
}

/// Watches `group` (named `name`) until `stop` is raised: exports its series into
/// `metrics`, keeps its view in `views`, and reports a core that quit on an error.
pub fn watch_group<C: GroupConfig>(
    name: &'static str,
    group: RaftGroup<C>,
    metrics: Metrics,
    views: GroupViews,
    failures: Failures,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(WATCH_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut reported = false;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
            let view = observe(name, &group, &metrics).await;
            if let Some(reason) = &view.stopped
                && !reported
            {
                reported = true;
                metrics.raft_storage_errors.with_label_values(&[name]).inc();
                tracing::error!(group = name, %reason, "the Raft group stopped on an error; the node shuts down so that it restarts from its durable state");
                failures.report(format!("the {name} Raft group stopped: {reason}"));
            }
            views.update(view);
        }
    })
}

/// One look at a group: its view, and its series set from it.
async fn observe<C: GroupConfig>(
    name: &'static str,
    group: &RaftGroup<C>,
    metrics: &Metrics,
) -> GroupView {
    let raft = group.metrics();
    let stopped = match &raft.running_state {
        Err(Fatal::Stopped) | Ok(()) => None,
        Err(fatal) => Some(fatal.to_string()),
    };
    let committed_index = if stopped.is_none() {
        tokio::time::timeout(COMMITTED_QUERY_TIMEOUT, group.committed_index())
            .await
            .ok()
            .and_then(Result::ok)
            .flatten()
    } else {
        None
    };
    let gauge = |vec: &prometheus::IntGaugeVec, value: Option<u64>| {
        vec.with_label_values(&[name])
            .set(value.map_or(-1, |v| i64::try_from(v).unwrap_or(i64::MAX)));
    };
    gauge(&metrics.raft_term, Some(raft.current_term));
    gauge(&metrics.raft_leader_id, raft.current_leader.map(|id| id.0));
    gauge(&metrics.raft_last_log_index, raft.last_log_index);
    gauge(&metrics.raft_committed_index, committed_index);
    gauge(&metrics.raft_applied_index, raft.last_applied.map(|id| id.index));
    gauge(&metrics.raft_snapshot_index, raft.snapshot.map(|id| id.index));
    let role = match raft.state {
        ServerState::Leader => "leader",
        ServerState::Follower => "follower",
        ServerState::Candidate => "candidate",
        ServerState::Learner => "learner",
        ServerState::Shutdown => "shutdown",
    };
    for each in ROLES {
        metrics.raft_role.with_label_values(&[name, each]).set(i64::from(each == role));
    }
    if let Some(replication) = &raft.replication {
        let last = raft.last_log_index.unwrap_or(0);
        for (follower, matched) in replication.iter().filter(|(id, _)| **id != raft.id) {
            let lag = last.saturating_sub(matched.map_or(0, |log_id| log_id.index));
            metrics
                .raft_replication_lag
                .with_label_values(&[name, &follower.to_string()])
                .set(i64::try_from(lag).unwrap_or(i64::MAX));
        }
    }
    GroupView {
        group: name,
        member: group.is_member(),
        stopped,
        leader: raft.current_leader.map(|id: NodeId| id.0),
        applied_index: raft.last_applied.map(|id| id.index),
        committed_index,
    }
}

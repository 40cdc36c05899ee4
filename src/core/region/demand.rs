//! A region's demand on one sliced limit, measured over the observation window from samples
//! of an ever-growing count of offered hits (admitted and refused alike): the number the
//! planner (`plan.rs`) calls `demand_tokens`.
//!
//! The rebalancer samples the count on each tick; this file keeps the samples of the last
//! window (at most [`DEMAND_SAMPLES_MAX`]) and answers the hits offered since the newest
//! sample at least a window old, scaled to one window of the limit. Before a whole window
//! has passed, the hits seen so far are scaled over the whole window, so demand is never
//! overstated while it is still being measured. It reads no clock: `now_ms` comes in.
//!
//! The count is region-wide ([`OfferedHits`]): every node of the region, voters and
//! gateways, reports its own ever-growing count of hits offered on each sliced limit to
//! the region's quota ledger once per rebalance interval (`crate::slice_follow`), and the
//! ledger adds up what each node's count grew by. So the leader's rebalancer measures what
//! the whole region was offered, not what its own RLS saw.
//!
//! ```text
//!  node n, each interval: Demand{n, [(limit, n's hits_total)]} ──Raft──▶ ledger:
//!      OfferedHits[limit] += n's count - n's last count   (the count itself after a restart)
//!  leader's rebalancer, each tick: OfferedHits[limit].hits_total ──▶ DemandWindow ──▶ demand
//! ```

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::plan::demand_per_window;
use crate::core::ledger::NodeId;

/// Most nodes whose counts the ledger keeps per sliced limit: more than a region runs (its
/// voters and gateways); beyond it, the node heard from least recently is forgotten, and
/// its next report is a first one again (a baseline: one interval of its hits uncounted).
pub const REPORTING_NODES_MAX: usize = 64;

/// Most samples one window keeps: with the default tick (1 s) and window (20 s), 21 are
/// needed; with a finer tick, the oldest are dropped and the window shortens to what is kept.
pub const DEMAND_SAMPLES_MAX: usize = 256;

/// Samples of one count of offered hits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DemandWindow {
    /// `(time, count)` pairs, oldest first, time and count never decreasing.
    samples: VecDeque<(u64, u64)>,
}

impl DemandWindow {
    /// Records the count `hits_total` seen at `now_ms` and returns the demand over the last
    /// `observe_ms`, in tokens per `window_ms`. A count or time that went backwards (a
    /// counter reset, a clock step) restarts the measurement.
    pub fn sample(&mut self, now_ms: u64, hits_total: u64, observe_ms: u64, window_ms: u64) -> u64 {
        if self.samples.back().is_some_and(|(at_ms, count)| *at_ms > now_ms || *count > hits_total)
        {
            self.samples.clear();
        }
        self.samples.push_back((now_ms, hits_total));
        // Keep the newest sample at least a window old as the baseline, drop older ones.
        let window_start_ms = now_ms.saturating_sub(observe_ms);
        while self.samples.len() >= 2 && self.samples[1].0 <= window_start_ms {
            self.samples.pop_front();
        }
        while self.samples.len() > DEMAND_SAMPLES_MAX {
            self.samples.pop_front();
        }
        let (_, baseline) = self.samples.front().copied().expect("a sample was just pushed");
        demand_per_window(hits_total - baseline, observe_ms, window_ms)
    }
}

/// One node's last report on one sliced limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
struct NodeCount {
    /// The node's own count of offered hits, as last reported.
    hits_total: u64,
    /// Ledger time of that report.
    reported_at_ms: u64,
}

/// The region's count of hits offered on one sliced limit, from every node's reports: what
/// the leader's [`DemandWindow`] samples. Lives in the quota ledger (`transfer.rs`), so
/// every replica counts alike and a new leader reads where the last one left off.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OfferedHits {
    /// Hits offered region-wide since the ledger began counting; never decreases.
    hits_total: u64,
    /// Each reporting node's last report (at most [`REPORTING_NODES_MAX`]).
    nodes: BTreeMap<NodeId, NodeCount>,
}

impl OfferedHits {
    /// The region-wide count: the sum of what every node's count grew by between its
    /// reports.
    #[must_use]
    pub fn hits_total(&self) -> u64 {
        self.hits_total
    }

    /// Records that `node` counted `node_hits_total` offered hits by ledger time `now_ms`.
    /// A node's first report is a baseline only (its hits before it fell in no window this
    /// ledger measured); a count below the node's last one is a restarted node counting
    /// from 0, whose hits since the restart are all new.
    pub fn record(&mut self, node: NodeId, node_hits_total: u64, now_ms: u64) {
        let report = NodeCount { hits_total: node_hits_total, reported_at_ms: now_ms };
        if let Some(last) = self.nodes.get_mut(&node) {
            let added = node_hits_total.checked_sub(last.hits_total).unwrap_or(node_hits_total);
            self.hits_total = self.hits_total.saturating_add(added);
            *last = report;
            return;
        }
        if self.nodes.len() >= REPORTING_NODES_MAX
            && let Some(stalest) = self
                .nodes
                .iter()
                .min_by_key(|(id, count)| (count.reported_at_ms, **id))
                .map(|(id, _)| *id)
        {
            self.nodes.remove(&stalest);
        }
        self.nodes.insert(node, report);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The naive region-wide count: every node's whole history of reports, each growth
    /// between two consecutive reports of a node added (a drop counted as a restart from 0).
    fn offered_model(reports: &[(u64, u64)]) -> u64 {
        let mut last: BTreeMap<u64, u64> = BTreeMap::new();
        let mut total = 0_u64;
        for (node, count) in reports {
            if let Some(previous) = last.insert(*node, *count) {
                total += if *count >= previous { count - previous } else { *count };
            }
        }
        total
    }

    proptest! {
        /// With no more nodes than the ledger keeps, the region-wide count is the model's:
        /// each node's growth counted once, restarts included, first reports as baselines.
        #[test]
        fn offered_hits_add_up_every_node_like_the_model(
            steps in prop::collection::vec((0_u64..8, 0_u64..1_000, any::<bool>()), 1..200),
        ) {
            let mut offered = OfferedHits::default();
            let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
            let mut reports = Vec::new();
            for (now_ms, (node, hits, restart)) in (0_u64..).zip(steps) {
                let count = counts.entry(node).or_default();
                *count = if restart { hits } else { *count + hits };
                reports.push((node, *count));
                let before = offered.hits_total();
                offered.record(NodeId(node), *count, now_ms);
                prop_assert!(offered.hits_total() >= before, "the count never decreases");
                prop_assert_eq!(offered.hits_total(), offered_model(&reports));
            }
        }

        /// However many nodes report, the ledger keeps at most `REPORTING_NODES_MAX`, and
        /// the count never exceeds the model's (a forgotten node only loses hits).
        #[test]
        fn offered_hits_stay_bounded(
            steps in prop::collection::vec((0_u64..200, 0_u64..1_000), 1..400),
        ) {
            let mut offered = OfferedHits::default();
            let mut counts: BTreeMap<u64, u64> = BTreeMap::new();
            let mut reports = Vec::new();
            for (now_ms, (node, hits)) in (0_u64..).zip(steps) {
                let count = counts.entry(node).or_default();
                *count += hits;
                reports.push((node, *count));
                offered.record(NodeId(node), *count, now_ms);
                prop_assert!(offered.nodes.len() <= REPORTING_NODES_MAX);
                prop_assert!(offered.hits_total() <= offered_model(&reports));
            }
        }
    }

    /// Against a model that keeps every sample: the hits since the newest sample at least a
    /// window old (the first sample when none is), scaled by `demand_per_window`.
    fn model(samples: &[(u64, u64)], observe_ms: u64, window_ms: u64) -> u64 {
        let (now_ms, count) = *samples.last().expect("one sample at least");
        let start_ms = now_ms.saturating_sub(observe_ms);
        let baseline = samples
            .iter()
            .rev()
            .find(|(at_ms, _)| *at_ms <= start_ms)
            .or(samples.first())
            .map_or(0, |(_, count)| *count);
        demand_per_window(count - baseline, observe_ms, window_ms)
    }

    proptest! {
        /// With time and count growing, the window answers as the model that keeps every
        /// sample, while it keeps few enough.
        #[test]
        fn demand_matches_a_model_keeping_every_sample(
            steps in prop::collection::vec((1_u64..3_000, 0_u64..500), 1..80),
            observe_ms in 1_u64..40_000,
            window_ms in 1_u64..120_000,
        ) {
            let mut window = DemandWindow::default();
            let mut samples = Vec::new();
            let (mut now_ms, mut count) = (0_u64, 0_u64);
            for (elapsed_ms, hits) in steps {
                now_ms += elapsed_ms;
                count += hits;
                samples.push((now_ms, count));
                let demand = window.sample(now_ms, count, observe_ms, window_ms);
                prop_assert_eq!(demand, model(&samples, observe_ms, window_ms));
                prop_assert!(window.samples.len() <= DEMAND_SAMPLES_MAX);
            }
        }
    }

    /// A count that went backwards (a restarted counter) starts the measurement again
    /// rather than underflowing; hits beyond the window no longer count.
    #[test]
    fn a_reset_count_restarts_and_old_hits_age_out() {
        let mut window = DemandWindow::default();
        assert_eq!(window.sample(0, 0, 10_000, 1_000), 0);
        assert_eq!(window.sample(1_000, 500, 10_000, 1_000), 50);
        assert_eq!(window.sample(2_000, 100, 10_000, 1_000), 0);
        assert_eq!(window.sample(3_000, 300, 10_000, 1_000), 20);
        assert_eq!(window.sample(30_000, 300, 10_000, 1_000), 0);
    }
}

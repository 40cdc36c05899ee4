//! How every node of a region, voters and gateways alike, takes part in the region's slices
//! of global limits (DESIGN section 5): it reports its own count of hits offered on each
//! sliced limit to the quota ledger, where the leader's rebalancer reads the region-wide sum
//! (`crate::core::region::demand`), and a gateway enforces the slices the ledger answers.
//!
//! ```text
//!  every rebalance interval, on every node with a sliced limit in its policy:
//!    ratelimit_total_hits{domain, path} of each sliced rule (this node's RLS)
//!      ── Demand{node, [(limit, hits_total)]} ──Raft write (a gateway's is forwarded)──▶
//!    ledger: OfferedHits += growth         ◀── Slices([(limit, tokens)])
//!    gateway: PolicyStore::follow_slices(the answer)   (a voter follows its own replica,
//!                                                       `crate::actors::rebalancer`)
//! ```
//!
//! A gateway holds no replica, so without the answer it would enforce the policy's shares
//! while the voters enforce the ledger's slices, and since a limit's numbers name its
//! ledger counter (`crate::core::lease_key`), it would lease from a bucket of its own. A
//! write that fails leaves the slices as they were; the next interval tries again. Each
//! report is one write per node and interval, bounded by the write timeout.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::actors::rebalancer::LEDGER_WRITE_TIMEOUT;
use crate::config::Role;
use crate::core::ledger::{NodeId, QuotaCommand, QuotaResponse};
use crate::core::region::transfer::{RegionCommand, RegionResponse, SLICED_RULES_MAX, SliceKey};
use crate::ledger::{QuotaGroup, RaftGroup};
use crate::metrics::Metrics;
use crate::policy_store::PolicyStore;

/// Reports one node's offered hits on sliced limits, and on a gateway follows the slices.
pub struct SliceFollower {
    /// This node.
    pub node_id: NodeId,
    /// A gateway follows the slices the ledger answers; a voter only reports.
    pub role: Role,
    /// The region's quota group (a gateway's writes are forwarded to its leader).
    pub group: RaftGroup<QuotaGroup>,
    /// The policy: which limits are sliced, and what RLS enforces.
    pub policy: Arc<PolicyStore>,
    /// Where this node's RLS counts offered hits.
    pub metrics: Metrics,
    /// How often to report: the rebalancer's interval.
    pub interval: Duration,
}

impl SliceFollower {
    /// Reports every `interval` until `shutdown` resolves.
    pub fn start(self, shutdown: impl Future<Output = ()> + Send + 'static) -> JoinHandle<()> {
        tokio::spawn(async move {
            tokio::pin!(shutdown);
            let mut ticks = tokio::time::interval(self.interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = &mut shutdown => return,
                    _ = ticks.tick() => self.report().await,
                }
            }
        })
    }

    /// This node's count of offered hits on each sliced limit of its policy.
    fn counts(&self) -> Vec<(SliceKey, u64)> {
        let mut hits = Vec::new();
        for rule in self.policy.global().rules() {
            if rule.regions.is_none() {
                continue;
            }
            // Upstream's total_hits under the rule's own path: every hit offered, admitted
            // or not, so a region held at its slice still shows what it would use.
            let hits_total = self
                .metrics
                .ratelimit_stats
                .total_hits
                .with_label_values(&[rule.domain.as_str(), rule.path.as_str()])
                .get();
            for index in 0..rule.limits.len() {
                if hits.len() >= SLICED_RULES_MAX {
                    return hits;
                }
                hits.push((SliceKey::of(&rule.domain, &rule.path, index), hits_total));
            }
        }
        hits
    }

    async fn report(&self) {
        let hits = self.counts();
        if hits.is_empty() {
            return;
        }
        let command = QuotaCommand::Region {
            now_ms: crate::clock::now_ms(),
            command: RegionCommand::Demand { node_id: self.node_id, hits },
        };
        match self.group.write(command, LEDGER_WRITE_TIMEOUT).await {
            Ok(QuotaResponse::Region(RegionResponse::Slices(slices))) => {
                if self.role == Role::Gateway {
                    self.policy.follow_slices(slices.into_iter().collect::<BTreeMap<_, _>>());
                }
            }
            Ok(other) => tracing::warn!(?other, "unexpected answer to a demand report"),
            Err(error) => tracing::debug!(%error, "demand report not written; next interval"),
        }
    }
}

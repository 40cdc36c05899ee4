//! The counter handles of the active policy's rules, resolved once per policy.
//!
//! A rule's labels (domain, path, statistics key) are fixed by the policy, so the RLS hot
//! path increments a resolved handle instead of hashing its labels into a `MetricVec` on
//! every request. A statistics key named by runtime values, and a request's own limit
//! override, still go through the vectors (`crate::api::rls`).

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use prometheus::IntCounter;

use crate::core::policy::{PolicySet, Rule, RuleId};
use crate::metrics::Metrics;

/// How `quotamesh_rls_descriptor_decisions_total` labels one descriptor's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescriptorCode {
    /// Admitted.
    Ok,
    /// Refused by a shadow rule: answered OK.
    ShadowOverLimit,
    /// Refused by a warn rule: answered OK with a warning.
    WarnOverLimit,
    /// Refused.
    OverLimit,
}

impl DescriptorCode {
    /// Every code, in the order of [`DescriptorCode::label`]'s index.
    const ALL: [Self; 4] = [Self::Ok, Self::ShadowOverLimit, Self::WarnOverLimit, Self::OverLimit];

    /// The metric's `code` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ShadowOverLimit => "shadow_over_limit",
            Self::WarnOverLimit => "warn_over_limit",
            Self::OverLimit => "over_limit",
        }
    }
}

/// Upstream's statistics of one rule under its own path.
pub struct StatsCounters {
    /// `quotamesh_ratelimit_total_hits_total`.
    pub total_hits: IntCounter,
    /// `quotamesh_ratelimit_over_limit_total`.
    pub over_limit: IntCounter,
    /// `quotamesh_ratelimit_near_limit_total`.
    pub near_limit: IntCounter,
    /// `quotamesh_ratelimit_within_limit_total`.
    pub within_limit: IntCounter,
    /// `quotamesh_ratelimit_shadow_mode_total`.
    pub shadow_mode: IntCounter,
}

/// One rule's counters.
pub struct RuleCounters {
    /// `quotamesh_rls_descriptor_decisions_total`, one per [`DescriptorCode`].
    decisions: [IntCounter; 4],
    /// `quotamesh_rls_warnings_total`.
    pub warnings: IntCounter,
    /// `quotamesh_rls_shadow_blocks_total`.
    pub shadow_blocks: IntCounter,
    /// Upstream's statistics under the rule's path (its key unless runtime values name it).
    pub stats: StatsCounters,
}

impl RuleCounters {
    fn of(metrics: &Metrics, rule: &Rule) -> Self {
        let rule_labels = [rule.domain.as_str(), rule.path.as_str()];
        let stats = &metrics.ratelimit_stats;
        Self {
            decisions: DescriptorCode::ALL.map(|code| {
                metrics.rls_descriptor_decisions.with_label_values(&[
                    rule.domain.as_str(),
                    rule.path.as_str(),
                    code.label(),
                ])
            }),
            warnings: metrics.rls_warnings.with_label_values(&rule_labels),
            shadow_blocks: metrics.rls_shadow_blocks.with_label_values(&rule_labels),
            stats: StatsCounters {
                total_hits: stats.total_hits.with_label_values(&rule_labels),
                over_limit: stats.over_limit.with_label_values(&rule_labels),
                near_limit: stats.near_limit.with_label_values(&rule_labels),
                within_limit: stats.within_limit.with_label_values(&rule_labels),
                shadow_mode: stats.shadow_mode.with_label_values(&rule_labels),
            },
        }
    }

    /// Counts one descriptor's decision.
    pub fn count_decision(&self, code: DescriptorCode) {
        let index = DescriptorCode::ALL.iter().position(|each| *each == code).unwrap_or(0);
        self.decisions[index].inc();
    }
}

/// The counters of one policy's rules, in [`RuleId`] order.
pub struct ResolvedRules {
    policy: Arc<PolicySet>,
    rules: Vec<RuleCounters>,
}

impl ResolvedRules {
    /// The counters of the rule `id` of the policy they were resolved for.
    pub fn rule(&self, id: RuleId) -> Option<&RuleCounters> {
        usize::try_from(id.0).ok().and_then(|index| self.rules.get(index))
    }
}

/// The active policy's rule counters, resolved again when the policy changes.
pub struct RuleMetrics {
    metrics: Metrics,
    resolved: ArcSwapOption<ResolvedRules>,
}

impl RuleMetrics {
    /// Nothing resolved yet: the first request resolves its policy's rules.
    pub fn new(metrics: Metrics) -> Self {
        Self { metrics, resolved: ArcSwapOption::empty() }
    }

    /// The counters of `policy`'s rules: those already resolved when `policy` is the one
    /// they were resolved for, else resolved now (once per policy change; two requests
    /// racing on a change both resolve, and the handles are the same counters).
    pub fn of(&self, policy: &Arc<PolicySet>) -> Arc<ResolvedRules> {
        if let Some(resolved) = self.resolved.load_full()
            && Arc::ptr_eq(&resolved.policy, policy)
        {
            return resolved;
        }
        let resolved = Arc::new(ResolvedRules {
            policy: Arc::clone(policy),
            rules: policy.rules().map(|rule| RuleCounters::of(&self.metrics, rule)).collect(),
        });
        self.resolved.store(Some(Arc::clone(&resolved)));
        resolved
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::PolicySource;

    fn policy(yaml: &str) -> Arc<PolicySet> {
        let source = PolicySource { name: "policy.yaml".to_owned(), text: yaml.to_owned() };
        Arc::new(PolicySet::parse(&[source]).expect("a valid policy"))
    }

    /// A resolved handle is the counter the labelled vector exports; the same policy is
    /// resolved once, a new one anew.
    #[test]
    fn handles_count_under_the_rule_labels_and_follow_the_policy() {
        let metrics = Metrics::new();
        let rules = RuleMetrics::new(metrics.clone());
        let first = policy(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let resolved = rules.of(&first);
        let counters = resolved.rule(RuleId(0)).expect("the rule");
        counters.count_decision(DescriptorCode::WarnOverLimit);
        counters.stats.total_hits.inc_by(3);
        let exported = metrics
            .rls_descriptor_decisions
            .with_label_values(&["d", "k", "warn_over_limit"])
            .get();
        assert_eq!(exported, 1);
        assert_eq!(metrics.ratelimit_stats.total_hits.with_label_values(&["d", "k"]).get(), 3);
        assert!(Arc::ptr_eq(&resolved, &rules.of(&first)), "resolved once per policy");
        let second = policy(
            "domain: e\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        );
        let again = rules.of(&second);
        assert!(!Arc::ptr_eq(&resolved, &again));
        again.rule(RuleId(0)).expect("the rule").count_decision(DescriptorCode::Ok);
        assert_eq!(metrics.rls_descriptor_decisions.with_label_values(&["e", "k", "ok"]).get(), 1);
    }
}

//! The counter handles of the active policy's rules and domains, resolved once per policy.
//!
//! A rule's labels (domain, path, statistics key) and a domain's are fixed by the policy, so
//! the RLS hot path increments a resolved handle instead of hashing its labels into a
//! `MetricVec` on every request. A statistics key named by runtime values, and a request's own limit
//! override, still go through the vectors (`crate::api::rls`).

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use prometheus::IntCounter;

use crate::core::policy::{PolicySet, Rule, RuleId};
use crate::metrics::{DOMAIN_UNKNOWN, Metrics};

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

/// One domain's answers, `quotamesh_rls_decisions_total`, under its label.
pub struct DomainCounters {
    /// The `domain` label: the domain, or [`DOMAIN_UNKNOWN`] for one no policy declares.
    pub label: Box<str>,
    ok: IntCounter,
    over_limit: IntCounter,
}

impl DomainCounters {
    fn of(metrics: &Metrics, label: &str) -> Self {
        Self {
            label: label.into(),
            ok: metrics.rls_decisions.with_label_values(&[label, "ok"]),
            over_limit: metrics.rls_decisions.with_label_values(&[label, "over_limit"]),
        }
    }

    /// Counts one request's overall answer.
    pub fn count_answer(&self, admitted: bool) {
        if admitted { &self.ok } else { &self.over_limit }.inc();
    }
}

/// The counters of one policy's rules, in [`RuleId`] order, and of its domains.
pub struct ResolvedRules {
    policy: Arc<PolicySet>,
    rules: Vec<RuleCounters>,
    /// Bounded by the policy's domains. Looked up with a client's string on every request,
    /// but only the policy inserts: a fast hash cannot be flooded here.
    domains: foldhash::HashMap<Box<str>, DomainCounters>,
    unknown_domain: DomainCounters,
}

impl ResolvedRules {
    /// The counters of the rule `id` of the policy they were resolved for.
    pub fn rule(&self, id: RuleId) -> Option<&RuleCounters> {
        usize::try_from(id.0).ok().and_then(|index| self.rules.get(index))
    }

    /// The counters of `domain`, or of [`DOMAIN_UNKNOWN`] when the policy declares no such
    /// domain (a caller's domain never becomes a label of its own).
    pub fn domain(&self, domain: &str) -> &DomainCounters {
        self.domains.get(domain).unwrap_or(&self.unknown_domain)
    }
}

/// The active policy's rule and domain counters, resolved again when the policy changes,
/// and the counters whose labels no policy names.
pub struct RuleMetrics {
    metrics: Metrics,
    resolved: ArcSwapOption<ResolvedRules>,
    /// `quotamesh_rls_unmatched_total{reason="domain_not_found"}`.
    pub unmatched_domain: IntCounter,
    /// `quotamesh_rls_unmatched_total{reason="no_rule"}`.
    pub unmatched_rule: IntCounter,
}

impl RuleMetrics {
    /// Nothing resolved yet: the first request resolves its policy's rules.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            unmatched_domain: metrics.rls_unmatched.with_label_values(&["domain_not_found"]),
            unmatched_rule: metrics.rls_unmatched.with_label_values(&["no_rule"]),
            metrics,
            resolved: ArcSwapOption::empty(),
        }
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
        let domains = policy
            .domains()
            .map(|domain| (Box::from(domain), DomainCounters::of(&self.metrics, domain)))
            .collect();
        let resolved = Arc::new(ResolvedRules {
            policy: Arc::clone(policy),
            rules: policy.rules().map(|rule| RuleCounters::of(&self.metrics, rule)).collect(),
            domains,
            unknown_domain: DomainCounters::of(&self.metrics, DOMAIN_UNKNOWN),
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

    /// A declared domain counts under its name; any other under the one unknown label, and
    /// a domain the policy no longer declares is unknown after the change.
    #[test]
    fn answers_count_under_the_domain_or_the_unknown_label() {
        let metrics = Metrics::new();
        let rules = RuleMetrics::new(metrics.clone());
        let first = policy("domain: d\ndescriptors: []\n");
        let resolved = rules.of(&first);
        resolved.domain("d").count_answer(true);
        resolved.domain("d").count_answer(false);
        resolved.domain("caller-made-up").count_answer(true);
        let answers = |domain: &str, code: &str| {
            metrics.rls_decisions.with_label_values(&[domain, code]).get()
        };
        assert_eq!((answers("d", "ok"), answers("d", "over_limit")), (1, 1));
        assert_eq!(answers(DOMAIN_UNKNOWN, "ok"), 1);
        assert_eq!(answers("caller-made-up", "ok"), 0);
        let second = policy("domain: e\ndescriptors: []\n");
        rules.of(&second).domain("d").count_answer(true);
        assert_eq!((answers("d", "ok"), answers(DOMAIN_UNKNOWN, "ok")), (1, 2));
    }
}

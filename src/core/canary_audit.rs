//! The canary audit (DESIGN section 8): proof that every fail-closed rule still refuses
//! over-quota traffic, against the silent fail-open creep (a rule quietly made fail-open,
//! shadowed, raised or deleted, found weeks later on the bill).
//!
//! For each fail-closed, enforced rule of the policy the operator intends, this module says
//! which synthetic request must be refused ([`synthetic_request`]): the rule's descriptor
//! with a reserved value ([`AUDIT_VALUE`]) wherever the rule counts runtime values
//! separately, so no caller's counter is touched, and one hit more than the rule's tightest
//! limit, which no limit may admit. It also says how a node's served rule has drifted from
//! the intended one ([`drift`]): a rule made fail-open still refuses while the ledger is
//! healthy, so only its served configuration shows it.
//!
//! Pure: `quotamesh audit canary` (`crate::cli::audit`) sends the requests through each
//! node's RLS port and reads each node's served policy.

use crate::core::admission::can_overrun;
use crate::core::policy::{FailureMode, PolicySet, Rollout, Rule};

/// The descriptor value the audit's requests carry where a rule counts each runtime value
/// separately: a counter no caller shares.
pub const AUDIT_VALUE: &str = "quotamesh-canary-audit";

/// The request that must be refused to prove a rule enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticRequest {
    /// The rule's domain.
    pub domain: String,
    /// One descriptor: `(key, value)` per level of the rule, the root first.
    pub entries: Vec<(String, String)>,
    /// Hits: one more than the rule's tightest limit admits at once.
    pub hits: u32,
}

/// Why a rule is not audited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotAudited {
    /// `failure_mode: open`: the audit is about fail-closed rules.
    #[error("fail-open rule")]
    FailOpen,
    /// No limit, or `unlimited`: nothing to refuse.
    #[error("no limit to exceed")]
    NoLimit,
    /// Not enforced everywhere by intent (`shadow`, `warn`, a canary).
    #[error("not enforced everywhere by the policy (rollout stage)")]
    NotEnforced,
    /// Every level names its counter by a fixed value, and a fixed window spends what is
    /// left when it refuses (as upstream counts): the request would spend callers' quota.
    #[error("a fixed window whose counter callers share: a refusal would spend their window")]
    WouldSpendCallersQuota,
    /// Its tightest limit is above what one request's `hits_addend` (a u32) can exceed.
    #[error("limit too large for one request to exceed")]
    LimitTooLarge,
}

/// The request proving `rule` refuses over-quota traffic, or why it is not audited.
///
/// # Errors
/// [`NotAudited`] for a rule the audit does not cover, with the reason.
pub fn synthetic_request(rule: &Rule) -> Result<SyntheticRequest, NotAudited> {
    if rule.failure_mode != FailureMode::Closed {
        return Err(NotAudited::FailOpen);
    }
    if rule.unlimited || rule.limits.is_empty() {
        return Err(NotAudited::NoLimit);
    }
    if rule.rollout != Rollout::Enforce {
        return Err(NotAudited::NotEnforced);
    }
    let mut isolated = false;
    let entries = rule
        .levels
        .iter()
        .map(|level| {
            let value = match level.value.as_deref() {
                // A key-only level, or a wildcard without a shared counter: each runtime
                // value counts apart, so the reserved one is the audit's alone.
                None => {
                    isolated = true;
                    AUDIT_VALUE.to_owned()
                }
                Some(pattern) if pattern.contains('*') => {
                    isolated |= !level.share_threshold;
                    pattern.replace('*', AUDIT_VALUE)
                }
                Some(exact) => exact.to_owned(),
            };
            (level.key.clone(), value)
        })
        .collect();
    // More than a limit's capacity is refused at once without consuming anything, except by
    // a fixed window, which spends what is left (`crate::core::admission::overrun_until_ms`).
    if !isolated && rule.limits.iter().any(|limit| can_overrun(&limit.spec)) {
        return Err(NotAudited::WouldSpendCallersQuota);
    }
    let tightest = rule.limits.iter().map(|limit| limit.spec.capacity_tokens()).min();
    let hits = tightest
        .and_then(|capacity| capacity.checked_add(1))
        .and_then(|hits| u32::try_from(hits).ok())
        .ok_or(NotAudited::LimitTooLarge)?;
    Ok(SyntheticRequest { domain: rule.domain.clone(), entries, hits })
}

/// How a node's served rule differs from the intended fail-closed one, in ways that let
/// over-quota traffic through.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Drift {
    /// The node serves no rule at the intended one's domain and path.
    #[error("the node serves no such rule")]
    Missing,
    /// The node serves it fail-open.
    #[error("served with failure_mode: open (intended: closed)")]
    FailOpen,
    /// The node serves it at another rollout stage.
    #[error("served at rollout {served:?} (intended: enforce)")]
    NotEnforced {
        /// The served rollout.
        served: Rollout,
    },
    /// The node serves it without a limit.
    #[error("served without a limit (intended: {intended_tokens} at once)")]
    Unlimited {
        /// The intended tightest capacity.
        intended_tokens: u64,
    },
    /// The node's tightest limit admits more at once than the intended one.
    #[error("served with a limit of {served_tokens} at once (intended: {intended_tokens})")]
    Raised {
        /// The intended tightest capacity.
        intended_tokens: u64,
        /// The served tightest capacity.
        served_tokens: u64,
    },
}

/// How `served` (the node's policy) lets through what the intended fail-closed `rule`
/// refuses; empty when it does not.
#[must_use]
pub fn drift(rule: &Rule, served: &PolicySet) -> Vec<Drift> {
    let Some(served) = served
        .rules()
        .find(|candidate| candidate.domain == rule.domain && candidate.path == rule.path)
    else {
        return vec![Drift::Missing];
    };
    let mut drifts = Vec::new();
    if served.failure_mode != FailureMode::Closed {
        drifts.push(Drift::FailOpen);
    }
    if served.rollout != Rollout::Enforce {
        drifts.push(Drift::NotEnforced { served: served.rollout });
    }
    let tightest = |rule: &Rule| rule.limits.iter().map(|limit| limit.spec.capacity_tokens()).min();
    if let Some(intended_tokens) = tightest(rule) {
        match tightest(served) {
            _ if served.unlimited => drifts.push(Drift::Unlimited { intended_tokens }),
            None => drifts.push(Drift::Unlimited { intended_tokens }),
            Some(served_tokens) if served_tokens > intended_tokens => {
                drifts.push(Drift::Raised { intended_tokens, served_tokens });
            }
            Some(_) => {}
        }
    }
    drifts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::PolicySource;

    fn set(text: &str) -> PolicySet {
        PolicySet::parse(&[PolicySource { name: "p.yaml".into(), text: text.into() }])
            .expect("a valid policy")
    }

    fn rule<'s>(set: &'s PolicySet, path: &str) -> &'s Rule {
        set.rules().find(|rule| rule.path == path).expect("the rule exists")
    }

    const POLICY: &str = r"
domain: pay
descriptors:
  - key: tenant
    failure_mode: closed
    rate_limits:
      - {unit: second, requests_per_unit: 50}
      - {unit: minute, requests_per_unit: 1000}
  - key: route
    value: /charge*
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}
  - key: cluster
    value: payments
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 200}
  - key: cluster
    value: ledger
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 20, algorithm: fixed_window}
  - key: catalog
    rate_limit: {unit: second, requests_per_unit: 500}
  - key: trial
    failure_mode: closed
    rollout: warn
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: account
    value: acme
    descriptors:
      - key: user
        failure_mode: closed
        rate_limit: {unit: hour, requests_per_unit: 7}
";

    /// The reserved value goes where a rule counts runtime values apart (key-only levels,
    /// wildcards), fixed values stay, and the hits exceed the tightest limit by one.
    #[test]
    fn a_synthetic_request_exceeds_the_tightest_limit_on_a_counter_of_its_own() {
        let set = set(POLICY);
        let request = |path| synthetic_request(rule(&set, path));
        let tenant = request("tenant").expect("audited");
        assert_eq!(tenant.domain, "pay");
        assert_eq!(tenant.entries, [("tenant".to_owned(), AUDIT_VALUE.to_owned())]);
        assert_eq!(tenant.hits, 51);
        let charge = request("route_/charge*").expect("a wildcard counts values apart");
        assert_eq!(charge.entries, [("route".to_owned(), format!("/charge{AUDIT_VALUE}"))]);
        assert_eq!(charge.hits, 11);
        let payments = request("cluster_payments").expect("refused at once, nothing spent");
        assert_eq!(payments.entries, [("cluster".to_owned(), "payments".to_owned())]);
        assert_eq!(payments.hits, 201);
        assert_eq!(request("cluster_ledger"), Err(NotAudited::WouldSpendCallersQuota));
        assert_eq!(request("catalog"), Err(NotAudited::FailOpen));
        assert_eq!(request("trial"), Err(NotAudited::NotEnforced));
        assert_eq!(request("account_acme"), Err(NotAudited::FailOpen), "no limit, default open");
        let nested = request("account_acme.user").expect("a nested rule");
        assert_eq!(
            nested.entries,
            [
                ("account".to_owned(), "acme".to_owned()),
                ("user".to_owned(), AUDIT_VALUE.to_owned())
            ]
        );
        assert_eq!(nested.hits, 8);
    }

    /// A served rule that lets more through than intended is reported, each way it does;
    /// the same rule, or a tighter one, is not.
    #[test]
    fn drift_names_every_way_a_served_rule_lets_more_through() {
        let intended = set(POLICY);
        let tenant = rule(&intended, "tenant");
        assert_eq!(drift(tenant, &intended), []);
        let served = |from: &str, to: &str| {
            assert!(POLICY.contains(from), "{from}");
            set(&POLICY.replacen(from, to, 1))
        };
        let open = served(
            "  - key: tenant\n    failure_mode: closed",
            "  - key: tenant\n    failure_mode: open",
        );
        assert_eq!(drift(tenant, &open), [Drift::FailOpen]);
        let shadow = served(
            "  - key: tenant\n    failure_mode: closed",
            "  - key: tenant\n    failure_mode: closed\n    shadow_mode: true",
        );
        assert_eq!(drift(tenant, &shadow), [Drift::NotEnforced { served: Rollout::Shadow }]);
        let raised = served(
            "{unit: second, requests_per_unit: 50}",
            "{unit: second, requests_per_unit: 80}",
        );
        assert_eq!(
            drift(tenant, &raised),
            [Drift::Raised { intended_tokens: 50, served_tokens: 80 }]
        );
        let tighter =
            served("{unit: second, requests_per_unit: 50}", "{unit: second, requests_per_unit: 5}");
        assert_eq!(drift(tenant, &tighter), []);
        let gone = served("  - key: tenant\n", "  - key: tenants\n");
        assert_eq!(drift(tenant, &gone), [Drift::Missing]);
    }
}

//! The RLS workload's plan: hits on one key of each of two token-bucket rules, one that
//! fails open (Envoy's default: a node cut from the ledger admits from a local fallback
//! bucket) and one that fails closed (it refuses instead), offered well above their limit
//! through every node. Pure: the seed and the options fix every planned hit. Also the
//! policy the nodes serve for it.

use serde::{Deserialize, Serialize};

use super::{Pacing, Planned, PlannedOp};

/// The policy's domain.
pub const DOMAIN: &str = "jepsen";
/// The value every hit carries for its rule's key.
pub const KEY_VALUE: &str = "k";

/// One rule of the workload's policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RlsRule {
    /// The descriptor key (and the rule's path in the node's metrics).
    pub key: String,
    pub fail_open: bool,
}

/// The workload's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RlsOptions {
    pub rules: Vec<RlsRule>,
    /// Every rule's token bucket: this many tokens a second...
    pub limit_per_second: u64,
    /// ...and at most this many at once.
    pub burst_tokens: u64,
    /// The nodes' `[leasing] fallback_multiplier` in thousandths (the shipped 1.0).
    pub fallback_multiplier_permille: u64,
    /// Hits offered over all rules; its nodes are the voters, then the gateways.
    #[serde(flatten)]
    pub pacing: Pacing,
}

impl RlsOptions {
    /// The defaults at the given pace: an open and a closed rule of 20 a second (bursts of
    /// 20), so the default rate of 200 offers five times the limit.
    pub fn new(pacing: Pacing) -> Self {
        Self {
            rules: vec![
                RlsRule { key: "open".to_owned(), fail_open: true },
                RlsRule { key: "closed".to_owned(), fail_open: false },
            ],
            limit_per_second: 20,
            burst_tokens: 20,
            fallback_multiplier_permille: 1_000,
            pacing,
        }
    }

    /// The policy file the nodes serve (envoyproxy/ratelimit's format with quotamesh's
    /// `failure_mode` and `burst`).
    pub fn policy_yaml(&self) -> String {
        let mut text = format!("domain: {DOMAIN}\ndescriptors:\n");
        for rule in &self.rules {
            text.push_str(&format!(
                "  - key: {key}\n    failure_mode: {mode}\n    rate_limit:\n      name: {key}\n      \
                 unit: second\n      requests_per_unit: {limit}\n      burst: {burst}\n",
                key = rule.key,
                mode = if rule.fail_open { "open" } else { "closed" },
                limit = self.limit_per_second,
                burst = self.burst_tokens,
            ));
        }
        text
    }
}

/// Every worker's hits, in order, each on a seeded rule.
pub fn plan(seed: u64, options: &RlsOptions) -> Vec<Vec<Planned>> {
    let rules = options.rules.len().max(1);
    options.pacing.plan(seed, |rng, _, _| PlannedOp::Check { rule: rng.index(rules) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every hit names an existing rule (pacing and seeding are `Pacing::plan`'s).
        #[test]
        fn hits_name_rules(seed: u64, rate in 1_u64..400, time_limit_ms in 0_u64..20_000) {
            let options = RlsOptions::new(Pacing::new(3, rate, time_limit_ms));
            let rules = options.rules.len();
            let named = plan(seed, &options)
                .into_iter()
                .flatten()
                .all(|hit| matches!(hit.op, PlannedOp::Check { rule } if rule < rules));
            prop_assert!(named);
        }
    }

    /// The policy names both rules with their failure modes.
    #[test]
    fn policy_has_both_rules() {
        let text = RlsOptions::new(Pacing::new(3, 200, 1_000)).policy_yaml();
        assert!(text.contains("key: open\n    failure_mode: open"), "{text}");
        assert!(text.contains("key: closed\n    failure_mode: closed"), "{text}");
    }
}

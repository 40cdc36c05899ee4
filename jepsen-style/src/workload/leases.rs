//! The lease-conservation workload's plan: lease grants asked through the admin
//! `AcquireLeases` of every node (gateways included), as a lease broker asks for them, on a
//! few keys of one token-bucket rule, offered well above its rate. Pure: the seed and the
//! options fix every planned request. Also the policy the nodes serve for it.
//!
//! No hit of the Rate Limit Service names these keys, so no node's lease broker ever
//! reports on them: nothing the ledger grants on them is settled or credited back (an
//! expired lease is written off as spent). The grants alone are then bounded by the
//! bucket, which is what `checker::leases` holds them to.

use serde::{Deserialize, Serialize};

use super::{Pacing, Planned, PlannedOp};

/// The policy's domain.
pub const DOMAIN: &str = "jepsen-leases";
/// The rule's descriptor key; each key of the workload is one of its values.
pub const DESCRIPTOR_KEY: &str = "leased";

/// The workload's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseOptions {
    /// How many keys (descriptor values `k0`, `k1`, ...), each a bucket of its own.
    pub keys: usize,
    /// Every key's token bucket: this many tokens a second...
    pub limit_per_second: u64,
    /// ...and at most this many at once.
    pub burst_tokens: u64,
    /// Each request wants 1 to this many tokens.
    pub tokens_wanted_max: u64,
    /// Every grant's TTL: one for all, so a node's aggregate lease expires with its latest
    /// grant, whose expiry less this is its ledger time.
    pub lease_ttl_ms: u64,
    /// Requests over all keys; its nodes are the voters, then the gateways.
    #[serde(flatten)]
    pub pacing: Pacing,
}

impl LeaseOptions {
    /// The defaults at the given pace (over voters and gateways): three keys of 20 tokens a
    /// second (bursts of 20), requests of 1 to 5 tokens, so the default rate of 200 asks
    /// for five times the keys' rates together.
    pub fn new(pacing: Pacing) -> Self {
        Self {
            keys: 3,
            limit_per_second: 20,
            burst_tokens: 20,
            tokens_wanted_max: 5,
            lease_ttl_ms: 500,
            pacing,
        }
    }

    /// Key `index`'s descriptor value.
    pub fn key_value(index: usize) -> String {
        format!("k{index}")
    }

    /// The policy file the nodes serve: one token-bucket rule whose every value is a key.
    pub fn policy_yaml(&self) -> String {
        format!(
            "domain: {DOMAIN}\ndescriptors:\n  - key: {DESCRIPTOR_KEY}\n    rate_limit:\n      \
             name: {DESCRIPTOR_KEY}\n      unit: second\n      requests_per_unit: {limit}\n      \
             burst: {burst}\n",
            limit = self.limit_per_second,
            burst = self.burst_tokens,
        )
    }
}

/// Every worker's requests, in order, each on a seeded key for a seeded number of tokens.
pub fn plan(seed: u64, options: &LeaseOptions) -> Vec<Vec<Planned>> {
    let keys = options.keys.max(1);
    let wanted_max = options.tokens_wanted_max.max(1);
    options.pacing.plan(seed, |rng, _, _| PlannedOp::Lease {
        key: rng.index(keys),
        tokens: rng.between(1, wanted_max),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every request names an existing key and wants 1 to the maximum of tokens
        /// (pacing and seeding are `Pacing::plan`'s).
        #[test]
        fn requests_are_in_range(seed: u64, rate in 1_u64..400, time_limit_ms in 0_u64..20_000) {
            let options = LeaseOptions::new(Pacing::new(5, rate, time_limit_ms));
            let in_range = plan(seed, &options).into_iter().flatten().all(|planned| {
                matches!(
                    planned.op,
                    PlannedOp::Lease { key, tokens }
                        if key < options.keys && (1..=options.tokens_wanted_max).contains(&tokens)
                )
            });
            prop_assert!(in_range);
        }
    }

    /// The policy is one token bucket of the workload's rate and burst.
    #[test]
    fn policy_has_the_bucket() {
        let text = LeaseOptions::new(Pacing::new(3, 200, 1_000)).policy_yaml();
        assert!(text.starts_with("domain: jepsen-leases\n"), "{text}");
        assert!(text.contains("key: leased\n"), "{text}");
        assert!(text.contains("requests_per_unit: 20\n      burst: 20\n"), "{text}");
    }
}

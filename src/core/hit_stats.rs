//! envoyproxy/ratelimit's per-descriptor statistics of one decision: how a descriptor's hits
//! split into `over_limit`, `near_limit` and `within_limit`, so a migrating user's
//! dashboards and alerts read the same numbers.
//!
//! Upstream counts in a Redis counter that every hit increments: with `before` the count
//! before a descriptor's hits and `after = before + hits`, hits past the limit are
//! `over_limit`, hits past `floor(limit * near_limit_ratio)` but within the limit are
//! `near_limit`, and an admitted descriptor adds all of its hits to `within_limit` (its
//! near ones too). quotamesh's counters consume nothing for rejected hits, so `before` and
//! `after` are read off what the decision says is left: an admitted descriptor was at
//! `limit - remaining - hits` before, a rejected one at `limit - remaining` (its hits would
//! have taken it past the limit). Recording the counts is `crate::api::rls`'s job.

/// Upstream's default `NEAR_LIMIT_RATIO`, 0.8, in thousandths.
pub const NEAR_LIMIT_RATIO_PERMILLE_DEFAULT: u64 = 800;

/// The statistics of one descriptor's hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HitCounts {
    /// Every hit (`total_hits`).
    pub total: u64,
    /// Hits past the limit (`over_limit`).
    pub over_limit: u64,
    /// Hits past the near-limit threshold and within the limit (`near_limit`).
    pub near_limit: u64,
    /// Hits of an admitted descriptor (`within_limit`), the near ones included.
    pub within_limit: u64,
}

/// Splits `hits` against a limit of `limit_tokens` that has `remaining_tokens` left after
/// the decision (`admitted` or not); `near_limit_ratio_permille` is capped at 1,000.
#[must_use]
pub fn classify(
    limit_tokens: u64,
    remaining_tokens: u64,
    hits: u64,
    admitted: bool,
    near_limit_ratio_permille: u64,
) -> HitCounts {
    let remaining_tokens = remaining_tokens.min(limit_tokens);
    let used_after_tokens = if admitted {
        limit_tokens - remaining_tokens
    } else {
        (limit_tokens - remaining_tokens).saturating_add(hits)
    };
    let used_before_tokens = used_after_tokens.saturating_sub(hits);
    let near_threshold_tokens = u64::try_from(
        u128::from(limit_tokens) * u128::from(near_limit_ratio_permille.min(1_000)) / 1_000,
    )
    .expect("at most the limit, a u64");
    let mut counts = HitCounts { total: hits, ..HitCounts::default() };
    if used_after_tokens > limit_tokens {
        if used_before_tokens >= limit_tokens {
            counts.over_limit = hits;
        } else {
            counts.over_limit = used_after_tokens - limit_tokens;
            counts.near_limit = limit_tokens - near_threshold_tokens.max(used_before_tokens);
        }
    } else {
        if used_after_tokens > near_threshold_tokens {
            counts.near_limit = if used_before_tokens >= near_threshold_tokens {
                hits
            } else {
                used_after_tokens - near_threshold_tokens
            };
        }
        counts.within_limit = hits;
    }
    counts
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The examples of upstream's documentation: a limit of 10 with the 0.8 ratio.
    #[test]
    fn near_and_over_split_as_upstream() {
        // 7 used, 2 more: the 9th is near the limit, both within it.
        assert_eq!(
            classify(10, 1, 2, true, 800),
            HitCounts { total: 2, over_limit: 0, near_limit: 1, within_limit: 2 }
        );
        // 9 used, 3 more rejected: 1 near (the 10th), 2 over.
        assert_eq!(
            classify(10, 1, 3, false, 800),
            HitCounts { total: 3, over_limit: 2, near_limit: 1, within_limit: 0 }
        );
        // Already at the limit: every hit is over.
        assert_eq!(
            classify(10, 0, 4, false, 800),
            HitCounts { total: 4, over_limit: 4, near_limit: 0, within_limit: 0 }
        );
        // Far from it: within only.
        assert_eq!(
            classify(10, 9, 1, true, 800),
            HitCounts { total: 1, over_limit: 0, near_limit: 0, within_limit: 1 }
        );
    }

    /// The reference: replay the hits one at a time against upstream's counter.
    fn one_by_one(limit: u64, before: u64, hits: u64, ratio_permille: u64) -> HitCounts {
        let near = limit * ratio_permille / 1_000;
        let mut counts = HitCounts { total: hits, ..HitCounts::default() };
        for count in before + 1..=before + hits {
            if count > limit {
                counts.over_limit += 1;
            } else if count > near {
                counts.near_limit += 1;
            }
        }
        if before + hits <= limit {
            counts.within_limit = hits;
        }
        counts
    }

    proptest! {
        /// Whatever the numbers, the split is what counting the hits one by one gives.
        #[test]
        fn classify_matches_counting_one_by_one(
            limit in 0_u64..200,
            used in 0_u64..200,
            hits in 0_u64..200,
            ratio_permille in 0_u64..=1_000,
        ) {
            let used = used.min(limit);
            let remaining = limit - used;
            let admitted = hits <= remaining;
            let remaining_after = if admitted { remaining - hits } else { remaining };
            let counts = classify(limit, remaining_after, hits, admitted, ratio_permille);
            prop_assert_eq!(counts, one_by_one(limit, used, hits, ratio_permille));
            prop_assert!(counts.over_limit + counts.near_limit <= counts.total);
        }
    }
}

//! Regions: a global limit sliced between regions, and the pure machinery that moves
//! tokens of a slice from one region to another (DESIGN section 5).
//!
//! A rule may carry per-region shares (`regions: {us-east: 60%, eu-central: 40%}` in the
//! policy, `crate::core::policy`). Each region enforces its slice of the rule's limit with
//! no cross-region traffic on the request path: its quota group's buckets get the slice as
//! their rate and capacity ([`RegionShares::slice_spec`]). A region the rule does not name
//! gets a slice of 0, which refuses every hit until tokens are transferred to it.
//!
//! This module owns the arithmetic of slices ([`split_tokens`]: largest remainder, so the
//! slices of the named regions always add up to the global limit exactly). Its submodules
//! own the rest of the pure core:
//!
//! - [`transfer`]: the state a region's quota group keeps about slices and transfers, and
//!   the idempotent commands that move tokens (debit, credit, cancel, settle), with the
//!   conservation invariant.
//! - [`plan`]: the rebalance planner: when a region asks, how much a donor gives, how
//!   slices drift back to the policy's shares.
//! - [`demand`]: a region's demand on a limit over the observation window, from samples of
//!   its count of offered hits, which adds up the counts every node of the region reports.
//!
//! Nothing here does IO or reads a clock; the QUIC transport (`crate::region`) and the
//! rebalancer actor (`crate::actors::rebalancer`) wrap it.

pub mod demand;
pub mod plan;
pub mod transfer;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use crate::core::rate::{LimitSpec, LimitSpecError};

/// Longest region name, in bytes (as long as a region name in a certificate, `crate::tls`).
pub const REGION_NAME_BYTES_MAX: usize = 128;
/// Most regions one rule may name.
pub const REGIONS_PER_RULE_MAX: usize = 64;
/// A share is written in hundredths of a percent: 10,000 is the whole limit.
pub const SHARE_BASIS_POINTS_WHOLE: u32 = 10_000;

const _: () = assert!(REGIONS_PER_RULE_MAX > 0);

/// Why a region name was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegionNameError {
    /// Empty, or longer than [`REGION_NAME_BYTES_MAX`].
    #[error("a region name must be 1 to {REGION_NAME_BYTES_MAX} bytes")]
    Length,
    /// A character outside `[A-Za-z0-9_.-]`.
    #[error("a region name may only use A-Z, a-z, 0-9, `_`, `.` and `-`")]
    Character,
}

/// Checks a region name: 1 to [`REGION_NAME_BYTES_MAX`] bytes of `[A-Za-z0-9_.-]`, the
/// rule certificates name regions by (`crate::tls::valid_name`), so a name is the same in
/// policies, configuration, certificates and metrics labels.
///
/// # Errors
/// [`RegionNameError`] saying what is wrong.
pub fn check_region_name(name: &str) -> Result<(), RegionNameError> {
    if name.is_empty() || name.len() > REGION_NAME_BYTES_MAX {
        return Err(RegionNameError::Length);
    }
    if !name.bytes().all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'.' | b'-'))
    {
        return Err(RegionNameError::Character);
    }
    Ok(())
}

/// A rule's shares per region, in basis points ([`SHARE_BASIS_POINTS_WHOLE`] is 100 %).
/// Built only by the policy loader, which checks the names and that the shares add up to
/// exactly 100 %.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RegionShares {
    basis_points: BTreeMap<String, u32>,
}

impl RegionShares {
    /// Shares from `(region, basis points)` pairs; `None` unless every name is valid, no
    /// name repeats, there are at most [`REGIONS_PER_RULE_MAX`] and they add up to 100 %.
    #[must_use]
    pub fn new(shares: impl IntoIterator<Item = (String, u32)>) -> Option<Self> {
        let mut basis_points = BTreeMap::new();
        for (name, share) in shares {
            if check_region_name(&name).is_err() || basis_points.insert(name, share).is_some() {
                return None;
            }
        }
        let total: u64 = basis_points.values().map(|share| u64::from(*share)).sum();
        (basis_points.len() <= REGIONS_PER_RULE_MAX && total == u64::from(SHARE_BASIS_POINTS_WHOLE))
            .then_some(Self { basis_points })
    }

    /// The regions and their shares, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, u32)> {
        self.basis_points.iter().map(|(name, share)| (name.as_str(), *share))
    }

    /// The share of `region` in basis points; 0 for a region the rule does not name.
    #[must_use]
    pub fn basis_points_of(&self, region: &str) -> u32 {
        self.basis_points.get(region).copied().unwrap_or(0)
    }

    /// `region`'s slice of `total_tokens` ([`split_tokens`]); 0 for a region not named.
    #[must_use]
    pub fn slice_of(&self, region: &str, total_tokens: u64) -> u64 {
        split_tokens(total_tokens, self).get(region).copied().unwrap_or(0)
    }

    /// The limit `region` enforces for a rule whose global limit is `global`: the rate and
    /// the burst are both sliced, so a region's bucket refills at its share of the rate and
    /// holds at most its share of the burst (at least one token while its rate is above 0).
    /// A region not named, or whose slice rounds down to 0, refuses every hit.
    ///
    /// # Errors
    /// Never for a valid `global` (a slice is never above the limit it is cut from); the
    /// [`LimitSpecError`] of `LimitSpec::new` otherwise.
    pub fn slice_spec(
        &self,
        region: &str,
        global: &LimitSpec,
    ) -> Result<LimitSpec, LimitSpecError> {
        let requests_per_window = self.slice_of(region, global.requests_per_window);
        slice_spec_of(global, requests_per_window)
    }
}

/// The limit of a region holding `slice_tokens` of `global`'s rate per window: the burst is
/// scaled by the same fraction (at least one token while the rate is above 0).
///
/// # Errors
/// The [`LimitSpecError`] of `LimitSpec::new`: never while `slice_tokens` is at most the
/// global rate.
pub fn slice_spec_of(global: &LimitSpec, slice_tokens: u64) -> Result<LimitSpec, LimitSpecError> {
    if slice_tokens == 0 {
        return LimitSpec::new(global.algorithm, 0, global.window_ms, None);
    }
    let burst = u128::from(global.burst_tokens) * u128::from(slice_tokens)
        / u128::from(global.requests_per_window.max(1));
    let burst_tokens = u64::try_from(burst).unwrap_or(u64::MAX).max(1);
    LimitSpec::new(global.algorithm, slice_tokens, global.window_ms, Some(burst_tokens))
}

/// Splits `total_tokens` between the regions of `shares` by the largest-remainder method:
/// each region gets the floor of its exact share, and the tokens left by rounding go one by
/// one to the largest remainders (ties by name), so the slices add up to `total_tokens`
/// exactly and every region is within one token of its exact share.
#[must_use]
pub fn split_tokens(total_tokens: u64, shares: &RegionShares) -> BTreeMap<String, u64> {
    let whole = u128::from(SHARE_BASIS_POINTS_WHOLE);
    let mut slices = BTreeMap::new();
    let mut remainders: Vec<(u128, &str)> = Vec::with_capacity(shares.basis_points.len());
    let mut given: u64 = 0;
    for (name, share) in &shares.basis_points {
        let exact = u128::from(total_tokens) * u128::from(*share);
        let floor = u64::try_from(exact / whole).expect("a share of a u64 fits a u64");
        given += floor;
        remainders.push((exact % whole, name));
        slices.insert(name.clone(), floor);
    }
    // Largest remainder first; among equal remainders, names in order.
    remainders.sort_by(|left, right| right.0.cmp(&left.0).then(left.1.cmp(right.1)));
    let left_over = total_tokens - given;
    for (_, name) in remainders.iter().take(usize::try_from(left_over).unwrap_or(usize::MAX)) {
        *slices.get_mut(*name).expect("every remainder names a slice") += 1;
    }
    slices
}

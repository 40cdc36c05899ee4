//! The rebalance planner: which region asks for tokens, how many a donor gives, and how
//! slices drift back toward the policy's shares when demand falls (DESIGN section 5).
//!
//! Every number is one rule's, in tokens per window of its limit. A region's **demand** is
//! its offered traffic on the rule over the observation window (20 s by default), scaled to
//! one window of the limit: hits admitted and refused alike, so a region held at its slice
//! still shows what it would use. The rules, with `T` the trigger (80 % by default):
//!
//! ```text
//!   hot:     demand >= T x slice                  -> ask for target - slice, where
//!                                                    target = demand / U + 1 (U = 50 %)
//!   floor:   demand / M + 1 (0 without demand),   -> a donor keeps this much: after
//!            M = (T + U) / 2 (65 %)                  giving, its demand may grow by
//!                                                    T / M - 1 (23 %) before it is hot
//!   give:    min(asked, slice - floor)
//!   drift:   slice > policy slice, and cold:      -> give min(slice - max(target, policy),
//!            demand < U / 2 x slice (25 %)           deficit) to the region furthest below
//!                                                    its policy slice
//! ```
//!
//! The numbers are bands, so that a demand that wobbles does not move tokens back and
//! forth: a region given its target uses half of it, and is hot again only if its demand
//! grows by 60 %, cold only if it halves; a donor given down to its floor is hot again only
//! if its demand grows by 23 % (`tests.rs`: a wobbling demand never reverses a transfer).
//!
//! The planner only proposes; every token moves through `transfer.rs`'s commands. It reads
//! no clock: the caller measures demand over its window and calls it on a timer.

/// Default share of a slice whose demand makes a region ask: the design's 80 %.
pub const TRIGGER_PERCENT_DEFAULT: u64 = 80;
/// Default observation window for demand: the design's 20 s.
pub const OBSERVE_MS_DEFAULT: u64 = 20_000;
/// Default utilisation a region asks to reach: twice its demand, so a region whose traffic
/// keeps growing does not ask again at once.
pub const TARGET_PERCENT_DEFAULT: u64 = 50;

/// Settings of the planner (`[rebalance]` in the node's configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSettings {
    /// A region asks when its demand reaches this share of its slice, in percent (1..=100).
    pub trigger_percent: u64,
    /// What a region asks for: a slice its demand fills to this percent (1..=trigger).
    pub target_percent: u64,
    /// The window demand is measured over, in milliseconds.
    pub observe_ms: u64,
}

impl Default for PlanSettings {
    fn default() -> Self {
        Self {
            trigger_percent: TRIGGER_PERCENT_DEFAULT,
            target_percent: TARGET_PERCENT_DEFAULT,
            observe_ms: OBSERVE_MS_DEFAULT,
        }
    }
}

/// Why planner settings were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanSettingsError {
    /// `trigger_percent` outside 1..=100, or `target_percent` outside 1..=trigger.
    #[error("need 1 <= target_percent <= trigger_percent <= 100")]
    Percent,
    /// `observe_ms` of 0.
    #[error("observe_ms must be at least 1")]
    Observe,
}

impl PlanSettings {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`PlanSettingsError`] naming the bad setting.
    pub fn check(&self) -> Result<(), PlanSettingsError> {
        if !(1..=100).contains(&self.trigger_percent)
            || !(1..=self.trigger_percent).contains(&self.target_percent)
        {
            return Err(PlanSettingsError::Percent);
        }
        if self.observe_ms == 0 {
            return Err(PlanSettingsError::Observe);
        }
        Ok(())
    }

    /// True when `demand_tokens` reaches the trigger share of `slice_tokens`.
    #[must_use]
    pub fn is_hot(&self, view: &RegionView) -> bool {
        view.demand_tokens > 0
            && u128::from(view.demand_tokens) * 100
                >= u128::from(view.slice_tokens) * u128::from(self.trigger_percent)
    }

    /// What a region keeps when it gives: the smallest slice its demand fills to less than
    /// halfway between the target and the trigger, so it is not hot after giving, nor made
    /// hot by a small rise of its demand.
    #[must_use]
    pub fn floor_tokens(&self, view: &RegionView) -> u64 {
        above_percent(view.demand_tokens, (self.trigger_percent + self.target_percent) / 2)
    }

    /// The slice a region's demand fills to the target share: what a hot region asks to
    /// reach, and what drift keeps.
    #[must_use]
    pub fn target_tokens(&self, view: &RegionView) -> u64 {
        above_percent(view.demand_tokens, self.target_percent)
    }

    /// Tokens a hot region asks for (0 when it is not hot): enough to bring its demand to
    /// the target share of its slice, within what the rule has outside this region.
    #[must_use]
    pub fn ask_tokens(&self, view: &RegionView) -> u64 {
        if !self.is_hot(view) {
            return 0;
        }
        let target = self.target_tokens(view);
        // At least one token: a hot region whose target rounds to its slice still asks.
        target
            .saturating_sub(view.slice_tokens)
            .max(1)
            .min(view.global_tokens.saturating_sub(view.slice_tokens))
    }

    /// Tokens a donor gives in answer to an ask of `asked_tokens`: what it holds above its
    /// floor, at most what was asked.
    #[must_use]
    pub fn give_tokens(&self, donor: &RegionView, asked_tokens: u64) -> u64 {
        donor.slice_tokens.saturating_sub(self.floor_tokens(donor)).min(asked_tokens)
    }

    /// The drift of a region whose demand fell: when its slice is above its policy slice
    /// and its demand fills less than half the target share of it, it gives back what it
    /// holds above both the slice it would ask for ([`PlanSettings::target_tokens`]) and its
    /// policy slice to the peer furthest below its own policy slice (ties by name), at most
    /// that peer's deficit. `None` when there is nothing to give or nobody below its share.
    #[must_use]
    pub fn drift<'p>(
        &self,
        own: &RegionView,
        peers: &'p [(String, RegionView)],
    ) -> Option<(&'p str, u64)> {
        let cold_percent = (self.target_percent / 2).max(1);
        if u128::from(own.demand_tokens) * 100
            >= u128::from(own.slice_tokens) * u128::from(cold_percent)
        {
            return None;
        }
        let keep = self.target_tokens(own).max(own.policy_tokens);
        let surplus = own.slice_tokens.saturating_sub(keep);
        if surplus == 0 {
            return None;
        }
        let (name, deficit) = peers
            .iter()
            .map(|(name, view)| {
                (name.as_str(), view.policy_tokens.saturating_sub(view.slice_tokens))
            })
            .filter(|(_, deficit)| *deficit > 0)
            .max_by(|left, right| left.1.cmp(&right.1).then(right.0.cmp(left.0)))?;
        Some((name, surplus.min(deficit)))
    }

    /// The asks of a hot region: its want split over the peers with something to give
    /// (most to give first, ties by name), each asked at most what it can give.
    #[must_use]
    pub fn asks<'p>(
        &self,
        own: &RegionView,
        peers: &'p [(String, RegionView)],
    ) -> Vec<(&'p str, u64)> {
        let mut want = self.ask_tokens(own);
        let mut donors: Vec<(&str, u64)> = peers
            .iter()
            .map(|(name, view)| (name.as_str(), self.give_tokens(view, u64::MAX)))
            .filter(|(_, spare)| *spare > 0)
            .collect();
        donors.sort_by(|left, right| right.1.cmp(&left.1).then(left.0.cmp(right.0)));
        let mut asks = Vec::new();
        for (name, spare) in donors {
            if want == 0 {
                break;
            }
            let asked = spare.min(want);
            want -= asked;
            asks.push((name, asked));
        }
        asks
    }
}

/// What the planner knows of one region for one rule (regions exchange it, `crate::region`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RegionView {
    /// The rule's global limit, tokens per window.
    pub global_tokens: u64,
    /// The region's slice now.
    pub slice_tokens: u64,
    /// The region's slice by the policy's shares.
    pub policy_tokens: u64,
    /// The region's demand over the observation window, scaled to one window of the limit.
    pub demand_tokens: u64,
}

/// The smallest slice `s` with `tokens * 100 < s * percent`: `floor(tokens * 100 / percent)
/// + 1` (0 for no tokens), saturating; `percent` is at least 1 in valid settings.
fn above_percent(tokens: u64, percent: u64) -> u64 {
    if tokens == 0 {
        return 0;
    }
    let scaled = u128::from(tokens) * 100 / u128::from(percent.max(1)) + 1;
    u64::try_from(scaled).unwrap_or(u64::MAX)
}

/// Demand over an observation window scaled to one window of a limit: `hits` offered in
/// `observe_ms`, as tokens per `window_ms` (rounded up, saturating).
#[must_use]
pub fn demand_per_window(hits: u64, observe_ms: u64, window_ms: u64) -> u64 {
    let scaled = u128::from(hits) * u128::from(window_ms);
    u64::try_from(scaled.div_ceil(u128::from(observe_ms.max(1)))).unwrap_or(u64::MAX)
}

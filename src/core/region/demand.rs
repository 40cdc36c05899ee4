//! A region's demand on one sliced limit, measured over the observation window from samples
//! of an ever-growing count of offered hits (admitted and refused alike): the number the
//! planner (`plan.rs`) calls `demand_tokens`.
//!
//! The rebalancer samples the count on each tick; this file keeps the samples of the last
//! window (at most [`DEMAND_SAMPLES_MAX`]) and answers the hits offered since the newest
//! sample at least a window old, scaled to one window of the limit. Before a whole window
//! has passed, the hits seen so far are scaled over the whole window, so demand is never
//! overstated while it is still being measured. It reads no clock: `now_ms` comes in.

use std::collections::VecDeque;

use super::plan::demand_per_window;

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

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

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

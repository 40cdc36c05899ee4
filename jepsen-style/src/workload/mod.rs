//! Workloads: what the clients do during a run. Each workload's plan is drawn from the seed
//! without IO (same seed, same operations); carrying it out against the nodes is in
//! `crate::run`.

pub mod bank;
pub mod holds;
pub mod leases;
pub mod rls;

use serde::{Deserialize, Serialize};

use crate::rng::SeededRng;

/// What a planned operation does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PlannedOp {
    /// Bank: a debit from one account and, once approved, a credit to another.
    Transfer { transfer: u64, from: usize, to: usize, amount: u64 },
    /// Bank: a linearizable balance read.
    Read { account: usize },
    /// RLS: one hit on a rule's key.
    Check { rule: usize },
    /// Leases: a grant of `tokens` on a key through the admin API.
    Lease { key: usize, tokens: u64 },
    /// Holds: a reserve on an account and, `wait_ms` after it is approved, its end.
    Hold { hold: u64, account: usize, amount: u64, ttl_ms: u64, wait_ms: u64, end: holds::HoldEnd },
}

/// One operation of a worker's plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Planned {
    /// Not started before this, from the workload's start.
    pub at_ms: u64,
    /// The node (position) it is sent to first.
    pub node: usize,
    pub op: PlannedOp,
}

/// Operations a worker plans at most (they are numbered per worker, e.g. in transfer ids):
/// at 500/s over 8 workers, that is over 4 hours.
pub const OPERATIONS_PER_WORKER_MAX: u64 = 1_000_000;

/// How a workload's operations are spread: over how many clients, how fast, for how long
/// and over how many nodes. Every workload's options hold one (flattened, so saved runs
/// keep their fields), and so does `run::RunOptions`, built from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pacing {
    /// Concurrent clients (runs saved before the command line held a pacing: the default).
    #[serde(default = "workers_default")]
    pub workers: usize,
    /// Planned operations per second, over all workers.
    pub rate_per_second: u64,
    pub time_limit_ms: u64,
    /// The nodes operations go to. In `run::RunOptions`, the voters: the workloads that also
    /// send to gateways count them in their own pacing.
    pub nodes: usize,
}

/// Every workload's concurrent clients.
pub const WORKERS_DEFAULT: usize = 8;

fn workers_default() -> usize {
    WORKERS_DEFAULT
}

impl Pacing {
    /// [`WORKERS_DEFAULT`] clients planning `rate_per_second` operations a second over
    /// `nodes` nodes until `time_limit_ms`.
    pub fn new(nodes: usize, rate_per_second: u64, time_limit_ms: u64) -> Self {
        Self { workers: WORKERS_DEFAULT, rate_per_second, time_limit_ms, nodes }
    }

    /// The same pace over another number of nodes.
    pub fn over(self, nodes: usize) -> Self {
        Self { nodes, ..self }
    }

    /// Paces the workers so that together they plan `rate_per_second` operations a second
    /// until `time_limit_ms`, each at a seeded moment of its slot and on a seeded node among
    /// `nodes`; `draw(rng, worker, sequence)` decides what each operation is.
    pub fn plan(
        &self,
        seed: u64,
        mut draw: impl FnMut(&mut SeededRng, u64, u64) -> PlannedOp,
    ) -> Vec<Vec<Planned>> {
        let workers = self.workers.max(1);
        // Each worker plans one operation per `spacing_us` (microseconds, so a high rate over
        // few workers is not rounded down to whole milliseconds).
        let spacing_us =
            (workers as u64).saturating_mul(1_000_000).div_ceil(self.rate_per_second.max(1)).max(1);
        let time_limit_us = self.time_limit_ms.saturating_mul(1_000);
        (0..workers as u64)
            .map(|worker| {
                let mut rng = SeededRng::fork(seed, worker);
                let mut ops = Vec::new();
                let mut slot_us = 0;
                let mut sequence = 0;
                while slot_us < time_limit_us && sequence < OPERATIONS_PER_WORKER_MAX {
                    let at_ms = (slot_us + rng.between(0, spacing_us - 1)) / 1_000;
                    let node = rng.index(self.nodes.max(1));
                    let op = draw(&mut rng, worker, sequence);
                    sequence += 1;
                    if at_ms < self.time_limit_ms {
                        ops.push(Planned { at_ms, node, op });
                    }
                    slot_us += spacing_us;
                }
                ops
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Pacing is a function of the seed; each worker's operations are in time order,
        /// within the time limit and on existing nodes; the rate is roughly kept.
        #[test]
        fn pacing_is_seeded_and_sane(
            seed: u64,
            workers in 1_usize..12,
            nodes in 1_usize..6,
            rate in 1_u64..400,
            time_limit_ms in 0_u64..30_000,
        ) {
            let draw = |rng: &mut SeededRng, _, _| PlannedOp::Read { account: rng.index(3) };
            let pacing = Pacing { workers, rate_per_second: rate, time_limit_ms, nodes };
            let planned = pacing.plan(seed, draw);
            prop_assert_eq!(&planned, &pacing.plan(seed, draw));
            prop_assert_eq!(planned.len(), workers);
            for ops in &planned {
                prop_assert!(ops.windows(2).all(|pair| pair[0].at_ms <= pair[1].at_ms));
                prop_assert!(ops.iter().all(|op| op.at_ms < time_limit_ms && op.node < nodes));
            }
            let total = planned.iter().map(Vec::len).sum::<usize>() as u64;
            let expected = rate * time_limit_ms / 1_000;
            prop_assert!(total <= expected + workers as u64);
            prop_assert!(total + workers as u64 * 2 >= expected * 9 / 10);
        }
    }
}

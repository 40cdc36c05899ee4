//! Workloads: what the clients do during a run. Each workload's plan is drawn from the seed
//! without IO (same seed, same operations); carrying it out against the nodes is in
//! `crate::run`.

pub mod bank;
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

/// Paces `workers` workers so that together they plan `rate_per_second` operations a second
/// until `time_limit_ms`, each at a seeded moment of its slot and on a seeded node among
/// `nodes`; `draw(rng, worker, sequence)` decides what each operation is.
pub fn pace(
    seed: u64,
    workers: usize,
    rate_per_second: u64,
    time_limit_ms: u64,
    nodes: usize,
    mut draw: impl FnMut(&mut SeededRng, u64, u64) -> PlannedOp,
) -> Vec<Vec<Planned>> {
    let workers = workers.max(1);
    // Each worker plans one operation per `spacing_ms`.
    let spacing_ms = (workers as u64).saturating_mul(1_000).div_ceil(rate_per_second.max(1)).max(1);
    (0..workers as u64)
        .map(|worker| {
            let mut rng = SeededRng::fork(seed, worker);
            let mut ops = Vec::new();
            let mut slot_ms = 0;
            let mut sequence = 0;
            while slot_ms < time_limit_ms && sequence < OPERATIONS_PER_WORKER_MAX {
                let at_ms = slot_ms + rng.between(0, spacing_ms - 1);
                let node = rng.index(nodes.max(1));
                let op = draw(&mut rng, worker, sequence);
                sequence += 1;
                if at_ms < time_limit_ms {
                    ops.push(Planned { at_ms, node, op });
                }
                slot_ms += spacing_ms;
            }
            ops
        })
        .collect()
}

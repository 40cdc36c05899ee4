//! Workloads: what the clients do during a run. Each workload's plan is drawn from the seed
//! without IO (same seed, same operations); carrying it out against the nodes is in
//! `crate::run`.

pub mod bank;

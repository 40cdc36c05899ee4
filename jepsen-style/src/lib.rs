//! quotamesh-jepsen: black-box fault injection against real quotamesh nodes. A run starts
//! a region (`topology`), drives a seeded workload through the nodes' gRPC APIs while a
//! seeded nemesis kills and pauses them (`workload`, `nemesis`, `run`), records every
//! operation (`history`), then judges the history against the final state (`checker`) and
//! writes a report (`report`, and a page with plots: `html`). It never links the quotamesh crate: its client is generated
//! from `proto/`, as any outside client's would be.

pub mod checker;
pub mod client;
pub mod history;
pub mod html;
pub mod nemesis;
pub mod proto;
pub mod report;
pub mod rng;
pub mod run;
pub mod topology;
pub mod workload;

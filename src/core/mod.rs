//! The pure core: rate-limit math, policy matching, and the quota and billing ledgers.
//!
//! Nothing here does IO, reads a clock, or imports tokio, tonic, sled, ractor or quinn:
//! every function takes `now_ms` as an argument, so the same code runs in the node, in
//! property tests and (later) inside the Raft state machine. The actors (`crate::actors`)
//! and the gRPC services (`crate::api`) wrap it.

pub mod billing;
pub mod headers;
pub mod ledger;
pub mod policy;
pub mod rate;

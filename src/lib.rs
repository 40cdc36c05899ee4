//! quotamesh: a distributed quota mesh.
//!
//! # Layout
//! - [`core`]: pure rate-limit math and policy matching (no IO, no clock).
//! - [`ledger`]: the Raft groups of a region (openraft, redb log, sled state, gRPC transport).
pub mod core;
pub mod ledger;

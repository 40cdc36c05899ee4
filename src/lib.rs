//! quotamesh: a distributed quota mesh.
//!
//! # Layout
//! - [`core`]: pure rate-limit math and policy matching (no IO, no clock).
pub mod core;

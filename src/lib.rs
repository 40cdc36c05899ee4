//! quotamesh: a distributed quota mesh.
//!
//! Each node answers Envoy Rate Limit Service questions from memory; later slices lease the
//! tokens from a Raft-replicated regional ledger (see DESIGN in the repository).
//!
//! # Layout
//! - [`core`]: pure rate-limit math, policy matching and header formatting (no IO, no clock).
//! - [`actors`]: the tenant-shard actors (ractor) that own per-key state.
//! - [`ledger`]: the Raft groups of a region (openraft, redb log, sled state, gRPC transport).
//! - [`api`]: the gRPC services (Envoy RLS v3) and the metrics/health HTTP endpoints.
//! - [`policy_store`]: loads policy files, swaps them in atomically, reloads on change.
//! - [`node`]: wires a node together; ordered shutdown.
//! - [`raft_host`]: the Raft side of a node: its groups and their shared peer listener.
//! - [`region`]: the QUIC link between regions (mTLS), carrying slice transfers.
//! - [`tls`]: the cluster's CA, node certificates, mTLS between nodes.
//! - [`identity`]: the cluster and node id stored in a data directory, checked on start.
//! - [`config`]: the node's TOML configuration.
//! - [`logging`]: the log filter and format; openraft's expected events kept out of ERROR.
//! - [`metrics`]: every Prometheus metric, by name.
//! - [`clock`]: the only reader of system time.
//! - [`cli`]: the subcommands of the `quotamesh` binary.

pub mod actors;
pub mod api;
pub mod cli;
pub mod clock;
pub mod config;
pub mod core;
pub mod identity;
pub mod ledger;
pub mod logging;
pub mod metrics;
pub mod node;
pub mod policy_follow;
pub mod policy_store;
pub mod raft_health;
pub mod raft_host;
pub mod region;
pub mod slice_follow;
pub mod tls;

//! The pure core: rate-limit math, policy matching, leasing, and the quota and billing
//! ledgers' state machines.
//!
//! Nothing here does IO, reads a clock, or imports tokio, tonic, sled, ractor or quinn:
//! every function takes `now_ms` as an argument, so the same code runs in the node, in
//! property tests and inside the Raft state machine. The actors (`crate::actors`), the
//! gRPC services (`crate::api`) and the Raft layer (`crate::ledger`) wrap it.
//!
//! - [`rate`]: token bucket, sliding and fixed windows on fixed-point tokens.
//! - [`policy`]: policy YAML with located errors, descriptor matching.
//! - [`headers`]: RateLimit response header fields.
//! - [`hit_stats`]: envoyproxy/ratelimit's per-descriptor statistics of one decision.
//! - [`lease`]: node-side lease sizing, refill, expiry and the drift bound.
//! - [`admission`]: one counter's decision on the abuse path (lease, credit, fallback).
//! - [`lease_key`]: a counter's name in the ledger, alike on every node.
//! - [`dense_map`]: the map a shard's stripe keeps its keys in, an entry's size a key.
//! - [`interner`]: values many holders share, kept once by id: a stripe's limits.
//! - [`circuit`]: the circuit breaker around ledger calls.
//! - [`ledger`]: the regional quota ledger's deterministic state machine.
//! - [`policy_versions`]: the region's replicated policy sets, versioned, with history.
//! - [`ledger_time`]: how a group's leader stamps command time; clock offsets.
//! - [`readiness`]: whether a node should take traffic (`/readyz`).
//! - [`rfc3339`]: epoch milliseconds as RFC 3339 text for people.
//! - [`fair_share`]: max-min fair division of a contended key's rate between nodes.
//! - [`region`]: a global limit sliced per region; rebalance planning and transfers.
//! - [`shadow_report`]: shadow rules' would-be rejections as events, summed per rule.
//! - [`canary_audit`]: the synthetic request that proves a fail-closed rule still refuses,
//!   and how a served rule drifted from the intended one.

pub mod admission;
pub mod billing;
pub mod canary_audit;
pub mod circuit;
pub mod dense_map;
pub mod digest;
pub mod fair_share;
pub mod headers;
pub mod hit_stats;
pub mod interner;
pub mod lease;
pub mod lease_key;
pub mod ledger;
pub mod ledger_time;
pub mod policy;
pub mod policy_versions;
pub mod rate;
pub mod readiness;
pub mod region;
pub mod rfc3339;
pub mod shadow_report;

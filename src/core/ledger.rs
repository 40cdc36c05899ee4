//! The quota ledger's state machine: pure, deterministic apply of lease commands.
//!
//! SKELETON: node identity only; the machine is being written.

use serde::{Deserialize, Serialize};

/// A node of a region, as the ledger and Raft know it.
///
/// It is a newtype so a node id cannot be confused with a token count or a log index where it
/// crosses an API. The same type is openraft's `NodeId` for every Raft group (it meets
/// openraft's bounds: `Copy`, `Ord`, `Display`, `Default`, serde), so there is one id per node
/// across the ledger, Raft and the CLI. It serializes as a bare `u64`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<u64> for NodeId {
    fn from(id: u64) -> Self {
        Self(id)
    }
}

//! The link between regions: QUIC (quinn) with mutual TLS under the cluster CA, carrying the
//! transfer messages of `crate::core::region::transfer` between the rebalancers of regions.
//!
//! ```text
//!  region A (donor)                                    region B (recipient)
//!  PeerLink::call(Credit{id})  ── one connection per peer region, one stream per call ──▶
//!     timeout on every call, keepalive, reconnect    RegionEndpoint::serve: checks the peer
//!     with backoff; a peer down fails the call        certificate names a node of a peer
//!     at once while it backs off                      region, and that the region speaks
//!  ◀── RegionReply::Received(Credited) ─────────────  only for its own transfers, then asks
//!                                                     the handler (the region's ledger)
//! ```
//!
//! - [`wire`]: the messages and their size limit.
//! - [`transport`]: the endpoint, the per-peer links and the identity checks.
//!
//! The rules of transfers (what a credit does, idempotency, conservation) are the core's;
//! this module only moves bytes between regions that proved who they are.

pub mod transport;
pub mod wire;

use std::net::SocketAddr;

/// Default QUIC (UDP) address a node listens on for other regions.
pub const QUIC_ADDR_DEFAULT: &str = "127.0.0.1:8443";

/// Another region, as `[[regions]]` in the node's configuration names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionPeer {
    /// The region's name, as its nodes' certificates name it.
    pub name: String,
    /// Where one of its voters answers QUIC (any voter serves a peer).
    pub quic_addr: SocketAddr,
}

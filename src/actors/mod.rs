//! ractor actors, the thin shells around the core.
//!
//! ```text
//!  RLS handler ──(hot path: lock one stripe, spend a leased balance)──▶ ShardTable stripes
//!       │  │                                                             ▲ create / answers /
//!       │  └──(cold key: cast Admit + one-shot reply)──▶ ShardActor ─────┘ sweep / evict
//!       │                                                  │ returns       ▲ answers (cast)
//!       └──(refill or short key: ask)──▶ LeaseBroker ◀─────┘               │
//!                                          └──one batched command per ~1 ms──▶ quota ledger
//! ```
//!
//! - [`shard`]: the tenant-shard actors and the per-key tables they own. A decision never
//!   waits on an actor for a key it has seen: a ractor `call` costs 7-15 us on a busy
//!   machine, a locked stripe tens of nanoseconds. The actor owns which keys exist.
//! - [`lease_broker`]: gathers lease asks and returns from every shard into one ledger
//!   command per batch window, owns the circuit breaker, and casts the answers back.
//!
//! - [`rebalancer`]: on the leader of the quota group, moves tokens of global limits
//!   between regions over QUIC, and makes every voter enforce its region's ledger slices.
//!
//! Mailboxes are unbounded in ractor, so every sender bounds its in-flight messages itself
//! (see `shard::COLD_ADMISSIONS_INFLIGHT_MAX` and `lease_broker::BROKER_QUEUE_MAX`).

pub mod lease_broker;
pub mod lease_protocol;
pub mod rebalancer;
pub mod shard;

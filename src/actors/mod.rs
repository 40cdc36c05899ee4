//! ractor actors, the thin shells around the core.
//!
//! ```text
//!  RLS handler ──(hot path: lock one stripe, core math)──▶ ShardTable stripes
//!       │                                                    ▲ insert / evict / sweep
//!       └──(cold key: cast Admit + one-shot reply)──▶ ShardActor (one per shard)
//! ```
//!
//! - [`shard`]: the tenant-shard actors and the per-key tables they own. A decision never
//!   waits on an actor for a key it has seen: a ractor `call` costs 7-15 us on a busy
//!   machine, a locked stripe tens of nanoseconds. The actor owns which keys exist.
//!
//! Mailboxes are unbounded in ractor, so every sender bounds its in-flight messages itself
//! (see `shard::COLD_ADMISSIONS_INFLIGHT_MAX`).

pub mod shard;

//! The Raft layer of a region: openraft 0.9 groups with durable storage and a gRPC transport.
//!
//! A region runs several Raft groups (`quota` now, `billing` later), each with its own
//! storage and its own state machine, on one shared transport. This module owns everything
//! that touches openraft, redb and sled; the state machines' rules live in `crate::core`
//! and reach this layer through [`GroupMachine`].
//!
//! ```text
//!  caller ──write(cmd)──▶ RaftGroup ──leader?──▶ openraft client_write ──▶ commit ──▶ apply
//!                             │ no: Forward RPC to the leader (one hop, never re-forwarded)
//!                             ▼
//!                  RaftPeer gRPC service (routes by group name) on the leader's node
//!
//!  openraft ──append/vote/snapshot──▶ network::PeerNetwork ──gRPC──▶ service::RaftPeerService
//!                                                                    └─▶ that group's Raft
//!
//!  storage per group, in its own directory:
//!    raft-log.redb  redb: entries, vote, committed, purge marker  (source of truth, fsync'd)
//!    state/         sled: the machine's records, applied id, membership  (rebuildable)
//!    snapshots/     the latest snapshot, one fsync'd file     (rebuilds sled after a crash)
//! ```
//!
//! - [`log_store`]: the Raft log in redb (`RaftLogStorage`).
//! - [`state_store`]: the state machine's records in sled, snapshots in files (`RaftStateMachine`).
//! - [`network`]: the client side of the transport (`RaftNetworkFactory`).
//! - [`service`]: the server side, one tonic service routing to every group of the process.
//! - [`group`]: [`RaftGroup`], the handle a node uses: open, initialize, write, read, members.
//! - `core_gate`: the door every call into openraft's core passes, closed first at shutdown.
//! - [`ledger_time`]: the leader's stamp on every command, and the clock offsets it sees.
//! - [`quota`]: the quota group's type configuration over `crate::core::ledger`.
//! - [`billing`]: the billing group's type configuration over `crate::core::billing`.

// openraft's error types are fixed by its traits and are large; boxing ours alone gains nothing.
#![allow(clippy::result_large_err)]

pub mod billing;
mod core_gate;
pub mod group;
pub mod ledger_time;
pub mod log_store;
pub mod network;
pub mod quota;
pub mod service;
pub mod state_store;

use std::io::Cursor;

pub use crate::core::ledger::NodeId;
pub use billing::{BILLING_GROUP_NAME, BillingGroup};
pub use group::{GroupSettings, MembershipError, OpenError, RaftGroup, ShutdownError, WriteError};
pub use network::{PeerChannels, PeerNetwork};
pub use openraft::BasicNode;
pub use quota::{QUOTA_GROUP_NAME, QuotaGroup};
pub use service::RaftPeerService;

/// Generated code for `proto/quotamesh/raft/v1/raft.proto`.
#[allow(missing_docs, unused_qualifications, clippy::all)]
pub mod proto {
    tonic::include_proto!("quotamesh.raft.v1");
}

/// Largest gRPC message between Raft peers, both ways, on server and client.
///
/// An `AppendEntries` batch is split by openraft when the client reports it too large
/// (`PayloadTooLarge`), so this bounds memory per call rather than throughput.
pub const PEER_MESSAGE_BYTES_MAX: usize = 16 * 1024 * 1024;
/// Largest encoded command a group accepts for a write; a command must fit in one message
/// with room for the log entry's framing.
pub const COMMAND_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Snapshot chunk size sent in one `InstallSnapshot` call.
pub const SNAPSHOT_CHUNK_BYTES: usize = 4 * 1024 * 1024;
/// Largest snapshot a node builds or accepts; a snapshot is held in memory while it moves.
pub const SNAPSHOT_BYTES_MAX: usize = 1024 * 1024 * 1024;
/// Longest group name; names route requests and name directories.
pub const GROUP_NAME_BYTES_MAX: usize = 64;

const _: () = assert!(COMMAND_BYTES_MAX + 64 * 1024 <= PEER_MESSAGE_BYTES_MAX);
const _: () = assert!(SNAPSHOT_CHUNK_BYTES + 64 * 1024 <= PEER_MESSAGE_BYTES_MAX);
const _: () = assert!(SNAPSHOT_CHUNK_BYTES <= SNAPSHOT_BYTES_MAX);

/// The openraft type configuration of one Raft group.
///
/// Every group shares the node id, node address, log entry, snapshot and runtime types, so
/// the storage, transport and handle below are written once; a group only names its
/// [`GroupMachine`]. Declare one with `openraft::declare_raft_types!` (with `NodeId =
/// NodeId`) and implement this trait for it, as [`quota::QuotaGroup`] does.
pub trait GroupConfig:
    openraft::RaftTypeConfig<
        D: Clone,
        NodeId = NodeId,
        Node = BasicNode,
        Entry = openraft::Entry<Self>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
        Responder = openraft::impls::OneshotResponder<Self>,
    >
{
    /// The deterministic state machine this group replicates.
    type Machine: GroupMachine<Command = Self::D, Response = Self::R>;

    /// Whether `command` may reach this group through a `Forward` call from node `sender`
    /// (the Raft id its verified certificate names), whose certificate is a voter's
    /// (`sender_may_vote`) or a gateway's. A node proposes only what it may propose itself:
    /// never on another node's behalf.
    ///
    /// # Errors
    /// Why not, for the refusal's `PERMISSION_DENIED`.
    fn check_forward(
        command: &Self::D,
        sender: NodeId,
        sender_may_vote: bool,
    ) -> Result<(), String>;
}

/// One record of a machine's materialized state: key and encoded value.
pub type Record = (Vec<u8>, Vec<u8>);

/// One changed record of a machine's materialized state: `None` deletes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordChange {
    /// The record's key, unique within the machine.
    pub key: Vec<u8>,
    /// The new encoded value, or `None` when the record was removed.
    pub value: Option<Vec<u8>>,
}

/// A record read back from storage could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("record {key:?} cannot be decoded: {reason}")]
pub struct RecordError {
    /// The record's key, lossily printed.
    pub key: String,
    /// Why it was refused.
    pub reason: String,
}

/// The deterministic state machine of one group, as the storage layer sees it.
///
/// The machine keeps its working state in memory (apply must be fast and must not wait on a
/// disk), and tells the store which records changed after each batch, so the store writes
/// them to sled together with the applied log id. On open, and after a snapshot is installed,
/// the machine is rebuilt from those records.
pub trait GroupMachine: Sized + Send + Sync + 'static {
    /// The command a client writes.
    type Command: openraft::AppData + Clone;
    /// What applying one log entry answers.
    type Response: openraft::AppDataResponse;

    /// The response to a log entry that carries no command (blank or membership).
    fn empty_response() -> Self::Response;

    /// Applies one committed command. Must be deterministic: the same commands in the same
    /// order give the same state and responses on every replica.
    fn apply(&mut self, log_index: u64, command: &Self::Command) -> Self::Response;

    /// Returns and forgets the records changed since the last call.
    fn take_changes(&mut self) -> Vec<RecordChange>;

    /// Rebuilds the machine from all its records (an empty iterator gives a new machine).
    ///
    /// # Errors
    /// [`RecordError`] when a record cannot be decoded.
    fn from_records<I>(records: I) -> Result<Self, RecordError>
    where
        I: IntoIterator<Item = Record>;

    /// A digest of the whole state, equal on replicas that applied the same commands.
    fn digest(&self) -> u64;

    /// Ledger time as applied so far: where a new leader's stamps continue from
    /// (`crate::core::ledger_time`).
    fn ledger_time_ms(&self) -> u64;

    /// Sets the time `command` applies at. The leader stamps every command before it
    /// proposes it, over whatever time its proposer put there.
    fn stamp(command: &mut Self::Command, now_ms: u64);

    /// A number that changes when something outside the group should look at the machine
    /// again (the quota ledger's policy version). The store publishes it on a watch channel
    /// after each applied batch ([`state_store::MachineView::subscribe`]): apply never waits
    /// on whoever follows it. The default never changes.
    fn change_signal(&self) -> u64 {
        0
    }
}

/// Error values of openraft's storage traits, built from any error.
fn storage_io(
    subject: openraft::ErrorSubject<NodeId>,
    verb: openraft::ErrorVerb,
    error: &(dyn std::error::Error + 'static),
) -> openraft::StorageError<NodeId> {
    openraft::StorageIOError::new(subject, verb, openraft::AnyError::from_dyn(error, None)).into()
}

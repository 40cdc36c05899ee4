//! [`RaftGroup`]: the handle a node holds for one Raft group it runs.
//!
//! It opens the group's storage in its own directory, starts openraft, and offers what a
//! node needs: bootstrap and membership changes, writes with a deadline (forwarded to the
//! leader when this node is not it), local reads of the machine, and metrics.
//!
//! ```text
//!  write(cmd, timeout)
//!    ├─ this node leads ─────────▶ raft.client_write ──▶ response
//!    │                                  └─ ForwardToLeader (lost leadership) ─┐
//!    ├─ another node leads ──Forward RPC──▶ its raft.client_write ──▶ response │
//!    │                                  └─ ForwardToLeader ───────────────────┤
//!    ├─ no leader known, this node is a member ── wait for the metrics ◀──────┤
//!    └─ no leader known, not a member (a gateway) ────────────────────────────┘
//!         └─ cached leader, else the next seed ──Forward RPC──▶ as above
//!  until the deadline; a call whose outcome is unknown is never repeated.
//! ```
//!
//! A member (voter or learner) learns the leader from its own Raft metrics. A node outside
//! the group (a gateway, or a voter not yet added) never does, so it is given seeds, the
//! region's configured voters, and keeps the leader it last reached: a successful write or a
//! `ForwardToLeader` naming a leader sets it; a node that cannot be reached, does not answer,
//! or knows no leader clears it. A follower seed answers `ForwardToLeader` with the leader's
//! id and address (`service.rs` runs the write there, never forwards it), so a write from a
//! gateway takes at most two hops: a seed, then the leader it names.
//!
//! Every call into openraft's core, this node's own and its peers' messages alike, passes the
//! group's gate (`core_gate`): shutdown closes it first, so the core stops with no call
//! waiting on it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use openraft::error::{
    CheckIsLeaderError, ClientWriteError, InitializeError, InstallSnapshotError, RaftError,
};
use openraft::metrics::Wait;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::storage::RaftLogStorage;
use openraft::{
    ChangeMembers, Config, ConfigError, Raft, RaftMetrics, ServerState, SnapshotPolicy,
};
use parking_lot::Mutex;
use prometheus::Histogram;
use tokio::sync::watch;
use tokio::time::Instant;

use super::core_gate::CoreGate;
use super::ledger_time::{ClockOffsets, Forwarded, Stamper};
use super::log_store::{LogOpenError, LogStore};
use super::network::{PeerCallError, PeerChannels, PeerNetwork, Rpc};
use super::state_store::{MachineView, StateOpenError, StateStore};
use super::{
    BasicNode, COMMAND_BYTES_MAX, GROUP_NAME_BYTES_MAX, GroupConfig, GroupMachine, NodeId,
    SNAPSHOT_CHUNK_BYTES,
};

/// How long a write waits between looks for a leader while none is known.
const LEADER_POLL: Duration = Duration::from_millis(20);
/// Most log entries in one `AppendEntries` call; a quota command carries up to a few
/// thousand lease requests, so a bounded count keeps calls well under the message limit.
const APPEND_ENTRIES_PER_CALL_MAX: u64 = 64;
/// How long [`RaftGroup::shutdown`] waits for openraft's tasks to drop the storage.
pub const STORAGE_RELEASE_TIMEOUT: Duration = Duration::from_secs(10);
/// File name of the Raft log inside a group's directory.
const LOG_FILE_NAME: &str = "raft-log.redb";
/// Most seeds a group is given: the region's voters, as the configuration bounds them.
pub const SEEDS_MAX: usize = super::network::PEER_CHANNELS_MAX;

/// How to run one group on one node. [`GroupSettings::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct GroupSettings {
    /// The group's name, routing key on the transport: `[a-z0-9_-]`, at most
    /// [`GROUP_NAME_BYTES_MAX`] bytes.
    pub group: String,
    /// This node's id; stable for the life of its directory.
    pub node_id: NodeId,
    /// The group's own directory (log, state, snapshots).
    pub directory: PathBuf,
    /// Leader heartbeat period.
    pub heartbeat_interval_ms: u64,
    /// Election timeout range; a follower that hears no leader for a random time in it
    /// starts an election.
    pub election_timeout_min_ms: u64,
    /// Upper end of the election timeout range.
    pub election_timeout_max_ms: u64,
    /// A snapshot is built once this many entries were applied since the last one.
    pub snapshot_every_logs: u64,
    /// Entries kept in the log behind a snapshot, so a briefly lagging follower catches up
    /// from the log rather than from a snapshot.
    pub logs_kept_after_snapshot: u64,
    /// Where a write goes when this node is not a member and so learns no leader itself (a
    /// gateway): the region's voters with their Raft addresses, at most [`SEEDS_MAX`]. This
    /// node's own id is ignored. Empty (the default): such a write waits for the metrics.
    pub seeds: BTreeMap<NodeId, BasicNode>,
    /// Where this node, leading, judges and reports the clocks of the nodes whose writes it
    /// proposes; shared by the groups of a process. Default: `max_clock_offset_ms` 500, no
    /// metrics.
    pub clock_offsets: ClockOffsets,
    /// Where the Raft log records how long each fsync'd write of appended entries took
    /// (the group's series of `quotamesh_raft_log_fsync_duration_seconds`). Default: none.
    pub log_fsync_seconds: Option<Histogram>,
}

impl GroupSettings {
    /// Defaults for a group on a regional network: heartbeat 50 ms, elections after 300 to
    /// 600 ms of silence, a snapshot every 10,000 entries keeping 1,000 behind it.
    pub fn new(group: impl Into<String>, node_id: NodeId, directory: impl Into<PathBuf>) -> Self {
        Self {
            group: group.into(),
            node_id,
            directory: directory.into(),
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 300,
            election_timeout_max_ms: 600,
            snapshot_every_logs: 10_000,
            logs_kept_after_snapshot: 1_000,
            seeds: BTreeMap::new(),
            clock_offsets: ClockOffsets::default(),
            log_fsync_seconds: None,
        }
    }

    fn raft_config(&self) -> Result<Config, ConfigError> {
        Config {
            cluster_name: self.group.clone(),
            heartbeat_interval: self.heartbeat_interval_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_every_logs),
            max_in_snapshot_log_to_keep: self.logs_kept_after_snapshot,
            max_payload_entries: APPEND_ENTRIES_PER_CALL_MAX,
            snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES as u64,
            ..Config::default()
        }
        .validate()
    }
}

/// Why a group could not be opened. None of these goes away by retrying as is.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The group name is empty, too long or has characters outside `[a-z0-9_-]`.
    #[error("invalid group name {0:?}: use 1 to {GROUP_NAME_BYTES_MAX} characters of [a-z0-9_-]")]
    GroupName(String),
    /// More than [`SEEDS_MAX`] seeds were given.
    #[error("{count} seeds for group {group:?}; at most {SEEDS_MAX}")]
    TooManySeeds {
        /// The group.
        group: String,
        /// How many were given.
        count: usize,
    },
    /// The Raft timings or snapshot settings are inconsistent.
    #[error("invalid Raft settings for group {group:?}: {source}")]
    Settings {
        /// The group.
        group: String,
        /// openraft's reason.
        #[source]
        source: ConfigError,
    },
    /// The group's directory could not be created.
    #[error("cannot create the group directory {path}: {source}")]
    Directory {
        /// The directory.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The Raft log could not be opened.
    #[error(transparent)]
    Log(#[from] LogOpenError),
    /// The state machine store could not be opened.
    #[error(transparent)]
    State(#[from] StateOpenError),
    /// openraft refused to start on this storage.
    #[error("Raft group {group:?} failed to start: {reason}")]
    Start {
        /// The group.
        group: String,
        /// openraft's reason.
        reason: String,
    },
}

/// Why a write was not acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WriteError {
    /// The encoded command is larger than [`COMMAND_BYTES_MAX`]; it was not sent.
    #[error("command of {bytes} bytes exceeds the limit of {COMMAND_BYTES_MAX}")]
    TooLarge {
        /// The command's encoded size.
        bytes: usize,
    },
    /// No reachable leader was found before the deadline; the command was not applied.
    #[error("no reachable leader within the deadline; the command was not applied")]
    NoLeader,
    /// The deadline passed after the command was handed to a leader: it may or may not be
    /// applied. Retrying may apply it twice.
    #[error("no answer within the deadline; the command may or may not have been applied")]
    Timeout,
    /// The leader was lost after the command was handed to it: it may or may not be applied.
    #[error(
        "lost the leader {leader} after sending; the command may or may not have been applied: {reason}"
    )]
    LeaderLost {
        /// The node the command was sent to.
        leader: NodeId,
        /// What went wrong.
        reason: String,
    },
    /// The leader could not read the command (nodes on different versions); not applied.
    #[error("the leader {leader} refused the command: {reason}")]
    Refused {
        /// The node that refused it.
        leader: NodeId,
        /// Its reason.
        reason: String,
    },
    /// This node's Raft group has stopped (shutdown or a storage failure).
    #[error("the Raft group on this node has stopped: {0}")]
    Stopped(String),
}

impl WriteError {
    /// Whether sending the same command again (here, later, or through another node) may
    /// get it applied: false when the group refuses the command as such (too large, or the
    /// leader cannot read it), which no retry changes.
    pub fn retry_may_help(&self) -> bool {
        !matches!(self, Self::TooLarge { .. } | Self::Refused { .. })
    }

    /// Whether the command may have been applied although no answer came back.
    pub fn may_have_applied(&self) -> bool {
        matches!(self, Self::Timeout | Self::LeaderLost { .. })
    }
}

/// Why a bootstrap or membership change failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// The group already has a membership (it was initialized before, here or by a peer).
    #[error("the group is already initialized")]
    AlreadyInitialized,
    /// Membership changes run on the leader; this node is not it.
    #[error("this node is not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader this node knows of, if any.
        leader: Option<NodeId>,
    },
    /// openraft refused the change (another change in progress, unknown learner, ...).
    #[error("membership change refused: {0}")]
    Refused(String),
    /// This node's Raft group has stopped.
    #[error("the Raft group on this node has stopped: {0}")]
    Stopped(String),
}

fn membership_error(
    error: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
) -> MembershipError {
    match error {
        RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => {
            MembershipError::NotLeader { leader: forward.leader_id }
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(refused)) => {
            MembershipError::Refused(refused.to_string())
        }
        RaftError::Fatal(fatal) => MembershipError::Stopped(fatal.to_string()),
    }
}

/// A running Raft group on this node; cheap to clone.
pub struct RaftGroup<C: GroupConfig> {
    name: Arc<str>,
    node_id: NodeId,
    raft: Raft<C>,
    /// Every call into `raft`'s core passes it, so that shutdown stops the core idle.
    gate: CoreGate,
    view: MachineView<C::Machine>,
    channels: PeerChannels,
    storage: StorageLiveness,
    route: Arc<LeaderRoute>,
    stamper: Arc<Stamper>,
    clock_offsets: ClockOffsets,
    /// The index of the last entry in this node's log when it started (0 for none).
    recovery_index: u64,
}

/// How a node outside the group finds the leader: its seeds and the leader it last reached.
/// Shared by every clone of a [`RaftGroup`].
struct LeaderRoute {
    /// This node, which is never cached: it knows whether it leads from its own metrics.
    node_id: NodeId,
    /// The seeds, without this node, in id order.
    seeds: Vec<(NodeId, BasicNode)>,
    /// The seed the next look for a leader starts at (modulo the count).
    next_seed: AtomicUsize,
    /// The leader last reached or named by a `ForwardToLeader`.
    cached: Mutex<Option<(NodeId, BasicNode)>>,
}

impl LeaderRoute {
    fn new(node_id: NodeId, seeds: &BTreeMap<NodeId, BasicNode>) -> Self {
        let seeds: Vec<(NodeId, BasicNode)> = seeds
            .iter()
            .filter(|(id, _)| **id != node_id)
            .map(|(id, node)| (*id, node.clone()))
            .collect();
        // Nodes start at different seeds, so gateways spread their first looks.
        let start = usize::try_from(node_id.0).unwrap_or(0);
        Self { node_id, seeds, next_seed: AtomicUsize::new(start), cached: Mutex::new(None) }
    }

    fn cached(&self) -> Option<(NodeId, BasicNode)> {
        self.cached.lock().clone()
    }

    fn remember(&self, leader: NodeId, node: BasicNode) {
        if leader != self.node_id {
            *self.cached.lock() = Some((leader, node));
        }
    }

    /// Clears the cache if it names `node_id`: that node is not (or no longer) the leader.
    fn forget(&self, node_id: NodeId) {
        let mut cached = self.cached.lock();
        if cached.as_ref().is_some_and(|(id, _)| *id == node_id) {
            *cached = None;
        }
    }

    /// The next seed in rotation.
    fn next_seed(&self) -> Option<(NodeId, BasicNode)> {
        if self.seeds.is_empty() {
            return None;
        }
        let turn = self.next_seed.fetch_add(1, Ordering::Relaxed);
        self.seeds.get(turn % self.seeds.len()).cloned()
    }

    fn seed_node(&self, node_id: NodeId) -> Option<BasicNode> {
        self.seeds.iter().find(|(id, _)| *id == node_id).map(|(_, node)| node.clone())
    }
}

/// Weak handles on the storage openraft owns, to know when it let go of the files.
#[derive(Clone)]
struct StorageLiveness {
    log: Weak<redb::Database>,
    state: Weak<sled::Db>,
}

impl StorageLiveness {
    fn released(&self) -> bool {
        self.log.strong_count() == 0 && self.state.strong_count() == 0
    }
}

/// Why a group did not stop cleanly. Shutting down again will not help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShutdownError {
    /// openraft's core task failed while stopping.
    #[error("the Raft core failed while stopping: {0}")]
    Raft(String),
    /// openraft's tasks still held the storage after [`STORAGE_RELEASE_TIMEOUT`]; reopening
    /// the directory in this process would fail on sled's lock.
    #[error("the group's storage was still in use {STORAGE_RELEASE_TIMEOUT:?} after shutdown")]
    StorageBusy,
}

impl<C: GroupConfig> Clone for RaftGroup<C> {
    fn clone(&self) -> Self {
        Self {
            name: Arc::clone(&self.name),
            node_id: self.node_id,
            raft: self.raft.clone(),
            gate: self.gate.clone(),
            view: self.view.clone(),
            channels: self.channels.clone(),
            storage: self.storage.clone(),
            route: Arc::clone(&self.route),
            stamper: Arc::clone(&self.stamper),
            clock_offsets: self.clock_offsets.clone(),
            recovery_index: self.recovery_index,
        }
    }
}

fn valid_group_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= GROUP_NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

impl<C: GroupConfig> RaftGroup<C> {
    /// Opens the group's storage under `settings.directory` and starts its Raft node, which
    /// talks to peers over `channels`. A fresh directory gives an uninitialized node: call
    /// [`Self::initialize`] on one node of a new group, or add it from the leader.
    ///
    /// Register the returned group with the process's
    /// [`RaftPeerService`](super::RaftPeerService) so peers can reach it.
    ///
    /// # Errors
    /// [`OpenError`] when the settings are invalid or the storage cannot be opened.
    pub async fn open(settings: &GroupSettings, channels: PeerChannels) -> Result<Self, OpenError> {
        if !valid_group_name(&settings.group) {
            return Err(OpenError::GroupName(settings.group.clone()));
        }
        if settings.seeds.len() > SEEDS_MAX {
            return Err(OpenError::TooManySeeds {
                group: settings.group.clone(),
                count: settings.seeds.len(),
            });
        }
        let config = settings
            .raft_config()
            .map_err(|source| OpenError::Settings { group: settings.group.clone(), source })?;
        let directory = settings.directory.clone();
        std::fs::create_dir_all(&directory).map_err(|source| OpenError::Directory {
            path: directory.display().to_string(),
            source,
        })?;
        let (mut log_store, state_store) =
            open_stores::<C>(&directory, settings.log_fsync_seconds.clone()).await?;
        let recovery_index = log_store
            .get_log_state()
            .await
            .map_err(|error| OpenError::Start {
                group: settings.group.clone(),
                reason: error.to_string(),
            })?
            .last_log_id
            .map_or(0, |log_id| log_id.index);
        let view = state_store.view();
        let storage = StorageLiveness { log: log_store.liveness(), state: state_store.liveness() };
        let name: Arc<str> = Arc::from(settings.group.as_str());
        let network = PeerNetwork::new(Arc::clone(&name), settings.node_id, channels.clone());
        let raft = Raft::new(settings.node_id, Arc::new(config), network, log_store, state_store)
            .await
            .map_err(|fatal| OpenError::Start {
                group: settings.group.clone(),
                reason: fatal.to_string(),
            })?;
        let route = Arc::new(LeaderRoute::new(settings.node_id, &settings.seeds));
        let stamper = Arc::new(Stamper::default());
        tokio::spawn(anchor_on_election(raft.metrics(), Arc::downgrade(&stamper), view.clone()));
        Ok(Self {
            name,
            node_id: settings.node_id,
            raft,
            gate: CoreGate::default(),
            view,
            channels,
            storage,
            route,
            stamper,
            clock_offsets: settings.clock_offsets.clone(),
            recovery_index,
        })
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// Whether the group's core has stopped (shutdown, or a storage failure).
    pub(crate) fn core_stopped(&self) -> bool {
        self.raft.metrics().borrow().running_state.is_err()
    }

    /// Waits on the group's metrics (an applied index, a purge), for at most `timeout`.
    pub fn wait(&self, timeout: Duration) -> Wait<NodeId, BasicNode, openraft::TokioRuntime> {
        self.raft.wait(Some(timeout))
    }

    /// Confirms with a quorum that this node still leads, for a linearizable read; returns
    /// the log id the read must see applied.
    ///
    /// # Errors
    /// openraft's, when this node does not lead or no quorum answered; `Fatal::Stopped`
    /// when the group is stopping.
    pub async fn ensure_linearizable(
        &self,
    ) -> Result<
        Option<openraft::LogId<NodeId>>,
        RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>,
    > {
        self.gate.call(self.raft.ensure_linearizable()).await
    }

    /// Hands a leader's `AppendEntries` to this node's core (the transport's server side).
    pub(crate) async fn append_entries(
        &self,
        request: AppendEntriesRequest<C>,
    ) -> Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        self.gate.call(self.raft.append_entries(request)).await
    }

    /// Hands a candidate's `Vote` to this node's core.
    pub(crate) async fn vote(
        &self,
        request: VoteRequest<NodeId>,
    ) -> Result<VoteResponse<NodeId>, RaftError<NodeId>> {
        self.gate.call(self.raft.vote(request)).await
    }

    /// Hands a leader's snapshot chunk to this node's core.
    pub(crate) async fn install_snapshot(
        &self,
        request: InstallSnapshotRequest<C>,
    ) -> Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        self.gate.call(self.raft.install_snapshot(request)).await
    }

    /// Forms a new group from `members` (voters with their Raft addresses). Call it on one
    /// node of a brand-new group, which must be among `members`.
    ///
    /// # Errors
    /// [`MembershipError::AlreadyInitialized`] when the group has a membership already.
    pub async fn initialize(
        &self,
        members: BTreeMap<NodeId, BasicNode>,
    ) -> Result<(), MembershipError> {
        // Asked first so that a restarted bootstrap node does not make openraft log its own
        // "Can not initialize" ERROR for what is expected (`crate::logging`).
        if self.is_initialized().await? {
            return Err(MembershipError::AlreadyInitialized);
        }
        match self.gate.call(self.raft.initialize(members)).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => {
                Err(MembershipError::AlreadyInitialized)
            }
            Err(RaftError::APIError(InitializeError::NotInMembers(refused))) => {
                Err(MembershipError::Refused(refused.to_string()))
            }
            Err(RaftError::Fatal(fatal)) => Err(MembershipError::Stopped(fatal.to_string())),
        }
    }

    /// Adds a non-voting member (a learner, with a replica of its own) and waits until it
    /// has caught up with the log. Run it on the leader. (A gateway is no member at all.)
    ///
    /// # Errors
    /// [`MembershipError`] when this node is not the leader or the change is refused.
    pub async fn add_learner(
        &self,
        node_id: NodeId,
        node: BasicNode,
    ) -> Result<(), MembershipError> {
        self.gate
            .call(self.raft.add_learner(node_id, node, true))
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Makes `voters` the voting members (each must be a member already, e.g. a learner);
    /// removed voters stay as learners. Run it on the leader.
    ///
    /// # Errors
    /// [`MembershipError`] when this node is not the leader or the change is refused.
    pub async fn change_voters(&self, voters: BTreeSet<NodeId>) -> Result<(), MembershipError> {
        self.gate
            .call(self.raft.change_membership(voters, true))
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Makes the learner `node_id` a voter (joint consensus). Run it on the leader.
    ///
    /// # Errors
    /// [`MembershipError`] when this node is not the leader, `node_id` is not a learner, or
    /// another change is in progress.
    pub async fn promote_voter(&self, node_id: NodeId) -> Result<(), MembershipError> {
        let change = ChangeMembers::AddVoterIds(BTreeSet::from([node_id]));
        self.gate
            .call(self.raft.change_membership(change, false))
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Removes `node_id` from the group altogether: a voter leaves the voters (joint
    /// consensus) and the members at once; a learner leaves the members. Run it on the
    /// leader; removing the leader itself makes it step down once the change commits.
    ///
    /// # Errors
    /// [`MembershipError`] when this node is not the leader, `node_id` is not a member, or
    /// another change is in progress.
    pub async fn remove_member(&self, node_id: NodeId) -> Result<(), MembershipError> {
        let is_voter = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .any(|voter| voter == node_id);
        let ids = BTreeSet::from([node_id]);
        let change = if is_voter {
            ChangeMembers::RemoveVoters(ids)
        } else {
            ChangeMembers::RemoveNodes(ids)
        };
        self.gate
            .call(self.raft.change_membership(change, false))
            .await
            .map(|_| ())
            .map_err(membership_error)
    }

    /// Whether the group has a membership on this node (initialized here or joined).
    ///
    /// # Errors
    /// [`MembershipError::Stopped`] when the group has stopped.
    pub async fn is_initialized(&self) -> Result<bool, MembershipError> {
        self.gate
            .call(self.raft.is_initialized())
            .await
            .map_err(|fatal| MembershipError::Stopped(fatal.to_string()))
    }

    /// The index of the last entry this node knows to be committed (by a quorum).
    ///
    /// # Errors
    /// [`MembershipError::Stopped`] when the group has stopped.
    pub async fn committed_index(&self) -> Result<Option<u64>, MembershipError> {
        self.gate
            .call(self.raft.with_raft_state(|state| state.committed.map(|id| id.index)))
            .await
            .map_err(|fatal| MembershipError::Stopped(fatal.to_string()))
    }

    /// The group's Raft metrics as this node sees them (leader, term, log and applied
    /// indexes, membership, replication lag when leading).
    pub fn metrics(&self) -> RaftMetrics<NodeId, BasicNode> {
        self.raft.metrics().borrow().clone()
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<NodeId> {
        self.raft.metrics().borrow().current_leader
    }

    /// Whether this node is in the group's membership as it sees it (a voter or a learner),
    /// so it learns the leader from its own metrics. False on a gateway and on a node not
    /// yet added (or formed).
    pub fn is_member(&self) -> bool {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        metrics.membership_config.membership().get_node(&self.node_id).is_some()
    }

    /// How many voters the group has as this node knows it: its membership's voters when it
    /// is a member, else its seeds (the configured voters; a gateway's only view).
    pub fn voter_count(&self) -> usize {
        if self.is_member() {
            self.raft.metrics().borrow().membership_config.membership().voter_ids().count()
        } else {
            self.route.seeds.len()
        }
    }

    /// The seeds a write goes through when this node is not a member, without this node.
    pub fn seeds(&self) -> impl Iterator<Item = (NodeId, &BasicNode)> {
        self.route.seeds.iter().map(|(id, node)| (*id, node))
    }

    /// The leader a write from this node last reached or was sent to by a `ForwardToLeader`,
    /// if no failure has cleared it since: a gateway's view of the leader.
    pub fn cached_leader(&self) -> Option<NodeId> {
        self.route.cached().map(|(id, _)| id)
    }

    /// The machine's change signal ([`GroupMachine::change_signal`]) as applied on this node.
    pub fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.view.subscribe()
    }

    /// Where a read from a node outside the group goes: the leader its writes last reached,
    /// else the next seed (so a seed that is down is passed over on the next read).
    pub(crate) fn read_target(&self) -> Option<(NodeId, BasicNode)> {
        self.route.cached().or_else(|| self.route.next_seed())
    }

    /// Forgets `node_id` as the cached leader after a failed read, as a failed write does.
    pub(crate) fn forget_target(&self, node_id: NodeId) {
        self.route.forget(node_id);
    }

    /// The process's channels to its peers.
    pub(crate) fn channels(&self) -> &PeerChannels {
        &self.channels
    }

    /// Runs `read` on the machine as applied on this node so far; it may be behind the leader.
    pub fn read<T>(&self, read: impl FnOnce(&C::Machine) -> T) -> T {
        self.view.read(read)
    }

    /// Runs `read` on the machine as applied on this node and returns its answer with the
    /// index of the last entry applied, both seen at one instant.
    pub fn read_at_applied<T>(&self, read: impl FnOnce(&C::Machine) -> T) -> (T, Option<u64>) {
        self.view.read_at_applied(read)
    }

    /// The digest of the machine as applied on this node, to compare replicas.
    pub fn digest(&self) -> u64 {
        self.view.read(GroupMachine::digest)
    }

    /// Whether this node has applied every entry its log held when it started. Until then
    /// its read index may miss acknowledged writes: openraft 0.9 lets a leader keep its
    /// leadership across a restart, and the committed index it restarts from is a hint that
    /// a crash may have lost (openraft issue 1511), so the entries past it were committed
    /// (and acknowledged) for all this node knows. A linearizable read waits for a committed
    /// barrier instead.
    pub fn recovered(&self) -> bool {
        self.last_applied_index().unwrap_or(0) >= self.recovery_index
    }

    /// The index of the last entry applied on this node.
    pub fn last_applied_index(&self) -> Option<u64> {
        self.view.last_applied_index()
    }

    /// Commits `command` and returns the machine's response, within `timeout`.
    ///
    /// On a follower the command goes to the leader in one hop; on a node outside the group
    /// (a gateway) to the cached leader, else to a seed, which names the leader. A command is
    /// sent again only when it certainly was not applied (no leader, refused connection,
    /// leadership moved before it was accepted), so a command is never applied twice by this
    /// method.
    ///
    /// # Errors
    /// [`WriteError`]; [`WriteError::may_have_applied`] tells whether the outcome is unknown.
    pub async fn write(&self, command: C::D, timeout: Duration) -> Result<C::R, WriteError> {
        let payload_bytes = postcard::experimental::serialized_size(&command)
            .map_err(|e| WriteError::Refused { leader: self.node_id, reason: e.to_string() })?;
        if payload_bytes > COMMAND_BYTES_MAX {
            return Err(WriteError::TooLarge { bytes: payload_bytes });
        }
        let deadline = Instant::now() + timeout;
        let mut hint: Option<(NodeId, Option<BasicNode>)> = None;
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(WriteError::NoLeader);
            }
            let remaining = deadline - now;
            let leader = hint.take().or_else(|| self.next_target());
            let Some((leader_id, leader_node)) = leader else {
                self.wait_for_metrics(remaining.min(LEADER_POLL)).await;
                continue;
            };
            let outcome = if leader_id == self.node_id {
                self.write_here(&command, remaining).await
            } else {
                let Some(node) = leader_node.or_else(|| self.node_address(leader_id)) else {
                    self.wait_for_metrics(remaining.min(LEADER_POLL)).await;
                    continue;
                };
                self.write_at(leader_id, &node, &command, remaining).await
            };
            match outcome {
                Attempt::Done(result) => return result,
                Attempt::NotApplied { leader } => {
                    if leader.is_none() {
                        // Leadership is moving or the leader is down: give it a moment.
                        tokio::time::sleep(remaining.min(LEADER_POLL)).await;
                    }
                    hint = leader;
                }
            }
        }
    }

    /// Sets `command`'s time to this node's stamp as the leader (`crate::ledger::ledger_time`),
    /// over the proposer's: every command is proposed through here or [`Self::forwarded`].
    fn stamp(&self, command: &mut C::D) {
        let term = self.raft.metrics().borrow().current_term;
        let stamp_ms = self.stamper.stamp(term, || self.view.read(GroupMachine::ledger_time_ms));
        <C::Machine as GroupMachine>::stamp(command, stamp_ms);
    }

    /// Proposes a command another node forwarded (the server side of `Forward`): judges the
    /// sender's clock when this node leads, stamps the command and writes it here.
    pub(crate) async fn forwarded(
        &self,
        forwarded: Forwarded<C::D>,
    ) -> Result<C::R, RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>> {
        if self.leader() == Some(self.node_id) {
            self.clock_offsets.observe(&self.name, forwarded.from, forwarded.sent_at_ms);
        }
        let mut command = forwarded.command;
        self.stamp(&mut command);
        self.gate.call(self.raft.client_write(command)).await.map(|written| written.data)
    }

    /// The clock offsets this node saw while leading (shared with the process's other groups).
    pub fn clock_offsets(&self) -> &ClockOffsets {
        &self.clock_offsets
    }

    async fn write_here(&self, command: &C::D, remaining: Duration) -> Attempt<C::R> {
        let mut command = command.clone();
        self.stamp(&mut command);
        match tokio::time::timeout(remaining, self.gate.call(self.raft.client_write(command))).await
        {
            Err(_) => Attempt::Done(Err(WriteError::Timeout)),
            Ok(Ok(written)) => Attempt::Done(Ok(written.data)),
            Ok(Err(error)) => self.classify(self.node_id, error),
        }
    }

    /// Sends `command` to `leader` (or a seed taken for it) and keeps the cached leader up to
    /// date with what the attempt taught.
    async fn write_at(
        &self,
        leader: NodeId,
        node: &BasicNode,
        command: &C::D,
        remaining: Duration,
    ) -> Attempt<C::R> {
        let attempt = self.send_to(leader, node, command, remaining).await;
        match &attempt {
            Attempt::Done(Ok(_)) => self.route.remember(leader, node.clone()),
            // The node is the leader; it refused this command only.
            Attempt::Done(Err(WriteError::Refused { .. })) => {}
            // No answer: the next write looks for the leader again rather than wait on it.
            Attempt::Done(Err(_)) => self.route.forget(leader),
            Attempt::NotApplied { leader: Some((named, named_node)) } => {
                match named_node.clone().or_else(|| self.node_address(*named)) {
                    Some(named_node) => self.route.remember(*named, named_node),
                    None => self.route.forget(leader),
                }
            }
            Attempt::NotApplied { leader: None } => self.route.forget(leader),
        }
        attempt
    }

    async fn send_to(
        &self,
        leader: NodeId,
        node: &BasicNode,
        command: &C::D,
        remaining: Duration,
    ) -> Attempt<C::R> {
        // The wall clock is read as the call leaves, so the leader sees this node's offset
        // plus the transit time only, however long the write waited for a leader.
        let forwarded =
            Forwarded { from: self.node_id, sent_at_ms: crate::clock::now_ms(), command };
        let reply = self
            .channels
            .call::<_, C::R, RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>>(
                &node.addr,
                Rpc::Forward,
                &self.name,
                &forwarded,
                remaining,
            )
            .await;
        match reply {
            Ok(Ok(response)) => Attempt::Done(Ok(response)),
            Ok(Err(error)) => self.classify(leader, error),
            Err(PeerCallError::Timeout(_)) => Attempt::Done(Err(WriteError::Timeout)),
            Err(error) if error.never_delivered() => {
                tracing::debug!(group = %self.name, %leader, %error, "leader unreachable; looking again");
                Attempt::NotApplied { leader: None }
            }
            Err(PeerCallError::Status(status)) if status.code() == tonic::Code::InvalidArgument => {
                Attempt::Done(Err(WriteError::Refused {
                    leader,
                    reason: status.message().to_owned(),
                }))
            }
            Err(error) => {
                Attempt::Done(Err(WriteError::LeaderLost { leader, reason: error.to_string() }))
            }
        }
    }

    fn classify(
        &self,
        leader: NodeId,
        error: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>,
    ) -> Attempt<C::R> {
        match error {
            RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => {
                Attempt::NotApplied {
                    leader: forward.leader_id.map(|id| (id, forward.leader_node)),
                }
            }
            RaftError::APIError(ClientWriteError::ChangeMembershipError(refused)) => {
                Attempt::Done(Err(WriteError::Refused { leader, reason: refused.to_string() }))
            }
            RaftError::Fatal(fatal) if leader == self.node_id => {
                Attempt::Done(Err(WriteError::Stopped(fatal.to_string())))
            }
            // The remote Raft stopped while holding the command: outcome unknown.
            RaftError::Fatal(fatal) => {
                Attempt::Done(Err(WriteError::LeaderLost { leader, reason: fatal.to_string() }))
            }
        }
    }

    fn known_leader(&self) -> Option<(NodeId, Option<BasicNode>)> {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        let leader = metrics.current_leader?;
        let node = metrics.membership_config.membership().get_node(&leader).cloned();
        Some((leader, node))
    }

    /// Where the next attempt goes when no hint is at hand: the leader the metrics name;
    /// for a node outside the group, the cached leader, else the next seed; `None` to wait
    /// for the metrics (a member learns the leader itself, from the election it takes part
    /// in or hears of, sooner than by asking others).
    fn next_target(&self) -> Option<(NodeId, Option<BasicNode>)> {
        if let Some(known) = self.known_leader() {
            return Some(known);
        }
        if self.is_member() {
            return None;
        }
        self.route
            .cached()
            .or_else(|| self.route.next_seed())
            .map(|(leader, node)| (leader, Some(node)))
    }

    /// A node's Raft address: from the membership this node sees, else from the seeds.
    fn node_address(&self, node_id: NodeId) -> Option<BasicNode> {
        let member =
            self.raft.metrics().borrow().membership_config.membership().get_node(&node_id).cloned();
        member.or_else(|| self.route.seed_node(node_id))
    }

    async fn wait_for_metrics(&self, at_most: Duration) {
        let mut metrics = self.raft.metrics();
        // A change or the timeout both mean "look again"; a closed channel means the group
        // stopped, which the next write attempt reports.
        let _changed = tokio::time::timeout(at_most, metrics.changed()).await;
    }

    /// Stops the Raft node and waits until its storage is closed, so the same directory can
    /// be opened again (a restart in the same process). Calls into the core stop first
    /// (refused, or dropped in flight), so the core stops with none waiting on it.
    ///
    /// # Errors
    /// [`ShutdownError`] when openraft failed while stopping or kept the storage open.
    pub async fn shutdown(&self) -> Result<(), ShutdownError> {
        self.gate.close().await;
        self.raft.shutdown().await.map_err(|e| ShutdownError::Raft(e.to_string()))?;
        // openraft's worker tasks drop the stores shortly after the core stops.
        let deadline = Instant::now() + STORAGE_RELEASE_TIMEOUT;
        while !self.storage.released() {
            if Instant::now() >= deadline {
                return Err(ShutdownError::StorageBusy);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }
}

/// One attempt of a write: finished, or certainly not applied (try again, maybe elsewhere).
enum Attempt<R> {
    Done(Result<R, WriteError>),
    NotApplied { leader: Option<(NodeId, Option<BasicNode>)> },
}

/// Anchors the group's ledger time as soon as this node becomes leader, so its first stamp
/// of a term counts from the election rather than from its first write. Ends when the
/// group stops (its metrics close) or its handle is gone.
async fn anchor_on_election<M: GroupMachine>(
    mut metrics: watch::Receiver<RaftMetrics<NodeId, BasicNode>>,
    stamper: Weak<Stamper>,
    view: MachineView<M>,
) {
    loop {
        let (term, leads) = {
            let metrics = metrics.borrow_and_update();
            (metrics.current_term, metrics.state == ServerState::Leader)
        };
        if leads {
            let Some(stamper) = stamper.upgrade() else { return };
            stamper.anchor(term, || view.read(GroupMachine::ledger_time_ms));
        }
        if metrics.changed().await.is_err() {
            return;
        }
    }
}

async fn open_stores<C: GroupConfig>(
    directory: &Path,
    log_fsync_seconds: Option<Histogram>,
) -> Result<(LogStore<C>, StateStore<C>), OpenError> {
    let log_path = directory.join(LOG_FILE_NAME);
    let state_directory = directory.to_path_buf();
    // Both opens read and possibly repair files: keep them off the async workers.
    tokio::task::spawn_blocking(move || -> Result<_, OpenError> {
        let log_store = LogStore::<C>::open(&log_path, log_fsync_seconds)?;
        let state_store = StateStore::<C>::open(&state_directory)?;
        Ok((log_store, state_store))
    })
    .await
    .map_err(|e| OpenError::Start {
        group: directory.display().to_string(),
        reason: e.to_string(),
    })?
}

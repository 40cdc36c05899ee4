//! The quota group: openraft's type configuration over the pure quota ledger
//! (`crate::core::ledger`), and how the ledger's state maps onto the store's records.
//!
//! Records: `h` holds ledger time (`last_seen_ms`), `P` followed by the version's 8
//! big-endian bytes one policy version (`crate::core::policy_versions`), `r` the region
//! slices and transfers, and `k` followed by the key's bytes one key's bucket and leases;
//! values are postcard. The rules are in the core; this file only names types and encodes.

use std::io::Cursor;

use crate::core::ledger::{
    KEY_BYTES_MAX, KeyEntry, LEASE_REQUESTS_PER_COMMAND_MAX, POLICY_FILE_NAME_BYTES_MAX,
    POLICY_FILES_MAX, POLICY_SET_BYTES_MAX, PolicyVersions, QuotaCommand, QuotaLedger,
    QuotaResponse, StoredPolicyVersion,
};
use crate::core::policy_versions::{POLICY_MESSAGE_BYTES_MAX, POLICY_OPERATOR_BYTES_MAX};
use crate::core::region::transfer::{RegionCommand, RegionLedger};

use super::{
    BasicNode, COMMAND_BYTES_MAX, GroupConfig, GroupMachine, NodeId, Record, RecordChange,
    RecordError,
};

/// The name the quota group goes by on the transport and on disk.
pub const QUOTA_GROUP_NAME: &str = "quota";

/// Upper bound of one lease request's encoding besides its key: the limit, counts, TTL and
/// length prefixes, as postcard varints.
const LEASE_REQUEST_FIXED_BYTES_MAX: usize = 64;

// The largest valid command must fit the transport's command limit.
const _: () = assert!(
    LEASE_REQUESTS_PER_COMMAND_MAX * (KEY_BYTES_MAX + LEASE_REQUEST_FIXED_BYTES_MAX) + 64
        <= COMMAND_BYTES_MAX
);
const _: () = assert!(
    POLICY_SET_BYTES_MAX
        + POLICY_FILES_MAX * (POLICY_FILE_NAME_BYTES_MAX + 16)
        + POLICY_MESSAGE_BYTES_MAX
        + POLICY_OPERATOR_BYTES_MAX
        + 64
        <= COMMAND_BYTES_MAX
);

openraft::declare_raft_types!(
    /// openraft types of the quota group.
    pub QuotaGroup:
        D = QuotaCommand,
        R = QuotaResponse,
        NodeId = NodeId,
        Node = BasicNode,
        Entry = openraft::Entry<QuotaGroup>,
        SnapshotData = Cursor<Vec<u8>>,
);

impl GroupConfig for QuotaGroup {
    type Machine = QuotaLedger;

    /// Lease commands (acquire, settle) only for the sender's own leases (a gateway's as a
    /// voter's); a demand report only of the sender's own count (how a gateway, which holds
    /// no replica, reports its offered hits: `crate::slice_follow`); a new policy set and
    /// the other region commands (slices, transfers) only from a voter.
    fn check_forward(
        command: &QuotaCommand,
        sender: NodeId,
        sender_may_vote: bool,
    ) -> Result<(), String> {
        let for_node = match command {
            QuotaCommand::AcquireLeases { node_id, .. }
            | QuotaCommand::SettleLeases { node_id, .. }
            | QuotaCommand::Region { command: RegionCommand::Demand { node_id, .. }, .. } => {
                *node_id
            }
            QuotaCommand::ApplyPolicySet { .. }
            | QuotaCommand::RollbackPolicySet { .. }
            | QuotaCommand::Region { .. }
                if sender_may_vote =>
            {
                return Ok(());
            }
            QuotaCommand::ApplyPolicySet { .. } | QuotaCommand::RollbackPolicySet { .. } => {
                return Err(format!("node {sender} is a gateway and may not change the policy"));
            }
            QuotaCommand::Region { .. } => {
                return Err(format!("node {sender} is a gateway and may not move region slices"));
            }
        };
        if for_node == sender {
            Ok(())
        } else {
            Err(format!("node {sender} may not speak for node {for_node}"))
        }
    }
}

const RECORD_LAST_SEEN: &[u8] = b"h";
const RECORD_POLICY_PREFIX: u8 = b'P';
const RECORD_REGIONS: &[u8] = b"r";
const RECORD_KEY_PREFIX: u8 = b'k';

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value).expect("postcard encodes ledger records into a Vec without error")
}

fn key_record(key: &str) -> Vec<u8> {
    let mut record = Vec::with_capacity(1 + key.len());
    record.push(RECORD_KEY_PREFIX);
    record.extend_from_slice(key.as_bytes());
    record
}

fn policy_record(version: u64) -> Vec<u8> {
    let mut record = Vec::with_capacity(9);
    record.push(RECORD_POLICY_PREFIX);
    record.extend_from_slice(&version.to_be_bytes());
    record
}

fn undecodable(key: &[u8], reason: impl std::fmt::Display) -> RecordError {
    RecordError { key: String::from_utf8_lossy(key).into_owned(), reason: reason.to_string() }
}

impl GroupMachine for QuotaLedger {
    type Command = QuotaCommand;
    type Response = QuotaResponse;

    fn empty_response() -> QuotaResponse {
        QuotaResponse::NoCommand
    }

    fn apply(&mut self, _log_index: u64, command: &QuotaCommand) -> QuotaResponse {
        QuotaLedger::apply(self, command)
    }

    fn take_changes(&mut self) -> Vec<RecordChange> {
        let changes = QuotaLedger::take_changes(self);
        let mut records = Vec::with_capacity(changes.keys.len() + 2);
        if let Some(last_seen_ms) = changes.last_seen_ms {
            records.push(RecordChange {
                key: RECORD_LAST_SEEN.to_vec(),
                value: Some(encode(&last_seen_ms)),
            });
        }
        for (version, stored) in changes.policies {
            records.push(RecordChange {
                key: policy_record(version),
                value: stored.map(|stored| encode(&stored)),
            });
        }
        if let Some(regions) = changes.regions {
            records
                .push(RecordChange { key: RECORD_REGIONS.to_vec(), value: Some(encode(&regions)) });
        }
        for (key, entry) in changes.keys {
            records.push(RecordChange {
                key: key_record(&key),
                value: entry.map(|entry| encode(&entry)),
            });
        }
        records
    }

    fn from_records<I>(records: I) -> Result<Self, RecordError>
    where
        I: IntoIterator<Item = Record>,
    {
        let mut last_seen_ms = 0;
        let mut policies: Vec<StoredPolicyVersion> = Vec::new();
        let mut regions = RegionLedger::default();
        let mut keys = Vec::new();
        for (key, value) in records {
            if key == RECORD_LAST_SEEN {
                last_seen_ms = postcard::from_bytes(&value).map_err(|e| undecodable(&key, e))?;
            } else if key.len() == 9 && key[0] == RECORD_POLICY_PREFIX {
                policies.push(postcard::from_bytes(&value).map_err(|e| undecodable(&key, e))?);
            } else if key == RECORD_REGIONS {
                regions = postcard::from_bytes(&value).map_err(|e| undecodable(&key, e))?;
            } else if let Some((&RECORD_KEY_PREFIX, name)) = key.split_first() {
                let name = String::from_utf8(name.to_vec()).map_err(|e| undecodable(&key, e))?;
                let entry: KeyEntry =
                    postcard::from_bytes(&value).map_err(|e| undecodable(&key, e))?;
                keys.push((name, entry));
            } else {
                return Err(undecodable(&key, "unknown record"));
            }
        }
        QuotaLedger::from_parts(last_seen_ms, PolicyVersions::from_stored(policies), keys)
            .map(|ledger| ledger.with_regions(regions))
            .map_err(|e| RecordError { key: "ledger".to_owned(), reason: e.to_string() })
    }

    fn digest(&self) -> u64 {
        QuotaLedger::digest(self)
    }

    fn ledger_time_ms(&self) -> u64 {
        self.last_seen_ms()
    }

    fn stamp(command: &mut QuotaCommand, stamp_ms: u64) {
        match command {
            QuotaCommand::AcquireLeases { now_ms, .. }
            | QuotaCommand::SettleLeases { now_ms, .. }
            | QuotaCommand::ApplyPolicySet { now_ms, .. }
            | QuotaCommand::RollbackPolicySet { now_ms, .. }
            | QuotaCommand::Region { now_ms, .. } => *now_ms = stamp_ms,
        }
    }

    /// The current policy version: a node's policy store follows it (`crate::policy_store`).
    fn change_signal(&self) -> u64 {
        self.policies().current_version()
    }
}

/// A `FetchPolicy` request: the policy version the caller serves (0: none replicated).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyFetch {
    /// The version the caller serves.
    pub known_version: u64,
}

/// A `FetchPolicy` answer, from the machine as applied on the serving node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PolicyFetched {
    /// The current version there (0: none applied yet).
    pub current_version: u64,
    /// The current version with its files, when it is not the caller's.
    pub version: Option<StoredPolicyVersion>,
}

impl PolicyFetched {
    /// The answer of `ledger` to `fetch`: the version number alone while the caller serves
    /// it, so a poll costs a few bytes.
    pub fn answer(ledger: &QuotaLedger, fetch: PolicyFetch) -> Self {
        let current_version = ledger.policies().current_version();
        let version = (current_version != fetch.known_version)
            .then(|| ledger.policies().current().cloned())
            .flatten();
        Self { current_version, version }
    }
}

/// Why a `FetchPolicy` call got no answer; the next poll may.
#[derive(Debug, thiserror::Error)]
pub enum FetchPolicyError {
    /// The node knows neither a leader nor a seed to ask.
    #[error("no voter to ask for the policy")]
    NoPeer,
    /// The call failed.
    #[error("asking node {node_id} for the policy: {source}")]
    Call {
        /// The node asked.
        node_id: NodeId,
        /// What failed.
        #[source]
        source: super::network::PeerCallError,
    },
}

impl super::RaftGroup<QuotaGroup> {
    /// Asks a voter (the leader this node last reached, else the next seed) for the region's
    /// current policy version, with its files when it is not `known_version`: how a gateway,
    /// which holds no replica, follows the policy. Bounded by `timeout`.
    ///
    /// # Errors
    /// [`FetchPolicyError`]; nothing changed anywhere.
    pub async fn fetch_policy(
        &self,
        known_version: u64,
        timeout: std::time::Duration,
    ) -> Result<PolicyFetched, FetchPolicyError> {
        let (node_id, node) = self.read_target().ok_or(FetchPolicyError::NoPeer)?;
        let call = |source| FetchPolicyError::Call { node_id, source };
        let payload = postcard::to_allocvec(&PolicyFetch { known_version })
            .map_err(|e| call(super::network::PeerCallError::Encode(e)))?;
        let reply = self
            .channels()
            .call_raw(
                &node.addr,
                super::network::Rpc::FetchPolicy,
                QUOTA_GROUP_NAME,
                payload,
                timeout,
            )
            .await
            .map_err(|source| {
                self.forget_target(node_id);
                call(source)
            })?;
        postcard::from_bytes(&reply).map_err(|e| call(super::network::PeerCallError::Decode(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::region::transfer::{Slice, SliceKey};

    fn region(command: RegionCommand) -> QuotaCommand {
        QuotaCommand::Region { now_ms: 0, command }
    }

    fn demand(node_id: u64) -> QuotaCommand {
        region(RegionCommand::Demand {
            node_id: NodeId(node_id),
            hits: vec![(SliceKey::of("d", "k", 0), 7)],
        })
    }

    /// A gateway's only region command is its own demand report: one naming another node,
    /// or any command that moves a slice, is refused; a voter may forward any of them but
    /// another node's report.
    #[test]
    fn a_gateway_forwards_its_own_demand_report_and_no_other_region_command() {
        let gateway = NodeId(9);
        assert_eq!(QuotaGroup::check_forward(&demand(9), gateway, false), Ok(()));
        assert!(QuotaGroup::check_forward(&demand(1), gateway, false).is_err());
        let key = SliceKey::of("d", "k", 0);
        let moves = [
            RegionCommand::Adopt {
                key: key.clone(),
                slice: Slice { global_tokens: 10, tokens: 10 },
            },
            RegionCommand::Debit {
                serial: 1,
                key: key.clone(),
                recipient: "b".to_owned(),
                tokens: 1,
            },
            RegionCommand::Relimit {
                key,
                from_global_tokens: 10,
                to_global_tokens: 5,
                to_policy_tokens: 5,
            },
        ];
        for command in moves {
            let command = region(command);
            assert!(QuotaGroup::check_forward(&command, gateway, false).is_err(), "{command:?}");
            assert_eq!(QuotaGroup::check_forward(&command, NodeId(1), true), Ok(()));
        }
        // Nobody reports on another node's behalf, a voter no more than a gateway.
        assert_eq!(QuotaGroup::check_forward(&demand(1), NodeId(1), true), Ok(()));
        assert!(QuotaGroup::check_forward(&demand(1), NodeId(2), true).is_err());
    }
}

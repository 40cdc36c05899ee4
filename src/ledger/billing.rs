//! The billing group: openraft's type configuration over the pure billing ledger
//! (`crate::core::billing`), and how the ledger's state maps onto the store's records.
//!
//! The billing group runs beside the quota group on the same transport but in its own
//! directory (`<data_dir>/billing`: its own redb log, sled state and snapshots), so lease
//! traffic on the quota group never queues in front of a billing commit (DESIGN.md section 1).
//!
//! Records (values are postcard):
//! - `m`: the ledger clock (time, next hold id);
//! - `c` tenant `0x00` meter: one account;
//! - `h` hold id (8 bytes, big-endian): one hold;
//! - `b` first sequence (8 bytes, big-endian): the trail entries of one command with its key
//!   retention, so records scan in trail order and a batch of debits is one write. The
//!   idempotency keys are rebuilt from these on load (`BillingLedger::from_parts`).
//!
//! Tenant names never contain `0x00` (`AccountId::check`), so the separator is unambiguous.

use std::io::Cursor;

use crate::core::billing::{
    AccountId, BillingCommand, BillingLedger, BillingResponse, HoldId, LedgerClock, TrailBlock,
};

use super::{
    BasicNode, COMMAND_BYTES_MAX, GroupConfig, GroupMachine, NodeId, Record, RecordChange,
    RecordError,
};
use crate::core::billing::{
    CALLER_BYTES_MAX, IDEMPOTENCY_KEY_BYTES_MAX, METER_BYTES_MAX, OPERATIONS_PER_COMMAND_MAX,
    TENANT_BYTES_MAX,
};

/// The name the billing group goes by on the transport and on disk.
pub const BILLING_GROUP_NAME: &str = "billing";

/// Upper bound of one operation's encoding besides its strings: enum tags, amounts, TTL,
/// hold id and length prefixes, as postcard varints.
const OPERATION_FIXED_BYTES_MAX: usize = 64;

// The largest valid command must fit the transport's command limit (its trail block, a
// little larger per operation, is a store record and has no such limit).
const _: () = assert!(
    OPERATIONS_PER_COMMAND_MAX
        * (CALLER_BYTES_MAX
            + IDEMPOTENCY_KEY_BYTES_MAX
            + TENANT_BYTES_MAX
            + METER_BYTES_MAX
            + OPERATION_FIXED_BYTES_MAX)
        + 64
        <= COMMAND_BYTES_MAX
);

openraft::declare_raft_types!(
    /// openraft types of the billing group.
    pub BillingGroup:
        D = BillingCommand,
        R = BillingResponse,
        NodeId = NodeId,
        Node = BasicNode,
        Entry = openraft::Entry<BillingGroup>,
        SnapshotData = Cursor<Vec<u8>>,
);

impl GroupConfig for BillingGroup {
    type Machine = BillingLedger;

    /// Only from a voter's certificate, whose billing API authenticated every caller named
    /// in the batch (a gateway serves no billing API, so it has no caller to speak for).
    fn check_forward(
        command: &BillingCommand,
        sender: NodeId,
        sender_may_vote: bool,
    ) -> Result<(), String> {
        if !sender_may_vote {
            return Err(format!(
                "node {sender} is a gateway, which serves no billing API, and may not propose to it"
            ));
        }
        if command.operations.iter().any(|operation| operation.caller.is_empty()) {
            return Err("a billing operation without its authenticated caller".to_owned());
        }
        Ok(())
    }
}

const RECORD_CLOCK: &[u8] = b"m";
const PREFIX_ACCOUNT: u8 = b'c';
const PREFIX_HOLD: u8 = b'h';
const PREFIX_BLOCK: u8 = b'b';

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value).expect("postcard encodes billing records into a Vec without error")
}

fn pair_record(prefix: u8, first: &str, second: &str) -> Vec<u8> {
    let mut record = Vec::with_capacity(2 + first.len() + second.len());
    record.push(prefix);
    record.extend_from_slice(first.as_bytes());
    record.push(0);
    record.extend_from_slice(second.as_bytes());
    record
}

fn number_record(prefix: u8, number: u64) -> Vec<u8> {
    let mut record = Vec::with_capacity(9);
    record.push(prefix);
    record.extend_from_slice(&number.to_be_bytes());
    record
}

fn undecodable(key: &[u8], reason: impl std::fmt::Display) -> RecordError {
    RecordError { key: String::from_utf8_lossy(key).into_owned(), reason: reason.to_string() }
}

fn split_pair(key: &[u8]) -> Result<(String, String), RecordError> {
    let body = &key[1..];
    let separator =
        body.iter().position(|b| *b == 0).ok_or_else(|| undecodable(key, "no separator"))?;
    let first = String::from_utf8(body[..separator].to_vec()).map_err(|e| undecodable(key, e))?;
    let second =
        String::from_utf8(body[separator + 1..].to_vec()).map_err(|e| undecodable(key, e))?;
    Ok((first, second))
}

fn split_number(key: &[u8]) -> Result<u64, RecordError> {
    let bytes: [u8; 8] = key[1..].try_into().map_err(|_| undecodable(key, "not 8 bytes"))?;
    Ok(u64::from_be_bytes(bytes))
}

impl GroupMachine for BillingLedger {
    type Command = BillingCommand;
    type Response = BillingResponse;

    fn empty_response() -> BillingResponse {
        BillingResponse { ledger_index: 0, outcomes: Vec::new() }
    }

    fn apply(&mut self, log_index: u64, command: &BillingCommand) -> BillingResponse {
        BillingLedger::apply(self, log_index, command)
    }

    fn take_changes(&mut self) -> Vec<RecordChange> {
        let changes = BillingLedger::take_changes(self);
        let mut records = Vec::with_capacity(
            1 + changes.accounts.len() + changes.holds.len() + changes.blocks.len(),
        );
        if let Some(clock) = changes.clock {
            records.push(RecordChange { key: RECORD_CLOCK.to_vec(), value: Some(encode(&clock)) });
        }
        for (id, account) in changes.accounts {
            records.push(RecordChange {
                key: pair_record(PREFIX_ACCOUNT, &id.tenant, &id.meter),
                value: account.map(|account| encode(&account)),
            });
        }
        for (id, hold) in changes.holds {
            records.push(RecordChange {
                key: number_record(PREFIX_HOLD, id.0),
                value: hold.map(|hold| encode(&hold)),
            });
        }
        for block in changes.blocks {
            let first = block.entries.first().map_or(0, |entry| entry.sequence);
            records.push(RecordChange {
                key: number_record(PREFIX_BLOCK, first),
                value: Some(encode(&block)),
            });
        }
        records
    }

    fn from_records<I>(records: I) -> Result<Self, RecordError>
    where
        I: IntoIterator<Item = Record>,
    {
        let mut clock = LedgerClock::default();
        let mut accounts = Vec::new();
        let mut holds = Vec::new();
        let mut blocks: Vec<TrailBlock> = Vec::new();
        // sled scans in key order: entries come out in sequence order (big-endian keys).
        for (key, value) in records {
            let decode_error = |e: postcard::Error| undecodable(&key, e);
            match key.first() {
                _ if key == RECORD_CLOCK => {
                    clock = postcard::from_bytes(&value).map_err(decode_error)?;
                }
                Some(&PREFIX_ACCOUNT) => {
                    let (tenant, meter) = split_pair(&key)?;
                    let account = postcard::from_bytes(&value).map_err(decode_error)?;
                    accounts.push((AccountId { tenant, meter }, account));
                }
                Some(&PREFIX_HOLD) => {
                    let id = HoldId(split_number(&key)?);
                    holds.push((id, postcard::from_bytes(&value).map_err(decode_error)?));
                }
                Some(&PREFIX_BLOCK) => {
                    split_number(&key)?;
                    blocks.push(postcard::from_bytes(&value).map_err(decode_error)?);
                }
                _ => return Err(undecodable(&key, "unknown record")),
            }
        }
        BillingLedger::from_parts(clock, accounts, holds, blocks)
            .map_err(|e| RecordError { key: "billing".to_owned(), reason: e.to_string() })
    }

    fn digest(&self) -> u64 {
        BillingLedger::digest(self)
    }

    fn ledger_time_ms(&self) -> u64 {
        self.last_seen_ms()
    }

    fn stamp(command: &mut BillingCommand, now_ms: u64) {
        command.now_ms = now_ms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::billing::{IdempotencyKey, Operation, OperationRequest};

    /// Every record the machine hands out rebuilds the same machine.
    #[test]
    fn records_rebuild_the_same_ledger() {
        let mut ledger = BillingLedger::new();
        let account = AccountId::new("t1", "api");
        let operation = |key: &str, request| Operation {
            caller: "svc".to_owned(),
            key: IdempotencyKey(key.to_owned()),
            request,
        };
        let command = BillingCommand {
            now_ms: 1000,
            key_retention_ms: crate::core::billing::KEY_RETENTION_MS_DEFAULT,
            operations: vec![
                operation(
                    "a",
                    OperationRequest::CreateAccount { account: account.clone(), floor: 5 },
                ),
                operation("b", OperationRequest::Credit { account: account.clone(), amount: 50 }),
                operation(
                    "c",
                    OperationRequest::Reserve { account: account.clone(), amount: 20, ttl_ms: 9 },
                ),
                operation("d", OperationRequest::Debit { account, amount: 7 }),
            ],
        };
        GroupMachine::apply(&mut ledger, 1, &command);
        let mut store = std::collections::BTreeMap::new();
        for change in GroupMachine::take_changes(&mut ledger) {
            if let Some(value) = change.value {
                store.insert(change.key, value);
            }
        }
        let rebuilt = <BillingLedger as GroupMachine>::from_records(store).expect("rebuild");
        assert_eq!(GroupMachine::digest(&rebuilt), GroupMachine::digest(&ledger));
        assert_eq!(rebuilt.trail().len(), 4);
    }
}

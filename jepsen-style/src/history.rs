//! A run's history: every client operation as an `invoke` and exactly one completion (`ok`:
//! it happened; `fail`: it definitely did not; `info`: unknown), with the runner's monotonic
//! time, the process and the node it went to; and the `history.jsonl` file (one event a
//! line) it is written to and read back from. The checkers read only these types.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// A node of the cluster under test (its `raft_node_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u64);

/// A logical client: runs one operation at a time; an `info` completion retires it (the
/// worker goes on under a new process id), as in Jepsen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ProcessId(pub u64);

/// What an event says about its operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EventType {
    Invoke,
    Ok,
    Fail,
    Info,
}

/// The operation a client performed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Function {
    CreateAccount,
    Credit,
    Debit,
    /// A linearizable balance read.
    Read,
    /// An RLS decision on one hit.
    Check,
    /// Holds an amount until captured, voided or expired (ledger time).
    Reserve,
    /// Debits up to a hold's amount and releases it.
    Capture,
    /// Releases a hold.
    Void,
    /// A lease grant through the admin `AcquireLeases` (no idempotency key: each call is a
    /// grant of its own).
    Acquire,
}

impl Function {
    /// Whether the operation changes the billing ledger (and so has an idempotency key).
    pub fn is_mutation(self) -> bool {
        !matches!(self, Self::Read | Self::Check | Self::Acquire)
    }

    /// The kind of trail entry a mutation makes when it commits.
    pub fn entry_kind(self) -> Option<EntryKind> {
        match self {
            Self::CreateAccount => Some(EntryKind::CreateAccount),
            Self::Credit => Some(EntryKind::Credit),
            Self::Debit => Some(EntryKind::Debit),
            Self::Reserve => Some(EntryKind::Reserve),
            Self::Capture => Some(EntryKind::Capture),
            Self::Void => Some(EntryKind::Void),
            Self::Read | Self::Check | Self::Acquire => None,
        }
    }
}

/// What the ledger decided for a committed mutation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    Approved,
    InsufficientFunds,
}

/// An operation's arguments (on `invoke`) and, on completion, what came back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpValue {
    /// The account's meter name (the tenant is the workload's); empty for RLS hits.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub account: String,
    /// The descriptor key an RLS hit carries (its rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub descriptor: Option<String>,
    /// The tokens a lease grant got (its `ok`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub granted: Option<u64>,
    /// The whole tokens the bucket kept after a lease grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining: Option<u64>,
    /// The ledger time a lease grant committed at (its expiry less its TTL; none when
    /// nothing was granted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger_time_ms: Option<u64>,
    /// Whether an RLS hit was admitted (`OK`) or refused (`OVER_LIMIT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admitted: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount: Option<u64>,
    /// The idempotency key of a mutation; retries of one logical operation share it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The bank transfer a debit or credit belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<u64>,
    /// The hold a reserve made (on its `ok`), or a capture or void resolves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<u64>,
    /// How long after its commit (ledger time) a reserve's hold expires.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// The original commit's decision (`ok` mutations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<Decision>,
    /// The reply was a `DUPLICATE`: a retry of a key committed before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
    /// The balance after the original commit, or the balance read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balance: Option<u64>,
    /// The Raft log index of the original commit, or the index a read reflects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ledger_index: Option<u64>,
    /// Why a `fail` or `info` ended so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A `fail` the node answered by the ledger's rules (a hold already expired or
    /// resolved, an unknown hold): a definite answer of a working service, not an outage.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refused: bool,
}

/// One line of `history.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Position in the history, from 0.
    pub index: u64,
    /// The runner's monotonic clock since the run started.
    pub time_ns: u64,
    pub process: ProcessId,
    #[serde(rename = "type")]
    pub event_type: EventType,
    pub f: Function,
    pub node: NodeId,
    pub value: OpValue,
}

impl Event {
    /// Whether this completion is an answer of a working service: `ok`, or a refusal by
    /// the ledger's rules.
    pub fn served(&self) -> bool {
        self.event_type == EventType::Ok
            || (self.event_type == EventType::Fail && self.value.refused)
    }
}

/// The kind of a committed audit-trail entry, as the billing API lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EntryKind {
    CreateAccount,
    Credit,
    Debit,
    Reserve,
    Capture,
    Void,
    /// A hold released by the ledger when its TTL ran out (no key).
    Expire,
    /// A kind this suite does not know.
    Other,
}

/// One entry of the audit trail read from a node after the run (`trail-node-N.jsonl`): the
/// final state the bank checker holds the history against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrailEntry {
    pub sequence: u64,
    pub ledger_index: u64,
    /// Ledger time: the committing leader's clock, never going back along the trail.
    #[serde(default)]
    pub time_ms: u64,
    pub kind: EntryKind,
    pub account: String,
    pub key: String,
    /// The amount asked (the floor for a create).
    pub amount: u64,
    pub decision: Decision,
    pub balance_before: u64,
    pub balance_after: u64,
    #[serde(default)]
    pub held_before: u64,
    pub held_after: u64,
    /// The hold a reserve made, or a capture, void or expiry resolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<u64>,
    /// The TTL a reserve asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

/// One read of the quota ledger's keys on one voter (`ledger.jsonl`), taken every few
/// hundred milliseconds while the RLS and lease workloads run: one applied state of the
/// replicated ledger, which the lease checker orders by its applied index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerSample {
    /// The runner's monotonic clock when the answer came.
    pub time_ns: u64,
    pub node: NodeId,
    /// The Raft log index of the state read.
    pub applied_index: u64,
    /// Ledger time of that state.
    pub ledger_time_ms: u64,
    pub keys: Vec<KeySample>,
}

/// One key of a [`LedgerSample`]: its limit and its bucket's totals (admin `ReadKeys`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeySample {
    pub key: String,
    pub algorithm: String,
    pub capacity_tokens: u64,
    pub requests_per_window: u64,
    pub window_ms: u64,
    /// Ledger time the totals began (the bucket's life under this limit).
    pub since_ms: u64,
    pub granted_tokens: u64,
    pub charged_tokens: u64,
    pub returned_tokens: u64,
}

/// An operation paired up: its invoke and its completion, if any.
#[derive(Debug, Clone)]
pub struct Operation<'history> {
    pub invoke: &'history Event,
    pub completion: Option<&'history Event>,
}

impl Operation<'_> {
    /// The completion's type; an operation that never completed is unknown (`info`).
    pub fn outcome(&self) -> EventType {
        self.completion.map_or(EventType::Info, |event| event.event_type)
    }

    /// The completion's value (the invoke's when it never completed).
    pub fn result(&self) -> &OpValue {
        self.completion.map_or(&self.invoke.value, |event| &event.value)
    }

    /// Whether the service answered it: `ok`, or refused by the ledger's rules.
    pub fn served(&self) -> bool {
        self.completion.is_some_and(Event::served)
    }

    /// When it completed (never: `u64::MAX`).
    pub fn completed_ns(&self) -> u64 {
        self.completion.map_or(u64::MAX, |event| event.time_ns)
    }
}

/// Pairs each invoke with the next completion of its process. Assumes a well-formed history
/// (see `checker::well_formed`); stray completions are skipped.
pub fn operations(events: &[Event]) -> Vec<Operation<'_>> {
    let mut open: std::collections::HashMap<ProcessId, usize> = std::collections::HashMap::new();
    let mut operations: Vec<Operation<'_>> = Vec::new();
    for event in events {
        if event.event_type == EventType::Invoke {
            open.insert(event.process, operations.len());
            operations.push(Operation { invoke: event, completion: None });
        } else if let Some(position) = open.remove(&event.process) {
            operations[position].completion = Some(event);
        }
    }
    operations
}

/// Errors reading or writing a JSONL file.
#[derive(Debug, thiserror::Error)]
pub enum JsonlError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path} line {line}: {source}")]
    Parse { path: String, line: usize, source: serde_json::Error },
}

/// Appends records as JSON lines, flushing each so a crashed runner leaves a usable prefix.
pub struct JsonlWriter {
    path: String,
    file: std::io::BufWriter<std::fs::File>,
}

impl JsonlWriter {
    /// Creates (or truncates) the file.
    ///
    /// # Errors
    /// The file cannot be created.
    pub fn create(path: &Path) -> Result<Self, JsonlError> {
        let display = path.display().to_string();
        let file = std::fs::File::create(path)
            .map_err(|source| JsonlError::Io { path: display.clone(), source })?;
        Ok(Self { path: display, file: std::io::BufWriter::new(file) })
    }

    /// Writes one record.
    ///
    /// # Errors
    /// The write fails.
    pub fn write<T: Serialize>(&mut self, record: &T) -> Result<(), JsonlError> {
        let io = |source| JsonlError::Io { path: self.path.clone(), source };
        serde_json::to_writer(&mut self.file, record)
            .map_err(|error| io(std::io::Error::other(error)))?;
        self.file.write_all(b"\n").map_err(io)?;
        self.file.flush().map_err(io)
    }
}

/// Reads every record of a JSONL file.
///
/// # Errors
/// The file cannot be read or a line is not a record.
pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<T>, JsonlError> {
    let display = path.display().to_string();
    let file = std::fs::File::open(path)
        .map_err(|source| JsonlError::Io { path: display.clone(), source })?;
    let mut records = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|source| JsonlError::Io { path: display.clone(), source })?;
        if line.trim().is_empty() {
            continue;
        }
        let record = serde_json::from_str(&line).map_err(|source| JsonlError::Parse {
            path: display.clone(),
            line: number + 1,
            source,
        })?;
        records.push(record);
    }
    Ok(records)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds hand-made histories for the checkers' tests.
    pub(crate) struct HistoryBuilder {
        pub events: Vec<Event>,
    }

    impl HistoryBuilder {
        pub(crate) fn new() -> Self {
            Self { events: Vec::new() }
        }

        /// Appends an event at the next index, 1 ms after the previous one.
        pub(crate) fn push(
            &mut self,
            process: u64,
            event_type: EventType,
            f: Function,
            value: OpValue,
        ) -> &mut Self {
            let index = self.events.len() as u64;
            self.events.push(Event {
                index,
                time_ns: index * 1_000_000,
                process: ProcessId(process),
                event_type,
                f,
                node: NodeId(1),
                value,
            });
            self
        }
    }

    /// A history survives the JSONL file unchanged.
    #[test]
    fn jsonl_round_trip() {
        let mut history = HistoryBuilder::new();
        let value = OpValue {
            account: "a0".into(),
            amount: Some(5),
            key: Some("k".into()),
            ..OpValue::default()
        };
        history.push(0, EventType::Invoke, Function::Debit, value.clone());
        let done = OpValue { decision: Some(Decision::Approved), balance: Some(95), ..value };
        history.push(0, EventType::Ok, Function::Debit, done);
        let directory = std::env::temp_dir().join(format!("jepsen-jsonl-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("temp dir");
        let path = directory.join("history.jsonl");
        let mut writer = JsonlWriter::create(&path).expect("create");
        for event in &history.events {
            writer.write(event).expect("write");
        }
        let back: Vec<Event> = read_jsonl(&path).expect("read");
        assert_eq!(back, history.events);
        let operations = operations(&back);
        assert_eq!(operations.len(), 1);
        assert_eq!(operations[0].outcome(), EventType::Ok);
        let _ = std::fs::remove_dir_all(directory);
    }
}

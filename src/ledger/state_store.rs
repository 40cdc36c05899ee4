//! The state machine of one group: its records in sled, its snapshots in files.
//!
//! sled holds the materialized ledger (DESIGN.md section 2: the role Redis plays in the
//! product brief) but is not the source of truth: sled 0.34's `flush()` does not survive a
//! power loss. So the records changed by applied entries are written together with the
//! applied log id and membership in one atomic sled batch, and durability comes from
//! elsewhere:
//!
//! - snapshots are written to a temporary file, fsync'd, renamed into place and the directory
//!   fsync'd; only the latest is kept;
//! - on open, when sled's applied id is behind the latest snapshot (sled lost writes, or a
//!   snapshot install was cut short), sled is rebuilt from that snapshot, and openraft then
//!   replays the committed log after it from the redb log (`log_store`).
//!
//! Since sled is not the source of truth, it is written behind the machine: once every
//! [`SLED_WRITE_EVERY_APPLIES`] applied batches (or [`UNWRITTEN_RECORDS_MAX`] changed
//! records), before a snapshot is taken, and when the store closes. Each sled batch hands a
//! write of sled's log buffer to its I/O pool, which wakes all its threads for it: with one
//! per applied batch, that pool switched context more often than a hot node's request
//! thread. A crash loses at most the unwritten batches from sled; its applied id says so,
//! and openraft replays them.
//!
//! The machine itself ([`GroupMachine`]) works in memory; this file rebuilds it from sled's
//! records on open and after a snapshot install. Snapshot data is held in memory while it
//! moves (`Cursor<Vec<u8>>`), bounded by [`SNAPSHOT_BYTES_MAX`].

use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use openraft::storage::RaftStateMachine;
use openraft::{
    EntryPayload, ErrorSubject, ErrorVerb, LogId, RaftSnapshotBuilder, Snapshot, SnapshotMeta,
    StorageError, StoredMembership,
};
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use super::{
    BasicNode, GroupConfig, GroupMachine, NodeId, Record, RecordError, SNAPSHOT_BYTES_MAX,
    storage_io,
};

type Meta = SnapshotMeta<NodeId, BasicNode>;

/// sled's page cache per group. sled's 1 GiB default counts on-disk page sizes, not heap,
/// and resident memory runs well above it (dependencies.md section 2), so keep it small:
/// the machine's working state is in memory anyway.
const SLED_CACHE_BYTES: u64 = 64 * 1024 * 1024;
/// Applied batches between two writes to sled (module documentation).
pub const SLED_WRITE_EVERY_APPLIES: u32 = 32;
/// Changed records held unwritten at most: a large batch is written at once.
pub const UNWRITTEN_RECORDS_MAX: usize = 4_096;
/// How long opening waits for sled's directory lock (see `open_sled`).
const SLED_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);
/// Key prefix of the machine's records in sled.
const RECORD_PREFIX: &[u8] = b"r/";
/// sled key of the applied log id (postcard `Option<LogId>`).
const KEY_APPLIED: &[u8] = b"m/applied";
/// sled key of the applied membership (postcard `StoredMembership`).
const KEY_MEMBERSHIP: &[u8] = b"m/membership";
/// First bytes of every snapshot file, with the format version.
const SNAPSHOT_MAGIC: &[u8; 8] = b"QMSNAP01";
const SNAPSHOT_FILE_PREFIX: &str = "snapshot-";
const SNAPSHOT_FILE_SUFFIX: &str = ".bin";
const TEMPORARY_SUFFIX: &str = ".tmp";

/// Why the state store could not be opened. Opening again will not help: the directory
/// needs an operator.
#[derive(Debug, thiserror::Error)]
pub enum StateOpenError {
    /// A directory or snapshot file could not be read or written.
    #[error("state store IO on {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// sled refused its directory (corrupt, or locked by another process).
    #[error("cannot open the state database: {0}")]
    Sled(#[from] sled::Error),
    /// The latest snapshot file is damaged; the log before it may be purged, so the state
    /// cannot be rebuilt without it.
    #[error("snapshot {path} is damaged: {reason}")]
    CorruptSnapshot {
        /// The snapshot file.
        path: String,
        /// What was wrong.
        reason: String,
    },
    /// A record or pointer in sled cannot be decoded.
    #[error("the state database holds an undecodable value: {0}")]
    CorruptState(String),
}

/// What a snapshot carries: the machine's records and the pointers stored with them.
#[derive(Debug, Serialize, Deserialize)]
struct SnapshotBody {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
    records: Vec<Record>,
}

/// The machine in memory with the pointers applied with it; readers share it.
struct Applied<M> {
    machine: M,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

/// Read access to a group's machine, shared by the store and the group's handle.
pub struct MachineView<M> {
    applied: Arc<RwLock<Applied<M>>>,
    /// The machine's [`GroupMachine::change_signal`] as last applied.
    signal: Arc<tokio::sync::watch::Sender<u64>>,
}

impl<M> Clone for MachineView<M> {
    fn clone(&self) -> Self {
        Self { applied: Arc::clone(&self.applied), signal: Arc::clone(&self.signal) }
    }
}

impl<M: GroupMachine> MachineView<M> {
    /// Runs `read` on the machine as applied so far on this node (maybe behind the leader).
    pub fn read<T>(&self, read: impl FnOnce(&M) -> T) -> T {
        read(&self.applied.read().machine)
    }

    /// Runs `read` on the machine and returns its answer with the index of the last entry
    /// applied, both seen at one instant (no apply runs in between).
    pub fn read_at_applied<T>(&self, read: impl FnOnce(&M) -> T) -> (T, Option<u64>) {
        let applied = self.applied.read();
        (read(&applied.machine), applied.last_applied.map(|id| id.index))
    }

    /// The index of the last log entry applied on this node.
    pub fn last_applied_index(&self) -> Option<u64> {
        self.applied.read().last_applied.map(|id| id.index)
    }

    /// The machine's [`GroupMachine::change_signal`], updated after every applied batch and
    /// snapshot install; a receiver sees the latest value, never a queue of them.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.signal.subscribe()
    }
}

/// Publishes the machine's change signal when it moved; never blocks.
fn publish_signal(signal: &tokio::sync::watch::Sender<u64>, value: u64) {
    signal.send_if_modified(|current| {
        let moved = *current != value;
        *current = value;
        moved
    });
}

/// The snapshot directory and the latest snapshot in it.
struct SnapshotFiles {
    directory: PathBuf,
    latest: Mutex<Option<Meta>>,
    /// Makes temporary file names unique when a build and an install overlap.
    temporary_sequence: AtomicU64,
}

impl SnapshotFiles {
    fn path_for(&self, meta: &Meta) -> PathBuf {
        let index = meta.last_log_id.map_or(0, |id| id.index);
        self.directory.join(format!("{SNAPSHOT_FILE_PREFIX}{index:020}{SNAPSHOT_FILE_SUFFIX}"))
    }

    /// Writes the snapshot durably, makes it the latest unless a newer one exists, and
    /// removes every other snapshot file.
    fn store(&self, meta: &Meta, body: &[u8]) -> std::io::Result<()> {
        let final_path = self.path_for(meta);
        let sequence = self.temporary_sequence.fetch_add(1, Ordering::Relaxed);
        let temporary_path = final_path.with_extension(format!("{sequence}{TEMPORARY_SUFFIX}"));
        let meta_bytes = postcard::to_allocvec(meta).map_err(std::io::Error::other)?;
        let meta_len = u32::try_from(meta_bytes.len()).map_err(std::io::Error::other)?;
        {
            let mut file = std::fs::File::create(&temporary_path)?;
            file.write_all(SNAPSHOT_MAGIC)?;
            file.write_all(&meta_len.to_le_bytes())?;
            file.write_all(&meta_bytes)?;
            file.write_all(body)?;
            file.sync_all()?;
        }
        let mut latest = self.latest.lock();
        let newer_exists =
            latest.as_ref().is_some_and(|current| current.last_log_id > meta.last_log_id);
        if newer_exists {
            // A newer snapshot was installed while this one was built: this one is useless.
            std::fs::remove_file(&temporary_path)?;
            return Ok(());
        }
        std::fs::rename(&temporary_path, &final_path)?;
        std::fs::File::open(&self.directory)?.sync_all()?;
        *latest = Some(meta.clone());
        for entry in std::fs::read_dir(&self.directory)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if path != final_path
                && name.starts_with(SNAPSHOT_FILE_PREFIX)
                && name.ends_with(SNAPSHOT_FILE_SUFFIX)
            {
                std::fs::remove_file(&path)?;
            }
        }
        Ok(())
    }

    /// Reads a snapshot file: its meta and its body.
    fn load(path: &Path) -> Result<(Meta, Vec<u8>), String> {
        let mut bytes = std::fs::read(path).map_err(|e| e.to_string())?;
        let rest =
            bytes.strip_prefix(SNAPSHOT_MAGIC.as_slice()).ok_or("bad magic or format version")?;
        let (length_bytes, rest) = rest.split_at_checked(4).ok_or("truncated header")?;
        let meta_len = u32::from_le_bytes(length_bytes.try_into().map_err(|_| "truncated header")?);
        let meta_bytes = rest.get(..meta_len as usize).ok_or("truncated meta")?;
        let meta = postcard::from_bytes(meta_bytes).map_err(|e| format!("meta: {e}"))?;
        // Drop the header in place rather than copying a body that may be large.
        bytes.drain(..SNAPSHOT_MAGIC.len() + 4 + meta_len as usize);
        Ok((meta, bytes))
    }

    fn load_latest(&self) -> Result<Option<(Meta, Vec<u8>)>, String> {
        let Some(meta) = self.latest.lock().clone() else {
            return Ok(None);
        };
        Self::load(&self.path_for(&meta)).map(Some)
    }
}

/// The state machine store of one group (openraft's `RaftStateMachine`).
pub struct StateStore<C: GroupConfig> {
    // In an `Arc` only so the group can tell when openraft dropped the store (`liveness`).
    db: Arc<sled::Db>,
    applied: Arc<RwLock<Applied<C::Machine>>>,
    snapshots: Arc<SnapshotFiles>,
    signal: Arc<tokio::sync::watch::Sender<u64>>,
    unwritten: Unwritten,
    /// A write to sled failed: nothing is written any more, not even at close, since a later
    /// batch would move the applied id past records that never reached sled. sled stays at
    /// its last whole batch (or without an applied id, mid-install), which a reopen repairs.
    failed: bool,
}

/// What the machine applied that sled does not hold yet: each changed record's latest value
/// (`None`: removed), and how many applied batches that covers.
#[derive(Default)]
struct Unwritten {
    records: HashMap<Vec<u8>, Option<Vec<u8>>>,
    batches: u32,
}

impl<C: GroupConfig> StateStore<C> {
    /// Opens the store in `directory` (`state/` for sled, `snapshots/` for files), rebuilding
    /// sled from the latest snapshot when sled is behind it.
    ///
    /// # Errors
    /// [`StateOpenError`] when a directory cannot be used or its content is damaged.
    pub fn open(directory: &Path) -> Result<Self, StateOpenError> {
        let io = |path: &Path| {
            let path = path.display().to_string();
            move |source| StateOpenError::Io { path, source }
        };
        let snapshot_directory = directory.join("snapshots");
        std::fs::create_dir_all(&snapshot_directory).map_err(io(&snapshot_directory))?;
        let mut latest: Option<(Meta, PathBuf)> = None;
        for entry in std::fs::read_dir(&snapshot_directory).map_err(io(&snapshot_directory))? {
            let path = entry.map_err(io(&snapshot_directory))?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            if name.ends_with(TEMPORARY_SUFFIX) {
                // A snapshot write cut short by a crash: never renamed, so never used.
                std::fs::remove_file(&path).map_err(io(&path))?;
                continue;
            }
            if !(name.starts_with(SNAPSHOT_FILE_PREFIX) && name.ends_with(SNAPSHOT_FILE_SUFFIX)) {
                continue;
            }
            let (meta, _) = SnapshotFiles::load(&path).map_err(|reason| {
                StateOpenError::CorruptSnapshot { path: path.display().to_string(), reason }
            })?;
            if latest.as_ref().is_none_or(|(current, _)| meta.last_log_id > current.last_log_id) {
                latest = Some((meta, path));
            }
        }
        let snapshots = Arc::new(SnapshotFiles {
            directory: snapshot_directory,
            latest: Mutex::new(latest.as_ref().map(|(meta, _)| meta.clone())),
            temporary_sequence: AtomicU64::new(0),
        });

        let db = open_sled(&directory.join("state"))?;
        let sled_applied: Option<LogId<NodeId>> = match db.get(KEY_APPLIED)? {
            Some(bytes) => postcard::from_bytes(&bytes)
                .map_err(|e| StateOpenError::CorruptState(format!("applied id: {e}")))?,
            None => None,
        };
        if let Some((meta, path)) = &latest
            && sled_applied < meta.last_log_id
        {
            tracing::info!(
                snapshot = %path.display(),
                ?sled_applied,
                snapshot_last_log_id = ?meta.last_log_id,
                "state database is behind the latest snapshot: rebuilding it from the snapshot"
            );
            let corrupt = |reason: String| StateOpenError::CorruptSnapshot {
                path: path.display().to_string(),
                reason,
            };
            let (_, body) = SnapshotFiles::load(path).map_err(corrupt)?;
            let body: SnapshotBody =
                postcard::from_bytes(&body).map_err(|e| corrupt(format!("body: {e}")))?;
            replace_contents(&db, &body)?;
        }
        let applied = load_applied::<C::Machine>(&db)?;
        let signal = Arc::new(tokio::sync::watch::Sender::new(applied.machine.change_signal()));
        Ok(Self {
            db: Arc::new(db),
            applied: Arc::new(RwLock::new(applied)),
            snapshots,
            signal,
            unwritten: Unwritten::default(),
            failed: false,
        })
    }

    /// Dies when the store is dropped: sled holds a lock on its directory until then.
    pub fn liveness(&self) -> std::sync::Weak<sled::Db> {
        Arc::downgrade(&self.db)
    }

    /// Writes what sled does not hold yet, with the pointers as applied now, in one atomic
    /// batch: sled's records and its applied id never disagree.
    fn write_unwritten(&mut self) -> Result<(), sled::Error> {
        if self.failed {
            return Err(earlier_write_failed());
        }
        if self.unwritten.batches == 0 && self.unwritten.records.is_empty() {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        for (key, value) in self.unwritten.records.drain() {
            match value {
                Some(value) => batch.insert(record_key(&key), value),
                None => batch.remove(record_key(&key)),
            }
        }
        self.unwritten.batches = 0;
        {
            let applied = self.applied.read();
            batch.insert(KEY_MEMBERSHIP, encode(&applied.membership));
            batch.insert(KEY_APPLIED, encode(&applied.last_applied));
        }
        let written = self.db.apply_batch(batch);
        self.failed = written.is_err();
        written
    }

    /// A read handle on the machine, for the group's handle.
    pub fn view(&self) -> MachineView<C::Machine> {
        MachineView { applied: Arc::clone(&self.applied), signal: Arc::clone(&self.signal) }
    }
}

impl<C: GroupConfig> Drop for StateStore<C> {
    /// Writes what sled does not hold yet, so a clean restart has nothing to replay; if that
    /// fails, the restart replays it from the log.
    fn drop(&mut self) {
        if let Err(error) = self.write_unwritten() {
            tracing::warn!(%error, "the state database missed its last writes; a restart replays them");
        }
    }
}

fn earlier_write_failed() -> sled::Error {
    sled::Error::Io(std::io::Error::other("an earlier write to the state database failed"))
}

/// Opens sled, waiting out a directory lock for up to [`SLED_LOCK_WAIT`].
///
/// sled releases its lock only when its background threads finish with the dropped
/// database, a moment after the last handle is gone; a group restarted in the same process
/// can arrive first. A lock still held after the wait is another live process's.
fn open_sled(path: &Path) -> Result<sled::Db, sled::Error> {
    let deadline = std::time::Instant::now() + SLED_LOCK_WAIT;
    loop {
        match sled::Config::new().path(path).cache_capacity(SLED_CACHE_BYTES).open() {
            // sled 0.34 reports a held lock as `ErrorKind::Other` with this message.
            Err(sled::Error::Io(error))
                if error.to_string().starts_with("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            opened => return opened,
        }
    }
}

/// Replaces everything in sled with a snapshot's content.
///
/// The applied pointer is removed first and written last, in the same batch as the records:
/// if this is cut short, sled's applied id stays behind the snapshot file (already durable),
/// and the next open rebuilds again.
fn replace_contents(db: &sled::Db, body: &SnapshotBody) -> Result<(), sled::Error> {
    db.remove(KEY_APPLIED)?;
    db.clear()?;
    let mut batch = sled::Batch::default();
    for (key, value) in &body.records {
        batch.insert(record_key(key), value.as_slice());
    }
    batch.insert(KEY_MEMBERSHIP, encode(&body.membership));
    batch.insert(KEY_APPLIED, encode(&body.last_applied));
    db.apply_batch(batch)
}

/// Loads pointers and records from sled and rebuilds the machine.
fn load_applied<M: GroupMachine>(db: &sled::Db) -> Result<Applied<M>, StateOpenError> {
    let corrupt = |what: &str, e: &dyn std::fmt::Display| {
        StateOpenError::CorruptState(format!("{what}: {e}"))
    };
    let last_applied = match db.get(KEY_APPLIED)? {
        Some(bytes) => postcard::from_bytes(&bytes).map_err(|e| corrupt("applied id", &e))?,
        None => None,
    };
    let membership = match db.get(KEY_MEMBERSHIP)? {
        Some(bytes) => postcard::from_bytes(&bytes).map_err(|e| corrupt("membership", &e))?,
        None => StoredMembership::default(),
    };
    let records = scan_records(db)?;
    let machine = M::from_records(records).map_err(|e| corrupt("record", &e))?;
    Ok(Applied { machine, last_applied, membership })
}

fn scan_records(db: &sled::Db) -> Result<Vec<Record>, sled::Error> {
    db.scan_prefix(RECORD_PREFIX)
        .map(|item| item.map(|(key, value)| (key[RECORD_PREFIX.len()..].to_vec(), value.to_vec())))
        .collect()
}

fn record_key(key: &[u8]) -> Vec<u8> {
    let mut full = Vec::with_capacity(RECORD_PREFIX.len() + key.len());
    full.extend_from_slice(RECORD_PREFIX);
    full.extend_from_slice(key);
    full
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    postcard::to_allocvec(value)
        .expect("postcard encodes openraft's pointer types into a Vec without error")
}

fn sm_error(verb: ErrorVerb, error: &(dyn std::error::Error + 'static)) -> StorageError<NodeId> {
    storage_io(ErrorSubject::StateMachine, verb, error)
}

fn snapshot_error(
    verb: ErrorVerb,
    error: &(dyn std::error::Error + 'static),
) -> StorageError<NodeId> {
    storage_io(ErrorSubject::Snapshot(None), verb, error)
}

/// A snapshot's content captured at one applied index, written to a file by the builder.
pub struct SnapshotBuilder<C> {
    body: Option<SnapshotBody>,
    snapshots: Arc<SnapshotFiles>,
    _config: PhantomData<fn() -> C>,
}

impl<C: GroupConfig> RaftSnapshotBuilder<C> for SnapshotBuilder<C> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<C>, StorageError<NodeId>> {
        let body = self.body.take().ok_or_else(|| {
            snapshot_error(ErrorVerb::Write, &std::io::Error::other("snapshot builder used twice"))
        })?;
        let bytes =
            postcard::to_allocvec(&body).map_err(|e| snapshot_error(ErrorVerb::Write, &e))?;
        if bytes.len() > SNAPSHOT_BYTES_MAX {
            let reason = format!("snapshot of {} bytes exceeds {SNAPSHOT_BYTES_MAX}", bytes.len());
            return Err(snapshot_error(ErrorVerb::Write, &std::io::Error::other(reason)));
        }
        // The id names the last entry it covers: equal ids mean equal content.
        let snapshot_id = match body.last_applied {
            Some(id) => format!("{}-{}-{}", id.leader_id.term, id.leader_id.node_id, id.index),
            None => "empty".to_owned(),
        };
        let meta = SnapshotMeta {
            last_log_id: body.last_applied,
            last_membership: body.membership,
            snapshot_id,
        };
        let snapshots = Arc::clone(&self.snapshots);
        let (meta, bytes) = tokio::task::spawn_blocking(move || {
            snapshots.store(&meta, &bytes).map(|()| (meta, bytes))
        })
        .await
        .map_err(|e| snapshot_error(ErrorVerb::Write, &e))?
        .map_err(|e| snapshot_error(ErrorVerb::Write, &e))?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(bytes)) })
    }
}

impl<C: GroupConfig> RaftStateMachine<C> for StateStore<C> {
    type SnapshotBuilder = SnapshotBuilder<C>;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        let applied = self.applied.read();
        Ok((applied.last_applied, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<C::R>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = C::Entry> + Send,
        I::IntoIter: Send,
    {
        let mut responses = Vec::new();
        let (changes, signal) = {
            let mut applied = self.applied.write();
            for entry in entries {
                applied.last_applied = Some(entry.log_id);
                let response = match &entry.payload {
                    EntryPayload::Blank => <C::Machine as GroupMachine>::empty_response(),
                    EntryPayload::Normal(command) => {
                        applied.machine.apply(entry.log_id.index, command)
                    }
                    EntryPayload::Membership(membership) => {
                        applied.membership =
                            StoredMembership::new(Some(entry.log_id), membership.clone());
                        <C::Machine as GroupMachine>::empty_response()
                    }
                };
                responses.push(response);
            }
            (applied.machine.take_changes(), applied.machine.change_signal())
        };
        for change in changes {
            self.unwritten.records.insert(change.key, change.value);
        }
        self.unwritten.batches += 1;
        if self.unwritten.batches >= SLED_WRITE_EVERY_APPLIES
            || self.unwritten.records.len() >= UNWRITTEN_RECORDS_MAX
        {
            self.write_unwritten().map_err(|e| sm_error(ErrorVerb::Write, &e))?;
        }
        publish_signal(&self.signal, signal);
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // Captured here, under `&mut self`, so no apply runs in between: the records and the
        // pointers agree. A failed write or scan leaves the builder empty and its build
        // reports it.
        let written = self.write_unwritten();
        let body = {
            let applied = self.applied.read();
            match written.and_then(|()| scan_records(&self.db)) {
                Ok(records) => Some(SnapshotBody {
                    last_applied: applied.last_applied,
                    membership: applied.membership.clone(),
                    records,
                }),
                Err(error) => {
                    tracing::error!(%error, "cannot write or read the state database for a snapshot");
                    None
                }
            }
        };
        SnapshotBuilder { body, snapshots: Arc::clone(&self.snapshots), _config: PhantomData }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &Meta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        let fail = |reason: String| snapshot_error(ErrorVerb::Read, &std::io::Error::other(reason));
        if bytes.len() > SNAPSHOT_BYTES_MAX {
            return Err(fail(format!(
                "snapshot of {} bytes exceeds {SNAPSHOT_BYTES_MAX}",
                bytes.len()
            )));
        }
        let body: SnapshotBody =
            postcard::from_bytes(&bytes).map_err(|e| fail(format!("undecodable snapshot: {e}")))?;
        if body.last_applied != meta.last_log_id {
            return Err(fail(format!(
                "snapshot body ends at {:?} but its meta says {:?}",
                body.last_applied, meta.last_log_id
            )));
        }
        let machine = <C::Machine as GroupMachine>::from_records(body.records.iter().cloned())
            .map_err(|e: RecordError| snapshot_error(ErrorVerb::Read, &e))?;
        // The file first: once it is durable, a crash in the middle of replacing sled is
        // repaired on the next open.
        let snapshots = Arc::clone(&self.snapshots);
        let stored_meta = meta.clone();
        tokio::task::spawn_blocking(move || snapshots.store(&stored_meta, &bytes))
            .await
            .map_err(|e| snapshot_error(ErrorVerb::Write, &e))?
            .map_err(|e| snapshot_error(ErrorVerb::Write, &e))?;
        // What was unwritten is older than the snapshot, which replaces it all.
        self.unwritten = Unwritten::default();
        if self.failed {
            return Err(sm_error(ErrorVerb::Write, &earlier_write_failed()));
        }
        if let Err(error) = replace_contents(&self.db, &body) {
            self.failed = true;
            return Err(sm_error(ErrorVerb::Write, &error));
        }
        let signal = machine.change_signal();
        *self.applied.write() =
            Applied { machine, last_applied: body.last_applied, membership: body.membership };
        publish_signal(&self.signal, signal);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<C>>, StorageError<NodeId>> {
        let snapshots = Arc::clone(&self.snapshots);
        let loaded = tokio::task::spawn_blocking(move || snapshots.load_latest())
            .await
            .map_err(|e| snapshot_error(ErrorVerb::Read, &e))?
            .map_err(|reason| snapshot_error(ErrorVerb::Read, &std::io::Error::other(reason)))?;
        Ok(loaded.map(|(meta, body)| Snapshot { meta, snapshot: Box::new(Cursor::new(body)) }))
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, Entry};

    use super::*;
    use crate::core::ledger::{LeaseRequest, QuotaCommand};
    use crate::core::rate::{Algorithm, LimitSpec};
    use crate::ledger::QuotaGroup;

    fn grant_entry(index: u64) -> Entry<QuotaGroup> {
        let limit = LimitSpec::new(Algorithm::TokenBucket, 100, 1_000, None).expect("a limit");
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, NodeId(1)), index),
            payload: EntryPayload::Normal(QuotaCommand::AcquireLeases {
                now_ms: 1_000 + index,
                node_id: NodeId(1),
                requests: vec![LeaseRequest {
                    key: format!("rl:test:key{index}"),
                    limit,
                    tokens_wanted: 5,
                    lease_ttl_ms: 500,
                }],
            }),
        }
    }

    /// Once a write to sled failed, the store writes nothing more, not even when it closes:
    /// sled keeps its last whole batch, and a reopen finds the applied id of that batch.
    #[tokio::test]
    async fn after_a_failed_write_sled_keeps_its_last_whole_batch() {
        let directory = tempfile::tempdir().expect("a temporary directory");
        let written = u64::from(SLED_WRITE_EVERY_APPLIES);
        {
            let mut state =
                StateStore::<QuotaGroup>::open(directory.path()).expect("the store opens");
            for index in 1..=written {
                state.apply([grant_entry(index)]).await.expect("apply");
            }
            // As if the next write had failed, with its batch's records lost from sled.
            state.failed = true;
            let mut refused = false;
            for index in written + 1..=2 * written {
                refused |= state.apply([grant_entry(index)]).await.is_err();
            }
            assert!(refused, "a store whose write failed refuses its next write");
        }
        let mut state = StateStore::<QuotaGroup>::open(directory.path()).expect("reopens");
        let (applied, _) = state.applied_state().await.expect("applied state");
        let last_whole = LogId::new(CommittedLeaderId::new(1, NodeId(1)), written);
        assert_eq!(applied, Some(last_whole), "the log replays what came after");
    }
}

//! The Raft log of one group in redb: entries, vote, committed id and purge marker.
//!
//! This is the source of truth of a group (DESIGN.md section 2), so nothing is acknowledged
//! before it is fsync'd: `save_vote`, `truncate` and `purge` return, and `append` calls
//! `LogFlushed::log_io_completed`, only after a redb commit with `Durability::Immediate`
//! covering the write returned. Entries are postcard-encoded `openraft::Entry` values keyed by
//! index. The state machine and snapshots are `state_store`'s.
//!
//! Group commit. openraft 0.9 calls `append` once per client write and waits for it, so an
//! fsync inside `append` would allow one commit per fsync. Instead `append` encodes the
//! entries, puts them in memory where readers find them at once (`Unflushed`), and queues
//! them with their callback for this store's flusher thread. The flusher writes every entry
//! queued meanwhile in one `Durability::Immediate` transaction (one fsync), and only then
//! drops them from memory and completes their callbacks, in order:
//!
//! ```text
//!  append(e1) ─▶ unflushed += e1 ─▶ queue (e1, cb1) ┐
//!  append(e2) ─▶ unflushed += e2 ─▶ queue (e2, cb2) ┼─▶ flusher: write e1, e2; commit(Immediate)
//!                                                    │   = fsync ─▶ unflushed -= e1, e2 ─▶ cb1, cb2
//!  truncate/purge/save_vote ─▶ barrier: wait until every queued callback completed ─▶ commit(Immediate)
//! ```
//!
//! One thread writes the appended entries, so a write never waits for another's fsync and the
//! runtime hands each append to no other thread than the flusher's (a transaction of its own
//! on tokio's blocking pool cost a second commit and two thread switches per append). The
//! barrier keeps openraft's view of IO in the order it issued it, as a synchronous store
//! would, and leaves nothing unflushed. `save_committed` is a hint openraft may lose, so it
//! only notes the id in memory and the flusher writes it into its next transaction. The other
//! transactions run on tokio's blocking pool, so a commit never stalls the runtime's worker
//! threads. The flusher times each of its writes for the node's metrics
//! (`quotamesh_raft_log_fsync_duration_seconds`): the disk's share of a commit's latency.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogId, LogState, RaftLogReader, StorageError, Vote};
use parking_lot::Mutex;
use prometheus::Histogram;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use super::{GroupConfig, NodeId, storage_io};

/// Log entries by index, postcard-encoded.
const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
/// Small singletons (vote, committed, last purged), postcard-encoded.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const META_VOTE: &str = "vote";
const META_COMMITTED: &str = "committed";
const META_LAST_PURGED: &str = "last_purged";

/// Callbacks and barriers waiting for the flusher; a full queue makes `append` wait, which
/// holds openraft back rather than growing memory.
const FLUSH_QUEUE_MAX: usize = 4096;

/// What the flusher thread is asked to do, in order.
enum FlushRequest<C: openraft::RaftTypeConfig> {
    /// Write these entries, fsync, then complete this callback.
    Appended(Vec<UnflushedEntry>, LogFlushed<C>),
    /// Answer once every request queued before it has been completed.
    Barrier(oneshot::Sender<()>),
}

/// Why the log store could not be opened. Opening again will not help: the file or its
/// directory needs an operator.
#[derive(Debug, thiserror::Error)]
pub enum LogOpenError {
    /// redb refused the file (missing permissions, corrupt, locked by another process).
    #[error("cannot open the Raft log at {path}: {source}")]
    Database {
        /// The log file.
        path: String,
        /// redb's reason.
        #[source]
        source: redb::DatabaseError,
    },
    /// Creating the tables failed.
    #[error("cannot prepare the Raft log tables: {0}")]
    Tables(#[from] redb::Error),
    /// The flusher thread could not be started.
    #[error("cannot start the Raft log flusher thread: {0}")]
    Flusher(std::io::Error),
}

/// The latest committed id openraft reported, postcard-encoded, until the flusher writes it.
type PendingCommitted = Arc<Mutex<Option<Vec<u8>>>>;

/// An appended entry: its index, log id and postcard encoding.
#[derive(Clone)]
struct UnflushedEntry {
    index: u64,
    log_id: LogId<NodeId>,
    bytes: Arc<[u8]>,
}

/// The entries appended but not yet written by the flusher, by index: always the log's last
/// entries, as the flusher writes them in order. Bounded by the flusher's queue.
type Unflushed = Arc<Mutex<BTreeMap<u64, UnflushedEntry>>>;

/// The Raft log store of one group; cheap to clone (openraft reads through clones).
pub struct LogStore<C: openraft::RaftTypeConfig> {
    db: Arc<redb::Database>,
    flusher: mpsc::Sender<FlushRequest<C>>,
    committed: PendingCommitted,
    unflushed: Unflushed,
    _config: PhantomData<fn() -> C>,
}

impl<C: openraft::RaftTypeConfig> Clone for LogStore<C> {
    fn clone(&self) -> Self {
        Self {
            db: Arc::clone(&self.db),
            flusher: self.flusher.clone(),
            committed: Arc::clone(&self.committed),
            unflushed: Arc::clone(&self.unflushed),
            _config: PhantomData,
        }
    }
}

/// The flusher thread: one transaction and fsync for every batch of queued appends, carrying
/// the latest committed id. It holds the database only while it commits, so the file closes
/// as soon as the last [`LogStore`] handle is dropped (a restart in the same process reopens
/// it at once); then it stops. Once a write has failed it writes nothing more and fails every
/// later append: a later batch would leave a hole where the failed one's entries belong.
/// Each write's duration, from its transaction's start to the end of its fsync (time queued
/// for the flusher excluded), goes to `fsync_seconds`: what the disk cost, which a ledger
/// call's latency alone cannot tell from a slow network or scheduler.
fn run_flusher<C: openraft::RaftTypeConfig>(
    db: std::sync::Weak<redb::Database>,
    committed: PendingCommitted,
    unflushed: Unflushed,
    fsync_seconds: Option<&Histogram>,
    mut requests: mpsc::Receiver<FlushRequest<C>>,
) {
    let mut batch = Vec::new();
    let mut failed: Option<String> = None;
    while let Some(first) = requests.blocking_recv() {
        batch.push(first);
        while batch.len() < FLUSH_QUEUE_MAX {
            match requests.try_recv() {
                Ok(request) => batch.push(request),
                Err(_) => break,
            }
        }
        let entries: Vec<&UnflushedEntry> = batch
            .iter()
            .flat_map(|request| match request {
                FlushRequest::Appended(entries, _) => entries.as_slice(),
                FlushRequest::Barrier(_) => &[],
            })
            .collect();
        let needs_fsync = batch.iter().any(|request| matches!(request, FlushRequest::Appended(..)));
        let flushed: Result<(), String> = match (&failed, needs_fsync) {
            (Some(error), _) => Err(error.clone()),
            (None, false) => Ok(()),
            (None, true) => match db.upgrade() {
                Some(db) => {
                    let started = crate::clock::monotonic();
                    let written = write_and_fsync(&db, &entries, &committed);
                    if let Some(histogram) = fsync_seconds {
                        histogram.observe(started.elapsed().as_secs_f64());
                    }
                    written.map_err(|error| error.to_string())
                }
                None => Err("the Raft log was closed before it was fsync'd".to_owned()),
            },
        };
        match &flushed {
            // Readers find them in redb now. A failed write leaves them in memory, and
            // openraft stops the group on the error.
            Ok(()) => {
                let mut unflushed = unflushed.lock();
                for entry in &entries {
                    if unflushed
                        .get(&entry.index)
                        .is_some_and(|kept| Arc::ptr_eq(&kept.bytes, &entry.bytes))
                    {
                        unflushed.remove(&entry.index);
                    }
                }
            }
            Err(error) => {
                if failed.is_none() {
                    tracing::error!(%error, "the Raft log could not be fsync'd");
                    failed = Some(error.clone());
                }
            }
        }
        drop(entries);
        for request in batch.drain(..) {
            match request {
                FlushRequest::Appended(_, callback) => {
                    callback.log_io_completed(flushed.clone().map_err(std::io::Error::other))
                }
                FlushRequest::Barrier(done) => {
                    let _ = done.send(());
                }
            }
        }
    }
}

/// Writes `entries` and the pending committed id, if there is one, in one transaction
/// committed with `Durability::Immediate`.
fn write_and_fsync(
    db: &redb::Database,
    entries: &[&UnflushedEntry],
    committed: &PendingCommitted,
) -> Result<(), redb::Error> {
    let txn = db.begin_write()?;
    {
        let mut table = txn.open_table(ENTRIES)?;
        for entry in entries {
            table.insert(entry.index, &*entry.bytes)?;
        }
    }
    if let Some(bytes) = committed.lock().take() {
        txn.open_table(META)?.insert(META_COMMITTED, bytes.as_slice())?;
    }
    txn.commit()?;
    Ok(())
}

impl<C: GroupConfig> LogStore<C> {
    /// Opens (or creates) the log file `path`; the flusher records each write's duration in
    /// `fsync_seconds` when given.
    ///
    /// # Errors
    /// [`LogOpenError`] when redb cannot open the file or create its tables.
    pub fn open(path: &Path, fsync_seconds: Option<Histogram>) -> Result<Self, LogOpenError> {
        let db = redb::Database::create(path).map_err(|source| LogOpenError::Database {
            path: path.display().to_string(),
            source,
        })?;
        // Create both tables up front so read transactions never meet a missing table.
        let txn = db.begin_write().map_err(redb::Error::from)?;
        txn.open_table(ENTRIES).map_err(redb::Error::from)?;
        txn.open_table(META).map_err(redb::Error::from)?;
        txn.commit().map_err(redb::Error::from)?;
        let db = Arc::new(db);
        let (flusher, requests) = mpsc::channel(FLUSH_QUEUE_MAX);
        let flusher_db = Arc::downgrade(&db);
        let committed = PendingCommitted::default();
        let unflushed = Unflushed::default();
        let (flusher_committed, flusher_unflushed) =
            (Arc::clone(&committed), Arc::clone(&unflushed));
        std::thread::Builder::new()
            .name("raft-log-flush".to_owned())
            .spawn(move || {
                run_flusher::<C>(
                    flusher_db,
                    flusher_committed,
                    flusher_unflushed,
                    fsync_seconds.as_ref(),
                    requests,
                )
            })
            .map_err(LogOpenError::Flusher)?;
        Ok(Self { db, flusher, committed, unflushed, _config: PhantomData })
    }

    /// Waits until every append queued before this call has been fsync'd and completed.
    async fn barrier(
        &self,
        subject: ErrorSubject<NodeId>,
        verb: ErrorVerb,
    ) -> Result<(), StorageError<NodeId>> {
        let (done, completed) = oneshot::channel();
        let stopped = |_| {
            storage_io(
                subject.clone(),
                verb,
                &std::io::Error::other("the Raft log flusher stopped"),
            )
        };
        self.flusher.send(FlushRequest::Barrier(done)).await.map_err(|_| stopped(()))?;
        completed.await.map_err(|_| stopped(()))
    }

    /// Dies when the last handle on the log file is dropped, so the file can be reopened.
    pub fn liveness(&self) -> std::sync::Weak<redb::Database> {
        Arc::downgrade(&self.db)
    }

    /// Runs one write transaction on the blocking pool and commits it, fsync'd.
    async fn write<F>(
        &self,
        verb_subject: (ErrorSubject<NodeId>, ErrorVerb),
        body: F,
    ) -> Result<(), StorageError<NodeId>>
    where
        F: FnOnce(&redb::WriteTransaction) -> Result<(), redb::Error> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        let (subject, verb) = verb_subject;
        let outcome = tokio::task::spawn_blocking(move || -> Result<(), redb::Error> {
            let txn = db.begin_write()?;
            body(&txn)?;
            // Durability::Immediate, redb's default: commit returns after the fsync.
            txn.commit()?;
            Ok(())
        })
        .await;
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(storage_io(subject, verb, &error)),
            Err(join_error) => Err(storage_io(subject, verb, &join_error)),
        }
    }

    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &str,
        subject: ErrorSubject<NodeId>,
    ) -> Result<Option<T>, StorageError<NodeId>> {
        let fail = |error: &(dyn std::error::Error + 'static)| {
            storage_io(subject.clone(), ErrorVerb::Read, error)
        };
        let txn = self.db.begin_read().map_err(|e| fail(&e))?;
        let table = txn.open_table(META).map_err(|e| fail(&e))?;
        let Some(bytes) = table.get(key).map_err(|e| fail(&e))? else {
            return Ok(None);
        };
        postcard::from_bytes(bytes.value()).map(Some).map_err(|e| fail(&e))
    }

    async fn write_meta<T: serde::Serialize>(
        &self,
        key: &'static str,
        value: &T,
        subject: ErrorSubject<NodeId>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = postcard::to_allocvec(value)
            .map_err(|e| storage_io(subject.clone(), ErrorVerb::Write, &e))?;
        self.write((subject, ErrorVerb::Write), move |txn| {
            txn.open_table(META)?.insert(key, bytes.as_slice())?;
            Ok(())
        })
        .await
    }
}

impl<C: GroupConfig> RaftLogReader<C> for LogStore<C> {
    // Reads run inline: redb serves them from its page cache, and openraft's replication
    // tasks read in bounded batches (`max_payload_entries`).
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<C::Entry>, StorageError<NodeId>> {
        let fail = |error: &(dyn std::error::Error + 'static)| {
            storage_io(ErrorSubject::Logs, ErrorVerb::Read, error)
        };
        let bounds: (Bound<u64>, Bound<u64>) =
            (range.start_bound().cloned(), range.end_bound().cloned());
        // The unflushed entries first, then redb: an entry the flusher writes in between is
        // dropped from memory only after its commit, so it is in one or the other. The
        // unflushed ones are the log's last, so redb is read only below the first of them.
        let unflushed: Vec<UnflushedEntry> =
            self.unflushed.lock().range(bounds).map(|(_, entry)| entry.clone()).collect();
        let redb_end = match unflushed.first() {
            Some(first) => Bound::Excluded(first.index),
            None => bounds.1,
        };
        let txn = self.db.begin_read().map_err(|e| fail(&e))?;
        let table = txn.open_table(ENTRIES).map_err(|e| fail(&e))?;
        let mut entries = Vec::new();
        for item in table.range::<u64>((bounds.0, redb_end)).map_err(|e| fail(&e))? {
            let (_, bytes) = item.map_err(|e| fail(&e))?;
            entries.push(postcard::from_bytes(bytes.value()).map_err(|e| fail(&e))?);
        }
        for entry in unflushed {
            entries.push(postcard::from_bytes(&entry.bytes).map_err(|e| fail(&e))?);
        }
        Ok(entries)
    }
}

impl<C: GroupConfig> RaftLogStorage<C> for LogStore<C> {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, StorageError<NodeId>> {
        let last_purged_log_id: Option<LogId<NodeId>> =
            self.read_meta(META_LAST_PURGED, ErrorSubject::Logs)?;
        let fail = |error: &(dyn std::error::Error + 'static)| {
            storage_io(ErrorSubject::Logs, ErrorVerb::Read, error)
        };
        if let Some((_, last)) = self.unflushed.lock().last_key_value() {
            return Ok(LogState { last_purged_log_id, last_log_id: Some(last.log_id) });
        }
        let txn = self.db.begin_read().map_err(|e| fail(&e))?;
        let table = txn.open_table(ENTRIES).map_err(|e| fail(&e))?;
        let last_log_id = match table.last().map_err(|e| fail(&e))? {
            Some((_, bytes)) => {
                let entry: C::Entry = postcard::from_bytes(bytes.value()).map_err(|e| fail(&e))?;
                Some(entry.log_id)
            }
            None => last_purged_log_id,
        };
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.barrier(ErrorSubject::Vote, ErrorVerb::Write).await?;
        self.write_meta(META_VOTE, vote, ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.read_meta(META_VOTE, ErrorSubject::Vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        // A hint openraft may lose: written by the flusher's next fsync, whenever that comes.
        let bytes = postcard::to_allocvec(&committed)
            .map_err(|e| storage_io(ErrorSubject::Store, ErrorVerb::Write, &e))?;
        *self.committed.lock() = Some(bytes);
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        let pending = self.committed.lock().clone();
        let committed = match pending {
            Some(bytes) => Some(
                postcard::from_bytes::<Option<LogId<NodeId>>>(&bytes)
                    .map_err(|e| storage_io(ErrorSubject::Store, ErrorVerb::Read, &e))?,
            ),
            None => self.read_meta::<Option<LogId<NodeId>>>(META_COMMITTED, ErrorSubject::Store)?,
        };
        Ok(committed.flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<C>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = C::Entry> + Send,
        I::IntoIter: Send,
    {
        let mut encoded = Vec::new();
        for entry in entries {
            let bytes = postcard::to_allocvec(&entry)
                .map_err(|e| storage_io(ErrorSubject::Logs, ErrorVerb::Write, &e))?;
            let (index, log_id) = (entry.log_id.index, entry.log_id);
            encoded.push(UnflushedEntry { index, log_id, bytes: bytes.into() });
        }
        // Readable now, durable only after the flusher's fsync: only then may openraft count
        // this node's copy towards a quorum.
        self.unflushed.lock().extend(encoded.iter().map(|entry| (entry.index, entry.clone())));
        if let Err(mpsc::error::SendError(request)) =
            self.flusher.send(FlushRequest::Appended(encoded, callback)).await
        {
            let error = std::io::Error::other("the Raft log flusher stopped");
            if let FlushRequest::Appended(_, callback) = request {
                callback.log_io_completed(Err(std::io::Error::other(error.to_string())));
            }
            return Err(storage_io(ErrorSubject::Logs, ErrorVerb::Write, &error));
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.barrier(ErrorSubject::Logs, ErrorVerb::Delete).await?;
        self.write((ErrorSubject::Logs, ErrorVerb::Delete), move |txn| {
            txn.open_table(ENTRIES)?.retain_in(log_id.index.., |_, _| false)?;
            Ok(())
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        let marker = postcard::to_allocvec(&log_id)
            .map_err(|e| storage_io(ErrorSubject::Logs, ErrorVerb::Delete, &e))?;
        // Marker and deletion in one transaction: a crash never leaves a hole before the marker.
        self.barrier(ErrorSubject::Logs, ErrorVerb::Delete).await?;
        self.write((ErrorSubject::Logs, ErrorVerb::Delete), move |txn| {
            txn.open_table(META)?.insert(META_LAST_PURGED, marker.as_slice())?;
            txn.open_table(ENTRIES)?.retain_in(..=log_id.index, |_, _| false)?;
            Ok(())
        })
        .await
    }
}

//! The Raft log of one group in redb: entries, vote, committed id and purge marker.
//!
//! This is the source of truth of a group (DESIGN.md section 2), so every write is one redb
//! transaction committed with `Durability::Immediate` (fsync'd) before openraft hears of it:
//! `save_vote` returns, and `append` calls `LogFlushed::log_io_completed`, only after the
//! commit returned. The fsync runs on tokio's blocking pool so it never stalls the runtime's
//! two worker threads. Entries are postcard-encoded `openraft::Entry` values keyed by index.
//! The state machine and snapshots are `state_store`'s.

use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, LogId, LogState, RaftLogReader, StorageError, Vote};
use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use super::{GroupConfig, NodeId, storage_io};

/// Log entries by index, postcard-encoded.
const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
/// Small singletons (vote, committed, last purged), postcard-encoded.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const META_VOTE: &str = "vote";
const META_COMMITTED: &str = "committed";
const META_LAST_PURGED: &str = "last_purged";

/// Why the log store could not be opened.
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
}

impl LogOpenError {
    /// Opening again will not help: the file or its directory needs an operator.
    pub fn retry_may_help(&self) -> bool {
        false
    }
}

/// The Raft log store of one group; cheap to clone (openraft reads through clones).
pub struct LogStore<C> {
    db: Arc<redb::Database>,
    _config: PhantomData<fn() -> C>,
}

impl<C> Clone for LogStore<C> {
    fn clone(&self) -> Self {
        Self { db: Arc::clone(&self.db), _config: PhantomData }
    }
}

impl<C: GroupConfig> LogStore<C> {
    /// Opens (or creates) the log file `path`.
    ///
    /// # Errors
    /// [`LogOpenError`] when redb cannot open the file or create its tables.
    pub fn open(path: &Path) -> Result<Self, LogOpenError> {
        let db = redb::Database::create(path).map_err(|source| LogOpenError::Database {
            path: path.display().to_string(),
            source,
        })?;
        // Create both tables up front so read transactions never meet a missing table.
        let txn = db.begin_write().map_err(redb::Error::from)?;
        txn.open_table(ENTRIES).map_err(redb::Error::from)?;
        txn.open_table(META).map_err(redb::Error::from)?;
        txn.commit().map_err(redb::Error::from)?;
        Ok(Self { db: Arc::new(db), _config: PhantomData })
    }

    /// Dies when the last handle on the log file is dropped, so the file can be reopened.
    pub fn liveness(&self) -> std::sync::Weak<redb::Database> {
        Arc::downgrade(&self.db)
    }

    /// Runs one write transaction on the blocking pool and commits it durably.
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
            // Durability::Immediate is redb's default: commit returns after the fsync.
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
        let txn = self.db.begin_read().map_err(|e| fail(&e))?;
        let table = txn.open_table(ENTRIES).map_err(|e| fail(&e))?;
        let bounds: (Bound<u64>, Bound<u64>) =
            (range.start_bound().cloned(), range.end_bound().cloned());
        let mut entries = Vec::new();
        for item in table.range::<u64>(bounds).map_err(|e| fail(&e))? {
            let (_, bytes) = item.map_err(|e| fail(&e))?;
            entries.push(postcard::from_bytes(bytes.value()).map_err(|e| fail(&e))?);
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
        self.write_meta(META_VOTE, vote, ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.read_meta(META_VOTE, ErrorSubject::Vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        self.write_meta(META_COMMITTED, &committed, ErrorSubject::Store).await
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(self.read_meta::<Option<LogId<NodeId>>>(META_COMMITTED, ErrorSubject::Store)?.flatten())
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
        // Encode first, then write the whole batch in one transaction: one fsync per batch.
        let mut encoded = Vec::new();
        for entry in entries {
            let bytes = postcard::to_allocvec(&entry)
                .map_err(|e| storage_io(ErrorSubject::Logs, ErrorVerb::Write, &e))?;
            encoded.push((entry.log_id.index, bytes));
        }
        let outcome = self
            .write((ErrorSubject::Logs, ErrorVerb::Write), move |txn| {
                let mut table = txn.open_table(ENTRIES)?;
                for (index, bytes) in &encoded {
                    table.insert(*index, bytes.as_slice())?;
                }
                Ok(())
            })
            .await;
        // The commit above returned, so the entries are durable: only now may openraft count
        // this node's copy towards a quorum.
        match &outcome {
            Ok(()) => callback.log_io_completed(Ok(())),
            Err(error) => callback.log_io_completed(Err(std::io::Error::other(error.to_string()))),
        }
        outcome
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
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
        self.write((ErrorSubject::Logs, ErrorVerb::Delete), move |txn| {
            txn.open_table(META)?.insert(META_LAST_PURGED, marker.as_slice())?;
            txn.open_table(ENTRIES)?.retain_in(..=log_id.index, |_, _| false)?;
            Ok(())
        })
        .await
    }
}

//! The quota group's storage (redb log, sled state, snapshot files) against openraft's own
//! storage conformance suite, the sled rebuild from a snapshot after sled loses data, sled
//! written behind the machine, and log entries readable before the flusher has written them.

use std::collections::BTreeSet;

use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{
    Entry, EntryPayload, LogId, Membership, RaftLogReader, RaftSnapshotBuilder, StorageError,
};
use quotamesh::core::ledger::{LeaseRequest, NodeId, QuotaCommand, QuotaResponse};
use quotamesh::core::rate::{Algorithm, LimitSpec};
use quotamesh::ledger::QuotaGroup;
use quotamesh::ledger::log_store::LogStore;
use quotamesh::ledger::state_store::StateStore;

struct TempStores;

impl StoreBuilder<QuotaGroup, LogStore<QuotaGroup>, StateStore<QuotaGroup>, tempfile::TempDir>
    for TempStores
{
    async fn build(
        &self,
    ) -> Result<
        (tempfile::TempDir, LogStore<QuotaGroup>, StateStore<QuotaGroup>),
        StorageError<NodeId>,
    > {
        let directory = tempfile::tempdir().expect("a temporary directory");
        let log = LogStore::open(&directory.path().join("raft-log.redb"), None)
            .expect("the log store opens");
        let state = StateStore::open(directory.path()).expect("the state store opens");
        Ok((directory, log, state))
    }
}

// Proves the redb log store and the sled state store meet every rule openraft's suite checks.
#[test]
fn openraft_storage_suite_passes() -> anyhow::Result<()> {
    Suite::test_all(TempStores)?;
    Ok(())
}

fn log_id(term: u64, index: u64) -> LogId<NodeId> {
    LogId::new(openraft::CommittedLeaderId::new(term, NodeId(1)), index)
}

fn grant_entry(index: u64, now_ms: u64) -> Entry<QuotaGroup> {
    let limit = LimitSpec::new(Algorithm::TokenBucket, 100, 1_000, None).expect("a valid limit");
    Entry {
        log_id: log_id(1, index),
        payload: EntryPayload::Normal(QuotaCommand::AcquireLeases {
            now_ms,
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

// Proves that when sled loses its data, reopening rebuilds it from the latest snapshot file,
// and that the log entries after the snapshot are what remains to replay.
#[tokio::test]
async fn state_is_rebuilt_from_the_latest_snapshot_when_sled_is_lost() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let membership = Entry::<QuotaGroup> {
        log_id: log_id(1, 1),
        payload: EntryPayload::Membership(Membership::new(vec![BTreeSet::from([NodeId(1)])], None)),
    };
    let digest_at_snapshot = {
        let mut state =
            StateStore::<QuotaGroup>::open(directory.path()).expect("the state store opens");
        let replies = state
            .apply([membership, grant_entry(2, 1_000), grant_entry(3, 1_001)])
            .await
            .expect("apply");
        assert!(
            matches!(&replies[1], QuotaResponse::Leases(grants) if grants[0].as_ref().map(|g| g.granted_tokens) == Ok(5))
        );
        let snapshot =
            state.get_snapshot_builder().await.build_snapshot().await.expect("a snapshot");
        assert_eq!(snapshot.meta.last_log_id, Some(log_id(1, 3)));
        let digest = state.view().read(|ledger| ledger.digest());
        state.apply([grant_entry(4, 1_002)]).await.expect("apply after the snapshot");
        assert_ne!(state.view().read(|ledger| ledger.digest()), digest);
        digest
    };
    // Lose sled entirely (it is not the source of truth): only the snapshot file remains.
    std::fs::remove_dir_all(directory.path().join("state")).expect("remove the sled directory");
    let mut state =
        StateStore::<QuotaGroup>::open(directory.path()).expect("the state store reopens");
    let (applied, membership) = state.applied_state().await.expect("applied state");
    assert_eq!(applied, Some(log_id(1, 3)), "rebuilt up to the snapshot; the log replays the rest");
    assert_eq!(membership.log_id(), &Some(log_id(1, 1)));
    assert_eq!(state.view().read(|ledger| ledger.digest()), digest_at_snapshot);
    let current = state.get_current_snapshot().await.expect("read").expect("a current snapshot");
    assert_eq!(current.meta.last_log_id, Some(log_id(1, 3)));
}

// Proves that sled, written behind the machine, holds every applied batch once the store is
// closed: a reopen finds the last applied id and the same ledger, with nothing to replay.
#[tokio::test]
async fn a_closed_state_store_holds_every_applied_batch() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let batches = u64::from(quotamesh::ledger::state_store::SLED_WRITE_EVERY_APPLIES) + 3;
    let digest = {
        let mut state =
            StateStore::<QuotaGroup>::open(directory.path()).expect("the state store opens");
        for index in 1..=batches {
            state.apply([grant_entry(index, 1_000 + index)]).await.expect("apply");
        }
        state.view().read(|ledger| ledger.digest())
    };
    let mut state =
        StateStore::<QuotaGroup>::open(directory.path()).expect("the state store reopens");
    let (applied, _) = state.applied_state().await.expect("applied state");
    assert_eq!(applied, Some(log_id(1, batches)), "every batch is in sled");
    assert_eq!(state.view().read(|ledger| ledger.digest()), digest);
}

// Proves the log store keeps vote, entries and purge marker across a reopen of its file.
#[tokio::test]
async fn log_survives_reopen() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let path = directory.path().join("raft-log.redb");
    {
        let mut log = LogStore::<QuotaGroup>::open(&path, None).expect("the log opens");
        let vote = openraft::Vote::new(3, NodeId(2));
        log.save_vote(&vote).await.expect("save vote");
        let entries: Vec<Entry<QuotaGroup>> =
            (1..=5).map(|index| grant_entry(index, 1_000 + index)).collect();
        // Returns only once the append reported itself durable through its callback.
        log.blocking_append(entries).await.expect("append");
        log.purge(log_id(1, 2)).await.expect("purge");
    }
    let mut log = LogStore::<QuotaGroup>::open(&path, None).expect("the log reopens");
    assert_eq!(log.read_vote().await.expect("read vote"), Some(openraft::Vote::new(3, NodeId(2))));
    let state = log.get_log_state().await.expect("log state");
    assert_eq!(state.last_purged_log_id, Some(log_id(1, 2)));
    assert_eq!(state.last_log_id, Some(log_id(1, 5)));
}

// Proves appended entries are readable as soon as `append` returns, before the flusher has
// written them (openraft's replication reads them at once), and are durable once their
// callback has said so; the flusher's one write is timed, including what held the disk back.
#[tokio::test]
async fn appended_entries_are_readable_before_they_are_flushed() {
    let directory = tempfile::tempdir().expect("a temporary directory");
    let path = directory.path().join("raft-log.redb");
    let fsync_seconds = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new(
        "fsync_seconds",
        "the flusher's writes",
    ))
    .expect("a histogram");
    let mut log =
        LogStore::<QuotaGroup>::open(&path, Some(fsync_seconds.clone())).expect("the log opens");
    let db = log.liveness().upgrade().expect("the log is open");
    // redb has one writer at a time: while this transaction is open the flusher cannot write.
    let held = db.begin_write().expect("a write transaction");
    let mut appender = log.clone();
    let entries: Vec<Entry<QuotaGroup>> =
        (1..=3).map(|index| grant_entry(index, 1_000 + index)).collect();
    let appended = tokio::spawn(async move { appender.blocking_append(entries).await });
    let mut reader = log.get_log_reader().await;
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let read = reader.try_get_log_entries(1..=3).await.expect("the log reads");
            if read.len() == 3 {
                return read;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the appended entries are readable while the flusher waits");
    let indexes: Vec<u64> = read.iter().map(|entry| entry.log_id.index).collect();
    assert_eq!(indexes, [1, 2, 3]);
    let state = log.get_log_state().await.expect("log state");
    assert_eq!(state.last_log_id, Some(log_id(1, 3)));
    assert!(!appended.is_finished(), "the append is not durable before the flusher wrote it");
    // The flusher has the append (this single-threaded test ran the appender up to its wait
    // for the callback) and waits for the disk.
    let held_for = std::time::Duration::from_millis(200);
    tokio::time::sleep(held_for).await;
    held.abort().expect("the held transaction ends");
    appended.await.expect("the append task").expect("append");
    assert_eq!(fsync_seconds.get_sample_count(), 1, "three entries appended at once, one write");
    assert!(
        fsync_seconds.get_sample_sum() >= held_for.as_secs_f64() / 2.0,
        "the write waited for the disk: {} s",
        fsync_seconds.get_sample_sum()
    );
    drop((db, reader, log));
    let mut reopened = LogStore::<QuotaGroup>::open(&path, None).expect("the log reopens");
    let state = reopened.get_log_state().await.expect("log state");
    assert_eq!(state.last_log_id, Some(log_id(1, 3)));
}

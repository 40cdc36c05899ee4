//! Batches concurrent billing operations into Raft commands.
//!
//! One Raft commit costs an fsync on a majority; committing each debit alone would cap a
//! node at a few hundred debits a second. The proposer queues operations from every
//! concurrent call and sends what has gathered as ONE command while earlier commands are in
//! flight, with at most [`WRITES_IN_FLIGHT_MAX`] commands outstanding, so a batch grows with
//! the load and a lone call waits for nothing but its own commit.
//!
//! ```text
//!  call ─▶ queue (bounded) ─▶ proposer task ─▶ batch ─▶ RaftGroup::write (leader, or one hop)
//!   ▲                                                       │ BillingResponse, one per op
//!   └──────────────── oneshot reply ◀────────────────────────┘
//! ```
//!
//! A call that gives up (its deadline passed) answers `UNAVAILABLE` itself; its operation
//! may still commit, which is why a client retries with the same key. A command the group
//! refuses as such (too large; a leader that cannot read it) was not applied and never will
//! be: its operations answer [`ProposeError::Rejected`], a code that tells clients not to
//! retry (`crate::api::status`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use crate::core::billing::OperationError;
use crate::core::billing::{BillingCommand, OPERATIONS_PER_COMMAND_MAX, Operation, Outcome};
use crate::ledger::{BillingGroup, RaftGroup, WriteError};

/// Most operations waiting for a batch; a call beyond it is refused at once.
pub const QUEUED_OPERATIONS_MAX: usize = 65_536;
/// Most commands in flight at once from this node. Two keep the log busy (one commits while
/// the next gathers) without splitting the load into many small batches: every log entry
/// costs an fsync on the leader and on a follower, so larger batches mean more debits per
/// second (measured: 8 in flight gave a third of the throughput of 2 at 256 clients).
pub const WRITES_IN_FLIGHT_MAX: usize = 2;

const _: () = assert!(QUEUED_OPERATIONS_MAX >= OPERATIONS_PER_COMMAND_MAX);

/// Why an operation got no committed outcome.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProposeError {
    /// The ledger refused the operation; nothing was applied.
    #[error(transparent)]
    Refused(#[from] OperationError),
    /// The billing group refused the command carrying the operation as such (too large, or
    /// a leader that cannot read it): nothing was applied, and sending it again will not
    /// help.
    #[error("the billing group refused the command: {0}")]
    Rejected(WriteError),
    /// No commit within the deadline (no quorum, leader lost, timeout): the operation may or
    /// may not have been applied.
    #[error("no commit within the deadline; the outcome is unknown, retry with the same key: {0}")]
    Unavailable(String),
    /// The queue is full; the operation was not sent.
    #[error("the billing queue of this node is full; retry later")]
    Overloaded,
    /// The node is shutting down; the operation was not sent.
    #[error("the node is shutting down")]
    Stopped,
}

struct Pending {
    operation: Operation,
    deadline: Instant,
    reply: oneshot::Sender<Result<Outcome, ProposeError>>,
}

/// The sending side; cheap to clone.
#[derive(Clone)]
pub struct Proposer {
    queue: mpsc::Sender<Pending>,
}

/// What every command of this node carries besides its operations.
#[derive(Debug, Clone, Copy)]
pub struct ProposerSettings {
    /// `billing.key_retention_ms`.
    pub key_retention_ms: u64,
}

impl Proposer {
    /// Starts the proposer task for `group`; it ends when every [`Proposer`] is dropped.
    pub fn start(group: RaftGroup<BillingGroup>, settings: ProposerSettings) -> Self {
        let (queue, receiver) = mpsc::channel(QUEUED_OPERATIONS_MAX);
        tokio::spawn(run(group, settings, receiver));
        Self { queue }
    }

    /// Commits `operation` and returns its outcome, or gives up at `deadline`.
    ///
    /// # Errors
    /// [`ProposeError`]; `Unavailable` means the outcome is unknown.
    pub async fn propose(
        &self,
        operation: Operation,
        deadline: Instant,
    ) -> Result<Outcome, ProposeError> {
        let (reply, answer) = oneshot::channel();
        self.queue.try_send(Pending { operation, deadline, reply }).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ProposeError::Overloaded,
            mpsc::error::TrySendError::Closed(_) => ProposeError::Stopped,
        })?;
        match tokio::time::timeout_at(deadline, answer).await {
            Err(_) => Err(ProposeError::Unavailable("deadline passed".to_owned())),
            // The task dropped the reply: it stopped while holding the operation.
            Ok(Err(_)) => Err(ProposeError::Unavailable("the proposer stopped".to_owned())),
            Ok(Ok(result)) => result,
        }
    }
}

async fn run(
    group: RaftGroup<BillingGroup>,
    settings: ProposerSettings,
    mut receiver: mpsc::Receiver<Pending>,
) {
    let in_flight = Arc::new(Semaphore::new(WRITES_IN_FLIGHT_MAX));
    loop {
        // Take the permit first: while all are busy, operations gather in the queue.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
        let Some(first) = receiver.recv().await else { return };
        let mut batch = Vec::with_capacity(64);
        batch.push(first);
        while batch.len() < OPERATIONS_PER_COMMAND_MAX {
            match receiver.try_recv() {
                Ok(pending) => batch.push(pending),
                Err(_) => break,
            }
        }
        // A caller that already gave up is not proposed: its answer is UNAVAILABLE anyway.
        batch.retain(|pending| !pending.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let group = group.clone();
        tokio::spawn(async move {
            write_batch(&group, settings, batch).await;
            drop(permit);
        });
    }
}

async fn write_batch(
    group: &RaftGroup<BillingGroup>,
    settings: ProposerSettings,
    batch: Vec<Pending>,
) {
    let latest = batch.iter().map(|pending| pending.deadline).max().unwrap_or_else(Instant::now);
    let timeout = latest.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let (operations, replies): (Vec<_>, Vec<_>) =
        batch.into_iter().map(|pending| (pending.operation, pending.reply)).unzip();
    let command = BillingCommand {
        now_ms: crate::clock::now_ms(),
        key_retention_ms: settings.key_retention_ms,
        operations,
    };
    match group.write(command, timeout).await {
        Ok(response) => {
            let mut outcomes = response.outcomes.into_iter();
            for reply in replies {
                let result = match outcomes.next() {
                    Some(outcome) => outcome.map_err(ProposeError::Refused),
                    // A response shorter than its command breaks the machine's contract.
                    None => Err(ProposeError::Unavailable("short response".to_owned())),
                };
                let _ = reply.send(result);
            }
        }
        Err(error) => {
            let failure = write_failure(&error);
            for reply in replies {
                let _ = reply.send(Err(failure.clone()));
            }
        }
    }
}

fn write_failure(error: &WriteError) -> ProposeError {
    if !error.retry_may_help() {
        return ProposeError::Rejected(error.clone());
    }
    // Not applied, or unknown: to the caller both mean "retry with the same key". A group
    // that stopped may have appended the command before it did, so that is unknown too.
    ProposeError::Unavailable(error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::NodeId;

    /// A command the group refuses as such answers a code that says "not applied, do not
    /// retry"; one whose outcome is unknown, or that may go through later, UNAVAILABLE.
    #[test]
    fn write_failures_keep_their_kind() {
        let code = |error: WriteError| tonic::Status::from(write_failure(&error)).code();
        assert_eq!(code(WriteError::TooLarge { bytes: 5 }), tonic::Code::ResourceExhausted);
        let refused = WriteError::Refused { leader: NodeId(1), reason: "version".to_owned() };
        assert_eq!(code(refused), tonic::Code::FailedPrecondition);
        for unknown in [
            WriteError::NoLeader,
            WriteError::Timeout,
            WriteError::LeaderLost { leader: NodeId(2), reason: "reset".to_owned() },
            WriteError::Stopped("storage".to_owned()),
        ] {
            assert_eq!(code(unknown), tonic::Code::Unavailable);
        }
    }
}

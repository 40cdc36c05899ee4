//! [`CoreGate`]: the door every call into a group's openraft core passes, so that a shutdown
//! stops the core with no call in flight.
//!
//! openraft answers a call whose core stopped under it with `Fatal::Stopped` and logs that as
//! an ERROR, which a deliberate stop is not. So a stop first closes the gate: calls not yet
//! made are refused, calls in flight are dropped (their callers see `Fatal::Stopped`, as
//! they would have from the core), and only once none is left does the core stop. A call
//! dropped in flight may still take effect: its outcome is unknown to the caller, as it is
//! for any call to a node that stops.

use std::future::Future;

use openraft::error::Fatal;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::NodeId;

/// Shared by every clone of a group's handle.
#[derive(Clone, Default)]
pub(crate) struct CoreGate {
    closing: CancellationToken,
    in_flight: TaskTracker,
}

impl CoreGate {
    /// Runs `call` (a call into the core) unless the gate is closing; a call in flight when
    /// it closes is dropped. Either way the caller gets `Fatal::Stopped`.
    pub(crate) async fn call<T, E: From<Fatal<NodeId>>>(
        &self,
        call: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        // Counted before the check: a close that has not seen this call yet waits for it,
        // and one that has is seen by the check, so the call is never started.
        let _counted = self.in_flight.token();
        tokio::select! {
            biased;
            () = self.closing.cancelled() => Err(Fatal::Stopped.into()),
            outcome = call => outcome,
        }
    }

    /// Refuses new calls, drops those in flight and returns once none is left.
    pub(crate) async fn close(&self) {
        self.closing.cancel();
        self.in_flight.close();
        self.in_flight.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_closed_gate_refuses_calls_and_drops_those_in_flight() {
        let gate = CoreGate::default();
        let answered: Result<u8, Fatal<NodeId>> = gate.call(async { Ok(7) }).await;
        assert_eq!(answered, Ok(7));

        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let waiting = tokio::spawn({
            let gate = gate.clone();
            async move {
                gate.call(async move {
                    let _ = started_tx.send(());
                    std::future::pending::<Result<u8, Fatal<NodeId>>>().await
                })
                .await
            }
        });
        started_rx.await.expect("the call started");
        tokio::time::timeout(Duration::from_secs(5), gate.close())
            .await
            .expect("close returns once the call in flight is dropped");
        assert_eq!(waiting.await.expect("joined"), Err(Fatal::Stopped));

        let mut reached = false;
        let refused: Result<u8, Fatal<NodeId>> = gate
            .call(async {
                reached = true;
                Ok(1)
            })
            .await;
        assert_eq!(refused, Err(Fatal::Stopped));
        assert!(!reached, "a call after the close never starts");
    }
}

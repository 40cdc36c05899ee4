//! The leader's side of ledger time: the anchor its stamps count from, and the clock
//! offsets of the nodes whose writes it proposes. The rule is `crate::core::ledger_time`'s;
//! this file reads the clocks (through `crate::clock`), holds the state and reports.
//!
//! ```text
//!  follower / gateway ── Forward { from, sent_at_ms, command } ──▶ leader
//!                                     │ offset = sent_at_ms - leader wall clock
//!                                     │   past max_clock_offset_ms: metric, WARN, status
//!                                     ▼
//!            command.now_ms = Stamper::stamp (anchor + monotonic elapsed) ──▶ client_write
//! ```
//!
//! A write proposed on the leader itself is stamped the same way (`crate::ledger::group`),
//! so every command in the log carries a leader's stamp; a proposer's own `now_ms` is
//! overwritten and moves nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::NodeId;
use crate::core::ledger_time::{
    MAX_CLOCK_OFFSET_MS_DEFAULT, anchor_ms, clock_offset_ms, offset_exceeded, stamp_ms,
};
use crate::metrics::Metrics;

/// Most nodes whose offset is kept (and labelled in metrics): a region's voters and
/// gateways. A proposer beyond them is still judged and logged, not kept.
pub const OFFSET_NODES_MAX: usize = super::network::PEER_CHANNELS_MAX;
/// Shortest time between two warnings about one node's clock.
const OFFSET_WARNING_INTERVAL: Duration = Duration::from_secs(10);

/// What a follower or gateway sends the leader in a `Forward` call (the payload's postcard
/// encoding): who it is, its wall clock when it sent, and the command (whose own time the
/// leader overwrites).
#[derive(Debug, Serialize, Deserialize)]
pub struct Forwarded<D> {
    /// The sending node.
    pub from: NodeId,
    /// Its wall clock when it sent, to judge its offset from the leader's.
    pub sent_at_ms: u64,
    /// The group's command.
    pub command: D,
}

/// Where this node's stamps count from while it leads in `term`.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    term: u64,
    ledger_ms: u64,
    at: Instant,
}

/// The leader's stamp source for one group: anchored once per term, then monotonic.
#[derive(Debug, Default)]
pub(crate) struct Stamper {
    anchor: Mutex<Option<Anchor>>,
}

impl Stamper {
    /// Anchors for `term` unless anchored for it already: at `applied_ledger_ms()` (the
    /// machine's ledger time as applied here) and this instant.
    pub(crate) fn anchor(&self, term: u64, applied_ledger_ms: impl FnOnce() -> u64) {
        let mut anchor = self.anchor.lock();
        Self::anchored(&mut anchor, term, applied_ledger_ms);
    }

    /// The time to stamp on a command proposed now in `term`.
    pub(crate) fn stamp(&self, term: u64, applied_ledger_ms: impl FnOnce() -> u64) -> u64 {
        let mut anchor = self.anchor.lock();
        let anchor = Self::anchored(&mut anchor, term, applied_ledger_ms);
        stamp_ms(anchor.ledger_ms, crate::clock::elapsed_ms(anchor.at))
    }

    fn anchored(
        anchor: &mut Option<Anchor>,
        term: u64,
        applied_ledger_ms: impl FnOnce() -> u64,
    ) -> Anchor {
        match *anchor {
            Some(current) if current.term == term => current,
            _ => {
                let applied_ms = applied_ledger_ms();
                let fresh = Anchor {
                    term,
                    ledger_ms: anchor_ms(applied_ms, crate::clock::now_ms()),
                    at: crate::clock::monotonic(),
                };
                tracing::debug!(
                    term,
                    applied_ms,
                    anchor_ms = fresh.ledger_ms,
                    "ledger time anchored"
                );
                *anchor = Some(fresh);
                fresh
            }
        }
    }
}

/// One node's clock as the leader last judged it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockOffset {
    /// The node.
    pub node_id: NodeId,
    /// How far its wall clock was ahead of this node's at its last write (negative: behind).
    pub offset_ms: i64,
    /// Writes from it whose offset was past `max_clock_offset_ms`.
    pub exceeded_total: u64,
}

#[derive(Debug)]
struct Seen {
    offset: ClockOffset,
    warned_at: Option<Instant>,
}

struct OffsetsInner {
    max_clock_offset_ms: u64,
    nodes: Mutex<BTreeMap<NodeId, Seen>>,
    metrics: Option<Metrics>,
}

/// The clock offsets this node saw as a leader, shared by the groups of a process; cheap to
/// clone.
#[derive(Clone)]
pub struct ClockOffsets {
    inner: Arc<OffsetsInner>,
}

impl std::fmt::Debug for ClockOffsets {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ClockOffsets")
            .field("max_clock_offset_ms", &self.inner.max_clock_offset_ms)
            .field("nodes", &self.snapshot())
            .finish()
    }
}

impl Default for ClockOffsets {
    fn default() -> Self {
        Self::new(MAX_CLOCK_OFFSET_MS_DEFAULT, None)
    }
}

impl ClockOffsets {
    /// Judges offsets against `max_clock_offset_ms`, recording into `metrics` when given.
    pub fn new(max_clock_offset_ms: u64, metrics: Option<Metrics>) -> Self {
        Self {
            inner: Arc::new(OffsetsInner {
                max_clock_offset_ms,
                nodes: Mutex::new(BTreeMap::new()),
                metrics,
            }),
        }
    }

    /// The offset past which a node is reported.
    pub fn max_clock_offset_ms(&self) -> u64 {
        self.inner.max_clock_offset_ms
    }

    /// Judges the clock of `from`, which read `sent_at_ms` when it sent a write of `group`
    /// that reached this node now.
    pub(crate) fn observe(&self, group: &str, from: NodeId, sent_at_ms: u64) {
        let offset_ms = clock_offset_ms(sent_at_ms, crate::clock::now_ms());
        let exceeded = offset_exceeded(offset_ms, self.inner.max_clock_offset_ms);
        let warn = {
            let mut nodes = self.inner.nodes.lock();
            if nodes.len() >= OFFSET_NODES_MAX && !nodes.contains_key(&from) {
                exceeded
            } else {
                let seen = nodes.entry(from).or_insert(Seen {
                    offset: ClockOffset { node_id: from, offset_ms, exceeded_total: 0 },
                    warned_at: None,
                });
                seen.offset.offset_ms = offset_ms;
                if exceeded {
                    seen.offset.exceeded_total = seen.offset.exceeded_total.saturating_add(1);
                }
                let due = seen
                    .warned_at
                    .is_none_or(|warned_at| warned_at.elapsed() >= OFFSET_WARNING_INTERVAL);
                if exceeded && due {
                    seen.warned_at = Some(crate::clock::monotonic());
                }
                if let Some(metrics) = &self.inner.metrics {
                    let node = from.to_string();
                    #[allow(clippy::cast_precision_loss)]
                    let seconds = offset_ms as f64 / 1000.0;
                    metrics.clock_offset.with_label_values(&[&node]).set(seconds);
                    if exceeded {
                        metrics.clock_offset_exceeded.with_label_values(&[&node]).inc();
                    }
                }
                exceeded && due
            }
        };
        if warn {
            tracing::warn!(
                %group,
                node = %from,
                offset_ms,
                max_clock_offset_ms = self.inner.max_clock_offset_ms,
                "a node's clock differs from this leader's by more than max_clock_offset_ms; \
                 its writes are stamped with the leader's time (check its NTP)"
            );
        }
    }

    /// The last judgement of every node seen, in id order.
    pub fn snapshot(&self) -> Vec<ClockOffset> {
        self.inner.nodes.lock().values().map(|seen| seen.offset).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stamper keeps its anchor within a term and re-anchors on a new one.
    #[test]
    fn anchors_once_per_term() {
        let stamper = Stamper::default();
        let first = stamper.stamp(3, || 1_000);
        assert!((1_000..1_000 + 60_000).contains(&first), "{first}");
        // Later reads of the applied time are not taken within the term.
        let again = stamper.stamp(3, || 9_999_999);
        assert!(again >= first && again < 9_999_999, "{again}");
        let next_term = stamper.stamp(4, || 9_999_999);
        assert!(next_term >= 9_999_999, "{next_term}");
    }

    /// Offsets past the bound are counted per node; within it they are only recorded.
    #[test]
    fn offsets_are_judged_per_node() {
        let offsets = ClockOffsets::new(500, Some(Metrics::new()));
        let now = crate::clock::now_ms();
        offsets.observe("billing", NodeId(3), now + 90_000_000);
        offsets.observe("billing", NodeId(3), now + 90_000_000);
        offsets.observe("billing", NodeId(2), now);
        let seen = offsets.snapshot();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0].node_id, NodeId(2));
        assert_eq!(seen[0].exceeded_total, 0);
        assert_eq!(seen[1].exceeded_total, 2);
        assert!(seen[1].offset_ms > 89_000_000);
    }
}

//! Whether a node should take traffic: the judgement behind `/readyz`, pure.
//!
//! A node is ready once it has started, every Raft group it is a member of runs, knows a
//! leader and has applied its log to within [`APPLY_LAG_ENTRIES_MAX`] entries of what it
//! knows committed, and its circuit breaker around the quota ledger is not open. Liveness
//! (`/healthz`) is not judged here: a node that is not ready is still alive. The shell that
//! gathers the views is `crate::raft_health`; the HTTP endpoint is `crate::api::http`.

/// Most entries a group's applied index may trail its committed one on a ready node: a
/// follower applies a batch within milliseconds, so more means it cannot keep up (or is
/// installing a snapshot) and would answer reads from an old state.
pub const APPLY_LAG_ENTRIES_MAX: u64 = 1_000;

/// One Raft group as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupView {
    /// The group's name.
    pub group: &'static str,
    /// Whether this node is a member (a gateway is not, and is not judged on the group).
    pub member: bool,
    /// Why the group stopped on this node, when it did (a storage failure).
    pub stopped: Option<String>,
    /// The leader this node knows of.
    pub leader: Option<u64>,
    /// The last entry applied here.
    pub applied_index: Option<u64>,
    /// The last entry this node knows committed.
    pub committed_index: Option<u64>,
}

/// Why a node is not ready.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// It has not finished starting (or is shutting down).
    #[error("starting")]
    Starting,
    /// A group stopped on this node.
    #[error("the {group} Raft group has stopped: {reason}")]
    GroupStopped {
        /// The group.
        group: &'static str,
        /// openraft's reason.
        reason: String,
    },
    /// A group knows no leader.
    #[error("the {group} Raft group knows no leader")]
    NoLeader {
        /// The group.
        group: &'static str,
    },
    /// A group's applied index trails its committed one by too much.
    #[error("the {group} Raft group applied {applied} of {committed} committed entries")]
    Behind {
        /// The group.
        group: &'static str,
        /// Applied here.
        applied: u64,
        /// Known committed.
        committed: u64,
    },
    /// The circuit breaker around the quota ledger is open: decisions come from the local
    /// fallback.
    #[error("the circuit breaker around the quota ledger is open")]
    CircuitOpen,
}

/// The first reason the node is not ready, if any.
///
/// # Errors
/// [`NotReady`] naming the first failed condition, groups in the order given.
pub fn judge(started: bool, groups: &[GroupView], circuit_open: bool) -> Result<(), NotReady> {
    if !started {
        return Err(NotReady::Starting);
    }
    for view in groups {
        if let Some(reason) = &view.stopped {
            return Err(NotReady::GroupStopped { group: view.group, reason: reason.clone() });
        }
        if !view.member {
            continue;
        }
        if view.leader.is_none() {
            return Err(NotReady::NoLeader { group: view.group });
        }
        let applied = view.applied_index.unwrap_or(0);
        let committed = view.committed_index.unwrap_or(0);
        if committed.saturating_sub(applied) > APPLY_LAG_ENTRIES_MAX {
            return Err(NotReady::Behind { group: view.group, applied, committed });
        }
    }
    if circuit_open {
        return Err(NotReady::CircuitOpen);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn healthy(group: &'static str) -> GroupView {
        GroupView {
            group,
            member: true,
            stopped: None,
            leader: Some(1),
            applied_index: Some(10),
            committed_index: Some(10),
        }
    }

    /// Each condition on its own makes the node unready, with its reason.
    #[test]
    fn every_condition_is_judged() {
        let ok = [healthy("quota"), healthy("billing")];
        assert_eq!(judge(true, &ok, false), Ok(()));
        assert_eq!(judge(false, &ok, false), Err(NotReady::Starting));
        assert_eq!(judge(true, &ok, true), Err(NotReady::CircuitOpen));
        let mut stopped = ok.clone();
        stopped[1].stopped = Some("storage error".to_owned());
        assert!(matches!(
            judge(true, &stopped, false),
            Err(NotReady::GroupStopped { group: "billing", .. })
        ));
        let mut leaderless = ok.clone();
        leaderless[0].leader = None;
        assert_eq!(judge(true, &leaderless, false), Err(NotReady::NoLeader { group: "quota" }));
        let mut behind = ok.clone();
        behind[0].committed_index = Some(10 + APPLY_LAG_ENTRIES_MAX + 1);
        assert!(matches!(judge(true, &behind, false), Err(NotReady::Behind { .. })));
    }

    /// A group this node is no member of (a gateway's) is not judged, unless it stopped.
    #[test]
    fn a_gateway_is_not_judged_on_the_group() {
        let mut outside = healthy("quota");
        outside.member = false;
        outside.leader = None;
        assert_eq!(judge(true, &[outside.clone()], false), Ok(()));
        outside.stopped = Some("gone".to_owned());
        assert!(judge(true, &[outside], false).is_err());
    }

    proptest! {
        /// Against the naive reading of the rule: ready exactly when started, the circuit
        /// is not open, and every member group runs, has a leader and a small apply lag.
        #[test]
        fn judgement_matches_the_rule(
            started: bool,
            circuit_open: bool,
            groups in prop::collection::vec(
                (any::<bool>(), any::<bool>(), any::<bool>(), 0u64..3_000, 0u64..3_000),
                0..4,
            ),
        ) {
            let views: Vec<GroupView> = groups
                .iter()
                .map(|(member, stopped, leader, applied, committed)| GroupView {
                    group: "g",
                    member: *member,
                    stopped: stopped.then(|| "stopped".to_owned()),
                    leader: leader.then_some(1),
                    applied_index: Some(*applied),
                    committed_index: Some(*committed),
                })
                .collect();
            let expected = started
                && !circuit_open
                && groups.iter().all(|(member, stopped, leader, applied, committed)| {
                    !stopped
                        && (!member
                            || (*leader && committed.saturating_sub(*applied) <= APPLY_LAG_ENTRIES_MAX))
                });
            prop_assert_eq!(judge(started, &views, circuit_open).is_ok(), expected);
        }
    }
}

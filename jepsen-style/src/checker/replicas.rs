//! The replicas checker (part of C5): after healing, every node has applied each Raft group
//! (billing, quota) to the same index with the same state digest, as the nodes' admin
//! `Status` reports them. The same index with another digest is a divergence (invalid);
//! nodes that never reached the same index within the final phase cannot be compared
//! (unknown).

use serde::{Deserialize, Serialize};

use super::CheckResult;
use crate::history::NodeId;

/// One group's state on one node (`replicas.json`, read last in the final phase).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaState {
    pub node: NodeId,
    /// `billing` or `quota`.
    pub group: String,
    /// `None`: the node did not answer, or has applied nothing.
    pub applied_index: Option<u64>,
    pub state_digest: u64,
}

pub fn check(replicas: &[ReplicaState]) -> CheckResult {
    let mut result = CheckResult::new("replicas");
    if replicas.is_empty() {
        result.unknown("no node's state was read".to_owned());
    }
    let mut groups: Vec<&str> = replicas.iter().map(|replica| replica.group.as_str()).collect();
    groups.sort_unstable();
    groups.dedup();
    for group in groups {
        let states: Vec<&ReplicaState> =
            replicas.iter().filter(|replica| replica.group == group).collect();
        result.checked += states.len() as u64;
        for (position, first) in states.iter().enumerate() {
            for second in &states[position + 1..] {
                if first.applied_index.is_some()
                    && first.applied_index == second.applied_index
                    && first.state_digest != second.state_digest
                {
                    result.problem(format!(
                        "{group}: nodes {} and {} both applied index {:?} with digests {:x} and \
                         {:x}",
                        first.node.0,
                        second.node.0,
                        first.applied_index,
                        first.state_digest,
                        second.state_digest
                    ));
                }
            }
        }
        if states.iter().any(|state| state.applied_index != states[0].applied_index) {
            let seen: Vec<String> = states
                .iter()
                .map(|state| format!("node {} at {:?}", state.node.0, state.applied_index))
                .collect();
            result.unknown(format!("{group}: the nodes did not converge: {}", seen.join(", ")));
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;

    fn state(node: u64, applied_index: Option<u64>, state_digest: u64) -> ReplicaState {
        ReplicaState { node: NodeId(node), group: "billing".into(), applied_index, state_digest }
    }

    /// Equal indexes and digests pass; a digest differing at one index is a divergence;
    /// different indexes cannot be judged; nothing read cannot be judged.
    #[test]
    fn divergence_is_flagged() {
        let same = [state(1, Some(9), 7), state(2, Some(9), 7), state(3, Some(9), 7)];
        assert_eq!(check(&same).validity, Validity::Valid);
        let diverged = [state(1, Some(9), 7), state(2, Some(9), 8), state(3, Some(9), 7)];
        assert_eq!(check(&diverged).validity, Validity::Invalid);
        let behind = [state(1, Some(9), 7), state(2, Some(8), 5), state(3, None, 0)];
        assert_eq!(check(&behind).validity, Validity::Unknown);
        assert_eq!(check(&[]).validity, Validity::Unknown);
    }
}

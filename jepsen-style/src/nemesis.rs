//! The nemesis's plan and record: a schedule of faults drawn from the seed (pure, no IO:
//! the same seed and options give the same schedule), and the `nemesis.jsonl` records of
//! each fault's start and end as it was carried out. Carrying a fault out on processes is
//! the topology's business (`topology::local`).

use serde::{Deserialize, Serialize};

use crate::history::NodeId;
use crate::rng::SeededRng;

/// A kind of fault the nemesis injects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL (kill -9), restarted on the same data directory when the fault ends.
    Kill,
    /// SIGSTOP, and SIGCONT when the fault ends.
    Pause,
    /// The target nodes cut off from the rest, both ways (netns only); every node alone when
    /// the target is all of them.
    Partition,
    /// The target nodes' wall clocks set off by the fault's offset (libfaketime), their
    /// monotonic clocks untouched; set back when the fault ends.
    Clock,
    /// The target nodes hear nothing from the rest, while the rest still hear them (netns):
    /// nft drops on the targets' input only.
    PartitionOneWay,
    /// The targets' partition put in place and taken away every [`FLAP_MS`] until the fault
    /// ends (netns).
    PartitionFlap,
    /// The targets' wall clocks stepped to the fault's offset and back to true time every
    /// [`CLOCK_STEP_MS`] (libfaketime): a clock that keeps jumping, where `clock` holds one
    /// offset.
    ClockStep,
    /// The targets' policy files rewritten on disk (the nodes watch them): the same rules
    /// plus one more, or, for [`PolicyEdit::Broken`], a file no node may accept; put back
    /// when the fault ends. The workload's limits must hold across reloads.
    Policy,
    /// The target node removed from the region's voters (`quotamesh cluster remove-node`)
    /// while it keeps running, and added back (`add-node`) when the fault ends.
    Membership,
    /// The targets' data directories full: each is a small tmpfs (root), filled by a file
    /// the runner writes until no space is left, and removed when the fault ends.
    Disk,
    /// Jepsen's `majorities-ring` (netns): every node hears a majority, no two the same one.
    /// The nodes stand in a seeded ring ([`Target::Ring`]) and each drops what it receives
    /// from every node outside the window of a majority around it ([`majorities_ring_links`]).
    MajoritiesRing,
}

/// A flapping partition changes state this often: below the election timeouts' 300 ms,
/// so a side may lose its leader and find the link back mid-election.
pub const FLAP_MS: u64 = 250;
/// A stepping clock changes state this often: above libfaketime's one-second re-read of the
/// offset file, so every step takes effect.
pub const CLOCK_STEP_MS: u64 = 1_100;

/// How a policy fault rewrites the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyEdit {
    /// The rules plus an unrelated one: a reload that must keep the workload's buckets.
    ExtraRule,
    /// Not a policy: the node must refuse it and keep serving the one it has.
    Broken,
}

impl FaultKind {
    /// Every kind.
    pub const ALL: [Self; 11] = [
        Self::Kill,
        Self::Pause,
        Self::Partition,
        Self::PartitionOneWay,
        Self::PartitionFlap,
        Self::Clock,
        Self::ClockStep,
        Self::Policy,
        Self::Membership,
        Self::Disk,
        Self::MajoritiesRing,
    ];

    /// Parses a `--nemesis` name.
    ///
    /// # Errors
    /// An unknown name, with the known ones.
    pub fn parse(name: &str) -> Result<Self, String> {
        let name = name.trim();
        Self::ALL.into_iter().find(|kind| kind.name() == name).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|kind| kind.name()).collect();
            format!("unknown nemesis {name:?}; known: {}", known.join(", "))
        })
    }

    /// Its `--nemesis` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kill => "kill",
            Self::Pause => "pause",
            Self::Partition => "partition",
            Self::Clock => "clock",
            Self::PartitionOneWay => "partition-one-way",
            Self::PartitionFlap => "partition-flap",
            Self::ClockStep => "clock-step",
            Self::Policy => "policy",
            Self::Membership => "membership",
            Self::Disk => "disk",
            Self::MajoritiesRing => "majorities-ring",
        }
    }

    /// How often a fault of this kind changes state while it lasts (`None`: it does not).
    pub fn toggle_ms(self) -> Option<u64> {
        match self {
            Self::PartitionFlap => Some(FLAP_MS),
            Self::ClockStep => Some(CLOCK_STEP_MS),
            _ => None,
        }
    }

    /// Whether it cuts network links (netns only).
    pub fn is_partition(self) -> bool {
        matches!(
            self,
            Self::Partition | Self::PartitionOneWay | Self::PartitionFlap | Self::MajoritiesRing
        )
    }

    /// Whether it moves wall clocks (the nodes then run under libfaketime).
    pub fn is_clock(self) -> bool {
        matches!(self, Self::Clock | Self::ClockStep)
    }
}

/// Which nodes a fault hits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// One node, by its position (0-based) among the cluster's nodes.
    One(usize),
    /// Whichever node leads the billing group when the fault starts.
    Leader,
    /// Fewer than half of the nodes, by position.
    Minority(Vec<usize>),
    /// Every node: a coordinated crash, or the whole cluster frozen.
    All,
    /// Partitions only: the other nodes split in two halves that cannot reach each other,
    /// this node (by position) reaching both.
    Bridge(usize),
    /// [`FaultKind::MajoritiesRing`] only: every node, in this ring order (positions).
    Ring(Vec<usize>),
}

/// The links a partition of `target` cuts, as pairs of positions (lower first), given the
/// nodes it resolved to (`positions`) among `nodes`: the targets from the rest, every link
/// for `All`, and between the two halves for a bridge.
pub fn cut_links(target: &Target, positions: &[usize], nodes: usize) -> Vec<(usize, usize)> {
    let pairs = (0..nodes).flat_map(|first| (first + 1..nodes).map(move |second| (first, second)));
    match target {
        Target::All => pairs.collect(),
        Target::Bridge(bridge) => {
            let others: Vec<usize> = (0..nodes).filter(|node| node != bridge).collect();
            let (left, right) = others.split_at(others.len() / 2);
            pairs.filter(|(first, second)| left.contains(first) && right.contains(second)).collect()
        }
        Target::One(_) | Target::Leader | Target::Minority(_) | Target::Ring(_) => pairs
            .filter(|(first, second)| positions.contains(first) != positions.contains(second))
            .collect(),
    }
}

/// The directed links a one-way partition of `target` cuts, as (sender, receiver) pairs of
/// positions: every other node to each target, or every node to every other for `All`.
pub fn one_way_links(target: &Target, positions: &[usize], nodes: usize) -> Vec<(usize, usize)> {
    let pairs = (0..nodes).flat_map(|sender| (0..nodes).map(move |receiver| (sender, receiver)));
    pairs
        .filter(|(sender, receiver)| {
            sender != receiver
                && match target {
                    Target::All => true,
                    _ => positions.contains(receiver) && !positions.contains(sender),
                }
        })
        .collect()
}

/// The directed links a majorities ring cuts, as (sender, receiver) pairs of positions:
/// each node hears the majority of nodes in the window of the ring around it (itself at
/// its middle, as Jepsen's `majorities-ring-perfect` places it) and drops what the others
/// send. With three or more nodes no two windows are the same majority. For five nodes the
/// cuts are symmetric (each node linked to its two neighbours); for three they are one
/// way round the ring, which over TCP, needing both directions, leaves every node alone.
pub fn majorities_ring_links(ring: &[usize]) -> Vec<(usize, usize)> {
    let count = ring.len();
    let majority = count / 2 + 1;
    let mut links = Vec::new();
    for (slot, receiver) in ring.iter().enumerate() {
        // The window starts majority / 2 slots before the receiver's.
        let first = slot + count - majority / 2;
        let heard: Vec<usize> = (first..first + majority).map(|at| ring[at % count]).collect();
        links.extend(
            ring.iter().filter(|sender| !heard.contains(sender)).map(|sender| (*sender, *receiver)),
        );
    }
    links.sort_unstable();
    links
}

/// One planned fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledFault {
    /// From the start of the workload.
    pub start_ms: u64,
    pub duration_ms: u64,
    pub kind: FaultKind,
    pub target: Target,
    /// For a clock fault: how far the targets' wall clocks move, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_offset_s: Option<i64>,
    /// For a policy fault: how the file is rewritten.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_edit: Option<PolicyEdit>,
}

/// The clock offsets a clock fault draws from: past the 24 h idempotency-key retention, an
/// hour either way (a hold's TTL), and an NTP-sized step.
pub const CLOCK_OFFSETS_S: [i64; 4] = [25 * 3_600, 3_600, -3_600, 30];

impl ScheduledFault {
    pub fn end_ms(&self) -> u64 {
        self.start_ms.saturating_add(self.duration_ms)
    }
}

/// What the schedule is drawn from, besides the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduleOptions {
    pub kinds: Vec<FaultKind>,
    pub nodes: usize,
    /// Faults start and end within this, from the workload's start.
    pub time_limit_ms: u64,
    /// Mean quiet time between two faults.
    pub interval_ms: u64,
    /// Shortest and longest fault.
    pub fault_ms_min: u64,
    pub fault_ms_max: u64,
}

/// The default quiet time between faults: long enough for a region to elect a leader and
/// serve again (election timeouts are 300 to 600 ms), short enough for several faults a run.
pub const INTERVAL_MS_DEFAULT: u64 = 4_000;
/// Faults last 1 to 3 s: a pause longer than the longest election timeout deposes a leader.
pub const FAULT_MS_MIN_DEFAULT: u64 = 1_000;
pub const FAULT_MS_MAX_DEFAULT: u64 = 3_000;
/// In percent: how often a partition is a bridge rather than its drawn target.
const BRIDGE_PERCENT: u64 = 25;
/// In percent: how often a policy fault writes a broken file rather than a good one.
const BROKEN_POLICY_PERCENT: u64 = 25;
/// In percent: how often a fault hits every node rather than one, the leader or a minority.
const ALL_NODES_PERCENT: u64 = 15;

/// The faults of a run, in time order, never overlapping, all ended by the time limit.
/// Kinds are dealt from a seeded shuffle of all of them, refilled when empty, so every kind
/// asked for comes up once in each round (a short run still sees each kind).
pub fn schedule(seed: u64, options: &ScheduleOptions) -> Vec<ScheduledFault> {
    let mut rng = SeededRng::fork(seed, u64::from(u32::MAX));
    let mut faults = Vec::new();
    if options.kinds.is_empty() || options.nodes == 0 {
        return faults;
    }
    let half = options.interval_ms / 2;
    let mut at_ms = rng.between(half, options.interval_ms.saturating_add(half));
    let mut deck: Vec<FaultKind> = Vec::new();
    loop {
        if deck.is_empty() {
            deck.clone_from(&options.kinds);
            // Fisher-Yates; the deck is dealt from its end.
            for slot in (1..deck.len()).rev() {
                deck.swap(slot, rng.index(slot + 1));
            }
        }
        let Some(kind) = deck.pop() else {
            return faults;
        };
        let mut target = draw_target(&mut rng, options.nodes);
        // Drawn only for partitions, so other kinds' schedules do not depend on it.
        if kind == FaultKind::Partition && options.nodes >= 3 && rng.percent(BRIDGE_PERCENT) {
            target = Target::Bridge(rng.index(options.nodes));
        }
        // Drawn only for majorities rings, so other kinds' schedules do not depend on it.
        if kind == FaultKind::MajoritiesRing {
            let mut ring: Vec<usize> = (0..options.nodes).collect();
            for slot in (1..ring.len()).rev() {
                ring.swap(slot, rng.index(slot + 1));
            }
            target = Target::Ring(ring);
        }
        // A region keeps a voter: a membership fault removes one node, or the leader.
        if kind == FaultKind::Membership && !matches!(target, Target::One(_)) {
            target = Target::Leader;
        }
        let duration_ms = rng.between(options.fault_ms_min, options.fault_ms_max);
        // Drawn only for clock faults, so other kinds' schedules do not depend on it.
        let clock_offset_s =
            kind.is_clock().then(|| CLOCK_OFFSETS_S[rng.index(CLOCK_OFFSETS_S.len())]);
        let policy_edit = (kind == FaultKind::Policy).then(|| {
            if rng.percent(BROKEN_POLICY_PERCENT) {
                PolicyEdit::Broken
            } else {
                PolicyEdit::ExtraRule
            }
        });
        let fault = ScheduledFault {
            start_ms: at_ms,
            duration_ms,
            kind,
            target,
            clock_offset_s,
            policy_edit,
        };
        if fault.end_ms() > options.time_limit_ms {
            return faults;
        }
        at_ms = fault.end_ms().saturating_add(rng.between(half, options.interval_ms + half));
        faults.push(fault);
    }
}

fn draw_target(rng: &mut SeededRng, nodes: usize) -> Target {
    if rng.percent(ALL_NODES_PERCENT) {
        return Target::All;
    }
    let minority_size = (nodes - 1) / 2;
    match rng.between(0, if minority_size > 1 { 2 } else { 1 }) {
        0 => Target::One(rng.index(nodes)),
        1 => Target::Leader,
        _ => {
            let mut positions: Vec<usize> = (0..nodes).collect();
            // A partial Fisher-Yates shuffle: the first `minority_size` are the pick.
            for slot in 0..minority_size {
                let other = slot + rng.index(nodes - slot);
                positions.swap(slot, other);
            }
            positions.truncate(minority_size);
            positions.sort_unstable();
            Target::Minority(positions)
        }
    }
}

/// Whether a fault record marks its start or its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Start,
    End,
}

/// What became of a nemesis step (openraft's Jepsen vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultOutcome {
    /// Done on every target.
    Installed,
    /// Known not done (no leader to target).
    Skipped,
    /// Partly done or unknown (a signal or a restart failed).
    Indeterminate,
}

/// One line of `nemesis.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NemesisRecord {
    /// The runner's monotonic clock since the run started (the history's time base): for a
    /// start, when the fault was in place; for an end, when healing began.
    pub time_ns: u64,
    /// The fault's position in the schedule.
    pub fault: usize,
    pub phase: Phase,
    pub kind: FaultKind,
    pub target: Target,
    /// The nodes it was applied to.
    pub nodes: Vec<NodeId>,
    pub outcome: FaultOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn options(nodes: usize, time_limit_ms: u64, kinds: Vec<FaultKind>) -> ScheduleOptions {
        ScheduleOptions {
            kinds,
            nodes,
            time_limit_ms,
            interval_ms: INTERVAL_MS_DEFAULT,
            fault_ms_min: FAULT_MS_MIN_DEFAULT,
            fault_ms_max: FAULT_MS_MAX_DEFAULT,
        }
    }

    proptest! {
        /// A schedule is a function of the seed, its faults are ordered, apart, within the
        /// time limit, of the asked kinds, and aimed at nodes that exist (a minority is
        /// fewer than half of them, without repeats).
        #[test]
        fn schedules_are_seeded_and_sane(
            seed: u64,
            nodes in 1_usize..8,
            time_limit_ms in 0_u64..600_000,
            pause_only: bool,
        ) {
            let kinds = if pause_only { vec![FaultKind::Pause] } else {
                vec![
                    FaultKind::Kill,
                    FaultKind::Pause,
                    FaultKind::Clock,
                    FaultKind::ClockStep,
                    FaultKind::PartitionOneWay,
                    FaultKind::PartitionFlap,
                    FaultKind::Policy,
                    FaultKind::Membership,
                    FaultKind::Disk,
                    FaultKind::MajoritiesRing,
                ]
            };
            let options = options(nodes, time_limit_ms, kinds.clone());
            let faults = schedule(seed, &options);
            prop_assert_eq!(&faults, &schedule(seed, &options));
            // Every round of as many faults as kinds holds each kind once.
            for round in faults.chunks_exact(kinds.len()) {
                for kind in &kinds {
                    prop_assert_eq!(round.iter().filter(|fault| fault.kind == *kind).count(), 1);
                }
            }
            let mut previous_end_ms = 0;
            for fault in &faults {
                prop_assert!(fault.start_ms > previous_end_ms);
                prop_assert!(fault.end_ms() <= time_limit_ms);
                prop_assert!(kinds.contains(&fault.kind));
                prop_assert!(fault.duration_ms >= FAULT_MS_MIN_DEFAULT);
                prop_assert!(fault.duration_ms <= FAULT_MS_MAX_DEFAULT);
                prop_assert_eq!(fault.clock_offset_s.is_some(), fault.kind.is_clock());
                prop_assert_eq!(fault.policy_edit.is_some(), fault.kind == FaultKind::Policy);
                if fault.kind == FaultKind::Membership {
                    prop_assert!(matches!(fault.target, Target::One(_) | Target::Leader));
                }
                match &fault.target {
                    Target::One(position) => prop_assert!(*position < nodes),
                    Target::Minority(positions) => {
                        prop_assert!(!positions.is_empty());
                        prop_assert!(positions.len() * 2 < nodes);
                        prop_assert!(positions.windows(2).all(|pair| pair[0] < pair[1]));
                        prop_assert!(positions.iter().all(|position| *position < nodes));
                    }
                    Target::Bridge(position) => {
                        prop_assert!(*position < nodes && nodes >= 3);
                        prop_assert_eq!(fault.kind, FaultKind::Partition);
                    }
                    Target::Ring(ring) => {
                        prop_assert_eq!(fault.kind, FaultKind::MajoritiesRing);
                        let mut sorted = ring.clone();
                        sorted.sort_unstable();
                        prop_assert_eq!(sorted, (0..nodes).collect::<Vec<_>>());
                    }
                    Target::Leader | Target::All => {}
                }
                prop_assert_eq!(
                    fault.kind == FaultKind::MajoritiesRing,
                    matches!(fault.target, Target::Ring(_))
                );
                previous_end_ms = fault.end_ms();
            }
        }
    }

    /// The links cut: the targets from the rest; every link for all; a bridge keeps its
    /// own links and cuts the halves apart.
    #[test]
    fn partitions_cut_the_right_links() {
        assert_eq!(cut_links(&Target::One(1), &[1], 3), vec![(0, 1), (1, 2)]);
        let minority = cut_links(&Target::Minority(vec![0, 3]), &[0, 3], 5);
        assert_eq!(minority, vec![(0, 1), (0, 2), (0, 4), (1, 3), (2, 3), (3, 4)]);
        assert_eq!(cut_links(&Target::All, &[0, 1, 2], 3), vec![(0, 1), (0, 2), (1, 2)]);
        assert_eq!(cut_links(&Target::Bridge(2), &[2], 3), vec![(0, 1)]);
        assert_eq!(cut_links(&Target::Bridge(0), &[0], 5), vec![(1, 3), (1, 4), (2, 3), (2, 4)]);
    }

    /// Every kind's name parses back to it, as serde names it too.
    #[test]
    fn names_round_trip() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::parse(kind.name()), Ok(kind));
            assert_eq!(serde_json::to_string(&kind).expect("json"), format!("\"{}\"", kind.name()));
        }
        assert!(FaultKind::parse("flood").is_err());
    }

    proptest! {
        /// In a majorities ring of three or more nodes every node hears a majority (itself
        /// included) and no two hear the same one; no node drops its own traffic.
        #[test]
        fn majorities_rings_are_distinct_majorities(
            nodes in 3_usize..10,
            seed: u64,
        ) {
            let mut rng = SeededRng::new(seed);
            let mut ring: Vec<usize> = (0..nodes).collect();
            for slot in (1..nodes).rev() {
                ring.swap(slot, rng.index(slot + 1));
            }
            let links = majorities_ring_links(&ring);
            let mut heard_sets = Vec::new();
            for receiver in 0..nodes {
                let heard: Vec<usize> = (0..nodes)
                    .filter(|sender| !links.contains(&(*sender, receiver)))
                    .collect();
                prop_assert!(heard.contains(&receiver));
                prop_assert!(heard.len() * 2 > nodes, "{heard:?} of {nodes}");
                prop_assert!(!heard_sets.contains(&heard), "{heard:?} twice");
                heard_sets.push(heard);
            }
        }
    }

    /// Five nodes: each linked both ways to its two ring neighbours only (Jepsen's exact
    /// ring); three: one way round the ring.
    #[test]
    fn majorities_rings_match_jepsen() {
        let five = majorities_ring_links(&[0, 1, 2, 3, 4]);
        let expected: Vec<(usize, usize)> =
            vec![(0, 2), (0, 3), (1, 3), (1, 4), (2, 0), (2, 4), (3, 0), (3, 1), (4, 1), (4, 2)];
        assert_eq!(five, expected);
        // Node 1 hears 0 and itself, 2 hears 1, 0 hears 2.
        assert_eq!(majorities_ring_links(&[0, 1, 2]), vec![(0, 2), (1, 0), (2, 1)]);
        assert_eq!(majorities_ring_links(&[0, 2, 1]), vec![(0, 1), (1, 2), (2, 0)]);
    }

    /// One way: the rest to the targets only; for all, every node hears no other.
    #[test]
    fn one_way_partitions_cut_one_direction() {
        assert_eq!(one_way_links(&Target::One(1), &[1], 3), vec![(0, 1), (2, 1)]);
        assert_eq!(one_way_links(&Target::All, &[0, 1], 2), vec![(0, 1), (1, 0)]);
        let minority = one_way_links(&Target::Minority(vec![0, 3]), &[0, 3], 4);
        assert_eq!(minority, vec![(1, 0), (1, 3), (2, 0), (2, 3)]);
    }

    /// A minute-long run of three nodes gets several faults of both kinds and targets beyond
    /// one node, and another seed gives another schedule.
    #[test]
    fn a_minute_has_varied_faults() {
        let options = options(3, 60_000, vec![FaultKind::Kill, FaultKind::Pause]);
        let faults = schedule(42, &options);
        assert!(faults.len() >= 6, "{faults:?}");
        assert!(faults.iter().any(|fault| fault.kind == FaultKind::Kill));
        assert!(faults.iter().any(|fault| fault.kind == FaultKind::Pause));
        assert!(faults.iter().any(|fault| !matches!(fault.target, Target::One(_))));
        assert_ne!(faults, schedule(43, &options));
    }
}

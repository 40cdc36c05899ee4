//! Policies: the YAML rule files, validated, and the matcher that finds the rule for a
//! request descriptor.
//!
//! The format is a superset of envoyproxy/ratelimit's, so its users migrate file for file:
//! one file holds one `domain` and a tree of `descriptors`, each with a `key`, an optional
//! `value` (`*` is a wildcard anywhere in it) and an optional `rate_limit`. quotamesh adds
//! `algorithm`, `burst`, `window` (any length instead of a `unit`), `rate_limits` (several
//! limits a hit must all pass), `failure_mode`, `lease` (per-rule lease sizes and
//! lookahead, DESIGN section 3), `regions` (a global limit sliced per region, DESIGN
//! section 5) and `rollout` with `enforce_after` (shadow, warn, canary, enforce: DESIGN
//! section 7). `cluster/policies/example.yaml` is a commented tour.
//!
//! Every key of envoyproxy/ratelimit's format carries its meaning here too: `quota_mode`,
//! `metadata` (returned in the response's dynamic metadata), `share_threshold` (one counter
//! for every value a wildcard matches), `detailed_metric` and `value_to_metric` (statistics
//! per runtime value, [`Rule::stats_key`]). [`LoadOptions`] holds the node-wide settings a
//! migrating user needs: domains merged over several files (upstream's
//! `MERGE_DOMAIN_CONFIG`) and the algorithm of limits that name none (`fixed_window` counts
//! as upstream does).
//!
//! ```text
//!  [PolicySource { name, text }, ..]          (the caller read the files)
//!        |  yaml.rs: located YAML tree per text
//!        |  load.rs: validation, every error with file:line:column
//!        v
//!  PolicySet { rules, per-domain match index, digest }
//!        |  match_descriptor(domain, entries)   (every descriptor of every request)
//!        v
//!  Match::{DomainNotFound, NoRule, Rule(&Rule)}
//! ```
//!
//! Pure core: no IO, no clock. Counting hits is `crate::core::rate`'s job; applying
//! a rule's rollout [`Stage`], `replaces` and `failure_mode` to a decision is the caller's, and so is
//! leasing with a rule's `lease` (`crate::core::lease`).

pub mod diff;
mod digest;
mod load;
mod matcher;
mod yaml;

pub use load::{DurationError, parse_duration_ms};

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::core::headers::PolicyHeader;
use crate::core::lease::LeaseTuning;
use crate::core::rate::{Algorithm, LimitSpec};
use crate::core::region::transfer::SliceKey;
use crate::core::region::{RegionShares, slice_spec_of};

/// Deepest nesting of `descriptors` accepted (the top level is depth 1). An input size
/// limit: a request descriptor only ever matches at its own depth, and Envoy sends few entries.
pub const DESCRIPTOR_DEPTH_MAX: usize = 16;

/// Most descriptors (and so rules) accepted in one policy set, over all files; an input
/// size limit that keeps the match index and the per-rule state of a node bounded.
pub const RULES_PER_SET_MAX: usize = 10_000;

// Rule ids are `u32`; the limit must fit.
const _: () = assert!(RULES_PER_SET_MAX <= u32::MAX as usize);

/// One policy file: its name (the path, used only in messages) and its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySource {
    /// Where the text came from, as the user should see it in an error (usually the path).
    pub name: String,
    /// The YAML text.
    pub text: String,
}

/// Node-wide settings that change how policy files are read (`[policy]` in the node's
/// configuration). They are part of the set's digest: two nodes that load the same files
/// with other options count differently, and their digests say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Several files may declare one domain; their descriptors are merged (upstream's
    /// `MERGE_DOMAIN_CONFIG=true`). A composite key declared twice at the top level of the
    /// merged domain is still an error.
    pub merge_domains: bool,
    /// The algorithm of a limit that names none and sets no `burst` (a `burst` means a
    /// token bucket). `fixed_window` counts as envoyproxy/ratelimit does.
    pub default_algorithm: Algorithm,
}

/// One problem in one policy file, at a 1-based line and column (in characters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {reason}")]
pub struct PolicyError {
    /// The [`PolicySource::name`] of the file.
    pub file: String,
    /// 1-based line.
    pub line: u32,
    /// 1-based column, counted in characters.
    pub column: u32,
    /// What is wrong, in a sentence fragment meant for the person who wrote the file.
    pub reason: String,
}

/// Every problem found in a set of policy files, in file order, then by position.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", lines(.0))]
pub struct PolicyErrors(pub Vec<PolicyError>);

/// One error per line, as a compiler prints them.
fn lines(errors: &[PolicyError]) -> String {
    errors.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
}

/// Identifies a rule within one [`PolicySet`]; ids are dense from 0 in a deterministic order
/// (domains by name, then descriptors in file order, parents before children). An id is
/// meaningless in another set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RuleId(pub u32);

/// What a node does with a hit for this rule when the ledger cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FailureMode {
    /// Admit (the envoyproxy/ratelimit behaviour, and Envoy's default).
    #[default]
    Open,
    /// Refuse: for quotas where an overrun costs more than an outage, e.g. payments.
    Closed,
}

/// A rule's rollout stage as the policy writes it (`rollout:`, DESIGN section 7): moving a
/// rule from one stage to the next is one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rollout {
    /// Evaluate and count would-be rejections, always admit (`shadow_mode: true` too).
    Shadow,
    /// Admit, and tell a caller over the limit in `RateLimit-Warning`.
    Warn,
    /// Enforce on the nodes a hash of (node id, rule) puts in the canary, `basis_points` of
    /// 10,000 of them; warn on the others.
    Canary {
        /// The canary's share of nodes, in hundredths of a percent.
        basis_points: u32,
    },
    /// Reject what is over the limit.
    #[default]
    Enforce,
}

/// What a rule's rollout does on one node ([`Rollout::stage_on`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Stage {
    /// Admit; count and report would-be rejections.
    Shadow,
    /// Admit; warn the caller when over the limit.
    Warn,
    /// Reject over the limit.
    #[default]
    Enforce,
}

impl Rollout {
    /// The stage on the node `node_id` for the rule at `domain`/`rule_path`. A canary is
    /// chosen by a hash of the three, so the same nodes stay in it while its share grows
    /// (a node in at 5 % is in at 50 %), and every rule picks its own nodes.
    #[must_use]
    pub fn stage_on(self, node_id: &str, domain: &str, rule_path: &str) -> Stage {
        match self {
            Self::Canary { basis_points }
                if canary_point(node_id, domain, rule_path) < basis_points =>
            {
                Stage::Enforce
            }
            _ => self.stage_outside_canary(),
        }
    }

    /// The stage on a node outside the canary (every node, for a rule without one).
    #[must_use]
    pub fn stage_outside_canary(self) -> Stage {
        match self {
            Self::Shadow => Stage::Shadow,
            Self::Warn | Self::Canary { .. } => Stage::Warn,
            Self::Enforce => Stage::Enforce,
        }
    }
}

/// Where a node falls for a rule's canary, in 0..10,000: SHA-256 of the length-prefixed
/// names, so the choice is the same on every platform and in every version.
#[must_use]
pub fn canary_point(node_id: &str, domain: &str, rule_path: &str) -> u32 {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    hasher.update(b"quotamesh canary v1");
    for part in [node_id, domain, rule_path] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    let head = u64::from_be_bytes(digest[..8].try_into().expect("a SHA-256 digest has 8 bytes"));
    u32::try_from(head % u64::from(crate::core::region::SHARE_BASIS_POINTS_WHOLE))
        .expect("below 10,000")
}

/// envoyproxy/ratelimit's named windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days, as envoyproxy/ratelimit counts it (not a calendar month).
    Month,
    /// 365 days, as envoyproxy/ratelimit counts it (not a calendar year).
    Year,
}

impl Unit {
    /// The window length of this unit in milliseconds.
    #[must_use]
    pub const fn window_ms(self) -> u64 {
        const SECOND_MS: u64 = 1_000;
        const DAY_MS: u64 = 86_400 * SECOND_MS;
        match self {
            Self::Second => SECOND_MS,
            Self::Minute => 60 * SECOND_MS,
            Self::Hour => 3_600 * SECOND_MS,
            Self::Day => DAY_MS,
            Self::Week => 7 * DAY_MS,
            Self::Month => 30 * DAY_MS,
            Self::Year => 365 * DAY_MS,
        }
    }
}

/// One limit of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleLimit {
    /// Algorithm and numbers, validated: what this node enforces (for a limit with
    /// `regions`, the region's slice once [`PolicySet::for_region_slices`] cut it).
    pub spec: LimitSpec,
    /// The limit as the policy states it (for a limit with `regions`, the global one). It
    /// names the counter in the ledger, so the region's counter stays the same when its
    /// slice moves: a moved slice carries the count over instead of starting a full bucket.
    pub policy_spec: LimitSpec,
    /// The unit the file named, or `None` when it gave a `window` instead.
    pub unit: Option<Unit>,
    /// The limit's `name`: a target for `replaces`, and the policy name in `RateLimit` headers.
    pub name: Option<String>,
    /// Its header fields' fixed part, for the limit as this node enforces it (`spec`).
    pub header: PolicyHeader,
}

impl RuleLimit {
    /// The `index`-th of a rule's `count` limits, at `path`: its header policy name is its
    /// own `name`, else the rule's path (numbered when the rule has several limits).
    pub fn new(
        spec: LimitSpec,
        policy_spec: LimitSpec,
        unit: Option<Unit>,
        name: Option<String>,
        (path, index, count): (&str, usize, usize),
    ) -> Self {
        let header_name = match (&name, count) {
            (Some(name), _) => Cow::Borrowed(name.as_str()),
            (None, 1) => Cow::Borrowed(path),
            (None, _) => Cow::Owned(format!("{path}#{index}")),
        };
        let header = PolicyHeader::new(&header_name, spec.requests_per_window, spec.window_ms);
        Self { spec, policy_spec, unit, name, header }
    }
}

/// One descriptor of a policy file, at one level of its tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// Unique within its [`PolicySet`].
    pub id: RuleId,
    /// The domain whose file declared it.
    pub domain: String,
    /// The config path, as envoyproxy/ratelimit's stats key without the domain:
    /// `key` or `key_value` per level, joined by `.` (`"key1_value1.key2"`).
    pub path: String,
    /// The limits a hit must all pass; empty when unlimited or without `rate_limit`.
    pub limits: Vec<RuleLimit>,
    /// `rate_limit: {unlimited: true}`: matched and counted in stats, never limited.
    pub unlimited: bool,
    /// How far the rule's rollout has gone (`rollout`, or `shadow_mode: true` for
    /// [`Rollout::Shadow`]): what a would-be rejection does.
    pub rollout: Rollout,
    /// What the rollout means on this node ([`PolicySet::for_node`] resolves a canary; a set
    /// not resolved for a node counts every node out of it).
    pub stage: Stage,
    /// `enforce_after`: the day (`YYYY-MM-DD`) a warned caller is told enforcement begins.
    pub enforce_after: Option<String>,
    /// Statistics per runtime value of every entry (envoyproxy/ratelimit's meaning).
    pub detailed_metric: bool,
    /// Counted with upstream's quota-mode semantics: a request is over its limit only when
    /// all of its quota-mode descriptors are (or any other enforced one is).
    pub quota_mode: bool,
    /// The descriptor's `metadata`, as JSON: merged into the response's dynamic metadata
    /// when this rule matches and admits the descriptor.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
    /// One entry per level of the descriptor tree down to this rule (the root first): how
    /// that level names counters and statistics.
    pub levels: Box<[RuleLevel]>,
    /// What to do when the ledger is unreachable.
    pub failure_mode: FailureMode,
    /// How a node leases this rule's tokens: the rule's `lease` block resolved against
    /// [`LeaseTuning::default`] (TTL and margin derived by [`LeaseTuning::with_sizes`]);
    /// the defaults when the block is absent. Valid by construction.
    pub lease: LeaseTuning,
    /// The rule's `regions`: its limits are global, and each region enforces its slice
    /// ([`PolicySet::for_region`]). `None`: every region enforces the whole limit.
    pub regions: Option<RegionShares>,
    /// Names of limits (in the same domain) this rule's limits replace when both match one
    /// request; validated to exist.
    pub replaces: Vec<String>,
    /// The file that declared it, as [`PolicySource::name`].
    pub file: String,
    /// The line of the descriptor in that file.
    pub line: u32,
}

/// One level of a rule's path: the descriptor declared there, as counting and statistics
/// need it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleLevel {
    /// The descriptor's `key`.
    pub key: String,
    /// The descriptor's `value` as written (a wildcard pattern too), `None` for a key only.
    pub value: Option<String>,
    /// `share_threshold: true` on a wildcard value: every value it matches shares one
    /// counter, named by the pattern.
    pub share_threshold: bool,
    /// `value_to_metric: true`: statistics name this level by its runtime value.
    pub value_to_metric: bool,
}

impl Rule {
    /// The entry values that name this rule's counters for a request descriptor that
    /// matched it: the request's own values, except at a `share_threshold` level, where the
    /// wildcard pattern stands for every value it matches. `entries` has one value per
    /// level (a match guarantees it).
    #[must_use]
    pub fn counter_value<'a>(&'a self, level: usize, runtime_value: &'a str) -> &'a str {
        match self.levels.get(level) {
            Some(RuleLevel { share_threshold: true, value: Some(pattern), .. }) => pattern.as_str(),
            _ => runtime_value,
        }
    }

    /// The statistics key of a request descriptor that matched this rule, as
    /// envoyproxy/ratelimit builds it (without the domain): per level `key` or
    /// `key_value`, joined by `.`. The configured value names a level, except that
    /// `detailed_metric` names every level by its runtime value, and `value_to_metric` its
    /// own level; a `share_threshold` level is always named by its pattern, so a shared
    /// counter has one series. Borrowed (the rule's path) unless a runtime value is used;
    /// `runtime_value(level)` is read only for a level named by its runtime value.
    #[must_use]
    pub fn stats_key<'a, 'v>(
        &'a self,
        runtime_value: impl Fn(usize) -> Option<&'v str>,
    ) -> Cow<'a, str> {
        let runtime = |index: usize, level: &RuleLevel| {
            !level.share_threshold
                && (self.detailed_metric || level.value_to_metric)
                && runtime_value(index).is_some_and(|value| !value.is_empty())
        };
        if !self.levels.iter().enumerate().any(|(index, level)| runtime(index, level)) {
            return Cow::Borrowed(&self.path);
        }
        let mut key = String::with_capacity(self.path.len() + 16);
        for (index, level) in self.levels.iter().enumerate() {
            if index > 0 {
                key.push('.');
            }
            key.push_str(&level.key);
            let value =
                if runtime(index, level) { runtime_value(index) } else { level.value.as_deref() };
            if let Some(value) = value {
                key.push('_');
                key.push_str(value);
            }
        }
        Cow::Owned(key)
    }
}

/// One entry of a request descriptor, as Envoy sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry<'e> {
    /// The descriptor key, e.g. `remote_address`.
    pub key: &'e str,
    /// The runtime value, e.g. `10.0.0.1`.
    pub value: &'e str,
}

/// The outcome of matching one request descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match<'p> {
    /// No policy file declares this domain.
    DomainNotFound,
    /// The domain exists, but no descriptor at the request's depth applies, or the one that
    /// applies has no `rate_limit`: the hit is not limited.
    NoRule,
    /// This rule applies; it has limits or is unlimited.
    Rule(&'p Rule),
}

/// A validated set of policies (one per domain), ready to match. Cheap to share behind an
/// `Arc`; replaced whole when policies change.
#[derive(Debug, Clone)]
pub struct PolicySet {
    rules: Vec<Rule>,
    domains: foldhash::HashMap<Box<str>, matcher::Domain>,
    digest: u64,
    default_algorithm: Algorithm,
}

impl Default for PolicySet {
    /// The empty set: every domain is [`Match::DomainNotFound`].
    fn default() -> Self {
        Self {
            rules: Vec::new(),
            domains: foldhash::HashMap::default(),
            digest: digest::empty_set(),
            default_algorithm: Algorithm::default(),
        }
    }
}

impl PolicySet {
    /// Validates policy files and builds the set. Never opens a file: the caller passes names
    /// and texts.
    ///
    /// # Errors
    /// [`PolicyErrors`] with every problem of every file (YAML syntax, unknown keys, wrong
    /// types, invalid limits, duplicate domains or descriptors, dangling `replaces`, input
    /// size limits), each at its file, line and column. The set is all or nothing.
    pub fn parse(sources: &[PolicySource]) -> Result<PolicySet, PolicyErrors> {
        load::load(sources, LoadOptions::default())
    }

    /// [`PolicySet::parse`] with node-wide [`LoadOptions`].
    ///
    /// # Errors
    /// As [`PolicySet::parse`]; a domain in several files is an error only without
    /// `merge_domains`.
    pub fn parse_with(
        sources: &[PolicySource],
        options: LoadOptions,
    ) -> Result<PolicySet, PolicyErrors> {
        load::load(sources, options)
    }

    /// The algorithm of limits that name none, also of a request's own `limit` override.
    #[must_use]
    pub fn default_algorithm(&self) -> Algorithm {
        self.default_algorithm
    }

    /// Finds the rule for one request descriptor, as envoyproxy/ratelimit does: a descriptor
    /// of N entries matches only descriptors nested exactly N deep; at each level an exact
    /// key and value wins over a wildcard value (first declared wins), which wins over a key
    /// without value. The walk never backtracks: once a level matched, a miss below it is a
    /// miss, even if a less specific descriptor at that level would have led further.
    ///
    /// Allocates nothing.
    ///
    /// # Panics
    /// Never: the index only points at rules of its own set, built together with it.
    #[must_use]
    pub fn match_descriptor(&self, domain: &str, entries: &[Entry<'_>]) -> Match<'_> {
        let Some(domain) = self.domains.get(domain) else {
            return Match::DomainNotFound;
        };
        let Some((last, path)) = entries.split_last() else {
            return Match::NoRule;
        };
        let mut level = &domain.root;
        for entry in path {
            match level.find(entry.key, entry.value) {
                Some(node) => level = &node.children,
                None => return Match::NoRule,
            }
        }
        match level.find(last.key, last.value) {
            Some(node) if node.decides => Match::Rule(self.rule_at(node.rule)),
            _ => Match::NoRule,
        }
    }

    /// True when some policy file declares `domain`.
    #[must_use]
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// Every domain some policy file declares, in no particular order.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(AsRef::as_ref)
    }

    /// Every rule, in [`RuleId`] order.
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.rules.iter()
    }

    /// The rule with this id, if it belongs to this set.
    #[must_use]
    pub fn rule(&self, id: RuleId) -> Option<&Rule> {
        usize::try_from(id.0).ok().and_then(|index| self.rules.get(index))
    }

    /// The rule holding the limit called `name` in `domain` (names are unique per domain),
    /// to apply `replaces`.
    #[must_use]
    pub fn rule_by_name(&self, domain: &str, name: &str) -> Option<&Rule> {
        let id = *self.domains.get(domain)?.names.get(name)?;
        self.rule(id)
    }

    /// A fingerprint of the content (domains, descriptor trees, limits, flags), stable
    /// across processes, platforms and the order of the files; it ignores file names,
    /// positions and comments. Two sets with one digest match alike (FNV-1a, not
    /// collision-resistant against someone forging policies).
    #[must_use]
    pub fn digest(&self) -> u64 {
        self.digest
    }

    /// The set as `region` enforces it: every limit of a rule with `regions` becomes the
    /// region's slice of it (`crate::core::region`), 0 for a region the rule does not name;
    /// rules without `regions` are unchanged. The digest stays the set's, alike in every
    /// region, since the files are.
    #[must_use]
    pub fn for_region(self, region: &str) -> PolicySet {
        self.for_region_slices(region, &BTreeMap::new())
    }

    /// The set as `region` enforces it once tokens moved between regions: a limit whose
    /// [`SliceKey`] is in `slices` gets that many tokens per window (the region's slice in
    /// its quota ledger, `crate::core::region::transfer`), the others their policy slice as
    /// in [`PolicySet::for_region`]. A slice above the global limit is capped at it.
    #[must_use]
    pub fn for_region_slices(
        mut self,
        region: &str,
        slices: &BTreeMap<SliceKey, u64>,
    ) -> PolicySet {
        for rule in &mut self.rules {
            let Some(shares) = &rule.regions else { continue };
            for (index, limit) in rule.limits.iter_mut().enumerate() {
                let key = SliceKey::of(&rule.domain, &rule.path, index);
                let sliced = match slices.get(&key) {
                    Some(tokens) => {
                        slice_spec_of(&limit.spec, (*tokens).min(limit.spec.requests_per_window))
                    }
                    None => shares.slice_spec(region, &limit.spec),
                };
                limit.spec = sliced.expect("a slice of a valid limit is a valid limit");
                limit.header = limit.header.with_quota(limit.spec.requests_per_window);
            }
        }
        self
    }

    /// The set as the node `node_id` serves it: each rule's [`Rule::stage`] resolved from
    /// its rollout ([`Rollout::stage_on`]). The digest stays the set's.
    #[must_use]
    pub fn for_node(mut self, node_id: &str) -> PolicySet {
        for rule in &mut self.rules {
            rule.stage = rule.rollout.stage_on(node_id, &rule.domain, &rule.path);
        }
        self
    }

    /// The rule an index node points at; index and rules are built together.
    fn rule_at(&self, id: RuleId) -> &Rule {
        self.rule(id).expect("the match index only holds ids of rules of its own set")
    }
}

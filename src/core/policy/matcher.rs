//! The match index: per domain, a tree of levels, each a hash map by key, then by value.
//!
//! Built once by `load.rs` from validated descriptors; read by
//! `PolicySet::match_descriptor` for every descriptor of every request, so a lookup is two
//! hash probes per level plus a scan of the level's wildcard values for that key, and never
//! allocates.
//!
//! The maps hash with foldhash, several times faster than std's SipHash on short strings.
//! Flooding cannot slow them: only the policy's own keys are ever inserted, and a client's
//! string is only looked up.

use foldhash::HashMap;

use super::RuleId;

/// One domain: the top level of its descriptor tree and its limit names.
#[derive(Debug, Clone, Default)]
pub(super) struct Domain {
    pub(super) root: Level,
    /// Limit name to the rule holding it, for `replaces`.
    pub(super) names: HashMap<Box<str>, RuleId>,
}

/// The descriptors declared side by side in one `descriptors` list.
#[derive(Debug, Clone, Default)]
pub(super) struct Level {
    by_key: HashMap<Box<str>, Branches>,
}

/// The descriptors of one level that share a key.
#[derive(Debug, Clone, Default)]
struct Branches {
    exact: HashMap<Box<str>, IndexNode>,
    /// Wildcard values in declaration order: the first that matches wins.
    wildcards: Vec<(Pattern, IndexNode)>,
    key_only: Option<Box<IndexNode>>,
}

/// One descriptor of the tree.
#[derive(Debug, Clone)]
pub(super) struct IndexNode {
    pub(super) rule: RuleId,
    /// Whether its rule has limits or is unlimited; a match on a node without is `NoRule`.
    pub(super) decides: bool,
    pub(super) children: Level,
}

impl Level {
    /// Adds a descriptor; `load.rs` has already rejected duplicate keys and values.
    pub(super) fn insert(&mut self, key: &str, value: Option<&str>, node: IndexNode) {
        let branches = self.by_key.entry(key.into()).or_default();
        match value {
            None => branches.key_only = Some(Box::new(node)),
            Some(value) => match Pattern::parse(value) {
                Some(pattern) => branches.wildcards.push((pattern, node)),
                None => {
                    branches.exact.insert(value.into(), node);
                }
            },
        }
    }

    /// The descriptor this entry selects at this level: exact value, else the first
    /// wildcard value that matches, else the key without value.
    pub(super) fn find(&self, key: &str, value: &str) -> Option<&IndexNode> {
        let branches = self.by_key.get(key)?;
        if let Some(node) = branches.exact.get(value) {
            return Some(node);
        }
        if let Some((_, node)) =
            branches.wildcards.iter().find(|(pattern, _)| pattern.matches(value))
        {
            return Some(node);
        }
        branches.key_only.as_deref()
    }
}

/// A value with `*` wildcards, each matching any run of characters (the empty one too),
/// cut at the stars when loaded so matching is a few prefix, suffix and substring tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pattern {
    prefix: Box<str>,
    /// The non-empty pieces between stars, in order.
    middles: Box<[Box<str>]>,
    suffix: Box<str>,
}

impl Pattern {
    /// `None` when the value has no `*` (an exact value).
    pub(super) fn parse(value: &str) -> Option<Self> {
        let mut pieces = value.split('*');
        let prefix = pieces.next()?;
        // At least one star means at least two pieces: the last one is the suffix.
        let mut rest: Vec<&str> = pieces.collect();
        let suffix = rest.pop()?;
        let middles = rest.into_iter().filter(|piece| !piece.is_empty()).map(Box::from).collect();
        Some(Self { prefix: prefix.into(), middles, suffix: suffix.into() })
    }

    pub(super) fn matches(&self, value: &str) -> bool {
        // Prefix, then suffix from what remains, so the two never overlap; then each middle
        // piece at its leftmost place, which leaves the most room for the pieces after it.
        let Some(rest) = value.strip_prefix(&*self.prefix) else { return false };
        let Some(mut rest) = rest.strip_suffix(&*self.suffix) else { return false };
        for middle in &self.middles {
            match rest.find(&**middle) {
                Some(at) => rest = &rest[at + middle.len()..],
                None => return false,
            }
        }
        true
    }
}

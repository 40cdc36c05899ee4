//! Validation and assembly: located YAML trees (`yaml.rs`) become rules, with every error
//! of every file positioned; then the set-wide checks (one file per domain unless
//! `merge_domains`, unique limit names, existing `replaces` targets), rule ids, the match
//! index (`matcher.rs`) and the digest (`digest.rs`).
//!
//! Validation never stops at the first problem: a bad value is reported and treated as
//! absent, and checks that depend on it are skipped rather than repeated as a cascade.

use std::collections::{BTreeMap, HashMap};

use super::digest::Fingerprint;
use super::matcher::{Domain, IndexNode, Level};
use super::yaml::{self, MapEntry, Node, Position, Value};
use super::{
    DESCRIPTOR_DEPTH_MAX, FailureMode, LoadOptions, PolicyError, PolicyErrors, PolicySet,
    PolicySource, RULES_PER_SET_MAX, Rollout, Rule, RuleId, RuleLevel, RuleLimit, Unit,
};
use crate::core::lease::{LEASE_TOKENS_MAX, LEASE_TTL_MS_MAX, LeaseTuning};
use crate::core::rate::{Algorithm, LimitSpec, LimitSpecError};
use crate::core::region::{
    REGIONS_PER_RULE_MAX, RegionShares, SHARE_BASIS_POINTS_WHOLE, check_region_name,
};

// A policy at the deepest descriptor nesting needs, per level, a `descriptors` list and a
// descriptor mapping, plus the root mapping and, at the leaf, `rate_limits`, its item,
// `replaces` and its item: it must fit the YAML nesting limit with room to spare.
const _: () = assert!(2 * DESCRIPTOR_DEPTH_MAX + 1 + 4 <= yaml::YAML_DEPTH_MAX);

pub(super) const ROOT_FIELDS: [&str; 2] = ["domain", "descriptors"];
/// A policy file written as a Kubernetes resource (`cluster/k8s/`): the policy is its `spec`.
const RESOURCE_FIELDS: [&str; 4] = ["apiVersion", "kind", "metadata", "spec"];
/// The resource's `apiVersion`.
pub(super) const RESOURCE_API_VERSION: &str = "quotamesh.io/v1";
/// The resource's `kind`.
pub(super) const RESOURCE_KIND: &str = "RateLimitPolicy";
pub(super) const DESCRIPTOR_FIELDS: [&str; 16] = [
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "shadow_mode",
    "rollout",
    "enforce_after",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "failure_mode",
    "lease",
    "regions",
    "descriptors",
];
pub(super) const LIMIT_FIELDS: [&str; 8] =
    ["unit", "requests_per_unit", "unlimited", "name", "replaces", "algorithm", "burst", "window"];
const REPLACES_FIELDS: [&str; 1] = ["name"];
pub(super) const LEASE_FIELDS: [&str; 3] = ["min_tokens", "max_tokens", "lookahead"];
/// The longest `lookahead` a rule may ask for: its lease TTL is 2 x lookahead, and that must
/// fit under the TTL cap, so the relation DESIGN section 3 states holds for every rule.
const LOOKAHEAD_MS_MAX: u64 = LEASE_TTL_MS_MAX / 2;
const _: () = assert!(LOOKAHEAD_MS_MAX >= 1);

pub(super) const UNITS: [(&str, Unit); 7] = [
    ("second", Unit::Second),
    ("minute", Unit::Minute),
    ("hour", Unit::Hour),
    ("day", Unit::Day),
    ("week", Unit::Week),
    ("month", Unit::Month),
    ("year", Unit::Year),
];
const ALGORITHMS: [(&str, Algorithm); 3] = [
    ("token_bucket", Algorithm::TokenBucket),
    ("sliding_window", Algorithm::SlidingWindow),
    ("fixed_window", Algorithm::FixedWindow),
];
/// Duration suffixes (`window`, `lookahead`) and their length in milliseconds.
const DURATION_SUFFIXES: [(&str, u64); 5] =
    [("ms", 1), ("s", 1_000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000)];

/// Validates every source, then assembles the set; see `PolicySet::parse_with`.
pub(super) fn load(
    sources: &[PolicySource],
    options: LoadOptions,
) -> Result<PolicySet, PolicyErrors> {
    let mut loader = Loader { options, ..Loader::default() };
    let mut domains: BTreeMap<String, DomainDraft<'_>> = BTreeMap::new();
    for (index, source) in sources.iter().enumerate() {
        let file = File { index, name: &source.name };
        let Some(draft) = loader.file(file, &source.text) else { continue };
        match domains.get_mut(&draft.name) {
            None => {
                domains.insert(draft.name.clone(), draft);
            }
            Some(first) if options.merge_domains => loader.merge(first, draft, sources),
            Some(first) => loader.error(
                file,
                draft.position,
                format!(
                    "domain `{}` is already defined at {}:{}:{} (one file per domain, unless \
                     `[policy] merge_domains = true`)",
                    draft.name, first.file.name, first.position.line, first.position.column
                ),
            ),
        }
    }
    for domain in domains.values() {
        loader.check_names(domain, sources);
    }
    if loader.errors.is_empty() {
        Ok(build(domains, sources, options))
    } else {
        // File order first, then position; the sort is stable, so errors at one position
        // keep the order they were found in.
        loader.errors.sort_by_key(|(index, error)| (*index, error.line, error.column));
        Err(PolicyErrors(loader.errors.into_iter().map(|(_, error)| error).collect()))
    }
}

/// The source an error belongs to: its place in the input (for sorting) and its name.
#[derive(Debug, Clone, Copy)]
struct File<'s> {
    index: usize,
    name: &'s str,
}

/// A string from the file with the place it was written, for later set-wide errors.
#[derive(Debug, Clone)]
struct Named {
    text: String,
    position: Position,
}

/// One file, validated as far as it goes.
struct DomainDraft<'s> {
    name: String,
    position: Position,
    file: File<'s>,
    descriptors: Vec<DescriptorDraft>,
}

struct DescriptorDraft {
    /// The index of the source that declared it (merged domains span several).
    file_index: usize,
    key: String,
    value: Option<String>,
    path: String,
    line: u32,
    limits: Vec<LimitDraft>,
    unlimited: bool,
    rollout: Rollout,
    enforce_after: Option<String>,
    quota_mode: bool,
    detailed_metric: bool,
    value_to_metric: bool,
    share_threshold: bool,
    metadata: Option<serde_json::Map<String, serde_json::Value>>,
    failure_mode: FailureMode,
    /// The `lease` block resolved against the defaults; the defaults when absent or invalid.
    lease: LeaseTuning,
    /// The `regions` shares; `None` when absent or invalid.
    regions: Option<RegionShares>,
    /// Every `name` written on this descriptor's limits, also on limits that were invalid,
    /// so a `replaces` pointing at them is not reported as dangling too.
    names: Vec<Named>,
    replaces: Vec<Named>,
    children: Vec<DescriptorDraft>,
}

struct LimitDraft {
    spec: LimitSpec,
    unit: Option<Unit>,
    name: Option<String>,
}

enum LimitOutcome {
    Unlimited,
    Limited(LimitDraft),
}

#[derive(Default)]
struct Loader {
    /// Errors with the index of their source, sorted before they are returned.
    errors: Vec<(usize, PolicyError)>,
    /// Descriptors seen over all files, against [`RULES_PER_SET_MAX`].
    descriptors_seen: usize,
    options: LoadOptions,
}

/// The file a descriptor of a (possibly merged) domain came from.
fn file_of<'s>(sources: &'s [PolicySource], index: usize) -> File<'s> {
    File { index, name: sources.get(index).map_or("", |source| source.name.as_str()) }
}

/// An entry whose value is not null: YAML's way to write a key without a value is to leave
/// it empty, and envoyproxy/ratelimit reads that as absent.
fn given(entry: Option<&MapEntry>) -> Option<&MapEntry> {
    entry.filter(|entry| !entry.value.is_null())
}

impl Loader {
    /// Appends a later file's descriptors to a domain declared before (`merge_domains`); a
    /// top-level composite key both declare is an error at the later one, as upstream's.
    fn merge(
        &mut self,
        into: &mut DomainDraft<'_>,
        from: DomainDraft<'_>,
        sources: &[PolicySource],
    ) {
        for descriptor in from.descriptors {
            let first = into
                .descriptors
                .iter()
                .find(|known| known.key == descriptor.key && known.value == descriptor.value);
            if let Some(first) = first {
                let reason = format!(
                    "duplicate descriptor composite key `{}.{}` (first at {}:{})",
                    into.name,
                    descriptor.path,
                    file_of(sources, first.file_index).name,
                    first.line
                );
                let position = Position { line: descriptor.line, column: 1 };
                self.error(from.file, position, reason);
            } else {
                into.descriptors.push(descriptor);
            }
        }
    }

    fn error(&mut self, file: File<'_>, position: Position, reason: impl Into<String>) {
        self.errors.push((
            file.index,
            PolicyError {
                file: file.name.to_owned(),
                line: position.line,
                column: position.column,
                reason: reason.into(),
            },
        ));
    }

    fn file<'s>(&mut self, file: File<'s>, text: &str) -> Option<DomainDraft<'s>> {
        let document = yaml::parse(text);
        let syntax_ok = document.diagnostics.is_empty();
        for diagnostic in document.diagnostics {
            self.error(file, diagnostic.position, diagnostic.reason);
        }
        let root = match document.root {
            Some(root) if !root.is_null() => root,
            _ => {
                if syntax_ok {
                    self.error(
                        file,
                        Position::START,
                        "empty policy file: expected `domain` and `descriptors`",
                    );
                }
                return None;
            }
        };
        let root = match &root.value {
            Value::Mapping(entries)
                if entries
                    .iter()
                    .any(|entry| RESOURCE_FIELDS[..2].contains(&entry.key.as_str())) =>
            {
                self.resource_spec(file, &root, entries)?
            }
            _ => &root,
        };
        let Value::Mapping(entries) = &root.value else {
            self.error(
                file,
                root.position,
                format!(
                    "a policy file must be a mapping with `domain` and `descriptors`, found {}",
                    root.found()
                ),
            );
            return None;
        };
        let [domain, descriptors] = self.fields(file, entries, ROOT_FIELDS, "the file");
        let domain = match domain {
            None => {
                self.error(file, root.position, "missing required key `domain`");
                None
            }
            Some(entry) => self
                .non_empty_string(file, entry)
                .map(|name| (name.to_owned(), entry.value.position)),
        };
        let domain_name = domain.as_ref().map_or("", |(name, _)| name.as_str());
        let descriptors = self.descriptors(file, descriptors, 1, "", domain_name);
        let (name, position) = domain?;
        Some(DomainDraft { name, position, file, descriptors })
    }

    /// The `spec` of a file written as a Kubernetes resource (`apiVersion:
    /// quotamesh.io/v1`, `kind: RateLimitPolicy`, `metadata.name`); `None` after reporting
    /// what is missing or wrong. Other `metadata` (labels, annotations) is Kubernetes' own.
    fn resource_spec<'n>(
        &mut self,
        file: File<'_>,
        root: &'n Node,
        entries: &'n [MapEntry],
    ) -> Option<&'n Node> {
        let [api_version, kind, metadata, spec] =
            self.fields(file, entries, RESOURCE_FIELDS, "a RateLimitPolicy resource");
        let mut valid = true;
        for (entry, name, expected) in
            [(api_version, "apiVersion", RESOURCE_API_VERSION), (kind, "kind", RESOURCE_KIND)]
        {
            let Some(entry) = entry else {
                self.error(file, root.position, format!("missing required key `{name}`"));
                valid = false;
                continue;
            };
            match self.string(file, entry) {
                Some(found) if found == expected => {}
                // Not a scalar: `string` said so.
                None if !entry.value.is_null() => valid = false,
                _ => {
                    let reason =
                        format!("`{name}` must be `{expected}`, found {}", entry.value.found());
                    self.error(file, entry.value.position, reason);
                    valid = false;
                }
            }
        }
        let name = metadata.and_then(|entry| match &entry.value.value {
            Value::Mapping(fields) => fields.iter().find(|field| field.key == "name"),
            _ => None,
        });
        match name {
            Some(name) => valid &= self.non_empty_string(file, name).is_some(),
            None => {
                let position = metadata.map_or(root.position, |entry| entry.value.position);
                self.error(file, position, "missing required key `metadata.name`");
                valid = false;
            }
        }
        let Some(spec) = spec else {
            self.error(file, root.position, "missing required key `spec`: the policy");
            return None;
        };
        valid.then_some(&spec.value)
    }

    /// Picks the known keys of a mapping, in the order of `names`, and reports the others:
    /// an unknown key is an error, so a misspelt field is never silently ignored and new
    /// fields can be added later without changing the meaning of old files.
    fn fields<'n, const N: usize>(
        &mut self,
        file: File<'_>,
        entries: &'n [MapEntry],
        names: [&'static str; N],
        context: &str,
    ) -> [Option<&'n MapEntry>; N] {
        let mut found = [None; N];
        for entry in entries {
            match names.iter().position(|name| *name == entry.key) {
                Some(slot) => found[slot] = Some(entry),
                None => self.error(
                    file,
                    entry.key_position,
                    format!(
                        "unknown key `{}` in {context}; expected one of: {}",
                        entry.key,
                        names.join(", ")
                    ),
                ),
            }
        }
        found
    }

    fn descriptors(
        &mut self,
        file: File<'_>,
        entry: Option<&MapEntry>,
        depth: usize,
        parent_path: &str,
        domain: &str,
    ) -> Vec<DescriptorDraft> {
        let Some(entry) = given(entry) else { return Vec::new() };
        let items = self.list(file, entry);
        if items.is_empty() {
            return Vec::new();
        }
        if depth > DESCRIPTOR_DEPTH_MAX {
            self.error(
                file,
                entry.key_position,
                format!("descriptors nested deeper than {DESCRIPTOR_DEPTH_MAX} levels (input size limit)"),
            );
            return Vec::new();
        }
        let mut drafts: Vec<DescriptorDraft> = Vec::with_capacity(items.len());
        // Composite key (key and value) to the line that declared it first.
        let mut first_lines: HashMap<(String, Option<String>), u32> = HashMap::new();
        for item in items {
            let Some(draft) = self.descriptor(file, item, depth, parent_path, domain) else {
                continue;
            };
            // An empty key was reported already; it is no composite key to compare.
            if draft.key.is_empty() {
                continue;
            }
            let composite_key = (draft.key.clone(), draft.value.clone());
            if let Some(first_line) = first_lines.get(&composite_key) {
                let reason = format!(
                    "duplicate descriptor composite key `{domain}.{}` (first at line {first_line})",
                    draft.path
                );
                self.error(file, item.position, reason);
            } else {
                first_lines.insert(composite_key, draft.line);
                drafts.push(draft);
            }
        }
        drafts
    }

    fn descriptor(
        &mut self,
        file: File<'_>,
        node: &Node,
        depth: usize,
        parent_path: &str,
        domain: &str,
    ) -> Option<DescriptorDraft> {
        let entries = self.mapping(file, node, "a descriptor")?;
        self.descriptors_seen += 1;
        if self.descriptors_seen == RULES_PER_SET_MAX + 1 {
            self.error(
                file,
                node.position,
                format!(
                    "more than {RULES_PER_SET_MAX} descriptors in the policy set (input size limit)"
                ),
            );
        }
        let [
            key,
            value,
            rate_limit,
            rate_limits,
            shadow_mode,
            rollout,
            enforce_after,
            quota_mode,
            detailed_metric,
            value_to_metric,
            share_threshold,
            metadata,
            failure_mode,
            lease,
            regions,
            descriptors,
        ] = self.fields(file, entries, DESCRIPTOR_FIELDS, "a descriptor");

        let key = match key {
            None => {
                self.error(file, node.position, "descriptor is missing required key `key`");
                String::new()
            }
            Some(entry) => self.non_empty_string(file, entry).unwrap_or_default().to_owned(),
        };
        // An empty value is no value, as in envoyproxy/ratelimit.
        let value = given(value)
            .and_then(|entry| self.string(file, entry))
            .filter(|value| !value.is_empty());
        let segment = match value {
            Some(value) => format!("{key}_{value}"),
            None => key.clone(),
        };
        let path =
            if parent_path.is_empty() { segment } else { format!("{parent_path}.{segment}") };

        let mut draft = DescriptorDraft {
            file_index: file.index,
            key,
            value: value.map(str::to_owned),
            path,
            line: node.position.line,
            limits: Vec::new(),
            unlimited: false,
            rollout: Rollout::Enforce,
            enforce_after: None,
            quota_mode: self.bool(file, quota_mode),
            detailed_metric: self.bool(file, detailed_metric),
            value_to_metric: self.bool(file, value_to_metric),
            share_threshold: false,
            metadata: given(metadata).and_then(|entry| self.metadata(file, entry)),
            failure_mode: FailureMode::Open,
            lease: LeaseTuning::default(),
            regions: None,
            names: Vec::new(),
            replaces: Vec::new(),
            children: Vec::new(),
        };
        let rate_limit = given(rate_limit);
        let rate_limits = given(rate_limits);
        if let (Some(_), Some(list)) = (rate_limit, rate_limits) {
            self.error(
                file,
                list.key_position,
                "`rate_limit` and `rate_limits` are mutually exclusive: list every limit under `rate_limits`",
            );
        }
        if let Some(entry) = rate_limit
            && let Some(limit) = self.mapping(file, &entry.value, "`rate_limit`")
        {
            match self.limit(file, limit, entry.key_position, false, &mut draft) {
                Some(LimitOutcome::Unlimited) => draft.unlimited = true,
                Some(LimitOutcome::Limited(limit)) => draft.limits.push(limit),
                None => {}
            }
        }
        if let Some(entry) = rate_limits {
            let items = self.list(file, entry);
            if matches!(&entry.value.value, Value::Sequence(items) if items.is_empty()) {
                self.error(
                    file,
                    entry.value.position,
                    "`rate_limits` must list at least one limit",
                );
            }
            for item in items {
                let Some(limit) = self.mapping(file, item, "a `rate_limits` item") else {
                    continue;
                };
                if let Some(LimitOutcome::Limited(limit)) =
                    self.limit(file, limit, item.position, true, &mut draft)
                {
                    draft.limits.push(limit);
                }
            }
        }
        for replaced in &draft.replaces {
            if draft.names.iter().any(|name| name.text == replaced.text) {
                let reason = format!(
                    "`replaces` names `{}`, a limit of this same descriptor: a limit cannot replace itself",
                    replaced.text
                );
                self.error(file, replaced.position, reason);
            }
        }

        if let Some(entry) = given(share_threshold)
            && self.bool(file, Some(entry))
        {
            if draft.value.as_deref().is_some_and(|value| value.contains('*')) {
                draft.share_threshold = true;
            } else {
                self.error(
                    file,
                    entry.key_position,
                    "`share_threshold` needs a wildcard `value` (one containing `*`)",
                );
            }
        }
        if let Some(entry) = given(failure_mode) {
            draft.failure_mode = self.failure_mode(file, entry).unwrap_or_default();
            if rate_limit.is_none() && rate_limits.is_none() {
                self.error(
                    file,
                    entry.key_position,
                    "`failure_mode` has no effect on a descriptor without `rate_limit` \
                     (nested descriptors do not inherit it)",
                );
            }
        }
        let limited = rate_limit.is_some() || rate_limits.is_some();
        if let Some(entry) = given(lease) {
            draft.lease = self.lease(file, entry).unwrap_or_default();
            self.needs_a_limit(file, entry, limited, draft.unlimited, "it never leases tokens");
        }
        if let Some(entry) = given(regions) {
            draft.regions = self.regions(file, entry);
            self.needs_a_limit(file, entry, limited, draft.unlimited, "it has no limit to slice");
        }
        self.rollout(file, &mut draft, [shadow_mode, rollout, enforce_after], limited);
        draft.children = self.descriptors(file, descriptors, depth + 1, &draft.path, domain);
        Some(draft)
    }

    /// Validates one `rate_limit` (or one `rate_limits` item); its names and `replaces` are
    /// recorded on the descriptor even when the numbers are invalid. `anchor` is where errors
    /// about the limit as a whole point.
    fn limit(
        &mut self,
        file: File<'_>,
        entries: &[MapEntry],
        anchor: Position,
        in_list: bool,
        descriptor: &mut DescriptorDraft,
    ) -> Option<LimitOutcome> {
        let context = if in_list { "a `rate_limits` item" } else { "`rate_limit`" };
        let [unit, requests_per_unit, unlimited, name, replaces, algorithm, burst, window] =
            self.fields(file, entries, LIMIT_FIELDS, context);
        let name = name.and_then(|entry| {
            let text = self.non_empty_string(file, entry)?.to_owned();
            Some(Named { text, position: entry.value.position })
        });
        descriptor.names.extend(name.clone());
        let replaces = self.replaces(file, replaces);
        descriptor.replaces.extend(replaces);

        if let Some(entry) = given(unlimited)
            && self.bool(file, Some(entry))
        {
            if in_list {
                self.error(
                    file,
                    entry.key_position,
                    "`unlimited: true` is not allowed in `rate_limits`; write `rate_limit: {unlimited: true}`",
                );
            }
            // A name would label a limit that does not exist; envoyproxy/ratelimit also
            // refuses a unit here.
            for entry in [unit, requests_per_unit, window, algorithm, burst].into_iter().flatten() {
                self.error(
                    file,
                    entry.key_position,
                    format!("`{}` cannot be combined with `unlimited: true`", entry.key),
                );
            }
            if let Some(name) = &name {
                self.error(
                    file,
                    name.position,
                    "`name` cannot be combined with `unlimited: true`: there is no limit to name",
                );
            }
            return (!in_list).then_some(LimitOutcome::Unlimited);
        }

        let (unit, window, requests_per_unit, burst) =
            (given(unit), given(window), given(requests_per_unit), given(burst));
        let mut valid = true;
        let unit_value = unit.and_then(|entry| self.unit(file, entry));
        let window_ms = match (unit, window) {
            (Some(_), Some(window)) => {
                self.error(
                    file,
                    window.key_position,
                    "`unit` and `window` are mutually exclusive; give one",
                );
                valid = false;
                None
            }
            (None, None) => {
                self.error(
                    file,
                    anchor,
                    "a rate limit needs `unit` or `window` (or `unlimited: true`)",
                );
                None
            }
            (Some(_), None) => unit_value.map(Unit::window_ms),
            (None, Some(window)) => self.duration(file, window, "30s"),
        };
        let requests = match requests_per_unit {
            None => {
                self.error(file, anchor, "a rate limit needs `requests_per_unit`");
                None
            }
            Some(entry) => self.integer(file, entry),
        };
        // A `burst` only means something to a token bucket, so it asks for one whatever
        // the node's default.
        let algorithm_value = match (given(algorithm), burst) {
            (Some(entry), _) => self.algorithm(file, entry).unwrap_or_default(),
            (None, Some(_)) => Algorithm::TokenBucket,
            (None, None) => self.options.default_algorithm,
        };
        let burst_value = burst.and_then(|entry| self.integer(file, entry));
        if let Some(entry) = burst {
            if algorithm_value != Algorithm::TokenBucket {
                let algorithm_name = ALGORITHMS
                    .iter()
                    .find(|(_, known)| *known == algorithm_value)
                    .map_or("", |(name, _)| name);
                self.error(
                    file,
                    entry.key_position,
                    format!(
                        "`burst` applies only to `algorithm: token_bucket`, not `{algorithm_name}`"
                    ),
                );
                valid = false;
            } else if let (Some(burst), Some(requests)) = (burst_value, requests)
                && burst < requests
            {
                self.error(
                    file,
                    entry.value.position,
                    format!("`burst` ({burst}) must be at least `requests_per_unit` ({requests})"),
                );
                valid = false;
            }
        }

        let (Some(requests), Some(window_ms), true) = (requests, window_ms, valid) else {
            return None;
        };
        match LimitSpec::new(algorithm_value, requests, window_ms, burst_value) {
            Ok(spec) => Some(LimitOutcome::Limited(LimitDraft {
                spec,
                unit: unit_value,
                name: name.map(|name| name.text),
            })),
            Err(error) => {
                let culprit = match error {
                    LimitSpecError::Requests(_) => requests_per_unit,
                    LimitSpecError::Window(_) => unit.or(window),
                    LimitSpecError::Burst(_) | LimitSpecError::BurstOfZeroLimit(_) => burst,
                };
                let position = culprit.map_or(anchor, |entry| entry.value.position);
                self.error(file, position, format!("invalid limit: {error}"));
                None
            }
        }
    }

    fn replaces(&mut self, file: File<'_>, entry: Option<&MapEntry>) -> Vec<Named> {
        let Some(entry) = given(entry) else { return Vec::new() };
        let mut names = Vec::new();
        for item in self.list(file, entry) {
            let Some(fields) = self.mapping(file, item, "a `replaces` item") else { continue };
            match self.fields(file, fields, REPLACES_FIELDS, "a `replaces` item") {
                [None] => self.error(file, item.position, "a `replaces` item needs `name`"),
                [Some(name)] => {
                    if let Some(text) = self.non_empty_string(file, name) {
                        names.push(Named { text: text.to_owned(), position: name.value.position });
                    }
                }
            }
        }
        names
    }

    /// Set-wide checks within one domain: limit names are unique (they identify a policy in
    /// `RateLimit` headers and for `replaces`), and every `replaces` names one of them.
    fn check_names(&mut self, domain: &DomainDraft<'_>, sources: &[PolicySource]) {
        let mut names: HashMap<&str, Position> = HashMap::new();
        let mut replaces: Vec<(usize, &Named)> = Vec::new();
        let mut pending: Vec<&DescriptorDraft> = domain.descriptors.iter().rev().collect();
        // Depth first in file order, so the "already used" error lands on the later name.
        while let Some(descriptor) = pending.pop() {
            for name in &descriptor.names {
                if let Some(first) = names.get(name.text.as_str()) {
                    let reason = format!(
                        "rate limit name `{}` is already used in domain `{}` at line {}",
                        name.text, domain.name, first.line
                    );
                    self.error(file_of(sources, descriptor.file_index), name.position, reason);
                } else {
                    names.insert(name.text.as_str(), name.position);
                }
            }
            replaces.extend(descriptor.replaces.iter().map(|named| (descriptor.file_index, named)));
            pending.extend(descriptor.children.iter().rev());
        }
        for (file_index, replaced) in replaces {
            if !names.contains_key(replaced.text.as_str()) {
                let reason = format!(
                    "`replaces` names `{}`, but no rate limit in domain `{}` has that name",
                    replaced.text, domain.name
                );
                self.error(file_of(sources, file_index), replaced.position, reason);
            }
        }
    }

    // Typed readers. Each reports a value of the wrong type and returns `None` for it, so
    // the caller goes on as if the key were absent.

    /// A scalar as text (YAML numbers and booleans included: envoyproxy/ratelimit reads
    /// `value: 200` as the string "200"); `None` for null.
    fn string<'n>(&mut self, file: File<'_>, entry: &'n MapEntry) -> Option<&'n str> {
        match &entry.value.value {
            _ if entry.value.is_null() => None,
            Value::Scalar { text, .. } => Some(text),
            Value::Sequence(_) | Value::Mapping(_) => {
                let reason =
                    format!("`{}` must be a string, found {}", entry.key, entry.value.found());
                self.error(file, entry.value.position, reason);
                None
            }
        }
    }

    fn non_empty_string<'n>(&mut self, file: File<'_>, entry: &'n MapEntry) -> Option<&'n str> {
        let text = self.string(file, entry);
        if text.is_none_or(str::is_empty)
            && !matches!(entry.value.value, Value::Sequence(_) | Value::Mapping(_))
        {
            // An empty value has no text to point at; its key does.
            let position =
                if entry.value.is_null() { entry.key_position } else { entry.value.position };
            self.error(file, position, format!("`{}` must not be empty", entry.key));
            return None;
        }
        text
    }

    /// `false` when absent or null.
    fn bool(&mut self, file: File<'_>, entry: Option<&MapEntry>) -> bool {
        let Some(entry) = given(entry) else { return false };
        match &entry.value.value {
            Value::Scalar { text, typed: true } => match text.as_str() {
                "true" | "True" | "TRUE" => return true,
                "false" | "False" | "FALSE" => return false,
                _ => {}
            },
            Value::Scalar { .. } | Value::Sequence(_) | Value::Mapping(_) => {}
        }
        let found = entry.value.found();
        self.error(
            file,
            entry.value.position,
            format!("`{}` must be true or false, found {found}", entry.key),
        );
        false
    }

    /// A descriptor's `metadata`: any YAML mapping, kept as JSON for the response's dynamic
    /// metadata. Plain scalars keep their YAML type (null, boolean, number); the rest are
    /// strings.
    fn metadata(
        &mut self,
        file: File<'_>,
        entry: &MapEntry,
    ) -> Option<serde_json::Map<String, serde_json::Value>> {
        match json_of(&entry.value) {
            serde_json::Value::Object(map) => Some(map),
            _ => {
                let found = entry.value.found();
                self.error(
                    file,
                    entry.value.position,
                    format!("`metadata` must be a mapping, found {found}"),
                );
                None
            }
        }
    }

    /// A whole number written in decimal digits, as a plain (unquoted) scalar.
    fn integer(&mut self, file: File<'_>, entry: &MapEntry) -> Option<u64> {
        let reason = match &entry.value.value {
            Value::Scalar { text, typed: true }
                if !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit()) =>
            {
                match text.parse::<u64>() {
                    Ok(number) => return Some(number),
                    Err(_) => format!("`{}` is too large: `{text}`", entry.key),
                }
            }
            Value::Scalar { text, typed: true } if text.starts_with('-') => {
                format!("`{}` must not be negative, found `{text}`", entry.key)
            }
            _ => format!("`{}` must be a whole number, found {}", entry.key, entry.value.found()),
        };
        self.error(file, entry.value.position, reason);
        None
    }

    fn list<'n>(&mut self, file: File<'_>, entry: &'n MapEntry) -> &'n [Node] {
        match &entry.value.value {
            _ if entry.value.is_null() => &[],
            Value::Sequence(items) => items,
            Value::Scalar { .. } | Value::Mapping(_) => {
                let reason =
                    format!("`{}` must be a list, found {}", entry.key, entry.value.found());
                self.error(file, entry.value.position, reason);
                &[]
            }
        }
    }

    fn mapping<'n>(
        &mut self,
        file: File<'_>,
        node: &'n Node,
        what: &str,
    ) -> Option<&'n [MapEntry]> {
        match &node.value {
            Value::Mapping(entries) => Some(entries),
            Value::Scalar { .. } | Value::Sequence(_) => {
                self.error(
                    file,
                    node.position,
                    format!("{what} must be a mapping, found {}", node.found()),
                );
                None
            }
        }
    }

    /// A unit name, case-insensitive as in envoyproxy/ratelimit.
    fn unit(&mut self, file: File<'_>, entry: &MapEntry) -> Option<Unit> {
        let text = self.string(file, entry)?;
        let unit =
            UNITS.iter().find(|(name, _)| name.eq_ignore_ascii_case(text)).map(|(_, unit)| *unit);
        if unit.is_none() {
            let reason = format!(
                "unknown unit `{text}`; expected second, minute, hour, day, week, month or year"
            );
            self.error(file, entry.value.position, reason);
        }
        unit
    }

    /// `<whole number><ms|s|m|h|d>`, e.g. `30s`, in milliseconds: a `window` or a
    /// `lookahead`, named in messages by its key, with `example` as the hint.
    fn duration(&mut self, file: File<'_>, entry: &MapEntry, example: &str) -> Option<u64> {
        let text = self.string(file, entry)?;
        let reason = match parse_duration_ms(text) {
            Ok(duration_ms) => return Some(duration_ms),
            Err(DurationError::Invalid) => format!(
                "invalid {} `{text}`: expected a whole number and one of ms, s, m, h, d (e.g. `{example}`)",
                entry.key
            ),
            Err(DurationError::TooLong) => format!("{} `{text}` is too long", entry.key),
        };
        self.error(file, entry.value.position, reason);
        None
    }

    fn algorithm(&mut self, file: File<'_>, entry: &MapEntry) -> Option<Algorithm> {
        let text = self.string(file, entry)?;
        let algorithm =
            ALGORITHMS.iter().find(|(name, _)| *name == text).map(|(_, algorithm)| *algorithm);
        if algorithm.is_none() {
            let reason = format!(
                "unknown algorithm `{text}`; expected token_bucket, sliding_window or fixed_window"
            );
            self.error(file, entry.value.position, reason);
        }
        algorithm
    }

    fn failure_mode(&mut self, file: File<'_>, entry: &MapEntry) -> Option<FailureMode> {
        match self.string(file, entry)? {
            "open" => Some(FailureMode::Open),
            "closed" => Some(FailureMode::Closed),
            other => {
                let reason = format!("unknown failure_mode `{other}`; expected open or closed");
                self.error(file, entry.value.position, reason);
                None
            }
        }
    }

    /// A `lease` block: each of `min_tokens`, `max_tokens` and `lookahead` is optional and
    /// defaults to [`LeaseTuning::default`]'s; the TTL and margin follow from the lookahead
    /// ([`LeaseTuning::with_sizes`]). `None` after reporting any problem.
    fn lease(&mut self, file: File<'_>, entry: &MapEntry) -> Option<LeaseTuning> {
        let fields = self.mapping(file, &entry.value, "`lease`")?;
        let [min_tokens, max_tokens, lookahead] =
            self.fields(file, fields, LEASE_FIELDS, "`lease`");
        let (min_tokens, max_tokens, lookahead) =
            (given(min_tokens), given(max_tokens), given(lookahead));
        let defaults = LeaseTuning::default();
        let min_lease_tokens = min_tokens
            .map_or(Some(defaults.min_lease_tokens), |field| self.lease_tokens(file, field));
        let max_lease_tokens = max_tokens
            .map_or(Some(defaults.max_lease_tokens), |field| self.lease_tokens(file, field));
        let lookahead_ms =
            lookahead.map_or(Some(defaults.lookahead_ms), |field| self.lookahead(file, field));
        // Each bad value was reported where it was written.
        let (Some(min_lease_tokens), Some(max_lease_tokens), Some(lookahead_ms)) =
            (min_lease_tokens, max_lease_tokens, lookahead_ms)
        else {
            return None;
        };
        if min_lease_tokens > max_lease_tokens {
            // Point at what was written, and say which side is a default: `min_tokens: 600`
            // alone clashes with the default maximum of 500.
            let note =
                |field: Option<&MapEntry>| if field.is_none() { ", the default" } else { "" };
            let reason = format!(
                "`min_tokens` ({min_lease_tokens}{}) must be at most `max_tokens` ({max_lease_tokens}{})",
                note(min_tokens),
                note(max_tokens)
            );
            let position =
                min_tokens.or(max_tokens).map_or(entry.key_position, |field| field.value.position);
            self.error(file, position, reason);
            return None;
        }
        // The checks above name the field at fault; this is the lease module's own word on
        // the whole, so the two can never disagree about what is valid.
        match LeaseTuning::with_sizes(min_lease_tokens, max_lease_tokens, lookahead_ms) {
            Ok(tuning) => Some(tuning),
            Err(error) => {
                self.error(file, entry.key_position, format!("invalid `lease`: {error}"));
                None
            }
        }
    }

    /// Reports a per-rule setting (`lease`, `regions`) on a descriptor it cannot act on: one
    /// without a limit (`limited` false), or an `unlimited` one, for `why_not_unlimited`.
    fn needs_a_limit(
        &mut self,
        file: File<'_>,
        entry: &MapEntry,
        limited: bool,
        unlimited: bool,
        why_not_unlimited: &str,
    ) {
        let reason = if !limited {
            format!(
                "`{}` has no effect on a descriptor without `rate_limit` (nested descriptors do \
                 not inherit it)",
                entry.key
            )
        } else if unlimited {
            format!("`{}` has no effect on an `unlimited` rule: {why_not_unlimited}", entry.key)
        } else {
            return;
        };
        self.error(file, entry.key_position, reason);
    }

    /// A `regions` mapping: region names to shares written as percentages (`60%`,
    /// `12.5%`, at most two decimals) adding up to exactly 100 %. `None` after reporting any
    /// problem.
    fn regions(&mut self, file: File<'_>, entry: &MapEntry) -> Option<RegionShares> {
        let fields = self.mapping(file, &entry.value, "`regions`")?;
        if fields.is_empty() {
            self.error(file, entry.value.position, "`regions` must name at least one region");
            return None;
        }
        if fields.len() > REGIONS_PER_RULE_MAX {
            let reason = format!(
                "`regions` names {} regions, over the maximum of {REGIONS_PER_RULE_MAX}",
                fields.len()
            );
            self.error(file, entry.value.position, reason);
            return None;
        }
        let mut shares = Vec::with_capacity(fields.len());
        let mut valid = true;
        for field in fields {
            if let Err(error) = check_region_name(&field.key) {
                self.error(file, field.key_position, format!("region `{}`: {error}", field.key));
                valid = false;
            }
            match self.string(file, field).map(parse_share) {
                Some(Some(share)) => shares.push((field.key.clone(), share)),
                Some(None) | None => {
                    let reason = format!(
                        "the share of region `{}` must be a percentage from 0% to 100% with at \
                         most two decimals, e.g. `60%` or `12.5%`",
                        field.key
                    );
                    self.error(file, field.value.position, reason);
                    valid = false;
                }
            }
        }
        if !valid {
            return None;
        }
        let total: u64 = shares.iter().map(|(_, share)| u64::from(*share)).sum();
        if total != u64::from(SHARE_BASIS_POINTS_WHOLE) {
            let reason =
                format!("the shares of `regions` add up to {}, not 100%", percent_text(total));
            self.error(file, entry.key_position, reason);
            return None;
        }
        RegionShares::new(shares)
    }

    /// A descriptor's rollout: `rollout` (`shadow`, `warn`, `{canary: P%}` or `enforce`),
    /// or upstream's `shadow_mode: true`, never both; `enforce_after`, a day (`YYYY-MM-DD`)
    /// that only warned callers are told.
    fn rollout(
        &mut self,
        file: File<'_>,
        draft: &mut DescriptorDraft,
        [shadow_mode, rollout, enforce_after]: [Option<&MapEntry>; 3],
        limited: bool,
    ) {
        let shadow = given(shadow_mode).is_some_and(|entry| self.bool(file, Some(entry)));
        if shadow {
            draft.rollout = Rollout::Shadow;
        }
        if let Some(entry) = given(rollout) {
            if shadow {
                self.error(
                    file,
                    entry.key_position,
                    "`rollout` and `shadow_mode: true` are mutually exclusive: write \
                     `rollout: shadow`",
                );
            } else if let Some(stage) = self.rollout_stage(file, entry) {
                draft.rollout = stage;
            }
            self.needs_a_limit(file, entry, limited, draft.unlimited, "it never rejects");
        }
        if let Some(entry) = given(enforce_after) {
            match self.string(file, entry) {
                Some(day) if is_calendar_day(day) => draft.enforce_after = Some(day.to_owned()),
                Some(day) => {
                    let reason = format!(
                        "`enforce_after` must be a day written `YYYY-MM-DD`, found `{day}`"
                    );
                    self.error(file, entry.value.position, reason);
                }
                None => {}
            }
            // Kept on the other stages, so moving a rule from `warn` to `enforce` is one line.
            self.needs_a_limit(file, entry, limited, draft.unlimited, "it never rejects");
        }
    }

    /// One `rollout` value.
    fn rollout_stage(&mut self, file: File<'_>, entry: &MapEntry) -> Option<Rollout> {
        const EXPECTED: &str = "expected shadow, warn, {canary: P%} or enforce";
        if let Value::Mapping(fields) = &entry.value.value {
            let [canary] = self.fields(file, fields, ["canary"], "`rollout`");
            let Some(canary) = given(canary) else {
                let reason = format!("`rollout` mapping must be `{{canary: P%}}`; {EXPECTED}");
                self.error(file, entry.value.position, reason);
                return None;
            };
            return match self.string(file, canary).map(parse_share) {
                Some(Some(basis_points)) => Some(Rollout::Canary { basis_points }),
                Some(None) => {
                    let reason = "the canary's share must be a percentage from 0% to 100% \
                                  with at most two decimals, e.g. `5%`";
                    self.error(file, canary.value.position, reason);
                    None
                }
                None => None,
            };
        }
        match self.string(file, entry)? {
            "shadow" => Some(Rollout::Shadow),
            "warn" => Some(Rollout::Warn),
            "enforce" => Some(Rollout::Enforce),
            other => {
                let reason = format!("unknown rollout `{other}`; {EXPECTED}");
                self.error(file, entry.value.position, reason);
                None
            }
        }
    }

    /// `min_tokens` or `max_tokens` of a `lease`: a whole number in 1..=`LEASE_TOKENS_MAX`.
    fn lease_tokens(&mut self, file: File<'_>, field: &MapEntry) -> Option<u64> {
        let tokens = self.integer(file, field)?;
        let reason = if tokens == 0 {
            format!("`{}` must be at least 1", field.key)
        } else if tokens > LEASE_TOKENS_MAX {
            format!("`{}` ({tokens}) must be at most {LEASE_TOKENS_MAX}", field.key)
        } else {
            return Some(tokens);
        };
        self.error(file, field.value.position, reason);
        None
    }

    /// The `lookahead` of a `lease`: a duration of at least 1 ms whose lease TTL, twice the
    /// lookahead, fits under `LEASE_TTL_MS_MAX`.
    fn lookahead(&mut self, file: File<'_>, field: &MapEntry) -> Option<u64> {
        let lookahead_ms = self.duration(file, field, "250ms")?;
        let reason = match lookahead_ms {
            0 => "`lookahead` must be at least 1ms".to_owned(),
            1..=LOOKAHEAD_MS_MAX => return Some(lookahead_ms),
            _ => format!(
                "`lookahead` of {lookahead_ms} ms would need a lease TTL of {} ms \
                 (2 x lookahead), but a lease lives at most {LEASE_TTL_MS_MAX} ms, so it can \
                 be at most {LOOKAHEAD_MS_MAX}ms",
                lookahead_ms.saturating_mul(2),
            ),
        };
        self.error(file, field.value.position, reason);
        None
    }
}

/// A share written as `60%` or `12.5%` (at most two decimals, at most 100 %), in basis
/// points; `None` for anything else.
fn parse_share(text: &str) -> Option<u32> {
    let number = text.strip_suffix('%')?;
    let (whole, decimals) = number.split_once('.').unwrap_or((number, ""));
    let digits = |part: &str, most: usize| {
        part.len() <= most && part.bytes().all(|byte| byte.is_ascii_digit())
    };
    if whole.is_empty() || !digits(whole, 3) || !digits(decimals, 2) || number.ends_with('.') {
        return None;
    }
    let hundredths = format!("{decimals:0<2}").parse::<u32>().ok()?;
    let share = whole.parse::<u32>().ok()?.checked_mul(100)?.checked_add(hundredths)?;
    (share <= SHARE_BASIS_POINTS_WHOLE).then_some(share)
}

/// Why a duration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not a whole number followed by one of ms, s, m, h, d.
    #[error("expected a whole number and one of ms, s, m, h, d (e.g. `10m`)")]
    Invalid,
    /// More milliseconds than a u64 holds.
    #[error("too long")]
    TooLong,
}

/// A duration as policies write it: a whole number and one of ms, s, m, h, d (`250ms`,
/// `10m`), in milliseconds.
///
/// # Errors
/// [`DurationError`] saying what is wrong.
pub fn parse_duration_ms(text: &str) -> Result<u64, DurationError> {
    let digits = text.find(|character: char| !character.is_ascii_digit()).unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits);
    let scale_ms = DURATION_SUFFIXES
        .iter()
        .find(|(name, _)| *name == suffix)
        .map(|(_, scale_ms)| *scale_ms)
        .filter(|_| !number.is_empty())
        .ok_or(DurationError::Invalid)?;
    number
        .parse::<u64>()
        .ok()
        .and_then(|number| number.checked_mul(scale_ms))
        .ok_or(DurationError::TooLong)
}

/// True for a day of the proleptic Gregorian calendar written `YYYY-MM-DD`.
fn is_calendar_day(text: &str) -> bool {
    let bytes = text.as_bytes();
    let digits = |range: std::ops::Range<usize>| {
        bytes[range.clone()].iter().all(u8::is_ascii_digit).then(|| text[range].parse::<u32>().ok())
    };
    if bytes.len() != 10 || bytes[4] != b'-' || bytes[7] != b'-' {
        return false;
    }
    let (Some(Some(year)), Some(Some(month)), Some(Some(day))) =
        (digits(0..4), digits(5..7), digits(8..10))
    else {
        return false;
    };
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    (1..=days).contains(&day)
}

/// Basis points as a percentage for messages: `9950` is `99.5%`.
fn percent_text(basis_points: u64) -> String {
    let (whole, hundredths) = (basis_points / 100, basis_points % 100);
    if hundredths == 0 {
        format!("{whole}%")
    } else {
        format!("{whole}.{}%", format!("{hundredths:02}").trim_end_matches('0'))
    }
}

/// A YAML node as JSON (for `metadata`): plain scalars keep their YAML type.
fn json_of(node: &Node) -> serde_json::Value {
    use serde_json::Value as Json;
    match &node.value {
        _ if node.is_null() => Json::Null,
        Value::Scalar { text, typed: true } => match text.as_str() {
            "true" | "True" | "TRUE" => Json::Bool(true),
            "false" | "False" | "FALSE" => Json::Bool(false),
            _ => text
                .parse::<i64>()
                .map(Json::from)
                .ok()
                .or_else(|| {
                    text.parse::<f64>()
                        .ok()
                        .and_then(serde_json::Number::from_f64)
                        .map(Json::Number)
                })
                .unwrap_or_else(|| Json::String(text.clone())),
        },
        Value::Scalar { text, typed: false } => Json::String(text.clone()),
        Value::Sequence(items) => Json::Array(items.iter().map(json_of).collect()),
        Value::Mapping(entries) => Json::Object(
            entries.iter().map(|entry| (entry.key.clone(), json_of(&entry.value))).collect(),
        ),
    }
}

/// Assembles a set from drafts that passed every check: ids in domain-name order, then
/// depth first in file order; the match index; the digest over the same walk.
fn build(
    domains: BTreeMap<String, DomainDraft<'_>>,
    sources: &[PolicySource],
    options: LoadOptions,
) -> PolicySet {
    let mut assembly = Assembly { rules: Vec::new(), fingerprint: Fingerprint::new() };
    let mut index = foldhash::HashMap::with_capacity_and_hasher(domains.len(), Default::default());
    for (name, draft) in domains {
        assembly.fingerprint.tag(b'D');
        assembly.fingerprint.str(&name);
        let mut domain = Domain::default();
        let mut levels = Vec::new();
        for descriptor in draft.descriptors {
            let place = Place { domain: &name, file: file_of(sources, descriptor.file_index).name };
            assembly.add(place, descriptor, &mut levels, &mut domain.root, &mut domain.names);
        }
        index.insert(name.into_boxed_str(), domain);
    }
    // Written only when not the default, so every set loaded without options keeps the
    // digest it had before options existed. The tag differs from every other one.
    if options.default_algorithm != Algorithm::default() {
        assembly.fingerprint.tag(b'A');
        assembly.fingerprint.tag(algorithm_tag(options.default_algorithm));
    }
    PolicySet {
        rules: assembly.rules,
        domains: index,
        digest: assembly.fingerprint.finish(),
        default_algorithm: options.default_algorithm,
    }
}

fn algorithm_tag(algorithm: Algorithm) -> u8 {
    match algorithm {
        Algorithm::TokenBucket => 0,
        Algorithm::SlidingWindow => 1,
        Algorithm::FixedWindow => 2,
    }
}

/// The domain and file of one rule.
#[derive(Clone, Copy)]
struct Place<'p> {
    domain: &'p str,
    file: &'p str,
}

struct Assembly {
    rules: Vec<Rule>,
    fingerprint: Fingerprint,
}

impl Assembly {
    /// Adds a descriptor and its children as rules, and indexes it in `parent`; `levels`
    /// holds its ancestors' levels on the way in and out.
    fn add(
        &mut self,
        place: Place<'_>,
        draft: DescriptorDraft,
        levels: &mut Vec<RuleLevel>,
        parent: &mut Level,
        names: &mut foldhash::HashMap<Box<str>, RuleId>,
    ) {
        levels.push(RuleLevel {
            key: draft.key.clone(),
            value: draft.value.clone(),
            share_threshold: draft.share_threshold,
            value_to_metric: draft.value_to_metric,
        });
        let depth = u64::try_from(levels.len()).unwrap_or(u64::MAX);
        let id = RuleId(
            u32::try_from(self.rules.len())
                .expect("RULES_PER_SET_MAX fits in u32 and was enforced"),
        );
        let count = draft.limits.len();
        let limits: Vec<RuleLimit> = draft
            .limits
            .into_iter()
            .enumerate()
            .map(|(index, limit)| {
                let place = (draft.path.as_str(), index, count);
                RuleLimit::new(limit.spec, limit.spec, limit.unit, limit.name, place)
            })
            .collect();
        for name in limits.iter().filter_map(|limit| limit.name.as_deref()) {
            names.insert(name.into(), id);
        }
        let mut replaces: Vec<String> = Vec::with_capacity(draft.replaces.len());
        for replaced in draft.replaces {
            if !replaces.contains(&replaced.text) {
                replaces.push(replaced.text);
            }
        }
        let rule = Rule {
            id,
            domain: place.domain.to_owned(),
            path: draft.path,
            limits,
            unlimited: draft.unlimited,
            rollout: draft.rollout,
            stage: draft.rollout.stage_outside_canary(),
            enforce_after: draft.enforce_after,
            detailed_metric: draft.detailed_metric,
            quota_mode: draft.quota_mode,
            metadata: draft.metadata,
            levels: levels.as_slice().into(),
            failure_mode: draft.failure_mode,
            lease: draft.lease,
            regions: draft.regions,
            replaces,
            file: place.file.to_owned(),
            line: draft.line,
        };
        self.digest(&rule, &draft.key, draft.value.as_deref(), depth);
        let decides = rule.unlimited || !rule.limits.is_empty();
        self.rules.push(rule);
        let mut children = Level::default();
        for child in draft.children {
            self.add(place, child, levels, &mut children, names);
        }
        levels.pop();
        parent.insert(
            &draft.key,
            draft.value.as_deref(),
            IndexNode { rule: id, decides, children },
        );
    }

    /// Everything that changes what a descriptor matches or decides, in a fixed order;
    /// nothing about where it was written.
    fn digest(&mut self, rule: &Rule, key: &str, value: Option<&str>, depth: u64) {
        let fingerprint = &mut self.fingerprint;
        fingerprint.tag(b'N');
        fingerprint.u64(depth);
        fingerprint.str(key);
        fingerprint.option_str(value);
        fingerprint.bool(rule.unlimited);
        fingerprint.bool(rule.rollout == Rollout::Shadow);
        fingerprint.bool(rule.detailed_metric);
        fingerprint.tag(match rule.failure_mode {
            FailureMode::Open => 0,
            FailureMode::Closed => 1,
        });
        fingerprint.len(rule.limits.len());
        for limit in &rule.limits {
            fingerprint.tag(algorithm_tag(limit.spec.algorithm));
            fingerprint.u64(limit.spec.requests_per_window);
            fingerprint.u64(limit.spec.window_ms);
            fingerprint.u64(limit.spec.burst_tokens);
            // The unit matters apart from its window: it is what Envoy is told.
            let unit_tag =
                limit.unit.and_then(|unit| UNITS.iter().position(|(_, known)| *known == unit));
            fingerprint.len(unit_tag.map_or(0, |position| position + 1));
            fingerprint.option_str(limit.name.as_deref());
        }
        fingerprint.len(rule.replaces.len());
        for replaced in &rule.replaces {
            fingerprint.str(replaced);
        }
        // Written only when it is not the default, so every policy without a `lease` block
        // keeps the digest it had before leases were tunable (nodes of two versions still
        // agree), and an explicit default block digests as its absence: it leases alike.
        // Unambiguous: the tag differs from the `N` and `D` that can follow.
        // The upstream keys that change counting or answers, likewise only when set. The
        // level's own flags are this rule's last level.
        let own = rule.levels.last();
        let share_threshold = own.is_some_and(|level| level.share_threshold);
        let value_to_metric = own.is_some_and(|level| level.value_to_metric);
        if rule.quota_mode || share_threshold || value_to_metric || rule.metadata.is_some() {
            fingerprint.tag(b'U');
            fingerprint.bool(rule.quota_mode);
            fingerprint.bool(share_threshold);
            fingerprint.bool(value_to_metric);
            let metadata = rule.metadata.as_ref().map(|map| {
                serde_json::to_string(map).expect("a JSON map of strings and numbers serializes")
            });
            fingerprint.option_str(metadata.as_deref());
        }
        // Only for the stages that came after shadow mode, so every other policy keeps its
        // digest.
        if let Rollout::Warn | Rollout::Canary { .. } = rule.rollout {
            fingerprint.tag(b'W');
            fingerprint.u64(match rule.rollout {
                Rollout::Canary { basis_points } => u64::from(basis_points) + 1,
                _ => 0,
            });
            fingerprint.option_str(rule.enforce_after.as_deref());
        }
        // Only when set, so every policy without `regions` keeps its digest.
        if let Some(regions) = &rule.regions {
            fingerprint.tag(b'R');
            fingerprint.len(regions.iter().count());
            for (region, share) in regions.iter() {
                fingerprint.str(region);
                fingerprint.u64(u64::from(share));
            }
        }
        if rule.lease != LeaseTuning::default() {
            let lease = &rule.lease;
            fingerprint.tag(b'L');
            for number in [
                lease.min_lease_tokens,
                lease.max_lease_tokens,
                lease.lookahead_ms,
                lease.low_watermark_percent,
                lease.lease_ttl_ms,
                lease.expiry_margin_ms,
                lease.rate_half_life_ms,
            ] {
                fingerprint.u64(number);
            }
        }
    }
}

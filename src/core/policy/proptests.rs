//! Property tests: `match_descriptor` against a naive reference matcher over random
//! descriptor trees, the digest's stability and sensitivity, and `lease` blocks against a
//! reference resolution written out from DESIGN section 3.
//!
//! Trees are generated as data, rendered to YAML and parsed, so the properties cover the
//! whole path from text to match. The reference matcher is a linear scan with its own
//! recursive glob, sharing no code with `matcher.rs`.

use proptest::prelude::*;

use super::{Entry, Match, PolicySet, PolicySource};
use crate::core::lease::{LEASE_TOKENS_MAX, LeaseTuning};

/// What a generated descriptor decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    /// No `rate_limit`: a placeholder, or a leaf that limits nothing.
    Nothing,
    /// `requests_per_unit` of a one-second limit.
    Limit(u64),
    Unlimited,
}

#[derive(Debug, Clone)]
struct Descriptor {
    key: &'static str,
    value: Option<&'static str>,
    decision: Decision,
    children: Vec<Descriptor>,
    /// The line of `- key:` once rendered; rules report it, so it identifies the match.
    line: u32,
}

const KEYS: [&str; 3] = ["a", "b", "c"];
/// Config values: exact ones, and wildcards at the end, the start, the middle, alone,
/// doubled, and around a piece that must be found in between.
const VALUES: [&str; 10] = ["x", "y", "xy", "x*", "*y", "*", "x*y", "**", "*x*", "y*x*y"];
/// Request values, chosen to hit and miss the config values above.
const REQUEST_VALUES: [&str; 11] =
    ["x", "y", "xy", "xay", "yx", "", "z", "x*", "xyy", "axb", "yxy"];

fn decision() -> impl Strategy<Value = Decision> {
    prop_oneof![
        Just(Decision::Nothing),
        (1_u64..1_000).prop_map(Decision::Limit),
        Just(Decision::Unlimited)
    ]
}

fn descriptor() -> impl Strategy<Value = Descriptor> {
    let key = prop::sample::select(&KEYS[..]);
    let value = prop::option::of(prop::sample::select(&VALUES[..]));
    let leaf = (key.clone(), value.clone(), decision()).prop_map(|(key, value, decision)| {
        Descriptor { key, value, decision, children: Vec::new(), line: 0 }
    });
    leaf.prop_recursive(3, 48, 5, move |inner| {
        (key.clone(), value.clone(), decision(), prop::collection::vec(inner, 0..5)).prop_map(
            |(key, value, decision, children)| Descriptor {
                key,
                value,
                decision,
                children,
                line: 0,
            },
        )
    })
}

/// A tree with at most one descriptor per key and value at each level, as a valid policy has.
fn forest() -> impl Strategy<Value = Vec<Descriptor>> {
    prop::collection::vec(descriptor(), 0..8).prop_map(dedupe)
}

fn dedupe(descriptors: Vec<Descriptor>) -> Vec<Descriptor> {
    let mut kept: Vec<Descriptor> = Vec::new();
    for mut descriptor in descriptors {
        if !kept.iter().any(|other| other.key == descriptor.key && other.value == descriptor.value)
        {
            descriptor.children = dedupe(descriptor.children);
            kept.push(descriptor);
        }
    }
    kept
}

fn request() -> impl Strategy<Value = Vec<(&'static str, &'static str)>> {
    prop::collection::vec(
        (prop::sample::select(&KEYS[..]), prop::sample::select(&REQUEST_VALUES[..])),
        1..5,
    )
}

/// Steps of a walk down the tree: which descriptor to follow, and what to put where its
/// value has a star (or no value).
fn walk() -> impl Strategy<Value = Vec<(prop::sample::Index, &'static str)>> {
    prop::collection::vec(
        (any::<prop::sample::Index>(), prop::sample::select(&REQUEST_VALUES[..])),
        1..5,
    )
}

/// A request that follows the tree, so deep rules are reached more often than by chance.
fn walk_request(
    mut level: &[Descriptor],
    steps: &[(prop::sample::Index, &'static str)],
) -> Vec<(String, String)> {
    let mut request = Vec::new();
    for (index, filler) in steps {
        if level.is_empty() {
            break;
        }
        let descriptor = &level[index.index(level.len())];
        let value =
            descriptor.value.map_or_else(|| (*filler).to_owned(), |own| own.replace('*', filler));
        request.push((descriptor.key.to_owned(), value));
        level = &descriptor.children;
    }
    request
}

/// Renders the tree as a policy file and records each descriptor's line.
fn render(descriptors: &mut [Descriptor]) -> String {
    let mut lines = vec!["domain: rl".to_owned(), "descriptors:".to_owned()];
    render_level(descriptors, 1, &mut lines);
    lines.join("\n")
}

fn render_level(descriptors: &mut [Descriptor], depth: usize, lines: &mut Vec<String>) {
    let indent = "    ".repeat(depth - 1);
    for descriptor in descriptors {
        lines.push(format!("{indent}  - key: {}", descriptor.key));
        descriptor.line = u32::try_from(lines.len()).unwrap_or(u32::MAX);
        if let Some(value) = descriptor.value {
            // Quoted: a plain `*` would start a YAML alias.
            lines.push(format!("{indent}    value: \"{value}\""));
        }
        match descriptor.decision {
            Decision::Nothing => {}
            Decision::Limit(requests) => {
                lines.push(format!(
                    "{indent}    rate_limit: {{unit: second, requests_per_unit: {requests}}}"
                ));
            }
            Decision::Unlimited => {
                lines.push(format!("{indent}    rate_limit: {{unlimited: true}}"))
            }
        }
        if !descriptor.children.is_empty() {
            lines.push(format!("{indent}    descriptors:"));
            render_level(&mut descriptor.children, depth + 1, lines);
        }
    }
}

fn parse(text: String) -> Result<PolicySet, TestCaseError> {
    PolicySet::parse(&[PolicySource { name: "p.yaml".to_owned(), text }])
        .map_err(|errors| TestCaseError::fail(format!("generated policy did not parse:\n{errors}")))
}

/// `*` matches any run of characters; everything else matches itself.
fn glob(pattern: &[char], value: &[char]) -> bool {
    match pattern.split_first() {
        None => value.is_empty(),
        Some(('*', rest)) => (0..=value.len()).any(|skip| glob(rest, &value[skip..])),
        Some((character, rest)) => value.first() == Some(character) && glob(rest, &value[1..]),
    }
}

/// envoyproxy/ratelimit's walk, written as plainly as possible: per level, the first
/// descriptor with the key and the exact value, else the first with the key and a matching
/// wildcard value, else the one with the key and no value; no backtracking; the last level
/// must decide something.
fn reference<'d>(
    mut level: &'d [Descriptor],
    request: &[(String, String)],
) -> Option<&'d Descriptor> {
    let mut found = None;
    for (key, value) in request {
        let value_chars: Vec<char> = value.chars().collect();
        let with_key = || level.iter().filter(|descriptor| descriptor.key == key);
        let exact = with_key().find(|descriptor| {
            descriptor.value.is_some_and(|own| !own.contains('*') && own == value)
        });
        let wildcard = || {
            with_key().find(|descriptor| {
                descriptor.value.is_some_and(|own| {
                    let pattern: Vec<char> = own.chars().collect();
                    own.contains('*') && glob(&pattern, &value_chars)
                })
            })
        };
        let key_only = || with_key().find(|descriptor| descriptor.value.is_none());
        let descriptor = exact.or_else(wildcard).or_else(key_only)?;
        found = Some(descriptor);
        level = &descriptor.children;
    }
    found.filter(|descriptor| descriptor.decision != Decision::Nothing)
}

fn first_limit(descriptors: &mut [Descriptor]) -> Option<&mut u64> {
    for descriptor in descriptors {
        if let Decision::Limit(requests) = &mut descriptor.decision {
            return Some(requests);
        }
        if let Some(requests) = first_limit(&mut descriptor.children) {
            return Some(requests);
        }
    }
    None
}

proptest! {
    #[test]
    fn match_descriptor_agrees_with_reference(
        mut tree in forest(),
        random in prop::collection::vec(request(), 1..12),
        walks in prop::collection::vec(walk(), 1..12),
    ) {
        // For random trees and descriptors (random ones, and ones that follow the tree), the
        // indexed matcher finds exactly the rule the linear reference walk finds (same line,
        // same decision), or no rule when it finds none.
        let set = parse(render(&mut tree))?;
        let owned = |request: &Vec<(&str, &str)>| -> Vec<(String, String)> {
            request.iter().map(|&(key, value)| (key.to_owned(), value.to_owned())).collect()
        };
        let random = random.iter().map(owned);
        let walked = walks.iter().map(|steps| walk_request(&tree, steps));
        for request in random.chain(walked) {
            let entries: Vec<Entry<'_>> = request
                .iter()
                .map(|(key, value)| Entry { key: key.as_str(), value: value.as_str() })
                .collect();
            match (set.match_descriptor("rl", &entries), reference(&tree, &request)) {
                (Match::NoRule, None) => {}
                (Match::Rule(rule), Some(descriptor)) => {
                    prop_assert_eq!(rule.line, descriptor.line, "request {:?}", request);
                    prop_assert_eq!(rule.unlimited, descriptor.decision == Decision::Unlimited);
                    if let Decision::Limit(requests_per_unit) = descriptor.decision {
                        prop_assert_eq!(rule.limits[0].spec.requests_per_window, requests_per_unit);
                    }
                }
                (actual, expected) => {
                    let message = format!("matcher {actual:?}, reference {expected:?}");
                    prop_assert!(false, "request {:?}: {}", request, message);
                }
            }
        }
    }

    #[test]
    fn digest_is_stable_and_sees_numbers(mut tree in forest()) {
        // Parsing the same text twice gives the same digest, and changing one number in it
        // changes the digest.
        let text = render(&mut tree);
        let first = parse(text.clone())?;
        let second = parse(text)?;
        prop_assert_eq!(first.digest(), second.digest());
        let Some(requests) = first_limit(&mut tree) else { return Ok(()) };
        *requests += 1;
        let changed = parse(render(&mut tree))?;
        prop_assert_ne!(first.digest(), changed.digest());
    }
}

/// A policy of one limited rule with the `lease` fields given (each `None` is left out), in
/// flow (`{a: 1}`) or block style.
fn lease_policy(
    min_tokens: Option<u64>,
    max_tokens: Option<u64>,
    lookahead_ms: Option<u64>,
    flow: bool,
) -> String {
    let fields: Vec<String> = [
        min_tokens.map(|tokens| format!("min_tokens: {tokens}")),
        max_tokens.map(|tokens| format!("max_tokens: {tokens}")),
        lookahead_ms.map(|lookahead_ms| format!("lookahead: {lookahead_ms}ms")),
    ]
    .into_iter()
    .flatten()
    .collect();
    let lease = if flow {
        format!("    lease: {{{}}}", fields.join(", "))
    } else if fields.is_empty() {
        "    lease:".to_owned()
    } else {
        format!("    lease:\n      {}", fields.join("\n      "))
    };
    [
        "domain: rl",
        "descriptors:",
        "  - key: a",
        "    rate_limit: {unit: second, requests_per_unit: 1}",
        &lease,
    ]
    .join("\n")
}

/// The tuning DESIGN section 3 asks for, written out: the given numbers over the defaults
/// 5, 500 and 250 ms, a TTL of twice the lookahead and a margin of 50 ms or a quarter of
/// the TTL; `None` when a rule may not ask for it.
fn reference_lease(
    min_tokens: Option<u64>,
    max_tokens: Option<u64>,
    lookahead_ms: Option<u64>,
) -> Option<LeaseTuning> {
    let (min, max, lookahead_ms) =
        (min_tokens.unwrap_or(5), max_tokens.unwrap_or(500), lookahead_ms.unwrap_or(250));
    let valid = 1 <= min && min <= max && max <= 1_000_000 && (1..=500).contains(&lookahead_ms);
    valid.then(|| LeaseTuning {
        min_lease_tokens: min,
        max_lease_tokens: max,
        lookahead_ms,
        low_watermark_percent: 20,
        lease_ttl_ms: 2 * lookahead_ms,
        expiry_margin_ms: (2 * lookahead_ms / 4).min(50),
        rate_half_life_ms: 1_000,
    })
}

fn lease_of(text: String) -> Result<Result<LeaseTuning, String>, TestCaseError> {
    match PolicySet::parse(&[PolicySource { name: "p.yaml".to_owned(), text }]) {
        Ok(set) => match set.match_descriptor("rl", &[Entry { key: "a", value: "x" }]) {
            Match::Rule(rule) => Ok(Ok(rule.lease)),
            other => Err(TestCaseError::fail(format!("expected the rule, got {other:?}"))),
        },
        Err(errors) => Ok(Err(errors.to_string())),
    }
}

/// Token counts around every edge: 0, small, the defaults, and the cap.
fn lease_tokens() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..=12_u64,
        490..=510_u64,
        1..=LEASE_TOKENS_MAX,
        LEASE_TOKENS_MAX - 2..=LEASE_TOKENS_MAX + 2,
    ]
}

proptest! {
    #[test]
    fn valid_lease_block_round_trips(
        min_tokens in 1..=LEASE_TOKENS_MAX,
        spread in 0..=LEASE_TOKENS_MAX,
        lookahead_ms in 1..=500_u64,
        flow in any::<bool>(),
    ) {
        // Any valid (min_tokens, max_tokens, lookahead) written in a policy comes back as
        // the rule's tuning, the numbers as written and the TTL derived as DESIGN says.
        let max_tokens = min_tokens.saturating_add(spread).min(LEASE_TOKENS_MAX);
        let text = lease_policy(Some(min_tokens), Some(max_tokens), Some(lookahead_ms), flow);
        let expected = reference_lease(Some(min_tokens), Some(max_tokens), Some(lookahead_ms));
        prop_assert!(expected.is_some());
        match lease_of(text)? {
            Ok(lease) => prop_assert_eq!(Some(lease), expected),
            Err(errors) => prop_assert!(false, "valid lease block refused:\n{}", errors),
        }
    }

    #[test]
    fn lease_block_is_accepted_exactly_when_valid(
        min_tokens in prop::option::of(lease_tokens()),
        max_tokens in prop::option::of(lease_tokens()),
        lookahead_ms in prop::option::of(prop_oneof![0..=3_u64, 1..=1_200_u64, 498..=502_u64]),
        flow in any::<bool>(),
    ) {
        // With any keys left out, the loader accepts a block exactly when the reference
        // finds it valid, resolves it to the reference tuning, and otherwise reports an
        // error on the `lease` line.
        let text = lease_policy(min_tokens, max_tokens, lookahead_ms, flow);
        match (lease_of(text)?, reference_lease(min_tokens, max_tokens, lookahead_ms)) {
            (Ok(lease), Some(expected)) => prop_assert_eq!(lease, expected),
            (Err(errors), None) => {
                let lease_lines = if flow { ["p.yaml:5:"].as_slice() } else {
                    ["p.yaml:5:", "p.yaml:6:", "p.yaml:7:", "p.yaml:8:"].as_slice()
                };
                for error in errors.lines() {
                    prop_assert!(
                        lease_lines.iter().any(|line| error.starts_with(line)),
                        "error away from the lease block: {}", error
                    );
                }
            }
            (actual, expected) => {
                prop_assert!(false, "loader {:?}, reference {:?}", actual, expected);
            }
        }
    }
}

/// A two-level policy: a wildcard `value` at the top, with or without `share_threshold`,
/// flags on its key-only child, and a limit on the child.
fn shared_policy(pattern: &str, share_threshold: bool, detailed: bool, to_metric: bool) -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: a\n    value: \"{pattern}\"\n    share_threshold: \
         {share_threshold}\n    value_to_metric: {to_metric}\n    descriptors:\n      - key: b\n        \
         detailed_metric: {detailed}\n        rate_limit: {{unit: minute, requests_per_unit: 5}}\n"
    )
}

proptest! {
    /// Against a reference written from upstream's documentation: a `share_threshold` level
    /// names counters and statistics by its pattern for every value it matches, a level
    /// without it by the runtime value; statistics name a level by its runtime value under
    /// `detailed_metric` (every level) or its own `value_to_metric`, else by its configured
    /// value.
    #[test]
    fn share_threshold_and_statistics_keys_follow_the_reference(
        pattern in prop::sample::select(&["x*", "*y", "x*y", "*"][..]),
        request_value in prop::sample::select(&REQUEST_VALUES[..]),
        child_value in prop::sample::select(&["p", "q", ""][..]),
        share_threshold: bool,
        detailed: bool,
        to_metric: bool,
    ) {
        let set = parse(shared_policy(pattern, share_threshold, detailed, to_metric))?;
        let entries = [Entry { key: "a", value: request_value }, Entry { key: "b", value: child_value }];
        let matches = glob(&pattern.chars().collect::<Vec<_>>(), &request_value.chars().collect::<Vec<_>>());
        let Match::Rule(rule) = set.match_descriptor("d", &entries) else {
            prop_assert!(!matches, "{pattern} matches {request_value}: a rule applies");
            return Ok(());
        };
        prop_assert!(matches);
        let expected_counter = if share_threshold { pattern } else { request_value };
        prop_assert_eq!(rule.counter_value(0, request_value), expected_counter);
        prop_assert_eq!(rule.counter_value(1, child_value), child_value);
        let top = if share_threshold || !(detailed || to_metric) || request_value.is_empty() {
            format!("a_{pattern}")
        } else {
            format!("a_{request_value}")
        };
        let child = if detailed && !child_value.is_empty() { format!("b_{child_value}") } else { "b".to_owned() };
        let runtime_values = [request_value, child_value];
        let key = rule.stats_key(|level| runtime_values.get(level).copied());
        prop_assert_eq!(key, format!("{top}.{child}"));
    }
}

proptest! {
    /// A canary only grows: a node that enforces at one share enforces at every larger one,
    /// 0 % is no node and 100 % every node, and the choice depends on the node and rule only.
    #[test]
    fn a_canary_keeps_its_nodes_as_it_grows(
        node in "[a-z0-9-]{1,20}",
        rule_path in "[a-z_]{1,20}",
        smaller in 0u32..=10_000,
        larger in 0u32..=10_000,
    ) {
        use super::{Rollout, Stage};
        let (smaller, larger) = (smaller.min(larger), smaller.max(larger));
        let stage = |basis_points| {
            Rollout::Canary { basis_points }.stage_on(&node, "domain", &rule_path)
        };
        if stage(smaller) == Stage::Enforce {
            prop_assert_eq!(stage(larger), Stage::Enforce);
        }
        prop_assert_eq!(stage(0), Stage::Warn);
        prop_assert_eq!(stage(10_000), Stage::Enforce);
        prop_assert_eq!(stage(smaller), stage(smaller));
    }
}

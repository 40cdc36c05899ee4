//! Property tests: `match_descriptor` against a naive reference matcher over random
//! descriptor trees, and the digest's stability and sensitivity.
//!
//! Trees are generated as data, rendered to YAML and parsed, so the properties cover the
//! whole path from text to match. The reference matcher is a linear scan with its own
//! recursive glob, sharing no code with `matcher.rs`.

use proptest::prelude::*;

use super::{Entry, Match, PolicySet, PolicySource};

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

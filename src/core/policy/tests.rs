//! Unit tests: envoyproxy/ratelimit's README examples, matching precedence, every load error
//! at its exact position, the example policy, and the digest's fixed value.
//!
//! Policy texts are written as one string per line, so the line numbers the tests expect
//! can be counted from the array.

use super::*;
use crate::core::lease::{LEASE_TOKENS_MAX, LeaseTuning};
use crate::core::rate::Algorithm;

/// The runtime values of a descriptor's levels, as `Rule::stats_key` reads them.
fn values<'v>(values: &'v [&'v str]) -> impl Fn(usize) -> Option<&'v str> {
    move |level| values.get(level).copied()
}

/// One text from its lines.
fn text(lines: &[&str]) -> String {
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

fn source(name: &str, lines: &[&str]) -> PolicySource {
    PolicySource { name: name.to_owned(), text: text(lines) }
}

/// Parses one file that must be valid.
fn parse(lines: &[&str]) -> PolicySet {
    match PolicySet::parse(&[source("p.yaml", lines)]) {
        Ok(set) => set,
        Err(errors) => panic!("expected a valid policy, got:\n{errors}"),
    }
}

/// The errors of sources that must be invalid, one `file:line:column: reason` each.
fn errors_of(sources: &[PolicySource]) -> Vec<String> {
    match PolicySet::parse(sources) {
        Ok(_) => panic!("expected errors, the policy parsed"),
        Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
    }
}

/// The errors of one invalid file named `p.yaml`.
fn errors(lines: &[&str]) -> Vec<String> {
    errors_of(&[source("p.yaml", lines)])
}

/// What a descriptor matches: the rule's path, or why there is none.
fn describe(set: &PolicySet, domain: &str, pairs: &[(&str, &str)]) -> String {
    let entries: Vec<Entry<'_>> = pairs.iter().map(|&(key, value)| Entry { key, value }).collect();
    match set.match_descriptor(domain, &entries) {
        Match::DomainNotFound => "domain not found".to_owned(),
        Match::NoRule => "no rule".to_owned(),
        Match::Rule(rule) => rule.path.clone(),
    }
}

/// The rule a descriptor must match.
fn matched<'p>(set: &'p PolicySet, domain: &str, pairs: &[(&str, &str)]) -> &'p Rule {
    let entries: Vec<Entry<'_>> = pairs.iter().map(|&(key, value)| Entry { key, value }).collect();
    match set.match_descriptor(domain, &entries) {
        Match::Rule(rule) => rule,
        other => panic!("expected a rule for {pairs:?}, got {other:?}"),
    }
}

/// `requests_per_window` and `window_ms` of a rule's only limit.
fn numbers(rule: &Rule) -> (u64, u64) {
    match rule.limits.as_slice() {
        [limit] => (limit.spec.requests_per_window, limit.spec.window_ms),
        other => panic!("expected one limit on {}, got {other:?}", rule.path),
    }
}

const SECOND_MS: u64 = 1_000;
const DAY_MS: u64 = 86_400_000;

// envoyproxy/ratelimit README examples.

#[test]
fn readme_example_1_two_values_of_one_key() {
    // Two values of one key each get their own 500/s limit; other values are not limited.
    let set = parse(&[
        "domain: mongo_cps",
        "descriptors:",
        "  - key: database",
        "    value: users",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 500",
        "",
        "  - key: database",
        "    value: default",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 500",
    ]);
    assert_eq!(numbers(matched(&set, "mongo_cps", &[("database", "users")])), (500, SECOND_MS));
    assert_eq!(describe(&set, "mongo_cps", &[("database", "default")]), "database_default");
    assert_eq!(describe(&set, "mongo_cps", &[("database", "orders")]), "no rule");
    assert_eq!(describe(&set, "mongo_cps", &[("database", "users"), ("x", "y")]), "no rule");
    assert_eq!(describe(&set, "other", &[("database", "users")]), "domain not found");
    let rule = matched(&set, "mongo_cps", &[("database", "users")]);
    assert_eq!(rule.limits[0].unit, Some(Unit::Second));
    assert_eq!(rule.limits[0].spec.algorithm, Algorithm::TokenBucket);
    assert_eq!(rule.line, 3);
}

#[test]
fn readme_example_2_nested_and_key_only() {
    // A nested key-only descriptor under a placeholder matches two-entry descriptors, and a
    // top-level key-only one matches one-entry descriptors; the placeholder alone decides nothing.
    let set = parse(&[
        "domain: messaging",
        "descriptors:",
        "  # Only allow 5 marketing messages a day",
        "  - key: message_type",
        "    value: marketing",
        "    descriptors:",
        "      - key: to_number",
        "        rate_limit:",
        "          unit: day",
        "          requests_per_unit: 5",
        "",
        "  # Only allow 100 messages a day to any unique phone number",
        "  - key: to_number",
        "    rate_limit:",
        "      unit: day",
        "      requests_per_unit: 100",
    ]);
    let nested =
        matched(&set, "messaging", &[("message_type", "marketing"), ("to_number", "2061111111")]);
    assert_eq!(nested.path, "message_type_marketing.to_number");
    assert_eq!(numbers(nested), (5, DAY_MS));
    let other_number =
        matched(&set, "messaging", &[("message_type", "marketing"), ("to_number", "2062222222")]);
    assert_eq!(other_number.id, nested.id, "key-only: one rule, counted per value by the caller");
    assert_eq!(numbers(matched(&set, "messaging", &[("to_number", "2061111111")])), (100, DAY_MS));
    assert_eq!(describe(&set, "messaging", &[("message_type", "marketing")]), "no rule");
    assert_eq!(
        describe(&set, "messaging", &[("message_type", "transactional"), ("to_number", "1")]),
        "no rule"
    );
}

#[test]
fn readme_example_3_as_written_loads_with_a_limit_of_zero() {
    // The README's "black list" loads as in envoyproxy/ratelimit: the listed address matches
    // its key+value rule, whose limit of 0 refuses every hit, and other addresses get 10/s.
    let set = parse(&[
        "domain: edge_proxy_per_ip",
        "descriptors:",
        "  - key: remote_address",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 10",
        "",
        "  # Black list IP",
        "  - key: remote_address",
        "    value: 50.0.0.5",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 0",
    ]);
    let black_listed = matched(&set, "edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]);
    assert_eq!(black_listed.path, "remote_address_50.0.0.5");
    assert_eq!(numbers(black_listed), (0, SECOND_MS));
    let spec = black_listed.limits[0].spec;
    assert_eq!((spec.algorithm, spec.burst_tokens), (Algorithm::TokenBucket, 0));
    assert!(!spec.evaluate(&spec.initial_state(0), 0, 1).admitted);
    assert_eq!(
        numbers(matched(&set, "edge_proxy_per_ip", &[("remote_address", "50.0.0.1")])),
        (10, SECOND_MS)
    );
}

#[test]
fn limit_of_zero_loads_with_every_algorithm() {
    // `requests_per_unit: 0` loads with any algorithm or window, and with `burst: 0` too.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - {key: a, rate_limit: {unit: hour, requests_per_unit: 0, burst: 0}}",
        "  - {key: b, rate_limit: {window: 5m, requests_per_unit: 0, algorithm: fixed_window}}",
        "  - {key: c, rate_limit: {unit: day, requests_per_unit: 0, algorithm: sliding_window}}",
    ]);
    let spec_of = |key| matched(&set, "rl", &[(key, "x")]).limits[0].spec;
    assert_eq!(numbers(matched(&set, "rl", &[("a", "x")])), (0, 3_600_000));
    assert_eq!(spec_of("a").burst_tokens, 0);
    assert_eq!((spec_of("b").algorithm, spec_of("b").window_ms), (Algorithm::FixedWindow, 300_000));
    assert_eq!(
        (spec_of("c").algorithm, spec_of("c").window_ms),
        (Algorithm::SlidingWindow, DAY_MS)
    );
    for key in ["a", "b", "c"] {
        assert_eq!(spec_of(key).requests_per_window, 0, "{key}");
        assert_eq!(spec_of(key).capacity_tokens(), 0, "{key}");
    }
}

#[test]
fn readme_example_3_key_value_before_key() {
    // With a non-zero limit, the specific address matches its key+value rule and every other
    // address the key-only rule.
    let set = parse(&[
        "domain: edge_proxy_per_ip",
        "descriptors:",
        "  - key: remote_address",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 10",
        "",
        "  - key: remote_address",
        "    value: 50.0.0.5",
        "    rate_limit:",
        "      unit: second",
        "      requests_per_unit: 1",
    ]);
    assert_eq!(
        numbers(matched(&set, "edge_proxy_per_ip", &[("remote_address", "50.0.0.1")])),
        (10, SECOND_MS)
    );
    let specific = matched(&set, "edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]);
    assert_eq!(specific.path, "remote_address_50.0.0.5");
    assert_eq!(numbers(specific), (1, SECOND_MS));
}

#[test]
fn readme_example_4_depth_must_match() {
    // A two-entry descriptor matches only a rule nested two deep, and a one-entry descriptor
    // does not match a placeholder whose limit sits one level further down.
    let flat = parse(&[
        "domain: example4",
        "descriptors:",
        "  - key: key",
        "    value: value",
        "    rate_limit:",
        "      requests_per_unit: 300",
        "      unit: second",
    ]);
    assert_eq!(describe(&flat, "example4", &[("key", "value"), ("subkey", "subvalue")]), "no rule");
    assert_eq!(describe(&flat, "example4", &[("key", "value")]), "key_value");

    let nested = parse(&[
        "domain: example4",
        "descriptors:",
        "  - key: key",
        "    value: value",
        "    descriptors:",
        "      - key: subkey",
        "        rate_limit:",
        "          requests_per_unit: 300",
        "          unit: second",
    ]);
    let rule = matched(&nested, "example4", &[("key", "value"), ("subkey", "subvalue")]);
    assert_eq!(rule.path, "key_value.subkey");
    assert_eq!(numbers(rule), (300, SECOND_MS));
    assert_eq!(describe(&nested, "example4", &[("key", "value")]), "no rule");
    assert_eq!(
        describe(&nested, "example4", &[("key", "value"), ("subkey", "a"), ("deeper", "b")]),
        "no rule"
    );
}

#[test]
fn readme_example_5_unlimited() {
    // An unlimited descriptor matches as a rule without limits, distinct from no rule.
    let set = parse(&[
        "domain: internal",
        "descriptors:",
        "  - key: ldap",
        "    rate_limit:",
        "      unlimited: true",
        "",
        "  - key: azure",
        "    rate_limit:",
        "      unit: minute",
        "      requests_per_unit: 100",
    ]);
    let ldap = matched(&set, "internal", &[("ldap", "anything")]);
    assert!(ldap.unlimited);
    assert!(ldap.limits.is_empty());
    let azure = matched(&set, "internal", &[("azure", "x")]);
    assert!(!azure.unlimited);
    assert_eq!(numbers(azure), (100, 60 * SECOND_MS));
    assert_eq!(describe(&set, "internal", &[("gcp", "x")]), "no rule");
}

// Matching precedence.

#[test]
fn wildcard_precedence() {
    // Exact beats wildcard, wildcards are tried in declaration order (not by specificity),
    // a wildcard beats key-only, and `*` works as prefix, suffix and in the middle.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - {key: path, rate_limit: {unit: second, requests_per_unit: 1}}",
        "  - {key: path, value: /api/*, rate_limit: {unit: second, requests_per_unit: 2}}",
        "  - {key: path, value: /api/v1*, rate_limit: {unit: second, requests_per_unit: 3}}",
        "  - {key: path, value: /api/v1/users, rate_limit: {unit: second, requests_per_unit: 4}}",
        "  - {key: path, value: '*.json', rate_limit: {unit: second, requests_per_unit: 5}}",
        "  - {key: path, value: /static/*/img*, rate_limit: {unit: second, requests_per_unit: 6}}",
        "  - {key: path, value: /open}",
    ]);
    assert_eq!(describe(&set, "rl", &[("path", "/api/v1/users")]), "path_/api/v1/users");
    assert_eq!(describe(&set, "rl", &[("path", "/api/v1/orders")]), "path_/api/*");
    assert_eq!(
        describe(&set, "rl", &[("path", "/api/")]),
        "path_/api/*",
        "a star matches nothing too"
    );
    assert_eq!(describe(&set, "rl", &[("path", "/data/x.json")]), "path_*.json");
    assert_eq!(describe(&set, "rl", &[("path", "/static/a/b/img.png")]), "path_/static/*/img*");
    assert_eq!(describe(&set, "rl", &[("path", "/static/img")]), "path");
    assert_eq!(describe(&set, "rl", &[("path", "/other")]), "path");
    assert_eq!(
        describe(&set, "rl", &[("path", "/open")]),
        "no rule",
        "a leaf without rate_limit is not limited"
    );
    assert_eq!(describe(&set, "rl", &[("route", "/api/x")]), "no rule");
}

#[test]
fn key_only_versus_key_value() {
    // At each level key+value wins over key-only, and the walk does not backtrack: once
    // `user: alice` matched, a miss below it is no rule even though key-only `user` would
    // have matched (envoyproxy/ratelimit behaves the same).
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: user",
        "    value: alice",
        "    descriptors:",
        "      - key: path",
        "        value: /a",
        "        rate_limit: {unit: second, requests_per_unit: 1}",
        "  - key: user",
        "    rate_limit: {unit: second, requests_per_unit: 2}",
        "    descriptors:",
        "      - key: path",
        "        rate_limit: {unit: second, requests_per_unit: 3}",
    ]);
    assert_eq!(describe(&set, "rl", &[("user", "alice"), ("path", "/a")]), "user_alice.path_/a");
    assert_eq!(describe(&set, "rl", &[("user", "alice"), ("path", "/b")]), "no rule");
    assert_eq!(describe(&set, "rl", &[("user", "bob"), ("path", "/b")]), "user.path");
    assert_eq!(describe(&set, "rl", &[("user", "bob")]), "user");
    assert_eq!(
        describe(&set, "rl", &[("user", "alice")]),
        "no rule",
        "user_alice has no rate_limit"
    );
    assert_eq!(describe(&set, "rl", &[]), "no rule");
    assert!(set.has_domain("rl"));
    assert!(!set.has_domain("r"));
}

#[test]
fn empty_set_finds_no_domain() {
    // The default set and a set parsed from no files are the same empty set.
    let empty = PolicySet::default();
    assert_eq!(describe(&empty, "rl", &[("a", "b")]), "domain not found");
    assert_eq!(empty.rules().count(), 0);
    match PolicySet::parse(&[]) {
        Ok(parsed) => assert_eq!(parsed.digest(), empty.digest()),
        Err(errors) => panic!("{errors}"),
    }
}

// Rule contents.

#[test]
fn example_policy_parses_and_matches() {
    // The embedded default policy is valid and every rule in it means what its comment says.
    let example = PolicySource {
        name: "cluster/policies/example.yaml".to_owned(),
        text: include_str!("../../../cluster/policies/example.yaml").to_owned(),
    };
    let set = match PolicySet::parse(&[example]) {
        Ok(set) => set,
        Err(errors) => panic!("{errors}"),
    };
    let domain = "quotamesh-example";
    let per_key = matched(&set, domain, &[("api_key", "k-123")]);
    assert_eq!(per_key.limits[0].spec.burst_tokens, 20);
    assert_eq!(numbers(per_key), (10, SECOND_MS));
    let partner = matched(&set, domain, &[("api_key", "partner-acme")]);
    assert_eq!(
        (partner.limits[0].spec.requests_per_window, partner.limits[0].spec.burst_tokens),
        (100, 200)
    );
    assert_eq!(
        matched(&set, domain, &[("tenant", "t1")]).limits[0].name.as_deref(),
        Some("per_tenant")
    );
    assert!(matched(&set, domain, &[("path", "/search?q=x")]).stage == Stage::Shadow);
    assert!(matched(&set, domain, &[("path", "/healthz")]).unlimited);
    assert_eq!(describe(&set, domain, &[("path", "/checkout")]), "no rule");
    let catalog = matched(&set, domain, &[("destination_cluster", "catalog")]);
    let catalog_limits: Vec<(u64, u64)> = catalog
        .limits
        .iter()
        .map(|limit| (limit.spec.requests_per_window, limit.spec.window_ms))
        .collect();
    assert_eq!(catalog_limits, [(500, SECOND_MS), (1_000_000, DAY_MS)]);
    let login = matched(&set, domain, &[("login_user", "ada")]);
    assert_eq!(login.limits[0].spec.algorithm, Algorithm::SlidingWindow);
    assert_eq!((login.limits[0].spec.window_ms, login.limits[0].unit), (30 * SECOND_MS, None));
    let payments = matched(&set, domain, &[("destination_cluster", "payments")]);
    assert_eq!(payments.failure_mode, FailureMode::Closed);
    assert_eq!(per_key.failure_mode, FailureMode::Open);
    assert_eq!(partner.lease, LeaseTuning::with_sizes(10, 200, 500).expect("valid"));
    assert_eq!(per_key.lease, LeaseTuning::default());
    assert_eq!(set.rule_by_name(domain, "payments").map(|rule| rule.id), Some(payments.id));
    assert_eq!(set.rules().count(), 8);
}

#[test]
fn rules_carry_ids_paths_files_and_replaces() {
    // Rules get dense ids (domains by name, then file order), paths like ratelimit's stats
    // keys, their file and line, and `replaces` resolved by name across the domain.
    let sources = [
        source(
            "b.yaml",
            &[
                "domain: b",
                "descriptors:",
                "  - key: key_1",
                "    value: value_1",
                "    descriptors:",
                "      - key: user",
                "        value: bkthomps",
                "        rate_limit:",
                "          name: specific_limit",
                "          requests_per_unit: 5",
                "          unit: second",
                "  - key: key_2",
                "    value: value_2",
                "    descriptors:",
                "      - key: user",
                "        value: bkthomps",
                "        rate_limit:",
                "          replaces:",
                "            - name: specific_limit",
                "          requests_per_unit: 10",
                "          unit: second",
            ],
        ),
        source("a.yaml", &["domain: a", "descriptors:", "  - {key: k, detailed_metric: true}"]),
    ];
    let set = match PolicySet::parse(&sources) {
        Ok(set) => set,
        Err(errors) => panic!("{errors}"),
    };
    let summary: Vec<(u32, &str, &str, &str, u32)> = set
        .rules()
        .map(|rule| {
            (rule.id.0, rule.domain.as_str(), rule.path.as_str(), rule.file.as_str(), rule.line)
        })
        .collect();
    assert_eq!(
        summary,
        [
            (0, "a", "k", "a.yaml", 3),
            (1, "b", "key_1_value_1", "b.yaml", 3),
            (2, "b", "key_1_value_1.user_bkthomps", "b.yaml", 6),
            (3, "b", "key_2_value_2", "b.yaml", 12),
            (4, "b", "key_2_value_2.user_bkthomps", "b.yaml", 15),
        ]
    );
    for rule in set.rules() {
        assert_eq!(set.rule(rule.id), Some(rule));
    }
    assert_eq!(set.rule(RuleId(5)), None);
    assert!(set.rules().next().is_some_and(|rule| rule.detailed_metric && rule.limits.is_empty()));
    let replacing = matched(&set, "b", &[("key_2", "value_2"), ("user", "bkthomps")]);
    assert_eq!(replacing.replaces, ["specific_limit"]);
    assert_eq!(set.rule_by_name("b", "specific_limit").map(|rule| rule.id), Some(RuleId(2)));
    assert_eq!(set.rule_by_name("a", "specific_limit"), None);
}

#[test]
fn units_windows_and_algorithms() {
    // Units map to ratelimit's windows case-insensitively, `window` takes any length, and
    // the algorithm and burst reach the LimitSpec.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - {key: a, rate_limit: {unit: SECOND, requests_per_unit: 1}}",
        "  - {key: b, rate_limit: {unit: Week, requests_per_unit: 1}}",
        "  - {key: c, rate_limit: {unit: month, requests_per_unit: 1}}",
        "  - {key: d, rate_limit: {unit: year, requests_per_unit: 1}}",
        "  - {key: e, rate_limit: {window: 1500ms, requests_per_unit: 1, algorithm: fixed_window}}",
        "  - {key: f, rate_limit: {window: 5m, requests_per_unit: 1}}",
        "  - {key: g, rate_limit: {window: 2h, requests_per_unit: 3, burst: 9}}",
        "  - {key: h, rate_limit: {window: 7d, requests_per_unit: 1, algorithm: sliding_window}}",
    ]);
    let window = |key: &str| numbers(matched(&set, "rl", &[(key, "v")])).1;
    assert_eq!(window("a"), SECOND_MS);
    assert_eq!(window("b"), 7 * DAY_MS);
    assert_eq!(window("c"), 30 * DAY_MS);
    assert_eq!(window("d"), 365 * DAY_MS);
    assert_eq!(window("e"), 1_500);
    assert_eq!(window("f"), 300 * SECOND_MS);
    assert_eq!(window("h"), 7 * DAY_MS);
    let g = &matched(&set, "rl", &[("g", "v")]).limits[0];
    assert_eq!((g.spec.window_ms, g.spec.burst_tokens, g.unit), (7_200_000, 9, None));
    assert_eq!(matched(&set, "rl", &[("e", "v")]).limits[0].spec.algorithm, Algorithm::FixedWindow);
    assert_eq!(Unit::Hour.window_ms(), 3_600_000);
    assert_eq!(Unit::Minute.window_ms(), 60_000);
    assert_eq!(Unit::Day.window_ms(), DAY_MS);
}

#[test]
fn anchors_aliases_and_merge_keys() {
    // YAML anchors, aliases and `<<` merges (which envoyproxy/ratelimit's YAML reader
    // accepts) work, and explicit keys win over merged ones.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: a",
        "    rate_limit: &standard",
        "      unit: second",
        "      requests_per_unit: 10",
        "  - key: b",
        "    rate_limit: *standard",
        "  - key: c",
        "    rate_limit:",
        "      <<: *standard",
        "      requests_per_unit: 20",
    ]);
    assert_eq!(numbers(matched(&set, "rl", &[("b", "x")])), (10, SECOND_MS));
    assert_eq!(numbers(matched(&set, "rl", &[("c", "x")])), (20, SECOND_MS));
}

#[test]
fn quoted_and_plain_scalars() {
    // Values are strings whatever they look like (`200`, `true`), an empty value is no
    // value, and a quoted `*` is a wildcard like a plain one.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - {key: status, value: 200, rate_limit: {unit: second, requests_per_unit: 1}}",
        "  - {key: flag, value: true, rate_limit: {unit: second, requests_per_unit: 1}}",
        "  - {key: any, value: '', rate_limit: {unit: second, requests_per_unit: 1}}",
        "  - {key: star, value: \"*\", rate_limit: {unit: second, requests_per_unit: 1}}",
    ]);
    assert_eq!(describe(&set, "rl", &[("status", "200")]), "status_200");
    assert_eq!(describe(&set, "rl", &[("flag", "true")]), "flag_true");
    assert_eq!(describe(&set, "rl", &[("any", "whatever")]), "any");
    assert_eq!(describe(&set, "rl", &[("star", "")]), "star_*");
}

// Load errors, each at its exact position.

#[test]
fn error_yaml_syntax() {
    // A syntax error is reported at the parser's position and ends that file's checks.
    assert_eq!(
        errors(&["domain: rl", "descriptors: [", "  - key: a"]),
        ["p.yaml:3:3: invalid YAML: \"-\" is only valid inside a block"]
    );
}

#[test]
fn error_empty_file() {
    // An empty file, or one holding only comments or an empty document, is an error.
    for text in [&[""][..], &["# nothing here"], &["---"]] {
        assert_eq!(
            errors(text),
            ["p.yaml:1:1: empty policy file: expected `domain` and `descriptors`"]
        );
    }
}

#[test]
fn error_missing_or_empty_domain() {
    // A file without a domain, or with an empty one, is refused at the mapping or the value.
    assert_eq!(errors(&["descriptors: []"]), ["p.yaml:1:1: missing required key `domain`"]);
    assert_eq!(
        errors(&["domain: ''", "descriptors: []"]),
        ["p.yaml:1:9: `domain` must not be empty"]
    );
    assert_eq!(errors(&["domain:", "descriptors: []"]), ["p.yaml:1:1: `domain` must not be empty"]);
}

#[test]
fn error_same_domain_in_two_files() {
    // A domain declared by two files is reported at the second, naming the first.
    let sources = [source("a.yaml", &["domain: rl"]), source("b.yaml", &["# again", "domain: rl"])];
    assert_eq!(
        errors_of(&sources),
        [
            "b.yaml:2:9: domain `rl` is already defined at a.yaml:1:9 (one file per domain, unless `[policy] merge_domains = true`)"
        ]
    );
}

#[test]
fn error_duplicate_composite_key() {
    // The same key and value twice at one level is ratelimit's "duplicate descriptor
    // composite key", reported at the second; the same key with another value is fine.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: k",
            "    value: v",
            "  - key: k",
            "    value: w",
            "  - key: k",
            "    value: v",
            "  - key: k",
            "    descriptors:",
            "      - key: n",
            "      - key: n",
            "  - key: k",
        ]),
        [
            "p.yaml:7:5: duplicate descriptor composite key `rl.k_v` (first at line 3)",
            "p.yaml:12:9: duplicate descriptor composite key `rl.k.n` (first at line 11)",
            "p.yaml:13:5: duplicate descriptor composite key `rl.k` (first at line 9)",
        ]
    );
}

#[test]
fn error_unlimited_with_limit_fields() {
    // `unlimited: true` refuses every field of a limit, each at its key.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: k",
            "    rate_limit:",
            "      unlimited: true",
            "      unit: second",
            "      requests_per_unit: 5",
            "      name: n",
        ]),
        [
            "p.yaml:6:7: `unit` cannot be combined with `unlimited: true`",
            "p.yaml:7:7: `requests_per_unit` cannot be combined with `unlimited: true`",
            "p.yaml:8:13: `name` cannot be combined with `unlimited: true`: there is no limit to name",
        ]
    );
}

#[test]
fn error_unit_and_window() {
    // A limit needs exactly one of `unit` and `window`, and `requests_per_unit`.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit:",
            "      requests_per_unit: 5",
            "  - key: b",
            "    rate_limit:",
            "      unit: second",
            "      window: 10s",
            "      requests_per_unit: 5",
            "  - key: c",
            "    rate_limit: {unit: second}",
        ]),
        [
            "p.yaml:4:5: a rate limit needs `unit` or `window` (or `unlimited: true`)",
            "p.yaml:9:7: `unit` and `window` are mutually exclusive; give one",
            "p.yaml:12:5: a rate limit needs `requests_per_unit`",
        ]
    );
}

#[test]
fn error_burst() {
    // A burst below the rate, or on an algorithm without a bucket, is refused.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit: {unit: second, requests_per_unit: 10, burst: 5}",
            "  - key: b",
            "    rate_limit: {unit: second, requests_per_unit: 10, burst: 20, algorithm: sliding_window}",
        ]),
        [
            "p.yaml:4:62: `burst` (5) must be at least `requests_per_unit` (10)",
            "p.yaml:6:55: `burst` applies only to `algorithm: token_bucket`, not `sliding_window`",
        ]
    );
}

#[test]
fn error_replaces() {
    // A limit may not replace itself (or a sibling limit of its descriptor), nor a name the
    // domain does not define; names are unique per domain; a replaces item needs a name.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit:",
            "      name: mine",
            "      unit: second",
            "      requests_per_unit: 1",
            "      replaces: [{name: mine}]",
            "  - key: b",
            "    rate_limits:",
            "      - {name: fast, unit: second, requests_per_unit: 1}",
            "      - {unit: day, requests_per_unit: 9, replaces: [{name: fast}]}",
            "  - key: c",
            "    rate_limit: {name: mine, unit: second, requests_per_unit: 1, replaces: [{name: ghost}, {}]}",
        ]),
        [
            "p.yaml:8:25: `replaces` names `mine`, a limit of this same descriptor: a limit cannot replace itself",
            "p.yaml:12:61: `replaces` names `fast`, a limit of this same descriptor: a limit cannot replace itself",
            "p.yaml:14:24: rate limit name `mine` is already used in domain `rl` at line 5",
            "p.yaml:14:84: `replaces` names `ghost`, but no rate limit in domain `rl` has that name",
            "p.yaml:14:92: a `replaces` item needs `name`",
        ]
    );
}

#[test]
fn error_rate_limit_and_rate_limits() {
    // `rate_limit` and `rate_limits` exclude each other, `rate_limits` needs an item, and
    // `unlimited` does not belong in it.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    rate_limits: [{unit: day, requests_per_unit: 9}]",
            "  - key: b",
            "    rate_limits: []",
            "  - key: c",
            "    rate_limits: [{unlimited: true}]",
        ]),
        [
            "p.yaml:5:5: `rate_limit` and `rate_limits` are mutually exclusive: list every limit under `rate_limits`",
            "p.yaml:7:18: `rate_limits` must list at least one limit",
            "p.yaml:9:20: `unlimited: true` is not allowed in `rate_limits`; write `rate_limit: {unlimited: true}`",
        ]
    );
}

#[test]
fn error_share_threshold_and_failure_mode() {
    // `share_threshold` needs a wildcard value, and `failure_mode` needs a limit to act on.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    value: exact",
            "    share_threshold: true",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "  - key: b",
            "    value: pre*",
            "    share_threshold: true",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "  - key: c",
            "    failure_mode: closed",
            "    descriptors:",
            "      - {key: d, rate_limit: {unit: second, requests_per_unit: 1}, failure_mode: shut}",
        ]),
        [
            "p.yaml:5:5: `share_threshold` needs a wildcard `value` (one containing `*`)",
            "p.yaml:12:5: `failure_mode` has no effect on a descriptor without `rate_limit` \
             (nested descriptors do not inherit it)",
            "p.yaml:14:82: unknown failure_mode `shut`; expected open or closed",
        ]
    );
}

#[test]
fn lease_block_resolves_against_the_defaults() {
    // A `lease` block sets the keys it gives and leaves the others at the defaults, the TTL
    // follows the lookahead, and a rule without the block (or with an empty one) gets
    // exactly the defaults.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: all",
        "    rate_limit: {unit: second, requests_per_unit: 100}",
        "    lease: {min_tokens: 10, max_tokens: 1000, lookahead: 100ms}",
        "  - key: some",
        "    rate_limits: [{unit: second, requests_per_unit: 1}]",
        "    lease:",
        "      max_tokens: 50",
        "  - key: none",
        "    rate_limit: {unit: second, requests_per_unit: 1}",
        "  - key: empty",
        "    rate_limit: {unit: second, requests_per_unit: 1}",
        "    lease: {}",
        "  - key: blank",
        "    rate_limit: {unit: second, requests_per_unit: 1}",
        "    lease:",
        "  - key: placeholder",
    ]);
    let all = matched(&set, "rl", &[("all", "x")]).lease;
    assert_eq!(
        (all.min_lease_tokens, all.max_lease_tokens, all.lookahead_ms, all.lease_ttl_ms),
        (10, 1_000, 100, 200)
    );
    assert_eq!(all, LeaseTuning::with_sizes(10, 1_000, 100).expect("valid"));
    let some = matched(&set, "rl", &[("some", "x")]).lease;
    assert_eq!(some, LeaseTuning { max_lease_tokens: 50, ..LeaseTuning::default() });
    for key in ["none", "empty", "blank"] {
        assert_eq!(matched(&set, "rl", &[(key, "x")]).lease, LeaseTuning::default(), "{key}");
    }
    assert!(set.rules().all(|rule| rule.lease.validate().is_ok()));
    let longest = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: a",
        "    rate_limit: {unit: second, requests_per_unit: 1}",
        "    lease: {min_tokens: 1, max_tokens: 1000000, lookahead: 500ms}",
    ]);
    let lease = matched(&longest, "rl", &[("a", "x")]).lease;
    assert_eq!((lease.max_lease_tokens, lease.lease_ttl_ms), (LEASE_TOKENS_MAX, 1_000));
}

#[test]
fn error_lease_values() {
    // Every bad `lease` value is reported at the value: unknown keys, non-integers, zero,
    // sizes out of order (also against a default), above the cap, and lookaheads that are
    // malformed, zero, or too long for the lease TTL cap.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {min_token: 10, ttl: 1s}",
            "  - key: b",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {min_tokens: ten, max_tokens: 2.5, lookahead: \"100\"}",
            "  - key: c",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {min_tokens: 0, max_tokens: -3}",
            "  - key: d",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {min_tokens: 20, max_tokens: 10}",
            "  - key: e",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {min_tokens: 600}",
            "  - key: f",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {max_tokens: 3}",
            "  - key: g",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {max_tokens: 1000001}",
            "  - key: h",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {lookahead: 0ms}",
            "  - key: i",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {lookahead: 501ms}",
            "  - key: j",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: {lookahead: 1s}",
            "  - key: k",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    lease: 100",
        ]),
        [
            "p.yaml:5:13: unknown key `min_token` in `lease`; expected one of: min_tokens, max_tokens, lookahead",
            "p.yaml:5:28: unknown key `ttl` in `lease`; expected one of: min_tokens, max_tokens, lookahead",
            "p.yaml:8:25: `min_tokens` must be a whole number, found `ten`",
            "p.yaml:8:42: `max_tokens` must be a whole number, found `2.5`",
            "p.yaml:8:58: invalid lookahead `100`: expected a whole number and one of ms, s, m, h, d (e.g. `250ms`)",
            "p.yaml:11:25: `min_tokens` must be at least 1",
            "p.yaml:11:40: `max_tokens` must not be negative, found `-3`",
            "p.yaml:14:25: `min_tokens` (20) must be at most `max_tokens` (10)",
            "p.yaml:17:25: `min_tokens` (600) must be at most `max_tokens` (500, the default)",
            "p.yaml:20:25: `min_tokens` (5, the default) must be at most `max_tokens` (3)",
            "p.yaml:23:25: `max_tokens` (1000001) must be at most 1000000",
            "p.yaml:26:24: `lookahead` must be at least 1ms",
            "p.yaml:29:24: `lookahead` of 501 ms would need a lease TTL of 1002 ms (2 x lookahead), \
             but a lease lives at most 1000 ms, so it can be at most 500ms",
            "p.yaml:32:24: `lookahead` of 1000 ms would need a lease TTL of 2000 ms (2 x lookahead), \
             but a lease lives at most 1000 ms, so it can be at most 500ms",
            "p.yaml:35:12: `lease` must be a mapping, found `100`",
        ]
    );
}

#[test]
fn error_lease_without_a_limit() {
    // `lease` needs tokens to lease: it is refused on a descriptor without a limit (children
    // do not inherit it) and on an `unlimited` rule, as `failure_mode` is without a limit.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    lease: {min_tokens: 10}",
            "    descriptors:",
            "      - {key: b, rate_limit: {unit: second, requests_per_unit: 1}}",
            "  - key: c",
            "    rate_limit: {unlimited: true}",
            "    lease: {max_tokens: 100}",
            "  - key: d",
            "    lease: {min_tokens: 0}",
        ]),
        [
            "p.yaml:4:5: `lease` has no effect on a descriptor without `rate_limit` \
             (nested descriptors do not inherit it)",
            "p.yaml:9:5: `lease` has no effect on an `unlimited` rule: it never leases tokens",
            "p.yaml:11:5: `lease` has no effect on a descriptor without `rate_limit` \
             (nested descriptors do not inherit it)",
            "p.yaml:11:25: `min_tokens` must be at least 1",
        ]
    );
}

#[test]
fn error_unknown_keys() {
    // An unknown key is an error at every level, listing the keys that are known.
    assert_eq!(
        errors(&[
            "domian: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limt: {unit: second, requests_per_unit: 1}",
            "    quota_mod: true",
            "    rate_limit:",
            "      unit: second",
            "      request_per_unit: 1",
            "      replaces: [{name: x, reason: y}]",
        ]),
        [
            "p.yaml:1:1: unknown key `domian` in the file; expected one of: domain, descriptors",
            "p.yaml:1:1: missing required key `domain`",
            "p.yaml:4:5: unknown key `rate_limt` in a descriptor; expected one of: key, value, rate_limit, \
             rate_limits, shadow_mode, rollout, enforce_after, quota_mode, detailed_metric, value_to_metric, share_threshold, metadata, \
             failure_mode, lease, regions, descriptors",
            "p.yaml:5:5: unknown key `quota_mod` in a descriptor; expected one of: key, value, rate_limit, \
             rate_limits, shadow_mode, rollout, enforce_after, quota_mode, detailed_metric, value_to_metric, share_threshold, metadata, \
             failure_mode, lease, regions, descriptors",
            "p.yaml:6:5: a rate limit needs `requests_per_unit`",
            "p.yaml:8:7: unknown key `request_per_unit` in `rate_limit`; expected one of: unit, requests_per_unit, \
             unlimited, name, replaces, algorithm, burst, window",
            "p.yaml:9:28: unknown key `reason` in a `replaces` item; expected one of: name",
        ]
    );
}

#[test]
fn error_wrong_types() {
    // A value of the wrong type is reported at the value, quoting what was found.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: [a]",
            "    shadow_mode: yes",
            "    rate_limit: {unit: second, requests_per_unit: \"10\"}",
            "  - key: b",
            "    descriptors: 5",
            "    rate_limit: [1]",
            "  - just a string",
        ]),
        [
            "p.yaml:3:10: `key` must be a string, found a list",
            "p.yaml:4:18: `shadow_mode` must be true or false, found `yes`",
            "p.yaml:5:51: `requests_per_unit` must be a whole number, found the string \"10\"",
            "p.yaml:7:18: `descriptors` must be a list, found `5`",
            "p.yaml:8:17: `rate_limit` must be a mapping, found a list",
            "p.yaml:9:5: a descriptor must be a mapping, found `just a string`",
        ]
    );
}

#[test]
fn error_bad_numbers_units_and_windows() {
    // Negative, fractional and oversized numbers, unknown units, algorithms and malformed
    // windows are each refused at the value.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - {key: a, rate_limit: {unit: second, requests_per_unit: -5}}",
            "  - {key: b, rate_limit: {unit: second, requests_per_unit: 1.5}}",
            "  - {key: c, rate_limit: {unit: second, requests_per_unit: 99999999999999999999}}",
            "  - {key: d, rate_limit: {unit: fortnight, requests_per_unit: 1}}",
            "  - {key: e, rate_limit: {window: 30x, requests_per_unit: 1}}",
            "  - {key: f, rate_limit: {window: 30, requests_per_unit: 1}}",
            "  - {key: g, rate_limit: {window: 99999999999999999999d, requests_per_unit: 1}}",
            "  - {key: h, rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}}",
        ]),
        [
            "p.yaml:3:60: `requests_per_unit` must not be negative, found `-5`",
            "p.yaml:4:60: `requests_per_unit` must be a whole number, found `1.5`",
            "p.yaml:5:60: `requests_per_unit` is too large: `99999999999999999999`",
            "p.yaml:6:33: unknown unit `fortnight`; expected second, minute, hour, day, week, month or year",
            "p.yaml:7:35: invalid window `30x`: expected a whole number and one of ms, s, m, h, d (e.g. `30s`)",
            "p.yaml:8:35: invalid window `30`: expected a whole number and one of ms, s, m, h, d (e.g. `30s`)",
            "p.yaml:9:35: window `99999999999999999999d` is too long",
            "p.yaml:10:74: unknown algorithm `leaky`; expected token_bucket, sliding_window or fixed_window",
        ]
    );
}

#[test]
fn error_limit_spec_ranges() {
    // LimitSpec's range errors are reported at the number that is out of range.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - {key: a, rate_limit: {window: 500d, requests_per_unit: 1}}",
            "  - {key: b, rate_limit: {window: 0s, requests_per_unit: 1}}",
            "  - {key: c, rate_limit: {unit: second, requests_per_unit: 2000000000000}}",
            "  - {key: d, rate_limit: {unit: second, requests_per_unit: 1, burst: 2000000000000}}",
            "  - {key: e, rate_limit: {unit: second, requests_per_unit: 0, burst: 5}}",
        ]),
        [
            "p.yaml:3:35: invalid limit: window must be between 1 ms and 34560000000 ms, got 43200000000 ms",
            "p.yaml:4:35: invalid limit: window must be between 1 ms and 34560000000 ms, got 0 ms",
            "p.yaml:5:60: invalid limit: requests per window must be between 0 and 1000000000000, got 2000000000000",
            "p.yaml:6:70: invalid limit: burst must be between 1 and 1000000000000 tokens, got 2000000000000",
            "p.yaml:7:70: invalid limit: a limit of 0 requests per window refuses every hit, so its burst must be 0 or left out, got 5",
        ]
    );
}

#[test]
fn error_missing_key() {
    // A descriptor without `key`, or with an empty one, is refused.
    assert_eq!(
        errors(&["domain: rl", "descriptors:", "  - value: x", "  - key: ''"]),
        [
            "p.yaml:3:5: descriptor is missing required key `key`",
            "p.yaml:4:10: `key` must not be empty"
        ]
    );
}

#[test]
fn error_yaml_structure() {
    // A second document, a key written twice, a non-mapping root and a custom tag are refused.
    assert_eq!(
        errors(&["domain: a", "---", "domain: b"]),
        ["p.yaml:2:1: a policy file holds one YAML document, found a second one (`---`)"]
    );
    assert_eq!(
        errors(&["domain: a", "descriptors: []", "domain: b"]),
        ["p.yaml:3:1: key `domain` appears twice in one mapping (first at line 1)"]
    );
    assert_eq!(
        errors(&["- domain: a"]),
        [
            "p.yaml:1:1: a policy file must be a mapping with `domain` and `descriptors`, found a list"
        ]
    );
    assert_eq!(errors(&["domain: !custom 'a'"]), ["p.yaml:1:9: unsupported YAML tag `!custom`"]);
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - {key: a, rate_limit: {unit: second, requests_per_unit: !!str 5}}"
        ]),
        ["p.yaml:3:66: `requests_per_unit` must be a whole number, found the string \"5\""]
    );
}

#[test]
fn error_alias_expansion_limit() {
    // Aliases that expand past the node budget ("billion laughs") are refused, not expanded.
    let mut lines = vec!["a0: &a0 [x, x, x, x, x, x, x, x, x, x]".to_owned()];
    for level in 1..8 {
        let previous = format!("*a{}", level - 1);
        let items = vec![previous; 10].join(", ");
        lines.push(format!("a{level}: &a{level} [{items}]"));
    }
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let reported = errors(&lines);
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(
        reported[0]
            .ends_with("more than 1000000 YAML nodes once aliases are expanded (input size limit)")
    );
}

#[test]
fn error_nesting_deeper_than_limit() {
    // Descriptors nest at most DESCRIPTOR_DEPTH_MAX deep; one more level is refused at the
    // `descriptors` key that opens it, and the deepest allowed level still matches.
    let nested = |depth: usize| {
        let mut lines = vec!["domain: rl".to_owned(), "descriptors:".to_owned()];
        for level in 1..=depth {
            let indent = " ".repeat(2 + 4 * (level - 1));
            lines.push(format!("{indent}- key: k{level}"));
            if level < depth {
                lines.push(format!("{indent}  descriptors:"));
            } else {
                lines.push(format!("{indent}  rate_limit: {{unit: second, requests_per_unit: 1}}"));
            }
        }
        lines
    };
    let deepest = nested(DESCRIPTOR_DEPTH_MAX);
    let set = parse(&deepest.iter().map(String::as_str).collect::<Vec<_>>());
    let keys: Vec<String> = (1..=DESCRIPTOR_DEPTH_MAX).map(|level| format!("k{level}")).collect();
    let pairs: Vec<(&str, &str)> = keys.iter().map(|key| (key.as_str(), "v")).collect();
    assert!(matches!(
        set.match_descriptor(
            "rl",
            &pairs.iter().map(|&(key, value)| Entry { key, value }).collect::<Vec<_>>()
        ),
        Match::Rule(_)
    ));

    let too_deep = nested(DESCRIPTOR_DEPTH_MAX + 1);
    assert_eq!(
        errors(&too_deep.iter().map(String::as_str).collect::<Vec<_>>()),
        ["p.yaml:34:65: descriptors nested deeper than 16 levels (input size limit)"]
    );
}

#[test]
fn error_too_many_rules() {
    // A set holds at most RULES_PER_SET_MAX descriptors over all files; the first one past
    // the limit is reported, once.
    let file = |name: &str, first: usize, count: usize| {
        let descriptors: String =
            (first..first + count).map(|index| format!("  - key: k{index}\n")).collect();
        PolicySource {
            name: format!("{name}.yaml"),
            text: format!("domain: {name}\ndescriptors:\n{descriptors}"),
        }
    };
    let at_limit = [file("a", 0, RULES_PER_SET_MAX / 2), file("b", 0, RULES_PER_SET_MAX / 2)];
    assert!(PolicySet::parse(&at_limit).is_ok());
    let past_limit = [file("a", 0, RULES_PER_SET_MAX / 2), file("b", 0, RULES_PER_SET_MAX / 2 + 2)];
    assert_eq!(
        errors_of(&past_limit),
        ["b.yaml:5003:5: more than 10000 descriptors in the policy set (input size limit)"]
    );
}

#[test]
fn all_errors_of_all_files_are_reported() {
    // Errors of several files come together, in file order and then by position, and a
    // valid file among them does not hide any.
    let sources = [
        source(
            "good.yaml",
            &[
                "domain: good",
                "descriptors:",
                "  - {key: a, rate_limit: {unit: second, requests_per_unit: 1}}",
            ],
        ),
        source(
            "bad.yaml",
            &[
                "domain: bad",
                "descriptors:",
                "  - key: a",
                "    rate_limit: {unit: decade, requests_per_unit: 1}",
                "  - key: b",
                "    shadow_mode: maybe",
            ],
        ),
        source("worse.yaml", &["domain: good", "descriptors:", "  - valeu: x"]),
        source("broken.yaml", &["domain: [unclosed"]),
    ];
    let reported = errors_of(&sources);
    assert_eq!(
        reported,
        [
            "bad.yaml:4:24: unknown unit `decade`; expected second, minute, hour, day, week, month or year",
            "bad.yaml:6:18: `shadow_mode` must be true or false, found `maybe`",
            "worse.yaml:1:9: domain `good` is already defined at good.yaml:1:9 (one file per domain, unless `[policy] merge_domains = true`)",
            "worse.yaml:3:5: unknown key `valeu` in a descriptor; expected one of: key, value, rate_limit, \
         rate_limits, shadow_mode, rollout, enforce_after, quota_mode, detailed_metric, value_to_metric, share_threshold, metadata, \
         failure_mode, lease, regions, descriptors",
            "worse.yaml:3:5: descriptor is missing required key `key`",
            "broken.yaml:1:9: invalid YAML: unclosed bracket '['",
        ]
    );
    match PolicySet::parse(&sources) {
        Err(errors) => assert_eq!(errors.to_string(), reported.join("\n")),
        Ok(_) => panic!("expected errors"),
    }
}

// Digest.

#[test]
fn digest_is_a_fixed_function_of_content() {
    // The digest of a known policy is a constant, so it agrees across processes, builds and
    // platforms; it ignores file names, comments, layout and file order.
    let lines = [
        "domain: rl",
        "descriptors:",
        "  - key: api_key",
        "    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}",
    ];
    let set = parse(&lines);
    assert_eq!(set.digest(), 0x8089_c20b_5034_3802);
    let relaid = [
        "# a comment",
        "domain: rl",
        "descriptors:",
        "  - key: api_key",
        "    rate_limit:",
        "      burst: 20",
        "      requests_per_unit: 10",
        "      unit: second",
    ];
    let relaid = match PolicySet::parse(&[
        source("elsewhere.yaml", &relaid),
        source("z.yaml", &["domain: z"]),
    ]) {
        Ok(set) => set,
        Err(errors) => panic!("{errors}"),
    };
    let reordered =
        match PolicySet::parse(&[source("z.yaml", &["domain: z"]), source("p.yaml", &lines)]) {
            Ok(set) => set,
            Err(errors) => panic!("{errors}"),
        };
    assert_eq!(relaid.digest(), reordered.digest());
    assert_ne!(relaid.digest(), set.digest(), "an added domain changes the digest");
}

#[test]
fn digest_sees_the_lease_block() {
    // A lease block that changes the tuning changes the digest, each number on its own; one
    // that spells out the defaults leases alike and digests as no block at all, which is
    // also the digest policies had before `lease` existed (the constant above).
    let with_lease = |lease: &str| {
        let mut lines = vec![
            "domain: rl",
            "descriptors:",
            "  - key: api_key",
            "    rate_limit: {unit: second, requests_per_unit: 10, burst: 20}",
        ];
        let line = format!("    lease: {lease}");
        if !lease.is_empty() {
            lines.push(&line);
        }
        parse(&lines).digest()
    };
    let absent = with_lease("");
    assert_eq!(absent, 0x8089_c20b_5034_3802);
    assert_eq!(with_lease("{min_tokens: 5, max_tokens: 500, lookahead: 250ms}"), absent);
    let changed = [
        with_lease("{min_tokens: 6}"),
        with_lease("{max_tokens: 499}"),
        with_lease("{lookahead: 249ms}"),
        with_lease("{min_tokens: 10, max_tokens: 1000, lookahead: 250ms}"),
    ];
    for (index, digest) in changed.iter().enumerate() {
        assert_ne!(*digest, absent, "block {index}");
        for other in &changed[index + 1..] {
            assert_ne!(digest, other);
        }
    }
}

// envoyproxy/ratelimit's keys beyond the README, and the node-wide load options.

#[test]
fn upstream_keys_carry_their_meaning() {
    // `quota_mode`, `metadata` (as JSON, plain scalars typed), `share_threshold` (the
    // pattern names the counter) and `value_to_metric` / `detailed_metric` (statistics
    // keys from runtime values) all load and land on the rule.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: service",
        "    value: service_1",
        "    quota_mode: true",
        "    rate_limit: {unit: minute, requests_per_unit: 1}",
        "    metadata:",
        "      service_with_quota:",
        "        name: \"service_1\"",
        "        weight: 2",
        "        on: true",
        "  - key: files",
        "    value: files/*",
        "    share_threshold: true",
        "    rate_limit: {unit: hour, requests_per_unit: 10}",
        "  - key: route",
        "    value_to_metric: true",
        "    descriptors:",
        "      - key: method",
        "        rate_limit: {unit: minute, requests_per_unit: 60}",
        "  - key: user",
        "    detailed_metric: true",
        "    rate_limit: {unit: minute, requests_per_unit: 60}",
    ]);
    let quota = matched(&set, "rl", &[("service", "service_1")]);
    assert!(quota.quota_mode);
    let metadata = serde_json::Value::Object(quota.metadata.clone().expect("metadata"));
    assert_eq!(
        metadata,
        serde_json::json!({"service_with_quota": {"name": "service_1", "weight": 2, "on": true}})
    );
    let files = matched(&set, "rl", &[("files", "files/a.pdf")]);
    assert_eq!(files.counter_value(0, "files/a.pdf"), "files/*");
    assert_eq!(files.stats_key(values(&["files/a.pdf"])), "files_files/*");
    let method = matched(&set, "rl", &[("route", "api"), ("method", "GET")]);
    assert_eq!(method.counter_value(0, "api"), "api", "no share_threshold: own counter");
    assert_eq!(method.stats_key(values(&["api", "GET"])), "route_api.method");
    let user = matched(&set, "rl", &[("user", "alice")]);
    assert_eq!(user.stats_key(values(&["alice"])), "user_alice");
    assert_eq!(user.stats_key(values(&[""])), "user", "an empty value adds nothing");
}

#[test]
fn share_threshold_levels_and_statistics_follow_upstream() {
    // Nested share_threshold levels each count under their pattern; a level without it
    // keeps the runtime value; share_threshold wins over value_to_metric in statistics.
    let set = parse(&[
        "domain: d",
        "descriptors:",
        "  - key: user",
        "    value: user/*",
        "    share_threshold: true",
        "    descriptors:",
        "      - key: file",
        "        value: file/*",
        "        descriptors:",
        "          - key: action",
        "            rate_limit: {unit: minute, requests_per_unit: 150}",
        "  - key: midroute",
        "    value: /api*v2",
        "    share_threshold: true",
        "    value_to_metric: true",
        "    rate_limit: {unit: minute, requests_per_unit: 80}",
    ]);
    let rule = matched(&set, "d", &[("user", "user/7"), ("file", "file/x"), ("action", "get")]);
    let counted: Vec<&str> = ["user/7", "file/x", "get"]
        .iter()
        .enumerate()
        .map(|(level, value)| rule.counter_value(level, value))
        .collect();
    assert_eq!(counted, ["user/*", "file/x", "get"]);
    assert_eq!(
        rule.stats_key(values(&["user/7", "file/x", "get"])),
        "user_user/*.file_file/*.action"
    );
    let mid = matched(&set, "d", &[("midroute", "/api/items/v2")]);
    assert_eq!(mid.stats_key(values(&["/api/items/v2"])), "midroute_/api*v2");
}

/// The options that make a migrating user's files count as upstream's.
fn upstream_options() -> LoadOptions {
    LoadOptions { merge_domains: true, default_algorithm: Algorithm::FixedWindow }
}

#[test]
fn default_algorithm_applies_to_limits_that_name_none() {
    // With `fixed_window` as the default, an unchanged upstream limit is a fixed window;
    // a limit that names its algorithm, or sets a burst, keeps what it says.
    let sources = [source(
        "p.yaml",
        &[
            "domain: d",
            "descriptors:",
            "  - {key: a, rate_limit: {unit: minute, requests_per_unit: 5}}",
            "  - {key: b, rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}}",
            "  - {key: c, rate_limit: {unit: minute, requests_per_unit: 5, burst: 10}}",
        ],
    )];
    let plain = PolicySet::parse(&sources).expect("valid");
    let upstream = PolicySet::parse_with(&sources, upstream_options()).expect("valid");
    let algorithm_of =
        |set: &PolicySet, key: &str| matched(set, "d", &[(key, "v")]).limits[0].spec.algorithm;
    assert_eq!(algorithm_of(&plain, "a"), Algorithm::TokenBucket);
    assert_eq!(algorithm_of(&upstream, "a"), Algorithm::FixedWindow);
    assert_eq!(algorithm_of(&upstream, "b"), Algorithm::SlidingWindow);
    assert_eq!(algorithm_of(&upstream, "c"), Algorithm::TokenBucket);
    assert_eq!(upstream.default_algorithm(), Algorithm::FixedWindow);
    // Counting differs, so the digests must.
    assert_ne!(plain.digest(), upstream.digest());
    let merge_only = PolicySet::parse_with(
        &sources,
        LoadOptions { merge_domains: true, default_algorithm: Algorithm::TokenBucket },
    )
    .expect("valid");
    assert_eq!(merge_only.digest(), plain.digest(), "merging one file changes nothing");
}

#[test]
fn merge_domains_joins_files_and_still_refuses_duplicates() {
    // Without the option a domain in two files is an error; with it their descriptors join,
    // each rule remembering its own file, and a top-level composite key declared in both
    // files is an error at the later one.
    let first = source(
        "one.yaml",
        &[
            "domain: d",
            "descriptors:",
            "  - {key: a, rate_limit: {unit: minute, requests_per_unit: 1}}",
        ],
    );
    let second = source(
        "two.yaml",
        &[
            "domain: d",
            "descriptors:",
            "  - {key: b, rate_limit: {unit: minute, requests_per_unit: 2}}",
        ],
    );
    assert_eq!(
        errors_of(&[first.clone(), second.clone()]),
        [
            "two.yaml:1:9: domain `d` is already defined at one.yaml:1:9 (one file per domain, unless \
          `[policy] merge_domains = true`)"
        ]
    );
    let merged =
        PolicySet::parse_with(&[first.clone(), second], upstream_options()).expect("valid");
    assert_eq!(matched(&merged, "d", &[("a", "x")]).file, "one.yaml");
    assert_eq!(matched(&merged, "d", &[("b", "x")]).file, "two.yaml");
    let clash = source(
        "three.yaml",
        &[
            "domain: d",
            "descriptors:",
            "  - {key: a, rate_limit: {unit: minute, requests_per_unit: 3}}",
        ],
    );
    match PolicySet::parse_with(&[first, clash], upstream_options()) {
        Ok(_) => panic!("a composite key in two merged files must be refused"),
        Err(errors) => assert_eq!(
            errors.to_string(),
            "three.yaml:3:1: duplicate descriptor composite key `d.a` (first at one.yaml:3)"
        ),
    }
}

#[test]
fn error_metadata_must_be_a_mapping() {
    // `metadata` is a mapping, as upstream's `google.protobuf.Struct`.
    assert_eq!(
        errors(&["domain: d", "descriptors:", "  - {key: a, metadata: [1, 2]}"]),
        ["p.yaml:3:24: `metadata` must be a mapping, found a list"]
    );
}

#[test]
fn header_policy_names_are_fixed_when_the_policy_loads() {
    // A limit's own name, else the rule's path, numbered when the rule has several limits.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: two",
        "    rate_limits:",
        "      - {unit: second, requests_per_unit: 10}",
        "      - {unit: hour, requests_per_unit: 100, name: hourly}",
        "  - key: one",
        "    rate_limit: {unit: minute, requests_per_unit: 5}",
    ]);
    let two = &matched(&set, "rl", &[("two", "x")]).limits;
    assert_eq!(two[0].header, PolicyHeader::new("two#0", 10, 1_000));
    assert_eq!(two[1].header, PolicyHeader::new("hourly", 100, 3_600_000));
    let one = &matched(&set, "rl", &[("one", "x")]).limits;
    assert_eq!(one[0].header, PolicyHeader::new("one", 5, 60_000));
}

#[test]
fn regions_slice_the_limits_per_region() {
    // A rule with `regions` keeps its global limit in the set; each region's view carries
    // its slice of the rate and of the burst, a region not named gets a limit of 0, and
    // rules without `regions` are the same in every region.
    let set = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: global",
        "    rate_limit: {unit: second, requests_per_unit: 1000, burst: 2000}",
        "    regions: {us-east: 60%, eu-central: 30%, us-west: 10%}",
        "  - key: thirds",
        "    rate_limit: {unit: second, requests_per_unit: 100}",
        "    regions:",
        "      a: 33.34%",
        "      b: 33.33%",
        "      c: 33.33%",
        "  - key: local",
        "    rate_limit: {unit: second, requests_per_unit: 5}",
    ]);
    let global = |set: &PolicySet, key: &str| {
        let spec = matched(set, "rl", &[(key, "x")]).limits[0].spec;
        (spec.requests_per_window, spec.burst_tokens)
    };
    assert_eq!(global(&set, "global"), (1_000, 2_000));
    let east = set.clone().for_region("us-east");
    assert_eq!(global(&east, "global"), (600, 1_200));
    assert_eq!(global(&set.clone().for_region("us-west"), "global"), (100, 200));
    assert_eq!(global(&set.clone().for_region("elsewhere"), "global"), (0, 0));
    let thirds: u64 = ["a", "b", "c"]
        .iter()
        .map(|region| global(&set.clone().for_region(region), "thirds").0)
        .sum();
    assert_eq!(thirds, 100, "the slices add up to the global limit");
    assert_eq!(global(&east, "local"), (5, 5));
    assert_eq!(east.digest(), set.digest());
    // Once tokens moved, the region's ledger slice replaces its policy slice (burst scaled
    // alike, capped at the global limit); limits the ledger does not name keep the policy's.
    let moved = BTreeMap::from([
        (SliceKey::of("rl", "global", 0), 900),
        (SliceKey::of("rl", "thirds", 0), 5_000),
    ]);
    let moved = set.clone().for_region_slices("us-east", &moved);
    assert_eq!(global(&moved, "global"), (900, 1_800));
    assert_eq!(global(&moved, "thirds"), (100, 100));
    // The headers show the slice the node enforces.
    let header = |set: &PolicySet| matched(set, "rl", &[("global", "x")]).limits[0].header.clone();
    assert_eq!(header(&east), PolicyHeader::new("global", 600, 1_000));
    assert_eq!(header(&moved), PolicyHeader::new("global", 900, 1_000));
    assert_eq!(global(&set.clone().for_region_slices("a", &BTreeMap::new()), "thirds").0, 34);
    let unsliced = parse(&[
        "domain: rl",
        "descriptors:",
        "  - key: global",
        "    rate_limit: {unit: second, requests_per_unit: 1000, burst: 2000}",
        "  - key: thirds",
        "    rate_limit: {unit: second, requests_per_unit: 100}",
        "  - key: local",
        "    rate_limit: {unit: second, requests_per_unit: 5}",
    ]);
    assert_ne!(unsliced.digest(), set.digest(), "the shares are part of the digest");
}

#[test]
fn error_regions_values() {
    // Every bad `regions` is reported where it was written: shares that do not add up to
    // 100 % (at the key), malformed or too large shares and bad region names (at each),
    // an empty or non-mapping value, and `regions` where there is no limit to slice.
    assert_eq!(
        errors(&[
            "domain: rl",
            "descriptors:",
            "  - key: a",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    regions: {us-east: 60%, eu: 30%}",
            "  - key: b",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    regions: {us-east: 60, eu: 40.001%, we st: 101%, x: 0.5%}",
            "  - key: c",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    regions: {}",
            "  - key: d",
            "    rate_limit: {unit: second, requests_per_unit: 1}",
            "    regions: [us-east]",
            "  - key: e",
            "    regions: {us-east: 100%}",
            "  - key: f",
            "    rate_limit: {unlimited: true}",
            "    regions: {us-east: 100%}",
        ]),
        [
            "p.yaml:5:5: the shares of `regions` add up to 90%, not 100%",
            "p.yaml:8:24: the share of region `us-east` must be a percentage from 0% to 100% \
             with at most two decimals, e.g. `60%` or `12.5%`",
            "p.yaml:8:32: the share of region `eu` must be a percentage from 0% to 100% with \
             at most two decimals, e.g. `60%` or `12.5%`",
            "p.yaml:8:41: region `we st`: a region name may only use A-Z, a-z, 0-9, `_`, `.` and `-`",
            "p.yaml:8:48: the share of region `we st` must be a percentage from 0% to 100% \
             with at most two decimals, e.g. `60%` or `12.5%`",
            "p.yaml:11:14: `regions` must name at least one region",
            "p.yaml:14:14: `regions` must be a mapping, found a list",
            "p.yaml:16:5: `regions` has no effect on a descriptor without `rate_limit` \
             (nested descriptors do not inherit it)",
            "p.yaml:19:5: `regions` has no effect on an `unlimited` rule: it has no limit to slice",
        ]
    );
}

/// Every rollout stage loads from one line, `shadow_mode: true` still means shadow, and a
/// node resolves a canary to enforce or warn; the stages after shadow change the digest,
/// the others keep it.
#[test]
fn rollout_stages_load_and_resolve_per_node() {
    let policy = |rollout: &str| {
        parse(&[
            "domain: ro",
            "descriptors:",
            "  - key: k",
            rollout,
            "    enforce_after: 2027-01-08",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
        ])
    };
    let rule = |set: &PolicySet| matched(set, "ro", &[("k", "v")]).clone();
    let warn = policy("    rollout: warn");
    assert_eq!(rule(&warn).rollout, Rollout::Warn);
    assert_eq!(rule(&warn).stage, Stage::Warn);
    assert_eq!(rule(&warn).enforce_after.as_deref(), Some("2027-01-08"));
    let canary = policy("    rollout: {canary: 12.5%}");
    assert_eq!(rule(&canary).rollout, Rollout::Canary { basis_points: 1_250 });
    assert_eq!(rule(&canary).stage, Stage::Warn, "outside any node, no canary");
    let nodes: Vec<String> = (0..400).map(|index| format!("node-{index}")).collect();
    let enforcing = nodes
        .iter()
        .filter(|node| rule(&canary.clone().for_node(node)).stage == Stage::Enforce)
        .count();
    assert!((25..=75).contains(&enforcing), "12.5 % of 400 nodes, got {enforcing}");
    let plain = parse(&[
        "domain: ro",
        "descriptors:",
        "  - key: k",
        "    rate_limit: {unit: minute, requests_per_unit: 5}",
    ]);
    let enforce = parse(&[
        "domain: ro",
        "descriptors:",
        "  - key: k",
        "    rollout: enforce",
        "    rate_limit: {unit: minute, requests_per_unit: 5}",
    ]);
    assert_eq!(rule(&enforce).stage, Stage::Enforce);
    assert_eq!(enforce.digest(), plain.digest(), "an explicit default digests as its absence");
    let shadow = |line: &str| {
        parse(&[
            "domain: ro",
            "descriptors:",
            "  - key: k",
            line,
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
        ])
    };
    let written = shadow("    rollout: shadow");
    let upstream = shadow("    shadow_mode: true");
    assert_eq!(rule(&written).stage, Stage::Shadow);
    assert_eq!(written.digest(), upstream.digest(), "two spellings of one stage");
    assert_ne!(warn.digest(), plain.digest());
    assert_ne!(warn.digest(), canary.digest());
    assert_ne!(policy("    rollout: {canary: 12%}").digest(), canary.digest());
}

/// Bad rollouts are reported where they are written.
#[test]
fn rollout_errors_point_at_the_value() {
    assert_eq!(
        errors(&[
            "domain: ro",
            "descriptors:",
            "  - key: a",
            "    rollout: canary",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
            "  - key: b",
            "    rollout: {canary: 120%}",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
            "  - key: c",
            "    rollout: {percent: 5%}",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
            "  - key: d",
            "    shadow_mode: true",
            "    rollout: warn",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
            "  - key: e",
            "    rollout: warn",
            "    enforce_after: 2027-02-30",
            "    rate_limit: {unit: minute, requests_per_unit: 5}",
            "  - key: g",
            "    rollout: warn",
        ]),
        [
            "p.yaml:4:14: unknown rollout `canary`; expected shadow, warn, {canary: P%} or enforce",
            "p.yaml:7:23: the canary's share must be a percentage from 0% to 100% with at most two \
             decimals, e.g. `5%`",
            "p.yaml:10:14: `rollout` mapping must be `{canary: P%}`; expected shadow, warn, \
             {canary: P%} or enforce",
            "p.yaml:10:15: unknown key `percent` in `rollout`; expected one of: canary",
            "p.yaml:14:5: `rollout` and `shadow_mode: true` are mutually exclusive: write \
             `rollout: shadow`",
            "p.yaml:18:20: `enforce_after` must be a day written `YYYY-MM-DD`, found `2027-02-30`",
            "p.yaml:21:5: `rollout` has no effect on a descriptor without `rate_limit` (nested \
             descriptors do not inherit it)",
        ]
    );
}

/// A policy written as a Kubernetes resource loads as its `spec` would alone, with the same
/// digest (where a policy was written is not part of it); extra metadata is Kubernetes'.
#[test]
fn a_kubernetes_resource_loads_as_its_spec() {
    let plain = parse(&[
        "domain: k8s",
        "descriptors:",
        "  - key: tenant",
        "    rate_limit: {unit: minute, requests_per_unit: 5}",
    ]);
    let resource = parse(&[
        "apiVersion: quotamesh.io/v1",
        "kind: RateLimitPolicy",
        "metadata:",
        "  name: tenants",
        "  labels: {team: platform}",
        "spec:",
        "  domain: k8s",
        "  descriptors:",
        "    - key: tenant",
        "      rate_limit: {unit: minute, requests_per_unit: 5}",
    ]);
    assert_eq!(resource.digest(), plain.digest());
    assert_eq!(matched(&resource, "k8s", &[("tenant", "t")]).line, 9);
}

/// A resource's own fields are checked, each error where it is written.
#[test]
fn a_kubernetes_resource_names_its_api_kind_and_name() {
    assert_eq!(
        errors(&[
            "apiVersion: quotamesh.io/v2",
            "kind: RateLimit",
            "metadata: {labels: {a: b}}",
            "spec:",
            "  domain: k8s",
            "  descriptors: []",
            "status: {}",
        ]),
        [
            "p.yaml:1:13: `apiVersion` must be `quotamesh.io/v1`, found `quotamesh.io/v2`",
            "p.yaml:2:7: `kind` must be `RateLimitPolicy`, found `RateLimit`",
            "p.yaml:3:11: missing required key `metadata.name`",
            "p.yaml:7:1: unknown key `status` in a RateLimitPolicy resource; expected one of: \
             apiVersion, kind, metadata, spec",
        ]
    );
    assert_eq!(
        errors(&["apiVersion: quotamesh.io/v1", "kind: RateLimitPolicy", "metadata: {name: x}"]),
        ["p.yaml:1:1: missing required key `spec`: the policy"]
    );
}

/// The shipped CustomResourceDefinition (`cluster/k8s/`) names the resource quotamesh reads
/// and every field the loader knows, no more: a field added to one is added to the other.
#[test]
fn the_kubernetes_schema_follows_the_loader() {
    use std::collections::BTreeSet;

    use super::load::{
        DESCRIPTOR_FIELDS, LEASE_FIELDS, LIMIT_FIELDS, RESOURCE_API_VERSION, RESOURCE_KIND,
        ROOT_FIELDS,
    };
    let crd: serde_json::Value =
        serde_saphyr::from_str(include_str!("../../../cluster/k8s/ratelimitpolicy-crd.yaml"))
            .expect("the CRD parses");
    let version = &crd["spec"]["versions"][0];
    assert_eq!(
        format!(
            "{}/{}",
            crd["spec"]["group"].as_str().expect("group"),
            version["name"].as_str().expect("name")
        ),
        RESOURCE_API_VERSION
    );
    assert_eq!(crd["spec"]["names"]["kind"], RESOURCE_KIND);
    let keys = |schema: &serde_json::Value| -> BTreeSet<String> {
        schema["properties"].as_object().expect("properties").keys().cloned().collect()
    };
    let names = |fields: &[&str]| -> BTreeSet<String> {
        fields.iter().map(|field| (*field).to_owned()).collect()
    };
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(keys(spec), names(&ROOT_FIELDS));
    let descriptor = &spec["properties"]["descriptors"]["items"];
    assert_eq!(keys(descriptor), names(&DESCRIPTOR_FIELDS));
    let fields = &descriptor["properties"];
    assert_eq!(keys(&fields["rate_limit"]), names(&LIMIT_FIELDS));
    assert_eq!(keys(&fields["rate_limits"]["items"]), names(&LIMIT_FIELDS));
    assert_eq!(keys(&fields["lease"]), names(&LEASE_FIELDS));
}

//! The shipped Prometheus alert rules are well formed and name only metrics the node (or
//! the canary audit) exports, and the bypass alert says what the issue asks: more than 0.5 % of decisions
//! for 60 s.

use std::collections::BTreeSet;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    groups: Vec<Group>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Group {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(rename = "for")]
    for_duration: String,
    labels: std::collections::BTreeMap<String, String>,
    annotations: std::collections::BTreeMap<String, String>,
}

/// Metric names in a PromQL expression (quotamesh's all start with `quotamesh_`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("quotamesh_"))
        .map(str::to_owned)
        .collect()
}

/// Whether `name` is registered under its full name, quoted, in `registered`, or is a series
/// (`_bucket`, `_sum`, `_count`) of a histogram registered so.
fn is_registered(registered: &str, name: &str) -> bool {
    let quoted = |name: &str| registered.contains(&format!("\"{name}\""));
    quoted(name)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| name.strip_suffix(suffix))
            .any(quoted)
}

#[test]
fn alert_rules_name_exported_metrics() {
    let text = include_str!("../cluster/alerts/quotamesh.rules.yml");
    let file: RuleFile = serde_saphyr::from_str(text).expect("the rules file parses");
    // The node's metrics, and the canary audit's (its own process).
    let registered =
        [include_str!("../src/metrics.rs"), include_str!("../src/cli/audit.rs")].concat();
    let mut alerts = BTreeSet::new();
    for group in &file.groups {
        assert!(!group.name.is_empty());
        for rule in &group.rules {
            assert!(alerts.insert(rule.alert.clone()), "alert {} twice", rule.alert);
            assert!(rule.labels.contains_key("severity"), "{} has a severity", rule.alert);
            assert!(rule.annotations.contains_key("summary"), "{} has a summary", rule.alert);
            let names = metric_names(&rule.expr);
            assert!(!names.is_empty(), "{} reads a quotamesh metric", rule.alert);
            for name in names {
                // Every metric is registered under its full name, quoted, in metrics.rs.
                assert!(
                    is_registered(&registered, &name),
                    "{}: {name} is not registered in src/metrics.rs or src/cli/audit.rs",
                    rule.alert
                );
            }
        }
    }
    let bypass = file
        .groups
        .iter()
        .flat_map(|group| &group.rules)
        .find(|rule| rule.alert == "QuotameshRateLimitBypassed")
        .expect("the bypass alert");
    assert_eq!(bypass.for_duration, "60s");
    assert!(bypass.expr.contains("> 0.005"), "0.5 % of decisions: {}", bypass.expr);
    assert_eq!(
        metric_names(&bypass.expr),
        BTreeSet::from([
            "quotamesh_rate_limit_bypassed_total".to_owned(),
            "quotamesh_rls_decisions_total".to_owned()
        ])
    );
}

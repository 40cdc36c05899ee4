//! What changes between two policy sets, rule by rule, in words (`quotamesh policy diff`):
//! rules are matched by domain and path, and each is described by everything that decides
//! its answers ([`describe`]). Pure.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::load::UNITS;
use super::{FailureMode, PolicySet, Rollout, Rule};
use crate::core::lease::LeaseTuning;
use crate::core::rate::Algorithm;

/// One rule's change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleChange {
    /// Only in the new set.
    Added {
        /// `domain/path`.
        rule: String,
        /// The rule, described.
        now: String,
    },
    /// Only in the old set.
    Removed {
        /// `domain/path`.
        rule: String,
        /// The rule, described.
        was: String,
    },
    /// In both, described differently.
    Changed {
        /// `domain/path`.
        rule: String,
        /// As it was.
        was: String,
        /// As it is now.
        now: String,
    },
}

/// The rules of `new` that are not in `old`, those gone, and those changed, in domain and
/// path order.
#[must_use]
pub fn diff(old: &PolicySet, new: &PolicySet) -> Vec<RuleChange> {
    let index = |set: &PolicySet| -> BTreeMap<String, String> {
        set.rules().map(|rule| (format!("{}/{}", rule.domain, rule.path), describe(rule))).collect()
    };
    let (old, mut new) = (index(old), index(new));
    let mut changes = Vec::new();
    for (rule, was) in old {
        match new.remove(&rule) {
            None => changes.push(RuleChange::Removed { rule, was }),
            Some(now) if now != was => changes.push(RuleChange::Changed { rule, was, now }),
            Some(_) => {}
        }
    }
    changes.extend(new.into_iter().map(|(rule, now)| RuleChange::Added { rule, now }));
    changes.sort_by(|left, right| name(left).cmp(name(right)));
    changes
}

fn name(change: &RuleChange) -> &str {
    match change {
        RuleChange::Added { rule, .. }
        | RuleChange::Removed { rule, .. }
        | RuleChange::Changed { rule, .. } => rule,
    }
}

/// A rule in one line, with everything that decides its answers: `20 per minute
/// fixed_window "per_key"; failure_mode closed; rollout warn; enforce_after 2027-01-08`. Settings at their
/// defaults are left out.
#[must_use]
pub fn describe(rule: &Rule) -> String {
    let mut text = String::new();
    if rule.unlimited {
        text.push_str("unlimited");
    } else if rule.limits.is_empty() {
        text.push_str("no limit");
    }
    for (index, limit) in rule.limits.iter().enumerate() {
        if index > 0 {
            text.push_str(" and ");
        }
        let spec = &limit.spec;
        let algorithm = spec.algorithm.name();
        let unit = limit.unit.and_then(|unit| UNITS.iter().find(|(_, known)| *known == unit));
        match unit {
            Some((unit, _)) => {
                let _ = write!(text, "{} per {unit} {algorithm}", spec.requests_per_window);
            }
            None => {
                let _ = write!(
                    text,
                    "{} per {}ms {algorithm}",
                    spec.requests_per_window, spec.window_ms
                );
            }
        }
        if spec.algorithm == Algorithm::TokenBucket && spec.burst_tokens != spec.requests_per_window
        {
            let _ = write!(text, " burst {}", spec.burst_tokens);
        }
        if let Some(name) = &limit.name {
            let _ = write!(text, " \"{name}\"");
        }
    }
    if rule.failure_mode == FailureMode::Closed {
        text.push_str("; failure_mode closed");
    }
    match rule.rollout {
        Rollout::Enforce => {}
        Rollout::Shadow => text.push_str("; rollout shadow"),
        Rollout::Warn => text.push_str("; rollout warn"),
        Rollout::Canary { basis_points } => {
            let _ =
                write!(text, "; rollout canary {}.{:02}%", basis_points / 100, basis_points % 100);
        }
    }
    if let Some(day) = &rule.enforce_after {
        let _ = write!(text, "; enforce_after {day}");
    }
    if rule.quota_mode {
        text.push_str("; quota_mode");
    }
    if !rule.replaces.is_empty() {
        let _ = write!(text, "; replaces {}", rule.replaces.join(", "));
    }
    if let Some(regions) = &rule.regions {
        let shares: Vec<String> = regions
            .iter()
            .map(|(region, share)| format!("{region} {}.{:02}%", share / 100, share % 100))
            .collect();
        let _ = write!(text, "; regions {}", shares.join(", "));
    }
    if rule.lease != LeaseTuning::default() {
        let lease = &rule.lease;
        let _ = write!(
            text,
            "; lease {}..{} tokens, lookahead {}ms",
            lease.min_lease_tokens, lease.max_lease_tokens, lease.lookahead_ms
        );
    }
    if let Some(level) = rule.levels.last() {
        if level.share_threshold {
            text.push_str("; share_threshold");
        }
        if level.value_to_metric {
            text.push_str("; value_to_metric");
        }
    }
    if rule.detailed_metric {
        text.push_str("; detailed_metric");
    }
    if let Some(metadata) = &rule.metadata {
        let _ = write!(text, "; metadata {}", serde_json::Value::Object(metadata.clone()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::super::PolicySource;
    use super::*;

    fn set(text: &str) -> PolicySet {
        PolicySet::parse(&[PolicySource { name: "p.yaml".into(), text: text.into() }])
            .expect("a valid policy")
    }

    const BASE: &str = "
domain: d
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: b
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 20, name: per_b, algorithm: fixed_window}
";

    /// Each kind of change is named once, in rule order, with both descriptions; the same
    /// set has none.
    #[test]
    fn a_diff_names_added_removed_and_changed_rules() {
        let base = set(BASE);
        assert_eq!(diff(&base, &base), []);
        let changed = set(&format!(
            "{}  - key: c\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n",
            BASE.replace("requests_per_unit: 5}", "requests_per_unit: 5}\n    rollout: warn")
                .replace("  - key: b\n", "  - key: bb\n")
        ));
        assert_eq!(
            diff(&base, &changed),
            [
                RuleChange::Changed {
                    rule: "d/a".into(),
                    was: "5 per second token_bucket".into(),
                    now: "5 per second token_bucket; rollout warn".into(),
                },
                RuleChange::Removed {
                    rule: "d/b".into(),
                    was: "20 per minute fixed_window \"per_b\"; failure_mode closed".into(),
                },
                RuleChange::Added {
                    rule: "d/bb".into(),
                    now: "20 per minute fixed_window \"per_b\"; failure_mode closed".into(),
                },
                RuleChange::Added { rule: "d/c".into(), now: "1 per hour token_bucket".into() },
            ]
        );
    }
}

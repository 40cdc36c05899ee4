//! The RLS over-admission checker (C7 of the fault-testing plan), per rule: the hits the
//! nodes admitted (`ok` decisions `OK`, counted in an interval only when the whole call lies
//! in it, so admissions are never over-counted) must stay within what the region's bucket
//! can have granted plus the tokens outside the ledger that the nodes export:
//!
//! ```text
//! A(I) <= C + R x |I| + B                               fail-closed rules
//! A(I) <= C + R x |I| + B + m x (C + R x |I|)           fail-open rules
//! ```
//!
//! C is the bucket's capacity, R its rate, B the drift bound the nodes export
//! (`quotamesh_lease_drift_bound_tokens`, the largest value seen in any metrics snapshot),
//! m the fallback multiplier: while nodes are cut from the ledger a fail-open rule admits
//! from local fallback buckets whose shares add up to at most m x the rule. Checked over
//! every interval of `window_ms` starting at an admission, and over the whole run.
//! A rule whose bound no node exported cannot be judged (unknown).

use super::CheckResult;
use crate::history::{Event, EventType, Function, operations};

/// What the checker needs to know of one rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleModel {
    /// The descriptor key its hits carry.
    pub key: String,
    pub capacity_tokens: u64,
    pub rate_per_second: u64,
    pub fail_open: bool,
    pub fallback_multiplier_permille: u64,
    /// The nodes' exported drift bound; `None` when no snapshot had it.
    pub drift_bound_tokens: Option<u64>,
}

impl RuleModel {
    /// The most admissions any interval of `length_ns` may hold.
    pub fn bound_tokens(&self, length_ns: u64, drift_bound_tokens: u64) -> u64 {
        let refill = u128::from(self.rate_per_second) * u128::from(length_ns) / 1_000_000_000_u128;
        let bucket = u128::from(self.capacity_tokens) + refill;
        let fallback = if self.fail_open {
            bucket * u128::from(self.fallback_multiplier_permille) / 1_000
        } else {
            0
        };
        u64::try_from(bucket + fallback + u128::from(drift_bound_tokens)).unwrap_or(u64::MAX)
    }
}

/// Checks every rule over intervals of `window_ms` and over the whole run.
pub fn check(events: &[Event], rules: &[RuleModel], window_ms: u64) -> Vec<CheckResult> {
    let operations = operations(events);
    rules
        .iter()
        .map(|rule| {
            let mut result = CheckResult::new(&format!("admissions-{}", rule.key));
            let Some(drift_bound_tokens) = rule.drift_bound_tokens else {
                result.unknown(format!("no node exported the drift bound of rule {}", rule.key));
                return result;
            };
            // Each admission's [invoke, completion], by invoke time.
            let mut admitted: Vec<(u64, u64)> = operations
                .iter()
                .filter(|operation| {
                    operation.invoke.f == Function::Check
                        && operation.invoke.value.descriptor.as_deref() == Some(rule.key.as_str())
                        && operation.outcome() == EventType::Ok
                        && operation.result().admitted == Some(true)
                })
                .map(|operation| (operation.invoke.time_ns, operation.completed_ns()))
                .collect();
            admitted.sort_unstable();
            result.checked = admitted.len() as u64;
            let window_ns = window_ms.saturating_mul(1_000_000);
            let bound = rule.bound_tokens(window_ns, drift_bound_tokens);
            let mut worst = (0_u64, 0_u64);
            for (position, (start_ns, _)) in admitted.iter().enumerate() {
                let end_ns = start_ns.saturating_add(window_ns);
                let inside = admitted[position..]
                    .iter()
                    .take_while(|(invoke_ns, _)| *invoke_ns <= end_ns)
                    .filter(|(_, completed_ns)| *completed_ns <= end_ns)
                    .count() as u64;
                if inside > worst.0 {
                    worst = (inside, *start_ns);
                }
            }
            if worst.0 > bound {
                result.problem(format!(
                    "rule {}: {} admitted in the {window_ms} ms from {:.3} s, above the bound {bound}",
                    rule.key,
                    worst.0,
                    worst.1 as f64 / 1e9
                ));
            }
            if let (Some(first), Some(last)) =
                (admitted.first(), admitted.iter().map(|(_, end)| *end).max())
            {
                let whole = rule.bound_tokens(last.saturating_sub(first.0), drift_bound_tokens);
                if admitted.len() as u64 > whole {
                    result.problem(format!(
                        "rule {}: {} admitted over the run, above the bound {whole}",
                        rule.key,
                        admitted.len()
                    ));
                }
            }
            result
        })
        .collect()
}

/// The largest `quotamesh_lease_drift_bound_tokens` of `rule` in `domain` across metrics
/// snapshots (Prometheus text), if any has it.
pub fn drift_bound_from_metrics(snapshots: &[String], domain: &str, rule: &str) -> Option<u64> {
    let domain_label = format!("domain=\"{domain}\"");
    let rule_label = format!("rule=\"{rule}\"");
    snapshots
        .iter()
        .flat_map(|text| text.lines())
        .filter(|line| line.starts_with("quotamesh_lease_drift_bound_tokens{"))
        .filter(|line| line.contains(&domain_label) && line.contains(&rule_label))
        .filter_map(|line| line.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .filter(|value| value.is_finite() && *value >= 0.0)
        .map(|value| value as u64)
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;
    use crate::history::OpValue;
    use crate::history::tests::HistoryBuilder;

    fn rule(fail_open: bool) -> RuleModel {
        RuleModel {
            key: "r".into(),
            capacity_tokens: 20,
            rate_per_second: 20,
            fail_open,
            fallback_multiplier_permille: 1_000,
            drift_bound_tokens: Some(10),
        }
    }

    /// `admitted` hits on rule `r`, spread evenly over `span_ms`, plus as many refused.
    fn history(admitted: u64, span_ms: u64) -> Vec<Event> {
        let mut history = HistoryBuilder::new();
        for hit in 0..admitted * 2 {
            let value = OpValue { descriptor: Some("r".into()), ..OpValue::default() };
            history.push(hit, EventType::Invoke, Function::Check, value.clone());
            let reply = OpValue { admitted: Some(hit % 2 == 0), ..value };
            history.push(hit, EventType::Ok, Function::Check, reply);
        }
        // Spread the hits over the span, 1 us per call.
        let step_ns = span_ms * 1_000_000 / (admitted * 2).max(1);
        for (position, event) in history.events.iter_mut().enumerate() {
            let hit = position as u64 / 2;
            event.time_ns = hit * step_ns + (position as u64 % 2) * 1_000;
        }
        history.events
    }

    fn validity(events: &[Event], rule: RuleModel) -> Validity {
        check(events, &[rule], 1_000)[0].validity
    }

    /// Admissions at the limit pass; a burst past capacity, refill and drift is flagged.
    #[test]
    fn over_admission_is_flagged() {
        assert_eq!(validity(&history(100, 5_000), rule(false)), Validity::Valid);
        // 20 + 20 + 10 = 50 in any second (a little less over the 0.97 s the hits span).
        assert_eq!(validity(&history(45, 990), rule(false)), Validity::Valid);
        assert_eq!(validity(&history(60, 990), rule(false)), Validity::Invalid);
    }

    /// A fail-open rule may add its fallback allowance, and no more.
    #[test]
    fn fail_open_allows_the_fallback() {
        // 50 + 1.0 x (20 + 20) = 90 in any second.
        assert_eq!(validity(&history(85, 990), rule(true)), Validity::Valid);
        assert_eq!(validity(&history(95, 990), rule(true)), Validity::Invalid);
    }

    /// Too many admissions over a whole run are flagged even when spread thinly.
    #[test]
    fn whole_run_over_admission_is_flagged() {
        // Over 10 s: 20 + 200 + 10 = 230 allowed, 300 admitted at 30 a second.
        let results = check(&history(300, 10_000), &[rule(false)], 1_000);
        assert_eq!(results[0].validity, Validity::Invalid);
        assert!(results[0].problems.iter().any(|problem| problem.contains("over the run")));
    }

    /// Without an exported bound the rule cannot be judged.
    #[test]
    fn missing_bound_is_unknown() {
        let mut model = rule(false);
        model.drift_bound_tokens = None;
        assert_eq!(validity(&history(10, 1_000), model), Validity::Unknown);
    }

    /// The bound is read from the matching series, the largest across snapshots.
    #[test]
    fn bound_from_metrics() {
        let snapshots = vec![
            "quotamesh_lease_drift_bound_tokens{domain=\"jepsen\",rule=\"open\"} 12\n\
             quotamesh_lease_drift_bound_tokens{domain=\"jepsen\",rule=\"closed\"} 7"
                .to_owned(),
            "quotamesh_lease_drift_bound_tokens{domain=\"jepsen\",rule=\"open\"} 30\n".to_owned(),
        ];
        assert_eq!(drift_bound_from_metrics(&snapshots, "jepsen", "open"), Some(30));
        assert_eq!(drift_bound_from_metrics(&snapshots, "jepsen", "closed"), Some(7));
        assert_eq!(drift_bound_from_metrics(&snapshots, "jepsen", "other"), None);
    }
}

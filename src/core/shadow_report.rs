//! Shadow-mode evidence (DESIGN section 7): the `RateLimitShadowBlock` event a node writes
//! for each request a shadow rule would have refused, and the report that sums them per
//! rule, the false-positive review to do before a rule is enforced.
//!
//! Events are JSON lines (the node's sink, `crate::api::shadow_events`); [`summarize`]
//! turns any sequence of them into per-rule figures: would-be rejections and their rate
//! over the period, first and last seen, and the descriptor values blocked most. Pure.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// Most distinct descriptor values counted per rule: past it, new values count as one
/// "other" entry, so a flood of random values cannot grow the report without bound.
pub const DISTINCT_VALUES_PER_RULE_MAX: usize = 100_000;

/// The `event` of every line: what the structured log calls it too.
pub const SHADOW_BLOCK_EVENT: &str = "RateLimitShadowBlock";

/// One request a shadow rule would have refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowEvent {
    /// Always [`SHADOW_BLOCK_EVENT`].
    pub event: String,
    /// When the node decided, epoch milliseconds of its clock.
    pub time_ms: u64,
    /// The same moment, RFC 3339 (UTC), for people.
    pub time: String,
    /// The node's id.
    pub node: String,
    /// The request's domain.
    pub domain: String,
    /// The rule's path (its statistics key without the domain).
    pub rule: String,
    /// The descriptor's entries, as sent.
    pub descriptor: Vec<DescriptorEntry>,
    /// Hits the request carried.
    pub hits: u64,
}

/// One entry of an event's descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescriptorEntry {
    /// The entry's key.
    pub key: String,
    /// Its runtime value.
    pub value: String,
}

impl ShadowEvent {
    /// The descriptor as one text: `key=value` per entry, joined by `,`.
    #[must_use]
    pub fn descriptor_text(&self) -> String {
        let entries: Vec<String> =
            self.descriptor.iter().map(|entry| format!("{}={}", entry.key, entry.value)).collect();
        entries.join(",")
    }
}

/// What one rule would have refused over a period.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuleSummary {
    /// The rule's domain.
    pub domain: String,
    /// The rule's path.
    pub rule: String,
    /// Requests it would have refused.
    pub blocks: u64,
    /// Their hits.
    pub hits: u64,
    /// Would-be refusals per hour over the whole period.
    pub blocks_per_hour: f64,
    /// The first and last would-be refusal, epoch ms.
    pub first_ms: u64,
    /// See `first_ms`.
    pub last_ms: u64,
    /// The descriptors refused most, with how often, most first (ties by text).
    pub top: Vec<(String, u64)>,
}

/// Sums `events` from `since_ms` up to `now_ms` per rule (rules by domain and path), with
/// each rule's `top` descriptors; events outside the period are skipped. An empty period
/// counts as one millisecond.
#[must_use]
pub fn summarize(
    events: impl IntoIterator<Item = ShadowEvent>,
    since_ms: u64,
    now_ms: u64,
    top: usize,
) -> Vec<RuleSummary> {
    struct Tally {
        blocks: u64,
        hits: u64,
        first_ms: u64,
        last_ms: u64,
        values: HashMap<String, u64>,
        other: u64,
    }
    let mut rules: BTreeMap<(String, String), Tally> = BTreeMap::new();
    for event in events {
        if event.time_ms < since_ms || event.time_ms > now_ms {
            continue;
        }
        let text = event.descriptor_text();
        let tally = rules.entry((event.domain, event.rule)).or_insert_with(|| Tally {
            blocks: 0,
            hits: 0,
            first_ms: u64::MAX,
            last_ms: 0,
            values: HashMap::new(),
            other: 0,
        });
        tally.blocks += 1;
        tally.hits = tally.hits.saturating_add(event.hits);
        tally.first_ms = tally.first_ms.min(event.time_ms);
        tally.last_ms = tally.last_ms.max(event.time_ms);
        let known =
            tally.values.len() < DISTINCT_VALUES_PER_RULE_MAX || tally.values.contains_key(&text);
        if known {
            *tally.values.entry(text).or_default() += 1;
        } else {
            tally.other += 1;
        }
    }
    let period_hours = (now_ms.saturating_sub(since_ms).max(1)) as f64 / 3_600_000.0;
    rules
        .into_iter()
        .map(|((domain, rule), tally)| {
            let mut values: Vec<(String, u64)> = tally.values.into_iter().collect();
            if tally.other > 0 {
                values.push(("(other values)".to_owned(), tally.other));
            }
            values.sort_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(&right.0)));
            values.truncate(top);
            RuleSummary {
                domain,
                rule,
                blocks: tally.blocks,
                hits: tally.hits,
                blocks_per_hour: tally.blocks as f64 / period_hours,
                first_ms: tally.first_ms,
                last_ms: tally.last_ms,
                top: values,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn event(time_ms: u64, rule: &str, value: &str) -> ShadowEvent {
        ShadowEvent {
            event: SHADOW_BLOCK_EVENT.to_owned(),
            time_ms,
            time: String::new(),
            node: "n".to_owned(),
            domain: "d".to_owned(),
            rule: rule.to_owned(),
            descriptor: vec![DescriptorEntry { key: "k".to_owned(), value: value.to_owned() }],
            hits: 2,
        }
    }

    /// Per rule: the events of the period, their hits, rate, first and last, and the values
    /// blocked most; events before or after the period are left out.
    #[test]
    fn a_report_sums_each_rules_period() {
        let events = vec![
            event(500, "a", "x"),
            event(1_000, "a", "x"),
            event(2_000, "a", "y"),
            event(3_000, "a", "x"),
            event(4_000, "b", "z"),
            event(9_000, "a", "x"),
        ];
        let report = summarize(events, 1_000, 3_601_000, 1);
        assert_eq!(report.len(), 2);
        let a = &report[0];
        assert_eq!((a.rule.as_str(), a.blocks, a.hits), ("a", 4, 8));
        assert_eq!((a.first_ms, a.last_ms), (1_000, 9_000));
        assert_eq!(a.top, [("k=x".to_owned(), 3)]);
        assert!((a.blocks_per_hour - 4.0).abs() < 1e-9);
        assert_eq!(report[1].top, [("k=z".to_owned(), 1)]);
        let line = serde_json::to_string(&event(1, "a", "x")).expect("serializes");
        assert_eq!(serde_json::from_str::<ShadowEvent>(&line).expect("parses"), event(1, "a", "x"));
    }

    proptest! {
        /// Every event of the period is counted once under its rule, and the top list is
        /// sorted, most first, with counts no larger than the rule's blocks.
        #[test]
        fn a_report_counts_every_event_once(
            events in prop::collection::vec((0u64..100, 0usize..3, 0usize..5), 0..200),
            since_ms in 0u64..50,
            top in 1usize..4,
        ) {
            let rules = ["a", "b", "c"];
            let values = ["v0", "v1", "v2", "v3", "v4"];
            let generated: Vec<ShadowEvent> = events
                .iter()
                .map(|(time_ms, rule, value)| event(*time_ms, rules[*rule], values[*value]))
                .collect();
            let report = summarize(generated, since_ms, 99, top);
            let inside = events.iter().filter(|(time_ms, _, _)| *time_ms >= since_ms).count();
            prop_assert_eq!(report.iter().map(|rule| rule.blocks).sum::<u64>(), inside as u64);
            for rule in &report {
                prop_assert!(rule.top.len() <= top);
                prop_assert!(rule.top.windows(2).all(|pair| pair[0].1 >= pair[1].1));
                prop_assert!(rule.top.iter().all(|(_, count)| *count <= rule.blocks));
                prop_assert!(rule.first_ms >= since_ms && rule.first_ms <= rule.last_ms);
            }
        }
    }
}

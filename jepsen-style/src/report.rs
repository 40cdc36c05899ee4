//! The run report (`report.md`, and what `quotamesh-jepsen report` prints): the options,
//! the verdict with each check's first problems, operations by function and outcome, the
//! share of operations that succeeded with and without a fault active, and each fault with
//! the time from its end to the next `ok` through any node and through every node. Rendered from the run's files alone. Also the
//! summary of a directory of runs: one row per run, then per kind of fault over every run
//! the faults, the share `ok` while one was active and the recovery times.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use anyhow::Context;

use crate::checker::{Verdict, availability};
use crate::history::{Event, EventType, Function, operations, read_jsonl};
use crate::nemesis::{FaultKind, NemesisRecord, Phase};
use crate::run::{RunRecord, WorkloadKind};

/// What a report is rendered from: a saved run's records.
pub struct RunFiles {
    pub record: RunRecord,
    pub verdict: Verdict,
    /// Empty when the history is missing or broken (the verdict says so).
    pub events: Vec<Event>,
    pub faults: Vec<NemesisRecord>,
}

impl RunFiles {
    /// Reads the run in `directory` (its verdict must have been written).
    ///
    /// # Errors
    /// `run.json` or `verdict.json` cannot be read.
    pub fn read(directory: &Path) -> anyhow::Result<Self> {
        let record: RunRecord = serde_json::from_slice(
            &std::fs::read(directory.join("run.json")).context("read run.json")?,
        )?;
        let verdict: Verdict = serde_json::from_slice(
            &std::fs::read(directory.join("verdict.json")).context("read verdict.json")?,
        )?;
        let events = read_jsonl(&directory.join("history.jsonl")).unwrap_or_default();
        let faults = read_jsonl(&directory.join("nemesis.jsonl")).unwrap_or_default();
        Ok(Self { record, verdict, events, faults })
    }
}

/// Renders the report of the run in `directory` (its verdict must have been written).
///
/// # Errors
/// `run.json` or `verdict.json` cannot be read.
pub fn render(directory: &Path) -> anyhow::Result<String> {
    let run = RunFiles::read(directory)?;
    Ok(render_parts(&run.record, &run.verdict, &run.events, &run.faults))
}

/// The report from the run's records. Pure.
pub fn render_parts(
    record: &RunRecord,
    verdict: &Verdict,
    events: &[Event],
    faults: &[NemesisRecord],
) -> String {
    let options = &record.options;
    let mut text = String::new();
    let nemeses: Vec<String> = options.nemeses.iter().map(|kind| kind.name().to_owned()).collect();
    let shape = match options.workload {
        WorkloadKind::Holds => format!(
            "holds of up to {} with TTLs of {} to {} ms on {} accounts of {} above a floor of {}",
            record.bank.transfer_amount_max,
            crate::workload::holds::TTL_MS_MIN,
            crate::workload::holds::TTL_MS_MAX,
            record.bank.accounts,
            record.bank.initial_balance,
            record.bank.floor
        ),
        WorkloadKind::Bank | WorkloadKind::Linear => format!(
            "{} accounts of {} above a floor of {}",
            record.bank.accounts, record.bank.initial_balance, record.bank.floor
        ),
        WorkloadKind::Rls => {
            let rules: Vec<String> = record
                .rls
                .rules
                .iter()
                .map(|rule| {
                    format!("{} ({})", rule.key, if rule.fail_open { "open" } else { "closed" })
                })
                .collect();
            format!(
                "rules {} of {}/s, bursts of {}",
                rules.join(", "),
                record.rls.limit_per_second,
                record.rls.burst_tokens
            )
        }
        WorkloadKind::Leases => match &record.leases {
            Some(leases) => format!(
                "{} keys of {}/s, bursts of {}, grants of 1 to {} for {} ms",
                leases.keys,
                leases.limit_per_second,
                leases.burst_tokens,
                leases.tokens_wanted_max,
                leases.lease_ttl_ms
            ),
            None => "leases".to_owned(),
        },
    };
    let gateways = match options.gateways {
        0 => String::new(),
        count => format!(" + {count} gateways"),
    };
    let _ = writeln!(
        text,
        "# quotamesh-jepsen: {} on {} {} nodes{gateways}, seed {}\n\n\
         nemeses: {} · time limit {} s · rate {}/s · {shape}\n",
        options.workload.name(),
        options.pacing.nodes,
        options.topology.name(),
        options.seed,
        if nemeses.is_empty() { "none".to_owned() } else { nemeses.join(", ") },
        options.pacing.time_limit_ms / 1_000,
        options.pacing.rate_per_second,
    );
    let _ = writeln!(text, "## Verdict: {:?}\n", verdict.validity);
    let _ = writeln!(text, "| check | verdict | checked | problems |\n|---|---|---|---|");
    for check in &verdict.checks {
        let _ = writeln!(
            text,
            "| {} | {:?} | {} | {} |",
            check.name, check.validity, check.checked, check.problem_count
        );
    }
    for check in verdict.checks.iter().filter(|check| !check.problems.is_empty()) {
        let _ = writeln!(text, "\n{} (first problems):\n", check.name);
        for problem in &check.problems {
            let _ = writeln!(text, "- {problem}");
        }
    }

    let operations = operations(events);
    let mut counts: BTreeMap<Function, [u64; 3]> = BTreeMap::new();
    for operation in &operations {
        let slot = counts.entry(operation.invoke.f).or_default();
        match operation.outcome() {
            EventType::Ok => slot[0] += 1,
            EventType::Fail => slot[1] += 1,
            _ => slot[2] += 1,
        }
    }
    let _ = writeln!(text, "\n## Operations ({})\n", operations.len());
    let _ = writeln!(text, "| function | ok | fail | info |\n|---|---|---|---|");
    for (function, [ok, fail, info]) in &counts {
        let _ = writeln!(text, "| {function:?} | {ok} | {fail} | {info} |");
    }
    let mut admitted: BTreeMap<&str, [u64; 2]> = BTreeMap::new();
    for operation in operations.iter().filter(|operation| operation.invoke.f == Function::Check) {
        let rule = operation.invoke.value.descriptor.as_deref().unwrap_or("");
        let slot = admitted.entry(rule).or_default();
        slot[0] += 1;
        slot[1] += u64::from(operation.result().admitted == Some(true));
    }
    for (rule, [hits, yes]) in &admitted {
        let _ = writeln!(text, "\nRule {rule}: {yes} of {hits} hits admitted.");
    }

    let measured =
        availability::measure(events, faults, record.options.availability.recovery_ms_max);
    let share = |share: availability::Share| {
        share.permille().map_or("-".to_owned(), |permille| {
            format!("{}.{} % of {}", permille / 10, permille % 10, share.operations)
        })
    };
    let _ = writeln!(
        text,
        "\n## Availability\n\nShare of operations `ok`:\n\n- no fault active, every node \
         recovered: {}",
        share(measured.quiet)
    );
    for (kind, during) in &measured.during {
        let _ = writeln!(text, "- during {kind:?}: {}", share(*during));
    }
    let starts: Vec<&NemesisRecord> =
        faults.iter().filter(|record| record.phase == Phase::Start).collect();
    let _ = writeln!(text, "\n## Faults ({})\n", starts.len());
    let _ = writeln!(
        text,
        "| # | kind | target | nodes | start s | end s | outcome | first ok after end: any / every node | detail |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    let ms = |value: Option<u64>| value.map_or("-".to_owned(), |ms| format!("{ms} ms"));
    for start in starts {
        let end =
            faults.iter().find(|record| record.fault == start.fault && record.phase == Phase::End);
        let recovery = measured
            .recoveries
            .iter()
            .find(|recovery| recovery.fault == start.fault)
            .map_or("- / -".to_owned(), |recovery| {
                format!("{} / {}", ms(recovery.any_ms), ms(recovery.every_ms))
            });
        let nodes: Vec<String> = start.nodes.iter().map(|node| node.0.to_string()).collect();
        let _ = writeln!(
            text,
            "| {} | {:?} | {:?} | {} | {:.1} | {} | {:?} | {} | {} |",
            start.fault,
            start.kind,
            start.target,
            nodes.join(","),
            start.time_ns as f64 / 1e9,
            end.map_or("-".to_owned(), |record| format!("{:.1}", record.time_ns as f64 / 1e9)),
            end.map_or(start.outcome, |record| record.outcome),
            recovery,
            start.detail.as_deref().unwrap_or("")
        );
    }
    text
}

/// One row of the summary across runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryRow {
    pub name: String,
    pub workload: &'static str,
    pub topology: &'static str,
    pub nemeses: String,
    pub seed: u64,
    pub operations: u64,
    pub unknown: u64,
    pub faults: u64,
    /// The `ok` share outside faults, in thousandths.
    pub quiet_ok_permille: Option<u64>,
    /// The longest time from a heal to the last node's first `ok`.
    pub recovery_ms_max: Option<u64>,
    /// Operations invoked while a fault of each kind was active, and how many were `ok`.
    pub during: BTreeMap<FaultKind, availability::Share>,
    /// Each fault's kind and the time from its heal to the last node's first `ok` (`None`:
    /// some node had none).
    pub recoveries: Vec<(FaultKind, Option<u64>)>,
    pub validity: crate::checker::Validity,
}

impl SummaryRow {
    /// The row of one run, from its records. Pure.
    pub fn of(
        name: String,
        record: &RunRecord,
        verdict: &Verdict,
        events: &[Event],
        faults: &[NemesisRecord],
    ) -> Self {
        let operations = operations(events);
        let measured =
            availability::measure(events, faults, record.options.availability.recovery_ms_max);
        let nemeses: Vec<String> =
            record.options.nemeses.iter().map(|kind| kind.name().to_owned()).collect();
        Self {
            name,
            workload: record.options.workload.name(),
            topology: record.options.topology.name(),
            nemeses: nemeses.join(","),
            seed: record.options.seed,
            operations: operations.len() as u64,
            unknown: operations
                .iter()
                .filter(|operation| operation.outcome() == EventType::Info)
                .count() as u64,
            faults: faults.iter().filter(|record| record.phase == Phase::Start).count() as u64,
            quiet_ok_permille: measured.quiet.permille(),
            recovery_ms_max: measured
                .recoveries
                .iter()
                .filter_map(|recovery| recovery.every_ms)
                .max(),
            during: measured.during.clone(),
            recoveries: measured
                .recoveries
                .iter()
                .map(|recovery| (recovery.kind, recovery.every_ms))
                .collect(),
            validity: verdict.validity,
        }
    }
}

/// The summary table of every run directly under `directory` (those with a verdict).
///
/// # Errors
/// `directory` cannot be listed.
pub fn render_summary(directory: &Path) -> anyhow::Result<String> {
    let mut rows = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(directory)
        .with_context(|| format!("list {}", directory.display()))?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.join("verdict.json").is_file())
        .collect();
    entries.sort();
    for run in entries {
        let read = |name: &str| std::fs::read(run.join(name)).ok();
        let (Some(record), Some(verdict)) = (read("run.json"), read("verdict.json")) else {
            continue;
        };
        let (Ok(record), Ok(verdict)) = (
            serde_json::from_slice::<RunRecord>(&record),
            serde_json::from_slice::<Verdict>(&verdict),
        ) else {
            continue;
        };
        let events: Vec<Event> = read_jsonl(&run.join("history.jsonl")).unwrap_or_default();
        let faults: Vec<NemesisRecord> = read_jsonl(&run.join("nemesis.jsonl")).unwrap_or_default();
        let name =
            run.file_name().map(|name| name.to_string_lossy().into_owned()).unwrap_or_default();
        rows.push(SummaryRow::of(name, &record, &verdict, &events, &faults));
    }
    Ok(summary_table(&rows))
}

/// The summary as a Markdown table with totals. Pure.
pub fn summary_table(rows: &[SummaryRow]) -> String {
    let mut text = format!("# quotamesh-jepsen: {} runs\n\n", rows.len());
    text.push_str(
        "| run | workload | topology | nemeses | seed | operations | info | faults | ok outside faults | \
         longest recovery | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:?} |",
            row.name,
            row.workload,
            row.topology,
            row.nemeses,
            row.seed,
            row.operations,
            row.unknown,
            row.faults,
            row.quiet_ok_permille.map_or("-".to_owned(), |permille| format!(
                "{}.{} %",
                permille / 10,
                permille % 10
            )),
            row.recovery_ms_max.map_or("-".to_owned(), |ms| format!("{ms} ms")),
            row.validity
        );
    }
    let count = |validity| rows.iter().filter(|row| row.validity == validity).count();
    let _ = writeln!(
        text,
        "\n{} operations, {} faults, longest recovery {}; {} valid, {} invalid, {} unknown.",
        rows.iter().map(|row| row.operations).sum::<u64>(),
        rows.iter().map(|row| row.faults).sum::<u64>(),
        rows.iter()
            .filter_map(|row| row.recovery_ms_max)
            .max()
            .map_or("-".to_owned(), |ms| format!("{ms} ms")),
        count(crate::checker::Validity::Valid),
        count(crate::checker::Validity::Invalid),
        count(crate::checker::Validity::Unknown),
    );
    text.push_str(&per_fault_kind(rows));
    text
}

/// Per kind of fault over every run: how many, the share of operations `ok` while one was
/// active, and the time from a heal to every node's first `ok` (median, 95th percentile,
/// longest, and how many heals some node did not answer after).
fn per_fault_kind(rows: &[SummaryRow]) -> String {
    let mut during: BTreeMap<FaultKind, availability::Share> = BTreeMap::new();
    let mut recoveries: BTreeMap<FaultKind, (Vec<u64>, u64)> = BTreeMap::new();
    for row in rows {
        for (kind, share) in &row.during {
            let total = during.entry(*kind).or_default();
            total.operations += share.operations;
            total.ok += share.ok;
        }
        for (kind, every_ms) in &row.recoveries {
            let (times, missing) = recoveries.entry(*kind).or_default();
            match every_ms {
                Some(ms) => times.push(*ms),
                None => *missing += 1,
            }
        }
    }
    if recoveries.is_empty() {
        return String::new();
    }
    let mut text = String::from(
        "\n| fault | faults | ok while active | recovery median | p95 | longest | unrecovered |\n\
         |---|---|---|---|---|---|---|\n",
    );
    let permille = |share: Option<&availability::Share>| {
        share
            .and_then(|share| share.permille())
            .map_or("-".to_owned(), |permille| format!("{}.{} %", permille / 10, permille % 10))
    };
    for (kind, (times, missing)) in &mut recoveries {
        times.sort_unstable();
        let quantile = |numerator: usize| {
            let last = times.len().checked_sub(1)?;
            times.get(last * numerator / 100).copied()
        };
        let ms = |value: Option<u64>| value.map_or("-".to_owned(), |ms| format!("{ms} ms"));
        let _ = writeln!(
            text,
            "| {} | {} | {} | {} | {} | {} | {missing} |",
            kind.name(),
            times.len() as u64 + *missing,
            permille(during.get(kind)),
            ms(quantile(50)),
            ms(quantile(95)),
            ms(times.last().copied()),
        );
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::Validity;

    /// The summary lists every run and totals operations, faults and verdicts.
    #[test]
    fn summary_totals_runs() {
        let row = |seed, validity| SummaryRow {
            name: format!("bank-seed{seed}"),
            workload: "bank",
            topology: "local",
            nemeses: "kill".into(),
            seed,
            operations: 100,
            unknown: 2,
            faults: 3,
            quiet_ok_permille: Some(987),
            recovery_ms_max: Some(seed * 1_000),
            during: BTreeMap::from([(
                FaultKind::Kill,
                availability::Share { operations: 10, ok: 7 },
            )]),
            recoveries: vec![
                (FaultKind::Kill, Some(seed * 1_000)),
                (FaultKind::Kill, Some(seed * 100)),
                (FaultKind::Kill, None),
            ],
            validity,
        };
        let text = summary_table(&[row(1, Validity::Valid), row(2, Validity::Invalid)]);
        assert!(
            text.contains("| bank-seed2 | bank | local | kill | 2 | 100 | 2 | 3 | 98.7 % | 2000 ms | Invalid |"),
            "{text}"
        );
        assert!(
            text.contains(
                "200 operations, 6 faults, longest recovery 2000 ms; 1 valid, 1 invalid, 0 unknown."
            ),
            "{text}"
        );
        // Per kind: six kills, 14 of 20 operations ok, recoveries 100, 200, 1000, 2000 ms.
        assert!(text.contains("| kill | 6 | 70.0 % | 200 ms | 1000 ms | 2000 ms | 2 |"), "{text}");
    }
}

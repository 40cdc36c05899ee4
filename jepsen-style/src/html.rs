//! The HTML report of a run (`report.html`, `quotamesh-jepsen report --html`): one
//! self-contained page (inline SVG, no script, no outside file) with the verdict, plots over
//! the run's time drawn with `plotters` (operations `ok` per second and mean latency per
//! node, and for RLS the hits admitted per second per rule against the rule's rate), every
//! fault's interval shaded, and the Markdown report below them. The series are pure
//! functions of the history (`series`); only the drawing is plotters'.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use plotters::prelude::*;

use crate::checker::{Validity, Verdict};
use crate::history::{Event, EventType, Function, NodeId, operations};
use crate::nemesis::{NemesisRecord, Phase};
use crate::report::RunFiles;
use crate::run::{RunRecord, WorkloadKind};

/// The plots' width of one bucket.
const BUCKET_MS: u64 = 1_000;
const PLOT_SIZE_PX: (u32, u32) = (960, 280);

/// Per-second figures of a set of operations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bucket {
    pub ok: u64,
    /// Summed latency of the `ok` operations, in microseconds.
    pub ok_latency_us: u64,
    /// RLS hits admitted.
    pub admitted: u64,
}

/// The figures of a run, bucket by bucket from its start.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    pub per_node: BTreeMap<NodeId, Vec<Bucket>>,
    /// RLS: per rule.
    pub per_rule: BTreeMap<String, Vec<Bucket>>,
    /// Each fault's start and end, in seconds.
    pub faults: Vec<(f64, f64, String)>,
    pub buckets: usize,
}

/// The series of a history, bucketed by the operations' completion. Pure.
pub fn series(events: &[Event], faults: &[NemesisRecord]) -> Series {
    let bucket_ns = BUCKET_MS * 1_000_000;
    let buckets = events.last().map_or(0, |event| (event.time_ns / bucket_ns) as usize + 1);
    let mut series = Series { buckets, ..Series::default() };
    for operation in operations(events) {
        let Some(completion) = operation.completion else { continue };
        if completion.event_type != EventType::Ok {
            continue;
        }
        let slot = (completion.time_ns / bucket_ns) as usize;
        let latency_us = completion.time_ns.saturating_sub(operation.invoke.time_ns) / 1_000;
        let admitted = u64::from(completion.value.admitted == Some(true));
        let add = |row: &mut Vec<Bucket>| {
            row.resize(buckets, Bucket::default());
            row[slot].ok += 1;
            row[slot].ok_latency_us += latency_us;
            row[slot].admitted += admitted;
        };
        add(series.per_node.entry(operation.invoke.node).or_default());
        if operation.invoke.f == Function::Check
            && let Some(rule) = &operation.invoke.value.descriptor
        {
            add(series.per_rule.entry(rule.clone()).or_default());
        }
    }
    for start in faults.iter().filter(|record| record.phase == Phase::Start) {
        let end_ns = faults
            .iter()
            .find(|record| record.fault == start.fault && record.phase == Phase::End)
            .map_or(buckets as u64 * bucket_ns, |record| record.time_ns);
        series.faults.push((
            start.time_ns as f64 / 1e9,
            end_ns as f64 / 1e9,
            format!("{:?}", start.kind),
        ));
    }
    series
}

/// One line of a plot: its name and its points (seconds, value).
type Line = (String, Vec<(f64, f64)>);

/// Draws `lines` over time as an SVG, the faults shaded, with a flat `limit` line if given.
fn plot(
    title: &str,
    y_label: &str,
    lines: &[Line],
    faults: &[(f64, f64, String)],
    limit: Option<f64>,
) -> Result<String, String> {
    let x_max = lines
        .iter()
        .flat_map(|(_, points)| points.iter().map(|(x, _)| *x))
        .chain(faults.iter().map(|(_, end, _)| *end))
        .fold(1.0_f64, f64::max);
    let y_max = lines
        .iter()
        .flat_map(|(_, points)| points.iter().map(|(_, y)| *y))
        .chain(limit)
        .fold(1.0_f64, f64::max)
        * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, PLOT_SIZE_PX).into_drawing_area();
        let draw = |error| format!("{title}: {error:?}");
        root.fill(&WHITE).map_err(draw)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(draw)?;
        chart
            .configure_mesh()
            .x_desc("seconds since the workload started")
            .y_desc(y_label)
            .draw()
            .map_err(draw)?;
        let shade = RGBColor(240, 120, 120).mix(0.25).filled();
        chart
            .draw_series(
                faults
                    .iter()
                    .map(|(start, end, _)| Rectangle::new([(*start, 0.0), (*end, y_max)], shade)),
            )
            .map_err(draw)?;
        for (index, (name, points)) in lines.iter().enumerate() {
            let color = Palette99::pick(index).to_rgba();
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                .map_err(draw)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        if let Some(limit) = limit {
            chart
                .draw_series(LineSeries::new([(0.0, limit), (x_max, limit)], BLACK.stroke_width(1)))
                .map_err(draw)?
                .label("allowed")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(draw)?;
        root.present().map_err(draw)?;
    }
    Ok(svg)
}

fn points(row: &[Bucket], value: impl Fn(&Bucket) -> Option<f64>) -> Vec<(f64, f64)> {
    row.iter()
        .enumerate()
        .filter_map(|(slot, bucket)| {
            value(bucket).map(|value| (slot as f64 * BUCKET_MS as f64 / 1e3, value))
        })
        .collect()
}

/// Escapes text for HTML.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The page of a run from its records and its Markdown report. Pure.
///
/// # Errors
/// A plot cannot be drawn.
pub fn render_parts(
    record: &RunRecord,
    verdict: &Verdict,
    events: &[Event],
    faults: &[NemesisRecord],
    markdown: &str,
) -> Result<String, String> {
    let options = &record.options;
    let series = series(events, faults);
    let title = format!(
        "quotamesh-jepsen: {} on {} {} nodes, seed {}",
        options.workload.name(),
        options.pacing.nodes,
        options.topology.name(),
        options.seed
    );
    let color = match verdict.validity {
        Validity::Valid => "#2a7d2a",
        Validity::Invalid => "#b00020",
        Validity::Unknown => "#a06000",
    };
    let mut html = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>\n\
         <style>body{{font-family:sans-serif;max-width:1000px;margin:1em auto}}\
         table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px}}\
         pre{{white-space:pre-wrap}}</style></head><body>\n<h1>{title}</h1>\n\
         <p style=\"font-size:1.4em;color:{color}\">Verdict: {:?}</p>\n<table><tr><th>check</th>\
         <th>verdict</th><th>checked</th><th>problems</th></tr>\n",
        verdict.validity
    );
    for check in &verdict.checks {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{:?}</td><td>{}</td><td>{}</td></tr>",
            escape(&check.name),
            check.validity,
            check.checked,
            check.problem_count
        );
    }
    html.push_str("</table>\n");
    for check in verdict.checks.iter().filter(|check| !check.problems.is_empty()) {
        let _ = writeln!(html, "<h3>{}: first problems</h3>\n<ul>", escape(&check.name));
        for problem in &check.problems {
            let _ = writeln!(html, "<li>{}</li>", escape(problem));
        }
        html.push_str("</ul>\n");
    }
    let _ = writeln!(html, "<p>Faults are shaded red.</p>");
    let per_node = |value: &dyn Fn(&Bucket) -> Option<f64>| -> Vec<Line> {
        series
            .per_node
            .iter()
            .map(|(node, row)| (format!("node {}", node.0), points(row, value)))
            .collect()
    };
    let throughput = per_node(&|bucket| Some(bucket.ok as f64));
    html.push_str(&plot("Operations ok per second", "ok / s", &throughput, &series.faults, None)?);
    let latency = per_node(&|bucket| {
        (bucket.ok > 0).then(|| bucket.ok_latency_us as f64 / bucket.ok as f64 / 1e3)
    });
    html.push_str(&plot("Mean latency of ok operations", "ms", &latency, &series.faults, None)?);
    if options.workload == WorkloadKind::Rls {
        for (rule, row) in &series.per_rule {
            let admitted = vec![(
                format!("{rule} admitted"),
                points(row, |bucket| Some(bucket.admitted as f64)),
            )];
            html.push_str(&plot(
                &format!("Rule {rule}: admitted per second"),
                "hits / s",
                &admitted,
                &series.faults,
                Some(record.rls.limit_per_second as f64),
            )?);
        }
    }
    let _ = write!(html, "\n<h2>Report</h2>\n<pre>{}</pre>\n</body></html>\n", escape(markdown));
    Ok(html)
}

/// The page of the run in `directory` (its verdict and Markdown report written).
///
/// # Errors
/// The run's records cannot be read, or a plot cannot be drawn.
pub fn render(directory: &Path) -> anyhow::Result<String> {
    let run = RunFiles::read(directory)?;
    let markdown = crate::report::render_parts(&run.record, &run.verdict, &run.events, &run.faults);
    render_parts(&run.record, &run.verdict, &run.events, &run.faults, &markdown)
        .map_err(anyhow::Error::msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::{OpValue, ProcessId};
    use crate::nemesis::{FaultKind, FaultOutcome, Target};

    fn event(index: u64, time_ms: u64, event_type: EventType, node: u64, admitted: bool) -> Event {
        Event {
            index,
            time_ns: time_ms * 1_000_000,
            process: ProcessId(index / 2),
            event_type,
            f: Function::Check,
            node: NodeId(node),
            value: OpValue {
                descriptor: Some("closed".into()),
                admitted: Some(admitted),
                ..OpValue::default()
            },
        }
    }

    /// Operations land in the second they completed in, per node and per rule, with their
    /// latency; failures count nowhere; faults keep their interval.
    #[test]
    fn series_buckets_by_completion() {
        let events = vec![
            event(0, 100, EventType::Invoke, 1, false),
            event(1, 300, EventType::Ok, 1, true),
            event(2, 900, EventType::Invoke, 2, false),
            event(3, 1_100, EventType::Ok, 2, false),
            event(4, 1_200, EventType::Invoke, 2, false),
            event(5, 1_300, EventType::Info, 2, false),
        ];
        let faults: Vec<NemesisRecord> = [(Phase::Start, 500), (Phase::End, 1_500)]
            .into_iter()
            .map(|(phase, ms)| NemesisRecord {
                time_ns: ms * 1_000_000,
                fault: 0,
                phase,
                kind: FaultKind::Pause,
                target: Target::One(0),
                nodes: vec![NodeId(1)],
                outcome: FaultOutcome::Installed,
                detail: None,
            })
            .collect();
        let series = series(&events, &faults);
        assert_eq!(series.buckets, 2);
        assert_eq!(
            series.per_node[&NodeId(1)][0],
            Bucket { ok: 1, ok_latency_us: 200_000, admitted: 1 }
        );
        assert_eq!(
            series.per_node[&NodeId(2)][1],
            Bucket { ok: 1, ok_latency_us: 200_000, admitted: 0 }
        );
        assert_eq!(series.per_node[&NodeId(2)][0], Bucket::default());
        assert_eq!(series.per_rule["closed"].iter().map(|bucket| bucket.ok).sum::<u64>(), 2);
        assert_eq!(series.faults, vec![(0.5, 1.5, "Pause".to_owned())]);
    }

    /// A plot is an SVG with the lines' names and the limit.
    #[test]
    fn plots_are_svg() {
        let lines = vec![("node 1".to_owned(), vec![(0.0, 3.0), (1.0, 5.0)])];
        let svg = plot("Title", "ok / s", &lines, &[(0.2, 0.6, "Kill".into())], Some(4.0))
            .expect("drawn");
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("node 1") && svg.contains("allowed") && svg.contains("<rect"));
    }
}

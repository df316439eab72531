//! The report of a run or a replay (`--report FILE.html`): one self-contained HTML page, what
//! an SRE looks at before reading logs. Its header says what ran and how it ended; below it, one
//! panel per series of the [`Timeline`] over time, each an inline SVG drawn by `plotters`'
//! SVG backend, with the marks (the first failure, the replay's `--until`, the liveness phase)
//! as vertical lines across every panel. No script, no font file, nothing fetched: the CSS is
//! inline and the browser draws the text.
//!
//! Each panel's `<svg>` has the series' id (`series-gpu-utilization`, `series-queue-depth`,
//! `series-nodes-up`, `series-faults`, `series-invariant-checks`) and a `<title>`; each mark is a
//! `<line class="mark mark-failure">` (or `mark-until`, `mark-liveness`) with a `<title>` saying
//! what happened there, and the legend above the panels has an element with the mark's id. Pure:
//! the caller writes the file.

use plotters::prelude::*;

use crate::replay::Replayed;
use crate::run::{Options, Outcome};
use crate::timeline::{MarkKind, Sample, Timeline};

/// A panel's size in pixels (the page is read on a laptop: five panels, one above the other).
pub const PANEL_WIDTH_PX: u32 = 1100;
pub const PANEL_HEIGHT_PX: u32 = 190;
/// A mark's label is cut to this many characters in the page (a failure can carry a history).
pub const MARK_LABEL_CHARS_MAX: usize = 600;

/// The series, in the order the page draws them: (id, title).
pub const SERIES: &[(&str, &str)] = &[
    ("series-gpu-utilization", "GPU utilization"),
    ("series-queue-depth", "Queue depth"),
    ("series-nodes-up", "Nodes up"),
    ("series-faults", "Faults"),
    ("series-invariant-checks", "Invariant checks"),
];

/// What the page says around the timeline.
pub struct Page<'a> {
    /// The page's title and first heading.
    pub title: String,
    pub ok: bool,
    /// Name and value, in order (seed, options, digest, …).
    pub facts: Vec<(&'static str, String)>,
    pub timeline: &'a Timeline,
    /// What the time axis is.
    pub time_axis: &'static str,
    /// What each series means here, in [`SERIES`]' order.
    pub meanings: [&'static str; 5],
}

/// A value held over an interval of the time axis (in the axis' unit): one sample.
#[derive(Clone, Copy)]
struct Held {
    from: f64,
    until: f64,
    value: f64,
}

/// How a panel draws its values.
#[derive(Clone, Copy)]
enum Draw {
    Area,
    Line,
    /// One bar per sample: the increase of a cumulative count over the sample's interval.
    Bars,
}

/// The page of a `sim run` recorded with [`Options::timeline`].
pub fn run_report(options: &Options, outcome: &Outcome) -> Result<String, String> {
    let timeline = outcome.timeline.as_ref().ok_or("the run recorded no timeline (Options::timeline)")?;
    let faults = if outcome.faults_enabled.is_empty() { "none".to_owned() } else { outcome.faults_enabled.join(", ") };
    let mut facts = vec![
        ("seed", options.seed.to_string()),
        ("nodes", options.nodes.to_string()),
        ("tenants", options.tenants.to_string()),
        ("simulated hours", {
            let how = if outcome.violation.is_some() { "stopped at the failure" } else { "then the liveness phase" };
            format!("{:.3} ({} asked; {how})", outcome.simulated_ms as f64 / 3_600_000.0, options.hours)
        }),
        ("steps", outcome.steps.to_string()),
        ("events", outcome.events.to_string()),
        ("faults enabled", faults),
        ("faults injected", outcome.faults_injected.iter().map(|(f, n)| format!("{f} {n}")).collect::<Vec<_>>().join(", ")),
        ("invariant checks", format!("{} after steps, {} full", outcome.step_checks, outcome.full_checks)),
        (
            "liveness",
            match outcome.liveness_ms {
                Some(ms) => format!("settled in {ms} ms (bound {} ms)", outcome.liveness_bound_ms),
                None => "not settled".to_owned(),
            },
        ),
        ("digest", outcome.digest.clone()),
    ];
    if let Some(failure) = &outcome.violation {
        facts.push(("first failure", format!("step {}, at {} ms: {}", failure.step, failure.at_ms, failure.what)));
    }
    facts.push(("reproduce", options.command()));
    let status = if outcome.violation.is_none() { "ok" } else { "FAILED" };
    html(&Page {
        title: format!("sim run {status}: seed {}, {} nodes, {} tenants", options.seed, options.nodes, options.tenants),
        ok: outcome.violation.is_none(),
        facts,
        timeline,
        time_axis: "simulated time",
        meanings: [
            "GPUs held by active reservations, over every GPU of the fleet (mean per sample)",
            "reservations waiting in a pool's queue (most per sample)",
            "nodes whose agent runs and hears its commands: not crashed, away or partitioned (fewest per sample)",
            "faults injected per interval (clock skew is set at the start, one per skewed agent)",
            "invariant checks passed so far: after every step, and the full checks (chains, projections, journals)",
        ],
    })
}

/// The page of a `sim replay` recorded with [`crate::replay::replay_recorded`].
pub fn replay_report(replayed: &Replayed, file: &str) -> Result<String, String> {
    let timeline = replayed.timeline.as_ref().ok_or("the replay recorded no timeline (replay_recorded)")?;
    let facts = vec![
        ("file", file.to_owned()),
        ("tenant", replayed.header.tenant.clone()),
        ("seqs", format!("{} to {}", replayed.header.from_seq, replayed.header.to_seq)),
        ("events verified", replayed.events_verified.to_string()),
        ("state at seq", replayed.at_seq.to_string()),
        ("state digest", replayed.digest()),
        ("signed by", replayed.key_ids.join(", ")),
    ];
    html(&Page {
        title: format!("sim replay: tenant {}, state at seq {}", replayed.header.tenant, replayed.at_seq),
        ok: true,
        facts,
        timeline,
        time_axis: "time since the file's first event (its events' own times)",
        meanings: [
            "GPUs allocated on the tenant's nodes, over their GPUs (mean per sample)",
            "the tenant's reservations in state queued (most per sample)",
            "the tenant's nodes not unreachable (fewest per sample)",
            "events of what went wrong per interval: node.unreachable, command.failed, gpu.hold_failed, reservation.failed, instance failures",
            "records verified so far: hash, link to the previous record, signature under a pinned key",
        ],
    })
}

/// The page: the header, the legend of marks, one panel per series.
pub fn html(page: &Page<'_>) -> Result<String, String> {
    let timeline = page.timeline;
    let samples = timeline.samples();
    let end_ms = timeline.end_ms().max(1);
    // Seconds for up to three minutes, minutes for up to three hours, hours beyond.
    let (unit_ms, unit) = match end_ms {
        0..=180_000 => (1000.0, "s"),
        180_001..=10_800_000 => (60_000.0, "min"),
        _ => (3_600_000.0, "h"),
    };
    let x = |ms: u64| ms as f64 / unit_ms;
    let x_max = x(end_ms);
    let mut out = String::with_capacity(64 * 1024 + samples.len() * 5 * 40);
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    out.push_str(&format!("<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n", escape(&page.title)));
    out.push_str(&format!(
        "<header class=\"{}\">\n<h1>{}</h1>\n<dl>\n",
        if page.ok { "ok" } else { "failed" },
        escape(&page.title)
    ));
    for (name, value) in &page.facts {
        out.push_str(&format!("<dt>{}</dt><dd>{}</dd>\n", escape(name), escape(&cut(value, MARK_LABEL_CHARS_MAX))));
    }
    out.push_str("</dl>\n</header>\n<ul class=\"marks\">\n");
    for mark in &timeline.marks {
        out.push_str(&format!(
            "<li id=\"{id}\" class=\"{id}\"><b>{:.2} {unit}</b> {}</li>\n",
            x(mark.at_ms),
            escape(&cut(&mark.label, MARK_LABEL_CHARS_MAX)),
            id = mark.kind.id()
        ));
    }
    out.push_str("</ul>\n");
    let bars = |count: fn(&Sample) -> u64| -> Vec<Held> {
        let mut before = 0;
        samples
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let until = samples.get(i + 1).map_or(end_ms, |n| n.at_ms);
                let value = count(s).saturating_sub(before);
                before = count(s);
                Held { from: x(s.at_ms), until: x(until), value: value as f64 }
            })
            .collect()
    };
    // Each sample holds until the next one, the last until the end.
    let held = |value: fn(&Sample) -> f64| -> Vec<Held> {
        let end = x(end_ms);
        let until = |i: usize| samples.get(i + 1).map_or(end, |n| x(n.at_ms));
        samples.iter().enumerate().map(|(i, s)| Held { from: x(s.at_ms), until: until(i), value: value(s) }).collect()
    };
    let panels: [(Draw, Vec<Held>, &str, RGBColor); 5] = [
        (Draw::Area, held(|s| s.gpu_utilization * 100.0), "% of GPUs", RGBColor(0x1f, 0x77, 0xb4)),
        (Draw::Line, held(|s| s.queue_depth as f64), "reservations", RGBColor(0xff, 0x7f, 0x0e)),
        (Draw::Line, held(|s| s.nodes_up as f64), "nodes", RGBColor(0x2c, 0xa0, 0x2c)),
        (Draw::Bars, bars(|s| s.faults), "per interval", RGBColor(0x94, 0x67, 0xbd)),
        (Draw::Line, held(|s| s.checks as f64), "passed, so far", RGBColor(0x17, 0xbe, 0xcf)),
    ];
    for (((id, title), meaning), (draw, values, y_desc, color)) in SERIES.iter().zip(page.meanings).zip(panels) {
        let marks: Vec<(f64, MarkKind, String)> =
            timeline.marks.iter().map(|m| (x(m.at_ms), m.kind, cut(&m.label, MARK_LABEL_CHARS_MAX))).collect();
        let svg = panel(id, title, draw, &values, (x_max, unit, page.time_axis), y_desc, color, &marks)?;
        out.push_str(&format!(
            "<section class=\"series\">\n<h2>{}</h2>\n<p>{}</p>\n{svg}\n</section>\n",
            escape(title),
            escape(meaning)
        ));
    }
    out.push_str(&format!(
        "<footer>{} samples of {} observations ({} per sample; at most {}), drawn with plotters' SVG backend.</footer>\n</body>\n</html>\n",
        samples.len(),
        timeline.observed(),
        timeline.stride(),
        crate::timeline::SAMPLES_MAX
    ));
    Ok(out)
}

/// One series' panel as an `<svg>` with the series' id and title, its marks added as titled
/// lines at the chart's own coordinates.
#[allow(clippy::too_many_arguments)]
fn panel(
    id: &str,
    title: &str,
    draw: Draw,
    values: &[Held],
    (x_max, unit, time_axis): (f64, &str, &str),
    y_desc: &str,
    color: RGBColor,
    marks: &[(f64, MarkKind, String)],
) -> Result<String, String> {
    let failed = |e: &dyn std::fmt::Display| format!("drawing the {title} panel: {e}");
    let y_top = values.iter().map(|v| v.value).fold(0.0, f64::max);
    // Counts: at least 0 to 5, labelled in whole numbers.
    let y_max = if matches!(draw, Draw::Area) { 100.0 } else { (y_top * 1.1).max(5.0) };
    let mut svg = String::new();
    let mut lines = Vec::new();
    {
        let root = SVGBackend::with_string(&mut svg, (PANEL_WIDTH_PX, PANEL_HEIGHT_PX)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| failed(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .margin(8)
            .x_label_area_size(34)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max.max(f64::MIN_POSITIVE), 0.0..y_max)
            .map_err(|e| failed(&e))?;
        chart
            .configure_mesh()
            .x_desc(format!("{time_axis} ({unit})"))
            .y_desc(y_desc)
            .y_labels(6)
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(RGBColor(0xee, 0xee, 0xee))
            .draw()
            .map_err(|e| failed(&e))?;
        // A sample holds until the next one: drawn as steps, never as a slope between them.
        let steps = || values.iter().flat_map(|v| [(v.from, v.value), (v.until, v.value)]);
        match draw {
            Draw::Area => chart.draw_series(AreaSeries::new(steps(), 0.0, color.mix(0.25)).border_style(color.stroke_width(2))),
            Draw::Line => chart.draw_series(LineSeries::new(steps(), color.stroke_width(2))),
            Draw::Bars => {
                // At least a thousandth of the axis wide, so a bar of one sample shows.
                let min_width = x_max / 1000.0;
                chart.draw_series(
                    values
                        .iter()
                        .filter(|v| v.value > 0.0)
                        .map(|v| Rectangle::new([(v.from, 0.0), (v.until.max(v.from + min_width), v.value)], color.filled())),
                )
            }
        }
        .map_err(|e| failed(&e))?;
        for (at, kind, label) in marks {
            let (x1, y1) = chart.backend_coord(&(*at, y_max));
            let (_, y2) = chart.backend_coord(&(*at, 0.0));
            let (stroke, dash) = match kind {
                MarkKind::Failure => ("#d62728", "none"),
                MarkKind::Until => ("#1f3fb4", "6 3"),
                MarkKind::Liveness => ("#7f7f7f", "2 3"),
                MarkKind::Divergence => ("#ff7f0e", "8 2"),
            };
            lines.push(format!(
                "<line class=\"mark {}\" x1=\"{x1}\" y1=\"{y1}\" x2=\"{x1}\" y2=\"{y2}\" stroke=\"{stroke}\" stroke-width=\"2\" stroke-dasharray=\"{dash}\"><title>{}</title></line>",
                kind.id(),
                escape(label)
            ));
        }
        root.present().map_err(|e| failed(&e))?;
    }
    // `<svg …>` as the backend opens it: the series' id and title go in, the marks before the end.
    let open_end = svg.find('>').ok_or_else(|| failed(&"the backend wrote no <svg>"))?;
    let (open, rest) = svg.split_at(open_end + 1);
    let body = rest.trim_end().strip_suffix("</svg>").ok_or_else(|| failed(&"the backend's <svg> is not closed"))?;
    let open = open.replacen("<svg ", &format!("<svg id=\"{id}\" class=\"series\" role=\"img\" "), 1);
    Ok(format!("{open}<title>{}</title>{body}{}</svg>", escape(title), lines.join("")))
}

/// `text` for HTML and SVG text and attributes.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// At most `max` characters of `text`, with an ellipsis when cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

const STYLE: &str = "\
body{font-family:sans-serif;margin:16px 24px;color:#222;background:#fff;max-width:1120px}\
h1{font-size:20px;margin:0 0 8px}h2{font-size:15px;margin:14px 0 2px}\
header{border-left:6px solid #2ca02c;padding:4px 12px;background:#f6fbf6}\
header.failed{border-left-color:#d62728;background:#fdf3f3}\
dl{display:grid;grid-template-columns:max-content 1fr;gap:1px 12px;margin:0;font-size:13px}\
dt{color:#666}dd{margin:0;font-family:monospace;overflow-wrap:anywhere;white-space:pre-wrap}\
ul.marks{list-style:none;padding:0;margin:10px 0;font-size:13px}\
ul.marks li{padding:2px 8px;margin:2px 0;border-left:4px solid #7f7f7f;white-space:pre-wrap}\
li.mark-failure{border-left-color:#d62728!important;background:#fdf3f3}\
li.mark-until{border-left-color:#1f3fb4!important;background:#f3f5fd}\
section.series p{margin:0 0 2px;font-size:12px;color:#555}\
svg.series{display:block}\
footer{margin-top:12px;font-size:12px;color:#777}";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::{MarkKind, Sample, Timeline};

    fn page(timeline: &Timeline) -> String {
        html(&Page {
            title: "a <test> & more".into(),
            ok: false,
            facts: vec![("seed", "7".into())],
            timeline,
            time_axis: "simulated time",
            meanings: ["a", "b", "c", "d", "e"],
        })
        .unwrap()
    }

    #[test]
    fn every_series_and_mark_is_in_the_page_and_nothing_is_fetched() {
        let mut timeline = Timeline::new();
        for i in 0..100u64 {
            timeline.observe(Sample {
                at_ms: i * 10_000,
                gpu_utilization: (i % 10) as f64 / 10.0,
                queue_depth: i % 4,
                nodes_up: 10 - i % 3,
                faults: i / 10,
                checks: i * 3,
            });
        }
        timeline.mark(MarkKind::Liveness, 600_000, "liveness");
        timeline.mark(MarkKind::Failure, 990_000, "double booking: <GPU 3>");
        let html = page(&timeline);
        for (id, title) in SERIES {
            let at = html.find(&format!("<svg id=\"{id}\"")).unwrap_or_else(|| panic!("{id} is missing"));
            let svg = &html[at..at + html[at..].find("</svg>").unwrap()];
            assert!(svg.contains(&format!("<title>{title}</title>")), "{id}");
            assert!(svg.contains("<polyline") || svg.contains("<polygon") || svg.contains("<rect"), "{id} draws nothing");
            assert!(svg.contains("class=\"mark mark-failure\""), "{id} has the failure's line");
        }
        assert!(html.contains("id=\"mark-failure\"") && html.contains("double booking: &lt;GPU 3&gt;"));
        assert!(html.contains("a &lt;test&gt; &amp; more"));
        assert!(!html.contains("<script"), "no script");
        // The one URL is SVG's namespace, which names and never fetches.
        assert_eq!(html.matches("http").count(), html.matches("http://www.w3.org/2000/svg").count(), "nothing fetched");
    }

    #[test]
    fn an_empty_timeline_still_draws_a_page() {
        let html = page(&Timeline::new());
        assert!(SERIES.iter().all(|(id, _)| html.contains(&format!("<svg id=\"{id}\""))));
    }

    #[test]
    fn cut_and_escape() {
        assert_eq!(cut("abcdef", 3), "abc…");
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(escape("<a href=\"x\">'&'</a>"), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }
}

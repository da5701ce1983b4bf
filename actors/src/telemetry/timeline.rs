//! A trace-event file as an SVG timeline: one row per (pid, tid) — a rank, or a pipeline stage — with
//! every complete span (`ph: "X"`) as a bar coloured by its category, a legend of the categories present
//! and a time axis. Generic over any Chrome trace: rows are named by `process_name`/`thread_name`
//! metadata when present.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use serde_json::Value;

use super::svg::{tick_label, ticks, Svg};
use super::trace_event::{TraceEvent, TraceFile};

/// Categories with a fixed colour, in legend order.
pub const CATEGORIES: &[(&str, &str)] = &[
    ("forward", "#4e79a7"),
    ("backward", "#f28e2b"),
    ("weight", "#59a14f"),
    ("compute", "#76b7b2"),
    ("comm", "#e15759"),
    ("optimizer", "#edc948"),
    ("idle", "#cfcfcf"),
    ("recovery", "#b07aa1"),
    ("checkpoint", "#9c755f"),
];
/// Colours for other categories, in order of first appearance.
const OTHER_COLOURS: &[&str] = &["#ff9da7", "#17becf", "#bcbd22", "#8c564b", "#7f7f7f", "#1f77b4"];

const WIDTH: f64 = 1400.0;
const LABEL_W: f64 = 170.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 70.0;
const ROW_H: f64 = 22.0;
const ROW_GAP: f64 = 6.0;
const AXIS_H: f64 = 44.0;

/// One row of the timeline.
#[derive(Debug)]
struct Row {
    pid: Value,
    tid: Value,
    label: String,
}

fn compare_ids(a: &Value, b: &Value) -> Ordering {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x.total_cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.to_string().cmp(&b.to_string()),
    }
}

fn id_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "0".into(),
        other => other.to_string(),
    }
}

/// The colour of each category present, fixed ones first.
pub fn palette(spans: &[&TraceEvent]) -> Vec<(String, String)> {
    let present: BTreeSet<&str> = spans.iter().map(|e| e.cat.as_str()).collect();
    let mut out: Vec<(String, String)> = CATEGORIES
        .iter()
        .filter(|(c, _)| present.contains(c))
        .map(|(c, col)| (c.to_string(), col.to_string()))
        .collect();
    let mut others = 0;
    for cat in spans.iter().map(|e| e.cat.as_str()) {
        if !out.iter().any(|(c, _)| c == cat) {
            out.push((cat.to_owned(), OTHER_COLOURS[others % OTHER_COLOURS.len()].to_owned()));
            others += 1;
        }
    }
    out
}

fn rows(trace: &TraceFile, spans: &[&TraceEvent]) -> Vec<Row> {
    let mut keys: Vec<(Value, Value)> = Vec::new();
    for e in spans {
        if !keys.iter().any(|(p, t)| p == &e.pid && t == &e.tid) {
            keys.push((e.pid.clone(), e.tid.clone()));
        }
    }
    keys.sort_by(|a, b| compare_ids(&a.0, &b.0).then_with(|| compare_ids(&a.1, &b.1)));
    keys.iter()
        .map(|(pid, tid)| {
            let threads = keys.iter().filter(|(p, _)| p == pid).count();
            let process = trace.label("process_name", pid, None);
            let thread = trace.label("thread_name", pid, Some(tid));
            let (pid_text, tid_text) = (format!("pid {}", id_text(pid)), format!("tid {}", id_text(tid)));
            // A named thread alone (one process of stages, say) is named by itself.
            let label = match (process, thread, threads > 1) {
                (Some(p), Some(t), _) => format!("{p} / {t}"),
                (None, Some(t), _) => t,
                (Some(p), None, false) => p,
                (Some(p), None, true) => format!("{p} / {tid_text}"),
                (None, None, false) => pid_text,
                (None, None, true) => format!("{pid_text} / {tid_text}"),
            };
            Row { pid: pid.clone(), tid: tid.clone(), label }
        })
        .collect()
}

/// Renders the timeline; an error if the trace has no complete span.
pub fn render(trace: &TraceFile, title: &str) -> Result<String, String> {
    let spans: Vec<&TraceEvent> = trace.trace_events.iter().filter(|e| e.is_span()).collect();
    if spans.is_empty() {
        return Err("the trace has no complete spans (ph \"X\" with a dur) to draw".into());
    }
    let t0 = spans.iter().map(|e| e.ts).fold(f64::INFINITY, f64::min);
    let t1 = spans.iter().map(|e| e.ts + e.dur.unwrap_or(0.0)).fold(f64::NEG_INFINITY, f64::max);
    let extent_us = (t1 - t0).max(1.0);
    let (unit, per_unit) = if extent_us >= 10e6 { ("s", 1e6) } else { ("ms", 1e3) };
    let rows = rows(trace, &spans);
    let colours = palette(&spans);
    let height = TOP + rows.len() as f64 * (ROW_H + ROW_GAP) + AXIS_H;
    let plot_w = WIDTH - LABEL_W - RIGHT;
    let x = |ts: f64| LABEL_W + (ts - t0) / extent_us * plot_w;
    let mut svg = Svg::new(WIDTH, height, title);
    svg.text((12.0, 22.0), title, 15.0, "start", "#222");

    svg.group("legend", &[]);
    let mut lx = 12.0;
    for (cat, colour) in &colours {
        svg.group("legend-item", &[("cat", cat)]);
        svg.rect(lx, 36.0, 14.0, 14.0, colour, None);
        svg.text((lx + 19.0, 47.5), cat, 12.0, "start", "#222");
        svg.end_group();
        lx += 32.0 + 6.8 * cat.len() as f64;
    }
    svg.end_group();

    let bottom = TOP + rows.len() as f64 * (ROW_H + ROW_GAP);
    let tick_values = ticks(0.0, extent_us / per_unit, 10);
    for v in &tick_values {
        let tx = x(t0 + v * per_unit);
        svg.line((tx, TOP - 4.0), (tx, bottom), "#e8e8e8", 1.0, None);
        svg.text((tx, bottom + 16.0), &tick_label(*v), 11.0, "middle", "#444");
    }
    svg.text(
        (LABEL_W + plot_w / 2.0, bottom + 34.0),
        &format!("time ({unit}) from the first span"),
        12.0,
        "middle",
        "#222",
    );

    for (i, row) in rows.iter().enumerate() {
        let y = TOP + i as f64 * (ROW_H + ROW_GAP);
        svg.group("row", &[("pid", &id_text(&row.pid)), ("tid", &id_text(&row.tid)), ("label", &row.label)]);
        svg.rect(LABEL_W, y, plot_w, ROW_H, "#f6f6f6", None);
        svg.text((LABEL_W - 8.0, y + ROW_H / 2.0 + 4.0), &row.label, 12.0, "end", "#222");
        for e in spans.iter().filter(|e| e.pid == row.pid && e.tid == row.tid) {
            let dur = e.dur.unwrap_or(0.0);
            let colour = colours.iter().find(|(c, _)| c == &e.cat).map_or("#999", |(_, col)| col.as_str());
            let (sx, w) = (x(e.ts), (dur / extent_us * plot_w).max(0.6));
            let tip = format!("{} ({}): {:.3} ms at {:.3} {unit}", e.name, e.cat, dur / 1e3, (e.ts - t0) / per_unit);
            svg.data_rect((sx, y + 1.0, w, ROW_H - 2.0), colour, &[("cat", &e.cat), ("name", &e.name)], Some(&tip));
        }
        svg.end_group();
    }
    Ok(svg.finish())
}

//! A run's loss and throughput against step, as SVG: two panels sharing the step axis, the validation
//! loss (`eval` events) drawn over the training loss, with vertical markers where the membership
//! changed (red), training recovered (purple) or rolled back to a checkpoint (brown), and ticks where
//! checkpoints were written.

use serde_json::Value;

use super::svg::{tick_label, ticks, Svg};

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 64.0;
const PANEL_H: f64 = 250.0;
const PANEL_GAP: f64 = 56.0;
const BOTTOM: f64 = 50.0;

/// The colour of the validation loss.
const EVAL_COLOUR: &str = "#ff7f0e";

/// Marker kinds with their colour and legend text.
const MARKERS: &[(&str, &str, &str)] = &[
    ("membership", "#d62728", "membership change"),
    ("recovery", "#9467bd", "recovered"),
    ("rollback", "#8c564b", "rolled back to a checkpoint"),
    ("checkpoint", "#7f7f7f", "checkpoint"),
];

/// (step, loss, tokens/s).
type Point = (f64, f64, f64);
/// A panel: its metric, axis label, colour and value.
type Panel = (&'static str, &'static str, &'static str, fn(&Point) -> f64);

/// What a plot is drawn from.
#[derive(Debug, Default, PartialEq)]
pub struct Series {
    /// (step, loss, tokens/s) per committed step, in the order committed; a rollback starts a new
    /// segment.
    pub segments: Vec<Vec<(f64, f64, f64)>>,
    /// (step, validation loss) per `eval` event, in the order reported; a step evaluated again (after a
    /// rollback) starts a new segment.
    pub evals: Vec<Vec<(f64, f64)>>,
    /// (kind, step, label).
    pub markers: Vec<(&'static str, f64, String)>,
}

fn num(e: &Value, key: &str) -> Option<f64> {
    e.get(key).and_then(Value::as_f64)
}

/// Steps and markers from a run's events. A membership change is placed at the last committed step.
pub fn series(events: &[Value]) -> Series {
    let mut s = Series::default();
    let mut last_step = 0.0;
    let mut current: Vec<(f64, f64, f64)> = Vec::new();
    let mut evals: Vec<(f64, f64)> = Vec::new();
    for e in events {
        match e.get("event").and_then(Value::as_str).unwrap_or("") {
            "step" => {
                let (Some(step), Some(loss)) = (num(e, "step"), num(e, "loss")) else { continue };
                // A step committed again (after a rollback) starts a new segment.
                if current.last().is_some_and(|p| step <= p.0) {
                    s.segments.push(std::mem::take(&mut current));
                }
                current.push((step, loss, num(e, "tokens_per_s").unwrap_or(0.0)));
                last_step = step;
            }
            "membership" => {
                let label =
                    format!("epoch {}: {} ranks", num(e, "epoch").unwrap_or(0.0), num(e, "world").unwrap_or(0.0));
                s.markers.push(("membership", last_step, label));
            }
            "recovery" => {
                let step = num(e, "step").unwrap_or(last_step);
                s.markers.push(("recovery", step, format!("recovered on {} ranks", num(e, "world").unwrap_or(0.0))));
            }
            "rollback" => {
                let to = num(e, "to_step").unwrap_or(0.0);
                s.markers.push(("rollback", to, format!("rolled back to step {to}")));
                last_step = to;
            }
            "eval" => {
                let (Some(step), Some(loss)) = (num(e, "step"), num(e, "loss")) else { continue };
                if evals.last().is_some_and(|p| step <= p.0) {
                    s.evals.push(std::mem::take(&mut evals));
                }
                evals.push((step, loss));
            }
            "checkpoint" => s.markers.push(("checkpoint", num(e, "step").unwrap_or(last_step), "checkpoint".into())),
            _ => {}
        }
    }
    if !current.is_empty() {
        s.segments.push(current);
    }
    if !evals.is_empty() {
        s.evals.push(evals);
    }
    s
}

/// Renders the plot; an error if the run committed no step.
pub fn render(series: &Series, title: &str) -> Result<String, String> {
    let points: Vec<&(f64, f64, f64)> = series.segments.iter().flatten().collect();
    if points.is_empty() {
        return Err("the run has no committed steps to plot".into());
    }
    let evals: Vec<&(f64, f64)> = series.evals.iter().flatten().collect();
    let max_step = points.iter().map(|p| p.0).chain(evals.iter().map(|e| e.0)).fold(1.0, f64::max);
    let plot_w = WIDTH - LEFT - RIGHT;
    let height = TOP + 2.0 * PANEL_H + PANEL_GAP + BOTTOM;
    let mut svg = Svg::new(WIDTH, height, title);
    svg.text((LEFT, 24.0), title, 15.0, "start", "#222");
    legend(&mut svg, series);
    let panels: [Panel; 2] = [("loss", "loss", "#1f77b4", |p| p.1), ("tokens_per_s", "tokens / s", "#2ca02c", |p| p.2)];
    for (i, panel) in panels.iter().enumerate() {
        let (metric, pick) = (panel.0, panel.3);
        // The loss panel's range holds the validation loss too.
        let eval_values = evals.iter().map(|e| e.1).filter(|_| metric == "loss");
        let values: Vec<f64> = points.iter().map(|p| pick(p)).chain(eval_values).filter(|v| v.is_finite()).collect();
        let (lo, hi) = panel_range(&values, metric);
        let frame = Frame { top: TOP + i as f64 * (PANEL_H + PANEL_GAP), lo, hi, max_step };
        draw_panel(&mut svg, &frame, panel, series, i == 0);
    }
    svg.text((LEFT + plot_w / 2.0, height - 14.0), "step", 12.0, "middle", "#222");
    Ok(svg.finish())
}

/// A panel's value range: `values`' with 5% padding (from 0 for tokens/s), 1 wide where they are equal.
fn panel_range(values: &[f64], metric: &str) -> (f64, f64) {
    let (mut lo, mut hi) = values.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(*v), h.max(*v)));
    if metric == "tokens_per_s" {
        lo = 0.0;
    }
    if hi.partial_cmp(&lo) != Some(std::cmp::Ordering::Greater) {
        hi = lo + 1.0;
    }
    let pad = (hi - lo) * 0.05;
    (if metric == "tokens_per_s" { 0.0 } else { lo - pad }, hi + pad)
}

/// Where a panel is drawn: its top, its value range `lo..hi` and the steps `0..max_step`.
struct Frame {
    top: f64,
    lo: f64,
    hi: f64,
    max_step: f64,
}

impl Frame {
    fn x(&self, step: f64) -> f64 {
        LEFT + step / self.max_step * (WIDTH - LEFT - RIGHT)
    }

    fn y(&self, v: f64) -> f64 {
        self.top + PANEL_H - (v - self.lo) / (self.hi - self.lo) * PANEL_H
    }
}

/// One panel: its grid and axis, the markers (labelled on the `first` panel), the series and its axes.
fn draw_panel(svg: &mut Svg, f: &Frame, (metric, axis_label, colour, pick): &Panel, series: &Series, first: bool) {
    let (plot_w, top) = (WIDTH - LEFT - RIGHT, f.top);
    svg.group("panel", &[("metric", metric)]);
    svg.rect(LEFT, top, plot_w, PANEL_H, "#fafafa", None);
    for t in ticks(f.lo, f.hi, 5) {
        svg.line((LEFT, f.y(t)), (LEFT + plot_w, f.y(t)), "#e4e4e4", 1.0, None);
        svg.text((LEFT - 6.0, f.y(t) + 4.0), &tick_label(t), 11.0, "end", "#444");
    }
    for t in ticks(0.0, f.max_step, 10) {
        svg.line((f.x(t), top), (f.x(t), top + PANEL_H), "#eeeeee", 1.0, None);
        svg.text((f.x(t), top + PANEL_H + 15.0), &tick_label(t), 11.0, "middle", "#444");
    }
    svg.vertical_text((22.0, top + PANEL_H / 2.0), axis_label, 12.0);
    draw_markers(svg, f, &series.markers, first);
    for segment in &series.segments {
        let pts: Vec<(f64, f64)> =
            segment.iter().map(|p| (f.x(p.0), f.y(pick(p)))).filter(|p| p.1.is_finite()).collect();
        svg.polyline(&pts, colour, 1.6, "series");
    }
    if *metric == "loss" {
        draw_evals(svg, f, &series.evals);
    }
    svg.line((LEFT, top + PANEL_H), (LEFT + plot_w, top + PANEL_H), "#444", 1.0, None);
    svg.line((LEFT, top), (LEFT, top + PANEL_H), "#444", 1.0, None);
    svg.end_group();
}

/// The markers' lines (a membership change's labelled where `labelled`).
fn draw_markers(svg: &mut Svg, f: &Frame, markers: &[(&'static str, f64, String)], labelled: bool) {
    let top = f.top;
    for (kind, step, label) in markers {
        let colour = MARKERS.iter().find(|m| m.0 == *kind).map_or("#000", |m| m.1);
        svg.group("marker", &[("kind", kind), ("step", &step.to_string()), ("label", label)]);
        match *kind {
            "checkpoint" => svg.line((f.x(*step), top + PANEL_H - 8.0), (f.x(*step), top + PANEL_H), colour, 2.0, None),
            // Solid and wide, so a recovery's dashed line at the same step leaves it visible.
            "membership" => {
                svg.line((f.x(*step), top), (f.x(*step), top + PANEL_H), colour, 3.0, None);
                if labelled {
                    svg.text((f.x(*step) + 4.0, top + 12.0), label, 10.0, "start", colour);
                }
            }
            _ => svg.line((f.x(*step), top), (f.x(*step), top + PANEL_H), colour, 1.5, Some("5,4")),
        }
        svg.end_group();
    }
}

/// The validation losses: a line per segment, a dot with its tooltip per evaluation.
fn draw_evals(svg: &mut Svg, f: &Frame, evals: &[Vec<(f64, f64)>]) {
    for segment in evals {
        let pts: Vec<(f64, f64)> = segment.iter().map(|e| (f.x(e.0), f.y(e.1))).filter(|p| p.1.is_finite()).collect();
        svg.polyline(&pts, EVAL_COLOUR, 2.0, "eval-series");
        for (e, pt) in segment.iter().zip(&pts) {
            let tip = format!("step {}: validation loss {:.4}", e.0, e.1);
            svg.circle(*pt, 3.0, EVAL_COLOUR, Some(&tip));
        }
    }
}

fn legend(svg: &mut Svg, series: &Series) {
    svg.group("legend", &[]);
    let mut lx = LEFT;
    let entries = [("loss", "#1f77b4", "loss"), ("tokens_per_s", "#2ca02c", "tokens/s")];
    let eval = (!series.evals.is_empty()).then_some(("eval", EVAL_COLOUR, "validation loss"));
    let present = MARKERS.iter().filter(|m| series.markers.iter().any(|s| s.0 == m.0)).map(|m| (m.0, m.1, m.2));
    for (kind, colour, text) in entries.into_iter().chain(eval).chain(present) {
        svg.group("legend-item", &[("kind", kind)]);
        svg.line((lx, 44.0), (lx + 18.0, 44.0), colour, 3.0, None);
        svg.text((lx + 23.0, 48.0), text, 12.0, "start", "#222");
        svg.end_group();
        lx += 40.0 + 7.0 * text.len() as f64;
    }
    svg.end_group();
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_rollback_starts_a_new_segment_and_changes_become_markers() {
        let events = vec![
            json!({ "event": "step", "step": 1, "loss": 5.0, "tokens_per_s": 10.0 }),
            json!({ "event": "step", "step": 2, "loss": 4.0, "tokens_per_s": 12.0 }),
            json!({ "event": "checkpoint", "step": 1 }),
            json!({ "event": "membership", "epoch": 3, "world": 1 }),
            json!({ "event": "rollback", "from_step": 2, "to_step": 1 }),
            json!({ "event": "recovery", "step": 1, "world": 1 }),
            json!({ "event": "step", "step": 2, "loss": 4.0, "tokens_per_s": 6.0 }),
        ];
        let s = series(&events);
        assert_eq!(s.segments.len(), 2);
        let kinds: Vec<(&str, f64)> = s.markers.iter().map(|m| (m.0, m.1)).collect();
        assert_eq!(kinds, vec![("checkpoint", 1.0), ("membership", 2.0), ("rollback", 1.0), ("recovery", 1.0)]);
        assert!(render(&s, "t").unwrap().contains(r#"data-kind="membership""#));
        assert!(render(&Series::default(), "t").is_err());
    }

    /// `eval` events become the validation series over the training loss: its points in order, the loss
    /// panel's range holding them, a legend entry; a step evaluated again starts a new segment.
    #[test]
    fn eval_events_are_drawn_over_the_training_loss() {
        let events = vec![
            json!({ "event": "step", "step": 1, "loss": 5.0, "tokens_per_s": 10.0 }),
            json!({ "event": "step", "step": 2, "loss": 4.0, "tokens_per_s": 10.0 }),
            json!({ "event": "eval", "step": 2, "loss": 6.5, "perplexity": 665.1 }),
            json!({ "event": "step", "step": 3, "loss": 3.0, "tokens_per_s": 10.0 }),
            json!({ "event": "eval", "step": 3, "loss": 6.0, "perplexity": 403.4 }),
            json!({ "event": "eval", "step": 3, "loss": 6.0, "perplexity": 403.4 }),
        ];
        let s = series(&events);
        assert_eq!(s.evals, vec![vec![(2.0, 6.5), (3.0, 6.0)], vec![(3.0, 6.0)]]);
        let svg = render(&s, "t").unwrap();
        assert!(svg.contains(r#"class="eval-series""#), "the validation polyline");
        assert!(svg.contains("step 2: validation loss 6.5000"), "a point with its tooltip");
        assert!(svg.contains(r#"data-kind="eval""#), "a legend entry");
        let dots: Vec<f64> = svg
            .split(r#"<circle "#)
            .skip(1)
            .filter_map(|c| c.split(r#"cy=""#).nth(1)?.split('"').next()?.parse().ok())
            .collect();
        assert_eq!(dots.len(), 3);
        assert!(dots.iter().all(|&y| (TOP..=TOP + PANEL_H).contains(&y)), "inside the loss panel: {dots:?}");
        assert!(dots[0] < dots[1], "a higher validation loss is drawn higher: {dots:?}");
        let without = render(&series(&events[..2]), "t").unwrap();
        assert!(!without.contains("eval-series") && !without.contains(r#"data-kind="eval""#));
    }
}

//! A run directory (`troupe train --run-dir DIR`): `events.jsonl` holds every event of the run, one JSON
//! object per line as `--json` prints them plus `time_us` (wall clock, µs since the Unix epoch) and the
//! ranks' `phases` reports; at the end `trace.json` holds the step phases per rank as a Chrome/Perfetto
//! trace. Each line is flushed as it is written, so a run that is killed keeps its events, and
//! `troupe trace DIR` rebuilds the trace from them.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use super::phases::PhaseSpan;
use super::trace_event::{TraceEvent, TraceFile};

pub const EVENTS: &str = "events.jsonl";
pub const TRACE: &str = "trace.json";
pub const TIMELINE: &str = "timeline.svg";
pub const PLOT: &str = "plot.svg";

/// The pid of the job-level row (recoveries as the controller saw them) in a run's trace.
pub const JOB_PID: u64 = 1_000_000;

pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

#[derive(Debug)]
pub struct RunDir {
    path: PathBuf,
    events: BufWriter<File>,
    failed: bool,
}

impl RunDir {
    /// Creates `path` (and its parents) for a new run. A directory that already holds a run is refused,
    /// so nothing recorded is overwritten.
    pub fn create(path: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(path).with_context(|| format!("--run-dir {}: cannot create it", path.display()))?;
        let events = path.join(EVENTS);
        if events.exists() {
            bail!(
                "--run-dir {}: it already holds a run ({EVENTS}); pick a new directory or remove that one",
                path.display()
            );
        }
        let file = File::create(&events).with_context(|| format!("--run-dir: cannot create {}", events.display()))?;
        Ok(RunDir { path: path.to_owned(), events: BufWriter::new(file), failed: false })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one event (an object; `time_us` added) and flushes it. A write error is logged once and
    /// the run goes on: recording must never stop training.
    pub fn record(&mut self, mut event: Value) {
        if let Value::Object(o) = &mut event {
            o.entry("time_us").or_insert(json!(now_us()));
        }
        let written = writeln!(self.events, "{event}").and_then(|()| self.events.flush());
        if let Err(e) = written {
            if !self.failed {
                tracing::error!(dir = %self.path.display(), "cannot write {EVENTS}, events are being lost: {e}");
            }
            self.failed = true;
        }
    }

    /// Flushes the events and writes `trace.json`; returns its path.
    pub fn finish(mut self) -> anyhow::Result<PathBuf> {
        self.events.flush().with_context(|| format!("writing {}", self.path.join(EVENTS).display()))?;
        let trace = trace_from_events(&read_events(&self.path)?);
        write_trace(&self.path.join(TRACE), &trace)
    }
}

/// Writes a trace file (complete, via a temporary file and a rename).
pub fn write_trace(path: &Path, trace: &TraceFile) -> anyhow::Result<PathBuf> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec(trace)?).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_owned())
}

/// The events of a run directory; a last line cut short by a crash is skipped, any other bad line is an
/// error naming it.
pub fn read_events(dir: &Path) -> anyhow::Result<Vec<Value>> {
    let path = dir.join(EVENTS);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!("{}: no {EVENTS} here; is it a run directory of `troupe train --run-dir`?", dir.display())
    })?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut events = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Value>(line) {
            Ok(v) => events.push(v),
            Err(_) if i + 1 == lines.len() => tracing::warn!("{}: ignoring a truncated last line", path.display()),
            Err(e) => bail!("{} line {}: not a JSON event: {e}", path.display(), i + 1),
        }
    }
    Ok(events)
}

fn event_name(e: &Value) -> &str {
    e.get("event").and_then(Value::as_str).unwrap_or("")
}

/// A pipeline stage's ops of one step as the timeline draws them: waiting is idle — its receives (a
/// receive waits for the neighbour's activation or gradient) and the gaps between its ops (`bubble`) —
/// so the idle time in a stage's row is the step's bubble as `troupe_job_bubble_fraction` counts it.
/// Other phases are kept as they are.
fn with_bubbles(mut spans: Vec<PhaseSpan>) -> Vec<PhaseSpan> {
    let is_op = |s: &PhaseSpan| s.microbatch.is_some();
    let mut ops: Vec<(u64, u64)> =
        spans.iter().filter(|s| is_op(s)).map(|s| (s.start_us, s.start_us + s.dur_us)).collect();
    ops.sort_unstable();
    let mut gaps = Vec::new();
    let mut end = ops.first().map_or(0, |o| o.1);
    for &(start, stop) in ops.iter().skip(1) {
        if start > end {
            gaps.push(PhaseSpan {
                name: "bubble".into(),
                cat: "idle".into(),
                start_us: end,
                dur_us: start - end,
                chunk: None,
                microbatch: None,
            });
        }
        end = end.max(stop);
    }
    for s in spans.iter_mut().filter(|s| is_op(s) && s.cat == "comm" && s.name.starts_with("recv")) {
        s.cat = "idle".into();
    }
    spans.extend(gaps);
    spans
}

/// The run's trace: each rank's phase spans (pid = rank, named "rank R", or by its pipeline stage: "stage
/// S", "stage S / rank R" when the stage has replicas; a stage's waiting drawn as idle, see
/// [`with_bubbles`]), and a job row for each membership change, as the client received the events:
/// "stalled" from the last committed step to the change (the failure happened, and was being detected,
/// in there) and "recovery" from the change to the next committed step. Times are relative to the run's
/// first recorded moment.
pub fn trace_from_events(events: &[Value]) -> TraceFile {
    let (spans, stages) = rank_spans(events);
    let job_spans = job_spans(events);
    let origin = spans
        .iter()
        .map(|(_, s, _)| s.start_us)
        .chain(job_spans.iter().map(|r| r.2))
        .chain(events.iter().filter(|e| event_name(e) == "start").filter_map(|e| e.get("time_us")?.as_u64()))
        .min()
        .unwrap_or(0);
    let mut out = Vec::new();
    let mut ranks: Vec<u64> = spans.iter().map(|(r, _, _)| *r).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for rank in &ranks {
        let label = match stages.get(rank) {
            Some(stage) if stages.values().filter(|s| *s == stage).count() > 1 => {
                format!("stage {stage} / rank {rank}")
            }
            Some(stage) => format!("stage {stage}"),
            None => format!("rank {rank}"),
        };
        out.push(TraceEvent::name_of("process_name", json!(rank), json!(0), &label));
    }
    for (rank, s, args) in spans {
        let ts = s.start_us.saturating_sub(origin) as f64;
        out.push(TraceEvent::span(&s.name, &s.cat, json!(rank), json!(0), ts, s.dur_us as f64, Some(args)));
    }
    if !job_spans.is_empty() {
        out.push(TraceEvent::name_of("process_name", json!(JOB_PID), json!(0), "job"));
        for (name, cat, from, to, what) in job_spans {
            let (ts, dur) = (from.saturating_sub(origin) as f64, (to - from).max(1) as f64);
            let args = Some(json!({ "changes": what }));
            out.push(TraceEvent::span(name, cat, json!(JOB_PID), json!(0), ts, dur, args));
        }
    }
    TraceFile { trace_events: out, display_time_unit: Some("ms".into()) }
}

/// A phase span of a rank (the first), with its trace arguments (the last).
type RankSpan = (u64, PhaseSpan, Value);

/// Each rank's phase spans of the `phases` events (with their bubbles, see [`with_bubbles`]), each with
/// its rank and the trace arguments of its step; and each rank's stage, as last reported (a rank keeps
/// its stage unless the world changes).
fn rank_spans(events: &[Value]) -> (Vec<RankSpan>, BTreeMap<u64, u64>) {
    let mut spans: Vec<RankSpan> = Vec::new();
    let mut stages: BTreeMap<u64, u64> = BTreeMap::new();
    for e in events.iter().filter(|e| event_name(e) == "phases") {
        let rank = e.get("rank").and_then(Value::as_u64).unwrap_or(0);
        let stage = e.get("stage").and_then(Value::as_u64);
        if let Some(stage) = stage {
            stages.insert(rank, stage);
        }
        let args = json!({ "step": e.get("step"), "node": e.get("node"), "attempt": e.get("attempt"), "stage": stage });
        let list: Vec<PhaseSpan> =
            e.get("spans").and_then(|s| serde_json::from_value(s.clone()).ok()).unwrap_or_default();
        spans.extend(with_bubbles(list).into_iter().map(|s| (rank, s, args.clone())));
    }
    (spans, stages)
}

/// The job row's spans (name, category, from, to, what changed): "stalled" from the last progress to a
/// membership change or rollback, "recovery" from it to the next committed step.
fn job_spans(events: &[Value]) -> Vec<(&'static str, &'static str, u64, u64, String)> {
    let mut job_spans = Vec::new();
    let mut interrupted: Option<(u64, String)> = None;
    let mut last_progress: Option<u64> = None;
    for e in events {
        let Some(t) = e.get("time_us").and_then(Value::as_u64) else { continue };
        match event_name(e) {
            "membership" | "rollback" if interrupted.is_none() => {
                let what = e.get("changes").map_or_else(|| event_name(e).to_owned(), Value::to_string);
                if let Some(from) = last_progress {
                    job_spans.push(("stalled", "idle", from, t.max(from), what.clone()));
                }
                interrupted = Some((t, what));
            }
            "step" => {
                if let Some((from, what)) = interrupted.take() {
                    job_spans.push(("recovery", "recovery", from, t.max(from), what));
                }
                last_progress = Some(t);
            }
            "start" => last_progress = Some(t),
            _ => {}
        }
    }
    job_spans
}

/// The part of a run's trace that shows steps `first..=last`: the ranks' spans of those steps and the
/// job row's spans that overlap them (the metadata kept). Err when no span is of those steps, naming the
/// steps the trace has.
pub fn only_steps(trace: &TraceFile, first: u64, last: u64) -> Result<TraceFile, String> {
    let step_of = |e: &TraceEvent| e.args.as_ref().and_then(|a| a.get("step")).and_then(Value::as_u64);
    let kept: Vec<&TraceEvent> = trace
        .trace_events
        .iter()
        .filter(|e| e.is_span() && step_of(e).is_some_and(|s| (first..=last).contains(&s)))
        .collect();
    let (Some(from), Some(to)) = (
        kept.iter().map(|e| e.ts).min_by(f64::total_cmp),
        kept.iter().map(|e| e.ts + e.dur.unwrap_or(0.0)).max_by(f64::total_cmp),
    ) else {
        let steps: Vec<u64> = trace.trace_events.iter().filter_map(step_of).collect();
        let have = match (steps.iter().min(), steps.iter().max()) {
            (Some(a), Some(b)) => format!("its step phases are of steps {a}..{b}"),
            _ => "it has no step phases".to_owned(),
        };
        return Err(format!("no spans of steps {first}..{last}: {have}"));
    };
    let job_row =
        |e: &TraceEvent| e.is_span() && e.pid == json!(JOB_PID) && e.ts < to && e.ts + e.dur.unwrap_or(0.0) > from;
    let trace_events =
        trace.trace_events.iter().filter(|e| !e.is_span() || job_row(e) || kept.contains(e)).cloned().collect();
    Ok(TraceFile { trace_events, display_time_unit: trace.display_time_unit.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_of_steps_keeps_their_spans_and_the_job_rows_spans_over_them() {
        let span =
            |name: &str, start_us: u64| json!({ "name": name, "cat": "compute", "start_us": start_us, "dur_us": 10 });
        let events = vec![
            json!({ "event": "start", "time_us": 1_000 }),
            json!({ "event": "phases", "rank": 0, "step": 1, "spans": [span("s1", 1_000)] }),
            json!({ "event": "step", "step": 1, "time_us": 1_020 }),
            json!({ "event": "membership", "changes": ["Failed"], "time_us": 1_030 }),
            json!({ "event": "phases", "rank": 0, "step": 2, "spans": [span("s2", 1_040)] }),
            json!({ "event": "step", "step": 2, "time_us": 1_060 }),
            json!({ "event": "phases", "rank": 0, "step": 3, "spans": [span("s3", 1_100)] }),
        ];
        let trace = trace_from_events(&events);
        let names =
            |t: &TraceFile| t.trace_events.iter().filter(|e| e.is_span()).map(|e| e.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&only_steps(&trace, 2, 2).unwrap()), ["s2", "recovery"], "the recovery spans step 2");
        assert_eq!(names(&only_steps(&trace, 3, 9).unwrap()), ["s3"]);
        let none = only_steps(&trace, 7, 8).unwrap_err();
        assert!(none.contains("steps 1..3"), "{none}");
    }

    #[test]
    fn phases_become_spans_per_rank_and_a_membership_change_a_recovery_span() {
        let span = |name: &str, cat: &str, start_us: u64| json!({ "name": name, "cat": cat, "start_us": start_us, "dur_us": 10 });
        let events = vec![
            json!({ "event": "start", "time_us": 1_000 }),
            json!({ "event": "phases", "rank": 1, "step": 1, "spans": [span("forward+backward", "compute", 1_100)] }),
            json!({ "event": "phases", "rank": 0, "step": 1, "spans": [span("forward+backward", "compute", 1_050), span("all-reduce", "comm", 1_060)] }),
            json!({ "event": "step", "step": 1, "time_us": 1_200 }),
            json!({ "event": "membership", "changes": ["Failed"], "time_us": 2_000 }),
            json!({ "event": "recovery", "step": 1, "time_us": 2_100 }),
            json!({ "event": "step", "step": 2, "time_us": 2_500 }),
        ];
        let trace = trace_from_events(&events);
        let spans: Vec<&TraceEvent> = trace.trace_events.iter().filter(|e| e.is_span()).collect();
        assert_eq!(spans.len(), 5);
        assert_eq!((spans[0].pid.clone(), spans[0].ts), (json!(1), 100.0));
        let job = |name: &str| spans.iter().find(|e| e.name == name && e.pid == json!(JOB_PID)).unwrap();
        assert_eq!((job("stalled").ts, job("stalled").dur), (200.0, Some(800.0)));
        assert_eq!(
            (job("recovery").ts, job("recovery").dur, job("recovery").cat.as_str()),
            (1_000.0, Some(500.0), "recovery")
        );
        assert_eq!(trace.label("process_name", &json!(0), None).as_deref(), Some("rank 0"));
    }

    /// A pipeline stage's row is named by its stage, and its waiting inside a step is idle: the receive
    /// (waiting for the neighbour) and the gap before its next op; sends, F and B keep their category.
    #[test]
    fn a_pipeline_stages_waits_inside_a_step_are_idle_and_its_row_is_named_by_stage() {
        let op = |name: &str, cat: &str, start_us: u64, dur_us: u64| json!({ "name": name, "cat": cat, "start_us": start_us, "dur_us": dur_us, "chunk": 1, "microbatch": 0 });
        let flush = json!({ "name": "flush", "cat": "comm", "start_us": 1_090, "dur_us": 5 });
        let events = vec![json!({ "event": "phases", "rank": 1, "stage": 1, "step": 1, "spans": [
            op("recv activation c1 mb0", "comm", 1_000, 30),
            op("F c1 mb0", "forward", 1_030, 10),
            op("B c1 mb0", "backward", 1_060, 20),
            op("send gradient c1 mb0", "comm", 1_080, 10),
            flush,
        ] })];
        let trace = trace_from_events(&events);
        let spans: Vec<(&str, &str, f64, f64)> = trace
            .trace_events
            .iter()
            .filter(|e| e.is_span())
            .map(|e| (e.name.as_str(), e.cat.as_str(), e.ts, e.dur.unwrap()))
            .collect();
        assert!(spans.contains(&("recv activation c1 mb0", "idle", 0.0, 30.0)), "{spans:?}");
        assert!(spans.contains(&("bubble", "idle", 40.0, 20.0)), "the gap between F and B: {spans:?}");
        assert!(spans.contains(&("send gradient c1 mb0", "comm", 80.0, 10.0)), "{spans:?}");
        assert!(spans.contains(&("flush", "comm", 90.0, 5.0)), "{spans:?}");
        assert_eq!(spans.iter().filter(|s| s.0 == "bubble").count(), 1, "no gap before the flush: {spans:?}");
        assert_eq!(trace.label("process_name", &json!(1), None).as_deref(), Some("stage 1"));
    }
}

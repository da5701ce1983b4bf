//! `troupe trace RUN_DIR|FILE.json`: a run's step phases (or any Chrome trace-event file, such as a
//! pipeline schedule's) as an SVG timeline per rank or stage, and — from a run directory — the
//! Perfetto/Chrome trace JSON rebuilt from its events.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::json;

use crate::telemetry::run_dir::{self, EVENTS, TIMELINE, TRACE};
use crate::telemetry::timeline;
use crate::telemetry::trace_event::TraceFile;

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// A run directory (`troupe train --run-dir`) or a Chrome trace-event JSON file.
    #[arg(value_name = "RUN_DIR|FILE.json")]
    pub input: PathBuf,
    /// Where to write the SVG timeline (default: RUN_DIR/timeline.svg, or FILE.svg beside the file).
    #[arg(long, value_name = "OUT.svg")]
    pub svg: Option<PathBuf>,
    /// Where to write the Perfetto trace JSON (default: RUN_DIR/trace.json; for a file input only when
    /// given).
    #[arg(long, value_name = "OUT.json")]
    pub perfetto: Option<PathBuf>,
    /// Draw only these steps of a run directory (`FIRST..LAST`, or one step), to see inside them; the
    /// Perfetto trace keeps the whole run.
    #[arg(long, value_name = "FIRST..LAST")]
    pub steps: Option<String>,
    /// Print what was written as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `--steps FIRST..LAST` or `--steps N`.
fn parse_steps(text: &str) -> anyhow::Result<(u64, u64)> {
    let (first, last) = text.split_once("..").unwrap_or((text, text));
    let number = |s: &str| s.trim().parse::<u64>().ok();
    match (number(first), number(last)) {
        (Some(a), Some(b)) if a <= b => Ok((a, b)),
        _ => anyhow::bail!("--steps {text}: give a step like 30 or a range like 30..32 (first ≤ last)"),
    }
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let input = &args.input;
    let (trace, default_svg, default_perfetto) = if input.is_dir() {
        let trace = if input.join(EVENTS).exists() {
            run_dir::trace_from_events(&run_dir::read_events(input)?)
        } else {
            read_trace(&input.join(TRACE)).with_context(|| {
                format!(
                    "{}: neither {EVENTS} nor {TRACE} here; is it a run directory of `troupe train --run-dir`?",
                    input.display()
                )
            })?
        };
        (trace, input.join(TIMELINE), Some(input.join(TRACE)))
    } else {
        (read_trace(input)?, input.with_extension("svg"), None)
    };
    let (drawn, title) = match &args.steps {
        Some(text) if input.is_dir() => {
            let (first, last) = parse_steps(text)?;
            let part = run_dir::only_steps(&trace, first, last)
                .map_err(|why| anyhow::anyhow!("--steps {text} of {}: {why}", input.display()))?;
            (Cow::Owned(part), format!("troupe timeline: {}, steps {first}..{last}", input.display()))
        }
        Some(text) => {
            anyhow::bail!("--steps {text}: only a run directory's phases carry steps; {} is a file", input.display())
        }
        None => (Cow::Borrowed(&trace), format!("troupe timeline: {}", input.display())),
    };
    let svg = timeline::render(&drawn, &title).map_err(|why| anyhow::anyhow!("{}: {why}", input.display()))?;
    let svg_path = args.svg.clone().unwrap_or(default_svg);
    std::fs::write(&svg_path, svg).with_context(|| format!("writing {}", svg_path.display()))?;
    let perfetto = args.perfetto.clone().or(default_perfetto);
    if let Some(path) = &perfetto {
        run_dir::write_trace(path, &trace)?;
    }
    let spans: Vec<_> = drawn.trace_events.iter().filter(|e| e.is_span()).collect();
    let mut rows: Vec<(String, String)> = spans.iter().map(|e| (e.pid.to_string(), e.tid.to_string())).collect();
    rows.sort();
    rows.dedup();
    if args.json {
        println!(
            "{}",
            json!({ "event": "trace", "svg": svg_path, "perfetto": perfetto, "spans": spans.len(), "rows": rows.len() })
        );
    } else {
        println!("wrote {} ({} spans in {} rows)", svg_path.display(), spans.len(), rows.len());
        if let Some(path) = &perfetto {
            println!("wrote {} (open it in https://ui.perfetto.dev or chrome://tracing)", path.display());
        }
    }
    Ok(())
}

fn read_trace(path: &Path) -> anyhow::Result<TraceFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    TraceFile::parse(&text, &path.display().to_string()).map_err(anyhow::Error::msg)
}

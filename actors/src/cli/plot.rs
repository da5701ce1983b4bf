//! `troupe plot RUN_DIR`: loss and throughput against step from a run's events, as SVG, the validation
//! loss over the training loss, with the membership changes, recoveries, rollbacks and checkpoints
//! marked.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::json;

use crate::telemetry::plot;
use crate::telemetry::run_dir::{self, PLOT};

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// A run directory (`troupe train --run-dir`).
    #[arg(value_name = "RUN_DIR")]
    pub run_dir: PathBuf,
    /// Where to write the SVG (default: RUN_DIR/plot.svg).
    #[arg(long, value_name = "OUT.svg")]
    pub out: Option<PathBuf>,
    /// Print what was written as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: PlotArgs) -> anyhow::Result<()> {
    let events = run_dir::read_events(&args.run_dir)?;
    let series = plot::series(&events);
    let title = format!("troupe run {}", args.run_dir.display());
    let svg = plot::render(&series, &title).map_err(|why| anyhow::anyhow!("{}: {why}", args.run_dir.display()))?;
    let out = args.out.clone().unwrap_or_else(|| args.run_dir.join(PLOT));
    std::fs::write(&out, svg).with_context(|| format!("writing {}", out.display()))?;
    let steps: usize = series.segments.iter().map(Vec::len).sum();
    let evals: usize = series.evals.iter().map(Vec::len).sum();
    let markers = series.markers.len();
    if args.json {
        println!("{}", json!({ "event": "plot", "svg": out, "steps": steps, "evals": evals, "markers": markers }));
    } else {
        println!("wrote {} ({steps} steps, {evals} evaluations, {markers} markers)", out.display());
    }
    Ok(())
}

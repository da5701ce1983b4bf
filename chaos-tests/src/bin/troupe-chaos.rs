//! `troupe chaos`: chaos runs on a local cluster. `troupe chaos ...` runs this binary (it sits next to
//! `troupe`), passing the path of the `troupe` binary in TROUPE_BIN.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use troupe_chaos::harness::{self, RunOptions, Scenario, SHIPPED};

#[derive(Debug, Parser)]
#[command(name = "troupe chaos", about = "Crash, pause and restart a running job's nodes and check nothing was lost")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a scenario: start a local cluster, train, inject its faults, check the invariants, report.
    Run {
        /// A shipped scenario (see `troupe chaos list`) or a scenario TOML file.
        #[arg(long)]
        scenario: String,
        /// Train this job config (the TOML `troupe train --config` takes) instead of the scenario's job;
        /// the reference trains it too.
        #[arg(long)]
        job: Option<PathBuf>,
        /// Drives the run's random choices (which node, how far into a step, what a link does to each packet).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the report as one JSON object.
        #[arg(long)]
        json: bool,
        /// The troupe binary the daemons run (default: $TROUPE_BIN, else `troupe` next to this binary).
        #[arg(long)]
        troupe: Option<PathBuf>,
        /// Log filter for the daemons (RUST_LOG syntax; default: info), written to node-N.log in the run directory.
        #[arg(long)]
        log: Option<String>,
        /// Keep the run directory (daemon logs, events.jsonl, checkpoints) even when the run passes.
        #[arg(long)]
        keep: bool,
    },
    /// The shipped scenarios and what each does.
    List {
        /// One JSON object per scenario: name, description, nodes, steps, fault kinds.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("troupe chaos: error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<bool> {
    match cli.command {
        Command::List { json } => {
            for (name, text) in SHIPPED {
                let s = Scenario::parse(text, name)?;
                if json {
                    let faults: Vec<&str> = s.faults.iter().map(|f| f.kind.as_str()).collect();
                    let line = serde_json::json!({ "name": name, "description": s.description, "nodes": s.nodes,
                                                   "steps": s.steps, "faults": faults });
                    println!("{line}");
                } else {
                    println!("{name:<30} {}", s.description);
                }
            }
            Ok(true)
        }
        Command::Run { scenario, job, seed, json, troupe, log, keep } => {
            let mut scenario = Scenario::load(&scenario)?;
            if let Some(job) = job {
                scenario = scenario.with_job_file(&job).context("--job")?;
            }
            let troupe = match troupe.or_else(|| std::env::var_os("TROUPE_BIN").map(PathBuf::from)) {
                Some(t) => t,
                None => std::env::current_exe()?.with_file_name("troupe"),
            };
            if !troupe.exists() {
                anyhow::bail!("no troupe binary at {}; pass --troupe PATH (or build it: make build)", troupe.display());
            }
            if !json {
                eprintln!("troupe chaos: running {} (seed {seed}) on {} daemons ...", scenario.name, scenario.nodes);
            }
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .context("starting the tokio runtime")?;
            let report = runtime.block_on(harness::run(&scenario, &RunOptions { seed, troupe, log, keep }))?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{report}");
            }
            Ok(report.passed)
        }
    }
}

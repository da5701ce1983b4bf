//! `troupe chaos`: chaos runs on a local cluster. `troupe chaos ...` runs this binary (it sits next to
//! `troupe`), passing the path of the `troupe` binary in TROUPE_BIN.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use troupe_chaos::cli::{Cli, Command};
use troupe_chaos::harness::{self, RunOptions, Scenario, SHIPPED};

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

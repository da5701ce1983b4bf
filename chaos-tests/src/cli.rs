//! The command line of `troupe chaos` (the `troupe-chaos` binary, which `troupe chaos` runs), here so that
//! tests can parse the command lines the documentation shows.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "troupe chaos", about = "Crash, pause and restart a running job's nodes and check nothing was lost")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
        /// Log filter for the daemons (RUST_LOG syntax; default: info, with a member's dials and
        /// connections at debug), written to node-N.log in the run directory.
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

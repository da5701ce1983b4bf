//! `troupe chaos ...`: the chaos harness lives in troupe-chaos (it drives the runtime from outside), as the
//! `troupe-chaos` binary next to this one; this subcommand hands it the command line and this binary's
//! path (TROUPE_BIN, the binary its daemons run).

use std::os::unix::process::CommandExt;
use std::process::Command;

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
#[command(disable_help_flag = true)]
pub struct ChaosArgs {
    /// `run --scenario NAME|FILE [--seed S] [--json]`, or `list` (see `troupe chaos --help`).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

pub fn run(args: ChaosArgs) -> anyhow::Result<()> {
    let me = std::env::current_exe().context("locating the troupe binary")?;
    let chaos = me.with_file_name("troupe-chaos");
    if !chaos.exists() {
        anyhow::bail!(
            "the chaos harness is not installed next to {} (no {}); build it with `cargo build --release -p troupe-chaos` or `make build`",
            me.display(),
            chaos.display()
        );
    }
    let error = Command::new(&chaos).args(&args.args).env("TROUPE_BIN", &me).exec();
    Err(error).with_context(|| format!("running {}", chaos.display()))
}

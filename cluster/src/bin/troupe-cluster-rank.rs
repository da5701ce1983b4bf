//! The cluster crate's own launcher binary, for tests and for benchmarking without libtorch:
//!
//! - no arguments: run as a rank (spec in `TROUPE_RANK_SPEC`), print one JSON report line;
//! - `bench --world N [--hosts H [--flat]] --mib M --iters K [--transport quic|local|encrypted-tcp|plaintext-tcp] [--peer] [--json]`: the same
//!   benchmark as `troupe bench allreduce` (the same flags), re-executing this binary for each rank;
//! - `crypto [--mib M] [--iters K] [--json]`: TLS record sealing and opening per core, for each rustls
//!   crypto provider built in (ring; aws-lc-rs with `--features aws-lc-rs`).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use troupe_cluster::bench::{run_allreduce_bench, run_crypto_bench, AllreduceArgs, CryptoArgs};

#[derive(Debug, Parser)]
#[command(
    name = "troupe-cluster-rank",
    about = "A rank process of the multi-process tests (no arguments: the spec in TROUPE_RANK_SPEC), or the \
             all-reduce benchmark without libtorch"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// All-reduce bus bandwidth over QUIC, TCP or the same-host transport, optionally beside Gloo (--peer):
    /// `troupe bench allreduce` without libtorch.
    Bench(AllreduceArgs),
    /// TLS 1.3 (AES-128-GCM) sealing and opening, GB/s on one core, per crypto provider built in.
    Crypto(CryptoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("troupe-cluster-rank: error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let args = match cli.command {
        None => return troupe_cluster::bench::run_rank_from_env(),
        Some(Command::Crypto(args)) => {
            for report in run_crypto_bench(&args)? {
                if args.json {
                    println!("{}", serde_json::to_string(&report)?);
                } else {
                    println!("{report:?}");
                }
            }
            return Ok(());
        }
        Some(Command::Bench(args)) => args,
    };
    let json = args.json;
    let exe = std::env::current_exe()?;
    let report = run_allreduce_bench(&args.bench(), &exe, &[])?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{report:#?}");
    }
    Ok(())
}

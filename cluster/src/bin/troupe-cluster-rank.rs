//! The cluster crate's own launcher binary, for tests and for benchmarking without libtorch:
//!
//! - no arguments: run as a rank (spec in `TROUPE_RANK_SPEC`), print one JSON report line;
//! - `bench --world N [--hosts H [--flat]] --mib M --iters K [--transport quic|local|encrypted-tcp|plaintext-tcp] [--peer] [--json]`: the same
//!   benchmark as `troupe bench allreduce`, re-executing this binary for each rank.

use anyhow::Context;
use troupe_cluster::bench::{default_peer_script, default_python, run_allreduce_bench, AllreduceBench, BenchTransport};

const USAGE: &str = "usage: troupe-cluster-rank bench [--world N] [--hosts H [--flat]] [--mib M] [--iters K] \
                     [--warmup W] [--transport quic|local|encrypted-tcp|plaintext-tcp] [--peer] [--json]";

fn parse_bench(args: &[String]) -> anyhow::Result<(AllreduceBench, bool)> {
    let mut b = AllreduceBench {
        world: 2,
        hosts: 1,
        flat: false,
        mib: 64,
        iters: 10,
        warmup_iters: 2,
        transport: BenchTransport::Quic,
        peer: false,
        python: default_python(),
        peer_script: default_peer_script(),
        rank_timeout_ms: 600_000,
    };
    let mut json = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--world" => b.world = value()?.parse()?,
            "--hosts" => b.hosts = value()?.parse()?,
            "--flat" => b.flat = true,
            "--mib" => b.mib = value()?.parse()?,
            "--iters" => b.iters = value()?.parse()?,
            "--warmup" => b.warmup_iters = value()?.parse()?,
            "--transport" => b.transport = value()?.parse().map_err(anyhow::Error::msg)?,
            "--peer" => b.peer = true,
            "--json" => json = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => anyhow::bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok((b, json))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("bench") {
        let (bench, json) = parse_bench(&args[1..])?;
        let exe = std::env::current_exe()?;
        let report = run_allreduce_bench(&bench, &exe, &[])?;
        if json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!("{report:#?}");
        }
        return Ok(());
    }
    troupe_cluster::bench::run_rank_from_env()
}

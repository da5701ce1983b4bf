//! `troupe bench allreduce --world N --mib M --iters K [--transport quic|local|encrypted-tcp|plaintext-tcp] [--peer] --json`:
//! launches N rank processes on loopback (re-executing this binary as `troupe bench allreduce-rank`),
//! and prints the all-reduce bus bandwidth (busbw_GBps = algbw × 2(n−1)/n), with `--peer` beside
//! PyTorch Gloo's measured the same way in the same run (bench/peers/gloo_allreduce.py).

use std::path::PathBuf;

use troupe_cluster::bench::{default_peer_script, default_python, run_allreduce_bench, AllreduceBench, BenchTransport};

/// The arguments that make this binary run one rank (see `run_rank`).
pub const RANK_ARGS: [&str; 2] = ["bench", "allreduce-rank"];

#[derive(Debug, clap::Args)]
pub struct AllreduceArgs {
    /// Number of rank processes.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Spread the ranks over this many hosts (loopback addresses 127.0.0.1, 127.0.0.2, …): all-reduce
    /// then runs in two tiers, within each host in shared memory and across hosts over the transport
    /// (QUIC, or encrypted or plaintext TCP).
    #[arg(long, default_value_t = 1)]
    pub hosts: usize,
    /// With --hosts: one flat ring among all ranks, no tiers, for comparison (messages between ranks
    /// of one host still take the same-host transport, as in the runtime).
    #[arg(long)]
    pub flat: bool,
    /// Size of the f32 buffer all-reduced, in MiB.
    #[arg(long, default_value_t = 64)]
    pub mib: usize,
    /// Timed iterations (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// quic (mutual-TLS QUIC on loopback), local (the same-host transport), encrypted-tcp (the opt-in
    /// TCP data plane, every byte sealed with AES-GCM, set up through QUIC) or plaintext-tcp (the same
    /// unencrypted, for trusted fabrics).
    #[arg(long, default_value = "quic")]
    pub transport: String,
    /// Also run PyTorch Gloo (bench/peers/gloo_allreduce.py) and report both.
    #[arg(long)]
    pub peer: bool,
    /// Python with torch for --peer (default: $TROUPE_TORCH_PYTHON or the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// The Gloo peer script (default: bench/peers/gloo_allreduce.py of this checkout).
    #[arg(long)]
    pub peer_script: Option<PathBuf>,
    /// One JSON object on one line.
    #[arg(long)]
    pub json: bool,
    /// Kill every rank after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_s: u64,
}

pub fn run(args: AllreduceArgs) -> anyhow::Result<()> {
    let transport: BenchTransport = args.transport.parse().map_err(anyhow::Error::msg)?;
    let bench = AllreduceBench {
        world: args.world,
        hosts: args.hosts,
        flat: args.flat,
        mib: args.mib,
        iters: args.iters,
        warmup_iters: args.warmup,
        transport,
        peer: args.peer,
        python: args.python.unwrap_or_else(default_python),
        peer_script: args.peer_script.unwrap_or_else(default_peer_script),
        rank_timeout_ms: args.timeout_s * 1000,
    };
    let exe = std::env::current_exe()?;
    let report = run_allreduce_bench(&bench, &exe, &RANK_ARGS)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "all-reduce {} MiB f32, {} ranks{} over {:?}{}: busbw {:.3} GB/s ({:.1} ms/iter)",
            report.mib,
            report.world,
            if report.hosts > 1 { format!(" on {} hosts", report.hosts) } else { String::new() },
            report.transport,
            if report.host_tier {
                " in two tiers"
            } else if report.same_host_routes {
                " flat (ranks of one host over their sockets)"
            } else {
                ""
            },
            report.busbw_gbps,
            report.seconds_per_iter * 1e3
        );
        if let (Some(p), Some(r)) = (&report.peer, report.ratio_vs_peer) {
            println!("  {} busbw {:.3} GB/s -> ratio {:.2}x", p.name, p.busbw_gbps, r);
        }
    }
    Ok(())
}

/// Body of the hidden `troupe bench allreduce-rank` subcommand: runs one rank from the spec in
/// `TROUPE_RANK_SPEC` and prints its JSON report.
pub fn run_rank() -> anyhow::Result<()> {
    troupe_cluster::bench::run_rank_from_env()
}

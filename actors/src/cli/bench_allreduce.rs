//! `troupe bench allreduce --world N --mib M --iters K [--transport quic|local|encrypted-tcp|plaintext-tcp] [--netns H [--rate-gbit G]] [--peer] --json`:
//! launches N rank processes on loopback, or with `--netns` spread over H network namespaces joined by
//! veth links (re-executing this binary as `troupe bench allreduce-rank`),
//! and prints the all-reduce bus bandwidth (busbw_GBps = algbw × 2(n−1)/n), with `--peer` beside
//! PyTorch Gloo's measured the same way in the same run (bench/peers/gloo_allreduce.py).

use troupe_cluster::bench::run_allreduce_bench;
pub use troupe_cluster::bench::AllreduceArgs;

/// The arguments that make this binary run one rank (see `run_rank`).
pub const RANK_ARGS: [&str; 2] = ["bench", "allreduce-rank"];

pub fn run(args: AllreduceArgs) -> anyhow::Result<()> {
    let json = args.json;
    let bench = args.bench();
    let exe = std::env::current_exe()?;
    let report = run_allreduce_bench(&bench, &exe, &RANK_ARGS)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "all-reduce {} MiB f32, {} ranks{} over {:?}{}: busbw {:.3} GB/s ({:.1} ms/iter)",
            report.mib,
            report.world,
            hosts_text(&report),
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
        if report.verified {
            println!("  result checked: one more all-reduce gave exactly the sum on every rank");
        }
        if report.cpu_seconds_per_iter > 0.0 {
            println!(
                "  CPU {:.1} ms per all-reduce, all ranks together ({:.2} ns per payload byte)",
                report.cpu_seconds_per_iter * 1e3,
                report.cpu_ns_per_byte
            );
        }
        if let (Some(p), Some(r)) = (&report.peer, report.ratio_vs_peer) {
            println!("  {} busbw {:.3} GB/s -> ratio {:.2}x", p.name, p.busbw_gbps, r);
            if let (Some(cpu), Some(ratio)) = (p.cpu_seconds_per_iter, report.cpu_ratio_vs_peer) {
                println!("  {} CPU {:.1} ms per all-reduce -> ours {:.2}x its CPU", p.name, cpu * 1e3, ratio);
            }
        }
    }
    Ok(())
}

fn hosts_text(report: &troupe_cluster::bench::AllreduceReport) -> String {
    match (report.netns, report.rate_gbit) {
        (0, _) if report.hosts > 1 => format!(" on {} hosts", report.hosts),
        (0, _) => String::new(),
        (n, None) => format!(" in {n} network namespaces"),
        (n, Some(g)) => format!(" in {n} network namespaces ({g} Gbit/s links)"),
    }
}

/// Body of the hidden `troupe bench allreduce-rank` subcommand: runs one rank from the spec in
/// `TROUPE_RANK_SPEC` and prints its JSON report.
pub fn run_rank() -> anyhow::Result<()> {
    troupe_cluster::bench::run_rank_from_env()
}

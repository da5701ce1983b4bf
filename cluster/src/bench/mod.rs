//! `troupe bench allreduce`: launches N rank processes on this machine (by re-executing the current
//! executable with a hidden subcommand), times all-reduce over QUIC on loopback or the same-host
//! transport, and reports bus bandwidth as nccl-tests define it: algbw × 2(n−1)/n. Optionally runs the
//! PyTorch Gloo peer script the same way, so one command prints both figures.

mod args;
mod crypto;
pub mod launch;
pub mod netns;
mod peer;
mod rank;
mod spec;

pub use args::AllreduceArgs;
pub use crypto::{run_crypto_bench, CryptoArgs, CryptoReport};
pub use launch::{launch_ranks, launch_ranks_netns, LaunchedRanks, Placement, RANK_SPEC_ENV};
pub use netns::NetnsHosts;
pub use peer::{kill_children, run_gloo_peer, run_gloo_peer_netns, wait_json_line, GlooJob, PeerReport};
pub use rank::{run_rank, run_rank_from_env};
pub use spec::{AllreduceReport, BenchTransport, RankMode, RankReport, RankSpec};

use std::path::PathBuf;
use std::time::Duration;

/// What `troupe bench allreduce` takes.
#[derive(Clone, Debug)]
pub struct AllreduceBench {
    pub world: usize,
    /// Hosts (loopback addresses) the QUIC ranks are spread over; with more than one, all-reduce runs
    /// in two tiers unless `flat`, and ranks that share a host exchange messages over a same-host
    /// transport either way.
    pub hosts: usize,
    pub flat: bool,
    /// Network namespaces to run the ranks (and Gloo's) in, as that many hosts; 0: loopback.
    pub netns: usize,
    /// With `netns`: each namespace's link shaped to this many Gbit/s.
    pub rate_gbit: Option<f64>,
    pub mib: usize,
    pub iters: usize,
    pub warmup_iters: usize,
    pub transport: BenchTransport,
    /// Run the Gloo peer script too and report both.
    pub peer: bool,
    pub python: PathBuf,
    pub peer_script: PathBuf,
    pub rank_timeout_ms: u64,
}

/// QUIC idle timeout used by the benchmark unless overridden.
pub const BENCH_IDLE_TIMEOUT_MS: u64 = 10_000;

/// Optional JSON object overriding [`crate::TransportConfig`] fields for the benchmark (default:
/// [`crate::TransportConfig::loopback`] on loopback, the network profile [`crate::TransportConfig::default`]
/// between network namespaces, as daemons on separate hosts use), e.g. `{"pipeline_slice_bytes": 1048576}`.
pub const TRANSPORT_CONFIG_ENV: &str = "TROUPE_TRANSPORT_CONFIG";

/// The benchmark's transport config: the loopback profile (or between hosts, `network`, the network
/// profile: MTU 1452 on a 1500-byte link) with [`TRANSPORT_CONFIG_ENV`]'s fields over it.
pub fn bench_transport_config(network: bool) -> anyhow::Result<crate::TransportConfig> {
    let base = if network { crate::TransportConfig::default() } else { crate::TransportConfig::loopback() };
    let Ok(json) = std::env::var(TRANSPORT_CONFIG_ENV) else { return Ok(base) };
    let bad = |e: serde_json::Error| {
        anyhow::anyhow!("{TRANSPORT_CONFIG_ENV}={json}: {e} (a JSON object of TransportConfig fields)")
    };
    let serde_json::Value::Object(over) = serde_json::from_str(&json).map_err(bad)? else {
        anyhow::bail!("{TRANSPORT_CONFIG_ENV}={json}: not a JSON object of TransportConfig fields");
    };
    let mut merged = serde_json::to_value(&base)?;
    merged.as_object_mut().expect("a struct serializes to an object").extend(over);
    serde_json::from_value(merged).map_err(bad)
}

/// Where the torch venv lives when `TROUPE_TORCH_PYTHON` is not set.
pub const DEFAULT_TORCH_PYTHON: &str = "/root/.cache/troupe/venv-torch-2.11.0/bin/python";

pub fn default_peer_script() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../bench/peers/gloo_allreduce.py"))
}

pub fn default_python() -> PathBuf {
    std::env::var_os("TROUPE_TORCH_PYTHON").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DEFAULT_TORCH_PYTHON))
}

/// Bus bandwidth of an all-reduce of `bytes` taking `seconds` on `n` ranks, in GB/s.
pub fn busbw_gbps(bytes: usize, seconds: f64, n: usize) -> f64 {
    if n < 2 || seconds <= 0.0 {
        return 0.0;
    }
    bytes as f64 / seconds / 1e9 * 2.0 * (n as f64 - 1.0) / n as f64
}

/// Refuses flag combinations the benchmark cannot run, naming the flag.
fn check_flags(bench: &AllreduceBench) -> anyhow::Result<()> {
    if bench.hosts > 1 && !bench.transport.uses_quic() {
        anyhow::bail!(
            "--hosts {} spreads ranks over loopback addresses: it needs --transport quic, encrypted-tcp or plaintext-tcp",
            bench.hosts
        );
    }
    if bench.hosts == 0 || bench.hosts > bench.world {
        anyhow::bail!("--hosts {} with --world {}: use 1 to {} hosts", bench.hosts, bench.world, bench.world);
    }
    if bench.netns > 0 {
        if !bench.transport.uses_quic() {
            anyhow::bail!(
                "--netns puts ranks on separate hosts: it needs --transport quic, encrypted-tcp or plaintext-tcp"
            );
        }
        if bench.hosts > 1 || bench.flat {
            anyhow::bail!("--netns {} sets the hosts itself: leave --hosts and --flat out", bench.netns);
        }
        if bench.netns < 2 || bench.netns > bench.world {
            anyhow::bail!("--netns {} with --world {}: use 2 to {} namespaces", bench.netns, bench.world, bench.world);
        }
    } else if bench.rate_gbit.is_some() {
        anyhow::bail!("--rate-gbit shapes the links between namespaces: it needs --netns");
    }
    if bench.rate_gbit.is_some_and(|r| !(r > 0.0 && r <= 400.0)) {
        anyhow::bail!("--rate-gbit {:?}: use a rate above 0 and at most 400 Gbit/s", bench.rate_gbit);
    }
    Ok(())
}

/// Runs the benchmark. `rank_args` are the arguments that make `exe` run [`run_rank_from_env`].
pub fn run_allreduce_bench(
    bench: &AllreduceBench,
    exe: &std::path::Path,
    rank_args: &[&str],
) -> anyhow::Result<AllreduceReport> {
    check_flags(bench)?;
    let elems = bench.mib * (1 << 20) / 4;
    let mode = RankMode::Bench { elems, iters: bench.iters, warmup_iters: bench.warmup_iters };
    let config = bench_transport_config(bench.netns > 0)?;
    let net = if bench.netns > 0 { Some(NetnsHosts::create(bench.netns, bench.rate_gbit)?) } else { None };
    let launched = match &net {
        Some(net) => launch_ranks_netns(exe, rank_args, bench.world, bench.transport, mode, config, net)?,
        None => {
            let placement = Placement { hosts: bench.hosts, flat: bench.flat };
            launch_ranks(exe, rank_args, bench.world, bench.transport, mode, config, placement)?
        }
    };
    let reports = launched.wait_all(bench.rank_timeout_ms)?;
    let errors: Vec<String> =
        reports.iter().filter_map(|r| r.error.as_ref().map(|e| format!("rank {}: {e}", r.rank))).collect();
    if !errors.is_empty() {
        anyhow::bail!("benchmark failed: {}", errors.join("; "));
    }
    let seconds = reports.iter().map(|r| r.seconds_per_iter).fold(0f64, f64::max);
    let bytes = elems * 4;
    let busbw = busbw_gbps(bytes, seconds, bench.world);
    let job = GlooJob {
        python: &bench.python,
        script: &bench.peer_script,
        world: bench.world,
        mib: bench.mib,
        iters: bench.iters,
        warmup: bench.warmup_iters,
    };
    let peer = match (&net, bench.peer) {
        (_, false) => None,
        (Some(net), true) => Some(run_gloo_peer_netns(&job, net, Duration::from_millis(bench.rank_timeout_ms))?),
        (None, true) => Some(run_gloo_peer(job.python, job.script, job.world, job.mib, job.iters, job.warmup)?),
    };
    let ratio = peer.as_ref().map(|p| if p.busbw_gbps > 0.0 { busbw / p.busbw_gbps } else { 0.0 });
    let cpu: f64 = reports.iter().map(|r| r.cpu_seconds_per_iter).sum();
    let cpu_ratio = peer.as_ref().and_then(|p| p.cpu_seconds_per_iter.filter(|&c| c > 0.0)).map(|c| cpu / c);
    Ok(AllreduceReport {
        bench: "allreduce".into(),
        transport: bench.transport,
        world: bench.world,
        hosts: if bench.netns > 0 { bench.netns } else { bench.hosts },
        host_tier: reports.iter().all(|r| r.host_tier),
        same_host_routes: reports.iter().all(|r| r.same_host_routes),
        mib: bench.mib,
        iters: bench.iters,
        seconds_per_iter: seconds,
        algbw_gbps: if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { 0.0 },
        busbw_gbps: busbw,
        cpu_seconds_per_iter: cpu,
        cpu_ns_per_byte: cpu * 1e9 / bytes as f64,
        shared_memory: reports.iter().all(|r| r.shared_memory),
        netns: bench.netns,
        rate_gbit: bench.rate_gbit.filter(|_| bench.netns > 0),
        verified: reports.iter().all(|r| r.verified),
        peer,
        ratio_vs_peer: ratio,
        cpu_ratio_vs_peer: cpu_ratio,
    })
}

//! `troupe bench train --world N --netns N [--rate-gbit G]`: what periodic synchronization is for — the
//! same job trained by N daemons, each in its own network namespace (node i's egress shaped to G Gbit/s
//! by tc tbf: a slow inter-host link; [`troupe_cluster::netns`]), as DDP (overlapped), DiLoCo with H = 8
//! and H = 32, and Streaming DiLoCo (4 fragments, H = 32), one after the other in the same command on
//! fresh clusters in the same namespaces, on the same token budget. Reported per run: tokens/s (as
//! `data_parallel` measures it: between committed step events, after the warm-up), the bytes on the
//! wire per step — every node's link interface's transmitted bytes (`ip -s link`, headers and the
//! control plane included) over the job, divided by its steps — the largest burst a synchronization
//! sends (the peak bytes a step moved), and the final training loss; then each one's ratio to DDP.
//!
//! With `--peer` (gpt-tiny), PyTorch's DistributedDataParallel over Gloo trains the same model, per-rank
//! micro-batch, context, threads and steps in the same namespaces after troupe's runs: one process per
//! namespace (bench/peers/ddp_gpt_tiny.py `--rank`), rank 0's address the rendezvous, Gloo bound to the
//! namespace's link; its tokens/s (rank 0's timed steps), bytes on the wire per step (measured as ours,
//! over the whole run: the rendezvous and the parameters' broadcast included) and final loss, and troupe
//! DDP's tokens/s ratio to it.

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_cluster::bench::{kill_children, wait_json_line};
use troupe_cluster::netns::{run_command, Layout, Namespaces, Subnet, IFNAME};
use troupe_model::ModelConfig;

use super::data_parallel::{run_job_with, Variant};
use super::{BenchTrainArgs, WARMUP_STEPS};
use crate::api::{LocalCluster, LocalClusterOptions, NodeHost};

/// Silence after which a daemon is declared dead (as `data_parallel`'s: the benchmark measures training).
const FAILURE_TIMEOUT_MS: u64 = 10_000;

/// One configuration of the series: a name, `parallel.sync`, `sync_every`, `fragments`.
struct Setting {
    name: &'static str,
    sync: &'static str,
    every: u64,
    fragments: usize,
}

const SERIES: [Setting; 4] = [
    Setting { name: "DDP", sync: "every_step", every: 1, fragments: 1 },
    Setting { name: "DiLoCo H=8", sync: "diloco", every: 8, fragments: 1 },
    Setting { name: "DiLoCo H=32", sync: "diloco", every: 32, fragments: 1 },
    Setting { name: "Streaming DiLoCo H=32 P=4", sync: "diloco", every: 32, fragments: 4 },
];

/// What `--netns` needs besides what `troupe bench train` checks.
pub(super) fn check(args: &BenchTrainArgs) -> anyhow::Result<()> {
    if args.world != args.netns || args.world < 2 {
        bail!("--netns {}: one daemon per namespace; pass --world {} (at least 2)", args.netns, args.netns.max(2));
    }
    if args.shard != "none" || args.tp.is_some() || args.precision != "fp32" {
        bail!("--netns runs DDP and DiLoCo in fp32 with no --shard or --tp; drop them");
    }
    if args.peer && args.model != "gpt-tiny" {
        bail!("--peer with --netns: the PyTorch DDP peer trains gpt-tiny there; drop --peer or --model {}", args.model);
    }
    if args.steps < 64 {
        bail!("--steps {} with --netns: at least 64, so that H = 32 synchronizes more than once", args.steps);
    }
    if let Some(rate) = args.rate_gbit {
        if !(rate.is_finite() && rate > 0.0) {
            bail!("--rate-gbit {rate}: must be a positive number of Gbit/s (e.g. 1)");
        }
    }
    Ok(())
}

pub(super) fn run(args: BenchTrainArgs, model: ModelConfig) -> anyhow::Result<()> {
    let layout = Layout {
        prefix: "troupe-benchtrain-",
        nodes: args.world,
        subnet: Subnet::PerRun { from: 100, span: 50 },
        host_address: true,
        rate_gbit: args.rate_gbit,
        iptables: false,
    };
    let net = Namespaces::create(&layout).map_err(|e| {
        anyhow::anyhow!(
            "--netns puts every daemon in a network namespace: it {e}; run as root with iproute2, or leave out --netns"
        )
    })?;
    let threads = if args.threads > 0 { args.threads } else { 1 };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut runs = Vec::new();
    for setting in &SERIES {
        let run = runtime.block_on(measure(&net, &model, &args, threads, setting))?;
        if !args.json {
            print_run(setting, &run);
        }
        runs.push((setting, run));
    }
    let peer = if args.peer { Some(measure_peer(&net, &model, &args, threads)?) } else { None };
    if let (Some(peer), false) = (&peer, args.json) {
        println!(
            "{:<26} {:>8.0} tokens/s, {:>12.0} bytes on the wire, final loss {:.4}",
            "PyTorch DDP (Gloo)", peer.tokens_per_s, peer.wire_bytes, peer.final_loss
        );
    }
    let report = report(&args, &model, threads, &runs, peer.as_ref());
    if args.json {
        println!("{report}");
    } else {
        print_ratios(&report);
    }
    Ok(())
}

/// One run's figures.
struct Figures {
    tokens_per_s: f64,
    final_loss: f64,
    /// Bytes every node's link interface transmitted over the job.
    wire_bytes: u64,
}

/// One configuration on a fresh cluster inside the namespaces.
async fn measure(
    net: &Namespaces,
    model: &ModelConfig,
    args: &BenchTrainArgs,
    threads: usize,
    setting: &Setting,
) -> anyhow::Result<Figures> {
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    let mut options = LocalClusterOptions::new(args.world);
    options.torch_threads = threads;
    options.membership.failure_timeout_ms = FAILURE_TIMEOUT_MS;
    options.hosts = (0..net.nodes()).map(|i| NodeHost { prefix: net.exec_prefix(i), ip: net.addr(i).into() }).collect();
    let cluster = LocalCluster::processes(&binary, options).await?;
    let before = wire_bytes(net)?;
    let variant = Variant { sync: setting.sync, sync_every: setting.every, ..Variant::ddp("fp32") };
    let outcome = run_job_with(&cluster, model, args.world, args.steps, threads, variant, setting.fragments).await;
    let after = wire_bytes(net);
    cluster.shutdown().await;
    let run = outcome?;
    Ok(Figures {
        tokens_per_s: run.tokens_per_s,
        final_loss: run.final_loss,
        wire_bytes: after?.saturating_sub(before),
    })
}

/// Longest a PyTorch peer run may take (it trains the same steps as one of ours).
const PEER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// PyTorch DDP over Gloo (bench/peers/ddp_gpt_tiny.py), one rank per namespace: rank 0's address the
/// rendezvous, Gloo's sockets on the namespace's link. Rank 0's tokens/s and final loss.
fn measure_peer(
    net: &Namespaces,
    model: &ModelConfig,
    args: &BenchTrainArgs,
    threads: usize,
) -> anyhow::Result<Figures> {
    let python = super::peer_python(args.python.as_ref());
    let script = super::peer_script("ddp_gpt_tiny.py")?;
    let flags = [
        ("--world", args.world.to_string()),
        ("--steps", args.steps.to_string()),
        ("--warmup", WARMUP_STEPS.to_string()),
        ("--micro-batch", super::MICRO_BATCH.to_string()),
        ("--context", model.context.to_string()),
        ("--threads", threads.to_string()),
        ("--master-addr", net.addr(0).to_string()),
        ("--master-port", "29512".to_string()),
    ];
    let before = wire_bytes(net)?;
    let deadline = std::time::Instant::now() + PEER_TIMEOUT;
    let mut children = Vec::new();
    for rank in 0..args.world {
        let mut command = net.command(rank, &python);
        command.arg(&script).args(flags.iter().flat_map(|(flag, value)| [*flag, value.as_str()]));
        command.args(["--rank", &rank.to_string()]).env("GLOO_SOCKET_IFNAME", IFNAME);
        match command.stdout(std::process::Stdio::piped()).spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                kill_children(&mut children);
                return Err(e)
                    .with_context(|| format!("starting the DDP peer's rank {rank} with {}", python.display()));
            }
        }
    }
    let mut reports = Vec::new();
    for rank in 0..children.len() {
        let line = wait_json_line(&mut children[rank], deadline);
        match line.as_deref().and_then(|l| serde_json::from_str::<Value>(l).ok()) {
            Some(report) => reports.push(report),
            None => {
                kill_children(&mut children);
                bail!(
                    "the DDP peer's rank {rank} in namespace {} gave no report (its stderr above)",
                    net.namespace(rank)
                );
            }
        }
    }
    let wire = wire_bytes(net)?.saturating_sub(before);
    let figure = |key: &str| reports[0][key].as_f64().with_context(|| format!("the DDP peer's {key}: {}", reports[0]));
    Ok(Figures { tokens_per_s: figure("tokens_per_s")?, final_loss: figure("final_loss")?, wire_bytes: wire })
}

/// The bytes all nodes' link interfaces have transmitted.
fn wire_bytes(net: &Namespaces) -> anyhow::Result<u64> {
    let mut total = 0;
    for i in 0..net.nodes() {
        let json = run_command(&["ip", "-n", net.namespace(i), "-s", "-j", "link", "show", IFNAME])?;
        total += tx_bytes_of(&json).with_context(|| format!("reading {IFNAME}'s tx bytes in {}", net.namespace(i)))?;
    }
    Ok(total)
}

/// `stats64.tx.bytes` of the one interface in `ip -s -j link show` output.
fn tx_bytes_of(json: &str) -> Option<u64> {
    let value: Value = serde_json::from_str(json).ok()?;
    value.get(0)?.get("stats64")?.get("tx")?.get("bytes")?.as_u64()
}

fn report(
    args: &BenchTrainArgs,
    model: &ModelConfig,
    threads: usize,
    runs: &[(&Setting, Figures)],
    peer: Option<&Figures>,
) -> Value {
    let steps = args.steps + WARMUP_STEPS;
    let ddp = &runs[0].1;
    let ddp_per_step = ddp.wire_bytes as f64 / steps as f64;
    let rows: Vec<Value> = runs
        .iter()
        .map(|(s, f)| {
            let per_step = f.wire_bytes as f64 / steps as f64;
            json!({
                "name": s.name, "sync": s.sync, "sync_every": s.every, "fragments": s.fragments,
                "tokens_per_s": f.tokens_per_s, "ratio_vs_ddp": f.tokens_per_s / ddp.tokens_per_s,
                "wire_bytes_per_step": per_step, "bytes_ratio_vs_ddp": per_step / ddp_per_step,
                "final_loss": f.final_loss,
            })
        })
        .collect();
    let peer = peer.map(|p| {
        let per_step = p.wire_bytes as f64 / steps as f64;
        json!({
            "name": "pytorch-ddp-gloo", "tokens_per_s": p.tokens_per_s, "wire_bytes_per_step": per_step,
            "final_loss": p.final_loss, "ddp_ratio_vs_peer": ddp.tokens_per_s / p.tokens_per_s,
            "ddp_bytes_ratio_vs_peer": ddp_per_step / per_step,
        })
    });
    json!({
        "bench": "train", "netns": args.netns, "rate_gbit": args.rate_gbit, "world": args.world,
        "model": args.model, "params": model.param_count(), "context": model.context,
        "global_batch": super::MICRO_BATCH * args.world, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "torch_threads": threads, "runs": rows, "peer": peer,
    })
}

fn print_run(setting: &Setting, run: &Figures) {
    println!(
        "{:<26} {:>8.0} tokens/s, {:>12.0} bytes on the wire, final loss {:.4}",
        setting.name, run.tokens_per_s, run.wire_bytes, run.final_loss
    );
}

fn print_ratios(report: &Value) {
    let peer = &report["peer"];
    if let Some(ratio) = peer["ddp_ratio_vs_peer"].as_f64() {
        println!(
            "troupe DDP: tokens/s × {ratio:.3} of PyTorch DDP over Gloo, bytes per step × {:.3} of its",
            peer["ddp_bytes_ratio_vs_peer"].as_f64().unwrap_or(f64::NAN)
        );
    }
    for row in report["runs"].as_array().into_iter().flatten() {
        println!(
            "{:<26} tokens/s × {:.3} of DDP, bytes per step {:.0} (× {:.4} of DDP)",
            row["name"].as_str().unwrap_or(""),
            row["ratio_vs_ddp"].as_f64().unwrap_or(f64::NAN),
            row["wire_bytes_per_step"].as_f64().unwrap_or(f64::NAN),
            row["bytes_ratio_vs_ddp"].as_f64().unwrap_or(f64::NAN),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tx_bytes_are_read_from_ip_s_json() {
        let json =
            r#"[{"ifindex":2,"ifname":"troupe0","stats64":{"rx":{"bytes":7},"tx":{"bytes":123456,"packets":9}}}]"#;
        assert_eq!(tx_bytes_of(json), Some(123456));
        assert_eq!(tx_bytes_of("[]"), None);
    }
}

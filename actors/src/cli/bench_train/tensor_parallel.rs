//! `troupe bench train --world N --tp T [--sp|--no-sp]`: a model preset trained with tensor degree T on a
//! local cluster of N `troupe daemon` processes (N = T × dp: dp tensor groups of T ranks, each group one
//! data-parallel replica of `MICRO_BATCH` samples per step), timed as `data_parallel` times a job (the
//! wall time between committed step events after the warm-up, each daemon's VmHWM, a fresh cluster per
//! repetition). With T > 1 each repetition also runs the same world purely data-parallel (tp = 1, DDP), so
//! the report says what splitting the layers costs or gains against replicating them. `--shard zeroK`
//! (with two tensor groups or more) runs ZeRO inside the tensor ranks' data-parallel groups, and the
//! baseline sharded alike; `--precision bf16|fp16` trains both in that precision (not with `--peer`).
//!
//! With `--peer`, PyTorch's own tensor parallelism of gpt-tiny trains between troupe's runs
//! (bench/peers/tp_gpt_tiny.py: DTensor's `parallelize_module` with ColwiseParallel / RowwiseParallel,
//! SequenceParallel norms with `--sp`, the loss under `loss_parallel`, a "cpu" device mesh (dp, tp) over
//! Gloo) with the same world, degree, per-replica micro-batch, context, threads and steps. Both report the
//! loss of their first step: different draws of the same model shape on the same data, so the two are
//! close (about ln 256 for gpt-tiny), which is the check that the peer trains the same thing.
//!
//! The report also gives what troupe's rank 0 held and sent in a step, as its engine measured it (the
//! job's `Usage` event): memory by kind, bytes sent by group and collective beside the theoretical
//! volume of Megatron's scheme for the same layout (`plan::traffic`), and the communication's share of
//! the step on every rank.

use anyhow::{anyhow, bail};
use serde_json::{json, Value};
use troupe_model::config::NODES_MAX;
use troupe_model::tensor_parallel::TpLayout;
use troupe_model::ModelConfig;

use super::data_parallel::{
    job_runtime, measure_cluster, mib_list, peer_peak_bytes, per_rank_max_mib, precision_name, shard_name, ClusterRun,
    Variant,
};
use super::{extend_report, median, run_peer, BenchDevice, BenchTrainArgs, MICRO_BATCH, WARMUP_STEPS};
use crate::plan::{plan_layout, Degrees, Host, LayoutRequest, Traffic};
use crate::protocol::RankUsage;

/// Refuses what the tensor-parallel benchmark cannot run, before anything starts: a degree that does not
/// divide the world or the model (the layout's own refusal), and flags that do not go with `--tp`.
pub(super) fn check(args: &BenchTrainArgs, model: &ModelConfig, tp: usize) -> anyhow::Result<()> {
    let world = args.world;
    if tp == 0 {
        bail!("--tp 0: the tensor-parallel degree is at least 1");
    }
    if !world.is_multiple_of(tp) {
        let nearest = (world / tp).max(1) * tp;
        bail!("--tp {tp} does not divide --world {world}: the world is tp × data-parallel replicas; use --world {nearest} (or a --tp that divides {world})");
    }
    if world > NODES_MAX {
        bail!("--world {world}: a local cluster has at most {NODES_MAX} daemons");
    }
    TpLayout::new(model, tp, sp(args)).map_err(|e| anyhow!("--tp {tp} with --model {}: {e}", args.model))?;
    let refused = [
        (
            args.shard != "none" && world / tp < 2,
            format!("--shard {}", args.shard),
            "ZeRO splits the state over the data-parallel replicas and this world has one tensor group; use a \
             --world of two groups or more (e.g. twice --tp), or drop --shard",
        ),
        (
            args.shard != "none" && args.peer,
            format!("--shard {}", args.shard),
            "the PyTorch tensor-parallel peer replicates its state over the data-parallel replicas; drop --peer or \
             --shard",
        ),
        (
            args.precision != "fp32" && args.peer,
            format!("--precision {}", args.precision),
            "the PyTorch tensor-parallel peer (bench/peers/tp_gpt_tiny.py) trains in fp32; drop --peer or --precision",
        ),
        (
            args.peft != "none",
            format!("--peft {}", args.peft),
            "the tensor-parallel benchmark trains every parameter; drop --peft (or --tp)",
        ),
        (
            args.device != BenchDevice::Cpu,
            "--device cuda".into(),
            "the tensor-parallel jobs run on the CPU; drop --device",
        ),
        (
            args.micro_batch != MICRO_BATCH,
            format!("--micro-batch {}", args.micro_batch),
            "each tensor group trains micro-batches of 8, as the peer does; drop --micro-batch",
        ),
        (
            args.peer && args.model != "gpt-tiny",
            format!("--model {}", args.model),
            "the PyTorch tensor-parallel peer (bench/peers/tp_gpt_tiny.py) trains gpt-tiny; drop --peer or --model",
        ),
    ];
    if let Some((_, flag, why)) = refused.into_iter().find(|(bad, ..)| *bad) {
        bail!("{flag} with --tp {tp}: {why}");
    }
    Ok(())
}

/// Sequence parallelism: on unless `--no-sp`.
pub(super) fn sp(args: &BenchTrainArgs) -> bool {
    !args.no_sp
}

/// The repetitions: troupe at tp = T, troupe's data-parallel baseline (T > 1) and the peer's reports.
struct Repetitions {
    ours: Vec<ClusterRun>,
    dp: Vec<ClusterRun>,
    peers: Vec<Value>,
}

pub(super) fn run(args: BenchTrainArgs, model: ModelConfig, tp: usize) -> anyhow::Result<()> {
    let world = args.world;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let load = load_average();
    let (threads, runtime) = job_runtime(&args)?;
    // The data-parallel baseline shards as the tensor groups' replicas do.
    let base = Variant { tp: 1, shard: shard_name(&args.shard), ..Variant::ddp(precision_name(&args.precision)) };
    let tensor = Variant { tp, sp: sp(&args), ..base };
    let mut runs = Repetitions { ours: Vec::new(), dp: Vec::new(), peers: Vec::new() };
    for _ in 0..args.repeats.max(1) {
        runs.ours.push(runtime.block_on(measure_cluster(&model, world, args.steps, threads, tensor))?);
        if tp > 1 {
            runs.dp.push(runtime.block_on(measure_cluster(&model, world, args.steps, threads, base))?);
        }
        if args.peer {
            let flags = [
                ("--world", world.to_string()),
                ("--tp", tp.to_string()),
                ("--sp", u8::from(sp(&args)).to_string()),
                ("--micro-batch", MICRO_BATCH.to_string()),
                ("--context", model.context.to_string()),
                ("--threads", threads.to_string()),
            ];
            runs.peers.push(run_peer(&args, "tp_gpt_tiny.py", &flags)?);
        }
    }
    let report = runs.report(&args, &model, (tp, threads), (cores, load));
    if args.json {
        println!("{report}");
    } else {
        print_lines(&report);
    }
    Ok(())
}

impl Repetitions {
    /// The JSON report: troupe's runs, its data-parallel baseline's, then the peer's (the field names of
    /// `data_parallel`'s report where they mean the same).
    fn report(
        &self,
        args: &BenchTrainArgs,
        model: &ModelConfig,
        (tp, threads): (usize, usize),
        machine: (usize, Option<f64>),
    ) -> Value {
        let (world, sp) = (args.world, sp(args) && tp > 1);
        let replicas = world / tp;
        let runs: Vec<f64> = self.ours.iter().map(|r| r.tokens_per_s).collect();
        let tokens_per_s = median(runs.clone());
        let (sharded, replicated) = TpLayout::new(model, tp, sp).map(|l| l.rank_numel()).unwrap_or_default();
        let mut report = json!({
            "bench": "train", "world": world, "tp": tp, "sp": sp, "dp": replicas, "shard": args.shard, "precision": args.precision,
            "steps": args.steps, "warmup_steps": WARMUP_STEPS, "model": args.model, "arch": model.arch.as_str(),
            "params": model.param_count(), "rank_params": sharded + replicated,
            "micro_batch": MICRO_BATCH, "global_batch": MICRO_BATCH * replicas, "context": model.context,
            "torch_threads": threads, "cores": machine.0, "load_average_1m": machine.1, "repeats": self.ours.len(),
            "tokens_per_s": tokens_per_s, "tokens_per_s_runs": runs,
            "first_loss": self.ours.first().map(|r| r.first_loss), "final_loss": self.ours.last().map(|r| r.final_loss),
            "peak_rss_mib_per_rank": per_rank_max_mib(self.ours.iter().map(|r| r.peak_rss_bytes.clone())),
        });
        extend_report(&mut report, self.usage_report(model, world, tp, sp));
        if !self.dp.is_empty() {
            let dp_runs: Vec<f64> = self.dp.iter().map(|r| r.tokens_per_s).collect();
            let dp_tps = median(dp_runs.clone());
            let extra = json!({
                "dp_tokens_per_s": dp_tps, "dp_tokens_per_s_runs": dp_runs, "dp_global_batch": MICRO_BATCH * world,
                "dp_peak_rss_mib_per_rank": per_rank_max_mib(self.dp.iter().map(|r| r.peak_rss_bytes.clone())),
                "ratio_vs_dp": tokens_per_s / dp_tps,
            });
            extend_report(&mut report, extra);
        }
        if let Some(last) = self.peers.last() {
            let peer_runs: Vec<Value> = self.peers.iter().map(|p| p["tokens_per_s"].clone()).collect();
            let peer_tps = median(self.peers.iter().map(|p| p["tokens_per_s"].as_f64().unwrap_or(f64::NAN)).collect());
            let extra = json!({
                "peer": last["peer"], "peer_torch": last["torch"], "peer_tp": last["tp"], "peer_sp": last["sp"],
                "peer_params": last["params"], "peer_rank_params": last["rank_params"],
                "peer_tokens_per_s": peer_tps, "peer_tokens_per_s_runs": peer_runs,
                "peer_first_loss": self.peers[0]["first_loss"], "peer_final_loss": last["final_loss"],
                "peer_peak_rss_mib_per_rank": per_rank_max_mib(self.peers.iter().map(peer_peak_bytes)),
                "ratio": tokens_per_s / peer_tps,
            });
            extend_report(&mut report, extra);
        }
        report
    }
}

impl Repetitions {
    /// Rank 0's memory by kind and its bytes sent per step by group and collective (the last run's), beside
    /// the theoretical volume; the communication's share of the step (median over runs of the ranks' mean).
    fn usage_report(&self, model: &ModelConfig, world: usize, tp: usize, sp: bool) -> Value {
        let Some(usage) = self.ours.iter().rev().find_map(|r| r.usage.as_ref()) else { return json!({}) };
        let mib = |b: u64| (b as f64 / (1u64 << 20) as f64 * 100.0).round() / 100.0;
        let key = |group: &str, collective: &str| format!("{group}/{collective}");
        let Some(rank0) = usage.first() else { return json!({}) };
        let sent: serde_json::Map<String, Value> =
            rank0.sent.iter().map(|s| (key(s.group.as_str(), s.collective.as_str()), json!(s.bytes))).collect();
        let mut theory = serde_json::Map::new();
        for t in theoretical(model, world, tp, sp) {
            let k = key(t.group.as_str(), t.collective.as_str());
            let total = theory.get(&k).and_then(Value::as_u64).unwrap_or(0) + t.bytes_per_rank;
            theory.insert(k, json!(total));
        }
        let shares: Vec<f64> = self
            .ours
            .iter()
            .filter_map(|r| r.usage.as_ref())
            .map(|ranks| ranks.iter().map(comm_share).sum::<f64>() / ranks.len().max(1) as f64)
            .collect();
        json!({
            "memory_mib_rank0": {
                "params": mib(rank0.param_bytes), "grads": mib(rank0.grad_bytes),
                "optimizer": mib(rank0.optimizer_bytes), "buddy": mib(rank0.buddy_bytes),
                "activations": mib(rank0.activation_bytes.unwrap_or(0)),
            },
            "memory_mib_per_rank": usage.iter().map(|u| mib(u.memory_bytes())).collect::<Vec<_>>(),
            "sent_bytes_per_step_rank0": sent,
            "theoretical_bytes_per_step_rank0": theory,
            "comm_share": median(shares.clone()),
            "comm_share_runs": shares,
        })
    }
}

/// The share of a rank's step spent in collectives and sends.
fn comm_share(u: &RankUsage) -> f64 {
    if u.step_seconds > 0.0 {
        u.comm_seconds() / u.step_seconds
    } else {
        f64::NAN
    }
}

/// What Megatron's scheme moves per step from rank 0 of this benchmark's layout (`plan::traffic`): one
/// stage, `world / tp` replicas of `MICRO_BATCH` samples in one micro-batch, all ranks on one host.
fn theoretical(model: &ModelConfig, world: usize, tp: usize, sp: bool) -> Vec<Traffic> {
    let degrees = Degrees { tp, pp: 1, dp: world / tp };
    let mut request = LayoutRequest::new(degrees, Host::uniform(1, world), model.clone());
    (request.sp, request.global_batch, request.micro_batch) = (sp, MICRO_BATCH * degrees.dp, MICRO_BATCH);
    plan_layout(&request).map(|plan| plan.stages[0].traffic.clone()).unwrap_or_default()
}

/// The human lines, from the report.
fn print_lines(report: &Value) {
    let f = |key: &str| report[key].as_f64().unwrap_or(f64::NAN);
    let u = |key: &str| report[key].as_u64().unwrap_or(0);
    let sp = if report["sp"] == true { "with sequence parallelism" } else { "without sequence parallelism" };
    println!(
        "troupe   {:>9.0} tokens/s  ({} at context {}, world {}: {} tensor group(s) of {} {sp}, {} thread(s) per rank, first loss {:.3}, peak RSS per rank {} MiB)",
        f("tokens_per_s"), report["model"].as_str().unwrap_or_default(), u("context"), u("world"), u("dp"), u("tp"),
        u("torch_threads"), f("first_loss"), mib_list(&report["peak_rss_mib_per_rank"])
    );
    if let Some(memory) = report.get("memory_mib_rank0") {
        let m = |k: &str| memory[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "         rank 0 holds {:.2} MiB parameters, {:.2} gradients, {:.2} optimizer state, {:.2} buddy copy, {:.2} activations at peak",
            m("params"), m("grads"), m("optimizer"), m("buddy"), m("activations")
        );
        let theory = &report["theoretical_bytes_per_step_rank0"];
        for (key, bytes) in report["sent_bytes_per_step_rank0"].as_object().into_iter().flatten() {
            let b = |v: &Value| v.as_u64().map_or("-".into(), |b| format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64));
            println!(
                "         rank 0 sends {:<24} {:>11} per step (Megatron's scheme: {})",
                key,
                b(bytes),
                b(&theory[key])
            );
        }
        println!(
            "         communication {:.0}% of the step (mean over the ranks, median over runs)",
            100.0 * f("comm_share")
        );
    }
    if report.get("dp_tokens_per_s").is_some() {
        println!(
            "troupe   {:>9.0} tokens/s  (the same world data-parallel, tp 1, peak RSS per rank {} MiB); tp / dp = {:.3}",
            f("dp_tokens_per_s"), mib_list(&report["dp_peak_rss_mib_per_rank"]), f("ratio_vs_dp")
        );
    }
    if report.get("peer_tokens_per_s").is_some() {
        println!(
            "pytorch  {:>9.0} tokens/s  (DTensor tensor parallelism over Gloo, same model and batch, first loss {:.3}, peak RSS per rank {} MiB)",
            f("peer_tokens_per_s"), f("peer_first_loss"), mib_list(&report["peer_peak_rss_mib_per_rank"])
        );
        println!("ratio    {:>9.3}", f("ratio"));
    }
}

/// The machine's 1-minute load average (/proc/loadavg), for the record of a shared machine.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

//! `troupe bench train --optimizer adafactor`: the same model trained with Adafactor and with AdamW in
//! the same repetitions (alternating, so machine drift hits both alike). Reports each one's tokens/s
//! and the ratio, and each one's optimizer state per rank and the ratio.
//!
//! - `--world 1`: in this process (a DDP rank holds the same state, the whole model's); the state is
//!   the bytes of its state tensors, whole and for the matrices alone (the factored ones).
//! - `--world N` with `--shard zero1|2|3` or `--tp T` (or neither: DDP): each optimizer's job on a fresh
//!   local cluster of N daemons per repetition, timed as `data_parallel` times a job. The state per rank
//!   is what the engine reports in the job's `Usage` event (under ZeRO its shard's fp32 masters
//!   included); every run also reports each daemon's peak resident memory (VmHWM).

use std::time::Instant;

use anyhow::bail;
use serde_json::{json, Value};
use troupe_model::config::{JobConfig, NODES_MAX};
use troupe_model::trainer::configure_torch_threads;
use troupe_model::{ModelConfig, Trainer};

use super::data_parallel::{
    job_runtime, measure_cluster, per_rank_max_mib, precision_name, shard_name, ClusterRun, Variant,
};
use super::{median, BenchDevice, BenchTrainArgs, MICRO_BATCH, WARMUP_STEPS};

/// One timed run: tokens/s, final loss, and the optimizer's state bytes (all, matrices).
struct OptimizerRun {
    tokens_per_s: f64,
    loss: f64,
    state_bytes: u64,
    matrix_state_bytes: u64,
}

/// Refuses what this comparison does not measure.
pub(super) fn check(args: &BenchTrainArgs) -> anyhow::Result<()> {
    if args.peer || args.peft != "none" || args.sync != "every_step" || args.netns > 0 || args.offload != "none" {
        bail!(
            "--optimizer {} compares with AdamW on the same layout: drop --peer, --peft, --sync, --netns and --offload",
            args.optimizer
        );
    }
    if args.world > 1 && (args.device != BenchDevice::Cpu || args.micro_batch != MICRO_BATCH) {
        bail!("--optimizer {} with --world {}: the jobs run on the CPU with micro-batches of {MICRO_BATCH}; drop --device and --micro-batch", args.optimizer, args.world);
    }
    if args.world == 1 && (args.shard != "none" || args.tp.is_some()) {
        bail!("--optimizer {} with --shard or --tp runs jobs: use --world 2 or more", args.optimizer);
    }
    if args.world > NODES_MAX {
        bail!("--world {}: a local cluster has at most {NODES_MAX} daemons", args.world);
    }
    if let Some(tp) = args.tp.filter(|&tp| tp == 0 || !args.world.is_multiple_of(tp)) {
        bail!("--tp {tp} does not divide --world {}: the world is tp × data-parallel replicas", args.world);
    }
    Ok(())
}

pub(super) fn run(args: BenchTrainArgs, model: ModelConfig) -> anyhow::Result<()> {
    if args.world > 1 {
        return run_jobs(args, model);
    }
    let threads = configure_torch_threads(args.threads, 1);
    let device = match args.device {
        crate::cli::bench_kernels::BenchDevice::Cpu => tch::Device::Cpu,
        crate::cli::bench_kernels::BenchDevice::Cuda => tch::Device::cuda_if_available(),
    };
    let names = ["adamw".to_string(), args.optimizer.clone()];
    let mut runs: [Vec<OptimizerRun>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..args.repeats.max(1) {
        for (name, list) in names.iter().zip(runs.iter_mut()) {
            list.push(measure(&model, &args, name, device)?);
        }
    }
    let summary: Vec<Value> = names.iter().zip(&runs).map(|(name, list)| summarise(name, list)).collect();
    let ratio =
        |key: &str| summary[1][key].as_f64().unwrap_or(0.0) / summary[0][key].as_f64().unwrap_or(1.0).max(1e-12);
    let report = json!({
        "bench": "train", "optimizer": args.optimizer, "model": args.model, "context": args.context,
        "micro_batch": args.micro_batch, "steps": args.steps, "repeats": args.repeats, "threads": threads,
        "runs": summary,
        "tokens_per_s_ratio": ratio("tokens_per_s"),
        "state_bytes_ratio": ratio("state_bytes"),
        "matrix_state_bytes_ratio": ratio("matrix_state_bytes"),
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    for run in &summary {
        println!(
            "{:>9}: {:>9.0} tokens/s, optimizer state {:>10} bytes per rank ({} for matrices), final loss {:.3}",
            run["optimizer"].as_str().unwrap_or(""),
            run["tokens_per_s"].as_f64().unwrap_or(0.0),
            run["state_bytes"],
            run["matrix_state_bytes"],
            run["final_loss"].as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "{} / adamw: tokens/s {:.3}×, optimizer state {:.4}× (matrices {:.4}×)",
        args.optimizer,
        report["tokens_per_s_ratio"].as_f64().unwrap_or(0.0),
        report["state_bytes_ratio"].as_f64().unwrap_or(0.0),
        report["matrix_state_bytes_ratio"].as_f64().unwrap_or(0.0),
    );
    Ok(())
}

fn summarise(name: &str, runs: &[OptimizerRun]) -> Value {
    let tokens: Vec<f64> = runs.iter().map(|r| r.tokens_per_s).collect();
    json!({
        "optimizer": name,
        "tokens_per_s": median(tokens.clone()),
        "tokens_per_s_runs": tokens,
        "state_bytes": runs.first().map_or(0, |r| r.state_bytes),
        "matrix_state_bytes": runs.first().map_or(0, |r| r.matrix_state_bytes),
        "final_loss": runs.last().map_or(f64::NAN, |r| r.loss),
    })
}

/// One timed run of `model` with `optimizer` (after [`WARMUP_STEPS`] untimed steps).
fn measure(
    model: &ModelConfig,
    args: &BenchTrainArgs,
    optimizer: &str,
    device: tch::Device,
) -> anyhow::Result<OptimizerRun> {
    let mut config = JobConfig { model: model.clone(), ..JobConfig::default() };
    config.parallel.precision.clone_from(&args.precision);
    config.train.optimizer = optimizer.into();
    config.train.steps = args.steps + WARMUP_STEPS;
    config.train.global_batch = args.micro_batch;
    config.train.micro_batch = args.micro_batch;
    let mut trainer = Trainer::new_on(config, device)?;
    for _ in 0..WARMUP_STEPS {
        trainer.train_step();
    }
    let started = Instant::now();
    let (mut tokens, mut loss) = (0, 0.0);
    for _ in 0..args.steps {
        let report = trainer.train_step();
        tokens += report.tokens;
        loss = report.loss;
    }
    let tokens_per_s = tokens as f64 / started.elapsed().as_secs_f64();
    let (state_bytes, matrix_state_bytes) = state_bytes(&trainer);
    Ok(OptimizerRun { tokens_per_s, loss, state_bytes, matrix_state_bytes })
}

/// Bytes of the optimizer's state tensors: all of them, and those of the matrices' (2-D and up) states.
fn state_bytes(trainer: &Trainer) -> (u64, u64) {
    let specs = trainer.model.specs();
    let matrix = |name: &str| {
        let index = name.rsplit('.').next().and_then(|i| i.parse::<usize>().ok());
        index.is_some_and(|i| specs.get(i).is_some_and(|s| s.shape.len() >= 2))
    };
    let state = trainer.optimizer.state_tensors();
    let bytes = |t: &tch::Tensor| troupe_model::tensor_bytes(t) as u64;
    let all = state.iter().map(|(_, t)| bytes(t)).sum();
    let matrices = state.iter().filter(|(n, _)| matrix(n)).map(|(_, t)| bytes(t)).sum();
    (all, matrices)
}

/// `--world N`: AdamW's and the other optimizer's jobs on fresh local clusters, alternating.
fn run_jobs(args: BenchTrainArgs, model: ModelConfig) -> anyhow::Result<()> {
    let world = args.world;
    let (threads, runtime) = job_runtime(&args)?;
    let optimizer: &'static str = if args.optimizer == "adafactor" { "adafactor" } else { "adamw" };
    let tp = args.tp.unwrap_or(1);
    let base = Variant {
        shard: shard_name(&args.shard),
        tp,
        sp: tp > 1 && super::tensor_parallel::sp(&args),
        ..Variant::ddp(precision_name(&args.precision))
    };
    let variants = [base, Variant { optimizer, ..base }];
    let mut runs: [Vec<ClusterRun>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..args.repeats.max(1) {
        for (variant, list) in variants.iter().zip(runs.iter_mut()) {
            list.push(runtime.block_on(measure_cluster(&model, world, args.steps, threads, *variant))?);
        }
    }
    let summary: Vec<Value> =
        variants.iter().zip(&runs).map(|(variant, list)| summarise_jobs(variant.optimizer, list)).collect();
    let ratio = |key: &str| {
        let [adamw, other] = [&summary[0][key], &summary[1][key]].map(Value::as_f64);
        adamw.zip(other).map(|(a, o)| o / a.max(1e-12))
    };
    let report = json!({
        "bench": "train", "optimizer": args.optimizer, "model": args.model, "context": args.context,
        "world": world, "shard": args.shard, "tp": tp, "precision": args.precision, "steps": args.steps,
        "repeats": args.repeats, "threads": threads,
        "runs": summary,
        "tokens_per_s_ratio": ratio("tokens_per_s"),
        "optimizer_bytes_ratio": ratio("optimizer_bytes_rank0"),
        "peak_mib_ratio": ratio("peak_mib_max"),
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    let layout = match (tp, args.shard.as_str()) {
        (1, "none") => "DDP".to_string(),
        (1, shard) => shard.to_uppercase().replace("ZERO", "ZeRO-"),
        (tp, _) => format!("tp = {tp}"),
    };
    for run in &summary {
        let state = match run["optimizer_bytes_rank0"].as_u64() {
            Some(bytes) => format!("optimizer state {bytes} bytes on rank 0, "),
            None => String::new(),
        };
        println!(
            "{:>9} ({layout}, world {world}): {:>9.0} tokens/s, {state}peak {:.0} MiB on the largest daemon, final loss {:.3}",
            run["optimizer"].as_str().unwrap_or(""),
            run["tokens_per_s"].as_f64().unwrap_or(0.0),
            run["peak_mib_max"].as_f64().unwrap_or(0.0),
            run["final_loss"].as_f64().unwrap_or(0.0),
        );
    }
    let shown = |key: &str| report[key].as_f64().map_or("n/a".to_string(), |r| format!("{r:.3}×"));
    println!(
        "{} / adamw: tokens/s {}, optimizer state {}, peak memory {}",
        args.optimizer,
        shown("tokens_per_s_ratio"),
        shown("optimizer_bytes_ratio"),
        shown("peak_mib_ratio"),
    );
    Ok(())
}

/// One optimizer's job runs: median tokens/s, each daemon's peak over the runs, the engine's reported
/// optimizer state per rank (where it reports one), the final loss.
fn summarise_jobs(name: &str, runs: &[ClusterRun]) -> Value {
    let tokens: Vec<f64> = runs.iter().map(|r| r.tokens_per_s).collect();
    let peaks = per_rank_max_mib(runs.iter().map(|r| r.peak_rss_bytes.clone()));
    let usage = runs.iter().rev().find_map(|r| r.usage.as_ref());
    let optimizer_bytes: Option<Vec<u64>> = usage.map(|u| u.iter().map(|r| r.optimizer_bytes).collect());
    json!({
        "optimizer": name,
        "tokens_per_s": median(tokens.clone()),
        "tokens_per_s_runs": tokens,
        "peak_mib_per_rank": peaks,
        "peak_mib_max": peaks.iter().copied().fold(0.0, f64::max),
        "optimizer_bytes_per_rank": optimizer_bytes,
        "optimizer_bytes_rank0": optimizer_bytes.as_ref().and_then(|b| b.first()),
        "final_loss": runs.last().map_or(f64::NAN, |r| r.final_loss),
    })
}

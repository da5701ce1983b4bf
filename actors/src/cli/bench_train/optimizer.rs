//! `troupe bench train --optimizer adafactor`: the same model trained with Adafactor and with AdamW in
//! the same repetitions (alternating, so machine drift hits both alike), in this process (`--world 1`;
//! a DDP rank holds the same state, the whole model's). Reports each one's tokens/s and the ratio, and
//! each one's optimizer state per rank — bytes of its state tensors, whole and for the matrices alone
//! (the factored ones) — and the ratio.

use std::time::Instant;

use anyhow::bail;
use serde_json::{json, Value};
use troupe_model::config::JobConfig;
use troupe_model::trainer::configure_torch_threads;
use troupe_model::{ModelConfig, Trainer};

use super::{median, BenchTrainArgs, WARMUP_STEPS};

/// One timed run: tokens/s, final loss, and the optimizer's state bytes (all, matrices).
struct OptimizerRun {
    tokens_per_s: f64,
    loss: f64,
    state_bytes: u64,
    matrix_state_bytes: u64,
}

/// Refuses what this comparison does not measure.
pub(super) fn check(args: &BenchTrainArgs) -> anyhow::Result<()> {
    if args.world != 1 || args.shard != "none" || args.tp.is_some() || args.peer || args.peft != "none" {
        bail!(
            "--optimizer {} compares with AdamW in this process: use --world 1 without --shard, --tp, --peer or \
             --peft (a DDP rank holds the same optimizer state as one process)",
            args.optimizer
        );
    }
    Ok(())
}

pub(super) fn run(args: BenchTrainArgs, model: ModelConfig) -> anyhow::Result<()> {
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

//! `troupe bench train --offload host`: the same model trained with the optimizer offloaded to the host
//! (`parallel.offload = "host"`) and without, in the same repetitions (alternating, so machine drift hits
//! both alike), in this process (`--world 1`). On `--device cuda` the offloaded run keeps its masters,
//! optimizer state and update on the host (pinned); on the CPU there is no device to offload from, so the
//! offloaded run uses the emulated staging (the same copies into CPU memory: their cost, not a device's
//! figure) and says so. Reports each one's tokens/s, the ratio, the bytes of optimizer state the device no
//! longer holds, and how far the two final models are apart (0 on the CPU: the same kernel computes both).

use std::time::Instant;

use anyhow::bail;
use serde_json::{json, Value};
use tch::Device;
use troupe_model::config::JobConfig;
use troupe_model::optim::offload::Staging;
use troupe_model::trainer::configure_torch_threads;
use troupe_model::{ModelConfig, Trainer};

use super::{median, BenchTrainArgs, WARMUP_STEPS};
use crate::cli::bench_kernels::BenchDevice;

/// One timed run: tokens/s, and the trainer at its end.
struct OffloadRun {
    tokens_per_s: f64,
    trainer: Trainer,
}

/// Refuses what this comparison does not measure.
pub(super) fn check(args: &BenchTrainArgs) -> anyhow::Result<()> {
    if args.world != 1 || args.shard != "none" || args.tp.is_some() || args.peer || args.peft != "none" {
        bail!(
            "--offload host compares with no offload in this process: use --world 1 without --shard, --tp, --peer \
             or --peft (the multi-rank jobs run on CPU ranks, whose optimizer is on the host already)"
        );
    }
    if args.optimizer != "adamw" {
        bail!("--offload host runs AdamW; drop --optimizer {} (one comparison at a time)", args.optimizer);
    }
    Ok(())
}

pub(super) fn run(args: BenchTrainArgs, model: ModelConfig) -> anyhow::Result<()> {
    let threads = configure_torch_threads(args.threads, 1);
    let (device, staging) = match args.device {
        BenchDevice::Cpu => (Device::Cpu, Staging::Emulated),
        BenchDevice::Cuda => {
            if !tch::Cuda::is_available() {
                bail!("--device cuda: no CUDA device");
            }
            (Device::Cuda(0), Staging::Device(Device::Cuda(0)))
        }
    };
    let mut runs: [Vec<OffloadRun>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..args.repeats.max(1) {
        for (offload, list) in [None, Some(staging)].into_iter().zip(runs.iter_mut()) {
            list.push(measure(&model, &args, device, offload)?);
        }
    }
    let [plain, offloaded] = &runs;
    let (last_plain, last_offloaded) = (&plain[plain.len() - 1].trainer, &offloaded[offloaded.len() - 1].trainer);
    let worst = worst_relative_difference(last_plain, last_offloaded);
    let tokens = |list: &[OffloadRun]| median(list.iter().map(|r| r.tokens_per_s).collect());
    let saved = last_offloaded.offloaded_state_bytes();
    let staging_name = if staging == Staging::Emulated { "emulated" } else { "cuda" };
    let summary = |name: &str, list: &[OffloadRun], saved: usize| -> Value {
        json!({ "offload": name, "tokens_per_s": tokens(list),
                "tokens_per_s_runs": list.iter().map(|r| r.tokens_per_s).collect::<Vec<_>>(),
                "device_bytes_saved": saved })
    };
    let report = json!({
        "bench": "train", "offload": "host", "staging": staging_name, "model": args.model, "context": args.context,
        "micro_batch": args.micro_batch, "steps": args.steps, "repeats": args.repeats, "threads": threads,
        "runs": [summary("none", plain, 0), summary("host", offloaded, saved)],
        "tokens_per_s_ratio": tokens(offloaded) / tokens(plain).max(1e-12),
        "device_bytes_saved": saved,
        "final_params_worst_relative_difference": worst,
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "offload none: {:>9.0} tokens/s\noffload host: {:>9.0} tokens/s ({staging_name} staging), {saved} bytes of optimizer state off the device",
        tokens(plain),
        tokens(offloaded)
    );
    println!(
        "host / none: tokens/s {:.3}×; final parameters apart by {worst:.1e} (worst relative L2 of a tensor)",
        report["tokens_per_s_ratio"].as_f64().unwrap_or(0.0)
    );
    Ok(())
}

/// One timed run of `model` on `device`, its optimizer offloaded through `offload` (after
/// [`WARMUP_STEPS`] untimed steps).
fn measure(
    model: &ModelConfig,
    args: &BenchTrainArgs,
    device: Device,
    offload: Option<Staging>,
) -> anyhow::Result<OffloadRun> {
    let mut config = JobConfig { model: model.clone(), ..JobConfig::default() };
    config.parallel.precision.clone_from(&args.precision);
    config.train.steps = args.steps + WARMUP_STEPS;
    config.train.global_batch = args.micro_batch;
    config.train.micro_batch = args.micro_batch;
    let mut trainer = match offload {
        Some(Staging::Device(_)) => {
            config.parallel.offload = "host".into();
            Trainer::new_on(config, device)?
        }
        Some(Staging::Emulated) => Trainer::new_on(config, device)?.with_offload(Staging::Emulated),
        None => Trainer::new_on(config, device)?,
    };
    for _ in 0..WARMUP_STEPS {
        trainer.train_step();
    }
    let started = Instant::now();
    let mut tokens = 0;
    for _ in 0..args.steps {
        tokens += trainer.train_step().tokens;
    }
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
    let tokens_per_s = tokens as f64 / started.elapsed().as_secs_f64();
    Ok(OffloadRun { tokens_per_s, trainer })
}

/// The largest relative L2 difference between two trainers' parameters, tensor by tensor.
fn worst_relative_difference(a: &Trainer, b: &Trainer) -> f64 {
    a.model
        .params()
        .iter()
        .zip(b.model.params())
        .map(|(x, y)| {
            let (x, y) = (x.detach().to_device(Device::Cpu), y.detach().to_device(Device::Cpu));
            (&x - &y).norm().double_value(&[]) / y.norm().double_value(&[]).max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max)
}

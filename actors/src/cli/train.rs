//! `troupe train`: runs a training job and reports every committed step — in this process, or handed to
//! `train_pipeline` (`--pp`) or `train_cluster` (`--nodes`, `--cluster`); the flags are `train_args`'s.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::checkpoint::{self, CheckpointStore, Layout, TrainingState};
use troupe_model::config::JobConfig;
use troupe_model::trainer::configure_torch_threads;
use troupe_model::Trainer;

use super::train_args::TrainArgs;
use crate::progress::{spinner, Reporter, StepEvent};
use crate::telemetry::{PhaseRecorder, RunDir};

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let config = args.job_config()?;
    if args.cluster.is_some() || config.parallel.nodes > 1 {
        return super::train_cluster::run(args, config);
    }
    if config.parallel.pp > 1 {
        return super::train_pipeline::run(args, config);
    }
    let threads = configure_torch_threads(config.train.torch_threads, 1);
    let mut trainer = open_trainer(&args, &config)?;
    let total = config.train.steps;
    if trainer.step >= total {
        bail!("--resume: the checkpoint has {} steps committed, not fewer than train.steps = {total}; raise --steps to train further", trainer.step);
    }
    let run_dir = args.run_dir.as_deref().map(RunDir::create).transpose()?;
    let mut phases = PhaseRecorder::new(run_dir.is_some());
    let reporter = Reporter::new(args.json, trainer.step, total, args.log_every).with_run_dir(run_dir);
    let params = report_start(&reporter, &config, &trainer, threads);
    let store = match &config.checkpoint.dir {
        Some(dir) => Some(
            CheckpointStore::open(dir, config.checkpoint.keep_last)
                .with_context(|| format!("--checkpoint-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let started = Instant::now();
    let mut losses = Losses::default();
    while trainer.step < total {
        train_step(&mut trainer, &reporter, &mut phases, &mut losses);
        after_step(&trainer, &config, store.as_ref(), &reporter, &mut phases)?;
    }
    if let Some(path) = &args.save_final {
        trainer.save_params(path).with_context(|| format!("--save-final {}", path.display()))?;
        reporter.event("saved", json!({ "path": path }), &format!("saved final parameters to {}", path.display()));
    }
    report_done(reporter, trainer.step, &losses, started, params);
    Ok(())
}

/// The trainer: restored from `--resume`'s checkpoint, or new.
fn open_trainer(args: &TrainArgs, config: &JobConfig) -> anyhow::Result<Trainer> {
    Ok(match &args.resume {
        Some(path) => {
            let dir = resolve_resume(path)?;
            let _restoring = spinner(args.json, format!("restoring {}", dir.display()));
            Trainer::resume(config.clone(), &dir)?
        }
        None => Trainer::new(config.clone())?,
    })
}

/// The start event: the model, its data and the steps ahead. Returns the model's (base) parameter count.
fn report_start(reporter: &Reporter, config: &JobConfig, trainer: &Trainer, threads: usize) -> usize {
    let total = config.train.steps;
    let (trainable, corpus) = (trainer.model.param_count(), trainer.sampler.corpus().origin.clone());
    let params: usize = troupe_model::model::base_specs(&config.model).iter().map(|s| s.numel()).sum();
    let what = match &config.model.peft {
        None => format!("{params} parameters"),
        Some(peft) => format!("{params} parameters, {trainable} trained: {:?}", peft.method).to_lowercase(),
    };
    let batch = config.train.global_batch;
    reporter.event(
        "start",
        json!({ "params": params, "trainable_params": trainable, "steps": total, "from_step": trainer.step,
                "global_batch": batch, "micro_batch": config.train.micro_batch, "context": config.model.context,
                "data": corpus, "world": 1, "torch_threads": threads, "offload": config.parallel.offload,
                "offloaded_state_bytes": trainer.offloaded_state_bytes() }),
        &format!(
            "troupe: training {} ({what}) on {corpus}, steps {}..{total}, batch {batch} × {} tokens, {threads} torch thread(s){}",
            config.model.arch.as_str(),
            trainer.step + 1,
            config.model.context,
            offload_note(config, trainer)
        ),
    );
    params
}

/// What `parallel.offload = "host"` did, for the start line ("" without it).
fn offload_note(config: &JobConfig, trainer: &Trainer) -> String {
    match (config.parallel.offload.as_str(), &trainer.offload) {
        ("host", Some(_)) => {
            format!("; optimizer offloaded to the host ({} bytes off the device)", trainer.offloaded_state_bytes())
        }
        ("host", None) => format!("; {}", troupe_model::optim::offload::CPU_RANK_NOTE),
        _ => String::new(),
    }
}

/// The losses and tokens of the steps trained, for the summary.
#[derive(Default)]
struct Losses {
    first: Option<f64>,
    /// The last (up to) 10.
    last: Vec<f64>,
    tokens: u64,
}

/// One step: the gradients, the update and its report.
fn train_step(trainer: &mut Trainer, reporter: &Reporter, phases: &mut PhaseRecorder, losses: &mut Losses) {
    let t0 = Instant::now();
    let loss = trainer.accumulate_gradients(trainer.step);
    let computed = Instant::now();
    let report = trainer.apply_update(loss);
    phases.span("forward+backward", "compute", t0, computed);
    phases.span("optimizer", "optimizer", computed, Instant::now());
    let seconds = t0.elapsed().as_secs_f64();
    losses.tokens += report.tokens;
    losses.first.get_or_insert(report.loss);
    losses.last.push(report.loss);
    if losses.last.len() > 10 {
        losses.last.remove(0);
    }
    reporter.step(&StepEvent {
        step: trainer.step,
        loss: report.loss,
        lr: report.lr,
        grad_norm: report.grad_norm,
        tokens_per_s: report.tokens as f64 / seconds,
        epoch: 0,
        world: 1,
        peak_rss_bytes: vec![crate::telemetry::memory::peak_rss_bytes()],
        skipped: report.skipped,
        loss_scale: report.loss_scale,
        bubble: None,
        mfu: None,
    });
}

/// After a step: the checkpoint and the evaluation when due, then the step's phases.
fn after_step(
    trainer: &Trainer,
    config: &JobConfig,
    store: Option<&CheckpointStore>,
    reporter: &Reporter,
    phases: &mut PhaseRecorder,
) -> anyhow::Result<()> {
    let total = config.train.steps;
    let every = config.checkpoint.every_steps;
    let due = trainer.step == total || (every > 0 && trainer.step % every == 0);
    if let (Some(store), true) = (store, due) {
        let saving = Instant::now();
        save_checkpoint(trainer, store, reporter)?;
        phases.span("checkpoint", "checkpoint", saving, Instant::now());
    }
    if config.eval_due(trainer.step) {
        // Forward only, after the update: no gradient, state or randomness is touched.
        let evaluating = Instant::now();
        if let Some(eval) = trainer.evaluate() {
            reporter.eval(trainer.step, eval.loss, eval.perplexity, eval.windows, eval.tokens);
        }
        phases.span("eval", "compute", evaluating, Instant::now());
    }
    if let Some(spans) = phases.take() {
        let fields = json!({ "rank": 0, "node": "local", "attempt": 1, "step": trainer.step, "spans": spans });
        reporter.record_only("phases", fields);
    }
    Ok(())
}

/// The summary: `steps` trained since `started`, the losses, the throughput.
fn report_done(reporter: Reporter, steps: u64, losses: &Losses, started: Instant, params: usize) {
    let wall = started.elapsed().as_secs_f64();
    let final_mean = losses.last.iter().sum::<f64>() / losses.last.len() as f64;
    let first = losses.first.unwrap_or(f64::NAN);
    let tokens = losses.tokens;
    reporter.finish(
        json!({ "steps": steps, "first_loss": first, "final_loss": losses.last.last(),
                "final_loss_mean10": final_mean, "tokens_per_s": tokens as f64 / wall, "wall_s": wall,
                "params": params, "world": 1 }),
        &format!(
            "done: {} steps in {wall:.1} s; loss {first:.4} → {final_mean:.4} (mean of the last {}); {:.0} tokens/s",
            steps,
            losses.last.len(),
            tokens as f64 / wall
        ),
    );
}

/// A synchronous save (the single process has nothing to overlap it with but its next step).
fn save_checkpoint(trainer: &Trainer, store: &CheckpointStore, reporter: &Reporter) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let saved = store.save(&TrainingState::snapshot(trainer), &Layout::ddp(1))?;
    let bytes = if saved.kept_existing { 0 } else { saved.bytes };
    reporter.checkpoint(trainer.step, &saved.path, t0.elapsed().as_secs_f64(), bytes);
    Ok(())
}

/// A checkpoint directory as given, or the newest valid one under a root (corrupt ones skipped, said).
fn resolve_resume(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(checkpoint::MANIFEST).exists() {
        return Ok(path.to_owned());
    }
    let (latest, skipped) = checkpoint::latest_valid(path);
    for (dir, why) in &skipped {
        eprintln!("troupe: skipping checkpoint {}: {why}", dir.display());
    }
    latest.with_context(|| {
        format!(
            "--resume {}: no valid checkpoint there (expected a step-NNNNNNNN directory with {})",
            path.display(),
            checkpoint::MANIFEST
        )
    })
}

//! `troupe train`: runs a training job and reports every committed step — in this process, or handed to
//! `train_pipeline` (`--pp`) or `train_cluster` (`--nodes`, `--cluster`); the flags are `train_args`'s.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::checkpoint::{self, CheckpointStore, Layout, TrainingState};
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
    let mut trainer = match &args.resume {
        Some(path) => {
            let dir = resolve_resume(path)?;
            let _restoring = spinner(args.json, format!("restoring {}", dir.display()));
            Trainer::resume(config.clone(), &dir)?
        }
        None => Trainer::new(config.clone())?,
    };
    let total = config.train.steps;
    if trainer.step >= total {
        bail!("--resume: the checkpoint has {} steps committed, not fewer than train.steps = {total}; raise --steps to train further", trainer.step);
    }
    let run_dir = args.run_dir.as_deref().map(RunDir::create).transpose()?;
    let mut phases = PhaseRecorder::new(run_dir.is_some());
    let reporter = Reporter::new(args.json, trainer.step, total, args.log_every).with_run_dir(run_dir);
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
                "data": corpus, "world": 1, "torch_threads": threads }),
        &format!(
            "troupe: training {} ({what}) on {corpus}, steps {}..{total}, batch {batch} × {} tokens, {threads} torch thread(s)",
            config.model.arch.as_str(),
            trainer.step + 1,
            config.model.context
        ),
    );

    let store = match &config.checkpoint.dir {
        Some(dir) => Some(
            CheckpointStore::open(dir, config.checkpoint.keep_last)
                .with_context(|| format!("--checkpoint-dir {}", dir.display()))?,
        ),
        None => None,
    };
    let started = Instant::now();
    let (mut first_loss, mut last_losses, mut tokens) = (None, Vec::new(), 0u64);
    while trainer.step < total {
        let t0 = Instant::now();
        let loss = trainer.accumulate_gradients(trainer.step);
        let computed = Instant::now();
        let report = trainer.apply_update(loss);
        phases.span("forward+backward", "compute", t0, computed);
        phases.span("optimizer", "optimizer", computed, Instant::now());
        let seconds = t0.elapsed().as_secs_f64();
        tokens += report.tokens;
        first_loss.get_or_insert(report.loss);
        last_losses.push(report.loss);
        if last_losses.len() > 10 {
            last_losses.remove(0);
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
        });
        let every = config.checkpoint.every_steps;
        let due = trainer.step == total || (every > 0 && trainer.step % every == 0);
        if let (Some(store), true) = (&store, due) {
            let saving = Instant::now();
            save_checkpoint(&trainer, store, &reporter)?;
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
    }
    if let Some(path) = &args.save_final {
        trainer.save_params(path).with_context(|| format!("--save-final {}", path.display()))?;
        reporter.event("saved", json!({ "path": path }), &format!("saved final parameters to {}", path.display()));
    }
    let wall = started.elapsed().as_secs_f64();
    let final_mean = last_losses.iter().sum::<f64>() / last_losses.len() as f64;
    let first = first_loss.unwrap_or(f64::NAN);
    reporter.finish(
        json!({ "steps": trainer.step, "first_loss": first, "final_loss": last_losses.last(),
                "final_loss_mean10": final_mean, "tokens_per_s": tokens as f64 / wall, "wall_s": wall,
                "params": params, "world": 1 }),
        &format!(
            "done: {} steps in {wall:.1} s; loss {first:.4} → {final_mean:.4} (mean of the last {}); {:.0} tokens/s",
            trainer.step,
            last_losses.len(),
            tokens as f64 / wall
        ),
    );
    Ok(())
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

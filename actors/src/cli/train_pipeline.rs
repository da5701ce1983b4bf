//! `troupe train --pp P [--dp D]`: the job as D pipelines of P stage actors in this process (threads over
//! the in-memory transport; each stage's gradients all-reduced among its D replicas), reporting each
//! committed step like the single-process trainer.

use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::checkpoint;
use troupe_model::config::JobConfig;
use troupe_model::model::param_specs;

use super::train_args::TrainArgs;
use crate::engine::pipeline::{measure_bubble, run_in_process, PipelineOptions, ScheduleKind};
use crate::progress::{Reporter, StepEvent};

pub fn run(args: TrainArgs, config: JobConfig) -> anyhow::Result<()> {
    if args.resume.is_some() || config.checkpoint.dir.is_some() {
        let ranks = config.parallel.pp * config.parallel.dp.max(1);
        bail!("--resume / --checkpoint-dir with --pp > 1 in one process: the in-process pipeline takes no checkpoints; add --nodes {ranks} (or more) to run the stages on daemons, which checkpoint and resume, or drop the flag");
    }
    let parallel = &config.parallel;
    let kind = ScheduleKind::parse(&parallel.schedule).map_err(|e| anyhow::anyhow!("--schedule: {e}"))?;
    let microbatches = parallel.pipeline_microbatches(&config.train);
    let mut options = PipelineOptions::new(kind, parallel.pp, microbatches, parallel.virtual_stages);
    options.data_parallel = parallel.dp.max(1);
    let world = parallel.pp * options.data_parallel;
    // One torch thread per stage unless the config says otherwise: the stages compute concurrently.
    let threads = if config.train.torch_threads > 0 { config.train.torch_threads } else { 1 };
    tch::set_num_threads(i32::try_from(threads).context("train.torch_threads is too large")?);

    let total = config.train.steps;
    let reporter = Reporter::new(args.json, 0, total, args.log_every);
    report_start(&reporter, &config, &options, threads);
    let started = Instant::now();
    let tokens_per_step = (config.train.global_batch * config.model.context) as u64;
    let mut last = Instant::now();
    let mut losses = Vec::new();
    let run = run_in_process(&config, &options, total, |step| {
        let now = Instant::now();
        let seconds = (now - last).as_secs_f64();
        last = now;
        losses.push(step.loss);
        reporter.step(&StepEvent {
            step: step.step + 1,
            loss: step.loss,
            lr: step.lr,
            grad_norm: step.grad_norm,
            tokens_per_s: tokens_per_step as f64 / seconds,
            epoch: 0,
            world,
            peak_rss_bytes: vec![crate::telemetry::memory::peak_rss_bytes()],
            skipped: step.skipped,
            loss_scale: step.loss_scale,
            bubble: Some(measure_bubble(std::slice::from_ref(step)).bubble),
            mfu: None,
        });
        if let Some(eval) = &step.eval {
            reporter.eval(step.step + 1, eval.loss, eval.perplexity, eval.windows, eval.tokens);
        }
    })?;
    let steps = run.steps.len();
    if let Some(path) = &args.save_final {
        let named = param_specs(&config.model).into_iter().map(|s| s.name).zip(run.params).collect();
        checkpoint::tensor_file::write_tensors(path, named)
            .with_context(|| format!("--save-final {}", path.display()))?;
        reporter.event("saved", json!({ "path": path }), &format!("saved final parameters to {}", path.display()));
    }
    report_done(reporter, (&config, &options), steps, &losses, started);
    Ok(())
}

/// The start event: the model, the pipelines and their schedule.
fn report_start(reporter: &Reporter, config: &JobConfig, options: &PipelineOptions, threads: usize) {
    let (parallel, kind, microbatches) = (&config.parallel, options.kind, options.shape.microbatches);
    let world = parallel.pp * options.data_parallel;
    let params = config.model.param_count();
    let batch = config.train.global_batch;
    reporter.event(
        "start",
        json!({ "params": params, "steps": config.train.steps, "from_step": 0, "global_batch": batch, "context": config.model.context,
                "world": world, "pp": parallel.pp, "dp": options.data_parallel, "schedule": kind.name(), "microbatches": microbatches,
                "virtual_stages": parallel.virtual_stages, "torch_threads": threads }),
        &format!(
            "troupe: training gpt ({params} parameters) as {} {kind} pipeline(s) of {} stages, {microbatches} micro-batches per pipeline of batch {batch} × {} tokens",
            options.data_parallel, parallel.pp, config.model.context
        ),
    );
}

/// The summary: `steps` trained since `started` with `losses`, the throughput.
fn report_done(
    reporter: Reporter,
    (config, options): (&JobConfig, &PipelineOptions),
    steps: usize,
    losses: &[f64],
    started: Instant,
) {
    let (parallel, kind) = (&config.parallel, options.kind);
    let world = parallel.pp * options.data_parallel;
    let params = config.model.param_count();
    let tokens_per_step = (config.train.global_batch * config.model.context) as u64;
    let wall = started.elapsed().as_secs_f64();
    let tail = &losses[losses.len().saturating_sub(10)..];
    let final_mean = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
    let first = losses.first().copied().unwrap_or(f64::NAN);
    let tokens = tokens_per_step * steps as u64;
    reporter.finish(
        json!({ "steps": steps, "first_loss": first, "final_loss": losses.last(),
                "final_loss_mean10": final_mean, "tokens_per_s": tokens as f64 / wall, "wall_s": wall,
                "params": params, "world": world, "pp": parallel.pp, "dp": options.data_parallel, "schedule": kind.name() }),
        &format!(
            "done: {} steps in {wall:.1} s; loss {first:.4} → {final_mean:.4} (mean of the last {}); {:.0} tokens/s",
            steps,
            tail.len(),
            tokens as f64 / wall
        ),
    );
}

//! `troupe bench pipeline`: a pipeline of in-process stage actors training gpt-tiny, measured. Prints the
//! measured bubble (stage idle time over total stage time, steady steps only) beside the plan's
//! theoretical bubble under unit costs — for GPipe and 1F1B the textbook (P − 1)/(M + P − 1) — and beside
//! the bubble the same plan has at the op costs this run measured; tokens/s; and with `--trace-out` the
//! measured F/B/W/send/recv spans as a Chrome/Perfetto trace; with `--peer`, PyTorch's
//! torch.distributed.pipelining on the same model, batch and schedule (bench/peers/pipeline_gpt_tiny.py)
//! in the same run, and the ratio.

use std::path::PathBuf;
use std::time::Instant;

use crate::engine::pipeline::{
    check, chrome_trace, measure_bubble, partition, plan, run_in_process, simulate, textbook_bubble, BubbleFigures,
    PipelineOptions, PipelineRun, PipelineStep, PlanShape, ScheduleKind,
};
use anyhow::Context;
use troupe_model::config::JobConfig;

#[derive(Debug, clap::Args)]
pub struct BenchPipelineArgs {
    /// Pipeline stages (devices), each a stage actor with one torch thread.
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Micro-batches per global batch.
    #[arg(long, default_value_t = 4)]
    pub microbatches: usize,
    /// gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Chunks per stage (interleaved only).
    #[arg(long, default_value_t = 1)]
    pub virtual_stages: usize,
    /// Steps to run; the first is not measured.
    #[arg(long, default_value_t = 5)]
    pub steps: u64,
    /// Samples per micro-batch (the global batch is this × --microbatches).
    #[arg(long, default_value_t = 4)]
    pub micro_batch_size: usize,
    /// Transformer blocks (default gpt-tiny's 4, or stages × virtual stages if more).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Vocabulary size (default gpt-tiny's 256): a large one makes the head the heaviest part to run.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// How the blocks are split among stages: params (equal parameter counts) or measured (equal time).
    #[arg(long, value_parser = ["params", "measured"], default_value = "params")]
    pub balance: String,
    /// Write the measured spans of the steady steps here as Chrome/Perfetto trace-event JSON.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Also run PyTorch's torch.distributed.pipelining on the same model, batch and schedule, one process
    /// per stage over Gloo (bench/peers/pipeline_gpt_tiny.py), and report both.
    #[arg(long)]
    pub peer: bool,
    /// Python with torch for the peer (default: $TROUPE_PYTHON, else the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchPipelineArgs) -> anyhow::Result<()> {
    let kind = ScheduleKind::parse(&args.schedule).map_err(|e| anyhow::anyhow!("--schedule: {e}"))?;
    anyhow::ensure!(args.steps >= 2, "--steps {} leaves no steady step to measure: use at least 2", args.steps);
    anyhow::ensure!(args.micro_batch_size > 0, "--micro-batch-size must be at least 1");
    let shape = PlanShape::new(args.stages, args.microbatches, args.virtual_stages);
    let plan = plan(kind, shape).map_err(|e| anyhow::anyhow!("{e}"))?;
    let unit = check(&plan).with_context(|| format!("the generated {kind} plan is invalid"))?;
    let config = job_config(&args, kind, shape)?;
    tch::set_num_threads(1);

    let options = PipelineOptions::new(kind, args.stages, args.microbatches, args.virtual_stages);
    let mut step_walls = Vec::new();
    let mut last = Instant::now();
    let run = run_in_process(&config, &options, args.steps, |_| {
        let now = Instant::now();
        step_walls.push((now - last).as_secs_f64());
        last = now;
    })?;
    let steady: &[PipelineStep] = &run.steps[1..];
    let steady_wall = step_walls[1..].iter().sum::<f64>() / steady.len() as f64;
    let figures = measure_bubble(steady);
    let at_measured_costs = simulate(&plan, &figures.costs(args.virtual_stages))?.bubble_fraction();
    let theory = unit.timeline.bubble_fraction();
    let tokens_per_step = (config.train.global_batch * config.model.context) as f64;

    if let Some(path) = &args.trace_out {
        let trace = chrome_trace(steady, args.stages, std::process::id(), 1);
        std::fs::write(path, serde_json::to_vec(&trace)?)
            .with_context(|| format!("writing the trace to {}", path.display()))?;
    }
    let tokens_per_s = tokens_per_step / steady_wall;
    let peer = if args.peer { Some(run_peer(&args, &config)?) } else { None };
    let measured = Measured { run: &run, steady_wall, figures, theory, at_measured_costs, tokens_per_s };
    if args.json {
        println!("{}", report(&args, kind, &config, &measured, peer));
    } else {
        print_lines(&args, kind, &measured, peer.as_ref().and_then(|p| p["tokens_per_s"].as_f64()));
    }
    Ok(())
}

/// gpt-tiny (deep enough for the chunks, `--layers` and `--vocab` if given) pipelined as `args` say.
fn job_config(args: &BenchPipelineArgs, kind: ScheduleKind, shape: PlanShape) -> anyhow::Result<JobConfig> {
    let mut config = JobConfig::default();
    config.model.n_layers = args.layers.unwrap_or_else(|| config.model.n_layers.max(shape.chunks()));
    config.train.steps = args.steps;
    config.train.global_batch = args.micro_batch_size * args.microbatches;
    config.train.micro_batch = args.micro_batch_size;
    config.model.vocab_size = args.vocab.unwrap_or(config.model.vocab_size);
    // The cut's own message (it names the depth needed) before the config's.
    partition(&config.model, shape.chunks()).map_err(|e| anyhow::anyhow!("--stages × --virtual-stages: {e}"))?;
    config.parallel.pp = args.stages;
    config.parallel.schedule = kind.name().into();
    config.parallel.microbatches = args.microbatches;
    config.parallel.virtual_stages = args.virtual_stages;
    config.parallel.balance.clone_from(&args.balance);
    config.train.torch_threads = 1;
    config.validate().context("the benchmark's job config")?;
    Ok(config)
}

/// What the run measured of its steady steps, and the bubbles it is compared with.
struct Measured<'a> {
    run: &'a PipelineRun,
    /// Mean wall time of a steady step.
    steady_wall: f64,
    figures: BubbleFigures,
    /// The plan's bubble under unit costs.
    theory: f64,
    /// The plan's bubble at the op costs measured.
    at_measured_costs: f64,
    tokens_per_s: f64,
}

/// The JSON report (`--json`); `peer`: the peer's report.
fn report(
    args: &BenchPipelineArgs,
    kind: ScheduleKind,
    config: &JobConfig,
    m: &Measured,
    peer: Option<serde_json::Value>,
) -> serde_json::Value {
    let (run, figures, theory, tokens_per_s) = (m.run, &m.figures, m.theory, m.tokens_per_s);
    let steady = &run.steps[1..];
    let peer_tokens_per_s = peer.as_ref().and_then(|p| p["tokens_per_s"].as_f64());
    let ms = |s: f64| if s.is_finite() { serde_json::json!(s * 1e3) } else { serde_json::Value::Null };
    serde_json::json!({
        "bench": "pipeline",
        "schedule": kind.name(),
        "stages": args.stages,
        "microbatches": args.microbatches,
        "virtual_stages": args.virtual_stages,
        "layers": config.model.n_layers,
        "vocab": config.model.vocab_size,
        "balance": args.balance,
        "chunk_blocks": run.layouts.iter().map(|l| [l.blocks.start, l.blocks.end]).collect::<Vec<_>>(),
        "micro_batch_size": args.micro_batch_size,
        "steps": args.steps,
        "steady_steps": steady.len(),
        "bubble": figures.bubble,
        "bubble_theory": theory,
        "bubble_vs_theory": figures.bubble / theory,
        "bubble_textbook": textbook_bubble(args.stages, args.microbatches),
        "bubble_at_measured_costs": m.at_measured_costs,
        "idle_s_per_step": figures.idle_s / steady.len() as f64,
        "step_span_s": figures.step_span_s,
        "step_s": m.steady_wall,
        "tokens_per_s": tokens_per_s,
        "peer": peer,
        "vs_peer": peer_tokens_per_s.map(|p| tokens_per_s / p),
        "forward_ms": ms(figures.forward_s),
        "backward_ms": ms(figures.backward_s),
        "backward_input_ms": ms(figures.backward_input_s),
        "backward_weight_ms": ms(figures.backward_weight_s),
        "final_loss": run.steps.last().map(|s| s.loss),
        "trace": args.trace_out.as_ref().map(|p| p.display().to_string()),
    })
}

/// The human lines: troupe's bubbles and tokens/s, and the peer's tokens/s (`--peer`).
fn print_lines(args: &BenchPipelineArgs, kind: ScheduleKind, m: &Measured, peer_tokens_per_s: Option<f64>) {
    println!(
        "{kind} P={} M={} V={} ({} balance, chunks of blocks {:?}): bubble {:.3} measured, {:.3} in theory \
         ({:.2}×), {:.3} at the measured op costs; {:.0} tokens/s",
        args.stages,
        args.microbatches,
        args.virtual_stages,
        args.balance,
        m.run.layouts.iter().map(|l| l.blocks.clone()).collect::<Vec<_>>(),
        m.figures.bubble,
        m.theory,
        m.figures.bubble / m.theory,
        m.at_measured_costs,
        m.tokens_per_s
    );
    if let Some(peer) = peer_tokens_per_s {
        println!(
            "PyTorch torch.distributed.pipelining ({kind}, Gloo, a process per stage): {peer:.0} tokens/s; troupe \
             {:.2}× that",
            m.tokens_per_s / peer
        );
    }
}

/// bench/peers/pipeline_gpt_tiny.py with this run's model, batch and schedule; its last stdout line.
fn run_peer(args: &BenchPipelineArgs, config: &JobConfig) -> anyhow::Result<serde_json::Value> {
    let flags = [
        ("--stages", args.stages),
        ("--virtual-stages", args.virtual_stages),
        ("--microbatches", args.microbatches),
        ("--micro-batch-size", args.micro_batch_size),
        ("--layers", config.model.n_layers),
        ("--vocab", config.model.vocab_size),
        ("--context", config.model.context),
        ("--steps", args.steps as usize - 1),
        ("--warmup", 1),
        ("--threads", 1),
    ];
    let mut all = vec!["--schedule".to_string(), args.schedule.clone()];
    all.extend(flags.iter().flat_map(|(flag, value)| [flag.to_string(), value.to_string()]));
    super::bench_train::run_peer_script(args.python.as_ref(), "pipeline_gpt_tiny.py", &all)
}

//! `troupe bench train --world N` (N ≥ 2): a model preset (`--model`, gpt-tiny by default, at `--context`)
//! trained data-parallel on a local cluster of N `troupe daemon` processes (one slot, one rank each),
//! beside PyTorch DDP over Gloo (bench/peers/ddp_gpt_tiny.py: gpt-tiny, or transformers' own model of the
//! config.json troupe writes for any other preset) with the same per-rank micro-batch, context, torch
//! threads and steps. With `--shard zero1|2|3` troupe's sharded run is measured beside troupe's DDP in the
//! same repetitions; the peer stays DDP.
//!
//! Throughput is what a client of the cluster sees: the wall time between committed step events as they
//! arrive, from the last warm-up commit to the last timed one, so cluster start-up, job placement and the
//! first steps are not counted. Memory is each daemon's VmHWM (the rank's model, gradients, optimizer
//! state and transport buffers live there), read once the job has finished, before the cluster shuts down.
//! Each repetition starts a fresh cluster, and with `--peer` the peer runs between repetitions, on a
//! machine where no daemon is left.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_model::config::{JobConfig, NODES_MAX};
use troupe_model::ModelConfig;

use super::{
    extend_report, median, peer_model, peer_model_flags, run_peer, vm_hwm_bytes, BenchTrainArgs, PeerDir, MICRO_BATCH,
    WARMUP_STEPS,
};
use crate::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};
use crate::protocol::RankUsage;

const MIB: f64 = 1048576.0;
/// Silence after which the benchmark's cluster declares a daemon dead. Raised from the default (1.5 s):
/// on a loaded machine a daemon can miss heartbeats for that long, and the benchmark measures steady
/// training, not failure detection; a membership change still ends it with an error.
const FAILURE_TIMEOUT_MS: u64 = 10_000;
/// Longest wait for the job's next event (above the transport's collective timeout, 60 s, so a stuck
/// collective reports itself first).
const EVENT_WAIT_MS_MAX: u64 = 180_000;

/// One repetition on the cluster.
pub(super) struct ClusterRun {
    pub(super) tokens_per_s: f64,
    pub(super) final_loss: f64,
    /// The loss of the first step.
    pub(super) first_loss: f64,
    /// VmHWM of each daemon, by rank.
    pub(super) peak_rss_bytes: Vec<u64>,
    /// Bytes all ranks sent to each other over the job (with `Variant::counted`).
    pub(super) bytes_sent: Option<u64>,
    /// The validation loss of the final model (with `Variant::counted`).
    pub(super) eval_loss: Option<f64>,
    /// What each rank held and sent in a step, by rank (engines that count it: all but pipelines).
    pub(super) usage: Option<Vec<RankUsage>>,
}

/// One job followed to its end.
pub(super) struct JobRun {
    /// Steady tokens/s after the warm-up.
    pub(super) tokens_per_s: f64,
    pub(super) first_loss: f64,
    pub(super) final_loss: f64,
    /// The last validation loss, when the job evaluates.
    pub(super) eval_loss: Option<f64>,
    /// Its `Usage` event's ranks.
    pub(super) usage: Option<Vec<RankUsage>>,
}

pub(super) fn run(
    args: BenchTrainArgs,
    model: ModelConfig,
    base: Option<&(tempfile::TempDir, ModelConfig)>,
) -> anyhow::Result<()> {
    let world = args.world;
    if world > NODES_MAX {
        bail!("--world {world}: a local cluster has at most {NODES_MAX} daemons");
    }
    let (threads, runtime) = job_runtime(&args)?;
    let (shard, precision) = (shard_name(&args.shard), precision_name(&args.precision));
    let (model, peer_config) = peer_model(model, base)?;
    let sync: &'static str = match args.sync.as_str() {
        "local_sgd" => "local_sgd",
        "diloco" => "diloco",
        _ => "every_step",
    };
    let counted = sync != "every_step";
    let measured = Variant {
        bucket_mib: args.bucket_mib,
        shard,
        sync,
        sync_every: args.sync_every,
        counted,
        ..Variant::ddp(precision)
    };
    let runs = measure_repeats(&args, &runtime, (&model, peer_config.as_ref()), threads, measured)?;
    let medians = runs.medians(args.peer);
    let report = runs.report(&args, &model, threads, shard, &medians);
    if args.json {
        println!("{report}");
        return Ok(());
    }
    print_lines(&args, &report, (model.context, threads), (shard, peer_config.is_some()), &medians);
    Ok(())
}

/// The repetitions of a benchmark: troupe's measured runs, its same-run baselines and the peer's.
struct Repetitions {
    ours: Vec<ClusterRun>,
    /// The same-run baseline: DDP with the all-reduce after the backward, or, for a sharded run, DDP.
    sequential: Vec<ClusterRun>,
    /// The peer's JSON report of each repetition (with `--peer`).
    peers: Vec<Value>,
}

/// The median tokens/s of each side.
struct Medians {
    tokens_per_s: f64,
    sequential: f64,
    /// With `--peer`.
    peer: Option<f64>,
}

/// `--repeats` repetitions of the `measured` run, its baseline and (`--peer`) the peer, each on a fresh
/// cluster; `peer_config`: where the peer finds the model, when it is not gpt-tiny.
fn measure_repeats(
    args: &BenchTrainArgs,
    runtime: &tokio::runtime::Runtime,
    (model, peer_config): (&ModelConfig, Option<&PeerDir>),
    threads: usize,
    measured: Variant,
) -> anyhow::Result<Repetitions> {
    let (world, shard) = (args.world, measured.shard);
    let mut runs = Repetitions { ours: Vec::new(), sequential: Vec::new(), peers: Vec::new() };
    for _ in 0..args.repeats.max(1) {
        runs.ours.push(runtime.block_on(measure_cluster(model, world, args.steps, threads, measured))?);
        let baseline = match shard {
            _ if measured.sync != "every_step" => Variant { sync: "every_step", ..measured },
            "none" => Variant { overlap: false, shard, ..measured },
            _ => Variant { shard: "none", ..measured },
        };
        runs.sequential.push(runtime.block_on(measure_cluster(model, world, args.steps, threads, baseline))?);
        if args.peer {
            let mut flags = vec![
                ("--world", world.to_string()),
                ("--micro-batch", MICRO_BATCH.to_string()),
                ("--context", model.context.to_string()),
                ("--threads", threads.to_string()),
                ("--precision", args.precision.clone()),
            ];
            if let Some(dir) = peer_config {
                flags.extend(peer_model_flags(dir, model));
            }
            runs.peers.push(run_peer(args, "ddp_gpt_tiny.py", &flags)?);
        }
    }
    Ok(runs)
}

impl Repetitions {
    fn medians(&self, peer: bool) -> Medians {
        Medians {
            tokens_per_s: median(self.ours.iter().map(|r| r.tokens_per_s).collect()),
            sequential: median(self.sequential.iter().map(|r| r.tokens_per_s).collect()),
            peer: peer
                .then(|| median(self.peers.iter().map(|p| p["tokens_per_s"].as_f64().unwrap_or(f64::NAN)).collect())),
        }
    }

    /// The JSON report: troupe's runs, then its baseline's, then the peer's.
    fn report(
        &self,
        args: &BenchTrainArgs,
        model: &ModelConfig,
        threads: usize,
        shard: &str,
        medians: &Medians,
    ) -> Value {
        let (world, context, ours) = (args.world, model.context, &self.ours);
        let runs: Vec<f64> = ours.iter().map(|r| r.tokens_per_s).collect();
        let tokens_per_s = medians.tokens_per_s;
        let peak_mib = per_rank_max_mib(ours.iter().map(|r| r.peak_rss_bytes.clone()));
        let sequential_runs: Vec<f64> = self.sequential.iter().map(|r| r.tokens_per_s).collect();
        let sequential_tps = medians.sequential;
        let mut report = json!({
            "bench": "train", "world": world, "shard": args.shard, "precision": args.precision, "steps": args.steps,
            "warmup_steps": WARMUP_STEPS,
            "model": args.model, "arch": model.arch.as_str(), "params": troupe_model::model::base_specs(model).iter().map(|s| s.numel()).sum::<usize>(), "trainable_params": model.param_count(), "peft": args.peft,
            "micro_batch": MICRO_BATCH, "global_batch": MICRO_BATCH * world, "context": context,
            "torch_threads": threads, "repeats": ours.len(),
            "tokens_per_s": tokens_per_s, "tokens_per_s_runs": runs,
            "final_loss": ours.last().map(|r| r.final_loss),
            "peak_rss_mib_per_rank": peak_mib,
            "overlap_comm": true, "bucket_mib": if args.bucket_mib > 0 { args.bucket_mib } else { 25 },
        });
        if args.sync != "every_step" {
            let figures = |runs: &[ClusterRun]| -> Vec<super::periodic::RunFigures> {
                let figures = |r: &ClusterRun| super::periodic::RunFigures {
                    tokens_per_s: r.tokens_per_s,
                    final_loss: r.final_loss,
                    bytes_sent: r.bytes_sent,
                    eval_loss: r.eval_loss,
                };
                runs.iter().map(figures).collect()
            };
            extend_report(&mut report, super::periodic::report(args, &figures(ours), &figures(&self.sequential)));
        } else if shard == "none" {
            let extra = json!({
                "tokens_per_s_no_overlap": sequential_tps, "tokens_per_s_no_overlap_runs": sequential_runs,
                "overlap_speedup": tokens_per_s / sequential_tps,
            });
            extend_report(&mut report, extra);
        } else {
            let ddp_peak_mib = per_rank_max_mib(self.sequential.iter().map(|r| r.peak_rss_bytes.clone()));
            let extra = json!({
                "ddp_tokens_per_s": sequential_tps, "ddp_tokens_per_s_runs": sequential_runs,
                "ddp_peak_rss_mib_per_rank": ddp_peak_mib, "ratio_vs_ddp": tokens_per_s / sequential_tps,
            });
            extend_report(&mut report, extra);
        }
        if let Some(peer_tps) = medians.peer {
            let peers = &self.peers;
            let peer_peak_mib = per_rank_max_mib(peers.iter().map(peer_peak_bytes));
            let extra = json!({
                "peer": peers.last().map(|p| p["peer"].clone()), "peer_shard": "none",
                "peer_params": peers.last().map(|p| p["params"].clone()), "peer_tokens_per_s": peer_tps,
                "peer_tokens_per_s_runs": peers.iter().map(|p| p["tokens_per_s"].clone()).collect::<Vec<_>>(),
                "peer_peak_rss_mib_per_rank": peer_peak_mib,
                "ratio": tokens_per_s / peer_tps,
                (if shard == "none" { "ratio_no_overlap" } else { "ratio_ddp_vs_peer" }): sequential_tps / peer_tps,
            });
            extend_report(&mut report, extra);
        }
        report
    }
}

/// The human lines: troupe, its baseline, the peer and the ratio (`peer_transformers`: the peer ran
/// transformers' model, not its own gpt-tiny).
fn print_lines(
    args: &BenchTrainArgs,
    report: &Value,
    (context, threads): (usize, usize),
    (shard, peer_transformers): (&str, bool),
    medians: &Medians,
) {
    let (world, tokens_per_s, sequential_tps) = (args.world, medians.tokens_per_s, medians.sequential);
    let mode = match shard {
        _ if args.sync != "every_step" => format!("{} H={}", args.sync, args.sync_every),
        "none" => "DDP".to_string(),
        _ => shard.to_uppercase().replace("ZERO", "ZeRO-"),
    };
    let reduce = match shard {
        _ if args.sync != "every_step" => "local steps, the replicas' parameters all-reduced every H steps",
        "none" => "all-reduce overlapped with backward",
        "zero1" => "all-reduce after the backward, AdamW on each rank's shard + its buddy copy",
        "zero3" => "parameters gathered per unit just in time, gradients reduced per unit to their owners, AdamW on each rank's shard + its buddy copy",
        _ => "reduce-scatter after the backward, AdamW on each rank's shard + its buddy copy",
    };
    println!(
        "troupe   {tokens_per_s:>9.0} tokens/s  ({} at context {context}, world {world}, {mode} on {world} daemons, {reduce}, {threads} thread(s) per rank, peak RSS per rank {} MiB)",
        args.model,
        mib_list(&report["peak_rss_mib_per_rank"])
    );
    if args.sync != "every_step" {
        super::periodic::print_line(report);
    } else if shard == "none" {
        println!("troupe   {sequential_tps:>9.0} tokens/s  (the same, all-reduce after the whole backward)");
    } else {
        println!(
            "troupe   {sequential_tps:>9.0} tokens/s  (DDP, same run, peak RSS per rank {} MiB); {mode} / DDP = {:.3}",
            mib_list(&report["ddp_peak_rss_mib_per_rank"]),
            tokens_per_s / sequential_tps
        );
    }
    if let Some(peer_tps) = medians.peer {
        let peer_name = if peer_transformers { "transformers" } else { "pytorch " };
        println!(
            "{peer_name} {peer_tps:>9.0} tokens/s  (DDP over Gloo, same model and batch, peak RSS per rank {} MiB)",
            mib_list(&report["peer_peak_rss_mib_per_rank"])
        );
        println!("ratio    {:>9.3}", tokens_per_s / peer_tps);
    }
}

/// The torch threads per daemon (`--threads`, else the cores divided by `--world`, at least 1) and the
/// runtime that follows the jobs.
pub(super) fn job_runtime(args: &BenchTrainArgs) -> anyhow::Result<(usize, tokio::runtime::Runtime)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if args.threads > 0 { args.threads } else { (cores / args.world).max(1) };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    Ok((threads, runtime))
}

/// `--shard`'s value (as clap checked it) as a variant's.
pub(super) fn shard_name(shard: &str) -> &'static str {
    match shard {
        "zero1" => "zero1",
        "zero2" => "zero2",
        "zero3" => "zero3",
        _ => "none",
    }
}

/// `--precision`'s value (as clap checked it) as a variant's.
pub(super) fn precision_name(precision: &str) -> &'static str {
    match precision {
        "bf16" => "bf16",
        "fp16" => "fp16",
        _ => "fp32",
    }
}

/// How the job all-reduces its gradients, its tensor-parallel degree and its optimizer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Variant {
    /// `parallel.overlap_comm`.
    pub(super) overlap: bool,
    /// `parallel.bucket_mib` (0: the default).
    pub(super) bucket_mib: usize,
    /// `parallel.shard`: none, zero1, zero2 or zero3.
    pub(super) shard: &'static str,
    /// `parallel.precision`.
    pub(super) precision: &'static str,
    /// `parallel.tp`: the world is tp × data-parallel replicas of `MICRO_BATCH` samples each.
    pub(super) tp: usize,
    /// `parallel.sp` (with `tp` > 1).
    pub(super) sp: bool,
    /// `parallel.sync` and `parallel.sync_every`.
    pub(super) sync: &'static str,
    /// `train.optimizer`.
    pub(super) optimizer: &'static str,
    pub(super) sync_every: u64,
    /// The figures a periodic synchronization is compared by: the bytes the ranks send (the daemons
    /// serve `/metrics`, read after the job) and the validation loss of the final model (a tenth of the
    /// corpus held out, evaluated after the last step).
    pub(super) counted: bool,
}

impl Variant {
    /// DDP, overlapped, default buckets, AdamW, in `precision`.
    pub(super) fn ddp(precision: &'static str) -> Self {
        let (sync, sync_every, counted) = ("every_step", 1, false);
        let optimizer = "adamw";
        Self {
            overlap: true,
            bucket_mib: 0,
            shard: "none",
            precision,
            tp: 1,
            sp: false,
            sync,
            sync_every,
            optimizer,
            counted,
        }
    }
}

/// One repetition: a fresh cluster of `world` daemons, one job training `model` for `steps` timed steps
/// after the warm-up.
pub(super) async fn measure_cluster(
    model: &ModelConfig,
    world: usize,
    steps: u64,
    threads: usize,
    variant: Variant,
) -> anyhow::Result<ClusterRun> {
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    let mut options = LocalClusterOptions::new(world);
    options.torch_threads = threads;
    options.membership.failure_timeout_ms = FAILURE_TIMEOUT_MS;
    if variant.counted {
        options.telemetry.metrics_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    }
    let cluster = LocalCluster::processes(&binary, options).await?;
    let outcome = run_job(&cluster, model, world, steps, threads, variant).await;
    let bytes_sent = match variant.counted {
        true => Some(super::periodic::bytes_sent(&cluster, world).await?),
        false => None,
    };
    let peaks: anyhow::Result<Vec<u64>> = (0..world)
        .map(|i| {
            let pid = cluster.pid(i).context("the local cluster's daemons are not processes")?;
            vm_hwm_bytes(&format!("/proc/{pid}/status"))
                .with_context(|| format!("reading VmHWM of daemon {} (pid {pid})", cluster.node_name(i)))
        })
        .collect();
    cluster.shutdown().await;
    let JobRun { tokens_per_s, first_loss, final_loss, eval_loss, usage } = outcome?;
    Ok(ClusterRun { tokens_per_s, final_loss, first_loss, peak_rss_bytes: peaks?, bytes_sent, eval_loss, usage })
}

/// Submits the job and follows it to the end.
async fn run_job(
    cluster: &LocalCluster,
    model: &ModelConfig,
    world: usize,
    steps: u64,
    threads: usize,
    variant: Variant,
) -> anyhow::Result<JobRun> {
    run_job_with(cluster, model, world, steps, threads, variant, 1).await
}

/// [`run_job`] with Streaming DiLoCo's `parallel.fragments`.
pub(super) async fn run_job_with(
    cluster: &LocalCluster,
    model: &ModelConfig,
    world: usize,
    steps: u64,
    threads: usize,
    variant: Variant,
    fragments: usize,
) -> anyhow::Result<JobRun> {
    let replicas = world / variant.tp;
    let mut config = JobConfig { model: model.clone(), ..JobConfig::default() };
    config.train.steps = steps + WARMUP_STEPS;
    config.train.global_batch = MICRO_BATCH * replicas;
    config.train.micro_batch = MICRO_BATCH;
    config.train.torch_threads = threads;
    config.parallel.nodes = world;
    config.parallel.overlap_comm = variant.overlap;
    config.parallel.bucket_mib = variant.bucket_mib;
    config.parallel.precision = variant.precision.into();
    config.parallel.tp = variant.tp;
    config.parallel.sp = variant.sp;
    config.parallel.sync = variant.sync.into();
    config.parallel.sync_every = variant.sync_every;
    config.parallel.fragments = fragments;
    config.train.optimizer = variant.optimizer.into();
    if variant.counted {
        config.data.val_fraction = 0.1;
        config.train.eval_every = config.train.steps;
    }
    let tokens_per_step = (config.train.global_batch * config.model.context) as u64;
    let job = Job::new(config).name("bench-train").data_parallel(replicas, variant.shard).elastic(world, world, 0);
    let mut handle = cluster.client().await?.submit(job).await?;
    let started = Instant::now();
    let mut commits = Vec::new();
    let (mut first_loss, mut loss, mut eval_loss, mut usage) = (f64::NAN, f64::NAN, None, None);
    let outcome = loop {
        let next = tokio::time::timeout(Duration::from_millis(EVENT_WAIT_MS_MAX), handle.next_event()).await;
        let Ok(event) = next else {
            break Err(anyhow::anyhow!(
                "no event from the job for {EVENT_WAIT_MS_MAX} ms ({} steps committed): a collective is stuck, \
                 or one step of {} at context {} takes longer than that on this machine (lower --context or \
                 pick a smaller --model)",
                commits.len(),
                model.preset.as_deref().unwrap_or("the model"),
                model.context
            ));
        };
        let Some(event) = event? else { break Err(anyhow::anyhow!("the job's events ended early")) };
        match event {
            JobEvent::Started { world: w, .. } | JobEvent::Step { world: w, .. } if w != world => {
                break Err(anyhow::anyhow!("the job ran on {w} ranks, not {world}"));
            }
            JobEvent::Step { step, loss: l, .. } => {
                if commits.is_empty() {
                    first_loss = l;
                }
                commits.push((step, started.elapsed()));
                loss = l;
            }
            JobEvent::Membership { changes, .. } => {
                break Err(anyhow::anyhow!("membership changed during the benchmark: {}", changes.join("; ")));
            }
            JobEvent::Recovered { step, .. } => {
                break Err(anyhow::anyhow!("the job recovered after step {step}: a rank failed during the benchmark"));
            }
            JobEvent::Usage { ranks, .. } => usage = Some(ranks),
            JobEvent::Started { .. }
            | JobEvent::Placed { .. }
            | JobEvent::Waiting { .. }
            | JobEvent::Saved { .. }
            | JobEvent::Checkpoint { .. }
            | JobEvent::Phases { .. } => {}
            JobEvent::Eval { loss, .. } => eval_loss = Some(loss),
            JobEvent::RolledBack { .. } => break Err(anyhow::anyhow!("the job rolled back during the benchmark")),
            JobEvent::Finished { .. } => break Ok(()),
            JobEvent::Failed { reason } => break Err(anyhow::anyhow!("the job failed: {reason}")),
            JobEvent::Cancelled => break Err(anyhow::anyhow!("the job was cancelled")),
        }
    };
    handle.close().await;
    outcome?;
    let tokens_per_s = steady_tokens_per_s(&commits, WARMUP_STEPS, steps + WARMUP_STEPS, tokens_per_step)
        .with_context(|| {
            format!("the commits of steps {WARMUP_STEPS} and {} were not both seen", steps + WARMUP_STEPS)
        })?;
    Ok(JobRun { tokens_per_s, first_loss, final_loss: loss, eval_loss, usage })
}

/// Tokens per second from the commit of step `from` to the commit of step `to`, given each committed
/// step's arrival time; None when either commit is missing or no time passed.
fn steady_tokens_per_s(commits: &[(u64, Duration)], from: u64, to: u64, tokens_per_step: u64) -> Option<f64> {
    let at = |step| commits.iter().find(|(s, _)| *s == step).map(|(_, t)| *t);
    let seconds = at(to)?.checked_sub(at(from)?)?.as_secs_f64();
    (to > from && seconds > 0.0).then(|| (to - from) as f64 * tokens_per_step as f64 / seconds)
}

/// The peak per rank over repetitions, in MiB (one decimal).
pub(super) fn per_rank_max_mib(runs: impl Iterator<Item = Vec<u64>>) -> Vec<f64> {
    let mut peak: Vec<u64> = Vec::new();
    for run in runs {
        peak.resize(peak.len().max(run.len()), 0);
        for (p, r) in peak.iter_mut().zip(run) {
            *p = (*p).max(r);
        }
    }
    peak.iter().map(|&b| (b as f64 / MIB * 10.0).round() / 10.0).collect()
}

pub(super) fn peer_peak_bytes(peer: &Value) -> Vec<u64> {
    peer["peak_mem_bytes_per_rank"].as_array().map_or_else(Vec::new, |a| a.iter().filter_map(Value::as_u64).collect())
}

pub(super) fn mib_list(values: &Value) -> String {
    let values = values.as_array().map_or_else(Vec::new, |a| a.iter().filter_map(Value::as_f64).collect());
    values.iter().map(|v| format!("{v:.0}")).collect::<Vec<_>>().join(" / ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(commits: &[(u64, u64)], from: u64, to: u64, expected: Option<f64>) {
        let commits: Vec<(u64, Duration)> = commits.iter().map(|&(s, ms)| (s, Duration::from_millis(ms))).collect();
        assert_eq!(steady_tokens_per_s(&commits, from, to, 1024), expected, "{commits:?} {from}..{to}");
    }

    #[test]
    fn steady_throughput_counts_only_the_steps_after_the_warm_up() {
        // Step 1 took 5 s (start-up), step 2 one; steps 3 and 4 half a second each.
        check(&[(1, 5000), (2, 6000), (3, 6500), (4, 7000)], 2, 4, Some(2.0 * 1024.0 / 1.0));
        check(&[(1, 5000), (2, 6000), (3, 6500), (4, 7000)], 0, 4, None);
        check(&[(1, 5000), (2, 6000)], 2, 4, None);
        check(&[(2, 6000), (4, 6000)], 2, 4, None);
    }

    #[test]
    fn peak_memory_is_the_largest_of_each_rank_over_repetitions() {
        let runs = vec![vec![100 << 20, 300 << 20], vec![200 << 20, 250 << 20]];
        assert_eq!(per_rank_max_mib(runs.into_iter()), vec![200.0, 300.0]);
    }
}

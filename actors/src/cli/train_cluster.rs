//! `troupe train` on a cluster: an embedded local cluster of `--nodes` daemons (child processes on
//! loopback, torn down at the end, also on Ctrl-C), or a running cluster with `--cluster ADDR`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

use super::train::TrainArgs;
use crate::api::{Client, DataPlane, Job, JobEvent, JobHandle, LocalCluster, LocalClusterOptions};
use crate::progress::{spinner, Reporter, StepEvent};
use crate::telemetry::RunDir;

/// How long an interrupted run waits for the controller to confirm the cancellation, and for the
/// client connection to close, before it tears the local cluster down regardless.
const GOODBYE: Duration = Duration::from_secs(5);

pub fn run(args: TrainArgs, config: JobConfig) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(train(args, config))
}

async fn train(args: TrainArgs, mut config: JobConfig) -> anyhow::Result<()> {
    if let Some(dir) = &config.checkpoint.dir {
        // The daemons may run elsewhere (or in another directory): make it absolute.
        let absolute = std::path::absolute(dir).with_context(|| format!("--checkpoint-dir {}", dir.display()))?;
        config.checkpoint.dir = Some(absolute);
    }
    let nodes = config.parallel.nodes;
    let run_dir = args.run_dir.as_deref().map(RunDir::create).transpose()?;
    let (cluster, client) = match &args.cluster {
        Some(addr) => {
            let addr = addr.parse().with_context(|| format!("--cluster {addr}: not an address like 10.0.0.5:7400"))?;
            let (Some(certs), Some(name)) = (&args.identity.certs, &args.identity.name) else {
                bail!(
                    "--cluster {addr}: which certificate? pass --certs DIR --as NAME (see `troupe cluster add-node`)"
                );
            };
            let identity = NodeIdentity::load(certs, name)?;
            (None, Client::connect(addr, &identity).await?)
        }
        None => {
            let binary = std::env::current_exe().context("locating the troupe binary")?;
            let started = Instant::now();
            let mut options = LocalClusterOptions::new(nodes);
            options.torch_threads = config.train.torch_threads;
            let starting = spinner(args.json, format!("starting a local cluster of {nodes} daemons on loopback"));
            let cluster = LocalCluster::processes(&binary, options).await?;
            drop(starting);
            if !args.json {
                println!(
                    "troupe: local cluster of {nodes} daemons on loopback up in {:.1} s (controller {})",
                    started.elapsed().as_secs_f64(),
                    cluster.addr()
                );
            }
            let client = cluster.client().await?;
            (Some(cluster), client)
        }
    };
    let total = config.train.steps;
    let plane = if args.data_plane == "quic" { DataPlane::Quic } else { DataPlane::Auto };
    let mode = Mode::of(&config);
    let mut job = Job::new(config).name("train").data_plane(plane).trace(run_dir.is_some());
    if let Some(path) = &args.save_final {
        let path = std::path::absolute(path).with_context(|| format!("--save-final {}", path.display()))?;
        job = job.save_final(path);
    }
    // Listen for Ctrl-C and SIGTERM before the loop: a signal that arrives while an event is being
    // printed is kept for the next poll (a fresh `ctrl_c()` future per iteration would miss it).
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut handle = client.submit(job).await?;
    let reporter = Reporter::new(args.json, 0, total, args.log_every).with_run_dir(run_dir);
    let started = Instant::now();
    let (mut first_loss, mut last, mut tokens_per_s, mut world) = (None, Vec::new(), Vec::new(), 0);
    let outcome = loop {
        let event = tokio::select! {
            e = handle.next_event() => e?,
            _ = interrupt.recv() => break Err(interrupted(&mut handle, &reporter).await),
            _ = terminate.recv() => break Err(interrupted(&mut handle, &reporter).await),
        };
        let Some(event) = event else { break Err(anyhow::anyhow!("the job's event stream ended early")) };
        match event {
            JobEvent::Started { world: w, epoch, from_step, attempt } => {
                world = w;
                reporter.event(
                    "start",
                    json!({ "world": w, "pp": mode.pp, "epoch": epoch, "from_step": from_step, "attempt": attempt, "steps": total,
                            "nodes": nodes, "job": handle.id() }),
                    &format!("troupe: job {} running {} on {w} rank(s), epoch {epoch}", handle.id(), mode.describe(w)),
                );
            }
            JobEvent::Step {
                step,
                loss,
                lr,
                grad_norm,
                skipped,
                loss_scale,
                tokens_per_s: tps,
                epoch,
                world: w,
                peak_rss_bytes,
                bubble,
            } => {
                world = w;
                first_loss.get_or_insert(loss);
                last.push(loss);
                tokens_per_s.push(tps);
                if last.len() > 10 {
                    last.remove(0);
                }
                let tokens_per_s = tps;
                let event = StepEvent {
                    step,
                    loss,
                    lr,
                    grad_norm,
                    tokens_per_s,
                    epoch,
                    world: w,
                    peak_rss_bytes,
                    skipped,
                    loss_scale,
                    bubble,
                };
                reporter.step(&event);
            }
            JobEvent::Membership { epoch, world: w, changes } => reporter.event(
                "membership",
                json!({ "epoch": epoch, "world": w, "changes": changes }),
                &format!("membership changed (epoch {epoch}, {w} ranks): {}", changes.join("; ")),
            ),
            JobEvent::Recovered { step, epoch, world: w } => {
                world = w;
                reporter.event(
                    "recovery",
                    json!({ "step": step, "epoch": epoch, "world": w }),
                    &format!("recovered: continuing after step {step} on {w} ranks (epoch {epoch})"),
                );
            }
            JobEvent::Waiting { nodes: have, min_nodes, wait_s } => {
                let limit =
                    if wait_s == 0 { "for as long as it takes".to_string() } else { format!("at most {wait_s} s") };
                reporter.event(
                    "waiting",
                    json!({ "nodes": have, "min_nodes": min_nodes, "wait_s": wait_s }),
                    &format!(
                        "waiting: {have} node(s) offer ranks, elastic.min_nodes is {min_nodes}{}; holding the last committed step {limit}",
                        mode.needs()
                    ),
                )
            }
            JobEvent::Checkpoint { step, path, seconds, bytes } => reporter.checkpoint(step, &path, seconds, bytes),
            JobEvent::RolledBack { from_step, to_step } => reporter.event(
                "rollback",
                json!({ "from_step": from_step, "to_step": to_step }),
                &format!(
                    "every node holding step {from_step} was lost: continuing from the checkpoint of step {to_step}"
                ),
            ),
            JobEvent::Saved { path } => reporter.event(
                "saved",
                json!({ "path": path }),
                &format!("saved final parameters to {}", path.display()),
            ),
            JobEvent::Phases { rank, node, attempt, step, spans, stage } => reporter.record_only(
                "phases",
                json!({ "rank": rank, "node": node, "attempt": attempt, "step": step, "spans": spans, "stage": stage }),
            ),
            JobEvent::Finished { steps, .. } => break Ok(steps),
            JobEvent::Failed { reason } => break Err(anyhow::anyhow!("the job failed: {reason}")),
            JobEvent::Cancelled => break Err(anyhow::anyhow!("the job was cancelled")),
        }
    };
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    let steps = outcome?;
    let wall = started.elapsed().as_secs_f64();
    let mean = last.iter().sum::<f64>() / last.len().max(1) as f64;
    let first = first_loss.unwrap_or(f64::NAN);
    // Steady-state throughput: the median step (the first steps include start-up).
    tokens_per_s.sort_by(f64::total_cmp);
    let median = tokens_per_s.get(tokens_per_s.len() / 2).copied().unwrap_or(0.0);
    reporter.finish(
        json!({ "steps": steps, "first_loss": first, "final_loss": last.last(), "final_loss_mean10": mean,
                "tokens_per_s": median, "wall_s": wall, "world": world, "nodes": nodes }),
        &format!(
            "done: {steps} steps on {world} ranks in {wall:.1} s; loss {first:.4} → {mean:.4} (mean of the last {}); {median:.0} tokens/s",
            last.len()
        ),
    );
    Ok(())
}

/// Ctrl-C or SIGTERM: ask the controller to cancel the job (bounded), then report the interruption.
async fn interrupted(handle: &mut JobHandle, reporter: &Reporter) -> anyhow::Error {
    reporter.say("troupe: interrupted; cancelling the job");
    match tokio::time::timeout(GOODBYE, handle.cancel()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => reporter.say(&format!("troupe: cancelling job {} failed: {e:#}", handle.id())),
        Err(_) => {
            reporter.say(&format!("troupe: no answer to the cancellation of job {} within {GOODBYE:?}", handle.id()))
        }
    }
    anyhow::anyhow!("interrupted")
}

/// How the job splits the work, for the human start line.
struct Mode {
    pp: usize,
    schedule: String,
    shard: String,
}

impl Mode {
    fn of(config: &JobConfig) -> Self {
        let parallel = &config.parallel;
        Self { pp: parallel.pp, schedule: parallel.schedule.clone(), shard: parallel.shard.clone() }
    }

    /// What else a job needs to run, for the waiting line.
    fn needs(&self) -> String {
        if self.pp > 1 {
            format!(" and one pipeline needs {} slots", self.pp)
        } else {
            String::new()
        }
    }

    fn describe(&self, world: usize) -> String {
        match (self.pp, self.shard.as_str()) {
            (1, "none") => "data-parallel".into(),
            (1, shard) => format!("data-parallel with {shard}"),
            (pp, _) => format!("{} {} pipeline(s) of {pp} stages", world / pp, self.schedule),
        }
    }
}

//! `troupe bench recovery --controller`: the controller's loss (issue 32). SIGKILL the daemon of the
//! Raft leader of three controller-eligible daemons, for good, and time the kill → the next step the
//! new leader commits (`takeover_s`); beside it, today's single controller SIGKILLed and restarted in
//! place at once (a supervisor's best case: `restart_s`), and torchft's lighthouse, whose 5 s
//! heartbeat timeout is the least a peer's replica group waits before it is declared gone (quoted, not
//! run: torchft has no standby lighthouse). Then the step overhead of replicating the controller: gpt-tiny's
//! tokens/s with three controllers over one, the two runs in the same command.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_model::config::JobConfig;

use super::{kill, quantiles, RecoveryArgs};
use crate::api::{Job, JobEvent, JobHandle, LocalCluster, LocalClusterOptions};

/// torchft's lighthouse declares a replica group gone after this long without a heartbeat
/// (`heartbeat_timeout_ms`, default 5000 in torchft's `LighthouseServer`).
const TORCHFT_HEARTBEAT_TIMEOUT_S: f64 = 5.0;
/// Eligible daemons of the replicated runs.
const CONTROLLERS: usize = 3;
/// Steps of the overhead runs (the first few, start-up, are left out of the median).
const OVERHEAD_STEPS: u64 = 40;

/// How the controller is lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loss {
    /// The Raft leader of three controllers, SIGKILLed for good.
    TakeOver,
    /// The single controller, SIGKILLed and restarted at once on its catalog.
    RestartInPlace,
}

pub fn run(args: &RecoveryArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<Value> {
    if args.nodes < CONTROLLERS {
        bail!(
            "--controller --nodes {}: the take-over needs at least {CONTROLLERS} daemons (three controllers)",
            args.nodes
        );
    }
    let (mut takeover, mut restart) = (Vec::new(), Vec::new());
    for run in 0..args.runs {
        for (loss, into) in [(Loss::TakeOver, &mut takeover), (Loss::RestartInPlace, &mut restart)] {
            let t = runtime.block_on(measure(args, loss)).with_context(|| format!("{loss:?}, run {}", run + 1))?;
            eprintln!("run {}/{}: {loss:?} {t:.3} s", run + 1, args.runs);
            into.push(t);
        }
    }
    let overhead = runtime.block_on(overhead(args))?;
    let (ours, restarted) = (quantiles(takeover.clone()), quantiles(restart.clone()));
    Ok(json!({
        "bench": "recovery", "fault": "controller", "nodes": args.nodes, "controllers": CONTROLLERS,
        "kill_at_step": args.kill_at_step, "runs_count": args.runs,
        "takeover_s": ours, "restart_in_place_s": restarted,
        "ratio_p50_restart_over_takeover": restarted["p50"].as_f64().zip(ours["p50"].as_f64()).map(|(r, t)| r / t),
        "peer": "torchft lighthouse", "peer_floor_s": TORCHFT_HEARTBEAT_TIMEOUT_S,
        "peer_note": "torchft's lighthouse is one process with no standby: its loss stops every replica group's \
            quorum until it is restarted; a lost replica group is declared gone only after the 5 s heartbeat timeout",
        "overhead": overhead,
        "runs": { "takeover_s": takeover, "restart_in_place_s": restart },
    }))
}

/// One loss of the controller on a fresh cluster: seconds from the SIGKILL to the next step committed
/// by the new (or restarted) controller, as a watcher attached after the kill sees it.
async fn measure(args: &RecoveryArgs, loss: Loss) -> anyhow::Result<f64> {
    let mut config = JobConfig::default();
    config.train.steps = args.kill_at_step + args.steps_after;
    config.train.torch_threads = 1;
    let mut cluster = start(args.nodes, loss == Loss::TakeOver).await?;
    let leader = match loss {
        Loss::TakeOver => leader_of(&cluster, Duration::from_secs(30)).await?,
        Loss::RestartInPlace => 0,
    };
    let others: Vec<usize> = (0..args.nodes).filter(|&i| i != leader).collect();
    let mut handle = cluster.client_to(others[0]).await?.submit(Job::new(config)).await?;
    let job = handle.id();
    let seen = loop {
        let Some((seq, event)) = handle.next_numbered().await? else { bail!("the job ended before the kill") };
        if matches!(event, JobEvent::Step { step, .. } if step >= args.kill_at_step) {
            break seq + 1;
        }
    };
    drop(handle);
    kill(cluster.pid(leader).context("the controller's pid")?)?;
    let killed = Instant::now();
    let askable = match loss {
        Loss::TakeOver => others,
        Loss::RestartInPlace => {
            tokio::task::block_in_place(|| {
                cluster.wait_exit(0, Duration::from_secs(10)).context("the killed controller did not exit")?;
                anyhow::Ok(cluster.restart_node(0)?)
            })?;
            vec![0]
        }
    };
    let mut handle = watch(&cluster, &askable, job, seen).await?;
    let mut resumed = false;
    let took = loop {
        match handle.next_event().await?.context("the job's stream ended after the kill")? {
            JobEvent::Membership { changes, .. } if changes.iter().any(|c| c.contains("resuming after step")) => {
                resumed = true
            }
            JobEvent::Step { .. } if resumed => break killed.elapsed().as_secs_f64(),
            JobEvent::Failed { reason } => bail!("the job failed after the kill: {reason}"),
            _ => {}
        }
    };
    handle.close().await;
    cluster.shutdown().await;
    Ok(took)
}

/// A local cluster of `nodes` daemon processes, three of them controller-eligible if `replicated`.
async fn start(nodes: usize, replicated: bool) -> anyhow::Result<LocalCluster> {
    let mut options = LocalClusterOptions::new(nodes);
    options.torch_threads = 1;
    options.controllers = if replicated { CONTROLLERS } else { 0 };
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    Ok(LocalCluster::processes(&binary, options).await?)
}

/// The index of the daemon that says it is the controller (the Raft leader), once one does.
async fn leader_of(cluster: &LocalCluster, within: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        for i in 0..CONTROLLERS {
            let asked = tokio::time::timeout(Duration::from_secs(1), async {
                let mut client = cluster.client_to(i).await?;
                let status = client.status().await;
                client.close().await;
                status
            });
            if let Ok(Ok(status)) = asked.await {
                if status.controller {
                    return Ok(i);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("no controller elected among the first {CONTROLLERS} daemons within {within:?}")
}

/// Follows `job` from event `since` through daemons `askable` (redirected to the controller), asking
/// again while none answers (an election, a restart under way).
async fn watch(cluster: &LocalCluster, askable: &[usize], job: u64, since: u64) -> anyhow::Result<JobHandle> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for &i in askable {
            // A redirect to the controller that just died would wait for the connect timeout.
            let tried = tokio::time::timeout(Duration::from_secs(1), async {
                cluster.client_to(i).await?.watch_from(job, since).await
            });
            if let Ok(Ok(handle)) = tried.await {
                return Ok(handle);
            }
        }
        if Instant::now() > deadline {
            bail!("no controller answered for job {job} within 60 s of the kill");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// gpt-tiny's median tokens/s with three controllers and with one (twice each, alternating, on fresh
/// clusters), and their ratio: what committing every step's record through a Raft majority costs.
async fn overhead(args: &RecoveryArgs) -> anyhow::Result<Value> {
    let (mut one, mut three) = (Vec::new(), Vec::new());
    for replicated in [false, true, false, true] {
        let rate = tokens_per_s(args.nodes, replicated).await?;
        eprintln!("overhead: {} controller(s): {rate:.0} tokens/s", if replicated { CONTROLLERS } else { 1 });
        if replicated { &mut three } else { &mut one }.push(rate);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        (v[(n - 1) / 2] + v[n / 2]) / 2.0
    };
    let (one_rate, three_rate) = (median(&mut one), median(&mut three));
    Ok(json!({
        "model": "gpt-tiny", "steps": OVERHEAD_STEPS, "tokens_per_s_one": one_rate, "tokens_per_s_three": three_rate,
        "ratio_three_over_one": three_rate / one_rate, "runs_one": one, "runs_three": three,
    }))
}

/// The median tokens/s of a gpt-tiny job's steps after the fifth, on a fresh cluster.
async fn tokens_per_s(nodes: usize, replicated: bool) -> anyhow::Result<f64> {
    let mut config = JobConfig::default();
    config.train.steps = OVERHEAD_STEPS;
    config.train.torch_threads = 1;
    let cluster = start(nodes, replicated).await?;
    let mut handle = cluster.client().await?.submit(Job::new(config)).await?;
    let mut rates = Vec::new();
    while let Some(event) = handle.next_event().await? {
        match event {
            JobEvent::Step { step, tokens_per_s, .. } if step > 5 => rates.push(tokens_per_s),
            JobEvent::Failed { reason } => bail!("the overhead run failed: {reason}"),
            _ => {}
        }
    }
    handle.close().await;
    cluster.shutdown().await;
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len() / 2).copied().context("the overhead run committed no step")
}

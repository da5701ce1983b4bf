//! `troupe bench recovery`: SIGKILL one daemon of a local cluster at a chosen step of a DDP (or ZeRO-1/2,
//! `--shard`) job and
//! measure how long until the controller notices (detect_s) and until the next step commits on the
//! survivors (recovery_s), with the phases between (`phases`: detect, decide, resume — from the job's
//! event stream); then check the run against the single-process reference. With --peer, then
//! the same loss under torchrun (bench/peers/torchrun_recovery.py: restart the worker group from the last
//! checkpoint), with the same ranks and kill step, and ratio = peer_recovery_s / recovery_s. With
//! `--runs N`, N measurements on fresh clusters summarised as p50/p99 (and the peer `--peer-runs` times).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tch::Tensor;
use troupe_cluster::membership::DetectorKind;
use troupe_model::config::JobConfig;
use troupe_model::oracle::compare_params;
use troupe_model::Trainer;

use super::bench_train::{peer_python, peer_script};
use crate::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};

#[derive(Debug, clap::Args)]
pub struct RecoveryArgs {
    /// Daemons (one rank each); the last one is killed.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// The step after whose commit the daemon is killed.
    #[arg(long, default_value_t = 5)]
    pub kill_at_step: u64,
    /// Steps after the kill.
    #[arg(long, default_value_t = 5)]
    pub steps_after: u64,
    /// Sharding of the job: none (DDP: every rank holds the state), zero1 or zero2 (each shard also
    /// held by a buddy rank, so the killed rank's shard is restored from memory).
    #[arg(long, value_parser = ["none", "zero1", "zero2"], default_value = "none")]
    pub shard: String,
    /// The controller's failure detector (node.toml `[membership] failure_detector`): fixed
    /// (`failure_timeout_ms`) or phi_accrual (adaptive, floor `failure_timeout_min_ms`).
    #[arg(long, value_parser = ["fixed", "phi_accrual"], default_value = "fixed")]
    pub failure_detector: String,
    /// Skip the reference run (and max_param_rel_diff).
    #[arg(long)]
    pub no_check: bool,
    /// Also run the torchrun peer (bench/peers/torchrun_recovery.py) after troupe's measurement.
    #[arg(long)]
    pub peer: bool,
    /// Repeat the measurement this many times (a fresh cluster each) and report p50/p99 of
    /// `recovery_s` and of each phase, beside every run's report (`runs`). With --peer, torchrun runs
    /// `--peer-runs` times.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub runs: u32,
    /// How many times the torchrun peer runs when `--runs` > 1 (it restarts its whole group: slow).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub peer_runs: u32,
    /// Python with torch for the peer (default: $TROUPE_PYTHON, else the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: RecoveryArgs) -> anyhow::Result<()> {
    if args.nodes < 2 {
        bail!("--nodes {}: recovery needs at least 2 daemons (one is killed)", args.nodes);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = if args.runs == 1 {
        let mut report = runtime.block_on(measure(&args))?;
        if args.peer {
            let recovery = report["recovery_s"].as_f64();
            add_peer(&mut report, &run_peer(&args)?, recovery);
        }
        report
    } else {
        repeated(&args, &runtime)?
    };
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// `--runs` measurements, each on a fresh cluster, summarised as p50/p99; then the peer's.
fn repeated(args: &RecoveryArgs, runtime: &tokio::runtime::Runtime) -> anyhow::Result<Value> {
    let mut runs = Vec::new();
    for run in 0..args.runs {
        let report = runtime.block_on(measure(args)).with_context(|| format!("run {} of {}", run + 1, args.runs))?;
        eprintln!("run {}/{}: recovery_s {}, phases {}", run + 1, args.runs, report["recovery_s"], report["phases"]);
        runs.push(report);
    }
    let of = |pick: &dyn Fn(&Value) -> &Value| quantiles(runs.iter().filter_map(|r| pick(r).as_f64()).collect());
    let mut summary = json!({
        "bench": "recovery", "nodes": args.nodes, "kill_at_step": args.kill_at_step, "shard": args.shard,
        "failure_detector": args.failure_detector, "runs_count": runs.len(),
        "recovery_s": of(&|r| &r["recovery_s"]),
        "detect_s": of(&|r| &r["detect_s"]),
        "phases": {
            "detect_s": of(&|r| &r["phases"]["detect_s"]),
            "decide_s": of(&|r| &r["phases"]["decide_s"]),
            "resume_s": of(&|r| &r["phases"]["resume_s"]),
        },
        "steps_redone_max": runs.iter().filter_map(|r| r["steps_redone"].as_u64()).max(),
        "max_param_rel_diff_max": runs.iter().filter_map(|r| r["max_param_rel_diff"].as_f64()).reduce(f64::max),
    });
    if args.peer {
        let peers = (0..args.peer_runs).map(|_| run_peer(args)).collect::<anyhow::Result<Vec<_>>>()?;
        let peer_of = |key: &str| quantiles(peers.iter().filter_map(|p| p[key].as_f64()).collect());
        let (peer_recovery, ours) = (peer_of("recovery_s"), &summary["recovery_s"]);
        summary["ratio_p50"] = json!(peer_recovery["p50"].as_f64().zip(ours["p50"].as_f64()).map(|(p, t)| p / t));
        summary["peer"] = peers.first().map_or(Value::Null, |p| p["peer"].clone());
        summary["peer_recovery_s"] = peer_recovery;
        summary["peer_detect_s"] = peer_of("detect_s");
        summary["peer_runs"] = json!(peers);
    }
    summary["runs"] = json!(runs);
    Ok(summary)
}

/// Nearest-rank p50 and p99 (and min, max) of `values`, in seconds; null without values.
fn quantiles(mut values: Vec<f64>) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    values.sort_by(f64::total_cmp);
    let rank = |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    json!({ "p50": rank(0.5), "p99": rank(0.99), "min": values[0], "max": values[values.len() - 1], "n": values.len() })
}

/// The peer's figures beside troupe's in a one-run report.
fn add_peer(report: &mut Value, peer: &Value, recovery: Option<f64>) {
    let peer_recovery = peer["recovery_s"].as_f64();
    report["peer"] = peer["peer"].clone();
    report["peer_recovery_s"] = json!(peer_recovery);
    report["peer_detect_s"] = peer["detect_s"].clone();
    report["peer_restart_s"] = peer["restart_s"].clone();
    report["peer_steps_redone"] = peer["steps_redone"].clone();
    report["peer_step_s_median"] = peer["step_s_median"].clone();
    report["ratio"] = json!(peer_recovery.zip(recovery).map(|(p, t)| p / t));
}

/// One measurement on a fresh local cluster: troupe's report.
async fn measure(args: &RecoveryArgs) -> anyhow::Result<Value> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("final.safetensors");
    let mut config = JobConfig::default();
    config.train.steps = args.kill_at_step + args.steps_after;
    config.train.torch_threads = 1;
    config.parallel.shard.clone_from(&args.shard);
    let mut options = LocalClusterOptions::new(args.nodes);
    options.torch_threads = 1;
    options.membership.failure_detector = match args.failure_detector.as_str() {
        "phi_accrual" => DetectorKind::PhiAccrual,
        _ => DetectorKind::Fixed,
    };
    let membership = options.membership.clone();
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    let cluster = LocalCluster::processes(&binary, options).await?;
    let victim = cluster.pid(args.nodes - 1).context("daemon pid")?;
    let mut handle = cluster.client().await?.submit(Job::new(config.clone()).save_final(&out)).await?;
    let mut seen = Seen::default();
    while let Some(event) = handle.next_event().await? {
        seen.event(event, args.kill_at_step, victim)?;
    }
    cluster.shutdown().await;
    let Seen { killed, detect, recovery, steps, rolled_back, viewed, resumed, committed, mut step_s, .. } = seen;
    let steps_redone = steps.len() as u64 - steps.iter().collect::<std::collections::BTreeSet<_>>().len() as u64;
    let diff = if args.no_check { None } else { Some(reference_diff(&config, &out)?) };
    step_s.sort_by(f64::total_cmp);
    let step_median = step_s.get(step_s.len() / 2).copied();
    Ok(json!({
        "bench": "recovery", "nodes": args.nodes, "kill_at_step": args.kill_at_step, "shard": args.shard,
        "rolled_back": rolled_back,
        "detect_s": detect, "recovery_s": recovery, "steps_redone": steps_redone,
        "steps_committed": steps.len(), "step_s_median": step_median, "max_param_rel_diff": diff,
        "phases": phases(killed, viewed, resumed, committed),
        "failure_detector": args.failure_detector,
        "failure_timeout_ms": membership.failure_timeout_ms,
        "failure_timeout_min_ms": membership.failure_timeout_min_ms,
    }))
}

/// What the benchmark saw of the job's events, and when.
struct Seen {
    /// When the victim was killed, and seconds from then to the view change and to the next commit.
    killed: Option<Instant>,
    detect: Option<f64>,
    recovery: Option<f64>,
    /// Every committed step, in order (a step redone after a rollback appears twice).
    steps: Vec<u64>,
    rolled_back: Option<(u64, u64)>,
    /// When the job said so, after the kill: the view change, the new attempt, the first commit.
    viewed: Option<Instant>,
    resumed: Option<Instant>,
    committed: Option<Instant>,
    /// Seconds between the commits of steps after the second, the recovery's excepted.
    step_s: Vec<f64>,
    /// The last commit.
    last: Instant,
}

impl Default for Seen {
    fn default() -> Self {
        Self {
            killed: None,
            detect: None,
            recovery: None,
            steps: Vec::new(),
            rolled_back: None,
            viewed: None,
            resumed: None,
            committed: None,
            step_s: Vec::new(),
            last: Instant::now(),
        }
    }
}

impl Seen {
    /// Takes in the job's next event; SIGKILLs `victim` once step `kill_at_step` committed.
    fn event(&mut self, event: JobEvent, kill_at_step: u64, victim: u32) -> anyhow::Result<()> {
        match event {
            JobEvent::Step { step, .. } => {
                self.steps.push(step);
                if let (Some(t), None) = (self.killed, self.recovery) {
                    self.committed = Some(Instant::now());
                    self.recovery = Some(t.elapsed().as_secs_f64());
                } else if step > 2 {
                    self.step_s.push(self.last.elapsed().as_secs_f64());
                }
                self.last = Instant::now();
                if step == kill_at_step {
                    std::process::Command::new("kill").arg("-KILL").arg(victim.to_string()).status()?;
                    self.killed = Some(Instant::now());
                }
            }
            JobEvent::Membership { .. } => {
                self.detect = self.killed.map(|t| t.elapsed().as_secs_f64());
                self.viewed = self.killed.map(|_| Instant::now());
            }
            JobEvent::Recovered { .. } | JobEvent::Started { .. }
                if self.viewed.is_some() && self.resumed.is_none() =>
            {
                self.resumed = Some(Instant::now());
            }
            JobEvent::RolledBack { from_step, to_step } => self.rolled_back = Some((from_step, to_step)),
            JobEvent::Failed { reason } => bail!("the job failed: {reason}"),
            _ => {}
        }
        Ok(())
    }
}

/// The recovery's phases in seconds, as the job's event stream shows them: `detect` (kill → the view
/// change), `decide` (→ the new attempt: abort, re-plan, attempt sent), `resume` (→ the next committed
/// step: the survivors' mesh rebuilt, state restored, one step). The events reach the client over the
/// control plane, so each includes that delivery; the sum is `recovery_s`.
fn phases(
    killed: Option<Instant>,
    viewed: Option<Instant>,
    resumed: Option<Instant>,
    committed: Option<Instant>,
) -> Value {
    let between = |a: Option<Instant>, b: Option<Instant>| a.zip(b).map(|(a, b)| b.duration_since(a).as_secs_f64());
    json!({
        "detect_s": between(killed, viewed),
        "decide_s": between(viewed, resumed),
        "resume_s": between(resumed, committed),
    })
}

/// bench/peers/torchrun_recovery.py with the same ranks, kill step and steps after; its last stdout line.
fn run_peer(args: &RecoveryArgs) -> anyhow::Result<Value> {
    let python = peer_python(args.python.as_ref());
    let script = peer_script("torchrun_recovery.py")?;
    let output = std::process::Command::new(&python)
        .arg(&script)
        .args(["--nodes", &args.nodes.to_string()])
        .args(["--kill-at-step", &args.kill_at_step.to_string()])
        .args(["--steps-after", &args.steps_after.to_string()])
        .output()
        .with_context(|| format!("running the peer {} {}; pass --python", python.display(), script.display()))?;
    if !output.status.success() {
        bail!("peer {} failed: {}", script.display(), String::from_utf8_lossy(&output.stderr));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("peer printed {line:?}, not JSON"))
}

fn reference_diff(config: &JobConfig, saved: &std::path::Path) -> anyhow::Result<f64> {
    tch::set_num_threads(1);
    let mut config = config.clone();
    config.parallel.shard = "none".into(); // the single-process reference
    let mut trainer = Trainer::new(config.clone())?;
    while trainer.step < config.train.steps {
        trainer.train_step();
    }
    let mut tensors = Tensor::read_safetensors(saved)?;
    let actual: Vec<Tensor> = trainer
        .model
        .named_params()
        .map(|(name, _)| {
            let i = tensors.iter().position(|(n, _)| n == name).expect("every parameter saved");
            tensors.swap_remove(i).1
        })
        .collect();
    Ok(compare_params(trainer.model.specs(), &actual, &trainer.param_values()).worst)
}

//! `troupe bench recovery`: take one daemon of a local cluster away at a chosen step of a DDP (or
//! ZeRO-1/2, `--shard`) job — SIGKILL its process, or with `--silent` cut its machine off with iptables
//! (every daemon in a network namespace: [`troupe_cluster::netns`]) — and measure how long until the controller notices
//! (detect_s) and until the next step commits on the survivors (recovery_s), with the phases between
//! (`phases`: detect, decide, resume, and resume split into the ranks' mesh rebuild, their state restore
//! and the first step to its commit — from the job's event stream and the ranks' phase spans); then check the run
//! against the single-process reference. With --peer, then the same loss under torchrun
//! (bench/peers/torchrun_recovery.py: restart the worker group from the last checkpoint), with the same
//! ranks and kill step, and ratio = peer_recovery_s / recovery_s. With `--runs N`, N measurements on fresh
//! clusters summarised as p50/p99 (and the peer `--peer-runs` times). With `--controller`, the
//! controller is what is lost: the Raft leader's take-over beside a restart in place ([`takeover`]).
//! With `--peft lora`, the same loss in a LoRA fine-tuning beside full fine-tuning of the same base
//! ([`peft`]): what a recovery costs when only the adapters are trained state.

use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tch::Tensor;
use troupe_cluster::membership::DetectorKind;
use troupe_cluster::netns::{Layout, Namespaces, NetnsError, Subnet};
use troupe_model::config::JobConfig;
use troupe_model::oracle::compare_params;
use troupe_model::Trainer;

mod peft;
pub mod soak;
mod takeover;

use super::bench_train::{bench_model, peer_python, peer_script};
use crate::api::{Job, JobEvent, LocalCluster, LocalClusterOptions, NodeHost};

/// Why `--silent --peer` has no torchrun figure (in the report as `peer_note`).
const TORCHRUN_SILENT: &str = "torchrun has no detector for a silent machine: each agent watches only its own \
    workers' processes, and its rendezvous notices a dead agent only at the next rendezvous. The survivors' \
    workers block in their collective until the process group's timeout fails them (torch.distributed's \
    default for Gloo: 30 min; for NCCL, its watchdog's, 10 min), and only then does the agent restart the \
    group: that timeout, as the user set it, is what a user sees. Not measured here.";

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
    #[arg(long, value_parser = ["fixed", "phi_accrual"], default_value = "phi_accrual")]
    pub failure_detector: String,
    /// Cut the last daemon's machine off (iptables DROP both ways, every daemon in its own network
    /// namespace: no reset, no FIN) instead of SIGKILLing its process: a machine gone silent, which only
    /// the heartbeat detector can find. Needs root.
    #[arg(long)]
    pub silent: bool,
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
    /// Take the controller away instead of a worker: SIGKILL the Raft leader of three
    /// controller-eligible daemons for good and time the take-over (kill → the next committed step),
    /// beside a single controller SIGKILLed and restarted in place, with torchft's 5 s heartbeat timeout
    /// quoted as the peer's floor; then gpt-tiny's tokens/s with three controllers over one.
    #[arg(long, conflicts_with_all = ["silent", "peer", "shard"])]
    pub controller: bool,
    /// The model: a preset (`gpt-tiny`, `llama-tiny`, `gpt2`, `smollm2-135m`, …) at `--context`
    /// (default: the job's default model, gpt-tiny).
    #[arg(long)]
    pub model: Option<String>,
    /// Tokens per sample with `--model`.
    #[arg(long, default_value_t = 128, requires = "model")]
    pub context: usize,
    /// Samples per step over all ranks (train.global_batch; default: the job's, 8).
    #[arg(long)]
    pub global_batch: Option<usize>,
    /// With `lora`: the preset's model, drawn once and written as a Hugging Face directory, is
    /// fine-tuned twice per run, every parameter trained and LoRA (r `--lora-r`, alpha 2r, the family's
    /// default targets), and the same daemon lost in each: the report has both and the ratios.
    #[arg(long, value_parser = ["none", "lora"], default_value = "none", conflicts_with_all = ["controller", "peer"])]
    pub peft: String,
    /// LoRA's rank with `--peft lora`.
    #[arg(long, default_value_t = 8)]
    pub lora_r: usize,
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
    let report = if args.controller {
        takeover::run(&args, &runtime)?
    } else if args.peft == "lora" {
        peft::run(&args, &runtime)?
    } else if args.runs == 1 {
        let mut report = runtime.block_on(measure(&args, &job_config(&args)?))?;
        if args.peer && args.silent {
            report["peer"] = json!("torchrun");
            report["peer_note"] = json!(TORCHRUN_SILENT);
        } else if args.peer {
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
    let config = job_config(args)?;
    let mut runs = Vec::new();
    for run in 0..args.runs {
        let report =
            runtime.block_on(measure(args, &config)).with_context(|| format!("run {} of {}", run + 1, args.runs))?;
        eprintln!("run {}/{}: recovery_s {}, phases {}", run + 1, args.runs, report["recovery_s"], report["phases"]);
        runs.push(report);
    }
    let mut summary = summarise(args, &runs);
    if args.peer && args.silent {
        summary["peer"] = json!("torchrun");
        summary["peer_note"] = json!(TORCHRUN_SILENT);
    } else if args.peer {
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

/// `runs`' figures as p50/p99 (and min, max): the summary of `--runs` measurements.
fn summarise(args: &RecoveryArgs, runs: &[Value]) -> Value {
    let of = |pick: &dyn Fn(&Value) -> &Value| quantiles(runs.iter().filter_map(|r| pick(r).as_f64()).collect());
    json!({
        "bench": "recovery", "nodes": args.nodes, "kill_at_step": args.kill_at_step, "shard": args.shard,
        "failure_detector": args.failure_detector, "fault": fault_name(args), "runs_count": runs.len(),
        "model": runs.first().map_or(Value::Null, |r| r["model"].clone()),
        "trainable_params": runs.first().map_or(Value::Null, |r| r["trainable_params"].clone()),
        "recovery_s": of(&|r| &r["recovery_s"]),
        "detect_s": of(&|r| &r["detect_s"]),
        "phases": {
            "detect_s": of(&|r| &r["phases"]["detect_s"]),
            "decide_s": of(&|r| &r["phases"]["decide_s"]),
            "resume_s": of(&|r| &r["phases"]["resume_s"]),
            "resume": {
                "rebuild_s": of(&|r| &r["phases"]["resume"]["rebuild_s"]),
                "restore_s": of(&|r| &r["phases"]["resume"]["restore_s"]),
                "first_commit_s": of(&|r| &r["phases"]["resume"]["first_commit_s"]),
            },
        },
        "step_s_median": of(&|r| &r["step_s_median"]),
        "steps_redone_max": runs.iter().filter_map(|r| r["steps_redone"].as_u64()).max(),
        "max_param_rel_diff_max": runs.iter().filter_map(|r| r["max_param_rel_diff"].as_f64()).reduce(f64::max),
    })
}

/// Nearest-rank p50 and p99 (and min, max) of `values`, in seconds; null without values.
fn quantiles(values: Vec<f64>) -> Value {
    quantiles_with(values, &[0.5, 0.99])
}

/// Nearest-rank quantiles `qs` of `values` (keys `p50`, `p99`, `p99.9`, …), with min, max and n; null
/// without values.
fn quantiles_with(mut values: Vec<f64>, qs: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    values.sort_by(f64::total_cmp);
    let rank = |q: f64| values[((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
    let mut out = json!({ "min": values[0], "max": values[values.len() - 1], "n": values.len() });
    for &q in qs {
        out[format!("p{}", q * 100.0)] = json!(rank(q));
    }
    out
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

fn fault_name(args: &RecoveryArgs) -> &'static str {
    if args.silent {
        "silent"
    } else {
        "kill"
    }
}

/// `--silent`'s machines: a network namespace per daemon on a bridge, node i at 10.X.Y.(i+1) (X in
/// 150-199, apart from the chaos harness's 200-249, so that the two can run at once), the controller's
/// side at .254; the last one is cut off with iptables.
fn silent_namespaces(nodes: usize) -> anyhow::Result<Namespaces> {
    let layout = Layout {
        prefix: "troupe-recovery-",
        nodes,
        subnet: Subnet::PerRun { from: 150, span: 50 },
        host_address: true,
        rate_gbit: None,
        iptables: true,
    };
    Namespaces::create(&layout).map_err(silent_error)
}

/// `--silent`'s refusal: what this machine lacks, and the way out.
fn silent_error(e: NetnsError) -> anyhow::Error {
    anyhow::anyhow!(
        "--silent puts every daemon in a network namespace and cuts one off with iptables: it {e}; run it as \
         root with iproute2's `ip` and `iptables`, or leave out --silent (SIGKILL)"
    )
}

/// How the local cluster starts node i: inside its namespace, listening on its address.
fn node_hosts(net: &Namespaces) -> Vec<NodeHost> {
    (0..net.nodes()).map(|i| NodeHost { prefix: net.exec_prefix(i), ip: net.addr(i).into() }).collect()
}

/// The job every measurement runs: `--model` at `--context` (the default job's model without it),
/// `--global-batch`, `--shard`, the kill step and the steps after, one torch thread per rank.
fn job_config(args: &RecoveryArgs) -> anyhow::Result<JobConfig> {
    let mut config = JobConfig::default();
    if let Some(name) = &args.model {
        config.model = bench_model(name, args.context)?;
    }
    if let Some(batch) = args.global_batch {
        config.train.global_batch = batch;
        config.train.micro_batch = config.train.micro_batch.min(batch);
    }
    config.train.steps = args.kill_at_step + args.steps_after;
    config.train.torch_threads = 1;
    config.parallel.shard.clone_from(&args.shard);
    config.validate().context("the benchmark's job")?;
    Ok(config)
}

/// One measurement of `config` on a fresh local cluster (in network namespaces with `--silent`):
/// troupe's report.
async fn measure(args: &RecoveryArgs, config: &JobConfig) -> anyhow::Result<Value> {
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("final.safetensors");
    let namespaces = if args.silent { Some(silent_namespaces(args.nodes)?) } else { None };
    let mut options = LocalClusterOptions::new(args.nodes);
    options.torch_threads = 1;
    options.hosts = namespaces.as_ref().map(node_hosts).unwrap_or_default();
    options.membership.failure_detector = match args.failure_detector.as_str() {
        "fixed" => DetectorKind::Fixed,
        _ => DetectorKind::PhiAccrual,
    };
    let membership = options.membership.clone();
    let binary = std::env::current_exe().context("locating the troupe binary")?;
    let cluster = LocalCluster::processes(&binary, options).await?;
    let target = args.nodes - 1;
    let victim = cluster.pid(target).context("daemon pid")?;
    let fault = || match &namespaces {
        Some(namespaces) => namespaces.cut(target),
        None => kill(victim),
    };
    // Every rank reports its phase spans: the resume's split comes from them.
    let job = Job::new(config.clone()).save_final(&out).trace(true);
    let mut handle = cluster.client().await?.submit(job).await?;
    let mut seen = Seen::default();
    while let Some(event) = handle.next_event().await? {
        seen.event(event, args.kill_at_step, &fault)?;
    }
    if namespaces.is_some() {
        kill(victim)?; // cut off, it would only wait out its drain
    }
    cluster.shutdown().await;
    drop(namespaces);
    let steps_redone =
        seen.steps.len() as u64 - seen.steps.iter().collect::<std::collections::BTreeSet<_>>().len() as u64;
    let diff = if args.no_check { None } else { Some(reference_diff(config, &out)?) };
    seen.step_s.sort_by(f64::total_cmp);
    let step_median = seen.step_s.get(seen.step_s.len() / 2).copied();
    Ok(json!({
        "bench": "recovery", "nodes": args.nodes, "kill_at_step": args.kill_at_step, "shard": args.shard,
        "model": config.model.preset.as_deref().unwrap_or("custom"),
        "trainable_params": config.model.param_count(), "global_batch": config.train.global_batch,
        "fault": fault_name(args), "rolled_back": seen.rolled_back,
        "detect_s": seen.detect, "recovery_s": seen.recovery, "steps_redone": steps_redone,
        "steps_committed": seen.steps.len(), "step_s_median": step_median, "max_param_rel_diff": diff,
        "detected_by": seen.detected_by, "phases": seen.phases(),
        "failure_detector": args.failure_detector,
        "failure_timeout_ms": membership.failure_timeout_ms,
        "failure_timeout_min_ms": membership.failure_timeout_min_ms,
    }))
}

fn kill(pid: u32) -> anyhow::Result<()> {
    let status = std::process::Command::new("kill").arg("-KILL").arg(pid.to_string()).status()?;
    if !status.success() {
        bail!("kill -KILL {pid} failed");
    }
    Ok(())
}

/// The wall clock now, in microseconds since the Unix epoch (what the ranks' phase spans count in).
fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// What the benchmark saw of the job's events, and when.
struct Seen {
    /// When the victim was taken away, and seconds from then to the view change and to the next commit.
    killed: Option<Instant>,
    detect: Option<f64>,
    recovery: Option<f64>,
    /// The controller's words for the view change (e.g. `Failed { .., silent_ms: 760 }`).
    detected_by: Vec<String>,
    /// Every committed step, in order (a step redone after a rollback appears twice).
    steps: Vec<u64>,
    rolled_back: Option<(u64, u64)>,
    /// When the job said so, after the kill: the view change, the new attempt, the first commit.
    viewed: Option<Instant>,
    resumed: Option<Instant>,
    committed: Option<Instant>,
    /// The first commit after the kill on the wall clock (µs since the Unix epoch).
    committed_unix_us: Option<u64>,
    /// Each rank's "mesh rebuild" and "state restore" spans of a resumed attempt — the worker's start,
    /// its engine over the rebuilt mesh, its state restored — by attempt: (attempt, start µs, built µs,
    /// restored µs).
    rebuilds: Vec<(u64, u64, u64, u64)>,
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
            detected_by: Vec::new(),
            steps: Vec::new(),
            rolled_back: None,
            viewed: None,
            resumed: None,
            committed: None,
            committed_unix_us: None,
            rebuilds: Vec::new(),
            step_s: Vec::new(),
            last: Instant::now(),
        }
    }
}

impl Seen {
    /// Takes in the job's next event; applies `fault` once step `kill_at_step` committed.
    fn event(
        &mut self,
        event: JobEvent,
        kill_at_step: u64,
        fault: &dyn Fn() -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        match event {
            JobEvent::Step { step, .. } => {
                self.steps.push(step);
                if let (Some(t), None) = (self.killed, self.recovery) {
                    self.committed = Some(Instant::now());
                    self.committed_unix_us = Some(unix_us());
                    self.recovery = Some(t.elapsed().as_secs_f64());
                } else if step > 2 {
                    self.step_s.push(self.last.elapsed().as_secs_f64());
                }
                self.last = Instant::now();
                if step == kill_at_step {
                    fault()?;
                    self.killed = Some(Instant::now());
                }
            }
            JobEvent::Membership { changes, .. } if self.killed.is_some() && self.viewed.is_none() => {
                self.detect = self.killed.map(|t| t.elapsed().as_secs_f64());
                self.viewed = Some(Instant::now());
                self.detected_by = changes;
            }
            JobEvent::Recovered { .. } | JobEvent::Started { .. }
                if self.viewed.is_some() && self.resumed.is_none() =>
            {
                self.resumed = Some(Instant::now());
            }
            JobEvent::Phases { attempt, spans, .. } if attempt > 1 => {
                let find = |name: &str| spans.iter().find(|s| s.cat == "recovery" && s.name == name);
                if let Some(rebuild) = find("mesh rebuild") {
                    let built = rebuild.start_us + rebuild.dur_us;
                    // A restore too quick for the clock records no span: it ended where the rebuild did.
                    let restored = find("state restore").map_or(built, |s| s.start_us + s.dur_us);
                    self.rebuilds.push((attempt, rebuild.start_us, built, restored));
                }
            }
            JobEvent::RolledBack { from_step, to_step } => self.rolled_back = Some((from_step, to_step)),
            JobEvent::Failed { reason } => bail!("the job failed: {reason}"),
            _ => {}
        }
        Ok(())
    }

    /// The recovery's phases in seconds, as the job's event stream shows them: `detect` (the fault → the
    /// view change), `decide` (→ the new attempt: abort, re-plan, every survivor ready), `resume` (→ the
    /// next committed step). The events reach the client over the control plane, so each includes that
    /// delivery; the sum is `recovery_s`. `resume` is split by the ranks' spans of the attempt that
    /// resumed: `rebuild` (the first rank's start to the last rank's engine over the rebuilt mesh),
    /// `restore` (→ the last rank's state restored: a copy from a buddy or a reshard) and `first_commit`
    /// (→ the first step committed); the rest of `resume` is the start's way to the ranks.
    fn phases(&self) -> Value {
        let between = |a: Option<Instant>, b: Option<Instant>| a.zip(b).map(|(a, b)| b.duration_since(a).as_secs_f64());
        let attempt = self.rebuilds.iter().map(|r| r.0).max();
        let resumed: Vec<&(u64, u64, u64, u64)> = self.rebuilds.iter().filter(|r| Some(r.0) == attempt).collect();
        let first = resumed.iter().map(|r| r.1).min();
        let (built, last) = (resumed.iter().map(|r| r.2).max(), resumed.iter().map(|r| r.3).max());
        let secs = |us: u64| us as f64 / 1e6;
        json!({
            "detect_s": between(self.killed, self.viewed),
            "decide_s": between(self.viewed, self.resumed),
            "resume_s": between(self.resumed, self.committed),
            "resume": {
                "rebuild_s": first.zip(built).map(|(a, b)| secs(b.saturating_sub(a))),
                "restore_s": built.zip(last).map(|(a, b)| secs(b.saturating_sub(a))),
                "first_commit_s": last.zip(self.committed_unix_us).map(|(a, b)| secs(b.saturating_sub(a))),
            },
        })
    }
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

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;
    use crate::protocol::PhaseSpan;

    fn step(step: u64) -> JobEvent {
        JobEvent::Step {
            step,
            loss: 5.0,
            lr: 1e-3,
            grad_norm: 1.0,
            skipped: false,
            loss_scale: 1.0,
            tokens_per_s: 1.0,
            epoch: 1,
            world: 3,
            peak_rss_bytes: Vec::new(),
            bubble: None,
            mfu: None,
        }
    }

    /// A rank's report of a resumed attempt: its mesh rebuild from `start_us`, its state restore, then
    /// its step's compute (not counted).
    fn recovery_spans(attempt: u64, start_us: u64, rebuild_us: u64, restore_us: u64) -> JobEvent {
        let span = |name: &str, cat: &str, start_us, dur_us| PhaseSpan {
            name: name.into(),
            cat: cat.into(),
            start_us,
            dur_us,
            chunk: None,
            microbatch: None,
        };
        let (built, restored) = (start_us + rebuild_us, start_us + rebuild_us + restore_us);
        let spans = vec![
            span("mesh rebuild", "recovery", start_us, rebuild_us),
            span("state restore", "recovery", built, restore_us),
            span("forward+backward", "compute", restored, 900_000),
        ];
        JobEvent::Phases { rank: 0, node: "node-0".into(), attempt, step: 6, spans, stage: None }
    }

    /// The fault is applied once, at its step; the view change after it is the detection, with the
    /// controller's words; the resume is split by the ranks' recovery spans of the attempt that resumed
    /// (an aborted attempt's spans do not count).
    #[test]
    fn the_fault_lands_at_its_step_and_the_resume_splits_by_the_last_attempts_spans() {
        let applied = Cell::new(0);
        let fault = || {
            applied.set(applied.get() + 1);
            Ok(())
        };
        let mut seen = Seen::default();
        let t0 = unix_us();
        let membership = |what: &str| JobEvent::Membership { epoch: 2, world: 2, changes: vec![what.into()] };
        let events = [
            step(4),
            membership("before the fault: not a detection"),
            step(5),
            membership("Failed { node: NodeId(\"node-2\"), silent_ms: 770 }"),
            membership("a second change: not the detection"),
            JobEvent::Recovered { step: 5, epoch: 2, world: 2 },
            // Attempt 2 was aborted mid-restore; attempt 3 resumed: ranks from t0, the last mesh built
            // at t0 + 100 ms, the last state restored at t0 + 150 ms.
            recovery_spans(2, t0 - 900_000, 500_000, 300_000),
            recovery_spans(3, t0 + 20_000, 60_000, 70_000),
            recovery_spans(3, t0, 100_000, 30_000),
        ];
        for event in events {
            seen.event(event, 5, &fault).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(200)); // the first commit, after t0 + 150 ms
        seen.event(step(6), 5, &fault).unwrap();
        assert_eq!(applied.get(), 1);
        assert_eq!(seen.detected_by, ["Failed { node: NodeId(\"node-2\"), silent_ms: 770 }"]);
        let phases = seen.phases();
        assert_eq!(phases["resume"]["rebuild_s"], json!(0.1), "{phases}");
        assert_eq!(phases["resume"]["restore_s"], json!(0.05), "{phases}");
        let first_commit = phases["resume"]["first_commit_s"].as_f64().unwrap();
        assert!((0.05..1.0).contains(&first_commit), "{phases}");
        assert_eq!(seen.steps, [4, 5, 6]);
    }

    #[test]
    fn silent_refusal_names_the_flag_what_is_missing_and_the_way_out() {
        for (e, missing) in [(NetnsError::NotRoot, "needs root"), (NetnsError::NoIptables, "needs `iptables`")] {
            let message = silent_error(e).to_string();
            assert!(message.starts_with("--silent "), "{message}");
            assert!(message.contains(missing) && message.contains("leave out --silent"), "{message}");
        }
    }
}

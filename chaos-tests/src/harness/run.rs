//! One chaos run: a local cluster of daemon processes, a training job, the scenario's faults injected as
//! the job reaches their steps, then the checker and the report.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::{watch, Mutex};
use troupe_actors::api::{Client, Job, JobEvent, JobHandle, LocalCluster, LocalClusterOptions};
use troupe_actors::protocol::JobId;
use troupe_cluster::{add_node, init_cluster, NodeIdentity};
use troupe_model::config::JobConfig;
use troupe_model::Trainer;

use super::checker;
use super::link::LinkStats;
use super::nemesis::{Injected, Nemesis, Progress};
use super::netns::Network;
use super::raft_log::{self, ControllerRecord};
use super::report::{Check, FaultRecord, Report, Summary};
use super::scenario::{Fault, NetworkKind, Scenario, Target, Trigger};
use crate::sim::rng::Rng;

/// How a run is started.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Drives every random choice of the run: which node a fault hits, how far into a step it lands.
    pub seed: u64,
    /// The `troupe` binary the daemons run.
    pub troupe: PathBuf,
    /// RUST_LOG filter of the daemons (None: [`DEFAULT_LOG`]), into the run directory's node-N.log.
    pub log: Option<String>,
    /// Keep the run directory (daemon logs, events.jsonl, checkpoints) also when the run passes; a
    /// failed run always keeps it.
    pub keep: bool,
}

/// The job a scenario trains: its job config file when it names one; else the small test model, so
/// that runs take seconds, in the scenario's precision with its injected overflows, as pipelines of `pp`
/// stages or tensor groups of `tp` ranks when it says so. The checker's reference trains the same config
/// on one rank.
pub fn job_config(scenario: &Scenario) -> JobConfig {
    if let Some(config) = &scenario.job_config {
        return config.clone();
    }
    let mut config = JobConfig::small(scenario.steps);
    config.parallel.precision.clone_from(&scenario.precision);
    config.train.inject_overflow_at.clone_from(&scenario.inject_overflow_at);
    config.parallel.pp = scenario.pp;
    config.parallel.schedule.clone_from(&scenario.schedule);
    config.parallel.tp = scenario.tp;
    // Every stage runs at least one block.
    config.model.n_layers = config.model.n_layers.max(scenario.pp);
    config
}

/// Runs `scenario` and checks it. Errors are reserved for the harness failing to run at all (no binary,
/// no cluster); everything the job or the faults get wrong is in the report.
pub async fn run(scenario: &Scenario, options: &RunOptions) -> anyhow::Result<Report> {
    let started = Instant::now();
    let work = tempfile::Builder::new().prefix("troupe-chaos-").tempdir().context("creating a work directory")?;
    let ckpt_dir = work.path().join("checkpoints");
    std::fs::create_dir_all(&ckpt_dir)?;
    let _tmpfs = match scenario.checkpoint_tmpfs_mib {
        0 => None,
        mib => match Tmpfs::mount(&ckpt_dir, mib) {
            Ok(t) => Some(t),
            Err(why) => return Ok(skipped(scenario, options, why)),
        },
    };
    let network = match network_of(scenario) {
        Ok(network) => network,
        Err(why) => return Ok(skipped(scenario, options, why)),
    };
    let cluster = start_cluster(scenario, options, work.path(), network.as_deref()).await?;
    let full_world = scenario.nodes - usize::from(scenario.controller_slots == Some(0));
    let bad_inputs = bad_inputs(&cluster).await;

    let config = job_config(scenario);
    let final_params = work.path().join("final.safetensors");
    let mut job =
        Job::new(config.clone()).name(&scenario.name).save_final(&final_params).data_plane(scenario.data_plane);
    if scenario.checkpoint_every > 0 {
        let keep = if scenario.checkpoint_tmpfs_mib > 0 { 3 } else { 0 };
        job = job.checkpoints(&ckpt_dir, scenario.checkpoint_every, keep);
    }
    let handle = cluster.client().await?.submit(job).await?;

    let client_identity =
        NodeIdentity::load(&cluster.certs_dir(), "client").context("the local cluster's client certificate")?;
    // The nemesis's questions to the daemons (who leads, which epoch) go under the client's certificate
    // too: a daemon keeps each client connection apart, so they take nothing from the job's event stream.
    let identity =
        NodeIdentity::load(&cluster.certs_dir(), "client").context("the local cluster's client certificate")?;
    let (progress_tx, progress_rx) = watch::channel(Progress::default());
    let (ckpt_tx, ckpt_rx) = watch::channel(None);
    let cluster = Arc::new(Mutex::new(cluster));
    let bound = Duration::from_secs_f64(scenario.progress_bound_s);
    let nemesis = Arc::new(Nemesis {
        cluster: cluster.clone(),
        progress: progress_rx,
        latest_checkpoint: ckpt_rx,
        tmpfs: (scenario.checkpoint_tmpfs_mib > 0).then(|| ckpt_dir.clone()),
        full_world,
        bound,
        network: network.clone(),
        observe_fencing: scenario.expect.fenced,
        controllers: scenario.controllers,
        nodes: scenario.nodes,
        identity,
    });
    let job = handle.id();
    let mut injector = Injector::new(scenario, options.seed, nemesis.clone());
    let followed = follow(handle, client_identity, &mut injector, progress_tx, ckpt_tx, bound).await;
    let injected = injector.finish(network.as_deref(), bound * 2).await?;
    drop(nemesis);
    let mut cluster = Arc::try_unwrap(cluster).ok().context("a fault task still holds the cluster")?.into_inner();
    let pids = cluster.spawned_pids().to_vec();
    let records =
        (scenario.controllers > 1).then(|| controller_records(&mut cluster, scenario.nodes, scenario.controllers, job));
    if records.is_none() {
        cluster.shutdown().await;
    } else {
        drop(cluster); // every daemon was stopped to read the controllers' records: this reaps them
    }

    let reference = tokio::task::spawn_blocking(move || train_reference(config)).await??;
    let outcome = Outcome { events: followed.events, stalled: followed.stalled, injected, pids, final_params, records };
    let checked = check(scenario, &outcome, &reference, full_world, bound);
    let passed = checked.checks.iter().chain(&bad_inputs).all(|c| c.passed);
    write_events(&work.path().join("events.jsonl"), started, &outcome.events);
    // A failed run keeps its directory: the daemons' logs (node-N.log), the events and checkpoints.
    let kept = (!passed || options.keep).then(|| work.keep());
    let mut faults = BTreeMap::new();
    for i in &outcome.injected {
        *faults.entry(i.kind.as_str().to_owned()).or_insert(0) += 1;
    }
    Ok(Report {
        kept,
        scenario: scenario.name.clone(),
        description: scenario.description.clone(),
        seed: options.seed,
        passed,
        skipped: None,
        nodes: scenario.nodes,
        data_plane: scenario.data_plane,
        steps: scenario.steps,
        wall_s: started.elapsed().as_secs_f64(),
        faults,
        recoveries: checked.recoveries,
        detection_s: checked.detection_s,
        undetected: checked.undetected,
        recovery_s: checked.recovery_s,
        steps_redone: checked.steps_redone,
        data_lost: checked.data_lost,
        bad_inputs,
        checks: checked.checks,
        injected: outcome.injected.iter().map(|f| FaultRecord::of(f, followed.first_step, &outcome.events)).collect(),
        links: checked.links,
    })
}

/// The scenario's network namespaces, if it asks for them (`Err`: why the run is skipped).
fn network_of(scenario: &Scenario) -> Result<Option<Arc<Network>>, String> {
    let network = match scenario.network {
        NetworkKind::Loopback => return Ok(None),
        NetworkKind::Namespaces => Arc::new(Network::create(scenario.nodes)?),
    };
    if scenario.faults.iter().any(|f| f.kind.degrades_links()) {
        network.link_mechanism()?;
    }
    Ok(Some(network))
}

/// The daemons' log filter unless the run names one: info, and what a member does to find its controller
/// again (dials, retries, introductions, connections gained and lost) at debug — a few kilobytes a run,
/// and what a failed rejoin needs to be understood from its kept logs.
pub const DEFAULT_LOG: &str =
    "info,troupe_cluster::control=debug,troupe_actors::runtime::node=debug,troupe_actors::runtime::node_core=debug";

/// The scenario's cluster of daemon processes, their logs in `work`.
async fn start_cluster(
    scenario: &Scenario,
    options: &RunOptions,
    work: &Path,
    network: Option<&Network>,
) -> anyhow::Result<LocalCluster> {
    let mut cluster_options = LocalClusterOptions::new(scenario.nodes);
    if let Some(network) = network {
        cluster_options.hosts = network.hosts();
    }
    cluster_options.controller_slots = scenario.controller_slots;
    cluster_options.controllers = scenario.controllers;
    cluster_options.membership = scenario.membership.clone();
    cluster_options.torch_threads = 1;
    cluster_options.log = Some(options.log.clone().unwrap_or_else(|| DEFAULT_LOG.into()));
    cluster_options.log_dir = Some(work.to_owned());
    Ok(LocalCluster::processes(&options.troupe, cluster_options).await?)
}

/// Schedules the scenario's faults as the job reaches their steps (or, for timed faults, their seconds
/// after the first committed step), each a task of its own.
struct Injector<'a> {
    scenario: &'a Scenario,
    rng: Rng,
    nemesis: Arc<Nemesis>,
    /// Faults by step, in step order (file order within a step).
    pending: VecDeque<(u64, Fault)>,
    timed: Vec<(f64, Fault)>,
    victims_left: Vec<usize>,
    tasks: Vec<tokio::task::JoinHandle<Option<Injected>>>,
}

impl<'a> Injector<'a> {
    fn new(scenario: &'a Scenario, seed: u64, nemesis: Arc<Nemesis>) -> Self {
        let by_step = |f: &Fault| if let Trigger::Step(s) = f.trigger() { Some((s, f.clone())) } else { None };
        let mut pending: Vec<(u64, Fault)> = scenario.faults.iter().filter_map(by_step).collect();
        pending.sort_by_key(|(step, _)| *step); // stable: file order within a step
        let by_time = |f: &Fault| if let Trigger::Seconds(s) = f.trigger() { Some((s, f.clone())) } else { None };
        Injector {
            scenario,
            rng: Rng::new(seed),
            nemesis,
            pending: pending.into(),
            timed: scenario.faults.iter().filter_map(by_time).collect(),
            victims_left: scenario.victims(),
            tasks: Vec::new(),
        }
    }

    /// The job committed `step` (the first one when `first`): the faults now due start, each after its
    /// delay and jitter; one still waiting when the job ends is not injected.
    fn on_step(&mut self, step: u64, first: bool, ended: &watch::Sender<Progress>) {
        let mut due: Vec<(Duration, Fault)> = Vec::new();
        if first {
            due.extend(self.timed.iter().map(|(s, f)| (Duration::from_secs_f64(*s), f.clone())));
        }
        while self.pending.front().is_some_and(|(at, _)| *at <= step) {
            due.push((Duration::ZERO, self.pending.pop_front().expect("checked").1));
        }
        for (after, fault) in due {
            let nodes = choose(&fault.node, &mut self.victims_left, self.scenario, &mut self.rng);
            let delay = after + Duration::from_millis(self.rng.range(0, fault.jitter_ms + 1));
            let (nemesis, seed, mut ended) = (self.nemesis.clone(), self.rng.next_u64(), ended.subscribe());
            self.tasks.push(tokio::spawn(async move {
                // A fault due after the job ended is not injected (the checker says so).
                let wait = tokio::time::sleep(delay);
                tokio::pin!(wait);
                loop {
                    tokio::select! {
                        () = &mut wait => break,
                        changed = ended.changed() => if changed.is_err() { return None },
                    }
                }
                Some(nemesis.apply(&fault, &nodes, seed).await)
            }));
        }
    }

    /// Waits for every fault task; links degraded for the rest of the run heal now, what their nemesis
    /// did going with the fault.
    async fn finish(self, network: Option<&Network>, bound: Duration) -> anyhow::Result<Vec<Injected>> {
        let mut injected: Vec<Injected> = Vec::new();
        for task in self.tasks {
            match tokio::time::timeout(bound, task).await {
                Ok(Ok(i)) => injected.extend(i),
                Ok(Err(e)) => anyhow::bail!("a fault task panicked: {e}"),
                Err(_) => anyhow::bail!("a fault did not finish within {bound:?}"),
            }
        }
        if let Some(network) = network {
            for fault in injected.iter_mut().filter(|f| f.kind.degrades_links() && f.healed.is_none()) {
                for &i in &fault.indices {
                    match network.heal(i) {
                        Ok(stats) => fault.links.extend(stats),
                        Err(e) => fault.error = Some(format!("healing node {i}'s links: {e:#}")),
                    }
                }
            }
        }
        Ok(injected)
    }
}

/// What the client saw of the job.
struct Followed {
    events: Vec<(Instant, JobEvent)>,
    /// Why the job stopped reporting before its end, if it did.
    stalled: Option<String>,
    first_step: Option<Instant>,
}

/// With replicated controllers, a job silent this long is watched again at the current leader (its
/// steps come every few milliseconds; the client's own reconnection keeps re-dialing the old leader).
const REWATCH_AFTER: Duration = Duration::from_secs(1);
/// ... and while no leader could be found (an election), it is looked for again this often.
const RELOOK_AFTER: Duration = Duration::from_millis(250);

/// The job's event stream, and how many events it yielded (the number of the next one).
struct Watch {
    handle: JobHandle,
    job: JobId,
    next: u64,
    /// The job client's certificate: the stream picked up again replaces the old one under the same name.
    identity: NodeIdentity,
}

impl Watch {
    /// Follows the job again from its next event at the controller the daemons name now (after a
    /// take-over the old one may be dead, paused or cut off, which its handle would keep re-dialing);
    /// false when no leader could be watched (an election is under way).
    async fn again_at_the_controller(&mut self, nemesis: &Nemesis) -> bool {
        let Some(leader) = nemesis.controller().await else { return false };
        let watched = async {
            let addr = nemesis.node_addr(leader.index).await?;
            anyhow::Ok(Client::connect(addr, &self.identity).await?.watch_from(self.job, self.next).await?)
        };
        match tokio::time::timeout(REWATCH_AFTER, watched).await {
            Ok(Ok(handle)) => {
                self.handle = handle;
                true
            }
            _ => false,
        }
    }
}

/// Follows the job to its end, starting faults as its steps commit; a job silent for the progress
/// bound plus the longest fault is cancelled. With replicated controllers a stream silent for
/// [`REWATCH_AFTER`] is picked up again at the current leader, from the event after the last one seen.
async fn follow(
    handle: JobHandle,
    identity: NodeIdentity,
    injector: &mut Injector<'_>,
    progress: watch::Sender<Progress>,
    checkpoints: watch::Sender<Option<PathBuf>>,
    bound: Duration,
) -> Followed {
    let faults = &injector.scenario.faults;
    let longest = faults.iter().map(|f| f.duration_s + f.return_after_s.unwrap_or(0.0)).fold(0.0, f64::max);
    let event_timeout = bound + Duration::from_secs_f64(longest);
    let replicated = injector.scenario.controllers > 1;
    let mut wait = if replicated { REWATCH_AFTER } else { event_timeout };
    let mut watch = Watch { job: handle.id(), handle, next: 0, identity };
    let mut followed = Followed { events: Vec::new(), stalled: None, first_step: None };
    let mut last_event = Instant::now();
    loop {
        let event = match tokio::time::timeout(wait, watch.handle.next_event()).await {
            Ok(Ok(Some(e))) => {
                wait = if replicated { REWATCH_AFTER } else { event_timeout };
                e
            }
            Ok(Ok(None)) => break,
            Ok(Err(e)) if !replicated => {
                followed.stalled = Some(format!("the job's event stream failed: {e:#}"));
                break;
            }
            _ if last_event.elapsed() >= event_timeout => {
                followed.stalled = Some(format!("no job event for {event_timeout:?}; cancelled the job"));
                let _ = tokio::time::timeout(Duration::from_secs(5), watch.handle.cancel()).await;
                break;
            }
            _ => {
                let found = watch.again_at_the_controller(&injector.nemesis).await;
                wait = if found { REWATCH_AFTER } else { RELOOK_AFTER };
                continue;
            }
        };
        watch.next += 1;
        last_event = Instant::now();
        let now = Instant::now();
        match &event {
            JobEvent::Step { step, world, epoch, .. } => {
                progress.send_replace(Progress { step: *step, world: *world, epoch: *epoch });
                let first = followed.first_step.is_none();
                followed.first_step.get_or_insert(now);
                injector.on_step(*step, first, &progress);
            }
            JobEvent::Checkpoint { path, .. } => {
                checkpoints.send_replace(Some(path.clone()));
            }
            _ => {}
        }
        let terminal = event.is_terminal();
        followed.events.push((now, event));
        if terminal {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), watch.handle.close()).await;
    // Faults waiting for progress learn that none will come (`progress` dropped here).
    followed
}

/// The reference: the same job in this process, one rank, no faults — its losses, final trainer and
/// evaluations.
type Reference = (Vec<f64>, Trainer, Vec<(u64, f64)>);

fn train_reference(mut config: JobConfig) -> anyhow::Result<Reference> {
    tch::set_num_threads(1);
    config.parallel.tp = 1;
    let mut trainer = Trainer::new(config)?;
    let (mut losses, mut evals) = (Vec::new(), Vec::new());
    while trainer.step < trainer.config.train.steps {
        losses.push(trainer.train_step().loss);
        if let (true, Some(eval)) = (trainer.config.eval_due(trainer.step), trainer.evaluate()) {
            evals.push((trainer.step, eval.loss));
        }
    }
    Ok((losses, trainer, evals))
}

/// What the run produced, for the checker.
struct Outcome {
    events: Vec<(Instant, JobEvent)>,
    stalled: Option<String>,
    injected: Vec<Injected>,
    pids: Vec<u32>,
    final_params: PathBuf,
    /// Replicated controllers: each controller's Raft log and catalog of the job, after the run.
    records: Option<anyhow::Result<Vec<ControllerRecord>>>,
}

/// Stops every daemon (SIGTERM, a bounded wait, then SIGKILL) and reads the job's record in each of the
/// `controllers` (nodes `0..controllers`): their redb files can be opened once their daemons are gone.
fn controller_records(
    cluster: &mut LocalCluster,
    nodes: usize,
    controllers: usize,
    job: JobId,
) -> anyhow::Result<Vec<ControllerRecord>> {
    for i in (0..nodes).rev() {
        let Some(pid) = cluster.pid(i) else { continue };
        let _ = std::process::Command::new("kill").arg("-TERM").arg(pid.to_string()).status();
        if cluster.wait_exit(i, Duration::from_secs(10)).is_none() {
            let _ = std::process::Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
            cluster.wait_exit(i, Duration::from_secs(5));
        }
    }
    let names: Vec<String> = (0..controllers).map(|i| cluster.node_name(i)).collect();
    names.iter().enumerate().map(|(i, name)| raft_log::read(name, &cluster.data_dir(i), job, &names)).collect()
}

/// The checker's verdicts and figures.
struct Checked {
    checks: Vec<Check>,
    recoveries: usize,
    steps_redone: u64,
    data_lost: u64,
    detection_s: Summary,
    recovery_s: Summary,
    undetected: Vec<String>,
    links: Vec<LinkStats>,
}

/// Every check of the run against the reference and the scenario's expectations.
fn check(scenario: &Scenario, run: &Outcome, reference: &Reference, full_world: usize, bound: Duration) -> Checked {
    let (events, injected) = (&run.events, &run.injected);
    let tolerance = checker::tolerance(&scenario.precision);
    let mut trajectory = checker::trajectory(events, scenario.steps, &reference.0, tolerance);
    let mut checks = std::mem::take(&mut trajectory.checks);
    if let Some(why) = &run.stalled {
        checks.insert(0, Check { name: "the job kept reporting".into(), passed: false, detail: why.clone() });
    }
    let scheduled = scenario.faults.len();
    checks.push(checker::faults_applied(injected));
    if injected.len() < scheduled {
        checks.push(Check {
            name: "every scheduled fault happened".into(),
            passed: false,
            detail: format!("{} of {scheduled} faults injected: the job ended first", injected.len()),
        });
    }
    checks.push(checker::faults_hit_training(events, injected));
    checks.push(checker::final_parameters(&run.final_params, &reference.1, tolerance));
    if !scenario.inject_overflow_at.is_empty() {
        checks.push(checker::overflows_skipped(events, &scenario.inject_overflow_at));
    }
    if !reference.2.is_empty() {
        checks.push(checker::evaluations(events, &reference.2, tolerance));
    }
    checks.push(checker::checkpoints_load(events, injected));
    checks.push(checker::progress_after_faults(events, injected, bound));
    checks.push(checker::no_process_left(&run.pids));
    checks.extend(checker::expected(&scenario.expect, events, injected, full_world, scenario.checkpoint_every));
    match &run.records {
        Some(Ok(records)) => {
            let seen: Vec<JobEvent> = events.iter().map(|(_, e)| e.clone()).collect();
            checks.push(raft_log::steps_in_majority(&seen, records));
            checks.push(raft_log::one_leader_per_step(records));
        }
        Some(Err(e)) => checks.push(Check {
            name: "the controllers' Raft logs were read".into(),
            passed: false,
            detail: format!("{e:#}"),
        }),
        None => {}
    }
    let (detection_s, recovery_s) = checker::timings(events, injected);
    Checked {
        checks,
        recoveries: trajectory.recoveries,
        steps_redone: trajectory.steps_redone,
        data_lost: trajectory.data_lost,
        detection_s,
        recovery_s,
        undetected: checker::undetected(events, injected),
        links: checker::link_effects(events, injected),
    }
}

/// The job's events as the client saw them, one JSON object per line with `t_s` since the run started.
fn write_events(path: &Path, started: Instant, events: &[(Instant, JobEvent)]) {
    let lines: String = events
        .iter()
        .filter_map(|(t, e)| {
            let mut v = serde_json::to_value(e).ok()?;
            v["t_s"] = serde_json::json!(t.duration_since(started).as_secs_f64());
            Some(format!("{v}\n"))
        })
        .collect();
    if let Err(e) = std::fs::write(path, lines) {
        eprintln!("troupe chaos: writing {}: {e}", path.display());
    }
}

/// The daemons a fault hits. Random workers are drawn without replacement while any are left, so two
/// faults of one run hit different nodes.
fn choose(target: &Target, left: &mut Vec<usize>, scenario: &Scenario, rng: &mut Rng) -> Vec<usize> {
    match target {
        Target::Index(i) => vec![*i],
        Target::AllWorkers => scenario.victims(),
        Target::AllNodes => (0..scenario.nodes).collect(),
        // Resolved when the fault starts: the controller then.
        Target::Controller => Vec::new(),
        Target::RandomWorker => {
            if left.is_empty() {
                left.extend(scenario.victims());
            }
            vec![left.swap_remove(rng.below(left.len() as u64) as usize)]
        }
    }
}

fn skipped(scenario: &Scenario, options: &RunOptions, why: String) -> Report {
    Report {
        kept: None,
        scenario: scenario.name.clone(),
        description: scenario.description.clone(),
        seed: options.seed,
        passed: true,
        skipped: Some(why),
        nodes: scenario.nodes,
        data_plane: scenario.data_plane,
        steps: scenario.steps,
        wall_s: 0.0,
        faults: BTreeMap::new(),
        recoveries: 0,
        detection_s: Summary::default(),
        recovery_s: Summary::default(),
        undetected: Vec::new(),
        steps_redone: 0,
        data_lost: 0,
        bad_inputs: Vec::new(),
        checks: Vec::new(),
        injected: Vec::new(),
        links: Vec::new(),
    }
}

/// Inputs a running cluster must refuse without harm: a client whose certificate another CA signed, and
/// a job whose config cannot train.
async fn bad_inputs(cluster: &LocalCluster) -> Vec<Check> {
    let mut checks = Vec::new();
    let stranger = async {
        let dir = tempfile::tempdir()?;
        init_cluster(dir.path())?;
        add_node("client", dir.path())?;
        let identity = NodeIdentity::load(dir.path(), "client")?;
        let mut client = Client::connect(cluster.addr(), &identity).await?;
        client.status().await?;
        anyhow::Ok(())
    };
    checks.push(refusal("a certificate from another CA is refused", "the stranger was served", stranger).await);
    let mut config = JobConfig::small(1);
    config.model.n_heads = 3; // 64 is not divisible by 3
    let submitted = async {
        cluster.client().await?.submit(Job::new(config)).await?;
        anyhow::Ok(())
    };
    checks.push(refusal("a job that cannot train is refused", "the controller accepted it", submitted).await);
    checks
}

/// A check that `attempt` is refused (an error within 10 s); `accepted` says what went wrong otherwise.
async fn refusal(name: &str, accepted: &str, attempt: impl std::future::Future<Output = anyhow::Result<()>>) -> Check {
    let outcome = tokio::time::timeout(Duration::from_secs(10), attempt).await;
    Check {
        name: name.into(),
        passed: matches!(outcome, Ok(Err(_))),
        detail: match outcome {
            Ok(Err(e)) => format!("refused: {}", first_line(&format!("{e:#}"))),
            Ok(Ok(())) => accepted.into(),
            Err(_) => "no answer within 10 s".into(),
        },
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// A tmpfs mounted for the run's checkpoints, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, mib: u64) -> Result<Self, String> {
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount ({e}); the scenario needs a tmpfs for its checkpoints"))?;
        if !out.status.success() {
            return Err(format!(
                "mounting a {mib} MiB tmpfs needs root (CAP_SYS_ADMIN): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs(dir.to_owned()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

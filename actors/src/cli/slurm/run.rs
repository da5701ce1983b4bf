//! `troupe slurm run job.toml`: one task per node of a Slurm job step. Each task is its node's daemon
//! (in this process). The first `--controllers` nodes are controller-eligible (one: the first node is the
//! controller; three or five: a Raft group whose leader is). The first node's task also submits the job,
//! follows it and ends the step with the job's outcome. The other tasks end when the job does; if the
//! first node is gone before that, the first task still alive follows the job in its place.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::signal::unix::{signal, Signal, SignalKind};
use troupe_cluster::{NodeIdentity, TransportConfig};
use troupe_model::config::JobConfig;

use super::env::SlurmTask;
use super::{certs, nodes};
use crate::api::{Client, DataPlane, Job, JobId, JobState};
use crate::cli::follow::{conclude, follow, Mode, OnInterrupt, GOODBYE};
use crate::daemon::{Daemon, NodeConfig};
use crate::node_config::controllers::CONTROLLERS_MAX;
use crate::progress::Reporter;
use crate::telemetry::RunDir;

/// How often a task that is not the first asks the controller about the job.
const POLL_MS: u64 = 1_000;
/// A controller-eligible node's Raft endpoint listens this many ports above its daemon: the default
/// daemon ports of two allocations sharing a node (7400 + SLURM_JOB_ID % 1000) never meet a Raft port.
const RAFT_PORT_OFFSET: u16 = 1000;
/// How long the first task waits, after the job ended, for the other tasks to see it and leave.
const FAREWELL_MS: u64 = 10_000;
/// The task that follows the job in the first task's place prints again the events the controller had
/// streamed in this window (or four failure timeouts, if longer) before the first node was missed: the
/// first task may have died with some of them unprinted (in flight, or sent while its node was not yet
/// declared dead), and a repeated line is harmless where a missing one is not.
const REPLAY_MS: u64 = 30_000;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// The job (TOML, as `troupe train --config`); every task reads it, the first submits it.
    #[arg(value_name = "job.toml")]
    pub config: PathBuf,
    #[command(flatten)]
    pub options: RunOptions,
}

/// The options of `troupe slurm run` that `troupe slurm sbatch` passes on to it.
#[derive(Clone, Debug, clap::Args)]
pub struct RunOptions {
    /// The cluster directory (CA and certificates) on a filesystem every node shares; made by the
    /// first task when it has no CA [default: $SLURM_SUBMIT_DIR/.troupe/slurm-$SLURM_JOB_ID].
    #[arg(long, value_name = "DIR")]
    pub cluster_dir: Option<PathBuf>,
    /// UDP port of every node's daemon [default: 7400 + SLURM_JOB_ID % 1000]; a controller-eligible node's
    /// Raft endpoint listens 1000 ports higher.
    #[arg(long)]
    pub port: Option<u16>,
    /// How many of the allocation's first nodes are controller-eligible: 1 (the first node is the
    /// controller, and losing it ends the job), or 3 or 5 (a Raft group: the job survives losing any
    /// minority of them, the first node included) [default: 3 with 3 or more nodes, else 1].
    #[arg(long, value_name = "N")]
    pub controllers: Option<usize>,
    /// Device slots per node [default: SLURM_GPUS_ON_NODE, or 1 on a node without GPUs].
    #[arg(long)]
    pub slots: Option<u32>,
    /// A node.toml whose other keys ([transport], [membership], [telemetry], ...) every node uses; name,
    /// listen, join, certs, data_dir and slots come from Slurm.
    #[arg(long, value_name = "node.toml")]
    pub node_template: Option<PathBuf>,
    /// Longest wait, in seconds, for the certificates, for every node to join, and for a silent
    /// controller.
    #[arg(long, value_name = "SECONDS", default_value_t = RunOptions::WAIT_S)]
    pub wait_s: u64,
    /// How tensors travel between ranks, as `troupe train --data-plane`.
    #[arg(long, value_parser = ["auto", "quic", "encrypted-tcp", "plaintext-tcp"], default_value = "auto")]
    pub data_plane: String,
    /// Write the final parameters to this safetensors file (on the first node).
    #[arg(long, value_name = "PATH.safetensors")]
    pub save_final: Option<PathBuf>,
    /// The first task writes the job's exit code here (0 finished, 1 failed or cancelled) when it ends,
    /// whatever happened to the step's other tasks.
    #[arg(long, value_name = "FILE")]
    pub exit_code_file: Option<PathBuf>,
    /// Record the run here, as `troupe train --run-dir` (the first task).
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print a plain progress line every N steps (default: about 20 lines per run).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub log_every: u64,
    /// One JSON object per line (the first task's events, as `troupe train --json`).
    #[arg(long)]
    pub json: bool,
}

impl RunOptions {
    /// The default of --wait-s.
    pub const WAIT_S: u64 = 120;
}

/// Where this task stands in the allocation.
struct Placement {
    task: SlurmTask,
    hosts: Vec<String>,
    names: Vec<String>,
    /// This node's index in `hosts`; 0 submits the job.
    index: usize,
    /// The daemon addresses of the controller-eligible nodes, `hosts[..controllers.len()]`.
    controllers: Vec<SocketAddr>,
    listen: SocketAddr,
}

impl Placement {
    fn of(task: SlurmTask, port: Option<u16>, controllers: Option<usize>) -> anyhow::Result<Self> {
        let hosts = nodes::expand(&task.node_list)?;
        if hosts.len() != task.nodes {
            bail!(
                "SLURM_JOB_NODELIST={:?} expands to {} node(s) but SLURM_NNODES={}",
                task.node_list,
                hosts.len(),
                task.nodes
            );
        }
        let names = nodes::troupe_names(&hosts)?;
        let index = hosts.iter().position(|h| *h == task.node_name).with_context(|| {
            format!("SLURMD_NODENAME={} is not in SLURM_JOB_NODELIST={:?} ({hosts:?})", task.node_name, task.node_list)
        })?;
        let port = port.unwrap_or(task.default_port());
        let count = controller_count(controllers, hosts.len())?;
        if count > 1 && port.checked_add(RAFT_PORT_OFFSET).is_none() {
            bail!(
                "--port {port}: a controller's Raft endpoint listens {RAFT_PORT_OFFSET} ports higher; choose a port \
                 below {}",
                u16::MAX - RAFT_PORT_OFFSET + 1
            );
        }
        let controllers = hosts[..count].iter().map(|h| nodes::address(h, port)).collect::<anyhow::Result<Vec<_>>>()?;
        let listen = match controllers.get(index) {
            Some(addr) => *addr,
            None => nodes::address(&hosts[index], port)?,
        };
        Ok(Placement { task, hosts, names, index, controllers, listen })
    }

    /// node.toml's `controllers` entries (`NAME@HOST:PORT+1000`), with two or more controller-eligible nodes.
    fn raft_entries(&self) -> Vec<String> {
        if self.controllers.len() < 2 {
            return Vec::new();
        }
        let raft = |addr: &SocketAddr| SocketAddr::new(addr.ip(), addr.port() + RAFT_PORT_OFFSET);
        self.names.iter().zip(&self.controllers).map(|(name, addr)| format!("{name}@{}", raft(addr))).collect()
    }

    /// A client of the cluster, at whichever controller-eligible node answers (a follower redirects).
    async fn client(&self, identity: &NodeIdentity) -> crate::api::Result<Client> {
        Client::connect_any(&self.controllers, identity).await
    }

    /// The controller-eligible nodes, for people: `n1 (10.0.0.1:7400)`, or three of them.
    fn describe_controllers(&self) -> String {
        let each: Vec<String> =
            self.hosts.iter().zip(&self.controllers).map(|(host, addr)| format!("{host} ({addr})")).collect();
        match each.len() {
            1 => format!("controller {}", each[0]),
            n => format!("{n} controllers (Raft) {}", each.join(", ")),
        }
    }

    fn name(&self) -> &str {
        &self.names[self.index]
    }

    fn job_name(&self) -> String {
        format!("slurm-{}", self.task.job_id)
    }
}

/// How many of `hosts` nodes are controller-eligible: `asked` (--controllers), or 3 with 3 nodes or more.
fn controller_count(asked: Option<usize>, hosts: usize) -> anyhow::Result<usize> {
    let count = asked.unwrap_or(if hosts >= 3 { 3 } else { 1 });
    if count == 0 || count > hosts || count > CONTROLLERS_MAX {
        bail!(
            "--controllers {count}: give 1, 3 or 5 (at most {CONTROLLERS_MAX}, and no more than the allocation's \
             {hosts} node(s))"
        );
    }
    if count % 2 == 0 {
        tracing::warn!(
            "--controllers {count}: an even number of controllers tolerates no more lost ones than {} would",
            count - 1
        );
    }
    Ok(count)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    crate::daemon::init_logging();
    let task = SlurmTask::from_vars(|k| std::env::var(k).ok())?;
    // Every task reads the job, so a bad one fails the whole step at once with the same message.
    let config = JobConfig::from_file(&args.config)?;
    let options = args.options;
    let placement = Placement::of(task, options.port, options.controllers)?;
    let dir = match &options.cluster_dir {
        Some(dir) => std::path::absolute(dir).with_context(|| format!("--cluster-dir {}", dir.display()))?,
        None => placement.task.submit_dir.join(".troupe").join(placement.job_name()),
    };
    let bound = Duration::from_secs(options.wait_s);
    let identity = if placement.index == 0 {
        // SLURM_RESTART_COUNT: how often Slurm requeued this job. The same job id names the same cluster
        // directory, so a requeued run keeps its CA; the job's checkpoint.dir gives it its steps.
        let restarts = std::env::var("SLURM_RESTART_COUNT").ok().filter(|n| !n.is_empty() && n != "0");
        if let Some(n) = restarts {
            let ca = if dir.join("ca.pem").exists() { "reusing the CA in" } else { "making the CA in" };
            println!("troupe slurm: Slurm restart {n} of job {}: {ca} {}", placement.task.job_id, dir.display());
        }
        certs::prepare(&dir, &placement.names)?;
        NodeIdentity::load(&dir, &certs::client_name(placement.name()))?
    } else {
        certs::wait(&dir, placement.name(), &placement.hosts[0], bound)?
    };
    // The daemon's catalog lives for this allocation only: durable state is the job's checkpoint.dir.
    let data_dir = tempfile::Builder::new()
        .prefix(&format!("troupe-{}-{}-", placement.job_name(), placement.name()))
        .tempdir()
        .context("creating the daemon's data directory under $TMPDIR")?;
    let node = node_config(&placement, &options, &dir, data_dir.path())?;
    let failure_timeout_ms = node.membership.failure_timeout_ms;
    println!(
        "troupe slurm: node {} (Slurm node {}) at {} with {} slot(s); {}",
        node.name,
        placement.task.node_name,
        node.listen,
        node.slots.unwrap_or(1),
        placement.describe_controllers()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(3)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async {
        let daemon = Daemon::start(node).await?;
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let result = if placement.index == 0 {
            lead(&placement, &options, config, &identity, &mut term, bound).await
        } else {
            let replay = Duration::from_millis(REPLAY_MS.max(4 * failure_timeout_ms));
            let waits = Waits { bound, replay };
            accompany(&placement, &options, &config, &identity, &daemon, &mut term, waits).await
        };
        tracing::info!(node = daemon.name(), "draining");
        let _ = daemon.drain().await;
        result
    })
}

/// The node's config: the template's keys (if any), the network-tuned transport unless the template
/// sets one, and what Slurm decided.
fn node_config(
    placement: &Placement,
    options: &RunOptions,
    certs: &Path,
    data_dir: &Path,
) -> anyhow::Result<NodeConfig> {
    let mut table = match &options.node_template {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--node-template {}", path.display()))?;
            toml::from_str::<toml::Table>(&text).with_context(|| format!("--node-template {}", path.display()))?
        }
        None => toml::Table::new(),
    };
    if !table.contains_key("transport") {
        table.insert("transport".into(), toml::Value::try_from(TransportConfig::default())?);
    }
    let slots = options.slots.unwrap_or(placement.task.slots());
    let set = [
        ("name", toml::Value::from(placement.name())),
        ("listen", placement.listen.to_string().into()),
        ("certs", certs.display().to_string().into()),
        ("data_dir", data_dir.display().to_string().into()),
        ("slots", i64::from(slots).into()),
    ];
    for (key, value) in set {
        table.insert(key.into(), value);
    }
    // Controller-eligible nodes find each other through Raft; the others join the first node, which
    // redirects them to the leader (and they keep every member's address for a later rejoin).
    if placement.index >= placement.controllers.len() {
        table.insert("join".into(), placement.controllers[0].to_string().into());
    } else {
        table.remove("join");
    }
    table.remove("raft_listen");
    let entries = placement.raft_entries();
    if entries.is_empty() {
        table.remove("controllers");
    } else {
        table.insert("controllers".into(), entries.into());
    }
    if !table.contains_key("torch_threads") {
        let threads = (placement.task.cpus_on_node / slots.max(1) as usize).max(1);
        table.insert("torch_threads".into(), (threads as i64).into());
    }
    let origin = options.node_template.as_ref().map_or("the Slurm node config".into(), |p| p.display().to_string());
    Ok(NodeConfig::parse(&toml::to_string(&table)?, &origin)?)
}

/// The first task: waits for every node, submits the job, follows it, records its exit code, lets the
/// other tasks see the end.
async fn lead(
    placement: &Placement,
    options: &RunOptions,
    mut config: JobConfig,
    identity: &NodeIdentity,
    term: &mut Signal,
    bound: Duration,
) -> anyhow::Result<()> {
    if let Some(file) = &options.exit_code_file {
        let _ = std::fs::remove_file(file);
    }
    if let Some(dir) = &config.checkpoint.dir {
        config.checkpoint.dir = Some(std::path::absolute(dir)?);
    }
    tokio::select! {
        joined = wait_for_members(placement, identity, bound) => joined?,
        _ = term.recv() => bail!("stopped by SIGTERM (scancel?) before the job was submitted"),
    }
    let run_dir = options.run_dir.as_deref().map(RunDir::create).transpose()?;
    let plane: DataPlane = options.data_plane.parse().map_err(anyhow::Error::msg)?;
    let mode = Mode::of(&config);
    let total = config.train.steps;
    let mut job = Job::new(config).name(placement.job_name()).data_plane(plane).trace(run_dir.is_some());
    if let Some(path) = &options.save_final {
        job = job.save_final(std::path::absolute(path)?);
    }
    let client = placement.client(identity).await?;
    let mut handle = client.submit(job).await?;
    let id = handle.id();
    let reporter = Reporter::new(options.json, 0, total, options.log_every).with_run_dir(run_dir);
    let started = Instant::now();
    // SIGTERM (scancel) cancels the job: the allocation is going away.
    let followed = follow(&mut handle, &reporter, &mode, Some(placement.hosts.len()), OnInterrupt::Cancel).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    let result = conclude(reporter, followed?, started, Some(placement.hosts.len()), id, false);
    record_exit_code(options, &result)?;
    // The others see the job's end on their next poll and leave; then this daemon drains.
    farewell(placement, identity, term).await;
    result
}

async fn members(placement: &Placement, identity: &NodeIdentity) -> Option<usize> {
    let mut client = placement.client(identity).await.ok()?;
    let status = client.status().await.ok();
    client.close().await;
    status.map(|s| s.members.len())
}

/// Waits until every node of the allocation is a member, naming the ones missing after `bound`. With
/// several controllers there is no controller to answer until a majority of them has started and
/// elected a leader: an unanswered question is asked again.
async fn wait_for_members(placement: &Placement, identity: &NodeIdentity, bound: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut client: Option<Client> = None;
    let mut missing: Vec<&String> = placement.names.iter().collect();
    let mut unanswered = None;
    loop {
        if client.is_none() {
            client = placement.client(identity).await.map_err(|e| unanswered = Some(e.to_string())).ok();
        }
        if let Some(c) = client.as_mut() {
            match c.status().await {
                Ok(status) => {
                    missing =
                        placement.names.iter().filter(|n| !status.members.iter().any(|m| &m.name == *n)).collect();
                    if missing.is_empty() {
                        client.take().expect("asked").close().await;
                        return Ok(());
                    }
                    unanswered = None;
                }
                Err(e) => {
                    unanswered = Some(e.to_string());
                    client = None;
                }
            }
        }
        if started.elapsed() >= bound {
            if let Some(error) = unanswered {
                bail!(
                    "no controller answered within {} s (--wait-s; {}): {error}",
                    bound.as_secs(),
                    placement.describe_controllers()
                );
            }
            bail!(
                "node(s) {missing:?} did not join within {} s (--wait-s); their task's output in the job's output \
                 says why (a firewall on UDP port {}? a certificate?)",
                bound.as_secs(),
                placement.listen.port()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How long a task that is not the first waits for a controller to answer (`bound`), and how far back
/// from the moment the first node was missed a task following in its place starts printing (`replay`).
#[derive(Clone, Copy, Debug)]
struct Waits {
    bound: Duration,
    replay: Duration,
}

/// Another task: serves as a node until the job ends (its outcome is this task's), SIGTERM, the
/// daemon stopping, or no controller answering for `bound`. If the first node leaves the cluster before
/// the job ended, the first task still alive follows the job in its place (with several controllers the
/// job outlives the first node).
async fn accompany(
    placement: &Placement,
    options: &RunOptions,
    config: &JobConfig,
    identity: &NodeIdentity,
    daemon: &Daemon,
    term: &mut Signal,
    Waits { bound, replay }: Waits,
) -> anyhow::Result<()> {
    let name = placement.job_name();
    let first = &placement.names[0];
    let mut heard = Instant::now();
    let mut client: Option<Client> = None;
    // Whether the first node was seen in the cluster; how many events the job had streamed at each poll
    // that saw it (the last `replay` of them), and when it was first missed: a task following in its
    // place starts from the count of the newest poll made `replay` before it was missed.
    let (mut first_seen, mut streamed, mut missed) = (false, VecDeque::<(Instant, u64)>::new(), None);
    // The job's end, once seen while a task before this one spoke for it (this task stays for it).
    let mut ended_seen: Option<anyhow::Result<()>> = None;
    loop {
        tokio::select! {
            _ = term.recv() => bail!("stopped by SIGTERM (scancel?): node {} left the cluster", placement.name()),
            _ = tokio::time::sleep(Duration::from_millis(POLL_MS)) => {}
        }
        if !daemon.is_running() {
            bail!("node {} stopped: {}", placement.name(), daemon.stop_reason().unwrap_or_default());
        }
        if client.is_none() {
            client = placement.client(identity).await.ok();
        }
        let status = match client.as_mut() {
            Some(c) => c.status().await.ok(),
            None => None,
        };
        let Some(status) = status else {
            client = None;
            if let Some(outcome) = ended_seen.take() {
                // The speaking task has left with the controllers' majority: the job's end is known.
                return outcome;
            }
            if heard.elapsed() >= bound {
                let why = if placement.controllers.len() == 1 {
                    "its node is gone, and the job with it (the first node runs the only controller; \
                     --controllers 3 survives losing it)"
                } else {
                    "a majority of them is gone, and the job with it"
                };
                bail!(
                    "no controller has answered for {} s ({}): {why}; with checkpoint.dir set, submit the script \
                     again and the job continues from its newest checkpoint",
                    bound.as_secs(),
                    placement.describe_controllers()
                );
            }
            continue;
        };
        heard = Instant::now();
        if !status.controller {
            // Only the controller knows the jobs (with several controllers, any of them may have
            // answered): ask it from the next poll on.
            client = match status.controller_addr {
                Some(addr) => Client::connect(addr, identity).await.ok(),
                None => None,
            };
            continue;
        }
        let member = |n: &String| status.members.iter().any(|m| &m.name == n);
        let job = status.jobs.iter().filter(|j| j.name == name).max_by_key(|j| j.id);
        // The job exists only once the first node's task submitted it: the first node was there.
        first_seen |= job.is_some();
        // A task before this one is alive while the first node is gone: it speaks for the job (or will).
        let speaker_before = !member(first) && placement.names[..placement.index].iter().any(member);
        if member(first) {
            (first_seen, missed) = (true, None);
            // How many events the controller has streamed (a status's job list does not count them).
            if let (Some(job), Some(c)) = (job, client.as_mut()) {
                if let Ok(info) = c.job_status(job.id).await {
                    streamed.push_back((Instant::now(), info.events));
                }
            }
            // Keep the newest poll older than `replay`, and those since.
            while streamed.get(1).is_some_and(|(at, _)| at.elapsed() > replay) {
                streamed.pop_front();
            }
        } else if first_seen {
            let missed = *missed.get_or_insert_with(Instant::now);
            if !placement.names[..placement.index].iter().any(member) {
                if let Some(outcome) = ended_seen.take() {
                    // The task that spoke for the job saw it end and has left (it waited for this one
                    // at most FAREWELL_MS): that end is this task's too, nothing is followed again.
                    return outcome;
                }
                // The first node's task is gone and this one is the first alive: it speaks for the job.
                let Some(job) = job else {
                    bail!("the first node {} left the cluster before it submitted the job", placement.hosts[0]);
                };
                let since =
                    streamed.iter().rev().find(|(at, _)| missed.duration_since(*at) >= replay).map_or(0, |p| p.1);
                let client = client.take().expect("a client that just answered");
                return follow_in_place(placement, options, config, identity, client, (job.id, since), term).await;
            }
        }
        let Some(job) = job else { continue };
        let ended = matches!(job.state, JobState::Finished | JobState::Failed | JobState::Cancelled);
        if ended && first_seen && speaker_before {
            // The task speaking for the job needs a controller until it has streamed the outcome: with
            // several controllers, this node leaving could take their majority with it. Stay until
            // that task has left (it waits at most FAREWELL_MS for the others first); then no
            // controller may answer this one, and the end seen here is its outcome.
            ended_seen = Some(match job.state {
                JobState::Finished => Ok(()),
                state => Err(anyhow::anyhow!("job {} ({name}) ended {state:?}", job.id)),
            });
            continue;
        }
        match job.state {
            JobState::Finished => return Ok(()),
            JobState::Failed | JobState::Cancelled => bail!(
                "job {} ({name}) ended {:?}: {}; the first task's output has the details",
                job.id,
                job.state,
                job.reason.as_deref().unwrap_or("no reason given")
            ),
            _ => {}
        }
    }
}

/// The first task alive once the first node is gone: follows the job from event `since`, which the
/// first task had printed (the events after it that it had printed too are printed again, none is
/// skipped), records the outcome and waits for the others as the first task would have.
async fn follow_in_place(
    placement: &Placement,
    options: &RunOptions,
    config: &JobConfig,
    identity: &NodeIdentity,
    client: Client,
    (job, since): (JobId, u64),
    term: &mut Signal,
) -> anyhow::Result<()> {
    println!(
        "troupe slurm: the first node {} left the cluster; node {} follows job {job} from its event {since} \
         (lines the first task printed after it are printed again)",
        placement.hosts[0],
        placement.name()
    );
    let mut handle = client.watch_from(job, since).await?;
    let total = config.train.steps;
    let reporter = Reporter::new(options.json, 0, total, options.log_every);
    let started = Instant::now();
    let nodes = Some(placement.hosts.len());
    let followed = follow(&mut handle, &reporter, &Mode::of(config), nodes, OnInterrupt::Cancel).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    let result = conclude(reporter, followed?, started, nodes, job, false);
    record_exit_code(options, &result)?;
    farewell(placement, identity, term).await;
    result
}

/// Writes the job's outcome to --exit-code-file (0 finished, 1 failed or cancelled), if given.
fn record_exit_code(options: &RunOptions, result: &anyhow::Result<()>) -> anyhow::Result<()> {
    if let Some(file) = &options.exit_code_file {
        let code = if result.is_ok() { "0\n" } else { "1\n" };
        std::fs::write(file, code).with_context(|| format!("--exit-code-file {}", file.display()))?;
    }
    Ok(())
}

/// Waits (up to FAREWELL_MS, or SIGTERM) until this node is the cluster's last: the others see the
/// job's end on their next poll and leave.
async fn farewell(placement: &Placement, identity: &NodeIdentity, term: &mut Signal) {
    let others_left = async {
        while members(placement, identity).await.is_some_and(|n| n > 1) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(Duration::from_millis(FAREWELL_MS), others_left) => {}
        _ = term.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Task `index` of an allocation of `hosts` nodes n1, n2, … at 10.0.0.1, 10.0.0.2, …, port 7400.
    fn placement(hosts: usize, index: usize, controllers: Option<usize>) -> anyhow::Result<Placement> {
        let host_names: Vec<String> = (1..=hosts).map(|i| format!("n{i}")).collect();
        let addr = |i: usize| SocketAddr::from(([10, 0, 0, i as u8 + 1], 7400));
        let task = SlurmTask {
            job_id: 0,
            node_list: format!("n[1-{hosts}]"),
            nodes: hosts,
            node_name: host_names[index].clone(),
            proc_id: index,
            tasks: hosts,
            cpus_on_node: 2,
            gpus_on_node: 0,
            submit_dir: PathBuf::from("/shared"),
        };
        let count = controller_count(controllers, hosts)?;
        Ok(Placement {
            task,
            names: host_names.clone(),
            hosts: host_names,
            index,
            controllers: (0..count).map(addr).collect(),
            listen: addr(index),
        })
    }

    fn config_of(placement: &Placement) -> NodeConfig {
        let options = RunOptions {
            cluster_dir: None,
            port: None,
            controllers: None,
            slots: None,
            node_template: None,
            wait_s: RunOptions::WAIT_S,
            data_plane: "auto".into(),
            save_final: None,
            exit_code_file: None,
            run_dir: None,
            log_every: 0,
            json: false,
        };
        let certs = tempfile::tempdir().unwrap();
        certs::prepare(certs.path(), &placement.names).unwrap();
        node_config(placement, &options, certs.path(), Path::new("/tmp/data")).unwrap()
    }

    #[test]
    fn three_nodes_or_more_get_three_controllers_and_fewer_one() {
        assert_eq!(controller_count(None, 1).unwrap(), 1);
        assert_eq!(controller_count(None, 2).unwrap(), 1);
        assert_eq!(controller_count(None, 3).unwrap(), 3);
        assert_eq!(controller_count(None, 64).unwrap(), 3);
        assert_eq!(controller_count(Some(5), 8).unwrap(), 5);
        assert_eq!(controller_count(Some(1), 8).unwrap(), 1);
        for (asked, hosts) in [(0, 4), (5, 4), (9, 16)] {
            let error = controller_count(Some(asked), hosts).unwrap_err().to_string();
            assert!(error.starts_with(&format!("--controllers {asked}: give 1, 3 or 5")), "{error}");
            assert!(error.contains(&format!("the allocation's {hosts} node(s)")), "{error}");
        }
    }

    #[test]
    fn controller_eligible_nodes_list_each_others_raft_ports_and_the_others_join_the_first() {
        let entries = ["n1@10.0.0.1:8400", "n2@10.0.0.2:8400", "n3@10.0.0.3:8400"];
        for index in 0..3 {
            let node = config_of(&placement(4, index, None).unwrap());
            assert_eq!(node.controllers, entries, "node {index}");
            assert_eq!(node.join, None, "a controller-eligible node finds the others through Raft");
        }
        let worker = config_of(&placement(4, 3, None).unwrap());
        assert_eq!(worker.controllers, entries);
        assert_eq!(worker.join, Some("10.0.0.1:7400".parse().unwrap()));
        // One controller: today's cluster, the first node the controller and no Raft.
        let first = config_of(&placement(4, 0, Some(1)).unwrap());
        let second = config_of(&placement(4, 1, Some(1)).unwrap());
        assert!(first.controllers.is_empty() && first.join.is_none());
        assert_eq!((second.controllers.len(), second.join), (0, Some("10.0.0.1:7400".parse().unwrap())));
        let described = placement(4, 3, None).unwrap().describe_controllers();
        assert_eq!(described, "3 controllers (Raft) n1 (10.0.0.1:7400), n2 (10.0.0.2:7400), n3 (10.0.0.3:7400)");
    }
}

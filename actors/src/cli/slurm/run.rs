//! `troupe slurm run job.toml`: one task per node of a Slurm job step. Each task is its node's daemon
//! (in this process); the first node's is the controller, and its task also submits the job, follows it
//! and ends the step with the job's outcome. The other tasks end when the job does.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::signal::unix::{signal, Signal, SignalKind};
use troupe_cluster::{NodeIdentity, TransportConfig};
use troupe_model::config::JobConfig;

use super::env::SlurmTask;
use super::{certs, nodes};
use crate::api::{Client, DataPlane, Job, JobState};
use crate::cli::follow::{conclude, follow, Mode, OnInterrupt, GOODBYE};
use crate::daemon::{Daemon, NodeConfig};
use crate::progress::Reporter;
use crate::telemetry::RunDir;

/// How often a task that is not the first asks the controller about the job.
const POLL_MS: u64 = 1_000;
/// How long the first task waits, after the job ended, for the other tasks to see it and leave.
const FAREWELL_MS: u64 = 10_000;

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
    /// UDP port of every node's daemon [default: 7400 + SLURM_JOB_ID % 1000].
    #[arg(long)]
    pub port: Option<u16>,
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
    /// This node's index in `hosts`; 0 runs the controller.
    index: usize,
    controller: SocketAddr,
    listen: SocketAddr,
}

impl Placement {
    fn of(task: SlurmTask, port: Option<u16>) -> anyhow::Result<Self> {
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
        let controller = nodes::address(&hosts[0], port)?;
        let listen = if index == 0 { controller } else { nodes::address(&hosts[index], port)? };
        Ok(Placement { task, hosts, names, index, controller, listen })
    }

    fn name(&self) -> &str {
        &self.names[self.index]
    }

    fn job_name(&self) -> String {
        format!("slurm-{}", self.task.job_id)
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    crate::daemon::init_logging();
    let task = SlurmTask::from_vars(|k| std::env::var(k).ok())?;
    // Every task reads the job, so a bad one fails the whole step at once with the same message.
    let config = JobConfig::from_file(&args.config)?;
    let options = args.options;
    let placement = Placement::of(task, options.port)?;
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
    println!(
        "troupe slurm: node {} (Slurm node {}) at {} with {} slot(s); controller {} at {}",
        node.name, placement.task.node_name, node.listen, node.slots, placement.hosts[0], placement.controller
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
            accompany(&placement, &identity, &daemon, &mut term, bound).await
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
    if placement.index > 0 {
        table.insert("join".into(), placement.controller.to_string().into());
    } else {
        table.remove("join");
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
    let client = Client::connect(placement.controller, identity).await?;
    let mut handle = client.submit(job).await?;
    let id = handle.id();
    let reporter = Reporter::new(options.json, 0, total, options.log_every).with_run_dir(run_dir);
    let started = Instant::now();
    // SIGTERM (scancel) cancels the job: the allocation is going away.
    let followed = follow(&mut handle, &reporter, &mode, Some(placement.hosts.len()), OnInterrupt::Cancel).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    let result = conclude(reporter, followed?, started, Some(placement.hosts.len()), id, false);
    if let Some(file) = &options.exit_code_file {
        let code = if result.is_ok() { "0\n" } else { "1\n" };
        std::fs::write(file, code).with_context(|| format!("--exit-code-file {}", file.display()))?;
    }
    // The others see the job's end on their next poll and leave; then this daemon drains.
    let farewell = async {
        while members(placement, identity).await.is_some_and(|n| n > 1) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(Duration::from_millis(FAREWELL_MS), farewell) => {}
        _ = term.recv() => {}
    }
    result
}

async fn members(placement: &Placement, identity: &NodeIdentity) -> Option<usize> {
    let mut client = Client::connect(placement.controller, identity).await.ok()?;
    let status = client.status().await.ok();
    client.close().await;
    status.map(|s| s.members.len())
}

/// Waits until every node of the allocation is a member, naming the ones missing after `bound`.
async fn wait_for_members(placement: &Placement, identity: &NodeIdentity, bound: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut client = Client::connect(placement.controller, identity).await?;
    loop {
        let status = client.status().await?;
        let missing: Vec<&String> =
            placement.names.iter().filter(|n| !status.members.iter().any(|m| &m.name == *n)).collect();
        if missing.is_empty() {
            client.close().await;
            return Ok(());
        }
        if started.elapsed() >= bound {
            bail!(
                "node(s) {missing:?} did not join within {} s (--wait-s); their task's output in the job's output \
                 says why (a firewall on UDP port {}? a certificate?)",
                bound.as_secs(),
                placement.controller.port()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Another task: serves as a node until the job ends (its outcome is this task's), SIGTERM, the
/// daemon stopping, or the controller silent for `bound`.
async fn accompany(
    placement: &Placement,
    identity: &NodeIdentity,
    daemon: &Daemon,
    term: &mut Signal,
    bound: Duration,
) -> anyhow::Result<()> {
    let name = placement.job_name();
    let mut heard = Instant::now();
    let mut client: Option<Client> = None;
    loop {
        tokio::select! {
            _ = term.recv() => bail!("stopped by SIGTERM (scancel?): node {} left the cluster", placement.name()),
            _ = tokio::time::sleep(Duration::from_millis(POLL_MS)) => {}
        }
        if !daemon.is_running() {
            bail!("node {} stopped: {}", placement.name(), daemon.stop_reason().unwrap_or_default());
        }
        if client.is_none() {
            client = Client::connect(placement.controller, identity).await.ok();
        }
        let status = match client.as_mut() {
            Some(c) => c.status().await.ok(),
            None => None,
        };
        let Some(status) = status else {
            client = None;
            if heard.elapsed() >= bound {
                bail!(
                    "the controller on {} ({}) has not answered for {} s: its node is gone, and the job with it \
                     (the first node runs the controller); with checkpoint.dir set, submit the script again and the \
                     job continues from its newest checkpoint",
                    placement.hosts[0],
                    placement.controller,
                    bound.as_secs()
                );
            }
            continue;
        };
        heard = Instant::now();
        let Some(job) = status.jobs.iter().filter(|j| j.name == name).max_by_key(|j| j.id) else { continue };
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

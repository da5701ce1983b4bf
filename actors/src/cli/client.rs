//! `troupe status` and `troupe job submit|status|cancel`: clients of a running cluster.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

use super::follow::{conclude, follow, Mode, OnInterrupt, GOODBYE};
use super::table::Table;
use crate::api::{Client, ClusterStatus, DataPlane, Job, JobInfo};
use crate::node_config::NodeConfig;
use crate::progress::Reporter;
use crate::telemetry::RunDir;

/// Which cluster to talk to, and with which certificate.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// Daemons' addresses, comma-separated: any members (the controllers, or any one: a daemon that is
    /// not the controller names it). The client follows the controller to whichever of them leads, and
    /// across a take-over. Default: the `listen` and `join` addresses of --node-config.
    #[arg(long, value_name = "ADDR[,ADDR…]", value_delimiter = ',')]
    pub cluster: Vec<SocketAddr>,
    /// Use this node's config for the address and certificate (default: ./node.toml if it exists).
    #[arg(long, value_name = "node.toml")]
    pub node_config: Option<PathBuf>,
    #[command(flatten)]
    pub identity: IdentityArgs,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

/// The certificate a client presents: any certificate issued by the cluster CA.
#[derive(Debug, clap::Args)]
pub struct IdentityArgs {
    /// Cluster directory holding the certificate to present (with --as).
    #[arg(long, value_name = "DIR")]
    pub certs: Option<PathBuf>,
    /// Name of the certificate to present (made with `troupe cluster add-node NAME`).
    #[arg(long = "as", value_name = "NAME")]
    pub name: Option<String>,
}

impl ClusterArgs {
    pub(super) async fn connect(&self) -> anyhow::Result<Client> {
        let node_config = self.node_config.clone().or_else(|| {
            let default = PathBuf::from("node.toml");
            default.exists().then_some(default)
        });
        let node = node_config.as_deref().map(NodeConfig::load).transpose()?;
        let addrs = match (&self.cluster[..], &node) {
            ([], Some(n)) => std::iter::once(n.listen).chain(n.join).collect(),
            ([], None) => {
                bail!("which cluster? pass --cluster ADDR[,ADDR…] (daemons' addresses) or --node-config node.toml")
            }
            (addrs, _) => addrs.to_vec(),
        };
        let (certs, name) = match (&self.identity.certs, &self.identity.name, &node) {
            (Some(dir), Some(name), _) => (dir.clone(), name.clone()),
            (None, None, Some(n)) => (n.certs.clone(), n.name.clone()),
            (Some(dir), None, Some(n)) => (dir.clone(), n.name.clone()),
            (None, Some(name), Some(n)) => (n.certs.clone(), name.clone()),
            _ => bail!("which certificate? pass --certs DIR --as NAME (see `troupe cluster add-node`) or --node-config node.toml"),
        };
        let identity = NodeIdentity::load(&certs, &name)?;
        Ok(Client::connect_any(&addrs, &identity).await?)
    }
}

pub(super) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("starting the tokio runtime")
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        let mut client = args.cluster.connect().await?;
        let status = client.status().await?;
        client.close().await;
        if args.cluster.json {
            println!("{}", serde_json::to_string(&status)?);
        } else {
            print_status(&status);
        }
        Ok(())
    })
}

fn print_status(s: &ClusterStatus) {
    let role = if s.controller { "the controller" } else { "a member" };
    println!("cluster at epoch {}: {} member(s); answered by {} ({role})", s.epoch, s.members.len(), s.node);
    println!();
    print!("{}", render_members(s));
    let controller = s.controller_addr;
    if !s.jobs.is_empty() {
        println!();
        print_jobs(&s.jobs);
    } else if !s.controller {
        println!("\n(jobs are listed by the controller{})", controller.map(|a| format!(" at {a}")).unwrap_or_default());
    }
    if s.refused_stale > 0 {
        println!("\nrefused stale-epoch messages: {}", s.refused_stale);
    }
}

/// The members table: each member's address, slots and what they compute on, role and dashboard.
fn render_members(s: &ClusterStatus) -> String {
    let mut members = Table::new(&["NODE", "ADDRESS", "SLOTS", "DEVICES", "IN USE", "ROLE", "DASHBOARD"]);
    for m in &s.members {
        let role = if Some(m.addr) == s.controller_addr { "controller" } else { "member" };
        let dashboard = m.dashboard.clone().unwrap_or_else(|| "-".into());
        let (slots, devices, load) = (m.slots.to_string(), devices_cell(&m.devices), load_cell(m.load.as_ref()));
        let row = vec![m.name.clone(), m.addr.to_string(), slots, devices, load, role.into()];
        members.row(row.into_iter().chain([dashboard]).collect());
    }
    for name in &s.joining {
        members.row(vec![name.clone(), "-".into(), "-".into(), "-".into(), "joining".into()]);
    }
    let mut out = members.render();
    for m in &s.members {
        let missing = m.devices.iter().find_map(|d| match d {
            crate::protocol::SlotDevice::Cuda { nccl_missing: Some(why), .. } => Some(why),
            _ => None,
        });
        if let Some(why) = missing {
            out.push_str(&format!("{}: no NCCL, gradients go through host memory: {why}\n", m.name));
        }
        if let Some(why) = m.load.as_ref().and_then(|l| l.devices_unavailable.as_ref()) {
            out.push_str(&format!("{}: no GPU figures: {why}\n", m.name));
        }
    }
    out
}

/// A member's slots' devices: `cpu`, or each GPU as `cuda:N NAME (GiB)` (slots in order).
fn devices_cell(devices: &[crate::protocol::SlotDevice]) -> String {
    use crate::protocol::SlotDevice;
    if devices.iter().all(|d| *d == SlotDevice::Cpu) {
        return "cpu".into();
    }
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let each = devices.iter().map(|d| match d {
        SlotDevice::Cpu => "cpu".to_owned(),
        SlotDevice::Cuda { name, memory_bytes, .. } => format!("{} {name} ({:.0} GiB)", d.label(), gib(*memory_bytes)),
    });
    each.collect::<Vec<_>>().join(", ")
}

/// What a member's machine is using, as its last heartbeat said: each GPU's memory in use of its total
/// and how busy it was (`cuda:0 12.3/80 GiB 87%`), then the daemon's resident memory and CPU share
/// (`host 2.1 GiB 45% cpu`); `-` before the first heartbeat that carried it.
fn load_cell(load: Option<&crate::protocol::NodeLoad>) -> String {
    let Some(load) = load else { return "-".into() };
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let mut parts: Vec<String> = load
        .devices
        .iter()
        .map(|d| {
            let (used, total, busy) = (gib(d.memory_used_bytes), gib(d.memory_total_bytes), d.busy_percent);
            format!("cuda:{} {used:.1}/{total:.0} GiB {busy}%", d.ordinal)
        })
        .collect();
    let cpu = load.cpu_percent.map_or(String::new(), |c| format!(" {c}% cpu"));
    parts.push(format!("host {:.1} GiB{cpu}", gib(load.rss_bytes)));
    parts.join(", ")
}

fn print_jobs(jobs: &[JobInfo]) {
    print!("{}", render_jobs(jobs));
}

/// The jobs table, then for each job that is not over a table of its slots: rank, node, slot, stage
/// (pipelines), replica, state and last committed step.
fn render_jobs(jobs: &[JobInfo]) -> String {
    let header = ["JOB", "NAME", "STATE", "STEP", "WORLD", "EPOCH", "ATTEMPTS", "LOSS", "DATA PLANE", "GRADIENTS"];
    let mut table = Table::new(&header);
    for j in jobs {
        let state = serde_json::to_value(j.state).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        table.row(vec![
            j.id.to_string(),
            j.name.clone(),
            state,
            format!("{}/{}", j.step, j.total_steps),
            j.world.to_string(),
            j.epoch.to_string(),
            j.attempts.to_string(),
            j.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
            j.data_plane.to_string(),
            j.plane.to_string(),
        ]);
    }
    let mut out = table.render();
    for j in jobs.iter().filter(|j| !j.plane_reason.is_empty() && !j.state.is_terminal()) {
        out.push_str(&format!("job {}: gradients on the {} plane: {}\n", j.id, j.plane, j.plane_reason));
    }
    for j in jobs.iter().filter(|j| j.reason.is_some()) {
        out.push_str(&format!("job {}: {}\n", j.id, j.reason.as_deref().unwrap_or_default()));
    }
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for j in jobs.iter().filter(|j| !j.ranks.is_empty()) {
        let pipeline = j.ranks.iter().any(|r| r.stage.is_some());
        let tensor = j.ranks.iter().any(|r| r.tensor.is_some());
        let mut header = vec!["RANK", "NODE", "SLOT"];
        if pipeline {
            header.push("STAGE");
        }
        if tensor {
            header.push("TENSOR");
        }
        header.extend(["REPLICA", "STATE", "STEP"]);
        let usage = j.ranks.iter().any(|r| r.memory_bytes.is_some());
        if usage {
            header.extend(["MEMORY", "SENT/STEP"]);
        }
        let mut ranks = Table::new(&header);
        for r in &j.ranks {
            let mut row = vec![dash(r.rank.map(|x| x.to_string())), r.node.clone(), r.slot.to_string()];
            if pipeline {
                row.push(dash(r.stage.map(|x| x.to_string())));
            }
            if tensor {
                row.push(dash(r.tensor.map(|x| x.to_string())));
            }
            row.extend([
                dash(r.replica.map(|x| x.to_string())),
                r.state.name().into(),
                dash(r.step.map(|x| x.to_string())),
            ]);
            if usage {
                let mib = |b: Option<u64>| dash(b.map(|b| format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)));
                row.extend([mib(r.memory_bytes), mib(r.sent_bytes_per_step)]);
            }
            ranks.row(row);
        }
        out.push_str(&format!("\njob {} ({}) ranks:\n{}", j.id, j.name, ranks.render()));
    }
    out
}

/// `troupe job submit`: submits the job, then (unless detached) follows it as `troupe train` does.
async fn submit(
    config: &Path,
    data_plane: &str,
    detach: bool,
    run_dir: Option<&Path>,
    log_every: u64,
    cluster: &ClusterArgs,
) -> anyhow::Result<()> {
    let job_config = JobConfig::from_file(config)?;
    let name = config.file_stem().map_or("job".into(), |s| s.to_string_lossy().into_owned());
    let mode = Mode::of(&job_config);
    let run_dir = run_dir.map(RunDir::create).transpose()?;
    let data_plane: DataPlane = data_plane.parse().map_err(anyhow::Error::msg)?;
    let job = Job::new(job_config).name(name).data_plane(data_plane).trace(run_dir.is_some());
    let client = cluster.connect().await?;
    let mut handle = client.submit(job).await?;
    let id = handle.id();
    let reporter = Reporter::new(cluster.json, 0, mode.total_steps, log_every).with_run_dir(run_dir);
    let line = if detach {
        format!("submitted job {id}; `troupe job status {id}` shows it, `troupe job cancel {id}` stops it")
    } else {
        format!("submitted job {id}; following it (Ctrl-C leaves it running)")
    };
    reporter.event("submitted", json!({ "job": id }), &line);
    if detach {
        handle.close().await;
        return Ok(());
    }
    let started = Instant::now();
    let followed = follow(&mut handle, &reporter, &mode, None, OnInterrupt::Detach).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    conclude(reporter, followed?, started, None, id, true)
}

/// `troupe job watch`: follows job `id` from event `from` (None: from now on) to its end.
async fn watch(id: u64, from: Option<u64>, log_every: u64, cluster: &ClusterArgs) -> anyhow::Result<()> {
    let mut client = cluster.connect().await?;
    let info = client.job_status(id).await?;
    let mut handle = match from {
        Some(since) => client.watch_from(id, since).await?,
        // A job over already: its last event (how it ended) is what there is to see.
        None if info.state.is_terminal() => client.watch_from(id, info.events.saturating_sub(1)).await?,
        None => client.watch(id).await?,
    };
    let mode = Mode::unknown(info.total_steps);
    let reporter = Reporter::new(cluster.json, info.step, info.total_steps, log_every);
    let started = Instant::now();
    let followed = follow(&mut handle, &reporter, &mode, None, OnInterrupt::Detach).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    conclude(reporter, followed?, started, None, id, true)
}

#[derive(Debug, clap::Subcommand)]
pub enum JobCommand {
    /// Submit a job config (TOML, as `troupe train --config`) and follow it until it ends: progress and
    /// a summary as `troupe train` prints them; exits non-zero when the job fails or is cancelled.
    Submit {
        #[arg(value_name = "job.toml")]
        config: PathBuf,
        /// How tensors travel between the job's ranks, as `troupe train --data-plane`: auto, quic,
        /// encrypted-tcp, or plaintext-tcp (unencrypted between hosts; the cluster must allow it).
        #[arg(long, value_parser = ["auto", "quic", "encrypted-tcp", "plaintext-tcp"], default_value = "auto")]
        data_plane: String,
        /// Return once submitted instead of following the job.
        #[arg(long)]
        detach: bool,
        /// Record the run here, as `troupe train --run-dir` does (the job's ranks report their step
        /// phases): `troupe trace DIR` and `troupe plot DIR` draw it.
        #[arg(long, value_name = "DIR", conflicts_with = "detach")]
        run_dir: Option<PathBuf>,
        /// Print a plain progress line every N steps (default: about 20 lines per run).
        #[arg(long, value_name = "N", default_value_t = 0)]
        log_every: u64,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Follow a job submitted elsewhere until it ends, as `troupe job submit` does (Ctrl-C leaves it
    /// running): across a take-over of the controller, every event once, in order.
    Watch {
        id: u64,
        /// Replay the job's events from this number on (0: from its start); default: from now on.
        #[arg(long, value_name = "N")]
        from: Option<u64>,
        /// Print a plain progress line every N steps (default: about 20 lines per run).
        #[arg(long, value_name = "N", default_value_t = 0)]
        log_every: u64,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Show a job.
    Status {
        id: u64,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
    /// Cancel a job.
    Cancel {
        id: u64,
        #[command(flatten)]
        cluster: ClusterArgs,
    },
}

pub fn job(command: JobCommand) -> anyhow::Result<()> {
    runtime()?.block_on(async {
        match command {
            JobCommand::Submit { config, data_plane, detach, run_dir, log_every, cluster } => {
                submit(&config, &data_plane, detach, run_dir.as_deref(), log_every, &cluster).await
            }
            JobCommand::Watch { id, from, log_every, cluster } => watch(id, from, log_every, &cluster).await,
            JobCommand::Status { id, cluster } => {
                let mut client = cluster.connect().await?;
                let info = client.job_status(id).await?;
                client.close().await;
                if cluster.json {
                    println!("{}", serde_json::to_string(&info)?);
                } else {
                    print_jobs(std::slice::from_ref(&info));
                }
                Ok(())
            }
            JobCommand::Cancel { id, cluster } => {
                let mut client = cluster.connect().await?;
                let info = client.cancel(id).await?;
                client.close().await;
                if cluster.json {
                    println!("{}", serde_json::to_string(&info)?);
                } else {
                    println!("cancelling job {id}");
                }
                Ok(())
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::JobState;
    use crate::protocol::{RankInfo, RankState};

    #[test]
    fn the_jobs_table_lists_each_running_jobs_slots() {
        let rank = |node: &str, rank, stage, state, step| RankInfo {
            node: node.into(),
            slot: 0,
            rank,
            stage,
            tensor: None,
            replica: rank.map(|_| 0),
            state,
            step,
            memory_bytes: None,
            sent_bytes_per_step: None,
        };
        let job_with = |ranks: Vec<RankInfo>| JobInfo {
            id: 3,
            name: "pipe".into(),
            state: JobState::Running,
            step: 12,
            total_steps: 100,
            epoch: 2,
            world: 2,
            attempts: 1,
            last_loss: Some(3.25),
            reason: None,
            events: 40,
            data_plane: DataPlane::EncryptedTcp,
            plane: Default::default(),
            plane_reason: String::new(),
            ranks,
        };
        let job = job_with(vec![
            rank("node-a", Some(0), Some(0), RankState::Training, Some(12)),
            rank("node-b", Some(1), Some(1), RankState::Training, Some(12)),
            rank("node-c", None, None, RankState::Spare, None),
        ]);
        let text = render_jobs(&[job]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["3", "pipe", "running", "12/100", "2", "2", "1", "3.2500", "encrypted-tcp", "host"]
        );
        assert_eq!(lines[3], "job 3 (pipe) ranks:");
        let cells = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(cells(lines[4]), ["RANK", "NODE", "SLOT", "STAGE", "REPLICA", "STATE", "STEP"]);
        assert_eq!(cells(lines[6]), ["1", "node-b", "0", "1", "0", "training", "12"]);
        assert_eq!(cells(lines[7]), ["-", "node-c", "0", "-", "-", "spare", "-"]);

        // A tensor-parallel job whose attempt reported its usage: each rank's memory and bytes per step.
        let mut tensor = job_with(vec![rank("node-a", Some(0), None, RankState::Training, Some(12))]);
        tensor.ranks[0].tensor = Some(0);
        (tensor.ranks[0].memory_bytes, tensor.ranks[0].sent_bytes_per_step) = (Some(3 << 20), Some(5 << 19));
        let text = render_jobs(&[tensor]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            cells(lines[4]),
            ["RANK", "NODE", "SLOT", "TENSOR", "REPLICA", "STATE", "STEP", "MEMORY", "SENT/STEP"]
        );
        assert!(lines[5].ends_with("3.0 MiB  2.5 MiB"), "{text}");

        // A job on GPUs says where its gradients are summed, and why.
        let mut gpus = job_with(Vec::new());
        gpus.plane = crate::protocol::GradientPlane::Nccl;
        gpus.plane_reason = "every rank of the 2 ranks has a GPU of its own".into();
        let text = render_jobs(&[gpus]);
        assert!(text.lines().nth(1).is_some_and(|l| l.ends_with("encrypted-tcp  nccl")), "{text}");
        assert!(text.contains("job 3: gradients on the nccl plane: every rank of the 2 ranks has a GPU"), "{text}");
    }

    #[test]
    fn the_members_table_shows_each_slots_device_what_it_uses_and_a_missing_nccl() {
        use crate::protocol::{ClusterStatus, DeviceLoad, MemberInfo, NodeLoad, SlotDevice};
        let h100 = |ordinal, nccl_missing: Option<&str>| SlotDevice::Cuda {
            ordinal,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: 80 << 30,
            nccl_missing: nccl_missing.map(str::to_owned),
        };
        let member = |name: &str, port: u16, slots, devices| MemberInfo {
            name: name.into(),
            addr: ([10, 0, 0, 1], port).into(),
            slots,
            dashboard: None,
            raft_listen: None,
            devices,
            load: None,
        };
        let status = ClusterStatus {
            node: "gpu-a".into(),
            controller: true,
            controller_addr: Some(([10, 0, 0, 1], 7400).into()),
            epoch: 3,
            members: vec![
                member("gpu-a", 7400, 2, vec![h100(0, None), h100(1, None)]),
                member("gpu-b", 7401, 1, vec![h100(3, Some("NCCL is installed only as /x/libnccl.so.2"))]),
                member("cpu-c", 7402, 2, Vec::new()),
            ],
            joining: Vec::new(),
            jobs: Vec::new(),
            refused_stale: 0,
            changes: Vec::new(),
        };
        let mut status = status;
        let gpu = |ordinal, used: u64, busy_percent| DeviceLoad {
            ordinal,
            memory_used_bytes: used,
            memory_total_bytes: 80 << 30,
            busy_percent,
        };
        status.members[0].load = Some(NodeLoad {
            rss_bytes: 3 << 29,
            cpu_percent: Some(25),
            devices: vec![gpu(0, 41 << 29, 87), gpu(1, 1 << 30, 0)],
            devices_unavailable: None,
        });
        status.members[1].load = Some(NodeLoad {
            rss_bytes: 1 << 30,
            cpu_percent: None,
            devices: Vec::new(),
            devices_unavailable: Some("NVML (libnvidia-ml.so.1) could not be loaded: a library error".into()),
        });
        let text = render_members(&status);
        let lines: Vec<&str> = text.lines().collect();
        let header = ["NODE", "ADDRESS", "SLOTS", "DEVICES", "IN", "USE", "ROLE", "DASHBOARD"];
        assert!(lines[0].split_whitespace().eq(header), "{text}");
        assert!(
            lines[1].contains("cuda:0 NVIDIA H100 80GB HBM3 (80 GiB), cuda:1 NVIDIA H100 80GB HBM3 (80 GiB)"),
            "{text}"
        );
        assert!(lines[1].contains("cuda:0 20.5/80 GiB 87%, cuda:1 1.0/80 GiB 0%, host 1.5 GiB 25% cpu"), "{text}");
        assert!(lines[2].contains("cuda:3 NVIDIA H100") && lines[2].contains(" host 1.0 GiB "), "{text}");
        assert!(!lines[2].contains("% cpu"), "no CPU share before a second sample: {text}");
        assert!(lines[3].split_whitespace().eq(["cpu-c", "10.0.0.1:7402", "2", "cpu", "-", "member", "-"]), "{text}");
        assert!(text.contains("gpu-b: no NCCL, gradients go through host memory: NCCL is installed only as"), "{text}");
        assert!(text.contains("gpu-b: no GPU figures: NVML (libnvidia-ml.so.1) could not be loaded"), "{text}");
    }
}

//! `troupe status` and `troupe job submit|status|cancel`: clients of a running cluster.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

use super::table::Table;
use crate::api::{Client, ClusterStatus, Job, JobInfo};
use crate::daemon::NodeConfig;

/// Which cluster to talk to, and with which certificate.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// A daemon's address (default: the `listen` address of --node-config).
    #[arg(long, value_name = "ADDR")]
    pub cluster: Option<SocketAddr>,
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
    async fn connect(&self) -> anyhow::Result<Client> {
        let node_config = self.node_config.clone().or_else(|| {
            let default = PathBuf::from("node.toml");
            default.exists().then_some(default)
        });
        let node = node_config.as_deref().map(NodeConfig::load).transpose()?;
        let addr = self
            .cluster
            .or(node.as_ref().map(|n| n.listen))
            .context("which cluster? pass --cluster ADDR (a daemon's address) or --node-config node.toml")?;
        let (certs, name) = match (&self.identity.certs, &self.identity.name, &node) {
            (Some(dir), Some(name), _) => (dir.clone(), name.clone()),
            (None, None, Some(n)) => (n.certs.clone(), n.name.clone()),
            (Some(dir), None, Some(n)) => (dir.clone(), n.name.clone()),
            (None, Some(name), Some(n)) => (n.certs.clone(), name.clone()),
            _ => bail!("which certificate? pass --certs DIR --as NAME (see `troupe cluster add-node`) or --node-config node.toml"),
        };
        let identity = NodeIdentity::load(&certs, &name)?;
        Client::connect(addr, &identity).await
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
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
    let role = if s.leader { "the controller" } else { "a member" };
    println!("cluster at epoch {}: {} member(s); answered by {} ({role})", s.epoch, s.members.len(), s.node);
    println!();
    let mut members = Table::new(&["NODE", "ADDRESS", "SLOTS", "ROLE"]);
    let controller = s.leader_addr;
    for m in &s.members {
        let role = if Some(m.addr) == controller { "controller" } else { "member" };
        members.row(vec![m.name.clone(), m.addr.to_string(), m.slots.to_string(), role.into()]);
    }
    for name in &s.joining {
        members.row(vec![name.clone(), "-".into(), "-".into(), "joining".into()]);
    }
    print!("{}", members.render());
    if !s.jobs.is_empty() {
        println!();
        print_jobs(&s.jobs);
    } else if !s.leader {
        println!("\n(jobs are listed by the controller{})", controller.map(|a| format!(" at {a}")).unwrap_or_default());
    }
    if s.refused_stale > 0 {
        println!("\nrefused stale-epoch messages: {}", s.refused_stale);
    }
}

fn print_jobs(jobs: &[JobInfo]) {
    let mut table = Table::new(&["JOB", "NAME", "STATE", "STEP", "WORLD", "EPOCH", "ATTEMPTS", "LOSS"]);
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
        ]);
    }
    print!("{}", table.render());
    for j in jobs.iter().filter(|j| j.reason.is_some()) {
        println!("job {}: {}", j.id, j.reason.as_deref().unwrap_or_default());
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum JobCommand {
    /// Submit a job config (TOML, as `troupe train --config`) and follow it until it ends.
    Submit {
        #[arg(value_name = "job.toml")]
        config: PathBuf,
        /// Return once submitted instead of following the job.
        #[arg(long)]
        detach: bool,
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
            JobCommand::Submit { config, detach, cluster } => {
                let job_config = JobConfig::from_file(&config)?;
                let name = config.file_stem().map_or("job".into(), |s| s.to_string_lossy().into_owned());
                let job = Job::new(job_config).name(name);
                let client = cluster.connect().await?;
                let mut handle = client.submit(job).await?;
                if cluster.json {
                    println!("{}", json!({ "event": "submitted", "job": handle.id() }));
                } else {
                    println!("submitted job {}", handle.id());
                }
                if detach {
                    handle.close().await;
                    return Ok(());
                }
                while let Some(event) = handle.next_event().await? {
                    println!("{}", serde_json::to_string(&event)?);
                }
                Ok(())
            }
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

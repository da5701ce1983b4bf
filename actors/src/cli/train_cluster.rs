//! `troupe train` on a cluster: an embedded local cluster of `--nodes` daemons (child processes on
//! loopback, torn down at the end, also on Ctrl-C; each serves its dashboard on a free loopback port, the
//! controller's URL printed), or a running cluster with `--cluster ADDR[,ADDR…]` (any of its daemons:
//! the client follows the controller, across a take-over too).

use std::time::Instant;

use anyhow::{bail, Context};
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

use super::follow::{conclude, follow, Mode, OnInterrupt, GOODBYE};
use super::train_args::TrainArgs;
use crate::api::{Client, DataPlane, Job, LocalCluster, LocalClusterOptions};
use crate::progress::{spinner, Reporter};
use crate::telemetry::RunDir;

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
    let mut dashboard = None;
    let (cluster, client) = match &args.cluster {
        Some(list) => {
            let addrs = parse_addrs(list)?;
            let (Some(certs), Some(name)) = (&args.identity.certs, &args.identity.name) else {
                bail!(
                    "--cluster {list}: which certificate? pass --certs DIR --as NAME (see `troupe cluster add-node`)"
                );
            };
            let identity = NodeIdentity::load(certs, name)?;
            (None, Client::connect_any(&addrs, &identity).await?)
        }
        None => {
            let binary = std::env::current_exe().context("locating the troupe binary")?;
            let started = Instant::now();
            let mut options = LocalClusterOptions::new(nodes);
            options.slots_per_node = args.slots_per_daemon(&config) as u32;
            options.torch_threads = config.train.torch_threads;
            options.telemetry.metrics_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
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
            dashboard = cluster.dashboard_url(0);
            if let Some(url) = &dashboard {
                // On stderr with --json: stdout is one JSON object per job event.
                let line = format!("troupe: dashboard on {url} (live while the job runs)");
                if args.json {
                    eprintln!("{line}");
                } else {
                    println!("{line}");
                }
            }
            let client = cluster.client().await?;
            (Some(cluster), client)
        }
    };
    let total = config.train.steps;
    let plane: DataPlane = args.data_plane.parse().map_err(anyhow::Error::msg)?;
    let mode = Mode::of(&config);
    let mut job = Job::new(config).name("train").data_plane(plane).trace(run_dir.is_some() || dashboard.is_some());
    if let Some(path) = &args.save_final {
        let path = std::path::absolute(path).with_context(|| format!("--save-final {}", path.display()))?;
        job = job.save_final(path);
    }
    let mut handle = client.submit(job).await?;
    let id = handle.id();
    let reporter = Reporter::new(args.json, 0, total, args.log_every).with_run_dir(run_dir);
    let started = Instant::now();
    let followed = follow(&mut handle, &reporter, &mode, Some(nodes), OnInterrupt::Cancel).await;
    let _ = tokio::time::timeout(GOODBYE, handle.close()).await;
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    conclude(reporter, followed?, started, Some(nodes), id, args.cluster.is_some())
}

/// `--cluster ADDR[,ADDR…]`: daemons' addresses (any members; the client follows the controller).
fn parse_addrs(list: &str) -> anyhow::Result<Vec<std::net::SocketAddr>> {
    list.split(',')
        .map(|a| {
            a.trim().parse().with_context(|| format!("--cluster {list}: {a:?} is not an address like 10.0.0.5:7400"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn cluster_takes_several_addresses_and_names_a_bad_one() {
        let addrs = super::parse_addrs("10.0.0.1:7400, 10.0.0.2:7400").unwrap();
        assert_eq!(addrs.len(), 2);
        let err = format!("{:#}", super::parse_addrs("10.0.0.1:7400,node-b").unwrap_err());
        assert!(err.contains("--cluster") && err.contains("\"node-b\" is not an address"), "{err}");
    }
}

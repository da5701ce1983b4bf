//! Shared bits of the runnable examples (see the files in this folder). An example's body lives here as
//! a function, so that the crate's tests run exactly what the example runs.

use std::path::Path;

use anyhow::{bail, Context};
use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_model::config::JobConfig;

/// Daemons of the job-API demo's local cluster.
pub const DEMO_NODES: usize = 2;

/// A model small enough to train a few steps in a second on two shared CPU cores.
pub fn small_config(steps: u64) -> JobConfig {
    JobConfig::small(steps)
}

/// One line per event, as the demo prints them.
pub fn describe(event: &JobEvent) -> String {
    match event {
        JobEvent::Started { world, epoch, from_step, attempt, data_plane, plane, .. } => {
            format!(
                "started    on {world} ranks at epoch {epoch}, from step {from_step} (attempt {attempt}, data plane {data_plane}, gradients on the {plane} plane)"
            )
        }
        JobEvent::Step { step, loss, lr, tokens_per_s, world, .. } => {
            format!("step {step:>5}  loss {loss:.4}  lr {lr:.2e}  {tokens_per_s:>8.0} tokens/s  ({world} ranks)")
        }
        JobEvent::Membership { epoch, world, changes } => {
            format!("membership changed: epoch {epoch}, {world} ranks: {}", changes.join("; "))
        }
        JobEvent::Recovered { step, epoch, world } => {
            format!("recovered  at step {step} on {world} ranks (epoch {epoch})")
        }
        JobEvent::Saved { path } => format!("saved      {}", path.display()),
        JobEvent::Finished { steps, final_loss } => match final_loss {
            Some(loss) => format!("finished   {steps} steps, final loss {loss:.4}"),
            None => format!("finished   {steps} steps"),
        },
        // Failed, Cancelled, and events added later.
        other => format!("{other:?}"),
    }
}

/// The job-API demo: starts an in-process local cluster of [`DEMO_NODES`] daemons, trains a small model
/// for `steps` steps on it, saves the final parameters under the directory `out`, prints every event as
/// it streams and returns them all (the terminal one last). The cluster is shut down also when the job
/// fails.
pub async fn job_api_demo(steps: u64, out: &Path) -> anyhow::Result<Vec<JobEvent>> {
    let cluster = LocalCluster::in_process(DEMO_NODES).await.context("starting the local cluster")?;
    println!("local cluster of {DEMO_NODES} daemons on loopback, controller {}", cluster.addr());
    let events = run_demo_job(&cluster, steps, out).await;
    cluster.shutdown().await;
    events
}

async fn run_demo_job(cluster: &LocalCluster, steps: u64, out: &Path) -> anyhow::Result<Vec<JobEvent>> {
    let job = Job::new(small_config(steps)).name("job-api-demo").save_final(out.join("final.safetensors"));
    let mut handle = cluster.client().await?.submit(job).await?;
    println!("submitted job {}", handle.id());
    let mut events = Vec::new();
    while let Some(event) = handle.next_event().await? {
        println!("{}", describe(&event));
        events.push(event);
    }
    handle.close().await;
    match events.last() {
        Some(last) if last.is_terminal() => Ok(events),
        _ => bail!("the job's event stream ended without a terminal event"),
    }
}

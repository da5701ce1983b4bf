//! `[elastic]` on real daemon processes: below `min_nodes` a job holds its last committed step and waits
//! for members; a node that returns within `wait_s` resumes it on the fault-free trajectory, and a wait
//! longer than `wait_s` fails it with a reason naming the keys.

mod common;

use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, JobHandle};
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;

fn config(steps: u64, min_nodes: usize, wait_s: u64) -> JobConfig {
    let mut config = JobConfig::small(steps);
    config.elastic.min_nodes = min_nodes;
    config.elastic.wait_s = wait_s;
    config
}

async fn next(job: &mut JobHandle) -> JobEvent {
    let event = tokio::time::timeout(Duration::from_secs(60), job.next_event()).await;
    event.expect("an event within 60 s").expect("the event stream").expect("the job ends with a terminal event")
}

/// Three daemons, `min_nodes = 3`: SIGKILL one mid-run. The job reports that it waits, commits nothing
/// while below three nodes, and when the node comes back (a new incarnation) it continues from the last
/// committed step — every step committed once, losses and final parameters equal to the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_min_nodes_a_job_waits_and_resumes_when_a_node_returns() {
    let dir = tempfile::tempdir().unwrap();
    let config = config(14, 3, 120);
    let mut cluster = common::processes(3).await;
    let out = dir.path().join("final.safetensors");
    let mut job = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut losses, mut killed, mut waiting, mut restarted) = (Vec::new(), false, false, false);
    let end = loop {
        let event = next(&mut job).await;
        match &event {
            JobEvent::Step { step, loss, world, .. } => {
                assert!(!waiting || restarted, "step {step} committed while waiting below min_nodes");
                assert_eq!(*world, 3, "every step runs on three ranks (min_nodes = 3)");
                losses.push(*loss);
                if *step == 4 && !killed {
                    common::signal(cluster.pid(2).unwrap(), "KILL");
                    killed = true;
                }
            }
            JobEvent::Waiting { nodes, min_nodes, wait_s } => {
                assert!(killed, "waiting before any node was lost: {event:?}");
                assert_eq!((*nodes, *min_nodes, *wait_s), (2, 3, 120));
                waiting = true;
                assert!(cluster.wait_exit(2, Duration::from_secs(10)).is_some(), "node-2 exits after SIGKILL");
                tokio::task::block_in_place(|| cluster.restart_node(2)).expect("node-2 restarts");
                restarted = true;
            }
            e if e.is_terminal() => break event,
            _ => {}
        }
    };
    assert!(matches!(end, JobEvent::Finished { steps: 14, .. }), "{end:?}");
    assert!(waiting && restarted, "the job waited for the node to return");

    tch::set_num_threads(1);
    let mut reference = Trainer::new(config.clone()).unwrap();
    let ref_losses: Vec<f64> = (0..config.train.steps).map(|_| reference.train_step().loss).collect();
    assert_eq!(losses.len(), ref_losses.len(), "one committed loss per step, none twice: {losses:?}");
    let diff = worst_loss_diff(&losses, &ref_losses);
    assert!(diff <= TOLERANCE, "losses differ from the reference by {diff:e}");
    let comparison =
        compare_params(reference.model.specs(), &common::saved_params(&out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

/// Two daemons, `min_nodes = 2`, `wait_s = 2`: after a SIGKILL nobody comes back, and the job fails once
/// it has waited 2 s, saying which keys to change — it does not hang, and it does not train on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_longer_than_wait_s_fails_the_job_naming_the_keys() {
    let config = config(1000, 2, 2);
    let cluster = common::processes(2).await;
    let mut job = cluster.client().await.unwrap().submit(Job::new(config)).await.unwrap();
    let mut waiting_since = None;
    let end = loop {
        let event = next(&mut job).await;
        match &event {
            JobEvent::Step { step: 3, world: 2, .. } if waiting_since.is_none() => {
                common::signal(cluster.pid(1).unwrap(), "KILL");
            }
            JobEvent::Step { world, .. } => assert_eq!(*world, 2, "no step below min_nodes"),
            JobEvent::Waiting { nodes: 1, min_nodes: 2, wait_s: 2 } => waiting_since = Some(std::time::Instant::now()),
            e if e.is_terminal() => break event,
            _ => {}
        }
    };
    let waited = waiting_since.expect("a waiting event before the failure").elapsed();
    let JobEvent::Failed { reason } = &end else { panic!("the job fails after its wait: {end:?}") };
    for needle in ["elastic.min_nodes = 2", "elastic.wait_s = 2 s", "add nodes"] {
        assert!(reason.contains(needle), "{needle:?} in the reason: {reason}");
    }
    assert!(waited >= Duration::from_millis(1500), "failed after {waited:?}, before wait_s");
    cluster.shutdown().await;
}

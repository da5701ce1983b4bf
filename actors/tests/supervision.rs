//! Supervision (docs/runtime-semantics.md, "Actors and supervision") in in-process daemons: a NodeActor
//! restarts a WorkerActor that panics, up to `RestartPolicy::max_restarts` within `window_ms`, then
//! escalates — the node stops. A worker restarted mid-job has lost its state; the job's next attempt
//! copies it from another rank and the run continues on the fault-free trajectory.

mod common;

use std::time::Duration;

use common::wait_for;
use ractor::{ActorRef, ActorStatus};
use troupe_actors::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};
use troupe_actors::daemon::Daemon;
use troupe_actors::node_config::restart::RestartPolicy;
use troupe_actors::runtime::worker::WorkerMsg;
use troupe_model::config::JobConfig;
use troupe_model::oracle::worst_loss_diff;
use troupe_model::Trainer;

/// How long a restart, or an escalation, may take to show (milliseconds are usual; the cores are shared).
const SUPERVISION_BOUND: Duration = Duration::from_secs(5);
/// Bound on the wait for any one job event.
const EVENT_TIMEOUT: Duration = Duration::from_secs(60);
const TOLERANCE: f64 = 1e-5;

/// The tests of this file share two CPU cores with other builds: one cluster at a time.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn small_config(steps: u64) -> JobConfig {
    JobConfig::small(steps)
}

async fn in_process(nodes: usize, restart: RestartPolicy) -> LocalCluster {
    let mut options = LocalClusterOptions::new(nodes);
    options.torch_threads = 1;
    options.restart = restart;
    LocalCluster::in_process_with(options).await.expect("local cluster starts")
}

/// Panics the worker of slot 0 and waits until the node's replacement for it is running; returns it.
async fn panic_and_wait_for_restart(daemon: &Daemon) -> ActorRef<WorkerMsg> {
    let old = daemon.worker(0).await.expect("a worker");
    old.cast(WorkerMsg::Panic("test".into())).unwrap();
    // ractor marks a spawned actor Running once its message loop has started, just after the spawn.
    let (new, _) = wait_for(SUPERVISION_BOUND, "the node to restart its worker", || async {
        daemon.worker(0).await.filter(|w| w.get_id() != old.get_id() && w.get_status() == ActorStatus::Running)
    })
    .await;
    assert_eq!(old.get_status(), ActorStatus::Stopped, "the panicked worker is gone");
    new
}

async fn changes(daemon: &Daemon) -> Vec<String> {
    daemon.status().await.expect("the node answers").changes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_panicking_worker_is_restarted_and_the_node_keeps_serving_jobs() {
    let _one = ONE_CLUSTER.lock().await;
    let cluster = in_process(1, RestartPolicy::default()).await;
    let daemon = cluster.daemon(0).unwrap();
    panic_and_wait_for_restart(daemon).await;

    let changes = changes(daemon).await;
    let restart = changes.iter().find(|c| c.contains("worker 0 failed")).unwrap_or_else(|| panic!("{changes:?}"));
    assert!(restart.contains("injected worker fault: test") && restart.ends_with("restart 1"), "{restart}");
    assert!(daemon.is_running());

    let job = cluster.client().await.unwrap().submit(Job::new(small_config(4))).await.unwrap();
    let (end, _) = tokio::time::timeout(EVENT_TIMEOUT, job.wait()).await.expect("the job ends").unwrap();
    assert!(matches!(end, JobEvent::Finished { steps: 4, .. }), "{end:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_worker_failing_more_than_max_restarts_within_the_window_stops_the_node_and_its_peers_drop_it() {
    let _one = ONE_CLUSTER.lock().await;
    let policy = RestartPolicy { max_restarts: 2, window_ms: 60_000 };
    let cluster = in_process(2, policy).await;
    let node_1 = cluster.daemon(1).unwrap();
    for restart in 1..=policy.max_restarts {
        panic_and_wait_for_restart(node_1).await;
        let changes = changes(node_1).await;
        assert!(changes.iter().any(|c| c.ends_with(&format!("restart {restart}"))), "{changes:?}");
    }
    assert!(node_1.is_running(), "{} restarts are allowed", policy.max_restarts);

    node_1.worker(0).await.unwrap().cast(WorkerMsg::Panic("test".into())).unwrap();
    let (_, took) =
        wait_for(SUPERVISION_BOUND, "the node to escalate and stop", || async { (!node_1.is_running()).then_some(()) })
            .await;
    eprintln!("node-1 stopped {:.0} ms after the failure that escalated", took.as_secs_f64() * 1e3);
    assert!(node_1.status().await.is_err(), "a stopped node answers nothing");
    let reason = node_1.stop_reason().expect("the escalation is recorded");
    assert!(reason.contains(&format!("failed {} times", policy.max_restarts + 1)), "{reason}");
    assert!(node_1.worker(0).await.is_none());

    let controller = cluster.daemon(0).unwrap();
    let (changes, took) = wait_for(SUPERVISION_BOUND, "the controller to drop node-1", || async {
        let status = controller.status().await.expect("the controller keeps running");
        (status.members.len() == 1).then_some(status.changes)
    })
    .await;
    eprintln!("the controller dropped node-1 {:.0} ms later: {:?}", took.as_secs_f64() * 1e3, changes.last());
    assert!(changes.last().is_some_and(|c| c.contains("node-1")), "{changes:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_worker_panicking_mid_job_is_restarted_and_the_job_recovers_from_the_other_rank() {
    let _one = ONE_CLUSTER.lock().await;
    const STEPS: u64 = 30;
    const PANIC_AFTER: u64 = 3;
    let config = small_config(STEPS);
    let cluster = in_process(2, RestartPolicy::default()).await;
    let node_1 = cluster.daemon(1).unwrap();
    let mut job = cluster.client().await.unwrap().submit(Job::new(config.clone())).await.unwrap();
    let mut events = Vec::new();
    while let Some(event) = tokio::time::timeout(EVENT_TIMEOUT, job.next_event()).await.expect("an event").unwrap() {
        if matches!(event, JobEvent::Step { step: PANIC_AFTER, .. }) {
            node_1.worker(0).await.unwrap().cast(WorkerMsg::Panic("test".into())).unwrap();
        }
        events.push(event);
    }
    job.close().await;
    let node_1_changes = changes(node_1).await;
    cluster.shutdown().await;

    assert!(node_1_changes.iter().any(|c| c.contains("worker 0 failed")), "{node_1_changes:?}");
    assert!(matches!(events.first(), Some(JobEvent::Started { world: 2, .. })), "{events:?}");
    let recovered: Vec<_> = events.iter().filter(|e| matches!(e, JobEvent::Recovered { .. })).collect();
    assert!(
        matches!(recovered[..], [JobEvent::Recovered { step, world: 2, .. }] if *step >= PANIC_AFTER),
        "one recovery on both ranks, from a step at or after the fault: {events:?}"
    );
    assert!(!events.iter().any(|e| matches!(e, JobEvent::Membership { .. })), "membership unchanged: {events:?}");
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: STEPS, .. })), "{events:?}");
    let (numbers, losses): (Vec<u64>, Vec<f64>) = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Step { step, loss, .. } => Some((*step, *loss)),
            _ => None,
        })
        .unzip();
    assert_eq!(numbers, (1..=STEPS).collect::<Vec<_>>(), "every step committed once: {events:?}");
    eprintln!("panicked after step {PANIC_AFTER}; {recovered:?}");

    // The restarted rank copied the committed state: the run stayed on the fault-free trajectory.
    tch::set_num_threads(1);
    let mut reference = Trainer::new(config).unwrap();
    let reference: Vec<f64> = (0..STEPS).map(|_| reference.train_step().loss).collect();
    let diff = worst_loss_diff(&losses, &reference);
    assert!(diff <= TOLERANCE, "losses differ from the reference by {diff:e}: {losses:?} vs {reference:?}");
}

//! The job-API example as a user relies on it: the event stream of a job on an in-process local cluster
//! of two daemons (started, one step event per committed step, saved, finished), and cancellation.

use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, JobState, LocalCluster};
use troupe_examples::{job_api_demo, small_config, DEMO_NODES};

const STEPS: u64 = 10;
/// Bound on the wait for any one event (a step takes milliseconds; the first one includes the mesh).
const EVENT_TIMEOUT: Duration = Duration::from_secs(60);

/// The tests of this file share two CPU cores with other builds: one cluster at a time.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn steps(events: &[JobEvent]) -> Vec<(u64, f64)> {
    events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Step { step, loss, .. } => Some((*step, *loss)),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn the_demo_streams_started_a_step_per_step_saved_and_finished() {
    let _one = ONE_CLUSTER.lock().await;
    let out = tempfile::tempdir().unwrap();
    let events = job_api_demo(STEPS, out.path()).await.unwrap();

    assert!(matches!(events.first(), Some(JobEvent::Started { world: DEMO_NODES, from_step: 0, .. })), "{events:?}");
    let steps = steps(&events);
    let numbers: Vec<u64> = steps.iter().map(|s| s.0).collect();
    assert_eq!(numbers, (1..=STEPS).collect::<Vec<_>>(), "one step event per step, in order: {events:?}");
    assert!(steps.iter().all(|s| s.1.is_finite()), "finite losses: {steps:?}");
    let (first, last) = (steps[0].1, steps[steps.len() - 1].1);
    assert!(last < first, "the loss went down: {first} -> {last}");

    let saved: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Saved { path } => Some(path.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(saved, [out.path().join("final.safetensors")], "rank 0 saved once, where asked: {events:?}");
    assert!(saved[0].is_file(), "{} exists", saved[0].display());
    assert!(
        matches!(events.last(), Some(JobEvent::Finished { steps: STEPS, final_loss: Some(l) }) if *l == last),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_job_cancelled_through_its_handle_ends_with_cancelled() {
    let _one = ONE_CLUSTER.lock().await;
    let cluster = LocalCluster::in_process(DEMO_NODES).await.unwrap();
    let job = Job::new(small_config(1_000)).name("cancelled");
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let id = handle.id();
    let mut events = Vec::new();
    let mut cancelled = false;
    while let Some(event) = tokio::time::timeout(EVENT_TIMEOUT, handle.next_event()).await.expect("an event").unwrap() {
        if !cancelled && matches!(event, JobEvent::Step { .. }) {
            handle.cancel().await.unwrap();
            cancelled = true;
        }
        events.push(event);
    }
    assert!(cancelled, "no step before the end: {events:?}");
    assert_eq!(events.last(), Some(&JobEvent::Cancelled), "{events:?}");
    assert_eq!(events.iter().filter(|e| e.is_terminal()).count(), 1, "{events:?}");
    let committed = steps(&events).len() as u64;
    assert!(committed < 1_000, "cancelled long before the end: {committed} steps");
    handle.close().await;

    let mut client = cluster.client().await.unwrap();
    let info = client.job_status(id).await.unwrap();
    assert_eq!(info.state, JobState::Cancelled, "{info:?}");
    assert_eq!(info.step, committed, "no step committed after the cancel: {info:?}");
    client.close().await;
    cluster.shutdown().await;
}

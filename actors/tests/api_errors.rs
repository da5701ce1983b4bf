//! The job API's errors are variants a program matches: a config the controller refuses names its key,
//! a daemon that is not there is unreachable, a job that fails or is cancelled says so with its id and
//! reason, and an unknown job or node is named. A real in-process cluster of one daemon.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use troupe_actors::api::{Client, Error, Job, JobEvent, LocalCluster};
use troupe_cluster::NodeIdentity;
use troupe_model::config::JobConfig;

/// Long enough for every case here on a loaded 2-core machine; a hang fails instead of blocking.
const BOUND: Duration = Duration::from_secs(60);

async fn bounded<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f).await.unwrap_or_else(|_| panic!("{what}: no answer within {BOUND:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_failures_cancellations_and_unknown_jobs_are_variants_to_match() {
    let cluster = LocalCluster::in_process(1).await.unwrap();

    // A config the controller refuses: the key, and the controller's message unchanged.
    let refused = bounded("submit", cluster.client().await.unwrap().submit(Job::new(JobConfig::small(0)))).await;
    match refused {
        Err(Error::Refused { key, message }) => {
            assert_eq!(key.as_deref(), Some("train.steps"), "{message}");
            assert!(message.starts_with("job config: config key `train.steps` = 0"), "{message}");
        }
        other => panic!("a job of 0 steps is refused naming train.steps: {:?}", other.map(|h| h.id())),
    }

    // A job that fails: it needs two nodes, the cluster has one, and it waits for them 1 s at most.
    let job = Job::new(JobConfig::small(5)).name("needs-two").elastic(2, 0, 1);
    let handle = bounded("submit", cluster.client().await.unwrap().submit(job)).await.unwrap();
    let failed = handle.id();
    match bounded("the failing job", handle.wait()).await {
        Err(Error::JobFailed { job, reason }) => {
            assert_eq!(job, failed);
            assert!(reason.contains("elastic.min_nodes = 2") && reason.contains("elastic.wait_s = 1 s"), "{reason}");
        }
        other => panic!("the job fails: {other:?}"),
    }
    // Watched after its end, it ends the same way, from its status.
    let watched = bounded("watch", cluster.client().await.unwrap().watch(failed)).await.unwrap();
    let again = bounded("wait", watched.wait()).await;
    assert!(matches!(&again, Err(Error::JobFailed { job, reason }) if *job == failed && reason.contains("min_nodes")));

    // A job cancelled while it runs.
    let mut handle =
        bounded("submit", cluster.client().await.unwrap().submit(Job::new(JobConfig::small(100_000)))).await.unwrap();
    let cancelled = handle.id();
    loop {
        match bounded("the first step", handle.next_event()).await.unwrap() {
            Some(JobEvent::Step { .. }) => break,
            Some(event) => assert!(!event.is_terminal(), "the job runs: {event:?}"),
            None => panic!("the event stream ended"),
        }
    }
    bounded("cancel", handle.cancel()).await.unwrap();
    match bounded("the cancelled job", handle.wait()).await {
        Err(Error::Cancelled { job }) => assert_eq!(job, cancelled),
        other => panic!("the job is cancelled: {other:?}"),
    }

    // A job the cluster never had, and a node the local cluster does not have.
    let mut client = cluster.client().await.unwrap();
    let unknown = bounded("job status", client.job_status(999)).await;
    assert!(matches!(unknown, Err(Error::NoSuchJob { job: 999 })), "{unknown:?}");
    let message = unknown.unwrap_err().to_string();
    assert_eq!(message, "no job 999 on this cluster (see `troupe status`)");
    assert!(matches!(bounded("cancel", client.cancel(999)).await, Err(Error::NoSuchJob { job: 999 })));
    client.close().await;
    assert!(matches!(cluster.client_to(7).await, Err(Error::NoSuchNode { index: 7, .. })));

    cluster.shutdown().await;
}

/// The threads of this process whose name starts with `prefix` (Linux truncates names to 15 bytes).
fn threads_named(prefix: &str) -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task lists this process's threads");
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// A daemon drained while its job computes aborts the attempt and waits for the step in libtorch to end:
/// once the drain returns no attempt thread runs, so a process exiting after it cannot tear libtorch down
/// under a step (a crash at exit, seen once before drains waited).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_returns_once_the_step_in_flight_has_left_libtorch() {
    let cluster = LocalCluster::in_process(1).await.unwrap();
    // gpt-tiny of 16 blocks, one micro-batch of the whole batch on one thread: most of a second of
    // libtorch with no await point, long beside the drain itself (tens of milliseconds).
    let mut config = JobConfig::default();
    config.model.n_layers = 16;
    config.train.steps = 100_000;
    config.train.micro_batch = config.train.global_batch;
    config.train.torch_threads = 1;
    let mut handle = bounded("submit", cluster.client().await.unwrap().submit(Job::new(config))).await.unwrap();
    let mut steps = 0;
    while steps < 2 {
        match bounded("a step", handle.next_event()).await.unwrap() {
            Some(JobEvent::Step { .. }) => steps += 1,
            Some(event) => assert!(!event.is_terminal(), "the job runs: {event:?}"),
            None => panic!("the event stream ended"),
        }
    }
    assert!(threads_named("troupe-attempt") >= 1, "the job's attempt computes on its thread");
    bounded("shutdown", cluster.shutdown()).await;
    // The attempt's thread has ended; a thread it started (named after it) may take a moment longer.
    // Without the wait the step goes on for most of a second after the drain.
    let deadline = std::time::Instant::now() + Duration::from_millis(50);
    while threads_named("troupe-attempt") > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(threads_named("troupe-attempt"), 0, "the drain returned while the attempt still computed");
}

/// Nothing listens on the port: `Unreachable`, with the address, and the message says what to check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_where_no_daemon_listens_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    troupe_cluster::init_cluster(dir.path()).unwrap();
    troupe_cluster::add_node("client", dir.path()).unwrap();
    let identity = NodeIdentity::load(dir.path(), "client").unwrap();
    let free: SocketAddr = UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap(); // closed again here
    let Err(error) = bounded("connect", Client::connect(free, &identity)).await else {
        panic!("nothing listens at {free}, yet it connected")
    };
    let Error::Unreachable { addr, .. } = &error else { panic!("unreachable: {error:?}") };
    assert_eq!(*addr, free);
    let message = error.to_string();
    assert!(message.contains(&free.to_string()) && message.contains("is it running?"), "{message}");
    assert!(std::error::Error::source(&error).is_some(), "the transport's error is its cause");
}

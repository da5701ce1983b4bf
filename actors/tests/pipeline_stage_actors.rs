//! A pipeline rank on the cluster runs its device as a `StageActor` linked under its WorkerActor: the
//! actor appears as the supervisor's child when the attempt's state is in place, computes the steps (the
//! same as the single-process reference), stops when the attempt hands its state back, and when it dies
//! mid-attempt the rank's next step fails, its state is reported lost, and the supervisor lives on.
//!
//! Two ranks (pp = 2) over the in-memory transport in one runtime, driven through `StepEngine` as the
//! worker's step loop drives them; a small recording actor stands in for the WorkerActor.

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use troupe_actors::engine::pipeline::PipelineReplica;
use troupe_actors::engine::{CommittedState, EngineError, StepEngine};
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::Trainer;

#[path = "common/supervisor.rs"]
mod supervisor;
use supervisor::{count, eventually, Events, Seen};

fn job() -> JobConfig {
    let mut config = JobConfig::small(3);
    config.model.n_layers = 2;
    config.parallel.pp = 2;
    config.train.global_batch = 4;
    config.train.micro_batch = 2;
    config
}

fn replicas(config: &JobConfig, supervisor: &ActorRef<()>) -> Vec<PipelineReplica<MemoryTransport>> {
    let collective = CollectiveConfig::from(&TransportConfig::default());
    MemoryTransport::mesh(2, 1024)
        .into_iter()
        .map(|t| {
            let comm = Communicator::new(Arc::new(t), 0, 1, collective.clone());
            let state = CommittedState::Full(Box::new(Trainer::new(config.clone()).unwrap()));
            PipelineReplica::adopt(state, comm, collective.clone(), Some(supervisor.get_cell()))
        })
        .collect()
}

async fn sync(ranks: &mut [PipelineReplica<MemoryTransport>]) {
    let [a, b] = ranks else { unreachable!() };
    let (x, y) = tokio::join!(a.sync(None), b.sync(None));
    x.unwrap();
    y.unwrap();
}

async fn step(ranks: &mut [PipelineReplica<MemoryTransport>]) -> Result<f64, EngineError> {
    let [a, b] = ranks else { unreachable!() };
    let (x, y) = tokio::join!(a.reduce(), b.reduce());
    let (x, y) = (x?, y?);
    let loss = x.loss;
    a.apply(x).await;
    b.apply(y).await;
    Ok(loss)
}

/// Two ranks under a recording supervisor, synced, after one step.
async fn after_one_step() -> (ActorRef<()>, Events, Vec<PipelineReplica<MemoryTransport>>) {
    let (supervisor, seen) = supervisor::spawn().await;
    let mut ranks = replicas(&job(), &supervisor);
    sync(&mut ranks).await;
    step(&mut ranks).await.unwrap();
    (supervisor, seen, ranks)
}

#[tokio::test(flavor = "current_thread")]
async fn stage_actors_live_under_the_worker_for_the_attempt_and_compute_the_reference() {
    let config = job();
    let mut reference = Trainer::new(config.clone()).unwrap();
    let (supervisor, seen) = supervisor::spawn().await;
    let mut ranks = replicas(&config, &supervisor);
    assert!(supervisor.get_children().is_empty(), "no stage before the state is in place");
    sync(&mut ranks).await;
    assert_eq!(supervisor.get_children().len(), 2, "one stage actor per rank, linked under the worker");
    assert_eq!(ranks.iter().map(|r| r.device()).collect::<Vec<_>>(), vec![Some(0), Some(1)]);
    for i in 0..3 {
        let loss = step(&mut ranks).await.unwrap();
        let want = reference.train_step().loss;
        assert!((loss - want).abs() <= 1e-5 * want.abs(), "step {i}: {loss} vs the reference's {want}");
        assert_eq!(ranks[0].trainer().step, i + 1, "the trainer mirrors the stage's counters");
    }
    for rank in ranks {
        let state = rank.into_state().await.expect("the state comes back from the actor");
        assert_eq!(state.step(), 3);
    }
    eventually(&seen, |s| count(s, Seen::Terminated) == 2).await;
    assert!(supervisor.get_children().is_empty(), "the actors stop with their attempt");
    assert_eq!(count(&seen.lock().unwrap(), Seen::Failed), 0);
    supervisor.stop(None);
}

#[tokio::test(flavor = "current_thread")]
async fn a_stage_actor_that_dies_fails_its_rank_and_loses_its_state_but_not_the_supervisor() {
    let (supervisor, seen, mut ranks) = after_one_step().await;
    // Rank 1's device dies (as a panic in the stage would end it).
    let dying = ranks[1].stage_actor().expect("synced");
    assert!(supervisor.get_children().iter().any(|c| c.get_id() == dying.get_id()), "it is the worker's child");
    dying.kill();
    eventually(&seen, |s| count(s, Seen::Terminated) >= 1).await;
    // Its next step fails at once (rank 0's would fail on its receive from the dead device).
    let err = ranks[1].reduce().await.expect_err("the dead stage cannot step");
    assert!(err.to_string().contains("stage actor"), "{err}");
    let mut ranks = ranks.into_iter();
    let survivor = ranks.next().unwrap();
    let lost = ranks.next().unwrap();
    assert!(lost.into_state().await.is_none(), "the dead device's state is gone");
    assert_eq!(survivor.into_state().await.map(|s| s.step()), Some(1), "the other rank keeps step 1");
    eventually(&seen, |s| count(s, Seen::Terminated) == 2).await;
    assert!(supervisor.get_cell().get_status() == ractor::ActorStatus::Running, "the supervisor lives on");
    supervisor.stop(None);
}

#[tokio::test(flavor = "current_thread")]
async fn an_abandoned_step_frees_the_stage_at_once_and_keeps_its_committed_state() {
    let (supervisor, seen, mut ranks) = after_one_step().await;
    // Rank 1 never takes part in step 2: rank 0's device waits on it (for 60 s, the receive timeout),
    // until the worker abandons the step, as on `Abort`.
    let waited = tokio::time::timeout(Duration::from_millis(300), ranks[0].reduce()).await;
    assert!(waited.is_err(), "rank 0 cannot finish the step alone");
    let started = std::time::Instant::now();
    let mut ranks = ranks.into_iter();
    let state = ranks.next().unwrap().into_state().await.expect("the state comes back");
    assert!(started.elapsed() < Duration::from_secs(5), "waited {:?} behind the abandoned step", started.elapsed());
    assert_eq!(state.step(), 1, "the committed step, nothing of the abandoned one");
    assert_eq!(ranks.next().unwrap().into_state().await.map(|s| s.step()), Some(1));
    eventually(&seen, |s| count(s, Seen::Terminated) == 2).await;
    assert_eq!(count(&seen.lock().unwrap(), Seen::Failed), 0, "abandoning a step fails no actor");
    supervisor.stop(None);
}

//! Durable checkpoints of cluster jobs: rank 0 writes one after committed steps; a job whose checkpoint
//! directory holds one continues from it; and when every rank holding the committed state is lost, the
//! job rolls back to the latest checkpoint and still lands on the reference trajectory.

mod common;

use std::time::Duration;

use tch::Tensor;
use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_actors::runtime::worker::WorkerMsg;
use troupe_model::config::JobConfig;
use troupe_model::oracle::compare_params;
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;

fn config(steps: u64, dir: &std::path::Path) -> JobConfig {
    let mut config = JobConfig::small(steps);
    // A schedule that does not depend on `steps`, so a run extended from 6 to 10 steps follows the same
    // learning rates as one of 10 (decay_steps = 0 would end the cosine at each run's own `steps`).
    config.train.decay_steps = 10;
    config.checkpoint.dir = Some(dir.to_owned());
    config.checkpoint.every_steps = 3;
    config.checkpoint.keep_last = 2;
    config
}

fn reference_params(config: &JobConfig) -> Trainer {
    tch::set_num_threads(1);
    let mut reference = config.clone();
    reference.checkpoint.dir = None;
    let mut trainer = Trainer::new(reference).unwrap();
    while trainer.step < config.train.steps {
        trainer.train_step();
    }
    trainer
}

fn saved(path: &std::path::Path, reference: &Trainer) -> Vec<Tensor> {
    let mut saved = Tensor::read_safetensors(path).unwrap();
    reference
        .model
        .named_params()
        .map(|(name, _)| saved.swap_remove(saved.iter().position(|(n, _)| n == name).unwrap()).1)
        .collect()
}

async fn run_to_end(cluster: &LocalCluster, job: Job) -> Vec<JobEvent> {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let mut events = Vec::new();
    while let Some(e) = tokio::time::timeout(Duration::from_secs(60), handle.next_event()).await.unwrap().unwrap() {
        events.push(e);
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_continues_from_the_checkpoints_of_an_earlier_run() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let first = run_to_end(&cluster, Job::new(config(6, &ckpt))).await;
    let steps: Vec<u64> = first
        .iter()
        .filter_map(|e| if let JobEvent::Checkpoint { step, .. } = e { Some(*step) } else { None })
        .collect();
    assert_eq!(steps, vec![3, 6], "every 3 steps and at the end: {first:?}");
    assert!(matches!(first.last(), Some(JobEvent::Finished { steps: 6, .. })));
    let kept: Vec<_> = std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(kept.len(), 2, "keep_last = 2: {kept:?}");

    // The same job with more steps continues from step 6, and ends where one uninterrupted run ends.
    let out = dir.path().join("final.safetensors");
    let config10 = config(10, &ckpt);
    let second = run_to_end(&cluster, Job::new(config10.clone()).save_final(&out)).await;
    assert!(matches!(second[0], JobEvent::Started { from_step: 6, world: 2, .. }), "{second:?}");
    let reference = reference_params(&config10);
    let comparison = compare_params(reference.model.specs(), &saved(&out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_every_copy_of_the_state_rolls_back_to_the_checkpoint_and_keeps_the_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let out = dir.path().join("final.safetensors");
    let config = config(12, &ckpt);
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut crashed, mut rolled_back) = (false, None);
    while let Some(event) = tokio::time::timeout(Duration::from_secs(60), handle.next_event()).await.unwrap().unwrap() {
        match event {
            JobEvent::Step { step, .. } if step >= 4 && !crashed => {
                // Both workers fail at once: every in-memory copy of the committed state is gone.
                for i in 0..2 {
                    cluster.daemon(i).unwrap().worker(0).await.unwrap().cast(WorkerMsg::Panic("test".into())).unwrap();
                }
                crashed = true;
            }
            JobEvent::RolledBack { from_step, to_step } => rolled_back = Some((from_step, to_step)),
            JobEvent::Finished { steps, .. } => assert_eq!(steps, 12),
            JobEvent::Failed { reason } => panic!("the job failed: {reason}"),
            _ => {}
        }
    }
    let (from, to) = rolled_back.expect("a rollback");
    assert!(to > 0 && to % 3 == 0 && from > to, "rolled back from {from} to a checkpoint (every 3 steps): {to}");
    let reference = reference_params(&config);
    let comparison = compare_params(reference.model.specs(), &saved(&out, &reference), &reference.param_values());
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

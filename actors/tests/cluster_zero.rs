//! ZeRO-1/2/3 jobs on the daemon runtime: the oracle (DESIGN.md §4) on daemon processes; a SIGKILLed daemon
//! costs no state because every shard has a buddy copy in memory (no rollback, same trajectory); losing a
//! rank and its buddy rolls back to the checkpoint (or fails, naming the cause, without one); checkpoints
//! of sharded jobs hold the whole state and load in DDP jobs and back.

mod common;

use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, JobHandle, LocalCluster};
use troupe_actors::runtime::worker::WorkerMsg;
use troupe_model::checkpoint::{Manifest, ShardMode};
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;
/// Longest wait for the next event of a job.
const EVENT_TIMEOUT: Duration = Duration::from_secs(60);

fn config(steps: u64, shard: &str) -> JobConfig {
    let mut config = JobConfig::small(steps);
    config.parallel.shard = shard.into();
    config
}

fn reference(config: &JobConfig) -> (Vec<f64>, Trainer) {
    tch::set_num_threads(1);
    let mut config = config.clone();
    config.checkpoint.dir = None;
    config.parallel.shard = "none".into();
    let mut trainer = Trainer::new(config.clone()).unwrap();
    let losses = (0..config.train.steps).map(|_| trainer.train_step().loss).collect();
    (losses, trainer)
}

/// Per-step losses (one per committed step, in order) and the saved final parameters equal the reference.
fn check(config: &JobConfig, losses: Option<&[f64]>, final_params: &Path, what: &str) {
    let (ref_losses, ref_trainer) = reference(config);
    if let Some(losses) = losses {
        assert_eq!(losses.len(), ref_losses.len(), "{what}: one committed loss per step");
        let diff = worst_loss_diff(losses, &ref_losses);
        assert!(diff <= TOLERANCE, "{what}: losses differ by {diff:e}");
    }
    let params = common::saved_params(final_params, &ref_trainer);
    let comparison = compare_params(ref_trainer.model.specs(), &params, &ref_trainer.param_values());
    eprintln!("{what}: params {comparison:?}");
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
}

async fn next(handle: &mut JobHandle) -> Option<JobEvent> {
    tokio::time::timeout(EVENT_TIMEOUT, handle.next_event()).await.expect("an event within the timeout").unwrap()
}

async fn run_to_end(cluster: &LocalCluster, job: Job) -> Vec<JobEvent> {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let mut events = Vec::new();
    while let Some(e) = next(&mut handle).await {
        events.push(e);
    }
    events
}

fn losses(events: &[JobEvent]) -> Vec<f64> {
    events.iter().filter_map(|e| if let JobEvent::Step { loss, .. } = e { Some(*loss) } else { None }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero1_zero2_and_zero3_on_two_daemon_processes_equal_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(2).await;
    for shard in ["zero1", "zero2", "zero3"] {
        let config = config(6, shard);
        let out = dir.path().join(format!("{shard}.safetensors"));
        let events = run_to_end(&cluster, Job::new(config.clone()).save_final(&out)).await;
        assert!(matches!(events.first(), Some(JobEvent::Started { world: 2, .. })), "{shard}: {events:?}");
        assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 6, .. })), "{shard}: {events:?}");
        check(&config, Some(&losses(&events)), &out, shard);
    }
    cluster.shutdown().await;
}

/// Issue 7's in-memory replicas: a zero2 (then a zero3) job on 3 daemons loses one to SIGKILL mid-run.
/// Its shard lives on in its buddy's copy, so the survivors reshard to a world of 2 and go on from the last
/// committed step — no rollback (the job has no checkpoint directory to roll back to) — on the fault-free
/// trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_daemon_of_a_zero2_or_zero3_job_costs_no_state_and_no_rollback() {
    for shard in ["zero2", "zero3"] {
        sigkill_costs_no_rollback(shard).await;
    }
}

async fn sigkill_costs_no_rollback(shard: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = config(12, shard);
    let cluster = common::processes(3).await;
    let out = dir.path().join("final.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut events, mut killed) = (Vec::new(), false);
    while let Some(event) = next(&mut handle).await {
        if let (JobEvent::Step { step: 4, .. }, false) = (&event, killed) {
            common::signal(cluster.pid(2).unwrap(), "KILL");
            killed = true;
        }
        events.push(event);
    }
    assert!(killed, "{events:?}");
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 12, .. })), "{events:#?}");
    assert!(!events.iter().any(|e| matches!(e, JobEvent::RolledBack { .. })), "no rollback: {events:#?}");
    assert!(events.iter().any(|e| matches!(e, JobEvent::Recovered { world: 2, .. })), "{events:#?}");
    check(&config, Some(&losses(&events)), &out, &format!("{shard}, 3 ranks, one SIGKILLed"));
    cluster.shutdown().await;
}

/// Fails the workers of daemons `which` once a step past a durable checkpoint (every `every` steps) has
/// committed (or, with `every` 0, once step 3 has); returns the events to the end.
async fn crash_workers_mid_job(cluster: &LocalCluster, job: Job, which: &[usize], every: u64) -> Vec<JobEvent> {
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let (mut events, mut durable, mut crashed) = (Vec::new(), 0, false);
    while let Some(event) = next(&mut handle).await {
        match &event {
            JobEvent::Checkpoint { step, .. } => durable = durable.max(*step),
            JobEvent::Step { step, .. }
                if !crashed && (if every > 0 { durable >= every && step % every != 0 } else { *step >= 3 }) =>
            {
                for &i in which {
                    let worker = cluster.daemon(i).unwrap().worker(0).await.unwrap();
                    worker.cast(WorkerMsg::Panic("test: rank and buddy lost".into())).unwrap();
                }
                crashed = true;
            }
            _ => {}
        }
        events.push(event);
    }
    assert!(crashed, "{events:#?}");
    events
}

/// Ranks 1 and 2 of 3 lose their state together (their workers fail and restart empty): shard 2 was held
/// by rank 2 and its buddy copy by rank 1, so the state of the last committed step is incomplete. With a
/// checkpoint directory the job rolls back to the checkpoint and keeps the trajectory; without one it
/// fails and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_rank_and_its_buddy_rolls_back_to_the_checkpoint_or_fails_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::in_process(3).await.unwrap();
    // Steps of this model take milliseconds: enough of them that the crash lands before the end.
    let mut config = config(30, "zero1");
    config.checkpoint.dir = Some(dir.path().join("ckpt"));
    config.checkpoint.every_steps = 5;
    let out = dir.path().join("final.safetensors");
    let events = crash_workers_mid_job(&cluster, Job::new(config.clone()).save_final(&out), &[1, 2], 5).await;
    let rolled_back = events.iter().find_map(|e| match e {
        JobEvent::RolledBack { from_step, to_step } => Some((*from_step, *to_step)),
        _ => None,
    });
    let recovered = events.iter().any(|e| matches!(e, JobEvent::Recovered { .. }));
    match rolled_back {
        Some((from, to)) => assert!(to % 5 == 0 && from > to, "rolled back from {from} to a checkpoint: {to}"),
        // The events trail the job: on a loaded machine the crash can land on a checkpointed step.
        None => assert!(recovered, "a rollback or a recovery: {events:#?}"),
    }
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 30, .. })), "{events:#?}");
    check(&config, None, &out, "zero1 after losing a rank and its buddy");

    config.checkpoint.dir = None;
    let events = crash_workers_mid_job(&cluster, Job::new(config), &[1, 2], 0).await;
    let Some(JobEvent::Failed { reason }) = events.last() else { panic!("the job fails: {events:#?}") };
    assert!(reason.contains("was lost") && reason.contains("checkpoint.dir"), "{reason}");
    cluster.shutdown().await;
}

/// A checkpoint of a sharded job holds the whole state (gathered to rank 0): a DDP job continues from a
/// zero2 job's checkpoint, a zero3 job from that DDP job's, a DDP job from the zero3 job's and a zero1
/// job from that one's, landing where one uninterrupted run lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_of_zero_and_ddp_jobs_load_in_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let mut last = None;
    let phases = [(4, "zero2", 0), (8, "none", 4), (12, "zero3", 8), (16, "none", 12), (20, "zero1", 16)];
    for (steps, shard, from) in phases {
        let mut config = config(steps, shard);
        // A schedule that does not depend on `steps`, so the runs follow one run's learning rates.
        config.train.decay_steps = 20;
        config.checkpoint.dir = Some(ckpt.clone());
        let out = dir.path().join(format!("{shard}-{steps}.safetensors"));
        let events = run_to_end(&cluster, Job::new(config.clone()).save_final(&out)).await;
        assert!(
            matches!(events.first(), Some(JobEvent::Started { from_step, .. }) if *from_step == from),
            "{shard} starts from step {from}: {events:?}"
        );
        assert!(matches!(events.last(), Some(JobEvent::Finished { .. })), "{shard}: {events:?}");
        let (step, newest) = troupe_model::checkpoint::step_dirs(&ckpt).pop().unwrap();
        let manifest: Manifest =
            serde_json::from_str(&std::fs::read_to_string(newest.join("manifest.json")).unwrap()).unwrap();
        let mode = match shard {
            "zero1" => ShardMode::Zero1,
            "zero2" => ShardMode::Zero2,
            "zero3" => ShardMode::Zero3,
            _ => ShardMode::Ddp,
        };
        assert_eq!((step, manifest.layout.shard_mode, manifest.layout.dp), (steps, mode, 2), "{shard}");
        last = Some((config, out));
    }
    let (config, out) = last.unwrap();
    check(&config, None, &out, "zero2 → ddp → zero3 → ddp → zero1 through checkpoints");
    cluster.shutdown().await;
}

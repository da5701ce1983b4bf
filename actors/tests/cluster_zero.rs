//! ZeRO-1/2/3 jobs on the daemon runtime: the oracle (DESIGN.md §4) on daemon processes; a SIGKILLed daemon
//! costs no state because every shard has a buddy copy in memory (no rollback, same trajectory); losing a
//! rank and its buddy rolls back to the checkpoint (or fails, naming the cause, without one); checkpoints
//! of sharded jobs hold the whole state and load in DDP jobs and back; each rank's `Usage` (what it holds
//! and sends) agrees with an independent count.

mod common;

use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, JobHandle, LocalCluster};
use troupe_actors::protocol::{CollectiveKind, GroupKind, RankUsage};
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

/// The one `Usage` event of a job run to its end on `cluster` (its attempt's second step), by rank.
async fn usage_of(cluster: &LocalCluster, config: &JobConfig) -> Vec<RankUsage> {
    let events = run_to_end(cluster, Job::new(config.clone())).await;
    assert!(matches!(events.last(), Some(JobEvent::Finished { .. })), "{events:?}");
    let mut told = events.into_iter().filter_map(|e| match e {
        JobEvent::Usage { attempt: 1, step: 2, ranks } => Some(ranks),
        JobEvent::Usage { .. } => panic!("one usage event, at the attempt's second step: {e:?}"),
        _ => None,
    });
    let ranks = told.next().expect("a usage event");
    assert!(told.next().is_none(), "one usage event");
    ranks
}

/// What each rank of a DDP or ZeRO job says it holds and sends, against an independent count: the
/// model's parameter count cut into the balanced shards, and a two-rank group's traffic (an all-reduce
/// of N values sends N from each rank, an all-gather this rank's chunk, a reduce-scatter the other's).
/// Adafactor's state is at most a tenth of AdamW's moments, the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rank_reports_what_it_holds_and_sends_under_ddp_and_every_zero_stage() {
    use CollectiveKind::*;
    let cluster = LocalCluster::in_process(2).await.unwrap();
    let n = JobConfig::small(1).model.param_count();
    let f32s = |elements: usize| 4 * elements as u64;
    let chunk = |rank| troupe_kernels::balanced_range(n, 2, rank).len();
    let sent = |u: &RankUsage, kind| u.sent_by(GroupKind::Data, kind);
    for shard in ["none", "zero1", "zero2", "zero3"] {
        let usage = usage_of(&cluster, &config(3, shard)).await;
        eprintln!("{shard}: {}", troupe_actors::protocol::describe_usage(2, &usage));
        assert_eq!(usage.len(), 2, "{shard}");
        for (rank, u) in usage.iter().enumerate() {
            let (own, other) = (chunk(rank), chunk(1 - rank));
            let what = format!("{shard} rank {rank}: {u:?}");
            assert!(u.activation_bytes.is_none() && u.comm_seconds() > 0.0, "{what}");
            // The step's collectives run inside it: their share is at most all of it.
            assert!(u.comm_seconds() <= u.step_seconds, "{what}");
            assert!(u.sent.iter().all(|line| line.group == GroupKind::Data && line.calls > 0), "{what}");
            let model = if shard == "zero3" { 0 } else { f32s(n) };
            let expected = match shard {
                // The whole model, its gradients and AdamW's two moments.
                "none" => (model, model, f32s(2 * n), 0),
                // The replica (none under ZeRO-3), its gradients and the own shard's reduced gradient; the
                // own shard's masters and two moments; the other rank's (its buddy's) masters, moments
                // and gradient shard.
                _ => (model, model + f32s(own), f32s(3 * own), f32s(4 * other)),
            };
            assert_eq!((u.param_bytes, u.grad_bytes, u.optimizer_bytes, u.buddy_bytes), expected, "{what}");
            match shard {
                // The gradients' buckets and the loss's word.
                "none" => assert_eq!(u.sent_bytes(), f32s(n + 1), "{what}"),
                // The masters gathered into the replica, the gradient all-reduced; loss and norm.
                "zero1" => {
                    assert_eq!((sent(u, AllGather), sent(u, AllReduce)), (f32s(own), f32s(n + 2)), "{what}");
                    assert_eq!(u.sent_bytes(), f32s(own + n + 2), "{what}");
                }
                // The other rank's chunk of the gradient to it, the own shard to the buddy that shadows it.
                "zero2" => {
                    let lines = [sent(u, AllGather), sent(u, ReduceScatter), sent(u, Send), sent(u, AllReduce)];
                    assert_eq!(lines, [f32s(own), f32s(other), f32s(own), f32s(2)], "{what}");
                    assert_eq!(u.sent_bytes(), lines.iter().sum::<u64>(), "{what}");
                }
                // Each unit's parameters handed out by their owners, its gradients summed onto them.
                _ => {
                    let broadcast = sent(u, Broadcast);
                    assert!(broadcast >= f32s(own) && broadcast % f32s(own) == 0, "{what}");
                    assert!(sent(u, Reduce) > 0 && sent(u, Send) == f32s(own), "{what}");
                    assert_eq!(sent(u, AllReduce), f32s(2), "{what}");
                }
            }
        }
    }
    // Adafactor: the factored statistics instead of AdamW's moments, whole under DDP and beside the own
    // shard's masters under ZeRO.
    for shard in ["none", "zero1"] {
        let usage = usage_of(&cluster, &common::with_adafactor(config(3, shard), false)).await;
        for (rank, u) in usage.iter().enumerate() {
            let (elements, masters) = if shard == "none" { (n, 0) } else { (chunk(rank), f32s(chunk(rank))) };
            let state = u.optimizer_bytes - masters;
            assert!(state > 0 && 10 * state <= f32s(2 * elements), "{shard} rank {rank}: {state} bytes: {u:?}");
        }
    }
    cluster.shutdown().await;
}

//! Pipelines across daemon processes (issue 6 item 1, issue 7's elasticity for `pp` > 1): each rank of
//! the job is one stage of one pipeline replica, activations and gradients cross between the daemons
//! over the attempt's mesh, and the result equals the single-process reference (DESIGN.md §4) —
//! per-step losses and final parameters within 1e-5 relative — also when a daemon is killed (the world
//! shrinks by whole pipelines, its stage restored from another replica or from the checkpoint) and when
//! one joins (the world grows back).

mod common;

use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{DataPlane, Job, JobEvent, JobHandle, LocalCluster};
use troupe_model::checkpoint;
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const TOLERANCE: f64 = 1e-5;
const EVENT_TIMEOUT: Duration = Duration::from_secs(90);

fn config(steps: u64, schedule: &str) -> JobConfig {
    let mut config = JobConfig::small(steps);
    config.model.n_layers = 2;
    config.parallel.pp = 2;
    config.parallel.schedule = schedule.into();
    config
}

fn check(config: &JobConfig, losses: Option<&[f64]>, final_params: &Path, what: &str) {
    tch::set_num_threads(1);
    let mut reference = Trainer::new(config.clone()).unwrap();
    let ref_losses: Vec<f64> = (0..config.train.steps).map(|_| reference.train_step().loss).collect();
    if let Some(losses) = losses {
        assert_eq!(losses.len(), ref_losses.len(), "{what}: one committed loss per step");
        let diff = worst_loss_diff(losses, &ref_losses);
        eprintln!("{what}: loss diff {diff:.1e}");
        assert!(diff <= TOLERANCE, "{what}: losses differ by {diff:e}");
    }
    let params = common::saved_params(final_params, &reference);
    let comparison = compare_params(reference.model.specs(), &params, &reference.param_values());
    eprintln!("{what}: params {comparison:?}");
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
}

async fn next(handle: &mut JobHandle) -> Option<JobEvent> {
    tokio::time::timeout(EVENT_TIMEOUT, handle.next_event()).await.expect("an event within the timeout").unwrap()
}

fn losses(events: &[JobEvent]) -> Vec<f64> {
    events.iter().filter_map(|e| if let JobEvent::Step { loss, .. } = e { Some(*loss) } else { None }).collect()
}

fn worlds(events: &[JobEvent]) -> Vec<usize> {
    events.iter().filter_map(|e| if let JobEvent::Step { world, .. } = e { Some(*world) } else { None }).collect()
}

/// 1F1B with two stages on two daemons over QUIC, then ZB-H1 over the same-host sockets on the same
/// daemons: both equal the reference, and the job's checkpoint — gathered from the stages — holds the
/// whole state, with the pipeline's layout in its manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_across_two_daemons_equals_the_reference_over_quic_and_sockets() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(2).await;
    for (schedule, plane) in [("1f1b", DataPlane::Quic), ("zb-h1", DataPlane::Auto)] {
        let mut config = config(6, schedule);
        config.checkpoint.dir = Some(dir.path().join(format!("ckpt-{schedule}")));
        config.checkpoint.every_steps = 3;
        let out = dir.path().join(format!("{schedule}.safetensors"));
        let job = Job::new(config.clone()).save_final(&out).data_plane(plane);
        let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
        let mut events = Vec::new();
        while let Some(e) = next(&mut handle).await {
            events.push(e);
        }
        assert!(matches!(events.first(), Some(JobEvent::Started { world: 2, .. })), "{schedule}: {events:?}");
        assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 6, .. })), "{schedule}: {events:#?}");
        check(&config, Some(&losses(&events)), &out, &format!("pp=2 {schedule}"));

        let root = config.checkpoint.dir.as_ref().unwrap();
        let (latest, skipped) = checkpoint::latest_valid(root);
        assert!(skipped.is_empty(), "{skipped:?}");
        let latest = latest.expect("a checkpoint of step 6");
        let manifest = checkpoint::verify(&latest).unwrap();
        assert_eq!((manifest.step, manifest.layout.pp, manifest.layout.dp), (6, 2, 1), "{manifest:?}");
        // The checkpoint is the reference's state after 6 steps, loadable by the single-process trainer.
        let resumed = Trainer::resume(config.clone(), &latest).unwrap();
        let saved = common::saved_params(&out, &resumed);
        let comparison = compare_params(resumed.model.specs(), &saved, &resumed.param_values());
        assert!(comparison.within(0.0), "checkpoint = final parameters: {comparison:?}");
    }
    cluster.shutdown().await;
}

/// Two pipelines of two stages on four daemons (pp=2 × dp=2). One daemon is SIGKILLed mid-run: the
/// world shrinks to one pipeline on the survivors, the lost stage's state comes from its other replica
/// (no rollback: the job has no checkpoint directory), and a daemon that joins grows it back to two —
/// all on the fault-free trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pipelines_lose_a_daemon_and_regrow_without_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = common::processes(4).await;
    // Enough steps (milliseconds each) that a daemon started after the shrink joins before the end.
    let config = config(600, "1f1b");
    let out = dir.path().join("final.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut events, mut phase) = (Vec::new(), 0);
    while let Some(event) = next(&mut handle).await {
        match (&event, phase) {
            (JobEvent::Step { step, world: 4, .. }, 0) if *step >= 4 => {
                common::signal(cluster.pid(1).unwrap(), "KILL");
                phase = 1;
            }
            (JobEvent::Recovered { world: 2, .. }, 1) => {
                cluster.add_node().unwrap();
                phase = 2;
            }
            (JobEvent::Recovered { world: 4, .. }, 2) => phase = 3,
            _ => {}
        }
        events.push(event);
    }
    let worlds = worlds(&events);
    eprintln!("worlds per step: {worlds:?}");
    assert_eq!(phase, 3, "kill, shrink and regrow all happened before the end: {events:#?}");
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 600, .. })), "{events:#?}");
    assert!(!events.iter().any(|e| matches!(e, JobEvent::RolledBack { .. })), "no rollback: {events:#?}");
    assert!(worlds.contains(&2) && worlds.last() == Some(&4), "{worlds:?}");
    check(&config, Some(&losses(&events)), &out, "pp=2 × dp=2, one SIGKILLed, one joined");
    cluster.shutdown().await;
}

/// Runs `config` (checkpoints every 5 steps) on `cluster`, SIGKILLs daemon `victim` at the first step
/// past a durable checkpoint, and returns the events to the end — checking the job finished after rolling
/// back to a checkpoint — and the layout of the first checkpoint.
async fn kill_after_a_checkpoint(
    cluster: &LocalCluster,
    config: &JobConfig,
    out: &Path,
    victim: usize,
) -> (Vec<JobEvent>, checkpoint::Layout) {
    let job = Job::new(config.clone()).save_final(out);
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let (mut events, mut durable, mut killed, mut first_layout) = (Vec::new(), 0, false, None);
    while let Some(event) = next(&mut handle).await {
        match &event {
            JobEvent::Checkpoint { step, path, .. } => {
                durable = durable.max(*step);
                first_layout.get_or_insert_with(|| checkpoint::verify(path).unwrap().layout);
            }
            JobEvent::Step { step, .. } if !killed && durable >= 5 && step % 5 != 0 => {
                common::signal(cluster.pid(victim).unwrap(), "KILL");
                killed = true;
            }
            _ => {}
        }
        events.push(event);
    }
    assert!(killed, "{events:#?}");
    let steps = config.train.steps;
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: s, .. }) if *s == steps), "{events:#?}");
    let rolled_back = events.iter().find_map(|e| match e {
        JobEvent::RolledBack { from_step, to_step } => Some((*from_step, *to_step)),
        _ => None,
    });
    let Some((from, to)) = rolled_back else { panic!("a rollback to the checkpoint: {events:#?}") };
    assert!(to % 5 == 0 && from > to, "rolled back from {from} to a checkpoint: {to}");
    (events, first_layout.expect("a checkpoint before the kill"))
}

/// One pipeline of two stages on three daemons (one spare). The daemon of a stage is SIGKILLed: its
/// chunks lived nowhere else, so the spare takes the stage and the job rolls back to the last checkpoint
/// — and still lands where the fault-free run lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_stage_with_no_other_replica_restores_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(3).await;
    let mut config = config(40, "gpipe");
    config.checkpoint.dir = Some(dir.path().join("ckpt"));
    config.checkpoint.every_steps = 5;
    let out = dir.path().join("final.safetensors");
    // Rank 1 (the second stage) is the second daemon in node-id order.
    kill_after_a_checkpoint(&cluster, &config, &out, 1).await;
    check(&config, None, &out, "pp=2 on 3 daemons, a stage lost, restored from the checkpoint");
    cluster.shutdown().await;
}

/// Adafactor in a pipeline (the small Llama, as every Adafactor oracle), one pipeline of two stages on
/// three daemons: a stage's daemon SIGKILLed, the spare restores the stage from the checkpoint, whose
/// slots hold Adafactor's state packed as the single process packs it, and the run lands on the
/// single-process Adafactor run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adafactor_pipeline_restores_a_lost_stage_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(3).await;
    let mut config = JobConfig::small_llama(40);
    config.model.n_layers = 2;
    (config.parallel.pp, config.parallel.schedule) = (2, "1f1b".into());
    config.train.optimizer = "adafactor".into();
    config.checkpoint.dir = Some(dir.path().join("ckpt"));
    config.checkpoint.every_steps = 5;
    let out = dir.path().join("final.safetensors");
    kill_after_a_checkpoint(&cluster, &config, &out, 1).await;
    check(&config, None, &out, "adafactor pp=2 on 3 daemons, a stage lost, restored from the checkpoint");
    cluster.shutdown().await;
}

/// Adafactor with ZeRO inside the stages' groups (pp=2 × dp=2 on 4 daemons): a checkpoint written by a
/// ZeRO-2 job — each owner's range of its device's Adafactor state, the factored statistics packed as
/// the single process packs them — is continued by a ZeRO-3 job, whose replicas read their ranges back
/// and complete the device's statistics among themselves; then a daemon is SIGKILLed and its half comes
/// back from the buddy's copy as the job goes on as one unsharded pipeline. Each lands on the
/// single-process Adafactor run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adafactor_with_zero_inside_the_stages_resumes_through_a_checkpoint_and_loses_an_owner() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = common::processes(4).await;
    let job = |steps: u64, shard: &str| {
        let mut config = JobConfig::small_llama(steps);
        config.model.n_layers = 2;
        (config.parallel.pp, config.parallel.schedule, config.parallel.shard) = (2, "1f1b".into(), shard.into());
        config.train.optimizer = "adafactor".into();
        config.train.adafactor.beta1 = Some(0.9);
        config.train.decay_steps = 40; // the same learning rates whatever `steps` is
        config.checkpoint.dir = Some(ckpt.clone());
        config
    };
    let first = job(6, "zero2");
    let out = dir.path().join("6.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(first.clone()).save_final(&out)).await.unwrap();
    let mut events = Vec::new();
    while let Some(event) = next(&mut handle).await {
        events.push(event);
    }
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 6, .. })), "{events:#?}");
    check(&first, None, &out, "adafactor pp=2 × dp=2 zero2, 6 steps");

    let second = job(40, "zero3");
    let out = dir.path().join("40.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(second.clone()).save_final(&out)).await.unwrap();
    let (mut events, mut killed) = (Vec::new(), false);
    while let Some(event) = next(&mut handle).await {
        if matches!(event, JobEvent::Step { step, world: 4, .. } if step >= 10) && !killed {
            common::signal(cluster.pid(3).unwrap(), "KILL");
            killed = true;
        }
        events.push(event);
    }
    assert!(matches!(events.first(), Some(JobEvent::Started { from_step: 6, world: 4, .. })), "{events:#?}");
    assert!(killed, "{events:#?}");
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 40, .. })), "{events:#?}");
    assert!(!events.iter().any(|e| matches!(e, JobEvent::RolledBack { .. })), "no rollback: {events:#?}");
    assert!(events.iter().any(|e| matches!(e, JobEvent::Recovered { world: 2, .. })), "{events:#?}");
    check(&second, None, &out, "adafactor pp=2 × dp=2 zero2 → zero3 from the checkpoint, an owner lost");
    cluster.shutdown().await;
}

/// Issue 7's resharding across `pp`: one checkpoint directory continued by a pp=2 job, a DDP job, a ZB-H1
/// pp=2 job and a ZeRO-2 job in turn, each starting where the previous one stopped, lands where one
/// uninterrupted run lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_of_pipeline_ddp_and_zero_jobs_load_in_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = troupe_actors::api::LocalCluster::in_process(2).await.unwrap();
    let mut last = None;
    let phases = [
        (4, 2, "1f1b", "none", 0),
        (8, 1, "1f1b", "none", 4),
        (12, 2, "zb-h1", "none", 8),
        (16, 1, "1f1b", "zero2", 12),
    ];
    for (steps, pp, schedule, shard, from) in phases {
        let mut config = config(steps, schedule);
        config.parallel.pp = pp;
        config.parallel.shard = shard.into();
        // A schedule that does not depend on `steps`, so the runs follow one run's learning rates.
        config.train.decay_steps = 16;
        config.checkpoint.dir = Some(ckpt.clone());
        let out = dir.path().join(format!("{steps}.safetensors"));
        let mut handle =
            cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
        let mut events = Vec::new();
        while let Some(e) = next(&mut handle).await {
            events.push(e);
        }
        let what = format!("pp={pp} {schedule} shard={shard}");
        assert!(
            matches!(events.first(), Some(JobEvent::Started { from_step, world: 2, .. }) if *from_step == from),
            "{what} starts from step {from}: {events:?}"
        );
        assert!(matches!(events.last(), Some(JobEvent::Finished { .. })), "{what}: {events:?}");
        let (step, newest) = checkpoint::step_dirs(&ckpt).pop().unwrap();
        let manifest = checkpoint::verify(&newest).unwrap();
        assert_eq!((step, manifest.layout.pp), (steps, pp), "{what}");
        last = Some((config, out));
    }
    let (config, out) = last.unwrap();
    check(&config, None, &out, "pp=2 → DDP → pp=2 → zero2 through checkpoints");
    cluster.shutdown().await;
}

/// ZeRO-3 inside the stages' groups on 4 daemons (pp=2 × dp=2): each rank owns half of its stage's
/// parameters and optimizer state and keeps a copy of the other half (`checkpoint.replicas = 1`, the
/// default). A SIGKILLed daemon's half is restored from that copy: the job goes on as one unsharded
/// pipeline from the last committed step — no checkpoint directory, no rollback — on the reference's
/// trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero3_inside_the_stages_loses_an_owner_and_restores_its_half_from_the_buddy_copy() {
    lose_an_owner_of_zero3_inside_the_stages(false).await;
}

/// The same with a tied head (`tie_word_embeddings`, as GPT-2 small): the killed daemon held a replica of
/// the head's stage and its copy of the embedding matrix; the surviving head's device keeps the copy in
/// step with the first stage's matrix through the shrink.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tied_head_under_zero3_inside_the_stages_loses_an_owner_and_goes_on() {
    lose_an_owner_of_zero3_inside_the_stages(true).await;
}

async fn lose_an_owner_of_zero3_inside_the_stages(tie_word_embeddings: bool) {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(4).await;
    let mut config = config(300, "1f1b");
    config.parallel.shard = "zero3".into();
    config.model.tie_word_embeddings = tie_word_embeddings;
    let out = dir.path().join("final.safetensors");
    let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone()).save_final(&out)).await.unwrap();
    let (mut events, mut killed) = (Vec::new(), false);
    while let Some(event) = next(&mut handle).await {
        if matches!(event, JobEvent::Step { step, world: 4, .. } if step >= 4) && !killed {
            common::signal(cluster.pid(3).unwrap(), "KILL");
            killed = true;
        }
        events.push(event);
    }
    assert!(killed, "{events:#?}");
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 300, .. })), "{events:#?}");
    assert!(!events.iter().any(|e| matches!(e, JobEvent::RolledBack { .. })), "no rollback: {events:#?}");
    assert!(events.iter().any(|e| matches!(e, JobEvent::Recovered { world: 2, .. })), "{events:#?}");
    let what = format!("pp=2 × dp=2 zero3 tied={tie_word_embeddings}, an owner lost, its half from the copy");
    check(&config, Some(&losses(&events)), &out, &what);
    cluster.shutdown().await;
}

/// The same without buddy copies (`checkpoint.replicas = 0`), and with a tied head: the lost half lived
/// nowhere else, so the job rolls back to the checkpoint (gathered from all four owners, the embedding
/// matrix once — not the head's copies) and goes on as one unsharded pipeline whose head's device copies
/// the matrix from the checkpoint, on the reference's trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero3_inside_the_stages_without_copies_loses_an_owner_and_rolls_back_to_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(4).await;
    let mut config = config(60, "1f1b");
    config.parallel.shard = "zero3".into();
    config.model.tie_word_embeddings = true;
    config.checkpoint.replicas = 0;
    config.checkpoint.dir = Some(dir.path().join("ckpt"));
    config.checkpoint.every_steps = 5;
    let out = dir.path().join("final.safetensors");
    let (_, layout) = kill_after_a_checkpoint(&cluster, &config, &out, 3).await;
    assert_eq!((layout.pp, layout.dp, layout.shard_mode), (2, 2, checkpoint::ShardMode::Zero3), "{layout:?}");
    check(&config, None, &out, "pp=2 × dp=2 zero3 tied, an owner lost, rolled back");
    cluster.shutdown().await;
}

/// What each device of a pp = 2 × dp = 2 job (untied, four daemons) says it holds and sends at step 2,
/// against an independent count: the two stages' parameters add up to the model's; without ZeRO each
/// device keeps its parameters, their gradients and AdamW's two moments, and all-reduces its gradients
/// with the loss word in its stage's group; with ZeRO-1 it keeps its own half's masters and moments, a
/// buddy copy of the other half (masters, moments, gradient), and the owned half's reduced gradient.
/// Each device sends its replica's activations (forward) or their gradients (backward) once per step —
/// a replica's samples × context × d_model floats — and the flush's two words along the chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_pipeline_device_reports_what_it_holds_and_sends() {
    use troupe_actors::protocol::{CollectiveKind, GroupKind, RankUsage};
    let cluster = LocalCluster::in_process(4).await.unwrap();
    let f32s = |elements: usize| 4 * elements as u64;
    for shard in ["none", "zero1"] {
        let mut config = config(3, "1f1b");
        (config.model.tie_word_embeddings, config.parallel.dp, config.parallel.shard) = (false, 2, shard.into());
        let mut handle = cluster.client().await.unwrap().submit(Job::new(config.clone())).await.unwrap();
        let mut usage: Vec<RankUsage> = Vec::new();
        while let Some(event) = next(&mut handle).await {
            match event {
                JobEvent::Usage { attempt: 1, step: 2, ranks } => usage = ranks,
                JobEvent::Failed { .. } | JobEvent::Cancelled { .. } => panic!("{shard}: {event:?}"),
                _ => {}
            }
        }
        eprintln!("{shard}: {}", troupe_actors::protocol::describe_usage(2, &usage));
        assert_eq!(usage.len(), 4, "{shard}: a usage line per rank");
        // Rank r is replica r mod 2 of device r div 2.
        let stage_params = [usage[0].param_bytes, usage[2].param_bytes];
        assert_eq!(stage_params.iter().sum::<u64>(), f32s(config.model.param_count()), "{shard}: {usage:?}");
        let model = &config.model;
        let activations = f32s(config.train.global_batch / 2 * model.context * model.d_model);
        for (rank, u) in usage.iter().enumerate() {
            let what = format!("{shard} rank {rank}: {u:?}");
            let n = (u.param_bytes / 4) as usize;
            assert_eq!(u.param_bytes, stage_params[rank / 2], "{what}");
            let own = troupe_kernels::balanced_range(n, 2, rank % 2).len();
            let other = n - own;
            let expected = match shard {
                "none" => (f32s(n), f32s(2 * n), 0),
                _ => (f32s(n + own), f32s(3 * own), f32s(4 * other)),
            };
            assert_eq!((u.grad_bytes, u.optimizer_bytes, u.buddy_bytes), expected, "{what}");
            assert_eq!(u.sent_by(GroupKind::Pipeline, CollectiveKind::Send), activations, "{what}");
            assert_eq!(u.sent_by(GroupKind::Pipeline, CollectiveKind::AllReduce), f32s(2), "{what}");
            let data = u.sent_by(GroupKind::Data, CollectiveKind::AllReduce);
            match shard {
                "none" => assert_eq!(data, f32s(n + 1), "{what}"),
                // ZeRO-1: the gradients all-reduced; the owners' squared norm and loss.
                _ => assert_eq!(data, f32s(n + 2), "{what}"),
            }
            assert!(u.comm_seconds() > 0.0 && u.activation_bytes.is_none(), "{what}");
        }
    }
    cluster.shutdown().await;
}

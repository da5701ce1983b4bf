//! Tensor × pipeline (× data) parallelism as a job: `parallel.tp` and `parallel.pp` together, every
//! schedule (GPipe, 1F1B, interleaved, ZB-H1 with its split backward), stages balanced by measured time,
//! recomputation, a tied and an untied head, sequence
//! parallelism on and off, ZeRO-3 inside the data-parallel groups — each equal to the single-process
//! reference; tp = 2 × pp = 2 × dp = 2 on four
//! two-slot daemon processes (each tensor group on one host's arena) that loses a daemon to SIGKILL: the
//! replica that lost it drops out and the job goes on from the other's state, on the reference.

use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, LocalCluster, LocalClusterOptions};
use troupe_model::config::JobConfig;

use super::{check, common, losses_and_worlds, reference, with_tp, TOLERANCE};

/// `config` at tp = 2 (sequence parallelism `sp`) × pp = 2 with `schedule`, over `layers` blocks.
fn pipelined(mut config: JobConfig, sp: bool, schedule: &str, layers: usize) -> JobConfig {
    config = with_tp(config, 2, sp);
    config.model.n_layers = layers;
    config.parallel.pp = 2;
    config.parallel.schedule = schedule.into();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_by_pp2_jobs_equal_the_reference_with_every_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::in_process(4).await.unwrap();
    let mut tied_llama = pipelined(JobConfig::small_llama(8), true, "1f1b", 2);
    tied_llama.model.tie_word_embeddings = true;
    let mut recomputed = pipelined(JobConfig::small(8), false, "gpipe", 2);
    recomputed.parallel.recompute = true;
    let mut interleaved = pipelined(JobConfig::small(8), true, "interleaved", 4);
    (interleaved.parallel.virtual_stages, interleaved.model.tie_word_embeddings) = (2, true);
    // Chunks cut by the parts' timed cost: rank 0 measures, every rank cuts alike.
    let mut measured = pipelined(JobConfig::small(8), true, "1f1b", 3);
    measured.parallel.balance = "measured".into();
    let cases = [
        ("gpt2 tp=2 pp=2 1f1b sp balance=measured", measured),
        ("tied llama tp=2 pp=2 1f1b sp", tied_llama),
        ("gpt2 tp=2 pp=2 gpipe recompute", recomputed),
        ("llama tp=2 pp=2 zb-h1 sp", pipelined(JobConfig::small_llama(8), true, "zb-h1", 2)),
        ("tied gpt2 tp=2 pp=2 interleaved v=2 sp", interleaved),
    ];
    for (what, config) in cases {
        let out = dir.path().join(format!("{}.safetensors", what.replace(' ', "-")));
        check(&cluster, config, &out, 4, what).await;
    }
    cluster.shutdown().await;
}

/// tp = 2 × pp = 2 × dp = 2, and the same with ZeRO-3 inside the data-parallel groups (each stage's
/// shards split over its two replicas, gathered for the step and dropped after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tp2_by_pp2_by_dp2_with_and_without_zero3_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::in_process(8).await.unwrap();
    for shard in ["none", "zero3"] {
        let mut config = pipelined(JobConfig::small_llama(8), true, "1f1b", 2);
        (config.parallel.dp, config.model.tie_word_embeddings, config.parallel.shard) = (2, true, shard.into());
        let what = format!("tied llama tp=2 x pp=2 x dp=2 shard={shard}");
        check(&cluster, config, &dir.path().join(format!("{shard}.safetensors")), 8, &what).await;
    }
    cluster.shutdown().await;
}

/// tp = 2 × pp = 2 × dp = 1 on five daemon processes (four ranks and a spare), no checkpoint: daemon 2
/// SIGKILLed after step 5. The lost rank's stage neighbour holds its own shard and a buddy copy of the lost
/// one's, so it puts that stage together and gathers the whole state along its chain with the other
/// stage; the spare takes the lost rank's place and the job goes on from the last committed step —
/// nothing rolled back, no step redone — on the reference's trajectory. (Without buddy copies under a
/// pipeline this job failed: its state was on no survivor and it had no checkpoint.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_by_pp2_job_that_loses_a_rank_goes_on_with_the_spare_from_a_buddy_copy() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::processes(5).await;
    let mut config = pipelined(JobConfig::small_llama(12), true, "1f1b", 2);
    config.parallel.dp = 1;
    let out = dir.path().join("final.safetensors");
    let job = Job::new(config.clone()).save_final(&out).elastic(1, 5, 10);
    let events = super::run_killing(&cluster, job, &[2]).await;
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 12, .. })), "{events:?}");
    let (_, worlds) = losses_and_worlds(&events);
    assert!(worlds.iter().all(|&w| w == 4), "tp 2 × pp 2 throughout: {worlds:?}");
    let killed = cluster.node_name(2);
    let held_a_rank = events.iter().any(|e| match e {
        JobEvent::Placed { attempt: 1, ranks, .. } => ranks.iter().any(|r| r.node.0 == killed),
        _ => false,
    });
    assert!(held_a_rank, "the killed daemon held a rank of the first attempt: {events:?}");
    assert!(events.iter().any(|e| matches!(e, JobEvent::Recovered { world: 4, .. })), "{events:?}");
    super::assert_no_step_redone_and_on_the_reference(&events, &config, &out, "tp=2 x pp=2 losing a rank");
    cluster.shutdown().await;
}

/// A checkpoint is layout-free: written at tp = 2 × pp = 2 (each stage's shards gathered over its tensor
/// group, then along the chain), resumed at tp = 2 × dp = 2 without a pipeline, the run ends where one
/// uninterrupted reference run ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_written_at_tp2_by_pp2_resumes_at_tp2_by_dp2_on_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let cluster = LocalCluster::in_process(4).await.unwrap();
    let config = |steps: u64, pp: usize, dp: usize| {
        let mut config = pipelined(JobConfig::small_llama(steps), true, "1f1b", 2);
        (config.parallel.pp, config.parallel.dp, config.train.decay_steps) = (pp, dp, 8);
        config.checkpoint.dir = Some(ckpt.clone());
        config.checkpoint.every_steps = 4;
        config
    };
    let first = super::run_to_end(&cluster, Job::new(config(4, 2, 1))).await;
    assert!(matches!(first.last(), Some(JobEvent::Finished { steps: 4, .. })), "{first:?}");
    assert!(first.iter().any(|e| matches!(e, JobEvent::Checkpoint { step: 4, .. })), "{first:?}");
    let out = dir.path().join("final.safetensors");
    let what = "tp=2 x pp=2 checkpoint resumed at tp=2 x dp=2";
    let second = super::resumed_on_the_reference(&cluster, config(8, 1, 2), &config(8, 1, 1), &out, 4, what).await;
    assert!(matches!(second[0], JobEvent::Started { world: 4, .. }), "{second:?}");
    cluster.shutdown().await;
}

/// tp = 2 × pp = 2 × dp = 2 on four daemon processes of two slots: rank t + 2·(d + 2·p) puts each tensor
/// group on one daemon. Daemon 3 (stage 1 of replica 1) is SIGKILLed after step 5: replica 1 is lost
/// whole, replica 0 holds the whole committed state, and the job goes on at dp = 1 (world 4) from the
/// last committed step, on the reference's trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tp2_by_pp2_by_dp2_job_that_loses_a_daemon_goes_on_from_the_other_replica() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = LocalClusterOptions::new(4);
    (options.slots_per_node, options.torch_threads) = (2, 1);
    let cluster = LocalCluster::processes(common::binary(), options).await.expect("local cluster starts");
    let mut config = pipelined(JobConfig::small_llama(12), true, "1f1b", 2);
    (config.parallel.dp, config.model.tie_word_embeddings) = (2, true);
    let out = dir.path().join("final.safetensors");
    let job = Job::new(config.clone()).save_final(&out).elastic(2, 4, 10);
    let mut handle = cluster.client().await.unwrap().submit(job).await.unwrap();
    let (mut events, mut killed) = (Vec::new(), false);
    while let Some(e) = tokio::time::timeout(Duration::from_secs(120), handle.next_event()).await.unwrap().unwrap() {
        if !killed && matches!(e, JobEvent::Step { step, .. } if step >= 5) {
            common::signal(cluster.pid(3).unwrap(), "KILL");
            killed = true;
        }
        events.push(e);
    }
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 12, .. })), "{events:?}");
    let (losses, worlds) = losses_and_worlds(&events);
    assert_eq!((worlds.first(), worlds.last()), (Some(&8), Some(&4)), "two replicas, then one: {worlds:?}");
    // Each attempt says where its ranks run: every tensor group on one daemon, dp 2 and then dp 1.
    let placed: Vec<(usize, &Vec<troupe_actors::protocol::RankSlot>)> = events
        .iter()
        .filter_map(|e| match e {
            JobEvent::Placed { tp: 2, pp: 2, dp, ranks, .. } => Some((*dp, ranks)),
            _ => None,
        })
        .collect();
    assert_eq!(placed.first().map(|p| (p.0, p.1.len())), Some((2, 8)), "{events:?}");
    assert_eq!(placed.last().map(|p| (p.0, p.1.len())), Some((1, 4)), "{events:?}");
    for (_, ranks) in &placed {
        assert!(ranks.chunks(2).all(|g| g[0].node == g[1].node), "a tensor group spans daemons: {ranks:?}");
    }
    let (ref_losses, reference) = reference(&config);
    assert_eq!(losses.len(), ref_losses.len(), "one committed loss per step: {events:?}");
    let diff = troupe_model::oracle::worst_loss_diff(&losses, &ref_losses);
    let params = common::saved_params(&out, &reference);
    let comparison = troupe_model::oracle::compare_params(reference.model.specs(), &params, &reference.param_values());
    eprintln!("tp=2 x pp=2 x dp=2 losing a daemon: loss diff {diff:.1e}, params {comparison:?}");
    assert!(diff <= TOLERANCE, "losses differ by {diff:e}");
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
    cluster.shutdown().await;
}

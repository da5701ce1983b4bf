//! Adafactor under tensor parallelism (`train.optimizer = "adafactor"` with `[parallel] tp`), checked as
//! the other tensor-parallel jobs are against the single-process Adafactor run: tp = 2 with sequence
//! parallelism on and off, with and without the first moment; tp = 4 over the small Llama's 2
//! key/value heads (each held by 2 ranks: its statistics counted once) and over a vocabulary tp does not
//! divide (padded rows); tp = 2 × dp = 2, with ZeRO-1/2/3 inside its data-parallel groups; tp = 2 inside
//! a pipeline (with data parallelism and ZeRO too); a checkpoint written at tp = 2 × dp = 2 (with and
//! without ZeRO) resumed at tp = 1 and at tp = 4; and on daemon processes a tensor rank SIGKILLed, the job going on at tp = 1 from the
//! survivor's buddy copy with nothing rolled back. The small Llama throughout, as every Adafactor oracle (GPT-2's key
//! biases have near-zero gradients, whose Adafactor updates amplify rounding).

use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_model::config::JobConfig;

use super::common::with_adafactor;
use super::{check, checkpointed, resumed_on_the_reference, run_to_end, with_tp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adafactor_at_tp2_and_tp4_equals_the_single_process_adafactor() {
    let dir = tempfile::tempdir().unwrap();
    let llama =
        |steps, tp, sp, first_moment| with_adafactor(with_tp(JobConfig::small_llama(steps), tp, sp), first_moment);
    let mut odd_vocab = llama(8, 4, false, true);
    odd_vocab.model.vocab_size = 259;
    let mut by_dp = llama(10, 2, true, true);
    by_dp.parallel.dp = 2;
    // A job takes every daemon of the cluster: tp = 2 alone on two, the rest on four.
    let on_two = [("tp=2 sp", llama(10, 2, true, false)), ("tp=2 no sp beta1", llama(10, 2, false, true))];
    let on_four = [
        ("tp=4 over 2 kv heads sp", llama(8, 4, true, false)),
        ("tp=4 vocab 259 beta1", odd_vocab),
        ("tp=2 x dp=2 beta1", by_dp),
    ];
    check_on_clusters(dir.path(), [(2, on_two.to_vec()), (4, on_four.to_vec())]).await;
}

/// Each case (name, config) of each (world, cases) checked against the single-process Adafactor on a
/// fresh in-process cluster of `world` daemons (a job takes every daemon of its cluster).
async fn check_on_clusters<const N: usize>(dir: &std::path::Path, sets: [(usize, Vec<(&str, JobConfig)>); N]) {
    for (world, cases) in sets {
        let cluster = LocalCluster::in_process(world).await.unwrap();
        for (what, config) in cases {
            let what = format!("llama adafactor {what}");
            let out = dir.join(format!("{}.safetensors", what.replace(' ', "-")));
            check(&cluster, config, &out, world, &what).await;
        }
        cluster.shutdown().await;
    }
}

/// Adafactor with ZeRO-1, -2 and -3 inside the data-parallel groups of tp = 2 × dp = 2 (each replica owns
/// half of its tensor rank's shard list, matrices cut between owners: their row and column sums summed
/// over both groups), and inside a pipeline: tp = 2 × pp = 2 with a tied head (its two copies, on the
/// first and last stage, updated alike), and tp = 2 × pp = 2 × dp = 2 with ZeRO-2 — each equal to the
/// single-process Adafactor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adafactor_with_zero_under_tp_and_inside_a_pipeline_equals_the_single_process_adafactor() {
    let dir = tempfile::tempdir().unwrap();
    let llama = |steps, first_moment| with_adafactor(with_tp(JobConfig::small_llama(steps), 2, true), first_moment);
    let zero = |shard: &str, first_moment| {
        let mut config = llama(8, first_moment);
        (config.parallel.dp, config.parallel.shard) = (2, shard.into());
        config
    };
    let piped = |dp: usize, shard: &str| {
        let mut config = llama(8, true);
        (config.parallel.pp, config.parallel.schedule, config.model.n_layers) = (2, "1f1b".into(), 2);
        (config.parallel.dp, config.parallel.shard, config.model.tie_word_embeddings) = (dp, shard.into(), true);
        config
    };
    let on_four = [
        ("tp=2 x dp=2 zero1 beta1", zero("zero1", true)),
        ("tp=2 x dp=2 zero2", zero("zero2", false)),
        ("tp=2 x dp=2 zero3 beta1", zero("zero3", true)),
        ("tied tp=2 x pp=2 1f1b beta1", piped(1, "none")),
    ];
    let on_eight = [("tied tp=2 x pp=2 x dp=2 zero2 beta1", piped(2, "zero2"))];
    check_on_clusters(dir.path(), [(4, on_four.to_vec()), (8, on_eight.to_vec())]).await;
}

/// The Adafactor state is layout-free: written at tp = 2 × dp = 2 (each rank's shard of the packed slots
/// gathered; under ZeRO-2 each owner's range of them first), resumed at tp = 1 (dp = 4) and at tp = 4,
/// each continuation ends where one uninterrupted reference run ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adafactor_checkpoint_written_at_tp2_resumes_at_tp1_and_tp4_on_the_reference_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = LocalCluster::in_process(4).await.unwrap();
    for (shard, resumed_at) in [("none", 1), ("none", 4), ("zero2", 1)] {
        let ckpt = dir.path().join(format!("ckpt-{shard}-{resumed_at}"));
        let config = |steps: u64, tp: usize| {
            checkpointed(with_adafactor(with_tp(JobConfig::small_llama(steps), tp, true), true), &ckpt)
        };
        let mut written = config(6, 2);
        written.parallel.shard = shard.into();
        let first = run_to_end(&cluster, Job::new(written)).await;
        assert!(matches!(first.last(), Some(JobEvent::Finished { steps: 6, .. })), "{first:?}");
        let out = dir.path().join(format!("final-{shard}-{resumed_at}.safetensors"));
        let what = format!("adafactor tp=2 shard={shard} checkpoint resumed at tp={resumed_at}");
        resumed_on_the_reference(&cluster, config(10, resumed_at), &config(10, 1), &out, 6, &what).await;
    }
    cluster.shutdown().await;
}

/// tp = 2 × dp = 1 with Adafactor on two daemon processes, no checkpoint: tensor rank 1's daemon SIGKILLed
/// after step 5. The survivor's buddy copy (parameters, first moment and the vectors' second moment,
/// beside the replicated statistics) holds the lost shard; the job goes on at tp = 1 from the last
/// committed step, nothing rolled back, on the reference's trajectory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adafactor_tp2_job_that_loses_a_rank_goes_on_at_tp1_from_the_buddy_copy() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = super::common::processes(2).await;
    let mut config = with_adafactor(with_tp(JobConfig::small_llama(12), 2, true), true);
    config.parallel.dp = 1;
    let out = dir.path().join("final.safetensors");
    let job = Job::new(config.clone()).save_final(&out).elastic(1, 2, 10);
    let events = super::run_killing(&cluster, job, &[1]).await;
    assert!(matches!(events.last(), Some(JobEvent::Finished { steps: 12, .. })), "{events:?}");
    let (_, worlds) = super::losses_and_worlds(&events);
    assert_eq!((worlds.first(), worlds.last()), (Some(&2), Some(&1)), "tp 2, then tp 1: {worlds:?}");
    assert!(super::said_degree_change(&events, "2 → 1", "buddy copy"), "{events:?}");
    super::assert_no_step_redone_and_on_the_reference(&events, &config, &out, "adafactor tp=2 losing a rank");
    cluster.shutdown().await;
}

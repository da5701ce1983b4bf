//! The oracle for periodic synchronization (`parallel.sync = "local_sgd" | "diloco"`): jobs on an embedded
//! local cluster of daemon processes equal the single-process reference of the same algorithm
//! (`troupe_model::periodic::ReplicaSet`: R replicas in one process, each with its share of every batch)
//! — every step's loss and the final parameters within 1e-5 relative — for H = 1 and H > 1, and through
//! the defined elastic behaviour: a rank killed inside an interval rolls the job back to the last
//! synchronization and the survivors redo the interval; a joiner takes the last synchronized state from
//! a peer. (H = 1 is not DDP with an inner AdamW: see `troupe_model::periodic`.)

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use troupe_actors::api::{Job, JobEvent, LocalCluster};
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::periodic::ReplicaSet;

const TOLERANCE: f64 = 1e-5;

fn job(sync: &str, every: u64, steps: u64) -> JobConfig {
    let mut config = common::two_block_job(steps);
    config.parallel.sync = sync.into();
    config.parallel.sync_every = every;
    config
}

/// What a run saw: the last loss of each step (a step redone after a rollback counts once, as redone),
/// and each recovery as (committed steps before it, the step it resumed from, the new ranks as indices of
/// the old ones — a joiner as the index of the rank it copied).
#[derive(Default)]
struct Run {
    losses: BTreeMap<u64, f64>,
    regroups: Vec<(u64, u64, Vec<usize>)>,
    rolled_back: Vec<(u64, u64)>,
    /// The first attempt's `Usage` event (its second step), by rank.
    usage: Vec<troupe_actors::protocol::RankUsage>,
}

/// The fault a test injects once `after` steps are committed.
#[derive(Clone, Copy)]
enum Fault {
    None,
    /// SIGKILL the daemon of node `node` (one slot per node: rank `node`).
    Kill {
        node: usize,
        after: u64,
    },
    /// Start one more daemon.
    Join {
        after: u64,
    },
}

async fn run(cluster: &mut LocalCluster, config: &JobConfig, world: usize, out: &Path, fault: Fault) -> Run {
    let job = Job::new(config.clone()).save_final(out);
    let mut job = cluster.client().await.unwrap().submit(job).await.unwrap();
    let (mut seen, mut world, mut committed, mut injected) = (Run::default(), world, 0, false);
    let end = loop {
        let event = tokio::time::timeout(Duration::from_secs(90), job.next_event()).await.expect("progress").unwrap();
        let Some(event) = event else { panic!("stream ended early") };
        match &event {
            JobEvent::Step { step, loss, .. } => {
                seen.losses.insert(*step, *loss);
                committed = *step;
                match fault {
                    Fault::Kill { node, after } if !injected && *step >= after => {
                        common::signal(cluster.pid(node).unwrap(), "KILL");
                        injected = true;
                    }
                    Fault::Join { after } if !injected && *step >= after => {
                        cluster.add_node().unwrap();
                        injected = true;
                    }
                    _ => {}
                }
            }
            JobEvent::RolledBack { from_step, to_step } => seen.rolled_back.push((*from_step, *to_step)),
            JobEvent::Usage { attempt: 1, step: 2, ranks } => seen.usage.clone_from(ranks),
            JobEvent::Recovered { step, world: new, .. } => {
                let members: Vec<usize> = match fault {
                    Fault::Kill { node, .. } if *new < world => (0..world).filter(|&r| r != node).collect(),
                    _ => (0..world).chain(std::iter::repeat_n(0, new.saturating_sub(world))).collect(),
                };
                assert_eq!(members.len(), *new, "the recovered world");
                seen.regroups.push((committed, *step, members));
                world = *new;
            }
            e if e.is_terminal() => break event,
            _ => {}
        }
    };
    assert!(matches!(end, JobEvent::Finished { steps, .. } if steps == config.train.steps), "{end:?}");
    seen
}

/// Replays `run` on the reference (`world` replicas at first, regrouped as the run was) and compares.
fn check(config: &JobConfig, world: usize, run: &Run, out: &Path, what: &str) {
    tch::set_num_threads(1);
    let mut set = ReplicaSet::new(config, world).unwrap();
    let mut losses = BTreeMap::new();
    let mut advance = |set: &mut ReplicaSet, to: u64| {
        while set.step() < to {
            let step = set.step() + 1; // events count committed steps from 1
            losses.insert(step, set.train_step());
        }
    };
    for (before, resumed, members) in &run.regroups {
        advance(&mut set, *before);
        set.regroup(members).unwrap();
        assert_eq!(set.step(), *resumed, "{what}: the run resumed from the reference's last synchronization");
    }
    advance(&mut set, config.train.steps);
    let (actual, expected): (Vec<f64>, Vec<f64>) = run.losses.iter().map(|(step, loss)| (*loss, losses[step])).unzip();
    assert_eq!(actual.len() as u64, config.train.steps, "{what}: a loss per step");
    let loss_diff = worst_loss_diff(&actual, &expected);
    let params = common::saved_params(out, set.first());
    let comparison = compare_params(set.first().model.specs(), &params, &set.params());
    eprintln!("{what}: loss diff {loss_diff:.1e}, params {comparison:?}, regroups {:?}", run.regroups);
    assert!(loss_diff <= TOLERANCE, "{what}: losses differ by {loss_diff:e}");
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_sgd_and_diloco_on_daemon_processes_equal_the_reference_for_h_1_and_h_over_1() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = common::processes(2).await;
    for (sync, every, steps) in [("local_sgd", 3, 10), ("diloco", 1, 4), ("diloco", 4, 10)] {
        let config = job(sync, every, steps);
        let out = dir.path().join(format!("{sync}-{every}.safetensors"));
        let seen = run(&mut cluster, &config, 2, &out, Fault::None).await;
        assert!(seen.regroups.is_empty(), "no fault, no recovery");
        check(&config, 2, &seen, &out, &format!("{sync} H={every} on 2 ranks"));
        // What a step moves: the loss and norm, and at an interval's end (after step 2 only when H = 1)
        // every parameter — H times fewer bytes per step than DDP's gradients over an interval.
        let n = config.model.param_count() as u64;
        let sent = if every == 1 { 4 * (n + 2) } else { 4 * 2 };
        assert_eq!(seen.usage.len(), 2, "{sync} H={every}: a usage event of both ranks");
        for u in &seen.usage {
            assert_eq!((u.param_bytes, u.grad_bytes), (4 * n, 4 * n), "{sync} H={every}: {u:?}");
            assert_eq!(u.sent_bytes(), sent, "{sync} H={every}: {u:?}");
        }
    }
    cluster.shutdown().await;
}

/// Streaming DiLoCo (`parallel.fragments` = 2 and 4; each fragment synchronized on its own offset in
/// the interval, the others keeping their local progress) on two daemons equals the reference replaying
/// the same schedule, and with one fragment it is the plain DiLoCo above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_diloco_on_daemon_processes_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = common::processes(2).await;
    for (blocks, fragments, every, steps) in [(2, 2, 4, 10), (4, 4, 8, 14)] {
        let mut config = job("diloco", every, steps);
        (config.model.n_layers, config.parallel.fragments) = (blocks, fragments);
        let out = dir.path().join(format!("streaming-{fragments}.safetensors"));
        let seen = run(&mut cluster, &config, 2, &out, Fault::None).await;
        assert!(seen.regroups.is_empty(), "no fault, no recovery");
        check(&config, 2, &seen, &out, &format!("streaming diloco P={fragments} H={every} on 2 ranks"));
    }
    cluster.shutdown().await;
}

/// Streaming DiLoCo (H = 4, 2 fragments: one synchronizes after every second step) on three daemons, one
/// SIGKILLed after step 5: the job rolls back to the last step after which a fragment synchronized (an
/// even step), the survivors keep their own unsynchronized fragment, and the run equals the reference
/// regrouped at the same step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_diloco_with_a_rank_killed_rolls_back_to_the_last_fragment_sync_and_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = job("diloco", 4, 16);
    config.parallel.fragments = 2;
    let mut cluster = common::processes(3).await;
    let out = dir.path().join("final.safetensors");
    let seen = run(&mut cluster, &config, 3, &out, Fault::Kill { node: 2, after: 5 }).await;
    let resumed: Vec<u64> = seen.regroups.iter().map(|r| r.1).collect();
    assert!(!resumed.is_empty() && resumed.iter().all(|s| s % 2 == 0), "resumed at fragment syncs: {resumed:?}");
    check(&config, 3, &seen, &out, "streaming diloco P=2 H=4, 3 ranks then 2");
    cluster.shutdown().await;
}

/// DiLoCo (H = 4) on three daemons, one SIGKILLed after step 5: the survivors give back the state of
/// step 4 (their last synchronization), the job rolls back to it — no checkpoint needed — and the two
/// ranks redo the interval; the whole run equals the reference regrouped at the same step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_killed_mid_interval_rolls_the_job_back_to_the_last_sync_and_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let config = job("diloco", 4, 16);
    let mut cluster = common::processes(3).await;
    let out = dir.path().join("final.safetensors");
    let seen = run(&mut cluster, &config, 3, &out, Fault::Kill { node: 2, after: 5 }).await;
    let resumed: Vec<u64> = seen.regroups.iter().map(|r| r.1).collect();
    assert!(!resumed.is_empty() && resumed.iter().all(|s| s % 4 == 0), "resumed at synchronizations: {resumed:?}");
    assert!(seen.rolled_back.iter().all(|(_, to)| to % 4 == 0), "{:?}", seen.rolled_back);
    assert!(!seen.rolled_back.is_empty(), "the kill landed inside an interval: {:?}", seen.regroups);
    check(&config, 3, &seen, &out, "diloco H=4, 3 ranks then 2");
    cluster.shutdown().await;
}

/// Adafactor as the inner optimizer (each replica's factored statistics its own): DiLoCo (H = 4) on
/// three daemons, one SIGKILLed after step 5; the survivors roll back to step 4 with their own
/// statistics and the run equals the Adafactor reference regrouped at the same step. The small Llama,
/// as every Adafactor oracle (runtime-semantics, "The oracle and GPT-2's key bias").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adafactor_inside_diloco_with_a_rank_killed_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = JobConfig::small_llama(12);
    (config.train.global_batch, config.train.micro_batch, config.train.torch_threads) = (8, 2, 1);
    (config.parallel.sync, config.parallel.sync_every) = ("diloco".into(), 4);
    config.train.optimizer = "adafactor".into();
    let mut cluster = common::processes(3).await;
    let out = dir.path().join("final.safetensors");
    let seen = run(&mut cluster, &config, 3, &out, Fault::Kill { node: 2, after: 5 }).await;
    let resumed: Vec<u64> = seen.regroups.iter().map(|r| r.1).collect();
    assert!(!resumed.is_empty() && resumed.iter().all(|s| s % 4 == 0), "resumed at synchronizations: {resumed:?}");
    check(&config, 3, &seen, &out, "adafactor in diloco H=4, 3 ranks then 2");
    cluster.shutdown().await;
}

/// DiLoCo (H = 3) on two daemons, a third joining after step 4: the job resumes from the last
/// synchronization, the joiner with rank 0's state (parameters, AdamW moments, outer momentum), the
/// others with their own moments; the run equals the reference with the same third replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_takes_the_last_synchronized_state_and_the_run_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let config = job("diloco", 3, 90);
    let mut cluster = common::processes(2).await;
    let out = dir.path().join("final.safetensors");
    let seen = run(&mut cluster, &config, 2, &out, Fault::Join { after: 4 }).await;
    assert!(seen.regroups.iter().any(|r| r.2.len() == 3), "the joiner trained: {:?}", seen.regroups);
    check(&config, 2, &seen, &out, "diloco H=3, 2 ranks then 3");
    cluster.shutdown().await;
}

/// `troupe train --nodes 2 --sync diloco --sync-every 4` (gpt-tiny, an embedded local cluster of two
/// daemons): every step's loss in `--json` and the `--save-final` parameters equal the reference's.
#[test]
fn troupe_train_with_sync_diloco_on_an_embedded_cluster_equals_the_reference() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("final.safetensors");
    let flags = ["train", "--nodes", "2", "--sync", "diloco", "--sync-every", "4", "--steps", "10", "--json"];
    let output = std::process::Command::new(common::binary()).args(flags).arg("--save-final").arg(&out).output();
    let output = output.unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let mut seen = Run::default();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let event: serde_json::Value = serde_json::from_str(line).unwrap();
        if event["event"] == "step" {
            seen.losses.insert(event["step"].as_u64().unwrap(), event["loss"].as_f64().unwrap());
        }
    }
    let mut config = JobConfig::default();
    config.train.steps = 10;
    (config.parallel.nodes, config.parallel.sync, config.parallel.sync_every) = (2, "diloco".into(), 4);
    check(&config, 2, &seen, &out, "troupe train --nodes 2 --sync diloco --sync-every 4");
}

/// A checkpointed job continued by a second run (`checkpoint.dir` shared; DiLoCo and local SGD, H = 4):
/// the first job trains 8 steps on two daemons and checkpoints every 4, the second continues it to 16
/// from the checkpoint of step 8. On the same world every rank resumes its own inner AdamW moments and
/// DiLoCo its outer momentum, so the run equals the uninterrupted reference; on three daemons the third
/// rank resumes as saved rank 0 (`rank mod 2`), as the reference regrouped to [0, 1, 0] at step 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpointed_job_resumed_on_daemons_equals_the_uninterrupted_reference_and_a_larger_world_copies_rank_mod_n()
{
    let dir = tempfile::tempdir().unwrap();
    let (mut cluster, mut nodes) = (common::processes(2).await, 2);
    for (sync, world) in [("diloco", 2), ("local_sgd", 2), ("diloco", 3)] {
        let what = format!("{sync} H=4 checkpointed at step 8 on 2 ranks, resumed on {world}");
        let mut config = job(sync, 4, 16);
        // A schedule that does not depend on `train.steps`, so the 8-step first run follows the 16-step one.
        config.train.decay_steps = 16;
        config.checkpoint.dir = Some(dir.path().join(format!("ckpt-{sync}-{world}")));
        config.checkpoint.every_steps = 4;
        let mut first = config.clone();
        first.train.steps = 8;
        run(&mut cluster, &first, 2, &dir.path().join("first.safetensors"), Fault::None).await;
        // `troupe checkpoint list` shows the ranks' part and the outer momentum.
        let listed = std::process::Command::new(common::binary())
            .args(["checkpoint", "list", "--json"])
            .arg(config.checkpoint.dir.as_ref().unwrap())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&listed.stdout);
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let outer = sync == "diloco";
        assert_eq!((last["step"].as_u64(), last["version"].as_u64()), (Some(8), Some(3)), "{what}: {stdout}");
        assert_eq!(last["periodic"], serde_json::json!({ "ranks": 2, "outer_momentum": outer }), "{what}: {stdout}");
        while nodes < world {
            cluster.add_node().unwrap();
            nodes += 1;
        }
        // In the view before the job is submitted: a node joining after would regroup it at a later step.
        cluster.wait_for_members(world).await.unwrap();
        let out = dir.path().join(format!("{sync}-{world}.safetensors"));
        let seen = run(&mut cluster, &config, world, &out, Fault::None).await;
        assert_eq!(seen.losses.keys().next(), Some(&9), "{what}: the second run continued from step 8");
        assert!(seen.regroups.is_empty(), "{what}: trained on {world} ranks throughout: {:?}", seen.regroups);

        tch::set_num_threads(1);
        let mut reference = ReplicaSet::new(&config, 2).unwrap();
        while reference.step() < 8 {
            reference.train_step();
        }
        reference.regroup(&(0..world).map(|r| r % 2).collect::<Vec<_>>()).unwrap();
        let mut expected = Vec::new();
        while reference.step() < 16 {
            expected.push(reference.train_step());
        }
        let actual: Vec<f64> = seen.losses.values().copied().collect();
        let loss_diff = worst_loss_diff(&actual, &expected);
        let params = common::saved_params(&out, reference.first());
        let comparison = compare_params(reference.first().model.specs(), &params, &reference.params());
        eprintln!("{what}: loss diff {loss_diff:.1e}, params {comparison:?}");
        assert!(loss_diff <= TOLERANCE, "{what}: losses differ by {loss_diff:e}");
        assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
    }
    cluster.shutdown().await;
}

//! The oracle for the "every rank has a GPU of its own" paths (issue 31): DDP flattens each bucket on
//! the rank's device and sums it through a device plane, ZeRO-1/2 reduce the flat gradient and gather
//! the masters there, ZeRO-3 gathers each unit's parameters and reduces its gradient there — NCCL on
//! GPUs; here the in-memory stand-in with NCCL's contract (`FakeNccl`), so
//! CI runs the same engine code on CPU tensors. Per-step
//! losses and final parameters equal the single-process reference within 1e-5 (fp32), replicas stay
//! bit-identical; a rank lost mid-step fails its peers' calls at once (not after the collective
//! timeout), and the survivors, rebuilt on a fresh communicator for the next epoch, stay on the
//! reference's trajectory.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::Tensor;
use troupe_actors::engine::device_plane::FakeNccl;
use troupe_actors::engine::{CommittedState, DataParallelReplica, ShardMode, ShardedReplica, StepEngine};
use troupe_actors::protocol::CollectiveKind;
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::generate::Evaluation;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const STEPS: u64 = 12;
const TOLERANCE: f64 = 1e-5;
/// Small buckets, so each step sums several on the device.
const BUCKET_BYTES: usize = 64 << 10;

fn job() -> JobConfig {
    let mut config = JobConfig::default();
    config.train.steps = STEPS;
    config.train.global_batch = 8;
    config.train.micro_batch = 2;
    config
}

fn reference(config: &JobConfig) -> (Vec<f64>, Vec<Tensor>) {
    tch::set_num_threads(1);
    let mut trainer = Trainer::new(config.clone()).unwrap();
    let losses = (0..config.train.steps).map(|_| trainer.train_step().loss).collect();
    (losses, trainer.param_values())
}

fn bits(t: &Tensor) -> Vec<u32> {
    let values: Vec<f32> = Vec::try_from(t.flatten(0, -1)).unwrap();
    values.into_iter().map(f32::to_bits).collect()
}

fn comm(transport: MemoryTransport, epoch: u64) -> Communicator<MemoryTransport> {
    Communicator::new(Arc::new(transport), 0, epoch, CollectiveConfig::from(&TransportConfig::default()))
}

fn on_thread<R: Send + 'static>(body: impl FnOnce() -> R + Send + 'static) -> std::thread::JoinHandle<R> {
    std::thread::spawn(move || {
        tch::set_num_threads(1);
        body()
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// What the survivor of a lost peer saw — its losses and final parameters over the whole run, the error
/// of the step that failed and how long that took — checked: the call failed at once because the peer
/// was gone (not after the 60 s timeout), and the run stayed on the reference's trajectory.
fn survived(run: (Vec<f64>, Vec<Tensor>, String, Duration), (ref_losses, ref_params): (&[f64], &[Tensor])) {
    let (losses, params, error, failed_after) = run;
    assert!(error.contains("aborted") && error.contains("rank 1 is gone"), "{error}");
    assert!(failed_after < Duration::from_secs(10), "failed after {failed_after:?}, not at once");
    let loss_diff = worst_loss_diff(&losses, ref_losses);
    assert!(loss_diff <= TOLERANCE, "losses differ by {loss_diff:e}");
    let specs = troupe_model::model::param_specs(&job().model);
    let comparison = compare_params(&specs, &params, ref_params);
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
}

/// Runs `body` on `world` ranks, each on a thread with its own runtime, given a fresh trainer of
/// `config`, its communicator (epoch 1) and its member of one fake-NCCL group: each rank's result, in
/// rank order.
fn on_device_ranks<R, F, Fut>(config: &JobConfig, world: usize, body: F) -> Vec<R>
where
    F: Fn(Trainer, Communicator<MemoryTransport>, FakeNccl) -> Fut + Send + Clone + 'static,
    Fut: Future<Output = R>,
    R: Send + 'static,
{
    let planes = FakeNccl::group(world, Duration::from_secs(60));
    let handles: Vec<_> = MemoryTransport::mesh(world, 4096)
        .into_iter()
        .zip(planes)
        .map(|(transport, plane)| {
            let (config, body) = (config.clone(), body.clone());
            on_thread(move || runtime().block_on(body(Trainer::new(config).unwrap(), comm(transport, 1), plane)))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// `world` DDP ranks summing their gradients through a fake-NCCL group: each rank's losses and final
/// parameters, and the name of the plane its engine used.
fn ddp_on_devices(config: &JobConfig, world: usize) -> Vec<(Vec<f64>, Vec<Tensor>, Option<&'static str>)> {
    let steps = config.train.steps;
    on_device_ranks(config, world, move |trainer, comm, plane| async move {
        let replica = DataParallelReplica::new(trainer, comm, BUCKET_BYTES).await.unwrap();
        let mut replica = replica.with_device_plane(Box::new(plane));
        assert!(replica.buckets().len() > 1, "several buckets per step");
        let mut losses = Vec::new();
        for _ in 0..steps {
            losses.push(replica.train_step().await.unwrap().loss);
        }
        (losses, replica.trainer().param_values(), replica.device_plane())
    })
}

#[test]
fn ddp_through_the_device_plane_equals_the_reference_at_2_and_3_ranks() {
    let config = job();
    let (ref_losses, ref_params) = reference(&config);
    let specs = troupe_model::model::param_specs(&config.model);
    for world in [2, 3] {
        let ranks = ddp_on_devices(&config, world);
        let (losses, params, plane) = &ranks[0];
        assert_eq!(*plane, Some("fake-nccl"), "the engine summed on the device plane");
        let loss_diff = worst_loss_diff(losses, &ref_losses);
        assert!(loss_diff <= TOLERANCE, "dp={world}: losses differ by {loss_diff:e}");
        let comparison = compare_params(&specs, params, &ref_params);
        assert!(comparison.within(TOLERANCE), "dp={world}: {comparison:?}");
        for (rank, (other_losses, other_params, _)) in ranks.iter().enumerate().skip(1) {
            assert_eq!(other_losses, losses, "rank {rank}'s losses");
            for (a, b) in other_params.iter().zip(params) {
                assert_eq!(bits(a), bits(b), "rank {rank}'s replica diverged from rank 0's");
            }
        }
        println!("dp={world} on the device plane: loss diff {loss_diff:.1e}, params worst {:.1e}", comparison.worst);
    }
}

/// Two ranks; rank 1 dies (its communicator dropped, as a killed process's) during step `lost_at`.
/// Rank 0's all-reduce fails at once, well before the 60 s timeout; the attempt ends, rank 0 keeps its
/// committed state and continues alone on a fresh communicator (the next epoch's): the whole run equals
/// the reference, since DDP's update does not depend on how the batch is split.
#[test]
fn a_lost_rank_fails_the_device_all_reduce_at_once_and_the_survivor_stays_on_the_reference() {
    let config = job();
    let lost_at = 5;
    let (ref_losses, ref_params) = reference(&config);
    let mut planes = FakeNccl::group(2, Duration::from_secs(60));
    let (plane1, plane0) = (planes.pop().unwrap(), planes.pop().unwrap());
    let mut transports = MemoryTransport::mesh(2, 4096);
    let (t1, t0) = (transports.pop().unwrap(), transports.pop().unwrap());
    let config1 = config.clone();
    let doomed = on_thread(move || {
        runtime().block_on(async move {
            let trainer = Trainer::new(config1).unwrap();
            let replica = DataParallelReplica::new(trainer, comm(t1, 1), BUCKET_BYTES).await.unwrap();
            let mut replica = replica.with_device_plane(Box::new(plane1));
            for _ in 0..lost_at {
                replica.train_step().await.unwrap();
            }
            // Dies during the next step: after its backward, before its first bucket's all-reduce.
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(replica);
        })
    });
    let survivor = on_thread(move || {
        runtime().block_on(async move {
            let trainer = Trainer::new(config.clone()).unwrap();
            let replica = DataParallelReplica::new(trainer, comm(t0, 1), BUCKET_BYTES).await.unwrap();
            let mut replica = replica.with_device_plane(Box::new(plane0));
            let mut losses = Vec::new();
            for _ in 0..lost_at {
                losses.push(replica.train_step().await.unwrap().loss);
            }
            let failing = Instant::now();
            let error = replica.train_step().await.unwrap_err().to_string();
            let failed_after = failing.elapsed();
            // The next epoch: one rank, its own communicator and a fresh plane, from the committed state.
            let trainer = replica.into_trainer();
            assert_eq!(trainer.step, lost_at, "the failed step was not applied");
            let alone = comm(MemoryTransport::mesh(1, 4096).remove(0), 2);
            let mut replica = DataParallelReplica::without_sync(trainer, alone, BUCKET_BYTES)
                .with_device_plane(Box::new(FakeNccl::group(1, Duration::from_secs(60)).remove(0)));
            while replica.trainer().step < config.train.steps {
                losses.push(replica.train_step().await.unwrap().loss);
            }
            (losses, replica.trainer().param_values(), error, failed_after)
        })
    });
    doomed.join().unwrap();
    survived(survivor.join().unwrap(), (&ref_losses, &ref_params));
}

/// One rank's run: its losses, final parameters, gradient collective and device plane.
type RankRun = (Vec<f64>, Vec<Tensor>, &'static str, Option<&'static str>);

/// `world` ZeRO-1/2 ranks (`mode`) reducing their gradients and gathering their masters through a
/// fake-NCCL group: each rank's run.
fn zero_on_devices(config: &JobConfig, world: usize, mode: ShardMode) -> Vec<RankRun> {
    let steps = config.train.steps;
    on_device_ranks(config, world, move |trainer, comm, plane| async move {
        let mut replica = ShardedReplica::new(trainer, comm, mode).await.unwrap();
        replica.set_device_plane(Box::new(plane)).unwrap();
        let mut losses = Vec::new();
        for _ in 0..steps {
            losses.push(replica.train_step().await.unwrap().loss);
        }
        let collective = StepEngine::gradient_collective(&replica);
        (losses, replica.trainer().param_values(), collective, replica.device_plane())
    })
}

/// ZeRO-1 (all-reduce) and ZeRO-2 (reduce-scatter) on the device plane, at 2 and 3 ranks — 3 does not
/// divide the model's length, so the balanced shards go through NCCL's equal pieces padded — equal the
/// single-process reference, and every rank's replica (its parameters all-gathered on the device)
/// matches rank 0's bit for bit.
#[test]
fn zero1_and_zero2_through_the_device_plane_equal_the_reference_at_2_and_3_ranks() {
    let config = job();
    let (ref_losses, ref_params) = reference(&config);
    let specs = troupe_model::model::param_specs(&config.model);
    let total: usize = specs.iter().map(|s| s.numel()).sum();
    assert_ne!(total % 3, 0, "the model's length is not a multiple of 3: the padded path runs");
    for (mode, collective) in [(ShardMode::Zero1, "all-reduce (device)"), (ShardMode::Zero2, "reduce-scatter (device)")]
    {
        for world in [2, 3] {
            let ranks = zero_on_devices(&config, world, mode);
            let (losses, params, used, plane) = &ranks[0];
            assert_eq!((*used, *plane), (collective, Some("fake-nccl")), "{mode:?}: reduced on the device plane");
            let loss_diff = worst_loss_diff(losses, &ref_losses);
            assert!(loss_diff <= TOLERANCE, "{mode:?} dp={world}: losses differ by {loss_diff:e}");
            let comparison = compare_params(&specs, params, &ref_params);
            assert!(comparison.within(TOLERANCE), "{mode:?} dp={world}: {comparison:?}");
            for (rank, (other_losses, other_params, _, _)) in ranks.iter().enumerate().skip(1) {
                assert_eq!(other_losses, losses, "{mode:?}: rank {rank}'s losses");
                for (a, b) in other_params.iter().zip(params) {
                    assert_eq!(bits(a), bits(b), "{mode:?}: rank {rank}'s replica diverged from rank 0's");
                }
            }
            println!(
                "{mode:?} dp={world} on the device plane: loss diff {loss_diff:.1e}, params worst {:.1e}",
                comparison.worst
            );
        }
    }
}

/// ZeRO-2 on two ranks; rank 1 dies during step `lost_at`. Rank 0's reduce-scatter fails at once; its
/// committed state (its owner's shard and its copy of rank 1's: one buddy) is kept, and it continues
/// alone on a fresh communicator — the state resharded to a world of one from what it holds — on the
/// reference's trajectory.
#[test]
fn zero2_on_the_device_plane_survives_a_lost_rank_from_its_buddy_copy() {
    survives_a_lost_rank(ShardMode::Zero2);
}

/// The same for ZeRO-3: rank 0's first gather of the step (a grouped broadcast) fails at once.
#[test]
fn zero3_on_the_device_plane_survives_a_lost_rank_from_its_buddy_copy() {
    survives_a_lost_rank(ShardMode::Zero3);
}

fn survives_a_lost_rank(mode: ShardMode) {
    let config = job();
    let lost_at = 5;
    let (ref_losses, ref_params) = reference(&config);
    let mut planes = FakeNccl::group(2, Duration::from_secs(60));
    let (plane1, plane0) = (planes.pop().unwrap(), planes.pop().unwrap());
    let mut transports = MemoryTransport::mesh(2, 4096);
    let (t1, t0) = (transports.pop().unwrap(), transports.pop().unwrap());
    let start = move |config: JobConfig, transport: MemoryTransport, plane: FakeNccl| async move {
        let trainer = Trainer::new(config).unwrap();
        let state = CommittedState::Full(Box::new(trainer));
        let mut replica = ShardedReplica::adopt(state, comm(transport, 1), mode, 1, None);
        replica.sync().await.unwrap();
        replica.set_device_plane(Box::new(plane)).unwrap();
        replica
    };
    let config1 = config.clone();
    let doomed = on_thread(move || {
        runtime().block_on(async move {
            let mut replica = start(config1, t1, plane1).await;
            for _ in 0..lost_at {
                replica.train_step().await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            drop(replica);
        })
    });
    let survivor = on_thread(move || {
        runtime().block_on(async move {
            let mut replica = start(config.clone(), t0, plane0).await;
            let mut losses = Vec::new();
            for _ in 0..lost_at {
                losses.push(replica.train_step().await.unwrap().loss);
            }
            let failing = Instant::now();
            let error = replica.train_step().await.unwrap_err().to_string();
            let failed_after = failing.elapsed();
            let state = replica.into_state().await.expect("the committed state is kept");
            assert_eq!(state.step(), lost_at, "the failed step was not applied");
            let alone = comm(MemoryTransport::mesh(1, 4096).remove(0), 2);
            let mut replica = ShardedReplica::adopt(state, alone, mode, 1, None);
            replica.sync().await.unwrap();
            replica.set_device_plane(Box::new(FakeNccl::group(1, Duration::from_secs(60)).remove(0))).unwrap();
            while replica.trainer().step < config.train.steps {
                losses.push(replica.train_step().await.unwrap().loss);
            }
            replica.refresh_params().await.unwrap(); // ZeRO-3 holds none between steps
            (losses, replica.trainer().param_values(), error, failed_after)
        })
    });
    doomed.join().unwrap();
    survived(survivor.join().unwrap(), (&ref_losses, &ref_params));
}

/// ZeRO-3's runs: each rank's losses, final parameters (gathered on the device plane after the last
/// step), validation loss, and the collectives its steps called on the host communicator.
struct Zero3Run {
    losses: Vec<f64>,
    params: Vec<Tensor>,
    eval: Evaluation,
    plane: Option<&'static str>,
    host_collectives: BTreeSet<CollectiveKind>,
}

fn zero3_on_devices(config: &JobConfig, world: usize) -> Vec<Zero3Run> {
    let steps = config.train.steps;
    on_device_ranks(config, world, move |trainer, comm, plane| async move {
        let mut replica = ShardedReplica::new(trainer, comm, ShardMode::Zero3).await.unwrap();
        replica.set_device_plane(Box::new(plane)).unwrap();
        let (mut losses, mut host_collectives) = (Vec::new(), BTreeSet::new());
        for _ in 0..steps {
            losses.push(replica.train_step().await.unwrap().loss);
            let usage = StepEngine::usage(&mut replica).expect("a synced rank reports its usage");
            host_collectives.extend(usage.sent.iter().filter(|s| s.calls > 0).map(|s| s.collective));
        }
        let eval = replica.evaluate().await.unwrap().expect("held out");
        replica.refresh_params().await.unwrap();
        let params = replica.trainer().param_values();
        Zero3Run { losses, params, eval, plane: replica.device_plane(), host_collectives }
    })
}

/// ZeRO-3 on the device plane — each unit's parameters gathered by grouped broadcasts from its owners'
/// pieces and its gradient reduced onto them there — at 2 and 3 ranks (3 does not divide the units:
/// they straddle owners), then at 3 with recomputation and a tied head (whose unit spans the embedding
/// matrix too): losses, validation loss and final parameters equal the single-process reference, every
/// rank's parameters are rank 0's bits, and the host communicator carried only the step's totals (one
/// all-reduce of a few floats), none of the units' broadcasts or reductions.
#[test]
fn zero3_through_the_device_plane_equals_the_reference() {
    let mut plain = job();
    plain.data.val_fraction = 0.1;
    plain.train.eval_samples = 5;
    let mut tied = plain.clone();
    tied.parallel.recompute = true;
    tied.model.tie_word_embeddings = true;
    for (name, config, worlds) in [("plain", &plain, &[2, 3][..]), ("recompute, tied", &tied, &[3][..])] {
        config.validate().unwrap();
        let (ref_losses, ref_params) = reference(config);
        let ref_eval = {
            let mut trainer = Trainer::new(config.clone()).unwrap();
            for _ in 0..config.train.steps {
                trainer.train_step();
            }
            trainer.evaluate().expect("held out")
        };
        let specs = troupe_model::model::param_specs(&config.model);
        for &world in worlds {
            let ranks = zero3_on_devices(config, world);
            let run = &ranks[0];
            assert_eq!(run.plane, Some("fake-nccl"), "{name} dp={world}: the device plane was used");
            let loss_diff = worst_loss_diff(&run.losses, &ref_losses);
            assert!(loss_diff <= TOLERANCE, "{name} dp={world}: losses differ by {loss_diff:e}");
            let comparison = compare_params(&specs, &run.params, &ref_params);
            assert!(comparison.within(TOLERANCE), "{name} dp={world}: {comparison:?}");
            let eval_diff = (run.eval.loss - ref_eval.loss).abs() / ref_eval.loss;
            assert!(eval_diff <= TOLERANCE, "{name} dp={world}: validation loss differs by {eval_diff:e}");
            for (rank, other) in ranks.iter().enumerate() {
                assert_eq!(other.losses, run.losses, "{name}: rank {rank}'s losses");
                for (a, b) in other.params.iter().zip(&run.params) {
                    assert_eq!(bits(a), bits(b), "{name}: rank {rank}'s parameters differ from rank 0's");
                }
                assert_eq!(
                    other.host_collectives,
                    BTreeSet::from([CollectiveKind::AllReduce]),
                    "{name} dp={world}: rank {rank}'s host collectives"
                );
            }
            println!(
                "ZeRO-3 {name} dp={world} on the device plane: loss diff {loss_diff:.1e}, params worst {:.1e}, eval diff {eval_diff:.1e}",
                comparison.worst
            );
        }
    }
}

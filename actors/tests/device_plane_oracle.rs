//! The oracle for the "every rank has a GPU of its own" paths (issue 31): DDP flattens each bucket on
//! the rank's device and sums it through a device plane, ZeRO-1/2 reduce the flat gradient and gather
//! the masters there, ZeRO-3 gathers each unit's parameters and reduces its gradient there — NCCL on
//! GPUs; here the in-memory stand-in with NCCL's contract (`FakeNccl`), so
//! CI runs the same engine code on CPU tensors. Per-step
//! losses and final parameters equal the single-process reference within 1e-5 (fp32), replicas stay
//! bit-identical; a rank lost mid-step fails its peers' calls at once (not after the collective
//! timeout), and the survivors, rebuilt on a fresh communicator for the next epoch, stay on the
//! reference's trajectory. Tensor parallelism (× data parallelism) runs its tensor group's
//! collectives and its data-parallel gradient sum through device planes the same way, for both model
//! families; a tensor rank lost mid-step fails its peer's plane call at once, and the survivor keeps
//! the whole committed state from its own shard and its buddy copy.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::Tensor;
use troupe_actors::engine::device_plane::FakeNccl;
use troupe_actors::engine::{
    CommittedState, DataParallelReplica, ShardMode, ShardedReplica, StepEngine, TensorParallelReplica,
};
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

/// `config` at tensor degree `tp` with `dp` model replicas (sequence parallelism on), 8 steps.
fn tensor_job(mut config: JobConfig, tp: usize, dp: usize) -> JobConfig {
    config.train.steps = 8;
    config.train.global_batch = 8;
    config.train.micro_batch = 2;
    (config.parallel.tp, config.parallel.dp, config.parallel.sp) = (tp, dp, true);
    config
}

/// The single-process reference of a tensor-parallel `config` (tp = 1).
fn tensor_reference(config: &JobConfig) -> (Vec<f64>, Vec<Tensor>) {
    let mut single = config.clone();
    (single.parallel.tp, single.parallel.dp) = (1, 1);
    reference(&single)
}

/// Rank `rank`'s engine of a `config` job (its tensor degree) on `transport`, its tensor group's
/// collectives on `tensor` and its data-parallel sum on `data`, sharded for the attempt.
async fn tensor_rank(
    config: &JobConfig,
    transport: Arc<MemoryTransport>,
    tensor: FakeNccl,
    data: Option<FakeNccl>,
) -> TensorParallelReplica<MemoryTransport> {
    let collective = CollectiveConfig::from(&TransportConfig::default());
    let state = CommittedState::Full(Box::new(Trainer::new(config.clone()).unwrap()));
    let (tp, comm) = (config.parallel.tp, Communicator::new(transport, 0, 1, collective.clone()));
    let mut engine = TensorParallelReplica::adopt(state, comm, collective, tp).unwrap();
    engine.set_device_planes(Box::new(tensor), data.map(|d| Box::new(d) as Box<_>)).unwrap();
    engine.sync(None).await.unwrap();
    engine
}

/// One step of a tensor rank: reduce, then apply (every rank commits it); the step's loss.
async fn tensor_step(engine: &mut TensorParallelReplica<MemoryTransport>) -> Result<f64, String> {
    let reduced = engine.reduce().await.map_err(|e| e.to_string())?;
    engine.apply(reduced).await;
    Ok(reduced.loss)
}

/// A tensor rank's run: its losses, the whole parameters its group gathers at the end, its plane's name
/// and the bytes of its buddy copy.
type TensorRun = (Vec<f64>, Vec<Tensor>, Option<&'static str>, u64);

/// Every rank of a tp × dp job through fake-NCCL planes (rank t + tp·d is tensor rank t of replica d:
/// one tensor group per replica, one data-parallel group per tensor index).
fn tensor_parallel_on_devices(config: &JobConfig) -> Vec<TensorRun> {
    let (tp, dp) = (config.parallel.tp, config.parallel.dp);
    let timeout = Duration::from_secs(60);
    let mut tensor: Vec<Vec<Option<FakeNccl>>> =
        (0..dp).map(|_| FakeNccl::group(tp, timeout).into_iter().map(Some).collect()).collect();
    let mut data: Vec<Vec<Option<FakeNccl>>> =
        (0..tp).map(|_| FakeNccl::group(dp, timeout).into_iter().map(Some).collect()).collect();
    let handles: Vec<_> = MemoryTransport::mesh(tp * dp, 4096)
        .into_iter()
        .enumerate()
        .map(|(rank, transport)| {
            let (t, d) = (rank % tp, rank / tp);
            let tensor_plane = tensor[d][t].take().unwrap();
            let data_plane = (dp > 1).then(|| data[t][d].take().unwrap());
            let config = config.clone();
            on_thread(move || {
                runtime().block_on(async move {
                    let mut engine = tensor_rank(&config, Arc::new(transport), tensor_plane, data_plane).await;
                    let (mut losses, mut buddy) = (Vec::new(), None);
                    for _ in 0..config.train.steps {
                        losses.push(tensor_step(&mut engine).await.unwrap());
                        buddy = buddy.or_else(|| engine.usage().map(|u| u.buddy_bytes));
                    }
                    let plane = engine.device_plane();
                    engine.finish().await.unwrap();
                    (losses, engine.trainer().param_values(), plane, buddy.expect("a step's usage"))
                })
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn tensor_parallelism_through_device_planes_equals_the_reference_for_both_families() {
    let cases = [
        ("llama tp=2", tensor_job(JobConfig::small_llama(8), 2, 1)),
        ("llama tp=2 x dp=2", tensor_job(JobConfig::small_llama(8), 2, 2)),
        ("gpt2 tp=2 x dp=2, no sp", {
            let mut config = tensor_job(JobConfig::small(8), 2, 2);
            config.parallel.sp = false;
            config
        }),
        // No buddy copies: a shard's worth of device memory per rank (×4: parameters, gradients, moments)
        // given back for recovery from another replica or the checkpoint.
        ("llama tp=2 x dp=2, checkpoint.replicas = 0", {
            let mut config = tensor_job(JobConfig::small_llama(8), 2, 2);
            config.checkpoint.replicas = 0;
            config
        }),
    ];
    for (what, config) in cases {
        let (ref_losses, ref_params) = tensor_reference(&config);
        let specs = troupe_model::model::param_specs(&config.model);
        let ranks = tensor_parallel_on_devices(&config);
        for (rank, (losses, params, plane, buddy)) in ranks.iter().enumerate() {
            assert_eq!(*plane, Some("fake-nccl"), "{what}: rank {rank}'s collectives ran on its device planes");
            let copies = config.checkpoint.replicas > 0;
            assert_eq!(*buddy > 0, copies, "{what}: rank {rank}'s buddy copy holds {buddy} bytes");
            let loss_diff = worst_loss_diff(losses, &ref_losses);
            assert!(loss_diff <= TOLERANCE, "{what}: rank {rank}'s losses differ by {loss_diff:e}");
            let comparison = compare_params(&specs, params, &ref_params);
            assert!(comparison.within(TOLERANCE), "{what}: rank {rank}: {comparison:?}");
            if rank > 0 {
                for (a, b) in params.iter().zip(&ranks[0].1) {
                    assert_eq!(bits(a), bits(b), "{what}: rank {rank}'s gathered state differs from rank 0's");
                }
            }
        }
        println!("{what} on device planes: loss diff {:.1e}", worst_loss_diff(&ranks[0].0, &ref_losses));
    }
}

/// A tensor group of 2 whose rank 1 is dropped (its plane aborts, as a killed process's NCCL peers see)
/// after 3 steps: rank 0's next step fails at once on its plane, not after the 60 s timeout, and rank
/// 0 ends the attempt holding the whole state of step 3 from its own shard and its buddy copy — on
/// the reference's trajectory, which it then follows alone to the end.
#[test]
fn a_lost_tensor_rank_fails_its_peers_plane_call_at_once_and_the_survivor_keeps_the_whole_state() {
    let config = tensor_job(JobConfig::small_llama(8), 2, 1);
    let lost_at = 3;
    let (ref_losses, ref_params) = tensor_reference(&config);
    let mut planes = FakeNccl::group(2, Duration::from_secs(60));
    let (plane1, plane0) = (planes.pop().unwrap(), planes.pop().unwrap());
    let mut transports: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 4096).into_iter().map(Arc::new).collect();
    let (t1, t0) = (transports.pop().unwrap(), transports.pop().unwrap());
    let (config0, config1) = (config.clone(), config.clone());
    let doomed = on_thread(move || {
        runtime().block_on(async move {
            let mut engine = tensor_rank(&config1, t1.clone(), plane1, None).await;
            for _ in 0..lost_at {
                tensor_step(&mut engine).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            // Killed: its NCCL peer's call aborts, its host peer sees the connection lost.
            t1.kill();
            drop(engine);
        })
    });
    let survivor = on_thread(move || {
        runtime().block_on(async move {
            let mut engine = tensor_rank(&config0, t0, plane0, None).await;
            let mut losses = Vec::new();
            for _ in 0..lost_at {
                losses.push(tensor_step(&mut engine).await.unwrap());
            }
            let failing = Instant::now();
            let error = tensor_step(&mut engine).await.unwrap_err();
            let failed_after = failing.elapsed();
            let Some(CommittedState::Full(mut trainer)) = engine.into_state().await else {
                panic!("the survivor kept nothing")
            };
            let ended_after = failing.elapsed();
            assert!(ended_after < Duration::from_secs(10), "the attempt ended after {ended_after:?}, not at once");
            assert_eq!(trainer.step, lost_at, "the failed step was not applied");
            trainer.config.parallel.tp = 1;
            while trainer.step < config0.train.steps {
                losses.push(trainer.train_step().loss);
            }
            (losses, trainer.param_values(), error, failed_after)
        })
    });
    doomed.join().unwrap();
    let (losses, params, error, failed_after) = survivor.join().unwrap();
    assert!(error.contains("fake NCCL") && error.contains("aborted"), "the plane's call failed: {error}");
    assert!(failed_after < Duration::from_secs(10), "failed after {failed_after:?}, not at once");
    let loss_diff = worst_loss_diff(&losses, &ref_losses);
    assert!(loss_diff <= TOLERANCE, "losses differ by {loss_diff:e}");
    let specs = troupe_model::model::param_specs(&config.model);
    let comparison = compare_params(&specs, &params, &ref_params);
    assert!(comparison.within(TOLERANCE), "{comparison:?}");
}

#[test]
fn device_planes_that_are_not_the_ranks_groups_are_refused() {
    let config = tensor_job(JobConfig::small_llama(8), 2, 2);
    let collective = CollectiveConfig::from(&TransportConfig::default());
    let adopt = |config: &JobConfig| {
        let state = CommittedState::Full(Box::new(Trainer::new(config.clone()).unwrap()));
        let transport = MemoryTransport::mesh(4, 64).remove(0);
        TensorParallelReplica::adopt(state, comm(transport, 1), collective.clone(), 2).unwrap()
    };
    let plane = |world: usize, rank: usize| Box::new(FakeNccl::group(world, Duration::from_secs(1)).remove(rank));
    let refused = |config: &JobConfig, tensor, data| adopt(config).set_device_planes(tensor, data).unwrap_err();
    let why = refused(&config, plane(4, 0), Some(plane(2, 0)));
    assert!(why.contains("tensor group's device plane is rank 0 of 4; this rank is 0 of 2"), "{why}");
    let why = refused(&config, plane(2, 0), None);
    assert!(why.contains("no data-parallel device plane for 2 model replica(s)"), "{why}");
    let mut zero = config.clone();
    zero.parallel.shard = "zero1".into();
    let why = refused(&zero, plane(2, 0), Some(plane(2, 0)));
    assert!(why.contains("computes on the host") && why.contains("zero1"), "{why}");
    adopt(&config).set_device_planes(plane(2, 0), Some(plane(2, 0))).expect("rank 0's own groups' planes");
}

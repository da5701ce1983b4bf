//! Optimizer offload (`parallel.offload = "host"`, troupe_model::optim::offload) with the device path
//! emulated ([`Staging::Emulated`]: the parameters the forward reads in CPU memory apart from the host
//! masters, the same copies in the same order as on CUDA). Offload moves where the update runs, not what
//! it computes, so every comparison here is bit for bit against the same run without offload — the one
//! process reference and DDP over troupe's collectives, with AdamW and Adafactor — and DDP also equals the
//! single-process reference within the oracle's 1e-5. A step that is reduced but never committed (its
//! vote failed) leaves the host masters, the optimizer state and the device parameters as they were; a
//! killed rank's replacement, offloaded, takes the survivor's state and the job goes on to the same bits.

use std::future::Future;
use std::sync::Arc;

use tch::Tensor;
use troupe_actors::engine::DataParallelReplica;
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::optim::offload::Staging;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const STEPS: u64 = 8;
const TOLERANCE: f64 = 1e-5;

/// The small GPT (one block) with AdamW, a global batch of 8 in micro-batches of 2.
fn adamw_job(steps: u64) -> JobConfig {
    let mut config = JobConfig::small(steps);
    config.train.global_batch = 8;
    config.train.micro_batch = 2;
    config
}

/// The small Llama with Adafactor (first moment, fixed lr, weight decay): its factored statistics are
/// part of the host state.
fn adafactor_job(steps: u64) -> JobConfig {
    let mut config = adamw_job(steps);
    config.model = JobConfig::small_llama(steps).model;
    config.train.optimizer = "adafactor".into();
    config.train.adafactor.beta1 = Some(0.9);
    config.train.adafactor.relative_step = false;
    config.train.adafactor.weight_decay = 0.01;
    config
}

fn trainer(config: &JobConfig, offload: bool) -> Trainer {
    let trainer = Trainer::new(config.clone()).unwrap();
    if offload {
        let trainer = trainer.with_offload(Staging::Emulated);
        let offload = trainer.offload.as_ref().expect("offloaded");
        for (master, param) in offload.masters().iter().zip(trainer.model.params()) {
            assert_ne!(master.data_ptr(), param.data_ptr(), "the masters are apart from the device parameters");
        }
        trainer
    } else {
        trainer
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    let values: Vec<f32> = Vec::try_from(t.detach().to_kind(tch::Kind::Float).flatten(0, -1)).unwrap();
    values.into_iter().map(f32::to_bits).collect()
}

/// Every bit of a trainer's committed state: parameters, the optimizer's state tensors and step.
#[derive(Debug, PartialEq)]
struct StateBits {
    params: Vec<Vec<u32>>,
    optimizer: Vec<(String, Vec<u32>)>,
    optimizer_step: u64,
    step: u64,
}

impl StateBits {
    fn of(trainer: &Trainer) -> Self {
        Self {
            params: trainer.model.params().iter().map(bits).collect(),
            optimizer: trainer.optimizer.state_tensors().iter().map(|(n, t)| (n.clone(), bits(t))).collect(),
            optimizer_step: trainer.optimizer.step(),
            step: trainer.step,
        }
    }
}

/// The host masters' bits (empty without offload).
fn master_bits(trainer: &Trainer) -> Vec<Vec<u32>> {
    trainer.offload.as_ref().map_or_else(Vec::new, |o| o.masters().iter().map(bits).collect())
}

/// Runs `body` on a DDP replica of each of `trainers` (one thread each, over the in-memory transport).
fn ddp<F, Fut, R>(trainers: Vec<Trainer>, body: F) -> Vec<R>
where
    F: Fn(DataParallelReplica<MemoryTransport>) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = R>,
    R: Send + 'static,
{
    let transports = MemoryTransport::mesh(trainers.len(), 4096);
    let handles: Vec<_> = transports
        .into_iter()
        .zip(trainers)
        .map(|(transport, trainer)| {
            let body = body.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async move {
                    let config = CollectiveConfig::from(&TransportConfig::default());
                    let comm = Communicator::new(Arc::new(transport), 0, 1, config);
                    body(DataParallelReplica::without_sync(trainer, comm, 1 << 20)).await
                })
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

/// `steps` DDP steps on each rank; each rank's losses and final trainer.
fn ddp_steps(trainers: Vec<Trainer>, steps: u64) -> Vec<(Vec<f64>, Trainer)> {
    ddp(trainers, move |mut replica| async move {
        let mut losses = Vec::new();
        for _ in 0..steps {
            losses.push(replica.train_step().await.unwrap().loss);
        }
        (losses, replica.into_trainer())
    })
}

fn reference(config: &JobConfig, offload: bool) -> (Vec<f64>, Trainer) {
    tch::set_num_threads(1);
    let mut trainer = trainer(config, offload);
    let losses = (0..config.train.steps).map(|_| trainer.train_step().loss).collect();
    (losses, trainer)
}

/// The oracle: DDP's losses and parameters within 1e-5 of the single process's.
fn assert_oracle(config: &JobConfig, losses: &[f64], trainer: &Trainer, reference: &(Vec<f64>, Trainer), what: &str) {
    let loss_diff = worst_loss_diff(losses, &reference.0);
    assert!(loss_diff <= TOLERANCE, "{what}: losses differ by {loss_diff:e}");
    let specs = troupe_model::model::param_specs(&config.model);
    let comparison = compare_params(&specs, &trainer.param_values(), &reference.1.param_values());
    assert!(comparison.within(TOLERANCE), "{what}: {comparison:?}");
}

/// Offload on one process and under DDP (2 ranks) gives the same bits as without — losses, parameters,
/// the optimizer's state — with AdamW and with Adafactor, and the host masters equal the parameters.
#[test]
fn offloaded_updates_equal_the_updates_in_place_bit_for_bit() {
    for config in [adamw_job(STEPS), adafactor_job(STEPS)] {
        let name = config.train.optimizer.clone();
        let plain = reference(&config, false);
        let offloaded = reference(&config, true);
        assert_eq!(offloaded.0, plain.0, "{name}, one process: losses");
        assert_eq!(StateBits::of(&offloaded.1), StateBits::of(&plain.1), "{name}, one process: state");
        assert_eq!(master_bits(&offloaded.1), StateBits::of(&offloaded.1).params, "{name}: masters = parameters");

        let without = ddp_steps(vec![trainer(&config, false), trainer(&config, false)], STEPS);
        let with = ddp_steps(vec![trainer(&config, true), trainer(&config, true)], STEPS);
        for (rank, (a, b)) in with.iter().zip(&without).enumerate() {
            assert_eq!(a.0, b.0, "{name}, DDP rank {rank}: losses");
            assert_eq!(StateBits::of(&a.1), StateBits::of(&b.1), "{name}, DDP rank {rank}: state");
            assert_eq!(master_bits(&a.1), StateBits::of(&a.1).params, "{name}, DDP rank {rank}: masters");
        }
        assert_oracle(&config, &with[0].0, &with[0].1, &plain, &format!("{name}, offloaded DDP"));
    }
}

/// A step reduced on every rank whose vote then fails (the worker never calls apply) changes nothing:
/// not the device parameters, not the host masters, not the optimizer's state or counters. Re-run, the
/// job goes on to the bits of a run that never lost the step.
#[test]
fn a_step_whose_vote_fails_leaves_the_host_state_unchanged() {
    for config in [adamw_job(6), adafactor_job(6)] {
        let name = config.train.optimizer.clone();
        let runs = ddp(vec![trainer(&config, true), trainer(&config, true)], |mut replica| async move {
            for _ in 0..3 {
                replica.train_step().await.unwrap();
            }
            let before = (StateBits::of(replica.trainer()), master_bits(replica.trainer()));
            let current = replica.trainer().offload.as_ref().unwrap().current_for();
            replica.reduce_gradients().await.unwrap(); // the vote fails: nothing is applied
            let after = (StateBits::of(replica.trainer()), master_bits(replica.trainer()));
            assert_eq!(after, before, "an uncommitted step touched the state");
            assert_eq!(replica.trainer().offload.as_ref().unwrap().current_for(), current);
            for _ in 3..6 {
                replica.train_step().await.unwrap();
            }
            replica.into_trainer()
        });
        let reference = ddp_steps(vec![trainer(&config, false), trainer(&config, false)], 6);
        for (rank, (got, want)) in runs.iter().zip(&reference).enumerate() {
            assert_eq!(StateBits::of(got), StateBits::of(&want.1), "{name}, rank {rank}");
        }
    }
}

/// A rank killed after 4 steps is replaced by a fresh, offloaded rank that takes the survivor's state
/// ([`DataParallelReplica::sync_state_from`]: parameters, optimizer state, counters — its masters are
/// then read back from the parameters before its first update); the job's 4 more steps equal the bits of
/// an uninterrupted DDP run without offload, and the single-process reference within the oracle's 1e-5.
#[test]
fn a_killed_ranks_offloaded_replacement_equals_the_reference() {
    for config in [adamw_job(STEPS), adafactor_job(STEPS)] {
        let name = config.train.optimizer.clone();
        let half = STEPS / 2;
        let mut first = ddp_steps(vec![trainer(&config, true), trainer(&config, true)], half);
        drop(first.pop()); // rank 1 is killed: its state is gone
        let (mut losses, survivor) = first.pop().unwrap();
        let replacement = trainer(&config, true);
        assert_eq!(replacement.step, 0);
        let second = ddp(vec![survivor, replacement], move |mut replica| async move {
            replica.sync_state_from(0).await.unwrap();
            assert_eq!(replica.trainer().step, half);
            let mut losses = Vec::new();
            for _ in half..STEPS {
                losses.push(replica.train_step().await.unwrap().loss);
            }
            (losses, replica.into_trainer())
        });
        losses.extend(&second[0].0);
        let uninterrupted = ddp_steps(vec![trainer(&config, false), trainer(&config, false)], STEPS);
        assert_eq!(losses, uninterrupted[0].0, "{name}: losses");
        for (rank, (got, want)) in second.iter().zip(&uninterrupted).enumerate() {
            assert_eq!(StateBits::of(&got.1), StateBits::of(&want.1), "{name}, rank {rank}");
            assert_eq!(master_bits(&got.1), StateBits::of(&got.1).params, "{name}, rank {rank}: masters");
        }
        assert_oracle(&config, &losses, &second[1].1, &reference(&config, false), &format!("{name}, replacement"));
    }
}

fn troupe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

/// `troupe train --offload host` on the CPU is accepted, trains, and says that nothing is offloaded — in
/// the start line and in the JSON start event (0 bytes off the device); a value that is not one names
/// the key and the values.
#[test]
fn offload_on_a_cpu_rank_is_accepted_and_says_so() {
    let text = troupe(&["train", "--offload", "host", "--steps", "2"]);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    assert!(stdout.contains(troupe_model::optim::offload::CPU_RANK_NOTE), "{stdout}");
    let json = troupe(&["train", "--offload", "host", "--steps", "2", "--json"]);
    assert!(json.status.success(), "{}", String::from_utf8_lossy(&json.stderr));
    let start: serde_json::Value = String::from_utf8_lossy(&json.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|e| e["event"] == "start")
        .expect("a start event");
    assert_eq!(start["offload"], "host");
    assert_eq!(start["offloaded_state_bytes"], 0);
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[parallel]\noffload = \"gpu\"\n").unwrap();
    let refused = troupe(&["train", "--config", bad.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(stderr.contains("parallel.offload") && stderr.contains("none, host"), "{stderr}");
}

//! The oracle for data parallelism (DESIGN.md §4): DDP and ZeRO-1/2/3 over troupe's collectives, with 2, 3
//! and 4 ranks (threads of this process over the in-memory transport; over QUIC between processes once the
//! actor runtime lands), with and without gradient accumulation, equal the single-process reference on
//! the same global batch — per-step losses and final parameters within 1e-5 relative, fp32, 20 steps — and
//! keep every replica bit-identical; bf16 and fp16 equal the reference in the same precision within a
//! measured tolerance. ZeRO-3 runs the small model (`JobConfig::small`) with and without
//! recomputation, and holds about a quarter of DDP's persistent state at 4 ranks.

use std::sync::Arc;

use tch::Tensor;
use troupe_actors::engine::{CommittedState, DataParallelReplica, PersistentState, ShardMode, ShardedReplica};
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::oracle::{compare_params, worst_loss_diff};
use troupe_model::Trainer;

const STEPS: u64 = 20;
const TOLERANCE: f64 = 1e-5;

fn job(micro_batch: usize) -> JobConfig {
    let mut config = JobConfig::default();
    config.train.steps = STEPS;
    config.train.global_batch = 8;
    config.train.micro_batch = micro_batch;
    config
}

/// The small model (one block, d_model 64) with a global batch of 8.
fn small_job(micro_batch: usize, recompute: bool) -> JobConfig {
    let mut config = JobConfig::small(STEPS);
    config.train.global_batch = 8;
    config.train.micro_batch = micro_batch;
    config.parallel.recompute = recompute;
    config
}

fn reference(config: &JobConfig) -> (Vec<f64>, Vec<Tensor>) {
    tch::set_num_threads(1);
    let mut trainer = Trainer::new(config.clone()).unwrap();
    let losses = (0..config.train.steps).map(|_| trainer.train_step().loss).collect();
    (losses, trainer.param_values())
}

#[derive(Clone, Copy, Debug)]
enum Engine {
    Ddp {
        bucket_bytes: usize,
    },
    Sharded(ShardMode),
    /// Sharded, started as the daemon starts a fresh job: from [`CommittedState::Initial`], each rank
    /// reading only the ranges it holds at its first sync.
    Fresh(ShardMode),
}

/// One rank's run: its losses, final parameters, and what it kept between steps at the end.
struct RankRun {
    losses: Vec<f64>,
    /// The steps that applied no update (fp16 overflow).
    skipped: Vec<u64>,
    params: Vec<Tensor>,
    persistent: PersistentState,
}

/// Runs `engine` with `world` ranks; returns each rank's run.
fn distributed(config: &JobConfig, world: usize, engine: Engine) -> Vec<RankRun> {
    let transports = MemoryTransport::mesh(world, 4096);
    let handles: Vec<_> = transports
        .into_iter()
        .map(|transport| {
            let config = config.clone();
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async move {
                    let comm = Communicator::new(
                        Arc::new(transport),
                        0,
                        1,
                        CollectiveConfig::from(&TransportConfig::default()),
                    );
                    let steps = config.train.steps;
                    if let Engine::Fresh(mode) = engine {
                        let trainer = Trainer::new_unmaterialised(config).unwrap();
                        assert!(trainer.model.params().iter().all(|p| p.numel() == 0), "nothing materialised");
                        let state = CommittedState::Initial(Box::new(trainer));
                        let mut replica = ShardedReplica::adopt(state, comm, mode, 0, None);
                        replica.sync().await.unwrap();
                        let (mut losses, skipped) = (Vec::new(), Vec::new());
                        for _ in 0..steps {
                            losses.push(replica.train_step().await.unwrap().loss);
                        }
                        let persistent = replica.persistent_state();
                        replica.refresh_params().await.unwrap();
                        return RankRun { losses, skipped, params: replica.trainer().param_values(), persistent };
                    }
                    let trainer = Trainer::new(config).unwrap();
                    let mut losses = Vec::new();
                    let mut skipped = Vec::new();
                    let mut record = |report: troupe_model::StepReport| {
                        losses.push(report.loss);
                        if report.skipped {
                            skipped.push(report.step);
                        }
                    };
                    match engine {
                        Engine::Ddp { bucket_bytes } => {
                            let mut replica = DataParallelReplica::new(trainer, comm, bucket_bytes).await.unwrap();
                            for _ in 0..steps {
                                record(replica.train_step().await.unwrap());
                            }
                            let persistent = PersistentState::of_model(replica.trainer());
                            RankRun { losses, skipped, params: replica.trainer().param_values(), persistent }
                        }
                        Engine::Fresh(_) => unreachable!("returned above"),
                        Engine::Sharded(mode) => {
                            let mut replica = ShardedReplica::new(trainer, comm, mode).await.unwrap();
                            let total: usize = replica.trainer().model.param_count();
                            // Each rank holds about 1/world of the optimizer state (params + 2 moments).
                            assert!(replica.optimizer_state_elements() <= 3 * total.div_ceil(world));
                            for _ in 0..steps {
                                record(replica.train_step().await.unwrap());
                            }
                            let persistent = replica.persistent_state();
                            // ZeRO-3 keeps no parameters between steps: gather them to compare.
                            replica.refresh_params().await.unwrap();
                            RankRun { losses, skipped, params: replica.trainer().param_values(), persistent }
                        }
                    }
                })
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let values: Vec<f32> = Vec::try_from(t.flatten(0, -1)).unwrap();
    values.into_iter().map(f32::to_bits).collect()
}

fn check(world: usize, micro_batch: usize, engine: Engine) {
    check_config(&job(micro_batch), world, engine);
}

fn check_config(config: &JobConfig, world: usize, engine: Engine) -> Vec<RankRun> {
    check_within(config, world, engine, TOLERANCE)
}

fn check_within(config: &JobConfig, world: usize, engine: Engine, tolerance: f64) -> Vec<RankRun> {
    let micro_batch = config.train.micro_batch;
    let (ref_losses, ref_params) = reference(config);
    let ranks = distributed(config, world, engine);
    let specs = troupe_model::model::param_specs(&config.model);
    let (losses, params) = (&ranks[0].losses, &ranks[0].params);
    let loss_diff = worst_loss_diff(losses, &ref_losses);
    assert!(
        loss_diff <= tolerance,
        "{engine:?} dp={world} micro={micro_batch}: losses differ by {loss_diff:e} relative"
    );
    let comparison = compare_params(&specs, params, &ref_params);
    assert!(comparison.within(tolerance), "{engine:?} dp={world} micro={micro_batch}: {comparison:?}");
    println!(
        "{engine:?} dp={world} micro={micro_batch}: loss diff {loss_diff:.1e}, params worst {:.1e} ({}), global {:.1e}",
        comparison.worst, comparison.worst_name, comparison.global
    );
    for (rank, other) in ranks.iter().enumerate().skip(1) {
        assert_eq!(&other.losses, losses, "rank {rank} reported different losses");
        assert_eq!(other.skipped, ranks[0].skipped, "rank {rank} skipped other steps");
        for (a, b) in other.params.iter().zip(params) {
            assert_eq!(bits(a), bits(b), "rank {rank}'s replica diverged from rank 0's");
        }
    }
    ranks
}

#[test]
fn dp2_equals_the_reference() {
    check(2, 4, Engine::Ddp { bucket_bytes: troupe_actors::engine::DEFAULT_BUCKET_BYTES });
}

#[test]
fn dp3_with_uneven_slices_and_accumulation_equals_the_reference() {
    // 8 samples over 3 ranks: slices of 3, 3, 2, each cut into micro-batches of 2; small buckets.
    check(3, 2, Engine::Ddp { bucket_bytes: 1 << 20 });
}

#[test]
fn dp4_with_accumulation_equals_the_reference() {
    check(4, 1, Engine::Ddp { bucket_bytes: 4 << 20 });
}

#[test]
fn zero1_dp2_equals_the_reference() {
    check(2, 8, Engine::Sharded(ShardMode::Zero1));
}

#[test]
fn zero2_dp3_with_accumulation_equals_the_reference() {
    check(3, 2, Engine::Sharded(ShardMode::Zero2));
}

#[test]
fn zero2_dp4_equals_the_reference() {
    check(4, 2, Engine::Sharded(ShardMode::Zero2));
}

#[test]
fn zero3_dp2_without_accumulation_equals_the_reference() {
    check_config(&small_job(4, false), 2, Engine::Sharded(ShardMode::Zero3));
}

#[test]
fn zero3_dp2_with_accumulation_and_recompute_equals_the_reference() {
    check_config(&small_job(1, true), 2, Engine::Sharded(ShardMode::Zero3));
}

#[test]
fn zero3_dp3_with_uneven_slices_equals_the_reference() {
    // Slices of 3, 3, 2 in micro-batches of 2: rank 2 takes part in the second round with nothing to
    // compute.
    check_config(&small_job(2, false), 3, Engine::Sharded(ShardMode::Zero3));
}

/// ZeRO-3 at 4 ranks, with accumulation and with recomputation, equals the reference; and a rank keeps
/// between steps about a quarter of what a DDP rank keeps (parameters, gradients, moments): its shard's
/// masters, moments and gradient, no parameters.
#[test]
fn zero3_dp4_equals_the_reference_and_keeps_a_quarter_of_ddps_state() {
    check_config(&small_job(1, true), 4, Engine::Sharded(ShardMode::Zero3));
    let config = small_job(1, false);
    let zero3 = check_config(&config, 4, Engine::Sharded(ShardMode::Zero3));
    let mut ddp_config = config.clone();
    ddp_config.train.steps = 1;
    let ddp = distributed(&ddp_config, 4, Engine::Ddp { bucket_bytes: troupe_actors::engine::DEFAULT_BUCKET_BYTES });
    let ddp_total = ddp[0].persistent.total();
    assert_eq!(ddp_total, 4 * config.model.param_count(), "DDP: parameters, gradients, two moments");
    for (rank, run) in zero3.iter().enumerate() {
        let p = run.persistent;
        assert_eq!(p.params, 0, "rank {rank} kept parameters between steps: {p:?}");
        let ratio = p.total() as f64 / ddp_total as f64;
        println!("zero3 rank {rank} of 4: {p:?} = {ratio:.3} x DDP's {ddp_total}");
        assert!(ratio <= 0.3, "rank {rank} keeps {ratio:.3} x DDP's persistent state: {p:?}");
    }
}

/// The Llama family (the small shape: GQA 4/2, RoPE θ = 500000; untied and tied heads) under DDP at
/// 2 and 3 ranks and ZeRO-1/2/3 (ZeRO-3 with accumulation and recomputation, and at 3 ranks) equals the
/// single-process reference. Tied, ZeRO-3's head unit gathers the embedding matrix too and reduces its
/// gradient to the matrix's owners, whose accumulators sum it with the embeddings'.
#[test]
fn llama_equals_the_reference_under_ddp_and_zero() {
    let llama = |micro_batch: usize, recompute: bool, tied: bool| {
        let mut config = JobConfig::small_llama(STEPS);
        config.train.global_batch = 8;
        config.train.micro_batch = micro_batch;
        config.parallel.recompute = recompute;
        config.model.tie_word_embeddings = tied;
        config
    };
    let ddp = Engine::Ddp { bucket_bytes: 1 << 20 };
    for tied in [false, true] {
        check_config(&llama(4, false, tied), 2, ddp);
        check_config(&llama(2, true, tied), 3, ddp);
        check_config(&llama(8, false, tied), 2, Engine::Sharded(ShardMode::Zero1));
        check_config(&llama(2, false, tied), 3, Engine::Sharded(ShardMode::Zero2));
        check_config(&llama(2, true, tied), 2, Engine::Sharded(ShardMode::Zero3));
        check_config(&llama(4, false, tied), 3, Engine::Sharded(ShardMode::Zero3));
    }
}

/// A tied GPT-2 (the small shape, gelu_new: GPT-2 small's kind of head) under ZeRO-3 at 2 ranks with
/// accumulation and recomputation, and at 4 ranks with a vocabulary of 1,024 — an embedding matrix
/// larger than a shard, so its gradient from the head reaches several owners — equals the
/// single-process reference.
#[test]
fn tied_gpt2_under_zero3_equals_the_reference() {
    let tied = |micro_batch: usize, recompute: bool| {
        let mut config = small_job(micro_batch, recompute);
        config.model.tie_word_embeddings = true;
        config.model.activation = troupe_model::model::Activation::GeluNew;
        config
    };
    check_config(&tied(1, true), 2, Engine::Sharded(ShardMode::Zero3));
    let mut wide = tied(2, false);
    wide.model.vocab_size = 1024;
    let matrix = troupe_model::model::param_specs(&wide.model)[0].numel();
    assert!(matrix > wide.model.param_count() / 4, "the matrix spans several of 4 shards");
    check_config(&wide, 4, Engine::Sharded(ShardMode::Zero3));
}

/// A fresh ZeRO job started the daemon's way — from `CommittedState::Initial`, each rank computing
/// (drawn values) or reading (Hugging Face weights, by range from a sharded safetensors directory) only
/// the flat ranges its layout gives it — equals the reference started from the same values: ZeRO-3
/// keeps its parts, ZeRO-1 materialises the whole model.
#[test]
fn a_fresh_sharded_job_reads_its_ranges_and_equals_the_reference() {
    let mut config = JobConfig::small_llama(6);
    config.train.global_batch = 8;
    config.train.micro_batch = 2;
    check_config(&config, 3, Engine::Fresh(ShardMode::Zero3));
    check_config(&config, 2, Engine::Fresh(ShardMode::Zero1));

    // The same model from Hugging Face weights, cut into several files so ranges span them.
    let dir = tempfile::tempdir().unwrap();
    let drawn = troupe_model::Model::new(config.model.clone(), 77);
    let values: Vec<Vec<f32>> =
        drawn.params().iter().map(|p| Vec::try_from(p.detach().flatten(0, -1)).unwrap()).collect();
    let options = troupe_model::hf::ExportOptions { max_shard_bytes: 64 << 10, ..Default::default() };
    troupe_model::hf::export(&config.model, &values, dir.path(), options).unwrap();
    assert!(dir.path().join("model.safetensors.index.json").is_file(), "the export is sharded");
    config.model.from_hf = Some(dir.path().to_owned());
    check_config(&config, 3, Engine::Fresh(ShardMode::Zero3));
}

/// Fine-tuning: LoRA (r 4 on q, k, v, o of a 2-block Llama; on c_attn and c_fc of a tied GPT-2) and
/// freeze (the last block and the head) under DDP at 2 and 3 ranks and ZeRO-1/2/3 (ZeRO-3 with
/// recomputation, and fresh — each rank drawing only its ranges of the adapters) equal the
/// single-process fine-tuning reference. The engines hold the adapters' state alone: a DDP rank keeps
/// parameters, gradients and two moments of the adapters, nothing of the frozen base, which the
/// process keeps once for its ranks — and under ZeRO-3 not at all between uses.
#[test]
fn lora_and_freeze_equal_the_reference_under_ddp_and_zero() {
    use troupe_model::model::peft::{Method, PeftConfig};
    let dir = tempfile::tempdir().unwrap();
    let fine_tune = |family: &str, peft: PeftConfig, micro_batch: usize, recompute: bool| {
        let mut config = match family {
            "llama" => JobConfig::small_llama(STEPS),
            _ => {
                let mut gpt2 = JobConfig::small(STEPS);
                gpt2.model.tie_word_embeddings = true;
                gpt2
            }
        };
        config.model.n_layers = 2;
        config.train.global_batch = 8;
        config.train.micro_batch = micro_batch;
        config.parallel.recompute = recompute;
        let base = dir.path().join(format!("{family}-{:?}-{}-{}", peft.method, peft.targets.len(), peft.dropout));
        troupe_model::oracle::fine_tuning(config, peft, &base, 5)
    };
    let lora = |targets: &[&str]| PeftConfig {
        r: 4,
        alpha: 8.0,
        targets: targets.iter().map(|t| t.to_string()).collect(),
        ..PeftConfig::default()
    };
    let ddp = Engine::Ddp { bucket_bytes: 1 << 20 };
    let llama = lora(&["q_proj", "k_proj", "v_proj", "o_proj"]);
    let gpt2 = lora(&["c_attn", "c_fc"]);
    let freeze = PeftConfig { method: Method::Freeze, last_blocks: 1, ..PeftConfig::default() };
    let first = fine_tune("llama", llama.clone(), 4, false);
    // Held here, the process's one copy of the base outlives each run, to be looked at.
    let base = troupe_model::model::peft::Base::open(first.model.from_hf.as_deref().unwrap()).unwrap();
    let ranks = check_config(&first, 2, ddp);
    let adapters = troupe_model::model::param_specs(&first.model);
    let adapter_elements: usize = adapters.iter().map(|s| s.numel()).sum();
    assert_eq!(ranks[0].persistent.total(), 4 * adapter_elements, "DDP keeps the adapters' state alone");
    let base_bytes = 4 * troupe_model::model::base_specs(&first.model).iter().map(|s| s.numel()).sum::<usize>();
    assert_eq!(base.held_bytes(), base_bytes, "DDP ranks keep the base (one copy for the process's ranks)");
    check_config(&fine_tune("llama", llama.clone(), 2, true), 3, ddp);
    check_config(&fine_tune("llama", llama.clone(), 8, false), 2, Engine::Sharded(ShardMode::Zero1));
    check_config(&fine_tune("llama", llama.clone(), 2, false), 3, Engine::Sharded(ShardMode::Zero2));
    check_config(&fine_tune("llama", llama.clone(), 2, true), 2, Engine::Sharded(ShardMode::Zero3));
    assert_eq!(base.held_bytes(), 0, "ZeRO-3 ranks read the base per use and keep none of it between");
    check_config(&fine_tune("llama", llama, 4, false), 3, Engine::Fresh(ShardMode::Zero3));
    check_config(&fine_tune("gpt2", gpt2.clone(), 4, false), 2, ddp);
    check_config(&fine_tune("gpt2", gpt2, 2, false), 2, Engine::Sharded(ShardMode::Zero3));
    // LoRA's dropout: each sample's mask is the same on any rank and in any micro-batch.
    let dropout = PeftConfig { dropout: 0.1, ..lora(&["q_proj", "v_proj", "o_proj"]) };
    check_config(&fine_tune("llama", dropout.clone(), 1, false), 3, ddp);
    check_config(&fine_tune("llama", dropout.clone(), 2, false), 2, Engine::Sharded(ShardMode::Zero2));
    check_config(&fine_tune("llama", dropout, 2, true), 3, Engine::Sharded(ShardMode::Zero3));
    for family in ["llama", "gpt2"] {
        check_config(&fine_tune(family, freeze.clone(), 4, false), 2, ddp);
        check_config(&fine_tune(family, freeze.clone(), 2, true), 2, Engine::Sharded(ShardMode::Zero3));
    }
}

/// The small model of `family` ("gpt2" or "llama") in `precision`, micro-batches of 2 (each rank
/// computes the reference's own micro-batches, so the 16-bit products see the same inputs).
fn precision_job(family: &str, precision: &str) -> JobConfig {
    let mut config = small_job(2, false);
    if family == "llama" {
        config.model = JobConfig::small_llama(STEPS).model;
    }
    config.parallel.precision = precision.into();
    config
}

/// bf16 and fp16 (with an overflow injected into step 5) under DDP and ZeRO-1/2/3, for GPT-2 and Llama,
/// equal the reference trainer in the same precision. Not within fp32's 1e-5: summation-order differences of the fp32
/// gradients (the same as in fp32, ~1e-7) flip roundings of the next step's 16-bit casts, and those
/// compound. Measured after 20 steps (2026-11-22): bf16 worst tensor 4.8e-4 relative (whole model 5.5e-5),
/// per-step loss 5.7e-5; fp16 1.2e-4 (1.5e-5), loss 4.5e-6; Llama (2026-11-26) bf16 1.1e-4 (2.1e-5), loss
/// 2.4e-5, fp16 2.7e-5 (5.2e-6), loss 4.6e-6. The bounds allow about 4× the GPT-2 figures. Every rank
/// skips exactly the injected step.
#[test]
fn bf16_and_fp16_equal_the_reference_in_the_same_precision() {
    for (family, precision, tolerance) in
        [("gpt2", "bf16", 2e-3), ("gpt2", "fp16", 5e-4), ("llama", "bf16", 2e-3), ("llama", "fp16", 5e-4)]
    {
        let mut config = precision_job(family, precision);
        if precision == "fp16" {
            config.train.inject_overflow_at = vec![5];
            config.parallel.loss_scale_window = 4;
        }
        for (world, engine) in [
            (2, Engine::Ddp { bucket_bytes: troupe_actors::engine::DEFAULT_BUCKET_BYTES }),
            (2, Engine::Sharded(ShardMode::Zero2)),
            (2, Engine::Sharded(ShardMode::Zero3)),
            (4, Engine::Sharded(ShardMode::Zero1)),
        ] {
            let ranks = check_within(&config, world, engine, tolerance);
            let expected: &[u64] = if precision == "fp16" { &[5] } else { &[] };
            assert_eq!(ranks[0].skipped, expected, "{family} {precision} {engine:?}: the skipped steps");
        }
    }
}

/// The small Llama with `train.optimizer = "adafactor"` (first moment, scheduled lr, weight decay).
///
/// Llama, not GPT-2: GPT-2's key bias has a true gradient of exactly zero and a computed one of rounding
/// noise (see troupe_model::oracle), and Adafactor clips each tensor's update by its RMS, so that noise —
/// normalised to ±1 like every other element — sets part of the scale of the whole `c_attn.bias` update:
/// the query and value biases then differ between summation orders by ~1e-3 relative (measured), the
/// rest of the model by ~1e-8. Llama has no attention biases.
fn adafactor_job(steps: u64, micro_batch: usize) -> JobConfig {
    let mut config = small_job(micro_batch, false);
    config.model = JobConfig::small_llama(steps).model;
    config.train.steps = steps;
    config.train.optimizer = "adafactor".into();
    config.train.adafactor.beta1 = Some(0.9);
    config.train.adafactor.relative_step = false;
    config.train.adafactor.weight_decay = 0.01;
    config
}

/// Adafactor under DDP: every rank holds the whole (factored) optimizer state and applies the same
/// update, so DDP with 2 and 3 ranks equals the single-process Adafactor run, every replica bit-identical,
/// each rank holding a small fraction of AdamW's state.
#[test]
fn adafactor_under_ddp_equals_the_reference() {
    let ddp = Engine::Ddp { bucket_bytes: 1 << 20 };
    let ranks = check_config(&adafactor_job(STEPS, 2), 3, ddp);
    check_config(&adafactor_job(STEPS, 4), 2, ddp);
    let params = ranks[0].persistent.params;
    let moments = ranks[0].persistent.moments;
    println!("Adafactor state per rank: {moments} elements for {params} parameters");
    // With a first moment (as parameters) the state is about half of AdamW's two moments; the factored
    // second moment alone is a sliver (kernels/model/tests/adafactor_vs_transformers.rs measures it).
    assert!(moments > params && moments * 10 < 12 * params, "{moments} state elements vs AdamW's {}", 2 * params);
}

/// A rank that joins a DDP Adafactor job takes the whole state — parameters, the optimizer's state
/// tensors, the step counters — from a survivor ([`DataParallelReplica::sync_state_from`]), and the two
/// go on to the reference's trajectory: 10 steps on one rank, then 10 on two, equal 20 of the reference.
#[test]
fn a_joiner_takes_adafactors_state_from_a_survivor() {
    let config = adafactor_job(2 * 10, 2);
    let (ref_losses, ref_params) = reference(&config);
    let mut survivor = Trainer::new(config.clone()).unwrap();
    let first: Vec<f64> = (0..10).map(|_| survivor.train_step().loss).collect();
    let joiner = Trainer::new(config.clone()).unwrap();
    let transports = MemoryTransport::mesh(2, 4096);
    let handles: Vec<_> = transports
        .into_iter()
        .zip([survivor, joiner])
        .map(|(transport, trainer)| {
            std::thread::spawn(move || {
                tch::set_num_threads(1);
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                runtime.block_on(async move {
                    let config = CollectiveConfig::from(&TransportConfig::default());
                    let comm = Communicator::new(Arc::new(transport), 0, 1, config);
                    let mut replica = DataParallelReplica::without_sync(trainer, comm, 1 << 20);
                    replica.sync_state_from(0).await.unwrap();
                    assert_eq!(replica.trainer().optimizer.step(), 10, "rank {}", replica.rank());
                    let mut losses = Vec::new();
                    for _ in 0..10 {
                        losses.push(replica.train_step().await.unwrap().loss);
                    }
                    (losses, replica.trainer().param_values())
                })
            })
        })
        .collect();
    let ranks: Vec<(Vec<f64>, Vec<Tensor>)> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
    let losses: Vec<f64> = first.into_iter().chain(ranks[0].0.iter().copied()).collect();
    let loss_diff = worst_loss_diff(&losses, &ref_losses);
    assert!(loss_diff <= TOLERANCE, "losses differ by {loss_diff:e}");
    let specs = troupe_model::model::param_specs(&config.model);
    let comparison = compare_params(&specs, &ranks[1].1, &ref_params);
    assert!(comparison.within(TOLERANCE), "the joiner: {comparison:?}");
    for (a, b) in ranks[0].1.iter().zip(&ranks[1].1) {
        assert_eq!(bits(a), bits(b), "the joiner's replica diverged from the survivor's");
    }
}

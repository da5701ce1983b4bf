//! The whole training state as plain host memory: what a checkpoint holds, what a snapshot copies out
//! of a trainer at a step boundary, and what a load reassembles from any layout's shards. Copying it out
//! of a trainer and into one ([`TrainingState::snapshot`], [`TrainingState::restore_into`]) is
//! [`crate::trainer`]'s, above this module.
//!
//! Each of the three per-parameter states (parameters, AdamW `exp_avg`, `exp_avg_sq`) is one flat `f32`
//! vector in the model's canonical parameter order, so a shard is a slice and resharding is slicing.

use super::manifest::StateKind;
use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::precision::LossScale;

/// A tensor of the flat order: its name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct TrainingState {
    pub config: JobConfig,
    /// Committed steps (the next step to run).
    pub step: u64,
    pub optimizer_step: u64,
    pub sampler: SamplerState,
    /// The parameters in canonical order; the flat vectors concatenate them in this order.
    pub tensors: Vec<TensorSpec>,
    /// Indexed by [`StateKind::index`]: parameters, `exp_avg`, `exp_avg_sq`.
    pub values: [Vec<f32>; 3],
    /// fp16's loss scaler (None: saved by a build without one, or by a run that did not scale).
    pub loss_scale: Option<LossScale>,
}

impl TrainingState {
    /// Elements of one state (all three have the same length).
    pub fn flat_len(&self) -> usize {
        self.values[0].len()
    }

    pub fn values(&self, kind: StateKind) -> &[f32] {
        &self.values[kind.index()]
    }

    /// Bytes of state (all three vectors).
    pub fn bytes(&self) -> u64 {
        (3 * self.flat_len() * std::mem::size_of::<f32>()) as u64
    }

    /// Offsets of each tensor in the flat order: tensor `i` is `offsets[i]..offsets[i + 1]`.
    pub fn offsets(&self) -> Vec<usize> {
        let mut offsets = vec![0];
        for spec in &self.tensors {
            offsets.push(offsets.last().copied().unwrap_or(0) + spec.numel());
        }
        offsets
    }
}

/// A synthetic state of `config`'s model at step `step` whose every value is a function of (step,
/// position): what the crash-consistency writer saves (so a reader can check a loaded checkpoint bit for
/// bit without a trainer) and what `troupe bench checkpoint` writes for models too large to train here.
pub fn synthetic_state(config: &JobConfig, step: u64) -> TrainingState {
    let tensors: Vec<TensorSpec> = crate::model::param_specs(&config.model)
        .iter()
        .map(|s| TensorSpec { name: s.name.clone(), shape: s.shape.iter().map(|&d| d as usize).collect() })
        .collect();
    let total: usize = tensors.iter().map(TensorSpec::numel).sum();
    let values = [0u64, 1, 2]
        .map(|k| (0..total).map(|i| (crate::rng::hash_words(&[step, k, i as u64]) >> 40) as f32).collect::<Vec<f32>>());
    let sampler = SamplerState {
        seed: config.train.seed,
        next_step: step,
        global_batch: config.train.global_batch,
        context: config.model.context,
        corpus_fingerprint: 0,
        corpus_tokens: 0,
    };
    TrainingState { config: config.clone(), step, optimizer_step: step, sampler, tensors, values, loss_scale: None }
}

/// The crash-consistency writer's state of step `step`: [`synthetic_state`] of `JobConfig::small`
/// (about 1 MB).
pub fn crash_state(step: u64) -> TrainingState {
    synthetic_state(&JobConfig::small(1_000_000), step)
}

//! The whole training state as plain host memory: what a checkpoint holds, what a snapshot copies out
//! of a trainer at a step boundary, and what a load reassembles from any layout's shards.
//!
//! Each of the three per-parameter states (parameters, AdamW `exp_avg`, `exp_avg_sq`) is one flat `f32`
//! vector in the model's canonical parameter order, so a shard is a slice and resharding is slicing.

use std::path::Path;

use tch::Tensor;

use super::manifest::StateKind;
use super::CheckpointError;
use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::precision::LossScale;
use crate::trainer::Trainer;

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
    /// Copies the trainer's state to host memory (the only part of an asynchronous save the step loop
    /// waits for).
    pub fn snapshot(trainer: &Trainer) -> Self {
        let tensors: Vec<TensorSpec> = trainer
            .model
            .specs()
            .iter()
            .map(|s| TensorSpec { name: s.name.clone(), shape: s.shape.iter().map(|&d| d as usize).collect() })
            .collect();
        let total = tensors.iter().map(TensorSpec::numel).sum();
        let mut values = [0, 1, 2].map(|_| vec![0f32; total]);
        copy_values(trainer, &tensors, &mut values);
        Self {
            config: trainer.config.clone(),
            step: trainer.step,
            optimizer_step: trainer.optimizer.step,
            sampler: trainer.sampler.state(trainer.step, trainer.config.train.global_batch),
            tensors,
            values,
            loss_scale: scaler_of(trainer),
        }
    }

    /// [`Self::snapshot`] into this state's buffers, when it holds a state of the same model (a recycled
    /// snapshot): copying into memory already mapped saves the page faults of fresh buffers, which cost
    /// as much as the copy itself.
    pub fn refresh(&mut self, trainer: &Trainer) {
        let same_shapes = self.tensors.len() == trainer.model.specs().len()
            && self
                .tensors
                .iter()
                .zip(trainer.model.specs())
                .all(|(t, s)| t.name == s.name && t.shape.iter().copied().eq(s.shape.iter().map(|&d| d as usize)));
        if !same_shapes {
            *self = Self::snapshot(trainer);
            return;
        }
        copy_values(trainer, &self.tensors, &mut self.values);
        self.config.clone_from(&trainer.config);
        self.step = trainer.step;
        self.optimizer_step = trainer.optimizer.step;
        self.sampler = trainer.sampler.state(trainer.step, trainer.config.train.global_batch);
        self.loss_scale = scaler_of(trainer);
    }

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

    /// Loads this state into `trainer` (freshly built from the config to continue with). `dir` names the
    /// checkpoint in errors. The model must be the same, and so must the data, seed and batch (the sampler
    /// state); `train.steps` may differ.
    pub fn restore_into(&self, trainer: &mut Trainer, dir: &Path) -> Result<(), CheckpointError> {
        let mismatch = |what, detail: String| CheckpointError::Mismatch { path: dir.to_owned(), what, detail };
        if self.config.model != trainer.config.model {
            let differ = self.config.model.differences(&trainer.config.model).join(", ");
            return Err(mismatch("model", format!("checkpoint's vs this job's: {differ}")));
        }
        let expected = trainer.sampler.state(self.step, trainer.config.train.global_batch);
        if self.sampler != expected {
            return Err(mismatch(
                "data, seed or batch",
                format!("checkpoint sampler {:?}, this run {:?}", self.sampler, expected),
            ));
        }
        let specs = trainer.model.specs();
        let same_tensors = specs.len() == self.tensors.len()
            && specs
                .iter()
                .zip(&self.tensors)
                .all(|(s, t)| s.name == t.name && s.shape.iter().map(|&d| d as usize).eq(t.shape.iter().copied()));
        if !same_tensors {
            return Err(mismatch("parameter list", "names or shapes differ from this model's".into()));
        }
        let offsets = self.offsets();
        let tensor = |kind: StateKind, i: usize, like: &Tensor| {
            let shape: Vec<i64> = self.tensors[i].shape.iter().map(|&d| d as i64).collect();
            Tensor::from_slice(&self.values(kind)[offsets[i]..offsets[i + 1]])
                .view(shape.as_slice())
                .to_device(like.device())
        };
        let params = trainer.model.params();
        let values: Vec<Tensor> = (0..params.len()).map(|i| tensor(StateKind::Param, i, &params[i])).collect();
        for (i, value) in values.iter().enumerate() {
            trainer.optimizer.exp_avg[i] = tensor(StateKind::ExpAvg, i, value);
            trainer.optimizer.exp_avg_sq[i] = tensor(StateKind::ExpAvgSq, i, value);
        }
        trainer.model.load_values(&values);
        trainer.optimizer.step = self.optimizer_step;
        trainer.step = self.step;
        let saved_precision = &self.config.parallel.precision;
        trainer.loss_scale = LossScale::resumed(&trainer.config.parallel, saved_precision, self.loss_scale);
        Ok(())
    }
}

/// The loss scaler state worth saving: fp16's (the other precisions' is the constant 1).
pub fn scaler_of(trainer: &Trainer) -> Option<LossScale> {
    trainer.model.precision.scales_loss().then_some(trainer.loss_scale)
}

/// Copies the trainer's parameters and moments into the three flat vectors (sized for `tensors`).
fn copy_values(trainer: &Trainer, tensors: &[TensorSpec], values: &mut [Vec<f32>; 3]) {
    let sources: [&[Tensor]; 3] = [trainer.model.params(), &trainer.optimizer.exp_avg, &trainer.optimizer.exp_avg_sq];
    for (flat, list) in values.iter_mut().zip(sources) {
        let mut at = 0;
        for (tensor, spec) in list.iter().zip(tensors) {
            let n = spec.numel();
            tensor.detach().copy_data(&mut flat[at..at + n], n);
            at += n;
        }
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

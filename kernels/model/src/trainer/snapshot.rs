//! A trainer's whole state in and out of host memory: the [`TrainingState`] snapshot a checkpoint
//! saves, and a loaded one restored into a trainer; saving to and restoring from a checkpoint
//! directory. Here, above [`crate::checkpoint`], which knows the state and not the trainer.

use std::path::{Path, PathBuf};

use tch::Tensor;

use super::Trainer;
use crate::checkpoint::state::TensorSpec;
use crate::checkpoint::{load_state, CheckpointError, CheckpointStore, Layout, StateKind, TrainingState};
use crate::precision::LossScale;

impl Trainer {
    /// Saves the trainer's whole state under `root/step-NNNNNNNN` as one shard, synchronously, recording
    /// it in the root's redb catalog; returns that directory. (The cluster runtime snapshots and saves in
    /// the background with [`crate::checkpoint::CheckpointWriter`] instead.)
    pub fn save_checkpoint(&self, root: &Path) -> Result<PathBuf, CheckpointError> {
        let store = CheckpointStore::open(root, 0)?;
        Ok(store.save(&TrainingState::snapshot(self), &Layout::ddp(1))?.path)
    }

    /// Restores this trainer (freshly built from the same config) from checkpoint `dir` (any version, any
    /// layout).
    pub fn restore_checkpoint(&mut self, dir: &Path) -> Result<(), CheckpointError> {
        load_state(dir)?.restore_into(self, dir)
    }
}

/// A trainer's state in host memory, and back. (The rest of [`TrainingState`] is in
/// [`crate::checkpoint::state`].)
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
            optimizer_step: trainer.optimizer.step(),
            sampler: trainer.sampler.state(trainer.step, trainer.config.train.global_batch),
            tensors,
            values,
            loss_scale: scaler_of(trainer),
            periodic: None,
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
        self.optimizer_step = trainer.optimizer.step();
        self.sampler = trainer.sampler.state(trainer.step, trainer.config.train.global_batch);
        self.loss_scale = scaler_of(trainer);
        self.periodic = None;
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
        let (saved, ours) = (&self.config.train.optimizer, &trainer.config.train.optimizer);
        if saved != ours {
            let detail = format!("saved by train.optimizer = {saved:?}, this job's is {ours:?}: resume with {saved:?}");
            return Err(mismatch("train.optimizer", detail));
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
            let slots = [StateKind::ExpAvg, StateKind::ExpAvgSq].map(|kind| tensor(kind, i, value));
            trainer.optimizer.unpack(i, slots);
        }
        trainer.model.load_values(&values);
        trainer.optimizer.set_step(self.optimizer_step);
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

/// Copies the trainer's parameters and its optimizer's two state slots per parameter (AdamW's moments,
/// or Adafactor's packed state, see [`crate::optim`]) into the three flat vectors (sized for `tensors`).
fn copy_values(trainer: &Trainer, tensors: &[TensorSpec], values: &mut [Vec<f32>; 3]) {
    let mut at = 0;
    for (i, (param, spec)) in trainer.model.params().iter().zip(tensors).enumerate() {
        let n = spec.numel();
        let [first, second] = trainer.optimizer.packed(i, param);
        for (flat, tensor) in values.iter_mut().zip([param.detach(), first, second]) {
            tensor.detach().copy_data(&mut flat[at..at + n], n);
        }
        at += n;
    }
}

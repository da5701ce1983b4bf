//! The single-process reference trainer — the oracle every distributed mode must reproduce
//! (DESIGN.md §4): one global batch per step, cut into micro-batches whose gradients accumulate, clipped
//! by global norm, applied by the optimizer (`train.optimizer`: AdamW or Adafactor) with warmup + cosine
//! decay.

use std::ops::Range;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::blockwise::{micro_batch_backward, Activations};
use crate::checkpoint::{self, CheckpointError};
use crate::config::{ConfigError, JobConfig};
use crate::data::{load_corpora, micro_batch_ranges, Corpus, DataError, EvalWindows, GlobalSampler};
use crate::generate::{window_loss_sum, Evaluation};
use crate::model::{Model, Samples};
use crate::optim::offload::{HostOffload, Staging};
use crate::optim::{grad_norm, learning_rate, scale_grads, Optimizer};
use crate::precision::{backward_weight, LossScale, Precision, Update};
use crate::transfer::upload;

mod snapshot;

pub use snapshot::scaler_of;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("model.from_hf: {0}")]
    Weights(#[from] crate::hf::HfError),
}

/// What one committed step did.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// The step's index (0-based); after it, `step + 1` steps are committed.
    pub step: u64,
    /// Mean next-token cross-entropy over the step's global batch, before the update.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping (not finite when the step overflowed).
    pub grad_norm: f64,
    /// Tokens the step trained on (global batch × context).
    pub tokens: u64,
    /// fp16: the step's gradients overflowed, so no update was applied (the batch is consumed).
    pub skipped: bool,
    /// The loss scale the step's backward ran at (1 unless fp16).
    pub loss_scale: f64,
}

/// The reference trainer's whole state.
#[derive(Debug)]
pub struct Trainer {
    pub config: JobConfig,
    pub model: Model,
    pub optimizer: Optimizer,
    pub sampler: GlobalSampler,
    /// Committed steps so far; the next step to run.
    pub step: u64,
    /// fp16's dynamic loss scale (constant 1 in the other precisions).
    pub loss_scale: LossScale,
    /// Where the model, its gradients and the optimizer state live and compute (default: the CPU; each
    /// micro-batch is copied there from the sampler).
    pub device: Device,
    /// The held-out windows `train.eval_every` evaluates (`data.val_fraction` or `data.val_path`);
    /// None when the job holds none out.
    pub validation: Option<EvalWindows>,
    /// `parallel.offload = "host"` on a device: the host masters the optimizer (whose state is on the
    /// host too) updates, each committed update copied back into the device parameters
    /// ([`crate::optim::offload`]). None: the update runs on the parameters where they are.
    pub offload: Option<HostOffload>,
}

impl Trainer {
    /// A fresh run: loads the corpus the config names and initialises the model from `train.seed`.
    pub fn new(config: JobConfig) -> Result<Self, TrainError> {
        Self::new_on(config, Device::Cpu)
    }

    /// A fresh run on an already loaded corpus.
    pub fn with_corpus(config: JobConfig, corpus: Corpus) -> Self {
        Self::with_corpus_on(config, corpus, Device::Cpu)
    }

    /// A fresh run on `device` (e.g. `Device::Cuda(0)`): the same initial bits as on the CPU, the
    /// model, its gradients and the optimizer's moments on the device. The fused AdamW kernel takes CPU
    /// tensors; on another device the update runs as libtorch ops with the same formula — or, with
    /// `parallel.offload = "host"`, the moments and the update (the fused kernel) are on the host.
    pub fn new_on(config: JobConfig, device: Device) -> Result<Self, TrainError> {
        config.validate()?;
        crate::hf::check_weights(&config.model)?;
        let (corpus, validation) = load_corpora(&config.data, &config.model)?;
        Ok(Self::with_corpus_on(config, corpus, device).with_validation(validation))
    }

    /// A fresh run whose model is not materialised ([`Model::unmaterialised`]: every parameter empty, no
    /// optimizer moments): for an engine that keeps only parts of the model — a ZeRO-3 rank, a pipeline
    /// stage — and reads its parts of the initial values by range ([`crate::init::initial_flat`]), so
    /// no rank holds or reads the whole model. Checks the config and the Hugging Face weights' headers
    /// like [`Self::new`].
    pub fn new_unmaterialised(config: JobConfig) -> Result<Self, TrainError> {
        config.validate()?;
        crate::hf::check_weights(&config.model)?;
        let (corpus, validation) = load_corpora(&config.data, &config.model)?;
        let model = Model::unmaterialised(config.model.clone()).with_precision(Precision::of_config(&config.parallel));
        Ok(Self::with_model(config, corpus, model, Device::Cpu).with_validation(validation))
    }

    /// [`Self::with_corpus`] on `device`.
    pub fn with_corpus_on(config: JobConfig, corpus: Corpus, device: Device) -> Self {
        let precision = Precision::of_config(&config.parallel);
        let model = Model::new(config.model.clone(), config.train.seed).to_device(device).with_precision(precision);
        Self::with_model(config, corpus, model, device)
    }

    fn with_model(config: JobConfig, corpus: Corpus, model: Model, device: Device) -> Self {
        let decays = model.specs().iter().map(|s| s.decays()).collect();
        let optimizer = Optimizer::new(&config.train, model.params(), decays);
        let sampler = GlobalSampler::new(config.train.seed, corpus, config.model.context);
        let loss_scale = LossScale::initial(&config.parallel);
        let trainer =
            Self { config, model, optimizer, sampler, step: 0, loss_scale, device, validation: None, offload: None };
        match Staging::of(&trainer.config.parallel.offload, device) {
            Some(staging) => trainer.with_offload(staging),
            None => trainer,
        }
    }

    /// The fresh trainer with its optimizer offloaded through `staging` (what `parallel.offload =
    /// "host"` does on a device; [`Staging::Emulated`] for tests on the CPU): host masters of the
    /// parameters, and the optimizer's state created beside them.
    pub fn with_offload(mut self, staging: Staging) -> Self {
        assert!(
            self.step == 0 && self.optimizer.step() == 0,
            "the optimizer is offloaded on a fresh trainer (a restored state is loaded after)"
        );
        let offload = HostOffload::new(staging, self.model.params(), self.step);
        let decays = self.model.specs().iter().map(|s| s.decays()).collect();
        self.optimizer = Optimizer::new(&self.config.train, offload.masters(), decays);
        self.offload = Some(offload);
        self
    }

    /// The parameters and optimizer state were overwritten from elsewhere (a rank synced from another):
    /// offloaded masters are read back from the parameters before the next update.
    pub fn state_replaced(&mut self) {
        if let Some(offload) = &mut self.offload {
            offload.invalidate();
        }
    }

    /// Bytes of optimizer state kept off the device by `parallel.offload = "host"` (0 without offload):
    /// what the device would otherwise hold beside its parameters.
    pub fn offloaded_state_bytes(&self) -> usize {
        match self.offload {
            Some(_) => self.optimizer.state_numel() * 4,
            None => 0,
        }
    }

    /// Evaluates on `corpus`'s first `train.eval_samples` windows ([`Self::evaluate`]); None: nothing.
    pub fn with_validation(mut self, corpus: Option<Corpus>) -> Self {
        let (context, samples) = (self.config.model.context, self.config.train.eval_samples);
        self.validation = corpus.map(|corpus| EvalWindows::new(corpus, context, samples));
        self
    }

    /// Continues the run saved in checkpoint directory `dir`. `config` must describe the same model, data
    /// and batch; `train.steps` (and so the schedule's end) may differ.
    pub fn resume(config: JobConfig, dir: &Path) -> Result<Self, TrainError> {
        Self::resume_on(config, dir, Device::Cpu)
    }

    /// [`Self::resume`] on `device`: the checkpoint's values copied into the model and optimizer state
    /// there.
    pub fn resume_on(config: JobConfig, dir: &Path, device: Device) -> Result<Self, TrainError> {
        let mut trainer = Self::new_on(config, device)?;
        trainer.restore_checkpoint(dir)?;
        Ok(trainer)
    }

    /// Runs one step: forward and backward over every micro-batch of the global batch, clip, AdamW.
    pub fn train_step(&mut self) -> StepReport {
        let step = self.step;
        let loss = self.accumulate_gradients(step);
        self.apply_update(loss)
    }

    /// Zeroes the gradients, then accumulates those of `step`'s whole global batch. Returns its mean loss.
    pub fn accumulate_gradients(&mut self, step: u64) -> f64 {
        self.accumulate_slice(step, 0..self.config.train.global_batch)
    }

    /// Zeroes the gradients, then accumulates those of samples `slice` of `step`'s global batch, cut into
    /// micro-batches, each micro-batch's mean loss weighted by its share of the *global* batch. Summing
    /// the results of slices that partition the batch — over ranks, over micro-batches — gives the
    /// gradient of the batch's mean loss, whatever the partition. Returns the slice's weighted loss (the
    /// batch's mean loss when summed likewise). The micro-batches' losses are read together at the end
    /// (on a GPU one synchronisation, not one per micro-batch), and summed in order.
    pub fn accumulate_slice(&mut self, step: u64, slice: Range<usize>) -> f64 {
        for p in self.model.params_mut() {
            p.zero_grad();
        }
        let train = &self.config.train;
        let global_batch = train.global_batch;
        let recompute = self.config.parallel.recompute;
        let mut losses: Vec<(Tensor, f64)> = Vec::new();
        for micro in micro_batch_ranges(slice, train.micro_batch) {
            let weight = micro.len() as f64 / global_batch as f64;
            let scaled = backward_weight(train, &self.loss_scale, step, &micro);
            let samples = Some(Samples::new(train.seed, step, micro.start));
            let (inputs, targets) = self.sampler.batch(step, micro);
            let (inputs, targets) = (upload(&inputs, self.device), upload(&targets, self.device));
            let micro_loss = if recompute {
                let model = &self.model;
                let (config, params) = (&model.config, model.params());
                let recompute = Activations::Recompute;
                micro_batch_backward(
                    config,
                    model.precision,
                    params,
                    &inputs,
                    &targets,
                    scaled,
                    samples,
                    recompute,
                    &mut |_| {},
                )
            } else {
                let micro_loss = self.model.loss_training(&inputs, &targets, samples);
                (&micro_loss * scaled).backward();
                micro_loss.detach()
            };
            losses.push((micro_loss, weight));
        }
        weighted_losses(&losses)
    }

    /// Finishes the step whose gradients (of the whole global batch) are in place: unscale and clip by
    /// global norm, AdamW at the scheduled rate — or, when fp16 overflowed, skip the update — and
    /// advance the step counter.
    pub fn apply_update(&mut self, loss: f64) -> StepReport {
        self.apply_update_with_norm(loss, None)
    }

    /// [`Self::apply_update`] with the (scaled) gradients' global norm already known (`None`: compute it).
    pub fn apply_update_with_norm(&mut self, loss: f64, known_norm: Option<f64>) -> StepReport {
        let step = self.step;
        let loss_scale = self.loss_scale.scale;
        let update = self.conclude_step(known_norm.unwrap_or_else(|| grad_norm(self.model.params())));
        let lr = learning_rate(&self.config.train, step);
        if let Update::Apply { grad_factor, .. } = update {
            let params = self.model.params_mut();
            scale_grads(params, grad_factor);
            match &mut self.offload {
                Some(offload) => offload.apply(&mut self.optimizer, params, lr, step),
                None => self.optimizer.apply(params, lr),
            }
        } else if let Some(offload) = &mut self.offload {
            offload.carry_over(step);
        }
        self.step += 1;
        self.report(step, loss, lr, &update, loss_scale)
    }

    /// The verdict on the step in flight from its scaled gradients' global norm (see
    /// [`LossScale::conclude`]); the loss scale moves on.
    pub fn conclude_step(&mut self, scaled_norm: f64) -> Update {
        let (precision, parallel) = (self.model.precision, &self.config.parallel);
        self.loss_scale.conclude(precision, scaled_norm, self.config.train.grad_clip, parallel.loss_scale_window)
    }

    /// The report of committed step `step` whose backward ran at `loss_scale`.
    pub fn report(&self, step: u64, loss: f64, lr: f64, update: &Update, loss_scale: f64) -> StepReport {
        let tokens = (self.config.train.global_batch * self.config.model.context) as u64;
        let (grad_norm, skipped) = (update.grad_norm(), update.skipped());
        StepReport { step, loss, lr, grad_norm, tokens, skipped, loss_scale }
    }

    /// The validation loss of the current model over [`Self::validation`]'s windows, `train.micro_batch`
    /// windows per forward (no gradients, no state change, no randomness); None without held-out data.
    pub fn evaluate(&self) -> Option<Evaluation> {
        let windows = self.validation.as_ref()?;
        let sum = window_loss_sum(&self.model, windows, 0..windows.len(), self.config.train.micro_batch);
        Some(Evaluation::of_sum(sum, windows))
    }

    /// Mean loss of `batches` fixed evaluation batches (no gradients, no state change).
    pub fn eval_loss(&self, batches: u64) -> f64 {
        tch::no_grad(|| {
            let total: f64 = (0..batches)
                .map(|b| {
                    let (inputs, targets) = self.sampler.batch(u64::MAX - b, 0..self.config.train.global_batch);
                    let (inputs, targets) = (upload(&inputs, self.device), upload(&targets, self.device));
                    self.model.loss(&inputs, &targets).double_value(&[])
                })
                .sum();
            total / batches as f64
        })
    }

    /// Writes the model parameters alone (HF GPT-2 names) to one safetensors file.
    pub fn save_params(&self, path: &Path) -> Result<(), CheckpointError> {
        checkpoint::tensor_file::write_tensors(
            path,
            self.model.named_params().map(|(n, t)| (n.to_owned(), t.detach())).collect(),
        )
    }

    /// Detached copies of the parameters, for comparisons.
    pub fn param_values(&self) -> Vec<Tensor> {
        self.model.params().iter().map(|p| p.detach().copy()).collect()
    }
}

/// Σ loss × weight over `losses` (scalar tensors, each with its weight), in order, the losses read to the
/// host in one copy: one synchronisation for a step's micro-batches on a GPU, where reading each would
/// wait for the device once per micro-batch. The same bits as reading each (`double_value`) in turn.
pub fn weighted_losses(losses: &[(Tensor, f64)]) -> f64 {
    if losses.is_empty() {
        return 0.0;
    }
    let read = Tensor::stack(&losses.iter().map(|(l, _)| l.to_kind(Kind::Double)).collect::<Vec<_>>(), 0);
    let values: Vec<f64> = Vec::try_from(&read.to_device(Device::Cpu)).expect("the losses as f64");
    values.iter().zip(losses).fold(0.0, |sum, (value, (_, weight))| sum + value * weight)
}

/// Sets the CPU threads one rank's compute may use — libtorch's intra-op threads and troupe-kernels'
/// (the fused AdamW, reductions) alike: `configured`, or the machine's cores shared by `ranks_on_host`,
/// so ranks sharing a machine do not oversubscribe it.
pub fn configure_torch_threads(configured: usize, ranks_on_host: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if configured > 0 { configured } else { (cores / ranks_on_host.max(1)).max(1) };
    tch::set_num_threads(threads as i32);
    troupe_kernels::set_cpu_threads(threads);
    threads
}

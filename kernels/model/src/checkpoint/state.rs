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
    /// A periodically synchronizing job's per-rank and outer state (format version 3; None for every
    /// other job and for older checkpoints). With it, `values` hold the global parameters and rank 0's
    /// inner optimizer state: a reader that ignores it still gets a whole, consistent state.
    pub periodic: Option<PeriodicState>,
}

/// What a periodically synchronizing job (`parallel.sync = "local_sgd" | "diloco"`) holds beyond one
/// trainer's state at a synchronization: each rank's own inner optimizer state (AdamW's moments or
/// Adafactor's packed statistics — they differ between ranks, which see different data between
/// synchronizations), with Streaming DiLoCo each rank's own parameters (its unsynchronized fragments'
/// local progress), and DiLoCo's outer momentum.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeriodicState {
    /// Indexed by the rank when saved (one per rank of that world).
    pub ranks: Vec<RankState>,
    /// DiLoCo's outer Nesterov momentum (flat, the parameter order; empty before the first
    /// synchronization and for local SGD).
    pub outer_momentum: Vec<f32>,
}

/// One rank's own part of a [`PeriodicState`] (flat vectors in the parameter order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankState {
    /// The optimizer's two state slots ([`StateKind::ExpAvg`], [`StateKind::ExpAvgSq`]).
    pub slots: [Vec<f32>; 2],
    /// The rank's own parameters where they are not the global ones (Streaming DiLoCo); empty otherwise.
    pub params: Vec<f32>,
}

/// What a rank resumes from a checkpoint of a periodically synchronizing job
/// ([`TrainingState::take_rank`]): besides its trainer's state, the outer optimizer's and the global
/// parameters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResumedPeriodic {
    /// DiLoCo's outer momentum (empty: none saved, it starts at zero).
    pub outer_momentum: Vec<f32>,
    /// With Streaming DiLoCo, each fragment's last synchronized values (empty: the trainer's parameters
    /// are the global ones).
    pub global: Vec<f32>,
}

impl PeriodicState {
    /// The saved rank that rank `rank` resumes as: `rank mod` the saved world. The same world gets every
    /// rank its own state back; a larger one gives a rank beyond the saved ones the state of saved rank
    /// `rank mod n` — what the runtime gives a joiner (a copy of a peer's whole state), so a resume at
    /// another world size is the same event as a membership change at that synchronization; a smaller
    /// one keeps the first ranks' states.
    pub fn source_of(&self, rank: usize) -> Option<usize> {
        (!self.ranks.is_empty()).then(|| rank % self.ranks.len())
    }
}

impl TrainingState {
    /// Elements of one state (all three have the same length).
    pub fn flat_len(&self) -> usize {
        self.values[0].len()
    }

    pub fn values(&self, kind: StateKind) -> &[f32] {
        &self.values[kind.index()]
    }

    /// Bytes of state (all three vectors, and the periodic part's).
    pub fn bytes(&self) -> u64 {
        let periodic = self.periodic.as_ref().map_or(0, |p| {
            p.outer_momentum.len()
                + p.ranks.iter().map(|r| r.slots[0].len() + r.slots[1].len() + r.params.len()).sum::<usize>()
        });
        ((3 * self.flat_len() + periodic) * std::mem::size_of::<f32>()) as u64
    }

    /// Makes this state rank `rank`'s of a periodically synchronizing job (see [`PeriodicState::source_of`])
    /// and takes the periodic part out: the optimizer slots (and, with Streaming DiLoCo, the parameters)
    /// become those of the saved rank it resumes as; what the trainer does not hold is returned. A state
    /// without a periodic part (an older checkpoint, or an every-step job's) is left as it is: every rank
    /// resumes with rank 0's inner state and the outer momentum at zero.
    pub fn take_rank(&mut self, rank: usize) -> ResumedPeriodic {
        let Some(mut periodic) = self.periodic.take() else { return ResumedPeriodic::default() };
        let mut resumed =
            ResumedPeriodic { outer_momentum: std::mem::take(&mut periodic.outer_momentum), global: Vec::new() };
        if let Some(source) = periodic.source_of(rank) {
            let own = std::mem::take(&mut periodic.ranks[source]);
            let [first, second] = own.slots;
            (self.values[1], self.values[2]) = (first, second);
            if !own.params.is_empty() {
                resumed.global = std::mem::replace(&mut self.values[0], own.params);
            }
        }
        resumed
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
    TrainingState {
        config: config.clone(),
        step,
        optimizer_step: step,
        sampler,
        tensors,
        values,
        loss_scale: None,
        periodic: None,
    }
}

/// The crash-consistency writer's state of step `step`: [`synthetic_state`] of `JobConfig::small`
/// (about 1 MB).
pub fn crash_state(step: u64) -> TrainingState {
    synthetic_state(&JobConfig::small(1_000_000), step)
}

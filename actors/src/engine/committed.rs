//! What a rank keeps of a job between attempts: the state of its last committed step.

use std::ops::Range;

use tch::Tensor;
use troupe_model::checkpoint::state::TensorSpec;
use troupe_model::Trainer;

use super::flat::append_flat;

/// A contiguous range of the flat parameter order with its fp32 master values and the optimizer's two
/// state slots (AdamW's moments; see [`troupe_model::optim`]) — a rank's own shard, or its copy of a
/// buddy's.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPiece {
    pub range: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl ShardPiece {
    pub fn zeros(range: Range<usize>) -> Self {
        let n = range.len();
        Self { range, master: vec![0.0; n], exp_avg: vec![0.0; n], exp_avg_sq: vec![0.0; n] }
    }

    /// Copies `range` (which this piece must contain) into the three outputs.
    pub fn read(&self, range: &Range<usize>, out: [&mut [f32]; 3]) {
        let at = range.start - self.range.start..range.end - self.range.start;
        for (dst, src) in out.into_iter().zip([&self.master, &self.exp_avg, &self.exp_avg_sq]) {
            dst.copy_from_slice(&src[at.clone()]);
        }
    }
}

/// The committed state of one rank.
#[derive(Debug)]
pub enum CommittedState {
    /// The whole state in a trainer: a DDP rank, or any rank fresh from step 0 or a checkpoint.
    Full(Box<Trainer>),
    /// A ZeRO-1/2/3 rank: its own shard and its buddies' shards (masters and moments) are the state; the
    /// trainer carries the step counters, the config and the sampler, and its parameters are only a cache
    /// of the masters (ZeRO-1/2: refreshed by an all-gather before they are used; ZeRO-3: empty tensors)
    /// — its own AdamW moments are emptied.
    Sharded { trainer: Box<Trainer>, pieces: Vec<ShardPiece> },
    /// Step 0 of a fresh ZeRO-3 or pipeline job: nothing materialised (the trainer's model is
    /// [`troupe_model::model::Model::unmaterialised`]). The values are a pure function of the config —
    /// drawn from `train.seed`, or read from `model.from_hf` — so at the first sync each rank computes
    /// or reads just the ranges its layout gives it ([`troupe_model::init::initial_flat`]), and no rank
    /// holds or reads the whole model.
    Initial(Box<Trainer>),
    /// A periodically synchronizing rank (`parallel.sync = "local_sgd" | "diloco"`): the state of the
    /// last synchronization — the global parameters with this rank's own AdamW moments — and DiLoCo's
    /// outer momentum (flat; empty before the first synchronization and for local SGD). With Streaming
    /// DiLoCo (`parallel.fragments` > 1) the trainer's parameters are the rank's own (the fragments not
    /// synchronized then keep its local progress) and `global` holds each fragment's last synchronized
    /// values (flat; empty with one fragment: the trainer's parameters are them).
    Periodic { trainer: Box<Trainer>, outer_momentum: Vec<f32>, global: Vec<f32> },
}

impl CommittedState {
    /// The state with a whole model: an [`Self::Initial`] state's model materialised (drawn, or read from
    /// `model.from_hf`) — for the engines that keep the whole model on every rank (DDP, ZeRO-1/2).
    pub fn materialised(self) -> Result<Self, troupe_model::hf::HfError> {
        match self {
            Self::Initial(mut trainer) => {
                let precision = trainer.model.precision;
                let model = troupe_model::model::Model::load(trainer.config.model.clone(), trainer.config.train.seed)?;
                trainer.model = model.with_precision(precision);
                let decays = trainer.model.specs().iter().map(|s| s.decays()).collect();
                let (train, params) = (&trainer.config.train, trainer.model.params());
                trainer.optimizer = troupe_model::optim::Optimizer::new(train, params, decays);
                Ok(Self::Full(trainer))
            }
            state => Ok(state),
        }
    }

    /// Committed steps (the next step to run).
    pub fn step(&self) -> u64 {
        match self {
            CommittedState::Full(t)
            | CommittedState::Sharded { trainer: t, .. }
            | CommittedState::Initial(t)
            | CommittedState::Periodic { trainer: t, .. } => t.step,
        }
    }
}

/// The whole state of a trainer as one piece covering the flat order.
pub(crate) fn full_piece(trainer: &Trainer) -> ShardPiece {
    let params: Vec<Tensor> = trainer.model.params().iter().map(Tensor::detach).collect();
    let mut piece = ShardPiece { range: 0..0, master: Vec::new(), exp_avg: Vec::new(), exp_avg_sq: Vec::new() };
    append_flat(&params, &mut piece.master);
    for (i, param) in params.iter().enumerate() {
        let [first, second] = trainer.optimizer.packed(i, param);
        append_flat(&[first], &mut piece.exp_avg);
        append_flat(&[second], &mut piece.exp_avg_sq);
    }
    piece.range = 0..piece.master.len();
    piece
}

/// The tensors of the flat order, as a checkpoint of the whole state names them.
pub(crate) fn tensor_specs(trainer: &Trainer) -> Vec<TensorSpec> {
    trainer
        .model
        .specs()
        .iter()
        .map(|s| TensorSpec { name: s.name.clone(), shape: s.shape.iter().map(|&d| d as usize).collect() })
        .collect()
}

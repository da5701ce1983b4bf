//! The one seam between the worker's step protocol and a training engine: whatever the engine (DDP,
//! ZeRO-1/2/3, pipelines), an attempt is sync → per step reduce (vote) → apply (after commit) → checkpoint snapshot
//! when due → finish → the committed state back.
//!
//! Below every engine: each implements [`StepEngine`] in its own module, and this one names none of them.

use troupe_cluster::ClusterError;
use troupe_model::checkpoint::CheckpointWriter;
use troupe_model::generate::Evaluation;
use troupe_model::Trainer;

use super::committed::CommittedState;

/// Why an engine could not go on.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Comm(#[from] ClusterError),
    /// No rank of the attempt holds this piece of the flat state at the most advanced committed step
    /// (a rank and every rank that shadowed it were lost).
    #[error(
        "the state of step {step} is incomplete: elements {range:?} of the flat parameter order were held only by ranks that are gone (a rank and its buddy copies); the ranks drop their partial state and restore from the newest checkpoint"
    )]
    StateLost { step: u64, range: std::ops::Range<usize> },
    /// A ZeRO rank's shard owner died or refused (its state is dropped; the next attempt restores it
    /// from a buddy's copy or the checkpoint).
    #[error("rank {rank}'s shard owner, {reason}")]
    ShardOwner { rank: usize, reason: String },
    /// A pipeline device's failure (a `pipeline::PipelineError`, which converts into this variant).
    #[error(transparent)]
    Pipeline(Box<dyn std::error::Error + Send + Sync>),
    /// A tensor-parallel rank's step or gather failed (a collective of its tensor or data-parallel
    /// group, or its tensor group's ranks disagree on the committed step).
    #[error("tensor parallelism: {0}")]
    TensorParallel(String),
    /// The attempt's layout cannot run this job (set-up, before any state moved).
    #[error("setting up the attempt: {0}")]
    Setup(String),
}

/// One timed op of a pipeline device's step.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTiming {
    /// E.g. "F c1 mb3", "send activation c0 mb2".
    pub name: String,
    /// The timeline category: forward, backward, weight or comm.
    pub cat: &'static str,
    pub start: std::time::Instant,
    pub end: std::time::Instant,
    /// The model chunk and micro-batch the op works on.
    pub chunk: usize,
    pub microbatch: usize,
}

/// A step whose gradients are reduced on every rank, ready to commit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReducedStep {
    /// The global batch's mean loss.
    pub loss: f64,
    /// The global L2 norm of the batch's gradient (before clipping).
    pub grad_norm: f64,
    /// Seconds of this rank's forward and backward; the rest of `reduce_gradients` was all-reduce.
    pub compute_seconds: f64,
}

/// One rank's engine for an attempt. Every method that communicates is a collective: every rank calls
/// it at the same point of the step loop.
#[allow(async_fn_in_trait)]
pub trait StepEngine {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// The trainer: committed step, config, sampler; parameters current after [`Self::finish`].
    fn trainer(&self) -> &Trainer;
    /// Makes the ranks' states one state at the start of an attempt (`source`: the rank the controller
    /// named as the most advanced, when the ranks' committed steps differ).
    async fn sync(&mut self, source: Option<usize>) -> Result<(), EngineError>;
    /// Everything of the step before the vote; nothing applied.
    async fn reduce(&mut self) -> Result<ReducedStep, EngineError>;
    /// The timed parts of the last [`Self::reduce`]'s compute, for the rank's timeline. None (the
    /// default): the compute was one span, `ReducedStep::compute_seconds` long. A pipeline device gives
    /// each of its ops — F, B, W and the sends and receives — with its chunk and micro-batch.
    fn op_spans(&mut self) -> Option<Vec<OpTiming>> {
        None
    }
    /// The collective that reduces the step's gradients after the compute, as the rank's timeline names
    /// it: "all-reduce" (DDP, ZeRO-1, ZeRO-3 whose reductions run inside the compute) or
    /// "reduce-scatter" (ZeRO-2).
    fn gradient_collective(&self) -> &'static str {
        "all-reduce"
    }
    /// What the rank held and sent in the last [`Self::reduce`] (its memory by kind, its traffic by group
    /// and collective), for engines that count it; None (the default) for the others.
    fn usage(&mut self) -> Option<crate::protocol::RankUsage> {
        None
    }
    /// The update of a committed step: local, cannot fail half-way (a pipeline device's runs in its stage
    /// actor; if that actor died, the rank's state is gone and the next step fails).
    async fn apply(&mut self, reduced: ReducedStep);
    /// A checkpoint of the committed state: the state copied to host memory on rank 0 and submitted to
    /// `writer` (rank 0's, when the job has one) tagged `tag`.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError>;
    /// The validation loss of the committed state (`train.eval_every`), computed data-parallel over the
    /// held-out windows — forward only: no state changes, no randomness — and the same on every rank;
    /// None when the job holds no data out.
    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError>;
    /// Brings the trainer's parameters up to date (before `--save-final`).
    async fn finish(&mut self) -> Result<(), EngineError>;
    /// The committed state to keep; None if this rank's state must not be used again.
    async fn into_state(self) -> Option<CommittedState>;
}

//! The one seam between the worker's step protocol and a training engine: whatever the engine (DDP,
//! ZeRO-1/2/3, pipelines), an attempt is sync → per step reduce (vote) → apply (after commit) → checkpoint snapshot
//! when due → finish → the committed state back.

use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::checkpoint::{CheckpointWriter, Layout, SaveRequest, TrainingState};
use troupe_model::generate::Evaluation;
use troupe_model::Trainer;

use super::committed::CommittedState;
use super::data_parallel::{DataParallelReplica, ReducedStep};
use super::sharded::{ShardMode, ShardedReplica};

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
    #[error(transparent)]
    Pipeline(#[from] super::pipeline::PipelineError),
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

impl<T: Transport> StepEngine for DataParallelReplica<T> {
    fn rank(&self) -> usize {
        DataParallelReplica::rank(self)
    }

    fn world(&self) -> usize {
        DataParallelReplica::world(self)
    }

    fn trainer(&self) -> &Trainer {
        DataParallelReplica::trainer(self)
    }

    async fn sync(&mut self, source: Option<usize>) -> Result<(), EngineError> {
        if let Some(source) = source {
            self.sync_state_from(source).await?;
        }
        Ok(())
    }

    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        Ok(self.reduce_gradients().await?)
    }

    async fn apply(&mut self, reduced: ReducedStep) {
        self.apply_update(reduced);
    }

    /// Every rank holds the whole state: rank 0 copies its own, nothing travels.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let Some(writer) = writer else { return Ok(()) };
        let state = match writer.take_spare() {
            Some(mut spare) => {
                spare.refresh(self.trainer());
                spare
            }
            None => Box::new(TrainingState::snapshot(self.trainer())),
        };
        writer.submit(SaveRequest { state, layout: Layout::ddp(self.world()), tag });
        Ok(())
    }

    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        Ok(DataParallelReplica::evaluate(self).await?)
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    async fn into_state(self) -> Option<CommittedState> {
        Some(CommittedState::Full(Box::new(self.into_trainer())))
    }
}

impl<T: Transport> StepEngine for ShardedReplica<T> {
    fn rank(&self) -> usize {
        ShardedReplica::rank(self)
    }

    fn world(&self) -> usize {
        ShardedReplica::world(self)
    }

    fn trainer(&self) -> &Trainer {
        ShardedReplica::trainer(self)
    }

    /// Every rank takes part whatever `source` says: the shards are put together from whoever holds them.
    async fn sync(&mut self, _source: Option<usize>) -> Result<(), EngineError> {
        ShardedReplica::sync(self).await
    }

    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        self.reduce_gradients().await
    }

    fn gradient_collective(&self) -> &'static str {
        match self.mode() {
            ShardMode::Zero2 => "reduce-scatter",
            ShardMode::Zero1 | ShardMode::Zero3 => "all-reduce",
        }
    }

    /// An owner that died marks the rank's state lost; the next step fails.
    async fn apply(&mut self, reduced: ReducedStep) {
        if let Err(e) = self.apply_update(reduced).await {
            tracing::error!(rank = self.rank(), "{e}");
        }
    }

    /// The shards are gathered to rank 0 (the step loop waits for the transfer and the copy); rank 0
    /// writes the whole state from that one snapshot, as for DDP.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let spare = writer.and_then(CheckpointWriter::take_spare);
        if let (Some(state), Some(writer)) = (self.gather_state(spare, writer.is_some()).await?, writer) {
            let world = self.world();
            let layout = Layout { dp: world, pp: 1, shard_mode: self.mode().layout(), shards: world };
            writer.submit(SaveRequest { state, layout, tag });
        }
        Ok(())
    }

    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        ShardedReplica::evaluate(self).await
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        self.refresh_params().await
    }

    async fn into_state(self) -> Option<CommittedState> {
        ShardedReplica::into_state(self).await
    }
}

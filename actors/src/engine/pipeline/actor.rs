//! `StageActor`: one pipeline device as a ractor actor. It owns a [`PipelineStage`] — the parameters and
//! optimizer state of the device's chunks (one per virtual stage) — and runs its ops of the plan,
//! exchanging activations and gradients with the other stage actors over the transport, then the flush:
//! in one `Step` message in process (`run.rs`), or split around the commit vote on the cluster
//! (`Reduce`, then `Apply` once the controller committed; `replica.rs`, where the actor is a child of
//! its rank's WorkerActor). One actor per device rather than per virtual stage: a plan orders a device's
//! chunks' ops against each other, so one mailbox runs them in that order.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tch::Tensor;
use troupe_cluster::transport::Transport;
use troupe_model::data::EvalWindows;
use troupe_model::generate::Evaluation;
use troupe_model::precision::LossScale;

use super::super::committed::ShardPiece;
use super::{PipelineError, PipelineStage, ReducedStage, StageStep};

/// A device's parameters by chunk: (chunk index, values in canonical order).
pub type ChunkParams = Vec<(usize, Vec<Tensor>)>;

/// A device's parameters: by chunk, and the head's device's copy of a tied embedding matrix.
pub type DeviceParams = (ChunkParams, Option<Tensor>);

pub enum StageMsg {
    /// Run the next step; the reply carries what it did or why it failed.
    Step(RpcReplyPort<Result<StageStep, String>>),
    /// The current parameters by chunk: (chunk index, values in canonical order), and a tied head's copy
    /// of the embedding matrix. Every device of the run is asked (with ZeRO inside the stages' groups, the
    /// replicas gather them together).
    Params(RpcReplyPort<Result<DeviceParams, String>>),
    /// The first half of a step: the device's ops and the reductions, nothing applied
    /// ([`PipelineStage::reduce_gradients`]). The step is abandoned — the actor free for the next message
    /// at once, its committed state untouched — when `abandon`'s sender is dropped or sends: the asking
    /// rank's step ended without it (an abort).
    Reduce { abandon: tokio::sync::oneshot::Receiver<()>, reply: RpcReplyPort<Result<ReducedStage, PipelineError>> },
    /// The second half, once the step is committed ([`PipelineStage::apply_update`]); the reply carries
    /// the counters after it.
    Apply(ReducedStage, RpcReplyPort<StageCounters>),
    /// The validation loss of the committed parameters over `windows`, forward only
    /// ([`PipelineStage::evaluate`]); abandoned like `Reduce` when `abandon`'s sender is dropped or sends.
    Evaluate {
        windows: EvalWindows,
        abandon: tokio::sync::oneshot::Receiver<()>,
        reply: RpcReplyPort<Result<Evaluation, PipelineError>>,
    },
    /// The device's committed state as pieces of the flat parameter order, and its counters.
    Export(RpcReplyPort<(Vec<ShardPiece>, StageCounters)>),
}

/// A stage's step counters: what its rank's trainer mirrors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageCounters {
    pub step: u64,
    pub optimizer_step: u64,
    pub loss_scale: LossScale,
}

impl StageCounters {
    pub fn of<T: Transport>(stage: &PipelineStage<T>) -> Self {
        Self { step: stage.step, optimizer_step: stage.optimizer_step(), loss_scale: stage.loss_scale() }
    }
}

pub struct StageActor<T: Transport>(std::marker::PhantomData<fn() -> T>);

impl<T: Transport> Default for StageActor<T> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T: Transport> Actor for StageActor<T> {
    type Msg = StageMsg;
    type State = PipelineStage<T>;
    type Arguments = PipelineStage<T>;

    async fn pre_start(
        &self,
        _me: ActorRef<StageMsg>,
        stage: PipelineStage<T>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(stage)
    }

    async fn handle(
        &self,
        _me: ActorRef<StageMsg>,
        msg: StageMsg,
        stage: &mut PipelineStage<T>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            StageMsg::Step(reply) => {
                let result = stage.train_step().await.map_err(|e: PipelineError| e.to_string());
                let _ = reply.send(result);
            }
            StageMsg::Params(reply) => {
                let result = stage.current_param_values().await.map_err(|e: PipelineError| e.to_string());
                let _ = reply.send(result.map(|chunks| (chunks, stage.tied_copy_value())));
            }
            StageMsg::Reduce { abandon, reply } => {
                let result = tokio::select! {
                    r = stage.reduce_gradients() => r,
                    _ = abandon => {
                        Err(PipelineError::Actor { device: stage.device(), reason: "the step was abandoned".into() })
                    }
                };
                let _ = reply.send(result);
            }
            StageMsg::Apply(reduced, reply) => {
                stage.apply_update(reduced);
                let _ = reply.send(StageCounters::of(stage));
            }
            StageMsg::Evaluate { windows, abandon, reply } => {
                let result = tokio::select! {
                    r = stage.evaluate(&windows) => r,
                    _ = abandon => {
                        Err(PipelineError::Actor { device: stage.device(), reason: "the evaluation was abandoned".into() })
                    }
                };
                let _ = reply.send(result);
            }
            StageMsg::Export(reply) => {
                let _ = reply.send((stage.export_state(), StageCounters::of(stage)));
            }
        }
        Ok(())
    }
}

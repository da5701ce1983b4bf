//! `StageActor`: one pipeline device as a ractor actor. It owns a [`PipelineStage`] — the parameters and
//! optimizer state of the device's chunks (one per virtual stage) — and runs one step per `Step`
//! message: its ops of the plan, exchanging activations and gradients with the other stage actors over
//! the transport, then the flush. One actor per device rather than per virtual stage: a plan orders a
//! device's chunks' ops against each other, so one mailbox runs them in that order.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tch::Tensor;
use troupe_cluster::transport::Transport;

use super::{PipelineError, PipelineStage, StageStep};

/// A device's parameters by chunk: (chunk index, values in canonical order).
pub type ChunkParams = Vec<(usize, Vec<Tensor>)>;

pub enum StageMsg {
    /// Run the next step; the reply carries what it did or why it failed.
    Step(RpcReplyPort<Result<StageStep, String>>),
    /// The current parameters by chunk: (chunk index, values in canonical order). Every device of the
    /// run is asked (with ZeRO inside the stages' groups, the replicas gather them together).
    Params(RpcReplyPort<Result<ChunkParams, String>>),
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
                let _ = reply.send(result);
            }
        }
        Ok(())
    }
}

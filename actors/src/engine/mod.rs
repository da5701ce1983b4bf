//! The training engines: how one rank's share of a step is computed and combined with the others'.
//!
//! In this build: [`DataParallelReplica`] (DDP: every rank holds the model, gradients are all-reduced in
//! buckets through troupe's own collectives, overlapped with a block-wise backward — `overlap`) and
//! [`ShardedReplica`] (ZeRO-1/2/3: optimizer state, for ZeRO-2 gradients too, for ZeRO-3 parameters
//! too — gathered per unit just in time, [`zero3`] — sharded across ranks, each shard also shadowed by
//! a buddy rank — [`shard_plan`]), both driven by the worker through [`StepEngine`]; and [`pipeline`]
//! (the model cut into stages run by stage actors: schedules as checked plans, activations and
//! gradients as messages); and [`TensorParallelReplica`] (`parallel.tp`: Megatron's layers over each
//! replica's tensor group, DDP over the replicas); and [`PeriodicReplica`] (`parallel.sync = "local_sgd" |
//! "diloco"`: local steps, the replicas' parameters synchronized every `parallel.sync_every` steps).
//! [`PersistentState`] counts what a rank keeps between steps.
//!
//! Architecture Invariant: dependencies point down, and no engine uses another. From the bottom:
//! `flat`, `shard_plan` (pure), `segments`, `committed`, `memory`, `eval`; then `step_engine` — the
//! [`StepEngine`] trait, [`EngineError`], [`ReducedStep`], [`OpTiming`], naming no engine; then what
//! engines share: `reshard`, `overlap`, `zero3`, `shard_owner` (below `sharded`, which spawns and asks
//! it); on top the engines, `data_parallel`, `sharded`, `pipeline`, `tensor_parallel` and `periodic`, each implementing [`StepEngine`]
//! in its own module (a pipeline failure becomes an [`EngineError`] by a `From` in `pipeline`). A helper
//! two engines need moves below both; nothing below an engine names one, and nothing in `step_engine`
//! names a concrete engine or its error. Whoever picks the engine for a job (the worker) is above them all.

mod committed;
mod data_parallel;
pub mod device_plane;
mod eval;
mod flat;
mod memory;
mod overlap;
mod periodic;
pub mod pipeline;
mod reshard;
mod segments;
mod shard_owner;
pub mod shard_plan;
mod sharded;
mod step_engine;
mod tensor_parallel;
pub mod zero3;

pub use committed::{CommittedState, ShardPiece};

/// Asks one of a rank's actors (its stage actor, its shard owner) and waits for the answer; if none
/// came — the actor died, or stopped first — why, in words.
pub(crate) async fn ask_actor<M: ractor::Message, R: Send + 'static>(
    actor: &ractor::ActorRef<M>,
    msg: impl FnOnce(ractor::RpcReplyPort<R>) -> M,
) -> Result<R, String> {
    use ractor::rpc::CallResult;
    match actor.call(msg, None).await {
        Ok(CallResult::Success(reply)) => Ok(reply),
        Ok(CallResult::Timeout) => Err("timed out".to_string()),
        Ok(CallResult::SenderError) => Err("stopped before replying".to_string()),
        Err(e) => Err(e.to_string()),
    }
}
pub use data_parallel::{plan_buckets, CommTiming, DataParallelReplica, DEFAULT_BUCKET_BYTES};
pub use memory::PersistentState;
pub(crate) use periodic::resume_rank;
pub use periodic::PeriodicReplica;
pub use segments::{plan_segments, plan_shard, ShardSegment};
pub use shard_owner::{OwnerArgs, OwnerUpdate, ShardOwnerActor, ShardOwnerMsg};
pub use shard_plan::ShardMode;
pub use sharded::ShardedReplica;
pub use step_engine::{EngineError, OpTiming, ReducedStep, StepEngine};
pub use tensor_parallel::{
    degree_change, degrees_to_try, tensor_parallel_on_device, PlaneControls, TensorParallelReplica,
};

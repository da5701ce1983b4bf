//! What can stop a pipeline step, with the device, step and operation it happened at.

use troupe_cluster::ClusterError;
use troupe_model::TrainError;

use super::super::step_engine::EngineError;
use super::{Op, PartitionError, ScheduleError};

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(
        "--microbatches {microbatches} is more than the {samples} samples a pipeline gets per step (train.global_batch \
         divided by --dp): use at most {samples} micro-batches, or a larger global batch"
    )]
    TooManyMicrobatches { microbatches: usize, samples: usize },
    #[error("device {device}, step {step}, {op}: {source}")]
    Message { device: usize, step: u64, op: Op, source: ClusterError },
    #[error("device {device}, step {step}, {op}: message of {got} bytes, expected {expected}")]
    BadMessage { device: usize, step: u64, op: Op, got: usize, expected: usize },
    #[error("device {device}, step {step}: reducing the gradient norm and loss across stages: {source}")]
    Flush { device: usize, step: u64, source: ClusterError },
    #[error(
        "device {device}, step {step}: summing the tied embedding matrix's gradient with device {peer} (the other \
         end of the pipeline): {source}"
    )]
    Tied { device: usize, peer: usize, step: u64, source: ClusterError },
    #[error("device {device}, evaluating the validation loss after step {step}: {what}")]
    Eval { device: usize, step: u64, what: String },
    #[error("stage actor of device {device}: {reason}")]
    Actor { device: usize, reason: String },
}

/// A pipeline's failure as the step engine's: here rather than beside [`EngineError`], which names no
/// engine.
impl From<PipelineError> for EngineError {
    fn from(e: PipelineError) -> Self {
        EngineError::Pipeline(Box::new(e))
    }
}

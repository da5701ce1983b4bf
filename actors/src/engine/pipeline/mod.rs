//! Pipeline parallelism: the model cut into stages on different devices, micro-batches flowing forward as
//! activations and backward as gradients.
//!
//! `plan`, `schedules`, `check` and `partition` are pure (no tch, no tokio, no clock): a schedule is a [`Plan`], the
//! ordered ops of every device, that the checker validates and times before anything runs.

mod actor;
mod balance;
mod check;
mod error;
mod measure;
mod partition;
mod plan;
mod replica;
mod run;
mod schedules;
mod stage;
mod trace;

pub use actor::{StageActor, StageMsg};
pub use balance::{costs_for, measure as measure_costs};
pub use check::{check, simulate, textbook_bubble, Costs, PlanError, PlanReport, Timeline};
pub use error::PipelineError;
pub use measure::{measure_bubble, BubbleFigures};
pub use partition::{partition, partition_by, ChunkLayout, ModelCosts, PartitionError};
pub use plan::{Op, OpKind, Plan, PlanShape, ScheduleKind};
pub use replica::PipelineReplica;
pub use run::{run_in_process, run_stages, DeviceTransports, PipelineOptions, PipelineRun, PipelineStep};
pub use schedules::{plan, with_messages, ScheduleError, MICROBATCHES_MAX, STAGES_MAX, VIRTUAL_STAGES_MAX};
pub use stage::{
    chunk_ranges, held_ranges, microbatch_ranges, tied_copy_range, DataParallelGroup, OpSpan, PipelineStage,
    ReducedStage, StageStep, PIPELINE_TAG_GROUP,
};
pub use trace::{category, chrome_trace, op_name};

//! Pipeline parallelism: the model cut into stages on different devices, micro-batches flowing forward as
//! activations and backward as gradients.
//!
//! `plan`, `schedules` and `check` are pure (no tch, no tokio, no clock): a schedule is a [`Plan`], the
//! ordered ops of every device, that the checker validates and times before anything runs.

mod check;
mod plan;
mod schedules;

pub use check::{check, simulate, textbook_bubble, Costs, PlanError, PlanReport, Timeline};
pub use plan::{Op, OpKind, Plan, PlanShape, ScheduleKind};
pub use schedules::{plan, with_messages, ScheduleError, MICROBATCHES_MAX, STAGES_MAX, VIRTUAL_STAGES_MAX};

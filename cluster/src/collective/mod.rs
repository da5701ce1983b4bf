//! Collectives: pure plans ([`plan`]) — which chunk goes to whom at which step — executed over any
//! [`crate::transport::Transport`] by [`exec`], behind the [`Communicator`] API and the [`Collective`]
//! trait that the NCCL backend also implements.

mod chunks;
mod communicator;
mod element;
pub mod exec;
mod hosts;
pub mod plan;
pub mod send_buffers;
pub mod shm;
pub mod simulate;

pub use chunks::chunk_range;
pub use communicator::{CallTally, Collective, CollectiveConfig, Communicator};
pub use element::{Dtype, Element};
pub use hosts::HostLayout;
pub use troupe_kernels::reduce::ReduceOp;

//! The training engines: how one rank's share of a step is computed and combined with the others'.
//!
//! In this build: [`DataParallelReplica`] (DDP: every rank holds the model, gradients are all-reduced in
//! buckets through troupe's own collectives). FSDP/ZeRO and pipeline stages land beside it.

mod data_parallel;

pub use data_parallel::{plan_buckets, DataParallelReplica, DEFAULT_BUCKET_BYTES};

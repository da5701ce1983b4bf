//! troupe-actors: the supervised actors (node, worker, stage, shard owner, job controller), the training
//! engine, the job API, and the `troupe` command line.
//!
//! In this build: the CLI over the single-process reference trainer, and the data-parallel engine
//! ([`engine::DataParallelReplica`]) over troupe's collectives; the actor runtime, remote messaging and
//! the other distributed modes land here next (see docs/ARCHITECTURE.md).

pub mod api;
pub mod catalog;
pub mod cli;
pub mod daemon;
pub mod engine;
pub mod error;
pub mod node_config;
pub mod plan;
pub mod progress;
pub mod protocol;
pub mod runtime;
pub mod telemetry;

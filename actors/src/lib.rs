//! troupe-actors: the supervised actors (node, worker, stage, shard owner, job controller), the training
//! engine, the job API, and the `troupe` command line.
//!
//! In this build the engine is the single-process reference trainer of troupe-model; the actor runtime,
//! remote messaging and the distributed modes land here next (see docs/ARCHITECTURE.md).

pub mod cli;
pub mod progress;

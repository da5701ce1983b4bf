//! The actor runtime (ractor on tokio): one supervision tree per node.
//!
//! ```text
//! NodeActor (the daemon)                       node.rs
//! ├── WorkerActor × slots                      worker.rs   (restarted per RestartPolicy, else escalate)
//! └── JobController × jobs (controller only)   controller.rs + job.rs (the sans-IO attempt/commit logic)
//! ```
//!
//! Pure logic lives beside the actors and is tested without them: [`restart`] (restart policy),
//! [`job`] (the job's attempt and commit protocol), and membership in `troupe_cluster::membership`.
//! docs/runtime-semantics.md is the contract: ordering, timeouts, restarts, epochs.

pub mod controller;
pub mod event_log;
pub mod job;
pub mod messages;
pub mod node;
pub mod node_core;
#[cfg(test)]
mod node_core_tests;
mod outbox;
pub mod raft;
pub mod worker;

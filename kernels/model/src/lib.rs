//! troupe-model: the libtorch (tch) engine — the reference GPT, the data pipeline and its deterministic
//! global sampler, AdamW and its schedule, and the single-process trainer that is the oracle for every
//! distributed mode (DESIGN.md §4).
//!
//! Invariant: only this crate and those above it link libtorch.

pub mod blockwise;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod gpt;
pub mod optim;
pub mod oracle;
pub mod precision;
pub mod rng;
pub mod storage;
pub mod trainer;

pub use config::{ConfigError, JobConfig};
pub use gpt::{Gpt, GptConfig};
pub use trainer::{StepReport, TrainError, Trainer};

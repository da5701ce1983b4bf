//! troupe-model: the libtorch (tch) engine — the model families (GPT-2, Llama) and Hugging Face's format, the data pipeline and its deterministic
//! global sampler, AdamW and its schedule, and the single-process trainer that is the oracle for every
//! distributed mode (DESIGN.md §4).
//!
//! Invariant: only this crate and those above it link libtorch.

pub mod blockwise;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod generate;
pub mod hf;
pub mod hf_weights;
pub mod init;
pub mod model;
pub mod optim;
pub mod oracle;
pub mod precision;
pub mod rng;
pub mod sections;
pub mod storage;
pub mod trainer;

pub use config::{ConfigError, JobConfig};
pub use model::{Model, ModelConfig};
pub use trainer::{StepReport, TrainError, Trainer};

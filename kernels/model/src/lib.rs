//! troupe-model: the libtorch (tch) engine — the model families (GPT-2, Llama) and Hugging Face's format, the data pipeline and its deterministic
//! global sampler, AdamW and its schedule, and the single-process trainer that is the oracle for every
//! distributed mode (DESIGN.md §4).
//!
//! Invariant: only this crate and those above it link libtorch.
//!
//! Architecture Invariant: the modules are layered, and a module uses only modules on rows below its
//! own (`scripts/module-cycles.py kernels/model/src` finds any dependency that points back up):
//!
//! ```text
//! periodic                               the reference of periodic synchronization (local SGD, DiLoCo)
//! trainer                                the reference trainer; its state into and out of checkpoints
//! checkpoint  generate                   durable training state; evaluation and sampling
//! data                                   corpora and the global sampler
//! oracle                                 the comparisons with the references
//! config      init                       JobConfig (TOML, [model] resolved); Model::new/load, initial values
//! hf          blockwise                  config.json, export, PEFT adapters; the blockwise backward
//! tensor_parallel                        a tensor-parallel rank's shards, forward and backward
//! model                                  the families, the parameter list, the frozen base
//! precision                              compute precision, the loss scaler
//! optim                                  AdamW, its schedule, clipping
//! sections    hf_weights  rng  storage   the plain config sections and ConfigError; HF tensors by name
//! transfer                               host-to-device uploads that do not stall the host
//! ```
//!
//! So the model never reads `config.json` or a PEFT adapter directory, the plain sections never name the
//! model, and a checkpoint never sees a `Trainer`. Where a method of a lower type needs a higher module,
//! that module implements it — `Model::new` and `Model::load` in `init`, `TrainingState::snapshot`,
//! `refresh` and `restore_into` in `trainer` — and whoever calls it is above that module too.

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
pub mod periodic;
pub mod precision;
pub mod rng;
pub mod sections;
pub mod storage;
pub mod tensor_parallel;
pub mod trainer;
pub mod transfer;

pub use config::{ConfigError, JobConfig};
pub use model::{Model, ModelConfig};
pub use trainer::{StepReport, TrainError, Trainer};

/// The bytes a tensor's elements take (elements × element size): what the memory reports count.
pub fn tensor_bytes(t: &tch::Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}

//! Tensor parallelism (Megatron-LM: column- and row-parallel linears, vocab-parallel embedding and
//! cross-entropy) and sequence parallelism (the norms and the residual stream sharded along the sequence)
//! for every model family, on one rank's shards.
//!
//! - [`layout`]: how each parameter splits (a table per family), shard and gather.
//! - [`group`]: the collectives a rank needs ([`TpGroup`]) and an in-process group for tests.
//! - [`tape`]: the computation cut at every collective into autograd segments.
//! - [`rank`]: a rank's forward, backward and gradient clipping.
//!
//! AdamW is elementwise, so a rank updates its shards with [`crate::optim::AdamW`] as they are: a shard's
//! update is the shard of the full update. See docs/ARCHITECTURE.md, "Tensor and sequence parallelism".

pub mod group;
pub mod layout;
pub mod rank;
pub mod tape;

pub use group::{LocalGroup, TpGroup};
pub use layout::{Split, TpLayout};
pub use rank::TpRank;

/// What tensor parallelism refuses.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(
        "tensor-parallel degree {degree} does not divide {key} ({value}); the nearest valid degree is {nearest} \
         (troupe does not pad: choose a degree that divides the heads, key/value heads, MLP width, vocabulary \
         and, with sequence parallelism, the sequence)"
    )]
    Degree { key: &'static str, value: usize, degree: usize, nearest: usize },
    #[error("{0}")]
    Unsupported(String),
    #[error(
        "parameter {name} of the {arch} family has no tensor-parallel rule: state its split in tensor_parallel::layout"
    )]
    NoRule { name: String, arch: &'static str },
    #[error("tensor-parallel collective failed: {0}")]
    Comm(String),
}

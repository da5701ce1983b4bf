//! Tensor parallelism (Megatron-LM: column- and row-parallel linears, vocab-parallel embedding and
//! cross-entropy) and sequence parallelism (the norms and the residual stream sharded along the sequence)
//! for every model family, on one rank's shards.
//!
//! - [`layout`]: how each parameter splits (a table per family), shard and gather.
//! - [`group`]: the collectives a rank needs ([`TpGroup`]) and an in-process group for tests.
//! - [`tape`]: the computation cut at every collective into autograd segments.
//! - [`rank`]: a rank's forward, backward and gradient clipping.
//! - [`parts`]: the model parts a rank runs (all, or a pipeline stage's) and the parameters it holds.
//! - [`stage`]: a rank's share of one pipeline stage (tensor × pipeline parallelism).
//!
//! AdamW is elementwise, so a rank updates its shards with [`crate::optim::AdamW`] as they are: a shard's
//! update is the shard of the full update. See docs/ARCHITECTURE.md, "Tensor and sequence parallelism".

pub mod group;
pub mod layout;
pub mod parts;
pub mod rank;
pub mod stage;
pub mod tape;

pub use group::{LocalGroup, TpGroup};
pub use layout::{splits_kv_heads, Split, TpLayout};
pub use parts::{held_params, StageParts};
pub use rank::TpRank;
pub use stage::{PendingWeights, StageForward};

/// What tensor parallelism refuses.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(
        "tensor-parallel degree {degree} (parallel.tp) does not divide {key} ({value}); the nearest valid degree \
         is {nearest} (choose a degree that divides the heads, the MLP width and, with sequence parallelism, the \
         sequence, and divides the key/value heads or is a multiple of them; the vocabulary is padded)"
    )]
    Degree { key: &'static str, value: usize, degree: usize, nearest: usize },
    #[error(
        "tensor-parallel degree {degree} (parallel.tp) neither divides model.n_kv_heads ({kv_heads}) nor is a \
         multiple of it (model.n_heads = {n_heads}): each rank needs whole key/value heads, or one replicated over \
         parallel.tp / model.n_kv_heads ranks; the nearest valid degree is {nearest}"
    )]
    KvHeads { degree: usize, kv_heads: usize, n_heads: usize, nearest: usize },
    #[error("{0}")]
    Unsupported(String),
    #[error(
        "parameter {name} of the {arch} family has no tensor-parallel rule: state its split in tensor_parallel::layout"
    )]
    NoRule { name: String, arch: &'static str },
    #[error("tensor-parallel collective failed: {0}")]
    Comm(String),
}

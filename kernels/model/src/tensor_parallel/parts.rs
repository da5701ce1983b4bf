//! Which parts of the model a rank runs — all of them, or one pipeline stage's — and which parameters
//! it therefore holds.

use std::ops::Range;

use crate::model::{param_specs, ModelConfig};

/// The model's parts one pipeline chunk runs: the embeddings (the first chunk), a run of blocks, the
/// final norm, head and loss (the last chunk).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageParts {
    pub embed: bool,
    pub blocks: Range<usize>,
    pub head: bool,
}

impl StageParts {
    /// The whole model: embeddings, every block, head.
    pub fn whole(config: &ModelConfig) -> Self {
        Self { embed: true, blocks: 0..config.n_layers, head: true }
    }

    /// Per model part (0 the embeddings, 1 + b block b, 1 + `n_layers` the head): whether these run it.
    pub fn runs(&self, config: &ModelConfig) -> Vec<bool> {
        let mut runs = vec![false; config.n_layers + 2];
        runs[0] = self.embed;
        for b in self.blocks.clone() {
            runs[1 + b] = true;
        }
        runs[1 + config.n_layers] = self.head;
        runs
    }
}

/// Per parameter ([`param_specs`] order): whether a rank running the model parts `runs` (as
/// [`StageParts::runs`], or several chunks' or-ed) uses it — its parts' parameters, and with a tied head
/// the embedding matrix, of which the head's stage keeps its own copy.
pub fn held_params(config: &ModelConfig, runs: &[bool]) -> Vec<bool> {
    let mut held = vec![false; param_specs(config).len()];
    let n = config.n_layers;
    let mut mark = |range: Range<usize>| held[range].iter_mut().for_each(|h| *h = true);
    if runs[0] {
        mark(config.embed_range());
    }
    for b in (0..n).filter(|b| runs[1 + b]) {
        mark(config.block_range(b));
    }
    if runs[1 + n] {
        mark(config.head_range());
        if config.head_takes_embedding() {
            mark(0..1);
        }
    }
    held
}

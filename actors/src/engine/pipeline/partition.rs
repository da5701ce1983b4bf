//! Cutting the model into pipeline chunks: the blocks split into P·V contiguous runs balanced by a cost
//! — parameter count (`parallel.balance = "params"`), or measured seconds (`"measured"`, see
//! [`super::balance`]) — the embeddings with the first chunk, the final LayerNorm, head and loss with the
//! last. Because the canonical parameter order is embeddings, blocks, head, every chunk owns one
//! contiguous range of it. Pure: shapes and costs in, ranges out.

use std::ops::Range;

use troupe_model::model::{param_specs, ModelConfig};

/// One chunk's share of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkLayout {
    /// Whether the chunk starts with the token and position embeddings (the first chunk).
    pub embed: bool,
    /// The transformer blocks it runs, in order.
    pub blocks: Range<usize>,
    /// Whether it ends with the final LayerNorm, the head and the loss (the last chunk).
    pub head: bool,
    /// Its parameters: a range of [`param_specs`]' order.
    pub params: Range<usize>,
    /// Their element count.
    pub numel: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PartitionError {
    #[error(
        "cannot cut {layers} blocks into {chunks} pipeline chunks (stages × virtual stages): use at most \
         {layers} chunks, or a deeper model (model.n_layers ≥ {chunks})"
    )]
    TooFewBlocks { layers: usize, chunks: usize },
}

/// What each part of the model weighs when the chunks are balanced: the embeddings, every block, and the
/// final LayerNorm + head + loss, in one unit (parameters, or seconds of forward and backward).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCosts {
    pub embed: f64,
    pub blocks: Vec<f64>,
    pub head: f64,
}

impl ModelCosts {
    /// Parameter counts: `parallel.balance = "params"`, the default (exact in f64 below 2⁵³). A tied
    /// head counts the embedding matrix it multiplies by (its device keeps a copy and runs the product),
    /// so it weighs what an untied head weighs.
    pub fn parameters(config: &ModelConfig) -> Self {
        let specs = param_specs(config);
        let numel = |r: Range<usize>| specs[r].iter().map(|s| s.numel()).sum::<usize>() as f64;
        let tied = if config.head_takes_embedding() { numel(0..1) } else { 0.0 };
        Self {
            embed: numel(config.embed_range()),
            blocks: (0..config.n_layers).map(|i| numel(config.block_range(i))).collect(),
            head: numel(config.head_range()) + tied,
        }
    }

    /// The costs in one flat list (embeddings, blocks, head) of `f32`, to travel in a collective; rounded
    /// to `f32` on the sender and taken back as they arrive, so every rank cuts from the same values.
    pub fn to_flat(&self) -> Vec<f32> {
        std::iter::once(self.embed).chain(self.blocks.iter().copied()).chain([self.head]).map(|c| c as f32).collect()
    }

    /// The inverse of [`Self::to_flat`]; None unless `flat` holds `layers` blocks.
    pub fn from_flat(flat: &[f32], layers: usize) -> Option<Self> {
        (flat.len() == layers + 2).then(|| Self {
            embed: flat[0].into(),
            blocks: flat[1..=layers].iter().map(|&c| c.into()).collect(),
            head: flat[layers + 1].into(),
        })
    }
}

/// Splits `config`'s blocks into `chunks` contiguous non-empty runs minimising the largest chunk's
/// parameter count (embeddings counted with the first chunk, the head with the last).
pub fn partition(config: &ModelConfig, chunks: usize) -> Result<Vec<ChunkLayout>, PartitionError> {
    partition_by(config, &ModelCosts::parameters(config), chunks)
}

/// Splits `config`'s blocks into `chunks` contiguous non-empty runs minimising the largest chunk's cost
/// under `costs` (embeddings counted with the first chunk, the head with the last). Ties go to the
/// earliest cut, so every rank given the same costs cuts the same way.
pub fn partition_by(
    config: &ModelConfig,
    costs: &ModelCosts,
    chunks: usize,
) -> Result<Vec<ChunkLayout>, PartitionError> {
    let layers = config.n_layers;
    if chunks == 0 || chunks > layers {
        return Err(PartitionError::TooFewBlocks { layers, chunks });
    }
    assert_eq!(costs.blocks.len(), layers, "a cost per block");
    let specs = param_specs(config);
    let numel = |r: Range<usize>| specs[r].iter().map(|s| s.numel()).sum::<usize>();
    // weight(c, a..b): chunk c running blocks a..b.
    let weight = |c: usize, a: usize, b: usize| {
        costs.blocks[a..b].iter().sum::<f64>()
            + if c == 0 { costs.embed } else { 0.0 }
            + if c + 1 == chunks { costs.head } else { 0.0 }
    };
    // best[c][b]: the smallest possible largest weight when chunks 0..=c run blocks 0..b; cut[c][b] the
    // start of chunk c in that split.
    let mut best = vec![vec![f64::INFINITY; layers + 1]; chunks];
    let mut cut = vec![vec![0usize; layers + 1]; chunks];
    for (b, best) in best[0].iter_mut().enumerate().skip(1) {
        *best = weight(0, 0, b);
    }
    for c in 1..chunks {
        for b in c + 1..=layers {
            for a in c..b {
                if best[c - 1][a] == f64::INFINITY {
                    continue;
                }
                let candidate = best[c - 1][a].max(weight(c, a, b));
                if candidate < best[c][b] {
                    (best[c][b], cut[c][b]) = (candidate, a);
                }
            }
        }
    }
    let mut bounds = vec![layers; chunks + 1];
    bounds[0] = 0;
    for c in (1..chunks).rev() {
        bounds[c] = cut[c][bounds[c + 1]];
    }
    Ok((0..chunks)
        .map(|c| {
            let blocks = bounds[c]..bounds[c + 1];
            let first = if c == 0 { 0 } else { config.block_range(blocks.start).start };
            let last = if c + 1 == chunks { specs.len() } else { config.block_range(blocks.end).start };
            ChunkLayout { embed: c == 0, head: c + 1 == chunks, numel: numel(first..last), blocks, params: first..last }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layers: usize) -> ModelConfig {
        ModelConfig { n_layers: layers, ..ModelConfig::gpt_tiny() }
    }

    #[test]
    fn chunks_cover_every_parameter_once_in_order() {
        for layers in 1..=8 {
            for chunks in 1..=layers {
                let cfg = config(layers);
                let parts = partition(&cfg, chunks).unwrap();
                assert_eq!(parts.len(), chunks);
                assert_eq!(parts[0].params.start, 0);
                assert_eq!(parts[chunks - 1].params.end, param_specs(&cfg).len());
                for w in parts.windows(2) {
                    assert_eq!(w[0].params.end, w[1].params.start);
                    assert_eq!(w[0].blocks.end, w[1].blocks.start);
                }
                assert!(parts.iter().all(|p| !p.blocks.is_empty()));
                assert_eq!(parts.iter().map(|p| p.numel).sum::<usize>(), cfg.param_count());
            }
        }
    }

    #[test]
    fn embeddings_and_head_weigh_on_the_end_chunks() {
        // gpt-tiny at 8 blocks over 4 chunks: a block is 789,760 parameters, the embeddings 98,304, the
        // head 66,048. Two blocks per chunk is the only balanced split with non-empty ends.
        let parts = partition(&config(8), 4).unwrap();
        let blocks: Vec<_> = parts.iter().map(|p| p.blocks.clone()).collect();
        assert_eq!(blocks, vec![0..2, 2..4, 4..6, 6..8]);
        // Large embeddings push blocks off the first chunk: vocab 50k makes wte 12.8M parameters.
        let big_vocab = ModelConfig { vocab_size: 50_000, n_layers: 6, ..ModelConfig::gpt_tiny() };
        let parts = partition(&big_vocab, 3).unwrap();
        assert_eq!(parts[0].blocks, 0..1, "{parts:?}");
        assert_eq!(parts[2].blocks, 5..6, "{parts:?}");
    }

    #[test]
    fn parameter_costs_cut_as_before_and_measured_costs_move_blocks_off_a_heavy_head() {
        let cfg = config(4);
        let by_params = partition_by(&cfg, &ModelCosts::parameters(&cfg), 2).unwrap();
        assert_eq!(by_params, partition(&cfg, 2).unwrap());
        assert_eq!(by_params[0].blocks, 0..2);
        // A head that costs three blocks' time (a large vocabulary's matrix product and softmax) and free
        // embeddings: the first chunk takes three blocks, and the parameters still cover the model.
        let costs = ModelCosts { embed: 0.1, blocks: vec![1.0; 4], head: 3.0 };
        let parts = partition_by(&cfg, &costs, 2).unwrap();
        assert_eq!(parts.iter().map(|p| p.blocks.clone()).collect::<Vec<_>>(), vec![0..3, 3..4]);
        assert_eq!(parts.iter().map(|p| p.numel).sum::<usize>(), cfg.param_count());
        // Costs travel through a collective as f32 and come back as the same cut.
        let back = ModelCosts::from_flat(&costs.to_flat(), 4).unwrap();
        assert_eq!(partition_by(&cfg, &back, 2).unwrap(), parts);
        assert_eq!(ModelCosts::from_flat(&costs.to_flat(), 5), None);
    }

    #[test]
    fn a_tied_head_weighs_what_an_untied_head_weighs() {
        // A vocabulary of 50k over 6 blocks of gpt-tiny: the head's matrix (12.8M) outweighs a block
        // (0.8M), tied or not, so the last chunk runs as few blocks either way.
        let untied = ModelConfig { vocab_size: 50_000, n_layers: 6, ..ModelConfig::gpt_tiny() };
        let tied = ModelConfig { tie_word_embeddings: true, ..untied.clone() };
        let blocks = |config: &ModelConfig| -> Vec<Range<usize>> {
            partition(config, 3).unwrap().into_iter().map(|p| p.blocks).collect()
        };
        assert_eq!(blocks(&tied), blocks(&untied));
        assert_eq!(blocks(&tied)[2], 5..6);
        // The chunks' parameters are still the flat state's: the matrix counted once, with the first.
        let parts = partition(&tied, 3).unwrap();
        assert_eq!(parts.iter().map(|p| p.numel).sum::<usize>(), tied.param_count());
    }

    #[test]
    fn too_many_chunks_is_refused_with_the_fix() {
        let err = partition(&config(4), 8).unwrap_err().to_string();
        assert!(err.contains("model.n_layers ≥ 8"), "{err}");
    }
}

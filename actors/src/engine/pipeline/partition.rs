//! Cutting the model into pipeline chunks: the blocks split into P·V contiguous runs balanced by
//! parameter count, the embeddings with the first chunk, the final LayerNorm, head and loss with the
//! last. Because the canonical parameter order is embeddings, blocks, head, every chunk owns one
//! contiguous range of it. Pure: shapes in, ranges out.

use std::ops::Range;

use troupe_model::gpt::{param_specs, GptConfig, PARAMS_AFTER_BLOCKS, PARAMS_BEFORE_BLOCKS, PARAMS_PER_BLOCK};

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

/// Splits `config`'s blocks into `chunks` contiguous non-empty runs minimising the largest chunk's
/// parameter count (embeddings counted with the first chunk, the head with the last).
pub fn partition(config: &GptConfig, chunks: usize) -> Result<Vec<ChunkLayout>, PartitionError> {
    let layers = config.n_layers;
    if chunks == 0 || chunks > layers {
        return Err(PartitionError::TooFewBlocks { layers, chunks });
    }
    let specs = param_specs(config);
    let numel = |r: Range<usize>| specs[r].iter().map(|s| s.numel()).sum::<usize>();
    let embed = numel(0..PARAMS_BEFORE_BLOCKS);
    let head = numel(specs.len() - PARAMS_AFTER_BLOCKS..specs.len());
    let block = |i: usize| {
        numel(PARAMS_BEFORE_BLOCKS + i * PARAMS_PER_BLOCK..PARAMS_BEFORE_BLOCKS + (i + 1) * PARAMS_PER_BLOCK)
    };
    let blocks_numel: Vec<usize> = (0..layers).map(block).collect();
    // weight(c, a..b): chunk c running blocks a..b.
    let weight = |c: usize, a: usize, b: usize| {
        blocks_numel[a..b].iter().sum::<usize>()
            + if c == 0 { embed } else { 0 }
            + if c + 1 == chunks { head } else { 0 }
    };
    // best[c][b]: the smallest possible largest weight when chunks 0..=c run blocks 0..b; cut[c][b] the
    // start of chunk c in that split.
    let mut best = vec![vec![usize::MAX; layers + 1]; chunks];
    let mut cut = vec![vec![0usize; layers + 1]; chunks];
    for (b, best) in best[0].iter_mut().enumerate().skip(1) {
        *best = weight(0, 0, b);
    }
    for c in 1..chunks {
        for b in c + 1..=layers {
            for a in c..b {
                if best[c - 1][a] == usize::MAX {
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
            let first = if c == 0 { 0 } else { PARAMS_BEFORE_BLOCKS + blocks.start * PARAMS_PER_BLOCK };
            let last = if c + 1 == chunks { specs.len() } else { PARAMS_BEFORE_BLOCKS + blocks.end * PARAMS_PER_BLOCK };
            ChunkLayout {
                embed: c == 0,
                head: c + 1 == chunks,
                numel: weight(c, blocks.start, blocks.end),
                blocks,
                params: first..last,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(layers: usize) -> GptConfig {
        GptConfig { n_layers: layers, ..GptConfig::gpt_tiny() }
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
        let big_vocab = GptConfig { vocab_size: 50_000, n_layers: 6, ..GptConfig::gpt_tiny() };
        let parts = partition(&big_vocab, 3).unwrap();
        assert_eq!(parts[0].blocks, 0..1, "{parts:?}");
        assert_eq!(parts[2].blocks, 5..6, "{parts:?}");
    }

    #[test]
    fn too_many_chunks_is_refused_with_the_fix() {
        let err = partition(&config(4), 8).unwrap_err().to_string();
        assert!(err.contains("model.n_layers ≥ 8"), "{err}");
    }
}

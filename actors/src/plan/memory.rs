//! What each rank holds: parameters, gradients and AdamW state in fp32, after the tensor split of its
//! stage's parameters (the model's own table, [`troupe_model::tensor_parallel::layout`]) and the ZeRO
//! split over its data-parallel group.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use troupe_model::tensor_parallel::{Split, TpLayout};

/// Bytes of one fp32 value (master weights, gradients and optimizer state are fp32 in every precision).
pub const FP32_BYTES: u64 = 4;
/// AdamW's states per parameter (first and second moments).
pub const ADAMW_STATES: u64 = 2;

/// One rank's fp32 training state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankMemory {
    /// Elements of the stage's split parameters this rank holds (1/T of them).
    pub sharded_elements: u64,
    /// Elements every tensor rank holds whole.
    pub replicated_elements: u64,
    /// The tied head's copy of the token embedding (its share) on the last stage of a pipeline; it has
    /// gradients, its optimizer state lives with the embedding on the first stage.
    pub tied_copy_elements: u64,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub optimizer_bytes: u64,
    pub total_bytes: u64,
}

/// The elements of parameters `range` (of [`troupe_model::model::param_specs`]) one rank of `layout`'s
/// group holds, by the model's own split table: (of split parameters, of replicated ones).
pub fn tensor_share(layout: &TpLayout, range: Range<usize>) -> (u64, u64) {
    let shapes = layout.shard_shapes();
    let numel = |shape: &Vec<i64>| shape.iter().product::<i64>() as u64;
    shapes[range.clone()].iter().zip(&layout.splits[range]).fold((0, 0), |(sharded, replicated), (shape, split)| {
        match split {
            Split::Replicated => (sharded, replicated + numel(shape)),
            _ => (sharded + numel(shape), replicated),
        }
    })
}

/// The state of one rank of a stage owning `params` (a range of the parameter list), with `tied_copy`
/// when it also holds the tied head's copy of the embedding, split as `layout` says, ZeRO stage `zero`
/// over `dp`.
pub fn rank_memory(layout: &TpLayout, params: Range<usize>, tied_copy: bool, dp: usize, zero: u8) -> RankMemory {
    let (sharded, replicated) = tensor_share(layout, params);
    let tied = if tied_copy { tensor_share(layout, 0..1).0 } else { 0 };
    let own = sharded + replicated;
    // ZeRO stage k splits the first k of (optimizer state, gradients, parameters) over the dp group.
    let zeroed = |elements: u64, from: u8| if zero >= from { elements.div_ceil(dp as u64) } else { elements };
    let param_bytes = FP32_BYTES * (zeroed(own, 3) + tied);
    let grad_bytes = FP32_BYTES * (zeroed(own, 2) + tied);
    let optimizer_bytes = FP32_BYTES * ADAMW_STATES * zeroed(own, 1);
    RankMemory {
        sharded_elements: sharded,
        replicated_elements: replicated,
        tied_copy_elements: tied,
        param_bytes,
        grad_bytes,
        optimizer_bytes,
        total_bytes: param_bytes + grad_bytes + optimizer_bytes,
    }
}

#[cfg(test)]
mod tests {
    use troupe_model::model::ModelConfig;

    use super::*;

    #[test]
    fn gpt_tiny_at_tp_2_holds_half_its_matrices_and_every_norm() {
        let config = ModelConfig::gpt_tiny();
        let layout = TpLayout::new(&config, 2, true).unwrap();
        let (sharded, replicated) = tensor_share(&layout, 0..config.param_tensors());
        // Replicated per block: ln_1, ln_2 (2 × 2 × 256), c_proj biases (2 × 256); wpe 128 × 256; ln_f 2 × 256.
        let per_block = 4 * 256 + 2 * 256;
        assert_eq!(replicated, (4 * per_block + 128 * 256 + 2 * 256) as u64);
        assert_eq!(2 * sharded + replicated, config.param_count() as u64);
    }

    #[test]
    fn zero_stages_split_state_then_gradients_then_parameters() {
        let config = ModelConfig::gpt_tiny();
        let layout = TpLayout::new(&config, 1, false).unwrap();
        let m = |zero| rank_memory(&layout, 0..config.param_tensors(), false, 4, zero);
        let n = config.param_count() as u64;
        assert_eq!((m(0).param_bytes, m(0).grad_bytes, m(0).optimizer_bytes), (4 * n, 4 * n, 8 * n));
        assert_eq!(m(1).optimizer_bytes, 8 * n.div_ceil(4));
        assert_eq!((m(2).grad_bytes, m(2).param_bytes), (4 * n.div_ceil(4), 4 * n));
        assert_eq!(m(3).param_bytes, 4 * n.div_ceil(4));
    }
}

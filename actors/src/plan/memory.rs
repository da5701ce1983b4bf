//! What each rank holds: parameters, gradients and AdamW state in fp32, after the tensor split of its
//! stage's parameters and the ZeRO split over its data-parallel group.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use troupe_model::model::{param_specs, ModelConfig, ParamSpec};

/// Bytes of one fp32 value (master weights, gradients and optimizer state are fp32 in every precision).
pub const FP32_BYTES: u64 = 4;
/// AdamW's states per parameter (first and second moments).
pub const ADAMW_STATES: u64 = 2;

/// How a parameter splits over a tensor group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Split by output rows: q/k/v (by heads), fc1, gate, up — weights and their biases.
    Column,
    /// Split by input columns: the attention output projection, fc2 / down (their biases replicated).
    Row,
    /// Split by vocabulary rows: the token embedding and the head.
    Vocab,
    /// Every tensor rank holds it whole: norms, position embeddings, row-parallel biases, adapters.
    Replicated,
}

/// How the parameter named `name` (GPT-2's or Llama's Hugging Face name) splits.
pub fn split_of(name: &str) -> Split {
    const COLUMN: &[&str] = &["attn.c_attn.", "mlp.c_fc.", "q_proj.", "k_proj.", "v_proj.", "gate_proj.", "up_proj."];
    const ROW: &[&str] = &["attn.c_proj.weight", "mlp.c_proj.weight", "o_proj.weight", "down_proj.weight"];
    const VOCAB: &[&str] = &["wte.weight", "embed_tokens.weight", "lm_head.weight"];
    let lora = name.contains("lora_");
    if !lora && VOCAB.iter().any(|v| name.ends_with(v)) {
        Split::Vocab
    } else if !lora && ROW.iter().any(|r| name.ends_with(r)) {
        Split::Row
    } else if !lora && COLUMN.iter().any(|c| name.contains(c)) {
        Split::Column
    } else {
        Split::Replicated
    }
}

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

/// The elements of `specs[range]` one of `tp` tensor ranks holds: (split, replicated).
pub fn tensor_share(specs: &[ParamSpec], range: Range<usize>, tp: usize) -> (u64, u64) {
    let (mut sharded, mut replicated) = (0u64, 0u64);
    for spec in &specs[range] {
        let numel = spec.numel() as u64;
        match split_of(&spec.name) {
            Split::Replicated => replicated += numel,
            _ => sharded += numel / tp as u64,
        }
    }
    (sharded, replicated)
}

/// The state of one rank of a stage owning `params` (a range of [`param_specs`]), with `tied_copy` when
/// it also holds the tied head's copy of the embedding, split `tp` ways, ZeRO stage `zero` over `dp`.
pub fn rank_memory(
    config: &ModelConfig,
    params: Range<usize>,
    tied_copy: bool,
    tp: usize,
    dp: usize,
    zero: u8,
) -> RankMemory {
    let specs = param_specs(config);
    let (sharded, replicated) = tensor_share(&specs, params, tp);
    let tied = if tied_copy { tensor_share(&specs, 0..1, tp).0 } else { 0 };
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
    use super::*;

    #[test]
    fn every_gpt2_and_llama_matrix_splits_and_norms_stay_whole() {
        for (name, split) in [
            ("wte.weight", Split::Vocab),
            ("wpe.weight", Split::Replicated),
            ("h.0.ln_1.weight", Split::Replicated),
            ("h.0.attn.c_attn.weight", Split::Column),
            ("h.0.attn.c_attn.bias", Split::Column),
            ("h.0.attn.c_proj.weight", Split::Row),
            ("h.0.attn.c_proj.bias", Split::Replicated),
            ("h.0.mlp.c_fc.bias", Split::Column),
            ("h.0.mlp.c_proj.weight", Split::Row),
            ("lm_head.weight", Split::Vocab),
            ("model.embed_tokens.weight", Split::Vocab),
            ("model.layers.0.self_attn.k_proj.bias", Split::Column),
            ("model.layers.0.self_attn.o_proj.weight", Split::Row),
            ("model.layers.0.mlp.up_proj.weight", Split::Column),
            ("model.layers.0.mlp.down_proj.weight", Split::Row),
            ("model.layers.0.post_attention_layernorm.weight", Split::Replicated),
            ("model.norm.weight", Split::Replicated),
        ] {
            assert_eq!(split_of(name), split, "{name}");
        }
    }

    #[test]
    fn gpt_tiny_at_tp_2_holds_half_its_matrices_and_every_norm() {
        let config = ModelConfig::gpt_tiny();
        let specs = param_specs(&config);
        let (sharded, replicated) = tensor_share(&specs, 0..specs.len(), 2);
        // Replicated per block: ln_1, ln_2 (2 × 2 × 256), c_proj biases (2 × 256); wpe 128 × 256; ln_f 2 × 256.
        let per_block = 4 * 256 + 2 * 256;
        assert_eq!(replicated, (4 * per_block + 128 * 256 + 2 * 256) as u64);
        assert_eq!(2 * sharded + replicated, config.param_count() as u64);
    }

    #[test]
    fn zero_stages_split_state_then_gradients_then_parameters() {
        let config = ModelConfig::gpt_tiny();
        let all = config.param_tensors();
        let m = |zero| rank_memory(&config, 0..all, false, 1, 4, zero);
        let n = config.param_count() as u64;
        assert_eq!((m(0).param_bytes, m(0).grad_bytes, m(0).optimizer_bytes), (4 * n, 4 * n, 8 * n));
        assert_eq!(m(1).optimizer_bytes, 8 * n.div_ceil(4));
        assert_eq!((m(2).grad_bytes, m(2).param_bytes), (4 * n.div_ceil(4), 4 * n));
        assert_eq!(m(3).param_bytes, 4 * n.div_ceil(4));
    }
}

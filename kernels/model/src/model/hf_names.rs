//! How the families' parameters are stored in Hugging Face's files. Llama's parameters carry Hugging
//! Face's names as they are. GPT-2's drop the `transformer.` prefix, and its `Conv1D` matrices are stored
//! `[in, out]` in the files and `[out, in]` in troupe (an `nn.Linear` layout): the transpose happens at
//! the file boundary — where a file is read ([`read_param`], [`crate::hf_weights`]) or written
//! ([`crate::hf`]) — and nowhere else.

use super::{Arch, ModelConfig, ParamSpec};
use crate::hf_weights::{HfError, HfWeights};

/// The name of `spec` in Hugging Face's files, and whether the file stores it transposed (GPT-2's
/// `Conv1D`).
pub fn file_name(config: &ModelConfig, spec: &ParamSpec) -> (String, bool) {
    match config.arch {
        Arch::Llama => (spec.name.clone(), false),
        Arch::Gpt2 if spec.name == "lm_head.weight" => (spec.name.clone(), false),
        Arch::Gpt2 => {
            let conv1d = [".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"];
            let transposed = conv1d.iter().any(|suffix| spec.name.ends_with(suffix));
            (format!("transformer.{}", spec.name), transposed)
        }
    }
}

/// Parameter `spec` of `config`'s model from `weights`, as fp32 in troupe's layout (GPT-2's `Conv1D`
/// matrices transposed), its shape checked.
pub fn read_param(weights: &HfWeights, config: &ModelConfig, spec: &ParamSpec) -> Result<Vec<f32>, HfError> {
    let (name, transposed) = file_name(config, spec);
    weights.read(&name, transposed, &spec.shape)
}

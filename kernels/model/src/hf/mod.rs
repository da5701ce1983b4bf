//! Hugging Face's model format, in and out: `config.json` ↔ [`ModelConfig`] (`config_json.rs`), the check
//! that a `from_hf` directory holds exactly the model's weights ([`check_weights`]), and an export that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads (`export.rs`); PEFT's LoRA adapter directories in and
//! out, and the merged model ([`peft`]).
//!
//! Below the model: reading the weights by tensor, and [`HfError`] ([`crate::hf_weights`], re-exported
//! here); the name and layout of each parameter in the files ([`crate::model::file_name`]: GPT-2's
//! `Conv1D` matrices are stored `[in, out]` and transposed at the file boundary, and nowhere else).

mod config_json;
mod export;
pub mod peft;

pub use crate::hf_weights::{HfError, HfWeights};
pub use config_json::{json_key, read_config, write_config, ARCHITECTURES};
pub use export::{export, ExportDtype, ExportOptions};

use crate::hf_weights::transpose;
use crate::model::{base_specs, file_name, ModelConfig, ParamSpec};

/// Checks, before anything trains, that `config.from_hf` holds exactly `config`'s parameters: every one
/// present with its shape and a readable dtype, and no tensor that is not one of them (buffers older
/// versions saved, and a tied head's copy, excepted). Reads the headers only — and, with `[peft]
/// from_adapters`, checks the adapters ([`peft::Adapters::open`]).
pub fn check_weights(config: &ModelConfig) -> Result<(), HfError> {
    let Some(dir) = &config.from_hf else { return Ok(()) };
    let specs = base_specs(config);
    let params = specs.iter().map(|spec| {
        let (name, transposed) = file_name(config, spec);
        (name, transposed, spec.shape.as_slice())
    });
    let tied_copy = |name: &str| config.tie_word_embeddings && name == "lm_head.weight";
    HfWeights::open(dir)?.check_exactly(params, tied_copy, config.arch.as_str())?;
    peft::check_adapters(config)
}

/// `spec`'s values (troupe's layout) as a file stores them: its shape and values, transposed where the
/// file keeps the matrix as `[in, out]` (GPT-2's `Conv1D`).
fn file_layout(spec: &ParamSpec, values: &[f32], transposed: bool) -> (Vec<usize>, Vec<f32>) {
    assert_eq!(values.len(), spec.numel(), "{}: value count", spec.name);
    let mut shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
    if !transposed {
        return (shape, values.to_vec());
    }
    let t = transpose(values, shape[0], shape[1]);
    shape.reverse();
    (shape, t)
}

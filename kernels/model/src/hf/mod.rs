//! Hugging Face's model format, in and out: `config.json` ↔ [`ModelConfig`] (`config_json.rs`), weights read
//! by tensor from `model.safetensors` or its shards (`weights.rs`), and an export that
//! `transformers.AutoModelForCausalLM.from_pretrained` loads (`export.rs`); PEFT's LoRA adapter directories in and
//! out, and the merged model ([`peft`]).
//!
//! Names: Llama's parameters carry Hugging Face's names as they are. GPT-2's drop the `transformer.`
//! prefix, and its `Conv1D` matrices are stored `[in, out]` in the files and `[out, in]` in troupe (an
//! `nn.Linear` layout): the transpose happens here, at the file boundary, and nowhere else.

use std::path::PathBuf;

mod config_json;
mod export;
pub mod peft;
mod weights;

pub use config_json::{json_key, read_config, write_config, ARCHITECTURES};
pub use export::{export, ExportDtype, ExportOptions};
pub use weights::{check_weights, HfWeights};

use crate::model::{Arch, ModelConfig, ParamSpec};

/// What a Hugging Face directory or file that cannot be used gets: the file, the tensor or the key, and
/// what was expected.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{dir}: no model.safetensors or model.safetensors.index.json; a Hugging Face model directory holds one (save_pretrained writes it)")]
    NoWeights { dir: PathBuf },
    #[error("{index}: names the file {file} for tensor {tensor}, but {file} is not in {dir}")]
    MissingShard { index: PathBuf, dir: PathBuf, file: String, tensor: String },
    #[error("{dir}: the weights have no tensor {tensor} (expected {shape:?}); the directory does not hold the model its config.json describes")]
    MissingTensor { dir: PathBuf, tensor: String, shape: Vec<i64> },
    #[error(
        "{path}: tensor {tensor} has shape {found:?}, expected {expected:?} for the model of config.json and [model]"
    )]
    Shape { path: PathBuf, tensor: String, found: Vec<usize>, expected: Vec<usize> },
    #[error(
        "{path}: tensor {tensor} is not a parameter of a {arch} model of this shape; remove it or check config.json"
    )]
    Unexpected { path: PathBuf, tensor: String, arch: &'static str },
    #[error("{path}: tensor {tensor} is {dtype}; troupe reads F32, BF16 and F16 weights")]
    Dtype { path: PathBuf, tensor: String, dtype: String },
    #[error("{path}: architecture {found:?} is not one troupe builds; supported: {supported}")]
    Architecture { path: PathBuf, found: String, supported: String },
    #[error("{path}: {key} = {value} is not supported: {why}")]
    Unsupported { path: PathBuf, key: String, value: String, why: String },
    #[error(
        "[model] {key} = {toml} disagrees with {path}: {json_key} = {json}; remove the key from [model] or correct it"
    )]
    Disagrees { key: String, toml: String, path: PathBuf, json_key: String, json: String },
}

/// The file name of `spec` in Hugging Face's layout, and whether the file stores it transposed
/// (GPT-2's `Conv1D`).
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

/// Tensors a Hugging Face file may hold that are not parameters (buffers older versions saved).
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") && !name.contains(".c_attn.")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".rotary_emb.inv_freq")
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

/// A row-major `[rows, cols]` matrix as row-major `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

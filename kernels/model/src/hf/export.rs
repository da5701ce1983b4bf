//! Writing a Hugging Face model directory from troupe's parameters: `config.json`,
//! `generation_config.json` and `model.safetensors` — or, above `max_shard_bytes`, shards
//! `model-0000N-of-0000M.safetensors` with `model.safetensors.index.json` — that
//! `AutoModelForCausalLM.from_pretrained` loads with no missing or unexpected keys.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::config_json::write_config;
use super::{file_layout, HfError};
use crate::model::{base_specs, file_name, ModelConfig, ParamSpec};

/// The dtype of the exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    F32,
    Bf16,
}

impl ExportDtype {
    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
        }
    }
}

/// How to export.
#[derive(Clone, Copy, Debug)]
pub struct ExportOptions {
    pub dtype: ExportDtype,
    /// Largest safetensors file; a model above it is split into shards with an index (transformers'
    /// `max_shard_size`).
    pub max_shard_bytes: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self { dtype: ExportDtype::F32, max_shard_bytes: 5 << 30 }
    }
}

/// Writes `config`'s model with parameter values `values` (fp32, troupe's layout, [`base_specs`] order: the whole
/// model, a LoRA model's adapters merged first) into `out` as a Hugging Face directory. Returns the files written.
pub fn export(
    config: &ModelConfig,
    values: &[Vec<f32>],
    out: &Path,
    options: ExportOptions,
) -> Result<Vec<String>, HfError> {
    let specs = base_specs(config);
    assert_eq!(values.len(), specs.len(), "one value vector per parameter");
    if config.qkv_bias && config.head_dim != 0 {
        return Err(HfError::Unsupported {
            path: out.to_owned(),
            key: "model.head_dim".into(),
            value: config.head_dim.to_string(),
            why: "Qwen2's config.json has no head_dim: it must be d_model / n_heads".into(),
        });
    }
    std::fs::create_dir_all(out).map_err(|source| HfError::Io { path: out.to_owned(), source })?;
    let tensors = file_tensors(config, &specs, values, options.dtype);
    let shards = plan_shards(&tensors, options.max_shard_bytes);
    let mut written = write_shards(out, &tensors, &shards, options.dtype)?;
    write_json(&out.join("config.json"), &write_config(config, options.dtype.torch_name()))?;
    write_json(&out.join("generation_config.json"), &json!({"_from_model_config": true}))?;
    written.extend(["config.json".to_owned(), "generation_config.json".to_owned()]);
    Ok(written)
}

/// Each tensor by its Hugging Face name: its shape in Hugging Face's layout and its bytes in `dtype`.
type FileTensors = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

/// The parameters `values` (of `specs`) under Hugging Face's names and layout, as `dtype` bytes.
fn file_tensors(config: &ModelConfig, specs: &[ParamSpec], values: &[Vec<f32>], dtype: ExportDtype) -> FileTensors {
    let mut tensors = FileTensors::new();
    for (spec, values) in specs.iter().zip(values) {
        let (name, transposed) = file_name(config, spec);
        let (shape, laid_out) = file_layout(spec, values, transposed);
        let bytes = match dtype {
            ExportDtype::F32 => laid_out.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ExportDtype::Bf16 => laid_out.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        };
        tensors.insert(name, (shape, bytes));
    }
    tensors
}

/// The tensors' names cut into shards of at most `max_shard_bytes` each, in name order (a tensor larger
/// than that gets a shard of its own).
fn plan_shards(tensors: &FileTensors, max_shard_bytes: u64) -> Vec<Vec<&String>> {
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, (_, bytes)) in tensors {
        let current = shards.last_mut().expect("a shard");
        if !current.is_empty() && size + bytes.len() as u64 > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("a shard").push(name);
        size += bytes.len() as u64;
    }
    shards
}

/// Writes `model.safetensors`, or one file per shard and the index. Returns the files written.
fn write_shards(
    out: &Path,
    tensors: &FileTensors,
    shards: &[Vec<&String>],
    dtype: ExportDtype,
) -> Result<Vec<String>, HfError> {
    let dtype = match dtype {
        ExportDtype::F32 => Dtype::F32,
        ExportDtype::Bf16 => Dtype::BF16,
    };
    let metadata = Some([("format".to_owned(), "pt".to_owned())].into_iter().collect());
    let mut written = Vec::new();
    let mut weight_map = serde_json::Map::new();
    let count = shards.len();
    for (i, shard) in shards.iter().enumerate() {
        let file = if count == 1 {
            "model.safetensors".to_owned()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let views = shard.iter().map(|name| {
            let (shape, bytes) = &tensors[*name];
            let view = TensorView::new(dtype, shape.clone(), bytes).expect("shape matches the bytes");
            (name.as_str(), view)
        });
        let path = out.join(&file);
        safetensors::serialize_to_file(views, metadata.clone(), &path)
            .map_err(|e| HfError::Format { path: path.clone(), message: format!("cannot write: {e}") })?;
        for name in shard {
            weight_map.insert((*name).clone(), json!(file));
        }
        written.push(file);
    }
    if count > 1 {
        let total: usize = tensors.values().map(|(_, bytes)| bytes.len()).sum();
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_json(&out.join("model.safetensors.index.json"), &index)?;
        written.push("model.safetensors.index.json".into());
    }
    Ok(written)
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), HfError> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialise");
    std::fs::write(path, text + "\n").map_err(|source| HfError::Io { path: path.to_owned(), source })
}

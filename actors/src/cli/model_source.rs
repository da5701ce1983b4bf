//! The model a `troupe generate` or `troupe eval` runs: a Hugging Face directory (config.json +
//! safetensors) or a troupe checkpoint (a `step-NNNNNNNN` directory, or a root: its newest valid one),
//! told apart by what the directory holds.

use std::path::Path;

use anyhow::{bail, Context};
use troupe_model::checkpoint::{load_state, StateKind, MANIFEST};
use troupe_model::hf;
use troupe_model::model::Model;
use troupe_model::ModelConfig;

/// Loads the model at `path` on the CPU.
pub fn load_model(path: &Path) -> anyhow::Result<Model> {
    if path.join("config.json").is_file() {
        let config = hf::read_config(path).with_context(|| format!("--model {}", path.display()))?;
        let config = ModelConfig { from_hf: Some(path.to_owned()), ..config };
        hf::check_weights(&config).with_context(|| format!("--model {}", path.display()))?;
        return Ok(Model::load(config, 0)?);
    }
    if !path.is_dir() {
        let what = if path.exists() { "not a directory" } else { "no such directory" };
        bail!("--model {}: {what}; name a Hugging Face model directory or a troupe checkpoint", path.display());
    }
    let dir = if path.join(MANIFEST).is_file() {
        path.to_owned()
    } else {
        super::checkpoint::source(path).with_context(|| {
            format!("--model {}: neither a Hugging Face directory (no config.json) nor a checkpoint", path.display())
        })?
    };
    let state = load_state(&dir).with_context(|| format!("loading {}", dir.display()))?;
    let config = ModelConfig { from_hf: None, ..state.config.model.clone() };
    let mut model = Model::new(config, 0);
    let offsets = state.offsets();
    let params = state.values(StateKind::Param);
    let values: Vec<tch::Tensor> = model
        .specs()
        .iter()
        .enumerate()
        .map(|(i, spec)| tch::Tensor::from_slice(&params[offsets[i]..offsets[i + 1]]).view(spec.shape.as_slice()))
        .collect();
    model.load_values(&values);
    Ok(model)
}

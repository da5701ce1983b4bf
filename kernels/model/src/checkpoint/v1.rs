//! Version-1 checkpoints (`model.safetensors` + `optimizer.safetensors`, whole tensors) described in the
//! version-2 terms, so they verify and load — into any layout — through the same code.

use std::path::Path;

use serde::Deserialize;

use super::manifest::{FileEntry, Layout, Manifest, Piece, RngState, StateKind, TensorEntry, FORMAT};
use super::CheckpointError;
use crate::config::JobConfig;
use crate::data::SamplerState;

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The version-1 `manifest.json`.
#[derive(Deserialize)]
struct ManifestV1 {
    step: u64,
    config: JobConfig,
    sampler: SamplerState,
    optimizer_step: u64,
    files: Vec<FileV1>,
}

#[derive(Deserialize)]
struct FileV1 {
    name: String,
    bytes: u64,
    checksum: u64,
}

/// The version-2 description of a version-1 manifest.
pub fn upgrade(dir: &Path, value: serde_json::Value) -> Result<Manifest, CheckpointError> {
    let old: ManifestV1 = serde_json::from_value(value)
        .map_err(|e| CheckpointError::Manifest { path: dir.to_owned(), message: format!("version 1: {e}") })?;
    let specs = crate::model::param_specs(&old.config.model);
    let mut tensors = Vec::new();
    for kind in StateKind::ALL {
        let file = if kind == StateKind::Param { MODEL_FILE } else { OPTIMIZER_FILE };
        for spec in &specs {
            tensors.push(TensorEntry {
                param: spec.name.clone(),
                state: kind,
                dtype: "F32".into(),
                shape: spec.shape.iter().map(|&d| d as usize).collect(),
                pieces: vec![Piece { file: file.into(), key: kind.key(&spec.name), elements: 0..spec.numel() }],
            });
        }
    }
    let files = old
        .files
        .into_iter()
        .map(|f| FileEntry { name: f.name, shard: 0, stage: 0, bytes: f.bytes, checksum: f.checksum })
        .collect();
    Ok(Manifest {
        format: FORMAT.into(),
        version: 1,
        step: old.step,
        optimizer_step: old.optimizer_step,
        rng: RngState { generator: "counter-splitmix64".into(), seed: old.config.train.seed, next_step: old.step },
        config: old.config,
        sampler: old.sampler,
        layout: Layout::ddp(1),
        tensors,
        files,
        loss_scale: None,
        base: None,
        periodic: None,
    })
}

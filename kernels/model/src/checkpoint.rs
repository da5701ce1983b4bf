//! Checkpoints of the reference trainer: one directory per committed step holding `model.safetensors`,
//! `optimizer.safetensors` and `manifest.json` (step, config, sampler state, optimizer step, and an XXH3-64
//! checksum per file from `troupe_kernels::checksum64`). The commit is atomic: files written and fsynced in
//! a temporary directory → manifest written and fsynced → directory renamed into place → parent fsynced. A
//! directory whose files do not match its manifest's checksums is refused on load.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;
use troupe_kernels::checksum64;

use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::trainer::Trainer;

pub const MANIFEST: &str = "manifest.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const FORMAT: &str = "troupe-checkpoint";
const FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {op} failed: {source}")]
    Io { path: PathBuf, op: &'static str, source: std::io::Error },
    #[error("checkpoint {path}: {message}")]
    Tensors { path: PathBuf, message: String },
    #[error("checkpoint {path}: manifest is not valid ({message}); the checkpoint is torn or not a troupe checkpoint")]
    Manifest { path: PathBuf, message: String },
    #[error("checkpoint {path}: {file} does not match its checksum (expected {expected:016x}, found {found:016x}); the file is corrupt")]
    Checksum { path: PathBuf, file: String, expected: u64, found: u64 },
    #[error("checkpoint {path} was written for a different {what}; resume with the job config it was trained with ({detail})")]
    Mismatch { path: PathBuf, what: &'static str, detail: String },
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Committed steps when saved.
    pub step: u64,
    pub config: JobConfig,
    pub sampler: SamplerState,
    pub optimizer_step: u64,
    pub files: Vec<FileEntry>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub checksum: u64,
}

/// The checkpoint directory name for `step` committed steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Saves the trainer's whole state under `parent/step-NNNNNNNN` atomically; returns that directory.
pub fn save(trainer: &Trainer, parent: &Path) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(parent).map_err(io(parent, "create directory"))?;
    let final_dir = parent.join(step_dir_name(trainer.step));
    let tmp = parent.join(format!(".{}.tmp-{}", step_dir_name(trainer.step), std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp, "remove stale temporary directory"))?;
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp, "create directory"))?;

    let model: Vec<(String, Tensor)> = trainer.model.named_params().map(|(n, t)| (n.to_owned(), t.detach())).collect();
    let names: Vec<&str> = trainer.model.specs().iter().map(|s| s.name.as_str()).collect();
    let mut optimizer = Vec::new();
    for (i, name) in names.iter().enumerate() {
        optimizer.push((format!("exp_avg.{name}"), trainer.optimizer.exp_avg[i].shallow_clone()));
        optimizer.push((format!("exp_avg_sq.{name}"), trainer.optimizer.exp_avg_sq[i].shallow_clone()));
    }
    let mut files = Vec::new();
    for (file, tensors) in [(MODEL_FILE, model), (OPTIMIZER_FILE, optimizer)] {
        let path = tmp.join(file);
        write_tensors(&path, tensors)?;
        let bytes = std::fs::read(&path).map_err(io(&path, "read back"))?;
        files.push(FileEntry { name: file.to_owned(), bytes: bytes.len() as u64, checksum: checksum64(&bytes) });
    }
    let manifest = Manifest {
        format: FORMAT.to_owned(),
        version: FORMAT_VERSION,
        step: trainer.step,
        config: trainer.config.clone(),
        sampler: trainer.sampler.state(trainer.step, trainer.config.train.global_batch),
        optimizer_step: trainer.optimizer.step,
        files,
    };
    let manifest_path = tmp.join(MANIFEST);
    let json = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
    write_synced(&manifest_path, &json)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io(&final_dir, "replace existing checkpoint"))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir, "rename into place"))?;
    File::open(parent).and_then(|d| d.sync_all()).map_err(io(parent, "fsync directory"))?;
    Ok(final_dir)
}

/// Reads and verifies a checkpoint directory: the manifest, and every file against its checksum.
pub fn load(dir: &Path) -> Result<(Manifest, HashMap<String, Tensor>), CheckpointError> {
    let manifest_path = dir.join(MANIFEST);
    let json = std::fs::read(&manifest_path).map_err(|source| CheckpointError::Io {
        path: manifest_path.clone(),
        op: "read",
        source,
    })?;
    let manifest: Manifest = serde_json::from_slice(&json)
        .map_err(|e| CheckpointError::Manifest { path: dir.to_owned(), message: e.to_string() })?;
    if manifest.format != FORMAT || manifest.version != FORMAT_VERSION {
        let message = format!("format {} v{}, expected {FORMAT} v{FORMAT_VERSION}", manifest.format, manifest.version);
        return Err(CheckpointError::Manifest { path: dir.to_owned(), message });
    }
    let mut tensors = HashMap::new();
    for entry in &manifest.files {
        let path = dir.join(&entry.name);
        let bytes =
            std::fs::read(&path).map_err(|source| CheckpointError::Io { path: path.clone(), op: "read", source })?;
        let found = checksum64(&bytes);
        if found != entry.checksum || bytes.len() as u64 != entry.bytes {
            return Err(CheckpointError::Checksum {
                path: dir.to_owned(),
                file: entry.name.clone(),
                expected: entry.checksum,
                found,
            });
        }
        let read = Tensor::read_safetensors(&path)
            .map_err(|e| CheckpointError::Tensors { path: path.clone(), message: e.to_string() })?;
        tensors.extend(read);
    }
    Ok((manifest, tensors))
}

/// Restores `trainer` (freshly built from the same config) from checkpoint `dir`.
pub fn restore(trainer: &mut Trainer, dir: &Path) -> Result<(), CheckpointError> {
    let (manifest, mut tensors) = load(dir)?;
    let mismatch = |what, detail: String| CheckpointError::Mismatch { path: dir.to_owned(), what, detail };
    if manifest.config.model != trainer.config.model {
        return Err(mismatch("model", format!("checkpoint has {:?}", manifest.config.model)));
    }
    let expected = trainer.sampler.state(manifest.step, trainer.config.train.global_batch);
    if manifest.sampler != expected {
        return Err(mismatch(
            "data, seed or batch",
            format!("checkpoint sampler {:?}, this run {:?}", manifest.sampler, expected),
        ));
    }
    let mut take = |name: String| {
        tensors.remove(&name).ok_or_else(|| CheckpointError::Tensors {
            path: dir.to_owned(),
            message: format!("tensor {name} is missing"),
        })
    };
    let names: Vec<String> = trainer.model.specs().iter().map(|s| s.name.clone()).collect();
    let mut values = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        values.push(take(name.clone())?);
        trainer.optimizer.exp_avg[i] = take(format!("exp_avg.{name}"))?;
        trainer.optimizer.exp_avg_sq[i] = take(format!("exp_avg_sq.{name}"))?;
    }
    trainer.model.load_values(&values);
    trainer.optimizer.step = manifest.optimizer_step;
    trainer.step = manifest.step;
    Ok(())
}

/// The newest checkpoint under `parent` that verifies; the ones skipped on the way, with why.
pub fn latest_valid(parent: &Path) -> (Option<PathBuf>, Vec<(PathBuf, CheckpointError)>) {
    let mut skipped = Vec::new();
    for dir in step_dirs(parent).into_iter().rev() {
        match load(&dir) {
            Ok(_) => return (Some(dir), skipped),
            Err(e) => skipped.push((dir, e)),
        }
    }
    (None, skipped)
}

/// Removes all but the newest `keep` checkpoints under `parent` (0 keeps all).
pub fn retain_last(parent: &Path, keep: usize) -> Result<(), CheckpointError> {
    let dirs = step_dirs(parent);
    if keep == 0 || dirs.len() <= keep {
        return Ok(());
    }
    for dir in &dirs[..dirs.len() - keep] {
        std::fs::remove_dir_all(dir).map_err(|source| CheckpointError::Io {
            path: dir.clone(),
            op: "remove old checkpoint",
            source,
        })?;
    }
    Ok(())
}

/// Committed checkpoint directories under `parent`, oldest first.
fn step_dirs(parent: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("step-")))
        .collect();
    dirs.sort();
    dirs
}

/// Maps an IO error at `path` during `op`.
fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_owned();
    move |source| CheckpointError::Io { path, op, source }
}

/// Writes named tensors to a safetensors file and fsyncs it.
pub fn write_tensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<(), CheckpointError> {
    Tensor::write_safetensors(&tensors, path)
        .map_err(|e| CheckpointError::Tensors { path: path.to_owned(), message: e.to_string() })?;
    File::open(path).and_then(|f| f.sync_all()).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        op: "fsync",
        source,
    })
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file =
        File::create(path).map_err(|source| CheckpointError::Io { path: path.to_owned(), op: "create", source })?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        op: "write",
        source,
    })
}

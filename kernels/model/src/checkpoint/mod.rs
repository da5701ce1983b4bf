//! Durable, sharded checkpoints of the whole training state (format version 3; 2 without a periodic part).
//!
//! A checkpoint is a directory `step-NNNNNNNN` under a checkpoint root holding one safetensors file per
//! shard (`shard-00000-of-00002.safetensors`: a contiguous range of the flat parameter order, with the
//! parameters and both AdamW moments of that range) and `manifest.json`: the step, the layout it was saved
//! under, for every tensor which file holds which element range (dtype, shape), an XXH3-64 checksum per
//! file, the sampler and RNG state and the optimizer step. The manifest describes every piece explicitly,
//! so a reader needs no layout rule to reassemble the state: any layout (DDP today; ZeRO shards and
//! pipeline stages later) loads into any other ([`read`]).
//!
//! A periodically synchronizing job (`parallel.sync = "local_sgd" | "diloco"`) adds a part (version 3,
//! [`manifest::PeriodicEntry`]): every rank's own inner optimizer state, one `rank-R-of-N` file each, and
//! DiLoCo's outer momentum, cut like the parameters (`outer-S-of-S`); the shards then hold the global
//! parameters and rank 0's moments, so a reader that ignores the part still gets one consistent state. A
//! rank resumes as saved rank `rank mod N` ([`state::PeriodicState::source_of`]).
//!
//! The commit ([`write`], [`store`]): shards written and fsynced in a temporary directory → manifest
//! written and fsynced → directory renamed into place and the root fsynced → recorded in the catalog
//! ([`catalog`], redb — sled failed the crash test) and committed. **The directory is authoritative**: a checkpoint exists iff its
//! `step-*` directory exists and verifies against its manifest; the catalog is an index written after the
//! rename and cleared before a removal, so it may lag the directories by the commit in flight at a crash,
//! never lead them (the store reconciles it when opened).
//!
//! Files, one idea each: `manifest` (the format), `state` (the training state in host memory),
//! `shards` (which flat ranges a layout cuts), `tensor_file` (safetensors write + fsync + checksum),
//! `write` (the atomic directory commit), `read` (verify, load, reshard), `v1` (the previous format,
//! still loadable), `catalog` (the `Catalog` trait, redb and in-memory), `store` (a checkpoint root:
//! save, retention, latest valid, reconcile), `writer` (the asynchronous writer thread).
//!
//! The trainer is above: its snapshot, and saving or restoring it in one call
//! ([`crate::trainer::Trainer::save_checkpoint`], [`crate::trainer::Trainer::restore_checkpoint`]), are
//! `crate::trainer`'s.

pub mod catalog;
pub mod manifest;
pub mod read;
pub mod shards;
pub mod state;
pub mod store;
pub mod tensor_file;
mod v1;
pub mod write;
pub mod writer;

use std::path::{Path, PathBuf};

pub use catalog::{Catalog, CatalogEntry, MemoryCatalog, RedbCatalog};
pub use manifest::{Layout, Manifest, ShardMode, StateKind, FORMAT, FORMAT_VERSION, FORMAT_VERSION_PLAIN, MANIFEST};
pub use read::{load_shard, load_state, verify};
pub use state::{crash_state, synthetic_state, PeriodicState, RankState, ResumedPeriodic, TrainingState};
pub use store::{CheckpointStore, Saved};
pub use writer::{CheckpointWriter, SaveRequest, WriteReport};

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
    #[error("checkpoint {path}: {file} has {found} bytes, the manifest says {expected}; the file is torn or corrupt")]
    Length { path: PathBuf, file: String, expected: u64, found: u64 },
    #[error("checkpoint {path} was written for a different {what}; resume with the job config it was trained with ({detail})")]
    Mismatch { path: PathBuf, what: &'static str, detail: String },
    #[error("checkpoint {path} is format version {version}, newer than this troupe reads ({FORMAT_VERSION}); upgrade troupe to load it")]
    TooNew { path: PathBuf, version: u32 },
    #[error("checkpoint catalog {path}: {message}")]
    Catalog { path: PathBuf, message: String },
}

/// The checkpoint directory name for `step` committed steps.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// The step a `step-NNNNNNNN` directory name stands for.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    name.strip_prefix("step-").filter(|digits| digits.bytes().all(|b| b.is_ascii_digit())).and_then(|d| d.parse().ok())
}

/// Committed checkpoint directories under `root`, oldest (lowest step) first.
pub fn step_dirs(root: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root) else { return Vec::new() };
    let mut dirs: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let step = parse_step_dir_name(e.file_name().to_str()?)?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    dirs.sort();
    dirs
}

/// The newest checkpoint under `root` that verifies; the ones skipped on the way, with why.
pub fn latest_valid(root: &Path) -> (Option<PathBuf>, Vec<(PathBuf, CheckpointError)>) {
    store::latest_valid(root)
}

/// Maps an IO error at `path` during `op`.
pub(crate) fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_owned();
    move |source| CheckpointError::Io { path, op, source }
}

/// fsyncs a directory, so that renames and creations inside it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir, "fsync directory"))
}

//! `manifest.json` of a version-2 checkpoint: what was saved, under which layout, and where every piece
//! of every tensor lies.
//!
//! The layout is recorded for information and for planning a reload; loading never relies on it: each
//! tensor lists its pieces (file, key in the file, element range of the flattened tensor), and the pieces
//! of a tensor must tile it exactly. So a ZeRO-3 save (per-rank ranges of the flat order) or a pipeline
//! save (per-stage tensor subsets) is described by the same fields as today's DDP save.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::config::JobConfig;
use crate::data::SamplerState;
use crate::precision::LossScale;

pub const MANIFEST: &str = "manifest.json";
pub const FORMAT: &str = "troupe-checkpoint";
/// Version 1: `model.safetensors` + `optimizer.safetensors` (still loaded, see `v1`). Version 2: shards.
/// Version 3: version 2 and a periodically synchronizing job's per-rank and outer state ([`Manifest::
/// periodic`]); only checkpoints that hold that part are written as version 3, so every other checkpoint
/// stays readable by a version-2 reader, and a version-2 reader refuses a version-3 one as too new rather
/// than resuming it without the ranks' states.
pub const FORMAT_VERSION: u32 = 3;
/// The version of a checkpoint without a periodic part.
pub const FORMAT_VERSION_PLAIN: u32 = 2;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    /// Committed steps when saved (the next step to run).
    pub step: u64,
    /// AdamW updates applied (the `t` of bias correction).
    pub optimizer_step: u64,
    pub config: JobConfig,
    pub sampler: SamplerState,
    pub rng: RngState,
    pub layout: Layout,
    /// Every tensor of the state, in the model's canonical order, parameters first, then `exp_avg`,
    /// then `exp_avg_sq`.
    pub tensors: Vec<TensorEntry>,
    pub files: Vec<FileEntry>,
    /// fp16's dynamic loss scaler when saved (absent for the other precisions and older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<LossScale>,
    /// A `[peft]` checkpoint's frozen base: the state holds what trains only, so the base it was trained
    /// on is part of what it means. Loading refuses a base whose weights' checksum differs (absent for
    /// full-model checkpoints and older ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<BaseRef>,
    /// Version 3: a periodically synchronizing job's per-rank and outer state (absent for every other job
    /// and in older checkpoints).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub periodic: Option<PeriodicEntry>,
}

/// Where a periodically synchronizing job's own parts are ([`super::state::PeriodicState`]). Each is a
/// flat vector over the whole parameter order, its pieces element ranges of that order (so any shard
/// count reads them back). Each rank's vectors are one file of their own, `rank-RRRRR-of-NNNNN.
/// safetensors` (a resuming rank reads one); the outer momentum is cut like the parameters, one
/// `outer-SSSSS-of-SSSSS.safetensors` per parameter shard.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeriodicEntry {
    /// Ranks whose state is saved: the world at the synchronization saved.
    pub ranks: usize,
    /// Every rank's `exp_avg` and `exp_avg_sq` (the optimizer's two slots), and with Streaming DiLoCo its
    /// `param`s.
    pub rank_vectors: Vec<FlatVector>,
    /// DiLoCo's outer momentum (empty: none, it starts at zero).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outer_momentum: Vec<Piece>,
}

/// A flat vector of rank `rank`, `state` saying which: its pieces tile the flat order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlatVector {
    pub rank: usize,
    pub state: StateKind,
    pub pieces: Vec<Piece>,
}

/// The base model a `[peft]` checkpoint trains on: `model.from_hf` and the checksum of its weights
/// ([`crate::hf::peft::base_checksum`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaseRef {
    pub dir: std::path::PathBuf,
    /// XXH3-64 of the directory's safetensors files (names and bytes, in name order).
    pub checksum: u64,
}

impl BaseRef {
    /// The base of `config`'s model, if it is a `[peft]` model.
    pub fn of(config: &JobConfig) -> Result<Option<Self>, crate::hf::HfError> {
        match (&config.model.peft, &config.model.from_hf) {
            (Some(_), Some(dir)) => Ok(Some(Self { dir: dir.clone(), checksum: crate::hf::peft::base_checksum(dir)? })),
            _ => Ok(None),
        }
    }

    /// Checks that the base is still what the checkpoint `checkpoint` was trained on.
    pub fn check(&self, checkpoint: &std::path::Path) -> Result<(), super::CheckpointError> {
        let mismatch = |detail: String| super::CheckpointError::Mismatch {
            path: checkpoint.to_owned(),
            what: "base model",
            detail,
        };
        let now = crate::hf::peft::base_checksum(&self.dir).map_err(|e| {
            mismatch(format!(
                "the base it was trained on cannot be read: {e}; restore {} (model.from_hf)",
                self.dir.display()
            ))
        })?;
        if now != self.checksum {
            return Err(mismatch(format!(
                "its adapters were trained on the weights of {} with checksum {:016x}, but that directory's weights now have                  checksum {now:016x}: the base changed; restore the base the checkpoint was trained on (nothing was loaded)",
                self.dir.display(),
                self.checksum
            )));
        }
        Ok(())
    }
}

/// The random state of training. troupe draws every random number from a counter-based generator
/// (`crate::rng`: a pure function of the seed and a position — parameter index, step, sample index), so
/// there is no hidden generator state to save: the seed and the next step reproduce every later draw.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngState {
    /// `counter-splitmix64`: the only generator troupe-model uses.
    pub generator: String,
    pub seed: u64,
    pub next_step: u64,
}

/// How the state was distributed when saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Data-parallel degree.
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    pub shard_mode: ShardMode,
    /// Shard files per pipeline stage: contiguous balanced ranges (`troupe_kernels::partition`) of the
    /// stage's flat parameter order.
    pub shards: usize,
}

/// How optimizer state and parameters were split across data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardMode {
    /// DDP: every rank holds the whole state; the files cut it into `shards` ranges so it can be written
    /// (and read) in parallel and loaded by any other layout.
    Ddp,
    Zero1,
    Zero2,
    Zero3,
}

impl Layout {
    /// Data parallelism over `world` ranks, one shard file per rank.
    pub fn ddp(world: usize) -> Self {
        Self { dp: world.max(1), pp: 1, shard_mode: ShardMode::Ddp, shards: world.max(1) }
    }
}

/// Which of the three per-parameter states a tensor is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    Param,
    ExpAvg,
    ExpAvgSq,
}

impl StateKind {
    pub const ALL: [StateKind; 3] = [StateKind::Param, StateKind::ExpAvg, StateKind::ExpAvgSq];

    /// The tensor's name in a safetensors file: parameters keep their HF GPT-2 names (so a one-shard
    /// checkpoint's parameters load as a model directly); moments are prefixed as in version 1.
    pub fn key(self, param: &str) -> String {
        match self {
            StateKind::Param => param.to_owned(),
            StateKind::ExpAvg => format!("exp_avg.{param}"),
            StateKind::ExpAvgSq => format!("exp_avg_sq.{param}"),
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One tensor of the state and where its elements are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    /// The parameter's name (HF GPT-2); with `state` it names the tensor.
    pub param: String,
    pub state: StateKind,
    /// `F32` (the only dtype of the fp32 state today; bf16 masters would say `BF16`).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Pieces in element order; together they tile `0..numel` exactly.
    pub pieces: Vec<Piece>,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Elements `elements` of a tensor (flattened, row-major) stored in `file` under `key`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Piece {
    pub file: String,
    pub key: String,
    pub elements: Range<usize>,
}

/// One file of the checkpoint and what verifies it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub name: String,
    /// The shard index within its stage, and the stage.
    pub shard: usize,
    pub stage: usize,
    pub bytes: u64,
    /// XXH3-64 of the whole file (`troupe_kernels::checksum64`).
    pub checksum: u64,
}

/// The file of rank `rank`'s own state, of `ranks`.
pub fn rank_file_name(rank: usize, ranks: usize) -> String {
    format!("rank-{rank:05}-of-{ranks:05}.safetensors")
}

/// The file of shard `index` of `count` of the outer momentum.
pub fn outer_file_name(index: usize, count: usize) -> String {
    format!("outer-{index:05}-of-{count:05}.safetensors")
}

/// The file name of shard `index` of `count`.
pub fn shard_file_name(index: usize, count: usize) -> String {
    format!("shard-{index:05}-of-{count:05}.safetensors")
}

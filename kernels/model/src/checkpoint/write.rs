//! The atomic commit of one checkpoint directory.
//!
//! 1. Every shard is written to a fresh temporary directory (`.tmp-step-N-PID-K`) and fsynced; shards
//!    are written by parallel threads (one per shard, at most [`WRITE_THREADS_MAX`], the rest of that
//!    budget splitting each file).
//! 2. The manifest is written and fsynced, then the temporary directory itself.
//! 3. The directory is renamed to `step-N` and the root fsynced. From here on the checkpoint exists.
//!
//! A crash at any point before 3 leaves only a temporary directory, which no reader looks at and the next
//! store on the root removes once its writer process is gone. A `step-N` that already exists and verifies
//! is kept (a re-computed step after a rollback holds the same state; replacing it would open a window
//! with no `step-N`); one that does not verify is moved aside first.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::manifest::{
    outer_file_name, rank_file_name, shard_file_name, BaseRef, FileEntry, FlatVector, Layout, Manifest, PeriodicEntry,
    Piece, RngState, StateKind, TensorEntry, FORMAT, FORMAT_VERSION, FORMAT_VERSION_PLAIN, MANIFEST,
};
use super::shards::{pieces_in, shard_range, FlatPiece};
use super::state::{PeriodicState, TrainingState};
use super::tensor_file::{write_f32_file, write_synced, FileTensor};
use super::{io, read, step_dir_name, sync_dir, CheckpointError};

/// Most threads writing one checkpoint: shards are written in parallel, and a file gets several
/// threads when there are fewer shards than this.
pub const WRITE_THREADS_MAX: usize = 4;

/// A committed checkpoint.
#[derive(Clone, Debug)]
pub struct Committed {
    pub path: PathBuf,
    pub manifest: Manifest,
    /// Bytes of the shard files.
    pub bytes: u64,
    /// The step directory already existed and verified: it was kept, nothing new was written.
    pub kept_existing: bool,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh name next to `step-N` for this process: `.{what}-step-N-PID-K` (`tmp`: being written,
/// `torn`: a broken one moved aside, `old`: being removed). Readers never look at names starting with a
/// dot; `store` removes those of processes that are gone.
pub(crate) fn private_name(what: &str, step: u64) -> String {
    let k = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(".{what}-{}-{}-{k}", step_dir_name(step), std::process::id())
}

/// Writes `state` under `root` in `layout` and commits it atomically as `root/step-N`.
pub fn write_checkpoint(state: &TrainingState, root: &Path, layout: &Layout) -> Result<Committed, CheckpointError> {
    std::fs::create_dir_all(root).map_err(io(root, "create directory"))?;
    let tmp = root.join(private_name("tmp", state.step));
    std::fs::create_dir(&tmp).map_err(io(&tmp, "create directory"))?;
    let result = write_into(state, &tmp, layout).and_then(|(manifest, bytes)| {
        let (path, kept_existing) = commit(&tmp, root, state.step)?;
        Ok(Committed { path, manifest, bytes, kept_existing })
    });
    if result.is_err() || result.as_ref().is_ok_and(|c| c.kept_existing) {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Steps 1 and 2: the shards, the manifest, the fsync of the directory.
fn write_into(state: &TrainingState, tmp: &Path, layout: &Layout) -> Result<(Manifest, u64), CheckpointError> {
    let shards = layout.shards.max(1);
    let offsets = state.offsets();
    let plans: Vec<(Range<usize>, Vec<FlatPiece>)> = (0..shards)
        .map(|i| {
            let range = shard_range(state.flat_len(), shards, i);
            let pieces = pieces_in(&offsets, range.clone());
            (range, pieces)
        })
        .collect();
    let mut files = write_shards(state, tmp, &plans)?;
    let ranges: Vec<Range<usize>> = plans.iter().map(|(range, _)| range.clone()).collect();
    let periodic = match &state.periodic {
        Some(periodic) => Some(write_periodic(state, periodic, tmp, &ranges, &mut files)?),
        None => None,
    };
    let bytes = files.iter().map(|f| f.bytes).sum();

    let mut tensors = Vec::new();
    for kind in StateKind::ALL {
        for (i, spec) in state.tensors.iter().enumerate() {
            let pieces = plans
                .iter()
                .enumerate()
                .flat_map(|(s, (_, pieces))| pieces.iter().filter(|p| p.tensor == i).map(move |p| (s, p)))
                .map(|(s, p)| Piece {
                    file: shard_file_name(s, shards),
                    key: kind.key(&spec.name),
                    elements: p.elements.clone(),
                })
                .collect();
            tensors.push(TensorEntry {
                param: spec.name.clone(),
                state: kind,
                dtype: "F32".into(),
                shape: spec.shape.clone(),
                pieces,
            });
        }
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        version: if periodic.is_some() { FORMAT_VERSION } else { FORMAT_VERSION_PLAIN },
        step: state.step,
        optimizer_step: state.optimizer_step,
        config: state.config.clone(),
        sampler: state.sampler.clone(),
        rng: RngState { generator: "counter-splitmix64".into(), seed: state.config.train.seed, next_step: state.step },
        layout: Layout { shards, ..layout.clone() },
        tensors,
        files,
        loss_scale: state.loss_scale,
        base: BaseRef::of(&state.config).map_err(|e| CheckpointError::Manifest {
            path: tmp.to_owned(),
            message: format!("the [peft] base: {e}"),
        })?,
        periodic,
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("the manifest serialises");
    write_synced(&tmp.join(MANIFEST), &json)?;
    sync_dir(tmp)?;
    Ok((manifest, bytes))
}

/// Writes every shard file, in parallel; returns their entries in shard order.
fn write_shards(
    state: &TrainingState,
    tmp: &Path,
    plans: &[(Range<usize>, Vec<FlatPiece>)],
) -> Result<Vec<FileEntry>, CheckpointError> {
    let shards = plans.len();
    let threads = shards.min(WRITE_THREADS_MAX);
    let per_file = (WRITE_THREADS_MAX / threads).max(1);
    let write_one = |index: usize| -> Result<FileEntry, CheckpointError> {
        let name = shard_file_name(index, shards);
        let (range, pieces) = &plans[index];
        let mut tensors = Vec::new();
        for kind in StateKind::ALL {
            for p in pieces {
                let spec = &state.tensors[p.tensor];
                let whole = p.elements.len() == spec.numel();
                tensors.push(FileTensor {
                    key: kind.key(&spec.name),
                    shape: if whole { spec.shape.clone() } else { vec![p.elements.len()] },
                    data: &state.values(kind)[p.flat.clone()],
                });
            }
        }
        let metadata = BTreeMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("step".to_owned(), state.step.to_string()),
            ("shard".to_owned(), format!("{index} of {shards}")),
            ("flat_range".to_owned(), format!("{}..{}", range.start, range.end)),
        ]);
        let written = write_f32_file(&tmp.join(&name), &tensors, &metadata, per_file)?;
        Ok(FileEntry { name, shard: index, stage: 0, bytes: written.bytes, checksum: written.checksum })
    };
    if threads <= 1 {
        return (0..shards).map(write_one).collect();
    }
    let results: Vec<Result<FileEntry, CheckpointError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let write_one = &write_one;
                scope.spawn(move || (t..shards).step_by(threads).map(write_one).collect::<Vec<_>>())
            })
            .collect();
        let mut by_thread: Vec<std::vec::IntoIter<_>> =
            handles.into_iter().map(|h| h.join().expect("a shard writer does not panic").into_iter()).collect();
        (0..shards).map(|i| by_thread[i % threads].next().expect("one result per shard")).collect()
    });
    results.into_iter().collect()
}

/// The periodic part's files (see [`PeriodicEntry`]): one per rank, and the outer momentum cut by the
/// parameter shards' flat `ranges`; their entries are appended to `files`.
fn write_periodic(
    state: &TrainingState,
    periodic: &PeriodicState,
    tmp: &Path,
    ranges: &[Range<usize>],
    files: &mut Vec<FileEntry>,
) -> Result<PeriodicEntry, CheckpointError> {
    let (total, ranks) = (state.flat_len(), periodic.ranks.len());
    let bad = |message: String| CheckpointError::Manifest { path: tmp.to_owned(), message };
    let metadata = |what: String| {
        BTreeMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("step".to_owned(), state.step.to_string()),
            ("part".to_owned(), what),
        ])
    };
    let mut rank_vectors = Vec::new();
    for (rank, own) in periodic.ranks.iter().enumerate() {
        let name = rank_file_name(rank, ranks);
        let kinds =
            [(StateKind::ExpAvg, &own.slots[0]), (StateKind::ExpAvgSq, &own.slots[1]), (StateKind::Param, &own.params)];
        let mut tensors = Vec::new();
        for (kind, values) in kinds.into_iter().filter(|(kind, v)| *kind != StateKind::Param || !v.is_empty()) {
            if values.len() != total {
                return Err(bad(format!(
                    "rank {rank}'s {kind:?} has {} elements, the parameters {total}",
                    values.len()
                )));
            }
            let key = kind.key("flat");
            rank_vectors.push(FlatVector {
                rank,
                state: kind,
                pieces: vec![Piece { file: name.clone(), key: key.clone(), elements: 0..total }],
            });
            tensors.push(FileTensor { key, shape: vec![total], data: values });
        }
        let written = write_f32_file(&tmp.join(&name), &tensors, &metadata(format!("rank {rank} of {ranks}")), 1)?;
        files.push(FileEntry { name, shard: rank, stage: 0, bytes: written.bytes, checksum: written.checksum });
    }
    let mut outer_momentum = Vec::new();
    if !periodic.outer_momentum.is_empty() {
        if periodic.outer_momentum.len() != total {
            let n = periodic.outer_momentum.len();
            return Err(bad(format!("the outer momentum has {n} elements, the parameters {total}")));
        }
        for (index, range) in ranges.iter().enumerate() {
            let name = outer_file_name(index, ranges.len());
            let key = "outer_momentum".to_owned();
            let tensor = FileTensor {
                key: key.clone(),
                shape: vec![range.len()],
                data: &periodic.outer_momentum[range.clone()],
            };
            let what = format!("outer momentum {}..{}", range.start, range.end);
            let written = write_f32_file(&tmp.join(&name), &[tensor], &metadata(what), 1)?;
            outer_momentum.push(Piece { file: name.clone(), key, elements: range.clone() });
            files.push(FileEntry { name, shard: index, stage: 0, bytes: written.bytes, checksum: written.checksum });
        }
    }
    Ok(PeriodicEntry { ranks, rank_vectors, outer_momentum })
}

/// Step 3: renames the finished temporary directory into place. Returns the step directory and whether an
/// existing valid one was kept instead.
fn commit(tmp: &Path, root: &Path, step: u64) -> Result<(PathBuf, bool), CheckpointError> {
    let final_dir = root.join(step_dir_name(step));
    let mut aside = None;
    if final_dir.exists() {
        match read::verify(&final_dir) {
            Ok(_) => return Ok((final_dir, true)),
            Err(why) => {
                tracing::warn!(checkpoint = %final_dir.display(), "replacing a checkpoint that does not verify: {why}");
                let moved = root.join(private_name("torn", step));
                std::fs::rename(&final_dir, &moved).map_err(io(&final_dir, "move a torn checkpoint aside"))?;
                aside = Some(moved);
            }
        }
    }
    std::fs::rename(tmp, &final_dir).map_err(io(&final_dir, "rename into place"))?;
    sync_dir(root)?;
    if let Some(moved) = aside {
        let _ = std::fs::remove_dir_all(moved);
    }
    Ok((final_dir, false))
}

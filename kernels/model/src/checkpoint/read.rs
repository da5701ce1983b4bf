//! Reading checkpoints: verify, load the whole state, or load one target shard — of any layout into any
//! other (resharding happens here, at load time, from the manifest's piece list).
//!
//! Nothing is trusted before it verifies: the manifest must parse and describe a consistent state (the
//! pieces of every tensor tile it exactly, shapes match the config's model), and every file read must
//! match its recorded length and XXH3-64 checksum. A version-1 checkpoint is described in the same terms
//! (`v1`), so it loads through the same path.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

use super::manifest::{Manifest, Piece, StateKind, TensorEntry, FORMAT, FORMAT_VERSION, MANIFEST};
use super::shards::intersect;
use super::state::{PeriodicState, RankState, TensorSpec, TrainingState};
use super::tensor_file::{copy_f32, parse, read_verified};
use super::{io, v1, CheckpointError};

/// Reads and checks the manifest of checkpoint `dir` (version 1 is converted to the version-2 form).
pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    let json = std::fs::read(&path).map_err(io(&path, "read"))?;
    let bad = |message: String| CheckpointError::Manifest { path: dir.to_owned(), message };
    let value: serde_json::Value = serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))?;
    let format = value.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != FORMAT {
        return Err(bad(format!("format {format:?}, expected {FORMAT:?}")));
    }
    let version = value.get("version").and_then(serde_json::Value::as_u64).unwrap_or(0);
    let manifest = match version {
        1 => v1::upgrade(dir, value)?,
        2 | 3 => serde_json::from_value(value).map_err(|e| bad(e.to_string()))?,
        v if v > u64::from(FORMAT_VERSION) => {
            return Err(CheckpointError::TooNew { path: dir.to_owned(), version: v as u32 });
        }
        v => return Err(bad(format!("unknown version {v}"))),
    };
    check_consistent(dir, &manifest)?;
    Ok(manifest)
}

/// Verifies checkpoint `dir` completely (manifest and every file); returns its manifest.
pub fn verify(dir: &Path) -> Result<Manifest, CheckpointError> {
    let manifest = read_manifest(dir)?;
    for file in &manifest.files {
        read_verified(dir, &file.name, file.bytes, file.checksum)?;
    }
    Ok(manifest)
}

/// Loads the whole state saved in `dir`, whatever layout it was saved under.
pub fn load_state(dir: &Path) -> Result<TrainingState, CheckpointError> {
    let manifest = read_manifest(dir)?;
    if let Some(base) = &manifest.base {
        base.check(dir)?;
    }
    let tensors = param_specs(&manifest);
    let total = tensors.iter().map(TensorSpec::numel).sum();
    let values = assemble(dir, &manifest, 0..total)?;
    let periodic = load_periodic(dir, &manifest, total)?;
    Ok(TrainingState {
        config: manifest.config,
        step: manifest.step,
        optimizer_step: manifest.optimizer_step,
        sampler: manifest.sampler,
        tensors,
        values,
        loss_scale: manifest.loss_scale,
        periodic,
    })
}

/// The periodic part of checkpoint `dir`, whole (every rank's vectors and the outer momentum); None if
/// it has none.
fn load_periodic(dir: &Path, manifest: &Manifest, total: usize) -> Result<Option<PeriodicState>, CheckpointError> {
    let Some(entry) = &manifest.periodic else { return Ok(None) };
    let mut buffers = HashMap::new();
    let mut periodic = PeriodicState { ranks: vec![RankState::default(); entry.ranks], outer_momentum: Vec::new() };
    for vector in &entry.rank_vectors {
        let values = read_flat(dir, manifest, &vector.pieces, total, &mut buffers)?;
        let own = &mut periodic.ranks[vector.rank];
        match vector.state {
            StateKind::Param => own.params = values,
            StateKind::ExpAvg => own.slots[0] = values,
            StateKind::ExpAvgSq => own.slots[1] = values,
        }
    }
    if !entry.outer_momentum.is_empty() {
        periodic.outer_momentum = read_flat(dir, manifest, &entry.outer_momentum, total, &mut buffers)?;
    }
    Ok(Some(periodic))
}

/// A flat vector of `total` elements from its `pieces` (each file read and verified once, kept in
/// `buffers`).
fn read_flat(
    dir: &Path,
    manifest: &Manifest,
    pieces: &[Piece],
    total: usize,
    buffers: &mut HashMap<String, Vec<u8>>,
) -> Result<Vec<f32>, CheckpointError> {
    let mut out = vec![0f32; total];
    for piece in pieces {
        if !buffers.contains_key(&piece.file) {
            let file = manifest.files.iter().find(|f| f.name == piece.file).expect("checked consistent");
            buffers.insert(piece.file.clone(), read_verified(dir, &file.name, file.bytes, file.checksum)?);
        }
        let path = dir.join(&piece.file);
        let parsed = parse(&path, &buffers[&piece.file])?;
        copy_f32(&path, &parsed, &piece.key, 0..piece.elements.len(), &mut out[piece.elements.clone()])?;
    }
    Ok(out)
}

/// Shard `index` of `shards` of the state saved in `dir`: the range of the flat order it covers and the
/// three states' values there. Only the files that hold part of it are read (and verified).
pub fn load_shard(dir: &Path, shards: usize, index: usize) -> Result<(Range<usize>, [Vec<f32>; 3]), CheckpointError> {
    let manifest = read_manifest(dir)?;
    if let Some(base) = &manifest.base {
        base.check(dir)?;
    }
    let total = param_specs(&manifest).iter().map(TensorSpec::numel).sum();
    let range = super::shards::shard_range(total, shards, index);
    let values = assemble(dir, &manifest, range.clone())?;
    Ok((range, values))
}

/// The parameters' names and shapes, in canonical (flat) order.
fn param_specs(manifest: &Manifest) -> Vec<TensorSpec> {
    manifest
        .tensors
        .iter()
        .filter(|t| t.state == StateKind::Param)
        .map(|t| TensorSpec { name: t.param.clone(), shape: t.shape.clone() })
        .collect()
}

/// The values of flat range `target` of all three states, read from the files that hold them.
fn assemble(dir: &Path, manifest: &Manifest, target: Range<usize>) -> Result<[Vec<f32>; 3], CheckpointError> {
    let specs = param_specs(manifest);
    let mut offsets = HashMap::new();
    let mut at = 0;
    for spec in &specs {
        offsets.insert(spec.name.as_str(), at);
        at += spec.numel();
    }
    // Which pieces overlap the target, and so which files are needed.
    let mut wanted = Vec::new();
    for entry in &manifest.tensors {
        let base = offsets[entry.param.as_str()];
        for piece in &entry.pieces {
            let flat = base + piece.elements.start..base + piece.elements.end;
            let overlap = intersect(&flat, &target);
            if !overlap.is_empty() {
                wanted.push((entry.state, piece, overlap.start - base..overlap.end - base, overlap));
            }
        }
    }
    let mut buffers = HashMap::new();
    for (_, piece, _, _) in &wanted {
        if !buffers.contains_key(piece.file.as_str()) {
            let file = manifest.files.iter().find(|f| f.name == piece.file).expect("checked consistent");
            buffers.insert(piece.file.as_str(), read_verified(dir, &file.name, file.bytes, file.checksum)?);
        }
    }
    let mut parsed = HashMap::new();
    for (name, buffer) in &buffers {
        parsed.insert(*name, parse(&dir.join(name), buffer)?);
    }
    let mut values = [0, 1, 2].map(|_| vec![0f32; target.len()]);
    for (state, piece, elements, overlap) in wanted {
        let in_file = elements.start - piece.elements.start..elements.end - piece.elements.start;
        let out = &mut values[state.index()][overlap.start - target.start..overlap.end - target.start];
        copy_f32(&dir.join(&piece.file), &parsed[piece.file.as_str()], &piece.key, in_file, out)?;
    }
    Ok(values)
}

/// The manifest describes one consistent state: each parameter once per state kind, in the same order
/// with the same shapes; every tensor's pieces tile it exactly and name listed files; the shapes are the
/// config's model's.
fn check_consistent(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    let bad = |message: String| CheckpointError::Manifest { path: dir.to_owned(), message };
    let by_kind = |kind: StateKind| manifest.tensors.iter().filter(move |t| t.state == kind);
    let params: Vec<&TensorEntry> = by_kind(StateKind::Param).collect();
    for kind in [StateKind::ExpAvg, StateKind::ExpAvgSq] {
        let others: Vec<&TensorEntry> = by_kind(kind).collect();
        let same = others.len() == params.len()
            && others.iter().zip(&params).all(|(o, p)| o.param == p.param && o.shape == p.shape);
        if !same {
            return Err(bad(format!("the {kind:?} tensors do not match the parameters one to one")));
        }
    }
    let model = crate::model::param_specs(&manifest.config.model);
    let matches_model = model.len() == params.len()
        && model
            .iter()
            .zip(&params)
            .all(|(m, p)| m.name == p.param && m.shape.iter().map(|&d| d as usize).eq(p.shape.iter().copied()));
    if !matches_model {
        return Err(bad("the tensors are not those of the model in the manifest's config".into()));
    }
    if let Some(f) = manifest.files.iter().find(|f| Path::new(&f.name).file_name() != Some(f.name.as_ref())) {
        return Err(bad(format!("file name {:?} is not a plain file name", f.name)));
    }
    if let Some(periodic) = &manifest.periodic {
        check_periodic(manifest, periodic, model.iter().map(|m| m.numel()).sum()).map_err(bad)?;
    }
    for entry in &manifest.tensors {
        if entry.dtype != "F32" {
            return Err(bad(format!(
                "{} {:?}: dtype {} (this build reads F32)",
                entry.param, entry.state, entry.dtype
            )));
        }
        let mut pieces: Vec<&Range<usize>> = entry.pieces.iter().map(|p| &p.elements).collect();
        pieces.sort_by_key(|r| r.start);
        let mut next = 0;
        for r in pieces {
            if r.start != next || r.end < r.start {
                return Err(bad(format!("the pieces of {} {:?} do not tile it", entry.param, entry.state)));
            }
            next = r.end;
        }
        if next != entry.numel() {
            return Err(bad(format!(
                "the pieces of {} {:?} cover {next} of {} elements",
                entry.param,
                entry.state,
                entry.numel()
            )));
        }
        if let Some(p) = entry.pieces.iter().find(|p| !manifest.files.iter().any(|f| f.name == p.file)) {
            return Err(bad(format!("{} names file {}, which is not listed", entry.param, p.file)));
        }
    }
    Ok(())
}

/// The periodic part describes every saved rank's two optimizer slots (and its parameters for all ranks
/// or none), each vector and the outer momentum tiling the `total` elements of the flat order from
/// listed files; only version 3 has one.
fn check_periodic(manifest: &Manifest, periodic: &super::manifest::PeriodicEntry, total: usize) -> Result<(), String> {
    if manifest.version < 3 {
        return Err(format!("version {} with a periodic part (version 3 has it)", manifest.version));
    }
    if periodic.ranks == 0 {
        return Err("a periodic part of 0 ranks".into());
    }
    let tiles = |what: &str, pieces: &[Piece]| -> Result<(), String> {
        let mut ranges: Vec<&Range<usize>> = pieces.iter().map(|p| &p.elements).collect();
        ranges.sort_by_key(|r| r.start);
        let mut next = 0;
        for r in ranges {
            if r.start != next || r.end < r.start {
                return Err(format!("the pieces of {what} do not tile the parameters' {total} elements"));
            }
            next = r.end;
        }
        if next != total {
            return Err(format!("the pieces of {what} cover {next} of the parameters' {total} elements"));
        }
        match pieces.iter().find(|p| !manifest.files.iter().any(|f| f.name == p.file)) {
            Some(p) => Err(format!("{what} names file {}, which is not listed", p.file)),
            None => Ok(()),
        }
    };
    let mut seen = std::collections::HashSet::new();
    for vector in &periodic.rank_vectors {
        let what = format!("rank {}'s {:?}", vector.rank, vector.state);
        if vector.rank >= periodic.ranks || !seen.insert((vector.rank, vector.state)) {
            return Err(format!("{what}: not one of {} ranks, or listed twice", periodic.ranks));
        }
        tiles(&what, &vector.pieces)?;
    }
    let count = |kind: StateKind| seen.iter().filter(|(_, k)| *k == kind).count();
    let params = count(StateKind::Param);
    if count(StateKind::ExpAvg) != periodic.ranks || count(StateKind::ExpAvgSq) != periodic.ranks {
        return Err(format!("the periodic part lacks optimizer slots of some of its {} ranks", periodic.ranks));
    }
    if params != 0 && params != periodic.ranks {
        return Err(format!("parameters of {params} of the periodic part's {} ranks (all or none)", periodic.ranks));
    }
    if !periodic.outer_momentum.is_empty() {
        tiles("the outer momentum", &periodic.outer_momentum)?;
    }
    Ok(())
}

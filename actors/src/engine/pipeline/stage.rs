//! One pipeline device's share of training: the parameters of its chunks (one per virtual stage), their
//! optimizer state (AdamW's or Adafactor's), and the execution of its ops of a [`Plan`] over a
//! [`Transport`] — activations out to the next chunk's device, gradients back to the previous one —
//! followed by the synchronous flush: the
//! gradient norm and the loss summed across devices, clipping and the optimizer on the local parameters.
//!
//! Gradients accumulate over the step's micro-batches, each micro-batch's loss weighted by its share of
//! the global batch, exactly as the reference trainer does, so the pipeline computes the reference's
//! update (within summation order). A backward with a gradient from the next chunk is the backward of the
//! scalar Σ(output · gradient), whose derivative is that gradient. B and W of zero-bubble schedules split
//! one backward: B asks autograd for the gradients of the input and of every parameter operation's
//! output over the retained graph, W turns each operation's output gradient into its weight gradients.
//!
//! A tied head runs on the device of the last chunk with that device's copy of the token-embedding
//! matrix, whose gradient it sums with the first chunk's device before the reductions (see [`tied`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tch::{Kind, Tensor};
use troupe_cluster::collective::{chunk_range, CallTally, Collective, Communicator, ReduceOp};
use troupe_cluster::transport::{LossScope, Transport};
use troupe_cluster::wire::Tag;
use troupe_cluster::ClusterError;
use troupe_model::config::JobConfig;
use troupe_model::data::{load_corpus, rank_slice, GlobalSampler};
use troupe_model::init::initial_values;
use troupe_model::model::{
    block_recorded, cross_entropy, embed_recorded, head_recorded, param_specs, ParamOp, ParamSpec, Samples,
};
use troupe_model::optim::adafactor_shard::{Prepared, ShardLayout, ShardSlots};
use troupe_model::optim::{learning_rate, scale_grads, Optimizer};
use troupe_model::precision::{backward_weight, LossScale, Precision, Update};
use troupe_model::TrainError;

use super::super::committed::ShardPiece;
use super::super::flat::{append_flat, copy_from_flat, materialise_grads};
use super::super::memory::{group_sent, tensor_and_grad_bytes};
use super::super::segments::{adamw_on_segments, plan_segments, ShardSegment};
use super::super::shard_plan::{buddies, shadow_holders, ShardMode, HOLDING_RANGES_MAX, REPLICAS_MAX};
use super::super::zero3::unit_tensors;
use super::error::PipelineError;
use super::{ChunkLayout, Op, OpKind, Plan, PlanShape};
use crate::protocol::{GroupKind, RankUsage};

mod eval;
mod tied;

pub use tied::tied_copy_range;
use tied::Tied;

/// The transport tag group of activations and gradients (collectives of the flush use their own).
pub const PIPELINE_TAG_GROUP: u32 = 0x5049_5045;

/// One executed op: what, and when relative to the run's origin (seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OpSpan {
    pub op: Op,
    pub start_s: f64,
    pub end_s: f64,
}

/// What a device reports after a step.
#[derive(Clone, Debug, PartialEq)]
pub struct StageStep {
    pub step: u64,
    /// The global batch's mean loss (the same on every device after the flush).
    pub loss: f64,
    /// Global gradient norm before clipping (not finite when the step overflowed).
    pub grad_norm: f64,
    pub lr: f64,
    /// fp16: the gradients overflowed and no update was applied.
    pub skipped: bool,
    /// The loss scale the step's backward ran at (1 unless fp16).
    pub loss_scale: f64,
    /// Every op this device ran, in order.
    pub spans: Vec<OpSpan>,
    /// Parameter elements the device holds after the step (with ZeRO-3 inside the stage's group, none of
    /// its chunks': dropped until the next step gathers them; a tied head's copy of the embedding matrix
    /// is kept whole).
    pub param_elements: usize,
}

/// A step whose reductions are done on this device, ready to commit.
#[derive(Clone, Debug, PartialEq)]
pub struct ReducedStage {
    pub loss: f64,
    pub grad_norm: f64,
    pub spans: Vec<OpSpan>,
    /// What the device held and sent in the step (None where it is not asked: an update's input).
    pub usage: Option<RankUsage>,
}

/// A chunk held by this device.
struct LocalChunk {
    chunk: usize,
    layout: ChunkLayout,
    /// Its parameters' positions in the device's parameter list.
    local: Range<usize>,
}

/// What the forward of (chunk, micro-batch) leaves for its backward.
struct Saved {
    /// The input as a leaf requiring grad (none for the first chunk, whose input is token ids).
    input: Option<Tensor>,
    /// The chunk's output: an activation, or for the last chunk the weighted loss.
    output: Tensor,
    /// The outputs of its parameter operations (parameter positions local to the chunk), for B/W.
    ops: Vec<ParamOp>,
    /// `parallel.recompute`: the forward ran without a graph (`output` is only a value, `ops` empty;
    /// `input` is the received activation as it came); the backward runs it again first.
    recompute: bool,
}

/// One device of a pipeline.
pub struct PipelineStage<T: Transport> {
    config: JobConfig,
    plan: Arc<Plan>,
    device: usize,
    transport: Arc<T>,
    comm: Communicator<T>,
    data_parallel: Option<DataParallelGroup<T>>,
    recv_timeout_ms: u64,
    chunks: Vec<LocalChunk>,
    /// Per chunk: its flat element range in the canonical parameter order ([`chunk_ranges`]).
    ranges: Vec<Range<usize>>,
    params: Vec<Tensor>,
    /// `train.optimizer` on the device's parameters (AdamW only with ZeRO inside the stage's group,
    /// where the moments live in the shard and this one keeps only the step counter).
    optimizer: Optimizer,
    /// A tied model's embedding matrix where this device holds the first or the last chunk.
    tied: Option<Tied>,
    /// ZeRO-1/2/3 within the stage's group; None: every replica holds the whole state of its chunks.
    shard: Option<StageShard>,
    /// Scratch: the device's flat gradients (or parameters).
    flat: Vec<f32>,
    precision: Precision,
    /// fp16's loss scaler; every device holds the same (each sees the same global norm).
    loss_scale: LossScale,
    sampler: Option<GlobalSampler>,
    microbatches: Vec<Range<usize>>,
    /// Committed steps; the next step to run.
    pub step: u64,
    origin: Instant,
    /// Activations and gradients sent to the pipeline's neighbours since the last usage report.
    neighbours_sent: CallTally,
}

/// The `microbatches` balanced contiguous micro-batches of `slice` (a data-parallel rank's share of the
/// global batch, or all of it), as sample ranges of the global batch.
pub fn microbatch_ranges(slice: Range<usize>, microbatches: usize) -> Vec<Range<usize>> {
    (0..microbatches)
        .map(|i| {
            let r = troupe_kernels::balanced_range(slice.len(), microbatches, i);
            slice.start + r.start..slice.start + r.end
        })
        .collect()
}

/// The flat element ranges (in the model's canonical parameter order) of `device`'s chunks, in
/// virtual-stage order: chunks are contiguous in that order, chunk `c` after chunks `0..c`.
pub fn chunk_ranges(shape: PlanShape, layouts: &[ChunkLayout], device: usize) -> Vec<Range<usize>> {
    let starts: Vec<usize> = layouts
        .iter()
        .scan(0, |offset, layout| {
            let start = *offset;
            *offset += layout.numel;
            Some(start)
        })
        .collect();
    (0..shape.virtual_stages)
        .map(|v| {
            let chunk = shape.chunk_at(device, v);
            starts[chunk]..starts[chunk] + layouts[chunk].numel
        })
        .collect()
}

/// `own` (a range of a device's flat order: its chunks, flat-order `ranges`, one after the other) as
/// (range within `own`, range of the model's flat order) pieces, one per chunk it touches.
fn owned_pieces(ranges: &[Range<usize>], own: &Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
    let mut pieces = Vec::new();
    let mut at = 0;
    for range in ranges {
        let span = at..at + range.len();
        let (start, end) = (own.start.max(span.start), own.end.min(span.end));
        if start < end {
            let global = range.start + (start - span.start)..range.start + (end - span.start);
            pieces.push((start - own.start..end - own.start, global));
        }
        at = span.end;
    }
    pieces
}

/// The flat-order ranges device `device` keeps between steps (what [`PipelineStage::export_state`]
/// gives and [`PipelineStage::load_state`] takes): its chunks' ranges, or with ZeRO inside the stage's
/// group (`sharded_among` = (replica, replicas)) the replica's owned part of them, then its copies of
/// its `copies` buddies' parts ([`buddies`] within the group) — each part cut at chunk boundaries.
pub fn held_ranges(
    shape: PlanShape,
    layouts: &[ChunkLayout],
    device: usize,
    sharded_among: Option<(usize, usize)>,
    copies: usize,
) -> Vec<Range<usize>> {
    let ranges = chunk_ranges(shape, layouts, device);
    match sharded_among {
        Some((replica, replicas)) if replicas > 1 => {
            let total = ranges.iter().map(Range::len).sum();
            std::iter::once(replica)
                .chain(buddies(replica, replicas, copies_kept(copies, shape.virtual_stages)))
                .flat_map(|r| owned_pieces(&ranges, &chunk_range(total, replicas, r)))
                .map(|(_, range)| range)
                .collect()
        }
        _ => ranges,
    }
}

/// The buddy copies a sharded stage replica keeps for `checkpoint.replicas = configured`: at most
/// [`REPLICAS_MAX`], and few enough that its owned part and the copies, each cut into up to
/// `virtual_stages` chunk pieces, fit one holding of the reshard ([`HOLDING_RANGES_MAX`] ranges) beside
/// a tied head's copy of the embedding matrix.
pub fn copies_kept(configured: usize, virtual_stages: usize) -> usize {
    let pieces_max = HOLDING_RANGES_MAX - 1;
    configured.min(REPLICAS_MAX).min((pieces_max / virtual_stages.max(1)).saturating_sub(1))
}

/// A device's data-parallel group: the devices that hold the same chunks for other slices of the batch.
/// Their gradients are summed before the norm, so each replica applies the whole batch's update.
pub struct DataParallelGroup<T: Transport> {
    pub comm: Communicator<T>,
}

/// ZeRO inside a stage's data-parallel group (`parallel.shard`, with `dp` > 1): replica `d` of `D` owns
/// `chunk_range(n, D, d)` of the device's flat parameters (its chunks in virtual-stage order, `n`
/// elements) — the fp32 masters and both AdamW moments of that range — and its parameters are only a
/// cache of the group's masters, refreshed by an all-gather in the group before the step after an update.
/// ZeRO-1 all-reduces the gradients, ZeRO-2 reduce-scatters them; ZeRO-3 also drops the parameters after
/// each step's flush (the device's chunks are its one unit: gathered for the step's ops, none between).
/// With `checkpoint.replicas = k` it also keeps a copy of the owned ranges of its `k` buddies in the group
/// (replicas `d + 1 … d + k` mod `D`), updated with the same gradient bits as the owner's, so a lost
/// replica's part is restored from memory. With Adafactor the parts keep its first moment and the
/// vectors' second moment, and every replica the device's factored statistics ([`StageAdafactor`]).
struct StageShard {
    mode: ShardMode,
    /// The owned part first, then the copies of the buddies' parts, nearest buddy first.
    parts: Vec<HeldPart>,
    /// `train.optimizer = "adafactor"`: what its update needs beyond the parts.
    adafactor: Option<StageAdafactor>,
    /// The parameters lag the masters (an update was applied, or a state loaded, since the last gather).
    params_stale: bool,
    /// ZeRO-3: the specs of the device's parameters, which are empty tensors between steps (dropped
    /// after the flush, rebuilt by the next gather).
    released_specs: Option<Vec<ParamSpec>>,
}

/// Adafactor on a sharded stage, as ZeRO's owners run it ([`troupe_model::optim::adafactor_shard`]) over
/// the device's flat order: the parts keep the first moment (`exp_avg`, zeros without `beta1`) and the
/// vectors' elementwise second moment (`exp_avg_sq` in its compact form); every replica of the group keeps
/// the device's matrices' row and column statistics whole. The flush all-reduces the owners' terms of the
/// per-matrix sums beside the loss and norm, then — once the global norm fixes the clipping factor — of
/// each parameter's Σ update², so the update after the commit is local to each replica, as AdamW's is.
struct StageAdafactor {
    layout: ShardLayout,
    /// The device's factored statistics (replicated in the group).
    stats: Vec<f32>,
    /// A state was loaded: `stats` holds only the owned part's statistics, completed by an all-reduce
    /// in the group (each statistic lies in exactly one owner's range) before the next step.
    stats_partial: bool,
    /// The flush's preparation of the step's update, with the group's Σ update² per parameter; None when
    /// the step will be skipped (fp16 overflow).
    prepared: Option<(Prepared, Vec<f32>)>,
}

/// A step's Adafactor update as the flush readied it: the coefficients and the group's reduced sums.
pub(super) struct Readied {
    sums: Vec<f32>,
    grad_factor: f32,
    lr: f64,
    t: u64,
}

impl StageShard {
    /// Replica `replica` of `replicas`' shard of the device's `params` (in flat order, described by
    /// `specs`): its owned part, then its copies of `kept` buddies' parts, each with the parameters'
    /// values as masters and zero optimizer state and gradient; `adafactor` for `train.optimizer =
    /// "adafactor"`.
    fn new(
        mode: ShardMode,
        (replica, replicas): (usize, usize),
        kept: usize,
        (params, specs): (&[Tensor], &[ParamSpec]),
        adafactor: bool,
    ) -> Self {
        let (numels, decays): (Vec<usize>, Vec<bool>) = specs.iter().map(|s| (s.numel(), s.decays())).unzip();
        let adafactor = adafactor.then(|| {
            let shapes: Vec<Vec<i64>> = specs.iter().map(|s| s.shape.clone()).collect();
            let layout = ShardLayout::new(&shapes, &decays);
            let stats = vec![0.0; layout.stats_len()];
            StageAdafactor { layout, stats, stats_partial: false, prepared: None }
        });
        let total = numels.iter().sum();
        let mut all = Vec::with_capacity(total);
        append_flat(params, &mut all);
        let parts = std::iter::once(replica)
            .chain(buddies(replica, replicas, kept))
            .map(|owner| {
                let range = chunk_range(total, replicas, owner);
                let n = range.len();
                let second = adafactor.as_ref().map_or(n, |a| a.layout.vector_elements(&range));
                HeldPart {
                    owner,
                    segments: plan_segments(&numels, &decays, &range),
                    master: all[range.clone()].to_vec(),
                    exp_avg: vec![0.0; n],
                    exp_avg_sq: vec![0.0; second],
                    grad: vec![0.0; n],
                    range,
                }
            })
            .collect();
        StageShard {
            mode,
            parts,
            adafactor,
            params_stale: false,
            released_specs: (mode == ShardMode::Zero3).then(|| specs.to_vec()),
        }
    }

    /// The part this replica owns.
    fn own(&self) -> &HeldPart {
        &self.parts[0]
    }

    /// `part`'s second slot as checkpoints pack it: AdamW's `exp_avg_sq`, or Adafactor's expanded from
    /// the compact form and the statistics.
    fn second_slot<'a>(&self, part: &'a HeldPart) -> std::borrow::Cow<'a, [f32]> {
        match &self.adafactor {
            Some(a) => std::borrow::Cow::Owned(a.layout.expand(&part.range, &part.exp_avg_sq, &a.stats)),
            None => std::borrow::Cow::Borrowed(&part.exp_avg_sq),
        }
    }
}

/// An owned range of the device's flat order held by a replica — its own, or its copy of a buddy's: the
/// masters, the optimizer's state (AdamW's moments; Adafactor's first moment and compact second moment,
/// [`StageAdafactor`]) and the step's reduced gradient.
struct HeldPart {
    /// The replica of the group that owns the range.
    owner: usize,
    range: Range<usize>,
    /// The parameter pieces it covers (decay or not).
    segments: Vec<ShardSegment>,
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grad: Vec<f32>,
}

/// A device's chunks, its parameters (in its chunks' order) and their specs.
type DeviceParams = (Vec<LocalChunk>, Vec<ParamSpec>, Vec<Tensor>);

/// The chunks `device` holds, in virtual-stage order, with their parameters (initialised from
/// `train.seed`, requiring grad) and those parameters' specs.
fn init_chunks(
    config: &JobConfig,
    shape: PlanShape,
    layouts: &[ChunkLayout],
    device: usize,
) -> Result<DeviceParams, PipelineError> {
    let all_specs = param_specs(&config.model);
    let (mut chunks, mut specs, mut params) = (Vec::new(), Vec::new(), Vec::new());
    for v in 0..shape.virtual_stages {
        let chunk = shape.chunk_at(device, v);
        let layout = layouts[chunk].clone();
        let start = params.len();
        let initial = initial_values(&config.model, config.train.seed, layout.params.clone())
            .map_err(|e| PipelineError::Train(e.into()))?;
        for (index, values) in layout.params.clone().zip(initial) {
            let spec = &all_specs[index];
            params.push(Tensor::from_slice(&values).view(spec.shape.as_slice()).set_requires_grad(true));
            specs.push(spec.clone());
        }
        chunks.push(LocalChunk { chunk, layout, local: start..params.len() });
    }
    Ok((chunks, specs, params))
}

/// The corpus's sampler when the device holds the first or the last chunk (which read tokens or
/// targets), else None.
fn load_sampler(config: &JobConfig, chunks: &[LocalChunk]) -> Result<Option<GlobalSampler>, PipelineError> {
    let ends = chunks.iter().any(|c| c.layout.embed || c.layout.head);
    if !ends {
        return Ok(None);
    }
    let corpus = load_corpus(&config.data, &config.model).map_err(TrainError::from)?;
    Ok(Some(GlobalSampler::new(config.train.seed, corpus, config.model.context)))
}

impl<T: Transport> PipelineStage<T> {
    /// Device `device` of `plan`: initialises the parameters of its chunks from `train.seed` (the same
    /// values the reference initialises them to) and loads the corpus if it holds the first or last chunk.
    /// `comm` spans the pipeline's devices (its collectives carry the flush).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        config: JobConfig,
        plan: Arc<Plan>,
        layouts: &[ChunkLayout],
        device: usize,
        transport: Arc<T>,
        comm: Communicator<T>,
        data_parallel: Option<DataParallelGroup<T>>,
        recv_timeout_ms: u64,
        origin: Instant,
    ) -> Result<Self, PipelineError> {
        let shape = plan.shape;
        let global_batch = config.train.global_batch;
        let slice = match &data_parallel {
            Some(group) => rank_slice(global_batch, group.comm.transport().rank(), group.comm.transport().world()),
            None => 0..global_batch,
        };
        if shape.microbatches > slice.len() {
            return Err(PipelineError::TooManyMicrobatches { microbatches: shape.microbatches, samples: slice.len() });
        }
        let (chunks, specs, params) = init_chunks(&config, shape, layouts, device)?;
        let decays = specs.iter().map(ParamSpec::decays).collect();
        let mut optimizer = Optimizer::new(&config.train, &params, decays);
        let shard = match (ShardMode::of_config(&config.parallel.shard), &data_parallel) {
            (Some(mode), Some(group)) if group.comm.world() > 1 => {
                let (replica, replicas) = (group.comm.rank(), group.comm.world());
                let kept = copies_kept(config.checkpoint.replicas, shape.virtual_stages).min(replicas - 1);
                let adafactor = config.train.optimizer == "adafactor";
                let shard = StageShard::new(mode, (replica, replicas), kept, (&params, &specs), adafactor);
                // The moments live in the shard: the optimizer's per-parameter ones are dropped.
                optimizer.clear_state();
                Some(shard)
            }
            _ => None,
        };
        let sampler = load_sampler(&config, &chunks)?;
        // Every parameter gets a gradient tensor, accumulated into in place.
        materialise_grads(&params);
        let sharded_adafactor = shard.as_ref().is_some_and(|s| s.adafactor.is_some());
        let tied = Tied::of(&config, shape, device, sharded_adafactor)?;
        let microbatches = microbatch_ranges(slice, shape.microbatches);
        let (precision, loss_scale) = (Precision::of_config(&config.parallel), LossScale::initial(&config.parallel));
        Ok(Self {
            config,
            plan,
            device,
            transport,
            comm,
            data_parallel,
            recv_timeout_ms,
            chunks,
            ranges: chunk_ranges(shape, layouts, device),
            params,
            optimizer,
            tied,
            shard,
            flat: Vec::new(),
            precision,
            loss_scale,
            sampler,
            microbatches,
            step: 0,
            origin,
            neighbours_sent: CallTally { op: "send", calls: 0, bytes: 0, seconds: 0.0 },
        })
    }

    pub fn device(&self) -> usize {
        self.device
    }

    /// The chunks this device holds, in virtual-stage order, with their parameter ranges in the model's
    /// canonical order.
    pub fn layouts(&self) -> impl Iterator<Item = &ChunkLayout> {
        self.chunks.iter().map(|c| &c.layout)
    }

    /// Detached copies of the local parameters by chunk: (chunk index, its parameters in canonical order).
    pub fn chunk_param_values(&self) -> Vec<(usize, Vec<Tensor>)> {
        self.chunks
            .iter()
            .map(|c| (c.chunk, self.params[c.local.clone()].iter().map(|p| p.detach().copy()).collect()))
            .collect()
    }

    /// This device's state as pieces of the flat parameter order, one per chunk (in virtual-stage order),
    /// then a tied head's copy of the embedding matrix ([`tied_copy_range`]): what a rank keeps between
    /// attempts of a cluster job.
    pub fn export_state(&self) -> Vec<ShardPiece> {
        if let Some(shard) = &self.shard {
            // The owned range of the device's flat order, then each buddy copy, cut at chunk boundaries
            // into flat-order ranges (the order of `held_ranges`).
            let mut pieces = Vec::new();
            for part in &shard.parts {
                let second = shard.second_slot(part);
                for (local, range) in self.owned_pieces(&part.range) {
                    pieces.push(ShardPiece {
                        range,
                        master: part.master[local.clone()].to_vec(),
                        exp_avg: part.exp_avg[local.clone()].to_vec(),
                        exp_avg_sq: second[local].to_vec(),
                    });
                }
            }
            pieces.extend(self.tied_copy_piece());
            return pieces;
        }
        let chunks = self.chunks.iter().zip(self.ranges.iter().cloned()).map(|(chunk, range)| {
            let mut piece = ShardPiece::zeros(0..0);
            let local = chunk.local.clone();
            let params: Vec<Tensor> = self.params[local.clone()].iter().map(Tensor::detach).collect();
            append_flat(&params, &mut piece.master);
            // Each parameter's two state slots as a checkpoint packs them (AdamW: its moments).
            for (i, param) in local.zip(&params) {
                let [first, second] = self.optimizer.packed(i, param);
                append_flat(&[first], &mut piece.exp_avg);
                append_flat(&[second], &mut piece.exp_avg_sq);
            }
            debug_assert_eq!(piece.master.len(), range.len());
            piece.range = range;
            piece
        });
        chunks.chain(self.tied_copy_piece()).collect()
    }

    /// Takes a committed state: the masters and moments of this device's chunks from `pieces` (each chunk's
    /// range inside one piece; and a tied head's copy, [`tied_copy_range`]), the step counters and the
    /// loss scaler.
    pub fn load_state(&mut self, pieces: &[ShardPiece], step: u64, optimizer_step: u64, loss_scale: LossScale) {
        self.step = step;
        self.optimizer.set_step(optimizer_step);
        self.loss_scale = loss_scale;
        self.load_tied_copy(pieces);
        let containing = |range: &Range<usize>| {
            pieces
                .iter()
                .find(|p| p.range.start <= range.start && range.end <= p.range.end)
                .expect("load_state: a piece holds each range this device needs")
        };
        if let Some(shard) = self.shard.as_mut() {
            if let Some(a) = shard.adafactor.as_mut() {
                a.stats.iter_mut().for_each(|v| *v = 0.0);
                a.stats_partial = true; // completed in the group at the next step
                a.prepared = None;
            }
            for (index, part) in shard.parts.iter_mut().enumerate() {
                let mut second = vec![0f32; part.range.len()];
                for (local, range) in owned_pieces(&self.ranges, &part.range) {
                    let out = [&mut part.master[local.clone()], &mut part.exp_avg[local.clone()], &mut second[local]];
                    containing(&range).read(&range, out);
                }
                match shard.adafactor.as_mut() {
                    Some(a) => {
                        part.exp_avg_sq = a.layout.compact(&part.range, &second);
                        if index == 0 {
                            a.layout.import_stats(&part.range, &second, &mut a.stats);
                        }
                    }
                    None => part.exp_avg_sq = second,
                }
            }
            shard.params_stale = true; // the group's masters, at the next step
            return;
        }
        for (chunk, range) in self.chunks.iter().zip(self.ranges.iter().cloned()) {
            let piece = containing(&range);
            let n = range.len();
            let (mut master, mut exp_avg, mut exp_avg_sq) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            piece.read(&range, [&mut master, &mut exp_avg, &mut exp_avg_sq]);
            let local = chunk.local.clone();
            copy_from_flat(&self.params[local.clone()], &master);
            let mut at = 0;
            for i in local {
                let param = &self.params[i];
                let slot = |flat: &[f32]| Tensor::from_slice(&flat[at..at + param.numel()]).view_as(param);
                self.optimizer.unpack(i, [slot(&exp_avg), slot(&exp_avg_sq)]);
                at += param.numel();
            }
        }
    }

    fn owned_pieces(&self, own: &Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
        owned_pieces(&self.ranges, own)
    }

    /// With ZeRO inside the stage's group, after an update or a loaded state: the group's owned masters
    /// all-gathered into the parameters. A collective of the stage's group.
    async fn refresh_params(&mut self, step: u64) -> Result<(), PipelineError> {
        let (Some(group), Some(shard)) = (&mut self.data_parallel, &mut self.shard) else { return Ok(()) };
        if !shard.params_stale {
            return Ok(());
        }
        let device = self.device;
        let flush = |source| PipelineError::Flush { device, step, source };
        // A loaded state's statistics: each replica has its owned part's, the sum is the device's. Every
        // replica of the group loads the state of an attempt, so every one takes part.
        if let Some(a) = shard.adafactor.as_mut().filter(|a| a.stats_partial) {
            group.comm.all_reduce(&mut a.stats[..], ReduceOp::Sum).await.map_err(flush)?;
            a.stats_partial = false;
        }
        let total: usize = self.ranges.iter().map(Range::len).sum();
        self.flat.clear();
        self.flat.resize(total, 0.0);
        group.comm.all_gather(&shard.own().master, &mut self.flat).await.map_err(flush)?;
        match &shard.released_specs {
            // ZeRO-3: fresh leaves of the right shapes (the released ones are empty), with gradients.
            Some(specs) => {
                self.params = unit_tensors(specs, &self.flat);
                materialise_grads(&self.params);
            }
            None => copy_from_flat(&self.params, &self.flat),
        }
        shard.params_stale = false;
        Ok(())
    }

    /// ZeRO-3, after the flush: the parameters (and their gradients) dropped until the next gather.
    fn release_params(&mut self) {
        let Some(shard) = self.shard.as_mut().filter(|s| s.released_specs.is_some()) else { return };
        for param in &mut self.params {
            *param = Tensor::zeros([0], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        }
        shard.params_stale = true;
    }

    /// Optimizer updates applied so far.
    pub fn optimizer_step(&self) -> u64 {
        self.optimizer.step()
    }

    /// fp16's loss scaler (every device holds the same).
    pub fn loss_scale(&self) -> LossScale {
        self.loss_scale
    }

    /// Runs one step: this device's ops, then the flush (norm and loss across devices, clip, AdamW).
    pub async fn train_step(&mut self) -> Result<StageStep, PipelineError> {
        let reduced = self.reduce_gradients().await?;
        Ok(self.apply_update(reduced))
    }

    /// Detached copies of the current parameters by chunk, as [`Self::chunk_param_values`] — after
    /// gathering them when ZeRO inside the stage's group left them behind the masters (a collective of
    /// the group: every replica of the stage calls it).
    pub async fn current_param_values(&mut self) -> Result<Vec<(usize, Vec<Tensor>)>, PipelineError> {
        self.refresh_params(self.step).await?;
        Ok(self.chunk_param_values())
    }

    /// The first half of a step: this device's ops and the reductions (gradients among the stage's
    /// replicas, norm and loss across devices). Nothing is applied: dropping the gradients now abandons
    /// the step cleanly — what a commit vote needs, as with `DataParallelReplica::reduce_gradients`.
    pub async fn reduce_gradients(&mut self) -> Result<ReducedStage, PipelineError> {
        let step = self.step;
        self.refresh_params(step).await?;
        for p in &mut self.params {
            p.zero_grad();
        }
        self.zero_tied_grad();
        let mut run = StepRun::default();
        let plan = self.plan.clone();
        for &op in &plan.devices[self.device] {
            let start_s = self.origin.elapsed().as_secs_f64();
            self.run_op(op, step, &mut run).await?;
            run.spans.push(OpSpan { op, start_s, end_s: self.origin.elapsed().as_secs_f64() });
        }
        debug_assert!(run.saved.is_empty() && run.pending_weights.is_empty(), "plan left work undone");
        self.sum_tied_gradients(step).await?;

        let mut loss = run.loss;
        let device = self.device;
        let flush = |source| PipelineError::Flush { device, step, source };
        let grads: Vec<Tensor> = self.params.iter().map(Tensor::grad).collect();
        let mut adafactor_sums = None;
        let sum_sq = match (&mut self.data_parallel, &mut self.shard) {
            (Some(group), Some(shard)) => {
                // ZeRO-1: all-reduce, keep the owned range; ZeRO-2: reduce-scatter, only the owned range
                // arrives. The stage's squared norm and loss are summed over the owners.
                self.flat.clear();
                append_flat(&grads, &mut self.flat);
                if shard.mode != ShardMode::Zero1 {
                    let (own, copies) = shard.parts.split_first_mut().expect("the owned part");
                    group.comm.reduce_scatter(&self.flat, &mut own.grad, ReduceOp::Sum).await.map_err(flush)?;
                    // The owned gradient to the replicas that keep a copy; the buddies' from them.
                    let (replica, replicas) = (group.comm.rank(), group.comm.world());
                    for holder in shadow_holders(replica, replicas, copies.len()) {
                        group.comm.send(holder, &own.grad).await.map_err(flush)?;
                    }
                    for copy in copies {
                        group.comm.recv(copy.owner, &mut copy.grad).await.map_err(flush)?;
                    }
                } else {
                    group.comm.all_reduce(&mut self.flat[..], ReduceOp::Sum).await.map_err(flush)?;
                    for part in &mut shard.parts {
                        part.grad.copy_from_slice(&self.flat[part.range.clone()]);
                    }
                }
                let own = shard.own();
                let own_sq: f64 = own.grad.iter().map(|&g| f64::from(g) * f64::from(g)).sum();
                let mut totals = vec![own_sq as f32, loss as f32];
                if let Some(a) = &shard.adafactor {
                    totals.extend(a.layout.partial_sums(&own.range, &own.master, &own.grad));
                }
                group.comm.all_reduce(&mut totals[..], ReduceOp::Sum).await.map_err(flush)?;
                loss = f64::from(totals[1]);
                adafactor_sums = shard.adafactor.is_some().then(|| totals.split_off(2));
                f64::from(totals[0])
            }
            (Some(group), None) => {
                // The replicas' weighted gradients (and losses) sum to the whole batch's.
                self.flat.clear();
                append_flat(&grads, &mut self.flat);
                self.flat.push(loss as f32);
                group.comm.all_reduce(&mut self.flat[..], ReduceOp::Sum).await.map_err(flush)?;
                loss = f64::from(self.flat.pop().expect("loss"));
                copy_from_flat(&grads, &self.flat);
                grads.iter().map(|g| g.square().sum(Kind::Double).double_value(&[])).sum()
            }
            (None, _) => grads.iter().map(|g| g.square().sum(Kind::Double).double_value(&[])).sum(),
        };
        self.share_tied_gradient(step).await?;
        let mut totals = [sum_sq as f32, loss as f32];
        self.comm.all_reduce(&mut totals[..], ReduceOp::Sum).await.map_err(flush)?;
        let (grad_norm, loss) = (f64::from(totals[0]).sqrt(), f64::from(totals[1]));
        if let Some(sums) = adafactor_sums {
            let prepared = self.prepare_adafactor(grad_norm, sums).await.map_err(flush)?;
            self.share_tied_adafactor(step, prepared).await?;
        }
        let usage = Some(self.usage());
        self.release_params();
        Ok(ReducedStage { loss, grad_norm, spans: run.spans, usage })
    }

    /// What the device holds and sent in the step just reduced (taken before ZeRO-3 drops the
    /// parameters): its chunks' parameters and gradients, a tied head's copy with its gradient and
    /// optimizer state, the optimizer's state (with ZeRO inside the stage's group: the owned part's
    /// fp32 masters and moments, Adafactor's statistics; its reduced gradient counted with the
    /// gradients), the buddies' parts; and the bytes sent to its neighbours (activations forward,
    /// gradients back) and by the flush along the chain (pipeline group), and in the stage's group of
    /// replicas (data group).
    fn usage(&mut self) -> RankUsage {
        let f32s = |n: usize| (n * std::mem::size_of::<f32>()) as u64;
        let (mut param_bytes, mut grad_bytes) = tensor_and_grad_bytes(&self.params);
        let mut optimizer_bytes = f32s(self.optimizer.state_numel());
        let mut buddy_bytes = 0;
        if let Some(Tied::Head { copy, .. }) = &self.tied {
            let [param, grad, state] = copy.bytes();
            (param_bytes, grad_bytes, optimizer_bytes) =
                (param_bytes + param, grad_bytes + grad, optimizer_bytes + state);
        }
        if let Some(shard) = &self.shard {
            let (own, copies) = shard.parts.split_first().expect("the owned part");
            grad_bytes += f32s(own.grad.len());
            optimizer_bytes += f32s(own.master.len() + own.exp_avg.len() + own.exp_avg_sq.len());
            optimizer_bytes += shard.adafactor.as_ref().map_or(0, |a| f32s(a.stats.len()));
            let part = |c: &HeldPart| f32s(c.master.len() + c.exp_avg.len() + c.exp_avg_sq.len() + c.grad.len());
            buddy_bytes = copies.iter().map(part).sum();
        }
        let mut chain = self.comm.take_calls();
        let neighbours = CallTally { op: "send", calls: 0, bytes: 0, seconds: 0.0 };
        chain.push(std::mem::replace(&mut self.neighbours_sent, neighbours));
        let mut sent = group_sent(GroupKind::Pipeline, chain);
        if let Some(group) = &mut self.data_parallel {
            sent.extend(group_sent(GroupKind::Data, group.comm.take_calls()));
        }
        let activation_bytes = None;
        RankUsage { param_bytes, grad_bytes, optimizer_bytes, buddy_bytes, activation_bytes, step_seconds: 0.0, sent }
    }

    /// Adafactor under ZeRO, at the end of the flush (before the vote): the update the step will apply
    /// if committed — the loss scaler's verdict on `grad_norm` previewed, the statistics advanced from
    /// the group's reduced per-matrix `sums` — and its Σ update² per parameter all-reduced in the group.
    /// Nothing when the step will be skipped (fp16 overflow: every device sees the same norm). Returns
    /// what a tied head's copy needs to follow: the step's coefficients and the group's reduced sums.
    async fn prepare_adafactor(&mut self, grad_norm: f64, sums: Vec<f32>) -> Result<Option<Readied>, ClusterError> {
        let (Some(group), Some(shard)) = (&mut self.data_parallel, &mut self.shard) else { return Ok(None) };
        let StageShard { parts, adafactor: Some(a), .. } = shard else { return Ok(None) };
        let (train, parallel) = (&self.config.train, &self.config.parallel);
        let mut scaler = self.loss_scale;
        a.prepared = None;
        let verdict = scaler.conclude(self.precision, grad_norm, train.grad_clip, parallel.loss_scale_window);
        let Update::Apply { grad_factor, .. } = verdict else { return Ok(None) };
        let (grad_factor, lr, t) = (grad_factor as f32, learning_rate(train, self.step), self.optimizer.step() + 1);
        let prepared = Prepared::new(&a.layout, &train.adafactor, &a.stats, &sums, grad_factor, lr, t);
        let own = &parts[0];
        let mut update_sq = prepared.partial_update_sq(&a.layout, &own.range, &own.grad, &own.exp_avg_sq);
        group.comm.all_reduce(&mut update_sq[..], ReduceOp::Sum).await?;
        a.prepared = Some((prepared, update_sq));
        Ok(Some(Readied { sums, grad_factor, lr, t }))
    }

    /// The second half, once the step is committed: unscale and clip by the global norm, the optimizer
    /// (AdamW or Adafactor; on the owned part and the buddy copies with ZeRO inside the group) on the local
    /// parameters (or, when fp16 overflowed, no update), advance the step counter.
    pub fn apply_update(&mut self, reduced: ReducedStage) -> StageStep {
        let step = self.step;
        let (train, parallel) = (&self.config.train, &self.config.parallel);
        let loss_scale = self.loss_scale.scale;
        let update =
            self.loss_scale.conclude(self.precision, reduced.grad_norm, train.grad_clip, parallel.loss_scale_window);
        let lr = learning_rate(train, step);
        match (update, &mut self.shard) {
            (Update::Apply { grad_factor, .. }, Some(shard)) => {
                let t = self.optimizer.step() + 1;
                // Each copy gets the bits its owner gets: same gradient, same coefficient, same kernel.
                if let Some(a) = shard.adafactor.as_mut() {
                    // The flush prepared this step's update (the factor applied inside it).
                    let (prepared, update_sq) = a.prepared.take().expect("the flush prepared the committed update");
                    for part in &mut shard.parts {
                        let slots = ShardSlots {
                            master: &mut part.master,
                            exp_avg: &mut part.exp_avg,
                            compact: &mut part.exp_avg_sq,
                            grad: &part.grad,
                        };
                        prepared.apply(&a.layout, &part.range, slots, &update_sq);
                    }
                    a.stats = prepared.stats;
                } else {
                    if grad_factor != 1.0 {
                        let factor = grad_factor as f32;
                        shard.parts.iter_mut().flat_map(|p| p.grad.iter_mut()).for_each(|g| *g *= factor);
                    }
                    for part in &mut shard.parts {
                        let state = [&mut part.master, &mut part.exp_avg, &mut part.exp_avg_sq];
                        adamw_on_segments(state, &part.segments, &part.grad, train, lr, t);
                    }
                }
                self.optimizer.set_step(t);
                shard.params_stale = true; // gathered before the next step's forward
            }
            (Update::Apply { grad_factor, .. }, None) => {
                scale_grads(&self.params, grad_factor);
                self.optimizer.apply(&mut self.params, lr);
            }
            (Update::Skip { .. }, _) => {}
        }
        if let Update::Apply { grad_factor, .. } = update {
            self.apply_tied_copy(grad_factor, lr, self.optimizer.step());
        }
        self.step += 1;
        let (grad_norm, skipped) = (update.grad_norm(), update.skipped());
        let param_elements = self.params.iter().map(Tensor::numel).sum::<usize>() + self.tied_copy_elements();
        StageStep { step, loss: reduced.loss, grad_norm, lr, skipped, loss_scale, spans: reduced.spans, param_elements }
    }

    fn local_chunk(&self, chunk: usize) -> &LocalChunk {
        &self.chunks[self.plan.shape.virtual_of(chunk)]
    }

    fn is_local(&self, chunk: usize) -> bool {
        self.plan.shape.device_of(chunk) == self.device
    }

    fn tag(&self, kind: OpKind, chunk: usize, microbatch: usize, step: u64) -> Tag {
        let kind_bits: u64 = if kind == OpKind::SendActivation || kind == OpKind::RecvActivation { 1 } else { 2 };
        Tag {
            group: PIPELINE_TAG_GROUP,
            epoch: self.comm.epoch(),
            seq: (kind_bits << 48) | ((chunk as u64) << 24) | microbatch as u64,
            step: step as u32,
        }
    }

    /// The shape of an activation (or its gradient) for micro-batch `mb`.
    fn activation_shape(&self, mb: usize) -> [i64; 3] {
        let model = &self.config.model;
        [self.microbatches[mb].len() as i64, model.context as i64, model.d_model as i64]
    }

    async fn run_op(&mut self, op: Op, step: u64, run: &mut StepRun) -> Result<(), PipelineError> {
        let (c, mb) = (op.chunk, op.microbatch);
        match op.kind {
            OpKind::Forward => self.forward(c, mb, step, run),
            OpKind::Backward => self.backward(c, mb, step, run, false),
            OpKind::BackwardInput => self.backward(c, mb, step, run, true),
            OpKind::BackwardWeight => {
                let pending = run.pending_weights.remove(&(c, mb)).expect("checked plan: W after its B");
                self.weight_pass(c, pending);
            }
            OpKind::SendActivation => {
                let output = &run.saved.get(&(c, mb)).expect("checked plan: send after forward").output;
                let bytes = tensor_bytes(output);
                self.send(op, self.plan.shape.device_of(c + 1), bytes, step).await?;
            }
            OpKind::SendGradient => {
                let grad = run.outgoing.remove(&(c, mb)).expect("checked plan: send after backward");
                let bytes = tensor_bytes(&grad);
                self.send(op, self.plan.shape.device_of(c - 1), bytes, step).await?;
            }
            OpKind::RecvActivation => {
                let tensor = self.recv(op, self.plan.shape.device_of(c), step).await?;
                run.activations.insert((c + 1, mb), tensor);
            }
            OpKind::RecvGradient => {
                let tensor = self.recv(op, self.plan.shape.device_of(c), step).await?;
                run.gradients.insert((c - 1, mb), tensor);
            }
        }
        Ok(())
    }

    /// F: the chunk's forward of micro-batch `mb`. The last chunk adds its share of the loss. With
    /// `parallel.recompute` it runs without a graph and keeps only its input (and its output, to send):
    /// the backward runs it again with one ([`Self::chunk_forward`] is a pure function of the parameters,
    /// the input and the step's batch — gpt-tiny has no dropout — so both passes compute the same bits).
    fn forward(&mut self, c: usize, mb: usize, step: u64, run: &mut StepRun) {
        let received = (!self.local_chunk(c).layout.embed)
            .then(|| run.activations.remove(&(c, mb)).expect("checked plan: input before forward"));
        let recompute = self.config.parallel.recompute;
        let (saved, loss) = if recompute {
            let (mut saved, loss) = tch::no_grad(|| self.chunk_forward(c, mb, step, received.as_ref()));
            saved.ops.clear();
            saved.input = received;
            (saved, loss)
        } else {
            self.chunk_forward(c, mb, step, received.as_ref())
        };
        run.loss += loss;
        if c + 1 < self.plan.shape.chunks() && self.is_local(c + 1) {
            run.activations.insert((c + 1, mb), saved.output.detach());
        }
        run.saved.insert((c, mb), Saved { recompute, ..saved });
    }

    /// The chunk's forward from `received` (its input activation; None for the first chunk, whose input
    /// is the step's token ids), recording the parameter operations for B/W. Returns what the backward
    /// needs and the micro-batch's loss × its share of the global batch (0 but for the last chunk).
    fn chunk_forward(&self, c: usize, mb: usize, step: u64, received: Option<&Tensor>) -> (Saved, f64) {
        let range = self.microbatches[mb].clone();
        let samples = Some(Samples::new(self.config.train.seed, step, range.start));
        let weight = range.len() as f64 / self.config.train.global_batch as f64;
        let (layout, p) = (&self.local_chunk(c).layout, self.chunk_params(c));
        let (model, precision) = (&self.config.model, self.precision);
        let scaled = backward_weight(&self.config.train, &self.loss_scale, step, &range);
        let batch = (layout.embed || layout.head)
            .then(|| self.sampler.as_ref().expect("end chunks load the corpus").batch(step, range));
        let mut ops = Vec::new();
        let (input, mut x, mut used) = match received {
            None => {
                let (tokens, _) = batch.as_ref().expect("first chunk has its batch");
                let embed = model.embed_range();
                (None, embed_recorded(model, &p[embed.clone()], tokens, &mut ops), embed.end)
            }
            Some(received) => {
                let leaf = received.detach().set_requires_grad(true);
                (Some(leaf.shallow_clone()), leaf, 0)
            }
        };
        let record_at = |offset: usize, ops: &mut Vec<ParamOp>, recorded: Vec<ParamOp>| {
            ops.extend(
                recorded
                    .into_iter()
                    .map(|op| ParamOp { params: op.params.start + offset..op.params.end + offset, ..op }),
            );
        };
        for b in layout.blocks.clone() {
            let mut recorded = Vec::new();
            let per_block = model.block_range(b).len();
            x = block_recorded(model, precision, b, &p[used..used + per_block], &x, samples, &mut recorded);
            record_at(used, &mut ops, recorded);
            used += per_block;
        }
        let (output, loss) = if layout.head {
            let (_, targets) = batch.as_ref().expect("last chunk has its batch");
            let mut recorded = Vec::new();
            let logits = head_recorded(model, precision, &p[used..], &x, &mut recorded);
            record_at(used, &mut ops, recorded);
            let loss = cross_entropy(&logits, targets);
            let weighted = loss.double_value(&[]) * weight;
            (loss * scaled, weighted)
        } else {
            (x, 0.0)
        };
        (Saved { input, output, ops, recompute: false }, loss)
    }

    /// The full backward (`split` false: weight and input gradients in one autograd pass) or its
    /// input-gradient half B (`split` true): autograd is asked for the gradients of the input and of every
    /// parameter operation's output — not of the weights, so the weight-gradient products are skipped —
    /// and keeps the graph for W. Routes the input gradient to the previous chunk: kept if it is local,
    /// queued for sending otherwise.
    fn backward(&mut self, c: usize, mb: usize, step: u64, run: &mut StepRun, split: bool) {
        let mut saved = run.saved.remove(&(c, mb)).expect("checked plan: backward after forward");
        if saved.recompute {
            // The forward again, now with a graph, from the kept input.
            saved = self.chunk_forward(c, mb, step, saved.input.as_ref()).0;
        }
        let Saved { input, output, ops, .. } = saved;
        let scalar = if self.local_chunk(c).layout.head {
            output
        } else {
            let grad = run.gradients.remove(&(c, mb)).expect("checked plan: gradient before backward");
            (&output * grad).sum(Kind::Float)
        };
        if !scalar.requires_grad() {
            // A first chunk that trains nothing (`[peft]` freezing it): no gradient to compute or pass on.
            if split {
                run.pending_weights.insert((c, mb), Vec::new());
            }
            return;
        }
        let mut wrt: Vec<Tensor> = input.iter().map(Tensor::shallow_clone).collect();
        let input_grad = if split {
            wrt.extend(ops.iter().map(|op| op.output.shallow_clone()));
            let mut grads = Tensor::run_backward(&[&scalar], &wrt, true, false);
            let op_grads = grads.split_off(input.iter().count());
            let pending = ops.into_iter().zip(op_grads).collect();
            run.pending_weights.insert((c, mb), pending);
            grads.pop()
        } else {
            wrt.extend(self.chunk_params(c));
            let mut grads = Tensor::run_backward(&[&scalar], &wrt, false, false);
            let weight_grads = grads.split_off(input.iter().count());
            self.accumulate(c, 0, &weight_grads);
            grads.pop()
        };
        if let Some(grad) = input_grad {
            if self.is_local(c - 1) {
                run.gradients.insert((c - 1, mb), grad);
            } else {
                run.outgoing.insert((c, mb), grad);
            }
        }
    }

    /// W: each parameter operation's weight gradients from its output's gradient that B computed — one
    /// autograd pass per operation, each reaching only that operation's parameters.
    fn weight_pass(&mut self, c: usize, pending: Vec<(ParamOp, Tensor)>) {
        let chunk_params = self.chunk_params(c);
        for (op, output_grad) in pending {
            if !output_grad.defined() {
                continue;
            }
            let scalar = (&op.output * &output_grad).sum(Kind::Float);
            let grads = Tensor::run_backward(&[&scalar], &chunk_params[op.params.clone()], false, false);
            self.accumulate(c, op.params.start, &grads);
        }
    }

    /// Chunk c's parameters as its forward takes them: the device's tensors of its range, then for the
    /// last chunk of a tied model the embedding matrix the head multiplies by (shallow handles: gradients
    /// land on the tensors themselves).
    fn chunk_params(&self, c: usize) -> Vec<Tensor> {
        let chunk = self.local_chunk(c);
        let tied = chunk.layout.head.then(|| self.tied_head_param()).flatten();
        self.params[chunk.local.clone()].iter().map(Tensor::shallow_clone).chain(tied).collect()
    }

    /// Adds one micro-batch's gradients of chunk c's parameters `first..` ([`Self::chunk_params`]) to the
    /// step's (as autograd's accumulation would).
    fn accumulate(&mut self, c: usize, first: usize, grads: &[Tensor]) {
        tch::no_grad(|| {
            for (param, grad) in self.chunk_params(c)[first..].iter().zip(grads) {
                if grad.defined() {
                    let _ = param.grad().g_add_(grad);
                }
            }
        });
    }

    async fn send(&mut self, op: Op, to: usize, bytes: Bytes, step: u64) -> Result<(), PipelineError> {
        let (transport, tag) = (self.transport.clone(), self.tag(op.kind, op.chunk, op.microbatch, step));
        let (device, len, started) = (self.device, bytes.len() as u64, Instant::now());
        transport.send(to, tag, bytes).await.map_err(|source| PipelineError::Message { device, step, op, source })?;
        let sent = &mut self.neighbours_sent;
        (sent.calls, sent.bytes, sent.seconds) =
            (sent.calls + 1, sent.bytes + len, sent.seconds + started.elapsed().as_secs_f64());
        Ok(())
    }

    async fn recv(&mut self, op: Op, from: usize, step: u64) -> Result<Tensor, PipelineError> {
        let send_kind = if op.kind == OpKind::RecvActivation { OpKind::SendActivation } else { OpKind::SendGradient };
        let (transport, tag) = (self.transport.clone(), self.tag(send_kind, op.chunk, op.microbatch, step));
        let payload = transport
            .recv(from, tag, LossScope::Peer, self.recv_timeout_ms)
            .await
            .map_err(|source| PipelineError::Message { device: self.device, step, op, source })?;
        let shape = self.activation_shape(op.microbatch);
        let expected = shape.iter().product::<i64>() as usize * 4;
        let bytes = payload.to_vec();
        if bytes.len() != expected {
            return Err(PipelineError::BadMessage { device: self.device, step, op, got: bytes.len(), expected });
        }
        let values: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok(Tensor::from_slice(&values).view(shape))
    }
}

/// An f32 tensor's values, little endian, as one message body.
fn tensor_bytes(tensor: &Tensor) -> Bytes {
    let tensor = tensor.detach().contiguous();
    let mut values = vec![0f32; tensor.numel()];
    let numel = values.len();
    tensor.copy_data(&mut values, numel);
    Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
}

/// The state of one step in flight on a device.
#[derive(Default)]
struct StepRun {
    saved: HashMap<(usize, usize), Saved>,
    /// Inputs waiting for their forward, by (consuming chunk, micro-batch).
    activations: HashMap<(usize, usize), Tensor>,
    /// Output gradients waiting for their backward, by (chunk, micro-batch).
    gradients: HashMap<(usize, usize), Tensor>,
    /// Input gradients waiting to be sent, by (producing chunk, micro-batch).
    outgoing: HashMap<(usize, usize), Tensor>,
    /// Zero-bubble: each parameter operation's output and its gradient, waiting for W, by (chunk,
    /// micro-batch).
    pending_weights: HashMap<(usize, usize), Vec<(ParamOp, Tensor)>>,
    /// Σ micro-batch loss × its share of the global batch (last chunk only).
    loss: f64,
    spans: Vec<OpSpan>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sorted, adjacent ranges joined.
    fn merged(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
        ranges.sort_by_key(|r| r.start);
        let mut out: Vec<Range<usize>> = Vec::new();
        for r in ranges {
            match out.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => out.push(r),
            }
        }
        out
    }

    #[test]
    fn a_sharded_replica_holds_its_part_then_its_buddies_parts_cut_at_chunk_boundaries() {
        let config = troupe_model::model::ModelConfig::gpt_tiny();
        let shape = PlanShape::new(2, 4, 2);
        let layouts = super::super::partition(&config, shape.chunks()).unwrap();
        for device in 0..2 {
            let chunks = chunk_ranges(shape, &layouts, device);
            let owned = |replica| held_ranges(shape, &layouts, device, Some((replica, 3)), 0);
            // The replicas' own parts tile the device's chunks.
            let tiled: Vec<Range<usize>> = (0..3).flat_map(owned).collect();
            assert_eq!(merged(tiled), merged(chunks.clone()), "device {device}");
            // One copy: replica 1 holds its part, then replica 2's; replica 2 wraps round to replica 0.
            let held = held_ranges(shape, &layouts, device, Some((1, 3)), 1);
            assert_eq!(held, [owned(1), owned(2)].concat());
            assert_eq!(held_ranges(shape, &layouts, device, Some((2, 3)), 5), [owned(2), owned(0), owned(1)].concat());
            // Unsharded: the chunks, whatever the copies.
            assert_eq!(held_ranges(shape, &layouts, device, None, 1), chunks);
        }
        assert_eq!(copies_kept(1, 2), 1);
        assert_eq!(copies_kept(9, 1), REPLICAS_MAX);
        assert_eq!(copies_kept(3, 8), 1, "(1 + 1) × 8 pieces fit a holding, (1 + 2) × 8 do not");
        assert_eq!(copies_kept(1, 16), 0);
    }
}

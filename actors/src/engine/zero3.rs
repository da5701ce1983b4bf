//! ZeRO-3 (FSDP): the parameters are sharded too. A rank keeps only its shards (masters, moments,
//! gradient accumulators — the state of [`super::ShardedReplica`], same ownership as ZeRO-1/2); the
//! model's parameter tensors are empty between steps. Each micro-batch runs unit by unit (embeddings,
//! each block, the head): the unit's full parameters are gathered from the owners of the ranges it spans
//! just before its forward, and dropped after it; before its backward they are gathered again (with
//! `parallel.recompute`: the forward kept only the unit's input and recomputes it) or still held by the
//! autograd graph (without); after the backward the unit's gradient is reduced to its owners, who add it
//! to their gradient shard, and the parameters are dropped.
//!
//! A tied head (`model.tie_word_embeddings`) multiplies by the token-embedding matrix, parameter 0 of the
//! embeddings' unit: the head's unit spans that matrix's elements too ([`Unit::tied`]), gathered with the
//! head's own and its gradient reduced to the matrix's owners with the head's, so each owner's
//! accumulator sums the matrix's two uses — the head's reduced first, the embeddings' at the end of the
//! backward — as autograd sums them in the single process.
//!
//! Every rank runs the same sequence of collectives — units in the same order, one broadcast (gather) or
//! reduce per owner piece, as many micro-batch rounds as the rank with the most micro-batches — so a rank
//! whose slice has fewer (or no) micro-batches takes part with nothing to compute and zero gradients.
//!
//! The compute of each unit runs on a blocking-pool thread while the attempt's runtime prefetches the next
//! unit's parameters and reduces the previous unit's gradient (see [`micro_batch`]).
//!
//! The units compute on the trainer's device. On GPUs of their own (a [`DevicePlane`]: NCCL), a unit's
//! gather is one group of NCCL broadcasts into a buffer on the device — each owner's piece put there
//! from its host masters first — whose views are the unit's parameters, and its reduction one group of
//! NCCL reductions of the flat gradient on the device, each owner copying only its own pieces down to
//! its gradient shard. Without one the same broadcasts and reductions run over the attempt's (host)
//! communicator, the parameters going up to the device and the gradients down.

use std::ops::Range;

use tch::{Device, Kind, Tensor};
use troupe_cluster::collective::{Collective, Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::blockwise::{backward_from, backward_stages, leaf, Activations};
use troupe_model::data::{micro_batch_ranges, rank_slice};
use troupe_model::model::{self, ModelConfig, ParamSpec};
use troupe_model::precision::{backward_weight, Precision};
use troupe_model::transfer::upload;
use troupe_model::Trainer;

use super::device_plane::DevicePlane;
use super::shard_plan::owner_pieces;

mod eval;

pub(crate) use eval::evaluate_share;

/// One unit of the model that is gathered, computed and released as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Its parameters (positions in [`model::param_specs`] order).
    pub params: Range<usize>,
    /// Their elements in the flat parameter order.
    pub flat: Range<usize>,
    /// The head of a tied model: the elements of the token-embedding matrix (parameter 0, owned by the
    /// embeddings' unit) that it multiplies by, after its own — what [`model::head_params`] appends.
    pub tied: Option<Range<usize>>,
}

impl Unit {
    /// The unit's ranges of the flat order, in the order its tensors come: its own, then the tied matrix.
    fn segments(&self) -> impl Iterator<Item = &Range<usize>> {
        std::iter::once(&self.flat).chain(&self.tied)
    }

    /// Elements gathered for the unit.
    fn len(&self) -> usize {
        self.segments().map(Range::len).sum()
    }

    /// The specs of the tensors the unit computes with, in [`Self::segments`]' order.
    fn specs(&self, specs: &[ParamSpec]) -> Vec<ParamSpec> {
        let tied = self.tied.as_ref().map(|_| specs[0].clone());
        specs[self.params.clone()].iter().cloned().chain(tied).collect()
    }
}

/// The units in forward order: the embeddings, every block, the head (final norm and head; tied, the
/// token-embedding matrix too).
pub fn plan_units(config: &ModelConfig, specs: &[ParamSpec]) -> Vec<Unit> {
    let mut offsets = vec![0];
    offsets.extend(specs.iter().scan(0, |sum, s| {
        *sum += s.numel();
        Some(*sum)
    }));
    let head = config.head_range();
    backward_stages(config)
        .into_iter()
        .rev()
        .map(|params| {
            let tied = (config.head_takes_embedding() && params == head).then(|| offsets[0]..offsets[1]);
            Unit { flat: offsets[params.start]..offsets[params.end], params, tied }
        })
        .collect()
}

/// The parameters of the whole model are dropped: each becomes an empty leaf (its values and gradient
/// freed), so a ZeRO-3 rank keeps none between steps.
pub fn release_params(trainer: &mut Trainer) {
    if let Some(base) = trainer.model.base() {
        base.transient(); // a fine-tuning job's frozen base is read per use too
    }
    for p in trainer.model.params_mut() {
        *p = Tensor::zeros([0], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    }
}

/// Rebuilds every parameter of the model from `flat` (the whole flat order), whatever its shape was, on
/// the trainer's device.
pub fn restore_params(trainer: &mut Trainer, flat: &[f32]) {
    restore_params_from(trainer, &Tensor::from_slice(flat));
}

/// [`restore_params`] from a flat tensor on any device: each parameter a tensor of its own (not a view
/// of `flat`) on the trainer's device.
pub fn restore_params_from(trainer: &mut Trainer, flat: &Tensor) {
    let (specs, device) = (trainer.model.specs().to_vec(), trainer.device);
    let mut offset = 0;
    for (p, spec) in trainer.model.params_mut().iter_mut().zip(&specs) {
        let n = spec.numel() as i64;
        let values = flat.narrow(0, offset, n).view(spec.shape.as_slice());
        *p = values.to_device_(device, Kind::Float, false, true).set_requires_grad(true);
        offset += n;
    }
}

/// Leaves requiring grad shaped by `specs`, views of consecutive elements of `buf` (a flat f32 tensor
/// that nothing else writes while they live): a gathered unit's parameters, without a copy.
fn leaves_of(specs: &[ParamSpec], buf: &Tensor) -> Vec<Tensor> {
    let mut offset = 0;
    specs
        .iter()
        .map(|spec| {
            let n = spec.numel() as i64;
            let t = buf.narrow(0, offset, n).view(spec.shape.as_slice()).detach().set_requires_grad(true);
            offset += n;
            t
        })
        .collect()
}

/// Fresh leaves requiring grad, shaped by `specs`, from consecutive values of `flat`.
pub(crate) fn unit_tensors(specs: &[ParamSpec], flat: &[f32]) -> Vec<Tensor> {
    let mut offset = 0;
    specs
        .iter()
        .map(|spec| {
            let n = spec.numel();
            let t = Tensor::from_slice(&flat[offset..offset + n]).view(spec.shape.as_slice()).set_requires_grad(true);
            offset += n;
            t
        })
        .collect()
}

/// One owner's piece of a unit.
struct Piece {
    /// Its elements in the unit's buffer (the unit's segments one after another).
    at: Range<usize>,
    owner: usize,
    /// Its elements in the flat order (inside the owner's shard).
    flat: Range<usize>,
}

/// One rank's side of a ZeRO-3 step's gathers and reductions.
struct Exchange<'a, T: Transport> {
    comm: &'a mut Communicator<T>,
    /// On GPUs of their own: the gathers and reductions on the device (module docs); None: over `comm`.
    plane: Option<&'a mut (dyn DevicePlane + 'static)>,
    /// Where the units compute: the gathered parameters are made there.
    device: Device,
    specs: Vec<ParamSpec>,
    total: usize,
    /// This rank's own shard: its range of the flat order and its masters.
    own: Range<usize>,
    masters: &'a [f32],
    /// The gradient of the own shard, accumulated over micro-batches.
    grad: &'a mut [f32],
    buf: Vec<f32>,
}

impl<T: Transport> Exchange<'_, T> {
    /// Each owner's piece of `unit`, segment by segment, in rank order.
    fn pieces(&self, unit: &Unit) -> Vec<Piece> {
        let world = self.comm.world();
        let mut pieces = Vec::new();
        let mut at = 0;
        for segment in unit.segments() {
            for (owner, flat) in owner_pieces(self.total, world, segment) {
                let start = at + flat.start - segment.start;
                pieces.push(Piece { at: start..start + flat.len(), owner, flat });
            }
            at += segment.len();
        }
        pieces
    }

    /// The full parameters of `unit`, on the device: each owner broadcasts its pieces — as one group
    /// on the device plane, else one by one in rank order over the host communicator.
    async fn gather(&mut self, unit: &Unit) -> Result<Vec<Tensor>, ClusterError> {
        let rank = self.comm.rank();
        let (pieces, specs) = (self.pieces(unit), unit.specs(&self.specs));
        let own = |flat: &Range<usize>| flat.start - self.own.start..flat.end - self.own.start;
        if let Some(plane) = self.plane.as_deref_mut() {
            let mut buf = Tensor::zeros([unit.len() as i64], (Kind::Float, self.device));
            tch::no_grad(|| {
                for p in pieces.iter().filter(|p| p.owner == rank) {
                    let masters = Tensor::from_slice(&self.masters[own(&p.flat)]);
                    buf.narrow(0, p.at.start as i64, p.at.len() as i64).copy_(&masters);
                }
            });
            let rooted: Vec<(Range<usize>, usize)> = pieces.iter().map(|p| (p.at.clone(), p.owner)).collect();
            plane.broadcast_pieces(&mut buf, &rooted).await?;
            return Ok(leaves_of(&specs, &buf));
        }
        self.buf.clear();
        self.buf.resize(unit.len(), 0.0);
        for p in &pieces {
            let dst = &mut self.buf[p.at.clone()];
            if p.owner == rank {
                dst.copy_from_slice(&self.masters[own(&p.flat)]);
            }
            self.comm.broadcast(dst, p.owner).await?;
        }
        Ok(leaves_of(&specs, &Tensor::from_slice(&self.buf).to_device(self.device)))
    }

    /// Sums `params`' gradients (zeros for `None`: nothing computed this round) over the ranks onto
    /// their owners, who add their part to the gradient shard — one group of reductions on the device
    /// plane (only the own pieces come down), else one reduction per piece over the host communicator.
    async fn reduce(&mut self, unit: &Unit, params: Option<Vec<Tensor>>) -> Result<(), ClusterError> {
        let rank = self.comm.rank();
        let pieces = self.pieces(unit);
        if self.plane.is_some() {
            let mut flat = grads_on(self.device, unit.len(), params);
            let rooted: Vec<(Range<usize>, usize)> = pieces.iter().map(|p| (p.at.clone(), p.owner)).collect();
            let plane = self.plane.as_deref_mut().expect("checked above");
            plane.reduce_pieces(&mut flat, &rooted).await?;
            for p in pieces.iter().filter(|p| p.owner == rank) {
                self.buf.clear();
                self.buf.resize(p.at.len(), 0.0);
                flat.narrow(0, p.at.start as i64, p.at.len() as i64).copy_data(&mut self.buf, p.at.len());
                let acc = &mut self.grad[p.flat.start - self.own.start..p.flat.end - self.own.start];
                acc.iter_mut().zip(&self.buf).for_each(|(a, g)| *a += g);
            }
            return Ok(());
        }
        self.load_grads(unit, params);
        for p in &pieces {
            let part = &mut self.buf[p.at.clone()];
            self.comm.reduce(part, ReduceOp::Sum, p.owner).await?;
            if p.owner == rank {
                let acc = &mut self.grad[p.flat.start - self.own.start..p.flat.end - self.own.start];
                acc.iter_mut().zip(part.iter()).for_each(|(a, g)| *a += g);
            }
        }
        Ok(())
    }

    /// `params`' gradients, flat, into the buffer (zeros for `None`); the parameters are dropped.
    fn load_grads(&mut self, unit: &Unit, params: Option<Vec<Tensor>>) {
        self.buf.clear();
        self.buf.resize(unit.len(), 0.0);
        if let Some(params) = params {
            let mut offset = 0;
            for p in &params {
                let n = p.numel();
                let g = p.grad();
                if g.defined() {
                    g.copy_data(&mut self.buf[offset..offset + n], n);
                }
                offset += n;
            }
        }
    }
}

/// `params`' gradients as one flat tensor of `len` elements on `device` (zeros where a parameter has
/// none, or for `None`); the parameters are dropped.
fn grads_on(device: Device, len: usize, params: Option<Vec<Tensor>>) -> Tensor {
    let flat = Tensor::zeros([len as i64], (Kind::Float, device));
    tch::no_grad(|| {
        let mut offset = 0;
        for p in params.iter().flatten() {
            let (n, g) = (p.numel() as i64, p.grad());
            if g.defined() {
                flat.narrow(0, offset, n).copy_(&g.reshape([-1]));
            }
            offset += n;
        }
    });
    flat
}

/// One micro-batch of this rank: tokens, targets, its weight (its share of the global batch) and the
/// factor its backward multiplies the loss by (the share times fp16's loss scale).
struct Batch {
    tokens: Tensor,
    targets: Tensor,
    weight: f64,
    backward_weight: f64,
    /// Which samples of the step (LoRA's dropout is a function of them).
    samples: model::Samples,
}

/// The forward and backward of `step`'s slice of this rank, unit by unit: zeroes `grad` (the own
/// shard's gradient), then accumulates into it the global batch's gradient of the own range (every
/// rank's slice, reduced). Returns this rank's weighted loss (the batch's mean loss when summed over
/// ranks). `own` must be this rank's own shard: its range of the flat order and its masters. The units
/// compute on the trainer's device; `plane` gathers and reduces there (module docs).
pub(super) async fn accumulate<T: Transport>(
    (comm, plane): (&mut Communicator<T>, Option<&mut (dyn DevicePlane + 'static)>),
    trainer: &mut Trainer,
    (own, masters): (Range<usize>, &[f32]),
    grad: &mut [f32],
) -> Result<f64, ClusterError> {
    grad.fill(0.0);
    let (rank, world) = (comm.rank(), comm.world());
    let config = trainer.config.clone();
    let train = &config.train;
    let specs = trainer.model.specs().to_vec();
    let units = plan_units(&config.model, &specs);
    let total = units.last().map_or(0, |u| u.flat.end);
    let rounds = (0..world)
        .map(|r| micro_batch_ranges(rank_slice(train.global_batch, r, world), train.micro_batch).len())
        .max()
        .unwrap_or(0);
    let mine = micro_batch_ranges(rank_slice(train.global_batch, rank, world), train.micro_batch);
    let activations = Activations::from_recompute(config.parallel.recompute);
    let device = trainer.device;
    let mut exchange = Exchange { comm, plane, device, specs, total, own, masters, grad, buf: Vec::new() };
    let mut losses = Vec::new();
    for round in 0..rounds {
        let batch = mine.get(round).map(|micro| {
            let weight = micro.len() as f64 / train.global_batch as f64;
            let backward_weight = backward_weight(train, &trainer.loss_scale, trainer.step, micro);
            let samples = model::Samples::new(train.seed, trainer.step, micro.start);
            let (tokens, targets) = trainer.sampler.batch(trainer.step, micro.clone());
            let (tokens, targets) = (upload(&tokens, device), upload(&targets, device));
            Batch { tokens, targets, weight, backward_weight, samples }
        });
        let weight = batch.as_ref().map_or(0.0, |b| b.weight);
        let model = (&config.model, trainer.model.precision);
        if let Some(loss) = micro_batch(&mut exchange, model, &units, batch, activations).await? {
            losses.push((loss, weight));
        }
    }
    Ok(troupe_model::trainer::weighted_losses(&losses))
}

/// What the forward keeps of a unit for its backward.
enum Kept {
    /// The unit's parameters and output with its graph (and, for a block, its input leaf).
    Graph { params: Vec<Tensor>, input: Option<Tensor>, output: Tensor },
    /// Only the unit's input (none for the embeddings: the tokens), to recompute from.
    Input(Option<Tensor>),
}

/// The model's shape and compute precision, what every unit's compute needs.
#[derive(Clone)]
struct Model {
    config: ModelConfig,
    precision: Precision,
}

impl Model {
    /// Unit `unit`'s forward (the embeddings of `tokens` when it is 0 and `input` is None, else block
    /// `unit - 1` on `input`); `samples` for a training forward.
    fn run(
        &self,
        unit: usize,
        params: &[Tensor],
        input: Option<&Tensor>,
        tokens: &Tensor,
        samples: Option<model::Samples>,
    ) -> Tensor {
        match input {
            None => model::embed(&self.config, params, tokens),
            Some(input) => model::block_training(&self.config, self.precision, unit - 1, params, input, samples),
        }
    }
}

/// Runs `f` on a thread of the runtime's blocking pool, so the attempt's (current-thread) runtime goes on
/// moving the collectives meanwhile. A panic in `f` continues here.
async fn on_thread<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Runs `comm` and, when there is one, `compute` concurrently; both results, or `comm`'s error (after
/// `compute` finished: a compute thread is never left running).
async fn alongside<C, R>(
    compute: Option<impl std::future::Future<Output = C>>,
    comm: impl std::future::Future<Output = Result<R, ClusterError>>,
) -> Result<(Option<C>, R), ClusterError> {
    match compute {
        Some(compute) => {
            let (done, comm) = tokio::join!(compute, comm);
            Ok((Some(done), comm?))
        }
        None => Ok((None, comm.await?)),
    }
}

/// What the forward through the embeddings and blocks leaves for the head and the backward.
struct BodyForward {
    /// Each unit's keep for its backward, in forward order (none without a micro-batch).
    kept: Vec<Kept>,
    /// The last block's output, the head's input (None without a micro-batch).
    output: Option<Tensor>,
    /// The head's gathered parameters.
    head_params: Vec<Tensor>,
}

/// What the head leaves for the backward through the blocks and the embeddings.
struct HeadDone {
    /// The micro-batch's mean loss, a scalar where the model computes (None without a micro-batch).
    loss: Option<Tensor>,
    /// The gradient of the head's input (None without a micro-batch).
    grad: Option<Tensor>,
    /// The head's parameters holding their gradients, to reduce (None without a micro-batch).
    params: Option<Vec<Tensor>>,
    /// (recompute) The last block's parameters, gathered for its backward.
    prefetched: Option<Vec<Tensor>>,
}

/// One micro-batch round (`batch` None: this rank has no micro-batch left and only takes part in the
/// collectives). Returns the micro-batch's mean loss (None without one), not yet read to the host.
///
/// Communication overlaps compute: each unit's forward (and backward) runs on a blocking-pool thread
/// while the attempt's runtime gathers the next unit's parameters — and, in the backward, reduces the
/// previous unit's gradient to its owners. So at most two units' gathered parameters are alive at once
/// (FSDP's prefetch of one). Every rank issues the same collectives in the same order, computing or not:
/// forward: gather 0, 1, …, head; head: (recompute) gather the last block; backward of unit i: reduce
/// unit i + 1 (the head first), then (recompute) gather unit i − 1; after the loop: reduce unit 0.
async fn micro_batch<T: Transport>(
    ex: &mut Exchange<'_, T>,
    (config, precision): (&ModelConfig, Precision),
    units: &[Unit],
    batch: Option<Batch>,
    activations: Activations,
) -> Result<Option<Tensor>, ClusterError> {
    let model = Model { config: config.clone(), precision };
    let recompute = activations == Activations::Recompute;
    let (head, body) = units.split_last().expect("the model has a head");
    let last = body.last().expect("the model has embeddings");
    let (BodyForward { kept, output, head_params }, batch) =
        forward_body(ex, &model, (body, head), batch, activations).await?;
    let (head_done, batch) = forward_head(ex, &model, last, (output, head_params), batch, recompute).await?;
    let loss = head_done.loss.as_ref().map(Tensor::shallow_clone);
    backward_body(ex, &model, (body, head), kept, head_done, batch, recompute).await?;
    Ok(loss)
}

/// The forward through the embeddings and blocks, each unit's compute beside the gather of the unit
/// after it (the head after the last block); without a micro-batch only the gathers. Gives `batch` back
/// (owned, not borrowed, across the awaits: a `Tensor` is not `Sync`).
async fn forward_body<T: Transport>(
    ex: &mut Exchange<'_, T>,
    model: &Model,
    (body, head): (&[Unit], &Unit),
    batch: Option<Batch>,
    activations: Activations,
) -> Result<(BodyForward, Option<Batch>), ClusterError> {
    let first = body.first().expect("the model has embeddings");
    let mut kept: Vec<Kept> = Vec::with_capacity(body.len());
    let mut x: Option<Tensor> = None;
    let mut params = ex.gather(first).await?;
    for u in 0..body.len() {
        let next = body.get(u + 1).unwrap_or(head);
        let Some(batch) = &batch else {
            params = ex.gather(next).await?;
            continue;
        };
        let (model, tokens, input) = (model.clone(), batch.tokens.shallow_clone(), x.take());
        let samples = Some(batch.samples);
        let compute = on_thread(move || match activations {
            Activations::Keep => {
                let input = input.map(|x| leaf(&x));
                let output = model.run(u, &params, input.as_ref(), &tokens, samples);
                (output.shallow_clone(), Kept::Graph { params, input, output })
            }
            // `params` dropped here — released until the backward gathers them again.
            Activations::Recompute => {
                (tch::no_grad(|| model.run(u, &params, input.as_ref(), &tokens, samples)), Kept::Input(input))
            }
        });
        let ((output, keep), gathered) = tokio::join!(compute, ex.gather(next));
        x = Some(output);
        kept.push(keep);
        params = gathered?;
    }
    Ok((BodyForward { kept, output: x, head_params: params }, batch))
}

/// The head and the loss (and the loss's backward into the head, scaled by the backward weight), beside
/// (recompute) the gather of the last block for its backward. Gives `batch` back.
async fn forward_head<T: Transport>(
    ex: &mut Exchange<'_, T>,
    model: &Model,
    last: &Unit,
    (input, head_params): (Option<Tensor>, Vec<Tensor>),
    batch: Option<Batch>,
    recompute: bool,
) -> Result<(HeadDone, Option<Batch>), ClusterError> {
    let head_compute = batch.as_ref().map(|batch| {
        let (model, targets) = (model.clone(), batch.targets.shallow_clone());
        let (input, scale) = (input.expect("the head's input"), batch.backward_weight);
        on_thread(move || {
            let input = leaf(&input);
            let logits = model::head(&model.config, model.precision, &head_params, &input);
            let micro_loss = model::cross_entropy(&logits, &targets);
            (&micro_loss * scale).backward();
            (micro_loss.detach(), input.grad(), head_params)
        })
    });
    let prefetch_last = async {
        match recompute {
            true => ex.gather(last).await.map(Some),
            false => Ok(None),
        }
    };
    let (head_done, prefetched) = alongside(head_compute, prefetch_last).await?;
    let done = match head_done {
        Some((loss, grad, params)) => HeadDone { loss: Some(loss), grad: Some(grad), params: Some(params), prefetched },
        None => HeadDone { loss: None, grad: None, params: None, prefetched },
    };
    Ok((done, batch))
}

/// The backward through the blocks and the embeddings, last first: each unit's backward beside the
/// reduce of the unit after it (the head first) and (recompute) the gather of the unit before it; then
/// the reduce of the embeddings.
async fn backward_body<T: Transport>(
    ex: &mut Exchange<'_, T>,
    model: &Model,
    (body, head): (&[Unit], &Unit),
    mut kept: Vec<Kept>,
    HeadDone { mut grad, params: head_params, mut prefetched, .. }: HeadDone,
    batch: Option<Batch>,
    recompute: bool,
) -> Result<(), ClusterError> {
    let mut pending: (&Unit, Option<Vec<Tensor>>) = (head, head_params);
    // With `[peft]` the first units may train nothing: no backward through them.
    let trains = troupe_model::blockwise::needs_backward(&model.config);
    for (i, unit) in body.iter().enumerate().rev() {
        let trains = trains[i];
        let gathered = prefetched.take();
        let compute = match (kept.pop(), grad.take(), &batch) {
            (Some(keep), Some(g), Some(batch)) => {
                let (model, tokens, samples) = (model.clone(), batch.tokens.shallow_clone(), Some(batch.samples));
                Some(on_thread(move || {
                    let (params, input, output) = match keep {
                        Kept::Graph { params, input, output } => (params, input, output),
                        Kept::Input(saved) => {
                            let params = gathered.expect("recompute gathers the unit before its backward");
                            let input = saved.map(|s| leaf(&s));
                            let output = model.run(i, &params, input.as_ref(), &tokens, samples);
                            (params, input, output)
                        }
                    };
                    if trains {
                        backward_from(&output, &g);
                    }
                    (params, input.filter(|_| trains).map(|i| i.grad()))
                }))
            }
            _ => None,
        };
        let (reduce_unit, reduce_params) = std::mem::replace(&mut pending, (unit, None));
        let before = i.checked_sub(1).map(|k| &body[k]);
        let comm = async {
            ex.reduce(reduce_unit, reduce_params).await?;
            match (recompute, before) {
                (true, Some(before)) => ex.gather(before).await.map(Some),
                _ => Ok(None),
            }
        };
        let (done, next) = alongside(compute, comm).await?;
        if let Some((params, input_grad)) = done {
            pending.1 = Some(params);
            grad = input_grad;
        }
        prefetched = next;
    }
    let (unit, params) = pending;
    ex.reduce(unit, params).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_cover_the_flat_order_in_forward_order() {
        let config = ModelConfig::gpt_tiny();
        let specs = model::param_specs(&config);
        let units = plan_units(&config, &specs);
        assert_eq!(units.len(), config.n_layers + 2, "embeddings, blocks, head");
        assert_eq!(units[0].params, 0..2);
        assert_eq!(units.last().map(|u| u.params.clone()), Some(50..53));
        let mut at = 0;
        for unit in &units {
            assert_eq!(unit.flat.start, at, "contiguous");
            let numel: usize = specs[unit.params.clone()].iter().map(ParamSpec::numel).sum();
            assert_eq!(unit.flat.len(), numel);
            at = unit.flat.end;
        }
        assert_eq!(at, config.param_count());
        assert!(units.iter().all(|u| u.tied.is_none()), "untied: no unit spans another's elements");
    }

    /// Tied, the head's unit also spans the token-embedding matrix — parameter 0, the start of the
    /// embeddings' unit — after its own elements, and its tensors come in `head_params`' order.
    #[test]
    fn a_tied_head_unit_spans_the_embedding_matrix_too() {
        let config = ModelConfig { tie_word_embeddings: true, ..ModelConfig::gpt_tiny() };
        let specs = model::param_specs(&config);
        let units = plan_units(&config, &specs);
        let head = units.last().unwrap();
        assert_eq!(head.params, config.head_range());
        assert_eq!(head.tied, Some(0..specs[0].numel()));
        assert_eq!(head.len(), head.flat.len() + specs[0].numel());
        let names: Vec<String> = head.specs(&specs).into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["ln_f.weight", "ln_f.bias", "wte.weight"]);
        assert!(units[..units.len() - 1].iter().all(|u| u.tied.is_none()));
    }
}

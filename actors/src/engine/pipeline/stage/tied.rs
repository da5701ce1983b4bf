//! A tied head (`model.tie_word_embeddings`) across a pipeline, Megatron-LM's way. The head multiplies
//! by the token-embedding matrix, parameter 0 of the first chunk; the device of the last chunk keeps a
//! copy of it, initialised from the same values (a fresh job's, or at resume and reshard the same piece
//! of the flat state: [`tied_copy_range`] is one of the ranges that device holds).
//!
//! After a step's ops, the two devices sum their gradients for the matrix: the head's device sends its
//! copy's gradient to the embeddings' device, which adds it to parameter 0's before the gradients are
//! reduced among the stage's data-parallel replicas (so the reduction sums both uses), and after that
//! reduction sends the summed gradient back, which the head's device takes as its copy's. The norm
//! counts the matrix once (the copy is outside the device's parameters), and both devices apply the same
//! optimizer update (AdamW's or Adafactor's, from the same state) to the same gradient bits by the same
//! kernel, so the copies stay bit-identical. The flat
//! state — checkpoints, shard pieces, resharding, buddy copies — holds the matrix once, as parameter 0;
//! the head's device reports its copy as one more piece of that range (a source as good as the
//! original, since the bits are the same) and drops it from what it writes to checkpoints.
//!
//! With Adafactor and ZeRO inside the stage groups, the embeddings' replicas update their ranges of the
//! matrix with the sharded Adafactor, whose per-matrix terms are sums over the group; the copy then
//! follows with the same elementwise math on the whole matrix ([`CopyAdafactor`]), from the matrix's
//! reduced terms the embeddings' device sends once its group has them — the same bits again.
//!
//! A device that holds both the first and the last chunk (a one-device pipeline, with or without
//! virtual stages) runs its head on parameter 0 itself: autograd sums both uses, nothing is exchanged.

use std::ops::Range;

use tch::{Kind, Tensor};
use troupe_cluster::collective::{chunk_range, Collective};
use troupe_cluster::transport::Transport;
use troupe_model::config::JobConfig;
use troupe_model::init::initial_values;
use troupe_model::model::{param_specs, ModelConfig};
use troupe_model::optim::adafactor_shard::{Prepared, ShardLayout, ShardSlots};
use troupe_model::optim::{scale_grads, Optimizer};

use super::super::super::committed::ShardPiece;
use super::super::super::flat::{append_flat, copy_from_flat, materialise_grads};
use super::super::super::shard_plan::ShardMode;
use super::super::{PipelineError, PlanShape};
use super::{PipelineStage, Readied};

/// The flat range (the token-embedding matrix, parameter 0) that `device` keeps a copy of: the device of
/// the last chunk of a tied model, when the first chunk is on another device. Pure.
pub fn tied_copy_range(model: &ModelConfig, shape: PlanShape, device: usize) -> Option<Range<usize>> {
    let head = shape.device_of(shape.chunks() - 1);
    let separate = device == head && shape.device_of(0) != head;
    (model.head_takes_embedding() && separate).then(|| 0..param_specs(model)[0].numel())
}

/// What a device of a tied model does with the matrix.
pub(super) enum Tied {
    /// It holds the embeddings and the head: the head runs on parameter 0 itself.
    Local,
    /// It holds the embeddings (parameter 0); the device `head` keeps a copy.
    Embed { head: usize },
    /// It holds the head and a copy of parameter 0, summed and updated with the device `embed`'s.
    Head { embed: usize, copy: TiedCopy },
}

/// The head's device's copy of the token-embedding matrix.
pub(super) struct TiedCopy {
    /// A leaf requiring grad, its gradient accumulated into over the step's micro-batches.
    param: Tensor,
    /// Its optimizer state (the step counter is set to the stage's before each update).
    optimizer: Optimizer,
    /// Its range of the flat order.
    range: Range<usize>,
    /// Adafactor with ZeRO inside the stage groups: the state the copy is updated with instead of
    /// `optimizer`'s.
    adafactor: Option<CopyAdafactor>,
}

/// The copy's Adafactor when the embeddings' owners run the sharded one: the matrix as a one-parameter
/// [`ShardLayout`] held whole — its first moment (zeros without `beta1`), its factored statistics (a
/// matrix has no elementwise second moment) — and the step's update readied from the embeddings'
/// device's terms.
pub(super) struct CopyAdafactor {
    layout: ShardLayout,
    exp_avg: Vec<f32>,
    stats: Vec<f32>,
    prepared: Option<(Prepared, Vec<f32>)>,
}

impl TiedCopy {
    /// Bytes of the copy, of its gradient, and of its optimizer state (Adafactor's when it follows
    /// sharded owners).
    pub(super) fn bytes(&self) -> [u64; 3] {
        let (param, grad) = super::super::super::memory::tensor_and_grad_bytes(std::slice::from_ref(&self.param));
        let adafactor = self.adafactor.as_ref().map_or(0, |a| a.exp_avg.len() + a.stats.len());
        [param, grad, (4 * (self.optimizer.state_numel() + adafactor)) as u64]
    }
}

impl Tied {
    /// The role of `device` in `shape`'s pipeline for `config`'s model (None: untied, or neither end),
    /// the copy initialised to parameter 0's initial values; `sharded_adafactor` when the stages run
    /// Adafactor on ZeRO shards (the copy then follows them, [`CopyAdafactor`]).
    pub(super) fn of(
        config: &JobConfig,
        shape: PlanShape,
        device: usize,
        sharded_adafactor: bool,
    ) -> Result<Option<Self>, PipelineError> {
        if !config.model.head_takes_embedding() {
            return Ok(None);
        }
        let (embed, head) = (shape.device_of(0), shape.device_of(shape.chunks() - 1));
        if let Some(range) = tied_copy_range(&config.model, shape, device) {
            let values =
                initial_values(&config.model, config.train.seed, 0..1).map_err(|e| PipelineError::Train(e.into()))?;
            let spec = &param_specs(&config.model)[0];
            let param = Tensor::from_slice(&values[0]).view(spec.shape.as_slice()).set_requires_grad(true);
            materialise_grads(std::slice::from_ref(&param));
            let mut optimizer = Optimizer::new(&config.train, std::slice::from_ref(&param), vec![spec.decays()]);
            let adafactor = sharded_adafactor.then(|| {
                optimizer.clear_state(); // only its step counter is used
                let layout = ShardLayout::new(std::slice::from_ref(&spec.shape), &[spec.decays()]);
                let stats = vec![0.0; layout.stats_len()];
                CopyAdafactor { layout, exp_avg: vec![0.0; spec.numel()], stats, prepared: None }
            });
            return Ok(Some(Self::Head { embed, copy: TiedCopy { param, optimizer, range, adafactor } }));
        }
        Ok(match (device == embed, device == head) {
            (true, true) => Some(Self::Local),
            (true, false) => Some(Self::Embed { head }),
            _ => None,
        })
    }
}

impl<T: Transport> PipelineStage<T> {
    /// What the head multiplies by, appended to the last chunk's parameters (as
    /// [`troupe_model::model::head_params`] appends it): parameter 0 itself, or this device's copy.
    pub(super) fn tied_head_param(&self) -> Option<Tensor> {
        match self.tied.as_ref()? {
            Tied::Local => Some(self.params[self.embedding_local()].shallow_clone()),
            Tied::Head { copy, .. } => Some(copy.param.shallow_clone()),
            Tied::Embed { .. } => None,
        }
    }

    /// Parameter 0's position in the device's parameter list (the first chunk's first parameter).
    fn embedding_local(&self) -> usize {
        self.local_chunk(0).local.start
    }

    /// The copy's elements (0 without one).
    pub(super) fn tied_copy_elements(&self) -> usize {
        match &self.tied {
            Some(Tied::Head { copy, .. }) => copy.param.numel(),
            _ => 0,
        }
    }

    /// A detached copy of the head's device's copy of the matrix, if this device keeps one.
    pub fn tied_copy_value(&self) -> Option<Tensor> {
        match &self.tied {
            Some(Tied::Head { copy, .. }) => Some(copy.param.detach().copy()),
            _ => None,
        }
    }

    /// The copy's gradient reset with the parameters' at the start of a step.
    pub(super) fn zero_tied_grad(&mut self) {
        if let Some(Tied::Head { copy, .. }) = &mut self.tied {
            copy.param.zero_grad();
        }
    }

    /// After the ops, before the reduction among the stage's replicas: the head's device sends its copy's
    /// gradient to the embeddings' device, which adds it to parameter 0's.
    pub(super) async fn sum_tied_gradients(&mut self, step: u64) -> Result<(), PipelineError> {
        let device = self.device;
        let failed = |peer, source| PipelineError::Tied { device, peer, step, source };
        match &self.tied {
            Some(Tied::Head { embed, copy }) => {
                let (embed, grad) = (*embed, flat_of(&copy.param.grad()));
                self.comm.send(embed, &grad).await.map_err(|e| failed(embed, e))
            }
            Some(Tied::Embed { head }) => {
                let (head, local) = (*head, self.embedding_local());
                let mut grad = vec![0f32; self.params[local].numel()];
                self.comm.recv(head, &mut grad).await.map_err(|e| failed(head, e))?;
                let param = &self.params[local];
                let head_use = Tensor::from_slice(&grad).view_as(param);
                tch::no_grad(|| {
                    let _ = param.grad().g_add_(&head_use);
                });
                Ok(())
            }
            Some(Tied::Local) | None => Ok(()),
        }
    }

    /// After the reduction among the stage's replicas: the embeddings' device sends parameter 0's summed
    /// gradient (gathered from the replicas that own its parts, with ZeRO-2/3 inside the group) to the
    /// head's device, which takes it as its copy's.
    pub(super) async fn share_tied_gradient(&mut self, step: u64) -> Result<(), PipelineError> {
        let device = self.device;
        let failed = |peer, source| PipelineError::Tied { device, peer, step, source };
        match &self.tied {
            Some(Tied::Head { embed, copy }) => {
                let (embed, mut grad) = (*embed, vec![0f32; copy.param.numel()]);
                self.comm.recv(embed, &mut grad).await.map_err(|e| failed(embed, e))?;
                if let Some(Tied::Head { copy, .. }) = &self.tied {
                    copy_from_flat(&[copy.param.grad()], &grad);
                }
                Ok(())
            }
            Some(Tied::Embed { head }) => {
                let head = *head;
                let grad = self.reduced_embedding_gradient().await.map_err(|e| failed(head, e))?;
                self.comm.send(head, &grad).await.map_err(|e| failed(head, e))
            }
            Some(Tied::Local) | None => Ok(()),
        }
    }

    /// Parameter 0's gradient after the reduction among the stage's replicas, whole: the parameter's own
    /// (DDP, or no replicas), the all-reduced flat buffer's (ZeRO-1), or each owner's part broadcast in
    /// the group (ZeRO-2/3, a collective of the group).
    async fn reduced_embedding_gradient(&mut self) -> Result<Vec<f32>, troupe_cluster::ClusterError> {
        let local = self.embedding_local();
        let offset: usize = self.params[..local].iter().map(Tensor::numel).sum();
        let matrix = offset..offset + self.params[local].numel();
        let (Some(group), Some(shard)) = (&mut self.data_parallel, &self.shard) else {
            return Ok(flat_of(&self.params[local].grad()));
        };
        if shard.mode == ShardMode::Zero1 {
            return Ok(self.flat[matrix].to_vec());
        }
        let total: usize = self.ranges.iter().map(Range::len).sum();
        let (replica, replicas) = (group.comm.rank(), group.comm.world());
        let own = shard.own();
        let mut grad = vec![0f32; matrix.len()];
        for owner in 0..replicas {
            let owned = chunk_range(total, replicas, owner);
            let (start, end) = (owned.start.max(matrix.start), owned.end.min(matrix.end));
            if start >= end {
                continue;
            }
            let part = &mut grad[start - offset..end - offset];
            if owner == replica {
                part.copy_from_slice(&own.grad[start - own.range.start..end - own.range.start]);
            }
            group.comm.broadcast(part, owner).await?;
        }
        Ok(grad)
    }

    /// Adafactor under ZeRO, once the flush readied the step's update (`readied`: None when the step will
    /// be skipped — on every device alike): the embeddings' device sends the head's device the matrix's
    /// terms its group reduced (Σ master², the row and column sums of g², Σ update²), and the head's
    /// device readies its copy's update from them with the same coefficients.
    pub(super) async fn share_tied_adafactor(
        &mut self,
        step: u64,
        readied: Option<Readied>,
    ) -> Result<(), PipelineError> {
        let Some(Readied { sums, grad_factor, lr, t }) = readied else { return Ok(()) };
        let device = self.device;
        let failed = |peer, source| PipelineError::Tied { device, peer, step, source };
        match &mut self.tied {
            Some(Tied::Embed { head }) => {
                let (head, local) = (*head, self.embedding_local());
                let Some(a) = self.shard.as_ref().and_then(|s| s.adafactor.as_ref()) else { return Ok(()) };
                let Some((_, update_sq)) = &a.prepared else { return Ok(()) };
                let stats = a.layout.stats_of(local);
                let p = a.layout.param_count();
                let mut terms = vec![sums[local]];
                terms.extend_from_slice(&sums[p + stats.start..p + stats.end]);
                terms.push(update_sq[local]);
                self.comm.send(head, &terms).await.map_err(|e| failed(head, e))
            }
            Some(Tied::Head { embed, copy }) => {
                let embed = *embed;
                let Some(a) = copy.adafactor.as_mut() else { return Ok(()) };
                let mut terms = vec![0f32; 2 + a.layout.stats_len()];
                self.comm.recv(embed, &mut terms).await.map_err(|e| failed(embed, e))?;
                let update_sq = vec![terms.pop().expect("Σ update²")];
                let config = &self.config.train.adafactor;
                let prepared = Prepared::new(&a.layout, config, &a.stats, &terms, grad_factor, lr, t);
                a.prepared = Some((prepared, update_sq));
                Ok(())
            }
            Some(Tied::Local) | None => Ok(()),
        }
    }

    /// The copy's optimizer update, the step's `t`-th, with the gradient multiplied by `grad_factor` the way
    /// the embeddings' device multiplies parameter 0's (the flat f32 product with ZeRO inside the groups,
    /// libtorch's otherwise) and the same fused kernel: the same bits as parameter 0.
    pub(super) fn apply_tied_copy(&mut self, grad_factor: f64, lr: f64, t: u64) {
        let sharded = self.shard.is_some();
        let Some(Tied::Head { copy, .. }) = &mut self.tied else { return };
        if let Some(a) = copy.adafactor.as_mut() {
            // As the owners apply the matrix's ranges: the factor inside the readied update.
            let (prepared, update_sq) = a.prepared.take().expect("the flush readied the copy's update");
            let (mut master, grad) = (flat_of(&copy.param.detach()), flat_of(&copy.param.grad()));
            let whole = 0..master.len();
            let slots = ShardSlots { master: &mut master, exp_avg: &mut a.exp_avg, compact: &mut [], grad: &grad };
            prepared.apply(&a.layout, &whole, slots, &update_sq);
            copy_from_flat(std::slice::from_ref(&copy.param), &master);
            a.stats = prepared.stats;
            copy.optimizer.set_step(t);
            return;
        }
        if grad_factor != 1.0 {
            if sharded {
                let grad = copy.param.grad();
                let factor = grad_factor as f32;
                let scaled: Vec<f32> = flat_of(&grad).into_iter().map(|g| g * factor).collect();
                copy_from_flat(&[grad], &scaled);
            } else {
                scale_grads(std::slice::from_ref(&copy.param), grad_factor);
            }
        }
        copy.optimizer.set_step(t - 1);
        copy.optimizer.apply(std::slice::from_mut(&mut copy.param), lr);
    }

    /// The copy as one more piece of the flat state (after the device's own).
    pub(super) fn tied_copy_piece(&self) -> Option<ShardPiece> {
        let Some(Tied::Head { copy, .. }) = &self.tied else { return None };
        let mut piece = ShardPiece::zeros(0..0);
        append_flat(&[copy.param.detach()], &mut piece.master);
        if let Some(a) = &copy.adafactor {
            let whole = 0..piece.master.len();
            piece.exp_avg.clone_from(&a.exp_avg);
            piece.exp_avg_sq = a.layout.expand(&whole, &[], &a.stats);
        } else {
            let [first, second] = copy.optimizer.packed(0, &copy.param.detach());
            append_flat(&[first], &mut piece.exp_avg);
            append_flat(&[second], &mut piece.exp_avg_sq);
        }
        piece.range = copy.range.clone();
        Some(piece)
    }

    /// Loads the copy from the piece of `pieces` that holds its range: parameter 0's values and moments.
    pub(super) fn load_tied_copy(&mut self, pieces: &[ShardPiece]) {
        let Some(Tied::Head { copy, .. }) = &mut self.tied else { return };
        let range = copy.range.clone();
        let piece = pieces
            .iter()
            .find(|p| p.range.start <= range.start && range.end <= p.range.end)
            .expect("load_state: a piece holds the tied embedding matrix the head's device copies");
        let n = range.len();
        let (mut master, mut exp_avg, mut exp_avg_sq) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        piece.read(&range, [&mut master, &mut exp_avg, &mut exp_avg_sq]);
        copy_from_flat(std::slice::from_ref(&copy.param), &master);
        if let Some(a) = copy.adafactor.as_mut() {
            // The whole matrix: its statistics complete, its first moment as it is.
            a.layout.import_stats(&(0..n), &exp_avg_sq, &mut a.stats);
            a.exp_avg = exp_avg;
            a.prepared = None;
            return;
        }
        let slot = |flat: &[f32]| Tensor::from_slice(flat).view_as(&copy.param);
        let slots = [slot(&exp_avg), slot(&exp_avg_sq)];
        copy.optimizer.unpack(0, slots);
    }
}

/// A tensor's values, flat.
fn flat_of(tensor: &Tensor) -> Vec<f32> {
    let tensor = tensor.to_kind(Kind::Float).contiguous();
    let mut out = Vec::new();
    append_flat(&[tensor], &mut out);
    out
}

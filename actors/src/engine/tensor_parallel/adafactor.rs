//! Adafactor under tensor parallelism (× data parallelism): each rank updates its own shards and its
//! buddy copy with the sharded Adafactor of ZeRO's owners (`troupe_model::optim::adafactor_shard`),
//! its elements of a parameter being the shard's positions in the whole parameter (a block of rows
//! under a column-parallel cut, of columns under a row-parallel one, a padded vocabulary range) rather
//! than a flat range.
//!
//! - Every rank of the tensor group keeps the factored statistics of every matrix whole (replicated,
//!   `R + C` values per `R × C` matrix) and advances them identically.
//! - Before the vote, once the global norm is known: the row and column sums of the squared gradient
//!   and each parameter's Σ master² are all-reduced over the tensor group (each rank's terms of its
//!   shard; a parameter several ranks hold — a replicated one, a replicated key/value head — counted by
//!   its first holder only), then each parameter's Σ update² (update clipping). The update itself is
//!   local to each rank.
//! - Checkpoints and the state between attempts stay layout-free: a rank's shard of Adafactor's two
//!   packed slots (first moment; `row`, `col` packed, zeros) is cut and gathered as AdamW's moments are.
//! - With ZeRO inside the data-parallel groups ([`ZeroAdafactor`], which [`super::zero::Zero`] holds):
//!   replica d owns range d of its tensor rank's flat shard list ([`Held::within`]: each parameter's
//!   runs cut to the range, so a matrix's rows and columns may be split between owners); the sums and
//!   each parameter's Σ update² are all-reduced over the data-parallel group, then the tensor group,
//!   and each owner updates its range's masters, first moment and vectors' second moment. The
//!   statistics stay whole and replicated on every rank of both groups.

use std::ops::Range;
use tch::Tensor;
use troupe_cluster::collective::ReduceOp;
use troupe_cluster::transport::Transport;

use tokio::runtime::Handle;
use troupe_model::optim::adafactor_shard::{Held, Prepared, ShardLayout, ShardSlots};
use troupe_model::optim::Adafactor;
use troupe_model::precision::{LossScale, Precision, Update};
use troupe_model::sections::AdafactorConfig;
use troupe_model::tensor_parallel::TpLayout;

use super::super::flat::{append_flat, copy_from_flat};
use super::group::CommGroup;
use super::meter::Metered;

/// One shard's Adafactor state (the rank's own, or its buddy copy of the previous rank's; under ZeRO a
/// replica's owned range of its rank's shard).
struct ShardState {
    held: Held,
    /// Per parameter: whether this rank's terms enter the group's sums (it is the shard's first holder).
    counted: Vec<bool>,
    /// The first moment, flat over the shard (empty without `beta1`).
    exp_avg: Vec<f32>,
    /// The vectors' elementwise second moment.
    compact: Vec<f32>,
}

impl ShardState {
    /// Tensor rank `rank`'s shard of the whole packed slots `slots` (with `own`, that range of its flat
    /// shard list).
    fn cut(
        (layout, beta1): (&ShardLayout, bool),
        tp: &TpLayout,
        (rank, held): (usize, &[bool]),
        slots: &[Vec<Tensor>; 2],
        own: Option<&Range<usize>>,
    ) -> Self {
        let shard = |list: &[Tensor]| {
            let mut flat = Vec::new();
            append_flat(&tp.shard_held(list, rank, held), &mut flat);
            match own {
                Some(own) => flat[own.clone()].to_vec(),
                None => flat,
            }
        };
        let mut state = Held::new(layout, tp.held_runs(rank, held));
        if let Some(own) = own {
            state = state.within(layout, own);
        }
        let second = shard(&slots[1]);
        let compact = (0..held.len())
            .filter(|&i| !layout.is_factored(i))
            .flat_map(|i| second[state.range_of(i)].to_vec())
            .collect();
        Self {
            counted: (0..held.len()).map(|i| held[i] && tp.first_holder(i, rank)).collect(),
            exp_avg: if beta1 { shard(&slots[0]) } else { Vec::new() },
            compact,
            held: state,
        }
    }

    fn bytes(&self) -> u64 {
        4 * (self.exp_avg.len() + self.compact.len()) as u64
    }
}

/// The loss scaler's verdict and the schedule's rate of the step being reduced, to ready its update
/// before the vote (every rank sees the same norm, so every rank previews the same verdict).
#[derive(Clone, Copy, Debug)]
pub(super) struct Preview {
    pub scaler: LossScale,
    pub precision: Precision,
    pub grad_clip: f64,
    pub window: u64,
    pub lr: f64,
}

impl Preview {
    /// The factor the step's gradients take (unscaling and clipping) if the loss scaler applies it;
    /// None when it will skip the step (fp16 overflow).
    fn grad_factor(self, grad_norm: f64) -> Option<f64> {
        let Preview { mut scaler, precision, grad_clip, window, .. } = self;
        match scaler.conclude(precision, grad_norm, grad_clip, window) {
            Update::Apply { grad_factor, .. } => Some(grad_factor),
            _ => None,
        }
    }
}

/// A tensor rank's Adafactor: its shard's state and its buddy copy's, the replicated statistics, and
/// the step readied before the vote.
pub(super) struct TpAdafactor {
    layout: ShardLayout,
    config: AdafactorConfig,
    stats: Vec<f32>,
    own: ShardState,
    buddy: Option<ShardState>,
    /// The readied step: its per-matrix quantities and each parameter's reduced Σ update².
    prepared: Option<(Prepared, Vec<f32>)>,
}

/// A shard's values flat, its gradients flat (zeros where none) and which parameters have one.
fn flat_of(params: &[Tensor]) -> (Vec<f32>, Vec<f32>, Vec<bool>) {
    let mut master = Vec::new();
    append_flat(params, &mut master);
    let grads: Vec<Tensor> =
        params.iter().map(|p| if p.grad().defined() { p.grad() } else { p.detach().zeros_like() }).collect();
    let mut grad = Vec::new();
    append_flat(&grads, &mut grad);
    (master, grad, params.iter().map(|p| p.grad().defined()).collect())
}

impl TpAdafactor {
    /// Tensor rank `rank`'s Adafactor (of the parameters `held`) from the whole state `whole` of the
    /// parameters `full`, with a buddy copy of tensor rank `buddy`'s shard.
    pub fn new(
        whole: &Adafactor,
        full: &[Tensor],
        decays: &[bool],
        tp: &TpLayout,
        rank: usize,
        held: &[bool],
        buddy: Option<usize>,
    ) -> Self {
        let Whole { layout, slots, stats } = Whole::of(whole, full, decays);
        let beta1 = whole.config.beta1.is_some();
        let own = ShardState::cut((&layout, beta1), tp, (rank, held), &slots, None);
        let buddy = buddy.map(|index| ShardState::cut((&layout, beta1), tp, (index, held), &slots, None));
        Self { config: whole.config.clone(), layout, stats, own, buddy, prepared: None }
    }

    /// Bytes of optimizer state: the own shard's and the replicated statistics; the buddy copy's.
    pub fn bytes(&self) -> (u64, u64) {
        (self.own.bytes() + 4 * self.stats.len() as u64, self.buddy.as_ref().map_or(0, ShardState::bytes))
    }

    /// Readies the step before the vote, from the rank's shards `params` (their gradients summed over
    /// the data-parallel group) and the global norm: the loss scaler's verdict previewed, the sums
    /// all-reduced over the tensor group, the statistics advanced, each parameter's Σ update²
    /// all-reduced. Nothing when the step will be skipped (fp16 overflow).
    pub fn prepare<T: Transport>(
        &mut self,
        params: &[Tensor],
        tp: &mut CommGroup<T>,
        preview: Preview,
        grad_norm: f64,
        t: u64,
    ) -> Result<(), String> {
        self.prepared = None;
        let (Some(grad_factor), lr) = (preview.grad_factor(grad_norm), preview.lr) else { return Ok(()) };
        let (master, grad, active) = flat_of(params);
        let select: Vec<bool> = self.own.counted.iter().zip(&active).map(|(&c, &a)| c && a).collect();
        let mut sums = self.layout.partial_sums_held(&self.own.held, &select, &master, &grad);
        let handle = tp.handle.clone();
        handle.block_on(tp.comm.all_reduce(&mut sums[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
        let mut prepared = Prepared::new(&self.layout, &self.config, &self.stats, &sums, grad_factor as f32, lr, t);
        // A parameter without a gradient (on every rank alike) keeps its statistics, as the whole-tensor
        // Adafactor leaves it alone.
        for index in (0..active.len()).filter(|&i| !active[i]) {
            prepared.keep_stats(&self.layout, index, &self.stats);
        }
        let mut update_sq =
            prepared.partial_update_sq_held(&self.layout, &self.own.held, &select, &grad, &self.own.compact);
        handle.block_on(tp.comm.all_reduce(&mut update_sq[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
        self.prepared = Some((prepared, update_sq));
        Ok(())
    }

    /// Applies the readied step to the rank's shards and to its buddy copy (the same bits its owner
    /// applies); nothing when none was readied (a skipped step).
    pub fn apply(&mut self, params: &mut [Tensor], buddy: Option<&mut [Tensor]>) {
        let Some((prepared, update_sq)) = self.prepared.take() else { return };
        let layout = &self.layout;
        let update = |state: &mut ShardState, params: &mut [Tensor]| {
            let (mut master, grad, active) = flat_of(params);
            let slots = ShardSlots {
                master: &mut master,
                exp_avg: &mut state.exp_avg,
                compact: &mut state.compact,
                grad: &grad,
            };
            prepared.apply_held(layout, &state.held, &active, slots, &update_sq);
            copy_from_flat(params, &master);
        };
        update(&mut self.own, params);
        if let (Some(state), Some(params)) = (self.buddy.as_mut(), buddy) {
            update(state, params);
        }
        self.stats = prepared.stats;
    }

    /// The shard's state as three lists shaped like `params` (its own, or with `buddy` its copy's):
    /// the parameters (detached), the first moment (zeros without `beta1`) and the packed second slot,
    /// which the tensor group's gather puts together as the whole-tensor Adafactor packs them.
    pub fn lists(&self, buddy: bool, params: &[Tensor]) -> [Vec<Tensor>; 3] {
        let state = if buddy { self.buddy.as_ref().expect("a buddy copy") } else { &self.own };
        let shaped = |values: Vec<f32>, p: &Tensor| Tensor::from_slice(&values).view(p.size().as_slice());
        let first = params
            .iter()
            .enumerate()
            .map(|(i, p)| match state.exp_avg.is_empty() {
                true => p.detach().zeros_like(),
                false => shaped(state.exp_avg[state.held.range_of(i)].to_vec(), p),
            })
            .collect();
        let second = params
            .iter()
            .enumerate()
            .map(|(i, p)| shaped(state.held.slot1_of(&self.layout, i, &state.compact, &self.stats), p))
            .collect();
        [params.iter().map(Tensor::detach).collect(), first, second]
    }
}

/// The whole-tensor Adafactor's state laid out for shards: the layout, its two packed slots (as
/// checkpoints hold them) and the statistics of every matrix.
struct Whole {
    layout: ShardLayout,
    slots: [Vec<Tensor>; 2],
    stats: Vec<f32>,
}

impl Whole {
    fn of(whole: &Adafactor, full: &[Tensor], decays: &[bool]) -> Self {
        let shapes: Vec<Vec<i64>> = full.iter().map(Tensor::size).collect();
        let layout = ShardLayout::new(&shapes, decays);
        let packed: Vec<[Tensor; 2]> = full.iter().enumerate().map(|(i, p)| whole.packed(i, p)).collect();
        let slots = [0, 1].map(|k| packed.iter().map(|s| s[k].shallow_clone()).collect::<Vec<_>>());
        let mut second = Vec::new();
        append_flat(&slots[1], &mut second);
        let mut stats = vec![0.0; layout.stats_len()];
        layout.import_stats(&(0..second.len()), &second, &mut stats);
        Self { layout, slots, stats }
    }
}

/// Adafactor on a ZeRO owner's range of its tensor rank's flat shard list (see the module's notes): the
/// range's first moment and vectors' second moment, the replicated statistics, and the step readied
/// before the vote. The masters and the reduced gradient of the range are [`super::zero::Zero`]'s.
pub(super) struct ZeroAdafactor {
    layout: ShardLayout,
    config: AdafactorConfig,
    stats: Vec<f32>,
    /// The owned elements of each parameter (positions in the whole parameter) and their state.
    state: ShardState,
    /// The readied step, each parameter's reduced Σ update², and which parameters had a gradient.
    prepared: Option<(Prepared, Vec<f32>, Vec<bool>)>,
}

impl ZeroAdafactor {
    /// Tensor rank `rank`'s owner of `own` (of its flat shard list of the parameters `held`), from the
    /// whole state `whole` of the parameters `full`.
    pub fn new(
        whole: &Adafactor,
        (full, decays): (&[Tensor], &[bool]),
        tp: &TpLayout,
        rank: usize,
        held: &[bool],
        own: &Range<usize>,
    ) -> Self {
        let Whole { layout, slots, stats } = Whole::of(whole, full, decays);
        let beta1 = whole.config.beta1.is_some();
        let state = ShardState::cut((&layout, beta1), tp, (rank, held), &slots, Some(own));
        Self { config: whole.config.clone(), state, layout, stats, prepared: None }
    }

    /// Bytes of optimizer state besides the masters: the range's moments and the replicated statistics.
    pub fn bytes(&self) -> u64 {
        self.state.bytes() + 4 * self.stats.len() as u64
    }

    /// Readies the step before the vote from the range's masters and reduced gradient and the global
    /// norm (as [`TpAdafactor::prepare`], the sums over the data-parallel group first); `active`: the
    /// parameters with a gradient. Nothing when the step will be skipped (fp16 overflow).
    #[allow(clippy::too_many_arguments)]
    pub fn prepare<T: Transport>(
        &mut self,
        (master, grad): (&[f32], &[f32]),
        active: Vec<bool>,
        dp: &mut Metered<T>,
        tp: &mut Metered<T>,
        handle: &Handle,
        (preview, grad_norm): (Preview, f64),
        t: u64,
    ) -> Result<(), String> {
        self.prepared = None;
        let (Some(grad_factor), lr) = (preview.grad_factor(grad_norm), preview.lr) else { return Ok(()) };
        let mut sum = |values: &mut Vec<f32>| -> Result<(), String> {
            handle.block_on(dp.all_reduce(&mut values[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
            handle.block_on(tp.all_reduce(&mut values[..], ReduceOp::Sum)).map_err(|e| e.to_string())
        };
        let state = &self.state;
        let select: Vec<bool> = state.counted.iter().zip(&active).map(|(&c, &a)| c && a).collect();
        let mut sums = self.layout.partial_sums_held(&state.held, &select, master, grad);
        sum(&mut sums)?;
        let mut prepared = Prepared::new(&self.layout, &self.config, &self.stats, &sums, grad_factor as f32, lr, t);
        for index in (0..active.len()).filter(|&i| !active[i]) {
            prepared.keep_stats(&self.layout, index, &self.stats);
        }
        let mut update_sq = prepared.partial_update_sq_held(&self.layout, &state.held, &select, grad, &state.compact);
        sum(&mut update_sq)?;
        self.prepared = Some((prepared, update_sq, active));
        Ok(())
    }

    /// Applies the readied step to the range's masters with its gradient (the factor applied inside);
    /// nothing when none was readied.
    pub fn apply(&mut self, master: &mut [f32], grad: &[f32]) {
        let Some((prepared, update_sq, active)) = self.prepared.take() else { return };
        let state = &mut self.state;
        let slots = ShardSlots { master, exp_avg: &mut state.exp_avg, compact: &mut state.compact, grad };
        prepared.apply_held(&self.layout, &state.held, &active, slots, &update_sq);
        self.stats = prepared.stats;
    }

    /// The range's two packed slots, flat (the first moment, zeros without `beta1`; the second slot at the
    /// owned positions), for the data-parallel group's gather.
    pub fn slots(&self) -> [Vec<f32>; 2] {
        let state = &self.state;
        let first = match state.exp_avg.is_empty() {
            true => vec![0.0; state.held.len()],
            false => state.exp_avg.clone(),
        };
        let second = (0..state.counted.len())
            .flat_map(|i| state.held.slot1_of(&self.layout, i, &state.compact, &self.stats))
            .collect();
        [first, second]
    }
}

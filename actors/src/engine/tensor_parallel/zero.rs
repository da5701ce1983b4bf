//! ZeRO inside the data-parallel groups of a tensor-parallel job (`parallel.shard` with `tp` > 1 and more
//! than one model replica): the D ranks that hold the same shards (one tensor index of one stage, over
//! the replicas) split the flat list of those shards with `chunk_range`; replica d owns range d — the
//! fp32 masters and both AdamW moments of it, or Adafactor's state of it ([`ZeroAdafactor`]) — and
//! applies the optimizer there only. ZeRO-1 all-reduces the
//! gradients and keeps its range of them, ZeRO-2 reduce-scatters them; both all-gather the masters into
//! the parameters before the next forward. ZeRO-3 also drops the parameters after each update (the shard
//! list is the one unit: gathered for the step, none between). The global norm is the owned ranges'
//! squares summed over the data-parallel group, then the tensor group (and a pipeline's stages).
//!
//! No replica holds the whole state: the end of an attempt (and a checkpoint or an evaluation) first
//! all-gathers the moments (and the masters) over the data-parallel group, then gathers the tensor
//! group as without ZeRO. A lost rank takes its ranges with it: the job resumes from the checkpoint.

use std::ops::Range;

use tch::Tensor;
use tokio::runtime::Handle;
use troupe_cluster::collective::{chunk_range, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_model::config::TrainConfig;
use troupe_model::tensor_parallel::{Split, TpLayout, TpRank};

use super::super::flat::{append_flat, copy_from_flat};
use super::super::segments::{adamw_on_segments, plan_segments, ShardSegment};
use super::super::shard_plan::ShardMode;
use super::adafactor::{Preview, ZeroAdafactor};
use super::meter::Metered;

fn comm_error(e: troupe_cluster::ClusterError) -> String {
    e.to_string()
}

/// This rank's owned range of its shard list and what it keeps of it.
pub(super) struct Zero {
    pub mode: ShardMode,
    /// The owned range of the flat shard list (the rank's parameters in order, each flattened).
    own: Range<usize>,
    total: usize,
    segments: Vec<ShardSegment>,
    master: Vec<f32>,
    /// AdamW's moments of the range (empty with Adafactor).
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// `train.optimizer = "adafactor"`: its state of the range.
    adafactor: Option<ZeroAdafactor>,
    /// The step's reduced gradient of the owned range.
    grad: Vec<f32>,
    /// The parameters' shapes (empty for those the rank does not hold), to rebuild them under ZeRO-3.
    shapes: Vec<Vec<i64>>,
    /// The parameters lag the masters (an update since the last gather, or ZeRO-3 released them).
    stale: bool,
}

impl Zero {
    /// Replica `replica` of `replicas`' range of `params` (the rank's shards) with the AdamW moments
    /// `exp_avg` / `exp_avg_sq` of the same shapes (empty lists with Adafactor: see
    /// [`Self::with_adafactor`]); `decays` by parameter.
    pub fn new(
        mode: ShardMode,
        (replica, replicas): (usize, usize),
        params: &[Tensor],
        moments: [&[Tensor]; 2],
        decays: &[bool],
    ) -> Self {
        let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
        let total = numels.iter().sum();
        let own = chunk_range(total, replicas, replica);
        let segments = plan_segments(&numels, decays, &own);
        let range = |list: &[Tensor]| {
            if list.is_empty() {
                return Vec::new();
            }
            let mut flat = Vec::with_capacity(total);
            append_flat(&list.iter().map(Tensor::detach).collect::<Vec<_>>(), &mut flat);
            flat[own.clone()].to_vec()
        };
        let [exp_avg, exp_avg_sq] = moments.map(range);
        Self {
            mode,
            master: range(params),
            exp_avg,
            exp_avg_sq,
            adafactor: None,
            grad: vec![0.0; own.len()],
            shapes: params.iter().map(Tensor::size).collect(),
            segments,
            own,
            total,
            stale: false,
        }
    }

    /// The owner running Adafactor on its range, its state made by `make` from the range.
    pub fn with_adafactor(mut self, make: impl FnOnce(&Range<usize>) -> ZeroAdafactor) -> Self {
        self.adafactor = Some(make(&self.own));
        self
    }

    /// (elements owned, of the rank's shard list).
    pub fn owned(&self) -> (usize, usize) {
        (self.own.len(), self.total)
    }

    /// Bytes it keeps beside the rank's shards: (the owned range's reduced gradient, its fp32 masters and
    /// the optimizer's state).
    pub fn held_bytes(&self) -> (u64, u64) {
        let bytes = |v: &Vec<f32>| (v.len() * std::mem::size_of::<f32>()) as u64;
        let state =
            bytes(&self.exp_avg) + bytes(&self.exp_avg_sq) + self.adafactor.as_ref().map_or(0, ZeroAdafactor::bytes);
        (bytes(&self.grad), bytes(&self.master) + state)
    }

    /// With Adafactor, readies its step before the vote from the reduced range and the global norm
    /// (`active`: the parameters with a gradient); nothing with AdamW.
    pub fn prepare<T: Transport>(
        &mut self,
        active: Vec<bool>,
        [dp, tp]: [&mut Metered<T>; 2],
        handle: &Handle,
        preview: (Preview, f64),
        t: u64,
    ) -> Result<(), String> {
        match self.adafactor.as_mut() {
            Some(adafactor) => adafactor.prepare((&self.master, &self.grad), active, dp, tp, handle, preview, t),
            None => Ok(()),
        }
    }

    /// Before a forward (or a gather of the state): the group's masters all-gathered into the rank's
    /// parameters when they lag (fresh leaves requiring grad under ZeRO-3, which dropped them).
    pub fn refresh<T: Transport>(
        &mut self,
        rank: &mut TpRank,
        dp: &mut Metered<T>,
        handle: &Handle,
    ) -> Result<(), String> {
        if !self.stale {
            return Ok(());
        }
        let mut flat = vec![0.0f32; self.total];
        handle.block_on(dp.all_gather(&self.master[..], &mut flat[..])).map_err(comm_error)?;
        let mut at = 0;
        for (param, shape) in rank.params_mut().iter_mut().zip(&self.shapes) {
            let n = shape.iter().product::<i64>() as usize;
            if self.mode == ShardMode::Zero3 {
                *param = Tensor::from_slice(&flat[at..at + n]).view(shape.as_slice()).set_requires_grad(true);
            } else {
                copy_from_flat(std::slice::from_ref(param), &flat[at..at + n]);
            }
            at += n;
        }
        self.stale = false;
        Ok(())
    }

    /// The step's gradients (`flat`, the rank's whole shard list) reduced over the group into the owned
    /// range: all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2/3).
    pub fn reduce<T: Transport>(
        &mut self,
        mut flat: Vec<f32>,
        dp: &mut Metered<T>,
        handle: &Handle,
    ) -> Result<(), String> {
        match self.mode {
            ShardMode::Zero1 => {
                handle.block_on(dp.all_reduce(&mut flat[..], ReduceOp::Sum)).map_err(comm_error)?;
                self.grad.copy_from_slice(&flat[self.own.clone()]);
            }
            ShardMode::Zero2 | ShardMode::Zero3 => {
                handle.block_on(dp.reduce_scatter(&flat[..], &mut self.grad[..], ReduceOp::Sum)).map_err(comm_error)?;
            }
        }
        Ok(())
    }

    /// The owned range's squared gradient: [of split parameters, each element divided by how many ranks
    /// of the tensor group hold it; of replicated ones, when `replicated` (tensor rank 0)]; parameters
    /// outside `counted` (a tied head's copy of the embedding matrix) left out.
    pub fn squares(&self, layout: &TpLayout, counted: &[bool], replicated: bool) -> [f64; 2] {
        let mut sums = [0.0f64; 2];
        for segment in &self.segments {
            let split = layout.splits[segment.param];
            if !counted[segment.param] || (split == Split::Replicated && !replicated) {
                continue;
            }
            let sum: f64 = self.grad[segment.in_shard.clone()].iter().map(|&g| f64::from(g) * f64::from(g)).sum();
            match split {
                Split::Replicated => sums[1] += sum,
                _ => sums[0] += sum / layout.holders(split) as f64,
            }
        }
        sums
    }

    /// AdamW update `t` at `lr` on the owned range, its gradient scaled by `grad_factor` (the clip), or
    /// Adafactor's step readied by [`Self::prepare`] (the factor inside it); the parameters lag until the
    /// next [`Self::refresh`]; ZeRO-3 drops them now.
    pub fn apply(&mut self, rank: &mut TpRank, train: &TrainConfig, lr: f64, t: u64, grad_factor: f64) {
        if let Some(adafactor) = self.adafactor.as_mut() {
            adafactor.apply(&mut self.master, &self.grad);
        } else {
            if grad_factor != 1.0 {
                self.grad.iter_mut().for_each(|g| *g = (f64::from(*g) * grad_factor) as f32);
            }
            let state = [&mut self.master, &mut self.exp_avg, &mut self.exp_avg_sq];
            adamw_on_segments(state, &self.segments, &self.grad, train, lr, t);
        }
        self.stale = true;
        if self.mode == ShardMode::Zero3 {
            for param in rank.params_mut() {
                *param = Tensor::zeros([0], tch::kind::FLOAT_CPU).set_requires_grad(true);
            }
        }
    }

    /// The optimizer's two slots of the rank's shard list (AdamW's exp_avg and exp_avg_sq, or
    /// Adafactor's packed ones, as tensors of the parameters' shapes), all-gathered over the group.
    pub fn gather_moments<T: Transport>(
        &self,
        dp: &mut Metered<T>,
        handle: &Handle,
    ) -> Result<[Vec<Tensor>; 2], String> {
        let slots = match &self.adafactor {
            Some(adafactor) => adafactor.slots(),
            None => [self.exp_avg.clone(), self.exp_avg_sq.clone()],
        };
        let mut out = [Vec::new(), Vec::new()];
        for (moment, list) in slots.iter().zip(out.iter_mut()) {
            let mut flat = vec![0.0f32; self.total];
            handle.block_on(dp.all_gather(&moment[..], &mut flat[..])).map_err(comm_error)?;
            let mut at = 0;
            for shape in &self.shapes {
                let n = shape.iter().product::<i64>() as usize;
                list.push(Tensor::from_slice(&flat[at..at + n]).view(shape.as_slice()));
                at += n;
            }
        }
        Ok(out)
    }
}

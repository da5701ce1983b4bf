//! ZeRO-1 and ZeRO-2 as message flows: every rank holds the model for compute, but the fp32 master
//! parameters and AdamW moments are split into contiguous shards of the flat parameter vector, one per
//! rank (the shard-owner's state), updated by the fused AdamW kernel of troupe-kernels.
//!
//! A step: each rank accumulates the gradient of its slice of the batch (as in DDP); the flat gradient is
//! summed — all-reduced (ZeRO-1) or reduce-scattered so each rank receives only its shard (ZeRO-2); the
//! global gradient norm is the sum of the shards' squared norms; each rank clips and updates its shard;
//! an all-gather returns the updated parameters to every replica. Same samples, weights, clipping and
//! AdamW as the reference, so the oracle holds (DESIGN.md §4).

use std::ops::Range;

use tch::Tensor;
use troupe_cluster::collective::{chunk_range, Collective, Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_kernels::adamw::{adamw_step, AdamWConfig, AdamWShard};
use troupe_model::data::rank_slice;
use troupe_model::optim::learning_rate;
use troupe_model::{StepReport, Trainer};

use super::data_parallel::{broadcast_params, materialise_grads};
use super::flat::{append_flat, copy_from_flat};

/// What is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardMode {
    /// Optimizer state sharded; gradients all-reduced in full.
    Zero1,
    /// Optimizer state and gradients sharded (gradients reduce-scattered).
    Zero2,
}

/// The part of one parameter that falls in this rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSegment {
    pub param: usize,
    /// Positions within this rank's shard.
    pub in_shard: Range<usize>,
    pub decays: bool,
}

/// This rank's shard of the flat parameter vector and the parameter pieces it covers.
pub fn plan_shard(numels: &[usize], decays: &[bool], rank: usize, world: usize) -> (Range<usize>, Vec<ShardSegment>) {
    let total = numels.iter().sum();
    let own = chunk_range(total, world, rank);
    let mut segments = Vec::new();
    let mut offset = 0;
    for (param, (&n, &decays)) in numels.iter().zip(decays).enumerate() {
        let (start, end) = (offset.max(own.start), (offset + n).min(own.end));
        if start < end {
            segments.push(ShardSegment { param, in_shard: start - own.start..end - own.start, decays });
        }
        offset += n;
    }
    (own, segments)
}

/// One rank of a ZeRO-1/2 job.
pub struct ShardedReplica<T: Transport> {
    trainer: Trainer,
    comm: Communicator<T>,
    mode: ShardMode,
    own: Range<usize>,
    segments: Vec<ShardSegment>,
    master: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grad_shard: Vec<f32>,
    flat: Vec<f32>,
}

impl<T: Transport> ShardedReplica<T> {
    pub async fn new(trainer: Trainer, comm: Communicator<T>, mode: ShardMode) -> Result<Self, ClusterError> {
        let numels: Vec<usize> = trainer.model.params().iter().map(Tensor::numel).collect();
        let decays: Vec<bool> = trainer.model.specs().iter().map(|s| s.decays()).collect();
        let (own, segments) = plan_shard(&numels, &decays, comm.rank(), comm.world());
        let total: usize = numels.iter().sum();
        let mut replica = Self {
            trainer,
            comm,
            mode,
            master: Vec::new(),
            exp_avg: vec![0.0; own.len()],
            exp_avg_sq: vec![0.0; own.len()],
            grad_shard: vec![0.0; own.len()],
            flat: Vec::with_capacity(total),
            own,
            segments,
        };
        materialise_grads(&replica.trainer);
        broadcast_params(&replica.trainer, &mut replica.comm, &mut replica.flat).await?;
        replica.flat.clear();
        let params: Vec<Tensor> = replica.trainer.model.params().iter().map(Tensor::detach).collect();
        append_flat(&params, &mut replica.flat);
        replica.master = replica.flat[replica.own.clone()].to_vec();
        Ok(replica)
    }

    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// Elements of optimizer state (master params + two moments) this rank holds.
    pub fn optimizer_state_elements(&self) -> usize {
        self.master.len() + self.exp_avg.len() + self.exp_avg_sq.len()
    }

    pub async fn train_step(&mut self) -> Result<StepReport, ClusterError> {
        let step = self.trainer.step;
        let train = self.trainer.config.train.clone();
        let slice = rank_slice(train.global_batch, self.comm.rank(), self.comm.world());
        let local_loss = self.trainer.accumulate_slice(step, slice);

        let grads: Vec<Tensor> = self.trainer.model.params().iter().map(Tensor::grad).collect();
        self.flat.clear();
        append_flat(&grads, &mut self.flat);
        match self.mode {
            ShardMode::Zero1 => {
                self.comm.all_reduce(&mut self.flat[..], ReduceOp::Sum).await?;
                self.grad_shard.copy_from_slice(&self.flat[self.own.clone()]);
            }
            ShardMode::Zero2 => self.comm.reduce_scatter(&self.flat, &mut self.grad_shard, ReduceOp::Sum).await?,
        }
        let local_sum_sq: f64 = self.grad_shard.iter().map(|&g| f64::from(g) * f64::from(g)).sum();
        let mut totals = [local_loss as f32, local_sum_sq as f32];
        self.comm.all_reduce(&mut totals[..], ReduceOp::Sum).await?;
        let (loss, norm) = (f64::from(totals[0]), f64::from(totals[1]).sqrt());

        if train.grad_clip > 0.0 {
            let coef = (train.grad_clip / (norm + 1e-6)).min(1.0);
            if coef < 1.0 {
                let coef = coef as f32;
                self.grad_shard.iter_mut().for_each(|g| *g *= coef);
            }
        }
        let lr = learning_rate(&train, step);
        for segment in &self.segments {
            let r = segment.in_shard.clone();
            let config = AdamWConfig {
                lr,
                beta1: train.beta1,
                beta2: train.beta2,
                eps: train.eps,
                weight_decay: if segment.decays { train.weight_decay } else { 0.0 },
            };
            let shard = AdamWShard {
                params: &mut self.master[r.clone()],
                exp_avg: &mut self.exp_avg[r.clone()],
                exp_avg_sq: &mut self.exp_avg_sq[r.clone()],
            };
            adamw_step(shard, &self.grad_shard[r], &config, step + 1, None);
        }
        self.comm.all_gather(&self.master, &mut self.flat).await?;
        copy_from_flat(self.trainer.model.params(), &self.flat);
        self.trainer.step += 1;
        let tokens = (train.global_batch * self.trainer.config.model.context) as u64;
        Ok(StepReport { step, loss, lr, grad_norm: norm, tokens })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_parameters_and_segments_know_their_decay() {
        let numels = [4, 6, 2];
        let decays = [true, false, true];
        let mut covered = 0;
        for rank in 0..3 {
            let (own, segments) = plan_shard(&numels, &decays, rank, 3);
            assert_eq!(own.start, covered);
            covered = own.end;
            let len: usize = segments.iter().map(|s| s.in_shard.len()).sum();
            assert_eq!(len, own.len());
        }
        assert_eq!(covered, 12);
        // Rank 1 holds elements 4..8: all of them inside parameter 1 (no decay).
        let (_, segments) = plan_shard(&numels, &decays, 1, 3);
        assert_eq!(segments, vec![ShardSegment { param: 1, in_shard: 0..4, decays: false }]);
    }
}

//! DDP as a message flow: each rank computes the gradient of its slice of the global batch (weighted by
//! the slice's share, so the sum over ranks is the whole batch's gradient), the gradients are summed in
//! flat buckets with all-reduce, and every rank applies the identical update. Because the all-reduce
//! gives every rank the same bits, replicas stay bit-identical; and because sampling, weighting and the
//! update are the reference trainer's own, the run equals the single-process reference within summation
//! order (the oracle, DESIGN.md §4).
//!
//! Overlap (`parallel.overlap_comm`, the default): the rank's backward runs block by block on a thread of
//! its own ([`super::overlap`]); its first micro-batches only accumulate (`no_sync`), and during the last
//! one each bucket is all-reduced as soon as the backward has finished its parameters, on the attempt's
//! runtime, while the remaining blocks' backward computes. Without overlap — or with a single bucket,
//! which is complete only when the backward is — the whole backward runs first, then the buckets are
//! all-reduced one after the other. Both give the same bits.
//!
//! On a GPU of its own (the attempt's plane is NCCL: `crate::plan::plane`), a rank sums its buckets on
//! the device through a [`DevicePlane`]: each bucket is flattened on the device, all-reduced there and
//! copied back into the gradients, the norm's sum of squares accumulated on the device and read once
//! per step; the buckets go one after the other once the backward is done (the backward and NCCL share
//! the device's stream). Otherwise the buckets are staged through host memory over the attempt's
//! communicator, wherever the model lives.

use std::ops::Range;

use std::time::Instant;

use tch::Tensor;
use troupe_cluster::collective::{Collective, Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_kernels::norm::sum_of_squares;
use troupe_model::blockwise::Activations;
use troupe_model::checkpoint::{CheckpointWriter, Layout, SaveRequest, TrainingState};
use troupe_model::data::{micro_batch_ranges, rank_slice};
use troupe_model::generate::Evaluation;
use troupe_model::precision::backward_weight;
use troupe_model::{StepReport, Trainer};

use super::committed::CommittedState;
use super::device_plane::DevicePlane;
use super::flat::{
    append_flat, broadcast_params, broadcast_state, copy_from_device_flat, copy_from_flat, flatten_on_device,
    materialise_grads,
};
use super::overlap::{BackwardJob, BackwardWork, MicroBatch, Progress};
use super::step_engine::{EngineError, ReducedStep, StepEngine};
use crate::protocol::RankUsage;

/// DDP's default bucket size (PyTorch uses 25 MB too).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Groups parameters into buckets of at most `bucket_bytes_max` bytes of f32 gradients (a parameter
/// larger than that gets a bucket of its own), in reverse order — the order backward produces them.
/// Each bucket is a range of parameter indices.
pub fn plan_buckets(numels: &[usize], bucket_bytes_max: usize) -> Vec<Range<usize>> {
    let mut buckets = Vec::new();
    let mut end = numels.len();
    while end > 0 {
        let mut start = end - 1;
        let mut bytes = numels[start] * 4;
        while start > 0 && bytes + numels[start - 1] * 4 <= bucket_bytes_max {
            start -= 1;
            bytes += numels[start] * 4;
        }
        buckets.push(start..end);
        end = start;
    }
    buckets
}

/// One data-parallel rank: a full replica of the model and optimizer, and a communicator.
pub struct DataParallelReplica<T: Transport> {
    trainer: Trainer,
    comm: Communicator<T>,
    buckets: Vec<Range<usize>>,
    flat: Vec<f32>,
    /// Sum of squares of the reduced gradients of the step in flight, gathered bucket by bucket while
    /// they are flat (saves a pass over every gradient for the norm).
    grad_sum_sq: f64,
    /// All-reduce buckets while the backward computes (`parallel.overlap_comm`).
    overlap: bool,
    /// One flat buffer per bucket, reused from step to step by the overlapped path.
    bucket_buffers: Vec<Vec<f32>>,
    /// How the last step's gradient all-reduce and compute overlapped.
    comm_timing: CommTiming,
    /// The gradients' all-reduce on the rank's device (NCCL), when the attempt's plane is on the GPUs.
    device_plane: Option<Box<dyn DevicePlane>>,
}

/// How much of a step's gradient all-reduce the backward hid.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommTiming {
    /// Seconds spent in bucket all-reduces (summed over buckets).
    pub comm_seconds: f64,
    /// The part of those seconds after the rank's compute had finished (what the step waited for).
    pub exposed_seconds: f64,
}

impl CommTiming {
    /// The fraction of all-reduce time hidden behind the backward (0 without overlap).
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm_seconds <= 0.0 {
            return 0.0;
        }
        (1.0 - self.exposed_seconds / self.comm_seconds).clamp(0.0, 1.0)
    }
}

impl<T: Transport> DataParallelReplica<T> {
    /// Wraps a freshly built trainer; rank 0's parameters are broadcast so every replica starts from the
    /// same bits even if their initialisation differed.
    pub async fn new(trainer: Trainer, comm: Communicator<T>, bucket_bytes_max: usize) -> Result<Self, ClusterError> {
        let mut replica = Self::without_sync(trainer, comm, bucket_bytes_max);
        broadcast_params(&replica.trainer, &mut replica.comm, &mut replica.flat).await?;
        Ok(replica)
    }

    /// Wraps a trainer whose state the caller knows to equal every other rank's (or will make equal with
    /// [`Self::sync_state_from`]).
    /// `bucket_bytes_max` applies unless the job sets `parallel.bucket_mib`.
    pub fn without_sync(trainer: Trainer, comm: Communicator<T>, bucket_bytes_max: usize) -> Self {
        let parallel = &trainer.config.parallel;
        let bucket_bytes_max = if parallel.bucket_mib > 0 { parallel.bucket_mib << 20 } else { bucket_bytes_max };
        let overlap = parallel.overlap_comm;
        let numels: Vec<usize> = trainer.model.params().iter().map(Tensor::numel).collect();
        let buckets = plan_buckets(&numels, bucket_bytes_max);
        let largest = buckets.iter().map(|b| numels[b.clone()].iter().sum::<usize>()).max().unwrap_or(0);
        let bucket_buffers = vec![Vec::new(); buckets.len()];
        let replica = Self {
            trainer,
            comm,
            buckets,
            flat: Vec::with_capacity(largest),
            grad_sum_sq: 0.0,
            overlap,
            bucket_buffers,
            comm_timing: CommTiming::default(),
            device_plane: None,
        };
        materialise_grads(replica.trainer.model.params());
        replica
    }

    /// Chooses the overlapped (`true`) or sequential path for the next steps, whatever the job said
    /// (a device plane always takes the sequential one).
    pub fn set_overlap(&mut self, overlap: bool) {
        self.overlap = overlap && self.device_plane.is_none();
    }

    /// Sums the gradients on the device through `plane` from the next step on (module docs).
    pub fn with_device_plane(mut self, plane: Box<dyn DevicePlane>) -> Self {
        self.device_plane = Some(plane);
        self.overlap = false;
        self
    }

    /// The device plane's name (`nccl`, `fake-nccl`), or None when the buckets are staged through host
    /// memory.
    pub fn device_plane(&self) -> Option<&'static str> {
        self.device_plane.as_ref().map(|p| p.name())
    }

    /// How the last step's all-reduce overlapped its backward.
    pub fn comm_timing(&self) -> CommTiming {
        self.comm_timing
    }

    /// Makes every rank's whole training state — parameters, AdamW moments, step counters and the loss
    /// scaler — equal to rank `source`'s: how a joiner or a replacement catches up with the survivors.
    pub async fn sync_state_from(&mut self, source: usize) -> Result<(), ClusterError> {
        broadcast_state(&mut self.comm, &mut self.trainer, &mut self.flat, source).await
    }

    /// Gives the trainer back (its state is the last committed step's). A device plane is aborted
    /// first: a collective still queued on the device returns, and the communicator is not reused.
    pub fn into_trainer(mut self) -> Trainer {
        if let Some(plane) = &mut self.device_plane {
            plane.abort();
        }
        self.trainer
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The attempt's (host) communicator: what a device plane's communicator is built over.
    pub fn communicator(&mut self) -> &mut Communicator<T> {
        &mut self.comm
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    pub fn buckets(&self) -> &[Range<usize>] {
        &self.buckets
    }

    /// One synchronous step: this rank's slice forward/backward, bucketed all-reduce, identical update.
    pub async fn train_step(&mut self) -> Result<StepReport, ClusterError> {
        let reduced = self.reduce_gradients().await?;
        Ok(self.apply_update(reduced))
    }

    /// The first half of a step: this rank's slice forward/backward and the bucketed all-reduce. Returns
    /// the batch's mean loss and gradient norm. Nothing is applied: dropping the gradients now abandons the
    /// step cleanly.
    pub async fn reduce_gradients(&mut self) -> Result<ReducedStep, ClusterError> {
        let started = Instant::now();
        self.comm.take_calls(); // what the step sends is metered from here
        self.grad_sum_sq = 0.0;
        // One bucket is complete only when the whole backward is: nothing could overlap, and the
        // block-wise backward and its thread would cost ~5% of a step for nothing (measured on gpt-tiny,
        // one 13 MB bucket at the default 25 MiB: docs/benchmarks.md).
        let (local_loss, compute_seconds) = if self.overlap && self.buckets.len() > 1 {
            self.overlapped_backward(started).await?
        } else {
            self.sequential_backward(started).await?
        };
        let mut loss = [local_loss as f32];
        self.comm.all_reduce(&mut loss[..], ReduceOp::Sum).await?;
        Ok(ReducedStep { loss: f64::from(loss[0]), grad_norm: self.grad_sum_sq.sqrt(), compute_seconds })
    }

    /// The whole backward, then every bucket's all-reduce. (local loss, compute seconds)
    async fn sequential_backward(&mut self, started: Instant) -> Result<(f64, f64), ClusterError> {
        let step = self.trainer.step;
        let slice = rank_slice(self.trainer.config.train.global_batch, self.rank(), self.world());
        let local_loss = self.trainer.accumulate_slice(step, slice);
        let compute_seconds = started.elapsed().as_secs_f64();
        let comm_started = Instant::now();
        if self.device_plane.is_some() {
            self.all_reduce_on_device().await?;
        } else {
            for b in 0..self.buckets.len() {
                self.all_reduce_bucket(self.buckets[b].clone()).await?;
            }
        }
        let comm_seconds = comm_started.elapsed().as_secs_f64();
        self.comm_timing = CommTiming { comm_seconds, exposed_seconds: comm_seconds };
        Ok((local_loss, compute_seconds))
    }

    /// The backward on its own thread, each bucket all-reduced here as soon as it is final there.
    async fn overlapped_backward(&mut self, started: Instant) -> Result<(f64, f64), ClusterError> {
        let step = self.trainer.step;
        let train = &self.trainer.config.train;
        let slice = rank_slice(train.global_batch, self.rank(), self.world());
        let micro_batches = micro_batch_ranges(slice, train.micro_batch)
            .into_iter()
            .map(|range| {
                let weight = range.len() as f64 / train.global_batch as f64;
                let backward_weight = backward_weight(train, &self.trainer.loss_scale, step, &range);
                let samples = troupe_model::model::Samples::new(train.seed, step, range.start);
                let (tokens, targets) = self.trainer.sampler.batch(step, range);
                MicroBatch { tokens, targets, weight, backward_weight, samples }
            })
            .collect();
        for p in self.trainer.model.params_mut() {
            p.zero_grad();
        }
        let model = &self.trainer.model;
        let work = BackwardWork {
            model: model.config.clone(),
            precision: model.precision,
            params: model.params().iter().map(Tensor::shallow_clone).collect(),
            micro_batches,
            activations: Activations::from_recompute(self.trainer.config.parallel.recompute),
            buckets: self.buckets.clone(),
            buffers: std::mem::take(&mut self.bucket_buffers),
        };
        let mut job =
            BackwardJob::spawn(work).map_err(|e| ClusterError::io("starting the backward thread".to_string(), e))?;
        let mut reduced = vec![Vec::new(); self.buckets.len()];
        let mut intervals = Vec::with_capacity(self.buckets.len());
        let (loss, finished) = loop {
            match job.next().await {
                Progress::Bucket { index, mut flat } => {
                    let t0 = Instant::now();
                    self.comm.all_reduce(&mut flat[..], ReduceOp::Sum).await?;
                    intervals.push((t0, Instant::now()));
                    self.grad_sum_sq += sum_of_squares(&flat);
                    reduced[index] = flat;
                }
                Progress::Done { loss, finished } => break (loss, finished),
            }
        };
        drop(job); // joins the thread: the gradients are no longer written
        for (bucket, flat) in self.buckets.iter().zip(&reduced) {
            let grads: Vec<Tensor> = self.trainer.model.params()[bucket.clone()].iter().map(Tensor::grad).collect();
            copy_from_flat(&grads, flat);
        }
        self.bucket_buffers = reduced;
        let exposed = |(s, e): &(Instant, Instant)| e.saturating_duration_since(finished.max(*s)).as_secs_f64();
        self.comm_timing = CommTiming {
            comm_seconds: intervals.iter().map(|(s, e)| e.duration_since(*s).as_secs_f64()).sum(),
            exposed_seconds: intervals.iter().map(exposed).sum(),
        };
        Ok((loss, finished.duration_since(started).as_secs_f64()))
    }

    /// The validation loss of the committed parameters: every rank's share of the held-out windows,
    /// summed over the ranks (`super::eval`); None when the job holds no data out.
    pub async fn evaluate(&mut self) -> Result<Option<Evaluation>, ClusterError> {
        let Some((local, windows)) = super::eval::replicated_share(&self.trainer, self.rank(), self.world()) else {
            return Ok(None);
        };
        Ok(Some(super::eval::reduce_shares(&mut self.comm, local, &windows).await?))
    }

    /// The second half, once the step is committed: the identical update on every rank.
    pub fn apply_update(&mut self, reduced: ReducedStep) -> StepReport {
        self.trainer.apply_update_with_norm(reduced.loss, Some(reduced.grad_norm))
    }

    /// Every bucket summed on the device by the device plane (module docs); the norm's sum of squares
    /// read back once, at the end.
    async fn all_reduce_on_device(&mut self) -> Result<(), ClusterError> {
        let plane = self.device_plane.as_mut().expect("called with a device plane");
        let mut sum_sq: Option<Tensor> = None;
        for bucket in &self.buckets {
            let grads: Vec<Tensor> = self.trainer.model.params()[bucket.clone()].iter().map(Tensor::grad).collect();
            let mut flat = flatten_on_device(&grads);
            plane.all_reduce_sum(&mut flat).await?;
            let sq = flat.to_kind(tch::Kind::Double).square().sum(tch::Kind::Double);
            sum_sq = Some(match sum_sq {
                Some(s) => s + sq,
                None => sq,
            });
            copy_from_device_flat(&grads, &flat);
        }
        self.grad_sum_sq += sum_sq.map_or(0.0, |s| s.double_value(&[]));
        Ok(())
    }

    async fn all_reduce_bucket(&mut self, bucket: Range<usize>) -> Result<(), ClusterError> {
        let grads: Vec<Tensor> = self.trainer.model.params()[bucket].iter().map(Tensor::grad).collect();
        self.flat.clear();
        append_flat(&grads, &mut self.flat);
        self.comm.all_reduce(&mut self.flat[..], ReduceOp::Sum).await?;
        self.grad_sum_sq += sum_of_squares(&self.flat);
        copy_from_flat(&grads, &self.flat);
        Ok(())
    }
}

impl<T: Transport> StepEngine for DataParallelReplica<T> {
    fn rank(&self) -> usize {
        DataParallelReplica::rank(self)
    }

    fn world(&self) -> usize {
        DataParallelReplica::world(self)
    }

    fn trainer(&self) -> &Trainer {
        DataParallelReplica::trainer(self)
    }

    async fn sync(&mut self, source: Option<usize>) -> Result<(), EngineError> {
        if let Some(source) = source {
            self.sync_state_from(source).await?;
        }
        Ok(())
    }

    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        Ok(self.reduce_gradients().await?)
    }

    /// The whole model, its gradients and AdamW's (or Adafactor's) state, and the step's all-reduces.
    fn usage(&mut self) -> Option<RankUsage> {
        Some(super::memory::whole_replica_usage(&self.trainer, 0, self.comm.take_calls()))
    }

    fn gradient_collective(&self) -> &'static str {
        match self.device_plane() {
            Some(_) => "all-reduce (device)",
            None => "all-reduce",
        }
    }

    async fn apply(&mut self, reduced: ReducedStep) {
        self.apply_update(reduced);
    }

    /// Every rank holds the whole state: rank 0 copies its own, nothing travels.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let Some(writer) = writer else { return Ok(()) };
        let state = match writer.take_spare() {
            Some(mut spare) => {
                spare.refresh(self.trainer());
                spare
            }
            None => Box::new(TrainingState::snapshot(self.trainer())),
        };
        writer.submit(SaveRequest { state, layout: Layout::ddp(self.world()), tag });
        Ok(())
    }

    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        Ok(DataParallelReplica::evaluate(self).await?)
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    async fn into_state(self) -> Option<CommittedState> {
        Some(CommittedState::Full(Box::new(self.into_trainer())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_parameter_once_in_reverse_order_within_the_limit() {
        // Gradient bytes: 40, 1200, 20, 20, 4000, 80.
        let numels = [10, 300, 5, 5, 1000, 20];
        assert_eq!(plan_buckets(&numels, 4800), vec![2..6, 0..2]);
        // A parameter over the limit gets a bucket of its own; one exactly at the limit fits alone.
        let buckets = plan_buckets(&numels, 1200);
        assert_eq!(buckets, vec![5..6, 4..5, 2..4, 1..2, 0..1]);
        let mut covered: Vec<usize> = buckets.iter().flat_map(|b| b.clone()).collect();
        covered.sort();
        assert_eq!(covered, (0..numels.len()).collect::<Vec<_>>());
        assert_eq!(plan_buckets(&numels, usize::MAX), vec![0..6]);
        assert_eq!(plan_buckets(&[], 100), Vec::<Range<usize>>::new());
    }
}

//! Periodic synchronization (`parallel.sync = "local_sgd" | "diloco"`, every `parallel.sync_every` = H
//! steps) as an engine: each rank is a replica that takes local steps with its own AdamW on its share of
//! every batch, and the replicas' parameters meet every H steps — averaged (local SGD) or moved by an
//! outer Nesterov step on the averaged delta (DiLoCo). The algorithm and its arithmetic are
//! [`troupe_model::periodic`]'s, whose `ReplicaSet` is the single-process reference this engine equals.
//! On a GPU slot (without `parallel.offload`) the working replica, its AdamW state and the last
//! synchronization's snapshot live on the device and the local steps run there; a synchronization copies
//! the parameters down and back through host memory (`flat_params`, `load_flat_ranges`), once every H
//! steps, over the attempt's host plane.
//!
//! Why a module of its own rather than a mode of `data_parallel`: DDP's step is a gradient all-reduce in
//! buckets overlapped with the backward, and its committed state is the trainer after the step; here a
//! step moves nothing but two numbers, a synchronization all-reduces whole parameters every H steps,
//! and the committed state is not the trainer but the last synchronization's snapshot. The two share
//! the flat-buffer helpers and the evaluation, which sit below both (`flat`, `eval`).
//!
//! The step protocol (the worker's reduce → vote → commit → apply, unchanged):
//! - reduce: the rank's local step (forward, backward, clip, AdamW on the working replica — which is
//!   not the committed state, so nothing committed changes), one all-reduce of the loss and the squared
//!   gradient norm (the vote reports the global batch's mean loss, as DDP does); on the last step of an
//!   interval also the synchronization's all-reduce, whose result is held back;
//! - apply (after the commit): the step counter advances; on the last step of an interval the new global
//!   parameters replace every replica's, and they — with the rank's AdamW moments and DiLoCo's outer
//!   momentum — become the rank's committed state ([`CommittedState::Periodic`]).
//!
//! So the commit that matters is the one of a synchronization step: a rank lost inside an interval, or
//! in its synchronization before the commit, leaves every other rank holding the last synchronization's
//! state, and the next attempt redoes the interval from it with the ranks it has (the controller rolls
//! the job back to that step: `PeriodicSync::last_sync`). That keeps the run deterministic — the
//! reference regroups its replicas at the same step — where carrying on would make the result depend on
//! how far each survivor had got when the loss was noticed. A joiner (a rank whose committed step is
//! not the source's) takes the source's whole state — the global parameters, its AdamW moments, the
//! outer momentum — while the ranks already at that step keep their own moments.
//!
//! Streaming DiLoCo (`parallel.fragments` = P > 1): the synchronization of an interval's step moves only
//! the fragments due then (`PeriodicSync::due_after`: one fragment every H/P steps, all after the last),
//! one all-reduce of their contributions concatenated, synchronous (no overlap with the next steps); the
//! commit replaces those fragments of the working replica and the rank's committed state becomes its
//! whole working state then — the other fragments' local progress included — with the global parameters
//! (each fragment's last synchronized values) beside it. A rank lost rolls the job back to the last step
//! after which any fragment synchronized, so at most H/P steps are redone.

use std::ops::Range;
use std::path::Path;
use std::time::Instant;

use troupe_cluster::collective::{Collective, Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::checkpoint::{
    load_state, CheckpointWriter, Layout, PeriodicState, RankState, SaveRequest, TrainingState,
};
use troupe_model::config::JobConfig;
use troupe_model::generate::Evaluation;
use troupe_model::periodic::{
    flat_params, fragment_ranges, load_flat_params, load_flat_ranges, local_step, own_part, replica_share, PeriodicSync,
};
use troupe_model::Trainer;

use super::committed::CommittedState;
use super::flat::{broadcast_state, counter_of, counter_words};
use super::step_engine::{EngineError, ReducedStep, StepEngine};
use crate::protocol::RankUsage;

/// Rank `rank`'s committed state from checkpoint `dir` of a periodically synchronizing job: the
/// checkpoint's state with the inner optimizer state (and with fragments the parameters) of saved rank
/// `rank mod n` — its own on the same world — and the outer momentum and global parameters as saved. A
/// checkpoint without the periodic part (version 2 and older, or saved by an every-step job) gives every
/// rank its one trainer state, rank 0's moments, and the outer momentum starts at zero. The trainer is
/// built on `device` (the slot's GPU when the replicas step there).
pub(crate) fn resume_rank(
    config: JobConfig,
    dir: &Path,
    rank: usize,
    device: tch::Device,
) -> Result<CommittedState, String> {
    let fail = |e: &dyn std::fmt::Display| format!("restoring checkpoint {}: {e}", dir.display());
    let mut state = load_state(dir).map_err(|e| fail(&e))?;
    let resumed = state.take_rank(rank);
    let mut trainer = Trainer::new_on(config, device).map_err(|e| fail(&e))?;
    state.restore_into(&mut trainer, dir).map_err(|e| fail(&e))?;
    let (outer_momentum, global) = (resumed.outer_momentum, resumed.global);
    Ok(CommittedState::Periodic { trainer: Box::new(trainer), outer_momentum, global })
}

/// Where an error names the rank's last synchronization as a "checkpoint".
const SYNCED: &str = "the last synchronization";

/// One replica of a periodically synchronizing job.
pub struct PeriodicReplica<T: Transport> {
    /// The working replica: the committed state plus the interval's local steps.
    trainer: Trainer,
    comm: Communicator<T>,
    sync: PeriodicSync,
    /// The samples of each batch this rank trains on, or why it has none (more ranks than samples: the
    /// attempt fails at its first step, the committed state kept).
    share: Result<Range<usize>, String>,
    /// The parameters of the last synchronization (flat; with fragments, each fragment's last).
    global: Vec<f32>,
    /// The fragments as ranges of the flat order (one covering it all without Streaming DiLoCo).
    fragments: Vec<Range<usize>>,
    /// DiLoCo's outer momentum (flat; empty before the first synchronization, and for local SGD).
    momentum: Vec<f32>,
    /// The rank's whole state at the last synchronization: what it gives back, checkpoints and
    /// evaluates.
    synced: TrainingState,
    /// The synchronization computed by the reduce of a step after which fragments are due, installed at
    /// its commit: (the due fragments' ranges, global parameters, outer momentum).
    pending: Option<(Vec<Range<usize>>, Vec<f32>, Vec<f32>)>,
    /// The working replica has moved since the last synchronization (its parameters and moments are
    /// not `synced`'s).
    moved: bool,
    flat: Vec<f32>,
}

impl<T: Transport> PeriodicReplica<T> {
    /// Takes the rank's committed state (a fresh job's step 0, a checkpoint's, or the last
    /// synchronization's); refuses a layout it cannot train, naming the keys.
    pub fn adopt(state: CommittedState, comm: Communicator<T>) -> Result<Self, String> {
        let (trainer, momentum, global) = match state.materialised().map_err(|e| e.to_string())? {
            CommittedState::Full(trainer) => (*trainer, Vec::new(), Vec::new()),
            CommittedState::Periodic { trainer, outer_momentum, global } => (*trainer, outer_momentum, global),
            _ => return Err("a periodically synchronizing job was handed a sharded state; dropped".into()),
        };
        let sync = PeriodicSync::of(&trainer.config.parallel)
            .ok_or("the periodic engine runs parallel.sync = \"local_sgd\" or \"diloco\" only")?;
        let share = replica_share(trainer.config.train.global_batch, comm.rank(), comm.world());
        let fragments = fragment_ranges(trainer.model.specs(), sync.fragments).map_err(|e| e.to_string())?;
        let global = if global.is_empty() { flat_params(&trainer) } else { global };
        let synced = TrainingState::snapshot(&trainer);
        let (pending, moved, flat) = (None, false, Vec::new());
        Ok(Self { trainer, comm, sync, share, global, fragments, momentum, synced, pending, moved, flat })
    }

    /// Makes a joiner's state the source's (see the module's doc). Every rank takes part.
    async fn catch_up(&mut self, source: usize) -> Result<(), EngineError> {
        let step = counter_words(self.trainer.step);
        let mut header = [step[0], step[1], self.momentum.len() as f32];
        self.comm.broadcast(&mut header[..], source).await?;
        let behind = counter_of(header[0], header[1]) != self.trainer.step;
        broadcast_state(&mut self.comm, &mut self.trainer, &mut self.flat, source).await?;
        if !behind {
            // Same synchronization, same global parameters: only the AdamW moments differed; keep ours.
            let mine = std::mem::replace(&mut self.synced, TrainingState::snapshot(&self.trainer));
            if let Err(e) = mine.restore_into(&mut self.trainer, Path::new(SYNCED)) {
                return Err(EngineError::Setup(format!("restoring this rank's own AdamW moments: {e}")));
            }
        }
        if header[2] > 0.0 {
            self.momentum.resize(self.global.len(), 0.0);
            self.comm.broadcast(&mut self.momentum[..], source).await?;
        }
        if self.fragments.len() > 1 {
            // Each fragment's last synchronized values: the trainer's parameters are not them.
            self.comm.broadcast(&mut self.global[..], source).await?;
        } else {
            self.global = flat_params(&self.trainer);
        }
        self.synced = TrainingState::snapshot(&self.trainer);
        self.moved = false;
        Ok(())
    }

    /// The synchronization of fragments `due`, one all-reduce of their contributions: (their ranges, the
    /// new global parameters, outer momentum), not yet installed.
    async fn synchronize(&mut self, due: &[usize]) -> Result<(Vec<Range<usize>>, Vec<f32>, Vec<f32>), ClusterError> {
        let ranges: Vec<Range<usize>> = due.iter().map(|&p| self.fragments[p].clone()).collect();
        let mut contribution = self.sync.contributions(&ranges, &self.global, &flat_params(&self.trainer));
        self.comm.all_reduce(&mut contribution[..], ReduceOp::Sum).await?;
        let (mut global, mut momentum) = (self.global.clone(), self.momentum.clone());
        self.sync.conclude(&ranges, &contribution, self.comm.world(), &mut global, &mut momentum);
        Ok((ranges, global, momentum))
    }

    /// The validation loss of the last synchronization's parameters (put in place of the working ones
    /// for the forward, then put back).
    async fn evaluate_synced(&mut self) -> Result<Option<Evaluation>, ClusterError> {
        let swap = self.moved || self.fragments.len() > 1;
        let working = swap.then(|| flat_params(&self.trainer));
        if swap {
            load_flat_params(&self.trainer, &self.global);
        }
        let (rank, world) = (self.comm.rank(), self.comm.world());
        let evaluated = match super::eval::replicated_share(&self.trainer, rank, world) {
            Some((local, windows)) => super::eval::reduce_shares(&mut self.comm, local, &windows).await.map(Some),
            None => Ok(None),
        };
        if let Some(working) = working {
            load_flat_params(&self.trainer, &working);
        }
        evaluated
    }
}

impl<T: Transport> StepEngine for PeriodicReplica<T> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    async fn sync(&mut self, source: Option<usize>) -> Result<(), EngineError> {
        match source {
            Some(source) => self.catch_up(source).await,
            None => Ok(()),
        }
    }

    /// The local step (applied to the working replica at once: see the module's doc; the step counter
    /// advances at the commit), the loss's all-reduce and, at an interval's end, the synchronization's.
    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        let share = self.share.clone().map_err(EngineError::Setup)?;
        let started = Instant::now();
        self.comm.take_calls(); // what the step sends is metered from here
        let step = self.trainer.step;
        self.pending = None;
        self.moved = true;
        let report = local_step(&mut self.trainer, share);
        self.trainer.step = step;
        let compute_seconds = started.elapsed().as_secs_f64();
        let mut figures = [report.loss as f32, (report.grad_norm * report.grad_norm) as f32];
        self.comm.all_reduce(&mut figures[..], ReduceOp::Sum).await?;
        let due = self.sync.due_after(step, self.trainer.config.train.steps);
        if !due.is_empty() {
            self.pending = Some(self.synchronize(&due).await?);
        }
        let grad_norm = (f64::from(figures[1]) / self.comm.world() as f64).sqrt();
        Ok(ReducedStep { loss: f64::from(figures[0]), grad_norm, compute_seconds })
    }

    /// The working replica, its gradients and inner optimizer state; beside that state, what the
    /// engine keeps to synchronize and to roll back: the global parameters, DiLoCo's outer momentum and
    /// the last synchronization's snapshot. What it sent: the loss's all-reduce, and at an interval's end
    /// the synchronization's.
    fn usage(&mut self) -> Option<RankUsage> {
        let kept = self.global.len() + self.momentum.len() + self.synced.bytes() as usize / std::mem::size_of::<f32>();
        Some(super::memory::whole_replica_usage(&self.trainer, kept, self.comm.take_calls()))
    }

    async fn apply(&mut self, _reduced: ReducedStep) {
        self.trainer.step += 1;
        if let Some((ranges, global, momentum)) = self.pending.take() {
            (self.global, self.momentum) = (global, momentum);
            load_flat_ranges(&self.trainer, &self.global, &ranges);
            self.synced.refresh(&self.trainer);
            self.moved = false;
        }
    }

    /// The last synchronization's state, tagged with its own step: a durable checkpoint never holds a
    /// replica's unsynchronized progress. Every rank sends its own part — its inner optimizer state, with
    /// fragments its own parameters — to rank 0, which saves them beside the global parameters (each
    /// fragment's last synchronized values) and DiLoCo's outer momentum (format version 3, see
    /// `troupe_model::checkpoint`). Rank 0 receives even without a writer, so the ranks' point-to-point
    /// sequences stay matched.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let fragmented = self.fragments.len() > 1;
        let mine = own_part(&self.synced, fragmented);
        if self.comm.rank() != 0 {
            for part in [&mine.slots[0], &mine.slots[1], &mine.params] {
                if !part.is_empty() {
                    self.comm.send(0, &part[..]).await?;
                }
            }
            return Ok(());
        }
        let total = self.global.len();
        let mut ranks = vec![mine];
        for rank in 1..self.comm.world() {
            let params = if fragmented { vec![0f32; total] } else { Vec::new() };
            let mut theirs = RankState { slots: [vec![0f32; total], vec![0f32; total]], params };
            let [first, second] = &mut theirs.slots;
            for part in [first, second, &mut theirs.params] {
                if !part.is_empty() {
                    self.comm.recv(rank, &mut part[..]).await?;
                }
            }
            ranks.push(theirs);
        }
        let Some(writer) = writer else { return Ok(()) };
        let mut state = Box::new(self.synced.clone());
        if fragmented && state.values[0].len() == total {
            state.values[0].copy_from_slice(&self.global);
        }
        state.periodic = Some(PeriodicState { ranks, outer_momentum: self.momentum.clone() });
        writer.submit(SaveRequest { state, layout: Layout::ddp(self.comm.world()), tag });
        Ok(())
    }

    /// The validation loss of the last synchronization's parameters, data-parallel over the ranks.
    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        Ok(self.evaluate_synced().await?)
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        load_flat_params(&self.trainer, &self.global);
        Ok(())
    }

    /// The last synchronization's state and the outer momentum.
    async fn into_state(mut self) -> Option<CommittedState> {
        if self.moved {
            if let Err(e) = self.synced.restore_into(&mut self.trainer, Path::new(SYNCED)) {
                tracing::error!("restoring the last synchronization's state: {e}; this rank's state is dropped");
                return None;
            }
        }
        let outer_momentum = self.momentum;
        let global = if self.fragments.len() > 1 { self.global } else { Vec::new() };
        Some(CommittedState::Periodic { trainer: Box::new(self.trainer), outer_momentum, global })
    }
}

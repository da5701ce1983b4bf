//! ZeRO-1, ZeRO-2 and ZeRO-3 as message flows: the fp32 master parameters and AdamW moments are split
//! into contiguous shards of the flat parameter vector, one per rank, held by the rank's
//! [`ShardOwnerActor`] (with its copies of its buddies' shards) and updated there by the fused AdamW
//! kernel of troupe-kernels. ZeRO-1/2 ranks hold the model for compute; ZeRO-3 ranks
//! hold none of it between steps and gather each unit's parameters just in time ([`super::zero3`]).
//!
//! A step: an all-gather of the masters refreshes every replica's parameters (when an update was applied
//! since); each rank accumulates the gradient of its slice of the batch (as in DDP); the flat gradient is
//! summed — all-reduced (ZeRO-1) or reduce-scattered so each rank receives only its shard (ZeRO-2, whose
//! owners then send that shard to the ranks that shadow it); the global gradient norm is the sum of the
//! shards' squared norms, each owner's term computed by the owner the gradient is staged with — then the
//! rank votes. Once the step is committed each owner clips and updates its shard and its buddy copies,
//! locally. Same samples, weights, clipping and AdamW as the reference, so the
//! oracle holds (DESIGN.md §4); and every shard's state lives on 1 + `replicas` ranks. ZeRO-3 differs
//! only in how the step's gradient shard is computed; sync, buddies, the update and checkpoints are
//! these.
//!
//! On GPUs of their own (the attempt's plane is NCCL: `crate::plan::plane`), ZeRO-1/2 ranks keep the
//! model and compute on the device and reduce there: the flat gradient is flattened on the device and
//! all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2) through the [`DevicePlane`], and only the held
//! pieces cross to the host for the owner; the updated masters go up once and are all-gathered on the
//! device into the parameters. The owner — masters, moments and the update — stays in host memory
//! (ZeRO-Offload's split: per step each rank moves its held gradient pieces down and its own masters
//! up). ZeRO-3 ranks compute each unit on the device too: its parameters gathered there from the
//! owners by grouped NCCL broadcasts (each owner's masters going up first) and its gradient reduced
//! there, only the own pieces coming down ([`super::zero3`]).
//!
//! With Adafactor (`train.optimizer = "adafactor"`) every rank also keeps the whole model's factored
//! statistics (`R + C` values per `R × C` matrix, replicated: [`troupe_model::optim::adafactor_shard`]),
//! put together at `sync` by one all-reduce of every owner's part of its slots. Before the vote two
//! small all-reduces complete what is per matrix: the row and column sums of the squared gradient and
//! each parameter's Σ master² ride with the loss and the norm; each parameter's Σ update² (update
//! clipping) follows once the clipping factor is known. The update after the commit stays local.

use std::ops::Range;
use std::sync::Arc;

use ractor::{Actor, ActorCell, ActorRef, RpcReplyPort};
use tch::Tensor;
use troupe_cluster::collective::{chunk_range, Collective, Communicator, ReduceOp};
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::checkpoint::{CheckpointWriter, Layout, SaveRequest, TrainingState};
use troupe_model::data::rank_slice;
use troupe_model::generate::Evaluation;
use troupe_model::optim::adafactor_shard::ShardLayout;
use troupe_model::optim::learning_rate;
use troupe_model::precision::Update;
use troupe_model::trainer::scaler_of;
use troupe_model::{StepReport, Trainer};

use super::committed::{full_piece, tensor_specs, CommittedState, ShardPiece};
use super::device_plane::{all_gather_balanced, reduce_scatter_balanced, DevicePlane};
use super::flat::{
    append_flat, broadcast_params, copy_from_device_flat, copy_from_flat, flatten_on_device, materialise_grads,
};
use super::memory::{group_sent, tensor_and_grad_bytes, PersistentState};
use super::reshard::{reshard, Held};
use super::segments::plan_segments;
use super::shard_owner::{OwnerAdafactor, OwnerArgs, OwnerUpdate, ShardOwnerActor, ShardOwnerMsg, Staged};
use super::shard_plan::{buddies, held_ranges, shadow_holders, ShardMode, REPLICAS_MAX};
use super::step_engine::{EngineError, ReducedStep, StepEngine};
use super::zero3;
use crate::protocol::{GroupKind, RankUsage};

/// One rank of a ZeRO-1/2/3 job: the engine that runs its share of each step's compute and
/// communication, its [`ShardOwnerActor`] — which holds its own shard of the masters and moments and its
/// copies of its buddies' shards (`replicas` of them, see [`super::shard_plan`]) — and, ZeRO-1/2 only, a
/// replica of the model for compute whose parameters are refreshed from the masters (all-gather) before
/// each step's forward. A ZeRO-3 rank's model tensors are empty except after [`Self::refresh_params`]
/// (`--save-final`).
///
/// Life of an attempt: [`Self::adopt`] the committed state (no communication) → [`Self::sync`] (every
/// rank describes what it holds; the state of the most advanced step is resharded to this world, and the
/// owner is spawned with it) → per step [`Self::reduce_gradients`] (vote) and, once committed,
/// [`Self::apply_update`] → [`Self::into_state`] (the owner hands the state back and stops).
pub struct ShardedReplica<T: Transport> {
    trainer: Trainer,
    comm: Communicator<T>,
    mode: ShardMode,
    replicas: usize,
    numels: Vec<usize>,
    decays: Vec<bool>,
    total: usize,
    /// Before `sync`: what the rank held when the attempt began. After: empty (the owner holds it).
    pieces: Vec<ShardPiece>,
    /// Before `sync`: the rank holds a fresh job's step 0 ([`CommittedState::Initial`]; `pieces` is
    /// empty), read by range when `sync` knows the layout.
    fresh: bool,
    /// After `sync`: the ranges the owner holds, its own shard first, then its buddies' in
    /// [`held_ranges`] order.
    held: Vec<Range<usize>>,
    /// The shard owner, once synced.
    owner: Option<ActorRef<ShardOwnerMsg>>,
    /// Where the owner is linked: the rank's WorkerActor (None: spawned unsupervised).
    supervisor: Option<ActorCell>,
    /// Per held piece: the reduced gradient of the step in flight (empty while the owner has them).
    grads: Vec<Vec<f32>>,
    flat: Vec<f32>,
    /// The replica's parameters lag the masters (an update was applied since the last all-gather).
    params_stale: bool,
    synced: bool,
    /// `sync` found the state of the most advanced step incomplete, or the owner died: this rank's state
    /// is dropped.
    lost: bool,
    /// With `train.optimizer = "adafactor"`: where the factored statistics are.
    adafactor: Option<Arc<ShardLayout>>,
    /// Adafactor: the step in flight's Σ update² per parameter (reduced before the vote).
    update_sq: Vec<f32>,
    /// ZeRO-1/2 on GPUs of their own: the gradients reduced and the masters gathered on the device.
    device_plane: Option<Box<dyn DevicePlane>>,
}

impl<T: Transport> ShardedReplica<T> {
    /// A fresh job in one call (in-process tests): rank 0's parameters are broadcast, every rank takes its
    /// shard, no buddy copies.
    pub async fn new(trainer: Trainer, mut comm: Communicator<T>, mode: ShardMode) -> Result<Self, EngineError> {
        let mut flat = Vec::new();
        materialise_grads(trainer.model.params());
        broadcast_params(&trainer, &mut comm, &mut flat).await?;
        let mut replica = Self::adopt(CommittedState::Full(Box::new(trainer)), comm, mode, 0, None);
        replica.sync().await?;
        Ok(replica)
    }

    /// Takes a rank's committed state for a new attempt. Nothing is sent: call [`Self::sync`] next. The
    /// shard owner will be linked under `supervisor` (the rank's WorkerActor).
    pub fn adopt(
        state: CommittedState,
        comm: Communicator<T>,
        mode: ShardMode,
        replicas: usize,
        supervisor: Option<ActorCell>,
    ) -> Self {
        // ZeRO-1/2 keep the whole model on every rank: a fresh state is materialised here. (The worker
        // hands `Initial` to ZeRO-3 only; this keeps any other mode right too.)
        let state = match (mode, state) {
            (ShardMode::Zero3, state) => state,
            (_, state) => state.materialised().unwrap_or_else(|e| panic!("materialising the initial model: {e}")),
        };
        let fresh = matches!(state, CommittedState::Initial(_));
        let (mut trainer, pieces) = match state {
            CommittedState::Sharded { trainer, pieces } => (*trainer, pieces),
            CommittedState::Initial(trainer) => (*trainer, Vec::new()),
            CommittedState::Full(trainer) | CommittedState::Periodic { trainer, .. } => {
                let mut trainer = *trainer;
                let piece = full_piece(&trainer);
                // The moments live in the pieces from now on.
                trainer.optimizer.clear_state();
                (trainer, vec![piece])
            }
        };
        trainer.optimizer.clear_state();
        let numels: Vec<usize> = trainer.model.specs().iter().map(|s| s.numel()).collect();
        let decays: Vec<bool> = trainer.model.specs().iter().map(|s| s.decays()).collect();
        let adafactor = (trainer.config.train.optimizer == "adafactor").then(|| {
            let shapes: Vec<Vec<i64>> = trainer.model.specs().iter().map(|s| s.shape.clone()).collect();
            Arc::new(ShardLayout::new(&shapes, &decays))
        });
        if mode == ShardMode::Zero3 {
            zero3::release_params(&mut trainer);
        } else {
            materialise_grads(trainer.model.params());
        }
        Self {
            total: numels.iter().sum(),
            trainer,
            comm,
            mode,
            replicas: replicas.min(REPLICAS_MAX),
            numels,
            decays,
            pieces,
            fresh,
            held: Vec::new(),
            owner: None,
            supervisor,
            grads: Vec::new(),
            flat: Vec::new(),
            params_stale: true,
            synced: false,
            lost: false,
            adafactor,
            update_sq: Vec::new(),
            device_plane: None,
        }
    }

    /// Reduces the gradients and gathers the masters (ZeRO-3: each unit's parameters) on the device
    /// through `plane` from the next step on (module docs). The plane's group must be this attempt's
    /// ranks, in the communicator's order.
    pub fn set_device_plane(&mut self, plane: Box<dyn DevicePlane>) -> Result<(), String> {
        let (rank, world) = (self.rank(), self.world());
        if (plane.rank(), plane.world()) != (rank, world) {
            return Err(format!(
                "the device plane's group is rank {} of {}, the attempt's rank {rank} of {world}",
                plane.rank(),
                plane.world()
            ));
        }
        self.device_plane = Some(plane);
        Ok(())
    }

    /// The device plane's name (`nccl`, `fake-nccl`), or None when the collectives go through host
    /// memory.
    pub fn device_plane(&self) -> Option<&'static str> {
        self.device_plane.as_ref().map(|p| p.name())
    }

    /// The attempt's (host) communicator: what a device plane's communicator is built over.
    pub fn communicator(&mut self) -> &mut Communicator<T> {
        &mut self.comm
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    pub fn mode(&self) -> ShardMode {
        self.mode
    }

    /// The trainer: step counters, config, sampler, and the replica's parameters (current after
    /// [`Self::refresh_params`] or [`Self::train_step`]).
    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// What this rank keeps between steps, in elements (see [`PersistentState`]): the owner's masters,
    /// moments and gradient buffers, the engine's model replica and buffers.
    pub fn persistent_state(&self) -> PersistentState {
        let held: usize = self.held().iter().map(Range::len).sum();
        let mut state = PersistentState::of_model(&self.trainer);
        state.masters = held;
        state.moments = self.moment_elements();
        state.grads += held;
        state.buffers = self.flat.capacity();
        state
    }

    /// Elements of optimizer state (master params + moments) this rank holds, buddy copies included.
    pub fn optimizer_state_elements(&self) -> usize {
        self.held().iter().map(Range::len).sum::<usize>() + self.moment_elements()
    }

    /// Elements of the optimizer's moments this rank holds, buddy copies included: AdamW's two per
    /// element; Adafactor's first moment (with `beta1`), the vectors' second moment, and the whole
    /// model's factored statistics (replicated).
    fn moment_elements(&self) -> usize {
        let held = self.held();
        let per_piece: usize = held.iter().map(|r| self.piece_moment_elements(r)).sum();
        per_piece + self.adafactor.as_ref().map_or(0, |layout| layout.stats_len())
    }

    /// Elements of moments a held piece `range` carries (the replicated factored statistics aside).
    fn piece_moment_elements(&self, range: &Range<usize>) -> usize {
        let Some(layout) = &self.adafactor else {
            return 2 * range.len();
        };
        let first = if self.trainer.config.train.adafactor.beta1.is_some() { range.len() } else { 0 };
        layout.vector_elements(range) + first
    }

    /// What the rank held after the step's reduction, by kind (bytes), and what its communicator sent in
    /// the step. Parameters and their gradients: the replica's model tensors (ZeRO-3: none, its units
    /// are gathered one at a time inside the step). Optimizer: the own shard's fp32 masters and moments,
    /// and Adafactor's replicated statistics. Gradients also count the own shard's reduced gradient;
    /// the buddy copy is each buddy's masters, moments and gradient shard.
    fn step_usage(&mut self) -> Option<RankUsage> {
        let (own, buddies) = self.held.split_first()?;
        let f32s = |elements: usize| (elements * std::mem::size_of::<f32>()) as u64;
        let (param_bytes, model_grads) = tensor_and_grad_bytes(self.trainer.model.params());
        let stats = self.adafactor.as_ref().map_or(0, |layout| layout.stats_len());
        let buddy = buddies.iter().map(|r| 2 * r.len() + self.piece_moment_elements(r)).sum();
        Some(RankUsage {
            param_bytes,
            grad_bytes: model_grads + f32s(own.len()),
            optimizer_bytes: f32s(own.len() + self.piece_moment_elements(own) + stats),
            buddy_bytes: f32s(buddy),
            activation_bytes: None,
            step_seconds: 0.0,
            sent: group_sent(GroupKind::Data, self.comm.take_calls()),
        })
    }

    /// The flat ranges this rank holds (own shard first).
    pub fn held(&self) -> Vec<Range<usize>> {
        match self.owner {
            Some(_) => self.held.clone(),
            None => self.pieces.iter().map(|p| p.range.clone()).collect(),
        }
    }

    /// The shard owner, once synced (a child of the supervisor given to [`Self::adopt`]).
    pub fn shard_owner(&self) -> Option<ActorCell> {
        self.owner.as_ref().map(ActorRef::get_cell)
    }

    /// Asks the shard owner; an owner that died fails the call, and this rank's state with it.
    async fn ask<R: Send + 'static>(
        &mut self,
        what: &str,
        msg: impl FnOnce(RpcReplyPort<R>) -> ShardOwnerMsg,
    ) -> Result<R, EngineError> {
        let owner = self.owner.as_ref().expect("ShardedReplica::sync before the first step");
        match super::ask_actor(owner, msg).await {
            Ok(reply) => Ok(reply),
            Err(failed) => Err(self.owner_lost(what, &failed)),
        }
    }

    fn owner_lost(&mut self, what: &str, failed: &str) -> EngineError {
        self.lost = true;
        let reason = format!("{what}: {failed}; this rank's shard is lost");
        EngineError::ShardOwner { rank: self.rank(), reason }
    }

    /// The own shard's range and masters, shared read-only with the owner until dropped.
    async fn lease(&mut self) -> Result<(Range<usize>, Arc<Vec<f32>>), EngineError> {
        self.ask("lending the masters", ShardOwnerMsg::Masters).await
    }

    /// Reshards the committed state to this attempt's world. Every rank all-gathers what every other
    /// holds; the most advanced step wins. When every rank already holds what it needs at that step,
    /// nothing else moves; otherwise every piece of the flat state is broadcast once from the lowest rank
    /// that holds it, and each rank keeps its own shard and its buddies'. A failure leaves the state
    /// this rank held untouched; a piece held by no rank fails with [`EngineError::StateLost`] and marks
    /// this rank's state lost (so the next attempt restores from the checkpoint). Then the rank's
    /// [`ShardOwnerActor`] is spawned with what it holds.
    pub async fn sync(&mut self) -> Result<(), EngineError> {
        if self.owner.is_some() {
            // Synced before: the state goes back to the engine to be resharded again.
            self.pieces = self.ask("handing the state back", ShardOwnerMsg::Export).await?;
            self.owner = None;
        }
        let (rank, world, total, replicas) = (self.rank(), self.world(), self.total, self.replicas);
        let held = if self.fresh { Held::fresh(&self.trainer) } else { Held::of(&self.trainer, &self.pieces) };
        let resharded = match reshard(&mut self.comm, total, held, |r| held_ranges(total, r, world, replicas)).await {
            Ok(resharded) => resharded,
            Err(e) => {
                self.lost = matches!(e, EngineError::StateLost { .. });
                return Err(e);
            }
        };
        let needed = held_ranges(total, rank, world, replicas);
        let segments = needed.iter().map(|r| plan_segments(&self.numels, &self.decays, r)).collect();
        self.grads = needed.iter().map(|r| vec![0.0; r.len()]).collect();
        let adafactor = match &self.adafactor {
            Some(layout) => Some(self.gather_statistics(layout.clone(), &resharded.pieces[0]).await?),
            None => None,
        };
        let args =
            OwnerArgs { pieces: resharded.pieces, segments, train: self.trainer.config.train.clone(), adafactor };
        let spawned = match self.supervisor.clone() {
            Some(worker) => Actor::spawn_linked(None, ShardOwnerActor, args, worker).await,
            None => Actor::spawn(None, ShardOwnerActor, args).await,
        };
        match spawned {
            Ok((owner, _)) => self.owner = Some(owner),
            Err(e) => return Err(self.owner_lost("spawning the shard owner", &e.to_string())),
        }
        self.held = needed;
        self.pieces = Vec::new(); // what the rank held before: the owner holds the state now
        self.fresh = false;
        self.trainer.loss_scale = resharded.loss_scale;
        self.trainer.step = resharded.step;
        self.trainer.optimizer.set_step(resharded.optimizer_step);
        self.params_stale = true;
        self.synced = true;
        Ok(())
    }

    /// Adafactor: the whole model's factored statistics, from every rank's own piece's second slot (the
    /// own pieces tile the flat order, so each statistic comes from exactly one rank; an all-reduce of
    /// `stats_len` values puts them together on every rank).
    async fn gather_statistics(
        &mut self,
        layout: Arc<ShardLayout>,
        own: &ShardPiece,
    ) -> Result<OwnerAdafactor, ClusterError> {
        let mut stats = vec![0f32; layout.stats_len()];
        layout.import_stats(&own.range, &own.exp_avg_sq, &mut stats);
        self.comm.all_reduce(&mut stats[..], ReduceOp::Sum).await?;
        Ok(OwnerAdafactor { layout, config: self.trainer.config.train.adafactor.clone(), stats })
    }

    /// Overwrites the replica's parameters with the masters of every rank (all-gather). A ZeRO-3 rank's
    /// parameters are rebuilt whole (until [`Self::into_state`] or the next step drops them again).
    pub async fn refresh_params(&mut self) -> Result<(), EngineError> {
        let (_, masters) = self.lease().await?;
        self.refresh_from(&masters).await?;
        Ok(())
    }

    /// [`Self::refresh_params`] with the own shard's masters at hand. With a device plane the own
    /// masters go up to the device and are all-gathered there.
    async fn refresh_from(&mut self, masters: &[f32]) -> Result<(), ClusterError> {
        if let Some(plane) = self.device_plane.as_deref_mut() {
            let device = self.trainer.device;
            let own = Tensor::from_slice(masters).to_device(device);
            let mut flat = Tensor::zeros([self.total as i64], (tch::Kind::Float, device));
            all_gather_balanced(plane, &own, &mut flat).await?;
            if self.mode == ShardMode::Zero3 {
                zero3::restore_params_from(&mut self.trainer, &flat);
            } else {
                copy_from_device_flat(self.trainer.model.params(), &flat);
            }
            self.params_stale = false;
            return Ok(());
        }
        self.flat.clear();
        self.flat.resize(self.total, 0.0);
        self.comm.all_gather(masters, &mut self.flat).await?;
        if self.mode == ShardMode::Zero3 {
            zero3::restore_params(&mut self.trainer, &self.flat);
            self.flat = Vec::new();
        } else {
            copy_from_flat(self.trainer.model.params(), &self.flat);
        }
        self.params_stale = false;
        Ok(())
    }

    /// One whole step (in-process use): reduce, apply, refresh the parameters (ZeRO-1/2; a ZeRO-3 rank
    /// keeps none: call [`Self::refresh_params`] to see them).
    pub async fn train_step(&mut self) -> Result<StepReport, EngineError> {
        let reduced = self.reduce_gradients().await?;
        let report = self.apply_update(reduced).await?;
        if self.mode != ShardMode::Zero3 {
            self.refresh_params().await?;
        }
        Ok(report)
    }

    /// The first half of a step, everything before the vote: refresh the parameters if an update was
    /// applied since, this rank's slice forward/backward, the gradient reduced (all-reduce for ZeRO-1,
    /// reduce-scatter for ZeRO-2, whose owners then send their gradient shard to the ranks that shadow
    /// it), the loss and global norm. ZeRO-3: the unit-by-unit flow of [`zero3::accumulate`] (its
    /// `compute_seconds` include the gathers and reductions interleaved with the compute), then the own
    /// gradient shard to the shadowing ranks as ZeRO-2. The reduced gradients are staged with the owner.
    /// Nothing is applied: dropping it now abandons the step cleanly.
    pub async fn reduce_gradients(&mut self) -> Result<ReducedStep, EngineError> {
        assert!(self.synced, "ShardedReplica::sync before the first step");
        self.comm.take_calls(); // what the step sends is metered from here
        if self.grads.is_empty() {
            // The last step's buffers stayed with the owner (that step was abandoned after staging).
            self.grads = self.held.iter().map(|r| vec![0.0; r.len()]).collect();
        }
        if self.mode == ShardMode::Zero3 {
            if !self.trainer.model.params().iter().all(|p| p.numel() == 0) {
                zero3::release_params(&mut self.trainer); // after `refresh_params`
            }
            let (own, masters) = self.lease().await?;
            let started = std::time::Instant::now();
            let planes = (&mut self.comm, self.device_plane.as_deref_mut());
            let local_loss =
                zero3::accumulate(planes, &mut self.trainer, (own, &masters[..]), &mut self.grads[0]).await?;
            let compute_seconds = started.elapsed().as_secs_f64();
            drop(masters); // the update runs in place
            self.share_grad_shard().await?;
            return self.reduce_totals(local_loss, compute_seconds).await;
        }
        if self.params_stale {
            let (_, masters) = self.lease().await?;
            self.refresh_from(&masters).await?;
        }
        let step = self.trainer.step;
        let (rank, world) = (self.rank(), self.world());
        let slice = rank_slice(self.trainer.config.train.global_batch, rank, world);
        let started = std::time::Instant::now();
        let local_loss = self.trainer.accumulate_slice(step, slice);
        let compute_seconds = started.elapsed().as_secs_f64();

        let grads: Vec<Tensor> = self.trainer.model.params().iter().map(Tensor::grad).collect();
        if self.device_plane.is_some() {
            self.reduce_on_device(&grads).await?;
            return self.reduce_totals(local_loss, compute_seconds).await;
        }
        self.flat.clear();
        append_flat(&grads, &mut self.flat);
        match self.mode {
            ShardMode::Zero1 => {
                self.comm.all_reduce(&mut self.flat[..], ReduceOp::Sum).await?;
                for (range, grad) in self.held.iter().zip(&mut self.grads) {
                    grad.copy_from_slice(&self.flat[range.clone()]);
                }
            }
            ShardMode::Zero2 => {
                self.comm.reduce_scatter(&self.flat, &mut self.grads[0], ReduceOp::Sum).await?;
                self.share_grad_shard().await?;
            }
            ShardMode::Zero3 => unreachable!("ZeRO-3 returned above"),
        }
        self.reduce_totals(local_loss, compute_seconds).await
    }

    /// The validation loss of the committed state (`super::eval`): ZeRO-1/2 gather the parameters if an
    /// update was applied since (the next step then need not) and run their share of the windows on
    /// the whole model; ZeRO-3 runs its share unit by unit, each unit's parameters gathered once for
    /// all its windows and dropped after ([`zero3::evaluate_share`]). None when the job holds no data
    /// out.
    pub async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        assert!(self.synced, "ShardedReplica::sync before evaluating");
        if self.trainer.validation.is_none() {
            return Ok(None);
        }
        let (local, windows) = if self.mode == ShardMode::Zero3 {
            let (own, masters) = self.lease().await?;
            let windows = self.trainer.validation.clone().expect("checked above");
            let trainer = &self.trainer;
            let model =
                (trainer.config.clone(), trainer.model.precision, trainer.model.specs().to_vec(), trainer.device);
            let planes = (&mut self.comm, self.device_plane.as_deref_mut());
            (zero3::evaluate_share(planes, model, (own, &masters[..]), &windows).await?, windows)
        } else {
            if self.params_stale {
                let (_, masters) = self.lease().await?;
                self.refresh_from(&masters).await?;
            }
            super::eval::replicated_share(&self.trainer, self.rank(), self.world()).expect("checked above")
        };
        Ok(Some(super::eval::reduce_shares(&mut self.comm, local, &windows).await?))
    }

    /// ZeRO-1/2 with a device plane: the flat gradient all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2)
    /// on the device; only the held pieces come down to the host for the owner (ZeRO-2's buddy pieces
    /// then travel from the shards' owners as on the host path).
    async fn reduce_on_device(&mut self, grads: &[Tensor]) -> Result<(), ClusterError> {
        let plane = self.device_plane.as_deref_mut().expect("called with a device plane");
        let mut flat = flatten_on_device(grads);
        match self.mode {
            ShardMode::Zero1 => {
                plane.all_reduce_sum(&mut flat).await?;
                for (range, grad) in self.held.iter().zip(&mut self.grads) {
                    flat.narrow(0, range.start as i64, range.len() as i64).copy_data(grad, range.len());
                }
            }
            ShardMode::Zero2 => {
                let len = self.held[0].len();
                let mut own = Tensor::zeros([len as i64], (tch::Kind::Float, flat.device()));
                reduce_scatter_balanced(plane, &flat, &mut own).await?;
                own.copy_data(&mut self.grads[0], len);
                self.share_grad_shard().await?;
            }
            ShardMode::Zero3 => unreachable!("ZeRO-3 reduces unit by unit in `zero3::accumulate`"),
        }
        Ok(())
    }

    /// ZeRO-2/3: the owner's gradient shard to the ranks that shadow it; the buddies' shards from them.
    async fn share_grad_shard(&mut self) -> Result<(), ClusterError> {
        let (rank, world) = (self.rank(), self.world());
        for holder in shadow_holders(rank, world, self.replicas) {
            self.comm.send(holder, &self.grads[0]).await?;
        }
        for (k, buddy) in buddies(rank, world, self.replicas).into_iter().enumerate() {
            self.comm.recv(buddy, &mut self.grads[1 + k]).await?;
        }
        Ok(())
    }

    /// Stages the reduced gradients with the owner, then the batch's loss and the global gradient norm
    /// (sum of the own shards' squared norms, each from its owner) over ranks.
    async fn reduce_totals(&mut self, local_loss: f64, compute_seconds: f64) -> Result<ReducedStep, EngineError> {
        let (step, grads) = (self.trainer.step, std::mem::take(&mut self.grads));
        let Staged { sum_sq, sums } =
            self.ask("staging the gradients", |reply| ShardOwnerMsg::Stage { step, grads, reply }).await?;
        let mut totals = vec![local_loss as f32, sum_sq as f32];
        totals.extend(sums);
        self.comm.all_reduce(&mut totals[..], ReduceOp::Sum).await?;
        let reduced =
            ReducedStep { loss: f64::from(totals[0]), grad_norm: f64::from(totals[1]).sqrt(), compute_seconds };
        if self.adafactor.is_some() {
            self.prepare_adafactor(reduced.grad_norm, totals.split_off(2)).await?;
        }
        Ok(reduced)
    }

    /// Adafactor, before the vote: the update this step will apply if committed (the loss scaler's
    /// verdict on `grad_norm`, previewed) readied by the owner from the reduced per-matrix `sums`, and its
    /// Σ update² per parameter all-reduced. Nothing when the step will be skipped (fp16 overflow: every
    /// rank sees the same norm).
    async fn prepare_adafactor(&mut self, grad_norm: f64, sums: Vec<f32>) -> Result<(), EngineError> {
        let (train, parallel) = (&self.trainer.config.train, &self.trainer.config.parallel);
        let mut scaler = self.trainer.loss_scale;
        let verdict =
            scaler.conclude(self.trainer.model.precision, grad_norm, train.grad_clip, parallel.loss_scale_window);
        let Update::Apply { grad_factor, .. } = verdict else {
            return Ok(());
        };
        let (step, lr, t) =
            (self.trainer.step, learning_rate(train, self.trainer.step), self.trainer.optimizer.step() + 1);
        let grad_factor = grad_factor as f32;
        let prepared = self
            .ask("preparing the update", |reply| ShardOwnerMsg::Prepare { step, grad_factor, lr, t, sums, reply })
            .await?;
        let mut update_sq = match prepared {
            Ok(update_sq) => update_sq,
            Err(refused) => return Err(self.owner_lost("preparing the update", &refused)),
        };
        self.comm.all_reduce(&mut update_sq[..], ReduceOp::Sum).await?;
        self.update_sq = update_sq;
        Ok(())
    }

    /// The second half, once the step is committed: the owner unscales and clips the staged gradients by
    /// the global norm and applies AdamW to the own shard and to every buddy copy — the same bits the
    /// buddy applies to its own — or the update is skipped when fp16 overflowed (every rank sees the same
    /// global norm, so every rank skips). Local to the rank, so it cannot fail half-way; it fails only if
    /// the owner died, and then this rank's state is lost. The replica's parameters are refreshed at the
    /// next step.
    pub async fn apply_update(&mut self, reduced: ReducedStep) -> Result<StepReport, EngineError> {
        let step = self.trainer.step;
        let train = self.trainer.config.train.clone();
        let loss_scale = self.trainer.loss_scale.scale;
        let update = self.trainer.conclude_step(reduced.grad_norm);
        let lr = learning_rate(&train, step);
        let Update::Apply { grad_factor, .. } = update else {
            self.trainer.step += 1;
            return Ok(self.trainer.report(step, reduced.loss, lr, &update, loss_scale));
        };
        let t = self.trainer.optimizer.step() + 1;
        let update_sq = std::mem::take(&mut self.update_sq);
        let update_of = OwnerUpdate { grad_factor: grad_factor as f32, lr, t, update_sq };
        let applied = self.ask("the update", |reply| ShardOwnerMsg::Apply { step, update: update_of, reply }).await?;
        match applied {
            Ok(buffers) => self.grads = buffers,
            Err(refused) => return Err(self.owner_lost("the update", &refused)),
        }
        self.trainer.optimizer.set_step(t);
        self.trainer.step += 1;
        self.params_stale = true;
        Ok(self.trainer.report(step, reduced.loss, lr, &update, loss_scale))
    }

    /// The whole committed state on rank 0, for a checkpoint: every rank sends its own shard (masters and
    /// moments) to rank 0, which assembles them into `spare` (a recycled snapshot) or a new state. A
    /// collective: every rank calls it; the others get `None`. `keep` false on rank 0 (no writer) still
    /// drains what the others send.
    pub async fn gather_state(
        &mut self,
        spare: Option<Box<TrainingState>>,
        keep: bool,
    ) -> Result<Option<Box<TrainingState>>, EngineError> {
        let (rank, world) = (self.rank(), self.world());
        if rank != 0 {
            let buf = Vec::with_capacity(3 * self.held[0].len());
            let buf = self.ask("packing the shard", |reply| ShardOwnerMsg::Pack(buf, reply)).await?;
            self.comm.send(0, &buf).await?;
            return Ok(None);
        }
        let state = spare.filter(|s| s.flat_len() == self.total).unwrap_or_else(|| {
            Box::new(TrainingState {
                config: self.trainer.config.clone(),
                step: 0,
                optimizer_step: 0,
                sampler: self.trainer.sampler.state(0, self.trainer.config.train.global_batch),
                tensors: tensor_specs(&self.trainer),
                values: [0, 1, 2].map(|_| vec![0f32; self.total]),
                loss_scale: None,
                periodic: None,
            })
        });
        let mut state = self.ask("copying the shard", |reply| ShardOwnerMsg::Fill(state, reply)).await?;
        let mut buf = Vec::new();
        for from in 1..world {
            let range = chunk_range(self.total, world, from);
            let n = range.len();
            buf.clear();
            buf.resize(3 * n, 0.0);
            self.comm.recv(from, &mut buf[..]).await?;
            for k in 0..3 {
                state.values[k][range.clone()].copy_from_slice(&buf[k * n..(k + 1) * n]);
            }
        }
        if !keep {
            return Ok(None);
        }
        let trainer = &self.trainer;
        state.config.clone_from(&trainer.config);
        state.tensors = tensor_specs(trainer);
        state.step = trainer.step;
        state.optimizer_step = trainer.optimizer.step();
        state.sampler = trainer.sampler.state(trainer.step, trainer.config.train.global_batch);
        state.loss_scale = scaler_of(trainer);
        Ok(Some(state))
    }

    /// The committed state to keep for the next attempt — handed back by the owner, which stops; None if
    /// `sync` found it lost or the owner died. A ZeRO-3 rank's parameters (rebuilt for `--save-final`)
    /// are dropped again.
    pub async fn into_state(mut self) -> Option<CommittedState> {
        if let Some(plane) = &mut self.device_plane {
            plane.abort();
        }
        if self.mode == ShardMode::Zero3 {
            zero3::release_params(&mut self.trainer);
        }
        let pieces = match (self.lost, self.owner.is_some()) {
            (true, _) => None,
            (false, true) => self.ask("handing the state back", ShardOwnerMsg::Export).await.ok(),
            (false, false) if self.fresh => return Some(CommittedState::Initial(Box::new(self.trainer))),
            (false, false) => Some(std::mem::take(&mut self.pieces)),
        };
        if let Some(owner) = self.owner.take() {
            owner.stop(None); // already stopping after Export; a lost owner is stopped here
        }
        Some(CommittedState::Sharded { trainer: Box::new(self.trainer), pieces: pieces? })
    }
}

impl<T: Transport> StepEngine for ShardedReplica<T> {
    fn rank(&self) -> usize {
        ShardedReplica::rank(self)
    }

    fn world(&self) -> usize {
        ShardedReplica::world(self)
    }

    fn trainer(&self) -> &Trainer {
        ShardedReplica::trainer(self)
    }

    /// Every rank takes part whatever `source` says: the shards are put together from whoever holds them.
    async fn sync(&mut self, _source: Option<usize>) -> Result<(), EngineError> {
        ShardedReplica::sync(self).await
    }

    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        self.reduce_gradients().await
    }

    fn usage(&mut self) -> Option<RankUsage> {
        self.step_usage()
    }

    fn gradient_collective(&self) -> &'static str {
        match (self.mode(), self.device_plane.is_some()) {
            (ShardMode::Zero2, false) => "reduce-scatter",
            (ShardMode::Zero2, true) => "reduce-scatter (device)",
            (_, false) => "all-reduce",
            (_, true) => "all-reduce (device)",
        }
    }

    /// An owner that died marks the rank's state lost; the next step fails.
    async fn apply(&mut self, reduced: ReducedStep) {
        if let Err(e) = self.apply_update(reduced).await {
            tracing::error!(rank = self.rank(), "{e}");
        }
    }

    /// The shards are gathered to rank 0 (the step loop waits for the transfer and the copy); rank 0
    /// writes the whole state from that one snapshot, as for DDP.
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let spare = writer.and_then(CheckpointWriter::take_spare);
        if let (Some(state), Some(writer)) = (self.gather_state(spare, writer.is_some()).await?, writer) {
            let world = self.world();
            let layout = Layout { dp: world, pp: 1, shard_mode: self.mode().layout(), shards: world };
            writer.submit(SaveRequest { state, layout, tag });
        }
        Ok(())
    }

    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        ShardedReplica::evaluate(self).await
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        self.refresh_params().await
    }

    async fn into_state(self) -> Option<CommittedState> {
        ShardedReplica::into_state(self).await
    }
}

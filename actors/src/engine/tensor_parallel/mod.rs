//! Tensor parallelism (× data parallelism) on the cluster: `parallel.tp = T` cuts every block's matrices
//! over T ranks (Megatron-LM's column/row-parallel layers, vocab-parallel embedding and cross-entropy,
//! sequence parallelism with `parallel.sp`; the maths is `troupe_model::tensor_parallel`).
//!
//! Rank `r` of a world of `T × D` ranks is tensor rank `r mod T` of model replica `r div T` (the
//! planner's order with `pp = 1`: a tensor group is T consecutive ranks, on as few hosts as possible).
//! The tensor group's collectives and the data-parallel gradient all-reduce (among the ranks of one
//! tensor index) run over [`Subgroup`]s of the attempt's mesh.
//!
//! State between attempts is [`CommittedState::Full`], layout-free: at the start of an attempt each rank
//! cuts its shards (parameters and the optimizer's state: AdamW's moments, or Adafactor's, see
//! [`adafactor`]) from the whole state with `TpLayout::shard`; at its
//! end (and for a checkpoint, an evaluation or `--save-final`) the tensor group all-gathers them back
//! with `TpLayout::gather`. Each rank also holds a buddy copy of the previous tensor rank's shard and
//! moments, updated in lockstep ([`Buddy`]). When a rank of a group is lost, the others' final gather
//! fails; the survivors then put the whole committed state together from their own shards and buddy
//! copies (a group of 2: the survivor alone, [`TensorParallelReplica::reassemble`]; larger: over a
//! subgroup of the survivors, [`TensorParallelReplica::gather_survivors`]) — every shard is there unless
//! two neighbouring ranks were lost, in which case they keep nothing and the next attempt starts from
//! another replica's ranks (which hold the whole committed state) or from the checkpoint. Their
//! collectives run over [`Subgroup`]s, whose receives fail on the loss of a member only, so a group
//! that lost no one completes its final gather; that gather runs in the next epoch, after this rank
//! fenced the attempt's, so that a computation left waiting on a peer that broke off (the attempt failed
//! elsewhere) fails at once instead of holding the shards for a collective timeout.

mod adafactor;
mod degree;
mod device;
mod group;
mod meter;
mod pipeline;
mod zero;

use std::any::Any;
use std::sync::Arc;

use tch::Tensor;
use tokio::runtime::Handle;
use tokio::task::JoinHandle;
use troupe_cluster::collective::{Collective, CollectiveConfig, Communicator, ReduceOp};
use troupe_cluster::transport::subgroup::Subgroup;
use troupe_cluster::transport::Transport;
use troupe_cluster::ClusterError;
use troupe_model::checkpoint::{CheckpointWriter, Layout, SaveRequest, TrainingState};
use troupe_model::data::{micro_batch_ranges, rank_slice};
use troupe_model::generate::Evaluation;
use troupe_model::model::Samples;
use troupe_model::optim::{learning_rate, scale_grads, AdamW, AdamWConfig, Optimizer};
use troupe_model::precision::{backward_weight, Update};
use troupe_model::tensor_parallel::{TpError, TpGroup, TpLayout, TpRank};
use troupe_model::transfer::upload;
use troupe_model::Trainer;

use super::committed::CommittedState;
use super::device_plane::DevicePlane;
use super::flat::{append_flat, broadcast_state, copy_from_flat, counter_words, flatten_on_device};
use super::pipeline::{costs_for, ModelCosts, PlanShape};
use super::shard_plan::ShardMode;
use super::step_engine::{EngineError, ReducedStep, StepEngine};
use crate::protocol::{rank_at, rank_coords, CollectiveKind, GroupKind, RankUsage};
use adafactor::{Preview, TpAdafactor, ZeroAdafactor};
pub use degree::{degree_change, degrees_to_try};
use device::{DevicePlanes, PlaneClient, Which};
use group::{values, CommGroup};
use meter::{Meter, Metered};

/// Collective group ids of the engine's subgroups (distinct from the attempt's and the other engines').
const TENSOR_GROUP: u32 = 0x5450_0001;
const DATA_GROUP: u32 = 0x5450_0002;
/// The final gather's group: a fresh sequence, so ranks whose attempt failed at different collectives
/// still meet.
const FINAL_GROUP: u32 = 0x5450_0003;
/// The survivors' gather, after the final one failed for a lost rank ([`TensorParallelReplica::gather_survivors`]).
const SURVIVOR_GROUP: u32 = 0x5450_0004;
/// With a pipeline: tensor rank t of every stage (activations, gradients, the stages' gather), and every
/// rank of the model replica (the norm and the loss); the final gather's chain.
const CHAIN_GROUP: u32 = 0x5450_0005;
const MODEL_GROUP: u32 = 0x5450_0006;
const FINAL_CHAIN_GROUP: u32 = 0x5450_0007;
/// The final gather's data-parallel group under ZeRO (its ranges of the moments and masters).
const FINAL_DATA_GROUP: u32 = 0x5450_0008;
/// The host communicators over which the tensor and data-parallel groups build their device planes
/// (NCCL's unique id travels on them).
const TENSOR_PLANE_GROUP: u32 = 0x5450_0009;
const DATA_PLANE_GROUP: u32 = 0x5450_000A;

/// What the blocking thread owns while it computes: the rank's shards, its groups, its AdamW and its
/// buddy copy.
struct Parts<T: Transport> {
    rank: TpRank,
    tp: CommGroup<T>,
    dp: Option<Metered<T>>,
    optimizer: AdamW,
    buddy: Option<Buddy>,
    /// With a pipeline (`parallel.pp` > 1): the stage's place in it.
    pipe: Option<pipeline::Pipe<T>>,
    /// `parallel.recompute`: each block's forward runs again at its backward.
    recompute: bool,
    /// `parallel.shard` (ZeRO) inside the data-parallel group: this rank's owned range of its shards.
    zero: Option<zero::Zero>,
    /// `train.optimizer = "adafactor"`: its state for the shards and the buddy copy (`optimizer` and
    /// the buddy's then only count the steps).
    adafactor: Option<TpAdafactor>,
    /// The data-parallel group's device plane (with several replicas on GPUs of their own): the
    /// gradient sum runs there instead of on `dp`.
    data_plane: Option<PlaneClient>,
}

/// This rank's copy of the previous rank's shard in its tensor group (tensor index `index`): its
/// parameters and AdamW moments, updated in lockstep — the owner sends it its gradients (after the
/// data-parallel average) in every step, and this rank applies the same update with the same factor,
/// so the copy and the owner's shard are the same bits at every committed step.
struct Buddy {
    index: usize,
    params: Vec<Tensor>,
    optimizer: AdamW,
}

impl Buddy {
    fn numel(&self) -> usize {
        self.params.iter().map(Tensor::numel).sum()
    }
}

/// One micro-batch: tokens, targets, its weight in the global batch's loss, its backward's weight (that
/// times fp16's loss scale: `precision::backward_weight`), and which samples of the step they are (LoRA's
/// dropout mask is a function of them).
type Batch = (Tensor, Tensor, f64, f64, Samples);

/// Whether a tensor-parallel job (`parallel.tp` > 1) keeps its shards, their gradients, AdamW moments
/// and buddy copies on the slot's device, its tensor group's collectives (and the data-parallel
/// gradient sum) on NCCL when the attempt's plane is NCCL: without a pipeline, without ZeRO inside the
/// data-parallel group and with AdamW (`plan::plane::runs_on_device` for the other engines).
pub fn tensor_parallel_on_device(config: &troupe_model::config::JobConfig) -> bool {
    let p = &config.parallel;
    p.tp > 1 && p.pp <= 1 && p.shard == "none" && config.train.optimizer == "adamw" && !p.periodic_sync()
}

/// A blocking computation: it gives back the parts and its result.
type Pending<T> = JoinHandle<(Parts<T>, Box<dyn Any + Send>)>;

/// Host communicators over a rank's tensor group and (with several model replicas) its data-parallel
/// group ([`TensorParallelReplica::plane_controls`]).
pub type PlaneControls<T> = (Communicator<Subgroup<T>>, Option<Communicator<Subgroup<T>>>);

/// Awaits `job`, serving the device planes' calls it makes meanwhile (see [`device`]).
async fn serving<T: Transport>(
    job: &mut Pending<T>,
    planes: Option<&mut DevicePlanes>,
) -> Result<(Parts<T>, Box<dyn Any + Send>), tokio::task::JoinError> {
    match planes {
        Some(planes) => tokio::select! {
            joined = job => joined,
            never = planes.serve() => match never {},
        },
        None => job.await,
    }
}

/// One rank of a tensor-parallel (× data-parallel) job.
pub struct TensorParallelReplica<T: Transport> {
    trainer: Trainer,
    comm: Communicator<T>,
    collective: CollectiveConfig,
    degree: usize,
    sp: bool,
    parts: Option<Parts<T>>,
    /// A blocking computation whose caller was dropped (the attempt aborted mid-step): it gives the
    /// parts back when it ends.
    pending: Option<Pending<T>>,
    /// The trainer's state was half overwritten (a broadcast that failed): nothing of it may be kept.
    lost: bool,
    /// The shards were cut: from then on they, not the trainer's parameters, are the state.
    sharded: bool,
    /// What the rank's groups sent in the current step.
    meter: Meter,
    /// The tensor and data-parallel groups' device planes, when the attempt runs on NCCL
    /// ([`Self::set_device_planes`]); served while a computation runs.
    planes: Option<DevicePlanes>,
    /// Where the rank's shards, their gradients, its optimizer state and buddy copy live (its slot's GPU:
    /// [`Self::place_on`]); the layout-free committed state stays in the trainer, in host memory.
    device: tch::Device,
}

impl<T: Transport> TensorParallelReplica<T> {
    /// Takes the rank's committed state (layout-free) for an attempt at tensor degree `degree` (the
    /// attempt's `parallel.tp`: the job's, or a smaller one after a loss; the state may come from an
    /// attempt at another); the shards are cut at [`StepEngine::sync`].
    pub fn adopt(
        state: CommittedState,
        comm: Communicator<T>,
        collective: CollectiveConfig,
        degree: usize,
    ) -> Result<Self, String> {
        let mut trainer = match state.materialised().map_err(|e| e.to_string())? {
            CommittedState::Full(trainer) => *trainer,
            _ => return Err("a tensor-parallel job was handed a sharded state; dropped".into()),
        };
        trainer.config.parallel.tp = degree.max(1);
        let (degree, sp, device) = (degree.max(1), trainer.config.parallel.sp, trainer.device);
        let meter = Meter::default();
        Ok(Self {
            trainer,
            comm,
            collective,
            degree,
            sp,
            parts: None,
            pending: None,
            lost: false,
            sharded: false,
            meter,
            planes: None,
            device,
        })
    }

    /// Puts the rank's shards, their gradients, its AdamW state and its buddy copy on `device` (its slot's
    /// GPU) when they are cut; the trainer's whole state stays where it is (host memory): the device
    /// never holds the whole model.
    pub fn place_on(&mut self, device: tch::Device) {
        self.device = device;
    }

    /// Host communicators over this rank's tensor group and, with several model replicas, its
    /// data-parallel group: what their device planes are built over (NCCL's unique id travels on them;
    /// the worker's `nccl_plane`).
    pub fn plane_controls(&self) -> Result<PlaneControls<T>, ClusterError> {
        let (epoch, collective) = (self.comm.epoch(), self.collective.clone());
        let tensor = Communicator::new(self.tensor_transport()?, TENSOR_PLANE_GROUP, epoch, collective.clone());
        let data = match self.replicas() > 1 {
            true => Some(Communicator::new(self.data_transport()?, DATA_PLANE_GROUP, epoch, collective)),
            false => None,
        };
        Ok((tensor, data))
    }

    /// Runs the tensor group's collectives on `tensor` and, with several model replicas, the
    /// data-parallel gradient sum on `data` (each this rank's member of its group's plane, as
    /// [`Self::plane_controls`] names the groups) instead of staging them through host memory. Refused
    /// for a layout whose shards stay on the host ([`tensor_parallel_on_device`]) or planes
    /// that are not this rank's groups.
    pub fn set_device_planes(
        &mut self,
        tensor: Box<dyn DevicePlane>,
        data: Option<Box<dyn DevicePlane>>,
    ) -> Result<(), String> {
        let config = &self.trainer.config;
        if !tensor_parallel_on_device(config) {
            return Err(format!(
                "tensor parallelism with pp = {}, shard = {:?} and optimizer = {:?} computes on the host: no device plane",
                config.parallel.pp, config.parallel.shard, config.train.optimizer
            ));
        }
        let (t, d) = self.coordinates();
        let mismatch = |what: &str, plane: &dyn DevicePlane, rank: usize, world: usize| {
            (plane.rank() != rank || plane.world() != world).then(|| {
                format!(
                    "the {what} group's device plane is rank {} of {}; this rank is {rank} of {world} there",
                    plane.rank(),
                    plane.world()
                )
            })
        };
        if let Some(why) = mismatch("tensor", tensor.as_ref(), t, self.degree) {
            return Err(why);
        }
        match (&data, self.replicas()) {
            (None, 1) => {}
            (Some(plane), replicas) if replicas > 1 => {
                if let Some(why) = mismatch("data-parallel", plane.as_ref(), d, replicas) {
                    return Err(why);
                }
            }
            (data, replicas) => {
                return Err(format!(
                    "{} data-parallel device plane for {replicas} model replica(s)",
                    if data.is_some() { "a" } else { "no" }
                ))
            }
        }
        self.planes = Some(DevicePlanes::new(tensor, data, self.device, &self.meter));
        Ok(())
    }

    /// The name of the device plane the groups' collectives run on (`nccl`, `fake-nccl`); None when
    /// they stage through host memory.
    pub fn device_plane(&self) -> Option<&'static str> {
        self.planes.as_ref().map(DevicePlanes::name)
    }

    /// This rank's index in its tensor group and its model replica (data-parallel index).
    fn coordinates(&self) -> (usize, usize) {
        let (t, d, _) = self.coords();
        (t, d)
    }

    /// This rank's (tensor index, model replica, pipeline stage): the planner's order, rank = t + T·(d +
    /// D·p) (`plan::placement`).
    fn coords(&self) -> (usize, usize, usize) {
        rank_coords(self.comm.rank(), self.degree, self.replicas())
    }

    /// The rank at (tensor index, model replica, pipeline stage).
    fn global(&self, t: usize, d: usize, p: usize) -> usize {
        rank_at((t, d, p), self.degree, self.replicas())
    }

    fn stages(&self) -> usize {
        self.trainer.config.parallel.pp.max(1)
    }

    fn replicas(&self) -> usize {
        (self.comm.world() / (self.degree * self.stages())).max(1)
    }

    fn subgroup(&self, members: Vec<usize>) -> Result<Arc<Subgroup<T>>, ClusterError> {
        Subgroup::new(self.comm.transport().clone(), members).map(Arc::new)
    }

    /// The tensor group's transport (the ranks of this rank's stage of its model replica).
    fn tensor_transport(&self) -> Result<Arc<Subgroup<T>>, ClusterError> {
        let (_, d, p) = self.coords();
        self.subgroup((0..self.degree).map(|t| self.global(t, d, p)).collect())
    }

    /// The data-parallel group's transport: the ranks of this rank's tensor index and stage, by replica.
    fn data_transport(&self) -> Result<Arc<Subgroup<T>>, ClusterError> {
        let (t, _, p) = self.coords();
        self.subgroup((0..self.replicas()).map(|d| self.global(t, d, p)).collect())
    }

    /// Whether ZeRO splits this rank's state over its data-parallel group.
    fn zero_sharded(&self) -> bool {
        self.parts.as_ref().is_some_and(|p| p.zero.is_some())
    }

    /// With a pipeline: tensor rank t of every stage of this rank's model replica, by stage.
    fn chain_transport(&self) -> Result<Arc<Subgroup<T>>, ClusterError> {
        let (t, d, _) = self.coords();
        self.subgroup((0..self.stages()).map(|p| self.global(t, d, p)).collect())
    }

    /// `parallel.balance = "measured"` with a pipeline: rank 0 times the whole model's parts on one
    /// micro-batch (the pipeline engine's `costs_for`; a part's share of a tensor rank's time is its share
    /// of the whole, its matrices split alike) and broadcasts the figures, so every rank cuts the chunks
    /// the same way. None: cut by parameter count.
    async fn measured_costs(&mut self) -> Result<Option<ModelCosts>, EngineError> {
        let config = &self.trainer.config;
        if self.stages() == 1 || config.parallel.balance != "measured" {
            return Ok(None);
        }
        let layers = config.model.n_layers;
        let mut flat = match self.comm.rank() {
            0 => {
                let microbatches = PlanShape::of(config, self.replicas()).map_err(EngineError::Setup)?.1.microbatches;
                let costs = costs_for(config, self.replicas(), microbatches);
                tracing::info!(?costs, "pipeline balance under tensor parallelism: measured seconds per part");
                costs.to_flat()
            }
            _ => vec![0.0; layers + 2],
        };
        self.comm.broadcast(&mut flat, 0).await?;
        Ok(Some(ModelCosts::from_flat(&flat, layers).expect("broadcast keeps the length")))
    }

    /// Cuts this rank's shards and AdamW moments from the trainer's whole state (a pipeline's chunks by
    /// `costs` when measured).
    fn shard(&mut self, costs: Option<ModelCosts>) -> Result<(), EngineError> {
        let (world, model_ranks) = (self.comm.world(), self.degree * self.stages());
        if !world.is_multiple_of(model_ranks) {
            return Err(EngineError::Setup(format!(
                "parallel.tp × parallel.pp = {model_ranks} does not divide the attempt's {world} ranks: the world must be \
                 tp × pp × data-parallel replicas",
            )));
        }
        let layout = TpLayout::new(&self.trainer.config.model, self.degree, self.sp)
            .map_err(|e| EngineError::Setup(format!("parallel.tp: {e}")))?;
        let (t, d, p) = self.coords();
        let (epoch, handle, collective) = (self.comm.epoch(), Handle::current(), self.collective.clone());
        let meter = &self.meter;
        let tp =
            Metered::new(self.tensor_transport()?, TENSOR_GROUP, epoch, collective.clone(), GroupKind::Tensor, meter);
        let dp = if self.replicas() > 1 {
            Some(Metered::new(self.data_transport()?, DATA_GROUP, epoch, collective.clone(), GroupKind::Data, meter))
        } else {
            None
        };
        let config = &self.trainer.config;
        let (pipe, runs) = if self.stages() > 1 {
            let geometry =
                pipeline::Geometry::of(config, self.replicas(), costs.as_ref()).map_err(EngineError::Setup)?;
            let runs = geometry.runs(config, p);
            let chain = Metered::new(
                self.chain_transport()?,
                CHAIN_GROUP,
                epoch,
                collective.clone(),
                GroupKind::Pipeline,
                meter,
            );
            let mut replica: Vec<usize> = (0..self.stages())
                .flat_map(|p| (0..self.degree).map(move |t| (t, p)))
                .map(|(t, p)| self.global(t, d, p))
                .collect();
            replica.sort_unstable();
            let model = Metered::new(
                self.subgroup(replica)?,
                MODEL_GROUP,
                epoch,
                collective.clone(),
                GroupKind::Pipeline,
                meter,
            );
            (Some(pipeline::Pipe::new(config, geometry, p, chain, model, &layout)), runs)
        } else {
            (None, vec![true; config.model.n_layers + 2])
        };
        let held = troupe_model::tensor_parallel::held_params(&config.model, &runs);
        let full: Vec<Tensor> = self.trainer.model.params().iter().map(Tensor::detach).collect();
        // The shards go to the rank's device (aliases of the trainer's tensors where that is theirs).
        let device = self.device;
        let placed = move |list: Vec<Tensor>| -> Vec<Tensor> { list.iter().map(|t| t.to_device(device)).collect() };
        let shards = placed(layout.shard_held(&full, t, &held));
        // With Adafactor its own state stands beside an AdamW that only counts the steps.
        let whole_adafactor = match &self.trainer.optimizer {
            Optimizer::Adafactor(whole) => Some(whole),
            Optimizer::AdamW(_) => None,
        };
        let (exp_avg, exp_avg_sq) = match whole_adafactor {
            Some(_) => (Vec::new(), Vec::new()),
            None => {
                let adamw = self.trainer.optimizer.adamw();
                let [exp_avg, exp_avg_sq] =
                    [&adamw.exp_avg, &adamw.exp_avg_sq].map(|m| placed(layout.shard_held(m, t, &held)));
                (exp_avg, exp_avg_sq)
            }
        };
        let decays: Vec<bool> = self.trainer.model.specs().iter().map(|s| s.decays()).collect();
        let zero_mode = ShardMode::of_config(&config.parallel.shard).filter(|_| dp.is_some());
        let zero = match (zero_mode, &dp) {
            (Some(mode), Some(_)) => {
                let moments = [exp_avg.as_slice(), exp_avg_sq.as_slice()];
                let mut zero = zero::Zero::new(mode, (d, self.replicas()), &shards, moments, &decays);
                let mut state = "AdamW moments";
                if let Some(whole) = whole_adafactor {
                    let params = (full.as_slice(), decays.as_slice());
                    zero = zero.with_adafactor(|own| ZeroAdafactor::new(whole, params, &layout, t, &held, own));
                    state = "Adafactor's moments, its matrices' statistics replicated";
                }
                let (owned, of) = zero.owned();
                tracing::info!(rank = self.comm.rank(), tensor_rank = t, replica = d, owned, of, "{mode:?} inside the data-parallel group: this replica owns {owned} of its tensor rank's {of} elements (masters and {state})");
                Some(zero)
            }
            _ => None,
        };
        // A buddy copy lets a tensor group that lost a rank put its stage together from its survivors (a
        // pipeline's other stages are whole); under ZeRO no replica holds the whole state: none there,
        // nor with `checkpoint.replicas = 0` (recovery from another replica or the checkpoint instead).
        let copies = self.trainer.config.checkpoint.replicas > 0;
        let buddy = (self.degree > 1 && zero.is_none() && copies).then(|| {
            let index = (t + self.degree - 1) % self.degree;
            let params: Vec<Tensor> = placed(layout.shard_held(&full, index, &held))
                .iter()
                .map(|s| s.detach().copy().set_requires_grad(true))
                .collect();
            let optimizer = match whole_adafactor {
                Some(_) => self.adamw(&params, &[], &[]),
                None => {
                    let adamw = self.trainer.optimizer.adamw();
                    let [exp_avg, exp_avg_sq] =
                        [&adamw.exp_avg, &adamw.exp_avg_sq].map(|m| placed(layout.shard_held(m, index, &held)));
                    self.adamw(&params, &exp_avg, &exp_avg_sq)
                }
            };
            Buddy { index, params, optimizer }
        });
        let adafactor = whole_adafactor
            .filter(|_| zero.is_none())
            .map(|whole| TpAdafactor::new(whole, &full, &decays, &layout, t, &held, buddy.as_ref().map(|b| b.index)));
        let mut rank = TpRank::running(layout, t, shards, runs);
        rank.precision = self.trainer.model.precision;
        let mut optimizer = self.adamw(rank.params(), &exp_avg, &exp_avg_sq);
        if zero.is_some() {
            // The moments live in the owned range; the optimizer only counts the steps.
            (optimizer.exp_avg, optimizer.exp_avg_sq) = (Vec::new(), Vec::new());
        }
        if let Some(buddy) = &buddy {
            let (own, copy) = (rank.params().iter().map(Tensor::numel).sum::<usize>(), buddy.numel());
            tracing::info!(
                rank = self.comm.rank(),
                tensor_rank = t,
                buddy_of = buddy.index,
                own_shard_elements = own,
                buddy_copy_bytes = 4 * 4 * copy,
                "buddy copy of tensor rank {}'s shard: parameters, AdamW moments and gradients ({} elements, 4 × fp32 each)",
                buddy.index,
                copy
            );
        }
        let recompute = self.trainer.config.parallel.recompute;
        let client = |which| self.planes.as_ref().and_then(|p| p.client(which));
        let (device, data_plane) = (client(Which::Tensor), client(Which::Data));
        let tp = CommGroup { comm: tp, handle, device };
        self.parts = Some(Parts { rank, tp, dp, optimizer, buddy, pipe, recompute, zero, adafactor, data_plane });
        self.sharded = true;
        Ok(())
    }

    /// An AdamW over `params` at the trainer's step, with the given moments (copied).
    fn adamw(&self, params: &[Tensor], exp_avg: &[Tensor], exp_avg_sq: &[Tensor]) -> AdamW {
        let decays = self.trainer.model.specs().iter().map(|s| s.decays()).collect();
        let mut optimizer = AdamW::new(AdamWConfig::from(&self.trainer.config.train), params, decays);
        optimizer.step = self.trainer.optimizer.step();
        optimizer.exp_avg = exp_avg.iter().map(Tensor::copy).collect();
        optimizer.exp_avg_sq = exp_avg_sq.iter().map(Tensor::copy).collect();
        optimizer
    }

    /// Gets the parts back from a blocking computation whose caller was dropped (serving its device
    /// planes' calls meanwhile: aborted ones fail at once).
    async fn reclaim(&mut self) {
        if let Some(mut job) = self.pending.take() {
            if let Ok((parts, _)) = serving(&mut job, self.planes.as_mut()).await {
                self.parts = Some(parts);
            }
        }
    }

    /// Runs `work` on the parts on a blocking thread (the model's tensor-parallel code is synchronous).
    async fn blocking<R: Send + 'static>(
        &mut self,
        work: impl FnOnce(&mut Parts<T>) -> R + Send + 'static,
    ) -> Result<R, EngineError> {
        self.reclaim().await;
        let Some(mut parts) = self.parts.take() else {
            return Err(EngineError::Setup("this rank's shards are gone (a computation of it panicked)".into()));
        };
        self.pending = Some(tokio::task::spawn_blocking(move || {
            let out = work(&mut parts);
            (parts, Box::new(out) as Box<dyn Any + Send>)
        }));
        let job = self.pending.as_mut().expect("just set");
        let joined = serving(job, self.planes.as_mut()).await;
        self.pending = None;
        let (parts, out) = joined.map_err(|e| EngineError::Setup(format!("the tensor-parallel computation: {e}")))?;
        self.parts = Some(parts);
        Ok(*out.downcast::<R>().expect("the computation's own result type"))
    }

    /// The step's micro-batches of this rank's model replica: of `train.micro_batch` samples, or with a
    /// pipeline its plan's count.
    fn batches(&self) -> Vec<Batch> {
        let (_, replica) = self.coordinates();
        let train = &self.trainer.config.train;
        let slice = rank_slice(train.global_batch, replica, self.replicas());
        let ranges = match self.parts.as_ref().and_then(|p| p.pipe.as_ref()) {
            Some(pipe) => super::pipeline::microbatch_ranges(slice, pipe.microbatches()),
            None => micro_batch_ranges(slice, train.micro_batch),
        };
        ranges
            .into_iter()
            .map(|range| {
                let weight = range.len() as f64 / train.global_batch as f64;
                let step = self.trainer.step;
                let backward = backward_weight(train, &self.trainer.loss_scale, step, &range);
                let samples = Samples::new(train.seed, step, range.start);
                let (tokens, targets) = self.trainer.sampler.batch(step, range);
                let device = self.device;
                (upload(&tokens, device), upload(&targets, device), weight, backward, samples)
            })
            .collect()
    }

    /// The whole state (parameters, the optimizer's state and counters) gathered from the tensor group into the
    /// trainer, on every rank of the group. With `fresh`, over a new sequence of collectives in the epoch
    /// after the attempt's (see [`StepEngine::into_state`]).
    async fn gather(&mut self, fresh: bool) -> Result<(), EngineError> {
        let counters = [self.trainer.step, self.parts.as_ref().map_or(0, |p| p.optimizer.step)];
        let fresh = match fresh {
            true => Some((
                self.tensor_transport()?,
                (self.stages() > 1).then(|| self.chain_transport()).transpose()?,
                self.zero_sharded().then(|| self.data_transport()).transpose()?,
            )),
            false => None,
        };
        let (epoch, collective, meter) = (self.comm.epoch() + 1, self.collective.clone(), self.meter.clone());
        let specs = self.trainer.model.specs().to_vec();
        // With a pipeline, a stage whose tensor group lost a rank is put together by its survivors from
        // their shards and buddy copies, and they go on to the chain's gather.
        let survivors = (fresh.is_some() && self.stages() > 1).then(|| self.survivors_of_group()).flatten();
        let gathered = self
            .blocking(move |parts| {
                if let Some((transport, chain, data)) = fresh {
                    let metered = |transport, id, group| Metered::new(transport, id, epoch, collective.clone(), group, &meter);
                    parts.tp.comm = metered(transport, FINAL_GROUP, GroupKind::Tensor);
                    (parts.tp.device, parts.data_plane) = (None, None);
                    if let (Some(pipe), Some(chain)) = (parts.pipe.as_mut(), chain) {
                        pipe.chain = metered(chain, FINAL_CHAIN_GROUP, GroupKind::Pipeline);
                    }
                    if let Some(data) = data {
                        parts.dp = Some(metered(data, FINAL_DATA_GROUP, GroupKind::Data));
                    }
                }
                let handle = parts.tp.handle.clone();
                if let (Some(zero), Some(dp)) = (parts.zero.as_mut(), parts.dp.as_mut()) {
                    zero.refresh(&mut parts.rank, dp, &handle)?;
                    [parts.optimizer.exp_avg, parts.optimizer.exp_avg_sq] = zero.gather_moments(dp, &handle)?;
                }
                let stage = gather_parts(parts, counters);
                if parts.zero.is_some() {
                    (parts.optimizer.exp_avg, parts.optimizer.exp_avg_sq) = (Vec::new(), Vec::new());
                }
                let stage = match (stage, survivors) {
                    (Ok(stage), _) => stage,
                    (Err(e), Some(survivors)) => {
                        let (held, comm) = survivors.now()?;
                        tracing::warn!(error = %e, survivors = ?held, "the stage's tensor group lost a rank: its survivors put the stage together from their shards and buddy copies");
                        gather_from_survivors(parts, comm, &held, counters)?
                    }
                    (Err(e), None) => return Err(e),
                };
                match parts.pipe.as_mut() {
                    Some(pipe) => pipe.gather_stages(&parts.tp.handle, stage, counters, &specs),
                    None => Ok(stage),
                }
            })
            .await?;
        self.keep(gathered.map_err(EngineError::TensorParallel)?, counters[1]);
        Ok(())
    }

    /// The whole state (parameters and the optimizer's two slots — AdamW's exp_avg and exp_avg_sq,
    /// Adafactor's packed ones — at `optimizer_step`) into the trainer, on its device.
    fn keep(&mut self, [params, first, second]: [Vec<Tensor>; 3], optimizer_step: u64) {
        copy_tensors(self.trainer.model.params(), &params);
        let device = self.trainer.device;
        let on_device = |list: Vec<Tensor>| list.into_iter().map(|t| t.to_device(device)).collect::<Vec<_>>();
        let (first, second) = (on_device(first), on_device(second));
        match &mut self.trainer.optimizer {
            Optimizer::AdamW(adamw) => (adamw.exp_avg, adamw.exp_avg_sq, adamw.step) = (first, second, optimizer_step),
            Optimizer::Adafactor(adafactor) => {
                for (i, slots) in first.into_iter().zip(second).enumerate() {
                    adafactor.unpack(i, slots.into());
                }
                adafactor.step = optimizer_step;
            }
        }
    }

    /// What the survivors of this rank's tensor group need to put its stage together after it lost a
    /// rank (with a pipeline: the final gather of [`Self::gather`]); None without a buddy copy.
    fn survivors_of_group(&self) -> Option<GroupSurvivors<T>> {
        self.parts.as_ref()?.buddy.as_ref()?;
        let (me, replica, stage) = self.coords();
        Some(GroupSurvivors {
            transport: self.comm.transport().clone(),
            members: (0..self.degree).map(|t| rank_at((t, replica, stage), self.degree, self.replicas())).collect(),
            me,
            epoch: self.comm.epoch() + 1,
            collective: self.collective.clone(),
        })
    }

    /// After the final gather failed: the ranks of this rank's tensor group the transport saw lost (a
    /// failed connection, not a goodbye) put the whole state together among the others from their own
    /// shards and buddy copies, over a subgroup of the survivors, into the trainer. Every shard is held
    /// by a survivor unless two neighbouring ranks were lost (rank t's copy is on t + 1). The survivors
    /// first all-gather their steps and the survivor set they saw: any difference (or a survivor that
    /// never comes) fails it, and they keep nothing. Gives the survivors' tensor ranks.
    async fn gather_survivors(&mut self) -> Result<Vec<usize>, String> {
        let Some(group) = self.survivors_of_group() else { return Err("this rank holds no buddy copy".into()) };
        let (survivors, comm) = group.now()?;
        let optimizer_step = self.parts.as_ref().map_or(0, |p| p.optimizer.step);
        let counters = [self.trainer.step, optimizer_step];
        let held = survivors.clone();
        let gathered = self
            .blocking(move |parts| gather_from_survivors(parts, comm, &held, counters))
            .await
            .map_err(|e| e.to_string())??;
        self.keep(gathered, optimizer_step);
        Ok(survivors)
    }
}

impl<T: Transport> TensorParallelReplica<T> {
    /// The whole state put together from this rank's own shard and its buddy copy into the trainer,
    /// when the two are every shard of the tensor group (tp = 2) at the same AdamW step — what the
    /// survivor of a tensor group that lost its other rank keeps. False (the trainer untouched) when
    /// they are not.
    fn reassemble(&mut self) -> bool {
        let Some(parts @ Parts { rank, optimizer, buddy: Some(buddy), pipe: None, .. }) = &self.parts else {
            return false;
        };
        if self.degree != 2 || optimizer.step != buddy.optimizer.step {
            return false;
        }
        let (own, copy) = (own_lists(parts), buddy_lists(parts).expect("a buddy copy"));
        let (own_first, step) = (rank.rank < buddy.index, optimizer.step);
        let mut whole = own.into_iter().zip(copy).map(|(own, copy)| {
            let per_rank = if own_first { [own, copy] } else { [copy, own] };
            rank.layout.gather(&per_rank)
        });
        let mut next = || whole.next().expect("three lists");
        self.keep([next(), next(), next()], step);
        true
    }
}

/// A tensor group's ranks as the survivors of a loss see them: the group's global ranks by tensor index,
/// this rank's index, and the epoch and collective settings of their gather.
struct GroupSurvivors<T: Transport> {
    transport: Arc<T>,
    members: Vec<usize>,
    me: usize,
    epoch: u64,
    collective: CollectiveConfig,
}

impl<T: Transport> GroupSurvivors<T> {
    /// The tensor ranks the transport saw lost (a failed connection, not a goodbye) left out: the
    /// survivors' tensor ranks and their communicator; an error when none was lost or two neighbouring
    /// ranks were (rank t's shard was only on t and t + 1).
    fn now(self) -> Result<(Vec<usize>, Communicator<Subgroup<T>>), String> {
        use futures::FutureExt;
        let degree = self.members.len();
        let lost: Vec<usize> = (0..degree)
            .filter(|&t| t != self.me && self.transport.loss_among(&[self.members[t]]).now_or_never().is_some())
            .collect();
        if lost.is_empty() {
            return Err("no rank of the tensor group was lost".into());
        }
        if let Some(t) = lost.iter().find(|&&t| lost.contains(&((t + 1) % degree))) {
            return Err(format!(
                "tensor ranks {t} and {} were both lost: rank {t}'s shard was only on them",
                (t + 1) % degree
            ));
        }
        let survivors: Vec<usize> = (0..degree).filter(|t| !lost.contains(t)).collect();
        let members = survivors.iter().map(|&t| self.members[t]).collect();
        let group = Subgroup::new(self.transport, members).map_err(|e| e.to_string())?;
        Ok((survivors, Communicator::new(Arc::new(group), SURVIVOR_GROUP, self.epoch, self.collective)))
    }
}

/// A shard's state as three lists (handles, not copies): parameters (detached), exp_avg, exp_avg_sq.
fn state_lists(params: &[Tensor], optimizer: &AdamW) -> [Vec<Tensor>; 3] {
    [
        params.iter().map(Tensor::detach).collect(),
        optimizer.exp_avg.iter().map(Tensor::shallow_clone).collect(),
        optimizer.exp_avg_sq.iter().map(Tensor::shallow_clone).collect(),
    ]
}

/// The rank's own shard's state as three lists (AdamW's or Adafactor's two slots).
fn own_lists<T: Transport>(parts: &Parts<T>) -> [Vec<Tensor>; 3] {
    match &parts.adafactor {
        Some(adafactor) => adafactor.lists(false, parts.rank.params()),
        None => state_lists(parts.rank.params(), &parts.optimizer),
    }
}

/// The buddy copy's state as three lists; None without one.
fn buddy_lists<T: Transport>(parts: &Parts<T>) -> Option<[Vec<Tensor>; 3]> {
    let buddy = parts.buddy.as_ref()?;
    Some(match &parts.adafactor {
        Some(adafactor) => adafactor.lists(true, &buddy.params),
        None => state_lists(&buddy.params, &buddy.optimizer),
    })
}

fn copy_tensors(dst: &[Tensor], src: &[Tensor]) {
    tch::no_grad(|| {
        for (d, s) in dst.iter().zip(src) {
            d.shallow_clone().copy_(s);
        }
    });
}

/// The tensor group's shards all-gathered into whole lists (parameters, exp_avg, exp_avg_sq); an error
/// when the ranks' counters differ (some applied a step the others did not).
fn gather_parts<T: Transport>(parts: &mut Parts<T>, counters: [u64; 2]) -> Result<[Vec<Tensor>; 3], String> {
    let n = parts.tp.size();
    let mine: Vec<f32> = counters.iter().flat_map(|&c| counter_words(c)).collect();
    let mut all = vec![0.0f32; mine.len() * n];
    let handle = parts.tp.handle.clone();
    handle.block_on(parts.tp.comm.all_gather(&mine[..], &mut all[..])).map_err(|e| e.to_string())?;
    if all.chunks(mine.len()).any(|c| c != &mine[..]) {
        return Err(format!("the tensor group's ranks hold different steps ({all:?}); its state is dropped"));
    }
    let layout = &parts.rank.layout;
    // The shards' shapes (a pipeline stage's: empty for the parameters it does not hold).
    let shapes: Vec<Vec<i64>> = parts.rank.params().iter().map(Tensor::size).collect();
    let lists = own_lists(parts);
    let mut out: Vec<Vec<Tensor>> = Vec::with_capacity(3);
    for list in lists {
        let mut flat = Vec::new();
        append_flat(&list.iter().map(Tensor::contiguous).collect::<Vec<_>>(), &mut flat);
        let mut everyone = vec![0.0f32; flat.len() * n];
        handle.block_on(parts.tp.comm.all_gather(&flat[..], &mut everyone[..])).map_err(|e| e.to_string())?;
        let per_rank: Vec<Vec<Tensor>> = everyone.chunks(flat.len()).map(|chunk| unflatten(chunk, &shapes)).collect();
        out.push(layout.gather(&per_rank));
    }
    let [a, b, c]: [Vec<Tensor>; 3] = out.try_into().map_err(|_| "three lists".to_string())?;
    Ok([a, b, c])
}

/// One rank's shard list (of `shapes`) from its flat values.
fn unflatten(flat: &[f32], shapes: &[Vec<i64>]) -> Vec<Tensor> {
    let shards: Vec<Tensor> = shapes.iter().map(|s| Tensor::zeros(s.as_slice(), tch::kind::FLOAT_CPU)).collect();
    copy_from_flat(&shards, flat);
    shards
}

/// The whole lists (parameters, exp_avg, exp_avg_sq) all-gathered over `comm`, the subgroup of the tensor
/// group's survivors (tensor ranks `survivors`, this rank among them): each gives its own shard and its
/// buddy copy. An error when the survivors saw different survivor sets, hold different steps, or some
/// shard is in none of them.
fn gather_from_survivors<T: Transport>(
    parts: &mut Parts<T>,
    mut comm: Communicator<Subgroup<T>>,
    survivors: &[usize],
    counters: [u64; 2],
) -> Result<[Vec<Tensor>; 3], String> {
    let Some(buddy) = &parts.buddy else { return Err("this rank holds no buddy copy".into()) };
    let (degree, handle) = (parts.tp.size(), parts.tp.handle.clone());
    let mut mine: Vec<f32> = counters.iter().chain([&buddy.optimizer.step]).flat_map(|&c| counter_words(c)).collect();
    mine.extend((0..degree).map(|t| if survivors.contains(&t) { 1.0 } else { 0.0 }));
    let mut all = vec![0.0f32; mine.len() * survivors.len()];
    handle.block_on(comm.all_gather(&mine[..], &mut all[..])).map_err(|e| e.to_string())?;
    if all.chunks(mine.len()).any(|c| c != &mine[..]) || counters[1] != buddy.optimizer.step {
        return Err(format!(
            "the survivors saw different survivors or hold different steps ({all:?}, buddy copy at AdamW step {}); \
             their state is dropped",
            buddy.optimizer.step
        ));
    }
    let layout = &parts.rank.layout;
    // The shards' shapes (a pipeline stage's: empty for the parameters it does not hold; the buddy copy
    // holds the same ones of its neighbour).
    let shapes: Vec<Vec<i64>> = parts.rank.params().iter().map(Tensor::size).collect();
    let (own, copy) = (own_lists(parts), buddy_lists(parts).expect("a buddy copy"));
    let mut out: Vec<Vec<Tensor>> = Vec::with_capacity(3);
    for (own, copy) in own.into_iter().zip(copy) {
        let mut flat = Vec::new();
        append_flat(&own.iter().map(Tensor::contiguous).collect::<Vec<_>>(), &mut flat);
        let half = flat.len();
        append_flat(&copy.iter().map(Tensor::contiguous).collect::<Vec<_>>(), &mut flat);
        if flat.len() != 2 * half {
            return Err("a buddy copy's shapes differ from the rank's own shard's".into());
        }
        let mut everyone = vec![0.0f32; flat.len() * survivors.len()];
        handle.block_on(comm.all_gather(&flat[..], &mut everyone[..])).map_err(|e| e.to_string())?;
        let mut per_rank: Vec<Option<Vec<Tensor>>> = (0..degree).map(|_| None).collect();
        for (held, &t) in everyone.chunks(flat.len()).zip(survivors) {
            let (shard, previous) = held.split_at(half);
            per_rank[t] = Some(unflatten(shard, &shapes));
            per_rank[(t + degree - 1) % degree].get_or_insert_with(|| unflatten(previous, &shapes));
        }
        let Some(per_rank) = per_rank.into_iter().collect::<Option<Vec<_>>>() else {
            return Err("a tensor rank's shard is on no survivor".into());
        };
        out.push(layout.gather(&per_rank));
    }
    let [a, b, c]: [Vec<Tensor>; 3] = out.try_into().map_err(|_| "three lists".to_string())?;
    Ok([a, b, c])
}

/// The forward and backward of the rank's micro-batches (each backward weighted as the reference weights
/// it: its share of the batch times fp16's loss scale), the gradients averaged over the data-parallel
/// group, and the global norm of those (scaled) gradients: (loss, norm).
fn compute<T: Transport>(parts: &mut Parts<T>, batches: Vec<Batch>) -> Result<(f64, f64), String> {
    let e = |e: TpError| e.to_string();
    let handle = parts.tp.handle.clone();
    if let (Some(zero), Some(dp)) = (parts.zero.as_mut(), parts.dp.as_mut()) {
        zero.refresh(&mut parts.rank, dp, &handle)?;
    }
    let params: Vec<Tensor> = parts.rank.params().iter().map(Tensor::shallow_clone).collect();
    let mut sum: Vec<Tensor> = params.iter().map(|p| p.detach().zeros_like()).collect();
    let mut loss = 0.0;
    for (tokens, targets, weight, backward, samples) in batches {
        for p in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let (rank, samples) = (&parts.rank, Some(samples));
        let loss_of = if parts.recompute { TpRank::loss_and_backward_recomputed } else { TpRank::loss_and_backward };
        loss += loss_of(rank, &mut parts.tp, &tokens, &targets, samples, backward).map_err(e)? * weight;
        tch::no_grad(|| {
            for (acc, p) in sum.iter_mut().zip(&params) {
                if p.grad().defined() {
                    *acc += p.grad();
                }
            }
        });
    }
    if let (Some(zero), Some(dp)) = (parts.zero.as_mut(), parts.dp.as_mut()) {
        let mut flat = Vec::new();
        append_flat(&sum, &mut flat);
        zero.reduce(flat, dp, &handle)?;
        let held = parts.rank.held().to_vec();
        let [split, replicated] = zero.squares(&parts.rank.layout, &held, parts.tp.comm.rank() == 0);
        let mut words = [split as f32, replicated as f32, loss as f32];
        handle.block_on(dp.all_reduce(&mut words[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
        handle.block_on(parts.tp.comm.all_reduce(&mut words[..2], ReduceOp::Sum)).map_err(|e| e.to_string())?;
        return Ok((f64::from(words[2]), (f64::from(words[0]) + f64::from(words[1])).sqrt()));
    }
    let (flat, summed) = match (parts.data_plane.as_ref(), parts.dp.as_mut()) {
        (Some(plane), Some(_)) => sum_on_device(&params, &sum, loss, plane, parts.buddy.is_some())?,
        (_, dp) => {
            let mut flat = Vec::new();
            append_flat(&sum, &mut flat);
            flat.push(loss as f32);
            sum_over_replicas(&params, flat, dp, &handle)?
        }
    };
    if parts.dp.is_some() {
        loss = f64::from(summed);
    }
    refresh_buddy(parts.buddy.as_ref(), &parts.rank, &mut parts.tp, flat)?;
    let norm = parts.rank.grad_norm(&mut parts.tp).map_err(e)?;
    Ok((loss, norm))
}

/// With Adafactor, readies its update once the global norm `norm` is known (whatever the layout: with or
/// without a pipeline, with or without ZeRO): over the tensor group, after the data-parallel group
/// under ZeRO. Nothing with AdamW.
fn prepare_adafactor<T: Transport>(parts: &mut Parts<T>, preview: Preview, norm: f64) -> Result<(), String> {
    let t = parts.optimizer.step + 1;
    if let Some(adafactor) = parts.adafactor.as_mut() {
        return adafactor.prepare(parts.rank.params(), &mut parts.tp, preview, norm, t);
    }
    if let (Some(zero), Some(dp)) = (parts.zero.as_mut(), parts.dp.as_mut()) {
        let active = parts.rank.params().iter().map(|p| p.grad().defined()).collect();
        let handle = parts.tp.handle.clone();
        zero.prepare(active, [dp, &mut parts.tp.comm], &handle, (preview, norm), t)?;
    }
    Ok(())
}

/// `flat` (the rank's gradients, flat, then the loss word) summed over the data-parallel group when there
/// is one and copied back into `params`' gradients (a parameter that took no part in the forward keeps
/// none, and AdamW leaves it alone); gives the gradients, flat, and the summed loss word.
fn sum_over_replicas<T: Transport>(
    params: &[Tensor],
    mut flat: Vec<f32>,
    dp: Option<&mut Metered<T>>,
    handle: &Handle,
) -> Result<(Vec<f32>, f32), String> {
    if let Some(dp) = dp {
        handle.block_on(dp.all_reduce(&mut flat[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
    }
    let loss = flat.pop().expect("the loss word");
    let mut offset = 0;
    for p in params {
        let n = p.numel();
        if p.grad().defined() {
            copy_from_flat(&[p.grad()], &flat[offset..offset + n]);
        }
        offset += n;
    }
    Ok((flat, loss))
}

/// [`sum_over_replicas`] on the data-parallel group's device plane: the rank's gradient sums `sum` and
/// its loss word summed over the group on the device and copied into `params`' gradients where they
/// have one; gives the summed gradients flat in host memory only `for_buddy` (the buddy copy's
/// exchange runs on the host communicator), and the summed loss word.
fn sum_on_device(
    params: &[Tensor],
    sum: &[Tensor],
    loss: f64,
    plane: &PlaneClient,
    for_buddy: bool,
) -> Result<(Vec<f32>, f32), String> {
    let grads = flatten_on_device(sum);
    let word = Tensor::from_slice(&[loss as f32]).to_device(grads.device());
    let flat = plane.call(CollectiveKind::AllReduce, &Tensor::cat(&[grads, word], 0)).map_err(|e| e.to_string())?;
    let total = flat.numel() as i64 - 1;
    let mut offset = 0;
    tch::no_grad(|| {
        for p in params {
            let n = p.numel() as i64;
            let mut grad = p.grad();
            if grad.defined() {
                grad.copy_(&flat.narrow(0, offset, n).view_as(p));
            }
            offset += n;
        }
    });
    let loss = flat.double_value(&[total]) as f32;
    let grads = if for_buddy { values(&flat.narrow(0, 0, total)) } else { Vec::new() };
    Ok((grads, loss))
}

/// The buddy exchange of a step: this rank sends its shard's gradients (`grads`, flat, after the
/// data-parallel average; with one word per parameter saying whether it has one) to the next rank of
/// its tensor group and takes the previous rank's, which become its copy's gradients.
fn refresh_buddy<T: Transport>(
    buddy: Option<&Buddy>,
    rank: &TpRank,
    tp: &mut CommGroup<T>,
    mut grads: Vec<f32>,
) -> Result<(), String> {
    let Some(buddy) = buddy else { return Ok(()) };
    let n = tp.size();
    let me = tp.rank();
    grads.extend(rank.params().iter().map(|p| if p.grad().defined() { 1.0f32 } else { 0.0 }));
    let mut theirs = vec![0.0f32; buddy.numel() + buddy.params.len()];
    let handle = tp.handle.clone();
    handle.block_on(tp.comm.send((me + 1) % n, &grads[..])).map_err(|e| e.to_string())?;
    handle.block_on(tp.comm.recv(buddy.index, &mut theirs[..])).map_err(|e| e.to_string())?;
    let (values, defined) = theirs.split_at(buddy.numel());
    let mut offset = 0;
    for (p, &has) in buddy.params.iter().zip(defined) {
        let numel = p.numel();
        let g = Tensor::from_slice(&values[offset..offset + numel]).view(p.size().as_slice()).to_device(p.device());
        offset += numel;
        set_grad(p, if has == 1.0 { Some(&g) } else { None });
    }
    Ok(())
}

/// What the rank holds after a step's reduction (see [`RankUsage`]), and `sent`, its groups' traffic.
fn usage_of<T: Transport>(parts: &Parts<T>, sent: Vec<crate::protocol::SentBytes>) -> RankUsage {
    let bytes = |t: &Tensor| troupe_model::tensor_bytes(t) as u64;
    let all = |list: &[Tensor]| list.iter().map(bytes).sum::<u64>();
    let grads = |list: &[Tensor]| list.iter().map(Tensor::grad).filter(Tensor::defined).map(|g| bytes(&g)).sum::<u64>();
    let moments = |o: &AdamW| all(&o.exp_avg) + all(&o.exp_avg_sq);
    let params = parts.rank.params();
    let (zero_grad, zero_state) = parts.zero.as_ref().map_or((0, 0), zero::Zero::held_bytes);
    let (adafactor, adafactor_buddy) = parts.adafactor.as_ref().map_or((0, 0), TpAdafactor::bytes);
    let buddy =
        parts.buddy.as_ref().map_or(0, |b| all(&b.params) + grads(&b.params) + moments(&b.optimizer) + adafactor_buddy);
    RankUsage {
        param_bytes: all(params),
        grad_bytes: grads(params) + zero_grad,
        optimizer_bytes: moments(&parts.optimizer) + zero_state + adafactor,
        buddy_bytes: buddy,
        activation_bytes: Some(parts.rank.take_activation_peak() as u64),
        step_seconds: 0.0,
        sent,
    }
}

/// Makes `grad` the gradient of the leaf `p` (or leaves it none). A leaf's gradient is only ever
/// written by a backward: the first one of `Σ p·grad` gives it `grad` exactly (the sum's backward is
/// ones, the product's `ones · grad`).
fn set_grad(p: &Tensor, grad: Option<&Tensor>) {
    let mut current = p.grad();
    match (grad, current.defined()) {
        (Some(g), true) => tch::no_grad(|| {
            current.copy_(g);
        }),
        (Some(g), false) => (p * g).sum(tch::Kind::Float).backward(),
        (None, true) => tch::no_grad(|| {
            let _ = current.zero_();
        }),
        (None, false) => {}
    }
}

impl<T: Transport> StepEngine for TensorParallelReplica<T> {
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
        if let Some(source) = source {
            self.lost = true;
            broadcast_state(&mut self.comm, &mut self.trainer, &mut Vec::new(), source).await?;
            self.lost = false;
        }
        let costs = self.measured_costs().await?;
        self.shard(costs)
    }

    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        let started = std::time::Instant::now();
        let batches = self.batches();
        self.meter.take();
        let (train, trainer) = (&self.trainer.config.train, &self.trainer);
        let preview = Preview {
            scaler: trainer.loss_scale,
            precision: trainer.model.precision,
            grad_clip: train.grad_clip,
            window: trainer.config.parallel.loss_scale_window,
            lr: learning_rate(train, trainer.step),
        };
        let step = move |parts: &mut Parts<T>| {
            parts.rank.take_activation_peak();
            let (loss, norm) = match parts.pipe.is_some() {
                true => pipeline::compute(parts, batches)?,
                false => compute(parts, batches)?,
            };
            prepare_adafactor(parts, preview, norm).map(|()| (loss, norm))
        };
        let (loss, grad_norm) = self.blocking(step).await?.map_err(EngineError::TensorParallel)?;
        Ok(ReducedStep { loss, grad_norm, compute_seconds: started.elapsed().as_secs_f64() })
    }

    /// The rank's shards, gradients, AdamW state and buddy copy, its peak activations and what its groups
    /// sent, of the step just reduced.
    fn usage(&mut self) -> Option<RankUsage> {
        let parts = self.parts.as_ref()?;
        Some(usage_of(parts, self.meter.take()))
    }

    async fn apply(&mut self, reduced: ReducedStep) {
        self.reclaim().await;
        let step = self.trainer.step;
        let update = self.trainer.conclude_step(reduced.grad_norm);
        let lr = learning_rate(&self.trainer.config.train, step);
        let train = &self.trainer.config.train;
        if let (Update::Apply { grad_factor, .. }, Some(parts)) = (update, self.parts.as_mut()) {
            if let Some(zero) = parts.zero.as_mut() {
                parts.optimizer.step += 1;
                zero.apply(&mut parts.rank, train, lr, parts.optimizer.step, grad_factor);
                self.trainer.step += 1;
                return;
            }
            if let Some(adafactor) = parts.adafactor.as_mut() {
                // Readied before the vote: the factor is applied inside it.
                parts.optimizer.step += 1;
                let buddy = parts.buddy.as_mut().map(|b| {
                    b.optimizer.step += 1;
                    b.params.as_mut_slice()
                });
                adafactor.apply(parts.rank.params_mut(), buddy);
                self.trainer.step += 1;
                return;
            }
            scale_grads(parts.rank.params(), grad_factor);
            parts.optimizer.apply(parts.rank.params_mut(), lr);
            if let Some(buddy) = &mut parts.buddy {
                scale_grads(&buddy.params, grad_factor);
                buddy.optimizer.apply(&mut buddy.params, lr);
            }
        }
        self.trainer.step += 1;
    }

    /// The tensor group of replica 0 gathers the whole state; rank 0 submits it (layout-free).
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        // Under ZeRO every replica holds part of the moments: all gather.
        if self.coordinates().1 != 0 && !self.zero_sharded() {
            return Ok(());
        }
        self.gather(false).await?;
        if let Some(writer) = writer {
            let state = Box::new(TrainingState::snapshot(&self.trainer));
            writer.submit(SaveRequest { state, layout: Layout::ddp(self.replicas()), tag });
        }
        Ok(())
    }

    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        if self.trainer.validation.is_none() {
            return Ok(None);
        }
        self.gather(false).await?;
        Ok(self.trainer.evaluate())
    }

    async fn finish(&mut self) -> Result<(), EngineError> {
        self.gather(false).await
    }

    /// The tensor group's shards gathered whole. The attempt is over: its epoch is fenced first, so that
    /// a computation still waiting on a peer (one that broke off when the attempt failed elsewhere) ends
    /// at once and gives the shards back; the gather runs in the next epoch.
    async fn into_state(mut self) -> Option<CommittedState> {
        if self.lost {
            return None;
        }
        self.comm.transport().fence(self.comm.epoch() + 1);
        // The attempt's device planes end with it: a call still in flight fails at once.
        if let Some(planes) = self.planes.as_mut() {
            planes.abort();
        }
        self.reclaim().await;
        self.planes = None;
        if !self.sharded {
            // The trainer still holds the attempt's starting state.
            return Some(CommittedState::Full(Box::new(self.trainer)));
        }
        match self.gather(true).await {
            Ok(()) => Some(CommittedState::Full(Box::new(self.trainer))),
            Err(e) if self.reassemble() => {
                tracing::warn!(rank = self.comm.rank(), error = %e, step = self.trainer.step, "the tensor group's state could not be gathered; this rank keeps the whole state of its last step from its own shard and its buddy copy");
                Some(CommittedState::Full(Box::new(self.trainer)))
            }
            Err(e) if self.stages() > 1 => {
                tracing::warn!(rank = self.comm.rank(), error = %e, step = self.trainer.step, "the pipeline's state could not be gathered along this rank's chain (a rank of it was lost); this rank keeps nothing");
                None
            }
            Err(e) => match self.gather_survivors().await {
                Ok(survivors) => {
                    tracing::warn!(rank = self.comm.rank(), error = %e, step = self.trainer.step, ?survivors, "the tensor group's state could not be gathered; its survivors put the whole state of its last step together from their own shards and buddy copies");
                    Some(CommittedState::Full(Box::new(self.trainer)))
                }
                Err(why) => {
                    tracing::warn!(rank = self.comm.rank(), error = %e, survivors = %why, "the tensor group's state could not be gathered, nor put together from its survivors' shards and buddy copies; this rank keeps nothing");
                    None
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use troupe_cluster::transport::memory::MemoryTransport;
    use troupe_cluster::TransportConfig;
    use troupe_model::config::JobConfig;

    use super::*;

    /// Replica 0 (ranks 0 and 1) of a tp = 2 × dp = 2 attempt on the in-memory mesh. Rank 0's step is
    /// left waiting on rank 1, whose step never runs (it broke off), and is aborted; then both end the
    /// attempt. Rank 0's computation, waiting on a message that will never come, must not hold its shards
    /// for the collective timeout: both keep the whole committed state, at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_left_waiting_on_a_peer_that_broke_off_does_not_cost_the_groups_state() {
        tch::set_num_threads(1);
        let mut config = JobConfig::small_llama(4);
        config.parallel.tp = 2;
        let transport = TransportConfig { collective_timeout_ms: 30_000, ..TransportConfig::default() };
        let collective = CollectiveConfig::from(&transport);
        let mesh: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(4, 1024).into_iter().map(Arc::new).collect();
        let replica = |rank: usize| {
            let trainer = Trainer::new(config.clone()).expect("a trainer");
            let comm = Communicator::new(mesh[rank].clone(), 0, 3, collective.clone());
            TensorParallelReplica::adopt(CommittedState::Full(Box::new(trainer)), comm, collective.clone(), 2)
                .expect("adopted")
        };
        let (mut r0, mut r1) = (replica(0), replica(1));
        r0.sync(None).await.expect("rank 0's shards");
        r1.sync(None).await.expect("rank 1's shards");
        let step = tokio::time::timeout(Duration::from_millis(300), r0.reduce()).await;
        assert!(step.is_err(), "rank 0's step cannot complete without rank 1");

        let started = Instant::now();
        let (s0, s1) = tokio::join!(r0.into_state(), r1.into_state());
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(10), "the end of the attempt waited {waited:?} (timeout 30 s)");
        let initial = Trainer::new(config.clone()).expect("a trainer");
        for (rank, state) in [s0, s1].into_iter().enumerate() {
            let Some(CommittedState::Full(trainer)) = state else { panic!("rank {rank} kept nothing") };
            assert_eq!((trainer.step, trainer.optimizer.step()), (0, 0), "rank {rank}");
            for (p, q) in trainer.model.params().iter().zip(initial.model.params()) {
                assert!(p.equal(q), "rank {rank}: the gathered parameters are the committed ones");
            }
        }
    }
}

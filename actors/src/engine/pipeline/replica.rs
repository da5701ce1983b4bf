//! A pipeline job on the cluster: each rank of the attempt is one device of one pipeline replica, driven
//! by the worker's step protocol through [`StepEngine`] like the DDP and ZeRO engines.
//!
//! Rank `r` of a world of `P × D` ranks is replica `r mod D` of device (stage) `r div D`, Megatron's
//! order: a stage's `D` replicas are consecutive ranks — on as few hosts as possible, since ranks are
//! numbered slot by slot in node-id order and the stage's gradient all-reduce is the heavy traffic — and
//! pipeline neighbours are `D` ranks apart, the next block of slots. Both groups are [`Subgroup`]s of
//! the attempt's one mesh (QUIC between hosts, Unix sockets on one): activations and gradients travel
//! between a replica's devices, the stage's gradient all-reduce among its replicas, the flush (norm and
//! loss) along each replica's chain.
//!
//! The device itself is a [`StageActor`] holding the [`PipelineStage`], spawned when the attempt's state
//! is in place and linked under the rank's WorkerActor (its supervisor): the step loop asks it to
//! `Reduce` (the ops and reductions, before the vote) and to `Apply` (after `Commit`), and takes its
//! state back with `Export` when the attempt ends. A panic in the stage stops only the actor: the worker
//! hears of it as a supervision event, the pending call fails, the attempt fails, and this rank's state is
//! gone (a stage's other replicas or a checkpoint restore it, as for a lost node).
//!
//! State between attempts is [`CommittedState::Sharded`]: the masters and optimizer slots (AdamW's
//! moments, or Adafactor's state packed as a checkpoint packs it) of the device's
//! chunks as pieces of the flat parameter order, with the trainer carrying only the counters, the config
//! and the sampler. At the start of an attempt [`reshard`] gives every rank its device's chunks at the
//! most advanced committed step, from whichever rank holds them — a stage's other replicas, a rank of
//! another layout, or a checkpoint — so the world may shrink and grow by whole pipelines (`pp` kept,
//! `dp` recomputed) with nothing lost while one replica of every stage survives.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorCell, ActorRef, RpcReplyPort};

use troupe_cluster::collective::{Collective, CollectiveConfig, Communicator};
use troupe_cluster::transport::subgroup::Subgroup;
use troupe_cluster::transport::Transport;
use troupe_model::checkpoint::{CheckpointWriter, Layout, SaveRequest, ShardMode, TrainingState};
use troupe_model::generate::Evaluation;
use troupe_model::model::ModelConfig;
use troupe_model::trainer::scaler_of;
use troupe_model::Trainer;

use super::super::committed::{full_piece, tensor_specs, CommittedState, ShardPiece};
use super::super::reshard::{reshard, Held};
use super::super::step_engine::{EngineError, OpTiming, ReducedStep, StepEngine};
use super::super::zero3;
use super::actor::{StageActor, StageCounters, StageMsg};
use super::{
    category, check, costs_for, held_ranges, op_name, partition, partition_by, plan, tied_copy_range, ChunkLayout,
    DataParallelGroup, ModelCosts, OpSpan, PipelineError, PipelineStage, Plan, PlanShape, ReducedStage, ScheduleKind,
};

/// Tag group of the flush's collectives along a replica's chain.
const FLUSH_GROUP: u32 = 0x5049_5001;
/// Tag group of a stage's gradient all-reduce among its replicas.
const STAGE_REPLICAS_GROUP: u32 = 0x5049_5002;

/// The pipeline geometry of an attempt of `world` ranks.
#[derive(Clone, Debug)]
struct Geometry {
    kind: ScheduleKind,
    shape: PlanShape,
    replicas: usize,
    /// ZeRO-1/2/3 inside each stage's group of replicas (`parallel.shard`, with more than one replica).
    sharded: bool,
    /// Buddy copies each sharded replica keeps of the other replicas' parts (`checkpoint.replicas`).
    copies: usize,
    layouts: Vec<ChunkLayout>,
    total: usize,
    /// A tied model's embedding matrix, which the head's device keeps a copy of.
    model: ModelConfig,
}

impl Geometry {
    fn of(trainer: &Trainer, world: usize) -> Result<Self, String> {
        let config = &trainer.config;
        let parallel = &config.parallel;
        let stages = parallel.pp;
        if world == 0 || !world.is_multiple_of(stages) {
            return Err(format!("{world} ranks do not make whole pipelines of parallel.pp = {stages} stages"));
        }
        let replicas = world / stages;
        let (kind, shape) = PlanShape::of(config, replicas)?;
        let layouts = partition(&config.model, shape.chunks()).map_err(|e| e.to_string())?;
        let total = layouts.iter().map(|l| l.numel).sum();
        let sharded = replicas > 1 && parallel.shard != "none";
        let copies = config.checkpoint.replicas;
        let model = config.model.clone();
        Ok(Self { kind, shape, replicas, sharded, copies, layouts, total, model })
    }

    /// The chunks cut by `costs` instead of parameter counts.
    fn rebalance(&mut self, config: &ModelConfig, costs: &ModelCosts) -> Result<(), String> {
        self.layouts = partition_by(config, costs, self.shape.chunks()).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn device_of(&self, rank: usize) -> usize {
        rank / self.replicas
    }

    fn replica_of(&self, rank: usize) -> usize {
        rank % self.replicas
    }

    /// The flat ranges rank `rank` holds: its device's chunks, or (sharded) its owned part of them, then
    /// its copies of its buddies' parts, then a tied head's copy of the embedding matrix.
    fn needed(&self, rank: usize) -> Vec<Range<usize>> {
        let (device, sharded_among) =
            (self.device_of(rank), self.sharded.then_some((self.replica_of(rank), self.replicas)));
        let mut ranges = held_ranges(self.shape, &self.layouts, device, sharded_among, self.copies);
        ranges.extend(tied_copy_range(&self.model, self.shape, device));
        ranges
    }

    /// The flat ranges rank `rank` contributes to a checkpoint: what it holds, without buddy copies (or a
    /// tied head's copy of the embedding matrix, which follows them).
    fn owned(&self, rank: usize) -> Vec<Range<usize>> {
        let sharded_among = self.sharded.then_some((self.replica_of(rank), self.replicas));
        held_ranges(self.shape, &self.layouts, self.device_of(rank), sharded_among, 0)
    }

    /// Whether rank `rank`'s pieces are part of the whole state gathered for a checkpoint: replica 0 of
    /// every device, or every rank when sharded.
    fn is_holder(&self, rank: usize) -> bool {
        self.sharded || self.replica_of(rank) == 0
    }
}

/// One rank of a pipeline job on the cluster.
pub struct PipelineReplica<T: Transport> {
    /// Step counters, config, sampler; its parameters are empty tensors (the stage holds the chunks),
    /// except after [`StepEngine::finish`] on rank 0.
    trainer: Trainer,
    comm: Communicator<T>,
    collective: CollectiveConfig,
    /// Before `sync`: what the rank held when the attempt began; after, empty (the stage holds it).
    pieces: Vec<ShardPiece>,
    /// Before `sync`: the rank holds a fresh job's step 0 ([`CommittedState::Initial`]; `pieces` is
    /// empty), read by range when `sync` knows the layout.
    fresh: bool,
    /// The device's actor, once synced.
    stage: Option<StageHandle>,
    /// Where the stage actor is linked: the rank's WorkerActor (None: spawned unsupervised).
    supervisor: Option<ActorCell>,
    geometry: Option<Geometry>,
    origin: Instant,
    /// The ops of the last `reduce`, for [`StepEngine::op_spans`].
    last_ops: Vec<OpSpan>,
    /// The device's usage in the step just reduced, for the step's usage report.
    last_usage: Option<crate::protocol::RankUsage>,
    /// `sync` found the state of the most advanced step incomplete, or the stage actor died: this
    /// rank's state is dropped.
    lost: bool,
}

/// This rank's stage actor and the device it runs.
struct StageHandle {
    actor: ActorRef<StageMsg>,
    device: usize,
}

/// Spawns the device's actor, linked under `supervisor` (the worker) when there is one.
async fn spawn_stage<T: Transport>(
    supervisor: Option<ActorCell>,
    stage: PipelineStage<Subgroup<T>>,
) -> Result<StageHandle, EngineError> {
    let device = stage.device();
    let spawned = match supervisor {
        Some(worker) => Actor::spawn_linked(None, StageActor::default(), stage, worker).await,
        None => Actor::spawn(None, StageActor::default(), stage).await,
    };
    let (actor, _) =
        spawned.map_err(|e| PipelineError::Actor { device, reason: format!("spawning the stage actor: {e}") })?;
    Ok(StageHandle { actor, device })
}

impl<T: Transport> PipelineReplica<T> {
    /// Takes a rank's committed state for a new attempt over `comm` (the attempt's whole world). Nothing
    /// is sent: [`StepEngine::sync`] builds the stage.
    /// The stage actor will be linked under `supervisor` (the rank's WorkerActor).
    pub fn adopt(
        state: CommittedState,
        comm: Communicator<T>,
        collective: CollectiveConfig,
        supervisor: Option<ActorCell>,
    ) -> Self {
        let fresh = matches!(state, CommittedState::Initial(_));
        let (mut trainer, pieces) = match state {
            CommittedState::Sharded { trainer, pieces } => (*trainer, pieces),
            CommittedState::Initial(trainer) => (*trainer, Vec::new()),
            CommittedState::Full(trainer) | CommittedState::Periodic { trainer, .. } => {
                let trainer = *trainer;
                let piece = full_piece(&trainer);
                (trainer, vec![piece])
            }
        };
        trainer.optimizer.clear_state();
        zero3::release_params(&mut trainer);
        Self {
            trainer,
            comm,
            collective,
            pieces,
            fresh,
            stage: None,
            supervisor,
            geometry: None,
            origin: Instant::now(),
            last_ops: Vec::new(),
            last_usage: None,
            lost: false,
        }
    }

    /// The device this rank runs, once synced.
    pub fn device(&self) -> Option<usize> {
        self.stage.as_ref().map(|s| s.device)
    }

    /// The device's actor, once synced (a child of the worker given to [`Self::adopt`]).
    pub fn stage_actor(&self) -> Option<ActorCell> {
        self.stage.as_ref().map(|s| s.actor.get_cell())
    }

    /// Asks the stage actor; an actor that died (a panic in the stage) fails the call, and this rank's
    /// state with it.
    async fn ask<R: Send + 'static>(
        &mut self,
        what: &str,
        msg: impl FnOnce(RpcReplyPort<R>) -> StageMsg,
    ) -> Result<R, EngineError> {
        let stage = self.stage.as_ref().expect("PipelineReplica::sync before the first step");
        let device = stage.device;
        let failed = match super::super::ask_actor(&stage.actor, msg).await {
            Ok(reply) => return Ok(reply),
            Err(failed) => failed,
        };
        self.lost = true;
        let reason = format!("the stage actor's {what}: {failed}; this rank's state of the device is lost");
        Err(PipelineError::Actor { device, reason }.into())
    }

    /// The device's pieces and counters, from its actor.
    async fn export(&mut self) -> Result<(Vec<ShardPiece>, StageCounters), EngineError> {
        self.ask("export", StageMsg::Export).await
    }

    /// Builds this rank's stage over subgroups of the attempt's mesh.
    fn build_stage(&self, geometry: &Geometry) -> Result<PipelineStage<Subgroup<T>>, String> {
        let (rank, stages, replicas) = (self.comm.rank(), geometry.shape.stages, geometry.replicas);
        let (replica, device) = (geometry.replica_of(rank), geometry.device_of(rank));
        let transport = self.comm.transport().clone();
        let chain: Vec<usize> = (0..stages).map(|s| s * replicas + replica).collect();
        let group = |members| Subgroup::new(transport.clone(), members).map(Arc::new).map_err(|e| e.to_string());
        let pipeline = group(chain)?;
        let epoch = self.comm.epoch();
        let flush = Communicator::new(pipeline.clone(), FLUSH_GROUP, epoch, self.collective.clone());
        let data_parallel = if geometry.replicas > 1 {
            let peers = group((0..replicas).map(|d| device * replicas + d).collect())?;
            let comm = Communicator::new(peers, STAGE_REPLICAS_GROUP, epoch, self.collective.clone());
            Some(DataParallelGroup { comm })
        } else {
            None
        };
        let plan: Arc<Plan> = Arc::new(plan(geometry.kind, geometry.shape).map_err(|e| e.to_string())?);
        check(&plan).map_err(|e| format!("generated plan {} {:?} is invalid: {e}", geometry.kind, geometry.shape))?;
        let timeout_ms = self.collective.collective_timeout_ms;
        let config = self.trainer.config.clone();
        PipelineStage::new(
            config,
            plan,
            &geometry.layouts,
            device,
            pipeline,
            flush,
            data_parallel,
            timeout_ms,
            self.origin,
        )
        .map_err(|e| e.to_string())
    }

    /// The whole committed state on rank 0 (replica 0's devices each send their chunks; with ZeRO inside
    /// the stages' groups every rank sends its owned part): masters, moments, counters. A collective; the
    /// other ranks get None.
    async fn gather_state(&mut self) -> Result<Option<TrainingState>, EngineError> {
        let geometry = self.geometry.clone().expect("synced");
        let rank = self.comm.rank();
        if !geometry.is_holder(rank) {
            return Ok(None); // another replica of the stage: replica 0 holds the same
        }
        let (mut pieces, _) = self.export().await?;
        pieces.truncate(geometry.owned(rank).len()); // the buddy copies follow the owned part
        if rank != 0 {
            let mut buf = Vec::new();
            for piece in &pieces {
                for v in [&piece.master, &piece.exp_avg, &piece.exp_avg_sq] {
                    buf.extend_from_slice(v);
                }
            }
            self.comm.send(0, &buf).await?;
            return Ok(None);
        }
        let mut values = [0, 1, 2].map(|_| vec![0f32; geometry.total]);
        let mut place = |range: &Range<usize>, parts: [&[f32]; 3]| {
            for (k, part) in parts.into_iter().enumerate() {
                values[k][range.clone()].copy_from_slice(part);
            }
        };
        for piece in &pieces {
            place(&piece.range, [&piece.master, &piece.exp_avg, &piece.exp_avg_sq]);
        }
        let mut buf = Vec::new();
        for holder in (1..self.comm.world()).filter(|&r| geometry.is_holder(r)) {
            let ranges = geometry.owned(holder);
            let n: usize = ranges.iter().map(Range::len).sum();
            buf.clear();
            buf.resize(3 * n, 0.0);
            self.comm.recv(holder, &mut buf[..]).await?;
            let mut at = 0;
            for range in &ranges {
                let len = range.len();
                let part = |k: usize| &buf[at + k * len..at + (k + 1) * len];
                place(range, [part(0), part(1), part(2)]);
                at += 3 * len;
            }
        }
        let trainer = &self.trainer;
        Ok(Some(TrainingState {
            config: trainer.config.clone(),
            step: trainer.step,
            optimizer_step: trainer.optimizer.step(),
            sampler: trainer.sampler.state(trainer.step, trainer.config.train.global_batch),
            tensors: tensor_specs(trainer),
            values,
            loss_scale: scaler_of(trainer),
            periodic: None,
        }))
    }

    /// `parallel.balance = "measured"`: rank 0 times the model's parts on one micro-batch (once per shape
    /// in its process) and broadcasts the figures, so every rank cuts the chunks the same way.
    async fn measured_costs(&mut self, geometry: &Geometry) -> Result<ModelCosts, EngineError> {
        let config = &self.trainer.config;
        let layers = config.model.n_layers;
        let mut flat = if self.comm.rank() == 0 {
            let costs = costs_for(config, geometry.replicas, geometry.shape.microbatches);
            tracing::info!(?costs, "pipeline balance: measured seconds of forward and backward per part");
            costs.to_flat()
        } else {
            vec![0.0; layers + 2]
        };
        self.comm.broadcast(&mut flat, 0).await?;
        Ok(ModelCosts::from_flat(&flat, layers).expect("broadcast keeps the length"))
    }

    /// The stage's counters into the trainer (what the worker reads and the committed state keeps).
    fn mirror_counters(&mut self, counters: StageCounters) {
        self.trainer.step = counters.step;
        self.trainer.optimizer.set_step(counters.optimizer_step);
        self.trainer.loss_scale = counters.loss_scale;
    }
}

impl<T: Transport> StepEngine for PipelineReplica<T> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// Every rank takes part whatever `source` says: the chunks are put together from whoever holds them.
    async fn sync(&mut self, _source: Option<usize>) -> Result<(), EngineError> {
        let mut geometry = Geometry::of(&self.trainer, self.comm.world()).map_err(EngineError::Setup)?;
        if self.trainer.config.parallel.balance == "measured" {
            let costs = self.measured_costs(&geometry).await?;
            geometry.rebalance(&self.trainer.config.model, &costs).map_err(EngineError::Setup)?;
        }
        let held = if self.fresh { Held::fresh(&self.trainer) } else { Held::of(&self.trainer, &self.pieces) };
        let resharded = match reshard(&mut self.comm, geometry.total, held, |r| geometry.needed(r)).await {
            Ok(resharded) => resharded,
            Err(e) => {
                self.lost = matches!(e, EngineError::StateLost { .. });
                return Err(e);
            }
        };
        self.origin = Instant::now();
        let mut stage = self.build_stage(&geometry).map_err(EngineError::Setup)?;
        stage.load_state(&resharded.pieces, resharded.step, resharded.optimizer_step, resharded.loss_scale);
        let counters = StageCounters::of(&stage);
        self.stage = Some(spawn_stage(self.supervisor.clone(), stage).await?);
        self.pieces = Vec::new();
        self.fresh = false;
        self.geometry = Some(geometry);
        self.mirror_counters(counters);
        Ok(())
    }

    /// The device's ops of the plan, the gradient all-reduce among the stage's replicas and the flush.
    /// `compute_seconds` runs until the device's last op ended; the rest was the reductions.
    async fn reduce(&mut self) -> Result<ReducedStep, EngineError> {
        let origin = self.origin;
        let started = origin.elapsed().as_secs_f64();
        // Dropped with this future (the worker abandons a step on `Abort`), the sender tells the actor to
        // stop the step's ops at once, so the end of the attempt does not wait for them behind `Export`.
        let (_abandon_when_dropped, abandon) = tokio::sync::oneshot::channel();
        let reduced = self.ask("step", |reply| StageMsg::Reduce { abandon, reply }).await??;
        let ops_end = reduced.spans.last().map_or(started, |s| s.end_s);
        self.last_ops = reduced.spans;
        self.last_usage = reduced.usage;
        Ok(ReducedStep { loss: reduced.loss, grad_norm: reduced.grad_norm, compute_seconds: ops_end - started })
    }

    /// The device's parameters, gradients, optimizer state, buddy parts and traffic (see
    /// `PipelineStage::usage`), of the step just reduced.
    fn usage(&mut self) -> Option<crate::protocol::RankUsage> {
        self.last_usage.take()
    }

    fn op_spans(&mut self) -> Option<Vec<OpTiming>> {
        let at = |s: f64| self.origin + Duration::from_secs_f64(s.max(0.0));
        let spans = std::mem::take(&mut self.last_ops);
        let timed = spans.iter().map(|span| {
            let op = span.op;
            OpTiming {
                name: format!("{} c{} mb{}", op_name(op.kind), op.chunk, op.microbatch),
                cat: category(op.kind),
                start: at(span.start_s),
                end: at(span.end_s),
                chunk: op.chunk,
                microbatch: op.microbatch,
            }
        });
        Some(timed.collect())
    }

    /// The update runs in the stage actor. If the actor died since the vote, the rank's state is gone
    /// (`into_state` gives None) and the next step fails the attempt.
    async fn apply(&mut self, reduced: ReducedStep) {
        let reduced = ReducedStage { loss: reduced.loss, grad_norm: reduced.grad_norm, spans: Vec::new(), usage: None };
        if let Ok(counters) = self.ask("update", |reply| StageMsg::Apply(reduced, reply)).await {
            self.mirror_counters(counters);
        }
    }

    /// Replica 0's devices send their chunks to rank 0, which writes the whole state (any layout loads it).
    async fn checkpoint(&mut self, writer: Option<&CheckpointWriter>, tag: u64) -> Result<(), EngineError> {
        let Some(state) = self.gather_state().await? else { return Ok(()) };
        let Some(writer) = writer else { return Ok(()) };
        let geometry = self.geometry.as_ref().expect("synced");
        let (pp, dp) = (geometry.shape.stages, geometry.replicas);
        let shard_mode = match (geometry.sharded, self.trainer.config.parallel.shard.as_str()) {
            (true, "zero1") => ShardMode::Zero1,
            (true, "zero2") => ShardMode::Zero2,
            (true, _) => ShardMode::Zero3,
            (false, _) => ShardMode::Ddp,
        };
        let layout = Layout { dp, pp, shard_mode, shards: pp };
        writer.submit(SaveRequest { state: Box::new(state), layout, tag });
        Ok(())
    }

    /// The stage actor runs its part of the forward-only pass (dropped with this future on an abort, the
    /// sender tells it to stop, as for `reduce`).
    async fn evaluate(&mut self) -> Result<Option<Evaluation>, EngineError> {
        let Some(windows) = self.trainer.validation.clone() else { return Ok(None) };
        let (_abandon_when_dropped, abandon) = tokio::sync::oneshot::channel();
        let eval = self.ask("evaluation", |reply| StageMsg::Evaluate { windows, abandon, reply }).await??;
        Ok(Some(eval))
    }

    /// The whole parameters on rank 0 (for `--save-final`).
    async fn finish(&mut self) -> Result<(), EngineError> {
        if let Some(state) = self.gather_state().await? {
            zero3::restore_params(&mut self.trainer, &state.values[0]);
        }
        Ok(())
    }

    /// Takes the state back from the stage actor and stops it.
    async fn into_state(mut self) -> Option<CommittedState> {
        let pieces = match (self.lost, self.stage.is_some()) {
            (true, _) => None,
            (false, true) => self.export().await.ok().map(|(pieces, counters)| {
                self.mirror_counters(counters);
                pieces
            }),
            (false, false) if self.fresh => return Some(CommittedState::Initial(Box::new(self.trainer))),
            (false, false) => Some(std::mem::take(&mut self.pieces)),
        };
        if let Some(stage) = self.stage.take() {
            stage.actor.stop(None);
        }
        let pieces = pieces?;
        zero3::release_params(&mut self.trainer);
        Some(CommittedState::Sharded { trainer: Box::new(self.trainer), pieces })
    }
}

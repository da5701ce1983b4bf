//! WorkerActor: one per device slot (a GPU ordinal, or a CPU slot). Holds, per job, the committed
//! training state of its rank, and runs attempts of the job's step protocol as a task it can abort.
//!
//! On a CUDA slot, a DDP, ZeRO-1/2/3 or tensor-parallel rank's model and gradients live on the slot's
//! GPU (`plan::plane::runs_on_device`; ZeRO-3's units one at a time; a tensor rank's shards; the other
//! engines compute on the host for now), and when the controller chose the NCCL plane for the attempt,
//! its gradients are reduced (and ZeRO's masters or units gathered, a tensor group's activations
//! reduced and gathered) there by NCCL (`engine::device_plane`), the communicator built for the
//! attempt's epoch over the attempt's mesh (a tensor-parallel rank: one over its tensor group and one
//! over its data-parallel group).
//!
//! What a restart loses and keeps: a restarted worker starts empty — the committed state of its jobs is
//! gone, and the next attempt copies it from another rank (`Start.source`). Nothing else is lost: the
//! controller holds the job, and the attempt that was running is reported failed by the node.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::mpsc;
use troupe_cluster::collective::{CollectiveConfig, Communicator, HostLayout};
use troupe_cluster::transport::quic::{bind_endpoint, PeerInfo, QuicTransport};
use troupe_cluster::transport::routed::Routed;
use troupe_cluster::transport::same_host::{socket_path, SameHostTransport};
use troupe_cluster::transport::tcp::{TcpPayloads, TcpTransport};
use troupe_cluster::transport::Transport;
use troupe_cluster::{NodeIdentity, TransportConfig};
use troupe_model::checkpoint::{self, CheckpointStore, CheckpointWriter, WriteReport};
use troupe_model::Trainer;

use super::messages::NodeMsg;
pub use super::messages::WorkerMsg;
use crate::engine::pipeline::PipelineReplica;
use crate::engine::{
    CommittedState, DataParallelReplica, EngineError, OpTiming, PeriodicReplica, ReducedStep, ShardMode,
    ShardedReplica, StepEngine, TensorParallelReplica, DEFAULT_BUCKET_BYTES,
};
use crate::protocol::{
    AttemptOutcome, DataPlane, EvalFigures, GradientPlane, JobId, JobSpec, RankUsage, SlotDevice, StageTime,
    StepFigures, ToController,
};
use crate::telemetry::link_bytes::Counted;
use crate::telemetry::{otel, NodeMetrics, PhaseRecorder};

pub struct WorkerArgs {
    pub slot: u32,
    /// What this slot computes on (node.toml `devices`).
    pub device: SlotDevice,
    /// The node's `telemetry.peak_tflops_per_slot`: the MFU denominator when set.
    pub peak_tflops: Option<f64>,
    pub node: ActorRef<NodeMsg>,
    pub identity: Arc<NodeIdentity>,
    pub host: IpAddr,
    pub transport: TransportConfig,
    /// Where the data plane's bytes per peer are counted.
    pub metrics: Arc<NodeMetrics>,
    /// The node's running attempt threads, which its drain waits for.
    pub attempts: AttemptThreads,
}

/// The attempt threads of one node's workers that have not ended. An aborted attempt ends at its next
/// await point: a step already in libtorch finishes first. A node that drains waits for them, so that a
/// process exiting after its drain never tears libtorch down under a step still computing.
#[derive(Clone, Default)]
pub struct AttemptThreads(Arc<tokio::sync::watch::Sender<usize>>);

/// Counts one attempt thread from its start to its end (the guard is dropped on the thread, last).
struct AttemptThread(AttemptThreads);

impl AttemptThreads {
    fn started(&self) -> AttemptThread {
        self.0.send_modify(|n| *n += 1);
        AttemptThread(self.clone())
    }

    /// The threads running now.
    pub fn running(&self) -> usize {
        *self.0.borrow()
    }

    /// Waits until no attempt thread runs, at most `bound`; false if some still ran then.
    pub async fn ended(&self, bound: Duration) -> bool {
        let mut rx = self.0.subscribe();
        let ended = tokio::time::timeout(bound, rx.wait_for(|n| *n == 0)).await.is_ok();
        ended
    }
}

impl Drop for AttemptThread {
    fn drop(&mut self) {
        self.0 .0.send_modify(|n| *n -= 1);
    }
}

/// What the worker tells a running attempt task: the controller committed a step, or the attempt ends.
enum AttemptSignal {
    Commit(u64),
    Abort,
}

struct Prepared {
    attempt: u64,
    rank: usize,
    epoch: u64,
    spec: Box<JobSpec>,
    endpoint: quinn::Endpoint,
    /// When this preparation restored the rank's state from a durable checkpoint.
    restored: Option<(Instant, Instant)>,
}

#[derive(Default)]
struct JobSlot {
    /// The rank's committed state (see `CommittedState`); taken by a running attempt.
    state: Option<CommittedState>,
    prepared: Option<Prepared>,
    /// The running attempt's number and control channel.
    running: Option<(u64, mpsc::UnboundedSender<AttemptSignal>)>,
    /// A Prepare that arrived while the previous attempt was still handing its state back.
    deferred: Option<WorkerMsg>,
    /// The job's checkpoint writer, once this worker has been rank 0 of an attempt; it outlives
    /// attempts, so a save in flight is never abandoned or doubled by the next attempt.
    writer: Option<Arc<CheckpointWriter>>,
}

pub struct WorkerState {
    args: WorkerArgs,
    jobs: HashMap<JobId, JobSlot>,
}

pub struct WorkerActor;

impl Actor for WorkerActor {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(&self, _me: ActorRef<WorkerMsg>, args: WorkerArgs) -> Result<WorkerState, ActorProcessingErr> {
        Ok(WorkerState { args, jobs: HashMap::new() })
    }

    /// One arm per [`WorkerMsg`], kept in one match (over 70 lines) so that the worker's side of the
    /// protocol reads in one place; each arm's work is a method of [`WorkerState`].
    async fn handle(
        &self,
        me: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            msg @ WorkerMsg::Prepare { .. } => {
                let WorkerMsg::Prepare { job, .. } = &msg else { unreachable!() };
                let slot = state.jobs.entry(*job).or_default();
                if slot.running.is_some() {
                    slot.deferred = Some(msg);
                    return Ok(());
                }
                state.prepare(msg);
            }
            WorkerMsg::Start { job, attempt, roster, source, plane } => {
                state.start(&me, job, attempt, roster, source, plane)
            }
            WorkerMsg::Commit { job, attempt, step } => state.control(job, attempt, AttemptSignal::Commit(step)),
            WorkerMsg::Abort { job, attempt } => {
                state.control(job, attempt, AttemptSignal::Abort);
                if let Some(slot) = state.jobs.get_mut(&job) {
                    slot.prepared.take_if(|p| p.attempt == attempt);
                }
            }
            WorkerMsg::Release { job } => {
                if let Some(slot) = state.jobs.remove(&job) {
                    if let Some((_, ctl)) = slot.running {
                        let _ = ctl.send(AttemptSignal::Abort);
                    }
                }
            }
            WorkerMsg::Retain { jobs } => {
                let ended: Vec<JobId> = state.jobs.keys().filter(|job| !jobs.contains(job)).copied().collect();
                for job in ended {
                    tracing::info!(
                        job,
                        slot = state.args.slot,
                        "dropping the state of a job that ended while this node was away"
                    );
                    if let Some((_, ctl)) = state.jobs.remove(&job).and_then(|slot| slot.running) {
                        let _ = ctl.send(AttemptSignal::Abort);
                    }
                }
            }
            WorkerMsg::AbortAll { keep } => {
                for slot in state.jobs.values_mut() {
                    if let Some((_, ctl)) = &slot.running {
                        let _ = ctl.send(AttemptSignal::Abort);
                    }
                    slot.prepared = None;
                    slot.deferred = None;
                }
                state.jobs.retain(|job, _| keep.contains(job));
            }
            WorkerMsg::DropAll => {
                for (_, slot) in state.jobs.drain() {
                    if let Some((_, ctl)) = slot.running {
                        let _ = ctl.send(AttemptSignal::Abort);
                    }
                }
            }
            WorkerMsg::Returned { job, attempt, state: committed, outcome } => {
                let me_slot = state.args.slot;
                if let Some(slot) = state.jobs.get_mut(&job) {
                    if slot.running.as_ref().is_some_and(|r| r.0 == attempt) {
                        slot.running = None;
                    }
                    slot.state = committed;
                    let deferred = slot.deferred.take();
                    state.report(ToController::Ended { job, attempt, slot: me_slot, outcome });
                    if let Some(prepare) = deferred {
                        state.prepare(prepare);
                    }
                }
            }
            WorkerMsg::Panic(why) => panic!("injected worker fault: {why}"),
        }
        Ok(())
    }

    /// The worker's children are its attempts' stage actors. One that stops is expected (its attempt
    /// ended); one that fails (a panic in the stage) is logged, and its attempt — whose pending call to
    /// it fails — ends failed with this rank's state of the device dropped. Neither stops the worker
    /// (ractor's default would).
    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<WorkerMsg>,
        event: SupervisionEvent,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match event {
            SupervisionEvent::ActorFailed(child, reason) => {
                tracing::warn!(slot = state.args.slot, child = %child.get_id(), "a stage or shard-owner actor failed: {reason}; its attempt fails and this rank's state it held is dropped");
            }
            SupervisionEvent::ActorTerminated(child, _, _) => {
                tracing::debug!(slot = state.args.slot, child = %child.get_id(), "a stage or shard-owner actor stopped");
            }
            _ => {}
        }
        Ok(())
    }
}

impl WorkerState {
    fn report(&self, msg: ToController) {
        let _ = self.args.node.cast(NodeMsg::FromWorker(msg));
    }

    fn prepare(&mut self, msg: WorkerMsg) {
        let WorkerMsg::Prepare { job, attempt, spec, rank, epoch, discard_from } = msg else { return };
        let (me, host) = (self.args.slot, self.args.host);
        let fail = |state: &Self, reason: String| {
            let outcome = AttemptOutcome::Failed { step: 0, reason };
            state.report(ToController::Ended { job, attempt, slot: me, outcome });
        };
        let slot = self.jobs.entry(job).or_default();
        if let (Some(from), Some(step)) = (discard_from, slot.state.as_ref().map(CommittedState::step)) {
            if step >= from {
                tracing::warn!(job, step, "dropping this rank's state: the state of step {from} is incomplete");
                slot.state = None;
            }
        }
        let mut restored = None;
        if slot.state.is_none() {
            let t0 = Instant::now();
            match fresh_state(&spec, rank, &self.args.device) {
                Ok((state, from_checkpoint)) => {
                    restored = from_checkpoint.then(|| (t0, Instant::now()));
                    slot.state = Some(state);
                }
                Err(e) => return fail(self, e),
            }
        }
        let committed = slot.state.as_ref().map(CommittedState::step);
        let endpoint = match bind_endpoint(&self.args.identity, SocketAddr::new(host, 0), &self.args.transport) {
            Ok(e) => e,
            Err(e) => return fail(self, format!("binding the data-plane endpoint: {e}")),
        };
        let data_addr = match endpoint.local_addr() {
            Ok(a) => a,
            Err(e) => return fail(self, format!("data-plane address: {e}")),
        };
        let slot = self.jobs.get_mut(&job).expect("inserted above");
        slot.prepared = Some(Prepared { attempt, rank, epoch, spec, endpoint, restored });
        self.report(ToController::Ready { job, attempt, slot: me, data_addr, committed });
    }

    fn start(
        &mut self,
        me: &ActorRef<WorkerMsg>,
        job: JobId,
        attempt: u64,
        roster: Vec<PeerInfo>,
        source: Option<usize>,
        plane: GradientPlane,
    ) {
        let Some(slot) = self.jobs.get_mut(&job) else { return };
        let Some(prepared) = slot.prepared.take_if(|p| p.attempt == attempt) else { return };
        let Some(state) = slot.state.take() else { return };
        if prepared.rank != 0 {
            // Another rank writes now: this worker's writer finishes what it has and lets the catalog go.
            slot.writer = None;
        } else if slot.writer.is_none() {
            slot.writer = spawn_writer(&prepared.spec, job, &self.args.node);
        }
        let writer = if prepared.rank == 0 { slot.writer.clone() } else { None };
        let (tx, rx) = mpsc::unbounded_channel();
        slot.running = Some((attempt, tx));
        let ctx = AttemptCtx {
            started: Instant::now(),
            epoch: prepared.epoch,
            job,
            attempt,
            slot: self.args.slot,
            node: self.args.node.clone(),
            worker: me.get_cell(),
            identity: self.args.identity.clone(),
            transport: self.args.transport.clone(),
            metrics: self.args.metrics.clone(),
            roster,
            source,
            writer,
            restored: prepared.restored,
            plane,
            device: self.args.device.clone(),
            // The peak of where the rank computes: an engine that stays on the host has no GPU peak.
            peak_flops: crate::telemetry::peak::peak_flops(
                if crate::plan::plane::runs_on_device(&prepared.spec.config) {
                    &self.args.device
                } else {
                    &SlotDevice::Cpu
                },
                &prepared.spec.config.parallel.precision,
                self.args.peak_tflops,
            ),
        };
        let me = me.clone();
        // Made on the attempt's thread: an engine on a GPU holds an NCCL communicator, which stays on
        // the thread that made it.
        let attempt_task = move || async move {
            let run = std::panic::AssertUnwindSafe(run_attempt(ctx, prepared, state, rx)).catch_unwind();
            let (state, outcome) = match run.await {
                Ok(result) => result,
                Err(panic) => {
                    let reason = panic_message(&panic);
                    (None, AttemptOutcome::Failed { step: 0, reason: format!("the attempt panicked: {reason}") })
                }
            };
            let _ = me.cast(WorkerMsg::Returned { job, attempt, state, outcome });
        };
        // Training computes for hundreds of milliseconds at a time without yielding: it gets a thread and
        // a runtime of its own, so the node's heartbeats and control messages never wait behind it.
        let counted = self.args.attempts.started();
        let spawned = std::thread::Builder::new().name(format!("troupe-attempt-{job}-{attempt}")).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime.block_on(attempt_task()),
                Err(e) => tracing::error!("cannot start the attempt's runtime: {e}"),
            }
            drop(counted);
        });
        if let Err(e) = spawned {
            tracing::error!(job, attempt, "cannot start the attempt's thread: {e}");
        }
    }

    fn control(&mut self, job: JobId, attempt: u64, ctl: AttemptSignal) {
        if let Some((running, tx)) = self.jobs.get(&job).and_then(|s| s.running.as_ref()) {
            if *running == attempt {
                let _ = tx.send(ctl);
            }
        }
    }
}

/// A rank with no state for a job: the latest valid durable checkpoint if the job has one (true: restored
/// from it), else step 0. Checkpoints that do not verify are skipped for the previous one (`latest_valid`
/// logs each, with why). Step 0 of an engine that keeps parts of the model (ZeRO-3, pipelines) is
/// [`CommittedState::Initial`]: nothing is drawn or read until the attempt knows which parts this rank
/// holds. A periodically synchronizing job's rank `rank` resumes its own inner optimizer state
/// (`engine::resume_rank`).
fn fresh_state(spec: &JobSpec, rank: usize, device: &SlotDevice) -> Result<(CommittedState, bool), String> {
    let config = spec.config.clone();
    // Where a whole replica lives: the slot's device for an engine that computes there. A tensor-parallel
    // rank's whole state stays in host memory: each attempt cuts its shards onto the device.
    let whole_on_device = crate::plan::plane::runs_on_device(&config) && config.parallel.tp <= 1;
    let on = if whole_on_device { device.torch() } else { tch::Device::Cpu };
    // An engine that keeps parts of the model never holds the whole of it on the device: a ZeRO-3 rank
    // resumes in host memory (its shard taken, the rest dropped) and gathers its units on the device.
    let in_parts = config.parallel.pp > 1 || config.parallel.shard == "zero3";
    if let Some(dir) = &config.checkpoint.dir {
        let (latest, skipped) = checkpoint::latest_valid(dir);
        if let (Some(latest), false) = (&latest, skipped.is_empty()) {
            tracing::warn!(checkpoint = %latest.display(), skipped = skipped.len(), "restoring from an older checkpoint: the newer ones do not verify");
        }
        if let Some(latest) = latest {
            if troupe_model::periodic::PeriodicSync::of(&config.parallel).is_some() {
                return crate::engine::resume_rank(config, &latest, rank, on).map(|state| (state, true));
            }
            return Trainer::resume_on(config, &latest, if in_parts { tch::Device::Cpu } else { on })
                .map(|mut t| {
                    t.device = on;
                    (CommittedState::Full(Box::new(t)), true)
                })
                .map_err(|e| format!("restoring checkpoint {}: {e}", latest.display()));
        }
    }
    let fresh = if in_parts {
        // Nothing is materialised; a ZeRO-3 rank on a GPU gathers its units there.
        Trainer::new_unmaterialised(config).map(|mut t| {
            t.device = on;
            CommittedState::Initial(Box::new(t))
        })
    } else {
        Trainer::new_on(config, on).map(|t| CommittedState::Full(Box::new(t)))
    };
    fresh.map(|state| (state, false)).map_err(|e| format!("building the model on this node: {e}"))
}

pub(crate) fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".into())
}

struct AttemptCtx {
    /// When the worker was told to start (set-up and state copy count from here).
    started: Instant,
    epoch: u64,
    job: JobId,
    attempt: u64,
    slot: u32,
    node: ActorRef<NodeMsg>,
    /// This worker: the supervisor of the attempt's child actors (a pipeline device's StageActor, a ZeRO
    /// rank's ShardOwnerActor).
    worker: ActorCell,
    identity: Arc<NodeIdentity>,
    transport: TransportConfig,
    metrics: Arc<NodeMetrics>,
    roster: Vec<PeerInfo>,
    source: Option<usize>,
    /// Rank 0's checkpoint writer (with `checkpoint.dir`).
    writer: Option<Arc<CheckpointWriter>>,
    /// When the preparation restored the rank's state from a durable checkpoint.
    restored: Option<(Instant, Instant)>,
    /// Where the attempt sums its gradients (the controller's choice, the same on every rank).
    plane: GradientPlane,
    /// What this rank's slot computes on.
    device: SlotDevice,
    /// The device's peak FLOP/s in the job's precision, when known (the step's MFU).
    peak_flops: Option<f64>,
}

/// Rank 0's asynchronous checkpoint writer for `spec`'s `checkpoint.dir`, reporting each durable save to
/// the controller (as the attempt that took the snapshot) and logging failures; None without a
/// directory, or if the writer cannot start (logged; training goes on without checkpoints).
fn spawn_writer(spec: &JobSpec, job: JobId, node: &ActorRef<NodeMsg>) -> Option<Arc<CheckpointWriter>> {
    let dir = spec.config.checkpoint.dir.as_ref()?;
    let store = match CheckpointStore::open(dir, spec.config.checkpoint.keep_last) {
        Ok(store) => store,
        Err(e) => {
            tracing::error!(job, "checkpoints disabled, training goes on: {e}");
            return None;
        }
    };
    let node = node.clone();
    let on_report = move |report| match report {
        WriteReport::Durable { tag: attempt, saved } => {
            let (step, path, seconds) = (saved.step, saved.path, saved.seconds);
            let bytes = if saved.kept_existing { 0 } else { saved.bytes };
            let checkpointed = ToController::Checkpointed { job, attempt, step, path, seconds, bytes };
            let _ = node.cast(NodeMsg::FromWorker(checkpointed));
        }
        WriteReport::Failed { step, error, .. } => {
            tracing::error!(
                job,
                step,
                "checkpoint failed, training goes on (the previous checkpoint stays valid): {error}"
            );
        }
        WriteReport::Superseded { step, by, .. } => {
            tracing::warn!(job, step, by, "checkpoint of step {step} skipped: the disk is slower than checkpoints are due; step {by} is written instead");
        }
    };
    match CheckpointWriter::spawn(store, on_report) {
        Ok(writer) => Some(Arc::new(writer)),
        Err(e) => {
            tracing::error!(job, "cannot start the checkpoint writer, training goes on without checkpoints: {e}");
            None
        }
    }
}

/// One rank's part of an attempt. Gives the rank's last committed state back (None only when the
/// engine found it incomplete).
///
/// The data plane: when every rank of the attempt is on this host (their data addresses share one IP),
/// the same-host transport (Unix sockets in a private directory, collectives in its shared-memory
/// arena); otherwise the QUIC mesh — or, with `encrypted_tcp` / `plaintext_tcp`, a TCP mesh set up
/// through it, encrypted by TLS or in the clear —
/// and, when some ranks share a host, a same-host transport among those on this rank's host too:
/// messages between ranks of one host take it ([`Routed`]), and all-reduce runs in two tiers (within
/// hosts in the arena, across hosts over the mesh).
async fn run_attempt(
    ctx: AttemptCtx,
    prepared: Prepared,
    state: CommittedState,
    mut ctl: mpsc::UnboundedReceiver<AttemptSignal>,
) -> (Option<CommittedState>, AttemptOutcome) {
    let Prepared { rank, epoch, spec, endpoint, .. } = prepared;
    let step = state.step();
    let one_host =
        spec.data_plane != DataPlane::Quic && ctx.roster.iter().all(|p| p.addr.ip() == ctx.roster[rank].addr.ip());
    if one_host {
        drop(endpoint);
        let dir = socket_dir(&ctx);
        let connect = async {
            make_private_dir(&dir)?;
            SameHostTransport::connect(&dir, rank, ctx.roster.len(), ctx.transport.clone()).await
        };
        let result = tokio::select! {
            t = connect => t,
            _ = wait_abort(&mut ctl) => return (Some(state), AttemptOutcome::Aborted { step }),
        };
        let outcome = match result {
            Ok(t) => train_over(&ctx, &spec, Arc::new(t), None, epoch, state, &mut ctl).await,
            Err(e) => (Some(state), AttemptOutcome::Failed { step, reason: e.to_string() }),
        };
        let _ = std::fs::remove_file(socket_path(&dir, rank));
        let _ = std::fs::remove_dir(&dir); // the last rank out removes it
        return outcome;
    }
    let connect = QuicTransport::connect_on(&ctx.identity, endpoint, rank, ctx.roster.clone(), ctx.transport.clone());
    let transport = tokio::select! {
        t = connect => match t {
            Ok(t) => Arc::new(t),
            Err(e) => return (Some(state), AttemptOutcome::Failed { step, reason: e.to_string() }),
        },
        _ = wait_abort(&mut ctl) => return (Some(state), AttemptOutcome::Aborted { step }),
    };
    let Some(payloads) = spec.data_plane.tcp_payloads() else {
        return between_hosts(&ctx, &spec, rank, epoch, transport, "QUIC", state, &mut ctl).await;
    };
    let connect = TcpTransport::connect(transport, &ctx.identity, &ctx.roster, ctx.transport.clone(), payloads);
    let tcp = tokio::select! {
        t = connect => match t {
            Ok(t) => Arc::new(t),
            Err(e) => return (Some(state), AttemptOutcome::Failed { step, reason: e.to_string() }),
        },
        _ = wait_abort(&mut ctl) => return (Some(state), AttemptOutcome::Aborted { step }),
    };
    let (mesh, how) = match payloads {
        TcpPayloads::Plaintext => (
            "plaintext TCP",
            "data_plane = plaintext_tcp: tensors between hosts go over TCP unencrypted (connections authenticated through QUIC)",
        ),
        TcpPayloads::Encrypted => (
            "encrypted TCP",
            "data_plane = encrypted_tcp: tensors between hosts go over TCP sealed by mutual TLS 1.3 (the cluster's certificates)",
        ),
    };
    tracing::info!(job = ctx.job, attempt = ctx.attempt, rank, "{how}");
    between_hosts(&ctx, &spec, rank, epoch, tcp, mesh, state, &mut ctl).await
}

/// The part of an attempt whose ranks span hosts, over `transport`, the mesh among all of them
/// (`mesh` names it in the log): with `data_plane` other than `quic`, ranks that share a host also
/// talk over a same-host transport of their own, and all-reduce runs in two tiers.
#[allow(clippy::too_many_arguments)] // an attempt's context, split where the mesh is chosen
async fn between_hosts<T: Transport>(
    ctx: &AttemptCtx,
    spec: &JobSpec,
    rank: usize,
    epoch: u64,
    transport: Arc<T>,
    mesh: &str,
    state: CommittedState,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> (Option<CommittedState>, AttemptOutcome) {
    let step = state.step();
    let layout = HostLayout::of(&ctx.roster.iter().map(|p| p.addr.ip()).collect::<Vec<_>>());
    if spec.data_plane == DataPlane::Quic || !layout.is_tiered() {
        return train_over(ctx, spec, transport, None, epoch, state, ctl).await;
    }
    let (local_rank, local_world) = (layout.local_rank(rank), layout.members(rank).len());
    if local_world == 1 {
        return train_over(ctx, spec, transport, Some((layout, None)), epoch, state, ctl).await;
    }
    // Several "hosts" may be one machine (loopback addresses in tests): a directory per host.
    let dir = socket_dir(ctx).with_extension(format!("host{}", layout.host_of(rank)));
    let connect = async {
        make_private_dir(&dir)?;
        SameHostTransport::connect(&dir, local_rank, local_world, ctx.transport.clone()).await
    };
    let result = tokio::select! {
        t = connect => t,
        _ = wait_abort(ctl) => return (Some(state), AttemptOutcome::Aborted { step }),
    };
    let routed = result.and_then(|local| {
        let local = Arc::new(local);
        let neighbours = layout.members(rank).to_vec();
        tracing::info!(
            job = ctx.job,
            attempt = ctx.attempt,
            rank,
            ?neighbours,
            "messages to the ranks of this host over its sockets, to the others over {mesh}"
        );
        Ok((Routed::new(transport, local.clone(), neighbours)?, local))
    });
    let outcome = match routed {
        Ok((routed, local)) => {
            let tier = Some((layout, Some(local)));
            train_over(ctx, spec, Arc::new(routed), tier, epoch, state, ctl).await
        }
        Err(e) => (Some(state), AttemptOutcome::Failed { step, reason: e.to_string() }),
    };
    let _ = std::fs::remove_file(socket_path(&dir, local_rank));
    let _ = std::fs::remove_dir(&dir);
    outcome
}

/// Two-tier all-reduce for an attempt whose ranks span hosts: the hosts of the roster, and the
/// same-host transport among this rank's host's ranks (`None` when it is alone there).
type HostTier = (HostLayout, Option<Arc<SameHostTransport>>);

/// Runs the attempt over `transport` with the job's engine: a tensor-parallel rank (`parallel.tp` > 1,
/// of a pipeline stage when `parallel.pp` > 1 too), a pipeline device (`parallel.pp` > 1), a periodically synchronizing replica (`parallel.sync`), DDP
/// (`parallel.shard = "none"`) or ZeRO-1/2/3 with `checkpoint.replicas` buddy copies of each shard.
async fn train_over<T: Transport>(
    ctx: &AttemptCtx,
    spec: &JobSpec,
    transport: Arc<T>,
    tier: Option<HostTier>,
    epoch: u64,
    state: CommittedState,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> (Option<CommittedState>, AttemptOutcome) {
    let peers: Vec<String> = ctx.roster.iter().map(|p| p.name.clone()).collect();
    let counted = Arc::new(Counted::new(transport.clone(), &peers, &ctx.metrics.links));
    let mut comm = Communicator::new(counted, 0, epoch, CollectiveConfig::from(&ctx.transport));
    if let Some((layout, local)) = tier {
        let hosts = layout.hosts().len();
        match comm.with_host_tier(layout, local).await {
            Ok(true) => tracing::info!(
                job = ctx.job,
                attempt = ctx.attempt,
                rank = transport.rank(),
                hosts,
                "all-reduce in two tiers: within hosts in shared memory, across hosts over QUIC"
            ),
            Ok(false) => {}
            Err(e) => {
                let step = state.step();
                return (Some(state), AttemptOutcome::Failed { step, reason: e.to_string() });
            }
        }
    }
    let collective = CollectiveConfig::from(&ctx.transport);
    let on_device = ctx.device.torch().is_cuda() && crate::plan::plane::runs_on_device(&spec.config);
    if spec.config.parallel.offload == "host" && !on_device {
        let rank = transport.rank();
        tracing::info!(job = ctx.job, attempt = ctx.attempt, rank, "{}", troupe_model::optim::offload::CPU_RANK_NOTE);
    } else if spec.config.parallel.offload == "host" && spec.config.parallel.tp > 1 {
        let rank = transport.rank();
        tracing::warn!(job = ctx.job, attempt = ctx.attempt, rank, "parallel.offload = \"host\" under tensor parallelism: not offloaded yet, the shards' AdamW state and update stay on the GPU");
    }
    let (state, outcome) = match (ShardMode::of_config(&spec.config.parallel.shard), state) {
        (_, state) if spec.config.parallel.tp > 1 => {
            match TensorParallelReplica::adopt(state, comm, collective, spec.config.parallel.tp) {
                Ok(mut engine) => {
                    if crate::engine::tensor_parallel_on_device(&spec.config) {
                        engine.place_on(ctx.device.torch());
                    }
                    if let (GradientPlane::Nccl, SlotDevice::Cuda { ordinal, .. }) = (ctx.plane, &ctx.device) {
                        let step = engine.trainer().step;
                        match tensor_planes(&mut engine, *ordinal as usize, ctl).await {
                            Ok(true) => tracing::info!(
                                job = ctx.job,
                                attempt = ctx.attempt,
                                rank = transport.rank(),
                                "the tensor group's collectives and the data-parallel gradient sum on cuda:{ordinal} by NCCL"
                            ),
                            Ok(false) => return (engine.into_state().await, AttemptOutcome::Aborted { step }),
                            Err(reason) => {
                                return (engine.into_state().await, AttemptOutcome::Failed { step, reason })
                            }
                        }
                    }
                    let outcome = drive(ctx, spec, &mut engine, ctl).await;
                    (engine.into_state().await, outcome)
                }
                Err(reason) => return (None, AttemptOutcome::Failed { step: 0, reason }),
            }
        }
        (_, state) if spec.config.parallel.pp > 1 => {
            let mut engine = PipelineReplica::adopt(state, comm, collective, Some(ctx.worker.clone()));
            let outcome = drive(ctx, spec, &mut engine, ctl).await;
            (engine.into_state().await, outcome)
        }
        (_, state) if spec.config.parallel.periodic_sync() => match PeriodicReplica::adopt(state, comm) {
            Ok(mut engine) => {
                let outcome = drive(ctx, spec, &mut engine, ctl).await;
                (engine.into_state().await, outcome)
            }
            Err(reason) => return (None, AttemptOutcome::Failed { step: 0, reason }),
        },
        (Some(mode), state) => {
            let replicas = spec.config.checkpoint.replicas;
            let mut engine = ShardedReplica::adopt(state, comm, mode, replicas, Some(ctx.worker.clone()));
            if let (GradientPlane::Nccl, SlotDevice::Cuda { ordinal, .. }) = (ctx.plane, &ctx.device) {
                let built = nccl_plane(engine.communicator(), *ordinal as usize, ctl).await;
                let step = engine.trainer().step;
                match built.and_then(|plane| plane.map(|p| engine.set_device_plane(p)).transpose()) {
                    Ok(Some(())) => tracing::info!(
                        job = ctx.job,
                        attempt = ctx.attempt,
                        rank = transport.rank(),
                        "gradients reduced and {} gathered on cuda:{ordinal} by NCCL; the shard owner updates in host memory",
                        if mode == ShardMode::Zero3 { "each unit's parameters" } else { "masters" }
                    ),
                    Ok(None) => return (StepEngine::into_state(engine).await, AttemptOutcome::Aborted { step }),
                    Err(reason) => {
                        return (StepEngine::into_state(engine).await, AttemptOutcome::Failed { step, reason })
                    }
                }
            }
            let outcome = drive(ctx, spec, &mut engine, ctl).await;
            (StepEngine::into_state(engine).await, outcome)
        }
        (None, CommittedState::Full(trainer)) => {
            let rank = transport.rank();
            let mut engine = DataParallelReplica::without_sync(*trainer, comm, DEFAULT_BUCKET_BYTES);
            if let (GradientPlane::Nccl, SlotDevice::Cuda { ordinal, .. }) = (ctx.plane, &ctx.device) {
                match nccl_plane(engine.communicator(), *ordinal as usize, ctl).await {
                    Ok(Some(plane)) => {
                        tracing::info!(
                            job = ctx.job,
                            attempt = ctx.attempt,
                            rank,
                            "gradients summed on cuda:{ordinal} by NCCL"
                        );
                        engine = engine.with_device_plane(plane);
                    }
                    Ok(None) => {
                        let step = engine.trainer().step;
                        let state = CommittedState::Full(Box::new(engine.into_trainer()));
                        return (Some(state), AttemptOutcome::Aborted { step });
                    }
                    Err(reason) => {
                        let step = engine.trainer().step;
                        let state = CommittedState::Full(Box::new(engine.into_trainer()));
                        return (Some(state), AttemptOutcome::Failed { step, reason });
                    }
                }
            }
            let outcome = drive(ctx, spec, &mut engine, ctl).await;
            (engine.into_state().await, outcome)
        }
        (None, state) => {
            // A job's shard mode never changes, so this is a broken invariant; the next attempt restores
            // the rank from its peers or the checkpoint rather than train on a partial state.
            drop(state);
            let reason = "a DDP job was handed a sharded or unmaterialised state; dropped".to_string();
            return (None, AttemptOutcome::Failed { step: 0, reason });
        }
    };
    // Ends every rank reaches together close gracefully: a rank that found the state lost says goodbye,
    // so a peer still finishing the same collective fails only a receive from it, not the whole
    // collective — every rank then drops its partial state, rather than some keeping it.
    if matches!(outcome, AttemptOutcome::Completed { .. }) || state.is_none() {
        transport.shutdown().await;
    }
    (state, outcome)
}

/// The NCCL communicator of a rank on CUDA device `ordinal` for the attempt's epoch, its unique id
/// exchanged over the engine's (host) communicator `comm`; None when the attempt was aborted first.
async fn nccl_plane<T: Transport>(
    comm: &mut Communicator<T>,
    ordinal: usize,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> Result<Option<Box<dyn crate::engine::device_plane::DevicePlane>>, String> {
    use crate::engine::device_plane::NcclPlane;
    use troupe_cluster::ClusterError;
    let connect = troupe_cluster::nccl::NcclCommunicator::connect(comm, ordinal);
    let failed = |e: ClusterError| match e {
        // NCCL or the device itself: the controller takes the host plane from the next attempt on.
        ClusterError::NoCuda(_) | ClusterError::Nccl(_) => {
            format!("{} (cuda:{ordinal}): {e}", crate::plan::plane::NCCL_UNUSABLE)
        }
        e => format!("building the NCCL communicator on cuda:{ordinal}: {e}"),
    };
    tokio::select! {
        r = connect => r.map(|c| Some(Box::new(NcclPlane::new(c)) as Box<_>)).map_err(failed),
        _ = wait_abort(ctl) => Ok(None),
    }
}

/// The NCCL communicators of a tensor-parallel rank on CUDA device `ordinal`: its tensor group's and,
/// with several model replicas, its data-parallel group's, each built over a host communicator of the
/// group; false when the attempt was aborted first.
async fn tensor_planes<T: Transport>(
    engine: &mut TensorParallelReplica<T>,
    ordinal: usize,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> Result<bool, String> {
    let (mut tensor, data) = engine.plane_controls().map_err(|e| format!("the tensor group's NCCL: {e}"))?;
    let Some(tensor) = nccl_plane(&mut tensor, ordinal, ctl).await? else { return Ok(false) };
    let data = match data {
        Some(mut control) => match nccl_plane(&mut control, ordinal, ctl).await? {
            Some(plane) => Some(plane),
            None => return Ok(false),
        },
        None => None,
    };
    engine.set_device_planes(tensor, data).map(|()| true)
}

/// A directory private to this attempt's ranks: named by a hash of the job, the attempt and the roster
/// (the same on every rank), under the temporary directory.
fn socket_dir(ctx: &AttemptCtx) -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (ctx.job, ctx.attempt).hash(&mut h);
    for peer in &ctx.roster {
        (&peer.name, peer.addr).hash(&mut h);
    }
    std::env::temp_dir().join(format!("troupe-{:016x}", h.finish()))
}

fn make_private_dir(dir: &std::path::Path) -> Result<(), troupe_cluster::ClusterError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(troupe_cluster::ClusterError::io(format!("creating {}", dir.display()), e)),
    }
}

async fn wait_abort(ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>) {
    while let Some(c) = ctl.recv().await {
        if matches!(c, AttemptSignal::Abort) {
            return;
        }
    }
    // The worker dropped the channel (released or restarted): same as an abort.
}

/// Longest the end of a job waits for its last checkpoint to become durable.
const FINAL_CHECKPOINT_WAIT: Duration = Duration::from_secs(300);

/// Waits (without blocking the attempt's runtime) until the writer has made every submitted checkpoint
/// durable or failed it, at most `limit`.
async fn wait_writer_idle(job: JobId, writer: &CheckpointWriter, limit: Duration) {
    let t0 = Instant::now();
    while !writer.is_idle() {
        if t0.elapsed() > limit {
            tracing::warn!(job, "the last checkpoint is not durable after {limit:?}; finishing without waiting for it");
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Exports the spans recorded since the last report over OTLP (when installed) and sends them to the
/// job's watchers (when the job traces).
fn report_phases(ctx: &AttemptCtx, spec: &JobSpec, rank: usize, step: u64, phases: &mut PhaseRecorder) {
    let Some(spans) = phases.take() else { return };
    let (job, attempt, slot) = (ctx.job, ctx.attempt, ctx.slot);
    let (epoch, node, trace_seed) = (ctx.epoch, ctx.identity.name.as_str(), spec.trace_seed);
    // Rank r of a pipeline job of D = world / pp replicas runs stage r div D.
    let pp = spec.config.parallel.pp;
    let stage = (pp > 1).then(|| rank / (ctx.roster.len() / pp).max(1));
    let attrs = otel::RankAttrs { job, trace_seed, attempt, rank, stage, epoch, node };
    otel::export_step(&attrs, step, &spans);
    if spec.trace {
        let _ =
            ctx.node.cast(NodeMsg::FromWorker(ToController::Phases { job, attempt, slot, rank, step, spans, stage }));
    }
}

/// A pipeline rank's schedule of the step that started at `t0`: to the end of its last op, and the time
/// its F, B and W ops took (what the controller turns into the step's bubble).
fn stage_time_of(t0: Instant, ops: &[OpTiming]) -> StageTime {
    let end = ops.iter().map(|op| op.end).max().unwrap_or(t0);
    let busy: Duration = ops
        .iter()
        .filter(|op| matches!(op.cat, "forward" | "backward" | "weight"))
        .map(|op| op.end.saturating_duration_since(op.start))
        .sum();
    StageTime { span_s: end.saturating_duration_since(t0).as_secs_f64(), busy_s: busy.as_secs_f64() }
}

/// The validation loss of the committed state (`train.eval_every`), every rank its share; rank 0
/// reports it to the controller. An abort or a failure (a rank lost mid-evaluation) ends the attempt
/// with that outcome: nothing was changed, and the next attempt starts at this step and evaluates it
/// again.
async fn evaluate<E: StepEngine>(
    ctx: &AttemptCtx,
    engine: &mut E,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
    phases: &mut PhaseRecorder,
) -> Result<(), AttemptOutcome> {
    let step = engine.trainer().step;
    let started = Instant::now();
    let evaluated = tokio::select! {
        r = engine.evaluate() => r,
        _ = wait_abort(ctl) => return Err(AttemptOutcome::Aborted { step }),
    };
    phases.span("eval", "compute", started, Instant::now());
    match evaluated {
        Ok(Some(eval)) if engine.rank() == 0 => {
            let figures = EvalFigures { loss: eval.loss, windows: eval.windows, tokens: eval.tokens };
            let evaluated = ToController::Evaluated { job: ctx.job, attempt: ctx.attempt, step, figures };
            let _ = ctx.node.cast(NodeMsg::FromWorker(evaluated));
            Ok(())
        }
        Ok(_) => Ok(()),
        Err(e) => {
            let reason = format!("evaluating the validation loss of step {step}: {e}");
            Err(AttemptOutcome::Failed { step, reason })
        }
    }
}

/// The step loop of one attempt, for any engine: sync, then per step reduce → vote → wait for the
/// commit → apply → (checkpoint when due) → (evaluate when due) until the job's last step; then
/// `--save-final` on rank 0.
async fn drive<E: StepEngine>(
    ctx: &AttemptCtx,
    spec: &JobSpec,
    engine: &mut E,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> AttemptOutcome {
    let mut phases = PhaseRecorder::new(spec.trace || otel::enabled());
    if let Err(outcome) = sync_state(ctx, engine, ctl, &mut phases).await {
        return outcome;
    }
    // An attempt that starts at an evaluation step evaluates it (again): the attempt before may have
    // lost a rank during it. The controller reports each step's evaluation once.
    if spec.config.eval_due(engine.trainer().step) {
        if let Err(outcome) = evaluate(ctx, engine, ctl, &mut phases).await {
            return outcome;
        }
    }
    while engine.trainer().step < spec.config.train.steps {
        if let Err(outcome) = one_step(ctx, spec, engine, ctl, &mut phases).await {
            return outcome;
        }
    }
    finish(ctx, spec, engine, ctl).await
}

/// The attempt's start: the engine brings every rank to the committed state (a copy from `source`, or
/// a reshard of what the ranks hold); the set-up time is recorded, a resumed attempt's as two
/// "recovery" spans: "mesh rebuild" (the worker's start to the engine over the new mesh) and "state
/// restore" (the sync).
async fn sync_state<E: StepEngine>(
    ctx: &AttemptCtx,
    engine: &mut E,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
    phases: &mut PhaseRecorder,
) -> Result<(), AttemptOutcome> {
    let step = engine.trainer().step;
    // The engine exists: the mesh is built (`train_over` builds it and adopts the state, then drives).
    let built = Instant::now();
    tokio::select! {
        r = engine.sync(ctx.source) => match r {
            Ok(()) => {}
            Err(e @ EngineError::StateLost { step: lost, .. }) => {
                return Err(AttemptOutcome::StateLost { step: lost, reason: e.to_string() });
            }
            Err(e) => {
                let what = ctx.source.map_or("resharding the committed state".to_string(), |s| format!("copying the state of rank {s}"));
                return Err(AttemptOutcome::Failed { step, reason: format!("{what}: {e}") });
            }
        },
        _ = wait_abort(ctl) => return Err(AttemptOutcome::Aborted { step }),
    }
    if let Some((from, to)) = ctx.restored {
        phases.span("checkpoint restore", "recovery", from, to);
    }
    if ctx.attempt > 1 {
        phases.span("mesh rebuild", "recovery", ctx.started, built);
        phases.span("state restore", "recovery", built, Instant::now());
    } else {
        phases.span("setup", "idle", ctx.started, Instant::now());
    }
    Ok(())
}

/// One step: reduce, vote, wait for the commit, apply; then the checkpoint and the evaluation when due.
async fn one_step<E: StepEngine>(
    ctx: &AttemptCtx,
    spec: &JobSpec,
    engine: &mut E,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
    phases: &mut PhaseRecorder,
) -> Result<(), AttemptOutcome> {
    let (rank, step) = (engine.rank(), engine.trainer().step);
    let t0 = Instant::now();
    let reduced = tokio::select! {
        r = engine.reduce() => match r {
            Ok(reduced) => reduced,
            Err(e) => {
                phases.span("failed step", "comm", t0, Instant::now());
                report_phases(ctx, spec, rank, step + 1, phases);
                return Err(AttemptOutcome::Failed { step, reason: e.to_string() });
            }
        },
        _ = wait_abort(ctl) => {
            phases.span("aborted step", "comm", t0, Instant::now());
            report_phases(ctx, spec, rank, step + 1, phases);
            return Err(AttemptOutcome::Aborted { step });
        }
    };
    let voted = vote(ctx, engine, &reduced, t0, phases);
    wait_commit(ctl, step).await.inspect_err(|_| {
        phases.span("commit wait (aborted)", "idle", voted, Instant::now());
        report_phases(ctx, spec, rank, step + 1, phases);
    })?;
    let committed = Instant::now();
    phases.span("commit wait", "idle", voted, committed);
    engine.apply(reduced).await;
    phases.span("optimizer", "optimizer", committed, Instant::now());
    let step = engine.trainer().step;
    let every = spec.config.checkpoint.every_steps;
    let due = step == spec.config.train.steps || (every > 0 && step.is_multiple_of(every));
    if spec.config.checkpoint.dir.is_some() && due {
        // The step loop waits only for the snapshot (for sharded engines: the gather of the shards to
        // rank 0); the write runs on rank 0's writer thread.
        let saving = Instant::now();
        let snapshot = tokio::select! {
            r = engine.checkpoint(ctx.writer.as_deref(), ctx.attempt) => r,
            _ = wait_abort(ctl) => return Err(AttemptOutcome::Aborted { step }),
        };
        if let Err(e) = snapshot {
            let reason = format!("gathering the checkpoint of step {step}: {e}");
            return Err(AttemptOutcome::Failed { step, reason });
        }
        tracing::debug!(job = ctx.job, step, seconds = saving.elapsed().as_secs_f64(), "checkpoint snapshot taken");
        phases.span("checkpoint", "checkpoint", saving, Instant::now());
    }
    if spec.config.eval_due(step) {
        if let Err(outcome) = evaluate(ctx, engine, ctl, phases).await {
            report_phases(ctx, spec, rank, step, phases);
            return Err(outcome);
        }
    }
    report_phases(ctx, spec, rank, step, phases);
    Ok(())
}

/// Records the step's compute and collective spans and sends the rank's vote; returns when it voted.
fn vote<E: StepEngine>(
    ctx: &AttemptCtx,
    engine: &mut E,
    reduced: &ReducedStep,
    t0: Instant,
    phases: &mut PhaseRecorder,
) -> Instant {
    let step = engine.trainer().step;
    let (voted, seconds) = (Instant::now(), t0.elapsed().as_secs_f64());
    let computed = t0 + std::time::Duration::from_secs_f64(reduced.compute_seconds);
    let mut stage_time = None;
    match engine.op_spans() {
        // A pipeline device: its ops, then the flush (the stage's all-reduce, the norm and loss).
        Some(ops) => {
            stage_time = Some(stage_time_of(t0, &ops));
            for op in ops {
                phases.op(&op.name, op.cat, op.start, op.end, op.chunk, op.microbatch);
            }
            phases.span("flush", "comm", computed, voted);
        }
        None => {
            phases.span("forward+backward", "compute", t0, computed);
            phases.span(engine.gradient_collective(), "comm", computed, voted);
        }
    }
    let trainer = engine.trainer();
    let loss_scale = trainer.loss_scale;
    let (grad_norm, skipped) = loss_scale.preview(trainer.model.precision, reduced.grad_norm);
    let peak_rss_bytes = crate::telemetry::memory::peak_rss_bytes();
    let (loss, loss_scale) = (reduced.loss, loss_scale.scale);
    // The whole reduce, its collectives included (an engine's `compute_seconds` may end before them).
    let usage = engine.usage().map(|usage| RankUsage { step_seconds: seconds, ..usage });
    let peak_flops = ctx.peak_flops;
    let figures = StepFigures { loss, grad_norm, skipped, loss_scale, peak_rss_bytes, stage_time, usage, peak_flops };
    let (job, attempt, slot) = (ctx.job, ctx.attempt, ctx.slot);
    let vote = ToController::Vote { job, attempt, slot, step, figures, seconds };
    let _ = ctx.node.cast(NodeMsg::FromWorker(vote));
    voted
}

/// Waits for the controller's commit of `step`; `Err` if the attempt is aborted first.
async fn wait_commit(ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>, step: u64) -> Result<(), AttemptOutcome> {
    loop {
        match ctl.recv().await {
            Some(AttemptSignal::Commit(s)) if s == step => return Ok(()),
            Some(AttemptSignal::Commit(_)) => continue,
            Some(AttemptSignal::Abort) | None => return Err(AttemptOutcome::Aborted { step }),
        }
    }
}

/// The attempt trained the job's last step: rank 0's last checkpoint is durable, and with
/// `--save-final` the final parameters are saved.
async fn finish<E: StepEngine>(
    ctx: &AttemptCtx,
    spec: &JobSpec,
    engine: &mut E,
    ctl: &mut mpsc::UnboundedReceiver<AttemptSignal>,
) -> AttemptOutcome {
    let failed = |step, reason: String| AttemptOutcome::Failed { step, reason };
    if let Some(writer) = &ctx.writer {
        // The job's last checkpoint is durable before the job reports its end.
        wait_writer_idle(ctx.job, writer, FINAL_CHECKPOINT_WAIT).await;
    }
    let step = engine.trainer().step;
    let mut saved = None;
    if let Some(path) = &spec.save_final {
        let finished = tokio::select! {
            r = engine.finish() => r,
            _ = wait_abort(ctl) => return AttemptOutcome::Aborted { step },
        };
        if let Err(e) = finished {
            return failed(step, format!("gathering the final parameters: {e}"));
        }
        if engine.rank() == 0 {
            if let Err(e) = engine.trainer().save_params(path) {
                return failed(step, format!("saving the final parameters to {}: {e}", path.display()));
            }
            saved = Some(path.clone());
        }
    }
    AttemptOutcome::Completed { step, saved }
}

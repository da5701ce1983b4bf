//! Running a pipeline: the plan checked, the model partitioned, one [`StageActor`] per device over a
//! transport mesh, each on a thread and runtime of its own, and one `Step` message to every actor per
//! global batch. [`run_in_process`] puts every
//! device in this process over the in-memory transport (tests, `troupe train --pp`, the benchmark); the
//! stage actors only need a [`Transport`], so devices in separate processes need nothing else from them.

use std::sync::Arc;
use std::time::Instant;

use futures::future::join_all;
use ractor::{Actor, ActorRef};
use tch::Tensor;
use troupe_cluster::collective::{CollectiveConfig, Communicator};
use troupe_cluster::transport::memory::MemoryTransport;
use troupe_cluster::transport::Transport;
use troupe_cluster::TransportConfig;
use troupe_model::config::JobConfig;
use troupe_model::data::{load_corpora, EvalWindows};
use troupe_model::generate::Evaluation;
use troupe_model::TrainError;

use super::actor::{StageActor, StageMsg};
use super::{
    check, costs_for, partition_by, plan, ChunkLayout, DataParallelGroup, OpSpan, PipelineError, PipelineStage,
    PlanShape, ScheduleKind,
};

/// Tag group of the flush's collectives (the activations use [`super::PIPELINE_TAG_GROUP`]).
const FLUSH_GROUP: u32 = 1;
/// Tag group of the all-reduce among a stage's data-parallel replicas.
const DATA_PARALLEL_GROUP: u32 = 2;

/// How to run a pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineOptions {
    pub kind: ScheduleKind,
    pub shape: PlanShape,
    /// Data-parallel replicas of the whole pipeline (each stage's gradients all-reduced among them).
    pub data_parallel: usize,
    /// The longest a device waits for one activation or gradient.
    pub recv_timeout_ms: u64,
    /// The longest the driver waits for a device to finish a step.
    pub step_timeout_ms: u64,
}

impl PipelineOptions {
    pub fn new(kind: ScheduleKind, stages: usize, microbatches: usize, virtual_stages: usize) -> Self {
        Self {
            kind,
            shape: PlanShape::new(stages, microbatches, virtual_stages),
            data_parallel: 1,
            recv_timeout_ms: 60_000,
            step_timeout_ms: 120_000,
        }
    }
}

/// One committed step of the whole pipeline.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineStep {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    /// fp16: the gradients overflowed and no device applied an update.
    pub skipped: bool,
    /// The loss scale the step's backward ran at (1 unless fp16).
    pub loss_scale: f64,
    /// Per device of data-parallel replica 0, its ops with their times (seconds since the run started).
    pub spans: Vec<Vec<OpSpan>>,
    /// Per device of data-parallel replica 0, the parameter elements it holds after the step.
    pub param_elements: Vec<usize>,
    /// The validation loss of the model after this step, when `train.eval_every` makes it due.
    pub eval: Option<Evaluation>,
}

/// A finished run.
pub struct PipelineRun {
    pub steps: Vec<PipelineStep>,
    /// The final parameters in the model's canonical order.
    pub params: Vec<Tensor>,
    /// How the model was cut: chunk c's blocks and parameters (device `c mod P` runs it).
    pub layouts: Vec<ChunkLayout>,
    /// A tied model: the head's device's copy of the embedding matrix (replica 0's), which must equal
    /// `params[0]` to the bit; None when untied or when one device holds the embeddings and the head.
    pub tied_copy: Option<Tensor>,
}

/// Runs `steps` steps of `config` as a pipeline of in-process devices over the in-memory transport (with
/// `data_parallel` > 1, that many pipelines, each stage's replicas joined by a mesh of their own).
/// `on_step` sees each step as it commits.
pub fn run_in_process(
    config: &JobConfig,
    options: &PipelineOptions,
    steps: u64,
    on_step: impl FnMut(&PipelineStep),
) -> Result<PipelineRun, PipelineError> {
    let (stages, replicas) = (options.shape.stages, options.data_parallel.max(1));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| PipelineError::Actor { device: 0, reason: format!("starting the runtime: {e}") })?;
    let mesh = |n: usize| -> Vec<Arc<MemoryTransport>> {
        MemoryTransport::mesh(n, unmatched_messages_max(options.shape)).into_iter().map(Arc::new).collect()
    };
    let pipelines: Vec<Vec<Arc<MemoryTransport>>> = (0..replicas).map(|_| mesh(stages)).collect();
    let mut stage_groups: Vec<Vec<Arc<MemoryTransport>>> = (0..stages).map(|_| mesh(replicas)).collect();
    let devices = pipelines
        .into_iter()
        .enumerate()
        .flat_map(|(replica, pipeline)| {
            let groups: Vec<Arc<MemoryTransport>> = stage_groups.iter_mut().map(|g| g[replica].clone()).collect();
            pipeline.into_iter().zip(groups).map(move |(pipeline, group)| DeviceTransports {
                pipeline,
                data_parallel: (replicas > 1).then_some(group),
            })
        })
        .collect();
    runtime.block_on(run_stages(config, options, devices, steps, on_step))
}

/// A device's transports: to the other stages of its pipeline, and to the replicas of its stage.
pub struct DeviceTransports<T: Transport> {
    pub pipeline: Arc<T>,
    pub data_parallel: Option<Arc<T>>,
}

/// Every message a device may have waiting: at most one activation and one gradient per (chunk,
/// micro-batch), plus the flush's.
fn unmatched_messages_max(shape: PlanShape) -> usize {
    2 * shape.chunks() * shape.microbatches + 64
}

/// Runs the pipeline over `devices` (replica-major: replica r's stage s is `r × P + s`) in the current
/// runtime.
pub async fn run_stages<T: Transport>(
    config: &JobConfig,
    options: &PipelineOptions,
    devices: Vec<DeviceTransports<T>>,
    steps: u64,
    mut on_step: impl FnMut(&PipelineStep),
) -> Result<PipelineRun, PipelineError> {
    let plan = Arc::new(plan(options.kind, options.shape)?);
    check(&plan).unwrap_or_else(|e| panic!("generated plan {} {:?} is invalid: {e}", options.kind, options.shape));
    let replicas = devices.len() / options.shape.stages;
    let costs = costs_for(config, replicas, options.shape.microbatches);
    let layouts = partition_by(&config.model, &costs, options.shape.chunks())?;
    let validation = validation_windows(config)?;
    let origin = Instant::now();
    let collective = CollectiveConfig::from(&TransportConfig::default());
    let mut stages = Vec::new();
    for (index, transports) in devices.into_iter().enumerate() {
        let device = index % options.shape.stages;
        let comm = Communicator::new(transports.pipeline.clone(), FLUSH_GROUP, 1, collective.clone());
        let data_parallel = transports
            .data_parallel
            .map(|t| DataParallelGroup { comm: Communicator::new(t, DATA_PARALLEL_GROUP, 1, collective.clone()) });
        let recv_timeout_ms = options.recv_timeout_ms;
        stages.push(PipelineStage::new(
            config.clone(),
            plan.clone(),
            &layouts,
            device,
            transports.pipeline,
            comm,
            data_parallel,
            recv_timeout_ms,
            origin,
        )?);
    }
    let mut actors = Vec::new();
    for stage in stages {
        match spawn_stage_thread(stage) {
            Ok(started) => actors.push(started),
            Err(e) => {
                for (actor, _) in &actors {
                    actor.stop(None);
                }
                return Err(e);
            }
        }
    }
    let eval = validation.as_ref().map(|windows| (config, windows));
    let result = drive(&actors, options, eval, steps, &mut on_step).await.map(|run| PipelineRun { layouts, ..run });
    for (actor, _) in &actors {
        actor.stop(None);
    }
    for (device, (_, thread)) in actors.into_iter().enumerate() {
        let joined = tokio::task::spawn_blocking(move || thread.join()).await;
        if !matches!(joined, Ok(Ok(()))) {
            return Err(PipelineError::Actor { device, reason: "its thread panicked".into() });
        }
    }
    result
}

/// Starts a device's actor on a thread and runtime of its own, so devices compute in parallel (on one
/// shared runtime a woken receiver can wait behind the sender's computation) and the driver's runtime
/// only waits.
fn spawn_stage_thread<T: Transport>(
    stage: PipelineStage<T>,
) -> Result<(ActorRef<StageMsg>, std::thread::JoinHandle<()>), PipelineError> {
    let device = stage.device();
    let failed = |reason: String| PipelineError::Actor { device, reason };
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(format!("stage-{device}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = started_tx.send(Err(format!("starting its runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                match Actor::spawn(None, StageActor::<T>::default(), stage).await {
                    Ok((actor, handle)) => {
                        let _ = started_tx.send(Ok(actor));
                        let _ = handle.await;
                    }
                    Err(e) => {
                        let _ = started_tx.send(Err(format!("spawning: {e}")));
                    }
                }
            });
        })
        .map_err(|e| failed(format!("starting its thread: {e}")))?;
    let actor =
        started_rx.recv().map_err(|_| failed("its thread ended before the actor started".into()))?.map_err(failed)?;
    Ok((actor, thread))
}

/// The held-out windows `train.eval_every` evaluates (None: the job evaluates nothing).
fn validation_windows(config: &JobConfig) -> Result<Option<EvalWindows>, PipelineError> {
    if config.train.eval_every == 0 {
        return Ok(None);
    }
    let (_, held_out) = load_corpora(&config.data, &config.model).map_err(TrainError::from)?;
    let (context, samples) = (config.model.context, config.train.eval_samples);
    Ok(held_out.map(|corpus| EvalWindows::new(corpus, context, samples)))
}

/// Every device's part of the validation loss (each returns the same; device 0's is taken).
async fn evaluate(
    actors: &[(ActorRef<StageMsg>, std::thread::JoinHandle<()>)],
    windows: &EvalWindows,
    timeout_ms: u64,
) -> Result<Evaluation, PipelineError> {
    let calls = actors.iter().map(|(actor, _)| {
        let windows = windows.clone();
        async move {
            // Kept until the reply: dropping it would abandon the evaluation.
            let (_abandon_when_dropped, abandon) = tokio::sync::oneshot::channel();
            ractor::call_t!(actor, (|reply| StageMsg::Evaluate { windows, abandon, reply }), timeout_ms)
        }
    });
    let mut first = None;
    for (device, reply) in join_all(calls).await.into_iter().enumerate() {
        let eval = reply.map_err(|e| PipelineError::Actor { device, reason: e.to_string() })??;
        first.get_or_insert(eval);
    }
    Ok(first.expect("a pipeline has devices"))
}

async fn drive(
    actors: &[(ActorRef<StageMsg>, std::thread::JoinHandle<()>)],
    options: &PipelineOptions,
    eval: Option<(&JobConfig, &EvalWindows)>,
    steps: u64,
    on_step: &mut impl FnMut(&PipelineStep),
) -> Result<PipelineRun, PipelineError> {
    let actor_error = |device: usize, reason: String| PipelineError::Actor { device, reason };
    let mut reports = Vec::new();
    for _ in 0..steps {
        let timeout_ms = options.step_timeout_ms;
        let calls = actors.iter().map(|(actor, _)| async move { ractor::call_t!(actor, StageMsg::Step, timeout_ms) });
        let mut per_device = Vec::with_capacity(actors.len());
        for (device, reply) in join_all(calls).await.into_iter().enumerate() {
            let step = reply.map_err(|e| actor_error(device, e.to_string()))?.map_err(|e| actor_error(device, e))?;
            per_device.push(step);
        }
        let first = &per_device[0];
        let eval = match eval {
            Some((config, windows)) if config.eval_due(first.step + 1) => {
                Some(evaluate(actors, windows, options.step_timeout_ms).await?)
            }
            _ => None,
        };
        let report = PipelineStep {
            step: first.step,
            loss: first.loss,
            grad_norm: first.grad_norm,
            lr: first.lr,
            skipped: first.skipped,
            loss_scale: first.loss_scale,
            spans: per_device[..options.shape.stages].iter().map(|s| s.spans.clone()).collect(),
            param_elements: per_device[..options.shape.stages].iter().map(|s| s.param_elements).collect(),
            eval,
        };
        on_step(&report);
        reports.push(report);
    }
    let timeout_ms = options.step_timeout_ms;
    let calls = actors.iter().map(|(actor, _)| async move { ractor::call_t!(actor, StageMsg::Params, timeout_ms) });
    let (mut chunks, mut tied_copy): (Vec<(usize, Vec<Tensor>)>, Option<Tensor>) = (Vec::new(), None);
    for (device, reply) in join_all(calls).await.into_iter().enumerate().take(options.shape.stages) {
        let (params, copy) =
            reply.map_err(|e| actor_error(device, e.to_string()))?.map_err(|e| actor_error(device, e))?;
        chunks.extend(params);
        tied_copy = tied_copy.or(copy);
    }
    chunks.sort_by_key(|(chunk, _)| *chunk);
    let params = chunks.into_iter().flat_map(|(_, p)| p).collect();
    Ok(PipelineRun { steps: reports, params, layouts: Vec::new(), tied_copy })
}

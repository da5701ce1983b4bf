//! Tensor × pipeline (× data) parallelism: with `parallel.pp = P > 1` each rank is tensor rank t of
//! pipeline stage p of model replica d (the planner's order, rank = t + T·(d + D·p)). The stage's chunks
//! come from the pipeline engine's partition and its schedule ([`plan`]: GPipe, 1F1B, interleaved,
//! ZB-H1); each rank runs its device's ops with its shards of the chunks' parts
//! (`TpRank::stage_forward` / `stage_backward`), its tensor group's collectives inside each op, and
//! sends activations and gradients to tensor rank t of the neighbouring stages — the whole residual
//! stream without sequence parallelism, its slice of the sequence with it. A zero-bubble schedule's B
//! gives the input's gradient only (`TpRank::stage_backward_input`: autograd skips the weight products,
//! each segment's graph is kept) and its W computes the parameters' gradients later
//! (`stage_backward_weight`, partial ones summed over the tensor group there).
//!
//! After the ops: a tied head's copy of the embedding matrix and the first stage's sum their gradients;
//! the data-parallel group sums every gradient; each rank sends its gradients to the next rank of its
//! tensor group, which keeps a buddy copy of its shard of the stage (without ZeRO); one all-reduce over
//! the replica's P × T ranks gives the global gradient norm and the loss.

use std::collections::HashMap;
use std::sync::Arc;

use tch::{Kind, Tensor};
use troupe_cluster::collective::ReduceOp;
use troupe_cluster::transport::Transport;
use troupe_model::config::JobConfig;
use troupe_model::tensor_parallel::{held_params, PendingWeights, StageForward, StageParts, TpLayout};

use super::super::pipeline::{check, partition, partition_by, plan, ModelCosts, OpKind, Plan, PlanShape};
use super::group::values;
use super::meter::Metered;
use super::{Batch, Parts};
use troupe_model::model::ParamSpec;

use crate::engine::flat::{append_flat, counter_words};

/// A rank's place in the pipeline and the groups it talks to beyond its tensor group.
pub(super) struct Pipe<T: Transport> {
    plan: Arc<Plan>,
    /// This rank's stage (the plan's device).
    device: usize,
    /// Every chunk's parts, by chunk index.
    chunks: Vec<StageParts>,
    /// Tensor rank t of every stage of this replica, member p = stage p: activations, gradients, a tied
    /// embedding's gradient and the final gather.
    pub(super) chain: Metered<T>,
    /// Every rank of this replica: the norm and the loss.
    model: Metered<T>,
    /// The head's stage keeps a copy of the embedding matrix (tied, and more than one stage).
    tied: bool,
    recompute: bool,
    d_model: i64,
    sp_degree: i64,
    /// Per stage, per parameter: whether the stage owns it ([`Geometry::owned`]).
    owned: Vec<Vec<bool>>,
}

/// The pipeline geometry of a tensor-parallel attempt: its plan and every chunk's parts.
pub(super) struct Geometry {
    pub plan: Arc<Plan>,
    pub chunks: Vec<StageParts>,
}

impl Geometry {
    /// The plan of `config`'s schedule for `replicas` model replicas, and the chunks cut as the pipeline
    /// engine cuts them: by parameter count, or by `costs` (`parallel.balance = "measured"`).
    pub fn of(config: &JobConfig, replicas: usize, costs: Option<&ModelCosts>) -> Result<Self, String> {
        let (kind, shape) = PlanShape::of(config, replicas)?;
        let layouts = match costs {
            Some(costs) => partition_by(&config.model, costs, shape.chunks()),
            None => partition(&config.model, shape.chunks()),
        }
        .map_err(|e| e.to_string())?;
        let chunks =
            layouts.into_iter().map(|l| StageParts { embed: l.embed, blocks: l.blocks, head: l.head }).collect();
        let plan = plan(kind, shape).map_err(|e| e.to_string())?;
        check(&plan).map_err(|e| format!("generated plan {kind} {shape:?} is invalid: {e}"))?;
        Ok(Self { plan: Arc::new(plan), chunks })
    }

    /// Per model part: whether stage `device` runs it (its chunks' parts).
    pub fn runs(&self, config: &JobConfig, device: usize) -> Vec<bool> {
        let shape = self.plan.shape;
        let mut runs = vec![false; config.model.n_layers + 2];
        for v in 0..shape.virtual_stages {
            let chunk = &self.chunks[shape.chunk_at(device, v)];
            for (run, part) in runs.iter_mut().zip(chunk.runs(&config.model)) {
                *run |= part;
            }
        }
        runs
    }

    /// Per parameter: whether stage `device` owns it — holds it, and is not a tied head's copy of the
    /// embedding matrix (owned by the first stage). Every parameter has one owner.
    pub fn owned(&self, config: &JobConfig, device: usize) -> Vec<bool> {
        let mut owned = held_params(&config.model, &self.runs(config, device));
        if device > 0 && config.model.head_takes_embedding() {
            owned[0] = false;
        }
        owned
    }
}

impl<T: Transport> Pipe<T> {
    pub fn new(
        config: &JobConfig,
        geometry: Geometry,
        device: usize,
        chain: Metered<T>,
        model: Metered<T>,
        layout: &TpLayout,
    ) -> Self {
        let tied = config.model.head_takes_embedding() && geometry.plan.shape.stages > 1;
        let owned = (0..geometry.plan.shape.stages).map(|p| geometry.owned(config, p)).collect();
        Self {
            owned,
            plan: geometry.plan,
            device,
            chunks: geometry.chunks,
            chain,
            model,
            tied,
            recompute: config.parallel.recompute,
            d_model: config.model.d_model as i64,
            sp_degree: if layout.sp { layout.degree as i64 } else { 1 },
        }
    }

    /// The micro-batches of a step.
    pub fn microbatches(&self) -> usize {
        self.plan.shape.microbatches
    }

    /// The whole state (parameters, exp_avg, exp_avg_sq: `stage`, this stage's whole tensors, from its
    /// tensor group's gather) all-gathered along the chain from every stage's owned parameters; an
    /// error when the stages' counters differ.
    pub fn gather_stages(
        &mut self,
        handle: &tokio::runtime::Handle,
        stage: [Vec<Tensor>; 3],
        counters: [u64; 2],
        specs: &[ParamSpec],
    ) -> Result<[Vec<Tensor>; 3], String> {
        let numel =
            |owned: &[bool]| -> usize { specs.iter().zip(owned).filter(|(_, &o)| o).map(|(s, _)| s.numel()).sum() };
        let longest = self.owned.iter().map(|o| numel(o)).max().unwrap_or(0);
        let header = 2 * counter_words(0).len();
        let width = header + 3 * longest;
        let mut mine: Vec<f32> = counters.iter().flat_map(|&c| counter_words(c)).collect();
        let owned = &self.owned[self.device];
        for list in &stage {
            let tensors: Vec<Tensor> =
                list.iter().zip(owned).filter(|(_, &o)| o).map(|(t, _)| t.contiguous()).collect();
            let mut flat = Vec::new();
            append_flat(&tensors, &mut flat);
            mine.extend(flat);
            mine.resize(mine.len() + longest - numel(owned), 0.0);
        }
        debug_assert_eq!(mine.len(), width);
        let mut all = vec![0.0f32; width * self.owned.len()];
        handle.block_on(self.chain.all_gather(&mine[..], &mut all[..])).map_err(|e| e.to_string())?;
        if all.chunks(width).any(|c| c[..header] != mine[..header]) {
            return Err("the pipeline's stages hold different steps; the replica's state is dropped".into());
        }
        let mut whole: [Vec<Option<Tensor>>; 3] = std::array::from_fn(|_| specs.iter().map(|_| None).collect());
        for (held, owned) in all.chunks(width).zip(&self.owned) {
            for (l, list) in whole.iter_mut().enumerate() {
                let mut at = header + l * longest;
                for ((slot, spec), _) in list.iter_mut().zip(specs).zip(owned).filter(|(_, &o)| o) {
                    let n = spec.numel();
                    *slot = Some(Tensor::from_slice(&held[at..at + n]).view(spec.shape.as_slice()));
                    at += n;
                }
            }
        }
        let complete = |list: Vec<Option<Tensor>>| list.into_iter().collect::<Option<Vec<Tensor>>>();
        let [a, b, c] = whole.map(complete);
        match (a, b, c) {
            (Some(a), Some(b), Some(c)) => Ok([a, b, c]),
            _ => Err("a parameter is owned by no stage".into()),
        }
    }

    fn is_local(&self, chunk: usize) -> bool {
        self.plan.shape.device_of(chunk) == self.device
    }

    fn last_device(&self) -> usize {
        self.plan.shape.stages - 1
    }

    /// The shape of an activation (or its gradient) of micro-batch `tokens` at a stage boundary.
    fn boundary_shape(&self, tokens: &Tensor) -> [i64; 3] {
        let size = tokens.size();
        [size[0], size[1] / self.sp_degree, self.d_model]
    }
}

/// What a forward left for its backward: its tape, or with `parallel.recompute` only its input.
enum Saved {
    Tape(StageForward),
    Again(Tensor),
}

impl Saved {
    /// Bytes it keeps until its backward.
    fn held_bytes(&self) -> usize {
        match self {
            Saved::Tape(forward) => forward.held_bytes(),
            Saved::Again(input) => troupe_model::tensor_bytes(input),
        }
    }
}

/// The step's tensors in flight on this rank, by (chunk, micro-batch).
#[derive(Default)]
struct Run {
    activations: HashMap<(usize, usize), Tensor>,
    gradients: HashMap<(usize, usize), Tensor>,
    to_next: HashMap<(usize, usize), Tensor>,
    to_previous: HashMap<(usize, usize), Tensor>,
    saved: HashMap<(usize, usize), Saved>,
    /// A zero-bubble B's weight pass, until its W; with the activation bytes it keeps.
    weights: HashMap<(usize, usize), (PendingWeights, usize)>,
    loss: f64,
}

/// The rank's ops of the step's plan over `batches` (one per micro-batch), then the reductions: (the
/// global batch's loss, the global gradient norm). The gradients are left summed over the data-parallel
/// group, ready for the update.
pub(super) fn compute<T: Transport>(parts: &mut Parts<T>, batches: Vec<Batch>) -> Result<(f64, f64), String> {
    let Parts { rank, tp, dp, pipe, zero, buddy, .. } = parts;
    let pipe = pipe.as_mut().expect("a pipelined tensor-parallel rank has its pipe");
    let handle = tp.handle.clone();
    if let (Some(zero), Some(dp)) = (zero.as_mut(), dp.as_mut()) {
        zero.refresh(rank, dp, &handle)?;
    }
    for p in rank.params_mut() {
        p.zero_grad();
    }
    let e = |e: troupe_model::tensor_parallel::TpError| e.to_string();
    let mut run = Run::default();
    // Bytes of activations kept for backwards (the micro-batches in flight), for the rank's peak.
    let mut live = 0;
    let ops = pipe.plan.devices[pipe.device].clone();
    for op in ops {
        let (c, mb) = (op.chunk, op.microbatch);
        let (tokens, targets, weight, backward, samples) = &batches[mb];
        match op.kind {
            OpKind::Forward => {
                let chunk = &pipe.chunks[c];
                let input = match chunk.embed {
                    true => tokens.shallow_clone(),
                    false => run.activations.remove(&(c, mb)).ok_or("the plan ran a forward before its input")?,
                };
                let mut forward = |input: &Tensor| rank.stage_forward(tp, chunk, input, Some(targets), Some(*samples));
                let (output, saved) = if pipe.recompute {
                    let output = tch::no_grad(|| forward(&input)).map_err(e)?.output().shallow_clone();
                    (output, Saved::Again(input))
                } else {
                    let forward = forward(&input).map_err(e)?;
                    (forward.output().shallow_clone(), Saved::Tape(forward))
                };
                live += saved.held_bytes();
                rank.hold_activations(live);
                if chunk.head {
                    run.loss += output.double_value(&[]) * weight;
                } else if pipe.is_local(c + 1) {
                    run.activations.insert((c + 1, mb), output);
                } else {
                    run.to_next.insert((c, mb), output);
                }
                run.saved.insert((c, mb), saved);
            }
            OpKind::Backward | OpKind::BackwardInput => {
                let chunk = &pipe.chunks[c];
                let seed = match chunk.head {
                    true => Tensor::full([], *backward, (Kind::Float, tokens.device())),
                    false => run.gradients.remove(&(c, mb)).ok_or("the plan ran a backward before its gradient")?,
                };
                let saved = run.saved.remove(&(c, mb)).ok_or("the plan ran a backward before its forward")?;
                let kept = saved.held_bytes();
                let forward = match saved {
                    Saved::Tape(forward) => forward,
                    Saved::Again(input) => {
                        let forward =
                            rank.stage_forward(tp, chunk, &input, Some(targets), Some(*samples)).map_err(e)?;
                        rank.hold_activations(live + forward.held_bytes());
                        forward
                    }
                };
                let grad = match op.kind {
                    OpKind::BackwardInput => {
                        let (grad, pending) = rank.stage_backward_input(tp, forward, seed).map_err(e)?;
                        run.weights.insert((c, mb), (pending, kept));
                        grad
                    }
                    _ => {
                        live -= kept;
                        rank.stage_backward(tp, forward, seed).map_err(e)?
                    }
                };
                if let (Some(grad), true) = (grad, c > 0) {
                    match pipe.is_local(c - 1) {
                        true => run.gradients.insert((c - 1, mb), grad),
                        false => run.to_previous.insert((c, mb), grad),
                    };
                }
            }
            OpKind::BackwardWeight => {
                let (pending, kept) = run.weights.remove(&(c, mb)).ok_or("the plan ran a W before its B")?;
                rank.stage_backward_weight(tp, pending).map_err(e)?;
                live -= kept;
            }
            OpKind::SendActivation | OpKind::SendGradient => {
                let (map, to) = match op.kind {
                    OpKind::SendActivation => (&mut run.to_next, c + 1),
                    _ => (&mut run.to_previous, c - 1),
                };
                let tensor = map.remove(&(c, mb)).ok_or("the plan sent a tensor before computing it")?;
                let peer = pipe.plan.shape.device_of(to);
                handle.block_on(pipe.chain.send(peer, &values(&tensor)[..])).map_err(|e| e.to_string())?;
            }
            OpKind::RecvActivation | OpKind::RecvGradient => {
                let shape = pipe.boundary_shape(tokens);
                let mut data = vec![0.0f32; shape.iter().product::<i64>() as usize];
                let peer = pipe.plan.shape.device_of(c);
                handle.block_on(pipe.chain.recv(peer, &mut data[..])).map_err(|e| e.to_string())?;
                let tensor = Tensor::from_slice(&data).view(shape).to_device(tokens.device());
                match op.kind {
                    OpKind::RecvActivation => run.activations.insert((c + 1, mb), tensor),
                    _ => run.gradients.insert((c - 1, mb), tensor),
                };
            }
        }
    }
    if !run.saved.is_empty() || !run.weights.is_empty() || !run.to_next.is_empty() || !run.to_previous.is_empty() {
        return Err("the plan left work undone".into());
    }
    let device = pipe.device;
    let last = pipe.last_device();
    if pipe.tied && (device == 0 || device == last) {
        // One gradient for the embedding matrix: the first stage's (lookups) plus the head's copy's.
        let grad = rank.params()[0].grad();
        let mine = values(&grad);
        let mut theirs = vec![0.0f32; mine.len()];
        let other = if device == 0 { last } else { 0 };
        handle.block_on(pipe.chain.send(other, &mine[..])).map_err(|e| e.to_string())?;
        handle.block_on(pipe.chain.recv(other, &mut theirs[..])).map_err(|e| e.to_string())?;
        let theirs = Tensor::from_slice(&theirs).view(grad.size().as_slice()).to_device(grad.device());
        tch::no_grad(|| {
            let sum = &grad + theirs;
            grad.shallow_clone().copy_(&sum);
        });
    }
    let loss = if device == last { run.loss } else { 0.0 };
    let mut counted = rank.held().to_vec();
    if pipe.tied && device == last {
        counted[0] = false;
    }
    let first = tp.comm.rank() == 0;
    let params: Vec<Tensor> = rank.params().iter().map(Tensor::shallow_clone).collect();
    let grads: Vec<Tensor> =
        params.iter().map(|p| if p.grad().defined() { p.grad() } else { p.detach().zeros_like() }).collect();
    let mut flat = Vec::new();
    append_flat(&grads, &mut flat);
    if let (Some(zero), Some(dp)) = (zero.as_mut(), dp.as_mut()) {
        zero.reduce(flat, dp, &handle)?;
        let [split, replicated] = zero.squares(&rank.layout, &counted, first);
        let mut words = [split as f32, replicated as f32, loss as f32];
        handle.block_on(dp.all_reduce(&mut words[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
        return model_norm_and_loss(pipe, &handle, words, first);
    }
    flat.push(loss as f32);
    let (flat, loss) = super::sum_over_replicas(&params, flat, dp.as_mut(), &handle)?;
    super::refresh_buddy(buddy.as_ref(), rank, tp, flat)?;
    let [sharded, replicated] = rank.grad_squares(&counted);
    model_norm_and_loss(pipe, &handle, [sharded as f32, if first { replicated as f32 } else { 0.0 }, loss], first)
}

/// The norm and the loss over the replica's P × T ranks, from this rank's [split squares, replicated
/// squares (tensor rank 0's only), the data-parallel sum of the loss]: every rank's split shards, each
/// tensor group's replicated parameters once, the head's copy of the embedding matrix not counted twice
/// (the caller leaves it out); the loss from the last stage's tensor rank 0.
fn model_norm_and_loss<T: Transport>(
    pipe: &mut Pipe<T>,
    handle: &tokio::runtime::Handle,
    [split, replicated, loss]: [f32; 3],
    first: bool,
) -> Result<(f64, f64), String> {
    let last = pipe.device == pipe.last_device();
    let mut words = [split, replicated, if first && last { loss } else { 0.0 }];
    handle.block_on(pipe.model.all_reduce(&mut words[..], ReduceOp::Sum)).map_err(|e| e.to_string())?;
    Ok((f64::from(words[2]), (f64::from(words[0]) + f64::from(words[1])).sqrt()))
}

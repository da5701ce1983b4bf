//! The plan checker: any [`Plan`] — generated or hand-written — is run on paper with blocking receives
//! and non-blocking sends (what the transports give: a send returns once queued). It is accepted when
//! every computation and message happens exactly once on the right device, every computation finds its
//! inputs already computed or received, no set of devices waits on each other forever, and no device
//! holds more activations than the schedule's bound. The same execution, given costs, times the plan
//! ([`simulate`]): the theoretical bubble.

use std::collections::{HashMap, HashSet};

use super::plan::{Op, OpKind, Plan, PlanShape};

/// Why a plan is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("device {device}: {op} does not belong there: {why}")]
    Misplaced { device: usize, op: Op, why: &'static str },
    #[error("device {device}: {op} appears twice")]
    Duplicate { device: usize, op: Op },
    #[error("no device runs {op}")]
    Missing { op: Op },
    #[error("device {device}: {op} runs before {needs}, which it depends on")]
    DependencyViolated { device: usize, op: Op, needs: Op },
    #[error("deadlock: every unfinished device waits for a message never sent: {}", blocked_list(.blocked))]
    Deadlock { blocked: Vec<(usize, Op)> },
    #[error("device {device} holds {held} activations at {op}; schedule {kind} allows {bound}")]
    ActivationBound { device: usize, op: Op, held: usize, bound: usize, kind: super::ScheduleKind },
}

fn blocked_list(blocked: &[(usize, Op)]) -> String {
    blocked.iter().map(|(d, op)| format!("device {d} at {op}")).collect::<Vec<_>>().join(", ")
}

/// What a valid plan does.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanReport {
    /// Per device, the most activations held at once.
    pub peak_activations: Vec<usize>,
    /// The timing under unit costs.
    pub timeline: Timeline,
}

/// Durations of one chunk's operations (a chunk is 1/V of a device's model share, so its costs are the
/// device's divided by V — pass the per-device figures; [`simulate`] divides).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    pub forward: f64,
    pub backward_input: f64,
    pub backward_weight: f64,
    /// Latency of a message, from the end of its send to its availability at the receiver.
    pub message: f64,
}

impl Costs {
    /// The textbook unit costs: F = B = W = 1 (so a full backward is 2), messages free.
    pub const UNIT: Costs = Costs { forward: 1.0, backward_input: 1.0, backward_weight: 1.0, message: 0.0 };
}

/// When every op of a plan runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per device, per op in plan order: (start, end).
    pub spans: Vec<Vec<(Op, f64, f64)>>,
}

impl Timeline {
    /// The step's length: the last end.
    pub fn makespan(&self) -> f64 {
        self.spans.iter().flatten().map(|&(_, _, end)| end).fold(0.0, f64::max)
    }

    /// Per device, time spent computing.
    pub fn busy(&self) -> Vec<f64> {
        self.spans
            .iter()
            .map(|ops| ops.iter().filter(|(op, _, _)| op.kind.is_compute()).map(|(_, s, e)| e - s).sum())
            .collect()
    }

    /// Idle time over all devices divided by devices × makespan: for GPipe and 1F1B under unit costs,
    /// (P − 1)/(M + P − 1).
    pub fn bubble_fraction(&self) -> f64 {
        let makespan = self.makespan();
        if makespan <= 0.0 {
            return 0.0;
        }
        let idle: f64 = self.busy().iter().map(|b| makespan - b).sum();
        idle / (makespan * self.spans.len() as f64)
    }
}

/// Validates `plan` (see the module doc) and times it under unit costs.
pub fn check(plan: &Plan) -> Result<PlanReport, PlanError> {
    let run = execute(plan, &Costs::UNIT)?;
    let bound = plan.activation_bound();
    if let Some((device, op, held)) = run.first_over(bound) {
        return Err(PlanError::ActivationBound { device, op, held, bound, kind: plan.kind });
    }
    Ok(PlanReport { peak_activations: run.peaks, timeline: run.timeline })
}

/// Times a structurally valid plan under `costs`.
pub fn simulate(plan: &Plan, costs: &Costs) -> Result<Timeline, PlanError> {
    Ok(execute(plan, costs)?.timeline)
}

/// The theoretical bubble of GPipe and 1F1B: (P − 1)/(M + P − 1).
pub fn textbook_bubble(stages: usize, microbatches: usize) -> f64 {
    (stages - 1) as f64 / (microbatches + stages - 1) as f64
}

struct Execution {
    timeline: Timeline,
    peaks: Vec<usize>,
    /// Per device, the first op at which it held its peak.
    peak_at: Vec<Option<Op>>,
}

impl Execution {
    fn first_over(&self, bound: usize) -> Option<(usize, Op, usize)> {
        (0..self.peaks.len())
            .find(|&d| self.peaks[d] > bound)
            .map(|d| (d, self.peak_at[d].expect("peak op"), self.peaks[d]))
    }
}

/// The ops on `device` that must have run before `op` (receives included: a computation needs its
/// input received, not merely sent).
fn local_needs(shape: &PlanShape, device: usize, op: Op, splits: bool) -> Vec<Op> {
    let (c, mb, chunks) = (op.chunk, op.microbatch, shape.chunks());
    let backward_kind = if splits { OpKind::BackwardInput } else { OpKind::Backward };
    let local = |other: usize| shape.device_of(other) == device;
    match op.kind {
        OpKind::Forward if c > 0 => {
            vec![if local(c - 1) {
                Op::new(OpKind::Forward, c - 1, mb)
            } else {
                Op::new(OpKind::RecvActivation, c - 1, mb)
            }]
        }
        OpKind::Backward | OpKind::BackwardInput => {
            let mut needs = vec![Op::new(OpKind::Forward, c, mb)];
            if c + 1 < chunks {
                needs.push(if local(c + 1) {
                    Op::new(backward_kind, c + 1, mb)
                } else {
                    Op::new(OpKind::RecvGradient, c + 1, mb)
                });
            }
            needs
        }
        OpKind::BackwardWeight => vec![Op::new(OpKind::BackwardInput, c, mb)],
        OpKind::SendActivation => vec![Op::new(OpKind::Forward, c, mb)],
        OpKind::SendGradient => vec![Op::new(backward_kind, c, mb)],
        _ => Vec::new(),
    }
}

/// Checks where each op may run; returns the reason it may not.
fn placement(shape: &PlanShape, device: usize, op: Op, splits: bool) -> Result<(), &'static str> {
    let (c, chunks) = (op.chunk, shape.chunks());
    if c >= chunks {
        return Err("chunk out of range");
    }
    if op.microbatch >= shape.microbatches {
        return Err("micro-batch out of range");
    }
    let on = |chunk: usize| shape.device_of(chunk) == device;
    match op.kind {
        OpKind::Forward => on(c).then_some(()).ok_or("the chunk lives on another device"),
        OpKind::Backward if splits => Err("this schedule splits the backward into B and W"),
        OpKind::BackwardInput | OpKind::BackwardWeight if !splits => Err("this schedule runs whole backwards"),
        OpKind::Backward | OpKind::BackwardInput | OpKind::BackwardWeight => {
            on(c).then_some(()).ok_or("the chunk lives on another device")
        }
        OpKind::SendActivation if c + 1 >= chunks => Err("the last chunk's output goes to the loss, not a device"),
        OpKind::SendGradient if c == 0 => Err("the first chunk's input gradient goes nowhere"),
        OpKind::SendActivation | OpKind::SendGradient if !on(c) => Err("only the producing device sends"),
        OpKind::SendActivation if on(c + 1) => Err("the next chunk is on the same device: no message"),
        OpKind::SendGradient if on(c - 1) => Err("the previous chunk is on the same device: no message"),
        OpKind::RecvActivation if c + 1 >= chunks || !on(c + 1) => Err("only the next chunk's device receives"),
        OpKind::RecvGradient if c == 0 || !on(c - 1) => Err("only the previous chunk's device receives"),
        OpKind::RecvActivation if on(c) => Err("the producer is on the same device: no message"),
        OpKind::RecvGradient if on(c) => Err("the producer is on the same device: no message"),
        _ => Ok(()),
    }
}

/// Every op a complete plan of this shape must contain.
fn required_ops(shape: &PlanShape, splits: bool) -> Vec<Op> {
    let chunks = shape.chunks();
    let mut ops = Vec::new();
    for c in 0..chunks {
        for mb in 0..shape.microbatches {
            ops.push(Op::new(OpKind::Forward, c, mb));
            if splits {
                ops.push(Op::new(OpKind::BackwardInput, c, mb));
                ops.push(Op::new(OpKind::BackwardWeight, c, mb));
            } else {
                ops.push(Op::new(OpKind::Backward, c, mb));
            }
            if c + 1 < chunks && shape.device_of(c) != shape.device_of(c + 1) {
                ops.push(Op::new(OpKind::SendActivation, c, mb));
                ops.push(Op::new(OpKind::RecvActivation, c, mb));
            }
            if c > 0 && shape.device_of(c) != shape.device_of(c - 1) {
                ops.push(Op::new(OpKind::SendGradient, c, mb));
                ops.push(Op::new(OpKind::RecvGradient, c, mb));
            }
        }
    }
    ops
}

/// Checks the plan's structure, then runs it on a simulated clock under `costs`.
fn execute(plan: &Plan, costs: &Costs) -> Result<Execution, PlanError> {
    check_structure(plan)?;
    run_clocked(plan, costs)
}

/// One op list per device, each op placed where it may run, none twice, none of the shape's missing.
fn check_structure(plan: &Plan) -> Result<(), PlanError> {
    let shape = &plan.shape;
    let splits = plan.kind.splits_backward();
    let devices = plan.devices.len();
    if devices != shape.stages {
        let op = Op::new(OpKind::Forward, shape.chunk_at(devices.min(shape.stages - 1), 0), 0);
        return Err(PlanError::Missing { op });
    }
    let mut seen = HashSet::new();
    for (device, ops) in plan.devices.iter().enumerate() {
        for &op in ops {
            placement(shape, device, op, splits).map_err(|why| PlanError::Misplaced { device, op, why })?;
            if !seen.insert(op) {
                return Err(PlanError::Duplicate { device, op });
            }
        }
    }
    if let Some(op) = required_ops(shape, splits).into_iter().find(|op| !seen.contains(op)) {
        return Err(PlanError::Missing { op });
    }
    Ok(())
}

/// The time an op of `kind` takes on a chunk (`costs` are a whole stage's, of `virtual_stages` chunks).
fn op_cost(costs: &Costs, virtual_stages: usize, kind: OpKind) -> f64 {
    let v = virtual_stages as f64;
    match kind {
        OpKind::Forward => costs.forward / v,
        OpKind::Backward => (costs.backward_input + costs.backward_weight) / v,
        OpKind::BackwardInput => costs.backward_input / v,
        OpKind::BackwardWeight => costs.backward_weight / v,
        _ => 0.0,
    }
}

/// The send a receive of `kind` waits for (None: `kind` is no receive).
fn awaited_send(kind: OpKind) -> Option<OpKind> {
    match kind {
        OpKind::RecvActivation => Some(OpKind::SendActivation),
        OpKind::RecvGradient => Some(OpKind::SendGradient),
        _ => None,
    }
}

/// Runs a structurally valid plan: each device runs its list in order, an op once its local needs ran
/// (and a receive once its send arrived); the timeline and each device's peak of held activations.
fn run_clocked(plan: &Plan, costs: &Costs) -> Result<Execution, PlanError> {
    let shape = &plan.shape;
    let splits = plan.kind.splits_backward();
    let devices = plan.devices.len();
    let mut pc = vec![0usize; devices];
    let mut clock = vec![0.0f64; devices];
    let mut done: Vec<HashMap<Op, f64>> = vec![HashMap::new(); devices];
    let mut sent: HashMap<(OpKind, usize, usize), f64> = HashMap::new();
    let mut held = vec![0usize; devices];
    let mut peaks = vec![0usize; devices];
    let mut peak_at = vec![None; devices];
    let mut spans: Vec<Vec<(Op, f64, f64)>> = plan.devices.iter().map(|ops| Vec::with_capacity(ops.len())).collect();
    loop {
        let mut progressed = false;
        for device in 0..devices {
            while let Some(&op) = plan.devices[device].get(pc[device]) {
                let mut ready = clock[device];
                for needs in local_needs(shape, device, op, splits) {
                    match done[device].get(&needs) {
                        Some(&at) => ready = ready.max(at),
                        None => return Err(PlanError::DependencyViolated { device, op, needs }),
                    }
                }
                if let Some(send) = awaited_send(op.kind) {
                    match sent.get(&(send, op.chunk, op.microbatch)) {
                        Some(&at) => ready = ready.max(at + costs.message),
                        None => break, // blocked
                    }
                }
                let end = ready + op_cost(costs, shape.virtual_stages, op.kind);
                match op.kind {
                    OpKind::SendActivation | OpKind::SendGradient => {
                        sent.insert((op.kind, op.chunk, op.microbatch), end);
                    }
                    OpKind::Forward => {
                        held[device] += 1;
                        if held[device] > peaks[device] {
                            (peaks[device], peak_at[device]) = (held[device], Some(op));
                        }
                    }
                    OpKind::Backward | OpKind::BackwardWeight => held[device] -= 1,
                    _ => {}
                }
                done[device].insert(op, end);
                spans[device].push((op, ready, end));
                clock[device] = end;
                pc[device] += 1;
                progressed = true;
            }
        }
        if (0..devices).all(|d| pc[d] == plan.devices[d].len()) {
            break;
        }
        if !progressed {
            let blocked = (0..devices).filter_map(|d| plan.devices[d].get(pc[d]).map(|&op| (d, op))).collect();
            return Err(PlanError::Deadlock { blocked });
        }
    }
    Ok(Execution { timeline: Timeline { spans }, peaks, peak_at })
}

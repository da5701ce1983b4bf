//! The schedule generators: (kind, P, M, V) → a [`Plan`]. Each first orders every device's computations
//! (F, B, W), then [`with_messages`] puts a receive right before the computation that consumes a remote
//! input and a send right after the one that produces a remote output. Pure functions: no clock, no IO.

use super::check::{simulate, Costs, PlanError};
use super::plan::{Op, OpKind, Plan, PlanShape, ScheduleKind};

/// Most stages, micro-batches and virtual stages a plan may have (a bound on plan size, not a tuning).
pub const STAGES_MAX: usize = 256;
pub const MICROBATCHES_MAX: usize = 4096;
pub const VIRTUAL_STAGES_MAX: usize = 16;

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("{what} = {value}: must be in 1..={max}")]
    OutOfRange { what: &'static str, value: usize, max: usize },
    #[error(
        "--virtual-stages {virtual_stages} needs --schedule interleaved (schedule {kind} runs one stage per device)"
    )]
    VirtualStagesNeedInterleaving { kind: ScheduleKind, virtual_stages: usize },
}

/// The plan of `kind` for `shape`.
pub fn plan(kind: ScheduleKind, shape: PlanShape) -> Result<Plan, ScheduleError> {
    let check = |what, value, max| {
        if (1..=max).contains(&value) {
            Ok(())
        } else {
            Err(ScheduleError::OutOfRange { what, value, max })
        }
    };
    check("stages", shape.stages, STAGES_MAX)?;
    check("microbatches", shape.microbatches, MICROBATCHES_MAX)?;
    check("virtual stages", shape.virtual_stages, VIRTUAL_STAGES_MAX)?;
    if shape.virtual_stages != 1 && kind != ScheduleKind::Interleaved {
        return Err(ScheduleError::VirtualStagesNeedInterleaving { kind, virtual_stages: shape.virtual_stages });
    }
    let compute = match kind {
        ScheduleKind::GPipe => gpipe(shape),
        ScheduleKind::OneFOneB => one_f_one_b(shape),
        ScheduleKind::Interleaved => interleaved(shape),
        ScheduleKind::ZbH1 => zb_h1(shape),
    };
    Ok(Plan { kind, shape, devices: with_messages(shape, compute) })
}

/// GPipe: every forward, then every backward, in micro-batch order.
fn gpipe(shape: PlanShape) -> Vec<Vec<Op>> {
    (0..shape.stages)
        .map(|d| {
            let forwards = (0..shape.microbatches).map(|mb| Op::new(OpKind::Forward, d, mb));
            let backwards = (0..shape.microbatches).map(|mb| Op::new(OpKind::Backward, d, mb));
            forwards.chain(backwards).collect()
        })
        .collect()
}

/// 1F1B (PipeDream-flush): device d runs min(P − d − 1, M) warm-up forwards, then alternates one forward
/// and one backward, then drains the remaining backwards.
fn one_f_one_b(shape: PlanShape) -> Vec<Vec<Op>> {
    let (p, m) = (shape.stages, shape.microbatches);
    (0..p)
        .map(|d| {
            let forwards: Vec<(usize, usize)> = (0..m).map(|mb| (d, mb)).collect();
            interleave_one_f_one_b(&forwards, &forwards, (p - d - 1).min(m), OpKind::Backward)
        })
        .collect()
}

/// Megatron's interleaved 1F1B. Micro-batches go through a device's chunks in groups of P: forwards of
/// the group on virtual stage 0, then on 1, …; backwards likewise from the last virtual stage down
/// (a remainder of M mod P forms a short last group). Device d warms up with (P − d − 1)·2 + (V − 1)·P
/// forwards (at most all M·V). When M is not a multiple of P that warm-up can make a steady-state
/// forward wait on a backward ordered after it; the warm-up of each device the checker finds blocked is
/// then raised by one until the plan runs (at worst to all forwards first, which always runs).
fn interleaved(shape: PlanShape) -> Vec<Vec<Op>> {
    let (p, v, total) = (shape.stages, shape.virtual_stages, shape.microbatches * shape.virtual_stages);
    let mut warmups: Vec<usize> = (0..p).map(|d| ((p - d - 1) * 2 + (v - 1) * p).min(total)).collect();
    loop {
        let compute = interleaved_with_warmups(shape, &warmups);
        let candidate = Plan { kind: ScheduleKind::Interleaved, shape, devices: with_messages(shape, compute.clone()) };
        let blocked: Vec<usize> = match simulate(&candidate, &Costs::UNIT) {
            Ok(_) => return compute,
            Err(PlanError::DependencyViolated { device, .. }) => vec![device],
            Err(PlanError::Deadlock { blocked }) => blocked.into_iter().map(|(device, _)| device).collect(),
            Err(other) => unreachable!("interleaved generator made a malformed plan: {other}"),
        };
        let raisable: Vec<usize> = blocked.into_iter().filter(|&d| warmups[d] < total).collect();
        assert!(!raisable.is_empty(), "interleaved plan blocked with every forward first");
        for d in raisable {
            warmups[d] += 1;
        }
    }
}

fn interleaved_with_warmups(shape: PlanShape, warmups: &[usize]) -> Vec<Vec<Op>> {
    let (p, m, v) = (shape.stages, shape.microbatches, shape.virtual_stages);
    (0..p)
        .map(|d| {
            let sequence = |virtuals: &mut dyn Iterator<Item = usize>| -> Vec<(usize, usize)> {
                let virtuals: Vec<usize> = virtuals.collect();
                let mut seq = Vec::with_capacity(m * v);
                for group in (0..m).step_by(p) {
                    for &vs in &virtuals {
                        for mb in group..(group + p).min(m) {
                            seq.push((shape.chunk_at(d, vs), mb));
                        }
                    }
                }
                seq
            };
            let (forwards, backwards) = (sequence(&mut (0..v)), sequence(&mut (0..v).rev()));
            interleave_one_f_one_b(&forwards, &backwards, warmups[d], OpKind::Backward)
        })
        .collect()
}

/// `warmup` forwards, then pairs (next forward, next backward), then the remaining backwards.
fn interleave_one_f_one_b(
    forwards: &[(usize, usize)],
    backwards: &[(usize, usize)],
    warmup: usize,
    backward: OpKind,
) -> Vec<Op> {
    let mut ops = Vec::with_capacity(forwards.len() * 2);
    let op = |kind, &(chunk, mb): &(usize, usize)| Op::new(kind, chunk, mb);
    ops.extend(forwards[..warmup].iter().map(|f| op(OpKind::Forward, f)));
    for (f, b) in forwards[warmup..].iter().zip(backwards) {
        ops.push(op(OpKind::Forward, f));
        ops.push(op(backward, b));
    }
    ops.extend(backwards[forwards.len() - warmup..].iter().map(|b| op(backward, b)));
    ops
}

/// ZB-H1 (Qi et al. 2023, §2.1): 1F1B's order with the backward split into B and W, and the W passes
/// of device d delayed by d micro-batches, so every device holds min(P, M) micro-batches' activations
/// (1F1B's peak, reached on device 0 only) and the delayed W passes fill the cool-down bubble. Device d:
/// min(P − d − 1, M) warm-up forwards; then per micro-batch k a forward (while any remain), B(k) and
/// W(k − d); then the remaining W passes. Under unit costs the step takes 3M + P − 1 for M ≥ P, against
/// 1F1B's 3(M + P − 1): a third of the idle time.
fn zb_h1(shape: PlanShape) -> Vec<Vec<Op>> {
    let (p, m) = (shape.stages, shape.microbatches);
    (0..p)
        .map(|d| {
            let warmup = (p - d - 1).min(m);
            let mut ops: Vec<Op> = (0..warmup).map(|mb| Op::new(OpKind::Forward, d, mb)).collect();
            let mut weights_done = 0;
            for k in 0..m {
                if warmup + k < m {
                    ops.push(Op::new(OpKind::Forward, d, warmup + k));
                }
                ops.push(Op::new(OpKind::BackwardInput, d, k));
                if k >= d {
                    ops.push(Op::new(OpKind::BackwardWeight, d, k - d));
                    weights_done += 1;
                }
            }
            ops.extend((weights_done..m).map(|mb| Op::new(OpKind::BackwardWeight, d, mb)));
            ops
        })
        .collect()
}

/// Adds the messages to per-device computation orders: before a computation whose input lives on another
/// device, the receive; after one whose output another device needs, the send.
pub fn with_messages(shape: PlanShape, compute: Vec<Vec<Op>>) -> Vec<Vec<Op>> {
    let chunks = shape.chunks();
    let remote = |from: usize, to: usize| shape.device_of(from) != shape.device_of(to);
    compute
        .into_iter()
        .map(|ops| {
            let mut out = Vec::with_capacity(ops.len() * 2);
            for op in ops {
                let (c, mb) = (op.chunk, op.microbatch);
                match op.kind {
                    OpKind::Forward => {
                        if c > 0 && remote(c - 1, c) {
                            out.push(Op::new(OpKind::RecvActivation, c - 1, mb));
                        }
                        out.push(op);
                        if c + 1 < chunks && remote(c, c + 1) {
                            out.push(Op::new(OpKind::SendActivation, c, mb));
                        }
                    }
                    OpKind::Backward | OpKind::BackwardInput => {
                        if c + 1 < chunks && remote(c + 1, c) {
                            out.push(Op::new(OpKind::RecvGradient, c + 1, mb));
                        }
                        out.push(op);
                        if c > 0 && remote(c, c - 1) {
                            out.push(Op::new(OpKind::SendGradient, c, mb));
                        }
                    }
                    _ => out.push(op),
                }
            }
            out
        })
        .collect()
}

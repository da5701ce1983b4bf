//! Executing a plan over a transport: the IO shell around [`super::plan`]. The working buffer is f32;
//! wire bytes are of element type `E`.

use std::ops::Range;

use bytes::Bytes;
use futures::future::{try_join, try_join_all};
use troupe_kernels::reduce::{finish_avg, reduce_into, ReduceOp};

use super::plan::{Action, Combine, Plan};
use super::Element;
use crate::error::Rank;
use crate::transport::{LossScope, Payload, Transport};
use crate::wire::Tag;
use crate::ClusterError;

/// Everything an execution needs besides the plan and the buffer.
#[derive(Clone, Copy, Debug)]
pub struct ExecContext {
    pub op: ReduceOp,
    /// Number of contributions an average divides by (the group size).
    pub contributions: usize,
    /// Tag of the call; `step` is added to each step's index so slices of one call never collide.
    pub tag: Tag,
    pub timeout_ms: u64,
    pub op_name: &'static str,
}

fn apply<E: Element>(dst: &mut [f32], src: &[E], combine: Combine, op: ReduceOp) {
    match combine {
        Combine::Reduce => {
            reduce_into(dst, src, op);
            // Partial results are stored as E, as they travel: both partners of an exchange then
            // combine identical values and every rank ends bit-identical.
            if E::DTYPE != super::Dtype::F32 {
                dst.iter_mut().for_each(|d| *d = E::from_f32(*d).to_f32());
            }
        }
        Combine::Copy => dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32()),
    }
}

fn read_unaligned<E: Element>(bytes: &[u8]) -> Vec<E> {
    bytes.chunks_exact(E::BYTES).map(bytemuck::pod_read_unaligned::<E>).collect()
}

/// Applies a received payload to `dst`, segment by segment, without copying aligned segments.
fn apply_payload<E: Element>(
    rank: Rank,
    from: Rank,
    ctx: &ExecContext,
    dst: &mut [f32],
    payload: &Payload,
    combine: Combine,
) -> Result<(), ClusterError> {
    let expected = dst.len() * E::BYTES;
    let got = payload.len();
    if got != expected {
        return Err(ClusterError::LengthMismatch { rank, op: ctx.op_name, peer: from, got, expected });
    }
    if payload.segments.iter().any(|s| s.len() % E::BYTES != 0) {
        let joined = payload.to_vec();
        let src = read_unaligned::<E>(&joined);
        apply(dst, &src, combine, ctx.op);
        return Ok(());
    }
    let mut at = 0;
    for seg in &payload.segments {
        let k = seg.len() / E::BYTES;
        let out = &mut dst[at..at + k];
        match bytemuck::try_cast_slice::<u8, E>(seg) {
            Ok(src) => apply(out, src, combine, ctx.op),
            Err(_) => apply(out, &read_unaligned::<E>(seg), combine, ctx.op),
        }
        at += k;
    }
    Ok(())
}

/// Runs `plan` on `buf` (the whole working buffer of this slice), tagging step i as `ctx.tag.step + i`.
pub async fn execute<T: Transport, E: Element>(
    transport: &T,
    plan: &Plan,
    buf: &mut [f32],
    ctx: ExecContext,
) -> Result<(), ClusterError> {
    let rank = transport.rank();
    for (i, step) in plan.steps.iter().enumerate() {
        let tag = Tag { step: ctx.tag.step + i as u32, ..ctx.tag };
        let sends: Vec<(Rank, Bytes)> = step
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { to, range } => Some((*to, E::encode(&buf[range.clone()]))),
                _ => None,
            })
            .collect();
        let recvs: Vec<(Rank, Range<usize>, Combine)> = step
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Recv { from, range, combine } => Some((*from, range.clone(), *combine)),
                _ => None,
            })
            .collect();
        let send_all = try_join_all(sends.into_iter().map(|(to, bytes)| transport.send(to, tag, bytes)));
        let recv_all =
            try_join_all(recvs.iter().map(|(from, _, _)| transport.recv(*from, tag, LossScope::Group, ctx.timeout_ms)));
        let (_, payloads) = try_join(send_all, recv_all).await?;
        for ((from, range, combine), payload) in recvs.iter().zip(&payloads) {
            apply_payload::<E>(rank, *from, &ctx, &mut buf[range.clone()], payload, *combine)?;
        }
        for a in &step.actions {
            if let Action::Finish { range } = a {
                if ctx.op == ReduceOp::Avg {
                    finish_avg(&mut buf[range.clone()], ctx.contributions);
                }
            }
        }
    }
    Ok(())
}

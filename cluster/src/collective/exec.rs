//! Executing a plan over a transport: the IO shell around [`super::plan`]. The working buffer is f32;
//! wire bytes are of element type `E`.

use std::ops::Range;

use futures::future::{try_join, try_join_all, Either};
use troupe_kernels::reduce::{finish_avg, reduce_into, ReduceOp};

use super::plan::{Action, Combine, Plan};
use super::send_buffers::SendBuffers;
use super::{Dtype, Element};
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
            E::round_in_place(dst);
        }
        Combine::Copy => E::widen(src, dst),
    }
}

/// Elements of a misaligned segment moved at a time into an aligned block on the stack (16 KiB of
/// f32: stays in L1 between the copy and the reduction).
const UNALIGNED_BLOCK_ELEMS: usize = 4096;

/// Applies `src` (raw little-endian `E`s at any address) to `out` through an aligned stack block —
/// except an f32 copy, whose bytes are already the output's: one copy, straight into it.
fn apply_unaligned<E: Element>(out: &mut [f32], src: &[u8], combine: Combine, op: ReduceOp) {
    if E::DTYPE == Dtype::F32 && combine == Combine::Copy {
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(src);
        return;
    }
    let mut block = [E::zeroed(); UNALIGNED_BLOCK_ELEMS];
    for (out, src) in out.chunks_mut(UNALIGNED_BLOCK_ELEMS).zip(src.chunks(UNALIGNED_BLOCK_ELEMS * E::BYTES)) {
        let block = &mut block[..out.len()];
        bytemuck::cast_slice_mut::<E, u8>(block).copy_from_slice(src);
        apply(out, block, combine, op);
    }
}

/// Applies a received payload to `dst`, segment by segment, without copying aligned segments.
/// Segments may end mid-element and start at any address (QUIC delivers the chunks it received,
/// wherever they sat in their packets): the split element is carried over, and a misaligned
/// segment goes through a small aligned block on the stack.
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
    let mut at = 0;
    let mut carry = [0u8; 16];
    let mut carried = 0;
    for seg in &payload.segments {
        let mut s: &[u8] = seg;
        if carried > 0 {
            let take = (E::BYTES - carried).min(s.len());
            carry[carried..carried + take].copy_from_slice(&s[..take]);
            carried += take;
            s = &s[take..];
            if carried < E::BYTES {
                continue;
            }
            let v = bytemuck::pod_read_unaligned::<E>(&carry[..E::BYTES]);
            apply(&mut dst[at..at + 1], std::slice::from_ref(&v), combine, ctx.op);
            at += 1;
        }
        let k = s.len() / E::BYTES;
        let (body, rest) = s.split_at(k * E::BYTES);
        let out = &mut dst[at..at + k];
        match bytemuck::try_cast_slice::<u8, E>(body) {
            Ok(src) => apply(out, src, combine, ctx.op),
            Err(_) => apply_unaligned::<E>(out, body, combine, ctx.op),
        }
        at += k;
        carry[..rest.len()].copy_from_slice(rest);
        carried = rest.len();
    }
    debug_assert!(at == dst.len() && carried == 0);
    Ok(())
}

/// Runs `plan` on `buf` (the whole working buffer of this slice), tagging step i as `ctx.tag.step + i`;
/// outgoing messages are encoded into `buffers`.
pub async fn execute<T: Transport, E: Element>(
    transport: &T,
    buffers: &SendBuffers,
    plan: &Plan,
    buf: &mut [f32],
    ctx: ExecContext,
) -> Result<(), ClusterError> {
    let rank = transport.rank();
    for (i, step) in plan.steps.iter().enumerate() {
        let tag = Tag { step: ctx.tag.step + i as u32, ..ctx.tag };
        // f32 wire bytes are the working buffer's own: a transport that copies as it sends (a socket)
        // takes them borrowed; otherwise they are encoded into a message the transport can keep.
        let sends: Vec<_> = step
            .actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { to, range } => Some((*to, &buf[range.clone()])),
                _ => None,
            })
            .map(|(to, values)| {
                if E::DTYPE == Dtype::F32 && transport.copies_on_send(to) {
                    Either::Left(transport.send_slice(to, tag, bytemuck::cast_slice(values)))
                } else {
                    Either::Right(transport.send(to, tag, buffers.encode::<E>(values)))
                }
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
        let send_all = try_join_all(sends);
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use half::bf16;

    use super::*;

    fn ctx(op: ReduceOp) -> ExecContext {
        ExecContext { op, contributions: 2, tag: Tag::default(), timeout_ms: 1, op_name: "test" }
    }

    /// Cuts `bytes` at the given offsets (into segments that split elements, some empty). With
    /// `shift` 0 they are slices of one aligned buffer (every element after a split one starts
    /// aligned); otherwise each is its own buffer whose element boundaries sit `shift` bytes off
    /// alignment, as a chunk somewhere in a received QUIC packet does.
    fn cut_shifted(bytes: &[u8], at: &[usize], shift: usize) -> Payload {
        let mut bounds = vec![0];
        bounds.extend(at.iter().copied());
        bounds.push(bytes.len());
        let whole = Bytes::copy_from_slice(bytes);
        let segment = |w: &[usize]| {
            if shift == 0 {
                return whole.slice(w[0]..w[1]);
            }
            // Byte g of the payload lands at lead + g - w[0]: element starts (g = 0 mod 4) at `shift` mod 4.
            let lead = (shift + w[0]) % 4;
            let mut v = vec![0u8; lead];
            v.extend_from_slice(&bytes[w[0]..w[1]]);
            Bytes::from(v).slice(lead..)
        };
        Payload { segments: bounds.windows(2).map(segment).collect() }
    }

    #[test]
    fn segments_that_split_elements_reduce_like_one_segment() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&src).to_vec();
        let base: Vec<f32> = (0..1000).map(|i| (i % 13) as f32).collect();
        let want: Vec<f32> = base.iter().zip(&src).map(|(a, b)| a + b).collect();
        for shift in 0..4 {
            for at in [vec![1], vec![3, 5, 5, 6], vec![1001, 2002, 3999], vec![7, 13, 2049, 2050, 3998]] {
                let payload = cut_shifted(&bytes, &at, shift);
                let mut dst = base.clone();
                apply_payload::<f32>(0, 1, &ctx(ReduceOp::Sum), &mut dst, &payload, Combine::Reduce).unwrap();
                assert_eq!(dst, want, "cut at {at:?}, shifted {shift}");
                let mut dst = vec![f32::NAN; 1000];
                apply_payload::<f32>(0, 1, &ctx(ReduceOp::Sum), &mut dst, &payload, Combine::Copy).unwrap();
                assert_eq!(dst, src, "copy cut at {at:?}, shifted {shift}");
            }
        }
        // Misaligned segments longer than one stack block (several blocks and a partial one).
        let long: Vec<f32> = (0..3 * UNALIGNED_BLOCK_ELEMS + 77).map(|i| (i % 251) as f32 - 100.0).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&long).to_vec();
        for shift in 1..4 {
            let payload = cut_shifted(&bytes, &[1, 4 * 5000 + 3], shift);
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let mut dst: Vec<f32> = (0..long.len()).map(|i| (i % 7) as f32 * 20.0).collect();
                let want: Vec<f32> =
                    dst.iter().zip(&long).map(|(&a, &b)| if op == ReduceOp::Sum { a + b } else { a.max(b) }).collect();
                apply_payload::<f32>(0, 1, &ctx(op), &mut dst, &payload, Combine::Reduce).unwrap();
                assert_eq!(dst, want, "long misaligned segments, {op:?}, shifted {shift}");
            }
            let mut dst = vec![f32::NAN; long.len()];
            apply_payload::<f32>(0, 1, &ctx(ReduceOp::Sum), &mut dst, &payload, Combine::Copy).unwrap();
            assert_eq!(dst, long, "long misaligned segments copied, shifted {shift}");
        }
        let half: Vec<bf16> = src.iter().map(|&v| bf16::from_f32(v)).collect();
        let bytes: Vec<u8> = bytemuck::cast_slice(&half).to_vec();
        for shift in 0..4 {
            let mut dst = vec![0f32; 1000];
            let payload = cut_shifted(&bytes, &[1, 2, 999, 1001], shift);
            apply_payload::<bf16>(0, 1, &ctx(ReduceOp::Max), &mut dst, &payload, Combine::Copy).unwrap();
            assert_eq!(dst, half.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "bf16 shifted {shift}");
        }
    }
}

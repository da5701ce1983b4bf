//! Collectives in the shared-memory arena of the same-host transport ([`crate::transport::shm`]).
//!
//! **Layout.** The buffer is cut into n chunks as everywhere ([`chunk_range`]): rank q owns chunk q.
//! Each chunk is walked in pieces of `slot_elems / n` elements; block b is the b-th piece of every
//! chunk. A rank's slot holds one block: piece q at offset `q · piece`. Blocks alternate between a
//! rank's two slots, so one block is written while the previous one is still read.
//!
//! **All-reduce, per block, in three phases** (every rank publishes each phase; a phase waits for the
//! phases it reads):
//! 1. *Write*: each rank copies the pieces it does not own into its slot.
//! 2. *Reduce* (after every rank's write): the owner of piece q combines the n contributions — its own
//!    from its buffer, the others straight from their slots — **in rank order 0, 1, …, n−1** (so the
//!    result does not depend on which rank owns the piece), and writes the result into its buffer and
//!    into piece q of its own slot.
//! 3. *Gather* (after every rank's reduce): each rank copies the other pieces' results from their
//!    owners' slots into its buffer.
//!
//! Each element of the buffer is read once and written once per rank from main memory; the slots are
//! small enough (default 1 MiB) to stay in the shared cache between a write and the peers' reads. A slot
//! is written again only after every rank has completed the last phase that reads it. Broadcast,
//! reduce, all-gather, reduce-scatter and barrier are subsets of the same phases.

use std::ops::Range;

use troupe_kernels::reduce::{ReduceInput, ReduceOp};

use super::chunk_range;
use crate::error::Rank;
use crate::transport::shm::{ArenaClaim, CallGuard, CallRecord};
use crate::wire::Tag;
use crate::ClusterError;

/// Elements combined at a time in the reduce phase (an L1-resident temporary).
const TILE_ELEMS: usize = 2048;

/// How a buffer of `len` elements maps onto blocks of the arena's slots.
#[derive(Clone, Copy, Debug)]
struct Layout {
    len: usize,
    n: usize,
    piece: usize,
    blocks: usize,
}

impl Layout {
    fn new(len: usize, n: usize, slot_elems: usize) -> Layout {
        let piece = (slot_elems / n).max(1);
        Layout { len, n, piece, blocks: len.div_ceil(n).div_ceil(piece) }
    }

    /// The elements of the buffer that are piece `q` of block `b`.
    fn piece(&self, q: Rank, b: usize) -> Range<usize> {
        let chunk = chunk_range(self.len, self.n, q);
        let start = (chunk.start + b * self.piece).min(chunk.end);
        start..(start + self.piece).min(chunk.end)
    }

    /// Where piece `q` sits in a slot.
    fn in_slot(&self, q: Rank, elems: usize) -> Range<usize> {
        q * self.piece..q * self.piece + elems
    }
}

/// Which collective, as recorded for the peers' check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShmOp {
    AllReduce(ReduceOp),
    Reduce(ReduceOp, Rank),
    Broadcast(Rank),
    AllGather,
    ReduceScatter(ReduceOp),
    Barrier,
}

impl ShmOp {
    fn name(self) -> &'static str {
        match self {
            ShmOp::AllReduce(_) => "all_reduce",
            ShmOp::Reduce(..) => "reduce",
            ShmOp::Broadcast(_) => "broadcast",
            ShmOp::AllGather => "all_gather",
            ShmOp::ReduceScatter(_) => "reduce_scatter",
            ShmOp::Barrier => "barrier",
        }
    }

    fn code(self) -> u64 {
        let op = |o: ReduceOp| o as u64;
        match self {
            ShmOp::AllReduce(o) => 1 | op(o) << 8,
            ShmOp::Reduce(o, root) => 2 | op(o) << 8 | (root as u64) << 16,
            ShmOp::Broadcast(root) => 3 | (root as u64) << 16,
            ShmOp::AllGather => 4,
            ShmOp::ReduceScatter(o) => 5 | op(o) << 8,
            ShmOp::Barrier => 6,
        }
    }
}

/// Elements (f32) a call of `op` on `len` elements moves between rank `me` and rank `q`: (read by `q`
/// from our slots, read by us from `q`'s).
pub fn traffic(op: ShmOp, len: usize, n: usize, me: Rank, q: Rank) -> (usize, usize) {
    let chunk = |r| chunk_range(len, n, r).len();
    match op {
        ShmOp::AllReduce(_) => (chunk(q) + chunk(me), chunk(me) + chunk(q)),
        ShmOp::Reduce(_, root) => {
            (chunk(q) + if q == root { chunk(me) } else { 0 }, chunk(me) + if me == root { chunk(q) } else { 0 })
        }
        ShmOp::Broadcast(root) if me == root => (len, 0),
        ShmOp::Broadcast(root) if q == root => (0, len),
        ShmOp::Broadcast(_) | ShmOp::Barrier => (0, 0),
        ShmOp::AllGather => (chunk(me), chunk(q)),
        ShmOp::ReduceScatter(_) => (chunk(q), chunk(me)),
    }
}

/// Runs `op` on `acc` (the f32 working buffer) in the arena. For all-gather, `acc` holds this rank's
/// chunk in place and ends with every chunk; for reduce-scatter, this rank's chunk of `acc` ends
/// reduced (the rest is scratch).
pub async fn run(
    claim: &mut ArenaClaim,
    op: ShmOp,
    acc: &mut [f32],
    tag: Tag,
    timeout_ms: u64,
) -> Result<(), ClusterError> {
    let record = CallRecord { op: op.name(), code: op.code(), len: acc.len() as u64, tag };
    let mut g = claim.begin(record, timeout_ms)?;
    let (me, n, slot_elems) = (g.arena().rank(), g.arena().world(), g.arena().slot_elems());
    let layout = Layout::new(acc.len(), n, slot_elems);
    match op {
        ShmOp::Barrier => {
            let arrived = g.publish();
            g.wait_all(arrived).await?;
        }
        ShmOp::AllReduce(o) => reduce_blocks(&mut g, &layout, acc, o, Gather::Everyone).await?,
        ShmOp::Reduce(o, root) => reduce_blocks(&mut g, &layout, acc, o, Gather::Root(root)).await?,
        ShmOp::ReduceScatter(o) => reduce_blocks(&mut g, &layout, acc, o, Gather::Nobody).await?,
        ShmOp::AllGather => {
            for b in 0..layout.blocks {
                let written = write_block(&mut g, &layout, acc, b, std::iter::once(me)).await?;
                g.wait_all(written).await?;
                gather(&g, &layout, acc, b, (0..n).filter(|&q| q != me), |q| q);
                let read = g.publish();
                g.read_until(b % 2, read);
            }
        }
        ShmOp::Broadcast(root) => {
            for b in 0..layout.blocks {
                if me == root {
                    write_block(&mut g, &layout, acc, b, 0..n).await?;
                } else {
                    let written = g.publish();
                    g.wait_for(root, written).await?;
                    gather(&g, &layout, acc, b, 0..n, |_| root);
                }
                let read = g.publish();
                if me == root {
                    g.read_until(b % 2, read);
                }
            }
        }
    }
    g.finish();
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Gather {
    Everyone,
    Root(Rank),
    Nobody,
}

/// Copies `pieces` of block `b` into this rank's slot, once no peer reads that slot any more. Returns
/// the phase that publishes the write.
async fn write_block(
    g: &mut CallGuard<'_>,
    layout: &Layout,
    acc: &[f32],
    b: usize,
    pieces: impl Iterator<Item = Rank>,
) -> Result<u32, ClusterError> {
    let s = b % 2;
    g.take_slot(s).await?;
    for q in pieces {
        let p = layout.piece(q, b);
        // SAFETY: our slot, taken for this block; peers read piece q only after the phase we publish.
        unsafe { g.own_slot(s)[layout.in_slot(q, p.len())].copy_from_slice(&acc[p]) };
    }
    Ok(g.publish())
}

/// Write, reduce and (per `gather_to`) gather every block, software-pipelined: block b + 1 is written
/// between block b's reduce and its gather, so a rank waiting for a slower peer's reduce has work.
async fn reduce_blocks(
    g: &mut CallGuard<'_>,
    layout: &Layout,
    acc: &mut [f32],
    op: ReduceOp,
    gather_to: Gather,
) -> Result<(), ClusterError> {
    let (me, n) = (g.arena().rank(), layout.n);
    if layout.blocks == 0 {
        return Ok(());
    }
    let others = move || (0..n).filter(move |&q| q != me);
    let mut written = write_block(g, layout, acc, 0, others()).await?;
    for b in 0..layout.blocks {
        let s = b % 2;
        g.wait_all(written).await?;
        let mine = layout.piece(me, b);
        let out = layout.in_slot(me, mine.len());
        // SAFETY: every peer published its write of block b, and rewrites the slot only after every
        // rank completed the last phase that reads it (noted with `read_until` below).
        let sources: Vec<&[f32]> =
            (0..n).map(|q| if q == me { &[][..] } else { unsafe { &g.slot(q, s)[out.clone()] } }).collect();
        // SAFETY: piece `me` of our slot is read by peers only in the gather, after we publish.
        let result = if gather_to == Gather::Nobody { None } else { Some(unsafe { &mut g.own_slot(s)[out] }) };
        combine_in_rank_order(&mut acc[mine], me, &sources, result, op, n);
        let reduced = g.publish();
        if b + 1 < layout.blocks {
            written = write_block(g, layout, acc, b + 1, others()).await?;
        }
        let last_read = match gather_to {
            Gather::Nobody => reduced,
            Gather::Everyone | Gather::Root(_) => {
                if gather_to == Gather::Everyone || gather_to == Gather::Root(me) {
                    g.wait_all(reduced).await?;
                    gather(g, layout, acc, b, others(), |q| q);
                }
                g.publish()
            }
        };
        g.read_until(s, last_read);
    }
    Ok(())
}

/// Copies each of `pieces` of block `b` from the slot of the rank `holder(piece)` into `acc`.
fn gather(
    g: &CallGuard<'_>,
    layout: &Layout,
    acc: &mut [f32],
    b: usize,
    pieces: impl Iterator<Item = Rank>,
    holder: impl Fn(Rank) -> Rank,
) {
    let s = b % 2;
    for q in pieces {
        let p = layout.piece(q, b);
        // SAFETY: the caller waited for the holder's phase that wrote the piece; it rewrites that slot
        // only after every rank completed this gather.
        let src = unsafe { &g.slot(holder(q), s)[layout.in_slot(q, p.len())] };
        acc[p].copy_from_slice(src);
    }
}

/// `mine` := op over the n contributions in rank order, where contribution `me` is `mine` itself and
/// the others are `sources[q]`; also copied into `result` when given. An average divides at the end.
fn combine_in_rank_order(
    mine: &mut [f32],
    me: Rank,
    sources: &[&[f32]],
    mut result: Option<&mut [f32]>,
    op: ReduceOp,
    n: usize,
) {
    let mut tmp = [0f32; TILE_ELEMS];
    let inv = 1.0 / n as f32;
    let mut start = 0;
    while start < mine.len() {
        let end = (start + TILE_ELEMS).min(mine.len());
        let t = &mut tmp[..end - start];
        for (q, source) in sources.iter().enumerate().take(n) {
            let src: &[f32] = if q == me { &mine[start..end] } else { &source[start..end] };
            if q == 0 {
                t.copy_from_slice(src);
            } else {
                f32::reduce_block(t, src, op);
            }
        }
        if op == ReduceOp::Avg {
            t.iter_mut().for_each(|v| *v *= inv);
        }
        mine[start..end].copy_from_slice(t);
        if let Some(r) = result.as_deref_mut() {
            r[start..end].copy_from_slice(t);
        }
        start = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_chunk_exactly_once() {
        for (len, n, slot) in [(0, 2, 8), (1, 3, 8), (10, 3, 6), (1000, 4, 64), (17, 8, 8), (5, 2, 1024)] {
            let l = Layout::new(len, n, slot);
            let mut seen = vec![0u8; len];
            for b in 0..l.blocks {
                for q in 0..n {
                    let p = l.piece(q, b);
                    assert!(p.len() <= l.piece && l.in_slot(q, p.len()).end <= slot.max(n), "{len} {n} {slot}");
                    seen[p].iter_mut().for_each(|s| *s += 1);
                }
            }
            assert!(seen.iter().all(|&s| s == 1), "len {len} n {n} slot {slot}: {seen:?}");
        }
    }

    #[test]
    fn what_one_rank_counts_as_sent_the_other_counts_as_received() {
        let ops = [
            ShmOp::AllReduce(ReduceOp::Sum),
            ShmOp::Reduce(ReduceOp::Max, 1),
            ShmOp::Broadcast(2),
            ShmOp::AllGather,
            ShmOp::ReduceScatter(ReduceOp::Avg),
            ShmOp::Barrier,
        ];
        for op in ops {
            for (len, n) in [(10, 3), (7, 4), (1000, 3)] {
                let mut total = 0;
                for me in 0..n {
                    for q in (0..n).filter(|&q| q != me) {
                        assert_eq!(traffic(op, len, n, me, q).0, traffic(op, len, n, q, me).1, "{op:?} {me}->{q}");
                        total += traffic(op, len, n, me, q).1;
                    }
                }
                // Everything a rank lacks, it reads once: an all-reduce moves 2(n-1)/n of the buffer per rank.
                let want = match op {
                    ShmOp::AllReduce(_) => 2 * (n - 1) * len,
                    ShmOp::Broadcast(_) => (n - 1) * len,
                    ShmOp::AllGather | ShmOp::ReduceScatter(_) => (n - 1) * len,
                    ShmOp::Reduce(..) => (n - 1) * len + (len - chunk_range(len, n, 1).len()),
                    ShmOp::Barrier => 0,
                };
                assert_eq!(total, want, "{op:?} len {len} n {n}");
            }
        }
    }

    #[test]
    fn combining_is_in_rank_order_whoever_owns_the_piece() {
        // 1e8 + 1 - 1e8 in f32 depends on the order: (1e8 + 1) - 1e8 = 0, (1e8 - 1e8) + 1 = 1.
        let contributions = [vec![1e8f32], vec![1.0], vec![-1e8]];
        let mut results = Vec::new();
        for me in 0..3 {
            let mut mine = contributions[me].clone();
            let sources: Vec<&[f32]> = contributions.iter().map(|c| &c[..]).collect();
            let mut out = [0f32];
            combine_in_rank_order(&mut mine, me, &sources, Some(&mut out), ReduceOp::Sum, 3);
            assert_eq!(mine, out);
            results.push(mine[0]);
        }
        assert_eq!(results, vec![(1e8f32 + 1.0) - 1e8; 3]);
    }
}

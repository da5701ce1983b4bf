//! The collectives of ranks whose models live on GPUs of their own: each rank's buffers are flattened
//! on its device and reduced or gathered there, never staged through host memory — by NCCL
//! ([`NcclPlane`]) on GPUs. [`FakeNccl`], an in-memory stand-in with NCCL's contract, runs the same
//! engine paths on CPU tensors in CI: every rank of a group makes the same calls in the same order, a
//! call completes when every rank has made it, every rank gets the same bits (sums in rank order), an
//! abort by any rank fails every call in flight and every later one at once, and a call that waits
//! longer than the timeout aborts the group.
//!
//! DDP sums its buckets ([`DevicePlane::all_reduce_sum`]); ZeRO-1/2 reduce-scatter the flat gradient
//! and all-gather the updated masters over the shard layout's balanced pieces
//! ([`reduce_scatter_balanced`], [`all_gather_balanced`]: NCCL's pieces are equal, so each balanced
//! piece is laid out in a padded buffer on the device); ZeRO-3 gathers each unit's parameters from
//! their owners and reduces its gradient to them by grouped broadcasts and reductions of the owners'
//! pieces ([`DevicePlane::broadcast_pieces`], [`DevicePlane::reduce_pieces`]).
//!
//! Which plane an attempt uses is the controller's choice (`crate::plan::plane`); the worker builds
//! the plane for the epoch and hands it to the engine (`DataParallelReplica::with_device_plane`,
//! `ShardedReplica::with_device_plane`).

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::LocalBoxFuture;
use tch::{Device, Kind, Tensor};
use troupe_cluster::collective::{chunk_range, Collective as _, Dtype, ReduceOp};
use troupe_cluster::nccl::NcclCommunicator;
use troupe_cluster::ClusterError;

/// A collective group's operations on device tensors (contiguous f32 on the plane's device).
pub trait DevicePlane {
    /// `nccl` or `fake-nccl` (logs and the step's collective span).
    fn name(&self) -> &'static str;
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sums `flat` over the group's ranks, in place.
    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// NCCL's reduce-scatter: `input` (world × `out.numel()` elements) summed over the ranks, this
    /// rank's piece (the rank-th of equal pieces) into `out`.
    fn reduce_scatter_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// NCCL's all-gather: every rank's `input` (equal lengths) into `out`, rank r's at r ×
    /// `input.numel()`.
    fn all_gather_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// NCCL's broadcasts as one group: for each piece `(range, root)`, rank `root`'s `buf[range]` into
    /// every rank's. Every rank passes the same pieces (ZeRO-3's gather of a unit from its owners).
    fn broadcast_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// NCCL's reductions (sums) as one group: for each piece `(range, root)`, `buf[range]` summed over
    /// the ranks into rank `root`'s; the other ranks' `buf[range]` is left as it was (ZeRO-3's
    /// reduction of a unit's gradient to its owners).
    fn reduce_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>>;
    /// Fails every call in flight and every later call (the attempt is over). Idempotent.
    fn abort(&mut self);
}

/// The length of each equal piece the balanced pieces of `total` elements are padded to.
fn padded_piece(total: usize, world: usize) -> usize {
    total.div_ceil(world).max(1)
}

/// Reduce-scatter over the balanced pieces the host collectives and the shard layout use
/// (`chunk_range`): `flat` summed over the ranks, this rank's piece `chunk_range(total, world, rank)`
/// into `own` (same device, that many elements).
pub async fn reduce_scatter_balanced(
    plane: &mut dyn DevicePlane,
    flat: &Tensor,
    own: &mut Tensor,
) -> Result<(), ClusterError> {
    let (rank, world, total) = (plane.rank(), plane.world(), flat.numel());
    let mine = chunk_range(total, world, rank);
    check_piece(plane, "reduce_scatter", own, mine.len())?;
    let piece = padded_piece(total, world);
    let padded = Tensor::zeros([(world * piece) as i64], (Kind::Float, flat.device()));
    tch::no_grad(|| {
        for r in 0..world {
            let range = chunk_range(total, world, r);
            let len = range.len() as i64;
            padded.narrow(0, (r * piece) as i64, len).copy_(&flat.narrow(0, range.start as i64, len));
        }
    });
    let mut out = Tensor::zeros([piece as i64], (Kind::Float, flat.device()));
    plane.reduce_scatter_equal(&padded, &mut out).await?;
    tch::no_grad(|| own.copy_(&out.narrow(0, 0, mine.len() as i64)));
    Ok(())
}

/// All-gather over balanced pieces: every rank's `own` (its piece `chunk_range(total, world, rank)`)
/// into `flat` (`total` elements, same device).
pub async fn all_gather_balanced(
    plane: &mut dyn DevicePlane,
    own: &Tensor,
    flat: &mut Tensor,
) -> Result<(), ClusterError> {
    let (rank, world, total) = (plane.rank(), plane.world(), flat.numel());
    let mine = chunk_range(total, world, rank);
    check_piece(plane, "all_gather", own, mine.len())?;
    let piece = padded_piece(total, world);
    let input = Tensor::zeros([piece as i64], (Kind::Float, flat.device()));
    tch::no_grad(|| input.narrow(0, 0, mine.len() as i64).copy_(own));
    let mut out = Tensor::zeros([(world * piece) as i64], (Kind::Float, flat.device()));
    plane.all_gather_equal(&input, &mut out).await?;
    tch::no_grad(|| {
        for r in 0..world {
            let range = chunk_range(total, world, r);
            let len = range.len() as i64;
            flat.narrow(0, range.start as i64, len).copy_(&out.narrow(0, (r * piece) as i64, len));
        }
    });
    Ok(())
}

fn check_piece(plane: &dyn DevicePlane, op: &'static str, own: &Tensor, len: usize) -> Result<(), ClusterError> {
    if own.numel() == len {
        return Ok(());
    }
    let (rank, world) = (plane.rank(), plane.world());
    let reason = format!("rank {rank} of {world}'s piece holds {} elements; its balanced piece is {len}", own.numel());
    Err(ClusterError::InvalidArgument { rank, op, reason })
}

/// NCCL on the rank's GPU, for one epoch (`NcclCommunicator`: its unique id exchanged over the epoch's
/// host communicator, its calls polled for NCCL's asynchronous errors and the collective timeout, and
/// aborted — `ncclCommAbort` — on an error, a timeout, or when dropped with the attempt).
pub struct NcclPlane {
    comm: NcclCommunicator,
    ordinal: usize,
}

impl NcclPlane {
    pub fn new(comm: NcclCommunicator) -> Self {
        let ordinal = comm.stream().context().ordinal();
        NcclPlane { comm, ordinal }
    }

    /// Refuses a tensor NCCL cannot be handed: not contiguous f32 on this plane's GPU.
    fn check(&self, op: &'static str, t: &Tensor) -> Result<(), ClusterError> {
        let ordinal = self.ordinal;
        if t.device() == Device::Cuda(ordinal) && t.kind() == Kind::Float && t.is_contiguous() {
            return Ok(());
        }
        let reason = format!(
            "a buffer on {:?} ({:?}, contiguous: {}); NCCL takes contiguous f32 on cuda:{ordinal}",
            t.device(),
            t.kind(),
            t.is_contiguous()
        );
        Err(ClusterError::InvalidArgument { rank: self.comm.rank(), op, reason })
    }

    /// Refuses an `input`/`out` pair whose lengths are not world × each other.
    fn check_pieces(&self, op: &'static str, long: &Tensor, short: &Tensor) -> Result<(), ClusterError> {
        self.check(op, long)?;
        self.check(op, short)?;
        if long.numel() == short.numel() * self.comm.world() {
            return Ok(());
        }
        let reason =
            format!("{} elements are not world ({}) × {} elements", long.numel(), self.comm.world(), short.numel());
        Err(ClusterError::InvalidArgument { rank: self.comm.rank(), op, reason })
    }

    /// [`DevicePlane::broadcast_pieces`] (`reduce` None) or [`DevicePlane::reduce_pieces`].
    async fn rooted(
        &mut self,
        op: &'static str,
        buf: &Tensor,
        pieces: &[(Range<usize>, usize)],
        reduce: Option<ReduceOp>,
    ) -> Result<(), ClusterError> {
        self.check(op, buf)?;
        let pieces: Vec<(usize, usize, usize)> = pieces.iter().map(|(r, root)| (r.start, r.len(), *root)).collect();
        let buffer = (buf.data_ptr() as u64, buf.numel());
        // SAFETY: see the impl's comment below; the communicator checks every piece against the
        // buffer's length.
        unsafe { self.comm.rooted_in_place(buffer, &pieces, Dtype::F32, reduce).await }
    }
}

// SAFETY (every call below): each tensor was checked to be contiguous f32 on the communicator's
// device and is borrowed until the call returns; libtorch computes on the same legacy default stream
// the call is enqueued on, so the memory is neither reused nor freed before the operation ran, even if
// the future is dropped (the communicator is then aborted with the attempt).
impl DevicePlane for NcclPlane {
    fn name(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            self.check("all_reduce", flat)?;
            let (ptr, count) = (flat.data_ptr() as u64, flat.numel());
            // SAFETY: see the impl's comment.
            unsafe { self.comm.all_reduce_in_place(ptr, count, Dtype::F32, ReduceOp::Sum).await }
        })
    }

    fn reduce_scatter_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            self.check_pieces("reduce_scatter", input, out)?;
            let ptrs = (input.data_ptr() as u64, out.data_ptr() as u64);
            // SAFETY: see the impl's comment; `input` and `out` are distinct tensors.
            unsafe { self.comm.reduce_scatter_ptrs(ptrs, out.numel(), Dtype::F32, ReduceOp::Sum).await }
        })
    }

    fn all_gather_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            self.check_pieces("all_gather", out, input)?;
            let ptrs = (input.data_ptr() as u64, out.data_ptr() as u64);
            // SAFETY: see the impl's comment; `input` and `out` are distinct tensors.
            unsafe { self.comm.all_gather_ptrs(ptrs, input.numel(), Dtype::F32).await }
        })
    }

    fn broadcast_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(self.rooted("broadcast", buf, pieces, None))
    }

    fn reduce_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(self.rooted("reduce", buf, pieces, Some(ReduceOp::Sum)))
    }

    fn abort(&mut self) {
        if let Err(e) = self.comm.abort() {
            tracing::warn!(error = %e, "aborting the NCCL communicator failed");
        }
    }
}

/// What a [`FakeNccl`] call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FakeOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Reduce,
}

impl FakeOp {
    fn name(self) -> &'static str {
        match self {
            FakeOp::AllReduce => "all_reduce",
            FakeOp::ReduceScatter => "reduce_scatter",
            FakeOp::AllGather => "all_gather",
            FakeOp::Broadcast => "broadcast",
            FakeOp::Reduce => "reduce",
        }
    }
}

/// What one rank posts to a [`FakeNccl`] call.
struct Posted {
    op: FakeOp,
    /// The pieces of a broadcast or reduction, `(range, root)` (empty for the others).
    pieces: Vec<(Range<usize>, usize)>,
    data: Vec<f32>,
}

/// One call of a [`FakeNccl`] group: each rank's post, then the result every rank copies its output
/// from (the sum, the rank-ordered concatenation for an all-gather, each piece's root's values for a
/// broadcast).
#[derive(Default)]
struct FakeCall {
    parts: BTreeMap<usize, Posted>,
    result: Option<Arc<Result<Vec<f32>, String>>>,
    taken: usize,
}

#[derive(Default)]
struct FakeGroupState {
    /// Calls by sequence number (each rank's n-th call joins call n).
    calls: BTreeMap<u64, FakeCall>,
    aborted: Option<String>,
}

struct FakeGroup {
    world: usize,
    state: Mutex<FakeGroupState>,
    changed: tokio::sync::Notify,
}

impl FakeGroup {
    fn lock(&self) -> std::sync::MutexGuard<'_, FakeGroupState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn abort(&self, why: String) {
        self.lock().aborted.get_or_insert(why);
        self.changed.notify_waiters();
    }
}

/// The result of a call whose every rank posted `parts` (in rank order): refused when the ranks made
/// different calls or gave different lengths or pieces (NCCL would hang or read out of bounds).
fn fake_result(parts: &BTreeMap<usize, Posted>) -> Result<Vec<f32>, String> {
    let first = &parts[&0];
    let op = first.op;
    if let Some((rank, other)) = parts.iter().find(|(_, p)| p.op != op) {
        return Err(format!("rank {rank} called {} where rank 0 called {}", other.op.name(), op.name()));
    }
    if let Some((rank, p)) = parts.iter().find(|(_, p)| p.data.len() != first.data.len()) {
        return Err(format!("rank {rank} gave {} elements where rank 0 gave {}", p.data.len(), first.data.len()));
    }
    if let Some((rank, p)) = parts.iter().find(|(_, p)| p.pieces != first.pieces) {
        return Err(format!("rank {rank} gave pieces {:?} where rank 0 gave {:?}", p.pieces, first.pieces));
    }
    match op {
        FakeOp::AllGather => Ok(parts.values().flat_map(|p| p.data.iter().copied()).collect()),
        FakeOp::Broadcast => {
            let mut out = vec![0f32; first.data.len()];
            for (range, root) in &first.pieces {
                out[range.clone()].copy_from_slice(&parts[root].data[range.clone()]);
            }
            Ok(out)
        }
        FakeOp::AllReduce | FakeOp::ReduceScatter | FakeOp::Reduce => {
            let mut sum = vec![0f32; first.data.len()];
            for part in parts.values() {
                sum.iter_mut().zip(&part.data).for_each(|(s, v)| *s += v);
            }
            Ok(sum)
        }
    }
}

/// One rank of an in-memory NCCL stand-in (module docs): what lets CI run the engines' "every rank has
/// its own device" paths. Dropping a rank aborts its group, as a killed process's peers see NCCL fail.
pub struct FakeNccl {
    rank: usize,
    group: Arc<FakeGroup>,
    calls: u64,
    timeout: Duration,
}

impl FakeNccl {
    /// The ranks of a fresh group of `world` (one epoch's communicator), each call bounded by `timeout`.
    pub fn group(world: usize, timeout: Duration) -> Vec<FakeNccl> {
        let group = Arc::new(FakeGroup { world, state: Mutex::default(), changed: tokio::sync::Notify::new() });
        (0..world).map(|rank| FakeNccl { rank, group: group.clone(), calls: 0, timeout }).collect()
    }

    fn error(&self, op: FakeOp, reason: String) -> ClusterError {
        ClusterError::Nccl(format!("rank {} of {} (fake NCCL): {}: {reason}", self.rank, self.group.world, op.name()))
    }

    /// Posts this rank's part of call `seq`; computes the call's result when it is the last part.
    fn post(&self, seq: u64, part: Posted) {
        let mut state = self.group.lock();
        let world = self.group.world;
        let call = state.calls.entry(seq).or_default();
        call.parts.insert(self.rank, part);
        if call.parts.len() == world {
            call.result = Some(Arc::new(fake_result(&call.parts)));
            call.parts.clear();
            drop(state);
            self.group.changed.notify_waiters();
        }
    }

    /// Waits for call `seq`'s result (or the group's abort, or the timeout, which aborts the group).
    async fn wait_result(&self, seq: u64, op: FakeOp) -> Result<Arc<Result<Vec<f32>, String>>, ClusterError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let notified = self.group.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                // A call every rank made completes on every rank, even if one is gone since.
                let mut state = self.group.lock();
                let world = self.group.world;
                if let Some(call) = state.calls.get_mut(&seq) {
                    if let Some(result) = call.result.clone() {
                        call.taken += 1;
                        if call.taken == world {
                            state.calls.remove(&seq);
                        }
                        return Ok(result);
                    }
                }
                if let Some(why) = &state.aborted {
                    return Err(self.error(op, format!("the communicator was aborted ({why})")));
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let why = format!("rank {} waited {} ms for its peers", self.rank, self.timeout.as_millis());
                self.group.abort(why.clone());
                let ms = self.timeout.as_millis();
                return Err(self.error(op, format!("not complete after {ms} ms; communicator aborted")));
            }
        }
    }

    /// One call: this rank's `input` in, the whole result out (every rank's the same).
    async fn call(&mut self, op: FakeOp, input: &Tensor) -> Result<Tensor, ClusterError> {
        self.call_pieces(op, input, Vec::new()).await
    }

    /// [`Self::call`] of a broadcast or reduction of `pieces`.
    async fn call_pieces(
        &mut self,
        op: FakeOp,
        input: &Tensor,
        pieces: Vec<(Range<usize>, usize)>,
    ) -> Result<Tensor, ClusterError> {
        if let Some(why) = &self.group.lock().aborted {
            return Err(self.error(op, format!("the communicator was aborted ({why})")));
        }
        let n = input.numel();
        if let Some((range, root)) = pieces.iter().find(|(r, root)| r.end > n || *root >= self.group.world) {
            let world = self.group.world;
            let reason =
                format!("piece {range:?} from root {root}: the buffer holds {n} elements, the world is {world}");
            return Err(self.error(op, reason));
        }
        let seq = self.calls;
        self.calls += 1;
        let mut data = vec![0f32; n];
        input.to_kind(Kind::Float).copy_data(&mut data, n);
        self.post(seq, Posted { op, pieces, data });
        let result = self.wait_result(seq, op).await?;
        let result = result.as_ref().as_ref().map_err(|e| self.error(op, e.clone()))?;
        Ok(Tensor::from_slice(result).to_device(input.device()))
    }
}

impl DevicePlane for FakeNccl {
    fn name(&self) -> &'static str {
        "fake-nccl"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.group.world
    }

    fn all_reduce_sum<'a>(&'a mut self, flat: &'a mut Tensor) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let summed = self.call(FakeOp::AllReduce, flat).await?;
            tch::no_grad(|| flat.copy_(&summed.view_as(flat)));
            Ok(())
        })
    }

    fn reduce_scatter_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let piece = out.numel() as i64;
            if input.numel() as i64 != piece * self.group.world as i64 {
                let reason = format!("{} elements are not world × {piece}", input.numel());
                return Err(self.error(FakeOp::ReduceScatter, reason));
            }
            let summed = self.call(FakeOp::ReduceScatter, input).await?;
            tch::no_grad(|| out.copy_(&summed.narrow(0, self.rank as i64 * piece, piece).view_as(out)));
            Ok(())
        })
    }

    fn all_gather_equal<'a>(
        &'a mut self,
        input: &'a Tensor,
        out: &'a mut Tensor,
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            if out.numel() != input.numel() * self.group.world {
                let reason = format!("{} elements are not world × {}", out.numel(), input.numel());
                return Err(self.error(FakeOp::AllGather, reason));
            }
            let gathered = self.call(FakeOp::AllGather, input).await?;
            tch::no_grad(|| out.copy_(&gathered.view_as(out)));
            Ok(())
        })
    }

    fn broadcast_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let result = self.call_pieces(FakeOp::Broadcast, buf, pieces.to_vec()).await?;
            copy_pieces(buf, &result, pieces.iter().map(|(r, _)| r));
            Ok(())
        })
    }

    fn reduce_pieces<'a>(
        &'a mut self,
        buf: &'a mut Tensor,
        pieces: &'a [(Range<usize>, usize)],
    ) -> LocalBoxFuture<'a, Result<(), ClusterError>> {
        Box::pin(async move {
            let summed = self.call_pieces(FakeOp::Reduce, buf, pieces.to_vec()).await?;
            let rank = self.rank;
            copy_pieces(buf, &summed, pieces.iter().filter(|(_, root)| *root == rank).map(|(r, _)| r));
            Ok(())
        })
    }

    fn abort(&mut self) {
        self.group.abort(format!("rank {} aborted", self.rank));
    }
}

/// `from`'s elements of each of `ranges` into `buf` (both flat, same length).
fn copy_pieces<'r>(buf: &Tensor, from: &Tensor, ranges: impl Iterator<Item = &'r Range<usize>>) {
    tch::no_grad(|| {
        for range in ranges {
            let (start, len) = (range.start as i64, range.len() as i64);
            buf.narrow(0, start, len).copy_(&from.narrow(0, start, len));
        }
    });
}

impl Drop for FakeNccl {
    fn drop(&mut self) {
        self.group.abort(format!("rank {} is gone", self.rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_ranks<F, R>(ranks: Vec<FakeNccl>, body: F) -> Vec<R>
    where
        F: Fn(usize, FakeNccl) -> LocalBoxFuture<'static, R> + Send + Sync + Clone + 'static,
        R: Send + 'static,
    {
        let handles: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(rank, plane)| {
                let body = body.clone();
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                    rt.block_on(body(rank, plane))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_same_sum_call_after_call() {
        let got = run_ranks(FakeNccl::group(3, Duration::from_secs(10)), |rank, mut plane| {
            Box::pin(async move {
                let mut sums = Vec::new();
                for call in 0..4 {
                    let mut t = Tensor::from_slice(&[rank as f32, 1.0, call as f32 * 0.5]);
                    plane.all_reduce_sum(&mut t).await.unwrap();
                    sums.push(Vec::<f32>::try_from(&t).unwrap());
                }
                sums
            })
        });
        for sums in &got {
            for (call, sum) in sums.iter().enumerate() {
                assert_eq!(sum, &vec![3.0, 3.0, 1.5 * call as f32], "call {call}");
            }
        }
    }

    #[test]
    fn a_rank_that_is_gone_fails_its_peers_at_once_not_after_the_timeout() {
        let started = std::time::Instant::now();
        let got = run_ranks(FakeNccl::group(2, Duration::from_secs(60)), |rank, mut plane| {
            Box::pin(async move {
                if rank == 1 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    drop(plane); // a killed rank: its communicator is gone
                    return Ok(());
                }
                let mut t = Tensor::from_slice(&[1f32]);
                plane.all_reduce_sum(&mut t).await
            })
        });
        let err = got[0].as_ref().unwrap_err().to_string();
        assert!(err.contains("aborted") && err.contains("rank 1 is gone"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "failed promptly, not after the 60 s timeout");
    }

    #[test]
    fn a_silent_peer_times_the_call_out_and_aborts_the_group_for_later_calls() {
        let mut ranks = FakeNccl::group(2, Duration::from_millis(100));
        let silent = ranks.pop().unwrap();
        let mut plane = ranks.pop().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mut t = Tensor::from_slice(&[1f32]);
        let err = rt.block_on(plane.all_reduce_sum(&mut t)).unwrap_err().to_string();
        assert!(err.contains("not complete after 100 ms"), "{err}");
        let mut u = Tensor::from_slice(&[1f32]);
        let err = rt.block_on(plane.all_reduce_sum(&mut u)).unwrap_err().to_string();
        assert!(err.contains("aborted"), "every later call fails: {err}");
        drop(silent);
        // The next epoch builds a fresh group: it works.
        let mut fresh = FakeNccl::group(1, Duration::from_millis(100));
        let mut v = Tensor::from_slice(&[2f32]);
        rt.block_on(fresh[0].all_reduce_sum(&mut v)).unwrap();
        assert_eq!(Vec::<f32>::try_from(&v).unwrap(), vec![2.0]);
    }

    /// Balanced pieces of a length the world does not divide (7 over 3: 3, 2, 2) go through the equal
    /// padded pieces and come back where the host collectives put them.
    #[test]
    fn reduce_scatter_and_all_gather_follow_the_balanced_pieces() {
        for world in [1, 2, 3, 4] {
            let got = run_ranks(FakeNccl::group(world, Duration::from_secs(10)), move |rank, mut plane| {
                Box::pin(async move {
                    let total = 7;
                    let flat = Tensor::from_slice(&(0..total).map(|i| (i * 10 + rank) as f32).collect::<Vec<_>>());
                    let mine = chunk_range(total, world, rank);
                    let mut own = Tensor::zeros([mine.len() as i64], (Kind::Float, Device::Cpu));
                    reduce_scatter_balanced(&mut plane, &flat, &mut own).await.unwrap();
                    let mut whole = Tensor::zeros([total as i64], (Kind::Float, Device::Cpu));
                    all_gather_balanced(&mut plane, &own, &mut whole).await.unwrap();
                    (mine, Vec::<f32>::try_from(&own).unwrap(), Vec::<f32>::try_from(&whole).unwrap())
                })
            });
            // Σ over ranks of (i·10 + rank) = world·i·10 + world(world−1)/2.
            let expected: Vec<f32> = (0..7).map(|i| (world * i * 10 + world * (world - 1) / 2) as f32).collect();
            for (rank, (mine, own, whole)) in got.iter().enumerate() {
                assert_eq!(own[..], expected[mine.clone()], "world {world}: rank {rank}'s piece");
                assert_eq!(whole, &expected, "world {world}: rank {rank}'s gathered whole");
            }
        }
    }

    /// ZeRO-3's pieces: each range from (or onto) its root, the ranges of one call meeting different
    /// roots. A broadcast gives every rank each root's values; a reduction gives each root the sum of
    /// its ranges and leaves every other rank's buffer as it was.
    #[test]
    fn grouped_broadcasts_and_reductions_follow_each_pieces_root() {
        let pieces = vec![(0..3, 2), (3..4, 0), (4..7, 1)];
        let got = run_ranks(FakeNccl::group(3, Duration::from_secs(10)), move |rank, mut plane| {
            let pieces = pieces.clone();
            Box::pin(async move {
                let mine = |base: usize| Tensor::from_slice(&(0..7).map(|i| (base + i) as f32).collect::<Vec<_>>());
                let mut sent = mine(rank * 100);
                plane.broadcast_pieces(&mut sent, &pieces).await.unwrap();
                let mut summed = mine(rank * 100);
                plane.reduce_pieces(&mut summed, &pieces).await.unwrap();
                (Vec::<f32>::try_from(&sent).unwrap(), Vec::<f32>::try_from(&summed).unwrap())
            })
        });
        let broadcast = [200.0, 201.0, 202.0, 3.0, 104.0, 105.0, 106.0];
        for (rank, (sent, summed)) in got.iter().enumerate() {
            assert_eq!(sent, &broadcast, "rank {rank}: each range is its root's");
            for (i, v) in summed.iter().enumerate() {
                let root = if i < 3 {
                    2
                } else if i < 4 {
                    0
                } else {
                    1
                };
                // Σ over ranks r of (100 r + i) = 300 + 3 i at the root; the rank's own values elsewhere.
                let want = if rank == root { 300 + 3 * i } else { rank * 100 + i };
                assert_eq!(*v, want as f32, "rank {rank}, element {i} (root {root})");
            }
        }
    }

    #[test]
    fn ranks_that_give_different_pieces_or_a_piece_outside_the_buffer_are_refused() {
        let got = run_ranks(FakeNccl::group(2, Duration::from_secs(10)), |rank, mut plane| {
            Box::pin(async move {
                let mut t = Tensor::from_slice(&[1f32, 2.0, 3.0]);
                let outside = plane.broadcast_pieces(&mut t, &[(2..4, 0)]).await.unwrap_err().to_string();
                let pieces = if rank == 0 { vec![(0..2, 0), (2..3, 1)] } else { vec![(0..1, 0), (1..3, 1)] };
                let differ = plane.reduce_pieces(&mut t, &pieces).await.unwrap_err().to_string();
                (outside, differ, Vec::<f32>::try_from(&t).unwrap())
            })
        });
        for (outside, differ, t) in &got {
            assert!(outside.contains("piece 2..4 from root 0: the buffer holds 3 elements"), "{outside}");
            assert!(differ.contains("rank 1 gave pieces [(0..1, 0), (1..3, 1)] where rank 0 gave"), "{differ}");
            assert_eq!(t, &vec![1.0, 2.0, 3.0], "nothing written");
        }
    }

    #[test]
    fn ranks_that_make_different_calls_are_refused_not_mixed() {
        let got = run_ranks(FakeNccl::group(2, Duration::from_secs(10)), |rank, mut plane| {
            Box::pin(async move {
                let mut t = Tensor::from_slice(&[1f32, 2.0]);
                if rank == 0 {
                    plane.all_reduce_sum(&mut t).await.map_err(|e| e.to_string())
                } else {
                    let mut out = Tensor::zeros([1], (Kind::Float, Device::Cpu));
                    plane.reduce_scatter_equal(&t, &mut out).await.map_err(|e| e.to_string())
                }
            })
        });
        for r in &got {
            let err = r.as_ref().unwrap_err();
            assert!(err.contains("rank 1 called reduce_scatter where rank 0 called all_reduce"), "{err}");
        }
    }

    #[test]
    fn a_piece_of_the_wrong_length_is_refused_before_anything_is_sent() {
        let mut ranks = FakeNccl::group(2, Duration::from_millis(100));
        let mut plane = ranks.remove(0);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let flat = Tensor::from_slice(&[1f32, 2.0, 3.0]);
        let mut own = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let err = rt.block_on(reduce_scatter_balanced(&mut plane, &flat, &mut own)).unwrap_err().to_string();
        assert!(err.contains("holds 1 elements; its balanced piece is 2"), "{err}");
        assert_eq!(plane.calls, 0, "nothing was posted");
    }
}

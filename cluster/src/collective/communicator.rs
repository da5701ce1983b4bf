//! The collective API over a transport. Every call is stamped with (group, epoch, sequence number):
//! ranks issue collectives in the same order, so the n-th call of an epoch has the same tag
//! everywhere, and a message of another call or a stale epoch can never be mistaken for this one's.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use troupe_kernels::reduce::{finish_avg, ReduceOp};

use super::exec::{execute, ExecContext};
use super::hosts::HostLayout;
use super::plan::{self, Plan};
use super::send_buffers::SendBuffers;
use super::shm::{self as shm_exec, ShmOp};
use super::{chunk_range, Dtype, Element};
use crate::error::Rank;
use crate::transport::same_host::SameHostTransport;
use crate::transport::shm::ArenaClaim;
use crate::transport::subgroup::Subgroup;
use crate::transport::{LossScope, Transport};
use crate::wire::Tag;
use crate::{ClusterError, TransportConfig};

/// The collective operations, whatever moves the bytes (a transport here, NCCL for CUDA buffers).
pub trait Collective {
    type Buffer<E: Element>: ?Sized;
    fn rank(&self) -> Rank;
    fn world(&self) -> usize;
    fn all_reduce<E: Element>(
        &mut self,
        buf: &mut Self::Buffer<E>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), ClusterError>>;
    fn broadcast<E: Element>(
        &mut self,
        buf: &mut Self::Buffer<E>,
        root: Rank,
    ) -> impl Future<Output = Result<(), ClusterError>>;
    /// Every rank ends with all ranks' `input` pieces concatenated in rank order in `output`.
    /// The transport communicator cuts `output` with `chunk_range` (pieces may differ by one element);
    /// NCCL needs equal pieces (`output` = world × `input`): the two agree whenever the length divides.
    fn all_gather<E: Element>(
        &mut self,
        input: &Self::Buffer<E>,
        output: &mut Self::Buffer<E>,
    ) -> impl Future<Output = Result<(), ClusterError>>;
    /// `op` over all ranks' `input`; this rank keeps its piece (cut as for `all_gather`) in `output`.
    fn reduce_scatter<E: Element>(
        &mut self,
        input: &Self::Buffer<E>,
        output: &mut Self::Buffer<E>,
        op: ReduceOp,
    ) -> impl Future<Output = Result<(), ClusterError>>;
    fn barrier(&mut self) -> impl Future<Output = Result<(), ClusterError>>;
}

/// Algorithm choices and the wait bound. Every rank of a group must use the same values (they decide
/// how many messages a call exchanges).
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveConfig {
    pub small_message_bytes_max: usize,
    pub pipeline_slice_bytes: usize,
    pub collective_timeout_ms: u64,
}

impl From<&TransportConfig> for CollectiveConfig {
    fn from(c: &TransportConfig) -> Self {
        CollectiveConfig {
            small_message_bytes_max: c.small_message_bytes_max,
            pipeline_slice_bytes: c.pipeline_slice_bytes,
            collective_timeout_ms: c.collective_timeout_ms,
        }
    }
}

/// Tag step used by point-to-point messages (collective steps count up from 0).
const P2P_STEP: u32 = u32::MAX;

/// What a communicator's calls of one kind did since the last [`Communicator::take_calls`].
#[derive(Clone, Debug, PartialEq)]
pub struct CallTally {
    /// `all_reduce`, `broadcast`, `reduce`, `all_gather`, `reduce_scatter`, `barrier`, `send` or `recv`.
    pub op: &'static str,
    pub calls: u64,
    /// Payload bytes the calls handed the transport ([`Transport::sent_bytes`]; 0 when it does not
    /// count them, and for a receive).
    pub bytes: u64,
    /// Their duration, waits included.
    pub seconds: f64,
}

/// When a call began: the time and the transport's byte count.
type CallMark = (Instant, Option<u64>);

pub struct Communicator<T: Transport> {
    transport: Arc<T>,
    group: u32,
    epoch: u64,
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    config: CollectiveConfig,
    /// The transport's shared-memory arena, when it has one and no other communicator holds it: the
    /// collectives of this communicator's first epoch run there (point-to-point stays on messages).
    arena: Option<ArenaClaim>,
    /// Buffers of outgoing messages, reused once the transport lets go of them.
    send_buffers: SendBuffers,
    /// Two-tier all-reduce ([`Self::with_host_tier`]): within hosts in their arenas, across hosts
    /// over this communicator's transport.
    hosts: Option<HostTier>,
    /// The calls since the last [`Self::take_calls`], by op.
    calls: Vec<CallTally>,
}

/// This rank's part in two-tier collectives.
struct HostTier {
    layout: HostLayout,
    /// The same-host transport of the ranks on this rank's host (kept for its failure detection) and
    /// this communicator's use of its arena; `None` when the rank is alone on its host.
    local: Option<(Arc<SameHostTransport>, ArenaClaim)>,
}

fn to_f32<E: Element>(data: &[E]) -> Vec<f32> {
    let mut wide = vec![0f32; data.len()];
    E::widen(data, &mut wide);
    wide
}

fn write_back<E: Element>(acc: &[f32], out: &mut [E]) {
    E::narrow(acc, out);
}

impl<T: Transport> Communicator<T> {
    pub fn new(transport: Arc<T>, group: u32, epoch: u64, config: CollectiveConfig) -> Self {
        let n = transport.world();
        transport.fence(epoch);
        let arena =
            transport.arena().filter(|a| a.world() == n && a.rank() == transport.rank()).and_then(|a| a.claim());
        Communicator {
            transport,
            group,
            epoch,
            seq: 0,
            p2p_sent: vec![0; n],
            p2p_received: vec![0; n],
            config,
            arena,
            send_buffers: SendBuffers::default(),
            hosts: None,
            calls: Vec::new(),
        }
    }

    /// The calls since the last time (or since the communicator was made), one line per op in the order
    /// first called, and starts again from none: how a step's collectives are metered.
    pub fn take_calls(&mut self) -> Vec<CallTally> {
        std::mem::take(&mut self.calls)
    }

    fn mark(&self) -> CallMark {
        (Instant::now(), self.transport.sent_bytes())
    }

    /// Notes a call of `op` begun at `mark`; passes its result on.
    fn note<R>(&mut self, op: &'static str, (at, before): CallMark, result: R) -> R {
        let bytes = match (before, self.transport.sent_bytes()) {
            (Some(before), Some(now)) => now.saturating_sub(before),
            _ => 0,
        };
        let seconds = at.elapsed().as_secs_f64();
        match self.calls.iter_mut().find(|c| c.op == op) {
            Some(c) => {
                c.calls += 1;
                c.bytes += bytes;
                c.seconds += seconds;
            }
            None => self.calls.push(CallTally { op, calls: 1, bytes, seconds }),
        }
        result
    }

    /// Whether collectives run in the transport's shared-memory arena.
    pub fn uses_shared_memory(&self) -> bool {
        self.arena.is_some()
    }

    /// Runs `op` in the arena if this communicator holds one (`None` otherwise), tagged like a message
    /// call so a mismatch between ranks names the call.
    async fn in_arena(&mut self, op: ShmOp, acc: &mut [f32]) -> Option<Result<(), ClusterError>> {
        let tag = Tag { group: self.group, epoch: self.epoch, seq: self.seq, step: 0 };
        let timeout_ms = self.config.collective_timeout_ms;
        let claim = self.arena.as_mut()?;
        self.seq += 1;
        let result = shm_exec::run(claim, op, acc, tag, timeout_ms).await;
        if result.is_ok() {
            let (me, n) = (self.transport.rank(), self.transport.world());
            for q in (0..n).filter(|&q| q != me) {
                let (sent, received) = shm_exec::traffic(op, acc.len(), n, me, q);
                self.transport.arena_traffic(q, sent as u64 * 4, received as u64 * 4);
            }
        }
        Some(result)
    }

    pub fn transport(&self) -> &Arc<T> {
        &self.transport
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The algorithm choices and wait bound every rank of the group shares.
    pub fn config(&self) -> &CollectiveConfig {
        &self.config
    }

    /// Moves to a new epoch: sequence numbers restart and every message of an older epoch — buffered
    /// or still in flight — is dropped. The shared-memory arena, if any, is given up: the ranks' phase
    /// counters may disagree after an aborted call, so later collectives use messages (the runtime
    /// connects a new transport, with a new arena, for each epoch instead).
    pub fn set_epoch(&mut self, epoch: u64) {
        assert!(epoch > self.epoch, "epochs only grow ({} -> {epoch})", self.epoch);
        self.arena = None;
        self.hosts = None;
        self.epoch = epoch;
        self.seq = 0;
        self.p2p_sent.iter_mut().for_each(|c| *c = 0);
        self.p2p_received.iter_mut().for_each(|c| *c = 0);
        self.transport.fence(epoch);
    }

    fn next_tag(&mut self) -> Tag {
        let tag = Tag { group: self.group, epoch: self.epoch, seq: self.seq, step: 0 };
        self.seq += 1;
        tag
    }

    fn ctx(&self, tag: Tag, op: ReduceOp, op_name: &'static str) -> ExecContext {
        ExecContext {
            op,
            contributions: self.transport.world(),
            tag,
            timeout_ms: self.config.collective_timeout_ms,
            op_name,
        }
    }

    fn slice_elems<E: Element>(&self) -> usize {
        (self.config.pipeline_slice_bytes / E::BYTES).max(1)
    }

    async fn all_reduce_f32<E: Element>(&mut self, acc: &mut [f32], op: ReduceOp) -> Result<(), ClusterError> {
        if self.hosts.is_some() {
            return self.tiered_all_reduce::<E>(acc, op).await;
        }
        if let Some(done) = self.in_arena(ShmOp::AllReduce(op), acc).await {
            return done;
        }
        let tag = self.next_tag();
        let ctx = self.ctx(tag, op, "all_reduce");
        all_reduce_over::<T, E>(&*self.transport, &self.send_buffers, &self.config, acc, ctx).await
    }

    /// Makes all-reduce run in two tiers: within each host in the shared-memory arena of `local` (the
    /// same-host transport of the ranks on this rank's host, numbered as in `layout.members`), across
    /// hosts over this communicator's transport. Every rank of the group calls it with the same
    /// layout (one entry per rank, e.g. from each rank's data-plane IP address) as its first collective
    /// of the epoch: it runs one flat all-reduce so that every rank agrees.
    ///
    /// When every host has the same number of ranks k, a call reduce-scatters within each host, each
    /// rank all-reduces its chunk with the ranks of the same local index on the other hosts (k
    /// cross-host groups at once, each carrying 1/k of the buffer), then all-gathers within the host;
    /// otherwise each host's leader (its lowest rank) carries the host's whole reduction. Every rank
    /// ends bit-identical, as with the flat ring. Other collectives stay flat.
    ///
    /// Returns whether the tiers are in use. They are not when `layout` has one host or one rank per
    /// host, or when some rank could not use its host's arena — then every rank stays flat and that
    /// rank logs why.
    pub async fn with_host_tier(
        &mut self,
        layout: HostLayout,
        local: Option<Arc<SameHostTransport>>,
    ) -> Result<bool, ClusterError> {
        let (me, n) = (self.transport.rank(), self.transport.world());
        if layout.world() != n {
            return Err(ClusterError::InvalidArgument {
                rank: me,
                op: "with_host_tier",
                reason: format!("a host layout of {} ranks for a group of {n}", layout.world()),
            });
        }
        if !layout.is_tiered() {
            return Ok(false);
        }
        let (local_me, local_n) = (layout.local_rank(me), layout.members(me).len());
        let local = match local {
            _ if local_n == 1 => None,
            None => {
                tracing::warn!(rank = me, "two-tier collectives: no same-host transport among the ranks of this host");
                None
            }
            Some(t) => match t.arena().filter(|a| a.world() == local_n && a.rank() == local_me).and_then(|a| a.claim())
            {
                Some(claim) => Some((t, claim)),
                None => {
                    tracing::warn!(
                        rank = me,
                        "two-tier collectives: no shared-memory arena among the ranks of this host"
                    );
                    None
                }
            },
        };
        let mut usable = [if local_n == 1 || local.is_some() { 1f32 } else { 0f32 }];
        self.all_reduce(&mut usable[..], ReduceOp::Min).await?;
        if usable[0] < 1.0 {
            tracing::warn!(
                rank = me,
                "two-tier collectives off: a rank could not use its host's arena; all-reduce stays flat"
            );
            return Ok(false);
        }
        self.hosts = Some(HostTier { layout, local });
        Ok(true)
    }

    /// Whether all-reduce runs in two tiers ([`Self::with_host_tier`]).
    pub fn uses_host_tier(&self) -> bool {
        self.hosts.is_some()
    }

    /// Two-tier all-reduce, pipelined over slices of `acc`: slice s crosses hosts while the arena
    /// reduces slice s + 1 within the host and gathers slice s − 1. The arena calls come in the same
    /// order on every rank of a host (before(0), then before(s + 1) and after(s − 1) for each s, then
    /// the last after); each slice's crossing is one plan whose tag steps start at s · 2^16.
    async fn tiered_all_reduce<E: Element>(&mut self, acc: &mut [f32], op: ReduceOp) -> Result<(), ClusterError> {
        let tag = self.next_tag();
        let (me, n) = (self.transport.rank(), self.transport.world());
        let timeout_ms = self.config.collective_timeout_ms;
        // An average sums in both tiers and divides once, by the whole group, at the end.
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let tier = self.hosts.as_mut().expect("tiered_all_reduce without tiers");
        let local_me = tier.layout.local_rank(me);
        let members = tier.layout.members(me).to_vec();
        // Who carries which part of each slice across hosts, and the arena calls around that.
        let (across, carriers, before, after) = match tier.layout.uniform_ranks_per_host() {
            Some(k) => (tier.layout.column(local_me), k, ShmOp::ReduceScatter(inner), ShmOp::AllGather),
            None => {
                let leaders = if local_me == 0 { tier.layout.leaders() } else { Vec::new() };
                (leaders, 1, ShmOp::Reduce(inner, 0), ShmOp::Broadcast(0))
            }
        };
        let crossing = CrossHostPart {
            group: if across.len() > 1 { Some(Subgroup::new(self.transport.clone(), across)?) } else { None },
            carriers,
            carrier: local_me,
            buffers: &self.send_buffers,
            config: &self.config,
            ctx: ExecContext { op: inner, contributions: n, tag, timeout_ms, op_name: "all_reduce" },
        };
        let mut claim = tier.local.as_mut().map(|(_, c)| c);
        let within =
            |op: ShmOp, step: u32| SameHostCall { op, tag: Tag { step, ..tag }, timeout_ms, members: &members };
        // Each carrier's part of a slice is about `pipeline_slice_bytes`, so a crossing is one plan.
        let slice_elems = (self.config.pipeline_slice_bytes / E::BYTES).max(1) * carriers;
        let count = acc.len().div_ceil(slice_elems).max(1);
        let mut slices = acc.chunks_mut(slice_elems);
        let result = async {
            let first = slices.next().unwrap_or_default();
            let mut ready = Some(within(before, 0).run(claim.as_deref_mut(), first).await?);
            let mut crossed: Option<&mut [f32]> = None;
            for s in 0..count {
                let x = ready.take().expect("slice s was reduced within the host");
                let (next, prev) = (slices.next(), crossed.take());
                let claim = claim.as_deref_mut();
                let arena_turn = async move {
                    let mut claim = claim;
                    let next = match next {
                        Some(next) => Some(within(before, 2 * s as u32 + 2).run(claim.as_deref_mut(), next).await?),
                        None => None,
                    };
                    if let Some(prev) = prev {
                        within(after, 2 * s as u32 - 1).run(claim, prev).await?;
                    }
                    Ok(next)
                };
                let (done, next) = futures::future::try_join(crossing.run::<E>(s, x), arena_turn).await?;
                crossed = Some(done);
                ready = next;
            }
            if let Some(last) = crossed {
                within(after, 2 * count as u32 - 1).run(claim.as_deref_mut(), last).await?;
            }
            Ok::<_, ClusterError>(())
        }
        .await;
        if let Err(e) = result {
            // The host's other ranks may wait for this one in the arena: fail them now, not at the timeout.
            if let Some(claim) = claim {
                claim.abandon();
            }
            return Err(e);
        }
        if tier.local.is_some() {
            for (q, &peer) in members.iter().enumerate().filter(|&(q, _)| q != local_me) {
                let moved = |op| shm_exec::traffic(op, acc.len(), members.len(), local_me, q);
                let ((sent_a, received_a), (sent_b, received_b)) = (moved(before), moved(after));
                self.transport.arena_traffic(peer, (sent_a + sent_b) as u64 * 4, (received_a + received_b) as u64 * 4);
            }
        }
        if op == ReduceOp::Avg {
            finish_avg(acc, n);
        }
        Ok(())
    }

    /// Runs `body` on an f32 view of `data`: in place for f32, through a converted copy otherwise.
    async fn with_acc<E: Element>(
        &mut self,
        data: &mut [E],
        op: ReduceOp,
        kind: CollectiveKind,
    ) -> Result<(), ClusterError> {
        if E::DTYPE == Dtype::F32 {
            let acc: &mut [f32] = bytemuck::cast_slice_mut(data);
            return self.dispatch::<E>(acc, op, kind).await;
        }
        let mut acc = to_f32(data);
        self.dispatch::<E>(&mut acc, op, kind).await?;
        write_back(&acc, data);
        Ok(())
    }

    async fn dispatch<E: Element>(
        &mut self,
        acc: &mut [f32],
        op: ReduceOp,
        kind: CollectiveKind,
    ) -> Result<(), ClusterError> {
        let (rank, n) = (self.transport.rank(), self.transport.world());
        let per = self.slice_elems::<E>();
        match kind {
            CollectiveKind::AllReduce => self.all_reduce_f32::<E>(acc, op).await,
            CollectiveKind::Broadcast(root) => {
                if let Some(done) = self.in_arena(ShmOp::Broadcast(root), acc).await {
                    return done;
                }
                let tag = self.next_tag();
                let ctx = self.ctx(tag, op, "broadcast");
                run_sliced::<T, E>(&*self.transport, &self.send_buffers, acc, ctx, per, |len| {
                    plan::plan_tree_broadcast(rank, n, len, root)
                })
                .await
            }
            CollectiveKind::Reduce(root) => {
                if let Some(done) = self.in_arena(ShmOp::Reduce(op, root), acc).await {
                    return done;
                }
                let tag = self.next_tag();
                let ctx = self.ctx(tag, op, "reduce");
                run_sliced::<T, E>(&*self.transport, &self.send_buffers, acc, ctx, per, |len| {
                    plan::plan_tree_reduce(rank, n, len, root)
                })
                .await
            }
        }
    }

    fn check_root(&self, root: Rank, op: &'static str) -> Result<(), ClusterError> {
        if root >= self.transport.world() {
            return Err(ClusterError::InvalidArgument {
                rank: self.transport.rank(),
                op,
                reason: format!("root {root} outside world of {}", self.transport.world()),
            });
        }
        Ok(())
    }

    /// Every rank ends with `op` over all ranks' `data`.
    pub async fn all_reduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.with_acc(data, op, CollectiveKind::AllReduce).await;
        self.note("all_reduce", mark, result)
    }

    /// Every rank ends with `root`'s `data`.
    pub async fn broadcast<E: Element>(&mut self, data: &mut [E], root: Rank) -> Result<(), ClusterError> {
        self.check_root(root, "broadcast")?;
        let mark = self.mark();
        let result = self.with_acc(data, ReduceOp::Sum, CollectiveKind::Broadcast(root)).await;
        self.note("broadcast", mark, result)
    }

    /// `root` ends with `op` over all ranks' `data`; other ranks' buffers hold partial results.
    pub async fn reduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp, root: Rank) -> Result<(), ClusterError> {
        self.check_root(root, "reduce")?;
        let mark = self.mark();
        let result = self.with_acc(data, op, CollectiveKind::Reduce(root)).await;
        self.note("reduce", mark, result)
    }

    /// `input` is this rank's chunk `chunk_range(output.len(), world, rank)`; every rank ends with the
    /// concatenation of all chunks in `output`.
    pub async fn all_gather<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.gather_all(input, output).await;
        self.note("all_gather", mark, result)
    }

    async fn gather_all<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), ClusterError> {
        let (rank, n) = (self.transport.rank(), self.transport.world());
        let own = chunk_range(output.len(), n, rank);
        if input.len() != own.len() {
            return Err(ClusterError::InvalidArgument {
                rank,
                op: "all_gather",
                reason: format!(
                    "input has {} elements, chunk {rank} of {} has {}",
                    input.len(),
                    output.len(),
                    own.len()
                ),
            });
        }
        let mut acc = vec![0f32; output.len()];
        E::widen(input, &mut acc[own]);
        if let Some(done) = self.in_arena(ShmOp::AllGather, &mut acc).await {
            done?;
            write_back(&acc, output);
            return Ok(());
        }
        let tag = self.next_tag();
        let ctx = self.ctx(tag, ReduceOp::Sum, "all_gather");
        execute::<T, E>(
            &self.transport,
            &self.send_buffers,
            &plan::plan_ring_all_gather(rank, n, output.len()),
            &mut acc,
            ctx,
        )
        .await?;
        write_back(&acc, output);
        Ok(())
    }

    /// Reduces `input` over all ranks; this rank gets chunk `chunk_range(input.len(), world, rank)` of
    /// the result in `output`.
    pub async fn reduce_scatter<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.scatter_reduced(input, output, op).await;
        self.note("reduce_scatter", mark, result)
    }

    async fn scatter_reduced<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        let (rank, n) = (self.transport.rank(), self.transport.world());
        let own = chunk_range(input.len(), n, rank);
        if output.len() != own.len() {
            return Err(ClusterError::InvalidArgument {
                rank,
                op: "reduce_scatter",
                reason: format!(
                    "output has {} elements, chunk {rank} of {} has {}",
                    output.len(),
                    input.len(),
                    own.len()
                ),
            });
        }
        let mut acc = to_f32(input);
        if let Some(done) = self.in_arena(ShmOp::ReduceScatter(op), &mut acc).await {
            done?;
            write_back(&acc[own], output);
            return Ok(());
        }
        let tag = self.next_tag();
        let ctx = self.ctx(tag, op, "reduce_scatter");
        execute::<T, E>(
            &self.transport,
            &self.send_buffers,
            &plan::plan_ring_reduce_scatter(rank, n, input.len()),
            &mut acc,
            ctx,
        )
        .await?;
        write_back(&acc[own], output);
        Ok(())
    }

    /// Returns once every rank has entered the barrier.
    pub async fn barrier(&mut self) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.enter_barrier().await;
        self.note("barrier", mark, result)
    }

    async fn enter_barrier(&mut self) -> Result<(), ClusterError> {
        if let Some(done) = self.in_arena(ShmOp::Barrier, &mut []).await {
            return done;
        }
        let (rank, n) = (self.transport.rank(), self.transport.world());
        let tag = self.next_tag();
        let ctx = self.ctx(tag, ReduceOp::Sum, "barrier");
        execute::<T, f32>(&self.transport, &self.send_buffers, &plan::plan_barrier(rank, n), &mut [], ctx).await
    }

    /// Point-to-point: the k-th `send` to a peer matches that peer's k-th `recv` from us (per epoch).
    pub async fn send<E: Element>(&mut self, to: Rank, data: &[E]) -> Result<(), ClusterError> {
        let tag = Tag { group: self.group, epoch: self.epoch, seq: self.p2p_sent[to], step: P2P_STEP };
        self.p2p_sent[to] += 1;
        let mark = self.mark();
        let result = self.transport.send(to, tag, bytes::Bytes::copy_from_slice(bytemuck::cast_slice(data))).await;
        self.note("send", mark, result)
    }

    pub async fn recv<E: Element>(&mut self, from: Rank, out: &mut [E]) -> Result<(), ClusterError> {
        let mark = self.mark();
        let result = self.receive(from, out).await;
        self.note("recv", mark, result)
    }

    async fn receive<E: Element>(&mut self, from: Rank, out: &mut [E]) -> Result<(), ClusterError> {
        let tag = Tag { group: self.group, epoch: self.epoch, seq: self.p2p_received[from], step: P2P_STEP };
        self.p2p_received[from] += 1;
        let payload = self.transport.recv(from, tag, LossScope::Peer, self.config.collective_timeout_ms).await?;
        let bytes = payload.to_vec();
        let expected = std::mem::size_of_val(out);
        if bytes.len() != expected {
            return Err(ClusterError::LengthMismatch {
                rank: self.transport.rank(),
                op: "recv",
                peer: from,
                got: bytes.len(),
                expected,
            });
        }
        bytemuck::cast_slice_mut::<E, u8>(out).copy_from_slice(&bytes);
        Ok(())
    }
}

/// One slice's trip across hosts in a two-tier all-reduce: this rank's carried part of the slice,
/// all-reduced with the ranks that carry the same part on the other hosts.
struct CrossHostPart<'a, T: Transport> {
    /// The carriers of this rank's part, one per host (`None`: this rank carries nothing across).
    group: Option<Subgroup<T>>,
    /// Ranks per host that each carry a part of every slice (1: the leader carries all of it).
    carriers: usize,
    carrier: Rank,
    buffers: &'a SendBuffers,
    config: &'a CollectiveConfig,
    ctx: ExecContext,
}

impl<T: Transport> CrossHostPart<'_, T> {
    async fn run<'s, E: Element>(&self, s: usize, slice: &'s mut [f32]) -> Result<&'s mut [f32], ClusterError> {
        if let Some(group) = &self.group {
            let part =
                if self.carriers > 1 { chunk_range(slice.len(), self.carriers, self.carrier) } else { 0..slice.len() };
            let ctx = ExecContext { tag: Tag { step: (s as u32) << 16, ..self.ctx.tag }, ..self.ctx };
            all_reduce_over::<Subgroup<T>, E>(group, self.buffers, self.config, &mut slice[part], ctx).await?;
        }
        Ok(slice)
    }
}

/// One arena call of a two-tier all-reduce on a slice (nothing when the rank is alone on its host).
struct SameHostCall<'a> {
    op: ShmOp,
    tag: Tag,
    timeout_ms: u64,
    /// The group's ranks of the host's ranks, for errors (the arena numbers them from 0).
    members: &'a [Rank],
}

impl SameHostCall<'_> {
    async fn run<'s>(
        self,
        claim: Option<&mut ArenaClaim>,
        slice: &'s mut [f32],
    ) -> Result<&'s mut [f32], ClusterError> {
        if let Some(claim) = claim {
            let members = self.members;
            shm_exec::run(claim, self.op, slice, self.tag, self.timeout_ms)
                .await
                .map_err(|e| e.renumbered(|local| members.get(local).copied().unwrap_or(local)))?;
        }
        Ok(slice)
    }
}

/// Runs one plan per slice of `acc`, all slices concurrently (a pipeline): slice i uses tag steps
/// from `i * steps_per_plan`.
async fn run_sliced<T: Transport, E: Element>(
    transport: &T,
    buffers: &SendBuffers,
    acc: &mut [f32],
    ctx: ExecContext,
    elems_per_slice: usize,
    make: impl Fn(usize) -> Plan,
) -> Result<(), ClusterError> {
    if acc.is_empty() {
        return execute::<T, E>(transport, buffers, &make(0), acc, ctx).await;
    }
    let steps = make(1).steps.len() as u32;
    let slices = acc.chunks_mut(elems_per_slice.max(1)).enumerate().map(|(i, slice)| {
        let plan = make(slice.len());
        let ctx = ExecContext { tag: Tag { step: i as u32 * steps, ..ctx.tag }, ..ctx };
        async move { execute::<T, E>(transport, buffers, &plan, slice, ctx).await }
    });
    futures::future::try_join_all(slices).await.map(|_| ())
}

/// All-reduce of `acc` over every rank of `transport` with messages: recursive doubling below
/// `small_message_bytes_max`, else the ring, sliced into a pipeline.
async fn all_reduce_over<T: Transport, E: Element>(
    transport: &T,
    buffers: &SendBuffers,
    config: &CollectiveConfig,
    acc: &mut [f32],
    ctx: ExecContext,
) -> Result<(), ClusterError> {
    let (rank, n) = (transport.rank(), transport.world());
    if acc.len() * E::BYTES < config.small_message_bytes_max {
        let plan = plan::plan_recursive_doubling_all_reduce(rank, n, acc.len());
        execute::<T, E>(transport, buffers, &plan, acc, ctx).await
    } else {
        let per = (config.pipeline_slice_bytes / E::BYTES).max(1);
        run_sliced::<T, E>(transport, buffers, acc, ctx, per, |len| plan::plan_ring_all_reduce(rank, n, len)).await
    }
}

#[derive(Clone, Copy)]
enum CollectiveKind {
    AllReduce,
    Broadcast(Rank),
    Reduce(Rank),
}

impl<T: Transport> Collective for Communicator<T> {
    type Buffer<E: Element> = [E];

    fn rank(&self) -> Rank {
        self.transport.rank()
    }

    fn world(&self) -> usize {
        self.transport.world()
    }

    async fn all_reduce<E: Element>(&mut self, buf: &mut [E], op: ReduceOp) -> Result<(), ClusterError> {
        Communicator::all_reduce(self, buf, op).await
    }

    async fn broadcast<E: Element>(&mut self, buf: &mut [E], root: Rank) -> Result<(), ClusterError> {
        Communicator::broadcast(self, buf, root).await
    }

    async fn all_gather<E: Element>(&mut self, input: &[E], output: &mut [E]) -> Result<(), ClusterError> {
        Communicator::all_gather(self, input, output).await
    }

    async fn reduce_scatter<E: Element>(
        &mut self,
        input: &[E],
        output: &mut [E],
        op: ReduceOp,
    ) -> Result<(), ClusterError> {
        Communicator::reduce_scatter(self, input, output, op).await
    }

    async fn barrier(&mut self) -> Result<(), ClusterError> {
        Communicator::barrier(self).await
    }
}

//! One group's ranks over two transports: the ranks on this rank's host over the same-host transport
//! (Unix sockets: no encryption and one kernel copy each way), every other rank over the mesh between
//! hosts (QUIC). Ranks keep the mesh's numbering; the same-host transport numbers the host's ranks in
//! their order among the group's (`members`). Both ends of a pair route by the same layout — the
//! roster's, the same on every rank — so a message is always received on the transport it was sent on.
//!
//! This is what lets point-to-point traffic (pipeline activations between stages on one host) and the
//! collectives that stay flat (reduce-scatter and all-gather of sharded training, broadcast) take the
//! cheap path between neighbours on one host in a job that spans hosts.
//!
//! A group receive ([`LossScope::Group`]) fails on the loss of a peer of *either* transport: a
//! collective waiting on a neighbour on this host must not wait out its timeout when a member on
//! another host crashed. A receive in [`LossScope::Members`] fails on the loss of one of those members,
//! whichever transport sees it. Errors name the mesh's ranks.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;

use super::{LossScope, Payload, Transport};
use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

/// Ranks of `remote` (the whole group), those on this host reached through `local` instead.
pub struct Routed<R: Transport, L: Transport> {
    remote: Arc<R>,
    local: Arc<L>,
    /// The index in `local` of each rank on this host (`None` for the others).
    local_index: Vec<Option<Rank>>,
    /// The rank in `remote` of each of `local`'s ranks.
    members: Vec<Rank>,
}

enum Route {
    Local(Rank),
    Remote,
}

impl<R: Transport, L: Transport> Routed<R, L> {
    /// `members[i]` is the rank (in `remote`) of `local`'s rank i: the ranks on this host, this rank
    /// among them. Every rank on this host must pass the same list.
    pub fn new(remote: Arc<R>, local: Arc<L>, members: Vec<Rank>) -> Result<Self, ClusterError> {
        let (me, world) = (remote.rank(), remote.world());
        let invalid = |why: String| ClusterError::InvalidArgument {
            rank: me,
            op: "routed transport",
            reason: format!("host members {members:?} of a group of {world} ranks: {why}"),
        };
        if members.len() != local.world() {
            return Err(invalid(format!("the same-host transport has {} ranks", local.world())));
        }
        let mut local_index = vec![None; world];
        for (i, &m) in members.iter().enumerate() {
            match local_index.get_mut(m) {
                None => return Err(invalid(format!("rank {m} is not in the group"))),
                Some(Some(_)) => return Err(invalid(format!("rank {m} is listed twice"))),
                Some(slot) => *slot = Some(i),
            }
        }
        if members[local.rank()] != me {
            return Err(invalid(format!(
                "the same-host transport's rank {} is listed as {}, not this rank ({me})",
                local.rank(),
                members[local.rank()]
            )));
        }
        Ok(Routed { remote, local, local_index, members })
    }

    /// Whether messages to and from `peer` take the same-host transport.
    pub fn is_local(&self, peer: Rank) -> bool {
        self.local_index.get(peer).is_some_and(Option::is_some)
    }

    fn route(&self, peer: Rank) -> Result<Route, ClusterError> {
        match self.local_index.get(peer) {
            Some(Some(l)) => Ok(Route::Local(*l)),
            Some(None) => Ok(Route::Remote),
            None => Err(ClusterError::InvalidArgument {
                rank: self.remote.rank(),
                op: "routed send/recv",
                reason: format!("rank {peer} is outside this group of {} ranks", self.remote.world()),
            }),
        }
    }

    fn global(&self, local: Rank) -> Rank {
        self.members.get(local).copied().unwrap_or(local)
    }

    /// `scope` in the same-host transport's numbering: members on other hosts are left out (the mesh
    /// between hosts watches them).
    fn local_scope(&self, scope: &LossScope) -> LossScope {
        match scope {
            LossScope::Members(members) => LossScope::Members(self.local_members(members).into()),
            other => other.clone(),
        }
    }

    /// Those of `peers` on this host, in the same-host transport's numbering.
    fn local_members(&self, peers: &[Rank]) -> Vec<Rank> {
        peers.iter().filter_map(|&p| self.local_index.get(p).copied().flatten()).collect()
    }

    /// `recv`, or — for a group receive — the first loss `other` sees of a peer `scope` covers (`others`:
    /// `scope`'s members in `other`'s numbering), whichever comes first.
    async fn or_loss_of<O: Transport>(
        &self,
        recv: impl Future<Output = Result<Payload, ClusterError>>,
        other: &O,
        global: impl Fn(Rank) -> Rank,
        others: &LossScope,
        tag: Tag,
    ) -> Result<Payload, ClusterError> {
        let loss = async {
            match others {
                LossScope::Peer => std::future::pending().await,
                LossScope::Group => other.any_loss().await,
                LossScope::Members(members) => other.loss_among(members).await,
            }
        };
        tokio::select! {
            biased;
            r = recv => r,
            (peer, reason) = loss => {
                Err(ClusterError::PeerLost { rank: self.remote.rank(), peer: global(peer), epoch: tag.epoch, reason })
            }
        }
    }
}

impl<R: Transport, L: Transport> Transport for Routed<R, L> {
    fn rank(&self) -> Rank {
        self.remote.rank()
    }

    fn world(&self) -> usize {
        self.remote.world()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        match self.route(to)? {
            Route::Local(l) => self.local.send(l, tag, payload).await.map_err(|e| e.renumbered(|r| self.global(r))),
            Route::Remote => self.remote.send(to, tag, payload).await,
        }
    }

    fn copies_on_send(&self, to: Rank) -> bool {
        match self.route(to) {
            Ok(Route::Local(l)) => self.local.copies_on_send(l),
            Ok(Route::Remote) => self.remote.copies_on_send(to),
            Err(_) => false,
        }
    }

    async fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> Result<(), ClusterError> {
        match self.route(to)? {
            Route::Local(l) => self.local.send_slice(l, tag, data).await.map_err(|e| e.renumbered(|r| self.global(r))),
            Route::Remote => self.remote.send_slice(to, tag, data).await,
        }
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        match self.route(from)? {
            Route::Local(l) => {
                let local = self.local_scope(&scope);
                let recv = async {
                    self.local.recv(l, tag, local, timeout_ms).await.map_err(|e| e.renumbered(|r| self.global(r)))
                };
                self.or_loss_of(recv, &*self.remote, |p| p, &scope, tag).await
            }
            Route::Remote => {
                let local = self.local_scope(&scope);
                let recv = self.remote.recv(from, tag, scope, timeout_ms);
                self.or_loss_of(recv, &*self.local, |p| self.global(p), &local, tag).await
            }
        }
    }

    fn fence(&self, epoch: u64) {
        self.remote.fence(epoch);
        self.local.fence(epoch);
    }

    async fn any_loss(&self) -> (Rank, String) {
        tokio::select! {
            lost = self.remote.any_loss() => lost,
            (peer, reason) = self.local.any_loss() => (self.global(peer), reason),
        }
    }

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        let local = self.local_members(peers);
        tokio::select! {
            lost = self.remote.loss_among(peers) => lost,
            (peer, reason) = self.local.loss_among(&local) => (self.global(peer), reason),
        }
    }

    /// Both transports, at once: each waits (bounded) for its peers to finish.
    async fn shutdown(&self) {
        futures::join!(self.remote.shutdown(), self.local.shutdown());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{chunk_range, CollectiveConfig, Communicator, ReduceOp};
    use crate::transport::memory::MemoryTransport;
    use crate::TransportConfig;

    /// Four ranks on two hosts ({0, 2} and {1, 3}: hosts need not be contiguous in rank order), each
    /// host with its own in-memory "same-host" mesh, all four on one "remote" mesh.
    struct TwoHosts {
        remote: Vec<Arc<MemoryTransport>>,
        local: Vec<Arc<MemoryTransport>>,
        routed: Vec<Arc<Routed<MemoryTransport, MemoryTransport>>>,
    }

    const HOSTS: [[Rank; 2]; 2] = [[0, 2], [1, 3]];

    fn two_hosts() -> TwoHosts {
        let remote: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(4, 64).into_iter().map(Arc::new).collect();
        let meshes: Vec<Vec<MemoryTransport>> = (0..2).map(|_| MemoryTransport::mesh(2, 64)).collect();
        let mut local: Vec<Option<Arc<MemoryTransport>>> = vec![None; 4];
        for (host, members) in HOSTS.iter().enumerate() {
            for (i, &rank) in members.iter().enumerate() {
                local[rank] = Some(Arc::new(meshes[host][i].clone()));
            }
        }
        let local: Vec<Arc<MemoryTransport>> = local.into_iter().map(|t| t.expect("every rank on a host")).collect();
        let routed = (0..4)
            .map(|rank| {
                let members = HOSTS[rank % 2].to_vec();
                Arc::new(Routed::new(remote[rank].clone(), local[rank].clone(), members).expect("valid"))
            })
            .collect();
        TwoHosts { remote, local, routed }
    }

    #[test]
    fn members_must_match_the_same_host_transport() {
        let t = two_hosts();
        let err = |members: Vec<Rank>| {
            Routed::new(t.remote[0].clone(), t.local[0].clone(), members).err().expect("refused").to_string()
        };
        assert!(err(vec![0]).contains("the same-host transport has 2 ranks"), "{}", err(vec![0]));
        assert!(err(vec![0, 4]).contains("rank 4 is not in the group"));
        assert!(err(vec![0, 0]).contains("listed twice"));
        assert!(err(vec![2, 0]).contains("not this rank (0)"));
        assert!(t.routed[0].is_local(2) && !t.routed[0].is_local(1) && !t.routed[0].is_local(3));
    }

    /// A message to a rank on this host goes through the same-host transport only; to another host,
    /// through the mesh only.
    #[tokio::test]
    async fn each_message_takes_its_hosts_path() {
        let t = two_hosts();
        let tag = Tag { group: 0, epoch: 1, seq: 0, step: 0 };
        t.routed[0].send(2, tag, Bytes::from_static(b"same host")).await.expect("send");
        t.routed[0].send(1, tag, Bytes::from_static(b"other host")).await.expect("send");
        // Rank 2 is local index 1 of host 0's mesh; rank 0 is its index 0.
        let got = t.local[2].recv(0, tag, LossScope::Peer, 1000).await.expect("on the same-host mesh");
        assert_eq!(got.to_vec(), b"same host");
        let got = t.remote[1].recv(0, tag, LossScope::Peer, 1000).await.expect("on the mesh");
        assert_eq!(got.to_vec(), b"other host");
        // Nothing took the other path.
        let tag2 = Tag { seq: 1, ..tag };
        t.routed[0].send(2, tag2, Bytes::from_static(b"x")).await.expect("send");
        assert!(matches!(t.remote[2].recv(0, tag2, LossScope::Peer, 50).await, Err(ClusterError::Timeout { .. })));
    }

    /// Every collective over the routed transports equals the plain result.
    #[tokio::test]
    async fn collectives_over_two_hosts_equal_the_reference() {
        let t = two_hosts();
        let config =
            CollectiveConfig { small_message_bytes_max: 64, ..CollectiveConfig::from(&TransportConfig::default()) };
        let len = 1001;
        let input = |rank: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0).collect() };
        let sum: Vec<f32> = (0..len).map(|i| (0..4).map(|r| input(r)[i]).sum()).collect();
        let tasks = t.routed.iter().enumerate().map(|(rank, routed)| {
            let mut comm = Communicator::new(routed.clone(), 0, 1, config.clone());
            async move {
                let mut all = input(rank);
                comm.all_reduce(&mut all[..], ReduceOp::Sum).await.expect("all-reduce");
                let mut mine = vec![0f32; chunk_range(len, 4, rank).len()];
                comm.reduce_scatter(&input(rank)[..], &mut mine[..], ReduceOp::Sum).await.expect("reduce-scatter");
                let mut gathered = vec![0f32; len];
                let piece = input(rank)[chunk_range(len, 4, rank)].to_vec();
                comm.all_gather(&piece[..], &mut gathered[..]).await.expect("all-gather");
                let mut root = if rank == 3 { input(3) } else { vec![0f32; len] };
                comm.broadcast(&mut root[..], 3).await.expect("broadcast");
                comm.barrier().await.expect("barrier");
                (all, mine, gathered, root)
            }
        });
        for (rank, (all, mine, gathered, root)) in futures::future::join_all(tasks).await.into_iter().enumerate() {
            assert_eq!(all, sum, "all-reduce on rank {rank}");
            assert_eq!(mine, sum[chunk_range(len, 4, rank)], "reduce-scatter on rank {rank}");
            let want: Vec<f32> = (0..4).flat_map(|r| input(r)[chunk_range(len, 4, r)].to_vec()).collect();
            assert_eq!(gathered, want, "all-gather on rank {rank}");
            assert_eq!(root, input(3), "broadcast on rank {rank}");
        }
    }

    /// A group receive from a neighbour on this host fails as soon as a rank on another host is lost,
    /// and the other way round; a point-to-point receive waits for its own peer only.
    #[tokio::test]
    async fn a_loss_on_either_path_fails_group_receives_on_both() {
        let t = two_hosts();
        let tag = Tag { group: 0, epoch: 3, seq: 0, step: 0 };
        let from_neighbour = t.routed[0].recv(2, tag, LossScope::Group, 10_000);
        let kill_other_host = async {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            t.remote[1].kill();
        };
        let (got, ()) = tokio::join!(from_neighbour, kill_other_host);
        match got {
            Err(ClusterError::PeerLost { rank: 0, peer: 1, epoch: 3, .. }) => {}
            other => panic!("expected rank 1 lost, got {other:?}"),
        }
        let p2p = t.routed[0].recv(2, tag, LossScope::Peer, 50).await;
        assert!(matches!(p2p, Err(ClusterError::Timeout { peer: 2, .. })), "{p2p:?}");

        // Host 1's neighbour dies (local index 1 of host 1 is rank 3): rank 1's group receive from
        // rank 0, on another host, fails and names rank 3.
        let t = two_hosts();
        t.local[3].kill();
        match t.routed[1].recv(0, tag, LossScope::Group, 10_000).await {
            Err(ClusterError::PeerLost { rank: 1, peer: 3, .. }) => {}
            other => panic!("expected rank 3 lost, got {other:?}"),
        }
        match t.routed[1].recv(3, tag, LossScope::Peer, 10_000).await {
            Err(ClusterError::PeerLost { rank: 1, peer: 3, .. }) => {}
            other => panic!("the neighbour's own loss names it in the group's numbering, got {other:?}"),
        }
    }

    /// A receive among members fails on the loss of a member, whichever path sees it, and outlives the
    /// loss of a rank outside them on either path.
    #[tokio::test]
    async fn a_members_receive_fails_on_a_members_loss_on_either_path_only() {
        let tag = Tag { group: 0, epoch: 3, seq: 0, step: 0 };
        let members = |m: &[Rank]| LossScope::Members(m.into());
        // Rank 0 waits on its neighbour 2; rank 1, on another host, is lost.
        let t = two_hosts();
        t.remote[1].kill();
        let got = t.routed[0].recv(2, tag, members(&[0, 2]), 50).await;
        assert!(matches!(got, Err(ClusterError::Timeout { peer: 2, .. })), "rank 1 is not a member: {got:?}");
        match t.routed[0].recv(2, tag, members(&[0, 1, 2]), 10_000).await {
            Err(ClusterError::PeerLost { rank: 0, peer: 1, .. }) => {}
            other => panic!("expected member 1 lost, got {other:?}"),
        }
        // Rank 1 waits on rank 0, on another host; its neighbour 3 is lost (seen by the same-host path).
        let t = two_hosts();
        t.local[3].kill();
        let got = t.routed[1].recv(0, tag, members(&[0, 1]), 50).await;
        assert!(matches!(got, Err(ClusterError::Timeout { peer: 0, .. })), "rank 3 is not a member: {got:?}");
        match t.routed[1].recv(0, tag, members(&[0, 1, 3]), 10_000).await {
            Err(ClusterError::PeerLost { rank: 1, peer: 3, .. }) => {}
            other => panic!("expected member 3 lost, got {other:?}"),
        }
        assert_eq!(t.routed[1].loss_among(&[0, 3]).await.0, 3, "named in the group's numbering");
    }
}

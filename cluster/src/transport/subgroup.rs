//! A subset of a transport's ranks seen as a transport of its own: local rank `i` is the member
//! `members[i]` of the inner transport. Pipelines use it to run a stage's data-parallel group and a
//! replica's chain of stages over the one mesh an attempt connects: nothing is copied or re-framed,
//! ranks are only renumbered. Collectives on different subgroups of one mesh must use different tag
//! groups ([`crate::collective::Communicator::new`]'s `group`) wherever two members share both.
//!
//! A collective's receive ([`LossScope::Group`]) on a subgroup fails on the loss of a member of the
//! subgroup only ([`LossScope::Members`] on the inner transport): a group that lost no one completes
//! what it is doing while another subgroup of the same mesh fails — a replica that survives the loss of
//! another keeps its state.
//!
//! Errors name the inner transport's ranks (the attempt's), which is what a log reader can map to a node;
//! [`Transport::any_loss`] names the subgroup's, as every transport names its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

use super::{LossScope, Payload, Transport};
use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

/// Ranks `members` of `inner`, renumbered `0..members.len()`.
pub struct Subgroup<T: Transport> {
    inner: Arc<T>,
    members: Arc<[Rank]>,
    rank: Rank,
    /// Payload bytes sent through this subgroup (each group of a mesh counts its own traffic).
    sent: AtomicU64,
}

impl<T: Transport> Subgroup<T> {
    /// The subgroup of `inner` made of `members` (inner ranks, distinct, in the subgroup's rank order),
    /// which must include `inner`'s own rank.
    pub fn new(inner: Arc<T>, members: Vec<Rank>) -> Result<Self, ClusterError> {
        let me = inner.rank();
        let world = inner.world();
        let invalid = |why: String| ClusterError::InvalidArgument {
            rank: me,
            op: "subgroup",
            reason: format!("members {members:?} of a transport of {world} ranks: {why}"),
        };
        if let Some(&bad) = members.iter().find(|&&m| m >= world) {
            return Err(invalid(format!("rank {bad} is not in the transport")));
        }
        let mut sorted = members.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != members.len() {
            return Err(invalid("a rank is listed twice".into()));
        }
        let Some(rank) = members.iter().position(|&m| m == me) else {
            return Err(invalid(format!("this rank ({me}) is not a member")));
        };
        Ok(Self { inner, members: members.into(), rank, sent: AtomicU64::new(0) })
    }

    /// The inner rank of local rank `local`.
    pub fn member(&self, local: Rank) -> Rank {
        self.members[local]
    }

    fn inner_rank(&self, local: Rank) -> Result<Rank, ClusterError> {
        self.members.get(local).copied().ok_or_else(|| ClusterError::InvalidArgument {
            rank: self.rank,
            op: "subgroup send/recv",
            reason: format!("rank {local} is outside this subgroup of {} ranks", self.members.len()),
        })
    }

    /// `scope` in the inner transport's numbering: a group receive concerns this subgroup's members.
    fn inner_scope(&self, scope: LossScope) -> Result<LossScope, ClusterError> {
        Ok(match scope {
            LossScope::Peer => LossScope::Peer,
            LossScope::Group => LossScope::Members(self.members.clone()),
            LossScope::Members(local) => LossScope::Members(self.inner_ranks(&local)?.into()),
        })
    }

    fn inner_ranks(&self, local: &[Rank]) -> Result<Vec<Rank>, ClusterError> {
        local.iter().map(|&l| self.inner_rank(l)).collect()
    }

    /// The local rank of inner rank `inner` (a member).
    fn local_rank(&self, inner: Rank) -> Rank {
        self.members.iter().position(|&m| m == inner).unwrap_or(inner)
    }
}

impl<T: Transport> Transport for Subgroup<T> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        let (to, len) = (self.inner_rank(to)?, payload.len() as u64);
        self.inner.send(to, tag, payload).await?;
        self.sent.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn copies_on_send(&self, to: Rank) -> bool {
        self.inner_rank(to).is_ok_and(|to| self.inner.copies_on_send(to))
    }

    async fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> Result<(), ClusterError> {
        let to = self.inner_rank(to)?;
        self.inner.send_slice(to, tag, data).await?;
        self.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// This subgroup's own sends (never an arena's: a subgroup has none).
    fn sent_bytes(&self) -> Option<u64> {
        Some(self.sent.load(Ordering::Relaxed))
    }

    /// With [`LossScope::Group`] the loss of a member of this subgroup fails the receive, not that of
    /// another rank of the inner transport.
    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        let from = self.inner_rank(from)?;
        let scope = self.inner_scope(scope)?;
        self.inner.recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.inner.fence(epoch);
    }

    /// The loss of a member (named by its rank in this subgroup).
    async fn any_loss(&self) -> (Rank, String) {
        let (peer, reason) = self.inner.loss_among(&self.members).await;
        (self.local_rank(peer), reason)
    }

    /// Ranks outside this subgroup are never lost to it: waits for ever for them.
    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        let inner: Vec<Rank> = peers.iter().filter_map(|&p| self.members.get(p).copied()).collect();
        let (peer, reason) = self.inner.loss_among(&inner).await;
        (self.local_rank(peer), reason)
    }

    /// Nothing: the inner transport belongs to whoever made the subgroups and is shut down by them.
    async fn shutdown(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{CollectiveConfig, Communicator, ReduceOp};
    use crate::transport::memory::MemoryTransport;
    use crate::transport::same_host::SameHostTransport;
    use crate::TransportConfig;

    #[test]
    fn members_must_exist_be_distinct_and_include_this_rank() {
        let mesh: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(4, 16).into_iter().map(Arc::new).collect();
        let err = |members: Vec<usize>| Subgroup::new(mesh[1].clone(), members).err().expect("refused").to_string();
        assert!(err(vec![1, 4]).contains("rank 4 is not in the transport"));
        assert!(err(vec![1, 1]).contains("listed twice"));
        assert!(err(vec![0, 2]).contains("this rank (1) is not a member"));
        let group = Subgroup::new(mesh[1].clone(), vec![3, 1]).expect("valid");
        assert_eq!((group.rank(), group.world(), group.member(0)), (1, 2, 3));
    }

    /// Two disjoint pairs of a 4-rank mesh all-reduce at once under the same tag group: each pair sums
    /// only its own members' values.
    #[tokio::test]
    async fn disjoint_subgroups_reduce_independently_over_one_mesh() {
        let mesh: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(4, 64).into_iter().map(Arc::new).collect();
        let config = CollectiveConfig::from(&TransportConfig::default());
        let groups = [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]];
        let tasks = mesh.iter().enumerate().map(|(rank, t)| {
            let group = Subgroup::new(t.clone(), groups[rank].clone()).expect("valid");
            let mut comm = Communicator::new(Arc::new(group), 7, 1, config.clone());
            async move {
                let mut data = vec![rank as f32 + 1.0; 5];
                comm.all_reduce(&mut data[..], ReduceOp::Sum).await.expect("all-reduce");
                (data, comm.take_calls())
            }
        });
        let results = futures::future::join_all(tasks).await;
        // {0, 2}: 1 + 3; {1, 3}: 2 + 4.
        for (rank, (data, calls)) in results.iter().enumerate() {
            let expected = if rank % 2 == 0 { 4.0 } else { 6.0 };
            assert!(data.iter().all(|&x| x == expected), "rank {rank}: {data:?}");
            // Each subgroup counts its own sends: a member of two sends the other its 5 values.
            let sent: Vec<(&str, u64)> = calls.iter().map(|c| (c.op, c.bytes)).collect();
            assert_eq!(sent, vec![("all_reduce", 20)], "rank {rank}");
        }
    }

    fn tag(seq: u64) -> Tag {
        Tag { group: 9, epoch: 1, seq, step: 0 }
    }

    /// Subgroup {0, 1, 2} of a 4-rank mesh: a group receive outlives the loss of rank 3, which is not a
    /// member, and fails on the loss of member 2 (named by its rank in the mesh); the subgroup's
    /// `any_loss` sees only members, by their rank in the subgroup.
    #[tokio::test]
    async fn a_group_receive_fails_on_the_loss_of_a_member_not_of_another_rank() {
        let mesh: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(4, 16).into_iter().map(Arc::new).collect();
        let group = Subgroup::new(mesh[0].clone(), vec![0, 1, 2]).expect("valid");
        let waiting = group.recv(1, tag(0), LossScope::Group, 10_000);
        let (got, ()) = tokio::join!(waiting, async {
            mesh[3].kill();
            mesh[1].send(0, tag(0), Bytes::from_static(b"x")).await.expect("sent");
        });
        assert_eq!(got.expect("rank 3 is not a member").to_vec(), b"x");
        let later = group.recv(1, tag(1), LossScope::Group, 30).await;
        assert!(matches!(later, Err(ClusterError::Timeout { .. })), "{later:?}");
        let seen = tokio::time::timeout(std::time::Duration::from_millis(30), group.any_loss()).await;
        assert!(seen.is_err(), "the subgroup lost no member: {seen:?}");

        let waiting = group.recv(1, tag(2), LossScope::Group, 10_000);
        let (got, ()) = tokio::join!(waiting, async { mesh[2].kill() });
        assert!(matches!(got, Err(ClusterError::PeerLost { rank: 0, peer: 2, .. })), "{got:?}");
        assert_eq!(group.any_loss().await.0, 2);
        let pair = Subgroup::new(mesh[0].clone(), vec![2, 0]).expect("valid");
        assert_eq!(pair.any_loss().await.0, 0, "rank 2 of the mesh is rank 0 of this subgroup");
    }

    /// Four ranks on the same-host transport (Unix sockets), rank 3 crashed: the tensor group {0, 1}
    /// still all-reduces; a group that had rank 3 as a member fails at once, naming it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_sockets_a_subgroup_that_lost_no_member_completes_its_collective() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let transport = TransportConfig { collective_timeout_ms: 10_000, ..TransportConfig::default() };
        let connect = |rank| SameHostTransport::connect(dir.path(), rank, 4, transport.clone());
        let (t0, t1, t2, t3) = tokio::join!(connect(0), connect(1), connect(2), connect(3));
        let (t0, t1, _t2) = (Arc::new(t0.expect("rank 0")), Arc::new(t1.expect("rank 1")), t2.expect("rank 2"));
        drop(t3.expect("rank 3")); // its sockets close without a goodbye: a crash
        for t in [&t0, &t1] {
            let seen = tokio::time::timeout(std::time::Duration::from_secs(5), t.any_loss()).await;
            assert_eq!(seen.expect("the loss is seen").0, 3);
        }
        let config = CollectiveConfig::from(&transport);
        let tasks = [&t0, &t1].into_iter().map(|t| {
            let group = Subgroup::new(t.clone(), vec![0, 1]).expect("valid");
            let mut comm = Communicator::new(Arc::new(group), 7, 1, config.clone());
            let rank = t.rank();
            async move {
                let mut data = vec![rank as f32 + 1.0; 1000];
                comm.all_reduce(&mut data[..], ReduceOp::Sum).await.map(|()| data)
            }
        });
        for (rank, result) in futures::future::join_all(tasks).await.into_iter().enumerate() {
            let data = result.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            assert!(data.iter().all(|&x| x == 3.0), "rank {rank}: {data:?}");
        }
        let with_the_lost = Subgroup::new(t0.clone(), vec![0, 1, 3]).expect("valid");
        match with_the_lost.recv(1, tag(0), LossScope::Group, 10_000).await {
            Err(ClusterError::PeerLost { rank: 0, peer: 3, .. }) => {}
            other => panic!("expected rank 3 lost, got {other:?}"),
        }
    }
}

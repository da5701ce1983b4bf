//! A subset of a transport's ranks seen as a transport of its own: local rank `i` is the member
//! `members[i]` of the inner transport. Pipelines use it to run a stage's data-parallel group and a
//! replica's chain of stages over the one mesh an attempt connects: nothing is copied or re-framed,
//! ranks are only renumbered. Collectives on different subgroups of one mesh must use different tag
//! groups ([`crate::collective::Communicator::new`]'s `group`) wherever two members share both.
//!
//! Errors name the inner transport's ranks (the attempt's), which is what a log reader can map to a node.

use std::sync::Arc;

use bytes::Bytes;

use super::{LossScope, Payload, Transport};
use crate::error::Rank;
use crate::wire::Tag;
use crate::ClusterError;

/// Ranks `members` of `inner`, renumbered `0..members.len()`.
pub struct Subgroup<T: Transport> {
    inner: Arc<T>,
    members: Vec<Rank>,
    rank: Rank,
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
        Ok(Self { inner, members, rank })
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
}

impl<T: Transport> Transport for Subgroup<T> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        let to = self.inner_rank(to)?;
        self.inner.send(to, tag, payload).await
    }

    fn copies_on_send(&self, to: Rank) -> bool {
        self.inner_rank(to).is_ok_and(|to| self.inner.copies_on_send(to))
    }

    async fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> Result<(), ClusterError> {
        let to = self.inner_rank(to)?;
        self.inner.send_slice(to, tag, data).await
    }

    /// With [`LossScope::Group`] the loss of any rank of the inner transport fails the receive, not only
    /// of this subgroup's: the inner transport knows no subgroups, and an attempt aborts on any loss.
    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        let from = self.inner_rank(from)?;
        self.inner.recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.inner.fence(epoch);
    }

    /// In the inner transport's numbering: the lost peer may be outside this subgroup.
    async fn any_loss(&self) -> (Rank, String) {
        self.inner.any_loss().await
    }

    /// Nothing: the inner transport belongs to whoever made the subgroups and is shut down by them.
    async fn shutdown(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{CollectiveConfig, Communicator, ReduceOp};
    use crate::transport::memory::MemoryTransport;
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
                data
            }
        });
        let results = futures::future::join_all(tasks).await;
        // {0, 2}: 1 + 3; {1, 3}: 2 + 4.
        for (rank, data) in results.iter().enumerate() {
            let expected = if rank % 2 == 0 { 4.0 } else { 6.0 };
            assert!(data.iter().all(|&x| x == expected), "rank {rank}: {data:?}");
        }
    }
}

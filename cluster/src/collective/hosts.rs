//! Which ranks share a host: the layout behind two-tier collectives ([`super::Communicator::with_host_tier`]).
//! Pure: ranks in, groups out.
//!
//! Hosts are numbered in the order of their lowest rank; a host's ranks keep their global order, and
//! its lowest rank is its *leader*. When every host has the same number of ranks k, *column* q is the
//! q-th rank of every host (in host order): the group that carries chunk q of a two-tier all-reduce
//! between hosts.

use crate::error::Rank;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLayout {
    /// The host of each rank.
    host_of: Vec<usize>,
    /// The ranks of each host, ascending.
    hosts: Vec<Vec<Rank>>,
}

impl HostLayout {
    /// Groups ranks by their host key (`keys[rank]`, e.g. the IP address a rank's data plane binds).
    pub fn of<K: PartialEq>(keys: &[K]) -> Self {
        let mut host_of = Vec::with_capacity(keys.len());
        let mut hosts: Vec<Vec<Rank>> = Vec::new();
        for (rank, key) in keys.iter().enumerate() {
            let host = match (0..hosts.len()).find(|&h| keys[hosts[h][0]] == *key) {
                Some(h) => h,
                None => {
                    hosts.push(Vec::new());
                    hosts.len() - 1
                }
            };
            hosts[host].push(rank);
            host_of.push(host);
        }
        HostLayout { host_of, hosts }
    }

    pub fn world(&self) -> usize {
        self.host_of.len()
    }

    /// The ranks of every host, hosts in order.
    pub fn hosts(&self) -> &[Vec<Rank>] {
        &self.hosts
    }

    /// The index of `rank`'s host.
    pub fn host_of(&self, rank: Rank) -> usize {
        self.host_of[rank]
    }

    /// The ranks on `rank`'s host (`rank` among them), ascending.
    pub fn members(&self, rank: Rank) -> &[Rank] {
        &self.hosts[self.host_of[rank]]
    }

    /// `rank`'s index among the ranks of its host (0: the host's leader).
    pub fn local_rank(&self, rank: Rank) -> Rank {
        self.members(rank).iter().position(|&r| r == rank).expect("a rank is on its own host")
    }

    /// Every host's leader, in host order.
    pub fn leaders(&self) -> Vec<Rank> {
        self.hosts.iter().map(|h| h[0]).collect()
    }

    /// The number of ranks on every host, when all hosts have the same.
    pub fn uniform_ranks_per_host(&self) -> Option<usize> {
        let k = self.hosts.first()?.len();
        self.hosts.iter().all(|h| h.len() == k).then_some(k)
    }

    /// The q-th rank of every host, in host order (hosts with fewer ranks are skipped).
    pub fn column(&self, q: Rank) -> Vec<Rank> {
        self.hosts.iter().filter_map(|h| h.get(q).copied()).collect()
    }

    /// Whether two tiers differ from one flat group: more than one host, and some host with several
    /// ranks.
    pub fn is_tiered(&self) -> bool {
        self.hosts.len() > 1 && self.hosts.iter().any(|h| h.len() > 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_group_by_key_in_order_of_their_lowest_rank() {
        let l = HostLayout::of(&["b", "a", "b", "c", "a", "b"]);
        assert_eq!(l.hosts(), &[vec![0, 2, 5], vec![1, 4], vec![3]]);
        assert_eq!(l.members(4), &[1, 4]);
        assert_eq!(l.local_rank(5), 2);
        assert_eq!(l.local_rank(1), 0);
        assert_eq!(l.leaders(), vec![0, 1, 3]);
        assert_eq!(l.uniform_ranks_per_host(), None);
        assert_eq!(l.column(1), vec![2, 4]);
        assert!(l.is_tiered());
    }

    #[test]
    fn uniform_hosts_have_columns_across_every_host() {
        let l = HostLayout::of(&[1, 1, 2, 2, 3, 3]);
        assert_eq!(l.uniform_ranks_per_host(), Some(2));
        assert_eq!(l.column(0), vec![0, 2, 4]);
        assert_eq!(l.column(1), vec![1, 3, 5]);
        assert_eq!(l.world(), 6);
    }

    #[test]
    fn one_host_or_one_rank_per_host_is_not_tiered() {
        assert!(!HostLayout::of(&[7, 7, 7]).is_tiered());
        assert!(!HostLayout::of(&[1, 2, 3]).is_tiered());
        assert!(!HostLayout::of::<u8>(&[]).is_tiered());
        assert_eq!(HostLayout::of::<u8>(&[]).uniform_ranks_per_host(), None);
    }
}

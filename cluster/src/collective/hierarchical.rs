//! Hierarchical all-reduce: reduce within each host over the same-host transport, all-reduce among one
//! leader per host over QUIC, broadcast back within each host. Cross-host traffic is one buffer per
//! host instead of one per rank.

use troupe_kernels::reduce::ReduceOp;

use super::{Communicator, Element};
use crate::transport::Transport;
use crate::ClusterError;

pub struct HierarchicalAllReduce<L: Transport, G: Transport> {
    /// All ranks on this host; local rank 0 is the host's leader.
    pub local: Communicator<L>,
    /// The leaders of all hosts; `None` on ranks that are not leaders.
    pub leaders: Option<Communicator<G>>,
    /// Ranks over all hosts (what an average divides by).
    pub world_total: usize,
}

impl<L: Transport, G: Transport> HierarchicalAllReduce<L, G> {
    pub async fn all_reduce<E: Element>(&mut self, data: &mut [E], op: ReduceOp) -> Result<(), ClusterError> {
        // An average sums at every level and divides once, by the global count, at the end.
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        self.local.reduce(data, inner, 0).await?;
        if let Some(leaders) = &mut self.leaders {
            leaders.all_reduce(data, inner).await?;
        }
        self.local.broadcast(data, 0).await?;
        if op == ReduceOp::Avg {
            let inv = 1.0 / self.world_total as f32;
            let mut wide = vec![0f32; data.len()];
            E::widen(data, &mut wide);
            wide.iter_mut().for_each(|v| *v *= inv);
            E::narrow(&wide, data);
        }
        Ok(())
    }
}

//! The collectives of a tensor-parallel group, on tch tensors, and an in-process implementation (ranks as
//! threads of one process) for tests. The engine implements [`TpGroup`] over
//! `troupe_cluster::collective::Collective` (whose all-gather and reduce-scatter cut flat buffers in rank
//! order: along a dim other than 0 it moves that dim first).

use std::sync::{Arc, Barrier, Mutex};

use tch::Tensor;

use super::TpError;

/// A tensor-parallel group as one rank sees it. Every rank calls the same operations in the same order
/// with tensors of the same shape; each call returns when this rank's result is ready.
pub trait TpGroup {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The sum over the ranks of `t`, identical bits on every rank.
    fn all_reduce(&mut self, t: &Tensor) -> Result<Tensor, TpError>;
    /// The ranks' `t` concatenated in rank order along `dim`.
    fn all_gather(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError>;
    /// The sum over the ranks of `t`, cut into `size` equal pieces along `dim`: this rank's piece.
    fn reduce_scatter(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError>;
}

struct Shared {
    size: usize,
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

/// One rank of an in-process group: threads exchange tensors through shared slots between two barriers.
/// Sums are taken in rank order, so every rank gets the same bits.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// The `size` ranks of a new group, rank r at index r (hand each to its thread).
    pub fn new(size: usize) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            size,
            slots: Mutex::new((0..size).map(|_| None).collect()),
            barrier: Barrier::new(size),
        });
        (0..size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    /// Every rank's `t` (copies), in rank order.
    fn exchange(&self, t: &Tensor) -> Result<Vec<Tensor>, TpError> {
        let poisoned = |_| TpError::Comm("a rank of the in-process group panicked".into());
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = Some(t.detach().contiguous().copy());
        self.shared.barrier.wait();
        let all = self
            .shared
            .slots
            .lock()
            .map_err(poisoned)?
            .iter()
            .map(|slot| slot.as_ref().map(Tensor::copy).expect("every rank filled its slot before the barrier"))
            .collect();
        // Nobody writes the next call's tensor before every rank has read this one's.
        self.shared.barrier.wait();
        Ok(all)
    }
}

fn sum(all: Vec<Tensor>) -> Tensor {
    let mut all = all.into_iter();
    let first = all.next().expect("a group has a rank");
    all.fold(first, |acc, t| acc + t)
}

impl TpGroup for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce(&mut self, t: &Tensor) -> Result<Tensor, TpError> {
        Ok(sum(self.exchange(t)?))
    }

    fn all_gather(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        Ok(Tensor::cat(&self.exchange(t)?, dim))
    }

    fn reduce_scatter(&mut self, t: &Tensor, dim: i64) -> Result<Tensor, TpError> {
        let size = self.size() as i64;
        let total = sum(self.exchange(t)?);
        let n = total.size()[dim.rem_euclid(total.dim() as i64) as usize] / size;
        Ok(total.narrow(dim, self.rank as i64 * n, n).contiguous())
    }
}

//! The collectives of a tensor-parallel group, on tch tensors, and an in-process implementation (ranks as
//! threads of one process) for tests. The engine implements [`TpGroup`] over
//! `troupe_cluster::collective::Collective` (whose all-gather and reduce-scatter cut flat buffers in rank
//! order: along a dim other than 0 it moves that dim first).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

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
    wait: Duration,
    state: Mutex<State>,
    turned: Condvar,
}

struct State {
    slots: Vec<Option<Tensor>>,
    /// Ranks that reached the current barrier, and how many barriers have opened.
    arrived: usize,
    generation: u64,
}

/// How long a rank of [`LocalGroup::new`] waits for the others at a barrier before the call fails (a
/// peer that panicked or stopped calling).
const WAIT: Duration = Duration::from_secs(60);

/// One rank of an in-process group: threads exchange tensors through shared slots between two barriers.
/// Sums are taken in rank order, so every rank gets the same bits.
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// The `size` ranks of a new group, rank r at index r (hand each to its thread).
    pub fn new(size: usize) -> Vec<LocalGroup> {
        Self::with_wait(size, WAIT)
    }

    /// [`Self::new`] whose calls fail after waiting `wait` for the other ranks.
    pub fn with_wait(size: usize, wait: Duration) -> Vec<LocalGroup> {
        let state = State { slots: (0..size).map(|_| None).collect(), arrived: 0, generation: 0 };
        let shared = Arc::new(Shared { size, wait, state: Mutex::new(state), turned: Condvar::new() });
        (0..size).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }

    /// Every rank's `t` (copies), in rank order.
    fn exchange(&self, t: &Tensor) -> Result<Vec<Tensor>, TpError> {
        self.lock()?.slots[self.rank] = Some(t.detach().contiguous().copy());
        let state = self.barrier()?;
        let all = state
            .slots
            .iter()
            .map(|slot| slot.as_ref().map(Tensor::copy).expect("every rank filled its slot before the barrier"))
            .collect();
        drop(state);
        // Nobody writes the next call's tensor before every rank has read this one's.
        drop(self.barrier()?);
        Ok(all)
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, TpError> {
        self.shared.state.lock().map_err(|_| TpError::Comm("a rank of the in-process group panicked".into()))
    }

    /// Waits until every rank has arrived; returns the state, locked.
    fn barrier(&self) -> Result<MutexGuard<'_, State>, TpError> {
        let mut state = self.lock()?;
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.shared.size {
            state.arrived = 0;
            state.generation += 1;
            self.shared.turned.notify_all();
            return Ok(state);
        }
        let (state, waited) = self
            .shared
            .turned
            .wait_timeout_while(state, self.shared.wait, |s| s.generation == generation)
            .map_err(|_| TpError::Comm("a rank of the in-process group panicked".into()))?;
        if waited.timed_out() {
            return Err(TpError::Comm(format!(
                "rank {} waited {:?} for the other ranks of its in-process group",
                self.rank, self.shared.wait
            )));
        }
        Ok(state)
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

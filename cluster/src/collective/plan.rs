//! Collective plans: for one rank, the ordered steps of a collective, each a set of sends and receives
//! of element ranges of one working buffer. Pure functions of (rank, world, len) — no IO, no clock.
//!
//! Step semantics (what [`super::exec`] and [`super::simulate`] both implement): at the start of a
//! step every `Send` snapshots its range; then every `Recv` is applied (reduced into, or copied over,
//! its range); then every `Finish` marks its range as fully reduced (an average divides here). A send at
//! step s from a to b matches the receive at step s on b from a, with the same length.

use std::ops::Range;

use super::chunk_range;
use crate::error::Rank;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Combine {
    Reduce,
    Copy,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Send { to: Rank, range: Range<usize> },
    Recv { from: Rank, range: Range<usize>, combine: Combine },
    Finish { range: Range<usize> },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub actions: Vec<Action>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
}

impl Plan {
    fn with_steps(count: usize) -> Self {
        Plan { steps: vec![Step::default(); count] }
    }

    fn push(&mut self, step: usize, action: Action) {
        self.steps[step].actions.push(action);
    }
}

fn ceil_log2(n: usize) -> usize {
    (usize::BITS - (n.max(1) - 1).leading_zeros()) as usize
}

/// Ring reduce-scatter phase over chunks of `len`: after it, rank r holds chunk `(r + 1 + shift) % n`
/// fully reduced (and finished).
fn ring_reduce_scatter_into(plan: &mut Plan, first_step: usize, rank: Rank, n: usize, len: usize, shift: usize) {
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    for s in 0..n - 1 {
        let send = (rank + shift + n - s) % n;
        let recv = (rank + shift + 2 * n - s - 1) % n;
        plan.push(first_step + s, Action::Send { to: next, range: chunk_range(len, n, send) });
        plan.push(
            first_step + s,
            Action::Recv { from: prev, range: chunk_range(len, n, recv), combine: Combine::Reduce },
        );
    }
    let owned = (rank + 1 + shift) % n;
    plan.push(first_step + n - 2, Action::Finish { range: chunk_range(len, n, owned) });
}

/// Ring all-gather phase: rank r starts owning chunk `(r + shift) % n`.
fn ring_all_gather_into(plan: &mut Plan, first_step: usize, rank: Rank, n: usize, len: usize, shift: usize) {
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;
    for s in 0..n - 1 {
        let send = (rank + shift + n - s) % n;
        let recv = (rank + shift + 2 * n - s - 1) % n;
        plan.push(first_step + s, Action::Send { to: next, range: chunk_range(len, n, send) });
        plan.push(
            first_step + s,
            Action::Recv { from: prev, range: chunk_range(len, n, recv), combine: Combine::Copy },
        );
    }
}

fn single_rank(len: usize, finish: bool) -> Plan {
    let mut plan = Plan::with_steps(1);
    if finish {
        plan.push(0, Action::Finish { range: 0..len });
    }
    plan
}

/// Bandwidth-optimal all-reduce: reduce-scatter then all-gather around a ring, 2(n−1) steps, each
/// rank sending 2(n−1)/n of the buffer.
pub fn plan_ring_all_reduce(rank: Rank, n: usize, len: usize) -> Plan {
    if n == 1 {
        return single_rank(len, true);
    }
    let mut plan = Plan::with_steps(2 * (n - 1));
    ring_reduce_scatter_into(&mut plan, 0, rank, n, len, 0);
    ring_all_gather_into(&mut plan, n - 1, rank, n, len, 1);
    plan
}

/// Latency-optimal all-reduce for small buffers: recursive doubling among the largest power of two
/// p ≤ n; the n − p extra ranks fold their data in first and receive the result last.
pub fn plan_recursive_doubling_all_reduce(rank: Rank, n: usize, len: usize) -> Plan {
    if n == 1 {
        return single_rank(len, true);
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    let rounds = p.trailing_zeros() as usize;
    let mut plan = Plan::with_steps(rounds + 2);
    let all = 0..len;
    if rank >= p {
        plan.push(0, Action::Send { to: rank - p, range: all.clone() });
        plan.push(rounds + 1, Action::Recv { from: rank - p, range: all, combine: Combine::Copy });
        return plan;
    }
    if rank < rem {
        plan.push(0, Action::Recv { from: rank + p, range: all.clone(), combine: Combine::Reduce });
    }
    for k in 0..rounds {
        let partner = rank ^ (1 << k);
        plan.push(1 + k, Action::Send { to: partner, range: all.clone() });
        plan.push(1 + k, Action::Recv { from: partner, range: all.clone(), combine: Combine::Reduce });
    }
    plan.push(rounds, Action::Finish { range: all.clone() });
    if rank < rem {
        plan.push(rounds + 1, Action::Send { to: rank + p, range: all });
    }
    plan
}

/// Ring reduce-scatter: rank r ends with chunk r (of `chunk_range(len, n, r)`) reduced and finished.
pub fn plan_ring_reduce_scatter(rank: Rank, n: usize, len: usize) -> Plan {
    if n == 1 {
        return single_rank(len, true);
    }
    let mut plan = Plan::with_steps(n - 1);
    ring_reduce_scatter_into(&mut plan, 0, rank, n, len, n - 1);
    plan
}

/// Ring all-gather: rank r contributes chunk r; every rank ends with all chunks.
pub fn plan_ring_all_gather(rank: Rank, n: usize, len: usize) -> Plan {
    if n == 1 {
        return Plan::with_steps(1);
    }
    let mut plan = Plan::with_steps(n - 1);
    ring_all_gather_into(&mut plan, 0, rank, n, len, 0);
    plan
}

/// Binomial-tree broadcast from `root`, ⌈log2 n⌉ steps.
pub fn plan_tree_broadcast(rank: Rank, n: usize, len: usize, root: Rank) -> Plan {
    let rounds = ceil_log2(n);
    let mut plan = Plan::with_steps(rounds.max(1));
    let v = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    for k in 0..rounds {
        let bit = 1 << k;
        if v < bit && v + bit < n {
            plan.push(k, Action::Send { to: real(v + bit), range: 0..len });
        } else if v >= bit && v < 2 * bit {
            plan.push(k, Action::Recv { from: real(v - bit), range: 0..len, combine: Combine::Copy });
        }
    }
    plan
}

/// Binomial-tree reduce to `root`; only the root's buffer holds the result.
pub fn plan_tree_reduce(rank: Rank, n: usize, len: usize, root: Rank) -> Plan {
    let rounds = ceil_log2(n);
    let mut plan = Plan::with_steps(rounds.max(1));
    let v = (rank + n - root) % n;
    let real = |v: usize| (v + root) % n;
    for k in 0..rounds {
        let bit = 1 << k;
        if v % (2 * bit) == bit {
            plan.push(k, Action::Send { to: real(v - bit), range: 0..len });
        } else if v.is_multiple_of(2 * bit) && v + bit < n {
            plan.push(k, Action::Recv { from: real(v + bit), range: 0..len, combine: Combine::Reduce });
        }
    }
    if v == 0 {
        let last = plan.steps.len() - 1;
        plan.push(last, Action::Finish { range: 0..len });
    }
    plan
}

/// Dissemination barrier: in round k every rank signals rank + 2^k and waits for rank − 2^k.
pub fn plan_barrier(rank: Rank, n: usize) -> Plan {
    let rounds = ceil_log2(n);
    let mut plan = Plan::with_steps(rounds.max(1));
    for k in 0..rounds {
        let d = 1 << k;
        plan.push(k, Action::Send { to: (rank + d) % n, range: 0..0 });
        plan.push(k, Action::Recv { from: (rank + n - d) % n, range: 0..0, combine: Combine::Copy });
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_all_reduce_has_2n_minus_2_steps_and_sends_2_n_minus_1_over_n() {
        let (n, len) = (4, 400);
        let plan = plan_ring_all_reduce(1, n, len);
        assert_eq!(plan.steps.len(), 6);
        let sent: usize = plan
            .steps
            .iter()
            .flat_map(|s| &s.actions)
            .map(|a| if let Action::Send { range, .. } = a { range.len() } else { 0 })
            .sum();
        assert_eq!(sent, 2 * (n - 1) * len / n);
    }

    #[test]
    fn ceil_log2_values() {
        for (n, want) in [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4)] {
            assert_eq!(ceil_log2(n), want, "n={n}");
        }
    }
}

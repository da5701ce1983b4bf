//! Property: for random world sizes and lengths, executing every rank's plan in memory (lockstep
//! simulation) gives exactly the reference. Integer-valued inputs make f32 sums exact, so the
//! comparison is bit-exact for every op.

use proptest::prelude::*;
use troupe_cluster::collective::plan::{self, Plan};
use troupe_cluster::collective::simulate::simulate;
use troupe_cluster::collective::{chunk_range, ReduceOp};

fn inputs(n: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 201) as f32 - 100.0
                })
                .collect()
        })
        .collect()
}

fn reference(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let n = inputs.len();
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let col = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => col.sum(),
                ReduceOp::Avg => col.sum::<f32>() * (1.0 / n as f32),
                ReduceOp::Max => col.fold(f32::MIN, f32::max),
                ReduceOp::Min => col.fold(f32::MAX, f32::min),
            }
        })
        .collect()
}

fn op_strategy() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Avg), Just(ReduceOp::Max), Just(ReduceOp::Min)]
}

fn run(plans: Vec<Plan>, bufs: &mut [Vec<f32>], op: ReduceOp) {
    simulate(&plans, bufs, op).unwrap_or_else(|e| panic!("plan inconsistent: {e}"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn all_reduce_plans_reduce_to_the_reference(n in 1usize..=8, len in 0usize..200, op in op_strategy(), seed: u64, ring: bool) {
        let input = inputs(n, len, seed);
        let want = reference(&input, op);
        let mut bufs = input.clone();
        let plans = (0..n).map(|r| if ring { plan::plan_ring_all_reduce(r, n, len) } else { plan::plan_recursive_doubling_all_reduce(r, n, len) }).collect();
        run(plans, &mut bufs, op);
        for b in &bufs {
            prop_assert_eq!(b, &want);
        }
    }

    #[test]
    fn reduce_scatter_plans_leave_chunk_r_on_rank_r(n in 1usize..=8, len in 0usize..200, op in op_strategy(), seed: u64) {
        let input = inputs(n, len, seed);
        let want = reference(&input, op);
        let mut bufs = input.clone();
        run((0..n).map(|r| plan::plan_ring_reduce_scatter(r, n, len)).collect(), &mut bufs, op);
        for (r, b) in bufs.iter().enumerate() {
            let c = chunk_range(len, n, r);
            prop_assert_eq!(&b[c.clone()], &want[c]);
        }
    }

    #[test]
    fn all_gather_plans_assemble_every_chunk(n in 1usize..=8, len in 0usize..200, seed: u64) {
        let full = inputs(1, len, seed).remove(0);
        let mut bufs: Vec<Vec<f32>> = (0..n).map(|r| {
            let mut b = vec![f32::NAN; len];
            let c = chunk_range(len, n, r);
            b[c.clone()].copy_from_slice(&full[c]);
            b
        }).collect();
        run((0..n).map(|r| plan::plan_ring_all_gather(r, n, len)).collect(), &mut bufs, ReduceOp::Sum);
        for b in &bufs {
            prop_assert_eq!(b, &full);
        }
    }

    #[test]
    fn tree_broadcast_and_reduce(n in 1usize..=8, len in 0usize..50, root_pick: usize, op in op_strategy(), seed: u64) {
        let root = root_pick % n;
        let input = inputs(n, len, seed);
        let mut bufs = input.clone();
        run((0..n).map(|r| plan::plan_tree_broadcast(r, n, len, root)).collect(), &mut bufs, op);
        for b in &bufs {
            prop_assert_eq!(b, &input[root]);
        }
        let mut bufs = input.clone();
        run((0..n).map(|r| plan::plan_tree_reduce(r, n, len, root)).collect(), &mut bufs, op);
        prop_assert_eq!(&bufs[root], &reference(&input, op));
    }

    #[test]
    fn barrier_plans_are_consistent(n in 1usize..=8) {
        let mut bufs = vec![Vec::new(); n];
        run((0..n).map(|r| plan::plan_barrier(r, n)).collect(), &mut bufs, ReduceOp::Sum);
    }
}

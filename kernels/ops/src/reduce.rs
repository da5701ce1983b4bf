//! Element-wise reduction of a received chunk into an f32 accumulator, as the collectives use it.
//!
//! CPU: plain loops over slices that LLVM vectorizes (f32 and bf16 directly); f16 is widened and
//! combined 16 (AVX-512) or 8 (AVX2 + F16C) at a time in [`crate::simd`], or, portably, widened in
//! L1-sized blocks with `half`'s slice conversion (F16C when the CPU has it). Buffers of
//! [`crate::cpu_parallel::PARALLEL_MIN_ELEMS`] elements or more are split across threads.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::cpu_parallel::{chunk_elems, for_each_part};
use crate::simd::{self, Isa};

/// How two values combine in a reduction. `Avg` accumulates like `Sum`; the caller divides once with
/// [`finish_avg`] after the last contribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

/// Elements widened per block when an input type has no direct f32 path (f16).
const WIDEN_BLOCK_ELEMS: usize = 1024;

/// An element type the reduction reads; accumulation is always f32.
pub trait ReduceInput: Copy + Send + Sync {
    fn to_f32(self) -> f32;

    /// `acc[i] = op(acc[i], src[i])` on one thread.
    #[inline]
    fn reduce_block(acc: &mut [f32], src: &[Self], op: ReduceOp) {
        Self::reduce_block_with(acc, src, op, Isa::detected());
    }

    /// [`ReduceInput::reduce_block`] with the instructions of `isa`. The default reads element by
    /// element (LLVM vectorizes it); types with a faster path override it.
    #[inline]
    fn reduce_block_with(acc: &mut [f32], src: &[Self], op: ReduceOp, isa: Isa) {
        let _ = isa;
        match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(src).for_each(|(a, s)| *a += s.to_f32()),
            ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, s)| *a = nan_max(*a, s.to_f32())),
            ReduceOp::Min => acc.iter_mut().zip(src).for_each(|(a, s)| *a = nan_min(*a, s.to_f32())),
        }
    }
}

impl ReduceInput for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl ReduceInput for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        // Exact: a bf16 is the upper half of an f32.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

impl ReduceInput for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    fn reduce_block_with(acc: &mut [f32], src: &[Self], op: ReduceOp, isa: Isa) {
        if simd::reduce_f16(isa, acc, src, op) {
            return;
        }
        let mut widened = [0.0f32; WIDEN_BLOCK_ELEMS];
        for (acc, src) in acc.chunks_mut(WIDEN_BLOCK_ELEMS).zip(src.chunks(WIDEN_BLOCK_ELEMS)) {
            let widened = &mut widened[..src.len()];
            src.convert_to_f32_slice(widened);
            f32::reduce_block_with(acc, widened, op, isa);
        }
    }
}

/// `acc[i] = op(acc[i], src[i])`. Max and min propagate NaN (like torch.maximum).
///
/// # Panics
/// If the lengths differ: that is a broken plan, not a peer's fault.
pub fn reduce_into<T: ReduceInput>(acc: &mut [f32], src: &[T], op: ReduceOp) {
    reduce_into_with(Isa::detected(), acc, src, op);
}

/// [`reduce_into`] with the instructions of `isa` (tests compare every level with the portable code).
pub fn reduce_into_with<T: ReduceInput>(isa: Isa, acc: &mut [f32], src: &[T], op: ReduceOp) {
    assert_eq!(acc.len(), src.len(), "reduce_into: accumulator and source lengths differ");
    let chunk = chunk_elems(acc.len());
    for_each_part(acc.chunks_mut(chunk).zip(src.chunks(chunk)), |(acc, src)| T::reduce_block_with(acc, src, op, isa));
}

/// Divides an `Avg` accumulator by the number of contributions (multiplies by its f32 reciprocal).
pub fn finish_avg(acc: &mut [f32], contributions: usize) {
    let inv = 1.0 / contributions as f32;
    let chunk = chunk_elems(acc.len());
    for_each_part(acc.chunks_mut(chunk), |acc| acc.iter_mut().for_each(|a| *a *= inv));
}

/// The larger of two values, NaN if either is NaN. Written as one unordered compare and a select so
/// that it vectorizes (`b > a` is false when either is NaN; then `b` is taken only if it is the NaN).
#[inline(always)]
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if b > a || b.is_nan() {
        b
    } else {
        a
    }
}

/// The smaller of two values, NaN if either is NaN.
#[inline(always)]
pub(crate) fn nan_min(a: f32, b: f32) -> f32 {
    if b < a || b.is_nan() {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_parallel::PARALLEL_MIN_ELEMS;
    use proptest::prelude::*;

    /// The scalar reference: what one element of a reduction must give.
    fn reference(op: ReduceOp, a: f32, s: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + s,
            ReduceOp::Max if a.is_nan() || s.is_nan() => f32::NAN,
            ReduceOp::Min if a.is_nan() || s.is_nan() => f32::NAN,
            ReduceOp::Max => a.max(s),
            ReduceOp::Min => a.min(s),
        }
    }

    fn same(got: f32, want: f32) -> bool {
        got == want || (got.is_nan() && want.is_nan())
    }

    fn check<T: ReduceInput + std::fmt::Debug>(op: ReduceOp, acc: &[f32], src: &[T]) {
        let mut got = acc.to_vec();
        reduce_into(&mut got, src, op);
        for (i, ((g, a), s)) in got.iter().zip(acc).zip(src).enumerate() {
            let want = reference(op, *a, s.to_f32());
            assert!(same(*g, want), "{op:?} at {i}: op({a}, {s:?}) gave {g}, want {want}");
        }
    }

    const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    const EDGES: [f32; 10] =
        [0.0, -0.0, 1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-45, -1e-40, f32::MAX, f32::MIN_POSITIVE];

    #[test]
    fn ops_combine_elementwise() {
        let mut acc = vec![1.0, 2.0];
        reduce_into(&mut acc, &[0.5f32, -2.0], ReduceOp::Sum);
        assert_eq!(acc, vec![1.5, 0.0]);
        let mut acc = vec![1.0, 2.0];
        reduce_into(&mut acc, &[0.5f32, 3.0], ReduceOp::Max);
        assert_eq!(acc, vec![1.0, 3.0]);
        let mut acc = vec![1.0, 2.0];
        reduce_into(&mut acc, &[0.5f32, 3.0], ReduceOp::Min);
        assert_eq!(acc, vec![0.5, 2.0]);
    }

    #[test]
    fn nan_propagates_from_either_side_in_max_and_min() {
        for op in [ReduceOp::Max, ReduceOp::Min] {
            let mut acc = vec![f32::NAN, 1.0, f32::NAN];
            reduce_into(&mut acc, &[1.0f32, f32::NAN, f32::NAN], op);
            assert!(acc.iter().all(|x| x.is_nan()), "{op:?}: {acc:?}");
        }
    }

    #[test]
    fn every_pair_of_edge_values_matches_the_reference() {
        let acc: Vec<f32> = EDGES.iter().flat_map(|a| EDGES.iter().map(move |_| *a)).collect();
        let src: Vec<f32> = EDGES.iter().flat_map(|_| EDGES.iter().copied()).collect();
        for op in OPS {
            check(op, &acc, &src);
            check(op, &acc, &src.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>());
            check(op, &acc, &src.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>());
        }
    }

    #[test]
    fn empty_buffers_are_a_no_op() {
        let mut acc: Vec<f32> = vec![];
        reduce_into(&mut acc, &[] as &[f16], ReduceOp::Sum);
        finish_avg(&mut acc, 3);
        assert!(acc.is_empty());
    }

    #[test]
    fn avg_divides_once() {
        let mut acc = vec![1.0f32, 3.0];
        reduce_into(&mut acc, &[bf16::from_f32(3.0), bf16::from_f32(5.0)], ReduceOp::Avg);
        finish_avg(&mut acc, 2);
        assert_eq!(acc, vec![2.0, 4.0]);
    }

    #[test]
    fn large_buffers_split_across_threads_match_the_reference() {
        let len = PARALLEL_MIN_ELEMS * 2 + 1001;
        let acc: Vec<f32> = (0..len).map(|i| (i % 97) as f32 - 48.0).collect();
        let src: Vec<f32> = (0..len).map(|i| ((i * 31) % 89) as f32 * 0.25).collect();
        for op in OPS {
            check(op, &acc, &src);
            check(op, &acc, &src.iter().map(|x| f16::from_f32(*x)).collect::<Vec<_>>());
        }
        let mut avg = acc.clone();
        finish_avg(&mut avg, 4);
        assert!(avg.iter().zip(&acc).all(|(g, a)| *g == a * 0.25));
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn mismatched_lengths_are_a_broken_plan() {
        reduce_into(&mut [0.0f32; 3], &[0.0f32; 2], ReduceOp::Sum);
    }

    fn any_op() -> impl Strategy<Value = ReduceOp> {
        prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Avg), Just(ReduceOp::Max), Just(ReduceOp::Min)]
    }

    /// Any f32 bit pattern: NaNs, infinities and subnormals included.
    fn any_bits_f32() -> impl Strategy<Value = f32> {
        any::<u32>().prop_map(f32::from_bits)
    }

    /// Every instruction set gives the portable path's bits, at every length. A NaN only has to be a NaN:
    /// Rust leaves the payload of an arithmetic NaN unspecified (LLVM may swap an addition's operands).
    fn check_every_isa<T: ReduceInput>(op: ReduceOp, acc: &[f32], src: &[T]) {
        let mut want = acc.to_vec();
        reduce_into_with(Isa::portable(), &mut want, src, op);
        for isa in Isa::available() {
            let mut got = acc.to_vec();
            reduce_into_with(isa, &mut got, src, op);
            let same_bits =
                got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
            assert!(same_bits, "{op:?} on {}: differs from portable", isa.name());
        }
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits_on_edges_and_odd_lengths() {
        let acc: Vec<f32> = EDGES.iter().flat_map(|a| EDGES.iter().map(move |_| *a)).collect();
        let src: Vec<f16> = EDGES.iter().flat_map(|_| EDGES.iter().map(|x| f16::from_f32(*x))).collect();
        // Every f16 bit pattern (NaN payloads, subnormals) against an accumulator of edge values.
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let all_acc: Vec<f32> = (0..all.len()).map(|i| EDGES[i % EDGES.len()]).collect();
        for op in OPS {
            check_every_isa(op, &acc, &src);
            check_every_isa(op, &all_acc, &all);
            for len in [0, 1, 7, 8, 9, 15, 16, 17, 33] {
                check_every_isa(op, &acc[..len], &src[..len]);
            }
        }
    }

    proptest! {
        #[test]
        fn random_f16_inputs_match_portable_on_every_isa(op in any_op(), pairs in prop::collection::vec((any_bits_f32(), any::<u16>()), 0..500)) {
            let (acc, bits): (Vec<f32>, Vec<u16>) = pairs.into_iter().unzip();
            check_every_isa(op, &acc, &bits.iter().map(|b| f16::from_bits(*b)).collect::<Vec<_>>());
        }

        #[test]
        fn random_f32_inputs_match_the_reference(op in any_op(), pairs in prop::collection::vec((any_bits_f32(), any_bits_f32()), 0..3000)) {
            let (acc, src): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            check(op, &acc, &src);
        }

        #[test]
        fn random_half_inputs_match_the_reference(op in any_op(), pairs in prop::collection::vec((any_bits_f32(), any::<u16>()), 0..3000)) {
            let (acc, bits): (Vec<f32>, Vec<u16>) = pairs.into_iter().unzip();
            check(op, &acc, &bits.iter().map(|b| bf16::from_bits(*b)).collect::<Vec<_>>());
            check(op, &acc, &bits.iter().map(|b| f16::from_bits(*b)).collect::<Vec<_>>());
        }
    }
}

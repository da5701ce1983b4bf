//! Element-wise reduction of a received chunk into an f32 accumulator, as the collectives use it.

use half::{bf16, f16};

/// How two values combine in a reduction. `Avg` accumulates like `Sum`; the caller divides once with
/// [`finish_avg`] after the last contribution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
}

/// An element type the reduction reads; accumulation is always f32.
pub trait ReduceInput: Copy {
    fn to_f32(self) -> f32;
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
        bf16::to_f32(self)
    }
}

impl ReduceInput for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// `acc[i] = op(acc[i], src[i])`. Max and min propagate NaN (like torch.maximum).
///
/// # Panics
/// If the lengths differ: that is a broken plan, not a peer's fault.
pub fn reduce_into<T: ReduceInput>(acc: &mut [f32], src: &[T], op: ReduceOp) {
    assert_eq!(acc.len(), src.len(), "reduce_into: accumulator and source lengths differ");
    match op {
        ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(src).for_each(|(a, s)| *a += s.to_f32()),
        ReduceOp::Max => acc.iter_mut().zip(src).for_each(|(a, s)| *a = nan_max(*a, s.to_f32())),
        ReduceOp::Min => acc.iter_mut().zip(src).for_each(|(a, s)| *a = nan_min(*a, s.to_f32())),
    }
}

/// Divides an `Avg` accumulator by the number of contributions.
pub fn finish_avg(acc: &mut [f32], contributions: usize) {
    let inv = 1.0 / contributions as f32;
    acc.iter_mut().for_each(|a| *a *= inv);
}

#[inline(always)]
fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

#[inline(always)]
fn nan_min(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.min(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(op: ReduceOp, acc: &[f32], src: &[f32], expected: &[f32]) {
        let mut acc = acc.to_vec();
        reduce_into(&mut acc, src, op);
        for (got, want) in acc.iter().zip(expected) {
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{op:?}: {got} != {want}");
        }
    }

    #[test]
    fn ops_combine_elementwise() {
        check(ReduceOp::Sum, &[1.0, 2.0], &[0.5, -2.0], &[1.5, 0.0]);
        check(ReduceOp::Max, &[1.0, 2.0], &[0.5, 3.0], &[1.0, 3.0]);
        check(ReduceOp::Min, &[1.0, 2.0], &[0.5, 3.0], &[0.5, 2.0]);
        check(ReduceOp::Max, &[1.0], &[f32::NAN], &[f32::NAN]);
    }

    #[test]
    fn avg_divides_once() {
        let mut acc = vec![1.0f32, 3.0];
        reduce_into(&mut acc, &[bf16::from_f32(3.0), bf16::from_f32(5.0)], ReduceOp::Avg);
        finish_avg(&mut acc, 2);
        assert_eq!(acc, vec![2.0, 4.0]);
    }
}

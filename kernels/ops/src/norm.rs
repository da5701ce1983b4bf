//! Global L2 norm over several buffers (gradient clipping).
//!
//! Accuracy: squares are accumulated in **f64** (four streams of eight independent lanes per thread, then the lanes and
//! the per-thread partials are added). An f64 sum of f32 squares loses nothing that matters: the relative
//! error bound is about n·2⁻⁵³, i.e. below f32 precision for any n up to 2²⁹ elements. The result is
//! deterministic for a given thread count (the partial sums are added in a fixed order).

use crate::cpu_parallel::{chunk_elems, map_parts};
use crate::simd::{self, Isa};

/// Independent f64 accumulators per stream, so the loop vectorizes.
const LANES: usize = 8;
/// Sequential streams read at once by one thread.
const STREAMS: usize = 4;

/// `sqrt(Σ_buffers Σ_i x_i²)`, accumulated in f64. Inf if any element is ±inf, NaN if any is NaN.
pub fn l2_norm(buffers: &[&[f32]]) -> f64 {
    buffers.iter().map(|b| sum_of_squares(b)).sum::<f64>().sqrt()
}

/// `Σ x_i²` in f64.
pub fn sum_of_squares(buffer: &[f32]) -> f64 {
    sum_of_squares_with(Isa::detected(), buffer)
}

/// [`sum_of_squares`] with the instructions of `isa`: the same bits on every level (tested).
pub fn sum_of_squares_with(isa: Isa, buffer: &[f32]) -> f64 {
    let chunk = chunk_elems(buffer.len());
    map_parts(buffer.chunks(chunk), |xs| sum_of_squares_block(xs, isa)).into_iter().sum()
}

/// One thread's sum of squares. The block is read as [`STREAMS`] sequential streams at once (four
/// equal quarters, advanced together): more cache-line fetches in flight than one stream, which measured
/// ~20% more read bandwidth from DRAM on the 2-core VM of docs/benchmarks.md. Lane j of stream s sums
/// the squares of the quarter's elements at positions ≡ j (mod 8) in order — on every instruction set,
/// so the result has the same bits whichever [`crate::simd`] path ran.
fn sum_of_squares_block(xs: &[f32], isa: Isa) -> f64 {
    let quarter = xs.len() / (STREAMS * LANES) * LANES;
    let (streams, tail) = xs.split_at(quarter * STREAMS);
    let mut quarters = streams.chunks_exact(quarter.max(1));
    let quarters: [&[f32]; STREAMS] = [(); STREAMS].map(|_| quarters.next().unwrap_or(&[]));
    let lanes = simd::sum_of_squares_lanes(isa, quarters).unwrap_or_else(|| portable_lanes(quarters));
    let tail_sum: f64 = tail.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
    lanes.iter().flatten().sum::<f64>() + tail_sum
}

/// The portable loop behind [`sum_of_squares_block`]: four streams of [`LANES`] f64 lanes that LLVM
/// vectorizes.
fn portable_lanes(quarters: [&[f32]; STREAMS]) -> [[f64; LANES]; STREAMS] {
    let mut lanes = [[0.0f64; LANES]; STREAMS];
    let [q0, q1, q2, q3] = quarters;
    let blocks =
        q0.chunks_exact(LANES).zip(q1.chunks_exact(LANES)).zip(q2.chunks_exact(LANES)).zip(q3.chunks_exact(LANES));
    for (((b0, b1), b2), b3) in blocks {
        for (stream, block) in lanes.iter_mut().zip([b0, b1, b2, b3]) {
            for (lane, x) in stream.iter_mut().zip(block) {
                let x = f64::from(*x);
                *lane += x * x;
            }
        }
    }
    lanes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_parallel::PARALLEL_MIN_ELEMS;
    use proptest::prelude::*;

    /// The plain reference: one f64 accumulator, element by element.
    fn reference(buffers: &[&[f32]]) -> f64 {
        buffers.iter().flat_map(|b| b.iter()).map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>().sqrt()
    }

    fn check(buffers: &[&[f32]]) {
        let (got, want) = (l2_norm(buffers), reference(buffers));
        let close = got == want || (got.is_nan() && want.is_nan()) || ((got - want).abs() <= 1e-12 * want);
        assert!(close, "l2_norm {got} vs reference {want}");
    }

    #[test]
    fn edge_values() {
        check(&[]);
        check(&[&[], &[]]);
        check(&[&[3.0], &[4.0]]);
        check(&[&[1e-45, -1e-40, f32::MIN_POSITIVE]]);
        check(&[&[f32::MAX, f32::MAX]]); // overflows f32 but not f64
        assert_eq!(l2_norm(&[&[3.0, 4.0]]), 5.0);
        assert!(l2_norm(&[&[1.0], &[f32::INFINITY]]).is_infinite());
        assert!(l2_norm(&[&[1.0, f32::NAN], &[f32::INFINITY]]).is_nan());
    }

    #[test]
    fn large_buffers_split_across_threads_match() {
        let a: Vec<f32> = (0..PARALLEL_MIN_ELEMS * 2 + 7).map(|i| (i as f32 * 0.3).sin()).collect();
        let b: Vec<f32> = (0..1001).map(|i| i as f32).collect();
        check(&[&a, &b, &[]]);
    }

    /// Every instruction set gives the portable path's bits (a NaN only has to be a NaN: Rust leaves
    /// the payload of an arithmetic NaN unspecified).
    fn check_every_isa(xs: &[f32]) {
        let want = sum_of_squares_with(Isa::portable(), xs);
        for isa in Isa::available() {
            let got = sum_of_squares_with(isa, xs);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{}: {got} vs portable {want}",
                isa.name()
            );
        }
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits() {
        let xs: Vec<f32> = (0..PARALLEL_MIN_ELEMS * 2 + 77).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        for len in [0, 1, 7, 31, 32, 33, 64, 100, 1000, 4099, xs.len()] {
            check_every_isa(&xs[..len]);
        }
        check_every_isa(&[f32::MAX, f32::MIN_POSITIVE, 1e-45, -0.0, f32::INFINITY, 3.0].repeat(40));
        check_every_isa(&[1.0, f32::NAN].repeat(40));
    }

    proptest! {
        #[test]
        fn random_buffers_match_portable_on_every_isa(bits in prop::collection::vec(any::<u32>(), 0..1000)) {
            check_every_isa(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>());
        }

        #[test]
        fn random_buffers_match_the_reference(bufs in prop::collection::vec(prop::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..300), 0..5)) {
            let views: Vec<&[f32]> = bufs.iter().map(|b| b.as_slice()).collect();
            check(&views);
        }
    }
}

//! Casts between f32 and the 16-bit float formats, rounding to nearest, ties to even.
//!
//! bf16 is done here with integer arithmetic that LLVM vectorizes; f16 goes through `half`'s slice
//! conversions, which use the F16C instructions when the CPU has them (detected at run time) and a
//! software path otherwise. Both agree bit for bit with `half::bf16::from_f32` / `half::f16::from_f32`
//! (tested), and NaNs stay NaN (quieted).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::cpu_parallel::{chunk_elems, for_each_part};

/// Elements per unrolled block: fixed-size inner loops over `chunks_exact` are what LLVM turns into
/// vector code here (measured in cache: ~3× a generic element-wise map for f32 → bf16).
const UNROLL_ELEMS: usize = 16;

fn f32_to_bf16_block(src: &[f32], dst: &mut [bf16]) {
    let mut dst_blocks = dst.chunks_exact_mut(UNROLL_ELEMS);
    let mut src_blocks = src.chunks_exact(UNROLL_ELEMS);
    for (d, s) in (&mut dst_blocks).zip(&mut src_blocks) {
        for i in 0..UNROLL_ELEMS {
            d[i] = bf16_from_f32_rne(s[i]);
        }
    }
    for (d, s) in dst_blocks.into_remainder().iter_mut().zip(src_blocks.remainder()) {
        *d = bf16_from_f32_rne(*s);
    }
}

fn bf16_to_f32_block(src: &[bf16], dst: &mut [f32]) {
    let mut dst_blocks = dst.chunks_exact_mut(UNROLL_ELEMS);
    let mut src_blocks = src.chunks_exact(UNROLL_ELEMS);
    for (d, s) in (&mut dst_blocks).zip(&mut src_blocks) {
        for i in 0..UNROLL_ELEMS {
            d[i] = bf16_to_f32_exact(s[i]);
        }
    }
    for (d, s) in dst_blocks.into_remainder().iter_mut().zip(src_blocks.remainder()) {
        *d = bf16_to_f32_exact(*s);
    }
}

/// The bf16 nearest to `x`, ties to even; NaN becomes a quiet NaN with the same sign and top payload.
#[inline(always)]
pub fn bf16_from_f32_rne(x: f32) -> bf16 {
    let bits = x.to_bits();
    let lsb_of_result = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb_of_result) >> 16;
    let quiet_nan = (bits >> 16) | 0x0040;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let result = if is_nan { quiet_nan } else { rounded };
    bf16::from_bits(result as u16)
}

/// The f32 equal to `x` (every bf16 is exactly an f32).
#[inline(always)]
pub fn bf16_to_f32_exact(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Runs a one-thread cast `block` over the whole buffer, split across threads where it pays.
fn cast_split<S: Sync, D: Send>(op: &str, src: &[S], dst: &mut [D], block: impl Fn(&[S], &mut [D]) + Sync) {
    assert_eq!(src.len(), dst.len(), "{op}: source and destination lengths differ");
    let chunk = chunk_elems(src.len());
    for_each_part(src.chunks(chunk).zip(dst.chunks_mut(chunk)), |(src, dst)| block(src, dst));
}

/// `dst[i] = bf16(src[i])`, round to nearest even.
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
    cast_split("f32_to_bf16", src, dst, f32_to_bf16_block);
}

/// `dst[i] = f32(src[i])`, exact.
///
/// # Panics
/// If the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    cast_split("bf16_to_f32", src, dst, bf16_to_f32_block);
}

/// `dst[i] = f16(src[i])`, round to nearest even (overflow gives ±inf, tiny values f16 subnormals).
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    cast_split("f32_to_f16", src, dst, |src, dst| dst.convert_from_f32_slice(src));
}

/// `dst[i] = f32(src[i])`, exact.
///
/// # Panics
/// If the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    cast_split("f16_to_f32", src, dst, |src, dst| src.convert_to_f32_slice(dst));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_parallel::PARALLEL_MIN_ELEMS;
    use proptest::prelude::*;

    /// Every 65,537th f32 bit pattern (65,537 patterns, all exponents, both signs) plus the edges.
    fn sampled_f32_patterns() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..=u32::MAX / 65_537).map(|i| f32::from_bits(i * 65_537)).collect();
        xs.extend([
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            65504.0,
            65520.0,
            6.0e-8,
            2.9e-8,
            1.0 + f32::EPSILON * 0.5,
            f32::from_bits(0x3f80_8000), // exactly halfway between two bf16: ties to even (down)
            f32::from_bits(0x3f81_8000), // halfway, odd below: ties to even (up)
            f32::from_bits(0x7f7f_ffff), // rounds up to +inf in bf16
        ]);
        xs
    }

    fn same_bits_or_both_nan_bf16(got: bf16, want: bf16) -> bool {
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
    }

    fn check_all(xs: &[f32]) {
        let mut b = vec![bf16::ZERO; xs.len()];
        f32_to_bf16(xs, &mut b);
        let mut h = vec![f16::ZERO; xs.len()];
        f32_to_f16(xs, &mut h);
        let mut back_b = vec![0.0f32; xs.len()];
        bf16_to_f32(&b, &mut back_b);
        let mut back_h = vec![0.0f32; xs.len()];
        f16_to_f32(&h, &mut back_h);
        for (i, x) in xs.iter().enumerate() {
            assert!(same_bits_or_both_nan_bf16(b[i], bf16::from_f32(*x)), "bf16({x:e}) = {:#06x}", b[i].to_bits());
            assert!(b[i].is_nan() == x.is_nan());
            let want_h = f16::from_f32(*x);
            assert!(h[i].to_bits() == want_h.to_bits() || (h[i].is_nan() && want_h.is_nan()), "f16({x:e})");
            assert!(back_b[i].to_bits() == b[i].to_f32().to_bits() || back_b[i].is_nan());
            assert!(back_h[i].to_bits() == h[i].to_f32().to_bits() || back_h[i].is_nan());
        }
    }

    #[test]
    fn sampled_bit_patterns_match_half() {
        check_all(&sampled_f32_patterns());
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: even mantissa is 1.0.
        assert_eq!(bf16_from_f32_rne(1.0 + 2f32.powi(-8)).to_f32(), 1.0);
        // 1.0078125 + 2^-8 is halfway between odd 1.0078125 and even 1.015625: rounds up.
        assert_eq!(bf16_from_f32_rne(1.0078125 + 2f32.powi(-8)).to_f32(), 1.015625);
        assert_eq!(bf16_from_f32_rne(f32::MAX).to_f32(), f32::INFINITY);
    }

    #[test]
    fn every_bf16_and_f16_widens_exactly() {
        let bits: Vec<u16> = (0..=u16::MAX).collect();
        let b: Vec<bf16> = bits.iter().map(|x| bf16::from_bits(*x)).collect();
        let h: Vec<f16> = bits.iter().map(|x| f16::from_bits(*x)).collect();
        let mut wide = vec![0.0f32; bits.len()];
        bf16_to_f32(&b, &mut wide);
        assert!(wide.iter().zip(&b).all(|(w, x)| w.to_bits() == x.to_f32().to_bits() || (w.is_nan() && x.is_nan())));
        f16_to_f32(&h, &mut wide);
        assert!(wide.iter().zip(&h).all(|(w, x)| w.to_bits() == x.to_f32().to_bits() || (w.is_nan() && x.is_nan())));
    }

    #[test]
    fn large_buffers_split_across_threads_round_the_same() {
        let xs: Vec<f32> = (0..PARALLEL_MIN_ELEMS * 2 + 3).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        check_all(&xs);
    }

    #[test]
    fn empty_buffers_are_a_no_op() {
        check_all(&[]);
    }

    proptest! {
        #[test]
        fn random_bit_patterns_match_half(bits in prop::collection::vec(any::<u32>(), 0..2000)) {
            check_all(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>());
        }
    }
}

//! Casts between f32 and the 16-bit float formats, rounding to nearest, ties to even.
//!
//! On x86-64 with AVX2 or AVX-512 the casts run in [`crate::simd`] (16 elements per instruction,
//! non-temporal stores for outputs of [`NON_TEMPORAL_MIN_BYTES`] or more). The portable path, kept as
//! the fallback and as the reference the SIMD path is tested against bit for bit: bf16 with integer
//! arithmetic that LLVM vectorizes, f16 through `half`'s slice conversions (F16C when the CPU has it,
//! software otherwise). Both agree bit for bit with `half::bf16::from_f32` / `half::f16::from_f32`
//! (tested), and NaNs stay NaN (quieted).

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::cpu_parallel::{chunk_elems, for_each_part};
use crate::simd::{self, Isa, Narrow};

/// Cast outputs at least this large are written with non-temporal stores (around the cache instead of
/// through it): no read of each destination line before it is written, and the caches keep what they
/// held. Below it, ordinary stores: a small output is usually read again soon (a collective sends it).
pub const NON_TEMPORAL_MIN_BYTES: usize = 8 << 20;

fn streaming<D>(dst: &[D]) -> bool {
    std::mem::size_of_val(dst) >= NON_TEMPORAL_MIN_BYTES
}

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
    f32_to_bf16_with(Isa::detected(), src, dst);
}

/// [`f32_to_bf16`] with the instructions of `isa` (tests compare every level with the portable code).
pub fn f32_to_bf16_with(isa: Isa, src: &[f32], dst: &mut [bf16]) {
    let streaming = streaming(dst);
    cast_split("f32_to_bf16", src, dst, |src, dst| {
        if !simd::narrow(isa, Narrow::Bf16, src, dst.reinterpret_cast_mut(), streaming) {
            f32_to_bf16_block(src, dst);
        }
    });
}

/// `dst[i] = f32(src[i])`, exact.
///
/// # Panics
/// If the lengths differ.
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    bf16_to_f32_with(Isa::detected(), src, dst);
}

/// [`bf16_to_f32`] with the instructions of `isa`.
pub fn bf16_to_f32_with(isa: Isa, src: &[bf16], dst: &mut [f32]) {
    let streaming = streaming(dst);
    cast_split("bf16_to_f32", src, dst, |src, dst| {
        if !simd::widen(isa, Narrow::Bf16, src.reinterpret_cast(), dst, streaming) {
            bf16_to_f32_block(src, dst);
        }
    });
}

/// `dst[i] = f16(src[i])`, round to nearest even (overflow gives ±inf, tiny values f16 subnormals).
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    f32_to_f16_with(Isa::detected(), src, dst);
}

/// [`f32_to_f16`] with the instructions of `isa`.
pub fn f32_to_f16_with(isa: Isa, src: &[f32], dst: &mut [f16]) {
    let streaming = streaming(dst);
    cast_split("f32_to_f16", src, dst, |src, dst| {
        if !simd::narrow(isa, Narrow::F16, src, dst.reinterpret_cast_mut(), streaming) {
            dst.convert_from_f32_slice(src);
        }
    });
}

/// `dst[i] = f32(src[i])`, exact.
///
/// # Panics
/// If the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    f16_to_f32_with(Isa::detected(), src, dst);
}

/// [`f16_to_f32`] with the instructions of `isa`.
pub fn f16_to_f32_with(isa: Isa, src: &[f16], dst: &mut [f32]) {
    let streaming = streaming(dst);
    cast_split("f16_to_f32", src, dst, |src, dst| {
        if !simd::widen(isa, Narrow::F16, src.reinterpret_cast(), dst, streaming) {
            src.convert_to_f32_slice(dst);
        }
    });
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

    /// Every instruction set's casts give the portable path's bits, for `xs` and for views of it that
    /// start at every offset within a cache line (heads before aligned stores), written to destinations
    /// at as many offsets, and ending anywhere (tails).
    fn check_every_isa_matches_portable(xs: &[f32]) {
        let portable = Isa::portable();
        let narrowed_bf16: Vec<bf16> = xs.iter().map(|x| bf16_from_f32_rne(*x)).collect();
        let narrowed_f16: Vec<f16> = xs.iter().map(|x| f16::from_f32(*x)).collect();
        for isa in Isa::available() {
            for start in (0..17.min(xs.len())).chain([xs.len()]) {
                let xs = &xs[start..];
                let (b, h) = (&narrowed_bf16[start..], &narrowed_f16[start..]);
                let run = |f: &dyn Fn(Isa, &mut Vec<u32>)| {
                    let (mut got, mut want) = (Vec::new(), Vec::new());
                    f(isa, &mut got);
                    f(portable, &mut want);
                    assert!(got == want, "{}: differs from portable at offset {start}", isa.name());
                };
                run(&|isa, out| {
                    let mut d = vec![bf16::ZERO; xs.len() + start];
                    f32_to_bf16_with(isa, xs, &mut d[start..]);
                    out.extend(d[start..].iter().map(|x| u32::from(x.to_bits())));
                });
                run(&|isa, out| {
                    let mut d = vec![f16::ZERO; xs.len() + start];
                    f32_to_f16_with(isa, xs, &mut d[start..]);
                    out.extend(d[start..].iter().map(|x| u32::from(x.to_bits())));
                });
                run(&|isa, out| {
                    let mut d = vec![0.0f32; b.len() + start];
                    bf16_to_f32_with(isa, b, &mut d[start..]);
                    out.extend(d[start..].iter().map(|x| x.to_bits()));
                });
                run(&|isa, out| {
                    let mut d = vec![0.0f32; h.len() + start];
                    f16_to_f32_with(isa, h, &mut d[start..]);
                    out.extend(d[start..].iter().map(|x| x.to_bits()));
                });
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits_on_edge_patterns() {
        println!("instruction sets: {:?}", Isa::available().iter().map(|i| i.name()).collect::<Vec<_>>());
        check_every_isa_matches_portable(&sampled_f32_patterns());
        // Every 16-bit pattern widened (NaN payloads, subnormals, both infinities), as f32 bits whose top
        // half is the pattern: narrowing those is exact, so this also covers every bf16 result.
        let all: Vec<f32> = (0..=u16::MAX).map(|b| f32::from_bits(u32::from(b) << 16)).collect();
        check_every_isa_matches_portable(&all);
        // f16 edges: every f32 near an f16 rounding boundary (ties, subnormal and overflow thresholds).
        let near_f16: Vec<f32> = (0..=u16::MAX)
            .flat_map(|b| {
                let x = f16::from_bits(b).to_f32().to_bits();
                [x.wrapping_sub(1), x, x.wrapping_add(1), x.wrapping_add(1 << 12), x.wrapping_add(0xfff)]
            })
            .map(f32::from_bits)
            .collect();
        check_every_isa_matches_portable(&near_f16);
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits_with_streaming_stores() {
        // Outputs of NON_TEMPORAL_MIN_BYTES or more take the non-temporal path, here split across threads.
        let len = NON_TEMPORAL_MIN_BYTES / 2 + 77;
        let xs: Vec<f32> = (0..len as u32).map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761))).collect();
        check_every_isa_matches_portable(&xs);
    }

    #[test]
    fn odd_lengths_and_length_zero_match_portable() {
        let xs = sampled_f32_patterns();
        for len in [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65] {
            check_every_isa_matches_portable(&xs[..len]);
        }
    }

    proptest! {
        #[test]
        fn random_bit_patterns_match_portable_on_every_isa(bits in prop::collection::vec(any::<u32>(), 0..300)) {
            check_every_isa_matches_portable(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>());
        }

        #[test]
        fn random_bit_patterns_match_half(bits in prop::collection::vec(any::<u32>(), 0..2000)) {
            check_all(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>());
        }
    }
}

//! Explicit SIMD for the CPU kernels: AVX-512 and AVX2 (with F16C and FMA) through `std::arch`, chosen
//! once per process at run time with `is_x86_feature_detected!`. Every kernel keeps its portable code as
//! the fallback, and the tests hold each SIMD path to that fallback bit for bit (casts: NaN payloads,
//! infinities, subnormals and ties included; the L2 norm: the same lanes summed in the same order).
//!
//! What each path buys, measured on the machine of docs/benchmarks.md: the casts and the f16 reduction
//! do 16 elements per instruction instead of what LLVM makes of the portable loop at the x86-64
//! baseline (SSE2: 4, and `half`'s F16C calls 4 at a time); large cast outputs are written with
//! non-temporal stores, which skip the read of each destination line that an ordinary store does
//! first (write-allocate). The L2 norm widens 8 f32 to f64 per instruction and adds with FMA (exact:
//! the square of an f32 fits an f64, so `fma(x, x, acc)` rounds once, like `acc + x * x`). XXH3's stripe
//! loop (the checksum) holds its 8 lanes in one AVX-512 register or two AVX2 ones and prefetches 4 and
//! 16 KiB ahead: one sequential read stream, which the hardware alone does not keep busy on this VM.
//!
//! `TROUPE_SIMD=portable|avx2|avx512` caps the instruction set (never raises it above what the CPU has),
//! to compare paths or rule SIMD out.
//!
//! Invariant: this module and [`crate::cuda`] are the only places in the crate with `unsafe`. Here it
//! is of four kinds, each with its invariant at the block: calling a `#[target_feature]` function
//! (sound because an [`Isa`] other than portable is only ever made by run-time detection), unaligned
//! loads and stores at pointers one block driver (`x86::blocks`) keeps inside the slices or of whole
//! fixed-size arrays (XXH3's lanes, stripes and secret), non-temporal stores to addresses the block
//! driver aligns with a scalar head, and prefetches (hints that never fault) of lines inside a slice.

use std::sync::OnceLock;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::checksum::xxh3::{Lanes, STRIPES_PER_BLOCK, STRIPE_LEN};
use crate::reduce::ReduceOp;

/// Which instructions this process may use. Only detection makes a value other than [`Isa::portable`],
/// so holding one is proof that the CPU has the instructions it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Isa(Level);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Level {
    Portable,
    /// AVX2 with F16C and FMA.
    Avx2,
    /// AVX-512F (which implies AVX2, F16C and FMA).
    Avx512,
}

impl Isa {
    /// The portable code only.
    pub fn portable() -> Self {
        Isa(Level::Portable)
    }

    /// The best level this CPU has, capped by `TROUPE_SIMD`; detected once per process.
    pub fn detected() -> Self {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = Self::available().into_iter().max().unwrap_or_else(Self::portable);
            match std::env::var("TROUPE_SIMD").as_deref() {
                Ok("portable") => Self::portable(),
                Ok("avx2") => best.min(Isa(Level::Avx2)),
                _ => best,
            }
        })
    }

    /// Every level this CPU can run, portable first (the tests compare each with the portable code).
    pub fn available() -> Vec<Self> {
        let mut levels = vec![Self::portable()];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") && is_x86_feature_detected!("fma") {
                levels.push(Isa(Level::Avx2));
            }
            if is_x86_feature_detected!("avx512f") {
                levels.push(Isa(Level::Avx512));
            }
        }
        levels
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }
}

/// The f32 → 16-bit casts and widenings this module has SIMD paths for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Narrow {
    Bf16,
    F16,
}

/// `dst[i] = bf16(src[i])` or `f16(src[i])`, ties to even, with non-temporal stores when `streaming`.
/// Returns false (touching nothing) when `isa` is portable: the caller runs its portable code.
pub(crate) fn narrow(isa: Isa, to: Narrow, src: &[f32], dst: &mut [u16], streaming: bool) -> bool {
    assert_eq!(src.len(), dst.len());
    match isa.0 {
        Level::Portable => false,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an Isa of this level exists only if detection found AVX-512F on this CPU.
        Level::Avx512 => unsafe { x86::narrow_avx512(to, src, dst, streaming) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an Isa of this level exists only if detection found AVX2, F16C and FMA.
        Level::Avx2 => unsafe { x86::narrow_avx2(to, src, dst, streaming) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// `dst[i] = f32(src[i])` for bf16 or f16 bit patterns, exact (a NaN is quieted, as F16C does).
/// Returns false when `isa` is portable.
pub(crate) fn widen(isa: Isa, from: Narrow, src: &[u16], dst: &mut [f32], streaming: bool) -> bool {
    assert_eq!(src.len(), dst.len());
    match isa.0 {
        Level::Portable => false,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx512 => unsafe { x86::widen_avx512(from, src, dst, streaming) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx2 => unsafe { x86::widen_avx2(from, src, dst, streaming) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// `acc[i] = op(acc[i], f32(src[i]))` for f16 `src`, with [`crate::reduce_into`]'s semantics (max/min
/// propagate NaN). Returns false when `isa` is portable.
pub(crate) fn reduce_f16(isa: Isa, acc: &mut [f32], src: &[f16], op: ReduceOp) -> bool {
    assert_eq!(acc.len(), src.len());
    let src: &[u16] = src.reinterpret_cast();
    match isa.0 {
        Level::Portable => false,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx512 => unsafe { x86::reduce_f16_avx512(acc, src, op) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx2 => unsafe { x86::reduce_f16_avx2(acc, src, op) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// Four equal-length streams (each a multiple of 8 elements long), squares accumulated in f64 into 8
/// lanes per stream: lane j of stream s sums `x²` over the stream's elements at positions ≡ j (mod 8), in
/// order. `None` when `isa` is portable.
pub(crate) fn sum_of_squares_lanes(isa: Isa, streams: [&[f32]; 4]) -> Option<[[f64; 8]; 4]> {
    assert!(streams.iter().all(|s| s.len() == streams[0].len() && s.len() % 8 == 0));
    match isa.0 {
        Level::Portable => None,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx512 => Some(unsafe { x86::sum_of_squares_avx512(streams) }),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx2 => Some(unsafe { x86::sum_of_squares_avx2(streams) }),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// XXH3's stripe loop ([`crate::checksum`]): accumulates every 64-byte stripe of `stripes` into
/// `lanes`, scrambling after each block's 16th, as [`Lanes::consume_portable`] does. Returns false
/// (touching nothing) when `isa` is portable.
pub(crate) fn xxh3_consume(isa: Isa, lanes: &mut Lanes, stripes: &[u8]) -> bool {
    assert!(stripes.len().is_multiple_of(STRIPE_LEN) && lanes.stripes_in_block < STRIPES_PER_BLOCK);
    let (acc, in_block) = (&mut lanes.acc, lanes.stripes_in_block);
    lanes.stripes_in_block = match isa.0 {
        Level::Portable => return false,
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx512 => unsafe { x86::xxh3_consume_avx512(acc, stripes, in_block) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in `narrow`.
        Level::Avx2 => unsafe { x86::xxh3_consume_avx2(acc, stripes, in_block) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => return false,
    };
    true
}

/// One element of each conversion, for heads and tails: the same values as the vector paths (tested).
fn narrow_one(to: Narrow, x: f32) -> u16 {
    match to {
        Narrow::Bf16 => crate::cast::bf16_from_f32_rne(x).to_bits(),
        Narrow::F16 => f16::from_f32(x).to_bits(),
    }
}

fn widen_one(from: Narrow, x: u16) -> f32 {
    match from {
        Narrow::Bf16 => crate::cast::bf16_to_f32_exact(bf16::from_bits(x)),
        Narrow::F16 => f16::from_bits(x).to_f32(),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{narrow_one, widen_one, Narrow};
    use crate::checksum::xxh3::{PRIME32_1, SECRET, SECRET_SCRAMBLE_START, STRIPES_PER_BLOCK, STRIPE_LEN};
    use crate::reduce::{nan_max, nan_min, ReduceOp};

    /// Runs an element-wise kernel over `src` and `dst` (equal lengths): `block` on `BLOCK` elements at
    /// a time (given pointers to the first of them in each slice), `one` on single elements before the
    /// first block and after the last. With `streaming`, the singles go first until `dst` is 64-byte
    /// aligned, so every block's stores are aligned as non-temporal stores must be, and the stores are
    /// fenced at the end. Inlined into each `#[target_feature]` caller, so `block` compiles with its
    /// instructions.
    #[inline(always)]
    fn blocks<S: Copy, D, const BLOCK: usize>(
        src: &[S],
        dst: &mut [D],
        streaming: bool,
        one: impl Fn(S, &mut D),
        mut block: impl FnMut(*const S, *mut D),
    ) {
        let n = src.len().min(dst.len());
        let head = if streaming { dst.as_ptr().align_offset(64).min(n) } else { 0 };
        let body_end = head + (n - head) / BLOCK * BLOCK;
        for i in (0..head).chain(body_end..n) {
            one(src[i], &mut dst[i]);
        }
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        for i in (head..body_end).step_by(BLOCK) {
            // SAFETY: i + BLOCK <= body_end <= n, so both pointers address BLOCK elements inside their
            // slices: the only ones `block` touches.
            block(unsafe { s.add(i) }, unsafe { d.add(i) });
        }
        if streaming {
            // Non-temporal stores are weakly ordered: make them visible before the caller's next write
            // or the thread's join publishes the buffer.
            // SAFETY: SSE (which has sfence) is part of the x86-64 baseline.
            unsafe { _mm_sfence() };
        }
    }

    /// bf16 bits of 16 f32 (ties to even; a NaN keeps its sign and top payload and is quieted).
    #[target_feature(enable = "avx512f")]
    fn bf16x16(x: __m512i) -> __m256i {
        let upper = _mm512_srli_epi32::<16>(x);
        let lsb = _mm512_and_si512(upper, _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb));
        let quiet = _mm512_or_si512(upper, _mm512_set1_epi32(0x40));
        let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7fff_ffff));
        let is_nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet))
    }

    /// Like [`bf16x16`] for 8 f32, the result in the low 16 bits of each 32-bit lane.
    #[target_feature(enable = "avx2")]
    fn bf16x8_in_u32(x: __m256i) -> __m256i {
        let upper = _mm256_srli_epi32::<16>(x);
        let lsb = _mm256_and_si256(upper, _mm256_set1_epi32(1));
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb));
        let quiet = _mm256_or_si256(upper, _mm256_set1_epi32(0x40));
        // Both sides are non-negative as i32, so the signed compare orders them as unsigned.
        let magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7fff_ffff));
        let is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
        _mm256_blendv_epi8(rounded, quiet, is_nan)
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn narrow_avx512(to: Narrow, src: &[f32], dst: &mut [u16], streaming: bool) -> bool {
        let one = |x, out: &mut u16| *out = narrow_one(to, x);
        blocks::<f32, u16, 16>(src, dst, streaming, one, |s, d| {
            // SAFETY: `blocks` hands 16 elements of each; a streaming store's address is 32-byte
            // aligned (dst's blocks start 64-byte aligned and advance 32 bytes).
            unsafe {
                let x = _mm512_loadu_si512(s.cast());
                let bits = match to {
                    Narrow::Bf16 => bf16x16(x),
                    Narrow::F16 => {
                        _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_castsi512_ps(x))
                    }
                };
                if streaming {
                    _mm256_stream_si256(d.cast(), bits);
                } else {
                    _mm256_storeu_si256(d.cast(), bits);
                }
            }
        });
        true
    }

    /// # Safety
    /// The CPU must have AVX2, F16C and FMA.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn narrow_avx2(to: Narrow, src: &[f32], dst: &mut [u16], streaming: bool) -> bool {
        let one = |x, out: &mut u16| *out = narrow_one(to, x);
        blocks::<f32, u16, 16>(src, dst, streaming, one, |s, d| {
            // SAFETY: as in `narrow_avx512`: 16 elements of each, streaming stores 32-byte aligned.
            unsafe {
                let bits = match to {
                    Narrow::Bf16 => {
                        let lo = bf16x8_in_u32(_mm256_loadu_si256(s.cast()));
                        let hi = bf16x8_in_u32(_mm256_loadu_si256(s.add(8).cast()));
                        // packus interleaves 128-bit halves; the permute puts them back in order.
                        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(lo, hi))
                    }
                    Narrow::F16 => {
                        let lo = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s));
                        let hi = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.add(8)));
                        _mm256_set_m128i(hi, lo)
                    }
                };
                if streaming {
                    _mm256_stream_si256(d.cast(), bits);
                } else {
                    _mm256_storeu_si256(d.cast(), bits);
                }
            }
        });
        true
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_avx512(from: Narrow, src: &[u16], dst: &mut [f32], streaming: bool) -> bool {
        let one = |x, out: &mut f32| *out = widen_one(from, x);
        blocks::<u16, f32, 16>(src, dst, streaming, one, |s, d| {
            // SAFETY: 16 elements of each; a streaming store's address is 64-byte aligned (dst's blocks
            // start aligned and advance 64 bytes).
            unsafe {
                let h = _mm256_loadu_si256(s.cast());
                let wide = match from {
                    Narrow::Bf16 => _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)),
                    Narrow::F16 => _mm512_castps_si512(_mm512_cvtph_ps(h)),
                };
                if streaming {
                    _mm512_stream_si512(d.cast(), wide);
                } else {
                    _mm512_storeu_si512(d.cast(), wide);
                }
            }
        });
        true
    }

    /// # Safety
    /// The CPU must have AVX2, F16C and FMA.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn widen_avx2(from: Narrow, src: &[u16], dst: &mut [f32], streaming: bool) -> bool {
        let one = |x, out: &mut f32| *out = widen_one(from, x);
        blocks::<u16, f32, 8>(src, dst, streaming, one, |s, d| {
            // SAFETY: 8 elements of each; a streaming store's address is 32-byte aligned (dst's blocks
            // start 64-byte aligned and advance 32 bytes).
            unsafe {
                let h = _mm_loadu_si128(s.cast());
                let wide = match from {
                    Narrow::Bf16 => _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)),
                    Narrow::F16 => _mm256_castps_si256(_mm256_cvtph_ps(h)),
                };
                if streaming {
                    _mm256_stream_si256(d.cast(), wide);
                } else {
                    _mm256_storeu_si256(d.cast(), wide);
                }
            }
        });
        true
    }

    fn reduce_one(op: ReduceOp, a: f32, s: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + s,
            ReduceOp::Max => nan_max(a, s),
            ReduceOp::Min => nan_min(a, s),
        }
    }

    /// # Safety
    /// The CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn reduce_f16_avx512(acc: &mut [f32], src: &[u16], op: ReduceOp) -> bool {
        let one = |x, a: &mut f32| *a = reduce_one(op, *a, widen_one(Narrow::F16, x));
        blocks::<u16, f32, 16>(src, acc, false, one, |s, a| {
            // SAFETY: 16 elements of each.
            unsafe {
                let x = _mm512_loadu_ps(a);
                let y = _mm512_cvtph_ps(_mm256_loadu_si256(s.cast()));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => _mm512_add_ps(x, y),
                    // nan_max: take y where y > x or y is NaN (x NaN and y not: x stays, NaN).
                    ReduceOp::Max => {
                        let take = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(y, x) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
                        _mm512_mask_blend_ps(take, x, y)
                    }
                    ReduceOp::Min => {
                        let take = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(y, x) | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(y, y);
                        _mm512_mask_blend_ps(take, x, y)
                    }
                };
                _mm512_storeu_ps(a, r);
            }
        });
        true
    }

    /// # Safety
    /// The CPU must have AVX2, F16C and FMA.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn reduce_f16_avx2(acc: &mut [f32], src: &[u16], op: ReduceOp) -> bool {
        let one = |x, a: &mut f32| *a = reduce_one(op, *a, widen_one(Narrow::F16, x));
        blocks::<u16, f32, 8>(src, acc, false, one, |s, a| {
            // SAFETY: 8 elements of each.
            unsafe {
                let x = _mm256_loadu_ps(a);
                let y = _mm256_cvtph_ps(_mm_loadu_si128(s.cast()));
                let r = match op {
                    ReduceOp::Sum | ReduceOp::Avg => _mm256_add_ps(x, y),
                    ReduceOp::Max => {
                        let take = _mm256_or_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(y, x), _mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
                        _mm256_blendv_ps(x, y, take)
                    }
                    ReduceOp::Min => {
                        let take = _mm256_or_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(y, x), _mm256_cmp_ps::<_CMP_UNORD_Q>(y, y));
                        _mm256_blendv_ps(x, y, take)
                    }
                };
                _mm256_storeu_ps(a, r);
            }
        });
        true
    }

    /// # Safety
    /// The CPU must have AVX-512F. Every stream has the same length, a multiple of 8.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn sum_of_squares_avx512(streams: [&[f32]; 4]) -> [[f64; 8]; 4] {
        let len = streams[0].len();
        let mut acc = [_mm512_setzero_pd(); 4];
        let mut i = 0;
        while i < len {
            for (a, stream) in acc.iter_mut().zip(&streams) {
                // SAFETY: i + 8 <= len (len is a multiple of 8), the length of every stream.
                let x = _mm512_cvtps_pd(unsafe { _mm256_loadu_ps(stream.as_ptr().add(i)) });
                *a = _mm512_fmadd_pd(x, x, *a);
            }
            i += 8;
        }
        let mut lanes = [[0.0f64; 8]; 4];
        for (out, a) in lanes.iter_mut().zip(acc) {
            // SAFETY: `out` is 8 f64, the 64 bytes the store writes.
            unsafe { _mm512_storeu_pd(out.as_mut_ptr(), a) };
        }
        lanes
    }

    /// # Safety
    /// The CPU must have AVX2, F16C and FMA. Every stream has the same length, a multiple of 8.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn sum_of_squares_avx2(streams: [&[f32]; 4]) -> [[f64; 8]; 4] {
        let len = streams[0].len();
        let mut acc = [[_mm256_setzero_pd(); 2]; 4];
        let mut i = 0;
        while i < len {
            for (a, stream) in acc.iter_mut().zip(&streams) {
                // SAFETY: i + 8 <= len, the length of every stream.
                let (lo, hi) =
                    unsafe { (_mm_loadu_ps(stream.as_ptr().add(i)), _mm_loadu_ps(stream.as_ptr().add(i + 4))) };
                let (lo, hi) = (_mm256_cvtps_pd(lo), _mm256_cvtps_pd(hi));
                a[0] = _mm256_fmadd_pd(lo, lo, a[0]);
                a[1] = _mm256_fmadd_pd(hi, hi, a[1]);
            }
            i += 8;
        }
        let mut lanes = [[0.0f64; 8]; 4];
        for (out, a) in lanes.iter_mut().zip(acc) {
            // SAFETY: `out` is 8 f64: each store writes 4 of them.
            unsafe {
                _mm256_storeu_pd(out.as_mut_ptr(), a[0]);
                _mm256_storeu_pd(out.as_mut_ptr().add(4), a[1]);
            }
        }
        lanes
    }

    /// How far ahead of the stripe being hashed the XXH3 loop prefetches, in blocks of 1 KiB (each
    /// stripe prefetches the one at its place in a later block): 4 blocks ahead into L1, 16 into L2.
    /// The loop reads one stream and on its own keeps too few cache misses in flight for this VM's
    /// memory: without prefetches it ran at 0.73× memcpy (AVX-512) and 0.59× (AVX2), with the L1 one
    /// alone at ~0.9–1.0×, with both at ~1.1× (docs/benchmarks.md).
    const XXH3_PREFETCH_L1_BLOCKS: usize = 4;
    const XXH3_PREFETCH_L2_BLOCKS: usize = 16;

    /// XXH3's stripe loop over the lanes `acc` (of whatever vector type): `accumulate(acc, stripe, k)` on
    /// each stripe, k being its index in its block (0..16, the secret's offset 8·k), `scramble(acc)`
    /// after each block's 16th. `in_block` stripes of the current block are done already: the first
    /// stripes finish that block, then whole blocks (each stripe with a prefetch ahead), then the rest. Returns the stripes done in the block the loop ends in. Inlined
    /// into each `#[target_feature]` caller, so the closures compile with its instructions.
    #[inline(always)]
    fn xxh3_stripes<A>(
        mut acc: A,
        stripes: &[u8],
        mut in_block: usize,
        accumulate: impl Fn(A, &[u8; STRIPE_LEN], usize) -> A,
        scramble: impl Fn(A) -> A,
    ) -> (A, usize) {
        let (stripes, _) = stripes.as_chunks::<STRIPE_LEN>();
        let head = ((STRIPES_PER_BLOCK - in_block) % STRIPES_PER_BLOCK).min(stripes.len());
        let (head, rest) = stripes.split_at(head);
        for stripe in head {
            acc = accumulate(acc, stripe, in_block);
            in_block += 1;
        }
        if in_block == STRIPES_PER_BLOCK {
            (acc, in_block) = (scramble(acc), 0);
        }
        let (blocks, tail) = rest.as_chunks::<STRIPES_PER_BLOCK>();
        for (b, block) in blocks.iter().enumerate() {
            let (near, far) = (blocks.get(b + XXH3_PREFETCH_L1_BLOCKS), blocks.get(b + XXH3_PREFETCH_L2_BLOCKS));
            for (k, stripe) in block.iter().enumerate() {
                if let Some(near) = near {
                    // SAFETY: a prefetch is a hint that never faults, here of a line inside `stripes`.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(near[k].as_ptr().cast()) };
                }
                if let Some(far) = far {
                    // SAFETY: as above.
                    unsafe { _mm_prefetch::<_MM_HINT_T1>(far[k].as_ptr().cast()) };
                }
                acc = accumulate(acc, stripe, k);
            }
            acc = scramble(acc);
        }
        for (k, stripe) in tail.iter().enumerate() {
            acc = accumulate(acc, stripe, k);
        }
        (acc, in_block + tail.len())
    }

    /// # Safety
    /// The CPU must have AVX-512F. `stripes` is a whole number of stripes, `in_block` < 16.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn xxh3_consume_avx512(acc: &mut [u64; 8], stripes: &[u8], in_block: usize) -> usize {
        // SAFETY: reads the 64 bytes of `bytes`.
        let load = |bytes: &[u8; 64]| unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) };
        let secret = |at: usize| load(SECRET[at..at + 64].try_into().expect("64 bytes"));
        let keys: [__m512i; STRIPES_PER_BLOCK] = std::array::from_fn(|k| secret(8 * k));
        let scramble_key = secret(SECRET_SCRAMBLE_START);
        let prime = _mm512_set1_epi64(PRIME32_1 as i64);
        let lanes = load(bytemuck::cast_ref(acc));
        let accumulate = |acc, stripe: &[u8; 64], k: usize| {
            let data = load(stripe);
            let mixed = _mm512_xor_si512(data, keys[k]);
            let product = _mm512_mul_epu32(mixed, _mm512_srli_epi64::<32>(mixed));
            // Each lane also gets the data word of its neighbour (lane i ^ 1).
            let swapped = _mm512_shuffle_epi32::<0b01_00_11_10>(data);
            _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped))
        };
        let scramble = |acc| {
            // acc ^ (acc >> 47) ^ key in one instruction (0x96: the XOR of all three).
            let mixed = _mm512_ternarylogic_epi64::<0x96>(acc, _mm512_srli_epi64::<47>(acc), scramble_key);
            // mixed · PRIME32_1 (mod 2^64), from 32×32-bit products: lo·p + (hi·p << 32).
            let lo = _mm512_mul_epu32(mixed, prime);
            let hi = _mm512_mul_epu32(_mm512_srli_epi64::<32>(mixed), prime);
            _mm512_add_epi64(lo, _mm512_slli_epi64::<32>(hi))
        };
        let (lanes, in_block) = xxh3_stripes(lanes, stripes, in_block, accumulate, scramble);
        // SAFETY: the 64 bytes of `acc`.
        unsafe { _mm512_storeu_si512(acc.as_mut_ptr().cast(), lanes) };
        in_block
    }

    /// # Safety
    /// The CPU must have AVX2, F16C and FMA. `stripes` is a whole number of stripes, `in_block` < 16.
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn xxh3_consume_avx2(acc: &mut [u64; 8], stripes: &[u8], in_block: usize) -> usize {
        // SAFETY: reads the 32 bytes at `at` and `at + 32` of `bytes` (64 bytes).
        let load = |bytes: &[u8; 64]| unsafe {
            [_mm256_loadu_si256(bytes.as_ptr().cast()), _mm256_loadu_si256(bytes.as_ptr().add(32).cast())]
        };
        let secret = |at: usize| load(SECRET[at..at + 64].try_into().expect("64 bytes"));
        let keys: [[__m256i; 2]; STRIPES_PER_BLOCK] = std::array::from_fn(|k| secret(8 * k));
        let scramble_key = secret(SECRET_SCRAMBLE_START);
        let lanes = load(bytemuck::cast_ref(acc));
        let accumulate = |acc: [__m256i; 2], stripe: &[u8; 64], k: usize| {
            let data = load(stripe);
            [xxh3_accumulate_avx2(acc[0], data[0], keys[k][0]), xxh3_accumulate_avx2(acc[1], data[1], keys[k][1])]
        };
        let scramble = |acc: [__m256i; 2]| {
            [xxh3_scramble_avx2(acc[0], scramble_key[0]), xxh3_scramble_avx2(acc[1], scramble_key[1])]
        };
        let (lanes, in_block) = xxh3_stripes(lanes, stripes, in_block, accumulate, scramble);
        // SAFETY: the 64 bytes of `acc`, 32 at a time.
        unsafe {
            _mm256_storeu_si256(acc.as_mut_ptr().cast(), lanes[0]);
            _mm256_storeu_si256(acc.as_mut_ptr().add(4).cast(), lanes[1]);
        }
        in_block
    }

    /// Half a stripe (4 lanes) of XXH3's accumulate, as in `xxh3_consume_avx512`.
    #[target_feature(enable = "avx2")]
    fn xxh3_accumulate_avx2(acc: __m256i, data: __m256i, key: __m256i) -> __m256i {
        let mixed = _mm256_xor_si256(data, key);
        let product = _mm256_mul_epu32(mixed, _mm256_srli_epi64::<32>(mixed));
        let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
        _mm256_add_epi64(acc, _mm256_add_epi64(product, swapped))
    }

    /// Half of XXH3's scramble (4 lanes), as in `xxh3_consume_avx512`.
    #[target_feature(enable = "avx2")]
    fn xxh3_scramble_avx2(acc: __m256i, key: __m256i) -> __m256i {
        let mixed = _mm256_xor_si256(_mm256_xor_si256(acc, _mm256_srli_epi64::<47>(acc)), key);
        let prime = _mm256_set1_epi64x(PRIME32_1 as i64);
        let lo = _mm256_mul_epu32(mixed, prime);
        let hi = _mm256_mul_epu32(_mm256_srli_epi64::<32>(mixed), prime);
        _mm256_add_epi64(lo, _mm256_slli_epi64::<32>(hi))
    }
}

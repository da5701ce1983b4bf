//! Gradient unscaling for mixed-precision training, with the overflow check fused into the same pass
//! (what `torch._amp_foreach_non_finite_check_and_unscale_` does).

use crate::cpu_parallel::{chunk_elems, map_parts};

/// Multiplies every gradient by `inv_scale` and returns whether any gradient was inf or NaN *before*
/// scaling (torch checks the input too). All values are multiplied either way; a caller that sees
/// `true` skips the optimizer step and lowers the loss scale.
pub fn unscale_grads(grads: &mut [f32], inv_scale: f32) -> bool {
    let chunk = chunk_elems(grads.len());
    map_parts(grads.chunks_mut(chunk), |grads| unscale_block(grads, inv_scale)).into_iter().any(|found| found)
}

/// Branch-free so it vectorizes: an f32 is inf or NaN exactly when its exponent bits are all ones.
fn unscale_block(grads: &mut [f32], inv_scale: f32) -> bool {
    const EXPONENT_BITS: u32 = 0x7f80_0000;
    let mut non_finite = 0u32;
    for g in grads.iter_mut() {
        non_finite |= u32::from(g.to_bits() & EXPONENT_BITS == EXPONENT_BITS);
        *g *= inv_scale;
    }
    non_finite != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_parallel::PARALLEL_MIN_ELEMS;
    use proptest::prelude::*;

    fn check(grads: &[f32], inv_scale: f32) {
        let mut got = grads.to_vec();
        let found = unscale_grads(&mut got, inv_scale);
        assert_eq!(found, grads.iter().any(|g| !g.is_finite()), "non-finite flag for {grads:?}");
        for (g, x) in got.iter().zip(grads) {
            let want = x * inv_scale;
            assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()));
        }
    }

    #[test]
    fn finds_inf_and_nan_anywhere_and_nothing_else() {
        check(&[], 0.5);
        check(&[1.0, -2.0, 1e-45, f32::MAX, f32::MIN_POSITIVE, -0.0], 1.0 / 65536.0);
        check(&[1.0, f32::NAN], 0.5);
        check(&[f32::NEG_INFINITY, 1.0, 2.0], 0.5);
        check(&[f32::INFINITY], 0.5);
    }

    #[test]
    fn overflow_caused_by_the_scale_itself_is_not_reported() {
        // torch checks the incoming value; a finite gradient times a huge factor is the caller's choice.
        let mut g = vec![f32::MAX];
        assert!(!unscale_grads(&mut g, 4.0));
        assert!(g[0].is_infinite());
    }

    #[test]
    fn a_single_nan_in_the_last_thread_chunk_is_found() {
        let mut grads = vec![0.5f32; PARALLEL_MIN_ELEMS * 2 + 5];
        *grads.last_mut().unwrap() = f32::NAN;
        check(&grads, 0.25);
        grads[0] = f32::INFINITY;
        *grads.last_mut().unwrap() = 1.0;
        check(&grads, 0.25);
    }

    proptest! {
        #[test]
        fn random_bit_patterns_match_the_reference(bits in prop::collection::vec(any::<u32>(), 0..2000), inv in prop_oneof![Just(1.0f32), 1e-6f32..1.0]) {
            check(&bits.into_iter().map(f32::from_bits).collect::<Vec<_>>(), inv);
        }
    }
}

//! Fused AdamW on a flat shard: one pass over params, grads and both moments (and the optional bf16
//! copy-out), instead of the nine tensor passes of torch's per-parameter loop.
//!
//! The arithmetic follows `torch.optim.AdamW` (single-tensor path, `amsgrad=False`,
//! `maximize=False`) operation for operation, in f32, with the per-step scalars computed in f64 as
//! Python computes them and then rounded to f32 as ATen does when it applies a Python scalar:
//!
//! ```text
//! p  *= 1 - lr*wd
//! m   = m + (1-b1)(g - m)            # torch.lerp with weight 1-b1 < 0.5
//! v   = b2 v + ((1-b2) g) g          # addcmul
//! step_size = lr / (1 - b1^t)
//! denom = sqrt(v) / sqrt(1 - b2^t) + eps
//! p  += -step_size * (m / denom)     # addcdiv
//! ```
//!
//! libtorch's C++ `torch::optim::AdamW` (what tch uses) writes the first moment as `m*b1 + (1-b1)*g`
//! instead of the lerp; the two differ by at most an ulp of `m` per step.

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::cast::bf16_from_f32_rne;
use crate::cpu_parallel::{chunk_elems, for_each_part};

/// AdamW hyper-parameters, as `torch.optim.AdamW` takes them. Defaults are torch's.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 1e-2 }
    }
}

/// The f32 scalars of one step, derived from the config and the step number exactly as torch derives
/// them (f64 arithmetic, rounded to f32 once). Shared by the CPU and CUDA paths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStepScalars {
    pub decay: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub neg_step_size: f32,
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
}

impl AdamWStepScalars {
    /// # Panics
    /// If `step` is 0: steps count from 1, as in torch.
    pub fn new(config: &AdamWConfig, step: u64) -> Self {
        assert!(step >= 1, "AdamW steps count from 1");
        let t = step as f64;
        let bias_correction1 = 1.0 - config.beta1.powf(t);
        let bias_correction2 = 1.0 - config.beta2.powf(t);
        Self {
            decay: (1.0 - config.lr * config.weight_decay) as f32,
            one_minus_beta1: (1.0 - config.beta1) as f32,
            beta2: config.beta2 as f32,
            one_minus_beta2: (1.0 - config.beta2) as f32,
            neg_step_size: (-(config.lr / bias_correction1)) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
            eps: config.eps as f32,
        }
    }
}

/// One rank's optimizer shard: fp32 master params and both moments, all the same length.
#[derive(Debug)]
pub struct AdamWShard<'a> {
    pub params: &'a mut [f32],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
}

/// Applies AdamW step `step` (counting from 1) to the shard; when `params_bf16` is given, also writes
/// the updated params rounded to bf16 (round to nearest even) for the compute copy.
///
/// # Panics
/// If any length differs from `params.len()`, or `step` is 0.
pub fn adamw_step(
    shard: AdamWShard<'_>,
    grads: &[f32],
    config: &AdamWConfig,
    step: u64,
    params_bf16: Option<&mut [bf16]>,
) {
    let AdamWShard { params, exp_avg, exp_avg_sq } = shard;
    let len = params.len();
    assert!(
        grads.len() == len && exp_avg.len() == len && exp_avg_sq.len() == len,
        "adamw_step: params, grads and moments lengths differ"
    );
    if let Some(out) = &params_bf16 {
        assert_eq!(out.len(), len, "adamw_step: bf16 copy-out length differs from params");
    }
    let scalars = AdamWStepScalars::new(config, step);
    let chunk = chunk_elems(len);
    let out_chunks =
        params_bf16.into_iter().flat_map(|out| out.chunks_mut(chunk).map(Some)).chain(std::iter::repeat_with(|| None));
    let parts = params
        .chunks_mut(chunk)
        .zip(grads.chunks(chunk))
        .zip(exp_avg.chunks_mut(chunk))
        .zip(exp_avg_sq.chunks_mut(chunk))
        .zip(out_chunks);
    for_each_part(parts, |((((p, g), m), v), out)| match out {
        Some(out) => adamw_block_with_copy_out(p, g, m, v, out, &scalars),
        None => adamw_block(p, g, m, v, &scalars),
    });
}

/// One element of the update: returns the new (param, exp_avg, exp_avg_sq).
#[inline(always)]
fn adamw_element(p: f32, g: f32, m: f32, v: f32, s: &AdamWStepScalars) -> (f32, f32, f32) {
    let p = p * s.decay;
    let m = m + s.one_minus_beta1 * (g - m);
    let v = v * s.beta2 + s.one_minus_beta2 * g * g;
    let denom = v.sqrt() / s.bias_correction2_sqrt + s.eps;
    let p = p + s.neg_step_size * (m / denom);
    (p, m, v)
}

fn adamw_block(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamWStepScalars) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        (*p, *m, *v) = adamw_element(*p, *g, *m, *v, s);
    }
}

fn adamw_block_with_copy_out(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    out: &mut [bf16],
    s: &AdamWStepScalars,
) {
    for ((((p, g), m), v), out) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()).zip(out.iter_mut()) {
        (*p, *m, *v) = adamw_element(*p, *g, *m, *v, s);
        *out = bf16_from_f32_rne(*p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_parallel::PARALLEL_MIN_ELEMS;
    use proptest::prelude::*;

    /// torch's formula written out per element, one tensor operation per line, in f32 with f64
    /// scalars rounded at use — the reference the fused kernel must match bit for bit.
    fn reference_step(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], c: &AdamWConfig, t: u64) {
        let step_size = c.lr / (1.0 - c.beta1.powf(t as f64));
        let bc2_sqrt = (1.0 - c.beta2.powf(t as f64)).sqrt();
        for i in 0..p.len() {
            p[i] *= (1.0 - c.lr * c.weight_decay) as f32;
            m[i] += (1.0 - c.beta1) as f32 * (g[i] - m[i]);
            v[i] = v[i] * c.beta2 as f32 + (1.0 - c.beta2) as f32 * g[i] * g[i];
            let denom = v[i].sqrt() / bc2_sqrt as f32 + c.eps as f32;
            p[i] += (-step_size) as f32 * (m[i] / denom);
        }
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    fn check(params: &[f32], grads: &[f32], config: &AdamWConfig, steps: u64) {
        let n = params.len();
        let (mut p, mut m, mut v) = (params.to_vec(), vec![0.0; n], vec![0.0; n]);
        let (mut rp, mut rm, mut rv) = (params.to_vec(), vec![0.0; n], vec![0.0; n]);
        let mut out = vec![bf16::ZERO; n];
        for t in 1..=steps {
            let shard = AdamWShard { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v };
            adamw_step(shard, grads, config, t, Some(&mut out));
            reference_step(&mut rp, grads, &mut rm, &mut rv, config, t);
        }
        for i in 0..n {
            assert!(
                same(p[i], rp[i]) && same(m[i], rm[i]) && same(v[i], rv[i]),
                "element {i}: p {} vs {}",
                p[i],
                rp[i]
            );
            assert!(same(out[i].to_f32(), bf16::from_f32(p[i]).to_f32()), "bf16 copy-out at {i}");
        }
    }

    #[test]
    fn matches_the_torch_formula_on_edge_values() {
        let params = [0.0, -0.0, 1.0, -3.5, 1e-40, f32::MAX, f32::NAN, f32::INFINITY, 2.0, 7.0, 0.5];
        let grads = [0.0, 1.0, -1.0, 1e-45, 1e30, -2.0, 0.1, 0.1, f32::NAN, f32::INFINITY, 1e-20];
        check(&params, &grads, &AdamWConfig::default(), 3);
    }

    #[test]
    fn empty_shard_is_a_no_op() {
        check(&[], &[], &AdamWConfig::default(), 2);
    }

    #[test]
    fn large_shards_split_across_threads_match() {
        let n = PARALLEL_MIN_ELEMS * 2 + 13;
        let params: Vec<f32> = (0..n).map(|i| (i as f32 * 0.01).sin()).collect();
        let grads: Vec<f32> = (0..n).map(|i| (i as f32 * 0.07).cos() * 1e-2).collect();
        check(&params, &grads, &AdamWConfig { lr: 3e-4, weight_decay: 0.1, ..AdamWConfig::default() }, 2);
    }

    #[test]
    fn first_step_moves_each_param_by_about_lr_against_its_gradient() {
        let mut p = vec![1.0f32, 1.0];
        let (mut m, mut v) = (vec![0.0; 2], vec![0.0; 2]);
        let config = AdamWConfig { lr: 0.1, weight_decay: 0.0, ..AdamWConfig::default() };
        adamw_step(AdamWShard { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v }, &[2.0, -0.5], &config, 1, None);
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6, "{p:?}");
    }

    #[test]
    #[should_panic(expected = "count from 1")]
    fn step_zero_is_refused() {
        AdamWStepScalars::new(&AdamWConfig::default(), 0);
    }

    proptest! {
        #[test]
        fn random_shards_match_the_torch_formula(
            pg in prop::collection::vec((-10.0f32..10.0, prop_oneof![-1.0f32..1.0, any::<u32>().prop_map(f32::from_bits)]), 0..700),
            lr in 1e-5f64..1e-1, wd in 0.0f64..0.3, steps in 1u64..6,
        ) {
            let (params, grads): (Vec<f32>, Vec<f32>) = pg.into_iter().unzip();
            check(&params, &grads, &AdamWConfig { lr, weight_decay: wd, ..AdamWConfig::default() }, steps);
        }
    }
}

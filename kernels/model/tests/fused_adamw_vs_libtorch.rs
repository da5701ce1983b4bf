//! troupe's fused AdamW on one flat shard equals libtorch's `torch::optim::AdamW` (through
//! `tch::nn::AdamW`) on the same parameters, held as separate tensors, within 1e-6 relative over 10 steps.

use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use troupe_kernels::{adamw_step, AdamWConfig, AdamWShard};

const STEPS: u64 = 10;
const RELATIVE_TOLERANCE: f64 = 1e-6;

/// A small deterministic generator (SplitMix64) so the test needs no RNG crate: uniform in [-1, 1).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_unit(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Runs both optimizers on parameters of the given shapes and returns the worst relative difference.
fn worst_relative_difference(shapes: &[&[i64]], config: &AdamWConfig, seed: u64) -> f64 {
    let mut rng = SplitMix64(seed);
    let sizes: Vec<usize> = shapes.iter().map(|s| s.iter().product::<i64>() as usize).collect();
    let total: usize = sizes.iter().sum();
    // Params in ±[0.5, 1.5) so that "relative" is meaningful for every element.
    let init: Vec<f32> = (0..total)
        .map(|_| {
            let u = rng.next_unit();
            u.signum() * (0.5 + u.abs())
        })
        .collect();
    // Gradients spanning four orders of magnitude, different at every step.
    let grads: Vec<Vec<f32>> =
        (0..STEPS).map(|_| (0..total).map(|i| rng.next_unit() * 10f32.powi((i % 4) as i32 - 2)).collect()).collect();

    // libtorch: one tensor per shape, gradients set through backward of <p, g>.
    let vs = nn::VarStore::new(Device::Cpu);
    let mut offset = 0;
    let mut vars = Vec::new();
    for (i, (shape, size)) in shapes.iter().zip(&sizes).enumerate() {
        let t = Tensor::from_slice(&init[offset..offset + size]).reshape(*shape);
        vars.push((vs.root().var_copy(&format!("p{i}"), &t), offset, *size));
        offset += size;
    }
    let mut opt = nn::AdamW {
        beta1: config.beta1,
        beta2: config.beta2,
        wd: config.weight_decay,
        eps: config.eps,
        amsgrad: false,
    }
    .build(&vs, config.lr)
    .expect("build libtorch AdamW");
    for g in &grads {
        opt.zero_grad();
        let loss = vars
            .iter()
            .map(|(p, off, size)| (p * Tensor::from_slice(&g[*off..off + size]).reshape(p.size())).sum(Kind::Float))
            .fold(Tensor::from(0f32), |acc, x| acc + x);
        loss.backward();
        opt.step();
    }
    let torch_params: Vec<f32> = vars
        .iter()
        .flat_map(|(p, _, _)| Vec::<f32>::try_from(p.detach().flatten(0, -1)).expect("read libtorch params"))
        .collect();

    // troupe: the same parameters as one flat shard.
    let (mut p, mut m, mut v) = (init.clone(), vec![0.0f32; total], vec![0.0f32; total]);
    for (t, g) in grads.iter().enumerate() {
        let shard = AdamWShard { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v };
        adamw_step(shard, g, config, t as u64 + 1, None);
    }

    assert_eq!(p.len(), torch_params.len());
    let moved = p.iter().zip(&init).filter(|(a, b)| a != b).count();
    assert!(moved > total / 2, "the optimizer must actually move the params ({moved} of {total} moved)");
    p.iter()
        .zip(&torch_params)
        .map(|(ours, theirs)| ((f64::from(*ours) - f64::from(*theirs)) / f64::from(*theirs)).abs())
        .fold(0.0, f64::max)
}

fn check(shapes: &[&[i64]], config: AdamWConfig) {
    let worst = worst_relative_difference(shapes, &config, 42);
    println!("{config:?}: worst relative difference after {STEPS} steps = {worst:.3e}");
    assert!(
        worst <= RELATIVE_TOLERANCE,
        "fused AdamW differs from libtorch by {worst:e} relative (> {RELATIVE_TOLERANCE:e})"
    );
}

#[test]
fn fused_adamw_equals_libtorch_adamw_with_default_hyper_parameters() {
    check(&[&[17, 33], &[257], &[5], &[4, 4, 4]], AdamWConfig::default());
}

#[test]
fn fused_adamw_equals_libtorch_adamw_with_large_lr_and_weight_decay() {
    let config = AdamWConfig { lr: 3e-2, beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.1 };
    check(&[&[64, 65], &[1000]], config);
}

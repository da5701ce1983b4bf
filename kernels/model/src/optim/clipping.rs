//! Gradient clipping by global norm, and the scaling of gradients it (and fp16's unscaling) applies.

use tch::Tensor;

/// The global L2 norm of all gradients: each gradient's Σ g² in f64 where it lives, the sums summed on
/// the host in parameter order — brought over in one copy, so on a GPU the norm costs one
/// synchronisation, not one per tensor.
pub fn grad_norm(params: &[Tensor]) -> f64 {
    let sums: Vec<Tensor> =
        params.iter().map(|p| p.grad()).filter(Tensor::defined).map(|g| g.square().sum(tch::Kind::Double)).collect();
    if sums.is_empty() {
        return 0.0;
    }
    let host = match sums.iter().all(|s| s.device() == sums[0].device()) {
        true => Tensor::stack(&sums, 0).to_device(tch::Device::Cpu),
        false => Tensor::stack(&sums.iter().map(|s| s.to_device(tch::Device::Cpu)).collect::<Vec<_>>(), 0),
    };
    let sums: Vec<f64> = Vec::try_from(&host).expect("a flat f64 tensor");
    let sum_sq: f64 = sums.into_iter().sum();
    sum_sq.sqrt()
}

/// Scales every gradient so the global norm is at most `max_norm` (torch's clip_grad_norm_). Returns the
/// norm before clipping.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    let norm = grad_norm(params);
    scale_grads(params, clip_coefficient(max_norm, norm));
    norm
}

/// The factor that clips gradients of global norm `norm` to `max_norm` (0: no clipping): torch's
/// `max_norm / (norm + 1e-6)`, clamped to 1.
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

/// Multiplies every gradient by `factor` (unscale and clip in one, see
/// [`crate::precision::Update::Apply`]); a factor of exactly 1 leaves them alone.
pub fn scale_grads(params: &[Tensor], factor: f64) {
    if factor == 1.0 {
        return;
    }
    tch::no_grad(|| {
        for p in params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.g_mul_scalar_(factor);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_bounds_the_global_norm() {
        let p = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[3.0f32, 4.0])).sum(tch::Kind::Float).backward();
        let before = clip_grad_norm(std::slice::from_ref(&p), 1.0);
        assert!((before - 5.0).abs() < 1e-6);
        assert!((grad_norm(std::slice::from_ref(&p)) - 1.0).abs() < 1e-5);
    }
}

//! AdamW, the learning-rate schedule and gradient clipping, written with tch ops on the parameter list so
//! their state is plain tensors that checkpoints save and shards can split.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::TrainConfig;

/// AdamW hyper-parameters (torch.optim.AdamW semantics: decoupled decay, bias correction).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl From<&TrainConfig> for AdamWConfig {
    fn from(t: &TrainConfig) -> Self {
        Self { beta1: t.beta1, beta2: t.beta2, eps: t.eps, weight_decay: t.weight_decay }
    }
}

/// AdamW state for an ordered parameter list.
#[derive(Debug)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Updates applied so far (the `t` of bias correction).
    pub step: u64,
    pub exp_avg: Vec<Tensor>,
    pub exp_avg_sq: Vec<Tensor>,
    /// Per parameter: whether weight decay applies.
    decays: Vec<bool>,
}

impl AdamW {
    pub fn new(config: AdamWConfig, params: &[Tensor], decays: Vec<bool>) -> Self {
        assert_eq!(params.len(), decays.len());
        let zeros = || params.iter().map(|p| Tensor::zeros_like(&p.detach())).collect();
        Self { config, step: 0, exp_avg: zeros(), exp_avg_sq: zeros(), decays }
    }

    /// One update of every parameter from its `.grad()`, at learning rate `lr`.
    pub fn apply(&mut self, params: &mut [Tensor], lr: f64) {
        let AdamWConfig { beta1, beta2, eps, weight_decay } = self.config;
        self.step += 1;
        let t = self.step as i32;
        let bias_correction1 = 1.0 - beta1.powi(t);
        let bias_correction2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        let step_size = lr / bias_correction1;
        tch::no_grad(|| {
            for (i, p) in params.iter_mut().enumerate() {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                if self.decays[i] && weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
                }
                let _ = self.exp_avg[i].lerp_(&grad, 1.0 - beta1);
                let _ = self.exp_avg_sq[i].g_mul_scalar_(beta2).addcmul_(&grad, &(&grad * (1.0 - beta2)));
                let denom = (self.exp_avg_sq[i].sqrt() / bias_correction2_sqrt) + eps;
                let _ = p.g_sub_(&((&self.exp_avg[i] / denom) * step_size));
            }
        });
    }
}

/// Linear warmup to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `decay_steps`
/// (0 = the run's `steps`), then `min_lr`. `step` counts from 0.
pub fn learning_rate(train: &TrainConfig, step: u64) -> f64 {
    if step < train.warmup_steps {
        return train.lr * (step + 1) as f64 / train.warmup_steps as f64;
    }
    let decay_steps = if train.decay_steps == 0 { train.steps } else { train.decay_steps };
    if step >= decay_steps || decay_steps <= train.warmup_steps {
        return train.min_lr;
    }
    let progress = (step - train.warmup_steps) as f64 / (decay_steps - train.warmup_steps) as f64;
    train.min_lr + 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()) * (train.lr - train.min_lr)
}

/// The global L2 norm of all gradients.
pub fn grad_norm(params: &[Tensor]) -> f64 {
    let sum_sq: f64 = params
        .iter()
        .map(|p| p.grad())
        .filter(Tensor::defined)
        .map(|g| g.square().sum(tch::Kind::Double).double_value(&[]))
        .sum();
    sum_sq.sqrt()
}

/// Scales every gradient so the global norm is at most `max_norm` (torch's clip_grad_norm_: the factor
/// is `max_norm / (norm + 1e-6)` clamped to 1). Returns the norm before clipping.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    clip_grad_norm_known(params, max_norm, grad_norm(params))
}

/// [`clip_grad_norm`] when the caller already knows the global norm (e.g. summed while the gradients
/// were flat for an all-reduce), saving a pass over every gradient.
pub fn clip_grad_norm_known(params: &[Tensor], max_norm: f64, norm: f64) -> f64 {
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    if coef < 1.0 {
        tch::no_grad(|| {
            for p in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.g_mul_scalar_(coef);
                }
            }
        });
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_min() {
        let train = TrainConfig { steps: 100, warmup_steps: 10, lr: 1.0, min_lr: 0.1, ..TrainConfig::default() };
        assert!((learning_rate(&train, 0) - 0.1).abs() < 1e-12);
        assert!((learning_rate(&train, 9) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&train, 10) - 1.0).abs() < 1e-12);
        assert!((learning_rate(&train, 55) - 0.55).abs() < 1e-12);
        assert!((learning_rate(&train, 100) - 0.1).abs() < 1e-12);
        let rates: Vec<f64> = (10..100).map(|s| learning_rate(&train, s)).collect();
        assert!(rates.windows(2).all(|w| w[1] <= w[0]));
    }

    #[test]
    fn adamw_first_step_moves_each_weight_by_lr_times_sign() {
        // At t = 1, m̂ = g and v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g).
        let mut p = Tensor::from_slice(&[1.0f32, -2.0, 3.0]).set_requires_grad(true);
        let loss = (&p * Tensor::from_slice(&[0.5f32, -4.0, 0.0])).sum(tch::Kind::Float);
        loss.backward();
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 };
        let mut opt = AdamW::new(config, std::slice::from_ref(&p), vec![true]);
        opt.apply(std::slice::from_mut(&mut p), 0.1);
        let got: Vec<f32> = Vec::try_from(p.detach()).unwrap();
        let want = [0.9f32, -1.9, 3.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let p = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        (&p * Tensor::from_slice(&[3.0f32, 4.0])).sum(tch::Kind::Float).backward();
        let before = clip_grad_norm(std::slice::from_ref(&p), 1.0);
        assert!((before - 5.0).abs() < 1e-6);
        assert!((grad_norm(std::slice::from_ref(&p)) - 1.0).abs() < 1e-5);
    }
}

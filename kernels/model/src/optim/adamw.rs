//! AdamW on the parameter list. Its state is plain tensors that checkpoints save and shards can split;
//! the update itself is troupe-kernels' fused AdamW run on each tensor's own storage (one pass over
//! parameter, gradient and both moments, no temporaries) — the CPU kernel on host tensors, the CUDA
//! kernel on a GPU's (every parameter of the step lent at once: one device synchronisation before the
//! launches and one after) — with libtorch's per-tensor ops kept only for tensors the kernels cannot
//! take, or where troupe's CUDA kernels cannot load.

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};
use troupe_kernels::adamw::{adamw_step, AdamWConfig as KernelConfig, AdamWShard};
use troupe_kernels::{Backend, CudaBackend};

use crate::sections::TrainConfig;
use crate::storage::{lend_cuda_groups, lend_f32, LendGroup};

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
    /// Troupe's CUDA kernels on the parameters' device once opened, or why they could not run there
    /// (logged once; the libtorch formula from then on).
    cuda: Option<Result<CudaBackend, String>>,
}

impl AdamW {
    pub fn new(config: AdamWConfig, params: &[Tensor], decays: Vec<bool>) -> Self {
        assert_eq!(params.len(), decays.len());
        let zeros = || params.iter().map(|p| Tensor::zeros_like(&p.detach())).collect();
        Self { config, step: 0, exp_avg: zeros(), exp_avg_sq: zeros(), decays, cuda: None }
    }

    /// One update of every parameter from its `.grad()`, at learning rate `lr`; parameters without a
    /// gradient are left alone. f32 contiguous tensors go through the fused kernel on their own storage
    /// — the CPU kernel on the host, the CUDA kernel when the parameters are on a GPU (all of them lent
    /// at once, [`Self::apply_on_cuda`]) — and any other tensor through libtorch ops with the same
    /// formula.
    pub fn apply(&mut self, params: &mut [Tensor], lr: f64) {
        self.apply_then(params, lr, &mut |_, _| {});
    }

    /// [`Self::apply`], calling `each(i, param)` as soon as parameter `i` is updated (an offloaded
    /// update starts copying it back to the device while the next one computes).
    pub fn apply_then(&mut self, params: &mut [Tensor], lr: f64, each: &mut dyn FnMut(usize, &Tensor)) {
        self.step += 1;
        let step = self.step;
        if let Some(Device::Cuda(ordinal)) = params.first().map(Tensor::device) {
            if !matches!(self.cuda, Some(Err(_))) {
                match self.apply_on_cuda(ordinal, params, lr) {
                    Ok(()) => {
                        params.iter().enumerate().filter(|(_, p)| p.grad().defined()).for_each(|(i, p)| each(i, p));
                        return;
                    }
                    Err(why) => {
                        tracing::warn!(%why, "AdamW: troupe's CUDA kernel cannot run on these tensors; libtorch ops instead");
                        self.cuda = Some(Err(why));
                    }
                }
            }
        }
        for (i, param) in params.iter_mut().enumerate() {
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            let config = self.kernel_config(lr, self.decays[i]);
            let lent = lend_f32(
                [
                    ("parameter", &mut *param),
                    ("exp_avg", &mut self.exp_avg[i]),
                    ("exp_avg_sq", &mut self.exp_avg_sq[i]),
                ],
                [("gradient", &grad)],
            );
            match lent {
                Ok(([p, m, v], [g])) => {
                    adamw_step(AdamWShard { params: p, exp_avg: m, exp_avg_sq: v }, g, &config, step, None)
                }
                Err(refused) => {
                    tracing::debug!(parameter = i, %refused, "AdamW: libtorch ops for a tensor the fused kernel cannot take");
                    self.apply_reference_to(i, param, &grad, lr);
                }
            }
            each(i, param);
        }
    }

    /// The fused CUDA kernel on every parameter with a gradient (on device `ordinal`), the step counter
    /// already advanced: the parameters, moments and gradients lent at once, one launch per parameter.
    /// An error before anything was launched (troupe's kernels cannot load, a tensor the kernel cannot
    /// take) leaves every tensor as it was; a launch that fails after others ran is a broken device, and
    /// panics (the attempt fails and the rank's state is restored from its peers).
    fn apply_on_cuda(&mut self, ordinal: usize, params: &mut [Tensor], lr: f64) -> Result<(), String> {
        let backend = match &self.cuda {
            Some(Ok(backend)) if backend.ordinal() == ordinal => backend.clone(),
            _ => CudaBackend::new(ordinal).map_err(|e| e.to_string())?,
        };
        self.cuda = Some(Ok(backend.clone()));
        let grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
        let trained: Vec<usize> = (0..params.len()).filter(|&i| grads[i].defined()).collect();
        let configs: Vec<KernelConfig> = trained.iter().map(|&i| self.kernel_config(lr, self.decays[i])).collect();
        let step = self.step;
        let groups: Vec<LendGroup<3, 1>> = params
            .iter_mut()
            .zip(self.exp_avg.iter_mut().zip(self.exp_avg_sq.iter_mut()))
            .zip(&grads)
            .filter(|(_, g)| g.defined())
            .map(|((p, (m, v)), g)| ([("parameter", p), ("exp_avg", m), ("exp_avg_sq", v)], [("gradient", g)]))
            .collect();
        let mut lent = lend_cuda_groups(&backend, groups).map_err(|e| e.to_string())?;
        let kernels = Backend::Cuda(backend.clone());
        for (k, config) in configs.iter().enumerate() {
            let ([p, m, v], [g]) = lent.group(k);
            if let Err(e) = kernels.adamw_step(p, g, m, v, None, config, step) {
                panic!(
                    "the fused AdamW kernel failed on cuda:{ordinal} after {k} of {} parameters: {e}",
                    configs.len()
                );
            }
        }
        Ok(())
    }

    /// The kernel's hyper-parameters for one parameter: its decay flag decides the weight decay.
    fn kernel_config(&self, lr: f64, decays: bool) -> KernelConfig {
        let AdamWConfig { beta1, beta2, eps, weight_decay } = self.config;
        KernelConfig { lr, beta1, beta2, eps, weight_decay: if decays { weight_decay } else { 0.0 } }
    }

    /// The update of parameter `i` (whose step counter `self.step` is already advanced) in libtorch
    /// ops: torch.optim.AdamW's single-tensor formula, which allocates a few temporaries per tensor.
    fn apply_reference_to(&mut self, i: usize, param: &mut Tensor, grad: &Tensor, lr: f64) {
        let AdamWConfig { beta1, beta2, eps, weight_decay } = self.config;
        let t = self.step as i32;
        let bias_correction1 = 1.0 - beta1.powi(t);
        let bias_correction2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        let step_size = lr / bias_correction1;
        tch::no_grad(|| {
            if self.decays[i] && weight_decay != 0.0 {
                let _ = param.g_mul_scalar_(1.0 - lr * weight_decay);
            }
            let _ = self.exp_avg[i].lerp_(grad, 1.0 - beta1);
            let _ = self.exp_avg_sq[i].g_mul_scalar_(beta2).addcmul_(grad, &(grad * (1.0 - beta2)));
            let denom = (self.exp_avg_sq[i].sqrt() / bias_correction2_sqrt) + eps;
            let _ = param.g_sub_(&((&self.exp_avg[i] / denom) * step_size));
        });
    }

    /// [`Self::apply`] with libtorch ops for every tensor: the formula the fused path must equal.
    #[cfg(test)]
    fn apply_reference(&mut self, params: &mut [Tensor], lr: f64) {
        self.step += 1;
        for (i, param) in params.iter_mut().enumerate() {
            let grad = param.grad();
            if grad.defined() {
                self.apply_reference_to(i, param, &grad, lr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Parameters of assorted shapes (one large enough for the kernel to split across threads), their
    /// decay flags, and a fresh gradient for each from `seed`.
    fn random_params(seed: i64) -> (Vec<Tensor>, Vec<bool>) {
        tch::manual_seed(seed);
        let shapes: [&[i64]; 5] = [&[256, 1100], &[64, 48], &[48], &[7], &[3, 5, 2]];
        let params = shapes.iter().map(|s| Tensor::randn(*s, (tch::Kind::Float, tch::Device::Cpu))).collect();
        (params, vec![true, true, false, false, true])
    }

    fn set_random_grads(params: &mut [Tensor], seed: i64) {
        tch::manual_seed(seed);
        for p in params.iter_mut() {
            p.zero_grad();
            let weights = Tensor::randn(p.size(), (tch::Kind::Float, tch::Device::Cpu)) * 1e-2;
            (&*p * weights).sum(tch::Kind::Float).backward();
        }
    }

    fn relative_l2(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).norm().double_value(&[]) / b.norm().double_value(&[]).max(f64::MIN_POSITIVE)
    }

    #[test]
    fn fused_update_equals_the_libtorch_formula_over_ten_steps() {
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let (values, decays) = random_params(7);
        let leaf = |t: &Tensor| t.copy().set_requires_grad(true);
        let mut fused_params: Vec<Tensor> = values.iter().map(leaf).collect();
        let mut reference_params: Vec<Tensor> = values.iter().map(leaf).collect();
        let mut fused = AdamW::new(config, &fused_params, decays.clone());
        let mut reference = AdamW::new(config, &reference_params, decays);
        for step in 0..10 {
            let lr = 1e-3 * (1.0 + step as f64) / 10.0;
            set_random_grads(&mut fused_params, 100 + step);
            set_random_grads(&mut reference_params, 100 + step);
            fused.apply(&mut fused_params, lr);
            reference.apply_reference(&mut reference_params, lr);
        }
        assert_eq!(fused.step, 10);
        for i in 0..fused_params.len() {
            let moved = relative_l2(&fused_params[i].detach(), &values[i]);
            assert!(moved > 1e-4, "parameter {i} barely moved ({moved:e}): the comparison would prove nothing");
            for (what, a, b) in [
                ("param", fused_params[i].detach(), reference_params[i].detach()),
                ("exp_avg", fused.exp_avg[i].shallow_clone(), reference.exp_avg[i].shallow_clone()),
                ("exp_avg_sq", fused.exp_avg_sq[i].shallow_clone(), reference.exp_avg_sq[i].shallow_clone()),
            ] {
                let rel = relative_l2(&a, &b);
                assert!(rel <= 1e-6, "parameter {i} {what}: fused vs libtorch relative L2 {rel:e}");
            }
        }
    }

    #[test]
    fn tensors_the_kernel_cannot_take_get_the_libtorch_formula() {
        // An f64 parameter cannot be lent as f32 storage: the update falls back to libtorch ops.
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let start = Tensor::from_slice(&[1.0f64, -2.0, 3.0]);
        let mut fallback = vec![start.copy().set_requires_grad(true)];
        let mut reference = vec![start.copy().set_requires_grad(true)];
        let mut a = AdamW::new(config, &fallback, vec![true]);
        let mut b = AdamW::new(config, &reference, vec![true]);
        for params in [&mut fallback, &mut reference] {
            (&params[0] * Tensor::from_slice(&[0.5f64, -4.0, 0.25])).sum(tch::Kind::Double).backward();
        }
        a.apply(&mut fallback, 0.1);
        b.apply_reference(&mut reference, 0.1);
        assert_eq!(fallback[0].kind(), tch::Kind::Double);
        let (got, want): (Vec<f64>, Vec<f64>) =
            (Vec::try_from(fallback[0].detach()).unwrap(), Vec::try_from(reference[0].detach()).unwrap());
        assert_eq!(got, want);
        assert!((got[1] - (-2.0 * 0.99 + 0.1)).abs() < 1e-6, "{got:?}");
    }

    #[test]
    fn parameters_without_a_gradient_are_left_alone() {
        let config = AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let mut params = vec![Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true)];
        let mut opt = AdamW::new(config, &params, vec![true]);
        opt.apply(&mut params, 0.1);
        assert_eq!(Vec::<f32>::try_from(params[0].detach()).unwrap(), vec![1.0, 2.0]);
        assert_eq!(opt.step, 1);
    }
}

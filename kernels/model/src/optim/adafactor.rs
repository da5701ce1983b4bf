//! Adafactor (Shazeer & Stern 2018) as Hugging Face transformers' `Adafactor` computes it: for a
//! parameter of two or more dimensions the second moment is factored — a running mean of the squared
//! gradient over its last dimension (`row`, one value per row) and over its second-to-last (`col`, one
//! per column), their product over the row mean standing in for the full matrix — and for a vector it is
//! kept whole; the update is the gradient over the root of that estimate, its RMS clipped to
//! `clip_threshold`, times a step size that is relative (`min(1e-2, 1/√t)`) or the schedule's, scaled
//! by the parameter's RMS; an optional first moment smooths it; weight decay is decoupled (times the
//! step size). libtorch ops per tensor.
//!
//! The state of a parameter of `n` elements, packed into two flat ranges of `n` values each (the
//! "slots" that checkpoints, buddy copies and AdamW's `exp_avg`/`exp_avg_sq` share): slot 0 the first
//! moment (zeros without `beta1`); slot 1 the unfactored second moment, or `row` then `col` then zeros.
//! A matrix with a single row keeps only `col` there: its row ratio is exactly 1 whatever `row` holds,
//! so ones come back in its place and the updates are the same bits. A matrix with a single column and
//! several rows (`row` alone fills the range) cannot be packed and is refused at config time
//! ([`check_packable`]).

use tch::{Kind, Tensor};

use crate::sections::AdafactorConfig;

/// One parameter's Adafactor state.
#[derive(Debug)]
pub struct AdafactorState {
    /// The first moment, shaped like the parameter (only with `beta1`).
    pub exp_avg: Option<Tensor>,
    pub second: SecondMoment,
}

/// The running mean of the squared gradient (plus `eps1`).
#[derive(Debug)]
pub enum SecondMoment {
    /// A parameter of two or more dimensions: the mean over its last dimension (`row`, shape
    /// `shape[..-1]`) and over its second-to-last (`col`, shape `shape[..-2] + shape[-1]`).
    Factored { row: Tensor, col: Tensor },
    /// A vector: elementwise (`exp_avg_sq`).
    Full(Tensor),
}

/// Adafactor state for an ordered parameter list.
#[derive(Debug)]
pub struct Adafactor {
    pub config: AdafactorConfig,
    /// Updates applied so far (the `t` of the decay `1 - t^decay_rate` and of the relative step).
    pub step: u64,
    pub states: Vec<AdafactorState>,
    /// Per parameter: whether weight decay applies.
    decays: Vec<bool>,
}

impl Adafactor {
    pub fn new(config: AdafactorConfig, params: &[Tensor], decays: Vec<bool>) -> Self {
        assert_eq!(params.len(), decays.len());
        let states = params.iter().map(|p| fresh_state(&config, &p.size(), p.device())).collect();
        Self { config, step: 0, states, decays }
    }

    /// One update of every parameter from its `.grad()`; `lr` is the schedule's rate, used only without
    /// `relative_step`. Parameters without a gradient are left alone.
    pub fn apply(&mut self, params: &mut [Tensor], lr: f64) {
        self.apply_then(params, lr, &mut |_, _| {});
    }

    /// [`Self::apply`], calling `each(i, param)` as soon as parameter `i` is updated (see
    /// [`crate::optim::offload`]).
    pub fn apply_then(&mut self, params: &mut [Tensor], lr: f64, each: &mut dyn FnMut(usize, &Tensor)) {
        self.step += 1;
        let beta2t = 1.0 - (self.step as f64).powf(self.config.decay_rate);
        tch::no_grad(|| {
            for (i, param) in params.iter_mut().enumerate() {
                let grad = param.grad();
                if grad.defined() {
                    self.update(i, param, &grad, lr, beta2t);
                    each(i, param);
                }
            }
        });
    }

    /// HF's `_get_lr`: the relative or the scheduled step size, times the parameter's RMS (at least
    /// `eps2`) with `scale_parameter`.
    pub fn step_size(&self, param: &Tensor, lr: f64) -> f64 {
        let c = &self.config;
        let t = self.step as f64;
        let base = if c.relative_step {
            let min_step = if c.warmup_init { 1e-6 * t } else { 1e-2 };
            min_step.min(1.0 / t.sqrt())
        } else {
            lr
        };
        if c.scale_parameter {
            base * c.eps2.max(rms(param))
        } else {
            base
        }
    }

    fn update(&mut self, i: usize, param: &mut Tensor, grad: &Tensor, lr: f64, beta2t: f64) {
        let c = self.config.clone();
        let step_size = self.step_size(param, lr);
        let squared = grad.square() + c.eps1;
        let state = &mut self.states[i];
        let mut update = match &mut state.second {
            SecondMoment::Factored { row, col } => {
                let _ = row.g_mul_scalar_(beta2t).g_add_(&(squared.mean_dim(-1, false, Kind::Float) * (1.0 - beta2t)));
                let _ = col.g_mul_scalar_(beta2t).g_add_(&(squared.mean_dim(-2, false, Kind::Float) * (1.0 - beta2t)));
                let r_factor = (&*row / row.mean_dim(-1, true, Kind::Float)).rsqrt().unsqueeze(-1);
                let c_factor = col.unsqueeze(-2).rsqrt();
                (r_factor * c_factor) * grad
            }
            SecondMoment::Full(v) => {
                let _ = v.g_mul_scalar_(beta2t).g_add_(&(squared * (1.0 - beta2t)));
                v.rsqrt() * grad
            }
        };
        let clip = (rms(&update) / c.clip_threshold).max(1.0);
        update = update / clip * step_size;
        if let (Some(m), Some(beta1)) = (&mut state.exp_avg, c.beta1) {
            let _ = m.g_mul_scalar_(beta1).g_add_(&(update * (1.0 - beta1)));
            update = m.shallow_clone();
        }
        if self.decays[i] && c.weight_decay != 0.0 {
            let _ = param.g_add_(&(&*param * (-c.weight_decay * step_size)));
        }
        let _ = param.g_sub_(&update);
    }

    /// The state tensors, named after HF's (`exp_avg.{i}`, `exp_avg_sq_row.{i}`, `exp_avg_sq_col.{i}`,
    /// `exp_avg_sq.{i}`), in parameter order.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, state) in self.states.iter().enumerate() {
            if let Some(m) = &state.exp_avg {
                out.push((format!("exp_avg.{i}"), m.shallow_clone()));
            }
            match &state.second {
                SecondMoment::Factored { row, col } => {
                    out.push((format!("exp_avg_sq_row.{i}"), row.shallow_clone()));
                    out.push((format!("exp_avg_sq_col.{i}"), col.shallow_clone()));
                }
                SecondMoment::Full(v) => out.push((format!("exp_avg_sq.{i}"), v.shallow_clone())),
            }
        }
        out
    }

    /// Parameter `i`'s state packed into its two slots (see the module doc), each shaped like `param`.
    pub fn packed(&self, i: usize, param: &Tensor) -> [Tensor; 2] {
        let state = &self.states[i];
        let first = state.exp_avg.as_ref().map_or_else(|| param.detach().zeros_like(), Tensor::copy);
        let second = match &state.second {
            SecondMoment::Full(v) => v.copy(),
            SecondMoment::Factored { row, col } => {
                let shape = param.size();
                let mut parts = vec![col.flatten(0, -1)];
                if !single_row(&shape) {
                    parts.insert(0, row.flatten(0, -1));
                }
                let used: i64 = parts.iter().map(|p| p.numel() as i64).sum();
                let n = param.numel() as i64;
                assert!(used <= n, "Adafactor state of shape {shape:?} does not pack (refused at config time)");
                let pad = Tensor::zeros([n - used], (Kind::Float, param.device()));
                parts.push(pad);
                Tensor::cat(&parts, 0).view(shape.as_slice())
            }
        };
        [first, second]
    }

    /// Sets parameter `i`'s state from its two packed slots (as [`Self::packed`] made them).
    pub fn unpack(&mut self, i: usize, [first, second]: [Tensor; 2]) {
        let state = &mut self.states[i];
        if state.exp_avg.is_some() {
            state.exp_avg = Some(first);
        }
        let shape = second.size();
        let flat = second.flatten(0, -1);
        match &mut state.second {
            SecondMoment::Full(v) => *v = second,
            SecondMoment::Factored { row, col } => {
                let (row_n, col_n) = (row.numel() as i64, col.numel() as i64);
                if single_row(&shape) {
                    *row = row.ones_like();
                    *col = flat.narrow(0, 0, col_n).view(col.size().as_slice()).copy();
                } else {
                    *col = flat.narrow(0, row_n, col_n).view(col.size().as_slice()).copy();
                    *row = flat.narrow(0, 0, row_n).view(row.size().as_slice()).copy();
                }
            }
        }
    }

    /// Empties the state (an engine that keeps it elsewhere).
    pub fn clear_state(&mut self) {
        self.states.clear();
    }
}

/// A fresh (zero) state for a parameter of `shape` (HF: factored from two dimensions up).
fn fresh_state(config: &AdafactorConfig, shape: &[i64], device: tch::Device) -> AdafactorState {
    let zeros = |s: &[i64]| Tensor::zeros(s, (Kind::Float, device));
    let exp_avg = config.beta1.map(|_| zeros(shape));
    let second = if shape.len() >= 2 {
        let row = zeros(&shape[..shape.len() - 1]);
        let col_shape: Vec<i64> = shape[..shape.len() - 2].iter().chain(&shape[shape.len() - 1..]).copied().collect();
        SecondMoment::Factored { row, col: zeros(&col_shape) }
    } else {
        SecondMoment::Full(zeros(shape))
    };
    AdafactorState { exp_avg, second }
}

/// Whether a factored parameter's second-to-last dimension is 1: its row ratio is exactly 1.
fn single_row(shape: &[i64]) -> bool {
    shape.len() >= 2 && shape[shape.len() - 2] == 1
}

/// Whether a parameter of `shape` packs into its two slots: every shape but a matrix (or higher) of one
/// column and several rows, whose `row` statistics alone fill the slot.
pub fn check_packable(shape: &[i64]) -> Result<(), String> {
    let n = shape.len();
    if n >= 2 && shape[n - 1] == 1 && shape[n - 2] > 1 {
        return Err(format!(
            "shape {shape:?} (one column) has factored statistics larger than the parameter, which troupe's \
             checkpoint slots cannot hold"
        ));
    }
    Ok(())
}

/// HF's `_rms`: the L2 norm over the square root of the element count.
fn rms(t: &Tensor) -> f64 {
    let n = t.numel();
    if n == 0 {
        return 0.0;
    }
    t.norm().double_value(&[]) / (n as f64).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AdafactorConfig {
        AdafactorConfig { beta1: Some(0.9), weight_decay: 0.01, ..AdafactorConfig::default() }
    }

    /// Parameters of every kind of shape, their gradients set from `seed`.
    fn params_with_grads(seed: i64) -> Vec<Tensor> {
        tch::manual_seed(seed);
        let shapes: [&[i64]; 5] = [&[12, 7], &[9], &[1, 6], &[2, 3, 4], &[5, 2]];
        shapes
            .iter()
            .map(|s| {
                let p = Tensor::randn(*s, (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
                (&p * Tensor::randn(*s, (Kind::Float, tch::Device::Cpu))).sum(Kind::Float).backward();
                p
            })
            .collect()
    }

    #[test]
    fn matrices_keep_row_and_column_statistics_and_vectors_the_whole_moment() {
        let params = params_with_grads(1);
        let opt = Adafactor::new(config(), &params, vec![true; params.len()]);
        let shapes: Vec<(String, Vec<i64>)> = opt.state_tensors().into_iter().map(|(n, t)| (n, t.size())).collect();
        assert!(shapes.contains(&("exp_avg_sq_row.0".into(), vec![12])), "{shapes:?}");
        assert!(shapes.contains(&("exp_avg_sq_col.0".into(), vec![7])), "{shapes:?}");
        assert!(shapes.contains(&("exp_avg_sq.1".into(), vec![9])), "{shapes:?}");
        assert!(shapes.contains(&("exp_avg_sq_row.3".into(), vec![2, 3])), "{shapes:?}");
        assert!(shapes.contains(&("exp_avg_sq_col.3".into(), vec![2, 4])), "{shapes:?}");
        assert!(shapes.contains(&("exp_avg.0".into(), vec![12, 7])), "{shapes:?}");
    }

    /// A copy of `params` (values and gradients) as fresh leaves.
    fn twin(params: &[Tensor]) -> Vec<Tensor> {
        params
            .iter()
            .map(|p| {
                let q = p.detach().copy().set_requires_grad(true);
                (&q * p.grad()).sum(Kind::Float).backward();
                q
            })
            .collect()
    }

    #[test]
    fn packed_state_unpacks_to_the_same_updates() {
        let mut params = params_with_grads(2);
        let n = params.len();
        let mut a = Adafactor::new(config(), &params, vec![true; n]);
        a.apply(&mut params, 0.0);
        // A fresh optimizer given the packed state (and the step) continues with the same bits.
        let mut restored_params = twin(&params);
        let mut b = Adafactor::new(config(), &restored_params, vec![true; n]);
        b.step = a.step;
        for i in 0..n {
            b.unpack(i, a.packed(i, &params[i]));
        }
        a.apply(&mut params, 0.0);
        b.apply(&mut restored_params, 0.0);
        for (x, y) in params.iter().zip(&restored_params) {
            assert!(x.detach().equal(&y.detach()), "restored state gave other bits");
        }
        // Without the state the second step differs: the comparison above proves something.
        let mut fresh_params = twin(&restored_params);
        let mut fresh = Adafactor::new(config(), &fresh_params, vec![true; n]);
        fresh.step = a.step - 1;
        fresh.apply(&mut fresh_params, 0.0);
        b.apply(&mut restored_params, 0.0);
        assert!(!fresh_params[0].detach().equal(&restored_params[0].detach()));
    }

    #[test]
    fn one_column_matrices_are_refused_and_one_row_matrices_pack() {
        assert!(check_packable(&[5, 1]).is_err());
        assert!(check_packable(&[3, 5, 1]).is_err());
        for ok in [&[1, 5][..], &[5, 5], &[7], &[1, 1], &[2, 1, 3]] {
            assert!(check_packable(ok).is_ok(), "{ok:?}");
        }
    }
}

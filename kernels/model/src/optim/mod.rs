//! The optimizer (`train.optimizer`: AdamW or Adafactor) on the parameter list, the learning-rate
//! schedule and gradient clipping.
//!
//! What engines and checkpoints move of an optimizer is its state tensors ([`Optimizer::state_tensors`],
//! named) or, in the flat per-parameter layout the checkpoints, buddy copies and shards share, its two
//! *slots* per parameter ([`Optimizer::packed`], [`Optimizer::unpack`]): AdamW's `exp_avg` and
//! `exp_avg_sq` as they are; Adafactor's first moment and its packed second-moment statistics (see
//! [`adafactor`]). So an AdamW checkpoint keeps its format, and an Adafactor one uses the same.
//!
//! Where Adafactor runs (checked at config time, [`validate`]): the reference trainer and DDP, whose
//! ranks each hold the whole optimizer state and apply the same update, and ZeRO-1/2/3, whose owners
//! update their flat ranges with [`adafactor_shard`] (the per-matrix statistics replicated, their sums
//! all-reduced) — in a data-parallel group, or in a pipeline stage's group over the device's flat order.
//! Tensor parallelism updates its flat shards with AdamW's elementwise kernel (a matrix's statistics
//! would need sums over the tensor group): refused with Adafactor.

use tch::Tensor;

use crate::sections::{ConfigError, TrainConfig};

pub mod adafactor;
pub mod adafactor_shard;
pub mod adamw;
mod clipping;
pub mod offload;
mod schedule;

pub use adafactor::Adafactor;
pub use adamw::{AdamW, AdamWConfig};
pub use clipping::{clip_coefficient, clip_grad_norm, grad_norm, scale_grads};
pub use schedule::learning_rate;

/// `train.optimizer`'s values.
pub const OPTIMIZERS: [&str; 2] = ["adamw", "adafactor"];

/// A trainer's optimizer.
#[derive(Debug)]
pub enum Optimizer {
    AdamW(AdamW),
    Adafactor(Adafactor),
}

impl Optimizer {
    /// The optimizer `train.optimizer` names (checked by [`validate`]), fresh, for `params`.
    pub fn new(train: &TrainConfig, params: &[Tensor], decays: Vec<bool>) -> Self {
        match train.optimizer.as_str() {
            "adafactor" => Self::Adafactor(Adafactor::new(train.adafactor.clone(), params, decays)),
            _ => Self::AdamW(AdamW::new(AdamWConfig::from(train), params, decays)),
        }
    }

    /// One update of every parameter from its `.grad()` at the schedule's rate `lr`.
    pub fn apply(&mut self, params: &mut [Tensor], lr: f64) {
        match self {
            Self::AdamW(o) => o.apply(params, lr),
            Self::Adafactor(o) => o.apply(params, lr),
        }
    }

    /// [`Self::apply`], calling `each(i, param)` as soon as parameter `i` is updated.
    pub fn apply_then(&mut self, params: &mut [Tensor], lr: f64, each: &mut dyn FnMut(usize, &Tensor)) {
        match self {
            Self::AdamW(o) => o.apply_then(params, lr, each),
            Self::Adafactor(o) => o.apply_then(params, lr, each),
        }
    }

    /// Updates applied so far.
    pub fn step(&self) -> u64 {
        match self {
            Self::AdamW(o) => o.step,
            Self::Adafactor(o) => o.step,
        }
    }

    pub fn set_step(&mut self, step: u64) {
        match self {
            Self::AdamW(o) => o.step = step,
            Self::Adafactor(o) => o.step = step,
        }
    }

    /// The AdamW inside, for the engines that run AdamW only (pipelines, tensor parallelism: an
    /// Adafactor job never reaches them, [`validate`]).
    pub fn adamw(&self) -> &AdamW {
        match self {
            Self::AdamW(o) => o,
            Self::Adafactor(_) => panic!("{}", adamw_only()),
        }
    }

    /// [`Self::adamw`], mutable.
    pub fn adamw_mut(&mut self) -> &mut AdamW {
        match self {
            Self::AdamW(o) => o,
            Self::Adafactor(_) => panic!("{}", adamw_only()),
        }
    }

    /// Every state tensor, named, in a fixed order (the same on every rank of a job).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        match self {
            Self::AdamW(o) => {
                let named = |what: &str, list: &[Tensor]| {
                    list.iter().enumerate().map(|(i, t)| (format!("{what}.{i}"), t.shallow_clone())).collect::<Vec<_>>()
                };
                let mut all = named("exp_avg", &o.exp_avg);
                all.extend(named("exp_avg_sq", &o.exp_avg_sq));
                all
            }
            Self::Adafactor(o) => o.state_tensors(),
        }
    }

    /// Elements of state held (what the memory reports count).
    pub fn state_numel(&self) -> usize {
        self.state_tensors().iter().map(|(_, t)| t.numel()).sum()
    }

    /// Parameter `i`'s state as its two slots, each shaped like `param` (AdamW: its moments, shared).
    pub fn packed(&self, i: usize, param: &Tensor) -> [Tensor; 2] {
        match self {
            Self::AdamW(o) => [o.exp_avg[i].shallow_clone(), o.exp_avg_sq[i].shallow_clone()],
            Self::Adafactor(o) => o.packed(i, param),
        }
    }

    /// Sets parameter `i`'s state from its two slots (as [`Self::packed`] gives them).
    pub fn unpack(&mut self, i: usize, slots: [Tensor; 2]) {
        match self {
            Self::AdamW(o) => {
                let [exp_avg, exp_avg_sq] = slots;
                o.exp_avg[i] = exp_avg;
                o.exp_avg_sq[i] = exp_avg_sq;
            }
            Self::Adafactor(o) => o.unpack(i, slots),
        }
    }

    /// Empties the state: an engine that keeps it as shards elsewhere.
    pub fn clear_state(&mut self) {
        match self {
            Self::AdamW(o) => {
                o.exp_avg.clear();
                o.exp_avg_sq.clear();
            }
            Self::Adafactor(o) => o.clear_state(),
        }
    }
}

fn adamw_only() -> String {
    "this engine runs AdamW only; train.optimizer = \"adafactor\" is refused at config time for it".into()
}

/// The `train.optimizer` keys: a known optimizer, Adafactor's hyper-parameters in range, its state
/// packable for every parameter (`shapes`: the model's names and shapes). Every parallel layout runs it:
/// the reference trainer, DDP, ZeRO-1/2/3, pipelines with or without ZeRO in their stage groups, tensor
/// parallelism with data parallelism, inside a pipeline and with ZeRO, and as the inner optimizer of
/// local SGD and DiLoCo, which each replica runs whole on its own parameters.
pub fn validate<'a>(
    train: &TrainConfig,
    shapes: impl IntoIterator<Item = (&'a str, &'a [i64])>,
) -> Result<(), ConfigError> {
    let name = train.optimizer.as_str();
    if !OPTIMIZERS.contains(&name) {
        return Err(invalid("train.optimizer", format!("{name:?}"), "must be \"adamw\" or \"adafactor\"".into()));
    }
    if name != "adafactor" {
        return Ok(());
    }
    validate_adafactor(&train.adafactor)?;
    for (param, shape) in shapes {
        if let Err(why) = adafactor::check_packable(shape) {
            return Err(invalid("train.optimizer", "\"adafactor\"".into(), format!("parameter {param}: {why}")));
        }
    }
    Ok(())
}

/// `[train.adafactor]`'s values in range.
fn validate_adafactor(a: &crate::sections::AdafactorConfig) -> Result<(), ConfigError> {
    let checks: [(&'static str, f64, bool, &str); 5] = [
        ("train.adafactor.eps1", a.eps1, a.eps1 >= 0.0, "must be ≥ 0, e.g. 1e-30"),
        ("train.adafactor.eps2", a.eps2, a.eps2 >= 0.0, "must be ≥ 0, e.g. 1e-3"),
        ("train.adafactor.clip_threshold", a.clip_threshold, a.clip_threshold > 0.0, "must be > 0, e.g. 1.0"),
        ("train.adafactor.decay_rate", a.decay_rate, a.decay_rate < 0.0, "must be < 0, e.g. -0.8"),
        ("train.adafactor.weight_decay", a.weight_decay, a.weight_decay >= 0.0, "must be ≥ 0, e.g. 0.0"),
    ];
    for (key, value, ok, allowed) in checks {
        if !(value.is_finite() && ok) {
            return Err(invalid(key, value.to_string(), allowed.into()));
        }
    }
    if let Some(beta1) = a.beta1.filter(|b| !(0.0..1.0).contains(b)) {
        return Err(invalid(
            "train.adafactor.beta1",
            beta1.to_string(),
            "must be in [0, 1), e.g. 0.9, or absent".into(),
        ));
    }
    Ok(())
}

fn invalid(key: &'static str, value: String, allowed: String) -> ConfigError {
    ConfigError::Invalid { key, value, allowed }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(optimizer: &str, shapes: &[(&str, &[i64])], expected: Result<(), &str>) {
        let train = TrainConfig { optimizer: optimizer.into(), ..TrainConfig::default() };
        let got = validate(&train, shapes.iter().copied()).map_err(|e| e.to_string());
        match (got, expected) {
            (Ok(()), Ok(())) => {}
            (Err(e), Err(want)) => assert!(e.contains(want), "{e:?} should name {want:?}"),
            (got, want) => panic!("{optimizer}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn config_names_a_known_optimizer_whose_state_packs() {
        let matrix: &[(&str, &[i64])] = &[("w", &[4, 3]), ("b", &[3])];
        check("adamw", matrix, Ok(()));
        check("adafactor", matrix, Ok(()));
        check("adam", matrix, Err("train.optimizer"));
        check("adafactor", &[("lora_b", &[8, 1])], Err("lora_b"));
    }

    #[test]
    fn adafactor_hyper_parameters_out_of_range_name_their_key() {
        let train = |a| TrainConfig { optimizer: "adafactor".into(), adafactor: a, ..TrainConfig::default() };
        let base = crate::sections::AdafactorConfig::default();
        for (a, key) in [
            (crate::sections::AdafactorConfig { beta1: Some(1.0), ..base.clone() }, "train.adafactor.beta1"),
            (crate::sections::AdafactorConfig { decay_rate: 0.5, ..base.clone() }, "train.adafactor.decay_rate"),
            (crate::sections::AdafactorConfig { clip_threshold: 0.0, ..base }, "train.adafactor.clip_threshold"),
        ] {
            let e = validate(&train(a), []).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }
}

//! Mixed precision: compute in 16 bits on fp32 master weights, and fp16's dynamic loss scaling.
//!
//! **Compute** follows `torch.autocast`: the parameters stay fp32 leaves (the masters, the optimizer's
//! and the shard owners' state), and only the matrix products — the linear layers and attention — run in
//! the 16-bit kind, on copies cast at use. Everything else runs in fp32 by type promotion: the embeddings,
//! every LayerNorm, the residual stream (fp32 + 16-bit = fp32), the softmax and cross-entropy of the loss.
//! Autograd casts each product's weight gradient back to fp32 as it reaches its master, so gradients,
//! their all-reduce, clipping and AdamW are fp32 whatever the compute precision, and so are the
//! activations that cross a pipeline stage boundary (the residual stream).
//!
//! **Loss scaling** (fp16 only; bf16 has fp32's exponent range): the loss is multiplied by a scale S
//! before the backward so small gradients survive fp16, and the update sees the gradients divided by S.
//! The division is folded into the clipping factor — one pass over the gradients, exact because S is a
//! power of two. A step whose gradient norm is not finite (an fp16 overflow somewhere in some rank's
//! backward: the norm is global, so every rank sees it) is skipped — no update, the optimizer's step
//! counter unchanged, the batch consumed — and S halves; after `loss_scale_window` clean steps in a row
//! S doubles. This is `torch.cuda.amp.GradScaler`'s policy with its defaults (2¹⁶, ×2 per 2000 clean
//! steps, ×½ on overflow).

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::optim::clip_coefficient;
use crate::sections::{ParallelConfig, TrainConfig};

/// The kind the matrix products compute in (`parallel.precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    /// The precision `parallel.precision` names (validated: anything else is fp32).
    pub fn of_config(parallel: &ParallelConfig) -> Self {
        match parallel.precision.as_str() {
            "bf16" => Self::Bf16,
            "fp16" => Self::Fp16,
            _ => Self::Fp32,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    /// The tensor kind of the products.
    pub fn kind(self) -> Kind {
        match self {
            Self::Fp32 => Kind::Float,
            Self::Bf16 => Kind::BFloat16,
            Self::Fp16 => Kind::Half,
        }
    }

    /// Whether the loss is scaled (fp16's narrow exponent range).
    pub fn scales_loss(self) -> bool {
        self == Self::Fp16
    }

    /// `x · wᵀ + b` in this precision: fp32 as is; otherwise input, weight and bias cast to the 16-bit
    /// kind (the cast is part of the graph, so the weight's gradient arrives in fp32).
    pub fn linear(self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
        if self == Self::Fp32 {
            return x.linear(weight, bias);
        }
        let kind = self.kind();
        x.to_kind(kind).linear(&weight.to_kind(kind), bias.map(|b| b.to_kind(kind)))
    }
}

/// The loss scaler's state: part of the training state (checkpointed, carried to joiners).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    /// The factor the loss is multiplied by before the backward (1 when the precision does not scale).
    pub scale: f64,
    /// Clean steps since the scale last changed.
    pub clean_steps: u64,
    /// Steps skipped for a non-finite gradient, over the whole run.
    pub skipped_steps: u64,
}

impl LossScale {
    /// The state a fresh run of `parallel` starts from.
    pub fn initial(parallel: &ParallelConfig) -> Self {
        let scale = if Precision::of_config(parallel).scales_loss() { parallel.loss_scale_init } else { 1.0 };
        Self { scale, clean_steps: 0, skipped_steps: 0 }
    }

    /// The state to continue `parallel`'s run from, given one saved by a run of `saved_precision`: kept
    /// when both scale the loss, the fresh state otherwise (a precision change on resume).
    pub fn resumed(parallel: &ParallelConfig, saved_precision: &str, saved: Option<Self>) -> Self {
        let scales = Precision::of_config(parallel).scales_loss();
        match saved {
            Some(saved) if scales && saved_precision == parallel.precision => saved,
            _ => Self::initial(parallel),
        }
    }

    /// What a committed step does, given the global L2 norm of its gradients as computed (at this
    /// scale), and advances the scaler: the norm is non-finite only where an fp16 backward overflowed.
    /// `grad_clip` is `train.grad_clip` (0: no clipping); `window` is `parallel.loss_scale_window`.
    pub fn conclude(&mut self, precision: Precision, scaled_norm: f64, grad_clip: f64, window: u64) -> Update {
        let (grad_norm, skips) = self.preview(precision, scaled_norm);
        if precision.scales_loss() {
            if skips {
                self.scale = (self.scale * 0.5).max(f64::MIN_POSITIVE);
                self.clean_steps = 0;
                self.skipped_steps += 1;
                return Update::Skip { grad_norm };
            }
            self.clean_steps += 1;
        }
        let factor = clip_coefficient(grad_clip, grad_norm) / self.scale;
        if precision.scales_loss() && self.clean_steps >= window.max(1) {
            self.scale *= 2.0;
            self.clean_steps = 0;
        }
        Update::Apply { grad_norm, grad_factor: factor }
    }

    /// What [`Self::conclude`] will make of a step whose scaled gradients have global norm
    /// `scaled_norm`, without changing anything: (the true norm, whether the step is skipped) — what a
    /// rank reports in its vote.
    pub fn preview(&self, precision: Precision, scaled_norm: f64) -> (f64, bool) {
        (scaled_norm / self.scale, precision.scales_loss() && !scaled_norm.is_finite())
    }

    /// The five f32 words a broadcast carries this state in (scale exact: a power of two; counters in
    /// 24-bit halves).
    pub fn to_words(self) -> [f32; 5] {
        let split = |v: u64| [(v >> 24) as f32, (v & 0xFF_FFFF) as f32];
        let (c, s) = (split(self.clean_steps), split(self.skipped_steps));
        [self.scale as f32, c[0], c[1], s[0], s[1]]
    }

    pub fn from_words(words: [f32; 5]) -> Self {
        let join = |hi: f32, lo: f32| ((hi as u64) << 24) | lo as u64;
        Self {
            scale: f64::from(words[0]),
            clean_steps: join(words[1], words[2]),
            skipped_steps: join(words[3], words[4]),
        }
    }
}

/// The factor micro-batch `micro` (samples of the global batch) of `step` multiplies its mean loss by
/// before its backward: its share of the global batch, times the loss scale — times ∞ for the
/// micro-batch that holds sample 0 (rank 0's first) when `train.inject_overflow_at` names the step.
pub fn backward_weight(train: &TrainConfig, scale: &LossScale, step: u64, micro: &Range<usize>) -> f64 {
    let share = micro.len() as f64 / train.global_batch as f64;
    let injected = micro.start == 0 && train.inject_overflow_at.contains(&step);
    share * scale.scale * if injected { f64::INFINITY } else { 1.0 }
}

/// What a committed step's update does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    /// Multiply every gradient by `grad_factor` (unscale and clip in one; 1 means leave them alone), then
    /// AdamW. `grad_norm`: the true (unscaled) global norm before clipping.
    Apply { grad_norm: f64, grad_factor: f64 },
    /// The gradients overflowed: no update; the scale was halved.
    Skip { grad_norm: f64 },
}

impl Update {
    pub fn grad_norm(&self) -> f64 {
        match *self {
            Self::Apply { grad_norm, .. } | Self::Skip { grad_norm } => grad_norm,
        }
    }

    pub fn skipped(&self) -> bool {
        matches!(self, Self::Skip { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp16(window: u64) -> ParallelConfig {
        ParallelConfig { precision: "fp16".into(), loss_scale_window: window, ..ParallelConfig::default() }
    }

    #[test]
    fn fp32_and_bf16_never_scale_nor_skip() {
        for precision in ["fp32", "bf16"] {
            let parallel = ParallelConfig { precision: precision.into(), ..ParallelConfig::default() };
            let mut scale = LossScale::initial(&parallel);
            assert_eq!(scale.scale, 1.0);
            let update = scale.conclude(Precision::of_config(&parallel), f64::NAN, 1.0, 1);
            assert!(!update.skipped(), "{precision}: no scaler, no skipping");
            assert_eq!(scale.scale, 1.0);
            // Without clipping the factor is exactly 1 (the gradients are left alone).
            assert_eq!(
                scale.conclude(Precision::Fp32, 3.0, 0.0, 1),
                Update::Apply { grad_norm: 3.0, grad_factor: 1.0 }
            );
        }
    }

    #[test]
    fn overflow_halves_and_skips_clean_steps_grow_after_the_window() {
        let parallel = fp16(3);
        let mut scale = LossScale::initial(&parallel);
        assert_eq!(scale.scale, 65536.0);
        let update = scale.conclude(Precision::Fp16, f64::INFINITY, 1.0, 3);
        assert!(update.skipped());
        assert_eq!((scale.scale, scale.skipped_steps, scale.clean_steps), (32768.0, 1, 0));
        for _ in 0..2 {
            scale.conclude(Precision::Fp16, 32768.0 * 0.5, 1.0, 3);
            assert_eq!(scale.scale, 32768.0);
        }
        // The third clean step in a row doubles the scale (for the next step).
        let update = scale.conclude(Precision::Fp16, 32768.0 * 0.5, 1.0, 3);
        assert_eq!(update, Update::Apply { grad_norm: 0.5, grad_factor: 1.0 / 32768.0 });
        assert_eq!((scale.scale, scale.clean_steps), (65536.0, 0));
        assert!(scale.conclude(Precision::Fp16, f64::NAN, 1.0, 3).skipped());
        assert_eq!((scale.scale, scale.skipped_steps), (32768.0, 2));
    }

    #[test]
    fn the_factor_unscales_and_clips_in_one() {
        let mut scale = LossScale { scale: 1024.0, clean_steps: 0, skipped_steps: 0 };
        // Scaled norm 4096 → true norm 4; clipped to 1: factor (1 / (4 + 1e-6)) / 1024.
        match scale.conclude(Precision::Fp16, 4096.0, 1.0, 2000) {
            Update::Apply { grad_norm, grad_factor } => {
                assert_eq!(grad_norm, 4.0);
                assert!((grad_factor - 1.0 / (4.0 + 1e-6) / 1024.0).abs() < 1e-18);
            }
            skip => panic!("{skip:?}"),
        }
    }

    #[test]
    fn words_round_trip_and_resume_keeps_only_a_matching_scaler() {
        let state = LossScale { scale: 2f64.powi(-3), clean_steps: (1 << 30) + 5, skipped_steps: 77 };
        assert_eq!(LossScale::from_words(state.to_words()), state);
        let parallel = fp16(2000);
        assert_eq!(LossScale::resumed(&parallel, "fp16", Some(state)), state);
        assert_eq!(LossScale::resumed(&parallel, "fp32", Some(state)), LossScale::initial(&parallel));
        assert_eq!(LossScale::resumed(&parallel, "fp16", None), LossScale::initial(&parallel));
    }
}

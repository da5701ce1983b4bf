//! The learning-rate schedule: linear warmup, then cosine decay.

use crate::sections::TrainConfig;

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
}

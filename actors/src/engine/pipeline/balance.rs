//! `parallel.balance = "measured"`: what each part of the model costs in seconds of forward and backward
//! on one micro-batch of the job's shape, timed here, for [`super::partition_by`].
//!
//! Parameter counts miss what has no parameters — attention over the context, the softmax and loss over
//! the vocabulary — and count what costs little to run (an embedding is a lookup, however many rows it
//! has), so with a large vocabulary or a long context the parameter-balanced cut leaves the last stage
//! the slowest and every other stage waiting on it. Timing the parts sees both.
//!
//! Each part runs forward and backward (the gradients of its input and its parameters, as a stage's B
//! computes them) once to warm up and then [`REPEATS`] times; its cost is the median. Only one rank
//! measures (the others would share its cores and skew it) and broadcasts the figures, so every rank
//! cuts the same way; a process keeps what it measured per shape for the attempts that follow.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use tch::{Device, Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::model::{block, cross_entropy, embed, head, head_params, Model, ModelConfig};
use troupe_model::precision::Precision;

use super::partition::ModelCosts;

/// Timed runs of each part after the warm-up; the median counts.
pub const REPEATS: usize = 3;

/// What `config`'s chunks are balanced by when `replicas` pipelines each cut the global batch into
/// `microbatches`: parameter counts, or (`parallel.balance = "measured"`) [`measure`]d seconds on one
/// micro-batch of the largest replica's share, kept per model shape for this process.
pub fn costs_for(config: &JobConfig, replicas: usize, microbatches: usize) -> ModelCosts {
    if config.parallel.balance != "measured" {
        return ModelCosts::parameters(&config.model);
    }
    let samples = config.train.global_batch.div_ceil(replicas.max(1)).div_ceil(microbatches.max(1)).max(1);
    static MEASURED: OnceLock<Mutex<HashMap<String, ModelCosts>>> = OnceLock::new();
    let key = format!("{:?} {} {samples}", config.model, config.parallel.precision);
    let cache = MEASURED.get_or_init(Default::default);
    if let Some(costs) = cache.lock().expect("not poisoned").get(&key) {
        return costs.clone();
    }
    let costs = measure(&config.model, Precision::of_config(&config.parallel), samples);
    cache.lock().expect("not poisoned").insert(key, costs.clone());
    costs
}

/// Seconds of forward + backward of the embeddings, each block and the head with its loss, on `samples`
/// sequences of the model's context, in `precision`, on this thread's torch settings.
pub fn measure(model: &ModelConfig, precision: Precision, samples: usize) -> ModelCosts {
    // The times do not depend on the values: drawn ones, so a model from Hugging Face weights is not
    // read whole here.
    let shape = ModelConfig { from_hf: None, ..model.clone() };
    let gpt = Model::new(shape, 0).with_precision(precision);
    let params = gpt.params();
    let tokens = Tensor::arange((samples.max(1) * model.context) as i64, (Kind::Int64, Device::Cpu))
        .remainder(model.vocab_size as i64)
        .view([samples.max(1) as i64, model.context as i64]);
    let targets = tokens.roll([-1], [1]);
    let x = tch::no_grad(|| embed(model, &params[model.embed_range()], &tokens));
    // The gradient arriving from the next stage: any fixed tensor of the activation's shape.
    let incoming = x.ones_like() * 1e-3;

    let embed_cost = median_seconds(|| {
        let out = embed(model, &params[model.embed_range()], &tokens);
        backward((&out * &incoming).sum(Kind::Float), &params[model.embed_range()]);
    });
    let blocks = (0..model.n_layers)
        .map(|i| {
            let p = &params[model.block_range(i)];
            median_seconds(|| {
                let input = x.detach().set_requires_grad(true);
                let out = block(model, precision, i, p, &input);
                backward_with_input((&out * &incoming).sum(Kind::Float), &input, p);
            })
        })
        .collect();
    let p = &head_params(model, params);
    let head_cost = median_seconds(|| {
        let input = x.detach().set_requires_grad(true);
        let loss = cross_entropy(&head(model, precision, p, &input), &targets);
        backward_with_input(loss, &input, p);
    });
    ModelCosts { embed: embed_cost, blocks, head: head_cost }
}

fn backward(scalar: Tensor, params: &[Tensor]) {
    let _ = Tensor::run_backward(&[&scalar], params, false, false);
}

fn backward_with_input(scalar: Tensor, input: &Tensor, params: &[Tensor]) {
    let wrt: Vec<&Tensor> = std::iter::once(input).chain(params).collect();
    let _ = Tensor::run_backward(&[&scalar], &wrt, false, false);
}

/// The median of [`REPEATS`] timed runs of `run` after one untimed.
fn median_seconds(mut run: impl FnMut()) -> f64 {
    run();
    let mut times: Vec<f64> = (0..REPEATS)
        .map(|_| {
            let started = Instant::now();
            run();
            started.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[REPEATS / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::pipeline::partition_by;

    /// A vocabulary of 8,192 over d_model 64: the head's product and softmax cost about ten blocks, the
    /// embedding lookup next to nothing, while by parameters the two ends weigh the same (524,288 each).
    fn big_vocab() -> ModelConfig {
        ModelConfig { vocab_size: 8192, context: 32, d_model: 64, n_layers: 4, n_heads: 2, ..ModelConfig::gpt_tiny() }
    }

    #[test]
    fn measured_costs_see_the_heavy_head_that_parameter_counts_miss() {
        tch::set_num_threads(1);
        let model = big_vocab();
        let measured = measure(&model, Precision::Fp32, 4);
        let block_mean = measured.blocks.iter().sum::<f64>() / measured.blocks.len() as f64;
        assert!(measured.blocks.iter().all(|&b| b > 0.0), "{measured:?}");
        assert!(measured.head > 2.0 * block_mean, "head {} vs block {block_mean}", measured.head);
        assert!(measured.embed < measured.head, "{measured:?}");
        let by_params = partition_by(&model, &ModelCosts::parameters(&model), 2).unwrap();
        let by_time = partition_by(&model, &measured, 2).unwrap();
        assert_eq!(by_params[0].blocks, 0..2);
        assert!(by_time[0].blocks.end > 2, "measured {measured:?} cut {by_time:?}");
    }

    #[test]
    fn costs_follow_the_config_and_are_kept_per_shape() {
        let mut config = JobConfig::small(1);
        assert_eq!(costs_for(&config, 1, 2), ModelCosts::parameters(&config.model));
        config.parallel.balance = "measured".into();
        let first = costs_for(&config, 1, 2);
        assert_eq!(costs_for(&config, 1, 2), first, "kept, not measured again");
        assert_eq!(first.blocks.len(), config.model.n_layers);
    }
}

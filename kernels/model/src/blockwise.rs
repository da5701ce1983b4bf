//! One micro-batch's forward and backward run block by block, so that a caller learns the moment a group
//! of parameters has its final gradient — what lets DDP start a bucket's all-reduce while the rest of the
//! backward still computes (libtorch, through tch, has no per-parameter hooks) — and so that the forward
//! may keep only each block's input and recompute the block just before its backward (`--recompute`).
//!
//! The forward runs embed → blocks → head with every block boundary cut into a fresh leaf that requires
//! grad (`detach` + `set_requires_grad`). The backward starts from the weighted loss through the head
//! alone, then runs each block's backward from its output's gradient — the backward of the scalar
//! Σ(output · gradient), whose derivative is exactly that gradient — last block first, then the
//! embeddings. Autograd sums the same terms into each parameter's `.grad` as one monolithic
//! `(loss · weight).backward()` would, so the gradients equal the monolithic ones (to the bit in practice;
//! the unit test bounds them at 1e-6 relative).
//!
//! gpt-tiny has no dropout and no other randomness in its forward, so a recomputed block sees exactly the
//! inputs and computes exactly the function of the first forward: no RNG state needs replaying. A model
//! change that adds dropout must save and restore the generator state per block here.

use std::ops::Range;

use tch::{Kind, Tensor};

use crate::model::{self, ModelConfig};
use crate::precision::Precision;

/// What the forward keeps for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// Every block's autograd graph, as a monolithic backward keeps it.
    Keep,
    /// Only each block's input (computed without a graph); each block's forward is re-run with grad from
    /// its saved input just before its backward. Peak activation memory drops from every block's graph to
    /// the block inputs plus one block's graph, for one more forward of the blocks.
    Recompute,
}

impl Activations {
    /// `Recompute` when `recompute` (the job's `parallel.recompute`), else `Keep`.
    pub fn from_recompute(recompute: bool) -> Self {
        if recompute {
            Self::Recompute
        } else {
            Self::Keep
        }
    }
}

/// The parameter ranges (positions in [`model::param_specs`] order) in the order a block-wise backward makes
/// their gradients final: the head, the blocks from last to first, the embeddings. Together they cover
/// every parameter once, each range below the previous one.
pub fn backward_stages(config: &ModelConfig) -> Vec<Range<usize>> {
    std::iter::once(config.head_range())
        .chain((0..config.n_layers).rev().map(|i| config.block_range(i)))
        .chain(std::iter::once(config.embed_range()))
        .collect()
}

/// A block boundary as a leaf of its own: the same values, no history, requiring grad.
pub fn leaf(x: &Tensor) -> Tensor {
    x.detach().set_requires_grad(true)
}

/// Backward of `output` from its gradient `grad`: the backward of Σ(output · grad).
pub fn backward_from(output: &Tensor, grad: &Tensor) {
    (output * grad).sum(Kind::Float).backward();
}

/// Forward and backward of one micro-batch (`tokens`, `targets`: `[batch, time]`) on `params` (the whole
/// model in canonical order, fp32 leaves requiring grad): adds `weight` × the gradient of the
/// micro-batch's mean loss to every parameter's `.grad`, exactly as `(loss · weight).backward()` on the
/// monolithic model would, and calls `on_final(range)` after each of [`backward_stages`]' ranges has its
/// gradient for this micro-batch complete. The products compute in `precision`; a loss scale is part of
/// `weight`. `samples` names the micro-batch's samples (LoRA's dropout is a function of them). Returns the
/// micro-batch's mean loss (unweighted) as a scalar tensor where the model computes — reading it on a
/// GPU waits for the device, so a caller reads the losses of a step together.
#[allow(clippy::too_many_arguments)]
pub fn micro_batch_backward(
    config: &ModelConfig,
    precision: Precision,
    params: &[Tensor],
    tokens: &Tensor,
    targets: &Tensor,
    weight: f64,
    samples: Option<model::Samples>,
    activations: Activations,
    on_final: &mut dyn FnMut(Range<usize>),
) -> Tensor {
    assert_eq!(params.len(), config.param_tensors(), "parameter list length");
    let blocks = Blocks { config, precision, params, samples };
    let BlockForward { embedded, mut inputs, outputs } = blocks.forward(tokens, activations);

    // The head and the loss: the only monolithic part.
    let head_params = model::head_params(config, params);
    let head_input = leaf(&inputs.pop().expect("the head's input"));
    let loss = model::cross_entropy(&model::head(config, precision, &head_params, &head_input), targets);
    (&loss * weight).backward();
    on_final(config.head_range());

    // With `[peft]` the first parts may train nothing: the backward stops after the first that does.
    let trains = needs_backward(config);
    let grad = blocks.backward(head_input.grad(), (inputs, outputs), &trains, activations, on_final);
    if trains[0] {
        let embedded = embedded.unwrap_or_else(|| model::embed(config, &params[config.embed_range()], tokens));
        backward_from(&embedded, &grad);
    }
    on_final(config.embed_range());
    loss.detach()
}

/// The embeddings and blocks of the model on `params`, as one micro-batch runs them.
struct Blocks<'a> {
    config: &'a ModelConfig,
    precision: Precision,
    params: &'a [Tensor],
    samples: Option<model::Samples>,
}

/// What the forward through the embeddings and blocks keeps for the backward. Keep: `inputs[i]` is
/// block i's input as a leaf (the last: the head's input), `outputs[i]` its output with its graph,
/// `embedded` the embeddings' output with its graph. Recompute: `inputs[i]` is block i's input without any
/// graph; `outputs` is empty and `embedded` None.
struct BlockForward {
    embedded: Option<Tensor>,
    inputs: Vec<Tensor>,
    outputs: Vec<Tensor>,
}

impl Blocks<'_> {
    /// Block `i`'s training forward on `input`.
    fn block(&self, i: usize, input: &Tensor) -> Tensor {
        let params = &self.params[self.config.block_range(i)];
        model::block_training(self.config, self.precision, i, params, input, self.samples)
    }

    /// The forward of `tokens` through the embeddings and the blocks, keeping what `activations` says.
    fn forward(&self, tokens: &Tensor, activations: Activations) -> BlockForward {
        let (config, n) = (self.config, self.config.n_layers);
        let embed_params = &self.params[config.embed_range()];
        match activations {
            Activations::Keep => {
                let embedded = model::embed(config, embed_params, tokens);
                let mut inputs = vec![leaf(&embedded)];
                let mut outputs = Vec::with_capacity(n);
                for i in 0..n {
                    let output = self.block(i, &inputs[i]);
                    inputs.push(leaf(&output));
                    outputs.push(output);
                }
                BlockForward { embedded: Some(embedded), inputs, outputs }
            }
            Activations::Recompute => {
                let inputs = tch::no_grad(|| {
                    let mut inputs = vec![model::embed(config, embed_params, tokens)];
                    for i in 0..n {
                        let output = self.block(i, &inputs[i]);
                        inputs.push(output);
                    }
                    inputs
                });
                BlockForward { embedded: None, inputs, outputs: Vec::new() }
            }
        }
    }

    /// The backward through the blocks, last first, from `grad` (the gradient of the last block's output)
    /// over the forward's block `inputs` and (Keep) `outputs`: `on_final` after each block's, a block
    /// that `trains` says trains nothing skipped. Returns the gradient of the first block's input.
    fn backward(
        &self,
        mut grad: Tensor,
        (mut inputs, mut outputs): (Vec<Tensor>, Vec<Tensor>),
        trains: &[bool],
        activations: Activations,
        on_final: &mut dyn FnMut(Range<usize>),
    ) -> Tensor {
        for i in (0..self.config.n_layers).rev() {
            if !trains[1 + i] {
                on_final(self.config.block_range(i));
                continue;
            }
            let saved = inputs.pop().expect("block input");
            let (input, output) = match activations {
                Activations::Keep => (saved, outputs.pop().expect("block output")),
                Activations::Recompute => {
                    let input = leaf(&saved);
                    let output = self.block(i, &input);
                    (input, output)
                }
            };
            backward_from(&output, &grad);
            grad = input.grad();
            on_final(self.config.block_range(i));
        }
        grad
    }
}

/// Per part in forward order (the embeddings, then each block): whether a backward through it reaches a
/// trained parameter — it, or a part before it, has one. Without `[peft]`, every part.
pub fn needs_backward(config: &ModelConfig) -> Vec<bool> {
    let sizes =
        std::iter::once(config.embed_range().len()).chain((0..config.n_layers).map(|i| config.block_range(i).len()));
    sizes
        .scan(false, |seen, len| {
            *seen |= len > 0;
            Some(*seen)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::JobConfig;
    use crate::data::{load_corpus, GlobalSampler};
    use crate::model::Model;

    fn grads(model: &Model) -> Vec<Tensor> {
        model.params().iter().map(|p| p.grad().copy()).collect()
    }

    fn zero_grads(model: &mut Model) {
        for p in model.params_mut() {
            p.zero_grad();
        }
    }

    fn worst_relative(a: &[Tensor], b: &[Tensor]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(a, b)| {
                let diff = (a - b).norm().double_value(&[]);
                diff / b.norm().double_value(&[]).max(f64::MIN_POSITIVE)
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn stages_cover_every_parameter_once_in_descending_order() {
        let config = ModelConfig::gpt_tiny();
        let stages = backward_stages(&config);
        assert_eq!(stages.first(), Some(&(50..53)));
        assert_eq!(stages[1], 38..50);
        assert_eq!(stages.last(), Some(&(0..2)));
        for pair in stages.windows(2) {
            assert_eq!(pair[1].end, pair[0].start, "stages must be contiguous and descending");
        }
        assert_eq!(stages.iter().map(|r| r.len()).sum::<usize>(), model::param_specs(&config).len());
    }

    /// Two micro-batches accumulated block-wise, with and without recomputation, against the monolithic
    /// backward: the same gradients (1e-6 relative per tensor), the same losses, and every stage reported
    /// once per micro-batch in [`backward_stages`] order.
    #[test]
    fn blockwise_gradients_equal_the_monolithic_backward() {
        tch::set_num_threads(1);
        let mut config = JobConfig::small(1);
        config.model.n_layers = 3;
        let corpus = load_corpus(&config.data, &config.model).unwrap();
        let sampler = GlobalSampler::new(config.train.seed, corpus, config.model.context);
        let mut model = Model::new(config.model.clone(), config.train.seed);
        let micro_batches = [(0..2, 0.5), (2..4, 0.5)];

        zero_grads(&mut model);
        let mut reference_losses = Vec::new();
        for (range, weight) in micro_batches.clone() {
            let (tokens, targets) = sampler.batch(3, range);
            let loss = model.loss(&tokens, &targets);
            (&loss * weight).backward();
            reference_losses.push(loss.double_value(&[]));
        }
        let reference = grads(&model);

        for activations in [Activations::Keep, Activations::Recompute] {
            zero_grads(&mut model);
            let mut reported = Vec::new();
            let mut losses = Vec::new();
            for (range, weight) in micro_batches.clone() {
                let (tokens, targets) = sampler.batch(3, range);
                let params = model.params();
                let mut on_final = |r: Range<usize>| reported.push(r);
                losses.push(
                    micro_batch_backward(
                        &config.model,
                        Precision::Fp32,
                        params,
                        &tokens,
                        &targets,
                        weight,
                        None,
                        activations,
                        &mut on_final,
                    )
                    .double_value(&[]),
                );
            }
            let worst = worst_relative(&grads(&model), &reference);
            assert!(worst <= 1e-6, "{activations:?}: gradients differ by {worst:e} relative");
            for (a, b) in losses.iter().zip(&reference_losses) {
                assert!((a - b).abs() <= 1e-6 * b.abs(), "{activations:?}: loss {a} vs {b}");
            }
            let stages = backward_stages(&config.model);
            assert_eq!(reported, [stages.clone(), stages].concat(), "{activations:?}: stages reported");
        }
    }

    /// The reported range's gradients are final when reported: nothing later in the backward changes them.
    #[test]
    fn a_reported_stage_is_not_touched_afterwards() {
        tch::set_num_threads(1);
        let config = JobConfig::small(1);
        let corpus = load_corpus(&config.data, &config.model).unwrap();
        let sampler = GlobalSampler::new(config.train.seed, corpus, config.model.context);
        let mut model = Model::new(config.model.clone(), config.train.seed);
        zero_grads(&mut model);
        let (tokens, targets) = sampler.batch(0, 0..4);
        let params: Vec<Tensor> = model.params().iter().map(Tensor::shallow_clone).collect();
        let mut snapshots: Vec<(Range<usize>, Vec<Tensor>)> = Vec::new();
        let mut on_final = |r: Range<usize>| {
            let copies = params[r.clone()].iter().map(|p| p.grad().copy()).collect();
            snapshots.push((r, copies));
        };
        let _loss = micro_batch_backward(
            &config.model,
            Precision::Fp32,
            &params,
            &tokens,
            &targets,
            1.0,
            None,
            Activations::Recompute,
            &mut on_final,
        );
        for (range, copies) in snapshots {
            let now: Vec<Tensor> = model.params()[range.clone()].iter().map(|p| p.grad().copy()).collect();
            assert_eq!(worst_relative(&now, &copies), 0.0, "stage {range:?} changed after it was reported final");
        }
    }
}

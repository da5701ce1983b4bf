//! A tensor-parallel rank's share of a pipeline stage (tensor × pipeline parallelism, Megatron-LM's
//! layout): the forward of a run of the model's parts — the embeddings, a range of blocks, the head and
//! loss — from the step's token ids or the previous stage's activation, and its backward from the next
//! stage's gradient (or, for the loss, its weight), giving the gradient of its input.
//!
//! Tensor rank t of stage p exchanges with tensor rank t of stages p ± 1 only: without sequence
//! parallelism the activation is the whole residual stream (`[batch, time, d_model]`, the same on every
//! rank of the group), with it the rank's slice of the sequence (`[batch, time / T, d_model]`) — each
//! rank sends what it holds, so nothing is gathered at a stage boundary.

use tch::Tensor;

use super::group::TpGroup;
use super::parts::{held_params, StageParts};
use super::rank::TpRank;
use super::tape::{Tape, WeightPass};
use super::TpError;
use crate::model::Samples;

/// A stage's forward of one micro-batch, kept for its backward: the tape, its input value (none for
/// the first stage, whose input is token ids), its output value, and the parameters its parts use.
pub struct StageForward {
    tape: Tape,
    input: Option<usize>,
    output: usize,
    params: Vec<bool>,
}

/// What a stage's input pass ([`TpRank::stage_backward_input`]) left for its weight pass: each segment's
/// graph, and the parameters its parts use.
pub struct PendingWeights {
    pass: WeightPass,
    params: Vec<bool>,
}

impl StageForward {
    /// The output: the activation for the next stage, or for the last the micro-batch's mean loss.
    pub fn output(&self) -> &Tensor {
        self.tape.value(self.output)
    }

    /// Bytes of the values its tape holds for the backward.
    pub fn held_bytes(&self) -> usize {
        self.tape.held_bytes().1
    }
}

impl TpRank {
    /// The forward of `parts` from `input` (token ids `[batch, time]` when they start with the
    /// embeddings, else the previous stage's output) to their output, or to the mean cross-entropy of
    /// `targets` when they end with the head. `samples` names the micro-batch's rows (LoRA's dropout).
    /// Under `tch::no_grad` nothing is kept for a backward (a recomputed pipeline's first pass).
    pub fn stage_forward(
        &self,
        group: &mut dyn TpGroup,
        parts: &StageParts,
        input: &Tensor,
        targets: Option<&Tensor>,
        samples: Option<Samples>,
    ) -> Result<StageForward, TpError> {
        let mut tape = Tape::default();
        let (output, input) = self.run_parts(&mut tape, group, parts, input, targets, samples)?;
        let params = held_params(&self.layout.config, &parts.runs(&self.layout.config));
        Ok(StageForward { tape, input, output, params })
    }

    /// The backward of `forward` from `seed` — the gradient of its output from the next stage, or for
    /// the loss its weight (`precision::backward_weight`, a scalar) — accumulating into its parameters'
    /// `.grad`; gives the gradient of its input activation (None for the first stage).
    pub fn stage_backward(
        &self,
        group: &mut dyn TpGroup,
        forward: StageForward,
        seed: Tensor,
    ) -> Result<Option<Tensor>, TpError> {
        let StageForward { tape, input, output, params } = forward;
        self.backward(group, tape, (output, seed), input, &params)
    }

    /// A zero-bubble schedule's B: [`Self::stage_backward`]'s gradient of the input, computing no
    /// parameter's; what the weight pass needs is kept in the [`PendingWeights`].
    pub fn stage_backward_input(
        &self,
        group: &mut dyn TpGroup,
        forward: StageForward,
        seed: Tensor,
    ) -> Result<(Option<Tensor>, PendingWeights), TpError> {
        let StageForward { tape, input, output, params } = forward;
        let wanted: Vec<usize> = input.into_iter().collect();
        let (mut grads, pass) = tape.backward_inputs(group, vec![(output, seed)], &wanted)?;
        Ok((grads.pop().flatten(), PendingWeights { pass, params }))
    }

    /// The weight pass (W) of a [`Self::stage_backward_input`]: the parameters' gradients accumulate into
    /// their `.grad` (partial ones summed over the group, as [`Self::stage_backward`] does).
    pub fn stage_backward_weight(&self, group: &mut dyn TpGroup, pending: PendingWeights) -> Result<(), TpError> {
        let PendingWeights { pass, params } = pending;
        let used: Vec<Tensor> =
            self.params().iter().zip(&params).filter(|(_, &used)| used).map(|(p, _)| p.shallow_clone()).collect();
        self.summing_partial_grads(group, &params, |_| {
            pass.run(&used);
            Ok(())
        })
    }

    /// [`Self::loss_and_backward`] with activation recomputation (`parallel.recompute`): the forward runs
    /// block by block without a graph, keeping only each block's input; the backward runs each block's
    /// forward again on the tape, the last block first, and back-propagates it from its output's gradient
    /// — one block's activations held at a time, for one more forward (its collectives included).
    pub fn loss_and_backward_recomputed(
        &self,
        group: &mut dyn TpGroup,
        tokens: &Tensor,
        targets: &Tensor,
        samples: Option<Samples>,
        backward_weight: f64,
    ) -> Result<f64, TpError> {
        let n = self.layout.config.n_layers;
        let chunks: Vec<StageParts> =
            (0..n).map(|b| StageParts { embed: b == 0, blocks: b..b + 1, head: b + 1 == n }).collect();
        let mut inputs = Vec::with_capacity(n);
        let mut x = tokens.shallow_clone();
        // The activations held at once: the block inputs kept so far, and the tape of the block that runs.
        let mut kept = 0;
        for chunk in &chunks {
            let forward = tch::no_grad(|| self.stage_forward(group, chunk, &x, Some(targets), samples))?;
            self.hold_activations(kept + forward.held_bytes());
            kept += crate::tensor_bytes(&x);
            inputs.push(std::mem::replace(&mut x, forward.output().shallow_clone()));
        }
        let value = x.double_value(&[]);
        let mut seed = Tensor::full([], backward_weight, (tch::Kind::Float, tokens.device()));
        for (chunk, input) in chunks.iter().zip(inputs).rev() {
            let forward = self.stage_forward(group, chunk, &input, Some(targets), samples)?;
            self.hold_activations(kept + forward.held_bytes());
            kept -= crate::tensor_bytes(&input);
            if let Some(grad) = self.stage_backward(group, forward, seed.shallow_clone())? {
                seed = grad;
            }
        }
        Ok(value)
    }
}

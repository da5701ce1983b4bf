//! The computation of one rank cut at every collective into segments, because tch has no custom autograd
//! function to put a collective inside one graph. A segment is an ordinary autograd graph from detached
//! leaf copies of its inputs to its outputs; between segments a [`Conjugate`] moves a value through the
//! group forward and its gradient through the conjugate collective backward. [`Tape::backward`] walks the
//! steps in reverse: a segment back-propagates its outputs' gradients with one `backward` of
//! `Σ sum(output · gradient)` (parameters, leaves of the whole model, accumulate their `.grad` there), and
//! its input leaves' gradients become the gradients of the values they were copied from.
//!
//! A zero-bubble schedule splits that walk ([`Tape::backward_inputs`]): B back-propagates each segment to
//! its input leaves only (autograd skips the weight-gradient products) and keeps the segment's graph; W
//! ([`WeightPass::run`]) later back-propagates each kept segment to the parameters only.

use tch::{Kind, Tensor};

use super::group::TpGroup;
use super::TpError;

/// Megatron's conjugate operators and their sequence-parallel forms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conjugate {
    /// f: identity forward, all-reduce backward (before a column-parallel layer).
    Copy,
    /// g: all-reduce forward, identity backward (after a row-parallel layer).
    Reduce,
    /// f with sequence parallelism: all-gather along `dim` forward, reduce-scatter backward.
    Gather(i64),
    /// g with sequence parallelism: reduce-scatter along `dim` forward, all-gather backward.
    Scatter(i64),
}

impl Conjugate {
    fn forward(self, group: &mut dyn TpGroup, t: &Tensor) -> Result<Tensor, TpError> {
        match self {
            Self::Copy => Ok(t.shallow_clone()),
            Self::Reduce => group.all_reduce(t),
            Self::Gather(dim) => group.all_gather(t, dim),
            Self::Scatter(dim) => group.reduce_scatter(t, dim),
        }
    }

    fn backward(self, group: &mut dyn TpGroup, grad: &Tensor) -> Result<Tensor, TpError> {
        match self {
            Self::Copy => group.all_reduce(grad),
            Self::Reduce => Ok(grad.shallow_clone()),
            Self::Gather(dim) => group.reduce_scatter(grad, dim),
            Self::Scatter(dim) => group.all_gather(grad, dim),
        }
    }
}

enum Step {
    Segment { inputs: Vec<(usize, Tensor)>, outputs: Vec<(usize, Tensor)> },
    Collective { input: usize, output: usize, op: Conjugate },
}

/// One rank's forward as values (detached tensors) and the steps that made them.
#[derive(Default)]
pub struct Tape {
    values: Vec<Tensor>,
    steps: Vec<Step>,
    /// The values of the norm/residual region (what sequence parallelism shards), for accounting.
    sequence_region: Vec<usize>,
}

impl Tape {
    /// The value `id`, detached.
    pub fn value(&self, id: usize) -> &Tensor {
        &self.values[id]
    }

    /// Counts the values `ids` in the norm/residual region.
    pub fn mark_sequence_region(&mut self, ids: &[usize]) {
        self.sequence_region.extend_from_slice(ids);
    }

    /// Bytes of the values the tape holds until the backward: (of the norm/residual region, of all).
    pub fn held_bytes(&self) -> (usize, usize) {
        let region = self.sequence_region.iter().map(|&id| crate::tensor_bytes(&self.values[id])).sum();
        (region, self.values.iter().map(crate::tensor_bytes).sum())
    }

    /// A value that comes from outside the tape (a pipeline stage's input activation): its gradient is
    /// what [`Self::backward`] gives back when asked for it.
    pub fn input(&mut self, value: &Tensor) -> usize {
        self.values.push(value.detach());
        self.values.len() - 1
    }

    /// Runs `f` on leaf copies of the values `inputs` (requiring grad) and records its outputs as new values.
    pub fn segment(&mut self, inputs: &[usize], f: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> Vec<usize> {
        let leaves: Vec<Tensor> = inputs.iter().map(|&id| self.values[id].detach().set_requires_grad(true)).collect();
        let outputs = f(&leaves);
        let ids: Vec<usize> = (self.values.len()..self.values.len() + outputs.len()).collect();
        self.values.extend(outputs.iter().map(Tensor::detach));
        self.steps.push(Step::Segment {
            inputs: inputs.iter().copied().zip(leaves).collect(),
            outputs: ids.iter().copied().zip(outputs).collect(),
        });
        ids
    }

    /// [`Self::segment`] of one output.
    pub fn segment1(&mut self, inputs: &[usize], f: impl FnOnce(&[Tensor]) -> Tensor) -> usize {
        self.segment(inputs, |x| vec![f(x)])[0]
    }

    /// The value `input` through `op`'s forward collective, as a new value.
    pub fn collective(&mut self, group: &mut dyn TpGroup, input: usize, op: Conjugate) -> Result<usize, TpError> {
        let out = op.forward(group, &self.values[input])?;
        self.values.push(out);
        let output = self.values.len() - 1;
        self.steps.push(Step::Collective { input, output, op });
        Ok(output)
    }

    /// Back-propagates `seeds` (value, gradient) through the steps in reverse, accumulating the
    /// parameters' `.grad`, and gives back the gradients of the values `wanted` (None where nothing
    /// flowed to one). Every rank runs the same collectives (a value without a gradient sends zeros).
    pub fn backward(
        self,
        group: &mut dyn TpGroup,
        seeds: Vec<(usize, Tensor)>,
        wanted: &[usize],
    ) -> Result<Vec<Option<Tensor>>, TpError> {
        self.walk(group, seeds, wanted, None)
    }

    /// [`Self::backward`]'s input pass (a zero-bubble schedule's B): the collectives and every value's
    /// gradient as there, but no parameter's: each segment's graph is kept for the [`WeightPass`].
    pub fn backward_inputs(
        self,
        group: &mut dyn TpGroup,
        seeds: Vec<(usize, Tensor)>,
        wanted: &[usize],
    ) -> Result<(Vec<Option<Tensor>>, WeightPass), TpError> {
        let mut weights = WeightPass { scalars: Vec::new() };
        let grads = self.walk(group, seeds, wanted, Some(&mut weights))?;
        Ok((grads, weights))
    }

    /// The backward walk; with `split`, the input pass only, each segment's Σ output · gradient kept there.
    fn walk(
        self,
        group: &mut dyn TpGroup,
        seeds: Vec<(usize, Tensor)>,
        wanted: &[usize],
        mut split: Option<&mut WeightPass>,
    ) -> Result<Vec<Option<Tensor>>, TpError> {
        let mut grads: Vec<Option<Tensor>> = self.values.iter().map(|_| None).collect();
        for (id, grad) in seeds {
            add(&mut grads[id], grad);
        }
        for step in self.steps.into_iter().rev() {
            match step {
                Step::Collective { input, output, op } => {
                    let grad = grads[output].take().unwrap_or_else(|| self.values[output].zeros_like());
                    add(&mut grads[input], op.backward(group, &grad)?);
                }
                Step::Segment { inputs, outputs } => {
                    let terms: Vec<Tensor> = outputs
                        .iter()
                        .filter(|(_, out)| out.requires_grad())
                        .filter_map(|(id, out)| grads[*id].take().map(|g| (out * g).sum(Kind::Float)))
                        .collect();
                    if terms.is_empty() {
                        continue;
                    }
                    let scalar = Tensor::stack(&terms, 0).sum(Kind::Float);
                    if let Some(weights) = split.as_deref_mut() {
                        if !inputs.is_empty() {
                            let leaves: Vec<&Tensor> = inputs.iter().map(|(_, leaf)| leaf).collect();
                            for ((id, _), grad) in
                                inputs.iter().zip(Tensor::run_backward(&[&scalar], &leaves, true, false))
                            {
                                if grad.defined() {
                                    add(&mut grads[*id], grad);
                                }
                            }
                        }
                        weights.scalars.push(scalar);
                        continue;
                    }
                    scalar.backward();
                    for (id, leaf) in inputs {
                        let grad = leaf.grad();
                        if grad.defined() {
                            add(&mut grads[id], grad);
                        }
                    }
                }
            }
        }
        Ok(wanted.iter().map(|&id| grads[id].take()).collect())
    }
}

/// What an input pass ([`Tape::backward_inputs`]) left for the weight pass: each segment's
/// Σ output · gradient, its graph kept, last segment first.
pub struct WeightPass {
    scalars: Vec<Tensor>,
}

impl WeightPass {
    /// The weight gradients: each kept segment back-propagated to `params` (the leaves that require a
    /// gradient; others are left alone), added to their `.grad` in the order a whole backward adds them.
    pub fn run(self, params: &[Tensor]) {
        let wrt: Vec<&Tensor> = params.iter().filter(|p| p.requires_grad() && p.numel() > 0).collect();
        if wrt.is_empty() {
            return;
        }
        for scalar in self.scalars {
            for (p, grad) in wrt.iter().zip(Tensor::run_backward(&[&scalar], &wrt, false, false)) {
                if grad.defined() {
                    accumulate_grad(p, &grad);
                }
            }
        }
    }
}

/// Adds `grad` to the leaf `p`'s gradient, as autograd's accumulation does (the first one becomes it).
fn accumulate_grad(p: &Tensor, grad: &Tensor) {
    let mut current = p.grad();
    if current.defined() {
        tch::no_grad(|| {
            let _ = current.g_add_(grad);
        });
    } else {
        // Only a backward writes a leaf's first gradient: that of Σ p · grad is `grad` exactly.
        (p * grad).sum(Kind::Float).backward();
    }
}

fn add(slot: &mut Option<Tensor>, grad: Tensor) {
    *slot = Some(match slot.take() {
        Some(acc) => acc + grad,
        None => grad,
    });
}

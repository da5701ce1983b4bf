//! One rank of a tensor-parallel group: its shards of the parameter list, and the forward and backward of
//! embed → blocks → head → loss on them (Megatron-LM's layers, Shoeybi et al. 2019; with sequence
//! parallelism, Korthikanti et al. 2022), and the gradient clipping that counts every shard.

use std::cell::Cell;

use tch::{Kind, Tensor};

use super::group::TpGroup;
use super::layout::{nearest_degree, Split, TpLayout};
use super::parts::{held_params, StageParts};
use super::tape::{Conjugate, Tape};
use super::TpError;
use crate::model::{
    block_attention, block_mlp_hidden, block_norm, final_norm, head_params, Arch, ModelConfig, Samples, Weights,
};
use crate::optim::{clip_coefficient, scale_grads};
use crate::precision::Precision;

/// A rank's shards (fp32 leaves requiring grad, in [`crate::model::param_specs`] order, each of its
/// [`TpLayout::shard_shapes`]) and what it runs them with.
pub struct TpRank {
    pub layout: TpLayout,
    pub rank: usize,
    pub precision: Precision,
    local: ModelConfig,
    params: Vec<Tensor>,
    /// With `[peft]`: the rank's shards of the frozen base, by position in
    /// [`crate::model::base_specs`] (None for what trains).
    frozen: Vec<Option<Tensor>>,
    /// With `[peft]`, per part and family parameter: a row-parallel weight's input columns on this rank
    /// (offset, whole width), for LoRA's dropout mask ([`Weights::training_on_columns`]).
    input_columns: Vec<Vec<Option<(i64, i64)>>>,
    /// Per parameter: whether this rank holds its shard (a parameter of a part it runs, or a tied head's
    /// embedding matrix); the others are empty tensors.
    held: Vec<bool>,
    /// The most bytes of activations held for a backward at once since the last
    /// [`Self::take_activation_peak`].
    activation_peak: Cell<usize>,
}

impl TpRank {
    /// Rank `rank` of `layout` holding `shards` (from [`TpLayout::shard`]).
    pub fn new(layout: TpLayout, rank: usize, shards: Vec<Tensor>) -> Self {
        let runs = vec![true; layout.config.n_layers + 2];
        Self::running(layout, rank, shards, runs)
    }

    /// Rank `rank` of `layout` running only the model parts `runs` (by part: 0 the embeddings, 1 + b
    /// block b, 1 + `n_layers` the head; a pipeline stage's, [`super::stage`]) and holding only their
    /// shards ([`held_params`]): `shards` has an empty tensor for every other parameter.
    pub fn running(layout: TpLayout, rank: usize, shards: Vec<Tensor>, runs: Vec<bool>) -> Self {
        let shapes = layout.shard_shapes();
        let held = held_params(&layout.config, &runs);
        assert_eq!(shards.len(), shapes.len(), "rank {rank}'s shard count");
        for (((shard, shape), spec), &held) in shards.iter().zip(&shapes).zip(&layout.specs).zip(&held) {
            match held {
                true => assert_eq!(&shard.size(), shape, "rank {rank}'s shard of {}", spec.name),
                false => assert_eq!(shard.numel(), 0, "rank {rank} does not hold {}", spec.name),
            }
        }
        let device = shards.first().map_or(tch::Device::Cpu, Tensor::device);
        let params = shards.into_iter().map(|s| s.detach().set_requires_grad(true)).collect();
        let local = layout.local_config();
        let frozen = frozen_shards(&layout, rank, device, &runs);
        let input_columns = input_columns(&layout, rank);
        let activation_peak = Cell::new(0);
        Self { layout, rank, precision: Precision::Fp32, local, params, frozen, input_columns, held, activation_peak }
    }

    /// Per parameter: whether this rank holds its shard.
    pub fn held(&self) -> &[bool] {
        &self.held
    }

    /// Notes that `bytes` of activations are held for backwards at once (a tape's values, and what a
    /// caller keeps beside it: a pipeline's micro-batches in flight, a recomputation's block inputs).
    pub fn hold_activations(&self, bytes: usize) {
        self.activation_peak.set(self.activation_peak.get().max(bytes));
    }

    /// The most bytes of activations held at once since the last call (the step's peak), and starts
    /// counting again.
    pub fn take_activation_peak(&self) -> usize {
        self.activation_peak.replace(0)
    }

    /// Part `part`'s weights on its trainable slice `trainable`: with `[peft]`, the frozen family
    /// parameters are this rank's shards of the base, and a training forward of `samples` applies LoRA's
    /// dropout with the single-process forward's mask (a row-parallel weight's input: its columns of it).
    fn weights(&self, part: usize, trainable: &[Tensor], device: tch::Device, samples: Option<Samples>) -> Weights {
        if self.layout.config.peft.is_none() {
            return Weights::of(&self.local, part, trainable, device);
        }
        let weights = Weights::with_frozen(&self.layout.config, part, trainable, |index| {
            self.frozen[index].as_ref().expect("a frozen parameter's shard").shallow_clone()
        });
        weights.training_on_columns(&self.layout.config, part, samples, self.input_columns[part].clone())
    }

    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    pub fn params_mut(&mut self) -> &mut [Tensor] {
        &mut self.params
    }

    /// The gradients of the shards (copies; zeros where none).
    pub fn grads(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| if p.grad().defined() { p.grad().copy() } else { p.zeros_like() }).collect()
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (`[batch, time]` each, the same on every
    /// rank), without gradients.
    pub fn loss(&self, group: &mut dyn TpGroup, tokens: &Tensor, targets: &Tensor) -> Result<f64, TpError> {
        tch::no_grad(|| {
            let mut tape = Tape::default();
            let loss = self.forward(&mut tape, group, tokens, targets, None)?;
            Ok(tape.value(loss).double_value(&[]))
        })
    }

    /// The loss of `tokens` against `targets` and its backward from `backward_weight` (the trainer's
    /// [`crate::precision::backward_weight`]: the micro-batch's share of the batch times fp16's loss
    /// scale; 1 for the plain gradient): the gradients accumulate into the shards' `.grad` (micro-batches
    /// add up), those of replicated parameters identical on every rank. `samples` names the batch's rows
    /// (the trainer's [`Samples`]) for LoRA's dropout (`peft.dropout`), which then drops what the
    /// single-process forward of those samples drops. The products run in [`Self::precision`].
    pub fn loss_and_backward(
        &self,
        group: &mut dyn TpGroup,
        tokens: &Tensor,
        targets: &Tensor,
        samples: Option<Samples>,
        backward_weight: f64,
    ) -> Result<f64, TpError> {
        let mut tape = Tape::default();
        let loss = self.forward(&mut tape, group, tokens, targets, samples)?;
        self.hold_activations(tape.held_bytes().1);
        let value = tape.value(loss).double_value(&[]);
        let seed = Tensor::full([], backward_weight, (Kind::Float, tokens.device()));
        self.backward(group, tape, (loss, seed), None, &self.held)?;
        Ok(value)
    }

    /// The backward of `tape` from `seed` (value, gradient), accumulating into the `.grad` of the
    /// parameters marked in `params` (those the tape's parts use); gives the gradient of the value
    /// `input` (a pipeline stage's input activation).
    pub(super) fn backward(
        &self,
        group: &mut dyn TpGroup,
        tape: Tape,
        seed: (usize, Tensor),
        input: Option<usize>,
        params: &[bool],
    ) -> Result<Option<Tensor>, TpError> {
        let wanted: Vec<usize> = input.into_iter().collect();
        let mut grads = self.summing_partial_grads(group, params, |group| tape.backward(group, vec![seed], &wanted))?;
        Ok(grads.pop().flatten())
    }

    /// Runs `pass`, which adds this call's gradients to the parameters marked in `params`, and makes the
    /// partial ones whole. With SP a replicated parameter's gradient of this call is partial (its rank's
    /// positions), and so is a whole LoRA factor's beside a split one (its rank's rows or columns of the
    /// weight, `TpLayout::partial_grads`), and a replicated key/value head's (its rank's query heads'
    /// share): the earlier calls' sum is put aside, this call's summed over the ranks that hold it, then
    /// the two added.
    pub(super) fn summing_partial_grads<R>(
        &self,
        group: &mut dyn TpGroup,
        params: &[bool],
        pass: impl FnOnce(&mut dyn TpGroup) -> Result<R, TpError>,
    ) -> Result<R, TpError> {
        let partial: Vec<usize> = (0..self.params.len()).filter(|&i| params[i] && self.grad_is_partial(i)).collect();
        let earlier: Vec<Option<Tensor>> = partial.iter().map(|&i| take_grad(&self.params[i])).collect();
        let out = pass(group)?;
        for (&i, earlier) in partial.iter().zip(earlier) {
            let p = &self.params[i];
            let mine = if p.grad().defined() { p.grad() } else { p.zeros_like() };
            let mut total = self.sum_over_holders(group, i, &mine)?;
            if let Some(earlier) = earlier {
                total += earlier;
            }
            tch::no_grad(|| {
                p.grad().copy_(&total);
            });
        }
        Ok(out)
    }

    /// Whether parameter `i`'s gradient after a backward is this rank's share of a sum over the ranks
    /// that hold it.
    fn grad_is_partial(&self, i: usize) -> bool {
        let layout = &self.layout;
        match layout.splits[i] {
            Split::Replicated => layout.partial_grads[i] || layout.sp,
            Split::KvHeads => layout.kv_replicas() > 1,
            _ => layout.partial_grads[i],
        }
    }

    /// `mine` (parameter `i`'s gradient share) summed over the ranks that hold the parameter: the group
    /// for a replicated one; for a key/value head replicated over `kv_replicas` ranks, by one all-reduce
    /// of all heads' gradients (each rank's in its head's place, zeros elsewhere: key/value heads are small
    /// under grouped-query attention), of which the rank keeps its head's.
    fn sum_over_holders(&self, group: &mut dyn TpGroup, i: usize, mine: &Tensor) -> Result<Tensor, TpError> {
        if self.layout.splits[i] != Split::KvHeads {
            return group.all_reduce(mine);
        }
        let (pieces, head) = (self.layout.kv_pieces() as i64, (self.rank / self.layout.kv_replicas()) as i64);
        let rows = mine.size()[0];
        let mut size = mine.size();
        size[0] *= pieces;
        let all = Tensor::zeros(size.as_slice(), (mine.kind(), mine.device()));
        all.narrow(0, head * rows, rows).copy_(mine);
        Ok(group.all_reduce(&all)?.narrow(0, head * rows, rows).contiguous())
    }

    /// Bytes of activations a rank holds for the backward of `tokens` (run without gradients): (of the
    /// norm/residual region — the block inputs, the norms' outputs, the residual sums, the final norm's —,
    /// of every value on the tape). Sequence parallelism divides the first by T.
    pub fn activation_bytes(
        &self,
        group: &mut dyn TpGroup,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<(usize, usize), TpError> {
        tch::no_grad(|| {
            let mut tape = Tape::default();
            self.forward(&mut tape, group, tokens, targets, None)?;
            Ok(tape.held_bytes())
        })
    }

    /// The global gradient norm: the split parameters' squares summed over the group (a key/value head
    /// held by several ranks counted once), the replicated ones' counted once.
    pub fn grad_norm(&self, group: &mut dyn TpGroup) -> Result<f64, TpError> {
        let [sharded, replicated] = self.grad_squares(&self.held);
        let sharded = group.all_reduce(&Tensor::from(sharded))?.double_value(&[]);
        Ok((sharded + replicated).sqrt())
    }

    /// This rank's sums of squared gradients of the parameters marked in `counted`: [of its split
    /// parameters' shards, each divided by how many ranks hold it; of its replicated ones]. The global
    /// norm's square is the first summed over every rank plus the second counted once per tensor group.
    pub fn grad_squares(&self, counted: &[bool]) -> [f64; 2] {
        let squares = |replicated: bool| -> f64 {
            self.params
                .iter()
                .zip(&self.layout.splits)
                .zip(counted)
                .filter(|((p, split), &counted)| {
                    counted && (**split == Split::Replicated) == replicated && p.grad().defined()
                })
                .map(|((p, &split), _)| {
                    let holders = if replicated { 1 } else { self.layout.holders(split) };
                    p.grad().square().sum(Kind::Double).double_value(&[]) / holders as f64
                })
                .sum()
        };
        [squares(false), squares(true)]
    }

    /// Scales the gradients so the global norm is at most `max_norm` (0: no clipping), as
    /// [`crate::optim::clip_grad_norm`] does for the full list; returns the norm before.
    pub fn clip_grad_norm(&self, group: &mut dyn TpGroup, max_norm: f64) -> Result<f64, TpError> {
        let norm = self.grad_norm(group)?;
        scale_grads(&self.params, clip_coefficient(max_norm, norm));
        Ok(norm)
    }

    /// The forward on the tape; returns the loss's value id.
    fn forward(
        &self,
        tape: &mut Tape,
        group: &mut dyn TpGroup,
        tokens: &Tensor,
        targets: &Tensor,
        samples: Option<Samples>,
    ) -> Result<usize, TpError> {
        assert_eq!(tokens.size(), targets.size(), "tokens and targets are both [batch, time]");
        let whole = StageParts::whole(&self.layout.config);
        self.run_parts(tape, group, &whole, tokens, Some(targets), samples).map(|(loss, _)| loss)
    }

    /// The forward of `parts` on the tape from `input` — token ids `[batch, time]` when they start with
    /// the embeddings, else the previous part's output (an input value of the tape) — to the loss of
    /// `targets` when they end with the head, else their output. Gives (output, input value).
    pub(super) fn run_parts(
        &self,
        tape: &mut Tape,
        group: &mut dyn TpGroup,
        parts: &StageParts,
        input: &Tensor,
        targets: Option<&Tensor>,
        samples: Option<Samples>,
    ) -> Result<(usize, Option<usize>), TpError> {
        let (mut x, input) = if parts.embed {
            let time = input.size()[1] as usize;
            let degree = self.layout.degree;
            if self.layout.sp && !time.is_multiple_of(degree) {
                let c = &self.layout.config;
                let nearest = nearest_degree(degree, &[time, c.n_heads, c.ffn_hidden()], c.kv_heads());
                return Err(TpError::Degree { key: "the batch's sequence length", value: time, degree, nearest });
            }
            (self.embed(tape, group, input)?, None)
        } else {
            let id = tape.input(input);
            (id, Some(id))
        };
        for index in parts.blocks.clone() {
            x = self.block(tape, group, index, x, samples)?;
        }
        if parts.head {
            let targets = targets.expect("the head's stage has the targets");
            let logits = self.head(tape, group, x)?;
            x = self.cross_entropy(tape, group, logits, targets)?;
        }
        Ok((x, input))
    }

    /// f and g: the conjugate operators, or their sequence-parallel forms (along the sequence, dim 1).
    fn f(&self) -> Conjugate {
        if self.layout.sp {
            Conjugate::Gather(1)
        } else {
            Conjugate::Copy
        }
    }

    fn g(&self) -> Conjugate {
        if self.layout.sp {
            Conjugate::Scatter(1)
        } else {
            Conjugate::Reduce
        }
    }

    /// Vocab-parallel embedding: this rank's rows looked up, tokens outside its range masked to zero, the
    /// partial embeddings summed over the group by g; GPT-2's positions added after.
    fn embed(&self, tape: &mut Tape, group: &mut dyn TpGroup, tokens: &Tensor) -> Result<usize, TpError> {
        let cfg = &self.layout.config;
        let range = self.layout.vocab_range(self.rank);
        let w = self.weights(0, &self.params[cfg.embed_range()], tokens.device(), None);
        let partial = tape.segment1(&[], |_| {
            let (ids, mask) = local_ids(tokens, &range);
            Tensor::embedding(&w[0], &ids, -1, false, false) * mask.unsqueeze(-1)
        });
        let x = tape.collective(group, partial, self.g())?;
        if cfg.arch != Arch::Gpt2 {
            return Ok(x);
        }
        let time = tape.value(x).size()[1];
        let start = if self.layout.sp { self.rank as i64 * time } else { 0 };
        let positions = Tensor::arange_start(start, start + time, (Kind::Int64, tokens.device()));
        Ok(tape.segment1(&[x], |x| &x[0] + Tensor::embedding(&w[1], &positions, -1, false, false)))
    }

    /// One block: norm → f → the rank's heads and its piece of the output projection → g → residual (and
    /// the bias, once) → norm → f → its columns of the MLP and rows of its last matrix → g → residual.
    fn block(
        &self,
        tape: &mut Tape,
        group: &mut dyn TpGroup,
        index: usize,
        x: usize,
        samples: Option<Samples>,
    ) -> Result<usize, TpError> {
        let (cfg, local, precision) = (&self.layout.config, &self.local, self.precision);
        let w = self.weights(1 + index, &self.params[cfg.block_range(index)], tape.value(x).device(), samples);
        let b = cfg.block_layout();
        let bias = |y: &Tensor, at: Option<usize>| match at {
            Some(at) => y + &w[at],
            None => y.shallow_clone(),
        };
        let h = tape.segment1(&[x], |v| block_norm(cfg, &w, b.attn_norm.clone(), &v[0]));
        tape.mark_sequence_region(&[x, h]);
        let h = tape.collective(group, h, self.f())?;
        let y =
            tape.segment1(&[h], |v| w.project(precision, &block_attention(local, precision, &w, &v[0]), b.attn_out));
        let y = tape.collective(group, y, self.g())?;
        let mid = tape.segment(&[x, y], |v| {
            let x = &v[0] + bias(&v[1], b.attn_out_bias);
            let h = block_norm(cfg, &w, b.mlp_norm.clone(), &x);
            vec![x, h]
        });
        tape.mark_sequence_region(&mid);
        let h = tape.collective(group, mid[1], self.f())?;
        let z =
            tape.segment1(&[h], |v| w.project(precision, &block_mlp_hidden(local, precision, &w, &v[0]), b.mlp_out));
        let z = tape.collective(group, z, self.g())?;
        Ok(tape.segment1(&[mid[0], z], |v| &v[0] + bias(&v[1], b.mlp_out_bias)))
    }

    /// The final norm → f → this rank's vocabulary rows of the head: logits `[batch, time, padded vocab /
    /// T]`, the padded columns −∞.
    fn head(&self, tape: &mut Tape, group: &mut dyn TpGroup, x: usize) -> Result<usize, TpError> {
        let cfg = &self.layout.config;
        let params = head_params(cfg, &self.params);
        let w = self.weights(1 + cfg.n_layers, &params, tape.value(x).device(), None);
        // The family's head list: the final norm, then the matrix (the tied embedding, appended, when tied).
        let matrix = cfg.params_after_blocks() - usize::from(!cfg.tie_word_embeddings);
        let h = tape.segment1(&[x], |v| final_norm(cfg, &w, &v[0]));
        tape.mark_sequence_region(&[x, h]);
        let h = tape.collective(group, h, self.f())?;
        let padding = self.padded_columns(tape.value(x).device());
        Ok(tape.segment1(&[h], |v| {
            let logits = self.precision.linear(&v[0], &w[matrix], None);
            match &padding {
                Some(mask) => logits.masked_fill(mask, f64::NEG_INFINITY),
                None => logits,
            }
        }))
    }

    /// The mask of this rank's head columns that are vocabulary padding (ids at or past
    /// `model.vocab_size`), None when it holds none: their logits are −∞, out of the cross-entropy.
    fn padded_columns(&self, device: tch::Device) -> Option<Tensor> {
        let range = self.layout.vocab_range(self.rank);
        let vocab = self.layout.config.vocab_size as i64;
        (range.end > vocab).then(|| Tensor::arange_start(range.start, range.end, (Kind::Int64, device)).ge(vocab))
    }

    /// Vocab-parallel cross-entropy: the maximum over the group (a constant shift), then the sum of
    /// exponentials and the target's logit each all-reduced (g); the full logits are never gathered.
    fn cross_entropy(
        &self,
        tape: &mut Tape,
        group: &mut dyn TpGroup,
        logits: usize,
        targets: &Tensor,
    ) -> Result<usize, TpError> {
        let local_max = tape.value(logits).to_kind(Kind::Float).amax(-1, true);
        let max = group.all_gather(&local_max, -1)?.amax(-1, true);
        let range = self.layout.vocab_range(self.rank);
        let parts = tape.segment(&[logits], |v| {
            let shifted = v[0].to_kind(Kind::Float) - &max;
            let sum_exp = shifted.exp().sum_dim_intlist(-1, false, Kind::Float);
            let (ids, mask) = local_ids(targets, &range);
            let picked = shifted.gather(-1, &ids.unsqueeze(-1), false).squeeze_dim(-1) * mask;
            vec![sum_exp, picked]
        });
        let sum_exp = tape.collective(group, parts[0], Conjugate::Reduce)?;
        let picked = tape.collective(group, parts[1], Conjugate::Reduce)?;
        Ok(tape.segment1(&[sum_exp, picked], |v| (v[0].log() - &v[1]).mean(Kind::Float)))
    }
}

/// With `[peft]`, per part and family parameter: (offset, whole width) of this rank's columns of a
/// row-parallel weight's input (`T` contiguous pieces, as the weight's columns), None for the others.
fn input_columns(layout: &TpLayout, rank: usize) -> Vec<Vec<Option<(i64, i64)>>> {
    let config = &layout.config;
    if config.peft.is_none() {
        return Vec::new();
    }
    let base = crate::model::base_specs(config);
    let piece = |width: i64| {
        let held = width / layout.degree as i64;
        (rank as i64 * held, width)
    };
    crate::model::peft::parts(config)
        .iter()
        .map(|part| {
            let row = |&index: &usize| layout.base_splits[index] == Split::Row;
            part.base.iter().map(|index| row(index).then(|| piece(base[*index].shape[1]))).collect()
        })
        .collect()
}

/// Rank `rank`'s shards of `layout`'s frozen base on `device` for the parts it `runs`, read from `model.from_hf` and cut (the files
/// hold whole tensors: each is read, sliced, and the whole dropped), by position in
/// [`crate::model::base_specs`]; empty without `[peft]`.
fn frozen_shards(layout: &TpLayout, rank: usize, device: tch::Device, runs: &[bool]) -> Vec<Option<Tensor>> {
    let config = &layout.config;
    if config.peft.is_none() {
        return Vec::new();
    }
    let base = crate::model::peft::Base::of(config);
    let mut frozen: Vec<Option<Tensor>> = layout.base_splits.iter().map(|_| None).collect();
    let parts = crate::model::peft::parts(config);
    for part in parts.iter().zip(runs).filter(|(_, &runs)| runs).map(|(part, _)| part) {
        for (&index, slot) in part.base.iter().zip(&part.slots) {
            if slot.trained.is_none() && frozen[index].is_none() {
                frozen[index] = Some(layout.shard_base(&base.read(config, index, device), index, rank));
            }
        }
    }
    frozen
}

/// Token ids as rows of this rank's vocabulary range (clamped into it) and the mask (1.0 inside, 0.0
/// outside).
fn local_ids(tokens: &Tensor, range: &std::ops::Range<i64>) -> (Tensor, Tensor) {
    let local = tokens - range.start;
    let mask = local.ge(0).logical_and(&local.lt(range.end - range.start)).to_kind(Kind::Float);
    (local.clamp(0, range.end - range.start - 1), mask)
}

/// Takes `p`'s gradient out (a copy), leaving zeros.
fn take_grad(p: &Tensor) -> Option<Tensor> {
    let mut grad = p.grad();
    if !grad.defined() {
        return None;
    }
    let earlier = grad.copy();
    let _ = grad.zero_();
    Some(earlier)
}

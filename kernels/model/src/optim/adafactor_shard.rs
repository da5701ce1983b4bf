//! Adafactor on flat shards of the parameter order (ZeRO-1/2/3): the same update as [`super::adafactor`]
//! (HF transformers' `Adafactor`), computed by owners that each hold a contiguous range of the flat
//! parameters, a range that may cut a matrix anywhere. Pure Rust on `f32` slices, no tch.
//!
//! What is per matrix rather than per element, and how an owner gets it:
//! - the factored statistics (`row`, `col`) of every matrix are kept whole on **every** rank (the
//!   [`ShardLayout::stats_len`] values, `R + C` per `R × C` matrix): replicated, not sharded, and updated
//!   identically everywhere from the same reduced sums;
//! - the row and column sums of the squared gradient, and each parameter's sum of squares (the RMS that
//!   scales the step) are partial sums over each owner's own range ([`ShardLayout::partial_sums`]),
//!   completed by one all-reduce of `P + stats_len` values beside the loss and the gradient norm;
//! - the update's RMS (update clipping) needs the new statistics and the clipping factor of the global
//!   gradient norm: a second all-reduce of `P` values ([`Prepared::partial_update_sq`]).
//!
//! Both reductions happen before the commit vote, so the update itself stays local to each owner.
//! A shard's optimizer state in checkpoints and buddy copies is the two *slots* of
//! [`super::adafactor`] (first moment; packed `row`, `col`, zeros) cut to the range:
//! [`ShardLayout::import_stats`] reads the statistics back from an owner's slot, [`ShardLayout::expand`]
//! writes them. An owner keeps of its range only the first moment (with `beta1`) and the elementwise
//! second moment of vectors (its *compact* slot, [`ShardLayout::compact`]).

use std::ops::Range;

use crate::sections::AdafactorConfig;

/// How one parameter's second moment is kept.
#[derive(Clone, Debug, PartialEq)]
enum Moment {
    /// A vector: elementwise, in the owners' compact slots.
    Full,
    /// Two or more dimensions `[batch…, rows, cols]`: `row` (`batch·rows` values, none when `rows` is 1:
    /// its ratio is exactly 1) then `col` (`batch·cols`), from `stats_at` in the replicated statistics.
    Factored { rows: usize, cols: usize, row_len: usize, stats_at: usize },
}

#[derive(Clone, Debug, PartialEq)]
struct Param {
    /// Its first element in the flat order.
    start: usize,
    numel: usize,
    decays: bool,
    moment: Moment,
}

impl Param {
    /// Its packed statistics' length (the prefix of its second slot they fill).
    fn prefix(&self) -> usize {
        match self.moment {
            Moment::Full => 0,
            Moment::Factored { rows, cols, row_len, .. } => row_len + self.numel / (rows * cols) * cols,
        }
    }
}

/// Where every parameter's elements and statistics are: the same on every rank of a job.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardLayout {
    params: Vec<Param>,
    stats_len: usize,
}

/// The part of parameter `index` inside a range: its elements `local` (positions in the parameter),
/// at `at` in the range.
struct Overlap<'a> {
    index: usize,
    param: &'a Param,
    local: Range<usize>,
    at: usize,
}

impl ShardLayout {
    /// The layout of parameters of `shapes` (flat order), `decays` saying which take weight decay.
    pub fn new(shapes: &[Vec<i64>], decays: &[bool]) -> Self {
        assert_eq!(shapes.len(), decays.len());
        let (mut start, mut stats_len) = (0, 0);
        let mut params = Vec::with_capacity(shapes.len());
        for (shape, &decays) in shapes.iter().zip(decays) {
            let numel = shape.iter().product::<i64>() as usize;
            let n = shape.len();
            let moment = if n >= 2 {
                let (rows, cols) = (shape[n - 2] as usize, shape[n - 1] as usize);
                let batch = numel / (rows * cols).max(1);
                let row_len = if rows == 1 { 0 } else { batch * rows };
                let moment = Moment::Factored { rows, cols, row_len, stats_at: stats_len };
                stats_len += row_len + batch * cols;
                moment
            } else {
                Moment::Full
            };
            params.push(Param { start, numel, decays, moment });
            start += numel;
        }
        Self { params, stats_len }
    }

    /// Values of the replicated factored statistics (every matrix's `row` and `col`).
    pub fn stats_len(&self) -> usize {
        self.stats_len
    }

    /// Values of [`Self::partial_sums`]: one per parameter, then the statistics'.
    pub fn sums_len(&self) -> usize {
        self.params.len() + self.stats_len
    }

    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    /// Where parameter `index`'s factored statistics lie in the replicated statistics (empty for a
    /// vector): its terms of [`Self::partial_sums`] are at `param_count() + ` this range.
    pub fn stats_of(&self, index: usize) -> Range<usize> {
        let param = &self.params[index];
        match param.moment {
            Moment::Full => 0..0,
            Moment::Factored { stats_at, .. } => stats_at..stats_at + param.prefix(),
        }
    }

    /// The parameters a flat range covers.
    fn overlaps<'a>(&'a self, range: &'a Range<usize>) -> impl Iterator<Item = Overlap<'a>> + 'a {
        self.params.iter().enumerate().filter_map(move |(index, param)| {
            let (start, end) = (param.start.max(range.start), (param.start + param.numel).min(range.end));
            (start < end).then(|| Overlap {
                index,
                param,
                local: start - param.start..end - param.start,
                at: start - range.start,
            })
        })
    }

    /// Elements of vectors in `range`: the length of its compact second-moment slot.
    pub fn vector_elements(&self, range: &Range<usize>) -> usize {
        self.overlaps(range).filter(|o| o.param.moment == Moment::Full).map(|o| o.local.len()).sum()
    }

    /// Copies the statistics packed in `slot1` (the second slot of `range`) into `stats`; positions the
    /// range does not hold are left alone (an all-reduce of every owner's disjoint part completes them).
    pub fn import_stats(&self, range: &Range<usize>, slot1: &[f32], stats: &mut [f32]) {
        for o in self.overlaps(range) {
            if let Moment::Factored { stats_at, .. } = o.param.moment {
                let end = o.local.end.min(o.param.prefix());
                for e in o.local.start..end {
                    stats[stats_at + e] = slot1[o.at + e - o.local.start];
                }
            }
        }
    }

    /// The vectors' elements of `slot1` (the second slot of `range`), in order.
    pub fn compact(&self, range: &Range<usize>, slot1: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.vector_elements(range));
        for o in self.overlaps(range).filter(|o| o.param.moment == Moment::Full) {
            out.extend_from_slice(&slot1[o.at..o.at + o.local.len()]);
        }
        out
    }

    /// The second slot of `range` from its compact form and the statistics (the inverse of
    /// [`Self::compact`] and [`Self::import_stats`]).
    pub fn expand(&self, range: &Range<usize>, compact: &[f32], stats: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; range.len()];
        let mut next = 0;
        for o in self.overlaps(range) {
            match o.param.moment {
                Moment::Full => {
                    out[o.at..o.at + o.local.len()].copy_from_slice(&compact[next..next + o.local.len()]);
                    next += o.local.len();
                }
                Moment::Factored { stats_at, .. } => {
                    for e in o.local.start..o.local.end.min(o.param.prefix()) {
                        out[o.at + e - o.local.start] = stats[stats_at + e];
                    }
                }
            }
        }
        out
    }

    /// This owner's terms of the step's per-matrix sums, from its own range's masters and (reduced,
    /// unclipped) gradient: per parameter Σ master², then per statistic Σ g² over the row or column's
    /// elements in the range. Summed over the owners (all-reduce), they are the whole model's.
    pub fn partial_sums(&self, range: &Range<usize>, master: &[f32], grad: &[f32]) -> Vec<f32> {
        let mut sums = vec![0f64; self.sums_len()];
        let p = self.params.len();
        for o in self.overlaps(range) {
            let shard = o.at..o.at + o.local.len();
            sums[o.index] = master[shard].iter().map(|&w| f64::from(w) * f64::from(w)).sum();
            let Moment::Factored { rows, cols, row_len, stats_at } = o.param.moment else { continue };
            let (row_sums, col_sums) = sums[p + stats_at..].split_at_mut(row_len);
            for (e, &g) in o.local.clone().zip(&grad[o.at..]) {
                let g2 = f64::from(g) * f64::from(g);
                let (b, i, j) = (e / (rows * cols), e / cols % rows, e % cols);
                if row_len > 0 {
                    row_sums[b * rows + i] += g2;
                }
                col_sums[b * cols + j] += g2;
            }
        }
        sums.into_iter().map(|s| s as f32).collect()
    }
}

/// One step's per-matrix quantities, the same on every rank: the new statistics, the row and column
/// factors, each parameter's step size. Made from the all-reduced [`ShardLayout::partial_sums`].
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The statistics after this step (what every rank keeps once the step is applied).
    pub stats: Vec<f32>,
    /// Per statistic: `rsqrt(row / mean(row))` at a row's position, `rsqrt(col)` at a column's.
    factors: Vec<f32>,
    step_sizes: Vec<f64>,
    beta2t: f64,
    grad_factor: f32,
    config: AdafactorConfig,
}

impl Prepared {
    /// Update `t` (counting this one) at the schedule's rate `lr`, of gradients to be multiplied by
    /// `grad_factor` (unscaling and global-norm clipping), from the statistics before it and the reduced
    /// sums.
    pub fn new(
        layout: &ShardLayout,
        config: &AdafactorConfig,
        stats: &[f32],
        sums: &[f32],
        grad_factor: f32,
        lr: f64,
        t: u64,
    ) -> Self {
        let beta2t = 1.0 - (t as f64).powf(config.decay_rate);
        let f2 = f64::from(grad_factor) * f64::from(grad_factor);
        let p = layout.params.len();
        let mut new = stats.to_vec();
        let mut factors = vec![0f32; stats.len()];
        let mut step_sizes = vec![0f64; p];
        for (index, param) in layout.params.iter().enumerate() {
            step_sizes[index] = step_size(config, param.numel, f64::from(sums[index]), lr, t);
            let Moment::Factored { rows, cols, row_len, stats_at } = param.moment else { continue };
            let batch = param.numel / (rows * cols);
            let decay = |old: f32, sum: f32, n: usize| {
                (beta2t * f64::from(old) + (1.0 - beta2t) * (f2 * f64::from(sum) / n as f64 + config.eps1)) as f32
            };
            let (rows_at, cols_at) =
                (stats_at..stats_at + row_len, stats_at + row_len..stats_at + row_len + batch * cols);
            for k in rows_at.clone() {
                new[k] = decay(stats[k], sums[p + k], cols);
            }
            for k in cols_at.clone() {
                new[k] = decay(stats[k], sums[p + k], rows);
                factors[k] = 1.0 / new[k].sqrt();
            }
            for b in (0..batch).filter(|_| row_len > 0) {
                let block = rows_at.start + b * rows..rows_at.start + (b + 1) * rows;
                let mean = new[block.clone()].iter().map(|&r| f64::from(r)).sum::<f64>() / rows as f64;
                for k in block {
                    factors[k] = 1.0 / (new[k] / mean as f32).sqrt();
                }
            }
        }
        Self { stats: new, factors, step_sizes, beta2t, grad_factor, config: config.clone() }
    }

    /// The update before clipping and the step size of element `e` of `param` with (unclipped)
    /// gradient `g`; a vector's second moment `v` is advanced in place.
    fn unclipped(&self, param: &Param, e: usize, g: f32, v: &mut f32) -> f32 {
        let g = g * self.grad_factor;
        match param.moment {
            Moment::Full => {
                let squared = f64::from(g) * f64::from(g) + self.config.eps1;
                *v = (self.beta2t * f64::from(*v) + (1.0 - self.beta2t) * squared) as f32;
                g / v.sqrt()
            }
            Moment::Factored { rows, cols, row_len, stats_at } => {
                let (b, i, j) = (e / (rows * cols), e / cols % rows, e % cols);
                let r = if row_len > 0 { self.factors[stats_at + b * rows + i] } else { 1.0 };
                r * self.factors[stats_at + row_len + b * cols + j] * g
            }
        }
    }

    /// This owner's terms of each parameter's Σ update² (before clipping) over `range`, whose staged
    /// gradient is `grad` (not yet multiplied by the factor) and compact second moment `compact`
    /// (unchanged: the advanced values are thrown away).
    pub fn partial_update_sq(
        &self,
        layout: &ShardLayout,
        range: &Range<usize>,
        grad: &[f32],
        compact: &[f32],
    ) -> Vec<f32> {
        let mut sums = vec![0f64; layout.params.len()];
        let mut next = 0;
        for o in layout.overlaps(range) {
            for (k, e) in o.local.clone().enumerate() {
                let mut v = if o.param.moment == Moment::Full { compact[next + k] } else { 0.0 };
                let u = self.unclipped(o.param, e, grad[o.at + k], &mut v);
                sums[o.index] += f64::from(u) * f64::from(u);
            }
            if o.param.moment == Moment::Full {
                next += o.local.len();
            }
        }
        sums.into_iter().map(|s| s as f32).collect()
    }

    /// Applies the step to `range`: `master`, the first moment `exp_avg` (empty without `beta1`) and the
    /// compact second moment, with the staged gradient `grad` (not yet multiplied by the factor) and the
    /// reduced Σ update² per parameter.
    pub fn apply(&self, layout: &ShardLayout, range: &Range<usize>, slots: ShardSlots<'_>, update_sq: &[f32]) {
        let ShardSlots { master, exp_avg, compact, grad } = slots;
        let mut next = 0;
        for o in layout.overlaps(range) {
            let rms = (f64::from(update_sq[o.index]) / o.param.numel as f64).sqrt();
            let clip = (rms / self.config.clip_threshold).max(1.0);
            let step = self.step_sizes[o.index];
            let decay = if o.param.decays { self.config.weight_decay * step } else { 0.0 };
            for (k, e) in o.local.clone().enumerate() {
                let s = o.at + k;
                let mut scratch = 0.0;
                let v = if o.param.moment == Moment::Full { &mut compact[next + k] } else { &mut scratch };
                let mut u = ((f64::from(self.unclipped(o.param, e, grad[s], v)) / clip) * step) as f32;
                if let (Some(beta1), false) = (self.config.beta1, exp_avg.is_empty()) {
                    exp_avg[s] = (beta1 * f64::from(exp_avg[s]) + (1.0 - beta1) * f64::from(u)) as f32;
                    u = exp_avg[s];
                }
                if decay != 0.0 {
                    master[s] += (f64::from(master[s]) * -decay) as f32;
                }
                master[s] -= u;
            }
            if o.param.moment == Moment::Full {
                next += o.local.len();
            }
        }
    }
}

/// What [`Prepared::apply`] changes of one range, and its staged gradient.
pub struct ShardSlots<'a> {
    pub master: &'a mut [f32],
    pub exp_avg: &'a mut [f32],
    pub compact: &'a mut [f32],
    pub grad: &'a [f32],
}

/// HF's `_get_lr` for a parameter of `numel` elements whose squares sum to `param_sq`.
fn step_size(c: &AdafactorConfig, numel: usize, param_sq: f64, lr: f64, t: u64) -> f64 {
    let t = t as f64;
    let base = if c.relative_step {
        let min_step = if c.warmup_init { 1e-6 * t } else { 1e-2 };
        min_step.min(1.0 / t.sqrt())
    } else {
        lr
    };
    if c.scale_parameter {
        base * c.eps2.max((param_sq / numel.max(1) as f64).sqrt())
    } else {
        base
    }
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    use super::*;
    use crate::optim::Adafactor;

    const SHAPES: [&[i64]; 5] = [&[12, 7], &[9], &[1, 6], &[2, 3, 4], &[5, 2]];

    /// A deterministic pseudo-random value in (-1, 1).
    fn noise(seed: u64) -> f32 {
        let x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// One owner of `range`: masters, first moment, compact second moment.
    struct Owner {
        range: Range<usize>,
        master: Vec<f32>,
        exp_avg: Vec<f32>,
        compact: Vec<f32>,
    }

    /// World-3 owners (boundaries inside matrices) against the tch Adafactor, over steps with fresh
    /// gradients and a clipping factor: the same parameters within 1e-6 relative, and the slots the
    /// owners write are the reference's packed slots.
    fn check(config: AdafactorConfig) {
        let shapes: Vec<Vec<i64>> = SHAPES.iter().map(|s| s.to_vec()).collect();
        let decays: Vec<bool> = shapes.iter().map(|s| s.len() >= 2).collect();
        let layout = ShardLayout::new(&shapes, &decays);
        let total: usize = shapes.iter().map(|s| s.iter().product::<i64>() as usize).sum();
        let init: Vec<f32> = (0..total).map(|k| noise(k as u64)).collect();
        let mut params: Vec<Tensor> = Vec::new();
        let mut at = 0;
        for s in &shapes {
            let n = s.iter().product::<i64>() as usize;
            let p = Tensor::from_slice(&init[at..at + n]).view(s.as_slice()).set_requires_grad(true);
            (&p * 0.0).sum(Kind::Float).backward();
            params.push(p);
            at += n;
        }
        let mut reference = Adafactor::new(config.clone(), &params, decays.clone());
        let ranges = [0..40, 40..101, 101..total];
        let mut owners: Vec<Owner> = ranges
            .iter()
            .map(|r| Owner {
                range: r.clone(),
                master: init[r.clone()].to_vec(),
                exp_avg: if config.beta1.is_some() { vec![0.0; r.len()] } else { Vec::new() },
                compact: vec![0.0; layout.vector_elements(r)],
            })
            .collect();
        let mut stats = vec![0f32; layout.stats_len()];
        for t in 1..=6u64 {
            let grad: Vec<f32> = (0..total).map(|k| noise(1000 * t + k as u64) * t as f32).collect();
            let factor = 0.5f32;
            let mut at = 0;
            for p in &params {
                let n = p.numel();
                let g: Vec<f32> = grad[at..at + n].iter().map(|g| g * factor).collect();
                let _ = p.grad().copy_(&Tensor::from_slice(&g).view(p.size().as_slice()));
                at += n;
            }
            reference.apply(&mut params, 0.05);
            let mut sums = vec![0f32; layout.sums_len()];
            for o in &owners {
                let part = layout.partial_sums(&o.range, &o.master, &grad[o.range.clone()]);
                sums.iter_mut().zip(part).for_each(|(s, p)| *s += p);
            }
            let prepared = Prepared::new(&layout, &config, &stats, &sums, factor, 0.05, t);
            let mut update_sq = vec![0f32; layout.param_count()];
            for o in &owners {
                let part = prepared.partial_update_sq(&layout, &o.range, &grad[o.range.clone()], &o.compact);
                update_sq.iter_mut().zip(part).for_each(|(s, p)| *s += p);
            }
            for o in &mut owners {
                let grad = &grad[o.range.clone()];
                let slots =
                    ShardSlots { master: &mut o.master, exp_avg: &mut o.exp_avg, compact: &mut o.compact, grad };
                prepared.apply(&layout, &o.range, slots, &update_sq);
            }
            stats = prepared.stats;
        }
        let flat = |ts: Vec<Tensor>| -> Vec<f32> { Vec::try_from(Tensor::cat(&ts, 0)).unwrap() };
        let want = flat(params.iter().map(|p| p.detach().flatten(0, -1)).collect());
        let got: Vec<f32> = owners.iter().flat_map(|o| o.master.clone()).collect();
        let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let scale = want.iter().map(|a| a.abs()).fold(0f32, f32::max);
        assert!(err <= 1e-6 * scale, "sharded Adafactor differs by {err} (scale {scale})");
        let packed =
            |k: usize| flat((0..params.len()).map(|i| reference.packed(i, &params[i])[k].flatten(0, -1)).collect());
        let slot1: Vec<f32> = owners.iter().flat_map(|o| layout.expand(&o.range, &o.compact, &stats)).collect();
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 * x.abs().max(1e-6));
        assert!(close(&packed(1), &slot1), "the second slots differ from the reference's packing");
        if config.beta1.is_some() {
            let slot0: Vec<f32> = owners.iter().flat_map(|o| o.exp_avg.clone()).collect();
            assert!(close(&packed(0), &slot0), "the first moments differ");
        }
        // The slots read back: every owner's statistics and compact moment, from its own slot alone.
        let mut restored = vec![0f32; layout.stats_len()];
        for o in &owners {
            let slot = &slot1[o.range.clone()];
            layout.import_stats(&o.range, slot, &mut restored);
            assert_eq!(layout.compact(&o.range, slot), o.compact);
        }
        assert_eq!(restored, stats);
    }

    #[test]
    fn owners_of_ranges_cutting_matrices_equal_the_whole_tensor_adafactor() {
        check(AdafactorConfig::default());
        check(AdafactorConfig {
            beta1: Some(0.9),
            weight_decay: 0.01,
            relative_step: false,
            ..AdafactorConfig::default()
        });
    }
}

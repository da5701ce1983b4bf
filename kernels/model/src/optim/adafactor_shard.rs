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
//!
//! A rank need not hold a contiguous range: under tensor parallelism it holds each parameter's shard
//! (a block of rows or of columns, several blocks of a fused matrix, a padded vocabulary range), whose
//! elements are [`Runs`] of positions in the whole parameter; [`Held`] places them in the rank's flat
//! buffer, and the `*_held` functions are the range functions' counterparts over it.

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

/// Which elements of one parameter a rank holds, in its local order: runs of consecutive positions in
/// the whole parameter (row-major), `None` for padding the whole parameter does not have (a vocabulary
/// padded to a multiple of the tensor degree).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Runs(Vec<(Option<usize>, usize)>);

impl Runs {
    /// The runs of `positions` (in local order).
    pub fn from_positions(positions: impl IntoIterator<Item = Option<usize>>) -> Self {
        let mut runs: Vec<(Option<usize>, usize)> = Vec::new();
        for position in positions {
            match runs.last_mut() {
                Some((Some(start), n)) if position == Some(*start + *n) => *n += 1,
                Some((None, n)) if position.is_none() => *n += 1,
                _ => runs.push((position, 1)),
            }
        }
        Self(runs)
    }

    /// Local elements (padding included).
    pub fn len(&self) -> usize {
        self.0.iter().map(|&(_, n)| n).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The runs of local elements `from..to`.
    fn cut(&self, from: usize, to: usize) -> Self {
        let mut out = Vec::new();
        let mut k = 0;
        for &(start, n) in &self.0 {
            let (lo, hi) = (from.max(k), to.min(k + n));
            if lo < hi {
                out.push((start.map(|s| s + lo - k), hi - lo));
            }
            k += n;
        }
        Self(out)
    }

    /// Every local element's position in the whole parameter (`None`: padding).
    fn positions(runs: &[(Option<usize>, usize)]) -> impl Iterator<Item = Option<usize>> + '_ {
        runs.iter().flat_map(|&(start, n)| (0..n).map(move |k| start.map(|s| s + k)))
    }
}

/// Where a rank's elements of every parameter lie in its flat buffer (parameters in the layout's order,
/// each shard's elements in its local order), and where its vectors' elements lie in its compact
/// second moment.
#[derive(Clone, Debug)]
pub struct Held {
    parts: Vec<(Runs, usize, usize)>,
    len: usize,
    compact_len: usize,
}

impl Held {
    /// `runs[i]`: the rank's elements of parameter `i` (empty: not held).
    pub fn new(layout: &ShardLayout, runs: Vec<Runs>) -> Self {
        assert_eq!(runs.len(), layout.params.len(), "one run list per parameter");
        let (mut len, mut compact_len) = (0, 0);
        let parts = runs
            .into_iter()
            .zip(&layout.params)
            .map(|(runs, param)| {
                let n = runs.len();
                let part = (runs, len, compact_len);
                len += n;
                if param.moment == Moment::Full {
                    compact_len += n;
                }
                part
            })
            .collect();
        Self { parts, len, compact_len }
    }

    /// The elements of `range` of the flat buffer, held apart (a ZeRO owner's range of a tensor rank's
    /// shard list): each parameter's runs cut to the elements there, the flat buffer starting at
    /// `range.start`.
    pub fn within(&self, layout: &ShardLayout, range: &Range<usize>) -> Held {
        let runs = self
            .parts
            .iter()
            .map(|(runs, at, _)| {
                let (lo, hi) = (range.start.max(*at), range.end.min(at + runs.len()));
                if lo < hi {
                    runs.cut(lo - at, hi - at)
                } else {
                    Runs::default()
                }
            })
            .collect();
        Held::new(layout, runs)
    }

    /// Elements of the flat buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements of the compact second moment (the vectors').
    pub fn compact_len(&self) -> usize {
        self.compact_len
    }

    /// Parameter `index`'s elements in the flat buffer.
    pub fn range_of(&self, index: usize) -> Range<usize> {
        let (runs, at, _) = &self.parts[index];
        *at..at + runs.len()
    }

    /// Parameter `index`'s elements in the compact second moment (empty for a matrix).
    pub fn compact_range_of(&self, layout: &ShardLayout, index: usize) -> Range<usize> {
        let (runs, _, compact_at) = &self.parts[index];
        match layout.params[index].moment {
            Moment::Full => *compact_at..compact_at + runs.len(),
            Moment::Factored { .. } => *compact_at..*compact_at,
        }
    }

    /// Parameter `index`'s part of its packed second slot (as [`super::adafactor`] packs it) at the
    /// positions this rank holds: a vector's compact moment, a matrix's statistics packed (zeros past
    /// them), zeros for padding — what the group's gather puts together into the whole slot.
    pub fn slot1_of(&self, layout: &ShardLayout, index: usize, compact: &[f32], stats: &[f32]) -> Vec<f32> {
        let (runs, ..) = &self.parts[index];
        let param = &layout.params[index];
        match param.moment {
            Moment::Full => compact[self.compact_range_of(layout, index)].to_vec(),
            Moment::Factored { stats_at, .. } => Runs::positions(&runs.0)
                .map(|e| match e {
                    Some(e) if e < param.prefix() => stats[stats_at + e],
                    _ => 0.0,
                })
                .collect(),
        }
    }

    /// The spans of the parameters `select` marks.
    fn spans<'a>(&'a self, layout: &'a ShardLayout, select: &'a [bool]) -> Vec<Span<'a>> {
        self.parts
            .iter()
            .zip(&layout.params)
            .enumerate()
            .filter(|&(index, ((runs, ..), _))| select[index] && !runs.is_empty())
            .map(|(index, ((runs, at, compact_at), param))| Span {
                index,
                param,
                runs: &runs.0,
                at: *at,
                compact_at: *compact_at,
            })
            .collect()
    }
}

/// A rank's elements of one parameter: at `at` in its flat buffer (and, for a vector, at `compact_at` in
/// its compact second moment), their positions in the parameter as `runs`.
struct Span<'a> {
    index: usize,
    param: &'a Param,
    runs: &'a [(Option<usize>, usize)],
    at: usize,
    compact_at: usize,
}

/// An element's (batch, row, column) in its parameter's `[batch…, rows, cols]` view.
type Coord = (usize, usize, usize);

impl Span<'_> {
    /// The span's local elements as segments that stay within one row of the parameter's
    /// `[batch…, rows, cols]` view (a vector is one row): (first local index, the first element's
    /// [`Coord`] — `None` for padding —, length). One division per segment, not per element.
    fn segments(&self) -> Vec<(usize, Option<Coord>, usize)> {
        let (rows, cols) = match self.param.moment {
            Moment::Factored { rows, cols, .. } => (rows, cols),
            Moment::Full => (1, self.param.numel.max(1)),
        };
        let mut out = Vec::new();
        let mut k = 0;
        for &(start, n) in self.runs {
            let Some(mut e) = start else {
                out.push((k, None, n));
                k += n;
                continue;
            };
            let end = k + n;
            while k < end {
                let (b, i, j) = (e / (rows * cols), e / cols % rows, e % cols);
                let len = (cols - j).min(end - k);
                out.push((k, Some((b, i, j)), len));
                (k, e) = (k + len, e + len);
            }
        }
        out
    }
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

    /// Whether parameter `index`'s second moment is factored (two or more dimensions).
    pub fn is_factored(&self, index: usize) -> bool {
        self.params[index].moment != Moment::Full
    }

    /// The spans of a flat range: each overlap's positions as one run (the owned runs live in `runs`).
    fn range_spans<'a>(
        &'a self,
        range: &Range<usize>,
        runs: &'a mut Vec<[(Option<usize>, usize); 1]>,
    ) -> Vec<Span<'a>> {
        let overlaps: Vec<(usize, usize, Range<usize>)> =
            self.overlaps(range).map(|o| (o.index, o.at, o.local)).collect();
        runs.clear();
        runs.extend(overlaps.iter().map(|(_, _, local)| [(Some(local.start), local.len())]));
        let runs: &'a Vec<_> = runs;
        let mut compact_at = 0;
        overlaps
            .into_iter()
            .zip(runs)
            .map(|((index, at, _), run)| {
                let param = &self.params[index];
                let span = Span { index, param, runs: run.as_slice(), at, compact_at };
                if param.moment == Moment::Full {
                    compact_at += run[0].1;
                }
                span
            })
            .collect()
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
        let mut runs = Vec::new();
        self.sums_of(&self.range_spans(range, &mut runs), master, grad)
    }

    /// [`Self::partial_sums`] of a rank's held elements of the parameters `select` marks (its flat
    /// `master` and `grad`); a parameter several ranks hold must be selected on one of them only.
    pub fn partial_sums_held(&self, held: &Held, select: &[bool], master: &[f32], grad: &[f32]) -> Vec<f32> {
        self.sums_of(&held.spans(self, select), master, grad)
    }

    fn sums_of(&self, spans: &[Span<'_>], master: &[f32], grad: &[f32]) -> Vec<f32> {
        let mut sums = vec![0f64; self.sums_len()];
        let p = self.params.len();
        for o in spans {
            let positions = Runs::positions(o.runs);
            for (k, e) in positions.enumerate() {
                if e.is_some() {
                    let w = master[o.at + k];
                    sums[o.index] += f64::from(w) * f64::from(w);
                }
            }
            let Moment::Factored { rows, cols, row_len, stats_at } = o.param.moment else { continue };
            let (row_sums, col_sums) = sums[p + stats_at..].split_at_mut(row_len);
            for (k, c, len) in o.segments() {
                let Some((b, i, j)) = c else { continue };
                let grad = &grad[o.at + k..o.at + k + len];
                let columns = &mut col_sums[b * cols + j..b * cols + j + len];
                let mut row = if row_len > 0 { row_sums[b * rows + i] } else { 0.0 };
                for (column, &g) in columns.iter_mut().zip(grad) {
                    let g2 = f64::from(g) * f64::from(g);
                    row += g2;
                    *column += g2;
                }
                if row_len > 0 {
                    row_sums[b * rows + i] = row;
                }
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

    /// The update before clipping of a vector's element with (unclipped) gradient `g`; its second moment
    /// `v` is advanced in place.
    fn unclipped_vector(&self, g: f32, v: &mut f32) -> f32 {
        let g = g * self.grad_factor;
        let squared = f64::from(g) * f64::from(g) + self.config.eps1;
        *v = (self.beta2t * f64::from(*v) + (1.0 - self.beta2t) * squared) as f32;
        g / v.sqrt()
    }

    /// The updates before clipping of a matrix's segment from `(b, i, j)` along its row, of (unclipped)
    /// gradients `grad`, each given to `each` with its index in the segment: the row's factor times each
    /// column's times the gradient.
    fn unclipped_row(&self, param: &Param, (b, i, j): Coord, grad: &[f32], mut each: impl FnMut(usize, f32)) {
        let Moment::Factored { rows, cols, row_len, stats_at } = param.moment else { unreachable!("a matrix") };
        let r = if row_len > 0 { self.factors[stats_at + b * rows + i] } else { 1.0 };
        let columns = &self.factors[stats_at + row_len + b * cols + j..][..grad.len()];
        for (t, (&c, &g)) in columns.iter().zip(grad).enumerate() {
            each(t, r * c * (g * self.grad_factor));
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
        let mut runs = Vec::new();
        self.update_sq_of(layout, &layout.range_spans(range, &mut runs), grad, compact)
    }

    /// [`Self::partial_update_sq`] of a rank's held elements of the parameters `select` marks (one
    /// holder of each, as for [`ShardLayout::partial_sums_held`]).
    pub fn partial_update_sq_held(
        &self,
        layout: &ShardLayout,
        held: &Held,
        select: &[bool],
        grad: &[f32],
        compact: &[f32],
    ) -> Vec<f32> {
        self.update_sq_of(layout, &held.spans(layout, select), grad, compact)
    }

    fn update_sq_of(&self, layout: &ShardLayout, spans: &[Span<'_>], grad: &[f32], compact: &[f32]) -> Vec<f32> {
        let mut sums = vec![0f64; layout.params.len()];
        for o in spans {
            let sum = &mut sums[o.index];
            for (k, c, len) in o.segments() {
                let Some(c) = c else { continue };
                let grad = &grad[o.at + k..o.at + k + len];
                if o.param.moment == Moment::Full {
                    for (t, &g) in grad.iter().enumerate() {
                        // The advanced moment is thrown away: the update applies it.
                        let mut v = compact[o.compact_at + k + t];
                        let u = self.unclipped_vector(g, &mut v);
                        *sum += f64::from(u) * f64::from(u);
                    }
                } else {
                    self.unclipped_row(o.param, c, grad, |_, u| *sum += f64::from(u) * f64::from(u));
                }
            }
        }
        sums.into_iter().map(|s| s as f32).collect()
    }

    /// Applies the step to `range`: `master`, the first moment `exp_avg` (empty without `beta1`) and the
    /// compact second moment, with the staged gradient `grad` (not yet multiplied by the factor) and the
    /// reduced Σ update² per parameter.
    pub fn apply(&self, layout: &ShardLayout, range: &Range<usize>, slots: ShardSlots<'_>, update_sq: &[f32]) {
        let mut runs = Vec::new();
        self.apply_to(&layout.range_spans(range, &mut runs), slots, update_sq);
    }

    /// [`Self::apply`] to a rank's held elements of the parameters `select` marks (every holder applies
    /// it to its own copy); padding is left alone.
    pub fn apply_held(
        &self,
        layout: &ShardLayout,
        held: &Held,
        select: &[bool],
        slots: ShardSlots<'_>,
        update_sq: &[f32],
    ) {
        self.apply_to(&held.spans(layout, select), slots, update_sq);
    }

    fn apply_to(&self, spans: &[Span<'_>], slots: ShardSlots<'_>, update_sq: &[f32]) {
        let ShardSlots { master, exp_avg, compact, grad } = slots;
        for o in spans {
            let rms = (f64::from(update_sq[o.index]) / o.param.numel as f64).sqrt();
            let clip = (rms / self.config.clip_threshold).max(1.0);
            let step = self.step_sizes[o.index];
            let decay = if o.param.decays { self.config.weight_decay * step } else { 0.0 };
            let beta1 = self.config.beta1.filter(|_| !exp_avg.is_empty());
            // Element `s` of the range takes the update `u` (before clipping).
            let mut finish = |s: usize, u: f32| {
                let mut u = ((f64::from(u) / clip) * step) as f32;
                if let Some(beta1) = beta1 {
                    exp_avg[s] = (beta1 * f64::from(exp_avg[s]) + (1.0 - beta1) * f64::from(u)) as f32;
                    u = exp_avg[s];
                }
                if decay != 0.0 {
                    master[s] += (f64::from(master[s]) * -decay) as f32;
                }
                master[s] -= u;
            };
            for (k, c, len) in o.segments() {
                let Some(c) = c else { continue };
                let at = o.at + k;
                if o.param.moment == Moment::Full {
                    for t in 0..len {
                        finish(at + t, self.unclipped_vector(grad[at + t], &mut compact[o.compact_at + k + t]));
                    }
                } else {
                    self.unclipped_row(o.param, c, &grad[at..at + len], |t, u| finish(at + t, u));
                }
            }
        }
    }

    /// Keeps parameter `index`'s statistics as they were before this step (a parameter no rank updates
    /// this step: one without a gradient, which the whole-tensor Adafactor leaves alone).
    pub fn keep_stats(&mut self, layout: &ShardLayout, index: usize, before: &[f32]) {
        let at = layout.stats_of(index);
        self.stats[at.clone()].copy_from_slice(&before[at]);
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
        let (mut params, mut reference) = reference_of(&config, &shapes, &decays, &init);
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
            reference_step(&mut reference, &mut params, &grad, factor);
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

    /// The whole-tensor Adafactor's parameters of `shapes` from the flat `init`, gradients defined.
    fn reference_of(
        config: &AdafactorConfig,
        shapes: &[Vec<i64>],
        decays: &[bool],
        init: &[f32],
    ) -> (Vec<Tensor>, Adafactor) {
        let mut params: Vec<Tensor> = Vec::new();
        let mut at = 0;
        for s in shapes {
            let n = s.iter().product::<i64>() as usize;
            let p = Tensor::from_slice(&init[at..at + n]).view(s.as_slice()).set_requires_grad(true);
            (&p * 0.0).sum(Kind::Float).backward();
            params.push(p);
            at += n;
        }
        let reference = Adafactor::new(config.clone(), &params, decays.to_vec());
        (params, reference)
    }

    /// One whole-tensor step with the flat gradient `grad` times `factor`, at lr 0.05.
    fn reference_step(reference: &mut Adafactor, params: &mut [Tensor], grad: &[f32], factor: f32) {
        let mut at = 0;
        for p in params.iter() {
            let n = p.numel();
            let g: Vec<f32> = grad[at..at + n].iter().map(|g| g * factor).collect();
            let _ = p.grad().copy_(&Tensor::from_slice(&g).view(p.size().as_slice()));
            at += n;
        }
        reference.apply(params, 0.05);
    }

    /// Two tensor ranks, each holding of every parameter a block of rows, a block of columns (one run per
    /// row), the whole (a replicated vector: its sums from rank 0 only) or rows with padding after them,
    /// against the whole-tensor Adafactor over steps: the same parameters within 1e-6 relative, padding
    /// untouched, and each rank's statistics the reference's.
    /// Two holders of row blocks, column blocks and padding, each one holder whole or (`split`) two owners
    /// of halves of its flat buffer (cut inside a row: [`Held::within`], as ZeRO under tensor parallelism
    /// cuts them), against the whole-tensor Adafactor.
    fn check_holders(split: bool) {
        let config = AdafactorConfig { beta1: Some(0.9), weight_decay: 0.01, ..AdafactorConfig::default() };
        let shapes: Vec<Vec<i64>> = vec![vec![6, 4], vec![5], vec![3, 4], vec![2, 3, 4]];
        let decays: Vec<bool> = shapes.iter().map(|s| s.len() >= 2).collect();
        let layout = ShardLayout::new(&shapes, &decays);
        let total: usize = shapes.iter().map(|s| s.iter().product::<i64>() as usize).sum();
        let init: Vec<f32> = (0..total).map(|k| noise(7 + k as u64)).collect();
        let (mut params, mut reference) = reference_of(&config, &shapes, &decays, &init);
        let starts: Vec<usize> = shapes
            .iter()
            .scan(0, |at, s| {
                let start = *at;
                *at += s.iter().product::<i64>() as usize;
                Some(start)
            })
            .collect();
        // Rank r's positions of each parameter: rows 3r..3r+3 of [6, 4]; the whole [5]; columns 2r..2r+2
        // of [3, 4]; of [2, 3, 4] rank 0 its first block, rank 1 its second and 4 padding elements.
        let positions = |r: usize| -> Vec<Vec<Option<usize>>> {
            vec![
                (12 * r..12 * r + 12).map(Some).collect(),
                (0..5).map(Some).collect(),
                (0..3).flat_map(|i| (2 * r..2 * r + 2).map(move |j| Some(4 * i + j))).collect(),
                match r {
                    0 => (0..12).map(Some).collect(),
                    _ => (12..24).map(Some).chain([None; 4]).collect(),
                },
            ]
        };
        struct Rank {
            held: Held,
            select: Vec<bool>,
            master: Vec<f32>,
            exp_avg: Vec<f32>,
            compact: Vec<f32>,
            positions: Vec<Option<usize>>,
        }
        let mut ranks: Vec<Rank> = (0..2)
            .map(|r| {
                let parts = positions(r);
                let held = Held::new(&layout, parts.iter().map(|p| Runs::from_positions(p.iter().copied())).collect());
                let flat: Vec<Option<usize>> = parts
                    .iter()
                    .zip(&starts)
                    .flat_map(|(p, &start)| p.iter().map(move |e| e.map(|e| start + e)))
                    .collect();
                let master = flat.iter().map(|e| e.map_or(0.0, |e| init[e])).collect();
                let exp_avg = vec![0.0; held.len()];
                let compact = vec![0.0; held.compact_len()];
                Rank { held, select: vec![true, r == 0, true, true], master, exp_avg, compact, positions: flat }
            })
            .collect();
        assert_eq!(ranks[1].held.range_of(3), 23..39);
        if split {
            ranks = ranks
                .into_iter()
                .flat_map(|rank| {
                    // Local element 1 of the [3, 4] shard: inside its first row.
                    let (cut, len) = (18, rank.held.len());
                    [0..cut, cut..len].map(|range| {
                        let held = rank.held.within(&layout, &range);
                        Rank {
                            select: rank.select.clone(),
                            master: rank.master[range.clone()].to_vec(),
                            exp_avg: vec![0.0; range.len()],
                            compact: vec![0.0; held.compact_len()],
                            positions: rank.positions[range.clone()].to_vec(),
                            held,
                        }
                    })
                })
                .collect();
            assert_eq!((ranks[0].held.range_of(2), ranks[1].held.range_of(2)), (17..18, 0..5));
            assert_eq!((ranks[1].held.compact_len(), ranks[3].held.range_of(3)), (0, 5..21));
        }
        let mut stats = vec![0f32; layout.stats_len()];
        for t in 1..=5u64 {
            let grad: Vec<f32> = (0..total).map(|k| noise(500 * t + k as u64) * t as f32).collect();
            reference_step(&mut reference, &mut params, &grad, 0.5);
            let local =
                |rank: &Rank| -> Vec<f32> { rank.positions.iter().map(|e| e.map_or(0.0, |e| grad[e])).collect() };
            let mut sums = vec![0f32; layout.sums_len()];
            for rank in &ranks {
                let part = layout.partial_sums_held(&rank.held, &rank.select, &rank.master, &local(rank));
                sums.iter_mut().zip(part).for_each(|(s, p)| *s += p);
            }
            let prepared = Prepared::new(&layout, &config, &stats, &sums, 0.5, 0.05, t);
            let mut update_sq = vec![0f32; layout.param_count()];
            for rank in &ranks {
                let part =
                    prepared.partial_update_sq_held(&layout, &rank.held, &rank.select, &local(rank), &rank.compact);
                update_sq.iter_mut().zip(part).for_each(|(s, p)| *s += p);
            }
            for rank in &mut ranks {
                let grad = local(rank);
                let slots = ShardSlots {
                    master: &mut rank.master,
                    exp_avg: &mut rank.exp_avg,
                    compact: &mut rank.compact,
                    grad: &grad,
                };
                prepared.apply_held(&layout, &rank.held, &[true; 4], slots, &update_sq);
            }
            stats = prepared.stats;
        }
        let want: Vec<f32> =
            Vec::try_from(Tensor::cat(&params.iter().map(|p| p.detach().flatten(0, -1)).collect::<Vec<_>>(), 0))
                .unwrap();
        let scale = want.iter().map(|a| a.abs()).fold(0f32, f32::max);
        for rank in &ranks {
            for (e, &got) in rank.positions.iter().zip(&rank.master) {
                match e {
                    Some(e) => assert!((want[*e] - got).abs() <= 1e-6 * scale, "element {e}: {got} vs {}", want[*e]),
                    None => assert_eq!(got, 0.0, "padding is left alone"),
                }
            }
        }
        let packed = reference.packed(0, &params[0]);
        let row_col: Vec<f32> = Vec::try_from(packed[1].flatten(0, -1).narrow(0, 0, 10)).unwrap();
        let close = row_col.iter().zip(&stats[layout.stats_of(0)]).all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs());
        assert!(close, "the statistics of [6, 4] differ: {row_col:?} vs {:?}", &stats[layout.stats_of(0)]);
    }

    #[test]
    fn holders_of_row_and_column_blocks_and_padding_equal_the_whole_tensor_adafactor() {
        check_holders(false);
    }

    #[test]
    fn owners_of_halves_of_each_holders_elements_equal_the_whole_tensor_adafactor() {
        check_holders(true);
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

//! The deterministic global sampler (DESIGN.md §4).
//!
//! Sample `i` of global step `s` is the window of `context + 1` tokens starting at
//! `start(seed, s, i)`, a pure function of its arguments. A step's global batch is samples
//! `0..global_batch`; a data-parallel rank takes a contiguous, balanced slice of it, and splits its slice
//! into micro-batches. So the samples a step sees never depend on how many ranks share it or how it is cut
//! into micro-batches — which is what lets every distributed mode reproduce the single-process run.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::Corpus;
use crate::rng::{hash_words, SplitMix64};

/// Draws sample windows from a corpus.
#[derive(Clone, Debug)]
pub struct GlobalSampler {
    seed: u64,
    corpus: Corpus,
    context: usize,
}

/// What a checkpoint records of the sampler; with the corpus it determines every future batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    pub seed: u64,
    /// The next global step whose samples will be drawn.
    pub next_step: u64,
    pub global_batch: usize,
    pub context: usize,
    pub corpus_fingerprint: u64,
    pub corpus_tokens: usize,
}

impl GlobalSampler {
    /// # Panics
    /// If the corpus is shorter than one sample (the loaders reject such corpora first).
    pub fn new(seed: u64, corpus: Corpus, context: usize) -> Self {
        assert!(corpus.len() > context, "corpus of {} tokens is shorter than one sample", corpus.len());
        Self { seed, corpus, context }
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Start offset of sample `index` of global step `step`.
    pub fn sample_start(&self, step: u64, index: usize) -> usize {
        let windows = (self.corpus.len() - self.context) as u64;
        SplitMix64::new(hash_words(&[self.seed, step, index as u64])).below(windows) as usize
    }

    /// Start offsets of samples `indices` of `step`.
    pub fn starts(&self, step: u64, indices: Range<usize>) -> Vec<usize> {
        indices.map(|i| self.sample_start(step, i)).collect()
    }

    /// Inputs and next-token targets, `[len(indices), context]` int64 each.
    pub fn batch(&self, step: u64, indices: Range<usize>) -> (Tensor, Tensor) {
        let rows = indices.len() as i64;
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for start in self.starts(step, indices) {
            self.corpus.extend_i64(start..start + self.context, &mut inputs);
            self.corpus.extend_i64(start + 1..start + self.context + 1, &mut targets);
        }
        let shape = [rows, self.context as i64];
        (Tensor::from_slice(&inputs).view(shape), Tensor::from_slice(&targets).view(shape))
    }

    pub fn state(&self, next_step: u64, global_batch: usize) -> SamplerState {
        SamplerState {
            seed: self.seed,
            next_step,
            global_batch,
            context: self.context,
            corpus_fingerprint: self.corpus.fingerprint(),
            corpus_tokens: self.corpus.len(),
        }
    }
}

/// The contiguous slice of a global batch that data-parallel rank `rank` of `ranks` takes: sizes differ by
/// at most one, the first `global_batch % ranks` ranks taking the larger share.
pub fn rank_slice(global_batch: usize, rank: usize, ranks: usize) -> Range<usize> {
    troupe_kernels::balanced_range(global_batch, ranks, rank)
}

/// Cuts a rank's slice into micro-batches of `micro_batch` samples (the last may be smaller).
pub fn micro_batch_ranges(slice: Range<usize>, micro_batch: usize) -> Vec<Range<usize>> {
    assert!(micro_batch > 0, "micro_batch must be at least 1");
    slice.clone().step_by(micro_batch).map(|start| start..(start + micro_batch).min(slice.end)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synthetic_text;

    fn sampler(seed: u64) -> GlobalSampler {
        GlobalSampler::new(
            seed,
            Corpus::from_tokens(synthetic_text(5000, 9).into_iter().map(u16::from).collect(), "t"),
            16,
        )
    }

    #[test]
    fn union_of_rank_slices_is_the_global_batch_for_any_world_and_split() {
        let sampler = sampler(5);
        for global_batch in [1, 7, 8, 12] {
            for step in [0, 1, 17] {
                let reference = sampler.starts(step, 0..global_batch);
                for world in 1..=4 {
                    for micro in [1, 2, 3, 8] {
                        let mut union = Vec::new();
                        for rank in 0..world {
                            for mb in micro_batch_ranges(rank_slice(global_batch, rank, world), micro) {
                                assert!(mb.len() <= micro);
                                union.extend(sampler.starts(step, mb));
                            }
                        }
                        assert_eq!(union, reference, "B={global_batch} step={step} world={world} micro={micro}");
                    }
                }
            }
        }
    }

    #[test]
    fn rank_slices_are_balanced_and_cover() {
        for (batch, ranks) in [(8, 3), (3, 4), (10, 4), (0, 2)] {
            let slices: Vec<_> = (0..ranks).map(|r| rank_slice(batch, r, ranks)).collect();
            assert_eq!(slices.first().unwrap().start, 0);
            assert_eq!(slices.last().unwrap().end, batch);
            assert!(slices.windows(2).all(|w| w[0].end == w[1].start));
            let sizes: Vec<_> = slices.iter().map(|s| s.len()).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1, "{sizes:?}");
        }
    }

    #[test]
    fn samples_depend_on_seed_and_step() {
        let (a, b) = (sampler(1), sampler(2));
        assert_eq!(a.starts(3, 0..8), sampler(1).starts(3, 0..8));
        assert_ne!(a.starts(3, 0..8), b.starts(3, 0..8));
        assert_ne!(a.starts(3, 0..8), a.starts(4, 0..8));
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let s = sampler(1);
        let (inputs, targets) = s.batch(0, 0..2);
        assert_eq!(inputs.size(), vec![2, 16]);
        let i: Vec<i64> = Vec::try_from(inputs.flatten(0, 1)).unwrap();
        let t: Vec<i64> = Vec::try_from(targets.flatten(0, 1)).unwrap();
        assert_eq!(&i[1..16], &t[..15]);
    }
}

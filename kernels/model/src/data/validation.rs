//! Held-out data: the contiguous train/validation split of a corpus (`data.val_fraction`, nanoGPT's
//! split) and the fixed windows a validation loss is measured on.
//!
//! The split is by position: the head trains, the tail validates. The sampler's corpus is the head
//! alone (its windows of `context + 1` tokens end inside it), and every validation window lies in the
//! tail, so no token is seen by both.

use std::ops::Range;

use tch::Tensor;

use super::{Corpus, DataError};

/// The corpus cut into its head (training) and its last `fraction` of tokens (validation), which must
/// hold at least `needed` tokens (one window). The head is at least as long as the tail
/// (`fraction` ≤ 0.5, checked with the config), so it holds a window too.
pub fn split_tail(corpus: Corpus, fraction: f64, needed: usize) -> Result<(Corpus, Corpus), DataError> {
    let total = corpus.len();
    let held = (total as f64 * fraction).floor() as usize;
    if held < needed {
        return Err(DataError::ValTooShort { origin: corpus.origin.clone(), fraction, tokens: held, total, needed });
    }
    let at = total - held;
    let origin = &corpus.origin;
    let train = corpus.slice(0..at, format!("{origin} (the first {at} tokens; the last {held} held out)"));
    let val = corpus.slice(at..total, format!("{origin} (the last {held} tokens, held out)"));
    Ok((train, val))
}

/// The windows a validation loss is measured on: consecutive windows of a corpus, window `w` the
/// `context` inputs from position `w · context` and their next tokens — so no two windows predict the
/// same token — the first `len` of them. What `troupe eval` reads ([`crate::generate::evaluate`]) and
/// what `train.eval_every` evaluates, in one definition.
#[derive(Clone, Debug)]
pub struct EvalWindows {
    corpus: Corpus,
    context: usize,
    len: usize,
}

impl EvalWindows {
    /// The first `max` windows of `corpus` (0: all of them).
    ///
    /// # Panics
    /// If the corpus is shorter than one window (`context + 1` tokens; the loaders reject it first).
    pub fn new(corpus: Corpus, context: usize, max: usize) -> Self {
        assert!(corpus.len() > context, "corpus of {} tokens is shorter than one window", corpus.len());
        let all = (corpus.len() - 1) / context;
        let len = if max > 0 { all.min(max) } else { all };
        Self { corpus, context, len }
    }

    /// How many windows.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn context(&self) -> usize {
        self.context
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    /// Tokens predicted over all the windows.
    pub fn tokens(&self) -> usize {
        self.len * self.context
    }

    /// Inputs and next-token targets of `windows`, `[len(windows), context]` int64 each.
    pub fn batch(&self, windows: Range<usize>) -> (Tensor, Tensor) {
        assert!(windows.end <= self.len, "windows {windows:?} of {}", self.len);
        let rows = windows.len() as i64;
        let context = self.context;
        let (mut inputs, mut targets) = (Vec::with_capacity(windows.len() * context), Vec::new());
        targets.reserve(windows.len() * context);
        for w in windows {
            let start = w * context;
            self.corpus.extend_i64(start..start + context, &mut inputs);
            self.corpus.extend_i64(start + 1..start + context + 1, &mut targets);
        }
        let shape = [rows, context as i64];
        (Tensor::from_slice(&inputs).view(shape), Tensor::from_slice(&targets).view(shape))
    }

    /// The positions of the corpus window `w` reads, inputs and targets together.
    pub fn span(&self, w: usize) -> Range<usize> {
        w * self.context..(w + 1) * self.context + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(n: usize) -> Corpus {
        Corpus::from_tokens((0..n).map(|i| (i % 251) as u16).collect(), "t")
    }

    #[test]
    fn the_tail_is_held_out_and_the_parts_tile_the_corpus() {
        let (train, val) = split_tail(corpus(1000), 0.1, 17).unwrap();
        assert_eq!((train.len(), val.len()), (900, 100));
        let ids = corpus(1000).to_ids();
        assert_eq!(train.to_ids(), ids[..900]);
        assert_eq!(val.to_ids(), ids[900..]);
        assert!(val.origin.contains("held out"), "{}", val.origin);
    }

    #[test]
    fn a_tail_shorter_than_one_window_is_named_with_the_fix() {
        let message = split_tail(corpus(1000), 0.01, 17).unwrap_err().to_string();
        for needle in
            ["data.val_fraction = 0.01", "last 10 of the 1000 tokens", "model.context + 1 = 17", "at least 0.017"]
        {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
    }

    #[test]
    fn windows_are_consecutive_and_predict_each_token_once() {
        let windows = EvalWindows::new(corpus(100), 8, 0);
        assert_eq!(windows.len(), 12, "(100 - 1) / 8");
        assert_eq!(EvalWindows::new(corpus(100), 8, 5).len(), 5);
        let (inputs, targets) = windows.batch(1..3);
        let inputs: Vec<i64> = Vec::try_from(inputs.flatten(0, 1)).unwrap();
        let targets: Vec<i64> = Vec::try_from(targets.flatten(0, 1)).unwrap();
        assert_eq!(inputs, (8..24).collect::<Vec<i64>>());
        assert_eq!(targets, (9..25).collect::<Vec<i64>>());
        assert_eq!(windows.span(2), 16..25);
    }
}

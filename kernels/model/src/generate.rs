//! What a user does right after training: sample from the model and measure it.
//!
//! [`generate`] decodes incrementally through the key/value cache ([`Model::forward_cached`]: the prompt
//! once, then one forward of one token per new token), greedy at temperature 0 (the first largest logit,
//! as `argmax` and transformers' `do_sample=False` pick), otherwise sampling from the softmax of the
//! logits over the temperature, cut to the `top_k` largest and to the smallest set whose probability
//! reaches `top_p`, drawn by troupe's seeded generator (the same seed, the same text).
//! [`evaluate`] is the mean next-token loss and perplexity over a corpus' consecutive windows.

use std::ops::Range;

use tch::{Kind, Tensor};

use crate::data::{micro_batch_ranges, Corpus, EvalWindows};
use crate::model::{cross_entropy, KvCache, Model};
use crate::rng::SplitMix64;
use crate::transfer::upload;

/// How the next token is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy. Otherwise the logits are divided by it before the softmax.
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f64,
    pub seed: u64,
    /// Generation stops after this token (the tokenizer's end of text), as transformers' `generate`
    /// stops at `eos_token_id`; None: never early.
    pub eos: Option<i64>,
}

impl Sampling {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, eos: None }
    }
}

/// A request that cannot be served, with the fix.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty; give at least one token")]
    EmptyPrompt,
    #[error(
        "the prompt's {tokens} tokens do not fit the model's context of {positions} positions; shorten the prompt"
    )]
    PromptTooLong { tokens: usize, positions: usize },
    #[error("prompt token {token} at position {position} is outside the model's vocabulary of {vocab}; use the model's tokenizer")]
    TokenOutOfVocabulary { token: i64, position: usize, vocab: usize },
    #[error("--temperature {0}: must be a finite number ≥ 0 (0 is greedy)")]
    Temperature(f64),
    #[error("--top-p {0}: must be in (0, 1]")]
    TopP(f64),
    #[error("the corpus holds {tokens} tokens, fewer than one window of the model's context + 1 = {needed}")]
    CorpusTooShort { tokens: usize, needed: usize },
    #[error("corpus token {token} at position {position} is outside the model's vocabulary of {vocab}; evaluate on data made with the model's tokenizer")]
    CorpusTokenOutOfVocabulary { token: u32, position: usize, vocab: usize },
}

/// Checks `prompt` against `model`: not empty, within its positions and its vocabulary.
pub fn check_prompt(model: &Model, prompt: &[i64]) -> Result<(), GenerateError> {
    let (vocab, positions) = (model.config.vocab_size, model.config.positions());
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if prompt.len() > positions {
        return Err(GenerateError::PromptTooLong { tokens: prompt.len(), positions });
    }
    if let Some((position, &token)) = prompt.iter().enumerate().find(|(_, &t)| t < 0 || t as usize >= vocab) {
        return Err(GenerateError::TokenOutOfVocabulary { token, position, vocab });
    }
    Ok(())
}

/// Up to `max_new` tokens after `prompt` (fewer if the model's positions run out, or after
/// `sampling.eos`), each handed to `on_token` as soon as it is chosen. Returns the new tokens.
pub fn generate(
    model: &Model,
    prompt: &[i64],
    max_new: usize,
    sampling: Sampling,
    mut on_token: impl FnMut(i64),
) -> Result<Vec<i64>, GenerateError> {
    check_prompt(model, prompt)?;
    if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
        return Err(GenerateError::Temperature(sampling.temperature));
    }
    if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
        return Err(GenerateError::TopP(sampling.top_p));
    }
    let device = model.params()[0].device();
    let mut rng = SplitMix64::new(sampling.seed);
    let mut cache = KvCache::new(model.config.n_layers);
    let room = model.config.positions() - prompt.len();
    let mut generated = Vec::new();
    tch::no_grad(|| {
        let mut input = Tensor::from_slice(prompt).view([1, -1]).to_device(device);
        for _ in 0..max_new.min(room) {
            let logits = model.forward_cached(&input, &mut cache);
            let last: Vec<f64> = Vec::try_from(logits.get(0).get(-1).to_kind(Kind::Double)).expect("logits");
            let token = choose(&last, sampling, &mut rng);
            on_token(token);
            generated.push(token);
            if sampling.eos == Some(token) {
                break;
            }
            input = Tensor::from_slice(&[token]).view([1, 1]).to_device(device);
        }
    });
    Ok(generated)
}

/// [`generate`] without the cache: the whole sequence through [`Model::forward`] for every new token (the
/// reference the cache is tested against).
pub fn generate_uncached(
    model: &Model,
    prompt: &[i64],
    max_new: usize,
    sampling: Sampling,
) -> Result<Vec<i64>, GenerateError> {
    check_prompt(model, prompt)?;
    let device = model.params()[0].device();
    let mut rng = SplitMix64::new(sampling.seed);
    let mut sequence = prompt.to_vec();
    let room = model.config.positions() - prompt.len();
    tch::no_grad(|| {
        for _ in 0..max_new.min(room) {
            let logits = model.forward(&Tensor::from_slice(&sequence).view([1, -1]).to_device(device));
            let last: Vec<f64> = Vec::try_from(logits.get(0).get(-1).to_kind(Kind::Double)).expect("logits");
            let token = choose(&last, sampling, &mut rng);
            sequence.push(token);
            if sampling.eos == Some(token) {
                break;
            }
        }
    });
    Ok(sequence.split_off(prompt.len()))
}

/// The next token from the last position's logits.
pub fn choose(logits: &[f64], sampling: Sampling, rng: &mut SplitMix64) -> i64 {
    let argmax = || {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as i64
    };
    if sampling.temperature == 0.0 {
        return argmax();
    }
    // Most likely first; ties by token id.
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if sampling.top_k > 0 {
        order.truncate(sampling.top_k);
    }
    let max = logits[order[0]];
    let weights: Vec<f64> = order.iter().map(|&i| ((logits[i] - max) / sampling.temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut kept = 0;
    let mut mass = 0.0;
    for w in &weights {
        kept += 1;
        mass += w / total;
        if mass >= sampling.top_p {
            break;
        }
    }
    let kept_total: f64 = weights[..kept].iter().sum();
    let mut draw = rng.next_f64() * kept_total;
    for (i, w) in weights[..kept].iter().enumerate() {
        if draw < *w {
            return order[i] as i64;
        }
        draw -= w;
    }
    order[kept - 1] as i64
}

/// The loss of a model on a corpus.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean next-token cross-entropy (nats).
    pub loss: f64,
    pub perplexity: f64,
    /// Predicted tokens the mean is over.
    pub tokens: usize,
    pub windows: usize,
}

impl Evaluation {
    /// The evaluation whose windows' losses sum to `sum` ([`window_loss_sum`] over all of `windows`,
    /// or its parts summed over data-parallel ranks).
    pub fn of_sum(sum: f64, windows: &EvalWindows) -> Self {
        let loss = sum / windows.len() as f64;
        Self { loss, perplexity: loss.exp(), tokens: windows.tokens(), windows: windows.len() }
    }
}

/// Mean next-token loss of `model` over consecutive non-overlapping windows of `corpus` (each window the
/// model's context of inputs and their next tokens, [`EvalWindows`]; at most `max_windows`, 0 for all),
/// `batch` windows per forward.
pub fn evaluate(model: &Model, corpus: &Corpus, max_windows: usize, batch: usize) -> Result<Evaluation, GenerateError> {
    let context = model.config.context;
    if corpus.len() < context + 1 {
        return Err(GenerateError::CorpusTooShort { tokens: corpus.len(), needed: context + 1 });
    }
    let vocab = model.config.vocab_size;
    if let Some((position, token)) = corpus.first_outside(vocab) {
        return Err(GenerateError::CorpusTokenOutOfVocabulary { token, position, vocab });
    }
    let windows = EvalWindows::new(corpus.clone(), context, max_windows);
    let sum = window_loss_sum(model, &windows, 0..windows.len(), batch);
    Ok(Evaluation::of_sum(sum, &windows))
}

/// Σ over `windows`' windows `range` of each window's mean next-token loss under `model`, forward only
/// (no gradients, nothing changed), `batch` windows per forward: a data-parallel rank's share of an
/// evaluation — the shares of ranks whose ranges tile the windows sum to [`evaluate`]'s total.
pub fn window_loss_sum(model: &Model, windows: &EvalWindows, range: Range<usize>, batch: usize) -> f64 {
    let device = model.params()[0].device();
    tch::no_grad(|| {
        micro_batch_ranges(range, batch.max(1))
            .into_iter()
            .map(|part| {
                let count = part.len() as f64;
                let (inputs, targets) = windows.batch(part);
                let (inputs, targets) = (upload(&inputs, device), upload(&targets, device));
                cross_entropy(&model.forward(&inputs), &targets).double_value(&[]) * count
            })
            .sum()
    })
}

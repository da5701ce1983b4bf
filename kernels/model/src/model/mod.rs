//! The model families, as pure functions of an explicit, ordered parameter list, so that data-parallel
//! replicas, FSDP shards and pipeline stages can run any range of a model on parameters they own or have
//! gathered — whatever its family.
//!
//! This module is the one seam between the engines and the families: every engine calls [`embed`],
//! [`block`], [`head`] (or their `_recorded` forms), [`param_specs`] and the layout methods of
//! [`ModelConfig`]; only the `match` on [`Arch`] here knows which family runs. A family is a file:
//! `gpt2.rs` (GPT-2: learned positions, LayerNorm, GeLU MLP, fused QKV with biases) and `llama.rs`
//! (Llama, Mistral, Qwen2: RoPE, RMSNorm, grouped-query attention, SwiGLU).
//!
//! Every model's list is `embed` parameters, then `n_layers` blocks of the same number of parameters,
//! then the `head` parameters (final norm, and the output matrix unless it is tied to the token
//! embedding). With `tie_word_embeddings` the head multiplies by the embedding matrix itself, which is a
//! parameter of the embed range: [`head_params`] hands it to the head, and its gradient sums both uses.

use std::ops::Range;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::hf_weights::HfError;
use crate::precision::Precision;
use crate::rng::{hash_words, SplitMix64};
use crate::sections::{invalid, positive, ConfigError};

pub mod gpt2;
mod hf_names;
pub mod kv_cache;
pub mod llama;
pub mod peft;
pub mod presets;

pub use hf_names::{file_name, read_param};
pub use kv_cache::KvCache;
pub use peft::PeftConfig;

/// The family of a model: how its parameters are laid out and what its forward computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2 (Hugging Face `GPT2LMHeadModel`); gpt-tiny is one.
    #[default]
    Gpt2,
    /// The Llama family (Hugging Face `LlamaForCausalLM`; also `MistralForCausalLM` without a sliding
    /// window, and `Qwen2ForCausalLM` with `qkv_bias`).
    Llama,
}

impl Arch {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
        }
    }
}

/// GPT-2's MLP activation (Hugging Face `activation_function`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// Exact GeLU (erf); gpt-tiny's.
    #[default]
    Gelu,
    /// GeLU's tanh approximation (`gelu_new`), what the published GPT-2 checkpoints use.
    GeluNew,
}

/// Llama 3's rotary-frequency rescaling (`rope_scaling` with `rope_type = "llama3"`), or the linear one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
}

/// The model's shape. `[model]` in the job config; every key has a default (gpt-tiny), `preset` names a
/// known shape and `from_hf` a Hugging Face directory whose `config.json` gives the shape and whose
/// safetensors give the initial weights (see [`crate::hf`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    pub arch: Arch,
    /// The preset the shape came from (informational once resolved; see [`presets`]).
    pub preset: Option<String>,
    /// A Hugging Face model directory: the shape comes from its `config.json` (keys set beside it must
    /// agree) and the initial weights from its safetensors.
    pub from_hf: Option<PathBuf>,
    pub vocab_size: usize,
    /// Tokens per sample (sequence length).
    pub context: usize,
    /// Positions the model can address (GPT-2: rows of the position embedding; Llama: the
    /// `max_position_embeddings` it declares); 0 means `context`.
    pub max_positions: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// Llama: key/value heads (grouped-query attention); 0 means `n_heads`.
    pub n_kv_heads: usize,
    /// Width of each head; 0 means `d_model / n_heads`.
    pub head_dim: usize,
    /// Inner width of the MLP; 0 means the family's default (GPT-2: 4 × d_model; Llama: SwiGLU's
    /// 8/3 × d_model rounded up to a multiple of 256).
    pub ffn_hidden: usize,
    /// The head multiplies by the token embedding matrix instead of a matrix of its own.
    pub tie_word_embeddings: bool,
    /// LayerNorm's (GPT-2) or RMSNorm's (Llama) epsilon.
    pub norm_eps: f64,
    /// GPT-2's MLP activation.
    pub activation: Activation,
    /// Llama: the RoPE base.
    pub rope_theta: f64,
    /// Llama: the RoPE rescaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Llama: biases on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// Standard deviation of the initial matrices (Hugging Face `initializer_range`).
    pub init_std: f64,
    /// Parameter-efficient fine-tuning (`[peft]` in the job config): what trains, and LoRA's adapters.
    /// Changes the parameter list every engine works on (see [`peft`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peft: Option<PeftConfig>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self::gpt_tiny()
    }
}

/// One parameter's name, shape and initialisation, in the model's canonical order.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal {
        std: f64,
    },
    Zeros,
    Ones,
    /// A LoRA adapter drawn by troupe's RNG: `A` uniform in [-bound, bound) (PEFT's Kaiming-uniform),
    /// `B` zero (bound 0). Never read from `model.from_hf`.
    Adapter {
        bound: f64,
    },
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }

    /// Whether AdamW's weight decay applies (matrices and embeddings; not biases or norm gains).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

impl ModelConfig {
    /// gpt-tiny (DESIGN.md §4): GPT-2 family, vocab 256 (bytes), context 128, d_model 256, 4 blocks,
    /// 4 heads, untied head, exact GeLU: 3,323,392 parameters.
    pub fn gpt_tiny() -> Self {
        Self {
            arch: Arch::Gpt2,
            preset: None,
            from_hf: None,
            vocab_size: 256,
            context: 128,
            max_positions: 0,
            d_model: 256,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 0,
            head_dim: 0,
            ffn_hidden: 0,
            tie_word_embeddings: false,
            norm_eps: 1e-5,
            activation: Activation::Gelu,
            rope_theta: 10_000.0,
            rope_scaling: None,
            qkv_bias: false,
            init_std: 0.02,
            peft: None,
        }
    }

    pub fn head_dim(&self) -> usize {
        if self.head_dim > 0 {
            self.head_dim
        } else {
            self.d_model / self.n_heads.max(1)
        }
    }

    pub fn kv_heads(&self) -> usize {
        if self.n_kv_heads > 0 {
            self.n_kv_heads
        } else {
            self.n_heads
        }
    }

    pub fn positions(&self) -> usize {
        if self.max_positions > 0 {
            self.max_positions
        } else {
            self.context
        }
    }

    pub fn ffn_hidden(&self) -> usize {
        if self.ffn_hidden > 0 {
            return self.ffn_hidden;
        }
        match self.arch {
            Arch::Gpt2 => 4 * self.d_model,
            Arch::Llama => (8 * self.d_model / 3).div_ceil(256) * 256,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("model.vocab_size", self.vocab_size)?;
        positive("model.context", self.context)?;
        positive("model.d_model", self.d_model)?;
        positive("model.n_layers", self.n_layers)?;
        positive("model.n_heads", self.n_heads)?;
        if self.context > self.positions() {
            return Err(invalid(
                "model.context",
                self.context,
                format!(
                    "must be at most model.max_positions ({}), the positions the model addresses",
                    self.positions()
                ),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return Err(invalid("model.norm_eps", self.norm_eps, "must be a finite number > 0, e.g. 1e-5"));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(invalid("model.init_std", self.init_std, "must be a finite number > 0, e.g. 0.02"));
        }
        match self.arch {
            Arch::Gpt2 => gpt2::validate(self)?,
            Arch::Llama => llama::validate(self)?,
        }
        match &self.peft {
            Some(peft) => peft.validate(self),
            None => Ok(()),
        }
    }

    /// The family's parameters before the first block (the embeddings).
    pub fn params_before_blocks(&self) -> usize {
        match self.arch {
            Arch::Gpt2 => gpt2::PARAMS_BEFORE_BLOCKS,
            Arch::Llama => llama::PARAMS_BEFORE_BLOCKS,
        }
    }

    /// The family's parameters of each block.
    pub fn params_per_block(&self) -> usize {
        match self.arch {
            Arch::Gpt2 => gpt2::PARAMS_PER_BLOCK,
            Arch::Llama => llama::params_per_block(self),
        }
    }

    /// The family's parameters after the last block (the final norm, and the output matrix unless tied).
    pub fn params_after_blocks(&self) -> usize {
        let norm = match self.arch {
            Arch::Gpt2 => 2,
            Arch::Llama => 1,
        };
        norm + usize::from(!self.tie_word_embeddings)
    }

    /// The embeddings' positions in [`base_specs`].
    pub fn base_embed_range(&self) -> Range<usize> {
        0..self.params_before_blocks()
    }

    /// Block `index`'s positions in [`base_specs`].
    pub fn base_block_range(&self, index: usize) -> Range<usize> {
        let start = self.params_before_blocks() + index * self.params_per_block();
        start..start + self.params_per_block()
    }

    /// The head's positions in [`base_specs`] (without the tied embedding).
    pub fn base_head_range(&self) -> Range<usize> {
        let total = self.params_before_blocks() + self.n_layers * self.params_per_block() + self.params_after_blocks();
        total - self.params_after_blocks()..total
    }

    /// Length of the parameter list ([`param_specs`]: what trains).
    pub fn param_tensors(&self) -> usize {
        match &self.peft {
            None => self.base_head_range().end,
            Some(_) => peft::parts(self).iter().map(|p| p.specs.len()).sum(),
        }
    }

    /// The embeddings' positions in the parameter list.
    pub fn embed_range(&self) -> Range<usize> {
        match &self.peft {
            None => self.base_embed_range(),
            Some(_) => self.part_range(0),
        }
    }

    /// Block `index`'s positions in the parameter list.
    pub fn block_range(&self, index: usize) -> Range<usize> {
        match &self.peft {
            None => self.base_block_range(index),
            Some(_) => self.part_range(1 + index),
        }
    }

    /// The head's positions in the parameter list (without the tied embedding, which is in
    /// [`Self::embed_range`]).
    pub fn head_range(&self) -> Range<usize> {
        match &self.peft {
            None => self.base_head_range(),
            Some(_) => self.part_range(1 + self.n_layers),
        }
    }

    fn part_range(&self, part: usize) -> Range<usize> {
        peft::part_ranges(&peft::parts(self)).swap_remove(part)
    }

    /// Whether the head's parameters include the token embedding: tied, and the embedding trains.
    pub fn head_takes_embedding(&self) -> bool {
        self.tie_word_embeddings && peft::trains_embedding(self)
    }

    /// Total parameter count (a tied matrix counted once).
    pub fn param_count(&self) -> usize {
        param_specs(self).iter().map(|s| s.numel()).sum()
    }

    /// The keys whose values differ from `other`'s, each as `model.KEY: SELF vs OTHER` (dotted for
    /// `[peft]`'s: `model.peft.r: 8 vs 4`), for errors that must say what differs.
    pub fn differences(&self, other: &ModelConfig) -> Vec<String> {
        fn flat(prefix: &str, value: toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
            match value {
                toml::Value::Table(table) => {
                    table.into_iter().for_each(|(k, v)| flat(&format!("{prefix}.{k}"), v, out))
                }
                other => {
                    out.insert(prefix.to_owned(), other.to_string());
                }
            }
        }
        let table = |config: &ModelConfig| {
            let mut out = std::collections::BTreeMap::new();
            flat("model", toml::Value::try_from(config).expect("a model config serialises"), &mut out);
            out
        };
        let (mine, theirs) = (table(self), table(other));
        let keys: std::collections::BTreeSet<&String> = mine.keys().chain(theirs.keys()).collect();
        let shown = |v: Option<&String>| v.cloned().unwrap_or_else(|| "(not set)".into());
        keys.into_iter()
            .filter(|k| mine.get(*k) != theirs.get(*k))
            .map(|k| format!("{k}: {} vs {}", shown(mine.get(k)), shown(theirs.get(k))))
            .collect()
    }

    /// Forward FLOPs per token (2 per multiply-accumulate of the matmuls, attention included), the
    /// figure MFU estimates use (training ≈ 3× this).
    pub fn forward_flops_per_token(&self) -> f64 {
        let (d, l, t, v) = (self.d_model as f64, self.n_layers as f64, self.context as f64, self.vocab_size as f64);
        let attn_width = (self.n_heads * self.head_dim()) as f64;
        let kv_width = (self.kv_heads() * self.head_dim()) as f64;
        let ffn = self.ffn_hidden() as f64;
        let mlp_matrices = match self.arch {
            Arch::Gpt2 => 2.0,
            Arch::Llama => 3.0,
        };
        let projections = 2.0 * d * (2.0 * attn_width + 2.0 * kv_width) + 2.0 * mlp_matrices * d * ffn;
        let attention = 2.0 * 2.0 * t * attn_width;
        l * (projections + attention) + 2.0 * d * v
    }
}

/// The family's canonical, ordered parameter list (Hugging Face's names: GPT-2's without the
/// `transformer.` prefix, Llama's as they are): what the model's weights are.
pub fn base_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    match cfg.arch {
        Arch::Gpt2 => gpt2::param_specs(cfg),
        Arch::Llama => llama::param_specs(cfg),
    }
}

/// The parameter list every engine trains, shards and checkpoints: [`base_specs`], or with `[peft]`
/// what trains of it and LoRA's adapters (see [`peft`]).
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    match &cfg.peft {
        None => base_specs(cfg),
        Some(_) => peft::parts(cfg).into_iter().flat_map(|p| p.specs).collect(),
    }
}

/// The initial values of parameter `index` from its spec: a pure function of (seed, index), computed in
/// Rust so every rank and every device gets the same bits whatever libtorch's global RNG has done.
/// (A model with `from_hf` starts from the file instead: see [`crate::init::initial_values`].)
pub fn init_values(spec: &ParamSpec, seed: u64, index: usize) -> Vec<f32> {
    let n = spec.numel();
    match spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => {
            let mut rng = SplitMix64::new(hash_words(&[seed, index as u64, 0x1417]));
            (0..n).map(|_| (rng.next_normal() * std) as f32).collect()
        }
        Init::Adapter { bound: 0.0 } => vec![0.0; n],
        Init::Adapter { bound } => {
            let mut rng = SplitMix64::new(hash_words(&[seed, index as u64, 0x10a4]));
            (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect()
        }
    }
}

/// The model: its config, its parameters (fp32 leaves requiring grad, in [`param_specs`] order) and
/// the precision its matrix products compute in.
/// Built by [`Model::new`] and [`Model::load`] (in [`crate::init`], above this module: they read
/// `model.from_hf` and `peft.from_adapters`) or by [`Model::unmaterialised`].
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub precision: Precision,
    specs: Vec<ParamSpec>,
    params: Vec<Tensor>,
    /// With `[peft]`: the frozen base, held so the process keeps its tensors while the model lives.
    base: Option<std::sync::Arc<peft::Base>>,
}

impl Model {
    /// A model of `config` with parameters `specs` (its [`param_specs`]) of values `values`, computing in
    /// fp32: what [`Self::load`] builds from the values [`crate::init`] reads or draws.
    pub(crate) fn from_values(
        config: ModelConfig,
        specs: Vec<ParamSpec>,
        values: Vec<Vec<f32>>,
    ) -> Result<Self, HfError> {
        let params = specs
            .iter()
            .zip(values)
            .map(|(spec, values)| Tensor::from_slice(&values).view(spec.shape.as_slice()).set_requires_grad(true))
            .collect();
        let base = hold_base(&config)?;
        Ok(Self { config, precision: Precision::Fp32, specs, params, base })
    }

    /// The model's shape without its values: every parameter an empty leaf (as a ZeRO-3 rank keeps them
    /// between steps). For a rank that holds only parts of a fresh model, read by [`crate::init::initial_flat`].
    pub fn unmaterialised(config: ModelConfig) -> Self {
        let specs = param_specs(&config);
        let empty = || Tensor::zeros([0], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let params = specs.iter().map(|_| empty()).collect();
        let base = hold_base(&config).unwrap_or_else(|e| panic!("{e}"));
        Self { config, precision: Precision::Fp32, specs, params, base }
    }

    /// The same model with its parameters on `device` (same values: initialisation is computed in Rust,
    /// so every device starts from the same bits). Leaves again, gradients reset.
    pub fn to_device(mut self, device: tch::Device) -> Self {
        if self.params.first().is_some_and(|p| p.device() != device) {
            self.params = self.params.iter().map(|p| p.detach().to_device(device).set_requires_grad(true)).collect();
        }
        self
    }

    /// The same model computing its matrix products in `precision` (the parameters stay fp32).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// With `[peft]`, the frozen base the model runs on.
    pub fn base(&self) -> Option<&peft::Base> {
        self.base.as_deref()
    }

    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    pub fn params_mut(&mut self) -> &mut [Tensor] {
        &mut self.params
    }

    pub fn named_params(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.specs.iter().map(|s| s.name.as_str()).zip(&self.params)
    }

    /// Parameters of the model's shape (from the specs, so a ZeRO-3 rank whose tensors are released
    /// between steps still counts them).
    pub fn param_count(&self) -> usize {
        self.specs.iter().map(ParamSpec::numel).sum()
    }

    /// Token ids `[batch, time]` (int64) → logits `[batch, time, vocab]`.
    pub fn forward(&self, tokens: &Tensor) -> Tensor {
        self.forward_training(tokens, None)
    }

    /// [`Self::forward`] in a training forward of `samples` (LoRA's dropout applies).
    pub fn forward_training(&self, tokens: &Tensor, samples: Option<Samples>) -> Tensor {
        let mut x = self.embed(tokens);
        for index in 0..self.config.n_layers {
            let p = &self.params[self.config.block_range(index)];
            x = block_training(&self.config, self.precision, index, p, &x, samples);
        }
        self.head(&x)
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (both `[batch, time]`).
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(tokens);
        cross_entropy(&logits, targets)
    }

    /// [`Self::loss`] in a training forward of `samples`.
    pub fn loss_training(&self, tokens: &Tensor, targets: &Tensor, samples: Option<Samples>) -> Tensor {
        cross_entropy(&self.forward_training(tokens, samples), targets)
    }

    /// The embeddings: `[batch, time]` → `[batch, time, d_model]`.
    pub fn embed(&self, tokens: &Tensor) -> Tensor {
        embed(&self.config, &self.params[self.config.embed_range()], tokens)
    }

    /// Transformer block `index`: `[batch, time, d_model]` → same shape.
    pub fn block(&self, index: usize, x: &Tensor) -> Tensor {
        block(&self.config, self.precision, index, &self.params[self.config.block_range(index)], x)
    }

    /// The final norm and the head: `[batch, time, d_model]` → logits `[batch, time, vocab]`.
    pub fn head(&self, x: &Tensor) -> Tensor {
        head(&self.config, self.precision, &head_params(&self.config, &self.params), x)
    }

    /// Token ids `[batch, time]` that continue the positions in `cache` → their logits `[batch, time,
    /// vocab]`, their keys and values added to the cache (incremental decoding; no autograd graph is
    /// needed, run it under `tch::no_grad`). Equals the last `time` positions of [`Self::forward`] over
    /// the whole sequence.
    pub fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Tensor {
        let config = &self.config;
        let start = cache.len();
        let time = tokens.size()[1];
        assert!(
            (start + time) as usize <= config.positions(),
            "sequence of {} tokens exceeds the model's positions",
            start + time
        );
        let w = Weights::of(config, 0, &self.params[config.embed_range()], tokens.device());
        let mut x = match config.arch {
            Arch::Gpt2 => gpt2::embed(&w, tokens, start, &mut Vec::new()),
            Arch::Llama => llama::embed(&w, tokens, &mut Vec::new()),
        };
        for (i, layer) in cache.layers.iter_mut().enumerate() {
            let w = Weights::of(config, 1 + i, &self.params[config.block_range(i)], x.device());
            x = match config.arch {
                Arch::Gpt2 => gpt2::block(config, self.precision, &w, &x, &mut Vec::new(), Some(layer)),
                Arch::Llama => llama::block(config, self.precision, &w, &x, &mut Vec::new(), Some(layer)),
            };
        }
        self.head(&x)
    }

    /// Copies parameter values in from another list in canonical order (shapes must match).
    pub fn load_values(&mut self, values: &[Tensor]) {
        assert_eq!(values.len(), self.params.len(), "parameter list length");
        tch::no_grad(|| {
            for (p, v) in self.params.iter_mut().zip(values) {
                p.copy_(v);
            }
        });
    }
}

/// The output of one operation that uses parameters, and which of the parameters handed to the forward
/// it uses (positions in that slice). A forward that records these lets a zero-bubble backward compute
/// the input gradient first — asking autograd for the gradients of these outputs instead of the
/// weights, so the weight-gradient products are skipped — and each operation's weight gradient later
/// from its output's gradient alone.
#[derive(Debug)]
pub struct ParamOp {
    pub output: Tensor,
    pub params: Range<usize>,
}

pub(crate) fn record(ops: &mut Vec<ParamOp>, output: &Tensor, params: Range<usize>) {
    ops.push(ParamOp { output: output.shallow_clone(), params });
}

fn hold_base(config: &ModelConfig) -> Result<Option<std::sync::Arc<peft::Base>>, HfError> {
    match (&config.peft, &config.from_hf) {
        (Some(_), Some(dir)) => peft::Base::open(dir).map(Some),
        _ => Ok(None),
    }
}

/// Which samples a training forward computes: micro-batch row `b` is sample `first + b` of step `step`'s
/// global batch, in a job seeded `seed`. What makes LoRA's dropout mask a function of the sample — the
/// same whatever the split of the batch over ranks, micro-batches and pipeline stages. Inference and
/// evaluation run without one (no dropout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Samples {
    pub seed: u64,
    pub step: u64,
    pub first: usize,
}

impl Samples {
    pub fn new(seed: u64, step: u64, first: usize) -> Self {
        Self { seed, step, first }
    }
}

/// A part of the model (0 the embeddings, 1 + i block i, 1 + n_layers the head) as its family's forward
/// takes it: the family's parameters in order, each the trainable tensor handed in or (`[peft]`) the
/// frozen base's, and the LoRA adapters beside the targeted weights. Operations are recorded in the
/// positions of the trainable slice handed in; an operation on frozen parameters alone is not recorded.
pub struct Weights {
    params: Vec<Tensor>,
    lora: Vec<Option<Lora>>,
    /// Where each family parameter is in the trainable slice (None: the slice is the family's list).
    slots: Option<Vec<peft::Slot>>,
    /// Training: LoRA's dropout on the adapters' input, keyed by the samples and this part.
    dropout: Option<(f64, Samples, usize)>,
    /// Per family parameter: the input columns a weight sees when they are a slice of its whole input
    /// (offset, whole width) — a tensor-parallel rank's row-parallel weight — for the dropout mask.
    /// Empty: every input whole.
    columns: Vec<Option<(i64, i64)>>,
}

struct Lora {
    a: Tensor,
    b: Tensor,
    scale: f64,
    /// `A`'s position in the trainable slice (`B` is the next).
    slot: usize,
}

impl std::ops::Index<usize> for Weights {
    type Output = Tensor;

    fn index(&self, index: usize) -> &Tensor {
        &self.params[index]
    }
}

impl Weights {
    /// Part `part` of `config`'s model on its trainable slice `trainable`; frozen tensors come from the
    /// base on `device`.
    pub fn of(config: &ModelConfig, part: usize, trainable: &[Tensor], device: tch::Device) -> Self {
        if config.peft.is_none() {
            let params = trainable.iter().map(Tensor::shallow_clone).collect::<Vec<_>>();
            let lora = params.iter().map(|_| None).collect();
            return Self { params, lora, slots: None, dropout: None, columns: Vec::new() };
        }
        let base = peft::Base::of(config);
        Self::with_frozen(config, part, trainable, |index| base.tensor(config, index, device))
    }

    /// A training forward of `samples`: LoRA's dropout (`peft.dropout` > 0) applies.
    fn training(mut self, config: &ModelConfig, part: usize, samples: Option<Samples>) -> Self {
        let p = config.peft.as_ref().map_or(0.0, |peft| peft.dropout);
        self.dropout = samples.filter(|_| p > 0.0).map(|samples| (p, samples, part));
        self
    }

    /// [`Self::training`] where family parameter `i`'s input is the columns `columns[i] = Some((offset,
    /// whole width))` of its whole input (a tensor-parallel rank's row-parallel weight): its dropout
    /// mask is those columns of the whole input's mask, as the single-process forward draws it.
    pub fn training_on_columns(
        self,
        config: &ModelConfig,
        part: usize,
        samples: Option<Samples>,
        columns: Vec<Option<(i64, i64)>>,
    ) -> Self {
        Self { columns, ..self.training(config, part, samples) }
    }

    /// Records `output` as the operation of the family parameters `family` (the trainable ones).
    fn record(&self, ops: &mut Vec<ParamOp>, output: &Tensor, family: Range<usize>) {
        let Some(slots) = &self.slots else { return record(ops, output, family) };
        let trained: Vec<usize> = family.filter_map(|i| slots[i].trained).collect();
        if let (Some(&first), Some(&last)) = (trained.first(), trained.last()) {
            assert_eq!(last + 1 - first, trained.len(), "an operation's trained parameters are consecutive");
            record(ops, output, first..last + 1);
        }
    }

    /// `x · weightᵀ + bias` in `precision`, plus the weight's LoRA update `scale · (x · Aᵀ) · Bᵀ` when it
    /// has adapters (PEFT's order: A, then B, then the scale).
    fn linear(
        &self,
        precision: Precision,
        x: &Tensor,
        weight: usize,
        bias: Option<usize>,
        ops: &mut Vec<ParamOp>,
    ) -> Tensor {
        let out = precision.linear(x, &self.params[weight], bias.map(|b| &self.params[b]));
        self.record(ops, &out, weight..bias.map_or(weight, |b| b) + 1);
        let Some(lora) = &self.lora[weight] else { return out };
        let dropped;
        let input = match self.dropout {
            Some((p, samples, part)) => {
                let columns = self.columns.get(weight).copied().flatten();
                dropped = x * peft::dropout_mask_of_columns(x, p, samples, part, weight, columns);
                &dropped
            }
            None => x,
        };
        let update = precision.linear(&precision.linear(input, &lora.a, None), &lora.b, None) * lora.scale;
        record(ops, &update, lora.slot..lora.slot + 2);
        out + update
    }
}

/// What the head runs on, from the whole parameter list: the head range, then (tied, and the embedding
/// trains) the token embedding. Shallow handles: the gradients land on the parameters themselves.
pub fn head_params(config: &ModelConfig, params: &[Tensor]) -> Vec<Tensor> {
    let mut head: Vec<Tensor> = params[config.head_range()].iter().map(Tensor::shallow_clone).collect();
    if config.head_takes_embedding() {
        head.push(params[0].shallow_clone());
    }
    head
}

/// Where a block's pieces are in its parameter list: the norm before attention and the one before the MLP,
/// and the two matrices (with their biases, if any) that take the attention's and the MLP's inner width
/// back to d_model — the seam at which tensor parallelism cuts a block ([`crate::tensor_parallel`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockLayout {
    pub attn_norm: Range<usize>,
    pub attn_out: usize,
    pub attn_out_bias: Option<usize>,
    pub mlp_norm: Range<usize>,
    pub mlp_out: usize,
    pub mlp_out_bias: Option<usize>,
}

impl ModelConfig {
    /// The family's [`BlockLayout`].
    pub fn block_layout(&self) -> BlockLayout {
        match self.arch {
            Arch::Gpt2 => gpt2::BLOCK,
            Arch::Llama => llama::block_layout(self),
        }
    }
}

/// A block's norm at `range` of its parameters `w` (see [`BlockLayout`]).
pub(crate) fn block_norm(config: &ModelConfig, w: &Weights, range: Range<usize>, x: &Tensor) -> Tensor {
    match config.arch {
        Arch::Gpt2 => gpt2::norm(config, w, range, x),
        Arch::Llama => llama::rms_norm(x, &w[range.start], config.norm_eps),
    }
}

/// A block's attention on the normed `h`, before the output projection: `[batch, time, n_heads ×
/// head_dim]`, for the heads `config` states (a tensor-parallel rank's config states its own).
pub(crate) fn block_attention(config: &ModelConfig, precision: Precision, w: &Weights, h: &Tensor) -> Tensor {
    match config.arch {
        Arch::Gpt2 => gpt2::attention(config, precision, w, h, &mut Vec::new(), None),
        Arch::Llama => llama::attention(config, precision, w, h, &mut Vec::new(), None),
    }
}

/// A block's MLP on the normed `h`, before its last matrix: `[batch, time, ffn_hidden]`.
pub(crate) fn block_mlp_hidden(config: &ModelConfig, precision: Precision, w: &Weights, h: &Tensor) -> Tensor {
    let gate = config.block_layout().mlp_norm.end;
    match config.arch {
        Arch::Gpt2 => gpt2::mlp_hidden(config, precision, w, h, &mut Vec::new()),
        Arch::Llama => llama::mlp_hidden(precision, w, h, gate, &mut Vec::new()),
    }
}

/// The final norm on the head's parameters `w` (its first ones).
pub(crate) fn final_norm(config: &ModelConfig, w: &Weights, x: &Tensor) -> Tensor {
    match config.arch {
        Arch::Gpt2 => gpt2::final_norm(config, w, x),
        Arch::Llama => llama::rms_norm(x, &w[0], config.norm_eps),
    }
}

/// The embeddings on the embed range's parameters: `[batch, time]` → `[batch, time, d_model]`. The free
/// functions take exactly the parameters they use, so a pipeline stage can run its range of the model
/// on the tensors it owns.
pub fn embed(config: &ModelConfig, params: &[Tensor], tokens: &Tensor) -> Tensor {
    embed_recorded(config, params, tokens, &mut Vec::new())
}

/// [`embed`], recording its parameter operations.
pub fn embed_recorded(config: &ModelConfig, params: &[Tensor], tokens: &Tensor, ops: &mut Vec<ParamOp>) -> Tensor {
    let time = tokens.size()[1];
    assert!(time as usize <= config.positions(), "sequence of {time} tokens exceeds the model's positions");
    let w = Weights::of(config, 0, params, tokens.device());
    match config.arch {
        Arch::Gpt2 => gpt2::embed(&w, tokens, 0, ops),
        Arch::Llama => llama::embed(&w, tokens, ops),
    }
}

/// Transformer block `index` on its parameters: `[batch, time, d_model]` → same shape. The linear layers
/// and attention compute in `precision`; the norms and the residual stream stay fp32 (autocast's
/// policy, see [`crate::precision`]).
pub fn block(config: &ModelConfig, precision: Precision, index: usize, p: &[Tensor], x: &Tensor) -> Tensor {
    block_recorded(config, precision, index, p, x, None, &mut Vec::new())
}

/// [`block`] in a training forward of `samples` (LoRA's dropout applies).
pub fn block_training(
    config: &ModelConfig,
    precision: Precision,
    index: usize,
    p: &[Tensor],
    x: &Tensor,
    samples: Option<Samples>,
) -> Tensor {
    block_recorded(config, precision, index, p, x, samples, &mut Vec::new())
}

/// [`block`], recording its parameter operations; `samples` for a training forward.
pub fn block_recorded(
    config: &ModelConfig,
    precision: Precision,
    index: usize,
    p: &[Tensor],
    x: &Tensor,
    samples: Option<Samples>,
    ops: &mut Vec<ParamOp>,
) -> Tensor {
    let w = Weights::of(config, 1 + index, p, x.device()).training(config, 1 + index, samples);
    match config.arch {
        Arch::Gpt2 => gpt2::block(config, precision, &w, x, ops, None),
        Arch::Llama => llama::block(config, precision, &w, x, ops, None),
    }
}

/// The final norm and the head on [`head_params`]: `[batch, time, d_model]` → logits
/// `[batch, time, vocab]` (in `precision`'s kind).
pub fn head(config: &ModelConfig, precision: Precision, params: &[Tensor], x: &Tensor) -> Tensor {
    head_recorded(config, precision, params, x, &mut Vec::new())
}

/// [`head`], recording its parameter operations.
pub fn head_recorded(
    config: &ModelConfig,
    precision: Precision,
    params: &[Tensor],
    x: &Tensor,
    ops: &mut Vec<ParamOp>,
) -> Tensor {
    let w = Weights::of(config, 1 + config.n_layers, params, x.device());
    let norm = config.params_after_blocks() - usize::from(!config.tie_word_embeddings);
    let h = final_norm(config, &w, x);
    w.record(ops, &h, 0..norm);
    w.linear(precision, &h, norm, None, ops)
}

/// Mean cross-entropy of `[batch, time, vocab]` logits against `[batch, time]` targets, in fp32 whatever
/// the logits' kind.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[2];
    logits.to_kind(Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]))
}

//! gpt-tiny, the reference model (DESIGN.md §4): a GPT-2 style decoder written as a pure function of an
//! explicit, ordered parameter list, so that data-parallel replicas, FSDP shards and pipeline stages can
//! run any range of it on parameters they own or have gathered.
//!
//! Per block: pre-LayerNorm → causal multi-head self-attention → residual → LayerNorm → MLP d→4d→d with
//! exact GeLU → residual. Token + learned position embeddings, a final LayerNorm, an untied linear head
//! without bias, no dropout. Linear weights are stored as PyTorch does, `[out, in]`.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::config::{invalid, positive, ConfigError};
use crate::precision::Precision;
use crate::rng::{hash_words, SplitMix64};

const LAYER_NORM_EPS: f64 = 1e-5;
const INIT_STD: f64 = 0.02;
/// Parameters per transformer block (see [`param_specs`]).
pub const PARAMS_PER_BLOCK: usize = 12;
/// Parameters before the first block: token and position embeddings.
pub const PARAMS_BEFORE_BLOCKS: usize = 2;
/// Parameters after the last block: final LayerNorm gain and bias, the head.
pub const PARAMS_AFTER_BLOCKS: usize = 3;

/// The model's shape. `[model]` in the job config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// Tokens per sample (sequence length).
    pub context: usize,
    pub d_model: usize,
    pub n_layers: usize,
    pub n_heads: usize,
}

impl Default for GptConfig {
    fn default() -> Self {
        Self::gpt_tiny()
    }
}

impl GptConfig {
    /// vocab 256 (bytes), context 128, d_model 256, 4 blocks, 4 heads: 3,323,392 parameters.
    pub fn gpt_tiny() -> Self {
        Self { vocab_size: 256, context: 128, d_model: 256, n_layers: 4, n_heads: 4 }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("model.vocab_size", self.vocab_size)?;
        positive("model.context", self.context)?;
        positive("model.d_model", self.d_model)?;
        positive("model.n_layers", self.n_layers)?;
        positive("model.n_heads", self.n_heads)?;
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(invalid(
                "model.n_heads",
                self.n_heads,
                format!("must divide model.d_model ({})", self.d_model),
            ));
        }
        Ok(())
    }

    /// Total parameter count.
    pub fn param_count(&self) -> usize {
        param_specs(self).iter().map(|s| s.numel()).sum()
    }

    /// Forward FLOPs per token (2 per multiply-accumulate of the matmuls, attention included), the
    /// figure MFU estimates use (training ≈ 3× this).
    pub fn forward_flops_per_token(&self) -> f64 {
        let (d, l, t, v) = (self.d_model as f64, self.n_layers as f64, self.context as f64, self.vocab_size as f64);
        let matmuls = l * (2.0 * 3.0 * d * d + 2.0 * d * d + 2.0 * 2.0 * 4.0 * d * d) + 2.0 * d * v;
        let attention = l * 2.0 * 2.0 * t * d;
        matmuls + attention
    }
}

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// One parameter's name, shape and initialisation, in the model's canonical order.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product::<i64>() as usize
    }

    /// Whether AdamW's weight decay applies (matrices and embeddings; not biases or LayerNorm gains).
    pub fn decays(&self) -> bool {
        self.shape.len() >= 2
    }
}

/// The canonical, ordered parameter list (HF GPT-2 names).
pub fn param_specs(cfg: &GptConfig) -> Vec<ParamSpec> {
    let (v, t, d) = (cfg.vocab_size as i64, cfg.context as i64, cfg.d_model as i64);
    let residual_std = INIT_STD / (2.0 * cfg.n_layers as f64).sqrt();
    let spec = |name: String, shape: Vec<i64>, init| ParamSpec { name, shape, init };
    let normal = Init::Normal { std: INIT_STD };
    let mut specs = vec![spec("wte.weight".into(), vec![v, d], normal), spec("wpe.weight".into(), vec![t, d], normal)];
    for i in 0..cfg.n_layers {
        let p = |suffix: &str| format!("h.{i}.{suffix}");
        specs.extend([
            spec(p("ln_1.weight"), vec![d], Init::Ones),
            spec(p("ln_1.bias"), vec![d], Init::Zeros),
            spec(p("attn.c_attn.weight"), vec![3 * d, d], normal),
            spec(p("attn.c_attn.bias"), vec![3 * d], Init::Zeros),
            spec(p("attn.c_proj.weight"), vec![d, d], Init::Normal { std: residual_std }),
            spec(p("attn.c_proj.bias"), vec![d], Init::Zeros),
            spec(p("ln_2.weight"), vec![d], Init::Ones),
            spec(p("ln_2.bias"), vec![d], Init::Zeros),
            spec(p("mlp.c_fc.weight"), vec![4 * d, d], normal),
            spec(p("mlp.c_fc.bias"), vec![4 * d], Init::Zeros),
            spec(p("mlp.c_proj.weight"), vec![d, 4 * d], Init::Normal { std: residual_std }),
            spec(p("mlp.c_proj.bias"), vec![d], Init::Zeros),
        ]);
    }
    specs.extend([
        spec("ln_f.weight".into(), vec![d], Init::Ones),
        spec("ln_f.bias".into(), vec![d], Init::Zeros),
        spec("lm_head.weight".into(), vec![v, d], normal),
    ]);
    specs
}

/// The initial values of parameter `index`: a pure function of (seed, index), computed in Rust so every
/// rank and every device gets the same bits whatever libtorch's global RNG has done.
pub fn init_values(spec: &ParamSpec, seed: u64, index: usize) -> Vec<f32> {
    let n = spec.numel();
    match spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal { std } => {
            let mut rng = SplitMix64::new(hash_words(&[seed, index as u64, 0x1417]));
            (0..n).map(|_| (rng.next_normal() * std) as f32).collect()
        }
    }
}

/// The model: its config, its parameters (fp32 leaves requiring grad, in [`param_specs`] order) and
/// the precision its matrix products compute in.
#[derive(Debug)]
pub struct Gpt {
    pub config: GptConfig,
    pub precision: Precision,
    specs: Vec<ParamSpec>,
    params: Vec<Tensor>,
}

impl Gpt {
    /// A freshly initialised model on the CPU, computing in fp32 (see [`Self::with_precision`]).
    pub fn new(config: GptConfig, seed: u64) -> Self {
        let specs = param_specs(&config);
        let params = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                Tensor::from_slice(&init_values(spec, seed, i)).view(spec.shape.as_slice()).set_requires_grad(true)
            })
            .collect();
        Self { config, precision: Precision::Fp32, specs, params }
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
        let mut x = self.embed(tokens);
        for block in 0..self.config.n_layers {
            x = self.block(block, &x);
        }
        self.head(&x)
    }

    /// Mean next-token cross-entropy of `tokens` against `targets` (both `[batch, time]`).
    pub fn loss(&self, tokens: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(tokens);
        cross_entropy(&logits, targets)
    }

    /// Token + position embeddings: `[batch, time]` → `[batch, time, d_model]`.
    pub fn embed(&self, tokens: &Tensor) -> Tensor {
        embed(&self.config, &self.params[..PARAMS_BEFORE_BLOCKS], tokens)
    }

    /// Transformer block `index`: `[batch, time, d_model]` → same shape.
    pub fn block(&self, index: usize, x: &Tensor) -> Tensor {
        let params = &self.params[PARAMS_BEFORE_BLOCKS + index * PARAMS_PER_BLOCK..][..PARAMS_PER_BLOCK];
        block(&self.config, self.precision, params, x)
    }

    /// Final LayerNorm and the untied head: `[batch, time, d_model]` → logits `[batch, time, vocab]`.
    pub fn head(&self, x: &Tensor) -> Tensor {
        head(&self.config, self.precision, &self.params[self.params.len() - PARAMS_AFTER_BLOCKS..], x)
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
    pub params: std::ops::Range<usize>,
}

fn record(ops: &mut Vec<ParamOp>, output: &Tensor, params: std::ops::Range<usize>) {
    ops.push(ParamOp { output: output.shallow_clone(), params });
}

/// Token + position embeddings on `params` = `[wte, wpe]`: `[batch, time]` → `[batch, time, d_model]`.
/// The free functions take exactly the parameters they use, so a pipeline stage can run its range of
/// the model on the tensors it owns.
pub fn embed(config: &GptConfig, params: &[Tensor], tokens: &Tensor) -> Tensor {
    embed_recorded(config, params, tokens, &mut Vec::new())
}

/// [`embed`], recording its parameter operations.
pub fn embed_recorded(config: &GptConfig, params: &[Tensor], tokens: &Tensor, ops: &mut Vec<ParamOp>) -> Tensor {
    let time = tokens.size()[1];
    assert!(time as usize <= config.context, "sequence of {time} tokens exceeds the context");
    let positions = Tensor::arange(time, (Kind::Int64, tokens.device()));
    let (wte, wpe) = (&params[0], &params[1]);
    let token_embedding = Tensor::embedding(wte, tokens, -1, false, false);
    let position_embedding = Tensor::embedding(wpe, &positions, -1, false, false);
    record(ops, &token_embedding, 0..1);
    record(ops, &position_embedding, 1..2);
    token_embedding + position_embedding
}

/// One transformer block on its [`PARAMS_PER_BLOCK`] parameters: `[batch, time, d_model]` → same shape.
/// The linear layers and attention compute in `precision`; the LayerNorms and the residual stream stay
/// fp32 (autocast's policy, see [`crate::precision`]).
pub fn block(config: &GptConfig, precision: Precision, p: &[Tensor], x: &Tensor) -> Tensor {
    block_recorded(config, precision, p, x, &mut Vec::new())
}

/// [`block`], recording its parameter operations.
pub fn block_recorded(
    config: &GptConfig,
    precision: Precision,
    p: &[Tensor],
    x: &Tensor,
    ops: &mut Vec<ParamOp>,
) -> Tensor {
    let (batch, time, d) = x.size3().expect("block input is [batch, time, d_model]");
    let (heads, head_dim) = (config.n_heads as i64, config.head_dim() as i64);

    let h = x.layer_norm([d], Some(&p[0]), Some(&p[1]), LAYER_NORM_EPS, false);
    record(ops, &h, 0..2);
    let qkv = precision.linear(&h, &p[2], Some(&p[3]));
    record(ops, &qkv, 2..4);
    let split = |t: &Tensor| t.view([batch, time, heads, head_dim]).transpose(1, 2);
    let parts = qkv.split(d, 2);
    let (q, k, v) = (split(&parts[0]), split(&parts[1]), split(&parts[2]));
    // Scores scaled by 1/sqrt(head_dim); future positions masked to -inf before the softmax.
    let attended = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, true, None, false);
    let attended = attended.transpose(1, 2).contiguous().view([batch, time, d]);
    let projected = precision.linear(&attended, &p[4], Some(&p[5]));
    record(ops, &projected, 4..6);
    let x = x + projected;

    let h = x.layer_norm([d], Some(&p[6]), Some(&p[7]), LAYER_NORM_EPS, false);
    record(ops, &h, 6..8);
    let h = precision.linear(&h, &p[8], Some(&p[9]));
    record(ops, &h, 8..10);
    let out = precision.linear(&h.gelu("none"), &p[10], Some(&p[11]));
    record(ops, &out, 10..12);
    x + out
}

/// Final LayerNorm and the untied head on `[ln_f.weight, ln_f.bias, lm_head.weight]`:
/// `[batch, time, d_model]` → logits `[batch, time, vocab]` (in `precision`'s kind).
pub fn head(config: &GptConfig, precision: Precision, params: &[Tensor], x: &Tensor) -> Tensor {
    head_recorded(config, precision, params, x, &mut Vec::new())
}

/// [`head`], recording its parameter operations.
pub fn head_recorded(
    config: &GptConfig,
    precision: Precision,
    params: &[Tensor],
    x: &Tensor,
    ops: &mut Vec<ParamOp>,
) -> Tensor {
    let d = config.d_model as i64;
    let h = x.layer_norm([d], Some(&params[0]), Some(&params[1]), LAYER_NORM_EPS, false);
    record(ops, &h, 0..2);
    let logits = precision.linear(&h, &params[2], None);
    record(ops, &logits, 2..3);
    logits
}

/// Mean cross-entropy of `[batch, time, vocab]` logits against `[batch, time]` targets, in fp32 whatever
/// the logits' kind.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    let vocab = logits.size()[2];
    logits.to_kind(Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]))
}

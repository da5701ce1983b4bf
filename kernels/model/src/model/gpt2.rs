//! GPT-2 (Hugging Face `GPT2LMHeadModel`): token + learned position embeddings; per block pre-LayerNorm →
//! causal multi-head self-attention (fused QKV with biases, scores scaled by 1/sqrt(head_dim)) → residual →
//! LayerNorm → MLP d→ffn→d with GeLU → residual; a final LayerNorm; the head (untied in gpt-tiny, tied to
//! the token embedding in the published GPT-2 checkpoints). No dropout. Linear weights are stored as
//! PyTorch's `nn.Linear` does, `[out, in]`; Hugging Face's `Conv1D` layout (`[in, out]`) is applied at the
//! file boundary (`crate::hf`).

use tch::{Kind, Tensor};

use super::kv_cache::LayerCache;
use super::{Activation, BlockLayout, Init, ModelConfig, ParamOp, ParamSpec, Weights};
use crate::precision::Precision;
use crate::sections::{invalid, ConfigError};

/// Parameters per transformer block (see [`param_specs`]).
pub const PARAMS_PER_BLOCK: usize = 12;
/// Parameters before the first block: token and position embeddings.
pub const PARAMS_BEFORE_BLOCKS: usize = 2;

pub(super) fn validate(cfg: &ModelConfig) -> Result<(), ConfigError> {
    if !cfg.d_model.is_multiple_of(cfg.n_heads) {
        return Err(invalid("model.n_heads", cfg.n_heads, format!("must divide model.d_model ({})", cfg.d_model)));
    }
    if cfg.head_dim != 0 && cfg.head_dim * cfg.n_heads != cfg.d_model {
        return Err(invalid(
            "model.head_dim",
            cfg.head_dim,
            "GPT-2's heads split d_model: leave it 0 (d_model / n_heads)",
        ));
    }
    if cfg.n_kv_heads != 0 && cfg.n_kv_heads != cfg.n_heads {
        return Err(invalid("model.n_kv_heads", cfg.n_kv_heads, "GPT-2 has no grouped-query attention: leave it 0"));
    }
    if cfg.rope_scaling.is_some() || cfg.qkv_bias {
        return Err(invalid("model.arch", "gpt2", "rope_scaling and qkv_bias are Llama-family keys: remove them"));
    }
    Ok(())
}

/// The canonical, ordered parameter list (HF GPT-2 names without the `transformer.` prefix).
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    let (v, t, d, f) = (cfg.vocab_size as i64, cfg.positions() as i64, cfg.d_model as i64, cfg.ffn_hidden() as i64);
    let residual_std = cfg.init_std / (2.0 * cfg.n_layers as f64).sqrt();
    let spec = |name: String, shape: Vec<i64>, init| ParamSpec { name, shape, init };
    let normal = Init::Normal { std: cfg.init_std };
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
            spec(p("mlp.c_fc.weight"), vec![f, d], normal),
            spec(p("mlp.c_fc.bias"), vec![f], Init::Zeros),
            spec(p("mlp.c_proj.weight"), vec![d, f], Init::Normal { std: residual_std }),
            spec(p("mlp.c_proj.bias"), vec![d], Init::Zeros),
        ]);
    }
    specs.extend([spec("ln_f.weight".into(), vec![d], Init::Ones), spec("ln_f.bias".into(), vec![d], Init::Zeros)]);
    if !cfg.tie_word_embeddings {
        specs.push(spec("lm_head.weight".into(), vec![v, d], normal));
    }
    specs
}

/// Token + position embeddings on `[wte, wpe]`, the tokens at positions `start..`.
pub(super) fn embed(params: &Weights, tokens: &Tensor, start: i64, ops: &mut Vec<ParamOp>) -> Tensor {
    let time = tokens.size()[1];
    let positions = Tensor::arange_start(start, start + time, (Kind::Int64, tokens.device()));
    let (wte, wpe) = (&params[0], &params[1]);
    let token_embedding = Tensor::embedding(wte, tokens, -1, false, false);
    let position_embedding = Tensor::embedding(wpe, &positions, -1, false, false);
    params.record(ops, &token_embedding, 0..1);
    params.record(ops, &position_embedding, 1..2);
    token_embedding + position_embedding
}

/// Where a block's pieces are in its [`PARAMS_PER_BLOCK`] parameters.
pub(super) const BLOCK: BlockLayout = BlockLayout {
    attn_norm: 0..2,
    attn_out: 4,
    attn_out_bias: Some(5),
    mlp_norm: 6..8,
    mlp_out: 10,
    mlp_out_bias: Some(11),
};

/// One block on its [`PARAMS_PER_BLOCK`] parameters; with `cache`, `x` continues the cached positions and
/// its keys and values join the cache.
pub(super) fn block(
    cfg: &ModelConfig,
    precision: Precision,
    p: &Weights,
    x: &Tensor,
    ops: &mut Vec<ParamOp>,
    cache: Option<&mut LayerCache>,
) -> Tensor {
    let h = norm(cfg, p, BLOCK.attn_norm, x);
    p.record(ops, &h, BLOCK.attn_norm);
    let attended = attention(cfg, precision, p, &h, ops, cache);
    let projected = p.linear(precision, &attended, 4, Some(5), ops);
    let x = x + projected;

    let h = norm(cfg, p, BLOCK.mlp_norm, &x);
    p.record(ops, &h, BLOCK.mlp_norm);
    let activated = mlp_hidden(cfg, precision, p, &h, ops);
    let out = p.linear(precision, &activated, 10, Some(11), ops);
    x + out
}

/// LayerNorm with the gain and bias at `range` of the block's parameters.
pub(super) fn norm(cfg: &ModelConfig, p: &Weights, range: std::ops::Range<usize>, x: &Tensor) -> Tensor {
    let d = x.size()[x.dim() - 1];
    x.layer_norm([d], Some(&p[range.start]), Some(&p[range.start + 1]), cfg.norm_eps, false)
}

/// Causal self-attention of `cfg.n_heads` heads on the normed `h`, before the output projection:
/// `[batch, time, n_heads × head_dim]`. The fused QKV holds Q, K and V of the heads one after the other.
pub(super) fn attention(
    cfg: &ModelConfig,
    precision: Precision,
    p: &Weights,
    h: &Tensor,
    ops: &mut Vec<ParamOp>,
    cache: Option<&mut LayerCache>,
) -> Tensor {
    let (batch, time, _) = h.size3().expect("block input is [batch, time, d_model]");
    let (heads, head_dim) = (cfg.n_heads as i64, cfg.head_dim() as i64);
    let width = heads * head_dim;
    let qkv = p.linear(precision, h, 2, Some(3), ops);
    let split = |t: &Tensor| t.view([batch, time, heads, head_dim]).transpose(1, 2);
    let parts = qkv.split(width, 2);
    let (q, k, v) = (split(&parts[0]), split(&parts[1]), split(&parts[2]));
    // Scores scaled by 1/sqrt(head_dim); future positions masked to -inf before the softmax.
    let start = cache.as_ref().map_or(0, |c| c.len());
    let (k, v) = match cache {
        None => (k, v),
        Some(cache) => cache.append(k, v),
    };
    let attended = super::kv_cache::attend(&q, &k, &v, start);
    attended.transpose(1, 2).contiguous().view([batch, time, width])
}

/// The MLP's first matrix and the activation on the normed `h`: `[batch, time, ffn_hidden]`.
pub(super) fn mlp_hidden(
    cfg: &ModelConfig,
    precision: Precision,
    p: &Weights,
    h: &Tensor,
    ops: &mut Vec<ParamOp>,
) -> Tensor {
    let h = p.linear(precision, h, 8, Some(9), ops);
    match cfg.activation {
        Activation::Gelu => h.gelu("none"),
        Activation::GeluNew => h.gelu("tanh"),
    }
}

/// The final LayerNorm on `[ln_f.weight, ln_f.bias]`.
pub(super) fn final_norm(cfg: &ModelConfig, params: &Weights, x: &Tensor) -> Tensor {
    x.layer_norm([cfg.d_model as i64], Some(&params[0]), Some(&params[1]), cfg.norm_eps, false)
}

//! The Llama family (Hugging Face `LlamaForCausalLM`; `MistralForCausalLM` without a sliding window and
//! `Qwen2ForCausalLM`, whose q/k/v projections carry biases, are the same function): a token embedding;
//! per block RMSNorm → grouped-query causal self-attention with rotary position embeddings (Hugging
//! Face's `rotate_half` convention) → residual → RMSNorm → SwiGLU MLP (`down(silu(gate(x)) · up(x))`) →
//! residual; a final RMSNorm; the head (untied, or tied to the embedding). No biases but Qwen2's, no
//! dropout. Names are Hugging Face's as they are, so Llama weights need no renaming.

use std::sync::Mutex;

use tch::{Kind, Tensor};

use super::kv_cache::LayerCache;
use super::{BlockLayout, Init, ModelConfig, ParamOp, ParamSpec, RopeScaling, Weights};
use crate::precision::Precision;
use crate::sections::{invalid, ConfigError};

/// Parameters before the first block: the token embedding.
pub const PARAMS_BEFORE_BLOCKS: usize = 1;

/// Parameters per block: two norms, q/k/v/o, gate/up/down, and Qwen2's q/k/v biases.
pub fn params_per_block(cfg: &ModelConfig) -> usize {
    9 + if cfg.qkv_bias { 3 } else { 0 }
}

pub(super) fn validate(cfg: &ModelConfig) -> Result<(), ConfigError> {
    let kv = cfg.kv_heads();
    if kv > cfg.n_heads || !cfg.n_heads.is_multiple_of(kv) {
        return Err(invalid(
            "model.n_kv_heads",
            kv,
            format!(
                "must divide model.n_heads ({}): each key/value head serves a whole group of query heads",
                cfg.n_heads
            ),
        ));
    }
    if cfg.head_dim == 0 && !cfg.d_model.is_multiple_of(cfg.n_heads) {
        return Err(invalid(
            "model.n_heads",
            cfg.n_heads,
            format!("must divide model.d_model ({}), or set model.head_dim", cfg.d_model),
        ));
    }
    if !cfg.head_dim().is_multiple_of(2) {
        return Err(invalid("model.head_dim", cfg.head_dim(), "must be even: rotary embeddings rotate pairs"));
    }
    if !(cfg.rope_theta.is_finite() && cfg.rope_theta > 1.0) {
        return Err(invalid("model.rope_theta", cfg.rope_theta, "must be a finite number > 1, e.g. 10000 or 500000"));
    }
    match &cfg.rope_scaling {
        Some(RopeScaling::Linear { factor }) | Some(RopeScaling::Llama3 { factor, .. })
            if factor.is_nan() || *factor < 1.0 =>
        {
            Err(invalid("model.rope_scaling.factor", factor, "must be ≥ 1"))
        }
        Some(RopeScaling::Llama3 { low_freq_factor, high_freq_factor, .. })
            if high_freq_factor.is_nan() || high_freq_factor <= low_freq_factor =>
        {
            Err(invalid(
                "model.rope_scaling.high_freq_factor",
                high_freq_factor,
                format!("must exceed low_freq_factor ({low_freq_factor})"),
            ))
        }
        _ => Ok(()),
    }
}

/// The canonical, ordered parameter list, with Hugging Face's names.
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    let (v, d, f) = (cfg.vocab_size as i64, cfg.d_model as i64, cfg.ffn_hidden() as i64);
    let q_width = (cfg.n_heads * cfg.head_dim()) as i64;
    let kv_width = (cfg.kv_heads() * cfg.head_dim()) as i64;
    let spec = |name: String, shape: Vec<i64>, init| ParamSpec { name, shape, init };
    let normal = Init::Normal { std: cfg.init_std };
    let mut specs = vec![spec("model.embed_tokens.weight".into(), vec![v, d], normal)];
    for i in 0..cfg.n_layers {
        let p = |suffix: &str| format!("model.layers.{i}.{suffix}");
        specs.push(spec(p("input_layernorm.weight"), vec![d], Init::Ones));
        for (name, width) in [("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)] {
            specs.push(spec(p(&format!("self_attn.{name}.weight")), vec![width, d], normal));
            if cfg.qkv_bias {
                specs.push(spec(p(&format!("self_attn.{name}.bias")), vec![width], Init::Zeros));
            }
        }
        specs.extend([
            spec(p("self_attn.o_proj.weight"), vec![d, q_width], normal),
            spec(p("post_attention_layernorm.weight"), vec![d], Init::Ones),
            spec(p("mlp.gate_proj.weight"), vec![f, d], normal),
            spec(p("mlp.up_proj.weight"), vec![f, d], normal),
            spec(p("mlp.down_proj.weight"), vec![d, f], normal),
        ]);
    }
    specs.push(spec("model.norm.weight".into(), vec![d], Init::Ones));
    if !cfg.tie_word_embeddings {
        specs.push(spec("lm_head.weight".into(), vec![v, d], normal));
    }
    specs
}

/// The token embedding.
pub(super) fn embed(params: &Weights, tokens: &Tensor, ops: &mut Vec<ParamOp>) -> Tensor {
    let embedded = Tensor::embedding(&params[0], tokens, -1, false, false);
    params.record(ops, &embedded, 0..1);
    embedded
}

/// RMSNorm as Hugging Face computes it: in fp32, `x / sqrt(mean(x²) + eps)`, cast back, times the gain.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Tensor {
    let h = x.to_kind(Kind::Float);
    let variance = h.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let normed = (h * (variance + eps).rsqrt()).to_kind(x.kind());
    weight * normed
}

/// The rotary frequencies (`inv_freq`) of `cfg`, computed in fp32 as Hugging Face does, with its
/// `rope_scaling` applied.
pub fn inv_freq(cfg: &ModelConfig, device: tch::Device) -> Tensor {
    let dim = cfg.head_dim() as i64;
    let exponents = Tensor::arange_start_step(0, dim, 2, (Kind::Int64, device)).to_kind(Kind::Float) / dim as f64;
    // Filled on the device: a host scalar copied there would make the host wait for the device.
    let base = Tensor::scalar_tensor(cfg.rope_theta as f32 as f64, (Kind::Float, device));
    let inv = base.pow(&exponents).reciprocal();
    match &cfg.rope_scaling {
        None => inv,
        Some(RopeScaling::Linear { factor }) => inv / *factor,
        Some(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }) => {
            let old = *original_max_position_embeddings as f64;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            let wavelen = inv.reciprocal() * (2.0 * std::f64::consts::PI);
            // Long wavelengths (below the low-frequency bound) are divided by the factor, short ones kept.
            let scaled = (&inv / *factor).where_self(&wavelen.gt(low_wavelen), &inv);
            let smooth = (old / &wavelen - *low_freq_factor) / (high_freq_factor - low_freq_factor);
            let smoothed: Tensor = (1.0 - &smooth) * &scaled / *factor + &smooth * &scaled;
            let medium = wavelen.ge(high_wavelen).logical_and(&wavelen.le(low_wavelen));
            smoothed.where_self(&medium, &scaled)
        }
    }
}

/// `cos` and `sin` of the rotary angles of positions `start..start + time`: each `[time, head_dim]` (the
/// frequencies repeated for both halves, as Hugging Face's `cat((freqs, freqs))`), fp32.
pub fn rotary(cfg: &ModelConfig, start: i64, time: i64, device: tch::Device) -> (Tensor, Tensor) {
    let positions = Tensor::arange_start(start, start + time, (Kind::Float, device));
    let freqs = positions.unsqueeze(1).matmul(&inv_freq(cfg, device).unsqueeze(0));
    let angles = Tensor::cat(&[&freqs, &freqs], -1);
    (angles.cos(), angles.sin())
}

/// [`rotary`] cast to `kind`, computed once per model shape, positions, device and kind and then kept:
/// every block of every step of a run uses the same angles, which would otherwise cost each block a
/// dozen small kernels. The few most recent sets are kept (decoding asks for one position at a time).
fn rotary_kept(cfg: &ModelConfig, start: i64, time: i64, device: tch::Device, kind: Kind) -> (Tensor, Tensor) {
    type Key = (u64, usize, Option<RopeScaling>, i64, i64, tch::Device, Kind);
    const KEPT: usize = 8;
    static KEPT_SETS: Mutex<Vec<(Key, Tensor, Tensor)>> = Mutex::new(Vec::new());
    let key: Key = (cfg.rope_theta.to_bits(), cfg.head_dim(), cfg.rope_scaling.clone(), start, time, device, kind);
    let mut kept = KEPT_SETS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, cos, sin)) = kept.iter().find(|(k, ..)| *k == key) {
        return (cos.shallow_clone(), sin.shallow_clone());
    }
    let (cos, sin) = rotary(cfg, start, time, device);
    let (cos, sin) = (cos.to_kind(kind), sin.to_kind(kind));
    if kept.len() == KEPT {
        drop(kept.remove(0));
    }
    kept.push((key, cos.shallow_clone(), sin.shallow_clone()));
    (cos, sin)
}

/// Rotates `x` (`[batch, heads, time, head_dim]`) by the angles (in `x`'s kind): `x·cos +
/// rotate_half(x)·sin`, where `rotate_half` maps the halves (x₁, x₂) to (−x₂, x₁).
fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let halves = x.split(half, -1);
    let rotated = Tensor::cat(&[&(-&halves[1]), &halves[0]], -1);
    x * cos + rotated * sin
}

/// Where a block's pieces are in its [`params_per_block`] parameters.
pub(super) fn block_layout(cfg: &ModelConfig) -> BlockLayout {
    let o = 1 + 3 * (1 + usize::from(cfg.qkv_bias));
    BlockLayout {
        attn_norm: 0..1,
        attn_out: o,
        attn_out_bias: None,
        mlp_norm: o + 1..o + 2,
        mlp_out: o + 4,
        mlp_out_bias: None,
    }
}

/// One block on its [`params_per_block`] parameters; with `cache`, `x` continues the cached positions
/// (its rotary angles start there) and its keys and values join the cache.
pub(super) fn block(
    cfg: &ModelConfig,
    precision: Precision,
    p: &Weights,
    x: &Tensor,
    ops: &mut Vec<ParamOp>,
    cache: Option<&mut LayerCache>,
) -> Tensor {
    let layout = block_layout(cfg);
    let h = rms_norm(x, &p[0], cfg.norm_eps);
    p.record(ops, &h, 0..1);
    let attended = attention(cfg, precision, p, &h, ops, cache);
    let o = layout.attn_out;
    let projected = p.linear(precision, &attended, o, None, ops);
    // fp32 residual + a 16-bit product: type promotion casts inside the add (as Hugging Face's `+`).
    let x = x + projected;

    let h = rms_norm(&x, &p[o + 1], cfg.norm_eps);
    p.record(ops, &h, o + 1..o + 2);
    let hidden = mlp_hidden(precision, p, &h, o + 2, ops);
    let out = p.linear(precision, &hidden, o + 4, None, ops);
    x + out
}

/// Grouped-query causal self-attention of `cfg.n_heads` query heads sharing `cfg.kv_heads()` key/value
/// heads, rotary embeddings applied, on the normed `h`, before the output projection:
/// `[batch, time, n_heads × head_dim]`.
pub(super) fn attention(
    cfg: &ModelConfig,
    precision: Precision,
    p: &Weights,
    h: &Tensor,
    ops: &mut Vec<ParamOp>,
    cache: Option<&mut LayerCache>,
) -> Tensor {
    let (batch, time, _) = h.size3().expect("block input is [batch, time, d_model]");
    let (heads, kv_heads, head_dim) = (cfg.n_heads as i64, cfg.kv_heads() as i64, cfg.head_dim() as i64);
    let bias = usize::from(cfg.qkv_bias);
    let mut at = 1;
    let mut project = |ops: &mut Vec<ParamOp>| {
        let out = p.linear(precision, h, at, (bias == 1).then_some(at + 1), ops);
        at += 1 + bias;
        out
    };
    let (q, k, v) = (project(ops), project(ops), project(ops));
    let heads_of = |t: &Tensor, n: i64| t.view([batch, time, n, head_dim]).transpose(1, 2);
    let start = cache.as_ref().map_or(0, |c| c.len());
    let (cos, sin) = rotary_kept(cfg, start, time, h.device(), q.kind());
    debug_assert_eq!(k.kind(), q.kind(), "q and k come from the same precision");
    let q = apply_rotary(&heads_of(&q, heads), &cos, &sin);
    let k = apply_rotary(&heads_of(&k, kv_heads), &cos, &sin);
    let v = heads_of(&v, kv_heads);
    // Each key/value head serves `heads / kv_heads` query heads in a row (Hugging Face's `repeat_kv`).
    // A cache keeps them unrepeated.
    let repeat = |t: Tensor| {
        if kv_heads == heads {
            return t;
        }
        let len = t.size()[2];
        t.unsqueeze(2)
            .expand([batch, kv_heads, heads / kv_heads, len, head_dim], false)
            .reshape([batch, heads, len, head_dim])
    };
    let (k, v) = match cache {
        None => (k, v),
        Some(cache) => cache.append(k, v),
    };
    let attended = super::kv_cache::attend(&q, &repeat(k), &repeat(v), start);
    attended.transpose(1, 2).contiguous().view([batch, time, heads * head_dim])
}

/// SwiGLU's inner product `silu(gate(h)) · up(h)` (gate at `gate`, up the next): `[batch, time, ffn_hidden]`.
pub(super) fn mlp_hidden(precision: Precision, p: &Weights, h: &Tensor, gate: usize, ops: &mut Vec<ParamOp>) -> Tensor {
    let g = p.linear(precision, h, gate, None, ops);
    let up = p.linear(precision, h, gate + 1, None, ops);
    g.silu() * up
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The values' bits, read through fp32 (exact for a 16-bit kind).
    fn bits(t: &Tensor) -> Vec<u32> {
        let values: Vec<f32> = Vec::try_from(t.to_kind(Kind::Float).contiguous().view([-1])).expect("f32 values");
        values.iter().map(|v| v.to_bits()).collect()
    }

    /// The kept angles are the ones computed afresh, in the kind asked for, for the shape and positions
    /// asked for; a set asked for again after more than the kept number of others is still right.
    #[test]
    fn kept_rotary_angles_equal_fresh_ones_for_each_shape_positions_and_kind() {
        let cfg = super::super::presets::preset("llama-tiny").expect("a preset");
        let other = ModelConfig { rope_theta: cfg.rope_theta * 2.0, ..cfg.clone() };
        let asks = [
            (&cfg, 0, 16, Kind::BFloat16),
            (&cfg, 0, 16, Kind::Float),
            (&cfg, 3, 16, Kind::BFloat16),
            (&cfg, 0, 9, Kind::BFloat16),
            (&other, 0, 16, Kind::BFloat16),
        ];
        // Twice round, with more distinct sets than are kept in between.
        let fillers: Vec<i64> = (100..100 + 10).collect();
        for _ in 0..2 {
            for &(config, start, time, kind) in &asks {
                let (cos, sin) = rotary_kept(config, start, time, Device::Cpu, kind);
                let (fresh_cos, fresh_sin) = rotary(config, start, time, Device::Cpu);
                assert_eq!((cos.kind(), cos.size()), (kind, vec![time, config.head_dim() as i64]));
                assert_eq!(bits(&cos), bits(&fresh_cos.to_kind(kind)), "cos at {start}+{time} in {kind:?}");
                assert_eq!(bits(&sin), bits(&fresh_sin.to_kind(kind)), "sin at {start}+{time} in {kind:?}");
                if kind == Kind::Float {
                    assert!(cos.allclose(&fresh_cos, 0.0, 0.0, false), "fp32 angles are the fresh ones exactly");
                }
            }
            for &start in &fillers {
                let _ = rotary_kept(&cfg, start, 1, Device::Cpu, Kind::Float);
            }
        }
        // Another theta gives other angles (the key holds the model's rotary settings).
        let (a, _) = rotary_kept(&cfg, 0, 16, Device::Cpu, Kind::Float);
        let (b, _) = rotary_kept(&other, 0, 16, Device::Cpu, Kind::Float);
        assert!(!a.allclose(&b, 0.0, 0.0, false));
    }
}

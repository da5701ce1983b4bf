//! `config.json` ↔ [`ModelConfig`]: the architectures troupe builds, read with every key that changes the
//! function checked (a value troupe does not build is refused by name, never ignored), and written so
//! that transformers builds exactly troupe's model.

use std::path::Path;

use serde_json::{json, Value};

use super::HfError;
use crate::model::{Activation, Arch, ModelConfig, RopeScaling};

/// The `architectures` troupe reads, and the family each is.
pub const ARCHITECTURES: &[(&str, Arch)] = &[
    ("LlamaForCausalLM", Arch::Llama),
    ("MistralForCausalLM", Arch::Llama),
    ("Qwen2ForCausalLM", Arch::Llama),
    ("GPT2LMHeadModel", Arch::Gpt2),
];

/// Reads `dir/config.json` into the model it describes (context = its position limit; `[model] context`
/// may shorten it).
pub fn read_config(dir: &Path) -> Result<ModelConfig, HfError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io { path: path.clone(), source })?;
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| HfError::Format { path: path.clone(), message: format!("not JSON: {e}") })?;
    let reader = Reader { path: &path, json: &json };
    let architecture = json
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .ok_or_else(|| reader.format("has no \"architectures\": [\"...ForCausalLM\"]"))?;
    let supported = || ARCHITECTURES.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", ");
    let Some(&(_, arch)) = ARCHITECTURES.iter().find(|(name, _)| *name == architecture) else {
        return Err(HfError::Architecture {
            path: path.clone(),
            found: architecture.to_owned(),
            supported: supported(),
        });
    };
    let mut config = match arch {
        Arch::Gpt2 => reader.gpt2()?,
        Arch::Llama => reader.llama(architecture)?,
    };
    config.init_std = reader.float_or("initializer_range", 0.02)?;
    config.context = config.positions();
    Ok(config)
}

struct Reader<'a> {
    path: &'a Path,
    json: &'a Value,
}

impl Reader<'_> {
    fn format(&self, message: &str) -> HfError {
        HfError::Format { path: self.path.to_owned(), message: message.to_owned() }
    }

    fn unsupported(&self, key: &str, value: &Value, why: &str) -> HfError {
        HfError::Unsupported {
            path: self.path.to_owned(),
            key: key.to_owned(),
            value: value.to_string(),
            why: why.into(),
        }
    }

    fn present(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize, HfError> {
        let value = self.present(key).ok_or_else(|| self.format(&format!("has no {key:?}")))?;
        value.as_u64().map(|v| v as usize).ok_or_else(|| self.unsupported(key, value, "must be a positive integer"))
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize, HfError> {
        if self.present(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }

    fn float_or(&self, key: &str, default: f64) -> Result<f64, HfError> {
        match self.present(key) {
            None => Ok(default),
            Some(value) => value.as_f64().ok_or_else(|| self.unsupported(key, value, "must be a number")),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool, HfError> {
        match self.present(key) {
            None => Ok(default),
            Some(value) => value.as_bool().ok_or_else(|| self.unsupported(key, value, "must be true or false")),
        }
    }

    /// A key that must hold `allowed` (or be absent) for troupe's function to be the model's.
    fn require(&self, key: &str, allowed: &[Value], why: &str) -> Result<(), HfError> {
        match self.present(key) {
            Some(value) if !allowed.contains(value) => Err(self.unsupported(key, value, why)),
            _ => Ok(()),
        }
    }

    fn gpt2(&self) -> Result<ModelConfig, HfError> {
        let d_model = self.usize("n_embd")?;
        let activation = match self.present("activation_function").and_then(Value::as_str).unwrap_or("gelu_new") {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluNew,
            other => {
                return Err(self.unsupported(
                    "activation_function",
                    &json!(other),
                    "troupe builds gelu, gelu_new and gelu_pytorch_tanh",
                ))
            }
        };
        self.require("scale_attn_weights", &[json!(true)], "troupe scales attention scores by 1/sqrt(head_dim)")?;
        self.require("scale_attn_by_inverse_layer_idx", &[json!(false)], "not built: scores are not scaled per layer")?;
        Ok(ModelConfig {
            arch: Arch::Gpt2,
            vocab_size: self.usize("vocab_size")?,
            max_positions: self.usize("n_positions")?,
            d_model,
            n_layers: self.usize("n_layer")?,
            n_heads: self.usize("n_head")?,
            ffn_hidden: self.usize_or("n_inner", 4 * d_model)?,
            tie_word_embeddings: self.bool_or("tie_word_embeddings", true)?,
            norm_eps: self.float_or("layer_norm_epsilon", 1e-5)?,
            activation,
            ..ModelConfig::gpt_tiny()
        })
    }

    fn llama(&self, architecture: &str) -> Result<ModelConfig, HfError> {
        let d_model = self.usize("hidden_size")?;
        let n_heads = self.usize("num_attention_heads")?;
        let max_positions = self.usize("max_position_embeddings")?;
        self.require("hidden_act", &[json!("silu")], "troupe's SwiGLU gates with silu")?;
        self.require(
            "attention_bias",
            &[json!(false)],
            "biases on every attention projection are not built (Qwen2's q/k/v biases are)",
        )?;
        self.require("mlp_bias", &[json!(false)], "MLP biases are not built")?;
        self.require("pretraining_tp", &[json!(1)], "only pretraining_tp = 1 computes the standard function")?;
        if architecture == "MistralForCausalLM" {
            if let Some(window) = self.present("sliding_window") {
                if window.as_u64().is_none_or(|w| (w as usize) < max_positions) {
                    return Err(self.unsupported(
                        "sliding_window",
                        window,
                        "sliding-window attention is not built; null or ≥ max_position_embeddings is the same function",
                    ));
                }
            }
        }
        if architecture == "Qwen2ForCausalLM" {
            self.require("use_sliding_window", &[json!(false)], "sliding-window attention is not built")?;
        }
        let head_dim = self.usize_or("head_dim", d_model / n_heads.max(1))?;
        Ok(ModelConfig {
            arch: Arch::Llama,
            vocab_size: self.usize("vocab_size")?,
            max_positions,
            d_model,
            n_layers: self.usize("num_hidden_layers")?,
            n_heads,
            n_kv_heads: self.usize_or("num_key_value_heads", n_heads)?,
            head_dim: if head_dim * n_heads == d_model { 0 } else { head_dim },
            ffn_hidden: self.usize("intermediate_size")?,
            tie_word_embeddings: self.bool_or("tie_word_embeddings", false)?,
            norm_eps: self.float_or("rms_norm_eps", 1e-6)?,
            rope_theta: self.rope_theta()?,
            rope_scaling: self.rope_scaling()?,
            qkv_bias: architecture == "Qwen2ForCausalLM",
            ..ModelConfig::gpt_tiny()
        })
    }

    /// RoPE's base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4.x).
    fn rope_theta(&self) -> Result<f64, HfError> {
        match self.present("rope_parameters").and_then(|p| p.get("rope_theta")) {
            Some(theta) => {
                theta.as_f64().ok_or_else(|| self.unsupported("rope_parameters.rope_theta", theta, "must be a number"))
            }
            None => self.float_or("rope_theta", 10_000.0),
        }
    }

    /// RoPE's rescaling: `rope_parameters` (transformers 5) or `rope_scaling` (4.x).
    fn rope_scaling(&self) -> Result<Option<RopeScaling>, HfError> {
        let Some(scaling) = self.present("rope_parameters").or_else(|| self.present("rope_scaling")) else {
            return Ok(None);
        };
        let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str).unwrap_or("");
        let number = |key: &str| {
            scaling
                .get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| self.unsupported(&format!("rope_scaling.{key}"), scaling, "must be a number"))
        };
        match kind {
            "default" => Ok(None),
            "linear" => Ok(Some(RopeScaling::Linear { factor: number("factor")? })),
            "llama3" => Ok(Some(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: number("original_max_position_embeddings")? as usize,
            })),
            _ => {
                Err(self.unsupported("rope_scaling", scaling, "troupe builds the \"llama3\" and \"linear\" rope types"))
            }
        }
    }
}

/// The `config.json` of `config`'s model, in `torch_dtype`, as transformers writes it.
pub fn write_config(config: &ModelConfig, torch_dtype: &str) -> Value {
    let mut json = match config.arch {
        Arch::Gpt2 => json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.positions(),
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.ffn_hidden(),
            "activation_function": match config.activation { Activation::Gelu => "gelu", Activation::GeluNew => "gelu_new" },
            "layer_norm_epsilon": config.norm_eps,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": true,
            "use_cache": true,
        }),
        Arch::Llama => {
            let (architecture, model_type) =
                if config.qkv_bias { ("Qwen2ForCausalLM", "qwen2") } else { ("LlamaForCausalLM", "llama") };
            let mut json = json!({
                "architectures": [architecture],
                "model_type": model_type,
                "vocab_size": config.vocab_size,
                "max_position_embeddings": config.positions(),
                "hidden_size": config.d_model,
                "intermediate_size": config.ffn_hidden(),
                "num_hidden_layers": config.n_layers,
                "num_attention_heads": config.n_heads,
                "num_key_value_heads": config.kv_heads(),
                "hidden_act": "silu",
                "rms_norm_eps": config.norm_eps,
                "rope_theta": config.rope_theta,
                "attention_dropout": 0.0,
                "use_cache": true,
            });
            if !config.qkv_bias {
                json["head_dim"] = json!(config.head_dim());
                json["attention_bias"] = json!(false);
                json["mlp_bias"] = json!(false);
            }
            json["rope_scaling"] = match &config.rope_scaling {
                None => Value::Null,
                Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => {
                    json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                           "high_freq_factor": high_freq_factor,
                           "original_max_position_embeddings": original_max_position_embeddings})
                }
            };
            json
        }
    };
    if config.arch == Arch::Gpt2 && config.vocab_size <= 50256 {
        // GPT2Config's default token ids (50256) would lie outside a smaller vocabulary.
        json["bos_token_id"] = Value::Null;
        json["eos_token_id"] = Value::Null;
    }
    json["tie_word_embeddings"] = json!(config.tie_word_embeddings);
    json["initializer_range"] = json!(config.init_std);
    json["torch_dtype"] = json!(torch_dtype);
    json
}

/// The `config.json` key that decides `[model]` key `key` of a model of family `arch`.
pub fn json_key(arch: Arch, key: &str) -> &str {
    let pairs: &[(&str, &str)] = match arch {
        Arch::Gpt2 => &[
            ("max_positions", "n_positions"),
            ("d_model", "n_embd"),
            ("n_layers", "n_layer"),
            ("n_heads", "n_head"),
            ("ffn_hidden", "n_inner"),
            ("norm_eps", "layer_norm_epsilon"),
            ("activation", "activation_function"),
        ],
        Arch::Llama => &[
            ("max_positions", "max_position_embeddings"),
            ("d_model", "hidden_size"),
            ("n_layers", "num_hidden_layers"),
            ("n_heads", "num_attention_heads"),
            ("n_kv_heads", "num_key_value_heads"),
            ("ffn_hidden", "intermediate_size"),
            ("norm_eps", "rms_norm_eps"),
        ],
    };
    match key {
        "arch" => "architectures",
        _ => pairs.iter().find(|(ours, _)| *ours == key).map_or(key, |(_, theirs)| theirs),
    }
}

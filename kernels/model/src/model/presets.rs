//! Known model shapes by name (`[model] preset = "…"`), with Hugging Face's exact shapes for the published
//! ones. A preset fills every key of `[model]`; keys set beside it override it. Their parameter counts are
//! tested (`presets_have_their_published_sizes`) and listed with their memory needs in docs/guide.md.

use super::{Activation, Arch, ModelConfig};

/// Every preset's name, what it is, and its parameter count.
pub const PRESETS: &[(&str, &str)] = &[
    ("gpt-tiny", "GPT-2 family, byte vocabulary, 4 blocks of 256 (the default; 3.3 M parameters)"),
    ("gpt2", "GPT-2 small as published (124 M parameters, tied head, gelu_new)"),
    ("llama-tiny", "Llama family test shape: byte vocabulary, 4 blocks of 256, 4 heads, 2 KV heads (3.0 M)"),
    ("smollm2-135m", "SmolLM2-135M (Llama architecture, 30 blocks of 576, GQA 9/3, tied; 135 M)"),
    ("tinyllama-1.1b", "TinyLlama-1.1B (22 blocks of 2048, GQA 32/4, untied; 1.1 B)"),
];

/// The preset called `name`, if there is one.
pub fn preset(name: &str) -> Option<ModelConfig> {
    let base = ModelConfig::gpt_tiny();
    let config = match name {
        "gpt-tiny" => base,
        "gpt2" => ModelConfig {
            vocab_size: 50257,
            context: 1024,
            d_model: 768,
            n_layers: 12,
            n_heads: 12,
            tie_word_embeddings: true,
            activation: Activation::GeluNew,
            ..base
        },
        "llama-tiny" => ModelConfig {
            arch: Arch::Llama,
            vocab_size: 256,
            context: 128,
            d_model: 256,
            n_layers: 4,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_hidden: 688,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            ..base
        },
        "smollm2-135m" => ModelConfig {
            arch: Arch::Llama,
            vocab_size: 49152,
            context: 2048,
            max_positions: 8192,
            d_model: 576,
            n_layers: 30,
            n_heads: 9,
            n_kv_heads: 3,
            ffn_hidden: 1536,
            tie_word_embeddings: true,
            norm_eps: 1e-5,
            rope_theta: 100_000.0,
            init_std: 0.041666666666666664,
            ..base
        },
        "tinyllama-1.1b" => ModelConfig {
            arch: Arch::Llama,
            vocab_size: 32000,
            context: 2048,
            d_model: 2048,
            n_layers: 22,
            n_heads: 32,
            n_kv_heads: 4,
            ffn_hidden: 5632,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            ..base
        },
        _ => return None,
    };
    Some(ModelConfig { preset: Some(name.to_owned()), ..config })
}

/// The names of the presets, for error messages.
pub fn names() -> String {
    PRESETS.iter().map(|(name, _)| format!("\"{name}\"")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_sizes() {
        // Hugging Face's counts for the published models (`sum(p.numel() for p in model.parameters())`).
        for (name, expected) in [
            ("gpt-tiny", 3_323_392),
            ("gpt2", 124_439_808),
            ("smollm2-135m", 134_515_008),
            ("tinyllama-1.1b", 1_100_048_384),
        ] {
            let config = preset(name).unwrap();
            config.validate().unwrap();
            assert_eq!(config.param_count(), expected, "{name}");
        }
        let tiny = preset("llama-tiny").unwrap();
        tiny.validate().unwrap();
        assert!(PRESETS.iter().all(|(name, _)| preset(name).is_some()));
        assert!(preset("gpt-5").is_none());
    }
}

//! Real model shapes under tensor parallelism: grouped-query attention with fewer key/value heads than
//! the degree (each key/value head replicated over the ranks whose query heads use it, its gradient
//! summed over them), and a vocabulary the degree does not divide (padded to a multiple of it, the padded
//! logits out of the cross-entropy, the padded rows never gathered nor exported). Each equals the
//! single-process reference within 1e-5 relative (losses, gradients, parameters after 3 AdamW steps).

use tch::Tensor;
use troupe_model::hf::{export, ExportOptions};
use troupe_model::model::{Model, ModelConfig};
use troupe_model::tensor_parallel::{Split, TpError, TpLayout};

use super::peft::{fine_tuned, lora_all_linears};
use super::{assert_equals_reference, assert_equals_reference_as, gpt2, llama, SEED};

/// Llama with 8 query heads over 2 key/value heads: at tp 4 each key/value head is on 2 ranks, at tp 8 on 4.
fn llama_two_kv_heads() -> ModelConfig {
    ModelConfig { n_kv_heads: 2, ..llama() }
}

/// An odd vocabulary (as GPT-2's 50257): 61 tokens, padded to 62 at tp 2 and 64 at tp 4.
fn odd_vocab(cfg: ModelConfig) -> ModelConfig {
    ModelConfig { vocab_size: 61, ..cfg }
}

#[test]
fn key_value_heads_are_replicated_when_the_degree_exceeds_them() {
    let cfg = llama_two_kv_heads();
    for (degree, replicas) in [(4, 2), (8, 4)] {
        let layout = TpLayout::new(&cfg, degree, true).unwrap();
        assert_eq!((layout.kv_pieces(), layout.kv_replicas()), (2, replicas));
        assert_eq!(layout.local_config().n_kv_heads, 1, "tp {degree}: one key/value head per rank");
        let at = layout.specs.iter().position(|s| s.name == "model.layers.0.self_attn.k_proj.weight").unwrap();
        assert_eq!(layout.splits[at], Split::KvHeads);
        assert_eq!(layout.shard_shapes()[at], [cfg.head_dim as i64, cfg.d_model as i64]);
        // Rank r holds key/value head r / replicas: ranks 0..replicas the first, the rest the second.
        let full: Vec<Tensor> = Model::new(cfg.clone(), SEED).params().iter().map(Tensor::detach).collect();
        let head = |h: i64| full[at].narrow(0, h * cfg.head_dim as i64, cfg.head_dim as i64);
        for rank in 0..degree {
            let want = head((rank / replicas) as i64);
            assert!(layout.shard(&full, rank)[at].equal(&want), "tp {degree}: rank {rank}'s key head");
        }
    }
    for (degree, sp) in [(4, false), (4, true), (8, false), (8, true)] {
        assert_equals_reference(&cfg, degree, sp);
    }
}

#[test]
fn lora_on_replicated_key_value_heads_equals_the_reference() {
    let cfg = ModelConfig { head_dim: 0, ..llama_two_kv_heads() };
    let dir = tempfile::tempdir().unwrap();
    let config = fine_tuned(&cfg, lora_all_linears(&cfg), dir.path());
    for sp in [false, true] {
        assert_equals_reference_as(&format!("llama 2 kv heads LoRA tp=4 sp={sp}"), &config, 4, sp);
    }
}

#[test]
fn an_odd_vocabulary_is_padded_and_equals_the_reference() {
    for cfg in [odd_vocab(gpt2()), odd_vocab(llama())] {
        for degree in [2, 4] {
            let layout = TpLayout::new(&cfg, degree, true).unwrap();
            assert_eq!(layout.padded_vocab(), 61usize.next_multiple_of(degree));
            assert_eq!(layout.shard_shapes()[0][0] as usize, layout.padded_vocab() / degree);
            for sp in [false, true] {
                let (want, got) = assert_equals_reference(&cfg, degree, sp);
                for (a, b) in got.params.iter().zip(&want.params) {
                    assert_eq!(a.size(), b.size(), "the gathered parameters have the model's own shapes");
                }
            }
        }
    }
}

#[test]
fn the_padded_rows_are_never_gathered_nor_exported() {
    // Qwen2's config.json has no head_dim: the exported Llama derives it (d_model / n_heads = 4, as set).
    for cfg in [odd_vocab(gpt2()), odd_vocab(ModelConfig { head_dim: 0, ..llama() })] {
        let model = Model::new(cfg.clone(), SEED);
        let layout = TpLayout::new(&cfg, 4, false).unwrap();
        let shards: Vec<Vec<Tensor>> = (0..4).map(|r| layout.shard(model.params(), r)).collect();
        // 61 rows padded to 64: rank 3 holds token 60 and three zero rows.
        let last = &shards[3][0];
        assert_eq!(last.size()[0], 16);
        assert_eq!(last.narrow(0, 13, 3).abs().max().double_value(&[]), 0.0);
        assert!(last.narrow(0, 12, 1).equal(&model.params()[0].detach().narrow(0, 60, 1)));
        let gathered = layout.gather(&shards);
        for ((spec, a), b) in layout.specs.iter().zip(&gathered).zip(model.params()) {
            assert!(a.equal(&b.detach()), "{} tp=4: {} changed in the round trip", cfg.arch.as_str(), spec.name);
        }
        let dir = tempfile::tempdir().unwrap();
        let values: Vec<Vec<f32>> = gathered.iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
        let files = export(&cfg, &values, dir.path(), ExportOptions::default()).unwrap();
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("config.json")).unwrap()).unwrap();
        assert_eq!(config["vocab_size"], 61, "{}", cfg.arch.as_str());
        let weights = files.iter().find(|f| f.ends_with(".safetensors")).unwrap();
        let bytes = std::fs::read(dir.path().join(weights)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let embedding =
            if cfg.arch.as_str() == "gpt2" { "transformer.wte.weight" } else { "model.embed_tokens.weight" };
        let embedding = file.tensor(embedding).or_else(|_| file.tensor(embedding.trim_start_matches("transformer.")));
        assert_eq!(embedding.unwrap().shape(), [61, cfg.d_model], "{}", cfg.arch.as_str());
    }
}

#[test]
fn a_degree_that_splits_no_key_value_head_is_refused_naming_parallel_tp_and_the_heads() {
    let cfg = ModelConfig { n_heads: 12, n_kv_heads: 4, ffn_hidden: 96, ..llama() };
    let msg = match TpLayout::new(&cfg, 6, false) {
        Err(e @ TpError::KvHeads { .. }) => e.to_string(),
        other => panic!("expected the key/value heads' refusal, got {:?}", other.map(|_| ())),
    };
    for part in ["parallel.tp", "degree 6", "model.n_kv_heads (4)", "model.n_heads = 12", "nearest valid degree is 4"] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    assert!(
        TpLayout::new(&cfg, 4, false).is_ok() && TpLayout::new(&ModelConfig { n_kv_heads: 2, ..cfg }, 4, false).is_ok()
    );
}

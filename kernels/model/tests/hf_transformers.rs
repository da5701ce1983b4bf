//! transformers is the external oracle of the model families and of Hugging Face's format: tiny random
//! models made and saved by transformers (tests/hf/oracle.py) load into troupe with the same logits,
//! loss and gradients (1e-5 relative, fp32); troupe's exports load back into transformers with no missing,
//! unexpected or mismatched key and no warning, and give the same loss; import(export(x)) is bit-identical.
//! The Python side runs in the provisioned venv (scripts/provision-libtorch.sh pins transformers).

use std::path::Path;

use tch::{Kind, Tensor};
use troupe_model::config::JobConfig;
use troupe_model::hf::{self, ExportDtype, ExportOptions, HfWeights};
use troupe_model::model::{self, Model, ModelConfig};
use troupe_model::oracle::transformers_oracle;

fn oracle(args: &[&str]) -> serde_json::Value {
    transformers_oracle(args).unwrap_or_else(|e| panic!("{e}"))
}

fn config_of(dir: &Path, context: usize) -> JobConfig {
    let toml = format!("[model]\nfrom_hf = {:?}\ncontext = {context}\n", dir.display().to_string());
    JobConfig::from_toml(&toml, "test.toml").unwrap()
}

/// Tensor `name` of a safetensors file written by oracle.py.
fn saved(path: &Path, name: &str) -> Tensor {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let view = file.tensor(name).unwrap();
    let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
    let kind = match view.dtype() {
        safetensors::Dtype::I64 => Kind::Int64,
        safetensors::Dtype::F32 => Kind::Float,
        other => panic!("{name}: {other:?}"),
    };
    Tensor::from_data_size(view.data(), &shape, kind)
}

fn relative(actual: &Tensor, expected: &Tensor) -> f64 {
    let diff = (actual - expected).norm().double_value(&[]);
    diff / expected.norm().double_value(&[]).max(f64::MIN_POSITIVE)
}

/// Input and target halves of the oracle's tokens.
fn split(tokens: &Tensor) -> (Tensor, Tensor) {
    let time = tokens.size()[1];
    (tokens.narrow(1, 0, time - 1).contiguous(), tokens.narrow(1, 1, time - 1).contiguous())
}

#[test]
fn troupe_computes_what_transformers_computes_on_its_models() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let made = oracle(&["make", dir.path().to_str().unwrap()]);
    let names: Vec<String> = serde_json::from_value(made["models"].clone()).unwrap();
    assert!(names.len() >= 6, "{made}");
    for name in names {
        let model_dir = dir.path().join(&name);
        let config = config_of(&model_dir, 16);
        let model = Model::load(config.model.clone(), 0).unwrap();
        let oracle_file = model_dir.join("oracle.safetensors");
        let (input, targets) = split(&saved(&oracle_file, "tokens"));

        let logits = model.forward(&input);
        let worst = relative(&logits, &saved(&oracle_file, "logits"));
        assert!(worst <= 1e-5, "{name}: logits differ from transformers' by {worst:e} relative");
        let loss = model::cross_entropy(&logits, &targets);
        let expected = saved(&oracle_file, "loss").double_value(&[0]);
        let got = loss.double_value(&[]);
        assert!((got - expected).abs() <= 1e-5 * expected.abs(), "{name}: loss {got} vs transformers' {expected}");

        loss.backward();
        let grads = HfWeights::open(&model_dir.join("grads")).unwrap();
        for (spec, param) in model.specs().iter().zip(model.params()) {
            let expected = model::read_param(&grads, &config.model, spec).unwrap();
            let expected = Tensor::from_slice(&expected).view(spec.shape.as_slice());
            let worst = relative(&param.grad(), &expected);
            assert!(worst <= 1e-5, "{name}: gradient of {} differs by {worst:e} relative", spec.name);
        }
    }
}

/// A model of each family as troupe initialises it, exported, loaded by transformers: same loss, no
/// missing, unexpected or mismatched key, no warning; read back by troupe: the same bits.
#[test]
fn exports_load_in_transformers_and_back_unchanged() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let tokens = Tensor::randint(256, [2, 17], (Kind::Int64, tch::Device::Cpu));
    let tokens_file = dir.path().join("tokens.safetensors");
    Tensor::write_safetensors(&[("tokens", &tokens)], &tokens_file).unwrap();
    let (input, targets) = split(&tokens);

    let mut tied = JobConfig::small_llama(1).model;
    tied.tie_word_embeddings = true;
    let gpt2_tied =
        ModelConfig { tie_word_embeddings: true, activation: model::Activation::GeluNew, ..JobConfig::small(1).model };
    let cases = [
        ("gpt-tiny", JobConfig::small(1).model, ExportDtype::F32, 5 << 30),
        ("gpt2-tied", gpt2_tied, ExportDtype::F32, 5 << 30),
        ("llama", JobConfig::small_llama(1).model, ExportDtype::F32, 5 << 30),
        ("llama-tied-sharded", tied, ExportDtype::F32, 40_000),
        ("llama-bf16", JobConfig::small_llama(1).model, ExportDtype::Bf16, 5 << 30),
    ];
    for (name, config, dtype, max_shard_bytes) in cases {
        config.validate().unwrap();
        let model = Model::new(config.clone(), 7);
        let values: Vec<Vec<f32>> =
            model.params().iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
        let out = dir.path().join(name);
        let written = hf::export(&config, &values, &out, ExportOptions { dtype, max_shard_bytes }).unwrap();
        if max_shard_bytes < 1 << 20 {
            assert!(written.iter().any(|f| f == "model.safetensors.index.json"), "{name}: {written:?}");
        }

        let checked = oracle(&["check", out.to_str().unwrap(), tokens_file.to_str().unwrap()]);
        for key in ["missing", "unexpected", "mismatched", "warnings"] {
            assert_eq!(checked[key], serde_json::json!([]), "{name}: transformers reports {key}: {checked}");
        }
        let theirs = checked["loss"].as_f64().unwrap();
        let back = Model::load(config_of(&out, config.context).model, 0).unwrap();
        let reloaded = model::cross_entropy(&back.forward(&input), &targets).double_value(&[]);
        let ours = model.loss(&input, &targets).double_value(&[]);
        match dtype {
            ExportDtype::F32 => {
                assert!(
                    (theirs - ours).abs() <= 1e-5 * ours.abs(),
                    "{name}: transformers' loss {theirs}, troupe's {ours}"
                );
                for (a, b) in back.params().iter().zip(model.params()) {
                    assert!(a.equal(b), "{name}: import(export(x)) changed a parameter");
                }
            }
            // bf16 weights: transformers and troupe read the same rounded weights.
            ExportDtype::Bf16 => {
                assert_eq!(checked["dtype"], "torch.float32", "{checked}");
                assert!((theirs - reloaded).abs() <= 1e-5 * reloaded.abs(), "{name}: {theirs} vs {reloaded}");
                assert!((reloaded - ours).abs() <= 1e-2 * ours.abs(), "{name}: bf16 rounding moved the loss too far");
            }
        }
    }
}

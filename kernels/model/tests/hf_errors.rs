//! What a bad Hugging Face directory gets (issue 28, "What bad input gets"): a config.json of an
//! unsupported architecture or function, a safetensors file with a missing, extra or misshaped tensor, a
//! truncated shard, an index naming a missing file, a `[model]` key that disagrees with config.json — each
//! is a clear error naming the file, the tensor or the key and what is expected, when the job config is
//! read or before the first step (`Trainer::new`), with nothing written.

use std::path::{Path, PathBuf};

use troupe_model::config::JobConfig;
use troupe_model::hf::{self, ExportOptions};
use troupe_model::model::Model;
use troupe_model::Trainer;

/// A valid exported directory of the small Llama (sharded when `max_shard_bytes` is small).
fn exported(root: &Path, name: &str, max_shard_bytes: u64) -> PathBuf {
    let config = JobConfig::small_llama(1).model;
    let model = Model::new(config.clone(), 5);
    let values: Vec<Vec<f32>> =
        model.params().iter().map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
    let dir = root.join(name);
    hf::export(&config, &values, &dir, ExportOptions { max_shard_bytes, ..ExportOptions::default() }).unwrap();
    dir
}

fn toml_for(dir: &Path, extra: &str) -> String {
    format!("[model]\nfrom_hf = {:?}\ncontext = 16\n{extra}", dir.display().to_string())
}

/// The error of reading the job config, or else of starting the trainer, as text.
fn error(dir: &Path, extra: &str) -> String {
    match JobConfig::from_toml(&toml_for(dir, extra), "job.toml") {
        Err(e) => e.to_string(),
        Ok(config) => Trainer::new(config).expect_err("the trainer refuses it").to_string(),
    }
}

/// Rewrites the JSON file `path` through `edit`.
fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, value.to_string()).unwrap();
}

/// Rewrites model.safetensors of `dir` with `tensors` changed by `edit` (name → (shape, f32 values)).
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> =
        file.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (shape, data))| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// The name of the second shard file of a sharded export.
fn second_shard(dir: &Path) -> String {
    let mut shards: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("model-"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 2, "a sharded export: {shards:?}");
    shards[1].clone()
}

fn check(text: &str, needles: &[&str]) {
    eprintln!("{text}");
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} not in the error: {text}");
    }
}

#[test]
fn bad_hugging_face_directories_are_named_before_anything_runs() {
    let root = tempfile::tempdir().unwrap();

    let ok = exported(root.path(), "ok", 5 << 30);
    Trainer::new(JobConfig::from_toml(&toml_for(&ok, ""), "job.toml").unwrap()).unwrap();

    let arch = exported(root.path(), "arch", 5 << 30);
    edit_json(&arch.join("config.json"), |c| c["architectures"] = serde_json::json!(["MambaForCausalLM"]));
    check(&error(&arch, ""), &["config.json", "MambaForCausalLM", "LlamaForCausalLM"]);

    let function = exported(root.path(), "function", 5 << 30);
    edit_json(&function.join("config.json"), |c| c["hidden_act"] = serde_json::json!("gelu"));
    check(&error(&function, ""), &["config.json", "hidden_act", "silu"]);

    let scaling = exported(root.path(), "scaling", 5 << 30);
    edit_json(&scaling.join("config.json"), |c| {
        c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
    });
    check(&error(&scaling, ""), &["rope_scaling", "yarn", "llama3"]);

    check(&error(&ok, "n_layers = 3\n"), &["n_layers", "num_hidden_layers", "config.json", "= 1"]);

    let missing = exported(root.path(), "missing", 5 << 30);
    edit_weights(&missing, |t| {
        t.remove("model.layers.0.mlp.up_proj.weight");
    });
    check(&error(&missing, ""), &["model.layers.0.mlp.up_proj.weight", "missing"]);

    let extra = exported(root.path(), "extra", 5 << 30);
    edit_weights(&extra, |t| {
        t.insert("model.layers.7.mlp.up_proj.weight".into(), (vec![2], vec![0; 8]));
    });
    check(&error(&extra, ""), &["model.layers.7.mlp.up_proj.weight", "not a parameter"]);

    let misshaped = exported(root.path(), "misshaped", 5 << 30);
    edit_weights(&misshaped, |t| {
        let (shape, data) = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
        shape.reverse();
        let _ = data;
    });
    check(
        &error(&misshaped, ""),
        &["model.safetensors", "model.layers.0.self_attn.k_proj.weight", "expected [32, 64]"],
    );

    let truncated = exported(root.path(), "truncated", 40_000);
    let shard = second_shard(&truncated);
    let len = std::fs::metadata(truncated.join(&shard)).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(truncated.join(&shard)).unwrap().set_len(len - 100).unwrap();
    check(&error(&truncated, ""), &[&shard, "truncated"]);

    let unindexed = exported(root.path(), "unindexed", 40_000);
    let shard = second_shard(&unindexed);
    std::fs::remove_file(unindexed.join(&shard)).unwrap();
    check(&error(&unindexed, ""), &["model.safetensors.index.json", &shard]);

    let empty = root.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(ok.join("config.json"), empty.join("config.json")).unwrap();
    check(&error(&empty, ""), &["no model.safetensors"]);
    check(&error(&root.path().join("nowhere"), ""), &["model.from_hf", "nowhere", "config.json"]);

    // Nothing was written into any of them.
    for dir in [&arch, &missing, &truncated] {
        let names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(names.iter().all(|n| n.ends_with(".json") || n.ends_with(".safetensors")), "{names:?}");
    }
}

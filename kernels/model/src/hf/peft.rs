//! Hugging Face PEFT's adapter format, in and out: a directory with `adapter_config.json` and
//! `adapter_model.safetensors` that `peft.PeftModel.from_pretrained(base, DIR)` loads (pinned: peft
//! 0.21.2, scripts/provision-libtorch.sh), and the merged model `W + s·B·A` as a full Hugging Face
//! directory.
//!
//! Names: PEFT's keys are the base model's module names under `base_model.model.` — Llama's
//! `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, GPT-2's
//! `base_model.model.transformer.h.0.attn.c_attn.lora_A.weight` — with the adapter name (`default`)
//! left out, and the modules that train in full (`modules_to_save`, troupe's `peft.train`) under their
//! own names (`base_model.model.lm_head.weight`). `A` is `[r, in]` and `B` `[out, r]` in both, for
//! GPT-2's `Conv1D` targets too (PEFT's `fan_in_fan_out = true` transposes the base weight, not the
//! adapters); a `Conv1D` weight trained in full is stored `[in, out]` as the base file stores it.
//!
//! Reading (`[peft] from_adapters = "DIR"`): the `[peft]` table stays the job's description and the
//! adapters must agree with it — `r`, `lora_alpha`, `use_rslora`, `target_modules` and
//! `modules_to_save` are compared, and a difference names both values and the key to set — so a
//! config never means something other than what it says. `lora_dropout` is the job's to choose and is
//! not compared. Every trainable tensor must be in the file with its shape, and nothing else may be.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};

use super::{file_layout, HfError, HfWeights};
use crate::hf_weights::transpose;
use crate::model::peft::{module_of, Method, PeftConfig};
use crate::model::{base_specs, file_name, param_specs, read_param, Arch, ModelConfig, ParamSpec};

pub const ADAPTER_CONFIG: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter types PEFT has that troupe reads.
pub const SUPPORTED_TYPES: &str = "LORA";

fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// PEFT's key of trainable parameter `spec` of `config`'s LoRA model, and whether the file stores it
/// transposed (a GPT-2 `Conv1D` weight trained in full).
pub fn peft_key(config: &ModelConfig, spec: &ParamSpec) -> (String, bool) {
    if is_adapter(&spec.name) {
        let name = match config.arch {
            Arch::Llama => spec.name.clone(),
            Arch::Gpt2 => format!("transformer.{}", spec.name),
        };
        return (format!("base_model.model.{name}"), false);
    }
    let (name, transposed) = file_name(config, spec);
    (format!("base_model.model.{name}"), transposed)
}

fn lora_of(config: &ModelConfig) -> Result<&crate::model::PeftConfig, String> {
    match &config.peft {
        Some(p) if p.method == Method::Lora => Ok(p),
        Some(_) => Err("is a freeze fine-tuning ([peft] method = \"freeze\"): it has no adapters; export the \
                        model with `troupe checkpoint export CKPT --out DIR`"
            .into()),
        None => Err("has no [peft] table: it trains no adapters; export the model with \
                     `troupe checkpoint export CKPT --out DIR`"
            .into()),
    }
}

/// `adapter_config.json` of `config`'s LoRA model, as PEFT writes it.
pub fn adapter_config(config: &ModelConfig) -> Value {
    let peft = config.peft.as_ref().expect("a LoRA model");
    let base = config.from_hf.as_ref().map(|d| d.display().to_string());
    let train = (!peft.train.is_empty()).then(|| peft.train.clone());
    json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": peft.r,
        "lora_alpha": peft.alpha,
        "use_rslora": peft.rslora,
        "lora_dropout": peft.dropout,
        "target_modules": peft.targets(config.arch),
        "modules_to_save": train,
        "fan_in_fan_out": config.arch == Arch::Gpt2,
        "bias": "none",
        "lora_bias": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": null,
        "layers_pattern": null,
        "exclude_modules": null,
        "revision": null,
    })
}

/// Writes the trainable parameters `values` ([`param_specs`] order, fp32, troupe's layout) of `config`'s
/// LoRA model into `out` as a PEFT adapter directory. Returns the files written.
pub fn export_adapters(config: &ModelConfig, values: &[Vec<f32>], out: &Path) -> Result<Vec<String>, HfError> {
    lora_of(config).map_err(|why| HfError::Format { path: out.to_owned(), message: format!("the model {why}") })?;
    let specs = param_specs(config);
    assert_eq!(values.len(), specs.len(), "one value vector per trainable parameter");
    std::fs::create_dir_all(out).map_err(|source| HfError::Io { path: out.to_owned(), source })?;
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for (spec, values) in specs.iter().zip(values) {
        let (key, transposed) = peft_key(config, spec);
        let (shape, laid_out) = file_layout(spec, values, transposed);
        tensors.insert(key, (shape, laid_out.iter().flat_map(|v| v.to_le_bytes()).collect()));
    }
    let views = tensors.iter().map(|(name, (shape, bytes))| {
        (name.as_str(), TensorView::new(Dtype::F32, shape.clone(), bytes).expect("shape matches the bytes"))
    });
    let path = out.join(ADAPTER_WEIGHTS);
    let metadata = Some([("format".to_owned(), "pt".to_owned())].into_iter().collect());
    safetensors::serialize_to_file(views, metadata, &path)
        .map_err(|e| HfError::Format { path: path.clone(), message: format!("cannot write: {e}") })?;
    let config_path = out.join(ADAPTER_CONFIG);
    let text = serde_json::to_string_pretty(&adapter_config(config)).expect("JSON values serialise");
    std::fs::write(&config_path, text + "\n").map_err(|source| HfError::Io { path: config_path, source })?;
    Ok(vec![ADAPTER_CONFIG.to_owned(), ADAPTER_WEIGHTS.to_owned()])
}

/// A PEFT adapter directory checked against a LoRA model: its trainable parameters by troupe name.
#[derive(Debug)]
pub struct Adapters {
    pub dir: PathBuf,
    values: HashMap<String, Vec<f32>>,
}

impl Adapters {
    /// Reads and checks `dir` against `config` (a LoRA model): the type is LORA with no feature troupe
    /// does not compute (DoRA, per-module ranks, biases), the hyperparameters agree with `[peft]`, every
    /// trainable parameter is present with its shape, and nothing else is.
    pub fn open(config: &ModelConfig, dir: &Path) -> Result<Self, HfError> {
        read_adapter_config(config, dir)?;
        let weights_path = dir.join(ADAPTER_WEIGHTS);
        let bytes =
            std::fs::read(&weights_path).map_err(|source| HfError::Io { path: weights_path.clone(), source })?;
        let file = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| format_error(&weights_path, format!("not a safetensors file: {e}")))?;
        let mut values = HashMap::new();
        let mut used = std::collections::HashSet::new();
        for spec in param_specs(config) {
            let (key, v) = read_adapter(config, (dir, &weights_path), &file, &spec)?;
            used.insert(key);
            values.insert(spec.name.clone(), v);
        }
        let mut names: Vec<String> = file.names().into_iter().map(str::to_owned).collect();
        names.sort();
        if let Some(extra) = names.into_iter().find(|n| !used.contains(n)) {
            return Err(HfError::Format {
                path: weights_path,
                message: format!(
                    "tensor {extra} is not an adapter of this {} model's [peft] (targets {:?}, train {:?}): \
                     the adapters were made for another model or other targets; set peft.targets and peft.train to \
                     what {ADAPTER_CONFIG} says, or use the adapters of this model",
                    config.arch.as_str(),
                    config.peft.as_ref().map(|p| p.targets(config.arch)).unwrap_or_default(),
                    config.peft.as_ref().map(|p| p.train.clone()).unwrap_or_default(),
                ),
            });
        }
        Ok(Self { dir: dir.to_owned(), values })
    }

    /// Trainable parameter `spec`'s values (troupe's layout), if the adapters hold it.
    pub fn get(&self, spec: &ParamSpec) -> Option<&Vec<f32>> {
        self.values.get(&spec.name)
    }
}

fn format_error(path: &Path, message: String) -> HfError {
    HfError::Format { path: path.to_owned(), message }
}

/// Reads `dir`'s `adapter_config.json` and checks it against `[peft]` (see [`check_config`]).
fn read_adapter_config(config: &ModelConfig, dir: &Path) -> Result<(), HfError> {
    let config_path = dir.join(ADAPTER_CONFIG);
    if !config_path.is_file() {
        return Err(format_error(
            &config_path,
            format!(
                "not found: a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} \
                 (`PeftModel.save_pretrained` and `troupe checkpoint export CKPT --out DIR --adapters` write them); \
                 check peft.from_adapters"
            ),
        ));
    }
    let text =
        std::fs::read_to_string(&config_path).map_err(|source| HfError::Io { path: config_path.clone(), source })?;
    let adapter: Value =
        serde_json::from_str(&text).map_err(|e| format_error(&config_path, format!("not JSON: {e}")))?;
    check_config(config, &config_path, &adapter)
}

/// Trainable parameter `spec` from the adapters' `file` (at `weights_path` in `dir`): its PEFT key and its
/// values in troupe's layout (fp32, transposed where PEFT's is).
fn read_adapter(
    config: &ModelConfig,
    (dir, weights_path): (&Path, &Path),
    file: &safetensors::SafeTensors,
    spec: &ParamSpec,
) -> Result<(String, Vec<f32>), HfError> {
    let (key, transposed) = peft_key(config, spec);
    let view = file.tensor(&key).map_err(|_| HfError::MissingTensor {
        dir: dir.to_owned(),
        tensor: format!("{ADAPTER_WEIGHTS}: {key}"),
        shape: spec.shape.clone(),
    })?;
    let mut expected: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
    if transposed {
        expected.reverse();
    }
    if view.shape() != expected.as_slice() {
        return Err(HfError::Shape {
            path: weights_path.to_owned(),
            tensor: key,
            found: view.shape().to_vec(),
            expected,
        });
    }
    let data = view.data();
    let v: Vec<f32> = match view.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        other => {
            return Err(HfError::Dtype { path: weights_path.to_owned(), tensor: key, dtype: format!("{other:?}") })
        }
    };
    let v = if transposed { transpose(&v, expected[0], expected[1]) } else { v };
    Ok((key, v))
}

/// `adapter_config.json` against `[peft]`.
fn check_config(config: &ModelConfig, path: &Path, adapter: &Value) -> Result<(), HfError> {
    let peft = config.peft.as_ref().expect("from_adapters is a [peft] key");
    check_supported(path, adapter)?;
    check_hyperparameters(peft, path, adapter)?;
    check_modules(config, peft, path, adapter)
}

fn unsupported(path: &Path, key: &str, value: &Value, why: &str) -> HfError {
    HfError::Unsupported { path: path.to_owned(), key: key.to_owned(), value: value.to_string(), why: why.to_owned() }
}

/// A `[peft]` key whose `toml` value disagrees with the adapters' `json` one at `json_key`.
fn disagree(path: &Path, key: &str, toml: String, json_key: &str, json: String) -> HfError {
    HfError::Format {
        path: path.to_owned(),
        message: format!(
            "{json_key} = {json} disagrees with [peft] {key} = {toml} (peft.from_adapters): set peft.{key} to the \
             adapters' value (the [peft] table describes the adapters it starts from)"
        ),
    }
}

/// The adapters are LoRA's, with none of the features troupe does not compute.
fn check_supported(path: &Path, adapter: &Value) -> Result<(), HfError> {
    let peft_type = adapter.get("peft_type").cloned().unwrap_or(Value::Null);
    if peft_type.as_str() != Some("LORA") {
        return Err(unsupported(
            path,
            "peft_type",
            &peft_type,
            &format!("troupe reads PEFT adapters of type {SUPPORTED_TYPES} (LoRA); train LoRA adapters or start without peft.from_adapters"),
        ));
    }
    let empty = |v: Option<&Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(Value::Object(m)) => m.is_empty(),
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::String(s)) => s.is_empty() || s == "none",
        _ => false,
    };
    for (key, why) in [
        ("use_dora", "DoRA is not computed by troupe; use plain LoRA adapters"),
        ("rank_pattern", "per-module ranks are not supported: every target has rank r"),
        ("alpha_pattern", "per-module alphas are not supported: every target has lora_alpha"),
        ("bias", "troupe's LoRA trains no biases (PEFT's bias = \"none\")"),
        ("lora_bias", "troupe's LoRA has no bias on B"),
        ("layers_to_transform", "troupe's LoRA adapts every block's targets"),
        ("exclude_modules", "troupe's LoRA adapts every block's targets"),
        ("trainable_token_indices", "trainable tokens are not supported"),
        ("target_parameters", "troupe adapts modules (target_modules), not parameters"),
    ] {
        if !empty(adapter.get(key)) {
            return Err(unsupported(path, key, &adapter[key], why));
        }
    }
    Ok(())
}

/// The adapters' rank, alpha and rsLoRA switch are `[peft]`'s.
fn check_hyperparameters(peft: &PeftConfig, path: &Path, adapter: &Value) -> Result<(), HfError> {
    let shown = |key: &str| adapter.get(key).map_or("(absent)".to_owned(), Value::to_string);
    if adapter.get("r").and_then(Value::as_u64) != Some(peft.r as u64) {
        return Err(disagree(path, "r", peft.r.to_string(), "r", shown("r")));
    }
    if adapter.get("lora_alpha").and_then(Value::as_f64) != Some(peft.alpha) {
        return Err(disagree(path, "alpha", peft.alpha.to_string(), "lora_alpha", shown("lora_alpha")));
    }
    let rslora = adapter.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    if rslora != peft.rslora {
        return Err(disagree(path, "rslora", peft.rslora.to_string(), "use_rslora", rslora.to_string()));
    }
    Ok(())
}

/// The adapters' target and saved modules are `[peft]`'s targets and trained modules (as sets).
fn check_modules(config: &ModelConfig, peft: &PeftConfig, path: &Path, adapter: &Value) -> Result<(), HfError> {
    let list = |key: &str| -> Result<Vec<String>, HfError> {
        match adapter.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| unsupported(path, key, &adapter[key], "must be a list of module names")),
            Some(other) => Err(unsupported(
                path,
                key,
                other,
                "troupe reads target and saved modules as a list of module names (not a regular expression); \
                 list them",
            )),
        }
    };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v.dedup();
        v
    };
    let targets = sorted(list("target_modules")?);
    if targets != sorted(peft.targets(config.arch)) {
        return Err(disagree(
            path,
            "targets",
            format!("{:?}", peft.targets(config.arch)),
            "target_modules",
            format!("{targets:?}"),
        ));
    }
    let saved = sorted(list("modules_to_save")?);
    if saved != sorted(peft.train.clone()) {
        return Err(disagree(path, "train", format!("{:?}", peft.train), "modules_to_save", format!("{saved:?}")));
    }
    Ok(())
}

/// Checks `config.peft.from_adapters`, if set, before anything trains (see [`Adapters::open`]).
pub fn check_adapters(config: &ModelConfig) -> Result<(), HfError> {
    match config.peft.as_ref().and_then(|p| p.from_adapters.as_deref()) {
        Some(dir) => Adapters::open(config, dir).map(|_| ()),
        None => Ok(()),
    }
}

/// The merged model of `config`'s LoRA model: every [`base_specs`] parameter, `W + s·B·A` where `W` has
/// adapters, the trained value where it trains in full, the base's (`model.from_hf`) otherwise. `trained`
/// holds the trainable parameters in [`param_specs`] order.
pub fn merge(config: &ModelConfig, trained: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, HfError> {
    let specs = param_specs(config);
    assert_eq!(trained.len(), specs.len(), "one value vector per trainable parameter");
    let dir = config.from_hf.as_deref().expect("a [peft] model has model.from_hf");
    let weights = HfWeights::open(dir)?;
    let scale = config.peft.as_ref().map_or(1.0, |p| p.scale());
    let by_name: HashMap<&str, &Vec<f32>> = specs.iter().map(|s| s.name.as_str()).zip(trained).collect();
    base_specs(config)
        .iter()
        .map(|spec| {
            if let Some(v) = by_name.get(spec.name.as_str()) {
                return Ok((*v).clone());
            }
            let w = read_param(&weights, config, spec)?;
            let module = module_of(&spec.name);
            if !spec.name.ends_with(".weight") || spec.shape.len() != 2 {
                return Ok(w); // a targeted layer's bias has no adapter
            }
            let (Some(a), Some(b)) = (
                by_name.get(format!("{module}.lora_A.weight").as_str()),
                by_name.get(format!("{module}.lora_B.weight").as_str()),
            ) else {
                return Ok(w);
            };
            let (out, inp) = (spec.shape[0], spec.shape[1]);
            let r = a.len() as i64 / inp;
            let a = tch::Tensor::from_slice(a).view([r, inp]).to_kind(tch::Kind::Double);
            let b = tch::Tensor::from_slice(b).view([out, r]).to_kind(tch::Kind::Double);
            let w = tch::Tensor::from_slice(&w).view([out, inp]).to_kind(tch::Kind::Double);
            let merged = (w + b.matmul(&a) * scale).to_kind(tch::Kind::Float).flatten(0, -1);
            Ok(Vec::<f32>::try_from(merged).expect("fp32 values"))
        })
        .collect()
}

/// Writes the merged model (see [`merge`]) of `config`'s `[peft]` model (LoRA or freeze) into `out` as a full Hugging Face
/// directory (`config.json` without `[peft]`, the weights). Returns the files written.
pub fn export_merged(
    config: &ModelConfig,
    trained: &[Vec<f32>],
    out: &Path,
    options: super::ExportOptions,
) -> Result<Vec<String>, HfError> {
    if config.peft.is_none() {
        return Err(HfError::Format {
            path: out.to_owned(),
            message: "the model has no [peft] table: there is nothing to merge; export it with \
                      `troupe checkpoint export CKPT --out DIR`"
                .into(),
        });
    }
    let merged = merge(config, trained)?;
    let plain = ModelConfig { peft: None, from_hf: None, ..config.clone() };
    super::export(&plain, &merged, out, options)
}

/// The checksum of a base model directory's weights: XXH3-64 (`troupe_kernels::Checksum64Stream`) of
/// its safetensors files' bytes in name order — `model.safetensors`, or every shard the index names —
/// each file's name hashed before its bytes. What a `[peft]` checkpoint records of the base it trains on
/// (`checkpoint::Manifest::base`). Computed once per process per directory and file set (keyed by each
/// file's size and modification time), so a job that saves every step reads its base once.
pub fn base_checksum(dir: &Path) -> Result<u64, HfError> {
    type Key = (PathBuf, Vec<(String, u64, Option<std::time::SystemTime>)>);
    static CACHE: std::sync::OnceLock<std::sync::Mutex<HashMap<Key, u64>>> = std::sync::OnceLock::new();
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| HfError::Io { path, source }
    };
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|name| name.ends_with(".safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(HfError::NoWeights { dir: dir.to_owned() });
    }
    let mut key: Key = (dir.to_owned(), Vec::new());
    for name in &files {
        let meta = std::fs::metadata(dir.join(name)).map_err(io(&dir.join(name)))?;
        key.1.push((name.clone(), meta.len(), meta.modified().ok()));
    }
    let cache = CACHE.get_or_init(Default::default);
    if let Some(sum) = cache.lock().expect("base checksums").get(&key) {
        return Ok(*sum);
    }
    let mut sum = troupe_kernels::Checksum64Stream::new();
    let mut buffer = vec![0u8; 8 << 20];
    for name in &files {
        let path = dir.join(name);
        sum.update(name.as_bytes());
        let mut file = std::fs::File::open(&path).map_err(io(&path))?;
        loop {
            let n = std::io::Read::read(&mut file, &mut buffer).map_err(io(&path))?;
            if n == 0 {
                break;
            }
            sum.update(&buffer[..n]);
        }
    }
    let sum = sum.finish();
    cache.lock().expect("base checksums").insert(key, sum);
    Ok(sum)
}

/// The `[peft]` table that describes the adapters of `dir` (`adapter_config.json`): LoRA with their `r`,
/// `lora_alpha`, `use_rslora`, `lora_dropout`, `target_modules` and `modules_to_save`, starting from them
/// (`from_adapters`). What `troupe generate` and `troupe eval` build with `--adapters DIR` on a base model
/// `model`; the adapters are then checked against it ([`Adapters::open`]) as a training job's are.
pub fn peft_config_of(model: &ModelConfig, dir: &Path) -> Result<crate::model::PeftConfig, HfError> {
    let path = dir.join(ADAPTER_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|source| HfError::Io { path: path.clone(), source })?;
    let adapter: Value = serde_json::from_str(&text)
        .map_err(|e| HfError::Format { path: path.clone(), message: format!("not JSON: {e}") })?;
    let strings = |key: &str| -> Vec<String> {
        adapter
            .get(key)
            .and_then(Value::as_array)
            .map_or_else(Vec::new, |items| items.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
    };
    let peft = crate::model::PeftConfig {
        method: Method::Lora,
        r: adapter.get("r").and_then(Value::as_u64).unwrap_or(0) as usize,
        alpha: adapter.get("lora_alpha").and_then(Value::as_f64).unwrap_or(0.0),
        rslora: adapter.get("use_rslora").and_then(Value::as_bool).unwrap_or(false),
        dropout: 0.0,
        targets: strings("target_modules"),
        train: strings("modules_to_save"),
        last_blocks: 0,
        from_adapters: Some(dir.to_owned()),
    };
    let with = ModelConfig { peft: Some(peft.clone()), ..model.clone() };
    check_config(&with, &path, &adapter)?;
    with.validate()
        .map_err(|e| HfError::Format { path: path.clone(), message: format!("does not fit the base model: {e}") })?;
    Ok(peft)
}

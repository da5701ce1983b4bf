//! Parameter-efficient fine-tuning: which of a model's parameters train, and the low-rank adapters
//! (LoRA, Hu et al. 2021) added beside its linear layers — `[peft]` in the job config.
//!
//! The seam is the parameter list. Without `[peft]` the list [`super::param_specs`] gives is the family's
//! whole list ([`super::base_specs`]). With it, the list is what *trains*: for LoRA the adapters `A`
//! (`[r, in]`) and `B` (`[out, r]`) of every targeted linear, and any module named in `train`; for
//! `method = "freeze"` the modules named in `train` or the last `last_blocks` blocks and the head. Every
//! engine (DDP, ZeRO-1/2/3, pipelines, checkpoints, buddy copies) works on that list as before, so the
//! frozen base has no gradient, no optimizer state, is never all-reduced and is not in a checkpoint's flat
//! state. The frozen parameters are read from `model.from_hf` when a part of the model runs
//! ([`Base`]: one read-only copy per directory and device in the process, loaded by tensor on first
//! use), so a pipeline stage reads only its blocks.
//!
//! The list keeps the model's parts: embed, then each block, then the head. Within a part, the
//! trainable slots follow the family's parameter order; a targeted weight's adapters `A`, `B` follow
//! the weight's own slot (or its place, when the weight is frozen). `A` starts Kaiming-uniform
//! (PEFT's default: a bound of 1/√in), `B` zero, both drawn by troupe's seeded RNG.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{Arch, Init, ModelConfig, ParamSpec};
use crate::sections::{invalid, ConfigError};

/// How the model is fine-tuned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Low-rank adapters beside the targeted linear layers; the base is frozen.
    #[default]
    Lora,
    /// No adapters: only the modules in `train` (or the last `last_blocks` blocks and the head) train.
    Freeze,
}

/// `[peft]`: parameter-efficient fine-tuning of a `model.from_hf` model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PeftConfig {
    pub method: Method,
    /// LoRA's rank.
    pub r: usize,
    /// LoRA's scale numerator: the update is `alpha / r · B·A` (or `alpha / √r` with `rslora`).
    pub alpha: f64,
    /// Rank-stabilised LoRA's scale, `alpha / √r`.
    pub rslora: bool,
    /// Dropout on the adapters' input (PEFT's `lora_dropout`), in training forwards only; each
    /// element's mask is a function of (seed, step, sample, layer, target, position) — see
    /// [`dropout_mask`].
    pub dropout: f64,
    /// The linear layers that get adapters, as Hugging Face module names matched on their last
    /// components (`q_proj`, `self_attn.o_proj`, `c_attn`, `mlp.c_proj`); empty: the family's default
    /// (PEFT's: `q_proj`, `v_proj` for Llama, `c_attn` for GPT-2).
    pub targets: Vec<String>,
    /// Modules that train in full (PEFT's `modules_to_save` for LoRA; the trained modules for freeze),
    /// matched on consecutive components of their names: `lm_head`, `mlp`, `layers.11`, `model.norm`.
    pub train: Vec<String>,
    /// Freeze: train the last N blocks, the final norm and the head.
    pub last_blocks: usize,
    /// Start from these Hugging Face PEFT adapters (a directory with `adapter_config.json` and
    /// `adapter_model.safetensors`) instead of fresh ones.
    pub from_adapters: Option<PathBuf>,
}

impl Default for PeftConfig {
    fn default() -> Self {
        Self {
            method: Method::Lora,
            r: 8,
            alpha: 8.0,
            rslora: false,
            dropout: 0.0,
            targets: Vec::new(),
            train: Vec::new(),
            last_blocks: 0,
            from_adapters: None,
        }
    }
}

/// What a family's linear layers are called, for errors and defaults.
fn default_targets(arch: Arch) -> &'static [&'static str] {
    match arch {
        Arch::Llama => &["q_proj", "v_proj"],
        Arch::Gpt2 => &["c_attn"],
    }
}

impl PeftConfig {
    /// LoRA's scale on `B·A`.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// The target names in force (the family's default when none is given).
    pub fn targets(&self, arch: Arch) -> Vec<String> {
        if self.targets.is_empty() {
            default_targets(arch).iter().map(|s| s.to_string()).collect()
        } else {
            self.targets.clone()
        }
    }

    /// Checks `[peft]` against the model it fine-tunes: every target and trained module exists, the
    /// rank fits every targeted layer, and something trains.
    pub fn validate(&self, model: &ModelConfig) -> Result<(), ConfigError> {
        if model.from_hf.is_none() {
            return Err(invalid(
                "model.from_hf",
                "(not set)",
                "[peft] fine-tunes a pretrained model: set model.from_hf to a Hugging Face model directory \
                 (`troupe checkpoint export CKPT --out DIR` writes one from a troupe checkpoint)",
            ));
        }
        let base = super::base_specs(model);
        let linears = block_linears(model, &base);
        for name in &self.train {
            if !base.iter().any(|s| module_contains(module_of(&s.name), name)) {
                return Err(invalid(
                    "peft.train",
                    format!("{name:?}"),
                    format!(
                        "names no module of this {} model; its modules include {}",
                        model.arch.as_str(),
                        module_examples(&base)
                    ),
                ));
            }
        }
        match self.method {
            Method::Freeze => self.validate_freeze(model)?,
            Method::Lora => self.validate_lora(model, &linears)?,
        }
        if let Some(dir) = &self.from_adapters {
            if self.method != Method::Lora {
                return Err(invalid(
                    "peft.from_adapters",
                    dir.display(),
                    "holds LoRA adapters: set peft.method = \"lora\"",
                ));
            }
        }
        Ok(())
    }

    /// Freeze's keys: the last blocks exist, something trains, no LoRA targets.
    fn validate_freeze(&self, model: &ModelConfig) -> Result<(), ConfigError> {
        if self.last_blocks > model.n_layers {
            return Err(invalid(
                "peft.last_blocks",
                self.last_blocks,
                format!("must be at most model.n_layers ({})", model.n_layers),
            ));
        }
        if self.train.is_empty() && self.last_blocks == 0 {
            return Err(invalid(
                "peft.method",
                "\"freeze\"",
                "trains nothing: set peft.last_blocks (e.g. 1: the last block and the head) or peft.train \
                         (module names, e.g. [\"lm_head\"])",
            ));
        }
        if !self.targets.is_empty() {
            return Err(invalid(
                "peft.targets",
                format!("{:?}", self.targets),
                "are LoRA's: remove them or set peft.method = \"lora\"",
            ));
        }
        Ok(())
    }

    /// LoRA's keys: rank, alpha and dropout in range, no freeze keys, and every target one of the blocks'
    /// `linears` that the rank fits.
    fn validate_lora(&self, model: &ModelConfig, linears: &[&ParamSpec]) -> Result<(), ConfigError> {
        if self.r == 0 {
            return Err(invalid("peft.r", 0, "LoRA's rank must be at least 1 (8 and 16 are common)"));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(invalid("peft.alpha", self.alpha, "must be a finite number > 0 (e.g. 16)"));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid("peft.dropout", self.dropout, "must be in [0, 1) (0.05 and 0.1 are common)"));
        }
        if self.last_blocks != 0 {
            return Err(invalid(
                "peft.last_blocks",
                self.last_blocks,
                "is freeze's: remove it or set peft.method = \"freeze\"",
            ));
        }
        self.validate_lora_targets(model, linears)
    }

    /// Every LoRA target names a linear layer of the blocks (`linears`), and the rank fits each it names.
    fn validate_lora_targets(&self, model: &ModelConfig, linears: &[&ParamSpec]) -> Result<(), ConfigError> {
        let available = || {
            let mut names: Vec<&str> = linears.iter().map(|s| last_component(module_of(&s.name))).collect();
            names.dedup();
            let mut seen = std::collections::BTreeSet::new();
            names.retain(|n| seen.insert(*n));
            names.join(", ")
        };
        for target in self.targets(model.arch) {
            let hits: Vec<&ParamSpec> =
                linears.iter().copied().filter(|s| module_ends_with(module_of(&s.name), &target)).collect();
            if hits.is_empty() {
                return Err(invalid(
                    "peft.targets",
                    format!("{target:?}"),
                    format!(
                        "is not a linear layer of this {} model's blocks; LoRA targets one of: {}",
                        model.arch.as_str(),
                        available()
                    ),
                ));
            }
            for spec in hits {
                let (out, inp) = (spec.shape[0] as usize, spec.shape[1] as usize);
                if self.r > out.min(inp) {
                    return Err(invalid(
                        "peft.r",
                        self.r,
                        format!(
                            "exceeds the smaller side of {} ({out} × {inp}): a rank must be at most {}",
                            module_of(&spec.name),
                            out.min(inp)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A parameter's module: its name without the last component (`weight`, `bias`).
pub fn module_of(name: &str) -> &str {
    name.rsplit_once('.').map_or(name, |(module, _)| module)
}

fn last_component(module: &str) -> &str {
    module.rsplit_once('.').map_or(module, |(_, last)| last)
}

/// Whether `module`'s last components are `target`'s (`q_proj` matches `model.layers.0.self_attn.q_proj`).
fn module_ends_with(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

/// Whether `pattern`'s components occur consecutively in `module`'s (`mlp` is in
/// `model.layers.0.mlp.up_proj`, `layers.1` in `model.layers.1.mlp`, `norm` is not in `ln_f`).
fn module_contains(module: &str, pattern: &str) -> bool {
    let (m, p): (Vec<&str>, Vec<&str>) = (module.split('.').collect(), pattern.split('.').collect());
    !p.is_empty() && m.windows(p.len()).any(|w| w == p.as_slice())
}

fn module_examples(base: &[ParamSpec]) -> String {
    let mut seen = std::collections::BTreeSet::new();
    let names: Vec<&str> =
        base.iter().map(|s| module_of(&s.name)).filter(|m| !m.contains(".1.") && seen.insert(*m)).collect();
    names.join(", ")
}

/// The blocks' linear weights (2-D parameters of the blocks).
fn block_linears<'a>(model: &ModelConfig, base: &'a [ParamSpec]) -> Vec<&'a ParamSpec> {
    let blocks = model.base_block_range(0).start..model.base_block_range(model.n_layers - 1).end;
    base[blocks].iter().filter(|s| s.shape.len() == 2).collect()
}

/// One family parameter's place in the trainable list of its part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    /// Its own slot when it trains; None when it is frozen (read from the base).
    pub trained: Option<usize>,
    /// The slot of its LoRA `A` (`B` is the next), when it is targeted.
    pub adapter: Option<usize>,
}

/// A part of the model (embed, one block, the head) as the trainable list sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct PartLayout {
    /// The family's parameters of the part, positions in [`super::base_specs`] (the head's include the
    /// tied embedding, position 0, last).
    pub base: Vec<usize>,
    /// Per family parameter, where it is in the part's trainable slice.
    pub slots: Vec<Slot>,
    /// The part's trainable specs in slot order.
    pub specs: Vec<ParamSpec>,
}

/// The model's parts, in list order: embed, the blocks, the head.
pub fn parts(model: &ModelConfig) -> Vec<PartLayout> {
    let base = super::base_specs(model);
    (0..model.n_layers + 2).map(|part| layout_of(model, &base, part)).collect()
}

/// Part `part` of the model (0 the embeddings, 1 + i block i, 1 + n_layers the head).
pub fn part(model: &ModelConfig, part: usize) -> PartLayout {
    layout_of(model, &super::base_specs(model), part)
}

fn layout_of(model: &ModelConfig, base: &[ParamSpec], part: usize) -> PartLayout {
    let last = model.n_layers + 1;
    let mut indices: Vec<usize> = match part {
        0 => model.base_embed_range().collect(),
        p if p == last => model.base_head_range().collect(),
        p => model.base_block_range(p - 1).collect(),
    };
    // The tied embedding sits last in the head's family list but belongs to the embed part.
    let tied_at = (model.tie_word_embeddings && part == last).then(|| {
        indices.push(0);
        indices.len() - 1
    });
    layout_part(model, base, part, last, indices, tied_at)
}

/// Whether the token embedding trains (always, without `[peft]`).
pub fn trains_embedding(model: &ModelConfig) -> bool {
    let base = super::base_specs(model);
    trains(model, 0, model.n_layers + 1, module_of(&base[0].name), true)
}

fn layout_part(
    model: &ModelConfig,
    base: &[ParamSpec],
    part: usize,
    last: usize,
    indices: Vec<usize>,
    tied_at: Option<usize>,
) -> PartLayout {
    let peft = model.peft.as_ref();
    let targets = peft.filter(|p| p.method == Method::Lora).map(|p| p.targets(model.arch)).unwrap_or_default();
    let mut slots = Vec::with_capacity(indices.len());
    let mut specs = Vec::new();
    for (at, &index) in indices.iter().enumerate() {
        let spec = &base[index];
        let module = module_of(&spec.name);
        let mut slot = Slot::default();
        if Some(at) == tied_at {
            // The tied embedding belongs to the embed part (slot 0 there); when it trains, the head's
            // slice has it appended after the head's own slots (see `super::head_params`).
            let embedding = &base[0];
            slot.trained = trains(model, 0, last, module_of(&embedding.name), true).then_some(specs.len());
            slots.push(slot);
            continue;
        }
        if trains(model, part, last, module, index == 0) {
            slot.trained = Some(specs.len());
            specs.push(spec.clone());
        }
        let in_block = part >= 1 && part <= model.n_layers;
        if in_block && spec.shape.len() == 2 && targets.iter().any(|t| module_ends_with(module, t)) {
            let r = peft.expect("targets come from [peft]").r as i64;
            let (out, inp) = (spec.shape[0], spec.shape[1]);
            slot.adapter = Some(specs.len());
            let bound = 1.0 / (inp as f64).sqrt();
            specs.push(ParamSpec {
                name: format!("{module}.lora_A.weight"),
                shape: vec![r, inp],
                init: Init::Adapter { bound },
            });
            specs.push(ParamSpec {
                name: format!("{module}.lora_B.weight"),
                shape: vec![out, r],
                init: Init::Adapter { bound: 0.0 },
            });
        }
        slots.push(slot);
    }
    PartLayout { base: indices, slots, specs }
}

/// Whether a family parameter of `part` (0 embed, 1..=n_layers the blocks, `last` the head) in
/// `module` trains; `embedding` marks the token embedding (which is the head's matrix when tied).
fn trains(model: &ModelConfig, part: usize, last: usize, module: &str, embedding: bool) -> bool {
    let Some(p) = &model.peft else { return true };
    let listed = p.train.iter().any(|m| module_contains(module, m));
    let last_blocks = p.method == Method::Freeze && p.last_blocks > 0 && {
        let first_trained = model.n_layers - p.last_blocks + 1;
        (first_trained..=last).contains(&part) || (embedding && model.tie_word_embeddings)
    };
    listed || last_blocks
}

/// The frozen base of a `model.from_hf` model in this process: its tensors read from the directory on
/// first use, one read-only copy per device, shared by every rank and model of the process that names
/// the same directory while one of them holds it. A ZeRO-3 rank makes it [`Base::transient`]: nothing
/// is kept, each use reads its tensors again (from the page cache, which the host's ranks share), so a
/// rank holds the base of the unit it computes and nothing between — the base "gathered just in time"
/// from the file instead of from peers.
#[derive(Debug)]
pub struct Base {
    dir: PathBuf,
    weights: crate::hf_weights::HfWeights,
    tensors: Mutex<HashMap<(usize, DeviceKey), Tensor>>,
    transient: std::sync::atomic::AtomicBool,
}

/// `tch::Device` as a map key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum DeviceKey {
    Cpu,
    Cuda(usize),
    Other,
}

impl From<tch::Device> for DeviceKey {
    fn from(device: tch::Device) -> Self {
        match device {
            tch::Device::Cpu => Self::Cpu,
            tch::Device::Cuda(i) => Self::Cuda(i),
            _ => Self::Other,
        }
    }
}

type Registry = Mutex<Vec<(PathBuf, Weak<Base>)>>;

fn registry() -> &'static Registry {
    static REGISTRY: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(Vec::new()))
}

impl Base {
    /// The base of `dir`, shared with whoever in the process holds it already.
    pub fn open(dir: &Path) -> Result<Arc<Self>, crate::hf_weights::HfError> {
        let mut registry = registry().lock().expect("base registry");
        registry.retain(|(_, weak)| weak.strong_count() > 0);
        if let Some(base) = registry.iter().find(|(d, _)| d == dir).and_then(|(_, weak)| weak.upgrade()) {
            return Ok(base);
        }
        let weights = crate::hf_weights::HfWeights::open(dir)?;
        let base = Arc::new(Self {
            dir: dir.to_owned(),
            weights,
            tensors: Mutex::new(HashMap::new()),
            transient: std::sync::atomic::AtomicBool::new(false),
        });
        registry.push((dir.to_owned(), Arc::downgrade(&base)));
        Ok(base)
    }

    /// The base of `model` (which has `from_hf`: [`PeftConfig::validate`] checks it).
    pub fn of(model: &ModelConfig) -> Arc<Self> {
        let dir = model.from_hf.as_deref().expect("[peft] needs model.from_hf (checked by validate)");
        Self::open(dir).unwrap_or_else(|e| panic!("the frozen base: {e}"))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Base parameter `index` of `model` on `device` (fp32, no gradient).
    pub fn tensor(&self, model: &ModelConfig, index: usize, device: tch::Device) -> Tensor {
        let key = (index, DeviceKey::from(device));
        if let Some(t) = self.tensors.lock().expect("base tensors").get(&key) {
            return t.shallow_clone();
        }
        let tensor = self.read(model, index, device);
        if self.transient.load(std::sync::atomic::Ordering::Relaxed) {
            return tensor;
        }
        let mut tensors = self.tensors.lock().expect("base tensors");
        tensors.entry(key).or_insert(tensor).shallow_clone()
    }

    /// Base parameter `index` of `model` read from the directory now and kept nowhere (a tensor-parallel
    /// rank cuts its shard from it and drops it: the files hold whole tensors, so the base is sliced after
    /// it is read, not read by range).
    pub fn read(&self, model: &ModelConfig, index: usize, device: tch::Device) -> Tensor {
        let spec = &super::base_specs(model)[index];
        let values = super::read_param(&self.weights, model, spec).unwrap_or_else(|e| panic!("the frozen base: {e}"));
        Tensor::from_slice(&values).view(spec.shape.as_slice()).to_device(device)
    }

    /// From now on nothing is kept: every use reads its tensors (ZeRO-3's just-in-time parameters);
    /// what was kept is dropped.
    pub fn transient(&self) {
        self.transient.store(true, std::sync::atomic::Ordering::Relaxed);
        self.tensors.lock().expect("base tensors").clear();
    }

    /// Bytes of base tensors kept between uses.
    pub fn held_bytes(&self) -> usize {
        let tensors = self.tensors.lock().expect("base tensors");
        tensors.values().map(crate::tensor_bytes).sum()
    }
}

impl super::Weights {
    /// Part `part` of `config`'s `[peft]` model on its trainable slice `trainable`, each frozen family
    /// parameter (by its position in [`super::base_specs`]) from `frozen`: the base's tensor for the
    /// reference ([`super::Weights::of`]), a rank's shard of it under tensor parallelism.
    pub fn with_frozen(
        config: &ModelConfig,
        part: usize,
        trainable: &[Tensor],
        frozen: impl Fn(usize) -> Tensor,
    ) -> Self {
        let peft = config.peft.as_ref().expect("a model with frozen parameters has [peft]");
        let layout = self::part(config, part);
        let used = layout.slots.iter().flat_map(|s| s.trained.into_iter().chain(s.adapter.map(|a| a + 1))).max();
        assert_eq!(trainable.len(), used.map_or(0, |last| last + 1), "part {part}'s trainable parameter count");
        let params = layout
            .base
            .iter()
            .zip(&layout.slots)
            .map(|(&index, slot)| match slot.trained {
                Some(at) => trainable[at].shallow_clone(),
                None => frozen(index),
            })
            .collect();
        let scale = peft.scale();
        let lora = layout
            .slots
            .iter()
            .map(|slot| {
                slot.adapter.map(|a| super::Lora {
                    a: trainable[a].shallow_clone(),
                    b: trainable[a + 1].shallow_clone(),
                    scale,
                    slot: a,
                })
            })
            .collect();
        Self { params, lora, slots: Some(layout.slots), dropout: None, columns: Vec::new() }
    }

    /// `x · weightᵀ` of family parameter `weight`, plus its LoRA update when it has adapters, without
    /// recording: a tensor-parallel rank's row-parallel product, whose bias is added after the sum.
    pub fn project(&self, precision: crate::precision::Precision, x: &Tensor, weight: usize) -> Tensor {
        self.linear(precision, x, weight, None, &mut Vec::new())
    }
}

/// LoRA's dropout mask for `x` (`[batch, time, in]`, row b being sample `samples.first + b`) at part
/// `part`'s family parameter `weight`: each element kept with probability 1 − `p` and then scaled by
/// 1/(1 − `p`) (inverted dropout, as `torch.nn.Dropout`), dropped to 0 otherwise. The decision is a hash
/// of (seed, step, sample, part, weight) — drawn here per sample — and the element's position in the
/// sample, computed with tensor operations on `x`'s device (32-bit lanes in int64, no overflow), so the
/// same sample gets the same mask on any rank, in any micro-batch, on any device, in a recomputation.
pub fn dropout_mask(x: &Tensor, p: f64, samples: super::Samples, part: usize, weight: usize) -> Tensor {
    dropout_mask_of_columns(x, p, samples, part, weight, None)
}

/// [`dropout_mask`] for `x` that is the columns `offset..` of an input `width` wide (`columns =
/// Some((offset, width))`; its last dimension the columns it holds): the mask is those columns of the
/// whole input's — what a tensor-parallel rank's slice of a row-parallel weight's input gets.
pub fn dropout_mask_of_columns(
    x: &Tensor,
    p: f64,
    samples: super::Samples,
    part: usize,
    weight: usize,
    columns: Option<(i64, i64)>,
) -> Tensor {
    use tch::Kind;
    let size = x.size();
    let (batch, per_sample) = (size[0], size[1..].iter().product::<i64>());
    let device = x.device();
    let positions = match columns {
        None => Tensor::arange(per_sample, (Kind::Int64, device)),
        Some((offset, width)) => {
            let held = *size.last().expect("x has a last dimension");
            let rows = per_sample / held;
            let starts = Tensor::arange(rows, (Kind::Int64, device)).view([rows, 1]) * width + offset;
            (starts + Tensor::arange(held, (Kind::Int64, device)).view([1, held])).view([per_sample])
        }
    };
    let whole = columns.map_or(per_sample, |(_, width)| per_sample / size.last().copied().unwrap_or(1) * width);
    assert!(whole <= 1 << 32, "a sample of {whole} elements exceeds the dropout hash's 32-bit positions");
    let salts: Vec<i64> = (0..batch as usize)
        .map(|b| {
            let sample = (samples.first + b) as u64;
            (crate::rng::hash_words(&[samples.seed, samples.step, sample, part as u64, weight as u64, 0xd50])
                & 0xffff_ffff) as i64
        })
        .collect();
    let salts = crate::transfer::upload(&Tensor::from_slice(&salts), device).view([batch, 1]);
    let mask32 = |t: Tensor| t.bitwise_and(0xffff_ffffi64);
    // A 32-bit integer hash (two xor-shift-multiply rounds); every product is below 2^63.
    let mut h = mask32(positions.view([1, per_sample]).bitwise_xor_tensor(&salts));
    for _ in 0..2 {
        h = mask32((h.bitwise_right_shift_tensor_scalar(16).bitwise_xor_tensor(&h)) * 0x045d_9f3bi64);
    }
    h = h.bitwise_right_shift_tensor_scalar(16).bitwise_xor_tensor(&h);
    let threshold = ((1.0 - p) * 4_294_967_296.0) as i64;
    (h.lt(threshold).to_kind(Kind::Float) / (1.0 - p)).view(size.as_slice()).to_kind(x.kind())
}

/// Each part's positions in the trainable list.
pub fn part_ranges(parts: &[PartLayout]) -> Vec<Range<usize>> {
    let mut at = 0;
    parts
        .iter()
        .map(|p| {
            let r = at..at + p.specs.len();
            at = r.end;
            r
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_matching_is_by_components() {
        assert!(module_ends_with("model.layers.0.self_attn.q_proj", "q_proj"));
        assert!(module_ends_with("h.0.attn.c_proj", "attn.c_proj"));
        assert!(!module_ends_with("h.0.mlp.c_proj", "attn.c_proj"));
        assert!(!module_ends_with("model.layers.0.self_attn.q_proj", "proj"));
        assert!(module_contains("model.layers.0.mlp.up_proj", "mlp"));
        assert!(module_contains("model.layers.11.mlp", "layers.11"));
        assert!(!module_contains("model.layers.1.mlp", "layers.11"));
        assert!(!module_contains("ln_f", "norm"));
    }
}

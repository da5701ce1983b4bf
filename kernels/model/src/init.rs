//! A fresh model's initial parameters: drawn from the seed ([`init_values`]), or read from
//! `model.from_hf`'s weights and `peft.from_adapters`' adapters — and [`Model::new`] and [`Model::load`],
//! which build a model from them. Above both the model and [`crate::hf`]: reading PEFT's adapters is the
//! Hugging Face boundary's, and the model's forward never needs it.

use std::ops::Range;

use crate::hf::peft::Adapters;
use crate::hf::{HfError, HfWeights};
use crate::model::{init_values, param_specs, read_param, Init, Model, ModelConfig, ParamSpec};

/// Building a model from its initial values. (The rest of [`Model`] is in [`crate::model`].)
impl Model {
    /// A freshly initialised model on the CPU, computing in fp32 (see [`Self::with_precision`]).
    /// Panics where `config.from_hf`'s weights cannot be read: [`Self::load`] returns that error, and
    /// job configs are checked with [`crate::hf::check_weights`] before anything runs.
    pub fn new(config: ModelConfig, seed: u64) -> Self {
        Self::load(config, seed).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Self::new`], with a Hugging Face weight file that cannot be read as an error.
    pub fn load(config: ModelConfig, seed: u64) -> Result<Self, HfError> {
        let specs = param_specs(&config);
        let values = initial_values(&config, seed, 0..specs.len())?;
        Self::from_values(config, specs, values)
    }
}

/// Trainable parameter `index`'s initial values: read from the PEFT adapters of `peft.from_adapters`
/// when set (every trainable parameter: adapters and `train`'s modules), else adapters drawn and
/// everything else read from the model's weights (`from_hf`) or drawn by [`init_values`].
fn initial_param(
    cfg: &ModelConfig,
    sources: &Sources,
    spec: &ParamSpec,
    seed: u64,
    index: usize,
) -> Result<Vec<f32>, HfError> {
    if let Some(values) = sources.adapters.as_ref().and_then(|a| a.get(spec)) {
        return Ok(values.clone());
    }
    match &sources.weights {
        Some(weights) if !matches!(spec.init, Init::Adapter { .. }) => read_param(weights, cfg, spec),
        _ => Ok(init_values(spec, seed, index)),
    }
}

/// Where a fresh job's parameters come from: `model.from_hf`'s weights, `peft.from_adapters`.
struct Sources {
    weights: Option<HfWeights>,
    adapters: Option<Adapters>,
}

impl Sources {
    fn open(cfg: &ModelConfig) -> Result<Self, HfError> {
        let weights = cfg.from_hf.as_deref().map(HfWeights::open).transpose()?;
        let adapters = cfg.peft.as_ref().and_then(|p| p.from_adapters.as_deref());
        let adapters = adapters.map(|dir| Adapters::open(cfg, dir)).transpose()?;
        Ok(Self { weights, adapters })
    }
}

/// The initial values of parameters `indices` of `cfg`'s model: read from the Hugging Face weights of
/// `cfg.from_hf` (only those tensors, from the memory-mapped files), else drawn by [`init_values`].
pub fn initial_values(cfg: &ModelConfig, seed: u64, indices: Range<usize>) -> Result<Vec<Vec<f32>>, HfError> {
    let specs = param_specs(cfg);
    let sources = Sources::open(cfg)?;
    indices.map(|i| initial_param(cfg, &sources, &specs[i], seed, i)).collect()
}

/// The initial values of the elements `range` of the flat parameter order (every parameter of
/// [`param_specs`] flattened, one after the other): what a ZeRO-3 rank or a pipeline stage holds of a
/// fresh job, computed without the rest of the model. Only the parameters that overlap `range` are drawn
/// or read (from `cfg.from_hf`, one tensor at a time); equals the same slice of every [`initial_values`]
/// flattened.
pub fn initial_flat(cfg: &ModelConfig, seed: u64, range: Range<usize>) -> Result<Vec<f32>, HfError> {
    let specs = param_specs(cfg);
    let sources = Sources::open(cfg)?;
    let mut out = Vec::with_capacity(range.len());
    let mut start = 0;
    for (index, spec) in specs.iter().enumerate() {
        let end = start + spec.numel();
        if start < range.end && range.start < end {
            let values = initial_param(cfg, &sources, spec, seed, index)?;
            out.extend_from_slice(&values[range.start.max(start) - start..range.end.min(end) - start]);
        }
        start = end;
    }
    assert_eq!(out.len(), range.len(), "range {range:?} is outside the {start} elements of the flat order");
    Ok(out)
}

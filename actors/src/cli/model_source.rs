//! The model a `troupe generate` or `troupe eval` runs: a Hugging Face directory (config.json +
//! safetensors) or a troupe checkpoint (a `step-NNNNNNNN` directory, or a root: its newest valid one),
//! told apart by what the directory holds — and the tokenizer it came with.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use troupe_model::checkpoint::{load_state, StateKind, MANIFEST};
use troupe_model::data::HfTokenizer;
use troupe_model::hf;
use troupe_model::model::Model;
use troupe_model::ModelConfig;

/// A model loaded for `troupe generate` or `troupe eval`, and the tokenizer it came with.
pub struct Loaded {
    pub model: Model,
    /// The `tokenizer.json` beside a Hugging Face directory's weights, or the `[data] tokenizer` of the
    /// job a checkpoint was saved by — where that file exists.
    pub tokenizer: Option<PathBuf>,
}

/// Loads the model at `path` on the CPU.
pub fn load_model(path: &Path) -> anyhow::Result<Model> {
    Ok(load(path)?.model)
}

/// Loads the model at `path` on the CPU, with the tokenizer it came with.
pub fn load(path: &Path) -> anyhow::Result<Loaded> {
    load_with(path, None)
}

/// Loads the model at `path` on the CPU — with `adapters` (`--adapters DIR`, a PEFT LoRA directory), the
/// LoRA model of base `path` (a Hugging Face directory) and those adapters, computed unmerged as
/// `W·x + s·B·(A·x)` — with the tokenizer it came with.
pub fn load_with(path: &Path, adapters: Option<&Path>) -> anyhow::Result<Loaded> {
    if let Some(adapters) = adapters {
        if !path.join("config.json").is_file() {
            bail!(
                "--adapters {} applies to a Hugging Face base model, but --model {} is not one (no config.json); \
                 name the base the adapters were trained on (a [peft] checkpoint holds its adapters already: drop --adapters)",
                adapters.display(),
                path.display()
            );
        }
    }
    if path.join("config.json").is_file() {
        let config = hf::read_config(path).with_context(|| format!("--model {}", path.display()))?;
        let mut config = ModelConfig { from_hf: Some(path.to_owned()), ..config };
        if let Some(adapters) = adapters {
            let peft = hf::peft::peft_config_of(&config, adapters)
                .with_context(|| format!("--adapters {} on --model {}", adapters.display(), path.display()))?;
            config.peft = Some(peft);
        }
        hf::check_weights(&config).with_context(|| match adapters {
            Some(a) => format!("--model {} --adapters {}", path.display(), a.display()),
            None => format!("--model {}", path.display()),
        })?;
        let tokenizer = Some(path.join("tokenizer.json")).filter(|t| t.is_file());
        return Ok(Loaded { model: Model::load(config, 0)?, tokenizer });
    }
    if !path.is_dir() {
        let what = if path.exists() { "not a directory" } else { "no such directory" };
        bail!("--model {}: {what}; name a Hugging Face model directory or a troupe checkpoint", path.display());
    }
    let dir = if path.join(MANIFEST).is_file() {
        path.to_owned()
    } else {
        super::checkpoint::source(path).with_context(|| {
            format!("--model {}: neither a Hugging Face directory (no config.json) nor a checkpoint", path.display())
        })?
    };
    let state = load_state(&dir).with_context(|| format!("loading {}", dir.display()))?;
    // A [peft] checkpoint holds what trains; its frozen base is read from model.from_hf (whose checksum
    // load_state checked).
    let from_hf = state.config.model.peft.as_ref().and(state.config.model.from_hf.clone());
    let mut config = ModelConfig { from_hf, ..state.config.model.clone() };
    if let Some(peft) = config.peft.as_mut() {
        peft.from_adapters = None; // what the job started from; the checkpoint holds what it trained
    }
    let mut model = Model::new(config, 0);
    let offsets = state.offsets();
    let params = state.values(StateKind::Param);
    let values: Vec<tch::Tensor> = model
        .specs()
        .iter()
        .enumerate()
        .map(|(i, spec)| tch::Tensor::from_slice(&params[offsets[i]..offsets[i + 1]]).view(spec.shape.as_slice()))
        .collect();
    model.load_values(&values);
    let tokenizer = state.config.data.tokenizer.clone().filter(|t| t.is_file());
    Ok(Loaded { model, tokenizer })
}

/// The tokenizer to use: `--tokenizer` if given, else the one the model came with; loaded, and checked
/// to fit the model's vocabulary.
pub fn tokenizer(flag: Option<&Path>, loaded: &Loaded) -> anyhow::Result<Option<HfTokenizer>> {
    let Some(path) = flag.or(loaded.tokenizer.as_deref()) else { return Ok(None) };
    let what = if flag.is_some() { "--tokenizer" } else { "the model's tokenizer" };
    let tokenizer = HfTokenizer::from_file(path).with_context(|| format!("{what} {}", path.display()))?;
    let vocab = loaded.model.config.vocab_size;
    if tokenizer.vocab_size() > vocab {
        bail!(
            "{what} {}: its {} tokens do not fit the model's vocabulary of {vocab}; use the tokenizer the model was trained with",
            path.display(),
            tokenizer.vocab_size()
        );
    }
    Ok(Some(tokenizer))
}

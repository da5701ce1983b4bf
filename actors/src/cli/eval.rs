//! `troupe eval`: a model's mean next-token loss and perplexity on a corpus, over consecutive
//! non-overlapping windows of its context.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::config::{DataConfig, DataKind};
use troupe_model::data::load_corpus;
use troupe_model::generate::evaluate;

use super::model_source::load_with;

/// Windows per forward.
const WINDOWS_PER_BATCH: usize = 8;

#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// A Hugging Face model directory or a troupe checkpoint (a step directory, or a root: its newest).
    #[arg(long)]
    pub model: PathBuf,
    /// Hugging Face PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) on the base
    /// model `--model` (a Hugging Face directory): computed unmerged, `W·x + s·B·(A·x)`.
    #[arg(long)]
    pub adapters: Option<PathBuf>,
    /// The corpus file (the `[data] path` of a job config).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// How the corpus is read (`[data] kind`): text, jsonl (a `text` field per line), bin (a `troupe data
    /// prepare` token file, or nanoGPT uint16) or synthetic (the built-in corpus, no file). Default: bin for
    /// a `.bin` file, jsonl for a `.jsonl` file, text for another file, synthetic without `--data`.
    #[arg(long, value_enum)]
    pub data_kind: Option<DataKindArg>,
    /// The `tokenizer.json` that encodes text and jsonl (default: the one the model came with — beside a
    /// Hugging Face directory's weights, or the `[data] tokenizer` of the job a checkpoint was saved by;
    /// without one, text is read as bytes).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Evaluate the first N windows only (0: every whole window of the corpus).
    #[arg(long, default_value_t = 0)]
    pub windows: usize,
    /// Tokens per window (default: the model's context).
    #[arg(long)]
    pub context: Option<usize>,
    /// One JSON object: `{"event":"eval","loss":…,"perplexity":…,"tokens":…}`.
    #[arg(long)]
    pub json: bool,
}

/// `--data-kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataKindArg {
    Synthetic,
    Text,
    Jsonl,
    Bin,
}

/// The corpus `--data` and `--data-kind` name, text and jsonl encoded by `tokenizer`.
fn data_config(args: &EvalArgs, tokenizer: Option<PathBuf>) -> anyhow::Result<DataConfig> {
    let kind = match (args.data_kind, &args.data) {
        (Some(DataKindArg::Synthetic), Some(path)) => {
            bail!(
                "--data {}: the synthetic corpus is built in; drop --data or pass --data-kind text|jsonl|bin",
                path.display()
            )
        }
        (Some(DataKindArg::Text | DataKindArg::Jsonl | DataKindArg::Bin), None) => {
            bail!("--data-kind text|jsonl|bin needs --data PATH")
        }
        (Some(DataKindArg::Synthetic) | None, None) => DataKind::Synthetic,
        (Some(DataKindArg::Text), Some(_)) => DataKind::Text,
        (Some(DataKindArg::Jsonl), Some(_)) => DataKind::Jsonl,
        (Some(DataKindArg::Bin), Some(_)) => DataKind::Bin,
        (None, Some(path)) if path.extension().is_some_and(|e| e == "bin") => DataKind::Bin,
        (None, Some(path)) if path.extension().is_some_and(|e| e == "jsonl") => DataKind::Jsonl,
        (None, Some(_)) => DataKind::Text,
    };
    let tokenizer = match kind {
        DataKind::Text | DataKind::Jsonl => tokenizer,
        DataKind::Bin | DataKind::Synthetic => None, // tokens already, or bytes
    };
    Ok(DataConfig { kind, path: args.data.clone(), tokenizer, ..DataConfig::default() })
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let loaded = load_with(&args.model, args.adapters.as_deref())?;
    // Checked against the model's vocabulary, then named by path: the corpus loader encodes with it.
    let tokenizer = super::model_source::tokenizer(args.tokenizer.as_deref(), &loaded)?;
    let data = data_config(&args, tokenizer.map(|t| t.path().to_owned()))?;
    let mut model = loaded.model;
    if let Some(context) = args.context {
        let positions = model.config.positions();
        if context == 0 || context > positions {
            bail!("--context {context}: must be in 1..={positions}, the positions the model addresses");
        }
        model.config.context = context;
    }
    let origin = data.path.as_ref().map_or_else(|| "the synthetic corpus".to_owned(), |p| p.display().to_string());
    let corpus = load_corpus(&data, &model.config).with_context(|| format!("--data {origin}"))?;
    let eval =
        evaluate(&model, &corpus, args.windows, WINDOWS_PER_BATCH).with_context(|| format!("--data {origin}"))?;
    if args.json {
        println!(
            "{}",
            json!({ "event": "eval", "loss": eval.loss, "perplexity": eval.perplexity, "tokens": eval.tokens,
                    "windows": eval.windows, "context": model.config.context, "model": args.model, "data": origin })
        );
    } else {
        println!(
            "loss {:.4}  perplexity {:.3}  ({} tokens: {} windows of {} from {origin})",
            eval.loss, eval.perplexity, eval.tokens, eval.windows, model.config.context
        );
    }
    Ok(())
}

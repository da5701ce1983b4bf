//! `troupe bench generate`: greedy decoding tokens/s through troupe's key/value cache, with `--peer`
//! beside transformers' `generate(do_sample=False)` (bench/peers/generate_hf.py) on the same weights,
//! prompt and thread count, and whether the two chose the same tokens.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use troupe_model::generate::{generate, Sampling};
use troupe_model::hf::{self, ExportOptions};
use troupe_model::model::{presets, Model};

use super::bench_train::run_peer_script;
use super::model_source::load_model;

#[derive(Debug, clap::Args)]
pub struct BenchGenerateArgs {
    /// A Hugging Face model directory or a troupe checkpoint; without it, `--preset` with random weights.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The model shape when there is no `--model` (gpt-tiny, gpt2, llama-tiny, smollm2-135m, tinyllama-1.1b).
    #[arg(long, default_value = "llama-tiny", conflicts_with = "model")]
    pub preset: String,
    /// Prompt length in tokens (ids `(7i + 3) mod vocab`).
    #[arg(long, default_value_t = 16)]
    pub prompt_tokens: usize,
    /// New tokens per timed run (prompt + new tokens fit the model's positions: 128 for the tiny presets).
    #[arg(long, default_value_t = 96)]
    pub new_tokens: usize,
    /// Timed runs of each (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Intra-op threads of troupe and the peer (default: every core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Also run transformers' generate on the same model and report the ratio.
    #[arg(long)]
    pub peer: bool,
    /// Python with torch and transformers for the peer (default: $TROUPE_PYTHON, else the provisioned venv).
    #[arg(long)]
    pub python: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

/// `--model`, or `--preset` with random weights.
fn bench_model(args: &BenchGenerateArgs) -> anyhow::Result<Model> {
    match &args.model {
        Some(path) => load_model(path),
        None => {
            let config = presets::preset(&args.preset)
                .with_context(|| format!("--preset {}: not a preset; one of {}", args.preset, presets::names()))?;
            Ok(Model::new(config, 1))
        }
    }
}

/// A Hugging Face directory holding `model`'s weights, for the peer: `--model` itself if it is one,
/// else the model exported into `scratch`.
fn hf_directory(args: &BenchGenerateArgs, model: &Model, scratch: &Path) -> anyhow::Result<PathBuf> {
    if let Some(path) = args.model.as_ref().filter(|p| p.join("config.json").is_file()) {
        return Ok(path.clone());
    }
    let values: Vec<Vec<f32>> =
        model.params().iter().map(|p| Vec::try_from(p.flatten(0, -1)).expect("fp32 parameters")).collect();
    let dir = scratch.join("model");
    hf::export(&model.config, &values, &dir, ExportOptions::default())
        .with_context(|| format!("writing the model as a Hugging Face directory for the peer ({})", dir.display()))?;
    Ok(dir)
}

/// transformers' `generate` on the same weights, `prompt` and `threads` (bench/peers/generate_hf.py): its
/// report fields, compared with troupe's `ours` tokens/s and `tokens`.
fn peer_fields(
    args: &BenchGenerateArgs,
    model: &Model,
    (prompt, tokens): (&[i64], &[i64]),
    threads: usize,
    ours: f64,
) -> anyhow::Result<Value> {
    let scratch = tempfile::tempdir()?;
    let dir = hf_directory(args, model, scratch.path())?;
    let ids = prompt.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
    let peer_args = [
        "--model-dir".to_string(),
        dir.display().to_string(),
        "--prompt-ids".into(),
        ids,
        "--new-tokens".into(),
        args.new_tokens.to_string(),
        "--repeats".into(),
        args.repeats.to_string(),
        "--threads".into(),
        threads.to_string(),
    ];
    let peer = run_peer_script(args.python.as_ref(), "generate_hf.py", &peer_args)?;
    let theirs = peer["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
    let same_tokens =
        peer["tokens"].as_array().is_some_and(|t| t.iter().map(Value::as_i64).eq(tokens.iter().map(|&t| Some(t))));
    Ok(json!({ "peer": "transformers-generate", "peer_tokens_per_s": theirs,
               "peer_tokens_per_s_runs": peer["tokens_per_s_runs"], "ratio_vs_peer": ours / theirs,
               "same_tokens": same_tokens }))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub fn run(args: BenchGenerateArgs) -> anyhow::Result<()> {
    if args.repeats == 0 || args.new_tokens == 0 || args.prompt_tokens == 0 {
        bail!("--repeats, --new-tokens and --prompt-tokens must be at least 1");
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    tch::set_num_threads(threads as i32);
    let model = bench_model(&args)?;
    let config = &model.config;
    let room = config.positions().saturating_sub(args.prompt_tokens);
    if args.new_tokens > room {
        bail!(
            "--prompt-tokens {} + --new-tokens {} exceed the model's {} positions",
            args.prompt_tokens,
            args.new_tokens,
            config.positions()
        );
    }
    let prompt: Vec<i64> = (0..args.prompt_tokens).map(|i| ((7 * i + 3) % config.vocab_size) as i64).collect();
    let greedy = Sampling::greedy();
    generate(&model, &prompt, args.new_tokens.min(8), greedy, |_| {})?;
    let mut rates = Vec::new();
    let mut tokens = Vec::new();
    for _ in 0..args.repeats {
        let started = Instant::now();
        tokens = generate(&model, &prompt, args.new_tokens, greedy, |_| {})?;
        rates.push(args.new_tokens as f64 / started.elapsed().as_secs_f64());
    }
    let ours = median(rates.clone());
    let mut report = json!({
        "event": "bench_generate", "arch": config.arch.as_str(), "params": model.param_count(),
        "model": args.model.as_ref().map_or_else(|| format!("preset:{}", args.preset), |p| p.display().to_string()),
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "threads": threads,
        "decoding": "greedy, key/value cache, fp32, cpu", "tokens_per_s": ours, "tokens_per_s_runs": rates,
    });
    if args.peer {
        let fields = peer_fields(&args, &model, (&prompt, &tokens), threads, ours)?;
        if let (Some(report), Value::Object(fields)) = (report.as_object_mut(), fields) {
            report.extend(fields);
        }
    }
    if args.json {
        println!("{report}");
        return Ok(());
    }
    println!(
        "troupe       {ours:>9.1} tokens/s  (greedy, {} new after {} prompt tokens, {threads} threads, {} parameters)",
        args.new_tokens,
        args.prompt_tokens,
        model.param_count()
    );
    if let Some(theirs) = report.get("peer_tokens_per_s").and_then(Value::as_f64) {
        println!("transformers {theirs:>9.1} tokens/s  (generate, do_sample=False, same weights and prompt)");
        println!("ratio        {:>9.3}   same tokens: {}", ours / theirs, report["same_tokens"]);
    }
    Ok(())
}

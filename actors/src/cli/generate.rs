//! `troupe generate`: sampling from a trained model through the key/value cache, each token written to
//! the terminal (and flushed) as it is chosen.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::generate::{generate, Sampling};

use super::model_source::load_model;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A Hugging Face model directory or a troupe checkpoint (a step directory, or a root: its newest).
    #[arg(long)]
    pub model: PathBuf,
    /// The prompt text: its bytes are the tokens (a byte-vocabulary model such as gpt-tiny).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated (`1,2,3`); the new tokens are printed as ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<i64>>,
    /// New tokens to generate (fewer if the model's positions run out first).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// 0: greedy (the most likely token); otherwise the softmax temperature.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample among the K most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample among the fewest most likely tokens whose probability reaches P (1: all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// The sampler's seed: the same seed, model and prompt give the same tokens.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// One JSON object (prompt and new token ids, text, tokens/s) at the end instead of streamed text.
    #[arg(long)]
    pub json: bool,
}

/// How tokens become what the terminal shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Vocabulary {
    /// Each token is a byte (the byte tokenizer of `--prompt`).
    Bytes,
    /// Token ids, space-separated (`--prompt-ids`).
    Ids,
}

impl Vocabulary {
    /// The prompt's tokens.
    fn encode(args: &GenerateArgs, vocab: usize) -> anyhow::Result<(Self, Vec<i64>)> {
        match (&args.prompt, &args.prompt_ids) {
            (_, Some(ids)) => Ok((Self::Ids, ids.clone())),
            (Some(text), None) => {
                if vocab < 256 {
                    bail!("--prompt: the model's vocabulary of {vocab} tokens cannot hold bytes; pass --prompt-ids");
                }
                Ok((Self::Bytes, text.bytes().map(i64::from).collect()))
            }
            (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
        }
    }

    /// What `tokens` print as, following `previous` tokens.
    fn render(self, tokens: &[i64], previous: usize) -> Vec<u8> {
        match self {
            Self::Bytes => tokens.iter().map(|&t| t as u8).collect(),
            Self::Ids => {
                let mut text = String::new();
                for (i, t) in tokens.iter().enumerate() {
                    if previous + i > 0 {
                        text.push(' ');
                    }
                    text.push_str(&t.to_string());
                }
                text.into_bytes()
            }
        }
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let model = load_model(&args.model)?;
    let (vocabulary, prompt) = Vocabulary::encode(&args, model.config.vocab_size)?;
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed };
    let mut out = std::io::stdout().lock();
    let stream = !args.json;
    if stream {
        out.write_all(&vocabulary.render(&prompt, 0))?;
        out.flush()?;
    }
    let mut written = prompt.len();
    let mut write_error = None;
    let started = Instant::now();
    let tokens = generate(&model, &prompt, args.max_new_tokens, sampling, |token| {
        if !stream || write_error.is_some() {
            return;
        }
        let wrote = out.write_all(&vocabulary.render(&[token], written)).and_then(|()| out.flush());
        written += 1;
        if let Err(e) = wrote {
            write_error = Some(e);
        }
    })
    .with_context(|| format!("--model {}", args.model.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    if let Some(e) = write_error {
        return Err(e).context("writing to stdout");
    }
    if args.json {
        let text = (vocabulary == Vocabulary::Bytes)
            .then(|| String::from_utf8_lossy(&vocabulary.render(&tokens, prompt.len())).into_owned());
        let tokens_per_s = tokens.len() as f64 / seconds.max(1e-9);
        writeln!(
            out,
            "{}",
            json!({ "event": "generated", "prompt_ids": prompt, "tokens": tokens, "text": text,
                    "seconds": seconds, "tokens_per_s": tokens_per_s })
        )?;
    } else {
        writeln!(out)?;
    }
    Ok(())
}

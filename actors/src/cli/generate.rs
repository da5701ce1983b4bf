//! `troupe generate`: sampling from a trained model through the key/value cache, each token written to
//! the terminal (and flushed) as it is chosen.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::generate::{generate, Sampling};

use troupe_model::data::HfTokenizer;

use super::model_source::load_with;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// A Hugging Face model directory or a troupe checkpoint (a step directory, or a root: its newest).
    #[arg(long)]
    pub model: PathBuf,
    /// Hugging Face PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`) on the base
    /// model `--model` (a Hugging Face directory): computed unmerged, `W·x + s·B·(A·x)`.
    #[arg(long)]
    pub adapters: Option<PathBuf>,
    /// The prompt text, encoded by the tokenizer (`--tokenizer`, else the one the model came with); a
    /// model without one reads its bytes as tokens (a byte-vocabulary model such as gpt-tiny).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated (`1,2,3`); the new tokens are printed as ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<i64>>,
    /// A `tokenizer.json` (default: the one beside a Hugging Face directory's weights, or the `[data]
    /// tokenizer` of the job a checkpoint was saved by).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// New tokens to generate (fewer if the model's positions run out first, or at the end of text).
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Go on past the tokenizer's end-of-text token instead of stopping after it.
    #[arg(long)]
    pub ignore_eos: bool,
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
enum Vocabulary {
    /// Each token is a byte (a model without a tokenizer, given `--prompt`).
    Bytes,
    /// Token ids, space-separated (`--prompt-ids`).
    Ids,
    /// A tokenizer's text: the prompt and the new tokens decoded together, so that what a token means
    /// in context (a leading space, a character split over tokens) comes out right.
    Text(HfTokenizer),
}

impl Vocabulary {
    /// The prompt's tokens.
    fn encode(args: &GenerateArgs, tokenizer: Option<HfTokenizer>, vocab: usize) -> anyhow::Result<(Self, Vec<i64>)> {
        match (&args.prompt, &args.prompt_ids, tokenizer) {
            (_, Some(ids), _) => Ok((Self::Ids, ids.clone())),
            (Some(text), None, Some(tokenizer)) => {
                let ids = tokenizer.encode(text).map_err(|e| anyhow::anyhow!("--prompt: {e}"))?;
                Ok((Self::Text(tokenizer), ids.into_iter().map(i64::from).collect()))
            }
            (Some(text), None, None) => {
                if vocab < 256 {
                    bail!(
                        "--prompt: the model has no tokenizer and its vocabulary of {vocab} tokens cannot hold bytes; \
                         pass --tokenizer tokenizer.json or --prompt-ids"
                    );
                }
                Ok((Self::Bytes, text.bytes().map(i64::from).collect()))
            }
            (None, None, _) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
        }
    }

    /// The tokenizer's end-of-text token, where generation stops.
    fn eos(&self) -> Option<i64> {
        match self {
            Self::Text(tokenizer) => tokenizer.eos().map(i64::from),
            Self::Bytes | Self::Ids => None,
        }
    }
}

/// What is printed as tokens come: the text of the sequence so far, less what was printed before.
struct Printer<'a> {
    vocabulary: &'a Vocabulary,
    sequence: Vec<i64>,
    /// What was printed so far: bytes of the rendered sequence (a byte vocabulary: tokens).
    printed: usize,
    /// Bytes of the rendered prompt: the generated text is what follows.
    prompt_len: usize,
}

impl<'a> Printer<'a> {
    fn new(vocabulary: &'a Vocabulary, prompt: &[i64]) -> anyhow::Result<Self> {
        let mut printer = Self { vocabulary, sequence: prompt.to_vec(), printed: 0, prompt_len: 0 };
        printer.prompt_len = printer.render()?.len();
        Ok(printer)
    }

    /// The whole sequence as text (ids: space-separated).
    fn render(&self) -> anyhow::Result<String> {
        Ok(match self.vocabulary {
            Vocabulary::Bytes => {
                String::from_utf8_lossy(&self.sequence.iter().map(|&t| t as u8).collect::<Vec<_>>()).into_owned()
            }
            Vocabulary::Ids => self.sequence.iter().map(i64::to_string).collect::<Vec<_>>().join(" "),
            Vocabulary::Text(tokenizer) => {
                let ids: Vec<u32> = self.sequence.iter().map(|&t| t as u32).collect();
                tokenizer.decode(&ids).map_err(|e| anyhow::anyhow!("decoding the tokens: {e}"))?
            }
        })
    }

    /// Adds `token` (None: nothing, the prompt) and returns what is new to print. Bytes print as they are,
    /// one per token; text waits while it ends inside a character.
    fn push(&mut self, token: Option<i64>) -> anyhow::Result<Vec<u8>> {
        self.sequence.extend(token);
        if let Vocabulary::Bytes = self.vocabulary {
            let new = self.sequence[self.printed..].iter().map(|&t| t as u8).collect();
            self.printed = self.sequence.len();
            return Ok(new);
        }
        let text = self.render()?;
        if text.ends_with('\u{FFFD}') || text.len() <= self.printed || !text.is_char_boundary(self.printed) {
            return Ok(Vec::new());
        }
        let new = text.as_bytes()[self.printed..].to_vec();
        self.printed = text.len();
        Ok(new)
    }

    /// What is left to print at the end: text held back because it ended inside a character, as the
    /// tokenizer decodes it.
    fn finish(&mut self) -> anyhow::Result<Vec<u8>> {
        if let Vocabulary::Bytes = self.vocabulary {
            return Ok(Vec::new());
        }
        let text = self.render()?;
        let new = text.as_bytes().get(self.printed..).unwrap_or_default().to_vec();
        self.printed = self.printed.max(text.len());
        Ok(new)
    }

    /// The generated text: the whole sequence's, after the prompt's.
    fn generated(&self) -> anyhow::Result<String> {
        let text = self.render()?;
        Ok(text.get(self.prompt_len..).unwrap_or_default().to_owned())
    }
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    tch::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()) as i32);
    let loaded = load_with(&args.model, args.adapters.as_deref())?;
    let tokenizer = super::model_source::tokenizer(args.tokenizer.as_deref(), &loaded)?;
    let model = loaded.model;
    let (vocabulary, prompt) = Vocabulary::encode(&args, tokenizer, model.config.vocab_size)?;
    let eos = if args.ignore_eos { None } else { vocabulary.eos() };
    let sampling =
        Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed, eos };
    let mut out = std::io::stdout().lock();
    let stream = !args.json;
    let mut printer = Printer::new(&vocabulary, &prompt)?;
    if stream {
        out.write_all(&printer.push(None)?)?;
        out.flush()?;
    }
    let mut failure = None;
    let started = Instant::now();
    let tokens = generate(&model, &prompt, args.max_new_tokens, sampling, |token| {
        if !stream || failure.is_some() {
            return;
        }
        let wrote = printer.push(Some(token)).and_then(|new| {
            out.write_all(&new)?;
            out.flush()?;
            Ok(())
        });
        if let Err(e) = wrote {
            failure = Some(e.context("writing to stdout"));
        }
    })
    .with_context(|| format!("--model {}", args.model.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    if let Some(e) = failure {
        return Err(e);
    }
    if args.json {
        printer.sequence.extend(&tokens);
        let text = match vocabulary {
            Vocabulary::Ids => None,
            Vocabulary::Bytes | Vocabulary::Text(_) => Some(printer.generated()?),
        };
        let tokens_per_s = tokens.len() as f64 / seconds.max(1e-9);
        writeln!(
            out,
            "{}",
            json!({ "event": "generated", "prompt_ids": prompt, "tokens": tokens, "text": text,
                    "stopped_at_eos": eos.is_some() && tokens.last() == eos.as_ref(),
                    "seconds": seconds, "tokens_per_s": tokens_per_s })
        )?;
    } else {
        out.write_all(&printer.finish()?)?;
        writeln!(out)?;
    }
    Ok(())
}

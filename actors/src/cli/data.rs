//! `troupe data prepare`: documents tokenized once into a token file, which `data.kind = "bin"` reads
//! without tokenizing at every start (the format: troupe_model::data's token_file.rs, docs/guide.md).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::json;
use troupe_model::data::{encode_documents, DocumentFormat, Encoder, TokenFileWriter};

use crate::progress::bytes_bar;

#[derive(Debug, clap::Subcommand)]
pub enum DataCommand {
    /// Tokenize text or .jsonl files once into a token file that `[data] kind = "bin"` reads: a header
    /// (magic "TROUPETK", token width, vocabulary, count), then uint16 ids while the vocabulary fits,
    /// uint32 above.
    Prepare(PrepareArgs),
}

#[derive(Debug, clap::Args)]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json. Without it: bytes, one token each (vocabulary 256).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The token file to write (replaced if it exists; written beside it as OUT.partial first).
    #[arg(long)]
    pub out: PathBuf,
    /// How the inputs hold documents: text (a file is one document) or jsonl (one JSON object per line,
    /// its "text" a document). Default: jsonl for .jsonl and .ndjson files, text for others.
    #[arg(long, value_enum)]
    pub format: Option<FormatArg>,
    /// One JSON object when done: `{"event":"prepared","out":…,"tokens":…,"token_bytes":…,…}`.
    #[arg(long)]
    pub json: bool,
    /// The input files, in order: their documents follow one another, each followed by the tokenizer's
    /// end-of-document token when it has one.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
}

/// `--format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    Text,
    Jsonl,
}

pub fn run(command: DataCommand) -> anyhow::Result<()> {
    match command {
        DataCommand::Prepare(args) => prepare(args),
    }
}

fn prepare(args: PrepareArgs) -> anyhow::Result<()> {
    let mut total_bytes = 0;
    for input in &args.inputs {
        let meta = std::fs::metadata(input).with_context(|| format!("input {}: cannot read it", input.display()))?;
        if !meta.is_file() {
            bail!("input {}: not a file", input.display());
        }
        if same_file(input, &args.out) {
            bail!("--out {} is also an input; write the tokens to another file", args.out.display());
        }
        total_bytes += meta.len();
    }
    let encoder = Encoder::load(args.tokenizer.as_deref())?;
    let mut writer = TokenFileWriter::create(&args.out, encoder.vocab_size())?;
    let bar = bytes_bar(args.json, total_bytes, "tokenizing");
    let (mut done_bytes, mut documents) = (0, 0);
    for input in &args.inputs {
        let format = match args.format {
            Some(FormatArg::Text) => DocumentFormat::Text,
            Some(FormatArg::Jsonl) => DocumentFormat::Jsonl,
            None => DocumentFormat::of_path(input),
        };
        let file = std::fs::File::open(input).with_context(|| format!("input {}: cannot open it", input.display()))?;
        let mut sink = |ids: &[u32]| writer.push(ids);
        let mut progress = |bytes: u64| {
            if let Some(bar) = &bar {
                bar.set_position(done_bytes + bytes);
            }
        };
        documents += encode_documents(&encoder, format, input, file, &mut sink, &mut progress)?;
        done_bytes += std::fs::metadata(input).map_or(0, |m| m.len());
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let header = writer.finish()?;
    let tokenizer = args.tokenizer.as_ref().map(|p| p.display().to_string());
    let width = if header.width_bytes == 2 { "uint16" } else { "uint32" };
    if args.json {
        println!(
            "{}",
            json!({ "event": "prepared", "out": args.out, "tokens": header.tokens, "token_bytes": header.width_bytes,
                    "vocab_size": header.vocab_size, "documents": documents, "inputs": args.inputs.len(),
                    "input_bytes": total_bytes, "eos": encoder.eos(), "tokenizer": tokenizer })
        );
    } else {
        let eos = encoder.eos().map_or("no end-of-document token".to_owned(), |id| format!("end of document: id {id}"));
        println!(
            "wrote {}: {} {width} tokens (vocabulary {}) from {} in {} ({total_bytes} bytes); {eos}",
            args.out.display(),
            header.tokens,
            header.vocab_size,
            count(documents, "document"),
            count(args.inputs.len() as u64, "file"),
        );
    }
    Ok(())
}

/// "1 file", "2 files".
fn count(n: u64, noun: &str) -> String {
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// Whether `a` and `b` name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

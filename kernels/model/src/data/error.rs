//! What a bad data file or tokenizer gets: the path, what is wrong, and what to do.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("data file {path}: cannot read it ({source}); check data.path in the job config")]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error("data file {path} is empty; point data.path at a file with at least {needed} tokens")]
    Empty { path: PathBuf, needed: usize },
    #[error("data file {path} holds {tokens} tokens, fewer than one sample needs (model.context + 1 = {needed}); use a longer file or a smaller model.context")]
    TooShort { path: PathBuf, tokens: usize, needed: usize },
    #[error("data file {path} is {bytes} bytes, not a whole number of uint16 tokens; is it really a nanoGPT .bin file (data.kind = \"bin\")?")]
    OddLength { path: PathBuf, bytes: usize },
    #[error("data file {path} holds token {token} at position {position}, outside model.vocab_size = {vocab}; set model.vocab_size to at least {}", u64::from(*token) + 1)]
    TokenOutOfRange { path: PathBuf, token: u32, position: usize, vocab: usize },
    #[error("data file {path} starts with troupe's token-file magic \"TROUPETK\" but {problem}; write it again with `troupe data prepare`")]
    BadHeader { path: PathBuf, problem: String },
    #[error("data file {path} was tokenized with a vocabulary of {vocab} tokens (its header says so), more than model.vocab_size = {model_vocab}; set model.vocab_size to at least {vocab}, or prepare the data with the model's tokenizer")]
    FileVocabTooLarge { path: PathBuf, vocab: usize, model_vocab: usize },
    #[error("tokenizer {path}: cannot load it as a Hugging Face tokenizer.json ({message}); data.tokenizer and --tokenizer name a tokenizer.json as the tokenizers library's `save` writes it")]
    Tokenizer { path: PathBuf, message: String },
    #[error("tokenizer config {path}: {message}; its eos_token names the token that ends each document (remove the key to let troupe pick <|endoftext|>, </s>, <|end_of_text|> or <eos>)")]
    TokenizerConfig { path: PathBuf, message: String },
    #[error("tokenizer {path} has a vocabulary of {vocab} tokens, more than model.vocab_size = {model_vocab}; set model.vocab_size to at least {vocab}, or use the model's own tokenizer")]
    TokenizerVocabTooLarge { path: PathBuf, vocab: usize, model_vocab: usize },
    #[error("data file {path} is not UTF-8 text (an invalid sequence at byte {offset}); a tokenizer encodes text: convert the file to UTF-8, or leave data.tokenizer out to train on its raw bytes")]
    NotUtf8 { path: PathBuf, offset: usize },
    #[error("data file {path}, line {line}: {message}; each line of a .jsonl file is one JSON object with a string field \"text\"")]
    JsonlLine { path: PathBuf, line: usize, message: String },
    #[error("tokenizer {tokenizer} failed to encode {path}: {message}")]
    Encode { path: PathBuf, tokenizer: PathBuf, message: String },
    #[error("data.val_fraction = {fraction} holds out the last {tokens} of the {total} tokens of {origin}, fewer than one validation window needs (model.context + 1 = {needed}); raise data.val_fraction to at least {:.3}, or use a longer corpus", (*needed as f64 / *total as f64).min(1.0))]
    ValTooShort { origin: String, fraction: f64, tokens: usize, total: usize, needed: usize },
    #[error(
        "validation file {path} (data.val_path): cannot read it ({source}); check data.val_path in the job config"
    )]
    ValUnreadable { path: PathBuf, source: std::io::Error },
    #[error("validation file {path} (data.val_path) holds {tokens} tokens, fewer than one validation window needs (model.context + 1 = {needed}); use a longer file")]
    ValFileTooShort { path: PathBuf, tokens: usize, needed: usize },
    #[error("token file {path}: cannot write it ({source})")]
    Write { path: PathBuf, source: std::io::Error },
}

//! Corpora: a token stream loaded once and shared (read-only) by every sampler.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{synthetic_text, ByteTokenizer};
use crate::config::{DataConfig, DataKind};
use crate::model::ModelConfig;
use crate::rng::hash_words;

/// What a bad data file gets: the path, what is wrong, and what to do.
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
    #[error("data file {path} holds token {token} at position {position}, outside model.vocab_size = {vocab}; set model.vocab_size to at least {}", token + 1)]
    TokenOutOfRange { path: PathBuf, token: u16, position: usize, vocab: usize },
}

/// A token stream.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Arc<[u16]>,
    /// Where it came from, for messages and manifests.
    pub origin: String,
}

impl Corpus {
    pub fn from_tokens(tokens: Vec<u16>, origin: impl Into<String>) -> Self {
        Self { tokens: tokens.into(), origin: origin.into() }
    }

    pub fn tokens(&self) -> &[u16] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Identifies the content, so a resume can refuse a checkpoint trained on other data.
    pub fn fingerprint(&self) -> u64 {
        let words: Vec<u64> =
            self.tokens.chunks(4).map(|c| c.iter().fold(0u64, |acc, &t| (acc << 16) | u64::from(t))).collect();
        hash_words(&[hash_words(&words), self.tokens.len() as u64])
    }
}

/// Loads the corpus `data` describes and checks it fits `model`.
pub fn load_corpus(data: &DataConfig, model: &ModelConfig) -> Result<Corpus, DataError> {
    let needed = model.context + 1;
    match data.kind {
        DataKind::Synthetic => {
            let text = synthetic_text(data.synthetic_bytes, data.synthetic_seed);
            Ok(Corpus::from_tokens(ByteTokenizer.encode(&text), format!("synthetic:{}", data.synthetic_seed)))
        }
        DataKind::Text | DataKind::Bin => {
            let path = data.path.as_deref().expect("validated: data.path is set for files");
            let bytes =
                std::fs::read(path).map_err(|source| DataError::Unreadable { path: path.to_owned(), source })?;
            let tokens =
                if data.kind == DataKind::Text { ByteTokenizer.encode(&bytes) } else { decode_bin(path, &bytes)? };
            check_tokens(path, &tokens, model.vocab_size, needed)?;
            Ok(Corpus::from_tokens(tokens, path.display().to_string()))
        }
    }
}

fn decode_bin(path: &Path, bytes: &[u8]) -> Result<Vec<u16>, DataError> {
    if !bytes.len().is_multiple_of(2) {
        return Err(DataError::OddLength { path: path.to_owned(), bytes: bytes.len() });
    }
    Ok(bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
}

fn check_tokens(path: &Path, tokens: &[u16], vocab: usize, needed: usize) -> Result<(), DataError> {
    if tokens.is_empty() {
        return Err(DataError::Empty { path: path.to_owned(), needed });
    }
    if tokens.len() < needed {
        return Err(DataError::TooShort { path: path.to_owned(), tokens: tokens.len(), needed });
    }
    if let Some((position, &token)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(DataError::TokenOutOfRange { path: path.to_owned(), token, position, vocab });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: DataKind, path: &Path) -> DataConfig {
        DataConfig { kind, path: Some(path.to_owned()), ..DataConfig::default() }
    }

    fn error(kind: DataKind, contents: Option<&[u8]>) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        if let Some(contents) = contents {
            std::fs::write(&path, contents).unwrap();
        }
        load_corpus(&config(kind, &path), &ModelConfig::gpt_tiny()).unwrap_err().to_string()
    }

    #[test]
    #[allow(clippy::type_complexity)]
    fn file_errors_name_the_file_and_the_fix() {
        let cases: Vec<(DataKind, Option<Vec<u8>>, &[&str])> = vec![
            (DataKind::Text, None, &["data.bin", "cannot read", "data.path"]),
            (DataKind::Text, Some(vec![]), &["data.bin", "is empty"]),
            (DataKind::Text, Some(vec![b'a'; 100]), &["holds 100 tokens", "model.context + 1 = 129"]),
            (DataKind::Bin, Some(vec![0; 301]), &["301 bytes", "uint16"]),
            (
                DataKind::Bin,
                Some([300u16; 200].iter().flat_map(|t| t.to_le_bytes()).collect()),
                &["token 300", "vocab_size to at least 301"],
            ),
        ];
        for (kind, contents, needles) in cases {
            let message = error(kind, contents.as_deref());
            for needle in needles {
                assert!(message.contains(needle), "{message:?} lacks {needle:?}");
            }
        }
    }

    #[test]
    fn loads_text_and_bin() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.txt");
        std::fs::write(&text, vec![b'x'; 200]).unwrap();
        let corpus = load_corpus(&config(DataKind::Text, &text), &ModelConfig::gpt_tiny()).unwrap();
        assert_eq!(corpus.len(), 200);
        let bin = dir.path().join("t.bin");
        let tokens: Vec<u16> = (0..300).map(|i| (i % 256) as u16).collect();
        std::fs::write(&bin, tokens.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let corpus = load_corpus(&config(DataKind::Bin, &bin), &ModelConfig::gpt_tiny()).unwrap();
        assert_eq!(corpus.tokens(), tokens.as_slice());
    }
}

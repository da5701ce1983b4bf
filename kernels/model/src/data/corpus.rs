//! Corpora: a token stream loaded once and shared (read-only) by every sampler.

use std::path::Path;

use super::documents::{encode_documents, DocumentFormat, Encoder};
use super::ids::{Ids, IdsBuilder};
use super::token_file::read_token_file;
use super::{synthetic_text, ByteTokenizer, DataError};
use crate::config::{DataConfig, DataKind};
use crate::model::ModelConfig;

/// A token stream.
#[derive(Clone, Debug)]
pub struct Corpus {
    ids: Ids,
    /// Where it came from, for messages and manifests.
    pub origin: String,
}

impl Corpus {
    pub fn from_tokens(tokens: Vec<u16>, origin: impl Into<String>) -> Self {
        Self { ids: Ids::U16(tokens.into()), origin: origin.into() }
    }

    /// A stream of any ids; held in 16 bits each while every id fits.
    pub fn from_ids(ids: Vec<u32>, origin: impl Into<String>) -> Self {
        Self { ids: Ids::from_u32(ids), origin: origin.into() }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.len() == 0
    }

    /// The id at `position`.
    pub fn token(&self, position: usize) -> u32 {
        self.ids.get(position)
    }

    /// Every id, widened (for tests and small corpora).
    pub fn to_ids(&self) -> Vec<u32> {
        (0..self.len()).map(|i| self.ids.get(i)).collect()
    }

    /// Appends the ids of `range` to `out` as libtorch's int64, what a batch tensor is made from.
    pub fn extend_i64(&self, range: std::ops::Range<usize>, out: &mut Vec<i64>) {
        self.ids.extend_i64(range, out);
    }

    /// The first id outside a vocabulary of `vocab`, with its position.
    pub fn first_outside(&self, vocab: usize) -> Option<(usize, u32)> {
        self.ids.first_at_least(vocab)
    }

    /// Identifies the content, so a resume can refuse a checkpoint trained on other data.
    pub fn fingerprint(&self) -> u64 {
        self.ids.fingerprint()
    }
}

/// Loads the corpus `data` describes and checks it fits `model`.
///
/// `text` without a tokenizer is the file's bytes; with one (and `jsonl` either way) the documents'
/// ids, each document followed by the tokenizer's end-of-document token (see `documents.rs`); `bin` is a
/// token file, troupe's (with a header) or nanoGPT's (uint16, no header; see `token_file.rs`).
pub fn load_corpus(data: &DataConfig, model: &ModelConfig) -> Result<Corpus, DataError> {
    let needed = model.context + 1;
    let path = match data.kind {
        DataKind::Synthetic => {
            let text = synthetic_text(data.synthetic_bytes, data.synthetic_seed);
            return Ok(Corpus::from_tokens(ByteTokenizer.encode(&text), format!("synthetic:{}", data.synthetic_seed)));
        }
        DataKind::Text | DataKind::Jsonl | DataKind::Bin => {
            data.path.as_deref().expect("validated: data.path is set for files")
        }
    };
    let unreadable = |source| DataError::Unreadable { path: path.to_owned(), source };
    let (ids, origin) = match data.kind {
        DataKind::Bin => {
            let file = read_token_file(path, &std::fs::read(path).map_err(unreadable)?)?;
            if let Some(vocab) = file.header.map(|h| h.vocab_size as usize).filter(|&v| v > model.vocab_size) {
                return Err(DataError::FileVocabTooLarge {
                    path: path.to_owned(),
                    vocab,
                    model_vocab: model.vocab_size,
                });
            }
            (file.ids, path.display().to_string())
        }
        _ => {
            let encoder = Encoder::load(data.tokenizer.as_deref())?;
            if let Encoder::Tokenizer(tokenizer) = &encoder {
                if tokenizer.vocab_size() > model.vocab_size {
                    return Err(DataError::TokenizerVocabTooLarge {
                        path: tokenizer.path().to_owned(),
                        vocab: tokenizer.vocab_size(),
                        model_vocab: model.vocab_size,
                    });
                }
            }
            let format = if data.kind == DataKind::Jsonl { DocumentFormat::Jsonl } else { DocumentFormat::Text };
            let mut ids = IdsBuilder::default();
            let input = std::fs::File::open(path).map_err(unreadable)?;
            let mut sink = |chunk: &[u32]| {
                ids.extend(chunk);
                Ok(())
            };
            encode_documents(&encoder, format, path, input, &mut sink, &mut |_| {})?;
            let origin = match &data.tokenizer {
                Some(tokenizer) => format!("{} (tokenizer {})", path.display(), tokenizer.display()),
                None => path.display().to_string(),
            };
            (ids.finish(), origin)
        }
    };
    let corpus = Corpus { ids, origin };
    check_tokens(path, &corpus, model.vocab_size, needed)?;
    Ok(corpus)
}

fn check_tokens(path: &Path, corpus: &Corpus, vocab: usize, needed: usize) -> Result<(), DataError> {
    if corpus.is_empty() {
        return Err(DataError::Empty { path: path.to_owned(), needed });
    }
    if corpus.len() < needed {
        return Err(DataError::TooShort { path: path.to_owned(), tokens: corpus.len(), needed });
    }
    if let Some((position, token)) = corpus.first_outside(vocab) {
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
        assert_eq!(corpus.to_ids(), tokens.iter().map(|&t| u32::from(t)).collect::<Vec<_>>());
    }
}

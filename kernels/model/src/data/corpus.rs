//! Corpora: a token stream loaded once and shared (read-only) by every sampler.

use std::path::Path;

use super::documents::{encode_documents, DocumentFormat, Encoder};
use super::ids::{Ids, IdsBuilder};
use super::token_file::read_token_file;
use super::validation::split_tail;
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

    /// Positions `range` as a corpus of their own (copied), named after this one.
    pub fn slice(&self, range: std::ops::Range<usize>, origin: impl Into<String>) -> Self {
        Self { ids: self.ids.slice(range), origin: origin.into() }
    }

    /// Identifies the content, so a resume can refuse a checkpoint trained on other data.
    pub fn fingerprint(&self) -> u64 {
        self.ids.fingerprint()
    }
}

/// Loads the training corpus `data` describes and checks it fits `model`: the whole corpus, or with
/// `data.val_fraction` its head (the tail is held out; [`load_corpora`] gives both).
///
/// `text` without a tokenizer is the file's bytes; with one (and `jsonl` either way) the documents'
/// ids, each document followed by the tokenizer's end-of-document token (see `documents.rs`); `bin` is a
/// token file, troupe's (with a header) or nanoGPT's (uint16, no header; see `token_file.rs`).
pub fn load_corpus(data: &DataConfig, model: &ModelConfig) -> Result<Corpus, DataError> {
    let corpus = read_corpus(data, data.path.as_deref(), model)?;
    if data.val_fraction > 0.0 {
        return Ok(split_tail(corpus, data.val_fraction, model.context + 1)?.0);
    }
    Ok(corpus)
}

/// The training corpus and the validation corpus, if the job holds one: the corpus' head and tail with
/// `data.val_fraction` (contiguous, never overlapping), or the whole corpus and the file
/// `data.val_path` (of the same kind, through the same tokenizer). Each part holds at least one window
/// (`model.context + 1` tokens), else the error names the key and the size needed.
pub fn load_corpora(data: &DataConfig, model: &ModelConfig) -> Result<(Corpus, Option<Corpus>), DataError> {
    let corpus = read_corpus(data, data.path.as_deref(), model)?;
    if data.val_fraction > 0.0 {
        let (train, val) = split_tail(corpus, data.val_fraction, model.context + 1)?;
        return Ok((train, Some(val)));
    }
    let Some(path) = &data.val_path else { return Ok((corpus, None)) };
    let val = read_corpus(data, Some(path), model).map_err(|e| match e {
        DataError::Unreadable { source, .. } => DataError::ValUnreadable { path: path.clone(), source },
        DataError::Empty { needed, .. } => DataError::ValFileTooShort { path: path.clone(), tokens: 0, needed },
        DataError::TooShort { tokens, needed, .. } => DataError::ValFileTooShort { path: path.clone(), tokens, needed },
        other => other,
    })?;
    Ok((corpus, Some(val)))
}

/// The corpus of `data`'s kind from `path` (None for the synthetic corpus), checked against `model`.
fn read_corpus(data: &DataConfig, path: Option<&Path>, model: &ModelConfig) -> Result<Corpus, DataError> {
    let needed = model.context + 1;
    let path = match data.kind {
        DataKind::Synthetic => {
            let text = synthetic_text(data.synthetic_bytes, data.synthetic_seed);
            return Ok(Corpus::from_tokens(ByteTokenizer.encode(&text), format!("synthetic:{}", data.synthetic_seed)));
        }
        DataKind::Text | DataKind::Jsonl | DataKind::Bin => path.expect("validated: data.path is set for files"),
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
    use crate::data::{EvalWindows, GlobalSampler};

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

    /// A bin corpus whose token at position p is p: a window's tokens say where it was read.
    fn positional(dir: &Path, tokens: u16) -> (DataConfig, ModelConfig) {
        let path = dir.join("positions.bin");
        std::fs::write(&path, (0..tokens).flat_map(u16::to_le_bytes).collect::<Vec<u8>>()).unwrap();
        let model = ModelConfig { vocab_size: tokens as usize, context: 16, ..ModelConfig::gpt_tiny() };
        (config(DataKind::Bin, &path), model)
    }

    #[test]
    fn training_windows_come_from_the_head_and_validation_windows_from_the_tail() {
        let dir = tempfile::tempdir().unwrap();
        let (mut data, model) = positional(dir.path(), 2000);
        data.val_fraction = 0.25;
        let (train, val) = load_corpora(&data, &model).unwrap();
        let val = val.expect("held out");
        assert_eq!((train.len(), val.len()), (1500, 500));
        assert_eq!(load_corpus(&data, &model).unwrap().to_ids(), train.to_ids(), "the trainer's corpus is the head");
        let sampler = GlobalSampler::new(7, train, model.context);
        let mut seen = Vec::new();
        for step in 0..300 {
            let (inputs, targets) = sampler.batch(step, 0..8);
            seen.extend(Vec::<i64>::try_from(inputs.flatten(0, 1)).unwrap());
            seen.extend(Vec::<i64>::try_from(targets.flatten(0, 1)).unwrap());
        }
        assert!(seen.iter().all(|&p| p < 1500), "a training window read a held-out position");
        assert!(seen.contains(&1499), "the head's last token trains");
        let windows = EvalWindows::new(val, model.context, 0);
        let (inputs, targets) = windows.batch(0..windows.len());
        let read: Vec<i64> =
            [inputs, targets].iter().flat_map(|t| Vec::<i64>::try_from(t.flatten(0, 1)).unwrap()).collect();
        assert!(read.iter().all(|&p| (1500..2000).contains(&p)), "a validation window read a training position");
        assert_eq!(windows.len(), 31, "(500 - 1) / 16");
    }

    /// Without val_fraction or val_path the corpus is the whole stream, as before the keys existed: the
    /// same ids, fingerprint (what checkpoints record) and samples.
    #[test]
    fn without_held_out_data_the_corpus_and_its_samples_are_unchanged() {
        let data = DataConfig::default();
        let model = ModelConfig::gpt_tiny();
        let (corpus, val) = load_corpora(&data, &model).unwrap();
        assert!(val.is_none());
        let whole = synthetic_text(data.synthetic_bytes, data.synthetic_seed);
        let raw = Corpus::from_tokens(ByteTokenizer.encode(&whole), "raw");
        assert_eq!(corpus.len(), raw.len());
        assert_eq!(corpus.fingerprint(), raw.fingerprint());
        let (a, b) = (GlobalSampler::new(1, corpus, 128), GlobalSampler::new(1, raw, 128));
        assert_eq!(a.starts(5, 0..8), b.starts(5, 0..8));
    }

    #[test]
    fn a_validation_file_of_the_same_kind_is_read_and_its_errors_name_data_val_path() {
        let dir = tempfile::tempdir().unwrap();
        let (mut data, model) = positional(dir.path(), 400);
        let val = dir.path().join("val.bin");
        std::fs::write(&val, [7u16; 40].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        data.val_path = Some(val.clone());
        let (train, held) = load_corpora(&data, &model).unwrap();
        assert_eq!((train.len(), held.unwrap().to_ids()), (400, vec![7; 40]));
        std::fs::write(&val, [7u16; 10].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let short = load_corpora(&data, &model).unwrap_err().to_string();
        for needle in ["val.bin", "data.val_path", "holds 10 tokens", "model.context + 1 = 17"] {
            assert!(short.contains(needle), "{short:?} lacks {needle:?}");
        }
        data.val_path = Some(dir.path().join("missing.bin"));
        let missing = load_corpora(&data, &model).unwrap_err().to_string();
        assert!(missing.contains("missing.bin") && missing.contains("check data.val_path"), "{missing}");
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

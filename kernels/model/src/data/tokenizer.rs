//! Hugging Face tokenizers: a `tokenizer.json` loaded through the `tokenizers` crate (Hugging Face's own
//! implementation, so the ids are the Python library's), and the token that ends a document.

use std::fmt;
use std::path::{Path, PathBuf};

use super::DataError;

/// Special tokens that end a document, as the families spell them: GPT-2, Qwen2, SmolLM (`<|endoftext|>`),
/// Llama 2 and Mistral (`</s>`), Llama 3 (`<|end_of_text|>`), Gemma (`<eos>`).
const EOS_SPELLINGS: &[&str] = &["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"];

/// A `tokenizer.json`, ready to encode.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
    eos: Option<u32>,
}

impl fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads `path`. Padding and truncation settings in the file are dropped: a document is encoded whole.
    /// The end-of-document token is `eos_token` of a `tokenizer_config.json` beside the file if there is
    /// one, else the first special token spelled as one of [`EOS_SPELLINGS`], else none.
    pub fn from_file(path: &Path) -> Result<Self, DataError> {
        let error = |message: String| DataError::Tokenizer { path: path.to_owned(), message };
        let bytes = std::fs::read(path).map_err(|e| error(format!("cannot read it: {e}")))?;
        let mut inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| error(e.to_string()))?;
        inner.with_truncation(None).map_err(|e| error(e.to_string()))?;
        inner.with_padding(None);
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        if vocab_size == 0 {
            return Err(error("its vocabulary is empty".into()));
        }
        let eos = match configured_eos(&inner, path)? {
            Some(id) => Some(id),
            None => spelled_eos(&inner),
        };
        Ok(Self { inner, path: path.to_owned(), vocab_size, eos })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One more than the largest id, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The token appended after each document, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The ids of `text` with no special tokens added (no BOS, no template): what the Python library's
    /// `tokenizer.encode(text, add_special_tokens=False).ids` gives.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let encoding = self.inner.encode_fast(text, false).map_err(|e| e.to_string())?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out (what the Python library's
    /// `tokenizer.decode(ids, skip_special_tokens=True)` gives).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner.decode(ids, true).map_err(|e| e.to_string())
    }

    /// [`encode`](Self::encode) of each text, on several threads (`TOKENIZERS_PARALLELISM=false` keeps it
    /// to one).
    pub fn encode_batch(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>, String> {
        let encodings = self.inner.encode_batch_fast(texts, false).map_err(|e| e.to_string())?;
        Ok(encodings.iter().map(|e| e.get_ids().to_vec()).collect())
    }
}

/// `eos_token` of the `tokenizer_config.json` beside `path`, if both exist.
fn configured_eos(tokenizer: &tokenizers::Tokenizer, path: &Path) -> Result<Option<u32>, DataError> {
    let config_path = path.with_file_name("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&config_path) else {
        return Ok(None);
    };
    let error = |message: String| DataError::TokenizerConfig { path: config_path.clone(), message };
    let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| error(format!("not JSON: {e}")))?;
    let eos = match &config["eos_token"] {
        serde_json::Value::Null => return Ok(None),
        serde_json::Value::String(content) => content.as_str(),
        serde_json::Value::Object(token) => match token.get("content") {
            Some(serde_json::Value::String(content)) => content.as_str(),
            _ => return Err(error("eos_token is an object without a string \"content\"".into())),
        },
        other => return Err(error(format!("eos_token is {other}, not a string"))),
    };
    match tokenizer.token_to_id(eos) {
        Some(id) => Ok(Some(id)),
        None => Err(error(format!("eos_token {eos:?} is not a token of {}", path.display()))),
    }
}

/// The first special token spelled as an end of document; the lowest id among several of one spelling.
fn spelled_eos(tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
    let added = tokenizer.get_added_tokens_decoder();
    EOS_SPELLINGS.iter().find_map(|spelling| {
        added.iter().filter(|(_, token)| token.special && token.content == *spelling).map(|(&id, _)| id).min()
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A word-level tokenizer.json: `words` get ids 0.., split on whitespace; `specials` are added special
    /// tokens after them.
    pub(crate) fn word_level_json(words: &[&str], specials: &[&str]) -> String {
        let vocab: serde_json::Map<String, serde_json::Value> =
            words.iter().enumerate().map(|(i, w)| (w.to_string(), i.into())).collect();
        let added: Vec<serde_json::Value> = specials
            .iter()
            .enumerate()
            .map(|(i, s)| {
                serde_json::json!({"id": words.len() + i, "content": s, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": words[0]}
        })
        .to_string()
    }

    fn load(dir: &Path, json: &str) -> Result<HfTokenizer, DataError> {
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        HfTokenizer::from_file(&path)
    }

    #[test]
    fn encodes_and_finds_the_end_of_document_token() {
        let dir = tempfile::tempdir().unwrap();
        let tokenizer = load(dir.path(), &word_level_json(&["<unk>", "a", "b"], &["<pad>", "</s>"])).unwrap();
        assert_eq!(tokenizer.vocab_size(), 5);
        assert_eq!(tokenizer.eos(), Some(4));
        assert_eq!(tokenizer.encode("a b zzz a").unwrap(), [1, 2, 0, 1]);
        assert_eq!(tokenizer.encode_batch(vec!["b".into(), "a a".into()]).unwrap(), [vec![2], vec![1, 1]]);
        let none = load(dir.path(), &word_level_json(&["<unk>", "a"], &["<pad>"])).unwrap();
        assert_eq!(none.eos(), None);
    }

    #[test]
    fn tokenizer_config_names_the_end_of_document_token() {
        let dir = tempfile::tempdir().unwrap();
        let json = word_level_json(&["<unk>", "a"], &["<|endoftext|>", "<|im_end|>"]);
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": {"content": "<|im_end|>"}}"#)
            .unwrap();
        assert_eq!(load(dir.path(), &json).unwrap().eos(), Some(3));
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"eos_token": "<nope>"}"#).unwrap();
        let message = load(dir.path(), &json).unwrap_err().to_string();
        assert!(
            message.contains("tokenizer_config.json") && message.contains("\"<nope>\" is not a token"),
            "{message}"
        );
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"bos_token": "<unk>"}"#).unwrap();
        assert_eq!(load(dir.path(), &json).unwrap().eos(), Some(2));
    }

    #[test]
    fn a_file_that_does_not_parse_is_named() {
        let dir = tempfile::tempdir().unwrap();
        for (json, needle) in [("{\"version\": \"1.0\"", "EOF"), ("tokens", "expected"), ("{\"model\": 3}", "line 1")] {
            let message = load(dir.path(), json).unwrap_err().to_string();
            assert!(message.contains("tokenizer.json") && message.contains("cannot load it"), "{message}");
            assert!(message.contains(needle), "{message:?} lacks {needle:?}");
        }
        let message = HfTokenizer::from_file(&dir.path().join("missing.json")).unwrap_err().to_string();
        assert!(message.contains("missing.json") && message.contains("cannot read it"), "{message}");
    }
}

//! Documents to token ids: what `load_corpus` runs for `kind = "text"` and `"jsonl"` and what `troupe data
//! prepare` runs, so that a prepared token file holds exactly the stream the text gives.
//!
//! A text file is one document; a `.jsonl` file holds one document per line, a JSON object whose string
//! field `text` is the document (other fields are ignored, blank lines skipped). Each document's ids are
//! followed by the tokenizer's end-of-document token when it has one ([`HfTokenizer::eos`]); the byte
//! tokenizer has none, so its documents follow one another directly. A document with empty text adds
//! nothing.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::{ByteTokenizer, DataError, HfTokenizer};

/// Documents of one jsonl batch handed to the tokenizer together (it encodes them on several threads).
const BATCH_DOCUMENTS_MAX: usize = 256;
/// Text bytes of one jsonl batch.
const BATCH_BYTES_MAX: usize = 4 << 20;

/// How a file holds its documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DocumentFormat {
    /// The whole file is one document.
    Text,
    /// One JSON object per line; its `text` is a document.
    Jsonl,
}

impl DocumentFormat {
    /// `.jsonl` (or `.ndjson`) files are jsonl, any other file text.
    pub fn of_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some("jsonl" | "ndjson") => DocumentFormat::Jsonl,
            _ => DocumentFormat::Text,
        }
    }
}

/// What turns a document into ids.
#[derive(Debug)]
pub enum Encoder {
    /// One token per byte (vocabulary 256, no end-of-document token).
    Bytes,
    Tokenizer(Box<HfTokenizer>),
}

impl Encoder {
    /// The tokenizer at `tokenizer`, else bytes.
    pub fn load(tokenizer: Option<&Path>) -> Result<Self, DataError> {
        Ok(match tokenizer {
            Some(path) => Encoder::Tokenizer(Box::new(HfTokenizer::from_file(path)?)),
            None => Encoder::Bytes,
        })
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Encoder::Bytes => ByteTokenizer::VOCAB,
            Encoder::Tokenizer(tokenizer) => tokenizer.vocab_size(),
        }
    }

    pub fn eos(&self) -> Option<u32> {
        match self {
            Encoder::Bytes => None,
            Encoder::Tokenizer(tokenizer) => tokenizer.eos(),
        }
    }

    /// Hands `sink` the ids of each document of `text`, then the end-of-document token.
    fn encode_all(&self, path: &Path, texts: Vec<String>, sink: &mut Sink<'_>) -> Result<(), DataError> {
        match self {
            Encoder::Bytes => texts.iter().try_for_each(|text| sink(&bytes_to_ids(text.as_bytes()))),
            Encoder::Tokenizer(tokenizer) => {
                let encodings =
                    tokenizer.encode_batch(texts).map_err(|message| encode_error(tokenizer, path, message))?;
                encodings.iter().try_for_each(|ids| self.emit(ids, sink))
            }
        }
    }

    fn emit(&self, ids: &[u32], sink: &mut Sink<'_>) -> Result<(), DataError> {
        sink(ids)?;
        match self.eos() {
            Some(eos) => sink(&[eos]),
            None => Ok(()),
        }
    }
}

/// Where the ids go, in order.
pub type Sink<'a> = dyn FnMut(&[u32]) -> Result<(), DataError> + 'a;

/// Encodes the documents of `input` (the file at `path`, for messages) into `sink`, calling `progress` with
/// the bytes of `input` consumed so far; returns the number of documents.
pub fn encode_documents(
    encoder: &Encoder,
    format: DocumentFormat,
    path: &Path,
    input: impl Read,
    sink: &mut Sink<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, DataError> {
    match format {
        DocumentFormat::Text => encode_text(encoder, path, input, sink, progress),
        DocumentFormat::Jsonl => encode_jsonl(encoder, path, input, sink, progress),
    }
}

fn encode_text(
    encoder: &Encoder,
    path: &Path,
    mut input: impl Read,
    sink: &mut Sink<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, DataError> {
    let mut bytes = Vec::new();
    input.read_to_end(&mut bytes).map_err(|source| DataError::Unreadable { path: path.to_owned(), source })?;
    progress(bytes.len() as u64);
    if bytes.is_empty() {
        return Ok(0);
    }
    match encoder {
        // Raw bytes, UTF-8 or not.
        Encoder::Bytes => sink(&bytes_to_ids(&bytes))?,
        Encoder::Tokenizer(tokenizer) => {
            let text = std::str::from_utf8(&bytes)
                .map_err(|e| DataError::NotUtf8 { path: path.to_owned(), offset: e.valid_up_to() })?;
            let ids = tokenizer.encode(text).map_err(|message| encode_error(tokenizer, path, message))?;
            encoder.emit(&ids, sink)?;
        }
    }
    Ok(1)
}

fn encode_jsonl(
    encoder: &Encoder,
    path: &Path,
    input: impl Read,
    sink: &mut Sink<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, DataError> {
    let mut reader = BufReader::with_capacity(1 << 20, input);
    let (mut line, mut number, mut consumed, mut documents) = (Vec::new(), 0, 0u64, 0u64);
    let (mut batch, mut batch_bytes) = (Vec::new(), 0);
    loop {
        line.clear();
        let read = reader
            .read_until(b'\n', &mut line)
            .map_err(|source| DataError::Unreadable { path: path.to_owned(), source })?;
        if read > 0 {
            number += 1;
            consumed += read as u64;
            if let Some(text) = jsonl_text(path, number, &line)? {
                batch_bytes += text.len();
                batch.push(text);
            }
        }
        if !batch.is_empty() && (read == 0 || batch.len() >= BATCH_DOCUMENTS_MAX || batch_bytes >= BATCH_BYTES_MAX) {
            documents += batch.len() as u64;
            encoder.encode_all(path, std::mem::take(&mut batch), sink)?;
            batch_bytes = 0;
            progress(consumed);
        }
        if read == 0 {
            progress(consumed);
            return Ok(documents);
        }
    }
}

/// The document of line `number` (1-based) of a jsonl file; `None` for a blank line or empty text.
fn jsonl_text(path: &Path, number: usize, line: &[u8]) -> Result<Option<String>, DataError> {
    let error = |message: String| DataError::JsonlLine { path: path.to_owned(), line: number, message };
    let mut line = line.strip_suffix(b"\n").unwrap_or(line);
    line = line.strip_suffix(b"\r").unwrap_or(line);
    if number == 1 {
        line = line.strip_prefix("\u{feff}".as_bytes()).unwrap_or(line);
    }
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_slice(line).map_err(|e| {
        let message = e.to_string();
        let message = message.rsplit_once(" at line ").map_or(message.as_str(), |(what, _)| what);
        error(format!("not JSON ({message}, at column {})", e.column()))
    })?;
    let serde_json::Value::Object(mut object) = value else {
        return Err(error(format!("{} is not a JSON object", json_kind(&value))));
    };
    match object.remove("text") {
        Some(serde_json::Value::String(text)) => Ok((!text.is_empty()).then_some(text)),
        Some(other) => Err(error(format!("\"text\" is {}, not a string", json_kind(&other)))),
        None => {
            let keys: Vec<&str> = object.keys().map(String::as_str).collect();
            Err(error(format!("the object has no \"text\" field (its fields: {})", keys.join(", "))))
        }
    }
}

fn json_kind(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn bytes_to_ids(bytes: &[u8]) -> Vec<u32> {
    ByteTokenizer.encode(bytes).into_iter().map(u32::from).collect()
}

fn encode_error(tokenizer: &HfTokenizer, path: &Path, message: String) -> DataError {
    DataError::Encode { path: path.to_owned(), tokenizer: tokenizer.path().to_owned(), message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer::tests::word_level_json;

    fn encode(encoder: &Encoder, format: DocumentFormat, input: &str) -> Result<(Vec<u32>, u64), DataError> {
        let mut ids = Vec::new();
        let mut progress = Vec::new();
        let documents = encode_documents(
            encoder,
            format,
            Path::new("in.jsonl"),
            input.as_bytes(),
            &mut |chunk| {
                ids.extend_from_slice(chunk);
                Ok(())
            },
            &mut |done| progress.push(done),
        )?;
        assert_eq!(progress.last(), Some(&(input.len() as u64)), "progress ends at the input's size");
        Ok((ids, documents))
    }

    fn word_level(dir: &Path, specials: &[&str]) -> Encoder {
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, word_level_json(&["<unk>", "a", "b", "c"], specials)).unwrap();
        Encoder::load(Some(&path)).unwrap()
    }

    #[test]
    fn documents_are_separated_by_the_end_of_document_token() {
        let dir = tempfile::tempdir().unwrap();
        let encoder = word_level(dir.path(), &["</s>"]);
        let jsonl = "{\"text\": \"a b\", \"id\": 1}\n\n{\"text\": \"\"}\r\n{\"text\": \"c a\"}";
        assert_eq!(encode(&encoder, DocumentFormat::Jsonl, jsonl).unwrap(), (vec![1, 2, 4, 3, 1, 4], 2));
        assert_eq!(encode(&encoder, DocumentFormat::Text, "a b\nc").unwrap(), (vec![1, 2, 3, 4], 1));
        assert_eq!(encode(&encoder, DocumentFormat::Text, "").unwrap(), (vec![], 0));
        let no_eos = word_level(dir.path(), &[]);
        assert_eq!(encode(&no_eos, DocumentFormat::Jsonl, jsonl).unwrap(), (vec![1, 2, 3, 1], 2));
        let bytes = encode(&Encoder::Bytes, DocumentFormat::Jsonl, "{\"text\":\"hé\"}\n{\"text\":\"!\"}\n").unwrap();
        assert_eq!(bytes, (vec![b'h'.into(), 0xc3, 0xa9, b'!'.into()], 2));
    }

    #[test]
    fn batches_keep_the_documents_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let encoder = word_level(dir.path(), &["</s>"]);
        let words = ["a", "b", "c"];
        let jsonl: String = (0..1000).map(|i| format!("{{\"text\": \"{}\"}}\n", words[i % 3])).collect();
        let (ids, documents) = encode(&encoder, DocumentFormat::Jsonl, &jsonl).unwrap();
        assert_eq!(documents, 1000);
        let expected: Vec<u32> = (0..1000).flat_map(|i| [1 + (i % 3) as u32, 4]).collect();
        assert_eq!(ids, expected);
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let encoder = word_level(dir.path(), &[]);
        let cases = [
            ("{\"text\": \"a\"}\n{\"text\": \"a\"\n", "line 2: not JSON (EOF while parsing an object, at column 12)"),
            ("[1, 2]\n", "line 1: an array is not a JSON object"),
            ("{\"body\": \"a\", \"id\": 3}\n", "line 1: the object has no \"text\" field (its fields: body, id)"),
            ("\n\n{\"text\": 7}\n", "line 3: \"text\" is a number, not a string"),
        ];
        for (input, needle) in cases {
            let message = encode(&encoder, DocumentFormat::Jsonl, input).unwrap_err().to_string();
            assert!(message.contains("in.jsonl") && message.contains(needle), "{message:?} lacks {needle:?}");
        }
        let message = encode_documents(
            &encoder,
            DocumentFormat::Text,
            Path::new("x.txt"),
            &[b'a', 0xff][..],
            &mut |_| Ok(()),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(message.contains("x.txt is not UTF-8") && message.contains("at byte 1"), "{message}");
    }

    #[test]
    fn formats_follow_the_extension() {
        assert_eq!(DocumentFormat::of_path(Path::new("a/b.jsonl")), DocumentFormat::Jsonl);
        assert_eq!(DocumentFormat::of_path(Path::new("b.ndjson")), DocumentFormat::Jsonl);
        assert_eq!(DocumentFormat::of_path(Path::new("b.txt")), DocumentFormat::Text);
        assert_eq!(DocumentFormat::of_path(Path::new("README")), DocumentFormat::Text);
    }
}

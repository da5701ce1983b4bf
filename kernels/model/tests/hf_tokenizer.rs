//! Hugging Face tokenizers in the data pipeline, against Hugging Face's Python `tokenizers` (the oracle,
//! pinned in the venv; kernels/model/tests/data/tokenizers_oracle.py): BPE tokenizers it trains on a
//! generated text encode that text, and text it never saw, to the same ids in troupe; a `kind = "text"`
//! corpus is the file's ids and a `kind = "jsonl"` corpus each line's, each document followed by the
//! end-of-document token; the sampler draws from them as from any corpus; a vocabulary larger than the
//! model's and a tokenizer file that does not parse are named.

use std::path::{Path, PathBuf};

use troupe_model::config::{DataConfig, DataKind};
use troupe_model::data::{load_corpus, synthetic_text, tokenizers_oracle, GlobalSampler, HfTokenizer};
use troupe_model::model::ModelConfig;

/// What byte-level and Unicode handling can trip on: accents, CJK, an emoji, NFKC's compatibility forms,
/// runs of spaces and tabs, CRLF, contractions, a special token's spelling inside text, trailing spaces.
const AWKWARD: &str = "naïve café — 東京 🙂 ½ ﬁn\n  two  spaces\t\ttabs \n\r\nwindows line\r\nit's we'll I'M\n\
                       <|endoftext|> inside </s> the text\n\n\n   trailing spaces   ";

fn oracle(args: &[&str]) -> serde_json::Value {
    tokenizers_oracle(args).unwrap_or_else(|e| panic!("{e}"))
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(value.clone()).unwrap()
}

/// Training text: the synthetic corpus with the awkward lines among it.
fn training_text(seed: u64) -> String {
    let text = String::from_utf8(synthetic_text(40_000, seed)).unwrap();
    let (head, tail) = text.split_at(20_000);
    format!("{head}{AWKWARD}{tail}{AWKWARD}")
}

/// A tokenizer of `kind` (bytelevel, metaspace) trained on [`training_text`], saved in `dir`.
fn trained(dir: &Path, kind: &str, vocab: usize) -> (PathBuf, usize) {
    let text = dir.join(format!("train-{kind}.txt"));
    std::fs::write(&text, training_text(3)).unwrap();
    let path = dir.join(format!("{kind}.json"));
    let made = oracle(&["train", text.to_str().unwrap(), path.to_str().unwrap(), &vocab.to_string(), kind]);
    (path, made["vocab_size"].as_u64().unwrap() as usize)
}

fn model(vocab_size: usize) -> ModelConfig {
    ModelConfig { vocab_size, context: 16, ..ModelConfig::gpt_tiny() }
}

fn data(kind: DataKind, path: &Path, tokenizer: Option<&Path>) -> DataConfig {
    DataConfig { kind, path: Some(path.to_owned()), tokenizer: tokenizer.map(Path::to_owned), ..DataConfig::default() }
}

#[test]
fn troupe_encodes_text_as_the_python_tokenizers_do() {
    let dir = tempfile::tempdir().unwrap();
    let unseen = dir.path().join("unseen.txt");
    // Another seed's sentences, and characters the training text never had (<unk> for metaspace).
    std::fs::write(
        &unseen,
        format!("{}Ωψ ∀x ∃y Ünïcödé {AWKWARD}", String::from_utf8(synthetic_text(5000, 99)).unwrap()),
    )
    .unwrap();
    let training = dir.path().join("train-bytelevel.txt");
    for (kind, vocab, eos) in [("bytelevel", 400, "<|endoftext|>"), ("metaspace", 300, "</s>")] {
        let (path, vocab_size) = trained(dir.path(), kind, vocab);
        let tokenizer = HfTokenizer::from_file(&path).unwrap();
        assert_eq!(tokenizer.vocab_size(), vocab_size, "{kind}");
        assert_eq!(vocab_size, vocab, "{kind}: the trainer filled the vocabulary asked for (merges to compare)");
        let eos_id = oracle(&["encode", path.to_str().unwrap(), &write(dir.path(), "eos.txt", eos)])["ids"][0].clone();
        assert_eq!(tokenizer.eos(), Some(eos_id.as_u64().unwrap() as u32), "{kind}: the end-of-document token");
        for file in [&training, &unseen] {
            let theirs = ids(&oracle(&["encode", path.to_str().unwrap(), file.to_str().unwrap()])["ids"]);
            let ours = tokenizer.encode(&std::fs::read_to_string(file).unwrap()).unwrap();
            assert!(theirs.len() > 1000, "{kind}: {} ids", theirs.len());
            assert_eq!(ours, theirs, "{kind}: {} encodes differently", file.display());
        }
    }
}

fn write(dir: &Path, name: &str, contents: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn text_and_jsonl_corpora_are_each_documents_ids_then_the_end_of_document_token() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, vocab) = trained(dir.path(), "bytelevel", 400);
    let eos = HfTokenizer::from_file(&tokenizer).unwrap().eos().unwrap();
    let model = model(vocab);

    let text = dir.path().join("train-bytelevel.txt");
    let mut expected = ids(&oracle(&["encode", tokenizer.to_str().unwrap(), text.to_str().unwrap()])["ids"]);
    expected.push(eos);
    let corpus = load_corpus(&data(DataKind::Text, &text, Some(&tokenizer)), &model).unwrap();
    assert_eq!(corpus.to_ids(), expected);
    assert!(corpus.origin.contains("bytelevel.json"), "{}", corpus.origin);

    let source = training_text(5);
    let lines: Vec<String> = source
        .lines()
        .enumerate()
        .map(|(i, line)| serde_json::json!({"id": i, "text": line, "meta": {"n": i}}).to_string())
        .collect();
    let jsonl = dir.path().join("docs.jsonl");
    std::fs::write(&jsonl, lines.join("\n") + "\n").unwrap();
    let documents: Vec<Vec<u32>> = serde_json::from_value(
        oracle(&["encode-jsonl", tokenizer.to_str().unwrap(), jsonl.to_str().unwrap()])["ids"].clone(),
    )
    .unwrap();
    assert!(documents.len() > 500);
    let expected: Vec<u32> =
        documents.iter().filter(|d| !d.is_empty()).flat_map(|d| d.iter().copied().chain([eos])).collect();
    let corpus = load_corpus(&data(DataKind::Jsonl, &jsonl, Some(&tokenizer)), &model).unwrap();
    assert_eq!(corpus.to_ids(), expected);

    // The sampler takes the ids as it takes bytes: windows of the stream, a function of (seed, step).
    let sampler = GlobalSampler::new(7, corpus.clone(), model.context);
    let (inputs, targets) = sampler.batch(3, 0..4);
    let starts = sampler.starts(3, 0..4);
    let inputs: Vec<i64> = Vec::try_from(inputs.flatten(0, 1)).unwrap();
    let targets: Vec<i64> = Vec::try_from(targets.flatten(0, 1)).unwrap();
    for (row, start) in starts.iter().enumerate() {
        let window: Vec<i64> = expected[*start..start + 17].iter().map(|&t| t.into()).collect();
        assert_eq!(&inputs[row * 16..row * 16 + 16], &window[..16]);
        assert_eq!(&targets[row * 16..row * 16 + 16], &window[1..]);
    }

    // Without a tokenizer a jsonl corpus is each text's UTF-8 bytes, one after another.
    let bytes = load_corpus(&data(DataKind::Jsonl, &jsonl, None), &self::model(256)).unwrap();
    let expected: Vec<u32> = source.lines().flat_map(|l| l.bytes().map(u32::from)).collect();
    assert_eq!(bytes.to_ids(), expected);
}

#[test]
fn a_vocabulary_larger_than_the_models_and_a_tokenizer_that_does_not_parse_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, vocab) = trained(dir.path(), "bytelevel", 400);
    let text = dir.path().join("train-bytelevel.txt");
    let error = |data: &DataConfig, model: &ModelConfig| load_corpus(data, model).unwrap_err().to_string();

    let message = error(&data(DataKind::Text, &text, Some(&tokenizer)), &model(256));
    for needle in [
        &format!("tokenizer {}", tokenizer.display()),
        &format!("vocabulary of {vocab} tokens"),
        "model.vocab_size = 256",
    ] {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }

    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{\"model\": {\"type\": \"BPE\", \"vocab\": [1, 2").unwrap();
    let message = error(&data(DataKind::Jsonl, &text, Some(&broken)), &model(vocab));
    assert!(
        message.contains("broken.json") && message.contains("cannot load it as a Hugging Face tokenizer.json"),
        "{message}"
    );
    let message = error(&data(DataKind::Text, &text, Some(&dir.path().join("absent.json"))), &model(vocab));
    assert!(message.contains("absent.json") && message.contains("cannot read it"), "{message}");

    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait, ".repeat(10)).unwrap();
    let message = error(&data(DataKind::Text, &latin1, Some(&tokenizer)), &model(vocab));
    assert!(message.contains("latin1.txt is not UTF-8") && message.contains("at byte 3"), "{message}");
}

//! `troupe data prepare` as a user runs it: a token file made once from text or jsonl gives exactly the
//! token stream, the samples and the training losses that the same text with `data.tokenizer` gives;
//! uint32 tokens above a 65,536 vocabulary; several inputs in order; and the errors, each naming the file
//! (a tokenizer that does not parse, a bad jsonl line, a vocabulary larger than the model's, a token
//! outside it). The tokenizers are made by Hugging Face's Python `tokenizers` in the venv.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use troupe_model::config::{DataConfig, DataKind};
use troupe_model::data::{load_corpus, synthetic_text, tokenizers_oracle, Corpus, GlobalSampler};
use troupe_model::model::ModelConfig;

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn stdout_of(output: &Output) -> String {
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn stderr_of_failure(output: &Output) -> String {
    assert!(!output.status.success(), "troupe succeeded: {}", String::from_utf8_lossy(&output.stdout));
    String::from_utf8(output.stderr.clone()).unwrap()
}

fn assert_names(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
}

fn oracle(args: &[&str]) -> Value {
    tokenizers_oracle(args).unwrap_or_else(|e| panic!("{e}"))
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A byte-level BPE of 400 tokens (`<|endoftext|>` among them) trained on the synthetic corpus, saved in
/// `dir`, and the text it was trained on.
fn bpe(dir: &Path) -> (PathBuf, PathBuf) {
    let text = dir.join("corpus.txt");
    std::fs::write(&text, synthetic_text(30_000, 4)).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let made = oracle(&["train", s(&text), s(&tokenizer), "400", "bytelevel"]);
    assert_eq!(made["vocab_size"], 400);
    (tokenizer, text)
}

/// The synthetic corpus's lines as documents of a jsonl file.
fn jsonl(dir: &Path, name: &str) -> PathBuf {
    let text = String::from_utf8(synthetic_text(20_000, 8)).unwrap();
    let lines: Vec<String> =
        text.lines().map(|l| serde_json::json!({ "text": l, "source": "synthetic" }).to_string()).collect();
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn prepare(args: &[&str]) -> Value {
    let mut all = vec!["data", "prepare", "--json"];
    all.extend_from_slice(args);
    serde_json::from_str(stdout_of(&troupe(&all)).trim()).unwrap()
}

fn corpus(kind: DataKind, path: &Path, tokenizer: Option<&Path>, vocab_size: usize) -> Corpus {
    let data = DataConfig {
        kind,
        path: Some(path.to_owned()),
        tokenizer: tokenizer.map(Path::to_owned),
        ..DataConfig::default()
    };
    load_corpus(&data, &ModelConfig { vocab_size, context: 16, ..ModelConfig::gpt_tiny() }).unwrap()
}

/// The same stream, fingerprint and samples (several steps of a global batch of 8).
fn assert_same_samples(a: &Corpus, b: &Corpus) {
    assert_eq!(a.to_ids(), b.to_ids());
    assert_eq!(a.fingerprint(), b.fingerprint());
    let (a, b) = (GlobalSampler::new(11, a.clone(), 16), GlobalSampler::new(11, b.clone(), 16));
    for step in [0, 1, 5, 40] {
        let ((ai, at), (bi, bt)) = (a.batch(step, 0..8), b.batch(step, 0..8));
        assert!(ai.equal(&bi) && at.equal(&bt), "step {step}");
    }
}

#[test]
fn prepare_then_bin_gives_the_samples_text_with_the_tokenizer_gives() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, text) = bpe(dir.path());
    let out = dir.path().join("tokens.bin");
    let report = prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&text)]);
    let from_text = corpus(DataKind::Text, &text, Some(&tokenizer), 400);
    assert_eq!(report["event"], "prepared");
    assert_eq!((report["tokens"].as_u64(), report["token_bytes"].as_u64()), (Some(from_text.len() as u64), Some(2)));
    assert_eq!(
        (report["vocab_size"].as_u64(), report["documents"].as_u64(), report["eos"].as_u64()),
        (Some(400), Some(1), Some(0))
    );
    let bytes = std::fs::read(&out).unwrap();
    assert!(bytes.starts_with(b"TROUPETK"), "the header's magic");
    assert_eq!(bytes.len(), 32 + 2 * from_text.len());
    assert!(!dir.path().join("tokens.bin.partial").exists());
    assert_same_samples(&corpus(DataKind::Bin, &out, None, 400), &from_text);

    // The summary a person reads.
    let summary = stdout_of(&troupe(&["data", "prepare", "--tokenizer", s(&tokenizer), "--out", s(&out), s(&text)]));
    assert_names(
        &summary,
        &[
            "tokens.bin",
            &format!("{} uint16 tokens (vocabulary 400) from 1 document in 1 file", from_text.len()),
            "end of document: id 0",
        ],
    );
}

#[test]
fn jsonl_by_extension_or_format_and_several_inputs_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, text) = bpe(dir.path());
    let docs = jsonl(dir.path(), "docs.jsonl");
    let from_jsonl = corpus(DataKind::Jsonl, &docs, Some(&tokenizer), 400);
    let out = dir.path().join("docs.bin");
    let report = prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&docs)]);
    let lines = std::fs::read_to_string(&docs).unwrap().lines().filter(|l| !l.contains("\"text\":\"\"")).count();
    assert_eq!(report["documents"].as_u64(), Some(lines as u64));
    assert_same_samples(&corpus(DataKind::Bin, &out, None, 400), &from_jsonl);

    // A jsonl file by another name, with --format.
    let renamed = dir.path().join("docs.txt");
    std::fs::copy(&docs, &renamed).unwrap();
    prepare(&["--tokenizer", s(&tokenizer), "--format", "jsonl", "--out", s(&out), s(&renamed)]);
    assert_eq!(corpus(DataKind::Bin, &out, None, 400).to_ids(), from_jsonl.to_ids());

    // Inputs follow one another: the jsonl's documents, then the text's.
    prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&docs), s(&text)]);
    let mut both = from_jsonl.to_ids();
    both.extend(corpus(DataKind::Text, &text, Some(&tokenizer), 400).to_ids());
    assert_eq!(corpus(DataKind::Bin, &out, None, 400).to_ids(), both);

    // Without a tokenizer: bytes, as `kind = "text"` reads them.
    prepare(&["--out", s(&out), s(&text)]);
    assert_same_samples(&corpus(DataKind::Bin, &out, None, 256), &corpus(DataKind::Text, &text, None, 256));
}

#[test]
fn vocabularies_above_65536_are_written_as_uint32() {
    let dir = tempfile::tempdir().unwrap();
    let tokenizer = dir.path().join("words.json");
    assert_eq!(oracle(&["wordlevel", s(&tokenizer), "70000"])["vocab_size"], 70_001);
    let words: Vec<String> = (0..3000u64).map(|i| format!("w{}", (i * 7919 + i * i) % 70_000)).collect();
    let text = dir.path().join("words.txt");
    std::fs::write(&text, words.join(" ")).unwrap();
    let out = dir.path().join("words.bin");
    let report = prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&text)]);
    assert_eq!((report["token_bytes"].as_u64(), report["tokens"].as_u64()), (Some(4), Some(3001)));
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 32 + 4 * 3001);
    let from_text = corpus(DataKind::Text, &text, Some(&tokenizer), 70_001);
    assert!(from_text.to_ids().iter().any(|&t| t > 65_535), "ids above uint16");
    assert_eq!(from_text.to_ids().last(), Some(&70_000), "the end-of-document token </s>");
    assert_same_samples(&corpus(DataKind::Bin, &out, None, 70_001), &from_text);
}

/// A job of a small model on `[data]` `data`, with the vocabulary `vocab_size`.
fn job(dir: &Path, name: &str, vocab_size: Option<usize>, data: &str) -> PathBuf {
    let vocab = vocab_size.map_or(String::new(), |v| format!("vocab_size = {v}\n"));
    let toml = format!(
        "[model]\n{vocab}n_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n[data]\n{data}"
    );
    let path = dir.join(name);
    std::fs::write(&path, toml).unwrap();
    path
}

fn losses(output: &Output) -> Vec<f64> {
    stdout_of(output)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["event"] == "step")
        .map(|e| e["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn training_on_the_prepared_file_equals_training_on_the_jsonl_with_the_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, _) = bpe(dir.path());
    let docs = jsonl(dir.path(), "docs.jsonl");
    let out = dir.path().join("docs.bin");
    prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&docs)]);
    let on_bin = job(dir.path(), "bin.toml", Some(400), &format!("kind = \"bin\"\npath = {:?}\n", s(&out)));
    let on_jsonl = job(
        dir.path(),
        "jsonl.toml",
        Some(400),
        &format!("kind = \"jsonl\"\npath = {:?}\ntokenizer = {:?}\n", s(&docs), s(&tokenizer)),
    );
    let bin = losses(&troupe(&["train", "--config", s(&on_bin), "--steps", "3", "--json"]));
    let jsonl = losses(&troupe(&["train", "--config", s(&on_jsonl), "--steps", "3", "--json"]));
    assert_eq!(bin.len(), 3);
    assert!(bin[0] > 5.0 && bin[0] < 7.0, "about ln 400 at the start: {bin:?}");
    assert_eq!(bin, jsonl, "the same tokens, the same samples, the same losses");
}

#[test]
fn errors_name_the_file_and_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, text) = bpe(dir.path());
    let out = dir.path().join("tokens.bin");
    let prepare_error = |args: &[&str]| {
        let mut all = vec!["data", "prepare", "--out", s(&out)];
        all.extend_from_slice(args);
        stderr_of_failure(&troupe(&all))
    };

    let broken = dir.path().join("broken.json");
    std::fs::write(&broken, "{\"version\": \"1.0\", \"model\": ").unwrap();
    let message = prepare_error(&["--tokenizer", s(&broken), s(&text)]);
    assert_names(&message, &["tokenizer", "broken.json", "cannot load it as a Hugging Face tokenizer.json", "EOF"]);

    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"text\": 3}\n").unwrap();
    let message = prepare_error(&["--tokenizer", s(&tokenizer), s(&bad)]);
    assert_names(&message, &["bad.jsonl, line 2", "\"text\" is a number, not a string"]);
    assert!(!out.exists() && !dir.path().join("tokens.bin.partial").exists(), "a failed prepare leaves nothing");

    let message = prepare_error(&[s(&dir.path().join("absent.txt"))]);
    assert_names(&message, &["input", "absent.txt", "cannot read it"]);
    let message = prepare_error(&["--tokenizer", s(&tokenizer)]);
    assert_names(&message, &["<INPUTS>"]);

    // Training: a vocabulary larger than the model's, from the file's header or the tokenizer; a token
    // outside the vocabulary in a headerless nanoGPT file; a tokenizer that does not parse.
    prepare(&["--tokenizer", s(&tokenizer), "--out", s(&out), s(&text)]);
    let train_error = |name: &str, vocab: Option<usize>, data: String| {
        let config = job(dir.path(), name, vocab, &data);
        stderr_of_failure(&troupe(&["train", "--config", s(&config), "--steps", "1"]))
    };
    let message = train_error("a.toml", None, format!("kind = \"bin\"\npath = {:?}\n", s(&out)));
    assert_names(&message, &["tokens.bin", "vocabulary of 400 tokens (its header says so)", "model.vocab_size = 256"]);
    let message = train_error(
        "b.toml",
        None,
        format!("kind = \"text\"\npath = {:?}\ntokenizer = {:?}\n", s(&text), s(&tokenizer)),
    );
    assert_names(
        &message,
        &["tokenizer.json has a vocabulary of 400 tokens", "model.vocab_size = 256", "at least 400"],
    );
    let nano = dir.path().join("nano.bin");
    let mut ids = [7u16; 100];
    ids[41] = 300;
    std::fs::write(&nano, ids.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let message = train_error("c.toml", None, format!("kind = \"bin\"\npath = {:?}\n", s(&nano)));
    assert_names(&message, &["nano.bin", "token 300 at position 41", "model.vocab_size = 256"]);
    let message = train_error(
        "d.toml",
        Some(400),
        format!("kind = \"jsonl\"\npath = {:?}\ntokenizer = {:?}\n", s(&bad), s(&broken)),
    );
    assert_names(&message, &["broken.json", "cannot load it"]);
    let message = train_error(
        "e.toml",
        Some(400),
        format!("kind = \"bin\"\npath = {:?}\ntokenizer = {:?}\n", s(&out), s(&tokenizer)),
    );
    assert_names(&message, &["data.tokenizer", "holds tokens already"]);
}

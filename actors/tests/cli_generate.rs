//! `troupe generate` and `troupe eval` as a user runs them: greedy decoding equals transformers'
//! `generate(do_sample=False)` token for token; a trained checkpoint streams its prompt and continuation,
//! seeded sampling repeats; eval's loss is the reference model's mean loss, the same from the checkpoint
//! and from its Hugging Face export; `bench generate --peer` decodes transformers' tokens; bad requests name
//! what is wrong.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use tch::Tensor;
use troupe_model::hf::read_config;
use troupe_model::model::{Model, ModelConfig};
use troupe_model::oracle::{transformers_oracle, venv_python};

/// A small byte-vocabulary GPT trained for a few steps, checkpointed.
const SMALL_JOB: &str = "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n";

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn succeeded(output: Output) -> Vec<u8> {
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    output.stdout
}

fn json(output: Output) -> Value {
    let stdout = String::from_utf8(succeeded(output)).unwrap();
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not one JSON object ({e}): {stdout}"))
}

fn failed(args: &[&str]) -> String {
    let output = troupe(args);
    assert!(!output.status.success(), "troupe {args:?} succeeded");
    String::from_utf8(output.stderr).unwrap()
}

fn ids(value: &Value) -> Vec<i64> {
    serde_json::from_value(value.clone()).unwrap()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The transformers oracle's tiny random models (kernels/model/tests/hf/oracle.py `make`).
fn oracle_models(dir: &Path) {
    transformers_oracle(&["make", s(dir)]).unwrap();
}

#[test]
fn greedy_generate_equals_transformers_generate() {
    let dir = tempfile::tempdir().unwrap();
    oracle_models(dir.path());
    let prompt = [3i64, 17, 42, 5, 60];
    let prompt_file = dir.path().join("prompt.safetensors");
    Tensor::write_safetensors(&[("tokens", &Tensor::from_slice(&prompt).view([1, 5]))], &prompt_file).unwrap();
    for name in ["llama_gqa", "gpt2_tied"] {
        let model = dir.path().join(name);
        let theirs = transformers_oracle(&["generate", s(&model), s(&prompt_file), "20"]).unwrap();
        let args = ["generate", "--model", s(&model), "--prompt-ids", "3,17,42,5,60", "--max-new-tokens", "20"];
        let ours = json(troupe(&[&args[..], &["--json"]].concat()));
        assert_eq!(ids(&ours["prompt_ids"]), prompt);
        assert_eq!(
            ids(&ours["tokens"]),
            ids(&theirs["tokens"])[5..],
            "{name}: greedy tokens differ from transformers'"
        );
        // Streamed: the prompt's ids, then the new ones, space-separated.
        let streamed = String::from_utf8(succeeded(troupe(&args))).unwrap();
        let all: Vec<i64> = streamed.split_whitespace().map(|t| t.parse().unwrap()).collect();
        assert_eq!(all, ids(&theirs["tokens"]), "{name}: streamed ids");
    }
    // The benchmark beside transformers' generate decodes the same tokens.
    let bench = bench_generate(&dir.path().join("llama_gqa"));
    assert_eq!(bench["arch"], "llama");
}

/// `troupe bench generate --peer` on `model` (a few tokens, one run): its report, checked.
fn bench_generate(model: &Path) -> Value {
    let args = ["--prompt-tokens", "4", "--new-tokens", "8", "--repeats", "1", "--threads", "1", "--peer", "--json"];
    let python = venv_python();
    let report =
        json(troupe(&[&["bench", "generate", "--model", s(model), "--python", s(&python)][..], &args].concat()));
    assert_eq!(report["same_tokens"], true, "troupe and transformers decode the same tokens: {report}");
    for key in ["tokens_per_s", "peer_tokens_per_s", "ratio_vs_peer"] {
        assert!(report[key].as_f64().is_some_and(|v| v > 0.0), "{key}: {report}");
    }
    report
}

/// Trains SMALL_JOB for 4 steps into `root` (a checkpoint at the end).
fn train_checkpoint(dir: &Path, root: &Path) {
    let config = dir.join("job.toml");
    std::fs::write(&config, SMALL_JOB).unwrap();
    let args = [
        "train",
        "--config",
        s(&config),
        "--steps",
        "4",
        "--json",
        "--checkpoint-dir",
        s(root),
        "--checkpoint-every",
        "4",
    ];
    succeeded(troupe(&args));
}

#[test]
fn a_checkpoint_streams_text_and_seeded_sampling_repeats() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    train_checkpoint(dir.path(), &root);
    let generate = |extra: &[&str]| {
        let args =
            [&["generate", "--model", s(&root), "--prompt", "The ", "--max-new-tokens", "20"][..], extra].concat();
        succeeded(troupe(&args))
    };
    // Text mode: the prompt, then one byte per new token, then a newline.
    let greedy = generate(&[]);
    assert_eq!(greedy.len(), 4 + 20 + 1, "{}", String::from_utf8_lossy(&greedy));
    assert!(greedy.starts_with(b"The ") && greedy.ends_with(b"\n"));
    assert_eq!(generate(&[]), greedy, "greedy decoding is deterministic");
    let as_json =
        json(troupe(&["generate", "--model", s(&root), "--prompt", "The ", "--max-new-tokens", "20", "--json"]));
    let tokens = ids(&as_json["tokens"]);
    assert_eq!(tokens.iter().map(|&t| t as u8).collect::<Vec<u8>>(), greedy[4..24], "JSON tokens = the streamed bytes");
    assert!(as_json["tokens_per_s"].as_f64().unwrap() > 0.0);

    let sampled = |seed: &str| generate(&["--temperature", "0.9", "--top-k", "40", "--top-p", "0.95", "--seed", seed]);
    let first = sampled("5");
    assert_eq!(first.len(), 25);
    assert_eq!(sampled("5"), first, "the same seed gives the same text");
    assert_ne!(sampled("6"), first, "another seed gives other text");
    // A checkpoint is benchmarked beside transformers through its Hugging Face export.
    assert_eq!(bench_generate(&root)["arch"], "gpt2");
}

/// Mean next-token loss of `model` over the consecutive windows of `tokens`: the reference eval.
fn reference_loss(model: &Model, tokens: &[i64], windows: usize) -> f64 {
    let context = model.config.context;
    let window = |w: usize, offset: usize| Tensor::from_slice(&tokens[w * context + offset..][..context]).view([1, -1]);
    let sum: f64 =
        (0..windows).map(|w| tch::no_grad(|| model.loss(&window(w, 0), &window(w, 1)).double_value(&[]))).sum();
    sum / windows as f64
}

#[test]
fn eval_is_the_mean_loss_from_a_hugging_face_directory_and_a_checkpoint() {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    oracle_models(dir.path());
    let model_dir = dir.path().join("llama_gqa");
    let config = ModelConfig { from_hf: Some(model_dir.clone()), ..read_config(&model_dir).unwrap() };
    let model = Model::load(config.clone(), 0).unwrap();
    // A nanoGPT .bin corpus of 3 whole windows of 32 and a few tokens more.
    let tokens: Vec<i64> = (0..(3 * config.context + 5) as i64).map(|i| (i * 37 + i / 5) % 96).collect();
    let corpus = dir.path().join("corpus.bin");
    std::fs::write(&corpus, tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let eval = json(troupe(&["eval", "--model", s(&model_dir), "--data", s(&corpus), "--json"]));
    assert_eq!(eval["event"], "eval");
    assert_eq!((eval["tokens"].as_u64(), eval["windows"].as_u64()), (Some(3 * 32), Some(3)));
    let reference = reference_loss(&model, &tokens, 3);
    let loss = eval["loss"].as_f64().unwrap();
    assert!((loss - reference).abs() <= 1e-6 * reference, "eval {loss}, reference {reference}");
    assert!((eval["perplexity"].as_f64().unwrap() - reference.exp()).abs() <= 1e-6 * reference.exp());
    let one = json(troupe(&["eval", "--model", s(&model_dir), "--data", s(&corpus), "--windows", "1", "--json"]));
    assert!((one["loss"].as_f64().unwrap() - reference_loss(&model, &tokens, 1)).abs() <= 1e-6 * reference);

    // A checkpoint and its Hugging Face export evaluate the same, on the built-in corpus and on a text file.
    let root = dir.path().join("ckpt");
    train_checkpoint(dir.path(), &root);
    let exported = dir.path().join("exported");
    succeeded(troupe(&["checkpoint", "export", s(&root), "--out", s(&exported)]));
    let text = dir.path().join("corpus.txt");
    std::fs::write(&text, "the quick brown fox jumps over the lazy dog. ".repeat(8)).unwrap();
    for data in [&["--windows", "4"][..], &["--data", s(&text)]] {
        let eval = |model: &Path| json(troupe(&[&["eval", "--model", s(model), "--json"][..], data].concat()));
        let (from_checkpoint, from_export) = (eval(&root), eval(&exported));
        let (a, b) = (from_checkpoint["loss"].as_f64().unwrap(), from_export["loss"].as_f64().unwrap());
        assert!((a - b).abs() <= 1e-6 * b, "{data:?}: checkpoint {a}, export {b}");
        assert_eq!(from_checkpoint["tokens"], from_export["tokens"]);
    }
}

#[test]
fn bad_requests_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    oracle_models(dir.path());
    let model = dir.path().join("llama_gqa");
    let m = s(&model);
    let too_long = (0..33).map(|i| (i % 90).to_string()).collect::<Vec<_>>().join(",");
    let cases: Vec<(Vec<&str>, &[&str])> = vec![
        (vec!["generate", "--model", m, "--prompt-ids", &too_long], &["33 tokens", "context of 32 positions"]),
        (vec!["generate", "--model", m, "--prompt-ids", "1,96"], &["token 96 at position 1", "vocabulary of 96"]),
        (
            vec!["generate", "--model", m, "--prompt", "hi"],
            &["vocabulary of 96 tokens cannot hold bytes", "--prompt-ids"],
        ),
        (vec!["generate", "--model", m, "--prompt-ids", "1", "--top-p", "0"], &["--top-p 0"]),
        (vec!["generate", "--model", m, "--prompt-ids", "1", "--temperature=-1"], &["--temperature -1"]),
        (vec!["generate", "--model", "/nonexistent", "--prompt-ids", "1"], &["/nonexistent", "no such directory"]),
        (
            vec!["generate", "--model", s(dir.path()), "--prompt-ids", "1"],
            &["neither a Hugging Face directory", "checkpoint"],
        ),
        (vec!["eval", "--model", m], &["token", "outside", "vocabulary of 96"]),
        (vec!["eval", "--model", m, "--data-kind", "text"], &["--data PATH"]),
        (vec!["eval", "--model", m, "--data-kind", "synthetic", "--data", m], &["built in"]),
        (vec!["eval", "--model", m, "--context", "33"], &["--context 33", "1..=32"]),
    ];
    for (args, expected) in cases {
        let stderr = failed(&args);
        for part in expected {
            assert!(stderr.contains(part), "troupe {args:?}: {part:?} not in {stderr}");
        }
    }
    let short = dir.path().join("short.bin");
    std::fs::write(&short, [1u8, 0, 2, 0, 3, 0]).unwrap();
    let stderr = failed(&["eval", "--model", m, "--data", s(&short)]);
    assert!(stderr.contains("3 tokens") && stderr.contains("33"), "{stderr}");
}

/// A model that came with a tokenizer — a Hugging Face directory with its `tokenizer.json`, or a
/// checkpoint of a job with `[data] tokenizer` — takes text: the prompt is encoded by it (the Python
/// tokenizers' ids), greedy decoding equals transformers' `generate` on those ids, the streamed and JSON
/// text is the tokenizer's decoding, generation stops after the end-of-text token unless `--ignore-eos`,
/// and `troupe eval` of a text corpus encodes it with the same tokenizer (the loss of its `troupe data
/// prepare` token file). A tokenizer larger than the model's vocabulary is refused, naming both.
#[test]
fn a_model_with_a_tokenizer_takes_text_prompts_and_corpora() {
    use troupe_model::data::tokenizers_oracle;
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, troupe_model::data::synthetic_text(20_000, 9)).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    tokenizers_oracle(&["train", s(&corpus), s(&tokenizer), "400", "bytelevel"]).unwrap();
    let config = dir.path().join("llama.toml");
    let job = format!(
        "[model]\narch = \"llama\"\nvocab_size = 400\nd_model = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n\
         ffn_hidden = 96\ncontext = 48\n[data]\nkind = \"text\"\npath = {:?}\ntokenizer = {:?}\n\
         [train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n",
        s(&corpus),
        s(&tokenizer)
    );
    std::fs::write(&config, job).unwrap();
    let root = dir.path().join("ckpt");
    succeeded(troupe(&["train", "--config", s(&config), "--steps", "3", "--json", "--checkpoint-dir", s(&root)]));
    let hf_dir = dir.path().join("hf");
    succeeded(troupe(&["checkpoint", "export", s(&root), "--out", s(&hf_dir)]));

    let prompt = "The quick brown fox";
    let prompt_file = dir.path().join("prompt.txt");
    std::fs::write(&prompt_file, prompt).unwrap();
    let prompt_ids = ids(&tokenizers_oracle(&["encode", s(&tokenizer), s(&prompt_file)]).unwrap()["ids"]);
    let decode = |ids: &[i64]| {
        let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        tokenizers_oracle(&["decode", s(&tokenizer), &list]).unwrap()["text"].as_str().unwrap().to_owned()
    };
    let n = prompt_ids.len() as i64;
    let prompt_tensor = Tensor::from_slice(&prompt_ids).view([1, n]);
    let tokens_file = dir.path().join("prompt.safetensors");
    Tensor::write_safetensors(&[("tokens", &prompt_tensor)], &tokens_file).unwrap();
    let theirs = ids(&transformers_oracle(&["generate", s(&hf_dir), s(&tokens_file), "16"]).unwrap()["tokens"]);

    let mut continuations = Vec::new();
    for model in [&hf_dir, &root] {
        let args = ["generate", "--model", s(model), "--prompt", prompt, "--max-new-tokens", "16", "--ignore-eos"];
        let ours = json(troupe(&[&args[..], &["--json"]].concat()));
        assert_eq!(ids(&ours["prompt_ids"]), prompt_ids, "{model:?}: the prompt is the tokenizer's ids");
        let tokens = ids(&ours["tokens"]);
        assert_eq!(tokens, theirs[prompt_ids.len()..], "{model:?}: greedy tokens differ from transformers'");
        let whole = decode(&theirs);
        let prompt_text = decode(&prompt_ids);
        assert_eq!(ours["text"].as_str().unwrap(), &whole[prompt_text.len()..], "{model:?}: the decoded continuation");
        let streamed = String::from_utf8(succeeded(troupe(&args))).unwrap();
        assert_eq!(streamed, format!("{whole}\n"), "{model:?}: streamed text is the tokenizer's decoding");
        continuations.push(tokens);
    }

    // Without --ignore-eos, generation ends right after the end-of-text token, if the model says it.
    let eos = ids(&tokenizers_oracle(&["encode", s(&tokenizer), s(&write(dir.path(), "eos.txt", "<|endoftext|>"))])
        .unwrap()["ids"]);
    assert_eq!(eos.len(), 1, "<|endoftext|> is one special token: {eos:?}");
    let stopping =
        json(troupe(&["generate", "--model", s(&hf_dir), "--prompt", prompt, "--max-new-tokens", "16", "--json"]));
    let expected: Vec<i64> = match continuations[0].iter().position(|&t| t == eos[0]) {
        Some(at) => continuations[0][..=at].to_vec(),
        None => continuations[0].clone(),
    };
    assert_eq!(ids(&stopping["tokens"]), expected);
    assert_eq!(stopping["stopped_at_eos"], expected.last() == Some(&eos[0]));

    // eval encodes a text corpus with the model's tokenizer: the loss of the prepared token file.
    let bin = dir.path().join("corpus.bin");
    succeeded(troupe(&["data", "prepare", "--tokenizer", s(&tokenizer), "--out", s(&bin), s(&corpus)]));
    let eval =
        |data: &Path| json(troupe(&["eval", "--model", s(&hf_dir), "--data", s(data), "--windows", "8", "--json"]));
    let (text, prepared) = (eval(&corpus), eval(&bin));
    assert_eq!(text["loss"], prepared["loss"], "text through the tokenizer = the prepared tokens: {text} {prepared}");
    assert_eq!(text["tokens"], prepared["tokens"]);

    // A tokenizer of 501 tokens for a model of 400.
    let big = dir.path().join("big.json");
    tokenizers_oracle(&["wordlevel", s(&big), "500"]).unwrap();
    let err = failed(&["generate", "--model", s(&hf_dir), "--prompt", "w1 w2", "--tokenizer", s(&big)]);
    assert!(err.contains("--tokenizer") && err.contains("501") && err.contains("400"), "{err}");
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

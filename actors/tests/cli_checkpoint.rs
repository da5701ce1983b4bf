//! `troupe checkpoint list|verify|reshard|export` as a user runs them on the checkpoints of a real
//! `troupe train` run: what they print, that a resharded checkpoint continues the same trajectory bit for
//! bit, that the exported parameters are the trained ones, and what a corrupt file or a bad path gets.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;
use tch::Tensor;

const SMALL_JOB: &str = "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\ndecay_steps = 8\n";

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn ok(output: Output) -> Output {
    assert!(
        output.status.success(),
        "troupe failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn json_lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Trains `steps` steps of the small job with checkpoints every 3 under `root`.
fn train(dir: &Path, root: &Path, steps: u64, extra: &[&str]) -> Vec<Value> {
    let config = dir.join("job.toml");
    std::fs::write(&config, SMALL_JOB).unwrap();
    let steps = steps.to_string();
    let mut args = vec!["train", "--config", s(&config), "--steps", &steps, "--json"];
    args.extend(["--checkpoint-dir", s(root), "--checkpoint-every", "3"]);
    args.extend(extra);
    json_lines(&ok(troupe(&args)))
}

fn losses(events: &[Value]) -> Vec<(u64, f64)> {
    events
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect()
}

fn tensors(path: &Path) -> Vec<(String, Tensor)> {
    let mut tensors = Tensor::read_safetensors(path).unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

#[test]
fn list_verify_reshard_and_export_the_checkpoints_of_a_run() {
    let dir = tempfile::tempdir().unwrap();
    let (root, final_params) = (dir.path().join("ckpt"), dir.path().join("final.safetensors"));
    train(dir.path(), &root, 6, &["--save-final", s(&final_params)]);

    let listed = json_lines(&ok(troupe(&["checkpoint", "list", s(&root), "--verify", "--json"])));
    let steps: Vec<(u64, bool, bool)> = listed
        .iter()
        .map(|l| (l["step"].as_u64().unwrap(), l["valid"].as_bool().unwrap(), l["resume_from"].as_bool().unwrap()))
        .collect();
    assert_eq!(steps, vec![(3, true, false), (6, true, true)], "{listed:?}");
    let human = String::from_utf8(ok(troupe(&["checkpoint", "list", s(&root)])).stdout).unwrap();
    assert!(human.lines().next().unwrap().contains("layout"), "a table with a header:\n{human}");
    assert!(human.contains("a job continues from here"), "{human}");
    ok(troupe(&["checkpoint", "verify", s(&root)]));

    // Reshard the newest into 3 files: the manifest says so, and every file verifies.
    let resharded = dir.path().join("r3");
    let out = json_lines(&ok(troupe(&[
        "checkpoint",
        "reshard",
        s(&root),
        "--shards",
        "3",
        "--out",
        s(&resharded),
        "--json",
    ])));
    assert_eq!((out[0]["step"].as_u64(), out[0]["shards"].as_u64()), (Some(6), Some(3)), "{out:?}");
    let listed = json_lines(&ok(troupe(&["checkpoint", "list", s(&resharded), "--verify", "--json"])));
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0]["files"].as_u64(), listed[0]["layout"]["shards"].as_u64()), (Some(3), Some(3)));

    // The exported parameters are exactly the run's final parameters.
    let exported = dir.path().join("model.safetensors");
    ok(troupe(&["checkpoint", "export", s(&resharded), "--raw", "--out", s(&exported)]));
    let (a, b) = (tensors(&exported), tensors(&final_params));
    assert_eq!(a.len(), b.len(), "every parameter, nothing else");
    for ((name_a, ta), (name_b, tb)) in a.iter().zip(&b) {
        assert_eq!(name_a, name_b);
        assert!(ta.equal(tb), "{name_a} differs from the saved final parameters");
    }

    // Continuing from the resharded checkpoint is bit for bit continuing from the original.
    let from_original = losses(&train(dir.path(), &dir.path().join("cont-a"), 8, &["--resume", s(&root)]));
    let from_resharded = losses(&train(dir.path(), &dir.path().join("cont-b"), 8, &["--resume", s(&resharded)]));
    assert_eq!(from_original.first().map(|l| l.0), Some(7), "continues after step 6: {from_original:?}");
    assert_eq!(from_original, from_resharded);
}

#[test]
fn a_corrupt_file_is_named_and_skipped_and_bad_paths_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    train(dir.path(), &root, 6, &[]);
    let shard = root.join("step-00000006").join("shard-00000-of-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&shard, bytes).unwrap();

    let verify = troupe(&["checkpoint", "verify", s(&root)]);
    assert!(!verify.status.success(), "verify exits non-zero on a corrupt checkpoint");
    let text = format!("{}{}", String::from_utf8_lossy(&verify.stdout), String::from_utf8_lossy(&verify.stderr));
    assert!(text.contains("shard-00000-of-00001.safetensors") && text.contains("checksum"), "{text}");
    assert!(text.contains("1 of 2 checkpoint(s) do not verify"), "{text}");

    // Listing (manifests only) cannot see a flipped byte; with --verify it can, and the resume mark
    // moves to the newest checkpoint that verifies.
    let listed = json_lines(&ok(troupe(&["checkpoint", "list", s(&root), "--verify", "--json"])));
    let valid: Vec<(bool, bool)> =
        listed.iter().map(|l| (l["valid"].as_bool().unwrap(), l["resume_from"].as_bool().unwrap())).collect();
    assert_eq!(valid, vec![(true, true), (false, false)], "{listed:?}");
    let exported = dir.path().join("model.safetensors");
    let out = json_lines(&ok(troupe(&["checkpoint", "export", s(&root), "--raw", "--out", s(&exported), "--json"])));
    assert_eq!(out[0]["step"].as_u64(), Some(3), "export of a root takes its newest valid checkpoint: {out:?}");

    let missing = troupe(&["checkpoint", "export", "/nonexistent/ckpt", "--out", s(&exported)]);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success() && err.contains("/nonexistent/ckpt") && err.contains("checkpoint root"), "{err}");
    let zero = troupe(&["checkpoint", "reshard", s(&root), "--shards", "0", "--out", s(&dir.path().join("x"))]);
    let err = String::from_utf8_lossy(&zero.stderr);
    assert!(!zero.status.success() && err.contains("--shards 0"), "{err}");
    let empty = tempfile::tempdir().unwrap();
    let none = troupe(&["checkpoint", "list", s(empty.path())]);
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success() && err.contains("no checkpoints here"), "{err}");
}

/// Runs `troupe ARGS` on a pseudo-terminal (`script`): what it drew on it, stdout and stderr together.
fn on_a_terminal(args: &[&str]) -> String {
    let command =
        std::iter::once(env!("CARGO_BIN_EXE_troupe")).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
    let out = Command::new("script").args(["-qec", &command, "/dev/null"]).output().expect("script runs");
    assert!(out.status.success(), "{command}: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Long commands show what they are doing on a terminal — loading and writing for `checkpoint export`
/// and `reshard` (then a bar of the bytes verified), restoring for `train --resume` — and never in JSON.
#[test]
fn on_a_terminal_checkpoint_commands_and_resume_show_progress_and_json_never_does() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    train(dir.path(), &root, 3, &[]);
    let exported = dir.path().join("model.safetensors");
    let drawn = on_a_terminal(&["checkpoint", "export", s(&root), "--raw", "--out", s(&exported)]);
    assert!(drawn.contains("loading ") && drawn.contains("writing "), "{drawn}");
    let drawn =
        on_a_terminal(&["checkpoint", "reshard", s(&root), "--shards", "2", "--out", s(&dir.path().join("r2"))]);
    assert!(drawn.contains("loading ") && drawn.contains("verifying"), "{drawn}");
    let config = dir.path().join("job.toml");
    let resume = ["train", "--config", s(&config), "--steps", "4", "--resume", s(&root)];
    let drawn = on_a_terminal(&resume);
    assert!(drawn.contains(&format!("restoring {}", root.join("step-00000003").display())), "{drawn}");
    let json = on_a_terminal(&[&resume[..], &["--json"]].concat());
    for line in json.lines().filter(|l| !l.trim().is_empty()) {
        serde_json::from_str::<Value>(line.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"));
    }
    let json = on_a_terminal(&["checkpoint", "export", s(&root), "--raw", "--out", s(&exported), "--json"]);
    assert_eq!(json.trim().lines().count(), 1, "one JSON object and nothing drawn: {json:?}");
}

/// `checkpoint export` of a Llama job's checkpoint writes a Hugging Face directory that transformers'
/// `from_pretrained` loads with no missing, unexpected or mismatched key and no warning, and whose loss
/// on the same tokens is troupe's, with the job's tokenizer beside it; an existing non-empty `--out` is
/// refused with nothing written.
#[test]
fn a_checkpoint_exports_as_a_hugging_face_directory_that_transformers_loads() {
    let dir = tempfile::tempdir().unwrap();
    // A byte-level BPE of 400 tokens made by the Python tokenizers, the job's [data] tokenizer.
    let text = dir.path().join("corpus.txt");
    std::fs::write(&text, troupe_model::data::synthetic_text(20_000, 4)).unwrap();
    let tokenizer = dir.path().join("tokenizer.json");
    troupe_model::data::tokenizers_oracle(&["train", s(&text), s(&tokenizer), "400", "bytelevel"]).unwrap();
    let config = dir.path().join("llama.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\narch = \"llama\"\nvocab_size = 400\nd_model = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n\
             ffn_hidden = 96\ncontext = 32\n[data]\nkind = \"text\"\npath = {:?}\ntokenizer = {:?}\n\
             [train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n",
            s(&text),
            s(&tokenizer)
        ),
    )
    .unwrap();
    let root = dir.path().join("ckpt");
    let args = ["train", "--config", s(&config), "--steps", "3", "--json", "--checkpoint-dir", s(&root)];
    ok(troupe(&args));
    let hf_dir = dir.path().join("hf");
    let out = json_lines(&ok(troupe(&["checkpoint", "export", s(&root), "--out", s(&hf_dir), "--json"])));
    assert_eq!((out[0]["format"].as_str(), out[0]["arch"].as_str()), (Some("huggingface"), Some("llama")), "{out:?}");
    for file in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        assert!(hf_dir.join(file).is_file(), "{file} written: {out:?}");
    }
    assert_eq!(std::fs::read(hf_dir.join("tokenizer.json")).unwrap(), std::fs::read(&tokenizer).unwrap());

    let tokens = Tensor::randint(400, [2, 17], (tch::Kind::Int64, tch::Device::Cpu));
    let tokens_file = dir.path().join("tokens.safetensors");
    Tensor::write_safetensors(&[("tokens", &tokens)], &tokens_file).unwrap();
    let checked = troupe_model::oracle::transformers_oracle(&["check", s(&hf_dir), s(&tokens_file)]).unwrap();
    for key in ["missing", "unexpected", "mismatched", "warnings"] {
        assert_eq!(checked[key], serde_json::json!([]), "transformers reports {key}: {checked}");
    }
    let model_config =
        troupe_model::ModelConfig { from_hf: Some(hf_dir.clone()), ..troupe_model::hf::read_config(&hf_dir).unwrap() };
    let model = troupe_model::Model::load(model_config, 0).unwrap();
    let (input, targets) = (tokens.narrow(1, 0, 16).contiguous(), tokens.narrow(1, 1, 16).contiguous());
    let ours = model.loss(&input, &targets).double_value(&[]);
    let theirs = checked["loss"].as_f64().unwrap();
    assert!((ours - theirs).abs() <= 1e-5 * ours.abs(), "transformers' loss {theirs}, troupe's {ours}");

    let again = troupe(&["checkpoint", "export", s(&root), "--out", s(&hf_dir)]);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("not an empty directory"), "{err}");
    assert!(hf_dir.join("model.safetensors").is_file(), "the refused export left the first one alone");
}

/// A LoRA job's checkpoint as a user exports it: a plain export is refused with the fix and writes
/// nothing; `--adapters` writes a PEFT directory; `--merge` a full Hugging Face model — and `troupe eval`
/// gives the same loss on the merged model as on the base with the adapters applied unmerged
/// (`--adapters`) and as the checkpoint itself at the same context.
#[test]
fn a_lora_checkpoint_exports_as_peft_adapters_or_merged_and_evaluates_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base");
    let mut job = troupe_model::config::JobConfig::small_llama(6);
    job.train.torch_threads = 1;
    let peft = troupe_model::model::PeftConfig {
        r: 4,
        alpha: 8.0,
        targets: vec!["q_proj".into(), "v_proj".into(), "down_proj".into()],
        ..Default::default()
    };
    let job = troupe_model::oracle::fine_tuning(job, peft, &base, 3);
    let config = dir.path().join("finetune.toml");
    let toml = format!(
        "[model]\nfrom_hf = {:?}\ncontext = {}\n[train]\nsteps = 6\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n\
         [peft]\nr = 4\nalpha = 8\ntargets = [\"q_proj\", \"v_proj\", \"down_proj\"]\n",
        s(&base),
        job.model.context
    );
    std::fs::write(&config, toml).unwrap();
    let root = dir.path().join("ckpt");
    ok(troupe(&["train", "--config", s(&config), "--checkpoint-dir", s(&root), "--checkpoint-every", "3", "--json"]));

    let plain = dir.path().join("plain");
    let refused = troupe(&["checkpoint", "export", s(&root), "--out", s(&plain)]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("--adapters") && stderr.contains("--merge"), "{stderr}");
    assert!(!plain.exists(), "a refused export wrote {}", plain.display());

    let adapters = dir.path().join("adapters");
    ok(troupe(&["checkpoint", "export", s(&root), "--out", s(&adapters), "--adapters"]));
    let config_json: Value =
        serde_json::from_str(&std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        (config_json["peft_type"].as_str(), config_json["r"].as_u64()),
        (Some("LORA"), Some(4)),
        "{config_json}"
    );
    let names: Vec<String> = tensors(&adapters.join("adapter_model.safetensors")).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 2 * 3 * job.model.n_layers, "{names:?}");
    assert!(names.iter().all(|n| n.starts_with("base_model.model.model.layers.") && n.contains(".lora_")), "{names:?}");

    let merged = dir.path().join("merged");
    ok(troupe(&["checkpoint", "export", s(&root), "--out", s(&merged), "--merge"]));
    let eval = |args: &[&str]| {
        let context = job.model.context.to_string();
        let all = [&["eval"][..], args, &["--windows", "4", "--context", &context, "--json"]].concat();
        json_lines(&ok(troupe(&all))).last().unwrap()["loss"].as_f64().unwrap()
    };
    let merged_loss = eval(&["--model", s(&merged)]);
    let unmerged = eval(&["--model", s(&base), "--adapters", s(&adapters)]);
    let checkpoint = eval(&["--model", s(&root)]);
    let base_loss = eval(&["--model", s(&base)]);
    assert!((merged_loss - unmerged).abs() <= 1e-5 * unmerged, "merged {merged_loss} vs unmerged {unmerged}");
    assert!((checkpoint - unmerged).abs() <= 1e-5 * unmerged, "checkpoint {checkpoint} vs unmerged {unmerged}");
    assert!((base_loss - unmerged).abs() > 1e-4 * unmerged, "the adapters changed nothing: {base_loss} vs {unmerged}");
}

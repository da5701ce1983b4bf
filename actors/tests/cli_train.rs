//! `troupe train` as a user runs it: the JSON event contract, checkpoints and resume through the CLI,
//! --save-final, the validation loss (`eval_every`) and its plot, and the errors for flags and configs
//! this build cannot honour.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// A small model so each run takes a second or two; the trainer is the same.
const SMALL_JOB: &str = "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\n";

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn small_job(dir: &Path) -> String {
    let path = dir.join("job.toml");
    std::fs::write(&path, SMALL_JOB).unwrap();
    path.to_str().unwrap().to_owned()
}

fn events(output: &Output) -> Vec<Value> {
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn step_losses(events: &[Value]) -> Vec<(u64, f64)> {
    events
        .iter()
        .filter(|e| e["event"] == "step")
        .map(|e| (e["step"].as_u64().unwrap(), e["loss"].as_f64().unwrap()))
        .collect()
}

#[test]
fn json_mode_prints_one_object_per_event_with_the_documented_fields() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path());
    let events = events(&troupe(&["train", "--config", &job, "--steps", "3", "--json"]));
    assert_eq!(events.first().unwrap()["event"], "start");
    let steps: Vec<&Value> = events.iter().filter(|e| e["event"] == "step").collect();
    assert_eq!(steps.len(), 3);
    for (i, step) in steps.iter().enumerate() {
        assert_eq!(step["step"], i as u64 + 1);
        for key in ["loss", "tokens_per_s", "epoch", "world"] {
            assert!(step.get(key).is_some_and(|v| v.is_number()), "step event lacks {key}: {step}");
        }
        let peak = &step["peak_rss_mib_per_rank"];
        assert!(peak[0].as_f64().is_some_and(|mib| mib > 50.0) && peak.as_array().unwrap().len() == 1, "{step}");
    }
    let summary = events.last().unwrap();
    assert_eq!(summary["event"], "summary");
    assert_eq!(summary["steps"], 3);
}

/// `--precision fp16` with an overflow injected into the second step: the step events carry the loss
/// scale and say which step was skipped, the summary counts it, and a person reading the log sees why.
#[test]
fn fp16_reports_the_loss_scale_and_the_skipped_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.toml");
    std::fs::write(&path, format!("{SMALL_JOB}inject_overflow_at = [1]\n")).unwrap();
    let job = path.to_str().unwrap();
    let events = events(&troupe(&["train", "--config", job, "--precision", "fp16", "--steps", "3", "--json"]));
    let steps: Vec<&Value> = events.iter().filter(|e| e["event"] == "step").collect();
    let skipped: Vec<bool> = steps.iter().map(|s| s["skipped"].as_bool().unwrap()).collect();
    let scales: Vec<f64> = steps.iter().map(|s| s["loss_scale"].as_f64().unwrap()).collect();
    assert_eq!(skipped, [false, true, false]);
    assert_eq!(scales, [65536.0, 65536.0, 32768.0]);
    assert!(steps[1]["grad_norm"].is_null(), "an overflowed norm is null in JSON: {}", steps[1]);
    assert_eq!(events.last().unwrap()["skipped_steps"], 1);

    let output = troupe(&["train", "--config", job, "--precision", "fp16", "--steps", "3"]);
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout.contains("step      2/3  loss") && stdout.contains("skipped: the fp16 gradients overflowed"),
        "{stdout}"
    );
    assert!(stdout.contains("1 step(s) skipped for an fp16 overflow"), "{stdout}");
}

#[test]
fn human_mode_shows_the_loss_and_a_summary() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path());
    let output = troupe(&["train", "--config", &job, "--steps", "4", "--log-every", "2"]);
    assert!(output.status.success());
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(stdout.contains("step      2/4  loss "), "{stdout}");
    assert!(stdout.contains("done: 4 steps"), "{stdout}");
}

#[test]
fn checkpoint_and_resume_through_the_cli_continue_the_same_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path());
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let straight = step_losses(&events(&troupe(&["train", "--config", &job, "--steps", "6", "--json"])));

    let first = events(&troupe(&[
        "train",
        "--config",
        &job,
        "--steps",
        "6",
        "--json",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "2",
    ]));
    assert_eq!(first.iter().filter(|e| e["event"] == "checkpoint").count(), 3);
    // Pretend the run died after step 4: resume from the step-4 checkpoint.
    std::fs::remove_dir_all(Path::new(ckpt).join("step-00000006")).unwrap();
    let resumed =
        step_losses(&events(&troupe(&["train", "--config", &job, "--steps", "6", "--json", "--resume", ckpt])));
    assert_eq!(resumed, straight[4..].to_vec(), "resumed steps must equal the uninterrupted run bit for bit");
}

/// `[train] eval_every` with a validation file: an `eval` event after every second step and after the
/// last, after that step's event, each the loss `troupe eval` gives that step's checkpoint on the
/// validation file; a held-out corpus that is too short is named with the size it needs; and `troupe
/// plot` draws the validation loss over the training loss.
#[test]
fn eval_every_reports_the_validation_loss_and_plot_draws_it() {
    let dir = tempfile::tempdir().unwrap();
    let (train, val) = (dir.path().join("train.txt"), dir.path().join("val.txt"));
    std::fs::write(&train, "the quick brown fox jumps over the lazy dog. ".repeat(200)).unwrap();
    std::fs::write(&val, "pack my box with five dozen liquor jugs! ".repeat(20)).unwrap();
    let job = |data: &str| {
        let path = dir.path().join("eval.toml");
        let text = format!(
            "[model]\nn_layers = 1\nd_model = 64\nn_heads = 2\ncontext = 32\n[data]\nkind = \"text\"\npath = {train:?}\n{data}\n\
             [train]\nglobal_batch = 4\nmicro_batch = 2\ntorch_threads = 1\neval_every = 2\neval_samples = 8\n"
        );
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let (run, ckpt) = (dir.path().join("run"), dir.path().join("ckpt"));
    let (run, ckpt) = (run.to_str().unwrap(), ckpt.to_str().unwrap());
    let config = job(&format!("val_path = {val:?}"));
    let args = ["train", "--config", &config, "--steps", "5", "--json", "--run-dir", run, "--checkpoint-dir", ckpt];
    let events = events(&troupe(&[&args[..], &["--checkpoint-every", "2"]].concat()));
    let order: Vec<String> = events
        .iter()
        .filter(|e| e["event"] == "step" || e["event"] == "eval")
        .map(|e| format!("{} {}", e["event"].as_str().unwrap(), e["step"]))
        .collect();
    let want = ["step 1", "step 2", "eval 2", "step 3", "step 4", "eval 4", "step 5", "eval 5"];
    assert_eq!(order, want, "an evaluation after its step, every 2 steps and after the last");
    let evals: Vec<&Value> = events.iter().filter(|e| e["event"] == "eval").collect();
    for eval in &evals {
        let loss = eval["loss"].as_f64().unwrap();
        assert!((eval["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9 * loss.exp(), "{eval}");
        assert_eq!((eval["windows"].as_u64(), eval["tokens"].as_u64()), (Some(8), Some(8 * 32)), "{eval}");
    }
    // The event at step 4 is what `troupe eval` says of step 4's checkpoint on the validation file.
    let step4 = Path::new(ckpt).join("step-00000004");
    let (model, val) = (step4.to_str().unwrap(), val.to_str().unwrap());
    let output = troupe(&["eval", "--model", model, "--data", val, "--windows", "8", "--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let offline: Value = serde_json::from_slice(output.stdout.trim_ascii()).unwrap();
    let (online, offline) = (evals[1]["loss"].as_f64().unwrap(), offline["loss"].as_f64().unwrap());
    assert!((online - offline).abs() <= 1e-5 * offline, "eval event {online} vs troupe eval {offline}");

    let plotted = troupe(&["plot", run, "--json"]);
    assert!(plotted.status.success(), "{}", String::from_utf8_lossy(&plotted.stderr));
    let plot: Value = serde_json::from_slice(plotted.stdout.trim_ascii()).unwrap();
    assert_eq!((plot["steps"].as_u64(), plot["evals"].as_u64()), (Some(5), Some(3)), "{plot}");
    let svg = std::fs::read_to_string(plot["svg"].as_str().unwrap()).unwrap();
    assert!(svg.contains(r#"class="eval-series""#) && svg.contains("validation loss"), "the eval series is drawn");

    // A tail too short for one window: the error names the key and what it needs.
    let output = troupe(&["train", "--config", &job("val_fraction = 0.001"), "--steps", "1"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("data.val_fraction = 0.001"), "{stderr}");
    assert!(stderr.contains("model.context + 1 = 33") && stderr.contains("raise data.val_fraction"), "{stderr}");
}

#[test]
fn save_final_writes_a_safetensors_file_of_all_parameters() {
    let dir = tempfile::tempdir().unwrap();
    let job = small_job(dir.path());
    let out = dir.path().join("final.safetensors");
    events(&troupe(&["train", "--config", &job, "--steps", "1", "--json", "--save-final", out.to_str().unwrap()]));
    let tensors = tch::Tensor::read_safetensors(&out).unwrap();
    assert_eq!(tensors.len(), 2 + 12 + 3);
    let wte = tensors.iter().find(|(n, _)| n == "wte.weight").expect("wte.weight saved");
    assert_eq!(wte.1.size(), vec![256, 64]);
}

#[test]
fn unavailable_flags_and_bad_configs_fail_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[train]\nlearning_rate = 0.1\n").unwrap();
    let bad = bad.to_str().unwrap();
    let inject = dir.path().join("inject.toml");
    std::fs::write(&inject, "[train]\ninject_overflow_at = [3]\n").unwrap();
    let inject = inject.to_str().unwrap();
    let scale = dir.path().join("scale.toml");
    std::fs::write(&scale, "[parallel]\nloss_scale_init = 1000.0\n").unwrap();
    let scale = scale.to_str().unwrap();
    let eval = dir.path().join("eval.toml");
    std::fs::write(&eval, "[train]\neval_every = 10\n").unwrap();
    let eval = eval.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["train", "--dp", "2"], "--dp"),
        (&["train", "--pp", "8"], "at most model.n_layers (4)"),
        (&["train", "--pp", "2", "--virtual-stages", "2"], "--schedule interleaved"),
        (&["train", "--pp", "2", "--microbatches", "9"], "at most train.global_batch (8)"),
        (&["train", "--pp", "2", "--dp", "2", "--microbatches", "5"], "train.global_batch / parallel.dp = 4"),
        (&["train", "--shard", "zero4"], "none, zero1, zero2, zero3"),
        (&["train", "--steps", "0"], "`train.steps` = 0: must be at least 1"),
        (&["train", "--nodes", "0"], "parallel.nodes"),
        (&["train", "--nodes", "2", "--dp", "3"], "raise --nodes or lower --dp"),
        (&["train", "--nodes", "2", "--resume", "/tmp"], "pass --checkpoint-dir instead"),
        (&["train", "--cluster", "127.0.0.1:7000"], "--cluster"),
        (&["train", "--config", bad], "unknown field `learning_rate`"),
        (&["train", "--config", "/nonexistent/job.toml"], "/nonexistent/job.toml"),
        (&["train", "--resume", "/nonexistent/ckpt"], "no valid checkpoint"),
        (&["train", "--config", inject], "set parallel.precision = \"fp16\""),
        (&["train", "--precision", "fp16", "--config", scale], "must be a power of two"),
        (&["train", "--config", eval], "set data.val_fraction (e.g. 0.1, the corpus' tail) or data.val_path"),
    ];
    for (args, needle) in cases {
        let output = troupe(args);
        assert!(!output.status.success(), "{args:?} should fail");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(needle), "{args:?}: stderr lacks {needle:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    }
}

//! `troupe bench train --world N` as a user runs it: the JSON report of a data-parallel run on a local
//! cluster of daemon processes, a ZeRO-3 run beside DDP, a Llama preset beside transformers' model under
//! PyTorch DDP, Adafactor beside AdamW at tp = 2, ZeRO-1 inside tp = 2 × dp = 2, and the errors for sharding one rank and for a model
//! that is not a preset. Speed is not asserted (the machine is shared); only that every figure is there
//! and positive.

use std::process::{Command, Output};

use serde_json::Value;
use troupe_model::oracle::venv_python;

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn positive(report: &Value, key: &str) -> f64 {
    let value = report[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number in {report}"));
    assert!(value > 0.0 && value.is_finite(), "{key} = {value} in {report}");
    value
}

#[test]
fn world_two_reports_throughput_and_peak_memory_of_each_rank() {
    let output = troupe(&["bench", "train", "--world", "2", "--steps", "2", "--repeats", "1", "--json"]);
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let line = stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    assert_eq!(report["bench"], "train");
    assert_eq!(report["world"], 2);
    assert_eq!(report["steps"], 2);
    assert_eq!(report["micro_batch"], 8);
    assert_eq!(report["global_batch"], 16);
    assert_eq!(report["context"], 128);
    assert_eq!((report["model"].as_str(), report["arch"].as_str()), (Some("gpt-tiny"), Some("gpt2")), "{report}");
    assert_eq!(report["params"], 3_323_392);
    positive(&report, "tokens_per_s");
    positive(&report, "torch_threads");
    positive(&report, "final_loss");
    assert_eq!(report["tokens_per_s_runs"].as_array().map(Vec::len), Some(1), "{report}");
    let peaks = report["peak_rss_mib_per_rank"].as_array().unwrap_or_else(|| panic!("no peaks in {report}"));
    assert_eq!(peaks.len(), 2, "{report}");
    for peak in peaks {
        // A rank holds at least gpt-tiny's parameters, gradients and AdamW moments (4 × 13.3 MB).
        assert!(peak.as_f64().is_some_and(|mib| mib > 50.0), "peak RSS {peak} MiB in {report}");
    }
    assert!(report.get("peer_tokens_per_s").is_none(), "no peer was asked for: {report}");
}

/// `--peer-compile`: the same peer under `torch.compile`, its report named so; refused without a peer.
#[test]
fn the_peer_runs_compiled_beside_troupe_when_asked() {
    let python = venv_python();
    let python = python.to_str().expect("a UTF-8 path");
    let args = ["bench", "train", "--context", "32", "--steps", "2", "--repeats", "1", "--threads", "1"];
    // torch.compile's CPU backend runs the C++ compiler found on PATH, as for any user.
    let compiled = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args([&args[..], &["--peer", "--peer-compile", "--python", python, "--json"]].concat())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .output()
        .expect("troupe runs");
    let report = report_of(compiled);
    assert_eq!(report["peer"], "pytorch-compile", "{report}");
    for key in ["tokens_per_s", "peer_tokens_per_s", "ratio_vs_peer"] {
        positive(&report, key);
    }
    let output = troupe(&[&args[..], &["--peer-compile"]].concat());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("add --peer"), "{stderr}");
}

#[test]
fn one_rank_sharding_is_refused_with_a_clear_message() {
    let output = troupe(&["bench", "train", "--world", "1", "--shard", "zero2"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("--world 2 or more"), "{stderr}");
}

#[test]
fn a_zero3_run_is_measured_beside_ddp_in_the_same_report() {
    let output =
        troupe(&["bench", "train", "--world", "2", "--shard", "zero3", "--steps", "2", "--repeats", "1", "--json"]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!(report["shard"], "zero3");
    for key in ["tokens_per_s", "ddp_tokens_per_s", "ratio_vs_ddp"] {
        assert!(report[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {report}");
    }
    for key in ["peak_rss_mib_per_rank", "ddp_peak_rss_mib_per_rank"] {
        assert_eq!(report[key].as_array().map(Vec::len), Some(2), "{key} per rank in {report}");
    }
}

#[test]
fn world_two_trains_a_llama_preset_beside_transformers_under_pytorch_ddp() {
    // The peer (bench/peers/ddp_gpt_tiny.py --config-dir) runs in the provisioned venv.
    let python = venv_python();
    let python = python.to_str().expect("a UTF-8 path");
    let args = ["--world", "2", "--model", "llama-tiny", "--context", "32", "--steps", "2", "--repeats", "1"];
    let output = troupe(&[&["bench", "train"][..], &args, &["--peer", "--python", python, "--json"]].concat());
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    assert_eq!((report["model"].as_str(), report["arch"].as_str()), (Some("llama-tiny"), Some("llama")), "{report}");
    assert_eq!((report["world"].as_u64(), report["context"].as_u64()), (Some(2), Some(32)), "{report}");
    assert_eq!((report["peer"].as_str(), report["peer_shard"].as_str()), (Some("transformers-ddp-gloo"), Some("none")));
    // Both sides built the same model from the preset: troupe's count is transformers' LlamaForCausalLM's.
    assert!(report["params"].as_u64().is_some_and(|n| n > 2_000_000), "{report}");
    assert_eq!(report["params"], report["peer_params"], "{report}");
    for key in ["tokens_per_s", "tokens_per_s_no_overlap", "peer_tokens_per_s", "ratio", "final_loss"] {
        positive(&report, key);
    }
    let ratio = report["tokens_per_s"].as_f64().unwrap() / report["peer_tokens_per_s"].as_f64().unwrap();
    assert!((positive(&report, "ratio") - ratio).abs() < 1e-9 * ratio, "{report}");
}

#[test]
fn a_model_that_is_not_a_preset_is_refused_naming_the_presets() {
    for world in ["1", "2"] {
        let output = troupe(&["bench", "train", "--world", world, "--model", "llama-7b"]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "--world {world} accepted llama-7b");
        assert!(stderr.contains("--model \"llama-7b\": not a preset") && stderr.contains("\"llama-tiny\""), "{stderr}");
    }
    let output = troupe(&["bench", "train", "--world", "2", "--model", "llama-tiny", "--context", "0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("--context 0"), "{stderr}");
}

/// `--netns` (root, namespaces) refuses what it cannot run before creating anything: its PyTorch peer
/// trains gpt-tiny only, and H = 32 needs 64 steps to synchronize more than once.
#[test]
fn namespace_series_refuses_a_peer_of_another_model_and_too_few_steps() {
    let cases: [(&[&str], &str); 2] = [
        (&["--peer", "--model", "llama-tiny", "--steps", "64"], "drop --peer or --model llama-tiny"),
        (&["--peer", "--steps", "8"], "--steps 8 with --netns: at least 64"),
    ];
    for (args, expected) in cases {
        let output = troupe(&[&["bench", "train", "--world", "2", "--netns", "2"][..], args].concat());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn world_zero_is_refused() {
    let output = troupe(&["bench", "train", "--world", "0"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--world 0"));
}

#[test]
fn world_one_reports_achieved_tflops_and_mfu_when_the_peak_is_given() {
    let args = ["bench", "train", "--steps", "1", "--repeats", "1", "--micro-batch", "2", "--peak-tflops", "2.5"];
    let output = troupe(&[&args[..], &["--json", "--threads", "1"]].concat());
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    assert_eq!((report["device"].as_str(), report["micro_batch"].as_u64()), (Some("cpu"), Some(2)), "{report}");
    let (tps, tflops, mfu) =
        (positive(&report, "tokens_per_s"), positive(&report, "achieved_tflops"), positive(&report, "mfu"));
    assert!((tflops - 3.0 * 3_323_392.0 * 2.0 * tps / 1e12).abs() < tflops * 0.2, "{report}");
    assert!((mfu - tflops / 2.5).abs() < 1e-12, "{report}");
}

#[test]
fn cuda_training_runs_on_the_gpu_or_says_no_cuda_device() {
    let output = troupe(&[
        "bench",
        "train",
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        assert!(stderr.contains("no CUDA device"), "failed for another reason: {stderr}");
        println!("cuda_training_...: skipped, {}", stderr.trim());
        return;
    }
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    positive(&report, "tokens_per_s");
    positive(&report, "achieved_tflops");
    assert!(report["device"].as_str().unwrap().contains("NVIDIA") || report["device"].is_string(), "{report}");
}

/// Without a GPU, `--device cuda` is refused before any setup: a LoRA run of a billion parameters would
/// otherwise write its base first (gigabytes, a minute here) only to fail after. The temporary directory
/// the base goes to does not exist, so a run that began the setup would fail on that instead.
#[test]
fn without_a_gpu_cuda_is_refused_before_the_fine_tuning_base_is_written() {
    if troupe_kernels::cuda::cuda_device_count().is_ok() {
        println!("without_a_gpu_...: skipped, this machine has a CUDA device");
        return;
    }
    let missing = tempfile::tempdir().unwrap().path().join("not-there");
    let args = ["bench", "train", "--device", "cuda", "--precision", "bf16", "--model", "tinyllama-1.1b"];
    let output = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .args(["--peft", "lora", "--steps", "1", "--json"])
        .env_clear()
        .env("TMPDIR", &missing)
        .output()
        .expect("troupe runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("no CUDA device"), "{stderr}");
    assert!(!missing.exists());
}

#[test]
fn cuda_training_is_for_one_rank() {
    let output = troupe(&["bench", "train", "--device", "cuda", "--world", "2"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--world 1"));
}

fn report_of(output: Output) -> Value {
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// LoRA's memory as measured: fine-tuning SmolLM2-135M's shape with LoRA (r 8 on q, v) peaks lower than
/// training every parameter by at least the base's optimizer state (two fp32 moments, 8 bytes a
/// parameter) — each the training's peak resident set in a process of its own, writing the base
/// excluded. The adapters are what trains: 0.34 % of the parameters.
#[test]
fn lora_peaks_below_full_training_by_at_least_the_base_optimizer_state() {
    let run = |peft: &str| {
        report_of(troupe(&[
            "bench",
            "train",
            "--model",
            "smollm2-135m",
            "--context",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "1",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--peft",
            peft,
            "--json",
        ]))
    };
    let (lora, full) = (run("lora"), run("none"));
    for report in [&lora, &full] {
        assert_eq!(report["peak_mem_is_training_only"], true, "{report}");
        positive(report, "tokens_per_s");
    }
    let params = full["params"].as_u64().unwrap();
    assert_eq!(lora["params"].as_u64(), Some(params), "the same model: {lora}");
    assert_eq!(full["trainable_params"].as_u64(), Some(params));
    let trainable = lora["trainable_params"].as_u64().unwrap();
    // 30 blocks × r 8 × (q: 576 in + 576 out, v: 576 in + 192 out): 0.34 % of the model.
    assert_eq!(trainable, 30 * 8 * (576 + 576 + 576 + 192), "LoRA trains {trainable} of {params}: {lora}");
    let (lora_peak, full_peak) = (positive(&lora, "peak_mem_bytes"), positive(&full, "peak_mem_bytes"));
    let moments = 8.0 * params as f64;
    println!(
        "peak: LoRA {:.0} MiB, full {:.0} MiB, base moments {:.0} MiB",
        lora_peak / 1048576.0,
        full_peak / 1048576.0,
        moments / 1048576.0
    );
    assert!(
        full_peak - lora_peak >= moments,
        "LoRA peaks at {lora_peak}, full training at {full_peak}: less than the {moments} bytes of moments apart"
    );
}

/// `--peft lora --peer`: PEFT fine-tunes the same base beside troupe, and counts the same adapters —
/// PEFT's trainable parameters are troupe's, and its model is the base plus them.
#[test]
fn lora_fine_tuning_runs_beside_peft_with_the_same_adapters() {
    let python = venv_python();
    let python = python.to_str().expect("a UTF-8 path");
    let report = report_of(troupe(&[
        "bench",
        "train",
        "--model",
        "llama-tiny",
        "--context",
        "32",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--peft",
        "lora",
        "--lora-r",
        "4",
        "--lora-targets",
        "q_proj,k_proj,down_proj",
        "--peer",
        "--python",
        python,
        "--json",
    ]));
    assert_eq!(report["peer"], "transformers-peft-eager", "{report}");
    // 4 blocks × r 4 × (q: 256 + 256, k: 256 + 128, down: 688 + 256).
    assert_eq!(report["trainable_params"].as_u64(), Some(4 * 4 * (512 + 384 + 944)), "{report}");
    assert_eq!(report["peer_trainable_params"], report["trainable_params"], "{report}");
    let (params, trainable) = (report["params"].as_u64().unwrap(), report["trainable_params"].as_u64().unwrap());
    assert_eq!(report["peer_params"].as_u64(), Some(params + trainable), "{report}");
    for key in ["tokens_per_s", "peer_tokens_per_s", "ratio_vs_peer"] {
        positive(&report, key);
    }
}

#[test]
fn tensor_parallel_runs_beside_pytorch_tensor_parallelism_and_data_parallelism() {
    // The peer (bench/peers/tp_gpt_tiny.py: DTensor ColwiseParallel/RowwiseParallel over Gloo) runs in the venv.
    let python = venv_python();
    let python = python.to_str().expect("a UTF-8 path");
    let args = ["--world", "2", "--tp", "2", "--context", "32", "--steps", "2", "--repeats", "1", "--peer"];
    let report = report_of(troupe(&[&["bench", "train"][..], &args, &["--python", python, "--json"]].concat()));
    let layout = ["world", "tp", "dp", "global_batch", "context"].map(|key| report[key].as_u64());
    assert_eq!(layout, [2, 2, 1, 8, 32].map(Some), "{report}");
    assert_eq!(
        (report["sp"].as_bool(), report["peer_sp"].as_bool(), report["peer_tp"].as_u64()),
        (Some(true), Some(true), Some(2))
    );
    assert_eq!(report["peer"], "pytorch-dtensor-tp-gloo", "{report}");
    // The same model on both sides, split over the two ranks of the group.
    assert_eq!(report["params"], report["peer_params"], "{report}");
    assert!(positive(&report, "rank_params") < positive(&report, "params") * 0.6, "{report}");
    for key in ["tokens_per_s", "dp_tokens_per_s", "ratio_vs_dp", "peer_tokens_per_s", "ratio", "final_loss"] {
        positive(&report, key);
    }
    // Different draws of the same model on the same bytes start near ln 256 = 5.55 on both sides.
    let (ours, peer) = (positive(&report, "first_loss"), positive(&report, "peer_first_loss"));
    assert!((ours - 256f64.ln()).abs() < 0.3 && (peer - 256f64.ln()).abs() < 0.3, "first losses {ours} / {peer}");
    for key in ["peak_rss_mib_per_rank", "dp_peak_rss_mib_per_rank", "peer_peak_rss_mib_per_rank"] {
        assert_eq!(report[key].as_array().map(Vec::len), Some(2), "{key} per rank in {report}");
    }
}

#[test]
fn tensor_parallel_bad_combinations_are_refused_before_anything_starts() {
    let cases: [(&[&str], &[&str]); 5] = [
        (&["--world", "3", "--tp", "2"], &["--tp 2 does not divide --world 3", "use --world 2"]),
        (&["--world", "3", "--tp", "3"], &["model.n_heads (4)", "nearest valid degree is 2"]),
        (&["--world", "2", "--tp", "2", "--shard", "zero1"], &["--shard zero1 with --tp 2", "one tensor group"]),
        (&["--world", "2", "--no-sp"], &["--sp / --no-sp go with --tp"]),
        (&["--world", "2", "--tp", "2", "--peer", "--precision", "bf16"], &["--precision bf16 with --tp 2", "fp32"]),
    ];
    for (args, expected) in cases {
        let output = troupe(&[&["bench", "train"][..], args].concat());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(expected.iter().all(|e| stderr.contains(e)), "{args:?}: {stderr}");
    }
}

/// `--optimizer adafactor` at tp = 2: AdamW's and Adafactor's jobs in one report, each rank's optimizer
/// state as the engine reports it; Adafactor's is under a tenth of AdamW's (its matrices keep `R + C`
/// statistics instead of two `R × C` moments). With one rank, `--tp` is refused.
#[test]
fn adafactor_under_tensor_parallelism_is_measured_beside_adamw_with_its_state_per_rank() {
    let refused = troupe(&["bench", "train", "--world", "1", "--tp", "2", "--optimizer", "adafactor"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("use --world 2"), "{stderr}");

    let args = ["bench", "train", "--world", "2", "--tp", "2", "--optimizer", "adafactor", "--steps", "2"];
    let output = troupe(&[&args[..], &["--repeats", "1", "--json"]].concat());
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    let runs = report["runs"].as_array().unwrap_or_else(|| panic!("no runs in {report}"));
    let names: Vec<_> = runs.iter().map(|r| r["optimizer"].as_str()).collect();
    assert_eq!(names, [Some("adamw"), Some("adafactor")], "{report}");
    for run in runs {
        positive(run, "tokens_per_s");
        positive(run, "final_loss");
        assert_eq!(run["optimizer_bytes_per_rank"].as_array().map(Vec::len), Some(2), "{report}");
        assert_eq!(run["peak_mib_per_rank"].as_array().map(Vec::len), Some(2), "{report}");
    }
    positive(&report, "tokens_per_s_ratio");
    let ratio = positive(&report, "optimizer_bytes_ratio");
    assert!(ratio < 0.1, "Adafactor's state per rank is {ratio}× AdamW's: {report}");
}

/// `--tp 2 --precision bf16`: the tensor group and its data-parallel baseline both train in bf16 (the
/// loss starts near ln 256 as in fp32).
#[test]
fn tensor_parallel_in_bf16_is_measured_beside_data_parallelism_in_bf16() {
    let args =
        ["--world", "2", "--tp", "2", "--precision", "bf16", "--context", "32", "--steps", "2", "--repeats", "1"];
    let report = report_of(troupe(&[&["bench", "train"][..], &args, &["--json"]].concat()));
    assert_eq!((report["precision"].as_str(), report["tp"].as_u64()), (Some("bf16"), Some(2)), "{report}");
    for key in ["tokens_per_s", "dp_tokens_per_s", "ratio_vs_dp", "final_loss"] {
        positive(&report, key);
    }
    let first = positive(&report, "first_loss");
    assert!((first - 256f64.ln()).abs() < 0.3, "first loss {first}: {report}");
}

/// `--tp 2 --shard zero1` over two tensor groups: ZeRO-1 inside the data-parallel groups of the tensor
/// ranks, its data-parallel baseline sharded alike, both measured.
#[test]
fn tensor_parallel_with_zero_inside_its_data_parallel_groups_is_measured() {
    let args = ["--world", "4", "--tp", "2", "--shard", "zero1", "--context", "32", "--steps", "2", "--repeats", "1"];
    let report = report_of(troupe(&[&["bench", "train"][..], &args, &["--json"]].concat()));
    assert_eq!((report["shard"].as_str(), report["dp"].as_u64()), (Some("zero1"), Some(2)), "{report}");
    for key in ["tokens_per_s", "dp_tokens_per_s", "final_loss"] {
        positive(&report, key);
    }
}

//! `troupe bench pipeline` as a user runs it: the JSON report (measured bubble beside the plan's theory)
//! and the Chrome/Perfetto trace of the measured spans; bad arguments get errors that name the fix.
//! Speed is not asserted (the machine is shared); only that the figures are there and consistent.

use std::process::{Command, Output};

use serde_json::Value;

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).env_clear().output().expect("troupe runs")
}

fn number(report: &Value, key: &str) -> f64 {
    report[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number in {report}"))
}

#[test]
fn one_f_one_b_reports_its_bubble_beside_theory_and_writes_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace_path = dir.path().join("trace.json");
    let trace_arg = trace_path.to_str().unwrap();
    let args = [
        "bench",
        "pipeline",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--schedule",
        "1f1b",
        "--steps",
        "3",
        "--layers",
        "2",
        "--micro-batch-size",
        "1",
        "--trace-out",
        trace_arg,
        "--json",
    ];
    let output = troupe(&args);
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    assert_eq!(report["bench"], "pipeline");
    assert_eq!(report["schedule"], "1f1b");
    assert_eq!(report["steady_steps"], 2);
    // 1F1B at P = 2, M = 2: (P − 1)/(M + P − 1) = 1/3, in theory and at any measured costs with F:B fixed.
    assert!((number(&report, "bubble_theory") - 1.0 / 3.0).abs() < 1e-12, "{report}");
    assert!((number(&report, "bubble_textbook") - 1.0 / 3.0).abs() < 1e-12, "{report}");
    let bubble = number(&report, "bubble");
    assert!((0.0..1.0).contains(&bubble), "{report}");
    assert!(number(&report, "tokens_per_s") > 0.0 && number(&report, "forward_ms") > 0.0, "{report}");
    assert!(report["backward_weight_ms"].is_null(), "1F1B has no separate W: {report}");

    let trace: Value = serde_json::from_slice(&std::fs::read(&trace_path).unwrap()).unwrap();
    let events: Vec<&Value> = trace["traceEvents"].as_array().unwrap().iter().filter(|e| e["ph"] == "X").collect();
    // Per steady step: device 0 runs F, send, recv, B per micro-batch; device 1 recv, F, B, send: 16 ops.
    assert_eq!(events.len(), 2 * 16, "{trace}");
    for event in &events {
        let category = event["cat"].as_str().unwrap();
        assert!(["forward", "backward", "comm"].contains(&category), "{event}");
        assert!(event["dur"].as_f64().unwrap() >= 0.0 && event["ts"].as_f64().unwrap() >= 0.0, "{event}");
        let args = &event["args"];
        assert!(args["stage"].as_u64().unwrap() < 2 && args["microbatch"].as_u64().unwrap() < 2, "{event}");
        assert_eq!(args["epoch"], 1);
        assert_eq!(event["tid"], args["stage"]);
    }
    let forwards = events.iter().filter(|e| e["cat"] == "forward").count();
    assert_eq!(forwards, 2 * 2 * 2, "steps × stages × micro-batches forwards");
}

#[test]
fn the_peer_runs_the_same_pipeline_in_pytorch_and_the_ratio_is_reported() {
    // The provisioned venv (or $TROUPE_PYTHON) runs bench/peers/pipeline_gpt_tiny.py.
    let mut command = Command::new(env!("CARGO_BIN_EXE_troupe"));
    command.env_clear();
    for key in ["HOME", "TROUPE_CACHE", "TROUPE_PYTHON"] {
        if let Some(value) = std::env::var_os(key) {
            command.env(key, value);
        }
    }
    let args = ["--stages", "2", "--microbatches", "2", "--schedule", "zb-h1", "--steps", "3", "--layers", "2"];
    let output =
        command.args(["bench", "pipeline", "--micro-batch-size", "1", "--peer", "--json"]).args(args).output().unwrap();
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    let peer = &report["peer"];
    assert_eq!(peer["peer"], "pytorch-pipelining-gloo", "{report}");
    assert_eq!(peer["schedule"], "zb-h1");
    assert_eq!((peer["stages"].as_u64(), peer["layers"].as_u64(), peer["steps"].as_u64()), (Some(2), Some(2), Some(2)));
    assert!(peer["final_loss"].as_f64().is_some_and(f64::is_finite), "{report}");
    let ratio = number(&report, "tokens_per_s") / number(peer, "tokens_per_s");
    assert!((number(&report, "vs_peer") - ratio).abs() < 1e-9 * ratio, "{report}");
}

#[test]
fn bad_arguments_name_the_fix() {
    let cases: [(&[&str], &str); 4] = [
        (&["--schedule", "pipedream"], "gpipe, 1f1b, interleaved, zb-h1"),
        (&["--schedule", "1f1b", "--virtual-stages", "2"], "--schedule interleaved"),
        (&["--stages", "8", "--layers", "4"], "model.n_layers ≥ 8"),
        (&["--steps", "1"], "at least 2"),
    ];
    for (extra, expected) in cases {
        let mut args = vec!["bench", "pipeline"];
        args.extend_from_slice(extra);
        let output = troupe(&args);
        assert!(!output.status.success(), "{extra:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{extra:?}: {stderr}");
    }
}

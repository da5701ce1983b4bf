//! `troupe bench checkpoint` as a user runs it: every figure of the JSON report is there and positive,
//! the scratch directory is cleaned up, and bad input is refused with the flag named. Speed is not
//! asserted (the machine is shared): the figures are in docs/benchmarks.md.

use std::process::{Command, Output};

use serde_json::Value;

fn troupe(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).output().expect("troupe runs")
}

fn positive(report: &Value, key: &str) -> f64 {
    let value = report[key].as_f64().unwrap_or_else(|| panic!("{key} is not a number in {report}"));
    assert!(value > 0.0 && value.is_finite(), "{key} = {value} in {report}");
    value
}

#[test]
fn the_report_has_the_write_ratios_against_dd_and_the_snapshot_fraction() {
    let dir = tempfile::tempdir().unwrap();
    let dir_arg = dir.path().to_str().unwrap();
    let args = ["bench", "checkpoint", "--json", "--skip-large", "--shards", "2", "--repeats", "1", "--steps", "1"];
    let output = troupe(&[&args[..], &["--dir", dir_arg]].concat());
    assert!(output.status.success(), "troupe failed: {}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let events: Vec<Value> =
        stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap_or("?")).collect();
    assert_eq!(kinds, ["snapshot", "write", "summary"], "{stdout}");
    for key in ["snapshot_s", "fresh_snapshot_s", "step_s", "snapshot_fraction"] {
        positive(&events[0], key);
    }
    let write = &events[1];
    assert_eq!((write["state"].as_str(), write["shards"].as_u64()), (Some("gpt-tiny"), Some(2)), "{write}");
    // gpt-tiny's parameters and both AdamW moments, 4 bytes each, plus the safetensors headers.
    let bytes = positive(write, "bytes");
    assert!((3.0 * 3_323_392.0 * 4.0..41e6).contains(&bytes), "{write}");
    for key in ["MBps", "dd_MBps", "vs_dd", "without_catalog_vs_dd"] {
        positive(write, key);
    }
    positive(&events[2], "worst_write_vs_dd");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "the scratch directory is removed: {left:?}");
}

#[test]
fn bad_flags_are_refused_with_the_flag_named() {
    let output = troupe(&["bench", "checkpoint", "--shards", "0"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--shards"), "{stderr}");
}

//! scripts/gpu_check.py, the device check's runner (issue 31), gives each check the verdict its output
//! earns: a run on a lent GPU is read from its JSON lines alone, so a failure must never read as a pass
//! or a skip. Exercised here over stand-in binaries (shell scripts named as the real ones) that pass,
//! skip for want of CUDA, print a report, or fail; the real binaries skip on this machine (no GPU).
//! (It lives in troupe-chaos beside the other checks of the repository's scripts and documents.)

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Writes an executable shell script `name` into `dir`.
fn stand_in(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Runs the checks over the stand-ins in `bin`: the exit status and the JSON lines, by check name, as
/// printed and as written to $OUT/gpu-check.jsonl (which must agree).
fn run_checks(bin: &Path) -> (Option<i32>, Vec<Value>) {
    let out = tempfile::tempdir().unwrap();
    let done = Command::new("python3")
        .arg(repo().join("scripts/gpu_check.py"))
        .args(["--bin", bin.to_str().unwrap(), "--commit", "abc"])
        .env("OUT", out.path())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&done.stdout).into_owned();
    let written = std::fs::read_to_string(out.path().join("gpu-check.jsonl")).unwrap();
    assert_eq!(stdout, written, "printed and written lines differ; stderr: {}", String::from_utf8_lossy(&done.stderr));
    let lines = stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}"))).collect();
    (done.status.code(), lines)
}

fn line<'a>(lines: &'a [Value], check: &str) -> &'a Value {
    lines.iter().find(|l| l["check"] == check).unwrap_or_else(|| panic!("no line for {check}: {lines:?}"))
}

#[test]
fn each_check_gets_the_verdict_its_output_earns_and_a_failure_fails_the_run() {
    let bin = tempfile::tempdir().unwrap();
    // The trainer's test passes; NCCL's test returns early without a GPU, as it does on this machine;
    // the kernels' bench prints its report; the training bench fails.
    stand_in(bin.path(), "cuda_trainer", "echo 'gpt-tiny: cpu [1.0]'; echo 'test result: ok. 1 passed; 0 failed'");
    stand_in(bin.path(), "nccl", "echo 'one_rank: skipped, no CUDA device: the CUDA driver library is not installed'");
    // The daemon-level tests return early without a GPU, as they do on this machine.
    stand_in(
        bin.path(),
        "gpu_slots",
        "echo \"$2: skipped: no CUDA device (the driver reports none)\"; echo 'test result: ok. 1 passed; 0 failed'",
    );
    stand_in(
        bin.path(),
        "troupe",
        r#"case "$2" in
  kernels) echo 'not JSON'; echo '{"bench": "kernels", "gbps": 3000.5}' ;;
  train) echo 'loss is NaN at step 3' >&2; exit 3 ;;
esac"#,
    );
    let (code, lines) = run_checks(bin.path());
    assert_eq!(code, Some(1), "a failed check fails the run: {lines:?}");
    assert_eq!(lines[0]["check"], "device");
    assert_eq!(lines[0]["commit"], "abc");

    let trainer = line(&lines, "cuda_trainer_follows_the_cpu");
    assert_eq!(trainer["status"], "passed", "{trainer}");
    let nccl = line(&lines, "nccl_world1_collectives_abort_rebuild");
    assert_eq!(nccl["status"], "skipped", "{nccl}");
    assert!(nccl["detail"].as_str().unwrap().contains("no CUDA device"), "{nccl}");
    let kernels = line(&lines, "fused_kernels_beside_device_copy");
    assert_eq!((&kernels["status"], &kernels["report"]["gbps"]), (&"passed".into(), &3000.5.into()), "{kernels}");
    let train = line(&lines, "smollm2_135m_bf16_beside_pytorch_eager");
    assert_eq!(train["status"], "failed", "{train}");
    let detail = train["detail"].as_str().unwrap();
    assert!(detail.contains("exit 3") && detail.contains("loss is NaN at step 3"), "{train}");
    for check in [
        "ddp_on_a_gpu_slot_over_nccl",
        "two_ranks_share_the_gpu_over_the_host_plane",
        "zero_on_gpu_slots_over_nccl_and_host",
        "tensor_group_on_a_shared_gpu",
        "periodic_sync_on_a_shared_gpu",
    ] {
        let l = line(&lines, check);
        assert_eq!(l["status"], "skipped", "{l}");
        assert!(l["detail"].as_str().unwrap().contains("no CUDA device"), "{l}");
    }
    let compile = line(&lines, "smollm2_135m_bf16_beside_torch_compile");
    assert_eq!(compile["status"], "failed", "the same failing `bench train`: {compile}");
}

#[test]
fn a_benchmark_that_fails_for_want_of_cuda_is_skipped_and_the_run_passes() {
    let bin = tempfile::tempdir().unwrap();
    for test in ["cuda_trainer", "cuda_storage", "nccl", "gpu_slots"] {
        stand_in(bin.path(), test, "echo 'the_test: skipped, no CUDA device: libtorch sees none'");
    }
    stand_in(bin.path(), "troupe", "echo 'troupe: error: no CUDA device: libtorch sees none' >&2; exit 1");
    let (code, lines) = run_checks(bin.path());
    assert_eq!(code, Some(0), "{lines:?}");
    let statuses: Vec<&str> = lines[1..].iter().map(|l| l["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["skipped"; 13], "{lines:?}");
}

#[test]
fn a_test_binary_that_ran_no_test_fails_the_check() {
    // libtest exits 0 when `--exact` matches nothing: a renamed test must not read as a pass.
    let bin = tempfile::tempdir().unwrap();
    stand_in(bin.path(), "cuda_trainer", "echo 'running 0 tests'; echo 'test result: ok. 0 passed; 0 failed'");
    stand_in(bin.path(), "cuda_storage", "echo 'test result: ok. 1 passed; 0 failed'");
    stand_in(bin.path(), "nccl", "echo 'test result: ok. 1 passed; 0 failed'");
    stand_in(bin.path(), "gpu_slots", "echo 'test result: ok. 1 passed; 0 failed'");
    stand_in(bin.path(), "troupe", "echo '{}'");
    let (code, lines) = run_checks(bin.path());
    assert_eq!(code, Some(1), "{lines:?}");
    let trainer = line(&lines, "cuda_trainer_follows_the_cpu");
    assert_eq!(trainer["status"], "failed", "{trainer}");
    assert!(trainer["detail"].as_str().unwrap().contains("did not run"), "{trainer}");
    assert_eq!(line(&lines, "nccl_world1_collectives_abort_rebuild")["status"], "passed");
}

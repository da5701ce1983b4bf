//! Every shipped chaos scenario passes, run as a user runs it: `troupe chaos run --scenario NAME --json`
//! (which hands over to the troupe-chaos binary), daemons as real processes on loopback.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `troupe` binary built beside this package's `troupe-chaos`.
fn troupe() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_BIN_EXE_troupe-chaos")).with_file_name("troupe");
    assert!(path.exists(), "{} is missing: build it first (cargo build --release --bin troupe)", path.display());
    path
}

/// Runs `scenario` with `seed` and returns its JSON report, after checking it passed.
fn run(scenario: &str, seed: u64) -> Value {
    let mut child = Command::new(troupe())
        .args(["chaos", "run", "--scenario", scenario, "--seed", &seed.to_string(), "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("troupe chaos starts");
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(240) {
            let _ = child.kill();
            panic!("troupe chaos run --scenario {scenario} --seed {seed} still running after 240 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
    let report: Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|e| panic!("{scenario}: the report is not JSON ({e}): {out:?}"));
    let failed: Vec<&Value> = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .chain(report["bad_inputs"].as_array().unwrap())
        .filter(|c| c["passed"] != true)
        .collect();
    assert!(
        status.success() && report["passed"] == true,
        "scenario {scenario} failed with seed {seed} (replay: troupe chaos run --scenario {scenario} --seed {seed}): {failed:#?}\nlogs: {}",
        report["kept"]
    );
    assert_eq!(report["data_lost"], 0);
    report
}

/// A scenario that needs a privilege the machine lacks reports itself skipped; say so loudly.
fn skipped(report: &Value) -> bool {
    if let Some(why) = report["skipped"].as_str() {
        eprintln!("SKIPPED {}: {why}", report["scenario"]);
        return true;
    }
    false
}

fn faults(report: &Value, kind: &str) -> u64 {
    report["faults"][kind].as_u64().unwrap_or(0)
}

#[test]
fn kill_worker() {
    let r = run("kill-worker", 11);
    assert_eq!(faults(&r, "kill"), 1);
    assert_eq!(r["detection_s"]["samples"], 1, "the loss was detected: {r}");
    assert!(r["recoveries"].as_u64().unwrap() >= 1);
}

#[test]
fn kill_two_workers() {
    let r = run("kill-two-workers", 12);
    assert_eq!(faults(&r, "kill"), 1);
    assert!(r["recoveries"].as_u64().unwrap() >= 1);
}

/// fp16 with an injected overflow and a SIGKILL: the overflowing step is skipped on every rank (one
/// global verdict), and the run lands on the fp16 reference within the 16-bit tolerance.
#[test]
fn fp16_overflow_and_kill() {
    let r = run("fp16-overflow-and-kill", 21);
    assert_eq!(faults(&r, "kill"), 1);
    let checks = r["checks"].as_array().unwrap();
    let skipped = checks.iter().find(|c| c["name"] == "exactly the overflowing steps skipped");
    assert!(skipped.is_some_and(|c| c["passed"] == true), "{r}");
}

/// pp = 2 × dp = 2 loses a stage's daemon: the survivors form one pipeline from the other replica's
/// state — nothing redone — and land on the reference.
#[test]
fn pipeline_kill_stage() {
    let r = run("pipeline-kill-stage", 22);
    assert_eq!(faults(&r, "kill"), 1);
    assert!(r["recoveries"].as_u64().unwrap() >= 1, "{r}");
    assert_eq!(r["steps_redone"], 0, "restored from the other replica, not a checkpoint: {r}");
}

#[test]
fn kill_and_return() {
    let r = run("kill-and-return", 13);
    assert!(r["recoveries"].as_u64().unwrap() >= 2, "shrink, then grow: {r}");
}

/// The controller's daemon dies mid-step and comes back: it restarts from its catalog (epoch, job, events)
/// and resumes from the step the workers hold in memory — no rollback, no step redone — while the
/// client's watcher reconnects and misses no event.
#[test]
fn kill_controller_node() {
    let r = run("kill-controller-node", 23);
    assert_eq!(faults(&r, "kill"), 1);
    assert!(r["recoveries"].as_u64().unwrap() >= 1, "{r}");
    // From the workers' memory, not a checkpoint: nothing redone — but the step whose commit the
    // controller recorded and died before sending, when the kill lands there.
    assert!(r["steps_redone"].as_u64().unwrap() <= 1, "resumed from the workers' memory: {r}");
}

/// The controller's daemon stopped past the failure timeout: when it wakes it declares its silent members
/// failed and trains on with its own rank, fences them when they speak, and they rejoin keeping their
/// committed state — the job regrows with no step redone.
#[test]
fn pause_controller_node() {
    let r = run("pause-controller-node", 24);
    assert_eq!(faults(&r, "pause"), 1);
    assert!(r["recoveries"].as_u64().unwrap() >= 2, "shrunk, then regrown: {r}");
    assert_eq!(r["steps_redone"], 0, "{r}");
}

#[test]
fn pause_beyond_timeout() {
    let r = run("pause-beyond-timeout", 14);
    assert_eq!(faults(&r, "pause"), 1);
    assert!(r["recoveries"].as_u64().unwrap() >= 2, "dropped, then rejoined after the fence: {r}");
}

#[test]
fn rolling_restart() {
    let r = run("rolling-restart", 15);
    assert!(r["recoveries"].as_u64().unwrap() >= 4, "two leaves and two rejoins: {r}");
}

#[test]
fn corrupt_latest_checkpoint() {
    let r = run("corrupt-latest-checkpoint", 16);
    assert!(r["steps_redone"].as_u64().unwrap() > 0, "a rollback redoes steps: {r}");
}

#[test]
fn disk_full_during_checkpoint() {
    let r = run("disk-full-during-checkpoint", 17);
    if !skipped(&r) {
        assert_eq!(faults(&r, "fill-disk"), 1);
    }
}

#[test]
fn a_bad_scenario_is_refused_with_the_key_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mine.toml");
    std::fs::write(&path, "description = \"x\"\n[[faults]]\nkind = \"kill\"\nnode = 0\nat_step = 2\n").unwrap();
    let out = Command::new(troupe()).args(["chaos", "run", "--scenario"]).arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("faults[0]") && stderr.contains("controller"), "{stderr}");
    let out = Command::new(troupe()).args(["chaos", "run", "--scenario", "no-such"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("kill-worker"), "lists the shipped scenarios");
}

#[test]
fn partition_minority() {
    let r = run("partition-minority", 18);
    if !skipped(&r) {
        assert_eq!(faults(&r, "partition"), 1);
        assert_eq!(r["detection_s"]["samples"], 1, "the cut-off node was detected: {r}");
    }
}

/// The controller's node cut off: it declares its members failed and trains on alone (only it commits,
/// so the cut-off majority cannot diverge); when the link heals they are fenced and rejoin with their
/// state, nothing redone.
#[test]
fn partition_controller_node() {
    let r = run("partition-controller-node", 25);
    if !skipped(&r) {
        assert_eq!(faults(&r, "partition"), 1);
        assert_eq!(r["steps_redone"], 0, "{r}");
        assert!(r["recoveries"].as_u64().unwrap() >= 2, "shrunk, then regrown: {r}");
    }
}

#[test]
fn partition_one_way() {
    let r = run("partition-one-way", 19);
    if !skipped(&r) {
        assert_eq!(faults(&r, "partition"), 1);
    }
}

#[test]
fn flaky_link() {
    let r = run("flaky-link", 20);
    if !skipped(&r) {
        assert_eq!(faults(&r, "flaky-link"), 1);
    }
}

#[test]
fn chaos_list_names_every_shipped_scenario_as_json() {
    let out = Command::new(troupe()).args(["chaos", "list", "--json"]).output().expect("troupe chaos list runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let listed: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let names: Vec<&str> = listed.iter().map(|l| l["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), troupe_chaos::harness::SHIPPED.len(), "{names:?}");
    assert!(names.contains(&"kill-worker"), "{names:?}");
    for line in &listed {
        assert!(line["nodes"].as_u64().unwrap() >= 2 && !line["faults"].as_array().unwrap().is_empty(), "{line}");
        assert!(!line["description"].as_str().unwrap().is_empty(), "{line}");
    }
}

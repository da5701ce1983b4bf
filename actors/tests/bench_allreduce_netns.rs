//! `troupe bench allreduce --netns`: ranks in separate network namespaces joined by veth links (and
//! Gloo's over the same namespaces) run end to end at a tiny size, the all-reduce's result is checked
//! (`verified`: one more all-reduce of rank-dependent integers gives exactly their sum on every rank),
//! and no namespace is left behind — after a failure too. Needs root and iproute2: without root the
//! benchmark must refuse, naming --netns, and that is what is checked then.

use std::process::{Command, Output};

use serde_json::Value;

/// Runs troupe; returns its output and the namespaces named after its pid that exist afterwards.
fn troupe<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (Output, Vec<String>) {
    let child = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("troupe runs");
    let tag = format!("troupe-bench-{}-", child.id());
    let out = child.wait_with_output().expect("troupe exits");
    let list = Command::new("ip").args(["netns", "list"]).output().map(|o| o.stdout).unwrap_or_default();
    let left = String::from_utf8_lossy(&list).lines().filter(|l| l.starts_with(&tag)).map(String::from).collect();
    (out, left)
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn report(args: &[String]) -> Option<Value> {
    let (out, left) = troupe(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !is_root() {
        assert!(!out.status.success() && stderr.contains("--netns needs root"), "not root: {stderr}");
        return None;
    }
    assert!(out.status.success(), "{} failed: {stderr}", args.join(" "));
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    Some(serde_json::from_str(stdout.lines().last().expect("a JSON line")).expect("JSON"))
}

fn tiny(transport: &str, world: &str) -> Vec<String> {
    let args = ["bench", "allreduce", "--netns", "2", "--world", world, "--mib", "1", "--iters", "2", "--warmup", "1"];
    args.into_iter().chain(["--transport", transport, "--json", "--timeout-s", "120"]).map(String::from).collect()
}

#[test]
fn encrypted_tcp_between_two_namespaces_beside_gloo_over_the_same_veth() {
    let mut args = tiny("encrypted-tcp", "2");
    args.push("--peer".into());
    let Some(r) = report(&args) else { return };
    assert_eq!(r["netns"], 2);
    assert_eq!(r["world"], 2);
    assert_eq!(r["verified"], true, "{r}");
    assert!(r["busbw_GBps"].as_f64().unwrap() > 0.0, "{r}");
    let peer = &r["peer"];
    assert_eq!(peer["name"], "gloo", "{r}");
    assert_eq!(peer["world"], 2);
    assert!(peer["busbw_GBps"].as_f64().unwrap() > 0.0, "{r}");
    // CPU per all-reduce, ours beside Gloo's, both measured by the processes over their timed loops.
    let (ours, theirs) = (r["cpu_seconds_per_iter"].as_f64().unwrap(), peer["cpu_seconds_per_iter"].as_f64().unwrap());
    assert!(ours > 0.0 && theirs > 0.0, "{r}");
    assert!((r["cpu_ratio_vs_peer"].as_f64().unwrap() - ours / theirs).abs() <= 1e-9 * ours / theirs, "{r}");
}

#[test]
fn four_ranks_over_quic_in_two_namespaces_run_in_two_tiers() {
    let Some(r) = report(&tiny("quic", "4")) else { return };
    assert_eq!(r["verified"], true, "{r}");
    assert_eq!(r["host_tier"], true, "two ranks per namespace share their host's memory: {r}");
}

#[test]
fn a_failing_run_leaves_no_namespace_behind() {
    if !is_root() {
        return;
    }
    // The ranks run; the Gloo peer cannot start (no such python): the benchmark fails after the
    // namespaces were made.
    let mut args = tiny("plaintext-tcp", "2");
    args.extend(["--peer", "--python", "/nonexistent/python"].map(String::from));
    let (out, left) = troupe(&args);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("gloo rank 0"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

#[test]
fn netns_refuses_what_it_cannot_run() {
    let (out, _) = troupe(&["bench", "allreduce", "--netns", "2", "--transport", "local"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--netns puts ranks on separate hosts"));
    let (out, _) = troupe(&["bench", "allreduce", "--netns", "3", "--world", "2"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--netns 3 with --world 2"));
    let (out, _) = troupe(&["bench", "allreduce", "--rate-gbit", "1"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rate-gbit shapes the links between namespaces"));
}

//! `troupe bench crypto`: runs, and prints one JSON object per rustls crypto provider built in (ring
//! at least) with its cipher suite and positive seal/open rates, and with --peer OpenSSL's line
//! (where openssl is installed). No timing is asserted.

use std::process::Command;

use serde_json::Value;

fn troupe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_troupe")).args(args).output().expect("troupe runs")
}

fn json_lines(out: &std::process::Output) -> Vec<Value> {
    assert!(out.status.success(), "troupe failed: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}"))).collect()
}

fn rate(report: &Value, key: &str) -> f64 {
    let v = report[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {report}"));
    assert!(v.is_finite() && v > 0.0, "{key} = {v} in {report}");
    v
}

#[test]
fn bench_crypto_prints_a_json_report_per_provider() {
    let lines = json_lines(&troupe(&["bench", "crypto", "--mib", "1", "--iters", "1", "--json"]));
    let ring = lines.iter().find(|l| l["provider"] == "ring").expect("a ring line");
    assert_eq!(ring["bench"], "crypto");
    assert!(ring["suite"].as_str().unwrap().contains("AES_128_GCM"), "{ring}");
    assert_eq!(ring["mib"], 1);
    rate(ring, "seal_gbps");
    rate(ring, "open_gbps");
    assert!(lines.iter().all(|l| l.get("peer").is_none()), "no peer line without --peer");
}

#[test]
fn bench_crypto_peer_prints_openssl_beside() {
    if Command::new("openssl").arg("version").output().is_err() {
        eprintln!("openssl is not installed: --peer's line not checked");
        return;
    }
    let lines = json_lines(&troupe(&["bench", "crypto", "--mib", "1", "--iters", "1", "--peer", "--json"]));
    let peer = lines.iter().find(|l| l["peer"] == "openssl").expect("an openssl line");
    assert!(peer["version"].as_str().unwrap().starts_with("OpenSSL"), "{peer}");
    assert_eq!(peer["block_bytes"], 16384);
    rate(peer, "seal_gbps");
    assert!(lines.iter().any(|l| l["provider"] == "ring"), "ours beside the peer");
}

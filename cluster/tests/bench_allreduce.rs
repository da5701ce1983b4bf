//! The all-reduce benchmark as a user runs it (`troupe-cluster-rank bench`, the libtorch-free twin of
//! `troupe bench allreduce`): one JSON line with the bus bandwidth and how the ranks ran, and plain
//! errors for placements and overrides it cannot honour.

use std::process::{Command, Output};

fn bench(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_troupe-cluster-rank"))
        .arg("bench")
        .args(["--mib", "1", "--iters", "2", "--warmup", "1", "--json"])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("the benchmark starts")
}

fn report(args: &[&str]) -> serde_json::Value {
    let out = bench(args, &[]);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap()
}

fn error(args: &[&str], env: &[(&str, &str)]) -> String {
    let out = bench(args, env);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn reports_bandwidth_and_how_the_ranks_ran() {
    let quic = report(&["--world", "2"]);
    assert!(quic["busbw_GBps"].as_f64().unwrap() > 0.0, "{quic}");
    assert_eq!((quic["transport"].as_str(), quic["host_tier"].as_bool()), (Some("quic"), Some(false)), "{quic}");
    let local = report(&["--world", "2", "--transport", "local"]);
    assert_eq!(local["shared_memory"], true, "{local}");
    let tiers = report(&["--world", "4", "--hosts", "2"]);
    assert_eq!((tiers["hosts"].as_u64(), tiers["host_tier"].as_bool()), (Some(2), Some(true)), "{tiers}");
    assert_eq!(tiers["same_host_routes"], true, "{tiers}");
    let flat = report(&["--world", "4", "--hosts", "2", "--flat"]);
    assert_eq!(flat["host_tier"], false, "{flat}");
    assert_eq!(flat["same_host_routes"], true, "ranks of one host still talk over their sockets: {flat}");
    let one_each = report(&["--world", "2", "--hosts", "2"]);
    assert_eq!(one_each["same_host_routes"], false, "no host holds two ranks: {one_each}");
}

/// The CPU figure is what the ranks' processes used over the timed all-reduces: more than nothing, no
/// more than every core for the whole time, and per payload byte what it is per all-reduce.
#[test]
fn reports_the_cpu_the_ranks_used_per_all_reduce() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    for transport in ["quic", "encrypted-tcp", "local"] {
        let r = report(&["--world", "2", "--transport", transport]);
        let (cpu, seconds) = (r["cpu_seconds_per_iter"].as_f64().unwrap(), r["seconds_per_iter"].as_f64().unwrap());
        assert!(cpu > 0.0 && cpu <= cores * seconds * 1.5, "{transport}: {cores} cores: {r}");
        let per_byte = cpu * 1e9 / (1 << 20) as f64;
        assert!((r["cpu_ns_per_byte"].as_f64().unwrap() - per_byte).abs() <= 1e-9 * per_byte, "{transport}: {r}");
    }
}

#[test]
fn placements_and_overrides_it_cannot_honour_are_refused_by_name() {
    assert!(error(&["--world", "2", "--hosts", "3"], &[]).contains("--hosts 3 with --world 2: use 1 to 2 hosts"));
    assert!(error(&["--world", "2", "--hosts", "2", "--transport", "local"], &[]).contains("needs --transport quic"));
    let typo = error(&["--world", "2"], &[("TROUPE_TRANSPORT_CONFIG", r#"{"pipeline_slice_byte": 1}"#)]);
    assert!(typo.contains("unknown field `pipeline_slice_byte`") && typo.contains("TROUPE_TRANSPORT_CONFIG"), "{typo}");
    let not_object = error(&["--world", "2"], &[("TROUPE_TRANSPORT_CONFIG", "[1]")]);
    assert!(not_object.contains("not a JSON object"), "{not_object}");
}

#[test]
fn a_bad_argument_gets_the_usage_error_and_exit_code_2() {
    let backtrace = [("RUST_BACKTRACE", "1")];
    for (args, needle) in [
        (&["--wrold", "2"][..], "unexpected argument '--wrold'"),
        (&["--transport", "udp"][..], "unknown transport \"udp\": use quic, local, encrypted-tcp or plaintext-tcp"),
        (&["--world", "many"][..], "invalid value 'many' for '--world <WORLD>'"),
    ] {
        let out = bench(args, &backtrace);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle) && stderr.contains("try '--help'"), "{args:?}: {stderr}");
        assert!(!stderr.contains("backtrace"), "{args:?}: {stderr}");
    }
}

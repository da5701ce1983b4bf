//! Separate rank processes (the `troupe-cluster-rank` binary) over real QUIC on loopback, over the
//! same-host transport and over the plaintext TCP data plane: every collective checked against the
//! reference; a SIGKILLed (or stopped) rank makes every other rank fail with a typed error within the
//! detection timeout, and nobody hangs.

use std::path::Path;
use std::time::{Duration, Instant};

use troupe_cluster::bench::{launch_ranks, BenchTransport, Placement, RankMode, RankReport};
use troupe_cluster::TransportConfig;

fn exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_troupe-cluster-rank"))
}

fn check_on(world: usize, transport: BenchTransport, config: TransportConfig, placement: Placement) -> Vec<RankReport> {
    let launched = launch_ranks(exe(), &[], world, transport, RankMode::Check, config, placement).unwrap();
    let reports = launched.wait_all(180_000).unwrap();
    for r in &reports {
        assert!(r.error.is_none(), "{transport:?} world {world} rank {}: {:?}", r.rank, r.error);
        assert!(r.checks_passed > 0);
    }
    reports
}

fn check_with(world: usize, transport: BenchTransport, config: TransportConfig) -> Vec<RankReport> {
    check_on(world, transport, config, Placement::ONE_HOST)
}

fn check(world: usize, transport: BenchTransport) {
    check_with(world, transport, TransportConfig::loopback());
}

#[test]
fn four_ranks_over_quic_run_every_collective_correctly() {
    check(4, BenchTransport::Quic);
}

#[test]
fn two_and_three_ranks_over_quic() {
    check(2, BenchTransport::Quic);
    check(3, BenchTransport::Quic);
}

/// Ranks on two hosts (loopback addresses 127.0.0.1 and 127.0.0.2) all-reduce in two tiers — within
/// each host in its arena, across hosts over QUIC — and every collective still equals the reference
/// bit for bit: two ranks per host (each rank carries half of every slice across), and three ranks
/// over two hosts (the leaders carry it all). Small slots and slices make the pipeline of slices and
/// the arena's blocks both many. Flat (`--flat`), every collective is one ring over all four ranks
/// whose messages between the two ranks of a host take their Unix sockets, the others QUIC.
#[test]
fn ranks_on_two_hosts_all_reduce_in_two_tiers() {
    let config = TransportConfig {
        shared_memory_slot_bytes: 12_000,
        pipeline_slice_bytes: 64 << 10,
        ..TransportConfig::loopback()
    };
    for world in [4, 3] {
        let reports = check_on(world, BenchTransport::Quic, config.clone(), Placement { hosts: 2, flat: false });
        assert!(reports.iter().all(|r| r.host_tier), "world {world}: not in two tiers: {reports:?}");
        // Three ranks: 0 and 1 on the first host, 2 alone on the second.
        let shares_a_host = |r: &RankReport| world == 4 || r.rank < 2;
        assert!(
            reports.iter().all(|r| r.same_host_routes == shares_a_host(r)),
            "world {world}: host neighbours not over their sockets: {reports:?}"
        );
    }
    let flat = check_on(4, BenchTransport::Quic, config, Placement { hosts: 2, flat: true });
    assert!(flat.iter().all(|r| !r.host_tier && r.same_host_routes), "{flat:?}");
}

#[test]
fn three_ranks_over_the_same_host_transport() {
    // In the shared-memory arena (the default), with slots small enough that the 300 001-element
    // checks take many blocks of both slots and the pieces split unevenly.
    let config = TransportConfig { shared_memory_slot_bytes: 12_000, ..TransportConfig::loopback() };
    let reports = check_with(3, BenchTransport::Local, config);
    assert!(reports.iter().all(|r| r.shared_memory), "the arena was not used: {reports:?}");
    // And over the sockets, with the arena turned off.
    let config = TransportConfig { shared_memory_slot_bytes: 0, ..TransportConfig::loopback() };
    let reports = check_with(2, BenchTransport::Local, config);
    assert!(reports.iter().all(|r| !r.shared_memory));
}

/// The opt-in plaintext TCP data plane, set up through the QUIC mesh: every collective on one host
/// and on two (two tiers, the cross-host tier over TCP; host neighbours over their sockets).
#[test]
fn four_ranks_over_plaintext_tcp_run_every_collective_correctly() {
    check(4, BenchTransport::PlaintextTcp);
    let config = TransportConfig {
        shared_memory_slot_bytes: 12_000,
        pipeline_slice_bytes: 64 << 10,
        ..TransportConfig::loopback()
    };
    let reports = check_on(4, BenchTransport::PlaintextTcp, config, Placement { hosts: 2, flat: false });
    assert!(reports.iter().all(|r| r.host_tier && r.same_host_routes), "{reports:?}");
}

/// The opt-in encrypted TCP data plane (mutual TLS 1.3, set up through the QUIC mesh):
/// every collective on one host, and on two hosts flat, so that host pairs and cross-host pairs both
/// carry every collective's messages.
#[test]
fn four_ranks_over_encrypted_tcp_run_every_collective_correctly() {
    check(4, BenchTransport::EncryptedTcp);
    let config = TransportConfig { pipeline_slice_bytes: 64 << 10, ..TransportConfig::loopback() };
    let reports = check_on(4, BenchTransport::EncryptedTcp, config, Placement { hosts: 2, flat: true });
    assert!(reports.iter().all(|r| !r.host_tier && r.same_host_routes), "{reports:?}");
}

fn sigkill_during_all_reduce(transport: BenchTransport, placement: Placement) {
    signal_during_all_reduce(transport, placement, libc::SIGKILL);
}

/// Rank 2 gets `signal` while the four ranks all-reduce in a loop: SIGKILL (its sockets close at once)
/// or SIGSTOP (it falls silent, every connection still open: only keep-alives can tell).
fn signal_during_all_reduce(transport: BenchTransport, placement: Placement, signal: libc::c_int) {
    let config = TransportConfig::loopback();
    let detect_ms = config.idle_timeout_ms;
    let mode = RankMode::Loop { elems: 1 << 18, seconds: 60 };
    let mut launched = launch_ranks(exe(), &[], 4, transport, mode, config, placement).unwrap();
    // Let the ranks connect and start all-reducing.
    std::thread::sleep(Duration::from_millis(3_000));
    for (r, c) in launched.children.iter_mut().enumerate() {
        assert!(c.try_wait().unwrap().is_none(), "rank {r} exited before the kill");
    }
    // SAFETY: kill(2) on our own child's pid, which has not been reaped (checked running above).
    assert_eq!(unsafe { libc::kill(launched.children[2].id() as libc::pid_t, signal) }, 0);
    let killed_at = Instant::now();
    // Detection timeout + time for a loaded 2-core machine to schedule the survivors.
    let deadline = killed_at + Duration::from_millis(detect_ms + 4_000);
    let mut failures = Vec::new();
    for (r, c) in launched.children.iter_mut().enumerate().filter(|(r, _)| *r != 2) {
        let report = troupe_cluster::bench::launch::wait_one(r, c, deadline).unwrap_or_else(|| {
            let _ = c.kill();
            panic!("{transport:?}: rank {r} still running {} ms after the signal", killed_at.elapsed().as_millis())
        });
        failures.push((
            r,
            report.error_kind.clone(),
            report.error.clone(),
            report.failed_after_ms,
            killed_at.elapsed(),
        ));
    }
    let _ = launched.children[2].kill();
    let _ = launched.children[2].wait();
    for (r, kind, error, call_ms, after) in failures {
        assert_eq!(kind.as_deref(), Some("PeerLost"), "{transport:?} rank {r}: {error:?}");
        eprintln!(
            "{transport:?} rank {r}: {error:?} ({call_ms:?} ms into its call), reported {} ms after the signal",
            after.as_millis()
        );
    }
}

#[test]
fn sigkilled_rank_fails_the_others_over_quic_within_the_timeout() {
    sigkill_during_all_reduce(BenchTransport::Quic, Placement::ONE_HOST);
}

/// Rank 2 (on the second host, with rank 3) dies during two-tier all-reduces: its host peer learns it
/// in the arena, the first host's ranks over QUIC or from a peer that gave its arena call up.
#[test]
fn sigkilled_rank_fails_the_others_in_two_tiers_within_the_timeout() {
    sigkill_during_all_reduce(BenchTransport::Quic, Placement { hosts: 2, flat: false });
}

/// The same, flat over two hosts: rank 3 learns of its host neighbour's death on their socket, ranks 0
/// and 1 over QUIC — and rank 0, whose ring neighbours are 1 (its socket) and 3 (QUIC), is never left
/// waiting on a path that saw nothing.
#[test]
fn sigkilled_rank_fails_the_others_flat_over_two_hosts_within_the_timeout() {
    sigkill_during_all_reduce(BenchTransport::Quic, Placement { hosts: 2, flat: true });
}

#[test]
fn sigkilled_rank_fails_the_others_over_plaintext_tcp_within_the_timeout() {
    sigkill_during_all_reduce(BenchTransport::PlaintextTcp, Placement::ONE_HOST);
}

/// A rank that stops (SIGSTOP: a hung host) keeps its TCP connections open, and the kernel still
/// acknowledges what is sent to it; only the QUIC mesh's keep-alives notice, and the TCP data plane
/// must fail its receives on that loss within the idle timeout rather than wait out the collective
/// backstop (60 s).
#[test]
fn a_stopped_rank_fails_the_others_over_plaintext_tcp_within_the_idle_timeout() {
    signal_during_all_reduce(BenchTransport::PlaintextTcp, Placement::ONE_HOST, libc::SIGSTOP);
}

#[test]
fn sigkilled_rank_fails_the_others_over_encrypted_tcp_within_the_timeout() {
    sigkill_during_all_reduce(BenchTransport::EncryptedTcp, Placement::ONE_HOST);
}

#[test]
fn sigkilled_rank_fails_the_others_over_the_same_host_transport() {
    sigkill_during_all_reduce(BenchTransport::Local, Placement::ONE_HOST);
}

/// A /dev/shm that cannot hold the segments (a container's small default, say): every rank says why,
/// all fall back to the sockets together, and the collectives complete. Needs a private mount
/// namespace (`unshare -m`, root); skipped with the reason otherwise.
#[test]
fn a_dev_shm_too_small_sends_every_rank_over_the_sockets() {
    let script = format!(
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {} bench --world 3 --mib 4 --iters 2 --transport local --json",
        exe().display()
    );
    let out = match std::process::Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .env("RUST_LOG", "warn")
        .arg(&script)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED a_dev_shm_too_small_sends_every_rank_over_the_sockets: no unshare ({e})");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() && stderr.contains("mount") {
        eprintln!("SKIPPED a_dev_shm_too_small_sends_every_rank_over_the_sockets: cannot mount a private /dev/shm here (needs root): {stderr}");
        return;
    }
    assert!(out.status.success(), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap();
    assert_eq!(report["shared_memory"], false, "{stdout}");
    assert!(report["busbw_GBps"].as_f64().unwrap() > 0.0, "{stdout}");
    assert_eq!(stderr.matches("no shared-memory arena").count(), 3, "each rank says why: {stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
}

//! A peer process's death is an event, not a silence: a control connection's peer SIGKILLed in a
//! child process is reported `Lost` within milliseconds (by its companion TCP connection), far below
//! the QUIC idle timeout; a paused process, a stranger on the companion port, and the old process of a
//! replaced connection cause nothing.
//!
//! The child is this test binary again, running the ignored test `child_dials_and_waits`.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use support::cluster;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc::UnboundedReceiver;
use troupe_cluster::control::verify::any_node_name_tls;
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::{NodeIdentity, TransportConfig};

type Events = UnboundedReceiver<ControlEvent>;

/// The child's environment: cluster directory, its node name, the address to dial.
const CHILD_DIR: &str = "TROUPE_TEST_CHILD_DIR";
const CHILD_NAME: &str = "TROUPE_TEST_CHILD_NAME";
const CHILD_DIAL: &str = "TROUPE_TEST_CHILD_DIAL";
/// The bound the tests assert, issue 38's: a SIGKILLed peer is `Lost` by its connection's end in under
/// 100 ms (measured p50 0.7 ms, max 2.1 ms; the figures are printed).
const LOST_WITHIN: Duration = Duration::from_millis(100);
/// Kills measured in the latency test.
const KILLS: usize = 10;

/// A QUIC idle timeout far above the bound: only the companion can report the death in time.
fn config() -> TransportConfig {
    TransportConfig { idle_timeout_ms: 20_000, keep_alive_interval_ms: 1_000, ..support::config() }
}

fn bind(id: &NodeIdentity) -> (ControlEndpoint, Events) {
    ControlEndpoint::bind(id, "127.0.0.1:0".parse().unwrap(), PeerRole::Node, &config()).unwrap()
}

/// The longest a connection may take to get its companion: it usually comes within milliseconds, but 5 s
/// was once not enough on a machine loaded by the rest of the suite.
const COMPANION_WAIT: Duration = Duration::from_secs(30);

/// Not a test: the child process. Dials, says it is ready, and waits to be killed.
#[test]
#[ignore = "the child process of the other tests"]
fn child_dials_and_waits() {
    let (Ok(dir), Ok(name), Ok(dial)) =
        (std::env::var(CHILD_DIR), std::env::var(CHILD_NAME), std::env::var(CHILD_DIAL))
    else {
        return;
    };
    let id = NodeIdentity::load(Path::new(&dir), &name).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (endpoint, _events) = bind(&id);
        let peer = endpoint.connect(dial.parse().unwrap()).await.unwrap();
        let deadline = Instant::now() + COMPANION_WAIT;
        while !endpoint.watches_process(&peer) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Straight to the pipe: libtest captures `println!`.
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {}", endpoint.watches_process(&peer)).unwrap();
        out.flush().unwrap();
        drop(out);
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

/// A child process `name` that dialed `addr` and set up its companion.
fn spawn_child(dir: &Path, name: &str, addr: SocketAddr) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["child_dials_and_waits", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_DIR, dir)
        .env(CHILD_NAME, name)
        .env(CHILD_DIAL, addr.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // libtest writes "test child_dials_and_waits ... " before it on the same line.
    let ready = lines.find_map(|l| l.ok().and_then(|l| l.find("READY").map(|at| l[at..].to_string())));
    if ready.as_deref() != Some("READY true") {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert_eq!(ready.as_deref(), Some("READY true"), "the child's companion connection is set up");
    child
}

async fn next(rx: &mut Events) -> ControlEvent {
    tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("an event within 5 s").expect("events open")
}

async fn quiet(rx: &mut Events, for_ms: u64) {
    if let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(for_ms), rx.recv()).await {
        panic!("unexpected event {e:?}");
    }
}

/// Waits until `endpoint`'s connection to `peer` has its companion.
async fn watched(endpoint: &ControlEndpoint, peer: &str) {
    let deadline = Instant::now() + COMPANION_WAIT;
    while !endpoint.watches_process(peer) {
        assert!(Instant::now() < deadline, "no companion connection to {peer} within {COMPANION_WAIT:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn kill(child: &Child, signal: libc::c_int) {
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_peer_process_is_lost_within_milliseconds() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let (survivor, mut events) = bind(&ids[0]);
    let mut latencies = Vec::new();
    for _ in 0..KILLS {
        let mut child = spawn_child(dir.path(), "node-b", survivor.local_addr());
        assert!(matches!(next(&mut events).await, ControlEvent::Connected { peer, .. } if peer == "node-b"));
        watched(&survivor, "node-b").await;
        kill(&child, libc::SIGKILL);
        let killed = Instant::now();
        let event = next(&mut events).await;
        let took = killed.elapsed();
        child.wait().unwrap();
        match event {
            ControlEvent::Lost { peer, reason } => {
                assert_eq!(peer, "node-b");
                assert!(reason.contains("peer process is gone"), "{reason}");
            }
            other => panic!("expected Lost, got {other:?}"),
        }
        assert!(took < LOST_WITHIN, "Lost {took:?} after the kill (idle timeout 20 s)");
        latencies.push(took);
    }
    latencies.sort();
    println!("SIGKILL -> Lost over {KILLS} kills: p50 {:?}, max {:?}", latencies[KILLS / 2], latencies[KILLS - 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_peer_process_is_not_lost() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let (survivor, mut events) = bind(&ids[0]);
    let mut child = spawn_child(dir.path(), "node-b", survivor.local_addr());
    assert!(matches!(next(&mut events).await, ControlEvent::Connected { .. }));
    watched(&survivor, "node-b").await;
    kill(&child, libc::SIGSTOP);
    quiet(&mut events, 2_000).await;
    kill(&child, libc::SIGCONT);
    quiet(&mut events, 300).await;
    assert!(survivor.watches_process("node-b"), "still connected and watched after the pause");
    kill(&child, libc::SIGKILL);
    assert!(matches!(next(&mut events).await, ControlEvent::Lost { .. }), "and a kill after it is still seen");
    child.wait().unwrap();
}

/// A stranger (no certificate, a foreign one, or a member without the connection's secret) that
/// connects to the companion port and closes — cleanly or with a reset — causes no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_closing_a_companion_connection_means_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let foreign_dir = tempfile::tempdir().unwrap();
    let foreign = cluster(foreign_dir.path(), &["node-b"]);
    let ((a, mut ra), (b, mut rb)) = (bind(&ids[0]), bind(&ids[1]));
    b.connect(a.local_addr()).await.unwrap();
    next(&mut ra).await;
    next(&mut rb).await;
    watched(&a, "node-b").await;
    watched(&b, "node-a").await;
    let port = a.local_addr();

    // No TLS at all: close at once, send garbage, reset.
    drop(tokio::net::TcpStream::connect(port).await.unwrap());
    let mut tcp = tokio::net::TcpStream::connect(port).await.unwrap();
    tcp.write_all(&[0x16; 64]).await.unwrap();
    drop(tcp);
    let tcp = tokio::net::TcpStream::connect(port).await.unwrap();
    socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO)).unwrap();
    drop(tcp);
    // TLS from a foreign CA (refused in the handshake), and from a member of this cluster with a
    // guessed secret, each then reset.
    for (id, secret) in [(&foreign[0], [7u8; 32]), (&ids[1], [0u8; 32])] {
        let connector = tokio_rustls::TlsConnector::from(Arc::new(any_node_name_tls(id).unwrap()));
        let tcp = tokio::net::TcpStream::connect(port).await.unwrap();
        socket2::SockRef::from(&tcp).set_linger(Some(Duration::ZERO)).unwrap();
        let name = rustls::pki_types::ServerName::try_from("troupe-node").unwrap();
        if let Ok(mut tls) = connector.connect(name, tcp).await {
            let _ = tls.write_all(&secret).await;
            let _ = tls.flush().await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    quiet(&mut ra, 500).await;
    quiet(&mut rb, 100).await;
    assert!(a.watches_process("node-b") && b.watches_process("node-a"));
    b.send("node-a", 1, Bytes::from_static(b"still here")).await.unwrap();
    assert!(matches!(next(&mut ra).await, ControlEvent::Message { body, .. } if body == "still here"));
}

/// The peer restarted and dialed again before its old process died: the old process's death (its old
/// companion's end) must not remove the new incarnation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_process_of_a_replaced_connection_dying_means_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let (survivor, mut events) = bind(&ids[0]);
    let mut old = spawn_child(dir.path(), "node-b", survivor.local_addr());
    assert!(matches!(next(&mut events).await, ControlEvent::Connected { .. }));
    watched(&survivor, "node-b").await;

    let (new, mut new_events) = bind(&ids[1]);
    new.connect(survivor.local_addr()).await.unwrap();
    assert!(matches!(next(&mut events).await, ControlEvent::Connected { peer, .. } if peer == "node-b"));
    next(&mut new_events).await;
    watched(&survivor, "node-b").await;
    kill(&old, libc::SIGKILL);
    old.wait().unwrap();
    quiet(&mut events, 1_000).await;
    assert!(survivor.watches_process("node-b"), "the new incarnation stays connected");
    new.send("node-a", 1, Bytes::from_static(b"new")).await.unwrap();
    assert!(matches!(next(&mut events).await, ControlEvent::Message { body, .. } if body == "new"));
    // A graceful end of the new one is a departure, not a loss.
    new.close().await;
    assert_eq!(next(&mut events).await, ControlEvent::Departed { peer: "node-b".into() });
}

/// `[transport] companion_tcp = false` (a network that closes TCP on the control port): no listener on
/// the port's TCP number, no companion between two nodes, and the control connection works as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn companion_tcp_off_binds_no_listener_and_watches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let off = TransportConfig { companion_tcp: false, ..config() };
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let (a, mut a_events) = ControlEndpoint::bind(&ids[0], addr, PeerRole::Node, &off).unwrap();
    let (b, _b_events) = ControlEndpoint::bind(&ids[1], addr, PeerRole::Node, &off).unwrap();
    let refused = tokio::net::TcpStream::connect(a.local_addr()).await;
    assert!(refused.is_err(), "a TCP listener on {} although companion_tcp = false", a.local_addr());
    assert_eq!(b.connect(a.local_addr()).await.unwrap(), "node-a");
    assert!(matches!(next(&mut a_events).await, ControlEvent::Connected { peer, .. } if peer == "node-b"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!a.watches_process("node-b") && !b.watches_process("node-a"), "a companion although it is off");
    b.send("node-a", 1, Bytes::from_static(b"still works")).await.unwrap();
    match next(&mut a_events).await {
        ControlEvent::Message { from, body, .. } => {
            assert_eq!((from.as_str(), &body[..]), ("node-b", &b"still works"[..]))
        }
        other => panic!("expected the message, got {other:?}"),
    }
}

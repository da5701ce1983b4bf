//! The control plane over real QUIC on 127.0.0.1: peers known by the name in their certificate,
//! messages in order, departures told from losses, and refusals of anyone the CA did not vouch for
//! or who claims another's name.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use support::cluster;
use tokio::sync::mpsc::UnboundedReceiver;
use troupe_cluster::control::{ControlEndpoint, ControlEvent, PeerRole};
use troupe_cluster::transport::quic::bind_endpoint;
use troupe_cluster::{NodeIdentity, TransportConfig};

type Events = UnboundedReceiver<ControlEvent>;

/// Small frames so that a larger message spans several.
fn config() -> TransportConfig {
    TransportConfig { connect_timeout_ms: 3_000, frame_bytes_max: 64 << 10, ..TransportConfig::loopback() }
}

fn bind_with(id: &NodeIdentity, role: PeerRole, cfg: &TransportConfig) -> (ControlEndpoint, Events) {
    ControlEndpoint::bind(id, "127.0.0.1:0".parse().unwrap(), role, cfg).unwrap()
}

fn bind(id: &NodeIdentity) -> (ControlEndpoint, Events) {
    bind_with(id, PeerRole::Node, &config())
}

async fn next(rx: &mut Events) -> ControlEvent {
    tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("an event within 5 s").expect("events open")
}

/// Nothing more arrives for a while.
async fn quiet(rx: &mut Events) {
    if let Ok(Some(e)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
        panic!("unexpected event {e:?}");
    }
}

fn connected(peer: &str, role: PeerRole) -> impl Fn(&ControlEvent) -> bool + '_ {
    move |e| matches!(e, ControlEvent::Connected { peer: p, role: r, .. } if p == peer && *r == role)
}

fn message(from: &str, role: PeerRole, epoch: u64, body: &'static [u8]) -> ControlEvent {
    ControlEvent::Message { from: from.into(), role, epoch, body: Bytes::from_static(body) }
}

/// `a` dials `b`; both see the other connected.
async fn pair(a: &ControlEndpoint, ra: &mut Events, b: &ControlEndpoint, rb: &mut Events) {
    assert_eq!(a.connect(b.local_addr()).await.unwrap(), b.name());
    let e = next(ra).await;
    assert!(connected(b.name(), b.role())(&e), "{e:?}");
    assert!(matches!(&e, ControlEvent::Connected { addr, .. } if *addr == b.local_addr()), "{e:?}");
    let e = next(rb).await;
    assert!(connected(a.name(), a.role())(&e), "{e:?}");
}

async fn wait_refusal(ep: &ControlEndpoint, mentions: &str) -> String {
    for _ in 0..300 {
        if let Some(r) = ep.refusals().into_iter().find(|r| r.reason.contains(mentions)) {
            return r.reason;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("no refusal mentioning {mentions:?}: {:?}", ep.refusals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_flow_both_ways_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let ((a, mut ra), (b, mut rb)) = (bind(&ids[0]), bind(&ids[1]));
    pair(&a, &mut ra, &b, &mut rb).await;
    assert_eq!(a.peers(), vec![("node-b".to_string(), PeerRole::Node)]);
    assert!(b.is_connected("node-a") && !b.is_connected("node-c"));

    a.send("node-b", 7, Bytes::from_static(b"hello")).await.unwrap();
    b.send("node-a", 9, Bytes::from_static(b"world")).await.unwrap();
    assert_eq!(next(&mut rb).await, message("node-a", PeerRole::Node, 7, b"hello"));
    assert_eq!(next(&mut ra).await, message("node-b", PeerRole::Node, 9, b"world"));

    let big: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
    a.send("node-b", 1, Bytes::from(big.clone())).await.unwrap();
    for i in 0..2000u64 {
        a.send("node-b", i, Bytes::copy_from_slice(&i.to_le_bytes())).await.unwrap();
    }
    let e = next(&mut rb).await;
    assert!(matches!(&e, ControlEvent::Message { body, .. } if body[..] == big[..]), "multi-frame message");
    for i in 0..2000u64 {
        match next(&mut rb).await {
            ControlEvent::Message { from, epoch, body, .. } => {
                assert_eq!((from.as_str(), epoch, &body[..]), ("node-a", i, &i.to_le_bytes()[..]), "message {i}");
            }
            other => panic!("message {i}: got {other:?}"),
        }
    }
    let err = a.send("node-c", 0, Bytes::new()).await.unwrap_err();
    assert!(err.to_string().contains("not connected"), "{err}");
    assert!(a.refusals().is_empty() && b.refusals().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_is_a_departure_after_every_message() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b", "node-c"]);
    let ((a, mut ra), (b, mut rb), (c, mut rc)) = (bind(&ids[0]), bind(&ids[1]), bind(&ids[2]));
    pair(&a, &mut ra, &b, &mut rb).await;
    pair(&c, &mut rc, &a, &mut ra).await;

    for i in 0..100u64 {
        b.send("node-a", i, Bytes::from_static(b"last words")).await.unwrap();
    }
    b.close().await;
    for i in 0..100u64 {
        assert_eq!(next(&mut ra).await, message("node-b", PeerRole::Node, i, b"last words"));
    }
    assert_eq!(next(&mut ra).await, ControlEvent::Departed { peer: "node-b".into() });
    assert!(b.connect(a.local_addr()).await.is_err(), "a closed endpoint does not dial");

    // A disconnect is a departure for the other side and nothing for ours.
    a.disconnect("node-c").await;
    assert_eq!(next(&mut rc).await, ControlEvent::Departed { peer: "node-a".into() });
    assert!(!a.is_connected("node-c") && !c.is_connected("node-a"));
    quiet(&mut ra).await;
}

/// Forwards UDP between one client and `target` until aborted: then the path goes silent, as if
/// the target's host had died.
async fn udp_relay(target: SocketAddr) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let front = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let back = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    back.connect(target).await.unwrap();
    let addr = front.local_addr().unwrap();
    let relay = tokio::spawn(async move {
        let (mut up, mut down) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
        let mut client = None;
        loop {
            tokio::select! {
                Ok((n, from)) = front.recv_from(&mut up) => {
                    client = Some(from);
                    let _ = back.send(&up[..n]).await;
                }
                Ok(n) = back.recv(&mut down) => {
                    if let Some(c) = client {
                        let _ = front.send_to(&down[..n], c).await;
                    }
                }
            }
        }
    });
    (addr, relay)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_lost_within_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let cfg = TransportConfig { idle_timeout_ms: 500, keep_alive_interval_ms: 100, ..config() };
    let ((a, mut ra), (b, mut rb)) =
        (bind_with(&ids[0], PeerRole::Node, &cfg), bind_with(&ids[1], PeerRole::Node, &cfg));
    let (via, relay) = udp_relay(b.local_addr()).await;
    assert_eq!(a.connect(via).await.unwrap(), "node-b");
    assert!(connected("node-b", PeerRole::Node)(&next(&mut ra).await));
    assert!(connected("node-a", PeerRole::Node)(&next(&mut rb).await));
    // Keep-alives hold the connection open well past the idle timeout.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    a.send("node-b", 1, Bytes::from_static(b"still there?")).await.unwrap();
    assert_eq!(next(&mut rb).await, message("node-a", PeerRole::Node, 1, b"still there?"));

    relay.abort();
    let silent_since = Instant::now();
    match next(&mut ra).await {
        ControlEvent::Lost { peer, reason } => assert_eq!((peer.as_str(), reason.as_str()), ("node-b", "timed out")),
        other => panic!("expected Lost, got {other:?}"),
    }
    let waited = silent_since.elapsed();
    assert!(waited < Duration::from_millis(1_500), "lost after {waited:?} with idle_timeout_ms = 500");
    assert!(matches!(next(&mut rb).await, ControlEvent::Lost { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_endpoint_without_close_is_a_loss() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let ((a, mut ra), (b, mut rb)) = (bind(&ids[0]), bind(&ids[1]));
    pair(&a, &mut ra, &b, &mut rb).await;
    drop(b);
    match next(&mut ra).await {
        ControlEvent::Lost { peer, reason } => assert!(peer == "node-b" && reason.contains("dropped"), "{reason}"),
        other => panic!("expected Lost, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_from_another_ca_are_refused() {
    let ours = tempfile::tempdir().unwrap();
    let theirs = tempfile::tempdir().unwrap();
    let ids = cluster(ours.path(), &["node-a", "node-b"]);
    let foreign = cluster(theirs.path(), &["node-x"]);
    let (a, mut ra) = bind(&ids[0]);

    // Entirely foreign: it does not trust us either.
    let (x, _rx) = bind(&foreign[0]);
    let err = x.connect(a.local_addr()).await.unwrap_err();
    wait_refusal(&a, "TLS handshake failed").await;
    wait_refusal(&x, "invalid peer certificate").await;
    // A foreign certificate that trusts our CA: our side refuses it.
    let impostor = NodeIdentity { ca: ids[0].ca.clone(), ..foreign[0].clone() };
    let (y, _ry) = bind(&impostor);
    let started = Instant::now();
    let err2 = y.connect(a.local_addr()).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "a refusal is not retried");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reasons: Vec<String> = a.refusals().into_iter().map(|r| r.reason).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    // Both CAs are named alike, so webpki finds "the" issuer and reports a bad signature.
    let ours_refused = |r: &String| !r.contains("aborted by peer") && r.contains("invalid peer certificate");
    assert!(reasons.iter().any(ours_refused), "{reasons:?}");
    assert!(err.to_string().contains("invalid peer certificate"), "{err}");
    assert!(err2.to_string().contains("invalid peer certificate"), "{err2}");
    assert!(!a.is_connected("node-x"));

    // Still serving good peers.
    let (b, mut rb) = bind(&ids[1]);
    pair(&b, &mut rb, &a, &mut ra).await;
    b.send("node-a", 3, Bytes::from_static(b"ok")).await.unwrap();
    assert_eq!(next(&mut ra).await, message("node-b", PeerRole::Node, 3, b"ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_introduction_must_match_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let (a, mut ra) = bind(&ids[0]);
    // node-b's certificate, introducing itself as node-c.
    let liar_id = NodeIdentity { name: "node-c".into(), ..ids[1].clone() };
    let (liar, _rl) = bind(&liar_id);

    let err = liar.connect(a.local_addr()).await.unwrap_err();
    let reason = wait_refusal(&a, "is not for \"node-c\"").await;
    assert!(err.to_string().contains("node-c"), "dialer told why: {err} (acceptor: {reason})");
    // The other way round: the dialer checks the acceptor's introduction too.
    let err = a.connect(liar.local_addr()).await.unwrap_err();
    assert!(err.to_string().contains("is not for \"node-c\""), "{err}");
    assert!(a.peers().is_empty());
    quiet(&mut ra).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_dialer_is_refused_after_the_connect_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let cfg = TransportConfig { connect_timeout_ms: 500, ..config() };
    let (a, _ra) = bind_with(&ids[0], PeerRole::Node, &cfg);
    let mute = bind_endpoint(&ids[1], "127.0.0.1:0".parse().unwrap(), &cfg).unwrap();
    let conn = mute.connect(a.local_addr(), "node-a").unwrap().await.unwrap();
    wait_refusal(&a, "no introduction within connect_timeout_ms = 500").await;
    let closed = tokio::time::timeout(Duration::from_secs(2), conn.closed()).await.unwrap();
    assert!(closed.to_string().contains("no introduction"), "{closed}");
}

/// Client `cli` dials node `node`: returns the name the node knows this connection by
/// (`<certificate name>#<n>`).
async fn dial_in(cli: &ControlEndpoint, rc: &mut Events, node: &ControlEndpoint, rn: &mut Events) -> String {
    assert_eq!(cli.connect(node.local_addr()).await.unwrap(), node.name());
    assert!(connected(node.name(), PeerRole::Node)(&next(rc).await));
    match next(rn).await {
        ControlEvent::Connected { peer, role: PeerRole::Client, .. } => {
            assert!(peer.starts_with(&format!("{}#", cli.name())), "{peer}");
            peer
        }
        e => panic!("expected the client's connection, got {e:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_talks_to_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b", "cli-1"]);
    let (a, mut ra) = bind(&ids[0]);
    let (cli, mut rc) = bind_with(&ids[2], PeerRole::Client, &config());
    let key = dial_in(&cli, &mut rc, &a, &mut ra).await;
    assert_eq!(a.peers(), vec![(key.clone(), PeerRole::Client)]);
    cli.send("node-a", 0, Bytes::from_static(b"status?")).await.unwrap();
    assert_eq!(next(&mut ra).await, message(&key, PeerRole::Client, 0, b"status?"));
    a.send(&key, 4, Bytes::from_static(b"healthy")).await.unwrap();
    assert_eq!(next(&mut rc).await, message("node-a", PeerRole::Node, 4, b"healthy"));

    // A client may present its own daemon's certificate...
    let (own, mut ro) = bind_with(&ids[0], PeerRole::Client, &config());
    dial_in(&own, &mut ro, &a, &mut ra).await;
    // ...and a node's certificate used by a client while the node is connected is a client of its own: it
    // takes nothing over, the node's connection and its messages are untouched.
    let (b, mut rb) = bind(&ids[1]);
    pair(&b, &mut rb, &a, &mut ra).await;
    let (fake, mut rf) = bind_with(&ids[1], PeerRole::Client, &config());
    let fake_key = dial_in(&fake, &mut rf, &a, &mut ra).await;
    assert_ne!(fake_key, "node-b");
    assert!(a.peers().contains(&("node-b".to_string(), PeerRole::Node)));
    b.send("node-a", 1, Bytes::from_static(b"still here")).await.unwrap();
    assert_eq!(next(&mut ra).await, message("node-b", PeerRole::Node, 1, b"still here"));
}

/// Two commands under one certificate (`troupe train` following its job, `troupe status` beside it)
/// each keep their own connection: the second neither closes the first nor receives its replies, and
/// the end of one is reported for that one alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clients_with_one_certificate_each_get_their_own_replies() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "cli-1"]);
    let (a, mut ra) = bind(&ids[0]);
    let (first, mut r1) = bind_with(&ids[1], PeerRole::Client, &config());
    let (second, mut r2) = bind_with(&ids[1], PeerRole::Client, &config());
    let k1 = dial_in(&first, &mut r1, &a, &mut ra).await;
    let k2 = dial_in(&second, &mut r2, &a, &mut ra).await;
    assert_ne!(k1, k2);
    a.send(&k1, 0, Bytes::from_static(b"to the first")).await.unwrap();
    a.send(&k2, 0, Bytes::from_static(b"to the second")).await.unwrap();
    assert_eq!(next(&mut r1).await, message("node-a", PeerRole::Node, 0, b"to the first"));
    assert_eq!(next(&mut r2).await, message("node-a", PeerRole::Node, 0, b"to the second"));
    quiet(&mut r1).await;
    second.close().await;
    assert_eq!(next(&mut ra).await, ControlEvent::Departed { peer: k2 });
    a.send(&k1, 0, Bytes::from_static(b"still yours")).await.unwrap();
    assert_eq!(next(&mut r1).await, message("node-a", PeerRole::Node, 0, b"still yours"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_connection_replaces_the_older_silently() {
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b"]);
    let ((a, mut ra), (b, mut rb)) = (bind(&ids[0]), bind(&ids[1]));
    pair(&b, &mut rb, &a, &mut ra).await;
    pair(&b, &mut rb, &a, &mut ra).await;
    // A restarted node-b (new endpoint, same certificate) dials again.
    let (b2, mut rb2) = bind(&ids[1]);
    pair(&b2, &mut rb2, &a, &mut ra).await;
    b2.send("node-a", 2, Bytes::from_static(b"back")).await.unwrap();
    assert_eq!(next(&mut ra).await, message("node-b", PeerRole::Node, 2, b"back"));
    a.send("node-b", 3, Bytes::from_static(b"welcome")).await.unwrap();
    assert_eq!(next(&mut rb2).await, message("node-a", PeerRole::Node, 3, b"welcome"));
    quiet(&mut ra).await;
    drop(b);
    quiet(&mut ra).await;
    assert_eq!(a.peers(), vec![("node-b".to_string(), PeerRole::Node)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_loses_that_connection_only() {
    use troupe_cluster::transport::frame_control;
    use troupe_cluster::wire::{ControlMessage, FrameKind};
    let dir = tempfile::tempdir().unwrap();
    let ids = cluster(dir.path(), &["node-a", "node-b", "node-c"]);
    let ((a, mut ra), (c, mut rc)) = (bind(&ids[0]), bind(&ids[2]));
    pair(&c, &mut rc, &a, &mut ra).await;

    let raw = bind_endpoint(&ids[1], "127.0.0.1:0".parse().unwrap(), &config()).unwrap();
    let conn = raw.connect(a.local_addr(), "node-a").unwrap().await.unwrap();
    let mut s = conn.open_uni().await.unwrap();
    let intro = ControlMessage::Introduce { node: "node-b".into(), role: PeerRole::Node };
    s.write_all(&frame_control(FrameKind::Hello, &intro)).await.unwrap();
    assert!(connected("node-b", PeerRole::Node)(&next(&mut ra).await));
    s.write_all(&[0xAB; 44]).await.unwrap();
    match next(&mut ra).await {
        ControlEvent::Lost { peer, reason } => assert!(peer == "node-b" && reason.contains("bad magic"), "{reason}"),
        other => panic!("expected Lost, got {other:?}"),
    }
    c.send("node-a", 5, Bytes::from_static(b"unaffected")).await.unwrap();
    assert_eq!(next(&mut ra).await, message("node-c", PeerRole::Node, 5, b"unaffected"));
}

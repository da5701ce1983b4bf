use std::net::{Ipv4Addr, SocketAddr};

use tokio::io::AsyncReadExt;

use super::*;
use crate::collective::{CollectiveConfig, Communicator, ReduceOp};
use crate::identity::{add_node, init_cluster};
use crate::transport::memory::MemoryTransport;

const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// Identities from one fresh CA for `names`, and the roster of ranks named `rank-0`, `rank-1`, … (the
/// first `world` of `names`, all on loopback; the port is the system's choice).
fn cluster(names: &[&str], world: usize) -> (Vec<NodeIdentity>, Vec<PeerInfo>) {
    let dir = tempfile::tempdir().expect("tempdir");
    init_cluster(dir.path()).expect("init");
    let ids: Vec<NodeIdentity> = names
        .iter()
        .map(|n| {
            add_node(n, dir.path()).expect("add node");
            NodeIdentity::load(dir.path(), n).expect("load")
        })
        .collect();
    let roster = names[..world].iter().map(|n| PeerInfo { name: n.to_string(), addr: (LOOPBACK, 0).into() }).collect();
    (ids, roster)
}

fn ranks(world: usize) -> Vec<&'static str> {
    ["rank-0", "rank-1", "rank-2", "rank-3"][..world].to_vec()
}

/// `world` ranks over TCP, set up through an in-memory control mesh (returned too).
async fn mesh(
    world: usize,
    payloads: TcpPayloads,
) -> (Vec<Arc<MemoryTransport>>, Vec<Arc<TcpTransport<MemoryTransport>>>) {
    let (ids, roster) = cluster(&ranks(world), world);
    let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(world, 64).into_iter().map(Arc::new).collect();
    let connects = control
        .iter()
        .zip(&ids)
        .map(|(c, id)| TcpTransport::connect(c.clone(), id, &roster, TransportConfig::default(), payloads));
    let tcp = futures::future::join_all(connects).await.into_iter().map(|t| Arc::new(t.expect("connect"))).collect();
    (control, tcp)
}

/// Messages of every size between every pair (borrowed and owned sends), and an all-reduce whose
/// slices are many frames and segments, equal what was sent — plaintext and over TLS.
#[tokio::test]
async fn three_ranks_exchange_messages_and_all_reduce() {
    for payloads in [TcpPayloads::Plaintext, TcpPayloads::Encrypted] {
        three_ranks_exchange_messages_and_all_reduce_with(payloads).await;
    }
}

async fn three_ranks_exchange_messages_and_all_reduce_with(payloads: TcpPayloads) {
    let (_control, tcp) = mesh(3, payloads).await;
    let tag = Tag { group: 0, epoch: 1, seq: 0, step: 0 };
    let message =
        |from: usize, to: usize| -> Vec<u8> { (0..(3 << 20) + from * 7 + to).map(|i| (i % 251) as u8).collect() };
    for (from, sender) in tcp.iter().enumerate() {
        for to in (0..3).filter(|&to| to != from) {
            if from % 2 == 0 {
                sender.send_slice(to, tag, &message(from, to)).await.expect("send");
            } else {
                sender.send(to, tag, Bytes::from(message(from, to))).await.expect("send");
            }
        }
    }
    for (to, receiver) in tcp.iter().enumerate() {
        for from in (0..3).filter(|&from| from != to) {
            let got = receiver.recv(from, tag, LossScope::Peer, 10_000).await.expect("recv");
            assert_eq!(got.to_vec(), message(from, to), "{from} -> {to}, {payloads:?}");
        }
    }
    let len = 1_500_001;
    let input = |rank: usize| -> Vec<f32> { (0..len).map(|i| ((i * 7 + rank * 13) % 101) as f32 - 50.0).collect() };
    let inputs: Vec<Vec<f32>> = (0..3).map(input).collect();
    let sum: Vec<f32> = (0..len).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
    let config = CollectiveConfig::from(&TransportConfig::default());
    let runs = tcp.iter().enumerate().map(|(rank, t)| {
        let mut comm = Communicator::new(t.clone(), 0, 1, config.clone());
        let mut data = inputs[rank].clone();
        async move {
            comm.all_reduce(&mut data[..], ReduceOp::Sum).await.expect("all-reduce");
            data
        }
    });
    for (rank, got) in futures::future::join_all(runs).await.into_iter().enumerate() {
        assert_eq!(got, sum, "rank {rank}, {payloads:?}");
    }
    futures::future::join_all(tcp.iter().map(|t| t.shutdown())).await;
}

/// Ranks asked for different payloads (one plaintext, one TLS) refuse to connect, each saying what
/// it was asked for and what its peer was: never a mesh where one side encrypts and the other not.
#[tokio::test]
async fn ranks_that_disagree_on_encryption_do_not_connect() {
    let (ids, roster) = cluster(&ranks(2), 2);
    let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 64).into_iter().map(Arc::new).collect();
    let config = TransportConfig { connect_timeout_ms: 5_000, ..TransportConfig::default() };
    let (plain, tls) = futures::future::join(
        TcpTransport::connect(control[0].clone(), &ids[0], &roster, config.clone(), TcpPayloads::Plaintext),
        TcpTransport::connect(control[1].clone(), &ids[1], &roster, config, TcpPayloads::Encrypted),
    )
    .await;
    for (result, says) in [
        (plain.err(), "the peer was asked for TLS (encrypted_tcp), this rank for plaintext"),
        (tls.err(), "the peer was asked for plaintext (plaintext_tcp), this rank for TLS"),
    ] {
        match result {
            Some(ClusterError::Connect { reason, .. }) => assert!(reason.contains(says), "{reason}"),
            other => panic!("expected a refusal saying {says:?}, got {other:?}"),
        }
    }
}

/// Rank 0 of two connecting in the background, the test playing rank 1 through the control mesh:
/// rank 0's task, its listener's address and the token it gave rank 1.
async fn rank_0_alone(
    id: &NodeIdentity,
    roster: &[PeerInfo],
    payloads: TcpPayloads,
) -> (tokio::task::JoinHandle<Result<TcpTransport<MemoryTransport>, ClusterError>>, SocketAddr, String) {
    let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 64).into_iter().map(Arc::new).collect();
    let rank0 = tokio::spawn({
        let (control, id, roster) = (control[0].clone(), id.clone(), roster.to_vec());
        async move { TcpTransport::connect(control, &id, &roster, TransportConfig::default(), payloads).await }
    });
    let tag = Tag { group: TCP_SETUP_GROUP, epoch: 0, seq: 0, step: 0 };
    let ours = Invitation {
        addr: "127.0.0.1:9".parse().expect("addr"),
        token: random_token().expect("token"),
        tls: payloads == TcpPayloads::Encrypted,
    };
    control[1].send(0, tag, Bytes::from(serde_json::to_vec(&ours).expect("json"))).await.expect("invite");
    let got = control[1].recv(0, tag, LossScope::Peer, 10_000).await.expect("rank 0's invitation").to_vec();
    let Invitation { addr, token, .. } = serde_json::from_slice(&got).expect("an invitation");
    // The control mesh must outlive the set-up: rank 0 holds its end, the test's end is leaked.
    std::mem::forget(control);
    (rank0, addr, token)
}

fn hello(rank: u32, world: u32, token: &str) -> Bytes {
    frame_control(FrameKind::Hello, &ControlMessage::TcpHello { rank, world, token: token.into() })
}

/// Whether a stream that wrote its first frame is closed on us (refused: it ends, perhaps after a TLS
/// alert) rather than kept.
async fn closed_on_us<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, first_frame: &[u8]) -> bool {
    let _ = say_hello(stream, first_frame).await;
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest)).await.is_ok()
}

/// Dials `addr` in the clear and says whether the connection was refused.
async fn refused(addr: SocketAddr, first_frame: Bytes) -> bool {
    let mut stream = TcpStream::connect(addr).await.expect("dial");
    closed_on_us(&mut stream, &first_frame).await
}

/// Connections with a wrong token, a bad world or rank, a first frame that is not a hello, or
/// garbage are closed, and rank 0 goes on waiting — until the real rank 1 dials.
#[tokio::test]
async fn connections_without_the_peers_token_are_refused_and_the_set_up_goes_on() {
    let (ids, roster) = cluster(&ranks(2), 2);
    let (rank0, addr, token) = rank_0_alone(&ids[0], &roster, TcpPayloads::Plaintext).await;
    let mut wrong = token.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).expect("hex");
    assert!(refused(addr, hello(1, 2, &wrong)).await, "a token one digit off");
    assert!(refused(addr, hello(1, 2, "")).await, "no token");
    assert!(refused(addr, hello(1, 3, &token)).await, "the wrong world");
    assert!(refused(addr, hello(0, 2, &token)).await, "rank 0 itself");
    let other_hello = ControlMessage::Hello { node: "rank-1".into(), rank: 1, world: 2 };
    assert!(refused(addr, frame_control(FrameKind::Hello, &other_hello)).await, "a QUIC hello");
    assert!(refused(addr, Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n")).await, "garbage");
    assert!(!rank0.is_finished(), "rank 0 gave up while its real peer had not dialed");

    let mut real = TcpStream::connect(addr).await.expect("dial");
    real.write_all(&hello(1, 2, &token)).await.expect("hello");
    let rank0 = rank0.await.expect("task").expect("rank 0 connected once the real rank 1 dialed");
    assert_eq!(rank0.refusals().len(), 6, "{:?}", rank0.refusals());
    rank0.send_slice(1, Tag { group: 0, epoch: 1, seq: 0, step: 0 }, b"welcome").await.expect("send");
    let mut head = [0u8; crate::wire::HEADER_BYTES + 7];
    real.read_exact(&mut head).await.expect("a frame arrives on the accepted connection");
    assert_eq!(&head[crate::wire::HEADER_BYTES..], b"welcome");
}

/// A TLS client trusting `ca_of`'s CA and presenting `cert_of`'s certificate (or none).
fn tls_client(ca_of: &NodeIdentity, cert_of: Option<&NodeIdentity>) -> TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca_of.ca.clone()).expect("CA");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots);
    let mut config = match cert_of {
        Some(id) => builder.with_client_auth_cert(vec![id.cert.clone()], id.key.clone_key()).expect("client cert"),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"troupe/1".to_vec()];
    TlsConnector::from(Arc::new(config))
}

/// Dials `addr` over TLS with `client`, says `first_frame`, and says whether it was refused — at the
/// handshake or after it (TLS 1.3: a client may finish before the server has checked its certificate).
async fn tls_refused(client: &TlsConnector, addr: SocketAddr, first_frame: Bytes) -> bool {
    let stream = TcpStream::connect(addr).await.expect("dial");
    match client.connect(ServerName::try_from("rank-0").expect("name"), stream).await {
        Err(_) => true,
        Ok(mut stream) => closed_on_us(&mut stream, &first_frame).await,
    }
}

/// Over TLS, rank 0 refuses at the handshake a client certificate from another CA and a client
/// without one, and after it a valid certificate of this cluster that is not the claimed rank's —
/// even with that rank's token — each logged with its reason; the set-up goes on, and the real
/// rank 1, with its certificate, is accepted and talked to over TLS.
#[tokio::test]
async fn tls_refuses_foreign_missing_and_other_ranks_certificates_and_the_set_up_goes_on() {
    let (ids, roster) = cluster(&["rank-0", "rank-1", "rank-2"], 2);
    let (foreign, _) = cluster(&["rank-1"], 1);
    let (rank0, addr, token) = rank_0_alone(&ids[0], &roster, TcpPayloads::Encrypted).await;
    let cases = [
        ("another CA's certificate", tls_client(&ids[0], Some(&foreign[0]))),
        ("no certificate", tls_client(&ids[0], None)),
        ("rank 2's certificate claiming rank 1", tls_client(&ids[0], Some(&ids[2]))),
    ];
    for (what, client) in &cases {
        assert!(tls_refused(client, addr, hello(1, 2, &token)).await, "{what}");
    }
    assert!(refused(addr, hello(1, 2, &token)).await, "plaintext to a TLS listener");
    assert!(!rank0.is_finished(), "rank 0 gave up while its real peer had not dialed");

    let stream = TcpStream::connect(addr).await.expect("dial");
    let real = TlsConnector::from(Arc::new(client_config(&ids[1]).expect("rank 1's config")));
    let mut real = real.connect(ServerName::try_from("rank-0").expect("name"), stream).await.expect("handshake");
    say_hello(&mut real, &hello(1, 2, &token)).await.expect("hello");
    let rank0 = rank0.await.expect("task").expect("rank 0 connected once the real rank 1 dialed");
    rank0.send_slice(1, Tag { group: 0, epoch: 1, seq: 0, step: 0 }, b"welcome").await.expect("send");
    let mut head = [0u8; crate::wire::HEADER_BYTES + 7];
    real.read_exact(&mut head).await.expect("a frame arrives over TLS");
    assert_eq!(&head[crate::wire::HEADER_BYTES..], b"welcome");

    let reasons: Vec<String> = rank0.refusals().into_iter().map(|r| r.reason).collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    let expected = [
        // Another CA of the same name: the signature does not verify (BadSignature; UnknownIssuer were
        // its name another).
        ("another CA's certificate", "TLS handshake failed: invalid peer certificate"),
        ("no certificate", "TLS handshake failed: peer sent no certificates"),
        ("rank 2's certificate", "claims rank 1 (\"rank-1\") with a certificate that is not its"),
        ("plaintext", "TLS handshake failed"),
    ];
    for ((what, says), reason) in expected.iter().zip(&reasons) {
        assert!(reason.contains(says), "{what}: {reason:?}");
    }
}

/// A control transport that puts a [`flipping_proxy`] in front of every listener its rank is invited
/// to dial: a man in the middle on the path of that rank's connections.
struct Tampered {
    inner: Arc<MemoryTransport>,
    flip_at: usize,
}

impl Transport for Tampered {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        self.inner.send(to, tag, payload).await
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        let got = self.inner.recv(from, tag, scope, timeout_ms).await?;
        if tag.group != TCP_SETUP_GROUP {
            return Ok(got);
        }
        let mut invitation: Invitation = serde_json::from_slice(&got.to_vec()).expect("an invitation");
        invitation.addr = flipping_proxy(invitation.addr, self.flip_at).await;
        Ok(Bytes::from(serde_json::to_vec(&invitation).expect("json")).into())
    }

    fn fence(&self, epoch: u64) {
        self.inner.fence(epoch)
    }

    async fn any_loss(&self) -> (Rank, String) {
        self.inner.any_loss().await
    }

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        self.inner.loss_among(peers).await
    }

    async fn shutdown(&self) {
        self.inner.shutdown().await
    }
}

/// A TCP proxy to `to` that passes everything through but flips the lowest bit of the byte at
/// `flip_at` of what the client sends. Returns its address.
async fn flipping_proxy(to: SocketAddr, flip_at: usize) -> SocketAddr {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.expect("accept");
        let server = TcpStream::connect(to).await.expect("connect");
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        tokio::spawn(async move {
            let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
            let _ = to_client.shutdown().await;
        });
        let (mut seen, mut buf) = (0usize, vec![0u8; 64 << 10]);
        loop {
            let n = match from_client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if (seen..seen + n).contains(&flip_at) {
                buf[flip_at - seen] ^= 1;
            }
            seen += n;
            if to_server.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to_server.shutdown().await;
    });
    addr
}

/// One bit flipped on the wire, well past the handshake, inside a tensor rank 1 sends rank 0: rank 0
/// never receives that message — its connection ends (TLS: the record fails to authenticate, an
/// alert is sent) and the receive fails with the peer lost; rank 1 sees the connection die too.
#[tokio::test]
async fn a_byte_flipped_on_the_wire_kills_the_connection_never_delivers_a_wrong_tensor() {
    let (ids, roster) = cluster(&ranks(2), 2);
    let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 64).into_iter().map(Arc::new).collect();
    let config = TransportConfig { connect_timeout_ms: 10_000, ..TransportConfig::default() };
    let rank0 = tokio::spawn({
        let (control, id, roster, config) = (control[0].clone(), ids[0].clone(), roster.clone(), config.clone());
        async move { TcpTransport::connect(control, &id, &roster, config, TcpPayloads::Encrypted).await }
    });
    // A byte 256 KiB into what rank 1 sends: inside the tensor, far past the handshake.
    let rank1 = TcpTransport::connect(
        Arc::new(Tampered { inner: control[1].clone(), flip_at: 256 << 10 }),
        &ids[1],
        &roster,
        config,
        TcpPayloads::Encrypted,
    )
    .await
    .expect("rank 1 connects through the proxy");
    let rank0 = rank0.await.expect("task").expect("rank 0 connects");

    let tag = Tag { group: 0, epoch: 1, seq: 0, step: 0 };
    let tensor: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    // The send may fail once rank 0 closes the connection: what matters is what rank 0 receives.
    let sending = tokio::spawn(async move {
        let _ = rank1.send_slice(0, tag, &tensor).await;
        rank1
    });
    match rank0.recv(1, tag, LossScope::Peer, 10_000).await {
        Err(ClusterError::PeerLost { peer: 1, reason, .. }) => {
            assert!(reason.contains("cannot decrypt peer's message"), "{reason}")
        }
        Ok(p) => panic!("a message of {} bytes was delivered from a tampered stream", p.len()),
        Err(e) => panic!("expected rank 1 lost, got {e}"),
    }
    let rank1 = tokio::time::timeout(Duration::from_secs(10), sending).await.expect("the send ends").expect("task");
    match rank1.recv(0, Tag { group: 0, epoch: 1, seq: 1, step: 0 }, LossScope::Peer, 10_000).await {
        // Rank 0's alert (bad_record_mac), or the reset of the socket it closed.
        Err(ClusterError::PeerLost { peer: 0, reason, .. }) => {
            assert!(reason.contains("BadRecordMac") || reason.contains("reset"), "{reason}")
        }
        other => panic!("rank 1 should see the connection die, got {other:?}"),
    }
}

/// A peer the control transport loses (a host fallen silent: its TCP connection still open) fails
/// receives from it over TCP, and group receives from anyone.
#[tokio::test]
async fn a_loss_on_the_control_transport_fails_receives_over_tcp() {
    let (control, tcp) = mesh(3, TcpPayloads::Encrypted).await;
    let tag = Tag { group: 0, epoch: 2, seq: 0, step: 0 };
    control[2].kill();
    for (from, scope) in [(2, LossScope::Peer), (1, LossScope::Group)] {
        match tcp[0].recv(from, tag, scope, 10_000).await {
            Err(ClusterError::PeerLost { rank: 0, peer: 2, reason, .. }) => {
                assert!(reason.contains("control transport"), "{reason}")
            }
            other => panic!("expected rank 2 lost, got {other:?}"),
        }
    }
}

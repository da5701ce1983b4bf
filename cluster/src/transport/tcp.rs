//! The TCP data plane between hosts: a job opts in with `data_plane = encrypted_tcp` (every byte
//! sealed with AES-128-GCM) or, on a trusted fabric, `data_plane = plaintext_tcp`; the default stays
//! the mutually-authenticated QUIC mesh.
//!
//! Why it exists: on a CPU-bound host QUIC's packetization — a copy into every packet and of every
//! received datagram, per-packet state and acknowledgements in user space — costs about as much CPU as
//! the transfer itself (docs/benchmarks.md). Over TCP the kernel does the segmenting, and a sealed
//! record of up to 1 MiB is read straight into the buffer it is delivered in and opened there
//! ([`super::sealed`]). Without encryption this is Gloo's and NCCL's trade: tensors in the clear.
//!
//! What stays protected: connections are set up *through* an authenticated control transport (the QUIC
//! mesh, mutual TLS): every rank binds a TCP listener and sends each peer, over that transport, the
//! listener's address and a fresh 256-bit token for that peer alone — and, encrypted, a fresh key for
//! what that peer will send it. A dialer's first frame names its rank and the token; a connection whose
//! token does not match the one given to the rank it claims — a stray process, a port scanner, a replay
//! towards another rank — is refused and logged, and the set-up goes on waiting for the real peer.
//! Encrypted, every later byte is sealed under keys only the two ranks hold: nobody on the fabric can
//! read a tensor, and an altered, dropped, repeated or injected record closes the connection (the
//! peer is lost, as on QUIC). Plaintext, anyone who can read or write the fabric can read or alter
//! tensors in flight, exactly as with Gloo or NCCL.
//!
//! Failure detection: a crashed peer's socket ends at once (EOF or reset); a host that falls silent is
//! caught by the control transport's keep-alive (QUIC's idle timeout), whose loss is forwarded into this
//! transport's mailbox, so receives fail with `PeerLost` either way. The control transport is kept
//! open for the lifetime of this one and closed after it.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::frame_io::{frame_control, read_message, FrameLimits, PlainSource, ReadOutcome};
use super::sealed::{RecordKey, SealedSource, SealedWriter};
use super::stream_mesh::{FrameWriter, Plain, StreamMesh};
use super::{LossScope, Mailbox, Payload, Transport};
use crate::error::Rank;
use crate::wire::{ControlMessage, FrameKind, Tag};
use crate::{ClusterError, TransportConfig};

/// Tag group of the set-up messages on the control transport (collectives use small group numbers,
/// the same-host arena's set-up `u32::MAX`).
const TCP_SETUP_GROUP: u32 = u32::MAX - 1;
const TOKEN_BYTES: usize = 32;
/// How long an accepted connection may take to send its first frame before it is dropped.
const HELLO_TIMEOUT_MS: u64 = 2_000;
/// Pause after a failed accept before the next.
const ACCEPT_RETRY_MS: u64 = 20;

/// What a rank tells each peer over the control transport: where to dial it, with what token, and —
/// when payloads are encrypted — the key the peer is to seal what it sends this rank with.
#[derive(Serialize, Deserialize)]
struct Invitation {
    addr: SocketAddr,
    token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key: Option<String>,
}

/// Whether the bytes on the TCP connections are encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpPayloads {
    /// Sent as they are (`data_plane = plaintext_tcp`).
    Plaintext,
    /// Sealed with AES-128-GCM in records ([`super::sealed`]), under a key per connection and
    /// direction handed over through the control transport (`data_plane = encrypted_tcp`).
    Encrypted,
}

/// The sending half of one TCP connection.
enum TcpWriter {
    Plain(Plain<OwnedWriteHalf>),
    Sealed(Box<SealedWriter<OwnedWriteHalf>>),
}

impl FrameWriter for TcpWriter {
    async fn write_frame(&mut self, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
        match self {
            TcpWriter::Plain(w) => w.write_frame(header, payload).await,
            TcpWriter::Sealed(w) => w.write_frame(header, payload).await,
        }
    }

    async fn close(&mut self) -> std::io::Result<()> {
        match self {
            TcpWriter::Plain(w) => w.close().await,
            TcpWriter::Sealed(w) => w.close().await,
        }
    }
}

/// The keys of one connection: the one this rank opens with (it chose it) and the one it seals with
/// (the peer chose it).
struct ConnectionKeys {
    open: RecordKey,
    seal: RecordKey,
}

/// What this rank expects of a peer's connection: the token the peer must show, and the connection's
/// keys when payloads are encrypted.
struct Expected {
    token: String,
    keys: Option<ConnectionKeys>,
}

/// Takes a connection whose hello is done into `mesh`, reading and writing as `keys` say.
fn join(
    mesh: &mut StreamMesh<TcpWriter>,
    peer: Rank,
    stream: TcpStream,
    keys: Option<&ConnectionKeys>,
    limits: FrameLimits,
) {
    let _ = stream.set_nodelay(true);
    let (reader, writer): (OwnedReadHalf, OwnedWriteHalf) = stream.into_split();
    match keys {
        None => mesh.add(peer, PlainSource(reader), TcpWriter::Plain(Plain(writer)), limits),
        Some(k) => mesh.add(
            peer,
            SealedSource::new(reader, &k.open),
            TcpWriter::Sealed(Box::new(SealedWriter::new(writer, &k.seal))),
            limits,
        ),
    }
}

pub struct TcpTransport<C: Transport> {
    rank: Rank,
    world: usize,
    mesh: StreamMesh<TcpWriter>,
    control: Arc<C>,
    /// Forwards the control transport's first peer loss into the mailbox.
    watch: tokio::task::JoinHandle<()>,
}

impl<C: Transport> Drop for TcpTransport<C> {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

fn random_token() -> Result<String, ClusterError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    rustls::crypto::ring::default_provider()
        .secure_random
        .fill(&mut bytes)
        .map_err(|_| ClusterError::Tls("no randomness for a TCP data-plane token".into()))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Equal, in time that does not depend on where they differ.
fn tokens_match(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl<C: Transport> TcpTransport<C> {
    /// Sets up the mesh among `control`'s ranks (the same ranks, numbered alike): listens on `bind_ip`
    /// (port chosen by the system), invites every peer over `control`, dials every lower rank, accepts
    /// every higher one. Every rank of `control` must call it, with the same `payloads`.
    pub async fn connect(
        control: Arc<C>,
        bind_ip: IpAddr,
        config: TransportConfig,
        payloads: TcpPayloads,
    ) -> Result<Self, ClusterError> {
        let (rank, world) = (control.rank(), control.world());
        let limits = FrameLimits::from(&config);
        let listener = TcpListener::bind((bind_ip, 0))
            .await
            .map_err(|e| ClusterError::io(format!("binding a TCP data-plane listener on {bind_ip}"), e))?;
        let addr = listener.local_addr().map_err(|e| ClusterError::io("reading the TCP listener's address", e))?;
        let tokens = (0..world).map(|_| random_token()).collect::<Result<Vec<_>, _>>()?;
        let open_keys = match payloads {
            TcpPayloads::Plaintext => None,
            TcpPayloads::Encrypted => Some(
                (0..world).map(|_| RecordKey::random().map_err(ClusterError::Tls)).collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let tag = Tag { group: TCP_SETUP_GROUP, epoch: 0, seq: 0, step: 0 };
        let peers: Vec<Rank> = (0..world).filter(|&q| q != rank).collect();
        for &q in &peers {
            let key = open_keys.as_ref().map(|k| k[q].to_hex());
            let invitation = serde_json::to_vec(&Invitation { addr, token: tokens[q].clone(), key })
                .expect("an invitation always serializes");
            control.send(q, tag, Bytes::from(invitation)).await?;
        }
        let mut invitations: Vec<Option<Invitation>> = (0..world).map(|_| None).collect();
        let mut keys: Vec<Option<ConnectionKeys>> = (0..world).map(|_| None).collect();
        for &q in &peers {
            let bad = |reason: String| ClusterError::Connect {
                rank,
                peer: q,
                addr: "(control transport)".into(),
                reason: format!("bad TCP data-plane invitation: {reason}"),
            };
            let bytes = control.recv(q, tag, LossScope::Peer, config.connect_timeout_ms).await?.to_vec();
            let invitation: Invitation = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
            if let Some(open) = &open_keys {
                let Some(seal) = &invitation.key else {
                    return Err(bad(
                        "no key: the peer was asked for plaintext payloads, this rank for encrypted ones".into()
                    ));
                };
                keys[q] = Some(ConnectionKeys { open: open[q].clone(), seal: RecordKey::from_hex(seal).map_err(bad)? });
            } else if invitation.key.is_some() {
                return Err(bad(
                    "a key: the peer was asked for encrypted payloads, this rank for plaintext ones".into()
                ));
            }
            invitations[q] = Some(invitation);
        }

        let mailbox = Arc::new(Mailbox::new(rank, config.unmatched_messages_max));
        let mut mesh = StreamMesh::new(rank, world, mailbox, config.frame_bytes_max, "TCP data-plane");
        let deadline = Instant::now() + Duration::from_millis(config.connect_timeout_ms);
        for (peer, invitation) in invitations.iter().enumerate().take(rank) {
            let Invitation { addr, token, .. } = invitation.as_ref().expect("every peer's invitation was received");
            let connect_err =
                |reason: String| ClusterError::Connect { rank, peer, addr: format!("tcp://{addr}"), reason };
            let left = deadline.saturating_duration_since(Instant::now());
            let mut stream = tokio::time::timeout(left, TcpStream::connect(addr))
                .await
                .map_err(|_| connect_err("not connected within connect_timeout_ms".into()))?
                .map_err(|e| connect_err(e.to_string()))?;
            let hello = ControlMessage::TcpHello { rank: rank as u32, world: world as u32, token: token.clone() };
            stream.write_all(&frame_control(FrameKind::Hello, &hello)).await.map_err(|e| connect_err(e.to_string()))?;
            join(&mut mesh, peer, stream, keys[peer].as_ref(), limits);
        }
        let expected: Vec<Expected> =
            tokens.into_iter().zip(keys).map(|(token, keys)| Expected { token, keys }).collect();
        accept_peers(&listener, &mut mesh, &expected, rank, world, limits, deadline).await?;

        let watch = tokio::spawn({
            let (control, mailbox) = (control.clone(), mesh.mailbox().clone());
            async move {
                let (peer, reason) = control.any_loss().await;
                mailbox.peer_lost(peer, format!("lost on the control transport: {reason}"));
            }
        });
        Ok(TcpTransport { rank, world, mesh, control, watch })
    }
}

/// Accepts a connection from every rank above `rank`. Connections are checked concurrently (one that
/// never speaks cannot hold up the others); one whose hello is malformed, names a rank that is not
/// expected, or carries the wrong token is dropped with a logged reason, and the wait goes on.
async fn accept_peers(
    listener: &TcpListener,
    mesh: &mut StreamMesh<TcpWriter>,
    expected: &[Expected],
    rank: Rank,
    world: usize,
    limits: FrameLimits,
    deadline: Instant,
) -> Result<(), ClusterError> {
    let mut pending: usize = world - rank - 1;
    let mut hellos: JoinSet<(SocketAddr, TcpStream, Result<ControlMessage, String>)> = JoinSet::new();
    while pending > 0 {
        let waiting_for =
            |mesh: &StreamMesh<_>| (rank + 1..world).filter(|&q| !mesh.is_connected(q)).collect::<Vec<_>>();
        tokio::select! {
            accepted = listener.accept() => {
                let (mut stream, from) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // E.g. out of file descriptors: pause rather than spin on the same error.
                        tracing::warn!(rank, error = %e, "accepting a TCP data-plane connection failed");
                        tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                        continue;
                    }
                };
                hellos.spawn(async move {
                    let hello = tokio::time::timeout(
                        Duration::from_millis(HELLO_TIMEOUT_MS),
                        read_message(&mut stream, limits),
                    )
                    .await;
                    let hello = match hello {
                        Err(_) => Err(format!("no hello within {HELLO_TIMEOUT_MS} ms")),
                        Ok(Err(e)) => Err(e.to_string()),
                        Ok(Ok(ReadOutcome::Control { kind: FrameKind::Hello, message })) => Ok(message),
                        Ok(Ok(other)) => Err(format!("first frame is not a hello: {other:?}")),
                    };
                    (from, stream, hello)
                });
            }
            Some(joined) = hellos.join_next() => {
                let Ok((from, stream, hello)) = joined else { continue };
                let peer = match hello {
                    Ok(ControlMessage::TcpHello { rank: r, world: w, token }) => {
                        let r = r as usize;
                        if w as usize != world || r <= rank || r >= world {
                            Err(format!("claims rank {r} of {w}; expected one of ranks {:?} of {world}", waiting_for(mesh)))
                        } else if mesh.is_connected(r) {
                            Err(format!("claims rank {r}, which is already connected"))
                        } else if !tokens_match(&token, &expected[r].token) {
                            Err(format!("claims rank {r} with a token that is not the one rank {r} was given"))
                        } else {
                            Ok(r)
                        }
                    }
                    Ok(other) => Err(format!("unexpected hello {other:?}")),
                    Err(e) => Err(e),
                };
                match peer {
                    Ok(peer) => {
                        join(mesh, peer, stream, expected[peer].keys.as_ref(), limits);
                        pending -= 1;
                    }
                    Err(reason) => tracing::warn!(rank, %from, %reason, "refused a TCP data-plane connection"),
                }
            }
            _ = tokio::time::sleep_until(deadline.into()) => {
                let missing = waiting_for(mesh);
                return Err(ClusterError::Connect {
                    rank,
                    peer: missing[0],
                    addr: listener.local_addr().map_or_else(|_| "?".into(), |a| format!("tcp://{a}")),
                    reason: format!("ranks {missing:?} did not connect within connect_timeout_ms"),
                });
            }
        }
    }
    Ok(())
}

impl<C: Transport> Transport for TcpTransport<C> {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        self.mesh.send_slice(to, tag, &payload).await
    }

    /// A socket write copies into the kernel before it returns.
    fn copies_on_send(&self, _to: Rank) -> bool {
        true
    }

    async fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> Result<(), ClusterError> {
        self.mesh.send_slice(to, tag, data).await
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        self.mesh.mailbox().recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.mesh.mailbox().fence(epoch);
        self.control.fence(epoch);
    }

    async fn any_loss(&self) -> (Rank, String) {
        self.mesh.mailbox().any_loss().await
    }

    async fn shutdown(&self) {
        self.mesh.shutdown().await;
        self.control.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::collective::{CollectiveConfig, Communicator, ReduceOp};
    use crate::transport::memory::MemoryTransport;

    const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

    /// `world` ranks over TCP, set up through an in-memory control mesh (returned too).
    async fn mesh(
        world: usize,
        payloads: TcpPayloads,
    ) -> (Vec<Arc<MemoryTransport>>, Vec<Arc<TcpTransport<MemoryTransport>>>) {
        let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(world, 64).into_iter().map(Arc::new).collect();
        let connects =
            control.iter().map(|c| TcpTransport::connect(c.clone(), LOOPBACK, TransportConfig::default(), payloads));
        let tcp =
            futures::future::join_all(connects).await.into_iter().map(|t| Arc::new(t.expect("connect"))).collect();
        (control, tcp)
    }

    /// Messages of every size between every pair (borrowed and owned sends), and an all-reduce whose
    /// slices are many frames and segments, equal what was sent — plaintext and encrypted.
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

    /// Ranks asked for different payloads (one plaintext, one encrypted) refuse to connect, each saying
    /// what it was asked for and what its peer was: never a mesh where one side seals and the other not.
    #[tokio::test]
    async fn ranks_that_disagree_on_encryption_do_not_connect() {
        let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 64).into_iter().map(Arc::new).collect();
        let config = TransportConfig { connect_timeout_ms: 5_000, ..TransportConfig::default() };
        let (plain, sealed) = futures::future::join(
            TcpTransport::connect(control[0].clone(), LOOPBACK, config.clone(), TcpPayloads::Plaintext),
            TcpTransport::connect(control[1].clone(), LOOPBACK, config, TcpPayloads::Encrypted),
        )
        .await;
        for (result, says) in [(plain.err(), "a key: the peer was asked for encrypted"), (sealed.err(), "no key")] {
            match result {
                Some(ClusterError::Connect { reason, .. }) => assert!(reason.contains(says), "{reason}"),
                other => panic!("expected a refusal saying {says:?}, got {other:?}"),
            }
        }
    }

    /// Dials rank 0's listener as the claimed `rank` with `token` and says whether the connection was
    /// closed on us (refused) rather than kept.
    async fn refused(addr: SocketAddr, first_frame: Bytes) -> bool {
        let mut stream = TcpStream::connect(addr).await.expect("dial");
        stream.write_all(&first_frame).await.expect("write");
        let mut byte = [0u8; 1];
        matches!(tokio::time::timeout(Duration::from_secs(5), stream.read(&mut byte)).await, Ok(Ok(0) | Err(_)))
    }

    /// The test plays rank 1 through the control mesh, so it learns rank 0's address and the token
    /// rank 0 gave it: connections with a wrong token, a bad world or rank, a first frame that is not
    /// a hello, or garbage are closed, and rank 0 goes on waiting — until the real rank 1 dials.
    #[tokio::test]
    async fn connections_without_the_peers_token_are_refused_and_the_set_up_goes_on() {
        let control: Vec<Arc<MemoryTransport>> = MemoryTransport::mesh(2, 64).into_iter().map(Arc::new).collect();
        let rank0 = tokio::spawn(TcpTransport::connect(
            control[0].clone(),
            LOOPBACK,
            TransportConfig::default(),
            TcpPayloads::Plaintext,
        ));
        let tag = Tag { group: TCP_SETUP_GROUP, epoch: 0, seq: 0, step: 0 };
        let ours =
            Invitation { addr: "127.0.0.1:9".parse().expect("addr"), token: random_token().expect("token"), key: None };
        control[1].send(0, tag, Bytes::from(serde_json::to_vec(&ours).expect("json"))).await.expect("invite");
        let got = control[1].recv(0, tag, LossScope::Peer, 10_000).await.expect("rank 0's invitation").to_vec();
        let Invitation { addr, token, .. } = serde_json::from_slice(&got).expect("an invitation");
        let hello = |rank: u32, world: u32, token: &str| {
            frame_control(FrameKind::Hello, &ControlMessage::TcpHello { rank, world, token: token.into() })
        };
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
        rank0.send_slice(1, Tag { group: 0, epoch: 1, seq: 0, step: 0 }, b"welcome").await.expect("send");
        let mut head = [0u8; crate::wire::HEADER_BYTES + 7];
        real.read_exact(&mut head).await.expect("a frame arrives on the accepted connection");
        assert_eq!(&head[crate::wire::HEADER_BYTES..], b"welcome");
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
}

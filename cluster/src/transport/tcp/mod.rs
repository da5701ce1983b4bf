//! The TCP data plane between hosts: a job opts in with `data_plane = encrypted_tcp` (TLS 1.3 with
//! mutual authentication, as on the QUIC mesh) or, on a trusted fabric, `data_plane = plaintext_tcp`;
//! the default stays the mutually-authenticated QUIC mesh.
//!
//! Why it exists: on a CPU-bound host QUIC's packetization — a copy into every packet and of every
//! received datagram, per-packet state and acknowledgements in user space — costs about as much CPU as
//! the transfer itself (docs/benchmarks.md). Over TCP the kernel does the segmenting. Without
//! encryption this is Gloo's and NCCL's trade: tensors in the clear.
//!
//! How connections are made: *through* an authenticated control transport (the QUIC mesh). Every rank
//! binds a TCP listener and sends each peer, over that transport, the listener's address and a fresh
//! 256-bit token for that peer alone. A dialer's first frame names its rank and the token; a connection
//! whose token does not match the one given to the rank it claims — a stray process, a port scanner, a
//! connection meant for another attempt — is refused and logged, and the set-up goes on waiting for
//! the real peer.
//!
//! Encrypted, every connection is TLS 1.3 (tokio-rustls) with the configurations the QUIC endpoint
//! uses ([`crate::identity::client_config`], [`crate::identity::server_config`]): the dialer checks the
//! listener's certificate against the cluster CA and the name the roster gives that rank; the listener
//! requires a client certificate from the cluster CA, and the hello's claimed rank must be the one the
//! certificate names, as QUIC's listener checks. A refused handshake — a certificate of another CA,
//! none, one for another rank — is logged with its reason and kept ([`TcpTransport::refusals`]), and
//! the set-up goes on. Every later byte is sealed and authenticated by TLS: an altered, dropped,
//! repeated or injected record fails to open, the connection ends with a TLS alert and the peer is
//! lost, as on QUIC — never a wrong tensor. Plaintext, anyone who can read or write the fabric can
//! read or alter tensors in flight, exactly as with Gloo or NCCL.
//!
//! Failure detection: a crashed peer's socket ends at once (EOF or reset); a host that falls silent is
//! caught by the control transport's keep-alive (QUIC's idle timeout), whose loss is forwarded into this
//! transport's mailbox, so receives fail with `PeerLost` either way. The control transport is kept
//! open for the lifetime of this one and closed after it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, WriteHalf};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

use super::frame_io::{frame_control, read_message, FrameLimits, PlainSource, ReadOutcome};
use super::quic::{PeerInfo, Refusal, RefusalLog};
use super::stream_mesh::{FrameWriter, Plain, StreamMesh};
use super::{LossScope, Mailbox, Payload, Transport};
use crate::error::Rank;
use crate::identity::{client_config, server_config, verify_peer_name, NodeIdentity};
use crate::wire::{ControlMessage, FrameKind, Tag};
use crate::{ClusterError, TransportConfig};

#[cfg(test)]
mod tests;

/// Tag group of the set-up messages on the control transport (collectives use small group numbers,
/// the same-host arena's set-up `u32::MAX`).
const TCP_SETUP_GROUP: u32 = u32::MAX - 1;
const TOKEN_BYTES: usize = 32;
/// How long an accepted connection may take to finish its TLS handshake and send its first frame
/// before it is dropped.
const HELLO_TIMEOUT_MS: u64 = 2_000;
/// Pause after a failed accept before the next.
const ACCEPT_RETRY_MS: u64 = 20;
/// Sealed records a TLS connection may hold before writing them to its socket (rustls's default is
/// 64 KiB): one `writev` carries up to 64 records of 16 KiB, not 4.
const TLS_SEND_BUFFER_BYTES: usize = 1 << 20;
/// What a TLS connection reads from its socket at a time: rustls asks for one record (≤ 16 KiB) per
/// read; a buffer below it turns 16 such reads into one system call.
const TLS_READ_BUFFER_BYTES: usize = 256 << 10;

/// The byte stream under a TLS connection.
type TlsSocket = BufReader<TcpStream>;

/// What a rank tells each peer over the control transport: where to dial it, with what token, and
/// whether it speaks TLS there (so that ranks asked for different planes say so instead of failing
/// in a handshake).
#[derive(Serialize, Deserialize)]
struct Invitation {
    addr: SocketAddr,
    token: String,
    tls: bool,
}

/// Whether the bytes on the TCP connections are encrypted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpPayloads {
    /// Sent as they are (`data_plane = plaintext_tcp`).
    Plaintext,
    /// TLS 1.3, mutually authenticated with the cluster's certificates (`data_plane = encrypted_tcp`).
    Encrypted,
}

/// The sending half of a connection, plain or TLS.
enum ConnectionWriter {
    Plain(Plain<OwnedWriteHalf>),
    Tls(Plain<WriteHalf<TlsStream<TlsSocket>>>),
}

impl FrameWriter for ConnectionWriter {
    async fn write_frame(&mut self, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
        match self {
            ConnectionWriter::Plain(w) => w.write_frame(header, payload).await,
            ConnectionWriter::Tls(w) => w.write_frame(header, payload).await,
        }
    }

    async fn close(&mut self) -> std::io::Result<()> {
        match self {
            ConnectionWriter::Plain(w) => w.close().await,
            ConnectionWriter::Tls(w) => w.close().await,
        }
    }
}

/// A connection whose hello is done.
enum Connection {
    Plain(TcpStream),
    Tls(Box<TlsStream<TlsSocket>>),
}

impl Connection {
    /// A TLS connection whose handshake is done, its buffers sized for bulk tensors.
    fn tls(mut stream: TlsStream<TlsSocket>) -> Self {
        match &mut stream {
            TlsStream::Client(s) => s.get_mut().1.set_buffer_limit(Some(TLS_SEND_BUFFER_BYTES)),
            TlsStream::Server(s) => s.get_mut().1.set_buffer_limit(Some(TLS_SEND_BUFFER_BYTES)),
        }
        Connection::Tls(Box::new(stream))
    }
}

/// Takes a connection whose hello is done into `mesh`. A TLS stream's halves share its session (a
/// lock taken for each read or write); a plain socket's are independent.
fn join(mesh: &mut StreamMesh<ConnectionWriter>, peer: Rank, connection: Connection, limits: FrameLimits) {
    match connection {
        Connection::Plain(stream) => {
            let (reader, writer) = stream.into_split();
            mesh.add(peer, PlainSource(reader), ConnectionWriter::Plain(Plain(writer)), limits);
        }
        Connection::Tls(stream) => {
            let (reader, writer) = tokio::io::split(*stream);
            mesh.add(peer, PlainSource(reader), ConnectionWriter::Tls(Plain(writer)), limits);
        }
    }
}

/// This node's TLS configurations, as the QUIC endpoint builds them.
struct Tls {
    connector: TlsConnector,
    acceptor: TlsAcceptor,
}

impl Tls {
    fn new(identity: &NodeIdentity) -> Result<Self, ClusterError> {
        Ok(Tls {
            connector: TlsConnector::from(Arc::new(client_config(identity)?)),
            acceptor: TlsAcceptor::from(Arc::new(server_config(identity)?)),
        })
    }
}

pub struct TcpTransport<C: Transport> {
    rank: Rank,
    world: usize,
    mesh: StreamMesh<ConnectionWriter>,
    control: Arc<C>,
    refusals: RefusalLog,
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

/// Writes `hello` and pushes it out (a TLS stream may hold it back otherwise).
async fn say_hello<S: AsyncWrite + Unpin>(stream: &mut S, hello: &[u8]) -> std::io::Result<()> {
    stream.write_all(hello).await?;
    stream.flush().await
}

impl<C: Transport> TcpTransport<C> {
    /// Sets up the mesh among `control`'s ranks (the same ranks, numbered alike; `roster` names each
    /// one's certificate and where it listens): listens on this rank's roster IP (port chosen by the
    /// system), invites every peer over `control`, dials every lower rank, accepts every higher one.
    /// Every rank of `control` must call it, with the same `payloads`; `identity` is this node's, for
    /// TLS.
    pub async fn connect(
        control: Arc<C>,
        identity: &NodeIdentity,
        roster: &[PeerInfo],
        config: TransportConfig,
        payloads: TcpPayloads,
    ) -> Result<Self, ClusterError> {
        let (rank, world) = (control.rank(), control.world());
        assert_eq!(roster.len(), world, "the roster names the control transport's ranks");
        let limits = FrameLimits::from(&config);
        let tls = match payloads {
            TcpPayloads::Plaintext => None,
            TcpPayloads::Encrypted => Some(Tls::new(identity)?),
        };
        let bind_ip = roster[rank].addr.ip();
        let listener = TcpListener::bind((bind_ip, 0))
            .await
            .map_err(|e| ClusterError::io(format!("binding a TCP data-plane listener on {bind_ip}"), e))?;
        let addr = listener.local_addr().map_err(|e| ClusterError::io("reading the TCP listener's address", e))?;
        let tokens = (0..world).map(|_| random_token()).collect::<Result<Vec<_>, _>>()?;
        let tag = Tag { group: TCP_SETUP_GROUP, epoch: 0, seq: 0, step: 0 };
        let peers: Vec<Rank> = (0..world).filter(|&q| q != rank).collect();
        for &q in &peers {
            let invitation = Invitation { addr, token: tokens[q].clone(), tls: tls.is_some() };
            let invitation = serde_json::to_vec(&invitation).expect("an invitation always serializes");
            control.send(q, tag, Bytes::from(invitation)).await?;
        }
        let mut invitations: Vec<Option<Invitation>> = (0..world).map(|_| None).collect();
        for &q in &peers {
            let bad = |reason: String| ClusterError::Connect {
                rank,
                peer: q,
                addr: "(control transport)".into(),
                reason: format!("bad TCP data-plane invitation: {reason}"),
            };
            let bytes = control.recv(q, tag, LossScope::Peer, config.connect_timeout_ms).await?.to_vec();
            let invitation: Invitation = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
            let plane = |tls: bool| if tls { "TLS (encrypted_tcp)" } else { "plaintext (plaintext_tcp)" };
            if invitation.tls != tls.is_some() {
                return Err(bad(format!(
                    "the peer was asked for {}, this rank for {}",
                    plane(invitation.tls),
                    plane(tls.is_some())
                )));
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
            let late = || connect_err("not connected within connect_timeout_ms".into());
            let left = || deadline.saturating_duration_since(Instant::now());
            let mut stream = tokio::time::timeout(left(), TcpStream::connect(addr))
                .await
                .map_err(|_| late())?
                .map_err(|e| connect_err(e.to_string()))?;
            let _ = stream.set_nodelay(true);
            let hello = ControlMessage::TcpHello { rank: rank as u32, world: world as u32, token: token.clone() };
            let hello = frame_control(FrameKind::Hello, &hello);
            let connection = match &tls {
                None => {
                    say_hello(&mut stream, &hello).await.map_err(|e| connect_err(e.to_string()))?;
                    Connection::Plain(stream)
                }
                Some(tls) => {
                    let name = ServerName::try_from(roster[peer].name.clone())
                        .map_err(|e| connect_err(format!("rank {peer}'s name {:?}: {e}", roster[peer].name)))?;
                    let stream = BufReader::with_capacity(TLS_READ_BUFFER_BYTES, stream);
                    let mut stream = tokio::time::timeout(left(), tls.connector.connect(name, stream))
                        .await
                        .map_err(|_| late())?
                        .map_err(|e| connect_err(format!("TLS handshake failed: {e}")))?;
                    say_hello(&mut stream, &hello).await.map_err(|e| connect_err(e.to_string()))?;
                    Connection::tls(stream.into())
                }
            };
            join(&mut mesh, peer, connection, limits);
        }
        let refusals = RefusalLog::default();
        let admission = Admission { rank, world, roster, tokens, tls: tls.map(|t| t.acceptor), limits, refusals };
        admission.accept_peers(&listener, &mut mesh, deadline).await?;

        let watch = tokio::spawn({
            let (control, mailbox) = (control.clone(), mesh.mailbox().clone());
            async move {
                let (peer, reason) = control.any_loss().await;
                mailbox.peer_lost(peer, format!("lost on the control transport: {reason}"));
            }
        });
        Ok(TcpTransport { rank, world, mesh, control, refusals: admission.refusals, watch })
    }

    /// The connections refused during set-up (also logged), oldest first.
    pub fn refusals(&self) -> Vec<Refusal> {
        self.refusals.list()
    }
}

/// An accepted connection whose handshake and hello are done, not yet checked.
struct Greeted {
    connection: Connection,
    /// The client's certificate chain, verified against the cluster CA by the handshake (TLS only).
    certificates: Option<Vec<CertificateDer<'static>>>,
    hello: ControlMessage,
}

/// What a listening rank checks of the connections it accepts.
struct Admission<'r> {
    rank: Rank,
    world: usize,
    roster: &'r [PeerInfo],
    /// The token each rank was given.
    tokens: Vec<String>,
    tls: Option<TlsAcceptor>,
    limits: FrameLimits,
    refusals: RefusalLog,
}

/// The TLS handshake (when `acceptor`) and the hello of an accepted connection.
async fn greet(mut stream: TcpStream, acceptor: Option<TlsAcceptor>, limits: FrameLimits) -> Result<Greeted, String> {
    let _ = stream.set_nodelay(true);
    match acceptor {
        None => {
            let hello = read_hello(&mut stream, limits).await?;
            Ok(Greeted { connection: Connection::Plain(stream), certificates: None, hello })
        }
        Some(acceptor) => {
            let stream = BufReader::with_capacity(TLS_READ_BUFFER_BYTES, stream);
            let mut stream = acceptor.accept(stream).await.map_err(|e| format!("TLS handshake failed: {e}"))?;
            let certificates = stream.get_ref().1.peer_certificates().map(<[_]>::to_vec);
            let hello = read_hello(&mut stream, limits).await?;
            Ok(Greeted { connection: Connection::tls(stream.into()), certificates, hello })
        }
    }
}

async fn read_hello<S: AsyncRead + Unpin + Send>(
    stream: &mut S,
    limits: FrameLimits,
) -> Result<ControlMessage, String> {
    match read_message(stream, limits).await {
        Err(e) => Err(e.to_string()),
        Ok(ReadOutcome::Control { kind: FrameKind::Hello, message }) => Ok(message),
        Ok(other) => Err(format!("first frame is not a hello: {other:?}")),
    }
}

impl Admission<'_> {
    /// Accepts a connection from every rank above this one. Connections are greeted concurrently (one
    /// that never speaks cannot hold up the others); one whose handshake fails, whose hello is
    /// malformed, names a rank that is not expected, carries the wrong token or — with TLS — comes
    /// with a certificate that does not name the rank it claims is refused with a logged reason, and
    /// the wait goes on.
    async fn accept_peers(
        &self,
        listener: &TcpListener,
        mesh: &mut StreamMesh<ConnectionWriter>,
        deadline: Instant,
    ) -> Result<(), ClusterError> {
        let (rank, world) = (self.rank, self.world);
        let mut pending: usize = world - rank - 1;
        let mut greetings: JoinSet<(SocketAddr, Result<Greeted, String>)> = JoinSet::new();
        while pending > 0 {
            tokio::select! {
                accepted = listener.accept() => {
                    let (stream, from) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // E.g. out of file descriptors: pause rather than spin on the same error.
                            tracing::warn!(rank, error = %e, "accepting a TCP data-plane connection failed");
                            tokio::time::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
                            continue;
                        }
                    };
                    let (acceptor, limits) = (self.tls.clone(), self.limits);
                    greetings.spawn(async move {
                        let greeting = tokio::time::timeout(
                            Duration::from_millis(HELLO_TIMEOUT_MS),
                            greet(stream, acceptor, limits),
                        );
                        let greeted = greeting.await.unwrap_or_else(|_| {
                            Err(format!("no handshake and hello within {HELLO_TIMEOUT_MS} ms"))
                        });
                        (from, greeted)
                    });
                }
                Some(joined) = greetings.join_next() => {
                    let Ok((from, greeted)) = joined else { continue };
                    match greeted.and_then(|g| self.check(mesh, g)) {
                        Ok((peer, connection)) => {
                            join(mesh, peer, connection, self.limits);
                            pending -= 1;
                        }
                        Err(reason) => {
                            tracing::warn!(rank, %from, %reason, "refused a TCP data-plane connection");
                            self.refusals.record(from, reason);
                        }
                    }
                }
                _ = tokio::time::sleep_until(deadline.into()) => {
                    let missing = self.waiting_for(mesh);
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

    fn waiting_for(&self, mesh: &StreamMesh<ConnectionWriter>) -> Vec<Rank> {
        (self.rank + 1..self.world).filter(|&q| !mesh.is_connected(q)).collect()
    }

    /// The rank a greeted connection is from, if it may join.
    fn check(&self, mesh: &StreamMesh<ConnectionWriter>, greeted: Greeted) -> Result<(Rank, Connection), String> {
        let Greeted { connection, certificates, hello } = greeted;
        let ControlMessage::TcpHello { rank: r, world: w, token } = hello else {
            return Err(format!("unexpected hello {hello:?}"));
        };
        let (r, world) = (r as usize, self.world);
        if w as usize != world || r <= self.rank || r >= world {
            return Err(format!(
                "claims rank {r} of {w}; expected one of ranks {:?} of {world}",
                self.waiting_for(mesh)
            ));
        }
        if mesh.is_connected(r) {
            return Err(format!("claims rank {r}, which is already connected"));
        }
        if self.tls.is_some() {
            let name = &self.roster[r].name;
            verify_peer_name(certificates.as_deref().unwrap_or_default(), name)
                .map_err(|e| format!("claims rank {r} ({name:?}) with a certificate that is not its: {e}"))?;
        }
        if !tokens_match(&token, &self.tokens[r]) {
            return Err(format!("claims rank {r} with a token that is not the one rank {r} was given"));
        }
        Ok((r, connection))
    }
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

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        self.mesh.mailbox().loss_among(peers).await
    }

    async fn shutdown(&self) {
        self.mesh.shutdown().await;
        self.control.shutdown().await;
    }
}

//! The companion TCP connection of a node-to-node control connection: the kernel's word that the peer
//! *process* is gone. QUIC runs over UDP, and when a process dies its kernel tells nobody; but it
//! closes the process's TCP sockets, so the peer reads an end at once. A machine that vanishes closes
//! nothing: that case stays the heartbeat detector's.
//!
//! - **Authenticated.** The companion is TLS 1.3 over TCP with the cluster CA on both sides (the
//!   same rustls configurations as QUIC), and the acceptor's certificate must name the peer of the
//!   QUIC connection. The dialer's first bytes are a secret exported from the QUIC connection's TLS
//!   session ([RFC 5705 exporter](quinn::Connection::export_keying_material)): it binds the companion
//!   to that very connection (incarnation), not merely to the peer's name. The acceptor answers one
//!   byte once it found the connection. A connection that fails any of this is dropped and means
//!   nothing: a stranger connecting to the port and closing causes no event.
//! - **What an end means.** A companion is closed deliberately with a TLS `close_notify` (once its
//!   QUIC connection closed, for whatever reason): that end means nothing, QUIC tells how it ended.
//!   An end *without* `close_notify` (EOF or reset by the peer's kernel) while the QUIC connection is
//!   still open and current means the peer process exited or was killed: the QUIC connection is
//!   closed with [`CLOSE_PROCESS_GONE`] and reported `Lost` at once, by the connection's reader as
//!   always (one event per connection).
//! - **Incarnations.** A replaced connection is closed first (`CLOSE_REPLACED`), so its companion's
//!   end finds it closed or no longer current and means nothing for the newer one.
//! - **Best effort.** The listener is TCP on the QUIC port's number. If it cannot be bound, or the
//!   companion cannot be set up, the connection works as before, detected by heartbeats only (logged).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio_rustls::{TlsAcceptor, TlsConnector, TlsStream};

use super::link::Link;
use super::serve::close_with;
use super::shared::Shared;
use super::verify::{any_node_name_tls, DIAL_SERVER_NAME};
use super::CLOSE_PROCESS_GONE;
use crate::identity::{server_config, verify_peer_name, NodeIdentity};
use crate::ClusterError;

/// The exporter label of the secret that binds a companion to its QUIC connection.
const EXPORTER_LABEL: &[u8] = b"EXPORTER-troupe-control-companion";
/// Bytes of that secret.
const SECRET_BYTES: usize = 32;
/// The acceptor's answer once it found the connection.
const ADMITTED: u8 = 1;
/// How long an idle companion's kernel waits before probing the peer (keeps middleboxes' state).
const KEEPALIVE_S: u64 = 10;

/// The TLS configurations and the listener's stop signal, shared by an endpoint's companions.
pub(super) struct Companions {
    acceptor: TlsAcceptor,
    connector: TlsConnector,
    /// Notified when the endpoint closes: the listener stops.
    pub stop: Notify,
}

impl Companions {
    pub fn new(id: &NodeIdentity) -> Result<Self, ClusterError> {
        Ok(Companions {
            acceptor: TlsAcceptor::from(Arc::new(server_config(id)?)),
            connector: TlsConnector::from(Arc::new(any_node_name_tls(id)?)),
            stop: Notify::new(),
        })
    }
}

/// Binds the companion listener on the QUIC endpoint's address (TCP, same port number) and serves it
/// until the endpoint closes. Best effort: a port taken by someone else leaves heartbeats only.
pub(super) fn listen(shared: &Arc<Shared>) {
    let addr = shared.local_addr;
    let listener = match std::net::TcpListener::bind(addr).and_then(|l| {
        l.set_nonblocking(true)?;
        TcpListener::from_std(l)
    }) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::warn!(node = %shared.name, %addr, error = %e,
                "no companion TCP listener: a peer process's death is detected by heartbeats only");
            return;
        }
    };
    tokio::spawn(serve_listener(shared.clone(), listener));
}

async fn serve_listener(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let stop = shared.companions.stop.notified();
        tokio::pin!(stop);
        stop.as_mut().enable();
        if shared.is_closed() {
            return;
        }
        let (tcp, remote) = tokio::select! {
            _ = stop => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::debug!(node = %shared.name, error = %e, "companion accept failed");
                    continue;
                }
            },
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let limit = Duration::from_millis(shared.connect_timeout_ms);
            match tokio::time::timeout(limit, admit(&shared, tcp)).await {
                Ok(Ok((link, tls))) => watch(&shared, link, tls).await,
                Ok(Err(reason)) => tracing::debug!(node = %shared.name, %remote, %reason, "companion refused"),
                Err(_) => tracing::debug!(node = %shared.name, %remote, "companion refused: too slow"),
            }
        });
    }
}

/// The acceptor's side: TLS, then the secret of one of our current connections, from its peer.
async fn admit(shared: &Arc<Shared>, tcp: TcpStream) -> Result<(Arc<Link>, TlsStream<TcpStream>), String> {
    let mut tls = shared.companions.acceptor.accept(tcp).await.map_err(|e| format!("TLS: {e}"))?;
    let mut secret = [0u8; SECRET_BYTES];
    tls.read_exact(&mut secret).await.map_err(|e| format!("reading the secret: {e}"))?;
    let certs = tls.get_ref().1.peer_certificates().ok_or("no client certificate")?.to_vec();
    let links = shared.peers().list();
    let link = links
        .into_iter()
        .map(|(_, link)| link)
        .find(|link| exported(&link.conn).is_some_and(|s| s == secret))
        .ok_or("no current connection has this secret")?;
    verify_peer_name(&certs, &link.name)?;
    tls.write_all(&[ADMITTED]).await.map_err(|e| format!("answering: {e}"))?;
    let tls = TlsStream::from(tls);
    Ok((link, tls))
}

/// The dialer's side, once the QUIC connection `link` is admitted: dials the peer's companion
/// listener at `addr` and watches it. Best effort: a failure is logged.
pub(super) async fn dial(shared: Arc<Shared>, link: Arc<Link>, addr: SocketAddr) {
    let limit = Duration::from_millis(shared.connect_timeout_ms);
    match tokio::time::timeout(limit, open(&shared, &link, addr)).await {
        Ok(Ok(tls)) => watch(&shared, link, tls).await,
        Ok(Err(reason)) => tracing::warn!(node = %shared.name, peer = %link.name, %addr, %reason,
            "no companion connection: this peer's death is detected by heartbeats only"),
        Err(_) => tracing::warn!(node = %shared.name, peer = %link.name, %addr,
            "no companion connection within connect_timeout_ms: heartbeats only"),
    }
}

async fn open(shared: &Shared, link: &Link, addr: SocketAddr) -> Result<TlsStream<TcpStream>, String> {
    let secret = exported(&link.conn).ok_or("the QUIC connection exports no secret")?;
    let tcp = TcpStream::connect(addr).await.map_err(|e| format!("TCP connect: {e}"))?;
    keep_alive(&tcp);
    let name = ServerName::try_from(DIAL_SERVER_NAME).map_err(|e| e.to_string())?;
    let mut tls = shared.companions.connector.connect(name, tcp).await.map_err(|e| format!("TLS: {e}"))?;
    let certs = tls.get_ref().1.peer_certificates().ok_or("no server certificate")?.to_vec();
    verify_peer_name(&certs, &link.name)?;
    tls.write_all(&secret).await.map_err(|e| format!("sending the secret: {e}"))?;
    let mut answer = [0u8; 1];
    tls.read_exact(&mut answer).await.map_err(|e| format!("no answer: {e}"))?;
    if answer[0] != ADMITTED {
        return Err(format!("unexpected answer {}", answer[0]));
    }
    Ok(TlsStream::from(tls))
}

fn keep_alive(tcp: &TcpStream) {
    let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(KEEPALIVE_S));
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
    let _ = tcp.set_nodelay(true);
}

fn exported(conn: &quinn::Connection) -> Option<[u8; SECRET_BYTES]> {
    let mut secret = [0u8; SECRET_BYTES];
    conn.export_keying_material(&mut secret, EXPORTER_LABEL, b"").ok()?;
    Some(secret)
}

/// Waits for the first of: the QUIC connection closing (then closes the companion with
/// `close_notify`), or the companion ending (then judges what the end means).
async fn watch(shared: &Shared, link: Arc<Link>, mut tls: TlsStream<TcpStream>) {
    if let TlsStream::Server(s) = &tls {
        keep_alive(s.get_ref().0);
    }
    link.set_watched();
    let mut buf = [0u8; 64];
    let ended = loop {
        tokio::select! {
            _ = link.conn.closed() => {
                let _ = tokio::time::timeout(Duration::from_millis(shared.connect_timeout_ms), tls.shutdown()).await;
                return;
            }
            read = tls.read(&mut buf) => match read {
                Ok(0) => return, // close_notify: a deliberate end; QUIC says how the connection ended.
                Ok(_) => continue, // nothing is sent after the answer; ignore
                Err(e) => break e,
            },
        }
    };
    let current = shared.peers().get(&link.name).is_some_and(|l| Arc::ptr_eq(&l, &link));
    if !current || link.conn.close_reason().is_some() {
        return;
    }
    let reason = format!("the peer process is gone: its companion TCP connection ended without close_notify ({ended})");
    tracing::info!(node = %shared.name, peer = %link.name, %reason, "closing control connection");
    link.set_process_gone(reason.clone());
    close_with(&link.conn, CLOSE_PROCESS_GONE, &reason);
}

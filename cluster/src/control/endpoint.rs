//! [`ControlEndpoint`]: the public face of the control plane (see the module docs for semantics).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use quinn::ConnectionError;
use tokio::sync::{mpsc, Notify};

use super::companion::{self, Companions};
use super::intro::introduce;
use super::serve::close_with;
use super::shared::Shared;
use super::table::PeerTable;
use super::verify::{dialer_client_config, DIAL_SERVER_NAME};
use super::{ControlEvent, PeerRole, Refusal, CLOSE_DROPPED, CLOSE_GOODBYE, CLOSE_PROTOCOL};
use crate::identity::NodeIdentity;
use crate::transport::quic::bind_endpoint;
use crate::transport::FrameLimits;
use crate::{ClusterError, TransportConfig};

/// Pause between dial attempts while the peer is not up yet.
const DIAL_RETRY_MS: u64 = 50;

/// A node's (or a client's) control-plane endpoint. Cheap to clone: clones share one endpoint. Dropping
/// the last clone without [`close`](Self::close) closes every connection abruptly (peers see `Lost`).
#[derive(Clone)]
pub struct ControlEndpoint {
    handle: Arc<Handle>,
}

/// Owned by the handles only (the endpoint's tasks hold [`Shared`]), so that its drop means "the
/// owner is gone".
struct Handle {
    shared: Arc<Shared>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.shared.mark_closed() {
            self.shared.endpoint.close(CLOSE_DROPPED, b"endpoint dropped without close");
        }
    }
}

impl ControlEndpoint {
    /// Binds `addr` (port 0 allowed). Events arrive on the returned receiver, which must be drained.
    pub fn bind(
        id: &NodeIdentity,
        addr: SocketAddr,
        role: PeerRole,
        cfg: &TransportConfig,
    ) -> Result<(ControlEndpoint, mpsc::UnboundedReceiver<ControlEvent>), ClusterError> {
        let mut endpoint = bind_endpoint(id, addr, cfg)?;
        endpoint.set_default_client_config(dialer_client_config(id, cfg)?);
        let local_addr = endpoint.local_addr().map_err(|e| ClusterError::io(format!("address bound for {addr}"), e))?;
        let (events, receiver) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            name: id.name.clone(),
            role,
            limits: FrameLimits::from(cfg),
            connect_timeout_ms: cfg.connect_timeout_ms,
            idle_timeout_ms: cfg.idle_timeout_ms,
            companion_tcp: cfg.companion_tcp,
            endpoint,
            local_addr,
            events,
            peers: Mutex::new(PeerTable::default()),
            admitted: Notify::new(),
            refusals: Default::default(),
            closed: AtomicBool::new(false),
            companions: Companions::new(id)?,
        });
        tokio::spawn(shared.clone().accept());
        if role == PeerRole::Node && cfg.companion_tcp {
            companion::listen(&shared);
        }
        Ok((ControlEndpoint { handle: Arc::new(Handle { shared }) }, receiver))
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.handle.shared
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.shared().local_addr
    }

    /// The node name in this endpoint's certificate.
    pub fn name(&self) -> &str {
        &self.shared().name
    }

    pub fn role(&self) -> PeerRole {
        self.shared().role
    }

    /// Dials `addr` and returns the peer's verified name once both sides introduced themselves and the
    /// peer admitted us. Retries while nothing answers, until `connect_timeout_ms`; a refusal is final.
    /// A connection to a name already connected replaces the older one.
    pub async fn connect(&self, addr: SocketAddr) -> Result<String, ClusterError> {
        let shared = self.shared();
        let err = |reason: String| ClusterError::Dial { node: shared.name.clone(), addr: addr.to_string(), reason };
        if shared.closed.load(Ordering::SeqCst) {
            return Err(err("this endpoint is closed".into()));
        }
        let deadline = Instant::now() + Duration::from_millis(shared.connect_timeout_ms);
        let conn = match dial(&shared.endpoint, addr, deadline).await {
            Ok(conn) => conn,
            Err(Failed { reason, refused_by_us }) => {
                if refused_by_us {
                    shared.refuse(addr, reason.clone());
                }
                return Err(err(reason));
            }
        };
        let intro = match introduce(&conn, shared.us(), true).await {
            Ok(intro) => intro,
            Err(reason) => {
                // Closed already: the peer refused us (the reason says why). Otherwise we refuse it.
                if conn.close_reason().is_none() {
                    close_with(&conn, CLOSE_PROTOCOL, &reason);
                    shared.refuse(addr, reason.clone());
                }
                return Err(err(reason));
            }
        };
        let name = intro.name.clone();
        match shared.admit(conn.clone(), intro) {
            Ok(link) if link.role == PeerRole::Node && shared.role == PeerRole::Node && shared.companion_tcp => {
                tokio::spawn(companion::dial(shared.clone(), link, conn.remote_address()));
            }
            Ok(_) => {}
            Err(reason) => {
                close_with(&conn, CLOSE_PROTOCOL, &reason);
                shared.refuse(addr, reason.clone());
                return Err(err(reason));
            }
        }
        Ok(name)
    }

    /// Sends one message to `peer` after every earlier one to it (FIFO per peer). Returns once QUIC owns
    /// the message; waits while the peer's receive window is full.
    pub async fn send(&self, peer: &str, epoch: u64, body: Bytes) -> Result<(), ClusterError> {
        let shared = self.shared();
        let err = |reason: String| ClusterError::SendTo { node: shared.name.clone(), peer: peer.into(), reason };
        let link = shared.peers().get(peer).ok_or_else(|| err("not connected".into()))?;
        link.send(epoch, body, shared.limits).await.map_err(err)
    }

    /// Whether the current connection to `peer` has a companion TCP connection watching the peer
    /// process, so that its death is reported `Lost` within milliseconds (node-to-node connections,
    /// shortly after they are admitted; see the module docs).
    pub fn watches_process(&self, peer: &str) -> bool {
        self.shared().peers().get(peer).is_some_and(|link| link.is_watched())
    }

    pub fn is_connected(&self, peer: &str) -> bool {
        self.shared().peers().get(peer).is_some()
    }

    /// Every connected peer with its role, sorted by name.
    pub fn peers(&self) -> Vec<(String, PeerRole)> {
        self.shared().peers().list().into_iter().map(|(name, link)| (name, link.role)).collect()
    }

    /// Says goodbye to `peer` (it sees `Departed`) and closes the connection; emits nothing here.
    pub async fn disconnect(&self, peer: &str) {
        let link = self.shared().peers().remove(peer);
        if let Some(link) = link {
            link.say_goodbye(self.shared().connect_timeout_ms).await;
        }
    }

    /// Says goodbye to every peer, waits (at most `connect_timeout_ms`) until each has read all we sent,
    /// then closes the endpoint. Nothing is admitted afterwards.
    pub async fn close(&self) {
        let shared = self.shared();
        let links = {
            let mut peers = shared.peers();
            shared.mark_closed();
            peers.drain()
        };
        futures::future::join_all(links.iter().map(|l| l.say_goodbye(shared.connect_timeout_ms))).await;
        shared.endpoint.close(CLOSE_GOODBYE, b"goodbye");
        let idle = shared.endpoint.wait_idle();
        let _ = tokio::time::timeout(Duration::from_millis(shared.idle_timeout_ms), idle).await;
    }

    /// Refused handshakes and introductions, oldest first (bounded; each is also logged).
    pub fn refusals(&self) -> Vec<Refusal> {
        self.shared().refusals.list()
    }
}

/// Whether a failed dial may be retried: nobody answered (yet). A refusal is final.
fn worth_retrying(err: &ConnectionError) -> bool {
    matches!(err, ConnectionError::TimedOut | ConnectionError::Reset)
}

/// Why a dial failed, and whether it was our side that refused (e.g. the peer's certificate).
struct Failed {
    reason: String,
    refused_by_us: bool,
}

async fn dial(endpoint: &quinn::Endpoint, addr: SocketAddr, deadline: Instant) -> Result<quinn::Connection, Failed> {
    let failed = |reason: String, refused_by_us| Failed { reason, refused_by_us };
    loop {
        let attempt = endpoint.connect(addr, DIAL_SERVER_NAME).map_err(|e| failed(e.to_string(), false))?;
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, attempt).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) if worth_retrying(&e) && Instant::now() + Duration::from_millis(DIAL_RETRY_MS) < deadline => {
                tracing::debug!(%addr, error = %e, "dial failed, retrying");
                tokio::time::sleep(Duration::from_millis(DIAL_RETRY_MS)).await;
            }
            Ok(Err(e)) => {
                let ours = matches!(e, ConnectionError::TransportError(_));
                return Err(failed(format!("TLS handshake failed: {e}"), ours));
            }
            Err(_) => return Err(failed("timed out (connect_timeout_ms)".into(), false)),
        }
    }
}

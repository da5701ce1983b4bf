//! The state one endpoint's tasks share: who is connected, refusals, the event channel; admitting a
//! connection and reporting its end.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, Notify};

use super::companion::Companions;
use super::intro::{introduce, Introduced, Us};
use super::link::Link;
use super::serve::{close_with, read_messages, Ending};
use super::table::PeerTable;
use super::{ControlEvent, PeerRole, CLOSE_PROTOCOL, CLOSE_REPLACED};
use crate::transport::quic::RefusalLog;
use crate::transport::FrameLimits;

pub(super) struct Shared {
    pub name: String,
    pub role: PeerRole,
    pub limits: FrameLimits,
    pub connect_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    /// [`crate::TransportConfig::companion_tcp`]: listen for and dial companion connections.
    pub companion_tcp: bool,
    pub endpoint: quinn::Endpoint,
    pub local_addr: SocketAddr,
    pub events: mpsc::UnboundedSender<ControlEvent>,
    pub peers: Mutex<PeerTable<Arc<Link>>>,
    /// Signalled whenever a connection is admitted (a replaced connection waits for its successor).
    pub admitted: Notify,
    pub refusals: RefusalLog,
    /// Set by `close()` or by dropping the last handle: nothing new is admitted.
    pub closed: AtomicBool,
    /// The companion TCP connections' TLS and listener (node endpoints only).
    pub companions: Companions,
}

impl Shared {
    pub fn peers(&self) -> MutexGuard<'_, PeerTable<Arc<Link>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Marks the endpoint closed (nothing new is admitted) and stops the companion listener; returns
    /// whether it was open.
    pub fn mark_closed(&self) -> bool {
        let was_open = !self.closed.swap(true, Ordering::SeqCst);
        self.companions.stop.notify_waiters();
        was_open
    }

    pub fn us(&self) -> Us<'_> {
        Us { name: &self.name, role: self.role, limits: self.limits, timeout_ms: self.connect_timeout_ms }
    }

    pub fn refuse(&self, remote: SocketAddr, reason: String) {
        tracing::warn!(node = %self.name, %remote, %reason, "refused control connection");
        self.refusals.record(remote, reason);
    }

    fn emit(&self, event: ControlEvent) {
        // The owner dropped the receiver: nobody is listening any more.
        let _ = self.events.send(event);
    }

    /// Makes an introduced connection the current one to its peer, reports it, and starts reading it.
    pub fn admit(self: &Arc<Self>, conn: quinn::Connection, intro: Introduced) -> Result<Arc<Link>, String> {
        let Introduced { name, role, outgoing, incoming } = intro;
        let (id, link) = {
            let mut peers = self.peers();
            if self.closed.load(Ordering::SeqCst) {
                return Err("this endpoint is closing".into());
            }
            // A node's name is its identity: its newer connection replaces the older (it restarted, or
            // its link broke). Clients are told apart by connection: two commands under one certificate
            // (`troupe train` following a job, `troupe status` beside it) each keep their connection
            // and their replies.
            let name = match role {
                PeerRole::Client if self.role == PeerRole::Node => format!("{name}#{}", peers.next_id()),
                _ => name,
            };
            if let Some(other) = peers.get(&name).filter(|l| l.role != role) {
                return Err(format!("{name:?} is already connected as {:?}; refusing it as {role:?}", other.role));
            }
            let link = Arc::new(Link::new(name.clone(), role, conn.clone(), outgoing));
            let (id, replaced) = peers.insert(&name, link.clone());
            if let Some(old) = replaced {
                tracing::info!(node = %self.name, peer = %name, "a newer connection replaces the older one");
                old.conn.close(CLOSE_REPLACED, b"replaced by a newer connection");
            }
            self.emit(ControlEvent::Connected { peer: name, role, addr: conn.remote_address() });
            (id, link)
        };
        self.admitted.notify_waiters();
        tokio::spawn(self.clone().serve(id, link.clone(), incoming));
        Ok(link)
    }

    async fn serve(self: Arc<Self>, id: u64, link: Arc<Link>, incoming: quinn::RecvStream) {
        let ending = read_messages(&link, incoming, self.limits, |e| self.emit(e)).await;
        let event = match ending {
            Ending::Goodbye => ControlEvent::Departed { peer: link.name.clone() },
            Ending::Lost(reason) => {
                let reason = link.process_gone().map_or(reason, str::to_owned);
                ControlEvent::Lost { peer: link.name.clone(), reason }
            }
            Ending::Replaced => {
                if self.successor_admitted(&link.name, id).await {
                    return;
                }
                let reason = "the peer replaced this connection, and no newer one was admitted in time";
                ControlEvent::Lost { peer: link.name.clone(), reason: reason.into() }
            }
        };
        let mut peers = self.peers();
        if peers.remove_if_current(&link.name, id).is_some() {
            tracing::info!(node = %self.name, ?event, "control connection ended");
            self.emit(event);
        }
    }

    /// Waits (at most `connect_timeout_ms`) until connection `id` of `name` is no longer current.
    async fn successor_admitted(&self, name: &str, id: u64) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(self.connect_timeout_ms);
        loop {
            let admitted = self.admitted.notified();
            tokio::pin!(admitted);
            admitted.as_mut().enable();
            if !self.peers().is_current(name, id) {
                return true;
            }
            if tokio::time::timeout_at(deadline, admitted).await.is_err() {
                return false;
            }
        }
    }

    /// Serves incoming connections until the endpoint closes.
    pub async fn accept(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            if self.closed.load(Ordering::SeqCst) {
                incoming.refuse();
                continue;
            }
            tokio::spawn(self.clone().admit_incoming(incoming));
        }
    }

    async fn admit_incoming(self: Arc<Self>, incoming: quinn::Incoming) {
        let remote = incoming.remote_address();
        let conn = match incoming.await {
            Ok(conn) => conn,
            Err(e) => return self.refuse(remote, format!("TLS handshake failed: {e}")),
        };
        let admitted = match introduce(&conn, self.us(), false).await {
            Ok(intro) => self.admit(conn.clone(), intro),
            Err(reason) => Err(reason),
        };
        if let Err(reason) = admitted {
            close_with(&conn, CLOSE_PROTOCOL, &reason);
            self.refuse(remote, reason);
        }
    }
}

//! Accepting connections: the TLS handshake refuses certificates not from the cluster CA (and missing
//! ones); then the first stream must carry a `Hello` whose claimed rank's roster name matches the name
//! in the certificate. Every refusal is logged with its reason and kept (bounded) for inspection.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::connection::{peer_certificates, serve_connection, CLOSE_PROTOCOL};
use super::mesh::PeerInfo;
use super::refusal::RefusalLog;
use crate::error::Rank;
use crate::identity::verify_peer_name;
use crate::transport::{read_message, FrameLimits, Mailbox, ReadOutcome};
use crate::wire::{ControlMessage, FrameKind};

pub(super) struct Shared {
    pub rank: Rank,
    pub roster: Vec<PeerInfo>,
    pub mailbox: Arc<Mailbox>,
    pub limits: FrameLimits,
    pub hello_timeout_ms: u64,
    pub conns: Mutex<Vec<Option<quinn::Connection>>>,
    pub connected: Notify,
    pub refusals: RefusalLog,
}

impl Shared {
    fn refuse(&self, remote: SocketAddr, reason: String) {
        tracing::warn!(rank = self.rank, %remote, %reason, "refused connection");
        self.refusals.record(remote, reason);
    }

    /// Records `conn` as the connection to `peer` and starts serving it. Refuses a second one.
    pub fn register(self: &Arc<Self>, peer: Rank, conn: quinn::Connection) -> Result<(), String> {
        {
            let mut conns = self.conns.lock().unwrap_or_else(|p| p.into_inner());
            if conns[peer].is_some() {
                return Err(format!("rank {peer} is already connected"));
            }
            conns[peer] = Some(conn.clone());
        }
        self.connected.notify_waiters();
        tokio::spawn(serve_connection(conn, peer, self.mailbox.clone(), self.limits));
        Ok(())
    }

    async fn admit(self: Arc<Self>, incoming: quinn::Incoming) {
        let remote = incoming.remote_address();
        let conn = match incoming.await {
            Ok(c) => c,
            Err(e) => return self.refuse(remote, format!("TLS handshake failed: {e}")),
        };
        match self.check_hello(&conn).await {
            Ok(peer) => {
                if let Err(reason) = self.register(peer, conn.clone()) {
                    conn.close(CLOSE_PROTOCOL, reason.as_bytes());
                    self.refuse(remote, reason);
                }
            }
            Err(reason) => {
                conn.close(CLOSE_PROTOCOL, &reason.as_bytes()[..reason.len().min(512)]);
                self.refuse(remote, reason);
            }
        }
    }

    async fn check_hello(&self, conn: &quinn::Connection) -> Result<Rank, String> {
        let certs = peer_certificates(conn).ok_or("peer presented no certificate")?;
        let first = async {
            let mut stream = conn.accept_uni().await.map_err(|e| format!("no hello stream: {e}"))?;
            read_message(&mut stream, self.limits).await.map_err(|e| format!("bad hello frame: {e}"))
        };
        let hello = tokio::time::timeout(Duration::from_millis(self.hello_timeout_ms), first)
            .await
            .map_err(|_| "no hello in time".to_string())??;
        let ReadOutcome::Control { kind: FrameKind::Hello, message: ControlMessage::Hello { node, rank, world } } =
            hello
        else {
            return Err(format!("first message is not a hello: {hello:?}"));
        };
        let rank = rank as usize;
        if world as usize != self.roster.len() || rank >= self.roster.len() || rank == self.rank {
            return Err(format!(
                "hello claims rank {rank} of world {world}; this group has {} ranks",
                self.roster.len()
            ));
        }
        if self.roster[rank].name != node {
            return Err(format!("hello claims rank {rank} as {node:?}, the roster says {:?}", self.roster[rank].name));
        }
        verify_peer_name(&certs, &node)?;
        Ok(rank)
    }
}

/// The accepting half of a node's QUIC endpoint. Keeps serving while individual connections fail.
pub struct QuicListener {
    pub(super) shared: Arc<Shared>,
    pub(super) endpoint: quinn::Endpoint,
}

impl QuicListener {
    pub fn start(
        endpoint: quinn::Endpoint,
        rank: Rank,
        roster: Vec<PeerInfo>,
        mailbox: Arc<Mailbox>,
        limits: FrameLimits,
        hello_timeout_ms: u64,
    ) -> Self {
        let world = roster.len();
        let shared = Arc::new(Shared {
            rank,
            roster,
            mailbox,
            limits,
            hello_timeout_ms,
            conns: Mutex::new(vec![None; world]),
            connected: Notify::new(),
            refusals: RefusalLog::default(),
        });
        let accept = shared.clone();
        let ep = endpoint.clone();
        tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                tokio::spawn(accept.clone().admit(incoming));
            }
        });
        QuicListener { shared, endpoint }
    }

    pub fn mailbox(&self) -> &Arc<Mailbox> {
        &self.shared.mailbox
    }

    pub fn refusals(&self) -> Vec<super::Refusal> {
        self.shared.refusals.list()
    }

    pub fn connection(&self, peer: Rank) -> Option<quinn::Connection> {
        self.shared.conns.lock().unwrap_or_else(|p| p.into_inner()).get(peer).cloned().flatten()
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }
}

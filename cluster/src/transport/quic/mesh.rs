//! A full mesh of QUIC connections among the ranks of a roster: rank i dials every j < i and accepts
//! every j > i. Implements [`Transport`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;

use super::connection::CLOSE_GOODBYE;
use super::endpoint::bind_endpoint;
use super::listener::QuicListener;
use crate::error::Rank;
use crate::identity::NodeIdentity;
use crate::transport::{frame_control, frame_message, FrameLimits, LossScope, Mailbox, Payload, Transport};
use crate::wire::{ControlMessage, FrameKind, Tag};
use crate::{ClusterError, TransportConfig};

/// A member of the group: the name in its certificate and where it listens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub name: String,
    pub addr: SocketAddr,
}

pub struct QuicTransport {
    rank: Rank,
    listener: QuicListener,
    config: TransportConfig,
    /// Streams sent but not yet acknowledged; `shutdown` waits for them.
    unacked: Mutex<JoinSet<()>>,
}

/// How often shutdown checks whether every peer has said goodbye.
const GOODBYE_POLL_MS: u64 = 5;

/// Pause between dial attempts while a peer is not up yet.
const DIAL_RETRY_MS: u64 = 50;

impl QuicTransport {
    /// Binds `roster[rank].addr`, connects to every other rank and returns once all are connected.
    pub async fn connect(
        id: &NodeIdentity,
        rank: Rank,
        roster: Vec<PeerInfo>,
        config: TransportConfig,
    ) -> Result<Self, ClusterError> {
        let endpoint = bind_endpoint(id, roster[rank].addr, &config)?;
        Self::connect_on(id, endpoint, rank, roster, config).await
    }

    /// Like [`Self::connect`], on an endpoint already bound (with [`bind_endpoint`]) at `roster[rank].addr`
    /// — how a rank that bound port 0 and announced the port it got joins the mesh.
    pub async fn connect_on(
        id: &NodeIdentity,
        endpoint: quinn::Endpoint,
        rank: Rank,
        roster: Vec<PeerInfo>,
        config: TransportConfig,
    ) -> Result<Self, ClusterError> {
        let mailbox = Arc::new(Mailbox::new(rank, config.unmatched_messages_max));
        let listener = QuicListener::start(
            endpoint.clone(),
            rank,
            roster.clone(),
            mailbox,
            FrameLimits::from(&config),
            config.connect_timeout_ms,
        );
        let deadline = Instant::now() + Duration::from_millis(config.connect_timeout_ms);
        let world = roster.len() as u32;
        for (peer, info) in roster.iter().enumerate().take(rank) {
            let conn = dial(&endpoint, rank, peer, info, deadline).await?;
            let hello = frame_control(
                FrameKind::Hello,
                &ControlMessage::Hello { node: id.name.clone(), rank: rank as u32, world },
            );
            let connect_err =
                |reason: String| ClusterError::Connect { rank, peer, addr: info.addr.to_string(), reason };
            let mut s = conn.open_uni().await.map_err(|e| connect_err(e.to_string()))?;
            s.write_all(&hello).await.map_err(|e| connect_err(e.to_string()))?;
            s.finish().map_err(|e| connect_err(e.to_string()))?;
            listener.shared.register(peer, conn).map_err(connect_err)?;
        }
        // Wait for the ranks above us to dial in.
        loop {
            let notified = listener.shared.connected.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let missing: Vec<Rank> = (rank + 1..roster.len()).filter(|&p| listener.connection(p).is_none()).collect();
            let Some(&peer) = missing.first() else { break };
            let now = Instant::now();
            if now >= deadline || tokio::time::timeout(deadline - now, notified).await.is_err() {
                return Err(ClusterError::Connect {
                    rank,
                    peer,
                    addr: roster[peer].addr.to_string(),
                    reason: format!(
                        "ranks {missing:?} did not connect within connect_timeout_ms = {}",
                        config.connect_timeout_ms
                    ),
                });
            }
        }
        Ok(QuicTransport { rank, listener, config, unacked: Mutex::new(JoinSet::new()) })
    }

    /// quinn's path statistics for the connection to `peer` (current MTU, RTT, congestion events).
    pub fn path_stats(&self, peer: Rank) -> Option<String> {
        self.listener.connection(peer).map(|c| format!("{:?}", c.stats().path))
    }

    pub fn listener(&self) -> &QuicListener {
        &self.listener
    }

    fn conn(&self, peer: Rank, epoch: u64) -> Result<quinn::Connection, ClusterError> {
        self.listener.connection(peer).ok_or(ClusterError::PeerLost {
            rank: self.rank,
            peer,
            epoch,
            reason: "not connected".into(),
        })
    }
}

async fn dial(
    endpoint: &quinn::Endpoint,
    rank: Rank,
    peer: Rank,
    info: &PeerInfo,
    deadline: Instant,
) -> Result<quinn::Connection, ClusterError> {
    let err = |reason: String| ClusterError::Connect { rank, peer, addr: info.addr.to_string(), reason };
    loop {
        let attempt = endpoint.connect(info.addr, &info.name).map_err(|e| err(e.to_string()))?;
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, attempt).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) if Instant::now() + Duration::from_millis(DIAL_RETRY_MS) < deadline => {
                tracing::debug!(rank, peer, error = %e, "dial failed, retrying");
                tokio::time::sleep(Duration::from_millis(DIAL_RETRY_MS)).await;
            }
            Ok(Err(e)) => return Err(err(e.to_string())),
            Err(_) => return Err(err("timed out".into())),
        }
    }
}

impl Transport for QuicTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.listener.shared.roster.len()
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        let conn = self.conn(to, tag.epoch)?;
        let lost = |e: String| ClusterError::PeerLost { rank: self.rank, peer: to, epoch: tag.epoch, reason: e };
        let mut chunks = frame_message(tag, payload, self.config.frame_bytes_max)
            .map_err(|source| ClusterError::Wire { rank: self.rank, peer: to, source })?;
        let mut stream = conn.open_uni().await.map_err(|e| lost(e.to_string()))?;
        stream.write_all_chunks(&mut chunks).await.map_err(|e| lost(format!("{e}: {e:?}")))?;
        stream.finish().map_err(|e| lost(e.to_string()))?;
        let acked = stream.stopped();
        self.unacked.lock().unwrap_or_else(|p| p.into_inner()).spawn(async move {
            let _ = acked.await;
        });
        Ok(())
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        self.listener.mailbox().recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.listener.mailbox().fence(epoch);
    }

    async fn any_loss(&self) -> (Rank, String) {
        self.listener.mailbox().any_loss().await
    }

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        self.listener.mailbox().loss_among(peers).await
    }

    async fn shutdown(&self) {
        let mut unacked = std::mem::take(&mut *self.unacked.lock().unwrap_or_else(|p| p.into_inner()));
        let drain = async { while unacked.join_next().await.is_some() {} };
        let bound = Duration::from_millis(self.config.connect_timeout_ms);
        let _ = tokio::time::timeout(bound, drain).await;
        // Closing while a peer still reads our last messages would discard them: announce that we
        // are finished, and close only once every peer has announced the same (or is gone).
        let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: self.rank as u32 });
        let peers: Vec<Rank> = (0..self.world()).filter(|&p| p != self.rank).collect();
        for &peer in &peers {
            if let Some(c) = self.listener.connection(peer) {
                if let Ok(mut s) = c.open_uni().await {
                    let _ = s.write_all(&goodbye).await;
                    let _ = s.finish();
                }
            }
        }
        let mailbox = self.listener.mailbox().clone();
        let wait = async {
            while !mailbox.all_finished_or_gone(peers.iter().copied()) {
                tokio::time::sleep(Duration::from_millis(GOODBYE_POLL_MS)).await;
            }
        };
        if tokio::time::timeout(bound, wait).await.is_err() {
            tracing::warn!(rank = self.rank, "peers did not finish within connect_timeout_ms; closing anyway");
        }
        for peer in 0..self.world() {
            if let Some(c) = self.listener.connection(peer) {
                c.close(CLOSE_GOODBYE, b"goodbye");
            }
        }
        self.listener.mailbox().close();
        let _ = tokio::time::timeout(
            Duration::from_millis(self.config.idle_timeout_ms),
            self.listener.endpoint.wait_idle(),
        )
        .await;
    }
}

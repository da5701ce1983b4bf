//! Same-host transport: a full mesh of Unix-domain stream sockets among processes on one machine
//! (rank i listens on `DIR/rank-i.sock`, dials every j < i). Same framing as QUIC; no TLS — the socket
//! directory's permissions are the boundary. A crashed peer surfaces at once (its socket hits EOF).
//!
//! Once the mesh is up the ranks also set up a shared-memory arena ([`super::shm`]) over it, unless
//! `shared_memory_slot_bytes` is 0 or any rank cannot; collectives then run in the arena and only
//! point-to-point messages and departures use the sockets.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};

use super::frame_io::{frame_control, read_message, FrameLimits, PlainSource, ReadOutcome};
use super::shm::{map_peer, Arena, OwnSegment};
use super::stream_mesh::{Plain, StreamMesh};
use super::{LossScope, Mailbox, Payload, Transport};
use crate::error::Rank;
use crate::wire::{ControlMessage, FrameKind, Tag};
use crate::{ClusterError, TransportConfig};

const DIAL_RETRY_MS: u64 = 20;
/// Socket buffer sizes requested for bulk traffic.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

pub struct SameHostTransport {
    rank: Rank,
    world: usize,
    mesh: StreamMesh<Plain<OwnedWriteHalf>>,
    config: TransportConfig,
    arena: Option<Arc<Arena>>,
}

/// Tag group of the arena set-up messages (collectives use small group numbers).
const ARENA_SETUP_GROUP: u32 = u32::MAX;

pub fn socket_path(dir: &Path, rank: Rank) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

fn tune(stream: &UnixStream) {
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
}

impl SameHostTransport {
    pub async fn connect(dir: &Path, rank: Rank, world: usize, config: TransportConfig) -> Result<Self, ClusterError> {
        let limits = FrameLimits::from(&config);
        let mailbox = Arc::new(Mailbox::new(rank, config.unmatched_messages_max));
        let path = socket_path(dir, rank);
        let _ = std::fs::remove_file(&path);
        let listener =
            UnixListener::bind(&path).map_err(|e| ClusterError::io(format!("binding {}", path.display()), e))?;
        let deadline = Instant::now() + Duration::from_millis(config.connect_timeout_ms);
        let mut mesh = StreamMesh::new(rank, world, mailbox, config.frame_bytes_max, "same-host");
        let connect_err = |peer: Rank, reason: String| ClusterError::Connect {
            rank,
            peer,
            addr: socket_path(dir, peer).display().to_string(),
            reason,
        };
        #[allow(clippy::needless_range_loop)] // `peer` names the socket to dial as well as the slot
        for peer in 0..rank {
            let stream = loop {
                match UnixStream::connect(socket_path(dir, peer)).await {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(rank, peer, error = %e, "dial failed, retrying");
                        tokio::time::sleep(Duration::from_millis(DIAL_RETRY_MS)).await;
                    }
                    Err(e) => return Err(connect_err(peer, e.to_string())),
                }
            };
            tune(&stream);
            let (reader, mut writer) = stream.into_split();
            let hello = frame_control(
                FrameKind::Hello,
                &ControlMessage::Hello { node: String::new(), rank: rank as u32, world: world as u32 },
            );
            writer.write_all(&hello).await.map_err(|e| connect_err(peer, e.to_string()))?;
            mesh.add(peer, PlainSource(reader), Plain(writer), limits);
        }
        for _ in rank + 1..world {
            let left = deadline.saturating_duration_since(Instant::now());
            let (stream, _) = tokio::time::timeout(left, listener.accept())
                .await
                .map_err(|_| connect_err(rank + 1, "peers did not connect within connect_timeout_ms".into()))?
                .map_err(|e| connect_err(rank + 1, e.to_string()))?;
            tune(&stream);
            let (mut reader, writer) = stream.into_split();
            let hello = tokio::time::timeout(left, read_message(&mut reader, limits))
                .await
                .map_err(|_| connect_err(rank + 1, "no hello".into()))?;
            let peer = match hello {
                Ok(ReadOutcome::Control {
                    kind: FrameKind::Hello,
                    message: ControlMessage::Hello { rank: r, world: w, .. },
                }) if (r as usize) > rank
                    && (r as usize) < world
                    && w as usize == world
                    && !mesh.is_connected(r as usize) =>
                {
                    r as usize
                }
                other => return Err(connect_err(rank + 1, format!("bad hello: {other:?}"))),
            };
            mesh.add(peer, PlainSource(reader), Plain(writer), limits);
        }
        let _ = std::fs::remove_file(&path);
        let mut transport = SameHostTransport { rank, world, mesh, config, arena: None };
        transport.arena = transport.set_up_arena().await?;
        Ok(transport)
    }

    /// Every rank creates its segment and sends the path; every rank maps the others' and says whether
    /// it managed. The arena is used only if all did, so every rank decides alike; each segment's name
    /// is removed once every peer has answered (mapped or not).
    async fn set_up_arena(&self) -> Result<Option<Arc<Arena>>, ClusterError> {
        let (rank, world) = (self.rank, self.world);
        let slot_bytes = self.config.shared_memory_slot_bytes;
        if world < 2 || slot_bytes == 0 {
            return Ok(None);
        }
        let timeout = self.config.connect_timeout_ms;
        let tag = |seq| Tag { group: ARENA_SETUP_GROUP, epoch: 0, seq, step: 0 };
        let own = if slot_bytes / 4 / world == 0 || !slot_bytes.is_multiple_of(4) {
            Err(format!(
                "shared_memory_slot_bytes = {slot_bytes} must be a multiple of 4 and at least 4 × {world} ranks"
            ))
        } else {
            OwnSegment::create(rank, slot_bytes).map_err(|e| format!("creating a segment in /dev/shm: {e}"))
        };
        let path = own.as_ref().map(|o| o.path().display().to_string()).unwrap_or_default();
        let peers: Vec<Rank> = (0..world).filter(|&q| q != rank).collect();
        for &q in &peers {
            self.send(q, tag(0), Bytes::from(path.clone().into_bytes())).await?;
        }
        let mut problem = own.as_ref().err().cloned();
        let mut mapped: Vec<Option<_>> = (0..world).map(|_| None).collect();
        for &q in &peers {
            let theirs = self.recv(q, tag(0), LossScope::Peer, timeout).await?.to_vec();
            let theirs = String::from_utf8_lossy(&theirs).into_owned();
            if problem.is_some() {
                continue;
            }
            if theirs.is_empty() {
                problem = Some(format!("rank {q} has no segment"));
                continue;
            }
            match map_peer(&theirs, slot_bytes) {
                Ok(m) => mapped[q] = Some(m),
                Err(e) => problem = Some(format!("rank {q}'s segment: {e}")),
            }
        }
        let ok = problem.is_none();
        for &q in &peers {
            self.send(q, tag(1), Bytes::from(vec![u8::from(ok)])).await?;
        }
        let mut all_ok = ok;
        for &q in &peers {
            let answer = self.recv(q, tag(1), LossScope::Peer, timeout).await?.to_vec();
            if answer != [1] {
                all_ok = false;
                problem.get_or_insert_with(|| format!("rank {q} could not map every segment"));
            }
        }
        match (own, all_ok) {
            (Ok(own), true) => {
                own.unlink();
                Ok(Some(Arc::new(Arena::new(rank, slot_bytes, own, mapped, self.mesh.mailbox().clone()))))
            }
            _ => {
                tracing::warn!(
                    rank,
                    reason = problem.as_deref().unwrap_or("unknown"),
                    "no shared-memory arena: collectives go over the sockets"
                );
                Ok(None)
            }
        }
    }
}

impl Transport for SameHostTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    async fn send(&self, to: Rank, tag: Tag, payload: Bytes) -> Result<(), ClusterError> {
        self.send_slice(to, tag, &payload).await
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
    }

    async fn any_loss(&self) -> (Rank, String) {
        self.mesh.mailbox().any_loss().await
    }

    async fn loss_among(&self, peers: &[Rank]) -> (Rank, String) {
        self.mesh.mailbox().loss_among(peers).await
    }

    fn arena(&self) -> Option<Arc<Arena>> {
        self.arena.clone()
    }

    async fn shutdown(&self) {
        self.mesh.shutdown().await;
    }
}

//! Same-host transport: a full mesh of Unix-domain stream sockets among processes on one machine
//! (rank i listens on `DIR/rank-i.sock`, dials every j < i). Same framing as QUIC; no TLS — the socket
//! directory's permissions are the boundary. A crashed peer surfaces at once (its socket hits EOF).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::Mutex as AsyncMutex;

use super::frame_io::{frame_control, frame_message, read_message, write_chunks, FrameLimits, ReadOutcome};
use super::{LossScope, Mailbox, Payload, Transport};
use crate::error::Rank;
use crate::wire::{ControlMessage, FrameKind, Tag, WireError};
use crate::{ClusterError, TransportConfig};

const DIAL_RETRY_MS: u64 = 20;
/// Socket buffer sizes requested for bulk traffic.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

pub struct SameHostTransport {
    rank: Rank,
    world: usize,
    writers: Vec<Option<AsyncMutex<OwnedWriteHalf>>>,
    mailbox: Arc<Mailbox>,
    config: TransportConfig,
}

pub fn socket_path(dir: &Path, rank: Rank) -> PathBuf {
    dir.join(format!("rank-{rank}.sock"))
}

fn tune(stream: &UnixStream) {
    let sock = socket2::SockRef::from(stream);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
}

async fn serve(mut reader: tokio::net::unix::OwnedReadHalf, peer: Rank, mailbox: Arc<Mailbox>, limits: FrameLimits) {
    loop {
        let outcome = read_message(&mut reader, limits).await;
        let err = match outcome {
            Ok(ReadOutcome::Data { tag, payload }) => match mailbox.deliver(peer, tag, payload) {
                Ok(()) => continue,
                Err(e) => e,
            },
            Ok(ReadOutcome::Control { message: ControlMessage::Abort { .. }, .. }) => continue,
            Ok(ReadOutcome::Control { message: ControlMessage::Goodbye { .. }, .. }) => {
                mailbox.peer_departed(peer);
                return;
            }
            Ok(ReadOutcome::Control { message, .. }) => WireError::Protocol(format!("unexpected {message:?}")),
            Ok(ReadOutcome::End) => {
                mailbox.peer_lost(peer, "socket closed without goodbye".into());
                return;
            }
            Err(WireError::Stream(reason)) => {
                mailbox.peer_lost(peer, reason);
                return;
            }
            Err(e) => e,
        };
        tracing::warn!(peer, reason = %err, "closing same-host connection: bad frame");
        mailbox.peer_lost(peer, format!("closed by us: {err}"));
        return;
    }
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
        let mut writers: Vec<Option<AsyncMutex<OwnedWriteHalf>>> = (0..world).map(|_| None).collect();
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
            tokio::spawn(serve(reader, peer, mailbox.clone(), limits));
            writers[peer] = Some(AsyncMutex::new(writer));
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
                    && writers[r as usize].is_none() =>
                {
                    r as usize
                }
                other => return Err(connect_err(rank + 1, format!("bad hello: {other:?}"))),
            };
            tokio::spawn(serve(reader, peer, mailbox.clone(), limits));
            writers[peer] = Some(AsyncMutex::new(writer));
        }
        let _ = std::fs::remove_file(&path);
        Ok(SameHostTransport { rank, world, writers, mailbox, config })
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
        let lost = |e: String| ClusterError::PeerLost { rank: self.rank, peer: to, epoch: tag.epoch, reason: e };
        let writer = self.writers.get(to).and_then(|w| w.as_ref()).ok_or_else(|| lost("not connected".into()))?;
        let chunks = frame_message(tag, payload, self.config.frame_bytes_max).map_err(|source| ClusterError::Wire {
            rank: self.rank,
            peer: to,
            source,
        })?;
        let mut w = writer.lock().await;
        write_chunks(&mut *w, &chunks).await.map_err(|e| lost(e.to_string()))
    }

    async fn recv(&self, from: Rank, tag: Tag, scope: LossScope, timeout_ms: u64) -> Result<Payload, ClusterError> {
        self.mailbox.recv(from, tag, scope, timeout_ms).await
    }

    fn fence(&self, epoch: u64) {
        self.mailbox.fence(epoch);
    }

    async fn shutdown(&self) {
        let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: self.rank as u32 });
        for w in self.writers.iter().flatten() {
            let mut w = w.lock().await;
            let _ = w.write_all(&goodbye).await;
            let _ = w.shutdown().await;
        }
        self.mailbox.close();
    }
}

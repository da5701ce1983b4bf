//! A full mesh of byte-stream connections (Unix or TCP sockets), one per peer, speaking this crate's
//! framing: what the same-host transport ([`super::same_host`]) and the TCP data plane ([`super::tcp`])
//! share once their connections are made. A reader task per peer delivers into the [`Mailbox`]; sends
//! write under a per-peer lock, straight from the caller's memory (a socket write copies into the
//! kernel before it returns; a TLS stream seals into its own buffer first).

use std::future::Future;
use std::sync::{Arc, Weak};

use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Mutex as AsyncMutex;

use super::frame_io::{frame_control, frame_parts, read_frames, FrameLimits, FrameSource, ReadOutcome};
use super::Mailbox;
use crate::error::Rank;
use crate::wire::{ControlMessage, FrameKind, Tag, WireError, HEADER_BYTES};
use crate::ClusterError;

/// The sending half of a connection, writing whole frames.
pub(crate) trait FrameWriter: Send + 'static {
    fn write_frame(&mut self, header: &[u8], payload: &[u8]) -> impl Future<Output = std::io::Result<()>> + Send;

    /// Ends the connection's sending direction.
    fn close(&mut self) -> impl Future<Output = std::io::Result<()>> + Send;
}

/// Frames written as they are to a byte stream (a socket, or a TLS stream over one), each pushed out
/// once written.
pub(crate) struct Plain<W>(pub W);

impl<W: AsyncWrite + Unpin + Send + 'static> FrameWriter for Plain<W> {
    async fn write_frame(&mut self, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
        self.0.write_all(header).await?;
        self.0.write_all(payload).await?;
        self.0.flush().await
    }

    fn close(&mut self) -> impl Future<Output = std::io::Result<()>> + Send {
        self.0.shutdown()
    }
}

/// The sending half of one peer's connection; `None` once the connection was closed after a failure.
type SharedWriter<W> = Arc<AsyncMutex<Option<W>>>;

pub(crate) struct StreamMesh<W> {
    rank: Rank,
    writers: Vec<Option<SharedWriter<W>>>,
    mailbox: Arc<Mailbox>,
    frame_bytes_max: u32,
    /// What the connections are, for the log ("same-host", "TCP").
    what: &'static str,
}

impl<W: FrameWriter> StreamMesh<W> {
    pub fn new(rank: Rank, world: usize, mailbox: Arc<Mailbox>, frame_bytes_max: u32, what: &'static str) -> Self {
        StreamMesh { rank, writers: (0..world).map(|_| None).collect(), mailbox, frame_bytes_max, what }
    }

    pub fn is_connected(&self, peer: Rank) -> bool {
        self.writers.get(peer).is_some_and(Option::is_some)
    }

    /// Takes the connection to `peer` (its hello already exchanged) into the mesh: a task reads its
    /// messages into the mailbox from now on, and closes the connection when it fails.
    pub fn add<S: FrameSource + 'static>(&mut self, peer: Rank, source: S, writer: W, limits: FrameLimits) {
        let writer = Arc::new(AsyncMutex::new(Some(writer)));
        tokio::spawn(serve(source, Arc::downgrade(&writer), peer, self.mailbox.clone(), limits, self.what));
        self.writers[peer] = Some(writer);
    }

    pub fn mailbox(&self) -> &Arc<Mailbox> {
        &self.mailbox
    }

    pub async fn send_slice(&self, to: Rank, tag: Tag, data: &[u8]) -> Result<(), ClusterError> {
        let lost = |e: String| ClusterError::PeerLost { rank: self.rank, peer: to, epoch: tag.epoch, reason: e };
        let writer = self.writers.get(to).and_then(|w| w.as_ref()).ok_or_else(|| lost("not connected".into()))?;
        let parts = frame_parts(tag, data.len(), self.frame_bytes_max).map_err(|source| ClusterError::Wire {
            rank: self.rank,
            peer: to,
            source,
        })?;
        let mut w = writer.lock().await;
        let w = w.as_mut().ok_or_else(|| lost("the connection was closed after a failure".into()))?;
        for (header, range) in parts {
            w.write_frame(&header, &data[range]).await.map_err(|e| lost(e.to_string()))?;
        }
        Ok(())
    }

    /// Says goodbye on every connection and closes it, so that peers see a departure, not a loss.
    pub async fn shutdown(&self) {
        let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: self.rank as u32 });
        for w in self.writers.iter().flatten() {
            let mut w = w.lock().await;
            let Some(w) = w.as_mut() else { continue };
            let _ = w.write_frame(&goodbye[..HEADER_BYTES], &goodbye[HEADER_BYTES..]).await;
            let _ = w.close().await;
        }
        self.mailbox.close();
    }
}

/// Reads `peer`'s messages into `mailbox` until it says goodbye, its connection ends or fails (the
/// peer is lost), or it sends a bad frame (logged, and the peer is lost). Unless the peer said
/// goodbye, the connection is then closed — both halves dropped — so that the peer's sends fail too
/// instead of filling a socket nobody reads. The writer is only borrowed (weakly): a mesh dropped
/// (a crash, as tests simulate one) closes its connections at once.
async fn serve<S: FrameSource, W>(
    source: S,
    writer: Weak<AsyncMutex<Option<W>>>,
    peer: Rank,
    mailbox: Arc<Mailbox>,
    limits: FrameLimits,
    what: &'static str,
) {
    if !read_until_done(source, peer, &mailbox, limits, what).await {
        if let Some(writer) = writer.upgrade() {
            drop(writer.lock().await.take());
        }
    }
}

/// [`serve`]'s reading: whether the peer said goodbye.
async fn read_until_done<S: FrameSource>(
    mut source: S,
    peer: Rank,
    mailbox: &Mailbox,
    limits: FrameLimits,
    what: &'static str,
) -> bool {
    loop {
        let outcome = read_frames(&mut source, limits).await;
        let err = match outcome {
            Ok(ReadOutcome::Data { tag, payload }) => match mailbox.deliver(peer, tag, payload) {
                Ok(()) => continue,
                Err(e) => e,
            },
            Ok(ReadOutcome::Control { message: ControlMessage::Abort { .. }, .. }) => continue,
            Ok(ReadOutcome::Control { message: ControlMessage::Goodbye { .. }, .. }) => {
                mailbox.peer_departed(peer);
                return true;
            }
            Ok(ReadOutcome::Control { message, .. }) => WireError::Protocol(format!("unexpected {message:?}")),
            Ok(ReadOutcome::End) => {
                mailbox.peer_lost(peer, "socket closed without goodbye".into());
                return false;
            }
            Err(WireError::Stream(reason)) => {
                mailbox.peer_lost(peer, reason);
                return false;
            }
            Err(e) => e,
        };
        tracing::warn!(peer, reason = %err, "closing {what} connection: bad frame");
        mailbox.peer_lost(peer, format!("closed by us: {err}"));
        return false;
    }
}

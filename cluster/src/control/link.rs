//! One admitted connection: its peer, and the single outgoing stream all messages to it are written
//! to, in order.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Mutex;

use super::{PeerRole, CLOSE_GOODBYE, CONTROL_GROUP};
use crate::transport::{frame_control, frame_message, FrameLimits};
use crate::wire::{ControlMessage, FrameKind, Tag};

pub(super) struct Link {
    pub name: String,
    pub role: PeerRole,
    pub conn: quinn::Connection,
    outgoing: Mutex<Outgoing>,
    /// A companion TCP connection watches the peer process ([`super::companion`]).
    watched: AtomicBool,
    /// Why the companion judged the peer process gone (the connection's `Lost` reason).
    process_gone: OnceLock<String>,
}

struct Outgoing {
    stream: quinn::SendStream,
    /// The frame header `seq` of the next message; the receiver checks there is no gap.
    next_seq: u64,
}

impl Link {
    pub fn new(name: String, role: PeerRole, conn: quinn::Connection, stream: quinn::SendStream) -> Self {
        let outgoing = Mutex::new(Outgoing { stream, next_seq: 0 });
        Link { name, role, conn, outgoing, watched: AtomicBool::new(false), process_gone: OnceLock::new() }
    }

    pub fn set_watched(&self) {
        self.watched.store(true, Ordering::SeqCst);
    }

    pub fn is_watched(&self) -> bool {
        self.watched.load(Ordering::SeqCst)
    }

    /// Records that the peer process is gone (before the connection is closed for it).
    pub fn set_process_gone(&self, reason: String) {
        let _ = self.process_gone.set(reason);
    }

    pub fn process_gone(&self) -> Option<&str> {
        self.process_gone.get().map(String::as_str)
    }

    /// Writes one message after all earlier ones. Waits while the peer's receive window is full.
    pub async fn send(&self, epoch: u64, body: Bytes, limits: FrameLimits) -> Result<(), String> {
        let bytes = body.len();
        let mut out = self.outgoing.lock().await;
        let tag = Tag { group: CONTROL_GROUP, epoch, seq: out.next_seq, step: 0 };
        let mut chunks = frame_message(tag, body, limits.frame_bytes_max).map_err(|e| e.to_string())?;
        let frames = chunks.len() / 2;
        if frames > limits.message_frames_max as usize {
            return Err(format!(
                "a message of {bytes} bytes needs {frames} frames; message_frames_max = {}",
                limits.message_frames_max
            ));
        }
        out.stream.write_all_chunks(&mut chunks).await.map_err(|e| e.to_string())?;
        out.next_seq += 1;
        Ok(())
    }

    /// Writes a goodbye after the last message and waits (at most `wait_ms`) for the peer to read
    /// everything and close the connection; then closes it with [`CLOSE_GOODBYE`].
    pub async fn say_goodbye(&self, wait_ms: u64) {
        let goodbye = frame_control(FrameKind::Control, &ControlMessage::Goodbye { rank: 0 });
        let delivered = async {
            {
                let mut out = self.outgoing.lock().await;
                if out.stream.write_all(&goodbye).await.is_err() {
                    return;
                }
                let _ = out.stream.finish();
            }
            self.conn.closed().await;
        };
        if tokio::time::timeout(Duration::from_millis(wait_ms), delivered).await.is_err() {
            tracing::debug!(peer = %self.name, wait_ms, "peer did not acknowledge our goodbye in time");
        }
        self.conn.close(CLOSE_GOODBYE, b"goodbye");
    }
}

//! Serving one established connection: every incoming stream is read as messages into the mailbox.
//! A malformed frame closes this connection (with the reason, logged) and nothing else.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use quinn::{ConnectionError, VarInt};
use rustls::pki_types::CertificateDer;

use crate::error::Rank;
use crate::transport::{read_message_with, FrameLimits, Mailbox, ReadOutcome};
use crate::wire::{ControlMessage, WireError};

/// Application close code for a graceful departure.
pub const CLOSE_GOODBYE: VarInt = VarInt::from_u32(0);
/// Application close code for a protocol violation by the peer.
pub const CLOSE_PROTOCOL: VarInt = VarInt::from_u32(1);

/// The certificate chain the peer presented (verified against the cluster CA during the handshake).
pub fn peer_certificates(conn: &quinn::Connection) -> Option<Vec<CertificateDer<'static>>> {
    conn.peer_identity().and_then(|any| any.downcast::<Vec<CertificateDer<'static>>>().ok()).map(|b| *b)
}

fn refuse(conn: &quinn::Connection, mailbox: &Mailbox, peer: Rank, err: &WireError) {
    tracing::warn!(peer, reason = %err, "closing connection: bad frame");
    let reason = err.to_string();
    mailbox.peer_lost(peer, format!("closed by us: {reason}"));
    conn.close(CLOSE_PROTOCOL, &reason.as_bytes()[..reason.len().min(512)]);
}

/// Payload bytes as the chunks quinn already holds (no copy, no reassembly buffer).
pub(super) fn read_chunks(stream: &mut quinn::RecvStream, length: u32) -> BoxFuture<'_, Result<Vec<Bytes>, WireError>> {
    Box::pin(async move {
        let length = length as usize;
        let mut left = length;
        let mut out = Vec::new();
        while left > 0 {
            match stream.read_chunk(left, true).await {
                Ok(Some(chunk)) => {
                    left -= chunk.bytes.len();
                    out.push(chunk.bytes);
                }
                Ok(None) => return Err(WireError::Truncated { needed: length, available: length - left }),
                Err(e) => return Err(WireError::Stream(format!("{e} ({e:?})"))),
            }
        }
        Ok(out)
    })
}

async fn read_stream(
    conn: quinn::Connection,
    mut stream: quinn::RecvStream,
    peer: Rank,
    mailbox: Arc<Mailbox>,
    limits: FrameLimits,
) {
    loop {
        match read_message_with(&mut stream, limits, read_chunks).await {
            Ok(ReadOutcome::End) => return,
            Ok(ReadOutcome::Data { tag, payload }) => {
                if let Err(e) = mailbox.deliver(peer, tag, payload) {
                    refuse(&conn, &mailbox, peer, &e);
                    return;
                }
            }
            Ok(ReadOutcome::Control { message: ControlMessage::Goodbye { .. }, .. }) => mailbox.peer_finished(peer),
            Ok(ReadOutcome::Control { message: ControlMessage::Abort { epoch, seq, reason }, .. }) => {
                tracing::info!(peer, epoch, seq, %reason, "peer aborted a collective");
            }
            Ok(ReadOutcome::Control { message, .. }) => {
                refuse(&conn, &mailbox, peer, &WireError::Protocol(format!("unexpected control message {message:?}")));
                return;
            }
            // The connection itself failed: `serve_connection` reports the loss.
            Err(WireError::Stream(_)) => return,
            Err(e) => {
                refuse(&conn, &mailbox, peer, &e);
                return;
            }
        }
    }
}

/// Reads every stream the peer opens until the connection ends, then reports the peer departed
/// (goodbye) or lost (anything else) to the mailbox.
pub async fn serve_connection(conn: quinn::Connection, peer: Rank, mailbox: Arc<Mailbox>, limits: FrameLimits) {
    let err = loop {
        match conn.accept_uni().await {
            Ok(stream) => {
                tokio::spawn(read_stream(conn.clone(), stream, peer, mailbox.clone(), limits));
            }
            Err(e) => break e,
        }
    };
    match err {
        ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_GOODBYE => mailbox.peer_departed(peer),
        ConnectionError::LocallyClosed => mailbox.peer_departed(peer),
        other => mailbox.peer_lost(peer, other.to_string()),
    }
}

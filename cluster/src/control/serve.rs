//! Reading one connection's incoming stream: every message in order, until a goodbye, a bad frame or
//! the end of the connection, which decides how the connection ended.

use bytes::Bytes;
use quinn::ConnectionError;

use super::link::Link;
use super::{ControlEvent, CLOSE_GOODBYE, CLOSE_PROTOCOL, CLOSE_REPLACED, CONTROL_GROUP};
use crate::transport::{read_message, FrameLimits, Payload, ReadOutcome};
use crate::wire::{ControlMessage, FrameKind, WireError};

/// Longest close reason sent to a peer (QUIC close frames must fit in a packet).
const CLOSE_REASON_BYTES_MAX: usize = 512;

/// How a connection ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Ending {
    /// The peer said goodbye: `Departed`.
    Goodbye,
    /// The peer replaced this connection by a newer one: no event once the newer one is admitted.
    Replaced,
    /// Anything else: `Lost`.
    Lost(String),
}

/// What an ended connection's error says about how it ended.
pub(super) fn ending_of(err: &ConnectionError) -> Ending {
    match err {
        ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_GOODBYE => Ending::Goodbye,
        ConnectionError::ApplicationClosed(close) if close.error_code == CLOSE_REPLACED => Ending::Replaced,
        other => Ending::Lost(other.to_string()),
    }
}

pub(super) fn close_with(conn: &quinn::Connection, code: quinn::VarInt, reason: &str) {
    let mut end = reason.len().min(CLOSE_REASON_BYTES_MAX);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    conn.close(code, &reason.as_bytes()[..end]);
}

fn into_bytes(payload: Payload) -> Bytes {
    match <[Bytes; 1]>::try_from(payload.segments) {
        Ok([one]) => one,
        Err(segments) => Bytes::from(segments.concat()),
    }
}

/// Delivers the peer's messages as events until the connection ends; closes it if the peer broke the
/// protocol or said goodbye, and returns how it ended.
pub(super) async fn read_messages(
    link: &Link,
    mut stream: quinn::RecvStream,
    limits: FrameLimits,
    emit: impl Fn(ControlEvent),
) -> Ending {
    let mut next_seq = 0u64;
    let violation = loop {
        let (tag, payload) = match read_message(&mut stream, limits).await {
            Ok(ReadOutcome::Data { tag, payload }) => (tag, payload),
            Ok(ReadOutcome::Control { kind: FrameKind::Control, message: ControlMessage::Goodbye { .. } }) => {
                link.conn.close(CLOSE_GOODBYE, b"goodbye");
                return Ending::Goodbye;
            }
            Ok(ReadOutcome::Control { message, .. }) => {
                break WireError::Protocol(format!("unexpected control message {message:?}"))
            }
            Ok(ReadOutcome::End) => break WireError::Protocol("stream ended without a goodbye".into()),
            Err(WireError::Stream(reason)) => match link.conn.close_reason() {
                Some(err) => return ending_of(&err),
                None => break WireError::Stream(reason),
            },
            Err(e) => break e,
        };
        if tag.group != CONTROL_GROUP || tag.step != 0 || tag.seq != next_seq {
            break WireError::Protocol(format!("expected control message seq {next_seq}, got {tag:?}"));
        }
        next_seq += 1;
        emit(ControlEvent::Message {
            from: link.name.clone(),
            role: link.role,
            epoch: tag.epoch,
            body: into_bytes(payload),
        });
    };
    tracing::warn!(peer = %link.name, reason = %violation, "closing control connection");
    let reason = violation.to_string();
    close_with(&link.conn, CLOSE_PROTOCOL, &reason);
    Ending::Lost(format!("closed by us: {reason}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn closed_by_peer(code: quinn::VarInt) -> ConnectionError {
        ConnectionError::ApplicationClosed(quinn::ApplicationClose { error_code: code, reason: Bytes::from("why") })
    }

    #[test]
    fn only_a_goodbye_is_a_departure() {
        let check = |err: ConnectionError, expected: Ending| assert_eq!(ending_of(&err), expected, "{err:?}");
        check(closed_by_peer(CLOSE_GOODBYE), Ending::Goodbye);
        check(closed_by_peer(CLOSE_REPLACED), Ending::Replaced);
        check(closed_by_peer(CLOSE_PROTOCOL), Ending::Lost("closed by peer: why (code 1)".into()));
        check(closed_by_peer(super::super::CLOSE_DROPPED), Ending::Lost("closed by peer: why (code 3)".into()));
        check(ConnectionError::TimedOut, Ending::Lost("timed out".into()));
        check(ConnectionError::Reset, Ending::Lost("reset by peer".into()));
    }

    #[test]
    fn payload_segments_join() {
        let one = Payload { segments: vec![Bytes::from_static(b"abc")] };
        assert_eq!(into_bytes(one), Bytes::from_static(b"abc"));
        let two = Payload { segments: vec![Bytes::from_static(b"ab"), Bytes::from_static(b"cd")] };
        assert_eq!(into_bytes(two), Bytes::from_static(b"abcd"));
        assert_eq!(into_bytes(Payload::default()), Bytes::new());
    }
}

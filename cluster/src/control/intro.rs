//! The introduction: each side's first frame on its outgoing stream names the sender and its role;
//! the receiver checks the name against the certificate the sender presented in the TLS handshake.
//! The dialer speaks first; the acceptor answers only once it has admitted the dialer.

use std::time::Duration;

use rustls::pki_types::CertificateDer;

use super::PeerRole;
use crate::identity::verify_peer_name;
use crate::transport::quic::peer_certificates;
use crate::transport::{frame_control, read_message, FrameLimits, ReadOutcome};
use crate::wire::{ControlMessage, FrameKind};

/// Longest excerpt of an unexpected first message quoted in a refusal.
const QUOTED_CHARS_MAX: usize = 200;

/// A verified peer and the two streams of the connection.
pub(super) struct Introduced {
    pub name: String,
    pub role: PeerRole,
    pub outgoing: quinn::SendStream,
    pub incoming: quinn::RecvStream,
}

/// Who we are, and how long the peer has to introduce itself.
#[derive(Clone, Copy)]
pub(super) struct Us<'a> {
    pub name: &'a str,
    pub role: PeerRole,
    pub limits: FrameLimits,
    pub timeout_ms: u64,
}

/// Runs the introduction on a freshly established connection. `Err` is the reason to refuse it.
pub(super) async fn introduce(conn: &quinn::Connection, us: Us<'_>, dialer: bool) -> Result<Introduced, String> {
    let certs = peer_certificates(conn).ok_or("peer presented no certificate")?;
    let speak = async {
        let ours = frame_control(FrameKind::Hello, &ControlMessage::Introduce { node: us.name.into(), role: us.role });
        let mut stream = conn.open_uni().await.map_err(|e| format!("opening our stream: {e}"))?;
        stream.write_all(&ours).await.map_err(|e| format!("sending our introduction: {e}"))?;
        Ok::<_, String>(stream)
    };
    if dialer {
        let outgoing = speak.await?;
        let (name, role, incoming) = listen(conn, &certs, us).await?;
        Ok(Introduced { name, role, outgoing, incoming })
    } else {
        let (name, role, incoming) = listen(conn, &certs, us).await?;
        let outgoing = speak.await?;
        Ok(Introduced { name, role, outgoing, incoming })
    }
}

async fn listen(
    conn: &quinn::Connection,
    certs: &[CertificateDer<'static>],
    us: Us<'_>,
) -> Result<(String, PeerRole, quinn::RecvStream), String> {
    let first = async {
        let mut stream = conn.accept_uni().await.map_err(|e| format!("no introduction: {e}"))?;
        let outcome = read_message(&mut stream, us.limits).await.map_err(|e| format!("bad introduction frame: {e}"))?;
        Ok::<_, String>((stream, outcome))
    };
    let (stream, outcome) = tokio::time::timeout(Duration::from_millis(us.timeout_ms), first)
        .await
        .map_err(|_| format!("no introduction within connect_timeout_ms = {}", us.timeout_ms))??;
    let (name, role) = check_introduction(outcome, certs, (us.name, us.role))?;
    Ok((name, role, stream))
}

/// The peer's verified name and role, from its first message and its certificate chain.
pub(super) fn check_introduction(
    first: ReadOutcome,
    certs: &[CertificateDer<'static>],
    (own_name, own_role): (&str, PeerRole),
) -> Result<(String, PeerRole), String> {
    let (node, role) = match first {
        ReadOutcome::Control { kind: FrameKind::Hello, message: ControlMessage::Introduce { node, role } } => {
            (node, role)
        }
        ReadOutcome::Control { kind, message } => {
            let quoted: String = format!("{kind:?} {message:?}").chars().take(QUOTED_CHARS_MAX).collect();
            return Err(format!("first message is not an introduction: {quoted}"));
        }
        ReadOutcome::Data { tag, .. } => return Err(format!("first message is data ({tag:?}), not an introduction")),
        ReadOutcome::End => return Err("stream ended before any introduction".into()),
    };
    // A client may present its own daemon's certificate; a node never connects to itself.
    if node == own_name && role == PeerRole::Node && own_role == PeerRole::Node {
        return Err(format!("peer introduces itself as node {node:?}, our own name"));
    }
    verify_peer_name(certs, &node)?;
    Ok((node, role))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::{add_node, init_cluster, NodeIdentity};
    use crate::wire::Tag;

    fn introduce_as(node: &str, role: PeerRole) -> ReadOutcome {
        ReadOutcome::Control { kind: FrameKind::Hello, message: ControlMessage::Introduce { node: node.into(), role } }
    }

    #[test]
    fn the_claim_must_match_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        init_cluster(dir.path()).unwrap();
        add_node("node-b", dir.path()).unwrap();
        let certs = vec![NodeIdentity::load(dir.path(), "node-b").unwrap().cert];
        let check = |first, own: &str| check_introduction(first, &certs, (own, PeerRole::Node));

        assert_eq!(check(introduce_as("node-b", PeerRole::Node), "node-a"), Ok(("node-b".into(), PeerRole::Node)));
        assert_eq!(check(introduce_as("node-b", PeerRole::Client), "node-b"), Ok(("node-b".into(), PeerRole::Client)));
        let from_own_client =
            check_introduction(introduce_as("node-b", PeerRole::Node), &certs, ("node-b", PeerRole::Client));
        assert_eq!(from_own_client, Ok(("node-b".into(), PeerRole::Node)));
        let goodbye = ReadOutcome::Control { kind: FrameKind::Control, message: ControlMessage::Goodbye { rank: 0 } };
        let data = ReadOutcome::Data { tag: Tag::default(), payload: Default::default() };
        let refused = [
            (introduce_as("node-c", PeerRole::Node), "node-a", "is not for \"node-c\""),
            (introduce_as("node-b", PeerRole::Node), "node-b", "our own name"),
            (goodbye, "node-a", "Goodbye"),
            (data, "node-a", "first message is data"),
            (ReadOutcome::End, "node-a", "ended"),
        ];
        for (first, own, expected) in refused {
            let reason = check(first, own).expect_err(expected);
            assert!(reason.contains(expected), "{reason:?} should mention {expected:?}");
        }
        assert!(check_introduction(introduce_as("node-b", PeerRole::Node), &[], ("node-a", PeerRole::Node)).is_err());
    }
}

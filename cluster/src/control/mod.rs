//! The control plane: messages between daemons, and between a command-line client and a daemon, over
//! mutually-authenticated QUIC. Unlike [`crate::transport::quic::QuicTransport`] (a fixed roster of
//! ranks), peers come and go: any holder of a certificate from the cluster CA may dial in, and a peer
//! is known by the node name in its certificate.
//!
//! # Semantics
//!
//! - **Identity.** The TLS handshake requires a certificate chaining to the cluster CA on both sides.
//!   The dialer does not know whom it dials, so it accepts any name in the acceptor's certificate
//!   ([`verify`]); then each side's first frame is a [`Introduce`](crate::wire::ControlMessage::Introduce) naming the sender,
//!   and the receiver checks that name against the certificate. The acceptor reads the dialer's
//!   introduction before it sends its own, so [`ControlEndpoint::connect`] returning `Ok` means the
//!   acceptor admitted us. A missing, foreign or mismatched certificate, or no introduction within
//!   `connect_timeout_ms`, is refused: closed with [`CLOSE_PROTOCOL`], logged, and recorded in
//!   [`ControlEndpoint::refusals`]. The endpoint keeps serving everyone else.
//! - **Ordering.** Each side writes all its messages to one long-lived unidirectional stream per
//!   connection, so messages to one peer arrive in the order they were sent (FIFO per peer), each
//!   exactly once, numbered by the frame header's `seq` (a gap is a protocol violation). Nothing is
//!   ordered across peers. `send` returns once QUIC owns the message, not once it is delivered; it
//!   waits while the peer's flow-control window is full.
//! - **Events.** For each connection: one [`ControlEvent::Connected`], then its messages, then at
//!   most one of [`ControlEvent::Departed`] (the peer said goodbye) or [`ControlEvent::Lost`]
//!   (anything else: crash, idle timeout, a malformed frame either way). Ends we chose
//!   ([`ControlEndpoint::disconnect`], [`ControlEndpoint::close`], replacement) emit nothing locally.
//! - **Replacement.** A newer connection with the same peer name replaces the older one (a restarted
//!   daemon dialing again); the older one is closed with [`CLOSE_REPLACED`] and emits no event, on
//!   either side. Clients are not replaced: a node endpoint names each client connection
//!   `<certificate name>#<n>` (unique for the endpoint's life) in its events and [`ControlEndpoint::send`],
//!   so two commands under one certificate each keep their own connection and replies. Limitation: two nodes dialing each other at the same moment may each keep the
//!   connection the other replaced; both then see `Lost` within `connect_timeout_ms`. Let one side
//!   dial (e.g. the joiner dials the seed).
//! - **Goodbye.** Saying goodbye writes [`Goodbye`](crate::wire::ControlMessage::Goodbye) (its `rank` is unused: 0) after
//!   the last message and waits (at most `connect_timeout_ms`) for the peer to read everything and
//!   close the connection with [`CLOSE_GOODBYE`]; then closes it too.
//! - **Limits.** Messages are framed like the data plane's (`frame_bytes_max`,
//!   `message_frames_max`, CRC-checked headers). The event channel is unbounded: the owner must keep
//!   draining it. Dropping the last handle without [`ControlEndpoint::close`] closes every connection
//!   with [`CLOSE_DROPPED`]: peers see `Lost`.
//! - **Process death.** Each node-to-node connection has a companion TLS-over-TCP connection
//!   (`control/companion.rs`): when a peer process dies, its kernel closes that socket, and the connection is
//!   reported `Lost` within milliseconds (closed with [`CLOSE_PROCESS_GONE`]) instead of after
//!   `idle_timeout_ms` or the heartbeat detector's silence. [`ControlEndpoint::watches_process`] says
//!   whether a connection has one. Client connections have none.
//!
//! Everything here must run inside a tokio runtime.

mod companion;
mod endpoint;
mod intro;
mod link;
mod serve;
mod shared;
mod table;
pub mod verify;

use std::net::SocketAddr;

use bytes::Bytes;
use quinn::VarInt;

pub use crate::transport::quic::{Refusal, CLOSE_GOODBYE, CLOSE_PROTOCOL};
pub use crate::wire::PeerRole;
pub use endpoint::ControlEndpoint;

/// The frame header `group` of control-plane messages (collectives use small group ids).
pub const CONTROL_GROUP: u32 = u32::MAX;
/// Application close code: this connection was replaced by a newer one to the same peer.
pub const CLOSE_REPLACED: VarInt = VarInt::from_u32(2);
/// Application close code: the endpoint was dropped without `close()` (its peers see `Lost`).
pub const CLOSE_DROPPED: VarInt = VarInt::from_u32(3);

/// Application close code: the peer's process is gone (its companion TCP connection ended without
/// `close_notify`); both sides see `Lost`.
pub const CLOSE_PROCESS_GONE: VarInt = VarInt::from_u32(4);

/// What a [`ControlEndpoint`] reports, in order per connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ControlEvent {
    /// A message from `from` (the name verified against its certificate). `epoch` is the sender's
    /// membership epoch (frame header epoch).
    Message { from: String, role: PeerRole, epoch: u64, body: Bytes },
    /// A peer was admitted (dialed by us or dialing in).
    Connected { peer: String, role: PeerRole, addr: SocketAddr },
    /// Connection failed without a goodbye (crash, idle timeout, protocol violation).
    Lost { peer: String, reason: String },
    /// The peer closed gracefully (sent Goodbye / closed with the goodbye code).
    Departed { peer: String },
}

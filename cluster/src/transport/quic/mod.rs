//! Mutually-authenticated QUIC (quinn + rustls/ring). One connection per pair of ranks; one
//! unidirectional stream per message, so many messages — the slices of a large collective — flow
//! concurrently under per-stream flow control.

mod connection;
mod endpoint;
mod gso;
mod listener;
mod mesh;
mod refusal;

pub use connection::{peer_certificates, serve_connection, CLOSE_GOODBYE, CLOSE_PROTOCOL};
pub use endpoint::{bind_endpoint, quinn_transport_config};
pub use listener::QuicListener;
pub use mesh::{PeerInfo, QuicTransport};
pub use refusal::{Refusal, RefusalLog, REFUSALS_KEPT_MAX};

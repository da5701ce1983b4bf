//! troupe-cluster: everything that crosses a process boundary — identity and certificates, the wire
//! protocol, the QUIC and same-host transports, and the collectives.
//!
//! Invariant: this crate never depends on tch/libtorch. Collective plans ([`collective::plan`]) and the
//! frame codec ([`wire`]) are sans-IO: no tokio, no sockets, no clocks.

pub mod bench;
pub mod collective;
pub mod config;
pub mod control;
pub mod error;
pub mod identity;
pub mod membership;
pub mod nccl;
pub mod netns;
pub mod transport;
pub mod wire;

pub use config::TransportConfig;
pub use error::ClusterError;
pub use identity::{add_node, init_cluster, NodeIdentity};
